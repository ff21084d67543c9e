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

/// A double's [`probe`](crate::lock::transport::Transport::probe): every
/// node unreachable (it does not model `Redlock::check`).
pub(crate) fn unsupported_probes(names: &[String]) -> Vec<crate::lock::transport::Probe> {
    names
        .iter()
        .map(|_| crate::lock::transport::Probe {
            connect: Some("not supported by this transport".into()),
            ..Default::default()
        })
        .collect()
}

/// A double's [`inspect`](crate::lock::transport::Transport::inspect): an
/// error per node (it does not model status queries).
pub(crate) fn unsupported_inspect(
    names: &[String],
) -> Vec<Result<Option<crate::lock::transport::Stored>, crate::NodeError>> {
    names
        .iter()
        .map(|n| {
            Err(crate::NodeError::new(
                n,
                crate::NodeErrorKind::Protocol,
                "not supported by this transport",
            ))
        })
        .collect()
}
