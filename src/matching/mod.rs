//! Which of a node's devices a ResourceClaim can get, and why not: `nvdra match`.
//!
//! For every request (and every `firstAvailable` subrequest) each device is checked as the
//! scheduler checks it — the class's selectors, then the request's, then `capacity.requests`
//! against the device's (consumable) capacity, then the device's `NoSchedule`/`NoExecute` taints
//! against the request's tolerations, then what other claims already hold ([`Held`]) — and the
//! first failing check is kept with the values that decided it (`memory 48Gi < 80Gi`,
//! `tainted gpu.nvidia.com/xid=79:NoSchedule, not tolerated`, `memory 24Gi > 8Gi left
//! (gpu-0: 72Gi held by claims a, b, c)`). Then a possible allocation is searched by
//! backtracking: `count` or `allocationMode: All`, the first subrequest that works, devices
//! used once (or shared, with their capacity consumed, when `allowMultipleAllocations`), shared
//! counters (`consumesCounters`, taken once per device), and every `matchAttribute` /
//! `distinctAttribute` constraint. The search is bounded ([`MAX_SEARCH_STEPS`]); running out is
//! reported, not waited for.
//!
//! Several claims are matched as the scheduler allocates them, one after another
//! ([`explain_all`]): claims that have a `status.allocation` hold their devices first, then the
//! others in input order, each one that fits holding what it got for the claims after it.
//! Each allocation of a device with `allowMultipleAllocations` consumes every capacity of it, as
//! the 1.36 allocator counts: what the request asks, rounded up to the device's request policy
//! (below its minimum: the minimum; between steps: the next step), or the policy's default when
//! it does not ask (the whole capacity without a policy). So on a GPU that `--shared-capacity`
//! publishes, a claim that asks for no memory consumes all of it (its policy's default) and
//! nothing else fits beside it, and one that asks for no multiprocessors consumes none.
//!
//! A request with `adminAccess: true` may get devices other claims hold, and what it gets is not
//! held for the claims after it ([`Held`] says what the scheduler counts); taints still apply to
//! it. A request for all matching devices (`allocationMode: All`) without admin access fails
//! when one of them is in use, as the allocator takes every one of them or none.
//!
//! Not modelled: DeviceTaintRules (only taints in the slices count), and which node the
//! scheduler would prefer among several.

