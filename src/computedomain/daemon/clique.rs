//! This node's entry in its ComputeDomainClique (`<domainUID>.<cliqueID>` in the driver's
//! namespace, or `fabric.<cliqueID>` for the per-clique daemon): the pure edits of the
//! `daemons` list (a list map keyed by `nodeName`), and the store the daemon reads and writes
//! the object through ([`Cliques`]: the API server in production, [`MemoryCliques`] in tests).
//!
//! Invariants of the edits:
//! - one entry per node name; this node's entry carries its current pod IP;
//! - a new entry takes the lowest index no entry holds (so names stay stable when a node in
//!   the middle leaves and another joins), below the domain's maximum;
//! - an entry of another node that carries this node's IP is stale (its pod is gone and the IP
//!   is this pod's now) and is dropped, so one IP never answers two names.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;

use futures::future::BoxFuture;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use crate::computedomain::api::{
    CLIQUE_ID_LABEL, CliqueDaemon, ComputeDomainClique, DOMAIN_LABEL, STATUS_NOT_READY,
};
/// The prefix of the clique object of the per-clique daemon (one IMEX daemon per fabric node,
/// serving every domain of the clique): `fabric.<cliqueID>`.
pub const PER_CLIQUE_PREFIX: &str = "fabric";

/// Who this daemon is in its clique.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Me {
    pub node_name: String,
    pub ip: String,
    pub clique_id: String,
    /// Indices run from 0 to this, exclusive (`--max-nodes-per-imex-domain`).
    pub max_nodes: u32,
}

/// Why this node has no entry.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "the clique has no free index below {max} (every one of 0..{max} is taken by another \
     node): raise --max-nodes-per-imex-domain or remove the entries of nodes that left"
)]
pub struct Full {
    pub max: u32,
}

/// Inserts or updates this node's entry (its IP, a new one's index and `NotReady`); true when
/// the list changed.
pub fn upsert(daemons: &mut Vec<CliqueDaemon>, me: &Me) -> Result<bool, Full> {
    let before = daemons.len();
    daemons.retain(|d| d.node_name == me.node_name || d.ip_address != me.ip);
    let mut changed = daemons.len() != before;
    if let Some(d) = daemons.iter_mut().find(|d| d.node_name == me.node_name) {
        if d.ip_address != me.ip || d.clique_id != me.clique_id {
            d.ip_address.clone_from(&me.ip);
            d.clique_id.clone_from(&me.clique_id);
            changed = true;
        }
        return Ok(changed);
    }
    let taken: BTreeSet<i64> = daemons.iter().map(|d| d.index).collect();
    let index = (0..i64::from(me.max_nodes))
        .find(|i| !taken.contains(i))
        .ok_or(Full { max: me.max_nodes })?;
    daemons.push(CliqueDaemon {
        node_name: me.node_name.clone(),
        ip_address: me.ip.clone(),
        clique_id: me.clique_id.clone(),
        index,
        status: STATUS_NOT_READY.into(),
    });
    Ok(true)
}

/// Sets this node's status; true when it changed (false also when the node has no entry).
pub fn set_status(daemons: &mut [CliqueDaemon], node_name: &str, status: &str) -> bool {
    match daemons.iter_mut().find(|d| d.node_name == node_name) {
        Some(d) if d.status != status => {
            d.status = status.into();
            true
        }
        _ => false,
    }
}

/// Drops this node's entry if it still carries this pod's IP (a successor pod on the node
/// that already wrote its own IP keeps its entry); true when it was dropped.
pub fn remove(daemons: &mut Vec<CliqueDaemon>, me: &Me) -> bool {
    let before = daemons.len();
    daemons.retain(|d| !(d.node_name == me.node_name && d.ip_address == me.ip));
    daemons.len() != before
}

/// The peers' DNS names (by index) and IPs: what the hosts file maps. Only entries of this
/// clique count; indices at or above the maximum are left out (the static `nodes.cfg` has no
/// name for them).
pub fn names(daemons: &[CliqueDaemon], clique_id: &str, max_nodes: u32) -> BTreeMap<i64, String> {
    daemons
        .iter()
        .filter(|d| d.clique_id == clique_id && (0..i64::from(max_nodes)).contains(&d.index))
        .map(|d| (d.index, d.ip_address.clone()))
        .collect()
}

/// A new clique object named `name` in `namespace`, labelled with its domain and clique.
pub fn new_object(
    namespace: &str,
    name: &str,
    domain_uid: &str,
    clique_id: &str,
) -> ComputeDomainClique {
    let mut labels = BTreeMap::new();
    if !domain_uid.is_empty() {
        labels.insert(DOMAIN_LABEL.to_string(), domain_uid.to_string());
    }
    labels.insert(CLIQUE_ID_LABEL.to_string(), clique_id.to_string());
    ComputeDomainClique {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some(namespace.into()),
            labels: Some(labels),
            ..ObjectMeta::default()
        },
        ..ComputeDomainClique::default()
    }
}

/// A failed store call.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The object changed since it was read (or already exists, on create): read it again.
    #[error("the clique object changed meanwhile")]
    Conflict,
    #[error("{0}")]
    Other(String),
}

