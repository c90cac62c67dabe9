//! A small Kubernetes API server for tests ([`ApiServer`]): ResourceSlices, Nodes,
//! ResourceClaims and DeviceClasses over HTTP/1 on 127.0.0.1, behaving like the real one where a
//! DRA driver's node side depends on it.
//!
//! Like the real server: cluster-scoped ResourceSlices at `/apis/resource.k8s.io/v1/resourceslices`
//! with `fieldSelector` (`spec.driver`, `spec.nodeName`, `metadata.name`) and `labelSelector`;
//! watches from a resourceVersion as chunked JSON lines (replaying history; an `ERROR` event with
//! a 410 `Status` when the version was compacted away); `generateName`; optimistic concurrency
//! (409 on a stale resourceVersion); no-op updates that store nothing; monotonically increasing
//! resourceVersions; validation of the `resource.k8s.io/v1` limits (422 `Invalid`); every error a
//! `Status` body. For tests: a count of write requests, external edits that bypass the counters,
//! fault injection (the next N requests fail with 500, the next update fails with 409), and dropped
//! fields (as when a feature gate is off). DeviceClasses (list, and a watch of changes from its
//! start), API discovery of `resource.k8s.io/v1` (absent on request), `/version`, JSON merge
//! patches of a Node's labels, and server-side apply of a ResourceClaim's `status.devices` (per
//! field manager; deallocation drops the entries; the field dropped on request).
//!
//! Every other resource a controller, daemon or plugin needs (Pods, Nodes, Namespaces, Events,
//! ConfigMaps, Secrets, ServiceAccounts, DaemonSets, Deployments, Leases, ResourceClaims,
//! ResourceClaimTemplates, ComputeDomains, ComputeDomainCliques) is a generic JSON object with
//! every verb, watches, finalizers, owner cascade and the `status` subresource: see `objects.rs`.

use futures::StreamExt;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Bytes, Frame, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::{
    AllocatedDeviceStatus, DeviceClass, ResourceClaim, ResourceSlice,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use serde_json::{Value, json};
use std::collections::{BTreeMap, BTreeSet};
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

mod objects;
#[cfg(test)]
mod tests;

/// The typed code's resources, for API discovery: (apiVersion, plural, kind, namespaced).
const TYPED: &[(&str, &str, &str, bool)] = &[
    ("resource.k8s.io/v1", "deviceclasses", "DeviceClass", false),
    (
        "resource.k8s.io/v1",
        "resourceslices",
        "ResourceSlice",
        false,
    ),
];

const NAME_ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";

type Body = BoxBody<Bytes, Infallible>;

/// HTTP-level counts of an [`ApiServer`] (external edits through the handle are not counted).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ApiCounts {
    /// Requests of any kind, faults injected included.
    pub requests: u64,
    /// Lists (ResourceSlices and DeviceClasses).
    pub lists: u64,
    /// Watches (ResourceSlices and DeviceClasses).
    pub watches: u64,
    /// Successful creates.
    pub creates: u64,
    /// Update requests that were accepted (no-op updates included: they are churn too).
    pub updates: u64,
    /// Successful deletes.
    pub deletes: u64,
    /// Write requests of any outcome (create, update, delete).
    pub write_requests: u64,
    /// Requests of any resource answered 409 Conflict (a stale resourceVersion, an object that
    /// already exists, a failed precondition).
    pub conflicts: u64,
}

/// One HTTP request as the server received it, for tests that check what a client asks
/// (e.g. the RBAC rules it needs).
///
/// Tests build these to compare with (the three parts of a request line are all there is to
/// one), so the struct is not `#[non_exhaustive]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecordedRequest {
    /// The HTTP method (`GET`, `POST`, ...).
    pub method: String,
    /// The path, without the query.
    pub path: String,
    /// The raw query string, without the `?` (empty when there is none).
    pub query: String,
}

impl ApiCounts {
    /// Accepted writes.
    pub fn writes(&self) -> u64 {
        self.creates + self.updates + self.deletes
    }
}

struct Watcher {
    selector: Selector,
    tx: mpsc::UnboundedSender<Bytes>,
}

#[derive(Default)]
struct State {
    slices: BTreeMap<String, ResourceSlice>,
    /// Every other resource, Nodes and ResourceClaims included (objects.rs).
    objects: objects::Objects,
    rv: u64,
    /// (resourceVersion, event type, object) of every slice change since `compacted`.
    history: Vec<(u64, &'static str, ResourceSlice)>,
    /// Watches from below this resourceVersion get 410 Gone.
    compacted: u64,
    watchers: Vec<Watcher>,
    fail_next: u32,
    conflict_next_update: bool,
    dropped_fields: Vec<String>,
    counts: ApiCounts,
    /// Every request received, in order (faults injected included).
    requests: Vec<RecordedRequest>,
    /// What `/version` reports as the minor version.
    server_minor: u32,
    /// And as the patch release (in `gitVersion`).
    server_patch: u32,
    /// DeviceClasses (list and watch; the watch streams changes from its start, no history).
    device_classes: BTreeMap<String, DeviceClass>,
    class_watchers: Vec<mpsc::UnboundedSender<Bytes>>,
    /// API discovery answers 404 for `resource.k8s.io/v1`, as a server without DRA does.
    dra_absent: bool,
    /// Accepted merge patches of Nodes.
    node_patches: u64,
    /// Who applied which of each claim's `status.devices` entries: per claim, per field manager.
    claim_status_owners: BTreeMap<(String, String), BTreeMap<String, BTreeSet<DeviceKey>>>,
    /// `status.devices` is dropped on write, as by a server without the field.
    claim_status_dropped: bool,
}

/// A `status.devices` entry's key: driver, pool, device, share ID.
type DeviceKey = (String, String, String, Option<String>);

fn device_key(d: &AllocatedDeviceStatus) -> DeviceKey {
    (
        d.driver.clone(),
        d.pool.clone(),
        d.device.clone(),
        d.share_id.clone(),
    )
}

impl State {
    fn next_rv(&mut self) -> u64 {
        self.rv += 1;
        self.rv
    }

