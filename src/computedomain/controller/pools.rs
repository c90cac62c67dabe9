//! Per-clique channel pools (issue 37 item 5): for every NVLink clique, a ResourceSlice pool of
//! IMEX channels that the scheduler hands out, so a domain that opts in is one claim for one
//! channel and all its pods land in one clique.
//!
//! The clique of a node is its `nvidia.com/gpu.clique` label (`<clusterUUID>.<cliqueID>`, set by
//! nvdra's node labels as by GPU feature discovery). Per clique, pool `clique-<clique>` of driver
//! `compute-domain.nvidia.com`: slices with `nodeSelector` on that label, devices
//! `channel-<N>` for N in 1..=channels (channel 0 stays NVIDIA's per-node channel), attributes
//! `type=channel`, `id=N`, `cliqueID=<clique>`. The pools are a pure function of the cliques
//! ([`desired`]); [`plan`] compares them with what the API server has.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::{Node, NodeSelector};
use k8s_openapi::api::resource::v1::{Device, DeviceAttribute, ResourceSlice, ResourceSliceSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde_json::json;

use crate::computedomain::api::{
    ATTR_CLIQUE, ATTR_ID, ATTR_TYPE, CLIQUE_LABEL, DRIVER_NAME, TYPE_CHANNEL,
};

/// Every clique pool's name starts with this.
pub const POOL_PREFIX: &str = "clique-";
/// Devices per slice (the API's limit).
pub const SLICE_DEVICES: usize = 128;

/// The pool of a clique.
pub fn pool_name(clique: &str) -> String {
    format!("{POOL_PREFIX}{clique}")
}

/// Whether `clique` can name a pool and its slices (DNS subdomains: lower-case letters, digits,
/// `-` and `.`).
pub fn valid_clique(clique: &str) -> bool {
    use kubelet_plugin::validate::is_dns_subdomain;
    !clique.is_empty()
        && is_dns_subdomain(&pool_name(clique), 253)
        && is_dns_subdomain(&slice_name(clique, usize::MAX), 253)
}

/// The cliques of the nodes (their `nvidia.com/gpu.clique` labels); invalid values come back
/// apart, to be reported.
pub fn cliques<'a>(
    nodes: impl IntoIterator<Item = &'a Node>,
) -> (BTreeSet<String>, BTreeSet<String>) {
    let mut good = BTreeSet::new();
    let mut bad = BTreeSet::new();
    for node in nodes {
        if let Some(c) = node
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(CLIQUE_LABEL))
        {
            if valid_clique(c) {
                good.insert(c.clone());
            } else {
                bad.insert(c.clone());
            }
        }
    }
    (good, bad)
}

fn slice_name(clique: &str, index: usize) -> String {
    format!("{DRIVER_NAME}-{}-{index}", pool_name(clique))
}

fn selector(clique: &str) -> NodeSelector {
    // The literal has NodeSelector's shape.
    serde_json::from_value(json!({"nodeSelectorTerms": [{"matchExpressions": [
        {"key": CLIQUE_LABEL, "operator": "In", "values": [clique]}
    ]}]}))
    .unwrap_or_default()
}

fn channel(clique: &str, id: u32) -> Device {
    let string = |s: &str| DeviceAttribute {
        string: Some(s.into()),
        ..DeviceAttribute::default()
    };
    Device {
        name: format!("channel-{id}"),
        attributes: Some(BTreeMap::from([
            (ATTR_TYPE.to_string(), string(TYPE_CHANNEL)),
            (
                ATTR_ID.to_string(),
                DeviceAttribute {
                    int: Some(i64::from(id)),
                    ..DeviceAttribute::default()
                },
            ),
            (ATTR_CLIQUE.to_string(), string(clique)),
        ])),
        ..Device::default()
    }
}

