//! The allocation search and the capacity checks on small hand-made nodes, where the right answer
//! is known: count and All, firstAvailable, matchAttribute and distinctAttribute, backtracking
//! past a greedy first choice, and consumable capacity with request policies.

use std::path::Path;

use super::*;
use crate::cel::Environment;

const DRIVER: &str = "gpu.nvidia.com";

/// A slice of `(name, memory, nvlinkDomain, allowMultipleAllocations)` GPUs.
fn slice(devices: &[(&str, &str, i64, bool)]) -> String {
    let mut s = format!(
        "apiVersion: resource.k8s.io/v1\nkind: ResourceSlice\nmetadata: {{name: s}}\nspec:\n  driver: {DRIVER}\n  nodeName: n\n  pool: {{name: n, generation: 1, resourceSliceCount: 1}}\n  devices:\n"
    );
    for (name, mem, dom, multi) in devices {
        s.push_str(&format!(
            "  - name: {name}\n    allowMultipleAllocations: {multi}\n    attributes:\n      type: {{string: gpu}}\n      nvlinkDomain: {{int: {dom}}}\n    capacity:\n      memory: {{value: {mem}}}\n"
        ));
    }
    s
}

fn claim(body: &str) -> String {
    format!(
        "---\napiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata: {{name: c}}\nspec:\n  devices:\n{body}"
    )
}

fn run(slices: &str, claim: &str) -> ClaimReport {
    let mut objects = Objects::default();
    input::read_text(
        Path::new("t.yaml"),
        &format!("{slices}{claim}"),
        &mut objects,
    )
    .unwrap();
    let env = Environment::new();
    let node = Node::from_slices(&env, &objects.slices).unwrap();
    let classes = compile_classes(&objects.classes).unwrap();
    explain(&env, &objects.claims[0], &classes, &node, &Held::default()).unwrap()
}

fn picked(r: &ClaimReport) -> Vec<String> {
    r.allocation
        .iter()
        .flatten()
        .map(|a| format!("{}={}", a.request, a.device))
        .collect()
}

#[test]
fn backtracking_finds_the_pair_a_greedy_pick_misses() {
    // gpu-a is alone in domain 0; the two in domain 1 are the only pair.
    let node = slice(&[
        ("gpu-a", "80Gi", 0, false),
        ("gpu-b", "80Gi", 1, false),
        ("gpu-c", "80Gi", 1, false),
    ]);
    let r = run(
        &node,
        &claim(
            "    requests:\n    - name: g\n      exactly: {deviceClassName: gpu.nvidia.com, count: 2}\n    constraints:\n    - matchAttribute: gpu.nvidia.com/nvlinkDomain\n",
        ),
    );
    assert!(r.satisfiable);
    assert_eq!(picked(&r), ["g=gpu-b", "g=gpu-c"]);
}

#[test]
fn all_takes_every_fitting_device_and_fails_on_none() {
    let node = slice(&[("gpu-a", "80Gi", 0, false), ("gpu-b", "40Gi", 0, false)]);
    let all = "    requests:\n    - name: g\n      exactly:\n        deviceClassName: gpu.nvidia.com\n        allocationMode: All\n        selectors:\n        - cel: {expression: \"device.capacity['gpu.nvidia.com'].memory.isGreaterThan(quantity('50Gi'))\"}\n";
    let r = run(&node, &claim(all));
    assert_eq!(picked(&r), ["g=gpu-a"]);
    let none = all.replace("50Gi", "500Gi");
    let r = run(&node, &claim(&none));
    assert!(!r.satisfiable);
    assert_eq!(
        r.requests[0].rejected[0].reason,
        "selectors[0]: memory 80Gi <= 500Gi"
    );
}

#[test]
fn first_available_falls_through_to_the_subrequest_that_fits() {
    let node = slice(&[("gpu-a", "40Gi", 0, false)]);
    let r = run(
        &node,
        &claim(
            "    requests:\n    - name: g\n      firstAvailable:\n      - name: big\n        deviceClassName: gpu.nvidia.com\n        selectors:\n        - cel: {expression: \"device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('80Gi')) >= 0\"}\n      - name: small\n        deviceClassName: gpu.nvidia.com\n",
        ),
    );
    assert_eq!(picked(&r), ["g/small=gpu-a"]);
    assert_eq!(r.requests.len(), 2);
    assert_eq!(r.requests[0].name, "g/big");
    assert_eq!(
        r.requests[0].rejected[0].reason,
        "selectors[0]: memory 40Gi < 80Gi"
    );
}

#[test]
fn distinct_attribute_and_competing_requests() {
    let node = slice(&[
        ("gpu-a", "80Gi", 0, false),
        ("gpu-b", "80Gi", 0, false),
        ("gpu-c", "80Gi", 1, false),
    ]);
    let r = run(
        &node,
        &claim(
            "    requests:\n    - name: g\n      exactly: {deviceClassName: gpu.nvidia.com, count: 2}\n    constraints:\n    - distinctAttribute: gpu.nvidia.com/nvlinkDomain\n",
        ),
    );
    assert_eq!(picked(&r), ["g=gpu-a", "g=gpu-c"]);
    // Two requests of two each over three exclusive devices.
    let r = run(
        &node,
        &claim(
            "    requests:\n    - name: x\n      exactly: {deviceClassName: gpu.nvidia.com, count: 2}\n    - name: y\n      exactly: {deviceClassName: gpu.nvidia.com, count: 2}\n",
        ),
    );
    assert!(!r.satisfiable);
    assert!(r.reason.unwrap().contains("compete"));
}

#[test]
fn consumable_capacity_is_shared_until_it_runs_out() {
    let node = slice(&[("gpu-a", "80Gi", 0, true)]);
    let two = "    requests:\n    - name: x\n      exactly:\n        deviceClassName: gpu.nvidia.com\n        capacity: {requests: {memory: 40Gi}}\n    - name: y\n      exactly:\n        deviceClassName: gpu.nvidia.com\n        capacity: {requests: {memory: 40Gi}}\n";
    let r = run(&node, &claim(two));
    assert_eq!(picked(&r), ["x=gpu-a", "y=gpu-a"]);
    let r = run(&node, &claim(&two.replacen("40Gi", "41Gi", 1)));
    assert!(!r.satisfiable, "{r:?}");
    // An exclusive device serves one request, whatever the amount.
    let node = slice(&[("gpu-a", "80Gi", 0, false)]);
    let r = run(&node, &claim(two));
    assert!(!r.satisfiable);
    // More than the device has.
    let one = "    requests:\n    - name: x\n      exactly:\n        deviceClassName: gpu.nvidia.com\n        capacity: {requests: {memory: 100Gi}}\n";
    let r = run(&node, &claim(one));
    assert_eq!(
        r.requests[0].rejected[0].reason,
        "capacity memory 80Gi < requested 100Gi"
    );
}

#[test]
fn request_policies_round_up() {
    use k8s_openapi::api::resource::v1::{CapacityRequestPolicy, CapacityRequestPolicyRange};
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    let q = |s: &str| Quantity(s.into());
    let range = CapacityRequestPolicy {
        valid_range: Some(CapacityRequestPolicyRange {
            min: q("1Gi"),
            max: Some(q("8Gi")),
            step: Some(q("1Gi")),
        }),
        ..Default::default()
    };
    let m = |s| parse_milli(s).unwrap();
    assert_eq!(round_up(&range, m("100Mi")), Some(m("1Gi")));
    assert_eq!(round_up(&range, m("1500Mi")), Some(m("2Gi")));
    assert_eq!(round_up(&range, m("9Gi")), None);
    let values = CapacityRequestPolicy {
        valid_values: Some(vec![q("4Gi"), q("2Gi")]),
        ..Default::default()
    };
    assert_eq!(round_up(&values, m("3Gi")), Some(m("4Gi")));
    assert_eq!(round_up(&values, m("5Gi")), None);
}

