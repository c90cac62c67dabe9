use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::{NodeSelector, NodeSelectorTerm};
use k8s_openapi::api::resource::v1::{CapacityRequestPolicy, DeviceTaint};
use proptest::prelude::*;

use super::*;
use crate::inventory::topology::load_profile;
use crate::inventory::{GpuUuid, Health, MigUuid, PciBusId};

const DRIVER: &str = "gpu.nvidia.com";

fn opts(partitionable: bool, layout: CounterLayout) -> SliceOptions {
    SliceOptions {
        driver: DRIVER.into(),
        node_name: "node-a".into(),
        partitionable,
        layout,
    }
}

fn plain() -> SliceOptions {
    opts(false, CounterLayout::Separate)
}

fn profile(name: &str) -> Inventory {
    load_profile(name, "node-a").unwrap()
}

/// A profile whose MIG-capable GPUs are in MIG mode with no instances yet: a node set up for
/// partitionable devices.
fn mig_ready(name: &str) -> Inventory {
    in_mig_mode(profile(name))
}

fn in_mig_mode(mut inv: Inventory) -> Inventory {
    for g in &mut inv.gpus {
        g.mig.enabled = g.mig.capable;
    }
    inv
}

fn all_devices(specs: &[ResourceSliceSpec]) -> Vec<&Device> {
    specs
        .iter()
        .flat_map(|s| s.devices.iter().flatten())
        .collect()
}

fn names(specs: &[ResourceSliceSpec]) -> Vec<String> {
    all_devices(specs).iter().map(|d| d.name.clone()).collect()
}

fn device<'a>(specs: &'a [ResourceSliceSpec], name: &str) -> &'a Device {
    all_devices(specs)
        .into_iter()
        .find(|d| d.name == name)
        .unwrap_or_else(|| panic!("no device {name} in {:?}", names(specs)))
}

fn attr<'a>(d: &'a Device, name: &str) -> &'a DeviceAttribute {
    d.attributes
        .as_ref()
        .unwrap()
        .get(name)
        .unwrap_or_else(|| panic!("{} has no attribute {name}", d.name))
}

fn cap(d: &Device, name: &str) -> String {
    d.capacity.as_ref().unwrap()[name].value.0.clone()
}

fn s(v: &str) -> DeviceAttribute {
    string(v)
}

/// `n` copies of GPU 0 of `profile_name` with distinct identities.
fn synthetic(profile_name: &str, n: u32) -> Inventory {
    let template = profile(profile_name).gpus[0].clone();
    let gpus = (0..n)
        .map(|i| {
            let mut g = template.clone();
            g.index = i;
            g.minor = i;
            g.uuid = GpuUuid(format!("GPU-{i:08}"));
            g.pci_bus_id = PciBusId(format!("{:04x}:{:02x}:00.0", i / 256, i % 256));
            g
        })
        .collect();
    Inventory::new(gpus).unwrap()
}

// ---------------------------------------------------------------------------------------------
// Naming

#[test]
fn device_names_follow_nvidia() {
    assert_eq!(DeviceName::gpu(0).as_str(), "gpu-0");
    assert_eq!(DeviceName::gpu(17).to_string(), "gpu-17");
    assert_eq!(
        DeviceName::mig(0, "1g.5gb", 19, 0).as_str(),
        "gpu-0-mig-1g5gb-19-0"
    );
    assert_eq!(
        DeviceName::mig(3, "1g.5gb+me", 20, 6).as_str(),
        "gpu-3-mig-1g5gbme-20-6"
    );
    assert_eq!(
        DeviceName::mig(1, "7g.141gb", 0, 0).as_str(),
        "gpu-1-mig-7g141gb-0-0"
    );
}

#[test]
fn profile_labels_are_rfc1123() {
    assert_eq!(profile_label("1G.10GB+ME"), "1g10gbme");
    assert_eq!(profile_label("1g.24gb-me"), "1g24gb-me");
    assert_eq!(profile_label("-2g.20gb gfx_x-"), "2g20gbgfxx");
    assert_eq!(counter_set_name(4), "gpu-4-counter-set");
}

#[test]
fn find_device_inverts_naming() {
    let inv = profile("a100-mig-mixed");
    for p in [plain(), opts(true, CounterLayout::Separate)] {
        let specs = desired_slices(&inv, &p).unwrap();
        for d in all_devices(&specs) {
            let found =
                find_device(&inv, &d.name).unwrap_or_else(|| panic!("{} does not resolve", d.name));
            match found {
                PublishedDevice::Gpu(g) => {
                    assert_eq!(DeviceName::gpu(g.minor).as_str(), d.name);
                    assert_eq!(attr(d, "uuid"), &s(g.uuid.as_str()));
                }
                PublishedDevice::Mig {
                    parent,
                    existing,
                    profile,
                    placement,
                } => {
                    assert_eq!(attr(d, "parentUUID"), &s(parent.uuid.as_str()));
                    let pname = existing
                        .map(|e| e.profile.clone())
                        .or(profile.map(|p| p.name.clone()))
                        .unwrap();
                    assert_eq!(attr(d, "profile"), &s(&pname));
                    assert!(d.name.ends_with(&format!("-{}", placement.start)));
                    match existing {
                        Some(e) => assert_eq!(attr(d, "uuid"), &s(e.uuid.as_str())),
                        None => assert!(!d.attributes.as_ref().unwrap().contains_key("uuid")),
                    }
                }
            }
        }
    }
    assert!(find_device(&inv, "gpu-9").is_none());
    assert!(find_device(&inv, "gpu-01").is_none());
    assert!(find_device(&inv, "gpu-1-mig-9g99gb-1-0").is_none());
    assert!(find_device(&inv, "gpu-1-xyz").is_none());
    assert!(find_device(&inv, "nvidia0").is_none());
}

// ---------------------------------------------------------------------------------------------
// Attributes

#[test]
fn full_gpu_attributes_have_the_right_types() {
    let inv = profile("dgx-h100");
    let specs = desired_slices(&inv, &plain()).unwrap();
    let g = &inv.gpus[3];
    let d = device(&specs, "gpu-3");
    let keys: BTreeSet<&str> = d
        .attributes
        .as_ref()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    let want: BTreeSet<&str> = [
        "type",
        "uuid",
        "index",
        "minor",
        "productName",
        "brand",
        "architecture",
        "cudaComputeCapability",
        "driverVersion",
        "cudaDriverVersion",
        ATTR_PCI_BUS_ID,
        ATTR_PCIE_ROOT,
        "numaNode",
        "nvlinkDomain",
        "migCapable",
    ]
    .into();
    assert_eq!(keys, want);
    assert_eq!(attr(d, "type"), &s("gpu"));
    assert_eq!(attr(d, "uuid"), &s(g.uuid.as_str()));
    assert_eq!(attr(d, "index"), &int(3));
    assert_eq!(attr(d, "minor"), &int(3));
    assert_eq!(attr(d, "productName"), &s("NVIDIA H100 80GB HBM3"));
    assert_eq!(attr(d, "brand"), &s("Nvidia"));
    assert_eq!(attr(d, "architecture"), &s("Hopper"));
    assert_eq!(attr(d, "cudaComputeCapability"), &version("9.0.0".into()));
    assert_eq!(attr(d, "driverVersion"), &version("570.124.6".into()));
    assert_eq!(attr(d, "cudaDriverVersion"), &version("12.8.0".into()));
    assert_eq!(attr(d, ATTR_PCI_BUS_ID), &s(g.pci_bus_id.as_str()));
    assert_eq!(attr(d, ATTR_PCIE_ROOT), &s(g.pcie_root.as_deref().unwrap()));
    assert_eq!(attr(d, "numaNode"), &int(0));
    assert_eq!(attr(d, "nvlinkDomain"), &int(0));
    assert_eq!(attr(d, "migCapable"), &boolean(true));
    let caps: BTreeMap<&str, String> = d
        .capacity
        .as_ref()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.as_str(), v.value.0.clone()))
        .collect();
    assert_eq!(
        caps,
        [
            ("memory", "80Gi".to_string()),
            ("multiprocessors", "132".to_string())
        ]
        .into()
    );
    // GPUs 4..7 sit on the second socket.
    assert_eq!(attr(device(&specs, "gpu-5"), "numaNode"), &int(1));
}

