//! A fake `libnvidia-ml.so` for testing nvdra's NVML backend on machines without a GPU.
//!
//! It exports the NVML functions the backend calls, with NVML's C signatures and return codes,
//! and answers them from one of two fixed nodes, chosen by the environment variable
//! `FAKE_NVML_NODE` when `nvmlInit_v2` runs (an unknown value makes `nvmlInit_v2` fail).
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
//! Driver 550.163.01, CUDA 12.4. `nvmlDeviceGetNumaNodeId` is deliberately not exported, so the
//! backend's handling of a symbol missing from an older driver is exercised too.
//!
//! Health events, and the hooks tests inject them with, are in `events.rs`.
//!
//! Handles are opaque integers cast to pointers; they are never dereferenced by callers. Every
//! function's contract is the one `nvml.h` documents for it: pointer arguments must be valid for
//! writes of the pointed-to type (null is answered with `NVML_ERROR_INVALID_ARGUMENT`).

// The safety contract of every export is nvml.h's, stated once above.
#![allow(clippy::missing_safety_doc)]

use std::ffi::c_char;
use std::os::raw::{c_int, c_uint, c_ulonglong};
use std::ptr;
use std::sync::atomic::{AtomicU8, Ordering};

use nvml_wrapper_sys::bindings::*;

const SUCCESS: nvmlReturn_t = nvmlReturn_enum_NVML_SUCCESS;
const INVALID: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT;
const NOT_SUPPORTED: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED;
const NOT_FOUND: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_NOT_FOUND;
const INSUFFICIENT_SIZE: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_SIZE;
const UNKNOWN: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_UNKNOWN;
const FUNCTION_NOT_FOUND: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_FUNCTION_NOT_FOUND;
const VERSION_MISMATCH: nvmlReturn_t = nvmlReturn_enum_NVML_ERROR_ARGUMENT_VERSION_MISMATCH;

/// The fabric cluster the `hgx-h100-sentinel` GPUs 0–5 registered with.
pub const CLUSTER_UUID: [u8; 16] = [
    0x6c, 0x1f, 0x3a, 0x52, 0x8d, 0x2e, 0x4b, 0x7a, 0x9f, 0x10, 0x01, 0x23, 0x45, 0x67, 0x89, 0xab,
];
/// Their clique.
pub const CLIQUE_ID: c_uint = 32766;

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
    /// `None`: `nvmlDeviceGetNumGpuCores` answers NOT_SUPPORTED.
    cores: Option<c_uint>,
    /// `Some`: the full GPU answers `nvmlDeviceGetAttributes_v2` with this SM count (most
    /// drivers answer only for MIG devices).
    attribute_sms: Option<c_uint>,
    /// MIG mode (current, pending); `None` when the GPU cannot do MIG.
    mig_mode: Option<(c_uint, c_uint)>,
    migs: &'static [Mig],
    /// Number of NVLinks; 0 when the GPU has none.
    links: c_uint,
    switches: Switches,
    fabric: FakeFabric,
}

