//! Raw NVML calls nvml-wrapper 0.13 lacks or gets wrong.
//!
//! The only `unsafe` code of the NVML backend. Each function resolves its symbol from the loaded
//! library's table (`Result` fields: a symbol the driver lacks is an error, not a panic), or by
//! name for calls newer than that table (the per-cgroup memory limits), calls it with
//! out-pointers to locals, and converts the answer to owned values.

use std::ffi::{CString, c_char, c_ulonglong};
use std::os::raw::c_uint;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::ptr;

use nvml_wrapper::error::{NvmlError, nvml_sym, nvml_try};
use nvml_wrapper::struct_wrappers::event::EventData;
use nvml_wrapper::{Device, Nvml};
use nvml_wrapper_sys::bindings::{
    NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED, NVML_COMPUTE_INSTANCE_PROFILE_COUNT,
    NVML_GPU_FABRIC_STATE_NOT_SUPPORTED, nvmlComputeInstance_t, nvmlComputeInstanceInfo_t,
    nvmlComputeInstancePlacement_t, nvmlComputeInstanceProfileInfo_t, nvmlDevice_t,
    nvmlEventData_t, nvmlGpuFabricInfo_t, nvmlGpuFabricInfo_v2_t, nvmlGpuFabricInfo_v3_t,
    nvmlGpuInstance_t, nvmlGpuInstanceInfo_t, nvmlGpuInstancePlacement_t,
    nvmlIntNvLinkDeviceType_enum_NVML_NVLINK_DEVICE_TYPE_GPU as LINK_GPU,
    nvmlIntNvLinkDeviceType_enum_NVML_NVLINK_DEVICE_TYPE_IBMNPU as LINK_IBMNPU,
    nvmlIntNvLinkDeviceType_enum_NVML_NVLINK_DEVICE_TYPE_SWITCH as LINK_SWITCH,
    nvmlIntNvLinkDeviceType_enum_NVML_NVLINK_DEVICE_TYPE_UNKNOWN as LINK_UNKNOWN,
    nvmlIntNvLinkDeviceType_t,
    nvmlReturn_enum_NVML_ERROR_ARGUMENT_VERSION_MISMATCH as VERSION_MISMATCH,
    nvmlReturn_enum_NVML_ERROR_FUNCTION_NOT_FOUND as FUNCTION_NOT_FOUND,
    nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_SIZE as INSUFFICIENT_SIZE, nvmlReturn_t,
};

use super::{FabricState, Placement, RawFabric, RawGpuInstance, RemoteDevice, raw};
use crate::inventory::MemoryLimits;

/// `nvmlDeviceGetGpuInstanceId` of a MIG device handle.
pub fn gpu_instance_id(nvml: &Nvml, mig: &Device<'_>) -> Result<u32, NvmlError> {
    let f = nvml_sym(nvml.lib().nvmlDeviceGetGpuInstanceId.as_ref())?;
    let mut id: c_uint = 0;
    // SAFETY: `f` has the C signature nvml-wrapper-sys declares for this symbol; the handle
    // comes from a live `Device` borrowed for the call (its `Nvml` outlives it), and `id` is
    // a valid, writable `c_uint` for the duration of the call.
    nvml_try(unsafe { f(mig.handle(), &mut id) })?;
    Ok(id)
}

/// `nvmlDeviceRegisterEvents` of `types` on `device` into `set`. nvml-wrapper's own call frees
/// the whole set when one GPU refuses, which would end the registrations of every other GPU.
pub fn register_events(
    nvml: &Nvml,
    device: &Device<'_>,
    types: u64,
    set: &nvml_wrapper::EventSet<'_>,
) -> Result<(), NvmlError> {
    let f = nvml_sym(nvml.lib().nvmlDeviceRegisterEvents.as_ref())?;
    // SAFETY: declared signature; `device` is a live handle and `set` a live event set, both
    // borrowed for the call from the same `Nvml`; NVML keeps no pointer into our memory. The
    // set's handle is only passed, never freed here.
    nvml_try(unsafe { f(device.handle(), types, set.handle()) })
}

