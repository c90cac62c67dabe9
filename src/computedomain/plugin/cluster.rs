//! What the plugin reads and writes in the cluster besides slices and claims' reads (which are
//! the library's): ComputeDomains (by UID), its node's entries in ComputeDomainCliques, its Node's
//! labels, the claims allocated on its node, and their device conditions. One trait, so the
//! plugin's logic runs against `MemoryCluster` in unit tests and [`KubeCluster`] in a cluster.
//!
//! [`KubeCluster`] reads from watches where it can (a prepare lists nothing) and puts every call
//! under [`CALL_DEADLINE`], the error naming the call.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context, anyhow};
use futures::StreamExt;
use futures::future::BoxFuture;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::{AllocatedDeviceStatus, ResourceClaim, ResourceSlice};
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::runtime::WatchStreamExt;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::watcher;
use kubelet_plugin::Claim;
use kubelet_plugin::status::StatusWriter;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::computedomain::api::{ComputeDomain, ComputeDomainClique, DRIVER_NAME};
use crate::dra::slices::{ATTR_FABRIC_CLIQUE_ID, ATTR_FABRIC_CLUSTER_UUID};

/// The cluster as the plugin sees it.
pub trait Cluster: Send + Sync + 'static {
    /// The ComputeDomain with UID `uid`, in any namespace; `None` when there is none.
    fn domain<'a>(&'a self, uid: &'a str) -> BoxFuture<'a, anyhow::Result<Option<ComputeDomain>>>;
    /// The ComputeDomainClique `name` of `namespace`; `None` when there is none.
    fn clique<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, anyhow::Result<Option<ComputeDomainClique>>>;
    /// The labels of Node `node`.
    fn node_labels<'a>(
        &'a self,
        node: &'a str,
    ) -> BoxFuture<'a, anyhow::Result<BTreeMap<String, String>>>;
    /// Sets (`Some`) or removes (`None`) one label of Node `node`, touching no other.
    fn set_node_label<'a>(
        &'a self,
        node: &'a str,
        key: &'a str,
        value: Option<&'a str>,
    ) -> BoxFuture<'a, anyhow::Result<()>>;
    /// The NVLink clique nvdra's GPU driver (`gpu.nvidia.com`) publishes for the node's GPUs
    /// (`fabricClusterUUID`.`fabricCliqueID`, the form of the `nvidia.com/gpu.clique` label);
    /// `None` when its slices name none, or several.
    fn gpu_clique<'a>(&'a self, node: &'a str) -> BoxFuture<'a, anyhow::Result<Option<String>>>;
    /// The ResourceClaims (all of them, as last seen); `None` until they were read once.
    fn claims(&self) -> Option<Vec<ResourceClaim>>;
    /// Makes `entries` the driver's entries in `claim`'s `status.devices`.
    fn set_device_status<'a>(
        &'a self,
        claim: &'a Claim,
        entries: Vec<AllocatedDeviceStatus>,
    ) -> BoxFuture<'a, anyhow::Result<()>>;
    /// Resolves when something the plugin follows (claims) may have changed.
    fn changed(&self) -> BoxFuture<'_, ()>;
}

/// nvdra's GPU driver, whose slices carry the GPUs' fabric registration.
pub const GPU_DRIVER: &str = "gpu.nvidia.com";

/// The one clique of the GPUs in `slices`, `<fabricClusterUUID>.<fabricCliqueID>`; `None` when
/// no GPU has one or they disagree (NVIDIA's plugin refuses a node whose GPUs do).
pub fn clique_of<'a>(slices: impl IntoIterator<Item = &'a ResourceSlice>) -> Option<String> {
    let mut found = std::collections::BTreeSet::new();
    for d in slices
        .into_iter()
        .flat_map(|s| s.spec.devices.iter().flatten())
    {
        let Some(attrs) = &d.attributes else { continue };
        let cluster = attrs
            .get(ATTR_FABRIC_CLUSTER_UUID)
            .and_then(|a| a.string.clone());
        let clique = attrs.get(ATTR_FABRIC_CLIQUE_ID).and_then(|a| a.int);
        if let (Some(u), Some(c)) = (cluster, clique) {
            found.insert(format!("{u}.{c}"));
        }
    }
    if found.len() > 1 {
        tracing::warn!(cliques = ?found, "the node's GPUs name several NVLink cliques; none is used");
        return None;
    }
    found.pop_first()
}

