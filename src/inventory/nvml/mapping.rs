//! Mapping ([`map`]): a [`RawNode`] plus sysfs into an [`Inventory`], pure, listing every omission.

use std::collections::BTreeSet;

use nvml_wrapper::enum_wrappers::device::{Brand, GpuVirtualizationMode};
use tracing::{Level, debug, warn};

use super::names::{attribute_engines, cores_per_sm, profile_engines};
use super::sysfs::parse_numa;
use super::{
    CallError, MIB, Omission, RawGiProfile, RawGpu, RawMigDevice, RawMigMode, RawNode, RawResult,
    Sysfs, architecture_from_cc, architecture_name, brand_name, fabric, format_cuda_version,
    mig_profile_name, pcie_root_of,
};
use crate::inventory::{
    Error, Gpu, GpuUuid, Health, Inventory, Mig, MigDevice, MigProfile, MigUuid, PciBusId, Result,
    Virtualization,
};

/// Turns what NVML and sysfs said into an [`Inventory`], logging every omission. See the module
/// doc for what is required and what degrades.
pub fn map(raw: RawNode, sysfs: &impl Sysfs) -> Result<Inventory> {
    let (inv, omissions) = map_with_omissions(raw, sysfs)?;
    for o in &omissions {
        o.log();
    }
    Ok(inv)
}

/// [`map`], returning the omissions instead of logging them (the backend logs each once).
pub fn map_with_omissions(raw: RawNode, sysfs: &impl Sysfs) -> Result<(Inventory, Vec<Omission>)> {
    let RawNode {
        driver_version,
        cuda_driver_version,
        gpus,
        unreadable,
    } = raw;
    let driver_version = driver_version
        .map_err(|e| Error::Nvml {
            call: "nvmlSystemGetDriverVersion".into(),
            reason: e.to_string(),
        })?
        .trim()
        .to_string();
    let cuda_raw = cuda_driver_version.map_err(|e| Error::Nvml {
        call: "nvmlSystemGetCudaDriverVersion".into(),
        reason: e.to_string(),
    })?;
    let cuda_driver_version = format_cuda_version(cuda_raw).ok_or_else(|| Error::Nvml {
        call: "nvmlSystemGetCudaDriverVersion".into(),
        reason: format!("invalid CUDA driver version {cuda_raw}"),
    })?;
    for (index, e) in &unreadable {
        warn!(gpu.index = index, error = %e, "skipping GPU: NVML gives no handle for it");
    }

    let node_buses: BTreeSet<PciBusId> = gpus
        .iter()
        .filter_map(|g| g.pci_bus_id.as_ref().ok())
        .filter_map(|b| PciBusId::normalize(b))
        .collect();
    let versions = Versions {
        driver: driver_version,
        cuda: cuda_driver_version,
    };
    let mut omissions = Vec::new();
    let mapped = gpus
        .into_iter()
        .filter_map(|g| map_gpu(g, &versions, &node_buses, sysfs, &mut omissions))
        .collect();
    Ok((Inventory::new(mapped)?, omissions))
}

pub(super) struct Versions {
    pub(super) driver: String,
    pub(super) cuda: String,
}

/// Unwraps a required per-GPU answer, or logs why the GPU is left out.
pub(super) fn required<T>(index: u32, call: &str, r: RawResult<T>) -> Option<T> {
    r.map_err(|e| warn!(gpu.index = index, call, error = %e, "skipping GPU: {call} failed"))
        .ok()
}

