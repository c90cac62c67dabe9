//! The supervisor: every long-lived task of `nvdra run`, by name.
//!
//! Invariants:
//! - Every task is spawned through [`Supervisor::spawn`] or [`Supervisor::spawn_last`], with a
//!   name and a tracing span of that name. A task that ends before shutdown was asked for —
//!   returning, failing or panicking — is a failure: `/readyz` fails at once naming it, every
//!   task is stopped, and [`Supervisor::run`] returns [`Error::TaskDied`] naming it, so the
//!   process exits non-zero and the DaemonSet restarts it.
//! - Every long-lived thread is supervised the same way, as a task that watches it
//!   ([`Supervisor::spawn_thread`]): a thread that panics or ends with an error is a dead task.
//!   Threads that serve a task end that task when they die instead (the inventory owner's reader,
//!   the metrics listener's thread); the metrics renderer cannot die (its render runs under
//!   `catch_unwind`, a panic answers 503). Threads that live for one call (a backend call's
//!   deadline, a child's pipes, the CEL parser) are waited on by that call.
//! - Shutdown is in two stages: the serving tasks first (servers drain, sockets go); the
//!   `last` tasks (the checkpoint writer flushing what the servers recorded, the metrics
//!   endpoint answering `/readyz` meanwhile) only once every serving task has stopped.
//! - A second signal, or [`GRACE`] passing, stops waiting.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;

use tokio::signal::unix::{Signal, SignalKind, signal};
use tokio::task::{Id, JoinError, JoinSet};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::{Error, GRACE, Result};
use crate::metrics::Metrics;

/// The two stages of shutdown.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    Serve,
    Last,
}

/// The named tasks of the daemon and their shutdown.
pub(super) struct Supervisor {
    tasks: JoinSet<Result<(), String>>,
    names: HashMap<Id, (&'static str, Stage)>,
    /// Cancels the serving tasks; a child of the caller's stop token.
    shutdown: CancellationToken,
    /// Cancels the `last` tasks, once the serving ones stopped.
    last: CancellationToken,
    signals: Option<(Signal, Signal)>,
    metrics: Arc<Metrics>,
    /// Crash tests only: the task that SIGUSR1 makes panic.
    #[cfg(feature = "crash-points")]
    kill: Option<String>,
}

impl Supervisor {
    pub(super) fn new(stop: &CancellationToken, metrics: Arc<Metrics>) -> Self {
        Self {
            tasks: JoinSet::new(),
            names: HashMap::new(),
            shutdown: stop.child_token(),
            last: CancellationToken::new(),
            signals: None,
            metrics,
            #[cfg(feature = "crash-points")]
            kill: None,
        }
    }

    /// Crash tests only: SIGUSR1 makes the task named `task` panic ([`KILL_ENV`]).
    #[cfg(feature = "crash-points")]
    pub(super) fn kill_on_sigusr1(&mut self, task: Option<String>) {
        self.kill = task;
    }

    /// The token that stops the serving tasks (cancelled on shutdown or a failure).
    pub(super) fn shutdown(&self) -> &CancellationToken {
        &self.shutdown
    }

    /// From here on, SIGTERM and SIGINT stop the daemon (before, they end it at once).
    pub(super) fn install_signals(&mut self) -> Result<()> {
        if self.signals.is_none() {
            let term = signal(SignalKind::terminate()).map_err(Error::Signals)?;
            let int = signal(SignalKind::interrupt()).map_err(Error::Signals)?;
            self.signals = Some((term, int));
        }
        Ok(())
    }

    /// Spawns a serving task: it gets the shutdown token and must run until it is cancelled.
    pub(super) fn spawn<F, E>(
        &mut self,
        name: &'static str,
        task: impl FnOnce(CancellationToken) -> F,
    ) where
        F: Future<Output = Result<(), E>> + Send + 'static,
        E: std::error::Error + 'static,
    {
        let token = self.shutdown.clone();
        self.add(name, Stage::Serve, task(token));
    }

    /// Spawns a task that stops only after every serving task has.
    pub(super) fn spawn_last<F, E>(
        &mut self,
        name: &'static str,
        task: impl FnOnce(CancellationToken) -> F,
    ) where
        F: Future<Output = Result<(), E>> + Send + 'static,
        E: std::error::Error + 'static,
    {
        let token = self.last.clone();
        self.add(name, Stage::Last, task(token));
    }

