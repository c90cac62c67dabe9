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
//!   exclusive. A shareable GPU or MIG device (`--shared-capacity`, `--consumable-shares`) is
//!   one device, allocated whole or in shares by its consumable capacity. GPUs and MIG devices marked unhealthy for good are not published; those the
//!   health monitor saw fail are published with a device taint (`<driver>/xid`,
//!   `<driver>/gpu-lost`), so a running pod's device does not vanish from the slice.
//!   With dynamic MIG a GPU that can switch MIG mode is offered whole and in MIG placements at
//!   once, and its counters keep the two apart.
//! - Every limit of `resource.k8s.io/v1` in Kubernetes 1.34 and 1.35 holds: at most 128 devices
//!   per slice (64 when a device consumes counters or has taints), 32 attributes and capacities
//!   per device, values of at most 64 characters, valid semantic versions, at most 8 counter sets
//!   of 32 counters per slice, at most 2 counter consumptions of 32 counters per device.
//!
//! Attribute names without a domain live in the driver's domain (`gpu.nvidia.com` by default) and
//! match NVIDIA's DRA driver where it has the same attribute, so existing DeviceClasses and CEL
//! selectors keep working.

mod attributes;
mod counters;
mod metadata;
mod names;
mod splitting;

use std::fmt;

#[cfg(test)]
use crate::ids::{PublishedDevice, find_device};
pub use crate::ledger::shares::ConsumableShares;
pub use attributes::normalize_version;
pub use metadata::device_metadata;
pub use names::counter_set_name;
#[cfg(test)]
use splitting::is_advanced;
pub use splitting::{Withdrawn, desired_slices, desired_slices_withdrawing, withdrawn_devices};
// The API server's rules are the kubelet-plugin library's (its test API server applies them too).
#[cfg(test)]
use kubelet_plugin::validate;
pub use kubelet_plugin::validate::{
    MAX_ATTRIBUTES_AND_CAPACITIES, MAX_CONSUMPTIONS_PER_DEVICE, MAX_COUNTER_SETS_PER_SLICE,
    MAX_COUNTERS_PER_CONSUMPTION, MAX_COUNTERS_PER_SET, MAX_DEVICES_PER_SLICE,
    MAX_DEVICES_PER_SLICE_WITH_COUNTERS_OR_TAINTS, MAX_VALUE_LENGTH, Violation, is_semver,
    validate, validate_pool,
};

