//! Crash points for the SIGKILL tests (`tests/integration/dra_crash.rs`), compiled only with the
//! `crash-points` feature (which `cargo test` turns on through the package's dev-dependency on
//! itself); a release build has none of this.
//!
//! A process started with [`CRASH_ENV`] naming a [`CrashPoint`] stops dead there (the thread
//! parks forever) after dropping [`CRASH_MARKER`] in the plugin directory, so the test can
//! SIGKILL it exactly at that step.

use std::future::Future;

use super::Plugin;

/// Environment variable naming a [`CrashPoint`].
pub const CRASH_ENV: &str = "NVDRA_TEST_CRASH_AT";
/// The file (in the plugin directory) a process stopped at its crash point leaves behind.
pub const CRASH_MARKER: &str = "test-crash-point-reached";

/// Where a crash test makes prepare or unprepare stop. A claim that changes GPU state passes the
/// prepare points in order; for one that does not (its spec and record are written in parallel),
/// each point is one of the states a crash can leave: nothing written, the spec only, the record
/// only, both. Unprepare (any rollback) passes [`CrashPoint::AfterUndo`], then one of the two
/// halves of its parallel removals.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CrashPoint {
    /// Reconfiguring: `PrepareStarted` is durable, nothing else is done. Otherwise: the claim is
    /// reserved in memory, nothing is written.
    AfterStarted,
    /// Dynamic MIG: the GPU's MIG mode was turned on (recorded durably before, with
    /// `PrepareStarted`); no instance is created.
    AfterMigModeOn,
    /// Dynamic MIG: the driver refused a MIG mode switch (`IN_USE`, `RESET_REQUIRED`) and left
    /// the change pending; it is not withdrawn yet.
    AfterMigModeRefused,
    /// A MIG instance (GPU and compute instance: the backend makes both in one call, and a GPU
    /// instance a crash leaves without its compute instance is nobody's, destroyed when it is
    /// in the way) was created; its UUID is not durable.
    AfterMigCreated,
    /// The CDI spec is written; the claim's record is not durable.
    AfterCdi,
    /// Reconfiguring: `PrepareCompleted` is recorded in memory but not on disk. Otherwise: the
    /// completed record is durable, the spec is not written.
    BeforeCompleted,
    /// Everything is durable; the reply was not sent.
    AfterCompleted,
    /// Rollback (an unprepare, or undoing a failed prepare): the GPU is back (MIG instances
    /// destroyed, time slices reset, MPS daemons stopped); the claim's spec and entry remain.
    AfterUndo,
    /// Dynamic MIG, unprepare: the claim's MIG instances are destroyed; the GPU's MIG mode is
    /// not turned off yet.
    BeforeMigModeOff,
    /// Dynamic MIG: the GPU's MIG mode was turned off (after its last instance, or for a claim
    /// of the GPU whole); the checkpoint still records it as turned on by nvdra.
    AfterMigModeOff,
    /// Rollback: the GPU is back and the spec removed; the entry is still durable.
    AfterSpecRemoved,
    /// Rollback: the GPU is back and the entry's removal durable; the spec remains.
    AfterForgotten,
}

/// A [`CRASH_ENV`] value that names no crash point.
#[derive(Debug, thiserror::Error)]
#[error(
    "{CRASH_ENV}={value:?}: expected after-started, after-mig-mode-on, \
     after-mig-mode-refused, after-mig-created, after-cdi, before-completed, after-completed, \
     after-undo, before-mig-mode-off, after-mig-mode-off, after-spec-removed or \
     after-forgotten"
)]
pub struct BadCrashPoint {
    pub value: String,
}

impl std::str::FromStr for CrashPoint {
    type Err = BadCrashPoint;
    fn from_str(s: &str) -> Result<Self, BadCrashPoint> {
        Ok(match s {
            "after-started" => Self::AfterStarted,
            "after-mig-mode-on" => Self::AfterMigModeOn,
            "after-mig-mode-refused" => Self::AfterMigModeRefused,
            "after-mig-created" => Self::AfterMigCreated,
            "before-mig-mode-off" => Self::BeforeMigModeOff,
            "after-mig-mode-off" => Self::AfterMigModeOff,
            "after-cdi" => Self::AfterCdi,
            "before-completed" => Self::BeforeCompleted,
            "after-completed" => Self::AfterCompleted,
            "after-undo" => Self::AfterUndo,
            "after-spec-removed" => Self::AfterSpecRemoved,
            "after-forgotten" => Self::AfterForgotten,
            _ => {
                return Err(BadCrashPoint {
                    value: s.to_string(),
                });
            }
        })
    }
}

/// The crash point [`CRASH_ENV`] names, if it is set.
pub fn from_env() -> Result<Option<CrashPoint>, BadCrashPoint> {
    match std::env::var(CRASH_ENV) {
        Ok(v) => v.parse().map(Some),
        Err(_) => Ok(None),
    }
}

impl Plugin {
    /// Makes this plugin stop at `at` (set once, before serving).
    pub fn stop_at(&self, at: CrashPoint) {
        if self.inner.crash_at.set(at).is_err() {
            tracing::warn!("crash point already set; keeping the first");
        }
    }

    /// Stops dead at `at` if that is the point set.
    pub(super) fn crash(&self, at: CrashPoint) {
        if self.inner.crash_at.get() == Some(&at) {
            tracing::error!(?at, "{CRASH_ENV} reached; waiting to be killed");
            let marker = self.inner.opts.plugin_dir.join(CRASH_MARKER);
            if let Err(e) = std::fs::write(&marker, format!("{at:?}\n")) {
                tracing::error!(error = %e, "cannot write {}; aborting instead", marker.display());
                std::process::abort();
            }
            loop {
                std::thread::park();
            }
        }
    }

    /// The parallel spec and record writes of a claim that changes nothing on the GPU. At
    /// [`CrashPoint::AfterCdi`] and [`CrashPoint::BeforeCompleted`] one write runs alone and the
    /// process stops before the other starts, so each half-written state is reached for sure.
    pub(super) async fn crash_between<A: Future, B: Future>(
        &self,
        spec: A,
        record: B,
    ) -> (A::Output, B::Output) {
        self.crash_between_at(
            (spec, CrashPoint::AfterCdi),
            (record, CrashPoint::BeforeCompleted),
        )
        .await
    }

    /// The parallel spec removal and entry removal of a rollback: at
    /// [`CrashPoint::AfterSpecRemoved`] and [`CrashPoint::AfterForgotten`] one half runs alone
    /// and the process stops before the other starts.
    pub(super) async fn crash_between_removals<A: Future, B: Future>(
        &self,
        spec: A,
        record: B,
    ) -> (A::Output, B::Output) {
        self.crash_between_at(
            (spec, CrashPoint::AfterSpecRemoved),
            (record, CrashPoint::AfterForgotten),
        )
        .await
    }

    /// Runs `a` and `b` in parallel, unless the crash point set is one of theirs: then that one
    /// runs alone and the process stops there.
    async fn crash_between_at<A: Future, B: Future>(
        &self,
        (a, a_alone): (A, CrashPoint),
        (b, b_alone): (B, CrashPoint),
    ) -> (A::Output, B::Output) {
        match self.inner.crash_at.get() {
            Some(&at) if at == a_alone => {
                let a = a.await;
                self.crash(at);
                (a, b.await)
            }
            Some(&at) if at == b_alone => {
                let b = b.await;
                self.crash(at);
                (a.await, b)
            }
            _ => tokio::join!(a, b),
        }
    }
}
