//! The desired `resource.k8s.io/v1` ResourceSlices for a node: a pure function of the
//! [`Inventory`].
//!
//! [`desired_slices`] names every device, fills in its attributes and capacities, models MIG
//! partitioning with shared counters when asked to, and splits the pool into as many slices as the
//! API server's limits require. The publisher sends the result as is (setting only the pool
//! generation and object metadata); `nvdra inventory -o slices` prints it.
//!
//! Invariants of every result (checked by [`validate`] and [`validate_pool`] before it is
//! returned, so a violation is a bug report, never something published):
//!
//! - One pool named after the node, `nodeName` set, `resourceSliceCount` = number of slices,
//!   generation 0 (the publisher owns it). At least one slice, possibly without devices: an empty
//!   pool tells the scheduler "no GPUs here", which is not the same as "no pool".
//! - Device names are DNS labels, unique in the pool, and derived only from stable hardware facts
//!   (`gpu-<minor>`, `gpu-<minor>-mig-<profile>-<giProfileId>-<placementStart>`), so the same
//!   silicon keeps its name across restarts. Devices are sorted by name within each slice.
//! - The same silicon is never offered twice: without partitioning, a GPU in MIG mode publishes
//!   only its MIG devices; with partitioning, shared counters make overlapping devices mutually
//!   exclusive. Unhealthy GPUs and MIG devices are not published.
//! - Every limit of `resource.k8s.io/v1` in Kubernetes 1.34 and 1.35 holds: at most 128 devices
//!   per slice (64 when a device consumes counters or has taints), 32 attributes and capacities
//!   per device, values of at most 64 characters, valid semantic versions, at most 8 counter sets
//!   of 32 counters per slice, at most 2 counter consumptions of 32 counters per device.
//!
//! Attribute names without a domain live in the driver's domain (`gpu.nvidia.com` by default) and
//! match NVIDIA's DRA driver where it has the same attribute, so existing DeviceClasses and CEL
//! selectors keep working.

mod validate;

use std::collections::BTreeMap;
use std::fmt;

use k8s_openapi::api::resource::v1::{
    Counter, CounterSet, Device, DeviceAttribute, DeviceCapacity, DeviceCounterConsumption,
    ResourcePool, ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use crate::inventory::{
    Engines, Gpu, Inventory, MigDevice, MigProfile, MigUuid, Placement, quantity,
};

pub use validate::{Violation, is_semver, validate, validate_pool};

/// Most devices in one slice.
pub const MAX_DEVICES_PER_SLICE: usize = 128;
/// Most devices in one slice when any of them consumes counters or has taints (1.35).
pub const MAX_DEVICES_PER_SLICE_WITH_COUNTERS_OR_TAINTS: usize = 64;
/// Most attributes and capacities of one device, together.
pub const MAX_ATTRIBUTES_AND_CAPACITIES: usize = 32;
/// Longest string or version attribute value.
pub const MAX_VALUE_LENGTH: usize = 64;
/// Most counter sets in one slice (1.35).
pub const MAX_COUNTER_SETS_PER_SLICE: usize = 8;
/// Most counters in one counter set (1.35), and in all sets of a slice that also lists devices
/// (1.34).
pub const MAX_COUNTERS_PER_SET: usize = 32;
/// Most counter consumptions of one device (1.35).
pub const MAX_CONSUMPTIONS_PER_DEVICE: usize = 2;
/// Most counters in one consumption (1.35), and consumed by one device in all (1.34).
pub const MAX_COUNTERS_PER_CONSUMPTION: usize = 32;

/// The standard attribute for a device's PCI address (extended BDF).
pub const ATTR_PCI_BUS_ID: &str = "resource.kubernetes.io/pciBusID";
/// The standard attribute for a device's PCIe root complex (`pci<domain>:<bus>`).
pub const ATTR_PCIE_ROOT: &str = "resource.kubernetes.io/pcieRoot";
/// The NVLink fabric cluster a GPU (and its MIG devices) registered with, a canonical UUID.
/// NVIDIA's DRA driver publishes no fabric attribute (its clique is only the
/// `nvidia.com/gpu.clique` node label, `<clusterUUID>.<cliqueID>`), so the name is ours.
pub const ATTR_FABRIC_CLUSTER_UUID: &str = "fabricClusterUUID";
/// The NVLink fabric clique within [`ATTR_FABRIC_CLUSTER_UUID`] (an int).
pub const ATTR_FABRIC_CLIQUE_ID: &str = "fabricCliqueID";

/// Why no slices could be computed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A computed slice breaks an API rule: a bug in this module (or an inventory no GPU has),
    /// reported instead of published.
    #[error(
        "bug: desired ResourceSlice {slice} of node {node} breaks the API's rules: {violations}; \
         nothing was published — please report this with the output of `nvdra inventory -o json`"
    )]
    Invalid {
        node: String,
        /// Index of the offending slice, or `pool` for rules across slices.
        slice: String,
        violations: Violations,
    },
    /// A MIG-capable GPU needs more counters than two consumptions can carry.
    #[error(
        "GPU gpu-{minor} needs {needed} shared counters ({memory_slices} memory slices plus its \
         resources), more than a device may consume ({max}: {sets} sets of {per_set}); publish it \
         without --partitionable"
    )]
    TooManyCounters {
        minor: u32,
        memory_slices: u32,
        needed: usize,
        max: usize,
        sets: usize,
        per_set: usize,
    },
    /// In the 1.34 layout a GPU's counters and all devices consuming them share one slice.
    #[error(
        "GPU gpu-{minor} has {devices} partitionable devices, more than the {max} one slice may \
         hold when its devices consume counters; the Kubernetes 1.34 layout keeps a GPU's counters \
         and devices in one slice, so use the 1.35 layout (counters in a slice of their own)"
    )]
    TooManyDevicesTogether {
        minor: u32,
        devices: usize,
        max: usize,
    },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Violations joined for an error message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violations(pub Vec<Violation>);

