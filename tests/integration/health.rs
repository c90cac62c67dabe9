//! The health monitor end to end on simulated GPUs: an XID on GPU 3 reaches the published
//! ResourceSlice on the test API server as a device taint on exactly GPU 3's devices (its MIG
//! devices included) and an open `ListAndWatch` stream as exactly GPU 3's replicas going
//! Unhealthy; an ignored XID changes nothing; recovery lifts all of it; a server that drops
//! taints gets the GPU withdrawn instead; an XID in one MIG instance of a dynamic-MIG H100 taints
//! that MIG device alone, in the slices and the health stream. (The health stream's versions and its resend period,
//! in paused time, are tested next to it in `src/dra/health.rs`; the same through NVML on the fake
//! library in `health_nvml.rs`.)

use crate::support;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use k8s_openapi::api::resource::v1::ResourceSlice;
use kubelet_plugin::proto::deviceplugin::v1beta1::{
    Empty, device_plugin_client::DevicePluginClient,
};
use kubelet_plugin::publisher::{Options, Publisher};
use nvdra::api::kube::KubeApi;
use nvdra::deviceplugin::DevicePlugin;
use nvdra::deviceplugin::server::Settings;
use nvdra::dra::slices::{ConsumableShares, CounterLayout, SliceOptions};
use nvdra::dra::sync::SliceSync;
use nvdra::health::faults::FaultFile;
use nvdra::health::{Event, EventKind, Monitor, MonitorHandle, Policy};
use nvdra::inventory::owner::{self, Owner};
use nvdra::inventory::sim::SimBackend;
use nvdra::inventory::{DeviceBackend, MigUuid, Reconfigure};
use support::apiserver::TestApiServer;
use support::wait::{SOON, eventually, until};
use tokio_util::sync::CancellationToken;

const DRIVER: &str = "gpu.nvidia.com";
const NODE: &str = "node-a";

/// a100-mig-mixed with GPU 3 in MIG mode too (a copy of GPU 1's instances), so GPU 3 has both a
/// whole-GPU sibling (GPU 0) and MIG devices of its own.
fn node() -> SimBackend {
    let sim = SimBackend::from_profile("a100-mig-mixed", NODE).unwrap();
    sim.update(|inv| {
        let mut mig = inv.gpus[1].mig.clone();
        for (i, d) in mig.devices.iter_mut().enumerate() {
            d.uuid = MigUuid(format!("MIG-gpu3-{i}"));
        }
        inv.gpus[3].mig = mig;
    });
    sim
}

fn policy() -> Policy {
    Policy {
        quiet_period: Duration::from_millis(300),
        probe_interval: Duration::from_millis(50),
        ..Policy::default()
    }
}

/// Device name → its taints as `key=value:effect`, over every published slice.
fn taints(slices: &[ResourceSlice]) -> BTreeMap<String, Vec<String>> {
    slices
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten())
        .map(|d| {
            let t = d
                .taints
                .iter()
                .flatten()
                .map(|t| {
                    format!(
                        "{}={}:{}",
                        t.key,
                        t.value.as_deref().unwrap_or(""),
                        t.effect
                    )
                })
                .collect();
            (d.name.clone(), t)
        })
        .collect()
}

struct Published {
    server: TestApiServer,
    handle: MonitorHandle,
    sim: SimBackend,
    /// The recovery probe fails until a test sets this.
    answers: Arc<AtomicBool>,
    token: CancellationToken,
}

/// A probe that fails until the test lets the GPUs answer: recovery happens when the test says.
struct Gate(Arc<AtomicBool>);

impl nvdra::health::Probe for Gate {
    fn probe(&self, _: &nvdra::inventory::GpuUuid) -> Result<(), String> {
        if self.0.load(Ordering::SeqCst) {
            Ok(())
        } else {
            Err("not yet".into())
        }
    }
}

impl Drop for Published {
    fn drop(&mut self) {
        self.token.cancel();
    }
}

