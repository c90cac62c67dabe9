//! The GPU health monitor: one task that hears every health event of the node and publishes the
//! health of each GPU through a `tokio::sync::watch` channel, which the inventory owner follows
//! (every consumer reads the node's health in the owner's publication).
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
//! The monitor publishes its state on a watch the inventory owner follows
//! ([`crate::inventory::owner`]): the owner lays it over its last read
//! ([`HealthState::apply`]: [`Health::Tainted`](crate::inventory::Health::Tainted), published with
//! a device taint instead of withdrawn) and publishes the node again, so every consumer sees one
//! inventory with its health.

pub mod faults;
mod monitor;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use tokio::sync::watch;

use crate::inventory::TaintEffect;

pub use crate::inventory::events::{Event, EventKind, Instance};
pub use crate::inventory::health::{
    Cause, DaemonsAsked, DaemonsDown, Fault, GpuHealth, HealthState, MigFault, XID_DOUBLE_BIT_ECC,
    XID_FALLEN_OFF_BUS,
};
pub use monitor::{Monitor, MonitorHandle, Probe, XidCounts};

/// XIDs that are the application's fault, not the GPU's (NVIDIA's device plugin ignores the
/// same): 13 graphics engine exception, 31 GPU memory page fault, 43 GPU stopped processing,
/// 45 preemptive cleanup, 68 video processor exception, 109 context switch timeout.
pub const DEFAULT_IGNORED_XIDS: [u64; 6] = [13, 31, 43, 45, 68, 109];
/// How long an unhealthy GPU must stay free of critical events before it is healthy again.
pub const DEFAULT_QUIET_PERIOD: Duration = Duration::from_secs(300);
/// How often unhealthy GPUs are re-probed.
pub const DEFAULT_PROBE_INTERVAL: Duration = Duration::from_secs(30);
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

#[cfg(test)]
mod tests;