impl fmt::Display for Violations {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, v) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{v}")?;
        }
        Ok(())
    }
}

/// How shared counters and the devices consuming them are spread over slices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CounterLayout {
    /// Kubernetes 1.34: counters and the devices consuming them in one slice per GPU.
    Together,
    /// Kubernetes 1.35 and later: slices holding only counters, then slices holding only devices
    /// (1.35 forbids both in one slice).
    #[default]
    Separate,
}

/// What to publish and how.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SliceOptions {
    /// The DRA driver name, e.g. `gpu.nvidia.com`; also the domain of unqualified attributes.
    pub driver: String,
    /// This node; also the pool name.
    pub node_name: String,
    /// Publish every possible MIG placement with shared counters (DRAPartitionableDevices)
    /// instead of only what exists.
    pub partitionable: bool,
    /// Only matters when `partitionable` is set.
    pub layout: CounterLayout,
}

/// A device name in the pool, derived from stable hardware facts only. Made by [`DeviceName::gpu`]
/// and [`DeviceName::mig`], or parsed (a checkpoint) by the same grammar.
#[derive(
    Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(try_from = "String", into = "String")]
pub struct DeviceName(String);

/// A string that is not a device name of this driver.
#[derive(Debug, thiserror::Error)]
#[error(
    "{0:?} is not a device name of this driver (gpu-<minor> or \
     gpu-<minor>-mig-<profile>-<giProfileId>-<start>)"
)]
pub struct InvalidDeviceName(pub String);

impl DeviceName {
    /// A whole GPU: `gpu-<minor>` (the `N` of `/dev/nvidiaN`, as NVIDIA's driver names it).
    pub fn gpu(minor: u32) -> Self {
        Self(format!("gpu-{minor}"))
    }

    /// A MIG device: `gpu-<minor>-mig-<profile>-<giProfileId>-<placementStart>`, with the profile
    /// lower-cased and reduced to letters, digits and dashes (`1g.5gb+me` → `1g5gbme`).
    pub fn mig(parent_minor: u32, profile: &str, gi_profile_id: u32, start: u32) -> Self {
        Self(format!(
            "gpu-{parent_minor}-mig-{}-{gi_profile_id}-{start}",
            profile_label(profile)
        ))
    }

