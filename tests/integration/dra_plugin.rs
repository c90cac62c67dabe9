//! The DRA kubelet plugin end to end, with a kubelet stand-in: real tonic clients over the Unix
//! sockets `nvdra::daemon::run` creates in a temp dir, a simulated backend, and the test API
//! server reached through the real `KubeApi` client.

use crate::support;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use k8s_openapi::api::resource::v1::{
    DeviceAllocationConfiguration, DeviceRequestAllocationResult, OpaqueDeviceConfiguration,
    ResourceClaim,
};
use k8s_openapi::apimachinery::pkg::runtime::RawExtension;
use kubelet_plugin::proto::dra::{v1, v1beta1};
use kubelet_plugin::proto::pluginregistration::{
    InfoRequest, RegistrationStatus, registration_client::RegistrationClient,
};
use nvdra::api::kube::KubeApi;
use nvdra::config::{self, Settings};
use nvdra::inventory::sim::{SimAction, SimBackend};
use support::apiserver::TestApiServer;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

const DRIVER: &str = "gpu.nvidia.com";
const NODE: &str = "node-a";

struct TestNode {
    dir: tempfile::TempDir,
    api: TestApiServer,
    sim: SimBackend,
    stop: CancellationToken,
    daemon: tokio::task::JoinHandle<nvdra::daemon::Result<()>>,
    reg_socket: PathBuf,
    dra_socket: PathBuf,
}

async fn unix_channel(path: &Path) -> Channel {
    kubelet_plugin::socket::connect(path)
        .await
        .expect("connect to the socket")
}

/// Waits until `path` exists (the daemon creates it once it serves).
async fn wait_for(path: &Path) {
    let what = format!("{} to appear", path.display());
    support::wait::eventually(&what, || path.exists()).await
}

async fn start(profile: &str, pod_uid: Option<&str>, partitionable: bool) -> TestNode {
    start_as(profile, pod_uid, partitionable, |_| {}).await
}

/// [`start`], the simulated GPUs as `setup` leaves them before the daemon's first read.
async fn start_as(
    profile: &str,
    pod_uid: Option<&str>,
    partitionable: bool,
    setup: impl FnOnce(&SimBackend),
) -> TestNode {
    let dir = tempfile::tempdir().unwrap();
    let boot = dir.path().join("boot_id");
    std::fs::write(&boot, "boot-1\n").unwrap();
    let mut settings = Settings::default();
    settings.serve.mode = Some(config::Mode::Dra);
    settings.daemon.metrics_address = Some("127.0.0.1:0".into());
    settings.backend.profile = Some(profile.into());
    settings.backend.node_name = Some(NODE.into());
    settings.backend.driver_root = Some(dir.path().join("driver"));
    settings.kubelet.kubelet_root = Some(dir.path().join("kubelet"));
    settings.kubelet.cdi_root = Some(dir.path().join("cdi"));
    settings.kubelet.pod_uid = pod_uid.map(String::from);
    settings.plugin.partitionable = Some(partitionable);
    let config = config::resolve(settings, None).unwrap();
    let sockets = kubelet_plugin::registration::Sockets::new(
        &config.registry_dir(),
        &config.plugin_dir(),
        DRIVER,
        pod_uid,
    );
    let sim = SimBackend::from_profile(profile, NODE).unwrap();
    setup(&sim);
    let api = TestApiServer::start().await;
    let stop = CancellationToken::new();
    let daemon = tokio::spawn(nvdra::daemon::run(
        config,
        nvdra::daemon::Extras {
            boot_id_file: Some(boot),
            ..Default::default()
        },
        Arc::new(sim.clone()),
        Arc::new(KubeApi::from_url(api.url()).unwrap()),
        stop.clone(),
    ));
    wait_for(&sockets.registration).await;
    TestNode {
        dir,
        api,
        sim,
        stop,
        daemon,
        reg_socket: sockets.registration,
        dra_socket: sockets.dra,
    }
}

