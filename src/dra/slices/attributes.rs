//! Device attributes and capacities: a GPU or MIG device as a `resource.k8s.io/v1` [`Device`].

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{
    CapacityRequestPolicy, CapacityRequestPolicyRange, Device, DeviceAttribute, DeviceCapacity,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use super::{
    ATTR_FABRIC_CLIQUE_ID, ATTR_FABRIC_CLUSTER_UUID, ATTR_PCI_BUS_ID, ATTR_PCIE_ROOT,
    MAX_VALUE_LENGTH, is_semver,
};
use crate::ids::DeviceName;
use crate::inventory::{Engines, Gpu, MigDevice, MigProfile, MigUuid, Placement, quantity};
use crate::ledger::shares::{FULL_COMPUTE, MEMORY_STEP};

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

/// The shareable twin of a whole GPU (`--shared-capacity`): the GPU's attributes with `type`
/// `gpu-shared` (so a class selecting `type == 'gpu'`, NVIDIA's included, never hands a share out
/// as a whole GPU) and `shared: true`; several allocations at once, each consuming `memory` (1 GiB
/// steps, default 1 GiB) and `compute` (percent of the SMs, default 100). `None` for a GPU with
/// less than 2 GiB, where no share of a whole GiB is left beside the smallest.
pub(super) fn shared_gpu_device(gpu: &Gpu) -> Option<Device> {
    let whole_gib = gpu.memory_bytes / MEMORY_STEP;
    if whole_gib < 2 {
        return None;
    }
    let mut a = gpu_attributes(gpu);
    a.insert("type".into(), string("gpu-shared"));
    a.insert("shared".into(), boolean(true));
    let policy = |default: &str, min: &str, max: String, step: &str| CapacityRequestPolicy {
        default: Some(Quantity(default.into())),
        valid_range: Some(CapacityRequestPolicyRange {
            min: Quantity(min.into()),
            max: Some(Quantity(max)),
            step: Some(Quantity(step.into())),
        }),
        valid_values: None,
    };
    let (step, full) = (quantity(MEMORY_STEP), FULL_COMPUTE.to_string());
    let mut c = Capacities::new();
    c.insert(
        "memory".into(),
        DeviceCapacity {
            value: Quantity(quantity(gpu.memory_bytes)),
            request_policy: Some(policy(
                &step,
                &step,
                quantity(whole_gib * MEMORY_STEP),
                &step,
            )),
        },
    );
    c.insert(
        "compute".into(),
        DeviceCapacity {
            value: Quantity(full.clone()),
            request_policy: Some(policy(&full, "1", full.clone(), "1")),
        },
    );
    Some(Device {
        name: DeviceName::shared(gpu.minor).into(),
        attributes: Some(a),
        capacity: Some(c),
        allow_multiple_allocations: Some(true),
        ..Default::default()
    })
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
        name: DeviceName::mig(gpu.minor, m.profile, m.gi_profile_id, m.placement.start).into(),
        attributes: Some(a),
        capacity: Some(c),
        ..Default::default()
    }
}
