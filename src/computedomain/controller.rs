//! `nvdra compute-domain controller`: the cluster's one ComputeDomain controller (a Deployment;
//! replicas elect a leader through a Lease), NVIDIA's `compute-domain-controller` in Rust.
//!
//! - [`reconcile`]: per domain, NVIDIA's objects ([`objects`]: the workload and daemon
//!   ResourceClaimTemplates, the DaemonSet of IMEX daemons) or, for a domain that opts in with
//!   the annotation `compute-domain.nvidia.com/channels: clique`, one ResourceClaim all its pods
//!   share; the status from the domain's cliques with conditions ([`status`]); Events;
//!   the finalizer.
//! - [`cleanup`]: what is left of domains that are gone, found by label and UID alone.
//! - [`pools`] and [`publish`]: per NVLink clique, a ResourceSlice pool of IMEX channels
//!   (`--clique-channels`), so the scheduler places a clique-channel domain in one clique and
//!   gives two domains different channels.
//! - [`lease`]: leader election; only the leader reconciles, publishes and sweeps. A leader that
//!   cannot renew exits (the Deployment restarts it as a candidate).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use kube::runtime::events::{Recorder, Reporter};
use kube::{Api, Client, Config};
use tokio_util::sync::CancellationToken;

use crate::computedomain::api;

pub mod cleanup;
pub mod lease;
pub mod objects;
pub mod pools;
pub mod publish;
pub mod reconcile;
pub mod status;

fn duration(s: &str) -> Result<Duration, String> {
    crate::health::parse_duration(s).map_err(|e| e.to_string())
}

/// Flags of `nvdra compute-domain controller` (NVIDIA's names and environment variables where
/// NVIDIA's controller has the setting).
#[derive(Debug, clap::Args)]
pub struct Args {
    /// A kubeconfig; without one, the in-cluster config (then `$KUBECONFIG`, `~/.kube/config`).
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// The driver's namespace: the DaemonSets, daemon claim templates and cliques live there.
    #[arg(long, env = "NAMESPACE", default_value = "nvdra")]
    pub namespace: String,
    /// The image of the daemon pods (nvdra's image: they run `nvdra compute-domain daemon`).
    #[arg(long, env = "IMAGE_NAME")]
    pub image_name: String,
    /// imagePullSecrets of the daemon pods, comma-separated.
    #[arg(long, env = "CD_DAEMON_IMAGE_PULL_SECRET_NAMES")]
    pub cd_daemon_image_pull_secret_names: Option<String>,
    /// The most nodes of one IMEX domain (18 on GB200 and GB300), handed to the daemons.
    #[arg(long, env = "MAX_NODES_PER_IMEX_DOMAIN", default_value_t = 18)]
    pub max_nodes_per_imex_domain: u32,
    /// The daemon pods' ServiceAccount (in the driver's namespace).
    #[arg(long, env = "DAEMON_SERVICE_ACCOUNT", default_value = api::DAEMON_SERVICE_ACCOUNT)]
    pub daemon_service_account: String,
    /// This pod's name: the leader identity's first part, the events' reporting instance.
    #[arg(long, env = "POD_NAME")]
    pub pod_name: Option<String>,
    /// Elect a leader among the replicas; without it, this process acts alone.
    #[arg(long, env = "LEADER_ELECTION_ENABLED", default_value_t = true, action = clap::ArgAction::Set)]
    pub leader_election_enabled: bool,
    /// The Lease's namespace (default: --namespace).
    #[arg(long, env = "LEADER_ELECTION_LEASE_LOCK_NAMESPACE")]
    pub leader_election_lease_lock_namespace: Option<String>,
    /// The Lease's name.
    #[arg(long, env = "LEADER_ELECTION_LEASE_LOCK_NAME", default_value = api::CONTROLLER_NAME)]
    pub leader_election_lease_lock_name: String,
    /// How long a leader's lease holds without renewal before another replica may take it.
    #[arg(long, env = "LEADER_ELECTION_LEASE_DURATION", default_value = "15s", value_parser = duration)]
    pub leader_election_lease_duration: Duration,
    /// How long the leader keeps trying to renew before it gives up (and exits).
    #[arg(long, env = "LEADER_ELECTION_RENEW_DEADLINE", default_value = "10s", value_parser = duration)]
    pub leader_election_renew_deadline: Duration,
    /// How often candidates try to take the lease and the leader renews it.
    #[arg(long, env = "LEADER_ELECTION_RETRY_PERIOD", default_value = "2s", value_parser = duration)]
    pub leader_election_retry_period: Duration,
    /// IMEX channels per NVLink clique pool (channels 1..=N of each clique's nodes), each clique
    /// with a DaemonSet of long-running per-clique IMEX daemons; 0: no pools and no per-clique
    /// daemons, so no domain can use clique channels.
    #[arg(long, env = "CLIQUE_CHANNELS", default_value_t = 0)]
    pub clique_channels: u32,
    /// The host's driver root (where `usr/bin/nvidia-imex` is), mounted read-only into the
    /// per-clique daemons.
    #[arg(long, env = "CLIQUE_DAEMON_DRIVER_ROOT", default_value = "/")]
    pub clique_daemon_driver_root: String,
    /// How often to look for objects of domains that are gone.
    #[arg(long, env = "CLEANUP_INTERVAL", default_value = "10m", value_parser = duration)]
    pub cleanup_interval: Duration,
}

