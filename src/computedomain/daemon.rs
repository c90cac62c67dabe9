//! `nvdra compute-domain daemon`: one node's IMEX daemon for a ComputeDomain, as NVIDIA's
//! `compute-domain-daemon run` (same environment, same `/imexd` directory, same clique object),
//! or the check of an IMEX the admin runs on the host (`--host-managed`), or one IMEX daemon for
//! the node's whole fabric clique (`--per-clique`).
//!
//! Each round (every `--check-interval-ms`), the daemon:
//! 1. writes its entry (nodeName, ipAddress, cliqueID, index, status) into the clique object
//!    `<domainUID>.<cliqueID>` in the driver's namespace, creating the object if absent; a new
//!    entry takes the lowest free index ([`clique`]);
//! 2. checks the node's GPUs' fabric registration through nvdra's inventory (`--fabric-check`):
//!    a registration in progress (or with another clique) is NotReady with that reason, and the
//!    round ends there, to be tried again;
//! 3. (managed mode) renders IMEX's config and the static `nodes.cfg` once, maps the present
//!    daemons' names to their IPs in the hosts file ([`files`]), starts `nvidia-imex` or
//!    restarts it after a backoff when it exited, and sends it `SIGUSR1` when the peers changed
//!    ([`imex`]);
//! 4. asks `nvidia-imex-ctl -q`: `READY` is Ready; anything else is NotReady, the reason being
//!    its answer, how IMEX last exited and IMEX's last error line;
//! 5. writes the status into its entry when it changed, and an event on the clique object when
//!    the reason changed, so people see why a node is NotReady;
//! 6. asks `nvidia-imex-ctl -N` which nodes its IMEX is connected to (IMEX's addresses mapped
//!    back to node names through the clique's entries) and, when the reason or the peers
//!    changed, annotates its own pod with both ([`DAEMON_REASON_ANNOTATION`],
//!    [`DAEMON_PEERS_ANNOTATION`]), which the controller turns into the domain's conditions.
//!
//! Nothing here exits because IMEX misbehaves: the process stays up and reports (NVIDIA's pod
//! is killed by its liveness probe after 20 minutes of NotReady and crash-loops). On SIGTERM it
//! stops IMEX and removes its entry.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::computedomain::api::{
    CliqueDaemon, ComputeDomainClique, STATUS_NOT_READY, STATUS_READY,
};
#[cfg(doc)]
use crate::computedomain::api::{DAEMON_PEERS_ANNOTATION, DAEMON_REASON_ANNOTATION};
use crate::inventory::{DeviceBackend, Inventory};

pub mod clique;
pub mod files;
pub mod imex;
pub mod kube;
#[cfg(test)]
mod tests;

use clique::{Cliques, Me, RecordedNotes, StoreError};
use imex::{DomainStatus, Exit, Imex, Readiness};

/// Whether the daemon checks the node's fabric registration before IMEX runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum FabricCheck {
    /// Through NVML when it loads in the container; skipped (with a warning) when it does not.
    Auto,
    /// Through NVML; the daemon does not start without it.
    Nvml,
    Off,
}

