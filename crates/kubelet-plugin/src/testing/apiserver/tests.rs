//! The generic store (objects.rs) through a peer we did not write: `kube::Client`, its `Api<T>`
//! verbs, kube-runtime's watcher, finalizer helper and event recorder, and kube's discovery.

use super::ApiServer;
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, ObjectReference, Pod};
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceClaimTemplate};
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use kube::core::{ApiResource, GroupVersionKind};
use kube::runtime::watcher;
use serde_json::{Value, json};
use std::time::Duration;

fn domains(client: &kube::Client, ns: &str) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk("resource.nvidia.com", "v1beta1", "ComputeDomain");
    let ar = ApiResource::from_gvk_with_plural(&gvk, "computedomains");
    Api::namespaced_with(client.clone(), ns, &ar)
}

fn domain(name: &str, labels: Value) -> DynamicObject {
    serde_json::from_value(json!({
        "apiVersion": "resource.nvidia.com/v1beta1", "kind": "ComputeDomain",
        "metadata": {"name": name, "labels": labels},
        "spec": {"numNodes": 4, "channel": {"resourceClaimTemplate": {"name": format!("{name}-ch")}}},
        "status": {"status": "Ready"},
    }))
    .expect("a domain")
}

fn code(e: kube::Error) -> (u16, String) {
    match e {
        kube::Error::Api(s) => (s.code, s.reason),
        other => panic!("want an API error, got {other}"),
    }
}

#[tokio::test]
async fn create_get_update_conflict_and_generate_name() {
    let server = ApiServer::start().await;
    let client = server.client().unwrap();
    let api = domains(&client, "team-a");
    let made = api
        .create(&PostParams::default(), &domain("d1", json!({})))
        .await
        .unwrap();
    let meta = &made.metadata;
    assert_eq!(meta.namespace.as_deref(), Some("team-a"));
    assert_eq!(
        meta.uid.as_ref().map(String::len),
        Some(36),
        "a UUID: {meta:?}"
    );
    assert!(meta.creation_timestamp.is_some() && meta.resource_version.is_some());
    assert_eq!(meta.generation, Some(1));
    // The status subresource: a create drops status.
    assert!(made.data.get("status").is_none(), "{made:?}");

    let again = api
        .create(&PostParams::default(), &domain("d1", json!({})))
        .await;
    assert_eq!(code(again.unwrap_err()), (409, "AlreadyExists".into()));

    let mut gen_named = domain("", json!({}));
    gen_named.metadata.name = None;
    gen_named.metadata.generate_name = Some("cd-".into());
    let g = api
        .create(&PostParams::default(), &gen_named)
        .await
        .unwrap();
    let name = g.metadata.name.unwrap();
    assert!(name.starts_with("cd-") && name.len() == 8, "{name}");

    // An update with the stored resourceVersion goes; one with an older one is a 409 Conflict.
    let mut cur = api.get("d1").await.unwrap();
    cur.data["spec"]["numNodes"] = json!(5);
    let stale = cur.clone();
    let updated = api
        .replace("d1", &PostParams::default(), &cur)
        .await
        .unwrap();
    assert_eq!(
        updated.metadata.generation,
        Some(2),
        "a spec change bumps the generation"
    );
    assert_ne!(
        updated.metadata.resource_version,
        stale.metadata.resource_version
    );
    let err = api
        .replace("d1", &PostParams::default(), &stale)
        .await
        .unwrap_err();
    assert_eq!(code(err), (409, "Conflict".into()));
    // Both 409s (the existing name, the stale update) are counted; the 404 below is not.
    assert_eq!(server.counts().conflicts, 2);
    let err = api.get("nope").await.unwrap_err();
    assert_eq!(code(err), (404, "NotFound".into()));

    // A no-op update stores nothing.
    let same = api
        .replace("d1", &PostParams::default(), &updated)
        .await
        .unwrap();
    assert_eq!(
        same.metadata.resource_version,
        updated.metadata.resource_version
    );

    // Namespaced: not in another namespace, all of them across namespaces.
    assert!(
        domains(&client, "team-b")
            .get_opt("d1")
            .await
            .unwrap()
            .is_none()
    );
    let all: Api<DynamicObject> = Api::all_with(
        client.clone(),
        &ApiResource::from_gvk_with_plural(
            &GroupVersionKind::gvk("resource.nvidia.com", "v1beta1", "ComputeDomain"),
            "computedomains",
        ),
    );
    assert_eq!(
        all.list(&ListParams::default()).await.unwrap().items.len(),
        2
    );
    // The handle sees what HTTP wrote.
    let stored = server
        .object(
            "resource.nvidia.com/v1beta1",
            "computedomains",
            "team-a",
            "d1",
        )
        .unwrap();
    assert_eq!(stored["spec"]["numNodes"], 5);
}