/// How long one call of the plugin's to the API server may take before it fails with an error
/// naming the call: nvdra's DRA path's deadline (the library's claim read), well inside the
/// kubelet's 45 s for a prepare. Per call rather than as the client's `read_timeout`, which
/// would also cut the watches.
pub const CALL_DEADLINE: Duration = kubelet_plugin::claims::READ_DEADLINE;

/// `call` (`what` names it: "list computedomains") under [`CALL_DEADLINE`]: `Err` when the API
/// server did not answer in time, else the call's own result.
pub async fn within<T>(
    what: &str,
    call: impl Future<Output = Result<T, kube::Error>>,
) -> anyhow::Result<Result<T, kube::Error>> {
    tokio::time::timeout(CALL_DEADLINE, call)
        .await
        .map_err(|_| {
            anyhow!(
                "the API server did not answer the call to {what} within {CALL_DEADLINE:?}; it is \
             retried (the kubelet retries a prepare)"
            )
        })
}

/// A kind the plugin follows with a watch (a reflector): its store, and whether the watch has
/// listed it once.
struct Followed<K: kube::Resource + 'static>
where
    K::DynamicType: Eq + std::hash::Hash + Clone,
{
    store: Store<K>,
    synced: Arc<AtomicBool>,
}

impl<K: kube::Resource + 'static> Followed<K>
where
    K::DynamicType: Eq + std::hash::Hash + Clone,
{
    /// The store, once the watch has listed the kind.
    fn ready(&self) -> Option<&Store<K>> {
        self.synced.load(Ordering::Relaxed).then_some(&self.store)
    }
}

/// Follows `api` (selected by `config`) until `stop`: each object is trimmed by `trim` before it
/// is stored, and `changed` is told when an object `wakes` the readiness pass.
fn follow<K>(
    api: Api<K>,
    config: watcher::Config,
    trim: impl FnMut(&mut K) + Send + 'static,
    wakes: impl Fn(&K) -> bool + Send + 'static,
    changed: Arc<Notify>,
    stop: CancellationToken,
) -> Followed<K>
where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug
        + Send
        + Sync
        + 'static,
{
    let (store, writer) = reflector::store();
    let events = watcher(api, config)
        .default_backoff()
        .modify(trim)
        .reflect(writer);
    let synced = Arc::new(AtomicBool::new(false));
    let listed = synced.clone();
    let kind = K::plural(&()).to_string();
    tokio::spawn(async move {
        let mut events = std::pin::pin!(events);
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                next = events.next() => match next {
                    // The reflector has stored the whole list by now.
                    Some(Ok(watcher::Event::InitDone)) => listed.store(true, Ordering::Relaxed),
                    Some(Ok(watcher::Event::Init)) => {}
                    Some(Ok(
                        watcher::Event::Apply(obj)
                        | watcher::Event::InitApply(obj)
                        | watcher::Event::Delete(obj),
                    )) => {
                        if wakes(&obj) {
                            changed.notify_one();
                        }
                    }
                    Some(Err(e)) => tracing::warn!(%kind, error = %e, "watching failed; retrying"),
                    None => return,
                },
            }
        }
    });
    Followed { store, synced }
}

/// Whether `claim` has a result of this driver (those the readiness pass reads).
fn of_driver(claim: &ResourceClaim) -> bool {
    claim
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .and_then(|a| a.devices.as_ref())
        .and_then(|d| d.results.as_ref())
        .is_some_and(|r| r.iter().any(|r| r.driver == DRIVER_NAME))
}

/// The cluster through kube-rs. What a prepare reads comes from watches (reflectors), so a
/// prepare makes no list:
///
/// - the ComputeDomains (all namespaces), looked up by UID in the store; one list only where
///   the watch has not listed them yet or misses the UID (a domain created a moment ago);
/// - the ComputeDomainCliques of the driver's namespace (a GET for one the store lacks: a
///   daemon's first entry, written a moment ago);
/// - the node's slices of nvdra's GPU driver (field selectors `spec.nodeName`, `spec.driver`),
///   for the node's clique;
/// - the ResourceClaims, all of them: the API server selects claims by `metadata.name` and
///   `metadata.namespace` only (no field of the allocation), so the node cannot ask for its own.
///   The store keeps only what the readiness pass reads: the spec and the managed fields are
///   dropped, and the status too for a claim with no device of this driver.
///
/// Node labels are read with a GET per use, not from a watch: a label the plugin has just
/// written must be seen by the next decision (a stale store would let two domains take the
/// node). Every call runs under [`CALL_DEADLINE`].
pub struct KubeCluster {
    client: kube::Client,
    namespace: String,
    node: String,
    domains: Followed<ComputeDomain>,
    cliques: Followed<ComputeDomainClique>,
    gpu_slices: Followed<ResourceSlice>,
    claims: Followed<ResourceClaim>,
    changed: Arc<Notify>,
    status: StatusWriter,
}

