use super::*;
use crate::publisher::Slice;
use k8s_openapi::api::core::v1::{NodeSelector, NodeSelectorRequirement, NodeSelectorTerm};
use k8s_openapi::api::resource::v1::{
    CounterSet, Device, DeviceAttribute, DeviceCapacity, DeviceCounterConsumption, DeviceTaint,
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

fn slice(devices: &[&str]) -> Slice {
    Slice {
        devices: devices.iter().map(|d| device(d, "80Gi")).collect(),
        ..Default::default()
    }
}

/// One node-local pool named after the node.
fn local(slices: Vec<Slice>) -> Resources {
    Resources::node_local(NODE, slices)
}

/// The spec slice `index` of `slices` is published with (node-local pool).
fn spec_of(slices: &[Slice], index: usize, generation: i64) -> ResourceSliceSpec {
    let pool = Pool {
        nodes: Nodes::ThisNode,
        slices: slices.to_vec(),
    };
    let (written, dropped) = (HashMap::new(), BTreeSet::new());
    let desired = Resources::default();
    let inp = Inputs {
        driver: DRIVER,
        node: NODE,
        desired: &desired,
        existing: &[],
        owner: None,
        written: &written,
        dropped: &dropped,
    };
    slice_spec(&inp, NODE, &pool, index, generation)
}

/// A stored slice as the server would return it: `name`, slice `index` of `slices` at
/// `generation`.
fn stored(name: &str, slices: &[Slice], index: usize, generation: i64) -> ResourceSlice {
    ResourceSlice {
        metadata: ObjectMeta {
            name: Some(name.into()),
            uid: Some(format!("uid-{name}")),
            resource_version: Some(format!("rv-{name}")),
            ..Default::default()
        },
        spec: spec_of(slices, index, generation),
    }
}

/// What the publisher names slice `i` of `count` (without the server's suffix).
fn named(i: usize, count: usize) -> String {
    format!("{}x1y2z", generate_name(i, count, DRIVER, NODE))
}

/// The whole pool `slices` as stored at `generation`, named by index.
fn published(slices: &[Slice], generation: i64) -> Vec<ResourceSlice> {
    (0..slices.len())
        .map(|i| stored(&named(i, slices.len()), slices, i, generation))
        .collect()
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

    fn plan(&self, desired: &Resources, existing: &[ResourceSlice]) -> Plan {
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

fn deleted(p: &Plan) -> Vec<&str> {
    p.deletes.iter().map(|d| d.name.as_str()).collect()
}

fn updated(p: &Plan) -> Vec<&str> {
    p.updates
        .iter()
        .map(|u| u.metadata.name.as_deref().unwrap())
        .collect()
}

#[test]
fn index_prefixes_are_five_hex_digits_or_as_many_as_the_highest_index_needs() {
    assert_eq!(index_width(0), 5);
    assert_eq!(index_width(1), 5);
    assert_eq!(index_width(0x10_0000), 5);
    assert_eq!(index_width(0x10_0001), 6);
    assert_eq!(
        generate_name(10, 11, DRIVER, NODE),
        "0000a-gpu.nvidia.com-node-a-"
    );
    assert_eq!(name_index("0000a-gpu.nvidia.com-node-a-x1y2z", 5), Some(10));
    // The old names, another width, no separator, not hex: no index.
    assert_eq!(name_index("node-a-gpu.nvidia.com-x1y2z", 5), None);
    assert_eq!(name_index("00000a-gpu.nvidia.com-node-a-x1y2z", 5), None);
    assert_eq!(name_index("0000a", 5), None);
    assert_eq!(name_index("0000g-x", 5), None);
    assert_eq!(name_index("0000", 5), None);
}

#[test]
fn a_new_pool_is_created_at_generation_one_named_by_index_with_owner() {
    let mut ctx = Ctx::new();
    ctx.owner = Some(owner());
    let p = ctx.plan(&local(vec![slice(&["gpu-0"]), slice(&["gpu-1"])]), &[]);
    assert!(p.updates.is_empty() && p.deletes.is_empty() && p.invalid.is_empty());
    assert_eq!(gens(&p.creates), vec![(1, 2), (1, 2)]);
    let names: Vec<&str> = p
        .creates
        .iter()
        .map(|c| c.metadata.generate_name.as_deref().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "00000-gpu.nvidia.com-node-a-",
            "00001-gpu.nvidia.com-node-a-"
        ]
    );
    for (i, c) in p.creates.iter().enumerate() {
        assert_eq!(c.metadata.name, None);
        assert_eq!(c.metadata.owner_references, Some(vec![owner()]));
        assert_eq!(c.spec.driver, DRIVER);
        assert_eq!(c.spec.node_name.as_deref(), Some(NODE));
        assert_eq!(c.spec.pool.name, NODE);
        assert_eq!(device_names(&c.spec), [format!("gpu-{i}")]);
    }
}

fn device_names(spec: &ResourceSliceSpec) -> Vec<String> {
    spec.devices
        .iter()
        .flatten()
        .map(|d| d.name.clone())
        .collect()
}

#[test]
fn a_matching_pool_needs_no_writes() {
    let ctx = Ctx::new();
    let want = vec![slice(&["gpu-0"]), slice(&["gpu-1"])];
    let mut existing = published(&want, 7);
    existing.reverse();
    assert_eq!(ctx.plan(&local(want), &existing), Plan::default());
}

#[test]
fn one_changed_slice_is_one_update_and_keeps_the_generation() {
    let ctx = Ctx::new();
    let before = vec![slice(&["gpu-0"]), slice(&["gpu-1"]), slice(&["gpu-2"])];
    let existing = published(&before, 3);
    let mut after = before.clone();
    after[1].devices[0] = device("gpu-1", "40Gi");
    let p = ctx.plan(&local(after), &existing);
    assert!(p.creates.is_empty() && p.deletes.is_empty());
    assert_eq!(updated(&p), [named(1, 3)]);
    assert_eq!(gens(&p.updates), vec![(3, 3)]);
}

#[test]
fn two_changed_slices_bump_the_generation_of_every_slice_in_place() {
    let ctx = Ctx::new();
    let before = vec![slice(&["gpu-0"]), slice(&["gpu-1"]), slice(&["gpu-2"])];
    let existing = published(&before, 3);
    let mut after = before.clone();
    after[0].devices[0] = device("gpu-0", "40Gi");
    after[2].devices[0] = device("gpu-2", "40Gi");
    let p = ctx.plan(&local(after), &existing);
    assert!(p.creates.is_empty() && p.deletes.is_empty());
    assert_eq!(updated(&p), [named(0, 3), named(1, 3), named(2, 3)]);
    assert_eq!(gens(&p.updates), vec![(4, 3); 3]);
}

#[test]
fn a_new_slice_is_created_and_existing_ones_bumped_with_the_new_count() {
    let ctx = Ctx::new();
    let before = vec![slice(&["gpu-0"])];
    let existing = published(&before, 1);
    let p = ctx.plan(
        &local(vec![slice(&["gpu-0"]), slice(&["gpu-1"])]),
        &existing,
    );
    assert_eq!(gens(&p.updates), vec![(2, 2)]);
    assert_eq!(gens(&p.creates), vec![(2, 2)]);
    assert_eq!(
        p.creates[0].metadata.generate_name.as_deref(),
        Some("00001-gpu.nvidia.com-node-a-")
    );
    assert!(p.deletes.is_empty());
}

#[test]
fn older_generations_are_deleted_first_with_preconditions_without_a_bump() {
    let ctx = Ctx::new();
    let want = vec![slice(&["gpu-0"])];
    let mut existing = published(&want, 2);
    existing.push(stored("00000-old", &want, 0, 1));
    let p = ctx.plan(&local(want), &existing);
    assert_eq!(
        p,
        Plan {
            deletes: vec![Obsolete {
                name: "00000-old".into(),
                preconditions: Preconditions {
                    uid: Some("uid-00000-old".into()),
                    resource_version: Some("rv-00000-old".into()),
                },
            }],
            ..Plan::default()
        }
    );
}

#[test]
fn a_slice_no_longer_desired_is_deleted_and_the_rest_updated_with_the_new_count() {
    let ctx = Ctx::new();
    let before = vec![slice(&["gpu-0"]), slice(&["gpu-1"]), slice(&["gpu-2"])];
    let existing = published(&before, 1);
    let p = ctx.plan(&local(before[..2].to_vec()), &existing);
    assert_eq!(deleted(&p), [named(2, 3)]);
    // Both remaining slices change (the count): two updates, a new generation.
    assert_eq!(gens(&p.updates), vec![(2, 2), (2, 2)]);
    assert!(p.creates.is_empty());
}

#[test]
fn reordered_slices_are_rewritten_in_place_so_names_follow_the_new_order() {
    let ctx = Ctx::new();
    let before = vec![slice(&["gpu-0"]), slice(&["gpu-1"])];
    let existing = published(&before, 1);
    let p = ctx.plan(
        &local(vec![slice(&["gpu-1"]), slice(&["gpu-0"])]),
        &existing,
    );
    assert_eq!(updated(&p), [named(0, 2), named(1, 2)]);
    assert_eq!(device_names(&p.updates[0].spec), ["gpu-1"]);
    assert_eq!(device_names(&p.updates[1].spec), ["gpu-0"]);
    assert_eq!(gens(&p.updates), vec![(2, 2), (2, 2)]);
}

#[test]
fn slices_without_an_index_or_with_a_taken_or_too_high_one_are_replaced() {
    let ctx = Ctx::new();
    let want = vec![slice(&["gpu-0"]), slice(&["gpu-1"])];
    let existing = vec![
        // The names before index prefixes: obsolete, and recreated under new names.
        stored("node-a-gpu.nvidia.com-abcde", &want, 0, 1),
        stored("00001-gpu.nvidia.com-node-a-aaaaa", &want, 1, 1),
        stored("00001-gpu.nvidia.com-node-a-bbbbb", &want, 1, 1),
        stored("00002-gpu.nvidia.com-node-a-ccccc", &want, 1, 1),
    ];
    let p = ctx.plan(&local(want), &existing);
    assert_eq!(
        deleted(&p),
        [
            "node-a-gpu.nvidia.com-abcde",
            "00001-gpu.nvidia.com-node-a-bbbbb",
            "00002-gpu.nvidia.com-node-a-ccccc"
        ]
    );
    assert_eq!(
        p.creates[0].metadata.generate_name.as_deref(),
        Some("00000-gpu.nvidia.com-node-a-")
    );
    assert_eq!(gens(&p.creates), vec![(2, 2)]);
    assert_eq!(updated(&p), ["00001-gpu.nvidia.com-node-a-aaaaa"]);
}

#[test]
fn pools_that_are_no_longer_desired_are_deleted() {
    let ctx = Ctx::new();
    let want = vec![slice(&["gpu-0"])];
    let mut gone = stored("00000-x", &want, 0, 1);
    gone.spec.pool.name = "old-pool".into();
    let mut existing = published(&want, 1);
    existing.push(gone);
    let p = ctx.plan(&local(want), &existing);
    assert_eq!(deleted(&p), ["00000-x"]);
    assert!(p.updates.is_empty() && p.creates.is_empty());
}

fn network(nodes: Nodes, slices: Vec<Slice>) -> Resources {
    Resources {
        pools: BTreeMap::from([("rack-1".to_string(), Pool { nodes, slices })]),
    }
}

#[test]
fn network_pools_name_their_nodes_instead_of_this_node() {
    let ctx = Ctx::new();
    let selector = NodeSelector {
        node_selector_terms: vec![NodeSelectorTerm {
            match_expressions: Some(vec![NodeSelectorRequirement {
                key: "rack".into(),
                operator: "In".into(),
                values: Some(vec!["1".into()]),
            }]),
            ..Default::default()
        }],
    };
    let p = ctx.plan(
        &network(Nodes::Selector(selector.clone()), vec![slice(&["nic-0"])]),
        &[],
    );
    let spec = &p.creates[0].spec;
    assert_eq!(spec.node_name, None);
    assert_eq!(spec.node_selector, Some(selector));
    assert_eq!(spec.pool.name, "rack-1");

    let p = ctx.plan(&network(Nodes::All, vec![slice(&["nic-0"])]), &[]);
    assert_eq!(p.creates[0].spec.all_nodes, Some(true));
    assert_eq!(p.creates[0].spec.node_name, None);

    let mut per_device = slice(&["nic-0", "nic-1"]);
    per_device.devices[0].node_name = Some("node-a".into());
    per_device.devices[1].all_nodes = Some(true);
    let p = ctx.plan(&network(Nodes::PerDevice, vec![per_device]), &[]);
    assert!(p.invalid.is_empty(), "{:?}", p.invalid);
    assert_eq!(p.creates[0].spec.per_device_node_selection, Some(true));
    assert_eq!(p.creates[0].spec.node_name, None);
}

#[test]
fn a_slice_whose_node_changes_is_replaced_as_node_name_is_immutable() {
    let ctx = Ctx::new();
    let want = vec![slice(&["nic-0"])];
    let mut existing = published(&want, 1);
    existing[0].spec.pool.name = "rack-1".into();
    let p = ctx.plan(&network(Nodes::All, want), &existing);
    assert_eq!(deleted(&p), [named(0, 1)]);
    assert_eq!(gens(&p.creates), vec![(2, 1)]);
    assert!(p.updates.is_empty());
}

#[test]
fn a_pool_breaking_the_api_rules_is_left_alone_and_named_and_others_published() {
    let ctx = Ctx::new();
    let good = vec![slice(&["gpu-0"])];
    let mut desired = local(good.clone());
    // A bad device name in slice 1, and a name used twice in the pool.
    desired.pools.insert(
        "bad".into(),
        Pool {
            nodes: Nodes::ThisNode,
            slices: vec![slice(&["gpu-0"]), slice(&["GPU 1", "gpu-0"])],
        },
    );
    let mut stale = stored("00000-x", &good, 0, 1);
    stale.spec.pool.name = "bad".into();
    let p = ctx.plan(&desired, &[stale]);
    assert_eq!(p.invalid.len(), 1);
    let bad = &p.invalid[0];
    assert_eq!(bad.pool, "bad");
    let rules: Vec<(Option<usize>, &str)> = bad
        .violations
        .iter()
        .map(|(i, v)| (*i, v.rule_id()))
        .collect();
    assert_eq!(
        rules,
        [(Some(1), "device-name"), (None, "duplicate-device")]
    );
    // The bad pool's slice stays; the good pool is created.
    assert!(p.deletes.is_empty());
    assert_eq!(p.creates.len(), 1);
    assert_eq!(p.creates[0].spec.pool.name, NODE);
    let msg = bad.to_string();
    assert!(
        msg.contains("pool \"bad\"") && msg.contains("slice 1: device GPU 1"),
        "{msg}"
    );
}

#[test]
fn empty_and_absent_values_compare_equal() {
    let ctx = Ctx::new();
    let mut want = vec![slice(&["gpu-0"])];
    let existing = published(&want, 1);
    want[0].devices[0].taints = Some(vec![]);
    want[0].devices[0].consumes_counters = Some(vec![]);
    assert!(ctx.plan(&local(want), &existing).is_empty());
}

#[test]
fn fields_the_server_drops_do_not_cause_updates() {
    let mut ctx = Ctx::new();
    let mut want = vec![slice(&["gpu-0"])];
    let existing = published(&want, 1);
    want[0].devices[0].taints = Some(vec![DeviceTaint {
        key: "gpu.nvidia.com/xid".into(),
        value: Some("79".into()),
        effect: "NoSchedule".into(),
        time_added: None,
    }]);
    assert_eq!(ctx.plan(&local(want.clone()), &existing).updates.len(), 1);
    ctx.dropped = dropped_fields(
        &normalized_spec(&spec_of(&want, 0, 1)),
        &normalized_spec(&existing[0].spec),
    );
    assert!(ctx.plan(&local(want), &existing).is_empty());
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
    let mut have = vec![slice(&["gpu-0", "gpu-1"])];
    have[0].devices[0].taints = Some(vec![taint(Some(time.clone()))]);
    let existing = published(&have, 1);
    let mut want = vec![slice(&["gpu-0", "gpu-1"])];
    want[0].devices[0].taints = Some(vec![taint(None)]);
    assert!(ctx.plan(&local(want.clone()), &existing).is_empty());

    // A real change elsewhere: the update keeps the time.
    want[0].devices[1] = device("gpu-1", "1Gi");
    let p = ctx.plan(&local(want), &existing);
    let taints = p.updates[0].spec.devices.as_ref().unwrap()[0]
        .taints
        .clone()
        .unwrap();
    assert_eq!(taints, vec![taint(Some(time))]);
}

#[test]
fn our_own_write_matches_even_if_the_server_normalised_it() {
    let mut ctx = Ctx::new();
    let want = vec![slice(&["gpu-0"])];
    // The server stored 80Gi as 81920Mi (a normalisation we cannot predict).
    let mut server = want.clone();
    server[0].devices[0] = device("gpu-0", "81920Mi");
    let existing = published(&server, 1);
    let name = named(0, 1);
    assert_eq!(ctx.plan(&local(want.clone()), &existing).updates.len(), 1);
    ctx.written.insert(
        name.clone(),
        Written {
            resource_version: format!("rv-{name}"),
            sent: normalized_spec(&spec_of(&want, 0, 1)),
        },
    );
    assert!(ctx.plan(&local(want.clone()), &existing).is_empty());
    // Someone else wrote since (another resourceVersion): compare for real.
    ctx.written.get_mut(&name).unwrap().resource_version = "older".into();
    assert_eq!(ctx.plan(&local(want), &existing).updates.len(), 1);
}

#[test]
fn a_missing_owner_reference_is_added_and_other_references_kept() {
    let mut ctx = Ctx::new();
    ctx.owner = Some(owner());
    let want = vec![slice(&["gpu-0"])];
    let mut have = published(&want, 1).remove(0);
    let other = OwnerReference {
        api_version: "apps/v1".into(),
        kind: "DaemonSet".into(),
        name: "fpga-driver".into(),
        uid: "ds-uid".into(),
        controller: None,
        block_owner_deletion: None,
    };
    have.metadata.owner_references = Some(vec![other.clone()]);
    let p = ctx.plan(&local(want), &[have]);
    // Only the owner changed: one update, same generation.
    assert_eq!(gens(&p.updates), vec![(1, 1)]);
    assert_eq!(
        p.updates[0].metadata.owner_references,
        Some(vec![other, owner()])
    );
}

#[test]
fn dropped_fields_are_named_by_path() {
    let mut sent = spec_of(&[slice(&["gpu-0", "gpu-1"])], 0, 1);
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
    let got = spec_of(&[slice(&["gpu-0", "gpu-1"])], 0, 1);
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
        .filter(|s| !p.deletes.iter().any(|d| d.name == name(s)))
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
        c.metadata.name = Some(format!(
            "{}{next_id}",
            c.metadata.generate_name.as_deref().unwrap()
        ));
        c.metadata.resource_version = Some(next_id.to_string());
        out.push(c);
    }
    out
}

fn layout() -> impl Strategy<Value = Vec<Slice>> {
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
                slice(&refs)
            })
            .collect()
    })
}