impl TestNode {
    fn add(&self, c: ResourceClaim) {
        self.api.seed_claim(c);
    }
    fn spec(&self, uid: &str) -> PathBuf {
        self.dir
            .path()
            .join("cdi")
            .join(format!("k8s.{DRIVER}-claim_{uid}.yaml"))
    }
    async fn v1(&self) -> v1::dra_plugin_client::DraPluginClient<Channel> {
        v1::dra_plugin_client::DraPluginClient::new(unix_channel(&self.dra_socket).await)
    }
    async fn v1beta1(&self) -> v1beta1::dra_plugin_client::DraPluginClient<Channel> {
        v1beta1::dra_plugin_client::DraPluginClient::new(unix_channel(&self.dra_socket).await)
    }
    /// Stops the daemon and checks it removed its sockets; returns the directory to inspect.
    async fn shutdown(self) -> tempfile::TempDir {
        self.stop.cancel();
        self.daemon.await.unwrap().unwrap();
        assert!(!self.reg_socket.exists(), "registration socket removed");
        assert!(!self.dra_socket.exists(), "DRA socket removed");
        self.dir
    }
}

fn result(request: &str, device: &str) -> DeviceRequestAllocationResult {
    nvdra::api::allocated_device(request, DRIVER, NODE, device)
}

fn claim(
    uid: &str,
    results: Vec<DeviceRequestAllocationResult>,
    config: Vec<DeviceAllocationConfiguration>,
) -> ResourceClaim {
    nvdra::api::allocated_claim("default", &format!("claim-{uid}"), uid, results, config)
}

fn v1_claim(uid: &str) -> v1::Claim {
    v1::Claim {
        namespace: "default".into(),
        uid: uid.into(),
        name: format!("claim-{uid}"),
    }
}

fn v1beta1_claim(uid: &str) -> v1beta1::Claim {
    v1beta1::Claim {
        namespace: "default".into(),
        uid: uid.into(),
        name: format!("claim-{uid}"),
    }
}

#[tokio::test]
async fn registration_handshake() {
    let node = start("l40s-pcie", None, false).await;
    let mut reg = RegistrationClient::new(unix_channel(&node.reg_socket).await);
    let info = reg.get_info(InfoRequest {}).await.unwrap().into_inner();
    assert_eq!(info.r#type, "DRAPlugin");
    assert_eq!(info.name, DRIVER);
    assert_eq!(PathBuf::from(&info.endpoint), node.dra_socket);
    assert!(Path::new(&info.endpoint).is_absolute());
    assert_eq!(
        info.supported_versions,
        vec![
            "v1.DRAPlugin".to_string(),
            "v1beta1.DRAPlugin".to_string(),
            "v1.DRAResourceHealth".to_string(),
            "v1beta1.DRAResourceHealth".to_string(),
            "v1alpha1.DRAResourceHealth".to_string()
        ]
    );
    // The endpoint it names already serves: an empty prepare answers.
    let r = node
        .v1()
        .await
        .node_prepare_resources(v1::NodePrepareResourcesRequest { claims: vec![] })
        .await
        .unwrap()
        .into_inner();
    assert!(r.claims.is_empty());
    reg.notify_registration_status(RegistrationStatus {
        plugin_registered: true,
        error: String::new(),
    })
    .await
    .unwrap();
    // A refusal is logged, not fatal: the socket keeps serving.
    reg.notify_registration_status(RegistrationStatus {
        plugin_registered: false,
        error: "no handler for DRAPlugin".into(),
    })
    .await
    .unwrap();
    reg.get_info(InfoRequest {}).await.unwrap();
    // The node's GPUs are published as ResourceSlices.
    let slices = node
        .api
        .wait_for(std::time::Duration::from_secs(20), |s| !s.is_empty())
        .await;
    let names: Vec<String> = slices
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten().map(|d| d.name.clone()))
        .collect();
    assert_eq!(names, vec!["gpu-0", "gpu-1", "gpu-2", "gpu-3"]);
    assert!(
        slices
            .iter()
            .all(|s| s.spec.node_name.as_deref() == Some(NODE))
    );
    node.shutdown().await;
}

