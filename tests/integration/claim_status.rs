//! Claim status (issue 36 item 1), end to end: `nvdra::daemon::run` against the test API server
//! through the real `KubeApi` client, the kubelet's calls through its DRA socket. After a
//! prepare, the claim's `status.devices` holds nvdra's entries (a `Ready` condition, the UUIDs),
//! applied by nvdra's field manager alone, beside another driver's entry, which stays; a prepare
//! that fails writes nothing; a re-prepare does not write again; unprepare leaves the entries
//! and deallocation (the API server's rule) drops them; `--claim-status=false` writes nothing,
//! and a server that drops the field changes nothing for the prepare.

use crate::support;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use k8s_openapi::api::resource::v1::{AllocatedDeviceStatus, ResourceClaim};
use kubelet_plugin::Claim;
use kubelet_plugin::status::StatusWriter;
use kubelet_plugin::testing::KubeletClient;
use nvdra::api::kube::KubeApi;
use nvdra::config::{self, Settings};
use nvdra::inventory::DeviceBackend;
use nvdra::inventory::sim::SimBackend;
use serde_json::Value;
use support::apiserver::TestApiServer;
use tokio_util::sync::CancellationToken;

const DRIVER: &str = "gpu.nvidia.com";
const NET: &str = "net.example.com";
const NODE: &str = "node-a";
const PROFILE: &str = "a100-mig-mixed";
const NS: &str = "team-a";

struct Node {
    _dir: tempfile::TempDir,
    api: TestApiServer,
    sim: SimBackend,
    stop: CancellationToken,
    daemon: tokio::task::JoinHandle<nvdra::daemon::Result<()>>,
    dra_socket: PathBuf,
}

/// `nvdra run --mode dra` for `NODE`, `claim_status` as given, against a fresh test API server
/// (`drop_field`: one that drops `status.devices`, as before Kubernetes 1.32).
async fn start(claim_status: bool, drop_field: bool) -> Node {
    let dir = tempfile::tempdir().unwrap();
    let boot = dir.path().join("boot_id");
    std::fs::write(&boot, "boot-1\n").unwrap();
    let mut settings = Settings::default();
    settings.serve.mode = Some(config::Mode::Dra);
    settings.daemon.metrics_address = Some("127.0.0.1:0".into());
    settings.daemon.claim_status = Some(claim_status);
    settings.backend.profile = Some(PROFILE.into());
    settings.backend.node_name = Some(NODE.into());
    settings.backend.driver_root = Some(dir.path().join("driver"));
    settings.kubelet.kubelet_root = Some(dir.path().join("kubelet"));
    settings.kubelet.cdi_root = Some(dir.path().join("cdi"));
    let config = config::resolve(settings, None).unwrap();
    let sockets = kubelet_plugin::registration::Sockets::new(
        &config.registry_dir(),
        &config.plugin_dir(),
        DRIVER,
        None,
    );
    let sim = SimBackend::from_profile(PROFILE, NODE).unwrap();
    let api = TestApiServer::start().await;
    if drop_field {
        api.drop_claim_device_status();
    }
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
    let registration = sockets.registration.clone();
    support::wait::eventually("the registration socket", || registration.exists()).await;
    Node {
        _dir: dir,
        api,
        sim,
        stop,
        daemon,
        dra_socket: sockets.dra,
    }
}

impl Node {
    async fn kubelet(&self) -> KubeletClient {
        KubeletClient::connect(&self.dra_socket).await.unwrap()
    }

    fn claim(&self, name: &str) -> ResourceClaim {
        self.api.claim(NS, name).expect("the claim is stored")
    }

    /// The status applies the API server received.
    fn applies(&self) -> usize {
        self.api
            .requests()
            .iter()
            .filter(|r| r.method == "PATCH" && r.path.ends_with("/status"))
            .count()
    }

    async fn stop(self) {
        self.stop.cancel();
        self.daemon.await.unwrap().unwrap();
    }
}

