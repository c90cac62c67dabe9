//! What keeps shares honest on the node, beside their MPS daemon: the compute mode of each GPU
//! that holds shares ([`compute_mode`](crate::dra::compute_mode)), put in place before a
//! share's daemon is used and put back after the GPU's last share.

use std::collections::{BTreeMap, BTreeSet};

use super::effects::shared_gpus;
use super::{ClaimError, Plugin};
use crate::ids::ClaimUid;
use crate::inventory::GpuUuid;
use crate::ledger::{ClaimEntry, ClaimState};

impl Plugin {
    /// Puts each GPU `devices` hold shares of in `EXCLUSIVE_PROCESS` (recorded first). The
    /// claim is reserved already, so a release racing with this one sees it.
    pub(super) async fn hold_compute_modes(
        &self,
        devices: &[crate::ledger::DeviceRecord],
    ) -> Result<(), ClaimError> {
        for gpu in shared_gpus(devices) {
            self.blocking(move |i| i.compute_modes.hold(&*i.backend, &gpu))
                .await??;
        }
        Ok(())
    }

    /// Puts back the compute mode of each GPU `devices` hold shares of, where no other claim
    /// holds a share of it (asked under the record's lock, against the ledger).
    pub(super) async fn release_compute_modes(
        &self,
        uid: &ClaimUid,
        devices: &[crate::ledger::DeviceRecord],
    ) -> Result<(), ClaimError> {
        for gpu in shared_gpus(devices) {
            let (ledger, owner) = (self.inner.ledger.clone(), uid.clone());
            self.blocking(move |i| {
                i.compute_modes.release(&*i.backend, &gpu, || {
                    ledger.read(|c| other_share(&c.claims, &owner, &gpu))
                })
            })
            .await??;
        }
        Ok(())
    }

    /// Start-up: GPUs with completed shares in the checkpoint are held again, recorded GPUs
    /// without are put back (an interrupted prepare's share is rolled back after this).
    /// Failures are logged: the GPU's next share prepare or unprepare retries.
    pub(super) async fn repair_compute_modes(&self, entries: &BTreeMap<ClaimUid, ClaimEntry>) {
        let shared: BTreeSet<GpuUuid> = entries
            .values()
            .filter(|e| e.state == ClaimState::PrepareCompleted)
            .flat_map(|e| shared_gpus(&e.devices))
            .collect();
        let repaired = self
            .blocking(move |i| i.compute_modes.repair(&*i.backend, &shared))
            .await;
        match repaired {
            Ok((done, failed)) => {
                if !(done.held.is_empty() && done.released.is_empty()) {
                    tracing::info!(held = ?done.held, released = ?done.released, "compute modes repaired from their record");
                }
                for e in failed {
                    tracing::error!(error = %kubelet_plugin::report::chain(&e), "cannot repair a GPU's compute mode at start-up");
                }
            }
            Err(e) => {
                tracing::error!(error = %kubelet_plugin::report::chain(&e), "compute-mode repair failed")
            }
        }
    }
}

/// Whether a claim other than `owner` holds a share of `gpu`.
pub(super) fn other_share(
    claims: &BTreeMap<ClaimUid, ClaimEntry>,
    owner: &ClaimUid,
    gpu: &GpuUuid,
) -> bool {
    claims.iter().any(|(u, e)| {
        u != owner
            && e.devices
                .iter()
                .any(|o| o.consumed.is_some() && o.gpu == *gpu)
    })
}
