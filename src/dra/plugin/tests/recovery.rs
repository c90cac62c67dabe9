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

/// Claim specs are not fsync'd, so a power loss can leave one empty, cut short or old; start-up
/// rewrites exactly those from the checkpoint and leaves intact ones alone.
#[tokio::test]
async fn restart_rewrites_damaged_specs_and_leaves_intact_ones() {
    use std::os::unix::fs::MetadataExt;
    let e = env("dgx-h100").await;
    for (name, gpu) in [
        ("intact", "gpu-0"),
        ("empty", "gpu-1"),
        ("cut", "gpu-2"),
        ("old", "gpu-3"),
    ] {
        e.add(claim(name, vec![result("gpu", gpu)]));
        e.prepare(name).await.unwrap();
    }
    let read = |name: &str| std::fs::read_to_string(e.spec(name)).unwrap();
    let damaged = ["cut", "empty", "old"];
    let before: Vec<String> = damaged.iter().map(|n| read(n)).collect();
    let intact = read("intact");
    let intact_inode = std::fs::metadata(e.spec("intact")).unwrap().ino();
    std::fs::write(e.spec("cut"), &before[0][..before[0].len() / 2]).unwrap();
    std::fs::write(e.spec("empty"), "").unwrap();
    // "old" holds another claim's devices, as a replaced but unsynced spec might.
    std::fs::write(e.spec("old"), &intact).unwrap();

    let (_p2, rec, _g) = e.restart(e.sim.clone()).await;
    let mut rewritten = rec.cdi_rewritten.clone();
    rewritten.sort_by(|a, b| a.as_str().cmp(b.as_str()));
    let expected: Vec<ClaimUid> = damaged
        .iter()
        .map(|n| ClaimUid::parse(*n).unwrap())
        .collect();
    assert_eq!(rewritten, expected);
    for (name, spec) in damaged.iter().zip(&before) {
        assert_eq!(&read(name), spec, "{name}");
    }
    assert_eq!(read("intact"), intact);
    let inode = std::fs::metadata(e.spec("intact")).unwrap().ino();
    assert_eq!(inode, intact_inode, "an intact spec is not rewritten");
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
