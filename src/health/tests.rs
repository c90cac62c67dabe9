use std::sync::atomic::{AtomicBool, Ordering};

use std::sync::Arc;

use tokio::time::Instant;

use super::faults::{Command, FaultFile, LineError, parse_line};
use super::*;
use crate::inventory::owner::{InventoryHandle, Owner};
use crate::inventory::sim::SimBackend;
use crate::inventory::{
    DeviceBackend, GpuUuid, Health, Inventory, MigUuid, Reconfigure, Taint, TaintKey,
};
use tokio_util::sync::CancellationToken;

fn sim() -> SimBackend {
    SimBackend::from_profile("dgx-a100-mig", "n").unwrap()
}

/// `sim`'s inventory owner, not read yet, and its handle: the probe `nvdra run`'s monitor uses.
fn owner(sim: &SimBackend) -> (Owner, InventoryHandle) {
    // Reads answer in real time, while a paused clock jumps from timer to timer (the
    // monitor's probes): a deadline that none of those jumps reaches.
    let (hour, year) = (Duration::from_secs(3600), Duration::from_secs(365 * 86400));
    Owner::new(Arc::new(sim.clone()), hour, year).unwrap()
}

fn uuid(sim: &SimBackend, index: usize) -> GpuUuid {
    sim.snapshot().unwrap().gpus[index].uuid.clone()
}

/// A probe a test switches between answering and not.
#[derive(Default)]
struct Switch(AtomicBool);

impl Probe for Switch {
    fn probe(&self, _: &GpuUuid) -> Result<(), String> {
        if self.0.load(Ordering::SeqCst) {
            Ok(())
        } else {
            Err("down".into())
        }
    }
}

fn policy() -> Policy {
    Policy {
        quiet_period: Duration::from_secs(60),
        probe_interval: Duration::from_secs(10),
        ..Policy::default()
    }
}

#[test]
fn the_default_policy_ignores_application_xids_only() {
    let p = Policy::default();
    for x in DEFAULT_IGNORED_XIDS {
        assert_eq!(p.judge(&EventKind::Xid(x)), None, "XID {x}");
    }
    assert_eq!(
        p.judge(&EventKind::Xid(79)),
        Some((Cause::Xid(79), TaintEffect::NoSchedule))
    );
    assert_eq!(
        p.judge(&EventKind::DoubleBitEcc),
        Some((Cause::DoubleBitEcc, TaintEffect::NoSchedule))
    );
    assert_eq!(
        p.judge(&EventKind::GpuLost),
        Some((Cause::GpuLost, TaintEffect::NoSchedule))
    );
}

#[test]
fn overrides_win_over_the_ignore_list() {
    let p = Policy {
        overrides: parse_overrides("13=NoSchedule, 94=ignore,79=NoExecute").unwrap(),
        ..Policy::default()
    };
    assert_eq!(
        p.judge(&EventKind::Xid(13)),
        Some((Cause::Xid(13), TaintEffect::NoSchedule))
    );
    assert_eq!(p.judge(&EventKind::Xid(94)), None);
    assert_eq!(
        p.judge(&EventKind::Xid(79)),
        Some((Cause::Xid(79), TaintEffect::NoExecute))
    );
    // A lost GPU takes XID 79's effect.
    assert_eq!(
        p.judge(&EventKind::GpuLost),
        Some((Cause::GpuLost, TaintEffect::NoExecute))
    );
    let p = Policy {
        overrides: parse_overrides("48=ignore").unwrap(),
        ..Policy::default()
    };
    assert_eq!(p.judge(&EventKind::DoubleBitEcc), None);
}

