//! Raw capture ([`read_raw`]): every NVML answer, success or failure, as plain owned values.

use std::fmt;

use nvml_wrapper::enum_wrappers::device::{Brand, GpuVirtualizationMode};
use nvml_wrapper::enums::device::DeviceArchitecture;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::struct_wrappers::device::{DeviceAttributes, ProfileInfo};
use nvml_wrapper::{Device, Nvml};
use tracing::debug;

use super::{GI_PROFILE_COUNT, NVLINK_MAX_LINKS, RawFabric, RawNvLink, RawPci, ffi};
use crate::inventory::{ComputeCapability, Error, Placement, Result};

/// Why an NVML call gave no value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CallError {
    /// `NVML_ERROR_NOT_SUPPORTED`: this GPU or driver does not do that (MIG on an L40S).
    NotSupported,
    /// `NVML_ERROR_NOT_FOUND`: the object does not exist (an empty MIG slot).
    NotFound,
    /// The installed driver's library lacks the function (older than the feature).
    Missing(String),
    /// `NVML_ERROR_NOT_READY`: not yet (a fabric registration in progress); a later read may
    /// succeed.
    NotReady,
    /// Any other failure, as NVML describes it.
    Failed(String),
}

impl fmt::Display for CallError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CallError::NotSupported => f.write_str("not supported"),
            CallError::NotFound => f.write_str("not found"),
            CallError::NotReady => f.write_str("not ready (NVML_ERROR_NOT_READY)"),
            CallError::Missing(s) => write!(f, "function missing from the NVML library ({s})"),
            CallError::Failed(s) => f.write_str(s),
        }
    }
}

impl From<NvmlError> for CallError {
    fn from(e: NvmlError) -> Self {
        match e {
            NvmlError::NotSupported => CallError::NotSupported,
            NvmlError::NotFound => CallError::NotFound,
            NvmlError::FailedToLoadSymbol(s) => CallError::Missing(s),
            NvmlError::FunctionNotFound => CallError::Missing("function not found".into()),
            // nvml-wrapper has no variant of its own for it.
            NvmlError::UnexpectedVariant(
                nvml_wrapper_sys::bindings::nvmlReturn_enum_NVML_ERROR_NOT_READY,
            ) => CallError::NotReady,
            other => CallError::Failed(other.to_string()),
        }
    }
}

/// The answer to one NVML call.
pub type RawResult<T> = std::result::Result<T, CallError>;

pub(super) fn raw<T>(r: std::result::Result<T, NvmlError>) -> RawResult<T> {
    r.map_err(CallError::from)
}

/// Everything NVML said about the node.
#[derive(Clone, Debug)]
pub struct RawNode {
    /// `nvmlSystemGetDriverVersion`, e.g. `570.124.06`.
    pub driver_version: RawResult<String>,
    /// `nvmlSystemGetCudaDriverVersion`, e.g. `12080`.
    pub cuda_driver_version: RawResult<i32>,
    pub gpus: Vec<RawGpu>,
    /// GPUs NVML counts but whose handle it would not give (fallen off the bus, no permission).
    pub unreadable: Vec<(u32, CallError)>,
}

