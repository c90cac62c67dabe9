//! A fake `libnvidia-ml.so` for testing nvdra's NVML backend on machines without a GPU.
//!
//! It exports the NVML functions the backend calls, with NVML's C signatures and return codes,
//! and answers them from one fixed node:
//!
//! | index | minor | GPU | bus | MIG | NVLink |
//! |---|---|---|---|---|---|
//! | 0 | 0 | A100-SXM4-40GB | 0000:07:00.0 | on: 3g.20gb (GI 1) at 0, empty slot, 1g.5gb (GI 7) at 6 | 12 links over 6 NVSwitches |
//! | 1 | 1 | A100-SXM4-40GB | 0000:0f:00.0 | off | 12 links over the same switches |
//! | 2 | 5 | L40S | 0000:b1:00.0 | not supported | not supported |
//!
//! Driver 550.163.01, CUDA 12.4. `nvmlDeviceGetNumaNodeId` is deliberately not exported, so the
//! backend's handling of a symbol missing from an older driver is exercised too.
//!
//! Handles are opaque integers cast to pointers; they are never dereferenced by callers. Every
//! function's contract is the one `nvml.h` documents for it: pointer arguments must be valid for
//! writes of the pointed-to type (null is answered with `NVML_ERROR_INVALID_ARGUMENT`).

// The safety contract of every export is nvml.h's, stated once above.
#![allow(clippy::missing_safety_doc)]

use std::ffi::c_char;
use std::os::raw::{c_int, c_uint, c_ulonglong};
use std::ptr;

use nvml_wrapper_sys::bindings::*;

const SUCCESS: nvmlReturn_t = nvmlReturn_enum_NVML_SUCCESS;
const INVALID: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT;
const NOT_SUPPORTED: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED;
const NOT_FOUND: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_NOT_FOUND;
const INSUFFICIENT_SIZE: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_SIZE;

const MAX_MIG_DEVICES: c_uint = 7;

struct Profile {
    index: c_uint,
    id: c_uint,
    slices: c_uint,
    instances: c_uint,
    mib: c_ulonglong,
    sms: c_uint,
    /// Copy engines, decoders, JPEG, OFA.
    engines: [c_uint; 4],
    size: c_uint,
    starts: &'static [c_uint],
}

/// An A100-40GB's GPU-instance profiles, by `NVML_GPU_INSTANCE_PROFILE_*` index.
const A100_PROFILES: &[Profile] = &[
    profile(
        0,
        19,
        1,
        7,
        4864,
        14,
        [1, 0, 0, 0],
        1,
        &[0, 1, 2, 3, 4, 5, 6],
    ),
    profile(1, 14, 2, 3, 9856, 28, [2, 1, 0, 0], 2, &[0, 2, 4]),
    profile(2, 9, 3, 2, 19968, 42, [3, 2, 0, 0], 4, &[0, 4]),
    profile(3, 5, 4, 1, 19968, 56, [4, 2, 0, 0], 4, &[0]),
    profile(4, 0, 7, 1, 40192, 98, [7, 5, 1, 1], 8, &[0]),
    profile(
        7,
        20,
        1,
        1,
        4864,
        14,
        [1, 1, 1, 1],
        1,
        &[0, 1, 2, 3, 4, 5, 6],
    ),
    profile(9, 15, 1, 4, 9856, 14, [1, 1, 0, 0], 2, &[0, 2, 4, 6]),
];

#[allow(clippy::too_many_arguments)]
const fn profile(
    index: c_uint,
    id: c_uint,
    slices: c_uint,
    instances: c_uint,
    mib: c_ulonglong,
    sms: c_uint,
    engines: [c_uint; 4],
    size: c_uint,
    starts: &'static [c_uint],
) -> Profile {
    Profile {
        index,
        id,
        slices,
        instances,
        mib,
        sms,
        engines,
        size,
        starts,
    }
}

struct Mig {
    slot: c_uint,
    uuid: &'static str,
    gi_id: c_uint,
    ci_id: c_uint,
    /// Index into `A100_PROFILES`.
    profile: usize,
    start: c_uint,
}

