//! `GetPreferredAllocation`: which of the available devices a container should get.
//!
//! - Whole GPUs: the set that keeps the devices closest — one NVLink domain first, then one NUMA
//!   node, then one PCIe root (pair scores 100, 10, 1, summed over the pairs of the set). Among
//!   equal sets, the one that leaves the fewest free GPUs stranded in the NVLink domains it
//!   touches (so one-GPU pods fill a half-used pair before they break a free one), then the
//!   lowest in the kubelet's order. The topology comes from the inventory snapshot, never from a
//!   per-call hardware walk.
//! - Replicas: spread across GPUs (`distributed`, the GPU with the fewest replicas in use first)
//!   or packed onto the busiest (`packed`), as NVIDIA's plugin.
//! - MIG devices: the kubelet's order.
//! - `nvidia.com/gpu-memory` units: all from one GPU — the must-include units' GPU, else the
//!   GPU with the fewest free units that still holds the request (best fit, so big requests
//!   keep finding room), else the one with the most free units.
//!
//! Must-include IDs always come first and are always in the answer. IDs the resource no longer
//! has, or unhealthy ones, are skipped: a lost GPU never fails the call for the others. The
//! answer is a hint; it never errs, and returns fewer devices only when fewer are usable.

use std::collections::BTreeMap;

use super::resources::{Device, Resource};

/// One container's request.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Request {
    pub available: Vec<String>,
    pub must_include: Vec<String>,
    pub size: usize,
}

/// The preferred device IDs for `req`.
pub fn preferred(resource: &Resource, req: &Request, packed: bool) -> Vec<String> {
    let mut chosen: Vec<String> = Vec::new();
    for id in &req.must_include {
        if !chosen.contains(id) {
            chosen.push(id.clone());
        }
    }
    if chosen.len() >= req.size {
        return chosen;
    }
    let mut seen = std::collections::BTreeSet::new();
    let candidates: Vec<&Device> = req
        .available
        .iter()
        .filter(|id| !chosen.contains(id) && seen.insert(id.as_str()))
        .filter_map(|id| resource.device(id))
        .filter(|d| d.health.is_healthy())
        .collect();
    let need = req.size - chosen.len();
    if candidates.len() <= need {
        chosen.extend(candidates.iter().map(|d| d.id.clone()));
        return chosen;
    }
    let must: Vec<&Device> = chosen.iter().filter_map(|id| resource.device(id)).collect();
    let picks = if resource.memory_units() {
        pack_units(&candidates, &must, need)
    } else if resource.replicated() {
        spread(resource, &candidates, &must, need, packed)
    } else if candidates.iter().any(|d| d.mig) {
        candidates[..need].to_vec()
    } else {
        aligned(&candidates, &must, need)
    };
    chosen.extend(picks.iter().map(|d| d.id.clone()));
    chosen
}

fn pair_score(a: &Device, b: &Device) -> u32 {
    let mut s = 0;
    if a.nvlink_domain == b.nvlink_domain {
        s += 100;
    }
    if a.numa_node.is_some() && a.numa_node == b.numa_node {
        s += 10;
    }
    if a.pcie_root.is_some() && a.pcie_root == b.pcie_root {
        s += 1;
    }
    s
}

fn set_score(set: &[&Device]) -> u32 {
    let mut s = 0;
    for (i, a) in set.iter().enumerate() {
        for b in &set[i + 1..] {
            s += pair_score(a, b);
        }
    }
    s
}

