//! A call's attempts at the nodes, and its waits between them: the local
//! queue's turn first, then attempts, each failure followed by a wait for a
//! release's wake-up (see [`crate::driver::notify`]) or a fallback: the
//! retry pause, or the owner's expiry where sooner, at most
//! [`FALLBACK_CAP`].

use std::sync::Arc;
use std::time::{Duration, Instant};

use log::{debug, trace};

use crate::algorithm::quorum;
use crate::clock::after;
use crate::error::Error;
use crate::events::Begun;
use crate::lock::queue::Turn;
use crate::lock::state::LockState;
use crate::Result;

use super::{Budget, Engine, Want};

/// Quick retries in a row after an attempt that found the key not held
/// everywhere (see `Engine::acquire`).
const QUICK_RETRIES: u32 = 2;

/// Woken tries in a row that met the same owners (see
/// [`quorum::new_owner`]) after which a waiter stops listening until its
/// next try by the clock. Three: such a try may be a real release followed
/// at once by an owner with as much time left, within a round's time (under
/// hot contention two in a row were seen, and the waiter missed the next
/// release by a retry pause); a stream of forged messages costs a waiter at
/// most three rounds per fallback pause.
const SAME_OWNERS: u32 = 3;

/// The longest a subscribed waiter waits for a wake-up before it tries
/// again (its retry pause or the owner's expiry, where shorter): a lost
/// message costs at most this.
pub(crate) const FALLBACK_CAP: Duration = Duration::from_secs(1);

/// What a failed attempt saw, for the wait after it.
#[derive(Debug, Default, Clone)]
pub(super) struct Failed {
    /// Nodes where its SET landed (undone since).
    pub ours: usize,
    /// How long until a majority could take the key, by the owners'
    /// remaining TTLs (see [`quorum::free_in`]).
    pub free_in: Option<Duration>,
    /// What each node said of the owner (see [`quorum::new_owner`]).
    pub owners: Vec<quorum::Seen>,
}