/// A claim allocated a whole GPU and an existing MIG device of this node, and another driver's
/// NIC.
fn seed(api: &TestApiServer, name: &str) -> Claim {
    let uid = format!("uid-{name}");
    let results = vec![
        nvdra::api::allocated_device("gpu", DRIVER, NODE, "gpu-3"),
        nvdra::api::allocated_device("mig", DRIVER, NODE, "gpu-1-mig-3g20gb-9-4"),
        nvdra::api::allocated_device("nic", NET, NODE, "nic-0"),
    ];
    api.seed_claim(nvdra::api::allocated_claim(NS, name, &uid, results, vec![]));
    Claim::new(NS, name, uid)
}

fn devices(claim: &ResourceClaim) -> Vec<AllocatedDeviceStatus> {
    claim
        .status
        .as_ref()
        .and_then(|s| s.devices.clone())
        .unwrap_or_default()
}

fn ours(claim: &ResourceClaim) -> Vec<AllocatedDeviceStatus> {
    devices(claim)
        .into_iter()
        .filter(|d| d.driver == DRIVER)
        .collect()
}

/// How many entries each field manager applied (`metadata.managedFields`).
fn managers(claim: &ResourceClaim) -> BTreeMap<String, usize> {
    claim
        .metadata
        .managed_fields
        .iter()
        .flatten()
        .map(|m| {
            let fields = &m.fields_v1.as_ref().unwrap().0;
            let n = fields["f:status"]["f:devices"].as_object().unwrap().len();
            (m.manager.clone().unwrap(), n)
        })
        .collect()
}

