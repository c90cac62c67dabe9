//! The publisher's decisions, as pure functions: which existing slice becomes which desired slice,
//! whether the pool needs a new generation, and what to delete, update and create.
//!
//! Invariants (the rules of Go's `k8s.io/dynamic-resource-allocation/resourceslice` controller):
//! - Slice `i` of a pool is published under a name that starts with `i` in hexadecimal, padded to
//!   [`index_width`] digits, then `-<driver>-<node>-` and the API server's random suffix. Existing
//!   slices are matched to desired ones by that index, and nothing else.
//! - Per pool, the highest existing `pool.generation` is current. Obsolete are: slices of an older
//!   generation, slices whose name carries no index of the current width, a second slice with the
//!   same index, an index past the desired count, and a slice whose `nodeName` differs from the
//!   desired one (the field is immutable). Pools no longer desired are deleted entirely.
//! - The generation is kept when no slice is new and at most one matched slice changes (one write
//!   is atomic: nobody sees a pool half old, half new); otherwise every slice gets
//!   `highest + 1` (1 for a new pool). `resourceSliceCount` is the number of desired slices.
//! - A pool whose slices break the API server's rules ([`crate::validate`]) is left as it is and
//!   reported, not written.
//! - "Changes" is semantic: JSON with empty and null values removed, fields the server is known to
//!   drop ignored, the server-set taint `timeAdded` carried over; and a slice whose
//!   resourceVersion is the one our own write returned, for the same desired spec, matches by
//!   definition (so server-side normalisation can never cause a write loop).

use super::{InvalidPool, Nodes, Pool, Resources};
use crate::validate::{self, Violation};
use k8s_openapi::api::resource::v1::{ResourcePool, ResourceSlice, ResourceSliceSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference, Preconditions};
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;

/// One step of a [`FieldPath`].
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum Seg {
    Key(String),
    /// Every element of an array.
    Each,
}

/// A field of a ResourceSlice, e.g. `spec.devices[].consumesCounters`.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FieldPath(Vec<Seg>);

impl FieldPath {
    /// The last field name: `consumesCounters` for `spec.devices[].consumesCounters`.
    pub fn field(&self) -> &str {
        self.0
            .iter()
            .rev()
            .find_map(|s| match s {
                Seg::Key(k) => Some(k.as_str()),
                Seg::Each => None,
            })
            .unwrap_or("")
    }
}

impl fmt::Display for FieldPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("spec")?;
        for seg in &self.0 {
            match seg {
                Seg::Key(k) => write!(f, ".{k}")?,
                Seg::Each => f.write_str("[]")?,
            }
        }
        Ok(())
    }
}

/// What our last write of a slice sent and got back.
#[derive(Clone, Debug, PartialEq)]
pub struct Written {
    /// The resourceVersion the server returned.
    pub resource_version: String,
    /// The normalised spec we sent.
    pub sent: Value,
}

/// Everything a plan depends on.
pub struct Inputs<'a> {
    pub driver: &'a str,
    pub node: &'a str,
    pub desired: &'a Resources,
    /// This publisher's slices on the server: those on its node and those of its network pools.
    pub existing: &'a [ResourceSlice],
    /// The Node as controller owner, when it is known.
    pub owner: Option<&'a OwnerReference>,
    /// Our own writes, by slice name.
    pub written: &'a HashMap<String, Written>,
    /// Fields the server was seen to drop.
    pub dropped: &'a BTreeSet<FieldPath>,
}

/// A slice to delete: its name, and the uid and resourceVersion it must still have.
#[derive(Debug, PartialEq)]
pub struct Obsolete {
    pub name: String,
    pub preconditions: Preconditions,
}

/// What to do, in this order: deletes, updates, creates; and the pools left alone because their
/// slices break the API's rules.
#[derive(Debug, Default, PartialEq)]
pub struct Plan {
    pub deletes: Vec<Obsolete>,
    pub updates: Vec<ResourceSlice>,
    pub creates: Vec<ResourceSlice>,
    pub invalid: Vec<InvalidPool>,
}

