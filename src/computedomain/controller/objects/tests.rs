use super::*;
use crate::computedomain::api::{ChannelSpec, ComputeDomainSpec, TemplateRef};
use serde_json::json;

fn domain(mode: Option<AllocationMode>) -> ComputeDomain {
    let mut cd = ComputeDomain::new(
        "team-a",
        "imex-channel-injection",
        ComputeDomainSpec {
            num_nodes: 2,
            channel: Some(ChannelSpec {
                resource_claim_template: TemplateRef {
                    name: "imex-channel-0".into(),
                },
                allocation_mode: mode,
                other: Default::default(),
            }),
            other: Default::default(),
        },
    );
    cd.metadata.uid = Some("7f3c".into());
    cd
}

fn settings() -> Settings {
    Settings {
        namespace: "nvdra".into(),
        image: "registry.example/nvdra:1.2".into(),
        daemon_service_account: "nvdra-compute-domain-daemon".into(),
        image_pull_secrets: vec!["regcred".into()],
        max_nodes_per_imex_domain: 18,
        clique_daemon_driver_root: "/run/nvidia/driver".into(),
    }
}

/// NVIDIA's `compute-domain-workload-claim-template.tmpl.yaml`, rendered for the domain.
#[test]
fn the_workload_template_is_nvidias() {
    let t = workload_template(&domain(None)).unwrap();
    assert_eq!(
        serde_json::to_value(&t).unwrap(),
        json!({
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaimTemplate",
            "metadata": {
                "namespace": "team-a",
                "name": "imex-channel-0",
                "finalizers": ["resource.nvidia.com/computeDomain"],
                "labels": {
                    "resource.nvidia.com/computeDomain": "7f3c",
                    "resource.nvidia.com/computeDomainTarget": "Workload",
                },
            },
            "spec": {"spec": {"devices": {
                "requests": [{"name": "channel", "exactly": {
                    "deviceClassName": "compute-domain-default-channel.nvidia.com"}}],
                "config": [{"requests": ["channel"], "opaque": {
                    "driver": "compute-domain.nvidia.com",
                    "parameters": {
                        "apiVersion": "resource.nvidia.com/v1beta1",
                        "kind": "ComputeDomainChannelConfig",
                        "domainID": "7f3c",
                        "allocationMode": "Single",
                    }}}],
            }}},
        })
    );
    // The mode is the domain's.
    let all = workload_template(&domain(Some(AllocationMode::All))).unwrap();
    let v = serde_json::to_value(&all).unwrap();
    assert_eq!(
        v["spec"]["spec"]["devices"]["config"][0]["opaque"]["parameters"]["allocationMode"],
        "All"
    );
    // The plugin reads the parameters as the channel config.
    let p = &v["spec"]["spec"]["devices"]["config"][0]["opaque"]["parameters"];
    let config: crate::computedomain::api::ChannelConfig =
        serde_json::from_value(p.clone()).unwrap();
    assert_eq!(config.domain_id, "7f3c");
    // Without a UID (not read from the API server) nothing is made.
    let mut no_uid = domain(None);
    no_uid.metadata.uid = None;
    assert!(workload_template(&no_uid).is_none());
}

