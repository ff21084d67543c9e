//! The Redlock algorithm: attempts, quorum decisions, retries, release and
//! extension. Talks to nodes only through [`Transport`] and reads time only
//! through [`Clock`].

use std::cell::Cell;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

use log::{debug, trace, warn};
use parking_lot::Mutex;

use crate::algorithm::quorum::{self, RestartRule, Tally, TtlHistory};
use crate::builder::{Builder, Settings};
use crate::clock::{after, new_token, Clock, Rng, Throttle, WARN_EVERY};
use crate::error::{Error, InvalidInput, NodeError};
use crate::events::{
    AttemptEvent, LostEvent, NodeChange, NodeEvent, Nodes, ReleaseEvent, RenewalEvent,
};
use crate::guard::{Callbacks, LockGuard, LockState, LostCallback, Timing};
use crate::lock::queue::{Gates, Permit};
use crate::lock::transport::{After, AfterRound, Key, NodeFacts, NodeResult, Op, Transport};
use crate::lock::watchdog::Watchdog;
use crate::Result;

use crate::MAX_TTL;

/// A Redlock client over N independent Redis nodes.
///
/// Cheap to clone (an `Arc` inside) and safe to share between threads.
/// Created by [`Redlock::builder`].
///
/// ```no_run
/// use std::time::Duration;
///
/// let locks = quorumlock::Redlock::builder()
///     .nodes(["redis://127.0.0.1:7001", "redis://127.0.0.1:7002", "redis://127.0.0.1:7003"])
///     .build()?;
/// let guard = locks.lock("lock:sku:42", Duration::from_secs(10))?;
/// // ... critical section: finish within guard.validity() ...
/// guard.release()?;
/// # Ok::<(), quorumlock::Error>(())
/// ```
#[derive(Clone)]
pub struct Redlock {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) settings: Settings,
    pub(crate) transport: Box<dyn Transport>,
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) on_lost: Option<Callbacks>,
    rng: Rng,
    warned: Vec<Throttle>,
    gates: Arc<Gates>,
    /// Longest TTL (ms) this client has used or seen reported by a node.
    /// The TTLs in use, as this client knows them (the restart rule).
    ttls: Mutex<TtlHistory>,
    /// Per node, the key of the lock history this client saw first (0:
    /// none yet), for `fresh_cluster`.
    first_histories: Vec<AtomicU64>,
    /// Per node, the key of the last lock history it reported (0: none
    /// yet): the histories a TTL this client uses first comes after.
    histories: Vec<AtomicU64>,
    /// Per node, whether the last event said its votes are held back.
    held_back: Vec<AtomicBool>,
    me: Weak<Inner>,
    watchdog: OnceLock<Watchdog>,
    /// Notified when a renewal round ends (a release may wait for one).
    pub(crate) renewal_done: Arc<crate::clock::Signal>,
}

impl fmt::Debug for Redlock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Redlock")
            .field("nodes", &self.inner.transport.node_names())
            .field("settings", &self.inner.settings)
            .finish()
    }
}

/// One node's copy of a lock key, from [`Redlock::inspect`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeKey {
    node: String,
    key: std::result::Result<Option<KeyInfo>, NodeError>,
}

impl NodeKey {
    /// The node's address, `host:port` (with `/db` when not 0).
    pub fn node(&self) -> &str {
        &self.node
    }

    /// The key on this node: `Ok(None)` when it does not exist, `Err` when
    /// the node could not be asked.
    pub fn key(&self) -> std::result::Result<Option<&KeyInfo>, &NodeError> {
        self.key.as_ref().map(Option::as_ref)
    }
}

/// A lock key as one node stores it.
///
/// `Debug` hides the token: it is what lets its owner release or extend the
/// lock, so it is printed only when asked for ([`token`](Self::token)).
#[derive(Clone, PartialEq, Eq)]
pub struct KeyInfo {
    token: String,
    ttl: Option<Duration>,
}

impl KeyInfo {
    /// The stored token (the value a holder's [`LockGuard::token`] starts
    /// with; after a hand-over it carries a section suffix).
    pub fn token(&self) -> &str {
        &self.token
    }

    /// Remaining time to live on this node's clock; `None` for a key
    /// without expiry (not one this crate wrote).
    pub fn ttl(&self) -> Option<Duration> {
        self.ttl
    }
}

impl fmt::Debug for KeyInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeyInfo")
            .field("token", &"<hidden>")
            .field("ttl", &self.ttl)
            .finish()
    }
}

/// An acquire round's outcome: when it ended, the decision, and the results
/// after the delayed-restart rule.
type Decision = (Instant, Result<Duration>, Vec<NodeResult>);

/// How long `acquire` may keep trying.
#[derive(Debug, Clone, Copy)]
enum Budget {
    Attempts(u32),
    Until(Instant),
}

impl Redlock {
    /// Starts configuring a client.
    pub fn builder() -> Builder {
        Builder::new()
    }

    pub(crate) fn from_parts(
        settings: Settings,
        transport: Box<dyn Transport>,
        clock: Arc<dyn Clock>,
        rng: Rng,
        on_lost: Option<Arc<LostCallback>>,
    ) -> Self {
        let warned = transport
            .node_names()
            .iter()
            .map(|_| Throttle::default())
            .collect();
        let per_node = || {
            transport
                .node_names()
                .iter()
                .map(|_| AtomicU64::new(0))
                .collect()
        };
        let (first_histories, histories) = (per_node(), per_node());
        // A configured longest TTL is in use since always.
        let known = TtlHistory::since_always(settings.max_ttl.unwrap_or_default().min(MAX_TTL));
        let names_len_flags = transport
            .node_names()
            .iter()
            .map(|_| AtomicBool::new(false))
            .collect();
        Redlock {
            inner: Arc::new_cyclic(|me| Inner {
                settings,
                transport,
                clock: clock.clone(),
                on_lost: on_lost.and_then(Callbacks::spawn),
                rng,
                warned,
                gates: Arc::new(Gates::new(clock.clone())),
                ttls: Mutex::new(known),
                first_histories,
                histories,
                held_back: names_len_flags,
                me: me.clone(),
                watchdog: OnceLock::new(),
                renewal_done: Arc::default(),
            }),
        }
    }

    /// Number of nodes.
    pub fn node_count(&self) -> usize {
        self.inner.transport.node_names().len()
    }

    /// Nodes that must agree for a lock to be held: `N/2 + 1`.
    pub fn quorum(&self) -> usize {
        quorum::quorum(self.node_count())
    }

    /// Makes one attempt to take `resource` for `ttl`.
    ///
    /// # Errors
    /// [`Error::Taken`] when another owner holds it, [`Error::NoQuorum`] when
    /// too many nodes failed, [`Error::ValidityExhausted`] when the round was
    /// too slow for the TTL, [`Error::InvalidInput`] for an empty resource or
    /// a TTL that is zero, too long, or not above the drift allowance.
    pub fn try_lock(&self, resource: &str, ttl: Duration) -> Result<LockGuard> {
        self.acquire(resource, ttl, Budget::Attempts(1))
    }

    /// Takes `resource` for `ttl`, making up to
    /// [`retry_count`](Builder::retry_count) attempts with a jittered pause
    /// between them. Returns the last attempt's error when all fail.
    ///
    /// Waits at most `retry_count × (retry_delay + retry_jitter +
    /// node_timeout)` in all (750 ms with the defaults), queueing behind
    /// threads of this process included, plus at most two node timeouts
    /// (the last attempt's round and, when it fails, the delete of what it
    /// may have set; three with [`fencing`](Builder::fencing): the round,
    /// the write-back and, if that fails, the release).
    ///
    /// # Errors
    /// As [`try_lock`](Self::try_lock).
    pub fn lock(&self, resource: &str, ttl: Duration) -> Result<LockGuard> {
        self.acquire(
            resource,
            ttl,
            Budget::Attempts(self.inner.settings.retry_count),
        )
    }

    /// Takes `resource` for `ttl`, retrying with jittered pauses until it
    /// succeeds or `wait` has passed (at least one attempt is made). Returns
    /// the last attempt's error when time runs out, within `wait` plus the
    /// node timeouts [`lock`](Self::lock) adds to its own bound.
    ///
    /// # Errors
    /// As [`try_lock`](Self::try_lock).
    pub fn lock_timeout(&self, resource: &str, ttl: Duration, wait: Duration) -> Result<LockGuard> {
        let until = after(self.inner.clock.now(), wait);
        self.acquire(resource, ttl, Budget::Until(until))
    }

