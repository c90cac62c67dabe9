//! The tokio runtime the daemon runs on, sized for a node agent rather than for the node: a
//! fixed few workers, a bounded blocking pool, and (glibc) a bounded number of malloc arenas
//! and no per-thread malloc caches.

use std::time::Duration;

/// Worker threads of the daemon's runtime. Its work is a few sockets, a watch and timers, with
/// NVML and file writes on the blocking pool; one worker per core (tokio's default) would be
/// 100–200 idle threads, stacks and run queues on a GPU node.
pub const WORKER_THREADS: usize = 2;

/// Most threads of the blocking pool (NVML calls, fsync'd writes, directory-API reads; each
/// short). A batch of claims larger than this queues instead of starting a thread per claim.
pub const MAX_BLOCKING_THREADS: usize = 8;

/// Most malloc arenas. glibc gives each new thread its own arena (up to 8 per core) and keeps
/// the memory a thread freed in it for that arena's next user; with blocking threads that come
/// and go, that is resident memory no one uses (benches/rss.rs). The daemon allocates little
/// and rarely from several threads at once, so two arenas cost it no contention.
pub const MALLOC_ARENAS: i32 = 2;

/// The runtime `nvdra run` (and the demo's daemon) runs on: [`WORKER_THREADS`] workers,
/// at most [`MAX_BLOCKING_THREADS`] blocking threads, which exit after 10 s idle, sharing at
/// most [`MALLOC_ARENAS`] malloc arenas (glibc).
pub fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    limit_malloc_arenas();
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(WORKER_THREADS)
        .max_blocking_threads(MAX_BLOCKING_THREADS)
        .thread_keep_alive(Duration::from_secs(10))
        .thread_name("nvdra")
        .enable_all()
        .build()
}

/// Caps glibc's arenas at [`MALLOC_ARENAS`], before the runtime starts its threads. An operator's
/// `MALLOC_ARENA_MAX` wins. Elsewhere (musl) there is nothing to cap.
fn limit_malloc_arenas() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    if std::env::var_os("MALLOC_ARENA_MAX").is_none() {
        // SAFETY: mallopt only sets an allocator parameter; it takes no pointers, and glibc
        // serialises it against allocation in other threads.
        let ok = unsafe { libc::mallopt(libc::M_ARENA_MAX, MALLOC_ARENAS) };
        if ok != 1 {
            tracing::debug!("mallopt(M_ARENA_MAX) refused; glibc keeps its default arenas");
        }
    }
}
