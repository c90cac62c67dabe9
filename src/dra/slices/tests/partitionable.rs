//! Partitionable tests: shared counters, layouts and counter set limits.

use super::*;

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
