//! The Redlock decisions, free of any I/O: majority, validity and clock-drift
//! maths, how votes turn into an outcome, retry back-off.
//!
//! Everything here is a pure function of its arguments so it can be tested
//! exhaustively and reused by a simulated cluster.

use std::time::{Duration, Instant};

use crate::algorithm::round::{Answer, NodeFacts, NodeResult, ServerKind};
use crate::error::{Error, NodeError, NodeErrorKind};

/// Extra drift allowance on top of `ttl × factor`, as in the Redlock spec.
pub(crate) const DRIFT_FLOOR: Duration = Duration::from_millis(2);

/// Votes needed among `nodes`: a strict majority.
pub(crate) fn quorum(nodes: usize) -> usize {
    nodes / 2 + 1
}

/// Which answers count as votes, beyond the restart rule: Redlock's nodes
/// must be independent servers that keep what they are told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct VoteRules {
    /// One vote per server: an entry that reaches a server another entry
    /// of the round already answered for is not counted (off only in
    /// tests, to show what it prevents).
    #[cfg(test)]
    pub one_per_server: bool,
    /// A node whose memory policy can evict lock keys votes too
    /// (`Builder::allow_evicting_nodes`); by default it does not.
    pub allow_evicting: bool,
}

// Not derived: `one_per_server` defaults to true. (Tests only: a client's
// rules come from its settings.)
#[cfg(test)]
impl Default for VoteRules {
    fn default() -> Self {
        VoteRules {
            one_per_server: true,
            allow_evicting: false,
        }
    }
}

/// Stores node `i`'s result `r` in `results` (node order; `names` for
/// messages) as the round counts it. Every transport stores each answer
/// through this, as it arrives, so that early decisions see it too:
/// - a replica or a cluster-mode node never votes, and an evicting node
///   votes only when `rules` allow it;
/// - two entries that reach one server count once. Both commands ran on
///   it, one after the other, and the second saw the first's effect (a
///   release's second delete finds the key gone): of the two answers the
///   one that did more of what was asked counts, the other becomes a
///   failure naming its twin.
pub(crate) fn insert_vote(
    results: &mut [Option<NodeResult>],
    names: &[String],
    i: usize,
    r: NodeResult,
    rules: VoteRules,
) {
    results[i] = Some(r);
    let Some(Ok(reply)) = &results[i] else {
        return;
    };
    let Some(tag) = reply.server else { return };
    let name = |j: usize| names.get(j).map_or("?", String::as_str).to_owned();
    if let Some(why) = unfit(tag.kind, rules) {
        results[i] = Some(Err(NodeError::new(name(i), NodeErrorKind::Unsuitable, why)));
        return;
    }
    #[cfg(test)]
    if !rules.one_per_server {
        return;
    }
    let twin = (0..results.len()).find(|&j| {
        j != i
            && matches!(&results[j], Some(Ok(rep)) if rep.server.is_some_and(|t| t.same_server(&tag)))
    });
    let Some(j) = twin else { return };
    let done = |r: &Option<NodeResult>| match r {
        Some(Ok(rep)) => rep
            .answers
            .iter()
            .filter(|a| matches!(a, Answer::Ok | Answer::Restored))
            .count(),
        _ => 0,
    };
    // The answer that did more counts; the other names its twin.
    let (keep, drop) = if done(&results[i]) > done(&results[j]) {
        (i, j)
    } else {
        (j, i)
    };
    results[drop] = Some(Err(NodeError::new(
        name(drop),
        NodeErrorKind::SameServer,
        format!("the same server as {}: its answer counts once", name(keep)),
    )));
}

/// Why a node of this kind cannot vote under `rules`, if it cannot.
fn unfit(kind: ServerKind, rules: VoteRules) -> Option<String> {
    match kind {
        ServerKind::Fit => None,
        ServerKind::Replica => {
            Some("a replica: its writes are not its own (role:slave)".to_owned())
        }
        ServerKind::Cluster => {
            Some("a Redis Cluster node, not an independent server (cluster_enabled:1)".to_owned())
        }
        ServerKind::Evicting(_) if rules.allow_evicting => None,
        ServerKind::Evicting(policy) => Some(format!(
            "its maxmemory-policy {policy} can evict lock keys, and a second client then takes a held lock: it does not vote; set maxmemory-policy noeviction (or Builder::allow_evicting_nodes(true))"
        )),
    }
}

/// Whether a one-key round is settled (see [`to_settle`]).
#[cfg(test)]
pub(crate) fn settled(results: &[Option<NodeResult>]) -> bool {
    to_settle(results) == 0
}

