//! The local hand-over: a lock passed to the next thread of this process
//! becomes its next critical section, unfenced with nothing sent, fenced by
//! one swap round (a fresh token and the next fencing token, the same
//! expiry); and the fencing write-back that lifts every granting node to a
//! lock's fencing token.

use std::cell::Cell;
use std::time::{Duration, Instant};

use log::{debug, trace};

use crate::algorithm::quorum::{self, Tally};
use crate::algorithm::round::{Key, NodeResult, Op};
use crate::error::Error;
use crate::events::Begun;
use crate::lock::state::LockState;
use crate::lock::transport::AfterRound;
use crate::Result;

use super::Engine;

impl Engine {
    /// A fenced lock's write-back: `counter = max(counter, fence)` on every
    /// node where the key still holds our token, counted like an extension
    /// (a majority, inside validity). Only then may the lock be used: any
    /// later holder's `SET` on a node of that majority comes after our key
    /// left it, hence after the write-back, so its token is larger. On
    /// failure the lock is released and the attempt failed (retryable).
    pub(super) fn write_back(&self, state: &LockState, fence: u64) -> Result<()> {
        let start = self.clock.now();
        let timing = state.timing();
        let time_left = timing.deadline.saturating_duration_since(start);
        let results = if fence == 0 || time_left.is_zero() {
            Vec::new()
        } else {
            let deadline = timing
                .deadline
                .min(self.round_deadline(start, state.size()));
            let op = Op::Fence { value: fence };
            let results = self.run_locks(op, &[state], deadline, Some(&quorum::to_settle));
            self.note_failures(&results);
            results
        };
        let elapsed = self.clock.now().saturating_duration_since(start);
        let nodes = results.len();
        let tally = Tally::of(&results, 0);
        let taken = tally.other;
        let outcome = if results.is_empty() {
            Err(Error::Expired)
        } else {
            quorum::decide_extend(tally, timing.ttl, elapsed, Duration::ZERO, time_left)
        };
        match outcome {
            Ok(_) => {
                debug!("lock {:?}: fencing token {fence}", state.resource);
                Ok(())
            }
            Err(e) => {
                debug!("lock {:?}: fencing token not recorded: {e}", state.resource);
                // Never reported acquired: no release event either.
                let _ = self.release_round(state);
                // As an acquire would say it: too many nodes failed, another
                // owner has the key, or the lock ran out of time.
                Err(match e {
                    e @ (Error::NoQuorum { .. } | Error::ScriptsRefused { .. }) => e,
                    Error::NotOwner { .. } => Error::Taken { held: taken, nodes },
                    _ => Error::ValidityExhausted {
                        elapsed: self.clock.now().saturating_duration_since(timing.since),
                        ttl: timing.ttl,
                    },
                })
            }
        }
    }

    /// Makes a lock handed over by this process's last holder a new critical
    /// section: unfenced, with nothing sent (see
    /// [`continue_section`](Self::continue_section)); fenced, by one swap
    /// round that gives the key a fresh token where it holds the old one,
    /// keeping its expiry, and writes the new section's fencing token. The
    /// swap counts like an extension: a majority, inside the old validity,
    /// which the new section inherits unchanged (so hand-overs never keep a
    /// key longer than one TTL). Not tried for another TTL than the lock's,
    /// or with less than [`node_timeout`](crate::Builder::node_timeout) of
    /// validity left. On any failure the old lock (and any new token) is
    /// deleted: the caller then locks anew.
    pub(crate) fn accept_hand_over(&self, handed: &LockState, ttl: Duration) -> Result<LockState> {
        let start = self.clock.now();
        let timing = handed.timing();
        let time_left = timing.deadline.saturating_duration_since(start);
        // A fenced handed's next token must stay exact in the scripts.
        let exhausted = handed
            .fence
            .is_some_and(|f| f >= crate::algorithm::round::FENCE_LIMIT);
        if handed.is_lost()
            || timing.ttl != ttl
            || time_left < self.settings.node_timeout
            || exhausted
        {
            let _ = self.release(handed);
            return Err(Error::Expired);
        }
        if handed.fence.is_none() {
            return Ok(self.continue_section(handed, start));
        }
        let token = crate::clock::section_token(&handed.token);
        let key = Key {
            next: Some(&token),
            ..handed.key()
        };
        let known = self.ttls.lock().max;
        let outcome: Cell<Option<Result<Duration>>> = Cell::new(None);
        let decide = |results: &[NodeResult]| {
            let elapsed = self.clock.now().saturating_duration_since(start);
            // The drift allowance was taken from the deadline at acquisition.
            let o = quorum::decide_extend(
                Tally::of(results, 0),
                ttl,
                elapsed,
                Duration::ZERO,
                time_left,
            );
            let next = if o.is_err() {
                AfterRound::Undo
            } else {
                AfterRound::Done
            };
            outcome.set(Some(o));
            next
        };
        // The next section's fencing token: the swap writes it wherever it
        // swaps, so it is its own write-back.
        let fence = handed.fence.map(|f| f + 1);
        let op = Op::Swap {
            ttl,
            known_max: known.max(ttl),
            fence,
        };
        let results = self.transport.run(
            op,
            &[key],
            timing
                .deadline
                .min(self.round_deadline(start, handed.size())),
            Some(&quorum::to_settle),
            Some(&decide),
        );
        self.record_histories(&results, None);
        self.note_failures(&results);
        let outcome = outcome.take().unwrap_or(Err(Error::Expired));
        if outcome.is_ok() {
            // The handing-over thread's section ends here (on failure, the
            // release of the handed reports it).
            self.release_event(handed, &Ok(()), &results);
        }
        let until = outcome.as_ref().map(|_| timing.deadline);
        let next = (handed.resource.as_str(), handed.section.saturating_add(1));
        self.attempt_event(next, start, until, &results, Begun::default());
        outcome?;
        // A node the swap did not reach keeps an earlier token of the
        // lineage, with the lock's expiry; the next swap or the release
        // takes it from there.
        let state = handed.next_section(start, token, fence);
        state.set_holding(quorum::holding(&results, 0));
        trace!(
            "lock {:?}: section {} under token {}",
            state.resource,
            state.section,
            state.token
        );
        Ok(state)
    }

    /// An unfenced lock's next critical section, handed over locally: the
    /// nodes hold the same key, token and expiry as before, so nothing is
    /// sent. Only this process could tell the two sections apart by token,
    /// and only a fencing token orders sections for a storage anyway; the
    /// section number tells them apart in the guard, the events and the
    /// logs. The handing-over section's release event and the new
    /// section's attempt event carry no node outcomes (no round was sent).
    fn continue_section(&self, handed: &LockState, start: Instant) -> LockState {
        let state = handed.next_section(start, handed.token.clone(), None);
        debug!(
            "lock {:?}: section {} handed over locally, nothing sent",
            state.resource, state.section
        );
        self.release_event(handed, &Ok(()), &[]);
        let next = (state.resource.as_str(), state.section);
        self.attempt_event(next, start, Ok(state.deadline()), &[], Begun::default());
        state
    }
}
