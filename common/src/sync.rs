//! Locks that outlive a panic. A thread that panics while it holds a `Mutex` poisons it;
//! every later `lock()` then returns an error. Faultline's locks guard plain state (maps,
//! counters, the last document) that stays consistent at every await and every step, so
//! a poisoned lock is taken as it is instead of taking the whole process down with it.

use std::sync::{Mutex, MutexGuard, PoisonError};

/// `lock()` that recovers a poisoned lock.
pub trait Locked<T: ?Sized> {
    /// The guard, whether or not a holder panicked.
    fn locked(&self) -> MutexGuard<'_, T>;
}

impl<T: ?Sized> Locked<T> for Mutex<T> {
    fn locked(&self) -> MutexGuard<'_, T> {
        self.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A lock poisoned by a panicking holder is still taken, with what it held.
    #[test]
    fn a_poisoned_lock_is_taken_as_it_is() {
        let m = std::sync::Arc::new(Mutex::new(1));
        let m2 = m.clone();
        let _ = std::thread::spawn(move || {
            let mut g = m2.lock().unwrap();
            *g = 2;
            panic!("poison it");
        })
        .join();
        assert!(m.is_poisoned());
        assert_eq!(*m.locked(), 2);
    }
}
