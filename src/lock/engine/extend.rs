//! Extensions: one round for many locks, with the missing copies of each
//! restored where a majority still holds it.

use std::time::{Duration, Instant};

use crate::algorithm::quorum::{self, Tally};
use crate::algorithm::round::{candidate_of, After, Key, NodeResult, Op};
use log::{debug, trace};

use crate::clock::after;
use crate::error::Error;
use crate::events::{Nodes, RenewalEvent};
use crate::lock::state::{LockState, Timing};
use crate::Result;

use super::Engine;

impl Engine {
    /// Sets the lock's expiry to `ttl` on every node where it holds our
    /// token; on success moves the state's deadline and returns the new
    /// validity.
    pub(crate) fn extend(&self, state: &LockState, ttl: Duration) -> Result<Duration> {
        self.validate(&state.resource, ttl)?;
        let mut outcome = self.extend_many(&[state], ttl, false);
        outcome.pop().unwrap_or(Err(Error::Expired))
    }

    /// Extends many locks to the same `ttl` in one round trip per node.
    /// Each lock's outcome is decided on its own: a majority, completed
    /// inside that lock's old validity. Locks found gone or taken are
    /// declared lost (`loud`: logged at warn).
    pub(crate) fn extend_many(
        &self,
        states: &[&LockState],
        ttl: Duration,
        loud: bool,
    ) -> Vec<Result<Duration>> {
        let drift = quorum::drift_allowance(ttl, self.settings.drift_factor);
        // A TTL grown by extension is a TTL in use, for the restart rule (the
        // extend script records it on the nodes too, as first used now if
        // it is longer than any this client knew of).
        let start = self.clock.now();
        let (known, told) = {
            let mut ttls = self.ttls.lock();
            let known = *ttls;
            // A held lock's connections are made: no wait.
            let begun = self.first_use(ttl, &known, None);
            *ttls = ttls.used(ttl, begun);
            (known.max, super::history::told(ttl, &known, begun))
        };
        let time_left: Vec<Duration> = states
            .iter()
            .map(|s| s.deadline().saturating_duration_since(start))
            .collect();
        let results = self.extension_round(states, ttl, loud, start, (known, told));
        let end = self.clock.now();
        self.note_failures(&results);
        let round = Extension {
            ttl,
            drift,
            start,
            end,
            loud,
        };
        let decided: Vec<(usize, Result<Duration>, bool)> = states
            .iter()
            .enumerate()
            .map(|(i, state)| self.judge_extension(&round, state, &results, i, time_left[i]))
            .collect();
        // A lock held on a majority whose key is missing elsewhere (a node
        // restarted empty or evicted it, or the acquisition never reached
        // it): its copies are restored, one round for them all.
        let missing: Vec<usize> = (0..states.len())
            .filter(|&i| {
                let (absent, o, _) = &decided[i];
                o.is_ok() && *absent > 0 && !states[i].is_released()
            })
            .collect();
        let restored = if missing.is_empty() {
            Vec::new()
        } else {
            let locks: Vec<&LockState> = missing.iter().map(|&i| states[i]).collect();
            // A caller's extension waits for its restore no longer than the
            // lock's old validity (it returns within it, as it would have
            // without the restore); the renewal thread waits the whole bound.
            let by = (!loud).then(|| {
                let old = missing
                    .iter()
                    .map(|&i| after(start, time_left[i]))
                    .min()
                    .unwrap_or(start);
                old.checked_sub(Duration::from_millis(1)).unwrap_or(old)
            });
            self.restore(&locks, ttl, by)
        };
        states
            .iter()
            .zip(decided)
            .enumerate()
            .map(|(i, (state, (_, outcome, lost_now)))| {
                // What each node holds now: this round's answers, with the
                // copies restored after it.
                let merged = missing
                    .iter()
                    .position(|&m| m == i)
                    .filter(|_| !restored.is_empty())
                    .map(|p| merge_restored(&results, i, &restored, p));
                let (view, index) = match &merged {
                    Some(m) => (&m[..], 0),
                    None => (&results[..], i),
                };
                let told = (outcome, lost_now, time_left[i]);
                self.report_extension(&round, state, (view, index), told)
            })
            .collect()
    }

