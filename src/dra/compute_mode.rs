//! The compute mode of GPUs that hold shares, and its durable record.
//!
//! While a GPU holds MPS shares it is in `EXCLUSIVE_PROCESS` compute mode: the MPS server is its
//! one context, so a CUDA process that misses the daemon (no pipe directory, a daemon that died)
//! fails to create a context instead of running beside the shares without any limit. NVIDIA's
//! DRA driver sets the same mode before it starts a daemon, and `DEFAULT` after.
//!
//! The mode a GPU had before is recorded in `<plugin dir>/compute-mode.json` (GPU UUID → mode
//! before), written through [`crate::durable`] **before** the mode changes, so a crash at any
//! point leaves either no change or a change the record names:
//!
//! - [`ComputeModes::hold`] (a share is prepared): record the mode before, then set
//!   `EXCLUSIVE_PROCESS`. A GPU already recorded is not asked again (the fast path of a share
//!   whose GPU holds others).
//! - [`ComputeModes::release`] (a share is unprepared): only when no other share of the GPU is
//!   left (asked under this module's lock, against the ledger where a new share is reserved
//!   before it holds), set the mode back, then drop the entry. A crash in between leaves the
//!   entry, and start-up sets the mode back again.
//! - [`ComputeModes::repair`] (start-up): GPUs with shares in the checkpoint are set
//!   `EXCLUSIVE_PROCESS` again (a reboot or another agent may have reset them), recorded GPUs
//!   without shares get their mode back.
//! - [`ComputeModes::recheck`] (the daemon watch, every round): a recorded GPU found out of
//!   `EXCLUSIVE_PROCESS` while it holds shares is put back.
//!
//! All methods block (NVML, fsync): run them off the async runtime.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::inventory::{self, ComputeMode, GpuUuid, Reconfigure};
use crate::lock::lock;

/// The record's file name in the plugin directory.
pub const RECORD: &str = "compute-mode.json";

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot read the compute-mode record {path}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "the compute-mode record {path} is not valid JSON (GPU UUID to compute mode); fix it, or \
         delete it and reset each GPU without shares with nvidia-smi -i <uuid> -c DEFAULT"
    )]
    Parse {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("cannot record the compute mode of GPU {gpu} before changing it")]
    Write {
        gpu: GpuUuid,
        source: crate::durable::Error,
    },
    #[error(
        "cannot put GPU {gpu} in EXCLUSIVE_PROCESS compute mode for its MPS shares, so a process \
         that missed the MPS daemon could run on it without limits; the share is refused. Check \
         that nvdra may change compute modes (it needs root) and the GPU with nvidia-smi -q -i {gpu}"
    )]
    Hold {
        gpu: GpuUuid,
        source: Box<inventory::Error>,
    },
    #[error(
        "cannot set GPU {gpu} back to compute mode {before} after its last share; it stays \
         recorded and is retried at the next unprepare of one of its shares and at start-up \
         (or reset it by hand: nvidia-smi -i {gpu} -c {before})"
    )]
    Release {
        gpu: GpuUuid,
        before: ComputeMode,
        source: Box<inventory::Error>,
    },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The record and the lock that orders holds and releases. One per plugin.
#[derive(Debug)]
pub struct ComputeModes {
    path: PathBuf,
    /// The record as last read or written; `None` until first needed.
    record: Mutex<Option<BTreeMap<GpuUuid, ComputeMode>>>,
}

/// What [`ComputeModes::repair`] changed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Repaired {
    /// GPUs with shares set to `EXCLUSIVE_PROCESS` (again).
    pub held: Vec<GpuUuid>,
    /// Recorded GPUs without shares set back to their mode before.
    pub released: Vec<GpuUuid>,
}