mod burst;
mod held;
pub mod input;
mod node;
mod report;
mod search;
mod taints;
mod validate;

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{
    CapacityRequestPolicy, DeviceClass, DeviceConstraint, DeviceSelector, DeviceToleration,
    ResourceClaimSpec, ResourceSlice,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use crate::cel::{Environment, Selector};
pub use held::{Held, Trust};
pub use input::{ClaimInput, FieldError, InputError, Objects, Origin};
pub use node::{Candidate, CounterSet, Node, WithdrawnCandidate};
pub use report::{ClaimReport, RequestReport, render_table};
use search::{Outcome, Search};
pub use validate::{Problem, validate};

/// Most search steps before the allocation search gives up.
pub const MAX_SEARCH_STEPS: u64 = 200_000;

/// Slices per node, by name: a node's own slices plus those for all nodes or a node selector
/// (which may apply to any node).
pub fn group_by_node(slices: Vec<ResourceSlice>) -> Vec<(String, Vec<ResourceSlice>)> {
    let (local, shared): (Vec<_>, Vec<_>) =
        slices.into_iter().partition(|s| s.spec.node_name.is_some());
    let mut nodes: BTreeMap<String, Vec<ResourceSlice>> = BTreeMap::new();
    for s in local {
        let n = s.spec.node_name.clone().unwrap_or_default();
        nodes.entry(n).or_default().push(s);
    }
    if nodes.is_empty() && !shared.is_empty() {
        nodes.insert("(any node)".into(), Vec::new());
    }
    for v in nodes.values_mut() {
        v.extend(shared.iter().cloned());
    }
    nodes.into_iter().collect()
}

fn slice_name(s: &ResourceSlice) -> String {
    s.metadata
        .name
        .clone()
        .or_else(|| s.metadata.generate_name.clone())
        .unwrap_or_default()
}

/// A DeviceClass's compiled selectors, and its opaque configs (what a share's config may take
/// from its class: `nvdra match` shows a share's burst limit).
pub struct Class {
    pub name: String,
    pub selectors: Vec<Selector>,
    pub config: Vec<crate::sharing::ConfigEntry>,
}

/// Compiles the classes (the input's first, then the built-in ones not redefined).
pub fn compile_classes(
    classes: &[(DeviceClass, Origin)],
) -> Result<BTreeMap<String, Class>, InputError> {
    let mut out = BTreeMap::new();
    let builtin = input::builtin_classes();
    for (c, origin) in classes.iter().chain(builtin.iter()) {
        let name = c.metadata.name.clone().unwrap_or_default();
        if out.contains_key(&name) {
            continue;
        }
        let selectors = compile_all(
            c.spec.selectors.as_deref().unwrap_or_default(),
            "spec.selectors",
            origin,
            "DeviceClass",
            &name,
        )?;
        let config = c
            .spec
            .config
            .iter()
            .flatten()
            .filter_map(|x| x.opaque.as_ref())
            .map(|o| crate::sharing::ConfigEntry {
                source: crate::sharing::ConfigSource::FromClass,
                requests: Vec::new(),
                driver: o.driver.clone(),
                parameters: o.parameters.0.clone(),
            })
            .collect();
        out.insert(
            name.clone(),
            Class {
                name,
                selectors,
                config,
            },
        );
    }
    Ok(out)
}

fn compile_all(
    selectors: &[DeviceSelector],
    path: &str,
    origin: &Origin,
    kind: &str,
    name: &str,
) -> Result<Vec<Selector>, InputError> {
    selectors
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let expr = s.cel.as_ref().map(|c| c.expression.as_str()).unwrap_or("");
            Selector::compile(expr).map_err(|e| {
                InputError::from(FieldError {
                    file: origin.file.clone(),
                    doc: origin.doc,
                    line: origin.line,
                    kind: kind.to_string(),
                    name: name.to_string(),
                    path: format!("{path}[{i}].cel.expression"),
                    message: e.to_string(),
                })
            })
        })
        .collect()
}

/// How many devices a request wants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Want {
    Count(usize),
    All,
}

/// One way to satisfy a request: the request itself, or one of its subrequests.
struct Alternative {
    /// `req` or `req/sub`.
    name: String,
    class: String,
    want: Want,
    /// `adminAccess: true` (only a request's `exactly` has it, never a subrequest).
    admin: bool,
    /// For `All` without admin access: a matching device in use, in words; the request then
    /// cannot be met.
    blocked: Option<String>,
    /// Fitting devices (indices into the candidates) and, for the others, why not.
    fits: Vec<usize>,
    rejected: Vec<(usize, String)>,
    /// Withdrawn devices ([`Node::withdrawn`]) that would fit but for that: (name, why).
    withdrawn: Vec<(String, String)>,
    /// What one allocation takes of each fitting shared device (capacity name → thousandths).
    consumes: BTreeMap<usize, Amounts>,
}

/// A request or subrequest as written, before it is checked.
struct Shape<'a> {
    /// `req` or `req/sub`.
    name: String,
    /// Its field path, for errors.
    path: String,
    class_name: &'a String,
    selectors: &'a [DeviceSelector],
    mode: Option<&'a str>,
    count: Option<i64>,
    capacity: Option<BTreeMap<String, Quantity>>,
    tolerations: &'a [DeviceToleration],
    admin: bool,
}

struct Request {
    name: String,
    alternatives: Vec<Alternative>,
}

/// Amounts by capacity or counter name, in thousandths.
pub type Amounts = BTreeMap<String, i128>;

/// A device picked for a request.
#[derive(Debug, Clone)]
struct Pick {
    /// `req` or `req/sub`.
    request: String,
    /// Index into [`Node::devices`].
    device: usize,
    /// The capacity it consumes of a shared device.
    consumed: Amounts,
    /// Admin access: the device is not held for the claims after it.
    admin: bool,
}

/// Explains the claims one after another against the node, as the scheduler allocates them:
/// the allocated ones (`status.allocation`) hold their devices, then each of the others, in
/// input order, is matched against what is left and, when it fits, holds what it got (but for
/// what it got with admin access, which holds nothing).
pub fn explain_all(
    env: &Environment,
    claims: &[ClaimInput],
    classes: &BTreeMap<String, Class>,
    node: &Node,
) -> Result<Vec<ClaimReport>, InputError> {
    explain_all_on(env, claims, classes, node, Trust::default())
}

