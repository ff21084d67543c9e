//! Leader election on the quorum: [`Election`] campaigns, a [`Leadership`]
//! is the lease a leader holds, [`Leader`] is what anyone reads of it.
//!
//! An election is a lock of its name, taken with a fencing token (the
//! term) and renewed by the client's renewal thread while the candidate
//! leads. Its token carries the candidate's id, in hex after an `@`, so that
//! anyone reading a majority of the nodes learns who leads.

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use parking_lot::Mutex;

use crate::algorithm::quorum;
use crate::algorithm::round::{candidate_hex, candidate_of};
use crate::clock::after;
use crate::error::{Error, InvalidInput};
use crate::events::LeadershipChange;
use crate::guard::{LockGuard, LostSignal};
use crate::lock::engine::Budget;
use crate::lock::transport::{Stored, Watch};
use crate::{NodeError, Redlock, Result};

/// How long a campaign waits at the nodes before it looks at
/// [`Election::stop`] again: a stopped campaign returns within about this
/// (and a round). Each slice begins with an attempt; in between, a
/// candidate tries when woken, at the lease's expiry, and by the clock
/// once per this (see the engine's waiter).
const STOP_CHECK: Duration = Duration::from_secs(1);

/// An election of one leader among candidates, over the lock of its name:
/// made by [`Redlock::election`], it campaigns for this process
/// ([`campaign`](Self::campaign), [`run`](Self::run)) and tells anyone who
/// leads ([`leader`](Self::leader), [`observe`](Self::observe)).
///
/// ```no_run
/// use std::time::Duration;
///
/// let locks = quorumlock::Redlock::builder()
///     .nodes(["redis://127.0.0.1:7001", "redis://127.0.0.1:7002", "redis://127.0.0.1:7003"])
///     .build()?;
/// let election = locks.election("reports", Duration::from_secs(10)).id("worker-7");
/// let leadership = election.campaign()?; // blocks until this process leads
/// println!("leading in term {}", leadership.term());
/// while leadership.is_leader() {
///     // one step of the leader's work, each write fenced by leadership.term()
/// #   break;
/// }
/// leadership.resign()?; // the next candidate is woken at once
/// # Ok::<(), quorumlock::Error>(())
/// ```
///
/// Cheap to clone; clones are one candidate, and [`stop`](Self::stop)
/// stops them all.
#[derive(Clone)]
pub struct Election {
    locks: Redlock,
    name: String,
    ttl: Duration,
    id: String,
    stop: Arc<Stop>,
}

impl fmt::Debug for Election {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Election")
            .field("name", &self.name)
            .field("ttl", &self.ttl)
            .field("id", &self.id)
            .field("stopped", &self.is_stopped())
            .finish()
    }
}

impl Redlock {
    /// An election of one leader for `name`, whose lease lasts `ttl` and is
    /// renewed while its holder leads (see [`Election`]). The candidate's
    /// id is the host's name and the process id (`host:1234`) until
    /// [`Election::id`] sets another.
    ///
    /// The election is the lock of `name`: a plain lock of the same name
    /// excludes it and is not a leader.
    pub fn election(&self, name: impl Into<String>, ttl: Duration) -> Election {
        Election {
            locks: self.clone(),
            name: name.into(),
            ttl,
            id: default_id(),
            stop: Arc::new(Stop::new()),
        }
    }
}

impl Election {
    /// Sets the candidate's id, which [`leader`](Self::leader) reports to
    /// anyone: 1 to [`MAX_ID_LEN`](crate::MAX_ID_LEN) bytes, any text
    /// (checked when it campaigns). Ids need not be unique; a term tells
    /// two leaders of one id apart.
    pub fn id(mut self, id: impl Into<String>) -> Self {
        self.id = id.into();
        self
    }

    /// The election's name: the lock's resource.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// This candidate's id.
    pub fn candidate(&self) -> &str {
        &self.id
    }

