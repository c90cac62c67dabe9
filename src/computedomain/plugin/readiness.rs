//! Node-side readiness, without a prepare that waits: the node label that brings a domain's
//! daemon here, the binding condition that lets the scheduler bind a pod once that daemon is
//! Ready, and the taint that keeps new pods off a node whose daemon is not.
//!
//! One pass, every few seconds and whenever a claim changes:
//!
//! 1. The claims allocated here: a result of this driver whose device is a channel of this
//!    node's pool (NVIDIA's shape), or of a clique pool with an allocation pinned to this node
//!    (`bindsToNode`).
//! 2. Each such claim whose channel waits for the binding condition
//!    ([`BINDING_CONDITION`](super::devices::BINDING_CONDITION)): in NVIDIA's shape the node is
//!    labelled `resource.nvidia.com/computeDomain=<domain UID>` (the domain's DaemonSet selects
//!    on it, so its daemon starts here) — or, when the node serves another domain, the claim's
//!    device gets the failure condition and the scheduler places the pod elsewhere; once the
//!    node's entry in the domain's ComputeDomainClique is Ready, the claim's device gets the
//!    condition `True` and the scheduler binds the pod.
//! 3. The label goes when no claim allocated or prepared here names its domain.
//! 4. The node's channel is tainted `NoSchedule` while the daemon of the domain it serves has an
//!    entry that is not Ready (started, and failing); an idle node is never tainted, so a
//!    domain's first pod can land on it.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::resource::v1::{AllocatedDeviceStatus, ResourceClaim};
use kubelet_plugin::Claim;
use kubelet_plugin::publisher::{PublisherHandle, Resources, Slice};
use tokio_util::sync::CancellationToken;

use super::devices::{self, BINDING_CONDITION, BINDING_FAILURE_CONDITION, Kind};
use super::prepare::{Config, Plugin, configs, pick};
use crate::computedomain::api::{
    CLIQUE_LABEL, ComputeDomainClique, DRIVER_NAME, NODE_LABEL, STATUS_READY,
};
use crate::computedomain::daemon::clique::PER_CLIQUE_PREFIX;

/// The node's desired slices: its two devices, the channel's binding conditions and taint.
pub fn resources(node: &str, binding_conditions: bool, not_ready: Option<&str>) -> Resources {
    Resources::node_local(
        node,
        vec![Slice {
            devices: devices::node_devices(binding_conditions, not_ready),
            ..Slice::default()
        }],
    )
}

/// A channel claim allocated on this node.
struct Here {
    claim: Claim,
    /// The domain its config names.
    domain: String,
    /// Whether it has the node's own channel (NVIDIA's shape), not a clique pool's.
    node_channel: bool,
    /// This driver's results: (pool, device).
    devices: Vec<(String, String)>,
    /// Whether the scheduler waits for the binding condition, not yet `True` or failed.
    waiting: bool,
}

fn condition_true(claim: &ResourceClaim, pool: &str, device: &str, kind: &str) -> bool {
    claim
        .status
        .as_ref()
        .and_then(|s| s.devices.as_ref())
        .into_iter()
        .flatten()
        .filter(|d| d.driver == DRIVER_NAME && d.pool == pool && d.device == device)
        .flat_map(|d| d.conditions.iter().flatten())
        .any(|c| c.type_ == kind && c.status == "True")
}

/// Whether an allocation's node selector pins it to `node` (as `bindsToNode` does: a
/// `metadata.name` field).
fn pinned_to(claim: &ResourceClaim, node: &str) -> bool {
    claim
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .and_then(|a| a.node_selector.as_ref())
        .is_some_and(|sel| {
            sel.node_selector_terms.iter().any(|t| {
                t.match_fields.iter().flatten().any(|f| {
                    f.key == "metadata.name"
                        && f.operator == "In"
                        && f.values.iter().flatten().any(|v| v == node)
                })
            })
        })
}