    /// Takes `resource` for `ttl` (retrying as [`lock`](Self::lock) does),
    /// renews it in the background while `f` runs, and releases it
    /// afterwards — also when `f` panics. Returns what `f` returns.
    ///
    /// Inside `f`, check [`LockGuard::is_held`] (or select on
    /// [`LockGuard::lost`]) before each step that needs the lock.
    ///
    /// ```no_run
    /// # use std::time::Duration;
    /// # let locks = quorumlock::Redlock::builder().node("redis://127.0.0.1:6379").build()?;
    /// let rows = locks.with_lock("job:nightly", Duration::from_secs(30), |guard| {
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
    /// As [`lock`](Self::lock) when the lock cannot be taken; and, after `f`
    /// ran, the reason the lock was lost ([`Error::Expired`],
    /// [`Error::NotOwner`]) if it was lost while `f` ran, and
    /// [`Error::Expired`] if `f` finished after the lock's deadline (whether
    /// or not the watchdog had noticed) — `f`'s result is then dropped,
    /// because its work was not protected.
    pub fn with_lock<T>(
        &self,
        resource: &str,
        ttl: Duration,
        f: impl FnOnce(&LockGuard) -> T,
    ) -> Result<T> {
        let guard = self.lock(resource, ttl)?;
        guard.auto_renew();
        let out = f(&guard);
        let lost = guard.lost().try_recv().ok();
        // Judged by the deadline itself, whatever the watchdog has seen yet:
        // work that ended past it ran without the lock's guarantee (the keys
        // may still be ours on the nodes: they outlive validity by the drift
        // allowance).
        let in_time = guard.is_held();
        match (guard.release(), lost) {
            (_, Some(reason)) => Err(reason),
            (_, None) if !in_time => Err(Error::Expired),
            (Ok(()), None) => Ok(out),
            (Err(e @ (Error::Expired | Error::NotOwner { .. })), None) => Err(e),
            (Err(e), None) => {
                // Held to the end; the keys left behind expire with the TTL.
                debug!("with_lock {resource:?}: release: {e}");
                Ok(out)
            }
        }
    }

    /// Waits until every node has a pooled connection (and the client has
    /// read who its server is) or has failed to connect, for at most
    /// `within`; returns how many nodes are connected.
    ///
    /// Also checks the node list: every connection asks its server for its
    /// `run_id` (and reads its lock history's id), and two entries that
    /// reach one server (two names of one host, a load balancer, two
    /// databases of one server) are an error. Rounds already count such a
    /// server's answers once ([`NodeErrorKind::SameServer`](crate::NodeErrorKind::SameServer)),
    /// but a cluster listed that way has fewer independent nodes than it
    /// seems: fix the list. Under an ACL that refuses `INFO`, only entries
    /// of one database are told apart, once its lock history exists.
    ///
    /// Never needed for correctness otherwise. A client connects in the background
    /// and its first rounds do not wait for a node still connecting (its
    /// vote cannot change a settled outcome), so a brand-new client's first
    /// lock may be set on only the nodes connected by then: a bare majority,
    /// one node failure from loss. A short-lived process that takes one lock
    /// (a cron job, `quorumlock run`) calls this first; a long-lived service
    /// need not.
    ///
    /// ```no_run
    /// use std::time::Duration;
    ///
    /// let locks = quorumlock::Redlock::builder()
    ///     .nodes(["redis://127.0.0.1:7001", "redis://127.0.0.1:7002", "redis://127.0.0.1:7003"])
    ///     .build()?;
    /// let connected = locks.wait_connected(Duration::from_millis(200))?;
    /// assert!(connected <= locks.node_count());
    /// # Ok::<(), quorumlock::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`InvalidInput::SameServer`](crate::InvalidInput::SameServer) naming
    /// two entries that reach one server.
    pub fn wait_connected(&self, within: Duration) -> Result<usize> {
        let deadline = after(self.inner.clock.now(), within);
        Ok(self.inner.transport.wait_connected(deadline)?)
    }

    /// What every node stores for `resource` right now: whether the key
    /// exists, its token and its remaining time to live. One entry per node,
    /// in the builder's order.
    ///
    /// For operators and status tools (`quorumlock status`): each node is
    /// asked on a connection of its own, all at once, each step within the
    /// node timeout (TCP connect, TLS handshake, `AUTH`, `SELECT`, then the
    /// replies; name resolution is not bounded). It takes no lock
    /// and changes no node's health. A node's copy says nothing on its own
    /// about who holds the lock: a lock is held only on a majority, within
    /// its validity.
    ///
    /// ```no_run
    /// let locks = quorumlock::Redlock::builder()
    ///     .nodes(["redis://127.0.0.1:7001", "redis://127.0.0.1:7002", "redis://127.0.0.1:7003"])
    ///     .build()?;
    /// for node in locks.inspect("lock:nightly-report")? {
    ///     match node.key() {
    ///         Ok(Some(k)) => println!("{}: held, {:?} left", node.node(), k.ttl()),
    ///         Ok(None) => println!("{}: free", node.node()),
    ///         Err(e) => println!("{}: {e}", node.node()),
    ///     }
    /// }
    /// # Ok::<(), quorumlock::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a resource name [`lock`](Self::lock)
    /// would refuse; per-node failures are in the entries.
    pub fn inspect(&self, resource: &str) -> Result<Vec<NodeKey>> {
        validate_resource(resource)?;
        let names = self.inner.transport.node_names();
        let found = self
            .inner
            .transport
            .inspect(resource, self.inner.settings.node_timeout);
        Ok(names
            .iter()
            .zip(found)
            .map(|(node, key)| NodeKey {
                node: node.clone(),
                key: key.map(|k| {
                    k.map(|s| KeyInfo {
                        token: s.value,
                        ttl: s.ttl,
                    })
                }),
            })
            .collect())
    }

    /// Audits the node list as the client judges nodes at connect, and
    /// more, with a verdict per node and for the set (`quorumlock check`
    /// prints it): whether the entries are distinct servers (`run_id`, lock
    /// history id), each node's role and cluster mode, its memory policy
    /// (an evicting one drops lock keys), its persistence settings and what
    /// they mean for the restart rule, its clock against this machine's
    /// (measured in one round trip), its round trip against the node
    /// timeout, and whether the lock's scripts run on `key` under its ACL.
    ///
    /// Each node is asked on a connection of its own, all at once, each
    /// step within the node timeout. The script test runs the acquire and
    /// release scripts on `key` on each node alone, with a random token for
    /// at most a second: one node's key never grants a lock, but a client
    /// locking `key` at that moment may count that node's vote as taken.
    /// Use a key your locks' ACL allows (`lock:check` under `~lock:*`).
    ///
    /// ```no_run
    /// let locks = quorumlock::Redlock::builder()
    ///     .nodes(["redis://127.0.0.1:7001", "redis://127.0.0.1:7002", "redis://127.0.0.1:7003"])
    ///     .build()?;
    /// let check = locks.check("lock:check")?;
    /// println!("{check}");
    /// assert!(check.is_safe(), "fix the findings marked UNSAFE or FAIL");
    /// # Ok::<(), quorumlock::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a key [`lock`](Self::lock) would refuse.
    pub fn check(&self, key: &str) -> Result<crate::Check> {
        validate_resource(key)?;
        let timeout = self.inner.settings.node_timeout;
        let probes = self.inner.transport.probe(key, timeout);
        Ok(crate::check::assess(
            self.inner.transport.node_names(),
            probes,
            timeout,
            self.quorum(),
            key,
        ))
    }

    /// A guard for a held lock, renewed when the client renews every lock.
    fn guard(&self, state: Arc<LockState>, turn: Option<Permit>) -> LockGuard {
        if let Some(turn) = &turn {
            // Local waiters wait for this lock, not for its guard.
            turn.set_holder(&state);
        }
        let guard = LockGuard::new(self.clone(), state, turn);
        if self.inner.settings.auto_renew {
            guard.auto_renew();
        }
        guard
    }

    fn acquire(&self, resource: &str, ttl: Duration, budget: Budget) -> Result<LockGuard> {
        let inner = &self.inner;
        let drift = inner.validate(resource, ttl)?;
        // One deadline for the whole call, local wait and attempts alike.
        let until = inner.wait_deadline(budget);
        let mut permit = inner.local_turn(resource, budget, until);
        if let Some(baton) = permit.as_ref().and_then(Permit::take_baton) {
            match inner.take_over(&baton, ttl) {
                Ok(state) => {
                    debug!("lock {resource:?}: taken over from a local holder");
                    return Ok(self.guard(Arc::new(state), permit));
                }
                Err(e) if inner.clock.now() >= until => {
                    debug!("lock {resource:?}: not taken over ({e}) and no time left");
                    return Err(e);
                }
                Err(e) => {
                    debug!("lock {resource:?}: not taken over ({e}); locking anew");
                }
            }
        }
        let mut attempt = 1u32;
        loop {
            let err = match inner.attempt(resource, ttl, drift) {
                Ok(state) => return Ok(self.guard(Arc::new(state), permit.take())),
                Err(e) if e.is_retryable() => e,
                Err(e) => return Err(e),
            };
            let s = &inner.settings;
            let mut pause =
                quorum::retry_delay(s.retry_delay, s.retry_jitter, inner.rng.next_u64());
            if let Budget::Attempts(n) = budget {
                if attempt >= n {
                    return Err(err);
                }
            }
            let left = until.saturating_duration_since(inner.clock.now());
            if left.is_zero() {
                return Err(err);
            }
            pause = pause.min(left);
            debug!("lock {resource:?}: attempt {attempt} failed ({err}); retrying in {pause:?}");
            inner.clock.sleep(pause);
            attempt = attempt.saturating_add(1);
        }
    }
}

impl Inner {
    /// Waits for this thread's turn among the threads of this process that
    /// want `resource` (see [`crate::lock::queue`]). One attempt never waits; when
    /// the wait runs out the caller still makes its attempts at the nodes,
    /// which report the real state.
    fn local_turn(&self, resource: &str, budget: Budget, until: Instant) -> Option<Permit> {
        if !self.settings.local_queue {
            return None;
        }
        match budget {
            Budget::Attempts(1) => self.gates.try_acquire(resource),
            _ => self.gates.acquire(resource, until),
        }
    }