#[test]
fn settings_strings_parse_or_name_the_bad_value() {
    assert_eq!(
        parse_xids("13, 31,,43").unwrap(),
        [13, 31, 43].into_iter().collect()
    );
    assert!(parse_xids("").unwrap().is_empty());
    assert_eq!(parse_xids("13,x"), Err(Error::BadXid("x".into())));
    assert_eq!(parse_overrides("79"), Err(Error::BadOverride("79".into())));
    assert_eq!(
        parse_overrides("79=sometimes"),
        Err(Error::BadOverride("79=sometimes".into()))
    );
    assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
    assert_eq!(parse_duration("30s").unwrap(), Duration::from_secs(30));
    assert_eq!(parse_duration("45").unwrap(), Duration::from_secs(45));
    assert_eq!(parse_duration("5m").unwrap(), Duration::from_secs(300));
    assert_eq!(parse_duration("1h").unwrap(), Duration::from_secs(3600));
    assert_eq!(
        parse_duration("5 min"),
        Err(Error::BadDuration("5 min".into()))
    );
    assert!(
        Error::BadOverride("79".into())
            .to_string()
            .contains("\"79\"")
    );
}

#[tokio::test(start_paused = true)]
async fn an_xid_makes_exactly_that_gpu_unhealthy_and_recovery_restores_it() {
    let sim = sim();
    let probe = Arc::new(Switch::default());
    let (monitor, handle) = Monitor::new(policy(), probe.clone());
    let stop = CancellationToken::new();
    tokio::spawn(monitor.run(stop.clone()));
    let mut watch = handle.subscribe();
    let gpu3 = uuid(&sim, 3);

    // An ignored XID first: the first change the watch sees must be the critical one.
    let tx = handle.events();
    tx.send(Event::gpu(uuid(&sim, 1), EventKind::Xid(13)))
        .await
        .unwrap();
    tx.send(Event::gpu(gpu3.clone(), EventKind::Xid(79)))
        .await
        .unwrap();
    watch.changed().await.unwrap();
    let state = watch.borrow_and_update().clone();
    let faults: Vec<(&GpuUuid, &Fault)> = state.faults().collect();
    assert_eq!(faults.len(), 1, "{faults:?}");
    assert_eq!(faults[0].0, &gpu3);
    assert_eq!(faults[0].1.cause, Cause::Xid(79));
    assert_eq!(faults[0].1.xid, Some(79));
    assert_eq!(
        faults[0].1.cause.to_string(),
        "XID 79 (GPU has fallen off the bus)"
    );

    // The overlay: GPU 3 tainted, its MIG devices follow it where devices are derived, the
    // others untouched.
    let mut inv = sim.snapshot().unwrap();
    state.apply(&mut inv);
    for g in &inv.gpus {
        if g.uuid == gpu3 {
            assert_eq!(
                g.health,
                Health::Tainted {
                    reason: "XID 79 (GPU has fallen off the bus)".into(),
                    taint: Taint {
                        key: TaintKey::Xid(79),
                        effect: TaintEffect::NoSchedule
                    }
                }
            );
        } else {
            assert!(g.health.is_healthy(), "{}", g.index);
        }
    }

    // The probe fails: after the quiet period the GPU stays unhealthy.
    tokio::time::sleep(Duration::from_secs(120)).await;
    assert!(!handle.state().is_empty());
    // It answers again: healthy at the next probe, and the watch says so.
    probe.0.store(true, Ordering::SeqCst);
    watch.changed().await.unwrap();
    assert!(watch.borrow_and_update().is_empty());
    stop.cancel();
}

#[tokio::test(start_paused = true)]
async fn a_new_critical_event_postpones_recovery_by_the_quiet_period() {
    let sim = sim();
    let probe = Arc::new(Switch(AtomicBool::new(true)));
    let (monitor, handle) = Monitor::new(policy(), probe);
    let stop = CancellationToken::new();
    tokio::spawn(monitor.run(stop.clone()));
    let mut watch = handle.subscribe();
    let gpu = uuid(&sim, 0);
    let tx = handle.events();
    let start = Instant::now();
    tx.send(Event::gpu(gpu.clone(), EventKind::DoubleBitEcc))
        .await
        .unwrap();
    watch.changed().await.unwrap();
    tokio::time::sleep(Duration::from_secs(50)).await;
    tx.send(Event::gpu(gpu.clone(), EventKind::Xid(48)))
        .await
        .unwrap();
    watch.changed().await.unwrap();
    assert!(watch.borrow().is_empty());
    // Healthy no sooner than the quiet period after the second event (paused time: exact).
    assert!(
        start.elapsed() >= Duration::from_secs(110),
        "{:?}",
        start.elapsed()
    );
    stop.cancel();
}

