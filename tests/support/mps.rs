//! MPS for the tests that run the `nvdra` binary with shares of a GPU: the stand-in
//! `nvidia-cuda-mps-control` (`nvdra mps-standin`, real processes on real sockets) under a
//! driver root, `nvdra mps-host` running its daemons, and a stand-in CUDA client.
//!
//! The stand-in daemon appends `start <CUDA_VISIBLE_DEVICES> <pipe dir>` and `quit <pipe dir>`
//! to `<driver root>/mps.log`, which counts the daemons' starts and clean quits across restarts
//! of nvdra and of the host, writes `nvdra-standin-control.<pid>` into the `/dev/shm` it got,
//! and appends its pid to `<dir>/log/standin-daemons`, which names each daemon process the host
//! started for a directory.
// Each test binary uses what it needs.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use nvdra::inventory::GpuUuid;
use nvdra::mps::dir::{DaemonId, Layout};

/// Installs the stand-in under `<driver_root>/usr/bin`, where nvdra and the host look for it.
pub fn install_standin(driver_root: &Path) {
    let bin = driver_root.join("usr/bin");
    std::fs::create_dir_all(&bin).unwrap();
    let script = format!(
        "#!/bin/sh\nSTANDIN_LOG='{log}' exec '{nvdra}' mps-standin \"$@\"\n",
        log = log_path(driver_root).display(),
        nvdra = env!("CARGO_BIN_EXE_nvdra"),
    );
    let p = control(driver_root);
    std::fs::write(&p, script).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
}

pub fn control(driver_root: &Path) -> PathBuf {
    driver_root.join("usr/bin/nvidia-cuda-mps-control")
}

pub fn log_path(driver_root: &Path) -> PathBuf {
    driver_root.join("mps.log")
}

/// The stand-in's log lines, oldest first (none before its first start).
pub fn log(driver_root: &Path) -> Vec<String> {
    std::fs::read_to_string(log_path(driver_root))
        .unwrap_or_default()
        .lines()
        .map(String::from)
        .collect()
}

/// How many lines of the log start with `word` (`start` or `quit`).
pub fn count(driver_root: &Path, word: &str) -> usize {
    log(driver_root)
        .iter()
        .filter(|l| l.split(' ').next() == Some(word))
        .count()
}

/// The daemon directory of the shares of GPU `uuid` under `mps_root`.
pub fn gpu_dir(mps_root: &Path, uuid: &str) -> PathBuf {
    Layout::new(mps_root).dir(&DaemonId::gpu(&GpuUuid(uuid.into())))
}

/// The pipe directory of the daemon of the shares of GPU `uuid` under `mps_root`.
pub fn gpu_pipe_dir(mps_root: &Path, uuid: &str) -> PathBuf {
    gpu_dir(mps_root, uuid).join("pipe")
}

/// Sends `command` to the daemon of `pipe` through the stand-in's client; its answer, or `None`
/// when no daemon answers.
pub fn ask(driver_root: &Path, pipe: &Path, command: &str) -> Option<String> {
    use std::io::Write;
    let mut c = Command::new(control(driver_root))
        .env("CUDA_MPS_PIPE_DIRECTORY", pipe)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let _ = writeln!(c.stdin.take().unwrap(), "{command}");
    let out = c.wait_with_output().unwrap();
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Whether a process with this pid runs (a zombie, killed and not yet reaped, does not).
pub fn runs(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit(')')
            .next()
            .is_some_and(|rest| !rest.trim_start().starts_with('Z'))
    })
}

/// The pids of the control daemons started for `dir`, in start order (each appended its pid to
/// `<dir>/log/standin-daemons`). Each one still running has `<dir>/shm` as its `/dev/shm`: it
/// wrote its marker there.
pub fn daemon_pids(dir: &Path) -> Vec<u32> {
    let pids: Vec<u32> = std::fs::read_to_string(dir.join("log/standin-daemons"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect();
    for pid in &pids {
        let marker = dir.join(format!("shm/nvdra-standin-control.{pid}"));
        assert!(
            !runs(*pid) || marker.exists(),
            "daemon {pid} runs without {} (not its /dev/shm?)",
            marker.display()
        );
    }
    pids
}

/// Waits up to 20 s until `f` holds, polling; panics naming `what` otherwise.
pub fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < Duration::from_secs(20), "never: {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `nvdra mps-host`, SIGKILLed when dropped (its daemons die with it).
pub struct Host {
    pub child: Child,
    pub root: PathBuf,
}

impl Host {
    /// The host over `root`, the driver root `driver_root` (with the stand-in) and the boot id
    /// in `boot_file`, with `env` added; returns once it recorded the boot (it then serves).
    pub fn start(root: &Path, driver_root: &Path, boot_file: &Path, env: &[(&str, &str)]) -> Host {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_nvdra"));
        Self::args(&mut cmd, root, driver_root, boot_file, env);
        Self::started(cmd, root, boot_file)
    }

    /// `nvdra mps-host`'s arguments and environment, added to `cmd` (which may be a wrapper
    /// that runs it, such as `setpriv`).
    pub fn args(
        cmd: &mut Command,
        root: &Path,
        driver_root: &Path,
        boot_file: &Path,
        env: &[(&str, &str)],
    ) {
        cmd.arg("mps-host")
            .arg("--mps-root")
            .arg(root)
            .arg("--driver-root")
            .arg(driver_root)
            .env("NVDRA_BOOT_ID_FILE", boot_file)
            .env("NVDRA_LOG", "warn")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit());
    }

    /// Runs `cmd` (a host) and waits until it recorded the boot.
    pub fn started(mut cmd: Command, root: &Path, boot_file: &Path) -> Host {
        let mut child = cmd.spawn().unwrap();
        let boot = std::fs::read_to_string(boot_file).unwrap();
        eventually("the host records the boot", || {
            assert!(child.try_wait().unwrap().is_none(), "mps-host exited");
            std::fs::read_to_string(root.join("boot_id")).is_ok_and(|b| b.trim() == boot.trim())
        });
        Host {
            child,
            root: root.to_path_buf(),
        }
    }
}

/// Asks for a daemon as the plugin does: its directory, with `spec`, renamed into place whole.
pub fn request(mps_root: &Path, id: &DaemonId, spec: &nvdra::mps::dir::DaemonSpec) {
    let staging = mps_root.join(format!(".new-{id}"));
    std::fs::create_dir_all(&staging).unwrap();
    Layout::make_subdirs(&staging).unwrap();
    std::fs::write(
        staging.join("daemon.json"),
        serde_json::to_vec(spec).unwrap(),
    )
    .unwrap();
    std::fs::rename(&staging, Layout::new(mps_root).dir(id)).unwrap();
}

impl Drop for Host {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        unmount_under(&self.root);
    }
}