fn fabric(clique_id: u32) -> crate::inventory::Fabric {
    crate::inventory::Fabric {
        cluster_uuid: crate::inventory::ClusterUuid::parse("6c1f3a52-8d2e-4b7a-9f10-0123456789ab")
            .unwrap(),
        clique_id,
    }
}

#[test]
fn fabric_registration_is_published_on_gpus_and_their_mig_devices() {
    let mut inv = profile("a100-mig-mixed");
    inv.gpus[0].fabric = Some(fabric(7));
    inv.gpus[1].fabric = Some(fabric(7));
    let specs = desired_slices(&inv, &plain()).unwrap();
    let d = device(&specs, "gpu-0");
    assert_eq!(
        attr(d, ATTR_FABRIC_CLUSTER_UUID),
        &s("6c1f3a52-8d2e-4b7a-9f10-0123456789ab")
    );
    assert_eq!(attr(d, ATTR_FABRIC_CLIQUE_ID), &int(7));
    // GPU 1 is in MIG mode: each MIG device carries its parent's fabric.
    let mig = device(&specs, "gpu-1-mig-3g20gb-9-4");
    assert_eq!(attr(mig, ATTR_FABRIC_CLIQUE_ID), &int(7));
    assert_eq!(
        attr(mig, ATTR_FABRIC_CLUSTER_UUID),
        attr(d, ATTR_FABRIC_CLUSTER_UUID)
    );
    // GPUs without a completed registration publish neither attribute, nor do their MIG devices.
    let gpu2_mig = inv.gpus[2].mig.devices[0].clone();
    let gpu2_mig = DeviceName::mig(
        2,
        &gpu2_mig.profile,
        gpu2_mig.gi_profile_id,
        gpu2_mig.placement.start,
    );
    for name in ["gpu-3", gpu2_mig.as_str()] {
        let attrs = device(&specs, name).attributes.as_ref().unwrap();
        assert!(
            !attrs.contains_key(ATTR_FABRIC_CLUSTER_UUID)
                && !attrs.contains_key(ATTR_FABRIC_CLIQUE_ID),
            "{name}"
        );
    }
}

/// The fullest device there is, a 7g instance spanning all 8 memory slices of a GPU with a PCIe
/// root, a NUMA node and a fabric, stays within the API's 32 attributes and capacities, in
/// plain and in partitionable mode.
#[test]
fn the_largest_mig_device_with_a_fabric_fits_the_attribute_limit() {
    let mut inv = mig_ready("dgx-a100");
    for g in &mut inv.gpus {
        g.fabric = Some(fabric(1));
    }
    for partitionable in [false, true] {
        let mut inv = inv.clone();
        if !partitionable {
            let g = &mut inv.gpus[0];
            let p = g
                .mig
                .profiles
                .iter()
                .find(|p| p.name.starts_with("7g"))
                .unwrap()
                .clone();
            g.mig.devices.push(MigDevice {
                uuid: MigUuid("MIG-7g".into()),
                profile: p.name.clone(),
                gi_profile_id: p.gi_profile_id,
                gi_id: 0,
                ci_id: 0,
                placement: p.placements[0],
                memory_bytes: p.memory_bytes,
                multiprocessors: p.multiprocessors,
                engines: p.engines,
                health: Health::Healthy,
            });
        }
        let specs = desired_slices(&inv, &opts(partitionable, CounterLayout::Separate))
            .unwrap_or_else(|e| panic!("partitionable={partitionable}: {e}"));
        let widest = all_devices(&specs)
            .into_iter()
            .map(|d| {
                d.attributes.as_ref().map_or(0, BTreeMap::len)
                    + d.capacity.as_ref().map_or(0, BTreeMap::len)
            })
            .max()
            .unwrap();
        // An existing device (with its `uuid`) is the widest there is: exactly at the limit.
        let want = if partitionable {
            MAX_ATTRIBUTES_AND_CAPACITIES - 1
        } else {
            MAX_ATTRIBUTES_AND_CAPACITIES
        };
        assert_eq!(widest, want, "partitionable={partitionable}");
    }
}

#[test]
fn facts_the_backend_could_not_learn_are_left_out() {
    let mut inv = profile("dgx-h100");
    inv.gpus[0].multiprocessors = None;
    inv.gpus[0].brand = None;
    inv.gpus[0].architecture = None;
    inv.gpus[1].mig.capable = false;
    inv.gpus[1].mig.mode_unknown = true;
    let specs = desired_slices(&inv, &plain()).unwrap();
    let d = device(&specs, "gpu-0");
    let attrs = d.attributes.as_ref().unwrap();
    assert!(!attrs.contains_key("brand") && !attrs.contains_key("architecture"));
    assert_eq!(attr(d, "productName"), &s("NVIDIA H100 80GB HBM3"));
    let caps = d.capacity.as_ref().unwrap();
    assert!(
        !caps.contains_key("multiprocessors"),
        "an unknown SM count is not published as 0: {caps:?}"
    );
    assert_eq!(cap(d, "memory"), "80Gi");
    let g1 = device(&specs, "gpu-1").attributes.as_ref().unwrap();
    assert!(
        !g1.contains_key("migCapable"),
        "unknown MIG mode: no migCapable"
    );
    assert_eq!(attr(device(&specs, "gpu-2"), "migCapable"), &boolean(true));
}

#[test]
fn partitionable_gpu_with_unknown_sm_count_offers_no_sm_counter() {
    let mut inv = mig_ready("dgx-a100");
    inv.gpus[0].multiprocessors = None;
    let specs = desired_slices(&inv, &opts(true, CounterLayout::Separate)).unwrap();
    let sets: Vec<&CounterSet> = specs
        .iter()
        .flat_map(|s| s.shared_counters.iter().flatten())
        .collect();
    let set0 = sets.iter().find(|c| c.name == counter_set_name(0)).unwrap();
    assert!(!set0.counters.contains_key("multiprocessors"));
    assert!(set0.counters.contains_key("memory-slice-0"));
    let set1 = sets.iter().find(|c| c.name == counter_set_name(1)).unwrap();
    assert_eq!(set1.counters["multiprocessors"].value.0, "108");
    // gpu-0's devices consume no SM counter; gpu-1's do.
    let d0 = device(&specs, "gpu-0-mig-1g10gb-19-0");
    assert!(!consumed(d0).keys().any(|(_, c)| c == "multiprocessors"));
    let d1 = device(&specs, "gpu-1-mig-1g10gb-19-0");
    assert!(consumed(d1).keys().any(|(_, c)| c == "multiprocessors"));
}

#[test]
fn nvidia_observed_a100_values() {
    let inv = profile("a100-mig-mixed");
    let specs = desired_slices(&inv, &plain()).unwrap();
    let d = device(&specs, "gpu-0");
    assert_eq!(attr(d, "driverVersion"), &version("550.163.1".into()));
    assert_eq!(attr(d, "cudaDriverVersion"), &version("12.4.0".into()));
    assert_eq!(attr(d, "cudaComputeCapability"), &version("8.0.0".into()));
    assert_eq!(attr(d, "architecture"), &s("Ampere"));
    assert_eq!(cap(d, "memory"), "40Gi");
    assert_eq!(attr(d, ATTR_PCI_BUS_ID), &s("0000:07:00.0"));
}

