//! SIGKILL at each step of a share's prepare, beside another claim's share of the GPU and as the
//! GPU's first, and of the last share's unprepare (`--shared-capacity`; shares of
//! `gpu-2`, 8Gi each). One MPS control daemon serves a GPU's shares,
//! run by `nvdra mps-host` as the plugin asks; the stand-in `nvidia-cuda-mps-control` logs its
//! starts and quits across the processes, and whether it answers says whether it runs. After
//! every crash, the restart and the kubelet's retry: exactly the shares whose prepare completed
//! are in the checkpoint, the daemon runs if and only if a share is held (started once for as
//! long as one is), and unpreparing everything leaves no daemon, no spec and no entry.

use std::path::PathBuf;
use std::process::Child;

use super::{
    DRIVER, Dirs, NODE, kill_at_crash_point, left_behind, prepare, terminate, unprepare,
    unprepare_call, wait_ready,
};
use crate::support::mps;

const DEVICE: &str = "gpu-2";

fn share_id(uid: &str) -> String {
    format!("5f0e0000-0000-4000-8000-{:012x}", uid.as_bytes()[0])
}

impl Dirs {
    /// `a` and `b`, shares of [`DEVICE`], allocated; the stand-in MPS installed and the MPS host
    /// running.
    fn with_shares() -> Dirs {
        let mut d = Dirs::new();
        d.shared_capacity = true;
        mps::install_standin(&d.p("driver"));
        d.mps_host = Some(mps::Host::start(
            &d.p("mps"),
            &d.p("driver"),
            &d.boot_file(),
            &[],
        ));
        for uid in ["a", "b"] {
            mps::write_share_claim(
                &d.p("api"),
                DRIVER,
                NODE,
                uid,
                DEVICE,
                &share_id(uid),
                "8Gi",
            );
        }
        d
    }

    fn driver(&self) -> PathBuf {
        self.p("driver")
    }

    /// The pipe directory of GPU 2's share daemon.
    fn share_pipe(&self) -> PathBuf {
        use nvdra::inventory::DeviceBackend;
        let gpu = nvdra::inventory::sim::SimBackend::from_profile(self.profile, NODE)
            .unwrap()
            .snapshot()
            .unwrap()
            .gpus[2]
            .uuid
            .to_string();
        mps::gpu_pipe_dir(&self.p("mps"), &gpu)
    }

    /// Whether the GPU's daemon runs, once the host has followed the plugin's request: a
    /// requested daemon answers, a released one's directory is gone.
    fn daemon_runs(&self) -> bool {
        let pipe = self.share_pipe();
        let dir = pipe.parent().unwrap();
        let requested = dir.join("daemon.json").exists();
        mps::eventually("the MPS host follows the request", || {
            if requested {
                mps::ask(&self.driver(), &pipe, "get_server_list").is_some()
            } else {
                !dir.exists()
            }
        });
        requested
    }

    /// The claims in the checkpoint, each with its state, in UID order.
    fn claim_states(&self) -> Vec<(String, String)> {
        let cp = self.checkpoint_json();
        cp["claims"]
            .as_object()
            .unwrap()
            .iter()
            .map(|(uid, e)| (uid.clone(), e["state"].as_str().unwrap().to_string()))
            .collect()
    }

    /// The daemon's (starts, quits) so far, once the host has followed the plugin's request.
    fn daemon_starts_stops(&self) -> (usize, usize) {
        self.daemon_runs();
        (
            mps::count(&self.driver(), "start"),
            mps::count(&self.driver(), "quit"),
        )
    }
}

/// `nvdra run`, SIGKILLed when dropped, so a failed assertion leaves no process behind.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Dirs {
    fn run(&self, crash_at: Option<&str>) -> Running {
        Running(self.spawn(crash_at))
    }
}

fn completed(uids: &[&str]) -> Vec<(String, String)> {
    uids.iter()
        .map(|u| (u.to_string(), "PrepareCompleted".to_string()))
        .collect()
}

fn spec_names(uids: &[&str]) -> Vec<String> {
    uids.iter().map(|u| Dirs::spec_name(u)).collect()
}

/// Prepares `uids` one by one with a process of its own, then stops it (SIGTERM).
async fn prepared_before(d: &Dirs, uids: &[&str], then_unprepare: &[&str]) {
    let mut p = d.run(None);
    wait_ready(d, &mut p.0).await;
    for uid in uids {
        let r = prepare(d, uid).await.unwrap();
        assert_eq!(r.error, "", "{uid}");
    }
    for uid in then_unprepare {
        assert_eq!(unprepare(d, uid).await, "", "{uid}");
    }
    assert!(terminate(&mut p.0).await.success());
}

