//! The ResourceSlice publisher end to end: `impl SliceApi for kube::Client` (kube-rs over HTTP)
//! against the test API server of the `testing` feature.
// Through `kube::Client` (the default feature `kube`); not a `[[test]]` with required features,
// which would make the image's build (Containerfile) stub this file too.
#![cfg(feature = "kube")]

use crate::wait::{SOON, eventually};
use k8s_openapi::api::resource::v1::{
    Device, DeviceAttribute, DeviceCapacity, DeviceTaint, ResourceClaim, ResourcePool,
    ResourceSlice, ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference, Preconditions};
use kubelet_plugin::api::{self, SliceApi};
use kubelet_plugin::claims::ClaimSource;
use kubelet_plugin::publisher::{
    Nodes, Options, Pool, Publisher, PublisherHandle, Resources, Slice,
};
use kubelet_plugin::testing::ApiServer;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

const DRIVER: &str = "fpga.example.com";
const NODE: &str = "node-a";
const NODE_UID: &str = "0b6f3c2e-node-a";

fn device(name: &str, memory: &str) -> Device {
    Device {
        name: name.into(),
        attributes: Some(BTreeMap::from([
            (
                "type".to_string(),
                DeviceAttribute {
                    string: Some("fpga".into()),
                    ..Default::default()
                },
            ),
            (
                "productName".to_string(),
                DeviceAttribute {
                    string: Some("Example FPGA X1".into()),
                    ..Default::default()
                },
            ),
        ])),
        capacity: Some(BTreeMap::from([(
            "memory".to_string(),
            DeviceCapacity {
                value: Quantity(memory.into()),
                request_policy: None,
            },
        )])),
        ..Default::default()
    }
}

/// A whole spec, for slices the tests store themselves.
fn spec(devices: Vec<Device>) -> ResourceSliceSpec {
    ResourceSliceSpec {
        driver: DRIVER.into(),
        node_name: Some(NODE.into()),
        pool: ResourcePool {
            name: NODE.into(),
            generation: 0,
            resource_slice_count: 0,
        },
        devices: Some(devices),
        ..Default::default()
    }
}

fn slice(devices: Vec<Device>) -> Slice {
    Slice {
        devices,
        ..Default::default()
    }
}

/// Two slices: dev-0..3 and dev-4..7, in the pool named after the node.
fn two_slices() -> Resources {
    let slices = (0..2)
        .map(|s| {
            slice(
                (0..4)
                    .map(|i| device(&format!("dev-{}", s * 4 + i), "80Gi"))
                    .collect(),
            )
        })
        .collect();
    Resources::node_local(NODE, slices)
}

/// The slices of the pool named after the node.
fn slices_of(r: &mut Resources) -> &mut Vec<Slice> {
    &mut r.pools.get_mut(NODE).expect("the node's pool").slices
}

fn device_names(slices: &[ResourceSlice]) -> BTreeSet<String> {
    slices
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten().map(|d| d.name.clone()))
        .collect()
}

fn all_device_names() -> BTreeSet<String> {
    (0..8).map(|i| format!("dev-{i}")).collect()
}

/// A complete pool: one generation, every slice counting `n`, holding `devices`.
fn complete(slices: &[ResourceSlice], n: usize, devices: &BTreeSet<String>) -> bool {
    let generations: BTreeSet<i64> = slices.iter().map(|s| s.spec.pool.generation).collect();
    slices.len() == n
        && generations.len() == 1
        && slices
            .iter()
            .all(|s| s.spec.pool.resource_slice_count == n as i64)
        && device_names(slices) == *devices
}

fn fast() -> Options {
    Options {
        settle: Duration::from_millis(20),
        backoff_base: Duration::from_millis(20),
        backoff_cap: Duration::from_millis(200),
        conflict_retries: 5,
        ..Options::default()
    }
}

struct Running {
    handle: PublisherHandle,
    token: CancellationToken,
    task: JoinHandle<()>,
}

impl Running {
    fn start(api: Arc<dyn SliceApi>) -> Self {
        let (publisher, handle) = Publisher::with_options(api, DRIVER, NODE, fast());
        let token = CancellationToken::new();
        let task = tokio::spawn(publisher.run(token.clone()));
        Running {
            handle,
            token,
            task,
        }
    }

