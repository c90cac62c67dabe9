//! Health in the slices: a GPU the monitor marked is published with its taint on every device
//! it carries; one marked unhealthy for good is not published.

use super::*;
use crate::inventory::{Taint, TaintEffect, TaintKey};

pub(super) fn tainted(key: TaintKey, effect: TaintEffect) -> Health {
    Health::Tainted {
        reason: "test".into(),
        taint: Taint { key, effect },
    }
}

/// Device name → its taints as `key=value:effect`.
fn taint_map(specs: &[ResourceSliceSpec]) -> BTreeMap<String, Vec<String>> {
    all_devices(specs)
        .into_iter()
        .map(|d| {
            let t = d
                .taints
                .iter()
                .flatten()
                .map(|t: &DeviceTaint| {
                    assert!(t.time_added.is_none(), "timeAdded is the server's");
                    format!(
                        "{}={}:{}",
                        t.key,
                        t.value.as_deref().unwrap_or(""),
                        t.effect
                    )
                })
                .collect();
            (d.name.clone(), t)
        })
        .collect()
}

#[test]
fn a_monitored_failure_taints_every_device_of_its_gpu_and_nothing_else() {
    let mut inv = profile("a100-mig-mixed");
    inv.gpus[0].health = tainted(TaintKey::Xid(79), TaintEffect::NoExecute);
    inv.gpus[2].health = tainted(TaintKey::GpuLost, TaintEffect::NoSchedule);
    let specs = desired_slices(&inv, &plain()).unwrap();
    let map = taint_map(&specs);
    let healthy = desired_slices(&profile("a100-mig-mixed"), &plain()).unwrap();
    assert_eq!(
        map.keys().collect::<Vec<_>>(),
        taint_map(&healthy).keys().collect::<Vec<_>>(),
        "nothing withdrawn"
    );
    for (name, t) in &map {
        let want: Vec<String> = if name == "gpu-0" {
            vec!["gpu.nvidia.com/xid=79:NoExecute".into()]
        } else if name.starts_with("gpu-2-mig-") {
            vec!["gpu.nvidia.com/gpu-lost=:NoSchedule".into()]
        } else {
            vec![]
        };
        assert_eq!(t, &want, "{name}");
    }
    // Tainted devices count as advanced: at most 64 per slice.
    assert!(
        specs
            .iter()
            .all(|s| s.devices.as_ref().map_or(0, Vec::len) <= 64)
    );
}

#[test]
fn partitionable_placements_of_a_tainted_gpu_carry_its_taint() {
    let mut inv = mig_ready("dgx-a100-mig");
    inv.gpus[3].health = tainted(TaintKey::Xid(48), TaintEffect::NoSchedule);
    let specs = desired_slices(&inv, &opts(true, CounterLayout::Separate)).unwrap();
    let map = taint_map(&specs);
    let gpu3: Vec<_> = map
        .iter()
        .filter(|(n, _)| n.starts_with("gpu-3-"))
        .collect();
    assert_eq!(gpu3.len(), 25);
    assert!(
        gpu3.iter()
            .all(|(_, t)| t.as_slice() == ["gpu.nvidia.com/xid=48:NoSchedule"])
    );
    assert!(
        map.iter()
            .filter(|(n, _)| !n.starts_with("gpu-3-"))
            .all(|(_, t)| t.is_empty())
    );
}

#[test]
fn a_gpu_unhealthy_for_good_is_still_withdrawn() {
    let mut inv = profile("dgx-h100");
    inv.gpus[3].health = Health::Unhealthy {
        reason: "broken".into(),
    };
    let map = taint_map(&desired_slices(&inv, &plain()).unwrap());
    assert!(!map.contains_key("gpu-3"));
    assert_eq!(map.len(), 7);
}

