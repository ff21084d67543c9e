//! The boundary between the lock engine and the nodes.
//!
//! The engine speaks only the [`Transport`] trait; the Redis driver
//! ([`crate::driver::node`]) and the test doubles implement it, as redsync
//! keeps `mutex.go` apart from its drivers.

use std::time::{Duration, Instant};

use crate::algorithm::round::{Key, NodeResult, Op};
use crate::algorithm::server::ServerInfo;
use crate::error::NodeError;

/// Tells a round, from the results so far (`None`: not read yet), how many
/// more replies it needs at least before its outcome is known: 0 when it
/// is (the remaining replies need not be waited for). The round is not
/// woken for fewer.
pub(crate) type Decided<'a> = &'a dyn Fn(&[Option<NodeResult>]) -> usize;

/// What an acquire round's caller decided, for what the transport does after
/// the round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AfterRound {
    /// The attempt failed: every key must be deleted again wherever the
    /// write may have landed, on the same connections (so that the delete
    /// reaches a node after the SET it undoes).
    Undo,
    /// The lock was granted: a healthy node the round did not reach (no
    /// connection was free in time) is sent the write after the round, as a
    /// late reply would land, so that the lock lives on every node it can.
    Complete,
    /// Nothing more to do.
    Done,
}

/// Called with an acquire round's results: what to do next.
pub(crate) type Undo<'a> = &'a dyn Fn(&[NodeResult]) -> AfterRound;

/// One thread's wait for a resource to be freed by another client (see
/// [`crate::driver::notify`]): a hint to try again, never a grant.
pub(crate) trait Watch: Send {
    /// Marks the wake-ups so far (before an attempt): [`wait`](Self::wait)
    /// waits past them.
    fn mark(&mut self);
    /// Waits until a wake-up after the mark (of a key listened to), or
    /// `until`; whether one came.
    fn wait(&self, until: Instant) -> bool;
    /// A wait for several keys listens from now on only to the keys marked
    /// `true` in `keys` (in the order watched): a release of a key its last
    /// try found free cannot be what it waits for. A wait for one key
    /// always listens.
    fn listen_to(&mut self, keys: &[bool]);
    /// After [`wait`](Self::wait) said a wake-up came: whether every
    /// wake-up since the mark was a release's copy that made its majority
    /// after a try began (the try before it read the owners before that
    /// release freed the key on a majority: meeting the same owners said
    /// nothing of its message).
    fn again(&self) -> bool;
}

/// Access to the N nodes.
pub(crate) trait Transport: Send + Sync + 'static {
    /// Display names of the nodes (no credentials), in node order.
    fn node_names(&self) -> &[String];

    /// Runs `op` for every key on every node at once and returns one result
    /// per node, in node order. Returns by `deadline` (give or take a
    /// scheduling quantum), and earlier once `decided` says the outcome is
    /// known: nodes that have not answered then count as timed out. With
    /// `undo` (acquire rounds), releases the keys when it says so.
    fn run(
        &self,
        op: Op,
        keys: &[Key<'_>],
        deadline: Instant,
        decided: Option<Decided<'_>>,
        undo: Option<Undo<'_>>,
    ) -> Vec<NodeResult>;

    /// Subscribes to `resource`'s releases, waiting until `confirm_by` at
    /// most for the nodes to confirm. `None`: not supported (doubles, the
    /// simulation) or no room: the caller polls.
    fn watch(&self, resource: &str, confirm_by: Instant) -> Option<Box<dyn Watch>>;

    /// [`watch`](Self::watch) for every one of `resources` at once (a lock
    /// of several): woken by a release of any. `None`: not supported (the
    /// simulation's sets poll) or no room.
    fn watch_all(&self, resources: &[&str], confirm_by: Instant) -> Option<Box<dyn Watch>>;

    /// [`watch`](Self::watch), only where `resource` is subscribed already
    /// (then without waiting).
    fn watch_existing(&self, resource: &str) -> Option<Box<dyn Watch>>;

    /// This client is about to release `resource` with `notice`: its own
    /// message wakes none of its waiters.
    fn releasing(&self, resource: &str, notice: u64);

    /// This client's release of `resources` ended: its own waiters for
    /// locks of several resources, which no local queue serves, try again.
    fn released(&self, resources: &[&str]);

    /// Per node, whether this client's own subscriber listens to
    /// `resource`'s releases there (a release's subscriber count includes
    /// it then); empty when it does not listen.
    fn watching(&self, resource: &str) -> Vec<bool>;

    /// Per node, the key of the lock history that had begun on it when a
    /// connection to it was made (0: none had begun, or not known), for a
    /// first use of a longer TTL (see `Engine::first_use`). With `until`,
    /// waits until then at most for nodes still connecting (see
    /// [`wait_connected`](Self::wait_connected)). Every key names a history
    /// that had begun before this call. Empty: none known.
    fn begun(&self, until: Option<Instant>) -> Vec<u64>;

    /// Each node's lock history as the last acquire script read it there,
    /// in node order (see [`Read`](crate::algorithm::restart::Read)), for
    /// the lean acquire, with the generation of the last read made before
    /// them (every read at or below it is among them); empty: this
    /// transport sends no lean acquire.
    fn reads(&self) -> (u64, Vec<Option<crate::algorithm::restart::Read>>);

    /// Waits until every node has a connection whose server and lock
    /// history are known (its connect commands answered), or is failing,
    /// at most until `deadline`; returns how many nodes have a
    /// connection, or the first two entries found to reach one server.
    fn wait_connected(&self, deadline: Instant) -> Result<usize, crate::error::InvalidInput>;

    /// Gathers the facts of [`Redlock::check`](crate::Redlock::check) from
    /// every node.
    fn probe(&self, key: &str, timeout: Duration) -> Vec<Probe>;

    /// Reads `resource`'s value (a writer's token, or its live readers and
    /// a writer's intent) and remaining time to live on every node, each
    /// within `timeout`, outside of rounds and pools (an operator's status
    /// query).
    fn inspect(&self, resource: &str, timeout: Duration) -> Vec<Result<Option<Stored>, NodeError>>;
}

