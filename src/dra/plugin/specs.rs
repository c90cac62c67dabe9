//! The plugin's claim CDI specs: what a claim's spec names, from its device records
//! ([`cdi_devices`]), written and checked on the blocking pool ([`Plugin::write_cdi`],
//! [`Plugin::ensure_cdi`]); and the specs themselves ([`Specs`]): the directory they live in, the
//! options that name them and the driver files they mount, as one value, so that no call can pair
//! a root with the wrong options.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use super::{ClaimError, Plugin};
use crate::cdi::memlimit::{Enforcement, Partitioning};
use crate::cdi::{self, CdiOptions, DriverFiles, DriverRoot, PreparedDevice};
use crate::dra::mps::Mps;
use crate::durable::Durability;
use crate::ids::ClaimUid;
use crate::inventory::{GpuUuid, Inventory, MigDevice, Reconfigure};
use crate::ledger::DeviceRecord;
use crate::lock::lock;
use crate::sharing::Sharing;

impl Plugin {
    /// Builds and writes the claim's CDI spec on the blocking pool (it reads the host).
    /// `created`: MIG devices made since `inv` was taken.
    pub(super) async fn write_cdi(
        &self,
        uid: &ClaimUid,
        devices: &[DeviceRecord],
        inv: &Inventory,
        created: &[MigDevice],
    ) -> Result<(), ClaimError> {
        let prepared = self.cdi_devices(uid, devices, inv, created)?;
        let uid = uid.clone();
        Ok(self
            .blocking(move |i| i.specs.write(&uid, &prepared))
            .await??)
    }

    /// Rewrites a completed claim's CDI spec unless it is intact (the spec is not fsync'd:
    /// [`Specs::write`]); whether it wrote.
    pub(super) async fn ensure_cdi(
        &self,
        uid: &ClaimUid,
        devices: &[DeviceRecord],
        inv: &Inventory,
    ) -> Result<bool, ClaimError> {
        let prepared = match self.cdi_devices(uid, devices, inv, &[]) {
            Ok(prepared) => prepared,
            Err(e) => {
                // The devices cannot be resolved now (a MIG device the backend no longer
                // lists): a spec that still reads as one stays, as the checkpoint's record does.
                let owner = uid.clone();
                if self.blocking(move |i| i.specs.readable(&owner)).await? {
                    tracing::warn!(claim.uid = %uid, error = %crate::report::chain(&e), "cannot rebuild the CDI spec to check it; keeping the one on disk");
                    return Ok(false);
                }
                return Err(e);
            }
        };
        let uid = uid.clone();
        Ok(self
            .blocking(move |i| i.specs.ensure(&uid, &prepared))
            .await??)
    }

    /// The devices of `uid`'s spec, as [`cdi_devices`] resolves them on this node.
    fn cdi_devices(
        &self,
        uid: &ClaimUid,
        devices: &[DeviceRecord],
        inv: &Inventory,
        created: &[MigDevice],
    ) -> Result<Vec<PreparedDevice>, ClaimError> {
        let (pool, mps) = (&self.inner.opts.pool, &self.inner.mps);
        cdi_devices(pool, uid, devices, inv, created, mps)
    }
}

