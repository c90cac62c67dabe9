//! The admission policies nvdra ships, evaluated by a CEL nvdra did not write: Google's cel-cpp
//! through the `cel-expr-python` bindings (`tests/support/vap.py`, pinned in `.ci/run`), with
//! the optional syntax and the strings extension of Kubernetes' CEL environment. Each policy is
//! read from the file users apply (tests/integration/helm.rs holds the chart's to the same objects)
//! and run on admission requests as the API server builds them, allowed and denied ones:
//!
//! - `nvdra-resourceslices` (manifests/base/admission.yaml): this node's slices only, of its
//!   driver, in the pool named after the node, of 1 to `maxSlices` slices; deletes of this node's
//!   slices whatever their pool. And every built-in profile, in every publishing mode, stays within
//!   `maxSlices`.
//! - `nvdra-node-labels` (manifests/components/node-labels/admission.yaml): an update of this
//!   Node's own `nvidia.com/` labels (exactly labels::OWNED), nothing else: not another Node, no
//!   other label, taint, annotation or status, no create or delete. The patch nvdra computes for
//!   a real inventory passes.
//!
//! Without the Python bindings these tests skip, unless `NVDRA_REQUIRE_CEL=1` (which `.ci/run`
//! sets) makes them fail.

use crate::support;

use std::collections::BTreeMap;
use std::process::Command;
use std::sync::OnceLock;

use serde_json::{Value, json};
use support::manifests::{documents, find, manifests, read, str_at};

/// What CI installs (`.ci/run`).
const PIP: &str = "python3 -m pip install cel-expr-python==0.1.3";
const USER: &str = "system:serviceaccount:nvdra:nvdra";
const DRIVER: &str = "gpu.nvidia.com";

fn have_cel() -> bool {
    static PROBE: OnceLock<Result<(), String>> = OnceLock::new();
    support::python::have(
        &PROBE,
        "from cel_expr_python import cel; from cel_expr_python.ext import ext_optional, ext_strings",
        "Google's CEL for Python (cel-expr-python)",
        "NVDRA_REQUIRE_CEL",
        PIP,
    )
}

fn policy(file: &str, name: &str) -> Value {
    let path = manifests().join(file);
    let docs = documents(&read(&path), file);
    find(&docs, "ValidatingAdmissionPolicy", name)
        .unwrap_or_else(|| panic!("{file}: no policy {name}"))
        .clone()
}

/// An admission request's `request` as the API server fills it for a service account token
/// bound to a pod on `node` (`None`: a token without the node-name claim).
fn request(
    user: &str,
    node: Option<&str>,
    operation: &str,
    group: &str,
    resource: &str,
    sub: &str,
) -> Value {
    let mut extra = serde_json::Map::new();
    if let Some(node) = node {
        extra.insert(
            "authentication.kubernetes.io/node-name".into(),
            json!([node]),
        );
    }
    extra.insert(
        "authentication.kubernetes.io/pod-name".into(),
        json!(["nvdra-x1"]),
    );
    json!({
        "operation": operation,
        "resource": {"group": group, "version": "v1", "resource": resource},
        "subResource": sub,
        "userInfo": {"username": user, "groups": ["system:serviceaccounts"], "extra": extra},
    })
}

/// What the evaluator answered for one sample.
#[derive(Debug, PartialEq)]
enum Decision {
    NotMatched,
    Allowed,
    /// The index of the first validation that failed, and its message.
    Denied(usize, String),
}

fn decide(policy: &Value, samples: &[Value]) -> Vec<Decision> {
    let input = json!({"policy": policy, "requests": samples}).to_string();
    let script = include_str!("../support/vap.py");
    let out = support::python::json_of(script, &[], &input, "the CEL evaluator");
    out.as_array()
        .expect("one answer per sample")
        .iter()
        .map(|a| {
            if a["matched"] == false {
                Decision::NotMatched
            } else if a["allowed"] == true {
                Decision::Allowed
            } else {
                assert!(
                    a.get("error").is_none_or(Value::is_null),
                    "a denial by error, not by a false validation: {a}"
                );
                let i = a["failed"].as_u64().expect("the failed validation") as usize;
                Decision::Denied(i, str_at(a, "/message").to_string())
            }
        })
        .collect()
}