    /// Records a change: history, watchers.
    fn emit(&mut self, kind: &'static str, obj: &ResourceSlice) {
        let rv = self.rv;
        self.history.push((rv, kind, obj.clone()));
        let line = event_line(kind, obj);
        self.watchers
            .retain(|w| !w.selector.matches(obj) || w.tx.send(line.clone()).is_ok());
    }
}

fn class_event(kind: &str, obj: &DeviceClass) -> Bytes {
    let mut line = serde_json::to_vec(&json!({ "type": kind, "object": obj }))
        .expect("a DeviceClass serialises");
    line.push(b'\n');
    Bytes::from(line)
}

fn event_line(kind: &str, obj: &ResourceSlice) -> Bytes {
    let mut line = serde_json::to_vec(&json!({ "type": kind, "object": obj }))
        .expect("a ResourceSlice serialises");
    line.push(b'\n');
    Bytes::from(line)
}

/// A Kubernetes API server in the test's process, over HTTP/1 on 127.0.0.1; it stops when
/// dropped.
///
/// Like the real server: cluster-scoped ResourceSlices at `/apis/resource.k8s.io/v1/resourceslices`
/// with `fieldSelector` (`spec.driver`, `spec.nodeName`, `metadata.name`) and `labelSelector`;
/// watches from a resourceVersion as chunked JSON lines (replaying history; an `ERROR` event with
/// a 410 `Status` when the version was compacted away); `generateName`; optimistic concurrency
/// (409 on a stale resourceVersion); no-op updates that store nothing; monotonically increasing
/// resourceVersions; the [`crate::validate`] rules the server shares, as 422 `Invalid`; every
/// error a `Status` body. Nodes and ResourceClaims to GET (stored with [`ApiServer::seed_node`]
/// and [`ApiServer::seed_claim`]), JSON merge patches of a Node's labels, server-side apply of a
/// claim's `status.devices` ([`ApiServer::claim`], [`ApiServer::deallocate_claim`],
/// [`ApiServer::drop_claim_device_status`]), DeviceClasses (list, and a watch of changes from its
/// start), API discovery of `resource.k8s.io/v1` and `/version`.
///
/// For tests: counts of requests ([`ApiServer::counts`]) and the requests themselves, external
/// edits that bypass the counters ([`ApiServer::insert_slice`], [`ApiServer::edit_slice`],
/// [`ApiServer::delete_slice`]), fault injection ([`ApiServer::fail_next`],
/// [`ApiServer::conflict_next_update`]), fields dropped as when a feature gate is off
/// ([`ApiServer::drop_field`]), compaction and closed watches.
///
/// ```
/// use kubelet_plugin::testing::ApiServer;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let server = ApiServer::start().await;
/// server.seed_node("node-a", "0b6f3c2e-node-a");
/// let client = server.client()?;
/// let node = kubelet_plugin::api::SliceApi::get_node(&client, "node-a").await?;
/// assert_eq!(node.metadata.uid.as_deref(), Some("0b6f3c2e-node-a"));
/// # Ok(())
/// # }
/// ```
pub struct ApiServer {
    url: String,
    state: Arc<Mutex<State>>,
    changed: Arc<watch::Sender<u64>>,
    shutdown: CancellationToken,
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

impl ApiServer {
    /// Binds 127.0.0.1:0 and serves on the current runtime.
    pub async fn start() -> Self {
        Self::start_on("127.0.0.1:0".parse().expect("an address")).await
    }

