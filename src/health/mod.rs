//! The GPU health monitor: one task that hears every health event of the node and publishes the
//! health of each GPU through a `tokio::sync::watch` channel that every consumer subscribes to
//! (the DRA health stream, the ResourceSlice sync, the device plugin's `ListAndWatch`).
//!
//! Sources send [`Event`]s: the NVML event thread (`inventory::nvml::events`: critical XIDs,
//! double-bit ECC, GPUs lost) or, for simulated GPUs, the fault file ([`faults`]). The monitor
//! ([`Monitor`]) classifies each event by the [`Policy`] (an ignore list, default 13, 31, 43, 45,
//! 68, 109 — application errors — and per-XID overrides), marks the GPU unhealthy with its cause,
//! and re-probes each unhealthy GPU on a schedule: a GPU whose probe succeeds and that saw no
//! critical event for the quiet period is healthy again. Each transition is logged once, with its
//! cause.
//!
//! Invariants:
//! - The state is per physical GPU, and per MIG device for the events NVML attributes to one
//!   MIG instance. What a GPU carries follows it: its MIG devices and its replicas are exactly
//!   as healthy as it is, wherever the inventory is turned into devices.
//! - An XID that NVML attributes to a GPU instance (the event's `gpuInstanceId`, and its
//!   `computeInstanceId` where set) is a fault of the MIG devices that instance had when the
//!   event was read ([`MigFault`], keyed by MIG UUID), not of the GPU: it taints those devices
//!   and every other MIG device on the same memory slices (another compute instance of the same
//!   GPU instance), nothing else. A GPU-wide event (no instance id), and one naming an instance
//!   the source found no MIG device for, taints the GPU. A per-instance fault ends when its
//!   device is gone (the instance destroyed: MIG UUIDs are made anew at each creation, so one
//!   made later on the same placement or with the same ids starts healthy), or by the GPU's own
//!   recovery rule (probe and quiet period).
//! - An event about one GPU changes only that GPU; a source that cannot watch one GPU reports
//!   that GPU alone ([`Cause::Unmonitored`]), never the node.
//! - The watch changes only when some GPU's health changes: a repeated event on a GPU already
//!   unhealthy postpones its recovery but wakes no consumer.
//!
//! Consumers read health through [`Monitored`], a backend wrapper that lays the state over every
//! snapshot as [`Health::Tainted`] (published with a device taint instead of withdrawn), so the
//! slice, stream and device-plugin code stay functions of one inventory.

pub mod faults;
mod monitor;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use crate::inventory::{
    self, DeviceBackend, GpuUuid, Health, Inventory, MigUuid, Taint, TaintEffect, TaintKey,
};

pub use crate::inventory::events::{Event, EventKind, Instance};
pub use monitor::{BackendProbe, Monitor, MonitorHandle, Probe, XidCounts};

/// XIDs that are the application's fault, not the GPU's (NVIDIA's device plugin ignores the
/// same): 13 graphics engine exception, 31 GPU memory page fault, 43 GPU stopped processing,
/// 45 preemptive cleanup, 68 video processor exception, 109 context switch timeout.
pub const DEFAULT_IGNORED_XIDS: [u64; 6] = [13, 31, 43, 45, 68, 109];
/// How long an unhealthy GPU must stay free of critical events before it is healthy again.
pub const DEFAULT_QUIET_PERIOD: Duration = Duration::from_secs(300);
/// How often unhealthy GPUs are re-probed.
pub const DEFAULT_PROBE_INTERVAL: Duration = Duration::from_secs(30);
/// The XID NVIDIA's driver logs for a double-bit ECC error; that event is tainted as this XID.
pub const XID_DOUBLE_BIT_ECC: u64 = 48;
/// The XID of a GPU that fell off the bus; its rule also decides the effect of a lost GPU.
pub const XID_FALLEN_OFF_BUS: u64 = 79;

/// Errors of health settings, each naming the offending value.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Error {
    #[error("{0:?} is not an XID (a whole number)")]
    BadXid(String),
    #[error(
        "{0:?} is not an XID override; write XID=ignore, XID=NoSchedule or XID=NoExecute (e.g. 94=ignore)"
    )]
    BadOverride(String),
    #[error("{0:?} is not a duration; write e.g. 500ms, 30s, 5m or 1h")]
    BadDuration(String),
}

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
    faults: BTreeMap<GpuUuid, Fault>,
    /// Faults of single MIG devices (see the module doc); a device that no longer exists lays
    /// nothing over an inventory, and the monitor forgets it at its next probe.
    mig_faults: BTreeMap<MigUuid, MigFault>,
    /// GPUs whose share daemon does not answer (reported by the plugin's daemon watch, through
    /// [`MonitorHandle::report_share_daemons`]).
    daemons_down: DaemonsDown,
}

/// The GPUs and MIG devices whose MPS share daemon does not answer, each with when it was first
/// seen down.
pub type DaemonsDown = BTreeMap<crate::inventory::DeviceUuid, std::time::SystemTime>;

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
            let hit: Vec<(inventory::Placement, &MigUuid, &MigFault)> = g
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
                let key = crate::inventory::DeviceUuid::Mig(m.uuid.clone());
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
                .contains_key(&crate::inventory::DeviceUuid::Gpu(g.uuid.clone()))
            {
                g.health = daemon_down();
            }
        }
    }
}

/// A subscription to the monitor's state.
pub type Watch = watch::Receiver<HealthState>;

/// `Some` when the monitor's state changed; never ready without a watch or once the monitor is
/// gone. For a `select!` branch of a consumer that re-reads on every transition.
pub async fn changed(health: &mut Option<Watch>) -> Option<()> {
    if let Some(h) = health
        && h.changed().await.is_ok()
    {
        return Some(());
    }
    std::future::pending().await
}