#[test]
fn unknown_numa_and_pcie_root_are_left_out() {
    let mut inv = profile("dgx-h100");
    inv.gpus[0].numa_node = None;
    inv.gpus[0].pcie_root = None;
    let specs = desired_slices(&inv, &plain()).unwrap();
    let attrs = device(&specs, "gpu-0").attributes.as_ref().unwrap();
    assert!(!attrs.contains_key("numaNode"));
    assert!(!attrs.contains_key(ATTR_PCIE_ROOT));
    assert!(attrs.contains_key(ATTR_PCI_BUS_ID));
    let other = device(&specs, "gpu-1").attributes.as_ref().unwrap();
    assert!(other.contains_key("numaNode") && other.contains_key(ATTR_PCIE_ROOT));
}

#[test]
fn nvlink_domains_are_published() {
    let inv = profile("pcie-pairs");
    let specs = desired_slices(&inv, &plain()).unwrap();
    let domains: Vec<&DeviceAttribute> = (0..4)
        .map(|i| attr(device(&specs, &format!("gpu-{i}")), "nvlinkDomain"))
        .collect();
    assert_eq!(domains, vec![&int(0), &int(0), &int(2), &int(2)]);
}

#[test]
fn versions_normalize_to_semver() {
    for (raw, want) in [
        ("570.124.06", Some("570.124.6")),
        ("550.163.01", Some("550.163.1")),
        ("12.4", Some("12.4.0")),
        ("12", Some("12.0.0")),
        ("9.0", Some("9.0.0")),
        (" v535.104.05 ", Some("535.104.5")),
        ("00.00.00", Some("0.0.0")),
        ("1.2.3-rc.01", Some("1.2.3-rc.1")),
        ("1.2.3-beta-2+build.7", Some("1.2.3-beta-2+build.7")),
        ("1.2.3.4", Some("1.2.3+4")),
        ("32.0.15.6094", Some("32.0.15+6094")),
        ("", None),
        ("N/A", None),
        ("1..2", None),
        ("1.2.x", None),
        ("1.2.3-", None),
        ("1.2.3+", None),
        ("1.2.3-a..b", None),
        ("99999999999999999999.1", None),
        (&"1".repeat(70), None),
    ] {
        let got = normalize_version(raw);
        assert_eq!(got.as_deref(), want, "{raw:?}");
        if let Some(v) = got {
            assert!(is_semver(&v), "{v}");
        }
    }
}

#[test]
fn unreadable_versions_are_left_out_not_published_as_strings() {
    let mut inv = profile("dgx-h100");
    inv.gpus[0].driver_version = "unknown".into();
    inv.gpus[0].cuda_driver_version = "12.8".into();
    let specs = desired_slices(&inv, &plain()).unwrap();
    let attrs = device(&specs, "gpu-0").attributes.as_ref().unwrap();
    assert!(!attrs.contains_key("driverVersion"));
    assert_eq!(attrs["cudaDriverVersion"], version("12.8.0".into()));
}

#[test]
fn semver_check_matches_the_api_server() {
    for ok in [
        "0.0.0",
        "1.2.3",
        "1.2.3-0",
        "1.2.3-alpha.1",
        "1.2.3-0a",
        "1.2.3+001",
        "1.2.3-x-y",
    ] {
        assert!(is_semver(ok), "{ok}");
    }
    for bad in [
        "1.2", "01.2.3", "1.2.03", "1.2.3-01", "1.2.3-", "1.2.3+", "v1.2.3", "1.2.3.4", "a.b.c", "",
    ] {
        assert!(!is_semver(bad), "{bad}");
    }
}

// ---------------------------------------------------------------------------------------------
// MIG without partitioning

#[test]
fn mig_mode_gpus_publish_only_their_mig_devices() {
    let inv = profile("a100-mig-mixed");
    let specs = desired_slices(&inv, &plain()).unwrap();
    assert_eq!(specs.len(), 1);
    let got = names(&specs);
    let want = vec![
        "gpu-0",
        "gpu-1-mig-1g5gb-19-2",
        "gpu-1-mig-1g5gb-19-3",
        "gpu-1-mig-2g10gb-14-0",
        "gpu-1-mig-3g20gb-9-4",
        "gpu-2-mig-1g10gb-15-0",
        "gpu-2-mig-1g10gb-15-2",
        "gpu-2-mig-1g10gb-15-4",
        "gpu-3",
    ];
    assert_eq!(got, want);
    assert!(
        all_devices(&specs)
            .iter()
            .all(|d| d.consumes_counters.is_none())
    );
    assert!(specs[0].shared_counters.is_none());
}

#[test]
fn mig_device_attributes_and_capacities() {
    let inv = profile("a100-mig-mixed");
    let parent = &inv.gpus[1];
    let specs = desired_slices(&inv, &plain()).unwrap();
    let d = device(&specs, "gpu-1-mig-3g20gb-9-4");
    let m = parent
        .mig
        .devices
        .iter()
        .find(|m| m.profile == "3g.20gb")
        .unwrap();
    assert_eq!(attr(d, "type"), &s("mig"));
    assert_eq!(attr(d, "uuid"), &s(m.uuid.as_str()));
    assert_eq!(attr(d, "parentUUID"), &s(parent.uuid.as_str()));
    assert_eq!(attr(d, "profile"), &s("3g.20gb"));
    assert_eq!(attr(d, "parentIndex"), &int(1));
    assert_eq!(attr(d, "productName"), &s("NVIDIA A100-SXM4-40GB"));
    assert_eq!(attr(d, "driverVersion"), &version("550.163.1".into()));
    assert_eq!(attr(d, ATTR_PCI_BUS_ID), &s(parent.pci_bus_id.as_str()));
    assert_eq!(attr(d, "nvlinkDomain"), &int(0));
    let attrs = d.attributes.as_ref().unwrap();
    assert!(!attrs.contains_key("index") && !attrs.contains_key("migCapable"));
    assert!(!attrs.contains_key("parentMinor"), "the name carries it");
    assert_eq!(cap(d, "memory"), "19968Mi");
    assert_eq!(cap(d, "multiprocessors"), "42");
    assert_eq!(cap(d, "copyEngines"), "3");
    assert_eq!(cap(d, "decoders"), "2");
    assert_eq!(cap(d, "encoders"), "0");
    assert_eq!(cap(d, "jpegEngines"), "0");
    assert_eq!(cap(d, "ofaEngines"), "0");
    let slices: Vec<&String> = d
        .capacity
        .as_ref()
        .unwrap()
        .keys()
        .filter(|k| k.starts_with("memorySlice"))
        .collect();
    assert_eq!(
        slices,
        vec![
            "memorySlice4",
            "memorySlice5",
            "memorySlice6",
            "memorySlice7"
        ]
    );
    assert!(
        d.capacity
            .as_ref()
            .unwrap()
            .iter()
            .filter(|(k, _)| k.starts_with("memorySlice"))
            .all(|(_, v)| v.value.0 == "1")
    );
}

#[test]
fn mig_mode_gpu_without_instances_publishes_nothing() {
    let mut inv = profile("a100-mig-mixed");
    inv.gpus[2].mig.devices.clear();
    let specs = desired_slices(&inv, &plain()).unwrap();
    assert!(!names(&specs).iter().any(|n| n.starts_with("gpu-2")));
}