fn denied(d: &Decision, index: usize, says: &str) {
    match d {
        Decision::Denied(i, message) => {
            assert_eq!(*i, index, "{message}");
            assert!(message.contains(says), "{message:?} does not say {says:?}");
        }
        other => panic!("want validation {index} to deny ({says}), got {other:?}"),
    }
}

// ---------------------------------------------------------------------------------------------
// ResourceSlices.

fn slice(node: &str, pool: &str, count: i64, driver: &str) -> Value {
    json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
        "metadata": {"name": format!("{node}-{driver}-x")},
        "spec": {"driver": driver, "nodeName": node, "devices": [],
                 "pool": {"name": pool, "generation": 3, "resourceSliceCount": count}},
    })
}

fn slice_request(
    node: Option<&str>,
    operation: &str,
    new: Option<Value>,
    old: Option<Value>,
) -> Value {
    json!({
        "request": request(USER, node, operation, "resource.k8s.io", "resourceslices", ""),
        "object": new,
        "oldObject": old,
    })
}

#[test]
fn the_slice_policy_admits_this_nodes_pool_only() {
    if !have_cel() {
        return;
    }
    let policy = policy("base/admission.yaml", "nvdra-resourceslices");
    let max = max_slices(&policy);
    let own = |count| Some(slice("node-a", "node-a", count, DRIVER));
    let a = Some("node-a");
    let cases = [
        slice_request(a, "CREATE", own(1), None),
        slice_request(a, "CREATE", own(max), None),
        slice_request(a, "UPDATE", own(2), own(1)),
        slice_request(a, "DELETE", None, own(1)),
        // An older release's slice of this node, in a pool of another name: it may go.
        slice_request(
            a,
            "DELETE",
            None,
            Some(slice("node-a", "old-pool", 1, DRIVER)),
        ),
        // Denied: another node's slice, created, moved there or deleted.
        slice_request(
            a,
            "CREATE",
            Some(slice("node-b", "node-b", 1, DRIVER)),
            None,
        ),
        slice_request(
            a,
            "UPDATE",
            Some(slice("node-b", "node-a", 1, DRIVER)),
            own(1),
        ),
        slice_request(
            a,
            "DELETE",
            None,
            Some(slice("node-b", "node-b", 1, DRIVER)),
        ),
        // Another pool name, another driver.
        slice_request(
            a,
            "CREATE",
            Some(slice("node-a", "node-b", 1, DRIVER)),
            None,
        ),
        slice_request(
            a,
            "UPDATE",
            Some(slice("node-a", "shared", 1, DRIVER)),
            own(1),
        ),
        slice_request(
            a,
            "CREATE",
            Some(slice("node-a", "node-a", 1, "x.example.com")),
            None,
        ),
        // A pool that claims more slices than the bound, or a huge count, or none.
        slice_request(a, "CREATE", own(max + 1), None),
        slice_request(a, "UPDATE", own(1 << 40), own(1)),
        slice_request(a, "CREATE", own(0), None),
        // A token without the node-name claim.
        slice_request(None, "CREATE", own(1), None),
    ];
    let got = decide(&policy, &cases);
    for d in &got[..5] {
        assert_eq!(*d, Decision::Allowed);
    }
    denied(&got[5], 1, "ResourceSlices of node 'node-b'");
    denied(&got[6], 1, "node 'node-a' may not write");
    denied(&got[7], 1, "ResourceSlices of node 'node-b'");
    denied(&got[8], 3, "only pool 'node-a', not 'node-b'");
    denied(&got[9], 3, "not 'shared'");
    denied(&got[10], 2, "not x.example.com");
    denied(&got[11], 4, &format!("1 to {max} slices, not {}", max + 1));
    denied(&got[12], 4, &format!("not {}", 1_i64 << 40));
    denied(&got[13], 4, "not 0");
    denied(&got[14], 0, "no node-name claim");

    // Anyone else (the scheduler, an admin) is not this policy's business.
    let other = json!({
        "request": request("system:admin", None, "CREATE", "resource.k8s.io", "resourceslices", ""),
        "object": slice("node-b", "elsewhere", 1_000, "x.example.com"),
    });
    assert_eq!(decide(&policy, &[other]), [Decision::NotMatched]);
}

