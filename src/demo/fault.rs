//! The demo's fault: XID 79 ("GPU has fallen off the bus") on GPU 3, written to the daemon's
//! fault file as an operator would (`echo xid 3 79 >> faults`), and what the kubelet and the
//! scheduler then see — the device `Unhealthy` with its cause on the DRA health stream, and a
//! taint on the device in the published ResourceSlice (the device stays listed, so a running
//! pod's device does not vanish).

use std::io::Write;
use std::path::Path;

use anyhow::{Context, Result, bail};
use k8s_openapi::api::resource::v1::DeviceTaint;

use super::{PATIENCE, wait_for_slices};
use kubelet_plugin::proto::health::v1::{
    HealthStatus, NodeWatchResourcesRequest, dra_resource_health_client::DraResourceHealthClient,
};
use kubelet_plugin::socket::connect as connect_unix;

const DEVICE: &str = "gpu-3";

pub async fn run<T>(
    out: &mut (dyn Write + Send),
    root: &Path,
    dra_socket: &Path,
    slices_dir: &Path,
    daemon: &tokio::task::JoinHandle<T>,
    step: u32,
) -> Result<()> {
    let mut health = DraResourceHealthClient::new(connect_unix(dra_socket).await?);
    let mut stream = health
        .node_watch_resources(NodeWatchResourcesRequest {})
        .await?
        .into_inner();
    // The first message is the full list, all healthy.
    stream
        .message()
        .await?
        .context("the health stream ended before its first list")?;

    let faults = root.join("faults");
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&faults)
        .with_context(|| format!("cannot open the fault file {}", faults.display()))?;
    writeln!(file, "xid 3 79")?;
    writeln!(
        out,
        "{step}. An operator's `echo xid 3 79 >> {}` (GPU 3 fell off the bus):",
        faults.display()
    )?;

    let message = tokio::time::timeout(PATIENCE, async {
        loop {
            let list = stream.message().await?.context("the health stream ended")?;
            let sick = list.devices.iter().find(|d| {
                d.health == HealthStatus::Unhealthy as i32
                    && d.device.as_ref().is_some_and(|id| id.device_name == DEVICE)
            });
            if let Some(d) = sick {
                return Ok::<_, anyhow::Error>(d.message.clone());
            }
        }
    })
    .await
    .context("the health stream did not report the fault within the demo's patience")??;
    writeln!(
        out,
        "   health stream (v1.DRAResourceHealth): {DEVICE} Unhealthy: {message}"
    )?;

    let taint = tokio::time::timeout(PATIENCE, async {
        loop {
            let slices = wait_for_slices(slices_dir, daemon).await?;
            let taint: Option<DeviceTaint> = slices
                .iter()
                .flat_map(|s| s.spec.devices.iter().flatten())
                .find(|d| d.name == DEVICE)
                .and_then(|d| d.taints.as_ref()?.first().cloned());
            if let Some(t) = taint {
                return Ok::<_, anyhow::Error>(t);
            }
            if daemon.is_finished() {
                bail!("the daemon stopped before tainting {DEVICE}");
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    })
    .await
    .context("the slice did not taint the device within the demo's patience")??;
    writeln!(
        out,
        "   ResourceSlice: {DEVICE} stays listed, tainted {}={} effect {} — the scheduler places no new claim on it\n",
        taint.key,
        taint.value.as_deref().unwrap_or(""),
        taint.effect
    )?;
    Ok(())
}
