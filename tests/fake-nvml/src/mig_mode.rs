//! MIG mode changes and the virtualization mode, as NVML's C API documents them, and the test
//! hooks that set what a change depends on.
//!
//! `nvmlDeviceSetMigMode(device, mode, activationStatus)` (nvml.h): for Ampere or newer; the
//! call records `mode` as the *pending* mode and returns `NVML_SUCCESS` (or an error such as
//! `NVML_ERROR_NOT_SUPPORTED` for a GPU without MIG), then tries to activate it and writes how
//! that went to `*activationStatus`: `NVML_SUCCESS` when current and pending now agree;
//! `NVML_ERROR_IN_USE` when "device unbind fails because the device isn't idle" (the caller
//! idles it and retries); `NVML_ERROR_RESET_REQUIRED` where a reset is needed to apply it. What
//! is not activated stays pending: asking for the current mode withdraws it, asking again for
//! the pending one tries again. "The attributes associated with the device, such as minor
//! number, might change" across an applied change.
//!
//! The fake answers, in order: IN_USE while the GPU is held — its process
//! ([`crate::usage::readings`]) runs, or, to turn MIG mode off, GPU instances exist, or another
//! process holds its device file (below) — then RESET_REQUIRED before Hopper (compute capability
//! 9.0) and on a Hopper made to (`FAKE_NVML_RESET_REQUIRED`, [`fake_nvml_set_reset_required`]:
//! some hypervisors' passthrough GPUs), and otherwise applies the change at once, taking
//! `FAKE_NVML_MIG_TOGGLE_DELAY_MS`. A vGPU guest cannot change it (NOT_SUPPORTED); a
//! passthrough VM can, as bare metal. Pending modes are kept in the state file.
//!
//! Holders, as the driver sees them: with `FAKE_NVML_DEV_DIR=<dir>`, GPU `i`'s device file is
//! `<dir>/nvidia<minor>` (created at `nvmlInit_v2` if missing, and held open by the fake itself
//! for the process that loaded it, as NVML holds `/dev/nvidia<minor>`). Any other process with
//! that file open blocks a switch unless its name (`/proc/<pid>/comm`) is
//! `nvidia-persistenced`'s, as the driver lets the persistence daemon's client be: a test starts
//! a DCGM-like `nv-hostengine`, an `nvidia-cuda-mps-server` or a persistence daemon as a real
//! process holding it.
//!
//! Minors that change: with `FAKE_NVML_MINOR_XOR=<n>`, each applied change gives the GPU the
//! minor `minor ^ n` (pick `n` above every minor, e.g. 64, so they stay unique); minors are then
//! kept in the state file.
//!
//! IN_USE as a return code: some drivers answer a GPU that is not idle with the call's own
//! return code `NVML_ERROR_IN_USE` instead of `NVML_SUCCESS` and the activation status.
//! `FAKE_NVML_IN_USE_AS_RETURN=1` (or the hook [`fake_nvml_set_in_use_as_return`]) makes the
//! fake answer so, leaving the GPU as the other form does (the change pending, for the caller to
//! withdraw).
//!
//! `FAKE_NVML_VIRTUALIZATION=none|passthrough|vgpu|host-vgpu|host-vsga` gives every GPU that
//! virtualization mode (a cloud's passthrough VM: `passthrough`), as the hook
//! [`fake_nvml_set_virtualization`] gives one GPU in-process.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::os::raw::{c_int, c_uint};
use std::path::{Path, PathBuf};
use std::time::Duration;

use nvml_wrapper_sys::bindings::*;

use super::model::Model;
use super::{Dev, INVALID, NOT_SUPPORTED, SUCCESS, changing, device, gpu, gpu_count, put, with};

const RESET_REQUIRED: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_RESET_REQUIRED;
const IN_USE: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_IN_USE;
const VGPU_GUEST: nvmlGpuVirtualizationMode_t =
    nvmlGpuVirtualizationMode_NVML_GPU_VIRTUALIZATION_MODE_VGPU;