impl Plan {
    /// No writes (invalid pools aside).
    pub fn is_empty(&self) -> bool {
        self.updates.is_empty() && self.creates.is_empty() && self.deletes.is_empty()
    }
}

/// The fewest hexadecimal digits of a slice index in a pool of `count` slices: 5, or more when
/// the highest index needs them, so that names sort as indices do.
pub fn index_width(count: usize) -> usize {
    let highest = count.saturating_sub(1);
    let digits = format!("{highest:x}").len();
    digits.max(5)
}

/// The index a slice's name starts with, when it is `width` hexadecimal digits and a `-`.
pub fn name_index(name: &str, width: usize) -> Option<usize> {
    let (prefix, _) = name.split_at_checked(width)?;
    if !name[width..].starts_with('-') || !prefix.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    usize::from_str_radix(prefix, 16).ok()
}

/// The `generateName` the publisher gives slice `index` of a pool of `count` slices:
/// `<index>-<driver>-<node>-`, the index in hexadecimal padded to 5 digits or more (e.g. for a
/// dry run that shows what it would publish).
pub fn generate_name(index: usize, count: usize, driver: &str, node: &str) -> String {
    let width = index_width(count);
    format!("{index:0width$x}-{driver}-{node}-")
}

/// The spec of slice `index` of `pool` as published.
pub fn slice_spec(
    inp: &Inputs<'_>,
    name: &str,
    pool: &Pool,
    index: usize,
    generation: i64,
) -> ResourceSliceSpec {
    let slice = &pool.slices[index];
    let mut spec = ResourceSliceSpec {
        driver: inp.driver.to_string(),
        pool: ResourcePool {
            name: name.to_string(),
            generation,
            resource_slice_count: i64::try_from(pool.slices.len()).unwrap_or(i64::MAX),
        },
        devices: some(&slice.devices),
        shared_counters: some(&slice.shared_counters),
        ..Default::default()
    };
    match &pool.nodes {
        Nodes::ThisNode => spec.node_name = Some(inp.node.to_string()),
        Nodes::Selector(sel) => spec.node_selector = Some(sel.clone()),
        Nodes::All => spec.all_nodes = Some(true),
        Nodes::PerDevice => spec.per_device_node_selection = Some(true),
    }
    spec
}

/// An empty list as absent, as Go's `omitempty` sends it.
fn some<T: Clone>(v: &[T]) -> Option<Vec<T>> {
    (!v.is_empty()).then(|| v.to_vec())
}

/// What the API server (or the allocator, for what spans slices) would refuse in `pool`: each
/// with the index of its slice (`None`: the pool's).
pub fn violations(inp: &Inputs<'_>, name: &str, pool: &Pool) -> Vec<(Option<usize>, Violation)> {
    let specs: Vec<ResourceSliceSpec> = (0..pool.slices.len())
        .map(|i| slice_spec(inp, name, pool, i, 1))
        .collect();
    let per_slice = specs
        .iter()
        .enumerate()
        .flat_map(|(i, s)| validate::validate(s).into_iter().map(move |v| (Some(i), v)));
    let pool_wide = validate::validate_pool(&specs)
        .into_iter()
        .map(|v| (None, v));
    per_slice
        .chain(pool_wide)
        .filter(|(_, v)| v.server_rejects())
        .collect()
}

/// Decides what to write so that the API server holds exactly `desired`.
pub fn plan(inp: &Inputs<'_>) -> Plan {
    let mut out = Plan::default();
    let mut existing_pools: BTreeMap<&str, Vec<&ResourceSlice>> = BTreeMap::new();
    for slice in inp.existing {
        existing_pools
            .entry(slice.spec.pool.name.as_str())
            .or_default()
            .push(slice);
    }
    for (pool, existing) in &existing_pools {
        if !inp.desired.pools.contains_key(*pool) {
            out.deletes.extend(existing.iter().map(|s| obsolete(s)));
        }
    }
    for (name, pool) in &inp.desired.pools {
        let existing = existing_pools
            .get(name.as_str())
            .map(Vec::as_slice)
            .unwrap_or(&[]);
        let bad = violations(inp, name, pool);
        if bad.is_empty() {
            plan_pool(inp, name, pool, existing, &mut out);
        } else {
            out.invalid.push(InvalidPool {
                pool: name.clone(),
                violations: bad,
            });
        }
    }
    out
}

