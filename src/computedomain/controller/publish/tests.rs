use super::*;

fn settings(image: &str) -> Settings {
    Settings {
        namespace: "nvdra".into(),
        image: image.into(),
        daemon_service_account: "nvdra-compute-domain-daemon".into(),
        image_pull_secrets: Vec::new(),
        max_nodes_per_imex_domain: 18,
        clique_daemon_driver_root: "/".into(),
    }
}

fn names(v: &[DaemonSet]) -> Vec<String> {
    v.iter().map(ResourceExt::name_any).collect()
}

#[test]
fn each_clique_gets_one_daemon_set_and_a_gone_clique_loses_it() {
    let s = settings("nvdra:1");
    let cliques: BTreeSet<String> = ["c.1", "c.2"].map(String::from).into();
    let plan = daemon_plan(&s, &cliques, &[]);
    assert_eq!(
        names(&plan.creates),
        [
            "computedomain-daemon-fabric.c.1",
            "computedomain-daemon-fabric.c.2"
        ]
    );
    assert!(plan.updates.is_empty() && plan.deletes.is_empty());

    // As stored: c.1 as rendered now, c.3's clique gone.
    let mut stored = objects::clique_daemon_set("c.1", &s);
    stored.metadata.resource_version = Some("5".into());
    let existing = [stored, objects::clique_daemon_set("c.3", &s)];
    let plan = daemon_plan(&s, &cliques, &existing);
    assert_eq!(names(&plan.creates), ["computedomain-daemon-fabric.c.2"]);
    assert!(plan.updates.is_empty(), "c.1 is as rendered");
    assert_eq!(plan.deletes, ["computedomain-daemon-fabric.c.3"]);

    // A new image: c.1 is replaced, at the stored version.
    let plan = daemon_plan(&settings("nvdra:2"), &cliques, &existing);
    assert_eq!(names(&plan.updates), ["computedomain-daemon-fabric.c.1"]);
    assert_eq!(
        plan.updates[0].metadata.resource_version.as_deref(),
        Some("5")
    );

    // No cliques (or no channels): every one goes.
    let plan = daemon_plan(&s, &BTreeSet::new(), &existing);
    assert_eq!(plan.deletes.len(), 2);
    assert!(plan.creates.is_empty());
}