/// [`explain_all`] on a node with `--share-trust-domain` ([`Trust`]): a shared device that a
/// claim of another trust domain holds is rejected for a share, with the holder and the rule.
pub fn explain_all_on(
    env: &Environment,
    claims: &[ClaimInput],
    classes: &BTreeMap<String, Class>,
    node: &Node,
    trust: Trust,
) -> Result<Vec<ClaimReport>, InputError> {
    let mut held = Held::with_trust(trust);
    let mut reports: Vec<Option<ClaimReport>> = claims.iter().map(|_| None).collect();
    for (i, c) in claims.iter().enumerate() {
        if let Some(a) = &c.allocation {
            let (found, missing) = held.hold_allocation(node, &c.name, c.namespace(), a);
            let mut report = report::allocated(c, node, found.clone(), missing);
            let configs = crate::sharing::from_allocation(a);
            burst::annotate(&mut report, &found, c, classes, node, Some(configs));
            reports[i] = Some(report);
        }
    }
    for (i, c) in claims.iter().enumerate() {
        if c.allocation.is_some() {
            continue;
        }
        let (report, picks) = explain_on(env, c, classes, node, &held)?;
        for p in picks.into_iter().flatten().filter(|p| !p.admin) {
            held.hold(p.device, &c.name, c.namespace(), p.consumed);
        }
        reports[i] = Some(report);
    }
    Ok(reports.into_iter().flatten().collect())
}

/// Explains one claim against the node's devices, with what `held` already holds.
pub fn explain(
    env: &Environment,
    claim: &ClaimInput,
    classes: &BTreeMap<String, Class>,
    node: &Node,
    held: &Held,
) -> Result<ClaimReport, InputError> {
    Ok(explain_on(env, claim, classes, node, held)?.0)
}