/// Detaches every mount under `root` (the daemons' `/dev/shm` tmpfs a SIGKILLed host left), so
/// a test leaves none on the machine.
pub fn unmount_under(root: &Path) {
    let Ok(mounts) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return;
    };
    for line in mounts.lines() {
        // Field 5 is the mount point (spaces and the like octal-escaped: none in a temp dir).
        if let Some(point) = line.split(' ').nth(4)
            && Path::new(point).starts_with(root)
        {
            let _ = Command::new("umount").args(["-l", point]).status();
        }
    }
}

/// The stand-in for a CUDA process using a share: connected through the daemon of `pipe` to
/// its server, and exits (non-zero) when they go.
pub struct CudaClient {
    pub child: Child,
    /// What it printed once connected.
    pub connected: String,
    _out: BufReader<ChildStdout>,
}

/// How a stand-in CUDA process started: on MPS, outside it (a plain context, unlimited: what no
/// share may ever get), or not at all.
pub enum Started {
    Mps(CudaClient),
    Plain(CudaClient),
    Failed(std::process::ExitStatus),
}

impl CudaClient {
    pub fn start(driver_root: &Path, pipe: &Path, env: &[(&str, &str)]) -> CudaClient {
        match Self::try_start(driver_root, pipe, env) {
            Started::Mps(c) => c,
            Started::Plain(c) => panic!("the client runs outside MPS: {}", c.connected),
            Started::Failed(status) => panic!("the client did not connect: {status}"),
        }
    }

    /// A CUDA process as CUDA starts one: through the daemon of `pipe` when it answers, else on
    /// a plain context when the GPU lets it have one.
    pub fn try_start(driver_root: &Path, pipe: &Path, env: &[(&str, &str)]) -> Started {
        let mut child = Command::new(control(driver_root))
            .arg("cuda-client")
            .env("CUDA_MPS_PIPE_DIRECTORY", pipe)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut connected = String::new();
        out.read_line(&mut connected).unwrap();
        let client = |child, connected: &str| CudaClient {
            child,
            connected: connected.trim().to_string(),
            _out: out,
        };
        if connected.starts_with("connected ") {
            Started::Mps(client(child, &connected))
        } else if connected.starts_with("plain-context ") {
            Started::Plain(client(child, &connected))
        } else {
            assert!(connected.is_empty(), "the client printed {connected:?}");
            Started::Failed(child.wait().unwrap())
        }
    }

    /// Still connected: the process runs (it exits as soon as its server goes).
    pub fn connected(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }
}

impl Drop for CudaClient {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A share of `device` (`gpu-<minor>`, `--shared-capacity`) as the scheduler allocates one: a
/// `shareID` and the consumed capacity (`multiprocessors` "0" unless the claim asked for SMs).
pub fn share(
    request: &str,
    driver: &str,
    pool: &str,
    device: &str,
    share_id: &str,
    memory: &str,
    multiprocessors: &str,
) -> k8s_openapi::api::resource::v1::DeviceRequestAllocationResult {
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    let mut r = nvdra::api::allocated_device(request, driver, pool, device);
    r.share_id = Some(share_id.into());
    r.consumed_capacity = Some(
        [
            ("memory".to_string(), Quantity(memory.into())),
            (
                "multiprocessors".to_string(),
                Quantity(multiprocessors.into()),
            ),
        ]
        .into(),
    );
    r
}

/// Claim `default/claim-<uid>`, allocated, with one share of `device` (request `nb`, `memory`,
/// no SMs asked) as [`share`] makes it.
pub fn share_claim(
    driver: &str,
    pool: &str,
    uid: &str,
    device: &str,
    share_id: &str,
    memory: &str,
) -> k8s_openapi::api::resource::v1::ResourceClaim {
    let result = share("nb", driver, pool, device, share_id, memory, "0");
    nvdra::api::allocated_claim(
        "default",
        &format!("claim-{uid}"),
        uid,
        vec![result],
        vec![],
    )
}

/// Writes [`share_claim`] into the directory API `api`.
pub fn write_share_claim(
    api: &Path,
    driver: &str,
    pool: &str,
    uid: &str,
    device: &str,
    share_id: &str,
    memory: &str,
) {
    let c = share_claim(driver, pool, uid, device, share_id, memory);
    nvdra::api::dir::write_claim(api, &c).unwrap();
}
