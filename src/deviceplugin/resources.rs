//! The resources the device plugin advertises, computed from the inventory and the options as
//! NVIDIA's plugin computes them (reference §2.4, §3.2, §6.1):
//! - `nvidia.com/gpu` for whole GPUs;
//! - MIG: `none` ignores MIG mode; `single` advertises the MIG devices as `nvidia.com/gpu` (and
//!   refuses nodes with mixed MIG modes, a MIG GPU without instances, or several profiles);
//!   `mixed` advertises them as `nvidia.com/mig-<profile>` (`+` in a profile becomes `.`);
//! - sharing: each selected device becomes `replicas` devices `<id>::0 …`, under the same name,
//!   `<name>.shared` (`renameByDefault`) or the entry's `rename`; unselected devices stay whole.
//! - `nvidia.com/gpu-memory` (nvdra's extension, off by default): every whole GPU that no sharing
//!   entry selects as one device per GiB of its memory, `<id>::mem-<n>` for `n` in
//!   `0..floor(memory / 1 GiB)`, each with the GPU's health and NUMA node, *instead of* as
//!   `nvidia.com/gpu`. NVIDIA's plugin has no such resource.
//!
//! Each physical GPU or MIG device is advertised under exactly one resource name: the device
//! manager keeps one account per name, so a GPU under two names could go to two pods.
//!
//! Under dynamic MIG ([`Options::dynamic_mig`], `--mode both --dynamic-mig`) a GPU whose MIG
//! mode DRA switches at run time is DRA's to shape: every strategy hands it out only whole,
//! while it is outside MIG mode, and leaves it out ([`LeftOut`]) while it is in MIG mode or, under
//! `single` on a node whose other GPUs are in MIG mode, at all. The strategy's checks (one MIG
//! mode, one profile) apply to the other GPUs, so a switch never makes the lists fail.
//!
//! Pure: no I/O.

use std::collections::{BTreeMap, BTreeSet};

use crate::holds::Occupied;
use crate::inventory::{DeviceUuid, GpuUuid, Health, Inventory, Placement};

use super::{DeviceSelector, IdStrategy, MigStrategy, Options, ResourceName};

/// The longest device ID the kubelet accepts.
pub const MAX_DEVICE_ID: usize = 63;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    #[error(
        "migStrategy single: all GPUs on the node must have the same MIG mode, but GPUs {enabled:?} are in MIG mode and {disabled:?} are not; use migStrategy mixed"
    )]
    MixedMigModes {
        enabled: Vec<u32>,
        disabled: Vec<u32>,
    },
    #[error("migStrategy single: GPU {gpu} is in MIG mode but has no MIG devices")]
    NoMigDevices { gpu: u32 },
    #[error(
        "migStrategy single: more than one MIG device type present on node ({profiles:?}); use migStrategy mixed"
    )]
    SeveralProfiles { profiles: Vec<String> },
    #[error("device ID {id:?} is {len} characters, over the kubelet's {MAX_DEVICE_ID}")]
    IdTooLong { id: String, len: usize },
    #[error("no valid resource name for {what}: {message}")]
    Name { what: String, message: String },
    #[error(
        "{name} is the GPU-memory resource (--device-plugin-gpu-memory); the sharing config must not advertise replicas under it"
    )]
    ReservedName { name: String },
}

/// A GPU the lists leave out because DRA's dynamic MIG shapes it, and why.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct LeftOut {
    pub uuid: GpuUuid,
    pub index: u32,
    pub why: LeftOutWhy,
}

/// Why a GPU that DRA's dynamic MIG shapes is not in the lists.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, thiserror::Error)]
pub enum LeftOutWhy {
    /// In MIG mode: its MIG devices are DRA's (or are about to be).
    #[error(
        "DRA switched it to MIG mode (dynamic MIG); its MIG devices are handed out through DRA"
    )]
    InMigMode,
    /// Whole, under `single` on a node whose `nvidia.com/gpu` are MIG devices.
    #[error(
        "migStrategy single advertises this node's MIG devices as nvidia.com/gpu, and this GPU, \
         whose MIG mode DRA switches (dynamic MIG), is whole; it is handed out through DRA"
    )]
    WholeBesideMig,
}

