//! Dynamic MIG (`--dynamic-mig`): a GPU's MIG mode follows the claims prepared on it.

use super::*;
use crate::ids::DeviceName;
use crate::inventory::{
    DeviceBackend, GpuUuid, Holder, HolderKind, MigModeChange, Placement, ProcessUsage,
    Reconfigure, SwitchBlock, Virtualization,
};

/// A plugin with dynamic MIG on (`keep_on`: `--dynamic-mig=keep-on`), without
/// `--partitionable`: dynamic MIG alone creates placements.
async fn env_dynamic(profile: &str, keep_on: bool) -> Env {
    env_tweaked(profile, dynamic(keep_on)).await
}

/// [`env_dynamic`] without keep-on over `hardware` and `gpus`, `sim` (`Env::sim`) or a wrapper
/// of it that counts or changes what the owner reads or the plugin asks of it.
async fn env_over(
    sim: &SimBackend,
    hardware: impl DeviceBackend,
    gpus: impl crate::inventory::Reconfigure,
) -> Env {
    let dir = tempfile::tempdir().unwrap();
    let api = Arc::new(FakeApi::default());
    let (hardware, gpus) = (Arc::new(hardware), Arc::new(gpus));
    let (plugin, _, _stop) =
        start_over(dir.path(), api.clone(), hardware, gpus, dynamic(false)).await;
    Env {
        plugin,
        api,
        sim: sim.clone(),
        dir,
        _stop,
    }
}

/// A second plugin with dynamic MIG on (without keep-on) over `e`'s directory, API and sim, as
/// after a restart: the plugin, what its start-up recovered, and the guard that stops it.
async fn restart(e: &Env) -> (Plugin, Recovery, super::Running) {
    start_with(e.dir.path(), e.api.clone(), e.sim.clone(), dynamic(false)).await
}

fn dynamic(keep_on: bool) -> impl FnOnce(&mut Options) {
    move |o| {
        o.partitionable = false;
        o.dynamic_mig = true;
        o.keep_mig_on = keep_on;
    }
}

/// The name of GPU `index`'s placement of `profile` at `start`.
fn placement(e: &Env, index: usize, profile: &str, start: u32) -> String {
    let inv = e.sim.snapshot().unwrap();
    let g = &inv.gpus[index];
    let p = g.mig.profiles.iter().find(|p| p.name == profile).unwrap();
    assert!(p.placements.iter().any(|pl| pl.start == start), "{p:?}");
    DeviceName::mig(g.minor, &p.name, p.gi_profile_id, start).to_string()
}

/// The GPU-instance profile id of 1g.10gb.
fn one_g(e: &Env) -> u32 {
    let inv = e.sim.snapshot().unwrap();
    let p = inv.gpus[0]
        .mig
        .profiles
        .iter()
        .find(|p| p.name == "1g.10gb");
    p.unwrap().gi_profile_id
}

fn gpu(e: &Env, index: usize) -> GpuUuid {
    e.sim.snapshot().unwrap().gpus[index].uuid.clone()
}

fn mig_mode(e: &Env, index: usize) -> bool {
    e.sim.snapshot().unwrap().gpus[index].mig.enabled
}

fn recorded(p: &Plugin) -> Vec<GpuUuid> {
    p.ledger().read(|c| c.mig_enabled.iter().cloned().collect())
}

/// MIG mode switches the sim applied, in order: (GPU, on).
fn switches(e: &Env) -> Vec<(GpuUuid, bool)> {
    e.sim
        .actions()
        .into_iter()
        .filter_map(|a| match a {
            SimAction::SetMigMode { gpu, enabled, .. } => Some((gpu, enabled)),
            _ => None,
        })
        .collect()
}

fn creates(e: &Env) -> usize {
    e.sim
        .actions()
        .iter()
        .filter(|a| matches!(a, SimAction::CreateMig { .. }))
        .count()
}

