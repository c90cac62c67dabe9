//! Keeps the API server's ResourceSlices for this driver exactly equal to the desired pools,
//! without churn (Go's `k8s.io/dynamic-resource-allocation/resourceslice` controller).
//!
//! The driver hands [`Resources`]: pools by name, each a list of [`Slice`]s (devices, shared
//! counters) and the nodes that reach it ([`Nodes`]). The publisher fills in the rest of each
//! ResourceSlice: driver, node (or node selection), pool name, generation, `resourceSliceCount`,
//! a name and the Node as owner.
//!
//! [`Publisher::run`] reconciles: list this publisher's slices (those on its node, and those of
//! its network-attached pools, [`Options::network_pools`]), `plan::plan` the difference (matching
//! by index, generation, owner reference, validation), write it. It reconciles when the desired
//! pools change, when the watch reports a change by anyone (the kubelet wipes slices on restart,
//! admins delete or edit them), and after a failure (exponential backoff with jitter).
//!
//! Invariants:
//! - Nothing is published before the first [`PublisherHandle::set_desired`].
//! - Slice `i` of a pool is named `<i in hex, 5 digits or more>-<driver>-<node>-<random>`, so the
//!   API server lists a pool's slices in the driver's order, and the scheduler, which tries
//!   slices in name order, prefers earlier ones (see the crate README, "Slice order").
//! - The steady state writes nothing: there is no periodic republish, and comparisons are
//!   semantic (see `publisher/plan.rs`). A change to one slice is one update, and keeps the
//!   pool's generation.
//! - Obsolete slices are deleted first, each only if it still has the uid and resourceVersion
//!   the publisher saw.
//! - A pool whose slices break the API server's rules ([`crate::validate`]) is not written: it is
//!   reported once (the error hook, [`InvalidPool`]) and left as it is until the next desired
//!   state; the other pools are published.
//! - Errors never end the task: transient ones back off (base 0.5 s, ×2, cap 30 s, jitter),
//!   conflicts re-read and retry at once (a few times, then back off).
//! - Fields the server drops (a feature gate is off) are logged once each, exposed through
//!   [`PublisherHandle::dropped_fields`], and ignored in later comparisons.

mod plan;

pub use plan::{FieldPath, generate_name};

use crate::api::{self, SliceApi, SliceEvent};
use crate::validate::Violation;
use futures::stream::{BoxStream, StreamExt};
use k8s_openapi::api::core::v1::NodeSelector;
use k8s_openapi::api::resource::v1::{CounterSet, Device, ResourceSlice};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use plan::{Inputs, Plan, Written};
use rand::Rng;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// What the ResourceSlice publisher counts (the publisher bumps them; its handle and
/// `/metrics` read them).
#[derive(Debug, Default)]
pub struct SliceCounters {
    /// Slices created.
    pub creates: AtomicU64,
    /// Slices replaced.
    pub updates: AtomicU64,
    /// Slices deleted.
    pub deletes: AtomicU64,
    /// Reconciles run (lists of the API server's slices), successful or not.
    pub reconciles: AtomicU64,
    /// Conflicts (409) and vanished slices met while writing.
    pub conflicts: AtomicU64,
    /// Failed reconciles, conflicts included.
    pub errors: AtomicU64,
    /// Set by the first complete publish; half of readiness.
    pub published: AtomicBool,
}

/// What a driver publishes: its pools, by name. The scheduler tries pools in name order (see the
/// crate README, "Slice order").
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Resources {
    /// The pools, by name (a DNS subdomain, or several joined by `/`).
    pub pools: BTreeMap<String, Pool>,
}

impl Resources {
    /// One pool named after `node`, reached from that node only: what most node-local drivers
    /// publish.
    pub fn node_local(node: &str, slices: Vec<Slice>) -> Self {
        Self {
            pools: BTreeMap::from([(
                node.to_string(),
                Pool {
                    nodes: Nodes::ThisNode,
                    slices,
                },
            )]),
        }
    }

