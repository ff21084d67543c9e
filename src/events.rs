//! Event hooks for metrics and traces: [`EventHandler`], given to
//! [`Builder::events`](crate::Builder::events).
//!
//! Handlers run on the thread that did the work (a caller's thread, the
//! renewal thread, a node's background thread), after the round, holding
//! none of the client's mutexes (`on_release` runs after the releasing
//! thread left the local queue; a successful `on_attempt` runs in the
//! thread that now holds the lock). Events borrow what the round produced, so a
//! client without a handler pays nothing and a no-op handler next to
//! nothing (`cargo bench --bench cycle` measures both).

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::algorithm::round::{Answer, NodeResult};
use crate::error::{Error, NodeErrorKind};

/// Receives what the client does. Every method has a no-op default:
/// implement those you need.
///
/// Keep handlers quick (bump a counter, record into a histogram, send on a
/// channel): they run on the client's threads, and a slow one delays the
/// caller or the renewal of every lock. A panic in a handler is caught and
/// logged at error level; the event is dropped and the client goes on (a
/// panic on the renewal thread would otherwise stop every lock's renewal).
///
/// ```
/// use std::sync::atomic::{AtomicU64, Ordering};
/// use quorumlock::{AttemptEvent, EventHandler};
///
/// #[derive(Default)]
/// struct Counters {
///     acquired: AtomicU64,
///     refused: AtomicU64,
/// }
///
/// impl EventHandler for Counters {
///     fn on_attempt(&self, event: &AttemptEvent<'_>) {
///         let counter = if event.acquired() { &self.acquired } else { &self.refused };
///         counter.fetch_add(1, Ordering::Relaxed);
///     }
/// }
///
/// let counters = std::sync::Arc::new(Counters::default());
/// let builder = quorumlock::Redlock::builder()
///     .nodes(["redis://127.0.0.1:7001"])
///     .events(counters.clone());
/// # let _ = builder;
/// ```
pub trait EventHandler: Send + Sync + 'static {
    /// An attempt to acquire a lock ended (each attempt of `lock()`'s
    /// retries, a hand-over between threads of this process included).
    fn on_attempt(&self, event: &AttemptEvent<'_>) {
        let _ = event;
    }

    /// A call to take a lock returned: with the lock, or with the error its
    /// caller got. One per call whose input was accepted, after the
    /// `on_attempt` of its last attempt (where it made one).
    fn on_acquire(&self, event: &AcquireEvent<'_>) {
        let _ = event;
    }

    /// An extension ended: a renewal by the renewal thread, or a call to
    /// [`LockGuard::extend`](crate::LockGuard::extend).
    fn on_renewal(&self, event: &RenewalEvent<'_>) {
        let _ = event;
    }

    /// A held lock was found lost (expired before its renewal, or no longer
    /// holding our token on a majority).
    fn on_lost(&self, event: &LostEvent<'_>) {
        let _ = event;
    }

    /// A lock was released (explicitly, on drop, or by `run`).
    fn on_release(&self, event: &ReleaseEvent<'_>) {
        let _ = event;
    }

    /// A candidate of an [`Election`](crate::Election) was elected, lost
    /// its lease, or resigned. (Its lock's own events come too: the
    /// attempt, the renewals, the loss or the release.)
    fn on_leadership(&self, event: &LeadershipEvent<'_>) {
        let _ = event;
    }

    /// A node's state changed: rounds stopped waiting for it, it answers
    /// again, or the delayed-restart rule holds its votes back.
    fn on_node(&self, event: &NodeEvent<'_>) {
        let _ = event;
    }
}

/// The handler a client was built with, if any.
#[derive(Clone, Default)]
pub(crate) struct Events(pub Option<Arc<dyn EventHandler>>);

impl fmt::Debug for Events {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.0.is_some() { "Some(..)" } else { "None" })
    }
}

impl Events {
    /// The handler, when there is one.
    #[inline]
    pub(crate) fn get(&self) -> Option<PanicSafe<'_>> {
        self.0.as_deref().map(PanicSafe)
    }
}

/// The user's handler, each call guarded against its panics.
#[derive(Clone, Copy)]
pub(crate) struct PanicSafe<'a>(&'a dyn EventHandler);