#[tokio::test]
async fn status_is_written_only_through_its_subresource() {
    let server = ApiServer::start().await;
    let client = server.client().unwrap();
    let api = domains(&client, "ns");
    api.create(&PostParams::default(), &domain("d", json!({})))
        .await
        .unwrap();
    let pp = PatchParams::default();
    // The status subresource writes status and nothing else.
    let patch = json!({"spec": {"numNodes": 9}, "status": {"status": "Ready", "nodes": []}});
    let after = api
        .patch_status("d", &pp, &Patch::Merge(&patch))
        .await
        .unwrap();
    assert_eq!(after.data["status"]["status"], "Ready");
    assert_eq!(after.data["spec"]["numNodes"], 4);
    assert_eq!(
        after.metadata.generation,
        Some(1),
        "a status write keeps the generation"
    );
    // The main resource keeps the stored status.
    let patch = json!({"metadata": {"labels": {"a": "b"}}, "status": {"status": "NotReady"}});
    let after = api.patch("d", &pp, &Patch::Merge(&patch)).await.unwrap();
    assert_eq!(after.data["status"]["status"], "Ready");
    assert_eq!(after.metadata.labels.as_ref().unwrap()["a"], "b");
    assert_eq!(
        after.metadata.generation,
        Some(1),
        "a metadata change keeps the generation"
    );
    // A kind without the subresource has no /status.
    let leases: Api<Lease> = Api::namespaced(client.clone(), "ns");
    let err = leases.get_status("x").await.unwrap_err();
    assert_eq!(code(err).0, 404);
}

#[tokio::test]
async fn patches_merge_strategic_json_and_apply() {
    let server = ApiServer::start().await;
    server.seed_node("node-0", "uid-node-0");
    let client = server.client().unwrap();
    let nodes: Api<Node> = Api::all(client.clone());
    // The labels a plugin sets and removes (merge), and taints (strategic merge, as JSON merge:
    // the list is replaced whole).
    let set =
        json!({"metadata": {"labels": {"resource.nvidia.com/computeDomain": "u1", "x": "y"}}});
    nodes
        .patch("node-0", &PatchParams::default(), &Patch::Merge(&set))
        .await
        .unwrap();
    let unset = json!({"metadata": {"labels": {"x": null}}});
    nodes
        .patch("node-0", &PatchParams::default(), &Patch::Strategic(&unset))
        .await
        .unwrap();
    let taint = json!({"spec": {"taints": [{"key": "k", "effect": "NoSchedule"}]}});
    nodes
        .patch("node-0", &PatchParams::default(), &Patch::Strategic(&taint))
        .await
        .unwrap();
    let node = server.node("node-0").unwrap();
    let labels = node.metadata.labels.clone().unwrap();
    assert_eq!(
        labels
            .get("resource.nvidia.com/computeDomain")
            .map(String::as_str),
        Some("u1")
    );
    assert!(!labels.contains_key("x"));
    assert_eq!(node.spec.unwrap().taints.unwrap()[0].key, "k");
    assert_eq!(server.node_patches(), 3);

    // Server-side apply: needs a field manager (kube always sends one), creates a missing
    // object, merges the given fields into an existing one.
    let leases: Api<Lease> = Api::namespaced(client.clone(), "nvdra");
    let ssa = PatchParams::apply("nvdra-test").force();
    let lease = json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                       "metadata": {"name": "l"}, "spec": {"holderIdentity": "a", "leaseDurationSeconds": 15}});
    let made = leases
        .patch("l", &ssa, &Patch::Apply(&lease))
        .await
        .unwrap();
    assert_eq!(
        made.spec.as_ref().unwrap().holder_identity.as_deref(),
        Some("a")
    );
    let lease = json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                       "metadata": {"name": "l"}, "spec": {"holderIdentity": "b"}});
    let after = leases
        .patch("l", &ssa, &Patch::Apply(&lease))
        .await
        .unwrap();
    let spec = after.spec.unwrap();
    assert_eq!(spec.holder_identity.as_deref(), Some("b"));
    assert_eq!(spec.lease_duration_seconds, Some(15));

    // JSON patch, with a test op that fails as kube-runtime's finalizer helper relies on.
    let ops: json_patch::Patch = serde_json::from_value(json!([
        {"op": "test", "path": "/spec/holderIdentity", "value": "b"},
        {"op": "replace", "path": "/spec/holderIdentity", "value": "c"},
    ]))
    .unwrap();
    leases
        .patch(
            "l",
            &PatchParams::default(),
            &Patch::Json::<()>(ops.clone()),
        )
        .await
        .unwrap();
    let err = leases
        .patch("l", &PatchParams::default(), &Patch::Json::<()>(ops))
        .await
        .unwrap_err();
    assert_eq!(code(err).0, 422);
    // A merge patch naming an older resourceVersion is a conflict.
    let stale = json!({"metadata": {"resourceVersion": made.metadata.resource_version}, "spec": {"holderIdentity": "d"}});
    let err = leases
        .patch("l", &PatchParams::default(), &Patch::Merge(&stale))
        .await
        .unwrap_err();
    assert_eq!(code(err), (409, "Conflict".into()));
}