    /// How many slices all pools have.
    pub fn slice_count(&self) -> usize {
        self.pools.values().map(|p| p.slices.len()).sum()
    }
}

/// The devices of one pool, and where they can be used.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Pool {
    /// The nodes that reach the pool's devices.
    pub nodes: Nodes,
    /// The pool's slices in the driver's order of preference: slice `i` is published under a
    /// name starting with `i`, and the scheduler tries slices in name order, and the devices of
    /// a slice in their order. Drivers should publish at least one slice, even an empty one,
    /// for a pool they serve: an empty pool says "no devices", no pool says nothing.
    pub slices: Vec<Slice>,
}

/// Which nodes can use a pool's devices (the ResourceSlice's node selection).
#[derive(Clone, Debug, Default, PartialEq)]
pub enum Nodes {
    /// The publisher's node (`spec.nodeName`).
    #[default]
    ThisNode,
    /// The nodes matching a selector of exactly one term (`spec.nodeSelector`):
    /// network-attached devices. The pool must be one of [`Options::network_pools`].
    Selector(NodeSelector),
    /// Every node (`spec.allNodes`). The pool must be one of [`Options::network_pools`].
    All,
    /// Each device names its nodes (`nodeName`, `nodeSelector` or `allNodes` on the device;
    /// `spec.perDeviceNodeSelection`). The pool must be one of [`Options::network_pools`].
    PerDevice,
}

/// What one ResourceSlice holds; the publisher fills in the rest.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Slice {
    /// The devices, in the driver's order of preference (at most 128, or 64 when any consumes
    /// counters or has taints).
    pub devices: Vec<Device>,
    /// Counter sets the pool's devices consume from (Kubernetes 1.35+: in a slice without
    /// devices).
    pub shared_counters: Vec<CounterSet>,
}

/// Errors of the publisher's handle.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A network-attached pool this publisher was not set up to publish.
    #[error(
        "pool {pool:?} is network-attached (nodeSelector, allNodes or per-device node \
         selection), but is not one of this publisher's network pools {declared:?}; name it in \
         publisher::Options::network_pools"
    )]
    UndeclaredNetworkPool {
        /// The pool.
        pool: String,
        /// The network pools the publisher was given.
        declared: BTreeSet<String>,
    },
}

/// A pool the publisher will not write because its slices break the API server's rules, reported
/// once per desired state through the error hook ([`crate::ErrorKind::Fatal`]).
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error(
    "pool {pool:?} is not published, its slices break the API's rules: {}; fix the slices the \
     driver hands the publisher",
    describe(violations)
)]
pub struct InvalidPool {
    /// The pool.
    pub pool: String,
    /// What is wrong, each with its slice's index in [`Pool::slices`] (`None`: the pool's).
    pub violations: Vec<(Option<usize>, Violation)>,
}

fn describe(violations: &[(Option<usize>, Violation)]) -> String {
    violations
        .iter()
        .map(|(slice, v)| match slice {
            Some(i) => format!("slice {i}: {v}"),
            None => v.to_string(),
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// The publisher handle's result.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Settings; the default timings suit production, tests shorten them.
#[derive(Clone, Debug)]
pub struct Options {
    /// The node's UID, for the owner reference of the slices; `None`: read from the Node (slices
    /// are published without an owner while it does not exist).
    pub node_uid: Option<String>,
    /// The network-attached pools (those not [`Nodes::ThisNode`]) this publisher owns among the
    /// driver's slices that name no node: it deletes their slices when they are no longer
    /// desired, and never touches other pools' (Go's `ReconcilePoolWithName`, for any number).
    pub network_pools: BTreeSet<String>,
    /// How long to wait after a watch event or a desired change for more to arrive, so a burst
    /// (e.g. the echo of our own writes) costs one reconcile.
    pub settle: Duration,
    /// First retry delay after a failure.
    pub backoff_base: Duration,
    /// Longest retry delay.
    pub backoff_cap: Duration,
    /// Immediate re-reads after conflicts before backing off.
    pub conflict_retries: u32,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            node_uid: None,
            network_pools: BTreeSet::new(),
            settle: Duration::from_millis(100),
            backoff_base: Duration::from_millis(500),
            backoff_cap: Duration::from_secs(30),
            conflict_retries: 5,
        }
    }
}

/// A snapshot of the cumulative counts (the atomics are [`SliceCounters`], which `/metrics`
/// renders).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// Slices created.
    pub creates: u64,
    /// Slices replaced.
    pub updates: u64,
    /// Slices deleted.
    pub deletes: u64,
    /// Reconciles run (lists of the API server's slices), successful or not.
    pub reconciles: u64,
    /// Conflicts (409) and vanished slices met while writing.
    pub conflicts: u64,
    /// Failed reconciles, conflicts included.
    pub errors: u64,
}

