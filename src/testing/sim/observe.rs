//! What the checkers read of a simulated node ([`Observed`]), so that they
//! need not know the world that runs it; and how a command reads in the
//! trace.

use std::time::Instant;

use crate::algorithm::round::{Key, Op};
use crate::testing::store::Store;

/// What a violation is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Kind {
    /// Two critical sections of one resource both within validity at once
    /// (but two readers: see [`conflicts`]).
    TwoHolders,
    /// A section's write was based on a read another section's write had
    /// already made stale (two holders in effect).
    LostUpdate,
    /// A fencing token not above every earlier grant's.
    FenceOrder,
    /// An extension completed after the lock's deadline and succeeded.
    LateExtend,
    /// A lock reported valid past what its last round allows.
    DeadlineBeyondTtl,
    /// A lock reported valid while its key is on fewer than a majority of
    /// nodes (nodes that lost their data since it was acquired count).
    DeadlineBeyondKeys,
    /// A section that lost its lock (or ran out) was told it had not.
    Unsignalled,
    /// A key of ours left on a node with no delete sent after it landed, or
    /// `release()` returned Ok with the key still on a majority.
    Leaked,
    /// A key outlived its section by more than one TTL.
    KeyOutlived,
    /// A call waited longer than its documented bound.
    WaitBound,
    /// With every node healthy and no contention, a lock was not granted.
    Liveness,
    /// A writer waiting behind a stream of readers (calm network, healthy
    /// nodes) did not get in within one reader TTL and a retry pause and a
    /// few rounds of its call: new readers did not keep out of its way.
    WriterStarved,
    /// A lock granted on a resource that is an application's key on so
    /// many nodes that the others are short of a majority (the scripts took
    /// another owner's key).
    ForeignTaken,
    /// Two leaders of one election whose leases were both valid at once
    /// (see [`leaders`](crate::testing::sim::leaders)).
    TwoLeaders,
    /// A term granted twice, or below one granted before it.
    TermOrder,
    /// A leader paused past its lease read `is_leader() == true` when it
    /// resumed (or `wait_end` said its leadership had not ended).
    StaleLeader,
    /// After a leader resigned or died, with a majority of nodes up and a
    /// candidate campaigning, no candidate led within the TTL, a retry pause
    /// and some slack.
    Failover,
    /// `Election::leader` named another leader (or term) than the one
    /// whose lease was valid throughout the call, or none.
    LeaderMisread,
    /// A logical thread panicked, or the run deadlocked or hung.
    Crash,
}

/// What the checker reads of one simulated node.
pub(crate) trait Observed {
    /// Whether it lost its data at or after virtual time `t` (ns).
    fn wiped_since(&self, t: u64) -> bool;
    /// Whether it lost its keys (its data, or an eviction) at or after `t`.
    fn lost_keys_since(&self, t: u64) -> bool;
    /// Whether `resource` holds a live token of `lineage` there at `now`.
    fn holds(&self, base: Instant, now: u64, resource: &str, lineage: &str) -> bool;
    /// Whether its keys can be judged: up, reachable, and its clock never
    /// stepped back.
    fn judged(&self) -> bool;
    /// Its own clock at `now`, as an instant of its store.
    fn local(&self, base: Instant, now: u64) -> Instant;
    /// What it stores.
    fn store(&self) -> &Store;
    /// Its clock's rate.
    fn rate(&self) -> f64;
    /// How long it was paused, crashed or cut off (ns).
    fn unreachable(&self) -> u64;
    /// Until when a copy marked `until` (see [`BACKLOG`]) lives, for a
    /// client that let go at `from`.
    fn copy_until(&self, from: u64, until: u64) -> u64;
    /// The longest stretch of `from..to` throughout which connections to
    /// it could be made (ns).
    fn longest_reachable(&self, from: u64, to: u64) -> u64;
    /// Since when (virtual ns) it has been up, reachable, answering, with
    /// its clock never set back and no fault on it (`None`: not now).
    fn sound_since(&self) -> Option<u64>;
    /// When it last lost its data and lock history (virtual ns).
    fn wiped_at(&self) -> Option<u64>;
}

/// A command for the trace: its kind, and each key's resource and the
/// start of its token.
pub(crate) fn traced(op: Op, keys: &[Key<'_>]) -> String {
    let op = format!("{op:?}");
    let kind = op.split([' ', '{']).next().unwrap_or_default();
    let keys: Vec<String> = keys
        .iter()
        .map(|k| format!("{}={}", k.resource, k.token.get(..8).unwrap_or(k.token)))
        .collect();
    format!("{kind} {}", keys.join(" "))
}