/// How many more replies a one-key round needs at least before it is
/// settled by the replies so far (`None`: not read yet), 0 when it is:
/// settled when a majority said OK, or too few nodes are left to make
/// one. A round waits on its replies without waking for fewer.
pub(crate) fn to_settle(results: &[Option<NodeResult>]) -> usize {
    to_settle_key(results, 0, |_, _| true, |_, _| true)
}

/// Whether a round of `keys` keys is settled for every key (see
/// [`to_settle_all`]).
#[cfg(test)]
pub(crate) fn settled_all(results: &[Option<NodeResult>], keys: usize) -> bool {
    to_settle_all(results, keys) == 0
}

/// How many more replies a round of `keys` keys needs at least before
/// every key is settled (each as [`to_settle`] says), 0 when it is. The
/// count is the round's, not the replies': before any reply, no key is
/// settled. Each reply adds one OK at most to a key, and is one fewer to
/// come.
pub(crate) fn to_settle_all(results: &[Option<NodeResult>], keys: usize) -> usize {
    (0..keys)
        .map(|k| to_settle_key(results, k, |_, _| true, |_, _| true))
        .max()
        .unwrap_or(0)
}

/// How many more replies a round needs at least before its `k`-th key is
/// settled (0 when it is; an acquire's, key 0): settled by a majority of
/// OKs that `certain`ly count (no reply still to come can disqualify
/// them), or by too few OKs that `count` now, even with every pending
/// reply, to make one. Where every OK that counts counts certainly, a reply adds one certain OK at most, and takes
/// one at most from the OKs that may still come to count (a reply can
/// disqualify only votes that are not certain, each one added by a reply
/// of its own); otherwise a reply may disqualify several at once, and the
/// round looks at every reply.
pub(crate) fn to_settle_key(
    results: &[Option<NodeResult>],
    k: usize,
    certain: impl Fn(usize, Option<&NodeFacts>) -> bool,
    counts: impl Fn(usize, Option<&NodeFacts>) -> bool,
) -> usize {
    let q = quorum(results.len());
    let oks = || {
        results.iter().enumerate().filter_map(|(i, r)| match r {
            Some(Ok(rep)) if rep.answers.get(k) == Some(&Answer::Ok) => {
                Some((i, rep.facts.as_ref()))
            }
            _ => None,
        })
    };
    let sure = oks().filter(|&(i, f)| certain(i, f)).count();
    let maybe = oks().filter(|&(i, f)| counts(i, f)).count();
    let pending = results.iter().filter(|r| r.is_none()).count();
    if sure >= q || maybe + pending < q {
        0
    } else if maybe > sure {
        1
    } else {
        (q - sure).min(maybe + pending + 1 - q)
    }
}

/// `ttl × factor + 2 ms`, saturating; never panics for any `ttl` or factor.
pub(crate) fn drift_allowance(ttl: Duration, factor: f64) -> Duration {
    let scaled =
        Duration::try_from_secs_f64(ttl.as_secs_f64() * factor).unwrap_or(if factor > 0.0 {
            Duration::MAX
        } else {
            Duration::ZERO
        });
    scaled.saturating_add(DRIFT_FLOOR)
}

/// `ttl − elapsed − drift`, or zero when that is not positive.
pub(crate) fn validity(ttl: Duration, elapsed: Duration, drift: Duration) -> Duration {
    ttl.saturating_sub(elapsed).saturating_sub(drift)
}

/// The answers of every node for one key.
#[derive(Debug, Default)]
pub(crate) struct Tally {
    /// The command did what we asked (set, deleted, extended).
    pub ok: usize,
    /// Another token holds the key.
    pub other: usize,
    /// The key does not exist.
    pub absent: usize,
    /// The key was absent and an extension set it again (not a vote).
    pub restored: usize,
    /// Nodes that gave no usable answer.
    pub failures: Vec<NodeError>,
}

impl Tally {
    /// Counts the answers for the `index`-th key of a round.
    pub(crate) fn of(results: &[NodeResult], index: usize) -> Tally {
        let mut t = Tally::default();
        for r in results {
            match r {
                Ok(reply) => match reply.answers.get(index) {
                    Some(Answer::Ok) => t.ok += 1,
                    Some(Answer::Other) => t.other += 1,
                    Some(Answer::Absent) => t.absent += 1,
                    Some(Answer::Restored) => t.restored += 1,
                    None => {}
                },
                Err(e) => t.failures.push(e.clone()),
            }
        }
        t
    }

