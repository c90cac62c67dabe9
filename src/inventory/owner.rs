//! The inventory owner: the one task that reads the node's inventory from the backend, and the
//! watch on which every consumer (prepare, slices, device plugin, health stream, labels,
//! metrics) reads what it published.
//!
//! [`Owner::run`] reads on a rescan and when asked ([`InventoryHandle::request`]: a MIG device
//! created or destroyed), lays the health monitor's state over each read
//! ([`HealthState::apply`]), and publishes the node on a `tokio::sync::watch` ([`Published`]:
//! one `Arc`, a generation). A health transition publishes the last read again with the new
//! state, without reading the hardware. Consumers follow the watch ([`changed`]) and nothing
//! else; so a MIG change or a health transition reaches every consumer from the same
//! publication.
//!
//! Invariants:
//! - Only the owner reads the hardware ([`DeviceBackend`]): its reader thread reads the
//!   inventory, and its handle asks for live readings and recovery probes. The reader is a
//!   thread of its own, not the blocking pool, so a slow or stuck NVML read never takes a thread
//!   a `/metrics` scrape or a prepare needs.
//! - Every read has a deadline ([`DEADLINE`]): one that passes it is published as
//!   [`Error::Deadline`] naming the call, and the owner goes on (health transitions and asks are
//!   still answered). The next cycle waits on the same read again — never a second one behind a
//!   stuck one — so at most one thread is ever stuck in the backend.
//! - A failed read keeps the last inventory published; only the error is new.
//! - Writes go through the write handle ([`Writes`]), which only the DRA plugin holds: each
//!   asks for a read, and the plugin's next look at the node waits for that read, so prepare
//!   never resolves devices against hardware it just changed.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::{Notify, oneshot, watch};
use tokio_util::sync::CancellationToken;

use super::deadline::{Deadlines, Lane};
use super::health::HealthState;
use super::{
    ComputeMode, DeviceBackend, Error, GpuUsage, GpuUuid, Inventory, MemoryLimits, MigDevice,
    MigUuid, Placement, Reconfiguration, Reconfigure, Result, TimeSlice,
};

/// How long one inventory read may take before it is reported as failed.
pub const DEADLINE: Duration = Duration::from_secs(30);

/// The backend call the owner makes, as errors name it.
const CALL: &str = "refresh (the inventory read)";

/// What the owner last published.
#[derive(Clone, Debug, Default)]
pub struct Published {
    /// The node: the last inventory read with the health monitor's state laid over it; `None`
    /// until a read succeeded.
    pub node: Option<Arc<Inventory>>,
    /// Why the latest read failed; `None` once one succeeds.
    pub error: Option<Arc<Error>>,
    /// The asks ([`InventoryHandle::request`]) that the latest read answers: it started after
    /// each of them.
    pub answered: u64,
    /// Reads published so far, failed ones included.
    pub reads: u64,
    /// Publications so far: every read and every health transition.
    pub generation: u64,
    /// The health monitor's state laid over `node` (with the share daemons' last round).
    pub health: HealthState,
}

impl Published {
    /// The node, or why there is none.
    pub fn node(&self) -> Result<Arc<Inventory>> {
        match (&self.node, &self.error) {
            (Some(inv), _) => Ok(inv.clone()),
            (None, Some(e)) => Err(Error::Read(e.clone())),
            (None, None) => Err(Error::NotRead),
        }
    }
}

/// A subscription to the owner's publications.
pub type Watch = watch::Receiver<Published>;

