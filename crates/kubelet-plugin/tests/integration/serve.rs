//! `serve` as a driver meets it, over its real socket: calls take turns (and, with a pod UID,
//! the node lock), a call runs to its end when the kubelet gives up on it, and a claim that is
//! replaced or not allocated never reaches the driver.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kubelet_plugin::testing::{KubeletClient, MemoryClaims, allocated_claim, allocated_device};
use kubelet_plugin::{
    BoxError, CancellationToken, Claim, Driver, Options, PrepareClaim, PrepareResults,
    PreparedDevice, UnprepareResults,
};
use tokio::sync::{Semaphore, mpsc};

const DRIVER: &str = "fpga.example.com";
const NODE: &str = "node-a";

/// A driver whose prepares wait for the test's permit, and say when they enter and leave.
struct Gated {
    permits: Semaphore,
    inside: AtomicUsize,
    most_inside: AtomicUsize,
    entered: mpsc::UnboundedSender<String>,
    left: mpsc::UnboundedSender<String>,
    /// Claims prepared, by UID: what the next call sees.
    prepared: Mutex<BTreeSet<String>>,
    /// Every claim UID that reached the driver.
    seen: Mutex<Vec<String>>,
    /// The node lock file, to look at while a call is inside.
    lock_file: Option<PathBuf>,
    lock_held: Mutex<Vec<bool>>,
}

impl Gated {
    fn new(
        lock_file: Option<PathBuf>,
    ) -> (
        Arc<Self>,
        mpsc::UnboundedReceiver<String>,
        mpsc::UnboundedReceiver<String>,
    ) {
        let (entered, entered_rx) = mpsc::unbounded_channel();
        let (left, left_rx) = mpsc::unbounded_channel();
        let d = Arc::new(Gated {
            permits: Semaphore::new(0),
            inside: AtomicUsize::new(0),
            most_inside: AtomicUsize::new(0),
            entered,
            left,
            prepared: Mutex::default(),
            seen: Mutex::default(),
            lock_file,
            lock_held: Mutex::default(),
        });
        (d, entered_rx, left_rx)
    }
}

impl Driver for Gated {
    async fn prepare(&self, claims: Vec<PrepareClaim>) -> Result<PrepareResults, BoxError> {
        let now = self.inside.fetch_add(1, Ordering::SeqCst) + 1;
        self.most_inside.fetch_max(now, Ordering::SeqCst);
        let uids: Vec<String> = claims.iter().map(|c| c.claim.uid.clone()).collect();
        self.seen.lock().unwrap().extend(uids.iter().cloned());
        if let Some(path) = &self.lock_file {
            // Another instance's view: can it take the node lock now?
            let f = std::fs::File::options().write(true).open(path)?;
            self.lock_held.lock().unwrap().push(f.try_lock().is_err());
        }
        self.entered.send(uids.join(",")).unwrap();
        self.permits.acquire().await?.forget();
        let mut results = Vec::new();
        for c in claims {
            let again = !self.prepared.lock().unwrap().insert(c.claim.uid.clone());
            let name = if again { "again" } else { "first" };
            let cdi = format!("k8s.{DRIVER}/claim={}-{name}", c.claim.uid);
            let devices = c
                .results
                .iter()
                .map(|r| {
                    PreparedDevice::new(
                        vec![r.request.clone()],
                        &r.pool,
                        &r.device,
                        vec![cdi.clone()],
                    )
                })
                .collect();
            results.push((c.claim.uid, Ok(devices)));
        }
        self.inside.fetch_sub(1, Ordering::SeqCst);
        self.left.send(uids.join(",")).unwrap();
        Ok(results)
    }

    async fn unprepare(&self, claims: Vec<Claim>) -> Result<UnprepareResults, BoxError> {
        Ok(claims.into_iter().map(|c| (c.uid, Ok(()))).collect())
    }
}

