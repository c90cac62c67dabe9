//! The health monitor through the NVML backend on the fake library (`tests/fake-nvml`, its
//! `events.rs`): an XID injected on GPU 0 (the A100 in MIG mode) reaches the health stream as
//! exactly GPU 0's MIG devices unhealthy and the slices as their taint; an ignored XID changes
//! nothing; recovery (quiet period, then a probe NVML answers) restores them; a GPU that stays
//! lost does not recover; one GPU whose event registration fails is the only one affected; an
//! XID the driver attributes to one MIG instance marks that MIG device alone, until the instance
//! is destroyed.
//!
//! The fake's event state is process-wide, so the tests here take turns ([`serial`]).

mod support;

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use kubelet_plugin::proto::health::v1alpha1::{
    HealthStatus, NodeWatchResourcesRequest, dra_resource_health_server::DraResourceHealth,
};
use nvdra::dra::health::NodeHealth;
use nvdra::dra::slices::{ConsumableShares, CounterLayout, SliceOptions, desired_slices};
use nvdra::health::{Cause, Monitor, MonitorHandle, Policy};
use nvdra::inventory::nvml::{LIBRARY, NvmlBackend};
use nvdra::inventory::owner::{self, InventoryHandle, Owner, Writes};
use nvdra::inventory::{DeviceBackend, GpuUuid, Reconfigure};
use tokio_util::sync::CancellationToken;

const SOON: Duration = Duration::from_secs(10);
const XID_EVENT: u64 = 0x8; // nvmlEventTypeXidCriticalError
const NVML_ERROR_UNKNOWN: u32 = 999;

async fn serial() -> tokio::sync::MutexGuard<'static, ()> {
    static TURN: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    TURN.lock().await
}

/// The fake under a driver root, NVML opened on it, and the hooks of the same loaded copy.
struct Fake {
    _root: tempfile::TempDir,
    backend: Arc<NvmlBackend>,
    lib: libloading::Library,
}

impl Fake {
    fn open() -> Self {
        let root = tempfile::tempdir().unwrap();
        let lib_dir = root.path().join("usr/lib64");
        std::fs::create_dir_all(&lib_dir).unwrap();
        let path = lib_dir.join(LIBRARY);
        std::os::unix::fs::symlink(support::fake_nvml::library(), &path).unwrap();
        let backend = Arc::new(NvmlBackend::open(root.path()).unwrap());
        // SAFETY: the fake library's initialisers are Rust statics; loading it again returns
        // the copy NVML already loaded.
        let lib = unsafe { libloading::Library::new(&path) }.unwrap();
        Self {
            _root: root,
            backend,
            lib,
        }
    }

    fn inject(&self, gpu: u32, event_type: u64, data: u64) {
        // SAFETY: the hook's C signature as `events.rs` of the fake declares it.
        let f: libloading::Symbol<extern "C" fn(u32, u64, u64) -> u32> =
            unsafe { self.lib.get(b"fake_nvml_inject_event") }.unwrap();
        assert_eq!(f(gpu, event_type, data), 0);
    }

    /// An event attributed to GPU instance `gi` (compute instance `ci`) of GPU `gpu`; the
    /// fake's answer (non-zero: refused, as the driver would never send it).
    fn inject_instance(&self, gpu: u32, event_type: u64, data: u64, gi: u32, ci: u32) -> u32 {
        // SAFETY: the hook's C signature as `events.rs` of the fake declares it.
        let f: libloading::Symbol<extern "C" fn(u32, u64, u64, u32, u32) -> u32> =
            unsafe { self.lib.get(b"fake_nvml_inject_instance_event") }.unwrap();
        f(gpu, event_type, data, gi, ci)
    }

    fn set_lost(&self, gpu: u32, lost: bool) {
        // SAFETY: as above.
        let f: libloading::Symbol<extern "C" fn(u32, i32) -> u32> =
            unsafe { self.lib.get(b"fake_nvml_set_lost") }.unwrap();
        assert_eq!(f(gpu, i32::from(lost)), 0);
    }