fn explain_on(
    env: &Environment,
    claim: &ClaimInput,
    classes: &BTreeMap<String, Class>,
    node: &Node,
    held: &Held,
) -> Result<(ClaimReport, Option<Vec<Pick>>), InputError> {
    let field = |path: String, message: String| {
        InputError::from(FieldError {
            file: claim.origin.file.clone(),
            doc: claim.origin.doc,
            line: claim.origin.line,
            kind: claim.kind.to_string(),
            name: claim.name.clone(),
            path,
            message,
        })
    };
    let spec: &ResourceClaimSpec = &claim.spec;
    let base = format!("{}.devices", claim.spec_path);
    let mut requests = Vec::new();
    for (i, r) in spec
        .devices
        .iter()
        .flat_map(|d| d.requests.iter().flatten())
        .enumerate()
    {
        let mut alternatives = Vec::new();
        let shapes: Vec<Shape> = if let Some(e) = &r.exactly {
            vec![Shape {
                name: r.name.clone(),
                path: format!("{base}.requests[{i}].exactly"),
                class_name: &e.device_class_name,
                selectors: e.selectors.as_deref().unwrap_or_default(),
                mode: e.allocation_mode.as_deref(),
                count: e.count,
                capacity: e.capacity.as_ref().and_then(|c| c.requests.clone()),
                tolerations: e.tolerations.as_deref().unwrap_or_default(),
                admin: e.admin_access == Some(true),
            }]
        } else if let Some(subs) = &r.first_available {
            subs.iter()
                .enumerate()
                .map(|(k, s)| Shape {
                    name: format!("{}/{}", r.name, s.name),
                    path: format!("{base}.requests[{i}].firstAvailable[{k}]"),
                    class_name: &s.device_class_name,
                    selectors: s.selectors.as_deref().unwrap_or_default(),
                    mode: s.allocation_mode.as_deref(),
                    count: s.count,
                    capacity: s.capacity.as_ref().and_then(|c| c.requests.clone()),
                    tolerations: s.tolerations.as_deref().unwrap_or_default(),
                    admin: false,
                })
                .collect()
        } else {
            return Err(field(
                format!("{base}.requests[{i}]"),
                "a request needs exactly or firstAvailable".into(),
            ));
        };
        for shape in shapes {
            let Shape {
                name,
                path,
                class_name,
                selectors,
                mode,
                count,
                capacity,
                tolerations,
                admin,
            } = shape;
            let class = classes.get(class_name.as_str()).ok_or_else(|| {
                field(
                    format!("{path}.deviceClassName"),
                    format!(
                        "no DeviceClass {class_name:?} (pass it with -f; known: {})",
                        classes.keys().cloned().collect::<Vec<_>>().join(", ")
                    ),
                )
            })?;
            let own = compile_all(
                selectors,
                &format!("{path}.selectors"),
                &claim.origin,
                claim.kind,
                &claim.name,
            )?;
            let want = match (mode.unwrap_or("ExactCount"), count) {
                ("All", _) => Want::All,
                ("ExactCount", c) => {
                    let c = c.unwrap_or(1);
                    if c < 1 {
                        return Err(field(
                            format!("{path}.count"),
                            format!("count {c} is less than 1"),
                        ));
                    }
                    Want::Count(c as usize)
                }
                (other, _) => {
                    return Err(field(
                        format!("{path}.allocationMode"),
                        format!("unknown allocation mode {other:?} (ExactCount or All)"),
                    ));
                }
            };
            let capacity: BTreeMap<String, String> = capacity
                .unwrap_or_default()
                .into_iter()
                .map(|(k, q)| (k, q.0))
                .collect();
            for (k, q) in &capacity {
                if parse_milli(q).is_none() {
                    return Err(field(
                        format!("{path}.capacity.requests[{k}]"),
                        format!("invalid quantity {q:?}"),
                    ));
                }
            }
            for (j, t) in tolerations.iter().enumerate() {
                if !taints::valid_operator(t.operator.as_deref()) {
                    return Err(field(
                        format!("{path}.tolerations[{j}].operator"),
                        format!(
                            "unknown toleration operator {:?} (Exists or Equal)",
                            t.operator.as_deref().unwrap_or_default()
                        ),
                    ));
                }
            }
            let mut fits = Vec::new();
            let mut rejected = Vec::new();
            let mut consumes = BTreeMap::new();
            let mut blocked = None;
            for d in 0..node.devices.len() {
                let c = match check(env, class, &own, &capacity, tolerations, &node.devices[d]) {
                    Ok(c) => c,
                    Err(why) => {
                        rejected.push((d, why));
                        continue;
                    }
                };
                match held.why_not(node, d, &c, admin, claim.namespace()) {
                    None => {
                        fits.push(d);
                        consumes.insert(d, c);
                    }
                    Some(busy) => {
                        if want == Want::All && busy.in_use && blocked.is_none() {
                            blocked =
                                Some(format!("{}: {}", node.devices[d].device.name, busy.reason));
                        }
                        rejected.push((d, busy.reason));
                    }
                }
            }
            // Withdrawn devices that would fit: named, with why they are not offered.
            let withdrawn = node
                .withdrawn
                .iter()
                .filter(|w| check(env, class, &own, &capacity, tolerations, &w.candidate).is_ok())
                .map(|w| (w.candidate.device.name.clone(), w.reason.clone()))
                .collect();
            alternatives.push(Alternative {
                name,
                class: class.name.clone(),
                want,
                admin,
                blocked,
                fits,
                rejected,
                withdrawn,
                consumes,
            });
        }
        requests.push(Request {
            name: r.name.clone(),
            alternatives,
        });
    }
    let constraints: Vec<DeviceConstraint> = spec
        .devices
        .as_ref()
        .and_then(|d| d.constraints.clone())
        .unwrap_or_default();
    for (i, c) in constraints.iter().enumerate() {
        for r in c.requests.iter().flatten() {
            let parent = r.split('/').next().unwrap_or(r);
            if !requests.iter().any(|q| q.name == parent) {
                return Err(field(
                    format!("{base}.constraints[{i}].requests"),
                    format!("no request {r:?}"),
                ));
            }
        }
    }
    let search = Search {
        node,
        held,
        requests: &requests,
        constraints: &constraints,
    };
    let outcome = search.run(&constraints.iter().map(|_| true).collect::<Vec<_>>());
    let (allocation, reason) = match outcome {
        Outcome::Found(picks) => (Some(picks), None),
        Outcome::GaveUp => (
            None,
            Some(format!(
                "the search gave up after {MAX_SEARCH_STEPS} steps; no allocation was found"
            )),
        ),
        Outcome::None => (None, Some(search.why_not())),
    };
    let mut report = report::build(
        claim,
        &requests,
        &constraints,
        node,
        allocation.clone(),
        reason,
    );
    burst::annotate(
        &mut report,
        allocation.as_deref().unwrap_or_default(),
        claim,
        classes,
        node,
        None,
    );
    Ok((report, allocation))
}