/// A key as one node stores it: its value (empty for a reader set) and
/// remaining time to live (`None`: no expiry), and for a reader set its
/// live entries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Stored {
    /// Whether the key is a lock's (a writer's token, or a reader set with
    /// the crate's mark); `false`: an application's key under that name,
    /// whose value is not reported (`value` empty, `readers` `None`).
    pub lock: bool,
    pub value: String,
    pub ttl: Option<Duration>,
    pub readers: Option<Readers>,
    /// A free key a waiting lock of several claims (see
    /// [`Place`](crate::algorithm::round::Place)): `value` empty.
    pub claim: bool,
    /// An election's term on the node, with the token it is the term of
    /// (see `FENCE_LUA`), where it has one.
    pub term: Option<(u64, String)>,
}

/// A reader set's live entries, as one node stores them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Readers {
    /// Each live reader's token and time left, longest-lived first.
    pub live: Vec<(String, Duration)>,
    /// The time left of a waiting writer's intent, where it lives.
    pub intent: Option<Duration>,
}

/// What the driver read from one node, on a connection of its own.
#[derive(Debug, Clone, Default)]
pub(crate) struct Probe {
    /// Why no connection could be made, or is of no use (unreachable, not
    /// answering).
    pub connect: Option<String>,
    /// The node refused the credentials, in its words (`WRONGPASS …`,
    /// `NOAUTH …`): reached, but of no use until the node URL is fixed.
    pub auth: Option<String>,
    /// `INFO`, or the server's refusal.
    pub info: Option<Result<ServerInfo, String>>,
    /// The metadata's id (written at connect when missing).
    pub history: Option<String>,
    /// The server's refusal to read the metadata's id (an ACL without it).
    pub history_refused: Option<String>,
    /// `SCRIPT LOAD` refused, with the server's words.
    pub load: Option<String>,
    /// `PING` round trips.
    pub rtts: Vec<Duration>,
    /// Node clock minus local clock (µs), and the round trip it took.
    pub clock: Option<(i64, Duration)>,
    /// `CONFIG GET save`, `appendonly`, `appendfsync`, or the refusal.
    pub persistence: Option<Result<(String, String, String), String>>,
    /// A lock and its release on the checked key, on this node alone:
    /// `Ok(held by another)` or the server's refusal.
    pub scripts: Option<Result<bool, String>>,
    /// Two read locks and their releases on the checked key (every
    /// sorted-set command their scripts use), as `scripts`: `Ok(true)`
    /// where a writer held it (nothing tried).
    pub read_scripts: Option<Result<bool, String>>,
}
