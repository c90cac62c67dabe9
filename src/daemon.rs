//! `nvdra run`: wires the long-lived tasks of a node agent and owns their shutdown.
//!
//! Start order (each step only once the previous one works, so the kubelet never sees a
//! registration without a serving endpoint):
//! 0. the metrics port is bound first: a taken port fails the start before anything exists;
//!    then the inventory owner ([`crate::inventory::owner`]) takes its first read: from here
//!    on it is the only reader of the backend, and every consumer below reads its watch; then
//!    the health monitor is created (and NVML's event thread started) so that every consumer
//!    subscribes to it, and every inventory read carries its state;
//! 1. the checkpoint writer, then recovery of what a crash or reboot left behind;
//! 2. the DRA gRPC server (`v1` + `v1beta1` + health) on its socket;
//! 3. the registration server in `plugins_registry/`;
//! 4. the ResourceSlice publisher and the metrics endpoint.
//!
//! `--mode device-plugin` runs only the metrics endpoint and the device plugin
//! ([`crate::deviceplugin`]): no checkpoint, no DRA socket, no publisher. `both` adds the device
//! plugin to the DRA tasks, sharing the DRA ledger ([`crate::deviceplugin::both`]): a GPU a claim
//! holds is unhealthy to the device manager, and one a container holds (PodResources) is hidden
//! from the slices. `auto` asks the API server first: without `resource.k8s.io/v1` it runs as
//! `device-plugin`; with it as `both`, the device plugin serving only the resource names no
//! DeviceClass maps ([`auto`]). Either way NVIDIA's config file is read and
//! checked against the inventory before anything is served.
//!
//! A start that fails leaves nothing behind: each socket this instance binds is owned by an
//! [`socket::OwnedSockets`] guard that unlinks it on every way out of [`run`] — but only while
//! the path still holds the socket this instance bound, never another instance's.
//!
//! Every mode starts through the one path above ([`run`]), skipping what it does not run; every
//! long-lived task is named and supervised ([`supervise`]).
//!
//! Shutdown: the first SIGTERM or SIGINT cancels every task; the servers stop accepting, remove
//! their sockets and finish in-flight calls; then the checkpoint writer flushes and stops, and
//! the metrics endpoint last. A second signal exits at once. Any task ending by itself —
//! returning, failing or panicking — is a failure: `/readyz` fails naming it, everything else
//! is stopped and [`run`] returns an error naming it, so the process exits non-zero and the
//! DaemonSet restarts it.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use std::convert::Infallible;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::api::ClusterApi;
use crate::config::{Config, Mode};
use crate::deviceplugin::{self, DevicePlugin};
use crate::dra::health::NodeHealth;
use crate::dra::plugin::{self, Plugin};
use crate::dra::slices;
use crate::dra::sync::{self, SliceSync};
use crate::holds::ContainerHolds;
use crate::inventory::owner::{self, InventoryHandle, Owner, Writes};
use crate::inventory::{Backend, Reconfigure};
use crate::ledger;
use crate::metrics::attribution::Attribution;
use crate::metrics::{self, Metrics};
use crate::report;
use crate::versions;
use kubelet_plugin::publisher::{self, Publisher};
use kubelet_plugin::socket;

pub mod auto;
pub mod labels;
mod runtime;
mod supervise;

#[cfg(test)]
mod one_publication;

pub use runtime::{MAX_BLOCKING_THREADS, WORKER_THREADS, runtime};
#[cfg(feature = "crash-points")]
pub use supervise::KILL_ENV;
use supervise::Supervisor;