    fn nodes(&self) -> usize {
        self.ok + self.other + self.absent + self.restored + self.failures.len()
    }
}

/// Nodes whose answer for the `index`-th key says it holds our token now
/// (without copying failures, as [`Tally::of`] does).
pub(crate) fn holding(results: &[NodeResult], index: usize) -> usize {
    results
        .iter()
        .filter(|r| {
            matches!(r, Ok(rep) if matches!(rep.answers.get(index), Some(Answer::Ok | Answer::Restored)))
        })
        .count()
}

/// What one node's answer to a failed acquire said of the key's owner:
/// for telling a woken attempt's owners from the attempt's before it (see
/// [`new_owner`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Seen {
    /// No answer (a failure, or the round ended without it).
    Unknown,
    /// Free, or ours (our SET landed).
    Free,
    /// Another owner's, for this long yet (`Duration::MAX`: no end known).
    Held(Duration),
}

/// Each node's [`Seen`] of each of a lock's `keys` after a failed
/// acquire, node by node.
pub(crate) fn seen(results: &[NodeResult], keys: usize) -> Vec<Seen> {
    results
        .iter()
        .flat_map(|r| (0..keys).map(move |index| seen_of(r, index)))
        .collect()
}

/// What one node's result says of the `index`-th key's owner (a set's
/// reply is folded into one answer, but keeps its keys' times).
fn seen_of(r: &NodeResult, index: usize) -> Seen {
    match r {
        Ok(rep) => match rep.held.get(index) {
            Some(Some(left)) => Seen::Held(*left),
            Some(None) => Seen::Free,
            // (An answer of another owner with no time: none known.)
            None if rep.answers.contains(&Answer::Other) => Seen::Held(Duration::MAX),
            None => Seen::Free,
        },
        Err(_) => Seen::Unknown,
    }
}

/// Per key of a lock of `keys` after a failed acquire (`seen`, as
/// [`seen`] gives it), whether another owner holds it with time left on
/// some node: what a release of it may let in.
pub(crate) fn blocking(seen: &[Seen], keys: usize) -> Vec<bool> {
    let mut out = vec![false; keys];
    for (i, s) in seen.iter().enumerate() {
        if matches!(s, Seen::Held(left) if !left.is_zero()) {
            if let Some(o) = out.get_mut(i % keys.max(1)) {
                *o = true;
            }
        }
    }
    out
}

/// Whether a woken attempt that failed (`now`: what it saw, `at` when)
/// met another owner than the attempt before it (`before`: what that one
/// saw, and when) on some node that answered both, for some key: a key
/// whose time left is not the old owner's less the time gone (by more
/// than `slack`, the most one node's two readings can be off: the longer
/// of the two rounds' times), longer (a new owner, a renewal) or shorter
/// (a new owner with a shorter TTL; a set's longest-held key released),
/// an end known where none was or none where one was, or a key freed or
/// taken in between. A release came, or a renewal: the message that woke
/// it may be true. `false` where every node that answered both shows the
/// same owners: the message may have been forged, from another database
/// (pub/sub ignores it) or late; but a new owner that took the key within
/// `slack` of the old one's time with as much time left looks the same,
/// so it takes three such tries in a row before the waiter hears no more
/// messages until its next try by the clock (see `Engine::acquire`). With
/// nothing to compare (no attempt before, or no node that answered both)
/// every message counts.
///
/// Node by node, not by [`free_in`]: a round ends at its first majority,
/// so two rounds' majorities may differ by a node, and one owner's copies
/// expire milliseconds apart on different nodes.
pub(crate) fn new_owner(
    before: Option<(Instant, &[Seen])>,
    now: &[Seen],
    at: Instant,
    slack: Duration,
) -> bool {
    let Some((then, was)) = before else {
        return true;
    };
    let gone = at.saturating_duration_since(then);
    let mut compared = false;
    for (w, n) in was.iter().zip(now) {
        match (*w, *n) {
            (Seen::Unknown, _) | (_, Seen::Unknown) | (Seen::Free, Seen::Free) => {}
            (Seen::Held(w), Seen::Held(n)) => {
                compared = true;
                // An end known where none was, or none where one was.
                if (w == Duration::MAX) != (n == Duration::MAX) {
                    return true;
                }
                let expected = w.saturating_sub(gone);
                if w != Duration::MAX
                    && (n > expected.saturating_add(slack) || n < expected.saturating_sub(slack))
                {
                    return true;
                }
            }
            // Freed or taken since.
            (Seen::Free, Seen::Held(_)) | (Seen::Held(_), Seen::Free) => return true,
        }
    }
    !compared
}

