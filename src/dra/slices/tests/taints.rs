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
