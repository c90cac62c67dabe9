//! Shares of MIG devices (`--shared-capacity`, `--consumable-shares`): each existing MIG device
//! is shared under an MPS daemon of its own, keyed by its UUID, held per process (NVIDIA's memory
//! partitioning excludes MIG), and its GPU's compute mode is left alone (it is the GPU's, and
//! the GPU's other MIG devices may be used by others).

use super::shares::share;
use super::*;
use crate::ids::DeviceName;
use crate::inventory::{ComputeMode, DeviceUuid, MigDevice};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

/// A plugin in share `mode` on the a100-mig-mixed profile (GPU 1 in MIG mode, with a 3g.20gb
/// device at placement 4 among others).
async fn env_in(mode: &str) -> Env {
    let mode: ConsumableShares = mode.parse().unwrap();
    env_tweaked("a100-mig-mixed", |o| {
        o.shared_capacity = mode;
        o.partitionable = false;
    })
    .await
}

/// GPU 1's MIG devices, each with its published name.
fn migs(e: &Env) -> (crate::inventory::GpuUuid, Vec<(String, MigDevice)>) {
    let inv = e.sim.snapshot().unwrap();
    let g = inv.gpu_by_minor(1).unwrap();
    let named = g
        .mig
        .devices
        .iter()
        .map(|m| {
            let name = DeviceName::mig(g.minor, &m.profile, m.gi_profile_id, m.placement.start);
            (name.to_string(), m.clone())
        })
        .collect();
    (g.uuid.clone(), named)
}

/// Two shares of one MIG device run under one daemon, the MIG device's: its pipe directory in
/// both specs, its UUID the daemon's only device, each share held per process to its memory
/// (of the MIG device's), the parent GPU's compute mode untouched; a share of another MIG
/// device of the same GPU gets a daemon of its own; the daemon goes with its last share.
#[tokio::test]
async fn shares_of_a_mig_device_run_under_its_own_daemon_and_leave_the_gpu_alone() {
    let e = env_in("memory").await;
    let _host = e.mps_host();
    let (gpu, migs) = migs(&e);
    let (name, mig) = migs.iter().find(|(_, m)| m.profile == "3g.20gb").unwrap();
    let (other_name, other) = migs.iter().find(|(_, m)| m.profile == "2g.10gb").unwrap();
    let mode_before = e.sim.compute_mode(&gpu).unwrap();
    e.add(claim("a", vec![share("nb", name, "4Gi")]));
    e.add(claim("b", vec![share("nb", name, "8Gi")]));
    e.add(claim("c", vec![share("nb", other_name, "2Gi")]));
    for uid in ["a", "b", "c"] {
        let d = e.prepare(uid).await.unwrap();
        assert!(d[0].consumed.is_some(), "{uid}: a share");
    }
    let key = DeviceUuid::Mig(mig.uuid.clone());
    let pipe = e.plugin.inner.mps.shares_pipe_dir(&key);
    assert!(
        pipe.starts_with(e.dir.path().join("mps"))
            && pipe
                .parent()
                .unwrap()
                .file_name()
                .unwrap()
                .to_str()
                .unwrap()
                .starts_with("m-"),
        "{}",
        pipe.display()
    );
    for uid in ["a", "b"] {
        let spec = std::fs::read_to_string(e.spec(uid)).unwrap();
        assert!(spec.contains(pipe.to_str().unwrap()), "{uid}: {spec}");
    }
    // 4Gi of a 19968Mi device less its part of the MPS server's reserve: 4096 × 18944/19968.
    let spec = std::fs::read_to_string(e.spec("a")).unwrap();
    assert!(
        spec.contains("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=3885M"),
        "{spec}"
    );
    assert!(
        !spec.contains("memory-limit-hook"),
        "per process on MIG: {spec}"
    );
    let other_pipe = e
        .plugin
        .inner
        .mps
        .shares_pipe_dir(&DeviceUuid::Mig(other.uuid.clone()));
    assert_ne!(other_pipe, pipe);
    let spec = std::fs::read_to_string(e.spec("c")).unwrap();
    assert!(spec.contains(other_pipe.to_str().unwrap()), "{spec}");
    // One daemon per MIG device, each seeing that device alone; none for the GPU.
    let log = std::fs::read_to_string(e.dir.path().join("driver/mps.log")).unwrap();
    let started: Vec<&str> = log.lines().filter(|l| l.starts_with("start ")).collect();
    assert_eq!(
        started,
        vec![
            format!("start {} {}", mig.uuid, pipe.display()),
            format!("start {} {}", other.uuid, other_pipe.display()),
        ],
        "{log}"
    );
    assert!(!e.plugin.inner.mps.gpu_requested(&gpu));
    assert_eq!(
        e.sim.compute_mode(&gpu).unwrap(),
        mode_before,
        "the compute mode is the GPU's: a MIG device's shares leave it alone"
    );
    assert_ne!(mode_before, ComputeMode::ExclusiveProcess);

    e.unprepare("a").await.unwrap();
    assert!(
        e.plugin.inner.mps.shares_requested(&key),
        "b still shares it"
    );
    e.unprepare("b").await.unwrap();
    assert!(
        !e.plugin.inner.mps.shares_requested(&key),
        "released after its last share"
    );
    assert!(
        e.plugin
            .inner
            .mps
            .shares_requested(&DeviceUuid::Mig(other.uuid.clone()))
    );
    e.unprepare("c").await.unwrap();
    assert_eq!(e.sim.compute_mode(&gpu).unwrap(), mode_before);
}

