//! `--shared-capacity`: the shareable twin of every whole GPU, its consumable capacities and the
//! counters that keep it and the whole GPU apart.

use super::*;
use crate::inventory::{TaintEffect, TaintKey};

fn policy(d: &Device, name: &str) -> (String, String, String, String, String) {
    let c = &d.capacity.as_ref().unwrap()[name];
    let p = c.request_policy.as_ref().expect("a request policy");
    let r = p.valid_range.as_ref().expect("a range");
    (
        c.value.0.clone(),
        p.default.as_ref().unwrap().0.clone(),
        r.min.0.clone(),
        r.max.as_ref().unwrap().0.clone(),
        r.step.as_ref().unwrap().0.clone(),
    )
}

#[test]
fn every_whole_gpu_gets_a_shareable_twin_drawing_on_the_same_counters() {
    let inv = profile("dgx-h100");
    let specs = desired_slices(&inv, &shared(false)).unwrap();
    let devices = all_devices(&specs);
    assert_eq!(devices.len(), 16, "{:?}", names(&specs));
    for g in &inv.gpus {
        let whole = device(&specs, &format!("gpu-{}", g.minor));
        let twin = device(&specs, &format!("gpu-{}-shared", g.minor));
        assert_eq!(twin.allow_multiple_allocations, Some(true));
        assert_eq!(whole.allow_multiple_allocations, None);
        // The whole GPU's attributes, but typed so that `type == 'gpu'` never picks a share.
        let mut expected = whole.attributes.clone().unwrap();
        expected.insert("type".into(), s("gpu-shared"));
        expected.insert("shared".into(), boolean(true));
        assert_eq!(twin.attributes.as_ref().unwrap(), &expected);
        let memory = cap(whole, "memory");
        assert_eq!(memory, "80Gi");
        assert_eq!(
            policy(twin, "memory"),
            (
                memory.clone(),
                "1Gi".into(),
                "1Gi".into(),
                "80Gi".into(),
                "1Gi".into()
            )
        );
        assert_eq!(
            policy(twin, "compute"),
            (
                "100".into(),
                "100".into(),
                "1".into(),
                "100".into(),
                "1".into()
            )
        );
        assert_eq!(twin.capacity.as_ref().unwrap().len(), 2);
        let set = format!("gpu-{}-counter-set", g.minor);
        let want = BTreeMap::from([((set.clone(), "memory".to_string()), memory.clone())]);
        assert_eq!(consumed(whole), want);
        assert_eq!(consumed(twin), want);
        let sets: Vec<&CounterSet> = specs
            .iter()
            .flat_map(|s| s.shared_counters.iter().flatten())
            .filter(|c| c.name == set)
            .collect();
        assert_eq!(sets.len(), 1);
        assert_eq!(sets[0].counters["memory"].value.0, memory);
    }
}

#[test]
fn both_layouts_pass_the_api_rules() {
    let inv = profile("dgx-h100");
    // 1.35+: a counters-only slice, then the devices.
    let specs = desired_slices(&inv, &shared(false)).unwrap();
    assert!(specs[0].devices.is_none() && specs[0].shared_counters.is_some());
    // 1.34: each GPU's counters with its two devices.
    let together = SliceOptions {
        layout: CounterLayout::Together,
        ..shared(false)
    };
    let specs = desired_slices(&inv, &together).unwrap();
    assert_eq!(specs.len(), 8);
    for s in &specs {
        assert_eq!(s.devices.as_ref().unwrap().len(), 2);
        assert_eq!(s.shared_counters.as_ref().unwrap().len(), 1);
        assert!(validate(s).is_empty());
    }
    assert!(validate_pool(&specs).is_empty());
}

#[test]
fn gpus_in_mig_mode_are_not_shared_by_capacity() {
    let inv = profile("a100-mig-mixed");
    for partitionable in [false, true] {
        let specs = desired_slices(&inv, &shared(partitionable)).unwrap();
        let twins: Vec<String> = names(&specs)
            .into_iter()
            .filter(|n| n.ends_with("-shared"))
            .collect();
        let whole: Vec<u32> = inv
            .gpus
            .iter()
            .filter(|g| !g.in_mig_mode())
            .map(|g| g.minor)
            .collect();
        assert!(!whole.is_empty());
        assert_eq!(
            twins,
            whole
                .iter()
                .map(|m| format!("gpu-{m}-shared"))
                .collect::<Vec<_>>()
        );
    }
}

#[test]
fn an_unhealthy_gpu_taints_its_twin_too() {
    let mut inv = profile("dgx-h100");
    let plain_taint = {
        let mut sick = inv.clone();
        sick.gpus[2].health = super::taints::tainted(TaintKey::Xid(79), TaintEffect::NoSchedule);
        let specs = desired_slices(&sick, &plain()).unwrap();
        device(&specs, "gpu-2").taints.clone()
    };
    inv.gpus[2].health = super::taints::tainted(TaintKey::Xid(79), TaintEffect::NoSchedule);
    let specs = desired_slices(&inv, &shared(false)).unwrap();
    assert!(plain_taint.is_some());
    assert_eq!(device(&specs, "gpu-2").taints, plain_taint);
    assert_eq!(device(&specs, "gpu-2-shared").taints, plain_taint);
}

#[test]
fn the_rest_of_the_pool_is_as_without_the_switch() {
    // Switched on, the whole GPUs keep their attributes and capacities; only counters are new.
    let inv = profile("dgx-h100");
    let off = desired_slices(&inv, &plain()).unwrap();
    let on = desired_slices(&inv, &shared(false)).unwrap();
    for d in all_devices(&off) {
        let mut twin = device(&on, &d.name).clone();
        twin.consumes_counters = None;
        assert_eq!(&twin, d);
    }
}
