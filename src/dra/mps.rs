//! MPS control daemons: one per claim shared with the MPS strategy, and one per GPU that
//! consumable-capacity shares use (`--shared-capacity`).
//!
//! **Per claim**: one daemon serves all of the claim's MPS devices: a container has one
//! `CUDA_MPS_PIPE_DIRECTORY`, so every MPS device it sees must sit behind one daemon. Since a
//! device belongs to one claim at a time, this is also one daemon per shared GPU. It is started
//! when the claim is prepared and stopped when it is unprepared; it lives in
//! `<plugin dir>/mps/<claim-uid>/{pipe,log}`.
//!
//! **Per GPU** (shares of `gpu-<minor>-shared`): many claims share the GPU, so the daemon belongs
//! to the GPU: started with the first share ([`Mps::ensure_gpu`]), stopped after the last
//! ([`Mps::stop_gpu`], which the caller invokes once the ledger holds no other share of it). It
//! lives in `<plugin dir>/mps/shared-<gpu-uuid>/{pipe,log}`. Each share's limits are its client
//! environment (`CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`, `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`), set by
//! its CDI spec. A lock per GPU makes "start unless running" and "stop" atomic against each
//! other, so a share prepared while the last other share goes never finds its daemon stopped.
//!
//! A daemon is started with `nvidia-cuda-mps-control -d` (found under the driver root) and
//! stopped with `echo quit | nvidia-cuda-mps-control`. The directory's existence is the record
//! that a daemon was started, so stop is idempotent and survives restarts; its `control` pipe
//! tells whether the daemon still runs. All methods block (they run processes): call them off
//! the async runtime.

use std::collections::HashMap;
use std::fmt;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};

use crate::ids::ClaimUid;
use crate::inventory::{DeviceUuid, GpuUuid};
use kubelet_plugin::lock::lock;

pub const CONTROL: &str = "nvidia-cuda-mps-control";

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(
        "MPS sharing was requested but {CONTROL} is not under the driver root {driver_root} \
         (looked in usr/bin, usr/local/bin, bin); install the driver's MPS tools or use TimeSlicing"
    )]
    NoControl { driver_root: PathBuf },
    #[error("cannot prepare the MPS directory {path}")]
    Dir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{CONTROL} {action} for {owner} failed: {reason}")]
    Control {
        action: &'static str,
        owner: Owner,
        reason: String,
    },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Whose daemon: a claim's, or a GPU's (its consumable-capacity shares).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Owner {
    Claim(ClaimUid),
    Gpu(GpuUuid),
}

impl fmt::Display for Owner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Owner::Claim(c) => write!(f, "claim {c}"),
            Owner::Gpu(g) => write!(f, "the shares of GPU {g}"),
        }
    }
}

pub struct Mps {
    root: PathBuf,
    driver_root: PathBuf,
    /// One lock per GPU with shares: start and stop of its daemon exclude each other.
    gpu_locks: Mutex<HashMap<GpuUuid, Arc<Mutex<()>>>>,
}

impl Mps {
    pub fn new(root: PathBuf, driver_root: PathBuf) -> Self {
        Self {
            root,
            driver_root,
            gpu_locks: Mutex::new(HashMap::new()),
        }
    }

    fn dir(&self, owner: &Owner) -> PathBuf {
        match owner {
            Owner::Claim(c) => self.root.join(c.as_str()),
            Owner::Gpu(g) => self.root.join(format!("shared-{}", g.as_str())),
        }
    }

    fn owner_pipe_dir(&self, owner: &Owner) -> PathBuf {
        self.dir(owner).join("pipe")
    }

    fn log_dir(&self, owner: &Owner) -> PathBuf {
        self.dir(owner).join("log")
    }

    /// The claim's `CUDA_MPS_PIPE_DIRECTORY` on the host.
    pub fn pipe_dir(&self, claim: &ClaimUid) -> PathBuf {
        self.owner_pipe_dir(&Owner::Claim(claim.clone()))
    }

    /// The `CUDA_MPS_PIPE_DIRECTORY` of a GPU's shares on the host.
    pub fn gpu_pipe_dir(&self, gpu: &GpuUuid) -> PathBuf {
        self.owner_pipe_dir(&Owner::Gpu(gpu.clone()))
    }