/// Where the clique objects live. Each call is one request; the daemon owns retries.
pub trait Cliques: Send + Sync + 'static {
    fn get<'a>(
        &'a self,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Option<ComputeDomainClique>, StoreError>>;
    /// Fails with [`StoreError::Conflict`] when the object exists.
    fn create(
        &self,
        clique: ComputeDomainClique,
    ) -> BoxFuture<'_, Result<ComputeDomainClique, StoreError>>;
    /// Fails with [`StoreError::Conflict`] when its resourceVersion is not the stored one.
    fn replace(
        &self,
        clique: ComputeDomainClique,
    ) -> BoxFuture<'_, Result<ComputeDomainClique, StoreError>>;
    /// Records an event on the object (a warning when `warning`): best effort.
    fn event<'a>(
        &'a self,
        clique: &'a ComputeDomainClique,
        warning: bool,
        reason: &'a str,
        message: &'a str,
    ) -> BoxFuture<'a, Result<(), StoreError>>;
    /// Sets this daemon's own pod's annotations: why it is not ready (empty when ready) and the
    /// nodes its IMEX is connected to, comma-separated (`None`: unknown, the annotation goes).
    fn annotate<'a>(
        &'a self,
        reason: &'a str,
        peers: Option<&'a str>,
    ) -> BoxFuture<'a, Result<(), StoreError>>;
    /// Whether [`Cliques::annotate`] writes anywhere (no pod name: the daemon does not ask IMEX
    /// for its peers at all).
    fn annotates(&self) -> bool {
        true
    }
}

/// The annotations [`MemoryCliques`] was given, in order: (reason, peers).
pub type RecordedNotes = (String, Option<String>);

/// One recorded event of [`MemoryCliques`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecordedEvent {
    pub object: String,
    pub warning: bool,
    pub reason: String,
    pub message: String,
}

/// Clique objects in memory, with the API server's optimistic concurrency (resourceVersion):
/// for tests, and for several daemons of one test sharing one store.
#[derive(Default)]
pub struct MemoryCliques {
    inner: Mutex<MemoryState>,
}

#[derive(Default)]
struct MemoryState {
    objects: BTreeMap<String, ComputeDomainClique>,
    version: u64,
    events: Vec<RecordedEvent>,
    writes: u64,
    notes: Vec<RecordedNotes>,
}

impl MemoryCliques {
    /// The stored object, as a reader would get it.
    pub fn object(&self, name: &str) -> Option<ComputeDomainClique> {
        self.lock().objects.get(name).cloned()
    }

    /// Every event recorded so far, in order.
    pub fn events(&self) -> Vec<RecordedEvent> {
        self.lock().events.clone()
    }

    /// Every pod annotation written so far, in order.
    pub fn notes(&self) -> Vec<RecordedNotes> {
        self.lock().notes.clone()
    }

    /// Successful creates and replaces so far.
    pub fn writes(&self) -> u64 {
        self.lock().writes
    }

    /// Replaces the object as another writer would (a test standing in for another node).
    pub fn edit(&self, name: &str, f: impl FnOnce(&mut ComputeDomainClique)) {
        let mut s = self.lock();
        s.version += 1;
        let version = s.version.to_string();
        if let Some(o) = s.objects.get_mut(name) {
            f(o);
            o.metadata.resource_version = Some(version);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, MemoryState> {
        // A panic while holding the lock is a test failure already; keep its state readable.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn store(
        &self,
        mut clique: ComputeDomainClique,
        create: bool,
    ) -> Result<ComputeDomainClique, StoreError> {
        let mut s = self.lock();
        let name = clique.metadata.name.clone().unwrap_or_default();
        match s.objects.get(&name) {
            Some(_) if create => return Err(StoreError::Conflict),
            None if !create => return Err(StoreError::Other(format!("{name} not found"))),
            Some(old) if old.metadata.resource_version != clique.metadata.resource_version => {
                return Err(StoreError::Conflict);
            }
            _ => {}
        }
        s.version += 1;
        s.writes += 1;
        clique.metadata.resource_version = Some(s.version.to_string());
        s.objects.insert(name, clique.clone());
        Ok(clique)
    }
}

impl Cliques for MemoryCliques {
    fn get<'a>(
        &'a self,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Option<ComputeDomainClique>, StoreError>> {
        let found = self.object(name);
        Box::pin(async move { Ok(found) })
    }

    fn create(
        &self,
        clique: ComputeDomainClique,
    ) -> BoxFuture<'_, Result<ComputeDomainClique, StoreError>> {
        let r = self.store(clique, true);
        Box::pin(async move { r })
    }

    fn replace(
        &self,
        clique: ComputeDomainClique,
    ) -> BoxFuture<'_, Result<ComputeDomainClique, StoreError>> {
        let r = self.store(clique, false);
        Box::pin(async move { r })
    }

    fn event<'a>(
        &'a self,
        clique: &'a ComputeDomainClique,
        warning: bool,
        reason: &'a str,
        message: &'a str,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        self.lock().events.push(RecordedEvent {
            object: clique.metadata.name.clone().unwrap_or_default(),
            warning,
            reason: reason.into(),
            message: message.into(),
        });
        Box::pin(async { Ok(()) })
    }
    fn annotate<'a>(
        &'a self,
        reason: &'a str,
        peers: Option<&'a str>,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        self.lock()
            .notes
            .push((reason.to_string(), peers.map(str::to_string)));
        Box::pin(async { Ok(()) })
    }
}