impl ComputeModes {
    pub fn new(plugin_dir: &Path) -> Self {
        Self {
            path: plugin_dir.join(RECORD),
            record: Mutex::new(None),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The recorded GPUs and their mode before.
    pub fn recorded(&self) -> Result<BTreeMap<GpuUuid, ComputeMode>> {
        let mut g = lock(&self.record);
        Ok(self.loaded(&mut g)?.clone())
    }

    /// Puts `gpu` in `EXCLUSIVE_PROCESS` for a share: its mode before is recorded durably
    /// first. A GPU already recorded is left as it is (it was set when recorded; start-up sets
    /// it again), so a share beside others costs no NVML call.
    pub fn hold(&self, backend: &dyn Reconfigure, gpu: &GpuUuid) -> Result<()> {
        let mut g = lock(&self.record);
        if self.loaded(&mut g)?.contains_key(gpu) {
            return Ok(());
        }
        self.set_exclusive(backend, gpu, &mut g)
    }

    /// Sets `gpu` back to its recorded mode and drops the entry, unless `still_shared` (asked
    /// under the lock [`ComputeModes::hold`] takes) says a share of it is left. A GPU not
    /// recorded is left alone.
    pub fn release(
        &self,
        backend: &dyn Reconfigure,
        gpu: &GpuUuid,
        still_shared: impl FnOnce() -> bool,
    ) -> Result<()> {
        let mut g = lock(&self.record);
        let Some(&before) = self.loaded(&mut g)?.get(gpu) else {
            return Ok(());
        };
        if still_shared() {
            return Ok(());
        }
        self.set_back(backend, gpu, before, &mut g)
    }

    /// Start-up: every GPU of `shared` in `EXCLUSIVE_PROCESS` (recorded first where it was not),
    /// every other recorded GPU back to its mode before. Each GPU's failure is returned with
    /// it, after the others were done.
    pub fn repair(
        &self,
        backend: &dyn Reconfigure,
        shared: &BTreeSet<GpuUuid>,
    ) -> (Repaired, Vec<Error>) {
        let mut done = Repaired::default();
        let mut failed = Vec::new();
        let mut g = lock(&self.record);
        let recorded = match self.loaded(&mut g) {
            Ok(r) => r.clone(),
            Err(e) => return (done, vec![e]),
        };
        for gpu in shared {
            let r = if recorded.contains_key(gpu) {
                match backend.compute_mode(gpu) {
                    Ok(ComputeMode::ExclusiveProcess) => continue,
                    Ok(_) => backend
                        .set_compute_mode(gpu, ComputeMode::ExclusiveProcess)
                        .map_err(|source| Error::Hold {
                            gpu: gpu.clone(),
                            source: Box::new(source),
                        }),
                    Err(source) => Err(Error::Hold {
                        gpu: gpu.clone(),
                        source: Box::new(source),
                    }),
                }
            } else {
                self.set_exclusive(backend, gpu, &mut g)
            };
            match r {
                Ok(()) => done.held.push(gpu.clone()),
                Err(e) => failed.push(e),
            }
        }
        for (gpu, before) in recorded {
            if shared.contains(&gpu) {
                continue;
            }
            match self.set_back(backend, &gpu, before, &mut g) {
                Ok(()) => done.released.push(gpu),
                Err(e) => failed.push(e),
            }
        }
        (done, failed)
    }

    /// The daemon watch: every recorded GPU (held for shares) found out of `EXCLUSIVE_PROCESS`
    /// — a GPU reset, a driver reload, another agent — is put back. Returns those put back, with
    /// the mode they were found in, and those that could not be read or put back (their shares
    /// then have no guard against a process outside MPS: the caller refuses new ones).
    pub fn recheck(&self, backend: &dyn Reconfigure) -> (Vec<(GpuUuid, ComputeMode)>, Vec<Error>) {
        let mut restored = Vec::new();
        let mut failed = Vec::new();
        let mut g = lock(&self.record);
        let recorded = match self.loaded(&mut g) {
            Ok(r) => r.clone(),
            Err(e) => return (restored, vec![e]),
        };
        for gpu in recorded.keys() {
            let hold = |source| Error::Hold {
                gpu: gpu.clone(),
                source: Box::new(source),
            };
            match backend.compute_mode(gpu) {
                Ok(ComputeMode::ExclusiveProcess) => {}
                Ok(found) => match backend.set_compute_mode(gpu, ComputeMode::ExclusiveProcess) {
                    Ok(()) => restored.push((gpu.clone(), found)),
                    Err(e) => failed.push(hold(e)),
                },
                Err(e) => failed.push(hold(e)),
            }
        }
        (restored, failed)
    }

    fn set_exclusive(
        &self,
        backend: &dyn Reconfigure,
        gpu: &GpuUuid,
        g: &mut Option<BTreeMap<GpuUuid, ComputeMode>>,
    ) -> Result<()> {
        let hold = |source| Error::Hold {
            gpu: gpu.clone(),
            source: Box::new(source),
        };
        let before = backend.compute_mode(gpu).map_err(hold)?;
        let mut next = self.loaded(g)?.clone();
        next.insert(gpu.clone(), before);
        self.write(gpu, &next)?;
        *g = Some(next);
        if before != ComputeMode::ExclusiveProcess {
            backend
                .set_compute_mode(gpu, ComputeMode::ExclusiveProcess)
                .map_err(hold)?;
            tracing::info!(gpu.uuid = %gpu, compute_mode.before = %before, "GPU set to EXCLUSIVE_PROCESS compute mode for its MPS shares");
        }
        Ok(())
    }

    fn set_back(
        &self,
        backend: &dyn Reconfigure,
        gpu: &GpuUuid,
        before: ComputeMode,
        g: &mut Option<BTreeMap<GpuUuid, ComputeMode>>,
    ) -> Result<()> {
        backend
            .set_compute_mode(gpu, before)
            .map_err(|source| Error::Release {
                gpu: gpu.clone(),
                before,
                source: Box::new(source),
            })?;
        let mut next = self.loaded(g)?.clone();
        next.remove(gpu);
        self.write(gpu, &next)?;
        *g = Some(next);
        tracing::info!(gpu.uuid = %gpu, compute_mode = %before, "GPU compute mode set back after its last share");
        Ok(())
    }

    /// The record, read from disk the first time.
    fn loaded<'a>(
        &self,
        g: &'a mut Option<BTreeMap<GpuUuid, ComputeMode>>,
    ) -> Result<&'a BTreeMap<GpuUuid, ComputeMode>> {
        if g.is_none() {
            *g = Some(read(&self.path)?);
        }
        // Just filled when it was empty.
        Ok(g.get_or_insert_with(BTreeMap::new))
    }