    /// Checks the grammar only; whether the device exists is [`find_device`]'s question.
    pub fn parse(name: &str) -> Result<Self, InvalidDeviceName> {
        let number = |s: &str| {
            !s.is_empty()
                && s.bytes().all(|b| b.is_ascii_digit())
                && (s.len() == 1 || !s.starts_with('0'))
        };
        let valid = || {
            let rest = name.strip_prefix("gpu-")?;
            let (minor, mig) = match rest.split_once('-') {
                Some((minor, mig)) => (minor, Some(mig.strip_prefix("mig-")?)),
                None => (rest, None),
            };
            let ok = number(minor)
                && mig.is_none_or(|mig| {
                    let mut parts = mig.rsplitn(3, '-');
                    let (start, gi, label) = (parts.next(), parts.next(), parts.next());
                    matches!((start, gi, label), (Some(s), Some(g), Some(l))
                        if number(s) && number(g) && !l.is_empty() && profile_label(l) == l)
                });
            ok.then_some(())
        };
        match valid() {
            Some(()) => Ok(Self(name.to_string())),
            None => Err(InvalidDeviceName(name.to_string())),
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for DeviceName {
    type Error = InvalidDeviceName;
    fn try_from(name: String) -> Result<Self, InvalidDeviceName> {
        Self::parse(&name)
    }
}

impl From<DeviceName> for String {
    fn from(name: DeviceName) -> String {
        name.0
    }
}

impl PartialEq<&str> for DeviceName {
    fn eq(&self, other: &&str) -> bool {
        self.0 == *other
    }
}

impl fmt::Display for DeviceName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A MIG profile name as it appears in device names: lower case, only `[a-z0-9-]`, no leading or
/// trailing dash (RFC 1123).
pub fn profile_label(profile: &str) -> String {
    let label: String = profile
        .chars()
        .map(|c| c.to_ascii_lowercase())
        .filter(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '-')
        .collect();
    label.trim_matches('-').to_string()
}

/// The name of a GPU's (first) counter set in partitionable mode: `gpu-<minor>-counter-set`.
pub fn counter_set_name(minor: u32) -> String {
    format!("gpu-{minor}-counter-set")
}

fn extra_counter_set_name(minor: u32, n: usize) -> String {
    format!("gpu-{minor}-counter-set-{n}")
}

/// What a published device name stands for on this node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PublishedDevice<'a> {
    /// A whole GPU.
    Gpu(&'a Gpu),
    /// A MIG device: one that exists, or (in partitionable mode) a placement that could be
    /// created.
    Mig {
        parent: &'a Gpu,
        /// Set when the MIG device exists.
        existing: Option<&'a MigDevice>,
        /// Set when the parent lists the profile.
        profile: Option<&'a MigProfile>,
        placement: Placement,
    },
}

/// Looks up what `name` stands for, the inverse of the naming in [`DeviceName`]. It does not say
/// whether the device is published (health, MIG mode and partitioning decide that).
pub fn find_device<'a>(inv: &'a Inventory, name: &str) -> Option<PublishedDevice<'a>> {
    let rest = name.strip_prefix("gpu-")?;
    let (minor, mig) = match rest.split_once('-') {
        Some((minor, mig)) => (minor, Some(mig.strip_prefix("mig-")?)),
        None => (rest, None),
    };
    if minor.len() > 1 && minor.starts_with('0') {
        return None;
    }
    let parent = inv.gpu_by_minor(minor.parse().ok()?)?;
    if mig.is_none() {
        return Some(PublishedDevice::Gpu(parent));
    }
    let minor = parent.minor;
    if let Some(d) =
        parent.mig.devices.iter().find(|d| {
            DeviceName::mig(minor, &d.profile, d.gi_profile_id, d.placement.start).0 == name
        })
    {
        return Some(PublishedDevice::Mig {
            parent,
            existing: Some(d),
            profile: parent
                .mig
                .profiles
                .iter()
                .find(|p| p.gi_profile_id == d.gi_profile_id),
            placement: d.placement,
        });
    }
    parent.mig.profiles.iter().find_map(|p| {
        p.placements
            .iter()
            .find(|pl| DeviceName::mig(minor, &p.name, p.gi_profile_id, pl.start).0 == name)
            .map(|pl| PublishedDevice::Mig {
                parent,
                existing: None,
                profile: Some(p),
                placement: *pl,
            })
    })
}

/// Normalizes a driver-reported version to semantic versioning 2.0.0, or `None` when it cannot be
/// read as one (the attribute is then left out rather than published as a string, which would
/// break CEL selectors comparing versions).
///
/// Missing minor and patch numbers become 0 (`12.4` → `12.4.0`), leading zeros are dropped
/// (`570.124.06` → `570.124.6`, as NVIDIA's driver does), a leading `v` is accepted, and numbers
/// beyond the third go into build metadata (`1.2.3.4` → `1.2.3+4`), which keeps the first three
/// comparable.
pub fn normalize_version(raw: &str) -> Option<String> {
    let s = raw.trim();
    let s = s.strip_prefix(['v', 'V']).unwrap_or(s);
    let (rest, build) = match s.split_once('+') {
        Some((rest, build)) => (rest, Some(build)),
        None => (s, None),
    };
    let (core, pre) = match rest.split_once('-') {
        Some((core, pre)) => (core, Some(pre)),
        None => (rest, None),
    };
    let number = |p: &str| -> Option<u64> {
        if p.is_empty() || !p.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        p.parse().ok()
    };
    let identifier_ok =
        |p: &str| !p.is_empty() && p.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-');

    let parts: Vec<&str> = core.split('.').collect();
    let mut nums = [0u64; 3];
    for (i, p) in parts.iter().take(3).enumerate() {
        nums[i] = number(p)?;
    }
    let mut out = format!("{}.{}.{}", nums[0], nums[1], nums[2]);
    if let Some(pre) = pre {
        let ids = pre
            .split('.')
            .map(|id| {
                if !identifier_ok(id) {
                    None
                } else if let Some(n) = number(id) {
                    Some(n.to_string())
                } else {
                    Some(id.to_string())
                }
            })
            .collect::<Option<Vec<_>>>()?;
        out.push('-');
        out.push_str(&ids.join("."));
    }
    let mut build_ids: Vec<&str> = parts.iter().skip(3).copied().collect();
    if let Some(build) = build {
        build_ids.extend(build.split('.'));
    }
    if !build_ids.is_empty() {
        if !build_ids.iter().all(|id| identifier_ok(id)) {
            return None;
        }
        out.push('+');
        out.push_str(&build_ids.join("."));
    }
    (out.len() <= MAX_VALUE_LENGTH && is_semver(&out)).then_some(out)
}

type Attributes = BTreeMap<String, DeviceAttribute>;
type Capacities = BTreeMap<String, DeviceCapacity>;

fn string(v: impl Into<String>) -> DeviceAttribute {
    DeviceAttribute {
        string: Some(v.into()),
        ..Default::default()
    }
}

fn int(v: impl Into<i64>) -> DeviceAttribute {
    DeviceAttribute {
        int: Some(v.into()),
        ..Default::default()
    }
}

fn boolean(v: bool) -> DeviceAttribute {
    DeviceAttribute {
        bool: Some(v),
        ..Default::default()
    }
}

fn version(v: String) -> DeviceAttribute {
    DeviceAttribute {
        version: Some(v),
        ..Default::default()
    }
}

fn capacity(value: String) -> DeviceCapacity {
    DeviceCapacity {
        value: Quantity(value),
        request_policy: None,
    }
}

/// Attributes a GPU and each of its MIG devices share: what the silicon is and where it sits.
/// What the backend could not learn is left out, never published as a placeholder.
fn silicon_attributes(gpu: &Gpu) -> Attributes {
    let mut a = Attributes::new();
    a.insert("productName".into(), string(&gpu.product_name));
    if let Some(brand) = &gpu.brand {
        a.insert("brand".into(), string(brand));
    }
    if let Some(architecture) = &gpu.architecture {
        a.insert("architecture".into(), string(architecture));
    }
    let cc = gpu.cuda_compute_capability;
    a.insert(
        "cudaComputeCapability".into(),
        version(format!("{}.{}.0", cc.major, cc.minor)),
    );
    if let Some(v) = normalize_version(&gpu.driver_version) {
        a.insert("driverVersion".into(), version(v));
    }
    if let Some(v) = normalize_version(&gpu.cuda_driver_version) {
        a.insert("cudaDriverVersion".into(), version(v));
    }
    a.insert(ATTR_PCI_BUS_ID.into(), string(gpu.pci_bus_id.as_str()));
    if let Some(root) = &gpu.pcie_root {
        a.insert(ATTR_PCIE_ROOT.into(), string(root));
    }
    if let Some(numa) = gpu.numa_node {
        a.insert("numaNode".into(), int(numa));
    }
    a.insert("nvlinkDomain".into(), int(gpu.nvlink_domain));
    if let Some(f) = &gpu.fabric {
        a.insert(
            ATTR_FABRIC_CLUSTER_UUID.into(),
            string(f.cluster_uuid.as_str()),
        );
        a.insert(ATTR_FABRIC_CLIQUE_ID.into(), int(f.clique_id));
    }
    a
}

fn gpu_attributes(gpu: &Gpu) -> Attributes {
    let mut a = silicon_attributes(gpu);
    a.insert("type".into(), string("gpu"));
    a.insert("uuid".into(), string(gpu.uuid.as_str()));
    a.insert("index".into(), int(gpu.index));
    a.insert("minor".into(), int(gpu.minor));
    if !gpu.mig.mode_unknown {
        a.insert("migCapable".into(), boolean(gpu.mig.capable));
    }
    a
}

fn engine_capacities(c: &mut Capacities, e: &Engines) {
    let Engines {
        copy_engines,
        decoders,
        encoders,
        jpeg_engines,
        ofa_engines,
    } = *e;
    for (name, n) in [
        ("copyEngines", copy_engines),
        ("decoders", decoders),
        ("encoders", encoders),
        ("jpegEngines", jpeg_engines),
        ("ofaEngines", ofa_engines),
    ] {
        c.insert(name.into(), capacity(n.to_string()));
    }
}

fn gpu_device(gpu: &Gpu) -> Device {
    let mut c = Capacities::new();
    c.insert("memory".into(), capacity(quantity(gpu.memory_bytes)));
    if let Some(sms) = gpu.multiprocessors {
        c.insert("multiprocessors".into(), capacity(sms.to_string()));
    }
    Device {
        name: DeviceName::gpu(gpu.minor).0,
        attributes: Some(gpu_attributes(gpu)),
        capacity: Some(c),
        ..Default::default()
    }
}

/// What a MIG device is made of, whether it exists or is a placement that could be created.
struct MigShape<'a> {
    profile: &'a str,
    gi_profile_id: u32,
    placement: Placement,
    memory_bytes: u64,
    multiprocessors: u32,
    engines: Engines,
    uuid: Option<&'a MigUuid>,
}