struct Gpu {
    name: &'static str,
    uuid: &'static str,
    bus: &'static str,
    minor: c_uint,
    arch: nvmlDeviceArchitecture_t,
    cc: (c_int, c_int),
    mib: c_ulonglong,
    cores: c_uint,
    /// MIG mode (current, pending); `None` when the GPU cannot do MIG.
    mig_mode: Option<(c_uint, c_uint)>,
    migs: &'static [Mig],
    /// Number of NVLinks; 0 when the GPU has none.
    links: c_uint,
}

const SWITCHES: [&str; 6] = [
    "00000000:01:00.0",
    "00000000:02:00.0",
    "00000000:03:00.0",
    "00000000:04:00.0",
    "00000000:05:00.0",
    "00000000:06:00.0",
];

static GPUS: [Gpu; 3] = [
    Gpu {
        name: "NVIDIA A100-SXM4-40GB",
        uuid: "GPU-f00d0000-0000-4000-8000-000000000000",
        bus: "00000000:07:00.0",
        minor: 0,
        arch: NVML_DEVICE_ARCH_AMPERE,
        cc: (8, 0),
        mib: 40960,
        cores: 6912,
        mig_mode: Some((1, 1)),
        migs: &[
            Mig {
                slot: 0,
                uuid: "MIG-f00d0000-0000-5000-8000-000000000001",
                gi_id: 1,
                ci_id: 0,
                profile: 2,
                start: 0,
            },
            Mig {
                slot: 2,
                uuid: "MIG-f00d0000-0000-5000-8000-000000000007",
                gi_id: 7,
                ci_id: 0,
                profile: 0,
                start: 6,
            },
        ],
        links: 12,
    },
    Gpu {
        name: "NVIDIA A100-SXM4-40GB",
        uuid: "GPU-f00d0000-0000-4000-8000-000000000001",
        bus: "00000000:0F:00.0",
        minor: 1,
        arch: NVML_DEVICE_ARCH_AMPERE,
        cc: (8, 0),
        mib: 40960,
        cores: 6912,
        mig_mode: Some((0, 0)),
        migs: &[],
        links: 12,
    },
    Gpu {
        name: "NVIDIA L40S",
        uuid: "GPU-f00d0000-0000-4000-8000-000000000002",
        bus: "00000000:B1:00.0",
        minor: 5,
        arch: NVML_DEVICE_ARCH_ADA,
        cc: (8, 9),
        mib: 46068,
        cores: 18176,
        mig_mode: None,
        migs: &[],
        links: 0,
    },
];

// ------------------------------------------------------------------------------------------------
// Handles
// ------------------------------------------------------------------------------------------------

const GPU_BASE: usize = 0x1000;
const MIG_BASE: usize = 0x2000;
const GI_BASE: usize = 0x3000;

fn handle<T>(n: usize) -> *mut T {
    ptr::without_provenance_mut(n)
}