#[test]
fn quantities_parse_in_thousandths() {
    for (s, want) in [
        ("1", 1_000),
        ("500m", 500),
        ("1k", 1_000_000),
        ("1Ki", 1_024_000),
        ("80Gi", 80 * (1i128 << 30) * 1000),
        ("1.5G", 1_500_000_000_000),
        ("1e3", 1_000_000),
        ("-2", -2_000),
    ] {
        assert_eq!(parse_milli(s), Some(want), "{s}");
    }
    for bad in ["", "Gi", "1.2.3", "1Q", "abc", "1e99"] {
        assert_eq!(parse_milli(bad), None, "{bad}");
    }
}

#[test]
fn the_builtin_classes_compile() {
    let classes = compile_classes(&[]).unwrap();
    assert!(classes.contains_key("gpu.nvidia.com"));
    assert!(classes.contains_key("mig.nvidia.com"));
}

/// A slice of `(name, taints)` GPUs, each taint as a YAML flow mapping.
fn tainted_slice(devices: &[(&str, &[&str])]) -> String {
    let mut s = format!(
        "apiVersion: resource.k8s.io/v1\nkind: ResourceSlice\nmetadata: {{name: s}}\nspec:\n  driver: {DRIVER}\n  nodeName: n\n  pool: {{name: n, generation: 1, resourceSliceCount: 1}}\n  devices:\n"
    );
    for (name, taints) in devices {
        s.push_str(&format!(
            "  - name: {name}\n    attributes:\n      type: {{string: gpu}}\n    capacity:\n      memory: {{value: 80Gi}}\n"
        ));
        if !taints.is_empty() {
            s.push_str("    taints:\n");
            for t in *taints {
                s.push_str(&format!("    - {t}\n"));
            }
        }
    }
    s
}

const XID_79: &str = "{key: gpu.nvidia.com/xid, value: \"79\", effect: NoSchedule}";

/// One request for one GPU with `tolerations` (a YAML flow sequence).
fn tolerating(tolerations: &str) -> String {
    claim(&format!(
        "    requests:\n    - name: g\n      exactly:\n        deviceClassName: gpu.nvidia.com\n        tolerations: {tolerations}\n"
    ))
}

#[test]
fn an_untolerated_no_schedule_taint_keeps_the_device_out_and_is_named() {
    let node = tainted_slice(&[("gpu-a", &[XID_79])]);
    let r = run(&node, &tolerating("[]"));
    assert!(!r.satisfiable);
    assert!(r.requests[0].fits.is_empty());
    assert_eq!(
        r.requests[0].rejected[0].reason,
        "tainted gpu.nvidia.com/xid=79:NoSchedule, not tolerated"
    );
    assert_eq!(r.reason.as_deref(), Some("request g needs 1 device, 0 fit"));
    // A toleration for another key, value or effect does not help, and NoExecute blocks too.
    for other in [
        "[{key: gpu.nvidia.com/gpu-lost, operator: Exists}]",
        "[{key: gpu.nvidia.com/xid, value: \"48\"}]",
        "[{operator: Exists, effect: NoExecute}]",
    ] {
        let r = run(&node, &tolerating(other));
        assert!(!r.satisfiable, "{other}");
    }
    let lost = tainted_slice(&[(
        "gpu-a",
        &["{key: gpu.nvidia.com/gpu-lost, effect: NoExecute}"],
    )]);
    let r = run(&lost, &tolerating("[]"));
    assert_eq!(
        r.requests[0].rejected[0].reason,
        "tainted gpu.nvidia.com/gpu-lost:NoExecute, not tolerated"
    );
}

#[test]
fn the_taint_is_named_only_for_a_device_that_otherwise_fits() {
    let node = tainted_slice(&[("gpu-a", &[XID_79])]);
    let r = run(
        &node,
        &claim(
            "    requests:\n    - name: g\n      exactly:\n        deviceClassName: gpu.nvidia.com\n        capacity: {requests: {memory: 100Gi}}\n",
        ),
    );
    assert_eq!(
        r.requests[0].rejected[0].reason,
        "capacity memory 80Gi < requested 100Gi"
    );
}

#[test]
fn each_kind_of_matching_toleration_lets_the_device_fit() {
    let node = tainted_slice(&[(
        "gpu-a",
        &[XID_79, "{key: example.com/maintenance, effect: NoExecute}"],
    )]);
    let maintenance = "{key: example.com/maintenance, operator: Exists}";
    for xid in [
        "{key: gpu.nvidia.com/xid, operator: Exists}",
        "{key: gpu.nvidia.com/xid, operator: Equal, value: \"79\"}",
        "{key: gpu.nvidia.com/xid, value: \"79\"}",
        "{key: gpu.nvidia.com/xid, operator: Exists, effect: NoSchedule}",
    ] {
        let r = run(&node, &tolerating(&format!("[{xid}, {maintenance}]")));
        assert_eq!(picked(&r), ["g=gpu-a"], "{xid}");
        // Each toleration alone leaves the other taint standing.
        let r = run(&node, &tolerating(&format!("[{xid}]")));
        assert_eq!(
            r.requests[0].rejected[0].reason,
            "tainted example.com/maintenance:NoExecute, not tolerated",
            "{xid}"
        );
    }
    // An empty key with Exists tolerates every taint.
    let r = run(&node, &tolerating("[{operator: Exists}]"));
    assert_eq!(picked(&r), ["g=gpu-a"]);
    // Naming both when neither is tolerated.
    let r = run(&node, &tolerating("[]"));
    assert_eq!(
        r.requests[0].rejected[0].reason,
        "tainted gpu.nvidia.com/xid=79:NoSchedule, example.com/maintenance:NoExecute, not tolerated"
    );
}

#[test]
fn effect_none_and_unknown_effects_never_block() {
    let node = tainted_slice(&[(
        "gpu-a",
        &[
            "{key: gpu.nvidia.com/xid, value: \"94\", effect: None}",
            "{key: example.com/future, effect: SomeNewEffect}",
        ],
    )]);
    let r = run(&node, &tolerating("[]"));
    assert_eq!(picked(&r), ["g=gpu-a"]);
    assert!(r.requests[0].rejected.is_empty());
}

#[test]
fn a_tainted_device_is_passed_over_for_an_untainted_one() {
    // gpu-a comes first, so a search that ignored taints would take it.
    let node = tainted_slice(&[("gpu-a", &[XID_79]), ("gpu-b", &[]), ("gpu-c", &[])]);
    let r = run(&node, &tolerating("[]"));
    assert_eq!(picked(&r), ["g=gpu-b"]);
    let r = run(
        &node,
        &claim(
            "    requests:\n    - name: g\n      exactly: {deviceClassName: gpu.nvidia.com, count: 2}\n",
        ),
    );
    assert_eq!(picked(&r), ["g=gpu-b", "g=gpu-c"]);
    assert_eq!(r.requests[0].fits, ["gpu-b", "gpu-c"]);
    // All means every untainted device.
    let r = run(
        &node,
        &claim(
            "    requests:\n    - name: g\n      exactly: {deviceClassName: gpu.nvidia.com, allocationMode: All}\n",
        ),
    );
    assert_eq!(picked(&r), ["g=gpu-b", "g=gpu-c"]);
}

