//! Live readings ([`GpuUsage`]) through nvml-wrapper: memory (`nvmlDeviceGetMemoryInfo_v2`),
//! utilization (`nvmlDeviceGetUtilizationRates`), power (`nvmlDeviceGetPowerUsage`), temperature
//! (`nvmlDeviceGetTemperature`) and compute processes (`nvmlDeviceGetComputeRunningProcesses_v3`).
//! Read-only; called for a scrape, never on the prepare path.
//!
//! A GPU whose UUID or memory cannot be read is left out (logged at debug: a scrape every few
//! seconds must not flood the log); any other reading it does not give is `None`.

use nvml_wrapper::Nvml;
use nvml_wrapper::enum_wrappers::device::TemperatureSensor;
use nvml_wrapper::enums::device::UsedGpuMemory;

use crate::inventory::{Error, GpuUsage, GpuUuid, ProcessUsage, Result};

/// Every GPU's readings. Fails only when NVML cannot count the GPUs.
pub fn read_usage(nvml: &Nvml) -> Result<Vec<GpuUsage>> {
    let count = nvml.device_count().map_err(|e| Error::Nvml {
        call: "nvmlDeviceGetCount".into(),
        reason: e.to_string(),
    })?;
    let mut out = Vec::new();
    for index in 0..count {
        let read = || -> std::result::Result<GpuUsage, nvml_wrapper::error::NvmlError> {
            let d = nvml.device_by_index(index)?;
            let gpu = GpuUuid(d.uuid()?);
            let memory = d.memory_info()?;
            let utilization = d.utilization_rates().ok();
            let processes = d
                .running_compute_processes()
                .unwrap_or_default()
                .into_iter()
                .map(|p| ProcessUsage {
                    pid: p.pid,
                    used_memory_bytes: match p.used_gpu_memory {
                        UsedGpuMemory::Used(b) => Some(b),
                        UsedGpuMemory::Unavailable => None,
                    },
                    gpu_instance: p.gpu_instance_id,
                })
                .collect();
            Ok(GpuUsage {
                gpu,
                memory_used_bytes: memory.used,
                memory_total_bytes: memory.total,
                utilization_percent: utilization.as_ref().map(|u| u.gpu),
                memory_utilization_percent: utilization.as_ref().map(|u| u.memory),
                power_milliwatts: d.power_usage().ok(),
                temperature_celsius: d.temperature(TemperatureSensor::Gpu).ok(),
                processes,
            })
        };
        match read() {
            Ok(u) => out.push(u),
            Err(e) => tracing::debug!(gpu.index = index, error = %e, "no readings for this GPU"),
        }
    }
    Ok(out)
}
