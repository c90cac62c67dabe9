//! Publisher loop tests on an in-memory API with paused time (timings are exact here); the
//! HTTP-level behaviour is tested in `tests/integration/publisher.rs` against the test API server.

use super::*;
use futures::future::BoxFuture;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::Device;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Preconditions;
use std::sync::Mutex;

const DRIVER: &str = "gpu.nvidia.com";
const NODE: &str = "node-a";

/// A minimal in-memory API: slices by name, a failure budget, a call log with times.
#[derive(Default)]
struct MemApi {
    state: Mutex<MemState>,
}

#[derive(Default)]
struct MemState {
    slices: std::collections::BTreeMap<String, ResourceSlice>,
    rv: u64,
    /// The next this many calls fail with `Transient`.
    fail: u32,
    /// Times of list calls.
    lists: Vec<Instant>,
    writes: u64,
    /// The writes in order: `delete <name>`, `update <name>`, `create <generateName>`.
    ops: Vec<String>,
    /// Someone else edits the slice just before our next delete reaches it.
    edit_before_delete: bool,
}

impl MemApi {
    fn lock(&self) -> std::sync::MutexGuard<'_, MemState> {
        self.state.lock().unwrap()
    }

    fn check_fail(&self) -> api::Result<()> {
        let mut st = self.lock();
        if st.fail > 0 {
            st.fail -= 1;
            return Err(api::Error::Transient("injected".into()));
        }
        Ok(())
    }
}

impl SliceApi for MemApi {
    fn list_slices<'a>(
        &'a self,
        _driver: &'a str,
        _node: &'a str,
    ) -> BoxFuture<'a, api::Result<Vec<ResourceSlice>>> {
        Box::pin(async move {
            self.lock().lists.push(Instant::now());
            self.check_fail()?;
            Ok(self.lock().slices.values().cloned().collect())
        })
    }

    fn create_slice<'a>(
        &'a self,
        slice: &'a ResourceSlice,
    ) -> BoxFuture<'a, api::Result<ResourceSlice>> {
        Box::pin(async move {
            self.check_fail()?;
            let mut st = self.lock();
            st.rv += 1;
            st.writes += 1;
            let prefix = slice.metadata.generate_name.clone().unwrap_or_default();
            st.ops.push(format!("create {prefix}"));
            let mut s = slice.clone();
            s.metadata.name = Some(format!("{prefix}{}", st.rv));
            s.metadata.uid = Some(format!("uid-{}", st.rv));
            s.metadata.resource_version = Some(st.rv.to_string());
            st.slices
                .insert(s.metadata.name.clone().unwrap(), s.clone());
            Ok(s)
        })
    }

    fn replace_slice<'a>(
        &'a self,
        slice: &'a ResourceSlice,
    ) -> BoxFuture<'a, api::Result<ResourceSlice>> {
        Box::pin(async move {
            self.check_fail()?;
            let mut st = self.lock();
            st.rv += 1;
            st.writes += 1;
            let name = slice.metadata.name.clone().unwrap();
            st.ops.push(format!("update {name}"));
            let mut s = slice.clone();
            s.metadata.resource_version = Some(st.rv.to_string());
            st.slices.insert(name, s.clone());
            Ok(s)
        })
    }

    fn delete_slice<'a>(
        &'a self,
        name: &'a str,
        pre: &'a Preconditions,
    ) -> BoxFuture<'a, api::Result<()>> {
        Box::pin(async move {
            self.check_fail()?;
            let mut st = self.lock();
            st.writes += 1;
            st.ops.push(format!("delete {name}"));
            if std::mem::take(&mut st.edit_before_delete) {
                st.rv += 1;
                let rv = st.rv.to_string();
                if let Some(s) = st.slices.get_mut(name) {
                    s.metadata.resource_version = Some(rv);
                }
            }
            if let Some(s) = st.slices.get(name)
                && pre.resource_version.is_some()
                && pre.resource_version != s.metadata.resource_version
            {
                return Err(api::Error::Conflict(format!("{name} changed").into()));
            }
            st.slices
                .remove(name)
                .map(|_| ())
                .ok_or_else(|| api::Error::NotFound(name.into()))
        })
    }

    fn watch_slices<'a>(
        &'a self,
        _driver: &'a str,
        _node: &'a str,
    ) -> BoxStream<'a, api::Result<SliceEvent>> {
        // A watch that starts and then stays quiet.
        futures::stream::once(async { Ok(SliceEvent::Restarted) })
            .chain(futures::stream::pending())
            .boxed()
    }

    fn get_node<'a>(&'a self, name: &'a str) -> BoxFuture<'a, api::Result<Node>> {
        Box::pin(async move { Err(api::Error::NotFound(name.into())) })
    }
}

/// One node-local pool of one slice holding `devices`.
fn one(devices: &[&str]) -> Resources {
    Resources::node_local(NODE, vec![slice(devices)])
}

