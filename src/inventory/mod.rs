//! The node's GPUs as one owned snapshot.
//!
//! An [`Inventory`] describes everything downstream parts need: each GPU, its MIG devices (existing
//! ones and the placements it could still host), NVLink/NUMA/PCIe topology and health. Backends
//! ([`nvml`], [`sim`]) produce it; nothing else talks to NVML. The types here are plain owned
//! values — no NVML handles or lifetimes — so they can be cloned, compared, serialized and sent
//! across tasks freely.
//!
//! Invariants upheld by [`Inventory::new`]: GPUs are sorted by index; indices, minors, UUIDs and
//! PCI bus ids are unique; `nvlink_domain` is computed from the NVLink peers (see
//! [`assign_nvlink_domains`]).

mod backend;
pub mod deadline;
mod domains;
pub mod events;
pub mod health;
pub mod holders;
mod mig_mode;
pub mod nvml;
pub mod owner;
mod quantity;
pub mod sim;
pub mod switch_blocks;
pub mod table;
pub mod topology;
mod usage;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use serde::{Deserialize, Serialize};

pub use backend::{
    Backend, ComputeMode, DeviceBackend, MEMORY_LIMIT_MAX, MemoryLimits, Reconfiguration,
    Reconfigure,
};
pub use domains::assign_nvlink_domains;
pub use mig_mode::{
    HOPPER, Holder, HolderKind, MigModeChange, NoMigToggle, SwitchBlock, Virtualization, on_off,
};
pub use quantity::{parse_quantity, quantity};
pub use usage::{GpuUsage, ProcessUsage};

