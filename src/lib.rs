#![doc = include_str!("guide.md")]
#![forbid(unsafe_code)]
// docs.rs (nightly) shows which feature a gated item needs.
#![cfg_attr(docsrs, feature(doc_cfg))]
#![deny(missing_docs)]

mod algorithm;
mod builder;
mod check;
mod clock;
mod driver;
mod election;
mod error;
mod events;
mod guard;
mod inspect;
mod lock;
#[cfg(feature = "metrics")]
#[cfg_attr(docsrs, doc(cfg(feature = "metrics")))]
pub mod metrics;
mod redlock;
mod request;

#[cfg(test)]
mod testing;

pub use builder::Builder;
pub use check::{Check, Finding, NodeCheck, Verdict};
#[cfg(feature = "tls-rustls")]
pub use driver::tls::Tls;
pub use election::{Election, Leader, Leadership, Observer};
pub use error::{Error, InvalidInput, NodeError, NodeErrorKind};
pub use events::{
    AcquireEvent, AttemptEvent, EventHandler, LeadershipChange, LeadershipEvent, LostEvent,
    NodeChange, NodeEvent, NodeOutcome, Nodes, ReleaseEvent, RenewalEvent,
};
pub use guard::{LockGuard, LostSignal};
pub use inspect::{KeyInfo, NodeKey, ReaderInfo};
pub use redlock::Redlock;
pub use request::LockRequest;

/// Longest resource name accepted, in bytes. A lock name is an identifier:
/// 1 KiB leaves room for any structured name (tenant, table, row id) while a
/// name sent to every node on every round stays small; hash longer
/// identifiers before using them as a resource.
pub const MAX_RESOURCE_LEN: usize = 1024;

/// Longest total length, in bytes, of the names of one lock of several
/// resources ([`LockRequest::and`]): sixteen times
/// [`MAX_RESOURCE_LEN`]. Every round sends them all to every node.
pub const MAX_RESOURCES_LEN: usize = 16 * MAX_RESOURCE_LEN;

/// Longest candidate id accepted ([`Election::id`]), in bytes: every
/// round of the leader's lock carries it in its token.
pub const MAX_ID_LEN: usize = 128;

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
        send_sync::<crate::LostSignal>();
        send_sync::<crate::LockRequest<'static>>();
    }

    #[test]
    fn errors_are_unwind_safe() {
        fn unwind_safe<T: std::panic::UnwindSafe + std::panic::RefUnwindSafe>() {}
        unwind_safe::<crate::Error>();
        unwind_safe::<crate::NodeError>();
    }
}