/// Flags of `nvdra compute-domain daemon`. The first ones are NVIDIA's environment (the
/// DaemonSet's downward API and the daemon claim's CDI edits), so its pod spec works as is.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The node's fabric clique, `<clusterUUID>.<cliqueID>` (from the daemon claim's prepare);
    /// empty: the node has no IMEX, and the daemon only waits.
    #[arg(long = "cliqueid", env = "CLIQUE_ID", default_value = "")]
    pub clique_id: String,
    /// The ComputeDomain's UID (from the daemon claim's prepare; its absence means the CDI
    /// edits did not apply). Not needed with --per-clique.
    #[arg(long, env = "COMPUTE_DOMAIN_UUID", default_value = "")]
    pub compute_domain_uuid: String,
    /// The ComputeDomain's name, for logs.
    #[arg(long, env = "COMPUTE_DOMAIN_NAME", default_value = "")]
    pub compute_domain_name: String,
    /// The ComputeDomain's namespace, for logs.
    #[arg(long, env = "COMPUTE_DOMAIN_NAMESPACE", default_value = "default")]
    pub compute_domain_namespace: String,
    /// This node's name.
    #[arg(long, env = "NODE_NAME")]
    pub node_name: String,
    /// This pod's IP: the address IMEX listens on and peers reach.
    #[arg(long, env = "POD_IP")]
    pub pod_ip: std::net::IpAddr,
    /// The driver's namespace, where the clique objects live.
    #[arg(long, env = "POD_NAMESPACE")]
    pub pod_namespace: String,
    /// This pod's name, annotated with why the node is not ready and which peers IMEX sees;
    /// empty: not annotated.
    #[arg(long, env = "POD_NAME", default_value = "")]
    pub pod_name: String,
    /// The most nodes a domain holds in one clique: the names `nodes.cfg` lists.
    #[arg(long, env = "MAX_NODES_PER_IMEX_DOMAIN", default_value_t = 18)]
    pub max_nodes_per_imex_domain: u32,
    /// The domain's IMEX directory (the daemon claim mounts it): the template in, the config and
    /// `nodes.cfg` out.
    #[arg(long, env = "NVDRA_CD_CONFIG_DIR", default_value = "/imexd")]
    pub config_dir: PathBuf,
    /// The hosts file IMEX resolves the peers' names through (the pod's own).
    #[arg(long, env = "NVDRA_CD_HOSTS_FILE", default_value = "/etc/hosts")]
    pub hosts_file: PathBuf,
    /// The IMEX daemon to run.
    #[arg(long, env = "NVDRA_CD_IMEX", default_value = "nvidia-imex")]
    pub imex: String,
    /// The IMEX control tool to ask.
    #[arg(long, env = "NVDRA_CD_IMEX_CTL", default_value = "nvidia-imex-ctl")]
    pub imex_ctl: String,
    /// The admin runs nvidia-imex on the host: only check it (with the host's config) and
    /// report.
    #[arg(long, env = "NVDRA_CD_HOST_MANAGED")]
    pub host_managed: bool,
    /// The host IMEX's config file, which nvidia-imex-ctl reads (--host-managed).
    #[arg(
        long,
        env = "NVDRA_CD_HOST_IMEX_CONFIG",
        default_value = "/etc/nvidia-imex/config.cfg"
    )]
    pub host_imex_config: PathBuf,
    /// One long-running IMEX daemon for every node of the fabric clique (object
    /// `fabric.<cliqueID>`), serving every domain of the clique through its own channels.
    #[arg(long, env = "NVDRA_CD_PER_CLIQUE")]
    pub per_clique: bool,
    /// Checking the GPUs' fabric registration before IMEX runs.
    #[arg(
        long,
        env = "NVDRA_CD_FABRIC_CHECK",
        value_enum,
        default_value = "auto"
    )]
    pub fabric_check: FabricCheck,
    /// Where the driver is, for NVML (--fabric-check).
    #[arg(long, env = "NVIDIA_DRIVER_ROOT", default_value = "/")]
    pub driver_root: PathBuf,
    /// Time between two rounds (entry, files, process, readiness).
    #[arg(long, env = "NVDRA_CD_CHECK_INTERVAL_MS", default_value_t = 2000)]
    pub check_interval_ms: u64,
    /// Least time between two SIGUSR1 to IMEX (it ignores one within 5 s of the last).
    #[arg(long, env = "NVDRA_CD_SIGUSR1_INTERVAL_MS", default_value_t = 5000)]
    pub sigusr1_interval_ms: u64,
    /// Longest wait before nvidia-imex is started again after it exited.
    #[arg(long, env = "NVDRA_CD_RESTART_BACKOFF_MAX_MS", default_value_t = 60000)]
    pub restart_backoff_max_ms: u64,
    /// Talk to the API server of this kubeconfig instead of the in-cluster config.
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
}