/// The device lists, and the GPUs left out of them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Lists {
    pub resources: Vec<Resource>,
    pub left_out: Vec<LeftOut>,
}

/// `nvidia.com/gpu-memory`: GPU memory in GiB units.
pub const GPU_MEMORY: &str = "nvidia.com/gpu-memory";
/// One unit of [`GPU_MEMORY`].
pub const GIB: u64 = 1 << 30;

/// One advertised device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Device {
    /// The ID the kubelet sees: [`Device::base`], with `::<replica>` when replicated.
    pub id: String,
    /// The physical device's ID under the ID strategy: a GPU or MIG UUID, or `<i>` / `<i>:<j>`.
    pub base: String,
    /// The GPU or MIG UUID.
    pub uuid: DeviceUuid,
    /// The physical GPU (a MIG device's parent).
    pub gpu: GpuUuid,
    /// A MIG device's placement on its GPU.
    pub placement: Option<Placement>,
    pub gpu_index: u32,
    pub minor: u32,
    pub numa_node: Option<u32>,
    pub health: Health,
    pub nvlink_domain: u32,
    pub pcie_root: Option<String>,
    /// A MIG device (never topology-aligned).
    pub mig: bool,
    pub replica: Option<u32>,
    /// How many replicas of the physical device this resource advertises (1 when whole).
    pub replicas: u32,
    /// The physical device's memory.
    pub memory_bytes: u64,
    /// A unit of [`GPU_MEMORY`]: its number on the GPU.
    pub memory_unit: Option<u32>,
}

/// One resource name and its devices.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resource {
    pub name: ResourceName,
    pub devices: Vec<Device>,
    /// A request with more than one replica of this resource fails.
    pub fail_requests_greater_than_one: bool,
}

impl Resource {
    pub fn device(&self, id: &str) -> Option<&Device> {
        self.devices.iter().find(|d| d.id == id)
    }

    /// The hardware a device occupies, for the ledger of `--mode both`.
    pub fn occupied(d: &Device) -> Occupied {
        Occupied {
            gpu: d.gpu.clone(),
            mig: match (&d.uuid, d.placement) {
                (DeviceUuid::Mig(m), Some(p)) => Some((m.clone(), p)),
                _ => None,
            },
        }
    }

    pub fn replicated(&self) -> bool {
        self.devices.iter().any(|d| d.replica.is_some())
    }

    /// The GiB units of [`GPU_MEMORY`].
    pub fn memory_units(&self) -> bool {
        self.devices.iter().any(|d| d.memory_unit.is_some())
    }
}

fn gpu_memory_resource() -> ResourceName {
    // A constant that parses (checked by the tests).
    ResourceName(GPU_MEMORY.into())
}

fn gpu_resource() -> ResourceName {
    // A constant that parses (checked by the tests).
    ResourceName(format!("{}/gpu", super::DOMAIN))
}

/// `nvidia.com/mig-<profile>`, `+` replaced by `.`.
pub fn mig_resource(profile: &str) -> Result<ResourceName, Error> {
    ResourceName::parse(&format!("mig-{}", profile.replace('+', "."))).map_err(|message| {
        Error::Name {
            what: format!("MIG profile {profile:?}"),
            message,
        }
    })
}

/// Whether DRA shapes `g` (dynamic MIG): it can switch MIG mode at run time, or DRA switched it
/// (`switched`, the checkpoint's record, which holds even where the GPU no longer can).
fn shaped_by_dra(g: &crate::inventory::Gpu, opts: &Options, switched: &BTreeSet<GpuUuid>) -> bool {
    switched.contains(&g.uuid) || (opts.dynamic_mig && g.mig_toggle().is_ok())
}

/// The devices before sharing, by resource name.
type Physical = BTreeMap<ResourceName, Vec<Device>>;