#[tokio::test]
async fn finalizers_hold_a_delete_and_owners_take_their_objects_along() {
    let server = ApiServer::start().await;
    let client = server.client().unwrap();
    let api = domains(&client, "ns");
    let mut d = domain("d", json!({}));
    d.metadata.finalizers = Some(vec!["resource.nvidia.com/computeDomain".into()]);
    let d = api.create(&PostParams::default(), &d).await.unwrap();
    let owner = json!([{"apiVersion": "resource.nvidia.com/v1beta1", "kind": "ComputeDomain",
                        "name": "d", "uid": d.metadata.uid, "controller": true}]);
    let ds: DaemonSet = serde_json::from_value(json!({
        "metadata": {"name": "d-ds", "ownerReferences": owner},
        "spec": {"selector": {"matchLabels": {"a": "b"}},
                 "template": {"metadata": {"labels": {"a": "b"}}, "spec": {"containers": []}}},
    }))
    .unwrap();
    let dss: Api<DaemonSet> = Api::namespaced(client.clone(), "ns");
    dss.create(&PostParams::default(), &ds).await.unwrap();
    let templates: Api<ResourceClaimTemplate> = Api::namespaced(client.clone(), "ns");
    let t: ResourceClaimTemplate = serde_json::from_value(json!({
        "metadata": {"name": "d-ch", "ownerReferences": owner},
        "spec": {"spec": {"devices": {"requests": []}}},
    }))
    .unwrap();
    templates.create(&PostParams::default(), &t).await.unwrap();

    // Marked, not gone, while a finalizer is left; its dependents stay too.
    api.delete("d", &DeleteParams::default()).await.unwrap();
    let marked = api.get("d").await.unwrap();
    assert!(marked.metadata.deletion_timestamp.is_some());
    assert!(dss.get_opt("d-ds").await.unwrap().is_some());
    // kube-runtime's finalizer helper removes it with a JSON patch (test + remove); then it
    // goes, and the garbage collector's part: what it owned.
    let ops: json_patch::Patch = serde_json::from_value(json!([
        {"op": "test", "path": "/metadata/finalizers", "value": ["resource.nvidia.com/computeDomain"]},
        {"op": "remove", "path": "/metadata/finalizers/0"},
    ]))
    .unwrap();
    api.patch("d", &PatchParams::default(), &Patch::Json::<()>(ops))
        .await
        .unwrap();
    assert!(api.get_opt("d").await.unwrap().is_none());
    assert!(dss.get_opt("d-ds").await.unwrap().is_none());
    assert!(templates.get_opt("d-ch").await.unwrap().is_none());

    // Preconditions: a wrong UID is a conflict.
    dss.create(&PostParams::default(), &ds).await.unwrap();
    let dp = DeleteParams {
        preconditions: Some(kube::api::Preconditions {
            uid: Some("other".into()),
            resource_version: None,
        }),
        ..Default::default()
    };
    assert_eq!(code(dss.delete("d-ds", &dp).await.unwrap_err()).0, 409);
    dss.delete("d-ds", &DeleteParams::default()).await.unwrap();
    assert!(dss.get_opt("d-ds").await.unwrap().is_none());
}

