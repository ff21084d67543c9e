//! Locks of several resources (`LockRequest::and`): one token, one key
//! per resource on every node, held as one lock.
//!
//! On a node, the acquire script sets every key of the lock or none (see
//! [`ACQUIRE_LUA`](crate::driver::scripts::ACQUIRE_LUA)), so each node votes
//! for the whole set. Every other round sends each key on its own (a
//! release, an extension, a restore and the retries the driver owes a node
//! are per key), and each node's answers are folded back into one per lock
//! ([`round::fold`]) before anything counts them: a node holds the lock
//! only where it holds every key of it.

use std::collections::HashSet;
use std::time::Instant;

use crate::algorithm::round::{self, Key, NodeResult, Op};
use crate::error::InvalidInput;
use crate::lock::state::LockState;
use crate::lock::transport::{AfterRound, Decided, Undo};
use crate::Result;
use crate::MAX_RESOURCES_LEN;

use super::{validate_resource, Engine};

/// Checks the resources of a lock of several: each a valid name, none
/// twice, at most [`MAX_RESOURCES_LEN`] bytes in all.
pub(crate) fn validate_resources<S: AsRef<str>>(resources: &[S]) -> Result<()> {
    let total = resources
        .iter()
        .fold(0usize, |n, r| n.saturating_add(r.as_ref().len()));
    if total > MAX_RESOURCES_LEN {
        return Err(InvalidInput::ResourcesTooLong {
            len: total,
            max: MAX_RESOURCES_LEN,
        }
        .into());
    }
    let mut seen = HashSet::with_capacity(resources.len());
    for r in resources {
        let r = r.as_ref();
        validate_resource(r)?;
        if !seen.insert(r) {
            return Err(InvalidInput::DuplicateResource(r.to_owned()).into());
        }
    }
    Ok(())
}

impl Engine {
    /// Runs `op` on every key of `locks` (as the transport's `run`), with
    /// each node's answers folded into one per lock, for `decided` and
    /// `undo` as for the caller.
    pub(super) fn run_locks(
        &self,
        op: Op,
        locks: &[&LockState],
        deadline: Instant,
        decided: Option<Decided<'_>>,
    ) -> Vec<NodeResult> {
        if let [one] = locks {
            if one.also.is_empty() {
                // The common case, without allocating.
                return self
                    .transport
                    .run(op, &[one.key()], deadline, decided, None);
            }
        }
        let keys: Vec<Key<'_>> = locks.iter().flat_map(|s| s.keys()).collect();
        let sizes = sizes_of(locks);
        self.run_keys(op, &keys, &sizes, deadline, decided, None)
    }