pub(super) fn map_gpu(
    raw: RawGpu,
    versions: &Versions,
    node_buses: &BTreeSet<PciBusId>,
    sysfs: &impl Sysfs,
    notes: &mut Vec<Omission>,
) -> Option<Gpu> {
    let RawGpu {
        index,
        minor,
        uuid,
        name,
        brand,
        architecture,
        compute_capability,
        memory_total_bytes,
        attributes,
        cuda_cores,
        pci_bus_id,
        numa_node,
        mig_mode,
        gi_profiles,
        mig_devices,
        nvlinks,
        fabric,
        virtualization,
    } = raw;
    let uuid = required(index, "nvmlDeviceGetUUID", uuid)?;
    let minor = required(index, "nvmlDeviceGetMinorNumber", minor)?;
    let product_name = required(index, "nvmlDeviceGetName", name)?;
    let memory_bytes = required(index, "nvmlDeviceGetMemoryInfo", memory_total_bytes)?;
    let cc = required(
        index,
        "nvmlDeviceGetCudaComputeCapability",
        compute_capability,
    )?;
    let raw_bus = required(index, "nvmlDeviceGetPciInfo", pci_bus_id)?;
    let Some(pci_bus_id) = PciBusId::normalize(&raw_bus) else {
        warn!(gpu.index = index, bus = %raw_bus, "skipping GPU: NVML reports an invalid PCI bus id");
        return None;
    };

    let gpu = GpuUuid(uuid);
    let mut omit = |field: &'static str, level: Level, reason: String| {
        notes.push(Omission {
            gpu_index: index,
            gpu: gpu.clone(),
            field,
            reason,
            level,
        });
    };

    let brand = match &brand {
        Ok(Brand::Unknown) => {
            omit(
                "brand",
                Level::INFO,
                "NVML reports the brand as unknown".into(),
            );
            None
        }
        Ok(b) => Some(brand_name(b).to_string()),
        Err(e) => {
            omit("brand", Level::INFO, format!("nvmlDeviceGetBrand: {e}"));
            None
        }
    };
    let architecture = match architecture.as_ref().ok().and_then(architecture_name) {
        Some(name) => Some(name),
        None => {
            let from_cc = architecture_from_cc(cc);
            if from_cc.is_none() {
                let nvml = match &architecture {
                    Ok(a) => format!("{a:?}"),
                    Err(e) => e.to_string(),
                };
                omit(
                    "architecture",
                    Level::INFO,
                    format!("NVML says {nvml}, and compute capability {cc} names none"),
                );
            }
            from_cc
        }
    }
    .map(String::from);

    // The SM count: the device's attributes (as for MIG devices), else CUDA cores per SM of the
    // architecture; never a made-up 0.
    let cores = cuda_cores
        .as_ref()
        .ok()
        .filter(|&&c| c > 0)
        .zip(cores_per_sm(cc));
    let multiprocessors = match (&attributes, cores) {
        (Ok(a), _) if a.multiprocessor_count > 0 => Some(a.multiprocessor_count),
        (_, Some((cores, per_sm))) => Some(cores / per_sm),
        _ => {
            let attrs = match &attributes {
                Ok(a) => format!("{} multiprocessors", a.multiprocessor_count),
                Err(e) => e.to_string(),
            };
            let cores = match &cuda_cores {
                Ok(c) => format!("{c} cores at compute capability {cc}"),
                Err(e) => e.to_string(),
            };
            omit(
                "multiprocessors",
                Level::WARN,
                format!("nvmlDeviceGetAttributes_v2: {attrs}; nvmlDeviceGetNumGpuCores: {cores}"),
            );
            None
        }
    };

    let pcie_root = sysfs
        .pci_device_link(&pci_bus_id)
        .and_then(|p| pcie_root_of(&p));
    if pcie_root.is_none() {
        debug!(gpu.index = index, bus = %pci_bus_id, "no PCIe root in sysfs for this GPU");
    }
    // Sysfs first: it is the CPU-side locality the kubelet's topology manager uses. NVML's NUMA
    // id is the GPU memory's own node on coherent platforms (Grace Hopper) — a fallback only.
    let numa_node = match sysfs.pci_numa_node(&pci_bus_id) {
        Some(text) => parse_numa(&text),
        None => numa_node.ok(),
    };

    let virtualization = match virtualization {
        Ok(v) => Some(match v {
            GpuVirtualizationMode::Bare => Virtualization::BareMetal,
            GpuVirtualizationMode::PassThrough => Virtualization::Passthrough,
            GpuVirtualizationMode::Vgpu => Virtualization::VgpuGuest,
            GpuVirtualizationMode::HostVgpu => Virtualization::VgpuHost,
            GpuVirtualizationMode::HostVsga => Virtualization::VsgaHost,
        }),
        Err(e) => {
            omit(
                "virtualization",
                Level::INFO,
                format!("nvmlDeviceGetVirtualizationMode: {e}; its MIG mode is not changed"),
            );
            None
        }
    };

    let mig = map_mig(
        (index, &gpu),
        mig_mode,
        &gi_profiles,
        mig_devices,
        memory_bytes,
        notes,
    );
    // The largest GPU-instance profile spans the GPU; without MIG, the device's attributes
    // where the driver gives them for a whole GPU.
    let engines = gi_profiles
        .iter()
        .max_by_key(|p| (p.info.slice_count, p.info.memory_size_mb))
        .map(|p| profile_engines(&p.info))
        .or_else(|| attributes.as_ref().ok().map(attribute_engines))
        .unwrap_or_default();

    let nvlink_peers = fabric::map_nvlinks((index, &gpu), &pci_bus_id, &nvlinks, node_buses, notes);
    let fabric = fabric::map_fabric((index, &gpu), fabric, notes);

    Some(Gpu {
        index,
        minor,
        uuid: gpu,
        product_name,
        brand,
        architecture,
        cuda_compute_capability: cc,
        driver_version: versions.driver.clone(),
        cuda_driver_version: versions.cuda.clone(),
        memory_bytes,
        multiprocessors,
        engines,
        pci_bus_id,
        pcie_root,
        numa_node,
        mig,
        nvlink_peers,
        nvlink_domain: index,
        fabric,
        virtualization,
        health: Health::Healthy,
    })
}

