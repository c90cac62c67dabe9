//! NVML enums and numbers as inventory facts: versions, brand and architecture names, MIG profile
//! names and engine counts.

use nvml_wrapper::enum_wrappers::device::Brand;
use nvml_wrapper::enums::device::DeviceArchitecture;
use nvml_wrapper::struct_wrappers::device::{DeviceAttributes, ProfileInfo};

use super::{GIB, MIB};
use crate::inventory::{ComputeCapability, Engines};

/// Formats NVML's CUDA driver version (`1000 * major + 10 * minor`): 12040 → `12.4`.
pub fn format_cuda_version(v: i32) -> Option<String> {
    (v > 0).then(|| format!("{}.{}", v / 1000, (v % 1000) / 10))
}

/// The brand as NVIDIA's Kubernetes components publish it (`Nvidia`, `GeForceRTX`, …).
pub fn brand_name(b: &Brand) -> &'static str {
    match b {
        Brand::Unknown => "Unknown",
        Brand::Quadro => "Quadro",
        Brand::Tesla => "Tesla",
        Brand::NVS => "NVS",
        Brand::GRID => "GRID",
        Brand::GeForce => "GeForce",
        Brand::Titan => "Titan",
        Brand::VApps => "vApps",
        Brand::VPC => "VPC",
        Brand::VCS => "VCS",
        Brand::VWS => "VWS",
        Brand::CloudGaming | Brand::VGaming => "CloudGaming",
        Brand::QuadroRTX => "QuadroRTX",
        Brand::NvidiaRTX => "NvidiaRTX",
        Brand::Nvidia => "Nvidia",
        Brand::GeForceRTX => "GeForceRTX",
        Brand::TitanRTX => "TitanRTX",
    }
}

/// The architecture name NVML reports, or `None` when it does not know it.
pub fn architecture_name(a: &DeviceArchitecture) -> Option<&'static str> {
    Some(match a {
        DeviceArchitecture::Kepler => "Kepler",
        DeviceArchitecture::Maxwell => "Maxwell",
        DeviceArchitecture::Pascal => "Pascal",
        DeviceArchitecture::Volta => "Volta",
        DeviceArchitecture::Turing => "Turing",
        DeviceArchitecture::Ampere => "Ampere",
        DeviceArchitecture::Ada => "Ada Lovelace",
        DeviceArchitecture::Hopper => "Hopper",
        DeviceArchitecture::Blackwell => "Blackwell",
        DeviceArchitecture::Unknown => return None,
    })
}

/// The architecture a compute capability belongs to, for drivers older than the GPU.
pub fn architecture_from_cc(cc: ComputeCapability) -> Option<&'static str> {
    Some(match (cc.major, cc.minor) {
        (3, _) => "Kepler",
        (5, _) => "Maxwell",
        (6, _) => "Pascal",
        (7, 0 | 2) => "Volta",
        (7, _) => "Turing",
        (8, 9) => "Ada Lovelace",
        (8, _) => "Ampere",
        (9, _) => "Hopper",
        (10.., _) => "Blackwell",
        _ => return None,
    })
}

/// CUDA cores per SM, to turn `nvmlDeviceGetNumGpuCores` into an SM count.
pub(super) fn cores_per_sm(cc: ComputeCapability) -> Option<u32> {
    match (cc.major, cc.minor) {
        (6, 0) | (7, _) | (8, 0) => Some(64),
        (6, _) | (8, _) | (9, _) | (10..=12, _) => Some(128),
        _ => None,
    }
}

/// The GB figure of a MIG profile name, computed as NVIDIA does: the profile's share of the
/// GPU's memory rounded up to eighths, times the GPU's memory in whole GiB, rounded.
pub fn mig_memory_gb(total_bytes: u64, profile_mib: u64) -> u64 {
    if total_bytes == 0 {
        return (profile_mib as f64 / 1024.0).round() as u64;
    }
    let fraction = (profile_mib * MIB) as f64 / total_bytes as f64;
    let eighths = (fraction * 8.0).ceil() / 8.0;
    let total_gib = total_bytes.div_ceil(GIB) as f64;
    (eighths * total_gib).round() as u64
}

/// The suffix NVIDIA gives a GPU-instance profile variant.
pub(super) fn profile_suffix(profile: u32) -> &'static str {
    use nvml_wrapper_sys::bindings as b;
    match profile {
        b::NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1 | b::NVML_GPU_INSTANCE_PROFILE_2_SLICE_REV1 => {
            "+me"
        }
        b::NVML_GPU_INSTANCE_PROFILE_1_SLICE_GFX
        | b::NVML_GPU_INSTANCE_PROFILE_2_SLICE_GFX
        | b::NVML_GPU_INSTANCE_PROFILE_4_SLICE_GFX => "+gfx",
        b::NVML_GPU_INSTANCE_PROFILE_1_SLICE_NO_ME | b::NVML_GPU_INSTANCE_PROFILE_2_SLICE_NO_ME => {
            "-me"
        }
        b::NVML_GPU_INSTANCE_PROFILE_1_SLICE_ALL_ME
        | b::NVML_GPU_INSTANCE_PROFILE_2_SLICE_ALL_ME => "+me.all",
        _ => "",
    }
}

/// A MIG profile name: `<G>g.<GB>gb`, `<C>c.<G>g.<GB>gb` when the compute instance is smaller
/// than its GPU instance, plus the variant suffix (`+me`, `+gfx`, `-me`, `+me.all`).
pub fn mig_profile_name(
    profile: Option<u32>,
    gi_slices: u32,
    ci_slices: u32,
    profile_mib: u64,
    total_bytes: u64,
) -> String {
    let gb = mig_memory_gb(total_bytes, profile_mib);
    let suffix = profile.map_or("", profile_suffix);
    if ci_slices != 0 && ci_slices < gi_slices {
        format!("{ci_slices}c.{gi_slices}g.{gb}gb{suffix}")
    } else {
        format!("{gi_slices}g.{gb}gb{suffix}")
    }
}

pub(super) fn profile_engines(info: &ProfileInfo) -> Engines {
    Engines {
        copy_engines: info.copy_engine_count,
        decoders: info.decoder_count,
        encoders: info.encoder_count,
        jpeg_engines: info.jpeg_count,
        ofa_engines: info.ofa_count,
    }
}

pub(super) fn attribute_engines(a: &DeviceAttributes) -> Engines {
    Engines {
        copy_engines: a.shared_copy_engine_count,
        decoders: a.shared_decoder_count,
        encoders: a.shared_encoder_count,
        jpeg_engines: a.shared_jpeg_count,
        ofa_engines: a.shared_ofa_count,
    }
}
