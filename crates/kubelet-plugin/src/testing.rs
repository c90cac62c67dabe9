//! What a driver's tests need instead of a cluster and a kubelet (feature `testing`): claims
//! and ResourceSlices in memory ([`MemoryClaims`], [`MemorySlices`]), claims as the scheduler
//! leaves them ([`allocated_claim`]), a client that calls a plugin's DRA socket as the
//! kubelet does ([`KubeletClient`]), and a small Kubernetes API server over HTTP
//! ([`ApiServer`]) for end-to-end tests through `kube::Client`.
//!
//! ```
//! use kubelet_plugin::testing::{MemoryClaims, allocated_claim, allocated_device};
//!
//! let claims = MemoryClaims::default();
//! claims.insert(allocated_claim(
//!     "default",
//!     "my-claim",
//!     "0f2d5a3c-1234-4bcd-9876-0123456789ab",
//!     vec![allocated_device("fpga", "fpga.example.com", "node-a", "fpga-0")],
//! ));
//! let opts = kubelet_plugin::Options::new("fpga.example.com", "node-a", claims.clone())?;
//! # Ok::<(), kubelet_plugin::InvalidName>(())
//! ```

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use futures::StreamExt;
use futures::future::BoxFuture;
use futures::stream::BoxStream;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::{
    AllocationResult, DeviceAllocationResult, DeviceRequestAllocationResult, ResourceClaim,
    ResourceClaimStatus, ResourceSlice,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use tokio::sync::broadcast;

use crate::api::{self, SliceApi, SliceEvent};
use crate::claims::ClaimSource;
use crate::driver::Claim;
use crate::lock::lock;
use crate::proto::dra::v1;

mod apiserver;

pub use apiserver::{ApiCounts, ApiServer, RecordedRequest};

/// ResourceClaims in memory, by namespace and name; clones share them.
#[derive(Clone, Debug, Default)]
pub struct MemoryClaims(Arc<Mutex<BTreeMap<(String, String), ResourceClaim>>>);

impl MemoryClaims {
    /// Stores `claim` under its namespace and name, replacing one of the same name.
    pub fn insert(&self, claim: ResourceClaim) {
        let key = (
            claim.metadata.namespace.clone().unwrap_or_default(),
            claim.metadata.name.clone().unwrap_or_default(),
        );
        lock(&self.0).insert(key, claim);
    }

    /// Removes a claim; whether there was one.
    pub fn remove(&self, namespace: &str, name: &str) -> bool {
        lock(&self.0)
            .remove(&(namespace.to_string(), name.to_string()))
            .is_some()
    }
}

impl ClaimSource for MemoryClaims {
    fn get_claim<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, api::Result<ResourceClaim>> {
        let found = lock(&self.0)
            .get(&(namespace.to_string(), name.to_string()))
            .cloned();
        Box::pin(async move {
            found.ok_or_else(|| {
                api::Error::NotFound(format!("resourceclaim {namespace}/{name}").into())
            })
        })
    }
}

/// A ResourceClaim as the scheduler leaves it: allocated `results`.
pub fn allocated_claim(
    namespace: &str,
    name: &str,
    uid: &str,
    results: Vec<DeviceRequestAllocationResult>,
) -> ResourceClaim {
    ResourceClaim {
        metadata: ObjectMeta {
            namespace: Some(namespace.into()),
            name: Some(name.into()),
            uid: Some(uid.into()),
            ..Default::default()
        },
        status: Some(ResourceClaimStatus {
            allocation: Some(AllocationResult {
                devices: Some(DeviceAllocationResult {
                    results: Some(results),
                    config: None,
                }),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// One device of an allocation: `request` got `device` of `driver`'s `pool`.
pub fn allocated_device(
    request: &str,
    driver: &str,
    pool: &str,
    device: &str,
) -> DeviceRequestAllocationResult {
    DeviceRequestAllocationResult {
        request: request.into(),
        driver: driver.into(),
        pool: pool.into(),
        device: device.into(),
        ..Default::default()
    }
}

#[derive(Debug, Default)]
struct Slices {
    by_name: BTreeMap<String, ResourceSlice>,
    version: u64,
    nodes: BTreeMap<String, Node>,
}

/// ResourceSlices (and Nodes) in memory, as an API server keeps them where the publisher looks:
/// `generateName` and `resourceVersion` honoured (a stale replace is a `Conflict`), every change
/// seen by watches. Clones share the store.
#[derive(Clone, Debug)]
pub struct MemorySlices {
    store: Arc<Mutex<Slices>>,
    events: broadcast::Sender<SliceEvent>,
}

impl Default for MemorySlices {
    fn default() -> Self {
        Self {
            store: Arc::default(),
            events: broadcast::channel(256).0,
        }
    }
}

impl MemorySlices {
    /// The stored slices, by name.
    pub fn slices(&self) -> Vec<ResourceSlice> {
        lock(&self.store).by_name.values().cloned().collect()
    }

    /// Stores a Node, for the owner reference of published slices.
    pub fn insert_node(&self, node: Node) {
        let name = node.metadata.name.clone().unwrap_or_default();
        lock(&self.store).nodes.insert(name, node);
    }

    fn stored(&self, mut slice: ResourceSlice, s: &mut Slices) -> ResourceSlice {
        s.version += 1;
        slice.metadata.resource_version = Some(s.version.to_string());
        let name = slice.metadata.name.clone().unwrap_or_default();
        s.by_name.insert(name.clone(), slice.clone());
        let _ = self.events.send(SliceEvent::Applied(name));
        slice
    }
}

impl SliceApi for MemorySlices {
    fn list_slices<'a>(
        &'a self,
        driver: &'a str,
        node: &'a str,
    ) -> BoxFuture<'a, api::Result<Vec<ResourceSlice>>> {
        let found = lock(&self.store)
            .by_name
            .values()
            .filter(|s| {
                s.spec.driver == driver && s.spec.node_name.as_deref().unwrap_or("") == node
            })
            .cloned()
            .collect();
        Box::pin(async move { Ok(found) })
    }

    fn create_slice<'a>(
        &'a self,
        slice: &'a ResourceSlice,
    ) -> BoxFuture<'a, api::Result<ResourceSlice>> {
        let mut s = lock(&self.store);
        let mut slice = slice.clone();
        if slice.metadata.name.is_none() {
            let Some(prefix) = slice.metadata.generate_name.clone() else {
                return Box::pin(async {
                    Err(api::Error::Invalid(
                        "create resourceslice: neither metadata.name nor generateName".into(),
                    ))
                });
            };
            slice.metadata.name = Some(format!("{prefix}{}", s.version + 1));
        }
        let name = slice.metadata.name.clone().unwrap_or_default();
        let result = if s.by_name.contains_key(&name) {
            Err(api::Error::Conflict(
                format!("create resourceslice {name}: it exists").into(),
            ))
        } else {
            Ok(self.stored(slice, &mut s))
        };
        Box::pin(async move { result })
    }

    fn replace_slice<'a>(
        &'a self,
        slice: &'a ResourceSlice,
    ) -> BoxFuture<'a, api::Result<ResourceSlice>> {
        let mut s = lock(&self.store);
        let name = slice.metadata.name.clone().unwrap_or_default();
        let result = match s.by_name.get(&name) {
            None => Err(api::Error::NotFound(
                format!("replace resourceslice {name}").into(),
            )),
            Some(have) if have.metadata.resource_version != slice.metadata.resource_version => {
                Err(api::Error::Conflict(
                    format!("replace resourceslice {name}: resourceVersion is stale").into(),
                ))
            }
            Some(_) => Ok(self.stored(slice.clone(), &mut s)),
        };
        Box::pin(async move { result })
    }

    fn delete_slice<'a>(
        &'a self,
        name: &'a str,
        pre: &'a k8s_openapi::apimachinery::pkg::apis::meta::v1::Preconditions,
    ) -> BoxFuture<'a, api::Result<()>> {
        let mut s = lock(&self.store);
        let stale = s.by_name.get(name).is_some_and(|have| {
            let differs = |want: &Option<String>, have: &Option<String>| {
                want.as_ref().is_some_and(|w| Some(w) != have.as_ref())
            };
            differs(&pre.uid, &have.metadata.uid)
                || differs(&pre.resource_version, &have.metadata.resource_version)
        });
        if stale {
            return Box::pin(async move {
                Err(api::Error::Conflict(
                    format!("delete resourceslice {name}: the preconditions do not hold").into(),
                ))
            });
        }
        let removed = s.by_name.remove(name).is_some();
        drop(s);
        let result = if removed {
            let _ = self.events.send(SliceEvent::Deleted(name.to_string()));
            Ok(())
        } else {
            Err(api::Error::NotFound(
                format!("delete resourceslice {name}").into(),
            ))
        };
        Box::pin(async move { result })
    }

    fn watch_slices<'a>(
        &'a self,
        _driver: &'a str,
        _node: &'a str,
    ) -> BoxStream<'a, api::Result<SliceEvent>> {
        use tokio_stream::wrappers::BroadcastStream;
        let events = BroadcastStream::new(self.events.subscribe()).map(|e| {
            // A watcher that fell behind missed events: it re-reads everything.
            Ok(e.unwrap_or(SliceEvent::Restarted))
        });
        futures::stream::once(async { Ok(SliceEvent::Restarted) })
            .chain(events)
            .boxed()
    }

    fn get_node<'a>(&'a self, name: &'a str) -> BoxFuture<'a, api::Result<Node>> {
        let found = lock(&self.store).nodes.get(name).cloned();
        Box::pin(async move {
            found.ok_or_else(|| api::Error::NotFound(format!("get node {name}").into()))
        })
    }
}