/// Ready when the owner published again; never once the owner is gone (a consumer then keeps
/// its last publication instead of spinning). For a `select!` branch of a consumer that follows
/// the publications.
pub async fn changed(node: &mut Watch) {
    if node.changed().await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// Asks and waits for the owner's reads, and asks the hardware what a read does not hold
/// (live readings, recovery probes), each call under a deadline ([`Deadlines`], [`DEADLINE`] by
/// default): a stuck `/metrics` reading or probe is reported as such instead of hanging its
/// caller.
#[derive(Clone)]
pub struct InventoryHandle {
    watch: Watch,
    asks: Arc<Asks>,
    hardware: Arc<dyn DeviceBackend>,
    deadlines: Deadlines,
}

#[derive(Debug, Default)]
struct Asks {
    count: AtomicU64,
    notify: Notify,
}

impl InventoryHandle {
    /// The owner's publications.
    pub fn subscribe(&self) -> Watch {
        self.watch.clone()
    }

    /// The latest publication.
    pub fn latest(&self) -> Published {
        self.watch.borrow().clone()
    }

    /// Asks for a read soon (the hardware may have changed); the returned ticket is answered by
    /// the first publication whose read started after this call ([`InventoryHandle::wait`]).
    pub fn request(&self) -> u64 {
        let ticket = self.asks.count.fetch_add(1, Ordering::SeqCst) + 1;
        self.asks.notify.notify_one();
        ticket
    }

    /// Waits until a read that answers `ticket` is published; bounded by the owner's deadline
    /// while the owner runs.
    pub async fn wait(&self, ticket: u64) -> Result<Published> {
        let mut w = self.watch.clone();
        let p = w
            .wait_for(|p| p.answered >= ticket)
            .await
            .map_err(|_| Error::OwnerGone)?;
        Ok(p.clone())
    }

    /// Asks for a read and waits for it.
    pub async fn refresh(&self) -> Result<Arc<Inventory>> {
        let ticket = self.request();
        self.wait(ticket).await?.node()
    }

    /// The hardware's name (`nvml`, `simulated`).
    pub fn backend(&self) -> &'static str {
        self.hardware.name()
    }

    /// Each GPU's live readings, read now, under the deadline: a `/metrics` scrape reports
    /// readings it could not get in time as unreadable instead of waiting for them.
    pub fn usage(&self) -> Result<Vec<GpuUsage>> {
        let hardware = self.hardware.clone();
        self.deadlines
            .call(Lane::Usage, "usage".into(), move || hardware.usage())
    }

    /// Whether `gpu` answers again (the health monitor's recovery probe), under the deadline:
    /// a probe that does not answer in time says so.
    pub fn probe(&self, gpu: &GpuUuid) -> std::result::Result<(), String> {
        let (hardware, g) = (self.hardware.clone(), gpu.clone());
        self.deadlines
            .call(Lane::Probe, format!("probe (GPU {gpu})"), move || {
                Ok(hardware.probe(&g))
            })
            .unwrap_or_else(|e| Err(crate::report::chain(&e).to_string()))
    }

    /// Starts the hardware's own health events ([`DeviceBackend::start_health_events`]).
    pub fn start_health_events(
        &self,
        sink: Box<dyn super::events::EventSink>,
    ) -> Option<std::io::Result<super::events::EventThread>> {
        self.hardware.start_health_events(sink)
    }
}

/// The task that owns the backend's reads.
pub struct Owner {
    backend_name: &'static str,
    reader: std::sync::mpsc::Sender<oneshot::Sender<Result<Inventory>>>,
    /// A read that passed its deadline and is still running, with the asks made before it
    /// started: the next cycle waits on it.
    pending: Option<(u64, oneshot::Receiver<Result<Inventory>>)>,
    tx: watch::Sender<Published>,
    asks: Arc<Asks>,
    rescan: Duration,
    deadline: Duration,
    /// The last inventory read, as the backend answered it (no health laid over it).
    last: Option<Arc<Inventory>>,
    /// The health monitor's state, laid over each publication ([`Owner::run`]).
    health: Option<watch::Receiver<HealthState>>,
}

