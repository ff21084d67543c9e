//! The boundary between the Redlock algorithm and the nodes.
//!
//! The algorithm ([`crate::redlock`]) speaks only this trait; the Redis driver
//! ([`crate::node`]) and test doubles implement it, as redsync keeps `mutex.go`
//! apart from its drivers.

use std::time::{Duration, Instant};

use crate::error::NodeError;

/// One lock's identity on a node: the key and our token.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Key<'a> {
    pub resource: &'a str,
    pub token: &'a str,
}

/// What to do to every key of a round, on every node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    /// `SET key token NX PX ttl`.
    Acquire { ttl: Duration },
    /// Delete the key if it holds our token.
    Release,
    /// Set the key's expiry to `ttl` if it holds our token.
    Extend { ttl: Duration },
}

/// One node's answer for one key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Answer {
    /// Done: set, deleted or extended.
    Ok,
    /// The key exists with another token.
    Other,
    /// The key does not exist.
    Absent,
}

/// One node's answers for every key of a round, in key order, or why the
/// node gave none.
pub(crate) type NodeResult = Result<Vec<Answer>, NodeError>;

/// Tells a round, from the results so far (`None`: not read yet), that its
/// outcome is known and the remaining replies need not be waited for.
pub(crate) type Decided<'a> = &'a dyn Fn(&[Option<NodeResult>]) -> bool;

/// Access to the N nodes.
pub(crate) trait Transport: Send + Sync + 'static {
    /// Display names of the nodes (no credentials), in node order.
    fn node_names(&self) -> &[String];

    /// Runs `op` for every key on every node at once and returns one result
    /// per node, in node order. Must return by `deadline` (give or take a
    /// scheduling quantum): a node that has not answered by then is a
    /// [`crate::NodeErrorKind::Timeout`]. Once `decided` says the outcome is
    /// known, it may stop waiting for the remaining nodes (they count as
    /// timed out).
    fn run(
        &self,
        op: Op,
        keys: &[Key<'_>],
        deadline: Instant,
        decided: Option<Decided<'_>>,
    ) -> Vec<NodeResult>;
}