fn here(claim: &ResourceClaim, node: &str) -> Option<Here> {
    let results = claim
        .status
        .as_ref()?
        .allocation
        .as_ref()?
        .devices
        .as_ref()?
        .results
        .clone()?;
    let pinned = pinned_to(claim, node);
    let ours: Vec<_> = results
        .iter()
        .filter(|r| {
            r.driver == DRIVER_NAME && matches!(Kind::parse(&r.device), Some(Kind::Channel(_)))
        })
        .filter(|r| r.pool == node || pinned)
        .collect();
    let first = ours.first()?;
    let cfgs = configs(claim).ok()?;
    let Some(Config::Channel(cfg)) = pick(&cfgs, &first.request) else {
        return None;
    };
    let waiting = ours.iter().any(|r| {
        r.binding_conditions
            .as_ref()
            .is_some_and(|c| c.iter().any(|c| c == BINDING_CONDITION))
            && !condition_true(claim, &r.pool, &r.device, BINDING_CONDITION)
            && !condition_true(claim, &r.pool, &r.device, BINDING_FAILURE_CONDITION)
    });
    Some(Here {
        claim: Claim::new(
            claim.metadata.namespace.clone().unwrap_or_default(),
            claim.metadata.name.clone().unwrap_or_default(),
            claim.metadata.uid.clone().unwrap_or_default(),
        ),
        domain: cfg.domain_id.clone(),
        node_channel: ours.iter().any(|r| r.pool == node),
        devices: ours
            .iter()
            .map(|r| (r.pool.clone(), r.device.clone()))
            .collect(),
        waiting,
    })
}

fn entries(h: &Here, kind: &str, reason: &str, message: &str) -> Vec<AllocatedDeviceStatus> {
    let mut condition = kubelet_plugin::status::ready(reason, message);
    condition.type_ = kind.into();
    h.devices
        .iter()
        .map(|(pool, device)| AllocatedDeviceStatus {
            driver: DRIVER_NAME.into(),
            pool: pool.clone(),
            device: device.clone(),
            conditions: Some(vec![condition.clone()]),
            ..AllocatedDeviceStatus::default()
        })
        .collect()
}

/// One pass (see the module docs). Returns the domain whose daemon is not ready on this node,
/// if any: the channel's taint.
pub async fn pass(plugin: &Plugin) -> anyhow::Result<Option<String>> {
    let node = plugin.node().to_string();
    let cluster = plugin.cluster().clone();
    // Prepares and unprepares wait meanwhile, so the label is never decided on a checkpoint
    // that is about to change.
    let cp = plugin.prepared().await;
    let mut labels = cluster.node_labels(&node).await?;
    let clique = plugin.clique_id().await?;
    // The clique label, as NVIDIA's plugin sets it (gpu-feature-discovery's key): the
    // controller's clique pools select their nodes by it.
    if !clique.is_empty() && labels.get(CLIQUE_LABEL) != Some(&clique) {
        cluster
            .set_node_label(&node, CLIQUE_LABEL, Some(&clique))
            .await?;
        labels.insert(CLIQUE_LABEL.into(), clique.clone());
        tracing::info!(%clique, "node labelled with its NVLink clique");
    }
    let claims = cluster.claims();
    let allocated: Vec<Here> = claims
        .iter()
        .flatten()
        .filter_map(|c| here(c, &node))
        .collect();
    for h in allocated.iter().filter(|h| h.waiting) {
        if h.node_channel {
            match labels.get(NODE_LABEL) {
                Some(v) if v == &h.domain => {}
                Some(v) => {
                    let why = format!(
                        "node {node} serves ComputeDomain {v}; a node serves one domain at a time"
                    );
                    let e = entries(
                        h,
                        BINDING_FAILURE_CONDITION,
                        "NodeServesAnotherDomain",
                        &why,
                    );
                    cluster.set_device_status(&h.claim, e).await?;
                    tracing::info!(claim = %h.claim.uid, domain = %h.domain, %why, "binding failed");
                    continue;
                }
                None => {
                    cluster
                        .set_node_label(&node, NODE_LABEL, Some(&h.domain))
                        .await?;
                    labels.insert(NODE_LABEL.into(), h.domain.clone());
                    tracing::info!(domain = %h.domain, "node labelled for the domain's daemon");
                }
            }
        }
        let object = if h.node_channel {
            h.domain.as_str()
        } else {
            PER_CLIQUE_PREFIX
        };
        if plugin.daemon_ready(object, &clique).await?.is_ok() {
            let msg = format!("the IMEX daemon of node {node} is Ready");
            let e = entries(h, BINDING_CONDITION, "DaemonReady", &msg);
            cluster.set_device_status(&h.claim, e).await?;
            tracing::info!(claim = %h.claim.uid, domain = %h.domain, "binding condition set");
        }
    }
    // The label stays while a claim allocated or prepared here names its domain; the claims
    // must have been read for that.
    if let (Some(_), Some(v)) = (&claims, labels.get(NODE_LABEL).cloned()) {
        let wanted: BTreeSet<&str> = allocated
            .iter()
            .filter(|h| h.node_channel)
            .map(|h| h.domain.as_str())
            .chain(
                cp.claims
                    .values()
                    .filter(|p| p.labelled)
                    .map(|p| p.domain.as_str()),
            )
            .collect();
        if !wanted.contains(v.as_str()) {
            cluster.set_node_label(&node, NODE_LABEL, None).await?;
            labels.remove(NODE_LABEL);
            tracing::info!(domain = %v, "node label removed: no claim of the domain is left here");
        }
    }
    drop(cp);
    let Some(domain) = labels.get(NODE_LABEL) else {
        return Ok(None);
    };
    let name = ComputeDomainClique::name_for(domain, &clique);
    let failing = cluster
        .clique(plugin.namespace(), &name)
        .await?
        .and_then(|c| c.daemons.into_iter().find(|d| d.node_name == node))
        .is_some_and(|d| d.status != STATUS_READY);
    Ok(failing.then(|| domain.clone()))
}