pub(super) fn map_mig(
    (index, parent): (u32, &GpuUuid),
    mode: RawResult<RawMigMode>,
    profiles: &[RawGiProfile],
    devices: Vec<RawMigDevice>,
    total_bytes: u64,
    notes: &mut Vec<Omission>,
) -> Mig {
    let parent_uuid = parent.as_str();
    let mode = match mode {
        Ok(m) => m,
        // A driver without the MIG API predates MIG: under it no GPU is MIG-capable.
        Err(CallError::NotSupported | CallError::Missing(_)) => return Mig::default(),
        Err(e) => {
            notes.push(Omission {
                gpu_index: index,
                gpu: parent.clone(),
                field: "migCapable",
                reason: format!("nvmlDeviceGetMigMode: {e}; the GPU is handled as not in MIG mode"),
                level: Level::WARN,
            });
            return Mig {
                mode_unknown: true,
                ..Mig::default()
            };
        }
    };
    if mode.pending != mode.current {
        warn!(
            gpu.index = index,
            current = mode.current,
            pending = mode.pending,
            "MIG mode change is pending; it takes effect after a GPU reset or reboot"
        );
    }
    let mut memory_slices = 0;
    let mut mig_profiles = Vec::with_capacity(profiles.len());
    for p in profiles {
        let mut placements = match &p.placements {
            Ok(v) => v.clone(),
            Err(e) => {
                debug!(gpu.index = index, profile = p.info.id, error = %e, "MIG placements unknown");
                Vec::new()
            }
        };
        placements.sort();
        placements.dedup();
        for pl in &placements {
            memory_slices = memory_slices.max(pl.start + pl.size);
        }
        mig_profiles.push(MigProfile {
            name: mig_profile_name(
                Some(p.profile),
                p.info.slice_count,
                0,
                p.info.memory_size_mb,
                total_bytes,
            ),
            gi_profile_id: p.info.id,
            memory_bytes: p.info.memory_size_mb * MIB,
            multiprocessors: p.info.multiprocessor_count,
            engines: profile_engines(&p.info),
            max_instances: p.info.instance_count,
            placements,
        });
    }

    let mut mig_devices = Vec::new();
    if mode.current {
        for d in devices {
            if let Some(m) = map_mig_device(index, parent_uuid, d, profiles, total_bytes) {
                mig_devices.push(m);
            }
        }
    } else if !devices.is_empty() {
        debug!(
            gpu.index = index,
            "MIG devices reported while MIG mode is off; ignoring them"
        );
    }
    mig_devices.sort_by_key(|m| (m.placement, m.gi_id, m.ci_id));
    // Existing instances count too, should the profiles' placements be unreadable.
    for d in &mig_devices {
        memory_slices = memory_slices.max(d.placement.start + d.placement.size);
    }

    Mig {
        capable: true,
        mode_unknown: false,
        enabled: mode.current,
        pending: (mode.pending != mode.current).then_some(mode.pending),
        memory_slices,
        devices: mig_devices,
        profiles: mig_profiles,
        ..Mig::default()
    }
}