/// The first check `cand` fails, in words; when it fits, what one allocation consumes of it
/// (by capacity name, in thousandths; nothing for an exclusive device, which is taken whole).
fn check(
    env: &Environment,
    class: &Class,
    own: &[Selector],
    capacity: &BTreeMap<String, String>,
    tolerations: &[DeviceToleration],
    cand: &Candidate,
) -> Result<Amounts, String> {
    for (i, s) in class.selectors.iter().enumerate() {
        if !matches!(s.evaluate(env, &cand.value), Ok(true)) {
            let why = s
                .explain(env, &cand.value)
                .unwrap_or_else(|| "false".into());
            return Err(format!("class {} selector[{i}]: {why}", class.name));
        }
    }
    for (i, s) in own.iter().enumerate() {
        if !matches!(s.evaluate(env, &cand.value), Ok(true)) {
            let why = s
                .explain(env, &cand.value)
                .unwrap_or_else(|| "false".into());
            return Err(format!("selectors[{i}]: {why}"));
        }
    }
    if let Some(set) = cand.unknown_sets.first() {
        return Err(format!(
            "consumes counters of {set}, which no slice of pool {} has",
            cand.pool
        ));
    }
    let shared = cand.shared();
    for name in capacity.keys() {
        let qualified = qualify(name, &cand.driver);
        if !cand
            .device
            .capacity
            .iter()
            .flatten()
            .any(|(k, _)| qualify(k, &cand.driver) == qualified)
        {
            return Err(format!("capacity {name}: the device has none"));
        }
    }
    // Every capacity of a shared device is consumed: what the request asks, rounded up to the
    // policy, or else the policy's default, or else all of it.
    let mut consumes = BTreeMap::new();
    for (key, have) in cand.device.capacity.iter().flatten() {
        let qualified = qualify(key, &cand.driver);
        let asked = capacity
            .iter()
            .find(|(k, _)| qualify(k, &cand.driver) == qualified);
        if !shared && asked.is_none() {
            continue;
        }
        let Some(value) = parse_milli(&have.value.0) else {
            return Err(format!(
                "capacity {key}: invalid quantity {:?}",
                have.value.0
            ));
        };
        let (want, shown) = match asked {
            Some((name, q)) => {
                // Checked in `explain`.
                let want = parse_milli(q).unwrap_or(0);
                let want = match (&have.request_policy, shared) {
                    (Some(p), true) => round_up(p, want).ok_or_else(|| {
                        format!("capacity {name}: {q} is outside the device's request policy")
                    })?,
                    _ => want,
                };
                (want, format!("capacity {name}"))
            }
            None => {
                let default = have
                    .request_policy
                    .as_ref()
                    .and_then(|p| p.default.as_ref())
                    .and_then(|q| parse_milli(&q.0));
                (
                    default.unwrap_or(value),
                    format!("capacity {key} (default)"),
                )
            }
        };
        if want > value {
            let q = asked
                .map(|(_, q)| q.clone())
                .unwrap_or_else(|| format_milli(want));
            return Err(format!("{shown} {} < requested {q}", have.value.0));
        }
        if shared {
            consumes.insert(key.clone(), want);
        }
    }
    // Taints last: a health taint is about the device's state, not its kind, so the report
    // names it only for a device that would otherwise fit; one that has too little memory
    // anyway is reported for that, which stays true after the GPU recovers.
    let left = taints::untolerated(
        cand.device.taints.as_deref().unwrap_or_default(),
        tolerations,
    );
    if !left.is_empty() {
        let names: Vec<String> = left.into_iter().map(taints::describe).collect();
        return Err(format!("tainted {}, not tolerated", names.join(", ")));
    }
    Ok(consumes)
}