    /// An extension round for `states` to `ttl`, begun at `start` (`loud`:
    /// the renewal thread's), with the TTLs in use `known` and what the
    /// nodes are `told`: every node's answers, none where no time was left.
    fn extension_round(
        &self,
        states: &[&LockState],
        ttl: Duration,
        loud: bool,
        start: Instant,
        (known, told): (Duration, (After, Duration)),
    ) -> Vec<NodeResult> {
        let keys: Vec<Key<'_>> = states.iter().flat_map(|s| s.keys()).collect();
        let sizes = super::several::sizes_of(states);
        let mut deadline = self.round_deadline(start, keys.len());
        if let [only] = states {
            // A lone extension need not wait past its lock's validity.
            deadline = deadline.min(only.deadline());
        }
        for state in states {
            state.reach_until(after(start, ttl));
        }
        if deadline > start {
            // Stop at a settled majority (every lock's, for a batch); the
            // renewal thread's rounds linger after that, as long again, for
            // the stragglers: a node that lost the key says so, and its copy
            // is restored (the renewal thread's time, not a caller's; a slow
            // node that answers within the node timeout but after the lock's
            // validity no longer costs the lock).
            // (Each lock's answers folded into one: see `several`.)
            let n = states.len();
            let settled = move |r: &[Option<NodeResult>]| quorum::to_settle_all(r, n);
            let op = Op::Extend {
                ttl,
                linger: loud,
                known_max: known,
                after: told.0,
                known_prev: told.1,
            };
            self.run_keys(op, &keys, &sizes, deadline, Some(&settled), None)
        } else {
            Vec::new()
        }
    }

    /// One lock's outcome in an extension round, from its answers (the
    /// `index`th lock of `results`; it had `time_left` when the round
    /// began), set on the lock at once (its new deadline, or its loss)
    /// before any copy is restored: the nodes it was missing from, the
    /// outcome, whether it was lost now.
    fn judge_extension(
        &self,
        round: &Extension,
        state: &LockState,
        results: &[NodeResult],
        index: usize,
        time_left: Duration,
    ) -> (usize, Result<Duration>, bool) {
        let Extension {
            ttl, drift, end, ..
        } = *round;
        let elapsed = end.saturating_duration_since(round.start);
        let tally = Tally::of(results, index);
        let absent = tally.absent;
        let mut outcome = if time_left.is_zero() || results.is_empty() {
            Err(Error::Expired)
        } else {
            quorum::decide_extend(tally, ttl, elapsed, drift, time_left)
        };
        if matches!(outcome, Err(Error::ValidityExhausted { .. }))
            && state.deadline() >= after(end, ttl.saturating_sub(drift))
        {
            // A TTL too short to survive the round, on a lock that already
            // lasts that long: nothing to do, and done.
            outcome = Ok(Duration::ZERO);
        }
        let mut lost_now = false;
        match &outcome {
            // The script never shortens a key: a TTL shorter than what was
            // left leaves the lock as it was.
            Ok(validity) => state.raise_timing(Timing {
                since: round.start,
                deadline: after(end, *validity),
                ttl,
            }),
            Err(e @ (Error::NotOwner { .. } | Error::Expired)) => {
                lost_now = state.lose(e, round.loud);
            }
            Err(_) => {}
        }
        (absent, outcome, lost_now)
    }

    /// Tells of one lock's extension: where it is held now (the `index`th
    /// lock of `view`, the round's answers with any copies restored), the
    /// events, and its loss (`lost_now`; it had `time_left` when the round
    /// began); returns the validity left.
    fn report_extension(
        &self,
        round: &Extension,
        state: &LockState,
        (view, index): (&[NodeResult], usize),
        (outcome, lost_now, time_left): (Result<Duration>, bool, Duration),
    ) -> Result<Duration> {
        let (end, elapsed) = (round.end, round.end.saturating_duration_since(round.start));
        // Only a round that confirmed the lock says where it is: one that
        // failed (too few answers in time) found nothing missing.
        if outcome.is_ok() && !view.is_empty() {
            state.set_holding(quorum::holding(view, index));
        }
        if let Some(h) = self.settings.events.get() {
            h.on_renewal(&RenewalEvent {
                resource: &state.resource,
                section: state.section,
                automatic: round.loud,
                left: time_left,
                elapsed,
                outcome: outcome
                    .as_ref()
                    .map(|_| state.deadline().saturating_duration_since(end)),
                nodes: Nodes::new(self.transport.node_names(), view, index),
            });
        }
        if let (true, Err(e)) = (lost_now, &outcome) {
            self.lost_event(state, e);
        }
        trace!("extend {:?}: {outcome:?} in {elapsed:?}", state.resource);
        outcome.map(|_| state.deadline().saturating_duration_since(end))
    }

