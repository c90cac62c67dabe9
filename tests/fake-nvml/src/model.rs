//! The node the fake answers for: owned values built at `nvmlInit_v2` (from one of the two fixed
//! nodes or from a topology), changed by the MIG create and destroy calls.

use std::os::raw::{c_int, c_uint};

use nvml_wrapper_sys::bindings::*;

use crate::{CLIQUE_ID, CLUSTER_UUID};

/// Most MIG devices (compute instances) a GPU lists.
pub const MAX_MIG_DEVICES: c_uint = 7;

pub struct Model {
    pub driver_version: String,
    /// `1000 * major + 10 * minor`.
    pub cuda_version: c_int,
    pub gpus: Vec<Gpu>,
    /// MIG devices created so far, for their UUIDs.
    pub created: u64,
    /// Each GPU's compute mode (`NVML_COMPUTEMODE_*`) by index; a GPU absent is `DEFAULT`.
    pub compute_modes: std::collections::BTreeMap<usize, c_uint>,
    /// How long an applied MIG mode change takes (`FAKE_NVML_MIG_TOGGLE_DELAY_MS`, default 0).
    pub mig_toggle_delay: std::time::Duration,
    /// Per-cgroup memory limits (soft, hard) by GPU index and cgroup path
    /// ([`crate::memory_limits`]); absent: none.
    pub memory_limits: std::collections::BTreeMap<(usize, String), (u64, u64)>,
    /// What MIG mode changes depend on beyond each GPU ([`crate::mig_mode`]).
    pub switching: crate::mig_mode::Switching,
}

pub struct Gpu {
    pub name: String,
    pub uuid: String,
    /// As NVML formats it: `00000000:07:00.0`.
    pub bus: String,
    pub minor: c_uint,
    pub brand: nvmlBrandType_t,
    pub arch: nvmlDeviceArchitecture_t,
    pub cc: (c_int, c_int),
    pub memory_bytes: u64,
    /// `None`: `nvmlDeviceGetNumGpuCores` answers NOT_SUPPORTED.
    pub cores: Option<c_uint>,
    /// `Some`: the full GPU answers `nvmlDeviceGetAttributes_v2` with this SM count and these
    /// engines (most drivers answer only for MIG devices).
    pub attributes: Option<(c_uint, Engines)>,
    /// MIG mode (current, pending); `None` when the GPU cannot do MIG.
    pub mig_mode: Option<(c_uint, c_uint)>,
    /// `nvmlDeviceGetVirtualizationMode`'s answer; `None`: NOT_SUPPORTED.
    pub virtualization: Option<nvmlGpuVirtualizationMode_t>,
    /// Its process ([`crate::usage::readings`]) has exited (test hook `fake_nvml_set_idle`).
    pub idle: bool,
    pub profiles: Vec<Profile>,
    pub instances: Vec<GpuInstance>,
    /// Active NVLinks, in link order.
    pub links: Vec<Link>,
    pub fabric: Fabric,
}

/// Copy engines, decoders, encoders, JPEG, OFA.
pub type Engines = [c_uint; 5];

pub struct Profile {
    /// `NVML_GPU_INSTANCE_PROFILE_*`.
    pub index: c_uint,
    /// What instances report as their `profileId`.
    pub id: c_uint,
    pub slices: c_uint,
    pub instances: c_uint,
    pub mib: u64,
    pub sms: c_uint,
    pub engines: Engines,
    /// Memory slices a placement spans.
    pub size: c_uint,
    pub starts: Vec<c_uint>,
}

pub struct GpuInstance {
    pub id: c_uint,
    /// Index into the GPU's `profiles`.
    pub profile: usize,
    pub start: c_uint,
    pub compute: Vec<ComputeInstance>,
}

pub struct ComputeInstance {
    pub id: c_uint,
    /// `NVML_COMPUTE_INSTANCE_PROFILE_*` (the fake's compute profile ids equal their index).
    pub profile: c_uint,
    pub slices: c_uint,
    /// Its index among the GPU's MIG device handles.
    pub slot: c_uint,
    pub uuid: String,
}

#[derive(Clone, Copy)]
pub struct Link {
    pub remote: nvmlPciInfo_t,
    pub kind: nvmlIntNvLinkDeviceType_t,
}

#[derive(Clone, Copy)]
pub enum Fabric {
    /// The call answers NOT_SUPPORTED.
    NotSupported,
    /// A registration in this `NVML_GPU_FABRIC_STATE_*`.
    State {
        cluster: [u8; 16],
        clique: c_uint,
        state: u32,
    },
}

