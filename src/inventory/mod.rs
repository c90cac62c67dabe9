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

pub mod cache;
pub mod nvml;
pub mod sim;
pub mod table;
pub mod topology;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use serde::{Deserialize, Serialize};

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
    Unhealthy {
        reason: String,
    },
}

impl Health {
    pub fn is_healthy(&self) -> bool {
        matches!(self, Health::Healthy)
    }
}

impl fmt::Display for Health {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Health::Healthy => f.write_str("Healthy"),
            Health::Unhealthy { reason } => write!(f, "Unhealthy ({reason})"),
        }
    }
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
    /// Number of memory slices a placement indexes into (8 on A100/H100/H200).
    pub memory_slices: u32,
    pub devices: Vec<MigDevice>,
    pub profiles: Vec<MigProfile>,
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
    pub health: Health,
}

impl Gpu {
    /// True when this GPU's silicon is handed out as MIG devices instead of as a whole.
    pub fn in_mig_mode(&self) -> bool {
        self.mig.capable && self.mig.enabled
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
}

/// Sets every GPU's `nvlink_domain` to the lowest index among the GPUs it can reach over NVLink.
///
/// GPUs are connected when one lists the other as a peer (either direction counts, since a
/// backend may see only one side) or when both reach the same NVSwitch. Peers naming a GPU that is
/// not in the list (hidden by `CUDA_VISIBLE_DEVICES`, or fallen off the bus) are ignored.
pub fn assign_nvlink_domains(gpus: &mut [Gpu]) {
    let n = gpus.len();
    let mut parent: Vec<usize> = (0..n).collect();
    fn find(parent: &mut [usize], mut x: usize) -> usize {
        while parent[x] != x {
            parent[x] = parent[parent[x]];
            x = parent[x];
        }
        x
    }
    let union = |parent: &mut Vec<usize>, a: usize, b: usize| {
        let (ra, rb) = (find(parent, a), find(parent, b));
        if ra != rb {
            parent[ra.max(rb)] = ra.min(rb);
        }
    };
    let by_bus: BTreeMap<&PciBusId, usize> = gpus
        .iter()
        .enumerate()
        .map(|(i, g)| (&g.pci_bus_id, i))
        .collect();
    let mut switch_owner: BTreeMap<&str, usize> = BTreeMap::new();
    let mut edges = Vec::new();
    for (i, g) in gpus.iter().enumerate() {
        for peer in &g.nvlink_peers {
            match peer {
                NvLinkPeer::Gpu(bus) => {
                    if let Some(&j) = by_bus.get(bus) {
                        edges.push((i, j));
                    }
                }
                NvLinkPeer::Switch(id) => {
                    let first = *switch_owner.entry(id.as_str()).or_insert(i);
                    edges.push((i, first));
                }
            }
        }
    }
    for (a, b) in edges {
        union(&mut parent, a, b);
    }
    let roots: Vec<usize> = (0..n).map(|i| find(&mut parent, i)).collect();
    let mut domain_of_root: BTreeMap<usize, u32> = BTreeMap::new();
    for (g, &root) in gpus.iter().zip(&roots) {
        domain_of_root
            .entry(root)
            .and_modify(|d| *d = (*d).min(g.index))
            .or_insert(g.index);
    }
    for (g, root) in gpus.iter_mut().zip(&roots) {
        g.nvlink_domain = domain_of_root[root];
    }
}

/// Formats bytes as a Kubernetes quantity in canonical binary-SI form (`80Gi`, `4864Mi`).
pub fn quantity(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["", "Ki", "Mi", "Gi", "Ti", "Pi"];
    let mut value = bytes;
    let mut unit = 0;
    while value != 0 && value.is_multiple_of(1024) && unit + 1 < UNITS.len() {
        value /= 1024;
        unit += 1;
    }
    format!("{value}{}", UNITS[unit])
}

/// Parses a Kubernetes quantity of bytes (`80Gi`, `4864Mi`, `1G`, `1024`) into bytes.
pub fn parse_quantity(s: &str) -> Option<u64> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (digits, suffix) = s.split_at(split);
    let value: u64 = digits.parse().ok()?;
    let mult: u64 = match suffix {
        "" => 1,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "Ti" => 1 << 40,
        "Pi" => 1 << 50,
        "k" => 1_000,
        "M" => 1_000_000,
        "G" => 1_000_000_000,
        "T" => 1_000_000_000_000,
        _ => return None,
    };
    value.checked_mul(mult)
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

/// A source of inventory snapshots, and the few reconfigurations prepare needs. Implementations
/// block (NVML is synchronous); async callers run them on the blocking pool ([`snapshot`]).
///
/// The reconfiguration methods default to [`Error::Unsupported`], so a backend opts in to each.
pub trait DeviceBackend: Send + Sync + 'static {
    /// A short name for logs (`nvml`, `simulated`).
    fn name(&self) -> &'static str;
    /// The current inventory. May come from a cache (see [`cache::Cached`]).
    fn snapshot(&self) -> Result<Inventory>;

