//! [`LockGuard`]: a held lock, released on drop.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::RecvTimeoutError;
use log::{debug, warn};

use crate::error::Error;
use crate::lock::engine::Engine;
use crate::lock::queue::Turn;
use crate::lock::state::LockState;
use crate::Result;

/// A held lock. Dropping it releases the lock (best effort, bounded by the
/// node timeout); [`release`](Self::release) does the same and reports the
/// outcome.
///
/// The guard only tells you what the algorithm knows: you may assume
/// exclusive access while [`validity`](Self::validity) is non-zero. Finish,
/// [`extend`](Self::extend), or let the watchdog renew it
/// ([`auto_renew`](Self::auto_renew)) before then.
#[must_use = "the lock is released as soon as the guard is dropped"]
pub struct LockGuard {
    engine: Arc<Engine>,
    state: Arc<LockState>,
    /// This thread's turn among local waiters; dropped (handing over) only
    /// after the release.
    turn: Option<Turn>,
}

impl fmt::Debug for LockGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The token stays out of Debug output: it is the lock's capability.
        f.debug_struct("LockGuard")
            .field("resource", &self.state.resource)
            .field("validity", &self.validity())
            .field("lost", &self.state.is_lost())
            .field("renewing", &self.state.is_renewing())
            .finish_non_exhaustive()
    }
}

impl LockGuard {
    pub(crate) fn new(engine: Arc<Engine>, state: Arc<LockState>, turn: Option<Turn>) -> Self {
        LockGuard {
            engine,
            state,
            turn,
        }
    }

    pub(crate) fn engine(&self) -> &Arc<Engine> {
        &self.engine
    }

    pub(crate) fn state(&self) -> &Arc<LockState> {
        &self.state
    }

    /// The locked resource (the Redis key); for a lock of several
    /// ([`LockRequest::and`](crate::LockRequest::and)), the first.
    pub fn resource(&self) -> &str {
        &self.state.resource
    }

    /// Every resource of the lock, in the order given: one, or those of a
    /// lock of several.
    ///
    /// ```no_run
    /// # use std::time::Duration;
    /// # let locks = quorumlock::Redlock::builder().node("redis://127.0.0.1:6379").build()?;
    /// let guard = locks.request("a", Duration::from_secs(5)).and("b").try_acquire()?;
    /// assert_eq!(guard.resources().collect::<Vec<_>>(), ["a", "b"]);
    /// # Ok::<(), quorumlock::Error>(())
    /// ```
    pub fn resources(&self) -> impl Iterator<Item = &str> {
        std::iter::once(self.state.resource.as_str())
            .chain(self.state.also.iter().map(String::as_str))
    }

    /// Whether it is a read lock ([`LockRequest::read`](crate::LockRequest::read)
    /// and its kin), shared with other readers; else it excludes every
    /// other holder.
    pub fn is_read(&self) -> bool {
        self.state.is_read()
    }

    /// The random token stored under the key. An unfenced lock handed over
    /// to another thread of this process keeps it (tell its sections apart
    /// by [`section`](Self::section)); a fenced one gets a new token at
    /// each hand-over, of the form `<lineage>.<random>` where the lineage
    /// is the token it was acquired with.
    pub fn token(&self) -> &str {
        &self.state.token
    }

    /// This critical section's number in its lock's lineage: 1 for a lock
    /// acquired at the nodes, one more at each hand-over to another thread
    /// of this process (see [`Builder::local_queue`](crate::Builder::local_queue)).
    /// Events and logs carry it too.
    ///
    /// An unfenced hand-over sends nothing to the nodes: the key, its token
    /// and its expiry stay, and only this number changes. Order sections
    /// for a storage by [`fencing_token`](Self::fencing_token), which a
    /// fenced hand-over moves on with one swap round trip.
    ///
    /// ```no_run
    /// # use std::time::Duration;
    /// # let locks = quorumlock::Redlock::builder().node("redis://127.0.0.1:6379").build()?;
    /// let guard = locks.lock("lock:sku:42", Duration::from_secs(10))?;
    /// assert!(guard.section() >= 1);
    /// # Ok::<(), quorumlock::Error>(())
    /// ```
    pub fn section(&self) -> u64 {
        self.state.section
    }

