//! The ResourceSlice publisher end to end: `impl SliceApi for kube::Client` (kube-rs over HTTP)
//! against the test API server of the `testing` feature.
// Through `kube::Client` (the default feature `kube`); not a `[[test]]` with required features,
// which would make the image's build (Containerfile) stub this file too.
#![cfg(feature = "kube")]

mod support {
    pub mod wait;
}

use k8s_openapi::api::resource::v1::{
    Device, DeviceAttribute, DeviceCapacity, DeviceTaint, ResourceClaim, ResourcePool,
    ResourceSlice, ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kubelet_plugin::api::{self, SliceApi};
use kubelet_plugin::claims::ClaimSource;
use kubelet_plugin::publisher::{Options, Publisher, PublisherHandle};
use kubelet_plugin::testing::ApiServer;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;
use support::wait::{SOON, eventually};
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

/// Two slices: dev-0..3 and dev-4..7.
fn two_slices() -> Vec<ResourceSliceSpec> {
    (0..2)
        .map(|s| {
            spec(
                (0..4)
                    .map(|i| device(&format!("dev-{}", s * 4 + i), "80Gi"))
                    .collect(),
            )
        })
        .collect()
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

    async fn publish(&self, specs: Vec<ResourceSliceSpec>) {
        let seq = self.handle.set_desired(specs).expect("specs for our node");
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
    for s in &slices {
        let name = s.metadata.name.as_deref().unwrap();
        let suffix = name.strip_prefix("node-a-fpga.example.com-").expect(name);
        assert_eq!(suffix.len(), 5, "{name}");
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
    assert!(slices.iter().all(|s| s.spec.pool.generation == 2));
    running.stop().await;
}

#[tokio::test]
async fn one_changed_device_is_one_update_with_a_new_generation() {
    let (server, running) = kube_setup().await;
    let mut desired = vec![spec(
        (0..8)
            .map(|i| device(&format!("dev-{i}"), "80Gi"))
            .collect(),
    )];
    running.publish(desired.clone()).await;
    let before = server.slices();
    let counts = server.counts();

    desired[0].devices.as_mut().unwrap()[3] = device("dev-3", "40Gi");
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
    assert_eq!(after.len(), 1);
    assert_eq!(after[0].metadata.name, before[0].metadata.name);
    assert_eq!(
        after[0].spec.pool.generation,
        before[0].spec.pool.generation + 1
    );
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
    three.push(spec(vec![device("dev-8", "80Gi")]));
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
    desired[1].devices.as_mut().unwrap()[0] = device("dev-4", "40Gi");
    running.publish(desired).await;

    let c = running.handle.counters();
    assert_eq!(c.conflicts, 1, "{c:?}");
    let slices = server.slices();
    assert!(complete(&slices, 2, &all_device_names()));
    assert!(
        slices.iter().all(|s| s.spec.pool.generation == 2),
        "{slices:#?}"
    );
    running.stop().await;
}

#[tokio::test]
async fn fields_dropped_by_the_server_are_reported_once_and_cause_no_churn() {
    let (server, running) = kube_setup().await;
    server.drop_field("devices[].taints");
    let mut desired = two_slices();
    desired[0].devices.as_mut().unwrap()[0].taints = Some(vec![DeviceTaint {
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
    stored("leftover", 3, vec![device("dev-9", "80Gi")]);
    stored("current", 4, current.clone());

    let api = server.client().unwrap();
    let running = Running::start(Arc::new(api));
    running.publish(vec![spec(current)]).await;

    let slices = server.slices();
    assert_eq!(slices.len(), 1);
    assert_eq!(slices[0].metadata.name.as_deref(), Some("current"));
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
async fn an_invalid_slice_is_reported_not_fatal() {
    let (server, running) = kube_setup().await;
    let too_many = spec(
        (0..129)
            .map(|i| device(&format!("dev-{i}"), "1Gi"))
            .collect(),
    );
    running.handle.set_desired(vec![too_many]).unwrap();
    let mut status = running.handle.status();
    let st = tokio::time::timeout(SOON, status.wait_for(|s| s.last_error.is_some()))
        .await
        .expect("an error is reported")
        .unwrap()
        .clone();
    let err = st.last_error.unwrap();
    assert!(err.contains("at most 128"), "{err}");
    assert!(err.contains("422"), "{err}");
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
        api.delete_slice("nope").await,
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
}