#[test]
fn fault_file_lines_name_gpus_by_index_or_uuid() {
    let sim = sim();
    let inv = sim.snapshot().unwrap();
    let g3 = inv.gpus[3].uuid.clone();
    assert_eq!(
        parse_line("xid 3 79  # fell off", &inv),
        Ok(Some(Command::Event(Event::gpu(
            g3.clone(),
            EventKind::Xid(79)
        ))))
    );
    assert_eq!(
        parse_line(&format!("ecc {g3}"), &inv),
        Ok(Some(Command::Event(Event::gpu(
            g3.clone(),
            EventKind::DoubleBitEcc
        ))))
    );
    assert_eq!(
        parse_line("lost 3", &inv),
        Ok(Some(Command::Lost(g3.clone())))
    );
    assert_eq!(parse_line("back 3", &inv), Ok(Some(Command::Back(g3))));
    assert_eq!(parse_line("   # nothing", &inv), Ok(None));
    // The simulated backend's processes: not faults.
    assert_eq!(parse_line("process 3 4242 2048", &inv), Ok(None));
    assert_eq!(parse_line("exit 3 4242", &inv), Ok(None));
    assert_eq!(parse_line("holder 3 900 nv-hostengine", &inv), Ok(None));
    assert_eq!(
        parse_line("xid 99 79", &inv),
        Err(LineError::NoGpu("99".into()))
    );
    assert_eq!(
        parse_line("xid 3 x", &inv),
        Err(LineError::BadXid("x".into()))
    );
    assert!(matches!(
        parse_line("reboot 3", &inv),
        Err(LineError::Unknown(_))
    ));
}

#[tokio::test(start_paused = true)]
async fn the_fault_file_drives_the_monitor_and_lost_gpus_fail_their_probe() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("faults");
    let sim = sim();
    let (mut owner, inventory) = owner(&sim);
    let file = FaultFile::new(path.clone(), Arc::new(inventory));
    let (monitor, handle) = Monitor::new(policy(), file.probe());
    let stop = CancellationToken::new();
    tokio::spawn(monitor.run(stop.clone()));
    owner.read().await.unwrap();
    let node = crate::inventory::owner::Published {
        node: Some(Arc::new(sim.snapshot().unwrap())),
        ..Default::default()
    };
    let node = tokio::sync::watch::channel(node).1;
    tokio::spawn(file.run(handle.events(), node, stop.clone()));
    let mut watch = handle.subscribe();

    std::fs::write(&path, "xid 2 13\nlost 3\n").unwrap();
    watch.changed().await.unwrap();
    let state = watch.borrow_and_update().clone();
    let faults: Vec<_> = state
        .faults()
        .map(|(g, f)| (g.clone(), f.cause.clone()))
        .collect();
    assert_eq!(faults, vec![(uuid(&sim, 3), Cause::GpuLost)]);

    // Lost: no recovery however long it is quiet, until the file says it is back.
    tokio::time::sleep(Duration::from_secs(600)).await;
    assert!(!handle.state().is_empty());
    std::fs::write(&path, "xid 2 13\nlost 3\nback 3\n").unwrap();
    watch.changed().await.unwrap();
    assert!(watch.borrow_and_update().is_empty());
    stop.cancel();
}

#[tokio::test(start_paused = true)]
async fn every_xid_is_counted_per_gpu_and_xid_the_ignored_ones_too() {
    let sim = sim();
    let (monitor, handle) = Monitor::new(policy(), Arc::new(Switch::default()));
    let stop = CancellationToken::new();
    tokio::spawn(monitor.run(stop.clone()));
    let mut watch = handle.subscribe();
    let (g0, g1) = (uuid(&sim, 0), uuid(&sim, 1));
    let tx = handle.events();
    for (gpu, kind) in [
        (&g0, EventKind::Xid(13)),
        (&g1, EventKind::Xid(13)),
        (&g0, EventKind::Xid(13)),
        (&g0, EventKind::GpuLost),
        // Critical, so the watch moves: every event before it has been handled by then.
        (&g1, EventKind::DoubleBitEcc),
    ] {
        tx.send(Event::gpu(gpu.clone(), kind)).await.unwrap();
    }
    // GpuLost on g0 changes the watch first, then the ECC error on g1.
    while matches!(watch.borrow_and_update().gpu(&g1), GpuHealth::Healthy) {
        watch.changed().await.unwrap();
    }
    let want: XidCounts = [
        ((g0.clone(), 13), 2),
        ((g1.clone(), 13), 1),
        ((g1.clone(), XID_DOUBLE_BIT_ECC), 1),
    ]
    .into_iter()
    .collect();
    assert_eq!(handle.xid_counts(), want);
    stop.cancel();
}