enum Dev {
    Gpu(&'static Gpu),
    Mig(&'static Mig),
}

fn device(d: nvmlDevice_t) -> Option<Dev> {
    let n = d.addr();
    if (GPU_BASE..GPU_BASE + GPUS.len()).contains(&n) {
        return Some(Dev::Gpu(&GPUS[n - GPU_BASE]));
    }
    let (g, slot) = ((n.checked_sub(MIG_BASE)?) / 0x100, (n - MIG_BASE) % 0x100);
    let gpu = GPUS.get(g).filter(|_| n < GI_BASE)?;
    let mig = gpu.migs.iter().find(|m| m.slot as usize == slot)?;
    Some(Dev::Mig(mig))
}

fn gpu(d: nvmlDevice_t) -> Option<&'static Gpu> {
    match device(d)? {
        Dev::Gpu(g) => Some(g),
        Dev::Mig(_) => None,
    }
}

fn gpu_index(g: &Gpu) -> usize {
    GPUS.iter().position(|x| ptr::eq(x, g)).unwrap_or_default()
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

fn c_chars<const N: usize>(s: &str) -> [c_char; N] {
    let mut out = [0 as c_char; N];
    for (o, b) in out.iter_mut().zip(s.bytes().take(N - 1)) {
        *o = b as c_char;
    }
    out
}

fn pci(bus: &str) -> nvmlPciInfo_t {
    nvmlPciInfo_t {
        busIdLegacy: c_chars(bus),
        domain: 0,
        bus: 0,
        device: 0,
        pciDeviceId: 0,
        pciSubSystemId: 0,
        busId: c_chars(bus),
    }
}

// ------------------------------------------------------------------------------------------------
// System
// ------------------------------------------------------------------------------------------------

#[unsafe(no_mangle)]
pub extern "C" fn nvmlInit_v2() -> nvmlReturn_t {
    SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlShutdown() -> nvmlReturn_t {
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetDriverVersion(buf: *mut c_char, len: c_uint) -> nvmlReturn_t {
    unsafe { put_str(buf, len, "550.163.01") }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion_v2(v: *mut c_int) -> nvmlReturn_t {
    unsafe { put(v, 12040) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCount_v2(count: *mut c_uint) -> nvmlReturn_t {
    unsafe { put(count, GPUS.len() as c_uint) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex_v2(
    index: c_uint,
    out: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    if index as usize >= GPUS.len() {
        return INVALID;
    }
    unsafe { put(out, handle(GPU_BASE + index as usize)) }
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
    match device(d) {
        Some(Dev::Gpu(g)) => unsafe { put_str(buf, len, g.uuid) },
        Some(Dev::Mig(m)) => unsafe { put_str(buf, len, m.uuid) },
        None => INVALID,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetName(
    d: nvmlDevice_t,
    buf: *mut c_char,
    len: c_uint,
) -> nvmlReturn_t {
    match gpu(d) {
        Some(g) => unsafe { put_str(buf, len, g.name) },
        None => INVALID,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMinorNumber(d: nvmlDevice_t, v: *mut c_uint) -> nvmlReturn_t {
    match gpu(d) {
        Some(g) => unsafe { put(v, g.minor) },
        None => INVALID,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetBrand(
    d: nvmlDevice_t,
    v: *mut nvmlBrandType_t,
) -> nvmlReturn_t {
    match gpu(d) {
        Some(_) => unsafe { put(v, nvmlBrandType_enum_NVML_BRAND_NVIDIA) },
        None => INVALID,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetArchitecture(
    d: nvmlDevice_t,
    v: *mut nvmlDeviceArchitecture_t,
) -> nvmlReturn_t {
    match gpu(d) {
        Some(g) => unsafe { put(v, g.arch) },
        None => INVALID,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCudaComputeCapability(
    d: nvmlDevice_t,
    major: *mut c_int,
    minor: *mut c_int,
) -> nvmlReturn_t {
    match gpu(d) {
        Some(g) => unsafe {
            match put(major, g.cc.0) {
                SUCCESS => put(minor, g.cc.1),
                e => e,
            }
        },
        None => INVALID,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(
    d: nvmlDevice_t,
    v: *mut nvmlMemory_v2_t,
) -> nvmlReturn_t {
    let Some(g) = gpu(d) else { return INVALID };
    let total = g.mib << 20;
    let reserved = 583 << 20;
    let info = nvmlMemory_v2_t {
        version: (size_of::<nvmlMemory_v2_t>() | (2 << 24)) as c_uint,
        total,
        reserved,
        free: total - reserved,
        used: 0,
    };
    unsafe { put(v, info) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNumGpuCores(d: nvmlDevice_t, v: *mut c_uint) -> nvmlReturn_t {
    match gpu(d) {
        Some(g) => unsafe { put(v, g.cores) },
        None => INVALID,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPciInfo_v3(
    d: nvmlDevice_t,
    v: *mut nvmlPciInfo_t,
) -> nvmlReturn_t {
    match gpu(d) {
        Some(g) => unsafe { put(v, pci(g.bus)) },
        None => INVALID,
    }
}

/// Full GPUs answer NotSupported, as most drivers do; MIG devices answer their attributes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetAttributes_v2(
    d: nvmlDevice_t,
    v: *mut nvmlDeviceAttributes_t,
) -> nvmlReturn_t {
    match device(d) {
        Some(Dev::Gpu(_)) => NOT_SUPPORTED,
        Some(Dev::Mig(m)) => {
            let p = &A100_PROFILES[m.profile];
            let attrs = nvmlDeviceAttributes_t {
                multiprocessorCount: p.sms,
                sharedCopyEngineCount: p.engines[0],
                sharedDecoderCount: p.engines[1],
                sharedEncoderCount: 0,
                sharedJpegCount: p.engines[2],
                sharedOfaCount: p.engines[3],
                gpuInstanceSliceCount: p.slices,
                computeInstanceSliceCount: p.slices,
                memorySizeMB: p.mib,
            };
            unsafe { put(v, attrs) }
        }
        None => INVALID,
    }
}

// ------------------------------------------------------------------------------------------------
// MIG
// ------------------------------------------------------------------------------------------------

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMigMode(
    d: nvmlDevice_t,
    current: *mut c_uint,
    pending: *mut c_uint,
) -> nvmlReturn_t {
    let Some(g) = gpu(d) else { return INVALID };
    let Some((c, p)) = g.mig_mode else {
        return NOT_SUPPORTED;
    };
    unsafe {
        match put(current, c) {
            SUCCESS => put(pending, p),
            e => e,
        }
    }
}

fn mig_gpu(d: nvmlDevice_t) -> Result<&'static Gpu, nvmlReturn_t> {
    let g = gpu(d).ok_or(INVALID)?;
    g.mig_mode.map(|_| g).ok_or(NOT_SUPPORTED)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceProfileInfo(
    d: nvmlDevice_t,
    profile: c_uint,
    v: *mut nvmlGpuInstanceProfileInfo_t,
) -> nvmlReturn_t {
    if let Err(e) = mig_gpu(d) {
        return e;
    }
    if profile >= NVML_GPU_INSTANCE_PROFILE_COUNT {
        return INVALID;
    }
    let Some(p) = A100_PROFILES.iter().find(|p| p.index == profile) else {
        return NOT_SUPPORTED;
    };
    let info = nvmlGpuInstanceProfileInfo_t {
        id: p.id,
        isP2pSupported: 0,
        sliceCount: p.slices,
        instanceCount: p.instances,
        multiprocessorCount: p.sms,
        copyEngineCount: p.engines[0],
        decoderCount: p.engines[1],
        encoderCount: 0,
        jpegCount: p.engines[2],
        ofaCount: p.engines[3],
        memorySizeMB: p.mib,
    };
    unsafe { put(v, info) }
}

/// Takes the profile's `id` (not its index), like NVML.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstancePossiblePlacements_v2(
    d: nvmlDevice_t,
    profile_id: c_uint,
    placements: *mut nvmlGpuInstancePlacement_t,
    count: *mut c_uint,
) -> nvmlReturn_t {
    if let Err(e) = mig_gpu(d) {
        return e;
    }
    let Some(p) = A100_PROFILES.iter().find(|p| p.id == profile_id) else {
        return NOT_SUPPORTED;
    };
    if count.is_null() {
        return INVALID;
    }
    let n = p.starts.len() as c_uint;
    if placements.is_null() {
        return unsafe { put(count, n) };
    }
    // SAFETY: `count` is non-null and valid for reads and writes (nvml.h).
    if unsafe { *count } < n {
        return INSUFFICIENT_SIZE;
    }
    for (i, &start) in p.starts.iter().enumerate() {
        let pl = nvmlGpuInstancePlacement_t {
            start,
            size: p.size,
        };
        // SAFETY: the caller's buffer holds `*count >= n` elements.
        unsafe { placements.add(i).write(pl) };
    }
    unsafe { put(count, n) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMaxMigDeviceCount(
    d: nvmlDevice_t,
    v: *mut c_uint,
) -> nvmlReturn_t {
    match mig_gpu(d) {
        Ok(_) => unsafe { put(v, MAX_MIG_DEVICES) },
        Err(e) => e,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMigDeviceHandleByIndex(
    d: nvmlDevice_t,
    index: c_uint,
    out: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    let g = match mig_gpu(d) {
        Ok(g) => g,
        Err(e) => return e,
    };
    if index >= MAX_MIG_DEVICES {
        return INVALID;
    }
    match g.migs.iter().find(|m| m.slot == index) {
        Some(m) => unsafe {
            put(
                out,
                handle(MIG_BASE + gpu_index(g) * 0x100 + m.slot as usize),
            )
        },
        None => NOT_FOUND,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceId(
    d: nvmlDevice_t,
    v: *mut c_uint,
) -> nvmlReturn_t {
    match device(d) {
        Some(Dev::Mig(m)) => unsafe { put(v, m.gi_id) },
        Some(Dev::Gpu(_)) => NOT_SUPPORTED,
        None => INVALID,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeInstanceId(
    d: nvmlDevice_t,
    v: *mut c_uint,
) -> nvmlReturn_t {
    match device(d) {
        Some(Dev::Mig(m)) => unsafe { put(v, m.ci_id) },
        Some(Dev::Gpu(_)) => NOT_SUPPORTED,
        None => INVALID,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceById(
    d: nvmlDevice_t,
    id: c_uint,
    out: *mut nvmlGpuInstance_t,
) -> nvmlReturn_t {
    let g = match mig_gpu(d) {
        Ok(g) => g,
        Err(e) => return e,
    };
    match g.migs.iter().find(|m| m.gi_id == id) {
        Some(m) => unsafe {
            put(
                out,
                handle(GI_BASE + gpu_index(g) * 0x100 + m.gi_id as usize),
            )
        },
        None => NOT_FOUND,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetInfo(
    gi: nvmlGpuInstance_t,
    v: *mut nvmlGpuInstanceInfo_t,
) -> nvmlReturn_t {
    let Some(n) = gi.addr().checked_sub(GI_BASE) else {
        return INVALID;
    };
    let Some(g) = GPUS.get(n / 0x100) else {
        return INVALID;
    };
    let Some(m) = g.migs.iter().find(|m| m.gi_id as usize == n % 0x100) else {
        return INVALID;
    };
    let p = &A100_PROFILES[m.profile];
    let info = nvmlGpuInstanceInfo_t {
        device: handle(GPU_BASE + gpu_index(g)),
        id: m.gi_id,
        profileId: p.id,
        placement: nvmlGpuInstancePlacement_t {
            start: m.start,
            size: p.size,
        },
    };
    unsafe { put(v, info) }
}

// ------------------------------------------------------------------------------------------------
// NVLink
// ------------------------------------------------------------------------------------------------

fn nvlink(d: nvmlDevice_t, link: c_uint) -> Result<&'static Gpu, nvmlReturn_t> {
    let g = gpu(d).ok_or(INVALID)?;
    if g.links == 0 {
        return Err(NOT_SUPPORTED);
    }
    if link >= g.links {
        return Err(INVALID);
    }
    Ok(g)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkState(
    d: nvmlDevice_t,
    link: c_uint,
    v: *mut nvmlEnableState_t,
) -> nvmlReturn_t {
    match nvlink(d, link) {
        Ok(_) => unsafe { put(v, nvmlEnableState_enum_NVML_FEATURE_ENABLED) },
        Err(e) => e,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkRemotePciInfo_v2(
    d: nvmlDevice_t,
    link: c_uint,
    v: *mut nvmlPciInfo_t,
) -> nvmlReturn_t {
    match nvlink(d, link) {
        Ok(_) => unsafe { put(v, pci(SWITCHES[link as usize % SWITCHES.len()])) },
        Err(e) => e,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkRemoteDeviceType(
    d: nvmlDevice_t,
    link: c_uint,
    v: *mut nvmlIntNvLinkDeviceType_t,
) -> nvmlReturn_t {
    match nvlink(d, link) {
        Ok(_) => unsafe {
            put(
                v,
                nvmlIntNvLinkDeviceType_enum_NVML_NVLINK_DEVICE_TYPE_SWITCH,
            )
        },
        Err(e) => e,
    }
}
