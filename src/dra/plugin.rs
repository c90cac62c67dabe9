//! The prepare/unprepare state machine of the DRA kubelet plugin, free of gRPC (see `grpc` and
//! `wire` for the edge).
//!
//! Prepare of one claim: read the ResourceClaim from the API server, check its UID and
//! allocation, take the results whose driver is ours, resolve each device in the inventory
//! (GPUs, existing MIG devices, and in partitionable mode MIG placements to create), resolve its
//! opaque config, then
//! 1. record the claim `PrepareStarted` with its devices in the ledger — atomically with the check
//!    that none of its devices is held by another claim — and make that durable;
//! 2. reconfigure (create MIG devices, set time slices, start MPS daemons);
//! 3. write the claim's CDI spec;
//! 4. record `PrepareCompleted` and make it durable.
//!
//! Any failure after step 1 rolls back what was done. A crash anywhere is repaired at start-up by
//! [`Plugin::recover`]: `Started` claims are rolled back, completed claims get their CDI spec
//! rewritten if it is missing, CDI specs of ours without a ledger entry are removed.
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
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use k8s_openapi::api::resource::v1::ResourceClaim;

use super::mps::{self, Mps};
use super::nodelock::{self, NodeLock};
use super::slices::{self, PublishedDevice};
use crate::api::{self, ClaimReader};
use crate::cdi::{self, CdiOptions, DriverFiles, PreparedDevice};
use crate::inventory::{
    self, DeviceBackend, Gpu, GpuUuid, Inventory, MigDevice, Placement, TimeSlice,
};
use crate::ledger::{self, ClaimEntry, ClaimState, ClaimUid, DeviceRecord, Ledger, MigRecord};
use crate::metrics::{Histogram, Metrics};
use crate::sharing::{self, DeviceKind, Sharing, TimeSliceInterval};

/// Environment variable naming a [`CrashPoint`]: the process stops there to be killed. For crash
/// tests only.
pub const CRASH_ENV: &str = "NVDRA_TEST_CRASH_AT";
/// The file (in the plugin directory) a process stopped at its crash point leaves behind.
pub const CRASH_MARKER: &str = "test-crash-point-reached";

/// Where a crash test makes prepare abort.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CrashPoint {
    /// The `PrepareStarted` record is durable; nothing else is done.
    AfterStarted,
    /// The CDI spec is written; the claim is not completed.
    AfterCdi,
    /// `PrepareCompleted` is recorded in memory but not yet on disk.
    BeforeCompleted,
    /// Everything is durable; the reply was not sent.
    AfterCompleted,
}

impl std::str::FromStr for CrashPoint {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "after-started" => Self::AfterStarted,
            "after-cdi" => Self::AfterCdi,
            "before-completed" => Self::BeforeCompleted,
            "after-completed" => Self::AfterCompleted,
            _ => {
                return Err(format!(
                    "{s:?}: expected after-started, after-cdi, before-completed or after-completed"
                ));
            }
        })
    }
}

