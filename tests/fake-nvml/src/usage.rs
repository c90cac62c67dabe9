//! Live readings of the fake GPUs: stable functions of the GPU's index ([`readings`]), so a
//! test computes what `/metrics` must show from the same function the library answers with.
//!
//! Exports `nvmlDeviceGetUtilizationRates`, `nvmlDeviceGetPowerUsage`,
//! `nvmlDeviceGetTemperature` and `nvmlDeviceGetComputeRunningProcesses_v3`; the memory in use
//! that `nvmlDeviceGetMemoryInfo_v2` answers is the processes' sum.

use std::os::raw::c_uint;

use nvml_wrapper_sys::bindings::*;

use super::model::Gpu;
use super::{INSUFFICIENT_SIZE, INVALID, NOT_SUPPORTED, SUCCESS, gpu, put, with};

/// NVML's "no GPU instance" in `nvmlProcessInfo_t`.
pub const NO_INSTANCE: c_uint = 0xFFFF_FFFF;

/// A process on a fake GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Process {
    pub pid: c_uint,
    pub used_bytes: u64,
    /// The GPU-instance id it runs in, or [`NO_INSTANCE`].
    pub gpu_instance: c_uint,
}

/// What GPU `index` reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Readings {
    pub utilization_gpu: c_uint,
    pub utilization_memory: c_uint,
    pub power_milliwatts: c_uint,
    pub temperature_celsius: c_uint,
    pub processes: Vec<Process>,
}

impl Readings {
    /// Device memory in use: the processes' sum.
    pub fn memory_used(&self) -> u64 {
        self.processes.iter().map(|p| p.used_bytes).sum()
    }
}

/// GPU `index`'s readings: utilization `20 + 7 * index` percent (memory: `10 + index`), power
/// `150 + index` W, temperature `50 + index` °C, and one process, PID `4000 + index`, using
/// `(index + 1) * 256` MiB — in the GPU's first GPU instance when it has one — unless a test
/// made the GPU idle (`fake_nvml_set_idle`).
pub fn readings(index: usize, gpu: &Gpu) -> Readings {
    let i = index as c_uint;
    Readings {
        utilization_gpu: 20 + 7 * i,
        utilization_memory: 10 + i,
        power_milliwatts: (150 + i) * 1000,
        temperature_celsius: 50 + i,
        processes: if gpu.idle {
            Vec::new()
        } else {
            vec![Process {
                pid: 4000 + i,
                used_bytes: (u64::from(i) + 1) * (256 << 20),
                gpu_instance: gpu.instances.first().map_or(NO_INSTANCE, |gi| gi.id),
            }]
        },
    }
}

/// `f` with GPU `d`'s index and readings.
fn with_readings(d: nvmlDevice_t, f: impl FnOnce(Readings) -> nvmlReturn_t) -> nvmlReturn_t {
    with(|m| {
        let Some(g) = gpu(m, d) else { return INVALID };
        let index = m.gpus.iter().position(|x| std::ptr::eq(x, g)).unwrap_or(0);
        f(readings(index, g))
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetUtilizationRates(
    d: nvmlDevice_t,
    v: *mut nvmlUtilization_t,
) -> nvmlReturn_t {
    with_readings(d, |r| unsafe {
        put(
            v,
            nvmlUtilization_t {
                gpu: r.utilization_gpu,
                memory: r.utilization_memory,
            },
        )
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPowerUsage(d: nvmlDevice_t, v: *mut c_uint) -> nvmlReturn_t {
    with_readings(d, |r| unsafe { put(v, r.power_milliwatts) })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetTemperature(
    d: nvmlDevice_t,
    sensor: nvmlTemperatureSensors_t,
    v: *mut c_uint,
) -> nvmlReturn_t {
    if sensor != nvmlTemperatureSensors_enum_NVML_TEMPERATURE_GPU {
        return NOT_SUPPORTED;
    }
    with_readings(d, |r| unsafe { put(v, r.temperature_celsius) })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses_v3(
    d: nvmlDevice_t,
    count: *mut c_uint,
    infos: *mut nvmlProcessInfo_t,
) -> nvmlReturn_t {
    if count.is_null() {
        return INVALID;
    }
    with_readings(d, |r| {
        let n = r.processes.len();
        // SAFETY: `count` is non-null and valid for reads and writes per nvml.h.
        let room = unsafe { *count } as usize;
        unsafe { *count = n as c_uint };
        if n == 0 {
            return SUCCESS;
        }
        if infos.is_null() || room < n {
            return INSUFFICIENT_SIZE;
        }
        for (k, p) in r.processes.iter().enumerate() {
            let info = nvmlProcessInfo_t {
                pid: p.pid,
                usedGpuMemory: p.used_bytes,
                gpuInstanceId: p.gpu_instance,
                computeInstanceId: if p.gpu_instance == NO_INSTANCE {
                    NO_INSTANCE
                } else {
                    0
                },
            };
            // SAFETY: `infos` holds `room >= n` elements per nvml.h.
            unsafe { infos.add(k).write(info) };
        }
        SUCCESS
    })
}