/// Runs the controller until SIGTERM or SIGINT, or until it loses its lease.
pub fn run(args: Args) -> anyhow::Result<()> {
    let l = (
        args.leader_election_lease_duration,
        args.leader_election_renew_deadline,
        args.leader_election_retry_period,
    );
    if !(l.2 < l.1 && l.1 < l.0) {
        anyhow::bail!(
            "leader election: the retry period ({:?}) must be shorter than the renew deadline \
             ({:?}), and that shorter than the lease duration ({:?}): fix \
             --leader-election-retry-period, --leader-election-renew-deadline or \
             --leader-election-lease-duration",
            l.2,
            l.1,
            l.0
        );
    }
    crate::daemon::runtime()?.block_on(serve(args))
}

async fn client(kubeconfig: Option<&std::path::Path>) -> anyhow::Result<Client> {
    use anyhow::Context as _;
    let config = match kubeconfig {
        Some(path) => {
            let file = kube::config::Kubeconfig::read_from(path)
                .with_context(|| format!("cannot read kubeconfig {}", path.display()))?;
            Config::from_custom_kubeconfig(file, &kube::config::KubeConfigOptions::default())
                .await
                .with_context(|| format!("kubeconfig {} is not usable", path.display()))?
        }
        None => Config::infer().await.context(
            "no in-cluster config and no usable kubeconfig: run in a pod or pass --kubeconfig",
        )?,
    };
    Ok(Client::try_from(config)?)
}

fn identity(pod_name: Option<&str>) -> String {
    let base = pod_name
        .map(String::from)
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "nvdra-compute-domain-controller".into());
    format!("{base}_{:08x}", rand::random::<u32>())
}

async fn serve(args: Args) -> anyhow::Result<()> {
    let client = client(args.kubeconfig.as_deref()).await?;
    let shutdown = CancellationToken::new();
    {
        let shutdown = shutdown.clone();
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::spawn(async move {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
            tracing::info!("signal received; stopping");
            shutdown.cancel();
        });
    }
    let identity = identity(args.pod_name.as_deref());
    let settings = objects::Settings {
        namespace: args.namespace.clone(),
        image: args.image_name.clone(),
        daemon_service_account: args.daemon_service_account.clone(),
        image_pull_secrets: args
            .cd_daemon_image_pull_secret_names
            .as_deref()
            .unwrap_or_default()
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(String::from)
            .collect(),
        max_nodes_per_imex_domain: args.max_nodes_per_imex_domain,
        clique_daemon_driver_root: args.clique_daemon_driver_root.clone(),
    };
    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: api::CONTROLLER_NAME.into(),
            instance: Some(identity.clone()),
        },
    );
    let ctx = Arc::new(reconcile::Context {
        client: client.clone(),
        settings,
        recorder,
    });

    if !args.leader_election_enabled {
        tracing::info!("leader election disabled: acting alone");
        lead(ctx, &args, shutdown).await;
        return Ok(());
    }
    let namespace = args
        .leader_election_lease_lock_namespace
        .clone()
        .unwrap_or_else(|| args.namespace.clone());
    let mut elector = lease::Elector::new(
        Api::namespaced(client.clone(), &namespace),
        &args.leader_election_lease_lock_name,
        &identity,
        lease::Timings {
            lease_duration: args.leader_election_lease_duration,
            renew_deadline: args.leader_election_renew_deadline,
            retry_period: args.leader_election_retry_period,
        },
    );
    tracing::info!(identity = %elector.identity(), lease = %args.leader_election_lease_lock_name, "waiting to lead");
    if !elector.acquire(&shutdown).await {
        return Ok(());
    }
    // The leader's work stops when the lease is given up (shutdown) or lost.
    let term = shutdown.child_token();
    let (held, ()) = tokio::join!(
        async {
            let held = elector.hold(&shutdown).await;
            term.cancel();
            held
        },
        lead(ctx, &args, term.clone()),
    );
    held.map_err(Into::into)
}

/// What the leader does, until `shutdown`.
async fn lead(ctx: Arc<reconcile::Context>, args: &Args, shutdown: CancellationToken) {
    let client = ctx.client.clone();
    let namespace = args.namespace.clone();
    let interval = args.cleanup_interval;
    let sweep = {
        let shutdown = shutdown.clone();
        async move {
            loop {
                match cleanup::orphans(&client, &namespace).await {
                    Ok(r) if !r.objects.is_empty() => tracing::info!(
                        removed = ?r.objects,
                        "removed the objects of compute domains that no longer exist"
                    ),
                    Ok(_) => {}
                    Err(e) => tracing::warn!(error = %e, "orphan sweep failed; trying again later"),
                }
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(interval) => {}
                }
            }
        }
    };
    tokio::join!(
        reconcile::run(ctx.clone(), shutdown.clone()),
        publish::run(
            ctx.client.clone(),
            &ctx.settings,
            args.clique_channels,
            shutdown.clone()
        ),
        sweep,
    );
}
