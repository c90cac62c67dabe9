//! Waiting for what should happen soon: polled, and always with a deadline, so a condition that
//! never comes fails the test naming what it waited for instead of hanging the run. The
//! deadline only bounds a failure; it asserts no speed (benchmarks measure that). nvdra's tests
//! and benches include this file too (`#[path]`).
// Each test binary uses what it needs.
#![allow(dead_code)]

use std::future::Future;
use std::time::Duration;

/// The deadline for what follows at once from the test's own step: far above any run on a
/// loaded 2-core machine, far below a hang.
pub const SOON: Duration = Duration::from_secs(30);

/// Between two probes.
const POLL: Duration = Duration::from_millis(10);

/// Probes until `probe` gives a value and returns it; panics naming `what` after `deadline`.
/// A probe may itself panic (a process that exited, a task that ended) to fail at once.
pub async fn until<T, F>(what: &str, deadline: Duration, mut probe: impl FnMut() -> F) -> T
where
    F: Future<Output = Option<T>>,
{
    let wait = async {
        loop {
            if let Some(value) = probe().await {
                return value;
            }
            tokio::time::sleep(POLL).await;
        }
    };
    match tokio::time::timeout(deadline, wait).await {
        Ok(value) => value,
        Err(_) => panic!("waited {deadline:?} for {what}, in vain"),
    }
}

/// Until `cond` holds, within [`SOON`].
pub async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    until(what, SOON, || std::future::ready(cond().then_some(()))).await
}

/// [`eventually`] for a test without a runtime: the calling thread sleeps between probes.
pub fn blocking(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + SOON;
    while !cond() {
        assert!(
            std::time::Instant::now() < deadline,
            "waited {SOON:?} for {what}, in vain"
        );
        std::thread::sleep(POLL);
    }
}
