//! The effects of a prepare and their undo: MIG instances created and destroyed, time slices
//! set and reset, MPS daemons requested and released, CDI specs written and removed. Each undo step
//! can be repeated safely, so a rollback that failed half-way is retried as a whole.
//!
//! Each effect is a function of the claim's device records, whether they come from this
//! prepare's [plan](super::plan) or from the checkpoint (recovery, a repeated prepare): the pure
//! helpers at the end derive what to change and what the CDI spec names from them.

use crate::cdi::PreparedDevice;
use crate::dra::mps::Mps;
use crate::ids::ClaimUid;
use crate::inventory::{DeviceUuid, GpuUuid, Inventory, MigDevice, Reconfigure, TimeSlice};
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

    /// Builds and writes the claim's CDI spec on the blocking pool (it reads the host).
    /// `created`: MIG devices made since `inv` was taken.
    pub(super) async fn write_cdi(
        &self,
        uid: &ClaimUid,
        devices: &[DeviceRecord],
        inv: &Inventory,
        created: &[MigDevice],
    ) -> Result<(), ClaimError> {
        let prepared = self.cdi_devices(uid, devices, inv, created)?;
        let uid = uid.clone();
        Ok(self
            .blocking(move |i| i.specs.write(&uid, &prepared))
            .await??)
    }

    /// Rewrites a completed claim's CDI spec unless it is intact (the spec is not fsync'd:
    /// [`Specs::write`](super::specs::Specs::write)); whether it wrote.
    pub(super) async fn ensure_cdi(
        &self,
        uid: &ClaimUid,
        devices: &[DeviceRecord],
        inv: &Inventory,
    ) -> Result<bool, ClaimError> {
        let prepared = match self.cdi_devices(uid, devices, inv, &[]) {
            Ok(prepared) => prepared,
            Err(e) => {
                // The devices cannot be resolved now (a MIG device the backend no longer
                // lists): a spec that still reads as one stays, as the checkpoint's record does.
                let owner = uid.clone();
                if self.blocking(move |i| i.specs.readable(&owner)).await? {
                    tracing::warn!(claim.uid = %uid, error = %crate::report::chain(&e), "cannot rebuild the CDI spec to check it; keeping the one on disk");
                    return Ok(false);
                }
                return Err(e);
            }
        };
        let uid = uid.clone();
        Ok(self
            .blocking(move |i| i.specs.ensure(&uid, &prepared))
            .await??)
    }

    /// The devices of `uid`'s spec, as [`cdi_devices`] resolves them on this node.
    fn cdi_devices(
        &self,
        uid: &ClaimUid,
        devices: &[DeviceRecord],
        inv: &Inventory,
        created: &[MigDevice],
    ) -> Result<Vec<PreparedDevice>, ClaimError> {
        let (pool, mps) = (&self.inner.opts.pool, &self.inner.mps);
        cdi_devices(pool, uid, devices, inv, created, mps)
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

/// The devices of a claim's CDI spec: each record with its GPU, and its MIG device looked up in
/// `inv` or among `created` (the MIG devices this prepare made, which `inv` predates).
pub(super) fn cdi_devices(
    pool: &str,
    uid: &ClaimUid,
    devices: &[DeviceRecord],
    inv: &Inventory,
    created: &[MigDevice],
    mps: &Mps,
) -> Result<Vec<PreparedDevice>, ClaimError> {
    let gone = |d: &DeviceRecord, reason: String| ClaimError::UnknownDevice {
        pool: d.pool.clone(),
        device: d.device.to_string(),
        ours: pool.to_string(),
        reason,
    };
    devices
        .iter()
        .map(|d| {
            let gpu = inv
                .gpu_by_uuid(d.gpu.as_str())
                .ok_or_else(|| gone(d, format!("GPU {} is gone", d.gpu)))?;
            let mig = match &d.mig {
                None => None,
                Some(m) => Some(
                    gpu.mig
                        .devices
                        .iter()
                        .chain(created)
                        .find(|x| Some(&x.uuid) == m.uuid.as_ref())
                        .ok_or_else(|| gone(d, "the MIG device is gone".into()))?
                        .clone(),
                ),
            };
            // What a share divides: its MIG device's memory for a share of one.
            let memory = mig.as_ref().map_or(gpu.memory_bytes, |m| m.memory_bytes);
            Ok(PreparedDevice {
                name: d.device.to_string(),
                gpu: gpu.clone(),
                mig,
                mps_pipe_dir: match (&d.sharing, d.consumed) {
                    (Sharing::Mps(_), Some(_)) => Some(mps.shares_pipe_dir(&d.share_target())),
                    (Sharing::Mps(_), None) => Some(mps.pipe_dir(uid)),
                    _ => None,
                },
                mps_shm_dir: match (&d.sharing, d.consumed) {
                    (Sharing::Mps(_), Some(_)) => Some(mps.shares_shm_dir(&d.share_target())),
                    (Sharing::Mps(_), None) => Some(mps.shm_dir(uid)),
                    _ => None,
                },
                sharing: d.sharing.clone(),
                // Soft: what the share is held to (what the scheduler counted, or its part of the
                // GPU in integer mode), guaranteed; hard: its burst limit, else the soft one. None
                // for an `unlimited` share that asked for no memory and no burst limit.
                memory_limits: d
                    .consumed
                    .and_then(|c| c.memory_limits(crate::ledger::shares::shareable_memory(memory))),
            })
        })
        .collect()
}
