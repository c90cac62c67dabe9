//! What the health monitor (`crate::health`) knows of the node's GPUs, and how it is laid over
//! an inventory ([`HealthState::apply`]): the types live here so that the inventory owner
//! publishes the node with its health applied without importing the monitor.

use std::collections::BTreeMap;
use std::fmt;

use tokio::time::Instant;

use super::{GpuUuid, Health, Inventory, MigUuid, Taint, TaintEffect, TaintKey};

/// The XID NVIDIA's driver logs for a double-bit ECC error; that event is tainted as this XID.
pub const XID_DOUBLE_BIT_ECC: u64 = 48;
/// The XID of a GPU that fell off the bus; its rule also decides the effect of a lost GPU.
pub const XID_FALLEN_OFF_BUS: u64 = 79;

/// Why a GPU is unhealthy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Cause {
    Xid(u64),
    DoubleBitEcc,
    GpuLost,
    Unmonitored(String),
}

impl Cause {
    /// The taint key this cause is published under.
    pub fn taint_key(&self) -> TaintKey {
        match self {
            Cause::Xid(x) => TaintKey::Xid(*x),
            Cause::DoubleBitEcc => TaintKey::Xid(XID_DOUBLE_BIT_ECC),
            Cause::GpuLost => TaintKey::GpuLost,
            Cause::Unmonitored(_) => TaintKey::Unmonitored,
        }
    }

    /// The XID behind the cause, where there is one.
    pub fn xid(&self) -> Option<u64> {
        match self {
            Cause::Xid(x) => Some(*x),
            Cause::DoubleBitEcc => Some(XID_DOUBLE_BIT_ECC),
            Cause::GpuLost | Cause::Unmonitored(_) => None,
        }
    }
}

impl fmt::Display for Cause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Cause::Xid(x) => match xid_name(*x) {
                Some(name) => write!(f, "XID {x} ({name})"),
                None => write!(f, "XID {x}"),
            },
            Cause::DoubleBitEcc => f.write_str("double-bit ECC error"),
            Cause::GpuLost => f.write_str("GPU lost: it no longer answers NVML"),
            Cause::Unmonitored(reason) => write!(f, "health events cannot be watched: {reason}"),
        }
    }
}

/// The name of the XIDs a GPU operator most often meets (NVIDIA's XID catalog).
fn xid_name(xid: u64) -> Option<&'static str> {
    Some(match xid {
        13 => "graphics engine exception",
        31 => "GPU memory page fault",
        43 => "GPU stopped processing",
        45 => "preemptive cleanup",
        48 => "double-bit ECC error",
        63 => "ECC page retirement or row remapping event",
        64 => "ECC page retirement or row remapping failure",
        68 => "video processor exception",
        74 => "NVLink error",
        79 => "GPU has fallen off the bus",
        92 => "high single-bit ECC error rate",
        94 => "contained ECC error",
        95 => "uncontained ECC error",
        109 => "context switch timeout",
        119 | 120 => "GSP error",
        _ => return None,
    })
}

/// What one GPU's failure looks like to consumers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fault {
    pub cause: Cause,
    /// The XID behind the cause, where there is one.
    pub xid: Option<u64>,
    pub effect: TaintEffect,
    /// When the GPU became unhealthy.
    pub since: Instant,
}

impl Fault {
    pub fn taint(&self) -> Taint {
        Taint {
            key: self.cause.taint_key(),
            effect: self.effect,
        }
    }
}

/// The health of one GPU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GpuHealth {
    Healthy,
    Unhealthy(Fault),
}

/// The fault of one MIG device: an event NVML attributed to its GPU instance (or compute
/// instance).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MigFault {
    /// The GPU the device is on.
    pub gpu: GpuUuid,
    /// The instance ids of the first event that hit it.
    pub gpu_instance: u32,
    pub compute_instance: Option<u32>,
    pub fault: Fault,
}

impl MigFault {
    /// The fault's cause and where it was seen, e.g. `XID 94 (contained ECC error) in GPU
    /// instance 3, compute instance 0`.
    pub fn reason(&self) -> String {
        let mut out = format!("{} in GPU instance {}", self.fault.cause, self.gpu_instance);
        if let Some(ci) = self.compute_instance {
            out.push_str(&format!(", compute instance {ci}"));
        }
        out
    }
}

/// The health of every GPU and MIG device the monitor has heard about; those absent are
/// healthy.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HealthState {
    pub(crate) faults: BTreeMap<GpuUuid, Fault>,
    /// Faults of single MIG devices (see the module doc); a device that no longer exists lays
    /// nothing over an inventory, and the monitor forgets it at its next probe.
    pub(crate) mig_faults: BTreeMap<MigUuid, MigFault>,
    /// GPUs whose share daemon does not answer (reported by the plugin's daemon watch, through
    /// `health::MonitorHandle::report_share_daemons`).
    pub(crate) daemons_down: DaemonsDown,
    /// The daemon watch's last round: each GPU and MIG device with shares it asked, and whether
    /// its daemon answered (`nvdra_mps_daemon_up`). Lays nothing over an inventory.
    pub(crate) daemons_asked: DaemonsAsked,
}

