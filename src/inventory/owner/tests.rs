use super::*;
use crate::inventory::Health;
use crate::inventory::sim::SimBackend;

/// Generous bound for what takes milliseconds; only reached when something is broken.
const SOON: Duration = Duration::from_secs(10);

/// Test-only knobs of the handles: a shorter deadline than [`DEADLINE`], and what is past it.
impl InventoryHandle {
    /// The same handle, with the hardware's calls waited for at most `after`.
    pub(crate) fn with_call_deadline(mut self, after: Duration) -> Self {
        self.deadlines = Deadlines::new(self.hardware.name(), after);
        self
    }

    /// The hardware calls past their deadline that still run.
    pub(crate) fn overdue(&self) -> Vec<String> {
        self.deadlines.overdue()
    }
}

impl Writes {
    /// The same, with the calls waited for at most `after`.
    pub(crate) fn with_call_deadline(mut self, after: Duration) -> Self {
        self.deadlines = Deadlines::new(self.handle.backend(), after);
        self
    }

    /// The calls past their deadline that still run.
    pub(crate) fn overdue(&self) -> Vec<String> {
        self.deadlines.overdue()
    }
}

fn owner(sim: &SimBackend) -> (Owner, InventoryHandle) {
    Owner::new(Arc::new(sim.clone()), Duration::from_secs(3600), DEADLINE).unwrap()
}

/// `f` on `watched` from a blocking thread, as prepare calls the write handle (a call held in
/// the simulated backend blocks its caller).
async fn blocking<T: Send + 'static>(
    watched: &Arc<Writes>,
    f: impl FnOnce(&Writes) -> T + Send + 'static,
) -> T {
    let w = watched.clone();
    tokio::task::spawn_blocking(move || f(&w)).await.unwrap()
}

/// `sim`'s owner running (until the token is cancelled), and the write handle's calls under a
/// deadline of two seconds, against calls the tests hold until they let them go.
fn running_with_short_deadline(
    sim: &SimBackend,
) -> (Arc<Writes>, InventoryHandle, CancellationToken) {
    let (owner, handle) = owner(sim);
    let stop = CancellationToken::new();
    tokio::spawn(owner.run(crate::testing::no_health(), stop.clone()));
    let watched = Arc::new(
        Writes::new(Arc::new(sim.clone()), handle.clone())
            .with_call_deadline(Duration::from_secs(2)),
    );
    (watched, handle, stop)
}

#[tokio::test]
async fn consumers_read_the_last_publication_until_the_owner_reads_again() {
    let sim = SimBackend::from_profile("a100-mig-mixed", "n").unwrap();
    let (mut owner, handle) = owner(&sim);
    let watched = Writes::new(Arc::new(sim.clone()), handle.clone());
    assert!(matches!(watched.node().await, Err(Error::NotRead)));
    let first = owner.read().await.unwrap();
    assert_eq!(*watched.node().await.unwrap(), *first);

    sim.update(|inv| {
        inv.gpus[0].health = Health::Unhealthy {
            reason: "XID 79".into(),
        }
    });
    // Not read yet: every consumer still sees the same inventory.
    assert_eq!(*watched.node().await.unwrap(), *first);
    let mut w = handle.subscribe();
    w.mark_unchanged();
    owner.read().await.unwrap();
    assert!(w.has_changed().unwrap(), "a read wakes the consumers");
    assert!(!watched.node().await.unwrap().gpus[0].health.is_healthy());
}

/// A refresh through the write handle ([`Writes`]) is a read the owner makes for it, asked for
/// and waited for (the plugin waiting for its MPS processes to leave a GPU): the only consumer
/// read that reaches the hardware, and still the owner's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refresh_through_the_write_handle_is_a_read_the_owner_makes() {
    let sim = SimBackend::from_profile("a100-mig-mixed", "n").unwrap();
    let stop = CancellationToken::new();
    let handle = crate::testing::start_owner(
        Arc::new(sim.clone()),
        Duration::from_secs(3600),
        crate::testing::no_health(),
        stop.clone(),
    )
    .await
    .unwrap();
    let watched = Writes::new(Arc::new(sim.clone()), handle.clone());
    sim.update(|inv| {
        inv.gpus[0].health = Health::Unhealthy {
            reason: "XID 79".into(),
        }
    });
    assert!(watched.node().await.unwrap().gpus[0].health.is_healthy());
    let fresh = watched.refresh().await.unwrap();
    assert!(!fresh.gpus[0].health.is_healthy(), "a fresh read");
    assert_eq!(handle.latest().reads, 2, "the owner's second read");
    stop.cancel();
}

