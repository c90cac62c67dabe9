//! A flood of the metrics port against `nvdra run` (the real binary, a simulated DGX H100, the
//! directory API): hundreds of connections that send nothing or a request head a byte at a
//! time, and scrapes back to back, while prepares run through the kubelet's DRA socket. Every
//! prepare completes, the kubelet's probe is answered, the daemon never holds more sockets than
//! its connection cap allows, and once the flood ends its descriptors are back where they were.
//! (What the flood costs a prepare is measured in `benches/metrics_flood.rs`.)

use std::path::Path;
use std::time::Duration;

use kubelet_plugin::proto::dra::v1;
use kubelet_plugin::proto::dra::v1::dra_plugin_client::DraPluginClient;

use crate::support::{daemon, flood, wait};

const NODE: &str = "flood-node";
const DRIVER: &str = "gpu.nvidia.com";
const NAMESPACE: &str = "flood";
const GPUS: usize = 8;
const CYCLES: usize = 20;
/// Descriptors a prepare may hold open for a moment besides the listener's (checkpoint and
/// spec files and their directories, a claim read), and the one accepted socket waiting for a
/// place.
const TRANSIENT_FDS: usize = 16;

fn write_claim(root: &Path, name: &str, uid: &str, device: &str) {
    let claim = nvdra::api::allocated_claim(
        NAMESPACE,
        name,
        uid,
        vec![nvdra::api::allocated_device("gpu", DRIVER, NODE, device)],
        Vec::new(),
    );
    nvdra::api::dir::write_claim(&root.join("api"), &claim).expect("write claim");
}

/// One claim per GPU for `cycle`, prepared and unprepared; each must succeed.
async fn cycle(dra: &mut DraPluginClient<tonic::transport::Channel>, root: &Path, cycle: usize) {
    let claims: Vec<v1::Claim> = (0..GPUS)
        .map(|gpu| {
            let name = format!("c{cycle}-{gpu}");
            let uid = format!("00000000-0000-4000-8000-{cycle:08}{gpu:04}");
            write_claim(root, &name, &uid, &format!("gpu-{gpu}"));
            v1::Claim {
                namespace: NAMESPACE.into(),
                uid,
                name,
            }
        })
        .collect();
    let prepared = dra
        .node_prepare_resources(v1::NodePrepareResourcesRequest {
            claims: claims.clone(),
        })
        .await
        .expect("NodePrepareResources")
        .into_inner();
    assert_eq!(prepared.claims.len(), GPUS);
    for (uid, r) in &prepared.claims {
        assert!(r.error.is_empty(), "prepare {uid}: {}", r.error);
        assert_eq!(r.devices.len(), 1, "prepare {uid}");
    }
    let unprepared = dra
        .node_unprepare_resources(v1::NodeUnprepareResourcesRequest { claims })
        .await
        .expect("NodeUnprepareResources")
        .into_inner();
    for (uid, r) in &unprepared.claims {
        assert!(r.error.is_empty(), "unprepare {uid}: {}", r.error);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_the_metrics_port_stalls_no_prepare_and_leaks_no_descriptor() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    // `/metrics` on `127.0.0.1:0` (the sandbox's): the port the kernel gave, read back.
    let mut run = daemon::nvdra_run(root, "dra", NODE);
    run.args(["--profile", "dgx-h100"]);
    let dra_socket = root.join("kubelet/plugins").join(DRIVER).join("dra.sock");
    let (daemon, addr, mut dra) = flood::serving(run, &dra_socket).await;
    let pid = daemon.0.id();
    // Warm: a cycle and a scrape, so that what stays open after them is in the baseline.
    cycle(&mut dra, root, 0).await;
    assert!(
        flood::get(addr, "/metrics")
            .await
            .is_some_and(|r| r.starts_with("HTTP/1.1 200"))
    );
    // The most seen at rest (a transient file of the last step may still be open).
    let mut baseline = 0;
    for _ in 0..5 {
        baseline = baseline.max(flood::fds(pid));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let flood = flood::Flood::start(
        addr,
        flood::Shape {
            idle: 120,
            slow: 40,
            scrapers: 2,
        },
    );
    // The flood is on: far more connections than places, so the server closes them for room.
    wait::until(
        "the server to close flood connections for room",
        wait::SOON,
        || {
            let closed = flood
                .counts
                .closed_by_server
                .load(std::sync::atomic::Ordering::Relaxed);
            std::future::ready((closed >= 200).then_some(()))
        },
    )
    .await;
    let cap = nvdra::metrics::server::MAX_CONNECTIONS;
    let mut most = 0;
    for c in 1..=CYCLES {
        cycle(&mut dra, root, c).await;
        most = most.max(flood::fds(pid));
        // The kubelet's probe gets through the flood (retried like a probe: each try has the
        // kubelet's 1 s probe timeout; the deadline bounds a failure, not a speed).
        wait::until(
            "/healthz to answer during the flood",
            wait::SOON,
            || async {
                flood::probe(addr, "/healthz", Duration::from_secs(1))
                    .await
                    .filter(|s| s.starts_with("HTTP/1.1 200"))
            },
        )
        .await;
        most = most.max(flood::fds(pid));
    }
    let counts = flood.stop().await;
    eprintln!("flood: {}", counts.summary());
    assert!(
        most <= baseline + cap + TRANSIENT_FDS,
        "the daemon held {most} descriptors during the flood, {baseline} at rest: more than its \
         {cap} connections account for"
    );
    // Everything the flood made the daemon open is closed again.
    wait::eventually(
        "the daemon's descriptors to go back to the baseline",
        || flood::fds(pid) <= baseline,
    )
    .await;
    // And it still serves.
    cycle(&mut dra, root, CYCLES + 1).await;
    assert!(
        flood::get(addr, "/metrics")
            .await
            .is_some_and(|r| r.starts_with("HTTP/1.1 200"))
    );
}