/// How IMEX runs on the node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Mode {
    /// The daemon runs `imex -c <config dir>/imexd.cfg` and asks `ctl`.
    Managed { imex: String, ctl: String },
    /// The admin runs IMEX; the daemon asks `ctl -c <config>`.
    HostManaged { ctl: String, config: PathBuf },
}

/// The validated settings.
#[derive(Clone, Debug)]
pub struct Settings {
    pub me: Me,
    /// The clique object's name and namespace.
    pub object: String,
    pub namespace: String,
    pub domain_uid: String,
    pub mode: Mode,
    pub config_dir: PathBuf,
    pub hosts_file: PathBuf,
    pub interval: Duration,
    pub usr1_interval: Duration,
    pub max_backoff: Duration,
}

impl Settings {
    /// Validates the flags; errors name the flag (its env name) and what to do.
    pub fn from_args(a: &Args) -> anyhow::Result<Self> {
        if !a.per_clique && a.compute_domain_uuid.is_empty() {
            anyhow::bail!(
                "COMPUTE_DOMAIN_UUID is empty: the daemon claim's CDI edits did not apply (is CDI \
                 enabled in the container runtime?), or pass --compute-domain-uuid"
            );
        }
        if a.max_nodes_per_imex_domain == 0 {
            anyhow::bail!(
                "--max-nodes-per-imex-domain (MAX_NODES_PER_IMEX_DOMAIN) is 0: give the most nodes of a domain in one clique, e.g. 18"
            );
        }
        let object = if a.per_clique {
            ComputeDomainClique::name_for(clique::PER_CLIQUE_PREFIX, &a.clique_id)
        } else {
            ComputeDomainClique::name_for(&a.compute_domain_uuid, &a.clique_id)
        };
        let mode = if a.host_managed {
            Mode::HostManaged {
                ctl: a.imex_ctl.clone(),
                config: a.host_imex_config.clone(),
            }
        } else {
            Mode::Managed {
                imex: a.imex.clone(),
                ctl: a.imex_ctl.clone(),
            }
        };
        Ok(Settings {
            me: Me {
                node_name: a.node_name.clone(),
                ip: a.pod_ip.to_string(),
                clique_id: a.clique_id.clone(),
                max_nodes: a.max_nodes_per_imex_domain,
            },
            object,
            namespace: a.pod_namespace.clone(),
            domain_uid: if a.per_clique {
                String::new()
            } else {
                a.compute_domain_uuid.clone()
            },
            mode,
            config_dir: a.config_dir.clone(),
            hosts_file: a.hosts_file.clone(),
            interval: Duration::from_millis(a.check_interval_ms.max(1)),
            usr1_interval: Duration::from_millis(a.sigusr1_interval_ms),
            max_backoff: Duration::from_millis(a.restart_backoff_max_ms),
        })
    }

    fn imex_config(&self) -> PathBuf {
        self.config_dir.join("imexd.cfg")
    }

    fn nodes_config(&self) -> PathBuf {
        self.config_dir.join("nodes.cfg")
    }
}

/// Whether the node's GPUs completed their fabric registration with the clique: `Err(reason)`
/// while they have not (in progress, failed, another clique).
pub trait FabricProbe: Send + Sync + 'static {
    fn check(&self, clique_id: &str) -> Result<(), String>;
}

/// No check.
pub struct NoFabricCheck;

impl FabricProbe for NoFabricCheck {
    fn check(&self, _: &str) -> Result<(), String> {
        Ok(())
    }
}

/// The check through nvdra's inventory (any backend: NVML on a node, simulated in tests).
pub struct InventoryFabric(pub Arc<dyn DeviceBackend>);

impl FabricProbe for InventoryFabric {
    fn check(&self, clique_id: &str) -> Result<(), String> {
        match self.0.snapshot() {
            Ok(inv) => fabric_reason(&inv, clique_id).map_or(Ok(()), Err),
            Err(e) => Err(format!("cannot read the GPUs' fabric registration: {e}")),
        }
    }
}

