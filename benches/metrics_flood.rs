//! What a flood of the metrics port costs a prepare: the real `nvdra run` binary (the one
//! `cargo bench` builds, release profile) on a simulated DGX H100 with the directory API,
//! one-claim prepares and unprepares on its DRA socket, in rounds alternating without and with
//! a flood (`tests/support/flood.rs`: [`SHAPE`]'s silent connections, connections sending a
//! head a byte at a time, and scrapes back to back, each reopened when the server closes it),
//! so that both see the same disk. The flood runs in this process, on the same machine: its
//! CPU is the daemon's too. Reported: prepare and unprepare p50/p99 with and without, the
//! kubelet's probe (`/healthz`, its 1 s timeout) answered and its p50/p99 during the flood,
//! and the daemon's file descriptors at rest, at most during the flood, and after it.
//!
//! Run: `cargo bench --bench metrics_flood` (`FLOOD_BINS="old/nvdra new/nvdra"` measures each
//! of those binaries in turn instead of the one the bench builds; `FLOOD_CYCLES=N` per round).

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use kubelet_plugin::proto::dra::v1;
use kubelet_plugin::proto::dra::v1::dra_plugin_client::DraPluginClient;

#[path = "../tests/support/daemon.rs"]
mod daemon;
#[path = "../tests/support/flood.rs"]
mod flood;
#[path = "../crates/kubelet-plugin/tests/support/wait.rs"]
mod wait;

const NODE: &str = "flood-node";
const DRIVER: &str = "gpu.nvidia.com";
const NAMESPACE: &str = "flood";
const GPUS: usize = 8;
const ROUNDS: usize = 4;
const SHAPE: flood::Shape = flood::Shape {
    idle: 300,
    slow: 100,
    scrapers: 8,
};
/// The kubelet's default probe timeout.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

type Client = DraPluginClient<tonic::transport::Channel>;

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn p50_p99(mut t: Vec<Duration>) -> String {
    t.sort();
    format!(
        "p50 {:>8.3?}  p99 {:>8.3?}  (n={})",
        percentile(&t, 0.5),
        percentile(&t, 0.99),
        t.len()
    )
}