/// What an XID does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum XidRule {
    Ignore,
    Critical(TaintEffect),
}

/// How events are judged and how GPUs recover.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Policy {
    pub ignored: BTreeSet<u64>,
    /// Per-XID rules; they win over `ignored`.
    pub overrides: BTreeMap<u64, XidRule>,
    pub quiet_period: Duration,
    pub probe_interval: Duration,
}

impl Default for Policy {
    fn default() -> Self {
        Self {
            ignored: DEFAULT_IGNORED_XIDS.into_iter().collect(),
            overrides: BTreeMap::new(),
            quiet_period: DEFAULT_QUIET_PERIOD,
            probe_interval: DEFAULT_PROBE_INTERVAL,
        }
    }
}

impl Policy {
    /// The rule for `xid`: its override, else ignored if listed, else critical (NoSchedule).
    pub fn rule(&self, xid: u64) -> XidRule {
        match self.overrides.get(&xid) {
            Some(r) => *r,
            None if self.ignored.contains(&xid) => XidRule::Ignore,
            None => XidRule::Critical(TaintEffect::NoSchedule),
        }
    }

    /// The fault `kind` makes, or `None` when it is ignored. A lost GPU is never ignored; it
    /// takes the effect of XID 79's rule (fallen off the bus) when that is critical.
    pub fn judge(&self, kind: &EventKind) -> Option<(Cause, TaintEffect)> {
        let effect_of = |xid| match self.rule(xid) {
            XidRule::Critical(e) => e,
            XidRule::Ignore => TaintEffect::NoSchedule,
        };
        match kind {
            EventKind::Xid(x) => match self.rule(*x) {
                XidRule::Ignore => None,
                XidRule::Critical(e) => Some((Cause::Xid(*x), e)),
            },
            EventKind::DoubleBitEcc => match self.rule(XID_DOUBLE_BIT_ECC) {
                XidRule::Ignore => None,
                XidRule::Critical(e) => Some((Cause::DoubleBitEcc, e)),
            },
            EventKind::GpuLost => Some((Cause::GpuLost, effect_of(XID_FALLEN_OFF_BUS))),
            EventKind::Unmonitored(r) => {
                Some((Cause::Unmonitored(r.clone()), TaintEffect::NoSchedule))
            }
        }
    }
}

/// Parses a comma-separated XID list (`13,31,43`); empty means none.
pub fn parse_xids(s: &str) -> Result<BTreeSet<u64>, Error> {
    s.split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(|t| t.parse().map_err(|_| Error::BadXid(t.to_string())))
        .collect()
}

/// Parses `XID=ignore|NoSchedule|NoExecute,...`; empty means none.
pub fn parse_overrides(s: &str) -> Result<BTreeMap<u64, XidRule>, Error> {
    let mut out = BTreeMap::new();
    for entry in s.split(',').map(str::trim).filter(|t| !t.is_empty()) {
        let bad = || Error::BadOverride(entry.to_string());
        let (xid, rule) = entry.split_once('=').ok_or_else(bad)?;
        let xid: u64 = xid.trim().parse().map_err(|_| bad())?;
        let rule = match rule.trim().to_ascii_lowercase().as_str() {
            "ignore" => XidRule::Ignore,
            "noschedule" | "critical" => XidRule::Critical(TaintEffect::NoSchedule),
            "noexecute" => XidRule::Critical(TaintEffect::NoExecute),
            _ => return Err(bad()),
        };
        out.insert(xid, rule);
    }
    Ok(out)
}

/// Parses `500ms`, `30s`, `5m`, `1h` (a bare number is seconds).
pub fn parse_duration(s: &str) -> Result<Duration, Error> {
    let t = s.trim();
    let bad = || Error::BadDuration(s.to_string());
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (n, unit) = t.split_at(split);
    let n: u64 = n.parse().map_err(|_| bad())?;
    Ok(match unit {
        "ms" => Duration::from_millis(n),
        "" | "s" => Duration::from_secs(n),
        "m" => Duration::from_secs(n.checked_mul(60).ok_or_else(bad)?),
        "h" => Duration::from_secs(n.checked_mul(3600).ok_or_else(bad)?),
        _ => return Err(bad()),
    })
}

/// A backend whose snapshots carry the monitor's health ([`HealthState::apply`]). Everything else
/// passes through.
pub struct Monitored {
    backend: Arc<dyn DeviceBackend>,
    health: Watch,
}

impl Monitored {
    pub fn new(backend: Arc<dyn DeviceBackend>, health: Watch) -> Self {
        Self { backend, health }
    }

    fn overlay(&self, mut inv: Inventory) -> Inventory {
        self.health.borrow().apply(&mut inv);
        inv
    }
}

// Named, not imported: elsewhere in this module (its tests included) `monitored.snapshot()` is
// `DeviceBackend::snapshot` alone, not ambiguous between the two traits.
impl inventory::Wrapper for Monitored {
    fn inner(&self) -> &dyn DeviceBackend {
        &*self.backend
    }

    fn snapshot(&self) -> inventory::Result<Inventory> {
        self.backend.snapshot().map(|inv| self.overlay(inv))
    }

    fn refresh(&self) -> inventory::Result<Inventory> {
        self.backend.refresh().map(|inv| self.overlay(inv))
    }

    /// The inner publication while there is nothing to lay over it (no fault, no daemon down):
    /// the common case of a prepare, which then copies nothing.
    fn published(&self) -> Option<Arc<Inventory>> {
        let health = self.health.borrow();
        if health.is_empty() {
            self.backend.published()
        } else {
            None
        }
    }
}

#[cfg(test)]
mod tests;