/// Why the inventory's GPUs are not (yet) in `clique_id`; `None` when every GPU is.
pub fn fabric_reason(inv: &Inventory, clique_id: &str) -> Option<String> {
    if inv.gpus.is_empty() {
        return Some("the node has no GPUs".into());
    }
    let pending: Vec<String> = inv
        .gpus
        .iter()
        .filter(|g| g.fabric.as_ref().map(ToString::to_string).as_deref() != Some(clique_id))
        .map(|g| match &g.fabric {
            Some(f) => format!("GPU {} is in clique {f}", g.index),
            None => format!("GPU {} has not completed its fabric registration", g.index),
        })
        .collect();
    (!pending.is_empty()).then(|| {
        format!(
            "fabric registration not complete for clique {clique_id}: {} (retrying)",
            pending.join(", ")
        )
    })
}

/// What one round ended with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Report {
    /// [`STATUS_READY`] or [`STATUS_NOT_READY`].
    pub status: String,
    /// Why NotReady (empty when Ready).
    pub reason: String,
}

/// The event reasons on the clique object.
pub const EVENT_NOT_READY: &str = "IMEXDaemonNotReady";
/// See [`EVENT_NOT_READY`].
pub const EVENT_READY: &str = "IMEXDaemonReady";

/// One node's daemon.
pub struct Daemon<S: Cliques> {
    settings: Settings,
    store: Arc<S>,
    probe: Box<dyn FabricProbe>,
    imex: Option<Imex>,
    files_written: bool,
    peers: Option<BTreeMap<i64, String>>,
    last_exit: Option<String>,
    reported: Option<Report>,
    written_status: Option<String>,
    /// The pod annotations last written, and the last failure to read IMEX's node table or to
    /// write them (each logged once).
    annotated: Option<RecordedNotes>,
    table_error: Option<String>,
    annotate_error: Option<String>,
}

impl<S: Cliques> Daemon<S> {
    pub fn new(settings: Settings, store: Arc<S>, probe: Box<dyn FabricProbe>) -> Self {
        let imex = match &settings.mode {
            Mode::Managed { imex, .. } => Some(Imex::new(
                imex.clone(),
                vec!["-c".into(), settings.imex_config().display().to_string()],
                settings.max_backoff,
                settings.usr1_interval,
            )),
            Mode::HostManaged { .. } => None,
        };
        Self {
            settings,
            store,
            probe,
            imex,
            files_written: false,
            peers: None,
            last_exit: None,
            reported: None,
            written_status: None,
            annotated: None,
            table_error: None,
            annotate_error: None,
        }
    }

    /// How often nvidia-imex was started.
    pub fn imex_starts(&self) -> u64 {
        self.imex.as_ref().map_or(0, Imex::starts)
    }

    /// One round (see the module doc).
    pub async fn step(&mut self) -> Report {
        let clique = match self.sync_entry().await {
            Ok(c) => Some(c),
            Err(reason) => {
                tracing::warn!(object = %self.settings.object, %reason, "cannot write this node's clique entry");
                None
            }
        };
        let (readiness, asked) = match self.probe.check(&self.settings.me.clique_id) {
            Err(reason) => (Readiness::NotReady(reason), false),
            Ok(()) => (self.run_imex(clique.as_ref()).await, true),
        };
        let report = match readiness {
            Readiness::Ready => Report {
                status: STATUS_READY.into(),
                reason: String::new(),
            },
            Readiness::NotReady(answer) => Report {
                status: STATUS_NOT_READY.into(),
                reason: self.reason(answer),
            },
        };
        let peers = match &clique {
            Some(c) if asked && self.store.annotates() => self.peers(c).await,
            _ => None,
        };
        if let Some(c) = clique {
            self.publish(c, &report).await;
        }
        self.annotate(&report, peers).await;
        report
    }

