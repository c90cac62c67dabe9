//! `nvdra demo`: the whole DRA flow on simulated GPUs, narrated, with no cluster and no GPU.
//!
//! It runs the real daemon ([`crate::daemon::run`]) on a simulated DGX H100 with the directory
//! API in a temporary directory, and plays the kubelet's part over the real sockets: the
//! registration handshake, reading the published ResourceSlices, preparing two claims that want
//! the same GPU (the second is refused until the first is released), unpreparing, a claim that
//! cannot fit explained by `nvdra match` ([`explain`]), two pods sharing one GPU by memory
//! (`--shared-capacity`, [`shares`]), and a GPU fault injected through the fault file
//! ([`fault`]); then the same node as a legacy device plugin ([`legacy`]). Everything it prints comes from what the
//! daemon wrote or answered.

mod explain;
mod fault;
mod legacy;
mod shapes;
mod shares;

use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::api::resource::v1::{
    DeviceAllocationConfiguration, OpaqueDeviceConfiguration, ResourceSlice,
};
use k8s_openapi::apimachinery::pkg::runtime::RawExtension;
use tokio_util::sync::CancellationToken;

use crate::config::{Api, Backend, Config, LogFormat, Mode};
use crate::inventory::sim::SimBackend;
use kubelet_plugin::proto::dra::v1;
use kubelet_plugin::proto::pluginregistration::{
    InfoRequest, RegistrationStatus, registration_client::RegistrationClient,
};
use kubelet_plugin::socket::connect as connect_unix;

const PROFILE: &str = "dgx-h100";
const NODE: &str = "demo-node";
const DRIVER: &str = "gpu.nvidia.com";
const NAMESPACE: &str = "demo";

/// How long the demo waits for the daemon to reach a step before giving up.
const PATIENCE: Duration = Duration::from_secs(30);

