//! What a round needs of the world around it: the nodes' shared state,
//! connections to each node, time, and waiting for replies. Production
//! gives it r2d2 pools of sockets and `poll(2)` ([`super::sockets`]); the
//! simulation gives it its own connections and virtual time. The round
//! itself ([`super::round::RoundRunner`]) is the same code for both.

use std::time::{Duration, Instant};

use crate::algorithm::quorum::VoteRules;
use crate::algorithm::round::Key;
use crate::driver::node::link::Link;
use crate::driver::node::node_round::NodeRound;
use crate::driver::node::state::NodeState;

/// The world of one client's rounds.
pub(crate) trait Links {
    /// A connection checked out for a round (back to its pool when dropped).
    type Link: Link;
    /// The node list's names.
    fn names(&self) -> &[String];
    /// Node `i`'s shared state.
    fn node(&self, i: usize) -> &NodeState;
    /// How answers count as votes.
    fn rules(&self) -> VoteRules;
    /// The node timeout.
    fn timeout(&self) -> Duration;
    /// Per entry, whether it is known to reach the server of an earlier
    /// one (empty when none is).
    fn twins(&self) -> Vec<bool>;
    /// Now.
    fn now(&self) -> Instant;
    /// A connection to node `i` whose late replies were read, if one is
    /// free now (a new one is started otherwise).
    fn checkout(&self, i: usize, now: Instant) -> Option<Self::Link>;
    /// As [`checkout`](Self::checkout), starting a new connection even to
    /// a node held failing: for a command whose older connection closed
    /// under it (the node has not answered it).
    fn checkout_anyway(&self, i: usize, now: Instant) -> Option<Self::Link>;
    /// Node `i` has connections, all in use: waits until `deadline` for one
    /// to come back. None when it has none to wait for.
    fn wait_for_free(&self, i: usize, deadline: Instant) -> Option<Self::Link>;
    /// When every pooled connection to node `i` is in use: the pool's size.
    fn pool_busy(&self, i: usize) -> Option<u32>;
    /// Waits at most `wait` until `need` connections of `parts` that await
    /// a wanted reply are ready (all of them, if fewer), and pushes each
    /// ready one (its index in `parts`) on `ready`. Fewer may be ready when
    /// the wait ends.
    fn wait_ready(
        &self,
        parts: &[NodeRound<Self::Link>],
        wait: Duration,
        need: usize,
        ready: &mut Vec<(usize, <Self::Link as Link>::Ready)>,
    );
    /// Keeps releases of `keys` node `i` did not answer, to send again until
    /// `until`.
    fn retry_later(&self, i: usize, keys: &[Key<'_>], until: Instant);
    /// Sends a granted lock's `SET` to node `i` after its round, which
    /// reached no connection to it in time.
    fn write_later(
        &self,
        i: usize,
        k: &Key<'_>,
        ttl: Duration,
        known_max: Duration,
        start: Instant,
    );
}