/// NVIDIA's `compute-domain-daemon-claim-template.tmpl.yaml` and `compute-domain-daemon.tmpl.yaml`.
#[test]
fn the_daemon_template_and_daemonset_are_nvidias_running_nvdra() {
    let t = daemon_template("7f3c", &settings());
    let v = serde_json::to_value(&t).unwrap();
    assert_eq!(v["metadata"]["name"], "computedomain-daemon-7f3c");
    assert_eq!(v["metadata"]["namespace"], "nvdra");
    assert_eq!(
        v["metadata"]["labels"],
        json!({"resource.nvidia.com/computeDomain": "7f3c",
               "resource.nvidia.com/computeDomainTarget": "Daemon"})
    );
    assert_eq!(
        v["spec"]["spec"]["devices"],
        json!({
            "requests": [{"name": "daemon", "exactly": {
                "deviceClassName": "compute-domain-daemon.nvidia.com"}}],
            "config": [{"requests": ["daemon"], "opaque": {
                "driver": "compute-domain.nvidia.com",
                "parameters": {"apiVersion": "resource.nvidia.com/v1beta1",
                               "kind": "ComputeDomainDaemonConfig", "domainID": "7f3c"}}}],
        })
    );

    let ds = serde_json::to_value(daemon_set("7f3c", &settings())).unwrap();
    assert_eq!(ds["metadata"]["name"], "computedomain-daemon-7f3c");
    assert_eq!(ds["metadata"]["namespace"], "nvdra");
    assert_eq!(
        ds["metadata"]["finalizers"],
        json!(["resource.nvidia.com/computeDomain"])
    );
    let label = json!({"resource.nvidia.com/computeDomain": "7f3c"});
    assert_eq!(ds["metadata"]["labels"], label);
    assert_eq!(ds["spec"]["selector"]["matchLabels"], label);
    let pod = &ds["spec"]["template"];
    assert_eq!(pod["metadata"]["labels"], label);
    assert_eq!(pod["spec"]["nodeSelector"], label);
    assert_eq!(
        pod["spec"]["serviceAccountName"],
        "nvdra-compute-domain-daemon"
    );
    assert_eq!(
        pod["spec"]["imagePullSecrets"],
        json!([{"name": "regcred"}])
    );
    assert_eq!(
        pod["spec"]["resourceClaims"],
        json!([{"name": "compute-domain-daemon",
                "resourceClaimTemplateName": "computedomain-daemon-7f3c"}])
    );
    let c = &pod["spec"]["containers"][0];
    assert_eq!(c["image"], "registry.example/nvdra:1.2");
    assert_eq!(c["command"], json!(["nvdra", "compute-domain", "daemon"]));
    assert_eq!(
        c["resources"]["claims"],
        json!([{"name": "compute-domain-daemon"}])
    );
    let env: BTreeMap<String, serde_json::Value> = c["env"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e["name"].as_str().unwrap().to_string(), e.clone()))
        .collect();
    assert_eq!(env["MAX_NODES_PER_IMEX_DOMAIN"]["value"], "18");
    assert_eq!(
        env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"],
        "spec.nodeName"
    );
    assert_eq!(
        env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"],
        "status.podIP"
    );
    assert_eq!(env["NVIDIA_VISIBLE_DEVICES"]["value"], "void");
    assert_downward_api(&env);
    // Every taint tolerated, as NVIDIA's (a daemon must run where its workload runs).
    assert_eq!(
        pod["spec"]["tolerations"],
        json!([{"operator": "Exists", "effect": "NoSchedule"},
               {"operator": "Exists", "effect": "NoExecute"},
               {"operator": "Exists", "effect": "PreferNoSchedule"}])
    );
}

fn env_of(container: &serde_json::Value) -> BTreeMap<String, serde_json::Value> {
    container["env"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e["name"].as_str().unwrap().to_string(), e.clone()))
        .collect()
}

/// What the daemon reads of its own pod through the downward API (NVIDIA's daemon's env): its
/// node, address and pod, which it patches with its reason and peers.
fn assert_downward_api(env: &BTreeMap<String, serde_json::Value>) {
    for (key, path) in [
        ("NODE_NAME", "spec.nodeName"),
        ("POD_IP", "status.podIP"),
        ("POD_UID", "metadata.uid"),
        ("POD_NAME", "metadata.name"),
        ("POD_NAMESPACE", "metadata.namespace"),
    ] {
        assert_eq!(
            env.get(key)
                .map(|e| &e["valueFrom"]["fieldRef"]["fieldPath"]),
            Some(&json!(path)),
            "{key}"
        );
    }
}