impl Owner {
    /// The owner over `backend`, reading every `rescan` and within `deadline`, and its handle.
    /// Nothing is read until [`Owner::read`] or [`Owner::run`]. Starts the reader thread, which
    /// ends with the owner.
    pub fn new(
        backend: Arc<dyn DeviceBackend>,
        rescan: Duration,
        deadline: Duration,
    ) -> std::io::Result<(Self, InventoryHandle)> {
        let (reader, requests) = std::sync::mpsc::channel::<oneshot::Sender<Result<Inventory>>>();
        let backend_name = backend.name();
        let hardware = backend.clone();
        std::thread::Builder::new()
            .name("nvdra-inventory".into())
            .spawn(move || {
                for reply in requests {
                    // The owner may have stopped waiting (deadline, shutdown).
                    let _ = reply.send(backend.snapshot());
                }
            })?;
        let (tx, watch) = watch::channel(Published::default());
        let asks = Arc::new(Asks::default());
        Ok((
            Self {
                backend_name,
                reader,
                pending: None,
                tx,
                asks: asks.clone(),
                rescan,
                deadline,
                last: None,
                health: None,
            },
            InventoryHandle {
                watch,
                asks,
                deadlines: Deadlines::new(backend_name, DEADLINE),
                hardware,
            },
        ))
    }

    /// The last read with the health state as it is now laid over it, and that state.
    fn node(&self) -> (Option<Arc<Inventory>>, HealthState) {
        let health = self.health.as_ref().map(|h| h.borrow().clone());
        let health = health.unwrap_or_default();
        let node = self.last.as_ref().map(|last| {
            if health.is_empty() {
                // Nothing to lay over it: the read itself, not a copy.
                return last.clone();
            }
            let mut node = Inventory::clone(last);
            health.apply(&mut node);
            Arc::new(node)
        });
        (node, health)
    }

    /// Publishes the last read again with the health state as it is now (a transition): no
    /// hardware read.
    fn republish(&mut self) {
        let (node, health) = self.node();
        self.tx.send_modify(|p| {
            p.node = node;
            p.health = health;
            p.generation += 1;
        });
    }

    /// Reads the inventory once and publishes the result, which is also returned.
    pub async fn read(&mut self) -> Result<Arc<Inventory>, Arc<Error>> {
        let (started, result) = self.read_with_deadline().await;
        match result {
            Ok(inv) => {
                // A read that started before some asks answers only those made before it.
                let answered = started;
                let inv = Arc::new(inv);
                self.last = Some(inv.clone());
                let (node, health) = self.node();
                self.tx.send_modify(|p| {
                    p.node = node;
                    p.health = health;
                    p.error = None;
                    p.answered = p.answered.max(answered);
                    p.reads += 1;
                    p.generation += 1;
                });
                if self.asks.count.load(Ordering::SeqCst) > answered {
                    // Asks made meanwhile get a read of their own.
                    self.asks.notify.notify_one();
                }
                Ok(inv)
            }
            Err(e) => {
                // Every ask so far is answered, by the failure.
                let answered = self.asks.count.load(Ordering::SeqCst);
                tracing::warn!(error = %crate::report::chain(&e), backend = self.backend_name,
                    "cannot read the inventory; consumers keep the last one read");
                let e = Arc::new(e);
                self.tx.send_modify(|p| {
                    p.error = Some(e.clone());
                    p.answered = p.answered.max(answered);
                    p.reads += 1;
                    p.generation += 1;
                });
                Err(e)
            }
        }
    }

    /// The asks made before the read started, and its result.
    async fn read_with_deadline(&mut self) -> (u64, Result<Inventory>) {
        let (started, mut reply) = match self.pending.take() {
            Some(p) => p,
            None => {
                let started = self.asks.count.load(Ordering::SeqCst);
                let (tx, rx) = oneshot::channel();
                if self.reader.send(tx).is_err() {
                    return (started, Err(Error::ReaderGone));
                }
                (started, rx)
            }
        };
        let result = match tokio::time::timeout(self.deadline, &mut reply).await {
            Ok(Ok(result)) => result,
            Ok(Err(_)) => Err(Error::ReaderGone),
            Err(_) => {
                self.pending = Some((started, reply));
                Err(Error::Deadline {
                    backend: self.backend_name,
                    call: CALL,
                    after: self.deadline,
                })
            }
        };
        (started, result)
    }