    fn fail_registration(&self, gpu: u32, code: u32) {
        // SAFETY: as above.
        let f: libloading::Symbol<extern "C" fn(u32, u32) -> u32> =
            unsafe { self.lib.get(b"fake_nvml_fail_registration") }.unwrap();
        assert_eq!(f(gpu, code), 0);
    }

    fn registrations(&self, gpu: u32) -> u32 {
        // SAFETY: as above.
        let f: libloading::Symbol<extern "C" fn(u32) -> u32> =
            unsafe { self.lib.get(b"fake_nvml_registrations") }.unwrap();
        f(gpu)
    }

    /// Starts `backend`'s event thread into `handle` and waits until it registered GPUs 0 and
    /// 1 (so an injected event is heard).
    async fn start_events(&self, backend: &Arc<dyn DeviceBackend>, handle: &MonitorHandle) {
        let before = (self.registrations(0), self.registrations(1));
        backend
            .start_health_events(Box::new(handle.events()))
            .expect("NVML has an event source")
            .expect("the event thread starts");
        let wait = async {
            while self.registrations(0) <= before.0 || self.registrations(1) <= before.1 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        };
        tokio::time::timeout(SOON, wait)
            .await
            .expect("the event thread registers GPUs 0 and 1");
    }

    fn uuid(&self, index: usize) -> GpuUuid {
        self.backend.snapshot().unwrap().gpus[index].uuid.clone()
    }

    /// A monitor fed by NVML's event thread, probing through NVML once `gate` is open.
    async fn monitor(
        &self,
        stop: &CancellationToken,
        gate: Arc<std::sync::atomic::AtomicBool>,
    ) -> (MonitorHandle, InventoryHandle) {
        let backend: Arc<dyn DeviceBackend> = self.backend.clone();
        // As `nvdra run` wires them: the monitor probes through the owner, which follows it.
        let hour = Duration::from_secs(3600);
        let (mut owner, inventory) = Owner::new(backend.clone(), hour, owner::DEADLINE).unwrap();
        let (monitor, handle) = Monitor::new(
            Policy {
                quiet_period: Duration::from_millis(300),
                probe_interval: Duration::from_millis(50),
                ..Policy::default()
            },
            Arc::new(Gated {
                open: gate,
                inner: inventory.clone(),
            }),
        );
        tokio::spawn(monitor.run(stop.clone()));
        self.start_events(&backend, &handle).await;
        // A failed first read is published, for the consumers to report.
        let _ = owner.read().await;
        tokio::spawn(owner.run(handle.subscribe(), stop.clone()));
        (handle.clone(), inventory)
    }
}

/// NVML's probe, failing until the test opens the gate (recovery when the test says).
struct Gated {
    open: Arc<std::sync::atomic::AtomicBool>,
    inner: InventoryHandle,
}

impl nvdra::health::Probe for Gated {
    fn probe(&self, gpu: &GpuUuid) -> Result<(), String> {
        if !self.open.load(std::sync::atomic::Ordering::SeqCst) {
            return Err("gate closed".into());
        }
        self.inner.probe(gpu)
    }

    fn mig_devices(&self) -> Option<std::collections::BTreeSet<nvdra::inventory::MigUuid>> {
        self.inner.mig_devices()
    }
}

/// Waits until the monitor's state satisfies `cond`.
async fn state(handle: &MonitorHandle, cond: impl Fn(&nvdra::health::HealthState) -> bool) {
    let mut w = handle.subscribe();
    tokio::time::timeout(SOON, w.wait_for(|s| cond(s)))
        .await
        .expect("the monitor's state")
        .unwrap();
}

