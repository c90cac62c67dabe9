//! What the plugin reads and writes in the cluster besides slices and claims' reads (which are
//! the library's): ComputeDomains (by UID), its node's entries in ComputeDomainCliques, its Node's
//! labels, the claims allocated on its node, and their device conditions. One trait, so the
//! plugin's logic runs against [`MemoryCluster`] in tests and [`KubeCluster`] in a cluster.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::Context;
use futures::StreamExt;
use futures::future::BoxFuture;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::{AllocatedDeviceStatus, ResourceClaim, ResourceSlice};
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::runtime::WatchStreamExt;
use kube::runtime::reflector::{self, Store};
use kube::runtime::watcher;
use kubelet_plugin::Claim;
use kubelet_plugin::lock::lock;
use kubelet_plugin::status::StatusWriter;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::computedomain::api::{ComputeDomain, ComputeDomainClique};
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
pub fn clique_of(slices: &[ResourceSlice]) -> Option<String> {
    let mut found = std::collections::BTreeSet::new();
    for d in slices.iter().flat_map(|s| s.spec.devices.iter().flatten()) {
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

/// The cluster through kube-rs: claims from a watch (a reflector), everything else one request
/// per call.
pub struct KubeCluster {
    client: kube::Client,
    claims: Store<ResourceClaim>,
    synced: Arc<AtomicBool>,
    changed: Arc<Notify>,
    status: StatusWriter,
}

impl KubeCluster {
    /// Starts following ResourceClaims (until `stop`) and returns the cluster.
    pub fn start(client: kube::Client, driver: &str, stop: CancellationToken) -> Arc<Self> {
        let (claims, writer) = reflector::store();
        let changed = Arc::new(Notify::new());
        let api = Api::<ResourceClaim>::all(client.clone());
        let events = reflector::reflector(
            writer,
            watcher(api, watcher::Config::default()).default_backoff(),
        )
        .touched_objects();
        let synced = Arc::new(AtomicBool::new(false));
        let (ready, store) = (synced.clone(), claims.clone());
        tokio::spawn(async move {
            if store.wait_until_ready().await.is_ok() {
                ready.store(true, Ordering::Relaxed);
            }
        });
        let notify = changed.clone();
        tokio::spawn(async move {
            let mut events = std::pin::pin!(events);
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    next = events.next() => match next {
                        Some(Ok(_)) => notify.notify_waiters(),
                        Some(Err(e)) => tracing::warn!(error = %e, "watching resourceclaims failed; retrying"),
                        None => return,
                    },
                }
            }
        });
        Arc::new(Self {
            status: StatusWriter::new(Arc::new(client.clone()), driver),
            client,
            claims,
            synced,
            changed,
        })
    }
}

impl Cluster for KubeCluster {
    fn domain<'a>(&'a self, uid: &'a str) -> BoxFuture<'a, anyhow::Result<Option<ComputeDomain>>> {
        Box::pin(async move {
            let api = Api::<ComputeDomain>::all(self.client.clone());
            let list = api.list(&ListParams::default()).await.context(
                "cannot list computedomains (are nvdra's CRDs installed and its RBAC granted?)",
            )?;
            Ok(list
                .items
                .into_iter()
                .find(|d| d.metadata.uid.as_deref() == Some(uid)))
        })
    }

    fn clique<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, anyhow::Result<Option<ComputeDomainClique>>> {
        Box::pin(async move {
            let api = Api::<ComputeDomainClique>::namespaced(self.client.clone(), namespace);
            api.get_opt(name)
                .await
                .with_context(|| format!("cannot read computedomainclique {namespace}/{name}"))
        })
    }

    fn node_labels<'a>(
        &'a self,
        node: &'a str,
    ) -> BoxFuture<'a, anyhow::Result<BTreeMap<String, String>>> {
        Box::pin(async move {
            let n = Api::<Node>::all(self.client.clone())
                .get(node)
                .await
                .with_context(|| format!("cannot read node {node}"))?;
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
            Api::<Node>::all(self.client.clone())
                .patch(node, &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .with_context(|| format!("cannot set label {key} of node {node}"))?;
            Ok(())
        })
    }

    fn gpu_clique<'a>(&'a self, node: &'a str) -> BoxFuture<'a, anyhow::Result<Option<String>>> {
        Box::pin(async move {
            let fields = format!("spec.nodeName={node},spec.driver={GPU_DRIVER}");
            let slices = Api::<ResourceSlice>::all(self.client.clone())
                .list(&ListParams::default().fields(&fields))
                .await
                .with_context(|| {
                    format!("cannot list the resourceslices of {GPU_DRIVER} on {node}")
                })?;
            Ok(clique_of(&slices.items))
        })
    }

    fn claims(&self) -> Option<Vec<ResourceClaim>> {
        self.synced
            .load(Ordering::Relaxed)
            .then(|| self.claims.state().iter().map(|c| (**c).clone()).collect())
    }

    fn set_device_status<'a>(
        &'a self,
        claim: &'a Claim,
        entries: Vec<AllocatedDeviceStatus>,
    ) -> BoxFuture<'a, anyhow::Result<()>> {
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
    fn domain<'a>(&'a self, uid: &'a str) -> BoxFuture<'a, anyhow::Result<Option<ComputeDomain>>> {
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

    fn gpu_clique<'a>(&'a self, _node: &'a str) -> BoxFuture<'a, anyhow::Result<Option<String>>> {
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