/// How long in-flight work may take to finish after the first signal.
pub const GRACE: Duration = Duration::from_secs(20);

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    DevicePluginConfig(#[from] deviceplugin::nvconfig::ConfigError),
    #[error("cannot start the device plugin")]
    DevicePlugin(#[from] deviceplugin::server::Error),
    #[error("cannot start the DRA plugin")]
    Start(#[from] plugin::StartError),
    #[error("recovering the checkpoint failed")]
    Recover(#[source] Box<plugin::ClaimError>),
    #[error(transparent)]
    Boot(#[from] ledger::Error),
    #[error(transparent)]
    Socket(#[from] kubelet_plugin::Error),
    #[error(transparent)]
    Names(#[from] kubelet_plugin::InvalidName),
    #[error("cannot listen for metrics on {addr}")]
    Metrics {
        addr: std::net::SocketAddr,
        source: std::io::Error,
    },
    #[error("cannot install signal handlers")]
    Signals(#[source] std::io::Error),
    #[error("cannot start the inventory reader thread")]
    Thread(#[source] std::io::Error),
    #[error("task {task} stopped unexpectedly: {reason}")]
    TaskDied { task: &'static str, reason: String },
    #[error("second signal: exiting without waiting for in-flight work")]
    Forced,
    #[error("tasks did not finish within {0:?} of the shutdown signal")]
    GraceExceeded(Duration),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Settings that are not part of the user-facing configuration.
#[derive(Clone, Debug, Default)]
pub struct Extras {
    /// Where the boot id is read (default `/proc/sys/kernel/random/boot_id`); tests point it at
    /// a file they control to simulate a reboot.
    pub boot_id_file: Option<PathBuf>,
    /// Where `/metrics` reads `<pid>/cgroup` to find a GPU process's pod (default `/proc`: with
    /// `hostPID`, the host's); tests give a fake one.
    pub proc_root: Option<PathBuf>,
    /// Crash tests only: stop at this point of prepare.
    #[cfg(feature = "crash-points")]
    pub crash_at: Option<plugin::crash::CrashPoint>,
    /// Crash tests only: the task that SIGUSR1 makes panic ([`KILL_ENV`]).
    #[cfg(feature = "crash-points")]
    pub kill_task: Option<String>,
}

/// Turns off what the backend cannot do on this node, saying so once: partitionable mode
/// without MIG creation would publish placements that every prepare refuses. Time slicing is
/// asked per claim, so it is only announced: such claims fail to prepare, naming the cause.
fn without_unavailable(mut config: Config, backend: &dyn Reconfigure) -> Config {
    use crate::inventory::Reconfiguration;
    if config.partitionable
        && let Some(why) = backend.unavailable(Reconfiguration::Mig)
    {
        tracing::warn!(
            "partitionable mode is off: {why}; MIG placements are not published, existing MIG devices are"
        );
        config.partitionable = false;
    }
    // Dynamic MIG switches modes and makes MIG devices at prepare: said once here, and each
    // such prepare fails naming the cause.
    if config.mode != Mode::DevicePlugin
        && config.dynamic_mig.enabled()
        && let Some(why) = backend.unavailable(Reconfiguration::Mig)
    {
        tracing::warn!(
            "dynamic MIG cannot change GPUs: {why}; claims that need a MIG mode switch or a new MIG device fail to prepare"
        );
    }
    // Only DRA claims ask for time slices.
    if config.mode != Mode::DevicePlugin
        && let Some(why) = backend.unavailable(Reconfiguration::TimeSlice)
    {
        tracing::warn!(
            "time slicing is unavailable: {why}; claims with a TimeSlicing config fail to prepare"
        );
    }
    config
}

/// How often the inventory owner reads the hardware when nobody asked: as often as the most
/// eager consumer read it before there was one owner (the device plugin's poll where it runs,
/// else the DRA health stream's interval).
fn rescan(config: &Config) -> Duration {
    match config.mode {
        Mode::Dra => kubelet_plugin::health::INTERVAL,
        Mode::DevicePlugin | Mode::Both | Mode::Auto => deviceplugin::server::POLL,
    }
}

/// Runs the node agent until a signal (or `stop`, for tests) ends it.
pub async fn run(
    config: Config,
    extras: Extras,
    backend: Arc<dyn Backend>,
    api: Arc<dyn ClusterApi>,
    stop: CancellationToken,
) -> Result<()> {
    // First: a taken port fails the start before the checkpoint or any socket is touched.
    let metrics_listener = metrics::bind(config.metrics_address)
        .await
        .map_err(|source| Error::Metrics {
            addr: config.metrics_address,
            source,
        })?;
    let metrics = Metrics::new();
    // Outlives the tasks: the servers stop (removing their sockets), then what is left goes.
    let mut owned = socket::OwnedSockets::default();
    let mut tasks = Supervisor::new(&stop, metrics.clone());
    #[cfg(feature = "crash-points")]
    tasks.kill_on_sigusr1(extras.kill_task.clone());
    let result = match start(
        config,
        &extras,
        backend,
        api,
        metrics,
        metrics_listener,
        &mut owned,
        &mut tasks,
    )
    .await
    {
        Ok(()) => tasks.run().await,
        Err(e) => {
            // What did start (the checkpoint writer among it) stops as on shutdown.
            if let Err(stopping) = tasks.stop().await {
                tracing::warn!(error = %stopping, "stopping after a failed start");
            }
            Err(e)
        }
    };
    // The servers removed their sockets; `owned` makes sure even a forced exit leaves none.
    drop(owned);
    result
}

/// Starts every task of `config.mode` under `tasks`, in the order the module doc gives.
#[allow(clippy::too_many_arguments)]
async fn start(
    config: Config,
    extras: &Extras,
    backend: Arc<dyn Backend>,
    api: Arc<dyn ClusterApi>,
    metrics: Arc<Metrics>,
    metrics_listener: tokio::net::TcpListener,
    owned: &mut socket::OwnedSockets,
    tasks: &mut Supervisor,
) -> Result<()> {
    // The inventory owner: the only reader of the backend. Its first read is taken now, so
    // that every consumer below starts from it; a failure is published (and logged) for the
    // consumers to report as they did when they read the backend themselves.
    let (mut owner, inventory) =
        Owner::new(backend.clone(), rescan(&config), owner::DEADLINE).map_err(Error::Thread)?;
    let _ = owner.read().await;
    warn_of_unlisted_profiles(&config, &inventory.latest());
    // The write side, for the DRA plugin alone.
    let writes = Writes::new(backend, inventory.clone());
    let config = without_unavailable(config, &writes);
    let monitor = HealthMonitor::start(&config, &inventory);
    // The owner lays the monitor's state over every publication: every consumer reads the node
    // with its health.
    let health = monitor.handle.subscribe();
    tasks.spawn("inventory", |token| async move {
        owner.run(health, token).await
    });
    metrics.set_info("backend", inventory.backend());
    metrics.set_info("driver", config.driver_name.clone());

    // `auto` becomes `device-plugin` without DRA, else `both` with the names DeviceClasses map
    // left to DRA.
    let mut config = config;
    let mut mapped = None;
    if config.mode == Mode::Auto {
        let (mode, m) = decide_auto(&api, tasks).await;
        config.mode = mode;
        mapped = m;
    }
    // `--node-labels`: GFD's labels, kept current beside whichever path runs.
    if config.node_labels {
        let options = match &config.device_plugin_config {
            Some(path) => deviceplugin::nvconfig::load(path)?,
            None => deviceplugin::Options::default(),
        };
        let (api, watch, node) = (api.clone(), inventory.subscribe(), config.node_name.clone());
        tasks.spawn("node-labels", |token| async move {
            labels::run(api, watch, options, node, labels::RETRY, token).await;
            Ok::<(), Infallible>(())
        });
    }
    let device_plugin = match config.mode {
        Mode::DevicePlugin | Mode::Both => Some(device_plugin(&config, inventory.subscribe())?),
        Mode::Dra | Mode::Auto => None,
    };
    let mut device_plugin = match mapped {
        Some(m) => device_plugin.map(|dp| dp.with_mapped(m)),
        None => device_plugin,
    };

    let plugin = if config.mode == Mode::DevicePlugin {
        tasks.install_signals()?;
        // Without DRA, ready means every resource is registered with the kubelet (there are
        // no slices to publish: the kubelet has the device lists).
        let m = metrics.clone();
        device_plugin = device_plugin.map(|dp| {
            dp.on_registered(Arc::new(move |all| {
                use std::sync::atomic::Ordering::Relaxed;
                m.registered.store(all, Relaxed);
                m.slices.published.store(all, Relaxed);
            }))
            // Which container holds which device: PodResources, read for `/metrics` only.
            .with_pod_resources(config.pod_resources_socket())
        });
        None
    } else {
        // `both`: one ledger for both paths, consulting what containers hold.
        let holds = device_plugin.as_ref().map(|_| ContainerHolds::default());
        let elsewhere = holds
            .clone()
            .map(|h| Arc::new(h) as Arc<dyn ledger::HeldElsewhere>);
        let plugin = start_dra(&config, extras, &api, writes, &metrics, elsewhere, tasks).await?;
        device_plugin = device_plugin.zip(holds).map(|(dp, holds)| {
            dp.with_ledger(
                plugin.ledger().clone(),
                holds,
                config.pod_resources_socket(),
            )
        });
        if let Some(dp) = &device_plugin {
            dp.observe_once().await;
        }
        Some(plugin)
    };
    // What a scrape reads: the claims, the containers, readings, XIDs, processes' pods.
    let source = scrape_source(
        &inventory,
        plugin.as_ref(),
        &monitor,
        device_plugin.as_ref(),
        extras,
    );
    if let Some(plugin) = &plugin {
        let holds = device_plugin.as_ref().and_then(DevicePlugin::holds);
        serve_dra(
            &config, plugin, holds, &monitor, &api, &inventory, &metrics, owned, tasks,
        )
        .await?;
    }
    monitor.spawn(inventory.subscribe(), tasks);
    if let Some(dp) = device_plugin {
        tasks.spawn("device-plugin", |token| dp.run(token));
    }
    // Last to stop: `/readyz` answers (failing) while the others drain.
    let m = metrics.clone();
    tasks.spawn_last("metrics", |token| async move {
        metrics::serve(metrics_listener, m, Some(source), token).await;
        Ok::<(), Infallible>(())
    });
    Ok(())
}

/// The DRA plugin over its checkpoint (consulting `elsewhere` at each reservation), the
/// checkpoint writer (stopping last, so it flushes what the servers recorded), and recovery of
/// what a crash or reboot left behind.
#[allow(clippy::too_many_arguments)]
async fn start_dra(
    config: &Config,
    extras: &Extras,
    api: &Arc<dyn ClusterApi>,
    writes: Writes,
    metrics: &Arc<Metrics>,
    elsewhere: Option<Arc<dyn ledger::HeldElsewhere>>,
    tasks: &mut Supervisor,
) -> Result<Plugin> {
    let boot_id_file = extras
        .boot_id_file
        .clone()
        .unwrap_or_else(|| PathBuf::from(ledger::BOOT_ID_PATH));
    let boot_id = ledger::read_boot_id(&boot_id_file)?;
    let (plugin, writer, outcome) = Plugin::new(
        plugin::Options {
            driver: config.driver_name.clone(),
            pool: config.node_name.clone(),
            plugin_dir: config.plugin_dir(),
            cdi_root: config.cdi_root.clone(),
            driver_root: config.driver_root.clone(),
            boot_id,
            partitionable: config.partitionable,
            shared_capacity: config.shared_capacity,
            mps_root: config.mps_root.clone(),
            dynamic_mig: config.dynamic_mig.enabled(),
            keep_mig_on: config.dynamic_mig == crate::config::DynamicMig::KeepOn,
            share_trust_domain: config.share_trust_domain.clone(),
            proc_root: extras.proc_root.clone(),
            claim_status: config.claim_status,
        },
        api.clone(),
        writes,
        metrics.clone(),
        elsewhere,
    )?;
    #[cfg(feature = "crash-points")]
    if let Some(at) = extras.crash_at {
        plugin.stop_at(at);
    }
    tracing::info!(checkpoint = %plugin.ledger().path().display(), ?outcome, "checkpoint loaded");
    tasks.spawn_last("checkpoint-writer", |token| async move {
        let r = writer.run(token).await;
        if r.is_ok() {
            tracing::info!("checkpoint flushed");
        }
        r
    });
    // Boxed: a claim's error is large, and every start-up result would carry its size.
    let rec = plugin
        .recover()
        .await
        .map_err(|e| Error::Recover(Box::new(e)))?;
    tracing::info!(
        rolled_back = rec.rolled_back.len(),
        cdi_rewritten = rec.cdi_rewritten.len(),
        orphans_removed = rec.orphans_removed.len(),
        "recovered state from the checkpoint"
    );
    Ok(plugin)
}

/// The DRA gRPC server, the registration socket, the slice publisher, with
/// `--shared-capacity` the share-daemon watch, and with `--dynamic-mig` the MIG switch watch.
#[allow(clippy::too_many_arguments)]
async fn serve_dra(
    config: &Config,
    plugin: &Plugin,
    holds: Option<ContainerHolds>,
    monitor: &HealthMonitor,
    api: &Arc<dyn ClusterApi>,
    inventory: &InventoryHandle,
    metrics: &Arc<Metrics>,
    owned: &mut socket::OwnedSockets,
    tasks: &mut Supervisor,
) -> Result<()> {
    tasks.install_signals()?;

    // The DRA side goes through the library as any driver does: it reads and checks the claims,
    // and serves the DRA socket, then registration. nvdra orders calls itself (one lock per
    // claim, different claims concurrently, and the node lock that reloads the checkpoint a
    // rolling update's other instance may have changed), so the library's serialization is off.
    let claims: Arc<dyn crate::api::ClaimReader> = api.clone();
    let registered = metrics.registered.clone();
    let health = NodeHealth::new(inventory.subscribe(), config.node_name.clone());
    let mut opts = kubelet_plugin::Options::new(&config.driver_name, &config.node_name, claims)?
        .kubelet_root(&config.kubelet_root)
        .serialize(false)
        .health(Arc::new(health))
        .on_registered(move |ok| registered.store(ok, std::sync::atomic::Ordering::Relaxed))
        // With --device-metadata, each prepared device's metadata file (KEP-5304), its CDI spec
        // beside the claims'.
        .device_metadata(config.device_metadata)
        .cdi_dir(&config.cdi_root);
    if let Some(uid) = &config.pod_uid {
        opts = opts.pod_uid(uid);
    }
    // Also with the flag off: files left from when it was on go.
    let files = opts.metadata_files().unwrap_or_else(|| {
        kubelet_plugin::metadata::Files::new(opts.driver(), &opts.plugin_dir(), &config.cdi_root)
    });
    plugin.retain_metadata(&files).await;
    let sockets = opts.sockets();
    let serving = kubelet_plugin::start(Arc::new(plugin.clone()), opts, tasks.shutdown().clone())?;
    // nvdra's own guard too: a forced exit (a second signal) leaves no socket behind either.
    owned.adopt(&sockets.dra);
    owned.adopt(&sockets.registration);
    tasks.spawn("dra-server", |_token| async move { serving.wait().await });

    publish(config, plugin, holds, api, inventory, metrics, tasks).await;
    if config.shared_capacity.enabled() {
        spawn_share_daemon_watch(config, plugin, monitor, tasks);
    }
    if config.dynamic_mig.enabled() {
        // Each read: a pending MIG mode change withdrawn, IN_USE blocks whose holders are gone
        // cleared.
        let (plugin, watch) = (plugin.clone(), inventory.subscribe());
        tasks.spawn("mig-switch-watch", |token| async move {
            plugin.watch_mig_switches(watch, token).await;
            Ok::<(), Infallible>(())
        });
    }
    Ok(())
}

/// What a `/metrics` scrape reads: the owner's publications and the GPUs' readings (through
/// `inventory`), the claims (`ledger`, absent without DRA), what containers hold through the
/// device plugin, the XID counts, processes' pods.
fn scrape_source(
    inventory: &InventoryHandle,
    plugin: Option<&Plugin>,
    monitor: &HealthMonitor,
    device_plugin: Option<&DevicePlugin>,
    extras: &Extras,
) -> Arc<Attribution> {
    let mut source = Attribution::new(inventory.subscribe(), inventory.clone())
        .with_monitor(monitor.handle.clone());
    if let Some(plugin) = plugin {
        let levels = plugin.clone();
        source = source
            .with_ledger(plugin.ledger().clone())
            .with_share_levels(Arc::new(move || levels.share_levels()));
    }
    if let Some(dp) = device_plugin
        && let Some(holds) = dp.holds()
    {
        source = source.with_holds(holds, dp.sharing_name());
    }
    if let Some(root) = &extras.proc_root {
        source = source.with_proc_root(root);
    }
    Arc::new(source)
}

/// How long `auto` waits for the first DeviceClass list before serving without it.
pub const FIRST_CLASSES: Duration = Duration::from_secs(10);

/// `--mode auto`: `device-plugin` where the API server lacks `resource.k8s.io/v1`, else `both`
/// with the DeviceClass mapping followed by a task of `tasks` (the first list awaited, up to
/// [`FIRST_CLASSES`], so a mapped name is never registered just to be withdrawn).
async fn decide_auto(
    api: &Arc<dyn ClusterApi>,
    tasks: &mut Supervisor,
) -> (Mode, Option<watch::Receiver<deviceplugin::Mapped>>) {
    let served = api.dra_served().await.unwrap_or_else(|e| {
        tracing::warn!(error = %report::chain(&e), "cannot ask the API server for resource.k8s.io/v1; assuming DRA is served");
        true
    });
    if !served {
        tracing::info!(
            "mode auto: the API server does not serve resource.k8s.io/v1; the device plugin serves every resource"
        );
        return (Mode::DevicePlugin, None);
    }
    let (tx, mut rx) = watch::channel(deviceplugin::Mapped::new());
    let api = api.clone();
    tasks.spawn("deviceclass-follow", |token| async move {
        auto::follow(api, tx, token).await;
        Ok::<(), Infallible>(())
    });
    if tokio::time::timeout(FIRST_CLASSES, rx.changed())
        .await
        .is_err()
    {
        tracing::warn!(wait = ?FIRST_CLASSES, "no DeviceClass list yet; serving every resource through the device plugin until one comes");
    }
    rx.mark_unchanged();
    tracing::info!(
        mapped = ?*rx.borrow(),
        "mode auto: DRA serves this node; the device plugin serves the resource names no DeviceClass maps"
    );
    (Mode::Both, Some(rx))
}

/// NVIDIA's config file (or its defaults) and the device plugin for it, checked against the
/// inventory: a MIG setup the strategy refuses fails the start.
fn device_plugin(config: &Config, node: owner::Watch) -> Result<DevicePlugin> {
    let mut options = match &config.device_plugin_config {
        Some(path) => deviceplugin::nvconfig::load(path)?,
        None => deviceplugin::Options::default(),
    };
    options.gpu_memory = config.device_plugin_gpu_memory;
    trust_domain_beside(config, &options)?;
    // Beside DRA, a GPU whose MIG mode DRA switches is DRA's to shape.
    options.dynamic_mig = config.mode == Mode::Both && config.dynamic_mig.enabled();
    let dp = DevicePlugin::new(
        deviceplugin::server::Settings {
            dir: config.device_plugin_dir(),
            driver: config.driver_name.clone(),
            driver_root: config.driver_root.clone(),
            cdi_root: config.cdi_root.clone(),
            watch: deviceplugin::server::WATCH,
        },
        options,
        node,
    );
    dp.check()?;
    Ok(dp)
}

/// Refuses `--share-trust-domain` beside a device-plugin config that shares GPUs (time-slicing
/// or MPS replicas): the kubelet's `Allocate` names no pod or namespace, so the device-plugin
/// path cannot keep a GPU's replicas in one domain, and a rule that silently does not hold on
/// part of the node is worse than none. (`--device-plugin-gpu-memory` is refused where the
/// configuration is resolved.)
fn trust_domain_beside(
    config: &Config,
    options: &deviceplugin::Options,
) -> Result<(), deviceplugin::nvconfig::ConfigError> {
    if !config.share_trust_domain.enabled() || options.sharing.is_none() {
        return Ok(());
    }
    Err(deviceplugin::nvconfig::ConfigError {
        file: config
            .device_plugin_config
            .as_ref()
            .map(|p| p.display().to_string())
            .unwrap_or_default(),
        key: "sharing".into(),
        message: format!(
            "shares GPUs between pods (replicas), but --share-trust-domain={} keeps a GPU's \
             shares within one trust domain, and the kubelet's Allocate names no pod or \
             namespace, so the device-plugin path cannot hold to it: share GPUs through DRA \
             only (drop the sharing section, or --mode dra), or set --share-trust-domain=off",
            config.share_trust_domain
        ),
    })
}

/// One warning when a switch that is on meets a Kubernetes version whose scheduler has a known
/// bug that hits it (`crate::versions`): the slices are published all the same, as the claims the
/// bug does not touch still work.
fn warn_of_known_bugs(config: &Config, version: &versions::KubeVersion) {
    let on: Vec<versions::Switch> = [
        (config.partitionable, versions::Switch::Partitionable),
        (
            config.shared_capacity.enabled(),
            versions::Switch::SharedCapacity,
        ),
        (config.dynamic_mig.enabled(), versions::Switch::DynamicMig),
    ]
    .into_iter()
    .filter_map(|(on, s)| on.then_some(s))
    .collect();
    if let Some(message) = versions::warning(version, &on) {
        let bugs: Vec<String> = versions::hits(version, &on)
            .iter()
            .map(|(b, _)| format!("kubernetes#{}", b.issue))
            .collect();
        tracing::warn!(kubernetes.version = %version, bugs = %bugs.join(","), "{message}");
    }
}

/// Names the `--mig-profiles` entries no GPU of the node has, once at start (a typo publishes no
/// placement of that profile, silently otherwise).
fn warn_of_unlisted_profiles(config: &Config, read: &owner::Published) {
    let (Some(allowed), Some(inv)) = (&config.mig_profiles, &read.node) else {
        return;
    };
    if !(config.partitionable || config.dynamic_mig.enabled()) {
        return;
    }
    let unlisted = slices::unlisted_profiles(inv, allowed);
    if !unlisted.is_empty() {
        tracing::warn!(
            profiles = %unlisted.join(","),
            "no GPU of this node has these --mig-profiles entries; they publish nothing here \
             (check the spelling against `nvidia-smi mig -lgip`)"
        );
    }
}

/// Starts the ResourceSlice publisher (counting into the metrics, readiness included) and the
/// task feeding it the owner's publications. `holds`: in `both`, what containers hold through
/// the device plugin, hidden from the slices.
async fn publish(
    config: &Config,
    plugin: &Plugin,
    holds: Option<ContainerHolds>,
    api: &Arc<dyn ClusterApi>,
    inventory: &InventoryHandle,
    metrics: &Arc<Metrics>,
    tasks: &mut Supervisor,
) {
    let version = api.server_version().await.unwrap_or_else(|e| {
        tracing::warn!(error = %crate::report::chain(&e), "cannot read the API server version; assuming the newest slice rules");
        None
    });
    if let Some(v) = &version {
        warn_of_known_bugs(config, v);
    }
    let opts = slices::SliceOptions {
        driver: config.driver_name.clone(),
        node_name: config.node_name.clone(),
        partitionable: config.partitionable,
        shared_capacity: config.shared_capacity,
        dynamic_mig: config.dynamic_mig.enabled(),
        mig_profiles: config.mig_profiles.clone(),
        layout: sync::layout_for(version.map(|v| v.minor)),
    };
    let (publisher, handle) = Publisher::with_counters(
        api.clone(),
        &config.driver_name,
        &config.node_name,
        publisher::Options::default(),
        metrics.slices.clone(),
    );
    let mut slice_sync = SliceSync::new(inventory.subscribe(), handle, opts)
        .with_metrics(metrics.clone())
        .with_switch_blocks(plugin.switch_blocks());
    if let Some(holds) = holds {
        slice_sync = slice_sync.with_holds(holds);
    }
    tasks.spawn("publisher", |token| async move {
        publisher.run(token).await;
        Ok::<(), Infallible>(())
    });
    tasks.spawn("slice-sync", |token| async move {
        slice_sync.run(token).await;
        Ok::<(), Infallible>(())
    });
}

/// Where the daemon watch's rounds go: the health monitor, whose state taints a GPU whose share
/// daemon does not answer; the owner publishes it, and every consumer (the slices,
/// `nvdra_mps_daemon_up`) follows the publication.
impl plugin::DaemonReport for crate::health::MonitorHandle {
    fn report(&self, up: &crate::health::DaemonsAsked, down: &crate::health::DaemonsDown) {
        self.report_share_daemons(up.clone(), down.clone());
    }
}

/// The daemon watch (`--shared-capacity`): every `--mps-probe-interval`, each GPU with shares
/// is asked whether its daemon answers.
fn spawn_share_daemon_watch(
    config: &Config,
    plugin: &Plugin,
    monitor: &HealthMonitor,
    tasks: &mut Supervisor,
) {
    let report = Arc::new(monitor.handle.clone());
    let (plugin, interval) = (plugin.clone(), config.mps_probe_interval);
    tracing::debug!(?interval, "watching the share daemons");
    tasks.spawn("share-daemon-watch", |token| async move {
        plugin.watch_share_daemons(interval, report, token).await;
        Ok::<(), Infallible>(())
    });
}

/// The health monitor and its event source, created at start (so every consumer can subscribe)
/// and spawned with the other tasks.
struct HealthMonitor {
    monitor: crate::health::Monitor,
    handle: crate::health::MonitorHandle,
    faults: Option<crate::health::faults::FaultFile>,
    /// The backend's event thread (NVML's), supervised once spawned.
    events: Option<crate::inventory::events::EventThread>,
}

impl HealthMonitor {
    /// The source is the backend's own (NVML's event thread, started here), or the fault file
    /// for simulated GPUs; the recovery probe is the fault file's or the backend's. A backend
    /// whose event source cannot start still serves: its GPUs are then only as healthy as its
    /// inventory says, which is logged. The event thread ends once the monitor is gone; its
    /// death before is the daemon's ([`Supervisor::spawn_thread`]): a process restart opens NVML
    /// and registers the events again, as an in-process restart could not where NVML itself
    /// failed (and no event that came while it was down is replayed either way).
    fn start(config: &Config, inventory: &InventoryHandle) -> Self {
        // Probes go through the owner's handle, each under its deadline.
        let probe: Arc<dyn crate::health::Probe> = Arc::new(inventory.clone());
        let faults = config
            .fault_file
            .clone()
            .map(|path| crate::health::faults::FaultFile::new(path, probe.clone()));
        let probe = match &faults {
            Some(f) => f.probe(),
            None => probe,
        };
        let (monitor, handle) = crate::health::Monitor::new(config.health.clone(), probe);
        let backend = inventory.backend();
        let events = match inventory.start_health_events(Box::new(handle.events())) {
            None => {
                tracing::debug!(backend, "no hardware health events");
                None
            }
            Some(Ok(thread)) => {
                tracing::info!(backend, "watching GPU health events");
                Some(thread)
            }
            Some(Err(e)) => {
                tracing::warn!(
                    error = %e,
                    "cannot start the GPU health-event thread; GPU health is not monitored"
                );
                None
            }
        };
        Self {
            monitor,
            handle,
            faults,
            events,
        }
    }

    fn spawn(self, node: owner::Watch, tasks: &mut Supervisor) {
        let Self {
            monitor,
            handle,
            faults,
            events,
        } = self;
        if let Some(thread) = events {
            tasks.spawn_thread("health-events", thread);
        }
        if let Some(f) = faults {
            let events = handle.events();
            tasks.spawn("fault-file", |token| async move {
                f.run(events, node, token).await;
                Ok::<(), Infallible>(())
            });
        }
        tasks.spawn("health-monitor", |token| async move {
            monitor.run(token).await;
            Ok::<(), Infallible>(())
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::sim::SimBackend;
    use crate::inventory::{
        self, ComputeMode, GpuUuid, MemoryLimits, MigDevice, MigModeChange, MigUuid, Placement,
        Reconfiguration, TimeSlice,
    };
    use std::path::Path;

    /// A backend that can change nothing.
    struct Plain;
    impl Reconfigure for Plain {
        fn unavailable(&self, what: Reconfiguration) -> Option<String> {
            Some(format!("the plain backend does not support {what}"))
        }
        fn set_time_slice(&self, _: &GpuUuid, _: TimeSlice) -> inventory::Result<()> {
            unreachable!()
        }
        fn compute_mode(&self, _: &GpuUuid) -> inventory::Result<ComputeMode> {
            unreachable!()
        }
        fn set_compute_mode(&self, _: &GpuUuid, _: ComputeMode) -> inventory::Result<()> {
            unreachable!()
        }
        fn memory_limits(&self, _: &GpuUuid, _: &Path) -> inventory::Result<MemoryLimits> {
            unreachable!()
        }
        fn create_mig(&self, _: &GpuUuid, _: u32, _: Placement) -> inventory::Result<MigDevice> {
            unreachable!()
        }
        fn destroy_mig(&self, _: &GpuUuid, _: &MigUuid) -> inventory::Result<()> {
            unreachable!()
        }
        fn set_mig_mode(&self, _: &GpuUuid, _: bool) -> inventory::Result<MigModeChange> {
            unreachable!()
        }
    }

    fn partitionable() -> Config {
        let mut s = crate::config::Settings::default();
        s.backend.node_name = Some("node-a".into());
        s.plugin.partitionable = Some(true);
        crate::config::resolve(s, None).unwrap()
    }

    /// The device-plugin path cannot keep replicas in one trust domain (its Allocate names no
    /// pod): a config that shares GPUs there and the rule are refused together, naming the
    /// file's key and the rule; either alone starts.
    #[test]
    fn a_trust_domain_is_refused_beside_device_plugin_replicas() {
        let config = |rule: &str| {
            let mut s = crate::config::Settings::default();
            s.backend.node_name = Some("node-a".into());
            s.plugin.share_trust_domain = Some(rule.parse().unwrap());
            s.serve.device_plugin_config = Some("/etc/nvdra/dp.yaml".into());
            crate::config::resolve(s, None).unwrap()
        };
        let replicas = deviceplugin::nvconfig::parse(
            "dp.yaml",
            "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 4}\n",
        )
        .unwrap();
        let plain = deviceplugin::Options::default();
        let e = trust_domain_beside(&config("namespace"), &replicas).unwrap_err();
        assert_eq!(
            (e.file.as_str(), e.key.as_str()),
            ("/etc/nvdra/dp.yaml", "sharing")
        );
        assert!(e.message.contains("--share-trust-domain=namespace"), "{e}");
        trust_domain_beside(&config("namespace"), &plain).unwrap();
        trust_domain_beside(&config("off"), &replicas).unwrap();
    }

    #[test]
    fn partitionable_mode_is_turned_off_where_mig_devices_cannot_be_created() {
        assert!(Plain.unavailable(Reconfiguration::Mig).is_some());
        assert!(!without_unavailable(partitionable(), &Plain).partitionable);
        let sim = SimBackend::from_profile("dgx-a100-mig", "node-a").unwrap();
        assert!(without_unavailable(partitionable(), &sim).partitionable);
    }
}