fn max_slices(policy: &Value) -> i64 {
    let var = policy["spec"]["variables"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "maxSlices")
        .expect("the maxSlices variable");
    str_at(var, "/expression")
        .parse()
        .expect("maxSlices is an integer literal")
}

/// nvdra stays well inside the bound it is held to: every built-in profile, in every way of
/// publishing (MIG placements, shares, dynamic MIG), is one pool of at most `maxSlices` slices,
/// named after its node.
#[test]
fn every_profile_publishes_within_the_slice_bound() {
    let policy = policy("base/admission.yaml", "nvdra-resourceslices");
    let max = max_slices(&policy);
    let modes: &[&[&str]] = &[
        &[],
        &["--partitionable"],
        &["--shared-capacity"],
        &["--dynamic-mig=on"],
        &["--partitionable", "--shared-capacity"],
    ];
    let mut most = (0, String::new());
    for profile in nvdra::inventory::topology::profile_names() {
        for flags in modes {
            let out = Command::new(env!("CARGO_BIN_EXE_nvdra"))
                .args(["inventory", "--profile", profile, "--node-name", "node-a"])
                .args(["-o", "slices"])
                .args(*flags)
                .env_remove("NVDRA_LOG")
                .output()
                .expect("nvdra runs");
            let what = format!("{profile} {}", flags.join(" "));
            if !out.status.success() {
                // A mode a profile does not allow (dynamic MIG on a GPU without MIG) is refused
                // as a whole; it publishes nothing.
                continue;
            }
            let slices = documents(&String::from_utf8(out.stdout).unwrap(), &what);
            let n = slices.len() as i64;
            assert!(n >= 1, "{what}: no slice");
            for s in &slices {
                assert_eq!(str_at(s, "/spec/pool/name"), "node-a", "{what}");
                assert_eq!(s["spec"]["pool"]["resourceSliceCount"], n, "{what}");
            }
            if n > most.0 {
                most = (n, what);
            }
        }
    }
    assert!(
        most.0 * 4 <= max,
        "{} publishes {} slices: too close to the policy's bound of {max}",
        most.1,
        most.0
    );
    eprintln!("most slices: {} ({}); bound {max}", most.0, most.1);
}

// ---------------------------------------------------------------------------------------------
// Node labels.

fn node(name: &str, labels: &[(&str, &str)]) -> Value {
    let labels: BTreeMap<&str, &str> = labels.iter().copied().collect();
    json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": labels,
                     "annotations": {"node.alpha.kubernetes.io/ttl": "0"}},
        "spec": {"podCIDR": "10.0.0.0/24", "providerID": "x://1"},
        "status": {"capacity": {"cpu": "8"}},
    })
}

fn node_request(
    node: Option<&str>,
    operation: &str,
    sub: &str,
    new: Option<Value>,
    old: Option<Value>,
) -> Value {
    json!({
        "request": request(USER, node, operation, "", "nodes", sub),
        "object": new,
        "oldObject": old,
    })
}

/// An update of `old` with `edit` applied.
fn edited(old: &Value, edit: impl FnOnce(&mut Value)) -> Value {
    let mut new = old.clone();
    edit(&mut new);
    new
}

const BASE_LABELS: &[(&str, &str)] = &[
    ("kubernetes.io/hostname", "node-a"),
    ("nvidia.com/gpu.present", "true"),
    ("nvidia.com/gpu.count", "8"),
    ("nvidia.com/mig.config", "all-disabled"),
];

