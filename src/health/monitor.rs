//! The monitor task: events in, per-GPU and per-MIG-device health out, recovery by probe and
//! quiet period (and, for a MIG device, by its instance being destroyed).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::{
    Cause, DaemonsAsked, DaemonsDown, Event, EventKind, Fault, HealthState, Instance, MigFault,
    Policy, Watch,
};
use crate::inventory::owner::InventoryHandle;
use crate::inventory::{GpuUuid, MigUuid};
use crate::lock::lock;

/// How many events may wait for the monitor; a source blocks (NVML) or waits (async) beyond.
const QUEUE: usize = 256;

/// Asks whether a GPU answers again. Blocking (NVML); the monitor runs it on the blocking pool.
pub trait Probe: Send + Sync + 'static {
    /// `Err` with the reason when the GPU still does not answer.
    fn probe(&self, gpu: &GpuUuid) -> Result<(), String>;

    /// The UUIDs of every MIG device on the node now, so that the fault of a MIG device whose
    /// instance was destroyed ends; `None` when this probe cannot tell (such faults then end
    /// as a GPU's do, by probe and quiet period).
    fn mig_devices(&self) -> Option<BTreeSet<MigUuid>> {
        None
    }
}

/// Probes through the inventory owner (`nvdra run`): the hardware's probe under the owner's
/// deadline; its MIG devices are those of the latest publication (a probe reads no inventory).
impl Probe for InventoryHandle {
    fn probe(&self, gpu: &GpuUuid) -> Result<(), String> {
        InventoryHandle::probe(self, gpu)
    }

    fn mig_devices(&self) -> Option<BTreeSet<MigUuid>> {
        let inv = self.latest().node().ok()?;
        let migs = inv.gpus.iter().flat_map(|g| &g.mig.devices);
        Some(migs.map(|m| m.uuid.clone()).collect())
    }
}

/// How many XID events each GPU reported, by XID, since start: every one the monitor heard,
/// the ignored ones included (an application's XID 13 is worth counting, not tainting).
pub type XidCounts = BTreeMap<(GpuUuid, u64), u64>;

/// Where sources send events and consumers subscribe; cheap to clone.
#[derive(Clone)]
pub struct MonitorHandle {
    events: mpsc::Sender<Event>,
    state: watch::Receiver<HealthState>,
    xids: Arc<Mutex<XidCounts>>,
    daemons: Arc<watch::Sender<(DaemonsAsked, DaemonsDown)>>,
}

impl MonitorHandle {
    /// The sender sources use (`blocking_send` from a thread, `send` from a task).
    pub fn events(&self) -> mpsc::Sender<Event> {
        self.events.clone()
    }

    /// A new subscription; its first `changed()` fires on the next transition.
    pub fn subscribe(&self) -> Watch {
        self.state.clone()
    }

    /// The current state.
    pub fn state(&self) -> HealthState {
        self.state.borrow().clone()
    }

    /// A copy of the XID counts (see [`XidCounts`]).
    pub fn xid_counts(&self) -> XidCounts {
        lock(&self.xids).clone()
    }

    /// The daemon watch's round: each GPU and MIG device with shares it asked and whether its
    /// daemon answered, and those whose daemon does not answer now with since when (all of
    /// them: one left out is up). The state changes, and its subscribers wake, only when the
    /// round's answers do.
    pub fn report_share_daemons(&self, asked: DaemonsAsked, down: DaemonsDown) {
        let round = (asked, down);
        self.daemons.send_if_modified(|d| {
            let modified = *d != round;
            *d = round;
            modified
        });
    }
}

/// What the monitor keeps per unhealthy GPU (or MIG device) beyond what it publishes.
struct Tracked<F> {
    fault: F,
    /// The last critical event: recovery waits for the quiet period after it.
    last_event: Instant,
}

/// The monitor task; see the module doc.
pub struct Monitor {
    policy: Policy,
    probe: Arc<dyn Probe>,
    events: mpsc::Receiver<Event>,
    /// A sender of our own: sources may come and go without closing the channel.
    _own: mpsc::Sender<Event>,
    state: watch::Sender<HealthState>,
    tracked: BTreeMap<GpuUuid, Tracked<Fault>>,
    /// MIG devices with a fault of their own (an event attributed to their instance).
    tracked_mig: BTreeMap<MigUuid, Tracked<MigFault>>,
    xids: Arc<Mutex<XidCounts>>,
    /// What the share-daemon watch reports, laid into the state as it is.
    daemons: watch::Receiver<(DaemonsAsked, DaemonsDown)>,
}