/// Monitor → monitored backend → slice sync (no rescan: only the watch triggers it) →
/// publisher → test API server.
async fn publish(prepare: impl FnOnce(&TestApiServer)) -> Published {
    let server = TestApiServer::start().await;
    server.seed_node(NODE, "uid-node-a");
    prepare(&server);
    let api = Arc::new(KubeApi::from_url(server.url()).unwrap());
    let (publisher, publisher_handle) = Publisher::with_options(
        api,
        DRIVER,
        NODE,
        Options {
            settle: Duration::from_millis(20),
            backoff_base: Duration::from_millis(20),
            backoff_cap: Duration::from_millis(200),
            conflict_retries: 5,
            ..Options::default()
        },
    );
    let sim = node();
    let inner: Arc<dyn DeviceBackend> = Arc::new(sim.clone());
    let answers = Arc::new(AtomicBool::new(false));
    let (monitor, handle) = Monitor::new(policy(), Arc::new(Gate(answers.clone())));
    let token = CancellationToken::new();
    let hour = Duration::from_secs(3600);
    let owner = nvdra::testing::start_owner(inner, hour, handle.subscribe(), token.clone())
        .await
        .unwrap();
    let sync = SliceSync::new(
        owner.subscribe(),
        publisher_handle,
        SliceOptions {
            driver: DRIVER.into(),
            node_name: NODE.into(),
            partitionable: false,
            shared_capacity: ConsumableShares::Disabled,
            dynamic_mig: false,
            mig_profiles: None,
            layout: CounterLayout::Separate,
        },
    );
    tokio::spawn(monitor.run(token.clone()));
    tokio::spawn(publisher.run(token.clone()));
    tokio::spawn(sync.run(token.clone()));
    Published {
        server,
        handle,
        sim,
        answers,
        token,
    }
}

fn gpu3_devices(all: &BTreeMap<String, Vec<String>>) -> Vec<String> {
    all.keys()
        .filter(|n| *n == "gpu-3" || n.starts_with("gpu-3-mig-"))
        .cloned()
        .collect()
}

#[tokio::test]
async fn an_xid_on_gpu_3_taints_exactly_its_devices_and_recovery_lifts_the_taints() {
    let node = publish(|_| {}).await;
    eventually("first publish", || node.server.slices().len() == 1).await;
    let before = taints(&node.server.slices());
    assert!(before.values().all(Vec::is_empty));
    let gpu3 = gpu3_devices(&before);
    assert_eq!(gpu3.len(), 4, "GPU 3's four MIG devices: {gpu3:?}");
    let writes = node.server.counts().updates;

    let inv = node.sim.snapshot().unwrap();
    let tx = node.handle.events();
    // An ignored XID on GPU 0 first, then the critical one on GPU 3: the one update that
    // follows must carry only GPU 3's taints.
    tx.send(Event::gpu(inv.gpus[0].uuid.clone(), EventKind::Xid(43)))
        .await
        .unwrap();
    tx.send(Event::gpu(inv.gpus[3].uuid.clone(), EventKind::Xid(79)))
        .await
        .unwrap();
    eventually("GPU 3 tainted", || {
        taints(&node.server.slices())
            .get(&gpu3[0])
            .is_some_and(|t| !t.is_empty())
    })
    .await;
    let after = taints(&node.server.slices());
    assert_eq!(
        after.keys().collect::<Vec<_>>(),
        before.keys().collect::<Vec<_>>(),
        "no device withdrawn"
    );
    for (name, t) in &after {
        if gpu3.contains(name) {
            assert_eq!(
                t,
                &vec!["gpu.nvidia.com/xid=79:NoSchedule".to_string()],
                "{name}"
            );
        } else {
            assert!(t.is_empty(), "{name}: {t:?}");
        }
    }
    assert_eq!(node.server.counts().updates, writes + 1, "one update");
    // The server set timeAdded.
    assert!(
        node.server
            .slices()
            .iter()
            .flat_map(|s| s.spec.devices.iter().flatten())
            .flat_map(|d| d.taints.iter().flatten())
            .all(|t| t.time_added.is_some())
    );

    // Quiet period over, probe answers: the taints go.
    node.answers.store(true, Ordering::SeqCst);
    eventually("taints lifted", || {
        taints(&node.server.slices()).values().all(Vec::is_empty)
    })
    .await;
    assert!(node.handle.state().is_empty());
}

#[tokio::test]
async fn a_server_that_drops_taints_gets_the_gpu_withdrawn_instead() {
    let node = publish(|server| server.drop_field("devices[].taints")).await;
    eventually("first publish", || node.server.slices().len() == 1).await;
    let all = taints(&node.server.slices());
    let gpu3 = gpu3_devices(&all);
    let inv = node.sim.snapshot().unwrap();
    node.handle
        .events()
        .send(Event::gpu(
            inv.gpus[3].uuid.clone(),
            EventKind::DoubleBitEcc,
        ))
        .await
        .unwrap();
    eventually("GPU 3 withdrawn", || {
        let now = taints(&node.server.slices());
        gpu3.iter().all(|n| !now.contains_key(n)) && now.len() == all.len() - gpu3.len()
    })
    .await;
    // Recovery brings the devices back.
    node.answers.store(true, Ordering::SeqCst);
    eventually("GPU 3 back", || {
        taints(&node.server.slices()).len() == all.len()
    })
    .await;
}

