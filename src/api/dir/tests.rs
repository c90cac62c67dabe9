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
    api.delete_slice(created.metadata.name.as_deref().unwrap())
        .await
        .unwrap();
    assert!(matches!(
        api.replace_slice(&updated).await,
        Err(Error::NotFound(_))
    ));
    assert!(matches!(
        api.delete_slice(created.metadata.name.as_deref().unwrap())
            .await,
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
        api.delete_slice("../../etc/passwd").await,
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