/// Why one claim could not be prepared or unprepared. Reported in that claim's response entry.
#[derive(Debug, thiserror::Error)]
pub enum ClaimError {
    #[error("resource claim {namespace}/{name} not found in the API server (deleted?)")]
    NotFound { namespace: String, name: String },
    #[error("cannot read resource claim {namespace}/{name}: {source}")]
    Api {
        namespace: String,
        name: String,
        source: api::Error,
    },
    #[error(
        "resource claim {namespace}/{name} now has UID {found}, not {expected}: it was deleted and \
         re-created; the kubelet retries with the new claim"
    )]
    UidChanged {
        namespace: String,
        name: String,
        expected: String,
        found: String,
    },
    #[error(
        "resource claim {namespace}/{name} is not allocated; the scheduler has not placed it yet"
    )]
    NotAllocated { namespace: String, name: String },
    #[error("device {device} of pool {pool} is not on this node (pool {ours}): {reason}")]
    UnknownDevice {
        pool: String,
        device: String,
        ours: String,
        reason: String,
    },
    #[error(
        "device {device} is already prepared for claim {namespace}/{name} ({uid}); it must be \
         unprepared first (was a pod force-deleted?)"
    )]
    DeviceInUse {
        device: String,
        namespace: String,
        name: String,
        uid: ClaimUid,
    },
    #[error("invalid device configuration for request {request}: {source}")]
    Config {
        request: String,
        source: sharing::Error,
    },
    #[error("claim UID {uid:?} cannot name a CDI device: {source}")]
    BadUid { uid: String, source: cdi::Error },
    #[error(transparent)]
    Backend(#[from] inventory::Error),
    #[error(transparent)]
    Mps(#[from] mps::Error),
    #[error(transparent)]
    Cdi(#[from] cdi::Error),
    #[error(transparent)]
    Ledger(#[from] ledger::Error),
    #[error(transparent)]
    Lock(#[from] nodelock::Error),
    #[error("internal task failed: {0}")]
    Task(String),
    /// The whole batch could not start (node lock, inventory); the kubelet retries.
    #[error("{0}")]
    Unavailable(String),
}

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
    /// `<kubelet root>/plugins/<driver>`: checkpoint, lock, MPS directories.
    pub plugin_dir: PathBuf,
    pub cdi_root: PathBuf,
    pub driver_root: PathBuf,
    pub boot_id: String,
    /// MIG placements without an instance may be prepared (the instance is created).
    pub partitionable: bool,
    pub crash_at: Option<CrashPoint>,
}

struct Inner {
    opts: Options,
    api: Arc<dyn ClaimReader>,
    backend: Arc<dyn DeviceBackend>,
    ledger: Ledger,
    cdi: CdiOptions,
    driver_files: DriverFiles,
    mps: Mps,
    node_lock: NodeLock,
    metrics: Arc<Metrics>,
    /// Told when prepare or unprepare changed the hardware (MIG devices), so slices follow.
    inventory_listener: std::sync::OnceLock<Arc<dyn Fn() + Send + Sync>>,
    /// One async mutex per claim being worked on.
    claim_locks: Mutex<HashMap<ClaimUid, Arc<tokio::sync::Mutex<()>>>>,
}

/// Why a plugin could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Ledger(#[from] ledger::Error),
    #[error(transparent)]
    Cdi(#[from] cdi::Error),
}

/// The plugin; cheap to clone.
#[derive(Clone)]
pub struct Plugin {
    inner: Arc<Inner>,
}

/// What start-up repaired.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Recovery {
    pub loaded: Option<ledger::LoadOutcome>,
    pub rolled_back: Vec<ClaimUid>,
    pub cdi_rewritten: Vec<ClaimUid>,
    pub orphans_removed: Vec<ClaimUid>,
    /// Claims that could not be recovered (logged); their entries stay.
    pub failed: Vec<ClaimUid>,
}

/// The hardware a ledger record occupies.
fn occupies(r: &DeviceRecord) -> (&inventory::GpuUuid, Option<Placement>) {
    (&r.gpu, r.mig.as_ref().map(|m| m.placement))
}

fn conflicts(a: &DeviceRecord, b: &DeviceRecord) -> bool {
    if a.admin_access || b.admin_access || (a.share_id.is_some() && b.share_id.is_some()) {
        return false;
    }
    let (ga, pa) = occupies(a);
    let (gb, pb) = occupies(b);
    ga == gb
        && match (pa, pb) {
            (Some(x), Some(y)) => x.overlaps(&y),
            _ => true,
        }
}

/// The UUIDs (GPU or MIG) of a claim's MPS-shared devices, for its MPS daemon.
fn mps_devices(devices: &[DeviceRecord]) -> Vec<GpuUuid> {
    devices
        .iter()
        .filter(|d| matches!(d.sharing, Sharing::Mps(_)))
        .map(|d| {
            d.mig
                .as_ref()
                .and_then(|m| m.uuid.clone())
                .unwrap_or_else(|| d.gpu.clone())
        })
        .collect()
}

/// Whether preparing these devices changes GPU state (creates a MIG instance, starts an MPS
/// daemon, sets a time slice), which must be recorded durably before it happens.
fn touches_hardware(devices: &[DeviceRecord]) -> bool {
    devices.iter().any(|d| {
        d.mig.as_ref().is_some_and(|m| m.created) || !matches!(d.sharing, Sharing::Exclusive)
    })
}

fn time_slice(i: TimeSliceInterval) -> TimeSlice {
    match i {
        TimeSliceInterval::Default => TimeSlice::Default,
        TimeSliceInterval::Short => TimeSlice::Short,
        TimeSliceInterval::Medium => TimeSlice::Medium,
        TimeSliceInterval::Long => TimeSlice::Long,
    }
}

/// What an allocated device name stands for on this node.
enum Resolved<'a> {
    Gpu(&'a Gpu),
    Mig(&'a Gpu, &'a MigDevice),
    /// A placement with no instance yet: created at prepare (partitionable mode).
    MigToCreate(&'a Gpu, &'a inventory::MigProfile, Placement),
}

/// Resolves a device name (named as [`slices::DeviceName`] does) to hardware that can be
/// prepared now, or says why not.
fn resolve_device<'a>(
    inv: &'a Inventory,
    name: &str,
    partitionable: bool,
) -> Result<Resolved<'a>, String> {
    match slices::find_device(inv, name) {
        None => Err(
            "no such GPU, MIG device or MIG placement (names look like gpu-<minor> \
                     or gpu-<minor>-mig-<profile>-<giProfileId>-<start>)"
                .into(),
        ),
        Some(PublishedDevice::Gpu(g)) if g.in_mig_mode() => Err(format!(
            "GPU {} is in MIG mode and is handed out only as MIG devices",
            g.minor
        )),
        Some(PublishedDevice::Gpu(g)) => Ok(Resolved::Gpu(g)),
        Some(PublishedDevice::Mig {
            parent,
            existing: Some(m),
            ..
        }) => Ok(Resolved::Mig(parent, m)),
        Some(PublishedDevice::Mig { parent, .. }) if !parent.in_mig_mode() => {
            Err(format!("GPU {} is not in MIG mode", parent.minor))
        }
        Some(PublishedDevice::Mig { .. }) if !partitionable => Err(
            "no MIG device exists at this placement, and creating MIG devices at prepare needs \
             partitionable mode"
                .into(),
        ),
        Some(PublishedDevice::Mig {
            parent,
            existing: None,
            profile: Some(p),
            placement,
        }) => Ok(Resolved::MigToCreate(parent, p, placement)),
        Some(PublishedDevice::Mig { profile: None, .. }) => {
            Err("the GPU does not list this MIG profile".into())
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Map inserts/removes only; a panic elsewhere cannot leave a half-done change.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Plugin {
    /// Opens the ledger in `opts.plugin_dir`. Spawn the returned writer, then call
    /// [`Plugin::recover`] before serving.
    pub fn new(
        opts: Options,
        api: Arc<dyn ClaimReader>,
        backend: Arc<dyn DeviceBackend>,
        metrics: Arc<Metrics>,
    ) -> Result<(Plugin, ledger::Writer, ledger::LoadOutcome), StartError> {
        let cdi = CdiOptions::resolve(&opts.driver, &opts.driver_root)?;
        let driver_files = cdi::discover_driver_files(&opts.driver_root);
        let (ledger, writer, outcome) = Ledger::open(&opts.plugin_dir, &opts.boot_id)?;
        let mps = Mps::new(opts.plugin_dir.join("mps"), opts.driver_root.clone());
        let node_lock = NodeLock::new(&opts.plugin_dir);
        Ok((
            Plugin {
                inner: Arc::new(Inner {
                    opts,
                    api,
                    backend,
                    ledger,
                    cdi,
                    driver_files,
                    mps,
                    node_lock,
                    metrics,
                    inventory_listener: std::sync::OnceLock::new(),
                    claim_locks: Mutex::new(HashMap::new()),
                }),
            },
            writer,
            outcome,
        ))
    }

    /// Sets the function called after MIG devices were created or destroyed (once).
    pub fn on_inventory_change(&self, f: Arc<dyn Fn() + Send + Sync>) {
        if self.inner.inventory_listener.set(f).is_err() {
            tracing::warn!("inventory listener already set; keeping the first");
        }
    }

    fn inventory_changed(&self) {
        if let Some(f) = self.inner.inventory_listener.get() {
            f();
        }
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

    async fn snapshot(&self) -> Result<Inventory, ClaimError> {
        Ok(inventory::snapshot(self.inner.backend.clone()).await?)
    }

    async fn blocking<R: Send + 'static>(
        &self,
        f: impl FnOnce(&Inner) -> R + Send + 'static,
    ) -> Result<R, ClaimError> {
        let inner = self.inner.clone();
        tokio::task::spawn_blocking(move || f(&inner))
            .await
            .map_err(|e| ClaimError::Task(e.to_string()))
    }

    /// Crash tests only: stops dead at `at` (the thread never returns), after dropping a marker
    /// file, so the test can SIGKILL the process exactly there.
    fn crash(&self, at: CrashPoint) {
        if self.inner.opts.crash_at == Some(at) {
            tracing::error!(?at, "{CRASH_ENV} reached; waiting to be killed");
            let marker = self.inner.opts.plugin_dir.join(CRASH_MARKER);
            if let Err(e) = std::fs::write(&marker, format!("{at:?}\n")) {
                tracing::error!(error = %e, "cannot write {}; aborting instead", marker.display());
                std::process::abort();
            }
            loop {
                std::thread::park();
            }
        }
    }

    fn claim_lock(&self, uid: &ClaimUid) -> Arc<tokio::sync::Mutex<()>> {
        lock(&self.inner.claim_locks)
            .entry(uid.clone())
            .or_default()
            .clone()
    }

    fn release_claim_lock(&self, uid: &ClaimUid, l: Arc<tokio::sync::Mutex<()>>) {
        let mut locks = lock(&self.inner.claim_locks);
        drop(l);
        // The map's own reference is the last one: nobody else waits on this claim.
        if locks.get(uid).is_some_and(|l| Arc::strong_count(l) == 1) {
            locks.remove(uid);
        }
    }

    /// Repairs what a crash or reboot left behind. Call once before serving.
    pub async fn recover(&self) -> Result<Recovery, ClaimError> {
        let _g = self.enter().await?;
        let mut rec = Recovery::default();
        let entries = self.inner.ledger.read(|c| c.claims.clone());
        let inv = self.snapshot().await?;
        // One claim's trouble (hardware gone, a daemon that will not start) must not keep the
        // plugin from serving the others: log it, keep its entry, and go on. Its next prepare or
        // unprepare retries.
        for (uid, entry) in &entries {
            let claim = format!("{}/{}", entry.namespace, entry.name);
            let result = match entry.state {
                ClaimState::PrepareStarted => {
                    tracing::warn!(claim.uid = %uid, %claim, "prepare was interrupted; rolling back");
                    let r = self.rollback(uid, &entry.devices).await;
                    if r.is_ok() {
                        rec.rolled_back.push(uid.clone());
                    }
                    r
                }
                ClaimState::PrepareCompleted => self.restore(uid, entry, &inv, &mut rec).await,
            };
            if let Err(e) = result {
                tracing::error!(claim.uid = %uid, %claim, error = %e, "cannot recover claim; left for its next prepare or unprepare");
                rec.failed.push(uid.clone());
            }
        }
        let known = self.inner.ledger.read(|c| c.claims.clone());
        for uid in cdi::list_claim_specs(&self.inner.opts.cdi_root, &self.inner.cdi)? {
            let uid = ClaimUid(uid);
            if !known.contains_key(&uid) {
                self.remove_spec(&uid)?;
                tracing::warn!(claim.uid = %uid, "removed orphan CDI spec with no checkpoint entry");
                rec.orphans_removed.push(uid);
            }
        }
        self.inner.ledger.flush().await?;
        Ok(rec)
    }

    /// Brings a completed claim's host state back: its MPS daemon and its CDI spec.
    async fn restore(
        &self,
        uid: &ClaimUid,
        entry: &ClaimEntry,
        inv: &Inventory,
        rec: &mut Recovery,
    ) -> Result<(), ClaimError> {
        let mps: Vec<GpuUuid> = mps_devices(&entry.devices);
        if !mps.is_empty() {
            let owner = uid.clone();
            self.blocking(move |i| i.mps.ensure(&owner, &mps)).await??;
        }
        if !entry.devices.is_empty() && !self.spec_exists(uid) {
            self.write_cdi(uid, &entry.devices, inv).await?;
            tracing::info!(claim.uid = %uid, "CDI spec was missing; rewritten from the checkpoint");
            rec.cdi_rewritten.push(uid.clone());
        }
        Ok(())
    }

    /// Prepares a batch; one result per claim, in order.
    pub async fn prepare(
        &self,
        claims: Vec<ClaimRef>,
    ) -> Vec<(ClaimUid, Result<Vec<DeviceRecord>, ClaimError>)> {
        // One snapshot per batch: MIG devices created by this batch are tracked in the ledger,
        // which is what conflict checks read.
        let setup = async { Ok(Arc::new(self.snapshot().await?)) };
        let m = &self.inner.metrics;
        let outcome = (&m.prepare_ok, &m.prepare_failed, &m.prepare_seconds);
        self.batch(claims, "prepare", outcome, setup, |c, inv| async move {
            self.prepare_one(&c, &inv).await
        })
        .await
    }

    /// Unprepares a batch; one result per claim, in order.
    pub async fn unprepare(
        &self,
        claims: Vec<ClaimRef>,
    ) -> Vec<(ClaimUid, Result<(), ClaimError>)> {
        let m = &self.inner.metrics;
        let outcome = (&m.unprepare_ok, &m.unprepare_failed, &m.unprepare_seconds);
        self.batch(
            claims,
            "unprepare",
            outcome,
            async { Ok(()) },
            |c, ()| async move { self.unprepare_one(&c.uid).await },
        )
        .await
    }

    /// Runs `op` for each claim of a batch: under the node lock, each claim under its own lock,
    /// different claims concurrently, after `setup` (whose value every claim gets). When the
    /// batch cannot start (lock, setup), every claim fails with that reason, so the kubelet still
    /// gets an entry per claim. Counts outcomes and the batch's duration.
    async fn batch<S, T, Setup, Op, Fut>(
        &self,
        claims: Vec<ClaimRef>,
        what: &'static str,
        (ok, failed, seconds): (&AtomicU64, &AtomicU64, &Histogram),
        setup: Setup,
        op: Op,
    ) -> Vec<(ClaimUid, Result<T, ClaimError>)>
    where
        S: Clone,
        Setup: Future<Output = Result<S, ClaimError>>,
        Op: Fn(ClaimRef, S) -> Fut,
        Fut: Future<Output = Result<T, ClaimError>>,
    {
        if claims.is_empty() {
            return Vec::new();
        }
        let started = Instant::now();
        let state = match self.enter().await {
            Ok(guard) => setup.await.map(|s| (guard, s)),
            Err(e) => Err(e),
        };
        let results = match state {
            Err(e) => {
                let msg = e.to_string();
                claims
                    .into_iter()
                    .map(|c| (c.uid, Err(ClaimError::Unavailable(msg.clone()))))
                    .collect()
            }
            Ok((_guard, shared)) => {
                let futs = claims.into_iter().map(|c| {
                    let (shared, op) = (shared.clone(), &op);
                    async move {
                        let uid = c.uid.clone();
                        let who = format!("{}/{}", c.namespace, c.name);
                        let l = self.claim_lock(&uid);
                        let r = {
                            let _held = l.lock().await;
                            op(c, shared).await
                        };
                        self.release_claim_lock(&uid, l);
                        if let Err(e) = &r {
                            tracing::warn!(claim.uid = %uid, claim = %who, error = %e, "{what} failed");
                        }
                        (uid, r)
                    }
                });
                futures::future::join_all(futs).await
            }
        };
        for (_, r) in &results {
            let c = if r.is_ok() { ok } else { failed };
            c.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        seconds.observe(started.elapsed());
        results
    }

    async fn prepare_one(
        &self,
        claim: &ClaimRef,
        inv: &Inventory,
    ) -> Result<Vec<DeviceRecord>, ClaimError> {
        let uid = &claim.uid;
        // Idempotency: a completed claim is answered from the ledger.
        if let Some(entry) = self.inner.ledger.read(|c| c.claims.get(uid).cloned()) {
            if entry.state == ClaimState::PrepareCompleted {
                if !entry.devices.is_empty() && !self.spec_exists(uid) {
                    self.write_cdi(uid, &entry.devices, inv).await?;
                    tracing::info!(claim.uid = %uid, "CDI spec was missing; rewritten");
                }
                tracing::debug!(claim.uid = %uid, "already prepared");
                return Ok(entry.devices);
            }
            // A `Started` entry outside recovery is a prepare that failed and could not roll
            // back completely; roll back again before starting over.
            self.rollback(uid, &entry.devices).await?;
        }

        let rc = self.read_claim(claim).await?;
        let planned = self.plan(claim, &rc, inv)?;

        // Step 1: reserve, atomically with the conflict check.
        self.inner.ledger.update(|claims| {
            for d in &planned {
                for (other_uid, other) in claims.iter() {
                    if other_uid == uid {
                        continue;
                    }
                    if other.devices.iter().any(|o| conflicts(d, o)) {
                        return Err(ClaimError::DeviceInUse {
                            device: d.device.clone(),
                            namespace: other.namespace.clone(),
                            name: other.name.clone(),
                            uid: other_uid.clone(),
                        });
                    }
                }
            }
            claims.insert(
                uid.clone(),
                ClaimEntry {
                    state: ClaimState::PrepareStarted,
                    namespace: claim.namespace.clone(),
                    name: claim.name.clone(),
                    devices: planned.clone(),
                },
            );
            Ok(())
        })?;
        // A claim that changes nothing on the GPU (no MIG instance, no MPS daemon, no time
        // slice) may write its CDI spec while the started record is being made durable: if the
        // process dies before both are on disk, the spec has no checkpoint entry and recovery
        // removes it as an orphan. That takes one fsync'd write off the critical path. Claims
        // that change the hardware record their intent durably first, so a crash can be undone.
        let cdi_written = if touches_hardware(&planned) || planned.is_empty() {
            if let Err(e) = self.inner.ledger.flush().await {
                self.inner.ledger.update(|c| c.remove(uid));
                return Err(e.into());
            }
            false
        } else {
            let (flushed, written) = tokio::join!(
                self.inner.ledger.flush(),
                self.write_cdi(uid, &planned, inv)
            );
            if let Err(e) = flushed.map_err(ClaimError::from).and(written) {
                if let Err(re) = self.rollback(uid, &planned).await {
                    tracing::error!(claim.uid = %uid, error = %re, "rollback after a failed prepare failed; retried on the next prepare or restart");
                }
                return Err(e);
            }
            true
        };
        self.crash(CrashPoint::AfterStarted);

        match self.apply(uid, planned, inv, cdi_written).await {
            Ok(devices) => Ok(devices),
            Err((e, devices)) => {
                if let Err(re) = self.rollback(uid, &devices).await {
                    tracing::error!(claim.uid = %uid, error = %re, "rollback after a failed prepare failed; retried on the next prepare or restart");
                }
                Err(e)
            }
        }
    }

    /// Steps 2–4; on failure returns the devices as far as they got, for the rollback.
    async fn apply(
        &self,
        uid: &ClaimUid,
        mut devices: Vec<DeviceRecord>,
        inv: &Inventory,
        cdi_written: bool,
    ) -> Result<Vec<DeviceRecord>, (ClaimError, Vec<DeviceRecord>)> {
        let mut created: Vec<MigDevice> = Vec::new();
        for i in 0..devices.len() {
            let d = devices[i].clone();
            let step: Result<(), ClaimError> = async {
                if let Some(m) = &d.mig
                    && m.created
                {
                    let (gpu, gi, placement) = (d.gpu.clone(), m.gi_profile_id, m.placement);
                    let dev = self
                        .blocking(move |i| i.backend.create_mig(&gpu, gi, placement))
                        .await??;
                    tracing::info!(claim.uid = %uid, device = %d.device, mig.uuid = %dev.uuid, "MIG device created");
                    self.inventory_changed();
                    if let Some(rec) = devices[i].mig.as_mut() {
                        rec.uuid = Some(dev.uuid.clone());
                    }
                    created.push(dev);
                }
                if let (Sharing::TimeSlicing { interval }, None) = (&d.sharing, &d.mig) {
                    // MIG devices are not time-sliced by interval; only whole GPUs are.
                    let (gpu, interval) = (d.gpu.clone(), time_slice(*interval));
                    self.blocking(move |i| i.backend.set_time_slice(&gpu, interval))
                        .await??;
                }
                Ok(())
            }
            .await;
            if let Err(e) = step {
                return Err((e, devices));
            }
        }
        let mps = mps_devices(&devices);
        if !mps.is_empty() {
            let owner = uid.clone();
            let started = self
                .blocking(move |i| i.mps.start(&owner, &mps))
                .await
                .and_then(|r| r.map_err(ClaimError::from));
            if let Err(e) = started {
                return Err((e, devices));
            }
        }
        // Record created MIG UUIDs so a rollback finds them (not yet durable; the rollback also
        // finds instances by placement).
        self.inner.ledger.update(|c| {
            if let Some(e) = c.get_mut(uid) {
                e.devices = devices.clone();
            }
        });

        let mut inv_now;
        let inv = if created.is_empty() {
            inv
        } else {
            inv_now = inv.clone();
            for m in &created {
                if let Some(g) = devices
                    .iter()
                    .find(|d| d.mig.as_ref().and_then(|r| r.uuid.as_ref()) == Some(&m.uuid))
                    .and_then(|d| inv_now.gpus.iter_mut().find(|g| g.uuid == d.gpu))
                {
                    g.mig.devices.push(m.clone());
                }
            }
            &inv_now
        };
        if !devices.is_empty()
            && !cdi_written
            && let Err(e) = self.write_cdi(uid, &devices, inv).await
        {
            return Err((e, devices));
        }
        self.crash(CrashPoint::AfterCdi);

        self.inner.ledger.update(|c| {
            if let Some(e) = c.get_mut(uid) {
                e.state = ClaimState::PrepareCompleted;
            }
        });
        self.crash(CrashPoint::BeforeCompleted);
        if let Err(e) = self.inner.ledger.flush().await {
            return Err((e.into(), devices));
        }
        self.crash(CrashPoint::AfterCompleted);
        tracing::info!(claim.uid = %uid, devices = devices.len(), "claim prepared");
        Ok(devices)
    }

    async fn read_claim(&self, claim: &ClaimRef) -> Result<ResourceClaim, ClaimError> {
        let rc = self
            .inner
            .api
            .get_claim(&claim.namespace, &claim.name)
            .await
            .map_err(|e| match e {
                api::Error::NotFound(_) => ClaimError::NotFound {
                    namespace: claim.namespace.clone(),
                    name: claim.name.clone(),
                },
                source => ClaimError::Api {
                    namespace: claim.namespace.clone(),
                    name: claim.name.clone(),
                    source,
                },
            })?;
        let found = rc.metadata.uid.clone().unwrap_or_default();
        if found != claim.uid.as_str() {
            return Err(ClaimError::UidChanged {
                namespace: claim.namespace.clone(),
                name: claim.name.clone(),
                expected: claim.uid.to_string(),
                found,
            });
        }
        Ok(rc)
    }

    /// The device records a claim's allocation asks for.
    fn plan(
        &self,
        claim: &ClaimRef,
        rc: &ResourceClaim,
        inv: &Inventory,
    ) -> Result<Vec<DeviceRecord>, ClaimError> {
        let opts = &self.inner.opts;
        let devices = rc
            .status
            .as_ref()
            .and_then(|s| s.allocation.as_ref())
            .and_then(|a| a.devices.as_ref())
            .ok_or_else(|| ClaimError::NotAllocated {
                namespace: claim.namespace.clone(),
                name: claim.name.clone(),
            })?;
        let entries = rc
            .status
            .as_ref()
            .and_then(|s| s.allocation.as_ref())
            .map(sharing::from_allocation)
            .unwrap_or_default();
        cdi::validate_device_name(claim.uid.as_str()).map_err(|source| ClaimError::BadUid {
            uid: claim.uid.to_string(),
            source,
        })?;
        let mut out: Vec<DeviceRecord> = Vec::new();
        let mut index: BTreeMap<(String, String), usize> = BTreeMap::new();
        for r in devices.results.iter().flatten() {
            if r.driver != opts.driver {
                continue;
            }
            let unknown = |reason: String| ClaimError::UnknownDevice {
                pool: r.pool.clone(),
                device: r.device.clone(),
                ours: opts.pool.clone(),
                reason,
            };
            if r.pool != opts.pool {
                return Err(unknown("the pool is another node's".into()));
            }
            let base = r
                .request
                .split('/')
                .next()
                .unwrap_or(&r.request)
                .to_string();
            if let Some(&i) = index.get(&(r.pool.clone(), r.device.clone())) {
                let d: &mut DeviceRecord = &mut out[i];
                if !d.requests.contains(&base) {
                    d.requests.push(base);
                }
                continue;
            }
            let resolved = resolve_device(inv, &r.device, opts.partitionable).map_err(unknown)?;
            let (gpu, mig, kind) = match resolved {
                Resolved::Gpu(g) => (g, None, DeviceKind::Gpu),
                Resolved::Mig(g, m) => (
                    g,
                    Some(MigRecord {
                        uuid: Some(m.uuid.clone()),
                        profile: m.profile.clone(),
                        gi_profile_id: m.gi_profile_id,
                        placement: m.placement,
                        created: false,
                    }),
                    DeviceKind::Mig,
                ),
                Resolved::MigToCreate(g, p, placement) => (
                    g,
                    Some(MigRecord {
                        uuid: None,
                        profile: p.name.clone(),
                        gi_profile_id: p.gi_profile_id,
                        placement,
                        created: true,
                    }),
                    DeviceKind::Mig,
                ),
            };
            let config_err = |source| ClaimError::Config {
                request: r.request.clone(),
                source,
            };
            let config =
                sharing::config_for_device(&entries, &opts.driver, &r.request, kind, &r.device)
                    .map_err(config_err)?;
            let sharing = sharing::sharing_for(config, kind, &r.device).map_err(config_err)?;
            index.insert((r.pool.clone(), r.device.clone()), out.len());
            out.push(DeviceRecord {
                requests: vec![base],
                pool: r.pool.clone(),
                device: r.device.clone(),
                cdi_ids: vec![cdi::device_id(
                    &self.inner.cdi,
                    claim.uid.as_str(),
                    &r.device,
                )],
                share_id: r.share_id.clone(),
                admin_access: r.admin_access.unwrap_or(false),
                gpu: gpu.uuid.clone(),
                mig,
                sharing,
            });
        }
        Ok(out)
    }

    fn spec_exists(&self, uid: &ClaimUid) -> bool {
        cdi::spec_path(&self.inner.opts.cdi_root, &self.inner.cdi, uid.as_str()).exists()
    }

    fn remove_spec(&self, uid: &ClaimUid) -> Result<bool, ClaimError> {
        Ok(cdi::remove_spec(
            &self.inner.opts.cdi_root,
            &self.inner.cdi,
            uid.as_str(),
        )?)
    }

    /// Builds and writes the claim's CDI spec on the blocking pool (it reads the host).
    async fn write_cdi(
        &self,
        uid: &ClaimUid,
        devices: &[DeviceRecord],
        inv: &Inventory,
    ) -> Result<(), ClaimError> {
        let gone = |d: &DeviceRecord, reason: String| ClaimError::UnknownDevice {
            pool: d.pool.clone(),
            device: d.device.clone(),
            ours: self.inner.opts.pool.clone(),
            reason,
        };
        let mut prepared = Vec::with_capacity(devices.len());
        for d in devices {
            let gpu = inv
                .gpu_by_uuid(d.gpu.as_str())
                .ok_or_else(|| gone(d, format!("GPU {} is gone", d.gpu)))?;
            let mig = match &d.mig {
                None => None,
                Some(m) => Some(
                    gpu.mig
                        .devices
                        .iter()
                        .find(|x| Some(&x.uuid) == m.uuid.as_ref())
                        .ok_or_else(|| gone(d, "the MIG device is gone".into()))?
                        .clone(),
                ),
            };
            prepared.push(PreparedDevice {
                name: d.device.clone(),
                gpu: gpu.clone(),
                mig,
                mps_pipe_dir: matches!(d.sharing, Sharing::Mps(_))
                    .then(|| self.inner.mps.pipe_dir(uid)),
                sharing: d.sharing.clone(),
            });
        }
        let uid = uid.clone();
        self.blocking(move |i| {
            let spec = cdi::claim_spec(&i.cdi, uid.as_str(), &prepared, &i.driver_files)?;
            cdi::write_spec(&i.opts.cdi_root, &i.cdi, uid.as_str(), &spec)?;
            Ok::<_, ClaimError>(())
        })
        .await?
    }

    /// Undoes whatever a (partial) prepare of `uid` did, then forgets the claim. Each step can be
    /// repeated safely.
    async fn rollback(&self, uid: &ClaimUid, devices: &[DeviceRecord]) -> Result<(), ClaimError> {
        self.undo_devices(uid, devices).await?;
        // The GPU is back to its old state; the spec and the entry may now go in parallel. A
        // crash in between leaves either an orphan spec (removed at start) or a completed entry
        // without a spec (rewritten at start, then unprepared again by the kubelet).
        let spec_uid = uid.clone();
        let (removed, flushed) = tokio::join!(
            self.blocking(move |i| {
                cdi::remove_spec(&i.opts.cdi_root, &i.cdi, spec_uid.as_str())
                    .map_err(ClaimError::from)
            }),
            async {
                self.inner.ledger.update(|c| c.remove(uid));
                self.inner.ledger.flush().await
            }
        );
        removed??;
        flushed?;
        Ok(())
    }

    async fn undo_devices(
        &self,
        uid: &ClaimUid,
        devices: &[DeviceRecord],
    ) -> Result<(), ClaimError> {
        if devices.iter().any(|d| matches!(d.sharing, Sharing::Mps(_))) {
            let uid = uid.clone();
            self.blocking(move |i| i.mps.stop(&uid)).await??;
        }
        for d in devices {
            if let (Sharing::TimeSlicing { .. }, None) = (&d.sharing, &d.mig) {
                // Back to the default unless another claim time-slices this GPU.
                let others = self.inner.ledger.read(|c| {
                    c.claims.iter().any(|(u, e)| {
                        u != uid
                            && e.devices.iter().any(|o| {
                                o.gpu == d.gpu
                                    && o.mig.is_none()
                                    && matches!(o.sharing, Sharing::TimeSlicing { .. })
                            })
                    })
                });
                if !others {
                    let gpu = d.gpu.clone();
                    self.blocking(move |i| i.backend.set_time_slice(&gpu, TimeSlice::Default))
                        .await??;
                }
            }
            if let Some(m) = &d.mig
                && m.created
            {
                let mig_uuid = match &m.uuid {
                    Some(u) => Some(u.clone()),
                    // Created but not recorded (crash in between): find it by placement.
                    None => self
                        .snapshot()
                        .await?
                        .gpu_by_uuid(d.gpu.as_str())
                        .and_then(|g| {
                            g.mig
                                .devices
                                .iter()
                                .find(|x| {
                                    x.placement == m.placement && x.gi_profile_id == m.gi_profile_id
                                })
                                .map(|x| x.uuid.clone())
                        }),
                };
                if let Some(mig_uuid) = mig_uuid {
                    let gpu = d.gpu.clone();
                    self.blocking(move |i| i.backend.destroy_mig(&gpu, &mig_uuid))
                        .await??;
                    tracing::info!(claim.uid = %uid, device = %d.device, "MIG device destroyed");
                    self.inventory_changed();
                }
            }
        }
        Ok(())
    }

    async fn unprepare_one(&self, uid: &ClaimUid) -> Result<(), ClaimError> {
        let Some(entry) = self.inner.ledger.read(|c| c.claims.get(uid).cloned()) else {
            // Unknown claims succeed; a stray spec of ours for it goes too.
            if cdi::validate_device_name(uid.as_str()).is_ok() && self.remove_spec(uid)? {
                tracing::warn!(claim.uid = %uid, "removed a CDI spec of a claim not in the checkpoint");
            }
            return Ok(());
        };
        self.rollback(uid, &entry.devices).await?;
        tracing::info!(claim.uid = %uid, claim = %format!("{}/{}", entry.namespace, entry.name), "claim unprepared");
        Ok(())
    }
}

#[cfg(test)]
mod tests;
