//! The effects of a prepare on the GPU and their undo: MIG instances created and destroyed, time
//! slices set and reset, MPS daemons requested and released; and the rollback, which also removes
//! the claim's CDI spec (written by [specs](super::specs)). Each undo step can be repeated safely,
//! so a rollback that failed half-way is retried as a whole.
//!
//! Each effect is a function of the claim's device records, whether they come from this
//! prepare's [plan](super::plan) or from the checkpoint (recovery, a repeated prepare): the pure
//! helpers at the end derive what to change from them.

use crate::ids::ClaimUid;
use crate::inventory::{DeviceUuid, GpuUuid, MigDevice, Reconfigure, TimeSlice};
use crate::ledger::DeviceRecord;
use crate::sharing::{Sharing, TimeSliceInterval};

use super::{ClaimError, Plugin, crash_point};

/// A reconfiguration that stopped part-way: the error, and the devices as far as they got (with
/// the UUIDs of MIG devices already created), for the rollback.
pub(super) type Partial = (ClaimError, Vec<DeviceRecord>);

impl Plugin {
    /// Changes the GPUs as `devices` ask: switches the MIG modes of `mig_modes` (dynamic MIG),
    /// creates MIG instances (recording their UUIDs in the records and the ledger), sets time
    /// slices, asks for the claim's MPS daemon. Returns the MIG devices created, which the
    /// inventory snapshot of the batch does not list.
    pub(super) async fn reconfigure(
        &self,
        uid: &ClaimUid,
        devices: &mut [DeviceRecord],
        mig_modes: &[(GpuUuid, bool)],
    ) -> Result<Vec<MigDevice>, ClaimError> {
        let mut created: Vec<MigDevice> = Vec::new();
        let result = self
            .reconfigure_devices(uid, devices, mig_modes, &mut created)
            .await;
        // Record created MIG UUIDs so a rollback finds them (not yet durable; the rollback also
        // finds instances by placement).
        if !created.is_empty() {
            self.inner.ledger.update(|c| {
                if let Some(e) = c.get_mut(uid) {
                    e.devices = devices.to_vec();
                }
            });
        }
        result.map(|()| created)
    }

    async fn reconfigure_devices(
        &self,
        uid: &ClaimUid,
        devices: &mut [DeviceRecord],
        mig_modes: &[(GpuUuid, bool)],
        created: &mut Vec<MigDevice>,
    ) -> Result<(), ClaimError> {
        // Dynamic MIG: each GPU's mode switch and the instances created on it under its lock.
        let _mig_locks = if self.inner.opts.dynamic_mig {
            let creates = devices
                .iter()
                .filter(|d| d.mig.as_ref().is_some_and(|m| m.created))
                .map(|d| d.gpu.clone());
            let gpus = mig_modes.iter().map(|(g, _)| g.clone()).chain(creates);
            let locks = self.lock_mig_gpus(gpus).await;
            self.switch_mig_modes(uid, mig_modes, devices).await?;
            locks
        } else {
            Vec::new()
        };
        for d in devices.iter_mut() {
            if let Some(m) = &mut d.mig
                && m.created
            {
                let (gpu, gi, placement) = (d.gpu.clone(), m.gi_profile_id, m.placement);
                let dev = self
                    .blocking(move |i| i.gpus.create_mig(&gpu, gi, placement))
                    .await??;
                tracing::info!(claim.uid = %uid, device = %d.device, mig.uuid = %dev.uuid, "MIG device created");
                m.uuid = Some(dev.uuid.clone());
                created.push(dev);
                crash_point!(self, AfterMigCreated);
            }
            if let (Sharing::TimeSlicing { interval }, None) = (&d.sharing, &d.mig) {
                // MIG devices are not time-sliced by interval; only whole GPUs are.
                let (gpu, interval) = (d.gpu.clone(), time_slice(*interval));
                self.blocking(move |i| i.gpus.set_time_slice(&gpu, interval))
                    .await??;
            }
        }
        // Shares' GPUs are in EXCLUSIVE_PROCESS before their daemon serves them.
        self.hold_compute_modes(devices).await?;
        let mps = mps_devices(devices);
        if !mps.is_empty() {
            let owner = uid.clone();
            self.blocking(move |i| i.mps.start(&owner, &mps)).await??;
        }
        for device in shared_devices(devices) {
            self.blocking(move |i| i.mps.ensure_shares(&device))
                .await??;
        }
        Ok(())
    }

    /// Asks for the MPS daemon of each GPU or MIG device `devices` hold shares of, unless it is
    /// asked for, and
    /// waits until it answers. The claim is reserved already, so no unprepare of another share
    /// releases a daemon found requested here ([`Plugin::undo_devices`] asks the ledger under the
    /// GPU's lock, which the request takes too). Before a new request the claim's record is made
    /// durable: a crash then leaves the daemon to a recorded share, which start-up keeps or rolls
    /// back, never to nobody.
    pub(super) async fn ensure_share_daemons(
        &self,
        devices: &[DeviceRecord],
    ) -> Result<(), ClaimError> {
        // Shares' GPUs are in EXCLUSIVE_PROCESS before their daemon serves them.
        self.hold_compute_modes(devices).await?;
        for device in shared_devices(devices) {
            let d = device.clone();
            if !self.blocking(move |i| i.mps.shares_requested(&d)).await? {
                self.inner.ledger.flush().await?;
            }
            self.blocking(move |i| i.mps.ensure_shares(&device))
                .await??;
        }
        Ok(())
    }