#[tokio::test]
async fn selectors_in_lists() {
    let server = ApiServer::start().await;
    let client = server.client().unwrap();
    let pods: Api<Pod> = Api::namespaced(client.clone(), "ns");
    for (name, labels, node) in [
        ("p0", json!({"app": "imex", "clique": "1"}), "node-0"),
        ("p1", json!({"app": "imex", "clique": "2"}), "node-1"),
        ("p2", json!({"app": "other"}), "node-0"),
    ] {
        let p: Pod = serde_json::from_value(json!({
            "metadata": {"name": name, "labels": labels}, "spec": {"nodeName": node, "containers": []},
        }))
        .unwrap();
        pods.create(&PostParams::default(), &p).await.unwrap();
    }
    let names = async |lp: ListParams| -> Vec<String> {
        let mut n: Vec<String> = pods
            .list(&lp)
            .await
            .unwrap()
            .items
            .into_iter()
            .map(|p| p.metadata.name.unwrap())
            .collect();
        n.sort();
        n
    };
    assert_eq!(
        names(ListParams::default().labels("app=imex")).await,
        ["p0", "p1"]
    );
    assert_eq!(
        names(ListParams::default().labels("app!=imex")).await,
        ["p2"]
    );
    assert_eq!(
        names(ListParams::default().labels("clique in (2,3)")).await,
        ["p1"]
    );
    assert_eq!(
        names(ListParams::default().labels("clique notin (2),app")).await,
        ["p0", "p2"]
    );
    assert_eq!(
        names(ListParams::default().labels("clique")).await,
        ["p0", "p1"]
    );
    assert_eq!(names(ListParams::default().labels("!clique")).await, ["p2"]);
    assert_eq!(
        names(ListParams::default().fields("metadata.name=p1")).await,
        ["p1"]
    );
    assert_eq!(
        names(ListParams::default().fields("spec.nodeName=node-0")).await,
        ["p0", "p2"]
    );
    assert_eq!(
        names(ListParams::default().fields("metadata.namespace=ns,metadata.name!=p0")).await,
        ["p1", "p2"]
    );
}

#[tokio::test]
async fn kube_runtime_watchers_see_adds_changes_and_deletes() {
    let server = ApiServer::start().await;
    let client = server.client().unwrap();
    let api = domains(&client, "ns");
    api.create(&PostParams::default(), &domain("before", json!({"w": "1"})))
        .await
        .unwrap();
    for config in [
        watcher::Config::default().labels("w=1"),
        watcher::Config::default().labels("w=1").streaming_lists(),
        watcher::Config::default().labels("w=1").disable_bookmarks(),
    ] {
        let mut events = watcher(api.clone(), config.clone()).boxed();
        let mut next = async || -> String {
            let e = tokio::time::timeout(Duration::from_secs(10), events.try_next())
                .await
                .expect("a watch event in time")
                .expect("no watch error")
                .expect("the watch goes on");
            match e {
                watcher::Event::Init => "init".into(),
                watcher::Event::InitApply(o) => format!("init {}", o.metadata.name.unwrap()),
                watcher::Event::InitDone => "done".into(),
                watcher::Event::Apply(o) => format!("apply {}", o.metadata.name.unwrap()),
                watcher::Event::Delete(o) => format!("delete {}", o.metadata.name.unwrap()),
            }
        };
        assert_eq!(next().await, "init", "{config:?}");
        let mut initial = vec![next().await];
        while initial.last().map(String::as_str) != Some("done") {
            initial.push(next().await);
        }
        assert!(initial.contains(&"init before".to_string()), "{initial:?}");
        let name = format!("d{}", rand::random::<u32>());
        api.create(&PostParams::default(), &domain(&name, json!({"w": "1"})))
            .await
            .unwrap();
        assert_eq!(next().await, format!("apply {name}"));
        // Out of the selector: a delete; back in: an apply; unmatched changes: nothing.
        let relabel = |v: &str| json!({"metadata": {"labels": {"w": v}}});
        let pp = PatchParams::default();
        api.patch(&name, &pp, &Patch::Merge(&relabel("2")))
            .await
            .unwrap();
        assert_eq!(next().await, format!("delete {name}"));
        api.patch(&name, &pp, &Patch::Merge(&relabel("3")))
            .await
            .unwrap();
        api.patch(&name, &pp, &Patch::Merge(&relabel("1")))
            .await
            .unwrap();
        assert_eq!(next().await, format!("apply {name}"));
        api.delete(&name, &DeleteParams::default()).await.unwrap();
        assert_eq!(next().await, format!("delete {name}"));
    }
}

