//! Health events as backends report them: which GPU (and, for an event NVML attributes to one,
//! which MIG instance), and what happened. The health monitor (`crate::health`) judges them;
//! backends only translate what the hardware says.

use super::{GpuUuid, MigUuid};

/// What a GPU event says happened.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EventKind {
    /// A critical XID error (NVML `nvmlEventTypeXidCriticalError`), with its XID.
    Xid(u64),
    /// A double-bit ECC error (`nvmlEventTypeDoubleBitEccError`).
    DoubleBitEcc,
    /// The GPU is gone (`NVML_ERROR_GPU_IS_LOST`, a failed probe of a vanished GPU).
    GpuLost,
    /// The GPU's events cannot be watched (registration refused); the reason says why.
    Unmonitored(String),
}

/// The MIG instance an event happened in: NVML's `gpuInstanceId` and `computeInstanceId` of
/// the event (set by the driver for an XID it can attribute to a GPU instance of a GPU in MIG
/// mode; `0xFFFFFFFF` otherwise), and the MIG devices they named when the event was read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Instance {
    pub gpu_instance: u32,
    /// `None` when the event names the GPU instance alone (all its compute instances).
    pub compute_instance: Option<u32>,
    /// The MIG devices of that GPU instance (of that compute instance, where one is named) the
    /// source found when it read the event. Read there, not later, because MIG UUIDs are made
    /// anew at each creation while instance ids are reused: a fault recorded by UUID ends with
    /// the instance it hit. Empty when the source found none (the event then counts for the
    /// whole GPU).
    pub devices: Vec<MigUuid>,
}

impl std::fmt::Display for Instance {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GPU instance {}", self.gpu_instance)?;
        match self.compute_instance {
            Some(ci) => write!(f, ", compute instance {ci}"),
            None => Ok(()),
        }
    }
}

/// One health event of one GPU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Event {
    pub gpu: GpuUuid,
    pub kind: EventKind,
    /// The MIG instance NVML attributed the event to; `None` for a GPU-wide event.
    pub instance: Option<Instance>,
}

impl Event {
    /// A GPU-wide event.
    pub fn gpu(gpu: GpuUuid, kind: EventKind) -> Self {
        Self {
            gpu,
            kind,
            instance: None,
        }
    }
}

/// A backend's event thread. It ends `Ok` once nobody listens (or when there is nothing to
/// watch), `Err` naming why it cannot watch any more; the daemon supervises it.
pub type EventThread = std::thread::JoinHandle<Result<(), String>>;

/// Where a backend's event thread sends events (from a plain thread: sending may block).
pub trait EventSink: Send + 'static {
    /// Delivers `event`; `false` when nobody listens any more and the thread should end.
    fn send(&self, event: Event) -> bool;
    /// True once nobody listens: the thread checks it between waits.
    fn is_closed(&self) -> bool;
}

impl EventSink for tokio::sync::mpsc::Sender<Event> {
    fn send(&self, event: Event) -> bool {
        self.blocking_send(event).is_ok()
    }

    fn is_closed(&self) -> bool {
        tokio::sync::mpsc::Sender::is_closed(self)
    }
}
