//! [`LockGuard`]: a held lock, released on drop.

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use log::{debug, warn};
use parking_lot::Mutex;

use crate::error::Error;
use crate::redlock::Redlock;
use crate::Result;

/// The shared record of one held lock.
#[derive(Debug)]
pub(crate) struct LockState {
    pub(crate) resource: String,
    pub(crate) token: String,
    timing: Mutex<Timing>,
    lost: AtomicBool,
    released: AtomicBool,
}

#[derive(Debug, Clone, Copy)]
struct Timing {
    deadline: Instant,
    ttl: Duration,
}

impl LockState {
    pub(crate) fn new(resource: &str, token: String, ttl: Duration, deadline: Instant) -> Self {
        LockState {
            resource: resource.to_owned(),
            token,
            timing: Mutex::new(Timing { deadline, ttl }),
            lost: AtomicBool::new(false),
            released: AtomicBool::new(false),
        }
    }

    pub(crate) fn deadline(&self) -> Instant {
        self.timing.lock().deadline
    }

    pub(crate) fn ttl(&self) -> Duration {
        self.timing.lock().ttl
    }

    pub(crate) fn set_deadline(&self, deadline: Instant, ttl: Duration) {
        *self.timing.lock() = Timing { deadline, ttl };
    }

    pub(crate) fn mark_lost(&self) {
        self.lost.store(true, Ordering::Release);
    }

    pub(crate) fn is_lost(&self) -> bool {
        self.lost.load(Ordering::Acquire)
    }

    /// Marks the lock released; true the first time only.
    fn take_release(&self) -> bool {
        !self.released.swap(true, Ordering::AcqRel)
    }
}

/// A held lock. Dropping it releases the lock (best effort, bounded by the
/// node timeout); [`release`](Self::release) does the same and reports the
/// outcome.
///
/// The guard only tells you what the algorithm knows: you may assume
/// exclusive access while [`validity`](Self::validity) is non-zero. Finish
/// (or [`extend`](Self::extend)) before then.
#[must_use = "the lock is released as soon as the guard is dropped"]
pub struct LockGuard {
    client: Redlock,
    state: std::sync::Arc<LockState>,
}

impl fmt::Debug for LockGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The token stays out of Debug output: it is the lock's capability.
        f.debug_struct("LockGuard")
            .field("resource", &self.state.resource)
            .field("validity", &self.validity())
            .field("lost", &self.state.is_lost())
            .finish_non_exhaustive()
    }
}

impl LockGuard {
    pub(crate) fn new(client: Redlock, state: LockState) -> Self {
        LockGuard {
            client,
            state: std::sync::Arc::new(state),
        }
    }

    /// The locked resource (the Redis key).
    pub fn resource(&self) -> &str {
        &self.state.resource
    }

    /// This acquisition's random token (the value stored under the key).
    pub fn token(&self) -> &str {
        &self.state.token
    }

    /// The TTL of the last successful acquire or extend.
    pub fn ttl(&self) -> Duration {
        self.state.ttl()
    }

    /// The monotonic instant until which the lock may be assumed held.
    pub fn deadline(&self) -> Instant {
        self.state.deadline()
    }

    /// How long the lock may still be assumed held; zero once expired or lost.
    pub fn validity(&self) -> Duration {
        if self.state.is_lost() {
            return Duration::ZERO;
        }
        let now = self.client.inner.clock.now();
        self.state.deadline().saturating_duration_since(now)
    }

    /// Whether the lock may still be assumed held: not lost, validity left.
    pub fn is_held(&self) -> bool {
        !self.validity().is_zero()
    }

    /// Sets the lock's expiry to `ttl` from now on every node where it is
    /// still ours, and moves the deadline. Succeeds only with a majority and
    /// only if done before the current validity runs out. Returns the new
    /// validity.
    ///
    /// # Errors
    /// [`Error::Expired`] or [`Error::NotOwner`] when the lock is no longer
    /// ours (the guard then counts as lost), [`Error::NoQuorum`] when too many
    /// nodes failed (the old deadline still stands),
    /// [`Error::InvalidInput`] for a bad TTL.
    pub fn extend(&self, ttl: Duration) -> Result<Duration> {
        if self.state.is_lost() {
            return Err(Error::Expired);
        }
        self.client.inner.extend(&self.state, ttl)
    }

    /// Releases the lock on every node and reports the outcome.
    ///
    /// # Errors
    /// [`Error::Expired`] when it had already expired on a majority,
    /// [`Error::NotOwner`] when another owner holds it now,
    /// [`Error::NoQuorum`] when too many nodes failed to answer (keys left
    /// behind expire with their TTL).
    pub fn release(self) -> Result<()> {
        if !self.state.take_release() {
            return Ok(());
        }
        self.client.inner.release(&self.state)
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        if !self.state.take_release() {
            return;
        }
        match self.client.inner.release(&self.state) {
            Ok(()) => debug!("lock {:?}: released on drop", self.state.resource),
            Err(e @ (Error::Expired | Error::NotOwner { .. })) if !self.state.is_lost() => {
                warn!(
                    "lock {:?}: already gone when dropped, the critical section outlived it: {e}",
                    self.state.resource
                )
            }
            Err(e) => debug!("lock {:?}: release on drop: {e}", self.state.resource),
        }
    }
}