#[test]
fn the_node_labels_policy_admits_only_this_nodes_own_labels() {
    if !have_cel() {
        return;
    }
    let policy = policy("components/node-labels/admission.yaml", "nvdra-node-labels");
    let a = Some("node-a");
    let old = node("node-a", BASE_LABELS);
    let label = |k: &str, v: Option<&str>| {
        let (k, v) = (k.to_string(), v.map(String::from));
        edited(&old, move |n| match v {
            Some(v) => n["metadata"]["labels"][k] = v.into(),
            None => {
                n["metadata"]["labels"].as_object_mut().unwrap().remove(&k);
            }
        })
    };
    let update = |new: Value| node_request(a, "UPDATE", "", Some(new), Some(old.clone()));
    let cases = [
        // Allowed: set, change and remove labels nvdra owns; an update that changes nothing.
        update(label("nvidia.com/gpu.count", Some("7"))),
        update(label(
            "nvidia.com/gpu.product",
            Some("NVIDIA-H100-80GB-HBM3"),
        )),
        update(label("nvidia.com/gpu.present", None)),
        update(old.clone()),
        // Denied: another Node.
        node_request(
            a,
            "UPDATE",
            "",
            Some(edited(&node("node-b", BASE_LABELS), |n| {
                n["metadata"]["labels"]["nvidia.com/gpu.count"] = "1".into()
            })),
            Some(node("node-b", BASE_LABELS)),
        ),
        // Labels it does not own: another domain's, removed or added; an nvidia.com/ one that
        // another controller acts on (the GPU Operator's mig-manager).
        update(label("kubernetes.io/hostname", None)),
        update(label("team", Some("a"))),
        update(label("nvidia.com/mig.config", Some("all-1g.10gb"))),
        // A taint, cordoning, an annotation.
        update(edited(&old, |n| {
            n["spec"]["taints"] = json!([{"key": "evil", "effect": "NoSchedule"}])
        })),
        update(edited(&old, |n| n["spec"]["unschedulable"] = true.into())),
        update(edited(&old, |n| {
            n["metadata"]["annotations"]["x"] = "y".into()
        })),
        // Create, delete, status.
        node_request(a, "CREATE", "", Some(node("node-a", &[])), None),
        node_request(a, "DELETE", "", None, Some(old.clone())),
        node_request(
            a,
            "UPDATE",
            "status",
            Some(edited(&old, |n| {
                n["status"]["capacity"]["cpu"] = "9".into()
            })),
            Some(old.clone()),
        ),
        // No node-name claim.
        node_request(
            None,
            "UPDATE",
            "",
            Some(label("nvidia.com/gpu.count", Some("7"))),
            Some(old.clone()),
        ),
    ];
    let got = decide(&policy, &cases);
    for d in &got[..4] {
        assert_eq!(*d, Decision::Allowed);
    }
    denied(&got[4], 2, "may not change Node 'node-b'");
    denied(&got[5], 3, "not kubernetes.io/hostname");
    denied(&got[6], 3, "not team");
    denied(&got[7], 3, "not nvidia.com/mig.config");
    for d in &got[8..11] {
        denied(d, 4, "not its spec (taints, unschedulable)");
    }
    denied(&got[11], 0, "not CREATE");
    denied(&got[12], 0, "not DELETE");
    denied(&got[13], 0, "not UPDATE its status");
    denied(&got[14], 1, "no node-name claim");

    let other = json!({
        "request": request("system:node:node-a", None, "UPDATE", "", "nodes", ""),
        "object": label("team", Some("b")),
        "oldObject": old,
    });
    assert_eq!(decide(&policy, &[other]), [Decision::NotMatched]);
}

/// The policy's `owned` list is the labels nvdra sets and removes, and the patch nvdra computes
/// for a real inventory, applied as the API server applies a merge patch, is admitted.
#[test]
fn the_node_labels_policy_admits_what_nvdra_patches() {
    use nvdra::daemon::labels;
    use nvdra::inventory::DeviceBackend;
    let policy = policy("components/node-labels/admission.yaml", "nvdra-node-labels");
    let owned = policy["spec"]["variables"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "owned")
        .expect("the owned variable");
    let listed: Vec<String> = str_at(owned, "/expression")
        .split('\'')
        .skip(1)
        .step_by(2)
        .map(String::from)
        .collect();
    assert_eq!(listed, labels::OWNED, "the policy's owned labels");
    if !have_cel() {
        return;
    }
    let inv = nvdra::inventory::sim::SimBackend::from_profile("dgx-h100", "node-a")
        .unwrap()
        .snapshot()
        .unwrap();
    let want = labels::labels(&inv, &Default::default());
    // A node GFD labelled differently, with labels nvdra does not know beside them.
    let old = node(
        "node-a",
        &[
            ("kubernetes.io/hostname", "node-a"),
            ("nvidia.com/gpu.count", "4"),
            ("nvidia.com/mps.capable", "true"),
            ("nvidia.com/mig.config", "all-disabled"),
        ],
    );
    let have: BTreeMap<String, String> = old["metadata"]["labels"]
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| labels::OWNED.contains(&k.as_str()))
        .map(|(k, v)| (k.clone(), v.as_str().unwrap().to_string()))
        .collect();
    let patch = labels::patch(&have, &want).expect("a change");
    let new = edited(&old, |n| {
        let l = n["metadata"]["labels"].as_object_mut().unwrap();
        for (k, v) in &patch {
            match v {
                Some(v) => l.insert(k.clone(), v.clone().into()),
                None => l.remove(k),
            };
        }
    });
    assert_ne!(new, old);
    let got = decide(
        &policy,
        &[node_request(
            Some("node-a"),
            "UPDATE",
            "",
            Some(new),
            Some(old),
        )],
    );
    assert_eq!(got, [Decision::Allowed]);
}

