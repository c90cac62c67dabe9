//! The tokio runtime the daemon runs on, sized for a node agent rather than for the node: a
//! fixed few workers and a bounded blocking pool.

use std::time::Duration;

/// Worker threads of the daemon's runtime. Its work is a few sockets, a watch and timers, with
/// NVML and file writes on the blocking pool; one worker per core (tokio's default) would be
/// 100–200 idle threads, stacks and run queues on a GPU node.
pub const WORKER_THREADS: usize = 2;

/// Most threads of the blocking pool (NVML calls, fsync'd writes, directory-API reads; each
/// short). A batch of claims larger than this queues instead of starting a thread per claim.
/// Nothing a network peer asks for runs here: `/metrics` renders on its own thread
/// ([`crate::metrics::server`]).
pub const MAX_BLOCKING_THREADS: usize = 8;

/// The runtime `nvdra run` (and the demo's daemon) runs on: [`WORKER_THREADS`] workers,
/// at most [`MAX_BLOCKING_THREADS`] blocking threads, which exit after 10 s idle. (glibc's
/// malloc is tuned where the daemon is deployed: the DaemonSet sets `GLIBC_TUNABLES`.)
pub fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(WORKER_THREADS)
        .max_blocking_threads(MAX_BLOCKING_THREADS)
        .thread_keep_alive(Duration::from_secs(10))
        .thread_name("nvdra")
        .enable_all()
        .build()
}