    /// The most a call may wait: `lock()` gets `retry_count × (retry_delay +
    /// retry_jitter + node_timeout)`, `lock_timeout()` its own wait.
    fn wait_deadline(&self, budget: Budget) -> Instant {
        let s = &self.settings;
        match budget {
            Budget::Attempts(n) => {
                let per_attempt = s
                    .retry_delay
                    .saturating_add(s.retry_jitter)
                    .saturating_add(s.node_timeout);
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

    /// One acquisition round: SET NX PX on every node, then the decision.
    /// On failure, releases wherever our SET may have landed, on the same
    /// connections as the SET.
    fn attempt(&self, resource: &str, ttl: Duration, drift: Duration) -> Result<LockState> {
        let token = new_token();
        let key = Key::new(resource, &token);
        let start = self.clock.now();
        let known = *self.ttls.lock();
        let first = self.first_use(ttl, &known);
        let rule = RestartRule {
            enabled: self.settings.restart_protection,
            floor: ttl,
            known,
            complete: false,
            loose: self.settings.loose_restart_rule,
        };
        // No point waiting for replies past the moment validity would be gone.
        let budget = self.settings.node_timeout.min(ttl.saturating_sub(drift));
        let horizon = self.horizon();
        let settled = |results: &[Option<NodeResult>]| {
            let longest = rule.longest(quorum::facts_of(results.iter().flatten()));
            // Whether the round can still be one every node answered: a vote
            // that would count then may count (`certain` waits for them all).
            let rule = RestartRule {
                complete: results
                    .iter()
                    .all(|r| r.as_ref().is_none_or(quorum::answered)),
                ..rule
            };
            let counts = |i: usize, facts: Option<&NodeFacts>| {
                facts.is_none_or(|f| {
                    let all = quorum::facts_of(results.iter().flatten());
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
            quorum::settled_acquire(results, certain, counts)
        };
        // The decision, made once the replies are in (and before any undo).
        let decision: Cell<Option<Decision>> = Cell::new(None);
        let decide = |results: &[NodeResult]| {
            let end = self.clock.now();
            let judged = self.judge(results.to_vec(), &rule);
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
        let results = self.transport.run(
            Op::Acquire {
                ttl,
                known_max: known.max,
                fenced: self.settings.fencing,
                after: first,
            },
            &[key],
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
        self.learn(&results, Some((ttl, first)));
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
                if !self.settings.fencing {
                    let state = LockState::new(resource, token, None, timing);
                    state.set_holding(holding);
                    return Ok(state);
                }
                // The token: the largest counter among the granting nodes.
                let fence = judged
                    .iter()
                    .filter_map(|r| r.as_ref().ok()?.fence)
                    .max()
                    .unwrap_or(0);
                let state = LockState::new(resource, token, Some(fence), timing);
                state.set_holding(holding);
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
                            let all = quorum::facts_of(results.iter());
                            rule.hold(&f, all, self.trusted(i, &f))
                        })
                })
                .collect();
            self.attempt_event(resource, start, result.as_ref(), &judged, &holds);
        }
        result
    }

    /// A fenced lock's write-back: `counter = max(counter, fence)` on every
    /// node where the key still holds our token, counted like an extension
    /// (a majority, inside validity). Only then may the lock be used: any
    /// later holder's `SET` on a node of that majority comes after our key
    /// left it, hence after the write-back, so its token is larger. On
    /// failure the lock is released and the attempt failed (retryable).
    fn write_back(&self, state: &LockState, fence: u64) -> Result<()> {
        let start = self.clock.now();
        let timing = state.timing();
        let time_left = timing.deadline.saturating_duration_since(start);
        let results = if fence == 0 || time_left.is_zero() {
            Vec::new()
        } else {
            let deadline = timing
                .deadline
                .min(after(start, self.settings.node_timeout));
            let op = Op::Fence { value: fence };
            let results =
                self.transport
                    .run(op, &[state.key()], deadline, Some(&quorum::settled), None);
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
                    e @ Error::NoQuorum { .. } => e,
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
    /// section: one swap round gives the key a fresh token, keeping its
    /// expiry, on every node where it holds the old token. It counts like an
    /// extension: a majority, inside the old validity, which the new section
    /// inherits unchanged (so hand-overs never keep a key longer than one
    /// TTL). Not tried for another TTL than the lock's, or with less than
    /// [`node_timeout`](crate::Builder::node_timeout) of validity left. On
    /// any failure the old lock (and any new token) is deleted: the caller
    /// then locks anew.
    pub(crate) fn take_over(&self, baton: &LockState, ttl: Duration) -> Result<LockState> {
        let start = self.clock.now();
        let timing = baton.timing();
        let time_left = timing.deadline.saturating_duration_since(start);
        // A fenced baton's next token must stay exact in the scripts.
        let exhausted = baton
            .fence
            .is_some_and(|f| f >= crate::driver::scripts::FENCE_LIMIT);
        if baton.is_lost()
            || timing.ttl != ttl
            || time_left < self.settings.node_timeout
            || exhausted
        {
            let _ = self.release(baton);
            return Err(Error::Expired);
        }
        let token = crate::clock::section_token(&baton.token);
        let key = Key {
            next: Some(&token),
            ..baton.key()
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
        let fence = baton.fence.map(|f| f + 1);
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
                .min(after(start, self.settings.node_timeout)),
            Some(&quorum::settled),
            Some(&decide),
        );
        self.learn(&results, None);
        self.note_failures(&results);
        let outcome = outcome.take().unwrap_or(Err(Error::Expired));
        if outcome.is_ok() {
            // The handing-over thread's section ends here (on failure, the
            // release of the baton reports it).
            self.release_event(baton, &Ok(()), &results);
        }
        if let Some(h) = self.settings.events.get() {
            let now = self.clock.now();
            h.on_attempt(&AttemptEvent {
                resource: &baton.resource,
                elapsed: now.saturating_duration_since(start),
                outcome: outcome
                    .as_ref()
                    .map(|_| timing.deadline.saturating_duration_since(now)),
                nodes: Nodes::new(self.transport.node_names(), &results, 0),
            });
        }
        outcome?;
        trace!("lock {:?}: token {token}", baton.resource);
        // A node the swap did not reach keeps an earlier token of the
        // lineage, with the lock's expiry; the next swap or the release
        // takes it from there.
        let mut state = LockState::new(&baton.resource, token, fence, timing);
        state.acquired = start;
        state.set_holding(quorum::holding(&results, 0));
        Ok(state)
    }

    /// Whether this client chose to trust node `i`'s lock history as seen.
    fn trusted(&self, i: usize, facts: &NodeFacts) -> bool {
        if !self.settings.fresh_cluster {
            return false;
        }
        // By key, not epoch: a node restarted from a snapshot keeps its
        // epoch but may have lost its latest locks (its key is new).
        let seen = self
            .first_histories
            .get(i)
            .map_or(0, |e| e.load(Ordering::Relaxed));
        seen == 0 || seen == facts.history
    }

    /// Applies the delayed-restart rule to an acquire round's results.
    fn judge(&self, results: Vec<NodeResult>, rule: &RestartRule) -> Vec<NodeResult> {
        let rule = &rule.heard(&results);
        let longest = rule.longest(quorum::facts_of(results.iter()));
        let horizon = self.horizon().max(longest);
        let heard_all = quorum::heard_all(&results);
        let all: Vec<NodeFacts> = quorum::facts_of(results.iter()).copied().collect();
        quorum::hold_back(results, self.transport.node_names(), |i, f| {
            let trusted = self.trusted(i, f);
            let left = rule.hold(f, all.iter(), trusted);
            if !left.is_zero() {
                Some(format!(
                    "lock history {:?} old; its votes count in {left:?}",
                    f.age
                ))
            } else if rule.enabled && !trusted && !heard_all && f.age < horizon {
                // A node that did not answer may know a longer TTL in use.
                Some(format!(
                    "lock history {:?} old, and not every node answered to say no longer TTL is in use",
                    f.age
                ))
            } else {
                None
            }
        })
    }

    /// Beyond this age a node's vote cannot be disqualified by what another
    /// node reports: no TTL in use is longer.
    fn horizon(&self) -> Duration {
        self.settings.max_ttl.unwrap_or(MAX_TTL)
    }

    /// Remembers what the nodes reported (the TTLs in use and, per node,
    /// the first and the last lock-history seen), and the TTL the round
    /// itself used, with the histories it sent as begun before it.
    fn learn(&self, results: &[NodeResult], used: Option<(Duration, After)>) {
        let mut heard: Option<TtlHistory> = None;
        for (i, r) in results.iter().enumerate() {
            let Some(f) = r.as_ref().ok().and_then(|r| r.facts) else {
                continue;
            };
            let h = TtlHistory::reported(&f);
            heard = Some(heard.map_or(h, |k| k.merge(h)));
            if let Some(e) = self.first_histories.get(i) {
                let _ = e.compare_exchange(0, f.history, Ordering::Relaxed, Ordering::Relaxed);
            }
            if let Some(k) = self.histories.get(i) {
                k.store(f.history, Ordering::Relaxed);
            }
        }
        if heard.is_none() && used.is_none() {
            return;
        }
        let mut ttls = self.ttls.lock();
        let mut next = heard.map_or(*ttls, |h| ttls.merge(h));
        if let Some((ttl, begun)) = used {
            next = next.used(ttl, begun);
        }
        *ttls = next;
    }

    /// The lock histories this client has seen begin (the last one each
    /// node reported).
    fn begun(&self) -> After {
        let mut out = After::NONE;
        for k in &self.histories {
            out.insert(k.load(Ordering::Relaxed));
        }
        out
    }

    /// What a round using `ttl` sends as the histories it comes after: the
    /// ones this client has seen begin if `ttl` is longer than any it knows
    /// of (a first use), else none (nothing is recorded).
    fn first_use(&self, ttl: Duration, known: &TtlHistory) -> After {
        if ttl > known.max {
            self.begun()
        } else {
            After::NONE
        }
    }

    /// Runs a release of one lock on every node, bounded by the node timeout.
    fn round(&self, op: Op, keys: &[Key<'_>]) -> Vec<NodeResult> {
        let deadline = after(self.clock.now(), self.settings.node_timeout);
        let results = self
            .transport
            .run(op, keys, deadline, Some(&quorum::settled), None);
        self.note_failures(&results);
        results
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
        let results = self.round(Op::Release { keep_until }, &[state.key()]);
        (quorum::decide_release(Tally::of(&results, 0)), results)
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
        let round = self
            .batch_deadline(now, crate::lock::watchdog::MAX_BATCH)
            .saturating_duration_since(now);
        let until = after(now, round.saturating_mul(2));
        loop {
            let seen = self.renewal_done.seen();
            if !state.renewal_in_flight() || self.clock.now() >= until {
                return;
            }
            self.clock.wait(&self.renewal_done, seen, Some(until));
        }
    }

    /// Tells the event handler a lock's critical section ended.
    pub(crate) fn release_event(
        &self,
        state: &LockState,
        outcome: &Result<()>,
        results: &[NodeResult],
    ) {
        if let Some(h) = self.settings.events.get() {
            h.on_release(&ReleaseEvent {
                resource: &state.resource,
                held: self.clock.now().saturating_duration_since(state.acquired),
                outcome: outcome.as_ref().map(|_| ()),
                nodes: Nodes::new(self.transport.node_names(), results, 0),
            });
        }
    }

    /// Tells the event handler a lock was lost.
    pub(crate) fn lost_event(&self, state: &LockState, error: &Error) {
        if let Some(h) = self.settings.events.get() {
            h.on_lost(&LostEvent {
                resource: &state.resource,
                error,
                held: self.clock.now().saturating_duration_since(state.acquired),
            });
        }
    }

    /// Tells the event handler an attempt ended, and which nodes the
    /// delayed-restart rule started or stopped holding back.
    fn attempt_event(
        &self,
        resource: &str,
        start: Instant,
        outcome: Result<&LockState, &Error>,
        judged: &[NodeResult],
        holds: &[Duration],
    ) {
        let Some(h) = self.settings.events.get() else {
            return;
        };
        let now = self.clock.now();
        h.on_attempt(&AttemptEvent {
            resource,
            elapsed: now.saturating_duration_since(start),
            outcome: outcome.map(|s| s.deadline().saturating_duration_since(now)),
            nodes: Nodes::new(self.transport.node_names(), judged, 0),
        });
        let names = self.transport.node_names();
        for (i, r) in judged.iter().enumerate() {
            let Some(flag) = self.held_back.get(i) else {
                continue;
            };
            let left = holds.get(i).copied().unwrap_or_default();
            let change = match r {
                Err(e) if e.kind() == crate::NodeErrorKind::Restarted && !left.is_zero() => (!flag
                    .swap(true, Ordering::Relaxed))
                .then_some(NodeChange::HeldBack { votes_in: left }),
                Ok(_) => flag
                    .swap(false, Ordering::Relaxed)
                    .then_some(NodeChange::HoldOver),
                Err(_) => None,
            };
            if let (Some(change), Some(node)) = (change, names.get(i)) {
                h.on_node(&NodeEvent { node, change });
            }
        }
    }

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
        let (known, begun) = {
            let mut ttls = self.ttls.lock();
            let known = *ttls;
            let begun = self.first_use(ttl, &known);
            *ttls = ttls.used(ttl, begun);
            (known.max, begun)
        };
        let keys: Vec<Key<'_>> = states.iter().map(|s| s.key()).collect();
        let mut deadline = self.batch_deadline(start, keys.len());
        if let [only] = states {
            // A lone extension need not wait past its lock's validity.
            deadline = deadline.min(only.deadline());
        }
        // What each lock had left when the round started.
        let time_left: Vec<Duration> = states
            .iter()
            .map(|s| s.deadline().saturating_duration_since(start))
            .collect();
        for state in states {
            state.reach_until(after(start, ttl));
        }
        let results = if deadline > start {
            // Stop at a settled majority (every lock's, for a batch); the
            // renewal thread's rounds linger after that, as long again, for
            // the stragglers: a node that lost the key says so, and its copy
            // is restored (the renewal thread's time, not a caller's; a slow
            // node that answers within the node timeout but after the lock's
            // validity no longer costs the lock).
            let settled: crate::lock::transport::Decided<'_> = if keys.len() == 1 {
                &quorum::settled
            } else {
                &quorum::settled_all
            };
            let op = Op::Extend {
                ttl,
                linger: loud,
                known_max: known,
                after: begun,
            };
            self.transport.run(op, &keys, deadline, Some(settled), None)
        } else {
            Vec::new()
        };
        let end = self.clock.now();
        self.note_failures(&results);
        let elapsed = end.saturating_duration_since(start);
        // Each lock's outcome, decided on its own.
        let decided: Vec<(usize, Result<Duration>, bool)> = states
            .iter()
            .enumerate()
            .map(|(i, state)| {
                let time_left = time_left[i];
                let tally = Tally::of(&results, i);
                let absent = tally.absent;
                let mut outcome = if time_left.is_zero() || results.is_empty() {
                    Err(Error::Expired)
                } else {
                    quorum::decide_extend(tally, ttl, elapsed, drift, time_left)
                };
                if matches!(outcome, Err(Error::ValidityExhausted { .. }))
                    && state.deadline() >= after(end, ttl.saturating_sub(drift))
                {
                    // A TTL too short to survive the round, on a lock that
                    // already lasts that long: nothing to do, and done.
                    outcome = Ok(Duration::ZERO);
                }
                // The lock's new deadline (or its loss) at once, before
                // any copy is restored.
                let mut lost_now = false;
                match &outcome {
                    // The script never shortens a key: a TTL shorter than
                    // what was left leaves the lock as it was.
                    Ok(validity) => state.raise_timing(Timing {
                        since: start,
                        deadline: after(end, *validity),
                        ttl,
                    }),
                    Err(e @ (Error::NotOwner { .. } | Error::Expired)) => {
                        // The callback is the watchdog's (as documented): a
                        // manual extend returns the error to its caller.
                        let callback = if loud { self.on_lost.as_ref() } else { None };
                        lost_now = state.lose(e, callback, loud);
                    }
                    Err(_) => {}
                }
                (absent, outcome, lost_now)
            })
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
            let keys: Vec<Key<'_>> = missing.iter().map(|&i| states[i].key()).collect();
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
            self.restore(&keys, ttl, by)
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
                // Only a round that confirmed the lock says where it is: one
                // that failed (too few answers in time) found nothing missing.
                if outcome.is_ok() && !view.is_empty() {
                    state.set_holding(quorum::holding(view, index));
                }
                if let Some(h) = self.settings.events.get() {
                    h.on_renewal(&RenewalEvent {
                        resource: &state.resource,
                        automatic: loud,
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
            })
            .collect()
    }

    /// Sets held locks' keys again where they are missing (`SET NX PX ttl`
    /// with our tokens), waiting for every node's answer within the node
    /// timeout (per 1,000 keys), and no later than `by` when given. A
    /// release of one of these locks comes after this round: the holder's
    /// own extension returns only then, and a release waits for the renewal
    /// thread's round (see [`LockState::begin_renewal`]), so a restored copy
    /// does not land after the release's delete. A node that has not
    /// answered by the end may still restore a copy after a release: its
    /// token stays unsettled, and the release's retries delete it.
    fn restore(&self, keys: &[Key<'_>], ttl: Duration, by: Option<Instant>) -> Vec<NodeResult> {
        let now = self.clock.now();
        let bound = self.batch_deadline(now, keys.len());
        let deadline = by.map_or(bound, |by| by.min(bound));
        let results = self
            .transport
            .run(Op::Restore { ttl }, keys, deadline, None, None);
        if by.is_none() {
            // (A caller's restore may be cut short by its lock's validity:
            // a reply not waited for then is no node's failure.)
            self.note_failures(&results);
        }
        debug!(
            "restored {} missing cop(ies) of {} lock(s)",
            (0..keys.len())
                .map(|k| Tally::of(&results, k).restored)
                .sum::<usize>(),
            keys.len()
        );
        results
    }

    /// Best-effort release of many locks in one round trip per node.
    pub(crate) fn release_many(&self, states: &[&LockState]) {
        let keys: Vec<Key<'_>> = states.iter().map(|s| s.key()).collect();
        let deadline = self.batch_deadline(self.clock.now(), keys.len());
        let keep_until = states
            .iter()
            .map(|s| self.keep_until(s))
            .max()
            .unwrap_or(deadline);
        let results = self
            .transport
            .run(Op::Release { keep_until }, &keys, deadline, None, None);
        self.note_failures(&results);
    }

    /// A round's deadline: the node timeout, plus one more per 1,000 keys
    /// (a big batch keeps the server busy for longer).
    fn batch_deadline(&self, start: Instant, keys: usize) -> Instant {
        let scale = u32::try_from(keys / 1000 + 1).unwrap_or(u32::MAX);
        after(start, self.settings.node_timeout.saturating_mul(scale))
    }

    /// The client's renewal thread, started on first use.
    pub(crate) fn watchdog(&self) -> &Watchdog {
        self.watchdog
            .get_or_init(|| Watchdog::spawn(self.me.clone(), self.clock.clone()))
    }

    /// Logs node failures: at most one warn per node per [`WARN_EVERY`],
    /// the rest at debug.
    fn note_failures(&self, results: &[NodeResult]) {
        let now = self.clock.now();
        for (i, r) in results.iter().enumerate() {
            if let Err(e) = r {
                if e.kind() == crate::NodeErrorKind::NotAwaited {
                    trace!("{e}");
                } else if self.warned.get(i).is_some_and(|t| t.ready(now, WARN_EVERY)) {
                    warn!("{e} (further failures of this node logged at debug for {WARN_EVERY:?})");
                } else {
                    debug!("{e}");
                }
            }
        }
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
    use crate::lock::transport::{Answer, Reply};
    results
        .iter()
        .zip(restored)
        .map(|(ext, rest)| {
            let answer =
                |r: &NodeResult, k: usize| r.as_ref().ok().and_then(|r| r.answers.get(k).copied());
            match (answer(ext, i), answer(rest, p)) {
                (Some(Answer::Absent), Some(Answer::Restored | Answer::Ok)) => Ok(Reply {
                    answers: vec![Answer::Restored],
                    facts: None,
                    fence: None,
                    server: None,
                }),
                (Some(a), _) => Ok(Reply {
                    answers: vec![a],
                    facts: None,
                    fence: None,
                    server: None,
                }),
                (None, _) => match ext {
                    Err(e) => Err(e.clone()),
                    Ok(_) => Ok(Reply {
                        answers: Vec::new(),
                        facts: None,
                        fence: None,
                        server: None,
                    }),
                },
            }
        })
        .collect()
}

/// Checks a resource name: not empty, not too long, not the crate's own key.
fn validate_resource(resource: &str) -> Result<()> {
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
    if resource == crate::driver::scripts::META_KEY {
        return Err(InvalidInput::ReservedResource(crate::driver::scripts::META_KEY).into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::fake::{client, client_over, client_with, Mode};
    use std::sync::atomic::Ordering;

    const MS: Duration = Duration::from_millis(1);
    const TTL: Duration = Duration::from_secs(10);

    #[test]
    fn acquires_on_every_node_with_validity_below_ttl() {
        let (locks, nodes, _) = client(3);
        let g = locks.try_lock("r", TTL).unwrap();
        // 10 s − 1 ms round − (100 ms + 2 ms) drift.
        assert_eq!(g.validity(), TTL - MS - 102 * MS);
        for i in 0..3 {
            assert_eq!(nodes.get(i, "r").as_deref(), Some(g.token()));
        }
        g.release().unwrap();
        assert!((0..3).all(|i| nodes.get(i, "r").is_none()));
    }

    #[test]
    fn a_second_owner_is_refused_until_release() {
        let (locks, _, _) = client(3);
        let g = locks.try_lock("r", TTL).unwrap();
        match locks.try_lock("r", TTL) {
            Err(Error::Taken { held: 3, nodes: 3 }) => {}
            other => panic!("{other:?}"),
        }
        drop(g);
        assert!(locks.try_lock("r", TTL).is_ok());
    }

    #[test]
    fn survives_a_minority_and_names_a_failed_majority() {
        let (locks, nodes, _) = client(3);
        nodes.set_mode(2, Mode::Down);
        drop(locks.try_lock("a", TTL).unwrap());
        nodes.set_mode(1, Mode::Hung);
        match locks.try_lock("b", TTL) {
            Err(Error::NoQuorum {
                agreed: 1,
                quorum: 2,
                failures,
            }) => {
                let names: Vec<_> = failures.iter().map(|f| f.node().to_owned()).collect();
                assert_eq!(names, ["fake1:6379", "fake2:6379"]);
            }
            other => panic!("{other:?}"),
        }
        // The failed attempt released its one successful SET.
        assert!(nodes.get(0, "b").is_none());
    }

    #[test]
    fn a_failed_attempt_unlocks_nodes_whose_reply_was_lost() {
        let (locks, nodes, _) = client(3);
        nodes.set_mode(1, Mode::Lossy);
        nodes.set_mode(2, Mode::Lossy);
        assert!(matches!(
            locks.try_lock("r", TTL),
            Err(Error::NoQuorum { .. })
        ));
        // Lossy nodes executed the SET, and then the release.
        assert!((0..3).all(|i| nodes.get(i, "r").is_none()));
    }

    #[test]
    fn no_release_round_when_every_node_refused() {
        let (locks, nodes, _) = client(3);
        let _g = locks.try_lock("r", TTL).unwrap();
        let before = nodes.rounds.load(Ordering::SeqCst);
        assert!(locks.try_lock("r", TTL).is_err());
        assert_eq!(nodes.rounds.load(Ordering::SeqCst) - before, 1);
    }

    #[test]
    fn too_slow_a_round_exhausts_validity_and_unlocks() {
        let (locks, nodes, _) = client(3);
        *nodes.latency.lock() = 40 * MS;
        match locks.try_lock("r", 41 * MS) {
            // The round is cut off where validity would reach zero.
            Err(Error::ValidityExhausted { elapsed, ttl }) => {
                let drift = quorum::drift_allowance(41 * MS, 0.01);
                assert_eq!((elapsed, ttl), (41 * MS - drift, 41 * MS));
            }
            other => panic!("{other:?}"),
        }
        assert!((0..3).all(|i| nodes.get(i, "r").is_none()));
    }

    /// Issue 8: a take-over is a new critical section under a fresh token,
    /// swapped on every node in one round, keeping the lock's expiry.
    #[test]
    fn a_take_over_swaps_in_a_fresh_token_in_one_round() {
        let (locks, nodes, clock) = client(3);
        let g = locks.lock("r", TTL).unwrap();
        let old = g.state().clone();
        clock.advance(TTL / 4);
        let before = nodes.rounds.load(Ordering::SeqCst);
        let new = locks.inner.take_over(&old, TTL).expect("taken over");
        assert_eq!(nodes.rounds.load(Ordering::SeqCst) - before, 1);
        assert_ne!(new.token, old.token);
        assert!((0..3).all(|i| nodes.get(i, "r").as_deref() == Some(new.token.as_str())));
        assert_eq!(new.timing(), old.timing(), "the same expiry");
        std::mem::forget(g);
    }

    /// A node the swap did not reach keeps the old token, with the lock's
    /// expiry: the next swap takes it from there, and releasing the new
    /// section deletes it there too, so no key is left behind to block that
    /// node's vote until the TTL runs out.
    #[test]
    fn releasing_a_taken_over_lock_deletes_old_tokens_the_swap_missed() {
        let (locks, nodes, _) = client(3);
        let g = locks.lock("r", TTL).unwrap();
        nodes.set_mode(2, Mode::Down);
        let b = locks.inner.take_over(g.state(), TTL).expect("2 of 3");
        std::mem::forget(g);
        nodes.set_mode(2, Mode::Up);
        // And once more, with node 2 still on the first token.
        nodes.set_mode(1, Mode::Down);
        let c = locks.inner.take_over(&b, TTL).expect("2 of 3");
        nodes.set_mode(1, Mode::Up);
        // Node 2 missed the first swap; the second takes it from there.
        assert_eq!(nodes.get(2, "r").as_deref(), Some(c.token.as_str()));
        assert!(nodes.get(1, "r").is_some_and(|t| t != c.token), "missed");
        locks.inner.release(&c).expect("released");
        assert!((0..3).all(|i| nodes.get(i, "r").is_none()), "nothing left");
    }

    /// Review of the swap: a node that missed many swaps in a row (down, or
    /// skipped as failing) still holds the first section's token; the last
    /// section's release must delete it (a list of recent tokens forgot it).
    #[test]
    fn a_node_that_missed_many_swaps_is_cleaned_by_the_release() {
        let (locks, nodes, _) = client(3);
        let g = locks.lock("r", TTL).unwrap();
        let first = g.state().token.clone();
        nodes.set_mode(2, Mode::Down);
        let mut state = locks.inner.take_over(g.state(), TTL).expect("2 of 3");
        std::mem::forget(g);
        for _ in 0..10 {
            state = locks.inner.take_over(&state, TTL).expect("2 of 3");
        }
        nodes.set_mode(2, Mode::Up);
        assert_eq!(nodes.get(2, "r"), Some(first));
        locks.inner.release(&state).expect("released");
        assert!((0..3).all(|i| nodes.get(i, "r").is_none()), "nothing left");
    }

    /// Issue 8: a handed-over lock that a majority no longer holds, or with
    /// too little validity left to swap inside it, is not used: it is
    /// deleted everywhere (the caller locks anew).
    #[test]
    fn a_take_over_that_cannot_count_deletes_the_old_lock() {
        let (locks, nodes, clock) = client(3);
        let g = locks.lock("r", TTL).unwrap();
        nodes.del(0, "r");
        nodes.del(1, "r");
        assert!(matches!(
            locks.inner.take_over(g.state(), TTL),
            Err(Error::Expired)
        ));
        assert!((0..3).all(|i| nodes.get(i, "r").is_none()), "nothing left");
        std::mem::forget(g);

        let g = locks.lock("s", TTL).unwrap();
        let left = g.validity();
        clock.advance(left - 10 * MS);
        let before = nodes.rounds.load(Ordering::SeqCst);
        assert!(locks.inner.take_over(g.state(), TTL).is_err());
        assert!((0..3).all(|i| nodes.get(i, "s").is_none()), "released");
        assert_eq!(
            nodes.rounds.load(Ordering::SeqCst) - before,
            1,
            "no swap tried"
        );
        std::mem::forget(g);
    }

    #[test]
    fn lock_makes_retry_count_attempts_then_reports_the_last_error() {
        let settings = Settings {
            retry_count: 4,
            ..crate::testing::fake::settings()
        };
        let (locks, nodes, clock) = client_with(3, settings.clone());
        // Held by another process (a holder in this one would be queued
        // behind, on the same virtual clock, for the whole wait).
        let other = client_over(&nodes, settings);
        let _g = other.try_lock("r", TTL).unwrap();
        let (r0, t0) = (nodes.rounds.load(Ordering::SeqCst), clock.now());
        assert!(matches!(locks.lock("r", TTL), Err(Error::Taken { .. })));
        assert_eq!(nodes.rounds.load(Ordering::SeqCst) - r0, 4);
        // Three pauses of at most 200 ms each, plus four 1 ms rounds.
        assert!(clock.now() - t0 <= 604 * MS, "{:?}", clock.now() - t0);
    }

    #[test]
    fn lock_timeout_keeps_trying_until_the_wait_is_over() {
        let (locks, nodes, clock) = client(3);
        let holder = locks.try_lock("r", TTL).unwrap();
        let t0 = clock.now();
        assert!(locks.lock_timeout("r", TTL, 2 * TTL / 10).is_err());
        let waited = clock.now() - t0;
        assert!(
            waited >= 2 * TTL / 10 && waited <= 2 * TTL / 10 + 2 * MS,
            "{waited:?}"
        );
        // It succeeds once the holder's key expires inside the wait.
        nodes.set_mode(0, Mode::Up);
        drop(holder);
        let g = locks.lock_timeout("r", TTL, TTL).unwrap();
        assert!(g.is_held());
    }

    #[test]
    fn extend_moves_the_deadline_and_detects_loss() {
        let (locks, nodes, clock) = client(3);
        let g = locks.try_lock("r", 100 * MS).unwrap();
        clock.advance(50 * MS);
        let v = g.extend(100 * MS).unwrap();
        assert_eq!(v, 100 * MS - MS - 3 * MS);
        clock.advance(90 * MS);
        assert!(g.is_held(), "extension should outlive the original ttl");
        // Someone deletes it behind our back on a majority.
        nodes.del(0, "r");
        nodes.del(1, "r");
        assert!(matches!(g.extend(100 * MS), Err(Error::Expired)));
        assert!(!g.is_held());
        assert!(matches!(g.extend(100 * MS), Err(Error::Expired)));
    }

    #[test]
    fn release_tells_expired_from_taken_over() {
        let (locks, _, clock) = client(3);
        let g = locks.try_lock("r", 100 * MS).unwrap();
        clock.advance(200 * MS);
        assert!(!g.is_held());
        assert!(matches!(g.release(), Err(Error::Expired)));

        let g = locks.try_lock("r", 100 * MS).unwrap();
        clock.advance(200 * MS);
        let _other = locks.try_lock("r", TTL).unwrap();
        assert!(matches!(g.release(), Err(Error::NotOwner { nodes: 3 })));
    }

    /// `max_ttl` is the longest TTL any client uses: the restart rule stops
    /// waiting for stragglers beyond it, so a lock or an extension above it
    /// is refused (found by the review of issue 19's rule).
    #[test]
    fn a_ttl_above_the_configured_max_ttl_is_refused() {
        let settings = Settings {
            max_ttl: Some(Duration::from_secs(2)),
            ..crate::testing::fake::settings()
        };
        let (locks, _, _) = crate::testing::fake::client_with(3, settings);
        let long = Duration::from_secs(3);
        assert!(matches!(
            locks.try_lock("r", long),
            Err(Error::InvalidInput(InvalidInput::TtlTooLong(t))) if t == long
        ));
        let g = locks
            .try_lock("r", Duration::from_secs(2))
            .expect("at max_ttl");
        assert!(matches!(
            g.extend(long),
            Err(Error::InvalidInput(InvalidInput::TtlTooLong(_)))
        ));
        g.release().expect("release");
    }

    #[test]
    fn bad_input_is_refused_before_any_io() {
        let (locks, nodes, _) = client(3);
        let cases: [(&str, Duration, InvalidInput); 4] = [
            ("", TTL, InvalidInput::EmptyResource),
            ("r", Duration::ZERO, InvalidInput::ZeroTtl),
            (
                "r",
                2 * MS,
                InvalidInput::TtlTooShort {
                    ttl: 2 * MS,
                    allowance: Duration::from_micros(2020),
                },
            ),
            ("r", Duration::MAX, InvalidInput::TtlTooLong(Duration::MAX)),
        ];
        for (res, ttl, want) in cases {
            match locks.lock(res, ttl) {
                Err(Error::InvalidInput(got)) => assert_eq!(got, want),
                other => panic!("{res:?} {ttl:?}: {other:?}"),
            }
        }
        assert_eq!(nodes.rounds.load(Ordering::SeqCst), 0);
    }

    /// Issue 7's restart race, made deterministic: X holds a lock on nodes
    /// 0 and 2; node 2 restarts empty; a client that meets the cluster for
    /// the first time must not win nodes 1 + 2, whatever TTL it asks for.
    #[test]
    fn a_node_that_lost_its_data_does_not_vote_for_a_fresh_client() {
        let (x, nodes, clock) = client(3);
        // The cluster has carried 10 s locks for a while.
        drop(x.try_lock("warm", TTL).unwrap());
        clock.advance(60 * TTL);
        nodes.set_mode(1, Mode::Down);
        let held = x.try_lock("r", TTL).expect("nodes 0 and 2");
        nodes.set_mode(1, Mode::Up);
        nodes.wipe(2);
        clock.advance(TTL / 10);

        // A fresh client with default (production) settings, asking 1 s.
        let y = client_over(&nodes, Settings::default());
        match y.try_lock("r", TTL / 10) {
            Err(Error::NoQuorum { failures, .. }) => {
                let f: Vec<_> = failures.iter().map(|f| (f.node(), f.kind())).collect();
                assert_eq!(f, [("fake2:6379", crate::NodeErrorKind::Restarted)]);
            }
            other => panic!("two holders: {other:?}"),
        }
        assert!(nodes.get(2, "r").is_none(), "the held-back SET was undone");
        // Without the rule it wins: the hazard is real.
        let unprotected = client_over(
            &nodes,
            Settings {
                restart_protection: false,
                ..Settings::default()
            },
        );
        assert!(unprotected.try_lock("r", TTL / 10).is_ok());
        assert!(held.is_held());
    }

    #[test]
    fn a_held_back_node_votes_again_after_the_longest_ttl() {
        let (x, nodes, clock) = client(3);
        drop(x.try_lock("warm", TTL).unwrap());
        clock.advance(60 * TTL);
        nodes.wipe(0);
        nodes.wipe(1);
        let y = client_over(&nodes, Settings::default());
        assert!(y.try_lock("a", TTL / 10).is_err(), "two young nodes of 3");
        // The young nodes learnt nothing of the 10 s TTL, but node 2 reports
        // it: they are held for 10 s, not for the 1 s asked.
        clock.advance(TTL / 2);
        assert!(y.try_lock("b", TTL / 10).is_err());
        clock.advance(TTL / 2);
        assert!(y.try_lock("c", TTL / 10).is_ok());
    }

    #[test]
    fn a_brand_new_cluster_waits_one_ttl_unless_declared_fresh() {
        let (_, nodes, clock) = client_with(3, Settings::default());
        let y = client_over(&nodes, Settings::default());
        let t0 = clock.now();
        let g = y.lock_timeout("r", TTL, 2 * TTL).expect("after one ttl");
        let waited = clock.now() - t0;
        assert!(waited >= TTL && waited < TTL + TTL / 2, "{waited:?}");
        drop(g);
        // Declared fresh: at once.
        let (fresh, _, _) = client(3);
        assert!(fresh.try_lock("r", TTL).is_ok());
    }

    #[test]
    fn a_fresh_cluster_client_still_holds_back_a_node_it_saw_restart() {
        let (x, nodes, clock) = client(3);
        drop(x.try_lock("warm", TTL).unwrap());
        clock.advance(TTL);
        nodes.set_mode(1, Mode::Down);
        let _held = x.try_lock("r", TTL).unwrap();
        nodes.set_mode(1, Mode::Up);
        nodes.wipe(2);
        let y = client_over(&nodes, crate::testing::fake::settings());
        // y has never seen node 2: trusted at first sight (the documented
        // risk of fresh_cluster); x has, and holds it back.
        drop(y);
        match x.try_lock("other", TTL) {
            Ok(g) => {
                assert_eq!(nodes.get(2, "other").as_deref(), Some(g.token()));
                // Granted by nodes 0 and 1; node 2's vote did not count.
            }
            Err(e) => panic!("{e}"),
        }
        nodes.set_mode(1, Mode::Down);
        match x.try_lock("third", TTL) {
            Err(Error::NoQuorum { failures, .. }) => {
                assert!(failures
                    .iter()
                    .any(|f| f.kind() == crate::NodeErrorKind::Restarted));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn releases_are_never_held_back() {
        let (x, nodes, clock) = client(3);
        drop(x.try_lock("warm", TTL).unwrap());
        nodes.wipe(2);
        clock.advance(TTL / 10);
        // x saw node 2's history start again: its acquire votes are held
        // back, but our SET there stands (it is ours).
        let g = x.try_lock("r", TTL).expect("nodes 0 and 1");
        assert_eq!(nodes.get(2, "r").as_deref(), Some(g.token()));
        match x.try_lock("probe", TTL) {
            Ok(p) => drop(p),
            Err(e) => panic!("{e}"),
        }
        // With node 0 down, the release needs node 2's delete to count.
        nodes.set_mode(0, Mode::Down);
        g.release().expect("deleted on nodes 1 and 2: a majority");
        assert!(nodes.get(2, "r").is_none());
    }

    #[test]
    fn huge_and_reserved_resource_names_are_refused_before_any_io() {
        let (locks, nodes, _) = client(3);
        let huge = "x".repeat(crate::MAX_RESOURCE_LEN + 1);
        match locks.try_lock(&huge, TTL) {
            Err(Error::InvalidInput(InvalidInput::ResourceTooLong { len, max })) => {
                assert_eq!(
                    (len, max),
                    (crate::MAX_RESOURCE_LEN + 1, crate::MAX_RESOURCE_LEN)
                );
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            locks.lock(crate::driver::scripts::META_KEY, TTL),
            Err(Error::InvalidInput(InvalidInput::ReservedResource(_)))
        ));
        assert_eq!(nodes.rounds.load(Ordering::SeqCst), 0);
        let longest = "y".repeat(crate::MAX_RESOURCE_LEN);
        assert!(locks.try_lock(&longest, TTL).is_ok());
    }

    /// Issue 8: `with_lock` must not report success for work that finished
    /// after the lock's validity, even while the keys (which live the full
    /// TTL, a drift allowance longer) are still ours on the nodes.
    #[test]
    fn with_lock_reports_work_that_outlived_its_validity() {
        let (locks, _, clock) = client(3);
        let ttl = TTL;
        let r = locks.with_lock("r", ttl, |g| {
            // Past the deadline, before the keys expire on the nodes.
            let past = g.validity() + MS;
            clock.advance(past);
            assert!(!g.is_held());
        });
        assert!(matches!(r, Err(Error::Expired)), "{r:?}");
        // Work done in time is still Ok.
        assert!(locks.with_lock("s", ttl, |_| clock.advance(MS)).is_ok());
    }

    /// Issue 8: `on_lost` is the watchdog's callback; a failed manual
    /// `extend` reports to its caller and must not run it on the caller's
    /// thread.
    #[test]
    fn a_failed_manual_extend_does_not_run_on_lost() {
        use std::sync::atomic::AtomicUsize;
        let calls = Arc::new(AtomicUsize::new(0));
        let seen = calls.clone();
        let (locks, nodes, _) = crate::testing::fake::client_with_on_lost(3, move |_, _| {
            seen.fetch_add(1, Ordering::SeqCst);
        });
        let g = locks.try_lock("r", TTL).unwrap();
        nodes.del(0, "r");
        nodes.del(1, "r");
        assert!(matches!(g.extend(TTL), Err(Error::Expired)));
        assert!(g.is_lost());
        assert_eq!(calls.load(Ordering::SeqCst), 0);
    }

    fn fenced() -> Settings {
        Settings {
            fencing: true,
            ..crate::testing::fake::settings()
        }
    }

    /// Issue 9: tokens grow with every critical section, across clients,
    /// and cost exactly one more round; an unfenced client has none.
    #[test]
    fn fencing_tokens_grow_with_every_critical_section() {
        let (a, nodes, clock) = client_with(3, fenced());
        let b = client_over(&nodes, fenced());
        let mut last = 0;
        for i in 0..20 {
            let locks = if i % 2 == 0 { &a } else { &b };
            let before = nodes.rounds.load(Ordering::SeqCst);
            let g = locks.try_lock("r", TTL).unwrap();
            assert_eq!(
                nodes.rounds.load(Ordering::SeqCst) - before,
                2,
                "SET, write-back"
            );
            let t = g.fencing_token().expect("fenced");
            assert!(t > last, "{t} after {last}");
            last = t;
            // Renewal keeps the token.
            g.extend(TTL).unwrap();
            assert_eq!(g.fencing_token(), Some(t));
            if i % 3 == 0 {
                drop(g); // released
            } else {
                std::mem::forget(g);
                clock.advance(TTL + MS); // expired
            }
        }
        let (plain, _, _) = client(3);
        assert_eq!(plain.try_lock("r", TTL).unwrap().fencing_token(), None);
    }

    /// Issue 9's ordering argument: the token is the largest counter of the
    /// granting majority, and it is written back where our key is, so that
    /// a later holder granted by other nodes still gets a larger one. Node
    /// 2's clock runs a second ahead: its counter, hence our token, is far
    /// above node 0's until the write-back.
    #[test]
    fn the_write_back_lifts_every_granting_node_to_the_token() {
        let (locks, nodes, _) = client_with(3, fenced());
        nodes.set_clock_offset(2, 1_000_000);
        nodes.set_mode(1, Mode::Down);
        let g = locks.try_lock("r", TTL).unwrap();
        let t1 = g.fencing_token().unwrap();
        assert_eq!(
            nodes.fence(2, "r"),
            Some(t1),
            "node 2's counter is the token"
        );
        assert_eq!(nodes.fence(0, "r"), Some(t1), "written back to node 0");
        g.release().unwrap();
        nodes.set_mode(1, Mode::Up);
        nodes.set_mode(2, Mode::Down);
        let g = locks.try_lock("r", TTL).unwrap();
        assert!(
            g.fencing_token().unwrap() > t1,
            "nodes 0 and 1 grant a larger one"
        );
    }

    /// A write-back that misses the majority (a node gone between the SET
    /// and the write-back) must not hand out the lock: it is released, and
    /// the attempt fails with a retryable error.
    #[test]
    fn a_lock_whose_token_was_not_written_back_is_not_returned() {
        let (locks, nodes, _) = client_with(3, fenced());
        *nodes.before_round.lock() = Some(crate::testing::fake::Hook(Box::new(|n, op| {
            if matches!(op, Op::Fence { .. }) {
                n.set_mode(0, Mode::Down);
                n.set_mode(1, Mode::Hung);
            }
        })));
        match locks.try_lock("r", TTL) {
            Err(e @ Error::NoQuorum { .. }) => assert!(e.is_retryable()),
            other => panic!("{other:?}"),
        }
        *nodes.before_round.lock() = None;
        assert!(nodes.get(2, "r").is_none(), "released where it answered");
        // A key deleted behind our back between the rounds: the same.
        *nodes.before_round.lock() = Some(crate::testing::fake::Hook(Box::new(|n, op| {
            if matches!(op, Op::Fence { .. }) {
                n.del(0, "s");
                n.del(1, "s");
            }
        })));
        match locks.try_lock("s", TTL) {
            Err(e) => assert!(e.is_retryable(), "{e:?}"),
            Ok(g) => panic!("granted without a written-back token: {g:?}"),
        }
    }

    /// Issue 9: a hand-over gives the next token, written by the swap
    /// itself (no extra round), so a later holder elsewhere gets more.
    #[test]
    fn a_hand_over_gives_the_next_token_in_the_swap() {
        let (locks, nodes, _) = client_with(3, fenced());
        let g = locks.lock("r", TTL).unwrap();
        let t = g.fencing_token().unwrap();
        let before = nodes.rounds.load(Ordering::SeqCst);
        let next = locks.inner.take_over(g.state(), TTL).expect("taken over");
        std::mem::forget(g);
        assert_eq!(nodes.rounds.load(Ordering::SeqCst) - before, 1);
        assert_eq!(next.fence, Some(t + 1));
        assert!((0..3).all(|i| nodes.fence(i, "r") == Some(t + 1)));
        locks.inner.release(&next).unwrap();
        let other = client_over(&nodes, fenced());
        assert!(other.try_lock("r", TTL).unwrap().fencing_token().unwrap() > t + 1);
    }

    /// A node that lost its data restarts its counters from its clock: the
    /// next token is still larger, as long as that clock is not behind the
    /// clocks that made earlier tokens by more than the time since. The
    /// README states this assumption; the second half shows it is needed.
    #[test]
    fn a_node_that_lost_its_counters_restarts_them_from_its_clock() {
        let (locks, nodes, _) = client_with(3, fenced());
        nodes.set_mode(2, Mode::Down);
        let t1 = locks.try_lock("r", TTL).unwrap().fencing_token().unwrap();
        nodes.set_mode(2, Mode::Up);
        // Node 1 loses its data; node 0 is down: nodes 1 and 2 (which never
        // saw the lock) grant the next one, after the restart hold.
        nodes.wipe(1);
        nodes.set_mode(0, Mode::Down);
        let t2 = locks.lock_timeout("r", TTL, 2 * TTL).unwrap();
        let t2 = t2.fencing_token().unwrap();
        assert!(t2 > t1, "{t2} after {t1}");
        // The same with node 1's and node 2's clocks behind by more than the
        // time since t2 was granted: the token goes backwards.
        nodes.set_mode(0, Mode::Up);
        nodes.wipe(1);
        nodes.set_mode(0, Mode::Down);
        nodes.set_clock_offset(1, -60_000_000);
        nodes.set_clock_offset(2, -60_000_000);
        // Node 2 kept its counter (t2 was written back there): it still
        // wins. Wipe it too, as a whole-cluster data loss would.
        nodes.wipe(2);
        let t3 = locks.lock_timeout("r", TTL, 2 * TTL).unwrap();
        let t3 = t3.fencing_token().unwrap();
        assert!(t3 < t2, "assumption broken: {t3} after {t2}");
    }

    /// Extensions never shorten a lock: one too short to survive its own
    /// round, on a lock that already lasts longer, is done (it used to
    /// report `ValidityExhausted` for a healthy lock).
    #[test]
    fn an_extension_shorter_than_what_is_left_is_done() {
        let (locks, nodes, _clock) = client(3);
        *nodes.latency.lock() = 2 * MS;
        let g = locks.try_lock("r", TTL).unwrap();
        let deadline = g.deadline();
        let v = g.extend(3 * MS).expect("nothing to do is done");
        assert!(v > TTL / 2, "{v:?}");
        assert_eq!(g.deadline(), deadline);
    }

    /// A failed extension may still have set a later expiry on the nodes
    /// it reached: the release's retry window covers it.
    #[test]
    fn a_failed_extension_widens_the_release_window() {
        let (locks, nodes, clock) = client(3);
        let g = locks.try_lock("r", TTL).unwrap();
        for i in 0..3 {
            nodes.set_mode(i, Mode::Lossy);
        }
        let start = clock.now();
        assert!(g.extend(10 * TTL).is_err(), "no replies: not extended");
        assert!(g.deadline() < start + TTL, "the deadline stays");
        let keep = locks.inner.keep_until(g.state());
        assert!(
            keep >= start + 10 * TTL,
            "release window {:?}",
            keep - start
        );
    }
}

/// The node list's rules: one vote per server, nodes that cannot keep
/// locks, and copies restored on every node the lock can be on.
#[cfg(test)]
mod node_rules {
    use super::*;
    use crate::lock::transport::ServerKind;
    use crate::testing::fake::{client, client_over, client_with, Mode};

    const TTL: Duration = Duration::from_secs(10);

    /// One server listed under two names gets one vote: with the third node
    /// down it cannot grant a lock alone, and a key it loses cannot let a
    /// second client in while the first holds.
    #[test]
    fn one_server_listed_twice_votes_once() {
        let (x, nodes, _) = client(3);
        nodes.alias(1, 0); // entries 0 and 1: one server
        nodes.set_mode(2, Mode::Down);
        match x.try_lock("r", TTL) {
            Err(Error::NoQuorum { failures, .. }) => {
                let kinds: Vec<_> = failures.iter().map(|f| f.kind()).collect();
                assert!(
                    kinds.contains(&crate::NodeErrorKind::SameServer),
                    "{failures:?}"
                );
            }
            other => panic!("one server granted a lock alone: {other:?}"),
        }
        assert!(nodes.get(0, "r").is_none(), "the failed attempt was undone");
        nodes.set_mode(2, Mode::Up);
        let g = x.try_lock("r", TTL).expect("servers 0 and 2");
        // The doubled server loses the key (eviction, a failover).
        nodes.del(0, "r");
        let y = client_over(&nodes, crate::testing::fake::settings());
        assert!(
            y.try_lock("r", TTL).is_err(),
            "a second holder from one server's two names"
        );
        assert!(g.is_held());
    }

    /// Without the rule (what the library did before), the same schedule
    /// gives two holders: the rule is what prevents it.
    #[test]
    fn counted_twice_one_server_lets_two_hold() {
        let settings = Settings {
            one_vote_per_server: false,
            ..crate::testing::fake::settings()
        };
        let (x, nodes, _) = client_with(3, settings.clone());
        nodes.alias(1, 0);
        nodes.set_mode(2, Mode::Down);
        let g = x.try_lock("r", TTL).expect("granted by one server");
        nodes.set_mode(2, Mode::Up);
        nodes.del(0, "r");
        let y = client_over(&nodes, settings);
        let h = y.try_lock("r", TTL).expect("a second holder");
        assert!(g.is_held() && h.is_held());
        std::mem::forget((g, h));
    }

    /// A replica or a cluster node never votes; an evicting node votes,
    /// unless the client refuses it.
    #[test]
    fn nodes_that_cannot_keep_locks_do_not_vote() {
        for kind in [ServerKind::Replica, ServerKind::Cluster] {
            let (x, nodes, _) = client(3);
            nodes.set_kind(0, kind);
            nodes.set_mode(2, Mode::Down);
            match x.try_lock("r", TTL) {
                Err(Error::NoQuorum { failures, .. }) => assert!(
                    failures
                        .iter()
                        .any(|f| f.kind() == crate::NodeErrorKind::Unsuitable),
                    "{kind:?}: {failures:?}"
                ),
                other => panic!("{kind:?} voted: {other:?}"),
            }
        }
        let evicting = ServerKind::Evicting("volatile-lru");
        let (x, nodes, _) = client(3);
        nodes.set_kind(0, evicting);
        nodes.set_mode(2, Mode::Down);
        drop(x.try_lock("r", TTL).expect("warned of, still counted"));
        let strict = Settings {
            refuse_evicting: true,
            ..crate::testing::fake::settings()
        };
        let x = client_over(&nodes, strict);
        assert!(x.try_lock("s", TTL).is_err(), "refused when asked to");
    }

    /// A lock lives on every node it can: an extension restores the key
    /// where it went missing (a node restarted empty, an eviction), and the
    /// guard says on how many nodes the lock is.
    #[test]
    fn extensions_restore_missing_copies() {
        let (x, nodes, _) = client(3);
        let g = x.try_lock("r", TTL).unwrap();
        assert_eq!(g.nodes_held(), 3);
        nodes.wipe(2); // restarted empty
        g.extend(TTL).expect("nodes 0 and 1 still hold it");
        assert_eq!(g.nodes_held(), 3, "restored on node 2");
        assert_eq!(nodes.get(2, "r").as_deref(), Some(g.token()));
        // One node failing now does not lose the lock.
        nodes.set_mode(0, Mode::Down);
        g.extend(TTL).expect("nodes 1 and 2 hold it");
        nodes.set_mode(0, Mode::Up);
        // A lock whose copies are gone from a majority is lost: nothing is
        // restored, and its release deletes what is left.
        nodes.del(1, "r");
        nodes.del(2, "r");
        assert!(matches!(g.extend(TTL), Err(Error::Expired)));
        assert!(g.is_lost());
        assert!(nodes.get(1, "r").is_none() && nodes.get(2, "r").is_none());
        drop(g);
        assert!(nodes.get(0, "r").is_none(), "cleaned up");
        // A key someone else holds is never overwritten.
        let g = x.try_lock("s", TTL).unwrap();
        nodes.del(0, "s");
        nodes.set_mode(1, Mode::Down);
        nodes.set_mode(2, Mode::Down);
        let other = client_over(&nodes, crate::testing::fake::settings());
        let theirs = other.try_lock("s", TTL);
        assert!(theirs.is_err(), "one node of three");
        nodes.set_mode(1, Mode::Up);
        nodes.set_mode(2, Mode::Up);
        crate::testing::fake::plant(&nodes, 0, "s", "someone-else", TTL);
        g.extend(TTL).expect("nodes 1 and 2");
        assert_eq!(nodes.get(0, "s").as_deref(), Some("someone-else"));
        assert_eq!(g.nodes_held(), 2);
        std::mem::forget(g);
    }

    /// An extension that fails without losing the lock (too few answers in
    /// time) says nothing about the copies: a held lock still reports the
    /// nodes of its last confirmed round, never fewer than a majority.
    #[test]
    fn a_failed_extension_leaves_nodes_held_as_last_confirmed() {
        let (x, nodes, _) = client(3);
        let g = x.try_lock("r", TTL).unwrap();
        nodes.set_mode(1, Mode::Down);
        nodes.set_mode(2, Mode::Down);
        assert!(matches!(g.extend(TTL), Err(Error::NoQuorum { .. })));
        assert!(g.is_held() && !g.is_lost());
        assert_eq!(g.nodes_held(), 3, "the copies were not found missing");
        nodes.set_mode(1, Mode::Up);
        nodes.set_mode(2, Mode::Up);
    }
}