impl PanicSafe<'_> {
    fn call(&self, what: &str, f: impl FnOnce()) {
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).is_err() {
            log::error!("event handler panicked in {what}; event dropped, the client goes on");
        }
    }

    pub(crate) fn on_attempt(&self, e: &AttemptEvent<'_>) {
        self.call("on_attempt", || self.0.on_attempt(e));
    }

    pub(crate) fn on_acquire(&self, e: &AcquireEvent<'_>) {
        self.call("on_acquire", || self.0.on_acquire(e));
    }

    pub(crate) fn on_renewal(&self, e: &RenewalEvent<'_>) {
        self.call("on_renewal", || self.0.on_renewal(e));
    }

    pub(crate) fn on_lost(&self, e: &LostEvent<'_>) {
        self.call("on_lost", || self.0.on_lost(e));
    }

    pub(crate) fn on_release(&self, e: &ReleaseEvent<'_>) {
        self.call("on_release", || self.0.on_release(e));
    }

    pub(crate) fn on_leadership(&self, e: &LeadershipEvent<'_>) {
        self.call("on_leadership", || self.0.on_leadership(e));
    }

    pub(crate) fn on_node(&self, e: &NodeEvent<'_>) {
        self.call("on_node", || self.0.on_node(e));
    }
}

/// What one node answered in a round, for one lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum NodeOutcome {
    /// It did what was asked: set the key, extended or deleted it.
    Agreed,
    /// The key holds another owner's token.
    HeldByOther,
    /// The key was not there (expired, or deleted).
    Missing,
    /// The key was not there, and the extension set it again with our
    /// token: a copy restored (on a node that restarted empty, evicted it,
    /// or never got the acquisition's `SET`), not a vote.
    Restored,
    /// No useful answer; the kind says why (a timeout, a skipped node, a
    /// vote held back by the restart rule, …).
    Failed(NodeErrorKind),
}

/// Per-node outcomes of one round, for one lock, in the builder's node order.
#[derive(Clone, Copy)]
pub struct Nodes<'a> {
    names: &'a [String],
    results: &'a [NodeResult],
    index: usize,
}

impl<'a> Nodes<'a> {
    pub(crate) fn new(names: &'a [String], results: &'a [NodeResult], index: usize) -> Self {
        Nodes {
            names,
            results,
            index,
        }
    }

    /// Each node's address (`host:port`, no credentials) and outcome. Empty
    /// when no round was sent: the lock had already expired, or an unfenced
    /// local hand-over needed none (see [`LockGuard::section`](crate::LockGuard::section)).
    pub fn iter(&self) -> impl Iterator<Item = (&'a str, NodeOutcome)> + 'a {
        let index = self.index;
        self.names
            .iter()
            .zip(self.results)
            .map(move |(name, r)| (name.as_str(), outcome(r, index)))
    }

    /// How many nodes answered [`NodeOutcome::Agreed`].
    pub fn agreed(&self) -> usize {
        self.iter()
            .filter(|(_, o)| *o == NodeOutcome::Agreed)
            .count()
    }

    /// How many nodes hold the key with our token after the round: those
    /// that agreed and those where it was restored (for an acquisition,
    /// votes held back by the restart rule are failures here, though their
    /// copy was set; see [`LockGuard::nodes_held`](crate::LockGuard::nodes_held)).
    pub fn held(&self) -> usize {
        self.iter()
            .filter(|(_, o)| matches!(o, NodeOutcome::Agreed | NodeOutcome::Restored))
            .count()
    }
}

impl fmt::Debug for Nodes<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

fn outcome(r: &NodeResult, index: usize) -> NodeOutcome {
    match r {
        Ok(reply) => match reply.answers.get(index) {
            Some(Answer::Ok) => NodeOutcome::Agreed,
            Some(Answer::Other) => NodeOutcome::HeldByOther,
            Some(Answer::Absent) => NodeOutcome::Missing,
            Some(Answer::Restored) => NodeOutcome::Restored,
            None => NodeOutcome::Failed(NodeErrorKind::Protocol),
        },
        Err(e) => NodeOutcome::Failed(e.kind()),
    }
}

/// An acquire attempt ended.
#[derive(Debug)]
pub struct AttemptEvent<'a> {
    pub(crate) resource: &'a str,
    pub(crate) section: u64,
    pub(crate) elapsed: Duration,
    pub(crate) outcome: Result<Duration, &'a Error>,
    pub(crate) nodes: Nodes<'a>,
    pub(crate) begun: Begun,
}

/// What an attempt followed: how long its call had waited, and whether a
/// release woke it.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Begun {
    pub waited: Duration,
    pub woken: bool,
}