#[test]
fn first_available_falls_through_to_the_subrequest_that_tolerates() {
    let node = tainted_slice(&[("gpu-a", &[XID_79])]);
    let r = run(
        &node,
        &claim(
            "    requests:\n    - name: g\n      firstAvailable:\n      - name: strict\n        deviceClassName: gpu.nvidia.com\n      - name: lenient\n        deviceClassName: gpu.nvidia.com\n        tolerations: [{key: gpu.nvidia.com/xid, operator: Exists}]\n",
        ),
    );
    assert_eq!(picked(&r), ["g/lenient=gpu-a"]);
    assert_eq!(r.requests[0].name, "g/strict");
    assert_eq!(
        r.requests[0].rejected[0].reason,
        "tainted gpu.nvidia.com/xid=79:NoSchedule, not tolerated"
    );
}

#[test]
fn an_unknown_toleration_operator_is_bad_input() {
    let text = format!(
        "{}{}",
        tainted_slice(&[("gpu-a", &[XID_79])]),
        tolerating("[{key: gpu.nvidia.com/xid, operator: In, value: \"79\"}]")
    );
    let mut objects = Objects::default();
    input::read_text(Path::new("t.yaml"), &text, &mut objects).unwrap();
    let env = Environment::new();
    let node = Node::from_slices(&env, &objects.slices).unwrap();
    let classes = compile_classes(&objects.classes).unwrap();
    let Err(InputError::Field(e)) =
        explain(&env, &objects.claims[0], &classes, &node, &Held::default())
    else {
        panic!("an operator In was accepted");
    };
    assert_eq!(
        e.path,
        "spec.devices.requests[0].exactly.tolerations[0].operator"
    );
    assert_eq!(
        e.message,
        "unknown toleration operator \"In\" (Exists or Equal)"
    );
}

// ---------------------------------------------------------------------------------------------
// Shared GPUs: consumable capacity and claims one after another.

/// A node of `gpus` H100s as `--shared-capacity` publishes them: per GPU one device `gpu-<i>`
/// allocatable many times, whose `memory` defaults to all of it and `multiprocessors` to none.
fn shared_node(gpus: usize) -> String {
    let mut devices = String::new();
    for i in 0..gpus {
        devices.push_str(&format!(
            "  - name: gpu-{i}\n    allowMultipleAllocations: true\n    attributes:\n      type: {{string: gpu}}\n      index: {{int: {i}}}\n    capacity:\n      memory:\n        value: 80Gi\n        requestPolicy: {{default: 80Gi, validRange: {{min: 1672Mi, max: 80Gi, step: 1Mi}}}}\n      multiprocessors:\n        value: \"132\"\n        requestPolicy: {{default: \"0\", validRange: {{min: \"0\", max: \"132\", step: \"1\"}}}}\n"
        ));
    }
    format!(
        "apiVersion: resource.k8s.io/v1\nkind: ResourceSlice\nmetadata: {{name: devices}}\nspec:\n  driver: {DRIVER}\n  nodeName: n\n  pool: {{name: n, generation: 1, resourceSliceCount: 1}}\n  devices:\n{devices}"
    )
}

/// A claim `name` for one device of `class` on GPU 0 asking `capacity` (a YAML flow mapping or
/// empty), and `status` (a claim's status block, or empty).
fn on_gpu0(name: &str, class: &str, capacity: &str, status: &str) -> String {
    let capacity = if capacity.is_empty() {
        String::new()
    } else {
        format!("        capacity: {{requests: {capacity}}}\n")
    };
    format!(
        "---\napiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata: {{name: {name}}}\nspec:\n  devices:\n    requests:\n    - name: gpu\n      exactly:\n        deviceClassName: {class}\n        selectors:\n        - cel: {{expression: \"device.attributes['gpu.nvidia.com'].index == 0\"}}\n{capacity}{status}"
    )
}

/// NVIDIA's claim shape: the GPU class, with or without a memory request.
const GPU: &str = "gpu.nvidia.com";
const SHARE_24: &str = "{memory: 24Gi}";

/// Every claim of the input, matched one after another.
fn run_all(text: &str) -> Vec<ClaimReport> {
    let mut objects = Objects::default();
    input::read_text(Path::new("t.yaml"), text, &mut objects).unwrap();
    let env = Environment::new();
    let node = Node::from_slices(&env, &objects.slices).unwrap();
    let classes = compile_classes(&objects.classes).unwrap();
    explain_all(&env, &objects.claims, &classes, &node).unwrap()
}

/// The reason device `device` did not fit the claim's first request.
fn rejected<'a>(r: &'a ClaimReport, device: &str) -> &'a str {
    &r.requests[0]
        .rejected
        .iter()
        .find(|x| x.device == device)
        .unwrap_or_else(|| panic!("{device} fits: {r:?}"))
        .reason
}

fn consumed(r: &ClaimReport) -> BTreeMap<String, String> {
    r.allocation.as_ref().unwrap()[0].consumed_capacity.clone()
}

fn amounts(memory: &str, sms: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        ("memory".into(), memory.into()),
        ("multiprocessors".into(), sms.into()),
    ])
}

#[test]
fn three_shares_of_24gi_fit_one_gpu_and_a_fourth_does_not() {
    let claims: String = ["a", "b", "c", "d"]
        .iter()
        .map(|n| on_gpu0(n, GPU, SHARE_24, ""))
        .collect();
    let r = run_all(&format!("{}{claims}", shared_node(2)));
    for share in &r[..3] {
        assert_eq!(picked(share), ["gpu=gpu-0"], "{share:?}");
        // Charged no multiprocessors: it asked for none.
        assert_eq!(consumed(share), amounts("24Gi", "0"));
    }
    assert!(!r[3].satisfiable);
    assert_eq!(
        rejected(&r[3], "gpu-0"),
        "memory 24Gi > 8Gi left (gpu-0: 72Gi held by claims a, b, c)"
    );
    assert_eq!(
        r[3].reason.as_deref(),
        Some("request gpu needs 1 device, 0 fit")
    );
}

#[test]
fn a_claim_that_asks_for_no_memory_takes_the_whole_gpu() {
    let claims = format!(
        "{}{}",
        on_gpu0("whole", GPU, "", ""),
        on_gpu0("next", GPU, SHARE_24, "")
    );
    let r = run_all(&format!("{}{claims}", shared_node(1)));
    assert_eq!(consumed(&r[0]), amounts("80Gi", "0"));
    assert_eq!(
        rejected(&r[1], "gpu-0"),
        "memory 24Gi > 0 left (gpu-0: 80Gi held by claim whole)"
    );
    // The other way round: a share first, then no whole GPU.
    let claims = format!(
        "{}{}",
        on_gpu0("share", GPU, SHARE_24, ""),
        on_gpu0("whole", GPU, "", "")
    );
    let r = run_all(&format!("{}{claims}", shared_node(1)));
    assert_eq!(picked(&r[0]), ["gpu=gpu-0"]);
    assert_eq!(
        rejected(&r[1], "gpu-0"),
        "memory 80Gi > 56Gi left (gpu-0: 24Gi held by claim share)"
    );
    // Each claim alone fits: what the other holds is what stops it.
    assert!(
        run_all(&format!(
            "{}{}",
            shared_node(1),
            on_gpu0("whole", GPU, "", "")
        ))[0]
            .satisfiable
    );
}