/// The device plugin with 2 time-slicing replicas per GPU and a poll far beyond the test: only
/// the monitor's watch can make it resend.
#[tokio::test]
async fn list_and_watch_resends_at_once_with_exactly_gpu_3s_replicas_unhealthy() {
    let root = tempfile::tempdir().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let faults = dir.path().join("faults");
    let sim = SimBackend::from_profile("dgx-h100", NODE).unwrap();
    let inner: Arc<dyn DeviceBackend> = Arc::new(sim.clone());
    // As `nvdra run` wires them: the monitor probes through the owner, which follows it.
    let hour = Duration::from_secs(3600);
    let (mut reader, inventory) = Owner::new(inner.clone(), hour, owner::DEADLINE).unwrap();
    reader.read().await.unwrap();
    let file = FaultFile::new(faults.clone(), Arc::new(inventory.clone()));
    let (monitor, handle) = Monitor::new(policy(), file.probe());
    let stop = CancellationToken::new();
    tokio::spawn(reader.run(handle.subscribe(), stop.clone()));
    let options = nvdra::deviceplugin::nvconfig::parse(
        "config.yaml",
        "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 2\n",
    )
    .unwrap();
    let dp = DevicePlugin::new(
        Settings {
            dir: root.path().join("device-plugins"),
            driver: DRIVER.into(),
            driver_root: nvdra::cdi::DriverRoot::at(&root.path().join("driver")),
            cdi_root: root.path().join("cdi"),
            watch: Duration::from_millis(20),
        },
        options,
        inventory.subscribe(),
    );
    tokio::spawn(monitor.run(stop.clone()));
    tokio::spawn(file.run(handle.events(), inventory.subscribe(), stop.clone()));
    let task = tokio::spawn(dp.run(stop.clone()));
    let sock = root.path().join("device-plugins/nvidia-gpu.sock");
    let (socket, running) = (&sock, &task);
    let channel = until("the device plugin's socket", SOON, || async move {
        assert!(
            !running.is_finished(),
            "the device plugin stopped: {running:?}"
        );
        kubelet_plugin::socket::connect(socket).await.ok()
    })
    .await;
    let mut client = DevicePluginClient::new(channel);
    let mut stream = client.list_and_watch(Empty {}).await.unwrap().into_inner();
    let first = stream.message().await.unwrap().unwrap();
    assert_eq!(first.devices.len(), 16, "8 GPUs x 2 replicas");
    assert!(first.devices.iter().all(|d| d.health == "Healthy"));
    let gpu3 = sim.snapshot().unwrap().gpus[3].uuid.to_string();

    // Through the fault file: an ignored XID on GPU 1, then GPU 3 lost.
    std::fs::write(&faults, "xid 1 31\nlost 3\n").unwrap();
    let second = tokio::time::timeout(SOON, stream.message())
        .await
        .expect("a resend long before the poll")
        .unwrap()
        .unwrap();
    assert_eq!(second.devices.len(), 16, "always the full list");
    let sick: Vec<&str> = second
        .devices
        .iter()
        .filter(|d| d.health == "Unhealthy")
        .map(|d| d.id.as_str())
        .collect();
    assert_eq!(sick.len(), 2, "{sick:?}");
    assert!(sick.iter().all(|id| id.starts_with(&gpu3)), "{sick:?}");

    // Back: healthy again after the quiet period, and sent.
    std::fs::write(&faults, "xid 1 31\nlost 3\nback 3\n").unwrap();
    let third = tokio::time::timeout(SOON, stream.message())
        .await
        .expect("the recovery is sent")
        .unwrap()
        .unwrap();
    assert!(third.devices.iter().all(|d| d.health == "Healthy"));
    stop.cancel();
}

