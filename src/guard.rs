//! [`LockGuard`]: a held lock, released on drop.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use log::{debug, warn};
use parking_lot::Mutex;

use crate::error::Error;
use crate::lock::queue::Permit;
use crate::lock::transport::Key;
use crate::redlock::{Inner, Redlock};
use crate::Result;

/// Called when a renewed lock is lost: the resource and the reason.
pub(crate) type LostCallback = dyn Fn(&str, &Error) + Send + Sync + 'static;

/// Runs the user's `on_lost` callback on a thread of its own, so that a slow
/// callback never delays the renewal of other locks. The thread ends when
/// the client is dropped (after the callback it may be running returns).
pub(crate) struct Callbacks {
    tx: crossbeam_channel::Sender<(String, Error)>,
}

impl Callbacks {
    pub(crate) fn spawn(f: Arc<LostCallback>) -> Option<Callbacks> {
        let (tx, rx) = crossbeam_channel::unbounded::<(String, Error)>();
        let spawned = std::thread::Builder::new()
            .name("qlock-on-lost".into())
            .spawn(move || {
                for (resource, err) in rx {
                    let run = std::panic::AssertUnwindSafe(|| f(&resource, &err));
                    if std::panic::catch_unwind(run).is_err() {
                        warn!("lock {resource:?}: the on_lost callback panicked");
                    }
                }
            });
        match spawned {
            Ok(_) => Some(Callbacks { tx }),
            Err(e) => {
                warn!("cannot start the on_lost thread: {e}; the callback will not run");
                None
            }
        }
    }

    fn notify(&self, resource: &str, err: &Error) {
        let _ = self.tx.send((resource.to_owned(), err.clone()));
    }
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// The shared record of one held lock (the guard's and the watchdog's).
pub(crate) struct LockState {
    pub(crate) id: u64,
    pub(crate) resource: String,
    pub(crate) token: String,
    /// The fencing token, for a client with fencing on.
    pub(crate) fence: Option<u64>,
    /// Start of the round that acquired it (events report time held).
    pub(crate) acquired: Instant,
    timing: Mutex<Timing>,
    /// The latest an extension sent for this lock may keep its key on a
    /// node (`start + ttl` of the longest sent), whether or not it
    /// succeeded: extensions never shorten a key.
    reach: Mutex<Option<Instant>>,
    /// Nodes that confirmed our key in the last round that touched it.
    holding: std::sync::atomic::AtomicUsize,
    /// A renewal round that may restore copies of the key is in flight:
    /// a release waits for it to end (see [`LockState::begin_renewal`]).
    in_renewal: AtomicBool,
    lost: AtomicBool,
    released: AtomicBool,
    renewing: AtomicBool,
    loss_tx: Mutex<Option<Sender<Error>>>,
    loss_rx: Receiver<Error>,
}

impl fmt::Debug for LockState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockState")
            .field("id", &self.id)
            .field("resource", &self.resource)
            .field("timing", &*self.timing.lock())
            .field("lost", &self.is_lost())
            .finish_non_exhaustive()
    }
}

/// When the lock was last confirmed and for how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Timing {
    /// Start of the round that last set the expiry (acquire or extend).
    pub since: Instant,
    /// Until when the lock may be assumed held.
    pub deadline: Instant,
    /// The TTL that round set.
    pub ttl: Duration,
}

impl LockState {
    pub(crate) fn new(resource: &str, token: String, fence: Option<u64>, timing: Timing) -> Self {
        let (tx, rx) = crossbeam_channel::bounded(1);
        LockState {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            resource: resource.to_owned(),
            token,
            fence,
            acquired: timing.since,
            timing: Mutex::new(timing),
            reach: Mutex::new(None),
            holding: std::sync::atomic::AtomicUsize::new(0),
            in_renewal: AtomicBool::new(false),
            lost: AtomicBool::new(false),
            released: AtomicBool::new(false),
            renewing: AtomicBool::new(false),
            loss_tx: Mutex::new(Some(tx)),
            loss_rx: rx,
        }
    }