    async fn publish(&self, resources: Resources) {
        let seq = self
            .handle
            .set_desired(resources)
            .expect("pools for our node");
        tokio::time::timeout(SOON, self.handle.wait_synced(seq))
            .await
            .unwrap_or_else(|_| panic!("not published: {:?}", self.handle.status().borrow()));
    }

    async fn stop(self) {
        self.token.cancel();
        tokio::time::timeout(SOON, self.task)
            .await
            .expect("the publisher stops promptly on shutdown")
            .expect("the publisher task does not panic");
    }
}

async fn kube_setup() -> (ApiServer, Running) {
    let server = ApiServer::start().await;
    server.seed_node(NODE, NODE_UID);
    let api = server.client().expect("a client for the test server");
    let running = Running::start(Arc::new(api));
    (server, running)
}

/// Makes the publisher reconcile once more and waits for that reconcile: the watch is dropped and
/// its resourceVersion compacted away, so the watch must re-list (as after an etcd compaction).
async fn force_reconcile(server: &ApiServer, running: &Running) {
    let before = running.handle.counters().reconciles;
    server.compact();
    server.close_watches();
    eventually("a reconcile after the watch restarted", || {
        running.handle.counters().reconciles > before
    })
    .await;
}

#[tokio::test]
async fn first_publish_creates_a_complete_pool_owned_by_the_node() {
    let (server, running) = kube_setup().await;
    running.publish(two_slices()).await;

    let slices = server.slices();
    assert!(complete(&slices, 2, &all_device_names()), "{slices:#?}");
    for (i, s) in slices.iter().enumerate() {
        let name = s.metadata.name.as_deref().unwrap();
        let prefix = format!("0000{i}-fpga.example.com-node-a-");
        let suffix = name.strip_prefix(&prefix).expect(name);
        assert_eq!(suffix.len(), 5, "{name}");
        assert_eq!(s.spec.driver, DRIVER);
        assert_eq!(s.spec.node_name.as_deref(), Some(NODE));
        assert_eq!(s.spec.pool.name, NODE);
        assert_eq!(s.spec.pool.generation, 1);
        assert_eq!(
            s.metadata.owner_references,
            Some(vec![OwnerReference {
                api_version: "v1".into(),
                kind: "Node".into(),
                name: NODE.into(),
                uid: NODE_UID.into(),
                controller: Some(true),
                block_owner_deletion: None,
            }])
        );
    }
    let counts = server.counts();
    assert_eq!((counts.creates, counts.updates, counts.deletes), (2, 0, 0));
    let c = running.handle.counters();
    assert_eq!((c.creates, c.updates, c.deletes), (2, 0, 0));
    running.stop().await;
}

#[tokio::test]
async fn the_steady_state_writes_nothing() {
    let (server, running) = kube_setup().await;
    running.publish(two_slices()).await;
    let writes = server.counts().write_requests;

    // Watch restarts (as after an API server restart) make the publisher re-read everything;
    // each waits for a reconcile that ran after the echo of our own writes.
    for _ in 0..3 {
        force_reconcile(&server, &running).await;
    }
    // The same desired state set again: `publish` waits for the reconcile of that state.
    running.publish(two_slices()).await;

    assert_eq!(server.counts().write_requests, writes, "no write requests");
    let c = running.handle.counters();
    assert_eq!((c.creates, c.updates, c.deletes), (2, 0, 0));
    assert!(c.reconciles >= 5, "it did look: {c:?}");
    running.stop().await;
}

#[tokio::test]
async fn an_external_delete_is_repaired_quickly() {
    let (server, running) = kube_setup().await;
    running.publish(two_slices()).await;
    let victim = server.slices()[0].metadata.name.clone().unwrap();

    assert!(server.delete_slice(&victim));
    let slices = server
        .wait_for(SOON, |s| complete(s, 2, &all_device_names()))
        .await;
    // The survivor was updated to the new generation, the missing one created.
    assert!(
        slices.iter().all(|s| s.spec.pool.generation == 2),
        "{slices:#?}"
    );
    let counts = server.counts();
    assert_eq!((counts.creates, counts.updates, counts.deletes), (3, 1, 0));

    // The kubelet's wipe at start: every slice of the node at once.
    for s in server.slices() {
        server.delete_slice(s.metadata.name.as_deref().unwrap());
    }
    server
        .wait_for(SOON, |s| complete(s, 2, &all_device_names()))
        .await;
    running.stop().await;
}

