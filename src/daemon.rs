//! `nvdra run`: wires the long-lived tasks of a node agent and owns their shutdown.
//!
//! Start order (each step only once the previous one works, so the kubelet never sees a
//! registration without a serving endpoint):
//! 0. the metrics port is bound first: a taken port fails the start before anything exists;
//!    then the health monitor is created (and NVML's event thread started) so that every
//!    consumer below subscribes to it, and every inventory read carries its state;
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
//! DeviceClass maps ([`crate::deviceplugin::auto`]). Either way NVIDIA's config file is read and
//! checked against the inventory before anything is served.
//!
//! A start that fails leaves nothing behind: each socket this instance binds is owned by an
//! [`socket::OwnedSockets`] guard that unlinks it on every way out of [`serve`] — but only while
//! the path still holds the socket this instance bound, never another instance's.
//!
//! Shutdown: the first SIGTERM or SIGINT cancels every task; the servers stop accepting, remove
//! their sockets and finish in-flight calls; then the checkpoint writer flushes and stops. A
//! second signal exits at once. A critical task ending by itself is a failure: everything else is
//! stopped and [`run`] returns an error, so the process exits non-zero and the DaemonSet restarts
//! it.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::api::ClusterApi;
use crate::config::{Config, Mode};
use crate::deviceplugin::holds::ContainerHolds;
use crate::deviceplugin::{self, DevicePlugin};
use crate::dra::health::NodeHealth;
use crate::dra::plugin::{self, Plugin};
use crate::dra::slices;
use crate::dra::sync::{self, SliceSync};
use crate::inventory::DeviceBackend;
use crate::ledger;
use crate::metrics::attribution::Attribution;
use crate::metrics::{self, Metrics};
use crate::report;
use crate::versions;
use kubelet_plugin::publisher::{self, Publisher};
use kubelet_plugin::socket;

mod runtime;
pub use runtime::{MAX_BLOCKING_THREADS, WORKER_THREADS, runtime};

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
    Recover(#[from] plugin::ClaimError),
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
}

