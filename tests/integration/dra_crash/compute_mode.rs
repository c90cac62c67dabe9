//! A share's GPU stays in `EXCLUSIVE_PROCESS` across a SIGKILL (`src/dra/compute_mode.rs`): on
//! the NVML backend over the fake library, whose compute modes outlive the process as a GPU's
//! do (`FAKE_NVML_STATE`). The process is killed in the middle of the GPU's first share's
//! prepare, and again while the share is held with the GPU reset to `DEFAULT` meanwhile (a
//! driver reload, another agent): each restart finds the share held and the GPU in
//! `EXCLUSIVE_PROCESS`, and the unprepare of the last share puts back the mode the GPU had
//! before the first (`PROHIBITED` here), recorded across both kills.

use std::os::raw::c_uint;
use std::process::Command;

use super::{DRIVER, Dirs, NODE, kill_at_crash_point, prepare, terminate, unprepare, wait_ready};
use crate::support::dra::wait_exit;
use crate::support::mps;

/// GPU 2 of `dgx-h100`, by the fake's index and by nvdra's name.
const GPU: usize = 2;
const DEVICE: &str = "gpu-2";

/// `NVML_COMPUTEMODE_*` (nvml.h).
const DEFAULT: c_uint = 0;
const PROHIBITED: c_uint = 2;
const EXCLUSIVE_PROCESS: c_uint = 3;

impl Dirs {
    /// The fake's compute mode of GPU `gpu`: its `mode` line in the state file, `DEFAULT`
    /// without one (`tests/fake-nvml/src/state.rs`).
    fn compute_mode(&self, gpu: usize) -> c_uint {
        let text = std::fs::read_to_string(self.nvml_state()).unwrap_or_default();
        text.lines()
            .filter_map(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                match f[..] {
                    ["mode", g, m] if g.parse() == Ok(gpu) => m.parse().ok(),
                    _ => None,
                }
            })
            .next_back()
            .unwrap_or(DEFAULT)
    }

    /// Sets the fake's compute mode of `gpu` while no process uses the library, as
    /// `nvidia-smi -c` or a GPU reset would.
    fn set_compute_mode(&self, gpu: usize, mode: c_uint) {
        let text = std::fs::read_to_string(self.nvml_state()).unwrap_or_default();
        let mut lines: Vec<String> = text
            .lines()
            .filter(|l| !l.starts_with(&format!("mode {gpu} ")))
            .map(str::to_string)
            .collect();
        if mode != DEFAULT {
            lines.push(format!("mode {gpu} {mode}"));
        }
        std::fs::write(self.nvml_state(), lines.join("\n") + "\n").unwrap();
    }
}

fn sigkill(child: &std::process::Child) {
    let killed = Command::new("kill")
        .args(["-KILL", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
}

#[tokio::test]
async fn exclusive_process_survives_a_sigkill_and_a_reset_while_the_share_is_held() {
    let mut d = Dirs::new();
    d.nvml = true;
    d.shared_capacity = true;
    mps::install_standin(&d.p("driver"));
    d.mps_host = Some(mps::Host::start(
        &d.p("mps"),
        &d.p("driver"),
        &d.boot_file(),
        &[],
    ));
    mps::write_share_claim(
        &d.p("api"),
        DRIVER,
        NODE,
        "a",
        DEVICE,
        "5f0e0000-0000-4000-8000-000000000061",
        "8Gi",
    );
    d.set_compute_mode(GPU, PROHIBITED);

    // Killed after the share's record is durable, before the kubelet hears of it.
    let point = "before-completed";
    let mut first = d.spawn(Some(point));
    wait_ready(&d, &mut first).await;
    let dra_socket = d.dra_socket();
    let call = tokio::spawn(async move { super::prepare_at(&dra_socket, "a").await });
    kill_at_crash_point(&d, &mut first, point).await;
    assert!(call.await.unwrap().is_err(), "the process died mid-call");
    assert_eq!(
        d.compute_mode(GPU),
        EXCLUSIVE_PROCESS,
        "left by the killed process"
    );

    let mut second = d.spawn(None);
    wait_ready(&d, &mut second).await;
    assert_eq!(
        d.checkpoint_json()["claims"]["a"]["state"],
        "PrepareCompleted"
    );
    assert_eq!(
        d.compute_mode(GPU),
        EXCLUSIVE_PROCESS,
        "kept by the restart: the share is held"
    );
    // The kubelet's retry.
    assert_eq!(prepare(&d, "a").await.unwrap().error, "");
    assert_eq!(d.compute_mode(GPU), EXCLUSIVE_PROCESS);

    // Killed while the share is held; the GPU is reset before the next start.
    sigkill(&second);
    wait_exit(&mut second).await;
    assert_eq!(d.compute_mode(GPU), EXCLUSIVE_PROCESS);
    d.set_compute_mode(GPU, DEFAULT);
    let mut third = d.spawn(None);
    wait_ready(&d, &mut third).await;
    assert_eq!(
        d.compute_mode(GPU),
        EXCLUSIVE_PROCESS,
        "set again at start-up, before serving: the share is held"
    );

    // The last share's unprepare puts back the mode before the first share.
    assert_eq!(unprepare(&d, "a").await, "");
    assert_eq!(d.compute_mode(GPU), PROHIBITED);
    assert!(terminate(&mut third).await.success());
}
