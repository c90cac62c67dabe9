//! Tests of the NVML backend through its seam: hand-built [`RawNode`]s shaped like what NVML
//! returns on real node types, mapped with an in-memory sysfs. Shared fixtures here; the tests live in one file per area.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use nvml_wrapper::enum_wrappers::device::{Brand, GpuVirtualizationMode};
use nvml_wrapper::enums::device::DeviceArchitecture;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::struct_wrappers::device::{DeviceAttributes, ProfileInfo};
use nvml_wrapper_sys::bindings as b;
use tracing::Level;

use super::backend::OmissionLog;
use super::sysfs::parse_numa;
use super::*;
use crate::inventory::{
    ComputeCapability, DeviceBackend, Engines, Error, GpuUuid, Mig, NODE_NVSWITCHES, NvLinkPeer,
    PciBusId,
};

mod fabric;
mod gpus;
mod host;
mod mig;
mod names;
mod nvlink;

/// An in-memory sysfs: symlink targets and `numa_node` contents by normalized bus id.
#[derive(Default)]
struct MapSysfs {
    links: BTreeMap<String, PathBuf>,
    numa: BTreeMap<String, String>,
}

impl MapSysfs {
    /// Places `bus` under root complex `root` (e.g. `pci0000:00`) on NUMA node `numa`.
    fn device(mut self, bus: &str, root: &str, numa: &str) -> Self {
        self.links.insert(
            bus.into(),
            format!("../../../devices/{root}/0000:00:01.0/{bus}").into(),
        );
        self.numa.insert(bus.into(), numa.into());
        self
    }
}

impl Sysfs for MapSysfs {
    fn pci_device_link(&self, bus: &PciBusId) -> Option<PathBuf> {
        self.links.get(bus.as_str()).cloned()
    }
    fn pci_numa_node(&self, bus: &PciBusId) -> Option<String> {
        self.numa.get(bus.as_str()).cloned()
    }
}

const MIB_: u64 = 1 << 20;

fn node(gpus: Vec<RawGpu>) -> RawNode {
    RawNode {
        driver_version: Ok("550.163.01".into()),
        cuda_driver_version: Ok(12040),
        gpus,
        unreadable: Vec::new(),
    }
}

/// An H100 80GB HBM3 as NVML describes it: no attributes on a full GPU, cores instead.
fn h100(index: u32, bus: &str) -> RawGpu {
    RawGpu {
        index,
        minor: Ok(index),
        uuid: Ok(format!("GPU-00000000-0000-0000-0000-00000000000{index}")),
        name: Ok("NVIDIA H100 80GB HBM3".into()),
        brand: Ok(Brand::Nvidia),
        architecture: Ok(DeviceArchitecture::Hopper),
        compute_capability: Ok(ComputeCapability { major: 9, minor: 0 }),
        memory_total_bytes: Ok(81559 * MIB_),
        attributes: Err(CallError::NotSupported),
        cuda_cores: Ok(16896),
        pci_bus_id: Ok(bus.into()),
        numa_node: Err(CallError::NotSupported),
        mig_mode: Ok(RawMigMode {
            current: false,
            pending: false,
        }),
        gi_profiles: Vec::new(),
        mig_devices: Vec::new(),
        nvlinks: Vec::new(),
        // What a single-node HGX reports: registered with the local fabric manager, no cluster.
        fabric: Ok(RawFabric {
            cluster_uuid: [0; 16],
            clique_id: 0,
            state: FabricState::Completed,
            status: Ok(()),
        }),
        virtualization: Ok(GpuVirtualizationMode::Bare),
    }
}

fn l40s(index: u32, bus: &str) -> RawGpu {
    RawGpu {
        name: Ok("NVIDIA L40S".into()),
        architecture: Ok(DeviceArchitecture::Ada),
        compute_capability: Ok(ComputeCapability { major: 8, minor: 9 }),
        memory_total_bytes: Ok(46068 * MIB_),
        cuda_cores: Ok(18176),
        mig_mode: Err(CallError::NotSupported),
        fabric: Err(CallError::NotSupported),
        ..h100(index, bus)
    }
}

fn a100_40gb(index: u32, bus: &str) -> RawGpu {
    RawGpu {
        name: Ok("NVIDIA A100-SXM4-40GB".into()),
        architecture: Ok(DeviceArchitecture::Ampere),
        compute_capability: Ok(ComputeCapability { major: 8, minor: 0 }),
        memory_total_bytes: Ok(40960 * MIB_),
        cuda_cores: Ok(6912),
        gi_profiles: a100_40gb_profiles(),
        fabric: Err(CallError::NotSupported),
        ..h100(index, bus)
    }
}

#[allow(clippy::too_many_arguments)]
fn info(
    id: u32,
    slices: u32,
    instances: u32,
    mib: u64,
    sms: u32,
    ce: u32,
    dec: u32,
) -> ProfileInfo {
    ProfileInfo {
        copy_engine_count: ce,
        decoder_count: dec,
        encoder_count: 0,
        id,
        instance_count: instances,
        is_p2p_supported: false,
        jpeg_count: 0,
        memory_size_mb: mib,
        multiprocessor_count: sms,
        ofa_count: 0,
        slice_count: slices,
    }
}

fn placements(starts: &[u32], size: u32) -> RawResult<Vec<Placement>> {
    Ok(starts
        .iter()
        .map(|&start| Placement { start, size })
        .collect())
}