#[test]
fn asked_multiprocessors_are_counted_and_unasked_ones_are_not() {
    let claims = format!(
        "{}{}{}",
        on_gpu0("a", GPU, "{memory: 8Gi, multiprocessors: \"100\"}", ""),
        on_gpu0("b", GPU, "{memory: 8Gi, multiprocessors: \"40\"}", ""),
        on_gpu0("c", GPU, "{memory: 8Gi}", "")
    );
    let r = run_all(&format!("{}{claims}", shared_node(1)));
    assert_eq!(consumed(&r[0]), amounts("8Gi", "100"));
    assert_eq!(
        rejected(&r[1], "gpu-0"),
        "multiprocessors 40 > 32 left (gpu-0: 100 held by claim a)"
    );
    assert_eq!(consumed(&r[2]), amounts("8Gi", "0"));
}

#[test]
fn share_requests_round_up_to_the_policy_and_above_its_max_do_not_fit() {
    let claims = format!(
        "{}{}{}",
        on_gpu0("tiny", GPU, "{memory: 1Gi}", ""),
        on_gpu0("odd", GPU, "{memory: 2048001Ki}", ""),
        on_gpu0("huge", GPU, "{memory: 81Gi}", "")
    );
    let r = run_all(&format!("{}{claims}", shared_node(1)));
    // Below the minimum: the minimum (at most 48 shares of a GPU).
    assert_eq!(consumed(&r[0])["memory"], "1672Mi");
    // Between steps: the next MiB.
    assert_eq!(consumed(&r[1])["memory"], "2001Mi");
    assert_eq!(
        rejected(&r[2], "gpu-0"),
        "capacity memory: 81Gi is outside the device's request policy"
    );
}

#[test]
fn two_requests_of_one_claim_may_share_a_gpu() {
    let two = "---\napiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata: {name: pair}\nspec:\n  devices:\n    requests:\n    - name: x\n      exactly: {deviceClassName: gpu.nvidia.com, capacity: {requests: {memory: 24Gi}}}\n    - name: y\n      exactly: {deviceClassName: gpu.nvidia.com, capacity: {requests: {memory: 24Gi}}}\n";
    let r = run_all(&format!("{}{two}", shared_node(1)));
    assert_eq!(picked(&r[0]), ["x=gpu-0", "y=gpu-0"]);
}

#[test]
fn a_shared_device_draws_its_counters_once_for_all_its_allocations() {
    // A device allocatable many times and an exclusive one on one counter set (not nvdra's
    // shape, but the scheduler's rule): two allocations of the first draw its counters once.
    let node = "apiVersion: resource.k8s.io/v1\nkind: ResourceSlice\nmetadata: {name: s}\nspec:\n  driver: gpu.nvidia.com\n  nodeName: n\n  pool: {name: n, generation: 1, resourceSliceCount: 1}\n  sharedCounters:\n  - name: set\n    counters: {memory: {value: 80Gi}}\n  devices:\n  - name: many\n    allowMultipleAllocations: true\n    attributes: {type: {string: gpu}, index: {int: 0}}\n    capacity:\n      memory: {value: 80Gi, requestPolicy: {default: 1Gi, validRange: {min: 1Gi, max: 80Gi, step: 1Gi}}}\n    consumesCounters: [{counterSet: set, counters: {memory: {value: 80Gi}}}]\n  - name: one\n    attributes: {type: {string: gpu}, index: {int: 1}}\n    capacity: {memory: {value: 80Gi}}\n    consumesCounters: [{counterSet: set, counters: {memory: {value: 80Gi}}}]\n";
    let two = "---\napiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata: {name: pair}\nspec:\n  devices:\n    requests:\n    - name: x\n      exactly: {deviceClassName: gpu.nvidia.com, selectors: [{cel: {expression: \"device.attributes['gpu.nvidia.com'].index == 0\"}}], capacity: {requests: {memory: 24Gi}}}\n    - name: y\n      exactly: {deviceClassName: gpu.nvidia.com, selectors: [{cel: {expression: \"device.attributes['gpu.nvidia.com'].index == 0\"}}], capacity: {requests: {memory: 24Gi}}}\n";
    let r = run_all(&format!("{node}{two}"));
    assert_eq!(picked(&r[0]), ["x=many", "y=many"]);
    // Whereas the two devices of one counter set cannot both be taken.
    let r = run(
        node,
        &claim(
            "    requests:\n    - name: g\n      exactly: {deviceClassName: gpu.nvidia.com, count: 2}\n",
        ),
    );
    assert!(!r.satisfiable);
    assert_eq!(r.requests[0].fits, ["many", "one"]);
    assert!(r.reason.unwrap().contains("compete"));
}

#[test]
fn allocated_claims_hold_their_devices_before_the_others_are_matched() {
    // Listed last, the allocated claim still holds 64Gi of the GPU first.
    let status = "status:\n  allocation:\n    devices:\n      results:\n      - {request: gpu, driver: gpu.nvidia.com, pool: n, device: gpu-0, shareID: 1f0c7e2a-8a5b-4c41-9d4e-3b2f1a0c9d8e, consumedCapacity: {memory: 64Gi, multiprocessors: \"0\"}}\n";
    let text = format!(
        "{}{}{}",
        shared_node(1),
        on_gpu0("pending", GPU, SHARE_24, ""),
        on_gpu0("running", GPU, SHARE_24, status)
    );
    let r = run_all(&text);
    assert_eq!(r.len(), 2);
    assert_eq!(
        rejected(&r[0], "gpu-0"),
        "memory 24Gi > 16Gi left (gpu-0: 64Gi held by claim running)"
    );
    assert!(r[1].allocated && r[1].satisfiable);
    assert_eq!(picked(&r[1]), ["gpu=gpu-0"]);
    // An allocation without consumedCapacity (an older scheduler) counts the policy's
    // defaults: the whole GPU.
    let status = "status:\n  allocation:\n    devices:\n      results:\n      - {request: gpu, driver: gpu.nvidia.com, pool: n, device: gpu-0}\n";
    let text = format!(
        "{}{}{}",
        shared_node(1),
        on_gpu0("running", GPU, "", status),
        on_gpu0("pending", GPU, SHARE_24, "")
    );
    let r = run_all(&text);
    assert_eq!(
        rejected(&r[1], "gpu-0"),
        "memory 24Gi > 0 left (gpu-0: 80Gi held by claim running)"
    );
    // An exclusive device allocated to a claim is not offered to another.
    let node = slice(&[("gpu-a", "80Gi", 0, false)]);
    let text = format!(
        "{node}---\napiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata: {{name: running}}\nspec:\n  devices:\n    requests:\n    - name: gpu\n      exactly: {{deviceClassName: gpu.nvidia.com}}\n{}---\napiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata: {{name: pending}}\nspec:\n  devices:\n    requests:\n    - name: gpu\n      exactly: {{deviceClassName: gpu.nvidia.com}}\n",
        status.replace("gpu-0}", "gpu-a}")
    );
    let r = run_all(&text);
    assert_eq!(rejected(&r[1], "gpu-a"), "allocated to claim running");
    // An allocation to a device the node does not have is said so.
    let text = format!(
        "{}{}",
        shared_node(1),
        on_gpu0("elsewhere", GPU, "", &status.replace("gpu-0}", "gpu-9}"))
    );
    let r = run_all(&text);
    assert!(!r[0].satisfiable);
    assert_eq!(
        r[0].reason.as_deref(),
        Some("allocated to devices the node does not have: gpu.nvidia.com/n/gpu-9")
    );
}

