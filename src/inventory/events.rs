//! Health events as backends report them: which GPU, and what happened. The health monitor
//! (`crate::health`) judges them; backends only translate what the hardware says.

use super::GpuUuid;

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

/// One health event of one GPU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Event {
    pub gpu: GpuUuid,
    pub kind: EventKind,
}

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