/// Errors from reading an inventory.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(
        "cannot load the NVIDIA management library {library}: {reason}; is the NVIDIA driver installed? \
         On a machine without NVIDIA GPUs use --backend simulated (or --profile NAME)"
    )]
    NvmlMissing { library: String, reason: String },
    #[error("NVML call {call} failed: {reason}")]
    Nvml { call: String, reason: String },
    #[error(transparent)]
    Topology(#[from] topology::Error),
    #[error("invalid inventory: {0}")]
    Invalid(String),
    /// The blocking task that talked to the backend panicked.
    #[error("the inventory task panicked")]
    Task(#[source] tokio::task::JoinError),
    /// The backend cannot do this (e.g. MIG reconfiguration through a backend without it).
    #[error("the {backend} backend does not support {operation}")]
    Unsupported {
        backend: &'static str,
        operation: &'static str,
    },
    /// A reconfiguration request the hardware refuses (bad placement, unknown GPU, ...).
    #[error("{0}")]
    Refused(String),
    /// MIG mode cannot change while processes run on the GPU (NVML's activation status
    /// `NVML_ERROR_IN_USE`). Retriable: the same call succeeds once they exit. The requested
    /// mode is left pending, as NVML leaves it: the caller withdraws it (one more request, for
    /// the current mode) or retries.
    #[error(
        "GPU {gpu} is in use by processes {}; its MIG mode can change once they exit",
        mig_mode::in_use_by(processes, holders)
    )]
    InUse {
        gpu: GpuUuid,
        /// Every pid found in the way: NVML's compute processes, then the other holders.
        processes: Vec<u32>,
        /// Those of them the backend could describe (name, and whose), sorted by pid; only
        /// holders that block a switch ([`HolderKind::Foreign`], [`HolderKind::OwnMps`]).
        holders: Vec<Holder>,
    },
    /// The MIG mode change is recorded as pending and takes effect only after a GPU reset
    /// (Ampere; or a VM that cannot reset the GPU itself). The change is left pending, as NVML
    /// leaves it: the caller withdraws it (one more request, for the current mode).
    #[error(
        "the MIG mode of GPU {gpu} is {}, with {} pending: a GPU reset is required to apply it",
        on_off(*current),
        on_off(*pending)
    )]
    ResetRequired {
        gpu: GpuUuid,
        current: bool,
        pending: bool,
    },
    /// MIG mode cannot be turned off while MIG devices exist.
    #[error(
        "cannot turn MIG mode off on GPU {gpu}: MIG devices {} exist; destroy them first",
        mig_mode::mig_uuids(devices)
    )]
    MigDevicesExist { gpu: GpuUuid, devices: Vec<MigUuid> },
    /// The GPU's MIG mode cannot change at all through this call.
    #[error("the MIG mode of GPU {gpu} cannot change")]
    MigModeFixed {
        gpu: GpuUuid,
        #[source]
        reason: NoMigToggle,
    },
    /// A driver tool (`nvidia-smi`) could not be started.
    #[error("cannot run {command}")]
    Command {
        command: String,
        #[source]
        source: std::io::Error,
    },
    /// An inventory read that did not answer in time ([`owner::DEADLINE`]).
    #[error(
        "the {backend} backend's {call} did not answer within {after:?}; the last inventory read is kept"
    )]
    Deadline {
        backend: &'static str,
        call: &'static str,
        after: std::time::Duration,
    },
    /// A backend call (a reconfiguration, a live reading, a probe) that did not return within
    /// its deadline ([`deadline::Deadlines`]); it goes on in the background.
    #[error(
        "the {backend} backend's {call} did not return within {after:?}; it goes on in the background"
    )]
    CallDeadline {
        backend: &'static str,
        call: String,
        after: std::time::Duration,
    },
    /// A call not made because another of its kind passed its deadline and still runs.
    #[error(
        "not calling {call}: the {backend} backend's {stuck} has not returned, {after:?} after it \
         was called; nvdra calls again once it returns"
    )]
    Overdue {
        backend: &'static str,
        call: String,
        stuck: String,
        after: std::time::Duration,
    },
    /// No thread could be started for a backend call.
    #[error("cannot start a thread for {call}")]
    Thread {
        call: String,
        #[source]
        source: std::io::Error,
    },
    /// A backend call panicked.
    #[error("the {backend} backend's {call} panicked")]
    CallPanicked { backend: &'static str, call: String },
    /// A driver tool that did not finish within its deadline, and was killed.
    #[error("{command} did not finish within {after:?} and was killed")]
    CommandDeadline {
        command: String,
        after: std::time::Duration,
    },
    /// No read succeeded yet; the last one failed.
    #[error("the node's inventory could not be read")]
    Read(#[source] std::sync::Arc<Error>),
    /// Nothing was read yet.
    #[error("the node's inventory has not been read yet")]
    NotRead,
    /// The inventory owner stopped (a supervised task, so the process is stopping).
    #[error("the inventory owner stopped")]
    OwnerGone,
    /// The inventory reader thread ended (it panicked in the backend).
    #[error("the inventory reader thread stopped (it panicked in the backend)")]
    ReaderGone,
    /// A driver tool ran and failed.
    #[error("{command} failed ({status}): {output}")]
    CommandFailed {
        command: String,
        status: String,
        output: String,
    },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

macro_rules! string_newtype {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
        #[serde(transparent)]
        pub struct $name(pub String);

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl $name {
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }
    };
}

string_newtype!(
    /// A GPU UUID as NVML reports it (`GPU-…`).
    GpuUuid
);
string_newtype!(
    /// A MIG device UUID as NVML reports it (`MIG-…`); never a GPU's.
    MigUuid
);
/// What CUDA_VISIBLE_DEVICES and NVML accept: a whole GPU's UUID or a MIG device's.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum DeviceUuid {
    Gpu(GpuUuid),
    Mig(MigUuid),
}

impl DeviceUuid {
    pub fn as_str(&self) -> &str {
        match self {
            DeviceUuid::Gpu(u) => u.as_str(),
            DeviceUuid::Mig(u) => u.as_str(),
        }
    }
}

impl fmt::Display for DeviceUuid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

string_newtype!(
    /// An extended PCI bus id, `dddd:bb:dd.f`, lower case.
    PciBusId
);