/// A capacity request rounded up to the next value the policy allows; `None` above its max.
fn round_up(p: &CapacityRequestPolicy, want: i128) -> Option<i128> {
    if let Some(values) = &p.valid_values {
        let mut vals: Vec<i128> = values.iter().filter_map(|v| parse_milli(&v.0)).collect();
        vals.sort();
        return vals.into_iter().find(|v| *v >= want);
    }
    if let Some(r) = &p.valid_range {
        let min = parse_milli(&r.min.0)?;
        if want <= min {
            return Some(min);
        }
        let mut w = want;
        if let Some(step) = r
            .step
            .as_ref()
            .and_then(|s| parse_milli(&s.0))
            .filter(|s| *s > 0)
        {
            let over = (w - min) % step;
            if over != 0 {
                w += step - over;
            }
        }
        if let Some(max) = r.max.as_ref().and_then(|m| parse_milli(&m.0))
            && w > max
        {
            return None;
        }
        return Some(w);
    }
    Some(want)
}

/// `name` with the driver's domain when it has none.
fn qualify(name: &str, driver: &str) -> String {
    if name.contains('/') {
        name.to_string()
    } else {
        format!("{driver}/{name}")
    }
}

/// A Kubernetes quantity in thousandths (`1`, `500m`, `80Gi`, `1.5G`, `1e3`).
pub fn parse_milli(s: &str) -> Option<i128> {
    let s = s.trim();
    let (num, suffix) = {
        let end = s
            .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '+' || c == '-'))
            .unwrap_or(s.len());
        s.split_at(end)
    };
    if num.is_empty() {
        return None;
    }
    let (neg, num) = match num.strip_prefix('-') {
        Some(n) => (true, n),
        None => (false, num.strip_prefix('+').unwrap_or(num)),
    };
    let (int, frac) = num.split_once('.').unwrap_or((num, ""));
    if int.is_empty() && frac.is_empty()
        || !int.chars().chain(frac.chars()).all(|c| c.is_ascii_digit())
    {
        return None;
    }
    // value = digits × 10^(-frac.len()) × multiplier, kept in thousandths.
    let digits: i128 = format!("{int}{frac}").parse().ok()?;
    let (num_mul, den_pow10): (i128, u32) = match suffix {
        "" => (1, 0),
        "m" => (1, 3),
        "k" => (1_000, 0),
        "M" => (1_000_000, 0),
        "G" => (1_000_000_000, 0),
        "T" => (1_000_000_000_000, 0),
        "P" => (1_000_000_000_000_000, 0),
        "E" => (1_000_000_000_000_000_000, 0),
        "Ki" => (1 << 10, 0),
        "Mi" => (1 << 20, 0),
        "Gi" => (1 << 30, 0),
        "Ti" => (1 << 40, 0),
        "Pi" => (1 << 50, 0),
        "Ei" => (1 << 60, 0),
        e if e.starts_with(['e', 'E']) => {
            let exp: i32 = e[1..].parse().ok()?;
            if !(-3..=18).contains(&exp) {
                return None;
            }
            if exp >= 0 {
                (10i128.pow(exp as u32), 0)
            } else {
                (1, (-exp) as u32)
            }
        }
        _ => return None,
    };
    let scaled = digits.checked_mul(num_mul)?.checked_mul(1000)?;
    let den = 10i128.checked_pow(frac.len() as u32 + den_pow10)?;
    let v = scaled / den;
    Some(if neg { -v } else { v })
}

/// Thousandths as a Kubernetes quantity: `24Gi`, `7831Mi`, `25`, `1500m`.
pub fn format_milli(v: i128) -> String {
    if v % 1000 != 0 {
        return format!("{v}m");
    }
    let n = v / 1000;
    for (suffix, unit) in [
        ("Ti", 1i128 << 40),
        ("Gi", 1 << 30),
        ("Mi", 1 << 20),
        ("Ki", 1 << 10),
    ] {
        if n != 0 && n % unit == 0 {
            return format!("{}{suffix}", n / unit);
        }
    }
    n.to_string()
}

#[cfg(test)]
mod tests;