    /// The key and token, as the transport takes them.
    pub(crate) fn key(&self) -> Key<'_> {
        Key::new(&self.resource, &self.token)
    }

    pub(crate) fn timing(&self) -> Timing {
        *self.timing.lock()
    }

    pub(crate) fn deadline(&self) -> Instant {
        self.timing.lock().deadline
    }

    /// Moves the lock to `timing` if that moves its deadline forward (in
    /// one step: two extensions finishing together never move it back).
    pub(crate) fn raise_timing(&self, timing: Timing) {
        let mut t = self.timing.lock();
        if timing.deadline > t.deadline {
            *t = timing;
        }
    }

    /// Records that an extension sent now may keep the key until `until`.
    pub(crate) fn reach_until(&self, until: Instant) {
        let mut r = self.reach.lock();
        *r = Some(r.map_or(until, |r| r.max(until)));
    }

    /// See [`reach_until`](Self::reach_until).
    pub(crate) fn reach(&self) -> Option<Instant> {
        *self.reach.lock()
    }

    pub(crate) fn is_lost(&self) -> bool {
        self.lost.load(Ordering::Acquire)
    }

    /// Records how many nodes confirmed our key in a round.
    pub(crate) fn set_holding(&self, nodes: usize) {
        self.holding.store(nodes, Ordering::Relaxed);
    }

    pub(crate) fn holding(&self) -> usize {
        self.holding.load(Ordering::Relaxed)
    }

    pub(crate) fn is_released(&self) -> bool {
        self.released.load(Ordering::Acquire)
    }

    /// The renewal thread is about to send a renewal of this lock, which
    /// restores its key where it is missing: false (and nothing sent) when
    /// the lock was released already. With [`take_release`](Self::take_release)
    /// and [`renewal_in_flight`](Self::renewal_in_flight), each side writes
    /// its flag then reads the other's (sequentially consistent), so that a
    /// release either stops the renewal or waits for it to end: a restored
    /// copy never lands after the release's delete.
    pub(crate) fn begin_renewal(&self) -> bool {
        self.in_renewal.store(true, Ordering::SeqCst);
        if self.released.load(Ordering::SeqCst) {
            self.in_renewal.store(false, Ordering::SeqCst);
            return false;
        }
        true
    }

    /// The renewal round of [`begin_renewal`](Self::begin_renewal) is over.
    pub(crate) fn end_renewal(&self) {
        self.in_renewal.store(false, Ordering::SeqCst);
    }

    /// Whether a renewal round of this lock is in flight (read after the
    /// release flag was set).
    pub(crate) fn renewal_in_flight(&self) -> bool {
        self.in_renewal.load(Ordering::SeqCst)
    }

    /// Declares the lock lost (once): flips the flag, fires the loss channel
    /// and the callback. Ignored after release: a release racing a renewal
    /// is not a loss. `loud` logs at warn (the watchdog found it), else debug
    /// (the caller of `extend` already gets the error).
    /// Declares the lock lost; true the first time only.
    pub(crate) fn lose(&self, err: &Error, callback: Option<&Callbacks>, loud: bool) -> bool {
        if self.is_released() || self.lost.swap(true, Ordering::AcqRel) {
            return false;
        }
        if loud {
            warn!("lock {:?} lost: {err}", self.resource);
        } else {
            debug!("lock {:?} lost: {err}", self.resource);
        }
        if let Some(tx) = self.loss_tx.lock().take() {
            let _ = tx.try_send(err.clone());
        }
        if let Some(cb) = callback {
            cb.notify(&self.resource, err);
        }
        true
    }

    /// Marks the lock released; true the first time only. Disconnects the
    /// loss channel so that nobody waits on it forever.
    pub(crate) fn take_release(&self) -> bool {
        let first = !self.released.swap(true, Ordering::SeqCst);
        if first {
            self.loss_tx.lock().take();
        }
        first
    }

    /// Marks the lock as renewed by the watchdog; true the first time only.
    pub(crate) fn start_renewing(&self) -> bool {
        !self.renewing.swap(true, Ordering::AcqRel)
    }

    pub(crate) fn is_renewing(&self) -> bool {
        self.renewing.load(Ordering::Acquire)
    }
}

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
    client: Redlock,
    state: Arc<LockState>,
    /// This thread's turn among local waiters; dropped (handing over) only
    /// after the release.
    turn: Option<Permit>,
    /// Released or handed over: nothing left for `Drop` to do.
    done: bool,
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
    pub(crate) fn new(client: Redlock, state: Arc<LockState>, turn: Option<Permit>) -> Self {
        LockGuard {
            client,
            state,
            turn,
            done: false,
        }
    }

    #[cfg(test)]
    pub(crate) fn state(&self) -> &Arc<LockState> {
        &self.state
    }

    fn inner(&self) -> &Inner {
        &self.client.inner
    }

    /// The locked resource (the Redis key).
    pub fn resource(&self) -> &str {
        &self.state.resource
    }

    /// This critical section's random token (the value stored under the
    /// key). A lock handed over between threads gets a new one, of the form
    /// `<lineage>.<random>` where the lineage is the token it was acquired
    /// with.
    pub fn token(&self) -> &str {
        &self.state.token
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
        let now = self.inner().clock.now();
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

    /// A channel that receives once, with the reason, when the lock is lost.
    /// Use it in `crossbeam_channel::select!` beside your own work to stop as
    /// soon as the lock is no longer yours. After the guard is released the
    /// channel is disconnected (`recv` returns `Err`).
    ///
    /// ```no_run
    /// # use std::time::Duration;
    /// # let locks = quorumlock::Redlock::builder().node("redis://127.0.0.1:6379").build()?;
    /// # let work = crossbeam_channel::never::<()>();
    /// let guard = locks.lock("job:import", Duration::from_secs(30))?;
    /// guard.auto_renew();
    /// crossbeam_channel::select! {
    ///     recv(work) -> _ => { /* finished under the lock */ }
    ///     recv(guard.lost()) -> why => { eprintln!("lock lost: {why:?}; stop writing"); }
    /// }
    /// # Ok::<(), quorumlock::Error>(())
    /// ```
    pub fn lost(&self) -> Receiver<Error> {
        self.state.loss_rx.clone()
    }

    /// Starts renewing this lock in the background until it is released or
    /// lost: the client's one watchdog thread extends it every
    /// `ttl × renew_fraction` (see [`Builder::renew_fraction`](crate::Builder::renew_fraction)).
    /// Calling it again does nothing. Locks taken by a client built with
    /// [`auto_renew(true)`](crate::Builder::auto_renew) are renewed already.
    pub fn auto_renew(&self) -> &Self {
        if !self.state.is_lost() && !self.state.is_released() && self.state.start_renewing() {
            self.inner().watchdog().add(self.state.clone());
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
        self.inner().extend(&self.state, ttl)
    }

    /// Releases the lock on every node and reports the outcome. Renewal
    /// stops before the keys are deleted. When other threads of this process
    /// are queued for the resource and at least half the TTL is left, the
    /// held lock passes to the next of them instead, which continues it
    /// under a token of its own (see
    /// [`Builder::local_queue`](crate::Builder::local_queue)); this guard's
    /// [`lost`](Self::lost) channel is disconnected either way.
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
    /// TTL left, hands the held lock to the next of them without a round trip.
    fn finish(&mut self) -> Option<Result<()>> {
        if std::mem::replace(&mut self.done, true) {
            return None;
        }
        if let Some(turn) = self.turn.take() {
            let t = self.state.timing();
            let left = t
                .deadline
                .saturating_duration_since(self.inner().clock.now());
            let handable = !self.state.is_renewing()
                && !self.state.is_lost()
                && !self.state.is_released()
                && left >= t.ttl / 2
                && turn.has_waiters();
            if handable {
                // With nobody left waiting, the lock and the turn come back:
                // released below, the turn passing on after.
                match turn.hand_over(self.state.clone()) {
                    Ok(()) => {
                        // This critical section ends here: the receiver
                        // continues under a token of its own.
                        self.state.take_release();
                        debug!(
                            "lock {:?}: handed to the next local waiter",
                            self.state.resource
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
            self.inner().watchdog().remove(self.state.id);
        }
        // Released holding the turn (the next local waiter must not race the
        // release on the nodes); the event handler is told after.
        let (outcome, results) = self.inner().release_round(&self.state);
        self.turn.take();
        self.inner().release_event(&self.state, &outcome, &results);
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