fn name(slice: &ResourceSlice) -> String {
    slice.metadata.name.clone().unwrap_or_default()
}

fn obsolete(slice: &ResourceSlice) -> Obsolete {
    Obsolete {
        name: name(slice),
        preconditions: Preconditions {
            uid: slice.metadata.uid.clone(),
            resource_version: slice.metadata.resource_version.clone(),
        },
    }
}

fn plan_pool(
    inp: &Inputs<'_>,
    pool_name: &str,
    pool: &Pool,
    existing: &[&ResourceSlice],
    out: &mut Plan,
) {
    let count = pool.slices.len();
    let highest = existing
        .iter()
        .map(|s| s.spec.pool.generation)
        .max()
        .unwrap_or(0);
    let width = index_width(count);
    let node_name = matches!(pool.nodes, Nodes::ThisNode).then_some(inp.node);
    let mut matched: Vec<Option<&ResourceSlice>> = vec![None; count];
    for slice in existing {
        let index = (slice.spec.pool.generation == highest
            && slice.spec.node_name.as_deref() == node_name)
            .then(|| name_index(&name(slice), width))
            .flatten()
            .filter(|&i| i < count && matched[i].is_none());
        match index {
            Some(i) => matched[i] = Some(slice),
            None => out.deletes.push(obsolete(slice)),
        }
    }

    let changed: Vec<usize> = (0..count)
        .filter(|&i| {
            matched[i].is_some_and(|have| {
                let want = slice_spec(inp, pool_name, pool, i, highest);
                !same(inp, have, &want) || !owner_ok(inp.owner, have)
            })
        })
        .collect();
    let new = matched.iter().any(Option::is_none);
    let generation = if !new && changed.len() <= 1 {
        highest
    } else {
        highest + 1
    };
    for (i, have) in matched.iter().enumerate() {
        let mut want = slice_spec(inp, pool_name, pool, i, generation);
        match have {
            Some(have) if generation != highest || changed.contains(&i) => {
                carry_taint_times(&mut want, &have.spec);
                out.updates.push(ResourceSlice {
                    metadata: updated_meta(&have.metadata, inp.owner),
                    spec: want,
                });
            }
            Some(_) => {}
            None => out.creates.push(ResourceSlice {
                metadata: ObjectMeta {
                    generate_name: Some(generate_name(i, count, inp.driver, inp.node)),
                    owner_references: inp.owner.map(|o| vec![o.clone()]),
                    ..Default::default()
                },
                spec: want,
            }),
        }
    }
}

/// Whether the existing slice already holds `want` (semantically).
fn same(inp: &Inputs<'_>, have: &ResourceSlice, want: &ResourceSliceSpec) -> bool {
    let want_json = normalized_spec(want);
    if let (Some(w), Some(rv)) = (
        inp.written.get(&name(have)),
        have.metadata.resource_version.as_deref(),
    ) && w.resource_version == rv
        && w.sent == want_json
    {
        return true;
    }
    let mut want = want.clone();
    carry_taint_times(&mut want, &have.spec);
    let mut want_json = normalized_spec(&want);
    for path in inp.dropped {
        strip(&mut want_json, &path.0);
    }
    normalize(&mut want_json);
    want_json == normalized_spec(&have.spec)
}

fn owner_ok(owner: Option<&OwnerReference>, have: &ResourceSlice) -> bool {
    owner.is_none_or(|o| {
        have.metadata
            .owner_references
            .iter()
            .flatten()
            .any(|r| r == o)
    })
}