    /// This critical section's fencing token, when the client was built
    /// with [`fencing`](crate::Builder::fencing) on (else `None`).
    ///
    /// Strictly greater than the token of every critical section of the
    /// same resource granted before this one started, under Redlock's own
    /// assumptions (bounded clock drift, restarted nodes held back) and,
    /// after a node lost its data, nodes' clocks that agree within the
    /// longest TTL. Renewal keeps it; a hand-over to another thread of this
    /// process gives the next one. Pass it with every write to the
    /// protected storage and have the storage refuse a token lower than the
    /// last it saw (`<=`, not `<`: a section may write more than once, and
    /// two sections never share a token):
    ///
    /// ```sql
    /// UPDATE stock SET qty = qty - 1, last_token = :token
    ///  WHERE sku = :sku AND last_token <= :token
    /// ```
    ///
    /// When a write depends on an earlier read, register the token at the
    /// read too (`SET last_token = max(last_token, :token)`): otherwise a
    /// stale holder's write can land between a newer holder's read and
    /// write, and be overwritten.
    ///
    /// Tokens start from the nodes' clocks in microseconds (about 1.8e15
    /// today): below 2^53, so they fit a signed 64-bit SQL integer
    /// (`i64::try_from`), a double or a JavaScript number.
    pub fn fencing_token(&self) -> Option<u64> {
        self.state.fence
    }

    /// The TTL of the last successful acquire, extend or renewal.
    pub fn ttl(&self) -> Duration {
        self.state.timing().ttl
    }

    /// The monotonic instant until which the lock may be assumed held. Moves
    /// forward with each extension or renewal.
    pub fn deadline(&self) -> Instant {
        self.state.deadline()
    }

    /// How long the lock may still be assumed held; zero once expired or lost.
    pub fn validity(&self) -> Duration {
        if self.state.is_lost() {
            return Duration::ZERO;
        }
        let now = self.engine.clock.now();
        self.state.deadline().saturating_duration_since(now)
    }

    /// Whether the lock may still be assumed held: not lost, validity left.
    pub fn is_held(&self) -> bool {
        !self.validity().is_zero()
    }

    /// How many nodes confirmed holding the lock's key in the last round
    /// that confirmed the lock: the acquisition, then each successful
    /// extension or renewal (which also restores the key where it went
    /// missing: a node that restarted empty, evicted it, or never got the
    /// acquisition's `SET`). A round that failed without losing the lock
    /// (too few answers in time) leaves the count as it was; a lost lock
    /// reads 0.
    ///
    /// A lock on every node survives the loss of any minority; one on a
    /// bare majority is one node failure from being lost. A node whose reply
    /// the round did not wait for (the outcome was settled before it
    /// arrived) is not counted, though its copy is most likely there: a
    /// later round confirms it.
    ///
    /// ```no_run
    /// # use std::time::Duration;
    /// # let locks = quorumlock::Redlock::builder().node("redis://127.0.0.1:6379").build()?;
    /// let guard = locks.lock("lock:sku:42", Duration::from_secs(10))?;
    /// assert!(guard.nodes_held() >= locks.quorum());
    /// # Ok::<(), quorumlock::Error>(())
    /// ```
    pub fn nodes_held(&self) -> usize {
        if self.state.is_lost() {
            return 0;
        }
        self.state.holding()
    }

    /// Whether the lock is known to be lost: a renewal or extension found it
    /// gone or taken, or its validity ran out before a renewal succeeded.
    /// (A lock that simply expired without renewal reads
    /// `is_held() == false` but is not reported lost.)
    pub fn is_lost(&self) -> bool {
        self.state.is_lost()
    }

    /// A signal of this lock's loss, to watch from any thread: it says why
    /// the lock was lost, or that the guard was released first.
    ///
    /// ```no_run
    /// # use std::time::Duration;
    /// # let locks = quorumlock::Redlock::builder().node("redis://127.0.0.1:6379").build()?;
    /// let guard = locks.lock("job:import", Duration::from_secs(30))?;
    /// guard.auto_renew();
    /// let lost = guard.lost();
    /// let watcher = std::thread::spawn(move || match lost.wait() {
    ///     Some(why) => eprintln!("lock lost: {why}; stop writing"),
    ///     None => {} // released first
    /// });
    /// // ... work, checking guard.is_held() ...
    /// guard.release()?;
    /// watcher.join().ok();
    /// # Ok::<(), quorumlock::Error>(())
    /// ```
    pub fn lost(&self) -> LostSignal {
        LostSignal {
            state: self.state.clone(),
        }
    }