impl KubeCluster {
    /// Starts following what the plugin of `node` reads (until `stop`); `namespace` is the
    /// driver's, where the cliques are.
    pub fn start(
        client: kube::Client,
        namespace: &str,
        node: &str,
        stop: CancellationToken,
    ) -> Arc<Self> {
        let changed = Arc::new(Notify::new());
        // Served from the API server's watch cache, not a quorum read of etcd: a node's plugin
        // starting (or all of them, after a rollout) costs the cluster's store nothing.
        let cached = || watcher::Config::default().any_semantic();
        let domains = follow(
            Api::<ComputeDomain>::all(client.clone()),
            cached(),
            |d: &mut ComputeDomain| d.metadata.managed_fields = None,
            |_| false,
            changed.clone(),
            stop.clone(),
        );
        let me = node.to_string();
        let cliques = follow(
            Api::<ComputeDomainClique>::namespaced(client.clone(), namespace),
            cached(),
            |c: &mut ComputeDomainClique| c.metadata.managed_fields = None,
            // A daemon of this node changed: a binding condition or the taint may follow.
            move |c| c.daemons.iter().any(|d| d.node_name == me),
            changed.clone(),
            stop.clone(),
        );
        let gpu_slices = follow(
            Api::<ResourceSlice>::all(client.clone()),
            cached().fields(&format!("spec.nodeName={node},spec.driver={GPU_DRIVER}")),
            |s: &mut ResourceSlice| s.metadata.managed_fields = None,
            |_| false,
            changed.clone(),
            stop.clone(),
        );
        let claims = follow(
            Api::<ResourceClaim>::all(client.clone()),
            cached(),
            |c: &mut ResourceClaim| {
                c.metadata.managed_fields = None;
                c.spec = Default::default();
                if !of_driver(c) {
                    c.status = None;
                }
            },
            of_driver,
            changed.clone(),
            stop,
        );
        Arc::new(Self {
            status: StatusWriter::new(Arc::new(client.clone()), DRIVER_NAME),
            client,
            namespace: namespace.into(),
            node: node.into(),
            domains,
            cliques,
            gpu_slices,
            claims,
            changed,
        })
    }
}

impl Cluster for KubeCluster {
    fn domain<'a>(&'a self, uid: &'a str) -> BoxFuture<'a, anyhow::Result<Option<ComputeDomain>>> {
        Box::pin(async move {
            let by_uid = |d: &ComputeDomain| d.metadata.uid.as_deref() == Some(uid);
            match self.domains.ready() {
                Some(store) => {
                    if let Some(d) = store.find(by_uid) {
                        return Ok(Some((*d).clone()));
                    }
                    tracing::info!(
                        domain = uid,
                        "computedomain not in the watch's store (created a moment ago?): \
                         listing computedomains once"
                    );
                }
                None => tracing::info!(
                    domain = uid,
                    "computedomains not listed by the watch yet: listing them once"
                ),
            }
            let api = Api::<ComputeDomain>::all(self.client.clone());
            let list = within("list computedomains", api.list(&ListParams::default()))
                .await?
                .context(
                    "cannot list computedomains (are nvdra's CRDs installed and its RBAC granted?)",
                )?;
            Ok(list.items.into_iter().find(by_uid))
        })
    }

    fn clique<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, anyhow::Result<Option<ComputeDomainClique>>> {
        Box::pin(async move {
            // Not in the store: not listed yet, or created a moment ago (a daemon's first entry),
            // so asked for once.
            if namespace == self.namespace
                && let Some(store) = self.cliques.ready()
                && let Some(c) = store.get(&ObjectRef::new(name).within(namespace))
            {
                return Ok(Some((*c).clone()));
            }
            let api = Api::<ComputeDomainClique>::namespaced(self.client.clone(), namespace);
            let what = format!("get computedomainclique {namespace}/{name}");
            within(&what, api.get_opt(name))
                .await?
                .with_context(|| format!("cannot {what}"))
        })
    }

