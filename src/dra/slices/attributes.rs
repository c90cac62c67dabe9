//! Device attributes and capacities: a GPU or MIG device as a `resource.k8s.io/v1` [`Device`].

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{
    CapacityRequestPolicy, CapacityRequestPolicyRange, Device, DeviceAttribute, DeviceCapacity,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use super::{
    ATTR_FABRIC_CLIQUE_ID, ATTR_FABRIC_CLUSTER_UUID, ATTR_NUMA_NODE, ATTR_PCI_BUS_ID,
    ATTR_PCIE_ROOT, MAX_ATTRIBUTES_AND_CAPACITIES, MAX_VALUE_LENGTH, is_semver,
};
use crate::ids::DeviceName;
use crate::inventory::{Engines, Gpu, MigDevice, MigProfile, MigUuid, Placement, quantity};
use crate::ledger::shares::{self, ConsumableShares};

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

pub(super) type Attributes = BTreeMap<String, DeviceAttribute>;
pub(super) type Capacities = BTreeMap<String, DeviceCapacity>;

pub(super) fn string(v: impl Into<String>) -> DeviceAttribute {
    DeviceAttribute {
        string: Some(v.into()),
        ..Default::default()
    }
}

pub(super) fn int(v: impl Into<i64>) -> DeviceAttribute {
    DeviceAttribute {
        int: Some(v.into()),
        ..Default::default()
    }
}

pub(super) fn boolean(v: bool) -> DeviceAttribute {
    DeviceAttribute {
        bool: Some(v),
        ..Default::default()
    }
}

pub(super) fn version(v: String) -> DeviceAttribute {
    DeviceAttribute {
        version: Some(v),
        ..Default::default()
    }
}

pub(super) fn capacity(value: String) -> DeviceCapacity {
    DeviceCapacity {
        value: Quantity(value),
        request_policy: None,
    }
}

/// Attributes a GPU and each of its MIG devices share: what the silicon is and where it sits.
/// What the backend could not learn is left out, never published as a placeholder.
pub(super) fn silicon_attributes(gpu: &Gpu) -> Attributes {
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
        a.insert(ATTR_NUMA_NODE.into(), int(numa));
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

pub(super) fn gpu_attributes(gpu: &Gpu) -> Attributes {
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

pub(super) fn engine_capacities(c: &mut Capacities, e: &Engines) {
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

pub(super) fn gpu_device(gpu: &Gpu) -> Device {
    let mut c = Capacities::new();
    c.insert("memory".into(), capacity(quantity(gpu.memory_bytes)));
    if let Some(sms) = gpu.multiprocessors {
        c.insert("multiprocessors".into(), capacity(sms.to_string()));
    }
    Device {
        name: DeviceName::gpu(gpu.minor).into(),
        attributes: Some(gpu_attributes(gpu)),
        capacity: Some(c),
        ..Default::default()
    }
}

/// A GPU outside MIG mode as a consumable-shares `mode` publishes it: the whole GPU's device,
/// which the scheduler may allocate many times (`allowMultipleAllocations`), each allocation
/// consuming part of it by the request policies (see [`crate::ledger::shares`]):
///
/// - `memory` (rounded down to a MiB), steps of 1Mi. In `memory` mode (`--shared-capacity`) the
///   default is the whole GPU, so a claim that asks for no memory gets the GPU exclusively, as on
///   a GPU published without the switch, and the smallest share lets at most 48 shares (MPS's
///   clients per GPU) fit. In `unlimited` and integer mode the default and the minimum are 0, as
///   NVIDIA's driver publishes them: a claim that asks for nothing consumes no memory.
/// - `shares` (integer mode `N` only): N, default 1, from 1 to N in steps of 1, as NVIDIA's
///   (without the step when N is 1, which the API server would refuse).
/// - `multiprocessors`: default 0, from 0 to all in steps of 1, so a share that does not ask
///   for SMs is not charged all of them (without a policy the scheduler charges the whole value
///   to each allocation). What a share asks the scheduler counts, and the node applies as a
///   cap (MPS's active thread percentage): SMs are not partitioned. NVIDIA's driver publishes
///   no `multiprocessors` on a GPU; a claim that does not ask for them sees no difference.
///
/// `None` when `mode` is disabled, and for a GPU too small to share ([`shares::is_shareable`]):
/// it is published as without the switch.
pub(super) fn shareable_gpu_device(gpu: &Gpu, mode: ConsumableShares) -> Option<Device> {
    if !mode.enabled() || !shares::is_shareable(gpu.memory_bytes) {
        return None;
    }
    let mut d = gpu_device(gpu);
    let c = d.capacity.get_or_insert_with(Capacities::new);
    share_capacities(c, gpu.memory_bytes, mode);
    if let Some(sms) = gpu.multiprocessors {
        c.insert(
            "multiprocessors".into(),
            consumable(sms.to_string(), "0".into(), "0".into(), "1".into()),
        );
    }
    d.allow_multiple_allocations = Some(true);
    Some(d)
}

/// An existing MIG device as a consumable-shares `mode` publishes it, as NVIDIA's driver does
/// (`allocatable.go`): allocated many times (`allowMultipleAllocations`), each share under the
/// MIG device's own MPS daemon. `memory` (and `shares` in integer mode) as on a shareable GPU
/// ([`shareable_gpu_device`]), of the MIG device's memory; every other capacity
/// (`multiprocessors`, the engines, `memorySlice<k>`) with a default-0 policy, from 0 to all in
/// steps of 1, so that a share that does not ask for them is charged none and a second one
/// fits (NVIDIA publishes them without a policy, so under the 1.36 allocator each claim that
/// does not ask for them consumes all of each). Where `shares` would take a device past the
/// API's limit, the fabric attributes go as in [`mig_device`].
///
/// `None` when `mode` is disabled, for a placement with no MIG device yet, and for a MIG
/// device too small to share: it is published as without the switch.
pub(super) fn shareable_mig_device(
    gpu: &Gpu,
    m: &MigShape<'_>,
    mode: ConsumableShares,
) -> Option<Device> {
    if !mode.enabled() || m.uuid.is_none() || !shares::is_shareable(m.memory_bytes) {
        return None;
    }
    let mut d = mig_device(gpu, m);
    let c = d.capacity.get_or_insert_with(Capacities::new);
    for (_, cap) in c.iter_mut() {
        *cap = consumable(cap.value.0.clone(), "0".into(), "0".into(), "1".into());
        if cap.value.0 == "0" {
            // min + step must lie within the value: without a step 0 alone is allowed.
            if let Some(r) = cap
                .request_policy
                .as_mut()
                .and_then(|p| p.valid_range.as_mut())
            {
                r.step = None;
            }
        }
    }
    share_capacities(c, m.memory_bytes, mode);
    fit_attribute_limit(&mut d);
    d.allow_multiple_allocations = Some(true);
    Some(d)
}

/// `memory` (and `shares` in integer mode) of a device of `memory_bytes` shared in `mode`
/// ([`shareable_gpu_device`] says how).
fn share_capacities(c: &mut Capacities, memory_bytes: u64, mode: ConsumableShares) {
    let memory = shares::shareable_memory(memory_bytes);
    let (default, min) = match mode {
        ConsumableShares::Memory => (memory, shares::min_share(memory)),
        _ => (0, 0),
    };
    c.insert(
        "memory".into(),
        consumable(
            quantity(memory),
            quantity(default),
            quantity(min),
            quantity(shares::MEMORY_STEP),
        ),
    );
    if let ConsumableShares::Count(n) = mode {
        let mut shares = consumable(n.get().to_string(), "1".into(), "1".into(), "1".into());
        if n.get() == 1 {
            // The API server wants min + step within the value: with one share NVIDIA's step
            // of 1 would have the slice refused. Without a step the range allows 1 alone all
            // the same.
            if let Some(r) = shares
                .request_policy
                .as_mut()
                .and_then(|p| p.valid_range.as_mut())
            {
                r.step = None;
            }
        }
        c.insert("shares".into(), shares);
    }
}

/// A consumable capacity of `value` whose request policy defaults to `default` and allows
/// `min..=value` in steps of `step` from `min`.
fn consumable(value: String, default: String, min: String, step: String) -> DeviceCapacity {
    DeviceCapacity {
        request_policy: Some(CapacityRequestPolicy {
            default: Some(Quantity(default)),
            valid_range: Some(CapacityRequestPolicyRange {
                min: Quantity(min),
                max: Some(Quantity(value.clone())),
                step: Some(Quantity(step)),
            }),
            valid_values: None,
        }),
        value: Quantity(value),
    }
}

/// What a MIG device is made of, whether it exists or is a placement that could be created.
pub(super) struct MigShape<'a> {
    pub(super) profile: &'a str,
    pub(super) gi_profile_id: u32,
    pub(super) placement: Placement,
    pub(super) memory_bytes: u64,
    pub(super) multiprocessors: u32,
    pub(super) engines: Engines,
    pub(super) uuid: Option<&'a MigUuid>,
}

impl<'a> MigShape<'a> {
    pub(super) fn existing(d: &'a MigDevice) -> Self {
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

    pub(super) fn possible(p: &'a MigProfile, placement: Placement) -> Self {
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

pub(super) fn mig_device(gpu: &Gpu, m: &MigShape<'_>) -> Device {
    let mut a = silicon_attributes(gpu);
    a.insert("type".into(), string("mig"));
    if let Some(uuid) = m.uuid {
        a.insert("uuid".into(), string(uuid.as_str()));
    }
    a.insert("parentUUID".into(), string(gpu.uuid.as_str()));
    a.insert("profile".into(), string(m.profile));
    // No `parentMinor`: the device name carries it, NVIDIA's driver does not publish it, and a
    // 7g device on an 8-slice GPU needs the room (see `fit_attribute_limit`).
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
    let mut d = Device {
        name: DeviceName::mig(gpu.minor, m.profile, m.gi_profile_id, m.placement.start).into(),
        attributes: Some(a),
        capacity: Some(c),
        ..Default::default()
    };
    fit_attribute_limit(&mut d);
    d
}

/// Keeps a MIG device within the API's 32 attributes and capacities: the widest, an existing
/// 7g device on an 8-slice GPU (16 attributes, 15 capacities, `shares` in integer mode) with
/// a fabric's 2 attributes, would break it. The fabric attributes go: they are nvdra's, not
/// NVIDIA's, and a MIG device has no NVLink peer-to-peer to align by them. Everything else
/// (the standard attributes, NVIDIA's names) stays.
fn fit_attribute_limit(d: &mut Device) {
    let width = d.attributes.as_ref().map_or(0, BTreeMap::len)
        + d.capacity.as_ref().map_or(0, BTreeMap::len);
    if width > MAX_ATTRIBUTES_AND_CAPACITIES
        && let Some(a) = d.attributes.as_mut()
    {
        a.remove(ATTR_FABRIC_CLUSTER_UUID);
        a.remove(ATTR_FABRIC_CLIQUE_ID);
    }
}
