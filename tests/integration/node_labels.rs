//! `--node-labels`: gpu-feature-discovery's labels on the Node, through the real `KubeApi` on the
//! test API server (JSON merge patches) and on the directory API.

use crate::support;

use std::sync::Arc;
use std::time::Duration;

use nvdra::api::ClusterApi;
use nvdra::api::kube::KubeApi;
use nvdra::daemon::labels;
use nvdra::deviceplugin::Options;
use nvdra::inventory::sim::SimBackend;
use support::apiserver::TestApiServer;
use tokio_util::sync::CancellationToken;

const NODE: &str = "node-a";

fn label(n: &k8s_openapi::api::core::v1::Node, k: &str) -> Option<String> {
    n.metadata.labels.as_ref().and_then(|l| l.get(k).cloned())
}

/// Waits until the Node satisfies `pred`.
async fn wait_node(
    api: &TestApiServer,
    what: &str,
    pred: impl Fn(&k8s_openapi::api::core::v1::Node) -> bool,
) {
    let what = format!("the node to be {what}");
    support::wait::eventually(&what, || api.node(NODE).is_some_and(|n| pred(&n))).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn labels_are_set_in_one_patch_kept_current_and_others_left_alone() {
    let server = TestApiServer::start().await;
    server.seed_node(NODE, "uid-1");
    // A label of someone else, and a stale one of ours from an earlier run.
    server.set_node_label(NODE, "team", "ml");
    server.set_node_label(NODE, "nvidia.com/mig.strategy", "mixed");
    let sim = SimBackend::from_profile("dgx-h100", NODE).unwrap();
    let api: Arc<dyn ClusterApi> = Arc::new(KubeApi::from_url(server.url()).unwrap());
    let stop = CancellationToken::new();
    let owner = nvdra::testing::start_owner(
        Arc::new(sim.clone()),
        Duration::from_millis(20),
        nvdra::testing::no_health(),
        stop.clone(),
    )
    .await
    .unwrap();
    let task = tokio::spawn(labels::run(
        api,
        owner.subscribe(),
        Options::default(),
        NODE.into(),
        Duration::from_millis(20),
        stop.clone(),
    ));

    wait_node(&server, "got gpu.product", |n| {
        label(n, "nvidia.com/gpu.product").is_some()
    })
    .await;
    let n = server.node(NODE).unwrap();
    assert_eq!(
        label(&n, "nvidia.com/gpu.product").as_deref(),
        Some("NVIDIA-H100-80GB-HBM3")
    );
    assert_eq!(label(&n, "nvidia.com/gpu.count").as_deref(), Some("8"));
    assert_eq!(label(&n, "nvidia.com/gpu.memory").as_deref(), Some("81920"));
    assert_eq!(
        label(&n, "nvidia.com/gpu.family").as_deref(),
        Some("hopper")
    );
    assert_eq!(
        label(&n, "nvidia.com/mig.strategy"),
        None,
        "stale owned label removed"
    );
    assert_eq!(
        label(&n, "team").as_deref(),
        Some("ml"),
        "foreign label kept"
    );
    assert_eq!(server.node_patches(), 1, "everything in one patch");

    // A GPU falls off the bus: one more patch, with the new count.
    sim.update(|inv| {
        inv.gpus.pop();
    });
    wait_node(&server, "counted 7 GPUs", |n| {
        label(n, "nvidia.com/gpu.count").as_deref() == Some("7")
    })
    .await;
    assert_eq!(server.node_patches(), 2);
    stop.cancel();
    task.await.unwrap();
}

#[tokio::test]
async fn the_directory_api_keeps_the_labels_in_the_node_file() {
    let dir = tempfile::tempdir().unwrap();
    let api: Arc<dyn ClusterApi> = Arc::new(nvdra::api::dir::DirApi::new(dir.path()).unwrap());
    let sim = SimBackend::from_profile("a100-mig-mixed", NODE).unwrap();
    let stop = CancellationToken::new();
    let owner = nvdra::testing::start_owner(
        Arc::new(sim),
        Duration::from_millis(20),
        nvdra::testing::no_health(),
        stop.clone(),
    )
    .await
    .unwrap();
    let task = tokio::spawn(labels::run(
        api.clone(),
        owner.subscribe(),
        Options::default(),
        NODE.into(),
        Duration::from_millis(20),
        stop.clone(),
    ));
    let path = dir.path().join(format!("nodes/{NODE}.yaml"));
    for _ in 0..2000 {
        if path.exists() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    stop.cancel();
    task.await.unwrap();
    let node = api.get_node(NODE).await.unwrap();
    assert_eq!(
        label(&node, "nvidia.com/mig.capable").as_deref(),
        Some("true")
    );
    assert_eq!(
        label(&node, "nvidia.com/gpu.family").as_deref(),
        Some("ampere")
    );
}

/// `nvdra run --node-labels` labels its node (here in the directory API) as it starts.
#[test]
fn nvdra_run_with_node_labels_labels_the_node() {
    let dir = tempfile::tempdir().unwrap();
    let p = |s: &str| dir.path().join(s);
    let mut child = support::daemon::nvdra_run(dir.path(), "dra", NODE)
        .args(["--node-labels", "--profile", "l40s-pcie"])
        .spawn()
        .unwrap();
    let node = p(&format!("api/nodes/{NODE}.yaml"));
    let mut text = String::new();
    for _ in 0..2000 {
        text = std::fs::read_to_string(&node).unwrap_or_default();
        if text.contains("nvidia.com/gpu.count") {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let _ = child.kill();
    let _ = child.wait();
    assert!(
        text.contains("nvidia.com/gpu.count: '4'") || text.contains("nvidia.com/gpu.count: \"4\""),
        "{text}"
    );
    assert!(
        text.contains("nvidia.com/gpu.family: ada-lovelace"),
        "{text}"
    );
}