#[test]
fn partly_used_counters_say_how_much_is_left() {
    // Two halves and the whole on one counter set (as MIG placements are published).
    let node = "apiVersion: resource.k8s.io/v1\nkind: ResourceSlice\nmetadata: {name: s}\nspec:\n  driver: gpu.nvidia.com\n  nodeName: n\n  pool: {name: n, generation: 1, resourceSliceCount: 1}\n  sharedCounters:\n  - name: set\n    counters: {memory: {value: 80Gi}}\n  devices:\n  - name: half-a\n    attributes: {type: {string: gpu}}\n    consumesCounters: [{counterSet: set, counters: {memory: {value: 40Gi}}}]\n  - name: whole\n    attributes: {type: {string: gpu}}\n    consumesCounters: [{counterSet: set, counters: {memory: {value: 80Gi}}}]\n  - name: lost\n    attributes: {type: {string: gpu}}\n    consumesCounters: [{counterSet: nowhere, counters: {memory: {value: 1Gi}}}]\n";
    let one = |n: &str| {
        format!(
            "---\napiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata: {{name: {n}}}\nspec:\n  devices:\n    requests:\n    - name: g\n      exactly: {{deviceClassName: gpu.nvidia.com}}\n"
        )
    };
    let r = run_all(&format!("{node}{}{}", one("first"), one("second")));
    assert_eq!(picked(&r[0]), ["g=half-a"]);
    assert_eq!(
        rejected(&r[1], "whole"),
        "counter memory of set: 80Gi > 40Gi left (taken by half-a (claim first))"
    );
    assert_eq!(
        rejected(&r[1], "lost"),
        "consumes counters of nowhere, which no slice of pool n has"
    );
}

// ---------------------------------------------------------------------------------------------
// Admin access, and All over devices in use: as the 1.36 allocator treats them.

/// A claim `name` with one request `g` for the gpu class: `fields` are more fields of its
/// `exactly` (a YAML flow mapping's inside), `status` a status block or empty.
fn plain(name: &str, fields: &str, status: &str) -> String {
    let fields = if fields.is_empty() {
        String::new()
    } else {
        format!(", {fields}")
    };
    format!(
        "---\napiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata: {{name: {name}}}\nspec:\n  devices:\n    requests:\n    - name: g\n      exactly: {{deviceClassName: gpu.nvidia.com{fields}}}\n{status}"
    )
}

/// A status that allocates `device` to request `g` (with `extra` fields in the result).
fn allocated_to(device: &str, extra: &str) -> String {
    format!(
        "status:\n  allocation:\n    devices:\n      results:\n      - {{request: g, driver: gpu.nvidia.com, pool: n, device: {device}{extra}}}\n"
    )
}

fn admin_picks(r: &ClaimReport) -> Vec<bool> {
    r.allocation
        .iter()
        .flatten()
        .map(|a| a.admin_access)
        .collect()
}

#[test]
fn admin_access_gets_devices_in_use_and_holds_them_for_no_claim_after_it() {
    let node = slice(&[("gpu-a", "80Gi", 0, false), ("gpu-b", "80Gi", 0, false)]);
    let text = format!(
        "{node}{}{}{}",
        plain("running", "", &allocated_to("gpu-a", "")),
        plain("monitor", "allocationMode: All, adminAccess: true", ""),
        plain("pending", "", "")
    );
    let r = run_all(&text);
    // The admin-access claim gets gpu-a, which `running` holds, and gpu-b.
    assert!(r[1].satisfiable, "{:?}", r[1]);
    assert_eq!(picked(&r[1]), ["g=gpu-a", "g=gpu-b"]);
    assert_eq!(admin_picks(&r[1]), [true, true]);
    assert!(r[1].requests[0].admin_access);
    // The plain claim after it is not blocked by it: gpu-b is still free, and gpu-a is held by
    // `running` alone.
    assert_eq!(picked(&r[2]), ["g=gpu-b"]);
    assert_eq!(rejected(&r[2], "gpu-a"), "allocated to claim running");
    let table = render_table(&r);
    assert!(
        table.contains("request g: All × gpu.nvidia.com (admin access)"),
        "{table}"
    );
    assert!(
        table.contains("satisfiable: g → gpu-a (admin access), g → gpu-b (admin access)"),
        "{table}"
    );

    // Without admin access the same claim asks for every matching device, one is in use, and
    // it cannot be met (the allocator takes all of them or none).
    let text = format!(
        "{node}{}{}",
        plain("running", "", &allocated_to("gpu-a", "")),
        plain("everything", "allocationMode: All", "")
    );
    let r = run_all(&text);
    assert!(!r[1].satisfiable);
    assert_eq!(
        r[1].reason.as_deref(),
        Some(
            "request g asks for all matching devices (allocationMode All), and one is in use \
             (gpu-a: allocated to claim running)"
        )
    );
}

#[test]
fn an_allocated_admin_access_result_holds_nothing() {
    let node = slice(&[("gpu-a", "80Gi", 0, false)]);
    let text = format!(
        "{node}{}{}",
        plain(
            "monitor",
            "adminAccess: true",
            &allocated_to("gpu-a", ", adminAccess: true")
        ),
        plain("pending", "", "")
    );
    let r = run_all(&text);
    assert!(r[0].allocated);
    assert_eq!(admin_picks(&r[0]), [true]);
    assert_eq!(picked(&r[1]), ["g=gpu-a"]);
}

#[test]
fn within_one_claim_a_device_is_taken_once_admin_access_or_not() {
    // The allocator marks an admin-access pick as allocating for the claim: its other requests
    // cannot have the device too.
    let node = slice(&[("gpu-a", "80Gi", 0, false)]);
    let two = "    requests:\n    - name: watch\n      exactly: {deviceClassName: gpu.nvidia.com, adminAccess: true}\n    - name: work\n      exactly: {deviceClassName: gpu.nvidia.com}\n";
    let r = run(&node, &claim(two));
    assert!(!r.satisfiable, "{r:?}");
    let node = slice(&[("gpu-a", "80Gi", 0, false), ("gpu-b", "80Gi", 0, false)]);
    let r = run(&node, &claim(two));
    assert_eq!(picked(&r), ["watch=gpu-a", "work=gpu-b"]);
}

#[test]
fn admin_access_needs_no_counters_but_the_capacity_left_of_a_shared_device() {
    // MIG-like placements on one counter set: `whole` in use takes all of it.
    let node = "apiVersion: resource.k8s.io/v1\nkind: ResourceSlice\nmetadata: {name: s}\nspec:\n  driver: gpu.nvidia.com\n  nodeName: n\n  pool: {name: n, generation: 1, resourceSliceCount: 1}\n  sharedCounters:\n  - name: set\n    counters: {memory: {value: 80Gi}}\n  devices:\n  - name: half-a\n    attributes: {type: {string: gpu}}\n    consumesCounters: [{counterSet: set, counters: {memory: {value: 40Gi}}}]\n  - name: whole\n    attributes: {type: {string: gpu}}\n    consumesCounters: [{counterSet: set, counters: {memory: {value: 80Gi}}}]\n";
    let text = format!(
        "{node}{}{}{}",
        plain("running", "", &allocated_to("whole", "")),
        plain("monitor", "allocationMode: All, adminAccess: true", ""),
        plain("pending", "", "")
    );
    let r = run_all(&text);
    assert_eq!(picked(&r[1]), ["g=half-a", "g=whole"]);
    assert!(!r[2].satisfiable);
    assert_eq!(
        rejected(&r[2], "half-a"),
        "counter memory of set is taken by whole (claim running)"
    );

    // On a shared GPU an admin-access request is still held to the capacity left, but what it
    // consumes is not held for the claims after it.
    let status = "status:\n  allocation:\n    devices:\n      results:\n      - {request: gpu, driver: gpu.nvidia.com, pool: n, device: gpu-0, shareID: 1f0c7e2a-8a5b-4c41-9d4e-3b2f1a0c9d8e, consumedCapacity: {memory: 64Gi, multiprocessors: \"0\"}}\n";
    let admin = |name: &str, memory: &str| {
        on_gpu0(name, GPU, &format!("{{memory: {memory}}}"), "").replace(
            "deviceClassName",
            "adminAccess: true\n        deviceClassName",
        )
    };
    let text = format!(
        "{}{}{}{}{}",
        shared_node(1),
        on_gpu0("running", GPU, "", status),
        admin("too-big", "24Gi"),
        admin("monitor", "16Gi"),
        on_gpu0("pending", GPU, "{memory: 16Gi}", "")
    );
    let r = run_all(&text);
    assert_eq!(
        rejected(&r[1], "gpu-0"),
        "memory 24Gi > 16Gi left (gpu-0: 64Gi held by claim running)"
    );
    assert_eq!(picked(&r[2]), ["gpu=gpu-0"]);
    assert_eq!(admin_picks(&r[2]), [true]);
    assert_eq!(picked(&r[3]), ["gpu=gpu-0"]);
}