#[tokio::test]
async fn a_3g_then_a_1g_claim_switch_the_gpu_on_and_whole_waits_for_both() {
    let e = env_dynamic("dgx-h100", false).await;
    let g0 = gpu(&e, 0);
    let (three, one) = (
        placement(&e, 0, "3g.40gb", 4),
        placement(&e, 0, "1g.10gb", 0),
    );
    e.add(claim("a", vec![result("mig", &three)]));
    e.add(claim("b", vec![result("mig", &one)]));
    e.add(claim("w", vec![result("gpu", "gpu-0")]));
    assert!(!mig_mode(&e, 0));

    let d = e.prepare("a").await.unwrap();
    assert_eq!(d[0].device, three.as_str());
    assert!(d[0].mig.as_ref().unwrap().created);
    assert_eq!(switches(&e), vec![(g0.clone(), true)]);
    assert_eq!(creates(&e), 1);
    assert_eq!(recorded(&e.plugin), vec![g0.clone()], "nvdra's to turn off");
    // The spec is the MIG device's, as for any created instance (its nodes:
    // `mig_capability_nodes_come_from_procfs_for_existing_and_created_devices`).
    let spec = std::fs::read_to_string(e.spec("a")).unwrap();
    assert!(spec.contains(&format!("a-{three}")), "{spec}");

    e.prepare("b").await.unwrap();
    assert_eq!(switches(&e).len(), 1, "already in MIG mode");
    assert_eq!(creates(&e), 2);
    assert_eq!(e.sim.snapshot().unwrap().gpus[0].mig.devices.len(), 2);

    // The GPU whole is refused while either instance is held, naming the holders.
    let err = e.prepare("w").await.unwrap_err().to_string();
    for held in [
        format!("{three} by claim default/claim-a (a)"),
        format!("{one} by claim default/claim-b (b)"),
    ] {
        assert!(err.contains(&held), "{err}");
    }
    assert!(e.state("w").is_none());
    e.unprepare("a").await.unwrap();
    assert!(mig_mode(&e, 0), "the 1g instance is left");
    let err = e.prepare("w").await.unwrap_err().to_string();
    assert!(
        err.contains("default/claim-b") && !err.contains("claim-a"),
        "{err}"
    );

    // After the last instance the mode goes off, and the GPU is handed out whole.
    e.unprepare("b").await.unwrap();
    assert!(!mig_mode(&e, 0));
    assert!(e.sim.snapshot().unwrap().gpus[0].mig.devices.is_empty());
    assert_eq!(switches(&e), vec![(g0.clone(), true), (g0.clone(), false)]);
    assert!(recorded(&e.plugin).is_empty());
    e.prepare("w").await.unwrap();
    assert_eq!(switches(&e).len(), 2, "the whole GPU needed no switch");
    assert!(e.spec("w").exists());
}

/// A MIG placement the scheduler allocated on a GPU that shares hold (`--shared-capacity`;
/// the allocation was made against an older state) is refused at prepare, naming the share's
/// claim and saying what was placed: a MIG device, not the GPU whole. Nothing is switched,
/// created or recorded; once the share ends, the same prepare succeeds.
#[tokio::test]
async fn a_mig_placement_beside_a_share_is_refused_naming_the_share() {
    let e = env_dynamic("dgx-h100", false).await;
    let _host = e.mps_host();
    let three = placement(&e, 0, "3g.40gb", 4);
    e.add(claim("s", vec![super::shares::share("nb", "gpu-0", "8Gi")]));
    e.add(claim("m", vec![result("mig", &three)]));
    e.prepare("s").await.unwrap();

    let err = e.prepare("m").await.unwrap_err();
    assert_eq!(
        err.to_string(),
        format!(
            "the scheduler placed MIG device {three} on GPU {}, which shares of claim \
             default/claim-s (s) hold; the node refuses it rather than split a GPU in use into \
             MIG devices (the allocation was made against an older state): delete the pod so \
             the scheduler places it again, or wait until those shares end",
            gpu(&e, 0)
        )
    );
    assert!(matches!(err, ClaimError::MigOnShares { .. }), "{err:?}");
    assert!(e.state("m").is_none());
    assert!(!e.spec("m").exists());
    assert!(switches(&e).is_empty(), "no MIG mode switch");
    assert_eq!(creates(&e), 0);

    e.unprepare("s").await.unwrap();
    let d = e.prepare("m").await.unwrap();
    assert_eq!(d[0].device, three.as_str());
    assert_eq!(switches(&e), vec![(gpu(&e, 0), true)]);
}