    /// Runs `f` under this lock, renewed in the background meanwhile, then
    /// releases it, also when `f` panics. Returns what `f` returns.
    ///
    /// Inside `f`, check [`is_held`](Self::is_held) (or watch
    /// [`lost`](Self::lost)) before each step that needs the lock.
    ///
    /// ```no_run
    /// # use std::time::Duration;
    /// # let locks = quorumlock::Redlock::builder().node("redis://127.0.0.1:6379").build()?;
    /// let rows = locks.lock("job:nightly", Duration::from_secs(30))?.run(|guard| {
    ///     let mut rows = 0;
    ///     while guard.is_held() && rows < 1_000 {
    ///         rows += 1; // one unit of work
    ///     }
    ///     rows
    /// })?;
    /// # Ok::<(), quorumlock::Error>(())
    /// ```
    ///
    /// # Errors
    /// The reason the lock was lost ([`Error::Expired`],
    /// [`Error::NotOwner`]) if it was lost while `f` ran, and
    /// [`Error::Expired`] if `f` finished after the lock's deadline (whether
    /// or not the renewal thread had noticed): `f`'s result is then dropped,
    /// because its work was not protected.
    pub fn run<T>(self, f: impl FnOnce(&LockGuard) -> T) -> Result<T> {
        self.auto_renew();
        let state = self.state.clone();
        let out = f(&self);
        let lost = state.lost_reason();
        // Judged by the deadline itself, whatever the renewal thread has
        // seen yet: work that ended past it ran without the lock's
        // guarantee (the keys may still be ours on the nodes: they outlive
        // validity by the drift allowance).
        let in_time = self.is_held();
        match (self.release(), lost) {
            (_, Some(reason)) => Err(reason),
            (_, None) if !in_time => Err(Error::Expired),
            (Ok(()), None) => Ok(out),
            (Err(e @ (Error::Expired | Error::NotOwner { .. })), None) => Err(e),
            (Err(e), None) => {
                // Held to the end; the keys left behind expire with the TTL.
                debug!("lock {:?}: release after run: {e}", state.resource);
                Ok(out)
            }
        }
    }

    /// Starts renewing this lock in the background until it is released or
    /// lost: the client's one watchdog thread extends it every
    /// `ttl × renew_fraction` (see [`Builder::renew_fraction`](crate::Builder::renew_fraction)).
    /// Calling it again does nothing. Locks taken by a client built with
    /// [`auto_renew(true)`](crate::Builder::auto_renew) are renewed already.
    pub fn auto_renew(&self) -> &Self {
        if !self.state.is_lost() && !self.state.is_released() && self.state.start_renewing() {
            self.engine.watchdog().add(self.state.clone());
        }
        self
    }

    /// Whether the watchdog renews this lock.
    pub fn is_auto_renewed(&self) -> bool {
        self.state.is_renewing()
    }

    /// Makes the lock last at least `ttl` from now on every node where it
    /// is still ours, and moves the deadline forward. It never shortens a
    /// lock: with a `ttl` below what is left the lock stays as it was (a
    /// shortening extension delayed in the network could otherwise land
    /// after a later renewal, and cut the keys short under a holder that
    /// believes it holds). Succeeds only with a majority and only if done
    /// before the current validity runs out. Returns the validity left.
    ///
    /// # Errors
    /// [`Error::Expired`] or [`Error::NotOwner`] when the lock is no longer
    /// ours (the guard then counts as lost), [`Error::NoQuorum`] when too many
    /// nodes failed (the old deadline still stands),
    /// [`Error::InvalidInput`] for a bad TTL.
    pub fn extend(&self, ttl: Duration) -> Result<Duration> {
        if self.state.is_lost() || self.state.is_released() {
            return Err(Error::Expired);
        }
        self.engine.extend(&self.state, ttl)
    }

    /// Releases the lock on every node and reports the outcome. Renewal
    /// stops before the keys are deleted. When other threads of this process
    /// are queued for the resource and at least half the TTL is left, the
    /// held lock passes to the next of them instead, which continues it as
    /// its next critical section (see [`section`](Self::section) and
    /// [`Builder::local_queue`](crate::Builder::local_queue)); this guard's
    /// [`lost`](Self::lost) signal ends without a loss either way.
    ///
    /// # Errors
    /// [`Error::Expired`] when it had already expired on a majority,
    /// [`Error::NotOwner`] when another owner holds it now,
    /// [`Error::NoQuorum`] when too many nodes failed to answer (keys left
    /// behind expire with their TTL).
    pub fn release(mut self) -> Result<()> {
        self.finish().unwrap_or(Ok(()))
    }

