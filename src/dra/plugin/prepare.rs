//! A prepare, in order, from the kubelet's batch to its answer: the library's call
//! ([`Driver::prepare`]) first, then the steps it calls, in this file in the same order;
//! unprepare, which shares the batch, at the end.
//!
//! **The batch.** The claims' UIDs are parsed here, once: a claim whose UID is not one gets its
//! error (prepare) or its success (unprepare: it cannot have been prepared) without reaching the
//! plugin. The batch takes the node lock (which reloads the checkpoint a rolling update's other
//! instance may have changed) and the node's inventory as the owner published it, then runs each
//! claim under its own lock, different claims concurrently, each with an entry of its own
//! whatever happens to the others.
//!
//! **One claim's prepare:**
//!
//! 1. **Already prepared?** A completed claim is answered from the checkpoint (its CDI spec
//!    rewritten if damaged); a started one, a prepare that could not roll back, is rolled back
//!    before starting over.
//! 2. **Read** the claim (the library read and checked it, and picked this driver's results)
//!    and the node's inventory.
//! 3. **Plan and check**: the device records to reserve ([`plan`](super::plan)); for a claim
//!    with shares, the checks that need no lock (a share for one pod, the user its pod runs as
//!    and its namespace's trust label, read from the API, its daemon up).
//! 4. **Record**: reserve the devices in the ledger, atomically with the check that no other
//!    claim or container holds them ([`crate::holds`]) and that shares fit beside the GPU's
//!    other shares (user, trust domain, memory, count).
//! 5. **Effects and spec**, on the path the claim needs:
//!    - a claim that changes GPU state (creates a MIG instance, starts an MPS daemon, sets a
//!      time slice, switches MIG mode) records `PrepareStarted` durably first, so that a crash
//!      can be undone at start-up; then reconfigures ([effects](super::effects)), writes its CDI
//!      spec ([specs](super::specs)) and records `PrepareCompleted`;
//!    - a claim that changes nothing on the GPU is recorded `PrepareCompleted` at once, and its
//!      CDI spec and that record are written in parallel: one durable write on the critical
//!      path. Shares of a GPU take this path too: their GPU's MPS daemon usually runs already;
//!      where it does not, the completed record is made durable before the daemon starts, so a
//!      crash leaves a recorded share whose daemon and spec start-up brings back.
//!      Whichever half a crash leaves, start-up repairs: a spec without an entry is removed, a
//!      completed entry without a spec gets its spec rewritten.
//! 6. **Answer**: the device records, which the kubelet gets as CDI device IDs; the claim's
//!    `status.devices` entries are written on their own task ([`status`](super::status)).
//!
//! Any failure after step 4 rolls back what was done.
//!
//! **The answer.** Each claim's device records as the kubelet is told them, with the metadata
//! its container reads (KEP-5304), read from the node once per batch. Device records are
//! destructured exhaustively, so a new field must be decided on here.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Instant;

use futures::FutureExt;
use futures::future::{BoxFuture, Shared};
use kubelet_plugin::metadata::DeviceMetadata;
use kubelet_plugin::{
    BoxError, Claim, Driver, PrepareClaim, PrepareResults, PreparedDevice, UnprepareResults,
};

use super::effects::Partial;
use super::plan::{self, Plan};
use super::{ClaimError, ClaimRef, Plugin, crash_point, mig_mode};
use crate::holds::claims_holding;
use crate::ids::ClaimUid;
use crate::inventory::owner::Writes;
use crate::inventory::{DeviceUuid, GpuUuid, Inventory, quantity};
use crate::ledger::{self, ClaimEntry, ClaimState, DeviceRecord, PodRef, ShareUser};
// The claim-lock map sees inserts and removes only, so ignoring poison is sound.
use crate::lock::lock;
use crate::metrics::Histogram;
use crate::report::chain;

impl Driver for Plugin {
    async fn prepare(&self, claims: Vec<PrepareClaim>) -> Result<PrepareResults, BoxError> {
        let read = claims.into_iter().map(|c| (c.claim.clone(), Some(c)));
        let Claims::<Option<PrepareClaim>> { valid, rejected } = read.collect();
        let results = Plugin::prepare_claims(self, valid).await;
        // Once per batch, after its prepares (a MIG device one of them created and this read
        // does not see yet is described from its record).
        let inv = if results.iter().any(|(_, r)| r.is_ok()) {
            self.metadata_inventory().await
        } else {
            None
        };
        let results = results.into_iter().map(|(uid, r)| {
            let devices = r
                .map(|records| {
                    let prepared = |d| prepared(d, inv.as_deref());
                    records.into_iter().map(prepared).collect()
                })
                .map_err(BoxError::from);
            (String::from(uid), devices)
        });
        Ok(rejected
            .into_iter()
            .map(|(uid, e)| (uid, Err(e.into())))
            .chain(results)
            .collect())
    }

    async fn unprepare(&self, claims: Vec<Claim>) -> Result<UnprepareResults, BoxError> {
        let Claims::<()> { valid, rejected } = claims.into_iter().map(|c| (c, ())).collect();
        let valid = valid.into_iter().map(|(c, ())| c).collect();
        let results = Plugin::unprepare(self, valid).await;
        // With an invalid UID, a claim was never prepared, and unprepare of an unknown claim
        // succeeds.
        Ok(rejected
            .into_iter()
            .map(|(uid, _)| (uid, Ok(())))
            .chain(
                results
                    .into_iter()
                    .map(|(uid, r)| (String::from(uid), r.map_err(BoxError::from))),
            )
            .collect())
    }
}