impl PciBusId {
    /// Normalizes NVML's forms (`00000000:07:00.0`, upper case) to `0000:07:00.0`.
    pub fn normalize(raw: &str) -> Option<Self> {
        let raw = raw.trim().to_ascii_lowercase();
        let (domain, rest) = raw.split_once(':')?;
        let (bus, rest) = rest.split_once(':')?;
        let (dev, func) = rest.split_once('.')?;
        let hex = |s: &str, max_len: usize| {
            !s.is_empty() && s.len() <= max_len && s.chars().all(|c| c.is_ascii_hexdigit())
        };
        if !(hex(domain, 8) && hex(bus, 2) && hex(dev, 2) && hex(func, 1)) {
            return None;
        }
        let domain = u32::from_str_radix(domain, 16).ok()?;
        if domain > 0xffff {
            return None;
        }
        Some(Self(format!("{domain:04x}:{bus:0>2}:{dev:0>2}.{func}")))
    }

    /// The PCI domain and bus, e.g. `("0000", "07")`.
    pub fn domain_and_bus(&self) -> (&str, &str) {
        let mut parts = self.0.splitn(3, ':');
        let domain = parts.next().unwrap_or_default();
        let bus = parts.next().unwrap_or_default();
        (domain, bus)
    }
}

/// CUDA compute capability, e.g. 9.0 for Hopper.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ComputeCapability {
    pub major: u32,
    pub minor: u32,
}

impl fmt::Display for ComputeCapability {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

/// Whether a device can be handed out.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "camelCase")]
pub enum Health {
    #[default]
    Healthy,
    /// Broken for good as far as nvdra knows (a topology file says so): not published at all.
    Unhealthy { reason: String },
    /// Failing as the health monitor saw it (`crate::health`): still published, carrying
    /// `taint`, so a pod already using the device keeps seeing it in the slice while the
    /// scheduler keeps new claims off it (DRA device taints, KEP-5055). It becomes `Healthy`
    /// again when the monitor sees the GPU recover.
    Tainted { reason: String, taint: Taint },
}

impl Health {
    pub fn is_healthy(&self) -> bool {
        matches!(self, Health::Healthy)
    }

    /// True for a device that is left out of the published slices.
    pub fn is_withdrawn(&self) -> bool {
        matches!(self, Health::Unhealthy { .. })
    }

    /// Why the device is not healthy; `None` when it is.
    pub fn reason(&self) -> Option<&str> {
        match self {
            Health::Healthy => None,
            Health::Unhealthy { reason } | Health::Tainted { reason, .. } => Some(reason),
        }
    }
}

impl fmt::Display for Health {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.reason() {
            None => f.write_str("Healthy"),
            Some(reason) => write!(f, "Unhealthy ({reason})"),
        }
    }
}

/// What a device taint says about a failing GPU; published under the driver's domain
/// (`gpu.nvidia.com/xid=79`, `gpu.nvidia.com/gpu-lost`), the keys NVIDIA's DRA driver uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", tag = "kind", content = "xid")]
pub enum TaintKey {
    /// A critical XID error; the value is the XID.
    Xid(u64),
    /// The GPU fell off the bus or stopped answering NVML.
    GpuLost,
    /// The GPU's health cannot be watched (NVML refused its event registration).
    Unmonitored,
    /// The MPS control daemon of the GPU's shares does not answer: a new share could not be
    /// served (nor limited) until the MPS host has restarted it.
    MpsDaemonDown,
}

impl TaintKey {
    /// The key's name within the driver's domain.
    pub fn name(&self) -> &'static str {
        match self {
            TaintKey::Xid(_) => "xid",
            TaintKey::GpuLost => "gpu-lost",
            TaintKey::Unmonitored => "unmonitored",
            TaintKey::MpsDaemonDown => "mps-daemon-down",
        }
    }

    /// The taint's value: the XID for an XID taint, none otherwise.
    pub fn value(&self) -> Option<String> {
        match self {
            TaintKey::Xid(x) => Some(x.to_string()),
            TaintKey::GpuLost | TaintKey::Unmonitored | TaintKey::MpsDaemonDown => None,
        }
    }
}