#[test]
fn unhealthy_devices_are_not_published() {
    let mut inv = profile("a100-mig-mixed");
    inv.gpus[0].health = Health::Unhealthy {
        reason: "XID 79".into(),
    };
    inv.gpus[1].mig.devices[0].health = Health::Unhealthy {
        reason: "XID 94".into(),
    };
    let bad_mig = DeviceName::mig(
        1,
        &inv.gpus[1].mig.devices[0].profile,
        inv.gpus[1].mig.devices[0].gi_profile_id,
        inv.gpus[1].mig.devices[0].placement.start,
    );
    inv.gpus[2].health = Health::Unhealthy {
        reason: "fallen off the bus".into(),
    };
    for p in [plain(), opts(true, CounterLayout::Separate)] {
        let specs = desired_slices(&inv, &p).unwrap();
        let got = names(&specs);
        assert!(!got.contains(&"gpu-0".to_string()), "{got:?}");
        assert!(!got.contains(&bad_mig.to_string()), "{got:?}");
        assert!(!got.iter().any(|n| n.starts_with("gpu-2")), "{got:?}");
        assert!(got.iter().any(|n| n.starts_with("gpu-1-mig-")), "{got:?}");
        assert!(got.contains(&"gpu-3".to_string()), "{got:?}");
        let sets: Vec<&str> = specs
            .iter()
            .flat_map(|s| s.shared_counters.iter().flatten())
            .map(|c| c.name.as_str())
            .collect();
        assert!(!sets.contains(&"gpu-2-counter-set"), "{sets:?}");
    }
}

#[test]
fn no_gpus_still_publishes_one_empty_slice() {
    let mut inv = profile("dgx-h100");
    for g in &mut inv.gpus {
        g.health = Health::Unhealthy { reason: "x".into() };
    }
    for p in [plain(), opts(true, CounterLayout::Together)] {
        for inv in [&inv, &Inventory::default()] {
            let specs = desired_slices(inv, &p).unwrap();
            assert_eq!(specs.len(), 1);
            assert_eq!(specs[0].devices.as_deref(), Some(&[][..]));
            assert_eq!(specs[0].pool.resource_slice_count, 1);
        }
    }
}

#[test]
fn results_are_deterministic_and_local_to_each_gpu() {
    // The publisher compares desired with existing slices; any needless difference is churn.
    let o = opts(true, CounterLayout::Separate);
    let inv = mig_ready("dgx-a100");
    let a = desired_slices(&inv, &o).unwrap();
    let mut shuffled = inv.gpus.clone();
    shuffled.reverse();
    let b = desired_slices(&Inventory::new(shuffled).unwrap(), &o).unwrap();
    assert_eq!(a, b);
    // One GPU's MIG change touches only its own device slice (and the counters slice stays).
    let mut changed = inv.clone();
    let p = changed.gpus[4].mig.profiles[0].clone();
    changed.gpus[4].mig.enabled = true;
    changed.gpus[4].mig.devices.push(MigDevice {
        uuid: MigUuid("MIG-x".into()),
        profile: p.name.clone(),
        gi_profile_id: p.gi_profile_id,
        gi_id: 1,
        ci_id: 0,
        placement: p.placements[0],
        memory_bytes: p.memory_bytes,
        multiprocessors: p.multiprocessors,
        engines: p.engines,
        health: Health::Healthy,
    });
    let c = desired_slices(&changed, &o).unwrap();
    assert_eq!(a.len(), c.len());
    let differing: Vec<usize> = (0..a.len()).filter(|&i| a[i] != c[i]).collect();
    assert_eq!(
        differing,
        vec![5],
        "only gpu-4's device slice (after the counters slice)"
    );
}

#[test]
fn pool_bookkeeping() {
    let specs = desired_slices(&profile("dgx-h100"), &plain()).unwrap();
    assert_eq!(specs.len(), 1);
    let s = &specs[0];
    assert_eq!(s.driver, DRIVER);
    assert_eq!(s.node_name.as_deref(), Some("node-a"));
    assert_eq!(s.pool.name, "node-a");
    assert_eq!(s.pool.generation, 0);
    assert_eq!(s.pool.resource_slice_count, 1);
    assert!(s.all_nodes.is_none() && s.node_selector.is_none());
    assert_eq!(
        names(&specs),
        (0..8).map(|i| format!("gpu-{i}")).collect::<Vec<_>>()
    );
}

// ---------------------------------------------------------------------------------------------
// Partitionable

fn consumed(d: &Device) -> BTreeMap<(String, String), String> {
    d.consumes_counters
        .iter()
        .flatten()
        .flat_map(|c| {
            c.counters
                .iter()
                .map(|(k, v)| ((c.counter_set.clone(), k.clone()), v.value.0.clone()))
        })
        .collect()
}

#[test]
fn partitionable_dgx_a100_publishes_every_placement() {
    let inv = mig_ready("dgx-a100");
    let specs = desired_slices(&inv, &opts(true, CounterLayout::Separate)).unwrap();
    let per_gpu: usize = inv.gpus[0]
        .mig
        .profiles
        .iter()
        .map(|p| p.placements.len())
        .sum();
    assert_eq!(per_gpu, 7 + 7 + 4 + 3 + 2 + 1 + 1);
    let devices = all_devices(&specs);
    assert_eq!(devices.len(), 8 * per_gpu);

    let sets: Vec<&CounterSet> = specs
        .iter()
        .flat_map(|s| s.shared_counters.iter().flatten())
        .collect();
    assert_eq!(sets.len(), 8);
    let set = sets.iter().find(|s| s.name == "gpu-0-counter-set").unwrap();
    let counters: BTreeMap<&str, &str> = set
        .counters
        .iter()
        .map(|(k, v)| (k.as_str(), v.value.0.as_str()))
        .collect();
    let mut want: BTreeMap<&str, &str> = [
        ("memory", "80Gi"),
        ("multiprocessors", "108"),
        ("copy-engines", "7"),
        ("decoders", "5"),
        ("jpeg-engines", "1"),
        ("ofa-engines", "1"),
    ]
    .into();
    let slice_names: Vec<String> = (0..8).map(|i| format!("memory-slice-{i}")).collect();
    for n in &slice_names {
        want.insert(n, "1");
    }
    assert_eq!(
        counters, want,
        "A100 has no encoders, so no encoder counter"
    );

    // The GPU in MIG mode is not published whole; its largest placement covers all of it.
    assert!(!names(&specs).contains(&"gpu-0".to_string()));
    let full = device(&specs, "gpu-0-mig-7g80gb-0-0");
    assert_eq!(consumed(full).len(), want.len());
    assert_eq!(
        consumed(full)[&("gpu-0-counter-set".into(), "memory".into())],
        "80384Mi"
    );
    assert_eq!(cap(full, "copyEngines"), "7");
    assert_eq!(attr(full, "type"), &s("mig"));

    // A placement consumes its share and exactly its memory slices.
    let d = device(&specs, "gpu-5-mig-2g20gb-14-4");
    assert!(!d.attributes.as_ref().unwrap().contains_key("uuid"));
    assert_eq!(attr(d, "profile"), &s("2g.20gb"));
    let got = consumed(d);
    let set5 = "gpu-5-counter-set".to_string();
    assert_eq!(got[&(set5.clone(), "memory".into())], "19968Mi");
    assert_eq!(got[&(set5.clone(), "multiprocessors".into())], "28");
    assert_eq!(got[&(set5.clone(), "copy-engines".into())], "2");
    assert_eq!(got[&(set5.clone(), "decoders".into())], "1");
    let slices: Vec<&str> = got
        .keys()
        .filter(|(_, k)| k.starts_with("memory-slice-"))
        .map(|(_, k)| k.as_str())
        .collect();
    assert_eq!(slices, vec!["memory-slice-4", "memory-slice-5"]);
    assert!(
        !got.keys()
            .any(|(_, k)| k == "jpeg-engines" || k == "encoders")
    );
    assert_eq!(cap(d, "memorySlice4"), "1");

    // Every profile's every placement, per GPU, by name.
    for g in &inv.gpus {
        for p in &g.mig.profiles {
            for pl in &p.placements {
                let name = DeviceName::mig(g.minor, &p.name, p.gi_profile_id, pl.start);
                let d = device(&specs, name.as_str());
                let n = consumed(d)
                    .keys()
                    .filter(|(set, k)| {
                        set == &counter_set_name(g.minor) && k.starts_with("memory-slice-")
                    })
                    .count();
                assert_eq!(n as u32, pl.size, "{name}");
            }
        }
    }
}