/// What MIG mode changes depend on beyond each GPU's own state, from the environment at
/// `nvmlInit_v2` and the hooks.
#[derive(Debug, Default)]
pub struct Switching {
    /// `FAKE_NVML_DEV_DIR`, made absolute: where the GPUs' device files are.
    pub dev_dir: Option<PathBuf>,
    /// `FAKE_NVML_MINOR_XOR`: what an applied change XORs into the GPU's minor (0: nothing).
    pub minor_xor: c_uint,
    /// GPUs (by index) that answer RESET_REQUIRED whatever their architecture
    /// (`FAKE_NVML_RESET_REQUIRED`, [`fake_nvml_set_reset_required`]).
    pub reset_required: BTreeSet<usize>,
    /// `FAKE_NVML_IN_USE_AS_RETURN=1` ([`fake_nvml_set_in_use_as_return`]): IN_USE is the
    /// call's return code, not its activation status.
    pub in_use_as_return: bool,
    /// `FAKE_NVML_VIRTUALIZATION`: every GPU's virtualization mode, where set.
    pub virtualization: Option<nvmlGpuVirtualizationMode_t>,
    /// The device files the fake holds open for its process, by GPU index.
    own: BTreeMap<usize, File>,
}

/// At `nvmlInit_v2`, once the state file is read: every GPU gets `FAKE_NVML_VIRTUALIZATION`'s
/// mode, and its device file is held, at the minor the state file may have changed, as NVML
/// holds each GPU's node.
pub(crate) fn at_init(m: &mut Model) {
    for (i, g) in m.gpus.iter_mut().enumerate() {
        if let Some(v) = m.switching.virtualization {
            g.virtualization = Some(v);
        }
        m.switching.hold(i, g.minor);
    }
}

impl Switching {
    /// Reads `FAKE_NVML_DEV_DIR`, `FAKE_NVML_MINOR_XOR`, `FAKE_NVML_RESET_REQUIRED` (GPU
    /// indices, comma-separated) and `FAKE_NVML_IN_USE_AS_RETURN` (`1` or `0`).
    pub(crate) fn from_env() -> Result<Self, String> {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        let dev_dir = match var("FAKE_NVML_DEV_DIR") {
            Some(d) => Some(
                std::fs::create_dir_all(&d)
                    .and_then(|()| std::fs::canonicalize(&d))
                    .map_err(|e| format!("FAKE_NVML_DEV_DIR={d:?}: {e}"))?,
            ),
            None => None,
        };
        let minor_xor = match var("FAKE_NVML_MINOR_XOR") {
            Some(v) => v
                .parse()
                .map_err(|_| format!("FAKE_NVML_MINOR_XOR={v:?} is not a number"))?,
            None => 0,
        };
        let reset_required = match var("FAKE_NVML_RESET_REQUIRED") {
            Some(v) => v
                .split(',')
                .map(|i| i.trim().parse::<usize>())
                .collect::<Result<_, _>>()
                .map_err(|_| {
                    format!("FAKE_NVML_RESET_REQUIRED={v:?} is not a list of GPU indices")
                })?,
            None => BTreeSet::new(),
        };
        let in_use_as_return = match var("FAKE_NVML_IN_USE_AS_RETURN").as_deref() {
            None | Some("0") => false,
            Some("1") => true,
            Some(v) => {
                return Err(format!(
                    "FAKE_NVML_IN_USE_AS_RETURN={v:?} is neither 1 nor 0"
                ));
            }
        };
        let virtualization = match var("FAKE_NVML_VIRTUALIZATION").as_deref() {
            None => None,
            Some("none") => Some(nvmlGpuVirtualizationMode_NVML_GPU_VIRTUALIZATION_MODE_NONE),
            Some("passthrough") => {
                Some(nvmlGpuVirtualizationMode_NVML_GPU_VIRTUALIZATION_MODE_PASSTHROUGH)
            }
            Some("vgpu") => Some(VGPU_GUEST),
            Some("host-vgpu") => {
                Some(nvmlGpuVirtualizationMode_NVML_GPU_VIRTUALIZATION_MODE_HOST_VGPU)
            }
            Some("host-vsga") => {
                Some(nvmlGpuVirtualizationMode_NVML_GPU_VIRTUALIZATION_MODE_HOST_VSGA)
            }
            Some(v) => {
                return Err(format!(
                    "FAKE_NVML_VIRTUALIZATION={v:?} is none of none, passthrough, vgpu, \
                     host-vgpu, host-vsga"
                ));
            }
        };
        Ok(Self {
            dev_dir,
            minor_xor,
            reset_required,
            in_use_as_return,
            virtualization,
            own: BTreeMap::new(),
        })
    }