    /// Serves on `addr`, e.g. the address of a server that was stopped (to test an API server
    /// coming back); retries the bind for a while, as the old listener may still be closing.
    pub async fn start_on(addr: std::net::SocketAddr) -> Self {
        let mut tries = 0;
        let listener = loop {
            match tokio::net::TcpListener::bind(addr).await {
                Ok(l) => break l,
                Err(e) if tries < 100 => {
                    tries += 1;
                    let _ = e;
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(e) => panic!("bind {addr}: {e}"),
            }
        };
        let url = format!("http://{}", listener.local_addr().expect("local addr"));
        let state = Arc::new(Mutex::new(State {
            server_minor: 35,
            ..State::default()
        }));
        let changed = Arc::new(watch::channel(0).0);
        let shutdown = CancellationToken::new();
        let server = Server {
            state: state.clone(),
            changed: changed.clone(),
        };
        let token = shutdown.clone();
        tokio::spawn(async move {
            loop {
                let stream = tokio::select! {
                    _ = token.cancelled() => return,
                    accepted = listener.accept() => match accepted {
                        Ok((stream, _)) => stream,
                        Err(_) => continue,
                    },
                };
                let server = server.clone();
                let token = token.clone();
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |req| {
                        let server = server.clone();
                        async move { Ok::<_, Infallible>(server.handle(req).await) }
                    });
                    let conn = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service);
                    tokio::select! {
                        _ = token.cancelled() => {}
                        _ = conn => {}
                    }
                });
            }
        });
        ApiServer {
            url,
            state,
            changed,
            shutdown,
        }
    }

    /// A `kube::Client` that talks plain HTTP to this server (`SliceApi` and `ClaimSource` are
    /// implemented for it).
    #[cfg(feature = "kube")]
    pub fn client(&self) -> Result<kube::Client, kube::Error> {
        let uri: http::Uri = self.url.parse().expect("the url is a valid URI");
        kube::Client::try_from(kube::Config::new(uri))
    }

    /// `http://127.0.0.1:<port>`.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// A kubeconfig that points a client (kubectl, or a program under test started with
    /// `--kubeconfig`) at this server over plain HTTP, with no credentials.
    pub fn kubeconfig(&self) -> String {
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: t\n  cluster: {{server: \"{}\"}}\n\
             contexts:\n- name: t\n  context: {{cluster: t, user: t}}\ncurrent-context: t\n\
             users:\n- name: t\n  user: {{}}\n",
            self.url
        )
    }

    /// The address it listens on (to start another one there with [`ApiServer::start_on`]).
    pub fn addr(&self) -> std::net::SocketAddr {
        self.url
            .trim_start_matches("http://")
            .parse()
            .expect("the url holds an address")
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn notify(&self) {
        self.changed.send_modify(|n| *n += 1);
    }

    /// All stored slices, by name.
    pub fn slices(&self) -> Vec<ResourceSlice> {
        self.lock().slices.values().cloned().collect()
    }

    /// Every request received so far, in order.
    pub fn requests(&self) -> Vec<RecordedRequest> {
        self.lock().requests.clone()
    }

    /// The HTTP-level counts so far.
    pub fn counts(&self) -> ApiCounts {
        self.lock().counts
    }

    /// Accepted HTTP writes so far.
    pub fn writes(&self) -> u64 {
        self.lock().counts.writes()
    }

    /// The current resourceVersion.
    pub fn resource_version(&self) -> u64 {
        self.lock().rv
    }

    /// A Node as stored.
    pub fn node(&self, name: &str) -> Option<Node> {
        self.get::<Node>("", name)
    }

    /// Accepted Node merge patches so far.
    pub fn node_patches(&self) -> u64 {
        self.lock().node_patches
    }

    /// Sets a Node label directly (as another controller would).
    pub fn set_node_label(&self, name: &str, key: &str, value: &str) {
        if let Some(mut n) = self.get::<Node>("", name) {
            n.metadata
                .labels
                .get_or_insert_with(Default::default)
                .insert(key.into(), value.into());
            self.put(&n);
        }
    }

    /// Stores a Node with this name and UID (the owner of a node's ResourceSlices).
    pub fn seed_node(&self, name: &str, uid: &str) {
        let node = Node {
            metadata: ObjectMeta {
                name: Some(name.into()),
                uid: Some(uid.into()),
                ..Default::default()
            },
            ..Default::default()
        };
        self.put(&node);
    }

    /// Stores a DeviceClass (listed and watched, never written through HTTP).
    pub fn seed_device_class(&self, class: DeviceClass) {
        self.set_device_class(class);
    }

    /// Stores a ResourceClaim under its namespace and name (read with GET; its status written
    /// by server-side apply only).
    pub fn seed_claim(&self, claim: ResourceClaim) {
        self.put(&claim);
    }

    /// A ResourceClaim as stored.
    pub fn claim(&self, namespace: &str, name: &str) -> Option<ResourceClaim> {
        self.get::<ResourceClaim>(namespace, name)
    }

    /// Deallocates a claim as the resourceclaim controller does once no pod holds it: its
    /// allocation and reservations go, and with them, by the API server's own rule, the
    /// `status.devices` entries of the devices that were allocated (all of them: an entry must
    /// be of an allocated device). False when there is no such claim.
    pub fn deallocate_claim(&self, namespace: &str, name: &str) -> bool {
        let key = (namespace.to_string(), name.to_string());
        self.lock().claim_status_owners.remove(&key);
        let Some(mut claim) = self.get::<ResourceClaim>(namespace, name) else {
            return false;
        };
        if let Some(status) = claim.status.as_mut() {
            status.allocation = None;
            status.reserved_for = None;
            status.devices = None;
        }
        claim.metadata.managed_fields = None;
        self.put(&claim);
        true
    }

    /// An object of a built-in kind as stored (`namespace` empty for a cluster-scoped one), for
    /// the kinds the generic store serves (see [`ApiServer::object`]).
    pub fn get<K>(&self, namespace: &str, name: &str) -> Option<K>
    where
        K: k8s_openapi::Resource + serde::de::DeserializeOwned,
    {
        let v = self.object(K::API_VERSION, K::URL_PATH_SEGMENT, namespace, name)?;
        Some(serde_json::from_value(v).expect("a stored object parses as its kind"))
    }

    /// Stores an object of a built-in kind as someone else would (see [`ApiServer::put_object`]).
    pub fn put<K>(&self, obj: &K) -> K
    where
        K: k8s_openapi::Resource + serde::Serialize + serde::de::DeserializeOwned,
    {
        let v = serde_json::to_value(obj).expect("an object serialises");
        let stored = self.put_object(K::API_VERSION, K::URL_PATH_SEGMENT, v);
        serde_json::from_value(stored).expect("a stored object parses as its kind")
    }

    /// An object of the generic store as stored: `api_version` as in `apiVersion` (`v1`,
    /// `apps/v1`, `resource.nvidia.com/v1beta1`), the resource's plural, and `namespace` empty
    /// for a cluster-scoped one. The store serves Pods, Nodes, Namespaces, Events (both
    /// groups), ConfigMaps, Secrets, ServiceAccounts, DaemonSets, Deployments, Leases,
    /// ResourceClaims, ResourceClaimTemplates, ComputeDomains and ComputeDomainCliques.
    pub fn object(
        &self,
        api_version: &str,
        plural: &str,
        namespace: &str,
        name: &str,
    ) -> Option<Value> {
        let res = objects::resource(api_version, plural)?;
        self.lock().objects.get(res, namespace, name).cloned()
    }

    /// Every stored object of a resource of the generic store.
    pub fn objects(&self, api_version: &str, plural: &str) -> Vec<Value> {
        match objects::resource(api_version, plural) {
            Some(res) => self.lock().objects.all(res),
            None => Vec::new(),
        }
    }

    /// Stores an object as someone else would (a scheduler, a kubelet, the test itself): created
    /// or replaced whole, status included, with `uid`, `creationTimestamp`, `generation` and a
    /// new `resourceVersion` filled in; watches are told. Not counted. Returns it as stored.
    ///
    /// # Panics
    ///
    /// On a resource the store does not serve (a test's mistake).
    pub fn put_object(&self, api_version: &str, plural: &str, obj: Value) -> Value {
        let Some(res) = objects::resource(api_version, plural) else {
            panic!("the test API server does not serve {plural} of {api_version}");
        };
        let stored = self.lock().obj_put(res, obj);
        self.notify();
        stored
    }

    /// Deletes an object as someone else would: with finalizers it is only marked
    /// (`deletionTimestamp`), else removed with what it owns. False if there was none.
    pub fn delete_object(
        &self,
        api_version: &str,
        plural: &str,
        namespace: &str,
        name: &str,
    ) -> bool {
        let Some(res) = objects::resource(api_version, plural) else {
            return false;
        };
        let mut st = self.lock();
        let Some(obj) = st.objects.get(res, namespace, name).cloned() else {
            return false;
        };
        st.obj_delete(res, obj);
        drop(st);
        self.notify();
        true
    }

    /// Waits until `pred` holds of the server (checked after every write); panics naming `what`
    /// after `timeout`.
    pub async fn wait_until(
        &self,
        timeout: Duration,
        what: &str,
        pred: impl Fn(&ApiServer) -> bool,
    ) {
        let mut rx = self.changed.subscribe();
        let wait = async {
            loop {
                rx.borrow_and_update();
                if pred(self) {
                    return;
                }
                if rx.changed().await.is_err() {
                    std::future::pending::<()>().await;
                }
            }
        };
        if tokio::time::timeout(timeout, wait).await.is_err() {
            panic!("{what}: not within {timeout:?}");
        }
    }

    /// Drops `status.devices` on every write from now on, as a server without the field does
    /// (before Kubernetes 1.32, or with the `DRAResourceClaimDeviceStatus` feature gate off).
    pub fn drop_claim_device_status(&self) {
        self.lock().claim_status_dropped = true;
    }

    /// Stores a slice as someone else would (not counted); `metadata.name` must be set.
    pub fn insert_slice(&self, mut slice: ResourceSlice) -> ResourceSlice {
        let mut st = self.lock();
        let rv = st.next_rv();
        let name = slice
            .metadata
            .name
            .clone()
            .expect("insert_slice needs a name");
        slice.metadata.resource_version = Some(rv.to_string());
        slice
            .metadata
            .uid
            .get_or_insert_with(|| format!("uid-{rv}"));
        let kind = if st.slices.contains_key(&name) {
            "MODIFIED"
        } else {
            "ADDED"
        };
        st.slices.insert(name, slice.clone());
        st.emit(kind, &slice);
        drop(st);
        self.notify();
        slice
    }

    /// Deletes a slice as someone else would (e.g. the kubelet on restart); not counted.
    pub fn delete_slice(&self, name: &str) -> bool {
        let mut st = self.lock();
        let Some(mut obj) = st.slices.remove(name) else {
            return false;
        };
        let rv = st.next_rv();
        obj.metadata.resource_version = Some(rv.to_string());
        st.emit("DELETED", &obj);
        drop(st);
        self.notify();
        true
    }

    /// Edits a slice as someone else would; not counted.
    pub fn edit_slice(&self, name: &str, edit: impl FnOnce(&mut ResourceSlice)) {
        let mut slice = self
            .lock()
            .slices
            .get(name)
            .cloned()
            .expect("no such slice");
        edit(&mut slice);
        self.insert_slice(slice);
    }

    /// Creates or replaces a DeviceClass, telling the DeviceClass watches.
    pub fn set_device_class(&self, mut class: DeviceClass) {
        let mut st = self.lock();
        let rv = st.next_rv();
        class.metadata.resource_version = Some(rv.to_string());
        let name = class
            .metadata
            .name
            .clone()
            .expect("a DeviceClass has a name");
        let kind = if st.device_classes.contains_key(&name) {
            "MODIFIED"
        } else {
            "ADDED"
        };
        let line = class_event(kind, &class);
        st.class_watchers.retain(|w| w.send(line.clone()).is_ok());
        st.device_classes.insert(name, class);
    }

    /// Deletes a DeviceClass, telling the DeviceClass watches; false if there was none.
    pub fn delete_device_class(&self, name: &str) -> bool {
        let mut st = self.lock();
        let Some(mut class) = st.device_classes.remove(name) else {
            return false;
        };
        class.metadata.resource_version = Some(st.next_rv().to_string());
        let line = class_event("DELETED", &class);
        st.class_watchers.retain(|w| w.send(line.clone()).is_ok());
        true
    }

    /// API discovery answers 404 for `resource.k8s.io/v1` (a cluster without DRA).
    pub fn set_dra_absent(&self) {
        self.lock().dra_absent = true;
    }

    /// Makes `/version` report Kubernetes 1.`minor` (default 1.35.0).
    pub fn set_server_minor(&self, minor: u32) {
        self.lock().server_minor = minor;
    }

    /// Makes `/version` report Kubernetes 1.`minor`.`patch` (its `gitVersion`).
    pub fn set_server_version(&self, minor: u32, patch: u32) {
        let mut st = self.lock();
        st.server_minor = minor;
        st.server_patch = patch;
    }

    /// The next `n` requests (of any kind) fail with 500.
    pub fn fail_next(&self, n: u32) {
        self.lock().fail_next = n;
    }

    /// The next update fails with 409 Conflict, whatever its resourceVersion.
    pub fn conflict_next_update(&self) {
        self.lock().conflict_next_update = true;
    }

    /// Silently drops a spec field on create and update, as the API server does for a field whose
    /// feature gate is off: `sharedCounters`, `devices[].consumesCounters`, `devices[].taints`.
    pub fn drop_field(&self, path: &str) {
        self.lock().dropped_fields.push(path.into());
    }

    /// Moves the resourceVersion on (as writes elsewhere in the cluster do) and forgets the event
    /// history: a watch from any earlier resourceVersion gets 410 Gone.
    pub fn compact(&self) {
        let mut st = self.lock();
        st.history.clear();
        st.objects.forget_history();
        st.compacted = st.next_rv();
    }

    /// Ends every open watch (as a server restart or a load balancer would).
    pub fn close_watches(&self) {
        let mut st = self.lock();
        st.watchers.clear();
        st.objects.close_watches();
    }

    /// Open watches.
    pub fn watchers(&self) -> usize {
        let mut st = self.lock();
        st.watchers.retain(|w| !w.tx.is_closed());
        st.watchers.len()
    }

    /// Waits until `pred` holds for the stored slices; panics with the slices after `timeout`.
    pub async fn wait_for(
        &self,
        timeout: Duration,
        pred: impl Fn(&[ResourceSlice]) -> bool,
    ) -> Vec<ResourceSlice> {
        let mut rx = self.changed.subscribe();
        let wait = async {
            loop {
                let slices = self.slices();
                if pred(&slices) {
                    return slices;
                }
                if rx.changed().await.is_err() {
                    std::future::pending::<()>().await;
                }
            }
        };
        match tokio::time::timeout(timeout, wait).await {
            Ok(slices) => slices,
            Err(_) => panic!(
                "condition not met within {timeout:?}; slices: {:#?}",
                self.slices()
            ),
        }
    }
}

#[derive(Clone)]
struct Server {
    state: Arc<Mutex<State>>,
    changed: Arc<watch::Sender<u64>>,
}

fn full(status: StatusCode, body: Vec<u8>) -> Response<Body> {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)).boxed())
        .expect("a valid response")
}

