//! The lock engine: attempts, take-overs, releases and extensions, each a
//! round through the [`Transport`] decided by [`crate::algorithm`], with
//! time read only through [`Clock`].
//!
//! [`Engine`] is the state one client shares between its handles, guards and
//! renewal thread. Its methods live by concern: this file runs attempts and
//! releases; [`extend`] extends (and restores missing copies); [`history`]
//! keeps what the delayed-restart rule knows; [`report`] tells the event
//! handler and the log.

use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::algorithm::quorum::{self, Tally};
use crate::algorithm::restart::TtlHistory;
use crate::algorithm::round::{self, is_reader, Key, NodeResult, Op};
use crate::clock::{after, Clock, Rng, Throttle};
use crate::error::{Error, InvalidInput};
use crate::lock::queue::Queues;
use crate::lock::settings::Settings;
use crate::lock::state::LockState;
use crate::lock::transport::Transport;
use crate::lock::watchdog::{Renew, Watchdog};
use crate::Result;
use crate::MAX_TTL;

mod acquire;
mod extend;
#[cfg(test)]
mod fencing_tests;
mod handover;
mod history;
#[cfg(test)]
mod history_tests;
#[cfg(test)]
mod node_rules_tests;
mod remote;
mod report;
#[cfg(test)]
mod report_tests;
mod several;
#[cfg(test)]
mod tests;
mod wait;

/// How long `acquire` may keep trying.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Budget {
    Attempts(u32),
    Until(Instant),
}

/// What a lock call asks for.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Want<'a> {
    /// The resource (the first of a lock of several).
    pub resource: &'a str,
    /// A lock of several: the other resources (see `several`).
    pub also: &'a [String],
    pub ttl: Duration,
    /// A read lock: shared with other readers, one resource, never fenced
    /// (see [`crate::algorithm::round::is_reader`]).
    pub read: bool,
    /// Whether the lock gets a fencing token (a reader never does).
    pub fenced: bool,
    /// A candidate's id, hex-encoded, carried in the token after `@` (see
    /// [`crate::election`]); empty for any other lock.
    pub tag: &'a str,
}

impl<'a> Want<'a> {
    /// Whether the call takes part in the local queue and waits for one key's
    /// wake-ups, one thread of this client at a time: an exclusive lock of
    /// one resource. (Readers share, and a lock of several waits for any of
    /// its keys: every such waiter of this client is woken together.)
    pub(crate) fn alone(&self) -> bool {
        self.also.is_empty() && !self.read
    }

    /// The resources, the first one first (as [`LockState`]'s keys).
    pub(crate) fn resources(&self) -> impl Iterator<Item = &'a str> {
        std::iter::once(self.resource).chain(self.also.iter().map(String::as_str))
    }

    /// How many resources (keys) it names.
    pub(crate) fn size(&self) -> usize {
        self.also.len().saturating_add(1)
    }
}

pub(crate) struct Engine {
    pub(crate) settings: Settings,
    pub(crate) transport: Box<dyn Transport>,
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) rng: Rng,
    queues: Arc<Queues>,
    /// The TTLs in use, as this client knows them (the restart rule).
    ttls: Mutex<TtlHistory>,
    /// What the engine remembers of each node, in node order.
    nodes: Vec<NodeMemo>,
    me: Weak<Engine>,
    watchdog: OnceLock<Watchdog>,
    /// Notified when a renewal round ends (a release may wait for one).
    pub(crate) renewal_done: Arc<crate::clock::Signal>,
    /// The keys whose last release reached other clients' waiters.
    pub(crate) remote: remote::Remote,
}

/// What the engine remembers of one node.
#[derive(Default)]
struct NodeMemo {
    /// Its failures' warn-level log throttle.
    warned: Throttle,
    /// The key of the lock history this client saw first (0: none yet),
    /// for `fresh_cluster`.
    first_history: AtomicU64,
    /// The key of the last lock history it reported (0: none yet): the
    /// histories a TTL this client uses first comes after.
    history: AtomicU64,
    /// Whether the last event said its votes are held back.
    held_back: AtomicBool,
}