#[test]
fn a_cliques_daemon_set_runs_the_per_clique_daemon_on_the_cliques_nodes() {
    let clique = "6f1c2d3e-0000-4000-8000-00000000abcd.7";
    let ds = serde_json::to_value(clique_daemon_set(clique, &settings())).unwrap();
    assert_eq!(
        ds["metadata"]["name"],
        "computedomain-daemon-fabric.6f1c2d3e-0000-4000-8000-00000000abcd.7"
    );
    assert_eq!(ds["metadata"]["namespace"], "nvdra");
    // No domain's label and no finalizer: the domains' cleanup never touches it.
    let label = json!({"compute-domain.nvidia.com/clique": clique});
    assert_eq!(ds["metadata"]["labels"], label);
    assert!(ds["metadata"].get("finalizers").is_none());
    assert_eq!(ds["spec"]["selector"]["matchLabels"], label);
    let pod = &ds["spec"]["template"];
    assert_eq!(pod["metadata"]["labels"], label);
    assert_eq!(
        pod["spec"]["nodeSelector"],
        json!({"nvidia.com/gpu.clique": clique})
    );
    assert_eq!(
        pod["spec"]["serviceAccountName"],
        "nvdra-compute-domain-daemon"
    );
    assert_eq!(
        pod["spec"]["imagePullSecrets"],
        json!([{"name": "regcred"}])
    );
    assert!(pod["spec"].get("resourceClaims").is_none());
    let c = &pod["spec"]["containers"][0];
    assert_eq!(c["image"], "registry.example/nvdra:1.2");
    assert_eq!(
        c["command"],
        json!(["nvdra", "compute-domain", "daemon", "--per-clique"])
    );
    assert_eq!(c["securityContext"], json!({"privileged": true}));
    let env = env_of(c);
    assert_downward_api(&env);
    for (key, value) in [
        ("CLIQUE_ID", clique),
        ("MAX_NODES_PER_IMEX_DOMAIN", "18"),
        ("NVIDIA_VISIBLE_DEVICES", "void"),
        ("NVIDIA_DRIVER_ROOT", "/driver-root"),
        ("NVDRA_CD_IMEX", "/driver-root/usr/bin/nvidia-imex"),
        ("NVDRA_CD_IMEX_CTL", "/driver-root/usr/bin/nvidia-imex-ctl"),
        ("NVDRA_CD_CONFIG_DIR", "/imexd"),
    ] {
        assert_eq!(env[key]["value"], value, "{key}");
    }
    assert_eq!(
        pod["spec"]["volumes"],
        json!([
            {"name": "driver-root", "hostPath": {"path": "/run/nvidia/driver", "type": "Directory"}},
            {"name": "imexd", "emptyDir": {}},
            {"name": "imex-state", "hostPath": {"path": "/var/lib/nvdra/compute-domain/imex",
                                                "type": "DirectoryOrCreate"}},
        ])
    );
    assert_eq!(
        c["volumeMounts"],
        json!([
            {"name": "driver-root", "mountPath": "/driver-root", "readOnly": true},
            {"name": "imexd", "mountPath": "/imexd"},
            {"name": "imex-state", "mountPath": "/var/run/nvidia-imex"},
        ])
    );
    assert_eq!(
        pod["spec"]["tolerations"],
        json!([{"operator": "Exists", "effect": "NoSchedule"},
               {"operator": "Exists", "effect": "NoExecute"},
               {"operator": "Exists", "effect": "PreferNoSchedule"}])
    );
}

#[test]
fn a_cliques_daemon_set_carries_a_digest_of_what_was_rendered() {
    let digest = |s: &Settings| {
        clique_daemon_set("c.1", s)
            .metadata
            .annotations
            .unwrap()
            .remove(CLIQUE_DAEMON_DIGEST)
            .unwrap()
    };
    let a = digest(&settings());
    assert_eq!(a.len(), 16);
    assert_eq!(
        digest(&settings()),
        a,
        "the same rendering, the same digest"
    );
    let mut other = settings();
    other.image = "registry.example/nvdra:1.3".into();
    assert_ne!(digest(&other), a, "a new image is a new digest");
}

#[test]
fn a_clique_domain_is_one_claim_of_the_clique_channel_class() {
    let mut cd = domain(Some(AllocationMode::All));
    assert_eq!(channel_mode(&cd), Ok(ChannelMode::PerNode));
    cd.metadata.annotations = Some(BTreeMap::from([(
        CHANNELS_ANNOTATION.to_string(),
        "clique".to_string(),
    )]));
    assert_eq!(channel_mode(&cd), Ok(ChannelMode::Clique));
    let claim = clique_claim(&cd).unwrap();
    let v = serde_json::to_value(&claim).unwrap();
    assert_eq!(v["metadata"]["namespace"], "team-a");
    assert_eq!(v["metadata"]["name"], "imex-channel-0");
    assert_eq!(
        v["metadata"]["labels"]["resource.nvidia.com/computeDomain"],
        "7f3c"
    );
    assert_eq!(
        v["spec"]["devices"]["requests"],
        json!([{"name": "channel", "exactly": {
            "deviceClassName": "compute-domain-channel.nvidia.com"}}])
    );
    // One channel whatever the domain asked: the pool's channel is the domain's isolation.
    assert_eq!(
        v["spec"]["devices"]["config"][0]["opaque"]["parameters"],
        json!({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "ComputeDomainChannelConfig",
               "domainID": "7f3c", "allocationMode": "Single"})
    );

    cd.metadata
        .annotations
        .as_mut()
        .unwrap()
        .insert(CHANNELS_ANNOTATION.into(), "rack".into());
    let err = channel_mode(&cd).unwrap_err();
    assert!(
        err.contains("\"rack\"") && err.contains(CHANNELS_ANNOTATION),
        "{err}"
    );
}
