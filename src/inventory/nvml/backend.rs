//! The backend: opening NVML (library candidates under the driver root), snapshots, and omissions
//! logged once.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use nvml_wrapper::Nvml;
use nvml_wrapper::error::NvmlError;
use tracing::{Level, debug, info, warn};

use super::{
    HostSysfs, LIBRARY, SYSFS_ROOT, ffi, map_with_omissions, read_raw, read_usage, reconfigure,
};
use crate::inventory::holders::HolderScan;
use crate::inventory::{
    ComputeMode, DeviceBackend, Error, GpuUsage, GpuUuid, Inventory, MemoryLimits, MigDevice,
    MigModeChange, MigUuid, Placement, Reconfiguration, Reconfigure, Result, TimeSlice,
};

pub struct NvmlBackend {
    nvml: Arc<Nvml>,
    sysfs: HostSysfs,
    logged: OmissionLog,
    driver_root: PathBuf,
    /// The library file NVML was loaded from, when it was found under the driver root.
    library: Option<PathBuf>,
    /// `nvidia-smi` under the driver root, for time slicing.
    nvidia_smi: Option<PathBuf>,
    /// One MIG reconfiguration at a time: two creations racing for overlapping slices would
    /// each see the other's half-made GPU instance as an orphan.
    reconfiguring: Mutex<()>,
    /// Where each read finds the processes holding the GPUs ([`NvmlBackend::with_holders`]);
    /// `None`: reads list none.
    holders: Option<HolderScan>,
}

impl std::fmt::Debug for NvmlBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmlBackend")
            .field("sysfs", &self.sysfs.root)
            .finish_non_exhaustive()
    }
}

impl NvmlBackend {
    /// Loads NVML. With a driver root other than `/`, the library is looked up under it first
    /// (the usual layout of a containerized driver), then by the default search path.
    pub fn open(driver_root: &Path) -> Result<Self> {
        let mut tried = Vec::new();
        for candidate in library_candidates(driver_root) {
            let init = match &candidate {
                Some(path) => Nvml::builder().lib_path(path.as_os_str()).init(),
                None => Nvml::init(),
            };
            match init {
                Ok(nvml) => {
                    return Ok(Self {
                        nvml: Arc::new(nvml),
                        sysfs: HostSysfs::new(SYSFS_ROOT),
                        logged: OmissionLog::default(),
                        driver_root: driver_root.to_path_buf(),
                        library: candidate,
                        nvidia_smi: reconfigure::find_nvidia_smi(driver_root),
                        reconfiguring: Mutex::new(()),
                        holders: None,
                    });
                }
                Err(NvmlError::LibloadingError(e)) => tried.push(match &candidate {
                    Some(path) => format!("{}: {e}", path.display()),
                    None => e.to_string(),
                }),
                Err(e) => {
                    return Err(Error::Nvml {
                        call: "nvmlInit".into(),
                        reason: e.to_string(),
                    });
                }
            }
        }
        Err(Error::NvmlMissing {
            library: LIBRARY.into(),
            reason: tried.join("; "),
        })
    }

    /// Reads PCI placement from another sysfs mount (for tests or unusual container layouts).
    pub fn with_sysfs_root(mut self, root: impl Into<PathBuf>) -> Self {
        self.sysfs = HostSysfs::new(root);
        self
    }

    /// Makes each snapshot list the processes holding each MIG-capable GPU in its
    /// [`Mig::holders`](crate::inventory::Mig::holders) (one walk of `scan`'s proc root per
    /// read, plus NVML's compute processes of each such GPU), and an `IN_USE` answer name them:
    /// what `--dynamic-mig` needs to offer only GPUs it can switch. Without it, reads are as
    /// they were.
    pub fn with_holders(mut self, scan: HolderScan) -> Self {
        self.holders = Some(scan);
        self
    }

    pub fn nvml(&self) -> &Nvml {
        &self.nvml
    }
}

