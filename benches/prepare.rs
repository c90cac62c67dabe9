//! Prepare/unprepare through the kubelet's gRPC API, beside the floors it cannot beat, all
//! measured in the same run on the same machine:
//!
//! - the empty `NodePrepareResources` round trip on the same Unix socket (gRPC + tonic);
//! - one ResourceClaim GET from the API the plugin uses;
//! - one fsync'd atomic file write (what a durable checkpoint update costs).
//!
//! A shared disk's fsync time drifts by several times within a minute, so the write floor is also
//! sampled between the sequential prepares, and the ratio of prepare p50 to the sum of the floors'
//! p50s uses that interleaved sample.
//!
//! Workloads: sequential one-GPU claims (p50/p99 of prepare, unprepare, and both), and 64 claims
//! prepared concurrently as 64 separate RPCs (like 64 pods starting at once), reporting wall
//! time, claims per second and how many checkpoint writes group commit needed.
//!
//! Shares of a GPU (`--shared-capacity`, allocations of `gpu-<minor>` consuming 2Gi of memory):
//! a share prepared while another share of its GPU keeps the GPU's MPS daemon running,
//! interleaved with whole-GPU prepares in one loop so that both see the same disk (goal: share
//! p50 <= 1.2x whole-GPU p50); and, reported apart, a GPU's first share, whose prepare starts the
//! daemon. The daemons are the stand-in `nvidia-cuda-mps-control` (`nvdra mps-standin`), run by
//! `nvdra mps-host` as on a node: the first-share figure includes the host noticing the request
//! (it scans every 200 ms) and the daemon answering, not a real daemon's start-up.
//!
//! The node is a DGX A100 profile widened to 64 GPUs, simulated, read through the inventory
//! owner as `nvdra run` reads it. Run with
//! `cargo bench --bench prepare`.

#[path = "../tests/support/apiserver.rs"]
mod apiserver;

/// The API the plugin reads claims from: the test API server over HTTP through the real
/// `KubeApi` client (no client-side rate limit), as a kubelet plugin in a cluster would.
mod bench_api {
    use std::sync::Arc;

    use nvdra::api::ClusterApi;
    use nvdra::api::kube::KubeApi;

    use super::apiserver::TestApiServer;

    pub struct BenchApi {
        server: TestApiServer,
        client: Arc<KubeApi>,
        node: String,
        driver: String,
        /// Shares seeded so far: each gets its own shareID.
        shares: std::sync::atomic::AtomicU64,
    }

    pub async fn start(node: &str, driver: &str) -> BenchApi {
        let server = TestApiServer::start().await;
        let client = Arc::new(KubeApi::from_url(server.url()).expect("client"));
        BenchApi {
            server,
            client,
            node: node.into(),
            driver: driver.into(),
            shares: Default::default(),
        }
    }

    impl BenchApi {
        pub fn describe(&self) -> String {
            format!("test API server at {} via KubeApi", self.server.url())
        }
        pub fn cluster_api(&self) -> Arc<dyn ClusterApi> {
            self.client.clone()
        }
        pub async fn add_claim(&self, uid: &str, device: &str) {
            self.server.seed_claim(nvdra::api::allocated_claim(
                "default",
                &format!("claim-{uid}"),
                uid,
                vec![nvdra::api::allocated_device(
                    "gpu",
                    &self.driver,
                    &self.node,
                    device,
                )],
                vec![],
            ));
        }
        /// A share of `device` (`gpu-<minor>`, `--shared-capacity`) as the scheduler allocates
        /// one: a shareID and the consumed capacity.
        pub async fn add_share(&self, uid: &str, device: &str, memory: &str, sms: &str) {
            use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
            let mut result =
                nvdra::api::allocated_device("share", &self.driver, &self.node, device);
            let n = self
                .shares
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            result.share_id = Some(format!("5f0e0000-0000-4000-8000-{n:012}"));
            result.consumed_capacity = Some(
                [
                    ("memory".to_string(), Quantity(memory.into())),
                    ("multiprocessors".to_string(), Quantity(sms.into())),
                ]
                .into(),
            );
            self.server.seed_claim(nvdra::api::allocated_claim(
                "default",
                &format!("claim-{uid}"),
                uid,
                vec![result],
                vec![],
            ));
        }
        pub async fn stop(self) {}
    }
}

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kubelet_plugin::proto::dra::v1;
use nvdra::dra::plugin::{self, Plugin};
use nvdra::inventory::owner;
use nvdra::inventory::sim::SimBackend;
use nvdra::inventory::{GpuUuid, Inventory, PciBusId, topology};
use nvdra::ledger;
use nvdra::metrics::Metrics;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

