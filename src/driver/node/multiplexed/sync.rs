//! The locks and counters the multiplexed connection's hand-offs are made of: `parking_lot`'s
//! and the standard library's, or, in the model tests (built with
//! `RUSTFLAGS="--cfg quorumlock_shuttle"`), `shuttle`'s, so that its
//! scheduler explores their interleavings (see `model_tests`).

#[cfg(not(all(test, quorumlock_shuttle)))]
pub(crate) use parking_lot::Mutex;
#[cfg(not(all(test, quorumlock_shuttle)))]
pub(crate) use std::sync::atomic::AtomicUsize;

#[cfg(all(test, quorumlock_shuttle))]
pub(crate) use shuttle::sync::atomic::AtomicUsize;

/// `parking_lot::Mutex`'s API over `shuttle`'s mutex.
#[cfg(all(test, quorumlock_shuttle))]
#[derive(Default)]
pub(crate) struct Mutex<T>(shuttle::sync::Mutex<T>);

#[cfg(all(test, quorumlock_shuttle))]
impl<T> Mutex<T> {
    pub(crate) fn new(t: T) -> Self {
        Mutex(shuttle::sync::Mutex::new(t))
    }

    pub(crate) fn lock(&self) -> shuttle::sync::MutexGuard<'_, T> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn get_mut(&mut self) -> &mut T {
        self.0.get_mut().unwrap_or_else(|e| e.into_inner())
    }
}