/// The slices of one clique's pool with `channels` channels, at `generation`.
pub fn pool_slices(clique: &str, channels: u32, generation: i64) -> Vec<ResourceSlice> {
    let devices: Vec<Device> = (1..=channels).map(|id| channel(clique, id)).collect();
    let chunks: Vec<&[Device]> = if devices.is_empty() {
        vec![&[]]
    } else {
        devices.chunks(SLICE_DEVICES).collect()
    };
    let count = i64::try_from(chunks.len()).unwrap_or(i64::MAX);
    chunks
        .into_iter()
        .enumerate()
        .map(|(i, chunk)| ResourceSlice {
            metadata: ObjectMeta {
                name: Some(slice_name(clique, i)),
                ..ObjectMeta::default()
            },
            spec: ResourceSliceSpec {
                driver: DRIVER_NAME.into(),
                node_selector: Some(selector(clique)),
                pool: k8s_openapi::api::resource::v1::ResourcePool {
                    name: pool_name(clique),
                    generation,
                    resource_slice_count: count,
                },
                devices: Some(chunk.to_vec()),
                ..ResourceSliceSpec::default()
            },
        })
        .collect()
}

/// What to write to make the API server's clique pools the desired ones.
#[derive(Debug, Default, PartialEq)]
pub struct Plan {
    pub creates: Vec<ResourceSlice>,
    /// Replacements, each with the resourceVersion of the slice it replaces.
    pub updates: Vec<ResourceSlice>,
    /// Names of slices to delete.
    pub deletes: Vec<String>,
}

impl Plan {
    pub fn is_empty(&self) -> bool {
        self.creates.is_empty() && self.updates.is_empty() && self.deletes.is_empty()
    }
}

/// Whether a slice is one of the clique pools' (this driver's, no node, pool `clique-…`).
pub fn is_pool_slice(s: &ResourceSlice) -> bool {
    s.spec.driver == DRIVER_NAME
        && s.spec.node_name.is_none()
        && s.spec.pool.name.starts_with(POOL_PREFIX)
}

/// The writes that turn `existing` (any of the driver's slices; others are ignored) into the
/// pools of `cliques` with `channels` channels each. A pool that is already right is left alone;
/// one that is not is rewritten whole at its highest generation plus one (the scheduler then
/// ignores its older slices); pools of cliques that are gone are deleted.
pub fn plan(cliques: &BTreeSet<String>, channels: u32, existing: &[ResourceSlice]) -> Plan {
    let mut by_pool: BTreeMap<&str, Vec<&ResourceSlice>> = BTreeMap::new();
    for s in existing.iter().filter(|s| is_pool_slice(s)) {
        by_pool
            .entry(s.spec.pool.name.as_str())
            .or_default()
            .push(s);
    }
    let mut plan = Plan::default();
    let wanted: BTreeSet<String> = cliques.iter().map(|c| pool_name(c)).collect();
    for (pool, slices) in &by_pool {
        if !wanted.contains(*pool) {
            plan.deletes
                .extend(slices.iter().filter_map(|s| s.metadata.name.clone()));
        }
    }
    for clique in cliques {
        let have = by_pool
            .get(pool_name(clique).as_str())
            .cloned()
            .unwrap_or_default();
        let generation = have.iter().map(|s| s.spec.pool.generation).max();
        let want = pool_slices(clique, channels, generation.unwrap_or(0));
        let same = have.len() == want.len()
            && want.iter().all(|w| {
                have.iter().any(|h| {
                    h.metadata.name == w.metadata.name
                        && h.spec.pool == w.spec.pool
                        && h.spec.node_selector == w.spec.node_selector
                        && h.spec.devices == w.spec.devices
                })
            });
        if same {
            continue;
        }
        let next = generation.map_or(0, |g| g + 1);
        let names: BTreeMap<String, Option<String>> = have
            .iter()
            .filter_map(|s| {
                s.metadata
                    .name
                    .clone()
                    .map(|n| (n, s.metadata.resource_version.clone()))
            })
            .collect();
        let want = pool_slices(clique, channels, next);
        for mut w in want {
            let name = w.metadata.name.clone().unwrap_or_default();
            match names.get(&name) {
                Some(rv) => {
                    w.metadata.resource_version = rv.clone();
                    plan.updates.push(w);
                }
                None => plan.creates.push(w),
            }
        }
        let kept: BTreeSet<String> = pool_slices(clique, channels, next)
            .into_iter()
            .filter_map(|s| s.metadata.name)
            .collect();
        plan.deletes
            .extend(names.keys().filter(|n| !kept.contains(*n)).cloned());
    }
    plan
}

#[cfg(test)]
mod tests;
