//! The demo's legacy part: the same simulated node as a device plugin, with the demo playing the
//! kubelet's device manager — it serves `kubelet.sock`, takes the plugin's `Register`, reads the
//! first `ListAndWatch` list and asks `Allocate` for one `nvidia.com/gpu`, as a pod with
//! `resources.limits: {nvidia.com/gpu: 1}` would.

use std::io::Write;
use std::sync::Arc;

use anyhow::{Context, Result, ensure};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use super::{PATIENCE, wait_for};
use crate::config::{Config, Mode};
use crate::inventory::sim::SimBackend;
use kubelet_plugin::proto::deviceplugin::v1beta1::{
    AllocateRequest, ContainerAllocateRequest, Empty, RegisterRequest,
    device_plugin_client::DevicePluginClient,
    registration_server::{Registration, RegistrationServer},
};
use kubelet_plugin::socket::connect as connect_unix;

/// The kubelet's `Registration` service: every request is handed to the demo.
struct Kubelet(mpsc::Sender<RegisterRequest>);

#[tonic::async_trait]
impl Registration for Kubelet {
    async fn register(&self, request: Request<RegisterRequest>) -> Result<Response<Empty>, Status> {
        self.0
            .send(request.into_inner())
            .await
            .map_err(|_| Status::unavailable("the demo stopped listening"))?;
        Ok(Response::new(Empty {}))
    }
}

/// Runs the daemon as a device plugin on `sim` and plays the device manager against it.
pub async fn run(
    out: &mut (dyn Write + Send),
    mut config: Config,
    sim: SimBackend,
    step: u32,
) -> Result<()> {
    config.mode = Mode::DevicePlugin;
    // A fresh node: the fault of the DRA part is not replayed.
    config.fault_file = None;
    let dir = config.device_plugin_dir();
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let kubelet_sock = dir.join("kubelet.sock");
    let listener = kubelet_plugin::socket::bind(&kubelet_sock)?;
    let (tx, mut registered) = mpsc::channel(4);
    let stop = CancellationToken::new();
    let kubelet = {
        let stop = stop.clone();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(RegistrationServer::new(Kubelet(tx)))
                .serve_with_incoming_shutdown(
                    kubelet_plugin::socket::incoming(listener),
                    stop.cancelled_owned(),
                ),
        )
    };
    let api = crate::api::connect(&config.api).await?;
    let daemon = tokio::spawn(crate::daemon::run(
        config,
        crate::daemon::Extras::default(),
        Arc::new(sim),
        api,
        stop.clone(),
    ));

    let result = async {
        let req = tokio::time::timeout(PATIENCE, registered.recv())
            .await
            .context("the device plugin did not register within the demo's patience")?
            .context("the kubelet stand-in stopped")?;
        writeln!(
            out,
            "{step}. The same inventory as a legacy device plugin: nvdra registers {:?} on {} (endpoint {}).",
            req.resource_name,
            kubelet_sock.display(),
            req.endpoint
        )?;
        let plugin_sock = dir.join(&req.endpoint);
        wait_for(&plugin_sock, &daemon).await?;
        let mut client = DevicePluginClient::new(connect_unix(&plugin_sock).await?);
        let mut stream = client.list_and_watch(Empty {}).await?.into_inner();
        let list = stream
            .message()
            .await?
            .context("ListAndWatch ended before its first list")?;
        let healthy = list.devices.iter().filter(|d| d.health == "Healthy").count();
        writeln!(
            out,
            "   ListAndWatch: {} devices, {healthy} healthy; e.g. {}",
            list.devices.len(),
            list.devices.first().map(|d| d.id.as_str()).unwrap_or("(none)")
        )?;
        let first = list
            .devices
            .first()
            .context("the device plugin listed no devices")?;
        let response = client
            .allocate(AllocateRequest {
                container_requests: vec![ContainerAllocateRequest {
                    devices_ids: vec![first.id.clone()],
                }],
            })
            .await?
            .into_inner();
        let container = response
            .container_responses
            .first()
            .context("Allocate answered no container")?;
        let visible = container
            .envs
            .get("NVIDIA_VISIBLE_DEVICES")
            .context("Allocate set no NVIDIA_VISIBLE_DEVICES")?;
        ensure!(
            visible == &first.id,
            "Allocate exposed {visible}, not the device {} it was asked for",
            first.id
        );
        writeln!(
            out,
            "   A pod with resources.limits {{{}: 1}} is allocated {}: NVIDIA_VISIBLE_DEVICES={visible}\n",
            req.resource_name, first.id
        )?;
        Ok::<_, anyhow::Error>(())
    }
    .await;

    stop.cancel();
    let stopped = daemon
        .await
        .context("the device-plugin daemon task panicked")?;
    let served = kubelet.await.context("the kubelet stand-in panicked")?;
    result?;
    stopped?;
    served.context("the kubelet stand-in failed")?;
    Ok(())
}