/// What a taint does to claims, as `resource.k8s.io` names it.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
pub enum TaintEffect {
    /// New claims do not get the device; running pods keep it.
    #[default]
    NoSchedule,
    /// Also evicts the pods using the device.
    NoExecute,
}

impl TaintEffect {
    pub fn as_str(&self) -> &'static str {
        match self {
            TaintEffect::NoSchedule => "NoSchedule",
            TaintEffect::NoExecute => "NoExecute",
        }
    }
}

impl fmt::Display for TaintEffect {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One taint of a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Taint {
    pub key: TaintKey,
    pub effect: TaintEffect,
}

/// Engines of a GPU or MIG instance besides the SMs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Engines {
    #[serde(default)]
    pub copy_engines: u32,
    #[serde(default)]
    pub decoders: u32,
    #[serde(default)]
    pub encoders: u32,
    #[serde(default)]
    pub jpeg_engines: u32,
    #[serde(default)]
    pub ofa_engines: u32,
}

/// A MIG placement: the first memory slice and the number of slices.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Placement {
    pub start: u32,
    pub size: u32,
}

impl Placement {
    pub fn overlaps(&self, other: &Placement) -> bool {
        self.start < other.start + other.size && other.start < self.start + self.size
    }

    pub fn slices(&self) -> std::ops::Range<u32> {
        self.start..self.start + self.size
    }
}

/// A GPU-instance profile a MIG-capable GPU supports.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MigProfile {
    /// e.g. `1g.10gb`, `1g.10gb+me`.
    pub name: String,
    /// NVML's GPU-instance profile id as `nvidia-smi mig -lgip` shows it (19 for A100 `1g.5gb`).
    pub gi_profile_id: u32,
    pub memory_bytes: u64,
    pub multiprocessors: u32,
    pub engines: Engines,
    pub max_instances: u32,
    /// Every placement this profile may take, sorted by start.
    pub placements: Vec<Placement>,
}

/// An existing MIG device (a GPU instance with one compute instance).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MigDevice {
    pub uuid: MigUuid,
    pub profile: String,
    pub gi_profile_id: u32,
    pub gi_id: u32,
    pub ci_id: u32,
    pub placement: Placement,
    pub memory_bytes: u64,
    pub multiprocessors: u32,
    pub engines: Engines,
    pub health: Health,
}

/// MIG state of one GPU.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Mig {
    pub capable: bool,
    /// NVML could not say whether this GPU does MIG (its MIG-mode query failed). `capable` and
    /// `enabled` are then false, so the GPU is handled whole, but `migCapable` is not published:
    /// "no" would be a value NVML never gave.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub mode_unknown: bool,
    /// Current MIG mode; a GPU in MIG mode is handed out only as MIG devices.
    pub enabled: bool,
    /// The pending MIG mode where it differs from `enabled`: a change NVML recorded that takes
    /// effect only at the next GPU reset. `None` when nothing is pending.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending: Option<bool>,
    /// Number of memory slices a placement indexes into (8 on A100/H100/H200).
    pub memory_slices: u32,
    pub devices: Vec<MigDevice>,
    pub profiles: Vec<MigProfile>,
    /// The processes that hold the GPU open (its device file, or a context NVML lists), as
    /// the backend found them at this read: what makes the driver refuse a MIG mode switch
    /// with `IN_USE`. Read only where the backend was asked to (`--dynamic-mig`); each says
    /// whether it blocks a switch ([`Holder::blocks_switch`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub holders: Vec<Holder>,
    /// Why nvdra will not switch this GPU's MIG mode now though the GPU could at run time: set
    /// by the plugin from what the driver answered a switch, never by a backend read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub switch_block: Option<SwitchBlock>,
}

/// What the far end of an NVLink is.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", tag = "kind", content = "id")]
pub enum NvLinkPeer {
    /// Another GPU, by PCI bus id.
    Gpu(PciBusId),
    /// An NVSwitch, by an id unique on the node: its PCI bus id where NVML reports one, or
    /// [`NODE_NVSWITCHES`] where NVML reports only "a switch" (the invalid-address sentinel of
    /// DGX/HGX baseboards, whose NVSwitches are not PCI functions of the host).
    Switch(String),
}