    /// Campaigns until this process leads: waits, woken by the leader's
    /// resignation on any node, or trying when its lease would expire, and
    /// goes on through node failures. Returns once elected, or with
    /// [`Error::Stopped`] once [`stop`](Self::stop) is called (within a
    /// second and a round).
    ///
    /// A waiting candidate sends an attempt when woken, when the leader's
    /// lease would expire as its last attempt read it (about once per two
    /// thirds of the TTL, as the leader renews), and otherwise about once a
    /// second. A candidate elected as it is stopped resigns at once.
    ///
    /// # Errors
    /// [`Error::Stopped`]; [`Error::InvalidInput`] for a bad name, TTL or id.
    pub fn campaign(&self) -> Result<Leadership> {
        self.campaign_until(None)
    }

    /// [`campaign`](Self::campaign) for at most `wait` (at least one
    /// attempt is made).
    ///
    /// # Errors
    /// As [`campaign`](Self::campaign); when `wait` ran out, the last
    /// attempt's error ([`Error::Taken`] where another candidate leads).
    pub fn campaign_for(&self, wait: Duration) -> Result<Leadership> {
        let until = after(self.locks.engine.clock.now(), wait);
        self.campaign_until(Some(until))
    }

    fn campaign_until(&self, until: Option<Instant>) -> Result<Leadership> {
        if self.id.is_empty() || self.id.len() > crate::MAX_ID_LEN {
            return Err(InvalidInput::BadCandidateId { len: self.id.len() }.into());
        }
        let engine = &self.locks.engine;
        let tag = candidate_hex(&self.id);
        // The name's subscription, kept from slice to slice (each slice's
        // call finds it, instead of subscribing again and trying twice).
        let mut subscribed = None;
        loop {
            if self.is_stopped() {
                return Err(Error::Stopped);
            }
            let now = engine.clock.now();
            let chunk = after(now, STOP_CHECK);
            let budget = Budget::Until(until.map_or(chunk, |u| u.min(chunk)));
            let request = self.locks.request(&self.name, self.ttl).candidate(&tag);
            match request.take(budget) {
                // Elected as it was stopped: it resigns at once.
                Ok(guard) if self.is_stopped() => {
                    drop(self.elected(guard));
                    return Err(Error::Stopped);
                }
                Ok(guard) => return Ok(self.elected(guard)),
                Err(e) if !e.is_retryable() => return Err(e),
                Err(e) if until.is_some_and(|u| engine.clock.now() >= u) => return Err(e),
                Err(_) if subscribed.is_none() && engine.settings.wake_ups => {
                    let confirm_by = after(engine.clock.now(), engine.settings.node_timeout);
                    subscribed = engine.transport.watch(&self.name, confirm_by);
                }
                Err(_) => {}
            }
        }
    }

    /// A campaign's lock, now a leader's lease, renewed.
    fn elected(&self, guard: LockGuard) -> Leadership {
        guard.auto_renew();
        let term = guard.fencing_token().unwrap_or(0);
        let engine = guard.engine();
        engine.leadership_event(guard.state(), LeadershipChange::Elected, None);
        log::debug!(
            "election {:?}: {:?} leads in term {term}",
            self.name,
            self.id
        );
        Leadership {
            guard: Some(guard),
            id: self.id.clone(),
            term,
            stop: self.stop.clone(),
        }
    }

    /// Who leads now, as a majority of the nodes store it: `None` where no
    /// candidate's lease is on a majority. Takes no lock and campaigns for
    /// nothing; each node is asked as [`Redlock::inspect`] asks it.
    ///
    /// A leader is reported once its term is recorded (by the round its
    /// campaign ends with): a candidate still being elected reads as none.
    ///
    /// ```no_run
    /// # use std::time::Duration;
    /// # let locks = quorumlock::Redlock::builder().node("redis://127.0.0.1:6379").build()?;
    /// match locks.election("reports", Duration::from_secs(10)).leader()? {
    ///     Some(leader) => println!("{} leads in term {}", leader.id(), leader.term()),
    ///     None => println!("no leader"),
    /// }
    /// # Ok::<(), quorumlock::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::NoQuorum`] when fewer than a majority of the nodes answered,
    /// or when a candidate's lease is on fewer than a majority of those that
    /// did but could be on a majority with those that did not;
    /// [`Error::InvalidInput`] for a bad name.
    pub fn leader(&self) -> Result<Option<Leader>> {
        let engine = &self.locks.engine;
        crate::lock::engine::validate_resource(&self.name)?;
        let found = engine
            .transport
            .inspect(&self.name, engine.settings.node_timeout);
        leader_of(&found, quorum::quorum(found.len()))
    }