#[tokio::test]
async fn a_whole_gpu_claim_turns_mig_mode_off_but_keeps_foreign_instances() {
    let e = env_dynamic("dgx-h100", false).await;
    let (g1, g2) = (gpu(&e, 1), gpu(&e, 2));
    // An operator left GPU 1 in MIG mode with no instance, GPU 2 with one of its own.
    e.sim.set_mig_mode(&g1, true).unwrap();
    e.sim.set_mig_mode(&g2, true).unwrap();
    let foreign = e
        .sim
        .create_mig(&g2, one_g(&e), Placement { start: 0, size: 1 })
        .unwrap();
    e.reread().await;
    e.add(claim("w1", vec![result("gpu", "gpu-1")]));
    e.add(claim("w2", vec![result("gpu", "gpu-2")]));

    e.prepare("w1").await.unwrap();
    assert!(!mig_mode(&e, 1));
    assert_eq!(switches(&e).last(), Some(&(g1, false)));

    let err = e.prepare("w2").await.unwrap_err().to_string();
    assert!(err.contains(foreign.uuid.as_str()), "{err}");
    assert!(err.contains("did not create"), "{err}");
    assert!(mig_mode(&e, 2));
    assert_eq!(
        e.sim.snapshot().unwrap().gpus[2].mig.devices.len(),
        1,
        "kept"
    );
    assert!(e.state("w2").is_none());
}

#[tokio::test]
async fn processes_on_the_gpu_answer_in_use_naming_them_and_the_retry_succeeds() {
    let e = env_dynamic("dgx-h100", false).await;
    let g3 = gpu(&e, 3);
    let one = placement(&e, 3, "1g.10gb", 2);
    e.add(claim("p", vec![result("mig", &one)]));
    e.sim.set_processes(
        &g3,
        vec![ProcessUsage {
            pid: 4242,
            used_memory_bytes: Some(1 << 30),
            gpu_instance: None,
        }],
    );
    e.reread().await;
    let err = e.prepare("p").await.unwrap_err();
    assert!(matches!(err, ClaimError::MigModeInUse { .. }), "{err}");
    let msg = err.to_string();
    assert!(msg.contains("pid 4242"), "{msg}");
    assert!(msg.contains("gpu-3"), "{msg}");
    assert!(msg.contains("retries"), "{msg}");
    assert!(msg.contains("tainted NoExecute"), "{msg}");
    // Rolled back: nothing held, nothing recorded, the GPU as it was, nothing left pending.
    assert!(e.state("p").is_none());
    assert!(recorded(&e.plugin).is_empty());
    assert!(!mig_mode(&e, 3));
    assert_eq!(e.sim.snapshot().unwrap().gpus[3].mig.pending, None);
    assert!(!e.spec("p").exists());
    // The GPU is blocked, naming the process, so the slices taint what needs a switch.
    let Some(SwitchBlock::InUse { holders }) = e.plugin.switch_blocks().get(&g3) else {
        panic!("{:?}", e.plugin.switch_blocks().all())
    };
    assert_eq!(holders.iter().map(|h| h.pid).collect::<Vec<_>>(), [4242]);

    // The kubelet's retry once it exited switches the GPU, and the block goes.
    e.sim.set_processes(&g3, vec![]);
    e.reread().await;
    e.prepare("p").await.unwrap();
    assert!(mig_mode(&e, 3));
    assert!(e.plugin.switch_blocks().all().is_empty());
}

/// Holders the inventory names (a DCGM host engine) are named in the error beside NVML's pids,
/// the harmless ones (the persistence daemon) left out; the block stays while a read still finds
/// a holder in the way, and a read that finds none clears it with no prepare.
#[tokio::test]
async fn in_use_names_the_holders_and_a_read_without_them_clears_the_block() {
    let e = env_dynamic("dgx-h100", false).await;
    let g2 = gpu(&e, 2);
    let one = placement(&e, 2, "1g.10gb", 0);
    e.add(claim("p", vec![result("mig", &one)]));
    let holder = |pid: u32, name: &str, kind| Holder {
        pid,
        name: name.into(),
        kind,
    };
    let persistenced = holder(8, "nvidia-persistenced", HolderKind::Harmless);
    e.sim.set_holders(
        &g2,
        vec![
            holder(7, "nv-hostengine", HolderKind::Foreign),
            persistenced.clone(),
        ],
    );
    e.reread().await;
    let msg = e.prepare("p").await.unwrap_err().to_string();
    assert!(msg.contains("pid 7 (nv-hostengine)"), "{msg}");
    assert!(!msg.contains("pid 8"), "{msg}");
    assert_eq!(e.sim.snapshot().unwrap().gpus[2].mig.pending, None);
    let blocked = || e.plugin.switch_blocks().get(&g2);
    assert_eq!(
        blocked(),
        Some(SwitchBlock::InUse {
            holders: vec![holder(7, "nv-hostengine", HolderKind::Foreign)]
        })
    );

    // A read that still finds it keeps the block; one that does not clears it.
    let inv = e.sim.snapshot().unwrap();
    assert!(e.plugin.recheck_mig_switches(&inv).await.is_empty());
    assert!(blocked().is_some());
    e.sim.set_holders(&g2, vec![persistenced]);
    let inv = e.sim.snapshot().unwrap();
    assert_eq!(e.plugin.recheck_mig_switches(&inv).await, vec![g2.clone()]);
    assert_eq!(blocked(), None);
    e.reread().await;
    e.prepare("p").await.unwrap();
    assert!(mig_mode(&e, 2));
}

