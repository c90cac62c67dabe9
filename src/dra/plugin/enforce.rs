//! What keeps shares honest on the node, beside their MPS daemon: the compute mode of each GPU
//! that holds shares, or that a claim shares through MPS as a whole GPU
//! ([`compute_mode`](crate::dra::compute_mode)), put in place before the daemon is used and put
//! back after the GPU's last such claim; and the daemon watch, which
//! asks each such GPU's daemon every few seconds whether it answers. One that does not is
//! reported (a `NoSchedule` device taint through the health monitor, `nvdra_mps_daemon_up` 0)
//! and new shares of its GPU are refused until it answers again. Which daemons are down, and
//! since when, is the health monitor's record alone, as the inventory owner publishes it: the
//! plugin reads it there, for its refusals and the next round.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio_util::sync::CancellationToken;

use super::effects::shared_devices;
use super::{ClaimError, Plugin};
use crate::health::DaemonsDown;
use crate::ids::ClaimUid;
use crate::inventory::{DeviceUuid, GpuUuid};
use crate::ledger::{ClaimEntry, ClaimState, DeviceRecord};
use crate::sharing::Sharing;

impl Plugin {
    /// Puts each GPU of [`one_context_gpus`] in `EXCLUSIVE_PROCESS` (recorded first). The
    /// claim is reserved already, so a release racing with this one sees it.
    pub(super) async fn hold_compute_modes(
        &self,
        devices: &[DeviceRecord],
    ) -> Result<(), ClaimError> {
        for gpu in one_context_gpus(devices) {
            self.blocking(move |i| i.compute_modes.hold(&i.gpus, &gpu))
                .await??;
        }
        Ok(())
    }