    /// Deregisters and releases, once (`None` when already done); or, with
    /// threads of this process queued for the resource and at least half the
    /// TTL left, hands the held lock to the next of them (unfenced, without
    /// a round trip).
    fn finish(&mut self) -> Option<Result<()>> {
        // Released or handed over already (either marks the lock released):
        // nothing left to do.
        if self.state.is_released() {
            return None;
        }
        if let Some(turn) = self.turn.take() {
            let t = self.state.timing();
            let left = t
                .deadline
                .saturating_duration_since(self.engine.clock.now());
            let handable = !self.state.is_renewing()
                && !self.state.is_lost()
                && left >= t.ttl / 2
                && turn.has_waiters()
                // Other clients wait too: they get it by the nodes.
                && !self.engine.remote.others_wait(&self.state.resource);
            if handable {
                // With nobody left waiting, the lock and the turn come back:
                // released below, the turn passing on after.
                match turn.hand_over(self.state.clone()) {
                    Ok(()) => {
                        // This critical section ends here: the receiver
                        // continues as the next.
                        self.state.take_release();
                        debug!(
                            "lock {:?}: section {} ends, handed to the next local waiter",
                            self.state.resource, self.state.section
                        );
                        return Some(Ok(()));
                    }
                    Err((turn, _)) => {
                        debug!(
                            "lock {:?}: the local waiter left; releasing instead",
                            self.state.resource
                        );
                        self.turn = Some(turn);
                    }
                }
            } else {
                // Released below; the turn passes on once `turn` drops, after.
                self.turn = Some(turn);
            }
        }
        if !self.state.take_release() {
            return None;
        }
        if self.state.is_renewing() {
            self.engine.watchdog().remove(self.state.id);
        }
        // Released holding the turn (the next local waiter must not race the
        // release on the nodes); the event handler is told after.
        let (outcome, results) = self.engine.release_round(&self.state);
        self.turn.take();
        self.engine.release_event(&self.state, &outcome, &results);
        Some(outcome)
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        let Some(outcome) = self.finish() else {
            return;
        };
        match outcome {
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

/// A held lock's loss, watched from any thread ([`LockGuard::lost`]).
///
/// ```no_run
/// # use std::time::Duration;
/// # let locks = quorumlock::Redlock::builder().node("redis://127.0.0.1:6379").build()?;
/// let guard = locks.lock("job:import", Duration::from_secs(30))?;
/// let lost = guard.lost();
/// drop(guard); // released: the signal ends without a loss
/// assert!(lost.is_ended() && lost.wait().is_none());
/// # Ok::<(), quorumlock::Error>(())
/// ```
///
/// It ends once: with the reason when the lock is found lost (a renewal or
/// extension found it gone or taken, or its validity ran out before a
/// renewal succeeded), or without one when the guard is released or its
/// lock handed to another thread of this process. Clones watch the same
/// lock.
#[derive(Clone)]
pub struct LostSignal {
    state: Arc<LockState>,
}

impl fmt::Debug for LostSignal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LostSignal")
            .field("resource", &self.state.resource)
            .field("lost", &self.state.is_lost())
            .finish()
    }
}

impl LostSignal {
    /// Why the lock was lost, if it was by now. Never blocks.
    pub fn check(&self) -> Option<Error> {
        self.state.lost_reason()
    }

    /// Whether the signal has ended: the lock was found lost, or its guard
    /// was released or handed over.
    pub fn is_ended(&self) -> bool {
        self.state.has_ended()
    }

    /// Blocks until the lock is lost (the reason) or released (`None`).
    pub fn wait(&self) -> Option<Error> {
        let _ = self.state.ended().recv();
        self.check()
    }

    /// Blocks until the lock is lost (the reason), or released or `timeout`
    /// has passed (`None`). Once the signal has ended without a loss it
    /// returns `None` at once: a loop that waits on it checks
    /// [`is_ended`](Self::is_ended) too.
    pub fn wait_timeout(&self, timeout: Duration) -> Option<Error> {
        match self.state.ended().recv_timeout(timeout) {
            Err(RecvTimeoutError::Timeout) => None,
            _ => self.check(),
        }
    }
}