    /// Reads the inventory from the hardware, bypassing any cache.
    fn refresh(&self) -> Result<Inventory> {
        self.snapshot()
    }

    /// Sets the compute time slice of a whole GPU.
    fn set_time_slice(&self, gpu: &GpuUuid, interval: TimeSlice) -> Result<()> {
        let _ = (gpu, interval);
        Err(Error::Unsupported {
            backend: self.name(),
            operation: "setting the time slice",
        })
    }

    /// Creates a MIG device (GPU instance plus one compute instance spanning it) of the GPU-instance
    /// profile `gi_profile_id` at `placement`, and returns it.
    fn create_mig(
        &self,
        gpu: &GpuUuid,
        gi_profile_id: u32,
        placement: Placement,
    ) -> Result<MigDevice> {
        let _ = (gpu, gi_profile_id, placement);
        Err(Error::Unsupported {
            backend: self.name(),
            operation: "creating MIG devices",
        })
    }

    /// Destroys a MIG device created by [`DeviceBackend::create_mig`]. Destroying one that no
    /// longer exists succeeds, so rollbacks can repeat it.
    fn destroy_mig(&self, gpu: &GpuUuid, mig: &MigUuid) -> Result<()> {
        let _ = (gpu, mig);
        Err(Error::Unsupported {
            backend: self.name(),
            operation: "destroying MIG devices",
        })
    }
}

/// [`DeviceBackend::snapshot`] off the async runtime.
pub async fn snapshot(backend: std::sync::Arc<dyn DeviceBackend>) -> Result<Inventory> {
    tokio::task::spawn_blocking(move || backend.snapshot())
        .await
        .map_err(Error::Task)?
}

