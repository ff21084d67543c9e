//! [`LockState`]: the record of one held lock that its guard, the renewal
//! thread and the local queue share.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use log::{debug, warn};
use parking_lot::Mutex;

use crate::algorithm::round::Key;
use crate::error::Error;
use crate::lock::spans::Caller;

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// The shared record of one held lock (the guard's and the watchdog's).
pub(crate) struct LockState {
    pub(crate) id: u64,
    pub(crate) resource: String,
    /// A lock of several resources (`request().and()`): the others, after
    /// `resource`, all with the same token and held as one.
    pub(crate) also: Vec<String>,
    pub(crate) token: String,
    /// The fencing token, for a client with fencing on.
    pub(crate) fence: Option<u64>,
    /// The critical section's number in its lineage: 1 for a lock acquired
    /// at the nodes, one more at each local hand-over.
    pub(crate) section: u64,
    /// Start of the round that acquired it (events report time held).
    pub(crate) acquired: Instant,
    /// The span current where the lock was taken: the parent of the spans
    /// of the renewal thread's work for it (empty without `tracing`).
    pub(crate) caller: Caller,
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
    released: AtomicBool,
    renewing: AtomicBool,
    /// Why the lock was lost, once it was (set once: the lock is lost).
    lost: OnceLock<Error>,
    /// Dropped when the lock is lost or released: every
    /// [`LostSignal`](crate::LostSignal) waiting on `ended` then wakes.
    end: Mutex<Option<Sender<()>>>,
    ended: Receiver<()>,
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
        let (tx, rx) = crossbeam_channel::bounded(0);
        LockState {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            resource: resource.to_owned(),
            also: Vec::new(),
            token,
            fence,
            section: 1,
            acquired: timing.since,
            caller: Caller::none(),
            timing: Mutex::new(timing),
            reach: Mutex::new(None),
            holding: std::sync::atomic::AtomicUsize::new(0),
            in_renewal: AtomicBool::new(false),
            released: AtomicBool::new(false),
            renewing: AtomicBool::new(false),
            lost: OnceLock::new(),
            end: Mutex::new(Some(tx)),
            ended: rx,
        }
    }

    /// The next section of this lock, handed over locally, under `token`
    /// and `fence` (new where a swap wrote them), begun at `now`: the same
    /// expiry, node count and reach (an extension the old section sent may
    /// still land: the extend script takes any token of the lineage).
    pub(crate) fn next_section(
        &self,
        now: Instant,
        token: String,
        fence: Option<u64>,
    ) -> LockState {
        let mut next = LockState::new(&self.resource, token, fence, self.timing());
        next.section = self.section.saturating_add(1);
        next.acquired = now;
        *next.reach.get_mut() = self.reach();
        next.set_holding(self.holding());
        next
    }

    /// Whether it is a read lock (shared with other readers).
    pub(crate) fn is_read(&self) -> bool {
        crate::algorithm::round::is_reader(&self.token)
    }

    /// The key and token, as the transport takes them.
    pub(crate) fn key(&self) -> Key<'_> {
        Key::new(&self.resource, &self.token)
    }

    /// How many keys the lock has on each node.
    pub(crate) fn size(&self) -> usize {
        self.also.len().saturating_add(1)
    }

    /// Every key of the lock, its first resource's first.
    pub(crate) fn keys(&self) -> impl Iterator<Item = Key<'_>> {
        std::iter::once(self.key()).chain(self.also.iter().map(|r| Key::new(r, &self.token)))
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
        self.lost.get().is_some()
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

    /// Declares the lock lost (once; true the first time only): keeps the
    /// reason and wakes every [`LostSignal`](crate::LostSignal). Ignored
    /// after release: a release racing a renewal is not a loss. `loud` logs
    /// at warn (the watchdog found it), else debug (the caller of `extend`
    /// already gets the error).
    pub(crate) fn lose(&self, err: &Error, loud: bool) -> bool {
        // Under `end`, as `take_release`: a signal ends once, lost or
        // released, and a lost one has its reason by then.
        let mut end = self.end.lock();
        if end.is_none() || self.is_released() {
            return false;
        }
        let _ = self.lost.set(err.clone());
        end.take();
        drop(end);
        if loud {
            warn!("lock {:?} lost: {err}", self.resource);
        } else {
            debug!("lock {:?} lost: {err}", self.resource);
        }
        true
    }

    /// Marks the lock released; true the first time only. Wakes every
    /// [`LostSignal`](crate::LostSignal), so that nobody waits forever.
    pub(crate) fn take_release(&self) -> bool {
        let mut end = self.end.lock();
        let first = !self.released.swap(true, Ordering::SeqCst);
        if first {
            end.take();
        }
        first
    }

    /// Whether the lock was found lost or released.
    pub(crate) fn has_ended(&self) -> bool {
        self.is_lost() || self.is_released()
    }

    /// Marks the lock as renewed by the watchdog; true the first time only.
    pub(crate) fn start_renewing(&self) -> bool {
        !self.renewing.swap(true, Ordering::AcqRel)
    }

    /// Disconnected once the lock is lost or released.
    pub(crate) fn ended(&self) -> &Receiver<()> {
        &self.ended
    }

    /// Why the lock was lost, if it was.
    pub(crate) fn lost_reason(&self) -> Option<Error> {
        self.lost.get().cloned()
    }

    pub(crate) fn is_renewing(&self) -> bool {
        self.renewing.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn state() -> Arc<LockState> {
        let now = Instant::now();
        let timing = Timing {
            since: now,
            deadline: now + Duration::from_secs(1),
            ttl: Duration::from_secs(1),
        };
        Arc::new(LockState::new("r", "t".into(), None, timing))
    }

    /// A loss signal ends once: a loss after the release is none, and a
    /// loss before it keeps its reason through the release.
    #[test]
    fn a_loss_signal_ends_once_with_its_reason_or_none() {
        let released = state();
        assert!(!released.has_ended());
        assert!(released.take_release());
        assert!(!released.lose(&Error::Expired, false), "released first");
        assert!(released.has_ended() && released.lost_reason().is_none());
        assert!(!released.is_lost());

        let lost = state();
        let ended = lost.ended();
        assert!(lost.lose(&Error::NotOwner { nodes: 2 }, false));
        assert!(!lost.lose(&Error::Expired, false), "once");
        assert!(ended.recv().is_err(), "the waiters wake");
        lost.take_release();
        assert!(matches!(
            lost.lost_reason(),
            Some(Error::NotOwner { nodes: 2 })
        ));
    }
}