/// Whole GPUs: greedy completion from each seed (or from the must-include devices), best set.
fn aligned<'a>(candidates: &[&'a Device], must: &[&'a Device], need: usize) -> Vec<&'a Device> {
    let complete = |start: Vec<&'a Device>, picks: Vec<&'a Device>| {
        let mut set: Vec<&'a Device> = start;
        let mut picks = picks;
        while picks.len() < need {
            let best = candidates
                .iter()
                .filter(|c| !picks.iter().any(|p| p.id == c.id))
                .max_by_key(|c| {
                    let s: u32 = set.iter().map(|x| pair_score(c, x)).sum();
                    // max_by_key keeps the last maximum; prefer the earliest.
                    (s, std::cmp::Reverse(position(candidates, c)))
                })
                .copied();
            let Some(best) = best else { break };
            picks.push(best);
            set.push(best);
        }
        (set_score(&set), stranded(candidates, &set), picks)
    };
    let runs: Vec<_> = if must.is_empty() {
        candidates
            .iter()
            .map(|seed| complete(vec![*seed], vec![*seed]))
            .collect()
    } else {
        vec![complete(must.to_vec(), Vec::new())]
    };
    // Highest score, then fewest stranded; `runs` is in seed order, so the first of equals wins.
    let mut best: Option<(u32, usize, Vec<&'a Device>)> = None;
    for run in runs {
        let better = match &best {
            None => true,
            Some((s, st, _)) => run.0 > *s || (run.0 == *s && run.1 < *st),
        };
        if better {
            best = Some(run);
        }
    }
    best.map(|b| b.2).unwrap_or_default()
}

fn position(candidates: &[&Device], d: &Device) -> usize {
    candidates
        .iter()
        .position(|c| c.id == d.id)
        .unwrap_or(usize::MAX)
}

/// Free GPUs left in the NVLink domains `set` touches.
fn stranded(candidates: &[&Device], set: &[&Device]) -> usize {
    candidates
        .iter()
        .filter(|c| !set.iter().any(|s| s.id == c.id))
        .filter(|c| set.iter().any(|s| s.nvlink_domain == c.nvlink_domain))
        .count()
}

/// Replicas: per physical device, how many of its replicas are in use; pick from the least used
/// (or the most used when `packed`), then the one least picked in this call.
fn spread<'a>(
    resource: &Resource,
    candidates: &[&'a Device],
    must: &[&Device],
    need: usize,
    packed: bool,
) -> Vec<&'a Device> {
    let mut total: BTreeMap<&str, usize> = BTreeMap::new();
    for d in &resource.devices {
        *total.entry(d.base.as_str()).or_default() += 1;
    }
    let mut free: BTreeMap<&str, usize> = BTreeMap::new();
    for d in candidates {
        *free.entry(d.base.as_str()).or_default() += 1;
    }
    let mut picked: BTreeMap<&str, usize> = BTreeMap::new();
    for d in must {
        *picked.entry(d.base.as_str()).or_default() += 1;
    }
    let mut left: Vec<&'a Device> = candidates.to_vec();
    let mut out = Vec::new();
    for _ in 0..need {
        let key = |d: &&Device| {
            let b = d.base.as_str();
            let used = total.get(b).copied().unwrap_or(0) - free.get(b).copied().unwrap_or(0);
            let used = if packed { usize::MAX - used } else { used };
            (used, picked.get(b).copied().unwrap_or(0))
        };
        let Some((i, _)) = left.iter().enumerate().min_by_key(|(_, d)| key(d)) else {
            break;
        };
        let d = left.remove(i);
        if let Some(f) = free.get_mut(d.base.as_str()) {
            *f -= 1;
        }
        *picked.entry(d.base.as_str()).or_default() += 1;
        out.push(d);
    }
    out
}

/// GPU-memory units: `need` more from one GPU (see the module doc).
fn pack_units<'a>(candidates: &[&'a Device], must: &[&Device], need: usize) -> Vec<&'a Device> {
    let gpu = match must.first() {
        Some(m) => Some(m.base.as_str()),
        None => {
            // Free units per GPU, in the kubelet's order of first appearance.
            let mut free: Vec<(&str, usize)> = Vec::new();
            for c in candidates {
                match free.iter_mut().find(|(b, _)| *b == c.base) {
                    Some((_, n)) => *n += 1,
                    None => free.push((c.base.as_str(), 1)),
                }
            }
            free.iter()
                .filter(|(_, n)| *n >= need)
                .min_by_key(|(_, n)| *n)
                // `max_by_key` keeps the last maximum; reversed, that is the first.
                .or_else(|| free.iter().rev().max_by_key(|(_, n)| *n))
                .map(|(b, _)| *b)
        }
    };
    let Some(gpu) = gpu else {
        return Vec::new();
    };
    candidates
        .iter()
        .filter(|c| c.base == gpu)
        .take(need)
        .copied()
        .collect()
}
