//! MIG mode changes and the virtualization mode, as NVML's C API documents them, and the test
//! hooks that set what a change depends on.
//!
//! `nvmlDeviceSetMigMode(device, mode, activationStatus)` (nvml.h): for Ampere or newer; the
//! call records `mode` as the *pending* mode and returns `NVML_SUCCESS` (or an error such as
//! `NVML_ERROR_NOT_SUPPORTED` for a GPU without MIG), then tries to activate it and writes how
//! that went to `*activationStatus`: `NVML_SUCCESS` when current and pending now agree;
//! `NVML_ERROR_IN_USE` when "device unbind fails because the device isn't idle" (the caller
//! idles it and retries); `NVML_ERROR_RESET_REQUIRED` where a reset is needed to apply it. The
//! fake activates at once from Hopper (compute capability 9.0) on, answers RESET_REQUIRED
//! before, and IN_USE while the GPU's process ([`crate::usage::readings`]) runs or, to turn MIG
//! mode off, while GPU instances exist. A vGPU guest cannot change it: NOT_SUPPORTED.

use std::os::raw::{c_int, c_uint};
use std::time::Duration;

use nvml_wrapper_sys::bindings::*;

use super::{Dev, INVALID, NOT_SUPPORTED, SUCCESS, changing, device, gpu, gpu_count, put, with};

const RESET_REQUIRED: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_RESET_REQUIRED;
const IN_USE: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_IN_USE;
const VGPU_GUEST: nvmlGpuVirtualizationMode_t =
    nvmlGpuVirtualizationMode_NVML_GPU_VIRTUALIZATION_MODE_VGPU;

/// `FAKE_NVML_MIG_TOGGLE_DELAY_MS`: how long an applied change takes (unset: none).
pub(crate) fn toggle_delay() -> Result<Duration, String> {
    match std::env::var("FAKE_NVML_MIG_TOGGLE_DELAY_MS") {
        Err(_) => Ok(Duration::ZERO),
        Ok(v) if v.is_empty() => Ok(Duration::ZERO),
        Ok(v) => v.parse().map(Duration::from_millis).map_err(|_| {
            format!("FAKE_NVML_MIG_TOGGLE_DELAY_MS={v:?} is not a number of milliseconds")
        }),
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetVirtualizationMode(
    d: nvmlDevice_t,
    mode: *mut nvmlGpuVirtualizationMode_t,
) -> nvmlReturn_t {
    with(|m| {
        let Some(g) = gpu(m, d) else { return INVALID };
        match g.virtualization {
            Some(v) => unsafe { put(mode, v) },
            None => NOT_SUPPORTED,
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceSetMigMode(
    d: nvmlDevice_t,
    mode: c_uint,
    activation_status: *mut nvmlReturn_t,
) -> nvmlReturn_t {
    if activation_status.is_null()
        || (mode != NVML_DEVICE_MIG_ENABLE && mode != NVML_DEVICE_MIG_DISABLE)
    {
        return INVALID;
    }
    // The state file keeps the mode, as the GPU does across processes.
    changing(|m| {
        let Some(Dev::Gpu(i)) = device(m, d) else {
            return INVALID;
        };
        let delay = m.mig_toggle_delay;
        let g = &mut m.gpus[i];
        let Some((current, _)) = g.mig_mode else {
            return NOT_SUPPORTED;
        };
        if g.virtualization == Some(VGPU_GUEST) {
            return NOT_SUPPORTED;
        }
        g.mig_mode = Some((current, mode));
        let status = if mode == current {
            SUCCESS
        } else if !g.idle || (mode == NVML_DEVICE_MIG_DISABLE && !g.instances.is_empty()) {
            IN_USE
        } else if g.cc.0 < 9 {
            RESET_REQUIRED
        } else {
            // The node stays locked meanwhile: NVML serializes calls on one GPU too.
            std::thread::sleep(delay);
            g.mig_mode = Some((mode, mode));
            SUCCESS
        };
        unsafe { put(activation_status, status) }
    })
}

/// Test hook: GPU `gpu_index`'s process exits (`idle` non-zero) or runs again.
#[unsafe(no_mangle)]
pub extern "C" fn fake_nvml_set_idle(gpu_index: c_uint, idle: c_int) -> nvmlReturn_t {
    set(gpu_index, |g| g.idle = idle != 0)
}

/// Test hook: `nvmlDeviceGetVirtualizationMode` answers `mode` for GPU `gpu_index`.
#[unsafe(no_mangle)]
pub extern "C" fn fake_nvml_set_virtualization(
    gpu_index: c_uint,
    mode: nvmlGpuVirtualizationMode_t,
) -> nvmlReturn_t {
    set(gpu_index, |g| g.virtualization = Some(mode))
}

fn set(gpu_index: c_uint, f: impl FnOnce(&mut crate::model::Gpu)) -> nvmlReturn_t {
    let index = gpu_index as usize;
    if index >= gpu_count() {
        return INVALID;
    }
    with(|m| {
        f(&mut m.gpus[index]);
        SUCCESS
    })
}