#[tokio::test]
async fn a_reconfiguration_is_seen_by_the_next_snapshot() {
    let sim = SimBackend::from_profile("a100-mig-mixed", "n").unwrap();
    let (owner, handle) = owner(&sim);
    let stop = CancellationToken::new();
    let task = tokio::spawn(owner.run(crate::testing::no_health(), stop.clone()));
    let watched = Arc::new(Writes::new(Arc::new(sim.clone()), handle.clone()));
    let before = handle.refresh().await.unwrap();
    let gpu2 = before.gpus[2].uuid.clone();

    let g = gpu2.clone();
    let created = blocking(&watched, move |w| {
        w.create_mig(&g, 15, Placement { start: 6, size: 2 })
    })
    .await
    .unwrap();
    // The owner's rescan is an hour away: only the reconfiguration's ask reads again.
    let after = tokio::time::timeout(SOON, watched.node())
        .await
        .expect("the owner answers the ask")
        .unwrap();
    assert!(
        after.gpus[2]
            .mig
            .devices
            .iter()
            .any(|d| d.uuid == created.uuid),
        "the created MIG device is listed"
    );
    stop.cancel();
    task.await.unwrap().unwrap();
}

/// A MIG mode change, refused ones too, is seen by the next snapshot: an Ampere's refusal
/// leaves the change pending, which consumers must see.
#[tokio::test]
async fn a_mig_mode_change_even_refused_is_seen_by_the_next_snapshot() {
    let sim = SimBackend::from_profile("a100-mig-mixed", "n").unwrap();
    let (owner, handle) = owner(&sim);
    let stop = CancellationToken::new();
    let task = tokio::spawn(owner.run(crate::testing::no_health(), stop.clone()));
    let watched = Arc::new(Writes::new(Arc::new(sim.clone()), handle.clone()));
    let gpu3 = handle.refresh().await.unwrap().gpus[3].uuid.clone();
    let g = gpu3.clone();
    let refused = blocking(&watched, move |w| w.set_mig_mode(&g, true)).await;
    assert!(refused.is_err(), "an Ampere needs a reset: {refused:?}");
    let after = tokio::time::timeout(SOON, watched.node())
        .await
        .expect("the owner answers the ask")
        .unwrap();
    assert_eq!(after.gpus[3].mig.pending, Some(true));
    stop.cancel();
    task.await.unwrap().unwrap();
}

/// A backend whose reads block until the test lets one through.
struct Stuck {
    sim: SimBackend,
    release: std::sync::Mutex<std::sync::mpsc::Receiver<()>>,
}

impl DeviceBackend for Stuck {
    fn name(&self) -> &'static str {
        "stuck"
    }
    fn snapshot(&self) -> Result<Inventory> {
        let _ = self.release.lock().unwrap().recv();
        self.sim.snapshot()
    }
}

/// Paused time: the deadline passes as soon as the read is the only thing left to wait for.
#[tokio::test(start_paused = true)]
async fn a_read_past_its_deadline_is_an_error_naming_the_call_and_the_owner_goes_on() {
    let sim = SimBackend::from_profile("l40s-pcie", "n").unwrap();
    let (release, rx) = std::sync::mpsc::channel();
    let stuck = Stuck {
        sim,
        release: std::sync::Mutex::new(rx),
    };
    let (mut owner, handle) =
        Owner::new(Arc::new(stuck), Duration::from_secs(3600), DEADLINE).unwrap();
    let e = owner.read().await.unwrap_err();
    assert!(matches!(*e, Error::Deadline { call: CALL, .. }), "{e:?}");
    let text = e.to_string();
    assert!(
        text.contains("stuck") && text.contains("refresh") && text.contains("30s"),
        "{text}"
    );
    let published = handle.latest();
    assert_eq!(published.reads, 1, "the failure is published");
    assert!(matches!(published.node(), Err(Error::Read(_))));

    // An ask made while the read is stuck.
    let ticket = handle.request();

    // The next cycle waits on the same read, which is not repeated: one release answers it
    // (in real time now, so that the thread's answer is not raced by a paused clock).
    tokio::time::resume();
    release.send(()).unwrap();
    let inv = owner.read().await.unwrap();
    assert_eq!(inv.gpus.len(), 4);
    assert!(handle.latest().error.is_none());
    assert_eq!(handle.latest().reads, 2);
    // That read started before the ask, so it does not answer it; the next one does.
    assert!(handle.latest().answered < ticket);
    release.send(()).unwrap();
    owner.read().await.unwrap();
    assert!(handle.latest().answered >= ticket);
}

/// A backend that can read only once: a second read would panic its thread.
struct Once(std::sync::atomic::AtomicBool, SimBackend);

impl DeviceBackend for Once {
    fn name(&self) -> &'static str {
        "once"
    }
    fn snapshot(&self) -> Result<Inventory> {
        assert!(!self.0.swap(true, Ordering::SeqCst), "read twice");
        self.1.snapshot()
    }
}