/// The devices of a claim's CDI spec: each record with its GPU, and its MIG device looked up in
/// `inv` or among `created` (the MIG devices this prepare made, which `inv` predates).
pub(super) fn cdi_devices(
    pool: &str,
    uid: &ClaimUid,
    devices: &[DeviceRecord],
    inv: &Inventory,
    created: &[MigDevice],
    mps: &Mps,
) -> Result<Vec<PreparedDevice>, ClaimError> {
    let gone = |d: &DeviceRecord, reason: String| ClaimError::UnknownDevice {
        pool: d.pool.clone(),
        device: d.device.to_string(),
        ours: pool.to_string(),
        reason,
    };
    devices
        .iter()
        .map(|d| {
            let gpu = inv
                .gpu_by_uuid(d.gpu.as_str())
                .ok_or_else(|| gone(d, format!("GPU {} is gone", d.gpu)))?;
            let mig = match &d.mig {
                None => None,
                Some(m) => Some(
                    gpu.mig
                        .devices
                        .iter()
                        .chain(created)
                        .find(|x| Some(&x.uuid) == m.uuid.as_ref())
                        .ok_or_else(|| gone(d, "the MIG device is gone".into()))?
                        .clone(),
                ),
            };
            // What a share divides: its MIG device's memory for a share of one.
            let memory = mig.as_ref().map_or(gpu.memory_bytes, |m| m.memory_bytes);
            Ok(PreparedDevice {
                name: d.device.to_string(),
                gpu: gpu.clone(),
                mig,
                mps_pipe_dir: match (&d.sharing, d.consumed) {
                    (Sharing::Mps(_), Some(_)) => Some(mps.shares_pipe_dir(&d.share_target())),
                    (Sharing::Mps(_), None) => Some(mps.pipe_dir(uid)),
                    _ => None,
                },
                mps_shm_dir: match (&d.sharing, d.consumed) {
                    (Sharing::Mps(_), Some(_)) => Some(mps.shares_shm_dir(&d.share_target())),
                    (Sharing::Mps(_), None) => Some(mps.shm_dir(uid)),
                    _ => None,
                },
                sharing: d.sharing.clone(),
                // Soft: what the share is held to (what the scheduler counted, or its part of the
                // GPU in integer mode), guaranteed; hard: its burst limit, else the soft one. None
                // for an `unlimited` share that asked for no memory and no burst limit.
                memory_limits: d
                    .consumed
                    .and_then(|c| c.memory_limits(crate::ledger::shares::shareable_memory(memory))),
            })
        })
        .collect()
}

pub(super) struct Specs {
    root: PathBuf,
    opts: CdiOptions,
    /// Where the driver may partition GPU memory per cgroup: how each GPU is asked, and its
    /// answer ([`Specs::enable_memory_limits`]).
    partitioning: Option<Probe>,
    /// Found at start; looked for again while none are found, since on GPU Operator nodes the
    /// driver container may come up after nvdra.
    driver_files: Mutex<DriverFiles>,
    /// Why the MPS start gate could not be installed; MPS claims are then refused.
    gate_error: Option<String>,
    /// Which limit holds each share claim's memory, as its written spec says (for `/metrics`).
    levels: Mutex<BTreeMap<ClaimUid, Enforcement>>,
    /// nvdra's binary installed on the host for the hooks, or why it could not be: installed
    /// once, for whichever hook asks first ([`Specs::hook_binary`]).
    installed: Option<Result<PathBuf, String>>,
}

impl Specs {
    /// Specs of `driver` in `root`, for a host whose driver files are under `driver_root`.
    pub fn new(driver: &str, driver_root: &DriverRoot, root: PathBuf) -> Result<Self, cdi::Error> {
        Ok(Self {
            opts: CdiOptions::resolve(driver, driver_root)?,
            partitioning: None,
            driver_files: Mutex::new(cdi::discover_driver_files(driver_root)),
            root,
            gate_error: None,
            levels: Mutex::default(),
            installed: None,
        })
    }

    /// nvdra's binary installed in `dir` (a host directory) for the hooks: copied at the first
    /// call (reading the running binary and the installed copy), the same answer after.
    fn hook_binary(&mut self, dir: &Path) -> Result<PathBuf, String> {
        self.installed
            .get_or_insert_with(|| cdi::install_hook(dir).map_err(|e| format!("{e:#}")))
            .clone()
    }

