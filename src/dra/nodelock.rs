//! Serialization between plugin instances on one node (rolling updates): prepare and unprepare
//! hold an exclusive `flock` (`File::lock`) on `<plugin data dir>/serialize.lock`.
//!
//! Within one process the lock is shared: the first operation to start takes the flock (on the
//! blocking pool, since `flock` waits), later ones join it, and the last to finish releases it.
//! So claims of one process are still prepared concurrently, while two processes take turns.
//! Whenever the lock is newly taken, `on_acquire` runs (the plugin reloads the checkpoint, which
//! the other instance may have changed meanwhile).

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

pub const FILE_NAME: &str = "serialize.lock";

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot lock {path}: {source}")]
    Lock {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("lock task failed: {0}")]
    Task(String),
}

#[derive(Default)]
struct State {
    holders: usize,
    file: Option<File>,
}

pub struct NodeLock {
    path: PathBuf,
    state: Arc<Mutex<State>>,
    /// Serializes taking the flock, so only one task waits on it.
    acquiring: tokio::sync::Mutex<()>,
}

/// Held while an operation runs; the flock is released when the last guard drops.
pub struct Guard {
    state: Arc<Mutex<State>>,
}

fn lock(m: &Mutex<State>) -> std::sync::MutexGuard<'_, State> {
    // Counter updates are single statements; a poisoned lock still holds a consistent count.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl NodeLock {
    pub fn new(dir: &Path) -> Self {
        Self {
            path: dir.join(FILE_NAME),
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
        let path = self.path.clone();
        let file = tokio::task::spawn_blocking(move || {
            let f = File::options()
                .create(true)
                .truncate(false)
                .write(true)
                .open(&path)
                .map_err(|source| Error::Lock {
                    path: path.clone(),
                    source,
                })?;
            // Blocks until the other instance releases it (flock(2) under the hood).
            f.lock().map_err(|source| Error::Lock { path, source })?;
            Ok(f)
        })
        .await
        .map_err(|e| Error::Task(e.to_string()))??;
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

impl Drop for Guard {
    fn drop(&mut self) {
        let mut s = lock(&self.state);
        s.holders = s.holders.saturating_sub(1);
        if s.holders == 0 {
            // Closing the descriptor releases the flock.
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
}