/// The existing metadata with our controller reference in place of any other controller.
fn updated_meta(have: &ObjectMeta, owner: Option<&OwnerReference>) -> ObjectMeta {
    let mut meta = have.clone();
    // Leaving managedFields out of an update keeps the server's; sending them back could not help.
    meta.managed_fields = None;
    if let Some(owner) = owner {
        let mut refs: Vec<OwnerReference> = meta
            .owner_references
            .take()
            .unwrap_or_default()
            .into_iter()
            .filter(|r| r.controller != Some(true) && r.uid != owner.uid)
            .collect();
        refs.push(owner.clone());
        meta.owner_references = Some(refs);
    }
    meta
}

/// Keeps the server-set `timeAdded` of taints that are still there (same key, value, effect).
fn carry_taint_times(want: &mut ResourceSliceSpec, have: &ResourceSliceSpec) {
    let Some(devices) = want.devices.as_mut() else {
        return;
    };
    for device in devices {
        let Some(taints) = device.taints.as_mut() else {
            continue;
        };
        let old = have
            .devices
            .iter()
            .flatten()
            .find(|d| d.name == device.name)
            .and_then(|d| d.taints.as_ref());
        for taint in taints.iter_mut().filter(|t| t.time_added.is_none()) {
            taint.time_added = old
                .into_iter()
                .flatten()
                .find(|o| o.key == taint.key && o.value == taint.value && o.effect == taint.effect)
                .and_then(|o| o.time_added.clone());
        }
    }
}

/// The spec as JSON without nulls, empty objects or empty arrays (what Go's `omitempty` drops).
pub fn normalized_spec(spec: &ResourceSliceSpec) -> Value {
    // Serialising plain data with string keys cannot fail; Null would only make us publish.
    let mut v = serde_json::to_value(spec).unwrap_or(Value::Null);
    normalize(&mut v);
    v
}

/// Removes nulls, empty objects and empty arrays, recursively. Returns whether `v` is now empty.
fn normalize(v: &mut Value) -> bool {
    match v {
        Value::Null => true,
        Value::Object(map) => {
            map.retain(|_, child| !normalize(child));
            map.is_empty()
        }
        Value::Array(items) => {
            for item in items.iter_mut() {
                normalize(item);
            }
            items.is_empty()
        }
        _ => false,
    }
}

fn strip(v: &mut Value, path: &[Seg]) {
    match (path.split_first(), v) {
        (Some((Seg::Key(k), rest)), Value::Object(map)) => {
            if rest.is_empty() {
                map.remove(k);
            } else if let Some(child) = map.get_mut(k) {
                strip(child, rest);
            }
        }
        (Some((Seg::Each, rest)), Value::Array(items)) => {
            for item in items {
                strip(item, rest);
            }
        }
        _ => {}
    }
}

/// Fields present in what we sent (normalised) and absent from what the server stored.
pub fn dropped_fields(sent: &Value, got: &Value) -> BTreeSet<FieldPath> {
    let mut out = BTreeSet::new();
    let mut got = got.clone();
    normalize(&mut got);
    walk(sent, &got, &mut Vec::new(), &mut out);
    out
}

fn walk(sent: &Value, got: &Value, at: &mut Vec<Seg>, out: &mut BTreeSet<FieldPath>) {
    match (sent, got) {
        (Value::Object(s), Value::Object(g)) => {
            for (k, sv) in s {
                at.push(Seg::Key(k.clone()));
                match g.get(k) {
                    Some(gv) => walk(sv, gv, at, out),
                    None => {
                        out.insert(FieldPath(at.clone()));
                    }
                }
                at.pop();
            }
        }
        (Value::Array(s), Value::Array(g)) if s.len() == g.len() => {
            at.push(Seg::Each);
            for (sv, gv) in s.iter().zip(g) {
                walk(sv, gv, at, out);
            }
            at.pop();
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests;
