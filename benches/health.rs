//! How long an injected GPU fault takes to reach the kubelet and the scheduler: from an XID 79
//! event on GPU 3 of a simulated DGX H100 handed to the health monitor, to (a) the DRA health
//! stream's next message listing GPU 3 unhealthy, and (b) the ResourceSlice on the test API
//! server (KubeApi over HTTP on 127.0.0.1) carrying GPU 3's `gpu.nvidia.com/xid` taint; and the
//! recovery (quiet period 0, probe every 100 ms: the first figure is mostly the probe schedule,
//! the second the path from the stream's message to the slice). The
//! tests check that it happens; these figures are how fast. Median of several runs.
//!
//! Then the NVML path on the fake library (`tests/fake-nvml`): an XID injected into the fake's
//! event set → NVML's event thread (`nvmlEventSetWait_v2`) → the monitor → the health-stream
//! message.
//!
//! Run: `cargo bench --bench health`

#[path = "../tests/support/apiserver.rs"]
mod apiserver;
#[path = "../tests/support/fake_nvml.rs"]
mod fake_nvml;

use std::sync::Arc;
use std::time::{Duration, Instant};

use apiserver::TestApiServer;
use futures::StreamExt;
use k8s_openapi::api::resource::v1::ResourceSlice;
use kubelet_plugin::health::HealthService;
use kubelet_plugin::proto::health::v1alpha1::dra_resource_health_server::DraResourceHealth;
use kubelet_plugin::proto::health::v1alpha1::{HealthStatus, NodeWatchResourcesRequest};
use kubelet_plugin::publisher::{Options, Publisher};
use nvdra::api::kube::KubeApi;
use nvdra::dra::health::NodeHealth;
use nvdra::dra::slices::{ConsumableShares, CounterLayout, SliceOptions};
use nvdra::dra::sync::SliceSync;
use nvdra::health::{Event, EventKind, Monitor, Policy};
use nvdra::inventory::DeviceBackend;
use nvdra::inventory::owner;
use nvdra::inventory::sim::SimBackend;
use tokio_util::sync::CancellationToken;

const DRIVER: &str = "gpu.nvidia.com";
const NODE: &str = "dgx-h100-0";
const RUNS: usize = 15;

fn gpu3_tainted(slices: &[ResourceSlice]) -> Option<bool> {
    slices
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten())
        .find(|d| d.name == "gpu-3")
        .map(|d| d.taints.as_ref().is_some_and(|t| !t.is_empty()))
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1e3)
}

#[tokio::main]
async fn main() {
    let (mut stream_sick, mut slice_sick, mut stream_well, mut slice_well) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..RUNS {
        let server = Arc::new(TestApiServer::start().await);
        server.seed_node(NODE, "node-uid");
        let api = Arc::new(KubeApi::from_url(server.url()).expect("client"));
        let (publisher, handle) = Publisher::with_options(
            api,
            DRIVER,
            NODE,
            Options {
                settle: Duration::ZERO,
                ..Options::default()
            },
        );
        let sim = SimBackend::from_profile("dgx-h100", NODE).expect("profile");
        let inner: Arc<dyn DeviceBackend> = Arc::new(sim.clone());
        // As `nvdra run` wires them: the monitor probes through the owner, which follows it.
        let hour = Duration::from_secs(3600);
        let (mut owner, node) = owner::Owner::new(inner, hour, owner::DEADLINE).expect("the owner");
        owner.read().await.expect("the first read");
        let (monitor, mh) = Monitor::new(
            Policy {
                quiet_period: Duration::ZERO,
                probe_interval: Duration::from_millis(100),
                ..Policy::default()
            },
            Arc::new(node.clone()),
        );
        let token = CancellationToken::new();
        tokio::spawn(owner.run(mh.subscribe(), token.clone()));
        let sync = SliceSync::new(
            node.subscribe(),
            handle,
            SliceOptions {
                driver: DRIVER.into(),
                node_name: NODE.into(),
                partitionable: false,
                shared_capacity: ConsumableShares::Disabled,
                dynamic_mig: false,
                mig_profiles: None,
                layout: CounterLayout::Separate,
            },
        );
        tokio::spawn(monitor.run(token.clone()));
        tokio::spawn(publisher.run(token.clone()));
        tokio::spawn(sync.run(token.clone()));
        let mut stream = health_stream(node.subscribe(), NODE, &token).await;
        server
            .wait_for(Duration::from_secs(10), |s| gpu3_tainted(s) == Some(false))
            .await;
        // Let the echo of the first publish pass.
        tokio::time::sleep(Duration::from_millis(50)).await;

        let gpu3 = sim.snapshot().expect("inventory").gpus[3].uuid.clone();
        let watch_slices = {
            let server = server.clone();
            tokio::spawn(async move {
                server
                    .wait_for(Duration::from_secs(10), |s| gpu3_tainted(s) == Some(true))
                    .await;
                Instant::now()
            })
        };
        let t = Instant::now();
        mh.events()
            .send(Event::gpu(gpu3, EventKind::Xid(79)))
            .await
            .expect("monitor");
        let m = stream.next().await.expect("message").expect("ok");
        stream_sick.push(t.elapsed());
        assert!(
            m.devices
                .iter()
                .any(|d| d.health == HealthStatus::Unhealthy as i32)
        );
        slice_sick.push(watch_slices.await.expect("watch") - t);
        let sick_at = t;

        // Recovery: the next probe round (at most 100 ms away) finds it healthy.
        let watch_slices = {
            let server = server.clone();
            tokio::spawn(async move {
                server
                    .wait_for(Duration::from_secs(10), |s| gpu3_tainted(s) == Some(false))
                    .await;
                Instant::now()
            })
        };
        let m = stream.next().await.expect("message").expect("ok");
        let t = Instant::now();
        stream_well.push(t - sick_at);
        assert!(
            m.devices
                .iter()
                .all(|d| d.health == HealthStatus::Healthy as i32)
        );
        slice_well.push(watch_slices.await.expect("watch") - t);
        token.cancel();
    }
    let nvml = nvml_path().await;
    println!("health: XID 79 on GPU 3 of a simulated dgx-h100; {RUNS} runs");
    println!(
        "  fault → health-stream message: median {}",
        ms(median(stream_sick))
    );
    println!(
        "  fault → tainted slice on the test API server: median {}",
        ms(median(slice_sick))
    );
    println!(
        "  recovery: fault → healthy stream message (quiet period 0, probe every 100 ms): median {}",
        ms(median(stream_well))
    );
    println!(
        "  recovery: healthy stream message → untainted slice: median {}",
        ms(median(slice_well))
    );
    println!(
        "  NVML on the fake library: XID injected on GPU 0 → health-stream message: median {}",
        ms(median(nvml))
    );
}

