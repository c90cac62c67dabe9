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

/// The glibc tunable that turns off malloc's per-thread caches (tcache).
pub const NO_THREAD_CACHES: &str = "glibc.malloc.tcache_count=0";

/// Turns off glibc's per-thread malloc caches for the daemon by executing itself again (same
/// PID, same arguments) with [`NO_THREAD_CACHES`] added to `GLIBC_TUNABLES`; call first thing in
/// `nvdra run`, while nothing else has started. glibc reads tunables only at start, and has no
/// call that sets this one later.
///
/// Why: with the caches, the heap kept growing under a steady load of prepares (anonymous memory
/// 2.6 → 3.5 MiB from cycle 100 to 3,000 in benches/rss.rs, though nothing leaked); without them
/// it stays at 2.1 MiB from cycle 100 on. The daemon allocates little and from few threads, so
/// the caches buy it no speed (benches/prepare.rs).
///
/// An operator's own `GLIBC_TUNABLES` that names `glibc.malloc.tcache_count` wins (set it to 7
/// for glibc's default). If the executable cannot be run again (deleted or replaced since it
/// started), the daemon goes on with the caches and says so on stderr. Elsewhere (musl) this
/// does nothing.
pub fn without_thread_caches() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        use std::os::unix::process::CommandExt;
        let given = std::env::var("GLIBC_TUNABLES").unwrap_or_default();
        let Some(tunables) = tunables_without_thread_caches(&given) else {
            return;
        };
        let exe = match std::env::current_exe() {
            Ok(exe) => exe,
            Err(e) => {
                eprintln!("nvdra: keeping malloc's thread caches: cannot find own executable: {e}");
                return;
            }
        };
        let mut args = std::env::args_os();
        let arg0 = args.next().unwrap_or_else(|| exe.clone().into_os_string());
        // exec returns only on failure.
        let e = std::process::Command::new(&exe)
            .arg0(arg0)
            .args(args)
            .env("GLIBC_TUNABLES", tunables)
            .exec();
        eprintln!(
            "nvdra: keeping malloc's thread caches: cannot run {} again: {e}",
            exe.display()
        );
    }
}

/// `GLIBC_TUNABLES` with [`NO_THREAD_CACHES`] added to the operator's `given` tunables; `None`
/// when `given` already sets the thread caches.
fn tunables_without_thread_caches(given: &str) -> Option<String> {
    if given
        .split(':')
        .any(|t| t.split('=').next() == Some("glibc.malloc.tcache_count"))
    {
        return None;
    }
    Some(match given {
        "" => NO_THREAD_CACHES.to_string(),
        other => format!("{other}:{NO_THREAD_CACHES}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_thread_cache_tunable_is_added_to_the_operators_unless_they_set_it() {
        let add = tunables_without_thread_caches;
        assert_eq!(add("").as_deref(), Some(NO_THREAD_CACHES));
        assert_eq!(
            add("glibc.malloc.arena_max=2").as_deref(),
            Some("glibc.malloc.arena_max=2:glibc.malloc.tcache_count=0")
        );
        assert_eq!(add("glibc.malloc.tcache_count=7"), None);
        assert_eq!(
            add("glibc.malloc.arena_max=2:glibc.malloc.tcache_count=3"),
            None
        );
        // A name that merely starts the same is another tunable.
        assert_eq!(
            add("glibc.malloc.tcache_count_x=1").as_deref(),
            Some("glibc.malloc.tcache_count_x=1:glibc.malloc.tcache_count=0")
        );
    }
}