/// With `a`'s share of the GPU prepared (and its daemon running) when `beside_a`, else alone,
/// the process dies at `point` of `b`'s prepare.
async fn crash_a_share_prepare(point: &str, beside_a: bool) {
    let d = Dirs::with_shares();
    let others: &[&str] = if beside_a { &["a"] } else { &[] };
    let starts = others.len();
    prepared_before(&d, others, &[]).await;
    assert_eq!(d.daemon_runs(), beside_a);
    assert_eq!(d.daemon_starts_stops(), (starts, 0));

    let mut first = d.run(Some(point));
    wait_ready(&d, &mut first.0).await;
    assert_eq!(
        d.daemon_starts_stops(),
        (starts, 0),
        "{point}: a running daemon is kept at start-up"
    );
    let dra_socket = d.dra_socket();
    let call = tokio::spawn(async move { super::prepare_at(&dra_socket, "b").await });
    kill_at_crash_point(&d, &mut first.0, point).await;
    let r = call.await.unwrap();
    assert!(r.is_err(), "{point}: the process died mid-call: {r:?}");

    // Beside a running daemon a share changes nothing on the GPU: its spec and record are
    // written in parallel, as a whole GPU's. As the GPU's first, its record is made durable
    // before the daemon starts, so every point after the start has it.
    let (state, spec) = if beside_a || point == "after-started" {
        left_behind(point, false)
    } else {
        (Some("PrepareCompleted"), point != "before-completed")
    };
    let mut want = completed(others);
    if let Some(state) = state {
        want.push(("b".into(), state.into()));
    }
    assert_eq!(d.claim_states(), want, "{point}");
    let mut specs = spec_names(others);
    if spec {
        specs.push(Dirs::spec_name("b"));
    }
    assert_eq!(d.specs(), specs, "{point}");
    let started_by_b = !beside_a && point != "after-started";
    assert_eq!(d.daemon_runs(), beside_a || started_by_b, "{point}");
    let starts = starts + usize::from(started_by_b);
    assert_eq!(d.daemon_starts_stops(), (starts, 0), "{point}");

    let mut second = d.run(None);
    wait_ready(&d, &mut second.0).await;
    // Recovery keeps exactly the shares whose prepare completed, and the daemon iff one is.
    let mut held = others.to_vec();
    if state == Some("PrepareCompleted") {
        held.push("b");
    }
    assert_eq!(d.claim_states(), completed(&held), "{point}");
    assert_eq!(d.specs(), spec_names(&held), "{point}");
    let running = !held.is_empty();
    assert_eq!(d.daemon_runs(), running, "{point}");
    let stops = usize::from(started_by_b && !running);
    assert_eq!(d.daemon_starts_stops(), (starts, stops), "{point}");

    // The kubelet retries b.
    let r = prepare(&d, "b").await.unwrap();
    assert_eq!(r.error, "", "{point}");
    assert_eq!(r.devices.len(), 1);
    assert_eq!(r.devices[0].share_id.as_deref(), Some(&*share_id("b")));
    assert_eq!(
        r.devices[0].cdi_device_ids,
        vec![format!("k8s.{DRIVER}/claim=b-{DEVICE}")]
    );
    let mut held = others.to_vec();
    held.push("b");
    assert_eq!(d.claim_states(), completed(&held), "{point}");
    assert_eq!(d.specs(), spec_names(&held));
    let cp = d.checkpoint_json();
    for uid in &held {
        assert_eq!(
            cp["claims"][*uid]["devices"][0]["consumedCapacity"],
            serde_json::json!({"memory": 8u64 << 30}),
            "{point}: {cp}"
        );
    }
    assert!(d.daemon_runs(), "{point}");
    let starts = starts + usize::from(!running);
    assert_eq!(
        d.daemon_starts_stops(),
        (starts, stops),
        "{point}: one daemon while a share is held"
    );

    // Unprepared, b first: the daemon goes with the last share.
    assert_eq!(unprepare(&d, "b").await, "");
    assert_eq!(
        d.daemon_runs(),
        beside_a,
        "{point}: runs iff a is still held"
    );
    if beside_a {
        assert_eq!(unprepare(&d, "a").await, "");
    }
    assert!(!d.daemon_runs() && !d.share_pipe().exists(), "{point}");
    assert_eq!(d.daemon_starts_stops(), (starts, stops + 1), "{point}");
    assert!(d.specs().is_empty(), "{point}: {:?}", d.specs());
    assert!(d.claim_states().is_empty(), "{point}");
    let status = terminate(&mut second.0).await;
    assert!(status.success(), "{point}: clean exit on SIGTERM: {status}");
}