/// Runs the demo, printing to `out`.
pub async fn run(out: &mut (dyn Write + Send)) -> Result<()> {
    let dir = tempfile::Builder::new()
        .prefix("nvdra-demo-")
        .tempdir()
        .context("cannot create a temporary directory")?;
    let root = dir.path();
    let config = Config {
        mode: Mode::Dra,
        backend: Backend::Profile(PROFILE.into()),
        node_name: NODE.into(),
        driver_name: DRIVER.into(),
        driver_root: crate::cdi::DriverRoot::at(&root.join("driver")),
        kubelet_root: root.join("kubelet"),
        cdi_root: root.join("cdi"),
        device_metadata: false,
        api: Api::Dir(root.join("api")),
        metrics_address: "127.0.0.1:0".parse().context("loopback address")?,
        log_format: LogFormat::Plain,
        partitionable: false,
        shared_capacity: crate::config::ConsumableShares::Memory,
        dynamic_mig: crate::config::DynamicMig::On,
        mig_profiles: None,
        share_trust_domain: Default::default(),
        pod_uid: None,
        device_plugin_config: None,
        device_plugin_gpu_memory: false,
        health: Default::default(),
        fault_file: Some(root.join("faults")),
        mps_probe_interval: Duration::from_secs(5),
        node_labels: false,
        // The directory API keeps no claim status.
        claim_status: false,
        mps_root: root.join("mps"),
    };
    let sim = SimBackend::from_profile(PROFILE, NODE)?;

    writeln!(
        out,
        "nvdra demo: a simulated {PROFILE} node named {NODE}, no cluster needed"
    )?;
    writeln!(out, "  working directory: {}", root.display())?;
    writeln!(
        out,
        "  (the API server is the directory {}/api)\n",
        root.display()
    )?;

    let mut mps_host = shares::start_mps_host(config.driver_root.ctr(), &config.mps_root)?;
    // Two claims the scheduler allocated: both got gpu-0, as after a force-deleted pod.
    write_claim(root, "train", "uid-train", &["gpu-0", "gpu-1"], true)?;
    write_claim(root, "notebook", "uid-notebook", &["gpu-0"], false)?;

    let api = crate::api::connect(&config.api).await?;
    let stop = CancellationToken::new();
    let reg_socket = config.registry_dir().join(format!("{DRIVER}-reg.sock"));
    let dra_socket = config.plugin_dir().join("dra.sock");
    let slices_dir = root.join("api/resourceslices");
    let daemon = tokio::spawn(crate::daemon::run(
        config.clone(),
        crate::daemon::Extras::default(),
        Arc::new(sim.clone()),
        api,
        stop.clone(),
    ));

    let result = async {
        // 1. Registration, as the kubelet's plugin watcher does it.
        wait_for(&reg_socket, &daemon).await?;
        let mut reg = RegistrationClient::new(connect_unix(&reg_socket).await?);
        let info = reg.get_info(InfoRequest {}).await?.into_inner();
        writeln!(out, "1. The kubelet finds {} and asks who is there:", reg_socket.display())?;
        writeln!(
            out,
            "   {} plugin {:?} at {} speaking {:?}",
            info.r#type, info.name, info.endpoint, info.supported_versions
        )?;
        reg.notify_registration_status(RegistrationStatus {
            plugin_registered: true,
            error: String::new(),
        })
        .await?;
        writeln!(out, "   registered.\n")?;

        // 2. The published slices.
        let slices = wait_for_slices(&slices_dir, &daemon).await?;
        let devices: Vec<&k8s_openapi::api::resource::v1::Device> = slices
            .iter()
            .flat_map(|s| s.spec.devices.iter().flatten())
            .collect();
        writeln!(
            out,
            "2. nvdra published {} ResourceSlice(s) with {} devices for pool {NODE}:",
            slices.len(),
            devices.len()
        )?;
        let shareable = devices
            .iter()
            .filter(|d| d.allow_multiple_allocations == Some(true))
            .count();
        writeln!(
            out,
            "   ({shareable} of them allocatable whole or in shares by memory, --shared-capacity)"
        )?;
        for d in devices.iter().take(2) {
            let attrs = d.attributes.as_ref();
            let text = |k: &str| {
                attrs
                    .and_then(|a| a.get(k))
                    .map(|v| {
                        v.string
                            .clone()
                            .or(v.version.clone())
                            .or(v.int.map(|i| i.to_string()))
                            .or(v.bool.map(|b| b.to_string()))
                            .unwrap_or_default()
                    })
                    .unwrap_or_default()
            };
            let memory = d
                .capacity
                .as_ref()
                .and_then(|c| c.get("memory"))
                .map(|q| q.value.0.clone())
                .unwrap_or_default();
            writeln!(
                out,
                "   {}: {} {memory}, CUDA {}, driver {}, NUMA {}, nvlinkDomain {}",
                d.name,
                text("productName"),
                text("cudaComputeCapability"),
                text("driverVersion"),
                text("numaNode"),
                text("nvlinkDomain")
            )?;
        }
        writeln!(out, "   ... (nvdra inventory --profile {PROFILE} -o slices shows them all)\n")?;

        // 3. What a claim that does not fit is told.
        explain::run(out, &slices, 3)?;

        // 4. Prepare.
        let mut dra = v1::dra_plugin_client::DraPluginClient::new(connect_unix(&dra_socket).await?);
        let train = prepare(&mut dra, "train", "uid-train").await?;
        ensure!(train.error.is_empty(), "preparing demo/train failed: {}", train.error);
        writeln!(out, "4. The kubelet prepares claim {NAMESPACE}/train (two GPUs, time-sliced):")?;
        for d in &train.devices {
            writeln!(out, "   {} -> {}", d.device_name, d.cdi_device_ids.join(", "))?;
        }
        let spec_path = root
            .join("cdi")
            .join(format!("k8s.{DRIVER}-claim_uid-train.yaml"));
        let spec = std::fs::read_to_string(&spec_path)
            .with_context(|| format!("prepare wrote no CDI spec at {}", spec_path.display()))?;
        // The GPUs a container gets are the spec's device nodes; its env says `void` so that a
        // legacy NVIDIA runtime hook adds none (as NVIDIA's driver writes it).
        let visible = spec
            .lines()
            .find(|l| l.contains("NVIDIA_VISIBLE_DEVICES="))
            .map(str::trim)
            .unwrap_or("(no NVIDIA_VISIBLE_DEVICES)");
        let gpu_nodes: Vec<&str> = spec
            .lines()
            .map(str::trim)
            .filter_map(|l| l.trim_start_matches("- ").strip_prefix("path: "))
            .filter(|p| {
                p.strip_prefix("/dev/nvidia")
                    .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
            })
            .collect();
        writeln!(out, "   CDI spec {}:", spec_path.display())?;
        writeln!(out, "     GPU device nodes: {}", gpu_nodes.join(", "))?;
        writeln!(out, "     {visible}")?;
        ensure!(
            gpu_nodes.contains(&"/dev/nvidia0"),
            "the CDI spec does not give gpu-0's device node"
        );
        let actions = sim.actions();
        writeln!(
            out,
            "   the simulated GPUs recorded: {}\n",
            actions
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("; ")
        )?;

        // 5. A second claim for the same GPU is refused, with the reason.
        let notebook = prepare(&mut dra, "notebook", "uid-notebook").await?;
        ensure!(
            !notebook.error.is_empty(),
            "gpu-0 was handed to two claims"
        );
        writeln!(out, "5. Claim {NAMESPACE}/notebook also wants gpu-0; nvdra refuses:")?;
        writeln!(out, "   {}\n", notebook.error)?;

        // 6. Unprepare frees it.
        let un = unprepare(&mut dra, "train", "uid-train").await?;
        ensure!(un.is_empty(), "unpreparing demo/train failed: {un}");
        ensure!(!spec_path.exists(), "unprepare left the CDI spec");
        let notebook = prepare(&mut dra, "notebook", "uid-notebook").await?;
        ensure!(notebook.error.is_empty(), "preparing demo/notebook failed: {}", notebook.error);
        writeln!(
            out,
            "6. After {NAMESPACE}/train is unprepared (its CDI spec removed), {NAMESPACE}/notebook gets {}.\n",
            notebook
                .devices
                .iter()
                .map(|d| d.device_name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        )?;
        let un = unprepare(&mut dra, "notebook", "uid-notebook").await?;
        ensure!(un.is_empty(), "unpreparing demo/notebook failed: {un}");

        // 7. Two pods share one GPU by memory.
        shares::run(out, root, &mut dra, &slices, 7).await?;

        // 8. One H100 whole, in two MIG devices, and whole again.
        let (gpu, uuid) = shapes::reshapeable(&slices)
            .context("no GPU of the demo is published whole and in MIG placements")?;
        shapes::run(out, root, &mut dra, &slices_dir, &daemon, &sim, (&gpu, &uuid), 8).await?;

        // 9. A GPU fault reaches the health stream and the slices.
        fault::run(out, root, &dra_socket, &slices_dir, &daemon, 9).await?;
        Ok::<_, anyhow::Error>(())
    }
    .await;

    stop.cancel();
    let stopped = daemon.await.context("the daemon task panicked")?;
    // Its daemons die with it.
    let _ = mps_host.kill();
    let _ = mps_host.wait();
    result?;
    stopped?;
    writeln!(
        out,
        "   The daemon shut down cleanly and removed its sockets.\n"
    )?;

    legacy::run(out, config, SimBackend::from_profile(PROFILE, NODE)?, 10).await?;
    writeln!(
        out,
        "Next: deploy for real with `kubectl apply -k manifests/overlays/plain` (README, Deploying)."
    )?;
    Ok(())
}

fn write_claim(
    root: &Path,
    name: &str,
    uid: &str,
    devices: &[&str],
    time_sliced: bool,
) -> Result<()> {
    let results = devices
        .iter()
        .map(|d| crate::api::allocated_device("gpus", DRIVER, NODE, d))
        .collect();
    let config = time_sliced.then(|| {
        vec![DeviceAllocationConfiguration {
            source: "FromClaim".into(),
            requests: None,
            opaque: Some(OpaqueDeviceConfiguration {
                driver: DRIVER.into(),
                parameters: RawExtension(serde_json::json!({
                    "apiVersion": "resource.nvidia.com/v1beta1",
                    "kind": "GpuConfig",
                    "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Short"}},
                })),
            }),
        }]
    });
    let claim =
        crate::api::allocated_claim(NAMESPACE, name, uid, results, config.unwrap_or_default());
    crate::api::dir::write_claim(&root.join("api"), &claim)?;
    Ok(())
}

