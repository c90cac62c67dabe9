//! A domain's status as a pure function of what the daemons report: NVIDIA's `status.status` and
//! `status.nodes` (from the domain's ComputeDomainCliques), and conditions a person can act on.
//!
//! - `status.nodes`: one entry per daemon of every clique `<UID>.<cliqueID>`, as NVIDIA's
//!   controller builds it.
//! - `status.status`: `NotReady` while fewer than `spec.numNodes` nodes are listed or any is
//!   `NotReady`, else `Ready` (NVIDIA's rule). A clique-channel domain has no daemons of its own:
//!   it is `Ready` once its claim exists (as NVIDIA's host-managed mode is once its template does)
//!   until the claim is allocated; then it follows the per-clique daemons of its channel's clique
//!   ([`clique_mode`]).
//! - `status.conditions` (nvdra's; NVIDIA's CRD prunes it, nvdra's keeps it):
//!   - `Ready`, with reason `AllNodesReady`, `WaitingForNodes` (how many, and the daemon pods
//!     that have not registered, with their pods' own reasons: Pending, CrashLoopBackOff,
//!     ImagePullBackOff…) or `DaemonNotReady` (each node with what its daemon last said: the
//!     event it records on its clique object, with IMEX's answer and last error line, else
//!     [`DAEMON_REASON_ANNOTATION`] on its pod, else its pod's state); for a clique-channel domain
//!     `ClaimMissing`, `ChannelNotAllocated`, then `CliqueReady`, `DaemonNotReady` or
//!     `WaitingForNodes` about its clique's per-clique daemons;
//!   - `PeersConnected`: `AllPeersConnected`, or `PeersMissing` naming, per node, the nodes of
//!     its clique its daemon does not see (the peer matrix, from [`DAEMON_PEERS_ANNOTATION`]).
//!
//! A condition keeps its `lastTransitionTime` while its `status` stays the same.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::{Event, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;

use super::pools::POOL_PREFIX;
use crate::computedomain::api::{
    CliqueDaemon, ComputeDomain, ComputeDomainClique, ComputeDomainStatus, DAEMON_PEERS_ANNOTATION,
    DAEMON_REASON_ANNOTATION, DOMAIN_LABEL, DomainNode, STATUS_NOT_READY, STATUS_READY,
};
use crate::computedomain::daemon::clique::PER_CLIQUE_PREFIX;

/// The condition types.
pub const READY: &str = "Ready";
/// See [`READY`].
pub const PEERS: &str = "PeersConnected";

/// What a domain's daemon pod says about its node, beyond its clique entry.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DaemonReport {
    /// The node the pod runs on (empty while it is not scheduled).
    pub node: String,
    /// The pod's name.
    pub pod: String,
    /// Why the daemon is not ready: its own line ([`DAEMON_REASON_ANNOTATION`]), else what the
    /// pod's status says (a container waiting or crashed, the pod pending).
    pub reason: Option<String>,
    /// The nodes its IMEX daemon is connected to ([`DAEMON_PEERS_ANNOTATION`]), if it said.
    pub peers: Option<BTreeSet<String>>,
}

/// What a daemon pod reports.
pub fn report(pod: &Pod) -> DaemonReport {
    let annotations = pod.metadata.annotations.as_ref();
    let note = |key: &str| {
        annotations
            .and_then(|a| a.get(key))
            .map(|v| v.trim().to_string())
    };
    let reason = note(DAEMON_REASON_ANNOTATION)
        .filter(|r| !r.is_empty())
        .or_else(|| pod_reason(pod));
    let peers = note(DAEMON_PEERS_ANNOTATION).map(|v| {
        v.split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .map(String::from)
            .collect()
    });
    DaemonReport {
        node: pod
            .spec
            .as_ref()
            .and_then(|s| s.node_name.clone())
            .unwrap_or_default(),
        pod: pod.metadata.name.clone().unwrap_or_default(),
        reason,
        peers,
    }
}