#[tokio::test]
async fn a_prepared_claim_has_nvdras_entries_until_it_is_deallocated() {
    let node = start(true, false).await;
    let claim = seed(&node.api, "c1");
    // Another driver's entry, applied before nvdra's.
    let net = StatusWriter::new(Arc::new(node.api.client().unwrap()), NET);
    let nic = AllocatedDeviceStatus {
        conditions: Some(vec![kubelet_plugin::status::ready("Attached", "up")]),
        ..net.entry(NODE, "nic-0", None)
    };
    net.apply(&claim, vec![nic]).await.unwrap();
    let before = node.applies();
    // A claim nvdra cannot prepare (a device of another node's pool) gets no entries.
    let bad = Claim::new(NS, "c2", "uid-c2");
    node.api.seed_claim(nvdra::api::allocated_claim(
        NS,
        "c2",
        "uid-c2",
        vec![nvdra::api::allocated_device(
            "gpu", DRIVER, "node-b", "gpu-0",
        )],
        vec![],
    ));

    let mut kubelet = node.kubelet().await;
    let answers = kubelet
        .prepare(&[claim.clone(), bad.clone()])
        .await
        .unwrap();
    assert!(answers[&claim.uid].is_ok(), "{answers:?}");
    assert!(answers[&bad.uid].is_err(), "{answers:?}");
    support::wait::eventually("nvdra's entries in the claim's status", || {
        ours(&node.claim("c1")).len() == 2
    })
    .await;

    let stored = node.claim("c1");
    let inv = node.sim.snapshot().unwrap();
    let gpu3 = inv.gpus.iter().find(|g| g.minor == 3).unwrap();
    let entries = ours(&stored);
    for (e, device) in entries.iter().zip(["gpu-3", "gpu-1-mig-3g20gb-9-4"]) {
        assert_eq!((e.pool.as_str(), e.device.as_str()), (NODE, device));
        assert_eq!(e.share_id, None);
        let conditions = e.conditions.as_ref().unwrap();
        assert_eq!(conditions.len(), 1);
        let ready = &conditions[0];
        assert_eq!(
            (ready.type_.as_str(), ready.status.as_str()),
            ("Ready", "True")
        );
        assert_eq!(ready.reason, "DevicePrepared");
        assert!(e.network_data.is_none());
    }
    let data: Vec<&Value> = entries
        .iter()
        .map(|e| &e.data.as_ref().unwrap().0)
        .collect();
    assert_eq!(data[0]["uuid"], gpu3.uuid.as_str());
    assert_eq!(data[0]["gpuUUID"], gpu3.uuid.as_str());
    assert_eq!(data[0]["sharing"], "exclusive");
    let gpu1 = inv.gpus.iter().find(|g| g.minor == 1).unwrap();
    assert!(
        data[1]["uuid"].as_str().unwrap().starts_with("MIG-"),
        "{}",
        data[1]
    );
    assert_eq!(data[1]["gpuUUID"], gpu1.uuid.as_str());
    assert_eq!(data[1]["migProfile"], "3g.20gb");
    // The other driver's entry stays; each manager owns its own.
    assert_eq!(devices(&stored).len(), 3);
    assert_eq!(
        managers(&stored),
        BTreeMap::from([(DRIVER.to_string(), 2), (NET.to_string(), 1)])
    );
    // One apply, as nvdra's field manager, forced, of this claim only.
    let applies: Vec<_> = node
        .api
        .requests()
        .into_iter()
        .filter(|r| r.method == "PATCH")
        .skip(before)
        .collect();
    assert_eq!(applies.len(), 1, "{applies:?}");
    assert!(
        applies[0]
            .path
            .ends_with("/namespaces/team-a/resourceclaims/c1/status")
    );
    assert!(applies[0].query.contains("fieldManager=gpu.nvidia.com"));
    assert!(applies[0].query.contains("force=true"));

    // A re-prepare answers from the checkpoint and writes nothing again.
    kubelet.prepare(std::slice::from_ref(&claim)).await.unwrap()[&claim.uid]
        .as_ref()
        .unwrap();
    assert_eq!(node.applies(), before + 1);

    // Unprepare leaves them: the API server drops them when the claim is deallocated.
    let done = kubelet
        .unprepare(std::slice::from_ref(&claim))
        .await
        .unwrap();
    assert_eq!(done[&claim.uid], Ok(()));
    assert_eq!(node.applies(), before + 1);
    assert_eq!(ours(&node.claim("c1")).len(), 2);
    assert!(node.api.deallocate_claim(NS, "c1"));
    assert!(devices(&node.claim("c1")).is_empty());

    // Allocated again (the same claim, as the scheduler may): its next prepare writes again.
    seed(&node.api, "c1");
    kubelet.prepare(std::slice::from_ref(&claim)).await.unwrap()[&claim.uid]
        .as_ref()
        .unwrap();
    support::wait::eventually("the entries written again", || {
        ours(&node.claim("c1")).len() == 2
    })
    .await;
    assert_eq!(node.applies(), before + 2);
    node.stop().await;
}

#[tokio::test]
async fn claim_status_off_writes_nothing() {
    let node = start(false, false).await;
    let claim = seed(&node.api, "c1");
    let mut kubelet = node.kubelet().await;
    let answers = kubelet.prepare(std::slice::from_ref(&claim)).await.unwrap();
    assert!(answers[&claim.uid].is_ok(), "{answers:?}");
    kubelet
        .unprepare(std::slice::from_ref(&claim))
        .await
        .unwrap();
    assert_eq!(node.applies(), 0);
    assert!(devices(&node.claim("c1")).is_empty());
    node.stop().await;
}

#[tokio::test]
async fn a_server_without_the_field_prepares_as_before() {
    let node = start(true, true).await;
    let claim = seed(&node.api, "c1");
    let mut kubelet = node.kubelet().await;
    let answers = kubelet.prepare(std::slice::from_ref(&claim)).await.unwrap();
    assert!(answers[&claim.uid].is_ok(), "{answers:?}");
    support::wait::eventually("the status apply", || node.applies() == 1).await;
    assert!(devices(&node.claim("c1")).is_empty());
    // Told apart, not an error: the claim is not written again at its re-prepare.
    kubelet.prepare(std::slice::from_ref(&claim)).await.unwrap();
    assert_eq!(node.applies(), 1);
    node.stop().await;
}
