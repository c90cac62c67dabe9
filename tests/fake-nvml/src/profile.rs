//! A node from a topology: nvdra's own parser reads the built-in profile or file, and the fake
//! answers NVML calls so that the NVML backend reads the same inventory back.
//!
//! What NVML cannot say the way a topology does is encoded as NVML says it: NVSwitches, named in
//! a topology, get PCI addresses ([`switch_bus_id`], numbered in the order of their sorted
//! names); GPU-instance profiles get the `NVML_GPU_INSTANCE_PROFILE_*` index whose suffix their
//! name carries; a whole GPU's SM count and engines come as its device attributes. PCIe root and
//! NUMA node are sysfs facts, which the fake cannot serve: a test lays them out in a sysfs tree.

use std::collections::BTreeSet;
use std::os::raw::c_uint;

use nvdra::inventory::{
    Engines as InvEngines, Gpu as InvGpu, Inventory, NvLinkPeer, Virtualization,
};
use nvml_wrapper_sys::bindings::*;

use crate::model::{
    CI_SLICES, ComputeInstance, Engines, Fabric, Gpu, GpuInstance, Link, Model, Profile, pci,
};

/// The PCI bus id (as nvdra normalizes it) the fake gives the `ordinal`-th NVSwitch of a
/// topology, counting the node's distinct switch names in sorted order.
pub fn switch_bus_id(ordinal: usize) -> String {
    format!("0000:{:02x}:00.0", 0xe0 + ordinal)
}

/// The distinct NVSwitch names of an inventory, sorted: the order [`switch_bus_id`] numbers.
pub fn switch_names(inv: &Inventory) -> Vec<String> {
    let names: BTreeSet<&String> = inv
        .gpus
        .iter()
        .flat_map(|g| &g.nvlink_peers)
        .filter_map(|p| match p {
            NvLinkPeer::Switch(name) => Some(name),
            NvLinkPeer::Gpu(_) => None,
        })
        .collect();
    names.into_iter().cloned().collect()
}

fn nvml_bus(bus: &str) -> String {
    format!("0000{}", bus.to_ascii_uppercase())
}

fn engines(e: &InvEngines) -> Engines {
    [
        e.copy_engines,
        e.decoders,
        e.encoders,
        e.jpeg_engines,
        e.ofa_engines,
    ]
}

fn architecture(name: Option<&str>) -> nvmlDeviceArchitecture_t {
    match name {
        Some("Kepler") => NVML_DEVICE_ARCH_KEPLER,
        Some("Maxwell") => NVML_DEVICE_ARCH_MAXWELL,
        Some("Pascal") => NVML_DEVICE_ARCH_PASCAL,
        Some("Volta") => NVML_DEVICE_ARCH_VOLTA,
        Some("Turing") => NVML_DEVICE_ARCH_TURING,
        Some("Ampere") => NVML_DEVICE_ARCH_AMPERE,
        Some("Ada Lovelace") => NVML_DEVICE_ARCH_ADA,
        Some("Hopper") => NVML_DEVICE_ARCH_HOPPER,
        Some("Blackwell") => NVML_DEVICE_ARCH_BLACKWELL,
        _ => NVML_DEVICE_ARCH_UNKNOWN,
    }
}

fn brand(name: Option<&str>) -> nvmlBrandType_t {
    match name {
        Some("Quadro") => nvmlBrandType_enum_NVML_BRAND_QUADRO,
        Some("Tesla") => nvmlBrandType_enum_NVML_BRAND_TESLA,
        Some("NVS") => nvmlBrandType_enum_NVML_BRAND_NVS,
        Some("GRID") => nvmlBrandType_enum_NVML_BRAND_GRID,
        Some("GeForce") => nvmlBrandType_enum_NVML_BRAND_GEFORCE,
        Some("Titan") => nvmlBrandType_enum_NVML_BRAND_TITAN,
        Some("QuadroRTX") => nvmlBrandType_enum_NVML_BRAND_QUADRO_RTX,
        Some("NvidiaRTX") => nvmlBrandType_enum_NVML_BRAND_NVIDIA_RTX,
        Some("Nvidia") => nvmlBrandType_enum_NVML_BRAND_NVIDIA,
        Some("GeForceRTX") => nvmlBrandType_enum_NVML_BRAND_GEFORCE_RTX,
        Some("TitanRTX") => nvmlBrandType_enum_NVML_BRAND_TITAN_RTX,
        _ => nvmlBrandType_enum_NVML_BRAND_UNKNOWN,
    }
}