/// Calls a plugin's DRA socket (`v1.DRAPlugin`) as the kubelet does.
#[derive(Clone, Debug)]
pub struct KubeletClient {
    client: v1::dra_plugin_client::DraPluginClient<tonic::transport::Channel>,
    deadline: Option<std::time::Duration>,
}

/// Each claim's answer by UID: its devices' CDI IDs, or its error.
pub type Answers = BTreeMap<String, Result<Vec<String>, String>>;

impl KubeletClient {
    /// Connects to the DRA socket at `path`.
    pub async fn connect(path: &Path) -> Result<Self, tonic::transport::Error> {
        let channel = crate::socket::connect(path).await?;
        Ok(Self {
            client: v1::dra_plugin_client::DraPluginClient::new(channel),
            deadline: None,
        })
    }

    /// Sends each call with a deadline (`grpc-timeout`), as the kubelet does: when it passes,
    /// the call fails with `DEADLINE_EXCEEDED` and the plugin's server drops it.
    pub fn with_deadline(mut self, deadline: std::time::Duration) -> Self {
        self.deadline = Some(deadline);
        self
    }

    fn request<T>(&self, message: T) -> tonic::Request<T> {
        let mut request = tonic::Request::new(message);
        if let Some(deadline) = self.deadline {
            request.set_timeout(deadline);
        }
        request
    }

