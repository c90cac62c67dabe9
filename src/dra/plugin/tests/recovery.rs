//! Restarts: what recovery repairs, and two instances sharing one checkpoint.

use super::*;

#[tokio::test]
async fn restart_recovers_started_completed_and_orphans() {
    let e = env("a100-mig-mixed").await;
    e.add(claim("done", vec![result("gpu", "gpu-0")]));
    e.add(claim("half", vec![result("mig", "gpu-2-mig-1g10gb-15-6")]));
    e.prepare("done").await.unwrap();
    e.prepare("half").await.unwrap();
    // Make "half" look interrupted, as a crash between the steps would leave it, and drop the
    // spec of "done" as a reboot of a tmpfs CDI root would (same boot id: the runtime's dir was
    // wiped by hand).
    e.plugin.ledger().update(|c| {
        c.get_mut(&ClaimUid::parse("half").unwrap()).unwrap().state = ClaimState::PrepareStarted;
    });
    e.plugin.ledger().flush().await.unwrap();
    std::fs::remove_file(e.spec("done")).unwrap();
    std::fs::write(e.spec("stray"), "{}").unwrap();

    let (p2, rec, _g) = e.restart(e.sim.clone()).await;
    assert_eq!(rec.rolled_back, vec![ClaimUid::parse("half").unwrap()]);
    assert_eq!(rec.cdi_rewritten, vec![ClaimUid::parse("done").unwrap()]);
    assert_eq!(rec.orphans_removed, vec![ClaimUid::parse("stray").unwrap()]);
    assert!(e.spec("done").exists());
    assert!(!e.spec("half").exists());
    assert!(!e.spec("stray").exists());
    assert!(matches!(
        e.sim.actions().last(),
        Some(SimAction::DestroyMig { .. })
    ));
    assert_eq!(p2.ledger().read(|c| c.claims.len()), 1);
    // The completed claim is served from the checkpoint without the API.
    lock(&e.api.claims).clear();
    let r = p2.prepare(vec![cref("done")]).await;
    assert!(r[0].1.is_ok());
}

#[tokio::test]
async fn a_claim_that_cannot_be_recovered_does_not_stop_the_others() {
    let e = env("a100-mig-mixed").await;
    e.add(claim("mig", vec![result("mig", "gpu-2-mig-1g10gb-15-6")]));
    e.add(claim("gpu", vec![result("gpu", "gpu-0")]));
    e.prepare("mig").await.unwrap();
    e.prepare("gpu").await.unwrap();
    std::fs::remove_file(e.spec("mig")).unwrap();
    std::fs::remove_file(e.spec("gpu")).unwrap();
    // A restart on hardware that lost the created MIG device (a fresh simulated node).
    let fresh = SimBackend::from_profile("a100-mig-mixed", NODE).unwrap();
    let (p2, rec, _g) = e.restart(fresh).await;
    assert_eq!(rec.failed, vec![ClaimUid::parse("mig").unwrap()]);
    assert_eq!(rec.cdi_rewritten, vec![ClaimUid::parse("gpu").unwrap()]);
    assert!(e.spec("gpu").exists());
    // The failed claim stays known, so its unprepare still cleans up.
    assert_eq!(p2.ledger().read(|c| c.claims.len()), 2);
    let r = p2.unprepare(vec![cref("mig")]).await;
    assert!(r[0].1.is_ok(), "{:?}", r[0].1);
    assert_eq!(p2.ledger().read(|c| c.claims.len()), 1);
}

#[tokio::test]
async fn two_instances_share_the_checkpoint() {
    let e = env("dgx-h100").await;
    let (b, _, _g) = e.restart(e.sim.clone()).await;
    e.add(claim("x", vec![result("gpu", "gpu-0")]));
    e.add(claim("y", vec![result("gpu", "gpu-0")]));
    e.prepare("x").await.unwrap();
    // The second instance was started before x existed; it reloads on taking the lock.
    let r = b.prepare(vec![cref("y")]).await;
    let err = r[0].1.as_ref().unwrap_err();
    assert!(matches!(err, ClaimError::DeviceInUse { .. }), "{err}");
    // The kubelet may send the unprepare to the other instance.
    assert!(b.unprepare(vec![cref("x")]).await[0].1.is_ok());
    assert!(!e.spec("x").exists());
    // And the first instance sees that too.
    e.prepare("y").await.unwrap();
    assert_eq!(
        e.plugin
            .ledger()
            .read(|c| c.claims.keys().cloned().collect::<Vec<_>>()),
        vec![ClaimUid::parse("y").unwrap()]
    );
}
