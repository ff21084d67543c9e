//! Test-only doubles: in-memory fake nodes and the deterministic simulation.

pub(crate) mod fake;
mod fencing_checks;
pub(crate) mod logs;
mod scripts_agree;
pub(crate) mod sim;
pub(crate) mod store;

/// A request for every one of `set` (at least one), as one lock.
pub(crate) fn request_all<'a, S: AsRef<str>>(
    locks: &'a crate::Redlock,
    set: &'a [S],
    ttl: std::time::Duration,
) -> crate::LockRequest<'a> {
    let (first, rest) = set.split_first().expect("a set of at least one");
    rest.iter()
        .fold(locks.request(first.as_ref(), ttl), |r, k| r.and(k.as_ref()))
}
