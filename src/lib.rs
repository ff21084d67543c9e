//! A synchronous [Redlock](https://redis.io/docs/latest/develop/use/patterns/distributed-locks/)
//! distributed lock over N independent Redis nodes.
//!
//! * Acquisition sends `SET key token NX PX ttl` to every node at once over
//!   pooled connections (one round trip to the slowest node), and holds the
//!   lock only with a majority and while
//!   `validity = ttl − elapsed − (ttl × drift + 2 ms)` is positive.
//! * Every node call is bounded by a short timeout (50 ms by default): a dead
//!   or hung node costs its vote, never a hang.
//! * Release and extension are compare-and-delete / compare-and-pexpire Lua
//!   scripts: only the token's owner can touch the key.
//! * [`LockGuard`] releases on drop.
//!
//! ```no_run
//! use std::time::Duration;
//!
//! let locks = quorumlock::Redlock::builder()
//!     .nodes(["redis://10.0.0.1:6379", "redis://10.0.0.2:6379", "redis://10.0.0.3:6379"])
//!     .build()?; // never blocks or fails because a node is down
//! let guard = locks.lock("lock:sku:42", Duration::from_secs(10))?;
//! assert!(guard.validity() < Duration::from_secs(10));
//! // ... critical section ...
//! guard.release()?; // or just drop it
//! # Ok::<(), quorumlock::Error>(())
//! ```
//!
//! Redlock gives *efficiency* locks (avoid doing work twice) a good home. For
//! *correctness* locks, a lock service alone cannot protect storage from a
//! paused client whose lock expired; see the README on fencing.
#![forbid(unsafe_code)]
// docs.rs (nightly) shows which feature a gated item needs.
#![cfg_attr(docsrs, feature(doc_cfg))]
#![deny(missing_docs)]

mod algorithm;
mod builder;
mod check;
mod clock;
mod driver;
mod error;
mod events;
mod guard;
mod inspect;
mod lock;
mod redlock;

#[cfg(test)]
mod testing;

pub use builder::Builder;
pub use check::{Check, Finding, NodeCheck, Verdict};
#[cfg(feature = "tls-rustls")]
pub use driver::tls::Tls;
pub use error::{Error, InvalidInput, NodeError, NodeErrorKind};
pub use events::{
    AttemptEvent, EventHandler, LostEvent, NodeChange, NodeEvent, NodeOutcome, Nodes, ReleaseEvent,
    RenewalEvent,
};
pub use guard::LockGuard;
pub use inspect::{KeyInfo, NodeKey, ReaderInfo};
pub use redlock::Redlock;

/// Longest resource name accepted, in bytes. A lock name is an identifier:
/// 1 KiB leaves room for any structured name (tenant, table, row id) while a
/// name sent to every node on every round stays small; hash longer
/// identifiers before using them as a resource.
pub const MAX_RESOURCE_LEN: usize = 1024;

/// Longest total length, in bytes, of the names of one lock of several
/// resources ([`Redlock::try_lock_all`]): sixteen times
/// [`MAX_RESOURCE_LEN`]. Every round sends them all to every node.
pub const MAX_RESOURCES_LEN: usize = 16 * MAX_RESOURCE_LEN;

/// Longest TTL accepted for a lock (and for `Builder::max_ttl`): one hour.
///
/// With renewal ([`LockGuard::auto_renew`]) a TTL need only cover the
/// longest stall of the holder, so a longer one only delays recovery after
/// a crash. The bound also lets the delayed-restart rule settle a round early
/// on the votes of nodes whose lock history is older than it (see the README).
pub const MAX_TTL: std::time::Duration = std::time::Duration::from_secs(3600);

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The README's examples, compiled as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

#[cfg(test)]
mod tests {
    fn send_sync<T: Send + Sync>() {}

    #[test]
    fn handles_cross_threads() {
        // Guards move into worker threads; clients are shared between them.
        send_sync::<crate::Redlock>();
        send_sync::<crate::LockGuard>();
        send_sync::<crate::Builder>();
        send_sync::<crate::Error>();
    }
}
