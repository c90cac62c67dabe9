//! The batch runner: a kubelet request names several claims; each gets its own entry, whatever
//! happens to the others.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Instant;

use futures::FutureExt;
use futures::future::{BoxFuture, Shared};
use kubelet_plugin::PrepareClaim;

use super::{ClaimError, ClaimRef, Plugin};
use crate::inventory::Inventory;
use crate::inventory::owner::Writes;
// The claim-lock map sees inserts and removes only, so ignoring poison is sound.
use crate::ids::ClaimUid;
use crate::ledger::DeviceRecord;
use crate::lock::lock;
use crate::metrics::Histogram;

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