    fn control(&self) -> Result<PathBuf> {
        ["usr/bin", "usr/local/bin", "bin"]
            .iter()
            .map(|d| self.driver_root.join(d).join(CONTROL))
            .find(|p| p.is_file())
            .ok_or_else(|| Error::NoControl {
                driver_root: self.driver_root.clone(),
            })
    }

    /// Starts the claim's daemon for `devices` (GPU or MIG UUIDs); returns the pipe directory.
    pub fn start(&self, claim: &ClaimUid, devices: &[DeviceUuid]) -> Result<PathBuf> {
        self.start_for(&Owner::Claim(claim.clone()), devices)
    }

    fn start_for(&self, owner: &Owner, devices: &[DeviceUuid]) -> Result<PathBuf> {
        let control = self.control()?;
        for dir in [self.owner_pipe_dir(owner), self.log_dir(owner)] {
            std::fs::create_dir_all(&dir).map_err(|source| Error::Dir { path: dir, source })?;
        }
        // TEMPORARY (helper C): the clients' /dev/shm, until helper B's version makes it.
        self.make_shm_dir(owner)?;
        let visible: Vec<&str> = devices.iter().map(DeviceUuid::as_str).collect();
        let out = self
            .command(&control, owner)
            .env("CUDA_VISIBLE_DEVICES", visible.join(","))
            .arg("-d")
            .stdin(Stdio::null())
            .output()
            .map_err(|e| fail("start", owner, e.to_string()))?;
        if !out.status.success() {
            return Err(fail(
                "start",
                owner,
                format!(
                    "{}: {}",
                    out.status,
                    String::from_utf8_lossy(&out.stderr).trim()
                ),
            ));
        }
        tracing::info!(%owner, devices = %visible.join(","), "MPS control daemon started");
        Ok(self.owner_pipe_dir(owner))
    }

    /// At start-up, for a prepared claim: starts the daemon only when its control pipe is
    /// missing (the daemon died, e.g. with the node's previous boot).
    pub fn ensure(&self, claim: &ClaimUid, devices: &[DeviceUuid]) -> Result<PathBuf> {
        if self.pipe_dir(claim).join("control").exists() {
            return Ok(self.pipe_dir(claim));
        }
        self.start(claim, devices)
    }

    /// Starts the GPU's share daemon unless it runs; returns its pipe directory.
    pub fn ensure_gpu(&self, gpu: &GpuUuid) -> Result<PathBuf> {
        let l = self.gpu_lock(gpu);
        let _g = lock(&l);
        let owner = Owner::Gpu(gpu.clone());
        let pipe = self.owner_pipe_dir(&owner);
        if pipe.join("control").exists() {
            return Ok(pipe);
        }
        self.start_for(&owner, &[DeviceUuid::Gpu(gpu.clone())])
    }

    /// Whether the GPU's share daemon runs (its control pipe exists), asked under the GPU's lock:
    /// a stop that had begun has finished.
    pub fn gpu_running(&self, gpu: &GpuUuid) -> bool {
        let l = self.gpu_lock(gpu);
        let _g = lock(&l);
        self.gpu_pipe_dir(gpu).join("control").exists()
    }

    /// Stops the GPU's share daemon if `still_shared` (asked under the GPU's lock, so no share
    /// can start using the daemon in between) says no share of it is left.
    pub fn stop_gpu(&self, gpu: &GpuUuid, still_shared: impl FnOnce() -> bool) -> Result<()> {
        let l = self.gpu_lock(gpu);
        let _g = lock(&l);
        if still_shared() {
            return Ok(());
        }
        self.stop_for(&Owner::Gpu(gpu.clone()))
    }

    fn gpu_lock(&self, gpu: &GpuUuid) -> Arc<Mutex<()>> {
        lock(&self.gpu_locks)
            .entry(gpu.clone())
            .or_default()
            .clone()
    }

    /// Stops the claim's daemon and removes its directory. A claim without one is a no-op; a
    /// daemon that is already gone is logged, not an error, so unprepare can always finish.
    pub fn stop(&self, claim: &ClaimUid) -> Result<()> {
        self.stop_for(&Owner::Claim(claim.clone()))
    }