#[test]
fn separate_layout_puts_counters_first() {
    let specs =
        desired_slices(&mig_ready("dgx-a100"), &opts(true, CounterLayout::Separate)).unwrap();
    assert_eq!(specs.len(), 9);
    assert!(specs[0].devices.is_none());
    assert_eq!(specs[0].shared_counters.as_ref().unwrap().len(), 8);
    for (i, s) in specs.iter().enumerate().skip(1) {
        assert!(s.shared_counters.is_none());
        let devices = s.devices.as_ref().unwrap();
        assert_eq!(devices.len(), 25);
        let prefix = format!("gpu-{}", i - 1);
        assert!(
            devices
                .iter()
                .all(|d| d.name.starts_with(&format!("{prefix}-"))),
            "slice {i}"
        );
        assert!(devices.is_sorted_by(|a, b| a.name <= b.name));
    }
    assert!(specs.iter().all(|s| s.pool.resource_slice_count == 9));
}

#[test]
fn together_layout_has_one_slice_per_gpu() {
    let specs =
        desired_slices(&mig_ready("dgx-a100"), &opts(true, CounterLayout::Together)).unwrap();
    assert_eq!(specs.len(), 8);
    for (i, s) in specs.iter().enumerate() {
        let sets = s.shared_counters.as_ref().unwrap();
        assert_eq!(sets.len(), 1);
        assert_eq!(sets[0].name, format!("gpu-{i}-counter-set"));
        let devices = s.devices.as_ref().unwrap();
        assert_eq!(devices.len(), 25);
        assert!(
            devices
                .iter()
                .all(|d| { d.consumes_counters.as_ref().unwrap()[0].counter_set == sets[0].name })
        );
        assert!(devices.is_sorted_by(|a, b| a.name <= b.name));
    }
}

#[test]
fn partitionable_keeps_existing_mig_devices_and_their_silicon() {
    let inv = profile("a100-mig-mixed");
    let specs = desired_slices(&inv, &opts(true, CounterLayout::Separate)).unwrap();
    let got = names(&specs);
    // GPU 1 is fully carved up: only its four existing devices, no whole GPU, no placements.
    let gpu1: Vec<&String> = got.iter().filter(|n| n.starts_with("gpu-1")).collect();
    assert_eq!(gpu1.len(), 4, "{gpu1:?}");
    assert!(!got.contains(&"gpu-1".to_string()));
    for n in &gpu1 {
        let d = device(&specs, n);
        assert!(d.attributes.as_ref().unwrap().contains_key("uuid"), "{n}");
        assert!(d.consumes_counters.is_some(), "{n}");
    }
    // GPU 2 uses slices 0-5; what starts at 6 is still free.
    let mut gpu2: Vec<&str> = got
        .iter()
        .filter(|n| n.starts_with("gpu-2"))
        .map(String::as_str)
        .collect();
    gpu2.sort();
    assert_eq!(
        gpu2,
        vec![
            "gpu-2-mig-1g10gb-15-0",
            "gpu-2-mig-1g10gb-15-2",
            "gpu-2-mig-1g10gb-15-4",
            "gpu-2-mig-1g10gb-15-6",
            "gpu-2-mig-1g5gb-19-6",
            "gpu-2-mig-1g5gbme-20-6",
        ]
    );
    // GPU 3 is MIG-capable but not in MIG mode: the whole GPU, plainly, without placements
    // (prepare never switches MIG mode).
    assert!(got.contains(&"gpu-3".to_string()));
    assert!(!got.iter().any(|n| n.starts_with("gpu-3-mig-")));
    assert!(device(&specs, "gpu-3").consumes_counters.is_none());
}

#[test]
fn non_mig_gpus_are_published_plainly_in_partitionable_mode() {
    let inv = profile("l40s-pcie");
    for layout in [CounterLayout::Separate, CounterLayout::Together] {
        let specs = desired_slices(&inv, &opts(true, layout)).unwrap();
        assert_eq!(specs.len(), 1);
        assert!(specs[0].shared_counters.is_none());
        assert_eq!(names(&specs).len(), inv.gpus.len());
        assert!(
            all_devices(&specs)
                .iter()
                .all(|d| d.consumes_counters.is_none())
        );
        assert_eq!(attr(all_devices(&specs)[0], "migCapable"), &boolean(false));
        assert!(
            !all_devices(&specs)[0]
                .capacity
                .as_ref()
                .unwrap()
                .contains_key("copyEngines")
        );
    }
}

#[test]
fn many_gpus_spread_counter_sets_over_slices_of_eight() {
    let inv = in_mig_mode(synthetic("dgx-a100", 20));
    let specs = desired_slices(&inv, &opts(true, CounterLayout::Separate)).unwrap();
    let counter_slices: Vec<usize> = specs
        .iter()
        .filter(|s| s.devices.is_none())
        .map(|s| s.shared_counters.as_ref().unwrap().len())
        .collect();
    assert_eq!(counter_slices, vec![8, 8, 4]);
    assert_eq!(specs.len(), 3 + 20);
    let together = desired_slices(&inv, &opts(true, CounterLayout::Together)).unwrap();
    assert_eq!(together.len(), 20);
}

fn with_memory_slices(n: u32) -> Inventory {
    let mut inv = in_mig_mode(synthetic("dgx-a100", 1));
    let g = &mut inv.gpus[0];
    g.mig.memory_slices = n;
    g.mig.profiles.retain(|p| p.name == "1g.10gb");
    g.mig.profiles[0].placements = (0..n).map(|start| Placement { start, size: 1 }).collect();
    inv
}

#[test]
fn counters_beyond_one_set_split_into_a_second() {
    // 6 resource counters + 40 memory slices = 46 counters: two sets.
    let inv = with_memory_slices(40);
    let specs = desired_slices(&inv, &opts(true, CounterLayout::Separate)).unwrap();
    let sets: Vec<&CounterSet> = specs
        .iter()
        .flat_map(|s| s.shared_counters.iter().flatten())
        .collect();
    assert_eq!(
        sets.iter().map(|s| s.name.as_str()).collect::<Vec<_>>(),
        vec!["gpu-0-counter-set", "gpu-0-counter-set-2"]
    );
    assert_eq!(sets[0].counters.len(), 32);
    assert_eq!(sets[1].counters.len(), 14);
    // A GPU in MIG mode is handed out only as MIG devices.
    assert!(!names(&specs).contains(&"gpu-0".to_string()));
    // A placement in the second set's slices consumes from both sets (resources from the first).
    let last = device(&specs, "gpu-0-mig-1g10gb-19-39");
    let sets_used: Vec<&str> = last
        .consumes_counters
        .as_ref()
        .unwrap()
        .iter()
        .map(|c| c.counter_set.as_str())
        .collect();
    assert_eq!(sets_used, vec!["gpu-0-counter-set", "gpu-0-counter-set-2"]);
    let first = device(&specs, "gpu-0-mig-1g10gb-19-0");
    assert_eq!(first.consumes_counters.as_ref().unwrap().len(), 1);
    // 40 devices consuming counters need a single devices slice below 64.
    assert_eq!(specs.len(), 2);

    // The 1.34 layout allows only 32 counters in a slice with devices.
    let err = desired_slices(&inv, &opts(true, CounterLayout::Together)).unwrap_err();
    assert!(err.to_string().contains("too-many-counters"), "{err}");
}

