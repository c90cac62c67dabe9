//! Issue 35 item 2: one MIG change and one health transition each reach the consumers of the
//! inventory owner's watch (slices, `ListAndWatch`, the DRA health stream, the node labels,
//! `/metrics`) from the same publication, the MIG change with one hardware read and the health
//! transition with none.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use kubelet_plugin::proto::deviceplugin::v1beta1::{
    Empty, ListAndWatchResponse, device_plugin_client::DevicePluginClient,
};
use kubelet_plugin::proto::health::v1alpha1::dra_resource_health_server::DraResourceHealth;
use kubelet_plugin::proto::health::v1alpha1::{HealthStatus, NodeWatchResourcesRequest};
use kubelet_plugin::publisher::Publisher;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::api::ClusterApi;
use crate::api::dir::DirApi;
use crate::daemon::labels;
use crate::deviceplugin::server::Settings;
use crate::deviceplugin::{DevicePlugin, MigStrategy, Options};
use crate::dra::health::NodeHealth;
use crate::dra::slices::{ConsumableShares, CounterLayout, SliceOptions};
use crate::dra::sync::SliceSync;
use crate::inventory::health::{Cause, Fault, HealthState};
use crate::inventory::sim::SimBackend;
use crate::inventory::{DeviceUuid, Placement, ProcessUsage, Reconfigure, TaintEffect};
use crate::metrics::{Source, attribution::Attribution};

const NODE: &str = "n";
/// The new MIG device: a 1g.10gb (profile 15) in the free slots 6-7 of GPU 2.
const NEW: &str = "gpu-2-mig-1g10gb-15-6";