impl Engine {
    /// Locks `resource` within `budget`: this thread's turn in the local
    /// queue first (taking over a lock handed to it), then attempts with a
    /// jittered pause between them. Returns the lock and the turn it holds.
    ///
    /// `want.also`: the other resources of a lock of several (see
    /// `several`), validated by the caller. Such a lock, and a read lock,
    /// has no turn in a local queue (its threads meet at the nodes); their
    /// waiters are woken together, by a release of any of their resources.
    /// A writer that waits (not `try_lock`) keeps new readers out while it
    /// does (see [`Op::Acquire`](crate::algorithm::round::Op::Acquire)).
    pub(crate) fn acquire(
        &self,
        want: Want<'_>,
        budget: Budget,
    ) -> Result<(Arc<LockState>, Option<Turn>)> {
        let Want {
            resource,
            also,
            ttl,
            ..
        } = want;
        let called = self.clock.now();
        let drift = self.validate(resource, ttl)?;
        // One deadline for the whole call, local wait and attempts alike.
        let keys = also.len().saturating_add(1);
        let until = self.wait_deadline(budget, keys);
        let single = want.alone();
        let mut turn = if single {
            self.queue_turn(resource, budget, until)
        } else {
            None
        };
        if let Some(handed) = turn.as_ref().and_then(Turn::take_hand_over) {
            match self.accept_hand_over(&handed, ttl) {
                Ok(state) => {
                    debug!("lock {resource:?}: taken over from a local holder");
                    return Ok((Arc::new(state), turn));
                }
                Err(e) if self.clock.now() >= until => {
                    debug!("lock {resource:?}: not taken over ({e}) and no time left");
                    return Err(e);
                }
                Err(e) => {
                    debug!("lock {resource:?}: not taken over ({e}); locking anew");
                }
            }
        }
        let waits = !matches!(budget, Budget::Attempts(1));
        let wakes = waits && self.settings.wake_ups;
        if waits {
            self.yield_to_others(resource, also, until);
        }
        // This client's own releases wake its waiters for locks of several
        // and its readers.
        let _set_waiting = (waits && !single).then(|| self.remote.set_waiting());
        // A waiting writer's intent outlives the longest wait between its
        // tries: the retry pause, and the round and undo before it (each
        // as long as a round of its keys may wait). (Not
        // cut to the TTL: a TTL below the pause let readers in between the
        // tries, and a stream of them starved the writer.)
        let span = if waits && !want.read {
            let s = &self.settings;
            s.retry_delay
                .saturating_add(s.retry_jitter)
                .saturating_add(self.allowance(keys).saturating_mul(3))
        } else {
            Duration::ZERO
        };
        let mut attempt = 1u32;
        // When the next counted attempt is due (the retry pause after the
        // last): a subscribed waiter's tries at a shorter fallback (the cap,
        // the owner's expiry) come in between, not counted, so that
        // `lock()`'s attempts stay a retry pause apart.
        let mut due: Option<Instant> = None;
        // Wake-ups by the releases of other clients (see
        // `crate::driver::notify`): from the first failed attempt on, or
        // from the start where this client is subscribed already.
        let mut watch = if wakes && single {
            self.transport.watch_existing(resource)
        } else {
            None
        };
        let mut seen = 0;
        let mut woken = false;
        // Whether this attempt was made with the other waiters at once:
        // woken, or at the owners' expiry.
        let mut together = false;
        // Whether an owner's expiry may end a wait: not after an attempt at
        // an expiry found the key still held (a live holder renews it; its
        // waiters would try at every expiry they read), for the rest of the
        // call.
        let mut trust_expiry = true;
        let mut at_expiry = false;
        // Wake-ups this call lost (the last one woken is not lost yet).
        let mut lost = 0u32;
        // What the last attempt saw of the owners, and when: a woken
        // attempt that meets the same owners again may have been woken by
        // a message no release sent (forged, or from another database:
        // pub/sub ignores it). After `SAME_OWNERS` such tries in a row the
        // waiter hears no more messages until its next try by the clock
        // (see `quorum::new_owner`).
        // (With the attempt's time: the window of its readings.)
        let mut owners: Option<(Instant, Duration, Vec<quorum::Seen>)> = None;
        let mut same = 0u32;
        let mut quick = 0;
        loop {
            if let Some(w) = &watch {
                seen = w.seen();
            }
            let tried = self.clock.now();
            let begun = Begun {
                waited: tried.saturating_duration_since(called),
                woken,
            };
            let mut failed = Failed::default();
            // ... but not past the call: an attempt after which no try
            // may come (the last counted one, or at the deadline) marks
            // none, and none outlives the call's wait (a writer that gave
            // up kept readers out for a whole pause).
            let last = matches!(budget, Budget::Attempts(n) if attempt >= n);
            let intent = if last {
                Duration::ZERO
            } else {
                span.min(until.saturating_duration_since(tried))
            };
            let err = match self.attempt(want, drift, intent, begun, until, &mut failed) {
                Ok(state) => return Ok((Arc::new(state), turn.take())),
                Err(e) if e.is_retryable() => e,
                Err(e) => return Err(e),
            };
            // Drawn first, as always (the simulation's schedules rest on the
            // order of the draws).
            let s = &self.settings;
            let pause = quorum::retry_delay(s.retry_delay, s.retry_jitter, self.rng.next_u64());
            let now = self.clock.now();
            let left = until.saturating_duration_since(now);
            if left.is_zero() {
                return Err(err);
            }
            if watch.is_none() && wakes {
                // Subscribed, then tried again at once (not counted as an
                // attempt): the release may have come before the
                // subscription.
                let confirm_by = after(now, self.settings.node_timeout.min(left));
                watch = if single {
                    self.transport.watch(resource, confirm_by)
                } else {
                    let names: Vec<&str> = std::iter::once(resource)
                        .chain(also.iter().map(String::as_str))
                        .collect();
                    self.transport.watch_all(&names, confirm_by)
                };
                if watch.is_some() {
                    debug!("lock {resource:?}: attempt failed ({err}); waiting for its release");
                    continue;
                }
            }
            // A woken try never counts: a message is a hint anyone can
            // send, and must not use up `lock()`'s attempts, which stay a
            // retry pause apart.
            if due.is_none_or(|d| now >= d) {
                if let Budget::Attempts(n) = budget {
                    if attempt >= n {
                        return Err(err);
                    }
                }
                attempt = attempt.saturating_add(1);
                due = Some(after(now, pause));
            }
            // What is left of the retry pause.
            let pause = due.map_or(pause, |d| d.saturating_duration_since(now));
            let took = now.saturating_duration_since(tried);
            // Each reading is somewhere in its attempt: off by the longer
            // of the two attempts' times (and PTTL's millisecond).
            let read_in = owners.as_ref().map_or(took, |(_, t, _)| took.max(*t));
            let slack = read_in.saturating_add(Duration::from_millis(1));
            let before = owners.as_ref().map(|(t, _, o)| (*t, o.as_slice()));
            same = if woken && !quorum::new_owner(before, &failed.owners, now, slack) {
                same.saturating_add(1)
            } else {
                0
            };
            let deaf = same >= SAME_OWNERS;
            let free_in = failed.free_in;
            owners = Some((now, took, failed.owners));
            // A woken attempt that set the key on some nodes and still
            // lost: maybe waiters woken together split the votes and each
            // undid its own, which frees the key without a message. Tried
            // again soon (half to twice an attempt's time, at random),
            // twice in a row at most, then the retry pause. Not where the
            // try met the same owners again (`deaf`): a real split shows
            // other waiters' keys where the try before saw none, and a quick
            // retry is no try by the clock (a holder on a bare majority let
            // every forged message set the free nodes, and the quick retries
            // in between ended the deafness: ~150 rounds in a 1.2 s storm).
            let split = !deaf
                && watch.is_some()
                && (together || quick > 0)
                && quick < QUICK_RETRIES
                && failed.ours > 0
                && matches!(err, Error::Taken { .. });
            // A subscribed waiter's fallback, should no wake-up come: the
            // retry pause, or sooner the moment the owners' keys expire on
            // a majority (a holder that stopped without a release), never
            // more than `FALLBACK_CAP`. (Where this attempt set some nodes,
            // the owners elsewhere may be waiters that split the votes with
            // it: their keys' expiry is a whole TTL, and the shorter of it
            // and the pause never waits longer.)
            if at_expiry && !split {
                trust_expiry = false;
            }
            let expiry = watch
                .as_ref()
                .and(free_in)
                .filter(|_| trust_expiry)
                .map(|f| f.saturating_add(Duration::from_millis(1)));
            let pause = if split {
                quick += 1;
                quorum::retry_delay(took * 5 / 4, took * 3 / 4, self.rng.next_u64()).min(pause)
            } else {
                quick = 0;
                match (&watch, expiry) {
                    (Some(_), Some(e)) => e.min(pause).min(FALLBACK_CAP),
                    (Some(_), None) => pause.min(FALLBACK_CAP),
                    (None, _) => pause,
                }
            }
            .min(left);
            at_expiry = !split && expiry.is_some_and(|e| e <= pause);
            debug!("lock {resource:?}: attempt failed ({err}); retrying within {pause:?}");
            match &watch {
                Some(w) => {
                    woken = if deaf {
                        trace!("lock {resource:?}: woken for nothing; not listening for {pause:?}");
                        self.clock.sleep(pause);
                        false
                    } else {
                        w.wait(seen, after(self.clock.now(), pause))
                    };
                    // Woken, or at the owners' expiry: every waiter would
                    // try at once.
                    together = woken || at_expiry;
                    if woken {
                        // (The expiry stays untrusted where it was: a woken
                        // try that fails may meet the same renewed holder,
                        // after a forged or duplicated message; a new owner
                        // that dies costs at most the cap.)
                        at_expiry = false;
                    }
                    if together {
                        // Every woken waiter would try at once. Each waits
                        // one attempt's time over one more than the
                        // wake-ups it lost (less up to a quarter, at
                        // random): who lost more rounds goes first, close
                        // to first come, first served, and the votes
                        // rarely split. Never sooner than one attempt's
                        // time after its last one ended: a stream of
                        // messages cannot drive rounds back to back.
                        lost = lost.saturating_add(1);
                        let ahead = took / lost;
                        let spread = ahead.saturating_sub(quorum::retry_delay(
                            ahead / 8,
                            ahead / 8,
                            self.rng.next_u64(),
                        ));
                        let spaced = after(now, took).saturating_duration_since(self.clock.now());
                        let wait = spread
                            .max(spaced)
                            .min(until.saturating_duration_since(self.clock.now()));
                        trace!("lock {resource:?}: woken ({woken}); trying in {wait:?}");
                        self.clock.sleep(wait);
                    } else {
                        trace!("lock {resource:?}: not woken; trying again");
                    }
                }
                None => {
                    (together, at_expiry) = (false, false);
                    self.clock.sleep(pause);
                }
            }
        }
    }
}