// ---------------------------------------------------------------------------------------------
// Claim status.

/// A claim allocated to `node` (the node selector the scheduler writes for a node's devices),
/// with `entries` in `status.devices` (`(driver, pool, device)`).
fn claim(node: Option<&str>, entries: &[(&str, &str, &str)]) -> Value {
    let devices: Vec<Value> = entries
        .iter()
        .map(|(driver, pool, device)| {
            json!({"driver": driver, "pool": pool, "device": device,
                   "conditions": [{"type": "Ready", "status": "True", "reason": "DevicePrepared",
                                   "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z"}],
                   "data": {"uuid": format!("GPU-{device}")}})
        })
        .collect();
    let mut c = json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": "claim-1", "namespace": "team-a", "uid": "uid-1"},
        "spec": {"devices": {"requests": [{"name": "gpu"}]}},
        "status": {
            "reservedFor": [{"resource": "pods", "name": "pod-1", "uid": "pod-uid-1"}],
        },
    });
    if let Some(node) = node {
        c["status"]["allocation"] = json!({
            "devices": {"results": [
                {"request": "gpu", "driver": DRIVER, "pool": node, "device": "gpu-0"},
                {"request": "gpu", "driver": DRIVER, "pool": node, "device": "gpu-1"},
                {"request": "nic", "driver": "net.example.com", "pool": node, "device": "nic-0"},
            ]},
            "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                {"key": "metadata.name", "operator": "In", "values": [node]}]}]},
        });
    }
    if !devices.is_empty() {
        c["status"]["devices"] = Value::Array(devices);
    }
    c
}

fn status_request(node: Option<&str>, new: Value, old: Value) -> Value {
    json!({
        "request": request(USER, node, "UPDATE", "resource.k8s.io", "resourceclaims", "status"),
        "object": new,
        "oldObject": old,
    })
}

