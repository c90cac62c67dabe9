//! Live readings ([`GpuUsage`]) through nvml-wrapper: memory (`nvmlDeviceGetMemoryInfo_v2`),
//! utilization (`nvmlDeviceGetUtilizationRates`), power (`nvmlDeviceGetPowerUsage`), temperature
//! (`nvmlDeviceGetTemperature`) and compute processes (`nvmlDeviceGetComputeRunningProcesses_v3`).
//! Read-only; called for a scrape, never on the prepare path.
//!
//! A GPU whose UUID or memory cannot be read is left out (logged at debug: a scrape every few
//! seconds must not flood the log); any other reading it does not give is `None`.

use nvml_wrapper::enum_wrappers::device::TemperatureSensor;
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::struct_wrappers::device::ProcessInfo;
use nvml_wrapper::{Device, Nvml};

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
            let processes = compute_processes(&d)
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

/// How many times the compute processes are asked for in all while NVML answers
/// `INSUFFICIENT_SIZE`.
const PROCESS_TRIES: usize = 4;

/// `nvmlDeviceGetComputeRunningProcesses_v3` through nvml-wrapper, which asks NVML for the
/// count and reads with room for five more; when more than that started in between, NVML
/// answers `INSUFFICIENT_SIZE` and it is asked again (a count and a read each time), at most
/// [`PROCESS_TRIES`] times in all.
pub(super) fn compute_processes(d: &Device<'_>) -> Result<Vec<ProcessInfo>, NvmlError> {
    retry_insufficient(PROCESS_TRIES, || d.running_compute_processes())
}

/// `read`, again while it fails with `InsufficientSize`, at most `tries` times in all.
fn retry_insufficient<T>(
    tries: usize,
    mut read: impl FnMut() -> Result<T, NvmlError>,
) -> Result<T, NvmlError> {
    let mut last = read();
    for _ in 1..tries {
        match last {
            Err(NvmlError::InsufficientSize(_)) => last = read(),
            _ => break,
        }
    }
    last
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_list_that_outgrew_its_buffer_is_read_again_a_bounded_number_of_times() {
        // Grew once between the count and the read: the second try reads it.
        let mut calls = 0;
        let r = retry_insufficient(PROCESS_TRIES, || {
            calls += 1;
            if calls == 1 {
                Err(NvmlError::InsufficientSize(None))
            } else {
                Ok(calls)
            }
        });
        assert_eq!(r.unwrap(), 2);
        // Growing for ever: given up after PROCESS_TRIES calls.
        let mut calls = 0;
        let r: Result<(), _> = retry_insufficient(PROCESS_TRIES, || {
            calls += 1;
            Err(NvmlError::InsufficientSize(None))
        });
        assert!(matches!(r, Err(NvmlError::InsufficientSize(_))), "{r:?}");
        assert_eq!(calls, PROCESS_TRIES);
        // Another error is not retried.
        let mut calls = 0;
        let r: Result<(), _> = retry_insufficient(PROCESS_TRIES, || {
            calls += 1;
            Err(NvmlError::NotSupported)
        });
        assert!(matches!(r, Err(NvmlError::NotSupported)), "{r:?}");
        assert_eq!(calls, 1);
    }
}