#[tokio::test]
async fn a_failed_read_keeps_the_last_inventory_and_names_what_failed() {
    let sim = SimBackend::from_profile("l40s-pcie", "n").unwrap();
    let once = Once(std::sync::atomic::AtomicBool::new(false), sim);
    let (mut owner, handle) =
        Owner::new(Arc::new(once), Duration::from_secs(3600), DEADLINE).unwrap();
    let first = owner.read().await.unwrap();
    // The reader thread panicked in the backend: the read fails, naming it.
    let e = owner.read().await.unwrap_err();
    assert!(matches!(*e, Error::ReaderGone), "{e:?}");
    let p = handle.latest();
    assert_eq!(p.node().unwrap(), first, "the last inventory stays");
    assert!(p.error.is_some());
}

/// Waits (at most [`SOON`]) until no call of `watched` is past its deadline.
fn until_returned(watched: &Writes) {
    let start = std::time::Instant::now();
    while !watched.overdue().is_empty() {
        assert!(start.elapsed() < SOON, "{:?} still runs", watched.overdue());
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[tokio::test]
async fn a_stuck_reconfiguration_is_an_error_naming_it_and_blocks_other_writes_until_it_returns() {
    use crate::inventory::sim::SimCall;
    let sim = SimBackend::from_profile("a100-mig-mixed", "n").unwrap();
    let (watched, handle, stop) = running_with_short_deadline(&sim);
    let before = handle.refresh().await.unwrap();
    let gpu2 = before.gpus[2].uuid.clone();
    let held = sim.hold(SimCall::CreateMig);
    let g = gpu2.clone();
    let e = blocking(&watched, move |w| {
        w.create_mig(&g, 15, Placement { start: 6, size: 2 })
    })
    .await
    .unwrap_err();
    assert!(matches!(e, Error::CallDeadline { .. }), "{e:?}");
    assert_eq!(
        e.to_string(),
        format!(
            "the simulated backend's create_mig of profile 15 (GPU {gpu2}) did not return within \
             2s; it goes on in the background"
        )
    );
    // No other write races it (an undo would find the hardware half-changed).
    let g = gpu2.clone();
    let e = blocking(&watched, move |w| w.set_time_slice(&g, TimeSlice::Long))
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Overdue { .. }), "{e:?}");
    assert!(e.to_string().contains("create_mig of profile 15"), "{e}");
    assert!(sim.time_slice(&gpu2) == TimeSlice::Default);

    // It returns: the device exists, and the next snapshot is read after it.
    drop(held);
    until_returned(&watched);
    let after = tokio::time::timeout(SOON, watched.node())
        .await
        .expect("the owner answers the late write's ask")
        .unwrap();
    assert_eq!(
        after.gpus[2].mig.devices.len(),
        before.gpus[2].mig.devices.len() + 1
    );
    let g = gpu2.clone();
    blocking(&watched, move |w| w.set_time_slice(&g, TimeSlice::Long))
        .await
        .unwrap();
    assert_eq!(sim.time_slice(&gpu2), TimeSlice::Long);
    stop.cancel();
}

/// A MIG mode switch is a reconfiguration like the others: one that hangs in the driver is
/// reported at the deadline, holds back the other writes until it returns, and the snapshot
/// after it shows the mode it left.
#[tokio::test]
async fn a_stuck_mig_mode_switch_is_an_error_naming_it_and_the_mode_shows_once_it_returns() {
    use crate::inventory::sim::SimCall;
    let sim = SimBackend::from_profile("dgx-h100", "n").unwrap();
    let (watched, handle, stop) = running_with_short_deadline(&sim);
    let gpu = handle.refresh().await.unwrap().gpus[5].uuid.clone();
    let held = sim.hold(SimCall::SetMigMode);
    let g = gpu.clone();
    let e = blocking(&watched, move |w| w.set_mig_mode(&g, true))
        .await
        .unwrap_err();
    assert!(matches!(e, Error::CallDeadline { .. }), "{e:?}");
    assert_eq!(
        e.to_string(),
        format!(
            "the simulated backend's set_mig_mode on (GPU {gpu}) did not return within 2s; it \
             goes on in the background"
        )
    );
    let g = gpu.clone();
    let e = blocking(&watched, move |w| {
        w.set_compute_mode(&g, ComputeMode::Default)
    })
    .await
    .unwrap_err();
    assert!(matches!(e, Error::Overdue { .. }), "{e:?}");
    assert!(e.to_string().contains("set_mig_mode on"), "{e}");

    drop(held);
    until_returned(&watched);
    let after = tokio::time::timeout(SOON, watched.node())
        .await
        .expect("the owner answers the late switch's ask")
        .unwrap();
    assert!(after.gpus[5].mig.enabled, "{:?}", after.gpus[5].mig);
    let g = gpu.clone();
    let again = blocking(&watched, move |w| w.set_mig_mode(&g, true))
        .await
        .unwrap();
    assert_eq!(again, crate::inventory::MigModeChange::Unchanged);
    stop.cancel();
}