/// Where a GPU's NVLinks say their switches are.
#[derive(Clone, Copy)]
enum Switches {
    /// Link `n` reaches `SWITCHES[n % 6]`.
    Real,
    /// The invalid address in the numeric fields, this bus-id string.
    Sentinel(&'static str),
}

#[derive(Clone, Copy)]
enum FakeFabric {
    /// The call answers NOT_SUPPORTED.
    NotSupported,
    /// A registration in this `NVML_GPU_FABRIC_STATE_*`, in [`CLUSTER_UUID`] / [`CLIQUE_ID`].
    State(u32),
}

const SWITCHES: [&str; 6] = [
    "00000000:01:00.0",
    "00000000:02:00.0",
    "00000000:03:00.0",
    "00000000:04:00.0",
    "00000000:05:00.0",
    "00000000:06:00.0",
];

static A100_L40S: [Gpu; 3] = [
    Gpu {
        name: "NVIDIA A100-SXM4-40GB",
        uuid: "GPU-f00d0000-0000-4000-8000-000000000000",
        bus: "00000000:07:00.0",
        minor: 0,
        arch: NVML_DEVICE_ARCH_AMPERE,
        cc: (8, 0),
        mib: 40960,
        cores: Some(6912),
        attribute_sms: None,
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
        switches: Switches::Real,
        fabric: FakeFabric::NotSupported,
    },
    Gpu {
        name: "NVIDIA A100-SXM4-40GB",
        uuid: "GPU-f00d0000-0000-4000-8000-000000000001",
        bus: "00000000:0F:00.0",
        minor: 1,
        arch: NVML_DEVICE_ARCH_AMPERE,
        cc: (8, 0),
        mib: 40960,
        cores: Some(6912),
        attribute_sms: None,
        mig_mode: Some((0, 0)),
        migs: &[],
        links: 12,
        switches: Switches::Real,
        fabric: FakeFabric::NotSupported,
    },
    Gpu {
        name: "NVIDIA L40S",
        uuid: "GPU-f00d0000-0000-4000-8000-000000000002",
        bus: "00000000:B1:00.0",
        minor: 5,
        arch: NVML_DEVICE_ARCH_ADA,
        cc: (8, 9),
        mib: 46068,
        cores: Some(18176),
        attribute_sms: None,
        mig_mode: None,
        migs: &[],
        links: 0,
        switches: Switches::Real,
        fabric: FakeFabric::NotSupported,
    },
];

const fn h100(
    index: usize,
    bus: &'static str,
    switch_bus_id: &'static str,
    fabric_state: Option<u32>,
) -> Gpu {
    const UUIDS: [&str; 8] = [
        "GPU-f00d0100-0000-4000-8000-000000000000",
        "GPU-f00d0100-0000-4000-8000-000000000001",
        "GPU-f00d0100-0000-4000-8000-000000000002",
        "GPU-f00d0100-0000-4000-8000-000000000003",
        "GPU-f00d0100-0000-4000-8000-000000000004",
        "GPU-f00d0100-0000-4000-8000-000000000005",
        "GPU-f00d0100-0000-4000-8000-000000000006",
        "GPU-f00d0100-0000-4000-8000-000000000007",
    ];
    Gpu {
        name: "NVIDIA H100 80GB HBM3",
        uuid: UUIDS[index],
        bus,
        minor: index as c_uint,
        arch: NVML_DEVICE_ARCH_HOPPER,
        cc: (9, 0),
        mib: 81559,
        cores: Some(16896),
        attribute_sms: None,
        mig_mode: None,
        migs: &[],
        links: 18,
        switches: Switches::Sentinel(switch_bus_id),
        fabric: match fabric_state {
            Some(state) => FakeFabric::State(state),
            None => FakeFabric::NotSupported,
        },
    }
}

const COMPLETED: Option<u32> = Some(NVML_GPU_FABRIC_STATE_COMPLETED);
const SENTINEL: &str = "FFFFFFFF:FF:FF.0";

static HGX_H100_SENTINEL: [Gpu; 8] = [
    h100(0, "00000000:1A:00.0", SENTINEL, COMPLETED),
    h100(1, "00000000:1B:00.0", SENTINEL, COMPLETED),
    h100(2, "00000000:4A:00.0", SENTINEL, COMPLETED),
    h100(3, "00000000:4B:00.0", SENTINEL, COMPLETED),
    h100(4, "00000000:8A:00.0", SENTINEL, COMPLETED),
    h100(5, "00000000:8B:00.0", SENTINEL, COMPLETED),
    Gpu {
        cores: None,
        attribute_sms: Some(132),
        ..h100(
            6,
            "00000000:CA:00.0",
            "ffffffff:ff:ff.0",
            Some(NVML_GPU_FABRIC_STATE_IN_PROGRESS),
        )
    },
    Gpu {
        cores: None,
        ..h100(7, "00000000:CB:00.0", "", None)
    },
];

/// 0: `a100-l40s`, 1: `hgx-h100-sentinel`; set by `nvmlInit_v2`.
static NODE: AtomicU8 = AtomicU8::new(0);
/// 3, 2 or 1: the newest fabric-info struct version the driver takes; set by `nvmlInit_v2`.
static FABRIC_API: AtomicU8 = AtomicU8::new(3);

// Health events and their test hooks (`events.rs`) see the GPUs only through these four.
mod events;

fn gpu_count() -> usize {
    gpus().len()
}

fn gpu_uuid(index: usize) -> Option<&'static str> {
    gpus().get(index).map(|g| g.uuid)
}

fn gpu_handle(index: usize) -> nvmlDevice_t {
    handle(GPU_BASE + index)
}

fn gpu_index_of(d: nvmlDevice_t) -> Option<usize> {
    gpu(d).map(gpu_index)
}

fn gpus() -> &'static [Gpu] {
    match NODE.load(Ordering::Relaxed) {
        1 => &HGX_H100_SENTINEL,
        _ => &A100_L40S,
    }
}

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
    let gpus = gpus();
    if (GPU_BASE..GPU_BASE + gpus.len()).contains(&n) {
        return Some(Dev::Gpu(&gpus[n - GPU_BASE]));
    }
    let (g, slot) = ((n.checked_sub(MIG_BASE)?) / 0x100, (n - MIG_BASE) % 0x100);
    let gpu = gpus.get(g).filter(|_| n < GI_BASE)?;
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
    gpus()
        .iter()
        .position(|x| ptr::eq(x, g))
        .unwrap_or_default()
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