/// The share-daemon watch's reports reach every consumer as health: a GPU whose daemon does not
/// answer is published with the `mps-daemon-down` NoSchedule taint, a fault's taint wins, and a
/// daemon back up lifts it.
#[tokio::test(start_paused = true)]
async fn a_share_daemon_down_taints_its_gpu_until_reported_up() {
    use crate::dra::slices::{CounterLayout, SliceOptions, desired_slices};
    // Whole GPUs (shares are of GPUs outside MIG mode).
    let sim = SimBackend::from_profile("dgx-h100", "n").unwrap();
    let (monitor, handle) = Monitor::new(policy(), Arc::new(Switch::default()));
    let stop = CancellationToken::new();
    tokio::spawn(monitor.run(stop.clone()));
    let mut watch = handle.subscribe();
    let (gpu0, gpu1) = (uuid(&sim, 0), uuid(&sim, 1));
    let since = std::time::SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);

    handle.report_share_daemons(
        Default::default(),
        DaemonsDown::from([
            (crate::inventory::DeviceUuid::Gpu(gpu0.clone()), since),
            (crate::inventory::DeviceUuid::Gpu(gpu1.clone()), since),
        ]),
    );
    watch.changed().await.unwrap();
    handle
        .events()
        .send(Event::gpu(gpu1.clone(), EventKind::Xid(79)))
        .await
        .unwrap();
    watch.changed().await.unwrap();
    let state = watch.borrow_and_update().clone();
    assert_eq!(state.daemons_down().len(), 2);
    let mut inv = sim.snapshot().unwrap();
    state.apply(&mut inv);
    let taint_of = |i: usize| match &inv.gpus[i].health {
        Health::Tainted { taint, .. } => Some(taint.key),
        _ => None,
    };
    assert_eq!(taint_of(0), Some(TaintKey::MpsDaemonDown));
    assert_eq!(taint_of(1), Some(TaintKey::Xid(79)), "a fault's taint wins");
    assert_eq!(taint_of(2), None);
    // As published: the device keeps its place in the slice, tainted NoSchedule.
    let opts = SliceOptions {
        driver: "gpu.nvidia.com".into(),
        node_name: "n1".into(),
        partitionable: false,
        shared_capacity: crate::dra::slices::ConsumableShares::Disabled,
        dynamic_mig: false,
        mig_profiles: None,
        layout: CounterLayout::Separate,
    };
    let slices = desired_slices(&inv, &opts).unwrap();
    let device = slices
        .iter()
        .flat_map(|s| s.devices.iter().flatten())
        .find(|d| d.name == format!("gpu-{}", inv.gpus[0].minor))
        .unwrap();
    let taints = device.taints.as_ref().unwrap();
    assert_eq!(taints.len(), 1);
    assert_eq!(taints[0].key, "gpu.nvidia.com/mps-daemon-down");
    assert_eq!(taints[0].effect, "NoSchedule");
    assert_eq!(taints[0].value, None);

    // GPU 0's daemon back up lifts its taint.
    handle.report_share_daemons(
        Default::default(),
        DaemonsDown::from([(crate::inventory::DeviceUuid::Gpu(gpu1.clone()), since)]),
    );
    watch.changed().await.unwrap();
    let state = watch.borrow_and_update().clone();
    let mut inv = sim.snapshot().unwrap();
    state.apply(&mut inv);
    assert!(inv.gpus[0].health.is_healthy());
    assert!(!watch.has_changed().unwrap());
    stop.cancel();
}

