//! Serialization between plugin instances on one node (rolling updates): prepare and unprepare
//! hold two exclusive locks on the whole of `<lock dir>/serialize.lock` (the plugin data
//! directory by default):
//!
//! - the open file description (OFD) `fcntl` write lock that Go's `kubeletplugin` helper takes
//!   (`F_OFD_SETLKW`, whole file, through etcd's `fileutil.LockFile`), so a Go instance and a Rust
//!   one, say the old and the new pod of a rolling update from a Go driver, take turns;
//! - the `flock` this library took before, so an instance built with an older version of it
//!   takes turns too.
//!
//! The two kinds of lock do not see each other on Linux: each alone would let the other kind's
//! holder in. Each attempt takes the OFD lock, then the `flock`; when the second is held
//! elsewhere it releases the first and tries again later. So it never waits while holding one of
//! them, and cannot deadlock with a peer that takes either kind, or both in any order.
//!
//! Within one process the lock is shared: the first operation to start takes the locks (polling
//! non-blocking attempts, giving up with a clear error after [`TIMEOUT`]), later ones join it,
//! and the last to finish releases it.
//! So claims of one process are still prepared concurrently, while two processes take turns.
//! Whenever the lock is newly taken, `on_acquire` runs (the plugin reloads the checkpoint, which
//! the other instance may have changed meanwhile).

use std::fs::{File, TryLockError};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

// The state's updates are single statements (a counter, an `Option`), so the helper's
// poison-ignoring is sound here.
use crate::lock::lock;

/// The lock file in the directory given (Go's helper names it the same).
pub const FILE_NAME: &str = "serialize.lock";

/// Why the lock could not be taken.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The lock file could not be opened or locked.
    #[error("cannot lock {path}")]
    Lock {
        /// The lock file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    #[error(
        "another instance of this plugin has held {path} for {waited:?}; is its old pod stuck? \
         The kubelet retries"
    )]
    /// Another instance held the lock for the whole timeout.
    Busy {
        /// The lock file.
        path: PathBuf,
        /// How long this operation waited.
        waited: Duration,
    },
    /// The blocking task that opens the file panicked.
    #[error("the lock task panicked")]
    Task(#[source] tokio::task::JoinError),
}

/// How long an operation waits for another instance before failing.
pub const TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Default)]
struct State {
    holders: usize,
    /// The lock file, opened once and kept (a prepare then pays no blocking-pool round trip to
    /// open it); locked while `holders > 0`.
    file: Option<File>,
}

/// The lock of one directory, shared by the operations of one process (see the module doc).
pub struct NodeLock {
    path: PathBuf,
    timeout: Duration,
    state: Arc<Mutex<State>>,
    /// Serializes taking the flock, so only one task waits on it.
    acquiring: tokio::sync::Mutex<()>,
}

/// Held while an operation runs; the flock is released when the last guard drops.
pub struct Guard {
    state: Arc<Mutex<State>>,
}

impl NodeLock {
    /// The lock `<dir>/serialize.lock`, waiting at most [`TIMEOUT`] for another instance.
    pub fn new(dir: &Path) -> Self {
        Self::with_timeout(dir, TIMEOUT)
    }

    /// [`NodeLock::new`], waiting at most `timeout`.
    pub fn with_timeout(dir: &Path, timeout: Duration) -> Self {
        Self {
            path: dir.join(FILE_NAME),
            timeout,
            state: Arc::new(Mutex::new(State::default())),
            acquiring: tokio::sync::Mutex::new(()),
        }
    }