/// PCI info with the numeric fields parsed from `bus` (`dddddddd:bb:dd.f`), as NVML fills them.
fn pci(bus: &str) -> nvmlPciInfo_t {
    let mut parts = bus.split([':', '.']);
    let mut next = || u32::from_str_radix(parts.next().unwrap_or_default(), 16).unwrap_or(0);
    let (domain, bus_no, device) = (next(), next(), next());
    nvmlPciInfo_t {
        busIdLegacy: c_chars(bus),
        domain,
        bus: bus_no,
        device,
        pciDeviceId: 0,
        pciSubSystemId: 0,
        busId: c_chars(bus),
    }
}

/// What NVSwitch baseboards report for a switch link: the invalid address, whatever the string.
fn sentinel_pci(bus_id: &str) -> nvmlPciInfo_t {
    nvmlPciInfo_t {
        domain: 0xFFFF_FFFF,
        bus: 0xFF,
        device: 0xFF,
        ..pci(bus_id)
    }
}

// ------------------------------------------------------------------------------------------------
// System
// ------------------------------------------------------------------------------------------------

/// Reads `FAKE_NVML_NODE` and `FAKE_NVML_FABRIC_API` (see the crate doc).
#[unsafe(no_mangle)]
pub extern "C" fn nvmlInit_v2() -> nvmlReturn_t {
    let node = match std::env::var("FAKE_NVML_NODE").as_deref() {
        Err(_) | Ok("" | "a100-l40s") => 0,
        Ok("hgx-h100-sentinel") => 1,
        Ok(_) => return UNKNOWN,
    };
    let api = match std::env::var("FAKE_NVML_FABRIC_API").as_deref() {
        Err(_) | Ok("" | "v3") => 3,
        Ok("v2") => 2,
        Ok("v1") => 1,
        Ok(_) => return UNKNOWN,
    };
    NODE.store(node, Ordering::Relaxed);
    FABRIC_API.store(api, Ordering::Relaxed);
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
    unsafe { put(count, gpus().len() as c_uint) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex_v2(
    index: c_uint,
    out: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    if index as usize >= gpus().len() {
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
    match gpu(d).map(|g| g.cores) {
        Some(Some(cores)) => unsafe { put(v, cores) },
        Some(None) => NOT_SUPPORTED,
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

/// Full GPUs answer NotSupported, as most drivers do, unless `attribute_sms` is set; MIG devices
/// answer their attributes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetAttributes_v2(
    d: nvmlDevice_t,
    v: *mut nvmlDeviceAttributes_t,
) -> nvmlReturn_t {
    match device(d) {
        Some(Dev::Gpu(g)) => match g.attribute_sms {
            Some(sms) => {
                let attrs = nvmlDeviceAttributes_t {
                    multiprocessorCount: sms,
                    sharedCopyEngineCount: 0,
                    sharedDecoderCount: 0,
                    sharedEncoderCount: 0,
                    sharedJpegCount: 0,
                    sharedOfaCount: 0,
                    gpuInstanceSliceCount: 0,
                    computeInstanceSliceCount: 0,
                    memorySizeMB: g.mib,
                };
                unsafe { put(v, attrs) }
            }
            None => NOT_SUPPORTED,
        },
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
    let Some(g) = gpus().get(n / 0x100) else {
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
        Ok(g) => match g.switches {
            Switches::Real => unsafe { put(v, pci(SWITCHES[link as usize % SWITCHES.len()])) },
            Switches::Sentinel(bus_id) => unsafe { put(v, sentinel_pci(bus_id)) },
        },
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

// ------------------------------------------------------------------------------------------------
// NVLink fabric
// ------------------------------------------------------------------------------------------------

/// `NVML_STRUCT_VERSION(GpuFabricInfo, v)`.
const fn fabric_version<T>(v: u32) -> c_uint {
    (size_of::<T>() as c_uint) | (v << 24)
}
const FABRIC_V2: c_uint = fabric_version::<nvmlGpuFabricInfo_v2_t>(2);
const FABRIC_V3: c_uint = fabric_version::<nvmlGpuFabricInfo_v3_t>(3);

/// (cluster UUID, status, clique, state) of a GPU's registration.
fn fabric(d: nvmlDevice_t) -> Result<([u8; 16], nvmlReturn_t, c_uint, u8), nvmlReturn_t> {
    let g = gpu(d).ok_or(INVALID)?;
    match g.fabric {
        FakeFabric::NotSupported => Err(NOT_SUPPORTED),
        FakeFabric::State(state) => Ok((CLUSTER_UUID, SUCCESS, CLIQUE_ID, state as u8)),
    }
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