impl Counters {
    /// Creates, updates and deletes.
    pub fn writes(&self) -> u64 {
        self.creates + self.updates + self.deletes
    }
}

impl Counters {
    fn of(c: &SliceCounters) -> Counters {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        Counters {
            creates: get(&c.creates),
            updates: get(&c.updates),
            deletes: get(&c.deletes),
            reconciles: get(&c.reconciles),
            conflicts: get(&c.conflicts),
            errors: get(&c.errors),
        }
    }
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// Where publishing stands.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Status {
    /// The sequence number of the desired state most recently published in full (see
    /// [`PublisherHandle::set_desired`]); `None` before the first success.
    pub synced: Option<u64>,
    /// Slices published by that success.
    pub slices: usize,
    /// The last reconcile's error, or why a pool is not published ([`InvalidPool`]); `None`
    /// after a complete success.
    pub last_error: Option<String>,
}

/// The desired pools with their sequence number.
type Desired = Option<(u64, Arc<Resources>)>;

struct Shared {
    counters: Arc<SliceCounters>,
    dropped: watch::Sender<BTreeSet<FieldPath>>,
    status: watch::Sender<Status>,
}

/// Sets what to publish and observes the publisher. Cheap to clone.
#[derive(Clone)]
pub struct PublisherHandle {
    network_pools: Arc<BTreeSet<String>>,
    desired: Arc<watch::Sender<Desired>>,
    shared: Arc<Shared>,
}

impl PublisherHandle {
    /// Replaces the desired pools. Returns the sequence number that [`Status::synced`] reaches
    /// once they are published. Pools that break the API's rules are not refused here: the
    /// publisher reports them ([`InvalidPool`]) and publishes the others.
    pub fn set_desired(&self, resources: Resources) -> Result<u64> {
        for (name, pool) in &resources.pools {
            if pool.nodes != Nodes::ThisNode && !self.network_pools.contains(name) {
                return Err(Error::UndeclaredNetworkPool {
                    pool: name.clone(),
                    declared: (*self.network_pools).clone(),
                });
            }
        }
        let resources = Arc::new(resources);
        let mut seq = 0;
        self.desired.send_modify(|d| {
            seq = d.as_ref().map_or(1, |(n, _)| n + 1);
            *d = Some((seq, resources));
        });
        Ok(seq)
    }

    /// The latest desired pools; `None` before the first [`set_desired`](Self::set_desired).
    pub fn desired(&self) -> Option<Arc<Resources>> {
        self.desired.borrow().as_ref().map(|(_, d)| d.clone())
    }

    /// The sequence number of the latest desired state; `None` before the first
    /// [`set_desired`](Self::set_desired).
    pub fn desired_seq(&self) -> Option<u64> {
        self.desired.borrow().as_ref().map(|(n, _)| *n)
    }

    /// Fields the API server dropped from what we sent (e.g. `spec.sharedCounters`,
    /// `spec.devices[].consumesCounters`, `spec.devices[].taints` when the feature gates
    /// `DRAPartitionableDevices` or `DRADeviceTaints` are off). Grows only. The caller can react by
    /// publishing a plain layout.
    pub fn dropped_fields(&self) -> watch::Receiver<BTreeSet<FieldPath>> {
        self.shared.dropped.subscribe()
    }

