//! Dynamic MIG (`--dynamic-mig`): a GPU's MIG mode follows the claims prepared on it.

use super::*;
use crate::ids::DeviceName;
use crate::inventory::{DeviceBackend, GpuUuid, MigModeChange, Placement, ProcessUsage};

/// A plugin with dynamic MIG on (`keep_on`: `--dynamic-mig=keep-on`), without
/// `--partitionable`: dynamic MIG alone creates placements.
async fn env_dynamic(profile: &str, keep_on: bool) -> Env {
    let dir = tempfile::tempdir().unwrap();
    let api = Arc::new(FakeApi::default());
    let sim = SimBackend::from_profile(profile, NODE).unwrap();
    let (plugin, _, stop) =
        start_with(dir.path(), api.clone(), sim.clone(), dynamic(keep_on)).await;
    Env {
        plugin,
        api,
        sim,
        dir,
        _stop: stop,
    }
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
    let err = e.prepare("p").await.unwrap_err();
    assert!(matches!(err, ClaimError::MigModeInUse { .. }), "{err}");
    let msg = err.to_string();
    assert!(msg.contains("pid 4242"), "{msg}");
    assert!(msg.contains("gpu-3"), "{msg}");
    assert!(msg.contains("retries"), "{msg}");
    // Rolled back: nothing held, nothing recorded, the GPU as it was.
    assert!(e.state("p").is_none());
    assert!(recorded(&e.plugin).is_empty());
    assert!(!mig_mode(&e, 3));
    assert!(!e.spec("p").exists());

    e.sim.set_processes(&g3, vec![]);
    e.prepare("p").await.unwrap();
    assert!(mig_mode(&e, 3));
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
    e.sim.update(|inv| inv.gpus[0].mig.pending = Some(true));
    let one = placement(&e, 0, "1g.10gb", 0);
    e.add(claim("a", vec![result("mig", &one)]));
    let err = e.prepare("a").await.unwrap_err().to_string();
    assert!(err.contains("reset required"), "{err}");
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

    let (p2, rec, _g) =
        start_with(e.dir.path(), e.api.clone(), e.sim.clone(), dynamic(false)).await;
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

/// A backend whose MIG mode changes wait for a GPU reset (NVML's RESET_REQUIRED), as where
/// the driver cannot apply one at once: the change is left pending.
struct ResetRequired(SimBackend);

impl crate::inventory::Wrapper for ResetRequired {
    fn inner(&self) -> &dyn DeviceBackend {
        &self.0
    }

    fn set_mig_mode(
        &self,
        gpu: &GpuUuid,
        enabled: bool,
    ) -> crate::inventory::Result<MigModeChange> {
        let current = self.0.update(|inv| {
            let g = inv.gpus.iter_mut().find(|g| g.uuid == *gpu).unwrap();
            g.mig.pending = Some(enabled);
            g.mig.enabled
        });
        Err(crate::inventory::Error::ResetRequired {
            gpu: gpu.clone(),
            current,
            pending: enabled,
        })
    }
}

#[tokio::test]
async fn a_switch_that_needs_a_reset_is_refused_and_the_gpu_no_longer_switches() {
    let dir = tempfile::tempdir().unwrap();
    let api = Arc::new(FakeApi::default());
    let sim = SimBackend::from_profile("dgx-h100", NODE).unwrap();
    let (plugin, _, _stop) = start_with(
        dir.path(),
        api.clone(),
        ResetRequired(sim.clone()),
        dynamic(false),
    )
    .await;
    let e = Env {
        plugin,
        api,
        sim,
        dir,
        _stop,
    };
    let one = placement(&e, 0, "1g.10gb", 0);
    e.add(claim("a", vec![result("mig", &one)]));
    let err = e.prepare("a").await.unwrap_err();
    assert!(matches!(err, ClaimError::MigResetRequired { .. }), "{err}");
    let msg = err.to_string();
    assert!(msg.contains("current off, pending on"), "{msg}");
    assert!(msg.contains("never resets"), "{msg}");
    assert!(e.state("a").is_none());
    assert!(recorded(&e.plugin).is_empty(), "rolled back");
    // The pending change makes the GPU one that does not switch: refused saying so.
    let err = e.prepare("a").await.unwrap_err().to_string();
    assert!(err.contains("reset required"), "{err}");
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