    fn wire(claims: &[Claim]) -> Vec<v1::Claim> {
        claims
            .iter()
            .map(|c| v1::Claim {
                namespace: c.namespace.clone(),
                uid: c.uid.clone(),
                name: c.name.clone(),
            })
            .collect()
    }

    /// `NodePrepareResources` for `claims`: the whole response.
    pub async fn prepare_raw(
        &mut self,
        claims: &[Claim],
    ) -> Result<v1::NodePrepareResourcesResponse, tonic::Status> {
        let claims = Self::wire(claims);
        let request = self.request(v1::NodePrepareResourcesRequest { claims });
        let r = self.client.node_prepare_resources(request).await?;
        Ok(r.into_inner())
    }

    /// `NodePrepareResources` for `claims`: each claim's CDI device IDs, or its error.
    pub async fn prepare(&mut self, claims: &[Claim]) -> Result<Answers, tonic::Status> {
        let r = self.prepare_raw(claims).await?;
        Ok(r.claims
            .into_iter()
            .map(|(uid, c)| {
                let answer = if c.error.is_empty() {
                    Ok(c.devices
                        .into_iter()
                        .flat_map(|d| d.cdi_device_ids)
                        .collect())
                } else {
                    Err(c.error)
                };
                (uid, answer)
            })
            .collect())
    }

    /// `NodeUnprepareResources` for `claims`: each claim's error, if any.
    pub async fn unprepare(
        &mut self,
        claims: &[Claim],
    ) -> Result<BTreeMap<String, Result<(), String>>, tonic::Status> {
        let claims = Self::wire(claims);
        let request = self.request(v1::NodeUnprepareResourcesRequest { claims });
        let r = self.client.node_unprepare_resources(request).await?;
        Ok(r.into_inner()
            .claims
            .into_iter()
            .map(|(uid, c)| {
                (
                    uid,
                    if c.error.is_empty() {
                        Ok(())
                    } else {
                        Err(c.error)
                    },
                )
            })
            .collect())
    }
}