#[tokio::test]
async fn an_external_edit_is_reverted() {
    let (server, running) = kube_setup().await;
    running.publish(two_slices()).await;
    let name = server.slices()[0].metadata.name.clone().unwrap();
    server.edit_slice(&name, |s| {
        s.spec.devices.as_mut().unwrap()[0] = device("dev-0", "1Gi");
    });
    let slices = server
        .wait_for(SOON, |s| {
            complete(s, 2, &all_device_names())
                && s.iter()
                    .flat_map(|s| s.spec.devices.iter().flatten())
                    .all(|d| d.capacity.as_ref().unwrap()["memory"].value.0 == "80Gi")
        })
        .await;
    // One slice to put back: one update, the generation kept.
    assert!(slices.iter().all(|s| s.spec.pool.generation == 1));
    assert_eq!(server.counts().updates, 1);
    running.stop().await;
}

#[tokio::test]
async fn one_changed_device_is_one_update_that_keeps_the_generation() {
    let (server, running) = kube_setup().await;
    let mut desired = two_slices();
    running.publish(desired.clone()).await;
    let before = server.slices();
    let counts = server.counts();

    slices_of(&mut desired)[0].devices[3] = device("dev-3", "40Gi");
    running.publish(desired).await;

    let after = server.slices();
    let delta = server.counts();
    assert_eq!(
        (
            delta.creates - counts.creates,
            delta.updates - counts.updates,
            delta.deletes - counts.deletes
        ),
        (0, 1, 0)
    );
    assert_eq!(after.len(), 2);
    assert_eq!(after[0].metadata.name, before[0].metadata.name);
    // The one write is atomic, so the pool never looks half old, half new: Go's controller
    // keeps the generation then, and so does this one.
    assert_eq!(
        after[0].spec.pool.generation,
        before[0].spec.pool.generation
    );
    assert_eq!(after[1], before[1]);
    let dev3 = &after[0].spec.devices.as_ref().unwrap()[3];
    assert_eq!(dev3.capacity.as_ref().unwrap()["memory"].value.0, "40Gi");
    running.stop().await;
}

#[tokio::test]
async fn server_errors_are_retried_until_the_server_recovers() {
    let server = ApiServer::start().await;
    server.seed_node(NODE, NODE_UID);
    server.fail_next(8);
    let api = server.client().unwrap();
    let running = Running::start(Arc::new(api));
    running.publish(two_slices()).await;

    assert!(complete(&server.slices(), 2, &all_device_names()));
    let c = running.handle.counters();
    assert!(c.errors >= 1, "{c:?}");
    assert_eq!(server.counts().creates, 2, "no duplicate slices");

    // Failures in the middle of a change: it still converges, without duplicates.
    server.fail_next(3);
    let mut three = two_slices();
    slices_of(&mut three).push(slice(vec![device("dev-8", "80Gi")]));
    running.publish(three).await;
    let mut want = all_device_names();
    want.insert("dev-8".into());
    assert!(
        complete(&server.slices(), 3, &want),
        "{:#?}",
        server.slices()
    );
    running.stop().await;
}

#[tokio::test]
async fn an_api_server_that_is_down_is_waited_for_and_published_to_when_back() {
    let first = ApiServer::start().await;
    let addr = first.addr();
    drop(first);
    let uri: http::Uri = format!("http://{addr}").parse().unwrap();
    let api = kube::Client::try_from(kube::Config::new(uri)).unwrap();
    let running = Running::start(Arc::new(api));
    running.handle.set_desired(two_slices()).unwrap();
    eventually("failed attempts while the server is down", || {
        running.handle.counters().errors >= 2
    })
    .await;
    let err = running.handle.status().borrow().last_error.clone().unwrap();
    assert!(err.contains("unavailable"), "{err}");
    assert!(!running.task.is_finished());

    let server = ApiServer::start_on(addr).await;
    server.seed_node(NODE, NODE_UID);
    server
        .wait_for(SOON, |s| complete(s, 2, &all_device_names()))
        .await;
    assert_eq!(server.counts().creates, 2);
    running.stop().await;
}

