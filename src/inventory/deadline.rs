//! Backend calls with a deadline: each runs on a thread of its own while its caller waits at
//! most the deadline. A call that passes it is reported as [`Error::CallDeadline`] naming the
//! call, and goes on in the background (a thread blocked in NVML cannot be stopped).
//!
//! Invariants:
//! - At most one call per [`Lane`] is ever past its deadline: while one is, every new call of
//!   that lane fails at once with [`Error::Overdue`] naming the stuck one, so threads never pile
//!   up behind a hung driver.
//! - A write that passed its deadline is never raced: no other write starts until it returned,
//!   so what prepare undoes or redoes next sees the hardware as that write left it. Its caller
//!   was told it failed, so no record claims it done; a rollback that meets the stuck write fails
//!   too and is repeated by the kubelet's retry (or start-up), after the write returned.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::{Error, Result};
use crate::lock::lock;

/// Calls that exclude each other only once one of them is past its deadline.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Lane {
    /// Reconfigurations (MIG devices, time slices, compute modes) and the compute-mode read
    /// that decides them.
    Write,
    /// Live readings for `/metrics` ([`super::DeviceBackend::usage`]).
    Usage,
    /// The health monitor's recovery probes.
    Probe,
}

/// The calls of one backend, each under `after`.
#[derive(Clone, Debug)]
pub struct Deadlines {
    backend: &'static str,
    after: Duration,
    /// The call of each lane that passed its deadline and has not returned yet.
    overdue: Arc<Mutex<BTreeMap<Lane, String>>>,
}

impl Deadlines {
    pub fn new(backend: &'static str, after: Duration) -> Self {
        Self {
            backend,
            after,
            overdue: Arc::default(),
        }
    }

    /// Runs `f` (named `call` in errors) on a thread of its own and waits for it at most the
    /// deadline.
    pub fn call<T: Send + 'static>(
        &self,
        lane: Lane,
        call: String,
        f: impl FnOnce() -> Result<T> + Send + 'static,
    ) -> Result<T> {
        if let Some(stuck) = lock(&self.overdue).get(&lane) {
            return Err(Error::Overdue {
                backend: self.backend,
                call,
                stuck: stuck.clone(),
                after: self.after,
            });
        }
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let overdue = self.overdue.clone();
        std::thread::Builder::new()
            .name("nvdra-backend".into())
            .spawn(move || {
                let result = f();
                // Under the lock: the caller decides under it whether it still waits.
                let mut overdue = lock(&overdue);
                if tx.send(result).is_err() {
                    // The caller gave up and marked the lane; this call is over now.
                    overdue.remove(&lane);
                }
            })
            .map_err(|source| Error::Thread {
                call: call.clone(),
                source,
            })?;
        match rx.recv_timeout(self.after) {
            Ok(result) => result,
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => Err(Error::CallPanicked {
                backend: self.backend,
                call,
            }),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                let mut overdue = lock(&self.overdue);
                // It may have returned just now.
                if let Ok(result) = rx.try_recv() {
                    return result;
                }
                overdue.insert(lane, call.clone());
                // Dropped under the lock: the thread's send then fails and clears the mark.
                drop(rx);
                tracing::warn!(backend = self.backend, call = %call, after = ?self.after,
                    "a backend call passed its deadline; it goes on in the background");
                Err(Error::CallDeadline {
                    backend: self.backend,
                    call,
                    after: self.after,
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    impl Deadlines {
        /// The calls past their deadline that still run (empty when none is).
        pub(crate) fn overdue(&self) -> Vec<String> {
            lock(&self.overdue).values().cloned().collect()
        }
    }

    /// A call held until the test lets it go: past any deadline, whatever the machine's speed.
    fn held() -> (
        std::sync::mpsc::Sender<()>,
        impl FnOnce() -> Result<u32> + Send,
    ) {
        let (go, wait) = std::sync::mpsc::channel::<()>();
        (go, move || {
            let _ = wait.recv();
            Ok(7)
        })
    }

    /// Waits (at most a minute) until nothing is overdue.
    fn until_idle(d: &Deadlines) {
        let start = std::time::Instant::now();
        while !d.overdue().is_empty() {
            assert!(start.elapsed() < Duration::from_secs(60), "still overdue");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn a_stuck_call_is_named_and_its_lane_refuses_until_it_returns() {
        let d = Deadlines::new("simulated", Duration::from_millis(50));
        let (go, stuck) = held();
        let e = d
            .call(Lane::Write, "create_mig (GPU G0)".into(), stuck)
            .unwrap_err();
        assert!(matches!(e, Error::CallDeadline { .. }), "{e:?}");
        assert_eq!(
            e.to_string(),
            "the simulated backend's create_mig (GPU G0) did not return within 50ms; it goes on \
             in the background"
        );
        assert_eq!(d.overdue(), vec!["create_mig (GPU G0)".to_string()]);
        // Another write is refused at once, naming the stuck one; other lanes still run.
        let e = d
            .call(Lane::Write, "destroy_mig (GPU G0)".into(), || Ok(1))
            .unwrap_err();
        assert!(matches!(e, Error::Overdue { .. }), "{e:?}");
        let said = e.to_string();
        assert!(said.contains("destroy_mig (GPU G0)"), "{said}");
        assert!(said.contains("create_mig (GPU G0)"), "{said}");
        // Other lanes are not held up (a generous deadline: this call returns at once).
        let d2 = Deadlines {
            after: Duration::from_secs(60),
            ..d.clone()
        };
        assert_eq!(d2.call(Lane::Usage, "usage".into(), || Ok(2)).unwrap(), 2);
        // Once the stuck call returns, the lane is free again.
        go.send(()).unwrap();
        until_idle(&d);
        assert_eq!(d2.call(Lane::Write, "again".into(), || Ok(3)).unwrap(), 3);
    }

    #[test]
    fn a_call_within_its_deadline_returns_its_result() {
        let d = Deadlines::new("simulated", Duration::from_secs(60));
        assert_eq!(d.call(Lane::Probe, "probe".into(), || Ok(5)).unwrap(), 5);
        let e = d
            .call::<()>(Lane::Probe, "probe".into(), || {
                Err(Error::Refused("no".into()))
            })
            .unwrap_err();
        assert_eq!(e.to_string(), "no");
        assert!(d.overdue().is_empty());
    }
}
