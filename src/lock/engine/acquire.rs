//! A call's turn, attempts and waits: the local queue's turn first (taking
//! over a lock handed to it), then attempts at the nodes, each failure
//! followed by a wait (see [`Waiter`]).

use std::cell::Cell;
use std::sync::Arc;
use std::time::{Duration, Instant};

use log::{debug, trace};

use crate::algorithm::quorum::{self, Tally};
use crate::algorithm::restart::{self, RestartRule, TtlHistory};
use crate::algorithm::round::{Key, NodeFacts, NodeResult, Op, Place};
use crate::clock::{after, new_reader_token, new_token};
use crate::error::{Error, InvalidInput};
use crate::lock::queue::Turn;
use crate::lock::spans::{Kind, LockCall};
use crate::lock::state::{LockState, Timing};
use crate::lock::transport::AfterRound;
use crate::Result;

use super::wait::{Failed, Try, Waiter};
use super::{history, Budget, Engine, Want};

/// An acquire round's outcome: when it ended, the decision, and the results
/// after the delayed-restart rule.
type Decision = (Instant, Result<Duration>, Vec<NodeResult>);

impl Engine {
    /// Locks `resource` within `budget` (see the module doc); returns the
    /// lock and the turn it holds. `want.also`: the other resources of a
    /// lock of several (see `several`), validated by the caller. Such a
    /// lock, and a read lock, has no turn in a local queue (its threads
    /// meet at the nodes); their waiters are woken together, by a release
    /// of any of their resources.
    /// A writer that waits (not `try_lock`) keeps new readers out while it
    /// does (see [`Op::Acquire`]).
    ///
    /// Every lock call comes here: its span (see [`crate::lock::spans`])
    /// opens and ends here, and the lock carries its caller's span.
    pub(crate) fn acquire(
        &self,
        want: Want<'_>,
        budget: Budget,
    ) -> Result<(Arc<LockState>, Option<Turn>)> {
        let kind = if !want.tag.is_empty() {
            Kind::Election
        } else if want.read {
            Kind::Read
        } else if !want.also.is_empty() {
            Kind::Several
        } else {
            Kind::Write
        };
        let mut call = LockCall::start(want.resource, kind);
        let result = call.in_scope(|call| self.call(want, budget, call));
        let caller = call.end(result.as_ref().map(|_| ()));
        result.map(|(mut state, turn)| {
            state.caller = caller;
            (Arc::new(state), turn)
        })
    }

    /// [`acquire`](Self::acquire) inside the call's span: input checked,
    /// then the call, then its [`on_acquire`](crate::EventHandler::on_acquire)
    /// (for input accepted).
    fn call(
        &self,
        want: Want<'_>,
        budget: Budget,
        call: &mut LockCall,
    ) -> Result<(LockState, Option<Turn>)> {
        if !want.also.is_empty() {
            super::several::validate_resources(&want.resources().collect::<Vec<_>>())?;
            if want.read {
                return Err(InvalidInput::ReadOfSeveral.into());
            }
        }
        let called = self.clock.now();
        let drift = self.validate(want.resource, want.ttl)?;
        let result = self.acquire_valid(want, budget, (called, drift), call);
        let outcome = result.as_ref().map(|_| ());
        self.acquire_event(want.resource, called, call.attempts(), outcome);
        result
    }