/// One event of `set` (`nvmlEventSetWait_v2`), with the MIG instance ids nvml-wrapper's
/// `EventSet::wait` drops: `gpuInstanceId` and `computeInstanceId` as NVML gives them
/// (`0xFFFFFFFF` where the event is not attributed to an instance).
pub fn wait_event<'nvml>(
    nvml: &'nvml Nvml,
    set: &nvml_wrapper::EventSet<'nvml>,
    timeout_ms: u32,
) -> Result<(EventData<'nvml>, u32, u32), NvmlError> {
    let f = nvml_sym(nvml.lib().nvmlEventSetWait_v2.as_ref())?;
    let mut data = nvmlEventData_t {
        device: ptr::null_mut(),
        eventType: 0,
        eventData: 0,
        gpuInstanceId: u32::MAX,
        computeInstanceId: u32::MAX,
    };
    // SAFETY: declared signature; `set` is a live event set borrowed for the call from this
    // `Nvml` (only passed, never freed here); `data` is a valid, writable struct.
    nvml_try(unsafe { f(set.handle(), &mut data, timeout_ms) })?;
    let (gi, ci) = (data.gpuInstanceId, data.computeInstanceId);
    // SAFETY: NVML filled `data` on success; its device handle belongs to this `Nvml`, which
    // outlives the returned value (the lifetime says so).
    Ok((unsafe { EventData::new(data, nvml) }, gi, ci))
}

/// `nvmlDeviceGetComputeInstanceId` of a MIG device handle.
pub fn compute_instance_id(nvml: &Nvml, mig: &Device<'_>) -> Result<u32, NvmlError> {
    let f = nvml_sym(nvml.lib().nvmlDeviceGetComputeInstanceId.as_ref())?;
    let mut id: c_uint = 0;
    // SAFETY: as in `gpu_instance_id`: declared signature, live handle, valid out-pointer.
    nvml_try(unsafe { f(mig.handle(), &mut id) })?;
    Ok(id)
}

/// The profile id and placement of GPU instance `gi_id` on `parent`
/// (`nvmlDeviceGetGpuInstanceById` + `nvmlGpuInstanceGetInfo`).
pub fn gpu_instance_info(
    nvml: &Nvml,
    parent: &Device<'_>,
    gi_id: u32,
) -> Result<RawGpuInstance, NvmlError> {
    let lib = nvml.lib();
    let by_id = nvml_sym(lib.nvmlDeviceGetGpuInstanceById.as_ref())?;
    let get_info = nvml_sym(lib.nvmlGpuInstanceGetInfo.as_ref())?;
    let mut gi: nvmlGpuInstance_t = ptr::null_mut();
    // SAFETY: declared signature; `parent` is a live device handle; `gi` is a valid
    // out-pointer. The returned instance handle is owned by NVML and needs no release.
    nvml_try(unsafe { by_id(parent.handle(), gi_id, &mut gi) })?;
    if gi.is_null() {
        return Err(NvmlError::Unknown);
    }
    let mut info = nvmlGpuInstanceInfo_t {
        device: ptr::null_mut(),
        id: 0,
        profileId: 0,
        placement: nvmlGpuInstancePlacement_t { start: 0, size: 0 },
    };
    // SAFETY: declared signature; `gi` is the non-null handle NVML just returned for a
    // device that is still open; `info` is a fully initialized struct NVML writes into.
    nvml_try(unsafe { get_info(gi, &mut info) })?;
    Ok(RawGpuInstance {
        profile_id: info.profileId,
        placement: Placement {
            start: info.placement.start,
            size: info.placement.size,
        },
    })
}

/// `nvmlDeviceGetGpuInstancePossiblePlacements_v2` for a profile (by its `info.id`).
pub fn possible_placements(
    nvml: &Nvml,
    device: &Device<'_>,
    profile_id: u32,
) -> Result<Vec<Placement>, NvmlError> {
    let f = nvml_sym(
        nvml.lib()
            .nvmlDeviceGetGpuInstancePossiblePlacements_v2
            .as_ref(),
    )?;
    let mut count: c_uint = 0;
    // SAFETY: declared signature; a null buffer asks NVML only for the count, which it
    // writes to the valid `count`.
    nvml_try(unsafe { f(device.handle(), profile_id, ptr::null_mut(), &mut count) })?;
    if count == 0 {
        return Ok(Vec::new());
    }
    let mut buf = vec![nvmlGpuInstancePlacement_t { start: 0, size: 0 }; count as usize];
    // SAFETY: `buf` holds `count` initialized elements and `count` tells NVML its capacity;
    // NVML writes at most that many and stores the number written back into `count`.
    nvml_try(unsafe { f(device.handle(), profile_id, buf.as_mut_ptr(), &mut count) })?;
    buf.truncate(count as usize);
    Ok(buf
        .into_iter()
        .map(|p| Placement {
            start: p.start,
            size: p.size,
        })
        .collect())
}