#[tokio::test]
async fn a_stuck_usage_read_or_probe_is_reported_and_not_waited_for() {
    use crate::inventory::sim::SimCall;
    let sim = SimBackend::from_profile("a100-mig-mixed", "n").unwrap();
    let (mut owner, handle) = owner(&sim);
    owner.read().await.unwrap();
    let handle = handle.with_call_deadline(Duration::from_secs(2));
    let gpu0 = sim.snapshot().unwrap().gpus[0].uuid.clone();
    let held = (sim.hold(SimCall::Usage), sim.hold(SimCall::Probe));
    let h = handle.clone();
    let (usage, probe, again) =
        tokio::task::spawn_blocking(move || (h.usage(), h.probe(&gpu0), h.usage()))
            .await
            .unwrap();
    let e = usage.unwrap_err();
    assert!(matches!(e, Error::CallDeadline { .. }), "{e:?}");
    assert!(
        e.to_string().contains("usage did not return within 2s"),
        "{e}"
    );
    let why = probe.unwrap_err();
    assert!(
        why.contains("probe (GPU") && why.contains("within 2s"),
        "{why}"
    );
    // The next scrape does not start a second read behind the stuck one.
    assert!(matches!(again, Err(Error::Overdue { .. })), "{again:?}");
    drop(held);
    let start = std::time::Instant::now();
    while !handle.overdue().is_empty() {
        assert!(start.elapsed() < SOON, "{:?} still runs", handle.overdue());
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(handle.usage().is_ok());
}

#[tokio::test]
async fn the_publication_is_shared_unless_a_reconfiguration_waits_for_its_read() {
    use futures::FutureExt;
    let sim = SimBackend::from_profile("a100-mig-mixed", "n").unwrap();
    let (mut owner, handle) = owner(&sim);
    let watched = Writes::new(Arc::new(sim.clone()), handle.clone());
    assert!(
        matches!(watched.node().now_or_never(), Some(Err(Error::NotRead))),
        "nothing read yet"
    );
    let first = owner.read().await.unwrap();
    let shared = watched.node().now_or_never().expect("published").unwrap();
    assert!(
        Arc::ptr_eq(&shared, &first),
        "the publication itself, not a copy"
    );
    let gpu = first.gpus[0].uuid.clone();
    watched.set_time_slice(&gpu, TimeSlice::Short).unwrap();
    assert!(
        watched.node().now_or_never().is_none(),
        "the read after the change is awaited"
    );
    owner.read().await.unwrap();
    assert!(watched.node().now_or_never().is_some());
}

/// A backend counting its reads.
struct Reads(std::sync::atomic::AtomicU64, SimBackend);

impl DeviceBackend for Reads {
    fn name(&self) -> &'static str {
        "reads"
    }
    fn snapshot(&self) -> Result<Inventory> {
        self.0.fetch_add(1, Ordering::SeqCst);
        self.1.snapshot()
    }
}

/// A health transition is published once, laid over the last read, with no hardware read: the
/// consumers of the watch see it in the next generation.
#[tokio::test]
async fn a_health_transition_is_published_without_a_hardware_read() {
    use crate::inventory::health::{Cause, Fault, HealthState};
    let sim = SimBackend::from_profile("l40s-pcie", "n").unwrap();
    let reads = Arc::new(Reads(std::sync::atomic::AtomicU64::new(0), sim.clone()));
    let (mut owner, handle) =
        Owner::new(reads.clone(), Duration::from_secs(3600), DEADLINE).unwrap();
    owner.read().await.unwrap();
    let (health, watch) = watch::channel(HealthState::default());
    let stop = CancellationToken::new();
    tokio::spawn(owner.run(watch, stop.clone()));
    // The owner runs (and waits) before the transition.
    tokio::task::yield_now().await;
    let mut node = handle.subscribe();
    node.mark_unchanged();
    let before = handle.latest().generation;
    let gpu = sim.snapshot().unwrap().gpus[1].uuid.clone();
    health.send_modify(|s| {
        s.faults.insert(
            gpu.clone(),
            Fault {
                cause: Cause::Xid(79),
                xid: Some(79),
                effect: crate::inventory::TaintEffect::NoSchedule,
                since: tokio::time::Instant::now(),
            },
        );
    });
    tokio::time::timeout(SOON, node.changed())
        .await
        .unwrap()
        .unwrap();
    let p = handle.latest();
    assert_eq!(p.generation, before + 1);
    assert!(matches!(
        p.node().unwrap().gpus[1].health,
        Health::Tainted { .. }
    ));
    assert_eq!(reads.0.load(Ordering::SeqCst), 1, "one read: the first");
    stop.cancel();
}
