//! Device-plugin RPCs on one Unix socket, beside the floor they cannot beat, in the same run:
//! the empty `GetDevicePluginOptions` round trip (gRPC + tonic + the socket layer), then
//! `Allocate` of one GPU (envvar strategy) and `GetPreferredAllocation` of 2 of 8 GPUs, each
//! measured in rounds that interleave the three calls so that machine noise hits them alike.
//! The node is the simulated `dgx-h100` profile. Run with `cargo bench --bench deviceplugin`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kubelet_plugin::proto::deviceplugin::v1beta1::{
    AllocateRequest, ContainerAllocateRequest, ContainerPreferredAllocationRequest, Empty,
    PreferredAllocationRequest, device_plugin_client::DevicePluginClient,
};
use nvdra::deviceplugin::server::Settings;
use nvdra::deviceplugin::{DevicePlugin, Options};
use nvdra::inventory::sim::SimBackend;
use tokio_util::sync::CancellationToken;

#[path = "../crates/kubelet-plugin/tests/support/wait.rs"]
mod wait;

const ROUNDS: usize = 5000;

fn pct(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

fn line(name: &str, mut v: Vec<Duration>, floor: Duration) {
    v.sort_unstable();
    let (p50, p99) = (pct(&v, 0.50), pct(&v, 0.99));
    println!(
        "{name:<28} p50 {:>7.1} µs   p99 {:>7.1} µs   p50 / empty-call p50 = {:.2}",
        p50.as_secs_f64() * 1e6,
        p99.as_secs_f64() * 1e6,
        p50.as_secs_f64() / floor.as_secs_f64()
    );
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let root = tempfile::tempdir().expect("tempdir");
        let dir = root.path().join("device-plugins");
        let sim = SimBackend::from_profile("dgx-h100", "bench").expect("profile");
        let stop = CancellationToken::new();
        let node = nvdra::testing::start_owner(
            Arc::new(sim),
            Duration::from_secs(5),
            nvdra::testing::no_health(),
            stop.clone(),
        )
        .await
        .expect("inventory owner")
        .subscribe();
        let dp = DevicePlugin::new(
            Settings {
                dir: dir.clone(),
                driver: "gpu.nvidia.com".into(),
                driver_root: nvdra::cdi::DriverRoot::at(&root.path().join("driver")),
                cdi_root: root.path().join("cdi"),
                watch: Duration::from_millis(250),
            },
            Options::default(),
            node,
        );
        let task = tokio::spawn(dp.run(stop.clone()));
        let sock = dir.join("nvidia-gpu.sock");
        let socket = &sock;
        let channel = wait::until("the device plugin's socket", wait::SOON, || async move {
            kubelet_plugin::socket::connect(socket).await.ok()
        })
        .await;
        let mut client = DevicePluginClient::new(channel);
        let mut list = client
            .list_and_watch(Empty {})
            .await
            .expect("ListAndWatch")
            .into_inner();
        let ids: Vec<String> = list
            .message()
            .await
            .expect("list")
            .expect("a first list")
            .devices
            .into_iter()
            .map(|d| d.id)
            .collect();
        let alloc = AllocateRequest {
            container_requests: vec![ContainerAllocateRequest {
                devices_ids: vec![ids[3].clone()],
            }],
        };
        let pref = PreferredAllocationRequest {
            container_requests: vec![ContainerPreferredAllocationRequest {
                available_device_i_ds: ids.clone(),
                must_include_device_i_ds: vec![],
                allocation_size: 2,
            }],
        };
        let (mut empty, mut allocate, mut preferred) = (Vec::new(), Vec::new(), Vec::new());
        for round in 0..ROUNDS + 200 {
            let t = Instant::now();
            client
                .get_device_plugin_options(Empty {})
                .await
                .expect("options");
            let e = t.elapsed();
            let t = Instant::now();
            client.allocate(alloc.clone()).await.expect("allocate");
            let a = t.elapsed();
            let t = Instant::now();
            client
                .get_preferred_allocation(pref.clone())
                .await
                .expect("preferred");
            let p = t.elapsed();
            // The first rounds warm up connections and allocators.
            if round >= 200 {
                empty.push(e);
                allocate.push(a);
                preferred.push(p);
            }
        }
        let mut sorted = empty.clone();
        sorted.sort_unstable();
        let floor = pct(&sorted, 0.5);
        println!("dgx-h100 (8 simulated GPUs), {ROUNDS} rounds on one connection:");
        line("GetDevicePluginOptions", empty, floor);
        line("Allocate (1 GPU, envvar)", allocate, floor);
        line("GetPreferredAllocation (2/8)", preferred, floor);
        stop.cancel();
        let _ = task.await;
    });
}
