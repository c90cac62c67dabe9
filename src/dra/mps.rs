//! MPS control daemons for claims shared with the MPS strategy.
//!
//! One daemon per claim, serving all of the claim's MPS devices: a container has one
//! `CUDA_MPS_PIPE_DIRECTORY`, so every MPS device it sees must sit behind one daemon. Since a
//! device belongs to one claim at a time, this is also one daemon per shared GPU. The daemon is
//! started (`nvidia-cuda-mps-control -d`, found under the driver root) when the claim is prepared
//! and stopped (`echo quit | nvidia-cuda-mps-control`) when it is unprepared.
//!
//! Each daemon lives in `<plugin dir>/mps/<claim-uid>/{pipe,log}` (its `CUDA_MPS_PIPE_DIRECTORY`
//! and `CUDA_MPS_LOG_DIRECTORY`); the CDI spec mounts the pipe directory into containers and sets
//! the per-client limits. The directory's existence is the record that a daemon was started, so
//! stop is idempotent and survives restarts. All methods block (they run processes): call them
//! off the async runtime.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::ids::ClaimUid;
use crate::inventory::DeviceUuid;

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
    #[error("{CONTROL} {action} for claim {claim} failed: {reason}")]
    Control {
        action: &'static str,
        claim: ClaimUid,
        reason: String,
    },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

pub struct Mps {
    root: PathBuf,
    driver_root: PathBuf,
}

impl Mps {
    pub fn new(root: PathBuf, driver_root: PathBuf) -> Self {
        Self { root, driver_root }
    }

    fn claim_dir(&self, claim: &ClaimUid) -> PathBuf {
        self.root.join(claim.as_str())
    }

    /// The claim's `CUDA_MPS_PIPE_DIRECTORY` on the host.
    pub fn pipe_dir(&self, claim: &ClaimUid) -> PathBuf {
        self.claim_dir(claim).join("pipe")
    }

    fn log_dir(&self, claim: &ClaimUid) -> PathBuf {
        self.claim_dir(claim).join("log")
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
        let control = self.control()?;
        for dir in [self.pipe_dir(claim), self.log_dir(claim)] {
            std::fs::create_dir_all(&dir).map_err(|source| Error::Dir { path: dir, source })?;
        }
        let visible: Vec<&str> = devices.iter().map(DeviceUuid::as_str).collect();
        let out = self
            .command(&control, claim)
            .env("CUDA_VISIBLE_DEVICES", visible.join(","))
            .arg("-d")
            .stdin(Stdio::null())
            .output()
            .map_err(|e| self.fail("start", claim, e.to_string()))?;
        if !out.status.success() {
            return Err(self.fail(
                "start",
                claim,
                format!(
                    "{}: {}",
                    out.status,
                    String::from_utf8_lossy(&out.stderr).trim()
                ),
            ));
        }
        tracing::info!(claim.uid = %claim, devices = %visible.join(","), "MPS control daemon started");
        Ok(self.pipe_dir(claim))
    }

    /// At start-up, for a prepared claim: starts the daemon only when its control pipe is
    /// missing (the daemon died, e.g. with the node's previous boot).
    pub fn ensure(&self, claim: &ClaimUid, devices: &[DeviceUuid]) -> Result<PathBuf> {
        if self.pipe_dir(claim).join("control").exists() {
            return Ok(self.pipe_dir(claim));
        }
        self.start(claim, devices)
    }

    /// Stops the claim's daemon and removes its directory. A claim without one is a no-op; a
    /// daemon that is already gone is logged, not an error, so unprepare can always finish.
    pub fn stop(&self, claim: &ClaimUid) -> Result<()> {
        let dir = self.claim_dir(claim);
        if !dir.exists() {
            return Ok(());
        }
        match self.quit(claim) {
            Ok(()) => tracing::info!(claim.uid = %claim, "MPS control daemon stopped"),
            Err(e @ Error::NoControl { .. }) => return Err(e),
            Err(e) => {
                tracing::warn!(claim.uid = %claim, error = %kubelet_plugin::report::chain(&e), "MPS control daemon did not stop cleanly; assuming it is gone")
            }
        }
        std::fs::remove_dir_all(&dir).map_err(|source| Error::Dir { path: dir, source })
    }

    fn quit(&self, claim: &ClaimUid) -> Result<()> {
        let control = self.control()?;
        let mut child = self
            .command(&control, claim)
            .stdin(Stdio::piped())
            .spawn()
            .map_err(|e| self.fail("stop", claim, e.to_string()))?;
        if let Some(mut stdin) = child.stdin.take() {
            stdin
                .write_all(b"quit\n")
                .map_err(|e| self.fail("stop", claim, e.to_string()))?;
        }
        let out = child
            .wait_with_output()
            .map_err(|e| self.fail("stop", claim, e.to_string()))?;
        if !out.status.success() {
            return Err(self.fail(
                "stop",
                claim,
                format!(
                    "{}: {}",
                    out.status,
                    String::from_utf8_lossy(&out.stderr).trim()
                ),
            ));
        }
        Ok(())
    }

    fn fail(&self, action: &'static str, claim: &ClaimUid, reason: String) -> Error {
        Error::Control {
            action,
            claim: claim.clone(),
            reason,
        }
    }

    fn command(&self, control: &Path, claim: &ClaimUid) -> Command {
        let mut c = Command::new(control);
        c.env("CUDA_MPS_PIPE_DIRECTORY", self.pipe_dir(claim))
            .env("CUDA_MPS_LOG_DIRECTORY", self.log_dir(claim))
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        c
    }
}

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
             else while read l; do echo \"$l $CUDA_MPS_PIPE_DIRECTORY\" >> {log}; done; fi\n",
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
        let log = std::fs::read_to_string(driver_root.join("mps.log")).unwrap();
        let lines: Vec<&str> = log.lines().collect();
        assert_eq!(
            lines,
            vec![
                format!("start GPU-a,GPU-b {}", pipe.display()),
                format!("quit {}", pipe.display())
            ]
        );
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
}