    fn stop_for(&self, owner: &Owner) -> Result<()> {
        let dir = self.dir(owner);
        if !dir.exists() {
            return Ok(());
        }
        match self.quit(owner) {
            Ok(()) => tracing::info!(%owner, "MPS control daemon stopped"),
            Err(e @ Error::NoControl { .. }) => return Err(e),
            Err(e) => {
                tracing::warn!(%owner, error = %kubelet_plugin::report::chain(&e), "MPS control daemon did not stop cleanly; assuming it is gone")
            }
        }
        std::fs::remove_dir_all(&dir).map_err(|source| Error::Dir { path: dir, source })
    }

    fn quit(&self, owner: &Owner) -> Result<()> {
        let control = self.control()?;
        let mut child = self
            .command(&control, owner)
            .stdin(Stdio::piped())
            .spawn()
            .map_err(|e| fail("stop", owner, e.to_string()))?;
        if let Some(mut stdin) = child.stdin.take() {
            stdin
                .write_all(b"quit\n")
                .map_err(|e| fail("stop", owner, e.to_string()))?;
        }
        let out = child
            .wait_with_output()
            .map_err(|e| fail("stop", owner, e.to_string()))?;
        if !out.status.success() {
            return Err(fail(
                "stop",
                owner,
                format!(
                    "{}: {}",
                    out.status,
                    String::from_utf8_lossy(&out.stderr).trim()
                ),
            ));
        }
        Ok(())
    }

    fn command(&self, control: &Path, owner: &Owner) -> Command {
        let mut c = Command::new(control);
        c.env("CUDA_MPS_PIPE_DIRECTORY", self.owner_pipe_dir(owner))
            .env("CUDA_MPS_LOG_DIRECTORY", self.log_dir(owner))
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        c
    }
}

fn fail(action: &'static str, owner: &Owner, reason: String) -> Error {
    Error::Control {
        action,
        owner: owner.clone(),
        reason,
    }
}

// TEMPORARY (helper C): replaced by helper B's version at merge. What the enforcement side
// needs of the MPS host's directory protocol: each daemon's `shm` directory (its `/dev/shm`,
// mounted on every client's) and whether a GPU's share daemon answers.
impl Mps {
    /// The host directory a GPU's share daemon has as `/dev/shm`.
    pub fn gpu_shm_dir(&self, gpu: &GpuUuid) -> PathBuf {
        self.dir(&Owner::Gpu(gpu.clone())).join("shm")
    }

    /// The host directory a claim's MPS daemon has as `/dev/shm`.
    pub fn shm_dir(&self, claim: &ClaimUid) -> PathBuf {
        self.dir(&Owner::Claim(claim.clone())).join("shm")
    }

    /// Creates the daemon's shm directory, writable by every client UID (sticky, as `/dev/shm`).
    fn make_shm_dir(&self, owner: &Owner) -> Result<()> {
        use std::os::unix::fs::PermissionsExt;
        let dir = self.dir(owner).join("shm");
        std::fs::create_dir_all(&dir)
            .and_then(|()| std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o1777)))
            .map_err(|source| Error::Dir { path: dir, source })
    }

    /// Whether the GPU's share daemon answers `get_server_list` within [`ALIVE_DEADLINE`]. Takes
    /// no lock a prepare waits on; blocking (it runs a process): call it off the runtime.
    pub fn alive_gpu(&self, gpu: &GpuUuid) -> bool {
        let Ok(control) = self.control() else {
            return false;
        };
        let owner = Owner::Gpu(gpu.clone());
        let Ok(mut child) = self
            .command(&control, &owner)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
        else {
            return false;
        };
        if let Some(mut stdin) = child.stdin.take()
            && stdin.write_all(b"get_server_list\n").is_err()
        {
            let _ = child.kill();
            let _ = child.wait();
            return false;
        }
        let deadline = std::time::Instant::now() + ALIVE_DEADLINE;
        loop {
            match child.try_wait() {
                Ok(Some(status)) => return status.success(),
                Ok(None) if std::time::Instant::now() < deadline => {
                    std::thread::sleep(std::time::Duration::from_millis(20))
                }
                _ => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return false;
                }
            }
        }
    }
}