#[tokio::test]
async fn a_conflict_on_update_is_re_read_and_retried() {
    let (server, running) = kube_setup().await;
    let mut desired = two_slices();
    running.publish(desired.clone()).await;

    server.conflict_next_update();
    slices_of(&mut desired)[1].devices[0] = device("dev-4", "40Gi");
    running.publish(desired).await;

    let c = running.handle.counters();
    assert_eq!(c.conflicts, 1, "{c:?}");
    let slices = server.slices();
    assert!(complete(&slices, 2, &all_device_names()));
    let memory = &slices[1].spec.devices.as_ref().unwrap()[0]
        .capacity
        .as_ref()
        .unwrap()["memory"];
    assert_eq!(memory.value.0, "40Gi", "{slices:#?}");
    running.stop().await;
}

#[tokio::test]
async fn fields_dropped_by_the_server_are_reported_once_and_cause_no_churn() {
    let (server, running) = kube_setup().await;
    server.drop_field("devices[].taints");
    let mut desired = two_slices();
    slices_of(&mut desired)[0].devices[0].taints = Some(vec![DeviceTaint {
        key: "fpga.example.com/unhealthy".into(),
        value: Some("xid-79".into()),
        effect: "NoSchedule".into(),
        time_added: None,
    }]);
    let mut dropped = running.handle.dropped_fields();
    running.publish(desired).await;

    let fields = tokio::time::timeout(SOON, dropped.wait_for(|d| !d.is_empty()))
        .await
        .expect("dropped fields reported")
        .expect("the publisher keeps the channel")
        .clone();
    let names: Vec<String> = fields.iter().map(|f| f.to_string()).collect();
    assert_eq!(names, ["spec.devices[].taints"]);
    assert_eq!(fields.iter().next().unwrap().field(), "taints");

    let writes = server.counts().write_requests;
    force_reconcile(&server, &running).await;
    force_reconcile(&server, &running).await;
    assert_eq!(server.counts().write_requests, writes, "no update loop");
    running.stop().await;
}

#[tokio::test]
async fn a_stale_slice_of_an_old_generation_is_deleted() {
    let server = ApiServer::start().await;
    server.seed_node(NODE, NODE_UID);
    let owner = OwnerReference {
        api_version: "v1".into(),
        kind: "Node".into(),
        name: NODE.into(),
        uid: NODE_UID.into(),
        controller: Some(true),
        block_owner_deletion: None,
    };
    let stored = |name: &str, generation: i64, devices: Vec<Device>| {
        let mut s = spec(devices);
        s.pool.generation = generation;
        s.pool.resource_slice_count = 1;
        server.insert_slice(ResourceSlice {
            metadata: ObjectMeta {
                name: Some(name.into()),
                owner_references: Some(vec![owner.clone()]),
                ..Default::default()
            },
            spec: s,
        })
    };
    let current: Vec<Device> = (0..2)
        .map(|i| device(&format!("dev-{i}"), "80Gi"))
        .collect();
    let current_name = "00000-fpga.example.com-node-a-cur00";
    stored(
        "00000-fpga.example.com-node-a-old00",
        3,
        vec![device("dev-9", "80Gi")],
    );
    stored(current_name, 4, current.clone());

    let api = server.client().unwrap();
    let running = Running::start(Arc::new(api));
    running
        .publish(Resources::node_local(NODE, vec![slice(current)]))
        .await;

    let slices = server.slices();
    assert_eq!(slices.len(), 1);
    assert_eq!(slices[0].metadata.name.as_deref(), Some(current_name));
    assert_eq!(slices[0].spec.pool.generation, 4, "no bump for a delete");
    let counts = server.counts();
    assert_eq!((counts.creates, counts.updates, counts.deletes), (0, 0, 1));
    running.stop().await;
}

#[tokio::test]
async fn a_compacted_watch_re_lists_and_still_sees_deletes() {
    let (server, running) = kube_setup().await;
    running.publish(two_slices()).await;
    // Old history gone and the watch dropped: re-watching from the old version gets 410.
    force_reconcile(&server, &running).await;
    eventually("the watch to be re-established", || server.watchers() > 0).await;

    let victim = server.slices()[1].metadata.name.clone().unwrap();
    server.delete_slice(&victim);
    server
        .wait_for(SOON, |s| complete(s, 2, &all_device_names()))
        .await;
    running.stop().await;
}