    /// [`run_locks`](Self::run_locks) for keys already laid out: `sizes[i]`
    /// consecutive keys are the `i`-th lock (empty: one key each). Without
    /// a lock of several keys, exactly the transport's `run`.
    pub(super) fn run_keys(
        &self,
        op: Op,
        keys: &[Key<'_>],
        sizes: &[usize],
        deadline: Instant,
        decided: Option<Decided<'_>>,
        undo: Option<Undo<'_>>,
    ) -> Vec<NodeResult> {
        if !round::grouped(sizes) {
            return self.transport.run(op, keys, deadline, decided, undo);
        }
        let fold_all = |results: &[NodeResult]| -> Vec<NodeResult> {
            results.iter().map(|r| round::fold(op, r, sizes)).collect()
        };
        let folded_decided = decided.map(|d| {
            move |partial: &[Option<NodeResult>]| {
                let view: Vec<Option<NodeResult>> = partial
                    .iter()
                    .map(|r| r.as_ref().map(|r| round::fold(op, r, sizes)))
                    .collect();
                d(&view)
            }
        });
        let folded_undo =
            undo.map(|u| move |results: &[NodeResult]| -> AfterRound { u(&fold_all(results)) });
        let decided: Option<Decided<'_>> = folded_decided.as_ref().map(|d| d as _);
        let undo: Option<Undo<'_>> = folded_undo.as_ref().map(|u| u as _);
        let results = self.transport.run(op, keys, deadline, decided, undo);
        fold_all(&results)
    }
}

/// Keys per lock, for [`Engine::run_keys`]; empty (no folding) where every
/// lock has one.
pub(super) fn sizes_of(locks: &[&LockState]) -> Vec<usize> {
    if locks.iter().all(|s| s.also.is_empty()) {
        return Vec::new();
    }
    locks.iter().map(|s| s.size()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::Clock;
    use crate::error::Error;

    fn invalid(r: Result<()>) -> InvalidInput {
        match r {
            Err(Error::InvalidInput(i)) => i,
            other => panic!("expected invalid input, got {other:?}"),
        }
    }

    #[test]
    fn resources_of_one_lock_are_named_once_and_bounded() {
        assert!(matches!(
            invalid(validate_resources(&["a", "b", "a"])),
            InvalidInput::DuplicateResource(d) if d == "a"
        ));
        assert!(matches!(
            invalid(validate_resources(&["a", ""])),
            InvalidInput::EmptyResource
        ));
        let long = "x".repeat(crate::MAX_RESOURCE_LEN);
        let many: Vec<String> = (0..17)
            .map(|i| format!("{i}{long}")[..1024].to_owned())
            .collect();
        assert!(matches!(
            invalid(validate_resources(&many)),
            InvalidInput::ResourcesTooLong { len, max } if len > max && max == MAX_RESOURCES_LEN
        ));
        let fine: Vec<String> = (0..16).map(|i| format!("{i:04}{}", &long[4..])).collect();
        assert!(validate_resources(&fine).is_ok());
        assert!(validate_resources(&["b", "a"]).is_ok());
    }

    /// `n` distinct names, shortest first (one ASCII byte, then two): the
    /// most names the bounds admit in the fewest bytes.
    fn shortest(n: usize) -> Vec<String> {
        let ascii = || (0u8..128).map(char::from);
        ascii()
            .map(String::from)
            .chain(ascii().flat_map(|a| ascii().map(move |b| format!("{a}{b}"))))
            .take(n)
            .collect()
    }

    /// A round of a set waits for a node as long as the crate's batches do,
    /// one node timeout more per 200 keys: a hung node (the fake waits for
    /// it until the deadline) costs an acquire and a release of 1,000 keys
    /// six node timeouts each, no more, and the lock's validity counts
    /// that round. A lone key's rounds keep exactly one node timeout.
    #[test]
    fn a_hung_node_costs_a_big_sets_rounds_their_scaled_deadline_and_a_lone_key_one() {
        use crate::testing::fake::{client, Mode};
        use std::time::Duration;
        let ttl = Duration::from_secs(10);
        let (locks, nodes, clock) = client(3);
        nodes.set_mode(2, Mode::Hung);
        let timeout = crate::lock::settings::Settings::default().node_timeout;
        let drift = crate::algorithm::quorum::drift_allowance(ttl, 0.01);
        let set = shortest(1_000);
        let start = clock.now();
        let g = crate::testing::request_all(&locks, &set, ttl)
            .try_acquire()
            .unwrap();
        assert_eq!(clock.now() - start, timeout * 6, "acquire");
        assert_eq!(g.validity(), ttl - timeout * 6 - drift);
        let start = clock.now();
        g.release().unwrap();
        assert_eq!(clock.now() - start, timeout * 6, "release");
        assert!(set.iter().all(|k| nodes.get(0, k).is_none()));
        let start = clock.now();
        let g = locks.try_lock("lone", ttl).unwrap();
        assert_eq!(clock.now() - start, timeout, "lone acquire");
        let start = clock.now();
        g.release().unwrap();
        assert_eq!(clock.now() - start, timeout, "lone release");
    }

    /// A set's round allowance past its TTL's validity (1,000 keys: six
    /// node timeouts, 300 ms; a TTL of 120 ms) is cut to what the validity
    /// could last, and a round that used it up yields no lock (never one
    /// with no validity left), and leaves nothing set.
    #[test]
    fn a_set_whose_round_outlasts_its_ttl_is_refused_not_granted_without_validity() {
        use crate::testing::fake::{client, Mode};
        use std::time::Duration;
        let ttl = Duration::from_millis(120);
        let (locks, nodes, clock) = client(3);
        nodes.set_mode(2, Mode::Hung);
        let set = shortest(1_000);
        let start = clock.now();
        match crate::testing::request_all(&locks, &set, ttl).try_acquire() {
            Err(Error::ValidityExhausted { .. }) => {}
            other => panic!("{other:?}"),
        }
        let drift = crate::algorithm::quorum::drift_allowance(ttl, 0.01);
        assert_eq!(clock.now() - start, ttl - drift);
        assert!(set
            .iter()
            .all(|k| (0..3).all(|i| nodes.get(i, k).is_none())));
    }
}
