//! The device plugin in-process on a simulated node: a health change reaches an open
//! `ListAndWatch` stream as a new full list, Allocate then refuses the sick GPU, and the streams
//! end and the sockets go when the plugin stops. (The kubelet's side of the conversation, with a
//! client nvdra did not write, is in `deviceplugin_grpcio.rs`.)

use std::sync::Arc;
use std::time::Duration;

use kubelet_plugin::proto::deviceplugin::v1beta1::{
    AllocateRequest, ContainerAllocateRequest, Empty, device_plugin_client::DevicePluginClient,
};
use nvdra::deviceplugin::server::Settings;
use nvdra::deviceplugin::{DevicePlugin, Options};
use nvdra::inventory::Health;
use nvdra::inventory::owner;
use nvdra::inventory::sim::SimBackend;
use tokio_util::sync::CancellationToken;

use crate::support::wait;

/// The plugin's settings in a test directory: kubelet.sock and the plugin sockets under
/// `<root>/device-plugins`, sockets checked every 20 ms.
fn settings(root: &std::path::Path) -> Settings {
    Settings {
        dir: root.join("device-plugins"),
        driver: "gpu.nvidia.com".into(),
        driver_root: nvdra::cdi::DriverRoot::at(&root.join("driver")),
        cdi_root: root.join("cdi"),
        watch: Duration::from_millis(20),
    }
}

/// An inventory owner over `sim` reading it every `rescan` until `stop`: its publications.
async fn owner_of(sim: &SimBackend, rescan: Duration, stop: &CancellationToken) -> owner::Watch {
    nvdra::testing::start_owner(
        Arc::new(sim.clone()),
        rescan,
        nvdra::testing::no_health(),
        stop.clone(),
    )
    .await
    .unwrap()
    .subscribe()
}

