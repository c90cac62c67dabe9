//! The API server's rules for `resource.k8s.io/v1` ResourceSlices, to check desired slices
//! before publishing them (a slice the server would refuse is a driver's bug better caught in
//! its tests than in a 422 at run time).
//!
//! [`validate`] checks one slice the way the API server's validation does (Kubernetes 1.34 and
//! 1.35; where they differ, the shape of the slice says which applies: a slice with both shared
//! counters and devices is a 1.34 slice). [`validate_pool`] checks what spans the slices of a pool:
//! unique names, consumptions that reference existing counters. A few rules are stricter than the
//! API server where the looser form would mislead CEL or the scheduler (an attribute given both
//! with and without the driver's domain, a device consuming more than a counter holds):
//! [`Violation::server_rejects`] tells them apart.
//!
//! Every [`Violation`]'s `rule` starts with a stable rule id (`device-name: …`), so callers and
//! tests can tell them apart.
//!
//! ```
//! use kubelet_plugin::k8s_openapi::api::resource::v1::{Device, ResourcePool, ResourceSliceSpec};
//! use kubelet_plugin::validate::validate;
//!
//! let mut spec = ResourceSliceSpec {
//!     driver: "fpga.example.com".into(),
//!     node_name: Some("node-a".into()),
//!     pool: ResourcePool { name: "node-a".into(), generation: 0, resource_slice_count: 1 },
//!     devices: Some(vec![Device { name: "fpga-0".into(), ..Default::default() }]),
//!     ..Default::default()
//! };
//! assert!(validate(&spec).is_empty());
//! spec.devices.as_mut().unwrap()[0].name = "FPGA 0".into();
//! assert_eq!(validate(&spec)[0].rule_id(), "device-name");
//! ```

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use k8s_openapi::api::resource::v1::{
    CapacityRequestPolicy, Device, DeviceAttribute, ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

/// Most devices in one slice.
pub const MAX_DEVICES_PER_SLICE: usize = 128;
/// Most devices in one slice when any of them consumes counters or has taints (1.35).
pub const MAX_DEVICES_PER_SLICE_WITH_COUNTERS_OR_TAINTS: usize = 64;
/// Most attributes and capacities of one device, together.
pub const MAX_ATTRIBUTES_AND_CAPACITIES: usize = 32;
/// Longest string or version attribute value.
pub const MAX_VALUE_LENGTH: usize = 64;
/// Most counter sets in one slice (1.35).
pub const MAX_COUNTER_SETS_PER_SLICE: usize = 8;
/// Most counters in one counter set (1.35), and in all sets of a slice that also lists devices
/// (1.34).
pub const MAX_COUNTERS_PER_SET: usize = 32;
/// Most counter consumptions of one device (1.35).
pub const MAX_CONSUMPTIONS_PER_DEVICE: usize = 2;
/// Most counters in one consumption (1.35), and consumed by one device in all (1.34).
pub const MAX_COUNTERS_PER_CONSUMPTION: usize = 32;

/// The rules this module checks that the API server does not (see [`Violation::server_rejects`]).
const STRICTER_THAN_THE_SERVER: [&str; 2] = ["duplicate-attribute", "counter-exceeded"];

/// Whether `d` consumes counters or has taints: then its slice may hold at most
/// [`MAX_DEVICES_PER_SLICE_WITH_COUNTERS_OR_TAINTS`] devices instead of
/// [`MAX_DEVICES_PER_SLICE`].
pub fn has_counters_or_taints(d: &Device) -> bool {
    d.consumes_counters.as_ref().is_some_and(|c| !c.is_empty())
        || d.taints.as_ref().is_some_and(|t| !t.is_empty())
}

/// A lower-case DNS label (RFC 1123) as Kubernetes checks it: 1..=`max` characters of
/// `[a-z0-9-]`, alphanumeric at both ends.
pub fn is_dns_label(s: &str, max: usize) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= max
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
}