/// How long a daemon may take to answer before it counts as down.
pub const ALIVE_DEADLINE: std::time::Duration = std::time::Duration::from_secs(2);
// END TEMPORARY (helper C)

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::inventory::GpuUuid;
    use std::os::unix::fs::PermissionsExt;

    /// A fake `nvidia-cuda-mps-control` under `driver_root` that appends what it was asked to
    /// `<driver_root>/mps.log`.
    pub(crate) fn fake_control(driver_root: &Path) {
        let bin = driver_root.join("usr/bin");
        std::fs::create_dir_all(&bin).unwrap();
        let log = driver_root.join("mps.log");
        let script = format!(
            "#!/bin/sh\nif [ \"$1\" = -d ]; then echo \"start $CUDA_VISIBLE_DEVICES $CUDA_MPS_PIPE_DIRECTORY\" >> {log}; \
             : > \"$CUDA_MPS_PIPE_DIRECTORY/control\"; \
             else while read l; do \
             if [ \"$l\" = get_server_list ]; then [ -e \"$CUDA_MPS_PIPE_DIRECTORY/control\" ] || exit 1; continue; fi; \
             echo \"$l $CUDA_MPS_PIPE_DIRECTORY\" >> {log}; rm -f \"$CUDA_MPS_PIPE_DIRECTORY/control\"; done; fi\n",
            log = log.display()
        );
        let p = bin.join(CONTROL);
        std::fs::write(&p, script).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    }

    #[test]
    fn daemon_started_for_the_claims_devices_and_stopped_once() {
        let dir = tempfile::tempdir().unwrap();
        let driver_root = dir.path().join("driver");
        fake_control(&driver_root);
        let mps = Mps::new(dir.path().join("mps"), driver_root.clone());
        let claim = ClaimUid::parse("c1").unwrap();
        let pipe = mps
            .start(
                &claim,
                &[
                    DeviceUuid::Gpu(GpuUuid("GPU-a".into())),
                    DeviceUuid::Gpu(GpuUuid("GPU-b".into())),
                ],
            )
            .unwrap();
        assert!(pipe.is_dir());
        mps.stop(&claim).unwrap();
        mps.stop(&claim).unwrap();
        assert!(!pipe.exists());
        assert_eq!(
            logged(&driver_root),
            vec![
                format!("start GPU-a,GPU-b {}", pipe.display()),
                format!("quit {}", pipe.display())
            ]
        );
    }

    /// What the fake control was asked, a line each.
    fn logged(driver_root: &Path) -> Vec<String> {
        std::fs::read_to_string(driver_root.join("mps.log"))
            .unwrap()
            .lines()
            .map(String::from)
            .collect()
    }

    #[test]
    fn missing_control_binary_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let mps = Mps::new(dir.path().join("mps"), dir.path().to_path_buf());
        let e = mps
            .start(
                &ClaimUid::parse("c").unwrap(),
                &[DeviceUuid::Gpu(GpuUuid("GPU-a".into()))],
            )
            .unwrap_err();
        assert!(e.to_string().contains("nvidia-cuda-mps-control"), "{e}");
    }

    #[test]
    fn a_gpus_share_daemon_starts_once_and_stops_when_no_share_is_left() {
        let dir = tempfile::tempdir().unwrap();
        let driver_root = dir.path().join("driver");
        fake_control(&driver_root);
        let mps = Mps::new(dir.path().join("mps"), driver_root.clone());
        let gpu = GpuUuid("GPU-a".into());
        let pipe = mps.ensure_gpu(&gpu).unwrap();
        assert_eq!(
            mps.ensure_gpu(&gpu).unwrap(),
            pipe,
            "a running daemon is reused"
        );
        assert_eq!(pipe, mps.gpu_pipe_dir(&gpu));
        mps.stop_gpu(&gpu, || true).unwrap();
        assert!(pipe.join("control").exists(), "kept while a share is left");
        mps.stop_gpu(&gpu, || false).unwrap();
        mps.stop_gpu(&gpu, || false).unwrap();
        assert!(!pipe.exists());
        assert_eq!(
            logged(&driver_root),
            vec![
                format!("start GPU-a {}", pipe.display()),
                format!("quit {}", pipe.display())
            ]
        );
    }
}