    /// Follows the election: an iterator that blocks until the leader
    /// changes (another leader or term, none, or the nodes not answering)
    /// and yields what [`leader`](Self::leader) then reads, the first time
    /// at once. It ends once [`stop`](Self::stop) is called.
    ///
    /// It reads the nodes when woken by a resignation (where this client
    /// can subscribe to the name's releases) and at least every quarter of
    /// the TTL (between 10 ms and a second), sooner while no one leads.
    ///
    /// ```no_run
    /// # use std::time::Duration;
    /// # let locks = quorumlock::Redlock::builder().node("redis://127.0.0.1:6379").build()?;
    /// for leader in locks.election("reports", Duration::from_secs(10)).observe() {
    ///     match leader {
    ///         Ok(Some(l)) => println!("{} leads in term {}", l.id(), l.term()),
    ///         Ok(None) => println!("no leader"),
    ///         Err(e) => println!("cannot tell: {e}"),
    ///     }
    /// }
    /// # Ok::<(), quorumlock::Error>(())
    /// ```
    pub fn observe(&self) -> Observer {
        let every = (self.ttl / 4).clamp(Duration::from_millis(10), Duration::from_secs(1));
        Observer {
            election: self.clone(),
            last: None,
            watch: None,
            every,
            soon: None,
            woken: false,
            deaf_until: None,
        }
    }

    /// Leads whenever elected, until [`stop`](Self::stop): campaigns, runs
    /// `work` with the [`Leadership`], resigns when `work` returns, and
    /// campaigns again after a jittered back-off (the retry pause, doubling
    /// up to the TTL while terms end lost within a TTL of their start).
    ///
    /// `work` must return promptly once the leadership ends: check
    /// [`Leadership::is_leader`] before each step, or wait with
    /// [`Leadership::wait_end`]; both also see [`stop`](Self::stop).
    ///
    /// ```no_run
    /// # use std::time::Duration;
    /// # let locks = quorumlock::Redlock::builder().node("redis://127.0.0.1:6379").build()?;
    /// let election = locks.election("scheduler", Duration::from_secs(5)).id("host-a");
    /// let stopper = election.clone();
    /// std::thread::spawn(move || {
    ///     std::thread::sleep(Duration::from_secs(60));
    ///     stopper.stop(); // on shutdown
    /// });
    /// election.run(|leadership| {
    ///     while !leadership.wait_end(Duration::from_secs(1)) {
    ///         println!("term {}: scheduling", leadership.term());
    ///     }
    /// })?;
    /// # Ok::<(), quorumlock::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a bad name, TTL or id; `Ok` once stopped.
    pub fn run(&self, mut work: impl FnMut(&Leadership)) -> Result<()> {
        let engine = &self.locks.engine;
        let base = engine.settings.retry_delay.max(Duration::from_millis(1));
        let mut backoff = base;
        loop {
            let leadership = match self.campaign() {
                Ok(l) => l,
                Err(Error::Stopped) => return Ok(()),
                Err(e) => return Err(e),
            };
            let began = engine.clock.now();
            work(&leadership);
            let lost = leadership.guard().is_lost() || !leadership.guard().is_held();
            drop(leadership);
            let short = engine.clock.now().saturating_duration_since(began) < self.ttl;
            backoff = if lost && short {
                backoff.saturating_mul(2).min(self.ttl)
            } else {
                base
            };
            // Jittered: half to all of it.
            let pause = quorum::retry_delay(backoff * 3 / 4, backoff / 4, engine.rng.next_u64());
            if self.stop.sleep(&*engine.clock, pause) {
                return Ok(());
            }
        }
    }

    /// Stops this candidate: a campaign returns [`Error::Stopped`],
    /// [`run`](Self::run) returns once its `work` has, and an
    /// [`observe`](Self::observe) iterator ends. A leader of this election
    /// is no longer [`is_leader`](Leadership::is_leader), and
    /// [`wait_end`](Leadership::wait_end) returns: its lease is held until
    /// it resigns (or its `Leadership` drops). Clones stop together; it
    /// cannot be undone.
    pub fn stop(&self) {
        self.stop.stop();
    }

