//! Splitting tests: per-slice device limits, and errors that name the device and the rule.

use super::*;

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