/// `nvdra::daemon::run` with `--fault-file` on a simulated node: a line appended to the file
/// reaches the slice on the API server as a taint and the health stream, served as `v1` and
/// `v1beta1` on the DRA socket, as GPU 3 unhealthy with its cause.
#[tokio::test]
async fn the_daemon_wires_the_fault_file_to_the_slices_and_every_health_stream() {
    use kubelet_plugin::proto::health::{v1, v1beta1};
    use nvdra::config::{self, Settings};
    let dir = tempfile::tempdir().unwrap();
    let boot = dir.path().join("boot_id");
    std::fs::write(&boot, "boot-1\n").unwrap();
    let faults = dir.path().join("faults");
    let mut settings = Settings::default();
    settings.serve.mode = Some(config::Mode::Dra);
    settings.daemon.metrics_address = Some("127.0.0.1:0".into());
    settings.backend.profile = Some("dgx-h100".into());
    settings.backend.node_name = Some(NODE.into());
    settings.backend.driver_root = Some(dir.path().join("driver"));
    settings.kubelet.kubelet_root = Some(dir.path().join("kubelet"));
    settings.kubelet.cdi_root = Some(dir.path().join("cdi"));
    settings.health.fault_file = Some(faults.clone());
    let config = config::resolve(settings, None).unwrap();
    let dra_socket = config.plugin_dir().join("dra.sock");
    let server = TestApiServer::start().await;
    let stop = CancellationToken::new();
    let daemon = tokio::spawn(nvdra::daemon::run(
        config,
        nvdra::daemon::Extras {
            boot_id_file: Some(boot),
            ..Default::default()
        },
        Arc::new(SimBackend::from_profile("dgx-h100", NODE).unwrap()),
        Arc::new(KubeApi::from_url(server.url()).unwrap()),
        stop.clone(),
    ));
    eventually("first publish", || {
        taints(&server.slices()).contains_key("gpu-3")
    })
    .await;
    let channel = kubelet_plugin::socket::connect(&dra_socket).await.unwrap();
    let mut ga = v1::dra_resource_health_client::DraResourceHealthClient::new(channel.clone())
        .node_watch_resources(v1::NodeWatchResourcesRequest {})
        .await
        .unwrap()
        .into_inner();
    let mut beta = v1beta1::dra_resource_health_client::DraResourceHealthClient::new(channel)
        .node_watch_resources(v1beta1::NodeWatchResourcesRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(ga.message().await.unwrap().unwrap().devices.len(), 8);
    assert_eq!(beta.message().await.unwrap().unwrap().devices.len(), 8);

    std::fs::write(&faults, "xid 3 79\n").unwrap();
    eventually("GPU 3 tainted", || {
        taints(&server.slices())
            .get("gpu-3")
            .is_some_and(|t| !t.is_empty())
    })
    .await;
    let m = ga.message().await.unwrap().unwrap();
    let sick: Vec<(String, String)> = m
        .devices
        .into_iter()
        .filter(|d| d.health == v1::HealthStatus::Unhealthy as i32)
        .map(|d| (d.device.unwrap().device_name, d.message))
        .collect();
    assert_eq!(
        sick,
        [(
            "gpu-3".to_string(),
            "XID 79 (GPU has fallen off the bus)".to_string()
        )]
    );
    let m = beta.message().await.unwrap().unwrap();
    assert_eq!(
        m.devices
            .iter()
            .filter(|d| d.health == v1beta1::HealthStatus::Unhealthy as i32)
            .count(),
        1
    );
    stop.cancel();
    daemon.await.unwrap().unwrap();
}

/// A dynamic-MIG H100 (GPU 0, switched to MIG mode, a 3g.40gb and a 1g.10gb instance) with
/// faults from the fault file: an XID the line attributes to the 3g.40gb instance (`gi=`, `ci=`,
/// as NVML attributes one) taints that MIG device alone in the slices and in the DRA health
/// stream; the other instance, the free placements and the other GPUs stay clean. A GPU-wide XID
/// on GPU 0 then taints every device of it.
#[tokio::test]
async fn an_xid_in_one_mig_instance_of_a_dynamic_mig_gpu_taints_that_device_alone() {
    use kubelet_plugin::health::HealthSource;
    use nvdra::inventory::Placement;
    let dir = tempfile::tempdir().unwrap();
    let faults = dir.path().join("faults");
    let sim = SimBackend::from_profile("dgx-h100", NODE).unwrap();
    let gpu0 = sim.snapshot().unwrap().gpus[0].clone();
    assert!(gpu0.mig_toggle().is_ok(), "GPU 0 switches at run time");
    sim.set_mig_mode(&gpu0.uuid, true).unwrap();
    let profile = |name: &str| {
        gpu0.mig
            .profiles
            .iter()
            .find(|p| p.name == name)
            .unwrap()
            .gi_profile_id
    };
    let sick = sim
        .create_mig(
            &gpu0.uuid,
            profile("3g.40gb"),
            Placement { start: 0, size: 4 },
        )
        .unwrap();
    let well = sim
        .create_mig(
            &gpu0.uuid,
            profile("1g.10gb"),
            Placement { start: 6, size: 1 },
        )
        .unwrap();

    let inner: Arc<dyn DeviceBackend> = Arc::new(sim.clone());
    // As `nvdra run` wires them: the monitor probes through the owner, which follows it.
    let hour = Duration::from_secs(3600);
    let (mut reader, owner) = Owner::new(inner, hour, owner::DEADLINE).unwrap();
    reader.read().await.unwrap();
    let file = FaultFile::new(faults.clone(), Arc::new(owner.clone()));
    let (monitor, handle) = Monitor::new(policy(), file.probe());
    let stop = CancellationToken::new();
    tokio::spawn(reader.run(handle.subscribe(), stop.clone()));
    let mut node = owner.subscribe();
    tokio::spawn(monitor.run(stop.clone()));
    tokio::spawn(file.run(handle.events(), owner.subscribe(), stop.clone()));
    let opts = SliceOptions {
        driver: DRIVER.into(),
        node_name: NODE.into(),
        partitionable: false,
        shared_capacity: ConsumableShares::Disabled,
        dynamic_mig: true,
        mig_profiles: None,
        layout: CounterLayout::Separate,
    };
    let published = |node: &owner::Watch| {
        let specs =
            nvdra::dra::slices::desired_slices(&node.borrow().node().unwrap(), &opts).unwrap();
        let slices: Vec<ResourceSlice> = specs
            .into_iter()
            .map(|spec| ResourceSlice {
                metadata: Default::default(),
                spec,
            })
            .collect();
        taints(&slices)
    };
    let before = published(&node);
    node.mark_unchanged();
    assert!(before.values().all(Vec::is_empty));
    let (sick_name, well_name) = ("gpu-0-mig-3g40gb-9-0", "gpu-0-mig-1g10gb-19-6");
    assert!(before.contains_key(sick_name) && before.contains_key(well_name));
    let free: Vec<&String> = before
        .keys()
        .filter(|n| n.starts_with("gpu-0-mig-") && *n != sick_name && *n != well_name)
        .collect();
    assert!(!free.is_empty(), "free placements on slices 4, 5 and 7");

    std::fs::write(
        &faults,
        format!("xid 0 94 gi={} ci={}\n", sick.gi_id, sick.ci_id),
    )
    .unwrap();
    eventually("the instance's fault", || {
        handle.state().mig(&sick.uuid).is_some()
    })
    .await;
    assert_eq!(handle.state().faults().count(), 0, "not GPU 0's");
    // The owner's publication of that transition.
    node.changed().await.unwrap();
    let after = published(&node);
    assert_eq!(
        after.keys().collect::<Vec<_>>(),
        before.keys().collect::<Vec<_>>(),
        "nothing withdrawn"
    );
    for (name, t) in &after {
        if name == sick_name {
            assert_eq!(t, &["gpu.nvidia.com/xid=94:NoSchedule".to_string()]);
        } else {
            assert!(t.is_empty(), "{name}: {t:?}");
        }
    }
    let health = nvdra::dra::health::NodeHealth::new(node.clone(), NODE)
        .device_health()
        .await
        .unwrap();
    let unhealthy: Vec<(String, String)> = health
        .into_iter()
        .filter_map(|d| Some((d.device, d.problem?)))
        .collect();
    assert_eq!(
        unhealthy,
        [(
            sick_name.to_string(),
            format!(
                "XID 94 (contained ECC error) in GPU instance {}, compute instance {}",
                sick.gi_id, sick.ci_id
            )
        )]
    );
    assert!(handle.state().mig(&well.uuid).is_none());

    // A GPU-wide XID: every device of GPU 0.
    std::fs::write(
        &faults,
        format!("xid 0 94 gi={} ci={}\nxid 0 79\n", sick.gi_id, sick.ci_id),
    )
    .unwrap();
    eventually("GPU 0's fault", || handle.state().faults().count() == 1).await;
    node.changed().await.unwrap();
    for (name, t) in &published(&node) {
        let want: &[&str] = if name.starts_with("gpu-0-") {
            &["gpu.nvidia.com/xid=79:NoSchedule"]
        } else {
            &[]
        };
        assert_eq!(t, want, "{name}");
    }
    stop.cancel();
}