impl Monitor {
    pub fn new(policy: Policy, probe: Arc<dyn Probe>) -> (Self, MonitorHandle) {
        let (tx, rx) = mpsc::channel(QUEUE);
        let (state, state_rx) = watch::channel(HealthState::default());
        let xids = Arc::new(Mutex::new(XidCounts::new()));
        let (daemons, daemons_rx) = watch::channel(Default::default());
        (
            Self {
                policy,
                probe,
                events: rx,
                _own: tx.clone(),
                state,
                tracked: BTreeMap::new(),
                tracked_mig: BTreeMap::new(),
                xids: xids.clone(),
                daemons: daemons_rx,
            },
            MonitorHandle {
                events: tx,
                state: state_rx,
                xids,
                daemons: Arc::new(daemons),
            },
        )
    }

    /// Runs until `shutdown`.
    pub async fn run(mut self, shutdown: CancellationToken) {
        let mut probe = tokio::time::interval(self.policy.probe_interval);
        probe.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        probe.tick().await;
        loop {
            tokio::select! {
                biased;
                () = shutdown.cancelled() => return,
                // `_own` keeps the channel open, so `None` cannot come.
                Some(ev) = self.events.recv() => self.on_event(ev),
                // The handle (and so the sender) lives as long as any consumer does.
                Ok(()) = self.daemons.changed() => self.publish(),
                _ = probe.tick() => self.probe_all().await,
            }
        }
    }

    fn on_event(&mut self, ev: Event) {
        let Event {
            gpu,
            kind,
            instance,
        } = ev;
        let xid = match kind {
            EventKind::Xid(x) => Some(x),
            EventKind::DoubleBitEcc => Some(super::XID_DOUBLE_BIT_ECC),
            EventKind::GpuLost | EventKind::Unmonitored(_) => None,
        };
        if let Some(x) = xid {
            *lock(&self.xids).entry((gpu.clone(), x)).or_default() += 1;
        }
        let Some((cause, effect)) = self.policy.judge(&kind) else {
            tracing::debug!(gpu.uuid = %gpu, event = ?kind, instance = ?instance, "ignored health event");
            return;
        };
        let now = Instant::now();
        let fault = Fault {
            xid: cause.xid(),
            cause,
            effect,
            since: now,
        };
        match instance {
            Some(i) if !i.devices.is_empty() => self.on_instance_fault(gpu, i, fault),
            Some(i) => {
                tracing::warn!(
                    gpu.uuid = %gpu,
                    instance = %i,
                    cause = %fault.cause,
                    "a health event names a MIG instance with no MIG device found; the whole GPU counts as hit"
                );
                self.on_gpu_fault(gpu, fault);
            }
            None => self.on_gpu_fault(gpu, fault),
        }
    }

    fn on_gpu_fault(&mut self, gpu: GpuUuid, fault: Fault) {
        let now = fault.since;
        match self.tracked.get_mut(&gpu) {
            Some(t) => {
                // Already unhealthy: the first cause stays, recovery waits longer.
                t.last_event = now;
                tracing::debug!(gpu.uuid = %gpu, cause = %fault.cause, "another critical event on an unhealthy GPU");
            }
            None => {
                tracing::warn!(gpu.uuid = %gpu, cause = %fault.cause, taint.effect = %fault.effect, "GPU unhealthy");
                self.tracked.insert(
                    gpu,
                    Tracked {
                        fault,
                        last_event: now,
                    },
                );
                self.publish();
            }
        }
    }