fn ok_json(status: StatusCode, v: &impl k8s_openapi::serde::Serialize) -> Response<Body> {
    full(status, serde_json::to_vec(v).expect("serialisable"))
}

fn status_value(code: u16, reason: &str, message: &str, details: Option<Value>) -> Value {
    let mut v = json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    });
    if let Some(d) = details {
        v["details"] = d;
    }
    v
}

fn error(code: u16, reason: &str, message: impl Into<String>) -> Response<Body> {
    let status = StatusCode::from_u16(code).expect("a valid status code");
    ok_json(status, &status_value(code, reason, &message.into(), None))
}

fn not_found(kind: &str, name: &str) -> Response<Body> {
    error(404, "NotFound", format!("{kind} \"{name}\" not found"))
}

fn conflict(name: &str) -> Response<Body> {
    error(
        409,
        "Conflict",
        format!(
            "Operation cannot be fulfilled on resourceslices.resource.k8s.io \"{name}\": the \
             object has been modified; please apply your changes to the latest version and try again"
        ),
    )
}

fn invalid(name: &str, causes: Vec<(String, String)>) -> Response<Body> {
    let message = format!(
        "ResourceSlice.resource.k8s.io \"{name}\" is invalid: {}",
        causes
            .iter()
            .map(|(f, m)| format!("{f}: {m}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let details = json!({
        "name": name,
        "group": "resource.k8s.io",
        "kind": "ResourceSlice",
        "causes": causes.iter().map(|(f, m)| json!({"reason": "FieldValueInvalid", "message": m, "field": f})).collect::<Vec<_>>(),
    });
    ok_json(
        StatusCode::UNPROCESSABLE_ENTITY,
        &status_value(422, "Invalid", &message, Some(details)),
    )
}

fn query(req: &Request<Incoming>) -> BTreeMap<String, String> {
    req.uri()
        .query()
        .unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect()
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap_or("");
                match u8::from_str_radix(hex, 16) {
                    Ok(b) => {
                        out.push(b);
                        i += 2;
                    }
                    Err(_) => out.push(b'%'),
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A parsed field and label selector.
#[derive(Clone, Debug, Default)]
struct Selector {
    /// (field, value, equal?)
    fields: Vec<(String, String, bool)>,
    labels: Vec<LabelReq>,
}

#[derive(Clone, Debug)]
enum LabelReq {
    Eq(String, String),
    Ne(String, String),
    Exists(String),
    NotExists(String),
}

impl Selector {
    fn parse(q: &BTreeMap<String, String>) -> Result<Self, String> {
        let mut sel = Selector::default();
        for term in q
            .get("fieldSelector")
            .map(String::as_str)
            .unwrap_or("")
            .split(',')
            .filter(|t| !t.is_empty())
        {
            let (field, value, eq) = if let Some((f, v)) = term.split_once("!=") {
                (f, v, false)
            } else if let Some((f, v)) = term.split_once("==") {
                (f, v, true)
            } else if let Some((f, v)) = term.split_once('=') {
                (f, v, true)
            } else {
                return Err(format!("invalid field selector term {term:?}"));
            };
            if !["spec.driver", "spec.nodeName", "metadata.name"].contains(&field) {
                return Err(format!(
                    "field label not supported: {field} (resourceslices support spec.driver, \
                     spec.nodeName, metadata.name)"
                ));
            }
            sel.fields.push((field.into(), value.into(), eq));
        }
        for term in q
            .get("labelSelector")
            .map(String::as_str)
            .unwrap_or("")
            .split(',')
            .filter(|t| !t.is_empty())
        {
            let req = if let Some((k, v)) = term.split_once("!=") {
                LabelReq::Ne(k.into(), v.into())
            } else if let Some((k, v)) = term.split_once("==") {
                LabelReq::Eq(k.into(), v.into())
            } else if let Some((k, v)) = term.split_once('=') {
                LabelReq::Eq(k.into(), v.into())
            } else if let Some(k) = term.strip_prefix('!') {
                LabelReq::NotExists(k.into())
            } else {
                LabelReq::Exists(term.into())
            };
            sel.labels.push(req);
        }
        Ok(sel)
    }

    fn matches(&self, s: &ResourceSlice) -> bool {
        let fields_ok = self.fields.iter().all(|(f, v, eq)| {
            let actual = match f.as_str() {
                "spec.driver" => s.spec.driver.as_str(),
                "spec.nodeName" => s.spec.node_name.as_deref().unwrap_or(""),
                _ => s.metadata.name.as_deref().unwrap_or(""),
            };
            (actual == v) == *eq
        });
        let labels = s.metadata.labels.clone().unwrap_or_default();
        let labels_ok = self.labels.iter().all(|r| match r {
            LabelReq::Eq(k, v) => labels.get(k) == Some(v),
            LabelReq::Ne(k, v) => labels.get(k) != Some(v),
            LabelReq::Exists(k) => labels.contains_key(k),
            LabelReq::NotExists(k) => !labels.contains_key(k),
        });
        fields_ok && labels_ok
    }
}

impl Server {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    async fn handle(&self, req: Request<Incoming>) -> Response<Body> {
        {
            let mut st = self.lock();
            st.counts.requests += 1;
            st.requests.push(RecordedRequest {
                method: req.method().to_string(),
                path: req.uri().path().to_string(),
                query: req.uri().query().unwrap_or_default().to_string(),
            });
            if st.fail_next > 0 {
                st.fail_next -= 1;
                return error(
                    500,
                    "InternalError",
                    "Internal error occurred: injected fault",
                );
            }
        }
        let path = req.uri().path().to_string();
        let method = req.method().clone();
        let q = query(&req);
        let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
        let content_type = req
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string();
        let resp = match (method.clone(), segs.as_slice()) {
            (Method::GET, ["apis", "resource.k8s.io", "v1", "resourceslices"]) => {
                if q.get("watch").is_some_and(|w| w == "true" || w == "1") {
                    self.watch(&q)
                } else {
                    self.list(&q)
                }
            }
            (Method::POST, ["apis", "resource.k8s.io", "v1", "resourceslices"]) => {
                match read_slice(req).await {
                    Ok(s) => self.create(s),
                    Err(r) => r,
                }
            }
            (Method::GET, ["apis", "resource.k8s.io", "v1", "resourceslices", name]) => {
                match self.lock().slices.get(*name) {
                    Some(s) => ok_json(StatusCode::OK, s),
                    None => not_found("resourceslices.resource.k8s.io", name),
                }
            }
            (Method::PUT, ["apis", "resource.k8s.io", "v1", "resourceslices", name]) => {
                let name = name.to_string();
                match read_slice(req).await {
                    Ok(s) => self.update(&name, s),
                    Err(r) => r,
                }
            }
            (Method::DELETE, ["apis", "resource.k8s.io", "v1", "resourceslices", name]) => {
                let name = name.to_string();
                match read_preconditions(req).await {
                    Ok(pre) => self.delete(&name, pre),
                    Err(r) => r,
                }
            }
            (Method::GET, ["apis", "resource.k8s.io", "v1"]) => {
                if self.lock().dra_absent {
                    not_found("resource.k8s.io/v1", "v1")
                } else {
                    objects::discovery(Some("resource.k8s.io/v1"), false, TYPED)
                }
            }
            (Method::GET, ["apis", "resource.k8s.io", "v1", "deviceclasses"]) => {
                let mut st = self.lock();
                if q.get("watch").is_some_and(|w| w == "true" || w == "1") {
                    st.counts.watches += 1;
                    let (tx, rx) = mpsc::unbounded_channel::<Bytes>();
                    if q.get("resourceVersion")
                        .is_none_or(|v| v.is_empty() || v == "0")
                    {
                        for c in st.device_classes.values() {
                            let _ = tx.send(class_event("ADDED", c));
                        }
                    }
                    st.class_watchers.push(tx);
                    stream_response(rx)
                } else {
                    st.counts.lists += 1;
                    let items: Vec<&DeviceClass> = st.device_classes.values().collect();
                    ok_json(
                        StatusCode::OK,
                        &json!({
                            "apiVersion": "resource.k8s.io/v1",
                            "kind": "DeviceClassList",
                            "metadata": { "resourceVersion": st.rv.to_string() },
                            "items": items,
                        }),
                    )
                }
            }
            (Method::GET, ["version"]) => {
                let (minor, patch) = {
                    let st = self.lock();
                    (st.server_minor, st.server_patch)
                };
                ok_json(
                    StatusCode::OK,
                    &serde_json::json!({
                        "major": "1",
                        "minor": minor.to_string(),
                        "gitVersion": format!("v1.{minor}.{patch}"),
                        "gitCommit": "",
                        "gitTreeState": "clean",
                        "buildDate": "2026-01-01T00:00:00Z",
                        "goVersion": "go1.25",
                        "compiler": "gc",
                        "platform": "linux/amd64",
                    }),
                )
            }
            (
                Method::PATCH,
                [
                    "apis",
                    "resource.k8s.io",
                    "v1",
                    "namespaces",
                    ns,
                    "resourceclaims",
                    name,
                    "status",
                ],
            ) if content_type.starts_with("application/apply-patch") => {
                let key = (ns.to_string(), name.to_string());
                match req.into_body().collect().await.map(|b| b.to_bytes()) {
                    Err(_) => error(400, "BadRequest", "unreadable body"),
                    Ok(bytes) => self.apply_claim_status(key, &q, &bytes),
                }
            }
            _ => self.generic(&method, &segs, &q, &content_type, req).await,
        };
        if resp.status().is_success() && method != Method::GET {
            self.changed.send_modify(|n| *n += 1);
        }
        if resp.status() == StatusCode::CONFLICT {
            self.lock().counts.conflicts += 1;
        }
        resp
    }

    /// A server-side apply of a claim's `status.devices` by one field manager, close enough to the
    /// real server's: the claim must exist (404) and have the patch's `metadata.uid` (409); each
    /// entry must be of one of the allocation's results, with at most 10 KiB of `data` and 8
    /// conditions (422). The manager's entries are replaced as a whole (forced: they are its
    /// alone after), its earlier entries it no longer applies are removed unless another
    /// manager applied them too, and other managers' entries stay; `metadata.managedFields`
    /// says who applied which. A server that drops the field stores nothing and answers 200.
    fn apply_claim_status(
        &self,
        key: (String, String),
        q: &BTreeMap<String, String>,
        body: &[u8],
    ) -> Response<Body> {
        let Some(manager) = q.get("fieldManager").filter(|m| !m.is_empty()).cloned() else {
            return error(
                400,
                "BadRequest",
                "fieldManager is required for apply requests",
            );
        };
        // An apply patch is YAML; JSON is YAML, and what kube-rs sends.
        let patch: Value = match serde_json::from_slice(body) {
            Ok(v) => v,
            Err(e) => return error(400, "BadRequest", format!("bad apply patch: {e}")),
        };
        let entries: Vec<AllocatedDeviceStatus> = match patch
            .pointer("/status/devices")
            .cloned()
            .map(serde_json::from_value)
            .transpose()
        {
            Ok(d) => d.unwrap_or_default(),
            Err(e) => return error(400, "BadRequest", format!("bad status.devices: {e}")),
        };
        // Not in `counts`, which are the slices' (as Node patches): see `requests`.
        let mut st = self.lock();
        let res = objects::resource("resource.k8s.io/v1", "resourceclaims")
            .expect("the store serves claims");
        let Some(mut claim) = st.objects.get(res, &key.0, &key.1).map(|v| {
            serde_json::from_value::<ResourceClaim>(v.clone()).expect("a stored claim parses")
        }) else {
            return not_found("resourceclaims.resource.k8s.io", &key.1);
        };
        let have = claim.metadata.uid.clone().unwrap_or_default();
        if let Some(uid) = patch.pointer("/metadata/uid").and_then(Value::as_str)
            && uid != have
        {
            return error(
                409,
                "Conflict",
                format!(
                    "Operation cannot be fulfilled on resourceclaims.resource.k8s.io \"{}\": \
                     Precondition failed: UID in precondition: {uid}, UID in object meta: {have}",
                    key.1
                ),
            );
        }
        if st.claim_status_dropped {
            return ok_json(StatusCode::OK, &claim);
        }
        let allocated: BTreeSet<DeviceKey> = claim
            .status
            .as_ref()
            .and_then(|s| s.allocation.as_ref())
            .and_then(|a| a.devices.as_ref())
            .and_then(|d| d.results.as_ref())
            .into_iter()
            .flatten()
            .map(|r| {
                (
                    r.driver.clone(),
                    r.pool.clone(),
                    r.device.clone(),
                    r.share_id.clone(),
                )
            })
            .collect();
        let mut causes = Vec::new();
        for (i, e) in entries.iter().enumerate() {
            let field = format!("status.devices[{i}]");
            if !allocated.contains(&device_key(e)) {
                causes.push(format!(
                    "{field}: Invalid value: {:?}: must be an allocated device in the claim",
                    device_key(e)
                ));
            }
            let data = e.data.as_ref().map_or(0, |d| d.0.to_string().len());
            if data > 10 * 1024 {
                causes.push(format!(
                    "{field}.data: Too long: may not be more than 10240 bytes"
                ));
            }
            if e.conditions.as_ref().is_some_and(|c| c.len() > 8) {
                causes.push(format!(
                    "{field}.conditions: Too many: must have at most 8 items"
                ));
            }
        }
        if !causes.is_empty() {
            return error(
                422,
                "Invalid",
                format!(
                    "ResourceClaim.resource.k8s.io \"{}\" is invalid: {}",
                    key.1,
                    causes.join(", ")
                ),
            );
        }
        let applied: BTreeSet<DeviceKey> = entries.iter().map(device_key).collect();
        let owners = st.claim_status_owners.entry(key.clone()).or_default();
        let before = owners
            .insert(manager.clone(), applied.clone())
            .unwrap_or_default();
        for (m, keys) in owners.iter_mut() {
            if *m != manager {
                keys.retain(|k| !applied.contains(k));
            }
        }
        owners.retain(|_, keys| !keys.is_empty());
        let owned: BTreeSet<DeviceKey> = owners.values().flatten().cloned().collect();
        let managed: Vec<_> = owners
            .iter()
            .map(|(m, keys)| {
                let devices: serde_json::Map<String, Value> = keys
                    .iter()
                    .map(|(driver, pool, device, share)| {
                        let mut k = json!({"driver": driver, "pool": pool, "device": device});
                        if let Some(share) = share {
                            k["shareID"] = share.clone().into();
                        }
                        (format!("k:{k}"), json!({}))
                    })
                    .collect();
                json!({
                    "manager": m, "operation": "Apply", "apiVersion": "resource.k8s.io/v1",
                    "subresource": "status", "fieldsType": "FieldsV1",
                    "fieldsV1": {"f:status": {"f:devices": devices}},
                })
            })
            .collect();
        let status = claim.status.get_or_insert_with(Default::default);
        let old = status.devices.clone();
        let mut devices = status.devices.take().unwrap_or_default();
        devices.retain(|d| {
            let k = device_key(d);
            applied.contains(&k) || !before.contains(&k) || owned.contains(&k)
        });
        for e in entries {
            match devices.iter_mut().find(|d| device_key(d) == device_key(&e)) {
                Some(d) => *d = e,
                None => devices.push(e),
            }
        }
        status.devices = (!devices.is_empty()).then_some(devices);
        let changed = status.devices != old;
        let managed_fields = (!managed.is_empty())
            .then(|| serde_json::from_value(Value::Array(managed)).expect("managed fields parse"));
        if !changed && claim.metadata.managed_fields == managed_fields {
            return ok_json(StatusCode::OK, &claim);
        }
        claim.metadata.managed_fields = managed_fields;
        let res = objects::resource("resource.k8s.io/v1", "resourceclaims")
            .expect("the store serves claims");
        let old = st.objects.get(res, &key.0, &key.1).cloned();
        let new = serde_json::to_value(&claim).expect("a claim serialises");
        let stored = st.obj_commit(res, old, Some(new));
        ok_json(StatusCode::OK, &stored)
    }

    /// Any request of the generic store (objects.rs): discovery, or a verb on an object or a
    /// collection.
    async fn generic(
        &self,
        method: &Method,
        segs: &[&str],
        q: &BTreeMap<String, String>,
        content_type: &str,
        req: Request<Incoming>,
    ) -> Response<Body> {
        let t = match objects::parse_path(segs) {
            objects::Path::Discovery(api, core) => {
                if *method != Method::GET {
                    return error(
                        405,
                        "MethodNotAllowed",
                        format!("{method} of a discovery document"),
                    );
                }
                return objects::discovery(api.as_deref(), core, TYPED);
            }
            objects::Path::Target(t) => t,
            objects::Path::Unknown => {
                return error(
                    404,
                    "NotFound",
                    format!(
                        "the server could not find the requested resource ({method} /{})",
                        segs.join("/")
                    ),
                );
            }
        };
        let body = match req.into_body().collect().await {
            Ok(b) => b.to_bytes(),
            Err(e) => return error(400, "BadRequest", format!("reading the body: {e}")),
        };
        let mut st = self.lock();
        let resp = match (method, &t.name) {
            (&Method::GET, _) => st.obj_read(&t, q),
            (&Method::POST, None) if !t.status => st.obj_create(&t, &body),
            (&Method::PUT, Some(_)) => st.obj_update(&t, &body),
            (&Method::PATCH, Some(_)) => st.obj_patch(&t, content_type, q, &body),
            (&Method::DELETE, Some(_)) if !t.status => st.obj_delete_req(&t, &body),
            (&Method::DELETE, None) => st.obj_delete_collection(&t, q),
            _ => error(
                405,
                "MethodNotAllowed",
                format!("{method} is not allowed on /{}", segs.join("/")),
            ),
        };
        if *method == Method::PATCH && t.res.plural == "nodes" && resp.status().is_success() {
            st.node_patches += 1;
        }
        resp
    }

    fn list(&self, q: &BTreeMap<String, String>) -> Response<Body> {
        let sel = match Selector::parse(q) {
            Ok(s) => s,
            Err(e) => return error(400, "BadRequest", e),
        };
        let mut st = self.lock();
        st.counts.lists += 1;
        let items: Vec<&ResourceSlice> = st.slices.values().filter(|s| sel.matches(s)).collect();
        ok_json(
            StatusCode::OK,
            &json!({
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceSliceList",
                "metadata": { "resourceVersion": st.rv.to_string() },
                "items": items,
            }),
        )
    }

    fn watch(&self, q: &BTreeMap<String, String>) -> Response<Body> {
        let sel = match Selector::parse(q) {
            Ok(s) => s,
            Err(e) => return error(400, "BadRequest", e),
        };
        let (tx, rx) = mpsc::unbounded_channel::<Bytes>();
        let mut st = self.lock();
        st.counts.watches += 1;
        let from = q.get("resourceVersion").cloned().unwrap_or_default();
        match from.parse::<u64>() {
            Ok(rv) if rv != 0 => {
                if rv < st.compacted {
                    let status = status_value(
                        410,
                        "Expired",
                        &format!("too old resource version: {rv} ({})", st.compacted),
                        None,
                    );
                    let mut line = serde_json::to_vec(&json!({"type": "ERROR", "object": status}))
                        .expect("serialisable");
                    line.push(b'\n');
                    let _ = tx.send(Bytes::from(line));
                    drop(tx);
                    return stream_response(rx);
                }
                for (_, kind, obj) in st
                    .history
                    .iter()
                    .filter(|(v, _, o)| *v > rv && sel.matches(o))
                {
                    let _ = tx.send(event_line(kind, obj));
                }
            }
            _ if from.is_empty() || from == "0" => {
                for obj in st.slices.values().filter(|o| sel.matches(o)) {
                    let _ = tx.send(event_line("ADDED", obj));
                }
            }
            _ => {
                return error(
                    400,
                    "BadRequest",
                    format!("invalid resourceVersion {from:?}"),
                );
            }
        }
        st.watchers.push(Watcher { selector: sel, tx });
        stream_response(rx)
    }

    fn create(&self, mut s: ResourceSlice) -> Response<Body> {
        let mut st = self.lock();
        st.counts.write_requests += 1;
        drop_fields(&mut s, &st.dropped_fields);
        let name = match (&s.metadata.name, &s.metadata.generate_name) {
            (Some(n), _) => n.clone(),
            (None, Some(prefix)) => {
                let base: String = prefix.chars().take(58).collect();
                loop {
                    let suffix: String = (0..5)
                        .map(|_| {
                            char::from(NAME_ALPHABET[rand::random_range(0..NAME_ALPHABET.len())])
                        })
                        .collect();
                    let name = format!("{base}{suffix}");
                    if !st.slices.contains_key(&name) {
                        break name;
                    }
                }
            }
            (None, None) => {
                return invalid(
                    "",
                    vec![(
                        "metadata.name".into(),
                        "name or generateName is required".into(),
                    )],
                );
            }
        };
        if st.slices.contains_key(&name) {
            return error(
                409,
                "AlreadyExists",
                format!("resourceslices.resource.k8s.io \"{name}\" already exists"),
            );
        }
        s.metadata.name = Some(name.clone());
        let causes = validate(&s, st.server_minor);
        if !causes.is_empty() {
            return invalid(&name, causes);
        }
        let rv = st.next_rv();
        s.metadata.resource_version = Some(rv.to_string());
        s.metadata.uid = Some(format!("uid-{rv}"));
        s.metadata.generation = Some(1);
        s.metadata.creation_timestamp = Some(now());
        s.metadata.managed_fields = None;
        stamp_taints(&mut s, None);
        st.slices.insert(name, s.clone());
        st.counts.creates += 1;
        st.emit("ADDED", &s);
        ok_json(StatusCode::CREATED, &s)
    }

    fn update(&self, name: &str, mut s: ResourceSlice) -> Response<Body> {
        let mut st = self.lock();
        st.counts.write_requests += 1;
        if s.metadata.name.as_deref() != Some(name) {
            return error(
                400,
                "BadRequest",
                format!(
                    "the name of the object ({:?}) does not match the name on the URL ({name})",
                    s.metadata.name
                ),
            );
        }
        let Some(current) = st.slices.get(name).cloned() else {
            return not_found("resourceslices.resource.k8s.io", name);
        };
        if std::mem::take(&mut st.conflict_next_update) {
            return conflict(name);
        }
        if let Some(rv) = s.metadata.resource_version.as_deref()
            && !rv.is_empty()
            && Some(rv) != current.metadata.resource_version.as_deref()
        {
            return conflict(name);
        }
        drop_fields(&mut s, &st.dropped_fields);
        let mut causes = validate(&s, st.server_minor);
        for (field, old, new) in [
            (
                "spec.driver",
                Some(&current.spec.driver),
                Some(&s.spec.driver),
            ),
            (
                "spec.pool.name",
                Some(&current.spec.pool.name),
                Some(&s.spec.pool.name),
            ),
            (
                "spec.nodeName",
                current.spec.node_name.as_ref(),
                s.spec.node_name.as_ref(),
            ),
        ] {
            if old != new {
                causes.push((field.into(), "field is immutable".into()));
            }
        }
        if !causes.is_empty() {
            return invalid(name, causes);
        }
        // Server-owned metadata.
        s.metadata.uid = current.metadata.uid.clone();
        s.metadata.creation_timestamp = current.metadata.creation_timestamp.clone();
        s.metadata.generate_name = s
            .metadata
            .generate_name
            .or(current.metadata.generate_name.clone());
        s.metadata.managed_fields = None;
        stamp_taints(&mut s, Some(&current));
        let spec_changed = current.spec != s.spec;
        s.metadata.generation =
            Some(current.metadata.generation.unwrap_or(1) + i64::from(spec_changed));
        s.metadata.resource_version = current.metadata.resource_version.clone();
        st.counts.updates += 1;
        if s == current {
            // A no-op update stores nothing and emits no event.
            return ok_json(StatusCode::OK, &current);
        }
        let rv = st.next_rv();
        s.metadata.resource_version = Some(rv.to_string());
        st.slices.insert(name.into(), s.clone());
        st.emit("MODIFIED", &s);
        ok_json(StatusCode::OK, &s)
    }

    /// DELETE, honouring `preconditions` as the API server does (409 when they do not hold).
    fn delete(&self, name: &str, pre: Option<serde_json::Value>) -> Response<Body> {
        let mut st = self.lock();
        st.counts.write_requests += 1;
        let Some(have) = st.slices.get(name) else {
            return not_found("resourceslices.resource.k8s.io", name);
        };
        let pre = pre.unwrap_or_default();
        let (uid, rv) = (&have.metadata.uid, &have.metadata.resource_version);
        if let Some(want) = pre.get("uid").and_then(|v| v.as_str())
            && uid.as_deref() != Some(want)
        {
            let msg = format!(
                "Precondition failed: UID in precondition: {want}, UID in object meta: {}",
                uid.as_deref().unwrap_or("")
            );
            return error(409, "Conflict", msg);
        }
        if let Some(want) = pre.get("resourceVersion").and_then(|v| v.as_str())
            && rv.as_deref() != Some(want)
        {
            return conflict(name);
        }
        let Some(mut obj) = st.slices.remove(name) else {
            return not_found("resourceslices.resource.k8s.io", name);
        };
        let rv = st.next_rv();
        obj.metadata.resource_version = Some(rv.to_string());
        st.counts.deletes += 1;
        st.emit("DELETED", &obj);
        ok_json(StatusCode::OK, &obj)
    }
}

fn stream_response(rx: mpsc::UnboundedReceiver<Bytes>) -> Response<Body> {
    let frames = tokio_stream::wrappers::UnboundedReceiverStream::new(rx)
        .map(|b| Ok::<_, Infallible>(Frame::data(b)));
    Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "application/json")
        .body(BodyExt::boxed(StreamBody::new(frames)))
        .expect("a valid response")
}

/// The `preconditions` of a DELETE's DeleteOptions body, if it has any.
async fn read_preconditions(
    req: Request<Incoming>,
) -> Result<Option<serde_json::Value>, Response<Body>> {
    let bytes = req
        .into_body()
        .collect()
        .await
        .map_err(|e| error(400, "BadRequest", format!("reading the body: {e}")))?
        .to_bytes();
    if bytes.is_empty() {
        return Ok(None);
    }
    let options: serde_json::Value = serde_json::from_slice(&bytes)
        .map_err(|e| error(400, "BadRequest", format!("decoding DeleteOptions: {e}")))?;
    Ok(options.get("preconditions").cloned())
}

async fn read_slice(req: Request<Incoming>) -> Result<ResourceSlice, Response<Body>> {
    let bytes = req
        .into_body()
        .collect()
        .await
        .map_err(|e| error(400, "BadRequest", format!("reading the body: {e}")))?
        .to_bytes();
    serde_json::from_slice(&bytes)
        .map_err(|e| error(400, "BadRequest", format!("decoding a ResourceSlice: {e}")))
}

fn now() -> Time {
    let t = k8s_openapi::jiff::Timestamp::now();
    Time(k8s_openapi::jiff::Timestamp::from_second(t.as_second()).unwrap_or(t))
}

/// Sets `timeAdded` on taints that lack it, keeping the stored time of an unchanged taint.
fn stamp_taints(s: &mut ResourceSlice, current: Option<&ResourceSlice>) {
    for d in s.spec.devices.iter_mut().flatten() {
        let old = current
            .and_then(|c| c.spec.devices.as_ref())
            .and_then(|ds| ds.iter().find(|o| o.name == d.name))
            .and_then(|o| o.taints.clone())
            .unwrap_or_default();
        for t in d.taints.iter_mut().flatten() {
            if t.time_added.is_none() {
                t.time_added = old
                    .iter()
                    .find(|o| o.key == t.key && o.value == t.value && o.effect == t.effect)
                    .and_then(|o| o.time_added.clone())
                    .or_else(|| Some(now()));
            }
        }
    }
}

/// Removes the configured spec fields (`a.b[].c` paths) from a slice.
fn drop_fields(s: &mut ResourceSlice, paths: &[String]) {
    if paths.is_empty() {
        return;
    }
    let mut spec = serde_json::to_value(&s.spec).expect("a spec serialises");
    for path in paths {
        let segs: Vec<&str> = path.split('.').collect();
        strip(&mut spec, &segs);
    }
    s.spec = serde_json::from_value(spec).expect("a spec minus optional fields still parses");
}

fn strip(v: &mut Value, segs: &[&str]) {
    let Some((first, rest)) = segs.split_first() else {
        return;
    };
    let (key, each) = match first.strip_suffix("[]") {
        Some(k) => (k, true),
        None => (*first, false),
    };
    let Value::Object(map) = v else {
        return;
    };
    if rest.is_empty() && !each {
        map.remove(key);
        return;
    }
    let Some(child) = map.get_mut(key) else {
        return;
    };
    if each {
        if let Value::Array(items) = child {
            for item in items {
                strip(item, rest);
            }
        }
    } else {
        strip(child, rest);
    }
}

/// The `resource.k8s.io/v1` validation: the object's name, the library's rules that the API
/// server shares ([`crate::validate`], Kubernetes 1.34 and 1.35 limits), and one difference
/// between the two versions: a 1.35 server (`minor` 35 and later) refuses shared counters in the
/// same slice as devices, which 1.34 takes.
fn validate(s: &ResourceSlice, minor: u32) -> Vec<(String, String)> {
    let mut causes: Vec<(String, String)> = Vec::new();
    let name = s.metadata.name.as_deref().unwrap_or("");
    if !crate::validate::is_dns_subdomain(name, 253) {
        causes.push((
            "metadata.name".into(),
            format!("{name:?} is not a DNS subdomain"),
        ));
    }
    let spec = &s.spec;
    let devices = spec.devices.as_deref().unwrap_or(&[]);
    let counters = spec.shared_counters.as_deref().unwrap_or(&[]);
    if minor >= 35 && !devices.is_empty() && !counters.is_empty() {
        causes.push((
            "spec".into(),
            "only one of `devices` and `sharedCounters` may be set".into(),
        ));
    }
    for v in crate::validate::validate(spec) {
        if v.server_rejects() {
            let field = match &v.device {
                Some(d) => format!("spec.devices[{d}]"),
                None => "spec".into(),
            };
            causes.push((field, v.rule));
        }
    }
    causes
}
