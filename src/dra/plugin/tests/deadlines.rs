//! Prepare's writes to the GPU under the write handle's deadline ([`Writes`], as in `nvdra
//! run`): a write that hangs fails its prepare with an error naming it, and what the checkpoint
//! says stays true of the hardware once it returns.

use super::*;
use crate::inventory::owner::Writes;
use crate::inventory::sim::SimCall;

/// A plugin whose write handle waits for the hardware at most two seconds (what the tests hold
/// is held until they let it go), and that handle.
async fn watched_env(profile: &str) -> (Env, Writes) {
    let dir = tempfile::tempdir().unwrap();
    let api = Arc::new(FakeApi::default());
    let sim = SimBackend::from_profile(profile, NODE).unwrap();
    let (writes, inventory, health, stop) =
        owned(Arc::new(sim.clone()), Arc::new(sim.clone())).await;
    let watched = writes.with_call_deadline(std::time::Duration::from_secs(2));
    let d = dir.path();
    let opts = Options {
        driver: DRIVER.into(),
        pool: NODE.into(),
        plugin_dir: d.join("plugin"),
        cdi_root: d.join("cdi"),
        driver_root: crate::cdi::DriverRoot::at(&d.join("driver")),
        boot_id: "boot-1".into(),
        partitionable: true,
        shared_capacity: crate::ledger::shares::ConsumableShares::Memory,
        dynamic_mig: false,
        keep_mig_on: false,
        share_trust_domain: Default::default(),
        proc_root: None,
        claim_status: false,
        mps_root: d.join("mps"),
    };
    let (plugin, writer, _) =
        Plugin::new(opts, api.clone(), watched.clone(), Metrics::new(), None).unwrap();
    tokio::spawn(writer.run(stop.clone()));
    plugin.recover().await.unwrap();
    let env = Env {
        plugin,
        api,
        sim,
        dir,
        _stop: Running {
            _stop: stop.drop_guard(),
            health,
            inventory,
        },
    };
    (env, watched)
}

/// Waits (at most a minute) until no backend call is past its deadline.
async fn until_returned(watched: &Writes) {
    let start = std::time::Instant::now();
    while !watched.overdue().is_empty() {
        assert!(
            start.elapsed() < std::time::Duration::from_secs(60),
            "{:?}",
            watched.overdue()
        );
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn a_write_that_hangs_fails_the_prepare_by_name_and_the_retry_completes_it() {
    let (e, watched) = watched_env("dgx-h100").await;
    let gpu = e.sim.snapshot().unwrap().gpus[0].uuid.clone();
    e.add(claim_with(
        "t",
        vec![result("gpu", "gpu-0")],
        vec![opaque(
            &["gpu"],
            serde_json::json!({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig", "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}}),
        )],
    ));
    let held = e.sim.hold(SimCall::SetTimeSlice);
    let err = crate::report::chain(&e.prepare("t").await.unwrap_err()).to_string();
    assert!(
        err.contains(&format!(
            "set_time_slice (GPU {gpu}) did not return within 2s"
        )),
        "{err}"
    );
    // Its rollback does not race the write still running: the claim stays recorded as started,
    // for the kubelet's retry (or start-up) to undo once the write returned.
    assert_eq!(e.state("t"), Some(ClaimState::PrepareStarted));
    assert!(!e.spec("t").exists());

    drop(held);
    until_returned(&watched).await;
    // The write went through late; the retry undoes it and prepares again.
    e.prepare("t").await.unwrap();
    assert_eq!(e.state("t"), Some(ClaimState::PrepareCompleted));
    assert_eq!(e.sim.time_slice(&gpu), TimeSlice::Long);
    e.unprepare("t").await.unwrap();
    assert_eq!(e.sim.time_slice(&gpu), TimeSlice::Default);
    assert_eq!(e.state("t"), None);
}