    /// Gives the specs of shares the driver's per-container memory limits ([`cdi::memlimit`])
    /// where they can hold: a cgroup v2 hierarchy at the cgroup root, the driver's NVML library
    /// found under the driver root, and nvdra's binary installed in `dir` (a host directory).
    /// Each whole GPU is then asked through `backend` at its first share whether its driver
    /// partitions memory per cgroup ([`Reconfigure::memory_limits`] on the cgroup root), and
    /// the answer kept: a node's driver does not change under the plugin. Anywhere else a
    /// share's limit is per CUDA process only, as logged.
    pub fn enable_memory_limits(&mut self, dir: &Path, backend: Arc<dyn Reconfigure>) {
        const PER_PROCESS: &str =
            "a share's memory limit is per CUDA process (CUDA_MPS_PINNED_DEVICE_MEM_LIMIT)";
        let cgroups = self.opts.root.read_path(&self.opts.cgroup_root);
        if !cgroups.join("cgroup.controllers").is_file() {
            tracing::info!(
                cgroups = %cgroups.display(),
                "no cgroup v2 hierarchy there, so no per-container memory limits: {PER_PROCESS}"
            );
            return;
        }
        let Some(nvml) = nvml_library(&self.driver_files()) else {
            tracing::info!(
                driver_root = %self.opts.root.host().display(),
                "no libnvidia-ml.so under the driver root, so no per-container memory limits: \
                 {PER_PROCESS}"
            );
            return;
        };
        let binary = match self.hook_binary(dir) {
            Ok(b) => b,
            Err(e) => {
                tracing::warn!(error = %e, "cannot install the memory-limit hook: {PER_PROCESS}");
                return;
            }
        };
        tracing::info!(
            hook = %binary.display(),
            nvml = %nvml.display(),
            "each GPU's driver is asked at its first share whether it limits memory per cgroup"
        );
        let dmem = dmem_backend(&cgroups);
        if dmem {
            tracing::info!(
                "the driver partitions memory through the dmem cgroup controller: a share's \
                 container gets its hard limit only, since its soft limit (dmem.min) could not be \
                 cleared when the container goes (runc and crun remove the cgroup before poststop \
                 hooks) and every ancestor cgroup would keep the reservation"
            );
        }
        self.opts.partitioning = Some(Partitioning {
            binary,
            nvml,
            gpus: Default::default(),
            dmem,
        });
        self.partitioning = Some(Probe {
            backend,
            cgroup: cgroups,
            answers: Mutex::default(),
        });
    }