    fn node_labels<'a>(
        &'a self,
        node: &'a str,
    ) -> BoxFuture<'a, anyhow::Result<BTreeMap<String, String>>> {
        Box::pin(async move {
            let api = Api::<Node>::all(self.client.clone());
            let what = format!("get node {node}");
            let n = within(&what, api.get(node))
                .await?
                .with_context(|| format!("cannot {what}"))?;
            Ok(n.metadata.labels.unwrap_or_default())
        })
    }

    fn set_node_label<'a>(
        &'a self,
        node: &'a str,
        key: &'a str,
        value: Option<&'a str>,
    ) -> BoxFuture<'a, anyhow::Result<()>> {
        Box::pin(async move {
            let patch = serde_json::json!({"metadata": {"labels": {key: value}}});
            let api = Api::<Node>::all(self.client.clone());
            let what = format!("set label {key} of node {node}");
            within(
                &what,
                api.patch(node, &PatchParams::default(), &Patch::Merge(&patch)),
            )
            .await?
            .with_context(|| format!("cannot {what}"))?;
            Ok(())
        })
    }

    fn gpu_clique<'a>(&'a self, node: &'a str) -> BoxFuture<'a, anyhow::Result<Option<String>>> {
        Box::pin(async move {
            if node == self.node
                && let Some(store) = self.gpu_slices.ready()
            {
                return Ok(clique_of(store.state().iter().map(|s| &**s)));
            }
            let fields = format!("spec.nodeName={node},spec.driver={GPU_DRIVER}");
            let api = Api::<ResourceSlice>::all(self.client.clone());
            let what = format!("list the resourceslices of {GPU_DRIVER} on {node}");
            let slices = within(&what, api.list(&ListParams::default().fields(&fields)))
                .await?
                .with_context(|| format!("cannot {what}"))?;
            Ok(clique_of(&slices.items))
        })
    }

    fn claims(&self) -> Option<Vec<ResourceClaim>> {
        let store = self.claims.ready()?;
        Some(store.state().iter().map(|c| (**c).clone()).collect())
    }

    fn set_device_status<'a>(
        &'a self,
        claim: &'a Claim,
        entries: Vec<AllocatedDeviceStatus>,
    ) -> BoxFuture<'a, anyhow::Result<()>> {
        // The library's writer runs the apply under its own deadline (`status::WRITE_DEADLINE`).
        Box::pin(async move {
            self.status.apply(claim, entries).await.with_context(|| {
                format!(
                    "cannot write the status of resourceclaim {}/{}",
                    claim.namespace, claim.name
                )
            })?;
            Ok(())
        })
    }

    fn changed(&self) -> BoxFuture<'_, ()> {
        Box::pin(self.changed.notified())
    }
}

#[cfg(test)]
pub use memory::MemoryCluster;

#[cfg(test)]
mod memory {
    use std::sync::Mutex;

    use kubelet_plugin::lock::lock;

    use super::*;

    /// The cluster in memory, for tests: what a test puts in is what the plugin sees.
    #[derive(Clone, Default)]
    pub struct MemoryCluster {
        inner: Arc<Mutex<Memory>>,
        changed: Arc<Notify>,
    }

    #[derive(Default)]
    struct Memory {
        domains: Vec<ComputeDomain>,
        cliques: BTreeMap<(String, String), ComputeDomainClique>,
        labels: BTreeMap<String, BTreeMap<String, String>>,
        claims: Vec<ResourceClaim>,
        status: BTreeMap<(String, String), Vec<AllocatedDeviceStatus>>,
        label_writes: u64,
        gpu_clique: Option<String>,
    }

    impl MemoryCluster {
        /// Adds (or replaces, by UID) a ComputeDomain.
        pub fn put_domain(&self, d: ComputeDomain) {
            let mut m = lock(&self.inner);
            m.domains.retain(|x| x.metadata.uid != d.metadata.uid);
            m.domains.push(d);
        }