/// A recovery probe that hangs (NVML stuck) does not stop the monitor: through the inventory
/// owner's handle it gives up at the deadline, the GPU stays unhealthy, and the monitor goes on
/// judging events; once the probe returns, the GPU can recover.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_probe_that_hangs_is_given_up_at_its_deadline_and_the_monitor_goes_on() {
    use crate::inventory::sim::SimCall;
    let sim = sim();
    let (mut owner, inventory) = Owner::new(
        Arc::new(sim.clone()),
        Duration::from_secs(3600),
        Duration::from_secs(60),
    )
    .unwrap();
    owner.read().await.unwrap();
    let watched = inventory.with_call_deadline(Duration::from_secs(2));
    let policy = Policy {
        quiet_period: Duration::ZERO,
        probe_interval: Duration::from_millis(20),
        ..Policy::default()
    };
    let (monitor, handle) = Monitor::new(policy, Arc::new(watched.clone()));
    let stop = CancellationToken::new();
    tokio::spawn(monitor.run(stop.clone()));
    let (gpu0, gpu1) = (uuid(&sim, 0), uuid(&sim, 1));
    let held = sim.hold(SimCall::Probe);
    let tx = handle.events();
    tx.send(Event::gpu(gpu0.clone(), EventKind::Xid(79)))
        .await
        .unwrap();
    // The probe of GPU 0 starts and hangs; the monitor gives up on it and hears the next event.
    let wait = |pred: Box<dyn Fn(&HealthState) -> bool + Send>| {
        let mut w = handle.subscribe();
        async move {
            tokio::time::timeout(Duration::from_secs(60), w.wait_for(|s| pred(s)))
                .await
                .expect("the monitor answers")
                .unwrap();
        }
    };
    let overdue = watched.clone();
    tokio::time::timeout(Duration::from_secs(60), async {
        while overdue.overdue().is_empty() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the probe passes its deadline");
    tx.send(Event::gpu(gpu1.clone(), EventKind::Xid(79)))
        .await
        .unwrap();
    let g1 = gpu1.clone();
    wait(Box::new(move |s| {
        matches!(s.gpu(&g1), GpuHealth::Unhealthy(_))
    }))
    .await;
    assert!(matches!(handle.state().gpu(&gpu0), GpuHealth::Unhealthy(_)));

    // The probe returns: both GPUs answer their next probes and recover.
    drop(held);
    wait(Box::new(|s| s.is_empty())).await;
    stop.cancel();
}

/// a100-mig-mixed with a second compute instance (ci 1) in GPU 1's 3g.20gb GPU instance: two
/// MIG devices on the same memory slices.
fn two_compute_instances() -> SimBackend {
    let sim = SimBackend::from_profile("a100-mig-mixed", "n").unwrap();
    sim.update(|inv| {
        let g = &mut inv.gpus[1];
        let mut ci1 = g
            .mig
            .devices
            .iter()
            .find(|m| m.profile == "3g.20gb")
            .unwrap()
            .clone();
        ci1.ci_id = 1;
        ci1.uuid = MigUuid("MIG-3g-ci1".into());
        g.mig.devices.push(ci1);
    });
    sim
}

/// NVML's answer for an XID in GPU 1's MIG device `profile` (its GPU instance, and its compute
/// instance 0 when `ci`), with the devices the source found for those ids.
fn instance_event(inv: &Inventory, profile: &str, ci: bool, xid: u64) -> Event {
    let g = &inv.gpus[1];
    let m = g
        .mig
        .devices
        .iter()
        .find(|m| m.profile == profile && m.ci_id == 0)
        .unwrap();
    let compute_instance = ci.then_some(0);
    Event {
        gpu: g.uuid.clone(),
        kind: EventKind::Xid(xid),
        instance: Some(Instance {
            gpu_instance: m.gi_id,
            compute_instance,
            devices: g
                .mig
                .devices
                .iter()
                .filter(|d| d.gi_id == m.gi_id && compute_instance.is_none_or(|c| c == d.ci_id))
                .map(|d| d.uuid.clone())
                .collect(),
        }),
    }
}

/// The taint key of each MIG device of GPU `index`, by profile and compute instance.
fn mig_taints(inv: &Inventory, index: usize) -> Vec<(String, u32, u32, Option<TaintKey>)> {
    inv.gpus[index]
        .mig
        .devices
        .iter()
        .map(|m| {
            let key = match &m.health {
                Health::Tainted { taint, .. } => Some(taint.key),
                _ => None,
            };
            (m.profile.clone(), m.placement.start, m.ci_id, key)
        })
        .collect()
}

/// An XID that NVML attributes to one compute instance marks that MIG device, and the one other
/// compute instance of its GPU instance (same memory slices), and nothing else: not the GPU,
/// not its other MIG devices, not another GPU. The whole GPU, which takes every slice, counts as
/// hit where it is handed out whole.
#[tokio::test(start_paused = true)]
async fn an_xid_in_one_mig_instance_marks_the_devices_on_its_memory_slices_only() {
    let sim = two_compute_instances();
    let inv = sim.snapshot().unwrap();
    let (monitor, handle) = Monitor::new(policy(), Arc::new(Switch::default()));
    let stop = CancellationToken::new();
    tokio::spawn(monitor.run(stop.clone()));
    let mut watch = handle.subscribe();
    handle
        .events()
        .send(instance_event(&inv, "3g.20gb", true, 94))
        .await
        .unwrap();
    watch.changed().await.unwrap();
    let state = watch.borrow_and_update().clone();
    assert_eq!(state.faults().count(), 0, "no GPU fault");
    let hit: Vec<(&MigUuid, String)> = state.mig_faults().map(|(m, f)| (m, f.reason())).collect();
    let gi = inv.gpus[1]
        .mig
        .devices
        .iter()
        .find(|m| m.profile == "3g.20gb")
        .unwrap();
    assert_eq!(
        hit,
        [(
            &gi.uuid,
            format!(
                "XID 94 (contained ECC error) in GPU instance {}, compute instance 0",
                gi.gi_id
            )
        )]
    );

    let mut over = sim.snapshot().unwrap();
    state.apply(&mut over);
    assert!(over.gpus.iter().all(|g| g.health.is_healthy()));
    let x94 = Some(TaintKey::Xid(94));
    assert_eq!(
        mig_taints(&over, 1),
        [
            ("3g.20gb".into(), 4, 0, x94),
            ("2g.10gb".into(), 0, 0, None),
            ("1g.5gb".into(), 2, 0, None),
            ("1g.5gb".into(), 3, 0, None),
            ("3g.20gb".into(), 4, 1, x94),
        ]
    );
    let ci1 = over.gpus[1].mig.devices.last().unwrap();
    assert_eq!(
        ci1.health.reason().unwrap(),
        format!(
            "XID 94 (contained ECC error) in GPU instance {}, compute instance 0, on MIG device {}, which shares its memory slices",
            gi.gi_id, gi.uuid
        )
    );
    assert!(mig_taints(&over, 2).iter().all(|t| t.3.is_none()));
    assert_eq!(
        over.gpus[1].whole_health().reason(),
        over.gpus[1].mig.devices[0].health.reason(),
        "the whole GPU takes the instance's slices"
    );
    assert!(over.gpus[2].whole_health().is_healthy());

    // The device plugin's lists say the same: under `mixed` the two MIG devices on those slices,
    // under `none` (every GPU whole, MIG mode ignored) GPU 1, which takes them.
    use crate::deviceplugin::{MigStrategy, Options, resources::resources};
    let unhealthy = |strategy| {
        let options = Options {
            mig_strategy: strategy,
            ..Options::default()
        };
        let mut out: Vec<String> = resources(&over, &options)
            .unwrap()
            .iter()
            .flat_map(|r| &r.devices)
            .filter(|d| !d.health.is_healthy())
            .map(|d| d.uuid.to_string())
            .collect();
        out.sort();
        out
    };
    let mut want = vec![gi.uuid.to_string(), "MIG-3g-ci1".to_string()];
    want.sort();
    assert_eq!(unhealthy(MigStrategy::Mixed), want);
    assert_eq!(
        unhealthy(MigStrategy::None),
        [over.gpus[1].uuid.to_string()]
    );

    // A GPU-wide XID on the same GPU: the GPU itself.
    handle
        .events()
        .send(Event::gpu(inv.gpus[1].uuid.clone(), EventKind::Xid(79)))
        .await
        .unwrap();
    watch.changed().await.unwrap();
    let state = watch.borrow_and_update().clone();
    assert!(matches!(
        state.gpu(&inv.gpus[1].uuid),
        GpuHealth::Unhealthy(Fault {
            cause: Cause::Xid(79),
            ..
        })
    ));
    stop.cancel();
}

/// An event naming a GPU instance alone marks all its compute instances; one naming an instance
/// the source found no MIG device for (a GPU instance without a compute instance, or one gone by
/// the time it was read) marks the whole GPU, as before instance ids were read.
#[tokio::test(start_paused = true)]
async fn a_gpu_instance_event_marks_its_compute_instances_and_an_unknown_one_the_gpu() {
    let sim = two_compute_instances();
    let inv = sim.snapshot().unwrap();
    let (monitor, handle) = Monitor::new(policy(), Arc::new(Switch::default()));
    let stop = CancellationToken::new();
    tokio::spawn(monitor.run(stop.clone()));
    let mut watch = handle.subscribe();
    let tx = handle.events();
    tx.send(instance_event(&inv, "3g.20gb", false, 94))
        .await
        .unwrap();
    watch.changed().await.unwrap();
    let state = watch.borrow_and_update().clone();
    let mut hit: Vec<String> = state.mig_faults().map(|(m, _)| m.to_string()).collect();
    hit.sort();
    let gi = &inv.gpus[1].mig.devices[0];
    assert_eq!(gi.profile, "3g.20gb");
    let mut want = vec![gi.uuid.to_string(), "MIG-3g-ci1".to_string()];
    want.sort();
    assert_eq!(hit, want);
    assert!(
        state
            .mig_faults()
            .all(|(_, f)| f.compute_instance.is_none())
    );

    let gpu2 = inv.gpus[2].uuid.clone();
    tx.send(Event {
        gpu: gpu2.clone(),
        kind: EventKind::Xid(94),
        instance: Some(Instance {
            gpu_instance: 13,
            compute_instance: Some(0),
            devices: Vec::new(),
        }),
    })
    .await
    .unwrap();
    watch.changed().await.unwrap();
    let state = watch.borrow_and_update().clone();
    let faults: Vec<_> = state
        .faults()
        .map(|(g, f)| (g.clone(), f.cause.clone()))
        .collect();
    assert_eq!(faults, [(gpu2, Cause::Xid(94))]);
    stop.cancel();
}

/// The recovery probe of these tests, which also reads the node's MIG devices from the
/// simulated backend, fresh at each probe.
struct Live {
    up: AtomicBool,
    sim: SimBackend,
}

impl Probe for Live {
    fn probe(&self, _: &GpuUuid) -> Result<(), String> {
        if self.up.load(Ordering::SeqCst) {
            Ok(())
        } else {
            Err("down".into())
        }
    }

    fn mig_devices(&self) -> Option<std::collections::BTreeSet<MigUuid>> {
        let inv = self.sim.snapshot().ok()?;
        let migs = inv.gpus.iter().flat_map(|g| &g.mig.devices);
        Some(migs.map(|m| m.uuid.clone()).collect())
    }
}

/// A MIG device's fault ends when its instance is destroyed (at the next probe, whatever the
/// GPU's probe answers; and at once in what is laid over an inventory without it), so an
/// instance made later on the same placement starts healthy; the fault of one still there ends
/// as a GPU's does, once the quiet period is over and the GPU answers.
#[tokio::test(start_paused = true)]
async fn a_mig_fault_ends_with_its_instance_or_by_the_gpus_recovery_rule() {
    let sim = SimBackend::from_profile("a100-mig-mixed", "n").unwrap();
    let inv = sim.snapshot().unwrap();
    let probe = Arc::new(Live {
        up: AtomicBool::new(false),
        sim: sim.clone(),
    });
    let (monitor, handle) = Monitor::new(policy(), probe.clone());
    let stop = CancellationToken::new();
    tokio::spawn(monitor.run(stop.clone()));
    let mut watch = handle.subscribe();
    let tx = handle.events();
    tx.send(instance_event(&inv, "3g.20gb", true, 94))
        .await
        .unwrap();
    tx.send(instance_event(&inv, "2g.10gb", true, 94))
        .await
        .unwrap();
    watch
        .wait_for(|s| s.mig_faults().count() == 2)
        .await
        .unwrap();
    let g1 = &inv.gpus[1];
    let doomed = g1
        .mig
        .devices
        .iter()
        .find(|m| m.profile == "2g.10gb")
        .unwrap();
    let kept = g1
        .mig
        .devices
        .iter()
        .find(|m| m.profile == "3g.20gb")
        .unwrap();

    sim.destroy_mig(&g1.uuid, &doomed.uuid).unwrap();
    // Laid over an inventory without it, the fault marks nothing, before the monitor knows.
    let mut over = sim.snapshot().unwrap();
    handle.state().apply(&mut over);
    assert_eq!(
        mig_taints(&over, 1),
        [
            ("3g.20gb".into(), 4, 0, Some(TaintKey::Xid(94))),
            ("1g.5gb".into(), 2, 0, None),
            ("1g.5gb".into(), 3, 0, None),
        ]
    );
    // The next probe forgets it, long before the quiet period; the probe still fails, so the
    // other stays.
    tokio::time::timeout(
        policy().quiet_period,
        watch.wait_for(|s| s.mig_faults().count() == 1),
    )
    .await
    .expect("forgotten at the next probe")
    .unwrap();
    assert!(handle.state().mig(&kept.uuid).is_some());
    let again = sim
        .create_mig(&g1.uuid, doomed.gi_profile_id, doomed.placement)
        .unwrap();
    let mut over = sim.snapshot().unwrap();
    handle.state().apply(&mut over);
    let (_, made) = over.mig_by_uuid(&again.uuid).unwrap();
    assert!(made.health.is_healthy());

    // The quiet period over and the GPU answering: the other ends too.
    tokio::time::sleep(Duration::from_secs(120)).await;
    assert!(handle.state().mig(&kept.uuid).is_some(), "the probe fails");
    probe.up.store(true, Ordering::SeqCst);
    watch.wait_for(HealthState::is_empty).await.unwrap();
    stop.cancel();
}

#[test]
fn fault_file_xid_lines_may_name_a_mig_instance() {
    let sim = two_compute_instances();
    let inv = sim.snapshot().unwrap();
    let g1 = &inv.gpus[1];
    let gi = g1
        .mig
        .devices
        .iter()
        .find(|m| m.profile == "3g.20gb")
        .unwrap();
    let line = |ids: &str| parse_line(&format!("xid 1 94 {ids}"), &inv);
    let event = |ci: Option<u32>, devices: Vec<MigUuid>| {
        Ok(Some(Command::Event(Event {
            gpu: g1.uuid.clone(),
            kind: EventKind::Xid(94),
            instance: Some(Instance {
                gpu_instance: gi.gi_id,
                compute_instance: ci,
                devices,
            }),
        })))
    };
    assert_eq!(
        line(&format!("gi={} ci=1", gi.gi_id)),
        event(Some(1), vec![MigUuid("MIG-3g-ci1".into())])
    );
    assert_eq!(
        line(&format!("gi={}", gi.gi_id)),
        event(None, vec![gi.uuid.clone(), MigUuid("MIG-3g-ci1".into())])
    );
    // Ids of no instance: sent as NVML would, with no device found.
    assert_eq!(
        parse_line("xid 1 94 gi=99", &inv),
        Ok(Some(Command::Event(Event {
            gpu: g1.uuid.clone(),
            kind: EventKind::Xid(94),
            instance: Some(Instance {
                gpu_instance: 99,
                compute_instance: None,
                devices: Vec::new(),
            }),
        })))
    );
    assert_eq!(line("gi=x"), Err(LineError::BadInstance("gi=x".into())));
    assert_eq!(line("ci=0"), Err(LineError::BadInstance("ci=0".into())));
    assert_eq!(
        line("gi=1 gi=2"),
        Err(LineError::BadInstance("gi=2".into()))
    );
    assert!(matches!(line("gi=1 ci=0 x"), Err(LineError::Unknown(_))));
    assert!(
        LineError::BadInstance("gi=x".into())
            .to_string()
            .contains("write gi=ID or ci=ID")
    );
}