/// A share of a MIG device and a claim of the MIG device whole exclude each other (the node
/// refuses what a stale scheduler placed), and shares of one MIG device are counted against its
/// memory, not the GPU's.
#[tokio::test]
async fn a_mig_share_and_the_whole_mig_device_exclude_each_other_and_fit_its_memory() {
    let e = env_in("memory").await;
    let _host = e.mps_host();
    let (_, migs) = migs(&e);
    let (name, _) = migs.iter().find(|(_, m)| m.profile == "3g.20gb").unwrap();
    e.add(claim("s", vec![share("nb", name, "8Gi")]));
    e.add(claim("w", vec![result("gpu", name)]));
    e.prepare("s").await.unwrap();
    let err = e.prepare("w").await.unwrap_err();
    assert!(matches!(err, ClaimError::WholeGpuOnShares { .. }), "{err}");
    assert!(err.to_string().contains(name.as_str()), "{err}");
    // 8Gi + 12Gi is more than the 19968Mi of the MIG device.
    e.add(claim("t", vec![share("nb", name, "12Gi")]));
    let err = e.prepare("t").await.unwrap_err();
    assert!(matches!(err, ClaimError::OverCapacity { .. }), "{err}");
    assert!(
        err.to_string().contains(name.as_str()),
        "names the MIG device: {err}"
    );
    e.unprepare("s").await.unwrap();
    e.prepare("w").await.unwrap();
    let err = e.prepare("s").await.unwrap_err();
    assert!(matches!(err, ClaimError::ShareOnWholeGpu { .. }), "{err}");
}

/// The last round the watch reported, published to the plugin ([`publish_round`]).
struct LastRound(
    Mutex<Option<(BTreeMap<DeviceUuid, bool>, crate::health::DaemonsDown)>>,
    tokio::sync::watch::Sender<crate::inventory::health::HealthState>,
);

impl DaemonReport for LastRound {
    fn report(&self, up: &BTreeMap<DeviceUuid, bool>, down: &crate::health::DaemonsDown) {
        *lock(&self.0) = Some((up.clone(), down.clone()));
        publish_round(&self.1, up, down);
    }
}