/// What the pod's status says is wrong, if anything: a container waiting (with its reason and
/// message), one that last ended with a failure (its termination message), or the pod pending.
fn pod_reason(pod: &Pod) -> Option<String> {
    let status = pod.status.as_ref()?;
    for c in status.container_statuses.iter().flatten() {
        if let Some(w) = c.state.as_ref().and_then(|s| s.waiting.as_ref()) {
            let mut line = w.reason.clone().unwrap_or_else(|| "Waiting".into());
            if let Some(m) = w.message.as_deref().filter(|m| !m.is_empty()) {
                line = format!("{line}: {m}");
            }
            if let Some(t) = c.last_state.as_ref().and_then(|s| s.terminated.as_ref())
                && let Some(m) = t
                    .message
                    .as_deref()
                    .map(str::trim)
                    .filter(|m| !m.is_empty())
            {
                line = format!("{line}; last exit {}: {}", t.exit_code, last_line(m));
            }
            return Some(line);
        }
    }
    if status.phase.as_deref() == Some("Pending") {
        let why = status
            .conditions
            .iter()
            .flatten()
            .filter(|c| c.status == "False")
            .find_map(|c| c.message.clone().or_else(|| c.reason.clone()));
        return Some(match why {
            Some(m) => format!("Pending: {m}"),
            None => "Pending".into(),
        });
    }
    None
}

fn last_line(s: &str) -> &str {
    s.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or(s)
}

/// Each node's latest word on the domain's clique objects: the events the daemons record there
/// (`involvedObject` the clique `<uid>.<cliqueID>`, `source.host` the node, the message
/// `node <name>: <why>`), by node, the prefix taken off; a node whose latest event is not a
/// warning (it recovered) has none.
pub fn event_reasons(uid: &str, events: &[Event]) -> BTreeMap<String, String> {
    let prefix = format!("{uid}.");
    // Per node, its latest event: a warning's message, or nothing once it said it is ready.
    let mut latest: BTreeMap<String, (Option<Timestamp>, Option<String>)> = BTreeMap::new();
    for e in events {
        let ours = e.involved_object.kind.as_deref() == Some("ComputeDomainClique")
            && e.involved_object
                .name
                .as_deref()
                .is_some_and(|n| n.starts_with(&prefix));
        let node = e
            .source
            .as_ref()
            .and_then(|s| s.host.clone())
            .or_else(|| e.reporting_instance.clone());
        let (true, Some(node), Some(message)) = (ours, node, e.message.as_deref()) else {
            continue;
        };
        let at = e
            .last_timestamp
            .as_ref()
            .map(|t| t.0)
            .or_else(|| e.event_time.as_ref().map(|t| t.0))
            .or_else(|| e.metadata.creation_timestamp.as_ref().map(|t| t.0));
        let why = (e.type_.as_deref() == Some("Warning")).then(|| {
            message
                .strip_prefix(&format!("node {node}: "))
                .unwrap_or(message)
                .to_string()
        });
        match latest.get(&node) {
            Some((seen, _)) if *seen > at => {}
            _ => {
                latest.insert(node, (at, why));
            }
        }
    }
    latest
        .into_iter()
        .filter_map(|(n, (_, why))| Some((n, why?)))
        .collect()
}

/// `status.nodes` from the domain's cliques (those labelled with its UID, as NVIDIA's controller
/// groups them), in clique and index order.
pub fn nodes_from_cliques(uid: &str, cliques: &[ComputeDomainClique]) -> Vec<DomainNode> {
    let mut nodes: Vec<DomainNode> = cliques
        .iter()
        .filter(|c| {
            c.metadata
                .labels
                .as_ref()
                .and_then(|l| l.get(DOMAIN_LABEL))
                .is_some_and(|u| u == uid)
        })
        .flat_map(|c| &c.daemons)
        .map(domain_node)
        .collect();
    nodes.sort_by(|a, b| (&a.clique_id, a.index, &a.name).cmp(&(&b.clique_id, b.index, &b.name)));
    nodes
}