impl<'a> MigShape<'a> {
    fn existing(d: &'a MigDevice) -> Self {
        Self {
            profile: &d.profile,
            gi_profile_id: d.gi_profile_id,
            placement: d.placement,
            memory_bytes: d.memory_bytes,
            multiprocessors: d.multiprocessors,
            engines: d.engines,
            uuid: Some(&d.uuid),
        }
    }

    fn possible(p: &'a MigProfile, placement: Placement) -> Self {
        Self {
            profile: &p.name,
            gi_profile_id: p.gi_profile_id,
            placement,
            memory_bytes: p.memory_bytes,
            multiprocessors: p.multiprocessors,
            engines: p.engines,
            uuid: None,
        }
    }
}

fn mig_device(gpu: &Gpu, m: &MigShape<'_>) -> Device {
    let mut a = silicon_attributes(gpu);
    a.insert("type".into(), string("mig"));
    if let Some(uuid) = m.uuid {
        a.insert("uuid".into(), string(uuid.as_str()));
    }
    a.insert("parentUUID".into(), string(gpu.uuid.as_str()));
    a.insert("profile".into(), string(m.profile));
    // No `parentMinor`: the device name carries it, NVIDIA's driver does not publish it, and a
    // 7g device on an 8-slice GPU needs the room (16 attributes + 15 capacities + 2 fabric
    // attributes would break the limit of 32).
    a.insert("parentIndex".into(), int(gpu.index));

    let mut c = Capacities::new();
    c.insert("memory".into(), capacity(quantity(m.memory_bytes)));
    c.insert(
        "multiprocessors".into(),
        capacity(m.multiprocessors.to_string()),
    );
    engine_capacities(&mut c, &m.engines);
    for slice in m.placement.slices() {
        c.insert(format!("memorySlice{slice}"), capacity("1".into()));
    }
    Device {
        name: DeviceName::mig(gpu.minor, m.profile, m.gi_profile_id, m.placement.start).0,
        attributes: Some(a),
        capacity: Some(c),
        ..Default::default()
    }
}

