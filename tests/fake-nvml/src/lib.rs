//! A fake `libnvidia-ml.so` for testing nvdra's NVML backend on machines without a GPU.
//!
//! It exports the NVML functions the backend calls, with NVML's C signatures and return codes,
//! and answers them from one of two fixed nodes, chosen by the environment variable
//! `FAKE_NVML_NODE` when `nvmlInit_v2` runs (an unknown value makes `nvmlInit_v2` fail), or from
//! a topology: `FAKE_NVML_PROFILE=<built-in profile>` or `FAKE_NVML_TOPOLOGY=<file>`, parsed by
//! nvdra's own topology reader with the seed `FAKE_NVML_SEED` (default `fake-node`; give the
//! node name the simulated backend is given to get the same UUIDs). See [`profile`] for how a
//! topology becomes NVML answers.
//!
//! MIG instances are state: `nvmlDeviceCreateGpuInstanceWithPlacement`,
//! `nvmlGpuInstanceCreateComputeInstance` and their destroy calls change what the listing calls
//! answer. `FAKE_NVML_STATE=<file>` keeps them in a file ([`state`]) that outlives the process,
//! as a GPU outlives the daemon using it. A repeated `nvmlInit_v2` with the same environment
//! keeps the node as it is.
//!
//! Unset (or `a100-l40s`): NVSwitches at real-looking PCI addresses, no fabric support.
//!
//! | index | minor | GPU | bus | MIG | NVLink |
//! |---|---|---|---|---|---|
//! | 0 | 0 | A100-SXM4-40GB | 0000:07:00.0 | on: 3g.20gb (GI 1) at 0, empty slot, 1g.5gb (GI 7) at 6 | 12 links over 6 NVSwitches at 0000:01..06:00.0 |
//! | 1 | 1 | A100-SXM4-40GB | 0000:0f:00.0 | off | 12 links over the same switches |
//! | 2 | 5 | L40S | 0000:b1:00.0 | not supported | not supported |
//!
//! `hgx-h100-sentinel`: an HGX H100 as its driver reports it. Eight H100 80GB HBM3 (minor =
//! index, buses 0000:1a/1b/4a/4b/8a/8b/ca/cb:00.0, MIG not supported), 18 NVLinks each, every
//! link typed SWITCH with the remote PCI address `FFFFFFFF:FF:FF.0` in the numeric fields (the
//! bus-id string reads `FFFFFFFF:FF:FF.0` on GPUs 0–5, `ffffffff:ff:ff.0` on GPU 6 and is empty
//! on GPU 7). Fabric registration: GPUs 0–5 completed in cluster [`CLUSTER_UUID`], clique
//! [`CLIQUE_ID`]; GPU 6 in progress; GPU 7 not supported. `nvmlDeviceGetNumGpuCores` is not
//! supported on GPUs 6 and 7; GPU 6 answers `nvmlDeviceGetAttributes_v2` (132 SMs), GPU 7 does
//! not, so its SM count is unknowable.
//!
//! `FAKE_NVML_FABRIC_API` picks which fabric-info API the driver has: `v3` (default: the
//! versioned call takes v2 and v3 structs), `v2` (it answers ARGUMENT_VERSION_MISMATCH to v3,
//! like R550) or `v1` (it answers FUNCTION_NOT_FOUND; only `nvmlDeviceGetGpuFabricInfo`).
//!
//! `FAKE_NVML_FABRIC_FILE=<file>` overrides the fabric registrations of any node (state,
//! status, the call's return code), read again at every call: see [`fabric`](mod@fabric).
//!
//! Driver 550.163.01, CUDA 12.4. `nvmlDeviceGetNumaNodeId` is deliberately not exported, so the
//! backend's handling of a symbol missing from an older driver is exercised too.
//!
//! Health events, and the hooks tests inject them with, are in `events.rs`; live readings
//! (utilization, power, temperature, processes, memory in use) in `usage.rs`; MIG mode changes
//! (`nvmlDeviceSetMigMode`: at once from Hopper on, pending a reset before or where
//! `FAKE_NVML_RESET_REQUIRED` names the GPU; refused while a process runs or, with
//! `FAKE_NVML_DEV_DIR`, another process holds the GPU's device file; minors changed by
//! `FAKE_NVML_MINOR_XOR`; IN_USE as the call's return code with
//! `FAKE_NVML_IN_USE_AS_RETURN=1`), the virtualization mode (`FAKE_NVML_VIRTUALIZATION`) and their
//! hooks in `mig_mode.rs`. An applied MIG mode
//! change takes `FAKE_NVML_MIG_TOGGLE_DELAY_MS` milliseconds (default 0). MIG modes are kept in
//! the `FAKE_NVML_STATE` file with the instances. Per-cgroup memory limits (R615's
//! `nvmlDeviceSetMemoryLimits_v1` and `nvmlDeviceGetMemoryLimits_v1`, `FAKE_NVML_MEMORY_LIMITS`
//! to make them missing, unsupported or failing) are in `memory_limits.rs`, kept in the state
//! file too. `FAKE_NVML_IDLE=1` starts every GPU idle
//! (no process: its MIG mode can change), as `fake_nvml_set_idle` makes one in-process.
//!
//! Handles are opaque integers cast to pointers; they are never dereferenced by callers. Every
//! function's contract is the one `nvml.h` documents for it: pointer arguments must be valid for
//! writes of the pointed-to type (null is answered with `NVML_ERROR_INVALID_ARGUMENT`).

// The safety contract of every export is nvml.h's, stated once above.
#![allow(clippy::missing_safety_doc)]

pub mod fabric;
pub mod model;
pub mod profile;
pub mod state;

use std::ffi::{CStr, c_char};
use std::os::raw::{c_int, c_uint};
use std::path::PathBuf;
use std::ptr;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Mutex, MutexGuard};

use nvml_wrapper_sys::bindings::*;

use model::{CI_SLICES, ComputeInstance, Fabric, Gpu, GpuInstance, MAX_MIG_DEVICES, Model};