/// A lower-case DNS subdomain (RFC 1123): 1..=`max` characters, dot-separated labels of at most
/// 63.
pub fn is_dns_subdomain(s: &str, max: usize) -> bool {
    !s.is_empty() && s.len() <= max && s.split('.').all(|l| is_dns_label(l, 63))
}

/// A quantity of whole units (`80Gi`, `4864Mi`, `1G`, `1024`), as the rules that compare
/// quantities read it; `None` for any other form (left to [`is_quantity`]) or on overflow.
///
/// ```
/// assert_eq!(kubelet_plugin::validate::whole_quantity("80Gi"), Some(80 << 30));
/// assert_eq!(kubelet_plugin::validate::whole_quantity("1.5Gi"), None);
/// ```
pub fn whole_quantity(s: &str) -> Option<u64> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (digits, suffix) = s.split_at(split);
    let value: u64 = digits.parse().ok()?;
    let mult: u64 = match suffix {
        "" => 1,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "Ti" => 1 << 40,
        "Pi" => 1 << 50,
        "k" => 1_000,
        "M" => 1_000_000,
        "G" => 1_000_000_000,
        "T" => 1_000_000_000_000,
        _ => return None,
    };
    value.checked_mul(mult)
}

/// Longest driver name (and attribute domain).
const MAX_DRIVER_NAME: usize = 63;
/// Longest C identifier in a qualified name.
const MAX_ID: usize = 32;
/// Longest pool name.
const MAX_POOL_NAME: usize = 253;
/// Most taints per device (1.35; 1.34 allowed 4).
const MAX_TAINTS: usize = 16;
/// Most binding conditions (and binding failure conditions) per device.
const MAX_BINDING_CONDITIONS: usize = 4;
/// 1.34: most counters consumed by the devices of one slice.
const MAX_CONSUMED_COUNTERS_PER_SLICE_1_34: usize = 1024;

/// One broken rule: which device (if the rule is about one) and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Violation {
    /// The device the rule is about; `None` for the slice's (or pool's) own fields.
    pub device: Option<String>,
    /// `<rule-id>: <what is wrong, with the offending value>`.
    pub rule: String,
}

impl Violation {
    fn slice(rule: impl Into<String>) -> Self {
        Self {
            device: None,
            rule: rule.into(),
        }
    }

    fn device(device: &str, rule: impl Into<String>) -> Self {
        Self {
            device: Some(device.to_string()),
            rule: rule.into(),
        }
    }

    /// The stable id at the start of `rule`, e.g. `device-name`.
    pub fn rule_id(&self) -> &str {
        self.rule.split_once(':').map_or(&self.rule, |(id, _)| id)
    }

    /// Whether the API server refuses a slice for this; `false` for the few rules that are
    /// stricter than the server's (an attribute given both with and without the driver's domain,
    /// a device consuming more than a counter holds).
    pub fn server_rejects(&self) -> bool {
        !STRICTER_THAN_THE_SERVER.contains(&self.rule_id())
    }
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.device {
            Some(d) => write!(f, "device {d}: {}", self.rule),
            None => f.write_str(&self.rule),
        }
    }
}

fn is_c_identifier(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && (b[0].is_ascii_alphabetic() || b[0] == b'_')
        && b.iter().all(|c| c.is_ascii_alphanumeric() || *c == b'_')
}

/// Whether `s` is a semantic version 2.0.0 as the API server checks it.
pub fn is_semver(s: &str) -> bool {
    let numeric = |p: &str| {
        !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) && (p == "0" || !p.starts_with('0'))
    };
    let ident =
        |p: &str| !p.is_empty() && p.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-');
    let (rest, build) = match s.split_once('+') {
        Some((r, b)) => (r, Some(b)),
        None => (s, None),
    };
    let (core, pre) = match rest.split_once('-') {
        Some((c, p)) => (c, Some(p)),
        None => (rest, None),
    };
    let parts: Vec<&str> = core.split('.').collect();
    parts.len() == 3
        && parts.iter().all(|p| numeric(p))
        && pre.is_none_or(|pre| {
            pre.split('.')
                .all(|id| ident(id) && (!id.bytes().all(|b| b.is_ascii_digit()) || numeric(id)))
        })
        && build.is_none_or(|b| b.split('.').all(ident))
}