#[tokio::test]
async fn a_health_change_sends_a_new_list_and_allocate_refuses_the_gpu() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("device-plugins");
    let sim = SimBackend::from_profile("l40s-pcie", "n").unwrap();
    let stop = CancellationToken::new();
    let dp = DevicePlugin::new(
        settings(root.path()),
        Options::default(),
        owner_of(&sim, Duration::from_millis(20), &stop).await,
    );
    let task = tokio::spawn(dp.run(stop.clone()));
    let sock = dir.join("nvidia-gpu.sock");
    // The server binds on its first tick; no kubelet is needed for it to serve.
    let (socket, running) = (&sock, &task);
    let channel = wait::until("the device plugin's socket", wait::SOON, || async move {
        assert!(
            !running.is_finished(),
            "the device plugin stopped: {running:?}"
        );
        kubelet_plugin::socket::connect(socket).await.ok()
    })
    .await;
    let mut client = DevicePluginClient::new(channel);
    let mut stream = client.list_and_watch(Empty {}).await.unwrap().into_inner();
    let first = stream.message().await.unwrap().unwrap();
    assert_eq!(first.devices.len(), 4);
    assert!(first.devices.iter().all(|d| d.health == "Healthy"));
    let sick = first.devices[2].id.clone();

    sim.update(|inv| {
        inv.gpus[2].health = Health::Unhealthy {
            reason: "XID 79".into(),
        }
    });
    let second = stream.message().await.unwrap().unwrap();
    assert_eq!(second.devices.len(), 4, "always the full list");
    let health: Vec<&str> = second.devices.iter().map(|d| d.health.as_str()).collect();
    assert_eq!(health, ["Healthy", "Healthy", "Unhealthy", "Healthy"]);

    let err = client
        .allocate(AllocateRequest {
            container_requests: vec![ContainerAllocateRequest {
                devices_ids: vec![sick.clone()],
            }],
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(err.message().contains(&sick), "{}", err.message());

    stop.cancel();
    assert!(
        stream.message().await.unwrap_or(None).is_none(),
        "the stream ends on shutdown"
    );
    task.await.unwrap().unwrap();
    assert!(!sock.exists(), "the socket is removed on shutdown");
}

/// A kubelet registration service that records each `Register`.
struct Kubelet(tokio::sync::mpsc::UnboundedSender<String>);

#[tonic::async_trait]
impl kubelet_plugin::proto::deviceplugin::v1beta1::registration_server::Registration for Kubelet {
    async fn register(
        &self,
        request: tonic::Request<kubelet_plugin::proto::deviceplugin::v1beta1::RegisterRequest>,
    ) -> Result<tonic::Response<Empty>, tonic::Status> {
        let r = request.into_inner();
        let _ = self.0.send(format!("{} {}", r.resource_name, r.endpoint));
        Ok(tonic::Response::new(Empty {}))
    }
}

#[tokio::test]
async fn a_removed_plugin_socket_is_served_and_registered_again() {
    use kubelet_plugin::proto::deviceplugin::v1beta1::registration_server::RegistrationServer;
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("device-plugins");
    std::fs::create_dir_all(&dir).unwrap();
    let (tx, mut registrations) = tokio::sync::mpsc::unbounded_channel();
    let listener = tokio::net::UnixListener::bind(dir.join("kubelet.sock")).unwrap();
    let kubelet = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(RegistrationServer::new(Kubelet(tx)))
            .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(listener)),
    );
    let (ready_tx, mut ready) = tokio::sync::watch::channel(false);
    let sim = SimBackend::from_profile("l40s-pcie", "n").unwrap();
    let stop = CancellationToken::new();
    let dp = DevicePlugin::new(
        settings(root.path()),
        Options::default(),
        owner_of(&sim, Duration::from_secs(3600), &stop).await,
    )
    .on_registered(Arc::new(move |all| {
        let _ = ready_tx.send(all);
    }));
    let task = tokio::spawn(dp.run(stop.clone()));
    assert_eq!(
        registrations.recv().await.unwrap(),
        "nvidia.com/gpu nvidia-gpu.sock"
    );
    ready.wait_for(|r| *r).await.unwrap();
    let sock = dir.join("nvidia-gpu.sock");
    std::fs::remove_file(&sock).unwrap();
    assert_eq!(
        registrations.recv().await.unwrap(),
        "nvidia.com/gpu nvidia-gpu.sock",
        "registered again after its socket was removed"
    );
    // It serves.
    let mut client = DevicePluginClient::new(kubelet_plugin::socket::connect(&sock).await.unwrap());
    let list = client
        .list_and_watch(Empty {})
        .await
        .unwrap()
        .into_inner()
        .message()
        .await;
    assert_eq!(list.unwrap().unwrap().devices.len(), 4);
    stop.cancel();
    task.await.unwrap().unwrap();
    kubelet.abort();
}