/// The devices before sharing, and the GPUs left out.
fn physical(
    inv: &Inventory,
    opts: &Options,
    switched: &BTreeSet<GpuUuid>,
) -> Result<(Physical, Vec<LeftOut>), Error> {
    let mut out = Physical::new();
    // The GPUs whose shape is the operator's, which the strategy applies to; the others are
    // handed out whole while outside MIG mode, or left out.
    let (dra, gpus): (Vec<_>, Vec<_>) = inv
        .gpus
        .iter()
        .partition(|g| shaped_by_dra(g, opts, switched));
    let mut left_out = Vec::new();
    let mut leave_out = |g: &crate::inventory::Gpu, why| {
        left_out.push(LeftOut {
            uuid: g.uuid.clone(),
            index: g.index,
            why,
        })
    };
    let whole = |g: &crate::inventory::Gpu| Device {
        id: String::new(),
        base: match opts.id_strategy {
            IdStrategy::Uuid => g.uuid.0.clone(),
            IdStrategy::Index => g.index.to_string(),
        },
        uuid: DeviceUuid::Gpu(g.uuid.clone()),
        gpu: g.uuid.clone(),
        placement: None,
        gpu_index: g.index,
        minor: g.minor,
        numa_node: g.numa_node,
        // A GPU in MIG mode listed whole (`migStrategy: none`) takes every instance's slices.
        health: g.whole_health().clone(),
        nvlink_domain: g.nvlink_domain,
        pcie_root: g.pcie_root.clone(),
        mig: false,
        replica: None,
        replicas: 1,
        memory_bytes: g.memory_bytes,
        memory_unit: None,
    };
    let migs = |g: &crate::inventory::Gpu| -> Vec<(String, Device)> {
        g.mig
            .devices
            .iter()
            .enumerate()
            .map(|(j, m)| {
                let health = if g.health.is_healthy() {
                    m.health.clone()
                } else {
                    g.health.clone()
                };
                (
                    m.profile.clone(),
                    Device {
                        id: String::new(),
                        base: match opts.id_strategy {
                            IdStrategy::Uuid => m.uuid.0.clone(),
                            IdStrategy::Index => format!("{}:{j}", g.index),
                        },
                        uuid: DeviceUuid::Mig(m.uuid.clone()),
                        gpu: g.uuid.clone(),
                        placement: Some(m.placement),
                        gpu_index: g.index,
                        minor: g.minor,
                        numa_node: g.numa_node,
                        health,
                        nvlink_domain: g.nvlink_domain,
                        pcie_root: g.pcie_root.clone(),
                        mig: true,
                        replica: None,
                        replicas: 1,
                        memory_bytes: m.memory_bytes,
                        memory_unit: None,
                    },
                )
            })
            .collect()
    };
    let strategy = match opts.mig_strategy {
        MigStrategy::Single if !gpus.iter().any(|g| g.in_mig_mode()) => MigStrategy::None,
        s => s,
    };
    // DRA's GPUs: whole while outside MIG mode, except beside `single`'s MIG devices.
    let mut dra_whole = Vec::new();
    for g in dra {
        if g.in_mig_mode() {
            leave_out(g, LeftOutWhy::InMigMode);
        } else if strategy == MigStrategy::Single {
            leave_out(g, LeftOutWhy::WholeBesideMig);
        } else {
            dra_whole.push(g);
        }
    }
    match strategy {
        MigStrategy::None => {
            let mut all: Vec<_> = gpus.iter().chain(&dra_whole).copied().collect();
            all.sort_by_key(|g| g.index);
            out.insert(gpu_resource(), all.into_iter().map(whole).collect());
        }
        MigStrategy::Single => {
            let (enabled, disabled): (Vec<_>, Vec<_>) =
                gpus.iter().copied().partition(|g| g.in_mig_mode());
            if !disabled.is_empty() {
                return Err(Error::MixedMigModes {
                    enabled: enabled.iter().map(|g| g.index).collect(),
                    disabled: disabled.iter().map(|g| g.index).collect(),
                });
            }
            let mut profiles = std::collections::BTreeSet::new();
            let mut devices = Vec::new();
            for g in &enabled {
                if g.mig.devices.is_empty() {
                    return Err(Error::NoMigDevices { gpu: g.index });
                }
                for (profile, d) in migs(g) {
                    profiles.insert(profile);
                    devices.push(d);
                }
            }
            if profiles.len() > 1 {
                return Err(Error::SeveralProfiles {
                    profiles: profiles.into_iter().collect(),
                });
            }
            out.insert(gpu_resource(), devices);
        }
        MigStrategy::Mixed => {
            let mut all: Vec<_> = gpus.iter().chain(&dra_whole).copied().collect();
            all.sort_by_key(|g| g.index);
            for g in all {
                if !g.in_mig_mode() {
                    out.entry(gpu_resource()).or_default().push(whole(g));
                    continue;
                }
                if g.mig.devices.is_empty() {
                    tracing::warn!(gpu = g.index, "GPU in MIG mode has no MIG devices");
                }
                for (profile, d) in migs(g) {
                    out.entry(mig_resource(&profile)?).or_default().push(d);
                }
            }
        }
    }
    Ok((out, left_out))
}

