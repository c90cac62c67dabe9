//! `--mode auto` against the test API server (through the real `KubeApi`): DRA where the server
//! serves `resource.k8s.io/v1`, the device plugin only for the resource names no DeviceClass
//! maps via `spec.extendedResourceName` (re-decided when DeviceClasses change), and everything
//! through the device plugin where DRA is absent. What is served is read from the sockets the
//! daemon binds: one per device-plugin resource, and the DRA socket.

use crate::support;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use k8s_openapi::api::resource::v1::{DeviceClass, DeviceClassSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use nvdra::api::kube::KubeApi;
use nvdra::config::{self, Settings};
use nvdra::inventory::sim::SimBackend;
use support::apiserver::TestApiServer;
use tokio_util::sync::CancellationToken;

const NODE: &str = "node-a";
const DRIVER: &str = "gpu.nvidia.com";

struct TestNode {
    dir: tempfile::TempDir,
    api: TestApiServer,
    stop: CancellationToken,
    daemon: tokio::task::JoinHandle<nvdra::daemon::Result<()>>,
}

fn class(name: &str, extended: &str) -> DeviceClass {
    DeviceClass {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..Default::default()
        },
        spec: DeviceClassSpec {
            extended_resource_name: Some(extended.into()),
            ..Default::default()
        },
    }
}

/// Waits until `path` exists (`true`) or is gone (`false`).
async fn wait_until(path: &Path, exists: bool) {
    let what = format!(
        "{} to {}",
        path.display(),
        if exists { "appear" } else { "go away" }
    );
    support::wait::eventually(&what, || path.exists() == exists).await
}

/// Starts `nvdra run --mode auto` on a100-mig-mixed with `migStrategy: mixed` (so the device
/// plugin has several resource names) after `setup` prepared the API server.
async fn start(setup: impl FnOnce(&TestApiServer)) -> TestNode {
    let dir = tempfile::tempdir().unwrap();
    let p = |s: &str| dir.path().join(s);
    std::fs::write(p("boot_id"), "boot-1\n").unwrap();
    std::fs::write(p("dp.yaml"), "version: v1\nflags:\n  migStrategy: mixed\n").unwrap();
    let mut settings = Settings::default();
    settings.serve.mode = Some(config::Mode::Auto);
    settings.daemon.metrics_address = Some("127.0.0.1:0".into());
    settings.serve.device_plugin_config = Some(p("dp.yaml"));
    settings.backend.profile = Some("a100-mig-mixed".into());
    settings.backend.node_name = Some(NODE.into());
    settings.backend.driver_root = Some(p("driver"));
    settings.kubelet.kubelet_root = Some(p("kubelet"));
    settings.kubelet.cdi_root = Some(p("cdi"));
    let config = config::resolve(settings, None).unwrap();
    let api = TestApiServer::start().await;
    setup(&api);
    let stop = CancellationToken::new();
    let daemon = tokio::spawn(nvdra::daemon::run(
        config,
        nvdra::daemon::Extras {
            boot_id_file: Some(p("boot_id")),
            ..Default::default()
        },
        Arc::new(SimBackend::from_profile("a100-mig-mixed", NODE).unwrap()),
        Arc::new(KubeApi::from_url(api.url()).unwrap()),
        stop.clone(),
    ));
    TestNode {
        dir,
        api,
        stop,
        daemon,
    }
}

impl TestNode {
    fn dp(&self, short: &str) -> PathBuf {
        self.dir
            .path()
            .join(format!("kubelet/device-plugins/nvidia-{short}.sock"))
    }

    fn dra(&self) -> PathBuf {
        self.dir
            .path()
            .join(format!("kubelet/plugins/{DRIVER}/dra.sock"))
    }

    async fn shutdown(self) {
        self.stop.cancel();
        self.daemon.await.unwrap().unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mapped_name_is_left_to_dra_and_the_others_stay_with_the_device_plugin() {
    let node = start(|api| api.set_device_class(class("gpu-legacy", "nvidia.com/gpu"))).await;
    wait_until(&node.dra(), true).await;
    // The servers of all resources start in one pass: once one MIG resource is served, the
    // mapped nvidia.com/gpu would be too, were it served.
    wait_until(&node.dp("mig-1g.10gb"), true).await;
    assert!(
        !node.dp("gpu").exists(),
        "nvidia.com/gpu is mapped by a DeviceClass and must not be registered"
    );
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_mapping_class_both_paths_serve_and_a_new_class_re_decides() {
    let node = start(|_| {}).await;
    wait_until(&node.dra(), true).await;
    wait_until(&node.dp("gpu"), true).await;
    wait_until(&node.dp("mig-1g.10gb"), true).await;

    // A DeviceClass now maps nvidia.com/gpu: the device plugin withdraws it, keeps the rest.
    node.api
        .set_device_class(class("gpu-legacy", "nvidia.com/gpu"));
    wait_until(&node.dp("gpu"), false).await;
    assert!(node.dp("mig-1g.10gb").exists());
    assert!(node.dra().exists());

    // Deleted again: the device plugin serves nvidia.com/gpu again.
    assert!(node.api.delete_device_class("gpu-legacy"));
    wait_until(&node.dp("gpu"), true).await;
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_dra_on_the_server_the_device_plugin_serves_every_name() {
    let node = start(|api| {
        api.set_dra_absent();
        api.set_device_class(class("gpu-legacy", "nvidia.com/gpu"));
    })
    .await;
    wait_until(&node.dp("gpu"), true).await;
    wait_until(&node.dp("mig-1g.10gb"), true).await;
    // device-plugin mode starts no DRA socket at all (it is decided before anything is bound).
    assert!(!node.dra().exists());
    assert!(
        !node
            .dir
            .path()
            .join("kubelet/plugins_registry")
            .join(format!("{DRIVER}-reg.sock"))
            .exists()
    );
    node.shutdown().await;
}