/// `nvmlDeviceGetNvLinkRemoteDeviceType` for one link.
pub fn nvlink_remote_type(
    nvml: &Nvml,
    device: &Device<'_>,
    link: u32,
) -> Result<RemoteDevice, NvmlError> {
    let f = nvml_sym(nvml.lib().nvmlDeviceGetNvLinkRemoteDeviceType.as_ref())?;
    let mut kind: nvmlIntNvLinkDeviceType_t = LINK_UNKNOWN;
    // SAFETY: declared signature; live handle; `kind` is a valid, writable enum slot.
    nvml_try(unsafe { f(device.handle(), link, &mut kind) })?;
    Ok(match kind {
        LINK_GPU => RemoteDevice::Gpu,
        LINK_SWITCH => RemoteDevice::Switch,
        LINK_IBMNPU => RemoteDevice::IbmNpu,
        _ => RemoteDevice::Unknown,
    })
}

/// `NVML_STRUCT_VERSION(GpuFabricInfo, v)`: the struct's size in the low bits, `v` in the top byte.
const fn fabric_info_version<T>(v: u32) -> u32 {
    size_of::<T>() as u32 | (v << 24)
}
pub(super) const FABRIC_INFO_V3: u32 = fabric_info_version::<nvmlGpuFabricInfo_v3_t>(3);
pub(super) const FABRIC_INFO_V2: u32 = fabric_info_version::<nvmlGpuFabricInfo_v2_t>(2);

/// The GPU's NVLink fabric registration.
///
/// `nvmlDeviceGetGpuFabricInfoV` first, with the newest struct version this build knows (v3,
/// R570+), then v2 when the driver answers "argument version mismatch" (R550); the unversioned
/// `nvmlDeviceGetGpuFabricInfo` (R535) only when the driver lacks the `V` function. Only the
/// fields all versions share are read.
pub fn gpu_fabric_info(nvml: &Nvml, device: &Device<'_>) -> Result<RawFabric, NvmlError> {
    let lib = nvml.lib();
    if let Ok(f) = lib.nvmlDeviceGetGpuFabricInfoV.as_ref() {
        for version in [FABRIC_INFO_V3, FABRIC_INFO_V2] {
            // The v3 layout is v2's plus a trailing field, so one v3 buffer serves both.
            let mut info = nvmlGpuFabricInfo_v3_t {
                version,
                clusterUuid: [0; 16],
                status: 0,
                cliqueId: 0,
                state: NVML_GPU_FABRIC_STATE_NOT_SUPPORTED as u8,
                healthMask: 0,
                healthSummary: 0,
            };
            // SAFETY: declared signature (`nvmlGpuFabricInfoV_t` is the v3 struct); live handle;
            // `info` is an initialized v3 struct, large enough for whichever version `version`
            // announces, and NVML writes at most that version's size.
            let code = unsafe { f(device.handle(), &mut info) };
            match code {
                VERSION_MISMATCH => continue,
                FUNCTION_NOT_FOUND => break,
                code => {
                    nvml_try(code)?;
                    return Ok(fabric(
                        info.clusterUuid,
                        info.cliqueId,
                        info.state,
                        info.status,
                    ));
                }
            }
        }
    }
    let f = nvml_sym(lib.nvmlDeviceGetGpuFabricInfo.as_ref())?;
    let mut info = nvmlGpuFabricInfo_t {
        clusterUuid: [0; 16],
        status: 0,
        cliqueId: 0,
        state: NVML_GPU_FABRIC_STATE_NOT_SUPPORTED as u8,
    };
    // SAFETY: declared signature; live handle; `info` is an initialized struct NVML writes into.
    nvml_try(unsafe { f(device.handle(), &mut info) })?;
    Ok(fabric(
        info.clusterUuid,
        info.cliqueId,
        info.state,
        info.status,
    ))
}

fn fabric(cluster_uuid: [u8; 16], clique_id: u32, state: u8, status: nvmlReturn_t) -> RawFabric {
    RawFabric {
        cluster_uuid,
        clique_id,
        state: FabricState::from_raw(state),
        status: raw(nvml_try(status)),
    }
}