        /// Adds or replaces a ComputeDomainClique.
        pub fn put_clique(&self, c: ComputeDomainClique) {
            let key = (
                c.metadata.namespace.clone().unwrap_or_default(),
                c.metadata.name.clone().unwrap_or_default(),
            );
            lock(&self.inner).cliques.insert(key, c);
        }

        /// Adds or replaces (by namespace and name) a claim, and tells the plugin.
        pub fn put_claim(&self, c: ResourceClaim) {
            {
                let mut m = lock(&self.inner);
                m.claims.retain(|x| {
                    (&x.metadata.namespace, &x.metadata.name)
                        != (&c.metadata.namespace, &c.metadata.name)
                });
                m.claims.push(c);
            }
            self.changed.notify_waiters();
        }

        /// Removes a claim, and tells the plugin.
        pub fn remove_claim(&self, namespace: &str, name: &str) {
            lock(&self.inner).claims.retain(|x| {
                (x.metadata.namespace.as_deref(), x.metadata.name.as_deref())
                    != (Some(namespace), Some(name))
            });
            self.changed.notify_waiters();
        }

        /// A node's labels.
        pub fn labels(&self, node: &str) -> BTreeMap<String, String> {
            lock(&self.inner)
                .labels
                .get(node)
                .cloned()
                .unwrap_or_default()
        }

        /// Sets a node label, as someone else would.
        pub fn put_label(&self, node: &str, key: &str, value: &str) {
            lock(&self.inner)
                .labels
                .entry(node.into())
                .or_default()
                .insert(key.into(), value.into());
        }

        /// How many label writes the plugin made.
        pub fn label_writes(&self) -> u64 {
            lock(&self.inner).label_writes
        }

        /// The driver's entries in a claim's `status.devices`, as last written.
        pub fn device_status(&self, namespace: &str, name: &str) -> Vec<AllocatedDeviceStatus> {
            lock(&self.inner)
                .status
                .get(&(namespace.to_string(), name.to_string()))
                .cloned()
                .unwrap_or_default()
        }
    }

    impl Cluster for MemoryCluster {
        fn domain<'a>(
            &'a self,
            uid: &'a str,
        ) -> BoxFuture<'a, anyhow::Result<Option<ComputeDomain>>> {
            let found = lock(&self.inner)
                .domains
                .iter()
                .find(|d| d.metadata.uid.as_deref() == Some(uid))
                .cloned();
            Box::pin(async move { Ok(found) })
        }

        fn clique<'a>(
            &'a self,
            namespace: &'a str,
            name: &'a str,
        ) -> BoxFuture<'a, anyhow::Result<Option<ComputeDomainClique>>> {
            let found = lock(&self.inner)
                .cliques
                .get(&(namespace.to_string(), name.to_string()))
                .cloned();
            Box::pin(async move { Ok(found) })
        }

        fn node_labels<'a>(
            &'a self,
            node: &'a str,
        ) -> BoxFuture<'a, anyhow::Result<BTreeMap<String, String>>> {
            let labels = self.labels(node);
            Box::pin(async move { Ok(labels) })
        }

        fn set_node_label<'a>(
            &'a self,
            node: &'a str,
            key: &'a str,
            value: Option<&'a str>,
        ) -> BoxFuture<'a, anyhow::Result<()>> {
            {
                let mut m = lock(&self.inner);
                m.label_writes += 1;
                let labels = m.labels.entry(node.into()).or_default();
                match value {
                    Some(v) => labels.insert(key.into(), v.into()),
                    None => labels.remove(key),
                };
            }
            Box::pin(async { Ok(()) })
        }

        fn gpu_clique<'a>(
            &'a self,
            _node: &'a str,
        ) -> BoxFuture<'a, anyhow::Result<Option<String>>> {
            let c = lock(&self.inner).gpu_clique.clone();
            Box::pin(async move { Ok(c) })
        }

        fn claims(&self) -> Option<Vec<ResourceClaim>> {
            Some(lock(&self.inner).claims.clone())
        }

        fn set_device_status<'a>(
            &'a self,
            claim: &'a Claim,
            entries: Vec<AllocatedDeviceStatus>,
        ) -> BoxFuture<'a, anyhow::Result<()>> {
            lock(&self.inner)
                .status
                .insert((claim.namespace.clone(), claim.name.clone()), entries);
            Box::pin(async { Ok(()) })
        }

        fn changed(&self) -> BoxFuture<'_, ()> {
            Box::pin(self.changed.notified())
        }
    }
}