#[tokio::test]
async fn an_xid_on_the_mig_gpu_reaches_the_stream_and_the_slices_and_recovery_restores_it() {
    let _turn = serial().await;
    let fake = Fake::open();
    let stop = CancellationToken::new();
    let gate = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (handle, monitored) = fake.monitor(&stop, gate.clone()).await;
    let svc = NodeHealth::new(monitored.subscribe(), "n")
        .service(Duration::from_secs(3600), stop.clone());
    let mut stream = svc
        .node_watch_resources(tonic::Request::new(NodeWatchResourcesRequest {}))
        .await
        .unwrap()
        .into_inner();
    let first = stream.next().await.unwrap().unwrap();
    assert!(
        first
            .devices
            .iter()
            .all(|d| d.health == HealthStatus::Healthy as i32)
    );

    // Ignored (31), then critical (79) on GPU 0: the next message is the critical one.
    fake.inject(0, XID_EVENT, 31);
    fake.inject(0, XID_EVENT, 79);
    let m = tokio::time::timeout(SOON, stream.next())
        .await
        .expect("a message on the change, long before the interval")
        .unwrap()
        .unwrap();
    let sick: Vec<(String, String)> = m
        .devices
        .iter()
        .filter(|d| d.health == HealthStatus::Unhealthy as i32)
        .map(|d| (d.device.clone().unwrap().device_name, d.message.clone()))
        .collect();
    let names: Vec<&str> = sick.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["gpu-0-mig-1g5gb-19-6", "gpu-0-mig-3g20gb-9-0"]);
    assert!(
        sick.iter()
            .all(|(_, m)| m == "XID 79 (GPU has fallen off the bus)")
    );
    assert_eq!(m.devices.len(), first.devices.len());

    // The slices: the same two devices tainted, nothing withdrawn.
    let inv = monitored.refresh().await.unwrap();
    let opts = SliceOptions {
        driver: "gpu.nvidia.com".into(),
        node_name: "n".into(),
        partitionable: false,
        shared_capacity: ConsumableShares::Disabled,
        dynamic_mig: false,
        mig_profiles: None,
        layout: CounterLayout::Separate,
    };
    let tainted: Vec<(String, String)> = desired_slices(&inv, &opts)
        .unwrap()
        .iter()
        .flat_map(|s| s.devices.clone().unwrap_or_default())
        .filter_map(|d| {
            let t = d.taints?.first()?.clone();
            Some((
                d.name,
                format!("{}={}:{}", t.key, t.value.unwrap_or_default(), t.effect),
            ))
        })
        .collect();
    assert_eq!(
        tainted,
        [
            (
                "gpu-0-mig-1g5gb-19-6".to_string(),
                "gpu.nvidia.com/xid=79:NoSchedule".to_string()
            ),
            (
                "gpu-0-mig-3g20gb-9-0".to_string(),
                "gpu.nvidia.com/xid=79:NoSchedule".to_string()
            )
        ]
    );

    // Recovery: NVML's probe answers after the quiet period.
    gate.store(true, std::sync::atomic::Ordering::SeqCst);
    let m = tokio::time::timeout(SOON, stream.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(
        m.devices
            .iter()
            .all(|d| d.health == HealthStatus::Healthy as i32)
    );
    assert!(handle.state().is_empty());
    stop.cancel();
}

/// Counts the probes of one GPU that failed.
struct Counting {
    inner: InventoryHandle,
    failed: tokio::sync::watch::Sender<u32>,
}

impl nvdra::health::Probe for Counting {
    fn probe(&self, gpu: &GpuUuid) -> Result<(), String> {
        let r = self.inner.probe(gpu);
        if r.is_err() {
            self.failed.send_modify(|n| *n += 1);
        }
        r
    }
}

#[tokio::test]
async fn a_lost_gpu_stays_unhealthy_until_nvml_finds_it() {
    let _turn = serial().await;
    let fake = Fake::open();
    let gpu1 = fake.uuid(1);
    // Lost before the monitor starts: its registration finds it gone.
    fake.set_lost(1, true);
    let stop = CancellationToken::new();
    let backend: Arc<dyn DeviceBackend> = fake.backend.clone();
    let (failed, mut failures) = tokio::sync::watch::channel(0);
    // The probe `nvdra run`'s monitor uses: the owner's (which need not have read for it).
    let hour = Duration::from_secs(3600);
    let (_owner, inventory) = Owner::new(backend.clone(), hour, owner::DEADLINE).unwrap();
    let (monitor, handle) = Monitor::new(
        Policy {
            quiet_period: Duration::from_millis(100),
            probe_interval: Duration::from_millis(20),
            ..Policy::default()
        },
        Arc::new(Counting {
            inner: inventory,
            failed,
        }),
    );
    tokio::spawn(monitor.run(stop.clone()));
    backend
        .start_health_events(Box::new(handle.events()))
        .unwrap()
        .unwrap();
    state(&handle, |s| !s.is_empty()).await;
    let faults: Vec<(GpuUuid, Cause)> = handle
        .state()
        .faults()
        .map(|(g, f)| (g.clone(), f.cause.clone()))
        .collect();
    assert_eq!(faults, [(gpu1.clone(), Cause::GpuLost)]);
    // Three probes after the quiet period failed: still unhealthy.
    tokio::time::timeout(SOON, failures.wait_for(|n| *n >= 3))
        .await
        .unwrap()
        .unwrap();
    assert!(!handle.state().is_empty());
    fake.set_lost(1, false);
    state(&handle, |s| s.is_empty()).await;
    stop.cancel();
}