/// Slice counts of `NVML_COMPUTE_INSTANCE_PROFILE_*`, by index.
pub const CI_SLICES: [c_uint; 8] = [1, 2, 3, 4, 7, 8, 6, 1];

impl Gpu {
    /// The MIG device (GPU instance, compute instance) at handle slot `slot`.
    pub fn mig_at(&self, slot: c_uint) -> Option<(&GpuInstance, &ComputeInstance)> {
        self.instances.iter().find_map(|gi| {
            gi.compute
                .iter()
                .find(|ci| ci.slot == slot)
                .map(|ci| (gi, ci))
        })
    }

    pub fn instance(&self, id: c_uint) -> Option<&GpuInstance> {
        self.instances.iter().find(|gi| gi.id == id)
    }

    pub fn instance_mut(&mut self, id: c_uint) -> Option<&mut GpuInstance> {
        self.instances.iter_mut().find(|gi| gi.id == id)
    }

    pub fn free_slot(&self) -> Option<c_uint> {
        (0..MAX_MIG_DEVICES).find(|s| self.mig_at(*s).is_none())
    }
}

/// PCI info with the numeric fields parsed from `bus` (`dddddddd:bb:dd.f`), as NVML fills them.
pub fn pci(bus: &str) -> nvmlPciInfo_t {
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

pub fn c_chars<const N: usize>(s: &str) -> [std::ffi::c_char; N] {
    let mut out = [0 as std::ffi::c_char; N];
    for (o, b) in out.iter_mut().zip(s.bytes().take(N - 1)) {
        *o = b as std::ffi::c_char;
    }
    out
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

const SWITCH: nvmlIntNvLinkDeviceType_t =
    nvmlIntNvLinkDeviceType_enum_NVML_NVLINK_DEVICE_TYPE_SWITCH;

// ------------------------------------------------------------------------------------------------
// The two fixed nodes
// ------------------------------------------------------------------------------------------------

/// An A100-40GB's GPU-instance profiles: (index, id, slices, instances, MiB, SMs, engines, size,
/// starts).
type ProfileRow = (
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    u64,
    c_uint,
    [c_uint; 4],
    c_uint,
    &'static [c_uint],
);
const A100_PROFILES: &[ProfileRow] = &[
    (
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
    (1, 14, 2, 3, 9856, 28, [2, 1, 0, 0], 2, &[0, 2, 4]),
    (2, 9, 3, 2, 19968, 42, [3, 2, 0, 0], 4, &[0, 4]),
    (3, 5, 4, 1, 19968, 56, [4, 2, 0, 0], 4, &[0]),
    (4, 0, 7, 1, 40192, 98, [7, 5, 1, 1], 8, &[0]),
    (
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
    (9, 15, 1, 4, 9856, 14, [1, 1, 0, 0], 2, &[0, 2, 4, 6]),
];

fn a100_profiles() -> Vec<Profile> {
    A100_PROFILES
        .iter()
        .map(
            |&(index, id, slices, instances, mib, sms, [ce, dec, jpeg, ofa], size, starts)| {
                Profile {
                    index,
                    id,
                    slices,
                    instances,
                    mib,
                    sms,
                    engines: [ce, dec, 0, jpeg, ofa],
                    size,
                    starts: starts.to_vec(),
                }
            },
        )
        .collect()
}

const SWITCHES: [&str; 6] = [
    "00000000:01:00.0",
    "00000000:02:00.0",
    "00000000:03:00.0",
    "00000000:04:00.0",
    "00000000:05:00.0",
    "00000000:06:00.0",
];

/// Link `n` reaches `SWITCHES[n % 6]`.
fn real_switch_links(n: usize) -> Vec<Link> {
    (0..n)
        .map(|i| Link {
            remote: pci(SWITCHES[i % SWITCHES.len()]),
            kind: SWITCH,
        })
        .collect()
}

fn a100(uuid: &str, bus: &str, minor: c_uint, mig: c_uint) -> Gpu {
    Gpu {
        name: "NVIDIA A100-SXM4-40GB".into(),
        uuid: uuid.into(),
        bus: bus.into(),
        minor,
        brand: nvmlBrandType_enum_NVML_BRAND_NVIDIA,
        arch: NVML_DEVICE_ARCH_AMPERE,
        cc: (8, 0),
        memory_bytes: 40960 << 20,
        cores: Some(6912),
        attributes: None,
        mig_mode: Some((mig, mig)),
        profiles: a100_profiles(),
        instances: Vec::new(),
        links: real_switch_links(12),
        fabric: Fabric::NotSupported,
        virtualization: Some(nvmlGpuVirtualizationMode_NVML_GPU_VIRTUALIZATION_MODE_NONE),
        idle: false,
    }
}

fn instance(id: c_uint, profile: usize, start: c_uint, slot: c_uint, uuid: &str) -> GpuInstance {
    let slices = A100_PROFILES[profile].2;
    GpuInstance {
        id,
        profile,
        start,
        compute: vec![ComputeInstance {
            id: 0,
            profile: CI_SLICES.iter().position(|s| *s == slices).unwrap_or(0) as c_uint,
            slices,
            slot,
            uuid: uuid.into(),
        }],
    }
}

/// `a100-l40s`: see the crate doc.
pub fn a100_l40s() -> Vec<Gpu> {
    let mut g0 = a100(
        "GPU-f00d0000-0000-4000-8000-000000000000",
        "00000000:07:00.0",
        0,
        1,
    );
    g0.instances = vec![
        instance(1, 2, 0, 0, "MIG-f00d0000-0000-5000-8000-000000000001"),
        instance(7, 0, 6, 2, "MIG-f00d0000-0000-5000-8000-000000000007"),
    ];
    let g1 = a100(
        "GPU-f00d0000-0000-4000-8000-000000000001",
        "00000000:0F:00.0",
        1,
        0,
    );
    let l40s = Gpu {
        name: "NVIDIA L40S".into(),
        uuid: "GPU-f00d0000-0000-4000-8000-000000000002".into(),
        bus: "00000000:B1:00.0".into(),
        minor: 5,
        brand: nvmlBrandType_enum_NVML_BRAND_NVIDIA,
        arch: NVML_DEVICE_ARCH_ADA,
        cc: (8, 9),
        memory_bytes: 46068 << 20,
        cores: Some(18176),
        attributes: None,
        mig_mode: None,
        profiles: Vec::new(),
        instances: Vec::new(),
        links: Vec::new(),
        fabric: Fabric::NotSupported,
        virtualization: Some(nvmlGpuVirtualizationMode_NVML_GPU_VIRTUALIZATION_MODE_NONE),
        idle: false,
    };
    vec![g0, g1, l40s]
}

fn h100(index: usize, bus: &str, switch_bus_id: &str, fabric_state: Option<u32>) -> Gpu {
    Gpu {
        name: "NVIDIA H100 80GB HBM3".into(),
        uuid: format!("GPU-f00d0100-0000-4000-8000-00000000000{index}"),
        bus: bus.into(),
        minor: index as c_uint,
        brand: nvmlBrandType_enum_NVML_BRAND_NVIDIA,
        arch: NVML_DEVICE_ARCH_HOPPER,
        cc: (9, 0),
        memory_bytes: 81559 << 20,
        cores: Some(16896),
        attributes: None,
        mig_mode: None,
        profiles: Vec::new(),
        instances: Vec::new(),
        links: (0..18)
            .map(|_| Link {
                remote: sentinel_pci(switch_bus_id),
                kind: SWITCH,
            })
            .collect(),
        fabric: match fabric_state {
            Some(state) => Fabric::State {
                cluster: CLUSTER_UUID,
                clique: CLIQUE_ID,
                state,
            },
            None => Fabric::NotSupported,
        },
        virtualization: Some(nvmlGpuVirtualizationMode_NVML_GPU_VIRTUALIZATION_MODE_NONE),
        idle: false,
    }
}

/// `hgx-h100-sentinel`: see the crate doc.
pub fn hgx_h100_sentinel() -> Vec<Gpu> {
    const SENTINEL: &str = "FFFFFFFF:FF:FF.0";
    const COMPLETED: Option<u32> = Some(NVML_GPU_FABRIC_STATE_COMPLETED);
    let mut gpus: Vec<Gpu> = [
        "00000000:1A:00.0",
        "00000000:1B:00.0",
        "00000000:4A:00.0",
        "00000000:4B:00.0",
        "00000000:8A:00.0",
        "00000000:8B:00.0",
    ]
    .iter()
    .enumerate()
    .map(|(i, bus)| h100(i, bus, SENTINEL, COMPLETED))
    .collect();
    gpus.push(Gpu {
        cores: None,
        attributes: Some((132, [0; 5])),
        ..h100(
            6,
            "00000000:CA:00.0",
            "ffffffff:ff:ff.0",
            Some(NVML_GPU_FABRIC_STATE_IN_PROGRESS),
        )
    });
    gpus.push(Gpu {
        cores: None,
        ..h100(7, "00000000:CB:00.0", "", None)
    });
    gpus
}
