//! The backend seams: [`DeviceBackend`], the hardware side the inventory owner reads, and
//! [`Reconfigure`], the write side the DRA plugin holds.

use std::path::Path;

use super::{
    Error, GpuUsage, GpuUuid, Inventory, MigDevice, MigModeChange, MigUuid, Placement, Result,
    TimeSlice,
};

/// A reconfiguration prepare may ask of a backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reconfiguration {
    /// [`Reconfigure::set_time_slice`].
    TimeSlice,
    /// [`Reconfigure::create_mig`] and [`Reconfigure::destroy_mig`].
    Mig,
}

impl std::fmt::Display for Reconfiguration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Reconfiguration::TimeSlice => "time slicing",
            Reconfiguration::Mig => "MIG creation",
        })
    }
}

/// A GPU's compute mode: how many CUDA contexts it admits (NVML `nvmlComputeMode_t`). While a
/// GPU holds MPS shares it is [`ComputeMode::ExclusiveProcess`]: the MPS server is its one
/// context, so a process that misses MPS fails instead of running beside it without limits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum ComputeMode {
    /// Any number of contexts.
    #[default]
    Default,
    /// One context (one process) at a time.
    ExclusiveProcess,
    /// No contexts.
    Prohibited,
}

impl std::fmt::Display for ComputeMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // As `nvidia-smi -c` names them.
        f.write_str(match self {
            ComputeMode::Default => "DEFAULT",
            ComputeMode::ExclusiveProcess => "EXCLUSIVE_PROCESS",
            ComputeMode::Prohibited => "PROHIBITED",
        })
    }
}

/// NVML's `NVML_DEVICE_MEMORY_LIMIT_MAX`, the hard limit that means "none" (nvml.h, CUDA 13.4 /
/// R615). NVIDIA's reference names the macro without its value; third-party readings of the
/// CUDA 13.4 header give `UINT64_MAX` (clearing is soft 0, hard `UINT64_MAX`). The one place
/// nvdra (and its fake NVML) spells the value.
pub const MEMORY_LIMIT_MAX: u64 = u64::MAX;

/// A cgroup's limits on one GPU's memory, in bytes (NVIDIA's MPS v3 memory partitioning, set
/// and read through NVML): below `soft` the memory is guaranteed; past it the cgroup "borrows"
/// and MPS may evict it under contention; past `hard` an allocation fails with out-of-memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryLimits {
    pub soft: u64,
    pub hard: u64,
}

impl MemoryLimits {
    /// No limit (NVML's documented "clear": soft 0, hard [`MEMORY_LIMIT_MAX`]).
    pub const NONE: Self = Self {
        soft: 0,
        hard: MEMORY_LIMIT_MAX,
    };

    /// `bytes` guaranteed and no more: a share that does not burst.
    pub fn fixed(bytes: u64) -> Self {
        Self {
            soft: bytes,
            hard: bytes,
        }
    }
}

impl std::fmt::Display for MemoryLimits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let hard = match self.hard {
            MEMORY_LIMIT_MAX => "max".to_string(),
            n => n.to_string(),
        };
        write!(f, "soft {} hard {hard}", self.soft)
    }
}