type TaskResult = (&'static str, Result<(), String>);

/// Turns off what the backend cannot do on this node, saying so once: partitionable mode
/// without MIG creation would publish placements that every prepare refuses. Time slicing is
/// asked per claim, so it is only announced: such claims fail to prepare, naming the cause.
fn without_unavailable(mut config: Config, backend: &dyn DeviceBackend) -> Config {
    use crate::inventory::Reconfiguration;
    if config.partitionable
        && let Some(why) = backend.unavailable(Reconfiguration::Mig)
    {
        tracing::warn!(
            "partitionable mode is off: {why}; MIG placements are not published, existing MIG devices are"
        );
        config.partitionable = false;
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

/// Runs the node agent until a signal (or `stop`, for tests) ends it.
pub async fn run(
    config: Config,
    extras: Extras,
    backend: Arc<dyn DeviceBackend>,
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
    // Prepare reads the cached inventory; the slice sync and health stream refresh it. Every
    // consumer reads it with the health monitor's state laid over it.
    let cached: Arc<dyn DeviceBackend> = Arc::new(crate::inventory::cache::Cached::new(backend));
    let config = without_unavailable(config, cached.as_ref());
    let monitor = HealthMonitor::start(&config, &cached);
    let backend: Arc<dyn DeviceBackend> = Arc::new(crate::health::Monitored::new(
        cached,
        monitor.handle.subscribe(),
    ));
    let metrics = Metrics::new();
    metrics.set_info("backend", backend.name());
    metrics.set_info("driver", config.driver_name.clone());

    // `auto` becomes `device-plugin` without DRA, else `both` with the names DeviceClasses map
    // left to DRA.
    let mut config = config;
    let _classes_guard;
    let mut mapped = None;
    if config.mode == Mode::Auto {
        let token = stop.child_token();
        _classes_guard = token.clone().drop_guard();
        let (mode, m) = decide_auto(&api, token).await;
        config.mode = mode;
        mapped = m;
    }
    // `--node-labels`: GFD's labels, kept current beside whichever path runs.
    let _labels_guard;
    if config.node_labels {
        let options = match &config.device_plugin_config {
            Some(path) => deviceplugin::nvconfig::load(path)?,
            None => deviceplugin::Options::default(),
        };
        let token = stop.child_token();
        _labels_guard = token.clone().drop_guard();
        tokio::spawn(deviceplugin::labels::run(
            api.clone(),
            backend.clone(),
            options,
            config.node_name.clone(),
            deviceplugin::labels::INTERVAL,
            token,
        ));
    }
    let device_plugin = match config.mode {
        Mode::DevicePlugin | Mode::Both => Some(
            device_plugin(&config, backend.clone())
                .await?
                .with_health(monitor.handle.subscribe()),
        ),
        Mode::Dra | Mode::Auto => None,
    };
    let device_plugin = match mapped {
        Some(m) => device_plugin.map(|dp| dp.with_mapped(m)),
        None => device_plugin,
    };
    if config.mode == Mode::DevicePlugin {
        let shutdown = stop.child_token();
        let mut sigterm = signal(SignalKind::terminate()).map_err(Error::Signals)?;
        let mut sigint = signal(SignalKind::interrupt()).map_err(Error::Signals)?;
        let mut tasks: JoinSet<TaskResult> = JoinSet::new();
        // Without DRA, ready means every resource is registered with the kubelet (there are
        // no slices to publish: the kubelet has the device lists).
        let m = metrics.clone();
        let device_plugin = device_plugin.map(|dp| {
            dp.on_registered(Arc::new(move |all| {
                use std::sync::atomic::Ordering::Relaxed;
                m.registered.store(all, Relaxed);
                m.slices.published.store(all, Relaxed);
            }))
        });
        // Which container holds which device: PodResources, read for `/metrics` only.
        let device_plugin =
            device_plugin.map(|dp| dp.with_pod_resources(config.pod_resources_socket()));
        metrics.set_source(scrape_source(
            &backend,
            None,
            &monitor,
            device_plugin.as_ref(),
            &extras,
        ));
        spawn_device_plugin(device_plugin, &mut tasks, &shutdown);
        monitor.spawn(&mut tasks, &shutdown);
        let (m, token) = (metrics.clone(), shutdown.clone());
        tasks.spawn(async move {
            metrics::serve(metrics_listener, m, token).await;
            ("metrics", Ok(()))
        });
        return supervise(tasks, &shutdown, &mut sigterm, &mut sigint).await;
    }

    let boot_id_file = extras
        .boot_id_file
        .clone()
        .unwrap_or_else(|| PathBuf::from(ledger::BOOT_ID_PATH));
    let boot_id = ledger::read_boot_id(&boot_id_file)?;
    let plugin_dir = config.plugin_dir();
    let (plugin, writer, outcome) = Plugin::new(
        plugin::Options {
            driver: config.driver_name.clone(),
            pool: config.node_name.clone(),
            plugin_dir: plugin_dir.clone(),
            cdi_root: config.cdi_root.clone(),
            driver_root: config.driver_root.clone(),
            boot_id,
            partitionable: config.partitionable,
            shared_capacity: config.shared_capacity,
            mps_root: config.mps_root.clone(),
        },
        api.clone(),
        backend.clone(),
        metrics.clone(),
    )?;
    #[cfg(feature = "crash-points")]
    if let Some(at) = extras.crash_at {
        plugin.stop_at(at);
    }
    tracing::info!(checkpoint = %plugin.ledger().path().display(), ?outcome, "checkpoint loaded");

    // The writer outlives the servers: it stops only after they drained.
    let writer_stop = CancellationToken::new();
    let writer_task = tokio::spawn(writer.run(writer_stop.clone()));
    let shutdown = stop.child_token();
    // `both`: one ledger for both paths.
    let device_plugin = device_plugin
        .map(|dp| dp.with_ledger(plugin.ledger().clone(), config.pod_resources_socket()));
    if let Some(dp) = &device_plugin {
        dp.observe_once().await;
    }
    // What a scrape reads: the claims, the containers (`both`), readings, XIDs, processes' pods.
    metrics.set_source(scrape_source(
        &backend,
        Some(plugin.ledger()),
        &monitor,
        device_plugin.as_ref(),
        &extras,
    ));
    let result = serve(
        &config,
        monitor,
        device_plugin,
        plugin,
        api,
        backend,
        metrics,
        metrics_listener,
        shutdown.clone(),
    )
    .await;
    shutdown.cancel();
    writer_stop.cancel();
    match writer_task.await {
        Ok(Ok(())) => tracing::info!("checkpoint flushed"),
        Ok(Err(e)) => tracing::error!(error = %report::chain(&e), "checkpoint writer failed"),
        Err(e) => tracing::error!(error = %e, "checkpoint writer panicked"),
    }
    result
}

#[allow(clippy::too_many_arguments)]
async fn serve(
    config: &Config,
    monitor: HealthMonitor,
    device_plugin: Option<DevicePlugin>,
    plugin: Plugin,
    api: Arc<dyn ClusterApi>,
    backend: Arc<dyn DeviceBackend>,
    metrics: Arc<Metrics>,
    metrics_listener: tokio::net::TcpListener,
    shutdown: CancellationToken,
) -> Result<()> {
    let rec = plugin.recover().await?;
    tracing::info!(
        rolled_back = rec.rolled_back.len(),
        cdi_rewritten = rec.cdi_rewritten.len(),
        orphans_removed = rec.orphans_removed.len(),
        "recovered state from the checkpoint"
    );

    let mut sigterm = signal(SignalKind::terminate()).map_err(Error::Signals)?;
    let mut sigint = signal(SignalKind::interrupt()).map_err(Error::Signals)?;

    // The DRA side goes through the library as any driver does: it reads and checks the claims,
    // and serves the DRA socket, then registration. nvdra orders calls itself (one lock per
    // claim, different claims concurrently, and the node lock that reloads the checkpoint a
    // rolling update's other instance may have changed), so the library's serialization is off.
    let claims: Arc<dyn crate::api::ClaimReader> = api.clone();
    let registered = metrics.registered.clone();
    let health = NodeHealth::new(backend.clone(), config.node_name.clone())
        .with_health(monitor.handle.subscribe());
    let mut opts = kubelet_plugin::Options::new(&config.driver_name, &config.node_name, claims)?
        .kubelet_root(&config.kubelet_root)
        .serialize(false)
        .health(Arc::new(health))
        .on_registered(move |ok| registered.store(ok, std::sync::atomic::Ordering::Relaxed));
    if let Some(uid) = &config.pod_uid {
        opts = opts.pod_uid(uid);
    }
    let sockets = opts.sockets();
    let serving = kubelet_plugin::start(Arc::new(plugin.clone()), opts, shutdown.clone())?;
    // Declared before the tasks, so dropped after them: the servers stop, then the files go,
    // even when a second signal does not wait for the servers.
    let mut owned = socket::OwnedSockets::default();
    owned.adopt(&sockets.dra);
    owned.adopt(&sockets.registration);
    let mut tasks: JoinSet<TaskResult> = JoinSet::new();
    tasks.spawn(async move {
        let r = serving.wait().await;
        ("dra-server", r.map_err(|e| report::chain(&e).to_string()))
    });

    let holds = device_plugin.as_ref().and_then(DevicePlugin::holds);
    publish(
        config,
        &plugin,
        holds,
        &api,
        &backend,
        &metrics,
        monitor.handle.subscribe(),
        &mut tasks,
        &shutdown,
    )
    .await;
    if config.shared_capacity {
        spawn_share_daemon_watch(config, &plugin, &monitor, &metrics, &mut tasks, &shutdown);
    }
    monitor.spawn(&mut tasks, &shutdown);

    spawn_device_plugin(device_plugin, &mut tasks, &shutdown);

    {
        let (m, token) = (metrics.clone(), shutdown.clone());
        tasks.spawn(async move {
            metrics::serve(metrics_listener, m, token).await;
            ("metrics", Ok(()))
        });
    }

    let result = supervise(tasks, &shutdown, &mut sigterm, &mut sigint).await;
    // The servers remove their sockets; `owned` makes sure even a forced exit leaves none.
    drop(owned);
    result
}

/// What a `/metrics` scrape reads: the claims (`ledger`, absent without DRA), what containers
/// hold through the device plugin, the GPUs' readings, the XID counts, processes' pods.
fn scrape_source(
    backend: &Arc<dyn DeviceBackend>,
    ledger: Option<&ledger::Ledger>,
    monitor: &HealthMonitor,
    device_plugin: Option<&DevicePlugin>,
    extras: &Extras,
) -> Arc<Attribution> {
    let mut source = Attribution::new(backend.clone()).with_monitor(monitor.handle.clone());
    if let Some(ledger) = ledger {
        source = source.with_ledger(ledger.clone());
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
/// with the DeviceClass mapping followed until `token` (the first list awaited, up to
/// [`FIRST_CLASSES`], so a mapped name is never registered just to be withdrawn).
async fn decide_auto(
    api: &Arc<dyn ClusterApi>,
    token: CancellationToken,
) -> (Mode, Option<watch::Receiver<deviceplugin::auto::Mapped>>) {
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
    let (tx, mut rx) = watch::channel(deviceplugin::auto::Mapped::new());
    tokio::spawn(deviceplugin::auto::follow(api.clone(), tx, token));
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
async fn device_plugin(config: &Config, backend: Arc<dyn DeviceBackend>) -> Result<DevicePlugin> {
    let mut options = match &config.device_plugin_config {
        Some(path) => deviceplugin::nvconfig::load(path)?,
        None => deviceplugin::Options::default(),
    };
    options.gpu_memory = config.device_plugin_gpu_memory;
    let dp = DevicePlugin::new(
        deviceplugin::server::Settings {
            dir: config.device_plugin_dir(),
            driver: config.driver_name.clone(),
            driver_root: config.driver_root.clone(),
            cdi_root: config.cdi_root.clone(),
            watch: deviceplugin::server::WATCH,
            poll: deviceplugin::server::POLL,
        },
        options,
        backend,
    );
    dp.check().await?;
    Ok(dp)
}

fn spawn_device_plugin(
    dp: Option<DevicePlugin>,
    tasks: &mut JoinSet<TaskResult>,
    shutdown: &CancellationToken,
) {
    if let Some(dp) = dp {
        let token = shutdown.clone();
        tasks.spawn(async move {
            let r = dp.run(token).await;
            (
                "device-plugin",
                r.map_err(|e| report::chain(&e).to_string()),
            )
        });
    }
}

/// Runs `tasks` until a signal, a stop request or a task ending on its own, then drains them
/// within [`GRACE`] unless a second signal comes.
async fn supervise(
    mut tasks: JoinSet<TaskResult>,
    shutdown: &CancellationToken,
    sigterm: &mut tokio::signal::unix::Signal,
    sigint: &mut tokio::signal::unix::Signal,
) -> Result<()> {
    // Run until a signal, a stop request, or a task ending on its own.
    let failure = tokio::select! {
        biased;
        _ = sigterm.recv() => { tracing::info!("SIGTERM: shutting down"); None }
        _ = sigint.recv() => { tracing::info!("SIGINT: shutting down"); None }
        () = shutdown.cancelled() => { tracing::info!("stop requested: shutting down"); None }
        Some(done) = tasks.join_next() => task_failure(done, shutdown),
    };
    shutdown.cancel();

    // Drain, unless a second signal says not to wait.
    let drain = async {
        while let Some(done) = tasks.join_next().await {
            match done {
                Ok((task, Err(e))) => {
                    tracing::warn!(task, error = %e, "task ended with an error while stopping")
                }
                Ok((task, Ok(()))) => tracing::debug!(task, "task stopped"),
                Err(e) => tracing::warn!(error = %e, "task panicked while stopping"),
            }
        }
    };
    let drained = tokio::select! {
        () = drain => Ok(()),
        _ = sigterm.recv() => Err(Error::Forced),
        _ = sigint.recv() => Err(Error::Forced),
        () = tokio::time::sleep(GRACE) => Err(Error::GraceExceeded(GRACE)),
    };
    match (failure, drained) {
        (Some(e), _) => Err(e),
        (None, Err(e)) => Err(e),
        (None, Ok(())) => {
            tracing::info!("stopped");
            Ok(())
        }
    }
}

/// A task that ended before shutdown was asked for is a failure; one that ended because of it
/// (the select saw the task first) is not.
fn task_failure(
    done: Result<TaskResult, tokio::task::JoinError>,
    shutdown: &CancellationToken,
) -> Option<Error> {
    let (task, reason) = match done {
        Ok((_, Ok(()))) if shutdown.is_cancelled() => return None,
        Ok((task, Ok(()))) => (task, "ended".to_string()),
        Ok((task, Err(e))) => (task, e),
        Err(e) => ("unknown", format!("panicked: {e}")),
    };
    tracing::error!(task, %reason, "critical task stopped; shutting down");
    Some(Error::TaskDied { task, reason })
}

/// One warning when a switch that is on meets a Kubernetes version whose scheduler has a known
/// bug that hits it (`crate::versions`): the slices are published all the same, as the claims the
/// bug does not touch still work.
fn warn_of_known_bugs(config: &Config, version: &versions::KubeVersion) {
    let on: Vec<versions::Switch> = [
        (config.partitionable, versions::Switch::Partitionable),
        (config.shared_capacity, versions::Switch::SharedCapacity),
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

/// How often the inventory is re-read for changes nobody announced.
pub const RESCAN: Duration = Duration::from_secs(60);

/// Starts the ResourceSlice publisher (counting into the metrics, readiness included) and the
/// task feeding it the inventory (told about MIG changes by the plugin, and about health
/// transitions by the monitor). `holds`: in `both`, what containers hold through the device
/// plugin, hidden from the slices.
#[allow(clippy::too_many_arguments)]
async fn publish(
    config: &Config,
    plugin: &Plugin,
    holds: Option<ContainerHolds>,
    api: &Arc<dyn ClusterApi>,
    backend: &Arc<dyn DeviceBackend>,
    metrics: &Arc<Metrics>,
    health: crate::health::Watch,
    tasks: &mut JoinSet<TaskResult>,
    shutdown: &CancellationToken,
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
        layout: sync::layout_for(version.map(|v| v.minor)),
    };
    let (publisher, handle) = Publisher::with_counters(
        api.clone(),
        &config.driver_name,
        &config.node_name,
        publisher::Options::default(),
        metrics.slices.clone(),
    );
    let (slice_sync, sync_handle) = SliceSync::new(backend.clone(), handle, opts, RESCAN);
    let mut slice_sync = slice_sync.with_metrics(metrics.clone()).with_health(health);
    if let Some(holds) = holds {
        slice_sync = slice_sync.with_holds(holds);
    }
    plugin.on_inventory_change(Arc::new(move || sync_handle.inventory_changed()));
    let token = shutdown.clone();
    tasks.spawn(async move {
        publisher.run(token).await;
        ("publisher", Ok(()))
    });
    let token = shutdown.clone();
    tasks.spawn(async move {
        slice_sync.run(token).await;
        ("slice-sync", Ok(()))
    });
}

/// Where the daemon watch's rounds go: `nvdra_mps_daemon_up` and the health monitor, whose
/// state taints a GPU whose share daemon does not answer (the slices follow its transitions).
struct ShareDaemonReport {
    metrics: Arc<Metrics>,
    monitor: crate::health::MonitorHandle,
}

impl plugin::DaemonReport for ShareDaemonReport {
    fn report(
        &self,
        up: &std::collections::BTreeMap<crate::inventory::GpuUuid, bool>,
        down: &crate::health::DaemonsDown,
    ) {
        self.metrics
            .set_share_daemons(up.iter().map(|(g, up)| (g.to_string(), *up)));
        self.monitor.report_share_daemons(down.clone());
    }
}

/// The daemon watch (`--shared-capacity`): every `--mps-probe-interval`, each GPU with shares
/// is asked whether its daemon answers.
fn spawn_share_daemon_watch(
    config: &Config,
    plugin: &Plugin,
    monitor: &HealthMonitor,
    metrics: &Arc<Metrics>,
    tasks: &mut JoinSet<TaskResult>,
    shutdown: &CancellationToken,
) {
    use tracing::Instrument;
    let report = Arc::new(ShareDaemonReport {
        metrics: metrics.clone(),
        monitor: monitor.handle.clone(),
    });
    let (plugin, interval, token) = (plugin.clone(), config.mps_probe_interval, shutdown.clone());
    tasks.spawn(
        async move {
            plugin.watch_share_daemons(interval, report, token).await;
            ("share-daemon-watch", Ok(()))
        }
        .instrument(tracing::info_span!("share-daemon-watch", ?interval)),
    );
}

/// The health monitor and its event source, created at start (so every consumer can subscribe)
/// and spawned with the other tasks.
struct HealthMonitor {
    monitor: crate::health::Monitor,
    handle: crate::health::MonitorHandle,
    faults: Option<crate::health::faults::FaultFile>,
}

impl HealthMonitor {
    /// The source is the backend's own (NVML's event thread, started here), or the fault file
    /// for simulated GPUs; the recovery probe is the fault file's or the backend's. A backend
    /// whose event source cannot start still serves: its GPUs are then only as healthy as its
    /// inventory says, which is logged. The event thread ends once the monitor is gone.
    fn start(config: &Config, backend: &Arc<dyn DeviceBackend>) -> Self {
        let faults = config
            .fault_file
            .clone()
            .map(|path| crate::health::faults::FaultFile::new(path, backend.clone()));
        let probe: Arc<dyn crate::health::Probe> = match &faults {
            Some(f) => f.probe(),
            None => Arc::new(crate::health::BackendProbe(backend.clone())),
        };
        let (monitor, handle) = crate::health::Monitor::new(config.health.clone(), probe);
        match backend.start_health_events(Box::new(handle.events())) {
            None => tracing::debug!(backend = backend.name(), "no hardware health events"),
            Some(Ok(_thread)) => {
                tracing::info!(backend = backend.name(), "watching GPU health events")
            }
            Some(Err(e)) => tracing::warn!(
                error = %e,
                "cannot start the GPU health-event thread; GPU health is not monitored"
            ),
        }
        Self {
            monitor,
            handle,
            faults,
        }
    }

    fn spawn(self, tasks: &mut JoinSet<TaskResult>, shutdown: &CancellationToken) {
        let Self {
            monitor,
            handle,
            faults,
        } = self;
        if let Some(f) = faults {
            let (events, token) = (handle.events(), shutdown.clone());
            tasks.spawn(async move {
                f.run(events, token).await;
                ("fault-file", Ok(()))
            });
        }
        let token = shutdown.clone();
        tasks.spawn(async move {
            monitor.run(token).await;
            ("health-monitor", Ok(()))
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::sim::SimBackend;
    use crate::inventory::{Inventory, Reconfiguration};

    /// A backend that can do nothing (the trait's defaults).
    struct Plain;
    impl DeviceBackend for Plain {
        fn name(&self) -> &'static str {
            "plain"
        }
        fn snapshot(&self) -> crate::inventory::Result<Inventory> {
            Ok(Inventory::default())
        }
    }

    fn partitionable() -> Config {
        let mut s = crate::config::Settings::default();
        s.backend.node_name = Some("node-a".into());
        s.plugin.partitionable = Some(true);
        crate::config::resolve(s, None).unwrap()
    }

    #[test]
    fn partitionable_mode_is_turned_off_where_mig_devices_cannot_be_created() {
        assert!(Plain.unavailable(Reconfiguration::Mig).is_some());
        assert!(!without_unavailable(partitionable(), &Plain).partitionable);
        let sim = SimBackend::from_profile("dgx-a100-mig", "node-a").unwrap();
        assert!(without_unavailable(partitionable(), &sim).partitionable);
    }
}
