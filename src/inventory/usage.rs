//! What a GPU is doing right now — memory in use, utilization, power, temperature and the
//! processes on it — read from the hardware on demand (a `/metrics` scrape), never on the prepare
//! path. Plain owned values, like the rest of the inventory.

use super::GpuUuid;

/// One GPU's live readings. A reading the hardware does not offer (power on some boards, the
/// temperature of a GPU in a VM) is `None` and exported as no sample, never as zero.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuUsage {
    pub gpu: GpuUuid,
    pub memory_used_bytes: u64,
    pub memory_total_bytes: u64,
    /// Percent of the last sample period a kernel ran (NVML `utilization.gpu`).
    pub utilization_percent: Option<u32>,
    /// Percent of the last sample period device memory was read or written.
    pub memory_utilization_percent: Option<u32>,
    pub power_milliwatts: Option<u32>,
    pub temperature_celsius: Option<u32>,
    /// The compute processes on the GPU (on its MIG devices included).
    pub processes: Vec<ProcessUsage>,
}

/// A process using a GPU, as the driver reports it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct ProcessUsage {
    /// The PID in the host's PID namespace (what NVML reports).
    pub pid: u32,
    /// Device memory the process uses; `None` where the driver does not say (NVML's "not
    /// available" value, e.g. without permission under some hypervisors).
    pub used_memory_bytes: Option<u64>,
    /// The GPU instance (MIG device) the process runs in, when it runs in one: NVML reports
    /// the instance's id, which [`super::MigDevice::gi_id`] matches.
    pub gpu_instance: Option<u32>,
}
