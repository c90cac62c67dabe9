//! Fault injection for simulated GPUs at run time: a watched file (`--fault-file`).
//!
//! A file rather than a control socket: any tool can write it (`echo xid 3 79 >> faults`,
//! `kubectl exec … -- sh -c 'echo … >> …'`, a test's `std::fs::write`), it needs no client and
//! no protocol, it works the same inside a container as outside, and it leaves a record of what
//! was injected. Polling it (every [`POLL`]) instead of inotify keeps it dependency-free and sees a
//! file that was replaced or created late.
//!
//! Each complete line appended is one fault, GPUs named by index or UUID:
//!
//! ```text
//! xid 3 79      # a critical (or ignored, per the XID policy) XID on GPU 3
//! xid 3 94 gi=2 # the same, attributed to GPU instance 2 of GPU 3 (all its compute instances)
//! xid 3 94 gi=2 ci=0   # ... to compute instance 0 of GPU instance 2
//! ecc 3         # a double-bit ECC error
//! lost 3        # GPU 3 stops answering: unhealthy, and its probe fails until `back 3`
//! back 3        # GPU 3 answers again (it recovers after the quiet period)
//! process 3 4242 2048   # a process (pid 4242, 2048 MiB) runs on GPU 3: it blocks a MIG mode change
//! holder 3 900 nv-hostengine   # a process holds GPU 3 open (nvidia-persistenced: harmlessly)
//! exit 3 4242   # it ended
//! ```
//!
//! `process`, `holder` and `exit` lines are the simulated backend's
//! ([`SimBackend::with_process_file`](crate::inventory::sim::SimBackend::with_process_file)),
//! skipped here.
//!
//! An XID with `gi=` is sent as NVML sends one it attributes to a MIG instance: with the MIG
//! devices of the node (the inventory owner's latest publication) that have those ids when the
//! line is read (none, if there are
//! none: the monitor then counts it for the whole GPU).
//!
//! `#` starts a comment; a line that is not one of these is logged and skipped. A file that
//! shrinks (truncated or replaced) is read again from its start.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::{Event, EventKind, Instance, Probe};
use crate::inventory::{GpuUuid, Inventory, MigUuid, owner};

/// How often the file is read.
pub const POLL: Duration = Duration::from_millis(250);

/// A line of the fault file, parsed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Command {
    Event(Event),
    Lost(GpuUuid),
    Back(GpuUuid),
}

/// Why a line was skipped.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LineError {
    #[error(
        "unknown fault {0:?}; write xid GPU XID [gi=ID [ci=ID]], ecc GPU, lost GPU or back GPU"
    )]
    Unknown(String),
    #[error("no GPU {0:?} on this node (give an index or a UUID)")]
    NoGpu(String),
    #[error("{0:?} is not an XID")]
    BadXid(String),
    #[error("{0:?} is not a MIG instance id; write gi=ID or ci=ID (a whole number)")]
    BadInstance(String),
}

/// Parses one line against the node's GPUs; `Ok(None)` for blank and comment lines.
pub fn parse_line(line: &str, inv: &Inventory) -> Result<Option<Command>, LineError> {
    let line = line.split('#').next().unwrap_or_default().trim();
    if line.is_empty() {
        return Ok(None);
    }
    let words: Vec<&str> = line.split_whitespace().collect();
    let gpu = |w: &str| {
        inv.gpus
            .iter()
            .find(|g| g.uuid.as_str() == w || w.parse::<u32>().is_ok_and(|i| g.index == i))
            .map(|g| g.uuid.clone())
            .ok_or_else(|| LineError::NoGpu(w.to_string()))
    };
    let event = |g, kind| Command::Event(Event::gpu(g, kind));
    let id = |w: &str, key: &str| {
        w.strip_prefix(key)
            .and_then(|n| n.parse::<u32>().ok())
            .ok_or_else(|| LineError::BadInstance(w.to_string()))
    };
    Ok(Some(match words.as_slice() {
        ["xid", g, x, ids @ ..] if ids.len() <= 2 => {
            let xid = x.parse().map_err(|_| LineError::BadXid(x.to_string()))?;
            let g = gpu(g)?;
            let instance = match ids {
                [] => None,
                [gi] => Some((id(gi, "gi=")?, None)),
                [gi, ci] => Some((id(gi, "gi=")?, Some(id(ci, "ci=")?))),
                _ => return Err(LineError::Unknown(line.to_string())),
            };
            let instance = instance.map(|(gi, ci)| Instance {
                gpu_instance: gi,
                compute_instance: ci,
                devices: mig_devices(inv, &g, gi, ci),
            });
            Command::Event(Event {
                gpu: g,
                kind: EventKind::Xid(xid),
                instance,
            })
        }
        ["ecc", g] => event(gpu(g)?, EventKind::DoubleBitEcc),
        ["lost", g] => Command::Lost(gpu(g)?),
        ["back", g] => Command::Back(gpu(g)?),
        // The simulated backend's processes.
        ["process", ..] | ["holder", ..] | ["exit", ..] => return Ok(None),
        _ => return Err(LineError::Unknown(line.to_string())),
    }))
}

