//! `nvdra compute-domain plugin`: the compute-domain kubelet plugin (driver
//! `compute-domain.nvidia.com`), a second driver on the kubelet-plugin library beside nvdra's
//! GPU driver, as NVIDIA's `compute-domain-kubelet-plugin`.
//!
//! - [`devices`]: what it publishes per node (NVIDIA's `channel-0` and `daemon-0`, attributes
//!   `type` and `id`), the channel's binding conditions and taint, and the character devices it
//!   injects (major from `/proc/devices`).
//! - [`prepare`]: prepare and unprepare ([`prepare::Plugin`], the library's `Driver`): a channel
//!   claim gets `/dev/nvidia-caps-imex-channels/channel<N>`, a daemon claim what NVIDIA's daemon
//!   container gets; a channel whose daemon is not ready fails at once, never waits.
//! - [`readiness`]: the node label, the binding conditions (KEP-5007) and the taint that keep a
//!   pod from binding where its domain's daemon is not ready.
//! - [`base`]: what a daemon claim's container gets besides its domain (NVIDIA's base spec:
//!   the node's NVIDIA device nodes and the driver's files).
//! - [`checkpoint`]: the plugin's own checkpoint (prepared claims survive a restart).
//! - [`cluster`]: the ComputeDomain objects, Node labels and claims the plugin reads and writes,
//!   behind a trait (kube-rs, or in memory for tests).
//!
//! Privileges: none beyond root's ownership of the kubelet's and the CDI directories (the
//! container runs as uid 0 with every capability dropped). The channels are created by the
//! container runtime from the CDI spec (type, major, minor), never by the plugin: no `mknod`.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use kubelet_plugin::{CancellationToken, Options};

use crate::computedomain::api::DRIVER_NAME;

pub mod base;
pub mod checkpoint;
pub mod cluster;
pub mod devices;
pub mod prepare;
pub mod readiness;

/// Whether the node's channel carries binding conditions (KEP-5007).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum BindingConditions {
    /// On where the API server is Kubernetes 1.36 or later (the feature's beta, on by default).
    Auto,
    /// Always: the scheduler must have `DRADeviceBindingConditions` on, or it never allocates
    /// the channel.
    On,
    /// Never: a pod is bound at once and its prepare fails (and is retried) until the daemon is
    /// ready.
    Off,
}

/// Flags of `nvdra compute-domain plugin` (README, "Compute domains": the plugin's table).
#[derive(Debug, clap::Args)]
pub struct Args {
    /// This node's name (the downward API's `spec.nodeName`).
    #[arg(long, env = "NODE_NAME")]
    pub node_name: String,
    /// This pod's UID (the downward API's `metadata.uid`): sockets apart for rolling updates.
    #[arg(long, env = "POD_UID")]
    pub pod_uid: Option<String>,
    /// The driver's namespace, where the daemons' ComputeDomainCliques are.
    #[arg(long, env = "NAMESPACE", default_value = "nvdra")]
    pub namespace: String,
    /// The kubelet's root directory (`--root-dir`).
    #[arg(long, env = "KUBELET_ROOT", default_value = "/var/lib/kubelet")]
    pub kubelet_root: PathBuf,
    /// Where CDI specs go.
    #[arg(long, env = "CDI_ROOT", default_value = "/var/run/cdi")]
    pub cdi_root: PathBuf,
    /// The kernel's device list, for the IMEX channels' and capabilities' majors.
    #[arg(long, env = "PROC_DEVICES", default_value = "/proc/devices")]
    pub proc_devices: PathBuf,
    /// The NVIDIA driver's capabilities directory (`fabric-imex-mgmt`, for the daemon).
    #[arg(
        long,
        env = "CAPABILITIES_ROOT",
        default_value = "/proc/driver/nvidia/capabilities"
    )]
    pub capabilities_root: PathBuf,
    /// Root of the NVIDIA driver installation on the host (`/`, or `/run/nvidia/driver` with
    /// the GPU Operator's driver container): a daemon's container gets its files.
    #[arg(long, env = "NVIDIA_DRIVER_ROOT", default_value = "/")]
    pub driver_root: PathBuf,
    /// Host root whose dev/ holds the NVIDIA device nodes (/dev when it has none); defaults to
    /// the driver root.
    #[arg(long, env = "NVIDIA_DEV_ROOT")]
    pub dev_root: Option<PathBuf>,
    /// Where the host's driver root is mounted in this container; defaults to the driver root.
    #[arg(long, env = "DRIVER_ROOT_CTR_PATH")]
    pub driver_root_ctr_path: Option<PathBuf>,
    /// The node's NVLink clique, `<clusterUUID>.<cliqueID>`; without it, what nvdra's GPU driver
    /// publishes for the node's GPUs, else the node's `nvidia.com/gpu.clique` label (none: the
    /// node is on no fabric).
    #[arg(long, env = "CLIQUE_ID")]
    pub clique_id: Option<String>,
    /// Binding conditions on the node's channel: auto, on or off.
    #[arg(long, env = "BINDING_CONDITIONS", value_enum, default_value = "auto")]
    pub binding_conditions: BindingConditions,
    /// Seconds between two readiness passes (a claim's change starts one at once).
    #[arg(long, env = "RESYNC_SECONDS", default_value = "5")]
    pub resync_seconds: u64,
    /// A kubeconfig; without one, the in-cluster config.
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
}