/// The switch id of NVLinks whose remote end NVML reports as an NVSwitch at the invalid PCI
/// address (`FFFFFFFF:FF:FF.0`): every such switch is one of this node's NVSwitches, and a
/// baseboard's NVSwitches form one fabric, so they share this id and join one NVLink domain.
pub const NODE_NVSWITCHES: &str = "node-nvswitches";

/// The id of an NVLink fabric cluster (a multi-node NVLink system, e.g. one GB200 NVL72 rack),
/// in canonical UUID form: 8-4-4-4-12 lower-case hex digits.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ClusterUuid(String);

impl ClusterUuid {
    /// The 16 bytes NVML reports, in order, as a canonical UUID.
    pub fn from_bytes(b: [u8; 16]) -> Self {
        let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
        Self(format!(
            "{}-{}-{}-{}-{}",
            &hex[0..8],
            &hex[8..12],
            &hex[12..16],
            &hex[16..20],
            &hex[20..32]
        ))
    }

    /// Accepts the canonical form in either case (`6C1F…` reads as `6c1f…`); anything else
    /// (braces, a `urn:uuid:` prefix, missing dashes) is `None`.
    pub fn parse(s: &str) -> Option<Self> {
        let groups: Vec<&str> = s.split('-').collect();
        let lens = [8, 4, 4, 4, 12];
        let ok = groups.len() == lens.len()
            && groups
                .iter()
                .zip(lens)
                .all(|(g, n)| g.len() == n && g.bytes().all(|c| c.is_ascii_hexdigit()));
        ok.then(|| Self(s.to_ascii_lowercase()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ClusterUuid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The NVLink fabric a GPU completed registration with (Hopper and later, through the fabric
/// manager): GPUs with the same cluster and clique can share memory over NVLink across nodes
/// (IMEX). Only ever set from a registration NVML reports as completed and successful.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Fabric {
    pub cluster_uuid: ClusterUuid,
    pub clique_id: u32,
}

impl fmt::Display for Fabric {
    /// `<clusterUUID>.<cliqueID>`, the form of NVIDIA's `nvidia.com/gpu.clique` node label.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.cluster_uuid, self.clique_id)
    }
}

/// One physical GPU.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Gpu {
    pub index: u32,
    /// The `N` of `/dev/nvidiaN`.
    pub minor: u32,
    pub uuid: GpuUuid,
    pub product_name: String,
    /// `None` when NVML does not know it (the attribute is then not published).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub brand: Option<String>,
    /// `None` when neither NVML nor the compute capability tells it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub architecture: Option<String>,
    pub cuda_compute_capability: ComputeCapability,
    /// As the driver reports it, e.g. `570.124.06`.
    pub driver_version: String,
    /// e.g. `12.8`.
    pub cuda_driver_version: String,
    pub memory_bytes: u64,
    /// The SM count; `None` when NVML cannot tell it (the capacity is then not published,
    /// never published as 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub multiprocessors: Option<u32>,
    pub engines: Engines,
    pub pci_bus_id: PciBusId,
    /// `pci<domain>:<bus>` of the PCIe root complex, when known.
    pub pcie_root: Option<String>,
    pub numa_node: Option<u32>,
    pub mig: Mig,
    /// Distinct NVLink peers (deduplicated; several links to one peer count once).
    pub nvlink_peers: BTreeSet<NvLinkPeer>,
    /// GPUs reachable from each other over NVLink (directly or through NVSwitches) share this id:
    /// the lowest GPU index in the island. A GPU without NVLink is an island of its own.
    pub nvlink_domain: u32,
    /// The NVLink fabric registration, where NVML reports a completed one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fabric: Option<Fabric>,
    /// How the GPU is virtualized; `None` when NVML cannot tell. Decides, with the compute
    /// capability and the MIG mode, whether its MIG mode may change ([`Gpu::mig_toggle`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub virtualization: Option<Virtualization>,
    pub health: Health,
}

impl Gpu {
    /// Whether MPS serves clients of several users at once on this GPU (multi-user mode,
    /// `nvidia-cuda-mps-control -M`): Volta (compute capability 7.0) and later. Before it, a
    /// client of another user waits until the running server's clients end.
    pub fn mps_multi_user(&self) -> bool {
        self.cuda_compute_capability.major >= 7
    }

    /// True when this GPU's silicon is handed out as MIG devices instead of as a whole.
    pub fn in_mig_mode(&self) -> bool {
        self.mig.capable && self.mig.enabled
    }

    /// The health of this GPU taken whole: its own while it is not healthy, else that of a
    /// MIG device on it the health monitor tainted (the fault of one instance), since the whole
    /// GPU takes every memory slice that instance takes; healthy otherwise.
    pub fn whole_health(&self) -> &Health {
        if !self.health.is_healthy() {
            return &self.health;
        }
        self.mig
            .devices
            .iter()
            .find(|m| matches!(m.health, Health::Tainted { .. }))
            .map_or(&self.health, |m| &m.health)
    }
}

/// The node's GPUs.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Inventory {
    pub gpus: Vec<Gpu>,
}

impl Inventory {
    /// Checks uniqueness, sorts by index and computes NVLink domains.
    pub fn new(mut gpus: Vec<Gpu>) -> Result<Self> {
        gpus.sort_by_key(|g| g.index);
        let mut seen = BTreeMap::new();
        for g in &gpus {
            for (kind, key) in [
                ("index", g.index.to_string()),
                ("minor", g.minor.to_string()),
                ("uuid", g.uuid.0.clone()),
                ("pci bus id", g.pci_bus_id.0.clone()),
            ] {
                if let Some(prev) = seen.insert((kind, key.clone()), g.index) {
                    return Err(Error::Invalid(format!(
                        "GPUs {prev} and {} share the {kind} {key}",
                        g.index
                    )));
                }
            }
            let mut mig_uuids = BTreeSet::new();
            for m in &g.mig.devices {
                if !mig_uuids.insert(&m.uuid) || seen.contains_key(&("uuid", m.uuid.0.clone())) {
                    return Err(Error::Invalid(format!(
                        "MIG device UUID {} appears twice",
                        m.uuid
                    )));
                }
            }
        }
        assign_nvlink_domains(&mut gpus);
        Ok(Self { gpus })
    }