#[tokio::test]
async fn a_mig_reconfiguration_serves_the_new_resource_and_shrinks_the_old() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("device-plugins");
    let sim = SimBackend::from_profile("a100-mig-mixed", "n").unwrap();
    let stop = CancellationToken::new();
    let dp = DevicePlugin::new(
        settings(root.path()),
        Options {
            mig_strategy: nvdra::deviceplugin::MigStrategy::Mixed,
            ..Options::default()
        },
        owner_of(&sim, Duration::from_millis(20), &stop).await,
    );
    let task = tokio::spawn(dp.run(stop.clone()));
    let connect = |sock: std::path::PathBuf| async move {
        for _ in 0..1000 {
            if let Ok(c) = kubelet_plugin::socket::connect(&sock).await {
                return DevicePluginClient::new(c);
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("{} was not served within 10 s", sock.display());
    };
    let mut gpu = connect(dir.join("nvidia-gpu.sock")).await;
    let mut stream = gpu.list_and_watch(Empty {}).await.unwrap().into_inner();
    assert_eq!(stream.message().await.unwrap().unwrap().devices.len(), 2);
    assert!(!dir.join("nvidia-mig-7g.40gb.sock").exists());

    // GPU 3 goes into MIG mode with one 7g.40gb instance.
    let uuid = sim.update(|inv| {
        let mut m = inv.gpus[1].mig.devices[0].clone();
        m.profile = "7g.40gb".into();
        m.uuid = nvdra::inventory::MigUuid("MIG-7g40gb-test".into());
        m.placement = nvdra::inventory::Placement { start: 0, size: 8 };
        inv.gpus[3].mig.enabled = true;
        inv.gpus[3].mig.devices = vec![m.clone()];
        m.uuid
    });
    let shrunk = stream.message().await.unwrap().unwrap();
    assert_eq!(shrunk.devices.len(), 1, "GPU 3 is no longer whole");
    let mut mig = connect(dir.join("nvidia-mig-7g.40gb.sock")).await;
    let list = mig
        .list_and_watch(Empty {})
        .await
        .unwrap()
        .into_inner()
        .message()
        .await
        .unwrap()
        .unwrap();
    let ids: Vec<&str> = list.devices.iter().map(|d| d.id.as_str()).collect();
    assert_eq!(ids, [uuid.as_str()]);
    stop.cancel();
    task.await.unwrap().unwrap();
    assert!(!dir.join("nvidia-mig-7g.40gb.sock").exists());
}

/// The daemon's wiring: the device plugin reads the inventory owner's watch, with a poll far
/// beyond the test. A MIG device created the way prepare creates one (through the owner's
/// write handle) is in the very next list of its resource, from the one read that the creation
/// asked of the owner — not left to the slices alone.
#[tokio::test]
async fn a_mig_device_created_at_prepare_reaches_list_and_watch_from_one_inventory_read() {
    use nvdra::inventory::owner::{Owner, Writes};
    use nvdra::inventory::{DeviceBackend, Placement, Reconfigure};
    const SOON: Duration = Duration::from_secs(10);
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("device-plugins");
    let sim = SimBackend::from_profile("a100-mig-mixed", "n").unwrap();
    let (mut owner, inventory) = Owner::new(
        Arc::new(sim.clone()),
        Duration::from_secs(3600),
        owner::DEADLINE,
    )
    .unwrap();
    owner.read().await.unwrap();
    let stop = CancellationToken::new();
    let owner_task = tokio::spawn(owner.run(nvdra::testing::no_health(), stop.clone()));
    let watched = Arc::new(Writes::new(Arc::new(sim.clone()), inventory.clone()));
    let dp = DevicePlugin::new(
        settings(root.path()),
        Options {
            mig_strategy: nvdra::deviceplugin::MigStrategy::Mixed,
            ..Options::default()
        },
        inventory.subscribe(),
    );
    let task = tokio::spawn(dp.run(stop.clone()));
    let sock = dir.join("nvidia-mig-1g.10gb.sock");
    let channel = tokio::time::timeout(SOON, async {
        loop {
            if let Ok(c) = kubelet_plugin::socket::connect(&sock).await {
                break c;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the MIG resource is served");
    let mut client = DevicePluginClient::new(channel);
    let mut stream = client.list_and_watch(Empty {}).await.unwrap().into_inner();
    let first = stream.message().await.unwrap().unwrap();
    let reads = inventory.latest().reads;

    let gpu2 = sim.snapshot().unwrap().gpus[2].uuid.clone();
    let w = watched.clone();
    let created = tokio::task::spawn_blocking(move || {
        w.create_mig(&gpu2, 15, Placement { start: 6, size: 2 })
    })
    .await
    .unwrap()
    .unwrap();
    let next = tokio::time::timeout(SOON, stream.message())
        .await
        .expect("the list changes without a poll")
        .unwrap()
        .unwrap();
    assert_eq!(next.devices.len(), first.devices.len() + 1);
    assert!(
        next.devices
            .iter()
            .any(|d| d.id == created.uuid.to_string()),
        "{next:?}"
    );
    assert_eq!(inventory.latest().reads, reads + 1, "one inventory read");

    stop.cancel();
    task.await.unwrap().unwrap();
    owner_task.await.unwrap().unwrap();
}