impl Engine {
    /// An engine over `transport`, with no lock held and no thread started
    /// (the renewal thread starts with the first renewed lock).
    pub(crate) fn new(
        settings: Settings,
        transport: Box<dyn Transport>,
        clock: Arc<dyn Clock>,
        rng: Rng,
    ) -> Arc<Engine> {
        let nodes = transport
            .node_names()
            .iter()
            .map(|_| NodeMemo::default())
            .collect();
        // A configured longest TTL is in use since always.
        let known = TtlHistory::since_always(settings.max_ttl.unwrap_or_default().min(MAX_TTL));
        Arc::new_cyclic(|me| Engine {
            settings,
            transport,
            clock: clock.clone(),
            rng,
            queues: Arc::new(Queues::new(clock.clone())),
            ttls: Mutex::new(known),
            nodes,
            me: me.clone(),
            watchdog: OnceLock::new(),
            renewal_done: Arc::default(),
            remote: remote::Remote::default(),
        })
    }

    /// The most a call for a lock of `keys` keys may wait: `lock()` gets
    /// `retry_count × (retry_delay + retry_jitter + node_timeout)` (one more
    /// node timeout per 200 keys of a set), `acquire_for()` its own wait.
    pub(crate) fn wait_deadline(&self, budget: Budget, keys: usize) -> Instant {
        let s = &self.settings;
        match budget {
            Budget::Attempts(n) => {
                let per_attempt = s
                    .retry_delay
                    .saturating_add(s.retry_jitter)
                    .saturating_add(self.allowance(keys));
                after(self.clock.now(), per_attempt.saturating_mul(n))
            }
            Budget::Until(until) => until,
        }
    }

    /// Checks a resource and TTL; returns the TTL's drift allowance.
    pub(crate) fn validate(&self, resource: &str, ttl: Duration) -> Result<Duration> {
        validate_resource(resource)?;
        if ttl.is_zero() {
            return Err(InvalidInput::ZeroTtl.into());
        }
        // `max_ttl` is what every client promised not to exceed (the
        // restart rule's horizon rests on it).
        if ttl > self.horizon() {
            return Err(InvalidInput::TtlTooLong(ttl).into());
        }
        let allowance = quorum::drift_allowance(ttl, self.settings.drift_factor);
        if ttl <= allowance {
            return Err(InvalidInput::TtlTooShort { ttl, allowance }.into());
        }
        Ok(allowance)
    }

    /// Until when a lock's key may still exist on some node: a release not
    /// answered by then need not be retried.
    fn keep_until(&self, state: &LockState) -> Instant {
        let t = state.timing();
        let slack = quorum::drift_allowance(t.ttl, self.settings.drift_factor);
        let own = after(t.since, t.ttl.saturating_add(slack));
        // A failed extension may have reached some nodes, and set a later
        // expiry there.
        let reach = state.reach().map(|r| after(r, slack));
        own.max(reach.unwrap_or(own))
    }

    /// Deletes the lock on every node where it still holds our token.
    pub(crate) fn release(&self, state: &LockState) -> Result<()> {
        let (outcome, results) = self.release_round(state);
        self.release_event(state, &outcome, &results);
        outcome
    }

    /// [`release`](Self::release) without telling the event handler (the
    /// caller does, once it holds nothing of the client's).
    pub(crate) fn release_round(&self, state: &LockState) -> (Result<()>, Vec<NodeResult>) {
        self.await_renewal(state);
        let keep_until = self.keep_until(state);
        let start = self.clock.now();
        // Nonzero: the freed key is published (see `Op::Release`).
        let notice = remote::notice_of(&state.key());
        // This client's own waiters are not woken by it: its local queue
        // hands the key on, and threads without one poll, as before (woken
        // together with the releaser's next attempt, they split the votes).
        // A reader's release is no hand-over: the last reader out wakes this
        // client's writer too.
        if !state.is_read() {
            for k in state.keys() {
                self.transport.releasing(k.resource, notice);
            }
        }
        // Bounded by the node timeout (one more per 200 keys of a set).
        let deadline = self.round_deadline(self.clock.now(), state.size());
        let op = Op::Release { keep_until, notice };
        let results = self.run_locks(op, &[state], deadline, Some(&quorum::to_settle));
        self.note_failures(&results);
        let outcome = quorum::decide_release(Tally::of(&results, 0));
        if outcome.is_ok() {
            self.note_woken(state, &results, start);
        }
        (outcome, results)
    }