    /// The nodes IMEX is connected to, comma-separated, from `nvidia-imex-ctl -N`; `None`
    /// when it cannot tell (logged once per reason, never fatal).
    async fn peers(&mut self, clique: &ComputeDomainClique) -> Option<String> {
        let (ctl, config) = match &self.settings.mode {
            Mode::Managed { ctl, .. } => (ctl.clone(), self.settings.imex_config()),
            Mode::HostManaged { ctl, config } => (ctl.clone(), config.clone()),
        };
        let names = imex::domain_status(&ctl, &config.display().to_string())
            .await
            .and_then(|status| {
                peer_names(&status, &clique.daemons, &self.settings.me).ok_or_else(|| {
                    format!(
                        "this node ({} or its name) is not in IMEX's node table",
                        self.settings.me.ip
                    )
                })
            });
        match names {
            Ok(names) => {
                if self.table_error.take().is_some() {
                    tracing::info!("IMEX's node table reads again");
                }
                Some(names.join(","))
            }
            Err(e) => {
                if self.table_error.as_ref() != Some(&e) {
                    tracing::warn!(error = %e, "cannot tell which peers IMEX sees: the pod's peer list is left out (retrying each round)");
                    self.table_error = Some(e);
                }
                None
            }
        }
    }

    /// Writes the reason and the peers on this daemon's pod when either changed; a failure is
    /// logged (once per error) and tried again at the next round.
    async fn annotate(&mut self, report: &Report, peers: Option<String>) {
        let notes = (report.reason.replace('\n', " "), peers);
        if self.annotated.as_ref() == Some(&notes) {
            return;
        }
        match self.store.annotate(&notes.0, notes.1.as_deref()).await {
            Ok(()) => {
                self.annotated = Some(notes);
                self.annotate_error = None;
            }
            Err(e) => {
                let e = e.to_string();
                if self.annotate_error.as_ref() != Some(&e) {
                    tracing::warn!(error = %e, "cannot annotate this daemon's pod (does its Role allow patch on pods?); retrying each round");
                    self.annotate_error = Some(e);
                }
            }
        }
    }

    fn reason(&self, answer: String) -> String {
        let mut reason = answer;
        if let Some(exit) = &self.last_exit {
            reason.push_str(&format!("; {exit}"));
        }
        if let Some(line) = self.imex.as_ref().and_then(Imex::last_error) {
            reason.push_str(&format!("; last IMEX error: {line}"));
        }
        reason
    }

    /// Files, process, readiness (managed), or readiness alone (host-managed).
    async fn run_imex(&mut self, clique: Option<&ComputeDomainClique>) -> Readiness {
        let ctl_config = match &self.settings.mode {
            Mode::HostManaged { ctl, config } => {
                return imex::query(ctl, &config.display().to_string()).await;
            }
            Mode::Managed { .. } => self.settings.imex_config(),
        };
        if !self.files_written {
            if let Err(e) = self.write_config() {
                return Readiness::NotReady(e);
            }
            self.files_written = true;
        }
        if let Some(c) = clique {
            let peers = clique::names(
                &c.daemons,
                &self.settings.me.clique_id,
                self.settings.me.max_nodes,
            );
            if self.peers.as_ref() != Some(&peers) {
                match files::write_hosts(&self.settings.hosts_file, &peers) {
                    Ok(changed) => {
                        tracing::info!(peers = ?peers, "IMEX peers");
                        self.peers = Some(peers);
                        if changed && let Some(imex) = self.imex.as_mut() {
                            imex.request_reload();
                        }
                    }
                    Err(e) => {
                        return Readiness::NotReady(format!(
                            "cannot write the hosts file {}: {e}",
                            self.settings.hosts_file.display()
                        ));
                    }
                }
            }
        }
        let Some(imex) = self.imex.as_mut() else {
            return Readiness::NotReady("no IMEX to run".into());
        };
        if let Exit::Exited { status, retry_in } = imex.poll() {
            self.last_exit = Some(format!(
                "nvidia-imex exited ({status}), started again after {retry_in:?}"
            ));
        }
        if let Err(e) = imex.ensure_started() {
            return Readiness::NotReady(format!("cannot start nvidia-imex: {e}"));
        }
        imex.flush_reload();
        let Mode::Managed { ctl, .. } = &self.settings.mode else {
            return Readiness::NotReady("no IMEX to run".into());
        };
        let ctl = ctl.clone();
        let r = imex::query(&ctl, &ctl_config.display().to_string()).await;
        if r == Readiness::Ready {
            self.last_exit = None;
        }
        r
    }