#[test]
fn the_claim_status_policy_admits_this_nodes_entries_of_its_driver_only() {
    if !have_cel() {
        return;
    }
    let policy = policy("base/admission.yaml", "nvdra-resourceclaim-status");
    let a = Some("node-a");
    let here = |e: &[(&str, &str, &str)]| claim(a, e);
    let ours = [(DRIVER, "node-a", "gpu-0"), (DRIVER, "node-a", "gpu-1")];
    let nic = ("net.example.com", "node-a", "nic-0");
    let with_nic = [ours[0], ours[1], nic];
    let changed = |mut c: Value, edit: fn(&mut Value)| {
        edit(&mut c);
        c
    };
    let cases = [
        // Allowed: nvdra's entries added, beside another driver's; changed; removed; a no-op.
        status_request(a, here(&ours), here(&[])),
        status_request(a, here(&with_nic), here(&[nic])),
        status_request(
            a,
            changed(here(&ours), |c| {
                c["status"]["devices"][0]["conditions"][0]["status"] = "False".into()
            }),
            here(&ours),
        ),
        status_request(a, here(&[nic]), here(&with_nic)),
        status_request(a, here(&ours), here(&ours)),
        // Denied: a claim allocated to another node, or not allocated.
        status_request(
            a,
            claim(Some("node-b"), &[(DRIVER, "node-b", "gpu-0")]),
            claim(Some("node-b"), &[]),
        ),
        status_request(a, claim(None, &[]), claim(None, &[])),
        // A node selector wider than this node alone.
        status_request(
            a,
            changed(here(&ours), |c| {
                c["status"]["allocation"]["nodeSelector"]["nodeSelectorTerms"][0]["matchFields"]
                    [0]["values"] = json!(["node-a", "node-b"])
            }),
            changed(here(&[]), |c| {
                c["status"]["allocation"]["nodeSelector"]["nodeSelectorTerms"][0]["matchFields"]
                    [0]["values"] = json!(["node-a", "node-b"])
            }),
        ),
        // The allocation or the reservations changed.
        status_request(
            a,
            changed(here(&ours), |c| {
                c["status"]["allocation"]["devices"]["results"][0]["device"] = "gpu-7".into()
            }),
            here(&[]),
        ),
        status_request(
            a,
            changed(here(&[]), |c| {
                c["status"]["reservedFor"] = json!([]);
            }),
            here(&[]),
        ),
        // Another driver's entry added, changed or removed; an entry of another pool.
        status_request(a, here(&with_nic), here(&ours)),
        status_request(
            a,
            changed(here(&with_nic), |c| {
                c["status"]["devices"][2]["data"] = json!({"evil": true})
            }),
            here(&with_nic),
        ),
        status_request(a, here(&ours), here(&with_nic)),
        status_request(a, here(&[(DRIVER, "node-b", "gpu-0")]), here(&[])),
        // No node-name claim.
        status_request(None, here(&ours), here(&[])),
    ];
    let got = decide(&policy, &cases);
    for (i, d) in got[..5].iter().enumerate() {
        assert_eq!(*d, Decision::Allowed, "case {i}");
    }
    for d in &got[5..8] {
        denied(
            d,
            1,
            "may write the status only of claims allocated to that node, not of team-a/claim-1",
        );
    }
    for d in &got[8..10] {
        denied(d, 2, "not its allocation or reservedFor");
    }
    denied(&got[10], 3, "not net.example.com/node-a/nic-0");
    denied(&got[11], 3, "not net.example.com/node-a/nic-0");
    denied(&got[12], 3, "not net.example.com/node-a/nic-0");
    denied(
        &got[13],
        3,
        "gpu.nvidia.com in pool 'node-a', not gpu.nvidia.com/node-b/gpu-0",
    );
    denied(&got[14], 0, "no node-name claim");

    // The claim itself (not its status), and anyone else: not this policy's business.
    let spec = json!({
        "request": request(USER, a, "UPDATE", "resource.k8s.io", "resourceclaims", ""),
        "object": here(&[]), "oldObject": here(&[]),
    });
    let scheduler = json!({
        "request": request("system:kube-scheduler", None, "UPDATE", "resource.k8s.io",
                           "resourceclaims", "status"),
        "object": here(&[]), "oldObject": claim(None, &[]),
    });
    assert_eq!(
        decide(&policy, &[spec, scheduler]),
        [Decision::NotMatched, Decision::NotMatched]
    );
}

/// The entries nvdra writes, as the API server stores them after its apply, pass the policy.
#[tokio::test]
async fn the_claim_status_policy_admits_what_nvdra_applies() {
    if !have_cel() {
        return;
    }
    use kubelet_plugin::status::{StatusWriter, ready};
    let server = support::apiserver::TestApiServer::start().await;
    let mut old = claim(Some("node-a"), &[]);
    let stored: k8s_openapi::api::resource::v1::ResourceClaim =
        serde_json::from_value(old.clone()).unwrap();
    server.seed_claim(stored);
    let writer = StatusWriter::new(std::sync::Arc::new(server.client().unwrap()), DRIVER);
    let entry = |device: &str| k8s_openapi::api::resource::v1::AllocatedDeviceStatus {
        conditions: Some(vec![ready("DevicePrepared", "prepared on node node-a")]),
        ..writer.entry("node-a", device, None)
    };
    let named = kubelet_plugin::Claim::new("team-a", "claim-1", "uid-1");
    writer
        .apply(&named, vec![entry("gpu-0"), entry("gpu-1")])
        .await
        .unwrap();
    let new = serde_json::to_value(server.claim("team-a", "claim-1").unwrap()).unwrap();
    old["metadata"] = new["metadata"].clone();
    let got = decide(
        &policy("base/admission.yaml", "nvdra-resourceclaim-status"),
        &[status_request(Some("node-a"), new, old)],
    );
    assert_eq!(got, [Decision::Allowed]);
}