    /// Sets held locks' keys again where they are missing (`SET NX PX ttl`
    /// with our tokens), waiting for every node's answer within the node
    /// timeout (one more per 200 keys), and no later than `by` when given. A
    /// release of one of these locks comes after this round: the holder's
    /// own extension returns only then, and a release waits for the renewal
    /// thread's round (see [`LockState::begin_renewal`]), so a restored copy
    /// does not land after the release's delete. A node that has not
    /// answered by the end may still restore a copy after a release: its
    /// token stays unsettled, and the release's retries delete it.
    pub(super) fn restore(
        &self,
        locks: &[&LockState],
        ttl: Duration,
        by: Option<Instant>,
    ) -> Vec<NodeResult> {
        let now = self.clock.now();
        let keys = locks.iter().map(|s| s.size()).sum();
        let bound = self.round_deadline(now, keys);
        let deadline = by.map_or(bound, |by| by.min(bound));
        let results = self.run_locks(Op::Restore { ttl }, locks, deadline, None);
        if by.is_none() {
            // (A caller's restore may be cut short by its lock's validity:
            // a reply not waited for then is no node's failure.)
            self.note_failures(&results);
        }
        debug!(
            "restored {} missing cop(ies) of {} lock(s)",
            (0..locks.len())
                .map(|k| Tally::of(&results, k).restored)
                .sum::<usize>(),
            locks.len()
        );
        // A leader's lease restored on a node (restarted empty, say) has
        // its term recorded there again, so that observers that read the
        // nodes the restart did not spare still find it (see `FENCE_LUA`).
        for (k, lock) in locks.iter().enumerate() {
            if let (Some(term), true) = (lock.fence, candidate_of(&lock.token).is_some()) {
                if Tally::of(&results, k).restored > 0 {
                    let d = self.round_deadline(self.clock.now(), lock.size());
                    let d = by.map_or(d, |by| by.min(d));
                    let _ = self.run_locks(Op::Fence { value: term }, &[lock], d, None);
                }
            }
        }
        results
    }
}

/// One lock's answers per node (a one-answer reply each): the extension's
/// (`results`, key `i`), with its missing copies restored where the restore
/// round (`restored`, key `p`) set or found our key.
fn merge_restored(
    results: &[NodeResult],
    i: usize,
    restored: &[NodeResult],
    p: usize,
) -> Vec<NodeResult> {
    use crate::algorithm::round::{Answer, Reply};
    results
        .iter()
        .zip(restored)
        .map(|(ext, rest)| {
            let answer =
                |r: &NodeResult, k: usize| r.as_ref().ok().and_then(|r| r.answers.get(k).copied());
            match (answer(ext, i), answer(rest, p)) {
                (Some(Answer::Absent), Some(Answer::Restored | Answer::Ok)) => {
                    Ok(Reply::new(vec![Answer::Restored]))
                }
                (Some(a), _) => Ok(Reply::new(vec![a])),
                (None, _) => ext
                    .as_ref()
                    .map(|_| Reply::new(Vec::new()))
                    .map_err(Clone::clone),
            }
        })
        .collect()
}

/// An extension round: the TTL asked for and its drift allowance, when the
/// round began and ended, and whether it is the renewal thread's (`loud`).
#[derive(Clone, Copy)]
struct Extension {
    ttl: Duration,
    drift: Duration,
    start: Instant,
    end: Instant,
    loud: bool,
}