#[tokio::test]
async fn keep_on_leaves_the_mode_on_after_the_last_instance() {
    let e = env_dynamic("dgx-h100", true).await;
    let one = placement(&e, 0, "1g.10gb", 0);
    e.add(claim("a", vec![result("mig", &one)]));
    e.add(claim("w", vec![result("gpu", "gpu-0")]));
    e.prepare("a").await.unwrap();
    e.unprepare("a").await.unwrap();
    assert!(mig_mode(&e, 0), "keep-on");
    assert!(e.sim.snapshot().unwrap().gpus[0].mig.devices.is_empty());
    // A claim of the GPU whole still turns it off.
    e.prepare("w").await.unwrap();
    assert!(!mig_mode(&e, 0));
    assert!(recorded(&e.plugin).is_empty());
}

#[tokio::test]
async fn a_gpu_that_cannot_toggle_is_refused_saying_why() {
    let e = env_dynamic("dgx-h100", false).await;
    e.sim
        .update(|inv| inv.gpus[0].virtualization = Some(Virtualization::VgpuGuest));
    e.reread().await;
    let one = placement(&e, 0, "1g.10gb", 0);
    e.add(claim("a", vec![result("mig", &one)]));
    let err = e.prepare("a").await.unwrap_err().to_string();
    assert!(err.contains("a vGPU guest"), "{err}");
    assert!(switches(&e).is_empty());
    // Without dynamic MIG a placement on a GPU outside MIG mode is refused as before.
    let plain = env("dgx-h100").await;
    plain.add(claim("a", vec![result("mig", &one)]));
    let err = plain.prepare("a").await.unwrap_err().to_string();
    assert!(err.contains("not in MIG mode"), "{err}");
}

#[tokio::test]
async fn start_up_turns_off_a_mode_left_on_with_no_instance() {
    let e = env_dynamic("dgx-h100", false).await;
    let (g0, g2) = (gpu(&e, 0), gpu(&e, 2));
    let one = placement(&e, 1, "1g.10gb", 0);
    e.add(claim("half", vec![result("mig", &one)]));
    e.prepare("half").await.unwrap();
    // What crashes leave: GPU 0 turned on and recorded, nothing created; GPU 1's prepare
    // interrupted after its instance was created; GPU 2 recorded but with an instance nvdra
    // did not create.
    assert_eq!(
        e.sim.set_mig_mode(&g0, true).unwrap(),
        MigModeChange::Applied
    );
    e.sim.set_mig_mode(&g2, true).unwrap();
    e.sim
        .create_mig(&g2, one_g(&e), Placement { start: 0, size: 1 })
        .unwrap();
    e.plugin.ledger().update(|c| {
        c.get_mut(&ClaimUid::parse("half").unwrap()).unwrap().state = ClaimState::PrepareStarted;
    });
    e.plugin.ledger().update_mig_enabled(|s| {
        s.insert(g0.clone());
        s.insert(g2.clone());
    });
    e.plugin.ledger().flush().await.unwrap();

    let (p2, rec, _g) = restart(&e).await;
    assert_eq!(rec.rolled_back, vec![ClaimUid::parse("half").unwrap()]);
    // GPU 1 went off in the rollback, after its instance; GPU 0 after the rollbacks.
    assert_eq!(rec.mig_modes_off, vec![g0.clone()]);
    assert!(!mig_mode(&e, 0) && !mig_mode(&e, 1));
    assert!(e.sim.snapshot().unwrap().gpus[1].mig.devices.is_empty());
    assert!(
        mig_mode(&e, 2),
        "a foreign instance keeps its GPU in MIG mode"
    );
    assert_eq!(e.sim.snapshot().unwrap().gpus[2].mig.devices.len(), 1);
    assert_eq!(recorded(&p2), vec![g2], "kept for a later start");
}