/// A clique entry as a `status.nodes` entry (no status yet is NotReady).
fn domain_node(d: &CliqueDaemon) -> DomainNode {
    DomainNode {
        name: d.node_name.clone(),
        ip_address: d.ip_address.clone(),
        clique_id: d.clique_id.clone(),
        index: d.index,
        status: if d.status.is_empty() {
            STATUS_NOT_READY.into()
        } else {
            d.status.clone()
        },
    }
}

/// `<node>: <why>` for each node that is not ready: its latest event's line, else its pod's
/// reason.
fn not_ready_lines(
    nodes: &[DomainNode],
    reasons: &BTreeMap<String, String>,
    pods: &[DaemonReport],
) -> Vec<String> {
    let by_node: BTreeMap<&str, &DaemonReport> =
        pods.iter().map(|p| (p.node.as_str(), p)).collect();
    nodes
        .iter()
        .filter(|n| n.status != STATUS_READY)
        .map(|n| {
            let why = reasons
                .get(&n.name)
                .cloned()
                .or_else(|| by_node.get(n.name.as_str()).and_then(|p| p.reason.clone()))
                .unwrap_or_else(|| "its IMEX daemon is not ready (it reported no reason)".into());
            format!("{}: {why}", n.name)
        })
        .collect()
}

/// For each daemon pod whose node has no entry yet: where it is and why it has not registered.
fn pending_lines(nodes: &[DomainNode], pods: &[DaemonReport]) -> Vec<String> {
    let listed: BTreeSet<&str> = nodes.iter().map(|n| n.name.as_str()).collect();
    pods.iter()
        .filter(|p| !listed.contains(p.node.as_str()))
        .map(|p| {
            let at = if p.node.is_empty() {
                format!("pod {}", p.pod)
            } else {
                format!("{} (pod {})", p.node, p.pod)
            };
            match &p.reason {
                Some(r) => format!("{at}: {r}"),
                None => format!("{at}: not registered in its clique yet"),
            }
        })
        .collect()
}

/// NVIDIA's rule for `status.status`.
pub fn overall(num_nodes: i64, nodes: &[DomainNode]) -> &'static str {
    let listed = i64::try_from(nodes.len()).unwrap_or(i64::MAX);
    if listed < num_nodes || nodes.iter().any(|n| n.status != STATUS_READY) {
        STATUS_NOT_READY
    } else {
        STATUS_READY
    }
}

/// A condition, keeping `previous`'s transition time while its status holds.
fn condition(
    previous: &[Condition],
    type_: &str,
    ok: bool,
    reason: &str,
    message: String,
    generation: Option<i64>,
    now: Timestamp,
) -> Condition {
    let status = if ok { "True" } else { "False" };
    let since = previous
        .iter()
        .find(|c| c.type_ == type_ && c.status == status)
        .map(|c| c.last_transition_time.clone())
        .unwrap_or(Time(now));
    Condition {
        type_: type_.into(),
        status: status.into(),
        reason: reason.into(),
        message,
        observed_generation: generation,
        last_transition_time: since,
    }
}

/// The domain's conditions as last written.
pub fn conditions_of(cd: &ComputeDomain) -> Vec<Condition> {
    cd.status
        .as_ref()
        .and_then(|s| s.other.get("conditions"))
        .and_then(|v| serde_json::from_value(v.clone()).ok())
        .unwrap_or_default()
}