impl<'a> AttemptEvent<'a> {
    /// The resource asked for.
    pub fn resource(&self) -> &'a str {
        self.resource
    }

    /// The critical section's number ([`LockGuard::section`](crate::LockGuard::section)).
    pub fn section(&self) -> u64 {
        self.section
    }

    /// From the start of the attempt to the decision (a fenced lock's write-back
    /// included).
    pub fn elapsed(&self) -> Duration {
        self.elapsed
    }

    /// Whether the lock was acquired.
    pub fn acquired(&self) -> bool {
        self.outcome.is_ok()
    }

    /// The validity the lock was acquired with.
    pub fn validity(&self) -> Option<Duration> {
        self.outcome.ok()
    }

    /// Why the attempt failed.
    pub fn error(&self) -> Option<&'a Error> {
        self.outcome.err()
    }

    /// What each node answered (after the delayed-restart rule).
    pub fn nodes(&self) -> Nodes<'a> {
        self.nodes
    }

    /// How long the call had been waiting when this attempt began: zero
    /// for its first attempt, and for a lock handed over by a thread of
    /// this process.
    pub fn waited(&self) -> Duration {
        self.begun.waited
    }

    /// Whether this attempt was made because a release woke it (another
    /// client's release of the resource, by pub/sub), rather than after its
    /// fallback (the retry pause, or the owner's expiry where sooner) or as
    /// the call's first.
    pub fn woken(&self) -> bool {
        self.begun.woken
    }
}

/// A call to take a lock returned ([`EventHandler::on_acquire`]): what its
/// caller saw, where [`AttemptEvent`]s tell of each of its attempts.
#[derive(Debug)]
pub struct AcquireEvent<'a> {
    pub(crate) resource: &'a str,
    pub(crate) waited: Duration,
    pub(crate) attempts: u32,
    pub(crate) outcome: Result<(), &'a Error>,
}

impl<'a> AcquireEvent<'a> {
    /// The resource asked for (the first of a lock of several).
    pub fn resource(&self) -> &'a str {
        self.resource
    }

    /// From the call to its return: its attempts, the waits between them,
    /// and its wait for a turn behind threads of this process that held or
    /// wanted the lock.
    pub fn waited(&self) -> Duration {
        self.waited
    }

    /// The rounds at the nodes it made: zero for a lock taken over from a
    /// thread of this process (which [`on_attempt`](EventHandler::on_attempt)
    /// still tells of, as a hand-over, with no node asked), or a wait that
    /// ended behind one. So the sum over calls can be far below the number
    /// of [`AttemptEvent`]s where threads of one process hand a lock on.
    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    /// Whether the call returned the lock.
    pub fn acquired(&self) -> bool {
        self.outcome.is_ok()
    }

    /// Why it did not: its caller's error (of its last attempt, or
    /// [`Error::Taken`] where a thread of this process held the lock
    /// through the whole wait).
    pub fn error(&self) -> Option<&'a Error> {
        self.outcome.err()
    }
}

/// An extension ended.
#[derive(Debug)]
pub struct RenewalEvent<'a> {
    pub(crate) resource: &'a str,
    pub(crate) section: u64,
    pub(crate) automatic: bool,
    pub(crate) left: Duration,
    pub(crate) elapsed: Duration,
    pub(crate) outcome: Result<Duration, &'a Error>,
    pub(crate) nodes: Nodes<'a>,
}

impl<'a> RenewalEvent<'a> {
    /// The lock's resource.
    pub fn resource(&self) -> &'a str {
        self.resource
    }

    /// The critical section's number ([`LockGuard::section`](crate::LockGuard::section)).
    pub fn section(&self) -> u64 {
        self.section
    }

    /// True for the renewal thread's extensions, false for
    /// [`LockGuard::extend`](crate::LockGuard::extend).
    pub fn is_automatic(&self) -> bool {
        self.automatic
    }

    /// The validity the lock had left when the extension began (zero where
    /// it had run out): how close to its expiry the renewal came. A renewal
    /// thread that falls behind (slow nodes, a slow handler, a long batch)
    /// shows as this shrinking.
    pub fn left(&self) -> Duration {
        self.left
    }

    /// The round's duration (shared by the locks renewed together).
    pub fn elapsed(&self) -> Duration {
        self.elapsed
    }

    /// The validity left after it, when it succeeded.
    pub fn validity(&self) -> Option<Duration> {
        self.outcome.ok()
    }

    /// Why it failed.
    pub fn error(&self) -> Option<&'a Error> {
        self.outcome.err()
    }

    /// What each node answered for this lock.
    pub fn nodes(&self) -> Nodes<'a> {
        self.nodes
    }
}