/// Counts the MIG mode switches asked of the backend, refused ones included.
struct CountSwitches(SimBackend, Arc<AtomicUsize>);

impl super::wrapper::Wrapper for CountSwitches {
    fn inner(&self) -> &dyn Reconfigure {
        &self.0
    }

    fn set_mig_mode(
        &self,
        gpu: &GpuUuid,
        enabled: bool,
    ) -> crate::inventory::Result<MigModeChange> {
        self.1.fetch_add(1, Ordering::SeqCst);
        self.0.set_mig_mode(gpu, enabled)
    }
}

/// An H100 whose switch waits for a reset (RESET_REQUIRED, as some hypervisors' passthrough
/// GPUs answer): the change is withdrawn at once, the GPU is no longer switched (not even asked), and it is
/// still handed out as it is.
#[tokio::test]
async fn a_switch_that_needs_a_reset_is_withdrawn_and_the_gpu_no_longer_switches() {
    let sim = SimBackend::from_profile("dgx-h100", NODE).unwrap();
    let asked = Arc::new(AtomicUsize::new(0));
    let e = env_over(&sim, sim.clone(), CountSwitches(sim.clone(), asked.clone())).await;
    let g0 = gpu(&e, 0);
    e.sim.set_reset_required(&g0, true);
    e.add(claim(
        "a",
        vec![result("mig", &placement(&e, 0, "1g.10gb", 0))],
    ));
    e.add(claim(
        "b",
        vec![result("mig", &placement(&e, 0, "1g.10gb", 1))],
    ));
    e.add(claim("w", vec![result("gpu", "gpu-0")]));
    let err = e.prepare("a").await.unwrap_err();
    assert!(matches!(err, ClaimError::MigResetRequired { .. }), "{err}");
    let msg = err.to_string();
    for want in [
        "RESET_REQUIRED",
        "withdrawn",
        "mode stays off",
        "never resets",
    ] {
        assert!(msg.contains(want), "{want}: {msg}");
    }
    // Withdrawn at once: nothing pending, the mode as it was, nothing recorded or held.
    let g = e.sim.snapshot().unwrap().gpus[0].clone();
    assert_eq!((g.mig.enabled, g.mig.pending), (false, None));
    assert!(e.state("a").is_none());
    assert!(recorded(&e.plugin).is_empty(), "rolled back");
    assert_eq!(
        asked.load(Ordering::SeqCst),
        2,
        "the switch and its withdrawal"
    );
    assert_eq!(
        e.plugin.switch_blocks().get(&g0),
        Some(SwitchBlock::ResetRequired)
    );

    // No longer switched: the next placement is refused without asking the driver, even once
    // the hypervisor would allow it (until nvdra restarts).
    e.sim.set_reset_required(&g0, false);
    let err = e.prepare("b").await.unwrap_err();
    assert!(matches!(err, ClaimError::MigSwitchDisabled { .. }), "{err}");
    assert!(err.to_string().contains("delete the pod"), "{err}");
    assert_eq!(asked.load(Ordering::SeqCst), 2);
    // The GPU whole needs no switch: still prepared.
    e.prepare("w").await.unwrap();
    assert_eq!(asked.load(Ordering::SeqCst), 2);
    assert!(switches(&e).is_empty());
}