// ------------------------------------------------------------------------------------------------
// MIG reconfiguration: GPU and compute instances created and destroyed
// ------------------------------------------------------------------------------------------------

/// A GPU instance handle, owned by NVML; valid while the instance exists and NVML is loaded.
#[derive(Clone, Copy, Debug)]
pub struct GpuInstance(nvmlGpuInstance_t);

/// A compute instance handle, owned by NVML; valid while the instance exists.
#[derive(Clone, Copy, Debug)]
pub struct ComputeInstance(nvmlComputeInstance_t);

/// `nvmlDeviceCreateGpuInstanceWithPlacement`: a GPU instance of the profile whose `info.id` is
/// `profile_id`, at `placement`.
pub fn create_gpu_instance(
    nvml: &Nvml,
    parent: &Device<'_>,
    profile_id: u32,
    placement: Placement,
) -> Result<GpuInstance, NvmlError> {
    let f = nvml_sym(nvml.lib().nvmlDeviceCreateGpuInstanceWithPlacement.as_ref())?;
    let at = nvmlGpuInstancePlacement_t {
        start: placement.start,
        size: placement.size,
    };
    let mut gi: nvmlGpuInstance_t = ptr::null_mut();
    // SAFETY: declared signature; live parent handle; `at` is a valid placement NVML only
    // reads, and `gi` a valid out-pointer.
    nvml_try(unsafe { f(parent.handle(), profile_id, &at, &mut gi) })?;
    if gi.is_null() {
        return Err(NvmlError::Unknown);
    }
    Ok(GpuInstance(gi))
}

/// `nvmlDeviceGetGpuInstanceById`.
pub fn gpu_instance_by_id(
    nvml: &Nvml,
    parent: &Device<'_>,
    gi_id: u32,
) -> Result<GpuInstance, NvmlError> {
    let f = nvml_sym(nvml.lib().nvmlDeviceGetGpuInstanceById.as_ref())?;
    let mut gi: nvmlGpuInstance_t = ptr::null_mut();
    // SAFETY: declared signature; live parent handle; valid out-pointer.
    nvml_try(unsafe { f(parent.handle(), gi_id, &mut gi) })?;
    if gi.is_null() {
        return Err(NvmlError::Unknown);
    }
    Ok(GpuInstance(gi))
}

/// The id and placement of a GPU instance (`nvmlGpuInstanceGetInfo`).
pub fn gpu_instance_id_of(nvml: &Nvml, gi: GpuInstance) -> Result<u32, NvmlError> {
    let f = nvml_sym(nvml.lib().nvmlGpuInstanceGetInfo.as_ref())?;
    let mut info = nvmlGpuInstanceInfo_t {
        device: ptr::null_mut(),
        id: 0,
        profileId: 0,
        placement: nvmlGpuInstancePlacement_t { start: 0, size: 0 },
    };
    // SAFETY: declared signature; `gi` is a live instance handle NVML gave; `info` is an
    // initialized struct NVML writes into.
    nvml_try(unsafe { f(gi.0, &mut info) })?;
    Ok(info.id)
}

/// The id of the largest compute-instance profile of a GPU instance (the one spanning all of
/// its slices), with shared engines.
pub fn spanning_compute_profile(nvml: &Nvml, gi: GpuInstance) -> Result<u32, NvmlError> {
    let mut best: Option<(u32, u32)> = None;
    let mut last_error = NvmlError::NotSupported;
    for profile in 0..NVML_COMPUTE_INSTANCE_PROFILE_COUNT {
        match compute_profile_info(nvml, gi, profile) {
            Ok(info) => {
                if best.is_none_or(|(slices, _)| info.sliceCount > slices) {
                    best = Some((info.sliceCount, info.id));
                }
            }
            Err(e) => last_error = e,
        }
    }
    best.map(|(_, id)| id).ok_or(last_error)
}

/// `nvmlGpuInstanceGetComputeInstanceProfileInfo` of compute profile `profile` (an index,
/// `NVML_COMPUTE_INSTANCE_PROFILE_*`) with shared engines, in `gi`.
fn compute_profile_info(
    nvml: &Nvml,
    gi: GpuInstance,
    profile: u32,
) -> Result<nvmlComputeInstanceProfileInfo_t, NvmlError> {
    let f = nvml_sym(
        nvml.lib()
            .nvmlGpuInstanceGetComputeInstanceProfileInfo
            .as_ref(),
    )?;
    let mut info = nvmlComputeInstanceProfileInfo_t {
        id: 0,
        sliceCount: 0,
        instanceCount: 0,
        multiprocessorCount: 0,
        sharedCopyEngineCount: 0,
        sharedDecoderCount: 0,
        sharedEncoderCount: 0,
        sharedJpegCount: 0,
        sharedOfaCount: 0,
    };
    // SAFETY: declared signature; live instance handle; `info` is initialized and writable.
    nvml_try(unsafe {
        f(
            gi.0,
            profile,
            NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED,
            &mut info,
        )
    })?;
    Ok(info)
}