/// `a` and `b` were prepared and `b` unprepared; the process dies at `point` of the unprepare of
/// `a`, the GPU's last share.
async fn crash_the_last_shares_unprepare(point: &str) {
    let d = Dirs::with_shares();
    prepared_before(&d, &["a", "b"], &["b"]).await;
    assert!(d.daemon_runs());
    assert_eq!(d.daemon_starts_stops(), (1, 0));

    let mut first = d.run(Some(point));
    wait_ready(&d, &mut first.0).await;
    let dra_socket = d.dra_socket();
    let call = tokio::spawn(async move { unprepare_call(&dra_socket, "a").await });
    kill_at_crash_point(&d, &mut first.0, point).await;
    let r = call.await.unwrap();
    assert!(r.is_err(), "{point}: the process died mid-call: {r:?}");

    // Every point comes after the daemon's stop; then the spec and the entry go in parallel.
    assert!(!d.daemon_runs(), "{point}");
    assert_eq!(d.daemon_starts_stops(), (1, 1), "{point}");
    let (entry, spec) = match point {
        "after-undo" => (true, true),
        "after-spec-removed" => (true, false),
        "after-forgotten" => (false, true),
        _ => panic!("not an unprepare crash point: {point}"),
    };
    let a: &[&str] = &["a"];
    assert_eq!(
        d.claim_states(),
        completed(if entry { a } else { &[] }),
        "{point}"
    );
    assert_eq!(d.specs(), spec_names(if spec { a } else { &[] }), "{point}");

    let mut second = d.run(None);
    wait_ready(&d, &mut second.0).await;
    if entry {
        // Still prepared as far as the checkpoint goes: recovery brings its daemon and spec back
        // for the kubelet's retry to take down again.
        assert!(d.daemon_runs(), "{point}: a is held");
        assert_eq!(d.daemon_starts_stops(), (2, 1), "{point}");
        assert_eq!(d.specs(), spec_names(a), "{point}");
    } else {
        // Forgotten: its orphan spec goes, and no daemon comes back.
        assert!(!d.daemon_runs(), "{point}: no share is held");
        assert_eq!(d.daemon_starts_stops(), (1, 1), "{point}");
        assert!(d.specs().is_empty(), "{point}: {:?}", d.specs());
        assert!(d.claim_states().is_empty(), "{point}");
    }

    // The kubelet retries the unprepare.
    assert_eq!(unprepare(&d, "a").await, "", "{point}");
    assert!(!d.daemon_runs() && !d.share_pipe().exists(), "{point}");
    let (starts, stops) = d.daemon_starts_stops();
    assert_eq!(starts, stops, "{point}: every start stopped");
    assert!(d.specs().is_empty(), "{point}: {:?}", d.specs());
    assert!(d.claim_states().is_empty(), "{point}");
    let status = terminate(&mut second.0).await;
    assert!(status.success(), "{point}: clean exit on SIGTERM: {status}");
}

#[tokio::test]
async fn share_crash_after_started() {
    crash_a_share_prepare("after-started", true).await;
}

#[tokio::test]
async fn first_share_crash_after_started() {
    crash_a_share_prepare("after-started", false).await;
}

#[tokio::test]
async fn share_crash_after_cdi() {
    crash_a_share_prepare("after-cdi", true).await;
}

#[tokio::test]
async fn first_share_crash_after_cdi() {
    crash_a_share_prepare("after-cdi", false).await;
}

#[tokio::test]
async fn share_crash_before_completed() {
    crash_a_share_prepare("before-completed", true).await;
}

#[tokio::test]
async fn first_share_crash_before_completed() {
    crash_a_share_prepare("before-completed", false).await;
}

#[tokio::test]
async fn share_crash_after_completed() {
    crash_a_share_prepare("after-completed", true).await;
}

#[tokio::test]
async fn first_share_crash_after_completed() {
    crash_a_share_prepare("after-completed", false).await;
}

#[tokio::test]
async fn last_share_unprepare_crash_after_undo() {
    crash_the_last_shares_unprepare("after-undo").await;
}

#[tokio::test]
async fn last_share_unprepare_crash_after_spec_removed() {
    crash_the_last_shares_unprepare("after-spec-removed").await;
}

#[tokio::test]
async fn last_share_unprepare_crash_after_forgotten() {
    crash_the_last_shares_unprepare("after-forgotten").await;
}
