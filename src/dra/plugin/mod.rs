//! The prepare/unprepare state machine of the DRA kubelet plugin, free of gRPC (the
//! kubelet-plugin library is the edge). Read top-down:
//!
//! - [`prepare`]: a prepare in order, read top to bottom: the library's `Driver` (the kubelet's
//!   batch of claims, one entry per claim, and the answer), each claim's steps, the order of its
//!   writes and its rollback; and unprepare;
//! - [`plan`]: pure — claim + inventory + settings → the device records to reserve;
//! - [`effects`]: MIG create/destroy, time slices, MPS, each with its undo, and the rollback;
//! - [`specs`]: the claim's CDI spec: what it names, written, checked and removed;
//! - [`mig_mode`]: dynamic MIG, a GPU's MIG mode switched by the claims it is prepared for;
//! - [`recovery`]: start-up repair of what a crash left.
//!
//! Prepare of one claim: read the ResourceClaim from the API server, check its UID and
//! allocation, take the results whose driver is ours, resolve each device in the inventory
//! (GPUs, existing MIG devices, and in partitionable mode MIG placements to create), resolve its
//! opaque config, reserve the devices in the ledger — atomically with the check that none of
//! them is held by another claim — then reconfigure the GPU, write the claim's CDI spec and record
//! `PrepareCompleted` durably (see [`prepare`] for which writes wait for which). Any failure
//! after the reservation rolls back what was done; a crash anywhere is repaired at start-up by
//! [`Plugin::recover`].
//!
//! Invariants:
//! - A device (a whole GPU, or overlapping MIG placements of one GPU) is never held by two claims
//!   at once, unless one of them has admin access or both are shared allocations (`shareID`).
//! - Operations on one claim are serialized; different claims run concurrently.
//! - A prepared claim re-prepared returns the same devices and CDI ids without rewriting anything.
//! - Unprepare of an unknown claim succeeds.
//! - One claim's failure is that claim's error, never the batch's.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use super::compute_mode::ComputeModes;
use super::mps::Mps;
use crate::api::ClaimReader;
use crate::cdi::DriverRoot;
use crate::ids::ClaimUid;
use crate::inventory::Inventory;
use crate::inventory::owner::{Watch, Writes};
use crate::inventory::switch_blocks::SwitchBlocks;
use crate::ledger::{self, Ledger};
use crate::metrics::Metrics;
use kubelet_plugin::nodelock::{self, NodeLock};

#[cfg(feature = "crash-points")]
pub mod crash;
mod effects;
mod enforce;
mod error;
mod metadata;
mod mig_mode;
mod plan;
mod prepare;
mod recovery;
mod specs;
mod status;

pub use enforce::{DaemonReport, PROBE_DEADLINE};
pub use error::{ClaimError, StartError};
pub use recovery::Recovery;
use specs::Specs;

/// Stops at a crash point of the SIGKILL tests; nothing without the `crash-points` feature.
macro_rules! crash_point {
    ($plugin:expr, $at:ident) => {
        #[cfg(feature = "crash-points")]
        $plugin.crash($crate::dra::plugin::crash::CrashPoint::$at);
    };
}
use crash_point;

/// The claim a kubelet names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClaimRef {
    pub namespace: String,
    pub name: String,
    pub uid: ClaimUid,
}