fn selected(sel: &DeviceSelector, position: usize, d: &Device) -> bool {
    match sel {
        DeviceSelector::All => true,
        DeviceSelector::First(n) => position < *n as usize,
        DeviceSelector::List(items) => items.iter().any(|item| {
            *item == d.uuid.as_str()
                || *item == d.base
                || (!d.mig && *item == d.gpu_index.to_string())
        }),
    }
}

/// Every resource to advertise, by name; resources without devices are left out (NVIDIA's
/// plugin does not start them either).
pub fn resources(inv: &Inventory, opts: &Options) -> Result<Vec<Resource>, Error> {
    lists(inv, opts, &BTreeSet::new()).map(|l| l.resources)
}

/// [`resources`], and the GPUs left out because DRA's dynamic MIG shapes them: those that can
/// switch MIG mode at run time where [`Options::dynamic_mig`] is on, and those in `switched`,
/// whose MIG mode DRA turned on (the checkpoint's record).
pub fn lists(
    inv: &Inventory,
    opts: &Options,
    switched: &BTreeSet<GpuUuid>,
) -> Result<Lists, Error> {
    let mut out: BTreeMap<ResourceName, Resource> = BTreeMap::new();
    let mut put = |name: &ResourceName, fail: bool, d: Device| {
        let r = out.entry(name.clone()).or_insert_with(|| Resource {
            name: name.clone(),
            devices: Vec::new(),
            fail_requests_greater_than_one: false,
        });
        r.fail_requests_greater_than_one |= fail;
        r.devices.push(d);
    };
    let (physical, left_out) = physical(inv, opts, switched)?;
    for (name, devices) in physical {
        let entry = opts
            .sharing
            .as_ref()
            .and_then(|s| s.resources.iter().find(|r| r.name == name).map(|r| (s, r)));
        for (pos, mut d) in devices.into_iter().enumerate() {
            match entry {
                Some((sharing, r)) if selected(&r.devices, pos, &d) => {
                    let target = match (&r.rename, sharing.rename_by_default) {
                        (Some(t), _) => t.clone(),
                        (None, true) => name.shared().map_err(|message| Error::Name {
                            what: format!("the shared replicas of {name} (renameByDefault)"),
                            message,
                        })?,
                        (None, false) => name.clone(),
                    };
                    if opts.gpu_memory && target.as_str() == GPU_MEMORY {
                        return Err(Error::ReservedName {
                            name: GPU_MEMORY.into(),
                        });
                    }
                    for n in 0..r.replicas {
                        let mut rep = d.clone();
                        rep.id = format!("{}::{n}", d.base);
                        rep.replica = Some(n);
                        rep.replicas = r.replicas;
                        put(&target, sharing.fail_requests_greater_than_one, rep);
                    }
                }
                // A whole GPU is advertised once: as GiB units when they are on, else whole.
                // Under two names the device manager would hand it to two pods.
                _ if opts.gpu_memory && !d.mig => {
                    for n in 0..(d.memory_bytes / GIB) as u32 {
                        let mut unit = d.clone();
                        unit.id = format!("{}::mem-{n}", d.base);
                        unit.memory_unit = Some(n);
                        put(&gpu_memory_resource(), false, unit);
                    }
                }
                _ => {
                    d.id = d.base.clone();
                    put(&name, false, d);
                }
            }
        }
    }
    let out: Vec<Resource> = out
        .into_values()
        .filter(|r| !r.devices.is_empty())
        .collect();
    for r in &out {
        for d in &r.devices {
            if d.id.len() > MAX_DEVICE_ID {
                return Err(Error::IdTooLong {
                    id: d.id.clone(),
                    len: d.id.len(),
                });
            }
        }
    }
    Ok(Lists {
        resources: out,
        left_out,
    })
}