/// The standard attribute for a device's PCI address (extended BDF).
pub const ATTR_PCI_BUS_ID: &str = "resource.kubernetes.io/pciBusID";
/// The standard attribute for a device's PCIe root complex (`pci<domain>:<bus>`).
pub const ATTR_PCIE_ROOT: &str = "resource.kubernetes.io/pcieRoot";
/// The standard attribute for a device's NUMA node (an int, KEP-6072), which other drivers (NICs,
/// CPUs, memory) publish too, so one `matchAttribute` aligns devices of several drivers. The
/// bare `numaNode` beside it stays for claims written against NVIDIA's names.
pub const ATTR_NUMA_NODE: &str = "resource.kubernetes.io/numaNode";
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
    /// Publish each GPU outside MIG mode as one device the scheduler may allocate many times,
    /// by consumable capacity (DRAConsumableCapacity), in one of NVIDIA's consumable-shares
    /// modes (`--consumable-shares`; `memory` is `--shared-capacity`): in `memory` a claim that
    /// asks for part of its memory gets a share, one that asks for none the whole GPU; in
    /// `unlimited` and integer mode every claim gets a share. Existing MIG devices are
    /// published shareable the same way (of their own memory; their other capacities with
    /// default-0 policies), except those of a GPU published for `dynamic_mig`, and MIG
    /// placements with no instance never are.
    pub shared_capacity: ConsumableShares,
    /// Publish each GPU that can switch MIG mode at run time ([`Gpu::mig_toggle`]) whole and
    /// in every free MIG placement, at either mode, all drawing on one counter set
    /// (`--dynamic-mig`); prepare switches the mode. A GPU that cannot is published as without
    /// the switch (an Ampere GPU whose MIG mode change waits for a reset with its placements,
    /// never its whole device or existing MIG devices, tainted [`TAINT_MIG_RESET_REQUIRED`]).
    /// Of a GPU that can, the devices that need a switch now (its placements outside MIG mode,
    /// the whole GPU in MIG mode without an instance) are withdrawn while a process that
    /// blocks a switch holds it ([`Holder::blocks_switch`]), and tainted
    /// [`TAINT_MIG_SWITCH_BLOCKED`] once a prepare met `IN_USE` ([`SwitchBlock::InUse`]) or
    /// the GPU answered `RESET_REQUIRED` ([`SwitchBlock::ResetRequired`], value
    /// `reset-required`; not switched again until nvdra restarts).
    ///
    /// [`Holder::blocks_switch`]: crate::inventory::Holder::blocks_switch
    /// [`SwitchBlock::InUse`]: crate::inventory::SwitchBlock::InUse
    /// [`SwitchBlock::ResetRequired`]: crate::inventory::SwitchBlock::ResetRequired
    ///
    /// [`Gpu::mig_toggle`]: crate::inventory::Gpu::mig_toggle
    pub dynamic_mig: bool,
    /// The MIG profiles whose placements `partitionable` and `dynamic_mig` publish
    /// (`--mig-profiles`); all when `None`. Existing MIG devices are published whatever their
    /// profile; a name no GPU has is no error (the list is per fleet, GPUs differ).
    pub mig_profiles: Option<Vec<String>>,
    /// Matters when `partitionable` or `dynamic_mig` is set.
    pub layout: CounterLayout,
}

/// The key (after `<driver>/`) of the taint on the MIG placements of an Ampere GPU whose MIG
/// mode change waits for a GPU reset, with `dynamic_mig`: nvdra never resets a GPU, so new
/// claims keep off the placements (which need an instance created) until someone does; the
/// whole GPU and existing MIG devices are never tainted so. No value; effect `NoSchedule`, so
/// running pods stay. A Hopper GPU never carries it: the plugin withdraws a pending change.
pub const TAINT_MIG_RESET_REQUIRED: &str = "mig-reset-required";

/// The key (after `<driver>/`) of the taint on the devices of a dynamic-MIG GPU that need a MIG
/// mode switch, after a prepare met `IN_USE` on it ([`SwitchBlock::InUse`]): effect
/// `NoExecute`, so the device-taint eviction controller evicts the pod whose claim was
/// allocated there and its claim is allocated anew (a withdrawn device could not be tainted);
/// value: the first holder in the way that blocks a switch, by its process name as a label
/// value (none where it has no usable name). Where the server drops taints, the devices are
/// withdrawn instead.
///
/// [`SwitchBlock::InUse`]: crate::inventory::SwitchBlock::InUse
pub const TAINT_MIG_SWITCH_BLOCKED: &str = "mig-switch-blocked";

/// The names of the `--mig-profiles` allowlist that no GPU of `inv` lists: no error (the list is
/// per fleet, and GPUs differ), but worth a word at start when none has them, as a misspelt name
/// silently publishes nothing.
pub fn unlisted_profiles<'a>(
    inv: &crate::inventory::Inventory,
    allowed: &'a [String],
) -> Vec<&'a str> {
    allowed
        .iter()
        .filter(|name| {
            !inv.gpus
                .iter()
                .any(|g| g.mig.profiles.iter().any(|p| &p.name == *name))
        })
        .map(String::as_str)
        .collect()
}

/// Devices in name order: how every slice lists them, so a republish compares equal.
fn sort_devices(devices: &mut [k8s_openapi::api::resource::v1::Device]) {
    devices.sort_by(|a, b| a.name.cmp(&b.name));
}

#[cfg(test)]
mod tests;