    fn write_config(&self) -> Result<(), String> {
        let s = &self.settings;
        let template_path = s.config_dir.join("imexd.cfg.tmpl");
        let template = match std::fs::read_to_string(&template_path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => files::DEFAULT_TEMPLATE.into(),
            Err(e) => return Err(format!("cannot read {}: {e}", template_path.display())),
        };
        let nodes = s.nodes_config();
        let config = files::render(&template, &s.me.ip, &nodes.display().to_string())
            .map_err(|e| e.to_string())?;
        for (path, text) in [
            (s.imex_config(), config),
            (nodes, files::nodes_config(s.me.max_nodes)),
        ] {
            crate::durable::write(&path, text.as_bytes()).map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    /// Reads the clique object (creating it when absent) and puts this node's entry in.
    async fn sync_entry(&mut self) -> Result<ComputeDomainClique, String> {
        let s = &self.settings;
        for _ in 0..3 {
            let current = match self.store.get(&s.object).await {
                Ok(Some(c)) => c,
                Ok(None) => {
                    let new =
                        clique::new_object(&s.namespace, &s.object, &s.domain_uid, &s.me.clique_id);
                    match self.store.create(new).await {
                        Ok(c) => c,
                        Err(StoreError::Conflict) => continue,
                        Err(e) => return Err(format!("cannot create {}: {e}", s.object)),
                    }
                }
                Err(e) => return Err(format!("cannot read {}: {e}", s.object)),
            };
            let mut next = current.clone();
            match clique::upsert(&mut next.daemons, &s.me) {
                Ok(false) => return Ok(current),
                Ok(true) => {}
                Err(full) => return Err(full.to_string()),
            }
            match self.store.replace(next).await {
                Ok(c) => {
                    self.written_status = None;
                    return Ok(c);
                }
                Err(StoreError::Conflict) => continue,
                Err(e) => return Err(format!("cannot write {}: {e}", s.object)),
            }
        }
        Err(format!(
            "{} kept changing under three writes: retrying at the next round",
            s.object
        ))
    }

    /// Writes the status into the entry when it changed, and an event when the reason did.
    async fn publish(&mut self, clique: ComputeDomainClique, report: &Report) {
        let mut next = clique;
        if clique::set_status(
            &mut next.daemons,
            &self.settings.me.node_name,
            &report.status,
        ) {
            match self.store.replace(next.clone()).await {
                Ok(c) => next = c,
                // Read again at the next round.
                Err(e) => {
                    tracing::warn!(object = %self.settings.object, error = %e, "cannot write this node's status")
                }
            }
        }
        if self.reported.as_ref() == Some(report) {
            return;
        }
        let ready = report.status == STATUS_READY;
        let (reason, message) = if ready {
            (
                EVENT_READY,
                format!("node {}: IMEX is ready", self.settings.me.node_name),
            )
        } else {
            (
                EVENT_NOT_READY,
                format!("node {}: {}", self.settings.me.node_name, report.reason),
            )
        };
        if ready {
            tracing::info!(node = %self.settings.me.node_name, "IMEX ready");
        } else {
            tracing::warn!(node = %self.settings.me.node_name, reason = %report.reason, "IMEX not ready");
        }
        if let Err(e) = self.store.event(&next, !ready, reason, &message).await {
            tracing::warn!(error = %e, "cannot record an event on the clique object");
        }
        self.reported = Some(report.clone());
    }

    /// Rounds until `stop`, then stops IMEX and removes this node's entry.
    pub async fn run(mut self, stop: CancellationToken) {
        loop {
            let report = self.step().await;
            tracing::debug!(status = %report.status, reason = %report.reason, "round");
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = tokio::time::sleep(self.settings.interval) => {}
            }
        }
        self.stop().await;
    }

    /// Stops IMEX (SIGTERM, SIGKILL after 10 s) and removes this node's entry.
    pub async fn stop(&mut self) {
        if let Some(imex) = self.imex.as_mut() {
            imex.stop(Duration::from_secs(10)).await;
        }
        let s = &self.settings;
        for _ in 0..3 {
            let Ok(Some(mut c)) = self.store.get(&s.object).await else {
                return;
            };
            if !clique::remove(&mut c.daemons, &s.me) {
                return;
            }
            match self.store.replace(c).await {
                Ok(_) => {
                    tracing::info!(object = %s.object, "removed this node's clique entry");
                    return;
                }
                Err(StoreError::Conflict) => continue,
                Err(e) => {
                    tracing::warn!(object = %s.object, error = %e, "cannot remove this node's clique entry");
                    return;
                }
            }
        }
    }
}

/// Runs the daemon until SIGTERM or SIGINT.
pub fn run(args: Args) -> anyhow::Result<()> {
    let settings = Settings::from_args(&args)?;
    let runtime = crate::daemon::runtime()?;
    runtime.block_on(async move {
        let stop = CancellationToken::new();
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        let mut int = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())?;
        let on_signal = stop.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
            tracing::info!("SIGTERM: stopping IMEX and removing this node's entry");
            on_signal.cancel();
        });
        if args.clique_id.is_empty() {
            tracing::info!("no clique ID: this node has no IMEX; waiting for shutdown");
            stop.cancelled().await;
            return Ok(());
        }
        let probe = fabric_probe(args.fabric_check, &args.driver_root)?;
        if args.pod_name.is_empty() {
            tracing::warn!(
                "POD_NAME is empty: the pod is not annotated with the reason and the peers"
            );
        }
        let store = kube::KubeCliques::new(
            args.kubeconfig.as_deref(),
            &settings.namespace,
            &settings.me.node_name,
            &args.pod_name,
        )
        .await?;
        tracing::info!(
            object = %settings.object,
            domain = %format!("{}/{}", args.compute_domain_namespace, args.compute_domain_name),
            mode = ?settings.mode,
            "compute-domain daemon starting"
        );
        Daemon::new(settings, Arc::new(store), probe)
            .run(stop)
            .await;
        Ok(())
    })
}

