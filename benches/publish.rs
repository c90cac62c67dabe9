//! How long the publisher takes to put a DGX A100's partitionable pool (`dgx-a100-mig`: every MIG
//! placement of 8 GPUs, 200 devices in 8 slices plus one shared-counters slice, as computed by
//! `dra::slices`) on an API server, from empty, after one slice is deleted by someone else, and
//! after a kubelet-style wipe; and what a no-change reconcile costs. KubeApi over HTTP against
//! the test API server on 127.0.0.1, and the directory API (`--api-dir`, whose watch polls every
//! `POLL_INTERVAL`) for the external delete. Median of several runs. (The tests only check that
//! a repair happens; how fast it happens is these figures.)
//!
//! Run: `cargo bench --bench publish`

#[path = "../tests/support/apiserver.rs"]
mod apiserver;

use apiserver::TestApiServer;
use k8s_openapi::api::resource::v1::{ResourceSlice, ResourceSliceSpec};
use kubelet_plugin::publisher::{Options, Publisher};
use nvdra::api::SliceApi;
use nvdra::api::dir::{DirApi, POLL_INTERVAL};
use nvdra::api::kube::KubeApi;
use nvdra::dra::slices::{ConsumableShares, CounterLayout, SliceOptions, desired_slices};
use nvdra::inventory::topology::load_profile;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

const DRIVER: &str = "gpu.nvidia.com";
const NODE: &str = "dgx-a100-0";
const RUNS: usize = 9;

/// What `nvdra run --partitionable` publishes for a DGX A100 with every GPU in MIG mode: every
/// placement of every profile, with per-GPU shared counters, in the 1.35 layout.
fn desired() -> Vec<ResourceSliceSpec> {
    let inv = load_profile("dgx-a100-mig", NODE).expect("built-in profile");
    desired_slices(
        &inv,
        &SliceOptions {
            driver: DRIVER.into(),
            node_name: NODE.into(),
            partitionable: true,
            shared_capacity: ConsumableShares::Disabled,
            dynamic_mig: false,
            mig_profiles: None,
            layout: CounterLayout::Separate,
        },
    )
    .expect("valid slices")
}

fn complete(slices: &[ResourceSlice], n: usize) -> bool {
    slices.len() == n
        && slices
            .iter()
            .all(|s| s.spec.pool.generation == slices[0].spec.pool.generation)
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1e3)
}

#[tokio::main]
async fn main() {
    let specs = desired();
    let n = specs.len();
    let devices: usize = specs
        .iter()
        .map(|s| s.devices.as_ref().map_or(0, Vec::len))
        .sum();
    let bytes: usize = specs
        .iter()
        .map(|s| serde_json::to_vec(s).unwrap().len())
        .sum();
    println!(
        "publish: {n} slices, {devices} devices, {:.0} KiB of JSON; {RUNS} runs",
        bytes as f64 / 1024.0
    );
    let desired = nvdra::dra::sync::pools(specs);

    let opts = Options {
        settle: Duration::ZERO,
        ..Options::default()
    };
    let (mut first, mut wipe, mut noop, mut one) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..RUNS {
        let server = TestApiServer::start().await;
        server.seed_node(NODE, "node-uid");
        let api = KubeApi::from_url(server.url()).expect("client");
        let (publisher, handle) =
            Publisher::with_options(Arc::new(api), DRIVER, NODE, opts.clone());
        let token = CancellationToken::new();
        let task = tokio::spawn(publisher.run(token.clone()));

        let t = Instant::now();
        let seq = handle.set_desired(desired.clone()).expect("our node");
        handle.wait_synced(seq).await;
        first.push(t.elapsed());
        assert!(complete(&server.slices(), n));

        // Let the echo of our own writes pass, then time a reconcile that writes nothing.
        tokio::time::sleep(Duration::from_millis(50)).await;
        let before = handle.counters();
        let t = Instant::now();
        let seq = handle.set_desired(desired.clone()).expect("our node");
        handle.wait_synced(seq).await;
        noop.push(t.elapsed());
        assert_eq!(
            handle.counters().writes(),
            before.writes(),
            "no writes when nothing changed"
        );

        let victim = server.slices()[0].metadata.name.clone().expect("named");
        let t = Instant::now();
        server.delete_slice(&victim);
        server
            .wait_for(Duration::from_secs(10), |s| complete(s, n))
            .await;
        one.push(t.elapsed());

        let t = Instant::now();
        for s in server.slices() {
            server.delete_slice(s.metadata.name.as_deref().unwrap());
        }
        server
            .wait_for(Duration::from_secs(10), |s| complete(s, n))
            .await;
        wipe.push(t.elapsed());

        token.cancel();
        task.await.expect("publisher task");
    }
    println!(
        "  first publish (empty → {n} slices): median {}",
        ms(median(first))
    );
    println!(
        "  no-change reconcile (list + compare): median {}",
        ms(median(noop))
    );
    println!(
        "  restore after one external delete:   median {}",
        ms(median(one))
    );
    println!(
        "  restore after a wipe of all slices:  median {}",
        ms(median(wipe))
    );

    let mut dir_one = Vec::new();
    for _ in 0..RUNS {
        let dir = tempfile::tempdir().expect("tempdir");
        let api = DirApi::new(dir.path()).expect("directory API");
        let (publisher, handle) =
            Publisher::with_options(Arc::new(api.clone()), DRIVER, NODE, Options::default());
        let token = CancellationToken::new();
        let task = tokio::spawn(publisher.run(token.clone()));
        let seq = handle.set_desired(desired.clone()).expect("our node");
        handle.wait_synced(seq).await;
        let slices = api.list_slices(DRIVER, NODE).await.expect("list");
        let victim = slices[0].metadata.name.clone().expect("named");

        let t = Instant::now();
        std::fs::remove_file(api.slices_dir().join(format!("{victim}.yaml"))).expect("remove");
        // Polled finer than `support::wait` polls: the poll period is this figure's resolution.
        loop {
            let now = api.list_slices(DRIVER, NODE).await.expect("list");
            if complete(&now, n) {
                break;
            }
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "the deleted slice file was not restored"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        dir_one.push(t.elapsed());
        token.cancel();
        task.await.expect("publisher task");
    }
    println!(
        "  directory API, restore after one file is deleted: median {} (watch polls every {})",
        ms(median(dir_one)),
        ms(POLL_INTERVAL)
    );
}