/// `nvmlGpuInstanceCreateComputeInstance`; returns the handle and the new instance's id.
pub fn create_compute_instance(
    nvml: &Nvml,
    gi: GpuInstance,
    ci_profile_id: u32,
) -> Result<(ComputeInstance, u32), NvmlError> {
    let lib = nvml.lib();
    let create = nvml_sym(lib.nvmlGpuInstanceCreateComputeInstance.as_ref())?;
    let get_info = nvml_sym(lib.nvmlComputeInstanceGetInfo_v2.as_ref())?;
    let mut ci: nvmlComputeInstance_t = ptr::null_mut();
    // SAFETY: declared signature; live instance handle; valid out-pointer.
    nvml_try(unsafe { create(gi.0, ci_profile_id, &mut ci) })?;
    if ci.is_null() {
        return Err(NvmlError::Unknown);
    }
    let ci = ComputeInstance(ci);
    let mut info = nvmlComputeInstanceInfo_t {
        device: ptr::null_mut(),
        gpuInstance: ptr::null_mut(),
        id: 0,
        profileId: 0,
        placement: nvmlComputeInstancePlacement_t { start: 0, size: 0 },
    };
    // SAFETY: declared signature; the compute instance NVML just created; `info` is an
    // initialized struct NVML writes into.
    match nvml_try(unsafe { get_info(ci.0, &mut info) }) {
        Ok(()) => Ok((ci, info.id)),
        Err(e) => {
            let _ = destroy_compute_instance(nvml, ci);
            Err(e)
        }
    }
}

/// `nvmlGpuInstanceGetComputeInstanceById`.
pub fn compute_instance_by_id(
    nvml: &Nvml,
    gi: GpuInstance,
    ci_id: u32,
) -> Result<ComputeInstance, NvmlError> {
    let f = nvml_sym(nvml.lib().nvmlGpuInstanceGetComputeInstanceById.as_ref())?;
    let mut ci: nvmlComputeInstance_t = ptr::null_mut();
    // SAFETY: declared signature; live instance handle; valid out-pointer.
    nvml_try(unsafe { f(gi.0, ci_id, &mut ci) })?;
    if ci.is_null() {
        return Err(NvmlError::Unknown);
    }
    Ok(ComputeInstance(ci))
}

/// How many times a list is asked for in all when NVML answers `INSUFFICIENT_SIZE` (it grew
/// between two calls: instances created by someone else meanwhile).
const LIST_TRIES: usize = 4;

/// A list NVML writes into the caller's buffer (`count`: its capacity in, the number written
/// out), read NVML's way: with room for `room` entries first (what NVML's documentation says
/// the buffer must hold), then, while NVML answers `INSUFFICIENT_SIZE` and writes back the
/// count it needs, again with that much room, at most [`LIST_TRIES`] calls in all. `call` gets
/// a buffer of `count` initialized entries (`empty`) and `count`.
fn read_list<T: Copy>(
    room: u32,
    empty: T,
    mut call: impl FnMut(*mut T, *mut c_uint) -> nvmlReturn_t,
) -> Result<Vec<T>, NvmlError> {
    let mut room = room.max(1);
    for _ in 0..LIST_TRIES {
        let mut buf = vec![empty; room as usize];
        let mut count = room;
        match call(buf.as_mut_ptr(), &mut count) {
            INSUFFICIENT_SIZE => room = count.max(room.saturating_add(1)),
            code => {
                nvml_try(code)?;
                buf.truncate((count as usize).min(buf.len()));
                return Ok(buf);
            }
        }
    }
    Err(NvmlError::InsufficientSize(Some(room as usize)))
}