/// Runs the plugin until SIGTERM or SIGINT.
pub fn run(args: Args) -> anyhow::Result<()> {
    let rt = crate::daemon::runtime().context("cannot start the async runtime")?;
    rt.block_on(async move {
        let stop = CancellationToken::new();
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .context("cannot handle SIGTERM")?;
        let on_signal = stop.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
            tracing::info!("stopping");
            on_signal.cancel();
        });
        let client = client(args.kubeconfig.as_deref()).await?;
        serve(args, client, stop).await
    })
}

async fn client(kubeconfig: Option<&std::path::Path>) -> anyhow::Result<kube::Client> {
    let config = match kubeconfig {
        Some(path) => {
            let file = kube::config::Kubeconfig::read_from(path)
                .with_context(|| format!("cannot read kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(file, &Default::default())
                .await
                .with_context(|| format!("kubeconfig {} is not usable", path.display()))?
        }
        None => kube::Config::infer().await.context(
            "no in-cluster config and no usable kubeconfig (run in a pod, or pass --kubeconfig)",
        )?,
    };
    kube::Client::try_from(config).context("cannot build a kube client")
}

/// Whether binding conditions are on, `auto` deciding by the API server's version.
async fn binding_conditions(mode: BindingConditions, client: &kube::Client) -> bool {
    match mode {
        BindingConditions::On => true,
        BindingConditions::Off => false,
        BindingConditions::Auto => {
            match cluster::within("read the API server's version", client.apiserver_version())
                .await
                .and_then(|r| r.context("cannot read the API server's version"))
            {
                Ok(v) => {
                    let minor: u32 = v
                        .minor
                        .trim_end_matches(|c: char| !c.is_ascii_digit())
                        .parse()
                        .unwrap_or(0);
                    v.major == "1" && minor >= 36
                }
                Err(e) => {
                    tracing::warn!(error = format!("{e:#}"), "binding conditions off");
                    false
                }
            }
        }
    }
}

/// Serves the plugin with `client` until `stop`.
pub async fn serve(
    args: Args,
    client: kube::Client,
    stop: CancellationToken,
) -> anyhow::Result<()> {
    let cluster = cluster::KubeCluster::start(
        client.clone(),
        &args.namespace,
        &args.node_name,
        stop.clone(),
    );
    let bc = binding_conditions(args.binding_conditions, &client).await;
    serve_with(args, client.clone(), Arc::new(client), cluster, bc, stop).await
}

/// Serves the plugin with the given parts until `stop`: claims read through `claims`, slices
/// written through `slices`, the rest through `cluster` (unit tests pass a `MemoryCluster`).
pub async fn serve_with(
    args: Args,
    claims: impl kubelet_plugin::claims::ClaimSource,
    slices: Arc<dyn kubelet_plugin::api::SliceApi>,
    cluster: Arc<dyn cluster::Cluster>,
    binding_conditions: bool,
    stop: CancellationToken,
) -> anyhow::Result<()> {
    let mut opts =
        Options::new(DRIVER_NAME, &args.node_name, claims)?.kubelet_root(&args.kubelet_root);
    if let Some(uid) = &args.pod_uid {
        opts = opts.pod_uid(uid);
    }
    let paths = prepare::Paths {
        plugin_dir: opts.plugin_dir(),
        cdi_root: args.cdi_root.clone(),
        proc_devices: args.proc_devices.clone(),
        capabilities_root: args.capabilities_root.clone(),
        driver_root: crate::cdi::DriverRoot::new(
            args.driver_root.clone(),
            args.driver_root_ctr_path
                .clone()
                .unwrap_or_else(|| args.driver_root.clone()),
            args.dev_root
                .clone()
                .unwrap_or_else(|| args.driver_root.clone()),
        ),
    };
    let plugin = Arc::new(prepare::Plugin::new(
        &args.node_name,
        &args.namespace,
        args.clique_id.clone(),
        paths,
        cluster,
    )?);
    tracing::info!(
        node = %args.node_name,
        binding_conditions,
        clique = ?args.clique_id,
        "compute-domain plugin starting"
    );
    let (publisher, handle) = opts.publisher(slices);
    let publishing = tokio::spawn(publisher.run(stop.clone()));
    let ready = tokio::spawn(readiness::run(
        plugin.clone(),
        handle,
        binding_conditions,
        Duration::from_secs(args.resync_seconds.max(1)),
        stop.clone(),
    ));
    let served = kubelet_plugin::serve(plugin, opts, stop.clone()).await;
    stop.cancel();
    let _ = ready.await;
    let _ = publishing.await;
    served.context("the kubelet plugin stopped")
}