fn claims(uids: &[&str]) -> MemoryClaims {
    let claims = MemoryClaims::default();
    for uid in uids {
        claims.insert(allocated_claim(
            "ns",
            &format!("claim-{uid}"),
            uid,
            vec![allocated_device("fpga", DRIVER, NODE, "fpga-0")],
        ));
    }
    claims
}

fn claim(uid: &str) -> Claim {
    Claim::new("ns", format!("claim-{uid}"), uid)
}

/// Serves `driver` with `opts` under `root`; the DRA socket once it is there.
async fn start(
    driver: Arc<Gated>,
    opts: Options,
    root: &Path,
    stop: &CancellationToken,
) -> KubeletClient {
    let opts = opts.kubelet_root(root);
    let socket = opts.sockets().dra;
    tokio::spawn(kubelet_plugin::serve(driver, opts, stop.clone()));
    // The file appears at bind(2), a moment before listen(2): until then, connecting is refused.
    for _ in 0..1000 {
        if let Ok(client) = KubeletClient::connect(&socket).await {
            return client;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("{} never appeared", socket.display());
}

/// Four prepares at once, each waiting inside the driver for a permit: how many were ever
/// inside together, once all four are done.
async fn four_at_once(serialize: bool) -> usize {
    let root = tempfile::tempdir().unwrap();
    let stop = CancellationToken::new();
    let uids = ["a", "b", "c", "d"];
    let (driver, mut entered, mut left) = Gated::new(None);
    let opts = Options::new(DRIVER, NODE, claims(&uids))
        .unwrap()
        .serialize(serialize);
    let client = start(driver.clone(), opts, root.path(), &stop).await;
    let calls: Vec<_> = uids
        .iter()
        .map(|u| {
            let mut client = client.clone();
            let c = claim(u);
            tokio::spawn(async move { client.prepare(&[c]).await.unwrap() })
        })
        .collect();
    entered.recv().await.unwrap();
    for _ in 0..uids.len() {
        driver.permits.add_permits(1);
        left.recv().await.unwrap();
    }
    for call in calls {
        let answers = call.await.unwrap();
        assert!(answers.values().all(Result::is_ok), "{answers:?}");
    }
    stop.cancel();
    driver.most_inside.load(Ordering::SeqCst)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn four_concurrent_prepares_reach_the_driver_one_at_a_time() {
    assert_eq!(four_at_once(true).await, 1);
}

/// The control: the same four calls, with serialization off, are inside together, so the test
/// above would see it if serialization failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn without_serialization_the_four_prepares_run_together() {
    let root = tempfile::tempdir().unwrap();
    let stop = CancellationToken::new();
    let uids = ["a", "b", "c", "d"];
    let (driver, mut entered, _left) = Gated::new(None);
    let opts = Options::new(DRIVER, NODE, claims(&uids))
        .unwrap()
        .serialize(false);
    let client = start(driver.clone(), opts, root.path(), &stop).await;
    for u in uids {
        let (mut client, c) = (client.clone(), claim(u));
        tokio::spawn(async move { client.prepare(&[c]).await });
    }
    for _ in 0..uids.len() {
        entered.recv().await.unwrap();
    }
    assert_eq!(driver.inside.load(Ordering::SeqCst), 4);
    driver.permits.add_permits(4);
    stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_prepare_whose_caller_gave_up_finishes_and_the_next_call_sees_it() {
    let root = tempfile::tempdir().unwrap();
    let stop = CancellationToken::new();
    let (driver, mut entered, mut left) = Gated::new(None);
    let opts = Options::new(DRIVER, NODE, claims(&["a"])).unwrap();
    let client = start(driver.clone(), opts, root.path(), &stop).await;
    // The kubelet's call, with its deadline: it passes while the driver works.
    let mut gives_up = KubeletClient::connect(&client_socket(root.path()))
        .await
        .unwrap()
        .with_deadline(Duration::from_millis(100));
    let call = tokio::spawn(async move { gives_up.prepare(&[claim("a")]).await });
    assert_eq!(entered.recv().await.unwrap(), "a");
    let status = call.await.unwrap().unwrap_err();
    // The client's own timer or the server's answer, whichever comes first.
    assert!(
        matches!(
            status.code(),
            tonic::Code::DeadlineExceeded | tonic::Code::Cancelled
        ),
        "{status:?}"
    );
    driver.permits.add_permits(1);
    let left = tokio::time::timeout(Duration::from_secs(10), left.recv()).await;
    assert_eq!(
        left.expect("the driver's prepare was dropped at the kubelet's deadline"),
        Some("a".to_string()),
        "the call ran to its end"
    );
    // The retry finds the claim prepared by the call nobody waited for.
    driver.permits.add_permits(1);
    let answers = client.clone().prepare(&[claim("a")]).await.unwrap();
    assert_eq!(
        answers["a"],
        Ok(vec![format!("k8s.{DRIVER}/claim=a-again")])
    );
    stop.cancel();
}

fn client_socket(root: &Path) -> PathBuf {
    kubelet_plugin::paths::plugin_dir(root, DRIVER).join("dra.sock")
}

#[tokio::test]
async fn a_replaced_or_unallocated_claim_is_refused_before_the_driver_sees_it() {
    let root = tempfile::tempdir().unwrap();
    let stop = CancellationToken::new();
    let source = claims(&["good"]);
    // "claim-old-uid" was deleted and re-created: the API server has another UID under its name.
    let mut replaced = allocated_claim("ns", "claim-old-uid", "new-uid", vec![]);
    replaced.metadata.name = Some("claim-old-uid".into());
    source.insert(replaced);
    let mut pending = allocated_claim("ns", "claim-pending", "pending", vec![]);
    pending.status = None;
    source.insert(pending);
    let (driver, _entered, _left) = Gated::new(None);
    driver.permits.add_permits(10);
    let opts = Options::new(DRIVER, NODE, source).unwrap();
    let mut client = start(driver.clone(), opts, root.path(), &stop).await;
    let answers = client
        .prepare(&[claim("good"), claim("old-uid"), claim("pending")])
        .await
        .unwrap();
    assert_eq!(*driver.seen.lock().unwrap(), vec!["good".to_string()]);
    assert_eq!(
        answers["good"],
        Ok(vec![format!("k8s.{DRIVER}/claim=good-first")])
    );
    let replaced = answers["old-uid"].as_ref().unwrap_err();
    assert!(
        replaced.contains("now has UID new-uid, not old-uid: it was deleted and re-created"),
        "{replaced}"
    );
    let pending = answers["pending"].as_ref().unwrap_err();
    assert!(
        pending.contains("ns/claim-pending is not allocated"),
        "{pending}"
    );
    stop.cancel();
}

/// With a pod UID (a rolling update), a call holds `<plugin dir>/serialize.lock` while the
/// driver works, so the other instance's calls wait for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_pod_uid_the_driver_works_under_the_node_lock() {
    let root = tempfile::tempdir().unwrap();
    let stop = CancellationToken::new();
    let lock = kubelet_plugin::paths::plugin_dir(root.path(), DRIVER)
        .join(kubelet_plugin::nodelock::FILE_NAME);
    let (driver, mut entered, mut left) = Gated::new(Some(lock.clone()));
    let opts = Options::new(DRIVER, NODE, claims(&["a"]))
        .unwrap()
        .pod_uid("0f2d5a3c-1234-4bcd-9876-0123456789ab");
    let mut client = start(driver.clone(), opts, root.path(), &stop).await;
    let call = tokio::spawn(async move { client.prepare(&[claim("a")]).await.unwrap() });
    entered.recv().await.unwrap();
    driver.permits.add_permits(1);
    left.recv().await.unwrap();
    assert!(call.await.unwrap()["a"].is_ok());
    assert_eq!(*driver.lock_held.lock().unwrap(), vec![true]);
    // Released after the call: the other instance can take it now.
    let f = std::fs::File::options().write(true).open(&lock).unwrap();
    f.try_lock().expect("the lock is free between calls");
    stop.cancel();
}