/// Whether `s` is a Kubernetes quantity: a decimal number and an optional suffix (`80Gi`, `1.5`,
/// `100m`, `1e3`).
pub fn is_quantity(s: &str) -> bool {
    let s = s.strip_prefix(['+', '-']).unwrap_or(s);
    let end = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, suffix) = s.split_at(end);
    let digits = num.bytes().filter(u8::is_ascii_digit).count();
    let dots = num.bytes().filter(|b| *b == b'.').count();
    if digits == 0 || dots > 1 {
        return false;
    }
    match suffix {
        "" | "Ki" | "Mi" | "Gi" | "Ti" | "Pi" | "Ei" | "n" | "u" | "m" | "k" | "M" | "G" | "T"
        | "P" | "E" => true,
        exp => {
            let Some(exp) = exp.strip_prefix(['e', 'E']) else {
                return false;
            };
            let exp = exp.strip_prefix(['+', '-']).unwrap_or(exp);
            !exp.is_empty() && exp.bytes().all(|b| b.is_ascii_digit())
        }
    }
}

/// A label key as taint keys use it: optional `prefix/` (DNS subdomain ≤253), then a name of at
/// most 63 characters, alphanumeric at both ends, `-_.` inside.
fn is_label_key(s: &str) -> bool {
    let (prefix, name) = match s.rsplit_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, s),
    };
    prefix.is_none_or(|p| is_dns_subdomain(p, 253)) && is_label_value(name) && !name.is_empty()
}

