//! SIGKILL at each step of a dynamic-MIG prepare and unprepare (`--dynamic-mig`), on the NVML
//! backend over the fake library, whose state file keeps MIG instances and MIG modes across the
//! killed process, as a GPU does: the mode switch, the instance's creation (GPU and compute
//! instance in one backend call; a GPU instance left without its compute instance is the
//! backend's to destroy), the spec, the completed record; and in the unprepare the instance's
//! destruction, the mode switched off, the spec and the entry removed. After every crash the
//! restart and the kubelet's retry end consistent: the claim prepared exactly once or not at
//! all, no instance nobody holds, MIG mode on exactly while an instance is held, and the
//! checkpoint's record of the GPUs nvdra turned on equal to the GPUs it left on. A switch the
//! driver refuses (IN_USE, which leaves the change pending as NVML does) is withdrawn at once,
//! or, killed before that, at the next start: nvdra leaves nothing pending.

use serde_json::json;

use super::{
    Dirs, NODE, kill_at_crash_point, prepare, terminate, unprepare, unprepare_call, wait_ready,
};

/// A 1g.10gb placement of GPU 0 (outside MIG mode on this profile).
const ONE_G: &str = "gpu-0-mig-1g10gb-19-0";

impl Dirs {
    /// A DGX H100 on the fake NVML with `--dynamic-mig`; claims `a` ([`ONE_G`]) and `w` (GPU 0
    /// whole).
    fn dynamic() -> Dirs {
        let mut d = Dirs::new();
        d.nvml = true;
        d.profile = "dgx-h100";
        d.dynamic_mig = true;
        d.add_claim("a", ONE_G);
        d.add_claim("w", "gpu-0");
        d
    }

    /// GPU 0's MIG mode in the fake's state: (current, pending), true for on.
    fn gpu0_mig_mode(&self) -> (bool, bool) {
        let modes = fake_nvml::state::mig_modes(&self.nvml_state());
        let (_, current, pending) = modes
            .into_iter()
            .find(|(g, _, _)| *g == 0)
            .expect("GPU 0's MIG mode in the state file");
        (current == 1, pending == 1)
    }

    fn gpu0_instances(&self) -> usize {
        self.mig_instances()
            .iter()
            .filter(|(g, ..)| *g == 0)
            .count()
    }

    /// The checkpoint's record of the GPUs nvdra turned on.
    fn mig_enabled(&self) -> serde_json::Value {
        self.checkpoint_json()
            .get("migEnabled")
            .cloned()
            .unwrap_or(json!([]))
    }
}

fn gpu0_uuid() -> String {
    nvdra::inventory::topology::load_profile("dgx-h100", NODE)
        .unwrap()
        .gpus[0]
        .uuid
        .to_string()
}

/// Checks GPU 0 is whole again and hands it out whole: no instance, MIG mode off, nothing
/// recorded, and claim `w` prepared and unprepared.
async fn whole_again(d: &Dirs, point: &str) {
    assert_eq!(d.gpu0_instances(), 0, "{point}: {:?}", d.mig_instances());
    assert_eq!(d.gpu0_mig_mode(), (false, false), "{point}");
    assert_eq!(d.mig_enabled(), json!([]), "{point}");
    let r = prepare(d, "w").await.unwrap();
    assert_eq!(r.error, "", "{point}: the GPU is whole again");
    assert_eq!(unprepare(d, "w").await, "", "{point}");
}