/// A held lock was lost.
#[derive(Debug)]
pub struct LostEvent<'a> {
    pub(crate) resource: &'a str,
    pub(crate) section: u64,
    pub(crate) error: &'a Error,
    pub(crate) held: Duration,
}

impl<'a> LostEvent<'a> {
    /// The lock's resource.
    pub fn resource(&self) -> &'a str {
        self.resource
    }

    /// The critical section's number ([`LockGuard::section`](crate::LockGuard::section)).
    pub fn section(&self) -> u64 {
        self.section
    }

    /// How it was found lost ([`Error::Expired`], [`Error::NotOwner`]).
    pub fn error(&self) -> &'a Error {
        self.error
    }

    /// From the start of its acquisition to the loss.
    pub fn held(&self) -> Duration {
        self.held
    }
}

/// What happened to a candidate's leadership ([`LeadershipEvent::change`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum LeadershipChange {
    /// It was elected: its campaign took the lease.
    Elected,
    /// It lost its lease while leading, or its lease had run out or was
    /// gone when it resigned ([`LeadershipEvent::error`] says how).
    Lost,
    /// It resigned ([`Leadership::resign`](crate::Leadership::resign), or
    /// its `Leadership` dropped).
    Resigned,
}

/// A candidate of an [`Election`](crate::Election) was elected, lost its
/// lease, or resigned.
#[derive(Debug)]
pub struct LeadershipEvent<'a> {
    pub(crate) name: &'a str,
    pub(crate) id: &'a str,
    pub(crate) term: u64,
    pub(crate) change: LeadershipChange,
    pub(crate) error: Option<&'a Error>,
}

impl<'a> LeadershipEvent<'a> {
    /// The election's name.
    pub fn name(&self) -> &'a str {
        self.name
    }

    /// The candidate's id ([`Election::id`](crate::Election::id)).
    pub fn id(&self) -> &'a str {
        self.id
    }

    /// Its term ([`Leadership::term`](crate::Leadership::term)).
    pub fn term(&self) -> u64 {
        self.term
    }

    /// What happened.
    pub fn change(&self) -> LeadershipChange {
        self.change
    }

    /// For [`LeadershipChange::Lost`], how it was found lost
    /// ([`Error::Expired`], [`Error::NotOwner`]); else `None`.
    pub fn error(&self) -> Option<&'a Error> {
        self.error
    }
}

/// A lock was released.
#[derive(Debug)]
pub struct ReleaseEvent<'a> {
    pub(crate) resource: &'a str,
    pub(crate) section: u64,
    pub(crate) held: Duration,
    pub(crate) outcome: Result<(), &'a Error>,
    pub(crate) nodes: Nodes<'a>,
}

impl<'a> ReleaseEvent<'a> {
    /// The lock's resource.
    pub fn resource(&self) -> &'a str {
        self.resource
    }

    /// The critical section's number ([`LockGuard::section`](crate::LockGuard::section)).
    pub fn section(&self) -> u64 {
        self.section
    }

    /// From the start of its acquisition to the release.
    pub fn held(&self) -> Duration {
        self.held
    }

    /// Why the release did not confirm the lock was held to the end
    /// ([`Error::Expired`], [`Error::NotOwner`], [`Error::NoQuorum`]).
    pub fn error(&self) -> Option<&'a Error> {
        self.outcome.err()
    }

    /// What each node answered.
    pub fn nodes(&self) -> Nodes<'a> {
        self.nodes
    }
}

/// A node's state changed.
#[derive(Debug)]
pub struct NodeEvent<'a> {
    pub(crate) node: &'a str,
    pub(crate) change: NodeChange,
}

impl<'a> NodeEvent<'a> {
    /// The node's address (`host:port`, no credentials).
    pub fn node(&self) -> &'a str {
        self.node
    }

    /// What changed.
    pub fn change(&self) -> NodeChange {
        self.change
    }
}

/// How a node's state changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum NodeChange {
    /// It refused a connection or let a command time out: rounds no longer
    /// wait for it (its vote counts as failed, and it is sent a trial
    /// command at most every 100 ms).
    Skipped {
        /// True when it refused (connection refused, failed handshake),
        /// false when it did not answer in time.
        refused: bool,
    },
    /// It answered again: rounds wait for it again.
    Rejoined,
    /// Its lock history is younger than the longest TTL in use (it is new,
    /// or restarted and lost its data): the delayed-restart rule holds its
    /// acquire votes back.
    HeldBack {
        /// When its votes count again, as of this event.
        votes_in: Duration,
    },
    /// The hold is over: its votes count again.
    HoldOver,
}