fn fabric_probe(
    check: FabricCheck,
    driver_root: &std::path::Path,
) -> anyhow::Result<Box<dyn FabricProbe>> {
    let nvml = || crate::inventory::nvml::NvmlBackend::open(driver_root);
    Ok(match check {
        FabricCheck::Off => Box::new(NoFabricCheck),
        FabricCheck::Nvml => Box::new(InventoryFabric(Arc::new(nvml()?))),
        FabricCheck::Auto => match nvml() {
            Ok(b) => Box::new(InventoryFabric(Arc::new(b))),
            Err(e) => {
                tracing::warn!(error = %e, "NVML does not load here: the fabric registration is not checked (IMEX's own state still is)");
                Box::new(NoFabricCheck)
            }
        },
    })
}

/// The names of the nodes of this clique that IMEX's node table shows this node connected to
/// (sorted; itself left out); IMEX's addresses are the entries' IPs or their per-domain DNS
/// names. `None` when this node is not in the table.
pub fn peer_names(status: &DomainStatus, daemons: &[CliqueDaemon], me: &Me) -> Option<Vec<String>> {
    let mine: Vec<&CliqueDaemon> = daemons
        .iter()
        .filter(|d| d.clique_id == me.clique_id)
        .collect();
    let my_name = mine
        .iter()
        .find(|d| d.node_name == me.node_name)
        .map(|d| files::dns_name(d.index));
    let mut addresses = vec![me.ip.as_str()];
    addresses.extend(my_name.as_deref());
    let from = status.index_of(&addresses)?;
    let names: std::collections::BTreeSet<String> = status
        .connected_from(from)
        .into_iter()
        .filter_map(|a| {
            mine.iter()
                .find(|d| d.ip_address == a || files::dns_name(d.index) == a)
        })
        .filter(|d| d.node_name != me.node_name)
        .map(|d| d.node_name.clone())
        .collect();
    Some(names.into_iter().collect())
}