#[test]
fn counters_beyond_two_sets_are_refused() {
    let err = desired_slices(
        &with_memory_slices(60),
        &opts(true, CounterLayout::Separate),
    )
    .unwrap_err();
    assert!(
        matches!(
            err,
            Error::TooManyCounters {
                minor: 0,
                needed: 66,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("without --partitionable"), "{err}");
    // Without partitioning the same GPU is fine.
    desired_slices(&with_memory_slices(60), &plain()).unwrap();
}

#[test]
fn partitionable_gpu_with_many_placements_splits_or_refuses() {
    // 4 profiles x 20 placements: 80 devices for one GPU, over 64.
    let mut inv = with_memory_slices(20);
    let base = inv.gpus[0].mig.profiles[0].clone();
    for k in 0..3u32 {
        let mut p = base.clone();
        p.name = format!("1g.{k}gb");
        p.gi_profile_id = 30 + k;
        inv.gpus[0].mig.profiles.push(p);
    }
    let specs = desired_slices(&inv, &opts(true, CounterLayout::Separate)).unwrap();
    let device_slices: Vec<usize> = specs
        .iter()
        .filter_map(|s| s.devices.as_ref().map(Vec::len))
        .collect();
    assert_eq!(device_slices, vec![64, 16]);
    let err = desired_slices(&inv, &opts(true, CounterLayout::Together)).unwrap_err();
    assert!(
        matches!(
            err,
            Error::TooManyDevicesTogether {
                minor: 0,
                devices: 80,
                max: 64
            }
        ),
        "{err}"
    );
}

// ---------------------------------------------------------------------------------------------
// Splitting

#[test]
fn plain_devices_split_at_128() {
    let specs = desired_slices(&synthetic("l40s-pcie", 300), &plain()).unwrap();
    let sizes: Vec<usize> = specs
        .iter()
        .map(|s| s.devices.as_ref().unwrap().len())
        .collect();
    assert_eq!(sizes, vec![128, 128, 44]);
    assert!(specs.iter().all(|s| s.pool.resource_slice_count == 3));
}

#[test]
fn devices_with_taints_or_counters_split_at_64() {
    let mk = |name: &str, advanced: bool| Device {
        name: name.into(),
        taints: advanced.then(|| {
            vec![DeviceTaint {
                key: "gpu.nvidia.com/xid".into(),
                value: Some("79".into()),
                effect: "NoSchedule".into(),
                time_added: None,
            }]
        }),
        ..Default::default()
    };
    let mut devices: Vec<Device> = (0..100).map(|i| mk(&format!("a{i:03}"), false)).collect();
    devices.push(mk("b", true));
    devices.extend((0..70).map(|i| mk(&format!("c{i:03}"), false)));
    let chunks = chunk_devices(devices);
    let sizes: Vec<usize> = chunks.iter().map(Vec::len).collect();
    assert_eq!(sizes, vec![100, 64, 7]);
    assert!(chunks[1].iter().any(is_advanced));
    assert!(!chunks[2].iter().any(is_advanced));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Whatever the GPU count, every device is published exactly once, every slice is within the
    /// limits, and the pool bookkeeping adds up. (`desired_slices` runs `validate` and
    /// `validate_pool` itself, so a success says they passed; the limits are restated here.)
    #[test]
    fn splitting_respects_limits(
        n in 0u32..300,
        profile_idx in 0usize..3,
        partitionable in any::<bool>(),
        together in any::<bool>(),
        mig_mode in any::<bool>(),
    ) {
        let profile_name = ["l40s-pcie", "dgx-a100", "a100-mig-mixed"][profile_idx];
        let n = if profile_name == "l40s-pcie" { n } else { n % 40 };
        let inv = synthetic(profile_name, n);
        let inv = if mig_mode { in_mig_mode(inv) } else { inv };
        let layout = if together { CounterLayout::Together } else { CounterLayout::Separate };
        let specs = desired_slices(&inv, &opts(partitionable, layout)).unwrap();
        prop_assert!(!specs.is_empty());
        for s in &specs {
            prop_assert_eq!(s.pool.resource_slice_count, specs.len() as i64);
            let devices = s.devices.as_deref().unwrap_or_default();
            let limit = if devices.iter().any(is_advanced) { 64 } else { 128 };
            prop_assert!(devices.len() <= limit);
            prop_assert!(devices.is_sorted_by(|a, b| a.name <= b.name));
            prop_assert!(s.shared_counters.as_ref().is_none_or(|c| c.len() <= 8));
        }
        let names = names(&specs);
        let unique: BTreeSet<&String> = names.iter().collect();
        prop_assert_eq!(unique.len(), names.len());
        // A GPU in MIG mode (here without instances) is only its placements when partitionable,
        // and nothing otherwise; any other GPU is itself.
        let per_gpu = match (inv.gpus.first().is_some_and(|g| g.in_mig_mode()), partitionable) {
            (true, true) => inv.gpus[0].mig.profiles.iter().map(|p| p.placements.len()).sum(),
            (true, false) => 0,
            (false, _) => 1,
        };
        prop_assert_eq!(names.len(), n as usize * per_gpu);
    }
}

// ---------------------------------------------------------------------------------------------
// Errors from desired_slices name the device and the rule

#[test]
fn invalid_results_are_reported_not_returned() {
    let mut inv = profile("dgx-h100");
    inv.gpus[2].product_name = "NVIDIA ".repeat(12);
    let err = desired_slices(&inv, &plain()).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("device gpu-2"), "{msg}");
    assert!(msg.contains("value-too-long"), "{msg}");
    assert!(msg.contains("productName"), "{msg}");

    let mut o = plain();
    o.driver = "GPU_NVIDIA".into();
    let msg = desired_slices(&profile("dgx-h100"), &o)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("driver-name"), "{msg}");
}

// ---------------------------------------------------------------------------------------------
// validate: one violation per rule

fn valid_spec() -> ResourceSliceSpec {
    desired_slices(&profile("a100-mig-mixed"), &plain())
        .unwrap()
        .remove(0)
}

fn valid_together() -> ResourceSliceSpec {
    desired_slices(&mig_ready("dgx-a100"), &opts(true, CounterLayout::Together))
        .unwrap()
        .remove(0)
}

fn rule_ids(v: &[Violation]) -> BTreeSet<String> {
    v.iter().map(|v| v.rule_id().to_string()).collect()
}

/// Applies `mutate` to a valid slice and expects exactly the rule `id` to break.
fn expect_rule(base: ResourceSliceSpec, id: &str, mutate: impl FnOnce(&mut ResourceSliceSpec)) {
    let mut spec = base;
    assert!(validate(&spec).is_empty());
    mutate(&mut spec);
    let v = validate(&spec);
    assert_eq!(rule_ids(&v), BTreeSet::from([id.to_string()]), "{v:?}");
}

fn first_device(s: &mut ResourceSliceSpec) -> &mut Device {
    &mut s.devices.as_mut().unwrap()[0]
}

#[test]
fn valid_slices_have_no_violations() {
    assert_eq!(validate(&valid_spec()), vec![]);
    assert_eq!(validate(&valid_together()), vec![]);
}