    /// [`acquire`](Self::acquire) of valid input, called at `called` (with
    /// the drift allowance of its TTL); `call` counts its attempts at the
    /// nodes.
    fn acquire_valid(
        &self,
        want: Want<'_>,
        budget: Budget,
        (called, drift): (Instant, Duration),
        call: &mut LockCall,
    ) -> Result<(LockState, Option<Turn>)> {
        let (resource, ttl) = (want.resource, want.ttl);
        // One deadline for the whole call, local wait and attempts alike.
        let until = self.wait_deadline(budget, want.size());
        // This thread's turn among the threads of this process that want
        // `resource` (see [`crate::lock::queue`]). One attempt never waits;
        // when the wait runs out the call still makes its attempts at the
        // nodes, which report the real state.
        let mut turn = match budget {
            _ if !want.alone() || !self.settings.local_queue => None,
            Budget::Attempts(1) => self.queues.try_acquire(resource),
            _ => self.queues.acquire(resource, until),
        };
        let handed = turn.as_ref().and_then(Turn::take_hand_over);
        // A candidate takes no other holder's lock: its token names another
        // candidate, or none (a leader's lock is renewed, never handed).
        let handed = match handed {
            Some(h) if !want.tag.is_empty() => {
                let _ = self.release(&h);
                None
            }
            h => h,
        };
        if let Some(handed) = handed {
            let held = handed.holding();
            match self.accept_hand_over(&handed, ttl) {
                Ok(state) => {
                    debug!("lock {resource:?}: taken over from a local holder");
                    if call.is_wanted() {
                        call.waited(self.clock.now().saturating_duration_since(called));
                    }
                    return Ok((state, turn));
                }
                // No time left for an attempt. Where the swap's round says
                // why (nodes failed, another owner), that is the answer;
                // else the lock came too late (expired, or of another TTL):
                // another thread of this process held it the whole wait.
                Err(e) if self.clock.now() >= until => {
                    debug!("lock {resource:?}: not taken over ({e}) and no time left");
                    let nodes = self.transport.node_names().len();
                    return Err(match e {
                        Error::Expired => Error::Taken { held, nodes },
                        e => e,
                    });
                }
                Err(e) => debug!("lock {resource:?}: not taken over ({e}); locking anew"),
            }
        }
        let mut waiter = Waiter::new(self, want, budget, (called, until));
        loop {
            let next = waiter.next_try();
            let mut failed = Failed::default();
            let begun = (next.begun.waited, next.begun.woken);
            let attempt = call.round(begun, || {
                self.attempt(want, drift, &next, until, &mut failed)
            });
            match attempt {
                Ok(state) => return Ok((state, turn.take())),
                Err(e) if e.is_retryable() => waiter.after_failure(e, failed)?,
                Err(e) => return Err(e),
            }
        }
    }