    /// Whether [`stop`](Self::stop) was called.
    pub fn is_stopped(&self) -> bool {
        self.stop.is_stopped()
    }
}

/// The default candidate id: `host:pid`.
fn default_id() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "host".to_owned());
    let mut id = format!("{host}:{}", std::process::id());
    if id.len() > crate::MAX_ID_LEN {
        let cut = (0..=crate::MAX_ID_LEN)
            .rev()
            .find(|&i| id.is_char_boundary(i))
            .unwrap_or(0);
        id.truncate(cut);
    }
    id
}

/// An election's stop: set once, seen by every clone and wait.
struct Stop {
    stopped: AtomicBool,
    /// Notified on stop: the loop's and the observer's sleeps, on the
    /// client's clock (the simulation's virtual one there).
    signal: Arc<crate::clock::Signal>,
    /// Dropped on stop: a leader's `wait_end` returns.
    tx: Mutex<Option<Sender<()>>>,
    ended: Receiver<()>,
}

impl Stop {
    fn new() -> Self {
        let (tx, ended) = crossbeam_channel::bounded(0);
        Stop {
            stopped: AtomicBool::new(false),
            signal: Arc::default(),
            tx: Mutex::new(Some(tx)),
            ended,
        }
    }

    fn stop(&self) {
        self.stopped.store(true, Ordering::Release);
        self.tx.lock().take();
        self.signal.notify();
    }

    fn is_stopped(&self) -> bool {
        self.stopped.load(Ordering::Acquire)
    }

    /// Sleeps `d` on `clock`, or less if stopped meanwhile: whether stopped.
    fn sleep(&self, clock: &dyn crate::clock::Clock, d: Duration) -> bool {
        let until = after(clock.now(), d);
        loop {
            let seen = self.signal.seen();
            if self.is_stopped() {
                return true;
            }
            if clock.now() >= until {
                return false;
            }
            clock.wait(&self.signal, seen, Some(until));
        }
    }
}

/// A leader's lease: held while this candidate leads, renewed in the
/// background, resigned when it drops ([`resign`](Self::resign) reports
/// the outcome). Made by [`Election::campaign`].
///
/// Check [`is_leader`](Self::is_leader) before each action that needs
/// leadership, and pass [`term`](Self::term) to storage that refuses a
/// lower one: a leader paused past its lease (a stop, a swap storm, a long
/// GC) reads `is_leader() == false` the moment it resumes, before its
/// renewal thread has run, but an action already past that check is
/// stopped only by the storage. See the fencing example in the guide.
pub struct Leadership {
    /// `None` once resigned.
    guard: Option<LockGuard>,
    id: String,
    term: u64,
    stop: Arc<Stop>,
}

impl fmt::Debug for Leadership {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Leadership")
            .field("name", &self.name())
            .field("id", &self.id)
            .field("term", &self.term)
            .field("leader", &self.is_leader())
            .finish()
    }
}

impl Leadership {
    fn guard(&self) -> &LockGuard {
        // Only `resign` and `drop` take it, and both consume `self`.
        self.guard.as_ref().unwrap_or_else(|| unreachable!())
    }

    /// The term: the lease's fencing token, strictly greater than every
    /// earlier leader's term of this election (under the guarantees of
    /// [`LockGuard::fencing_token`]). Pass it with every write the leader
    /// makes, to storage that refuses a term lower than the last it saw.
    pub fn term(&self) -> u64 {
        self.term
    }

    /// This leader's candidate id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The election's name.
    pub fn name(&self) -> &str {
        self.guard().resource()
    }

    /// Whether this process may act as the leader now: the lease is valid
    /// (by this process's monotonic clock, whatever the renewal thread has
    /// seen), not found lost, and the election not
    /// [stopped](Election::stop).
    pub fn is_leader(&self) -> bool {
        self.guard().is_held() && !self.stop.is_stopped()
    }

    /// How long the lease may still be assumed held.
    pub fn validity(&self) -> Duration {
        self.guard().validity()
    }

    /// The monotonic instant until which the lease may be assumed held;
    /// moves forward with each renewal.
    pub fn deadline(&self) -> Instant {
        self.guard().deadline()
    }

    /// A signal of the lease's loss, to watch from any thread (see
    /// [`LockGuard::lost`]).
    pub fn lost(&self) -> LostSignal {
        self.guard().lost()
    }