/// The claims of a request: those the plugin works on (with what was read of each), and those
/// whose UID is invalid, under the UID the kubelet sent.
#[derive(Debug)]
struct Claims<T> {
    valid: Vec<(ClaimRef, T)>,
    rejected: Vec<(String, ClaimError)>,
}

impl<T> Default for Claims<T> {
    fn default() -> Self {
        Self {
            valid: Vec::new(),
            rejected: Vec::new(),
        }
    }
}

impl<T> FromIterator<(Claim, T)> for Claims<T> {
    fn from_iter<I: IntoIterator<Item = (Claim, T)>>(iter: I) -> Self {
        let mut claims = Claims::default();
        for (claim, read) in iter {
            let Claim {
                namespace,
                name,
                uid,
                ..
            } = claim;
            match ClaimUid::parse(uid.as_str()) {
                Ok(uid) => claims.valid.push((
                    ClaimRef {
                        namespace,
                        name,
                        uid,
                    },
                    read,
                )),
                Err(source) => claims
                    .rejected
                    .push((uid.clone(), ClaimError::BadUid { uid, source })),
            }
        }
        claims
    }
}

/// A batch's inventory snapshot, taken as the batch starts (under the node lock): the owner's
/// publication (no copy, no thread), or the read that follows this plugin's last
/// reconfiguration, awaited by each claim only when it needs it, so a claim's own GET goes out
/// meanwhile instead of after it.
#[derive(Clone)]
pub(super) struct PendingInventory(
    Shared<BoxFuture<'static, Result<Arc<Inventory>, Arc<ClaimError>>>>,
);

impl PendingInventory {
    fn start(gpus: Writes) -> Self {
        let node = async move { gpus.node().await.map_err(|e| Arc::new(ClaimError::from(e))) };
        Self(node.boxed().shared())
    }

    /// The snapshot; its failure fails every claim of the batch alike.
    pub(super) async fn get(&self) -> Result<Arc<Inventory>, ClaimError> {
        self.0.clone().await.map_err(ClaimError::Unavailable)
    }
}

impl Plugin {
    /// Prepares a batch, reading each claim from the API; one result per claim, in order.
    pub async fn prepare(
        &self,
        claims: Vec<ClaimRef>,
    ) -> Vec<(ClaimUid, Result<Vec<DeviceRecord>, ClaimError>)> {
        self.prepare_claims(claims.into_iter().map(|c| (c, None)).collect())
            .await
    }

