//! Dynamic MIG on the node (`--dynamic-mig`): a GPU that can switch MIG mode at run time
//! ([`Gpu::mig_toggle`](crate::inventory::Gpu::mig_toggle)) is switched on by the prepare of a
//! MIG placement and off by the prepare of the GPU whole, and off again after the unprepare of
//! its last instance (unless `keep-on`).
//!
//! Invariants:
//! - nvdra never resets a GPU, and never destroys a MIG device it did not create: a GPU whose
//!   instances are not all nvdra's stays in MIG mode, and a whole-GPU claim on it is refused
//!   naming them.
//! - Before nvdra turns a GPU's MIG mode on, the GPU is recorded durably in the checkpoint
//!   ([`Checkpoint::mig_enabled`](crate::ledger::Checkpoint::mig_enabled), flushed with the
//!   claim's `PrepareStarted`), and it is forgotten only after nvdra turned the mode off. So a
//!   crash anywhere leaves either no change or a recorded GPU, which start-up
//!   ([`Plugin::repair_mig_modes`]) turns off when no instance is on it.
//! - A GPU's mode changes and the instance creations that depend on it run under that GPU's
//!   lock ([`Plugin::lock_mig_gpus`]), and "is this the GPU's last instance?" is asked of the
//!   ledger under the same lock, where a prepare that is about to create one is already
//!   reserved.
//! - nvdra leaves no MIG mode change pending on a GPU it switches (Hopper and later, where a
//!   change is applied at once or refused): a refused switch (`IN_USE`, `RESET_REQUIRED`) is
//!   withdrawn at once, under the GPU's lock; one a crash or a call past its deadline left is
//!   withdrawn at start-up ([`Plugin::recover`]), at the next prepare and at the next inventory
//!   read ([`Plugin::recheck_mig_switches`]). A pending change on a GPU before Hopper is the
//!   operator's, never touched.
//! - A switch refused by the driver is recorded for the GPU ([`SwitchBlocks`], which the slices
//!   follow): `RESET_REQUIRED` for good (until nvdra restarts: the GPU's MIG mode is then the
//!   operator's), `IN_USE` with its holders until a switch of the GPU succeeds or an inventory
//!   read finds none of them holding it.
//! - nvdra's own MPS daemons and servers quit asynchronously after their last share or claim
//!   is released: a switch, and an instance's destruction, waits for those on its GPU (or MIG
//!   device), up to [`OWN_MPS_EXIT`].
//!
//! [`SwitchBlocks`]: crate::inventory::switch_blocks::SwitchBlocks

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::OwnedMutexGuard;
use tokio_util::sync::CancellationToken;

use super::{ClaimError, Plugin, crash_point};
use crate::ids::ClaimUid;
use crate::inventory::{
    self, Gpu, GpuUuid, Holder, HolderKind, Inventory, MigModeChange, MigUuid, NoMigToggle,
    Reconfigure, SwitchBlock, on_off,
};
use crate::ledger::{ClaimEntry, DeviceRecord};
use std::collections::BTreeMap;

/// How long a MIG mode switch or an instance's destruction waits for nvdra's own MPS daemons
/// and servers on the GPU to exit after their release: the MPS host quits a released daemon
/// and kills it after its quit deadline (10 s), then removes its directory. (A released
/// daemon's directory is waited for at most that long after its release,
/// [`crate::dra::mps::QUIT_WAIT`]: past it the driver is asked and answers for itself.)
pub const OWN_MPS_EXIT: Duration = crate::dra::mps::QUIT_WAIT;
/// How often that wait looks again.
const OWN_MPS_POLL: Duration = Duration::from_millis(100);