#[tokio::test]
async fn an_invalid_slice_is_reported_and_never_sent() {
    let (server, running) = kube_setup().await;
    let too_many = slice(
        (0..129)
            .map(|i| device(&format!("dev-{i}"), "1Gi"))
            .collect(),
    );
    running
        .handle
        .set_desired(Resources::node_local(NODE, vec![too_many]))
        .unwrap();
    let mut status = running.handle.status();
    let st = tokio::time::timeout(SOON, status.wait_for(|s| s.last_error.is_some()))
        .await
        .expect("an error is reported")
        .unwrap()
        .clone();
    let err = st.last_error.unwrap();
    assert!(err.contains("at most 128"), "{err}");
    // The crate's own validation caught it: the server never saw it (no 422 retried).
    assert!(!err.contains("422"), "{err}");
    force_reconcile(&server, &running).await;
    assert_eq!(server.counts().write_requests, 0);
    assert_eq!(running.handle.counters().errors, 0, "not a retried failure");
    assert!(server.slices().is_empty());

    // A valid layout afterwards is published.
    running.publish(two_slices()).await;
    assert!(complete(&server.slices(), 2, &all_device_names()));
    running.stop().await;
}

#[tokio::test]
async fn shutdown_is_prompt_even_while_the_server_fails() {
    let (server, running) = kube_setup().await;
    server.fail_next(u32::MAX);
    running.handle.set_desired(two_slices()).unwrap();
    eventually("a failed attempt", || running.handle.counters().errors > 0).await;
    running.stop().await;
}

#[tokio::test]
async fn slices_without_a_node_object_have_no_owner() {
    let server = ApiServer::start().await;
    let api = server.client().unwrap();
    let running = Running::start(Arc::new(api));
    running.publish(two_slices()).await;
    assert!(
        server
            .slices()
            .iter()
            .all(|s| s.metadata.owner_references.is_none())
    );
    running.stop().await;
}

#[tokio::test]
async fn kube_api_reads_claims_and_maps_errors() {
    let server = ApiServer::start().await;
    server.seed_claim(ResourceClaim {
        metadata: ObjectMeta {
            name: Some("c1".into()),
            namespace: Some("ns1".into()),
            uid: Some("claim-uid".into()),
            ..Default::default()
        },
        ..Default::default()
    });
    let api = server.client().unwrap();
    let claim = api.get_claim("ns1", "c1").await.unwrap();
    assert_eq!(claim.metadata.uid.as_deref(), Some("claim-uid"));
    assert!(matches!(
        api.get_claim("ns1", "nope").await,
        Err(api::Error::NotFound(_))
    ));
    assert!(matches!(
        api.get_node("nope").await,
        Err(api::Error::NotFound(_))
    ));
    assert!(matches!(
        api.delete_slice("nope", &Preconditions::default()).await,
        Err(api::Error::NotFound(_))
    ));
    server.fail_next(1);
    assert!(matches!(
        api.list_slices(DRIVER, NODE).await,
        Err(api::Error::Transient(_))
    ));

    // A stale resourceVersion is a conflict.
    let mut s = ResourceSlice {
        metadata: ObjectMeta {
            generate_name: Some("x-".into()),
            ..Default::default()
        },
        spec: spec(vec![device("dev-0", "80Gi")]),
    };
    s.spec.pool.resource_slice_count = 1;
    let created = api.create_slice(&s).await.unwrap();
    let mut edit = created.clone();
    edit.spec.pool.generation = 5;
    api.replace_slice(&edit).await.unwrap();
    assert!(matches!(
        api.replace_slice(&edit).await,
        Err(api::Error::Conflict(_))
    ));
    let listed = api.list_slices(DRIVER, NODE).await.unwrap();
    assert_eq!(listed.len(), 1);
    assert!(
        api.list_slices(DRIVER, "other-node")
            .await
            .unwrap()
            .is_empty()
    );
    // The empty node selects the slices that name none.
    assert!(api.list_slices(DRIVER, "").await.unwrap().is_empty());

    // Deletes with preconditions: a stale resourceVersion or another uid leaves the slice.
    let name = created.metadata.name.clone().unwrap();
    let current = api.list_slices(DRIVER, NODE).await.unwrap().remove(0);
    let held = |uid: Option<String>, rv: Option<String>| Preconditions {
        uid,
        resource_version: rv,
    };
    for stale in [
        held(None, created.metadata.resource_version.clone()),
        held(Some("another-uid".into()), None),
    ] {
        assert!(
            matches!(
                api.delete_slice(&name, &stale).await,
                Err(api::Error::Conflict(_))
            ),
            "{stale:?}"
        );
    }
    assert_eq!(server.slices().len(), 1);
    let exact = held(
        current.metadata.uid.clone(),
        current.metadata.resource_version.clone(),
    );
    api.delete_slice(&name, &exact).await.unwrap();
    assert!(server.slices().is_empty());
}