const SUCCESS: nvmlReturn_t = nvmlReturn_enum_NVML_SUCCESS;
const INVALID: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT;
const NOT_SUPPORTED: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED;
const NOT_FOUND: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_NOT_FOUND;
const INSUFFICIENT_SIZE: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_SIZE;
const INSUFFICIENT_RESOURCES: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_RESOURCES;
const IN_USE: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_IN_USE;
const UNINITIALIZED: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_UNINITIALIZED;
const UNKNOWN: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_UNKNOWN;
const FUNCTION_NOT_FOUND: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_FUNCTION_NOT_FOUND;
const VERSION_MISMATCH: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_ARGUMENT_VERSION_MISMATCH;

/// The fabric cluster the `hgx-h100-sentinel` GPUs 0–5 registered with.
pub const CLUSTER_UUID: [u8; 16] = [
    0x6c, 0x1f, 0x3a, 0x52, 0x8d, 0x2e, 0x4b, 0x7a, 0x9f, 0x10, 0x01, 0x23, 0x45, 0x67, 0x89, 0xab,
];
/// Their clique.
pub const CLIQUE_ID: c_uint = 32766;

/// The node, its environment key (what `nvmlInit_v2` read), and the state file.
struct Loaded {
    key: String,
    model: Model,
    state: Option<PathBuf>,
}

static NODE: Mutex<Option<Loaded>> = Mutex::new(None);
/// 3, 2 or 1: the newest fabric-info struct version the driver takes; set by `nvmlInit_v2`.
static FABRIC_API: AtomicU8 = AtomicU8::new(3);

fn node() -> MutexGuard<'static, Option<Loaded>> {
    // A panic while answering cannot leave the model half-changed in a way worse than the
    // panic; keep answering.
    NODE.lock().unwrap_or_else(|p| p.into_inner())
}

/// Runs `f` on the initialized node; `NVML_ERROR_UNINITIALIZED` before `nvmlInit_v2`.
fn with(f: impl FnOnce(&mut Model) -> nvmlReturn_t) -> nvmlReturn_t {
    match node().as_mut() {
        Some(l) => f(&mut l.model),
        None => UNINITIALIZED,
    }
}

/// As [`with`], then writes the state file: for the calls that change MIG instances.
fn changing(f: impl FnOnce(&mut Model) -> nvmlReturn_t) -> nvmlReturn_t {
    match node().as_mut() {
        Some(l) => {
            let r = f(&mut l.model);
            if r == SUCCESS
                && let Some(path) = &l.state
            {
                state::save(path, &l.model);
            }
            r
        }
        None => UNINITIALIZED,
    }
}

// Health events and their test hooks (`events.rs`) see the GPUs only through these four.
mod events;
// Live readings (`usage.rs`): utilization, power, temperature, processes.
pub mod usage;
// MIG mode changes, holders and virtualization (`mig_mode.rs`).
pub mod mig_mode;
// Per-cgroup memory limits (`memory_limits.rs`).
pub mod memory_limits;

fn gpu_count() -> usize {
    node().as_ref().map_or(0, |l| l.model.gpus.len())
}

fn gpu_index_of(d: nvmlDevice_t) -> Option<usize> {
    match device(&node().as_ref()?.model, d)? {
        Dev::Gpu(g) => Some(g),
        Dev::Mig(..) => None,
    }
}

/// Whether GPU `g` is in MIG mode with GPU instance `gi` (and, unless it is `u32::MAX`, compute
/// instance `ci` in it): what the driver can attribute an XID to.
fn has_instance(g: usize, gi: c_uint, ci: c_uint) -> bool {
    let node = node();
    let Some(gpu) = node.as_ref().and_then(|l| l.model.gpus.get(g)) else {
        return false;
    };
    let in_mig = gpu
        .mig_mode
        .is_some_and(|(current, _)| current == NVML_DEVICE_MIG_ENABLE);
    in_mig
        && gpu
            .instance(gi)
            .is_some_and(|i| ci == c_uint::MAX || i.compute.iter().any(|c| c.id == ci))
}

// ------------------------------------------------------------------------------------------------
// Handles
// ------------------------------------------------------------------------------------------------

const GPU_BASE: usize = 0x1000;
const MIG_BASE: usize = 0x2000;
const GI_BASE: usize = 0x3000;
const CI_BASE: usize = 0x10_0000;

fn handle<T>(n: usize) -> *mut T {
    ptr::without_provenance_mut(n)
}

enum Dev {
    Gpu(usize),
    /// GPU index and MIG handle slot.
    Mig(usize, c_uint),
}

fn device(m: &Model, d: nvmlDevice_t) -> Option<Dev> {
    let n = d.addr();
    if (GPU_BASE..GPU_BASE + m.gpus.len()).contains(&n) {
        return Some(Dev::Gpu(n - GPU_BASE));
    }
    if !(MIG_BASE..GI_BASE).contains(&n) {
        return None;
    }
    let (g, slot) = ((n - MIG_BASE) / 0x100, ((n - MIG_BASE) % 0x100) as c_uint);
    m.gpus.get(g)?.mig_at(slot)?;
    Some(Dev::Mig(g, slot))
}

fn gpu(m: &Model, d: nvmlDevice_t) -> Option<&Gpu> {
    match device(m, d)? {
        Dev::Gpu(g) => m.gpus.get(g),
        Dev::Mig(..) => None,
    }
}

fn gpu_handle(g: usize) -> nvmlDevice_t {
    handle(GPU_BASE + g)
}

fn gi_handle(g: usize, gi: c_uint) -> nvmlGpuInstance_t {
    handle(GI_BASE + g * 0x100 + gi as usize)
}

/// (GPU index, GPU-instance id) of a live GPU-instance handle.
fn gi_of(m: &Model, gi: nvmlGpuInstance_t) -> Option<(usize, c_uint)> {
    let n = gi.addr().checked_sub(GI_BASE).filter(|n| *n < 0x1000)?;
    let (g, id) = (n / 0x100, (n % 0x100) as c_uint);
    m.gpus.get(g)?.instance(id)?;
    Some((g, id))
}

