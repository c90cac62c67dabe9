//! MPS control daemons: one per GPU shared with the MPS strategy, started when the first claim
//! using it is prepared and stopped (`echo quit | nvidia-cuda-mps-control`) when the last one is
//! unprepared.
//!
//! Each daemon lives in `<plugin dir>/mps/<gpu-uuid>/{pipe,log}` (its `CUDA_MPS_PIPE_DIRECTORY`
//! and `CUDA_MPS_LOG_DIRECTORY`); containers get the pipe directory through CDI. The users of each
//! daemon are counted in memory and rebuilt from the checkpoint at start-up ([`Mps::adopt`]).
//! All methods block (they run processes): call them off the async runtime.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;

use crate::inventory::GpuUuid;
use crate::ledger::ClaimUid;

pub const CONTROL: &str = "nvidia-cuda-mps-control";

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(
        "MPS sharing was requested but {CONTROL} is not under the driver root {driver_root} \
         (looked in usr/bin, usr/local/bin, bin); install the driver's MPS tools or use TimeSlicing"
    )]
    NoControl { driver_root: PathBuf },
    #[error("cannot prepare the MPS directory {path}: {source}")]
    Dir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{CONTROL} {action} for GPU {gpu} failed: {reason}")]
    Control {
        action: &'static str,
        gpu: GpuUuid,
        reason: String,
    },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Settings a daemon starts with.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Limits {
    pub active_thread_percentage: Option<u32>,
    pub pinned_memory_limit: Option<u64>,
}

pub struct Mps {
    root: PathBuf,
    driver_root: PathBuf,
    users: Mutex<BTreeMap<GpuUuid, BTreeSet<ClaimUid>>>,
}

impl Mps {
    pub fn new(root: PathBuf, driver_root: PathBuf) -> Self {
        Self {
            root,
            driver_root,
            users: Mutex::new(BTreeMap::new()),
        }
    }

    pub fn pipe_dir(&self, gpu: &GpuUuid) -> PathBuf {
        self.root.join(gpu.as_str()).join("pipe")
    }