#[tokio::test]
async fn watches_replay_from_a_resource_version_and_expire_when_compacted() {
    let server = ApiServer::start().await;
    let client = server.client().unwrap();
    let api = domains(&client, "ns");
    let first = api
        .create(&PostParams::default(), &domain("a", json!({})))
        .await
        .unwrap();
    api.create(&PostParams::default(), &domain("b", json!({})))
        .await
        .unwrap();
    let rv = first.metadata.resource_version.unwrap();
    let wp = kube::api::WatchParams::default();
    let mut stream = api.watch(&wp, &rv).await.unwrap().boxed();
    match stream.try_next().await.unwrap().unwrap() {
        kube::api::WatchEvent::Added(o) => assert_eq!(o.metadata.name.as_deref(), Some("b")),
        _ => panic!("want b added"),
    }
    server.compact();
    let mut stream = api.watch(&wp, &rv).await.unwrap().boxed();
    match stream.try_next().await.unwrap().unwrap() {
        kube::api::WatchEvent::Error(e) => assert_eq!(e.code, 410),
        _ => panic!("want 410 Gone"),
    }
}

#[tokio::test]
async fn events_leases_claims_and_discovery() {
    let server = ApiServer::start().await;
    let client = server.client().unwrap();
    // kube-runtime's recorder writes events.k8s.io/v1 Events.
    let recorder = kube::runtime::events::Recorder::new(
        client.clone(),
        kube::runtime::events::Reporter {
            controller: "nvdra".into(),
            instance: None,
        },
    );
    let reference = ObjectReference {
        api_version: Some("resource.nvidia.com/v1beta1".into()),
        kind: Some("ComputeDomain".into()),
        name: Some("d".into()),
        namespace: Some("ns".into()),
        ..Default::default()
    };
    let ev = kube::runtime::events::Event {
        type_: kube::runtime::events::EventType::Warning,
        reason: "DaemonNotReady".into(),
        note: Some("node-3".into()),
        action: "Reconcile".into(),
        secondary: None,
    };
    recorder.publish(&ev, &reference).await.unwrap();
    let events = server.objects("events.k8s.io/v1", "events");
    assert_eq!(events.len(), 1);
    assert_eq!(events[0]["reason"], "DaemonNotReady");

    // A claim created over HTTP is read by the typed accessor; its status goes through /status.
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), "ns");
    let c: ResourceClaim = serde_json::from_value(json!({
        "metadata": {"name": "c"}, "spec": {"devices": {"requests": []}},
    }))
    .unwrap();
    claims.create(&PostParams::default(), &c).await.unwrap();
    let status =
        json!({"status": {"reservedFor": [{"resource": "pods", "name": "p", "uid": "u"}]}});
    claims
        .patch_status("c", &PatchParams::default(), &Patch::Merge(&status))
        .await
        .unwrap();
    let held = server.claim("ns", "c").unwrap();
    assert_eq!(held.status.unwrap().reserved_for.unwrap()[0].name, "p");

    // Discovery finds the generic kinds and the typed ones.
    let discovery = kube::Discovery::new(client.clone()).run().await.unwrap();
    let gvk = GroupVersionKind::gvk("resource.nvidia.com", "v1beta1", "ComputeDomain");
    let (ar, caps) = discovery
        .resolve_gvk(&gvk)
        .expect("ComputeDomain discovered");
    assert_eq!(ar.plural, "computedomains");
    assert!(
        caps.subresources
            .iter()
            .any(|(s, _)| s.plural == "computedomains/status" || s.plural == "status")
    );
    for (g, k) in [
        ("apps", "DaemonSet"),
        ("coordination.k8s.io", "Lease"),
        ("", "Pod"),
        ("resource.k8s.io", "ResourceSlice"),
    ] {
        assert!(
            discovery
                .resolve_gvk(&GroupVersionKind::gvk(g, "v1", k))
                .is_some(),
            "{g} {k}"
        );
    }
    // Unknown resources are not served.
    let other: Api<DynamicObject> = Api::all_with(
        client,
        &ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk("x.io", "v1", "X"), "xs"),
    );
    assert_eq!(
        code(other.list(&ListParams::default()).await.unwrap_err()).0,
        404
    );
}