#[tokio::test]
async fn rolling_update_sockets_carry_the_pod_uid() {
    let uid = "5e8f6a2b-0c1d-4e5f-8a9b-0c1d2e3f4a5b";
    let node = start("l40s-pcie", Some(uid), false).await;
    assert!(
        node.reg_socket
            .ends_with(format!("plugins_registry/{DRIVER}-{uid}-reg.sock"))
    );
    let mut reg = RegistrationClient::new(unix_channel(&node.reg_socket).await);
    let info = reg.get_info(InfoRequest {}).await.unwrap().into_inner();
    assert!(
        info.endpoint.ends_with(&format!("dra-{uid}.sock")),
        "{}",
        info.endpoint
    );
    // Another instance's socket in the same directory is left alone at shutdown.
    let other = node
        .reg_socket
        .with_file_name(format!("{DRIVER}-other-reg.sock"));
    std::fs::write(&other, "").unwrap();
    let _dir = node.shutdown().await;
    assert!(other.exists());
}

#[tokio::test]
async fn v1_prepare_and_unprepare_of_single_multi_mig_and_configured_claims() {
    let node = start("a100-mig-mixed", None, true).await;
    node.add(claim("single", vec![result("gpu", "gpu-0")], vec![]));
    node.add(claim(
        "multi",
        vec![
            result("gpus/a", "gpu-3"),
            result("mig", "gpu-1-mig-3g20gb-9-4"),
        ],
        vec![],
    ));
    node.add(claim(
        "created",
        vec![result("mig", "gpu-2-mig-1g10gb-15-6")],
        vec![],
    ));
    node.add(claim(
        "sliced",
        vec![result("mig", "gpu-2-mig-1g10gb-15-0")],
        vec![DeviceAllocationConfiguration {
            source: "FromClaim".into(),
            requests: None,
            opaque: Some(OpaqueDeviceConfiguration {
                driver: DRIVER.into(),
                parameters: RawExtension(serde_json::json!({
                    "apiVersion": "resource.nvidia.com/v1beta1",
                    "kind": "MigDeviceConfig",
                    "sharing": {"strategy": "TimeSlicing"}
                })),
            }),
        }],
    ));
    let mut client = node.v1().await;
    let uids = ["single", "multi", "created", "sliced"];
    let resp = client
        .node_prepare_resources(v1::NodePrepareResourcesRequest {
            claims: uids.iter().map(|u| v1_claim(u)).collect(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(resp.claims.len(), 4);
    for u in uids {
        assert_eq!(resp.claims[u].error, "", "{u}");
        assert!(node.spec(u).exists(), "{u}");
    }
    let multi = &resp.claims["multi"].devices;
    assert_eq!(multi.len(), 2);
    assert_eq!(multi[0].request_names, vec!["gpus".to_string()]);
    assert_eq!(multi[0].pool_name, NODE);
    assert_eq!(multi[0].device_name, "gpu-3");
    assert_eq!(
        multi[1].cdi_device_ids,
        vec![format!("k8s.{DRIVER}/claim=multi-gpu-1-mig-3g20gb-9-4")]
    );
    assert_eq!(multi[0].share_id, None);
    assert!(matches!(
        node.sim.actions().as_slice(),
        [SimAction::CreateMig { .. }]
    ));

    // Idempotent: the same answer again.
    let again = client
        .node_prepare_resources(v1::NodePrepareResourcesRequest {
            claims: vec![v1_claim("multi")],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(&again.claims["multi"].devices, multi);

    let resp = client
        .node_unprepare_resources(v1::NodeUnprepareResourcesRequest {
            claims: uids
                .iter()
                .map(|u| v1_claim(u))
                .chain([v1_claim("unknown")])
                .collect(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(resp.claims.len(), 5);
    for (uid, r) in &resp.claims {
        assert_eq!(r.error, "", "{uid}");
    }
    for u in uids {
        assert!(!node.spec(u).exists(), "{u}");
    }
    assert!(matches!(
        node.sim.actions().as_slice(),
        [SimAction::CreateMig { .. }, SimAction::DestroyMig { .. }]
    ));
    node.shutdown().await;
}

#[tokio::test]
async fn a_bad_claim_fails_alone_in_its_batch_on_both_versions() {
    let node = start("dgx-h100", None, false).await;
    node.add(claim("good1", vec![result("gpu", "gpu-0")], vec![]));
    node.add(claim("good2", vec![result("gpu", "gpu-1")], vec![]));
    node.add(claim("bad", vec![result("gpu", "gpu-42")], vec![]));
    let mut notalloc = claim("notalloc", vec![], vec![]);
    notalloc.status = None;
    node.add(notalloc);
    let resp = node
        .v1beta1()
        .await
        .node_prepare_resources(v1beta1::NodePrepareResourcesRequest {
            claims: ["good1", "bad", "missing", "good2", "notalloc"]
                .iter()
                .map(|u| v1beta1_claim(u))
                .collect(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(resp.claims.len(), 5, "one entry per claim");
    assert_eq!(resp.claims["good1"].error, "");
    assert_eq!(resp.claims["good2"].error, "");
    assert_eq!(resp.claims["good2"].devices[0].device_name, "gpu-1");
    assert!(
        resp.claims["bad"].error.contains("gpu-42"),
        "{:?}",
        resp.claims["bad"]
    );
    assert!(resp.claims["bad"].devices.is_empty());
    assert!(resp.claims["missing"].error.contains("not found"));
    assert!(resp.claims["notalloc"].error.contains("not allocated"));

    // A device already held: the v1 API names the holder.
    node.add(claim("thief", vec![result("gpu", "gpu-0")], vec![]));
    let resp = node
        .v1()
        .await
        .node_prepare_resources(v1::NodePrepareResourcesRequest {
            claims: vec![v1_claim("thief")],
        })
        .await
        .unwrap()
        .into_inner();
    assert!(
        resp.claims["thief"]
            .error
            .contains("already prepared for claim default/claim-good1"),
        "{}",
        resp.claims["thief"].error
    );

    let resp = node
        .v1beta1()
        .await
        .node_unprepare_resources(v1beta1::NodeUnprepareResourcesRequest {
            claims: vec![v1beta1_claim("good1"), v1beta1_claim("bad")],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(resp.claims.len(), 2);
    assert!(resp.claims.values().all(|r| r.error.is_empty()));
    assert!(!node.spec("good1").exists());
    assert!(node.spec("good2").exists());
    node.shutdown().await;
}

#[tokio::test]
async fn shared_allocations_report_share_ids_on_v1() {
    let node = start("dgx-h100", None, false).await;
    let mut r = result("gpu", "gpu-2");
    r.share_id = Some("7f3c".into());
    node.add(claim("shared", vec![r], vec![]));
    let resp = node
        .v1()
        .await
        .node_prepare_resources(v1::NodePrepareResourcesRequest {
            claims: vec![v1_claim("shared")],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        resp.claims["shared"].devices[0].share_id.as_deref(),
        Some("7f3c")
    );
    node.shutdown().await;
}

#[tokio::test]
async fn health_stream_lists_devices_and_ends_at_shutdown() {
    use futures::StreamExt;
    use kubelet_plugin::proto::health::v1alpha1::{
        HealthStatus, NodeWatchResourcesRequest,
        dra_resource_health_client::DraResourceHealthClient,
    };
    // The stream sends what the inventory owner published: the GPU lost before its first read.
    let node = start_as("a100-mig-mixed", None, false, |sim| {
        sim.update(|inv| {
            inv.gpus[3].health = nvdra::inventory::Health::Unhealthy {
                reason: "XID 79: fallen off the bus".into(),
            }
        })
    })
    .await;
    let mut client = DraResourceHealthClient::new(unix_channel(&node.dra_socket).await);
    let mut stream = client
        .node_watch_resources(NodeWatchResourcesRequest {})
        .await
        .unwrap()
        .into_inner();
    let first = stream.next().await.unwrap().unwrap();
    assert_eq!(first.devices.len(), 9);
    let gpu3 = first
        .devices
        .iter()
        .find(|d| d.device.as_ref().unwrap().device_name == "gpu-3")
        .unwrap();
    assert_eq!(gpu3.health, HealthStatus::Unhealthy as i32);
    assert!(gpu3.message.contains("XID 79"));
    assert_eq!(gpu3.device.as_ref().unwrap().pool_name, NODE);
    // An open stream does not hold up shutdown, and it ends cleanly.
    let _dir = node.shutdown().await;
    assert!(stream.next().await.is_none());
}