#[test]
fn all_that_nothing_fits_says_so_without_a_count() {
    let node = slice(&[("gpu-a", "40Gi", 0, false)]);
    let r = run(
        &node,
        &claim(
            "    requests:\n    - name: g\n      exactly:\n        deviceClassName: gpu.nvidia.com\n        allocationMode: All\n        selectors:\n        - cel: {expression: \"device.capacity['gpu.nvidia.com'].memory.isGreaterThan(quantity('50Gi'))\"}\n",
        ),
    );
    assert!(!r.satisfiable);
    assert_eq!(
        r.reason.as_deref(),
        Some("request g asks for all matching devices (allocationMode All), and none fits")
    );
}

#[test]
fn quantities_format_as_kubernetes_writes_them() {
    for (s, want) in [
        ("24Gi", "24Gi"),
        ("7831Mi", "7831Mi"),
        ("25", "25"),
        ("1500m", "1500m"),
        ("0", "0"),
        ("1Ti", "1Ti"),
    ] {
        assert_eq!(format_milli(parse_milli(s).unwrap()), want, "{s}");
    }
}

// ---------------------------------------------------------------------------------------------
// Dynamic MIG: GPUs offered whole and in MIG placements on one counter set each, as
// `--dynamic-mig` publishes dgx-h100; the counters decide what lands where.

/// The first `gpus` GPUs of dgx-h100 as `--dynamic-mig` (and `--shared-capacity` when `shared`)
/// publishes them, with the claims of `claims` matched one after another.
fn dynamic_h100(gpus: usize, shared: bool, claims: &str) -> Vec<ClaimReport> {
    use crate::dra::slices::{ConsumableShares, CounterLayout, SliceOptions, desired_slices};
    use k8s_openapi::api::resource::v1::ResourceSlice;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
    let inv = crate::inventory::topology::load_profile("dgx-h100", "n").unwrap();
    let inv = crate::inventory::Inventory::new(inv.gpus[..gpus].to_vec()).unwrap();
    let opts = SliceOptions {
        driver: DRIVER.into(),
        node_name: "n".into(),
        partitionable: false,
        shared_capacity: if shared {
            ConsumableShares::Memory
        } else {
            ConsumableShares::Disabled
        },
        dynamic_mig: true,
        mig_profiles: None,
        layout: CounterLayout::Separate,
    };
    let mut objects = Objects::default();
    input::read_text(Path::new("t.yaml"), claims, &mut objects).unwrap();
    objects.slices = desired_slices(&inv, &opts)
        .unwrap()
        .into_iter()
        .enumerate()
        .map(|(i, spec)| ResourceSlice {
            metadata: ObjectMeta {
                name: Some(format!("n-{i}")),
                ..Default::default()
            },
            spec,
        })
        .collect();
    let env = Environment::new();
    let node = Node::from_slices(&env, &objects.slices).unwrap();
    let classes = compile_classes(&objects.classes).unwrap();
    explain_all(&env, &objects.claims, &classes, &node).unwrap()
}

/// A claim `name` for one device of `class`, with a CEL `selector` (or none) and `status` (a
/// status block, or empty).
fn one_of(name: &str, class: &str, selector: &str, status: &str) -> String {
    let selectors = if selector.is_empty() {
        String::new()
    } else {
        format!(", selectors: [{{cel: {{expression: \"{selector}\"}}}}]")
    };
    format!(
        "---\napiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata: {{name: {name}}}\nspec:\n  devices:\n    requests:\n    - name: g\n      exactly: {{deviceClassName: {class}{selectors}}}\n{status}"
    )
}

/// A claim `name` for one MIG device of `profile`.
fn mig_claim(name: &str, profile: &str) -> String {
    one_of(
        name,
        "mig.nvidia.com",
        &format!("device.attributes['gpu.nvidia.com'].profile == '{profile}'"),
        "",
    )
}

/// The one device a claim got.
fn got(r: &ClaimReport) -> String {
    assert!(r.satisfiable, "{} does not fit: {:?}", r.name, r.reason);
    let a = r.allocation.as_ref().unwrap();
    assert_eq!(a.len(), 1);
    a[0].device.clone()
}

/// `gpu-<minor>` of a device name.
fn gpu_of(device: &str) -> String {
    device.split('-').take(2).collect::<Vec<_>>().join("-")
}

#[test]
fn a_3g_then_a_1g_claim_fit_one_gpu_beside_each_other() {
    let r = dynamic_h100(
        1,
        false,
        &format!(
            "{}{}",
            mig_claim("big", "3g.40gb"),
            mig_claim("small", "1g.10gb")
        ),
    );
    let (big, small) = (got(&r[0]), got(&r[1]));
    assert!(big.starts_with("gpu-0-mig-3g40gb-9-"), "{big}");
    assert!(small.starts_with("gpu-0-mig-1g10gb-19-"), "{small}");
    // Their memory slices do not overlap: 3g takes 4 slices from its start, 1g one.
    let start = |d: &str| d.rsplit('-').next().unwrap().parse::<u32>().unwrap();
    let (b, s) = (start(&big), start(&small));
    assert!(s < b || s >= b + 4, "{big} and {small} overlap");
    // And the whole GPU no longer fits.
    let r = dynamic_h100(
        1,
        false,
        &format!(
            "{}{}{}",
            mig_claim("big", "3g.40gb"),
            mig_claim("small", "1g.10gb"),
            plain("whole", "", "")
        ),
    );
    assert!(!r[2].satisfiable);
    let why = rejected(&r[2], "gpu-0");
    assert!(
        why.contains("gpu-0-counter-set") && why.contains("taken by"),
        "{why}"
    );
}

#[test]
fn a_whole_gpu_does_not_fit_a_gpu_whose_placement_is_taken() {
    // A 1g placement allocated on GPU 0 (listed last, it still holds first).
    let text = format!(
        "{}{}",
        plain("whole", "", ""),
        one_of(
            "running",
            "mig.nvidia.com",
            "",
            &allocated_to("gpu-0-mig-1g10gb-19-3", "")
        )
    );
    let r = dynamic_h100(1, false, &text);
    assert!(r[1].allocated);
    assert!(!r[0].satisfiable);
    let why = rejected(&r[0], "gpu-0");
    assert!(
        why.contains("memory-slice-3") && why.contains("gpu-0-mig-1g10gb-19-3 (claim running)"),
        "{why}"
    );
}

