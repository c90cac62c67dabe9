use super::*;
use k8s_openapi::api::resource::v1::{
    CounterSet, Device, DeviceAttribute, DeviceCapacity, DeviceCounterConsumption, DeviceTaint,
    ResourcePool,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use proptest::prelude::*;

const DRIVER: &str = "gpu.nvidia.com";
const NODE: &str = "node-a";

fn device(name: &str, memory: &str) -> Device {
    Device {
        name: name.into(),
        attributes: Some(BTreeMap::from([(
            "type".to_string(),
            DeviceAttribute {
                string: Some("gpu".into()),
                ..Default::default()
            },
        )])),
        capacity: Some(BTreeMap::from([(
            "memory".to_string(),
            DeviceCapacity {
                value: Quantity(memory.into()),
                request_policy: None,
            },
        )])),
        ..Default::default()
    }
}

fn spec(devices: &[&str]) -> ResourceSliceSpec {
    ResourceSliceSpec {
        driver: DRIVER.into(),
        node_name: Some(NODE.into()),
        pool: ResourcePool {
            name: NODE.into(),
            generation: 0,
            resource_slice_count: 0,
        },
        devices: Some(devices.iter().map(|d| device(d, "80Gi")).collect()),
        ..Default::default()
    }
}

/// A stored slice as the server would return it.
fn stored(name: &str, mut spec: ResourceSliceSpec, generation: i64, count: i64) -> ResourceSlice {
    spec.pool.generation = generation;
    spec.pool.resource_slice_count = count;
    ResourceSlice {
        metadata: ObjectMeta {
            name: Some(name.into()),
            resource_version: Some(format!("rv-{name}")),
            ..Default::default()
        },
        spec,
    }
}

fn owner() -> OwnerReference {
    OwnerReference {
        api_version: "v1".into(),
        kind: "Node".into(),
        name: NODE.into(),
        uid: "node-uid".into(),
        controller: Some(true),
        block_owner_deletion: None,
    }
}

struct Ctx {
    written: HashMap<String, Written>,
    dropped: BTreeSet<FieldPath>,
    owner: Option<OwnerReference>,
}

impl Ctx {
    fn new() -> Self {
        Ctx {
            written: HashMap::new(),
            dropped: BTreeSet::new(),
            owner: None,
        }
    }

    fn plan(&self, desired: &[ResourceSliceSpec], existing: &[ResourceSlice]) -> Plan {
        plan(&Inputs {
            driver: DRIVER,
            node: NODE,
            desired,
            existing,
            owner: self.owner.as_ref(),
            written: &self.written,
            dropped: &self.dropped,
        })
    }
}

fn gens(slices: &[ResourceSlice]) -> Vec<(i64, i64)> {
    slices
        .iter()
        .map(|s| (s.spec.pool.generation, s.spec.pool.resource_slice_count))
        .collect()
}

#[test]
fn a_new_pool_is_created_at_generation_one_with_generate_name_and_owner() {
    let mut ctx = Ctx::new();
    ctx.owner = Some(owner());
    let p = ctx.plan(&[spec(&["gpu-0"]), spec(&["gpu-1"])], &[]);
    assert!(p.updates.is_empty() && p.deletes.is_empty());
    assert_eq!(gens(&p.creates), vec![(1, 2), (1, 2)]);
    for c in &p.creates {
        assert_eq!(
            c.metadata.generate_name.as_deref(),
            Some("node-a-gpu.nvidia.com-")
        );
        assert_eq!(c.metadata.name, None);
        assert_eq!(c.metadata.owner_references, Some(vec![owner()]));
    }
}

#[test]
fn a_matching_pool_needs_no_writes() {
    let ctx = Ctx::new();
    let existing = [
        stored("s1", spec(&["gpu-1"]), 7, 2),
        stored("s0", spec(&["gpu-0"]), 7, 2),
    ];
    let p = ctx.plan(&[spec(&["gpu-0"]), spec(&["gpu-1"])], &existing);
    assert!(p.is_empty(), "{p:?}");
}

#[test]
fn one_changed_device_bumps_the_generation_of_every_slice_in_place() {
    let ctx = Ctx::new();
    let existing = [
        stored("s0", spec(&["gpu-0"]), 7, 2),
        stored("s1", spec(&["gpu-1"]), 7, 2),
    ];
    let mut changed = spec(&["gpu-1"]);
    changed.devices.as_mut().unwrap()[0] = device("gpu-1", "40Gi");
    let p = ctx.plan(&[spec(&["gpu-0"]), changed], &existing);
    assert!(p.creates.is_empty() && p.deletes.is_empty(), "{p:?}");
    assert_eq!(gens(&p.updates), vec![(8, 2), (8, 2)]);
    let names: Vec<_> = p.updates.iter().map(name).collect();
    assert_eq!(names, ["s0", "s1"]);
    // Updates carry the stored resourceVersion, so a concurrent change is a conflict.
    assert_eq!(
        p.updates[1].metadata.resource_version.as_deref(),
        Some("rv-s1")
    );
}

#[test]
fn a_new_slice_is_created_and_existing_ones_bumped_with_the_new_count() {
    let ctx = Ctx::new();
    let existing = [
        stored("s0", spec(&["gpu-0"]), 2, 2),
        stored("s1", spec(&["gpu-1"]), 2, 2),
    ];
    let p = ctx.plan(
        &[spec(&["gpu-0"]), spec(&["gpu-1"]), spec(&["gpu-2"])],
        &existing,
    );
    assert_eq!(gens(&p.updates), vec![(3, 3), (3, 3)]);
    assert_eq!(gens(&p.creates), vec![(3, 3)]);
    assert!(p.deletes.is_empty());
}

#[test]
fn older_generations_are_deleted_without_a_bump() {
    let ctx = Ctx::new();
    let existing = [
        stored("old", spec(&["gpu-9"]), 3, 1),
        stored("cur", spec(&["gpu-0"]), 4, 1),
    ];
    let p = ctx.plan(&[spec(&["gpu-0"])], &existing);
    assert_eq!(
        p,
        Plan {
            deletes: vec!["old".into()],
            ..Default::default()
        }
    );
}

#[test]
fn a_slice_no_longer_desired_is_deleted_and_the_rest_bumped() {
    let ctx = Ctx::new();
    let existing = [
        stored("s0", spec(&["gpu-0"]), 2, 2),
        stored("s1", spec(&["gpu-1"]), 2, 2),
    ];
    let p = ctx.plan(&[spec(&["gpu-0"])], &existing);
    assert_eq!(gens(&p.updates), vec![(3, 1)]);
    assert_eq!(name(&p.updates[0]), "s0");
    assert_eq!(p.deletes, vec!["s1".to_string()]);
}

#[test]
fn one_slice_each_side_pairs_up_even_with_different_devices() {
    let ctx = Ctx::new();
    let existing = [stored("s0", spec(&["gpu-0"]), 5, 1)];
    let p = ctx.plan(&[spec(&["gpu-0", "gpu-1"])], &existing);
    assert!(p.creates.is_empty() && p.deletes.is_empty());
    assert_eq!(name(&p.updates[0]), "s0");
    assert_eq!(gens(&p.updates), vec![(6, 1)]);
}

#[test]
fn device_sets_decide_matching_and_a_single_leftover_pair_is_reused() {
    let ctx = Ctx::new();
    let existing = [
        stored("a", spec(&["gpu-0"]), 1, 2),
        stored("b", spec(&["gpu-1"]), 1, 2),
    ];
    let p = ctx.plan(&[spec(&["gpu-1"]), spec(&["gpu-2"])], &existing);
    // gpu-1 stays in b; the one leftover on each side (a, gpu-2) pair up.
    let held: Vec<(String, Vec<&str>)> = p
        .updates
        .iter()
        .map(|s| (name(s), device_names(&s.spec).into_iter().collect()))
        .collect();
    assert_eq!(
        held,
        [
            ("b".to_string(), vec!["gpu-1"]),
            ("a".to_string(), vec!["gpu-2"])
        ]
    );
    assert!(p.creates.is_empty() && p.deletes.is_empty());
}

#[test]
fn several_leftovers_are_created_and_deleted_not_guessed() {
    let ctx = Ctx::new();
    let existing = [
        stored("a", spec(&["gpu-0"]), 1, 3),
        stored("b", spec(&["gpu-1"]), 1, 3),
        stored("c", spec(&["gpu-5"]), 1, 3),
    ];
    let p = ctx.plan(
        &[spec(&["gpu-5"]), spec(&["gpu-2"]), spec(&["gpu-3"])],
        &existing,
    );
    assert_eq!(p.updates.len(), 1);
    assert_eq!(name(&p.updates[0]), "c");
    assert_eq!(gens(&p.creates), vec![(2, 3), (2, 3)]);
    assert_eq!(p.deletes, vec!["a".to_string(), "b".to_string()]);
}

#[test]
fn pools_that_are_no_longer_desired_are_deleted() {
    let ctx = Ctx::new();
    let mut other = spec(&["gpu-0"]);
    other.pool.name = "old-pool".into();
    let existing = [
        stored("x", other, 9, 1),
        stored("s0", spec(&["gpu-0"]), 1, 1),
    ];
    let p = ctx.plan(&[spec(&["gpu-0"])], &existing);
    assert_eq!(p.deletes, vec!["x".to_string()]);
    assert!(p.updates.is_empty() && p.creates.is_empty());
}

#[test]
fn empty_and_absent_values_compare_equal() {
    let ctx = Ctx::new();
    let mut want = spec(&["gpu-0"]);
    want.shared_counters = Some(vec![]);
    want.devices.as_mut().unwrap()[0].taints = Some(vec![]);
    let existing = [stored("s0", spec(&["gpu-0"]), 1, 1)];
    assert!(ctx.plan(&[want], &existing).is_empty());
}

#[test]
fn fields_the_server_drops_do_not_cause_updates() {
    let mut ctx = Ctx::new();
    let mut want = spec(&["gpu-0"]);
    want.devices.as_mut().unwrap()[0].taints = Some(vec![DeviceTaint {
        key: "gpu.nvidia.com/xid".into(),
        value: Some("79".into()),
        effect: "NoSchedule".into(),
        time_added: None,
    }]);
    let existing = [stored("s0", spec(&["gpu-0"]), 1, 1)];
    assert_eq!(
        ctx.plan(std::slice::from_ref(&want), &existing)
            .updates
            .len(),
        1
    );
    ctx.dropped = dropped_fields(
        &normalized_spec(&with_pool(&want, 1, 1)),
        &normalized_spec(&existing[0].spec),
    );
    assert!(ctx.plan(&[want], &existing).is_empty());
}

#[test]
fn taint_time_added_set_by_the_server_is_kept() {
    let ctx = Ctx::new();
    let taint = |t: Option<Time>| DeviceTaint {
        key: "k".into(),
        value: None,
        effect: "NoExecute".into(),
        time_added: t,
    };
    let time = Time(k8s_openapi::jiff::Timestamp::from_second(1_700_000_000).unwrap());
    let mut have = spec(&["gpu-0", "gpu-1"]);
    have.devices.as_mut().unwrap()[0].taints = Some(vec![taint(Some(time.clone()))]);
    let mut want = spec(&["gpu-0", "gpu-1"]);
    want.devices.as_mut().unwrap()[0].taints = Some(vec![taint(None)]);
    let existing = [stored("s0", have, 1, 1)];
    assert!(ctx.plan(std::slice::from_ref(&want), &existing).is_empty());

    // A real change elsewhere: the update keeps the time.
    want.devices.as_mut().unwrap()[1] = device("gpu-1", "1Gi");
    let p = ctx.plan(&[want], &existing);
    let taints = p.updates[0].spec.devices.as_ref().unwrap()[0]
        .taints
        .clone()
        .unwrap();
    assert_eq!(taints, vec![taint(Some(time))]);
}

#[test]
fn our_own_write_matches_even_if_the_server_normalised_it() {
    let mut ctx = Ctx::new();
    let want = spec(&["gpu-0"]);
    // The server stored 80Gi as 81920Mi (a normalisation we cannot predict).
    let mut server = want.clone();
    server.devices.as_mut().unwrap()[0] = device("gpu-0", "81920Mi");
    let existing = [stored("s0", server, 1, 1)];
    assert_eq!(
        ctx.plan(std::slice::from_ref(&want), &existing)
            .updates
            .len(),
        1
    );
    ctx.written.insert(
        "s0".into(),
        Written {
            resource_version: "rv-s0".into(),
            sent: normalized_spec(&with_pool(&want, 1, 1)),
        },
    );
    assert!(ctx.plan(std::slice::from_ref(&want), &existing).is_empty());
    // Someone else wrote since (another resourceVersion): compare for real.
    ctx.written.get_mut("s0").unwrap().resource_version = "older".into();
    assert_eq!(ctx.plan(&[want], &existing).updates.len(), 1);
}

#[test]
fn a_missing_owner_reference_is_added_and_other_references_kept() {
    let mut ctx = Ctx::new();
    ctx.owner = Some(owner());
    let mut have = stored("s0", spec(&["gpu-0"]), 1, 1);
    let other = OwnerReference {
        api_version: "apps/v1".into(),
        kind: "DaemonSet".into(),
        name: "fpga-driver".into(),
        uid: "ds-uid".into(),
        controller: None,
        block_owner_deletion: None,
    };
    have.metadata.owner_references = Some(vec![other.clone()]);
    let p = ctx.plan(&[spec(&["gpu-0"])], &[have]);
    assert_eq!(
        p.updates[0].metadata.owner_references,
        Some(vec![other, owner()])
    );
}

#[test]
fn dropped_fields_are_named_by_path() {
    let mut sent = spec(&["gpu-0", "gpu-1"]);
    sent.shared_counters = Some(vec![CounterSet {
        name: "gpu-0-counters".into(),
        counters: BTreeMap::new(),
    }]);
    for d in sent.devices.as_mut().unwrap() {
        d.consumes_counters = Some(vec![DeviceCounterConsumption {
            counter_set: "gpu-0-counters".into(),
            counters: BTreeMap::new(),
        }]);
    }
    let got = spec(&["gpu-0", "gpu-1"]);
    let paths: Vec<String> = dropped_fields(&normalized_spec(&sent), &normalized_spec(&got))
        .iter()
        .map(|p| p.to_string())
        .collect();
    assert_eq!(
        paths,
        ["spec.devices[].consumesCounters", "spec.sharedCounters"]
    );
    let none = dropped_fields(&normalized_spec(&got), &normalized_spec(&got));
    assert!(none.is_empty());
    let p = dropped_fields(&normalized_spec(&sent), &normalized_spec(&got));
    assert_eq!(p.iter().next().unwrap().field(), "consumesCounters");
}

/// Applies a plan the way the API server would.
fn apply(existing: &[ResourceSlice], p: &Plan, next_id: &mut u32) -> Vec<ResourceSlice> {
    let mut out: Vec<ResourceSlice> = existing
        .iter()
        .filter(|s| !p.deletes.contains(&name(s)))
        .cloned()
        .collect();
    for u in &p.updates {
        let slot = out.iter_mut().find(|s| name(s) == name(u)).unwrap();
        *slot = u.clone();
        *next_id += 1;
        slot.metadata.resource_version = Some(next_id.to_string());
    }
    for c in &p.creates {
        let mut c = c.clone();
        *next_id += 1;
        c.metadata.name = Some(format!("gen-{next_id}"));
        c.metadata.resource_version = Some(next_id.to_string());
        out.push(c);
    }
    out
}

fn layout() -> impl Strategy<Value = Vec<ResourceSliceSpec>> {
    // Up to 5 slices of up to 4 devices each, device names unique across the pool.
    prop::collection::vec(prop::collection::btree_set(0u8..40, 0..4), 0..5).prop_map(|groups| {
        let mut seen = BTreeSet::new();
        groups
            .into_iter()
            .map(|g| {
                let names: Vec<String> = g
                    .into_iter()
                    .filter(|d| seen.insert(*d))
                    .map(|d| format!("gpu-{d}"))
                    .collect();
                let refs: Vec<&str> = names.iter().map(String::as_str).collect();
                spec(&refs)
            })
            .collect()
    })
}

proptest! {
    /// From any published layout to any other: one plan converges, the result is one complete
    /// generation holding exactly the desired devices, and planning again writes nothing.
    #[test]
    fn one_plan_converges_and_the_next_is_empty(before in layout(), after in layout()) {
        let ctx = Ctx::new();
        let mut id = 0;
        let first = apply(&[], &ctx.plan(&before, &[]), &mut id);
        let p = ctx.plan(&after, &first);
        let now = apply(&first, &p, &mut id);
        prop_assert_eq!(now.len(), after.len());
        let generations: BTreeSet<i64> = now.iter().map(|s| s.spec.pool.generation).collect();
        prop_assert!(generations.len() <= 1);
        for s in &now {
            prop_assert_eq!(s.spec.pool.resource_slice_count as usize, after.len());
        }
        let mut want: Vec<BTreeSet<&str>> = after.iter().map(device_names).collect();
        let mut have: Vec<BTreeSet<&str>> = now.iter().map(|s| device_names(&s.spec)).collect();
        want.sort();
        have.sort();
        prop_assert_eq!(want, have);
        prop_assert!(ctx.plan(&after, &now).is_empty());
        if before == after && !before.is_empty() {
            prop_assert!(p.is_empty());
        }
    }
}
