//! MIG without partitioning, health, determinism and pool bookkeeping.

use super::*;

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