    /// Waits up to `timeout` for the leadership to end: the lease lost or
    /// run out, or the election [stopped](Election::stop). Whether it has
    /// ended (then [`is_leader`](Self::is_leader) is `false`).
    pub fn wait_end(&self, timeout: Duration) -> bool {
        let guard = self.guard();
        let engine = &guard.engine();
        let until = after(engine.clock.now(), timeout).min(guard.deadline());
        let wait = until.saturating_duration_since(engine.clock.now());
        if self.is_leader() && !wait.is_zero() {
            crossbeam_channel::select! {
                recv(guard.state().ended()) -> _ => {},
                recv(self.stop.ended) -> _ => {},
                default(wait) => {},
            }
        }
        !self.is_leader()
    }

    /// Resigns: releases the lease on every node, which wakes the waiting
    /// candidates at once. Dropping the `Leadership` does the same.
    ///
    /// # Errors
    /// As [`LockGuard::release`]: the lease had already run out or been
    /// taken, or too many nodes failed (the lease then expires by its TTL).
    pub fn resign(mut self) -> Result<()> {
        match self.guard.take() {
            Some(g) => g.release(),
            None => Ok(()),
        }
    }
}

/// A leader as a majority of the nodes store it ([`Election::leader`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Leader {
    id: String,
    term: u64,
    nodes: usize,
    ttl: Duration,
}

impl Leader {
    /// Its candidate id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Its term (see [`Election::leader`] on a leader still being elected).
    pub fn term(&self) -> u64 {
        self.term
    }

    /// How many nodes hold its lease.
    pub fn nodes(&self) -> usize {
        self.nodes
    }

    /// How long its lease lasts on a majority, unless renewed: the
    /// majority's shortest time to live.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }
}

/// Who leads, from what each node stores for the election's name: the
/// candidate whose token (one lineage) a `quorum` of nodes hold with time
/// to live, and whose term one of them recorded with that token; `None`
/// where none does.
pub(crate) fn leader_of(
    found: &[std::result::Result<Option<Stored>, NodeError>],
    quorum: usize,
) -> Result<Option<Leader>> {
    // Who leads cannot be told: `agreed` nodes said so, and these failed.
    let cannot_tell = |agreed| Error::NoQuorum {
        agreed,
        quorum,
        failures: found.iter().filter_map(|r| r.clone().err()).collect(),
    };
    let answered = found.iter().filter(|r| r.is_ok()).count();
    if answered < quorum {
        return Err(cannot_tell(answered));
    }
    let lineage = |v: &str| v.split('.').next().unwrap_or(v).to_owned();
    let held: Vec<&Stored> = found
        .iter()
        .filter_map(|r| r.as_ref().ok()?.as_ref())
        .filter(|s| s.lock && s.ttl.is_some_and(|t| !t.is_zero()))
        .collect();
    for s in &held {
        let Some(id) = candidate_of(&s.value) else {
            continue;
        };
        let mine: Vec<&&Stored> = held
            .iter()
            .filter(|o| lineage(&o.value) == lineage(&s.value))
            .collect();
        // Held on fewer than a majority of the nodes that answered, but
        // perhaps on the ones that did not: no one can tell.
        let unanswered = found.len() - answered;
        if mine.len() < quorum && mine.len() + unanswered >= quorum {
            return Err(cannot_tell(mine.len()));
        }
        // The term, where recorded with the token held: a majority holding
        // it and the majority its write-back reached share a node.
        let term = mine
            .iter()
            .filter_map(|o| o.term.as_ref().filter(|(_, t)| *t == o.value))
            .map(|(t, _)| *t)
            .max();
        let (Some(term), true) = (term, mine.len() >= quorum) else {
            continue;
        };
        let mut ttls: Vec<Duration> = mine.iter().filter_map(|o| o.ttl).collect();
        ttls.sort_unstable_by(|a, b| b.cmp(a));
        return Ok(Some(Leader {
            id,
            term,
            nodes: mine.len(),
            ttl: ttls.get(quorum - 1).copied().unwrap_or_default(),
        }));
    }
    Ok(None)
}

