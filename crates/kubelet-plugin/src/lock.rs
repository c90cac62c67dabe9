//! Taking a `std::sync::Mutex`, ignoring poison.
//!
//! A lock is poisoned when a thread panicked while holding it. The locks this helper is for guard
//! values that every critical section leaves whole (single assignments, map inserts and removes,
//! counters), so the data behind a poisoned lock is as good as any: ignoring the poison keeps one
//! panicked request from failing every later one. A critical section that could leave its data
//! half-done must not use it.

use std::sync::{Mutex, MutexGuard};

/// Locks `m`, ignoring poison (see the module doc).
pub fn lock<T: ?Sized>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}
#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    #[test]
    fn a_poisoned_lock_still_hands_out_its_value() {
        let m = Mutex::new(1);
        let _ = std::panic::catch_unwind(|| {
            let mut g = m.lock().unwrap();
            *g = 2;
            panic!("while holding the lock");
        });
        assert!(m.is_poisoned());
        assert_eq!(*super::lock(&m), 2);
    }
}