    /// Prepares a batch; a claim the kubelet-plugin library did not read (and check, and pick
    /// its results for this driver) is read from the API.
    pub(crate) async fn prepare_claims(
        &self,
        claims: Vec<(ClaimRef, Option<PrepareClaim>)>,
    ) -> Vec<(ClaimUid, Result<Vec<DeviceRecord>, ClaimError>)> {
        // One snapshot per batch: MIG devices created by this batch are tracked in the ledger,
        // which is what conflict checks read.
        let gpus = self.inner.gpus.clone();
        let setup = async move { Ok(PendingInventory::start(gpus)) };
        let m = &self.inner.metrics;
        let outcome = (&m.prepare_ok, &m.prepare_failed, &m.prepare_seconds);
        self.batch(claims, "prepare", outcome, setup, |c, rc, inv| async move {
            self.prepare_one(&c, rc, &inv).await
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
            claims.into_iter().map(|c| (c, ())).collect(),
            "unprepare",
            outcome,
            async { Ok(()) },
            |c, (), ()| async move { self.unprepare_one(&c.uid).await },
        )
        .await
    }

    /// Runs `op` for each claim of a batch: under the node lock, each claim under its own lock,
    /// different claims concurrently, after `setup` (whose value every claim gets). When the
    /// batch cannot start (lock, setup), every claim fails with that reason, so the kubelet still
    /// gets an entry per claim. Counts outcomes and the batch's duration.
    async fn batch<X, S, T, Setup, Op, Fut>(
        &self,
        claims: Vec<(ClaimRef, X)>,
        what: &'static str,
        (ok, failed, seconds): (&AtomicU64, &AtomicU64, &Histogram),
        setup: Setup,
        op: Op,
    ) -> Vec<(ClaimUid, Result<T, ClaimError>)>
    where
        S: Clone,
        Setup: Future<Output = Result<S, ClaimError>>,
        Op: Fn(ClaimRef, X, S) -> Fut,
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
                let cause = std::sync::Arc::new(e);
                claims
                    .into_iter()
                    .map(|(c, _)| (c.uid, Err(ClaimError::Unavailable(cause.clone()))))
                    .collect()
            }
            Ok((_guard, shared)) => {
                let futs = claims.into_iter().map(|(c, x)| {
                    let (shared, op) = (shared.clone(), &op);
                    async move {
                        let uid = c.uid.clone();
                        let who = format!("{}/{}", c.namespace, c.name);
                        let l = self.claim_lock(&uid);
                        let r = {
                            let _held = l.lock().await;
                            op(c, x, shared).await
                        };
                        self.release_claim_lock(&uid, l);
                        if let Err(e) = &r {
                            tracing::warn!(claim.uid = %uid, claim = %who, error = %crate::report::chain(e), "{what} failed");
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
}

impl Plugin {
    /// Prepares `claim`; `read` is the claim as the library read and checked it, when it did.
    pub(super) async fn prepare_one(
        &self,
        claim: &ClaimRef,
        read: Option<PrepareClaim>,
        inv: &PendingInventory,
    ) -> Result<Vec<DeviceRecord>, ClaimError> {
        if let Some(devices) = self.already_prepared(claim, read.as_ref(), inv).await? {
            // (The inventory was read for the check above: no wait.)
            self.report_prepared(claim, &devices, inv.get().await.ok());
            return Ok(devices);
        }
        let (read, inv) = self.read_claim_and_node(claim, read, inv).await?;
        let plan = self.plan_and_check(claim, &read, &inv).await?;
        let devices = if plan.touches_hardware() {
            self.prepare_reconfiguring(claim, plan, &inv).await?
        } else {
            self.prepare_without_hardware(claim, plan, &inv).await?
        };
        crash_point!(self, AfterCompleted);
        tracing::info!(claim.uid = %claim.uid, devices = devices.len(), "claim prepared");
        self.report_prepared(claim, &devices, Some(inv));
        Ok(devices)
    }

    /// Step 1: the devices of a claim the checkpoint holds completed; `None` for one to prepare.
    async fn already_prepared(
        &self,
        claim: &ClaimRef,
        read: Option<&PrepareClaim>,
        inv: &PendingInventory,
    ) -> Result<Option<Vec<DeviceRecord>>, ClaimError> {
        let uid = &claim.uid;
        let Some(entry) = self.inner.ledger.read(|c| c.claims.get(uid).cloned()) else {
            return Ok(None);
        };
        if entry.state != ClaimState::PrepareCompleted {
            self.rollback(uid, &entry.devices).await?;
            return Ok(None);
        }
        // A pod that joins a prepared share claim is checked as the first was: the share's
        // limit applies per CUDA process, so a second pod would double it.
        if entry.devices.iter().any(|d| d.consumed.is_some()) {
            let pods = match read {
                Some(read) => plan::reserved_pods(&read.resource_claim),
                None => plan::reserved_pods(&self.read_claim(claim).await?.resource_claim),
            };
            one_pod_per_share(claim, &entry.devices, &pods)?;
        }
        let inv = inv.get().await?;
        if !entry.devices.is_empty() && self.ensure_cdi(uid, &entry.devices, &inv).await? {
            tracing::info!(claim.uid = %uid, "CDI spec was missing or damaged; rewritten");
        }
        tracing::debug!(claim.uid = %uid, "already prepared");
        Ok(Some(entry.devices))
    }

    /// Step 2: the claim (read here unless the library did) and the batch's inventory. Dynamic
    /// MIG: a change left pending on a GPU nvdra switches (a switch past its deadline that
    /// returned since, a crash) would make the GPU refuse every switch: withdrawn first.
    async fn read_claim_and_node(
        &self,
        claim: &ClaimRef,
        read: Option<PrepareClaim>,
        inv: &PendingInventory,
    ) -> Result<(PrepareClaim, Arc<Inventory>), ClaimError> {
        let read = async {
            match read {
                Some(read) => Ok(read),
                None => self.read_claim(claim).await,
            }
        };
        let (read, inv) = tokio::join!(read, inv.get());
        let (mut inv, read) = (inv?, read?);
        let dynamic = self.inner.opts.dynamic_mig;
        if dynamic && inv.gpus.iter().any(|g| mig_mode::withdrawable(dynamic, g)) {
            self.withdraw_pending(&inv).await;
            inv = self.snapshot().await?;
        }
        Ok((read, inv))
    }

    /// Reads `claim` and checks it as the library does for the claims it hands over
    /// ([`kubelet_plugin::claims::fetch`]), so that a claim is checked, and its results for this
    /// driver picked, in one place whichever way it came.
    async fn read_claim(&self, claim: &ClaimRef) -> Result<PrepareClaim, ClaimError> {
        let named = kubelet_plugin::Claim::new(&claim.namespace, &claim.name, claim.uid.as_str());
        Ok(kubelet_plugin::claims::fetch(&*self.inner.api, named, self.driver()).await?)
    }

    /// Step 3: the claim's [`Plan`]; a share's checks and what it needs from the API.
    async fn plan_and_check(
        &self,
        claim: &ClaimRef,
        read: &PrepareClaim,
        inv: &Inventory,
    ) -> Result<Plan, ClaimError> {
        let opts = &self.inner.opts;
        let plan = plan::plan(opts, self.inner.specs.options(), claim, read, inv)?;
        if !plan.has_shares() {
            return Ok(plan);
        }
        one_pod_per_share(claim, &plan.devices, &plan.pods)?;
        // Whether its GPU serves every UID: for the check of its user and its daemon's request.
        self.inner.mps.know_gpus(inv);
        let plan = self.share_user(claim, plan, inv).await?;
        let plan = self.share_trust_label(claim, plan).await?;
        self.refuse_while_daemon_down(&plan.devices)?;
        Ok(plan)
    }

    /// Sets the plan's user when it holds a share of a GPU whose MPS serves one user at a time:
    /// the user its pod runs as, read from the pod (the kubelet's call names none).
    async fn share_user(
        &self,
        claim: &ClaimRef,
        mut plan: Plan,
        inv: &Inventory,
    ) -> Result<Plan, ClaimError> {
        let Some(share) = plan.devices.iter().find(|d| {
            let gpu = inv.gpu_by_uuid(d.gpu.as_str());
            d.consumed.is_some() && gpu.is_some_and(|g| !self.inner.mps.multi_user(g))
        }) else {
            return Ok(plan);
        };
        let unknown = |reason: String| ClaimError::ShareUserUnknown {
            namespace: claim.namespace.clone(),
            name: claim.name.clone(),
            device: share.device.to_string(),
            reason,
        };
        let pod = plan
            .pods
            .first()
            .ok_or_else(|| unknown("the claim is reserved for no pod".into()))?;
        let what = format!("pod {}/{}", claim.namespace, pod.name);
        let read = api_read(&what, self.inner.api.get_pod(&claim.namespace, &pod.name))
            .await
            .map_err(unknown)?;
        if read.metadata.uid.as_deref() != Some(pod.uid.as_str()) {
            return Err(unknown(format!(
                "pod {}/{} is not the one the claim is reserved for (UID {}, reserved for {})",
                claim.namespace,
                pod.name,
                read.metadata.uid.as_deref().unwrap_or("none"),
                pod.uid
            )));
        }
        let user = pod_user(&read).map_err(unknown)?;
        plan.user = Some(user);
        Ok(plan)
    }

    /// Sets the plan's trust label when it holds a share and `--share-trust-domain` is
    /// `label:<key>`: the value of `<key>` on the claim's Namespace, read through the API (one
    /// GET, only for such shares). A namespace that cannot be read refuses the share: admitting
    /// it blind would let it join a GPU of any domain.
    async fn share_trust_label(
        &self,
        claim: &ClaimRef,
        mut plan: Plan,
    ) -> Result<Plan, ClaimError> {
        let rule = &self.inner.opts.share_trust_domain;
        let Some(key) = rule.label_key() else {
            return Ok(plan);
        };
        let Some(share) = plan.devices.iter().find(|d| is_share(d)) else {
            return Ok(plan);
        };
        let what = format!("namespace {}", claim.namespace);
        let read = api_read(&what, self.inner.api.get_namespace(&claim.namespace))
            .await
            .map_err(|reason| ClaimError::ShareDomainUnknown {
                namespace: claim.namespace.clone(),
                name: claim.name.clone(),
                device: share.device.to_string(),
                rule: rule.to_string(),
                reason,
            })?;
        plan.trust_label = read
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(key))
            .map(|value| crate::sharing::trust::TrustLabel {
                key: key.to_string(),
                value: value.clone(),
            });
        Ok(plan)
    }
}

/// Refuses a claim with a GPU share that is reserved for more than one pod. The share's memory
/// limit (`CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`) is applied per CUDA process, so every pod of the
/// claim would get the whole limit: together more than the scheduler counted for the claim.
/// Checked where the kubelet prepares the claim (its first pod); a pod that joins an already
/// prepared claim is checked when it is found already prepared.
fn one_pod_per_share(
    claim: &ClaimRef,
    devices: &[DeviceRecord],
    pods: &[PodRef],
) -> Result<(), ClaimError> {
    match devices.iter().find(|d| d.consumed.is_some()) {
        Some(share) if pods.len() > 1 => Err(ClaimError::ShareForManyPods {
            namespace: claim.namespace.clone(),
            name: claim.name.clone(),
            device: share.device.to_string(),
            pods: pods
                .iter()
                .map(|p| p.name.as_str())
                .collect::<Vec<_>>()
                .join(", "),
        }),
        _ => Ok(()),
    }
}

/// The user `pod` runs as: its containers' `runAsUser`, each falling back to the pod's. One
/// user, or an error naming the containers of each when they differ (MPS would serve one and
/// make the others wait).
pub(super) fn pod_user(pod: &k8s_openapi::api::core::v1::Pod) -> Result<ShareUser, String> {
    let spec = pod.spec.as_ref().ok_or("the pod has no spec")?;
    let pod_level = spec.security_context.as_ref().and_then(|s| s.run_as_user);
    let mut users: BTreeMap<Option<i64>, Vec<&str>> = BTreeMap::new();
    for c in spec
        .init_containers
        .iter()
        .flatten()
        .chain(spec.containers.iter())
    {
        let user = c
            .security_context
            .as_ref()
            .and_then(|s| s.run_as_user)
            .or(pod_level);
        users.entry(user).or_default().push(c.name.as_str());
    }
    let as_share_user = |u: Option<i64>| u.map_or(ShareUser::ImageDefault, ShareUser::Uid);
    match users.len() {
        0 => Ok(as_share_user(pod_level)),
        1 => Ok(as_share_user(*users.keys().next().unwrap_or(&None))),
        _ => Err(format!(
            "its containers run as different users ({})",
            users
                .iter()
                .map(|(u, names)| format!("{}: {}", as_share_user(*u), names.join(", ")))
                .collect::<Vec<_>>()
                .join("; ")
        )),
    }
}

/// How long a prepare waits for one API read of its own (a pod, a namespace): as long as the
/// claim's read waits ([`kubelet_plugin::claims::READ_DEADLINE`], inside the kubelet-plugin
/// library's `fetch`), well inside the kubelet's 45 s. A prepare runs in the node's one turn, so
/// a read that never ends would hold every later prepare; per call rather than as the kube
/// client's `read_timeout`, which would also cut the slice and DeviceClass watches.
pub(super) const API_READ_DEADLINE: std::time::Duration = kubelet_plugin::claims::READ_DEADLINE;

/// Reads `what` through `read`, given up after [`API_READ_DEADLINE`]; the error names `what`.
async fn api_read<T>(
    what: &str,
    read: impl Future<Output = crate::api::Result<T>>,
) -> Result<T, String> {
    match tokio::time::timeout(API_READ_DEADLINE, read).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(format!("reading {what}: {e}")),
        Err(_) => Err(format!(
            "the API server did not answer the read of {what} within {API_READ_DEADLINE:?}; the \
             kubelet retries the prepare"
        )),
    }
}

impl Plugin {
    /// Records the claim in memory, atomically with the check that no other claim, and no
    /// container of the device-plugin path (`--mode both`), holds its devices.
    /// Shares of a GPU must fit beside the shares other claims hold of it.
    fn reserve(
        &self,
        claim: &ClaimRef,
        plan: &Plan,
        state: ClaimState,
        inv: &Inventory,
    ) -> Result<(), ClaimError> {
        self.inner.ledger.update_with_holds(|claims, holds| {
            conflict(claims, &claim.uid, &plan.devices)?;
            if plan.has_shares() {
                one_domain_per_gpu(&self.inner.opts.share_trust_domain, claims, claim, plan)?;
                fits(claims, &claim.uid, &plan.devices, inv)?;
                one_user_per_gpu(claims, &claim.uid, plan)?;
            }
            for d in &plan.devices {
                if let Some(h) = holds.holder_of(d) {
                    return Err(ClaimError::HeldByContainer {
                        device: d.device.to_string(),
                        held: h.held,
                        holder: h.holder,
                    });
                }
            }
            claims.insert(
                claim.uid.clone(),
                ClaimEntry {
                    state,
                    namespace: claim.namespace.clone(),
                    name: claim.name.clone(),
                    devices: plan.devices.clone(),
                    pods: plan.pods.clone(),
                    user: plan.user,
                    trust_label: plan.trust_label.clone(),
                },
            );
            Ok(())
        })
    }
}

/// The first of `devices` that another claim in `claims` holds, as that claim's error: a share
/// meeting a claim that holds its GPU whole, a whole GPU or a MIG placement meeting shares of
/// it, or a device in use.
pub(super) fn conflict(
    claims: &BTreeMap<ClaimUid, ClaimEntry>,
    uid: &ClaimUid,
    devices: &[DeviceRecord],
) -> Result<(), ClaimError> {
    let held = devices.iter().find_map(|d| {
        let (u, e) = claims_holding(claims, Some(uid), |o| d.conflicts_with(o)).next()?;
        Some((d, u, e))
    });
    let Some((d, other_uid, other)) = held else {
        return Ok(());
    };
    if d.consumed.is_some() {
        return Err(ClaimError::ShareOnWholeGpu {
            device: d.device.to_string(),
            namespace: other.namespace.clone(),
            name: other.name.clone(),
            uid: other_uid.clone(),
        });
    }
    let share_of_gpu =
        |o: &DeviceRecord| o.consumed.is_some() && o.share_target() == d.share_target();
    // A whole GPU (dynamic MIG) meeting MIG devices of it: name every claim that holds one.
    let mig_of_gpu = |o: &DeviceRecord| o.gpu == d.gpu && o.mig.is_some();
    if d.mig.is_none() && other.devices.iter().any(mig_of_gpu) {
        let holders: Vec<String> = claims_holding(claims, Some(uid), mig_of_gpu)
            .map(|(u, e)| {
                let migs: Vec<&str> = e
                    .devices
                    .iter()
                    .filter(|o| mig_of_gpu(o))
                    .map(|o| o.device.as_str())
                    .collect();
                format!(
                    "{} by claim {}/{} ({u})",
                    migs.join(", "),
                    e.namespace,
                    e.name
                )
            })
            .collect();
        return Err(ClaimError::WholeGpuOnMig {
            device: d.device.to_string(),
            holders: holders.join("; "),
        });
    }
    if other.devices.iter().any(share_of_gpu) {
        let holders = claims_named(claims_holding(claims, Some(uid), share_of_gpu));
        // A MIG placement to be created on a GPU that shares hold is no whole-GPU claim: its
        // own words. (An existing MIG device allocated whole beside shares of it is whole.)
        return Err(match (&d.mig, d.share_target()) {
            (Some(_), DeviceUuid::Gpu(_)) => ClaimError::MigOnShares {
                device: d.device.to_string(),
                gpu: d.gpu.to_string(),
                holders,
            },
            _ => ClaimError::WholeGpuOnShares {
                device: d.device.to_string(),
                holders,
            },
        });
    }
    Err(ClaimError::DeviceInUse {
        device: d.device.to_string(),
        namespace: other.namespace.clone(),
        name: other.name.clone(),
        uid: other_uid.clone(),
    })
}

/// The first share of `devices` that does not fit on its GPU beside the other shares of it (by
/// memory, or beyond the clients MPS serves), as that claim's error naming the GPU, what is held
/// and by whom.
pub(super) fn fits(
    claims: &BTreeMap<ClaimUid, ClaimEntry>,
    uid: &ClaimUid,
    devices: &[DeviceRecord],
    inv: &Inventory,
) -> Result<(), ClaimError> {
    let memory_of = |d: &DeviceUuid| inv.memory_of(d).map(ledger::shares::shareable_memory);
    let name = |d: &DeviceUuid| match d {
        DeviceUuid::Gpu(gpu) => inv
            .gpu_by_uuid(gpu.as_str())
            .map(|g| format!("gpu-{} ({gpu})", g.minor))
            .unwrap_or_else(|| gpu.to_string()),
        DeviceUuid::Mig(mig) => inv
            .mig_by_uuid(mig)
            .map(|(g, m)| {
                let name = crate::ids::DeviceName::mig(
                    g.minor,
                    &m.profile,
                    m.gi_profile_id,
                    m.placement.start,
                );
                format!("{name} ({mig})")
            })
            .unwrap_or_else(|| mig.to_string()),
    };
    if let Some((gpu, shares)) = ledger::shares::too_many_shares(claims, uid, devices) {
        return Err(ClaimError::TooManyShares {
            gpu: name(&gpu),
            shares,
            max: ledger::shares::MAX_SHARES,
        });
    }
    match ledger::shares::overcommitted(claims, uid, devices, memory_of) {
        Some(o) => Err(ClaimError::OverCapacity {
            gpu: name(&o.gpu),
            wanted: quantity(o.wanted),
            total: quantity(o.total),
            held: quantity(o.held),
            holders: if o.holders.is_empty() {
                "no other share".into()
            } else {
                o.holders.join("; ")
            },
        }),
        None => Ok(()),
    }
}

/// Refuses a share of a single-user GPU (its MPS serves one user at a time:
/// [`crate::dra::mps::Mps::multi_user`]) whose pod runs as another user than the GPU's other shares, naming both users and the claims.
pub(super) fn one_user_per_gpu(
    claims: &BTreeMap<ClaimUid, ClaimEntry>,
    uid: &ClaimUid,
    plan: &Plan,
) -> Result<(), ClaimError> {
    let Some(user) = plan.user else {
        return Ok(());
    };
    for d in plan.devices.iter().filter(|d| d.consumed.is_some()) {
        let shares_gpu =
            |o: &DeviceRecord| o.consumed.is_some() && o.share_target() == d.share_target();
        let others = || claims_holding(claims, Some(uid), shares_gpu);
        // The GPU's shares all run as one user (this check held for each), so the first
        // other user found is theirs.
        let Some(holder_user) = others().find_map(|(_, e)| e.user.filter(|u| *u != user)) else {
            continue;
        };
        let holders = others().filter(|(_, e)| e.user == Some(holder_user));
        return Err(ClaimError::ShareOfAnotherUser {
            device: d.device.to_string(),
            user,
            holder_user,
            holders: claims_named(holders),
        });
    }
    Ok(())
}

/// Refuses a share whose claim is of another trust domain ([`crate::sharing::trust`]) than a
/// claim that holds a share of the same GPU (MIG device), naming that holder, its domain and the
/// rule. Every holder is compared, not the first: under `label:<key>` a GPU's holders of one
/// namespace may have been admitted with different values. Runs under the ledger's lock, so
/// two prepares of different domains cannot both pass against an empty GPU.
pub(super) fn one_domain_per_gpu(
    rule: &crate::sharing::trust::TrustDomain,
    claims: &BTreeMap<ClaimUid, ClaimEntry>,
    claim: &ClaimRef,
    plan: &Plan,
) -> Result<(), ClaimError> {
    use crate::sharing::trust::Member;
    if !rule.enabled() {
        return Ok(());
    }
    let me = Member {
        namespace: &claim.namespace,
        label: plan.trust_label.as_ref(),
    };
    for d in plan.devices.iter().filter(|d| is_share(d)) {
        let target = d.share_target();
        let holders = claims_holding(claims, Some(&claim.uid), |o| {
            is_share(o) && o.share_target() == target
        });
        for (uid, e) in holders {
            let them = Member {
                namespace: &e.namespace,
                label: e.trust_label.as_ref(),
            };
            if !rule.admits(me, them) {
                return Err(ClaimError::ShareOfAnotherDomain {
                    device: d.device.to_string(),
                    claim: format!(
                        "{}/{} of {}",
                        claim.namespace,
                        claim.name,
                        rule.describe(me)
                    ),
                    holder: format!(
                        "{}/{} ({uid}) of {}",
                        e.namespace,
                        e.name,
                        rule.describe(them)
                    ),
                    rule: rule.to_string(),
                });
            }
        }
    }
    Ok(())
}

/// `claim ns/name (uid)`, or `claims a, b` for several.
fn claims_named<'a>(claims: impl Iterator<Item = (&'a ClaimUid, &'a ClaimEntry)>) -> String {
    let named: Vec<String> = claims
        .map(|(u, e)| format!("{}/{} ({u})", e.namespace, e.name))
        .collect();
    match named.as_slice() {
        [one] => format!("claim {one}"),
        many => format!("claims {}", many.join(", ")),
    }
}

/// A share under the trust-domain rule: a share of a GPU (or MIG device), not an admin's
/// access to it (admin access is granted only in namespaces the cluster admin marks for it,
/// and holds nothing).
fn is_share(d: &DeviceRecord) -> bool {
    d.consumed.is_some() && !d.admin_access
}

impl Plugin {
    /// The fast path: one durable write (spec and record in parallel).
    async fn prepare_without_hardware(
        &self,
        claim: &ClaimRef,
        plan: Plan,
        inv: &Inventory,
    ) -> Result<Vec<DeviceRecord>, ClaimError> {
        let uid = &claim.uid;
        self.reserve(claim, &plan, ClaimState::PrepareCompleted, inv)?;
        crash_point!(self, AfterStarted);
        if plan.has_shares()
            && let Err(e) = self.ensure_share_daemons(&plan.devices).await
        {
            return Err(self.rollback_after(uid, (e, plan.devices)).await);
        }
        let spec = async {
            if plan.devices.is_empty() {
                Ok(())
            } else {
                self.write_cdi(uid, &plan.devices, inv, &[]).await
            }
        };
        let record = async { self.inner.ledger.flush().await.map_err(ClaimError::from) };
        #[cfg(feature = "crash-points")]
        let (spec, record) = self.crash_between(spec, record).await;
        #[cfg(not(feature = "crash-points"))]
        let (spec, record) = tokio::join!(spec, record);
        if let Err(e) = spec.and(record) {
            return Err(self.rollback_after(uid, (e, plan.devices)).await);
        }
        Ok(plan.devices)
    }

    /// The slow path: the intent is durable before the GPU changes.
    async fn prepare_reconfiguring(
        &self,
        claim: &ClaimRef,
        plan: Plan,
        inv: &Inventory,
    ) -> Result<Vec<DeviceRecord>, ClaimError> {
        let uid = &claim.uid;
        self.reserve(claim, &plan, ClaimState::PrepareStarted, inv)?;
        // Dynamic MIG: a GPU is nvdra's to turn off again once that is durable, before it is on.
        let enables: Vec<GpuUuid> = plan
            .mig_modes
            .iter()
            .filter(|(_, on)| *on)
            .map(|(gpu, _)| gpu.clone())
            .collect();
        let recorded: Vec<GpuUuid> = self.inner.ledger.update_mig_enabled(|s| {
            enables
                .into_iter()
                .filter(|gpu| s.insert(gpu.clone()))
                .collect()
        });
        if let Err(e) = self.inner.ledger.flush().await {
            // Not durable, and nothing was switched: the record goes with the reservation.
            self.inner.ledger.withdraw_reservation(uid, &recorded);
            return Err(e.into());
        }
        crash_point!(self, AfterStarted);
        match self.complete(uid, plan.devices, &plan.mig_modes, inv).await {
            Ok(devices) => Ok(devices),
            Err(partial) => Err(self.rollback_after(uid, partial).await),
        }
    }

    /// Reconfigures, writes the spec, records `PrepareCompleted` durably; on failure returns
    /// the devices as far as they got, for the rollback.
    async fn complete(
        &self,
        uid: &ClaimUid,
        mut devices: Vec<DeviceRecord>,
        mig_modes: &[(GpuUuid, bool)],
        inv: &Inventory,
    ) -> Result<Vec<DeviceRecord>, Partial> {
        let created = match self.reconfigure(uid, &mut devices, mig_modes).await {
            Ok(created) => created,
            Err(e) => return Err((e, devices)),
        };
        // A GPU's minor may change across a MIG mode switch (nvml.h, nvmlDeviceSetMigMode):
        // the spec's device nodes come from a read made after it.
        let switched;
        let inv = if mig_modes.is_empty() {
            inv
        } else {
            switched = match self.snapshot().await {
                Ok(now) => now,
                Err(e) => return Err((e, devices)),
            };
            log_minor_changes(uid, inv, &switched, mig_modes);
            &switched
        };
        if let Err(e) = self.write_cdi(uid, &devices, inv, &created).await {
            return Err((e, devices));
        }
        crash_point!(self, AfterCdi);
        self.inner.ledger.update(|c| {
            if let Some(e) = c.get_mut(uid) {
                e.state = ClaimState::PrepareCompleted;
            }
        });
        crash_point!(self, BeforeCompleted);
        if let Err(e) = self.inner.ledger.flush().await {
            return Err((e.into(), devices));
        }
        Ok(devices)
    }
}

/// Logs each GPU of `switched` (the MIG modes a prepare switched) whose minor differs in `now`
/// from `before`: its devices keep the names they were allocated by (the minor at publish time),
/// the claim's spec gets the new device node, and the slices are published again with the new
/// names.
fn log_minor_changes(
    uid: &ClaimUid,
    before: &Inventory,
    now: &Inventory,
    switched: &[(GpuUuid, bool)],
) {
    for (gpu, on) in switched {
        let minor = |inv: &Inventory| inv.gpu_by_uuid(gpu.as_str()).map(|g| g.minor);
        if let (Some(old), Some(new)) = (minor(before), minor(now))
            && old != new
        {
            tracing::warn!(claim.uid = %uid, gpu.uuid = %gpu, mig.mode = crate::inventory::on_off(*on), minor.before = old, minor.after = new, "the GPU's minor changed across its MIG mode switch; the claim's devices keep their allocated names, its spec the new device node");
        }
    }
}

impl Plugin {
    /// The inventory prepared devices' metadata is read from: the owner's publication; `None`
    /// (logged) when there is none, and the files then name the devices only.
    pub(crate) async fn metadata_inventory(&self) -> Option<Arc<Inventory>> {
        match self.snapshot().await {
            Ok(inv) => Some(inv),
            Err(e) => {
                tracing::warn!(error = %chain(&e), "cannot read the inventory; the device metadata files name the devices only");
                None
            }
        }
    }
}

/// What the kubelet is told of one prepared device, with the metadata its container reads
/// (KEP-5304) from `inv` when there is one.
fn prepared(d: DeviceRecord, inv: Option<&Inventory>) -> PreparedDevice {
    let metadata = inv
        .and_then(|inv| crate::dra::slices::device_metadata(inv, &d))
        .map(DeviceMetadata::new);
    let DeviceRecord {
        requests,
        pool,
        device,
        cdi_ids,
        share_id,
        admin_access: _,
        gpu: _,
        mig: _,
        consumed: _,
        sharing: _,
    } = d;
    let mut device = PreparedDevice::new(requests, pool, device, cdi_ids);
    if let Some(share) = share_id {
        device = device.with_share_id(share);
    }
    match metadata {
        Some(m) => device.with_metadata(m),
        None => device,
    }
}

impl Plugin {
    pub(super) async fn unprepare_one(&self, uid: &ClaimUid) -> Result<(), ClaimError> {
        let Some(entry) = self.inner.ledger.read(|c| c.claims.get(uid).cloned()) else {
            // Unknown claims succeed; a stray spec of ours for it goes too.
            if self.inner.specs.remove(uid)? {
                tracing::warn!(claim.uid = %uid, "removed a CDI spec of a claim not in the checkpoint");
            }
            return Ok(());
        };
        self.rollback(uid, &entry.devices).await?;
        self.forget_status(uid);
        tracing::info!(claim.uid = %uid, claim = %format!("{}/{}", entry.namespace, entry.name), "claim unprepared");
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::cdi::CdiOptions;
    use crate::dra::plugin::plan::plan;
    use crate::dra::plugin::plan::tests::{DRIVER, checked, claim_ref, opts, result};
    use crate::inventory::GpuUuid;
    use crate::inventory::topology::load_profile;
    use crate::sharing::Sharing;

    fn record(share: Option<&str>) -> DeviceRecord {
        DeviceRecord {
            requests: vec!["gpu".into()],
            pool: "node".into(),
            device: crate::ids::DeviceName::gpu(0),
            cdi_ids: vec!["k8s.gpu.nvidia.com/claim=u-gpu-0".into()],
            share_id: share.map(String::from),
            admin_access: false,
            gpu: GpuUuid("GPU-0".into()),
            mig: None,
            consumed: None,
            sharing: Sharing::Exclusive,
        }
    }

    #[test]
    fn a_record_tells_the_kubelet_its_device_and_share() {
        let d = prepared(record(Some("s1")), None);
        assert_eq!(d.device, "gpu-0");
        assert_eq!(d.pool, "node");
        assert_eq!(d.requests, vec!["gpu".to_string()]);
        assert_eq!(d.share_id.as_deref(), Some("s1"));
        assert_eq!(
            d.cdi_ids,
            vec!["k8s.gpu.nvidia.com/claim=u-gpu-0".to_string()]
        );
    }

    #[test]
    fn a_bad_uid_is_that_claims_entry_and_never_reaches_the_plugin() {
        let claim = |uid: &str| (Claim::new("ns", format!("c-{}", uid.len()), uid), ());
        let claims: Claims<()> = vec![claim("good-1"), claim("a/b"), claim("")]
            .into_iter()
            .collect();
        assert_eq!(
            claims.valid,
            vec![(
                ClaimRef {
                    namespace: "ns".into(),
                    name: "c-6".into(),
                    uid: ClaimUid::parse("good-1").unwrap(),
                },
                ()
            )]
        );
        let rejected: Vec<&str> = claims.rejected.iter().map(|(u, _)| u.as_str()).collect();
        assert_eq!(rejected, vec!["a/b", ""]);
        let e = chain(&claims.rejected[0].1).to_string();
        assert!(
            e.starts_with("claim UID \"a/b\" cannot name a CDI device"),
            "{e}"
        );
        assert!(!chain(&claims.rejected[1].1).to_string().is_empty());
    }

    #[test]
    fn a_conflict_names_the_claim_that_holds_the_device() {
        let inv = load_profile("dgx-h100", "node-a").unwrap();
        let cdi = CdiOptions::resolve(
            DRIVER,
            &crate::cdi::DriverRoot::at(Path::new("/nonexistent")),
        )
        .unwrap();
        let rc = |uid: &str| {
            checked(crate::api::allocated_claim(
                "ns",
                "c",
                uid,
                vec![result("gpu", DRIVER, "gpu-3")],
                vec![],
            ))
        };
        let a = plan(&opts(false), &cdi, &claim_ref("a"), &rc("a"), &inv).unwrap();
        let b = plan(&opts(false), &cdi, &claim_ref("b"), &rc("b"), &inv).unwrap();
        let mut claims = BTreeMap::new();
        claims.insert(
            claim_ref("a").uid,
            ClaimEntry {
                state: crate::ledger::ClaimState::PrepareCompleted,
                namespace: "ns".into(),
                name: "holder".into(),
                devices: a.devices.clone(),
                pods: vec![],
                user: None,
                trust_label: None,
            },
        );
        // A claim does not conflict with itself (a retried prepare).
        conflict(&claims, &claim_ref("a").uid, &a.devices).unwrap();
        let e = conflict(&claims, &claim_ref("b").uid, &b.devices).unwrap_err();
        assert!(
            e.to_string()
                .contains("gpu-3 is already prepared for claim ns/holder (a)"),
            "{e}"
        );
    }
}