proptest! {
    /// From any published layout to any other: one plan converges, the result is one complete
    /// generation holding exactly the desired slices in the desired order by name, and
    /// planning again writes nothing.
    #[test]
    fn one_plan_converges_and_the_next_is_empty(before in layout(), after in layout()) {
        let ctx = Ctx::new();
        let mut id = 0;
        let first = apply(&[], &ctx.plan(&local(before.clone()), &[]), &mut id);
        let p = ctx.plan(&local(after.clone()), &first);
        let mut now = apply(&first, &p, &mut id);
        prop_assert_eq!(now.len(), after.len());
        let generations: BTreeSet<i64> = now.iter().map(|s| s.spec.pool.generation).collect();
        prop_assert!(generations.len() <= 1);
        for s in &now {
            prop_assert_eq!(s.spec.pool.resource_slice_count as usize, after.len());
        }
        now.sort_by_key(name);
        let want: Vec<Vec<String>> = after
            .iter()
            .map(|s| s.devices.iter().map(|d| d.name.clone()).collect())
            .collect();
        let have: Vec<Vec<String>> = now.iter().map(|s| device_names(&s.spec)).collect();
        prop_assert_eq!(want, have);
        prop_assert!(ctx.plan(&local(after.clone()), &now).is_empty());
        if before == after {
            prop_assert!(p.is_empty());
        }
        // At most one slice written (and nothing created): the generation stays.
        if p.creates.is_empty() && p.updates.len() <= 1 && !first.is_empty() {
            prop_assert!(now.iter().all(|s| s.spec.pool.generation == first[0].spec.pool.generation));
        }
    }
}