/// A change pending on a Hopper GPU (a refused switch nobody withdrew) is withdrawn at start-up
/// and at the next prepare, which then switches the GPU; one on an A100 is the operator's
/// (applied at the next reset) and stays.
#[tokio::test]
async fn a_pending_change_is_withdrawn_on_hopper_and_left_on_ampere() {
    let e = env_dynamic("dgx-h100", false).await;
    let (g1, g2) = (gpu(&e, 1), gpu(&e, 2));
    e.sim.update(|inv| inv.gpus[1].mig.pending = Some(true));
    let (p2, rec, _g) = restart(&e).await;
    assert_eq!(rec.pending_withdrawn, vec![g1]);
    assert_eq!(e.sim.snapshot().unwrap().gpus[1].mig.pending, None);
    assert!(!mig_mode(&e, 1));

    // At prepare: withdrawn, then switched as the claim needs.
    e.sim.update(|inv| inv.gpus[2].mig.pending = Some(true));
    clock_held(_g.inventory.refresh()).await.unwrap();
    e.add(claim(
        "a",
        vec![result("mig", &placement(&e, 2, "1g.10gb", 0))],
    ));
    let mut r = p2.prepare(vec![cref("a")]).await;
    r.pop().unwrap().1.unwrap();
    assert_eq!(switches(&e), vec![(g2, true)]);
    assert_eq!(e.sim.snapshot().unwrap().gpus[2].mig.pending, None);

    let a100 = env_dynamic("a100-mig-mixed", false).await;
    a100.sim.update(|inv| inv.gpus[0].mig.pending = Some(true));
    let (_p, rec, _g) = restart(&a100).await;
    assert!(rec.pending_withdrawn.is_empty());
    assert_eq!(a100.sim.snapshot().unwrap().gpus[0].mig.pending, Some(true));
}

/// The first flush of a prepare that would turn a GPU on fails (here: the checkpoint writer
/// is gone): the GPU is not left recorded as turned on by nvdra, in memory, so no later write
/// says so; the file keeps what it held.
#[tokio::test]
async fn a_failed_first_flush_leaves_no_gpu_recorded_as_switched() {
    let mut e = env_dynamic("dgx-h100", false).await;
    let writer = std::mem::replace(&mut e._stop._stop, CancellationToken::new().drop_guard());
    e.add(claim(
        "a",
        vec![result("mig", &placement(&e, 0, "1g.10gb", 0))],
    ));
    let path = e.plugin.ledger().path().to_path_buf();
    let before = std::fs::read(&path).unwrap();
    drop(writer);
    while e.plugin.ledger().flush().await.is_ok() {
        tokio::task::yield_now().await;
    }
    let err = e.prepare("a").await.unwrap_err();
    assert!(matches!(err, ClaimError::Ledger(_)), "{err}");
    assert!(switches(&e).is_empty());
    assert!(e.state("a").is_none());
    assert!(recorded(&e.plugin).is_empty(), "not durable, not recorded");
    assert_eq!(std::fs::read(&path).unwrap(), before);
}

/// Turns each GPU's MIG mode as asked, then gives the GPU a new minor (`+ 40`), as NVML's
/// documentation says a switch may.
struct ShiftMinors(SimBackend);

impl super::wrapper::Wrapper for ShiftMinors {
    fn inner(&self) -> &dyn Reconfigure {
        &self.0
    }

    fn set_mig_mode(
        &self,
        gpu: &GpuUuid,
        enabled: bool,
    ) -> crate::inventory::Result<MigModeChange> {
        let r = self.0.set_mig_mode(gpu, enabled)?;
        if r == MigModeChange::Applied {
            self.0.update(|inv| {
                let g = inv.gpus.iter_mut().find(|g| g.uuid == *gpu).unwrap();
                g.minor += 40;
            });
        }
        Ok(r)
    }
}

/// A minor that changed across the switch: the claim's spec has the GPU's new device node,
/// its device keeps the name it was allocated by.
#[tokio::test]
async fn the_spec_of_a_switched_gpu_has_the_minor_read_after_the_switch() {
    let sim = SimBackend::from_profile("dgx-h100", NODE).unwrap();
    let e = env_over(&sim, sim.clone(), ShiftMinors(sim.clone())).await;
    let one = placement(&e, 3, "1g.10gb", 0);
    e.add(claim("a", vec![result("mig", &one)]));
    let d = e.prepare("a").await.unwrap();
    assert_eq!(d[0].device, one.as_str(), "the allocated name");
    assert_eq!(e.sim.snapshot().unwrap().gpus[3].minor, 43);
    let spec = std::fs::read_to_string(e.spec("a")).unwrap();
    assert!(spec.contains("/dev/nvidia43"), "{spec}");
    assert!(!spec.contains("/dev/nvidia3\n"), "{spec}");
}

/// Clears the holders of GPU `.1` of the wrapped hardware after `.2` more reads (the owner's):
/// nvdra's own MPS server that exits a while after its last share was released.
struct ExitsAfter(SimBackend, GpuUuid, Arc<AtomicUsize>);