/// The MIG devices of `gpu` in `inv` with GPU instance id `gi` (and compute instance id `ci`,
/// where given).
fn mig_devices(inv: &Inventory, gpu: &GpuUuid, gi: u32, ci: Option<u32>) -> Vec<MigUuid> {
    inv.gpus
        .iter()
        .filter(|g| g.uuid == *gpu)
        .flat_map(|g| &g.mig.devices)
        .filter(|m| m.gi_id == gi && ci.is_none_or(|ci| m.ci_id == ci))
        .map(|m| m.uuid.clone())
        .collect()
}

/// The GPUs the fault file says are lost: their probe fails.
#[derive(Clone, Default)]
struct Lost(Arc<Mutex<BTreeSet<GpuUuid>>>);

struct SimProbe {
    lost: Lost,
    inner: Arc<dyn Probe>,
}

impl Probe for SimProbe {
    fn probe(&self, gpu: &GpuUuid) -> Result<(), String> {
        if crate::lock::lock(&self.lost.0).contains(gpu) {
            return Err("lost (fault file)".into());
        }
        self.inner.probe(gpu)
    }

    fn mig_devices(&self) -> Option<BTreeSet<MigUuid>> {
        self.inner.mig_devices()
    }
}

/// The watcher of one fault file.
pub struct FaultFile {
    path: PathBuf,
    /// The hardware's probe, which the file's lost GPUs fail.
    probe: Arc<dyn Probe>,
    lost: Lost,
    poll: Duration,
}

impl FaultFile {
    pub fn new(path: PathBuf, probe: Arc<dyn Probe>) -> Self {
        Self {
            path,
            probe,
            lost: Lost::default(),
            poll: POLL,
        }
    }

    /// The probe the monitor should use: the hardware's, failing for GPUs the file lost.
    pub fn probe(&self) -> Arc<dyn Probe> {
        Arc::new(SimProbe {
            lost: self.lost.clone(),
            inner: self.probe.clone(),
        })
    }

    /// Reads the file every [`POLL`] until `shutdown`, sending what new lines say about the
    /// GPUs of `node`'s latest publication.
    pub async fn run(
        self,
        events: mpsc::Sender<Event>,
        node: owner::Watch,
        shutdown: CancellationToken,
    ) {
        let mut offset = 0usize;
        let mut tick = tokio::time::interval(self.poll);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tracing::info!(file = %self.path.display(), "fault injection: watching");
        loop {
            tokio::select! {
                biased;
                () = shutdown.cancelled() => return,
                _ = tick.tick() => {}
            }
            // A small local file read inline: it keeps paused-time tests deterministic, and
            // the simulated backend is for demos and tests only.
            let Ok(text) = std::fs::read_to_string(&self.path) else {
                continue;
            };
            if text.len() < offset {
                offset = 0;
            }
            // Only complete lines: a writer may be half-way through one.
            let Some(end) = text[offset..].rfind('\n').map(|i| offset + i + 1) else {
                continue;
            };
            let new = &text[offset..end];
            offset = end;
            let inv = node.borrow().node();
            let inv = match inv {
                Ok(inv) => inv,
                Err(e) => {
                    tracing::warn!(error = %crate::report::chain(&e), "fault injection: cannot read the inventory; lines skipped");
                    continue;
                }
            };
            for line in new.lines() {
                match parse_line(line, &inv) {
                    Ok(None) => {}
                    Ok(Some(cmd)) => {
                        tracing::info!(fault = line.trim(), "fault injected");
                        if !self.apply(cmd, &events).await {
                            return;
                        }
                    }
                    Err(e) => tracing::warn!(line, error = %e, "fault file: line skipped"),
                }
            }
        }
    }

    /// False when the monitor is gone.
    async fn apply(&self, cmd: Command, events: &mpsc::Sender<Event>) -> bool {
        let ev = match cmd {
            Command::Event(ev) => ev,
            Command::Lost(gpu) => {
                crate::lock::lock(&self.lost.0).insert(gpu.clone());
                Event::gpu(gpu, EventKind::GpuLost)
            }
            Command::Back(gpu) => {
                crate::lock::lock(&self.lost.0).remove(&gpu);
                return true;
            }
        };
        events.send(ev).await.is_ok()
    }
}
