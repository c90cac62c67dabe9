//! Directory API tests: slice writes and conflicts, generated names, claims and nodes read, the
//! watch.

use super::*;
use k8s_openapi::api::resource::v1::{Device, ResourcePool, ResourceSliceSpec};
use kube::api::ObjectMeta;

fn slice(driver: &str, node: &str, devices: &[&str]) -> ResourceSlice {
    ResourceSlice {
        metadata: ObjectMeta {
            generate_name: Some(format!("{node}-{driver}-")),
            ..Default::default()
        },
        spec: ResourceSliceSpec {
            driver: driver.into(),
            node_name: Some(node.into()),
            pool: ResourcePool {
                name: node.into(),
                generation: 1,
                resource_slice_count: 1,
            },
            devices: Some(
                devices
                    .iter()
                    .map(|d| Device {
                        name: d.to_string(),
                        ..Default::default()
                    })
                    .collect(),
            ),
            ..Default::default()
        },
    }
}

#[tokio::test]
async fn create_generates_a_name_and_list_filters_by_driver_and_node() {
    let dir = tempfile::tempdir().unwrap();
    let api = DirApi::new(dir.path()).unwrap();
    let a = api
        .create_slice(&slice("gpu.nvidia.com", "n1", &["gpu-0"]))
        .await
        .unwrap();
    api.create_slice(&slice("other.example.com", "n1", &["x"]))
        .await
        .unwrap();
    api.create_slice(&slice("gpu.nvidia.com", "n2", &["y"]))
        .await
        .unwrap();
    let name = a.metadata.name.clone().unwrap();
    let suffix = name.strip_prefix("n1-gpu.nvidia.com-").unwrap();
    assert_eq!(suffix.len(), 5, "{name}");
    assert!(suffix.bytes().all(|b| NAME_ALPHABET.contains(&b)), "{name}");
    assert!(
        dir.path()
            .join(format!("resourceslices/{name}.yaml"))
            .exists()
    );
    let listed = api.list_slices("gpu.nvidia.com", "n1").await.unwrap();
    assert_eq!(listed, vec![a]);
    let hidden: Vec<_> = std::fs::read_dir(api.slices_dir())
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with('.'))
        .collect();
    assert!(hidden.is_empty(), "temp files left behind: {hidden:?}");
}

#[tokio::test]
async fn replace_checks_the_resource_version() {
    let dir = tempfile::tempdir().unwrap();
    let api = DirApi::new(dir.path()).unwrap();
    let created = api
        .create_slice(&slice("d.example.com", "n1", &["a"]))
        .await
        .unwrap();
    let mut edit = created.clone();
    edit.spec.pool.generation = 2;
    let updated = api.replace_slice(&edit).await.unwrap();
    let (rv1, rv2) = (
        created.metadata.resource_version.clone().unwrap(),
        updated.metadata.resource_version.clone().unwrap(),
    );
    assert!(rv2.parse::<u64>().unwrap() > rv1.parse::<u64>().unwrap());
    assert_eq!(updated.metadata.generation, Some(2));
    // `edit` still carries the old resourceVersion: a stale update.
    assert!(matches!(
        api.replace_slice(&edit).await,
        Err(Error::Conflict(_))
    ));
    // A delete with the preconditions of the stale copy leaves the slice; with the current ones,
    // deletes it.
    let name = created.metadata.name.as_deref().unwrap();
    let held = |s: &ResourceSlice| Preconditions {
        uid: s.metadata.uid.clone(),
        resource_version: s.metadata.resource_version.clone(),
    };
    assert!(matches!(
        api.delete_slice(name, &held(&created)).await,
        Err(Error::Conflict(_))
    ));
    api.delete_slice(name, &held(&updated)).await.unwrap();
    assert!(matches!(
        api.replace_slice(&updated).await,
        Err(Error::NotFound(_))
    ));
    assert!(matches!(
        api.delete_slice(name, &Preconditions::default()).await,
        Err(Error::NotFound(_))
    ));
}

#[tokio::test]
async fn names_that_are_not_dns_subdomains_are_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let api = DirApi::new(dir.path()).unwrap();
    let mut s = slice("d.example.com", "n1", &["a"]);
    s.metadata.name = Some("../escape".into());
    assert!(matches!(api.create_slice(&s).await, Err(Error::Invalid(_))));
    assert!(matches!(
        api.delete_slice("../../etc/passwd", &Preconditions::default())
            .await,
        Err(Error::Invalid(_))
    ));
}

#[tokio::test]
async fn unparseable_yaml_names_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let api = DirApi::new(dir.path()).unwrap();
    let bad = api.slices_dir().join("broken.yaml");
    std::fs::write(&bad, "spec: [not, a, spec]\n").unwrap();
    let err = api.list_slices("d", "n").await.unwrap_err().to_string();
    assert!(err.contains("broken.yaml"), "{err}");
    assert!(err.contains("spec"), "{err}");
}