    /// Waits (for at most the bound of a renewal's two rounds, the
    /// extension and the restore) while the renewal thread's round for
    /// `state` is in flight: it may restore a copy of the key, which must
    /// land before the release's delete, not after it.
    fn await_renewal(&self, state: &LockState) {
        if !state.renewal_in_flight() {
            return;
        }
        let now = self.clock.now();
        let round = self.allowance(crate::lock::watchdog::MAX_BATCH);
        let until = after(now, round.saturating_mul(2));
        loop {
            let seen = self.renewal_done.seen();
            if !state.renewal_in_flight() || self.clock.now() >= until {
                return;
            }
            self.clock.wait(&self.renewal_done, seen, Some(until));
        }
    }

    /// How long a round of `keys` keys waits for a node (see
    /// [`round::allowance`]): the node timeout for a lone lock.
    fn allowance(&self, keys: usize) -> Duration {
        round::allowance(self.settings.node_timeout, keys)
    }

    /// A round's deadline: [`allowance`](Self::allowance) from `start`.
    fn round_deadline(&self, start: Instant, keys: usize) -> Instant {
        after(start, self.allowance(keys))
    }

    /// The client's renewal thread, started on first use.
    pub(crate) fn watchdog(&self) -> &Watchdog {
        self.watchdog
            .get_or_init(|| Watchdog::spawn(self.me.clone(), self.clock.clone()))
    }
}

/// The renewal thread's view of the engine.
impl Renew for Engine {
    fn pacing(&self) -> (f64, Duration) {
        (self.settings.renew_fraction, self.settings.node_timeout)
    }

    fn renew(&self, states: &[&LockState], ttl: Duration) -> Vec<Result<Duration>> {
        self.extend_many(states, ttl, true)
    }

    fn renewed(&self) {
        self.renewal_done.notify();
    }

    fn expire(&self, state: &LockState) {
        if state.lose(&Error::Expired, true) {
            self.lost_event(state, &Error::Expired);
        }
    }

    /// Best-effort release of many locks in one round trip per node.
    fn release_lost(&self, states: &[&LockState]) {
        let keys: Vec<Key<'_>> = states.iter().flat_map(|s| s.keys()).collect();
        let deadline = self.round_deadline(self.clock.now(), keys.len());
        let keep_until = states
            .iter()
            .map(|s| self.keep_until(s))
            .max()
            .unwrap_or(deadline);
        let notice = keys.first().map_or(1, remote::notice_of);
        for k in keys.iter().filter(|k| !is_reader(k.token)) {
            self.transport.releasing(k.resource, notice);
        }
        let results = self.transport.run(
            Op::Release { keep_until, notice },
            &keys,
            deadline,
            None,
            None,
        );
        self.note_failures(&results);
    }
}

/// Checks a resource name: not empty, not too long, not the crate's own key.
pub(crate) fn validate_resource(resource: &str) -> Result<()> {
    if resource.is_empty() {
        return Err(InvalidInput::EmptyResource.into());
    }
    if resource.len() > crate::MAX_RESOURCE_LEN {
        return Err(InvalidInput::ResourceTooLong {
            len: resource.len(),
            max: crate::MAX_RESOURCE_LEN,
        }
        .into());
    }
    if resource == crate::algorithm::round::META_KEY {
        return Err(InvalidInput::ReservedResource(crate::algorithm::round::META_KEY).into());
    }
    Ok(())
}