    /// A fault of each MIG device `instance` names.
    fn on_instance_fault(&mut self, gpu: GpuUuid, instance: Instance, fault: Fault) {
        let now = fault.since;
        let Instance {
            gpu_instance,
            compute_instance,
            devices,
        } = instance;
        let mut changed = false;
        for mig in devices {
            match self.tracked_mig.get_mut(&mig) {
                Some(t) => {
                    t.last_event = now;
                    tracing::debug!(gpu.uuid = %gpu, mig.uuid = %mig, cause = %fault.cause, "another critical event on an unhealthy MIG device");
                }
                None => {
                    let f = MigFault {
                        gpu: gpu.clone(),
                        gpu_instance,
                        compute_instance,
                        fault: fault.clone(),
                    };
                    tracing::warn!(
                        gpu.uuid = %gpu,
                        mig.uuid = %mig,
                        cause = %f.reason(),
                        taint.effect = %fault.effect,
                        "MIG device unhealthy"
                    );
                    self.tracked_mig.insert(
                        mig,
                        Tracked {
                            fault: f,
                            last_event: now,
                        },
                    );
                    changed = true;
                }
            }
        }
        if changed {
            self.publish();
        }
    }

    /// Probes every unhealthy GPU, and the GPU of every unhealthy MIG device, whose quiet
    /// period is over; those that answer are healthy. A MIG device no longer on the node (its
    /// instance destroyed) is healthy at once.
    async fn probe_all(&mut self) {
        let now = Instant::now();
        let quiet_period = self.policy.quiet_period;
        // A GPU fault recovers by probe only where its cause can end: not `Unmonitored`.
        let recovers = move |t: &Tracked<Fault>| {
            !matches!(t.fault.cause, Cause::Unmonitored(_))
                && now.duration_since(t.last_event) >= quiet_period
        };
        let quiet = move |t: &Instant| now.duration_since(*t) >= quiet_period;
        let mut due: BTreeSet<GpuUuid> = self
            .tracked
            .iter()
            .filter(|(_, t)| recovers(t))
            .map(|(g, _)| g.clone())
            .collect();
        due.extend(
            self.tracked_mig
                .values()
                .filter(|t| quiet(&t.last_event))
                .map(|t| t.fault.gpu.clone()),
        );
        let any_mig = !self.tracked_mig.is_empty();
        if due.is_empty() && !any_mig {
            return;
        }
        let probe = self.probe.clone();
        let answers = tokio::task::spawn_blocking(move || {
            let live = if any_mig { probe.mig_devices() } else { None };
            let answers = due
                .into_iter()
                .map(|g| {
                    let r = probe.probe(&g);
                    (g, r)
                })
                .collect::<BTreeMap<_, _>>();
            (answers, live)
        })
        .await;
        let (answers, live) = match answers {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(error = %e, "the health probe panicked; GPUs stay unhealthy");
                return;
            }
        };
        let mut changed = false;
        for (gpu, answer) in &answers {
            match answer {
                Ok(()) => {
                    if self.tracked.get(gpu).is_some_and(recovers)
                        && let Some(t) = self.tracked.remove(gpu)
                    {
                        tracing::info!(
                            gpu.uuid = %gpu,
                            cause = %t.fault.cause,
                            quiet_for = ?self.policy.quiet_period,
                            "GPU healthy again"
                        );
                        changed = true;
                    }
                }
                Err(reason) => {
                    tracing::debug!(gpu.uuid = %gpu, %reason, "GPU still does not answer its probe")
                }
            }
        }
        self.tracked_mig.retain(|mig, t| {
            let f = &t.fault;
            if live.as_ref().is_some_and(|live| !live.contains(mig)) {
                tracing::info!(gpu.uuid = %f.gpu, mig.uuid = %mig, cause = %f.reason(), "MIG device gone (its instance destroyed); its fault ends");
                changed = true;
                return false;
            }
            let answered = answers.get(&f.gpu).is_some_and(Result::is_ok);
            if answered && quiet(&t.last_event) {
                tracing::info!(gpu.uuid = %f.gpu, mig.uuid = %mig, cause = %f.reason(), quiet_for = ?quiet_period, "MIG device healthy again");
                changed = true;
                return false;
            }
            true
        });
        if changed {
            self.publish();
        }
    }

    fn publish(&self) {
        let faults = self
            .tracked
            .iter()
            .map(|(g, t)| (g.clone(), t.fault.clone()))
            .collect();
        let mig_faults = self
            .tracked_mig
            .iter()
            .map(|(m, t)| (m.clone(), t.fault.clone()))
            .collect();
        let (daemons_asked, daemons_down) = self.daemons.borrow().clone();
        self.state.send_if_modified(|s| {
            let new = HealthState {
                faults,
                mig_faults,
                daemons_down,
                daemons_asked,
            };
            let modified = *s != new;
            *s = new;
            modified
        });
    }
}