fn is_label_value(s: &str) -> bool {
    let b = s.as_bytes();
    b.is_empty()
        || (b.len() <= 63
            && b[0].is_ascii_alphanumeric()
            && b[b.len() - 1].is_ascii_alphanumeric()
            && b.iter()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.')))
}

/// Checks an attribute or capacity name: a C identifier of at most 32 characters, optionally
/// prefixed by a domain (a DNS subdomain of at most 63 characters) and `/`.
fn check_qualified_name(name: &str) -> Option<String> {
    let (domain, id) = match name.split_once('/') {
        Some((d, i)) => (Some(d), i),
        None => (None, name),
    };
    if let Some(d) = domain
        && !is_dns_subdomain(d, MAX_DRIVER_NAME)
    {
        return Some(format!(
            "qualified-name: domain {d:?} of {name:?} must be a lower-case DNS subdomain of at \
             most {MAX_DRIVER_NAME} characters"
        ));
    }
    if !is_c_identifier(id) || id.len() > MAX_ID {
        return Some(format!(
            "qualified-name: {name:?} must be a C identifier of at most {MAX_ID} characters \
             (letters, digits, '_'), optionally after a domain and '/'"
        ));
    }
    None
}

fn check_attribute(name: &str, a: &DeviceAttribute, out: &mut Vec<String>) {
    // The values set, their strings (by kind) and their versions; Kubernetes 1.36 adds lists
    // of each kind (the program's k8s-openapi version decides whether the fields exist).
    #[allow(unused_mut)]
    let mut set = [
        a.bool.is_some(),
        a.int.is_some(),
        a.string.is_some(),
        a.version.is_some(),
    ]
    .iter()
    .filter(|x| **x)
    .count();
    #[allow(unused_mut)]
    let mut texts: Vec<(&str, &String)> = a
        .string
        .iter()
        .map(|s| ("string", s))
        .chain(a.version.iter().map(|v| ("version", v)))
        .collect();
    #[allow(unused_mut)]
    let mut versions: Vec<&String> = a.version.iter().collect();
    k8s_openapi::k8s_if_ge_1_36! {
        set += [
            a.bools.is_some(),
            a.ints.is_some(),
            a.strings.is_some(),
            a.versions.is_some(),
        ]
        .iter()
        .filter(|x| **x)
        .count();
        texts.extend(a.strings.iter().flatten().map(|s| ("string", s)));
        texts.extend(a.versions.iter().flatten().map(|v| ("version", v)));
        versions.extend(a.versions.iter().flatten());
    }
    if set != 1 {
        out.push(format!(
            "attribute-value: attribute {name:?} must have exactly one of bool, int, string, \
             version; it has {set}"
        ));
    }
    for (kind, value) in texts {
        if value.len() > MAX_VALUE_LENGTH {
            out.push(format!(
                "value-too-long: {kind} attribute {name:?} is {} characters, at most \
                 {MAX_VALUE_LENGTH} are allowed",
                value.len()
            ));
        }
    }
    for v in versions {
        if !is_semver(v) {
            out.push(format!(
                "version-not-semver: version attribute {name:?} = {v:?} is not a semantic \
                 version 2.0.0 (MAJOR.MINOR.PATCH, no leading zeros)"
            ));
        }
    }
}

fn check_device(driver: &str, per_device_node_selection: bool, d: &Device) -> Vec<String> {
    let mut out = Vec::new();
    if !is_dns_label(&d.name, 63) {
        out.push(format!(
            "device-name: {:?} must be a DNS label (at most 63 lower-case letters, digits and '-', \
             starting and ending with a letter or digit)",
            d.name
        ));
    }
    let attributes = d.attributes.as_ref();
    let capacities = d.capacity.as_ref();
    let total = attributes.map_or(0, BTreeMap::len) + capacities.map_or(0, BTreeMap::len);
    if total > MAX_ATTRIBUTES_AND_CAPACITIES {
        out.push(format!(
            "too-many-attributes: {total} attributes and capacities, at most \
             {MAX_ATTRIBUTES_AND_CAPACITIES} are allowed"
        ));
    }
    for (kind, names) in [
        (
            "attribute",
            attributes.map(|a| a.keys().collect::<Vec<_>>()),
        ),
        ("capacity", capacities.map(|c| c.keys().collect::<Vec<_>>())),
    ] {
        let names = names.unwrap_or_default();
        let mut seen = BTreeSet::new();
        for name in names {
            if let Some(problem) = check_qualified_name(name) {
                out.push(problem);
            }
            let local = name
                .strip_prefix(driver)
                .and_then(|rest| rest.strip_prefix('/'))
                .unwrap_or(name);
            if !seen.insert(local) {
                out.push(format!(
                    "duplicate-attribute: {kind} {local:?} is given both with and without the \
                     driver's domain {driver:?}"
                ));
            }
        }
    }
    for (name, a) in attributes.into_iter().flatten() {
        check_attribute(name, a, &mut out);
    }
    let allow_multiple = d.allow_multiple_allocations == Some(true);
    for (name, c) in capacities.into_iter().flatten() {
        if !is_quantity(&c.value.0) {
            out.push(format!(
                "quantity: capacity {name:?} = {:?} is not a Kubernetes quantity",
                c.value.0
            ));
        }
        if c.request_policy.is_some() && !allow_multiple {
            out.push(format!(
                "request-policy: capacity {name:?} has a requestPolicy but the device does not \
                 set allowMultipleAllocations"
            ));
        }
        if let Some(p) = &c.request_policy {
            check_request_policy(name, &c.value.0, p, &mut out);
        }
    }
    if let Some(consumptions) = &d.consumes_counters {
        if consumptions.len() > MAX_CONSUMPTIONS_PER_DEVICE {
            out.push(format!(
                "too-many-consumptions: {} counter consumptions, at most \
                 {MAX_CONSUMPTIONS_PER_DEVICE} are allowed",
                consumptions.len()
            ));
        }
        let mut sets = BTreeSet::new();
        for c in consumptions {
            if !is_dns_label(&c.counter_set, 63) {
                out.push(format!(
                    "counter-set-name: consumed counter set {:?} must be a DNS label",
                    c.counter_set
                ));
            }
            if !sets.insert(&c.counter_set) {
                out.push(format!(
                    "duplicate-consumption: counter set {:?} is consumed twice",
                    c.counter_set
                ));
            }
            if c.counters.is_empty() || c.counters.len() > MAX_COUNTERS_PER_CONSUMPTION {
                out.push(format!(
                    "consumption-counters: consumes {} counters from {:?}; between 1 and \
                     {MAX_COUNTERS_PER_CONSUMPTION} are allowed",
                    c.counters.len(),
                    c.counter_set
                ));
            }
            for (name, counter) in &c.counters {
                check_counter(name, &counter.value.0, &mut out);
            }
        }
    }
    if let Some(taints) = &d.taints {
        if taints.len() > MAX_TAINTS {
            out.push(format!(
                "too-many-taints: {} taints, at most {MAX_TAINTS} are allowed",
                taints.len()
            ));
        }
        for t in taints {
            if !is_label_key(&t.key) {
                out.push(format!("taint: key {:?} is not a label key", t.key));
            }
            if let Some(v) = &t.value
                && !is_label_value(v)
            {
                out.push(format!(
                    "taint: value {v:?} of {:?} is not a label value",
                    t.key
                ));
            }
            if !matches!(t.effect.as_str(), "NoSchedule" | "NoExecute" | "None") {
                out.push(format!(
                    "taint: effect {:?} of {:?} must be NoSchedule, NoExecute or None",
                    t.effect, t.key
                ));
            }
        }
    }
    for (kind, conditions) in [
        ("bindingConditions", &d.binding_conditions),
        ("bindingFailureConditions", &d.binding_failure_conditions),
    ] {
        if let Some(c) = conditions
            && c.len() > MAX_BINDING_CONDITIONS
        {
            out.push(format!(
                "binding-conditions: {} {kind}, at most {MAX_BINDING_CONDITIONS} are allowed",
                c.len()
            ));
        }
    }
    let node_fields = [
        d.node_name.is_some(),
        d.node_selector.is_some(),
        d.all_nodes.is_some(),
    ]
    .iter()
    .filter(|x| **x)
    .count();
    if per_device_node_selection && node_fields != 1 {
        out.push(format!(
            "per-device-node-selection: the slice sets perDeviceNodeSelection, so exactly one of \
             nodeName, nodeSelector, allNodes is required; {node_fields} are set"
        ));
    } else if !per_device_node_selection && node_fields != 0 {
        out.push(
            "per-device-node-selection: nodeName, nodeSelector and allNodes may be set on a \
             device only when the slice sets perDeviceNodeSelection"
                .to_string(),
        );
    }
    out
}

/// The rules of a consumable capacity's `requestPolicy` (as the API server validates them), for
/// quantities that are whole numbers (bytes, counts); others are left to the quantity check.
fn check_request_policy(name: &str, value: &str, p: &CapacityRequestPolicy, out: &mut Vec<String>) {
    let n = |q: &Quantity| whole_quantity(&q.0);
    let mut fail = |rule: &str| {
        out.push(format!(
            "request-policy: capacity {name:?} (value {value}): {rule}"
        ))
    };
    let Some(value) = whole_quantity(value) else {
        return;
    };
    let default = p.default.as_ref().and_then(n);
    if p.default.is_none() && (p.valid_range.is_some() || p.valid_values.is_some()) {
        fail("a default is required when validRange or validValues is set");
    }
    match (&p.valid_range, &p.valid_values) {
        (Some(_), Some(_)) => fail("validRange and validValues are mutually exclusive"),
        (Some(r), None) => {
            let (Some(min), max, step) = (
                n(&r.min),
                r.max.as_ref().and_then(n),
                r.step.as_ref().and_then(n),
            ) else {
                return;
            };
            let max_or_value = max.unwrap_or(value);
            if min > max_or_value || max_or_value > value {
                fail("validRange must have min <= max <= value");
            }
            if let Some(d) = default
                && (d < min || d > max_or_value)
            {
                fail("the default must lie within validRange");
            }
            if let Some(step) = step {
                if step == 0 {
                    fail("validRange.step must be positive");
                    return;
                }
                if min.saturating_add(step) > value {
                    fail("validRange.min + step must not exceed the value");
                }
                let off_step = |x: u64| x >= min && !(x - min).is_multiple_of(step);
                if max.is_some_and(off_step) {
                    fail("validRange.max must be min plus a multiple of step");
                }
                if default.is_some_and(off_step) {
                    fail("the default must be min plus a multiple of step");
                }
            }
        }
        (None, Some(values)) => {
            let values: Vec<u64> = values.iter().filter_map(n).collect();
            if values.is_empty() || values.len() > 10 {
                fail("validValues must hold 1 to 10 values");
            }
            if !values.windows(2).all(|w| w[0] < w[1]) || values.iter().any(|v| *v > value) {
                fail("validValues must be ascending and at most the value");
            }
            if default.is_some_and(|d| !values.contains(&d)) {
                fail("validValues must contain the default");
            }
        }
        (None, None) => {}
    }
}

fn check_counter(name: &str, value: &str, out: &mut Vec<String>) {
    if !is_dns_label(name, 63) {
        out.push(format!(
            "counter-name: counter {name:?} must be a DNS label"
        ));
    }
    if !is_quantity(value) {
        out.push(format!(
            "quantity: counter {name:?} = {value:?} is not a Kubernetes quantity"
        ));
    }
}

/// Checks one slice against the API server's rules; empty when it would be accepted.
pub fn validate(spec: &ResourceSliceSpec) -> Vec<Violation> {
    let mut v = Vec::new();
    if !is_dns_subdomain(&spec.driver, MAX_DRIVER_NAME) {
        v.push(Violation::slice(format!(
            "driver-name: {:?} must be a lower-case DNS subdomain of at most {MAX_DRIVER_NAME} \
             characters",
            spec.driver
        )));
    }
    let pool = &spec.pool;
    if pool.name.is_empty()
        || pool.name.len() > MAX_POOL_NAME
        || !pool.name.split('/').all(|p| is_dns_subdomain(p, 253))
    {
        v.push(Violation::slice(format!(
            "pool-name: {:?} must be one or more DNS subdomains separated by '/', at most \
             {MAX_POOL_NAME} characters",
            pool.name
        )));
    }
    if pool.generation < 0 {
        v.push(Violation::slice(format!(
            "pool-generation: {} must not be negative",
            pool.generation
        )));
    }
    if pool.resource_slice_count <= 0 {
        v.push(Violation::slice(format!(
            "pool-slice-count: resourceSliceCount {} must be greater than zero",
            pool.resource_slice_count
        )));
    }

    let mut selection = Vec::new();
    if let Some(n) = &spec.node_name {
        if is_dns_subdomain(n, 253) {
            selection.push("nodeName");
        } else {
            v.push(Violation::slice(format!(
                "node-selection: nodeName {n:?} must be a node name (a DNS subdomain)"
            )));
        }
    }
    if let Some(sel) = &spec.node_selector {
        selection.push("nodeSelector");
        if sel.node_selector_terms.len() != 1 {
            v.push(Violation::slice(format!(
                "node-selection: nodeSelector must have exactly one term, it has {}",
                sel.node_selector_terms.len()
            )));
        }
    }
    for (name, field) in [
        ("allNodes", spec.all_nodes),
        ("perDeviceNodeSelection", spec.per_device_node_selection),
    ] {
        match field {
            Some(true) => selection.push(name),
            Some(false) => v.push(Violation::slice(format!(
                "node-selection: {name} must be unset or true"
            ))),
            None => {}
        }
    }
    if selection.len() != 1 {
        v.push(Violation::slice(format!(
            "node-selection: exactly one of nodeName, nodeSelector, allNodes, \
             perDeviceNodeSelection is required; set: [{}]",
            selection.join(", ")
        )));
    }

    let devices: &[Device] = spec.devices.as_deref().unwrap_or_default();
    let counter_sets = spec.shared_counters.as_deref().unwrap_or_default();
    let advanced = devices.iter().any(has_counters_or_taints);
    let max_devices = if advanced {
        MAX_DEVICES_PER_SLICE_WITH_COUNTERS_OR_TAINTS
    } else {
        MAX_DEVICES_PER_SLICE
    };
    if devices.len() > max_devices {
        v.push(Violation::slice(format!(
            "too-many-devices: {} devices, at most {max_devices} are allowed{}",
            devices.len(),
            if advanced {
                " when a device consumes counters or has taints"
            } else {
                ""
            }
        )));
    }
    let per_device = spec.per_device_node_selection == Some(true);
    let mut names = BTreeSet::new();
    for d in devices {
        if !names.insert(d.name.as_str()) {
            v.push(Violation::device(
                &d.name,
                "duplicate-device: the name is used twice in the slice",
            ));
        }
        for rule in check_device(&spec.driver, per_device, d) {
            v.push(Violation::device(&d.name, rule));
        }
    }

    if counter_sets.len() > MAX_COUNTER_SETS_PER_SLICE {
        v.push(Violation::slice(format!(
            "too-many-counter-sets: {} counter sets, at most {MAX_COUNTER_SETS_PER_SLICE} are \
             allowed in one slice",
            counter_sets.len()
        )));
    }
    let mut set_names = BTreeSet::new();
    for set in counter_sets {
        if !is_dns_label(&set.name, 63) {
            v.push(Violation::slice(format!(
                "counter-set-name: {:?} must be a DNS label",
                set.name
            )));
        }
        if !set_names.insert(set.name.as_str()) {
            v.push(Violation::slice(format!(
                "duplicate-counter-set: {:?} is defined twice",
                set.name
            )));
        }
        if set.counters.is_empty() || set.counters.len() > MAX_COUNTERS_PER_SET {
            v.push(Violation::slice(format!(
                "too-many-counters: counter set {:?} has {} counters; between 1 and \
                 {MAX_COUNTERS_PER_SET} are allowed",
                set.name,
                set.counters.len()
            )));
        }
        let mut problems = Vec::new();
        for (name, c) in &set.counters {
            check_counter(name, &c.value.0, &mut problems);
        }
        v.extend(
            problems
                .into_iter()
                .map(|p| Violation::slice(format!("{p} (in counter set {:?})", set.name))),
        );
    }

    // Kubernetes 1.34 shape: counters and the devices consuming them in one slice.
    if !counter_sets.is_empty() && spec.devices.is_some() {
        let total: usize = counter_sets.iter().map(|s| s.counters.len()).sum();
        if total > MAX_COUNTERS_PER_SET {
            v.push(Violation::slice(format!(
                "too-many-counters: {total} counters across the slice's counter sets; a slice \
                 that also lists devices (the Kubernetes 1.34 layout) allows at most \
                 {MAX_COUNTERS_PER_SET}"
            )));
        }
        let mut consumed = 0;
        for d in devices {
            let Some(consumptions) = &d.consumes_counters else {
                continue;
            };
            let per_device: usize = consumptions.iter().map(|c| c.counters.len()).sum();
            consumed += per_device;
            if per_device > MAX_COUNTERS_PER_CONSUMPTION {
                v.push(Violation::device(
                    &d.name,
                    format!(
                        "consumption-counters: consumes {per_device} counters in all; the \
                         Kubernetes 1.34 layout allows at most {MAX_COUNTERS_PER_CONSUMPTION}"
                    ),
                ));
            }
            for c in consumptions {
                if !set_names.contains(c.counter_set.as_str()) {
                    v.push(Violation::device(
                        &d.name,
                        format!(
                            "unknown-counter-set: consumes from {:?}, which this slice does not \
                             define (the Kubernetes 1.34 layout needs it in the same slice)",
                            c.counter_set
                        ),
                    ));
                }
            }
        }
        if consumed > MAX_CONSUMED_COUNTERS_PER_SLICE_1_34 {
            v.push(Violation::slice(format!(
                "too-many-counters: devices consume {consumed} counters in all; the Kubernetes \
                 1.34 layout allows at most {MAX_CONSUMED_COUNTERS_PER_SLICE_1_34} per slice"
            )));
        }
    }
    v
}

/// Checks the rules that span the slices of one pool: the same driver, pool and generation
/// everywhere, `resourceSliceCount` equal to the number of slices, device and counter set names
/// unique in the pool, and every consumption naming a counter that exists and holds at least what
/// the device takes.
pub fn validate_pool(specs: &[ResourceSliceSpec]) -> Vec<Violation> {
    let mut v = Vec::new();
    let Some(first) = specs.first() else {
        return v;
    };
    for (i, s) in specs.iter().enumerate() {
        if s.driver != first.driver
            || s.pool.name != first.pool.name
            || s.pool.generation != first.pool.generation
        {
            v.push(Violation::slice(format!(
                "pool-mismatch: slice {i} has driver {:?}, pool {:?} generation {}; slice 0 has \
                 {:?}, {:?} generation {}",
                s.driver,
                s.pool.name,
                s.pool.generation,
                first.driver,
                first.pool.name,
                first.pool.generation
            )));
        }
        if s.pool.resource_slice_count != specs.len() as i64 {
            v.push(Violation::slice(format!(
                "pool-slice-count: slice {i} says resourceSliceCount {}, the pool has {} slices",
                s.pool.resource_slice_count,
                specs.len()
            )));
        }
    }
    let mut counters: BTreeMap<&str, &BTreeMap<String, k8s_openapi::api::resource::v1::Counter>> =
        BTreeMap::new();
    for set in specs
        .iter()
        .flat_map(|s| s.shared_counters.iter().flatten())
    {
        if counters.insert(&set.name, &set.counters).is_some() {
            v.push(Violation::slice(format!(
                "duplicate-counter-set: {:?} is defined in more than one place in the pool",
                set.name
            )));
        }
    }
    let mut names = BTreeSet::new();
    for d in specs.iter().flat_map(|s| s.devices.iter().flatten()) {
        if !names.insert(d.name.as_str()) {
            v.push(Violation::device(
                &d.name,
                "duplicate-device: the name is used more than once in the pool",
            ));
        }
        for c in d.consumes_counters.iter().flatten() {
            let Some(set) = counters.get(c.counter_set.as_str()) else {
                v.push(Violation::device(
                    &d.name,
                    format!(
                        "unknown-counter-set: consumes from {:?}, which the pool does not define",
                        c.counter_set
                    ),
                ));
                continue;
            };
            for (name, want) in &c.counters {
                let Some(have) = set.get(name) else {
                    v.push(Violation::device(
                        &d.name,
                        format!(
                            "unknown-counter: consumes {name:?}, which counter set {:?} does not \
                             have",
                            c.counter_set
                        ),
                    ));
                    continue;
                };
                if let (Some(w), Some(h)) =
                    (whole_quantity(&want.value.0), whole_quantity(&have.value.0))
                    && w > h
                {
                    v.push(Violation::device(
                        &d.name,
                        format!(
                            "counter-exceeded: consumes {} of {name:?} from {:?}, which holds \
                             only {}; the device could never be allocated",
                            want.value.0, c.counter_set, have.value.0
                        ),
                    ));
                }
            }
        }
    }
    v
}

#[cfg(test)]
mod tests;
