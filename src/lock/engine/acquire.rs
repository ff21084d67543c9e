//! A call's attempts at the nodes, and its waits between them: the local
//! queue's turn first, then attempts, each failure followed by a wait for a
//! release's wake-up (see [`crate::driver::notify`]) or a fallback: the
//! retry pause, or the owner's expiry where sooner, at most
//! [`FALLBACK_CAP`].

use std::cell::Cell;
use std::sync::Arc;
use std::time::{Duration, Instant};

use log::{debug, trace};

use crate::algorithm::quorum::{self, Tally};
use crate::algorithm::restart::{self, RestartRule};
use crate::algorithm::round::{Key, NodeFacts, NodeResult, Op};
use crate::clock::{after, new_reader_token, new_token};
use crate::error::Error;
use crate::events::Begun;
use crate::lock::queue::Turn;
use crate::lock::state::{LockState, Timing};
use crate::lock::transport::AfterRound;
use crate::Result;

use super::{history, Budget, Engine, Want};

/// An acquire round's outcome: when it ended, the decision, and the results
/// after the delayed-restart rule.
type Decision = (Instant, Result<Duration>, Vec<NodeResult>);

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
    /// does (see [`Op::Acquire`]).
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
        // Tries so far, counted or not.
        let mut tries = 0u32;
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
            let first = tries == 0;
            tries += 1;
            let err = match self.attempt(want, drift, (intent, first), begun, until, &mut failed) {
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

    /// One acquisition round: SET NX PX on every node, then the decision.
    /// On failure, releases wherever our SET may have landed, on the same
    /// connections as the SET.
    ///
    /// `intent`: for a writer that will try again, how long live readers
    /// keep new readers out (see [`Op::Acquire`]; zero for a reader), and
    /// whether this is the call's first try (see [`Engine::lean`]).
    /// `until`: the end of the call, which a first use's wait for the
    /// nodes' histories does not pass.
    fn attempt(
        &self,
        want: Want<'_>,
        drift: Duration,
        (intent, first_try): (Duration, bool),
        begun: Begun,
        until: Instant,
        seen: &mut Failed,
    ) -> Result<LockState> {
        let Want {
            resource,
            also,
            ttl,
            read,
        } = want;
        let token = if read {
            new_reader_token()
        } else {
            new_token()
        };
        // One key per resource, all with this token (a lock of several:
        // one vote per node for them all; see `several`).
        let one = [Key::new(resource, &token)];
        let several: Vec<Key<'_>>;
        let keys: &[Key<'_>] = if also.is_empty() {
            &one
        } else {
            several = one
                .into_iter()
                .chain(also.iter().map(|r| Key::new(r, &token)))
                .collect();
            &several
        };
        let mut start = self.clock.now();
        let known = *self.ttls.lock();
        // A first use learns the nodes' histories first (waiting at most
        // one node timeout, as a connect would, and not past the call's
        // end); the round starts after.
        let learn = after(start, self.settings.node_timeout).min(until);
        let first = self.first_use(ttl, &known, Some(learn));
        if ttl > known.max {
            start = self.clock.now();
        }
        let told = history::told(ttl, &known, first);
        let rule = RestartRule {
            enabled: self.settings.restart_protection,
            floor: ttl,
            known,
            complete: false,
            #[cfg(test)]
            loose: self.settings.loose_restart_rule,
        };
        // No point waiting for replies past the moment validity would be gone.
        let budget = self.allowance(keys.len()).min(ttl.saturating_sub(drift));
        let horizon = self.horizon();
        let settled = |results: &[Option<NodeResult>]| {
            let longest = rule.longest(restart::facts_of(results.iter().flatten()));
            // Whether the round can still be one every node answered: a vote
            // that would count then may count (`certain` waits for them all).
            let rule = RestartRule {
                complete: results
                    .iter()
                    .all(|r| r.as_ref().is_none_or(restart::answered)),
                ..rule
            };
            let counts = |i: usize, facts: Option<&NodeFacts>| {
                facts.is_none_or(|f| {
                    let all = restart::facts_of(results.iter().flatten());
                    rule.hold(f, all, self.trusted(i, f)).is_zero()
                })
            };
            // A young vote counts only once every waited-for node answered:
            // a straggler may report a longer TTL in use.
            let all_in = results.iter().all(Option::is_some);
            let certain = |i: usize, facts: Option<&NodeFacts>| {
                counts(i, facts)
                    && (all_in
                        || !rule.enabled
                        || facts
                            .is_none_or(|f| f.age >= horizon.max(longest) || self.trusted(i, f)))
            };
            let need = quorum::to_settle_acquire(results, certain, counts);
            // A TTL longer than every client promised (`max_ttl`) in use:
            // a reply may then disqualify votes counted as certain, several
            // at once; the round looks at every reply.
            if longest > horizon {
                need.min(1)
            } else {
                need
            }
        };
        // The decision, made once the replies are in (and before any undo).
        let decision: Cell<Option<Decision>> = Cell::new(None);
        let decide = |results: &[NodeResult]| {
            let end = self.clock.now();
            let judged = self.apply_restart_rule(results.to_vec(), &rule);
            let elapsed = end.saturating_duration_since(start);
            let tally = Tally::of(&judged, 0);
            // Our SET may have landed on a node that answered OK or not at all.
            let maybe_set = tally.ok > 0
                || judged.iter().zip(results).any(|(j, r)| {
                    j.is_err()
                        && !matches!(r, Err(e) if e.kind() == crate::NodeErrorKind::NoConnection)
                });
            let outcome = quorum::decide_acquire(tally, ttl, elapsed, drift);
            let next = match (&outcome, maybe_set) {
                (Ok(_), _) => AfterRound::Complete,
                (Err(_), true) => AfterRound::Undo,
                (Err(_), false) => AfterRound::Done,
            };
            decision.set(Some((end, outcome, judged)));
            next
        };
        let plain = !self.settings.fencing && !read && also.is_empty();
        let lean = (plain && (intent.is_zero() || first_try))
            .then(|| self.lean(ttl, &rule))
            .flatten();
        let results = self.run_keys(
            Op::Acquire {
                ttl,
                known_max: known.max,
                // A reader orders nothing: storage is guarded by its writers.
                fenced: self.settings.fencing && !read,
                after: told.0,
                known_prev: told.1,
                // (A lean acquire marks none.)
                intent: lean.map_or(intent, |_| Duration::ZERO),
                lean,
            },
            keys,
            &[keys.len()],
            after(start, budget),
            Some(&settled),
            Some(&decide),
        );
        let (end, outcome, judged) = match decision.take() {
            Some(d) => d,
            None => {
                // A transport that did not call `undo`: decide now.
                let _ = decide(&results);
                decision
                    .take()
                    .unwrap_or_else(|| (self.clock.now(), Err(Error::Expired), Vec::new()))
            }
        };
        self.record_histories(&results, Some((ttl, first)));
        self.note_failures(&judged);
        let elapsed = end.saturating_duration_since(start);
        // Where our key is now (held-back votes included: the key is set).
        let holding = quorum::holding(&results, 0);
        let result = (|| match outcome {
            Ok(validity) => {
                debug!("lock {resource:?}: acquired in {elapsed:?}, valid for {validity:?}");
                trace!("lock {resource:?}: token {token}");
                let timing = Timing {
                    since: start,
                    deadline: after(end, validity),
                    ttl,
                };
                let lock = |fence| {
                    let state = LockState::new(resource, token, fence, timing);
                    state.set_holding(holding);
                    state.with_also(also.to_vec())
                };
                if !self.settings.fencing || read {
                    return Ok(lock(None));
                }
                // The token: the largest counter among the granting nodes.
                let fence = judged
                    .iter()
                    .filter_map(|r| r.as_ref().ok()?.fence)
                    .max()
                    .unwrap_or(0);
                let state = lock(Some(fence));
                self.write_back(&state, fence)?;
                Ok(state)
            }
            Err(e) => {
                debug!("lock {resource:?}: not acquired in {elapsed:?}: {e}");
                Err(e)
            }
        })();
        if self.settings.events.get().is_some() {
            let rule = rule.heard(&results);
            let holds: Vec<Duration> = results
                .iter()
                .enumerate()
                .map(|(i, r)| {
                    r.as_ref()
                        .ok()
                        .and_then(|r| r.facts)
                        .map_or(Duration::ZERO, |f| {
                            let all = restart::facts_of(results.iter());
                            rule.hold(&f, all, self.trusted(i, &f))
                        })
                })
                .collect();
            self.attempt_event(resource, start, result.as_ref(), &judged, &holds, begun);
        }
        if result.is_err() {
            *seen = Failed {
                ours: Tally::of(&judged, 0).ok,
                free_in: quorum::free_in(&judged, 0),
                owners: quorum::seen(&judged, 1 + also.len()),
            };
        }
        result
    }
}