    /// Joins the held lock, or takes it and runs `on_acquire` first.
    pub async fn enter<E>(&self, on_acquire: impl FnOnce() -> Result<(), E>) -> Result<Guard, E>
    where
        E: From<Error>,
    {
        let _one = self.acquiring.lock().await;
        {
            let mut s = lock(&self.state);
            if s.holders > 0 {
                s.holders += 1;
                return Ok(Guard {
                    state: self.state.clone(),
                });
            }
        }
        // Only this task touches the file now: `acquiring` is held and nobody holds the lock.
        let kept = lock(&self.state).file.take();
        let file = match kept.filter(|f| self.still_names(f)) {
            Some(file) => file,
            None => {
                let path = self.path.clone();
                tokio::task::spawn_blocking(move || {
                    // A lock directory set apart may not exist yet (the plugin's own is there).
                    path.parent()
                        .map_or(Ok(()), std::fs::create_dir_all)
                        .and_then(|()| {
                            File::options()
                                .create(true)
                                .truncate(false)
                                .write(true)
                                .open(&path)
                        })
                        .map_err(|source| Error::Lock { path, source })
                })
                .await
                .map_err(Error::Task)??
            }
        };
        // Poll with non-blocking attempts instead of blocking a thread, so a stuck peer costs a
        // clear error after `timeout` rather than a hung call.
        let started = tokio::time::Instant::now();
        let mut pause = Duration::from_millis(1);
        loop {
            match try_lock_both(&file) {
                Ok(true) => break,
                Ok(false) if started.elapsed() < self.timeout => {
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_millis(50));
                }
                Ok(false) => {
                    lock(&self.state).file = Some(file);
                    return Err(Error::Busy {
                        path: self.path.clone(),
                        waited: self.timeout,
                    }
                    .into());
                }
                Err(source) => {
                    return Err(Error::Lock {
                        path: self.path.clone(),
                        source,
                    }
                    .into());
                }
            }
        }
        let guard = {
            let mut s = lock(&self.state);
            s.holders = 1;
            s.file = Some(file);
            Guard {
                state: self.state.clone(),
            }
        };
        // On failure the guard drops and releases the lock again.
        on_acquire()?;
        Ok(guard)
    }
}

impl NodeLock {
    /// Whether the kept descriptor is still the file at the lock's path (an operator may have
    /// removed the file; a peer would then lock a new one).
    fn still_names(&self, file: &File) -> bool {
        use std::os::unix::fs::MetadataExt;
        match (file.metadata(), std::fs::metadata(&self.path)) {
            (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
            _ => false,
        }
    }
}

/// One attempt at both locks, OFD first (see the module doc): `Ok(true)` holding both,
/// `Ok(false)` holding neither because a peer holds one.
fn try_lock_both(file: &File) -> io::Result<bool> {
    if !ofd::try_lock(file)? {
        return Ok(false);
    }
    match file.try_lock() {
        Ok(()) => Ok(true),
        Err(e) => {
            // Never wait holding one of the two; closing the descriptor would release it too.
            ofd::unlock(file)?;
            match e {
                TryLockError::WouldBlock => Ok(false),
                TryLockError::Error(e) => Err(e),
            }
        }
    }
}

/// Go's kind of lock: an exclusive open file description lock on the whole file, as etcd's
/// `fileutil.LockFile` takes it for Go's helper (`F_OFD_SETLKW`, `F_WRLCK`, from offset 0 with
/// length 0: the whole file however it grows). Here non-blocking (`F_OFD_SETLK`), polled.
mod ofd {
    use std::fs::File;
    use std::io;

    use nix::errno::Errno;
    use nix::fcntl::{FcntlArg, fcntl};
    use nix::libc;

    fn whole_file(kind: libc::c_int) -> libc::flock {
        // SAFETY: `flock` is a C struct of integers (and, on some targets, integer padding), for
        // which all-zero bytes are a valid value: start 0, length 0 (to the end of the file),
        // pid 0 (which OFD locks require).
        let mut lock: libc::flock = unsafe { std::mem::zeroed() };
        // The constants are 0..=2 and whence 0: the casts to `c_short` are lossless.
        lock.l_type = kind as libc::c_short;
        lock.l_whence = libc::SEEK_SET as libc::c_short;
        lock
    }