impl Plugin {
    /// Takes the MIG-mode locks of `gpus` (each once, in UUID order, so two callers never wait
    /// on each other); held while the guards live.
    pub(super) async fn lock_mig_gpus(
        &self,
        gpus: impl IntoIterator<Item = GpuUuid>,
    ) -> Vec<OwnedMutexGuard<()>> {
        let mut gpus: Vec<GpuUuid> = gpus.into_iter().collect();
        gpus.sort();
        gpus.dedup();
        let locks: Vec<Arc<tokio::sync::Mutex<()>>> = {
            let mut map = crate::lock::lock(&self.inner.mig_locks);
            gpus.into_iter()
                .map(|g| map.entry(g).or_default().clone())
                .collect()
        };
        let mut guards = Vec::with_capacity(locks.len());
        for l in locks {
            guards.push(l.lock_owned().await);
        }
        guards
    }

    /// Switches the MIG modes a prepare needs ([`Plan::mig_modes`](super::plan::Plan)); the
    /// caller holds the GPUs' locks. Turning a GPU off for a whole-GPU claim is refused while
    /// any MIG device is on it (nvdra keeps instances it did not create); a GPU that answered
    /// `RESET_REQUIRED` before is not switched again.
    pub(super) async fn switch_mig_modes(
        &self,
        uid: &ClaimUid,
        modes: &[(GpuUuid, bool)],
        devices: &[DeviceRecord],
    ) -> Result<(), ClaimError> {
        for (gpu, enable) in modes {
            let device = || {
                devices
                    .iter()
                    .find(|d| d.gpu == *gpu)
                    .map_or_else(|| gpu.to_string(), |d| d.device.to_string())
            };
            if self.inner.switch_blocks.get(gpu) == Some(SwitchBlock::ResetRequired) {
                return Err(ClaimError::MigSwitchDisabled {
                    device: device(),
                    gpu: self.gpu_name(gpu).await,
                    mode: on_off(*enable),
                });
            }
            if !*enable {
                let inv = self.snapshot().await?;
                if let Some(g) = inv.gpu_by_uuid(gpu.as_str())
                    && !g.mig.devices.is_empty()
                {
                    return Err(ClaimError::MigDevicesLeft {
                        device: device(),
                        devices: g
                            .mig
                            .devices
                            .iter()
                            .map(|d| d.uuid.as_str())
                            .collect::<Vec<_>>()
                            .join(", "),
                    });
                }
            }
            self.wait_own_mps(gpu, None, &format!("turn MIG mode {}", on_off(*enable)))
                .await?;
            let changed = self.set_mig_mode(gpu, *enable).await?;
            if changed == MigModeChange::Applied {
                tracing::info!(claim.uid = %uid, gpu.uuid = %gpu, mig.mode = on_off(*enable), "MIG mode switched");
            }
            if *enable {
                crash_point!(self, AfterMigModeOn);
            } else {
                // Off: whatever recorded it as nvdra's is done with it (written with the claim).
                self.inner.ledger.update_mig_enabled(|s| s.remove(gpu));
                crash_point!(self, AfterMigModeOff);
            }
        }
        Ok(())
    }

    /// After an unprepare or rollback of `uid` destroyed its instances: turns MIG mode off on
    /// each GPU of `devices` where nvdra created an instance, if no MIG device is left on it
    /// and no other claim holds or is about to create one (unless `keep-on`). A GPU whose mode
    /// is off already is forgotten from the record.
    pub(super) async fn mig_off_after_last(
        &self,
        uid: &ClaimUid,
        devices: &[DeviceRecord],
    ) -> Result<(), ClaimError> {
        let opts = &self.inner.opts;
        if !opts.dynamic_mig {
            return Ok(());
        }
        let gpus: Vec<GpuUuid> = devices
            .iter()
            .filter(|d| d.mig.as_ref().is_some_and(|m| m.created))
            .map(|d| d.gpu.clone())
            .collect();
        if gpus.is_empty() {
            return Ok(());
        }
        let _locks = self.lock_mig_gpus(gpus.iter().cloned()).await;
        crash_point!(self, BeforeMigModeOff);
        let inv = self.snapshot().await?;
        let claims = self.inner.ledger.read(|c| c.claims.clone());
        for gpu in dedup(gpus) {
            if !self
                .mig_off_if_unused(&inv, &claims, Some(uid), &gpu)
                .await?
            {
                continue;
            }
            tracing::info!(claim.uid = %uid, gpu.uuid = %gpu, "MIG mode turned off after the GPU's last MIG device");
            crash_point!(self, AfterMigModeOff);
        }
        Ok(())
    }