pub(super) fn library_candidates(driver_root: &Path) -> Vec<Option<PathBuf>> {
    let mut out = Vec::new();
    if driver_root != Path::new("/") {
        for dir in [
            "usr/lib/x86_64-linux-gnu",
            "usr/lib/aarch64-linux-gnu",
            "usr/lib64",
            "usr/lib",
            "lib64",
            "lib",
        ] {
            let p = driver_root.join(dir).join(LIBRARY);
            if p.exists() {
                out.push(Some(p));
            }
        }
    }
    out.push(None);
    out
}

impl DeviceBackend for NvmlBackend {
    fn name(&self) -> &'static str {
        "nvml"
    }

    fn snapshot(&self) -> Result<Inventory> {
        let (mut inv, omissions) = map_with_omissions(read_raw(&self.nvml)?, &self.sysfs)?;
        self.logged.log_new(&omissions);
        if let Some(scan) = &self.holders {
            fill_holders(&self.nvml, scan, &mut inv);
        }
        Ok(inv)
    }

    fn usage(&self) -> Result<Vec<GpuUsage>> {
        read_usage(&self.nvml)
    }

    fn start_health_events(
        &self,
        sink: Box<dyn crate::inventory::events::EventSink>,
    ) -> Option<std::io::Result<crate::inventory::events::EventThread>> {
        Some(super::events::start(self.nvml.clone(), sink))
    }

    fn probe(&self, gpu: &GpuUuid) -> std::result::Result<(), String> {
        super::events::probe(&self.nvml, gpu).map_err(|e| e.to_string())
    }
}

impl Reconfigure for NvmlBackend {
    fn unavailable(&self, what: Reconfiguration) -> Option<String> {
        match what {
            Reconfiguration::TimeSlice => self
                .nvidia_smi
                .is_none()
                .then(|| reconfigure::no_nvidia_smi(&self.driver_root)),
            Reconfiguration::Mig => ffi::has_mig_reconfiguration(&self.nvml)
                .err()
                .map(|symbol| format!("the NVML library lacks {symbol} (a driver older than MIG)")),
        }
        // Both change the GPU, which the driver allows only with CAP_SYS_ADMIN.
        .or_else(reconfigure::lacks_sys_admin_now)
    }

    fn set_time_slice(&self, gpu: &GpuUuid, interval: TimeSlice) -> Result<()> {
        let Some(smi) = &self.nvidia_smi else {
            return Err(Error::Refused(format!(
                "cannot set the time slice of GPU {gpu}: {}",
                reconfigure::no_nvidia_smi(&self.driver_root)
            )));
        };
        reconfigure::set_time_slice(
            smi,
            self.library.as_deref(),
            gpu,
            interval,
            reconfigure::NVIDIA_SMI_DEADLINE,
        )
    }

    fn compute_mode(&self, gpu: &GpuUuid) -> Result<ComputeMode> {
        reconfigure::compute_mode(&self.nvml, gpu)
    }

    fn set_compute_mode(&self, gpu: &GpuUuid, mode: ComputeMode) -> Result<()> {
        reconfigure::set_compute_mode(&self.nvml, gpu, mode)
    }

    fn memory_limits(&self, gpu: &GpuUuid, cgroup: &Path) -> Result<MemoryLimits> {
        let device = self
            .nvml
            .device_by_uuid(gpu.as_str())
            .map_err(|e| match e {
                NvmlError::NotFound | NvmlError::InvalidArg => {
                    Error::Refused(format!("no GPU with UUID {gpu}"))
                }
                e => Error::Nvml {
                    call: "nvmlDeviceGetHandleByUUID".into(),
                    reason: e.to_string(),
                },
            })?;
        ffi::memory_limits(&self.nvml, &device, cgroup)
            .map(|(limits, _used)| limits)
            .map_err(|e| Error::Nvml {
                call: ffi::GET_MEMORY_LIMITS.into(),
                reason: e.to_string(),
            })
    }