const DRIVER: &str = "gpu.nvidia.com";
const NODE: &str = "bench-node";
const GPUS: u32 = 64;
const SEQ_RUNS: usize = 300;
const FLOOR_RUNS: usize = 500;
const BURSTS: usize = 10;
/// First shares of a GPU (each starts the GPU's daemon; its unprepare stops it again).
const FIRST_SHARE_RUNS: usize = 100;
/// The GPU whose shares the benchmark prepares, and the one its first shares go to.
const SHARED_GPU: u32 = 0;
const FIRST_SHARE_GPU: u32 = 1;

/// The stand-in MPS (`nvdra mps-standin`, real processes) under the driver root and
/// `nvdra mps-host` running its daemons, as on a node: a share's prepare waits until its GPU's
/// daemon answers. The host is killed with the returned child (its daemons die with it).
fn mps_host(root: &Path) -> std::process::Child {
    use std::os::unix::fs::PermissionsExt;
    let bin = root.join("driver/usr/bin");
    std::fs::create_dir_all(&bin).expect("driver root");
    let path = bin.join("nvidia-cuda-mps-control");
    std::fs::write(
        &path,
        format!(
            "#!/bin/sh\nexec '{}' mps-standin \"$@\"\n",
            env!("CARGO_BIN_EXE_nvdra")
        ),
    )
    .expect("write the stand-in MPS control");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    std::fs::write(root.join("boot_id"), "bench\n").expect("boot id");
    std::process::Command::new(env!("CARGO_BIN_EXE_nvdra"))
        .arg("mps-host")
        .arg("--mps-root")
        .arg(root.join("mps"))
        .arg("--driver-root")
        .arg(root.join("driver"))
        .env("NVDRA_BOOT_ID_FILE", root.join("boot_id"))
        .env("NVDRA_LOG", "warn")
        .spawn()
        .expect("nvdra mps-host")
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

/// Prints p50 and p99; returns p50.
fn report(label: &str, mut times: Vec<Duration>) -> Duration {
    times.sort();
    let p50 = percentile(&times, 0.5);
    println!(
        "{label:<44} p50 {:>10.3?}  p99 {:>10.3?}  (n={})",
        p50,
        percentile(&times, 0.99),
        times.len()
    );
    p50
}

/// The DGX A100 profile with its 8 GPUs repeated to `GPUS`.
fn wide_inventory() -> Inventory {
    let base = topology::load_profile("dgx-a100", NODE).expect("built-in profile");
    let mut gpus = Vec::new();
    for i in 0..GPUS {
        let mut g = base.gpus[(i % 8) as usize].clone();
        g.index = i;
        g.minor = i;
        g.uuid = GpuUuid(format!("GPU-bench-{i:04}"));
        g.pci_bus_id = PciBusId(format!("0000:{:02x}:00.0", i + 1));
        g.nvlink_peers.clear();
        gpus.push(g);
    }
    Inventory::new(gpus).expect("valid inventory")
}

async fn unix_channel(path: &Path) -> Channel {
    kubelet_plugin::socket::connect(path)
        .await
        .expect("connect to the socket")
}

fn claim_ref(uid: &str) -> v1::Claim {
    v1::Claim {
        namespace: "default".into(),
        uid: uid.into(),
        name: format!("claim-{uid}"),
    }
}

type Client = v1::dra_plugin_client::DraPluginClient<Channel>;

/// Prepares one claim, which must succeed; the call's time.
async fn prepare_ok(client: &mut Client, uid: &str) -> Duration {
    let s = Instant::now();
    let r = client
        .node_prepare_resources(v1::NodePrepareResourcesRequest {
            claims: vec![claim_ref(uid)],
        })
        .await
        .expect("prepare")
        .into_inner();
    let t = s.elapsed();
    assert_eq!(r.claims[uid].error, "", "{uid}");
    t
}

/// Unprepares one claim, which must succeed; the call's time.
async fn unprepare_ok(client: &mut Client, uid: &str) -> Duration {
    let s = Instant::now();
    let r = client
        .node_unprepare_resources(v1::NodeUnprepareResourcesRequest {
            claims: vec![claim_ref(uid)],
        })
        .await
        .expect("unprepare")
        .into_inner();
    let t = s.elapsed();
    assert_eq!(r.claims[uid].error, "", "{uid}");
    t
}

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut host = mps_host(dir.path());
    let api = bench_api::start(NODE, DRIVER).await;
    let inv = wide_inventory();
    let sim = SimBackend::new(inv);
    let stop = CancellationToken::new();
    // Prepare reads the inventory owner's publication, as in `nvdra run`.
    let (mut owner, inventory) = owner::Owner::new(
        Arc::new(sim.clone()),
        Duration::from_secs(3600),
        owner::DEADLINE,
    )
    .expect("owner");
    owner.read().await.expect("first inventory read");
    tokio::spawn(owner.run(nvdra::testing::no_health(), stop.clone()));
    // A node with the driver installed: its files are found once, at start, and every spec
    // mounts them. (Without any, each prepare would look for them again, as on a node whose
    // driver container is not up yet: about 140 failed lookups per claim.)
    let libs = dir.path().join("driver/usr/lib/x86_64-linux-gnu");
    std::fs::create_dir_all(&libs).expect("driver library directory");
    for lib in [
        "libcuda.so",
        "libnvidia-ml.so",
        "libnvidia-ptxjitcompiler.so",
    ] {
        std::fs::write(libs.join(format!("{lib}.570.124.06")), lib).expect("driver library");
    }
    let (plugin, writer, _) = Plugin::new(
        plugin::Options {
            driver: DRIVER.into(),
            pool: NODE.into(),
            plugin_dir: dir.path().join("plugin"),
            cdi_root: dir.path().join("cdi"),
            driver_root: nvdra::cdi::DriverRoot::at(&dir.path().join("driver")),
            boot_id: "bench".into(),
            partitionable: false,
            shared_capacity: nvdra::dra::slices::ConsumableShares::Memory,
            mps_root: dir.path().join("mps"),
            dynamic_mig: false,
            keep_mig_on: false,
            share_trust_domain: Default::default(),
            proc_root: None,
            claim_status: false,
        },
        api.cluster_api(),
        owner::Writes::new(Arc::new(sim), inventory.clone()),
        Metrics::new(),
        None,
    )
    .expect("plugin");
    tokio::spawn(writer.run(stop.clone()));
    plugin.recover().await.expect("recover");
    // Served as the daemon serves it: through the library, which reads the claims, with
    // nvdra's own ordering of calls.
    let claims: Arc<dyn nvdra::api::ClaimReader> = api.cluster_api();
    let (_node, published) = tokio::sync::watch::channel(nvdra::inventory::owner::Published {
        node: Some(Arc::new(wide_inventory())),
        ..Default::default()
    });
    let health = nvdra::dra::health::NodeHealth::new(published, NODE);
    let opts = kubelet_plugin::Options::new(DRIVER, NODE, claims)
        .expect("names")
        .kubelet_root(dir.path().join("kubelet"))
        .serialize(false)
        .health(Arc::new(health));
    let socket = opts.sockets().dra;
    tokio::spawn(kubelet_plugin::serve(
        Arc::new(plugin.clone()),
        opts,
        stop.clone(),
    ));
    while !socket.exists() {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let mut client = v1::dra_plugin_client::DraPluginClient::new(unix_channel(&socket).await);

    println!(
        "nvdra prepare benchmark: {GPUS} simulated A100 GPUs, API: {}, files in {}",
        api.describe(),
        dir.path().display()
    );

    // Floors.
    let mut t = Vec::new();
    for _ in 0..FLOOR_RUNS {
        let s = Instant::now();
        client
            .node_prepare_resources(v1::NodePrepareResourcesRequest { claims: vec![] })
            .await
            .expect("empty prepare");
        t.push(s.elapsed());
    }
    let grpc_floor = report("floor: empty gRPC prepare round trip", t);

    api.add_claim("floor", "gpu-0").await;
    let cluster = api.cluster_api();
    let mut t = Vec::new();
    for _ in 0..FLOOR_RUNS {
        let s = Instant::now();
        cluster
            .get_claim("default", "claim-floor")
            .await
            .expect("claim GET");
        t.push(s.elapsed());
    }
    let get_floor = report("floor: one claim GET", t);

    let cp_path = dir.path().join("floor-checkpoint.json");
    let mut cp = ledger::Checkpoint::empty("bench");
    cp.claims.insert(
        nvdra::ids::ClaimUid::parse("x").expect("a valid UID"),
        ledger::ClaimEntry {
            state: ledger::ClaimState::PrepareCompleted,
            namespace: "default".into(),
            name: "x".into(),
            devices: vec![],
            pods: vec![],
            user: None,
            trust_label: None,
        },
    );
    let mut t = Vec::new();
    for _ in 0..FLOOR_RUNS / 5 {
        let s = Instant::now();
        ledger::write_file(&cp_path, &cp).expect("write");
        t.push(s.elapsed());
    }
    report("floor: one fsync'd atomic file write", t);

    // Sequential one-GPU claims.
    for i in 0..SEQ_RUNS {
        api.add_claim(&format!("seq-{i}"), &format!("gpu-{}", i as u32 % GPUS))
            .await;
    }
    let (mut prep, mut unprep, mut both) = (Vec::new(), Vec::new(), Vec::new());
    let mut writes = Vec::new();
    for i in 0..SEQ_RUNS {
        let s = Instant::now();
        ledger::write_file(&cp_path, &cp).expect("write");
        writes.push(s.elapsed());
        let uid = format!("seq-{i}");
        let s = Instant::now();
        let r = client
            .node_prepare_resources(v1::NodePrepareResourcesRequest {
                claims: vec![claim_ref(&uid)],
            })
            .await
            .expect("prepare")
            .into_inner();
        let p = s.elapsed();
        assert_eq!(r.claims[&uid].error, "", "{uid}");
        let s2 = Instant::now();
        let r = client
            .node_unprepare_resources(v1::NodeUnprepareResourcesRequest {
                claims: vec![claim_ref(&uid)],
            })
            .await
            .expect("unprepare")
            .into_inner();
        let u = s2.elapsed();
        assert_eq!(r.claims[&uid].error, "", "{uid}");
        prep.push(p);
        unprep.push(u);
        both.push(p + u);
    }
    let write_floor = report("floor: fsync'd write, between the prepares", writes);
    let prepare = report("1-GPU claim: prepare", prep);
    report("1-GPU claim: unprepare", unprep);
    report("1-GPU claim: prepare + unprepare", both);
    let floors = grpc_floor + get_floor + write_floor;
    println!(
        "1-GPU prepare p50 / sum of floor p50s ({floors:.3?}): {:.2}x (goal <= 1.5x)",
        prepare.as_secs_f64() / floors.as_secs_f64()
    );

    // Shares of one GPU beside whole GPUs, interleaved. A share held throughout keeps the GPU's
    // daemon running, as on a node where the GPU is already shared.
    let shared = format!("gpu-{SHARED_GPU}");
    api.add_share("anchor", &shared, "2Gi", "0").await;
    prepare_ok(&mut client, "anchor").await;
    let whole_gpus: Vec<u32> = (0..GPUS)
        .filter(|g| ![SHARED_GPU, FIRST_SHARE_GPU].contains(g))
        .collect();
    for i in 0..SEQ_RUNS {
        api.add_share(&format!("share-{i}"), &shared, "2Gi", "0")
            .await;
        api.add_claim(
            &format!("whole-{i}"),
            &format!("gpu-{}", whole_gpus[i % whole_gpus.len()]),
        )
        .await;
    }
    let (mut share_prep, mut share_unprep, mut whole_prep) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..SEQ_RUNS {
        // Alternate which goes first, so neither always follows the other's writes.
        let (first, second) = if i % 2 == 0 {
            (format!("share-{i}"), format!("whole-{i}"))
        } else {
            (format!("whole-{i}"), format!("share-{i}"))
        };
        for uid in [first, second] {
            let p = prepare_ok(&mut client, &uid).await;
            let u = unprepare_ok(&mut client, &uid).await;
            if uid.starts_with("share") {
                share_prep.push(p);
                share_unprep.push(u);
            } else {
                whole_prep.push(p);
            }
        }
    }
    let whole = report("interleaved: 1-GPU claim prepare", whole_prep);
    let share = report("interleaved: share prepare (daemon running)", share_prep);
    report("interleaved: share unprepare (daemon stays)", share_unprep);
    println!(
        "share prepare p50 / whole-GPU prepare p50 (same loop): {:.2}x (goal <= 1.2x)",
        share.as_secs_f64() / whole.as_secs_f64()
    );
    unprepare_ok(&mut client, "anchor").await;

    // A GPU's first share: its prepare starts the GPU's daemon, its unprepare stops it.
    let first_shared = format!("gpu-{FIRST_SHARE_GPU}");
    for i in 0..FIRST_SHARE_RUNS {
        api.add_share(&format!("first-{i}"), &first_shared, "2Gi", "0")
            .await;
    }
    let (mut first_prep, mut last_unprep) = (Vec::new(), Vec::new());
    for i in 0..FIRST_SHARE_RUNS {
        let uid = format!("first-{i}");
        first_prep.push(prepare_ok(&mut client, &uid).await);
        last_unprep.push(unprepare_ok(&mut client, &uid).await);
    }
    report("first share prepare (starts the daemon)", first_prep);
    report("last share unprepare (stops the daemon)", last_unprep);

    // 64 claims at once, one RPC each, on separate connections like separate pods would share
    // one kubelet connection: use clones of one channel (HTTP/2 multiplexing).
    let mut walls = Vec::new();
    let mut writes_per_burst = Vec::new();
    for b in 0..BURSTS {
        for g in 0..GPUS {
            api.add_claim(&format!("burst-{b}-{g}"), &format!("gpu-{g}"))
                .await;
        }
        let writes_before = plugin.ledger().writes();
        let s = Instant::now();
        let futs = (0..GPUS).map(|g| {
            let mut c = client.clone();
            let uid = format!("burst-{b}-{g}");
            async move {
                let r = c
                    .node_prepare_resources(v1::NodePrepareResourcesRequest {
                        claims: vec![claim_ref(&uid)],
                    })
                    .await
                    .expect("prepare")
                    .into_inner();
                assert_eq!(r.claims[&uid].error, "", "{uid}");
            }
        });
        futures::future::join_all(futs).await;
        walls.push(s.elapsed());
        writes_per_burst.push(plugin.ledger().writes() - writes_before);
        let r = client
            .node_unprepare_resources(v1::NodeUnprepareResourcesRequest {
                claims: (0..GPUS)
                    .map(|g| claim_ref(&format!("burst-{b}-{g}")))
                    .collect(),
            })
            .await
            .expect("unprepare")
            .into_inner();
        assert!(r.claims.values().all(|c| c.error.is_empty()));
    }
    walls.sort();
    let p50 = percentile(&walls, 0.5);
    println!(
        "64 concurrent 1-GPU prepares (64 RPCs)        wall p50 {:>10.3?}  max {:>10.3?}  => {:.0} claims/s; checkpoint writes per 64 prepares: {:?} (2 per claim without group commit = 128)",
        p50,
        walls[walls.len() - 1],
        f64::from(GPUS) / p50.as_secs_f64(),
        writes_per_burst
    );
    stop.cancel();
    api.stop().await;
    let _ = host.kill();
    let _ = host.wait();
}