/// Polls `f` every 10 ms until it is `Some`; panics naming `what` after 10 s, which only a broken
/// consumer reaches.
async fn until<T>(what: &str, mut f: impl AsyncFnMut() -> Option<T>) -> T {
    for _ in 0..1000 {
        if let Some(v) = f().await {
            return v;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("never saw {what}")
}

/// The `nvidia.com/gpu.count` label of the node in `api`.
async fn gpu_count(api: &dyn ClusterApi) -> Option<String> {
    let node = api.get_node(NODE).await.ok()?;
    node.metadata.labels?.get("nvidia.com/gpu.count").cloned()
}

/// The published slices' device `name`: its taint keys (`None` while it is not published).
fn slice_taints(
    handle: &kubelet_plugin::publisher::PublisherHandle,
    name: &str,
) -> Option<Vec<String>> {
    let desired = handle.desired()?;
    let device = desired
        .pools
        .values()
        .flat_map(|p| &p.slices)
        .flat_map(|s| &s.devices)
        .find(|d| d.name == name)?;
    Some(
        device
            .taints
            .iter()
            .flatten()
            .map(|t| t.key.clone())
            .collect(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mig_change_and_a_health_transition_reach_every_consumer_from_one_publication() {
    let root = tempfile::tempdir().unwrap();
    let sim = SimBackend::from_profile("a100-mig-mixed", NODE).unwrap();
    let stop = CancellationToken::new();
    let (health, health_rx) = watch::channel(HealthState::default());
    let hour = Duration::from_secs(3600);
    let owner = crate::testing::start_owner(Arc::new(sim.clone()), hour, health_rx, stop.clone())
        .await
        .unwrap();

    // Slices.
    let api: Arc<dyn ClusterApi> = Arc::new(DirApi::new(root.path().join("api")).unwrap());
    let (_publisher, slices) = Publisher::new(api.clone(), "gpu.nvidia.com", NODE);
    let options = SliceOptions {
        driver: "gpu.nvidia.com".into(),
        node_name: NODE.into(),
        partitionable: false,
        shared_capacity: ConsumableShares::Disabled,
        dynamic_mig: false,
        mig_profiles: None,
        layout: CounterLayout::Separate,
    };
    tokio::spawn(SliceSync::new(owner.subscribe(), slices.clone(), options).run(stop.clone()));
    // ListAndWatch of the 1g.10gb MIG devices.
    let settings = Settings {
        dir: root.path().join("device-plugins"),
        driver: "gpu.nvidia.com".into(),
        driver_root: crate::cdi::DriverRoot::at(&root.path().join("driver")),
        cdi_root: root.path().join("cdi"),
        watch: Duration::from_millis(20),
    };
    let dp_options = Options {
        mig_strategy: MigStrategy::Mixed,
        ..Options::default()
    };
    let dp = DevicePlugin::new(settings, dp_options, owner.subscribe());
    tokio::spawn(dp.run(stop.clone()));
    let sock = root.path().join("device-plugins/nvidia-mig-1g.10gb.sock");
    let channel = until("the device plugin's socket", async || {
        kubelet_plugin::socket::connect(&sock).await.ok()
    })
    .await;
    let mut list = DevicePluginClient::new(channel)
        .list_and_watch(Empty {})
        .await
        .unwrap()
        .into_inner();
    // The DRA health stream.
    let svc = NodeHealth::new(owner.subscribe(), NODE).service(hour, stop.clone());
    let mut stream = svc
        .node_watch_resources(tonic::Request::new(NodeWatchResourcesRequest {}))
        .await
        .unwrap()
        .into_inner();
    // The node labels (MIG strategy single: `gpu.count` counts the MIG devices).
    let label_options = Options {
        mig_strategy: MigStrategy::Single,
        ..Options::default()
    };
    tokio::spawn(labels::run(
        api.clone(),
        owner.subscribe(),
        label_options,
        NODE.into(),
        Duration::from_millis(20),
        stop.clone(),
    ));
    // `/metrics` (its readings live, through the owner's handle: no inventory read).
    let metrics = Attribution::new(owner.subscribe(), owner.clone());
    let mig_of = |pid: u32| {
        let s = metrics.scrape();
        s.processes
            .iter()
            .find(|p| p.pid == pid)
            .map(|p| p.mig_uuid.clone())
    };

    // Everyone has the first read.
    let first = list.message().await.unwrap().unwrap();
    assert_eq!(first.devices.len(), 3, "{first:?}");
    let health_first = stream.next().await.unwrap().unwrap();
    assert!(
        !health_first
            .devices
            .iter()
            .any(|d| d.device.as_ref().unwrap().device_name == NEW)
    );
    until("the first slices", async || slice_taints(&slices, "gpu-0")).await;
    until("the first labels", async || {
        (gpu_count(&*api).await.as_deref() == Some("7")).then_some(())
    })
    .await;
    let before = owner.latest();
    assert_eq!(before.reads, 1, "only the owner's first read");

    // (a) One MIG change and one ask: one read, seen by all four.
    let gpu2 = before.node.as_ref().unwrap().gpus[2].uuid.clone();
    let created = sim
        .create_mig(&gpu2, 15, Placement { start: 6, size: 2 })
        .unwrap();
    // A process in the new instance: `/metrics` names its MIG device only once a publication
    // lists the device (it reads no inventory of its own).
    sim.set_processes(
        &gpu2,
        vec![ProcessUsage {
            pid: 4242,
            used_memory_bytes: Some(1 << 30),
            gpu_instance: Some(created.gi_id),
        }],
    );
    assert_eq!(mig_of(4242), Some(String::new()), "not yet published");
    let ticket = owner.request();
    let read = owner.wait(ticket).await.unwrap();
    assert_eq!(read.reads, before.reads + 1);
    let second: ListAndWatchResponse = list.message().await.unwrap().unwrap();
    let ids: Vec<&str> = second.devices.iter().map(|d| d.id.as_str()).collect();
    assert_eq!(ids.len(), 4, "{ids:?}");
    assert!(ids.contains(&created.uuid.to_string().as_str()), "{ids:?}");
    assert!(second.devices.iter().all(|d| d.health == "Healthy"));
    let health_second = stream.next().await.unwrap().unwrap();
    let new = health_second
        .devices
        .iter()
        .find(|d| d.device.as_ref().unwrap().device_name == NEW)
        .expect("the health stream lists the new MIG device");
    assert_eq!(new.health, HealthStatus::Healthy as i32);
    let taints = until("the new MIG device in the slices", async || {
        slice_taints(&slices, NEW)
    })
    .await;
    assert!(taints.is_empty(), "{taints:?}");
    until("the labels to count 8 MIG devices", async || {
        (gpu_count(&*api).await.as_deref() == Some("8")).then_some(())
    })
    .await;
    assert_eq!(mig_of(4242), Some(created.uuid.to_string()), "/metrics");
    let after_mig = owner.latest();
    assert_eq!(
        (after_mig.reads, after_mig.generation),
        (read.reads, read.generation),
        "one hardware read, one publication, for the MIG change"
    );

    // (b) GPU 2 falls off the bus, and the share-daemon watch's round says GPU 0's daemon
    // answers: republished without a read.
    assert!(metrics.scrape().share_daemons.is_empty());
    let gpu0 = before.node.as_ref().unwrap().gpus[0].uuid.clone();
    health.send_modify(|h| {
        h.daemons_asked.insert(DeviceUuid::Gpu(gpu0.clone()), true);
        h.faults.insert(
            gpu2.clone(),
            Fault {
                cause: Cause::GpuLost,
                xid: None,
                effect: TaintEffect::NoSchedule,
                since: tokio::time::Instant::now(),
            },
        );
    });
    let third = list.message().await.unwrap().unwrap();
    let sick = third
        .devices
        .iter()
        .find(|d| d.id == created.uuid.to_string())
        .expect("ListAndWatch still lists the new MIG device");
    assert_eq!(sick.health, "Unhealthy");
    let health_third = stream.next().await.unwrap().unwrap();
    let new = health_third
        .devices
        .iter()
        .find(|d| d.device.as_ref().unwrap().device_name == NEW)
        .unwrap();
    assert_eq!(new.health, HealthStatus::Unhealthy as i32);
    let taints = until("the new MIG device tainted in the slices", async || {
        slice_taints(&slices, NEW).filter(|t| !t.is_empty())
    })
    .await;
    assert_eq!(taints.len(), 1, "{taints:?}");
    assert_eq!(
        metrics.scrape().share_daemons,
        vec![(gpu0.to_string(), true)],
        "nvdra_mps_daemon_up"
    );
    // The node labels carry no health: nothing of (b) to see there.
    let after_fault = owner.latest();
    assert_eq!(
        (after_fault.reads, after_fault.generation),
        (after_mig.reads, after_mig.generation + 1),
        "no hardware read, one publication, for the health transition"
    );
    stop.cancel();
}