/// A GPU's shared counters in partitionable mode: the resources MIG devices draw on (memory,
/// multiprocessors, engines) and one counter per memory slice, so that overlapping placements
/// exclude each other. Counters that would be zero are left out.
struct GpuCounters {
    sets: Vec<CounterSet>,
    /// Counter name → index into `sets`.
    set_of: BTreeMap<String, usize>,
    /// False when the GPU's SM count is unknown: it then offers no `multiprocessors` counter,
    /// and its MIG devices consume none (the memory slices still keep them apart).
    has_multiprocessors: bool,
}

fn resource_counters(
    memory_bytes: u64,
    multiprocessors: u32,
    e: &Engines,
) -> Vec<(String, String)> {
    let Engines {
        copy_engines,
        decoders,
        encoders,
        jpeg_engines,
        ofa_engines,
    } = *e;
    let mut out = Vec::new();
    if memory_bytes > 0 {
        out.push(("memory".to_string(), quantity(memory_bytes)));
    }
    for (name, n) in [
        ("multiprocessors", multiprocessors),
        ("copy-engines", copy_engines),
        ("decoders", decoders),
        ("encoders", encoders),
        ("jpeg-engines", jpeg_engines),
        ("ofa-engines", ofa_engines),
    ] {
        if n > 0 {
            out.push((name.to_string(), n.to_string()));
        }
    }
    out
}