    fn log_dir(&self, gpu: &GpuUuid) -> PathBuf {
        self.root.join(gpu.as_str()).join("log")
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

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<GpuUuid, BTreeSet<ClaimUid>>> {
        // Each change is one insert or remove; a panic cannot leave a half-done change.
        self.users.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether a daemon for `gpu` is in use by any claim.
    pub fn users(&self, gpu: &GpuUuid) -> usize {
        self.lock().get(gpu).map_or(0, BTreeSet::len)
    }

    /// Registers `claim` as a user of `gpu`'s daemon, starting it if it is the first; returns the
    /// pipe directory.
    pub fn acquire(&self, gpu: &GpuUuid, claim: &ClaimUid, limits: Limits) -> Result<PathBuf> {
        let mut users = self.lock();
        let set = users.entry(gpu.clone()).or_default();
        if set.is_empty()
            && let Err(e) = self.start(gpu, limits)
        {
            users.remove(gpu);
            return Err(e);
        }
        set.insert(claim.clone());
        Ok(self.pipe_dir(gpu))
    }

    /// Records a user found in the checkpoint at start-up; starts the daemon only if it is not
    /// running (its control pipe is missing, e.g. after the daemon died with the old process).
    pub fn adopt(&self, gpu: &GpuUuid, claim: &ClaimUid, limits: Limits) -> Result<PathBuf> {
        let mut users = self.lock();
        let set = users.entry(gpu.clone()).or_default();
        if set.is_empty() && !self.pipe_dir(gpu).join("control").exists() {
            self.start(gpu, limits)?;
        }
        set.insert(claim.clone());
        Ok(self.pipe_dir(gpu))
    }

    /// Drops `claim` as a user of `gpu`'s daemon and stops the daemon when it was the last.
    /// Releasing a claim that is not a user does nothing.
    pub fn release(&self, gpu: &GpuUuid, claim: &ClaimUid) -> Result<()> {
        let mut users = self.lock();
        let Some(set) = users.get_mut(gpu) else {
            return Ok(());
        };
        if !set.remove(claim) || !set.is_empty() {
            return Ok(());
        }
        users.remove(gpu);
        self.send(gpu, "stop", "quit\n")
    }

    fn start(&self, gpu: &GpuUuid, limits: Limits) -> Result<()> {
        let control = self.control()?;
        for dir in [self.pipe_dir(gpu), self.log_dir(gpu)] {
            std::fs::create_dir_all(&dir).map_err(|source| Error::Dir { path: dir, source })?;
        }
        let out = self
            .command(&control, gpu)
            .arg("-d")
            .stdin(Stdio::null())
            .output()
            .map_err(|e| Error::Control {
                action: "start",
                gpu: gpu.clone(),
                reason: e.to_string(),
            })?;
        if !out.status.success() {
            return Err(Error::Control {
                action: "start",
                gpu: gpu.clone(),
                reason: format!(
                    "{}: {}",
                    out.status,
                    String::from_utf8_lossy(&out.stderr).trim()
                ),
            });
        }
        let mut script = String::new();
        if let Some(p) = limits.active_thread_percentage {
            script.push_str(&format!("set_default_active_thread_percentage {p}\n"));
        }
        if let Some(bytes) = limits.pinned_memory_limit {
            script.push_str(&format!(
                "set_default_device_pinned_mem_limit 0 {}M\n",
                bytes.div_ceil(1 << 20)
            ));
        }
        if !script.is_empty() {
            self.send(gpu, "configure", &script)?;
        }
        tracing::info!(gpu = %gpu, pipe = %self.pipe_dir(gpu).display(), "MPS control daemon started");
        Ok(())
    }

    fn command(&self, control: &Path, gpu: &GpuUuid) -> Command {
        let mut c = Command::new(control);
        c.env("CUDA_MPS_PIPE_DIRECTORY", self.pipe_dir(gpu))
            .env("CUDA_MPS_LOG_DIRECTORY", self.log_dir(gpu))
            .env("CUDA_VISIBLE_DEVICES", gpu.as_str())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        c
    }

    fn send(&self, gpu: &GpuUuid, action: &'static str, input: &str) -> Result<()> {
        let fail = |reason: String| Error::Control {
            action,
            gpu: gpu.clone(),
            reason,
        };
        let control = self.control()?;
        let mut child = self
            .command(&control, gpu)
            .stdin(Stdio::piped())
            .spawn()
            .map_err(|e| fail(e.to_string()))?;
        if let Some(mut stdin) = child.stdin.take() {
            stdin
                .write_all(input.as_bytes())
                .map_err(|e| fail(e.to_string()))?;
        }
        let out = child.wait_with_output().map_err(|e| fail(e.to_string()))?;
        if !out.status.success() {
            return Err(fail(format!(
                "{}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        if action == "stop" {
            tracing::info!(gpu = %gpu, "MPS control daemon stopped");
        }
        Ok(())
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// A fake `nvidia-cuda-mps-control` under `driver_root` that appends its arguments, stdin and
    /// pipe directory to `<driver_root>/mps.log`.
    pub(crate) fn fake_control(driver_root: &Path) {
        let bin = driver_root.join("usr/bin");
        std::fs::create_dir_all(&bin).unwrap();
        let log = driver_root.join("mps.log");
        let script = format!(
            "#!/bin/sh\nif [ \"$1\" = -d ]; then echo \"start $CUDA_VISIBLE_DEVICES $CUDA_MPS_PIPE_DIRECTORY\" >> {log}; \
             else while read l; do echo \"cmd $CUDA_VISIBLE_DEVICES $l\" >> {log}; done; fi\n",
            log = log.display()
        );
        let p = bin.join(CONTROL);
        std::fs::write(&p, script).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    }

    #[test]
    fn one_daemon_per_gpu_stopped_with_the_last_user() {
        let dir = tempfile::tempdir().unwrap();
        let driver_root = dir.path().join("driver");
        fake_control(&driver_root);
        let mps = Mps::new(dir.path().join("mps"), driver_root.clone());
        let gpu = GpuUuid("GPU-a".into());
        let limits = Limits {
            active_thread_percentage: Some(40),
            pinned_memory_limit: None,
        };
        let pipe = mps.acquire(&gpu, &ClaimUid("c1".into()), limits).unwrap();
        assert!(pipe.is_dir());
        mps.acquire(&gpu, &ClaimUid("c2".into()), limits).unwrap();
        mps.release(&gpu, &ClaimUid("c1".into())).unwrap();
        assert_eq!(mps.users(&gpu), 1);
        mps.release(&gpu, &ClaimUid("c2".into())).unwrap();
        mps.release(&gpu, &ClaimUid("c2".into())).unwrap();
        let log = std::fs::read_to_string(driver_root.join("mps.log")).unwrap();
        let lines: Vec<&str> = log.lines().collect();
        assert_eq!(
            lines,
            vec![
                format!("start GPU-a {}", pipe.display()).as_str(),
                "cmd GPU-a set_default_active_thread_percentage 40",
                "cmd GPU-a quit",
            ]
        );
    }

    #[test]
    fn missing_control_binary_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let mps = Mps::new(dir.path().join("mps"), dir.path().to_path_buf());
        let e = mps
            .acquire(
                &GpuUuid("GPU-a".into()),
                &ClaimUid("c".into()),
                Limits::default(),
            )
            .unwrap_err();
        assert!(e.to_string().contains("nvidia-cuda-mps-control"), "{e}");
        assert_eq!(mps.users(&GpuUuid("GPU-a".into())), 0);
    }
}