    /// One acquisition round: SET NX PX on every node, then the decision.
    /// On failure, releases wherever our SET may have landed, on the same
    /// connections as the SET.
    ///
    /// `next`: what the call tells this try (see [`Try`]): for a writer that
    /// will try again, how long live readers keep new readers out (see
    /// [`Op::Acquire`]), and whether it is the call's first (see
    /// [`Engine::lean`]).
    /// `until`: the end of the call, which a first use's wait for the
    /// nodes' histories does not pass.
    fn attempt(
        &self,
        want: Want<'_>,
        drift: Duration,
        next: &Try,
        until: Instant,
        seen: &mut Failed,
    ) -> Result<LockState> {
        let (resource, also, ttl, read) = (want.resource, want.also, want.ttl, want.read);
        let token = match (read, want.tag) {
            (true, _) => new_reader_token(),
            (false, "") => new_token(),
            (false, tag) => format!("{}@{tag}", new_token()),
        };
        // One key per resource, all with this token (a lock of several:
        // one vote per node for them all; see `several`).
        // (No allocation for a lock of one.)
        let (one, several): ([Key<'_>; 1], Vec<Key<'_>>);
        let keys: &[Key<'_>] = if also.is_empty() {
            one = [Key::new(resource, &token)];
            &one
        } else {
            several = want.resources().map(|r| Key::new(r, &token)).collect();
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
        let rule = self.restart_rule(ttl, known);
        // No point waiting for replies past the moment validity would be gone.
        let budget = self.allowance(keys.len()).min(ttl.saturating_sub(drift));
        let horizon = self.horizon();
        let settled = |results: &[Option<NodeResult>]| self.to_settle(&rule, horizon, results);
        // The decision, made once the replies are in (and before any undo).
        let decision: Cell<Option<Decision>> = Cell::new(None);
        let decide = |results: &[NodeResult]| {
            let (next, d) = self.decide(&rule, (start, ttl, drift), results);
            decision.set(Some(d));
            next
        };
        let plain = !want.fenced && want.alone();
        let lean = (plain && (next.intent.is_zero() || next.first))
            .then(|| self.lean(ttl, &rule))
            .flatten();
        let results = self.run_keys(
            Op::Acquire {
                ttl,
                known_max: known.max,
                // A reader orders nothing: storage is guarded by its writers.
                fenced: want.fenced,
                after: told.0,
                known_prev: told.1,
                // (A lean acquire marks none.)
                intent: lean.map_or(next.intent, |_| Duration::ZERO),
                place: lean.map_or(next.place, |_| Place::NONE),
                lean,
            },
            keys,
            &[keys.len()],
            after(start, budget),
            Some(&settled),
            Some(&decide),
        );
        // (A transport that did not call `undo`: decided now.)
        let (end, outcome, judged) = decision
            .take()
            .unwrap_or_else(|| self.decide(&rule, (start, ttl, drift), &results).1);
        self.record_histories(&results, Some((ttl, first)));
        self.note_failures(&judged);
        // Where our key is now (held-back votes included: the key is set).
        let holding = quorum::holding(&results, 0);
        let result = outcome.and_then(|validity| {
            self.granted(want, token, (start, end, validity), &judged, holding)
        });
        if let Err(e) = &result {
            let elapsed = end.saturating_duration_since(start);
            debug!("lock {resource:?}: not acquired in {elapsed:?}: {e}");
        }
        // An attempt at the nodes begins a lineage: section 1.
        let outcome = result.as_ref().map(|s| s.deadline());
        self.attempt_event((resource, 1), start, outcome, &judged, next.begun);
        self.held_back_events((&judged, &results, &rule));
        if result.is_err() {
            *seen = Failed::of(&judged, want.size());
        }
        result
    }

    /// The delayed-restart rule for a round of `ttl`, with the TTLs in use
    /// `known`.
    fn restart_rule(&self, ttl: Duration, known: TtlHistory) -> RestartRule {
        RestartRule {
            enabled: self.settings.restart_protection,
            floor: ttl,
            known,
            complete: false,
            #[cfg(test)]
            loose: self.settings.loose_restart_rule,
        }
    }

    /// How many more replies an acquire round under `rule` needs at least
    /// before its outcome is known, from its results so far (see
    /// [`Decided`](crate::lock::transport::Decided)); `horizon`: the longest
    /// TTL every client promised (`max_ttl`).
    fn to_settle(
        &self,
        rule: &RestartRule,
        horizon: Duration,
        results: &[Option<NodeResult>],
    ) -> usize {
        let longest = rule.longest(restart::facts_of(results.iter().flatten()));
        // Whether the round can still be one every node answered: a vote
        // that would count then may count (`certain` waits for them all).
        let rule = RestartRule {
            complete: results
                .iter()
                .all(|r| r.as_ref().is_none_or(restart::answered)),
            ..*rule
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
                    || facts.is_none_or(|f| f.age >= horizon.max(longest) || self.trusted(i, f)))
        };
        let need = quorum::to_settle_key(results, 0, certain, counts);
        // A TTL longer than every client promised (`max_ttl`) in use:
        // a reply may then disqualify votes counted as certain, several
        // at once; the round looks at every reply.
        if longest > horizon {
            need.min(1)
        } else {
            need
        }
    }

    /// The lock an attempt for `want` won with `token`, in a round from
    /// `start` to `end` that left it `validity`: the nodes that hold its key
    /// (`holding`), and with fencing its token (the largest counter among
    /// the granting nodes, written back to them).
    fn granted(
        &self,
        want: Want<'_>,
        token: String,
        (start, end, validity): (Instant, Instant, Duration),
        judged: &[NodeResult],
        holding: usize,
    ) -> Result<LockState> {
        let resource = want.resource;
        let elapsed = end.saturating_duration_since(start);
        debug!("lock {resource:?}: acquired in {elapsed:?}, valid for {validity:?}");
        trace!("lock {resource:?}: token {token}");
        let timing = Timing {
            since: start,
            deadline: after(end, validity),
            ttl: want.ttl,
        };
        let lock = |fence| {
            let mut state = LockState::new(want.resource, token, fence, timing);
            state.set_holding(holding);
            state.also = want.also.to_vec();
            state
        };
        if !want.fenced {
            return Ok(lock(None));
        }
        let fence = judged
            .iter()
            .filter_map(|r| r.as_ref().ok()?.fence)
            .max()
            .unwrap_or(0);
        let state = lock(Some(fence));
        self.write_back(&state, fence)?;
        Ok(state)
    }

    /// An acquire round's decision under `rule`, from its replies (the round
    /// began at `start`, for `ttl` with `drift`): what the transport does
    /// after it, and the outcome with the results the rule left.
    fn decide(
        &self,
        rule: &RestartRule,
        (start, ttl, drift): (Instant, Duration, Duration),
        results: &[NodeResult],
    ) -> (AfterRound, Decision) {
        let end = self.clock.now();
        let judged = self.apply_restart_rule(results.to_vec(), rule);
        let elapsed = end.saturating_duration_since(start);
        let tally = Tally::of(&judged, 0);
        // Our SET may have landed on a node that answered OK or not at all.
        let maybe_set = tally.ok > 0
            || judged.iter().zip(results).any(|(j, r)| {
                j.is_err() && !matches!(r, Err(e) if e.kind() == crate::NodeErrorKind::NoConnection)
            });
        let outcome = quorum::decide_acquire(tally, ttl, elapsed, drift);
        let next = match (&outcome, maybe_set) {
            (Ok(_), _) => AfterRound::Complete,
            (Err(_), true) => AfterRound::Undo,
            (Err(_), false) => AfterRound::Done,
        };
        (next, (end, outcome, judged))
    }
}
