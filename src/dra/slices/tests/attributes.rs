//! Attribute tests: types, fabric, unknown facts, versions as semver.

use super::*;

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
        ATTR_NUMA_NODE,
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
    assert_eq!(attr(d, ATTR_NUMA_NODE), &int(0));
    assert_eq!(attr(device(&specs, "gpu-7"), ATTR_NUMA_NODE), &int(1));
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
/// plain and in partitionable mode: an existing one (with its `uuid`) gives up the fabric
/// attributes for the room, and keeps both NUMA attributes.
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
        let devices = all_devices(&specs);
        let width = |d: &Device| {
            d.attributes.as_ref().map_or(0, BTreeMap::len)
                + d.capacity.as_ref().map_or(0, BTreeMap::len)
        };
        let widest = devices.iter().map(|d| width(d)).max().unwrap();
        // A placement not yet created (no `uuid`) keeps its fabric and is exactly at the limit;
        // the existing device would be one over with it, so it goes without.
        let want = if partitionable {
            MAX_ATTRIBUTES_AND_CAPACITIES
        } else {
            MAX_ATTRIBUTES_AND_CAPACITIES - 1
        };
        assert_eq!(widest, want, "partitionable={partitionable}");
        if !partitionable {
            let d = devices.iter().find(|d| d.name.contains("-mig-7g")).unwrap();
            let attrs = d.attributes.as_ref().unwrap();
            assert!(attrs.contains_key("uuid"));
            assert!(
                !attrs.contains_key(ATTR_FABRIC_CLIQUE_ID)
                    && !attrs.contains_key(ATTR_FABRIC_CLUSTER_UUID)
            );
        }
        for d in &devices {
            let attrs = d.attributes.as_ref().unwrap();
            assert!(
                attrs.contains_key("numaNode") && attrs.contains_key(ATTR_NUMA_NODE),
                "{}",
                d.name
            );
        }
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