    fn write(&self, gpu: &GpuUuid, record: &BTreeMap<GpuUuid, ComputeMode>) -> Result<()> {
        let fail = |source| Error::Write {
            gpu: gpu.clone(),
            source,
        };
        if record.is_empty() {
            crate::durable::remove(&self.path).map_err(fail)?;
            return Ok(());
        }
        let text: BTreeMap<&str, ComputeMode> =
            record.iter().map(|(g, m)| (g.as_str(), *m)).collect();
        // A map of strings to unit enum variants always serializes.
        let mut bytes = serde_json::to_vec_pretty(&text).unwrap_or_default();
        bytes.push(b'\n');
        crate::durable::write(&self.path, &bytes).map_err(fail)
    }
}

fn read(path: &Path) -> Result<BTreeMap<GpuUuid, ComputeMode>> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(BTreeMap::new()),
        Err(source) => {
            return Err(Error::Read {
                path: path.to_path_buf(),
                source,
            });
        }
    };
    let map: BTreeMap<String, ComputeMode> =
        serde_json::from_slice(&bytes).map_err(|source| Error::Parse {
            path: path.to_path_buf(),
            source,
        })?;
    Ok(map.into_iter().map(|(g, m)| (GpuUuid(g), m)).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::DeviceBackend;
    use crate::inventory::sim::{SimAction, SimBackend};

    fn setup() -> (tempfile::TempDir, SimBackend, GpuUuid, GpuUuid) {
        let dir = tempfile::tempdir().unwrap();
        let sim = SimBackend::from_profile("dgx-h100", "n").unwrap();
        let inv = sim.snapshot().unwrap();
        (dir, sim, inv.gpus[0].uuid.clone(), inv.gpus[1].uuid.clone())
    }

    fn on_disk(dir: &Path) -> Option<serde_json::Value> {
        std::fs::read(dir.join(RECORD))
            .ok()
            .map(|b| serde_json::from_slice(&b).unwrap())
    }

    #[test]
    fn the_mode_before_is_recorded_before_the_change_and_put_back_after_the_last_share() {
        let (dir, sim, gpu, _) = setup();
        sim.set_compute_mode(&gpu, ComputeMode::Prohibited).unwrap();
        let modes = ComputeModes::new(dir.path());
        modes.hold(&sim, &gpu).unwrap();
        assert_eq!(
            sim.compute_mode(&gpu).unwrap(),
            ComputeMode::ExclusiveProcess
        );
        assert_eq!(
            on_disk(dir.path()),
            Some(serde_json::json!({ gpu.as_str(): "prohibited" }))
        );
        // A second share: no NVML call (the record says it is held).
        let before = sim.actions().len();
        modes.hold(&sim, &gpu).unwrap();
        assert_eq!(sim.actions().len(), before);

        // A share is left: nothing changes.
        modes.release(&sim, &gpu, || true).unwrap();
        assert_eq!(
            sim.compute_mode(&gpu).unwrap(),
            ComputeMode::ExclusiveProcess
        );
        modes.release(&sim, &gpu, || false).unwrap();
        assert_eq!(sim.compute_mode(&gpu).unwrap(), ComputeMode::Prohibited);
        assert_eq!(
            on_disk(dir.path()),
            None,
            "the record goes with its last entry"
        );
        // Releasing again is a no-op, and asks nobody.
        modes
            .release(&sim, &gpu, || panic!("not asked for a GPU not recorded"))
            .unwrap();
    }

    #[test]
    fn start_up_holds_gpus_with_shares_and_puts_back_the_others() {
        let (dir, sim, a, b) = setup();
        let modes = ComputeModes::new(dir.path());
        modes.hold(&sim, &a).unwrap();
        modes.hold(&sim, &b).unwrap();
        // A reboot reset both; b's shares are gone from the checkpoint.
        sim.set_compute_mode(&a, ComputeMode::Default).unwrap();
        let after_reboot = ComputeModes::new(dir.path());
        let shared = BTreeSet::from([a.clone()]);
        let (done, failed) = after_reboot.repair(&sim, &shared);
        assert!(failed.is_empty(), "{failed:?}");
        assert_eq!(done.held, vec![a.clone()]);
        assert_eq!(done.released, vec![b.clone()]);
        assert_eq!(sim.compute_mode(&a).unwrap(), ComputeMode::ExclusiveProcess);
        assert_eq!(sim.compute_mode(&b).unwrap(), ComputeMode::Default);
        assert_eq!(
            after_reboot.recorded().unwrap(),
            BTreeMap::from([(a.clone(), ComputeMode::Default)])
        );
        // A GPU with shares but no entry (a crash before the record, or an older nvdra) is
        // recorded, then held.
        let c = sim.snapshot().unwrap().gpus[2].uuid.clone();
        let (done, _) = after_reboot.repair(&sim, &BTreeSet::from([a.clone(), c.clone()]));
        assert_eq!(done.held, vec![c.clone()], "a was in the mode already");
        assert!(after_reboot.recorded().unwrap().contains_key(&c));
        assert!(sim.actions().contains(&SimAction::SetComputeMode {
            gpu: c,
            mode: ComputeMode::ExclusiveProcess
        }));
    }

    #[test]
    fn a_crash_between_record_and_change_is_put_right_at_start_up() {
        let (dir, sim, gpu, _) = setup();
        // Recorded, but the mode never changed (the process died in between) and the share
        // never made it into the checkpoint.
        std::fs::write(
            dir.path().join(RECORD),
            format!("{{\"{gpu}\": \"default\"}}"),
        )
        .unwrap();
        let modes = ComputeModes::new(dir.path());
        let (done, failed) = modes.repair(&sim, &BTreeSet::new());
        assert!(failed.is_empty(), "{failed:?}");
        assert_eq!(done.released, vec![gpu.clone()]);
        assert_eq!(sim.compute_mode(&gpu).unwrap(), ComputeMode::Default);
        assert_eq!(on_disk(dir.path()), None);
    }

    #[test]
    fn failures_name_the_gpu_and_what_to_do() {
        let (dir, sim, _, _) = setup();
        let modes = ComputeModes::new(dir.path());
        let gone = GpuUuid("GPU-gone".into());
        let e = modes.hold(&sim, &gone).unwrap_err();
        let msg = crate::report::chain(&e).to_string();
        assert!(
            msg.contains("GPU-gone") && msg.contains("share is refused") && msg.contains("root"),
            "{msg}"
        );
        assert_eq!(
            on_disk(dir.path()),
            None,
            "nothing recorded for a GPU not read"
        );

        std::fs::write(dir.path().join(RECORD), "{not json").unwrap();
        let e = ComputeModes::new(dir.path()).recorded().unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains(RECORD) && msg.contains("nvidia-smi -i <uuid> -c DEFAULT"),
            "{msg}"
        );
    }
}