#[tokio::test]
async fn causes_are_sources_said_once_not_part_of_the_message() {
    let dir = tempfile::tempdir().unwrap();
    let api = DirApi::new(dir.path()).unwrap();
    std::fs::write(
        api.slices_dir().join("broken.yaml"),
        "spec: [not, a, spec]\n",
    )
    .unwrap();
    let e = api.list_slices("d", "n").await.unwrap_err();
    let Error::Invalid(f) = &e else {
        panic!("{e:?}")
    };
    let cause = f.cause.as_deref().expect("the YAML error is kept");
    assert!(
        cause.downcast_ref::<crate::yaml::ParseError>().is_some(),
        "{cause:?}"
    );
    let said = cause.to_string();
    assert!(!e.to_string().contains(&said), "{e}");
    let chain = crate::report::chain(&e).to_string();
    assert_eq!(chain.matches(&said).count(), 1, "{chain}");

    // An I/O failure keeps the io::Error and its kind.
    let blocked = tempfile::tempdir().unwrap();
    std::fs::write(
        blocked.path().join("resourceslices"),
        "a file, not a directory",
    )
    .unwrap();
    let Err(e) = DirApi::new(blocked.path()) else {
        panic!("a file where the slices directory goes must fail")
    };
    let source = std::error::Error::source(&e).expect("a source");
    let io = source
        .downcast_ref::<std::io::Error>()
        .expect("an io::Error");
    assert_eq!(io.kind(), std::io::ErrorKind::AlreadyExists);
    assert!(e.to_string().contains("check --api-dir"), "{e}");
}

#[tokio::test]
async fn claims_and_nodes_are_read_from_their_directories() {
    let dir = tempfile::tempdir().unwrap();
    let api = DirApi::new(dir.path()).unwrap();
    assert!(matches!(api.get_node("n1").await, Err(Error::NotFound(_))));
    std::fs::create_dir_all(dir.path().join("nodes")).unwrap();
    std::fs::write(
        dir.path().join("nodes/n1.yaml"),
        "apiVersion: v1\nkind: Node\nmetadata:\n  name: n1\n  uid: 1234\n",
    )
    .unwrap();
    let node = api.get_node("n1").await.unwrap();
    assert_eq!(node.metadata.uid.as_deref(), Some("1234"));

    std::fs::create_dir_all(dir.path().join("resourceclaims/ns1")).unwrap();
    std::fs::write(
        dir.path().join("resourceclaims/ns1/c1.yaml"),
        "apiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata:\n  name: c1\n  \
         namespace: ns1\n  uid: u-1\nspec:\n  devices: {}\n",
    )
    .unwrap();
    let claim = api.get_claim("ns1", "c1").await.unwrap();
    assert_eq!(claim.metadata.uid.as_deref(), Some("u-1"));
    let missing = api.get_claim("ns1", "nope").await.unwrap_err().to_string();
    assert!(missing.contains("ns1/nope"), "{missing}");
}

#[tokio::test]
async fn watch_reports_external_edits_and_deletes_of_our_slices_only() {
    let dir = tempfile::tempdir().unwrap();
    let api = DirApi::new(dir.path()).unwrap();
    let ours = api
        .create_slice(&slice("d.example.com", "n1", &["a"]))
        .await
        .unwrap();
    let name = ours.metadata.name.clone().unwrap();
    let mut watch = api.watch_slices("d.example.com", "n1");
    assert_eq!(watch.next().await.unwrap().unwrap(), SliceEvent::Restarted);

    // Someone else's slice: no event. Then a hand edit of ours that keeps the
    // resourceVersion (a longer file), then a delete.
    api.create_slice(&slice("other.example.com", "n1", &["x"]))
        .await
        .unwrap();
    let path = api.slices_dir().join(format!("{name}.yaml"));
    let mut text = std::fs::read_to_string(&path).unwrap();
    text.push_str("# edited by hand\n");
    std::fs::write(&path, text).unwrap();
    assert_eq!(
        watch.next().await.unwrap().unwrap(),
        SliceEvent::Applied(name.clone())
    );
    std::fs::remove_file(&path).unwrap();
    assert_eq!(
        watch.next().await.unwrap().unwrap(),
        SliceEvent::Deleted(name.clone())
    );
}

