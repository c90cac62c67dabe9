//! The rules without a real driver's slices: names, device limits, the 1.34 layout, and which
//! rules the API server shares. (nvdra's tests check every rule on its GPUs' slices.)

use super::*;
use k8s_openapi::api::resource::v1::{
    Counter, CounterSet, DeviceCounterConsumption, DeviceTaint, ResourcePool,
};

fn device(name: &str) -> Device {
    Device {
        name: name.into(),
        ..Default::default()
    }
}

fn spec(devices: Vec<Device>) -> ResourceSliceSpec {
    ResourceSliceSpec {
        driver: "fpga.example.com".into(),
        node_name: Some("node-a".into()),
        pool: ResourcePool {
            name: "node-a".into(),
            generation: 0,
            resource_slice_count: 1,
        },
        devices: Some(devices),
        ..Default::default()
    }
}

fn ids(v: &[Violation]) -> Vec<&str> {
    v.iter().map(Violation::rule_id).collect()
}

#[test]
fn labels() {
    for ok in ["a", "gpu-0", "0", "a-b-c"] {
        assert!(is_dns_label(ok, 63), "{ok}");
    }
    for bad in ["", "-a", "a-", "A", "a.b", "a_b", "é"] {
        assert!(!is_dns_label(bad, 63), "{bad}");
    }
    assert!(is_dns_label(&"a".repeat(63), 63));
    assert!(!is_dns_label(&"a".repeat(64), 63));
    assert!(!is_dns_label("abcd", 3));
}

#[test]
fn subdomains() {
    for ok in ["gpu.nvidia.com", "node-a", "a.b-c.d"] {
        assert!(is_dns_subdomain(ok, 253), "{ok}");
    }
    for bad in ["", ".a", "a.", "a..b", "Gpu.nvidia.com", "a/b", "-a.b"] {
        assert!(!is_dns_subdomain(bad, 253), "{bad}");
    }
    let long_label = format!("{}.com", "a".repeat(64));
    assert!(!is_dns_subdomain(&long_label, 253));
    assert!(!is_dns_subdomain("a.b.c", 4));
}

#[test]
fn a_device_with_taints_or_counters_lowers_the_device_limit() {
    let many = |n: usize| {
        (0..n)
            .map(|i| device(&format!("fpga-{i}")))
            .collect::<Vec<_>>()
    };
    assert!(validate(&spec(many(MAX_DEVICES_PER_SLICE))).is_empty());
    assert_eq!(
        ids(&validate(&spec(many(MAX_DEVICES_PER_SLICE + 1)))),
        ["too-many-devices"]
    );
    let mut tainted = many(MAX_DEVICES_PER_SLICE_WITH_COUNTERS_OR_TAINTS + 1);
    tainted[0].taints = Some(vec![DeviceTaint {
        key: "fpga.example.com/broken".into(),
        effect: "NoSchedule".into(),
        ..Default::default()
    }]);
    assert!(has_counters_or_taints(&tainted[0]));
    let v = validate(&spec(tainted));
    assert_eq!(ids(&v), ["too-many-devices"]);
    assert!(v[0].rule.contains("at most 64"), "{}", v[0]);
}

#[test]
fn the_1_34_layout_needs_consumed_counters_in_the_same_slice() {
    let mut d = device("fpga-0");
    d.consumes_counters = Some(vec![DeviceCounterConsumption {
        counter_set: "fpga-0-counters".into(),
        counters: BTreeMap::from([(
            "lanes".to_string(),
            Counter {
                value: Quantity("2".into()),
            },
        )]),
    }]);
    let mut together = spec(vec![d]);
    together.shared_counters = Some(vec![CounterSet {
        name: "other".into(),
        counters: BTreeMap::from([(
            "lanes".to_string(),
            Counter {
                value: Quantity("4".into()),
            },
        )]),
    }]);
    assert_eq!(ids(&validate(&together)), ["unknown-counter-set"]);
    together.shared_counters.as_mut().unwrap()[0].name = "fpga-0-counters".into();
    assert!(validate(&together).is_empty());
    assert!(validate_pool(std::slice::from_ref(&together)).is_empty());
}

#[test]
fn stricter_rules_are_told_apart_from_the_servers() {
    let mut d = device("fpga-0");
    let text = |s: &str| DeviceAttribute {
        string: Some(s.into()),
        ..Default::default()
    };
    d.attributes = Some(BTreeMap::from([
        ("model".to_string(), text("x1")),
        ("fpga.example.com/model".to_string(), text("x1")),
    ]));
    let v = validate(&spec(vec![d]));
    assert_eq!(ids(&v), ["duplicate-attribute"]);
    assert!(!v[0].server_rejects());
    let v = validate(&spec(vec![device("FPGA 0")]));
    assert_eq!(ids(&v), ["device-name"]);
    assert!(v[0].server_rejects());
    assert_eq!(v[0].to_string(), format!("device FPGA 0: {}", v[0].rule));
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