/// The GPUs and MIG devices whose MPS share daemon does not answer, each with when it was first
/// seen down.
pub type DaemonsDown = BTreeMap<super::DeviceUuid, std::time::SystemTime>;

/// The GPUs and MIG devices with shares, and whether each one's MPS share daemon answered.
pub type DaemonsAsked = BTreeMap<super::DeviceUuid, bool>;

impl HealthState {
    pub fn gpu(&self, uuid: &GpuUuid) -> GpuHealth {
        match self.faults.get(uuid) {
            Some(f) => GpuHealth::Unhealthy(f.clone()),
            None => GpuHealth::Healthy,
        }
    }

    /// The unhealthy GPUs.
    pub fn faults(&self) -> impl Iterator<Item = (&GpuUuid, &Fault)> {
        self.faults.iter()
    }

    /// The fault of one MIG device, where an event attributed to its instance made one.
    pub fn mig(&self, uuid: &MigUuid) -> Option<&MigFault> {
        self.mig_faults.get(uuid)
    }

    /// The MIG devices with a fault of their own.
    pub fn mig_faults(&self) -> impl Iterator<Item = (&MigUuid, &MigFault)> {
        self.mig_faults.iter()
    }

    pub fn is_empty(&self) -> bool {
        self.faults.is_empty() && self.mig_faults.is_empty() && self.daemons_down.is_empty()
    }

    /// The GPUs whose share daemon does not answer.
    pub fn daemons_down(&self) -> &DaemonsDown {
        &self.daemons_down
    }

    /// Lays this state over `inv`: every GPU with a fault becomes [`Health::Tainted`] with the
    /// fault's cause as the reason (a GPU the backend already knows as withdrawn stays so); a
    /// GPU without one whose share daemon does not answer is tainted
    /// [`TaintKey::MpsDaemonDown`] `NoSchedule` (one taint per device: a fault's wins), and so
    /// is a healthy MIG device whose share daemon does not answer.
    /// Its MIG devices and replicas follow it where devices are derived.
    ///
    /// A MIG device with a fault of its own ([`MigFault`]) is tainted with it, and so is every
    /// other MIG device of its GPU on any of its memory slices (the reason names the device hit);
    /// other MIG devices, and the GPU itself, are not. A fault whose device is not in `inv` (its
    /// instance destroyed) lays nothing.
    pub fn apply(&self, inv: &mut Inventory) {
        let daemon_down = || Health::Tainted {
            reason: "the MPS control daemon of its shares does not answer".into(),
            taint: Taint {
                key: TaintKey::MpsDaemonDown,
                effect: TaintEffect::NoSchedule,
            },
        };
        for g in &mut inv.gpus {
            if g.health.is_withdrawn() {
                continue;
            }
            // The MIG devices of this GPU hit by a fault of their own, with their slices.
            let hit: Vec<(super::Placement, &MigUuid, &MigFault)> = g
                .mig
                .devices
                .iter()
                .filter_map(|m| {
                    let (uuid, f) = self.mig_faults.get_key_value(&m.uuid)?;
                    Some((m.placement, uuid, f))
                })
                .collect();
            for m in &mut g.mig.devices {
                if m.health.is_withdrawn() {
                    continue;
                }
                let key = super::DeviceUuid::Mig(m.uuid.clone());
                if let Some(f) = self.mig_faults.get(&m.uuid) {
                    m.health = Health::Tainted {
                        reason: f.reason(),
                        taint: f.fault.taint(),
                    };
                } else if let Some((_, uuid, f)) =
                    hit.iter().find(|(p, _, _)| p.overlaps(&m.placement))
                {
                    m.health = Health::Tainted {
                        reason: format!(
                            "{}, on MIG device {uuid}, which shares its memory slices",
                            f.reason()
                        ),
                        taint: f.fault.taint(),
                    };
                } else if m.health.is_healthy() && self.daemons_down.contains_key(&key) {
                    m.health = daemon_down();
                }
            }
            if let Some(f) = self.faults.get(&g.uuid) {
                g.health = Health::Tainted {
                    reason: f.cause.to_string(),
                    taint: f.taint(),
                };
            } else if self
                .daemons_down
                .contains_key(&super::DeviceUuid::Gpu(g.uuid.clone()))
            {
                g.health = daemon_down();
            }
        }
    }
}