/// Fixed settings of a plugin instance.
#[derive(Clone, Debug)]
pub struct Options {
    pub driver: String,
    /// The pool devices are published in: the node name.
    pub pool: String,
    /// `<kubelet root>/plugins/<driver>`: checkpoint, lock.
    pub plugin_dir: PathBuf,
    pub cdi_root: PathBuf,
    pub driver_root: DriverRoot,
    pub boot_id: String,
    /// MIG placements without an instance may be prepared (the instance is created).
    pub partitionable: bool,
    /// Which shares of a GPU may be prepared, and how each is held (`--shared-capacity`,
    /// `--consumable-shares`): in `memory` mode allocations of `gpu-<minor>` consuming less than
    /// its memory, in `unlimited` and integer mode every allocation of it with a `shareID`.
    pub shared_capacity: crate::ledger::shares::ConsumableShares,
    /// Where MPS daemons are asked for (`--mps-root`; the MPS host runs them).
    pub mps_root: PathBuf,
    /// `--dynamic-mig`: a GPU that can switch MIG mode at run time ([`crate::inventory::Gpu::mig_toggle`])
    /// is switched on for a MIG placement and off for the GPU whole, and its placements are
    /// created at prepare as in partitionable mode ([`mig_mode`]).
    pub dynamic_mig: bool,
    /// `--dynamic-mig=keep-on`: MIG mode is not turned off after a GPU's last instance.
    pub keep_mig_on: bool,
    /// `--share-trust-domain`: who may hold shares of one GPU together
    /// ([`crate::sharing::trust`]); checked at reservation, under the ledger's lock.
    pub share_trust_domain: crate::sharing::trust::TrustDomain,
    /// `--proc-root`: where the host's processes are seen (the pods of the processes that keep
    /// a GPU from switching MIG mode are found by their cgroups there); `/proc` when `None`.
    pub proc_root: Option<PathBuf>,
    /// `--claim-status`: after a prepare, the claim's `status.devices` entries are written
    /// where the API keeps them ([`status`]).
    pub claim_status: bool,
}

struct Inner {
    opts: Options,
    api: Arc<dyn ClaimReader>,
    /// The write handle: the plugin's reconfigurations, and the node the owner publishes.
    gpus: Writes,
    ledger: Ledger,
    specs: Specs,
    mps: Mps,
    /// The compute mode of GPUs that hold shares, and its record.
    compute_modes: ComputeModes,
    /// The inventory owner's publications: the health monitor's record of the share daemons
    /// that do not answer ([`Plugin::watch_share_daemons`] reports to it), whose GPUs' new
    /// shares are refused.
    node: Watch,
    node_lock: NodeLock,
    metrics: Arc<Metrics>,
    /// Writes claims' `status.devices` after prepare; `None` where none is written.
    status: Option<status::ClaimStatus>,
    /// One async mutex per claim being worked on.
    claim_locks: Mutex<HashMap<ClaimUid, Arc<tokio::sync::Mutex<()>>>>,
    /// Dynamic MIG: one async mutex per GPU whose MIG mode may change ([`mig_mode`]).
    mig_locks: Mutex<HashMap<crate::inventory::GpuUuid, Arc<tokio::sync::Mutex<()>>>>,
    /// Dynamic MIG: the GPUs whose MIG mode this plugin will not switch now, and why (set from
    /// what the driver answered a switch; shared with the slice sync and `/metrics`).
    switch_blocks: SwitchBlocks,
    #[cfg(feature = "crash-points")]
    crash_at: std::sync::OnceLock<crash::CrashPoint>,
}

/// The plugin; cheap to clone.
#[derive(Clone)]
pub struct Plugin {
    inner: Arc<Inner>,
}