    /// The publisher's progress, as it changes.
    pub fn status(&self) -> watch::Receiver<Status> {
        self.shared.status.subscribe()
    }

    /// What the publisher did so far.
    pub fn counters(&self) -> Counters {
        Counters::of(&self.shared.counters)
    }

    /// Waits until the desired state with sequence number `seq` (or a later one) is published.
    pub async fn wait_synced(&self, seq: u64) {
        let mut rx = self.status();
        // The sender lives in `self.shared`, so this never sees a closed channel.
        let _ = rx.wait_for(|s| s.synced >= Some(seq)).await;
    }
}

/// Exponential backoff with jitter (each delay uniformly in [½d, d]).
struct Backoff {
    base: Duration,
    cap: Duration,
    attempt: u32,
}

impl Backoff {
    fn new(base: Duration, cap: Duration) -> Self {
        Self {
            base,
            cap,
            attempt: 0,
        }
    }

    fn next_delay(&mut self) -> Duration {
        let exp = self.base.saturating_mul(1u32 << self.attempt.min(20));
        self.attempt = self.attempt.saturating_add(1);
        let d = exp.min(self.cap);
        d.mul_f64(rand::rng().random_range(0.5..=1.0))
    }

    fn reset(&mut self) {
        self.attempt = 0;
    }
}

/// How a reconcile failed.
enum Failure {
    /// The world changed under us (409, a slice vanished): re-read now.
    Retry(api::Error),
    /// Anything else: back off.
    Backoff(api::Error),
}

impl Failure {
    fn error(&self) -> &api::Error {
        match self {
            Failure::Retry(e) | Failure::Backoff(e) => e,
        }
    }
}

/// The reconciler. Construct with [`Publisher::new`], then spawn [`Publisher::run`].
pub struct Publisher {
    api: Arc<dyn SliceApi>,
    driver: Arc<str>,
    node: Arc<str>,
    opts: Options,
    desired: watch::Receiver<Desired>,
    shared: Arc<Shared>,
    /// Our own writes by slice name: what we sent and the resourceVersion we got.
    written: HashMap<String, Written>,
    /// Fields the server dropped (mirrors `shared.dropped`).
    dropped: BTreeSet<FieldPath>,
    /// The Node as owner, once found.
    owner: Option<OwnerReference>,
    /// Hears failures instead of the log ([`Publisher::on_error`]).
    on_error: Option<crate::error::ErrorHandler>,
    /// The desired state whose invalid pools were reported.
    reported: Option<u64>,
}

impl Publisher {
    /// The publisher of `driver`'s slices on `node`, writing through `api`, with default
    /// timings ([`crate::Options::publisher`] takes both names from the plugin's options).
    pub fn new(
        api: Arc<dyn SliceApi>,
        driver: impl Into<String>,
        node: impl Into<String>,
    ) -> (Publisher, PublisherHandle) {
        Self::with_options(api, driver, node, Options::default())
    }

    /// [`Publisher::new`] with other timings.
    pub fn with_options(
        api: Arc<dyn SliceApi>,
        driver: impl Into<String>,
        node: impl Into<String>,
        opts: Options,
    ) -> (Publisher, PublisherHandle) {
        Self::with_counters(api, driver, node, opts, Arc::default())
    }

    /// Counts into `counters` (the daemon passes the ones `/metrics` renders).
    pub fn with_counters(
        api: Arc<dyn SliceApi>,
        driver: impl Into<String>,
        node: impl Into<String>,
        opts: Options,
        counters: Arc<SliceCounters>,
    ) -> (Publisher, PublisherHandle) {
        let driver: Arc<str> = driver.into().into();
        let node: Arc<str> = node.into().into();
        let (desired_tx, desired_rx) = watch::channel(None);
        let shared = Arc::new(Shared {
            counters,
            dropped: watch::channel(BTreeSet::new()).0,
            status: watch::channel(Status::default()).0,
        });
        let handle = PublisherHandle {
            network_pools: Arc::new(opts.network_pools.clone()),
            desired: Arc::new(desired_tx),
            shared: shared.clone(),
        };
        let publisher = Publisher {
            api,
            driver,
            node,
            opts,
            desired: desired_rx,
            shared: shared.clone(),
            written: HashMap::new(),
            dropped: BTreeSet::new(),
            owner: None,
            on_error: None,
            reported: None,
        };
        (publisher, handle)
    }