fn claim(name: &str, uid: &str) -> Vec<v1::Claim> {
    vec![v1::Claim {
        namespace: NAMESPACE.into(),
        uid: uid.into(),
        name: name.into(),
    }]
}

/// The kubelet's DRA client.
type DraClient = v1::dra_plugin_client::DraPluginClient<tonic::transport::Channel>;

async fn prepare(
    dra: &mut DraClient,
    name: &str,
    uid: &str,
) -> Result<v1::NodePrepareResourceResponse> {
    let mut r = dra
        .node_prepare_resources(v1::NodePrepareResourcesRequest {
            claims: claim(name, uid),
        })
        .await?
        .into_inner();
    r.claims
        .remove(uid)
        .context("no response entry for the claim")
}

async fn unprepare(dra: &mut DraClient, name: &str, uid: &str) -> Result<String> {
    let mut r = dra
        .node_unprepare_resources(v1::NodeUnprepareResourcesRequest {
            claims: claim(name, uid),
        })
        .await?
        .into_inner();
    Ok(r.claims
        .remove(uid)
        .context("no response entry for the claim")?
        .error)
}

pub(super) async fn wait_for<T>(path: &Path, daemon: &tokio::task::JoinHandle<T>) -> Result<()> {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while !path.exists() {
        if daemon.is_finished() {
            bail!("the daemon stopped before creating {}", path.display());
        }
        if tokio::time::Instant::now() > deadline {
            bail!("{} did not appear within {PATIENCE:?}", path.display());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

pub(super) async fn wait_for_slices<T>(
    dir: &Path,
    daemon: &tokio::task::JoinHandle<T>,
) -> Result<Vec<ResourceSlice>> {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        let mut slices = Vec::new();
        if let Ok(entries) = std::fs::read_dir(dir) {
            for e in entries.flatten() {
                let path = e.path();
                let hidden = e.file_name().to_string_lossy().starts_with('.');
                if !hidden && path.extension().is_some_and(|x| x == "yaml") {
                    let text = std::fs::read_to_string(&path)?;
                    slices.push(crate::yaml::from_str::<ResourceSlice>(&text)?);
                }
            }
        }
        // The whole pool: as many slices as each says it has (one generation).
        let complete = slices.first().is_some_and(|first| {
            let pool = &first.spec.pool;
            slices.len() as i64 == pool.resource_slice_count
                && slices
                    .iter()
                    .all(|s| s.spec.pool.generation == pool.generation)
        });
        if complete {
            // In device order (slice names are generated): the scheduler's first fit.
            slices.sort_by_cached_key(|s| {
                s.spec
                    .devices
                    .iter()
                    .flatten()
                    .map(|d| d.name.clone())
                    .min()
                    .unwrap_or_default()
            });
            return Ok(slices);
        }
        if daemon.is_finished() {
            bail!("the daemon stopped before publishing slices");
        }
        if tokio::time::Instant::now() > deadline {
            bail!("no ResourceSlices in {} within {PATIENCE:?}", dir.display());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