    /// The options for a spec of `devices`: the GPUs of their shares asked whether their driver
    /// partitions memory per cgroup, and those that do listed.
    fn options_for(&self, devices: &[PreparedDevice]) -> Cow<'_, CdiOptions> {
        let (Some(probe), Some(partitioning)) = (&self.partitioning, &self.opts.partitioning)
        else {
            return Cow::Borrowed(&self.opts);
        };
        let mut shares = devices
            .iter()
            .filter(|d| d.memory_limits.is_some() && d.mig.is_none())
            .map(|d| &d.gpu.uuid)
            .peekable();
        if shares.peek().is_none() {
            return Cow::Borrowed(&self.opts);
        }
        let gpus = shares
            .filter(|gpu| probe.partitions(gpu))
            .cloned()
            .collect();
        let mut opts = self.opts.clone();
        opts.partitioning = Some(Partitioning {
            gpus,
            ..partitioning.clone()
        });
        Cow::Owned(opts)
    }

    /// Gives MPS claims' specs the start gate ([`cdi::gate`]): where the driver has
    /// `nvidia-cuda-mps-control`, nvdra's binary is installed in `dir` (a host directory) and
    /// named in the hook. Without the control binary no MPS claim can be prepared anyway. An
    /// install that fails is returned: the caller refuses MPS claims rather than start their
    /// containers ungated.
    pub fn enable_mps_gate(&mut self, dir: &std::path::Path) -> anyhow::Result<bool> {
        let Ok(control) = crate::mps::control::find(self.opts.root.ctr()) else {
            return Ok(false);
        };
        let binary = match self.hook_binary(dir) {
            Ok(b) => b,
            Err(e) => {
                self.gate_error = Some(e.clone());
                anyhow::bail!(e);
            }
        };
        self.opts.mps_gate = Some(cdi::gate::Gate {
            binary,
            control: self.opts.root.host_path(&control),
        });
        Ok(true)
    }

    pub fn options(&self) -> &CdiOptions {
        &self.opts
    }

    /// Builds and writes (or replaces) the claim's spec; reads the host, so blocking. Atomic, not
    /// durable: a power loss may lose or empty it, and start-up's [`Specs::ensure`] repairs that
    /// from the checkpoint, so a prepare waits for one fsync'd write (the checkpoint's), not two.
    pub fn write(&self, uid: &ClaimUid, devices: &[PreparedDevice]) -> Result<(), cdi::Error> {
        let (text, level) = self.render(uid, devices)?;
        self.replace(uid, &text)?;
        if let Some(level) = self.record_level(uid, level) {
            let how = match level {
                Enforcement::Container => {
                    "per container: the driver's soft and hard limits on the container's cgroup \
                     (NVML), and the MPS per-process limit"
                }
                Enforcement::Process => {
                    "per CUDA process only (CUDA_MPS_PINNED_DEVICE_MEM_LIMIT): this GPU's driver \
                     does not partition memory per cgroup"
                }
            };
            tracing::info!(claim.uid = %uid, %level, "share memory limit {how}");
        }
        Ok(())
    }

    /// Records which limit holds the claim's shares; `None` for a claim without shares.
    fn record_level(&self, uid: &ClaimUid, level: Option<Enforcement>) -> Option<Enforcement> {
        let level = level?;
        lock(&self.levels).insert(uid.clone(), level);
        Some(level)
    }

    /// Which limit holds each prepared share claim's memory.
    pub fn levels(&self) -> BTreeMap<ClaimUid, Enforcement> {
        lock(&self.levels).clone()
    }

    /// Rewrites the claim's spec unless the file already holds exactly what [`Specs::write`]
    /// would write (it may be missing, empty or stale after a power loss, or edited by hand).
    /// Whether it wrote.
    pub fn ensure(&self, uid: &ClaimUid, devices: &[PreparedDevice]) -> Result<bool, cdi::Error> {
        let (text, level) = self.render(uid, devices)?;
        self.record_level(uid, level);
        let path = cdi::spec_path(&self.root, &self.opts, uid);
        if std::fs::read(&path).is_ok_and(|on_disk| on_disk == text.as_bytes()) {
            return Ok(false);
        }
        self.replace(uid, &text)?;
        Ok(true)
    }

    /// The claim's spec as [`Specs::write`] writes it, and which limit holds its shares' memory
    /// (the weaker one where they differ; `None` without shares), from the same options.
    fn render(
        &self,
        uid: &ClaimUid,
        devices: &[PreparedDevice],
    ) -> Result<(String, Option<Enforcement>), cdi::Error> {
        if let Some(e) = &self.gate_error
            && devices.iter().any(|d| d.mps_pipe_dir.is_some())
        {
            return Err(cdi::Error::Mps {
                claim_uid: uid.to_string(),
                message: format!(
                    "the MPS start gate could not be installed at start ({e}): an MPS claim's \
                     containers could start while its daemon is down and run outside MPS, so \
                     none is prepared; fix the plugin directory and restart the plugin"
                ),
            });
        }
        let opts = self.options_for(devices);
        let text =
            cdi::claim_spec(&opts, uid.as_str(), devices, &self.driver_files())?.to_yaml()?;
        let level = devices
            .iter()
            .filter_map(|d| cdi::memlimit::enforcement(&opts, d))
            .max();
        Ok((text, level))
    }

    /// The driver's files, looked for again if none were found before.
    fn driver_files(&self) -> DriverFiles {
        // A poisoned lock still holds a complete value: it is only ever replaced whole.
        let mut files = self
            .driver_files
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if files.version.is_none() {
            let found = cdi::discover_driver_files(&self.opts.root);
            if let Some(version) = &found.version {
                tracing::info!(
                    driver.version = %version,
                    driver_root = %self.opts.root.host().display(),
                    "driver files found; claim specs mount them from now on"
                );
                *files = found;
            }
        }
        files.clone()
    }

    fn replace(&self, uid: &ClaimUid, text: &str) -> Result<(), cdi::Error> {
        cdi::write_spec_text(&self.root, &self.opts, uid, text, Durability::Atomic)?;
        Ok(())
    }

    /// Whether the claim's spec file reads as a CDI spec with devices (it may still be stale).
    pub fn readable(&self, uid: &ClaimUid) -> bool {
        let path = cdi::spec_path(&self.root, &self.opts, uid);
        std::fs::read_to_string(path)
            .ok()
            .and_then(|text| crate::yaml::from_str::<cdi::Spec>(&text).ok())
            .is_some_and(|spec| !spec.devices.is_empty())
    }

    /// Whether there was a spec to remove. Not durable either: a spec that comes back after a
    /// power loss has no checkpoint entry, and start-up removes it.
    pub fn remove(&self, uid: &ClaimUid) -> Result<bool, cdi::Error> {
        let removed = cdi::remove_spec(&self.root, &self.opts, uid, Durability::Atomic)?;
        lock(&self.levels).remove(uid);
        Ok(removed)
    }

    /// The claim UIDs of the specs in the directory.
    pub fn list(&self) -> Result<Vec<ClaimUid>, cdi::Error> {
        cdi::list_claim_specs(&self.root, &self.opts)
    }
}