    /// Puts back the compute mode of each GPU of [`one_context_gpus`], where no other claim
    /// holds it so (asked under the record's lock, against the ledger).
    pub(super) async fn release_compute_modes(
        &self,
        uid: &ClaimUid,
        devices: &[DeviceRecord],
    ) -> Result<(), ClaimError> {
        for gpu in one_context_gpus(devices) {
            let (ledger, owner) = (self.inner.ledger.clone(), uid.clone());
            self.blocking(move |i| {
                i.compute_modes.release(&i.gpus, &gpu, || {
                    ledger.read(|c| held_by_another(&c.claims, &owner, &gpu))
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
            .flat_map(|e| one_context_gpus(&e.devices))
            .collect();
        let repaired = self
            .blocking(move |i| i.compute_modes.repair(&i.gpus, &shared))
            .await;
        match repaired {
            Ok((done, failed)) => {
                if !(done.held.is_empty() && done.released.is_empty()) {
                    tracing::info!(held = ?done.held, released = ?done.released, "compute modes repaired from their record");
                }
                for e in failed {
                    tracing::error!(error = %crate::report::chain(&e), "cannot repair a GPU's compute mode at start-up");
                }
            }
            Err(e) => {
                tracing::error!(error = %crate::report::chain(&e), "compute-mode repair failed")
            }
        }
    }
}

/// The GPUs `devices` need in `EXCLUSIVE_PROCESS`, each once: those they hold shares of, and
/// whole GPUs a claim shares through its own MPS daemon (as NVIDIA's DRA driver does for MPS
/// claims). The mode is per GPU, so a MIG device's GPU is left alone.
pub(super) fn one_context_gpus(devices: &[DeviceRecord]) -> Vec<GpuUuid> {
    let mut gpus: Vec<GpuUuid> = devices
        .iter()
        .filter(|d| one_context(d))
        .map(|d| d.gpu.clone())
        .collect();
    gpus.sort();
    gpus.dedup();
    gpus
}

/// A share or an MPS claim of a whole GPU; never a MIG device's (its shares included: the
/// compute mode is the GPU's, and MIG devices beside it may be used by others).
fn one_context(d: &DeviceRecord) -> bool {
    d.mig.is_none() && (d.consumed.is_some() || matches!(d.sharing, Sharing::Mps(_)))
}

/// Whether a claim other than `owner` needs `gpu` in `EXCLUSIVE_PROCESS`.
pub(super) fn held_by_another(
    claims: &BTreeMap<ClaimUid, ClaimEntry>,
    owner: &ClaimUid,
    gpu: &GpuUuid,
) -> bool {
    crate::holds::claims_holding(claims, Some(owner), |o| one_context(o) && o.gpu == *gpu)
        .next()
        .is_some()
}

/// How long one probe of a GPU's share daemon may take, end to end, before it counts as down
/// (the probe's own deadline, plus the time to start the process).
pub const PROBE_DEADLINE: Duration = Duration::from_secs(3);

/// What the daemon watch tells the rest of the node after each round: the GPUs and MIG devices
/// with shares and whether each one's daemon answered, and those that do not with since when
/// (in `nvdra run`, the health monitor, whose state the owner publishes).
pub trait DaemonReport: Send + Sync + 'static {
    fn report(&self, up: &BTreeMap<DeviceUuid, bool>, down: &DaemonsDown);
}

impl Plugin {
    /// Refuses a new share of a GPU or MIG device whose share daemon did not answer the watch's
    /// last probe (as the owner's latest publication says).
    pub(super) fn refuse_while_daemon_down(
        &self,
        devices: &[crate::ledger::DeviceRecord],
    ) -> Result<(), ClaimError> {
        let published = self.inner.node.borrow();
        let down = published.health.daemons_down();
        let Some((d, since)) = devices
            .iter()
            .filter(|d| d.consumed.is_some())
            .find_map(|d| down.get(&d.share_target()).map(|s| (d, *s)))
        else {
            return Ok(());
        };
        let ago = SystemTime::now()
            .duration_since(since)
            .unwrap_or_default()
            .as_secs();
        Err(ClaimError::ShareDaemonDown {
            device: d.device.to_string(),
            gpu: match d.share_target() {
                DeviceUuid::Gpu(g) => format!("GPU {g}"),
                DeviceUuid::Mig(m) => format!("MIG device {m}"),
            },
            since: k8s_openapi::jiff::Timestamp::try_from(since)
                .map(|t| t.to_string())
                .unwrap_or_else(|_| "an unknown time".into()),
            ago: format!("{ago}s"),
        })
    }

    /// Asks the share daemon of every GPU or MIG device that holds shares, each under
    /// [`PROBE_DEADLINE`],
    /// whether it answers, and reports the result, with since when each one that does not is
    /// down (the published record's time, or now). Runs with no lock a prepare waits on: the
    /// ledger is copied, the probes run on the blocking pool.
    pub async fn probe_share_daemons(&self, report: &dyn DaemonReport) {
        let shared: BTreeSet<DeviceUuid> = self.inner.ledger.read(|c| {
            c.claims
                .values()
                .flat_map(|e| shared_devices(&e.devices))
                .collect()
        });
        let unguarded = self.recheck_compute_modes().await;
        // All GPUs at once: a round takes one deadline however many daemons are down.
        let probes = shared.into_iter().map(|gpu| async move {
            let g = gpu.clone();
            // A daemon a prepare has just asked for and is waiting on is starting, not down.
            let probe = self.blocking(move |i| i.mps.alive_shares(&g) || i.mps.starting_shares(&g));
            let answers = matches!(
                tokio::time::timeout(PROBE_DEADLINE, probe).await,
                Ok(Ok(true))
            );
            (gpu, answers)
        });

        // A GPU out of EXCLUSIVE_PROCESS that cannot be put back is as unguarded as one whose
        // daemon does not answer (a MIG device's shares leave the GPU's mode alone).
        let up: BTreeMap<DeviceUuid, bool> = futures::future::join_all(probes)
            .await
            .into_iter()
            .map(|(gpu, answers)| {
                let guarded = match &gpu {
                    DeviceUuid::Gpu(g) => !unguarded.contains(g),
                    DeviceUuid::Mig(_) => true,
                };
                (gpu, answers && guarded)
            })
            .collect();
        let now = SystemTime::now();
        let before = self.inner.node.borrow().health.daemons_down().clone();
        let mut down = DaemonsDown::new();
        for (gpu, answers) in &up {
            match (answers, before.get(gpu)) {
                (true, Some(since)) => {
                    let since = k8s_openapi::jiff::Timestamp::try_from(*since)
                        .map(|t| t.to_string())
                        .unwrap_or_default();
                    tracing::info!(gpu.uuid = %gpu, down_since = %since, "the MPS daemon of the GPU's shares answers again; new shares are accepted");
                }
                (true, None) => {}
                (false, Some(since)) => {
                    down.insert(gpu.clone(), *since);
                }
                (false, None) => {
                    tracing::warn!(gpu.uuid = %gpu, "the MPS daemon of the GPU's shares does not answer; the GPU is tainted mps-daemon-down and new shares are refused until it answers (the MPS host restarts it)");
                    down.insert(gpu.clone(), now);
                }
            }
        }
        report.report(&up, &down);
    }

    /// Puts back in `EXCLUSIVE_PROCESS` every GPU held for shares that left it (a reset, a driver
    /// reload, another agent: a CUDA process outside MPS could then take the GPU beside the
    /// shares). Returns the GPUs that could not be put back: the watch reports them as it does
    /// a daemon that does not answer (tainted, new shares refused).
    async fn recheck_compute_modes(&self) -> BTreeSet<GpuUuid> {
        let checked = self.blocking(|i| i.compute_modes.recheck(&i.gpus)).await;
        let (restored, failed) = match checked {
            Ok(r) => r,
            Err(e) => {
                tracing::error!(error = %crate::report::chain(&e), "cannot check the compute modes of the GPUs with shares");
                return BTreeSet::new();
            }
        };
        for (gpu, found) in restored {
            tracing::warn!(gpu.uuid = %gpu, found = ?found, "a GPU with shares was found out of EXCLUSIVE_PROCESS (a reset, a driver reload or another agent); put back");
        }
        failed
            .into_iter()
            .filter_map(|e| {
                tracing::error!(error = %crate::report::chain(&e), "a GPU with shares is out of EXCLUSIVE_PROCESS and cannot be put back; it is tainted and refuses new shares until it is");
                match e {
                    crate::dra::compute_mode::Error::Hold { gpu, .. } => Some(gpu),
                    _ => None,
                }
            })
            .collect()
    }

    /// The daemon watch: [`Plugin::probe_share_daemons`] every `interval` until `shutdown`.
    /// The first round comes one interval after start: start-up has just ensured the daemons.
    pub async fn watch_share_daemons(
        self,
        interval: Duration,
        report: Arc<dyn DaemonReport>,
        shutdown: CancellationToken,
    ) {
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                biased;
                () = shutdown.cancelled() => return,
                _ = tick.tick() => self.probe_share_daemons(&*report).await,
            }
        }
    }
}