/// Kills the daemon at `point` of claim `a`'s prepare, restarts it, and has the kubelet retry.
async fn crash_in_prepare(point: &str) {
    let d = Dirs::dynamic();
    let mut first = d.spawn(Some(point));
    wait_ready(&d, &mut first).await;
    let dra_socket = d.dra_socket();
    let call = tokio::spawn(async move { super::prepare_at(&dra_socket, "a").await });
    kill_at_crash_point(&d, &mut first, point).await;
    assert!(call.await.unwrap().is_err(), "{point}: died mid-call");

    // The GPU was recorded as nvdra's before anything changed on it.
    assert_eq!(d.mig_enabled(), json!([gpu0_uuid()]), "{point}");
    let switched = point != "after-started";
    let created = matches!(
        point,
        "after-mig-created" | "after-cdi" | "before-completed" | "after-completed"
    );
    assert_eq!(d.gpu0_mig_mode(), (switched, switched), "{point}");
    assert_eq!(d.gpu0_instances(), usize::from(created), "{point}");

    let mut second = d.spawn(None);
    wait_ready(&d, &mut second).await;
    let claims = d.checkpoint_json()["claims"].as_object().unwrap().len();
    if point == "after-completed" {
        // Completed: kept, with its instance and the mode.
        assert_eq!(claims, 1, "{point}");
        assert_eq!(d.gpu0_instances(), 1, "{point}");
        assert_eq!(d.gpu0_mig_mode(), (true, true), "{point}");
        assert_eq!(d.mig_enabled(), json!([gpu0_uuid()]), "{point}");
    } else {
        // Rolled back before serving: no instance, the mode off, nothing recorded.
        assert_eq!(claims, 0, "{point}");
        assert!(d.specs().is_empty(), "{point}: {:?}", d.specs());
        whole_again(&d, point).await;
    }

    // The kubelet retries: prepared once, on an instance of its own.
    let r = prepare(&d, "a").await.unwrap();
    assert_eq!(r.error, "", "{point}");
    assert_eq!(d.gpu0_instances(), 1, "{point}: {:?}", d.mig_instances());
    assert_eq!(d.gpu0_mig_mode(), (true, true), "{point}");
    assert_eq!(d.specs(), vec![Dirs::spec_name("a")], "{point}");
    let r = prepare(&d, "w").await.unwrap();
    assert!(
        r.error.contains("by claim default/claim-a (a)"),
        "{point}: {}",
        r.error
    );
    assert_eq!(unprepare(&d, "a").await, "", "{point}");
    whole_again(&d, point).await;
    let status = terminate(&mut second).await;
    assert!(status.success(), "{point}: {status}");
}

/// Prepares claim `a`, kills the daemon at `point` of its unprepare, restarts it, and has the
/// kubelet retry the unprepare.
async fn crash_in_unprepare(point: &str) {
    let d = Dirs::dynamic();
    let mut first = d.spawn(Some(point));
    wait_ready(&d, &mut first).await;
    let r = prepare(&d, "a").await.unwrap();
    assert_eq!(r.error, "", "{point}");
    assert_eq!(d.gpu0_mig_mode(), (true, true), "{point}");
    let dra_socket = d.dra_socket();
    let call = tokio::spawn(async move { unprepare_call(&dra_socket, "a").await });
    kill_at_crash_point(&d, &mut first, point).await;
    assert!(call.await.unwrap().is_err(), "{point}: died mid-call");

    // The instance is gone at every point; the mode only after it was switched off.
    assert_eq!(d.gpu0_instances(), 0, "{point}");
    let on = point == "before-mig-mode-off";
    assert_eq!(d.gpu0_mig_mode(), (on, on), "{point}");

    let mut second = d.spawn(None);
    wait_ready(&d, &mut second).await;
    // A mode still on stays while the claim's entry holds the GPU; the retry finishes.
    assert_eq!(d.gpu0_mig_mode(), (on, on), "{point}");
    assert_eq!(unprepare(&d, "a").await, "", "{point}");
    let cp = d.checkpoint_json();
    assert!(
        cp["claims"].as_object().unwrap().is_empty(),
        "{point}: {cp}"
    );
    assert!(d.specs().is_empty(), "{point}: {:?}", d.specs());
    whole_again(&d, point).await;
    let status = terminate(&mut second).await;
    assert!(status.success(), "{point}: {status}");
}