/// The GPU-instance profiles of an A100-SXM4-40GB: NVML profile index, `info`, placements.
fn a100_40gb_profiles() -> Vec<RawGiProfile> {
    let p = |profile, info, placements| RawGiProfile {
        profile,
        info,
        placements,
    };
    let mut me = info(20, 1, 1, 4864, 14, 1, 1);
    me.jpeg_count = 1;
    me.ofa_count = 1;
    vec![
        p(
            b::NVML_GPU_INSTANCE_PROFILE_1_SLICE,
            info(19, 1, 7, 4864, 14, 1, 0),
            placements(&[0, 1, 2, 3, 4, 5, 6], 1),
        ),
        p(
            b::NVML_GPU_INSTANCE_PROFILE_2_SLICE,
            info(14, 2, 3, 9856, 28, 2, 1),
            placements(&[0, 2, 4], 2),
        ),
        p(
            b::NVML_GPU_INSTANCE_PROFILE_3_SLICE,
            info(9, 3, 2, 19968, 42, 3, 2),
            placements(&[4, 0], 4),
        ),
        p(
            b::NVML_GPU_INSTANCE_PROFILE_4_SLICE,
            info(5, 4, 1, 19968, 56, 4, 2),
            placements(&[0], 4),
        ),
        p(
            b::NVML_GPU_INSTANCE_PROFILE_7_SLICE,
            info(0, 7, 1, 40192, 98, 7, 5),
            placements(&[0], 8),
        ),
        p(
            b::NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1,
            me,
            placements(&[0, 1, 2, 3, 4, 5, 6], 1),
        ),
        p(
            b::NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2,
            info(15, 1, 4, 9856, 14, 1, 1),
            placements(&[0, 2, 4, 6], 2),
        ),
    ]
}

fn attrs(
    sms: u32,
    ce: u32,
    dec: u32,
    gi_slices: u32,
    ci_slices: u32,
    mib: u64,
) -> DeviceAttributes {
    DeviceAttributes {
        multiprocessor_count: sms,
        shared_copy_engine_count: ce,
        shared_decoder_count: dec,
        shared_encoder_count: 0,
        shared_jpeg_count: 0,
        shared_ofa_count: 0,
        gpu_instance_slice_count: gi_slices,
        compute_instance_slice_count: ci_slices,
        memory_size_mb: mib,
    }
}

fn mig_dev(
    slot: u32,
    uuid: &str,
    gi_id: u32,
    profile_id: u32,
    start: u32,
    size: u32,
    attributes: RawResult<DeviceAttributes>,
) -> RawMigDevice {
    RawMigDevice {
        slot,
        uuid: Ok(uuid.into()),
        attributes,
        gi_id: Ok(gi_id),
        ci_id: Ok(0),
        gpu_instance: Ok(RawGpuInstance {
            profile_id,
            placement: Placement { start, size },
        }),
    }
}

/// The PCI info NVML fills in for `bus_id`: the string, and the numbers parsed from it.
fn pci(bus_id: &str) -> RawPci {
    let mut parts = bus_id.split([':', '.']);
    let mut next = || u32::from_str_radix(parts.next().unwrap_or_default(), 16).unwrap_or(0);
    RawPci {
        bus_id: bus_id.into(),
        domain: next(),
        bus: next(),
        device: next(),
    }
}

fn link(n: u32, remote: &str, kind: RawResult<RemoteDevice>) -> RawNvLink {
    RawNvLink {
        link: n,
        remote_pci: Ok(pci(remote)),
        remote_type: kind,
    }
}

/// A link to an NVSwitch as DGX/HGX drivers report it: the invalid PCI address, type SWITCH.
fn sentinel_link(n: u32, bus_id: &str) -> RawNvLink {
    RawNvLink {
        link: n,
        remote_pci: Ok(RawPci {
            bus_id: bus_id.into(),
            domain: 0xFFFF_FFFF,
            bus: 0xFF,
            device: 0xFF,
        }),
        remote_type: Ok(RemoteDevice::Switch),
    }
}

fn switch(bus: &str) -> NvLinkPeer {
    NvLinkPeer::Switch(bus.into())
}

fn gpu_peer(bus: &str) -> NvLinkPeer {
    NvLinkPeer::Gpu(PciBusId(bus.into()))
}

const HGX_BUSES: [&str; 8] = [
    "00000000:1A:00.0",
    "00000000:1B:00.0",
    "00000000:4A:00.0",
    "00000000:4B:00.0",
    "00000000:8A:00.0",
    "00000000:8B:00.0",
    "00000000:CA:00.0",
    "00000000:CB:00.0",
];

/// An HGX H100: 8 GPUs, 18 NVLinks each spread over 4 NVSwitches, two sockets.
fn hgx_h100() -> (RawNode, MapSysfs) {
    let switches = [
        "00000000:05:00.0",
        "00000000:06:00.0",
        "00000000:07:00.0",
        "00000000:08:00.0",
    ];
    let mut sysfs = MapSysfs::default();
    let gpus = HGX_BUSES
        .iter()
        .enumerate()
        .map(|(i, bus)| {
            let mut g = h100(i as u32, bus);
            g.nvlinks = (0..18)
                .map(|l| link(l, switches[l as usize % 4], Ok(RemoteDevice::Switch)))
                .collect();
            let norm = PciBusId::normalize(bus).unwrap();
            let (root, numa) = if i < 4 {
                ("pci0000:00", "0\n")
            } else {
                ("pci0000:80", "1\n")
            };
            sysfs = std::mem::take(&mut sysfs).device(norm.as_str(), root, numa);
            g
        })
        .collect();
    (node(gpus), sysfs)
}