    /// Undoes whatever a (partial) prepare of `uid` did, then forgets the claim. Each step can be
    /// repeated safely.
    pub(super) async fn rollback(
        &self,
        uid: &ClaimUid,
        devices: &[DeviceRecord],
    ) -> Result<(), ClaimError> {
        self.undo_devices(uid, devices).await?;
        crash_point!(self, AfterUndo);
        // The GPU is back to its old state; the spec and the entry may now go in parallel. A
        // crash in between leaves either an orphan spec (removed at start) or a completed entry
        // without a spec (rewritten at start, then unprepared again by the kubelet).
        let spec_uid = uid.clone();
        let spec = self.blocking(move |i| i.specs.remove(&spec_uid).map_err(ClaimError::from));
        let record = async {
            self.inner.ledger.update(|c| c.remove(uid));
            self.inner.ledger.flush().await
        };
        #[cfg(feature = "crash-points")]
        let (removed, flushed) = self.crash_between_removals(spec, record).await;
        #[cfg(not(feature = "crash-points"))]
        let (removed, flushed) = tokio::join!(spec, record);
        removed??;
        flushed?;
        Ok(())
    }

    /// [`Plugin::rollback`] after a failed prepare, whose error is what the kubelet hears; a
    /// failed rollback is logged and retried on the next prepare or at start-up.
    pub(super) async fn rollback_after(&self, uid: &ClaimUid, (e, devices): Partial) -> ClaimError {
        if let Err(re) = self.rollback(uid, &devices).await {
            tracing::error!(claim.uid = %uid, error = %crate::report::chain(&re), "rollback after a failed prepare failed; retried on the next prepare or restart");
        }
        e
    }

    async fn undo_devices(
        &self,
        uid: &ClaimUid,
        devices: &[DeviceRecord],
    ) -> Result<(), ClaimError> {
        if !mps_devices(devices).is_empty() {
            let uid = uid.clone();
            self.blocking(move |i| i.mps.stop(&uid)).await??;
        }
        for device in shared_devices(devices) {
            // The device's daemon goes with its last share: asked under the device's lock,
            // against the ledger, where this claim still is and any other share already is (a
            // share is reserved before it starts or reuses the daemon).
            let (ledger, owner) = (self.inner.ledger.clone(), uid.clone());
            self.blocking(move |i| {
                i.mps.stop_shares(&device, || {
                    ledger.read(|c| {
                        c.claims.iter().any(|(u, e)| {
                            *u != owner
                                && e.devices
                                    .iter()
                                    .any(|o| o.consumed.is_some() && o.share_target() == device)
                        })
                    })
                })
            })
            .await??;
        }
        // After the daemon: the GPU's mode goes back with its last share.
        self.release_compute_modes(uid, devices).await?;
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
                    self.blocking(move |i| i.gpus.set_time_slice(&gpu, TimeSlice::Default))
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
                    // A daemon of its shares or of this claim, released above, may still run
                    // on it: the driver refuses to destroy an instance in use.
                    self.wait_own_mps(&d.gpu, Some(&mig_uuid), "destroy MIG device")
                        .await?;
                    let gpu = d.gpu.clone();
                    self.blocking(move |i| i.gpus.destroy_mig(&gpu, &mig_uuid))
                        .await??;
                    tracing::info!(claim.uid = %uid, device = %d.device, "MIG device destroyed");
                }
            }
        }
        // Dynamic MIG: off after the GPU's last instance.
        self.mig_off_after_last(uid, devices).await
    }
}

/// The UUIDs (GPU or MIG) of a claim's MPS-shared devices, for its own MPS daemon; shares of a
/// GPU or MIG device use the device's daemon instead ([`shared_devices`]).
pub(super) fn mps_devices(devices: &[DeviceRecord]) -> Vec<DeviceUuid> {
    devices
        .iter()
        .filter(|d| matches!(d.sharing, Sharing::Mps(_)) && d.consumed.is_none())
        .map(|d| match d.mig.as_ref().and_then(|m| m.uuid.clone()) {
            Some(mig) => DeviceUuid::Mig(mig),
            None => DeviceUuid::Gpu(d.gpu.clone()),
        })
        .collect()
}

/// The GPUs and MIG devices a claim holds consumable-capacity shares of
/// ([`DeviceRecord::share_target`]), each once.
pub(super) fn shared_devices(devices: &[DeviceRecord]) -> Vec<DeviceUuid> {
    let mut shared: Vec<DeviceUuid> = devices
        .iter()
        .filter(|d| d.consumed.is_some())
        .map(DeviceRecord::share_target)
        .collect();
    shared.sort();
    shared.dedup();
    shared
}

pub(super) fn time_slice(i: TimeSliceInterval) -> TimeSlice {
    match i {
        TimeSliceInterval::Default => TimeSlice::Default,
        TimeSliceInterval::Short => TimeSlice::Short,
        TimeSliceInterval::Medium => TimeSlice::Medium,
        TimeSliceInterval::Long => TimeSlice::Long,
    }
}