    /// Turns `gpu`'s MIG mode off and forgets it, if it is on, toggleable, holds no MIG device
    /// and no claim but `except` records a MIG device on it; a GPU found off is forgotten.
    /// Whether it turned the mode off. The caller holds the GPU's lock.
    async fn mig_off_if_unused(
        &self,
        inv: &Inventory,
        claims: &BTreeMap<ClaimUid, ClaimEntry>,
        except: Option<&ClaimUid>,
        gpu: &GpuUuid,
    ) -> Result<bool, ClaimError> {
        let Some(g) = inv.gpu_by_uuid(gpu.as_str()) else {
            return Ok(false);
        };
        if !g.in_mig_mode() {
            self.inner.ledger.update_mig_enabled(|s| s.remove(gpu));
            return Ok(false);
        }
        let held = claims.iter().any(|(u, e)| {
            Some(u) != except && e.devices.iter().any(|d| d.gpu == *gpu && d.mig.is_some())
        });
        if self.inner.opts.keep_mig_on
            || held
            || !g.mig.devices.is_empty()
            || g.mig_toggle().is_err()
            || self.inner.switch_blocks.get(gpu) == Some(SwitchBlock::ResetRequired)
        {
            return Ok(false);
        }
        self.wait_own_mps(gpu, None, "turn MIG mode off").await?;
        let changed = self.set_mig_mode(gpu, false).await?;
        self.inner.ledger.update_mig_enabled(|s| s.remove(gpu));
        Ok(changed == MigModeChange::Applied)
    }