    /// Sends the publisher's failures to `hook` instead of the log: a pool that breaks the API's
    /// rules ([`InvalidPool`], reported once per desired state and not retried), a slice the
    /// API server rejects, or a request it refuses (401/403: credentials or RBAC) is
    /// [`ErrorKind::Fatal`](crate::ErrorKind::Fatal) (retrying cannot help), anything else [`Recoverable`](crate::ErrorKind::Recoverable) (retried).
    pub fn on_error(mut self, hook: crate::error::ErrorHandler) -> Self {
        self.on_error = Some(hook);
        self
    }

    /// Tells the hook of a failure, or logs it.
    fn failed(
        on_error: &Option<crate::error::ErrorHandler>,
        e: &api::Error,
        what: &str,
        retry_in: Duration,
    ) {
        match on_error {
            Some(hook) => {
                let kind = match e {
                    api::Error::Invalid(_) | api::Error::Denied(_) => {
                        crate::error::ErrorKind::Fatal
                    }
                    _ => crate::error::ErrorKind::Recoverable,
                };
                hook(kind, e, what);
            }
            None => {
                tracing::warn!(error = %crate::report::chain(e), ?retry_in, "{what}")
            }
        }
    }

    /// Reconciles until `shutdown` is cancelled. Never fails: errors are retried.
    pub async fn run(mut self, shutdown: CancellationToken) {
        let api = self.api.clone();
        let (driver, node) = (self.driver.clone(), self.node.clone());
        let network = !self.opts.network_pools.is_empty();
        // This node's slices, and (for network pools) the driver's slices that name no node.
        let open_watch = || -> BoxStream<'_, api::Result<SliceEvent>> {
            let local = api.watch_slices(&driver, &node);
            if network {
                futures::stream::select(local, api.watch_slices(&driver, "")).boxed()
            } else {
                local
            }
        };
        let mut watch: Option<BoxStream<'_, api::Result<SliceEvent>>> = Some(open_watch());
        let mut watch_retry: Option<Instant> = None;
        let mut watch_backoff = Backoff::new(self.opts.backoff_base, self.opts.backoff_cap);
        let mut backoff = Backoff::new(self.opts.backoff_base, self.opts.backoff_cap);
        // When to reconcile next. A desired change or a watch event brings a backoff forward:
        // they show the API answering again, or give a failing reconcile something new to try.
        let mut due: Option<Instant> = None;
        let mut conflicts_in_a_row = 0;
        let mut desired_open = true;
        tracing::info!(driver = %self.driver, node = %self.node, "resourceslice publisher started");

