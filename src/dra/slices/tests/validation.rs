//! Validation tests: one violation per rule.

use super::*;

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