    /// Reads on every rescan and ask, and publishes again on every transition of `health` (the
    /// health monitor's state), until `shutdown`. Read failures are published, not returned:
    /// the owner ends before shutdown only when its reader thread is gone
    /// ([`Error::ReaderGone`]: the backend panicked), as nothing could be read again.
    pub async fn run(
        mut self,
        health: watch::Receiver<HealthState>,
        shutdown: CancellationToken,
    ) -> Result<()> {
        let start = tokio::time::Instant::now() + self.rescan;
        let mut tick = tokio::time::interval_at(start, self.rescan);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut transitions = health.clone();
        let mut following = true;
        self.health = Some(health);
        if self.tx.borrow().node.is_some() && !transitions.borrow_and_update().is_empty() {
            // Read before the owner followed the monitor: published without its state.
            self.republish();
        }
        let asks = self.asks.clone();
        if self.tx.borrow().reads == 0 {
            tokio::select! {
                biased;
                () = shutdown.cancelled() => return Ok(()),
                r = self.read() => gone(r)?,
            }
        }
        loop {
            tokio::select! {
                biased;
                () = shutdown.cancelled() => return Ok(()),
                () = asks.notify.notified() => {}
                changed = transitions.changed(), if following => {
                    match changed {
                        Ok(()) => self.republish(),
                        // The monitor is gone: its last state stays laid over every read.
                        Err(_) => following = false,
                    }
                    continue;
                }
                _ = tick.tick() => {}
            }
            // Cancellation first: a read stuck past shutdown is left to its thread.
            tokio::select! {
                biased;
                () = shutdown.cancelled() => return Ok(()),
                r = self.read() => gone(r)?,
            }
        }
    }
}

/// A read that failed because the reader thread is gone ends the owner; others do not.
fn gone(read: Result<Arc<Inventory>, Arc<Error>>) -> Result<()> {
    match read {
        Err(e) if matches!(*e, Error::ReaderGone) => Err(Error::ReaderGone),
        _ => Ok(()),
    }
}

/// The write handle: the reconfigurations prepare makes ([`Reconfigure`]), held by the DRA
/// plugin alone, and the node as the owner publishes it. Every reconfiguration runs under a
/// deadline ([`Deadlines`], [`DEADLINE`] by default: a stuck one is reported as such instead of
/// hanging its caller) and asks the owner for a read; [`Writes::node`] then waits for that read.
#[derive(Clone)]
pub struct Writes {
    gpus: Arc<dyn Reconfigure>,
    handle: InventoryHandle,
    /// The ask made after the last reconfiguration, which the next [`Writes::node`] waits for.
    changed: Arc<AtomicU64>,
    deadlines: Deadlines,
}

impl Writes {
    pub fn new(gpus: Arc<dyn Reconfigure>, handle: InventoryHandle) -> Self {
        let deadlines = Deadlines::new(handle.backend(), DEADLINE);
        Self {
            gpus,
            handle,
            changed: Arc::new(AtomicU64::new(0)),
            deadlines,
        }
    }

    /// The owner's publications.
    pub fn subscribe(&self) -> Watch {
        self.handle.subscribe()
    }

    /// The node as the owner last published it, shared (no copy); after a reconfiguration, the
    /// first read that saw it, waited for (bounded by the owner's deadline): prepare never
    /// resolves devices against hardware it just changed.
    pub async fn node(&self) -> Result<Arc<Inventory>> {
        let ticket = self.changed.load(Ordering::SeqCst);
        {
            let latest = self.handle.watch.borrow();
            if latest.answered >= ticket {
                return latest.node();
            }
        }
        self.handle.wait(ticket).await?.node()
    }

