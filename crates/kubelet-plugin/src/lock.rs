//! Taking a `std::sync::Mutex` whose data every critical section leaves whole.

use std::sync::{Mutex, MutexGuard};

/// Locks `m`, ignoring poison: a panic while holding one of this crate's locks cannot leave its
/// data half-done (single assignments and counters), so one panicked task does not fail every
/// later one.
pub(crate) fn lock<T: ?Sized>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}