/// Follows an election ([`Election::observe`]): yields the leader each time
/// it changes.
pub struct Observer {
    election: Election,
    /// What was yielded last (`Err(())`: the nodes did not answer).
    last: Option<std::result::Result<Option<(String, u64)>, ()>>,
    watch: Option<Box<dyn Watch>>,
    every: Duration,
    /// While no one leads: the next, shorter, pause (doubling to `every`).
    soon: Option<Duration>,
    /// Whether the coming reading was woken by a message.
    woken: bool,
    /// Until when messages wake no reading (one woke a reading that found
    /// nothing changed).
    deaf_until: Option<Instant>,
}

impl fmt::Debug for Observer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Observer")
            .field("election", &self.election.name)
            .field("every", &self.every)
            .finish()
    }
}

impl Observer {
    /// Waits up to `timeout` for the leader to change: what it now is, or
    /// `None` if it did not change (or the election was stopped).
    pub fn next_within(&mut self, timeout: Duration) -> Option<Result<Option<Leader>>> {
        let engine = self.election.locks.engine.clone();
        let until = after(engine.clock.now(), timeout);
        loop {
            if self.election.is_stopped() {
                return None;
            }
            if self.last.is_none() && engine.settings.wake_ups {
                let confirm_by = after(engine.clock.now(), engine.settings.node_timeout);
                self.watch = engine.transport.watch(&self.election.name, confirm_by);
            }
            if let Some(w) = self.watch.as_mut() {
                w.mark();
            }
            let now = self.election.leader();
            let seen = match &now {
                Ok(l) => Ok(l.as_ref().map(|l| (l.id.clone(), l.term))),
                Err(_) => Err(()),
            };
            self.soon = match &seen {
                Ok(None) => Some(
                    self.soon
                        .map_or(Duration::from_millis(10), |s| s.saturating_mul(2))
                        .min(self.every),
                ),
                _ => None,
            };
            let changed = self.last.as_ref() != Some(&seen);
            let at = engine.clock.now();
            // Woken for nothing: a message is a hint anyone can send, and
            // a stream of them must not drive reads of every node. Deaf
            // to them until the next reading by the clock.
            if std::mem::take(&mut self.woken) && !changed {
                self.deaf_until = Some(after(at, self.every));
            }
            if changed {
                self.last = Some(seen);
                return Some(now);
            }
            let pause_until = after(at, self.soon.unwrap_or(self.every)).min(until);
            if at >= until {
                return None;
            }
            let woken = match &self.watch {
                Some(w) if self.deaf_until.is_none_or(|d| at >= d) => w.wait(pause_until),
                _ => self
                    .election
                    .stop
                    .sleep(&*engine.clock, pause_until.saturating_duration_since(at)),
            };
            if woken && !self.election.is_stopped() {
                // A resignation: the next leader takes a round or so.
                self.soon = Some(Duration::from_millis(10));
                self.woken = true;
            }
        }
    }
}

impl Iterator for Observer {
    type Item = Result<Option<Leader>>;