    /// A read the owner makes now, asked for and waited for (bounded by its deadline): the
    /// plugin waiting for its MPS processes to leave a GPU.
    pub async fn refresh(&self) -> Result<Arc<Inventory>> {
        self.handle.refresh().await
    }

    /// A reconfiguration, under the deadline. Once it returns (even after its caller gave up,
    /// even refused: a refused change may still have left one pending), the next
    /// [`Writes::node`] waits for a read that saw it.
    fn reconfigure<T: Send + 'static>(
        &self,
        call: String,
        f: impl FnOnce(&dyn Reconfigure) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        let (gpus, handle, changed) =
            (self.gpus.clone(), self.handle.clone(), self.changed.clone());
        self.deadlines.call(Lane::Write, call, move || {
            let r = f(&*gpus);
            changed.fetch_max(handle.request(), Ordering::SeqCst);
            r
        })
    }

    /// A driver call that changes no inventory, under the deadline.
    fn call<T: Send + 'static>(
        &self,
        call: String,
        f: impl FnOnce(&dyn Reconfigure) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        let gpus = self.gpus.clone();
        self.deadlines.call(Lane::Write, call, move || f(&*gpus))
    }
}

impl Reconfigure for Writes {
    fn unavailable(&self, what: Reconfiguration) -> Option<String> {
        self.gpus.unavailable(what)
    }

    fn set_time_slice(&self, gpu: &GpuUuid, interval: TimeSlice) -> Result<()> {
        let gpu = gpu.clone();
        self.reconfigure(format!("set_time_slice (GPU {gpu})"), move |b| {
            b.set_time_slice(&gpu, interval)
        })
    }

    fn compute_mode(&self, gpu: &GpuUuid) -> Result<ComputeMode> {
        let gpu = gpu.clone();
        self.call(format!("compute_mode (GPU {gpu})"), move |b| {
            b.compute_mode(&gpu)
        })
    }

    /// Under the write lane's deadline: a driver call like the compute-mode read.
    fn memory_limits(&self, gpu: &GpuUuid, cgroup: &std::path::Path) -> Result<MemoryLimits> {
        let (gpu, cgroup) = (gpu.clone(), cgroup.to_path_buf());
        self.call(format!("memory_limits (GPU {gpu})"), move |b| {
            b.memory_limits(&gpu, &cgroup)
        })
    }

    fn set_compute_mode(&self, gpu: &GpuUuid, mode: ComputeMode) -> Result<()> {
        let gpu = gpu.clone();
        self.call(format!("set_compute_mode {mode} (GPU {gpu})"), move |b| {
            b.set_compute_mode(&gpu, mode)
        })
    }

    fn create_mig(
        &self,
        gpu: &GpuUuid,
        gi_profile_id: u32,
        placement: Placement,
    ) -> Result<MigDevice> {
        let gpu = gpu.clone();
        self.reconfigure(
            format!("create_mig of profile {gi_profile_id} (GPU {gpu})"),
            move |b| b.create_mig(&gpu, gi_profile_id, placement),
        )
    }

    fn destroy_mig(&self, gpu: &GpuUuid, mig: &MigUuid) -> Result<()> {
        let (gpu, mig) = (gpu.clone(), mig.clone());
        self.reconfigure(format!("destroy_mig {mig} (GPU {gpu})"), move |b| {
            b.destroy_mig(&gpu, &mig)
        })
    }

    /// A reconfiguration like the others: under the deadline, and re-read on failure too (a
    /// refused change may still have left one pending). A change that needs a GPU reset does
    /// not wait for it: NVML answers RESET_REQUIRED at once.
    fn set_mig_mode(&self, gpu: &GpuUuid, enabled: bool) -> Result<super::MigModeChange> {
        let gpu = gpu.clone();
        self.reconfigure(
            format!("set_mig_mode {} (GPU {gpu})", super::on_off(enabled)),
            move |b| b.set_mig_mode(&gpu, enabled),
        )
    }
}

#[cfg(test)]
mod tests;