fn memory_slice_counter(i: u32) -> String {
    format!("memory-slice-{i}")
}

impl GpuCounters {
    /// Splits the counters over as few sets as the per-set limit allows: the resource counters
    /// and the first memory slices in `gpu-<minor>-counter-set`, further memory slices in
    /// `gpu-<minor>-counter-set-2`. Every GPU made so far needs one set (15 counters at most).
    fn new(gpu: &Gpu) -> Result<Self> {
        let mut all = resource_counters(
            gpu.memory_bytes,
            gpu.multiprocessors.unwrap_or(0),
            &gpu.engines,
        );
        all.extend((0..gpu.mig.memory_slices).map(|i| (memory_slice_counter(i), "1".to_string())));
        let needed = all.len();
        let max = MAX_CONSUMPTIONS_PER_DEVICE * MAX_COUNTERS_PER_SET;
        if needed > max {
            return Err(Error::TooManyCounters {
                minor: gpu.minor,
                memory_slices: gpu.mig.memory_slices,
                needed,
                max,
                sets: MAX_CONSUMPTIONS_PER_DEVICE,
                per_set: MAX_COUNTERS_PER_SET,
            });
        }
        let mut sets = Vec::new();
        let mut set_of = BTreeMap::new();
        for (n, chunk) in all.chunks(MAX_COUNTERS_PER_SET).enumerate() {
            let name = if n == 0 {
                counter_set_name(gpu.minor)
            } else {
                extra_counter_set_name(gpu.minor, n + 1)
            };
            let mut counters = BTreeMap::new();
            for (counter, value) in chunk {
                set_of.insert(counter.clone(), n);
                counters.insert(
                    counter.clone(),
                    Counter {
                        value: Quantity(value.clone()),
                    },
                );
            }
            sets.push(CounterSet { name, counters });
        }
        Ok(Self {
            sets,
            set_of,
            has_multiprocessors: gpu.multiprocessors.is_some(),
        })
    }