#[test]
fn violation_display_names_device_and_rule() {
    let v = Violation {
        device: Some("gpu-0".into()),
        rule: "device-name: x".into(),
    };
    assert_eq!(v.to_string(), "device gpu-0: device-name: x");
    assert_eq!(v.rule_id(), "device-name");
    let v = Violation {
        device: None,
        rule: "driver-name: y".into(),
    };
    assert_eq!(v.to_string(), "driver-name: y");
}

#[test]
fn rule_driver_name() {
    expect_rule(valid_spec(), "driver-name", |s| {
        s.driver = "Gpu.Nvidia.com".into()
    });
    expect_rule(valid_spec(), "driver-name", |s| {
        s.driver = format!("{}.com", "a".repeat(61))
    });
}

#[test]
fn rule_pool() {
    expect_rule(valid_spec(), "pool-name", |s| s.pool.name = "Node_A".into());
    expect_rule(valid_spec(), "pool-name", |s| s.pool.name = String::new());
    expect_rule(valid_spec(), "pool-name", |s| s.pool.name = "a".repeat(254));
    expect_rule(valid_spec(), "pool-generation", |s| s.pool.generation = -1);
    expect_rule(valid_spec(), "pool-slice-count", |s| {
        s.pool.resource_slice_count = 0
    });
    // Pool names may hold several subdomains separated by '/'.
    let mut ok = valid_spec();
    ok.pool.name = "node-a/gpus".into();
    assert!(validate(&ok).is_empty());
}

#[test]
fn rule_node_selection() {
    expect_rule(valid_spec(), "node-selection", |s| s.node_name = None);
    expect_rule(valid_spec(), "node-selection", |s| s.all_nodes = Some(true));
    expect_rule(valid_spec(), "node-selection", |s| {
        s.node_name = None;
        s.node_selector = Some(NodeSelector {
            node_selector_terms: vec![NodeSelectorTerm::default(), NodeSelectorTerm::default()],
        });
    });
    expect_rule(valid_spec(), "node-selection", |s| {
        s.node_name = Some("Node A".into());
    });
}

#[test]
fn rule_too_many_devices() {
    let device = first_device(&mut valid_spec()).clone();
    expect_rule(valid_spec(), "too-many-devices", |s| {
        s.devices = Some(
            (0..129)
                .map(|i| Device {
                    name: format!("gpu-{i}"),
                    ..device.clone()
                })
                .collect(),
        );
    });
    let mut with_counters = valid_together();
    let d = with_counters.devices.as_ref().unwrap()[0].clone();
    expect_rule(with_counters.clone(), "too-many-devices", |s| {
        s.devices = Some(
            (0..65)
                .map(|i| Device {
                    name: format!("x-{i}"),
                    ..d.clone()
                })
                .collect(),
        );
    });
    with_counters.devices.as_mut().unwrap().truncate(1);
    assert!(validate(&with_counters).is_empty());
}

#[test]
fn rule_device_name() {
    expect_rule(valid_spec(), "device-name", |s| {
        first_device(s).name = "GPU_0".into()
    });
    expect_rule(valid_spec(), "device-name", |s| {
        first_device(s).name = "a".repeat(64)
    });
    expect_rule(valid_spec(), "device-name", |s| {
        first_device(s).name = "gpu-".into()
    });
    expect_rule(valid_spec(), "duplicate-device", |s| {
        let d = s.devices.as_ref().unwrap()[0].clone();
        s.devices.as_mut().unwrap()[1] = d;
    });
}

#[test]
fn rule_too_many_attributes() {
    expect_rule(valid_spec(), "too-many-attributes", |s| {
        let d = first_device(s);
        let caps = d.capacity.as_mut().unwrap();
        for i in 0..20 {
            caps.insert(format!("extra{i}"), capacity("1".into()));
        }
    });
}

#[test]
fn rule_qualified_name() {
    for bad in [
        "9lives",
        "has-dash",
        "a".repeat(33).as_str(),
        "Bad_Domain/x",
        "/x",
        "example.com/",
        format!("{}.com/x", "a".repeat(61)).as_str(),
    ] {
        expect_rule(valid_spec(), "qualified-name", |s| {
            first_device(s)
                .attributes
                .as_mut()
                .unwrap()
                .insert(bad.to_string(), string("v"));
        });
    }
    expect_rule(valid_spec(), "qualified-name", |s| {
        first_device(s)
            .capacity
            .as_mut()
            .unwrap()
            .insert("memory-slice".into(), capacity("1".into()));
    });
    expect_rule(valid_spec(), "duplicate-attribute", |s| {
        first_device(s)
            .attributes
            .as_mut()
            .unwrap()
            .insert(format!("{DRIVER}/type"), string("gpu"));
    });
}

#[test]
fn rule_attribute_values() {
    expect_rule(valid_spec(), "attribute-value", |s| {
        first_device(s).attributes.as_mut().unwrap().insert(
            "both".into(),
            DeviceAttribute {
                int: Some(1),
                bool: Some(true),
                ..Default::default()
            },
        );
    });
    expect_rule(valid_spec(), "attribute-value", |s| {
        first_device(s)
            .attributes
            .as_mut()
            .unwrap()
            .insert("none".into(), DeviceAttribute::default());
    });
    expect_rule(valid_spec(), "value-too-long", |s| {
        first_device(s)
            .attributes
            .as_mut()
            .unwrap()
            .insert("long".into(), string("x".repeat(65)));
    });
    // 64 characters is still fine.
    let mut ok = valid_spec();
    first_device(&mut ok)
        .attributes
        .as_mut()
        .unwrap()
        .insert("long".into(), string("x".repeat(64)));
    assert!(validate(&ok).is_empty());
    expect_rule(valid_spec(), "version-not-semver", |s| {
        first_device(s)
            .attributes
            .as_mut()
            .unwrap()
            .insert("driverVersion".into(), version("570.124.06".into()));
    });
}

#[test]
fn rule_quantity_and_request_policy() {
    expect_rule(valid_spec(), "quantity", |s| {
        first_device(s)
            .capacity
            .as_mut()
            .unwrap()
            .insert("memory".into(), capacity("80 GB".into()));
    });
    expect_rule(valid_spec(), "request-policy", |s| {
        first_device(s)
            .capacity
            .as_mut()
            .unwrap()
            .get_mut("memory")
            .unwrap()
            .request_policy = Some(CapacityRequestPolicy::default());
    });
    for ok in ["1", "80Gi", "1.5", "100m", "1e3", "+5", ".5", "2E-2"] {
        assert!(validate::is_quantity(ok), "{ok}");
    }
    for bad in ["", "Gi", "1.2.3", "1Zi", "1e", "1 Gi", "1GiB"] {
        assert!(!validate::is_quantity(bad), "{bad}");
    }
}