    /// Takes the write lock: `Ok(false)` when a peer holds a lock on the file.
    pub(super) fn try_lock(file: &File) -> io::Result<bool> {
        match fcntl(file, FcntlArg::F_OFD_SETLK(&whole_file(libc::F_WRLCK))) {
            Ok(_) => Ok(true),
            Err(Errno::EAGAIN | Errno::EACCES) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    /// Releases it (closing the last descriptor of the open file description does too).
    pub(super) fn unlock(file: &File) -> io::Result<()> {
        fcntl(file, FcntlArg::F_OFD_SETLK(&whole_file(libc::F_UNLCK)))?;
        Ok(())
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        let mut s = lock(&self.state);
        s.holders = s.holders.saturating_sub(1);
        if s.holders == 0
            && let Some(file) = &s.file
            && (file.unlock().is_err() | ofd::unlock(file).is_err())
        {
            // Closing the descriptor releases both locks.
            s.file = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[tokio::test]
    async fn shared_in_process_exclusive_across_descriptors() {
        let dir = tempfile::tempdir().unwrap();
        let a = NodeLock::new(dir.path());
        let acquired = AtomicUsize::new(0);
        let on = || {
            acquired.fetch_add(1, Ordering::SeqCst);
            Ok::<(), Error>(())
        };
        let g1 = a.enter(on).await.unwrap();
        let g2 = a.enter(on).await.unwrap();
        assert_eq!(acquired.load(Ordering::SeqCst), 1, "second operation joins");
        // Another instance (its own descriptor) cannot take it now.
        let other = File::options()
            .write(true)
            .open(dir.path().join(FILE_NAME))
            .unwrap();
        assert!(other.try_lock().is_err());
        drop(g1);
        assert!(other.try_lock().is_err(), "still held by the second guard");
        drop(g2);
        other.try_lock().expect("released with the last guard");
        drop(other);
        let _g3 = a.enter(on).await.unwrap();
        assert_eq!(acquired.load(Ordering::SeqCst), 2, "re-taken, so reloaded");
    }

    /// The descriptor is kept between operations, and still excludes a peer each time; when the
    /// file at the path is replaced, the lock follows the path, where a peer would look.
    #[tokio::test]
    async fn the_kept_descriptor_follows_the_file_at_the_path() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(FILE_NAME);
        let a = NodeLock::new(dir.path());
        let ok = || Ok::<(), Error>(());
        let peer = |what: &str| {
            let f = File::options().write(true).open(&path).unwrap();
            assert!(
                f.try_lock().is_err(),
                "{what}: a peer must not get the lock"
            );
        };
        let kept = |a: &NodeLock| {
            lock(&a.state)
                .file
                .as_ref()
                .map(|f| f.metadata().unwrap().ino())
        };
        drop(a.enter(ok).await.unwrap());
        let first = kept(&a).expect("the descriptor is kept after the last guard");
        let g = a.enter(ok).await.unwrap();
        assert_eq!(kept(&a), Some(first), "the same descriptor again");
        peer("second operation");
        drop(g);
        std::fs::remove_file(&path).unwrap();
        let g = a.enter(ok).await.unwrap();
        let now = std::fs::metadata(&path).unwrap().ino();
        assert_eq!(kept(&a), Some(now), "reopened at the path");
        peer("after the file was replaced");
        drop(g);
    }

    #[tokio::test(start_paused = true)]
    async fn a_peer_that_never_lets_go_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(FILE_NAME), "").unwrap();
        let peer = File::options()
            .write(true)
            .open(dir.path().join(FILE_NAME))
            .unwrap();
        peer.try_lock().unwrap();
        let lock = NodeLock::with_timeout(dir.path(), Duration::from_secs(10));
        let e = match lock.enter(|| Ok::<(), Error>(())).await {
            Err(e) => e,
            Ok(_) => panic!("took a lock the peer holds"),
        };
        assert!(matches!(e, Error::Busy { .. }), "{e}");
        assert!(e.to_string().contains(FILE_NAME), "{e}");
        // Once the peer lets go, the next operation proceeds.
        drop(peer);
        lock.enter(|| Ok::<(), Error>(())).await.unwrap();
    }
}