impl Plugin {
    /// Opens the ledger in `opts.plugin_dir`, consulting `elsewhere` at each reservation
    /// (`--mode both`: what containers hold); `gpus`: the write handle, over the owner's
    /// publications. Spawn the returned writer, then call [`Plugin::recover`] before serving.
    pub fn new(
        opts: Options,
        api: Arc<dyn ClaimReader>,
        gpus: Writes,
        metrics: Arc<Metrics>,
        elsewhere: Option<Arc<dyn ledger::HeldElsewhere>>,
    ) -> Result<(Plugin, ledger::Writer, ledger::LoadOutcome), StartError> {
        let mut specs = Specs::new(&opts.driver, &opts.driver_root, opts.cdi_root.clone())?;
        if opts.shared_capacity.enabled() {
            specs.enable_memory_limits(&opts.plugin_dir.join("bin"), Arc::new(gpus.clone()));
        }
        match specs.enable_mps_gate(&opts.plugin_dir.join("bin")) {
            Ok(true) => tracing::info!(
                "MPS start gate installed: a container of an MPS claim starts only while its \
                 daemon answers with a server up"
            ),
            Ok(false) => {}
            Err(e) => tracing::error!(
                error = %format!("{e:#}"),
                "cannot install the MPS start gate; MPS claims and shares will be refused"
            ),
        }
        let (ledger, writer, outcome) = Ledger::open(&opts.plugin_dir, &opts.boot_id, elsewhere)?;
        // The MPS control client runs here, so it is found where nvdra reads the driver.
        let mps = Mps::new(
            opts.mps_root.clone(),
            opts.driver_root.ctr().to_path_buf(),
            opts.boot_id.clone(),
        );
        let node_lock = NodeLock::new(&opts.plugin_dir);
        let status = opts
            .claim_status
            .then(|| status::ClaimStatus::new(&api, &opts.driver, &opts.pool))
            .flatten();
        let compute_modes = ComputeModes::new(&opts.plugin_dir);
        // The metrics' record: `/metrics` reads what the plugin records in it.
        let switch_blocks = metrics.switch_blocks.clone();
        let node = gpus.subscribe();
        Ok((
            Plugin {
                inner: Arc::new(Inner {
                    opts,
                    api,
                    gpus,
                    ledger,
                    specs,
                    mps,
                    compute_modes,
                    node,
                    node_lock,
                    metrics,
                    status,
                    claim_locks: Mutex::new(HashMap::new()),
                    mig_locks: Mutex::new(HashMap::new()),
                    switch_blocks,
                    #[cfg(feature = "crash-points")]
                    crash_at: std::sync::OnceLock::new(),
                }),
            },
            writer,
            outcome,
        ))
    }

    /// Which limit holds each prepared share claim's memory: `container` (the driver's limits on
    /// the container's cgroup) or `process` (the MPS per-process limit only).
    pub fn share_levels(&self) -> BTreeMap<ClaimUid, &'static str> {
        self.inner
            .specs
            .levels()
            .into_iter()
            .map(|(uid, level)| (uid, level.as_str()))
            .collect()
    }

    /// The GPUs whose MIG mode this plugin will not switch now (dynamic MIG), shared: the slice
    /// sync applies them to each inventory it publishes
    /// ([`SwitchBlocks::apply`]), so a GPU that answered `RESET_REQUIRED` is published as one
    /// whose MIG mode is the operator's, and one whose switch met `IN_USE` has the devices that
    /// need a switch tainted. The plugin sets and clears them; the slice sync follows their
    /// changes ([`SwitchBlocks::changes`]).
    pub fn switch_blocks(&self) -> SwitchBlocks {
        self.inner.switch_blocks.clone()
    }

    pub fn ledger(&self) -> &Ledger {
        &self.inner.ledger
    }

    pub fn driver(&self) -> &str {
        &self.inner.opts.driver
    }

    async fn enter(&self) -> Result<nodelock::Guard, ClaimError> {
        let ledger = self.inner.ledger.clone();
        self.inner
            .node_lock
            .enter(move || {
                ledger
                    .reload_if_changed()
                    .map(|_| ())
                    .map_err(ClaimError::from)
            })
            .await
    }

    /// The node as the owner published it; after one of this plugin's reconfigurations, the
    /// first read that saw it.
    async fn snapshot(&self) -> Result<Arc<Inventory>, ClaimError> {
        Ok(self.inner.gpus.node().await?)
    }

    async fn blocking<R: Send + 'static>(
        &self,
        f: impl FnOnce(&Inner) -> R + Send + 'static,
    ) -> Result<R, ClaimError> {
        let inner = self.inner.clone();
        tokio::task::spawn_blocking(move || f(&inner))
            .await
            .map_err(ClaimError::Task)
    }
}

#[cfg(test)]
mod tests;
