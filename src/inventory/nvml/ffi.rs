//! Raw NVML calls nvml-wrapper 0.13 lacks or gets wrong.
//!
//! The only `unsafe` code of the NVML backend. Each function resolves its symbol from the loaded
//! library's table (`Result` fields: a symbol the driver lacks is an error, not a panic), calls
//! it with out-pointers to locals, and converts the answer to owned values.

use std::os::raw::c_uint;
use std::ptr;

use nvml_wrapper::error::{NvmlError, nvml_sym, nvml_try};
use nvml_wrapper::{Device, Nvml};
use nvml_wrapper_sys::bindings::{
    NVML_GPU_FABRIC_STATE_NOT_SUPPORTED, nvmlGpuFabricInfo_t, nvmlGpuFabricInfo_v2_t,
    nvmlGpuFabricInfo_v3_t, nvmlGpuInstance_t, nvmlGpuInstanceInfo_t, nvmlGpuInstancePlacement_t,
    nvmlIntNvLinkDeviceType_enum_NVML_NVLINK_DEVICE_TYPE_GPU as LINK_GPU,
    nvmlIntNvLinkDeviceType_enum_NVML_NVLINK_DEVICE_TYPE_IBMNPU as LINK_IBMNPU,
    nvmlIntNvLinkDeviceType_enum_NVML_NVLINK_DEVICE_TYPE_SWITCH as LINK_SWITCH,
    nvmlIntNvLinkDeviceType_enum_NVML_NVLINK_DEVICE_TYPE_UNKNOWN as LINK_UNKNOWN,
    nvmlIntNvLinkDeviceType_t,
    nvmlReturn_enum_NVML_ERROR_ARGUMENT_VERSION_MISMATCH as VERSION_MISMATCH,
    nvmlReturn_enum_NVML_ERROR_FUNCTION_NOT_FOUND as FUNCTION_NOT_FOUND, nvmlReturn_t,
};

use super::{FabricState, Placement, RawFabric, RawGpuInstance, RemoteDevice, raw};

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