/// Kills the daemon at `point` of claim `w`'s prepare (GPU 0 whole), GPU 0 found in MIG mode
/// with no instance (an operator's, not recorded as nvdra's), restarts it, and has the kubelet
/// retry: the mode goes off for the whole GPU exactly once, and an interrupted prepare leaves the
/// mode as the crash left it (the operator's on, or off), never half-recorded.
async fn crash_in_whole_prepare(point: &str) {
    let d = Dirs::dynamic();
    std::fs::write(d.nvml_state(), "created 0\nmig 0 1 1\n").unwrap();
    let mut first = d.spawn(Some(point));
    wait_ready(&d, &mut first).await;
    assert_eq!(d.gpu0_mig_mode(), (true, true), "{point}");
    let dra_socket = d.dra_socket();
    let call = tokio::spawn(async move { super::prepare_at(&dra_socket, "w").await });
    kill_at_crash_point(&d, &mut first, point).await;
    assert!(call.await.unwrap().is_err(), "{point}: died mid-call");
    let off = point == "after-mig-mode-off";
    assert_eq!(d.gpu0_mig_mode(), (!off, !off), "{point}");
    assert_eq!(d.mig_enabled(), json!([]), "{point}: not nvdra's to record");

    let mut second = d.spawn(None);
    wait_ready(&d, &mut second).await;
    // Rolled back; the mode stays as the crash left it.
    assert!(
        d.checkpoint_json()["claims"]
            .as_object()
            .unwrap()
            .is_empty()
    );
    assert_eq!(d.gpu0_mig_mode(), (!off, !off), "{point}");
    let r = prepare(&d, "w").await.unwrap();
    assert_eq!(r.error, "", "{point}");
    assert_eq!(d.gpu0_mig_mode(), (false, false), "{point}");
    let r = prepare(&d, "a").await.unwrap();
    assert!(
        r.error
            .contains("already prepared for claim default/claim-w"),
        "{point}: {}",
        r.error
    );
    assert_eq!(unprepare(&d, "w").await, "", "{point}");
    let r = prepare(&d, "a").await.unwrap();
    assert_eq!(r.error, "", "{point}");
    assert_eq!(unprepare(&d, "a").await, "", "{point}");
    assert_eq!(d.gpu0_mig_mode(), (false, false), "{point}");
    assert_eq!(d.mig_enabled(), json!([]), "{point}");
    let status = terminate(&mut second).await;
    assert!(status.success(), "{point}: {status}");
}

/// Kills the daemon between the driver's refusal of claim `a`'s switch (IN_USE or
/// RESET_REQUIRED: both leave the change pending, as NVML does) and its withdrawal, and restarts
/// it (`first` sets up the refusal; the second process runs on idle GPUs that switch): start-up
/// withdraws the change before serving, and the kubelet's retry switches the GPU.
async fn crash_after_refused(what: &str, first: impl FnOnce(&mut std::process::Command)) {
    let point = "after-mig-mode-refused";
    let d = Dirs::dynamic();
    let mut cmd = d.command(Some(point));
    first(&mut cmd);
    let mut first = cmd.spawn().unwrap();
    wait_ready(&d, &mut first).await;
    let dra_socket = d.dra_socket();
    let call = tokio::spawn(async move { super::prepare_at(&dra_socket, "a").await });
    kill_at_crash_point(&d, &mut first, point).await;
    assert!(call.await.unwrap().is_err(), "{what}: died mid-call");
    assert_eq!(d.gpu0_mig_mode(), (false, true), "{what}: left pending");
    assert_eq!(d.mig_enabled(), json!([gpu0_uuid()]), "{what}");

    let mut second = d.spawn(None);
    wait_ready(&d, &mut second).await;
    assert_eq!(d.gpu0_mig_mode(), (false, false), "{what}: withdrawn");
    assert!(
        d.checkpoint_json()["claims"]
            .as_object()
            .unwrap()
            .is_empty()
    );
    assert_eq!(d.mig_enabled(), json!([]), "{what}");
    let r = prepare(&d, "a").await.unwrap();
    assert_eq!(r.error, "", "{what}");
    assert_eq!(d.gpu0_mig_mode(), (true, true), "{what}");
    assert_eq!(d.gpu0_instances(), 1, "{what}");
    assert_eq!(unprepare(&d, "a").await, "", "{what}");
    whole_again(&d, what).await;
    let status = terminate(&mut second).await;
    assert!(status.success(), "{what}: {status}");
}

#[tokio::test]
async fn dynamic_mig_crash_after_mig_mode_in_use() {
    // GPU 0's process runs.
    crash_after_refused("in-use", |c| {
        c.env_remove("FAKE_NVML_IDLE");
    })
    .await;
}

#[tokio::test]
async fn dynamic_mig_crash_after_mig_mode_reset_required() {
    // An H100 whose switch waits for a reset, as some hypervisors' passthrough GPUs answer.
    crash_after_refused("reset-required", |c| {
        c.env("FAKE_NVML_RESET_REQUIRED", "0");
    })
    .await;
}