/// Everything NVML said about one physical GPU.
#[derive(Clone, Debug)]
pub struct RawGpu {
    /// NVML's index (`nvmlDeviceGetHandleByIndex`).
    pub index: u32,
    pub minor: RawResult<u32>,
    pub uuid: RawResult<String>,
    pub name: RawResult<String>,
    pub brand: RawResult<Brand>,
    pub architecture: RawResult<DeviceArchitecture>,
    pub compute_capability: RawResult<ComputeCapability>,
    /// `nvmlDeviceGetMemoryInfo` total, in bytes.
    pub memory_total_bytes: RawResult<u64>,
    /// `nvmlDeviceGetAttributes_v2`; most drivers answer only for MIG devices.
    pub attributes: RawResult<DeviceAttributes>,
    /// `nvmlDeviceGetNumGpuCores` (CUDA cores), for the SM count when attributes are missing.
    pub cuda_cores: RawResult<u32>,
    /// As NVML formats it, e.g. `00000000:07:00.0`.
    pub pci_bus_id: RawResult<String>,
    /// `nvmlDeviceGetNumaNodeId`: the GPU memory's own NUMA node on coherent platforms.
    pub numa_node: RawResult<u32>,
    pub mig_mode: RawResult<RawMigMode>,
    /// GPU-instance profiles this GPU supports (those NVML answered for).
    pub gi_profiles: Vec<RawGiProfile>,
    /// Existing MIG devices (only read in MIG mode).
    pub mig_devices: Vec<RawMigDevice>,
    /// Active NVLinks.
    pub nvlinks: Vec<RawNvLink>,
    /// The NVLink fabric registration (`nvmlDeviceGetGpuFabricInfoV`).
    pub fabric: RawResult<RawFabric>,
    /// `nvmlDeviceGetVirtualizationMode`: bare metal, passthrough, vGPU guest or host.
    pub virtualization: RawResult<GpuVirtualizationMode>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RawMigMode {
    pub current: bool,
    pub pending: bool,
}

/// One GPU-instance profile a GPU supports.
#[derive(Clone, Debug)]
pub struct RawGiProfile {
    /// The `NVML_GPU_INSTANCE_PROFILE_*` index it was queried with (names derive from it:
    /// `…_REV1` is the media-extension `+me` variant).
    pub profile: u32,
    /// `info.id` is what GPU instances report as their `profileId` (19 for A100 `1g.5gb`).
    pub info: ProfileInfo,
    pub placements: RawResult<Vec<Placement>>,
}

/// One existing MIG device.
#[derive(Clone, Debug)]
pub struct RawMigDevice {
    /// Its index among the parent's MIG device handles.
    pub slot: u32,
    pub uuid: RawResult<String>,
    pub attributes: RawResult<DeviceAttributes>,
    pub gi_id: RawResult<u32>,
    pub ci_id: RawResult<u32>,
    /// `nvmlGpuInstanceGetInfo` of its GPU instance.
    pub gpu_instance: RawResult<RawGpuInstance>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RawGpuInstance {
    /// Matches [`ProfileInfo::id`] of one of the parent's profiles.
    pub profile_id: u32,
    pub placement: Placement,
}

/// Makes every NVML call a snapshot needs. Fails only when NVML cannot count the GPUs.
pub fn read_raw(nvml: &Nvml) -> Result<RawNode> {
    let count = nvml.device_count().map_err(|e| Error::Nvml {
        call: "nvmlDeviceGetCount".into(),
        reason: e.to_string(),
    })?;
    let mut gpus = Vec::new();
    let mut unreadable = Vec::new();
    for index in 0..count {
        match nvml.device_by_index(index) {
            Ok(device) => gpus.push(read_gpu(nvml, index, &device)),
            Err(e) => unreadable.push((index, e.into())),
        }
    }
    Ok(RawNode {
        driver_version: raw(nvml.sys_driver_version()),
        cuda_driver_version: raw(nvml.sys_cuda_driver_version()),
        gpus,
        unreadable,
    })
}

pub(super) fn read_gpu(nvml: &Nvml, index: u32, d: &Device<'_>) -> RawGpu {
    let mig_mode = raw(d.mig_mode()).map(|m| RawMigMode {
        current: m.current == nvml_wrapper_sys::bindings::NVML_DEVICE_MIG_ENABLE,
        pending: m.pending == nvml_wrapper_sys::bindings::NVML_DEVICE_MIG_ENABLE,
    });
    let (gi_profiles, mig_devices) = match mig_mode {
        Ok(mode) => (
            read_gi_profiles(nvml, d),
            if mode.current {
                read_mig_devices(nvml, d)
            } else {
                Vec::new()
            },
        ),
        Err(_) => (Vec::new(), Vec::new()),
    };
    RawGpu {
        index,
        minor: raw(d.minor_number()),
        uuid: raw(d.uuid()),
        name: raw(d.name()),
        brand: raw(d.brand()),
        architecture: raw(d.architecture()),
        compute_capability: raw(d.cuda_compute_capability()).and_then(|cc| {
            match (u32::try_from(cc.major), u32::try_from(cc.minor)) {
                (Ok(major), Ok(minor)) => Ok(ComputeCapability { major, minor }),
                _ => Err(CallError::Failed(format!(
                    "negative compute capability {}.{}",
                    cc.major, cc.minor
                ))),
            }
        }),
        memory_total_bytes: raw(d.memory_info()).map(|m| m.total),
        attributes: raw(d.attributes()),
        cuda_cores: raw(d.num_cores()),
        pci_bus_id: raw(d.pci_info()).map(|p| p.bus_id),
        numa_node: raw(d.numa_node_id()),
        mig_mode,
        gi_profiles,
        mig_devices,
        nvlinks: read_nvlinks(nvml, d),
        fabric: raw(ffi::gpu_fabric_info(nvml, d)),
        virtualization: raw(d.virtualization_mode()),
    }
}

pub(super) fn read_gi_profiles(nvml: &Nvml, d: &Device<'_>) -> Vec<RawGiProfile> {
    let mut out = Vec::new();
    for profile in 0..GI_PROFILE_COUNT {
        match d.profile_info(profile) {
            Ok(info) => {
                let placements = raw(ffi::possible_placements(nvml, d, info.id));
                out.push(RawGiProfile {
                    profile,
                    info,
                    placements,
                });
            }
            // Profiles this GPU does not offer answer NotSupported or InvalidArg.
            Err(NvmlError::NotSupported | NvmlError::InvalidArg) => {}
            Err(e) => debug!(profile, error = %e, "nvmlDeviceGetGpuInstanceProfileInfo failed"),
        }
    }
    out
}

pub(super) fn read_mig_devices(nvml: &Nvml, parent: &Device<'_>) -> Vec<RawMigDevice> {
    let max = match parent.mig_device_count() {
        Ok(n) => n,
        Err(e) => {
            debug!(error = %e, "nvmlDeviceGetMaxMigDeviceCount failed");
            return Vec::new();
        }
    };
    let mut out = Vec::new();
    for slot in 0..max {
        let mig = match parent.mig_device_by_index(slot) {
            Ok(m) => m,
            // Empty slots answer NotFound (or InvalidArg on some drivers).
            Err(NvmlError::NotFound | NvmlError::InvalidArg) => continue,
            Err(e) => {
                debug!(slot, error = %e, "nvmlDeviceGetMigDeviceHandleByIndex failed");
                continue;
            }
        };
        let gi_id = raw(ffi::gpu_instance_id(nvml, &mig));
        let gpu_instance = match &gi_id {
            Ok(id) => raw(ffi::gpu_instance_info(nvml, parent, *id)),
            Err(e) => Err(e.clone()),
        };
        out.push(RawMigDevice {
            slot,
            uuid: raw(mig.uuid()),
            attributes: raw(mig.attributes()),
            gi_id,
            ci_id: raw(ffi::compute_instance_id(nvml, &mig)),
            gpu_instance,
        });
    }
    out
}

pub(super) fn read_nvlinks(nvml: &Nvml, d: &Device<'_>) -> Vec<RawNvLink> {
    let mut out = Vec::new();
    for link in 0..NVLINK_MAX_LINKS {
        let wrapper = d.link_wrapper_for(link);
        match wrapper.is_active() {
            Ok(true) => out.push(RawNvLink {
                link,
                remote_pci: raw(wrapper.remote_pci_info()).map(|p| RawPci {
                    bus_id: p.bus_id,
                    domain: p.domain,
                    bus: p.bus,
                    device: p.device,
                }),
                remote_type: raw(ffi::nvlink_remote_type(nvml, d, link)),
            }),
            Ok(false) => {}
            // No NVLink on this GPU at all: every link answers the same, stop asking.
            Err(NvmlError::NotSupported) if link == 0 => break,
            Err(NvmlError::NotSupported | NvmlError::InvalidArg) => {}
            Err(e) => debug!(link, error = %e, "nvmlDeviceGetNvLinkState failed"),
        }
    }
    out
}