        loop {
            let has_desired = self.desired.borrow().is_some();
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => break,
                changed = self.desired.changed(), if desired_open => {
                    if changed.is_err() {
                        // Every handle is gone: keep publishing the last desired state.
                        desired_open = false;
                    } else {
                        due = Some(earliest(due, Instant::now() + self.opts.settle));
                    }
                }
                ev = next_event(&mut watch) => match ev {
                    Some(Ok(ev)) => {
                        tracing::debug!(?ev, "resourceslice watch event");
                        watch_backoff.reset();
                        due = Some(earliest(due, Instant::now() + self.opts.settle));
                    }
                    end => {
                        let delay = watch_backoff.next_delay();
                        match end {
                            Some(Err(e)) => Self::failed(&self.on_error, &e, "resourceslice watch failed", delay),
                            _ => tracing::debug!(retry_in = ?delay, "resourceslice watch ended"),
                        }
                        watch = None;
                        watch_retry = Some(Instant::now() + delay);
                    }
                },
                _ = sleep_until(watch_retry) => {
                    watch_retry = None;
                    watch = Some(open_watch());
                }
                _ = sleep_until(due), if has_desired => {
                    due = None;
                    let result = tokio::select! {
                        biased;
                        _ = shutdown.cancelled() => break,
                        r = self.reconcile() => r,
                    };
                    match result {
                        Ok(()) => {
                            backoff.reset();
                            conflicts_in_a_row = 0;
                        }
                        Err(failure) => {
                            bump(&self.shared.counters.errors);
                            let msg = failure.error().to_string();
                            self.shared.status.send_modify(|s| s.last_error = Some(msg));
                            match failure {
                                Failure::Retry(e) if conflicts_in_a_row < self.opts.conflict_retries => {
                                    conflicts_in_a_row += 1;
                                    tracing::info!(error = %crate::report::chain(&e), "resourceslices changed while publishing; re-reading");
                                    due = Some(Instant::now());
                                }
                                Failure::Retry(e) | Failure::Backoff(e) => {
                                    conflicts_in_a_row = 0;
                                    let delay = backoff.next_delay();
                                    Self::failed(&self.on_error, &e, "publishing resourceslices failed", delay);
                                    due = Some(Instant::now() + delay);
                                }
                            }
                        }
                    }
                }
            }
        }
        tracing::info!(driver = %self.driver, node = %self.node, "resourceslice publisher stopped");
    }

    /// One pass: list, plan, write.
    async fn reconcile(&mut self) -> Result<(), Failure> {
        let Some((seq, desired)) = self.desired.borrow_and_update().clone() else {
            return Ok(());
        };
        bump(&self.shared.counters.reconciles);
        let mut existing = self
            .api
            .list_slices(&self.driver, &self.node)
            .await
            .map_err(Failure::Backoff)?;
        if !self.opts.network_pools.is_empty() {
            let network = self
                .api
                .list_slices(&self.driver, "")
                .await
                .map_err(Failure::Backoff)?;
            let ours = |s: &ResourceSlice| self.opts.network_pools.contains(&s.spec.pool.name);
            existing.extend(network.into_iter().filter(ours));
        }
        let names: BTreeSet<String> = existing
            .iter()
            .filter_map(|s| s.metadata.name.clone())
            .collect();
        self.written.retain(|n, _| names.contains(n));
        let owner = self.owner().await.map_err(Failure::Backoff)?;
        let mut plan = plan::plan(&Inputs {
            driver: &self.driver,
            node: &self.node,
            desired: &desired,
            existing: &existing,
            owner: owner.as_ref(),
            written: &self.written,
            dropped: &self.dropped,
        });
        let invalid = std::mem::take(&mut plan.invalid);
        if self.reported != Some(seq) {
            self.reported = Some(seq);
            for bad in &invalid {
                self.report_invalid(bad);
            }
        }
        if plan.is_empty() {
            tracing::debug!(pools = desired.pools.len(), "resourceslices up to date");
        } else {
            self.execute(plan).await?;
        }
        if !invalid.is_empty() {
            let msg = invalid
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("; ");
            self.shared.status.send_modify(|s| s.last_error = Some(msg));
            return Ok(());
        }
        let slices = desired.slice_count();
        self.shared.status.send_replace(Status {
            synced: Some(seq),
            slices,
            last_error: None,
        });
        if !self.shared.counters.published.swap(true, Ordering::Relaxed) {
            tracing::info!(slices, "ResourceSlices published");
        }
        Ok(())
    }

    /// Tells the hook of a pool left unpublished, or logs it.
    fn report_invalid(&self, bad: &InvalidPool) {
        let what = "resourceslices not published";
        match &self.on_error {
            Some(hook) => hook(crate::error::ErrorKind::Fatal, bad, what),
            None => tracing::error!(error = %bad, "{what}"),
        }
    }

    async fn execute(&mut self, plan: Plan) -> Result<(), Failure> {
        let generation = plan
            .updates
            .iter()
            .chain(&plan.creates)
            .map(|s| s.spec.pool.generation)
            .max();
        let (u, c, d) = (plan.updates.len(), plan.creates.len(), plan.deletes.len());
        // Deletes first: devices the driver no longer has go even if the new slices fail.
        for obsolete in plan.deletes {
            match self
                .api
                .delete_slice(&obsolete.name, &obsolete.preconditions)
                .await
            {
                Ok(()) => bump(&self.shared.counters.deletes),
                Err(api::Error::NotFound(_)) => {}
                Err(e @ api::Error::Conflict(_)) => {
                    // Someone changed it since the list: decide again on what is there now.
                    bump(&self.shared.counters.conflicts);
                    return Err(Failure::Retry(e));
                }
                Err(e) => return Err(Failure::Backoff(e)),
            }
            self.written.remove(&obsolete.name);
        }
        for slice in plan.updates {
            match self.api.replace_slice(&slice).await {
                Ok(got) => {
                    bump(&self.shared.counters.updates);
                    self.record(&slice, &got);
                }
                Err(e @ (api::Error::Conflict(_) | api::Error::NotFound(_))) => {
                    bump(&self.shared.counters.conflicts);
                    return Err(Failure::Retry(e));
                }
                Err(e) => return Err(Failure::Backoff(e)),
            }
        }
        for slice in plan.creates {
            match self.api.create_slice(&slice).await {
                Ok(got) => {
                    bump(&self.shared.counters.creates);
                    self.record(&slice, &got);
                }
                Err(e @ api::Error::Conflict(_)) => {
                    bump(&self.shared.counters.conflicts);
                    return Err(Failure::Retry(e));
                }
                Err(e) => return Err(Failure::Backoff(e)),
            }
        }
        tracing::info!(
            deletes = d,
            updates = u,
            creates = c,
            generation = ?generation,
            "published resourceslices"
        );
        Ok(())
    }

    /// Remembers a write and checks what the server kept of it.
    fn record(&mut self, sent: &ResourceSlice, got: &ResourceSlice) {
        let sent_json = plan::normalized_spec(&sent.spec);
        let name = got.metadata.name.clone().unwrap_or_default();
        let dropped = plan::dropped_fields(&sent_json, &plan::normalized_spec(&got.spec));
        let new: Vec<FieldPath> = dropped
            .into_iter()
            .filter(|p| !self.dropped.contains(p))
            .collect();
        for path in &new {
            tracing::warn!(
                field = %path,
                slice = %name,
                "the API server dropped a field of a published resourceslice; the feature gate \
                 for it (DRAPartitionableDevices, DRADeviceTaints, DRAConsumableCapacity, ...) is \
                 probably off in this cluster"
            );
        }
        if !new.is_empty() {
            self.dropped.extend(new);
            let all = self.dropped.clone();
            self.shared.dropped.send_replace(all);
        }
        if let Some(rv) = got.metadata.resource_version.clone() {
            self.written.insert(
                name,
                Written {
                    resource_version: rv,
                    sent: sent_json,
                },
            );
        }
    }

    /// The controller reference to our Node (by [`Options::node_uid`], else read once); `None`
    /// while the Node does not exist.
    async fn owner(&mut self) -> api::Result<Option<OwnerReference>> {
        if self.owner.is_none() {
            let uid = match &self.opts.node_uid {
                Some(uid) => Some(uid.clone()),
                None => match self.api.get_node(&self.node).await {
                    Ok(node) => node.metadata.uid,
                    Err(api::Error::NotFound(_)) => None,
                    Err(e) => return Err(e),
                },
            };
            self.owner = uid.map(|uid| OwnerReference {
                api_version: "v1".into(),
                kind: "Node".into(),
                name: self.node.to_string(),
                uid,
                controller: Some(true),
                block_owner_deletion: None,
            });
        }
        Ok(self.owner.clone())
    }
}

fn earliest(a: Option<Instant>, b: Instant) -> Instant {
    a.map_or(b, |a| a.min(b))
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

async fn next_event(
    watch: &mut Option<BoxStream<'_, api::Result<SliceEvent>>>,
) -> Option<api::Result<SliceEvent>> {
    match watch {
        Some(w) => w.next().await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests;