/// The order in which the scheduler's allocator tries devices, as the crate README states it
/// (Kubernetes 1.36+, the "incubating" and "experimental" allocators of
/// `k8s.io/dynamic-resource-allocation/structured`, `pools_*.go`: `sortPoolsByID`,
/// `sortSlicesByName`): pools by driver and pool name, a pool's slices by name, a slice's devices
/// in their order; first fit. Here each claim asks for one device and takes the first one free.
fn allocation_order(slices: &[ResourceSlice]) -> Vec<String> {
    let mut sorted: Vec<&ResourceSlice> = slices.iter().collect();
    sorted.sort_by_key(|s| (&s.spec.driver, &s.spec.pool.name, &s.metadata.name));
    let devices: Vec<&str> = sorted
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten())
        .map(|d| d.name.as_str())
        .collect();
    let mut taken: Vec<String> = Vec::new();
    for _claim in 0..devices.len() {
        let free = devices
            .iter()
            .find(|d| !taken.iter().any(|t| t == *d))
            .expect("a free device");
        taken.push(free.to_string());
    }
    taken
}

#[tokio::test]
async fn list_order_is_name_order_is_allocation_order_is_the_drivers_order() {
    let (server, running) = kube_setup().await;
    // 17 slices, so the last index is 0x10: "00010" sorts after "0000f" where "16" would sort
    // before "2". Device names deliberately out of order, so nothing else can explain the order.
    let slices: Vec<Slice> = (0..17)
        .map(|i| {
            let d = (i * 7) % 17;
            slice(vec![
                device(&format!("dev-{d}-x"), "80Gi"),
                device(&format!("dev-{d}-a"), "80Gi"),
            ])
        })
        .collect();
    let mut desired = Resources::node_local(NODE, slices);
    // A second pool whose name sorts first: the scheduler tries it first.
    desired.pools.insert(
        "a-pool".into(),
        Pool {
            nodes: Nodes::ThisNode,
            slices: vec![slice(vec![device("preferred", "80Gi")])],
        },
    );
    running.publish(desired.clone()).await;

    let drivers_order: Vec<String> = desired
        .pools
        .values()
        .flat_map(|p| &p.slices)
        .flat_map(|s| &s.devices)
        .map(|d| d.name.clone())
        .collect();
    let api = server.client().unwrap();
    let listed = api.list_slices(DRIVER, NODE).await.unwrap();
    let names: Vec<&str> = listed
        .iter()
        .map(|s| s.metadata.name.as_deref().unwrap())
        .collect();
    let mut sorted = names.clone();
    sorted.sort();
    assert_eq!(names, sorted, "the API server lists by name");
    // Within the node's pool, list order is the driver's order of slices.
    let pool_order: Vec<String> = listed
        .iter()
        .filter(|s| s.spec.pool.name == NODE)
        .flat_map(|s| s.spec.devices.iter().flatten())
        .map(|d| d.name.clone())
        .collect();
    let drivers_pool_order: Vec<String> = desired.pools[NODE]
        .slices
        .iter()
        .flat_map(|s| &s.devices)
        .map(|d| d.name.clone())
        .collect();
    assert_eq!(pool_order, drivers_pool_order);
    assert_eq!(allocation_order(&listed), drivers_order);
    assert_eq!(allocation_order(&listed)[0], "preferred");

    // The driver moves its last slice to the front: the names follow, and so does allocation.
    let node_pool = desired.pools.get_mut(NODE).unwrap();
    let last = node_pool.slices.pop().unwrap();
    node_pool.slices.insert(0, last);
    running.publish(desired.clone()).await;
    let listed = api.list_slices(DRIVER, NODE).await.unwrap();
    let drivers_order: Vec<String> = desired
        .pools
        .values()
        .flat_map(|p| &p.slices)
        .flat_map(|s| &s.devices)
        .map(|d| d.name.clone())
        .collect();
    assert_eq!(allocation_order(&listed), drivers_order);
    running.stop().await;
}

