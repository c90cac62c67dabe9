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

use std::sync::Arc;

use tokio::sync::OwnedMutexGuard;

use super::{ClaimError, Plugin, crash_point};
use crate::ids::ClaimUid;
use crate::inventory::{self, GpuUuid, Inventory, MigModeChange, on_off};
use crate::ledger::{ClaimEntry, DeviceRecord};
use std::collections::BTreeMap;

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
    /// any MIG device is on it (nvdra keeps instances it did not create).
    pub(super) async fn switch_mig_modes(
        &self,
        uid: &ClaimUid,
        modes: &[(GpuUuid, bool)],
        devices: &[DeviceRecord],
    ) -> Result<(), ClaimError> {
        for (gpu, enable) in modes {
            if !*enable {
                let inv = self.snapshot().await?;
                if let Some(g) = inv.gpu_by_uuid(gpu.as_str())
                    && !g.mig.devices.is_empty()
                {
                    let device = devices
                        .iter()
                        .find(|d| d.gpu == *gpu)
                        .map_or_else(|| gpu.to_string(), |d| d.device.to_string());
                    return Err(ClaimError::MigDevicesLeft {
                        device,
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
            let changed = self.set_mig_mode(gpu, *enable).await?;
            if changed == MigModeChange::Applied {
                tracing::info!(claim.uid = %uid, gpu.uuid = %gpu, mig.mode = on_off(*enable), "MIG mode switched");
                self.inventory_changed();
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
        {
            return Ok(false);
        }
        let changed = self.set_mig_mode(gpu, false).await?;
        self.inner.ledger.update_mig_enabled(|s| s.remove(gpu));
        if changed == MigModeChange::Applied {
            self.inventory_changed();
        }
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

    /// `backend.set_mig_mode`, its refusals as what the kubelet should hear.
    async fn set_mig_mode(&self, gpu: &GpuUuid, enable: bool) -> Result<MigModeChange, ClaimError> {
        let g = gpu.clone();
        let r = self
            .blocking(move |i| i.backend.set_mig_mode(&g, enable))
            .await?;
        match r {
            Ok(c) => Ok(c),
            Err(inventory::Error::InUse { gpu, processes, .. }) => {
                let claims = self.inner.ledger.read(|c| c.claims.clone());
                let processes = describe_processes(&processes, &claims, |pid| {
                    crate::metrics::attribution::pod_uid_of(std::path::Path::new("/proc"), pid)
                });
                Err(ClaimError::MigModeInUse {
                    gpu: self.gpu_name(&gpu).await,
                    mode: on_off(enable),
                    processes,
                })
            }
            Err(inventory::Error::ResetRequired {
                gpu,
                current,
                pending,
            }) => Err(ClaimError::MigResetRequired {
                gpu: self.gpu_name(&gpu).await,
                current: on_off(current),
                pending: on_off(pending),
            }),
            Err(e) => Err(e.into()),
        }
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

/// The processes in the way of a MIG mode change, each with its pod where its cgroup names one
/// (`pod_of`): by name when a claim in `claims` was prepared for that pod, else by UID.
pub(super) fn describe_processes(
    pids: &[u32],
    claims: &BTreeMap<ClaimUid, ClaimEntry>,
    pod_of: impl Fn(u32) -> Option<String>,
) -> String {
    if pids.is_empty() {
        return "(NVML named none)".into();
    }
    pids.iter()
        .map(|&pid| match pod_of(pid) {
            None => format!("pid {pid}"),
            Some(uid) => {
                let named = claims.values().find_map(|e| {
                    e.pods
                        .iter()
                        .find(|p| p.uid == uid)
                        .map(|p| format!("{}/{}", e.namespace, p.name))
                });
                match named {
                    Some(pod) => format!("pid {pid} (pod {pod})"),
                    None => format!("pid {pid} (pod UID {uid})"),
                }
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
            },
        );
        let pod_of = |pid| match pid {
            10 => Some("u-1".to_string()),
            11 => Some("u-2".to_string()),
            _ => None,
        };
        assert_eq!(
            describe_processes(&[10, 11, 12], &claims, pod_of),
            "pid 10 (pod ml/train-0), pid 11 (pod UID u-2), pid 12"
        );
        assert_eq!(
            describe_processes(&[], &claims, pod_of),
            "(NVML named none)"
        );
    }
}