    /// Consumptions of the given counters, one per set touched, in set order.
    fn consume(&self, counters: Vec<(String, String)>) -> Vec<DeviceCounterConsumption> {
        let mut per_set: BTreeMap<usize, BTreeMap<String, Counter>> = BTreeMap::new();
        for (name, value) in counters {
            // A counter the GPU lacks (a profile using an engine the GPU reports none of) goes to
            // the first set, where `validate_pool` reports it instead of it silently vanishing.
            let set = self.set_of.get(&name).copied().unwrap_or(0);
            per_set.entry(set).or_default().insert(
                name,
                Counter {
                    value: Quantity(value),
                },
            );
        }
        per_set
            .into_iter()
            .map(|(set, counters)| DeviceCounterConsumption {
                counter_set: self.sets[set].name.clone(),
                counters,
            })
            .collect()
    }

    fn consume_mig(&self, m: &MigShape<'_>) -> Vec<DeviceCounterConsumption> {
        let sms = if self.has_multiprocessors {
            m.multiprocessors
        } else {
            0
        };
        let mut counters = resource_counters(m.memory_bytes, sms, &m.engines);
        counters.extend(
            m.placement
                .slices()
                .map(|i| (memory_slice_counter(i), "1".to_string())),
        );
        self.consume(counters)
    }
}

/// One MIG-capable GPU in partitionable mode: its counters and the devices drawing on them.
struct Partitioned {
    minor: u32,
    counters: Vec<CounterSet>,
    devices: Vec<Device>,
}

/// The devices of a GPU in MIG mode, in partitionable mode.
///
/// Existing MIG devices (created outside nvdra, or left over) are published as they are, and
/// placements overlapping one are not: the counters only know what the scheduler allocated, not
/// what already exists. Every other placement of every profile is published; the largest
/// (`7g.*` at 0) covers the whole GPU. The GPU itself is not: in MIG mode CUDA cannot use it
/// whole, and switching MIG mode at prepare time would need the GPU idle (and on some models a
/// reset), which a kubelet plugin must not impose on a node.
fn partitioned(gpu: &Gpu) -> Result<Partitioned> {
    let counters = GpuCounters::new(gpu)?;
    let existing: &[MigDevice] = &gpu.mig.devices;
    let mut devices = Vec::new();
    for d in existing.iter().filter(|d| d.health.is_healthy()) {
        let shape = MigShape::existing(d);
        let mut dev = mig_device(gpu, &shape);
        dev.consumes_counters = Some(counters.consume_mig(&shape));
        devices.push(dev);
    }
    for p in &gpu.mig.profiles {
        for pl in &p.placements {
            if existing.iter().any(|d| d.placement.overlaps(pl)) {
                continue;
            }
            let shape = MigShape::possible(p, *pl);
            let mut dev = mig_device(gpu, &shape);
            dev.consumes_counters = Some(counters.consume_mig(&shape));
            devices.push(dev);
        }
    }
    sort_devices(&mut devices);
    Ok(Partitioned {
        minor: gpu.minor,
        counters: counters.sets,
        devices,
    })
}

fn sort_devices(devices: &mut [Device]) {
    devices.sort_by(|a, b| a.name.cmp(&b.name));
}

fn is_advanced(d: &Device) -> bool {
    d.consumes_counters.as_ref().is_some_and(|c| !c.is_empty())
        || d.taints.as_ref().is_some_and(|t| !t.is_empty())
}

/// Packs devices, in order, into as few chunks as the per-slice limits allow.
fn chunk_devices(devices: Vec<Device>) -> Vec<Vec<Device>> {
    let mut chunks = Vec::new();
    let mut current: Vec<Device> = Vec::new();
    let mut advanced = false;
    for d in devices {
        let adv = advanced || is_advanced(&d);
        let limit = if adv {
            MAX_DEVICES_PER_SLICE_WITH_COUNTERS_OR_TAINTS
        } else {
            MAX_DEVICES_PER_SLICE
        };
        if current.len() + 1 > limit {
            chunks.push(std::mem::take(&mut current));
            advanced = is_advanced(&d);
        } else {
            advanced = adv;
        }
        current.push(d);
    }
    if !current.is_empty() {
        chunks.push(current);
    }
    chunks
}