pub(super) fn map_mig_device(
    index: u32,
    parent_uuid: &str,
    raw: RawMigDevice,
    profiles: &[RawGiProfile],
    total_bytes: u64,
) -> Option<MigDevice> {
    let RawMigDevice {
        slot,
        uuid,
        attributes,
        gi_id,
        ci_id,
        gpu_instance,
    } = raw;
    let uuid = match uuid {
        Ok(u) => u,
        Err(e) => {
            warn!(gpu.index = index, gpu.uuid = parent_uuid, slot, error = %e, "skipping MIG device: no UUID");
            return None;
        }
    };
    let skip = |what: &str, e: &CallError| {
        warn!(gpu.index = index, mig.uuid = %uuid, error = %e, "skipping MIG device {uuid}: {what} unknown");
    };
    let gi_id = gi_id.map_err(|e| skip("GPU instance id", &e)).ok()?;
    let ci_id = ci_id.map_err(|e| skip("compute instance id", &e)).ok()?;
    let gi = gpu_instance
        .map_err(|e| skip("GPU instance placement", &e))
        .ok()?;
    let attributes = attributes
        .map_err(|e| debug!(mig.uuid = %uuid, error = %e, "MIG device attributes unknown"))
        .ok();
    let ci_slices = attributes
        .as_ref()
        .map_or(0, |a| a.compute_instance_slice_count);
    let profile = profiles.iter().find(|p| p.info.id == gi.profile_id);

    let (name, memory_bytes, profile_sms, profile_engines_) = match (profile, &attributes) {
        (Some(p), _) => (
            mig_profile_name(
                Some(p.profile),
                p.info.slice_count,
                ci_slices,
                p.info.memory_size_mb,
                total_bytes,
            ),
            p.info.memory_size_mb * MIB,
            p.info.multiprocessor_count,
            profile_engines(&p.info),
        ),
        (None, Some(a)) => {
            warn!(mig.uuid = %uuid, gi.profile_id = gi.profile_id, "GPU-instance profile not among the GPU's profiles; naming it from the device's attributes");
            (
                mig_profile_name(
                    None,
                    a.gpu_instance_slice_count,
                    ci_slices,
                    a.memory_size_mb,
                    total_bytes,
                ),
                a.memory_size_mb * MIB,
                a.multiprocessor_count,
                attribute_engines(a),
            )
        }
        (None, None) => {
            skip(
                "profile",
                &CallError::Failed(format!(
                    "GPU-instance profile id {} is not among the GPU's profiles and the device has no attributes",
                    gi.profile_id
                )),
            );
            return None;
        }
    };

    Some(MigDevice {
        uuid: MigUuid(uuid),
        profile: name,
        gi_profile_id: gi.profile_id,
        gi_id,
        ci_id,
        placement: gi.placement,
        memory_bytes,
        multiprocessors: attributes
            .as_ref()
            .map_or(profile_sms, |a| a.multiprocessor_count),
        engines: attributes
            .as_ref()
            .map_or(profile_engines_, attribute_engines),
        health: Health::Healthy,
    })
}