/// Runs passes until `stop`: every `every`, and when a claim changes; publishes the node's
/// slices whenever the taint changes (and once at the start).
pub async fn run(
    plugin: Arc<Plugin>,
    slices: PublisherHandle,
    binding_conditions: bool,
    every: Duration,
    stop: CancellationToken,
) {
    let node = plugin.node().to_string();
    let mut published: Option<Option<String>> = None;
    loop {
        match pass(&plugin).await {
            Ok(taint) => {
                if published.as_ref() != Some(&taint) {
                    match slices.set_desired(resources(&node, binding_conditions, taint.as_deref()))
                    {
                        Ok(_) => {
                            match &taint {
                                Some(d) => {
                                    tracing::warn!(domain = %d, "channel tainted: the node's IMEX daemon is not ready")
                                }
                                None if published.is_some() => {
                                    tracing::info!("channel taint removed")
                                }
                                None => {}
                            }
                            published = Some(taint);
                        }
                        Err(e) => tracing::error!(error = %e, "cannot publish the node's devices"),
                    }
                }
            }
            Err(e) => {
                tracing::warn!(error = format!("{e:#}"), "readiness pass failed; retrying");
                if published.is_none() {
                    // Publish the devices even while the cluster cannot be read.
                    if slices
                        .set_desired(resources(&node, binding_conditions, None))
                        .is_ok()
                    {
                        published = Some(None);
                    }
                }
            }
        }
        let cluster = plugin.cluster().clone();
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
            _ = cluster.changed() => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use k8s_openapi::api::resource::v1::{
        DeviceAllocationConfiguration, OpaqueDeviceConfiguration, ResourceClaim,
    };
    use k8s_openapi::apimachinery::pkg::runtime::RawExtension;
    use kubelet_plugin::testing::{allocated_claim, allocated_device};

    use super::*;
    use crate::computedomain::api::{CliqueDaemon, ComputeDomain, ComputeDomainSpec};
    use crate::computedomain::plugin::cluster::MemoryCluster;
    use crate::computedomain::plugin::prepare::Paths;

    const NODE: &str = "node-a";
    const DOMAIN: &str = "0f6c1d2e-0000-4000-8000-00000000000d";
    const CLIQUE: &str = "c0ffee00-0000-4000-8000-000000000001.1";

    fn plugin(dir: &Path, cluster: &MemoryCluster) -> Plugin {
        let mut d = ComputeDomain::new("team", "dom", ComputeDomainSpec::default());
        d.metadata.uid = Some(DOMAIN.into());
        cluster.put_domain(d);
        let paths = Paths {
            plugin_dir: dir.join("plugin"),
            cdi_root: dir.join("cdi"),
            proc_devices: dir.join("devices"),
            capabilities_root: dir.join("caps"),
            driver_root: crate::cdi::DriverRoot::at(&dir.join("driver")),
        };
        Plugin::new(
            NODE,
            "nvdra",
            Some(CLIQUE.into()),
            paths,
            Arc::new(cluster.clone()),
        )
        .unwrap()
    }

    /// A workload's claim allocated `channel-0` of this node, waiting for the binding condition.
    fn waiting_claim() -> ResourceClaim {
        let mut r = allocated_device("channel", DRIVER_NAME, NODE, "channel-0");
        r.binding_conditions = Some(vec![BINDING_CONDITION.into()]);
        r.binding_failure_conditions = Some(vec![BINDING_FAILURE_CONDITION.into()]);
        let mut c = allocated_claim("team", "wl", "claim-uid-1", vec![r]);
        let alloc = c.status.as_mut().unwrap().allocation.as_mut().unwrap();
        alloc.devices.as_mut().unwrap().config = Some(vec![DeviceAllocationConfiguration {
            source: "FromClaim".into(),
            requests: None,
            opaque: Some(OpaqueDeviceConfiguration {
                driver: DRIVER_NAME.into(),
                parameters: RawExtension(serde_json::json!({
                    "apiVersion": "resource.nvidia.com/v1beta1",
                    "kind": "ComputeDomainChannelConfig",
                    "domainID": DOMAIN,
                })),
            }),
        }]);
        c
    }

    fn clique(status: &str) -> ComputeDomainClique {
        let mut c = ComputeDomainClique::default();
        c.metadata.namespace = Some("nvdra".into());
        c.metadata.name = Some(ComputeDomainClique::name_for(DOMAIN, CLIQUE));
        c.daemons = vec![CliqueDaemon {
            node_name: NODE.into(),
            ip_address: "10.0.0.1".into(),
            clique_id: CLIQUE.into(),
            index: 0,
            status: status.into(),
        }];
        c
    }

    fn condition(cluster: &MemoryCluster, kind: &str) -> Option<String> {
        cluster
            .device_status("team", "wl")
            .iter()
            .flat_map(|e| e.conditions.iter().flatten())
            .find(|c| c.type_ == kind)
            .map(|c| c.status.clone())
    }

    #[tokio::test]
    async fn a_waiting_claim_brings_the_daemon_and_binds_once_it_is_ready() {
        let dir = tempfile::tempdir().unwrap();
        let cluster = MemoryCluster::default();
        let p = plugin(dir.path(), &cluster);
        cluster.put_claim(waiting_claim());

        // The daemon is placed: the node is labelled; no daemon yet, nothing else.
        assert_eq!(pass(&p).await.unwrap(), None);
        assert_eq!(
            cluster.labels(NODE).get(NODE_LABEL).map(String::as_str),
            Some(DOMAIN)
        );
        assert_eq!(condition(&cluster, BINDING_CONDITION), None);

        // It started and is not ready: the channel is tainted, the pod still waits.
        cluster.put_clique(clique("NotReady"));
        assert_eq!(pass(&p).await.unwrap().as_deref(), Some(DOMAIN));
        assert_eq!(condition(&cluster, BINDING_CONDITION), None);

        // Ready: the pod may bind, the taint goes.
        cluster.put_clique(clique("Ready"));
        assert_eq!(pass(&p).await.unwrap(), None);
        assert_eq!(
            condition(&cluster, BINDING_CONDITION).as_deref(),
            Some("True")
        );
        let entry = &cluster.device_status("team", "wl")[0];
        assert_eq!(
            (entry.pool.as_str(), entry.device.as_str()),
            (NODE, "channel-0")
        );

        // The claim gone (its pod never came, or left): the label goes.
        cluster.remove_claim("team", "wl");
        pass(&p).await.unwrap();
        assert_eq!(cluster.labels(NODE).get(NODE_LABEL), None);
    }

    #[tokio::test]
    async fn a_node_serving_another_domain_fails_the_binding_and_keeps_its_label() {
        let dir = tempfile::tempdir().unwrap();
        let cluster = MemoryCluster::default();
        let p = plugin(dir.path(), &cluster);
        cluster.put_label(NODE, NODE_LABEL, "another-domain");
        let mut other = waiting_claim();
        other.metadata.name = Some("other".into());
        other.metadata.uid = Some("claim-uid-2".into());
        let cfg = other.status.as_mut().unwrap().allocation.as_mut().unwrap();
        cfg.devices.as_mut().unwrap().config.as_mut().unwrap()[0]
            .opaque
            .as_mut()
            .unwrap()
            .parameters = RawExtension(serde_json::json!({
            "apiVersion": "resource.nvidia.com/v1beta1",
            "kind": "ComputeDomainChannelConfig",
            "domainID": "another-domain",
        }));
        // The other domain's claim keeps its label; this one's binding fails.
        cluster.put_claim(other);
        cluster.put_claim(waiting_claim());
        pass(&p).await.unwrap();
        assert_eq!(
            condition(&cluster, BINDING_FAILURE_CONDITION).as_deref(),
            Some("True")
        );
        assert_eq!(condition(&cluster, BINDING_CONDITION), None);
        assert_eq!(
            cluster.labels(NODE).get(NODE_LABEL).map(String::as_str),
            Some("another-domain")
        );
    }

    #[tokio::test]
    async fn an_idle_node_is_neither_labelled_nor_tainted() {
        let dir = tempfile::tempdir().unwrap();
        let cluster = MemoryCluster::default();
        let p = plugin(dir.path(), &cluster);
        cluster.put_clique(clique("NotReady"));
        assert_eq!(pass(&p).await.unwrap(), None);
        // Only its clique label, once.
        assert_eq!(cluster.labels(NODE).get(NODE_LABEL), None);
        assert_eq!(
            cluster.labels(NODE).get(CLIQUE_LABEL).map(String::as_str),
            Some(CLIQUE)
        );
        assert_eq!(pass(&p).await.unwrap(), None);
        assert_eq!(cluster.label_writes(), 1);
    }
}