impl DeviceBackend for ExitsAfter {
    fn name(&self) -> &'static str {
        "simulated"
    }

    fn snapshot(&self) -> crate::inventory::Result<Inventory> {
        let left = self.2.load(Ordering::SeqCst);
        if left > 0 && self.2.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0.set_holders(&self.1, vec![]);
        }
        self.0.snapshot()
    }
}

fn own_mps_server() -> Holder {
    Holder {
        pid: 77,
        name: "nvidia-cuda-mps-server".into(),
        kind: HolderKind::OwnMps,
    }
}

/// nvdra's own MPS server still on the GPU (released, not yet exited): the switch waits for it
/// instead of meeting IN_USE.
#[tokio::test]
async fn a_switch_waits_for_nvdras_own_mps_server_to_exit() {
    let sim = SimBackend::from_profile("dgx-h100", NODE).unwrap();
    let g4 = sim.snapshot().unwrap().gpus[4].uuid.clone();
    let snapshots = Arc::new(AtomicUsize::new(0));
    let e = env_over(
        &sim,
        ExitsAfter(sim.clone(), g4.clone(), snapshots.clone()),
        sim.clone(),
    )
    .await;
    e.add(claim(
        "a",
        vec![result("mig", &placement(&e, 4, "1g.10gb", 0))],
    ));
    e.sim.set_holders(&g4, vec![own_mps_server()]);
    e.reread().await;
    // Gone after a few more reads (the prepare's own, then the wait's).
    snapshots.store(5, Ordering::SeqCst);
    e.prepare("a").await.unwrap();
    assert_eq!(
        snapshots.load(Ordering::SeqCst),
        0,
        "read until it was gone"
    );
    assert_eq!(switches(&e), vec![(g4, true)]);
    assert!(e.plugin.switch_blocks().all().is_empty(), "no IN_USE met");
}

/// One that does not exit: past the bound (`OWN_MPS_EXIT`) the prepare fails naming it, and the GPU is
/// not asked to switch.
#[tokio::test(start_paused = true)]
async fn a_switch_fails_naming_nvdras_own_mps_server_that_does_not_exit() {
    let e = env_dynamic("dgx-h100", false).await;
    let g4 = gpu(&e, 4);
    e.add(claim(
        "a",
        vec![result("mig", &placement(&e, 4, "1g.10gb", 0))],
    ));
    e.sim.set_holders(&g4, vec![own_mps_server()]);
    e.reread().await;
    let err = e.prepare("a").await.unwrap_err();
    assert!(matches!(err, ClaimError::OwnMpsLeft { .. }), "{err}");
    let msg = err.to_string();
    assert!(msg.contains("pid 77 (nvidia-cuda-mps-server)"), "{msg}");
    assert!(msg.contains("turn MIG mode on"), "{msg}");
    assert!(switches(&e).is_empty());
    assert_eq!(e.sim.snapshot().unwrap().gpus[4].mig.pending, None);
    assert!(e.plugin.switch_blocks().all().is_empty());
    assert!(e.state("a").is_none());
}

/// Claims of one batch run concurrently: two placements of one GPU switch it on once (the
/// second waits on the GPU's lock, then finds it on), and their unprepares in one batch switch
/// it off once, after both instances are gone.
#[tokio::test]
async fn concurrent_claims_of_one_gpu_switch_it_once_each_way() {
    let e = env_dynamic("dgx-h100", false).await;
    let g0 = gpu(&e, 0);
    let (x, y) = (
        placement(&e, 0, "1g.10gb", 0),
        placement(&e, 0, "2g.20gb", 2),
    );
    e.add(claim("x", vec![result("mig", &x)]));
    e.add(claim("y", vec![result("mig", &y)]));
    for (_, r) in e.plugin.prepare(vec![cref("x"), cref("y")]).await {
        r.unwrap();
    }
    assert_eq!(switches(&e), vec![(g0.clone(), true)]);
    assert_eq!(creates(&e), 2);
    for (_, r) in e.plugin.unprepare(vec![cref("x"), cref("y")]).await {
        r.unwrap();
    }
    assert_eq!(switches(&e), vec![(g0.clone(), true), (g0, false)]);
    assert!(recorded(&e.plugin).is_empty());
}