/// The watch asks a MIG device's share daemon, not its GPU's: one that stops answering is
/// reported down by the MIG UUID, taints that MIG device alone, and refuses new shares of it
/// naming the MIG device, until it answers again.
#[tokio::test]
async fn the_watch_reports_a_mig_devices_daemon_and_taints_only_that_mig_device() {
    let e = env_in("memory").await;
    let host = e.mps_host();
    let (gpu, migs) = migs(&e);
    let (name, mig) = migs.iter().find(|(_, m)| m.profile == "3g.20gb").unwrap();
    e.add(claim("a", vec![share("nb", name, "4Gi")]));
    e.add(claim("b", vec![share("nb", name, "4Gi")]));
    e.prepare("a").await.unwrap();
    let key = DeviceUuid::Mig(mig.uuid.clone());
    let report = LastRound(Mutex::default(), e._stop.health.clone());
    e.plugin.probe_share_daemons(&report).await;
    e.settled().await;
    let (up, down) = lock(&report.0).clone().unwrap();
    assert_eq!(up, BTreeMap::from([(key.clone(), true)]));
    assert!(down.is_empty());

    drop(host);
    let pipe = e.plugin.inner.mps.shares_pipe_dir(&key);
    std::fs::remove_file(pipe.join("answering")).unwrap();
    e.plugin.probe_share_daemons(&report).await;
    e.settled().await;
    let (up, down) = lock(&report.0).clone().unwrap();
    assert_eq!(up, BTreeMap::from([(key.clone(), false)]));
    assert_eq!(down.keys().collect::<Vec<_>>(), vec![&key]);
    let err = e.prepare("b").await.unwrap_err();
    assert!(matches!(err, ClaimError::ShareDaemonDown { .. }), "{err}");
    assert!(
        err.to_string()
            .contains(&format!("MPS control daemon of MIG device {}", mig.uuid)),
        "{err}"
    );
    // As the health monitor lays it over the inventory: that MIG device is tainted, its GPU
    // and the GPU's other MIG devices are not.
    let (monitor, handle) = crate::health::Monitor::new(
        crate::health::Policy::default(),
        Arc::new(e._stop.inventory.clone()),
    );
    let stop = CancellationToken::new();
    tokio::spawn(monitor.run(stop.clone()));
    let mut watch = handle.subscribe();
    handle.report_share_daemons(Default::default(), down);
    watch.changed().await.unwrap();
    let mut inv = e.sim.snapshot().unwrap();
    watch.borrow_and_update().apply(&mut inv);
    let g = inv.gpu_by_uuid(gpu.as_str()).unwrap();
    assert!(g.health.is_healthy());
    for m in &g.mig.devices {
        assert_eq!(
            !m.health.is_healthy(),
            m.uuid == mig.uuid,
            "{}: {:?}",
            m.uuid,
            m.health
        );
    }
    stop.cancel();

    let _host = e.mps_host();
    mps::tests::eventually("the host starts the daemon again", || {
        pipe.join("answering").exists()
    });
    e.plugin.probe_share_daemons(&report).await;
    e.settled().await;
    assert!(lock(&report.0).as_ref().unwrap().1.is_empty());
    e.prepare("b").await.unwrap();
}

/// In integer mode a MIG device's share is held to its part of the MIG device, not of the GPU:
/// 1 of 4 shares of a 19968Mi 3g.20gb device is 4992Mi (less its part of the MPS server's
/// reserve) and 25% of its SMs.
#[tokio::test]
async fn an_integer_share_of_a_mig_device_is_its_part_of_the_mig_device() {
    let e = env_in("4").await;
    let _host = e.mps_host();
    let (_, migs) = migs(&e);
    let (name, _) = migs.iter().find(|(_, m)| m.profile == "3g.20gb").unwrap();
    let allocated = DeviceRequestAllocationResult {
        consumed_capacity: Some(BTreeMap::from([
            ("memory".to_string(), Quantity("0".into())),
            ("shares".to_string(), Quantity("1".into())),
            ("multiprocessors".to_string(), Quantity("0".into())),
        ])),
        ..share("mig", name, "0")
    };
    e.add(claim("a", vec![allocated]));
    let d = e.prepare("a").await.unwrap();
    assert_eq!(
        d[0].consumed.unwrap().shares,
        Some(crate::ledger::Shares { count: 1, of: 4 })
    );
    let spec = std::fs::read_to_string(e.spec("a")).unwrap();
    // 4992 MiB × 18944/19968 = 4736 MiB.
    assert!(
        spec.contains("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=4736M"),
        "{spec}"
    );
    assert!(
        spec.contains("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25"),
        "{spec}"
    );
}