/// The status of a domain in NVIDIA's per-node mode.
pub fn per_node(
    cd: &ComputeDomain,
    cliques: &[ComputeDomainClique],
    pods: &[DaemonReport],
    reasons: &BTreeMap<String, String>,
    now: Timestamp,
) -> ComputeDomainStatus {
    let uid = cd.metadata.uid.as_deref().unwrap_or_default();
    let nodes = nodes_from_cliques(uid, cliques);
    let status = overall(cd.spec.num_nodes, &nodes);
    let previous = conditions_of(cd);
    let generation = cd.metadata.generation;
    let not_ready = not_ready_lines(&nodes, reasons, pods);
    let ready = if status == STATUS_READY {
        condition(
            &previous,
            READY,
            true,
            "AllNodesReady",
            format!("{} of {} nodes ready", nodes.len(), cd.spec.num_nodes),
            generation,
            now,
        )
    } else if !not_ready.is_empty() {
        condition(
            &previous,
            READY,
            false,
            "DaemonNotReady",
            not_ready.join("; "),
            generation,
            now,
        )
    } else {
        let pending = pending_lines(&nodes, pods);
        let mut message = format!(
            "{} of {} nodes have registered an IMEX daemon; a node gets one when a pod using \
             the domain's channel is scheduled there",
            nodes.len(),
            cd.spec.num_nodes
        );
        if !pending.is_empty() {
            message = format!("{message}; {}", pending.join("; "));
        }
        condition(
            &previous,
            READY,
            false,
            "WaitingForNodes",
            message,
            generation,
            now,
        )
    };

    let mut conditions = vec![ready];
    if let Some(peers) = peer_condition(&nodes, pods, &previous, generation, now) {
        conditions.push(peers);
    }
    with_conditions(cd, status, nodes, conditions)
}

/// The peer matrix as a condition: for each node whose daemon said which peers it sees, the
/// nodes of its clique missing from them. `None` when no daemon said.
fn peer_condition(
    nodes: &[DomainNode],
    pods: &[DaemonReport],
    previous: &[Condition],
    generation: Option<i64>,
    now: Timestamp,
) -> Option<Condition> {
    let mut missing = Vec::new();
    let mut reported = false;
    for node in nodes {
        let Some(seen) = pods
            .iter()
            .find(|p| p.node == node.name)
            .and_then(|p| p.peers.as_ref())
        else {
            continue;
        };
        reported = true;
        let unseen: Vec<&str> = nodes
            .iter()
            .filter(|o| o.clique_id == node.clique_id && o.name != node.name)
            .map(|o| o.name.as_str())
            .filter(|o| !seen.contains(*o))
            .collect();
        if !unseen.is_empty() {
            missing.push(format!("{} does not see {}", node.name, unseen.join(", ")));
        }
    }
    if !reported {
        return None;
    }
    Some(if missing.is_empty() {
        condition(
            previous,
            PEERS,
            true,
            "AllPeersConnected",
            "every daemon sees every node of its clique".into(),
            generation,
            now,
        )
    } else {
        condition(
            previous,
            PEERS,
            false,
            "PeersMissing",
            format!(
                "{} (check the IMEX port, 50000 by default, between these nodes)",
                missing.join("; ")
            ),
            generation,
            now,
        )
    })
}

/// Where a clique-channel domain's claim stands.
#[derive(Clone, Debug, PartialEq)]
pub enum ClaimState {
    /// Not created yet.
    Missing,
    /// Created, not allocated: no pod using it has been scheduled.
    Pending,
    /// Allocated: `channel-<N>` of the pool of a clique.
    Allocated { pool: String, device: String },
}

/// The clique a pool serves (`clique-<clique>`).
pub fn pool_clique(pool: &str) -> &str {
    pool.strip_prefix(POOL_PREFIX).unwrap_or(pool)
}

/// What the per-clique daemons of the clique an allocated channel belongs to report.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CliqueDaemons {
    /// `fabric.<clique>`, absent until a daemon of the clique has registered.
    pub object: Option<ComputeDomainClique>,
    /// The per-clique daemon pods of the clique.
    pub pods: Vec<DaemonReport>,
    /// Each node's latest word, from the events on `fabric.<clique>` ([`event_reasons`]).
    pub reasons: BTreeMap<String, String>,
}

