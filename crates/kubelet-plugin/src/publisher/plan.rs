//! The publisher's decisions, as pure functions: which existing slice becomes which desired slice,
//! whether the pool needs a new generation, and what to create, update and delete.
//!
//! Invariants (mirroring Go's `k8s.io/dynamic-resource-allocation/resourceslice` controller):
//! - Per pool, the highest existing `pool.generation` is current; slices of older generations are
//!   deleted. Pools that are no longer desired are deleted entirely.
//! - Existing slices are matched to desired ones by identical spec, then by identical device-name
//!   set, then 1:1 when exactly one of each is left.
//! - When everything matches there are no creates or updates (deletes of obsolete slices only):
//!   the steady state writes nothing. Otherwise the pool gets generation `highest + 1` (1 for a new
//!   pool) in every slice, and `resourceSliceCount` = the number of desired slices in the pool.
//! - "Matches" is semantic: JSON with empty and null values removed, fields the server is known to
//!   drop ignored, the server-set taint `timeAdded` carried over; and a slice whose
//!   resourceVersion is the one our own write returned, for the same desired spec, matches by
//!   definition (so server-side normalisation can never cause a write loop).

use k8s_openapi::api::resource::v1::{ResourceSlice, ResourceSliceSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
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
    pub desired: &'a [ResourceSliceSpec],
    pub existing: &'a [ResourceSlice],
    /// The Node as controller owner, when it is known.
    pub owner: Option<&'a OwnerReference>,
    /// Our own writes, by slice name.
    pub written: &'a HashMap<String, Written>,
    /// Fields the server was seen to drop.
    pub dropped: &'a BTreeSet<FieldPath>,
}

/// What to do, in this order: updates, creates, deletes.
#[derive(Debug, Default, PartialEq)]
pub struct Plan {
    pub updates: Vec<ResourceSlice>,
    pub creates: Vec<ResourceSlice>,
    pub deletes: Vec<String>,
}

impl Plan {
    pub fn is_empty(&self) -> bool {
        self.updates.is_empty() && self.creates.is_empty() && self.deletes.is_empty()
    }
}

/// Decides what to write so that the API server holds exactly `desired`.
pub fn plan(inp: &Inputs<'_>) -> Plan {
    let mut out = Plan::default();
    let mut desired_pools: BTreeMap<&str, Vec<&ResourceSliceSpec>> = BTreeMap::new();
    for spec in inp.desired {
        desired_pools
            .entry(spec.pool.name.as_str())
            .or_default()
            .push(spec);
    }
    let mut existing_pools: BTreeMap<&str, Vec<&ResourceSlice>> = BTreeMap::new();
    for slice in inp.existing {
        existing_pools
            .entry(slice.spec.pool.name.as_str())
            .or_default()
            .push(slice);
    }
    for (pool, existing) in &existing_pools {
        if !desired_pools.contains_key(pool) {
            out.deletes.extend(existing.iter().map(|s| name(s)));
        }
    }
    for (pool, desired) in &desired_pools {
        let existing = existing_pools.get(pool).map(Vec::as_slice).unwrap_or(&[]);
        plan_pool(inp, desired, existing, &mut out);
    }
    out
}

fn name(slice: &ResourceSlice) -> String {
    slice.metadata.name.clone().unwrap_or_default()
}

fn plan_pool(
    inp: &Inputs<'_>,
    desired: &[&ResourceSliceSpec],
    existing: &[&ResourceSlice],
    out: &mut Plan,
) {
    let highest = existing.iter().map(|s| s.spec.pool.generation).max();
    let (current, obsolete): (Vec<&ResourceSlice>, Vec<&ResourceSlice>) = existing
        .iter()
        .partition(|s| Some(s.spec.pool.generation) == highest);
    out.deletes.extend(obsolete.iter().map(|s| name(s)));

    let count = i64::try_from(desired.len()).unwrap_or(i64::MAX);
    let matches = match_slices(inp, desired, &current);
    let unmatched_current = |matches: &[Option<usize>]| {
        (0..current.len())
            .filter(|j| !matches.contains(&Some(*j)))
            .map(|j| name(current[j]))
            .collect::<Vec<_>>()
    };

    if let Some(generation) = highest {
        let all_match = desired.iter().zip(&matches).all(|(spec, m)| {
            m.is_some_and(|j| {
                let want = with_pool(spec, generation, count);
                same(inp, current[j], &want) && owner_ok(inp.owner, current[j])
            })
        });
        if all_match {
            out.deletes.extend(unmatched_current(&matches));
            return;
        }
    }

    let generation = highest.map_or(1, |g| g + 1);
    for (spec, m) in desired.iter().zip(&matches) {
        let mut want = with_pool(spec, generation, count);
        match m {
            Some(j) => {
                let have = current[*j];
                carry_taint_times(&mut want, &have.spec);
                out.updates.push(ResourceSlice {
                    metadata: updated_meta(&have.metadata, inp.owner),
                    spec: want,
                });
            }
            None => out.creates.push(ResourceSlice {
                metadata: ObjectMeta {
                    generate_name: Some(format!("{}-{}-", inp.node, inp.driver)),
                    owner_references: inp.owner.map(|o| vec![o.clone()]),
                    ..Default::default()
                },
                spec: want,
            }),
        }
    }
    out.deletes.extend(unmatched_current(&matches));
}

fn with_pool(spec: &ResourceSliceSpec, generation: i64, count: i64) -> ResourceSliceSpec {
    let mut s = spec.clone();
    s.pool.generation = generation;
    s.pool.resource_slice_count = count;
    s
}

/// Pairs each desired slice with at most one current slice (index into `current`).
fn match_slices(
    inp: &Inputs<'_>,
    desired: &[&ResourceSliceSpec],
    current: &[&ResourceSlice],
) -> Vec<Option<usize>> {
    let mut m: Vec<Option<usize>> = vec![None; desired.len()];
    let mut used = vec![false; current.len()];
    let names: Vec<BTreeSet<&str>> = desired.iter().map(|s| device_names(s)).collect();
    let have_names: Vec<BTreeSet<&str>> = current.iter().map(|s| device_names(&s.spec)).collect();
    // Pass 1: identical content (generation and count aside), so equal device sets (e.g. several
    // counter-only slices without devices) pair up without needless updates.
    for (i, spec) in desired.iter().enumerate() {
        let found = (0..current.len()).find(|&j| {
            !used[j] && names[i] == have_names[j] && {
                let p = &current[j].spec.pool;
                same(
                    inp,
                    current[j],
                    &with_pool(spec, p.generation, p.resource_slice_count),
                )
            }
        });
        if let Some(j) = found {
            m[i] = Some(j);
            used[j] = true;
        }
    }
    // Pass 2: identical device-name sets.
    for i in 0..desired.len() {
        if m[i].is_some() {
            continue;
        }
        if let Some(j) = (0..current.len()).find(|&j| !used[j] && names[i] == have_names[j]) {
            m[i] = Some(j);
            used[j] = true;
        }
    }
    // Pass 3: one left on each side.
    let free_desired: Vec<usize> = (0..desired.len()).filter(|&i| m[i].is_none()).collect();
    let free_current: Vec<usize> = (0..current.len()).filter(|&j| !used[j]).collect();
    if let ([i], [j]) = (free_desired.as_slice(), free_current.as_slice()) {
        m[*i] = Some(*j);
    }
    m
}

fn device_names(spec: &ResourceSliceSpec) -> BTreeSet<&str> {
    spec.devices
        .iter()
        .flatten()
        .map(|d| d.name.as_str())
        .collect()
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