/// The `NVML_GPU_INSTANCE_PROFILE_*` indices whose names carry `suffix`, preferred first for a
/// profile of `slices` slices.
fn profile_indices(suffix: &str, slices: c_uint) -> Vec<c_uint> {
    match suffix {
        "+me" => vec![
            NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1,
            NVML_GPU_INSTANCE_PROFILE_2_SLICE_REV1,
        ],
        "+gfx" => vec![
            NVML_GPU_INSTANCE_PROFILE_1_SLICE_GFX,
            NVML_GPU_INSTANCE_PROFILE_2_SLICE_GFX,
            NVML_GPU_INSTANCE_PROFILE_4_SLICE_GFX,
        ],
        "-me" => vec![
            NVML_GPU_INSTANCE_PROFILE_1_SLICE_NO_ME,
            NVML_GPU_INSTANCE_PROFILE_2_SLICE_NO_ME,
        ],
        "+me.all" => vec![
            NVML_GPU_INSTANCE_PROFILE_1_SLICE_ALL_ME,
            NVML_GPU_INSTANCE_PROFILE_2_SLICE_ALL_ME,
        ],
        _ => {
            let by_slices = match slices {
                1 => NVML_GPU_INSTANCE_PROFILE_1_SLICE,
                2 => NVML_GPU_INSTANCE_PROFILE_2_SLICE,
                3 => NVML_GPU_INSTANCE_PROFILE_3_SLICE,
                4 => NVML_GPU_INSTANCE_PROFILE_4_SLICE,
                7 => NVML_GPU_INSTANCE_PROFILE_7_SLICE,
                8 => NVML_GPU_INSTANCE_PROFILE_8_SLICE,
                _ => NVML_GPU_INSTANCE_PROFILE_6_SLICE,
            };
            let mut v = vec![by_slices, NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2];
            v.extend(0..=6);
            v
        }
    }
}