/// How each GPU is asked whether its driver partitions memory per cgroup, and the answers.
struct Probe {
    backend: Arc<dyn Reconfigure>,
    /// The cgroup root as nvdra reads it: the cgroup asked about.
    cgroup: PathBuf,
    answers: Mutex<BTreeMap<GpuUuid, bool>>,
}

impl Probe {
    /// Whether `gpu`'s driver partitions its memory per cgroup: asked once, and logged.
    fn partitions(&self, gpu: &GpuUuid) -> bool {
        if let Some(known) = crate::lock::lock(&self.answers).get(gpu) {
            return *known;
        }
        // Not under the lock: a driver call, under the backend's deadline.
        let answer = self.backend.memory_limits(gpu, &self.cgroup);
        match &answer {
            Ok(limits) => tracing::info!(
                gpu = %gpu,
                cgroup = %self.cgroup.display(),
                %limits,
                "the driver limits this GPU's memory per cgroup: each share's container gets \
                 its own soft and hard limit"
            ),
            Err(e) => tracing::info!(
                gpu = %gpu,
                reason = %crate::report::chain(e),
                "no per-cgroup memory limits on this GPU: a share's memory limit is per CUDA \
                 process (CUDA_MPS_PINNED_DEVICE_MEM_LIMIT)"
            ),
        }
        *crate::lock::lock(&self.answers)
            .entry(gpu.clone())
            .or_insert(answer.is_ok())
    }
}

/// The driver's NVML library among its files (a host path), which the hook loads.
fn nvml_library(files: &DriverFiles) -> Option<PathBuf> {
    files
        .libraries
        .iter()
        .find(|l| {
            l.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("libnvidia-ml.so."))
        })
        .cloned()
}

/// Whether the root cgroup `cgroups` lists NVIDIA device memory regions in `dmem.capacity`: the
/// driver's `dmem` backend (kernel 6.14+), whose soft limits are reservations in the ancestors.
fn dmem_backend(cgroups: &Path) -> bool {
    std::fs::read_to_string(cgroups.join("dmem.capacity"))
        .is_ok_and(|t| t.lines().any(|l| l.starts_with("nvidia/")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::topology::load_profile;
    use crate::sharing::Sharing;

    /// The driver (an Operator's driver container) shows up after nvdra started: the next spec
    /// mounts its files.
    #[test]
    fn driver_files_found_after_start_reach_the_next_spec() {
        let dir = tempfile::tempdir().unwrap();
        let driver = dir.path().join("driver");
        let specs = Specs::new(
            "gpu.nvidia.com",
            &DriverRoot::at(&driver),
            dir.path().join("cdi"),
        )
        .unwrap();
        let gpu = load_profile("dgx-h100", "n").unwrap().gpus[0].clone();
        let devices = [PreparedDevice {
            name: "gpu-0".into(),
            gpu,
            mig: None,
            sharing: Sharing::Exclusive,
            mps_pipe_dir: None,
            mps_shm_dir: None,
            memory_limits: None,
        }];
        let uid = ClaimUid::parse("uid-1").unwrap();
        let lib = "usr/lib/x86_64-linux-gnu/libcuda.so.550.163.01";
        assert!(!specs.render(&uid, &devices).unwrap().0.contains(lib));
        let path = driver.join(lib);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, "libcuda").unwrap();
        assert!(specs.render(&uid, &devices).unwrap().0.contains(lib));
    }
}
