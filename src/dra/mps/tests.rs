//! The plugin's side of the directory protocol, against a model of the MPS host: a thread that
//! does what `nvdra mps-host` does to the directory (a daemon per request, its directory removed
//! on release) and a fake `nvidia-cuda-mps-control` client that answers while that "daemon" runs.
//! The real host and the stand-in daemon, as processes, are tested in
//! `tests/integration/mps_host.rs`.

use super::*;
use crate::inventory::GpuUuid;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

/// A fake `nvidia-cuda-mps-control` under `driver_root`, client mode only: it answers (exit 0)
/// when `<pipe>/answering` exists, which [`FakeHost`] creates for each daemon it "runs", and
/// otherwise fails as the real client does when no daemon listens.
pub(crate) fn fake_control(driver_root: &Path) {
    let bin = driver_root.join("usr/bin");
    std::fs::create_dir_all(&bin).unwrap();
    let script = "#!/bin/sh\nread cmd\n\
                  if [ -e \"$CUDA_MPS_PIPE_DIRECTORY/answering\" ]; then exit 0; fi\n\
                  echo 'Cannot find MPS control daemon process' >&2\nexit 1\n";
    let p = bin.join(CONTROL);
    std::fs::write(&p, script).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// The host's part, on a thread: for each request a "daemon" (`<pipe>/answering`) and a log
/// line `start <devices> <pipe>` in `<driver root>/mps.log`; for each release `quit <pipe>` and
/// the directory removed.
pub(crate) struct FakeHost {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl FakeHost {
    pub(crate) fn start(driver_root: &Path, mps_root: &Path) -> FakeHost {
        fake_control(driver_root);
        let (log, layout) = (driver_root.join("mps.log"), Layout::new(mps_root));
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                for id in layout.daemons().unwrap_or_default() {
                    let (pipe, answering) = (layout.pipe(&id), layout.pipe(&id).join("answering"));
                    match layout.read_spec(&id) {
                        Ok(Some(spec)) if !answering.exists() => {
                            append(
                                &log,
                                &format!("start {} {}", spec.devices.join(","), pipe.display()),
                            );
                            // The directory may vanish meanwhile (a test's reboot empties
                            // the MPS root): a host goes on, and starts it when asked again.
                            let _ = std::fs::write(&answering, "");
                        }
                        Ok(None) => {
                            append(&log, &format!("quit {}", pipe.display()));
                            let _ = std::fs::remove_dir_all(layout.dir(&id));
                        }
                        _ => {}
                    }
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        });
        FakeHost {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for FakeHost {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn append(log: &Path, line: &str) {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .unwrap();
    writeln!(f, "{line}").unwrap();
}

/// What the fake host did, a line each.
pub(crate) fn logged(driver_root: &Path) -> Vec<String> {
    std::fs::read_to_string(driver_root.join("mps.log"))
        .unwrap_or_default()
        .lines()
        .map(String::from)
        .collect()
}

/// Waits (up to 10 s) until `f` holds: the fake host works on its own thread.
pub(crate) fn eventually(what: &str, f: impl Fn() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < Duration::from_secs(10), "never: {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn mps(dir: &Path) -> Mps {
    Mps::new(dir.join("mps"), dir.join("driver"), "boot-1".into())
}

#[test]
fn a_claims_daemon_is_requested_for_its_devices_waited_for_and_released() {
    let dir = tempfile::tempdir().unwrap();
    let driver = dir.path().join("driver");
    let _host = FakeHost::start(&driver, &dir.path().join("mps"));
    let mps = mps(dir.path());
    let claim = ClaimUid::parse("c1").unwrap();
    let a = DeviceUuid::Gpu(GpuUuid("GPU-a".into()));
    let b = DeviceUuid::Gpu(GpuUuid("GPU-b".into()));
    let pipe = mps.start(&claim, &[a.clone(), b.clone()]).unwrap();
    assert_eq!(pipe, mps.pipe_dir(&claim));
    // It returned once the daemon answered: the host had started it.
    assert_eq!(
        logged(&driver),
        vec![format!("start GPU-a,GPU-b {}", pipe.display())]
    );
    let id = DaemonId::claim(&claim);
    let spec = Layout::new(dir.path().join("mps"))
        .read_spec(&id)
        .unwrap()
        .unwrap();
    assert_eq!(spec.boot_id.as_deref(), Some("boot-1"));
    assert_eq!(spec.owner, "claim c1");
    let mode = |p: PathBuf| std::fs::metadata(p).unwrap().permissions().mode() & 0o7777;
    assert_eq!(mode(pipe.clone()), 0o1777);
    assert_eq!(mode(mps.shm_dir(&claim)), 0o1777);
    // Asking again for a daemon that answers changes nothing.
    mps.start(&claim, &[a, b]).unwrap();
    mps.stop(&claim).unwrap();
    mps.stop(&claim).unwrap();
    eventually("the released directory is removed", || !pipe.exists());
    assert_eq!(
        logged(&driver),
        vec![
            format!("start GPU-a,GPU-b {}", pipe.display()),
            format!("quit {}", pipe.display())
        ]
    );
}

/// A released daemon stays quitting (its control daemon or server may still hold the GPU)
/// until the host has removed its directory; one asked for again is not quitting.
#[test]
fn a_released_daemon_is_quitting_until_the_host_removes_it() {
    let dir = tempfile::tempdir().unwrap();
    let driver = dir.path().join("driver");
    let mps = mps(dir.path());
    let claim = ClaimUid::parse("c1").unwrap();
    let (a, b) = (
        DeviceUuid::Gpu(GpuUuid("GPU-a".into())),
        DeviceUuid::Gpu(GpuUuid("GPU-b".into())),
    );
    // No host yet: the request is written and nobody removes the released directory.
    mps.ensure(&claim, &[a.clone(), b]).unwrap();
    assert!(
        mps.quitting(&["GPU-a"]).is_empty(),
        "asked for, not released"
    );
    mps.stop(&claim).unwrap();
    let id = DaemonId::claim(&claim);
    assert_eq!(mps.quitting(&["GPU-b", "GPU-c"]), vec![id.clone()]);
    assert!(mps.quitting(&["GPU-c"]).is_empty(), "serves neither");
    mps.ensure(&claim, std::slice::from_ref(&a)).unwrap();
    assert!(mps.quitting(&["GPU-a"]).is_empty(), "asked for again");
    mps.stop(&claim).unwrap();
    assert_eq!(mps.quitting(&["GPU-a"]), vec![id]);
    let _host = FakeHost::start(&driver, &dir.path().join("mps"));
    eventually("the host removed it", || {
        mps.quitting(&["GPU-a"]).is_empty()
    });
}

#[test]
fn missing_control_binary_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let e = mps(dir.path())
        .start(
            &ClaimUid::parse("c").unwrap(),
            &[DeviceUuid::Gpu(GpuUuid("GPU-a".into()))],
        )
        .unwrap_err();
    assert!(e.to_string().contains("nvidia-cuda-mps-control"), "{e}");
}

#[test]
fn a_gpus_share_daemon_is_requested_once_and_released_when_no_share_is_left() {
    let dir = tempfile::tempdir().unwrap();
    let driver = dir.path().join("driver");
    let _host = FakeHost::start(&driver, &dir.path().join("mps"));
    let mps = mps(dir.path());
    let gpu = GpuUuid("GPU-a".into());
    let pipe = mps.ensure_gpu(&gpu).unwrap();
    assert_eq!(
        mps.ensure_gpu(&gpu).unwrap(),
        pipe,
        "a running daemon is reused"
    );
    assert_eq!(pipe, mps.gpu_pipe_dir(&gpu));
    assert!(mps.alive_gpu(&gpu));
    mps.stop_gpu(&gpu, || true).unwrap();
    assert!(mps.gpu_requested(&gpu), "kept while a share is left");
    mps.stop_gpu(&gpu, || false).unwrap();
    mps.stop_gpu(&gpu, || false).unwrap();
    eventually("the released directory is removed", || !pipe.exists());
    assert!(!mps.alive_gpu(&gpu));
    assert_eq!(
        logged(&driver),
        vec![
            format!("start GPU-a {}", pipe.display()),
            format!("quit {}", pipe.display())
        ]
    );
}

/// A MIG device's shares get a daemon of their own, keyed by the MIG UUID (`m-…`, a directory
/// the host finds), with the MIG device alone visible to it, in multi-user mode as its GPU, and
/// beside the daemon of another device, which its release leaves alone.
#[test]
fn a_mig_devices_share_daemon_is_its_own_and_sees_only_the_mig_device() {
    use crate::inventory::DeviceBackend;
    let dir = tempfile::tempdir().unwrap();
    let driver = dir.path().join("driver");
    let _host = FakeHost::start(&driver, &dir.path().join("mps"));
    let mps = mps(dir.path());
    let inv = crate::inventory::sim::SimBackend::from_profile("a100-mig-mixed", "n")
        .unwrap()
        .snapshot()
        .unwrap();
    mps.know_gpus(&inv);
    let mig = inv
        .gpus
        .iter()
        .flat_map(|g| &g.mig.devices)
        .next()
        .expect("the profile has MIG devices")
        .uuid
        .clone();
    let (mig, gpu) = (DeviceUuid::Mig(mig), GpuUuid("GPU-a".into()));
    let pipe = mps.ensure_shares(&mig).unwrap();
    let layout = Layout::new(dir.path().join("mps"));
    let id = DaemonId::mig(match &mig {
        DeviceUuid::Mig(m) => m,
        DeviceUuid::Gpu(_) => unreachable!(),
    });
    assert!(id.as_str().starts_with("m-"));
    assert_eq!(pipe, layout.pipe(&id));
    assert_eq!(pipe, mps.shares_pipe_dir(&mig));
    assert_eq!(mps.shares_shm_dir(&mig), layout.shm(&id));
    let spec = layout.read_spec(&id).unwrap().unwrap();
    assert_eq!(spec.devices, vec![mig.as_str().to_string()]);
    assert!(spec.multi_user, "an A100's MIG device: Ampere, multi-user");
    assert!(spec.owner.contains("MIG device"), "{}", spec.owner);
    let gpu_pipe = mps.ensure_gpu(&gpu).unwrap();
    assert_ne!(gpu_pipe, pipe);
    assert!(mps.alive_shares(&mig) && mps.alive_gpu(&gpu));
    mps.stop_shares(&mig, || false).unwrap();
    eventually("the released directory is removed", || !pipe.exists());
    assert!(!mps.shares_requested(&mig) && mps.gpu_requested(&gpu));
    assert!(mps.alive_gpu(&gpu), "the GPU's daemon is another");
    assert_eq!(
        logged(&driver)[..2],
        [
            format!("start {mig} {}", pipe.display()),
            format!("start GPU-a {}", gpu_pipe.display()),
        ]
    );
}

#[test]
fn a_daemon_that_never_answers_fails_the_request_naming_the_gpu_and_the_host() {
    let dir = tempfile::tempdir().unwrap();
    // A client, but no host: nothing starts the daemon. A control socket file left over from
    // an earlier daemon does not count as one running.
    fake_control(&dir.path().join("driver"));
    let mps = mps(dir.path()).with_start_deadline(Duration::from_millis(300));
    let gpu = GpuUuid("GPU-a".into());
    std::fs::create_dir_all(mps.gpu_pipe_dir(&gpu)).unwrap();
    std::fs::write(mps.gpu_pipe_dir(&gpu).join("control"), "").unwrap();
    assert!(!mps.alive_gpu(&gpu));
    let e = mps.ensure_gpu(&gpu).unwrap_err();
    let msg = crate::report::chain(&e).to_string();
    for want in [
        "GPU-a",
        "MPS host",
        "not running",
        &mps.layout.log(&DaemonId::gpu(&gpu)).display().to_string(),
        "Cannot find MPS control daemon",
    ] {
        assert!(msg.contains(want), "{want:?} in {msg}");
    }
    assert!(
        mps.gpu_requested(&gpu),
        "the request stays for the host to find"
    );
}

#[test]
fn waiting_for_a_daemon_does_not_hold_the_gpus_lock() {
    let dir = tempfile::tempdir().unwrap();
    fake_control(&dir.path().join("driver"));
    let mps = Arc::new(mps(dir.path()).with_start_deadline(Duration::from_secs(30)));
    let gpu = GpuUuid("GPU-a".into());
    let waiting = {
        let (mps, gpu) = (mps.clone(), gpu.clone());
        std::thread::spawn(move || mps.ensure_gpu(&gpu))
    };
    eventually("the request is written", || mps.gpu_requested(&gpu));
    // Releasing takes the GPU's lock: it finishes while the request still waits for an answer.
    mps.stop_gpu(&gpu, || false).unwrap();
    assert!(
        !waiting.is_finished(),
        "the request waits for 30 s without a host"
    );
    assert!(!mps.gpu_requested(&gpu));
    // Let the waiting request end: a fake host answers for the re-requested daemon.
    std::fs::create_dir_all(mps.gpu_pipe_dir(&gpu)).unwrap();
    std::fs::write(mps.gpu_pipe_dir(&gpu).join("answering"), "").unwrap();
    waiting.join().unwrap().unwrap();
}

/// A daemon this process has just asked for is starting (the watch must not call it down)
/// until it answers, or until its start deadline has passed without an answer.
#[test]
fn a_daemon_asked_for_is_starting_until_it_answers_or_its_deadline_passes() {
    let dir = tempfile::tempdir().unwrap();
    fake_control(&dir.path().join("driver"));
    let m = mps(dir.path());
    let gpu = GpuUuid("GPU-a".into());
    assert!(!m.starting_gpu(&gpu), "never asked for");
    m.request_gpu(&gpu).unwrap();
    assert!(m.starting_gpu(&gpu));
    assert!(!m.alive_gpu(&gpu), "no host runs it yet");
    let _host = FakeHost::start(&dir.path().join("driver"), &dir.path().join("mps"));
    eventually("the daemon answers", || m.alive_gpu(&gpu));
    assert!(!m.starting_gpu(&gpu), "it answered");

    let late = mps(dir.path()).with_start_deadline(Duration::ZERO);
    let other = GpuUuid("GPU-b".into());
    late.request_gpu(&other).unwrap();
    assert!(!late.starting_gpu(&other), "past its start deadline");
}

/// A GPU's share daemon is asked for in multi-user mode (`-M`: one server for clients of every
/// UID) on Volta and later GPUs, and in single-user mode on older ones and on GPUs the
/// inventory has not shown it.
#[test]
fn share_daemons_are_multi_user_from_volta_on() {
    use crate::inventory::DeviceBackend;
    let dir = tempfile::tempdir().unwrap();
    fake_control(&dir.path().join("driver"));
    let m = mps(dir.path());
    let mut inv = crate::inventory::sim::SimBackend::from_profile("dgx-h100", "n")
        .unwrap()
        .snapshot()
        .unwrap();
    inv.gpus[1].cuda_compute_capability.major = 6; // a Pascal GPU
    m.know_gpus(&inv);
    let unknown = GpuUuid("GPU-not-in-the-inventory".into());
    let layout = Layout::new(dir.path().join("mps"));
    for (gpu, multi_user) in [
        (&inv.gpus[0].uuid, true),
        (&inv.gpus[1].uuid, false),
        (&unknown, false),
    ] {
        m.request_gpu(gpu).unwrap();
        let spec = layout.read_spec(&DaemonId::gpu(gpu)).unwrap().unwrap();
        assert_eq!(spec.multi_user, multi_user, "{gpu}");
    }
}

/// One rule for `-M` and the refusal of a share of another user: a Volta or later GPU whose
/// host found `-M` (or could not tell); never a pre-Volta GPU, nor where the host found the
/// driver's control daemon without it.
#[test]
fn multi_user_needs_the_gpu_and_the_hosts_control_daemon() {
    let dir = tempfile::tempdir().unwrap();
    let mps = mps(dir.path());
    let inv = crate::inventory::topology::load_profile("dgx-h100", "n").unwrap();
    let mut volta = inv.gpus[0].clone();
    let mut pascal = volta.clone();
    pascal.cuda_compute_capability.major = 6;
    volta.cuda_compute_capability.major = 7;
    assert!(
        mps.multi_user(&volta) && !mps.multi_user(&pascal),
        "nothing recorded"
    );
    let caps = dir.path().join("mps/host.json");
    std::fs::create_dir_all(caps.parent().unwrap()).unwrap();
    std::fs::write(&caps, r#"{"multiUser":true}"#).unwrap();
    assert!(mps.multi_user(&volta) && !mps.multi_user(&pascal));
    std::fs::write(&caps, r#"{"multiUser":false}"#).unwrap();
    assert!(!mps.multi_user(&volta) && !mps.multi_user(&pascal));
    // As learnt at a share's prepare: the host's record read once for the node's GPUs.
    let hopper = &inv.gpus[1];
    mps.know_gpus(&inv);
    assert!(!mps.multi_user(hopper), "the host found no -M");
    std::fs::write(&caps, r#"{"multiUser":true}"#).unwrap();
    assert!(!mps.multi_user(hopper), "until the next prepare learns it");
    mps.know_gpus(&inv);
    assert!(mps.multi_user(hopper));
}

/// Test-only shorthands: a shorter start deadline, and the shares daemon of a whole GPU.
impl Mps {
    /// How long a request waits for its daemon to answer (tests shorten it).
    pub(crate) fn with_start_deadline(mut self, deadline: Duration) -> Self {
        self.start_deadline = deadline;
        self
    }

    /// [`Mps::shares_pipe_dir`] of a GPU.
    pub(crate) fn gpu_pipe_dir(&self, gpu: &GpuUuid) -> PathBuf {
        self.shares_pipe_dir(&DeviceUuid::Gpu(gpu.clone()))
    }

    /// [`Mps::shares_shm_dir`] of a GPU.
    pub(crate) fn gpu_shm_dir(&self, gpu: &GpuUuid) -> PathBuf {
        self.shares_shm_dir(&DeviceUuid::Gpu(gpu.clone()))
    }

    /// [`Mps::ensure_shares`] of a GPU.
    pub(crate) fn ensure_gpu(&self, gpu: &GpuUuid) -> Result<PathBuf> {
        self.ensure_shares(&DeviceUuid::Gpu(gpu.clone()))
    }

    /// [`Mps::request_shares`] of a GPU.
    pub(crate) fn request_gpu(&self, gpu: &GpuUuid) -> Result<()> {
        self.request_shares(&DeviceUuid::Gpu(gpu.clone()))
    }

    /// [`Mps::shares_requested`] of a GPU.
    pub(crate) fn gpu_requested(&self, gpu: &GpuUuid) -> bool {
        self.shares_requested(&DeviceUuid::Gpu(gpu.clone()))
    }

    /// [`Mps::alive_shares`] of a GPU.
    pub(crate) fn alive_gpu(&self, gpu: &GpuUuid) -> bool {
        self.alive_shares(&DeviceUuid::Gpu(gpu.clone()))
    }

    /// [`Mps::starting_shares`] of a GPU.
    pub(crate) fn starting_gpu(&self, gpu: &GpuUuid) -> bool {
        self.starting_shares(&DeviceUuid::Gpu(gpu.clone()))
    }

    /// [`Mps::stop_shares`] of a GPU.
    pub(crate) fn stop_gpu(
        &self,
        gpu: &GpuUuid,
        still_shared: impl FnOnce() -> bool,
    ) -> Result<()> {
        self.stop_shares(&DeviceUuid::Gpu(gpu.clone()), still_shared)
    }
}