    /// Supervises `thread` as a serving task named `name`: its panic, or its end with an error,
    /// is a dead task; its end with `Ok` (nothing left to do) is not.
    pub(super) fn spawn_thread(
        &mut self,
        name: &'static str,
        thread: std::thread::JoinHandle<Result<(), String>>,
    ) {
        self.spawn(name, |token| async move {
            // A std thread cannot be awaited: it is looked at every THREAD_CHECK.
            let mut check = tokio::time::interval(THREAD_CHECK);
            while !thread.is_finished() {
                tokio::select! {
                    () = token.cancelled() => return Ok(()),
                    _ = check.tick() => {}
                }
            }
            match thread.join() {
                Ok(Ok(())) => {
                    token.cancelled().await;
                    Ok(())
                }
                Ok(Err(reason)) => Err(ThreadDied(reason)),
                Err(panic) => Err(ThreadDied(format!("panicked: {}", panic_text(panic)))),
            }
        });
    }

    fn add<F, E>(&mut self, name: &'static str, stage: Stage, task: F)
    where
        F: Future<Output = Result<(), E>> + Send + 'static,
        E: std::error::Error + 'static,
    {
        let task = async move { task.await.map_err(|e| crate::report::chain(&e).to_string()) };
        #[cfg(feature = "crash-points")]
        let task = {
            use futures::FutureExt;
            match self.kill.as_deref() {
                Some(k) if k == name => killable(name, task).boxed(),
                _ => task.boxed(),
            }
        };
        let handle = self
            .tasks
            .spawn(task.instrument(tracing::info_span!("task", name)));
        self.names.insert(handle.id(), (name, stage));
    }

    /// Runs until a signal, a stop request or a task ending on its own, then stops every task.
    pub(super) async fn run(mut self) -> Result<()> {
        self.install_signals()?;
        let failure = {
            let Some((term, int)) = self.signals.as_mut() else {
                unreachable!("installed above")
            };
            tokio::select! {
                biased;
                _ = term.recv() => { tracing::info!("SIGTERM: shutting down"); None }
                _ = int.recv() => { tracing::info!("SIGINT: shutting down"); None }
                () = self.shutdown.cancelled() => { tracing::info!("stop requested: shutting down"); None }
                Some(done) = self.tasks.join_next_with_id() => self.failure(done),
            }
        };
        let drained = self.stop().await;
        match (failure, drained) {
            (Some(e), _) => Err(e),
            (None, Err(e)) => Err(e),
            (None, Ok(())) => {
                tracing::info!("stopped");
                Ok(())
            }
        }
    }

    /// Stops every task (the serving ones, then the last ones) within [`GRACE`], unless a
    /// second signal says not to wait. Also for a start that failed half way.
    pub(super) async fn stop(&mut self) -> Result<()> {
        self.shutdown.cancel();
        let Self {
            tasks,
            names,
            last,
            signals,
            ..
        } = self;
        let drain = async {
            loop {
                if !names.values().any(|(_, s)| *s == Stage::Serve) {
                    last.cancel();
                }
                let Some(done) = tasks.join_next_with_id().await else {
                    break;
                };
                let id = match &done {
                    Ok((id, _)) => *id,
                    Err(e) => e.id(),
                };
                let task = names.remove(&id).map_or("unknown", |(n, _)| n);
                match done {
                    Ok((_, Err(e))) => {
                        tracing::warn!(task, error = %e, "task ended with an error while stopping")
                    }
                    Ok((_, Ok(()))) => tracing::debug!(task, "task stopped"),
                    Err(e) => tracing::warn!(task, error = %e, "task panicked while stopping"),
                }
            }
        };
        let second = async {
            match signals {
                Some((term, int)) => tokio::select! {
                    _ = term.recv() => {}
                    _ = int.recv() => {}
                },
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            () = drain => Ok(()),
            () = second => Err(Error::Forced),
            () = tokio::time::sleep(GRACE) => Err(Error::GraceExceeded(GRACE)),
        }
    }

    /// A task that ended before shutdown was asked for is a failure, named; one that ended
    /// because of it (the select saw the task first) is not.
    fn failure(&mut self, done: Result<(Id, Result<(), String>), JoinError>) -> Option<Error> {
        let id = match &done {
            Ok((id, _)) => *id,
            Err(e) => e.id(),
        };
        let task = self.names.remove(&id).map_or("unknown", |(n, _)| n);
        let reason = match done {
            Ok((_, Ok(()))) if self.shutdown.is_cancelled() => return None,
            Ok((_, Ok(()))) => "ended".to_string(),
            Ok((_, Err(e))) => e,
            Err(e) => format!("panicked: {}", panic_message(e)),
        };
        tracing::error!(task, %reason, "critical task stopped; shutting down");
        self.metrics.set_stopped(task, &reason);
        Some(Error::TaskDied { task, reason })
    }
}

/// How often a supervised thread is looked at: how late its death may be noticed.
const THREAD_CHECK: std::time::Duration = std::time::Duration::from_secs(1);

/// Why a supervised thread is dead.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct ThreadDied(String);

/// The panic's message, where it is a string.
fn panic_message(e: JoinError) -> String {
    if !e.is_panic() {
        return e.to_string();
    }
    panic_text(e.into_panic())
}

/// A panic payload's message, where it is a string.
fn panic_text(payload: Box<dyn std::any::Any + Send>) -> String {
    match payload.downcast_ref::<&str>() {
        Some(s) => (*s).to_string(),
        None => match payload.downcast_ref::<String>() {
            Some(s) => s.clone(),
            None => "a panic without a message".into(),
        },
    }
}

/// Crash tests only: the environment variable naming the task that SIGUSR1 kills.
#[cfg(feature = "crash-points")]
pub const KILL_ENV: &str = "NVDRA_TEST_KILL_TASK";

/// `task`, panicking when SIGUSR1 comes first.
#[cfg(feature = "crash-points")]
async fn killable(
    name: &'static str,
    task: impl Future<Output = Result<(), String>>,
) -> Result<(), String> {
    let mut usr1 = match signal(SignalKind::user_defined1()) {
        Ok(s) => s,
        Err(e) => return Err(format!("test hook: cannot install SIGUSR1: {e}")),
    };
    tokio::select! {
        r = task => r,
        _ = usr1.recv() => panic!("test hook: {name} killed by SIGUSR1"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::convert::Infallible;
    use std::sync::atomic::Ordering::Relaxed;

    /// A serving task and a last one, each saying when it stopped.
    fn two_stages(s: &mut Supervisor) -> std::sync::mpsc::Receiver<&'static str> {
        let (tx, rx) = std::sync::mpsc::channel();
        let t = tx.clone();
        s.spawn("server", |token| async move {
            token.cancelled().await;
            t.send("server").unwrap();
            Ok::<(), Infallible>(())
        });
        s.spawn_last("writer", |token| async move {
            token.cancelled().await;
            tx.send("writer").unwrap();
            Ok::<(), Infallible>(())
        });
        rx
    }

    fn ready_metrics() -> Arc<Metrics> {
        let m = Metrics::new();
        m.registered.store(true, Relaxed);
        m.slices.published.store(true, Relaxed);
        m
    }

    #[tokio::test]
    async fn a_task_that_panics_is_named_unreadies_and_stops_the_others_in_order() {
        let metrics = ready_metrics();
        let stop = CancellationToken::new();
        let mut s = Supervisor::new(&stop, metrics.clone());
        let stopped = two_stages(&mut s);
        s.spawn("doomed", |_| async move {
            if true {
                panic!("boom");
            }
            Ok::<(), Infallible>(())
        });
        let e = s.run().await.unwrap_err();
        match &e {
            Error::TaskDied { task, reason } => {
                assert_eq!(*task, "doomed");
                assert!(reason.contains("panicked: boom"), "{reason}");
            }
            e => panic!("{e:?}"),
        }
        assert!(!metrics.ready(), "/readyz fails");
        let order: Vec<&str> = stopped.try_iter().collect();
        assert_eq!(order, ["server", "writer"], "the last task stops last");
    }

    #[tokio::test]
    async fn a_task_that_returns_is_a_failure_and_a_requested_stop_is_not() {
        let metrics = ready_metrics();
        let stop = CancellationToken::new();
        let mut s = Supervisor::new(&stop, metrics.clone());
        let _stopped = two_stages(&mut s);
        s.spawn("quitter", |_| async { Ok::<(), Infallible>(()) });
        let e = s.run().await.unwrap_err();
        assert!(
            e.to_string()
                .contains("task quitter stopped unexpectedly: ended"),
            "{e}"
        );

        let metrics = ready_metrics();
        let stop = CancellationToken::new();
        let mut s = Supervisor::new(&stop, metrics.clone());
        let stopped = two_stages(&mut s);
        stop.cancel();
        s.run().await.unwrap();
        assert!(metrics.ready(), "a stop asked for is no failure");
        let order: Vec<&str> = stopped.try_iter().collect();
        assert_eq!(order, ["server", "writer"]);
    }

    /// A supervised thread that panics or ends with an error is a dead task, named with why; one
    /// that ends `Ok` (nothing to watch) is not, and shutdown goes on as asked.
    #[tokio::test]
    async fn a_thread_that_panics_or_fails_is_a_dead_task_and_one_that_is_done_is_not() {
        let panics = std::thread::spawn(|| -> Result<(), String> { panic!("boom") });
        let fails = std::thread::spawn(|| Err("the event set is gone".to_string()));
        for (thread, reason) in [(panics, "panicked: boom"), (fails, "the event set is gone")] {
            let metrics = ready_metrics();
            let stop = CancellationToken::new();
            let mut s = Supervisor::new(&stop, metrics.clone());
            let stopped = two_stages(&mut s);
            s.spawn_thread("events", thread);
            // A deadline, not a timing: without supervision the run would wait for a signal.
            let run = tokio::time::timeout(std::time::Duration::from_secs(60), s.run());
            match run.await.expect("the dead thread is noticed").unwrap_err() {
                Error::TaskDied { task, reason: r } => {
                    assert_eq!((task, r.as_str()), ("events", reason));
                }
                e => panic!("{e:?}"),
            }
            assert!(!metrics.ready(), "/readyz fails");
            let order: Vec<&str> = stopped.try_iter().collect();
            assert_eq!(order, ["server", "writer"]);
        }

        let metrics = ready_metrics();
        let stop = CancellationToken::new();
        let mut s = Supervisor::new(&stop, metrics.clone());
        let _stopped = two_stages(&mut s);
        let done = std::thread::spawn(|| Ok(()));
        while !done.is_finished() {
            std::thread::yield_now();
        }
        s.spawn_thread("events", done);
        // Past the thread's end (THREAD_CHECK): the run goes on until asked to stop.
        let stopper = tokio::spawn(async move {
            tokio::time::sleep(2 * THREAD_CHECK).await;
            stop.cancel();
        });
        s.run().await.unwrap();
        stopper.await.unwrap();
        assert!(metrics.ready(), "a thread done with its work is no failure");
    }

    /// `GET path` on `addr`: the whole answer.
    async fn get(addr: std::net::SocketAddr, path: &str) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(
            format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await
        .unwrap();
        let mut buf = String::new();
        s.read_to_string(&mut buf).await.unwrap();
        buf
    }

    /// While the serving tasks drain after a task died, `/readyz` (served by the last task, as
    /// the daemon runs it) answers 503 naming the dead task. Asserted unconditionally: the
    /// serving task here holds its drain until the answer is read, where the crash test of the
    /// whole process (`tests/integration/dra_crash.rs`) sees the 503 only when its poll lands
    /// before the process exits.
    #[tokio::test]
    async fn while_the_others_drain_readyz_answers_503_naming_the_dead_task() {
        let metrics = ready_metrics();
        let stop = CancellationToken::new();
        let mut s = Supervisor::new(&stop, metrics.clone());
        let listener = crate::metrics::server::bind(([127, 0, 0, 1], 0).into())
            .await
            .unwrap();
        let addr = listener.local_addr().unwrap();
        let m = metrics.clone();
        s.spawn_last("metrics", |token| async move {
            crate::metrics::server::serve(listener, m, None, token).await;
            Ok::<(), Infallible>(())
        });
        let (draining, drain_started) = tokio::sync::oneshot::channel::<()>();
        let (release, released) = tokio::sync::oneshot::channel::<()>();
        s.spawn("server", |token| async move {
            token.cancelled().await;
            draining.send(()).unwrap();
            released.await.unwrap();
            Ok::<(), Infallible>(())
        });
        let r = get(addr, "/readyz").await;
        assert!(r.starts_with("HTTP/1.1 200"), "{r}");
        s.spawn("doomed", |_| async move {
            if true {
                panic!("boom");
            }
            Ok::<(), Infallible>(())
        });
        let probe = async {
            drain_started.await.unwrap();
            let r = get(addr, "/readyz").await;
            release.send(()).unwrap();
            r
        };
        let (result, r) = tokio::join!(s.run(), probe);
        assert!(r.starts_with("HTTP/1.1 503"), "{r}");
        assert!(r.contains("task doomed stopped"), "{r}");
        assert!(
            matches!(result, Err(Error::TaskDied { task: "doomed", .. })),
            "{result:?}"
        );
    }
}