#[test]
fn diff_reports_new_changed_and_removed_files() {
    let stamp = |len, ours| FileStamp {
        modified: None,
        len,
        inode: 1,
        ours,
    };
    let prev = BTreeMap::from([
        ("kept".to_string(), stamp(1, true)),
        ("changed".to_string(), stamp(1, true)),
        ("gone".to_string(), stamp(1, true)),
        ("foreign".to_string(), stamp(1, false)),
    ]);
    let next = BTreeMap::from([
        ("kept".to_string(), stamp(1, true)),
        ("changed".to_string(), stamp(2, true)),
        ("new".to_string(), stamp(1, true)),
        ("foreign".to_string(), stamp(5, false)),
    ]);
    assert_eq!(
        diff(&prev, &next),
        vec![
            SliceEvent::Applied("changed".into()),
            SliceEvent::Applied("new".into()),
            SliceEvent::Deleted("gone".into()),
        ]
    );
}

/// The test peers' deadline ([`wait::SOON`]) and wait helper.
#[path = "../../../crates/kubelet-plugin/tests/support/wait.rs"]
mod wait;

/// The library's publisher over the directory API (moved here from the end-to-end tests of the
/// publisher, which are the library's own now): the first publish, a deleted file restored, and
/// no writes while nothing changes.
mod publishing {
    use super::super::DirApi;
    use super::wait::{SOON, eventually};
    use crate::api::SliceApi;
    use k8s_openapi::api::resource::v1::{Device, ResourceSlice};
    use kubelet_plugin::publisher::{Options, Publisher, Resources, Slice};
    use std::collections::BTreeSet;
    use std::sync::Arc;
    use std::time::Duration;

    const DRIVER: &str = "gpu.nvidia.com";
    const NODE: &str = "node-a";

    /// Two slices: gpu-0..3 and gpu-4..7.
    fn two_slices() -> Resources {
        let slices = (0..2)
            .map(|s| Slice {
                devices: (0..4)
                    .map(|i| Device {
                        name: format!("gpu-{}", s * 4 + i),
                        ..Default::default()
                    })
                    .collect(),
                ..Default::default()
            })
            .collect();
        Resources::node_local(NODE, slices)
    }

    /// `n` slices of one generation that hold gpu-0..7.
    fn complete(slices: &[ResourceSlice], n: usize) -> bool {
        let generations: BTreeSet<i64> = slices.iter().map(|s| s.spec.pool.generation).collect();
        let names: BTreeSet<String> = slices
            .iter()
            .flat_map(|s| s.spec.devices.iter().flatten().map(|d| d.name.clone()))
            .collect();
        slices.len() == n
            && generations.len() == 1
            && slices
                .iter()
                .all(|s| s.spec.pool.resource_slice_count == n as i64)
            && names == (0..8).map(|i| format!("gpu-{i}")).collect()
    }

    #[tokio::test]
    async fn dir_api_first_publish_and_external_changes() {
        let dir = tempfile::tempdir().unwrap();
        let api = DirApi::new(dir.path()).unwrap();
        let fast = Options {
            settle: Duration::from_millis(20),
            backoff_base: Duration::from_millis(20),
            backoff_cap: Duration::from_millis(200),
            conflict_retries: 5,
            ..Options::default()
        };
        let (publisher, handle) =
            Publisher::with_options(Arc::new(api.clone()), DRIVER, NODE, fast);
        let token = kubelet_plugin::CancellationToken::new();
        let task = tokio::spawn(publisher.run(token.clone()));
        let publish = || async {
            let seq = handle
                .set_desired(two_slices())
                .expect("specs for our node");
            tokio::time::timeout(SOON, handle.wait_synced(seq))
                .await
                .unwrap_or_else(|_| panic!("not published: {:?}", handle.status().borrow()));
        };
        publish().await;

        let read = || api.list_slices(DRIVER, NODE);
        let slices = read().await.unwrap();
        assert!(complete(&slices, 2), "{slices:#?}");
        assert!(slices.iter().all(|s| s.metadata.owner_references.is_none()));

        // Someone removes a file: it is restored (how fast: `benches/publish.rs`).
        let victim = slices[0].metadata.name.clone().unwrap();
        std::fs::remove_file(api.slices_dir().join(format!("{victim}.yaml"))).unwrap();
        let restored = tokio::time::timeout(SOON, async {
            loop {
                let now = read().await.unwrap();
                if complete(&now, 2) {
                    return now;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
        .expect("the deleted slice file is restored");
        assert!(restored.iter().all(|s| s.spec.pool.generation == 2));

        // Quiet: the files stay as they are. Once the repair is counted, reconciles that re-read
        // every file (the same desired state set again, twice) write nothing.
        eventually("the repair to be counted", || {
            let c = handle.counters();
            (c.creates, c.updates) == (3, 1)
        })
        .await;
        let c = handle.counters();
        publish().await;
        publish().await;
        let after = handle.counters();
        assert!(
            after.reconciles >= c.reconciles + 2,
            "it did look: {after:?}"
        );
        assert_eq!(after.writes(), c.writes());
        token.cancel();
        tokio::time::timeout(SOON, task)
            .await
            .expect("the publisher stops promptly on shutdown")
            .expect("the publisher task does not panic");
    }
}