fn ci_handle(g: usize, gi: c_uint, ci: c_uint) -> nvmlComputeInstance_t {
    handle(CI_BASE + g * 0x1_0000 + gi as usize * 0x100 + ci as usize)
}

/// (GPU index, GPU-instance id, compute-instance id) of a live compute-instance handle.
fn ci_of(m: &Model, ci: nvmlComputeInstance_t) -> Option<(usize, c_uint, c_uint)> {
    let n = ci.addr().checked_sub(CI_BASE)?;
    let (g, gi, id) = (
        n / 0x1_0000,
        ((n / 0x100) % 0x100) as c_uint,
        (n % 0x100) as c_uint,
    );
    m.gpus
        .get(g)?
        .instance(gi)?
        .compute
        .iter()
        .find(|c| c.id == id)?;
    Some((g, gi, id))
}

// ------------------------------------------------------------------------------------------------
// Writing answers
// ------------------------------------------------------------------------------------------------

unsafe fn put<T>(p: *mut T, v: T) -> nvmlReturn_t {
    if p.is_null() {
        return INVALID;
    }
    // SAFETY: non-null, and valid for a write of `T` per the function's nvml.h contract.
    unsafe { p.write(v) };
    SUCCESS
}

unsafe fn put_str(buf: *mut c_char, len: c_uint, s: &str) -> nvmlReturn_t {
    if buf.is_null() {
        return INVALID;
    }
    if s.len() + 1 > len as usize {
        return INSUFFICIENT_SIZE;
    }
    // SAFETY: `buf` is valid for `len` bytes (nvml.h) and we write `s.len() + 1 <= len` of them.
    unsafe {
        ptr::copy_nonoverlapping(s.as_ptr().cast::<c_char>(), buf, s.len());
        buf.add(s.len()).write(0);
    }
    SUCCESS
}

/// Writes `items` into a caller's buffer of `*count` elements, NVML's way: the number written
/// (or needed) goes back into `count`.
unsafe fn put_list<T: Copy>(buf: *mut T, count: *mut c_uint, items: &[T]) -> nvmlReturn_t {
    if count.is_null() || buf.is_null() {
        return INVALID;
    }
    let n = items.len() as c_uint;
    // SAFETY: `count` is non-null and valid for reads and writes (nvml.h).
    if unsafe { *count } < n {
        unsafe { count.write(n) };
        return INSUFFICIENT_SIZE;
    }
    for (i, item) in items.iter().enumerate() {
        // SAFETY: the caller's buffer holds `*count >= n` elements.
        unsafe { buf.add(i).write(*item) };
    }
    unsafe { put(count, n) }
}

// ------------------------------------------------------------------------------------------------
// System
// ------------------------------------------------------------------------------------------------

/// Builds the node the environment names (see the crate doc).
fn load_node() -> Result<(String, Model), String> {
    let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let seed = var("FAKE_NVML_SEED").unwrap_or_else(|| "fake-node".into());
    let key = format!(
        "{:?} {:?} {:?} {seed}",
        var("FAKE_NVML_NODE"),
        var("FAKE_NVML_PROFILE"),
        var("FAKE_NVML_TOPOLOGY")
    );
    let topology = match (var("FAKE_NVML_PROFILE"), var("FAKE_NVML_TOPOLOGY")) {
        (Some(name), _) => Some(nvdra::inventory::topology::load_profile(&name, &seed)),
        (None, Some(path)) => Some(nvdra::inventory::topology::load_file(
            std::path::Path::new(&path),
            &seed,
        )),
        (None, None) => None,
    };
    let model = match topology {
        Some(inv) => profile::model(&inv.map_err(|e| e.to_string())?),
        None => {
            let gpus = match var("FAKE_NVML_NODE").as_deref() {
                None | Some("a100-l40s") => model::a100_l40s(),
                Some("hgx-h100-sentinel") => model::hgx_h100_sentinel(),
                Some(other) => return Err(format!("unknown FAKE_NVML_NODE {other:?}")),
            };
            Model {
                driver_version: "550.163.01".into(),
                cuda_version: 12040,
                gpus,
                created: 0,
                compute_modes: Default::default(),
                mig_toggle_delay: Default::default(),
                memory_limits: Default::default(),
                switching: Default::default(),
            }
        }
    };
    Ok((key, model))
}