/// Slice contents before the pool bookkeeping is filled in.
#[derive(Default)]
struct Draft {
    counters: Option<Vec<CounterSet>>,
    devices: Option<Vec<Device>>,
}

/// Computes the ResourceSlices that describe `inv` for `opts.node_name`.
///
/// The result is validated before it is returned; an error means this module (or the inventory)
/// is wrong, and nothing should be published.
pub fn desired_slices(inv: &Inventory, opts: &SliceOptions) -> Result<Vec<ResourceSliceSpec>> {
    let healthy = inv.gpus.iter().filter(|g| g.health.is_healthy());
    let mut drafts = Vec::new();
    if opts.partitionable {
        let mut groups = Vec::new();
        let mut plain = Vec::new();
        for gpu in healthy {
            if gpu.in_mig_mode() {
                groups.push(partitioned(gpu)?);
            } else {
                plain.push(gpu_device(gpu));
            }
        }
        match opts.layout {
            CounterLayout::Together => {
                for g in groups {
                    if g.devices.len() > MAX_DEVICES_PER_SLICE_WITH_COUNTERS_OR_TAINTS {
                        return Err(Error::TooManyDevicesTogether {
                            minor: g.minor,
                            devices: g.devices.len(),
                            max: MAX_DEVICES_PER_SLICE_WITH_COUNTERS_OR_TAINTS,
                        });
                    }
                    drafts.push(Draft {
                        counters: Some(g.counters),
                        devices: Some(g.devices),
                    });
                }
            }
            CounterLayout::Separate => {
                let all_sets: Vec<CounterSet> = groups
                    .iter()
                    .flat_map(|g| g.counters.iter().cloned())
                    .collect();
                for chunk in all_sets.chunks(MAX_COUNTER_SETS_PER_SLICE) {
                    drafts.push(Draft {
                        counters: Some(chunk.to_vec()),
                        devices: None,
                    });
                }
                for g in groups {
                    for chunk in chunk_devices(g.devices) {
                        drafts.push(Draft {
                            counters: None,
                            devices: Some(chunk),
                        });
                    }
                }
            }
        }
        sort_devices(&mut plain);
        for chunk in chunk_devices(plain) {
            drafts.push(Draft {
                counters: None,
                devices: Some(chunk),
            });
        }
    } else {
        let mut devices = Vec::new();
        for gpu in healthy {
            if gpu.in_mig_mode() {
                for d in gpu.mig.devices.iter().filter(|d| d.health.is_healthy()) {
                    devices.push(mig_device(gpu, &MigShape::existing(d)));
                }
            } else {
                devices.push(gpu_device(gpu));
            }
        }
        sort_devices(&mut devices);
        for chunk in chunk_devices(devices) {
            drafts.push(Draft {
                counters: None,
                devices: Some(chunk),
            });
        }
    }
    if drafts.is_empty() {
        drafts.push(Draft {
            counters: None,
            devices: Some(Vec::new()),
        });
    }

    let count = drafts.len() as i64;
    let specs: Vec<ResourceSliceSpec> = drafts
        .into_iter()
        .map(|d| ResourceSliceSpec {
            driver: opts.driver.clone(),
            node_name: Some(opts.node_name.clone()),
            pool: ResourcePool {
                name: opts.node_name.clone(),
                generation: 0,
                resource_slice_count: count,
            },
            devices: d.devices,
            shared_counters: d.counters,
            ..Default::default()
        })
        .collect();

    for (i, spec) in specs.iter().enumerate() {
        let violations = validate(spec);
        if !violations.is_empty() {
            return Err(Error::Invalid {
                node: opts.node_name.clone(),
                slice: i.to_string(),
                violations: Violations(violations),
            });
        }
    }
    let violations = validate_pool(&specs);
    if !violations.is_empty() {
        return Err(Error::Invalid {
            node: opts.node_name.clone(),
            slice: "pool".into(),
            violations: Violations(violations),
        });
    }
    Ok(specs)
}

#[cfg(test)]
mod tests;