    pub fn gpu_by_uuid(&self, uuid: &str) -> Option<&Gpu> {
        self.gpus.iter().find(|g| g.uuid.0 == uuid)
    }

    pub fn gpu_by_minor(&self, minor: u32) -> Option<&Gpu> {
        self.gpus.iter().find(|g| g.minor == minor)
    }

    /// The MIG device of this UUID that exists now, with its GPU.
    pub fn mig_by_uuid(&self, uuid: &MigUuid) -> Option<(&Gpu, &MigDevice)> {
        self.gpus.iter().find_map(|g| {
            g.mig
                .devices
                .iter()
                .find(|m| m.uuid == *uuid)
                .map(|m| (g, m))
        })
    }

    /// The memory, in bytes, of the GPU or existing MIG device of this UUID: what a share of it
    /// divides.
    pub fn memory_of(&self, uuid: &DeviceUuid) -> Option<u64> {
        match uuid {
            DeviceUuid::Gpu(g) => self.gpu_by_uuid(g.as_str()).map(|g| g.memory_bytes),
            DeviceUuid::Mig(m) => self.mig_by_uuid(m).map(|(_, m)| m.memory_bytes),
        }
    }
}

/// A compute time-slice length for GPUs shared by time-slicing (`nvidia-smi compute-policy
/// --set-timeslice`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum TimeSlice {
    #[default]
    Default,
    Short,
    Medium,
    Long,
}

impl fmt::Display for TimeSlice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TimeSlice::Default => "Default",
            TimeSlice::Short => "Short",
            TimeSlice::Medium => "Medium",
            TimeSlice::Long => "Long",
        })
    }
}

#[cfg(test)]
mod tests;