#[tokio::test]
async fn a_gpu_whose_registration_fails_is_the_only_one_affected() {
    let _turn = serial().await;
    let fake = Fake::open();
    fake.fail_registration(2, NVML_ERROR_UNKNOWN);
    let stop = CancellationToken::new();
    let (handle, _) = fake
        .monitor(&stop, Arc::new(std::sync::atomic::AtomicBool::new(false)))
        .await;
    state(&handle, |s| !s.is_empty()).await;
    fake.fail_registration(2, 0);
    let faults: Vec<(GpuUuid, Cause)> = handle
        .state()
        .faults()
        .map(|(g, f)| (g.clone(), f.cause.clone()))
        .collect();
    assert_eq!(faults.len(), 1, "{faults:?}");
    assert_eq!(faults[0].0, fake.uuid(2));
    assert!(
        matches!(&faults[0].1, Cause::Unmonitored(r) if r.contains("nvmlDeviceRegisterEvents"))
    );
    // The others are still watched: an XID on GPU 1 is heard.
    fake.inject(1, XID_EVENT, 48);
    state(&handle, |s| s.faults().count() == 2).await;
    assert!(
        handle
            .state()
            .faults()
            .any(|(g, f)| *g == fake.uuid(1) && f.cause == Cause::Xid(48))
    );
    stop.cancel();
}

/// The devices of `inv`'s slices with a taint, and their first taint as `key=value:effect`.
fn tainted_devices(
    inv: &nvdra::inventory::Inventory,
    opts: &SliceOptions,
) -> Vec<(String, String)> {
    desired_slices(inv, opts)
        .unwrap()
        .iter()
        .flat_map(|s| s.devices.clone().unwrap_or_default())
        .filter_map(|d| {
            let t = d.taints?.first()?.clone();
            Some((
                d.name,
                format!("{}={}:{}", t.key, t.value.unwrap_or_default(), t.effect),
            ))
        })
        .collect()
}

