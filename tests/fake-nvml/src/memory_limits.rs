//! Per-cgroup memory limits (MPS v3 memory partitioning, R615 / CUDA 13.4), as NVML's C API
//! documents them:
//!
//! - `nvmlDeviceSetMemoryLimits_v1(device, nvmlSetMemoryLimits_v1_t *limits)` sets a cgroup's
//!   soft and hard limit on the GPU's memory, in bytes; the cgroup is named by `nameSpace`, the
//!   full path of its directory under `/sys/fs/cgroup`. Soft 0 and hard
//!   `NVML_DEVICE_MEMORY_LIMIT_MAX` clear them. Requires root.
//! - `nvmlDeviceGetMemoryLimits_v1(device, nvmlGetMemoryLimits_v1_t *limits)` reads them back,
//!   with the memory the cgroup uses: soft 0 and hard `NVML_DEVICE_MEMORY_LIMIT_MAX` when none
//!   is set.
//! - MIG handles are not supported (the fake answers `NVML_ERROR_NOT_SUPPORTED`).
//!
//! The fake keeps the limits per (GPU, `nameSpace`) in the model, and so in the
//! `FAKE_NVML_STATE` file ([`crate::state`]): the hook that sets them is a process of its own,
//! and the test reads what it set from the file. A `nameSpace` that is not an existing directory
//! is `NVML_ERROR_NOT_FOUND`; null pointers and a soft limit above the hard one are
//! `NVML_ERROR_INVALID_ARGUMENT`.
//!
//! `FAKE_NVML_MEMORY_LIMITS`, read at every call, makes the driver behave otherwise:
//!
//! | value | both calls | set |
//! |---|---|---|
//! | unset or empty | answer | sets |
//! | `missing` | `NVML_ERROR_FUNCTION_NOT_FOUND`, as a library older than R615 | — |
//! | `unsupported` | `NVML_ERROR_NOT_SUPPORTED`, as a driver without partitioning | — |
//! | `fail` | get answers | `NVML_ERROR_NO_PERMISSION`, as without root |
//! | `ignore` | get answers | `NVML_SUCCESS` without setting anything (a read-back catches it) |

use std::ffi::{CStr, c_char, c_ulonglong};

use nvml_wrapper_sys::bindings::*;

use super::{Dev, INVALID, NOT_FOUND, NOT_SUPPORTED, SUCCESS, changing, device, with};

const FUNCTION_NOT_FOUND: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_FUNCTION_NOT_FOUND;
const NO_PERMISSION: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_NO_PERMISSION;
const UNKNOWN: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_UNKNOWN;

/// `NVML_DEVICE_MEMORY_LIMIT_MAX`, as nvdra spells it.
pub const LIMIT_MAX: u64 = nvdra::inventory::MEMORY_LIMIT_MAX;

/// `nvmlSetMemoryLimits_v1_t`.
#[repr(C)]
pub struct SetMemoryLimitsV1 {
    pub name_space: *const c_char,
    pub soft_limit: c_ulonglong,
    pub hard_limit: c_ulonglong,
}

/// `nvmlGetMemoryLimits_v1_t`.
#[repr(C)]
pub struct GetMemoryLimitsV1 {
    pub name_space: *const c_char,
    pub soft_limit: c_ulonglong,
    pub hard_limit: c_ulonglong,
    pub current_used: c_ulonglong,
}

/// How the driver answers (`FAKE_NVML_MEMORY_LIMITS`).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Driver {
    Works,
    Missing,
    Unsupported,
    Fail,
    Ignore,
}

fn driver() -> Option<Driver> {
    match std::env::var("FAKE_NVML_MEMORY_LIMITS").as_deref() {
        Err(_) | Ok("") => Some(Driver::Works),
        Ok("missing") => Some(Driver::Missing),
        Ok("unsupported") => Some(Driver::Unsupported),
        Ok("fail") => Some(Driver::Fail),
        Ok("ignore") => Some(Driver::Ignore),
        Ok(other) => {
            eprintln!("fake-nvml: unknown FAKE_NVML_MEMORY_LIMITS {other:?}");
            None
        }
    }
}

/// The GPU index of `d` and the cgroup `ns` names, or the code NVML answers instead.
fn target(
    m: &crate::model::Model,
    d: nvmlDevice_t,
    ns: *const c_char,
) -> Result<(usize, String), nvmlReturn_t> {
    let g = match device(m, d) {
        Some(Dev::Gpu(g)) => g,
        // "MIG handles are not supported."
        Some(Dev::Mig(..)) => return Err(NOT_SUPPORTED),
        None => return Err(INVALID),
    };
    if ns.is_null() {
        return Err(INVALID);
    }
    // SAFETY: a NUL-terminated string (nvml.h: the cgroup's path).
    let ns = unsafe { CStr::from_ptr(ns) }.to_string_lossy().into_owned();
    let path = std::path::Path::new(&ns);
    if !path.is_absolute() || !path.is_dir() {
        return Err(NOT_FOUND);
    }
    Ok((g, ns))
}

/// The calls' common refusals: the driver's setting, then the arguments.
fn refused(driver: Option<Driver>) -> Option<nvmlReturn_t> {
    match driver? {
        Driver::Missing => Some(FUNCTION_NOT_FOUND),
        Driver::Unsupported => Some(NOT_SUPPORTED),
        Driver::Works | Driver::Fail | Driver::Ignore => None,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceSetMemoryLimits_v1(
    d: nvmlDevice_t,
    limits: *mut SetMemoryLimitsV1,
) -> nvmlReturn_t {
    let driver = driver();
    if driver.is_none() {
        return UNKNOWN;
    }
    if let Some(code) = refused(driver) {
        return code;
    }
    if limits.is_null() {
        return INVALID;
    }
    // SAFETY: non-null and valid for reads (nvml.h).
    let (ns, soft, hard) = unsafe {
        (
            (*limits).name_space,
            (*limits).soft_limit,
            (*limits).hard_limit,
        )
    };
    changing(|m| {
        let (g, ns) = match target(m, d, ns) {
            Ok(t) => t,
            Err(code) => return code,
        };
        if soft > hard {
            return INVALID;
        }
        match driver {
            Some(Driver::Fail) => return NO_PERMISSION,
            Some(Driver::Ignore) => return SUCCESS,
            _ => {}
        }
        if soft == 0 && hard == LIMIT_MAX {
            m.memory_limits.remove(&(g, ns));
        } else {
            m.memory_limits.insert((g, ns), (soft, hard));
        }
        SUCCESS
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryLimits_v1(
    d: nvmlDevice_t,
    limits: *mut GetMemoryLimitsV1,
) -> nvmlReturn_t {
    let driver = driver();
    if driver.is_none() {
        return UNKNOWN;
    }
    if let Some(code) = refused(driver) {
        return code;
    }
    if limits.is_null() {
        return INVALID;
    }
    // SAFETY: non-null and valid for reads and writes (nvml.h).
    let ns = unsafe { (*limits).name_space };
    with(|m| {
        let key = match target(m, d, ns) {
            Ok(t) => t,
            Err(code) => return code,
        };
        let (soft, hard) = m.memory_limits.get(&key).copied().unwrap_or((0, LIMIT_MAX));
        // SAFETY: as above; only the out-fields are written.
        unsafe {
            (*limits).soft_limit = soft;
            (*limits).hard_limit = hard;
            (*limits).current_used = 0;
        }
        SUCCESS
    })
}