/// The hardware side: the node's inventory, its live readings and health. Only the inventory
/// owner ([`owner`](super::owner)) calls it: consumers read its publication, and what the
/// hardware is asked beyond a read (live readings, recovery probes) goes through its handle.
/// Implementations block (NVML is synchronous).
pub trait DeviceBackend: Send + Sync + 'static {
    /// A short name for logs (`nvml`, `simulated`).
    fn name(&self) -> &'static str;
    /// The inventory, read from the hardware now.
    fn snapshot(&self) -> Result<Inventory>;

    /// Starts the backend's own source of health events (NVML: an event set waited on by a
    /// thread of its own), which sends each event to `sink` until `sink` is closed.
    /// `None` when the backend has none (simulated GPUs get faults from the fault file).
    fn start_health_events(
        &self,
        sink: Box<dyn super::events::EventSink>,
    ) -> Option<std::io::Result<super::events::EventThread>> {
        let _ = sink;
        None
    }

    /// Whether `gpu` answers again (the health monitor's recovery probe); `Err` says why not.
    /// By default: a fresh inventory lists it and does not withdraw it.
    fn probe(&self, gpu: &GpuUuid) -> std::result::Result<(), String> {
        let inv = self
            .snapshot()
            .map_err(|e| crate::report::chain(&e).to_string())?;
        match inv.gpu_by_uuid(gpu.as_str()) {
            Some(g) if !g.health.is_withdrawn() => Ok(()),
            Some(g) => Err(g.health.to_string()),
            None => Err("the GPU is no longer listed".into()),
        }
    }

    /// Each GPU's live readings ([`GpuUsage`]), read from the hardware now (never cached): for
    /// a `/metrics` scrape, never on the prepare path. Read-only.
    fn usage(&self) -> Result<Vec<GpuUsage>> {
        Err(Error::Unsupported {
            backend: self.name(),
            operation: "reading GPU usage",
        })
    }
}

/// A backend of both sides (NVML, simulated), as it is opened: `nvdra run` hands its hardware
/// side to the inventory owner and its write side to the DRA plugin's write handle.
pub trait Backend: DeviceBackend + Reconfigure {}

impl<T: DeviceBackend + Reconfigure> Backend for T {}

/// The write side: the few reconfigurations prepare makes (MIG devices and modes, time slices,
/// compute modes) and the driver state they decide on. Only the DRA plugin holds it, through
/// the owner's write handle ([`owner::Writes`](super::owner::Writes)), which asks the owner
/// for a read after each change. Implementations block.
pub trait Reconfigure: Send + Sync + 'static {
    /// Why this backend cannot do `what` on this node, or `None` when it can. Checked at start-up,
    /// so that nothing is published that prepare would refuse.
    fn unavailable(&self, what: Reconfiguration) -> Option<String>;

    /// Sets the compute time slice of a whole GPU.
    fn set_time_slice(&self, gpu: &GpuUuid, interval: TimeSlice) -> Result<()>;

    /// The compute mode of a whole GPU.
    fn compute_mode(&self, gpu: &GpuUuid) -> Result<ComputeMode>;

    /// Sets the compute mode of a whole GPU (needs root on real hardware).
    fn set_compute_mode(&self, gpu: &GpuUuid, mode: ComputeMode) -> Result<()>;

    /// The limits `cgroup` (a cgroup v2 directory, as this process sees it) has on `gpu`'s
    /// memory, read with `nvmlDeviceGetMemoryLimits_v1`: an answer means the driver partitions
    /// the GPU's memory per cgroup (MPS v3 memory partitioning); an error says why it does not,
    /// or cannot tell (a driver older than R615, a MIG device, the call refused).
    fn memory_limits(&self, gpu: &GpuUuid, cgroup: &Path) -> Result<MemoryLimits>;

    /// Creates a MIG device (GPU instance plus one compute instance spanning it) of the GPU-instance
    /// profile `gi_profile_id` at `placement`, and returns it.
    fn create_mig(
        &self,
        gpu: &GpuUuid,
        gi_profile_id: u32,
        placement: Placement,
    ) -> Result<MigDevice>;

    /// Destroys a MIG device created by [`Reconfigure::create_mig`]. Destroying one that no
    /// longer exists succeeds, so rollbacks can repeat it.
    fn destroy_mig(&self, gpu: &GpuUuid, mig: &MigUuid) -> Result<()>;

    /// Turns a whole GPU's MIG mode on or off, as dynamic MIG does at a GPU's first MIG claim
    /// and after its last. Turning it on leaves no MIG devices; turning it off is refused while
    /// any exist ([`Error::MigDevicesExist`]). [`Error::InUse`] (processes run on the GPU) is
    /// retriable; [`Error::ResetRequired`] (the change waits for a GPU reset, as on Ampere) is
    /// not. Callers check [`Gpu::mig_toggle`](super::Gpu::mig_toggle) first; the backend does
    /// what the hardware does.
    fn set_mig_mode(&self, gpu: &GpuUuid, enabled: bool) -> Result<MigModeChange>;
}