/// Through NVML: an XID the fake attributes to GPU 0's 3g.20gb instance (its `gpuInstanceId`
/// and `computeInstanceId`, as the driver fills them) is that MIG device's fault alone: the
/// health stream and the partitionable slices show that device, not GPU 0's other instance nor
/// its free placements. The instance destroyed, its fault ends (though GPU 0's probe still
/// fails), and the instance made again on the same placement, with the same ids and a new UUID,
/// is healthy. The fake refuses what the driver would never send: ids on a GPU outside MIG
/// mode, of an instance that does not exist, or on an event other than an XID.
#[tokio::test]
async fn an_xid_in_one_mig_instance_taints_that_device_alone_until_it_is_destroyed() {
    const DOUBLE_BIT_ECC_EVENT: u64 = 0x2;
    let _turn = serial().await;
    let fake = Fake::open();
    let stop = CancellationToken::new();
    let gate = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (handle, monitored) = fake.monitor(&stop, gate).await;
    let svc = NodeHealth::new(monitored.subscribe(), "n")
        .service(Duration::from_secs(3600), stop.clone());
    let mut stream = svc
        .node_watch_resources(tonic::Request::new(NodeWatchResourcesRequest {}))
        .await
        .unwrap()
        .into_inner();
    let first = stream.next().await.unwrap().unwrap();
    let inv = fake.backend.snapshot().unwrap();
    let g0 = inv.gpus[0].clone();
    let sick = g0
        .mig
        .devices
        .iter()
        .find(|m| m.profile == "3g.20gb")
        .unwrap()
        .clone();
    assert!(g0.mig.devices.len() >= 2, "another instance beside it");

    assert_ne!(fake.inject_instance(1, XID_EVENT, 94, sick.gi_id, 0), 0);
    assert_ne!(
        fake.inject_instance(0, XID_EVENT, 94, sick.gi_id + 40, 0),
        0
    );
    assert_ne!(fake.inject_instance(0, XID_EVENT, 94, sick.gi_id, 5), 0);
    assert_ne!(
        fake.inject_instance(0, DOUBLE_BIT_ECC_EVENT, 0, sick.gi_id, 0),
        0
    );
    assert_eq!(
        fake.inject_instance(0, XID_EVENT, 94, sick.gi_id, sick.ci_id),
        0
    );
    state(&handle, |s| s.mig_faults().count() == 1).await;
    let s = handle.state();
    assert_eq!(s.faults().count(), 0, "not the GPU");
    let f = s
        .mig(&sick.uuid)
        .expect("a fault of the instance's MIG device");
    assert_eq!(
        (f.gpu.clone(), f.gpu_instance, f.compute_instance),
        (g0.uuid.clone(), sick.gi_id, Some(sick.ci_id))
    );
    assert_eq!(f.fault.cause, Cause::Xid(94));

    let m = tokio::time::timeout(SOON, stream.next())
        .await
        .expect("a message on the change")
        .unwrap()
        .unwrap();
    assert_eq!(m.devices.len(), first.devices.len());
    let sick_names: Vec<(String, String)> = m
        .devices
        .iter()
        .filter(|d| d.health == HealthStatus::Unhealthy as i32)
        .map(|d| (d.device.clone().unwrap().device_name, d.message.clone()))
        .collect();
    assert_eq!(
        sick_names,
        [(
            "gpu-0-mig-3g20gb-9-0".to_string(),
            format!(
                "XID 94 (contained ECC error) in GPU instance {}, compute instance {}",
                sick.gi_id, sick.ci_id
            )
        )]
    );

    let opts = SliceOptions {
        driver: "gpu.nvidia.com".into(),
        node_name: "n".into(),
        partitionable: true,
        shared_capacity: ConsumableShares::Disabled,
        dynamic_mig: false,
        mig_profiles: None,
        layout: CounterLayout::Separate,
    };
    let over = monitored.refresh().await.unwrap();
    assert_eq!(
        tainted_devices(&over, &opts),
        [(
            "gpu-0-mig-3g20gb-9-0".to_string(),
            "gpu.nvidia.com/xid=94:NoSchedule".to_string()
        )]
    );
    let published = desired_slices(&over, &opts).unwrap();
    let gpu0_devices = published
        .iter()
        .flat_map(|s| s.devices.iter().flatten())
        .filter(|d| d.name.starts_with("gpu-0-mig-"))
        .count();
    assert!(
        gpu0_devices > 2,
        "free placements of GPU 0 are published, clean"
    );

    // Destroyed (through the write handle, as prepare's undo does: the owner reads again): the
    // fault ends at the next probe, though GPU 0's probe fails.
    let writes = Writes::new(fake.backend.clone(), monitored.clone());
    writes.destroy_mig(&g0.uuid, &sick.uuid).unwrap();
    state(&handle, |s| s.is_empty()).await;
    let again = fake
        .backend
        .create_mig(&g0.uuid, sick.gi_profile_id, sick.placement)
        .unwrap();
    assert_eq!(again.gi_id, sick.gi_id, "the same ids");
    assert_ne!(again.uuid, sick.uuid, "a new UUID");
    let over = monitored.refresh().await.unwrap();
    assert!(tainted_devices(&over, &opts).is_empty());
    let m = tokio::time::timeout(SOON, stream.next())
        .await
        .expect("a message on the change")
        .unwrap()
        .unwrap();
    assert!(
        m.devices
            .iter()
            .all(|d| d.health == HealthStatus::Healthy as i32)
    );
    stop.cancel();
}