    /// The device file of the GPU with minor `minor`, where there is a device directory.
    pub fn device_file(&self, minor: c_uint) -> Option<PathBuf> {
        Some(self.dev_dir.as_ref()?.join(format!("nvidia{minor}")))
    }

    /// Holds GPU `index`'s device file open (creating it if missing), as NVML holds the node of
    /// each GPU it answers for; the file of its former minor is let go.
    pub(crate) fn hold(&mut self, index: usize, minor: c_uint) {
        let Some(path) = self.device_file(minor) else {
            return;
        };
        let file = std::fs::OpenOptions::new()
            .read(true)
            .append(true)
            .create(true)
            .open(&path);
        match file {
            Ok(f) => {
                self.own.insert(index, f);
            }
            Err(e) => eprintln!("fake-nvml: cannot open {}: {e}", path.display()),
        }
    }

    /// The other processes holding `minor`'s device file open that block a switch: every one
    /// but the persistence daemon.
    fn blocking_holders(&self, minor: c_uint) -> Vec<u32> {
        let Some(path) = self.device_file(minor) else {
            return Vec::new();
        };
        holders_of(Path::new("/proc"), &path)
            .into_iter()
            .filter(|(pid, comm)| *pid != std::process::id() && comm != PERSISTENCED_COMM)
            .map(|(pid, _)| pid)
            .collect()
    }
}

/// What the kernel keeps of `nvidia-persistenced`'s name (15 bytes).
const PERSISTENCED_COMM: &str = "nvidia-persiste";

/// (pid, comm) of each process under `proc` with `file` among its open files, found by the path
/// its fd links name: the fake's own reading, apart from nvdra's holder scan.
pub fn holders_of(proc: &Path, file: &Path) -> Vec<(u32, String)> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(proc) else {
        return out;
    };
    for e in entries.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(fds) = std::fs::read_dir(e.path().join("fd")) else {
            continue;
        };
        let holds = fds
            .flatten()
            .any(|fd| std::fs::read_link(fd.path()).is_ok_and(|t| t == file));
        if holds {
            let comm = std::fs::read_to_string(e.path().join("comm")).unwrap_or_default();
            out.push((pid, comm.trim_end().to_string()));
        }
    }
    out.sort();
    out
}

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
        let switching = &mut m.switching;
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
        } else if !g.idle
            || (mode == NVML_DEVICE_MIG_DISABLE && !g.instances.is_empty())
            || !switching.blocking_holders(g.minor).is_empty()
        {
            IN_USE
        } else if g.cc.0 < 9 || switching.reset_required.contains(&i) {
            RESET_REQUIRED
        } else {
            // The node stays locked meanwhile: NVML serializes calls on one GPU too.
            std::thread::sleep(delay);
            g.mig_mode = Some((mode, mode));
            if switching.minor_xor != 0 {
                g.minor ^= switching.minor_xor;
                switching.hold(i, g.minor);
            }
            SUCCESS
        };
        if status == IN_USE && switching.in_use_as_return {
            // The pending mode is recorded as in the other form.
            return IN_USE;
        }
        unsafe { put(activation_status, status) }
    })
}

/// Test hook: GPU `gpu_index`'s process exits (`idle` non-zero) or runs again.
#[unsafe(no_mangle)]
pub extern "C" fn fake_nvml_set_idle(gpu_index: c_uint, idle: c_int) -> nvmlReturn_t {
    set(gpu_index, |g| g.idle = idle != 0)
}

/// Test hook: GPU `gpu_index` answers a MIG mode change it could apply with RESET_REQUIRED
/// (`on` non-zero), as an Ampere does, or stops doing so.
#[unsafe(no_mangle)]
pub extern "C" fn fake_nvml_set_reset_required(gpu_index: c_uint, on: c_int) -> nvmlReturn_t {
    let index = gpu_index as usize;
    if index >= gpu_count() {
        return INVALID;
    }
    with(|m| {
        if on != 0 {
            m.switching.reset_required.insert(index);
        } else {
            m.switching.reset_required.remove(&index);
        }
        SUCCESS
    })
}

/// Test hook: `nvmlDeviceSetMigMode` answers IN_USE as its return code (`on` non-zero), as some
/// drivers do, or through its activation status, as nvml.h documents.
#[unsafe(no_mangle)]
pub extern "C" fn fake_nvml_set_in_use_as_return(on: c_int) -> nvmlReturn_t {
    with(|m| {
        m.switching.in_use_as_return = on != 0;
        SUCCESS
    })
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