#[test]
fn whole_and_mig_claims_land_on_different_gpus_as_the_counters_say() {
    let claims = format!(
        "{}{}{}{}",
        plain("whole", "", ""),
        mig_claim("a", "3g.40gb"),
        mig_claim("b", "3g.40gb"),
        mig_claim("c", "1g.10gb"),
    );
    let r = dynamic_h100(2, false, &claims);
    let whole = got(&r[0]);
    let (a, b) = (got(&r[1]), got(&r[2]));
    // The MIG devices cannot be on the GPU taken whole; both 3g fit the other one.
    assert_eq!(gpu_of(&a), gpu_of(&b));
    assert_ne!(gpu_of(&a), whole);
    assert_ne!(a, b);
    // Two 3g devices leave no 1g placement on that GPU, and the other is taken whole.
    assert!(!r[3].satisfiable, "{:?}", r[3].allocation);

    // With shares: the whole GPU is allocatable many times, its counters drawn once; while a
    // share runs, no MIG device fits that GPU.
    let on0 = |name: &str| on_gpu0(name, GPU, SHARE_24, "");
    let claims = format!(
        "{}{}{}",
        on0("share-a"),
        on0("share-b"),
        mig_claim("mig", "1g.10gb"),
    );
    let r = dynamic_h100(1, true, &claims);
    assert_eq!(got(&r[0]), "gpu-0");
    assert_eq!(got(&r[1]), "gpu-0");
    assert!(!r[2].satisfiable);
    // The other way round: a MIG device first, then no share fits.
    let claims = format!("{}{}", mig_claim("mig", "1g.10gb"), on0("share"));
    let r = dynamic_h100(1, true, &claims);
    assert!(got(&r[0]).starts_with("gpu-0-mig-"));
    assert!(!r[1].satisfiable);
}

// ---------------------------------------------------------------------------------------------
// Burstable shares: a share's burst limit beside what the scheduler packs it by.

/// A claim config (under `spec.devices`) for all requests: MPS with `mps` as `mpsConfig`.
fn mps_config(mps: &str) -> String {
    format!(
        "    config:\n    - opaque:\n        driver: {DRIVER}\n        parameters: {{apiVersion: resource.nvidia.com/v1beta1, kind: GpuConfig, sharing: {{strategy: MPS, mpsConfig: {mps}}}}}\n"
    )
}

#[test]
fn a_share_is_packed_by_its_request_and_shown_with_its_burst_limit() {
    // 24Gi that may burst to 40Gi, then 56Gi: both fit one 80Gi GPU, as the scheduler counts
    // only what each consumes.
    let text = format!(
        "{}{}{}",
        shared_node(1),
        on_gpu0(
            "bursty",
            GPU,
            SHARE_24,
            &mps_config("{defaultPinnedDeviceMemoryLimit: 40Gi}")
        ),
        on_gpu0("rest", GPU, "{memory: 56Gi}", "")
    );
    let r = run_all(&text);
    assert!(r[0].satisfiable && r[1].satisfiable, "{r:?}");
    let a = &r[0].allocation.as_ref().unwrap()[0];
    assert_eq!(a.consumed_capacity, amounts("24Gi", "0"));
    assert_eq!(a.burst_limit.as_deref(), Some("40Gi"));
    assert_eq!(a.config_error, None);
    assert_eq!(r[1].allocation.as_ref().unwrap()[0].burst_limit, None);
    let table = render_table(&r);
    assert!(
        table.contains(
            "satisfiable: gpu → gpu-0 (memory 24Gi, multiprocessors 0, may burst to 40Gi)"
        ),
        "{table}"
    );
    let json = serde_json::to_value(&r[0]).unwrap();
    assert_eq!(json["allocation"][0]["burstLimit"], "40Gi", "{json}");
    assert!(
        serde_json::to_value(&r[1]).unwrap()["allocation"][0]
            .get("burstLimit")
            .is_none()
    );
}

#[test]
fn a_burst_limit_prepare_would_refuse_is_named_with_its_field() {
    for (limit, why) in [
        (
            "8Gi",
            "8Gi is below the 24Gi of memory the share is guaranteed",
        ),
        ("96Gi", "96Gi is more than the GPU's 80Gi of memory"),
        ("lots", "invalid quantity \"lots\""),
    ] {
        let text = format!(
            "{}{}",
            shared_node(1),
            on_gpu0(
                "c",
                GPU,
                SHARE_24,
                &mps_config(&format!("{{defaultPinnedDeviceMemoryLimit: {limit}}}"))
            )
        );
        let r = run_all(&text);
        // The scheduler allocates it; the node then refuses to prepare it.
        assert!(r[0].satisfiable, "{r:?}");
        let a = &r[0].allocation.as_ref().unwrap()[0];
        assert_eq!(a.burst_limit, None);
        let e = a.config_error.as_deref().unwrap_or_default();
        assert!(
            e.contains(&format!(
                "sharing.mpsConfig.defaultPinnedDeviceMemoryLimit: {why}"
            )),
            "{limit}: {e}"
        );
        assert!(
            render_table(&r).contains("refused at prepare: "),
            "{}",
            render_table(&r)
        );
    }
}

#[test]
fn a_burst_limit_comes_from_the_class_or_the_allocation_and_the_whole_gpu_has_none() {
    // From the request's class.
    let class = format!(
        "---\napiVersion: resource.k8s.io/v1\nkind: DeviceClass\nmetadata: {{name: bursty}}\nspec:\n  selectors:\n  - cel: {{expression: \"device.driver == '{DRIVER}'\"}}\n  config:\n  - opaque:\n      driver: {DRIVER}\n      parameters: {{apiVersion: resource.nvidia.com/v1beta1, kind: GpuConfig, sharing: {{strategy: MPS, mpsConfig: {{defaultPinnedDeviceMemoryLimit: 48Gi}}}}}}\n"
    );
    let r = run_all(&format!(
        "{}{class}{}",
        shared_node(1),
        on_gpu0("c", "bursty", SHARE_24, "")
    ));
    assert_eq!(
        r[0].allocation.as_ref().unwrap()[0].burst_limit.as_deref(),
        Some("48Gi"),
        "{r:?}"
    );
    // From an allocation's configs, as prepare reads them.
    let status = format!(
        "status:\n  allocation:\n    devices:\n      results:\n      - {{request: gpu, driver: {DRIVER}, pool: n, device: gpu-0, shareID: 1f0c7e2a-8a5b-4c41-9d4e-3b2f1a0c9d8e, consumedCapacity: {{memory: 24Gi, multiprocessors: \"0\"}}}}\n      config:\n      - source: FromClaim\n        opaque:\n          driver: {DRIVER}\n          parameters: {{apiVersion: resource.nvidia.com/v1beta1, kind: GpuConfig, sharing: {{strategy: MPS, mpsConfig: {{defaultPinnedDeviceMemoryLimit: 32Gi}}}}}}\n"
    );
    let r = run_all(&format!(
        "{}{}",
        shared_node(1),
        on_gpu0("running", GPU, SHARE_24, &status)
    ));
    assert!(r[0].allocated, "{r:?}");
    assert_eq!(
        r[0].allocation.as_ref().unwrap()[0].burst_limit.as_deref(),
        Some("32Gi"),
        "{r:?}"
    );
    // The whole GPU (no memory asked) is no share: the field keeps NVIDIA's meaning there, a
    // limit per MPS client of the claim's own daemon, and no burst is shown.
    let r = run_all(&format!(
        "{}{}",
        shared_node(1),
        on_gpu0(
            "whole",
            GPU,
            "",
            &mps_config("{defaultPinnedDeviceMemoryLimit: 40Gi}")
        )
    ));
    let a = &r[0].allocation.as_ref().unwrap()[0];
    assert_eq!(
        (a.burst_limit.as_deref(), a.config_error.as_deref()),
        (None, None)
    );
}