/// The same refusal without a crash: the change is withdrawn at once, so nothing is left
/// pending while the daemon runs on, and the retry succeeds once the GPU is idle (after a
/// restart here: the fake's GPUs are idle or not per process).
#[tokio::test]
async fn dynamic_mig_in_use_leaves_nothing_pending() {
    let d = Dirs::dynamic();
    let mut first = d
        .command(None)
        .env_remove("FAKE_NVML_IDLE")
        .spawn()
        .unwrap();
    wait_ready(&d, &mut first).await;
    let r = prepare(&d, "a").await.unwrap();
    assert!(
        r.error.contains("cannot turn the MIG mode of GPU gpu-0"),
        "{}",
        r.error
    );
    assert_eq!(d.gpu0_mig_mode(), (false, false), "withdrawn at once");
    assert_eq!(d.mig_enabled(), json!([]));
    let status = terminate(&mut first).await;
    assert!(status.success(), "{status}");
    let mut second = d.spawn(None);
    wait_ready(&d, &mut second).await;
    let r = prepare(&d, "a").await.unwrap();
    assert_eq!(r.error, "");
    assert_eq!(unprepare(&d, "a").await, "");
    whole_again(&d, "in-use").await;
    let status = terminate(&mut second).await;
    assert!(status.success(), "{status}");
}

/// The driver gives GPU 0 another minor when its MIG mode switches (NVML's documentation allows
/// it; `FAKE_NVML_MINOR_XOR`): the claim's spec has the device node of the minor read after the
/// switch.
#[tokio::test]
async fn dynamic_mig_spec_has_the_minor_read_after_the_switch() {
    let d = Dirs::dynamic();
    let mut daemon = d
        .command(None)
        .env("FAKE_NVML_MINOR_XOR", "64")
        .spawn()
        .unwrap();
    wait_ready(&d, &mut daemon).await;
    let r = prepare(&d, "a").await.unwrap();
    assert_eq!(r.error, "");
    let spec = std::fs::read_to_string(d.p("cdi").join(Dirs::spec_name("a"))).unwrap();
    assert!(spec.contains("/dev/nvidia64"), "{spec}");
    assert!(!spec.contains("/dev/nvidia0\n"), "{spec}");
    assert_eq!(unprepare(&d, "a").await, "");
    let status = terminate(&mut daemon).await;
    assert!(status.success(), "{status}");
}

#[tokio::test]
async fn dynamic_mig_crash_in_whole_prepare_after_started() {
    crash_in_whole_prepare("after-started").await;
}

#[tokio::test]
async fn dynamic_mig_crash_in_whole_prepare_after_mig_mode_off() {
    crash_in_whole_prepare("after-mig-mode-off").await;
}

#[tokio::test]
async fn dynamic_mig_crash_after_started() {
    crash_in_prepare("after-started").await;
}

#[tokio::test]
async fn dynamic_mig_crash_after_mig_mode_on() {
    crash_in_prepare("after-mig-mode-on").await;
}

#[tokio::test]
async fn dynamic_mig_crash_after_mig_created() {
    crash_in_prepare("after-mig-created").await;
}

#[tokio::test]
async fn dynamic_mig_crash_after_cdi() {
    crash_in_prepare("after-cdi").await;
}

#[tokio::test]
async fn dynamic_mig_crash_before_completed() {
    crash_in_prepare("before-completed").await;
}

#[tokio::test]
async fn dynamic_mig_crash_after_completed() {
    crash_in_prepare("after-completed").await;
}

#[tokio::test]
async fn dynamic_mig_crash_in_unprepare_before_mig_mode_off() {
    crash_in_unprepare("before-mig-mode-off").await;
}

#[tokio::test]
async fn dynamic_mig_crash_in_unprepare_after_mig_mode_off() {
    crash_in_unprepare("after-mig-mode-off").await;
}

#[tokio::test]
async fn dynamic_mig_crash_in_unprepare_after_undo() {
    crash_in_unprepare("after-undo").await;
}

#[tokio::test]
async fn dynamic_mig_crash_in_unprepare_after_spec_removed() {
    crash_in_unprepare("after-spec-removed").await;
}

#[tokio::test]
async fn dynamic_mig_crash_in_unprepare_after_forgotten() {
    crash_in_unprepare("after-forgotten").await;
}