/// `1g.10gb+me` → (1, "+me").
fn split_name(name: &str) -> (c_uint, &str) {
    let slices = name
        .split_once('g')
        .and_then(|(n, _)| n.rsplit('.').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(1);
    let suffix = name.find("gb").map_or("", |i| &name[i + 2..]);
    (slices, suffix)
}

fn gpu(g: &InvGpu, switches: &[String], created: &mut u64) -> Gpu {
    let mut profiles: Vec<Profile> = Vec::new();
    for p in &g.mig.profiles {
        let (slices, suffix) = split_name(&p.name);
        let index = profile_indices(suffix, slices)
            .into_iter()
            .find(|i| profiles.iter().all(|q| q.index != *i))
            .unwrap_or(NVML_GPU_INSTANCE_PROFILE_COUNT - 1);
        profiles.push(Profile {
            index,
            id: p.gi_profile_id,
            slices,
            instances: p.max_instances,
            mib: p.memory_bytes >> 20,
            sms: p.multiprocessors,
            engines: engines(&p.engines),
            size: p.placements.first().map_or(0, |pl| pl.size),
            starts: p.placements.iter().map(|pl| pl.start).collect(),
        });
    }
    let mut instances = Vec::new();
    for (slot, d) in g.mig.devices.iter().enumerate() {
        let Some(profile) = profiles.iter().position(|p| p.id == d.gi_profile_id) else {
            continue;
        };
        let slices = profiles[profile].slices;
        instances.push(GpuInstance {
            id: d.gi_id,
            profile,
            start: d.placement.start,
            compute: vec![ComputeInstance {
                id: d.ci_id,
                profile: CI_SLICES.iter().position(|s| *s == slices).unwrap_or(0) as c_uint,
                slices,
                slot: slot as c_uint,
                uuid: d.uuid.as_str().to_string(),
            }],
        });
        *created += 1;
    }
    let links = g
        .nvlink_peers
        .iter()
        .map(|p| match p {
            NvLinkPeer::Gpu(bus) => Link {
                remote: pci(&nvml_bus(bus.as_str())),
                kind: nvmlIntNvLinkDeviceType_enum_NVML_NVLINK_DEVICE_TYPE_GPU,
            },
            NvLinkPeer::Switch(name) => {
                let ordinal = switches.iter().position(|s| s == name).unwrap_or_default();
                Link {
                    remote: pci(&nvml_bus(&switch_bus_id(ordinal))),
                    kind: nvmlIntNvLinkDeviceType_enum_NVML_NVLINK_DEVICE_TYPE_SWITCH,
                }
            }
        })
        .collect();
    Gpu {
        name: g.product_name.clone(),
        uuid: g.uuid.as_str().to_string(),
        bus: nvml_bus(g.pci_bus_id.as_str()),
        minor: g.minor,
        brand: brand(g.brand.as_deref()),
        arch: architecture(g.architecture.as_deref()),
        cc: (
            g.cuda_compute_capability.major as i32,
            g.cuda_compute_capability.minor as i32,
        ),
        memory_bytes: g.memory_bytes,
        cores: None,
        attributes: g.multiprocessors.map(|sms| (sms, engines(&g.engines))),
        mig_mode: g.mig.capable.then(|| {
            let on = c_uint::from(g.mig.enabled);
            (on, g.mig.pending.map_or(on, c_uint::from))
        }),
        profiles,
        instances,
        links,
        fabric: match &g.fabric {
            Some(f) => Fabric::State {
                cluster: cluster_bytes(f.cluster_uuid.as_str()),
                clique: f.clique_id,
                state: NVML_GPU_FABRIC_STATE_COMPLETED,
            },
            None => Fabric::NotSupported,
        },
        virtualization: g.virtualization.map(|v| match v {
            Virtualization::BareMetal => {
                nvmlGpuVirtualizationMode_NVML_GPU_VIRTUALIZATION_MODE_NONE
            }
            Virtualization::Passthrough => {
                nvmlGpuVirtualizationMode_NVML_GPU_VIRTUALIZATION_MODE_PASSTHROUGH
            }
            Virtualization::VgpuGuest => {
                nvmlGpuVirtualizationMode_NVML_GPU_VIRTUALIZATION_MODE_VGPU
            }
            Virtualization::VgpuHost => {
                nvmlGpuVirtualizationMode_NVML_GPU_VIRTUALIZATION_MODE_HOST_VGPU
            }
            Virtualization::VsgaHost => {
                nvmlGpuVirtualizationMode_NVML_GPU_VIRTUALIZATION_MODE_HOST_VSGA
            }
        }),
        idle: false,
    }
}

fn cluster_bytes(uuid: &str) -> [u8; 16] {
    let hex: String = uuid.chars().filter(|c| *c != '-').collect();
    let mut out = [0; 16];
    for (i, b) in out.iter_mut().enumerate() {
        *b = hex
            .get(2 * i..2 * i + 2)
            .and_then(|h| u8::from_str_radix(h, 16).ok())
            .unwrap_or(0);
    }
    out
}

/// The fake node for an inventory.
pub fn model(inv: &Inventory) -> Model {
    let switches = switch_names(inv);
    let mut created = 0;
    let gpus = inv
        .gpus
        .iter()
        .map(|g| gpu(g, &switches, &mut created))
        .collect();
    let (driver_version, cuda) = inv.gpus.first().map_or_else(
        || ("550.163.01".to_string(), 12040),
        |g| {
            let (major, minor) = g.cuda_driver_version.split_once('.').unwrap_or(("12", "4"));
            (
                g.driver_version.clone(),
                major.parse::<i32>().unwrap_or(12) * 1000 + minor.parse::<i32>().unwrap_or(0) * 10,
            )
        },
    );
    Model {
        driver_version,
        cuda_version: cuda,
        gpus,
        created,
        compute_modes: Default::default(),
        mig_toggle_delay: Default::default(),
        memory_limits: Default::default(),
        switching: Default::default(),
    }
}