#[test]
fn in_integer_mode_a_burst_is_checked_against_the_shares_part_of_the_gpu() {
    // NVIDIA's integer mode with N = 4: a claim that asks for nothing takes 1 share, a fourth
    // of the GPU (20Gi), and no memory.
    let node = format!(
        "apiVersion: resource.k8s.io/v1\nkind: ResourceSlice\nmetadata: {{name: devices}}\nspec:\n  driver: {DRIVER}\n  nodeName: n\n  pool: {{name: n, generation: 1, resourceSliceCount: 1}}\n  devices:\n  - name: gpu-0\n    allowMultipleAllocations: true\n    attributes:\n      type: {{string: gpu}}\n      index: {{int: 0}}\n    capacity:\n      memory:\n        value: 80Gi\n        requestPolicy: {{default: \"0\", validRange: {{min: \"0\", max: 80Gi, step: 1Mi}}}}\n      shares:\n        value: \"4\"\n        requestPolicy: {{default: \"1\", validRange: {{min: \"1\", max: \"4\", step: \"1\"}}}}\n"
    );
    let burst = |limit: &str| {
        let r = run_all(&format!(
            "{node}{}",
            on_gpu0(
                "c",
                GPU,
                "",
                &mps_config(&format!("{{defaultPinnedDeviceMemoryLimit: {limit}}}"))
            )
        ));
        let a = r[0].allocation.as_ref().unwrap()[0].clone();
        (a.burst_limit, a.config_error)
    };
    assert_eq!(burst("40Gi"), (Some("40Gi".into()), None));
    let (limit, e) = burst("16Gi");
    assert_eq!(limit, None);
    assert!(
        e.unwrap_or_default()
            .contains("16Gi is below the 20Gi of memory the share is guaranteed"),
    );
}

// Dynamic MIG: what the node withdrew or tainted because a switch is blocked.

/// dgx-h100 with `--dynamic-mig` as `nvdra match --profile` sees it: GPU 0 held by a DCGM-like
/// holder (its placements withdrawn), GPU 1 after a prepare met IN_USE (its placements
/// tainted `mig-switch-blocked`), the rest idle.
fn blocked_node(env: &Environment) -> Node {
    use crate::dra::slices::{
        ConsumableShares, CounterLayout, SliceOptions, desired_slices, withdrawn_devices,
    };
    use crate::inventory::{Holder, HolderKind, SwitchBlock};
    let mut inv = crate::inventory::topology::load_profile("dgx-h100", "n").unwrap();
    let dcgm = Holder {
        pid: 4242,
        name: "nv-hostengine".into(),
        kind: HolderKind::Foreign,
    };
    inv.gpus[0].mig.holders = vec![dcgm.clone()];
    inv.gpus[1].mig.switch_block = Some(SwitchBlock::InUse {
        holders: vec![dcgm],
    });
    let opts = SliceOptions {
        driver: DRIVER.into(),
        node_name: "n".into(),
        partitionable: false,
        shared_capacity: ConsumableShares::Disabled,
        dynamic_mig: true,
        mig_profiles: None,
        layout: CounterLayout::Separate,
    };
    let slices: Vec<ResourceSlice> = desired_slices(&inv, &opts)
        .unwrap()
        .into_iter()
        .map(|spec| ResourceSlice {
            metadata: Default::default(),
            spec,
        })
        .collect();
    let withdrawn = withdrawn_devices(&inv, &opts)
        .unwrap()
        .into_iter()
        .map(|w| (w.device, w.reason))
        .collect();
    Node::from_slices(env, &slices)
        .unwrap()
        .with_withdrawn(env, DRIVER, "n", withdrawn)
        .unwrap()
}

fn one_g_claim(parent: Option<u32>) -> String {
    let mut expr = "device.attributes['gpu.nvidia.com'].profile == '1g.10gb'".to_string();
    if let Some(p) = parent {
        expr.push_str(&format!(
            " && device.attributes['gpu.nvidia.com'].parentIndex == {p}"
        ));
    }
    claim(&format!(
        "    requests:\n    - name: m\n      exactly:\n        deviceClassName: mig.nvidia.com\n        selectors:\n        - cel: {{expression: \"{expr}\"}}\n"
    ))
}

fn explain_on_blocked(claim_text: &str) -> ClaimReport {
    let env = Environment::new();
    let node = blocked_node(&env);
    let mut objects = Objects::default();
    input::read_text(Path::new("t.yaml"), claim_text, &mut objects).unwrap();
    let classes = compile_classes(&objects.classes).unwrap();
    explain(&env, &objects.claims[0], &classes, &node, &Held::default()).unwrap()
}

/// A claim that only a withdrawn placement would fit is explained naming the holders; the
/// withdrawn placements are listed with why, and never allocated.
#[test]
fn a_claim_for_a_withdrawn_placement_names_the_holder() {
    let why = "placements of gpu-0 withdrawn: held by pid 4242 (nv-hostengine), which blocks a \
               MIG mode switch";
    let r = explain_on_blocked(&one_g_claim(Some(0)));
    assert!(!r.satisfiable);
    assert_eq!(
        r.reason.as_deref(),
        Some(format!("request m needs 1 device, 0 fit ({why})").as_str())
    );
    let q = &r.requests[0];
    assert!(q.fits.is_empty());
    let named: Vec<&str> = q
        .rejected
        .iter()
        .filter(|x| x.reason == why)
        .map(|x| x.device.as_str())
        .collect();
    assert_eq!(
        named,
        [
            "gpu-0-mig-1g10gb-19-0",
            "gpu-0-mig-1g10gb-19-1",
            "gpu-0-mig-1g10gb-19-2",
            "gpu-0-mig-1g10gb-19-3",
            "gpu-0-mig-1g10gb-19-4",
            "gpu-0-mig-1g10gb-19-5",
            "gpu-0-mig-1g10gb-19-6",
        ]
    );
    // Any GPU's 1g.10gb: one of an idle GPU fits; the withdrawn ones are still named.
    let r = explain_on_blocked(&one_g_claim(None));
    assert!(r.satisfiable);
    let device = &r.allocation.as_ref().unwrap()[0].device;
    assert!(
        !device.starts_with("gpu-0-") && !device.starts_with("gpu-1-"),
        "{device}"
    );
    assert!(r.requests[0].rejected.iter().any(|x| x.reason == why));
}

/// A placement tainted `mig-switch-blocked` (a prepare met IN_USE on its GPU) is explained by
/// its taint, valued with the holder's name.
#[test]
fn a_claim_for_a_switch_blocked_placement_names_the_taint() {
    let r = explain_on_blocked(&one_g_claim(Some(1)));
    assert!(!r.satisfiable);
    let q = &r.requests[0];
    let tainted: Vec<&str> = q
        .rejected
        .iter()
        .filter(|x| {
            x.reason
                == "tainted gpu.nvidia.com/mig-switch-blocked=nv-hostengine:NoExecute, not \
                    tolerated"
        })
        .map(|x| x.device.as_str())
        .collect();
    assert_eq!(tainted.len(), 7, "{q:?}");
    assert!(
        tainted
            .iter()
            .all(|d| d.starts_with("gpu-1-mig-1g10gb-19-"))
    );
}
