use super::*;
use serde_json::json;

fn node(name: &str, clique: Option<&str>) -> Node {
    let mut labels = BTreeMap::new();
    if let Some(c) = clique {
        labels.insert(CLIQUE_LABEL.to_string(), c.to_string());
    }
    Node {
        metadata: ObjectMeta {
            name: Some(name.into()),
            labels: Some(labels),
            ..Default::default()
        },
        ..Default::default()
    }
}

const A: &str = "8c1d6c3a-44a5-4b7e-9f15-22d1b0a0c1e7.1";
const B: &str = "8c1d6c3a-44a5-4b7e-9f15-22d1b0a0c1e7.2";

#[test]
fn cliques_are_the_nodes_labels() {
    let nodes = [
        node("a1", Some(A)),
        node("a2", Some(A)),
        node("b1", Some(B)),
        node("cpu", None),
        node("odd", Some("Upper.Case")),
    ];
    let (good, bad) = cliques(&nodes);
    assert_eq!(good, BTreeSet::from([A.to_string(), B.to_string()]));
    assert_eq!(bad, BTreeSet::from(["Upper.Case".to_string()]));
    assert!(!valid_clique(""));
    assert!(!valid_clique("a..b"));
    assert!(!valid_clique("a-"));
}

#[test]
fn a_pool_is_channels_from_one_on_the_cliques_nodes() {
    let slices = pool_slices(A, 3, 0);
    assert_eq!(slices.len(), 1);
    let v = serde_json::to_value(&slices[0]).unwrap();
    assert_eq!(
        v["metadata"]["name"],
        format!("compute-domain.nvidia.com-clique-{A}-0")
    );
    assert_eq!(v["spec"]["driver"], "compute-domain.nvidia.com");
    assert_eq!(
        v["spec"]["pool"],
        json!({"name": format!("clique-{A}"), "generation": 0, "resourceSliceCount": 1})
    );
    assert_eq!(
        v["spec"]["nodeSelector"],
        json!({"nodeSelectorTerms": [{"matchExpressions": [
            {"key": "nvidia.com/gpu.clique", "operator": "In", "values": [A]}]}]})
    );
    assert!(v["spec"].get("nodeName").is_none());
    let devices = v["spec"]["devices"].as_array().unwrap();
    assert_eq!(devices.len(), 3);
    assert_eq!(
        devices[0],
        json!({"name": "channel-1", "attributes": {
            "type": {"string": "channel"}, "id": {"int": 1}, "cliqueID": {"string": A}}})
    );
    assert_eq!(devices[2]["name"], "channel-3");
    // More than a slice holds: several slices of one pool.
    let big = pool_slices(A, 300, 4);
    assert_eq!(big.len(), 3);
    assert!(big.iter().all(|s| s.spec.pool.resource_slice_count == 3));
    assert!(big.iter().all(|s| s.spec.pool.generation == 4));
    let counts: Vec<usize> = big
        .iter()
        .map(|s| s.spec.devices.as_ref().unwrap().len())
        .collect();
    assert_eq!(counts, [128, 128, 44]);
    // Every slice passes the API server's rules (the library's checks).
    for s in big.iter().chain(&slices) {
        let errs = kubelet_plugin::validate::validate(&s.spec);
        assert!(errs.is_empty(), "{errs:?}");
    }
    let specs: Vec<_> = big.iter().map(|s| s.spec.clone()).collect();
    assert!(kubelet_plugin::validate::validate_pool(&specs).is_empty());
}

fn stored(mut slices: Vec<ResourceSlice>, rv: &str) -> Vec<ResourceSlice> {
    for s in &mut slices {
        s.metadata.resource_version = Some(rv.into());
    }
    slices
}

#[test]
fn the_plan_writes_only_what_differs() {
    let both = BTreeSet::from([A.to_string(), B.to_string()]);
    // Nothing yet: create both pools.
    let p = plan(&both, 2, &[]);
    assert_eq!(p.creates.len(), 2);
    assert!(p.updates.is_empty() && p.deletes.is_empty());
    // As desired: nothing to do. Another driver's slice and a node's slice of ours are ignored.
    let mut existing = stored(pool_slices(A, 2, 0), "5");
    existing.extend(stored(pool_slices(B, 2, 0), "6"));
    let mut node_slice = pool_slices(A, 1, 0).remove(0);
    node_slice.metadata.name = Some("node-a-slice".into());
    node_slice.spec.node_selector = None;
    node_slice.spec.node_name = Some("node-a".into());
    node_slice.spec.pool.name = "node-a".into();
    existing.push(node_slice);
    assert!(plan(&both, 2, &existing).is_empty());
    // More channels: the pool is rewritten at the next generation, in place.
    let p = plan(&both, 3, &existing);
    assert_eq!(p.updates.len(), 2);
    assert!(p.updates.iter().all(|s| s.spec.pool.generation == 1));
    assert_eq!(p.updates[0].metadata.resource_version.as_deref(), Some("5"));
    assert!(p.creates.is_empty() && p.deletes.is_empty());
    // A clique gone: its pool deleted, the other left.
    let p = plan(&BTreeSet::from([A.to_string()]), 2, &existing);
    assert_eq!(
        p.deletes,
        [format!("compute-domain.nvidia.com-clique-{B}-0")]
    );
    assert!(p.creates.is_empty() && p.updates.is_empty());
    // Fewer slices: the extra one deleted, the first updated.
    let existing = stored(pool_slices(A, 200, 3), "7");
    let p = plan(&BTreeSet::from([A.to_string()]), 100, &existing);
    assert_eq!(p.updates.len(), 1);
    assert_eq!(p.updates[0].spec.pool.generation, 4);
    assert_eq!(p.updates[0].spec.pool.resource_slice_count, 1);
    assert_eq!(
        p.deletes,
        [format!("compute-domain.nvidia.com-clique-{A}-1")]
    );
}
