//! What the checkers read of a simulated node ([`Observed`]), so that they
//! need not know the world that runs it; and how a command reads in the
//! trace.

use std::time::Instant;

use crate::algorithm::round::{Key, Op};
use crate::testing::store::Store;

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