/// Reads `FAKE_NVML_NODE`, `FAKE_NVML_PROFILE`, `FAKE_NVML_TOPOLOGY`, `FAKE_NVML_SEED`,
/// `FAKE_NVML_STATE`, `FAKE_NVML_FABRIC_API`, `FAKE_NVML_MIG_TOGGLE_DELAY_MS`, `FAKE_NVML_IDLE`
/// and those of MIG mode changes, `FAKE_NVML_DEV_DIR`, `FAKE_NVML_MINOR_XOR`,
/// `FAKE_NVML_RESET_REQUIRED`, `FAKE_NVML_IN_USE_AS_RETURN` and `FAKE_NVML_VIRTUALIZATION` (see
/// the crate doc).
#[unsafe(no_mangle)]
pub extern "C" fn nvmlInit_v2() -> nvmlReturn_t {
    let api = match std::env::var("FAKE_NVML_FABRIC_API").as_deref() {
        Err(_) | Ok("" | "v3") => 3,
        Ok("v2") => 2,
        Ok("v1") => 1,
        Ok(_) => return UNKNOWN,
    };
    let state = std::env::var_os("FAKE_NVML_STATE")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from);
    let (key, mut model) = match load_node() {
        Ok(n) => n,
        Err(e) => {
            eprintln!("fake-nvml: {e}");
            return UNKNOWN;
        }
    };
    let (delay, switching) = match mig_mode::toggle_delay()
        .and_then(|d| mig_mode::Switching::from_env().map(|s| (d, s)))
    {
        Ok(d) => d,
        Err(e) => {
            eprintln!("fake-nvml: {e}");
            return UNKNOWN;
        }
    };
    let mut loaded = node();
    if loaded
        .as_ref()
        .is_some_and(|l| l.key == key && l.state == state)
    {
        FABRIC_API.store(api, Ordering::Relaxed);
        if let Some(l) = loaded.as_mut() {
            l.model.mig_toggle_delay = delay;
        }
        return SUCCESS;
    }
    model.mig_toggle_delay = delay;
    model.switching = switching;
    if std::env::var("FAKE_NVML_IDLE").is_ok_and(|v| v == "1") {
        for g in &mut model.gpus {
            g.idle = true;
        }
    }
    if let Some(path) = &state {
        if path.exists() {
            state::load(path, &mut model);
        } else {
            // From the first init on, the file says what the GPUs hold.
            state::save(path, &model);
        }
    }
    mig_mode::at_init(&mut model);
    *loaded = Some(Loaded { key, model, state });
    FABRIC_API.store(api, Ordering::Relaxed);
    SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlShutdown() -> nvmlReturn_t {
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetDriverVersion(buf: *mut c_char, len: c_uint) -> nvmlReturn_t {
    with(|m| unsafe { put_str(buf, len, &m.driver_version) })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion_v2(v: *mut c_int) -> nvmlReturn_t {
    with(|m| unsafe { put(v, m.cuda_version) })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCount_v2(count: *mut c_uint) -> nvmlReturn_t {
    with(|m| unsafe { put(count, m.gpus.len() as c_uint) })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex_v2(
    index: c_uint,
    out: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    with(|m| {
        if index as usize >= m.gpus.len() {
            return INVALID;
        }
        unsafe { put(out, gpu_handle(index as usize)) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByUUID(
    uuid: *const c_char,
    out: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    if uuid.is_null() {
        return INVALID;
    }
    // SAFETY: a NUL-terminated string (nvml.h).
    let uuid = unsafe { CStr::from_ptr(uuid) }.to_string_lossy();
    let mut found = None;
    let r = with(|m| match m.gpus.iter().position(|g| g.uuid == uuid) {
        Some(i) => {
            found = Some(i);
            SUCCESS
        }
        None => NOT_FOUND,
    });
    match found {
        // Outside `with`: the events module's state is never locked under the node's.
        Some(i) if events::lost(i) => events::GPU_IS_LOST,
        Some(i) => unsafe { put(out, gpu_handle(i)) },
        None => r,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetIndex(d: nvmlDevice_t, v: *mut c_uint) -> nvmlReturn_t {
    with(|m| match device(m, d) {
        Some(Dev::Gpu(g)) => unsafe { put(v, g as c_uint) },
        Some(Dev::Mig(..)) => NOT_SUPPORTED,
        None => INVALID,
    })
}

// ------------------------------------------------------------------------------------------------
// Identity
// ------------------------------------------------------------------------------------------------

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetUUID(
    d: nvmlDevice_t,
    buf: *mut c_char,
    len: c_uint,
) -> nvmlReturn_t {
    with(|m| match device(m, d) {
        Some(Dev::Gpu(g)) => unsafe { put_str(buf, len, &m.gpus[g].uuid) },
        Some(Dev::Mig(g, slot)) => match m.gpus[g].mig_at(slot) {
            Some((_, ci)) => unsafe { put_str(buf, len, &ci.uuid) },
            None => INVALID,
        },
        None => INVALID,
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetName(
    d: nvmlDevice_t,
    buf: *mut c_char,
    len: c_uint,
) -> nvmlReturn_t {
    with(|m| match gpu(m, d) {
        Some(g) => unsafe { put_str(buf, len, &g.name) },
        None => INVALID,
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMinorNumber(d: nvmlDevice_t, v: *mut c_uint) -> nvmlReturn_t {
    with(|m| match gpu(m, d) {
        Some(g) => unsafe { put(v, g.minor) },
        None => INVALID,
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetBrand(
    d: nvmlDevice_t,
    v: *mut nvmlBrandType_t,
) -> nvmlReturn_t {
    with(|m| match gpu(m, d) {
        Some(g) => unsafe { put(v, g.brand) },
        None => INVALID,
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetArchitecture(
    d: nvmlDevice_t,
    v: *mut nvmlDeviceArchitecture_t,
) -> nvmlReturn_t {
    with(|m| match gpu(m, d) {
        Some(g) => unsafe { put(v, g.arch) },
        None => INVALID,
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCudaComputeCapability(
    d: nvmlDevice_t,
    major: *mut c_int,
    minor: *mut c_int,
) -> nvmlReturn_t {
    with(|m| match gpu(m, d) {
        Some(g) => unsafe {
            match put(major, g.cc.0) {
                SUCCESS => put(minor, g.cc.1),
                e => e,
            }
        },
        None => INVALID,
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(
    d: nvmlDevice_t,
    v: *mut nvmlMemory_v2_t,
) -> nvmlReturn_t {
    with(|m| {
        let Some(g) = gpu(m, d) else { return INVALID };
        let total = g.memory_bytes;
        let reserved = (583 << 20).min(total);
        let index = m.gpus.iter().position(|x| std::ptr::eq(x, g)).unwrap_or(0);
        let used = usage::readings(index, g)
            .memory_used()
            .min(total - reserved);
        let info = nvmlMemory_v2_t {
            version: (size_of::<nvmlMemory_v2_t>() | (2 << 24)) as c_uint,
            total,
            reserved,
            free: total - reserved - used,
            used,
        };
        unsafe { put(v, info) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNumGpuCores(d: nvmlDevice_t, v: *mut c_uint) -> nvmlReturn_t {
    with(|m| match gpu(m, d).map(|g| g.cores) {
        Some(Some(cores)) => unsafe { put(v, cores) },
        Some(None) => NOT_SUPPORTED,
        None => INVALID,
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPciInfo_v3(
    d: nvmlDevice_t,
    v: *mut nvmlPciInfo_t,
) -> nvmlReturn_t {
    with(|m| match gpu(m, d) {
        Some(g) => unsafe { put(v, model::pci(&g.bus)) },
        None => INVALID,
    })
}

/// Full GPUs answer NotSupported, as most drivers do, unless `attributes` is set; MIG devices
/// answer their attributes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetAttributes_v2(
    d: nvmlDevice_t,
    v: *mut nvmlDeviceAttributes_t,
) -> nvmlReturn_t {
    with(|m| match device(m, d) {
        Some(Dev::Gpu(g)) => match m.gpus[g].attributes {
            Some((sms, [ce, dec, enc, jpeg, ofa])) => {
                let attrs = nvmlDeviceAttributes_t {
                    multiprocessorCount: sms,
                    sharedCopyEngineCount: ce,
                    sharedDecoderCount: dec,
                    sharedEncoderCount: enc,
                    sharedJpegCount: jpeg,
                    sharedOfaCount: ofa,
                    gpuInstanceSliceCount: 0,
                    computeInstanceSliceCount: 0,
                    memorySizeMB: m.gpus[g].memory_bytes >> 20,
                };
                unsafe { put(v, attrs) }
            }
            None => NOT_SUPPORTED,
        },
        Some(Dev::Mig(g, slot)) => {
            let gpu = &m.gpus[g];
            let Some((gi, ci)) = gpu.mig_at(slot) else {
                return INVALID;
            };
            let p = &gpu.profiles[gi.profile];
            let [ce, dec, enc, jpeg, ofa] = p.engines;
            let attrs = nvmlDeviceAttributes_t {
                multiprocessorCount: p.sms * ci.slices / p.slices.max(1),
                sharedCopyEngineCount: ce,
                sharedDecoderCount: dec,
                sharedEncoderCount: enc,
                sharedJpegCount: jpeg,
                sharedOfaCount: ofa,
                gpuInstanceSliceCount: p.slices,
                computeInstanceSliceCount: ci.slices,
                memorySizeMB: p.mib,
            };
            unsafe { put(v, attrs) }
        }
        None => INVALID,
    })
}

// ------------------------------------------------------------------------------------------------
// MIG: reading
// ------------------------------------------------------------------------------------------------

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMigMode(
    d: nvmlDevice_t,
    current: *mut c_uint,
    pending: *mut c_uint,
) -> nvmlReturn_t {
    with(|m| {
        let Some(g) = gpu(m, d) else { return INVALID };
        let Some((c, p)) = g.mig_mode else {
            return NOT_SUPPORTED;
        };
        unsafe {
            match put(current, c) {
                SUCCESS => put(pending, p),
                e => e,
            }
        }
    })
}

// ------------------------------------------------------------------------------------------------
// Compute mode
// ------------------------------------------------------------------------------------------------

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeMode(
    d: nvmlDevice_t,
    mode: *mut nvmlComputeMode_t,
) -> nvmlReturn_t {
    with(|m| match device(m, d) {
        Some(Dev::Gpu(g)) => {
            let current = m
                .compute_modes
                .get(&g)
                .copied()
                .unwrap_or(nvmlComputeMode_enum_NVML_COMPUTEMODE_DEFAULT);
            unsafe { put(mode, current) }
        }
        _ => INVALID,
    })
}

/// Sets a GPU's compute mode (DEFAULT, EXCLUSIVE_PROCESS or PROHIBITED; EXCLUSIVE_THREAD is
/// NOT_SUPPORTED, as on current drivers), kept in the state file like MIG instances.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceSetComputeMode(
    d: nvmlDevice_t,
    mode: nvmlComputeMode_t,
) -> nvmlReturn_t {
    const DEFAULT: nvmlComputeMode_t = nvmlComputeMode_enum_NVML_COMPUTEMODE_DEFAULT;
    const ONE_CONTEXT: [nvmlComputeMode_t; 2] = [
        nvmlComputeMode_enum_NVML_COMPUTEMODE_PROHIBITED,
        nvmlComputeMode_enum_NVML_COMPUTEMODE_EXCLUSIVE_PROCESS,
    ];
    changing(|m| match device(m, d) {
        Some(Dev::Gpu(g)) if mode == DEFAULT => {
            m.compute_modes.remove(&g);
            SUCCESS
        }
        Some(Dev::Gpu(g)) if ONE_CONTEXT.contains(&mode) => {
            m.compute_modes.insert(g, mode);
            SUCCESS
        }
        Some(Dev::Gpu(_)) => NOT_SUPPORTED,
        _ => INVALID,
    })
}

/// The MIG-capable GPU behind a handle, by index.
fn mig_gpu(m: &Model, d: nvmlDevice_t) -> Result<usize, nvmlReturn_t> {
    match device(m, d) {
        Some(Dev::Gpu(g)) if m.gpus[g].mig_mode.is_some() => Ok(g),
        Some(Dev::Gpu(_)) => Err(NOT_SUPPORTED),
        _ => Err(INVALID),
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceProfileInfo(
    d: nvmlDevice_t,
    profile: c_uint,
    v: *mut nvmlGpuInstanceProfileInfo_t,
) -> nvmlReturn_t {
    with(|m| {
        let g = match mig_gpu(m, d) {
            Ok(g) => &m.gpus[g],
            Err(e) => return e,
        };
        if profile >= NVML_GPU_INSTANCE_PROFILE_COUNT {
            return INVALID;
        }
        let Some(p) = g.profiles.iter().find(|p| p.index == profile) else {
            return NOT_SUPPORTED;
        };
        let [ce, dec, enc, jpeg, ofa] = p.engines;
        let info = nvmlGpuInstanceProfileInfo_t {
            id: p.id,
            isP2pSupported: 0,
            sliceCount: p.slices,
            instanceCount: p.instances,
            multiprocessorCount: p.sms,
            copyEngineCount: ce,
            decoderCount: dec,
            encoderCount: enc,
            jpegCount: jpeg,
            ofaCount: ofa,
            memorySizeMB: p.mib,
        };
        unsafe { put(v, info) }
    })
}

/// Takes the profile's `id` (not its index), like NVML.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstancePossiblePlacements_v2(
    d: nvmlDevice_t,
    profile_id: c_uint,
    placements: *mut nvmlGpuInstancePlacement_t,
    count: *mut c_uint,
) -> nvmlReturn_t {
    with(|m| {
        let g = match mig_gpu(m, d) {
            Ok(g) => &m.gpus[g],
            Err(e) => return e,
        };
        let Some(p) = g.profiles.iter().find(|p| p.id == profile_id) else {
            return NOT_SUPPORTED;
        };
        if count.is_null() {
            return INVALID;
        }
        if placements.is_null() {
            return unsafe { put(count, p.starts.len() as c_uint) };
        }
        let all: Vec<nvmlGpuInstancePlacement_t> = p
            .starts
            .iter()
            .map(|&start| nvmlGpuInstancePlacement_t {
                start,
                size: p.size,
            })
            .collect();
        unsafe { put_list(placements, count, &all) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMaxMigDeviceCount(
    d: nvmlDevice_t,
    v: *mut c_uint,
) -> nvmlReturn_t {
    with(|m| match mig_gpu(m, d) {
        Ok(_) => unsafe { put(v, MAX_MIG_DEVICES) },
        Err(e) => e,
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMigDeviceHandleByIndex(
    d: nvmlDevice_t,
    index: c_uint,
    out: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    with(|m| {
        let g = match mig_gpu(m, d) {
            Ok(g) => g,
            Err(e) => return e,
        };
        if index >= MAX_MIG_DEVICES {
            return INVALID;
        }
        match m.gpus[g].mig_at(index) {
            Some(_) => unsafe { put(out, handle(MIG_BASE + g * 0x100 + index as usize)) },
            None => NOT_FOUND,
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceId(
    d: nvmlDevice_t,
    v: *mut c_uint,
) -> nvmlReturn_t {
    with(|m| match device(m, d) {
        Some(Dev::Mig(g, slot)) => match m.gpus[g].mig_at(slot) {
            Some((gi, _)) => unsafe { put(v, gi.id) },
            None => INVALID,
        },
        Some(Dev::Gpu(_)) => NOT_SUPPORTED,
        None => INVALID,
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeInstanceId(
    d: nvmlDevice_t,
    v: *mut c_uint,
) -> nvmlReturn_t {
    with(|m| match device(m, d) {
        Some(Dev::Mig(g, slot)) => match m.gpus[g].mig_at(slot) {
            Some((_, ci)) => unsafe { put(v, ci.id) },
            None => INVALID,
        },
        Some(Dev::Gpu(_)) => NOT_SUPPORTED,
        None => INVALID,
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceById(
    d: nvmlDevice_t,
    id: c_uint,
    out: *mut nvmlGpuInstance_t,
) -> nvmlReturn_t {
    with(|m| {
        let g = match mig_gpu(m, d) {
            Ok(g) => g,
            Err(e) => return e,
        };
        match m.gpus[g].instance(id) {
            Some(_) => unsafe { put(out, gi_handle(g, id)) },
            None => NOT_FOUND,
        }
    })
}

fn gi_info(m: &Model, g: usize, id: c_uint) -> Option<nvmlGpuInstanceInfo_t> {
    let gpu = &m.gpus[g];
    let gi = gpu.instance(id)?;
    let p = &gpu.profiles[gi.profile];
    Some(nvmlGpuInstanceInfo_t {
        device: gpu_handle(g),
        id: gi.id,
        profileId: p.id,
        placement: nvmlGpuInstancePlacement_t {
            start: gi.start,
            size: p.size,
        },
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetInfo(
    gi: nvmlGpuInstance_t,
    v: *mut nvmlGpuInstanceInfo_t,
) -> nvmlReturn_t {
    with(
        |m| match gi_of(m, gi).and_then(|(g, id)| gi_info(m, g, id)) {
            Some(info) => unsafe { put(v, info) },
            None => INVALID,
        },
    )
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstances(
    d: nvmlDevice_t,
    profile_id: c_uint,
    out: *mut nvmlGpuInstance_t,
    count: *mut c_uint,
) -> nvmlReturn_t {
    with(|m| {
        let g = match mig_gpu(m, d) {
            Ok(g) => g,
            Err(e) => return e,
        };
        let gpu = &m.gpus[g];
        if !gpu.profiles.iter().any(|p| p.id == profile_id) {
            return INVALID;
        }
        let all: Vec<nvmlGpuInstance_t> = gpu
            .instances
            .iter()
            .filter(|gi| gpu.profiles[gi.profile].id == profile_id)
            .map(|gi| gi_handle(g, gi.id))
            .collect();
        unsafe { put_list(out, count, &all) }
    })
}

// ------------------------------------------------------------------------------------------------
// MIG: creating and destroying
// ------------------------------------------------------------------------------------------------

/// Refuses outside MIG mode, at a placement the profile does not allow, over slices another
/// instance holds, and past the profile's instance count.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceCreateGpuInstanceWithPlacement(
    d: nvmlDevice_t,
    profile_id: c_uint,
    placement: *const nvmlGpuInstancePlacement_t,
    out: *mut nvmlGpuInstance_t,
) -> nvmlReturn_t {
    if placement.is_null() || out.is_null() {
        return INVALID;
    }
    // SAFETY: non-null and valid for reads (nvml.h).
    let at = unsafe { placement.read() };
    changing(|m| {
        let g = match mig_gpu(m, d) {
            Ok(g) => g,
            Err(e) => return e,
        };
        let gpu = &mut m.gpus[g];
        if gpu.mig_mode.map(|(current, _)| current) != Some(1) {
            return NOT_SUPPORTED;
        }
        let Some(profile) = gpu.profiles.iter().position(|p| p.id == profile_id) else {
            return INVALID;
        };
        let p = &gpu.profiles[profile];
        if at.size != p.size || !p.starts.contains(&at.start) {
            return INVALID;
        }
        let overlaps = gpu.instances.iter().any(|gi| {
            let size = gpu.profiles[gi.profile].size;
            at.start < gi.start + size && gi.start < at.start + at.size
        });
        let same = gpu
            .instances
            .iter()
            .filter(|gi| gi.profile == profile)
            .count();
        if overlaps || same >= p.instances as usize {
            return INSUFFICIENT_RESOURCES;
        }
        let id = (1..).find(|id| gpu.instance(*id).is_none()).unwrap_or(1);
        gpu.instances.push(GpuInstance {
            id,
            profile,
            start: at.start,
            compute: Vec::new(),
        });
        unsafe { put(out, gi_handle(g, id)) }
    })
}

/// Refuses while the instance holds compute instances, as NVML does.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceDestroy(gi: nvmlGpuInstance_t) -> nvmlReturn_t {
    changing(|m| {
        let Some((g, id)) = gi_of(m, gi) else {
            return INVALID;
        };
        let gpu = &mut m.gpus[g];
        if gpu.instance(id).is_some_and(|gi| !gi.compute.is_empty()) {
            return IN_USE;
        }
        gpu.instances.retain(|gi| gi.id != id);
        SUCCESS
    })
}

/// Compute profiles up to the GPU instance's slice count (of the five plain ones), with ids
/// equal to their index.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstanceProfileInfo(
    gi: nvmlGpuInstance_t,
    profile: c_uint,
    eng_profile: c_uint,
    v: *mut nvmlComputeInstanceProfileInfo_t,
) -> nvmlReturn_t {
    with(|m| {
        let Some((g, id)) = gi_of(m, gi) else {
            return INVALID;
        };
        if profile >= NVML_COMPUTE_INSTANCE_PROFILE_COUNT
            || eng_profile != NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
        {
            return INVALID;
        }
        let gpu = &m.gpus[g];
        let Some(p) = gpu.instance(id).map(|gi| &gpu.profiles[gi.profile]) else {
            return INVALID;
        };
        let slices = CI_SLICES[profile as usize];
        if profile > NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE || slices > p.slices {
            return NOT_SUPPORTED;
        }
        let [ce, dec, enc, jpeg, ofa] = p.engines;
        let info = nvmlComputeInstanceProfileInfo_t {
            id: profile,
            sliceCount: slices,
            instanceCount: p.slices / slices,
            multiprocessorCount: p.sms * slices / p.slices.max(1),
            sharedCopyEngineCount: ce,
            sharedDecoderCount: dec,
            sharedEncoderCount: enc,
            sharedJpegCount: jpeg,
            sharedOfaCount: ofa,
        };
        unsafe { put(v, info) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceCreateComputeInstance(
    gi: nvmlGpuInstance_t,
    profile_id: c_uint,
    out: *mut nvmlComputeInstance_t,
) -> nvmlReturn_t {
    if out.is_null() {
        return INVALID;
    }
    changing(|m| {
        let Some((g, id)) = gi_of(m, gi) else {
            return INVALID;
        };
        if profile_id > NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE {
            return NOT_SUPPORTED;
        }
        let slices = CI_SLICES[profile_id as usize];
        let n = m.created;
        let gpu = &mut m.gpus[g];
        let Some(slot) = gpu.free_slot() else {
            return INSUFFICIENT_RESOURCES;
        };
        let gpu_uuid = gpu.uuid.clone();
        let Some(gi_slices) = gpu.instance(id).map(|gi| gpu.profiles[gi.profile].slices) else {
            return INVALID;
        };
        let Some(inst) = gpu.instance_mut(id) else {
            return INVALID;
        };
        let used: c_uint = inst.compute.iter().map(|c| c.slices).sum();
        if slices > gi_slices || used + slices > gi_slices {
            return INSUFFICIENT_RESOURCES;
        }
        let ci_id = (0..)
            .find(|c| inst.compute.iter().all(|x| x.id != *c))
            .unwrap_or(0);
        // A new UUID per creation, as NVML gives: the parent's first group, then a counter.
        let uuid = format!(
            "MIG-{}-fa4e-5000-8000-{:012x}",
            gpu_uuid.get(4..12).unwrap_or("00000000"),
            n + 1
        );
        inst.compute.push(ComputeInstance {
            id: ci_id,
            profile: profile_id,
            slices,
            slot,
            uuid,
        });
        m.created = n + 1;
        unsafe { put(out, ci_handle(g, id, ci_id)) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlComputeInstanceGetInfo_v2(
    ci: nvmlComputeInstance_t,
    v: *mut nvmlComputeInstanceInfo_t,
) -> nvmlReturn_t {
    with(|m| {
        let Some((g, gi, id)) = ci_of(m, ci) else {
            return INVALID;
        };
        let Some(c) = m.gpus[g]
            .instance(gi)
            .and_then(|x| x.compute.iter().find(|c| c.id == id))
        else {
            return INVALID;
        };
        let info = nvmlComputeInstanceInfo_t {
            device: gpu_handle(g),
            gpuInstance: gi_handle(g, gi),
            id,
            profileId: c.profile,
            placement: nvmlComputeInstancePlacement_t {
                start: 0,
                size: c.slices,
            },
        };
        unsafe { put(v, info) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstanceById(
    gi: nvmlGpuInstance_t,
    id: c_uint,
    out: *mut nvmlComputeInstance_t,
) -> nvmlReturn_t {
    with(|m| {
        let Some((g, gi_id)) = gi_of(m, gi) else {
            return INVALID;
        };
        match m.gpus[g]
            .instance(gi_id)
            .and_then(|x| x.compute.iter().find(|c| c.id == id))
        {
            Some(_) => unsafe { put(out, ci_handle(g, gi_id, id)) },
            None => NOT_FOUND,
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstances(
    gi: nvmlGpuInstance_t,
    profile_id: c_uint,
    out: *mut nvmlComputeInstance_t,
    count: *mut c_uint,
) -> nvmlReturn_t {
    with(|m| {
        let Some((g, gi_id)) = gi_of(m, gi) else {
            return INVALID;
        };
        let all: Vec<nvmlComputeInstance_t> = m.gpus[g]
            .instance(gi_id)
            .map(|x| {
                x.compute
                    .iter()
                    .filter(|c| c.profile == profile_id)
                    .map(|c| ci_handle(g, gi_id, c.id))
                    .collect()
            })
            .unwrap_or_default();
        unsafe { put_list(out, count, &all) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlComputeInstanceDestroy(ci: nvmlComputeInstance_t) -> nvmlReturn_t {
    changing(|m| {
        let Some((g, gi, id)) = ci_of(m, ci) else {
            return INVALID;
        };
        if let Some(x) = m.gpus[g].instance_mut(gi) {
            x.compute.retain(|c| c.id != id);
        }
        SUCCESS
    })
}

// ------------------------------------------------------------------------------------------------
// NVLink
// ------------------------------------------------------------------------------------------------

fn nvlink(m: &Model, d: nvmlDevice_t, link: c_uint) -> Result<model::Link, nvmlReturn_t> {
    let g = gpu(m, d).ok_or(INVALID)?;
    if g.links.is_empty() {
        return Err(NOT_SUPPORTED);
    }
    g.links.get(link as usize).copied().ok_or(INVALID)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkState(
    d: nvmlDevice_t,
    link: c_uint,
    v: *mut nvmlEnableState_t,
) -> nvmlReturn_t {
    with(|m| match nvlink(m, d, link) {
        Ok(_) => unsafe { put(v, nvmlEnableState_enum_NVML_FEATURE_ENABLED) },
        Err(e) => e,
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkRemotePciInfo_v2(
    d: nvmlDevice_t,
    link: c_uint,
    v: *mut nvmlPciInfo_t,
) -> nvmlReturn_t {
    with(|m| match nvlink(m, d, link) {
        Ok(l) => unsafe { put(v, l.remote) },
        Err(e) => e,
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkRemoteDeviceType(
    d: nvmlDevice_t,
    link: c_uint,
    v: *mut nvmlIntNvLinkDeviceType_t,
) -> nvmlReturn_t {
    with(|m| match nvlink(m, d, link) {
        Ok(l) => unsafe { put(v, l.kind) },
        Err(e) => e,
    })
}

// ------------------------------------------------------------------------------------------------
// NVLink fabric
// ------------------------------------------------------------------------------------------------

/// `NVML_STRUCT_VERSION(GpuFabricInfo, v)`.
const fn fabric_version<T>(v: u32) -> c_uint {
    (size_of::<T>() as c_uint) | (v << 24)
}
const FABRIC_V2: c_uint = fabric_version::<nvmlGpuFabricInfo_v2_t>(2);
const FABRIC_V3: c_uint = fabric_version::<nvmlGpuFabricInfo_v3_t>(3);

/// (cluster UUID, status, clique, state) of a GPU's registration, as the node has it or as
/// `FAKE_NVML_FABRIC_FILE` overrides it ([`fabric`](mod@fabric)).
fn fabric(d: nvmlDevice_t) -> Result<([u8; 16], nvmlReturn_t, c_uint, u8), nvmlReturn_t> {
    let n = node();
    let m = &n.as_ref().ok_or(UNINITIALIZED)?.model;
    let Some(Dev::Gpu(index)) = device(m, d) else {
        return Err(INVALID);
    };
    let g = m.gpus.get(index).ok_or(INVALID)?;
    let over = fabric::lookup(index as c_uint);
    if let Some(code) = over.call {
        return Err(code);
    }
    let (cluster, clique, state) = match (g.fabric, over.state) {
        (Fabric::NotSupported, None) => return Err(NOT_SUPPORTED),
        (Fabric::NotSupported, Some(state)) => ([0; 16], 0, state),
        (
            Fabric::State {
                cluster,
                clique,
                state,
            },
            over_state,
        ) => (cluster, clique, over_state.unwrap_or(state)),
    };
    Ok((cluster, over.status.unwrap_or(SUCCESS), clique, state as u8))
}

/// Takes a v2 or v3 struct (the `version` field says which), as drivers from R570 do; with
/// `FAKE_NVML_FABRIC_API=v2` only v2, with `v1` none.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuFabricInfoV(
    d: nvmlDevice_t,
    v: *mut nvmlGpuFabricInfoV_t,
) -> nvmlReturn_t {
    let api = FABRIC_API.load(Ordering::Relaxed);
    if api < 2 {
        return FUNCTION_NOT_FOUND;
    }
    if v.is_null() {
        return INVALID;
    }
    // SAFETY: every version of the struct starts with `version` (nvml.h); `v` is valid for it.
    let version = unsafe { v.cast::<c_uint>().read() };
    let (uuid, status, clique, state) = match fabric(d) {
        Ok(f) => f,
        Err(e) => return e,
    };
    match version {
        FABRIC_V3 if api >= 3 => {
            let info = nvmlGpuFabricInfo_v3_t {
                version,
                clusterUuid: uuid,
                status,
                cliqueId: clique,
                state,
                healthMask: 0,
                healthSummary: NVML_GPU_FABRIC_HEALTH_SUMMARY_HEALTHY as u8,
            };
            unsafe { put(v, info) }
        }
        FABRIC_V2 => {
            let info = nvmlGpuFabricInfo_v2_t {
                version,
                clusterUuid: uuid,
                status,
                cliqueId: clique,
                state,
                healthMask: 0,
            };
            // SAFETY: `version` says the caller's buffer holds a v2 struct; write only that.
            unsafe { put(v.cast::<nvmlGpuFabricInfo_v2_t>(), info) }
        }
        _ => VERSION_MISMATCH,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuFabricInfo(
    d: nvmlDevice_t,
    v: *mut nvmlGpuFabricInfo_t,
) -> nvmlReturn_t {
    match fabric(d) {
        Ok((uuid, status, clique, state)) => unsafe {
            put(
                v,
                nvmlGpuFabricInfo_t {
                    clusterUuid: uuid,
                    status,
                    cliqueId: clique,
                    state,
                },
            )
        },
        Err(e) => e,
    }
}
