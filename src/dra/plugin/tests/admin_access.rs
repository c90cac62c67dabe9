//! Admin access (`adminAccess: true`, monitoring) is outside every conflict check: the scheduler
//! allocates it beside other claims and the ledger lets it overlap them. So it is prepared only
//! on devices that exist as allocated, never where prepare would create a MIG instance or
//! switch a GPU's MIG mode.

use super::*;
use crate::ids::DeviceName;
use crate::inventory::DeviceBackend;

/// A plugin with dynamic MIG on, without `--partitionable`.
async fn env_dynamic() -> Env {
    env_tweaked("dgx-h100", |o| {
        o.partitionable = false;
        o.dynamic_mig = true;
    })
    .await
}

fn admin(device: &str) -> DeviceRequestAllocationResult {
    let mut r = result("monitor", device);
    r.admin_access = Some(true);
    r
}

/// The name of GPU `index`'s first 1g.10gb placement.
fn placement(e: &Env, index: usize) -> String {
    let inv = e.sim.snapshot().unwrap();
    let g = &inv.gpus[index];
    let p = g.mig.profiles.iter().find(|p| p.name == "1g.10gb").unwrap();
    DeviceName::mig(g.minor, &p.name, p.gi_profile_id, p.placements[0].start).to_string()
}

/// What the GPU was asked to do: MIG mode switches and instance creations.
fn gpu_changes(e: &Env) -> Vec<SimAction> {
    e.sim
        .actions()
        .into_iter()
        .filter(|a| {
            matches!(
                a,
                SimAction::SetMigMode { .. } | SimAction::CreateMig { .. }
            )
        })
        .collect()
}

/// The case: a whole-GPU claim is prepared (its pod not started yet); admin access to a
/// placement of that GPU, which the scheduler allocates beside it, would turn MIG mode on under
/// it. It is refused naming the device and why, and nothing changes on the GPU; admin access to
/// the GPU whole beside the claim, and to a MIG device once one exists, is prepared.
#[tokio::test]
async fn admin_access_to_a_placement_cannot_turn_mig_on_under_a_prepared_whole_gpu_claim() {
    let e = env_dynamic().await;
    e.add(claim("w", vec![result("gpu", "gpu-0")]));
    e.prepare("w").await.unwrap();
    let on_gpu0 = placement(&e, 0);
    e.add(claim("mon", vec![admin(&on_gpu0)]));
    let err = e.prepare("mon").await.unwrap_err();
    assert!(
        matches!(&err, ClaimError::AdminAccessNeedsChange { device, .. } if *device == on_gpu0),
        "{err:?}"
    );
    let msg = err.to_string();
    for part in [
        format!("{on_gpu0} cannot be prepared with admin access"),
        "GPU 0 is not in MIG mode, so preparing it would turn MIG mode on".into(),
        "admin access does not create MIG instances or switch MIG mode; ask for an existing \
         device"
            .into(),
    ] {
        assert!(msg.contains(&part), "{msg}");
    }
    assert_eq!(gpu_changes(&e), vec![], "nothing changed on the GPU");
    assert!(!e.sim.snapshot().unwrap().gpus[0].mig.enabled);
    assert_eq!(e.state("mon"), None, "nothing reserved");
    assert!(e.plugin.ledger().read(|c| c.mig_enabled.is_empty()));
    assert_eq!(
        e.state("w"),
        Some(ClaimState::PrepareCompleted),
        "the whole-GPU claim is untouched"
    );

    // The GPU whole exists as allocated: admin access to it beside the claim is prepared.
    e.add(claim("mon-whole", vec![admin("gpu-0")]));
    let d = e.prepare("mon-whole").await.unwrap();
    assert!(d[0].admin_access);

    // A placement of another GPU: refused while it has no instance; once a claim created one,
    // admin access to that MIG device is prepared beside it, without a change to the GPU.
    let on_gpu1 = placement(&e, 1);
    e.add(claim("mon-1", vec![admin(&on_gpu1)]));
    assert!(matches!(
        e.prepare("mon-1").await.unwrap_err(),
        ClaimError::AdminAccessNeedsChange { .. }
    ));
    e.add(claim("m", vec![result("mig", &on_gpu1)]));
    e.prepare("m").await.unwrap();
    let changes = gpu_changes(&e).len();
    assert_eq!(changes, 2, "MIG mode on, then the instance");
    let d = e.prepare("mon-1").await.unwrap();
    assert!(d[0].admin_access && !d[0].mig.as_ref().unwrap().created);
    assert_eq!(gpu_changes(&e).len(), changes);

    // GPU 1 whole would turn its MIG mode off: refused with admin access too.
    e.add(claim("mon-gpu1", vec![admin("gpu-1")]));
    let err = e.prepare("mon-gpu1").await.unwrap_err().to_string();
    assert!(
        err.contains("GPU 1 is in MIG mode, so preparing it whole would turn MIG mode off"),
        "{err}"
    );
    assert_eq!(gpu_changes(&e).len(), changes);
}