#[test]
fn rule_counter_consumption() {
    let consumption =
        |s: &mut ResourceSliceSpec| first_device(s).consumes_counters.as_mut().unwrap()[0].clone();
    expect_rule(valid_together(), "too-many-consumptions", |s| {
        let all = first_device(s).consumes_counters.as_mut().unwrap();
        for n in 0..2 {
            all.push(DeviceCounterConsumption {
                counter_set: format!("other-{n}"),
                counters: BTreeMap::from([(
                    "memory".to_string(),
                    Counter {
                        value: Quantity("1".into()),
                    },
                )]),
            });
        }
        s.shared_counters
            .as_mut()
            .unwrap()
            .extend((0..2).map(|n| CounterSet {
                name: format!("other-{n}"),
                counters: BTreeMap::from([(
                    "memory".to_string(),
                    Counter {
                        value: Quantity("1".into()),
                    },
                )]),
            }));
    });
    expect_rule(valid_together(), "duplicate-consumption", |s| {
        let c = consumption(s);
        first_device(s)
            .consumes_counters
            .as_mut()
            .unwrap()
            .push(DeviceCounterConsumption {
                counters: BTreeMap::from([(
                    "memory".to_string(),
                    Counter {
                        value: Quantity("1".into()),
                    },
                )]),
                ..c
            });
    });
    expect_rule(valid_together(), "consumption-counters", |s| {
        first_device(s).consumes_counters.as_mut().unwrap()[0]
            .counters
            .clear();
    });
    expect_rule(valid_together(), "counter-name", |s| {
        first_device(s).consumes_counters.as_mut().unwrap()[0]
            .counters
            .insert(
                "copyEngines".into(),
                Counter {
                    value: Quantity("1".into()),
                },
            );
    });
    expect_rule(valid_together(), "counter-set-name", |s| {
        s.shared_counters.as_mut().unwrap()[0].name = "Set_0".into();
        for d in s.devices.as_mut().unwrap() {
            d.consumes_counters.as_mut().unwrap()[0].counter_set = "Set_0".into();
        }
    });
    // 1.34 layout: a consumption must name a set of the same slice.
    expect_rule(valid_together(), "unknown-counter-set", |s| {
        first_device(s).consumes_counters.as_mut().unwrap()[0].counter_set =
            "gpu-9-counter-set".into();
    });
}

#[test]
fn rule_counter_sets() {
    let counters_only = desired_slices(
        &in_mig_mode(synthetic("dgx-a100", 8)),
        &opts(true, CounterLayout::Separate),
    )
    .unwrap()
    .remove(0);
    assert!(counters_only.devices.is_none());
    expect_rule(counters_only.clone(), "too-many-counter-sets", |s| {
        let mut extra = s.shared_counters.as_ref().unwrap()[0].clone();
        extra.name = "gpu-99-counter-set".into();
        s.shared_counters.as_mut().unwrap().push(extra);
    });
    expect_rule(counters_only.clone(), "duplicate-counter-set", |s| {
        let sets = s.shared_counters.as_mut().unwrap();
        sets[1].name = sets[0].name.clone();
    });
    expect_rule(counters_only.clone(), "counter-set-name", |s| {
        s.shared_counters.as_mut().unwrap()[0].name = "gpu.0".into();
    });
    expect_rule(counters_only.clone(), "too-many-counters", |s| {
        let c = &mut s.shared_counters.as_mut().unwrap()[0].counters;
        for i in 0..20 {
            c.insert(
                format!("extra-{i}"),
                Counter {
                    value: Quantity("1".into()),
                },
            );
        }
    });
    expect_rule(counters_only.clone(), "too-many-counters", |s| {
        s.shared_counters.as_mut().unwrap()[0].counters.clear();
    });
    expect_rule(counters_only.clone(), "counter-name", |s| {
        s.shared_counters.as_mut().unwrap()[0].counters.insert(
            "memory_slice".into(),
            Counter {
                value: Quantity("1".into()),
            },
        );
    });
    expect_rule(counters_only, "quantity", |s| {
        s.shared_counters.as_mut().unwrap()[0].counters.insert(
            "extra".into(),
            Counter {
                value: Quantity("lots".into()),
            },
        );
    });
    // 1.34 layout: at most 32 counters across the sets of a slice with devices, though 1.35
    // would accept each set alone.
    expect_rule(valid_together(), "too-many-counters", |s| {
        let mut extra = s.shared_counters.as_ref().unwrap()[0].clone();
        extra.name = "spare".into();
        extra.counters.extend((0..10).map(|i| {
            (
                format!("x-{i}"),
                Counter {
                    value: Quantity("1".into()),
                },
            )
        }));
        s.shared_counters.as_mut().unwrap().push(extra);
    });
}

#[test]
fn rule_taints_and_binding_conditions() {
    let taint = |key: &str, effect: &str| DeviceTaint {
        key: key.into(),
        value: None,
        effect: effect.into(),
        time_added: None,
    };
    let mut ok = valid_spec();
    first_device(&mut ok).taints = Some(vec![taint("gpu.nvidia.com/xid", "NoSchedule")]);
    assert!(validate(&ok).is_empty());
    expect_rule(valid_spec(), "too-many-taints", |s| {
        first_device(s).taints = Some((0..17).map(|i| taint(&format!("k{i}"), "None")).collect());
    });
    expect_rule(valid_spec(), "taint", |s| {
        first_device(s).taints = Some(vec![taint("gpu.nvidia.com/xid", "Evict")]);
    });
    expect_rule(valid_spec(), "taint", |s| {
        first_device(s).taints = Some(vec![taint("bad key!", "NoSchedule")]);
    });
    expect_rule(valid_spec(), "taint", |s| {
        let mut t = taint("gpu.nvidia.com/xid", "NoSchedule");
        t.value = Some("-79".into());
        first_device(s).taints = Some(vec![t]);
    });
    expect_rule(valid_spec(), "binding-conditions", |s| {
        first_device(s).binding_conditions = Some((0..5).map(|i| format!("c{i}")).collect());
    });
}

#[test]
fn rule_per_device_node_selection() {
    expect_rule(valid_spec(), "per-device-node-selection", |s| {
        first_device(s).node_name = Some("node-a".into());
    });
    expect_rule(valid_spec(), "per-device-node-selection", |s| {
        s.node_name = None;
        s.per_device_node_selection = Some(true);
        for d in s.devices.as_mut().unwrap().iter_mut().skip(1) {
            d.all_nodes = Some(true);
        }
    });
}

#[test]
fn pool_rules() {
    let good =
        desired_slices(&mig_ready("dgx-a100"), &opts(true, CounterLayout::Separate)).unwrap();
    assert!(validate_pool(&good).is_empty());
    let expect = |id: &str, mutate: &dyn Fn(&mut Vec<ResourceSliceSpec>)| {
        let mut specs = good.clone();
        mutate(&mut specs);
        let v = validate_pool(&specs);
        assert_eq!(rule_ids(&v), BTreeSet::from([id.to_string()]), "{v:?}");
    };
    expect("pool-mismatch", &|s| s[3].pool.generation = 4);
    expect("pool-mismatch", &|s| {
        s[3].driver = "other.example.com".into()
    });
    expect("pool-slice-count", &|s| {
        for x in s.iter_mut() {
            x.pool.resource_slice_count = 8;
        }
    });
    expect("duplicate-device", &|s| {
        let d = s[1].devices.as_ref().unwrap()[0].clone();
        s[2].devices.as_mut().unwrap().push(d);
    });
    expect("duplicate-counter-set", &|s| {
        let set = s[0].shared_counters.as_ref().unwrap()[0].clone();
        s.push(ResourceSliceSpec {
            shared_counters: Some(vec![set]),
            ..s[0].clone()
        });
        let n = s.len() as i64;
        for x in s.iter_mut() {
            x.pool.resource_slice_count = n;
        }
    });
    expect("unknown-counter-set", &|s| {
        s[1].devices.as_mut().unwrap()[0]
            .consumes_counters
            .as_mut()
            .unwrap()[0]
            .counter_set = "gpu-9-counter-set".into();
    });
    expect("unknown-counter", &|s| {
        s[1].devices.as_mut().unwrap()[0]
            .consumes_counters
            .as_mut()
            .unwrap()[0]
            .counters
            .insert(
                "encoders".into(),
                Counter {
                    value: Quantity("1".into()),
                },
            );
    });
    expect("counter-exceeded", &|s| {
        s[1].devices.as_mut().unwrap()[0]
            .consumes_counters
            .as_mut()
            .unwrap()[0]
            .counters
            .insert(
                "memory".into(),
                Counter {
                    value: Quantity("81Gi".into()),
                },
            );
    });
}