    /// Start-up: every GPU recorded as turned on by nvdra that holds no MIG device and that no
    /// claim records one on is turned off (unless `keep-on`), and forgotten; one found off is
    /// forgotten. Runs after interrupted prepares were rolled back. A GPU that cannot be turned
    /// off now (processes on it) is logged and stays recorded, for the next start or its next
    /// unprepare.
    pub(super) async fn repair_mig_modes(&self) -> Result<Vec<GpuUuid>, ClaimError> {
        let recorded: Vec<GpuUuid> = self
            .inner
            .ledger
            .read(|c| c.mig_enabled.iter().cloned().collect());
        let mut off = Vec::new();
        if recorded.is_empty() {
            return Ok(off);
        }
        let _locks = self.lock_mig_gpus(recorded.iter().cloned()).await;
        let inv = self.snapshot().await?;
        let claims = self.inner.ledger.read(|c| c.claims.clone());
        for gpu in recorded {
            if !self.inner.opts.dynamic_mig {
                tracing::warn!(gpu.uuid = %gpu, "nvdra turned this GPU's MIG mode on, and --dynamic-mig is off now: its MIG mode stays as it is");
                continue;
            }
            match self.mig_off_if_unused(&inv, &claims, None, &gpu).await {
                Ok(true) => {
                    tracing::info!(gpu.uuid = %gpu, "MIG mode left on by an interrupted prepare or unprepare turned off");
                    off.push(gpu);
                }
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(gpu.uuid = %gpu, error = %crate::report::chain(&e), "cannot turn off the MIG mode nvdra turned on; retried at the next start or unprepare");
                }
            }
        }
        Ok(off)
    }

    /// `backend.set_mig_mode`, its refusals as what the kubelet should hear; the caller holds
    /// the GPU's lock. A refused switch is withdrawn at once (the driver leaves it pending) and
    /// recorded in the GPU's [`SwitchBlock`]; a switch that went through clears an `IN_USE`
    /// block.
    async fn set_mig_mode(&self, gpu: &GpuUuid, enable: bool) -> Result<MigModeChange, ClaimError> {
        let g = gpu.clone();
        let r = self
            .blocking(move |i| i.gpus.set_mig_mode(&g, enable))
            .await?;
        match r {
            Ok(c) => {
                if matches!(
                    self.inner.switch_blocks.get(gpu),
                    Some(SwitchBlock::InUse { .. })
                ) && self.inner.switch_blocks.clear(gpu)
                {
                    tracing::info!(gpu.uuid = %gpu, "the GPU's MIG mode switched after all; its devices are offered again");
                }
                Ok(c)
            }
            Err(inventory::Error::InUse {
                gpu,
                processes,
                holders,
            }) => {
                crash_point!(self, AfterMigModeRefused);
                // Asked while the GPU was in the other mode (else nothing was asked).
                self.withdraw(&gpu, !enable).await;
                // The backend's, then the inventory's read made after the refusal.
                let mut found = holders;
                if let Ok(inv) = self.snapshot().await
                    && let Some(g) = inv.gpu_by_uuid(gpu.as_str())
                {
                    found.extend(g.mig.holders.iter().cloned());
                }
                let holders = in_use_holders(&processes, &found);
                let claims = self.inner.ledger.read(|c| c.claims.clone());
                let described = describe_holders(&holders, &claims, |pid| {
                    crate::metrics::attribution::pod_uid_of(
                        self.inner
                            .opts
                            .proc_root
                            .as_deref()
                            .unwrap_or(std::path::Path::new("/proc")),
                        pid,
                    )
                });
                if self
                    .inner
                    .switch_blocks
                    .set(&gpu, SwitchBlock::InUse { holders })
                {
                    tracing::warn!(gpu.uuid = %gpu, holders = %described, "MIG mode switch refused (IN_USE); the GPU's devices that need a switch are published tainted until the holders are gone");
                }
                Err(ClaimError::MigModeInUse {
                    gpu: self.gpu_name(&gpu).await,
                    mode: on_off(enable),
                    processes: described,
                })
            }
            Err(inventory::Error::ResetRequired {
                gpu,
                current,
                pending,
            }) => {
                crash_point!(self, AfterMigModeRefused);
                self.withdraw(&gpu, current).await;
                if self
                    .inner
                    .switch_blocks
                    .set(&gpu, SwitchBlock::ResetRequired)
                {
                    tracing::warn!(gpu.uuid = %gpu, mig.mode = on_off(current), "MIG mode switch answered RESET_REQUIRED (withdrawn): nvdra no longer switches this GPU's MIG mode until it restarts; it is published as a GPU whose MIG mode is the operator's");
                }
                Err(ClaimError::MigResetRequired {
                    gpu: self.gpu_name(&gpu).await,
                    current: on_off(current),
                    pending: on_off(pending),
                })
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Withdraws `gpu`'s pending MIG mode change: asking for the current mode activates
    /// nothing (nvml.h). Whether it went through; a failure is logged, and the change is
    /// withdrawn at the next prepare, inventory read or start. The caller holds the GPU's lock.
    async fn withdraw(&self, gpu: &GpuUuid, current: bool) -> bool {
        let g = gpu.clone();
        let r = self
            .blocking(move |i| i.gpus.set_mig_mode(&g, current))
            .await;
        match r.and_then(|r| r.map_err(ClaimError::from)) {
            Ok(_) => {
                tracing::info!(gpu.uuid = %gpu, mig.mode = on_off(current), "pending MIG mode change withdrawn");
                true
            }
            Err(e) => {
                tracing::warn!(gpu.uuid = %gpu, error = %crate::report::chain(&e), "cannot withdraw the pending MIG mode change; tried again at the next prepare, inventory read or start");
                false
            }
        }
    }

    /// Withdraws the pending MIG mode change of every GPU of `inv` that nvdra switches
    /// ([`withdrawable`]); the GPUs it withdrew. Each is looked at again under its lock, so a
    /// prepare switching it is not raced.
    pub(super) async fn withdraw_pending(&self, inv: &Inventory) -> Vec<GpuUuid> {
        let dynamic = self.inner.opts.dynamic_mig;
        let pending: Vec<GpuUuid> = inv
            .gpus
            .iter()
            .filter(|g| withdrawable(dynamic, g))
            .map(|g| g.uuid.clone())
            .collect();
        let mut withdrawn = Vec::new();
        if pending.is_empty() {
            return withdrawn;
        }
        let _locks = self.lock_mig_gpus(pending.iter().cloned()).await;
        let now = match self.snapshot().await {
            Ok(now) => now,
            Err(e) => {
                tracing::warn!(error = %crate::report::chain(&e), "cannot read the inventory to withdraw pending MIG mode changes");
                return withdrawn;
            }
        };
        for gpu in pending {
            let Some(g) = now.gpu_by_uuid(gpu.as_str()) else {
                continue;
            };
            if withdrawable(dynamic, g) && self.withdraw(&gpu, g.mig.enabled).await {
                withdrawn.push(gpu);
            }
        }
        withdrawn
    }

    /// What an inventory read tells dynamic MIG: a pending change on a GPU nvdra switches is
    /// withdrawn (one a switch past its deadline left, once that call returned), and an
    /// `IN_USE` block whose GPU no process holds any more (none that
    /// [blocks a switch](Holder::blocks_switch)) is cleared, so its devices are offered again.
    /// Returns the GPUs whose block was cleared.
    pub async fn recheck_mig_switches(&self, inv: &Inventory) -> Vec<GpuUuid> {
        if !self.inner.opts.dynamic_mig {
            return Vec::new();
        }
        self.withdraw_pending(inv).await;
        let mut cleared = Vec::new();
        for (gpu, block) in self.inner.switch_blocks.all() {
            let SwitchBlock::InUse { holders } = block else {
                continue;
            };
            let Some(g) = inv.gpu_by_uuid(gpu.as_str()) else {
                continue;
            };
            if g.mig.holders.iter().any(Holder::blocks_switch) {
                continue;
            }
            if self.inner.switch_blocks.clear(&gpu) {
                let was: Vec<String> = holders.iter().map(Holder::to_string).collect();
                tracing::info!(gpu.uuid = %gpu, holders = %was.join(", "), "the processes that kept the GPU's MIG mode from switching are gone; its devices are offered again");
                cleared.push(gpu);
            }
        }
        cleared
    }

    /// Dynamic MIG's watch of the inventory owner's publications
    /// ([`Plugin::recheck_mig_switches`] on each) until `shutdown`.
    pub async fn watch_mig_switches(
        self,
        mut inventory: crate::inventory::owner::Watch,
        shutdown: CancellationToken,
    ) {
        loop {
            tokio::select! {
                biased;
                () = shutdown.cancelled() => return,
                changed = inventory.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    let inv = inventory.borrow_and_update().node.clone();
                    if let Some(inv) = inv {
                        self.recheck_mig_switches(&inv).await;
                    }
                }
            }
        }
    }

    /// Waits until none of nvdra's own MPS daemons or servers is left on `gpu` (on `mig`
    /// alone, when given: what destroying that MIG device needs), up to [`OWN_MPS_EXIT`]: a
    /// daemon this process released that the MPS host has not removed yet, and (for the whole
    /// GPU) an MPS process the inventory finds holding it ([`HolderKind::OwnMps`]). `action`
    /// names what waits, for the error past the bound.
    pub(super) async fn wait_own_mps(
        &self,
        gpu: &GpuUuid,
        mig: Option<&MigUuid>,
        action: &str,
    ) -> Result<(), ClaimError> {
        let start = tokio::time::Instant::now();
        let mut waited = false;
        loop {
            // The holders come from the owner's reads: after the first look, a fresh one.
            let left = self.own_mps_left(gpu, mig, waited).await?;
            if left.is_empty() {
                if waited {
                    tracing::info!(gpu.uuid = %gpu, waited = ?start.elapsed(), "nvdra's own MPS daemon and server exited; going on to {action}");
                }
                return Ok(());
            }
            if start.elapsed() >= OWN_MPS_EXIT {
                return Err(ClaimError::OwnMpsLeft {
                    action: action.to_string(),
                    gpu: self.gpu_name(gpu).await,
                    left: left.join(", "),
                    waited: start.elapsed(),
                });
            }
            if !waited {
                tracing::info!(gpu.uuid = %gpu, left = %left.join(", "), "waiting for nvdra's own MPS daemon and server to exit before it can {action}");
                waited = true;
            }
            tokio::time::sleep(OWN_MPS_POLL).await;
        }
    }

    /// What [`Plugin::wait_own_mps`] waits for, named; from a `fresh` read of the hardware or
    /// the latest.
    async fn own_mps_left(
        &self,
        gpu: &GpuUuid,
        mig: Option<&MigUuid>,
        fresh: bool,
    ) -> Result<Vec<String>, ClaimError> {
        let (devices, holders) = match mig {
            Some(m) => (vec![m.to_string()], Vec::new()),
            None => {
                let inv = match fresh {
                    true => self.inner.gpus.refresh().await?,
                    false => self.snapshot().await?,
                };
                match inv.gpu_by_uuid(gpu.as_str()) {
                    Some(g) => (
                        std::iter::once(gpu.to_string())
                            .chain(g.mig.devices.iter().map(|d| d.uuid.to_string()))
                            .collect(),
                        g.mig
                            .holders
                            .iter()
                            .filter(|h| h.kind == HolderKind::OwnMps)
                            .map(|h| h.to_string())
                            .collect(),
                    ),
                    None => (vec![gpu.to_string()], Vec::new()),
                }
            }
        };
        let quitting = self
            .blocking(move |i| {
                let devices: Vec<&str> = devices.iter().map(String::as_str).collect();
                i.mps.quitting(&devices)
            })
            .await?;
        Ok(quitting
            .into_iter()
            .map(|id| format!("daemon {id}, its directory not yet removed"))
            .chain(holders)
            .collect())
    }

    /// `gpu-<minor> (<uuid>)`, or the UUID where the inventory cannot tell.
    async fn gpu_name(&self, gpu: &GpuUuid) -> String {
        match self.snapshot().await {
            Ok(inv) => match inv.gpu_by_uuid(gpu.as_str()) {
                Some(g) => format!("gpu-{} ({gpu})", g.minor),
                None => gpu.to_string(),
            },
            Err(_) => gpu.to_string(),
        }
    }
}

fn dedup(mut gpus: Vec<GpuUuid>) -> Vec<GpuUuid> {
    gpus.sort();
    gpus.dedup();
    gpus
}

/// Whether nvdra withdraws `g`'s pending MIG mode change (`dynamic`: `--dynamic-mig`): one
/// on a GPU it would switch but for that change (Hopper and later, where a change is applied
/// at once or refused, so one left pending is a refused one). Before Hopper a pending change
/// waits for the reset the operator asked for, and stays.
pub(super) fn withdrawable(dynamic: bool, g: &Gpu) -> bool {
    dynamic && matches!(g.mig_toggle(), Err(NoMigToggle::Pending { .. }))
}

/// The holders of an `IN_USE` answer: the processes NVML named and those the inventory's scan
/// found holding the GPU (`found`), each once, named where the scan read its name; the harmless
/// ones (`nvidia-persistenced`) are left out.
pub(super) fn in_use_holders(processes: &[u32], found: &[Holder]) -> Vec<Holder> {
    let mut holders: BTreeMap<u32, Holder> = BTreeMap::new();
    for h in found.iter().filter(|h| h.kind != HolderKind::Harmless) {
        match holders.get(&h.pid) {
            Some(known) if !known.name.is_empty() => {}
            _ => {
                holders.insert(h.pid, h.clone());
            }
        }
    }
    for &pid in processes {
        if found.iter().any(|h| h.pid == pid) {
            continue;
        }
        holders.entry(pid).or_insert_with(|| Holder {
            pid,
            name: String::new(),
            kind: HolderKind::Foreign,
        });
    }
    holders.into_values().collect()
}

/// The pod of process `pid` where its cgroup names one (`pod_of`): by name when a claim in
/// `claims` was prepared for that pod, else by UID.
fn pod_of_pid(
    pid: u32,
    claims: &BTreeMap<ClaimUid, ClaimEntry>,
    pod_of: &impl Fn(u32) -> Option<String>,
) -> Option<String> {
    let uid = pod_of(pid)?;
    let named = claims.values().find_map(|e| {
        e.pods
            .iter()
            .find(|p| p.uid == uid)
            .map(|p| format!("{}/{}", e.namespace, p.name))
    });
    Some(match named {
        Some(pod) => format!("pod {pod}"),
        None => format!("pod UID {uid}"),
    })
}

/// The processes in the way of a MIG mode change, each with its name where known and its pod
/// where its cgroup names one (`pod_of`; by name when a claim in `claims` was prepared for that
/// pod, else by UID): `pid 7 (nv-hostengine), pid 10 (python, pod ml/train-0)`.
pub(super) fn describe_holders(
    holders: &[Holder],
    claims: &BTreeMap<ClaimUid, ClaimEntry>,
    pod_of: impl Fn(u32) -> Option<String>,
) -> String {
    if holders.is_empty() {
        return "(NVML named none)".into();
    }
    holders
        .iter()
        .map(|h| {
            let notes: Vec<String> = (!h.name.is_empty())
                .then(|| h.name.clone())
                .into_iter()
                .chain(pod_of_pid(h.pid, claims, &pod_of))
                .collect();
            if notes.is_empty() {
                format!("pid {}", h.pid)
            } else {
                format!("pid {} ({})", h.pid, notes.join(", "))
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::{ClaimState, PodRef};

    #[test]
    fn processes_are_named_with_their_pods_where_known() {
        let mut claims = BTreeMap::new();
        claims.insert(
            ClaimUid::parse("c1").unwrap(),
            ClaimEntry {
                state: ClaimState::PrepareCompleted,
                namespace: "ml".into(),
                name: "c".into(),
                devices: vec![],
                pods: vec![PodRef {
                    name: "train-0".into(),
                    uid: "u-1".into(),
                }],
                user: None,
                trust_label: None,
            },
        );
        let pod_of = |pid| match pid {
            10 => Some("u-1".to_string()),
            11 => Some("u-2".to_string()),
            _ => None,
        };
        let unnamed: Vec<Holder> = [10, 11, 12]
            .into_iter()
            .map(|pid| Holder {
                pid,
                name: String::new(),
                kind: HolderKind::Foreign,
            })
            .collect();
        assert_eq!(
            describe_holders(&unnamed, &claims, pod_of),
            "pid 10 (pod ml/train-0), pid 11 (pod UID u-2), pid 12"
        );
        assert_eq!(describe_holders(&[], &claims, pod_of), "(NVML named none)");
    }

    #[test]
    fn in_use_holders_join_nvmls_pids_and_the_scan_naming_each_once() {
        let holder = |pid: u32, name: &str, kind| Holder {
            pid,
            name: name.into(),
            kind,
        };
        let found = [
            holder(12, "", HolderKind::Foreign),
            holder(12, "nv-hostengine", HolderKind::Foreign),
            holder(13, "nvidia-persistenced", HolderKind::Harmless),
            holder(14, "nvidia-cuda-mps-server", HolderKind::OwnMps),
        ];
        let holders = in_use_holders(&[11, 12, 13], &found);
        assert_eq!(
            holders,
            vec![
                holder(11, "", HolderKind::Foreign),
                holder(12, "nv-hostengine", HolderKind::Foreign),
                holder(14, "nvidia-cuda-mps-server", HolderKind::OwnMps),
            ],
            "13 is harmless, though NVML named it"
        );
        let claims = BTreeMap::new();
        let pod_of = |pid| (pid == 11).then(|| "u-9".to_string());
        assert_eq!(
            describe_holders(&holders, &claims, pod_of),
            "pid 11 (pod UID u-9), pid 12 (nv-hostengine), pid 14 (nvidia-cuda-mps-server)"
        );
    }
}