#[tokio::test]
async fn network_pools_are_published_watched_and_removed_and_others_left_alone() {
    let server = ApiServer::start().await;
    server.seed_node(NODE, NODE_UID);
    // Another publisher's network pool: never touched.
    let mut foreign = spec(vec![device("nic-9", "1Gi")]);
    foreign.node_name = None;
    foreign.all_nodes = Some(true);
    foreign.pool = ResourcePool {
        name: "rack-2".into(),
        generation: 1,
        resource_slice_count: 1,
    };
    server.insert_slice(ResourceSlice {
        metadata: ObjectMeta {
            name: Some("00000-fpga.example.com-node-b-zzzzz".into()),
            ..Default::default()
        },
        spec: foreign,
    });
    let api = server.client().unwrap();
    let opts = Options {
        network_pools: BTreeSet::from(["rack-1".to_string()]),
        ..fast()
    };
    let (publisher, handle) = Publisher::with_options(Arc::new(api), DRIVER, NODE, opts);
    let token = CancellationToken::new();
    let task = tokio::spawn(publisher.run(token.clone()));
    let running = Running {
        handle,
        token,
        task,
    };
    let mut desired = two_slices();
    desired.pools.insert(
        "rack-1".into(),
        Pool {
            nodes: Nodes::All,
            slices: vec![slice(vec![device("nic-0", "1Gi")])],
        },
    );
    running.publish(desired.clone()).await;
    let rack = |s: &[ResourceSlice], pool: &str| -> Vec<ResourceSlice> {
        s.iter()
            .filter(|s| s.spec.pool.name == pool)
            .cloned()
            .collect()
    };
    let rack1 = rack(&server.slices(), "rack-1");
    assert_eq!(rack1.len(), 1);
    assert_eq!(rack1[0].spec.all_nodes, Some(true));
    assert_eq!(rack1[0].spec.node_name, None);
    assert_eq!(
        rack1[0].metadata.owner_references.as_ref().unwrap()[0].uid,
        NODE_UID
    );

    // Deleted by someone: the watch of node-less slices sees it and it is put back. First let
    // the echoes of our own writes pass (each settles in 20 ms), so that only the watch can
    // bring the repair.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let name = rack1[0].metadata.name.clone().unwrap();
    server.delete_slice(&name);
    server
        .wait_for(SOON, |s| rack(s, "rack-1").len() == 1)
        .await;

    // No longer desired: deleted; the other publisher's pool stays.
    desired.pools.remove("rack-1");
    running.publish(desired).await;
    let slices = server.slices();
    assert!(rack(&slices, "rack-1").is_empty());
    assert_eq!(rack(&slices, "rack-2").len(), 1);
    assert!(complete(&rack(&slices, NODE), 2, &all_device_names()));
    running.stop().await;
}

#[tokio::test]
async fn slices_of_the_unprefixed_naming_are_replaced_once() {
    let server = ApiServer::start().await;
    server.seed_node(NODE, NODE_UID);
    let mut old = spec(vec![device("dev-0", "80Gi")]);
    old.pool.generation = 1;
    old.pool.resource_slice_count = 1;
    server.insert_slice(ResourceSlice {
        metadata: ObjectMeta {
            name: Some("node-a-fpga.example.com-abcde".into()),
            ..Default::default()
        },
        spec: old,
    });
    let running = Running::start(Arc::new(server.client().unwrap()));
    running
        .publish(Resources::node_local(
            NODE,
            vec![slice(vec![device("dev-0", "80Gi")])],
        ))
        .await;
    let slices = server.slices();
    assert_eq!(slices.len(), 1);
    assert!(
        slices[0]
            .metadata
            .name
            .as_deref()
            .unwrap()
            .starts_with("00000-fpga.example.com-node-a-")
    );
    assert_eq!(slices[0].spec.pool.generation, 2);
    let counts = server.counts();
    assert_eq!((counts.creates, counts.updates, counts.deletes), (1, 0, 1));
    running.stop().await;
}