/// The health stream of the owner's publications `published` with its first message (the full
/// list) already read.
async fn health_stream(
    published: owner::Watch,
    node: &str,
    token: &CancellationToken,
) -> <HealthService as DraResourceHealth>::NodeWatchResourcesStream {
    let svc = NodeHealth::new(published, node).service(Duration::from_secs(3600), token.clone());
    let mut stream = svc
        .node_watch_resources(tonic::Request::new(NodeWatchResourcesRequest {}))
        .await
        .expect("stream")
        .into_inner();
    stream.next().await.expect("first message").expect("ok");
    stream
}

async fn nvml_path() -> Vec<Duration> {
    use nvdra::inventory::nvml::{LIBRARY, NvmlBackend};
    let root = tempfile::tempdir().expect("temp dir");
    let lib_dir = root.path().join("usr/lib64");
    std::fs::create_dir_all(&lib_dir).expect("dir");
    let path = lib_dir.join(LIBRARY);
    std::os::unix::fs::symlink(fake_nvml::library(), &path).expect("symlink");
    let backend: Arc<dyn DeviceBackend> =
        Arc::new(NvmlBackend::open(root.path()).expect("the fake loads"));
    // SAFETY: loading the library NVML already loaded returns that copy.
    let lib = unsafe { libloading::Library::new(&path) }.expect("the fake");
    // SAFETY: the hooks' C signatures as the fake's events.rs declares them.
    let inject: libloading::Symbol<extern "C" fn(u32, u64, u64) -> u32> =
        unsafe { lib.get(b"fake_nvml_inject_event") }.expect("hook");
    let registrations: libloading::Symbol<extern "C" fn(u32) -> u32> =
        unsafe { lib.get(b"fake_nvml_registrations") }.expect("hook");
    let mut out = Vec::new();
    for _ in 0..RUNS {
        // As `nvdra run` wires them: the monitor probes through the owner, which follows it.
        let hour = Duration::from_secs(3600);
        let (mut owner, node) =
            owner::Owner::new(backend.clone(), hour, owner::DEADLINE).expect("the owner");
        owner.read().await.expect("the first read");
        let (monitor, mh) = Monitor::new(
            Policy {
                quiet_period: Duration::ZERO,
                probe_interval: Duration::from_millis(20),
                ..Policy::default()
            },
            Arc::new(node.clone()),
        );
        let token = CancellationToken::new();
        tokio::spawn(monitor.run(token.clone()));
        let before = registrations(0);
        backend
            .start_health_events(Box::new(mh.events()))
            .expect("an event source")
            .expect("the thread starts");
        while registrations(0) <= before {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        tokio::spawn(owner.run(mh.subscribe(), token.clone()));
        let mut stream = health_stream(node.subscribe(), "n", &token).await;
        let t = Instant::now();
        assert_eq!(inject(0, 0x8, 79), 0);
        let m = stream.next().await.expect("message").expect("ok");
        out.push(t.elapsed());
        assert!(
            m.devices
                .iter()
                .any(|d| d.health == HealthStatus::Unhealthy as i32)
        );
        // Recovered (quiet period 0) before the next run.
        let mut w = mh.subscribe();
        w.wait_for(|s| s.is_empty()).await.expect("monitor");
        token.cancel();
    }
    out
}
