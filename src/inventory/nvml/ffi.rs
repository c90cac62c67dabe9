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
    nvmlGpuInstance_t, nvmlGpuInstanceInfo_t, nvmlGpuInstancePlacement_t,
    nvmlIntNvLinkDeviceType_enum_NVML_NVLINK_DEVICE_TYPE_GPU as LINK_GPU,
    nvmlIntNvLinkDeviceType_enum_NVML_NVLINK_DEVICE_TYPE_IBMNPU as LINK_IBMNPU,
    nvmlIntNvLinkDeviceType_enum_NVML_NVLINK_DEVICE_TYPE_SWITCH as LINK_SWITCH,
    nvmlIntNvLinkDeviceType_enum_NVML_NVLINK_DEVICE_TYPE_UNKNOWN as LINK_UNKNOWN,
    nvmlIntNvLinkDeviceType_t,
};

use super::{Placement, RawGpuInstance, RemoteDevice};

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