/// The number of compute instances in a GPU instance, of every profile
/// (`nvmlGpuInstanceGetComputeInstances`, which takes a buffer per profile id that NVML's
/// documentation says must hold the instances the profile supports: its `instanceCount`, from
/// `nvmlGpuInstanceGetComputeInstanceProfileInfo`).
pub fn compute_instance_count(nvml: &Nvml, gi: GpuInstance) -> Result<u32, NvmlError> {
    let lib = nvml.lib();
    let f = nvml_sym(lib.nvmlGpuInstanceGetComputeInstances.as_ref())?;
    let mut total = 0;
    for profile in 0..NVML_COMPUTE_INSTANCE_PROFILE_COUNT {
        let room = match compute_profile_info(nvml, gi, profile) {
            Ok(info) => info.instanceCount,
            // A profile this instance does not support has no instances.
            Err(NvmlError::NotSupported | NvmlError::InvalidArg | NvmlError::NotFound) => continue,
            Err(e) => return Err(e),
        };
        // SAFETY: declared signature; live instance handle; `buf` holds `count` writable slots
        // and NVML writes at most that many, storing the number written into `count`.
        let listed = read_list(room, ptr::null_mut(), |buf, count| unsafe {
            f(gi.0, profile, buf, count)
        });
        match listed {
            Ok(cis) => total += cis.len() as u32,
            Err(NvmlError::NotSupported | NvmlError::InvalidArg | NvmlError::NotFound) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(total)
}

/// The GPU instances of one profile on `parent` (`nvmlDeviceGetGpuInstances`), with their ids
/// and placements. The buffer holds as many as the profile has possible placements (no two
/// instances share one); NVML's call takes no null buffer to ask for the count.
pub fn gpu_instances(
    nvml: &Nvml,
    parent: &Device<'_>,
    profile_id: u32,
) -> Result<Vec<(GpuInstance, u32, Placement)>, NvmlError> {
    let lib = nvml.lib();
    let list = nvml_sym(lib.nvmlDeviceGetGpuInstances.as_ref())?;
    let get_info = nvml_sym(lib.nvmlGpuInstanceGetInfo.as_ref())?;
    // Where the placements cannot be read, 8 (more than any GPU's instances of one profile
    // today) and NVML's INSUFFICIENT_SIZE answer if that is too few.
    let room = possible_placements(nvml, parent, profile_id)
        .map(|p| p.len() as u32)
        .unwrap_or(8);
    // SAFETY: declared signature; live parent handle; `buf` holds `count` writable slots.
    let listed = read_list(room, ptr::null_mut(), |buf, count| unsafe {
        list(parent.handle(), profile_id, buf, count)
    })?;
    let mut out = Vec::new();
    for gi in listed {
        if gi.is_null() {
            continue;
        }
        let mut info = nvmlGpuInstanceInfo_t {
            device: ptr::null_mut(),
            id: 0,
            profileId: 0,
            placement: nvmlGpuInstancePlacement_t { start: 0, size: 0 },
        };
        // SAFETY: declared signature; `gi` is a handle NVML just listed; `info` is writable.
        nvml_try(unsafe { get_info(gi, &mut info) })?;
        out.push((
            GpuInstance(gi),
            info.id,
            Placement {
                start: info.placement.start,
                size: info.placement.size,
            },
        ));
    }
    Ok(out)
}

/// `nvmlComputeInstanceDestroy`.
pub fn destroy_compute_instance(nvml: &Nvml, ci: ComputeInstance) -> Result<(), NvmlError> {
    let f = nvml_sym(nvml.lib().nvmlComputeInstanceDestroy.as_ref())?;
    // SAFETY: declared signature; a live compute instance handle, not used after this call.
    nvml_try(unsafe { f(ci.0) })
}

/// `nvmlGpuInstanceDestroy`.
pub fn destroy_gpu_instance(nvml: &Nvml, gi: GpuInstance) -> Result<(), NvmlError> {
    let f = nvml_sym(nvml.lib().nvmlGpuInstanceDestroy.as_ref())?;
    // SAFETY: declared signature; a live GPU instance handle, not used after this call.
    nvml_try(unsafe { f(gi.0) })
}

/// Whether the loaded library has every symbol MIG creation and destruction need.
pub fn has_mig_reconfiguration(nvml: &Nvml) -> Result<(), &'static str> {
    let lib = nvml.lib();
    for (name, present) in [
        (
            "nvmlDeviceCreateGpuInstanceWithPlacement",
            lib.nvmlDeviceCreateGpuInstanceWithPlacement.is_ok(),
        ),
        (
            "nvmlGpuInstanceGetComputeInstanceProfileInfo",
            lib.nvmlGpuInstanceGetComputeInstanceProfileInfo.is_ok(),
        ),
        (
            "nvmlGpuInstanceCreateComputeInstance",
            lib.nvmlGpuInstanceCreateComputeInstance.is_ok(),
        ),
        (
            "nvmlComputeInstanceGetInfo_v2",
            lib.nvmlComputeInstanceGetInfo_v2.is_ok(),
        ),
        (
            "nvmlGpuInstanceGetComputeInstanceById",
            lib.nvmlGpuInstanceGetComputeInstanceById.is_ok(),
        ),
        (
            "nvmlComputeInstanceDestroy",
            lib.nvmlComputeInstanceDestroy.is_ok(),
        ),
        ("nvmlGpuInstanceDestroy", lib.nvmlGpuInstanceDestroy.is_ok()),
    ] {
        if !present {
            return Err(name);
        }
    }
    Ok(())
}

// ------------------------------------------------------------------------------------------------
// Per-cgroup memory limits (MPS v3 memory partitioning, R615 / CUDA 13.4): nvml-wrapper-sys's
// table predates them, so their symbols are resolved here by name.
// ------------------------------------------------------------------------------------------------

/// `nvmlDeviceSetMemoryLimits_v1`.
pub const SET_MEMORY_LIMITS: &str = "nvmlDeviceSetMemoryLimits_v1";
/// `nvmlDeviceGetMemoryLimits_v1`.
pub const GET_MEMORY_LIMITS: &str = "nvmlDeviceGetMemoryLimits_v1";

/// `nvmlSetMemoryLimits_v1_t` (nvml.h): the cgroup by the full path of its sysfs directory, and
/// the limits to set, in bytes.
#[repr(C)]
struct SetMemoryLimitsV1 {
    name_space: *const c_char,
    soft_limit: c_ulonglong,
    hard_limit: c_ulonglong,
}

/// `nvmlGetMemoryLimits_v1_t` (nvml.h): the cgroup in, its limits and the memory it uses out.
#[repr(C)]
struct GetMemoryLimitsV1 {
    name_space: *const c_char,
    soft_limit: c_ulonglong,
    hard_limit: c_ulonglong,
    current_used: c_ulonglong,
}

/// `nvmlReturn_t nvmlDeviceSetMemoryLimits_v1(nvmlDevice_t, nvmlSetMemoryLimits_v1_t *)`.
type SetMemoryLimitsFn = unsafe extern "C" fn(nvmlDevice_t, *mut SetMemoryLimitsV1) -> nvmlReturn_t;
/// `nvmlReturn_t nvmlDeviceGetMemoryLimits_v1(nvmlDevice_t, nvmlGetMemoryLimits_v1_t *)`.
type GetMemoryLimitsFn = unsafe extern "C" fn(nvmlDevice_t, *mut GetMemoryLimitsV1) -> nvmlReturn_t;

/// The cgroup directory as the C string NVML reads.
fn name_space(cgroup: &Path) -> Result<CString, NvmlError> {
    Ok(CString::new(cgroup.as_os_str().as_bytes())?)
}

/// `nvmlDeviceSetMemoryLimits_v1` on `cgroup` (its full sysfs path). Needs root. A library
/// without the symbol (a driver older than R615) is [`NvmlError::FailedToLoadSymbol`].
pub fn set_memory_limits(
    nvml: &Nvml,
    device: &Device<'_>,
    cgroup: &Path,
    limits: MemoryLimits,
) -> Result<(), NvmlError> {
    // SAFETY: `SetMemoryLimitsFn` is the signature nvml.h declares for this symbol.
    let f = unsafe { symbol::<SetMemoryLimitsFn>(nvml, SET_MEMORY_LIMITS) }?;
    let ns = name_space(cgroup)?;
    let mut arg = SetMemoryLimitsV1 {
        name_space: ns.as_ptr(),
        soft_limit: limits.soft,
        hard_limit: limits.hard,
    };
    // SAFETY: declared signature, from the library `nvml` keeps loaded for this borrow; live
    // handle; `arg` is fully initialized and its `name_space` points to `ns`, a NUL-terminated
    // string that outlives the call. NVML keeps no pointer into either.
    nvml_try(unsafe { f(device.handle(), &mut arg) })
}

/// `nvmlDeviceGetMemoryLimits_v1` on `cgroup`: its limits and the memory it uses, in bytes.
/// Needs no privilege.
pub fn memory_limits(
    nvml: &Nvml,
    device: &Device<'_>,
    cgroup: &Path,
) -> Result<(MemoryLimits, u64), NvmlError> {
    // SAFETY: `GetMemoryLimitsFn` is the signature nvml.h declares for this symbol.
    let f = unsafe { symbol::<GetMemoryLimitsFn>(nvml, GET_MEMORY_LIMITS) }?;
    let ns = name_space(cgroup)?;
    let mut arg = GetMemoryLimitsV1 {
        name_space: ns.as_ptr(),
        soft_limit: 0,
        hard_limit: 0,
        current_used: 0,
    };
    // SAFETY: as in `set_memory_limits`; NVML writes only the three out-fields of `arg`.
    nvml_try(unsafe { f(device.handle(), &mut arg) })?;
    Ok((
        MemoryLimits {
            soft: arg.soft_limit,
            hard: arg.hard_limit,
        },
        arg.current_used,
    ))
}

/// The function `name` of the library `nvml` loaded, as a `T`.
///
/// # Safety
/// `T` must be the function pointer type nvml.h declares for `name`. The pointer returned is
/// valid while the library is loaded: callers use it only while they borrow `nvml`.
unsafe fn symbol<T: Copy>(nvml: &Nvml, name: &str) -> Result<T, NvmlError> {
    let mut cname = name.as_bytes().to_vec();
    cname.push(0);
    // SAFETY: the caller's contract: `T` is the symbol's declared type.
    unsafe { nvml.lib().__library.get::<T>(&cname) }
        .map(|s| *s)
        .map_err(|e| NvmlError::FailedToLoadSymbol(format!("{name}: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;

    /// NVML's side of a listing call over `items` (which `grow` may add to before each call):
    /// `INSUFFICIENT_SIZE` and the count needed when the buffer is too small, else the items
    /// and their count, as `nvml.h` documents it and the fake NVML answers.
    fn nvml_list(
        items: &RefCell<Vec<u32>>,
        grow: impl Fn(&mut Vec<u32>),
    ) -> impl FnMut(*mut u32, *mut c_uint) -> nvmlReturn_t {
        move |buf, count| {
            grow(&mut items.borrow_mut());
            let items = items.borrow();
            // SAFETY: `read_list` passes a valid count and a buffer of that many entries.
            unsafe {
                if (*count as usize) < items.len() {
                    *count = items.len() as c_uint;
                    return INSUFFICIENT_SIZE;
                }
                for (i, v) in items.iter().enumerate() {
                    *buf.add(i) = *v;
                }
                *count = items.len() as c_uint;
            }
            0
        }
    }

    #[test]
    fn a_list_longer_than_its_first_buffer_is_read_whole() {
        // Twenty entries against room for eight (what the buffers held before).
        let items = RefCell::new((0..20).collect());
        let got = read_list(8, 0, nvml_list(&items, |_| {})).unwrap();
        assert_eq!(got, (0..20).collect::<Vec<_>>());
        // Room enough at once: one call, the entries NVML wrote.
        let got = read_list(64, 0, nvml_list(&items, |_| {})).unwrap();
        assert_eq!(got.len(), 20);
    }

    #[test]
    fn a_list_that_grows_between_calls_is_asked_again_a_bounded_number_of_times() {
        // Two more each call: the second call's room is what the first said, too few again.
        let items = RefCell::new((0..10).collect());
        let grow = |v: &mut Vec<u32>| {
            let n = v.len() as u32;
            v.extend([n, n + 1]);
        };
        let got = read_list(8, 0, nvml_list(&items, grow)).unwrap_err();
        assert!(
            matches!(got, NvmlError::InsufficientSize(Some(_))),
            "{got:?}"
        );
        // Once it stops growing it is read whole.
        let calls = std::cell::Cell::new(0);
        let items = RefCell::new((0..10).collect());
        let grow_twice = |v: &mut Vec<u32>| {
            calls.set(calls.get() + 1);
            if calls.get() <= 2 {
                let n = v.len() as u32;
                v.push(n);
            }
        };
        let got = read_list(8, 0, nvml_list(&items, grow_twice)).unwrap();
        assert_eq!(got, (0..12).collect::<Vec<_>>());
        assert_eq!(calls.get(), 3);
    }
}