/// A dynamic-MIG H100 (GPU 0) in MIG mode with a 3g.40gb instance on memory slices 0..4, which
/// the health monitor tainted (an XID in that instance), and a 1g.10gb instance on slice 6.
fn one_instance_tainted() -> Inventory {
    let mut inv = profile("dgx-h100");
    let g = &mut inv.gpus[0];
    g.mig.enabled = true;
    let instance = |name: &str, start: u32, gi_id: u32| {
        let p = g.mig.profiles.iter().find(|p| p.name == name).unwrap();
        let placement = *p.placements.iter().find(|pl| pl.start == start).unwrap();
        MigDevice {
            uuid: MigUuid(format!("MIG-{name}-{start}")),
            profile: p.name.clone(),
            gi_profile_id: p.gi_profile_id,
            gi_id,
            ci_id: 0,
            placement,
            memory_bytes: p.memory_bytes,
            multiprocessors: p.multiprocessors,
            engines: p.engines,
            health: Health::Healthy,
        }
    };
    let mut sick = instance("3g.40gb", 0, 1);
    sick.health = tainted(TaintKey::Xid(94), TaintEffect::NoSchedule);
    let well = instance("1g.10gb", 6, 2);
    g.mig.devices = vec![sick, well];
    inv
}

/// The fault of one MIG instance, as the slices show it, with dynamic MIG and in partitionable
/// mode alike: that MIG device tainted; the other instance, the placements on other memory
/// slices and the other GPUs clean. A GPU-wide fault then taints every device of the GPU.
#[test]
fn a_tainted_mig_instance_taints_its_device_alone() {
    let dynamic = SliceOptions {
        dynamic_mig: true,
        ..plain()
    };
    let partitionable = opts(true, CounterLayout::Separate);
    for (mode, options) in [("dynamic", &dynamic), ("partitionable", &partitionable)] {
        let mut inv = one_instance_tainted();
        let map = taint_map(&desired_slices(&inv, options).unwrap());
        let x94 = ["gpu.nvidia.com/xid=94:NoSchedule".to_string()];
        assert_eq!(map["gpu-0-mig-3g40gb-9-0"], x94, "{mode}");
        assert!(map["gpu-0-mig-1g10gb-19-6"].is_empty(), "{mode}");
        let placements: Vec<&String> = map
            .keys()
            .filter(|n| {
                n.starts_with("gpu-0-mig-") && !n.ends_with("-9-0") && !n.ends_with("-19-6")
            })
            .collect();
        assert!(
            !placements.is_empty(),
            "{mode}: free placements on slices 4.."
        );
        for (name, t) in &map {
            if name != "gpu-0-mig-3g40gb-9-0" {
                assert!(t.is_empty(), "{mode}: {name}: {t:?}");
            }
        }
        assert!(
            !map.contains_key("gpu-0"),
            "{mode}: not whole beside instances"
        );

        inv.gpus[0].health = tainted(TaintKey::Xid(79), TaintEffect::NoSchedule);
        let map = taint_map(&desired_slices(&inv, options).unwrap());
        for (name, t) in &map {
            let want: &[&str] = if name.starts_with("gpu-0-") {
                &["gpu.nvidia.com/xid=79:NoSchedule"]
            } else {
                &[]
            };
            assert_eq!(t, want, "{mode}: {name}");
        }
    }
}

/// The rule the slices apply to every device of a counter group: a placement overlapping a
/// tainted instance, and the whole GPU (which overlaps every instance), carry its health; a
/// placement on other memory slices and the healthy instance do not.
#[test]
fn devices_on_a_tainted_instances_memory_slices_carry_its_taint() {
    let inv = one_instance_tainted();
    let g = &inv.gpus[0];
    let health = |name: &str| {
        let d = Device {
            name: name.into(),
            ..Default::default()
        };
        super::super::splitting::group_health(g, &d).clone()
    };
    let sick = &g.mig.devices[0].health;
    assert_eq!(&health("gpu-0-mig-3g40gb-9-0"), sick, "the instance itself");
    assert_eq!(
        &health("gpu-0-mig-1g10gb-19-3"),
        sick,
        "a placement on slice 3"
    );
    assert_eq!(&health("gpu-0"), sick, "the whole GPU");
    assert!(health("gpu-0-mig-1g10gb-19-4").is_healthy(), "slice 4");
    assert!(
        health("gpu-0-mig-1g10gb-19-6").is_healthy(),
        "the other instance"
    );
    assert!(health("gpu-0-mig-3g40gb-9-4").is_healthy(), "slices 4..8");
}