    fn create_mig(
        &self,
        gpu: &GpuUuid,
        gi_profile_id: u32,
        placement: Placement,
    ) -> Result<MigDevice> {
        // A panic in another reconfiguration leaves no state behind this lock.
        let _one = crate::lock::lock(&self.reconfiguring);
        reconfigure::create_mig(&self.nvml, gpu, gi_profile_id, placement)
    }

    fn destroy_mig(&self, gpu: &GpuUuid, mig: &MigUuid) -> Result<()> {
        let _one = crate::lock::lock(&self.reconfiguring);
        reconfigure::destroy_mig(&self.nvml, gpu, mig)
    }

    fn set_mig_mode(&self, gpu: &GpuUuid, enabled: bool) -> Result<MigModeChange> {
        let _one = crate::lock::lock(&self.reconfiguring);
        reconfigure::set_mig_mode(&self.nvml, gpu, enabled, self.holders.as_ref())
    }
}

/// Lists the holders of each MIG-capable GPU of `inv` in its `Mig::holders`: one scan for them
/// all, and NVML's compute processes of each (a GPU whose list cannot be read keeps the scan's).
fn fill_holders(nvml: &Nvml, scan: &HolderScan, inv: &mut Inventory) {
    let minors: Vec<u32> = inv
        .gpus
        .iter()
        .filter(|g| g.mig.capable)
        .map(|g| g.minor)
        .collect();
    let mut found = scan.scan(&minors);
    for g in inv.gpus.iter_mut().filter(|g| g.mig.capable) {
        let held = found.remove(&g.minor).unwrap_or_default();
        let compute: Vec<u32> = nvml
            .device_by_uuid(g.uuid.as_str())
            .and_then(|d| super::usage::compute_processes(&d))
            .map(|ps| ps.into_iter().map(|p| p.pid).collect())
            .unwrap_or_default();
        g.mig.holders = scan.with_processes(held, &compute);
    }
}

/// A fact NVML did not give for one GPU, left out of the inventory instead of guessed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Omission {
    pub gpu_index: u32,
    pub gpu: GpuUuid,
    /// What is left out, named as published (`multiprocessors`, `brand`, `fabric`, …).
    pub field: &'static str,
    pub reason: String,
    /// How loudly to say it: `WARN` for a gap on hardware that should have the value, `INFO`
    /// for a transient or harmless one, `DEBUG` for what a GPU simply does not have.
    pub level: Level,
}

impl Omission {
    pub(super) fn log(&self) {
        let (index, uuid, field, reason) =
            (self.gpu_index, self.gpu.as_str(), self.field, &self.reason);
        match self.level {
            Level::ERROR | Level::WARN => {
                warn!(
                    gpu.index = index,
                    gpu.uuid = uuid,
                    field,
                    "{field} not published: {reason}"
                )
            }
            Level::INFO => {
                info!(
                    gpu.index = index,
                    gpu.uuid = uuid,
                    field,
                    "{field} not published: {reason}"
                )
            }
            _ => debug!(
                gpu.index = index,
                gpu.uuid = uuid,
                field,
                "{field} not published: {reason}"
            ),
        }
    }
}

/// Logs each omission once per GPU and field while it lasts: again only when its reason changes,
/// or when it comes back after the value was seen.
#[derive(Debug, Default)]
pub(super) struct OmissionLog(Mutex<BTreeMap<(GpuUuid, &'static str), String>>);

impl OmissionLog {
    /// Logs the omissions not logged before (or whose reason changed) and returns them.
    pub(super) fn log_new<'a>(&self, omissions: &'a [Omission]) -> Vec<&'a Omission> {
        // A panic while logging cannot leave the map torn; keep using it.
        let mut seen = crate::lock::lock(&self.0);
        let mut now = BTreeMap::new();
        let mut logged = Vec::new();
        for o in omissions {
            let key = (o.gpu.clone(), o.field);
            if seen.get(&key) != Some(&o.reason) {
                o.log();
                logged.push(o);
            }
            now.insert(key, o.reason.clone());
        }
        *seen = now;
        logged
    }
}
