//! Start-up repair of what a crash or reboot left behind: a MIG mode change pending on a GPU
//! nvdra switches is withdrawn, `PrepareStarted` claims are rolled back, a MIG mode nvdra
//! turned on and left with no instance is turned off (dynamic MIG), completed claims get their MPS daemon asked for again and their CDI spec rewritten if it is
//! missing, empty or stale (specs are not fsync'd), CDI specs of ours without a ledger entry
//! are removed; GPUs with shares are put in `EXCLUSIVE_PROCESS` compute mode again and recorded
//! GPUs without shares get their mode back ([`crate::dra::compute_mode`]). Together with the
//! order of writes in [`prepare`](super::prepare), this makes every crash point end in a state
//! the kubelet's retry can finish.

use super::effects::{mps_devices, shared_devices};
use super::{ClaimError, Plugin};
use crate::ids::ClaimUid;
use crate::inventory::{DeviceUuid, Inventory};
use crate::ledger::{self, ClaimEntry, ClaimState};

/// What start-up repaired.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Recovery {
    pub loaded: Option<ledger::LoadOutcome>,
    pub rolled_back: Vec<ClaimUid>,
    pub cdi_rewritten: Vec<ClaimUid>,
    pub orphans_removed: Vec<ClaimUid>,
    /// Claims that could not be recovered (logged); their entries stay.
    pub failed: Vec<ClaimUid>,
    /// Dynamic MIG: GPUs whose MIG mode nvdra had turned on, left on with no instance by a
    /// crash, turned off.
    pub mig_modes_off: Vec<crate::inventory::GpuUuid>,
    /// Dynamic MIG: GPUs nvdra switches (Hopper and later) found with a MIG mode change
    /// pending (a refused switch a crash kept nvdra from withdrawing, or anyone's), withdrawn.
    pub pending_withdrawn: Vec<crate::inventory::GpuUuid>,
}

impl Plugin {
    /// Repairs what a crash or reboot left behind. Call once before serving.
    pub async fn recover(&self) -> Result<Recovery, ClaimError> {
        let _g = self.enter().await?;
        let mut rec = Recovery::default();
        let entries = self.inner.ledger.read(|c| c.claims.clone());
        self.repair_compute_modes(&entries).await;
        let mut inv = self.snapshot().await?;
        // First, before any repair switches a GPU: a change left pending on a GPU nvdra
        // switches would make it refuse every switch until a reset.
        rec.pending_withdrawn = self.withdraw_pending(&inv).await;
        if !rec.pending_withdrawn.is_empty() {
            inv = self.snapshot().await?;
        }
        self.inner.mps.know_gpus(&inv);
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
                tracing::error!(claim.uid = %uid, %claim, error = %crate::report::chain(&e), "cannot recover claim; left for its next prepare or unprepare");
                rec.failed.push(uid.clone());
            }
        }
        // After the rollbacks: a MIG mode nvdra left on with no instance goes off.
        rec.mig_modes_off = self.repair_mig_modes().await?;
        let known = self.inner.ledger.read(|c| c.claims.clone());
        for uid in self.inner.specs.list()? {
            if !known.contains_key(&uid) {
                self.inner.specs.remove(&uid)?;
                tracing::warn!(claim.uid = %uid, "removed orphan CDI spec with no checkpoint entry");
                rec.orphans_removed.push(uid);
            }
        }
        self.inner.ledger.flush().await?;
        Ok(rec)
    }

    /// Brings a completed claim's host state back: its MPS daemon's request (the MPS host runs
    /// it; start-up does not wait for it) and its CDI spec.
    async fn restore(
        &self,
        uid: &ClaimUid,
        entry: &ClaimEntry,
        inv: &Inventory,
        rec: &mut Recovery,
    ) -> Result<(), ClaimError> {
        let mps: Vec<DeviceUuid> = mps_devices(&entry.devices);
        if !mps.is_empty() {
            let owner = uid.clone();
            self.blocking(move |i| i.mps.ensure(&owner, &mps)).await??;
        }
        for device in shared_devices(&entry.devices) {
            self.blocking(move |i| i.mps.request_shares(&device))
                .await??;
        }
        if !entry.devices.is_empty() && self.ensure_cdi(uid, &entry.devices, inv).await? {
            tracing::info!(claim.uid = %uid, "CDI spec was missing or damaged; rewritten from the checkpoint");
            rec.cdi_rewritten.push(uid.clone());
        }
        Ok(())
    }
}