fn slice(devices: &[&str]) -> Slice {
    Slice {
        devices: devices
            .iter()
            .map(|d| Device {
                name: d.to_string(),
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    }
}

fn start(
    api: Arc<MemApi>,
) -> (
    PublisherHandle,
    CancellationToken,
    tokio::task::JoinHandle<()>,
) {
    let (publisher, handle) = Publisher::new(api, DRIVER, NODE);
    let token = CancellationToken::new();
    let task = tokio::spawn(publisher.run(token.clone()));
    (handle, token, task)
}

#[test]
fn backoff_doubles_with_jitter_up_to_the_cap() {
    let mut b = Backoff::new(Duration::from_millis(500), Duration::from_secs(30));
    let mut nominal = Duration::from_millis(500);
    for _ in 0..12 {
        let d = b.next_delay();
        assert!(
            d >= nominal / 2 && d <= nominal,
            "{d:?} not in [{nominal:?}/2, {nominal:?}]"
        );
        nominal = (nominal * 2).min(Duration::from_secs(30));
    }
    b.reset();
    assert!(b.next_delay() <= Duration::from_millis(500));
}

#[tokio::test(start_paused = true)]
async fn nothing_is_published_before_the_desired_state_is_set() {
    let api = Arc::new(MemApi::default());
    let (handle, token, task) = start(api.clone());
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert_eq!(handle.counters(), Counters::default());
    assert!(api.lock().lists.is_empty());
    token.cancel();
    task.await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_network_pool_must_be_declared() {
    let api = Arc::new(MemApi::default());
    let (_publisher, handle) = Publisher::new(api.clone(), DRIVER, NODE);
    let mut desired = one(&["gpu-0"]);
    desired.pools.insert(
        "rack-1".into(),
        Pool {
            nodes: Nodes::All,
            slices: vec![slice(&["nic-0"])],
        },
    );
    let err = handle.set_desired(desired.clone()).unwrap_err().to_string();
    assert!(
        err.contains("\"rack-1\"") && err.contains("network_pools"),
        "{err}"
    );
    let opts = Options {
        network_pools: BTreeSet::from(["rack-1".to_string()]),
        ..Options::default()
    };
    let (_publisher, handle) = Publisher::with_options(api, DRIVER, NODE, opts);
    handle.set_desired(desired).unwrap();
}

#[tokio::test(start_paused = true)]
async fn obsolete_slices_go_first_and_only_as_they_were_read() {
    let api = Arc::new(MemApi::default());
    let (handle, token, task) = start(api.clone());
    let seq = handle
        .set_desired(Resources::node_local(
            NODE,
            vec![slice(&["gpu-0"]), slice(&["gpu-1"]), slice(&["gpu-2"])],
        ))
        .unwrap();
    handle.wait_synced(seq).await;
    api.lock().ops.clear();

    // Slice 2 goes, slices 0 and 1 change (the count): the delete comes before the updates.
    // Someone edits slice 2 between our list and our delete: the delete is refused (its
    // resourceVersion is not the one we read), and the next pass reads and deletes it.
    api.lock().edit_before_delete = true;
    let seq = handle
        .set_desired(Resources::node_local(
            NODE,
            vec![slice(&["gpu-0"]), slice(&["gpu-1"])],
        ))
        .unwrap();
    handle.wait_synced(seq).await;
    let ops = api.lock().ops.clone();
    let third = "delete 00002-gpu.nvidia.com-node-a-3";
    assert_eq!(
        ops,
        [
            third,
            third,
            "update 00000-gpu.nvidia.com-node-a-1",
            "update 00001-gpu.nvidia.com-node-a-2"
        ],
        "{ops:?}"
    );
    assert_eq!(handle.counters().conflicts, 1);
    assert_eq!(api.lock().slices.len(), 2);
    token.cancel();
    task.await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn an_invalid_pool_is_reported_once_not_retried_and_the_rest_is_published() {
    let api = Arc::new(MemApi::default());
    let (publisher, handle) = Publisher::new(api.clone(), DRIVER, NODE);
    let heard = Arc::new(Mutex::new(Vec::new()));
    let h = heard.clone();
    let publisher = publisher.on_error(Arc::new(move |kind, e, _what| {
        h.lock().unwrap().push((kind, e.to_string()));
    }));
    let token = CancellationToken::new();
    let task = tokio::spawn(publisher.run(token.clone()));
    let mut desired = one(&["gpu-0"]);
    desired.pools.insert(
        "bad".into(),
        Pool {
            nodes: Nodes::ThisNode,
            slices: vec![slice(&["Not A Name"])],
        },
    );
    let seq = handle.set_desired(desired).unwrap();
    tokio::time::sleep(Duration::from_secs(3600)).await;
    let heard = heard.lock().unwrap().clone();
    assert_eq!(heard.len(), 1, "{heard:?}");
    assert_eq!(heard[0].0, crate::ErrorKind::Fatal);
    assert!(
        heard[0].1.contains("\"bad\"") && heard[0].1.contains("Not A Name"),
        "{heard:?}"
    );
    assert_eq!(api.lock().lists.len(), 1, "not retried");
    let names: Vec<String> = api
        .lock()
        .slices
        .values()
        .map(|s| s.spec.pool.name.clone())
        .collect();
    assert_eq!(names, [NODE]);
    let status = handle.status().borrow().clone();
    assert!(status.synced < Some(seq));
    assert!(status.last_error.unwrap().contains("\"bad\""));
    token.cancel();
    task.await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_given_node_uid_owns_the_slices_without_reading_the_node() {
    let api = Arc::new(MemApi::default());
    let opts = Options {
        node_uid: Some("uid-of-node-a".into()),
        ..Options::default()
    };
    let (publisher, handle) = Publisher::with_options(api.clone(), DRIVER, NODE, opts);
    let token = CancellationToken::new();
    let task = tokio::spawn(publisher.run(token.clone()));
    let seq = handle.set_desired(one(&["gpu-0"])).unwrap();
    handle.wait_synced(seq).await;
    let owners: Vec<_> = api
        .lock()
        .slices
        .values()
        .flat_map(|s| s.metadata.owner_references.clone().unwrap_or_default())
        .map(|o| (o.kind, o.name, o.uid, o.controller))
        .collect();
    assert_eq!(
        owners,
        [(
            "Node".to_string(),
            NODE.to_string(),
            "uid-of-node-a".to_string(),
            Some(true)
        )]
    );
    token.cancel();
    task.await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn an_unavailable_api_is_retried_with_growing_capped_delays_then_published() {
    let api = Arc::new(MemApi::default());
    api.lock().fail = 12;
    let (handle, token, task) = start(api.clone());
    let seq = handle.set_desired(one(&["gpu-0"])).unwrap();
    handle.wait_synced(seq).await;

    let lists = api.lock().lists.clone();
    assert_eq!(lists.len(), 13, "12 failed lists, then one that worked");
    let gaps: Vec<Duration> = lists.windows(2).map(|w| w[1] - w[0]).collect();
    let mut nominal = Duration::from_millis(500);
    for gap in &gaps {
        assert!(
            *gap >= nominal / 2 && *gap <= nominal,
            "gap {gap:?} for nominal {nominal:?}; all gaps {gaps:?}"
        );
        nominal = (nominal * 2).min(Duration::from_secs(30));
    }
    assert!(gaps.last().unwrap() >= &Duration::from_secs(15), "{gaps:?}");
    let c = handle.counters();
    assert_eq!((c.creates, c.errors), (1, 12));
    assert_eq!(api.lock().slices.len(), 1);
    let status = handle.status().borrow().clone();
    assert_eq!(status.last_error, None);
    assert_eq!(status.slices, 1);

    // A quiet hour later: not one more write or list.
    let lists_before = api.lock().lists.len();
    tokio::time::sleep(Duration::from_secs(3600)).await;
    assert_eq!(api.lock().lists.len(), lists_before);
    assert_eq!(api.lock().writes, 1);
    token.cancel();
    task.await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn dropping_every_handle_keeps_the_publisher_quietly_running() {
    let api = Arc::new(MemApi::default());
    let (handle, token, task) = start(api.clone());
    let seq = handle.set_desired(one(&["gpu-0"])).unwrap();
    handle.wait_synced(seq).await;
    drop(handle);
    tokio::time::sleep(Duration::from_secs(600)).await;
    assert!(!task.is_finished());
    assert_eq!(
        api.lock().lists.len(),
        1,
        "no busy loop on a closed channel"
    );
    token.cancel();
    task.await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_burst_of_desired_changes_costs_one_reconcile() {
    let api = Arc::new(MemApi::default());
    let (handle, token, task) = start(api.clone());
    let mut seq = 0;
    for n in 0..10 {
        seq = handle.set_desired(one(&[&format!("gpu-{n}")])).unwrap();
        // Let the publisher see each change (time stands still, so all within the settle time).
        tokio::task::yield_now().await;
    }
    handle.wait_synced(seq).await;
    assert_eq!(api.lock().lists.len(), 1);
    let only: Vec<String> = api
        .lock()
        .slices
        .values()
        .map(|s| s.spec.devices.as_ref().unwrap()[0].name.clone())
        .collect();
    assert_eq!(only, ["gpu-9"]);
    token.cancel();
    task.await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_desired_change_is_tried_at_once_even_during_a_long_backoff() {
    let api = Arc::new(MemApi::default());
    api.lock().fail = u32::MAX;
    let (handle, token, task) = start(api.clone());
    handle.set_desired(one(&["gpu-0"])).unwrap();
    // Ten minutes of outage: the retry delay is at its 30 s cap.
    tokio::time::sleep(Duration::from_secs(600)).await;
    let attempts = api.lock().lists.len();
    assert!(
        (20..=50).contains(&attempts),
        "{attempts} attempts in 10 minutes"
    );

    api.lock().fail = 0;
    let t = Instant::now();
    let seq = handle.set_desired(one(&["gpu-1"])).unwrap();
    handle.wait_synced(seq).await;
    assert!(
        t.elapsed() <= Options::default().settle,
        "{:?}",
        t.elapsed()
    );
    token.cancel();
    task.await.unwrap();
}