    /// Blocks until the leader changes; `None` once the election is stopped.
    fn next(&mut self) -> Option<Self::Item> {
        loop {
            if self.election.is_stopped() {
                return None;
            }
            if let Some(change) = self.next_within(Duration::from_secs(3600)) {
                return Some(change);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::round::is_token;
    use crate::error::NodeErrorKind;

    const RANDOM: &str = "0123456789abcdef0123456789abcdef";

    fn token(id: &str) -> String {
        format!("{RANDOM}@{}", candidate_hex(id))
    }

    /// A copy of `value` with its term recorded with it.
    fn held(value: &str, ttl_ms: u64, term: u64) -> std::result::Result<Option<Stored>, NodeError> {
        Ok(Some(Stored {
            lock: true,
            value: value.to_owned(),
            ttl: Some(Duration::from_millis(ttl_ms)),
            readers: None,
            claim: false,
            term: Some((term, value.to_owned())),
        }))
    }

    /// A copy with no term recorded with it: restored by a renewal on a
    /// node restarted empty, or one the write-back did not reach; `term`:
    /// another candidate's record there, or none.
    fn bare(
        value: &str,
        term: Option<(u64, &str)>,
    ) -> std::result::Result<Option<Stored>, NodeError> {
        let mut s = held(value, 900, 0)?.unwrap_or_else(|| unreachable!());
        s.term = term.map(|(t, v)| (t, v.to_owned()));
        Ok(Some(s))
    }

    fn failed() -> std::result::Result<Option<Stored>, NodeError> {
        Err(NodeError::new("n", NodeErrorKind::Timeout, "timed out"))
    }

    #[test]
    fn a_candidates_token_carries_its_id_and_is_a_lock_token() {
        for id in [
            "worker-7",
            "host.example.com:80",
            "a@b.c",
            "é",
            &"x".repeat(crate::MAX_ID_LEN),
        ] {
            let t = token(id);
            assert!(is_token(&t), "{t}");
            assert_eq!(candidate_of(&t).as_deref(), Some(id));
            // A handed-over section keeps its lineage, and so its id.
            let section = crate::clock::section_token(&t);
            assert!(is_token(&section));
            assert_eq!(candidate_of(&section).as_deref(), Some(id));
        }
        assert_eq!(candidate_of(RANDOM), None);
        let too_long = format!(
            "{RANDOM}@{}",
            candidate_hex(&"x".repeat(crate::MAX_ID_LEN + 1))
        );
        for bad in [
            format!("{RANDOM}@"),
            format!("{RANDOM}@abc"),
            format!("{RANDOM}@zz"),
            format!("{RANDOM}@ff"),
            too_long,
        ] {
            assert!(!is_token(&bad), "{bad}");
            assert_eq!(candidate_of(&bad), None, "{bad}");
        }
    }

    #[test]
    fn the_leader_is_the_candidate_a_majority_holds_with_its_term() {
        let (a, b) = (token("a"), token("b"));
        // Terms recorded with the tokens held; the shortest TTL of the
        // majority.
        let found = [held(&a, 900, 7), held(&a, 500, 7), held(&b, 900, 3)];
        let l = leader_of(&found, 2).expect("answered").expect("a leads");
        assert_eq!(
            (l.id(), l.term(), l.nodes(), l.ttl()),
            ("a", 7, 2, Duration::from_millis(500))
        );
        // The lease on 2 of 3 but one copy expired: no majority.
        let expired = Ok(Some(Stored {
            ttl: Some(Duration::ZERO),
            ..held(&a, 1, 7).unwrap().unwrap()
        }));
        assert_eq!(
            leader_of(&[held(&a, 900, 7), expired, Ok(None)], 2).expect("answered"),
            None
        );
        // A plain lock of the name leads nothing.
        assert_eq!(
            leader_of(&[held(RANDOM, 900, 1), held(RANDOM, 900, 1), Ok(None)], 2)
                .expect("answered"),
            None
        );
        // Split: none.
        assert_eq!(
            leader_of(&[held(&a, 900, 7), held(&b, 900, 8), Ok(None)], 2).expect("answered"),
            None
        );
        // A copy restored on a node restarted empty: no term of its own
        // there, and the counter another candidate's undone attempt left;
        // the term is the one recorded with the token elsewhere.
        let l = leader_of(&[held(&a, 900, 7), bare(&a, Some((99, &b))), Ok(None)], 2)
            .expect("answered")
            .expect("a leads");
        assert_eq!((l.id(), l.term(), l.nodes()), ("a", 7, 2));
        // Still being elected (no term recorded with the token): none yet.
        assert_eq!(
            leader_of(&[bare(&a, Some((5, &b))), bare(&a, None), Ok(None)], 2).expect("answered"),
            None
        );
        // Too few answers to tell.
        let r = leader_of(&[held(&a, 900, 7), failed(), failed()], 2);
        assert!(
            matches!(r, Err(Error::NoQuorum { agreed: 1, quorum: 2, ref failures }) if failures.len() == 2),
            "{r:?}"
        );
        // A lease on 1 of the 2 that answered, the third silent: it may
        // lead there; no one can tell.
        let r = leader_of(&[held(&a, 900, 7), Ok(None), failed()], 2);
        assert!(matches!(r, Err(Error::NoQuorum { agreed: 1, .. })), "{r:?}");
        // Two answers of a lease: enough.
        assert!(
            leader_of(&[held(&a, 900, 7), held(&a, 900, 7), failed()], 2)
                .expect("answered")
                .is_some()
        );
    }
}