/// The status of a clique-channel domain: where its claim stands and, once its channel is
/// allocated to a clique, that clique's per-clique daemons (`fabric.<clique>`): `Ready` while at
/// least `spec.numNodes` (at least one) of them are Ready, as many nodes as the domain's pods
/// need, else `NotReady` naming the nodes and their reasons as for NVIDIA's shape. Every node of
/// the clique is listed in `status.nodes`: the scheduler may place the domain's pods on any.
pub fn clique_mode(
    cd: &ComputeDomain,
    claim_name: &str,
    claim: &ClaimState,
    daemons: &CliqueDaemons,
    now: Timestamp,
) -> ComputeDomainStatus {
    let previous = conditions_of(cd);
    let generation = cd.metadata.generation;
    let cond = |ok: bool, reason: &str, message: String| {
        condition(&previous, READY, ok, reason, message, generation, now)
    };
    let (pool, device) = match claim {
        ClaimState::Missing => {
            let c = cond(
                false,
                "ClaimMissing",
                format!("the domain's ResourceClaim {claim_name} does not exist yet"),
            );
            return with_conditions(cd, STATUS_NOT_READY, Vec::new(), vec![c]);
        }
        ClaimState::Pending => {
            let c = cond(
                true,
                "ChannelNotAllocated",
                format!(
                    "pods sharing ResourceClaim {claim_name} (resourceClaimName) get one channel \
                     of one clique's pool when the first of them is scheduled"
                ),
            );
            return with_conditions(cd, STATUS_READY, Vec::new(), vec![c]);
        }
        ClaimState::Allocated { pool, device } => (pool, device),
    };
    let clique = pool_clique(pool);
    let object = ComputeDomainClique::name_for(PER_CLIQUE_PREFIX, clique);
    let mut nodes: Vec<DomainNode> = daemons
        .object
        .iter()
        .flat_map(|o| &o.daemons)
        .map(domain_node)
        .collect();
    nodes.sort_by(|a, b| (a.index, &a.name).cmp(&(b.index, &b.name)));
    let need = usize::try_from(cd.spec.num_nodes.max(1)).unwrap_or(usize::MAX);
    let ready_count = nodes.iter().filter(|n| n.status == STATUS_READY).count();
    let not_ready = not_ready_lines(&nodes, &daemons.reasons, &daemons.pods);
    let at = format!("{device} of pool {pool}");
    let (status, ready) = if ready_count >= need {
        let mut message = format!(
            "{at}: {ready_count} of the {} nodes of clique {clique} have a ready IMEX daemon \
             (the domain needs {need})",
            nodes.len()
        );
        if !not_ready.is_empty() {
            message = format!("{message}; not ready: {}", not_ready.join("; "));
        }
        (STATUS_READY, cond(true, "CliqueReady", message))
    } else if !not_ready.is_empty() {
        let message = format!(
            "{at}: {ready_count} of the {need} nodes the domain needs have a ready IMEX daemon in \
             clique {clique}; {}",
            not_ready.join("; ")
        );
        (STATUS_NOT_READY, cond(false, "DaemonNotReady", message))
    } else {
        let mut message = format!(
            "{at}: {} of the {need} nodes the domain needs have registered a per-clique IMEX \
             daemon in ComputeDomainClique {object}",
            nodes.len()
        );
        let pending = pending_lines(&nodes, &daemons.pods);
        if !pending.is_empty() {
            message = format!("{message}; {}", pending.join("; "));
        } else if daemons.pods.is_empty() {
            message = format!(
                "{message}; no per-clique daemon pod runs in the clique: the controller runs them \
                 (DaemonSet computedomain-daemon-{object}) while its --clique-channels is above 0"
            );
        }
        (STATUS_NOT_READY, cond(false, "WaitingForNodes", message))
    };
    let mut conditions = vec![ready];
    if let Some(peers) = peer_condition(&nodes, &daemons.pods, &previous, generation, now) {
        conditions.push(peers);
    }
    with_conditions(cd, status, nodes, conditions)
}

fn with_conditions(
    cd: &ComputeDomain,
    status: &str,
    nodes: Vec<DomainNode>,
    conditions: Vec<Condition>,
) -> ComputeDomainStatus {
    let mut other = cd
        .status
        .as_ref()
        .map(|s| s.other.clone())
        .unwrap_or_default();
    other.insert(
        "conditions".into(),
        serde_json::to_value(conditions).unwrap_or_default(),
    );
    ComputeDomainStatus {
        status: status.into(),
        nodes,
        other,
    }
}

#[cfg(test)]
mod tests;