/// After a failed acquire, how long until a majority of the nodes could
/// take the key (by the owners' remaining TTLs the answers reported; a
/// node where our SET landed is free once undone): the bound of a waiter's
/// fallback (see `Engine::acquire`). `None`: unknown (too many nodes failed
/// or hold keys that never expire).
pub(crate) fn free_in(results: &[NodeResult]) -> Option<Duration> {
    let mut free: Vec<Duration> = results
        .iter()
        .map(|r| match r {
            // The longest over the keys: the lock needs them all.
            Ok(rep) => (0..rep.held.len().max(1))
                .map(|i| match seen_of(r, i) {
                    Seen::Held(left) => left,
                    _ => Duration::ZERO,
                })
                .max()
                .unwrap_or(Duration::ZERO),
            Err(_) => Duration::MAX,
        })
        .collect();
    free.sort_unstable();
    free.get(quorum(results.len()) - 1)
        .copied()
        .filter(|d| *d != Duration::MAX)
}

impl Tally {
    /// The error to report when fewer than a majority said OK. Failures take
    /// precedence only when they could have changed the outcome.
    /// Nodes that refuse the scripts for good, when so many that the rest
    /// can never make a majority, outrank everything: no retry can help;
    /// fewer never change an outcome (a lock held elsewhere is `Taken`).
    fn shortfall(self, q: usize, owner_lost: impl FnOnce(usize) -> Error, gone: Error) -> Error {
        let nodes = self.nodes();
        let refused = self
            .failures
            .iter()
            .filter(|f| f.kind() == NodeErrorKind::ScriptsRefused)
            .count();
        if nodes - refused < q {
            Error::ScriptsRefused {
                nodes,
                quorum: q,
                failures: self.failures,
            }
        } else if self.ok + self.failures.len() - refused >= q {
            Error::NoQuorum {
                agreed: self.ok,
                quorum: q,
                failures: self.failures,
            }
        } else if self.other > 0 {
            owner_lost(self.other)
        } else {
            gone
        }
    }
}

/// The [`validity`] a round that won left, or `ValidityExhausted`.
fn valid(ttl: Duration, elapsed: Duration, drift: Duration) -> Result<Duration, Error> {
    let v = validity(ttl, elapsed, drift);
    if v.is_zero() {
        Err(Error::ValidityExhausted { elapsed, ttl })
    } else {
        Ok(v)
    }
}

/// Outcome of an acquisition round: the remaining validity, or why not.
pub(crate) fn decide_acquire(
    t: Tally,
    ttl: Duration,
    elapsed: Duration,
    drift: Duration,
) -> Result<Duration, Error> {
    let nodes = t.nodes();
    let q = quorum(nodes);
    if t.ok >= q {
        valid(ttl, elapsed, drift)
    } else {
        Err(t.shortfall(
            q,
            |held| Error::Taken { held, nodes },
            Error::Taken { held: 0, nodes },
        ))
    }
}

/// Outcome of a release round.
pub(crate) fn decide_release(t: Tally) -> Result<(), Error> {
    let q = quorum(t.nodes());
    if t.ok >= q {
        Ok(())
    } else {
        Err(t.shortfall(q, |nodes| Error::NotOwner { nodes }, Error::Expired))
    }
}

/// Outcome of an extension round: the new validity, or why not. `elapsed`
/// runs from the round's start; `time_left` is what remained of the old
/// validity at that start: an extension that completes after the old
/// validity ran out cannot be trusted.
pub(crate) fn decide_extend(
    t: Tally,
    ttl: Duration,
    elapsed: Duration,
    drift: Duration,
    time_left: Duration,
) -> Result<Duration, Error> {
    let q = quorum(t.nodes());
    if t.ok >= q {
        if elapsed >= time_left {
            return Err(Error::Expired);
        }
        valid(ttl, elapsed, drift)
    } else {
        Err(t.shortfall(q, |nodes| Error::NotOwner { nodes }, Error::Expired))
    }
}

/// A delay drawn uniformly from `base ± jitter` (floored at zero) using the
/// random word `r`.
pub(crate) fn retry_delay(base: Duration, jitter: Duration, r: u64) -> Duration {
    let j = jitter.as_nanos().min(u64::MAX as u128 / 4) as u64;
    let span = j.saturating_mul(2).saturating_add(1);
    let offset = Duration::from_nanos(r % span);
    base.saturating_add(offset)
        .saturating_sub(Duration::from_nanos(j))
}

#[cfg(test)]
#[path = "quorum_tests.rs"]
mod tests;