/// [`DeviceBackend::refresh`] off the async runtime.
pub async fn refresh(backend: std::sync::Arc<dyn DeviceBackend>) -> Result<Inventory> {
    tokio::task::spawn_blocking(move || backend.refresh())
        .await
        .map_err(Error::Task)?
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn gpu(index: u32, bus: &str, peers: &[NvLinkPeer]) -> Gpu {
        Gpu {
            index,
            minor: index,
            uuid: GpuUuid(format!("GPU-{index}")),
            product_name: "NVIDIA Test".into(),
            brand: Some("Nvidia".into()),
            architecture: Some("Hopper".into()),
            cuda_compute_capability: ComputeCapability { major: 9, minor: 0 },
            driver_version: "570.124.06".into(),
            cuda_driver_version: "12.8".into(),
            memory_bytes: 80 << 30,
            multiprocessors: Some(132),
            engines: Engines::default(),
            pci_bus_id: PciBusId(bus.into()),
            pcie_root: None,
            numa_node: None,
            mig: Mig::default(),
            nvlink_peers: peers.iter().cloned().collect(),
            nvlink_domain: u32::MAX,
            fabric: None,
            health: Health::Healthy,
        }
    }

    fn domains(gpus: Vec<Gpu>) -> Vec<u32> {
        Inventory::new(gpus)
            .unwrap()
            .gpus
            .iter()
            .map(|g| g.nvlink_domain)
            .collect()
    }

    fn bus(b: &str) -> NvLinkPeer {
        NvLinkPeer::Gpu(PciBusId(b.into()))
    }

    #[test]
    fn gpus_without_nvlink_are_islands() {
        let d = domains(vec![gpu(0, "a", &[]), gpu(1, "b", &[]), gpu(2, "c", &[])]);
        assert_eq!(d, vec![0, 1, 2]);
    }

    #[test]
    fn bridged_pairs_form_two_domains() {
        let d = domains(vec![
            gpu(0, "a", &[bus("b")]),
            gpu(1, "b", &[bus("a")]),
            gpu(2, "c", &[bus("d")]),
            gpu(3, "d", &[bus("c")]),
        ]);
        assert_eq!(d, vec![0, 0, 2, 2]);
    }

    #[test]
    fn one_sided_links_still_connect() {
        let d = domains(vec![gpu(0, "a", &[]), gpu(1, "b", &[bus("a")])]);
        assert_eq!(d, vec![0, 0]);
    }

    #[test]
    fn chains_are_transitive_and_use_lowest_index() {
        // 5 - 3 - 4, out of index order in the input.
        let d = domains(vec![
            gpu(4, "e", &[bus("d")]),
            gpu(3, "d", &[]),
            gpu(5, "f", &[bus("d")]),
        ]);
        assert_eq!(d, vec![3, 3, 3]);
    }

    #[test]
    fn switches_join_everything_attached() {
        let sw = |s: &str| NvLinkPeer::Switch(s.into());
        let d = domains(vec![
            gpu(0, "a", &[sw("s0"), sw("s1")]),
            gpu(1, "b", &[sw("s1")]),
            gpu(2, "c", &[sw("s0")]),
            gpu(3, "d", &[]),
            gpu(4, "e", &[sw("other")]),
        ]);
        assert_eq!(d, vec![0, 0, 0, 3, 4]);
    }

    #[test]
    fn peers_outside_the_inventory_are_ignored() {
        let d = domains(vec![gpu(0, "a", &[bus("zz")]), gpu(1, "b", &[])]);
        assert_eq!(d, vec![0, 1]);
    }

    #[test]
    fn duplicate_identities_are_rejected() {
        let mut g = gpu(1, "b", &[]);
        g.uuid = GpuUuid("GPU-0".into());
        let err = Inventory::new(vec![gpu(0, "a", &[]), g]).unwrap_err();
        assert!(err.to_string().contains("share the uuid GPU-0"), "{err}");
        let err = Inventory::new(vec![gpu(0, "a", &[]), gpu(0, "b", &[])]).unwrap_err();
        assert!(err.to_string().contains("index"), "{err}");
    }

    #[test]
    fn pci_bus_ids_normalize() {
        assert_eq!(
            PciBusId::normalize("00000000:0F:00.0").unwrap().0,
            "0000:0f:00.0"
        );
        assert_eq!(
            PciBusId::normalize("0000:b7:00.0").unwrap().0,
            "0000:b7:00.0"
        );
        assert!(PciBusId::normalize("garbage").is_none());
        assert!(PciBusId::normalize("0000:zz:00.0").is_none());
        let id = PciBusId::normalize("0001:87:00.0").unwrap();
        assert_eq!(id.domain_and_bus(), ("0001", "87"));
    }

    #[test]
    fn cluster_uuids_are_canonical() {
        let bytes = [
            0x6c, 0x1f, 0x3a, 0x52, 0x8d, 0x2e, 0x4b, 0x7a, 0x9f, 0x10, 0x01, 0x23, 0x45, 0x67,
            0x89, 0xab,
        ];
        let u = ClusterUuid::from_bytes(bytes);
        assert_eq!(u.as_str(), "6c1f3a52-8d2e-4b7a-9f10-0123456789ab");
        assert_eq!(
            ClusterUuid::parse("6C1F3A52-8D2E-4B7A-9F10-0123456789AB"),
            Some(u.clone())
        );
        for bad in [
            "",
            "6c1f3a528d2e4b7a9f100123456789ab",
            "{6c1f3a52-8d2e-4b7a-9f10-0123456789ab}",
            "6c1f3a52-8d2e-4b7a-9f10-0123456789a",
            "6c1f3a52-8d2e-4b7a-9f10-0123456789ag",
            "6c1f3a5-28d2e-4b7a-9f10-0123456789ab",
        ] {
            assert_eq!(ClusterUuid::parse(bad), None, "{bad:?}");
        }
        let f = Fabric {
            cluster_uuid: u,
            clique_id: 7,
        };
        assert_eq!(f.to_string(), "6c1f3a52-8d2e-4b7a-9f10-0123456789ab.7");
    }

    #[test]
    fn quantities_are_canonical_and_round_trip() {
        assert_eq!(quantity(80 << 30), "80Gi");
        assert_eq!(quantity(4864 << 20), "4864Mi");
        assert_eq!(quantity(1536), "1536");
        assert_eq!(quantity(0), "0");
        assert_eq!(quantity(3 << 40), "3Ti");
        for q in ["80Gi", "4864Mi", "1536", "141Gi"] {
            assert_eq!(quantity(parse_quantity(q).unwrap()), q);
        }
        assert_eq!(parse_quantity("1G"), Some(1_000_000_000));
        assert_eq!(parse_quantity("12Zi"), None);
        assert_eq!(parse_quantity("Gi"), None);
    }

    #[test]
    fn placements_overlap() {
        let p = |start, size| Placement { start, size };
        assert!(p(0, 4).overlaps(&p(2, 2)));
        assert!(!p(0, 4).overlaps(&p(4, 4)));
        assert!(p(6, 1).overlaps(&p(0, 8)));
    }
}