/// Prepares and unprepares one fresh claim; both must succeed. Their times.
async fn cycle(dra: &mut Client, root: &Path, i: usize) -> (Duration, Duration) {
    let name = format!("c{i}");
    let uid = format!("00000000-0000-4000-8000-{i:012}");
    let claim = nvdra::api::allocated_claim(
        NAMESPACE,
        &name,
        &uid,
        vec![nvdra::api::allocated_device(
            "gpu",
            DRIVER,
            NODE,
            &format!("gpu-{}", i % GPUS),
        )],
        Vec::new(),
    );
    let api = root.join("api");
    nvdra::api::dir::write_claim(&api, &claim).expect("write claim");
    let claims = vec![v1::Claim {
        namespace: NAMESPACE.into(),
        uid: uid.clone(),
        name: name.clone(),
    }];
    let s = Instant::now();
    let r = dra
        .node_prepare_resources(v1::NodePrepareResourcesRequest {
            claims: claims.clone(),
        })
        .await
        .expect("NodePrepareResources")
        .into_inner();
    let prepare = s.elapsed();
    assert!(r.claims[&uid].error.is_empty(), "{}", r.claims[&uid].error);
    let s = Instant::now();
    let r = dra
        .node_unprepare_resources(v1::NodeUnprepareResourcesRequest { claims })
        .await
        .expect("NodeUnprepareResources")
        .into_inner();
    let unprepare = s.elapsed();
    assert!(r.claims[&uid].error.is_empty(), "{}", r.claims[&uid].error);
    let _ = std::fs::remove_file(nvdra::api::dir::claim_path(&api, NAMESPACE, &name));
    (prepare, unprepare)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let cycles: usize = std::env::var("FLOOD_CYCLES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100);
    let bins: Vec<PathBuf> = match std::env::var("FLOOD_BINS") {
        Ok(list) => list.split_whitespace().map(PathBuf::from).collect(),
        Err(_) => vec![PathBuf::from(env!("CARGO_BIN_EXE_nvdra"))],
    };
    for bin in &bins {
        println!("{}", bin.display());
        measure(bin, cycles).await;
    }
}

async fn measure(bin: &Path, cycles: usize) {
    let dir = tempfile::tempdir().expect("tempdir");
    let root = dir.path();
    // `/metrics` on `127.0.0.1:0` (the sandbox's): the port the kernel gave, read back.
    let mut run = daemon::nvdra_run_of(bin, root, "dra", NODE);
    run.args(["--profile", "dgx-h100"]);
    let dra_socket = root.join("kubelet/plugins").join(DRIVER).join("dra.sock");
    let (daemon, addr, mut dra) = flood::serving(run, &dra_socket).await;
    let pid = daemon.0.id();
    let mut i = 0;
    for _ in 0..20 {
        cycle(&mut dra, root, i).await;
        i += 1;
    }
    let _ = flood::get(addr, "/metrics").await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let rest = flood::fds(pid);

    let (mut quiet_p, mut quiet_u, mut flood_p, mut flood_u) = (vec![], vec![], vec![], vec![]);
    let (mut probes, mut probes_ok, mut probe_times) = (0, 0, vec![]);
    let mut most = rest;
    let mut summaries = Vec::new();
    for _ in 0..ROUNDS {
        for _ in 0..cycles {
            let (p, u) = cycle(&mut dra, root, i).await;
            i += 1;
            quiet_p.push(p);
            quiet_u.push(u);
        }
        let f = flood::Flood::start(addr, SHAPE);
        // Under way: every connection of the flood opened at least once.
        let total = (SHAPE.idle + SHAPE.slow) as u64;
        wait::until("the flood to be under way", wait::SOON, || {
            std::future::ready((f.counts.opened.load(Ordering::Relaxed) >= total).then_some(()))
        })
        .await;
        for c in 0..cycles {
            let (p, u) = cycle(&mut dra, root, i).await;
            i += 1;
            flood_p.push(p);
            flood_u.push(u);
            most = most.max(flood::fds(pid));
            if c % 5 == 0 {
                probes += 1;
                let s = Instant::now();
                if flood::probe(addr, "/healthz", PROBE_TIMEOUT)
                    .await
                    .is_some_and(|l| l.starts_with("HTTP/1.1 200"))
                {
                    probes_ok += 1;
                    probe_times.push(s.elapsed());
                }
            }
        }
        summaries.push(f.stop().await.summary());
        wait::until(
            "the daemon to close the flood's sockets",
            wait::SOON,
            || std::future::ready((flood::fds(pid) <= rest).then_some(())),
        )
        .await;
    }
    // After the last flood ended and its sockets went: back at rest?
    let after = flood::fds(pid);

    println!(
        "metrics_flood: nvdra run, dgx-h100 (8 simulated GPUs), directory API, one-claim \
         prepare + unprepare; {ROUNDS} rounds of {cycles} cycles without, then {cycles} with a \
         flood of {} silent + {} slow connections + {} back-to-back scrapers (flood client on \
         the same machine)",
        SHAPE.idle, SHAPE.slow, SHAPE.scrapers
    );
    println!("  prepare,   no flood: {}", p50_p99(quiet_p.clone()));
    println!("  prepare,   flood:    {}", p50_p99(flood_p.clone()));
    println!("  unprepare, no flood: {}", p50_p99(quiet_u));
    println!("  unprepare, flood:    {}", p50_p99(flood_u));
    quiet_p.sort();
    flood_p.sort();
    println!(
        "  prepare p50 flood / no flood: {:.2}x",
        percentile(&flood_p, 0.5).as_secs_f64() / percentile(&quiet_p, 0.5).as_secs_f64()
    );
    let probe_line = if probe_times.is_empty() {
        String::new()
    } else {
        format!(", {}", p50_p99(probe_times))
    };
    println!("  /healthz during the flood: {probes_ok}/{probes} answered within 1 s{probe_line}");
    println!(
        "  daemon file descriptors: {rest} at rest, at most {most} during the floods, {after} after"
    );
    for (n, s) in summaries.iter().enumerate() {
        println!("  flood round {}: {s}", n + 1);
    }
}
