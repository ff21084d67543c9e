//! The Redlock decisions, free of any I/O: majority, validity and clock-drift
//! maths, how votes turn into an outcome, retry back-off.
//!
//! Everything here is a pure function of its arguments so it can be tested
//! exhaustively and reused by a simulated cluster.

use std::time::Duration;

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
    /// of the round already answered for is not counted (off only in the
    /// simulation, to show what it prevents).
    pub one_per_server: bool,
    /// A node whose memory policy can evict lock keys does not vote
    /// (`Builder::refuse_evicting_nodes`); by default it is only warned of.
    pub refuse_evicting: bool,
}

impl Default for VoteRules {
    fn default() -> Self {
        VoteRules {
            one_per_server: true,
            refuse_evicting: false,
        }
    }
}

/// Stores node `i`'s result `r` in `results` (node order; `names` for
/// messages) as the round counts it. Every transport stores each answer
/// through this, as it arrives, so that early decisions see it too:
/// - a replica or a cluster-mode node never votes, and an evicting node
///   votes unless `rules` refuse it;
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
        ServerKind::Evicting(policy) if rules.refuse_evicting => Some(format!(
            "its maxmemory-policy {policy} can evict lock keys (refuse_evicting_nodes)"
        )),
        ServerKind::Evicting(_) => None,
    }
}

/// Whether a one-key round is settled by the replies so far (`None`: not
/// read yet): a majority said OK, or too few nodes are left to make one.
pub(crate) fn settled(results: &[Option<NodeResult>]) -> bool {
    settled_by(results, |_, _| true)
}

/// Whether a round of many keys is settled for every key (see [`settled`]).
pub(crate) fn settled_all(results: &[Option<NodeResult>]) -> bool {
    let keys = results
        .iter()
        .filter_map(|r| r.as_ref()?.as_ref().ok().map(|rep| rep.answers.len()))
        .max()
        .unwrap_or(0);
    let q = quorum(results.len());
    let pending = results.iter().filter(|r| r.is_none()).count();
    (0..keys).all(|k| {
        let ok = results
            .iter()
            .filter(|r| matches!(r, Some(Ok(rep)) if rep.answers.get(k) == Some(&Answer::Ok)))
            .count();
        ok >= q || ok + pending < q
    })
}

/// [`settled`], counting an OK from node `i` only when `counts(i, facts)`.
pub(crate) fn settled_by(
    results: &[Option<NodeResult>],
    counts: impl Fn(usize, Option<&NodeFacts>) -> bool,
) -> bool {
    settled_acquire(results, &counts, &counts)
}

/// Whether an acquire round is settled: a majority of OKs that `certain`ly
/// count (no reply still to come can disqualify them), or too few OKs that
/// `count` now, even with every pending reply, to make one.
pub(crate) fn settled_acquire(
    results: &[Option<NodeResult>],
    certain: impl Fn(usize, Option<&NodeFacts>) -> bool,
    counts: impl Fn(usize, Option<&NodeFacts>) -> bool,
) -> bool {
    let q = quorum(results.len());
    let oks = || {
        results.iter().enumerate().filter_map(|(i, r)| match r {
            Some(Ok(rep)) if rep.answers.first() == Some(&Answer::Ok) => {
                Some((i, rep.facts.as_ref()))
            }
            _ => None,
        })
    };
    let sure = oks().filter(|&(i, f)| certain(i, f)).count();
    let maybe = oks().filter(|&(i, f)| counts(i, f)).count();
    let pending = results.iter().filter(|r| r.is_none()).count();
    sure >= q || maybe + pending < q
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

/// After a failed acquire, how long until a majority of the nodes could
/// take the key (by the owners' remaining TTLs the answers reported; a
/// node where our SET landed is free once undone): the bound of a waiter's
/// fallback (see `Engine::acquire`). `None`: unknown (too many nodes failed
/// or hold keys that never expire).
pub(crate) fn free_in(results: &[NodeResult], index: usize) -> Option<Duration> {
    let mut free: Vec<Duration> = results
        .iter()
        .map(|r| match r {
            Ok(rep) => match rep.answers.get(index) {
                Some(Answer::Other) => rep.held.unwrap_or(Duration::MAX),
                Some(_) => Duration::ZERO,
                None => Duration::MAX,
            },
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
    fn shortfall(self, q: usize, owner_lost: impl FnOnce(usize) -> Error, gone: Error) -> Error {
        if self.ok + self.failures.len() >= q {
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
        let v = validity(ttl, elapsed, drift);
        if v.is_zero() {
            Err(Error::ValidityExhausted { elapsed, ttl })
        } else {
            Ok(v)
        }
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
        let v = validity(ttl, elapsed, drift);
        if v.is_zero() {
            Err(Error::ValidityExhausted { elapsed, ttl })
        } else {
            Ok(v)
        }
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
mod tests {
    use super::*;
    use crate::error::NodeErrorKind;

    const MS: Duration = Duration::from_millis(1);

    fn fail(n: &str) -> NodeResult {
        Err(NodeError::new(n, NodeErrorKind::Timeout, ""))
    }

    fn tally(answers: &[Option<Answer>]) -> Tally {
        let results: Vec<NodeResult> = answers
            .iter()
            .enumerate()
            .map(|(i, a)| match a {
                Some(a) => Ok(crate::algorithm::round::Reply::new(vec![*a])),
                None => fail(&format!("n{i}")),
            })
            .collect();
        Tally::of(&results, 0)
    }

    #[test]
    fn a_round_is_settled_by_a_majority_either_way() {
        let ok = || Some(Ok(crate::algorithm::round::Reply::new(vec![Answer::Ok])));
        let other = || Some(Ok(crate::algorithm::round::Reply::new(vec![Answer::Other])));
        let failed = || Some(fail("x"));
        assert!(!settled(&[ok(), None, None]));
        assert!(settled(&[ok(), ok(), None]));
        assert!(!settled(&[ok(), other(), None]));
        assert!(settled(&[other(), failed(), None]));
        assert!(!settled(&[ok(), ok(), None, None, None]));
        assert!(settled(&[ok(), ok(), ok(), None, None]));
        assert!(settled(&[other(), other(), other(), None, None]));
    }

    /// One vote per server: of two entries' answers for one server, the
    /// one that did more counts (a release's second delete finds the key
    /// gone), whatever order they arrive in; replicas never vote, evicting
    /// nodes only when not refused.
    #[test]
    fn each_server_votes_once_and_unfit_nodes_not_at_all() {
        use crate::algorithm::round::{Reply, ServerTag};
        let names: Vec<String> = ["a", "a2", "b"].iter().map(|s| s.to_string()).collect();
        let tagged = |answer: Answer, run: u64, kind: ServerKind| -> NodeResult {
            let mut r = Reply::new(vec![answer]);
            r.server = Some(ServerTag {
                run: Some(run),
                history: None,
                kind,
            });
            Ok(r)
        };
        let rules = VoteRules::default();
        for order in [[0, 1], [1, 0]] {
            let mut results: Vec<Option<NodeResult>> = vec![None; 3];
            let answers = [Answer::Ok, Answer::Absent];
            for &i in &order {
                insert_vote(
                    &mut results,
                    &names,
                    i,
                    tagged(answers[i], 1, ServerKind::Fit),
                    rules,
                );
            }
            insert_vote(
                &mut results,
                &names,
                2,
                tagged(Answer::Ok, 2, ServerKind::Fit),
                rules,
            );
            let t = Tally::of(&results.iter().flatten().cloned().collect::<Vec<_>>(), 0);
            assert_eq!((t.ok, t.absent), (2, 0), "{order:?}: {results:?}");
            assert_eq!(t.failures[0].kind(), NodeErrorKind::SameServer);
            assert_eq!(t.failures[0].node(), "a2");
        }
        let mut results: Vec<Option<NodeResult>> = vec![None; 3];
        insert_vote(
            &mut results,
            &names,
            0,
            tagged(Answer::Ok, 1, ServerKind::Replica),
            rules,
        );
        insert_vote(
            &mut results,
            &names,
            1,
            tagged(Answer::Ok, 2, ServerKind::Evicting("volatile-lru")),
            rules,
        );
        assert!(matches!(&results[0], Some(Err(e)) if e.kind() == NodeErrorKind::Unsuitable));
        assert!(matches!(&results[1], Some(Ok(_))), "warned of, counted");
        let strict = VoteRules {
            refuse_evicting: true,
            ..rules
        };
        insert_vote(
            &mut results,
            &names,
            1,
            tagged(Answer::Ok, 2, ServerKind::Evicting("volatile-lru")),
            strict,
        );
        assert!(matches!(&results[1], Some(Err(e)) if e.kind() == NodeErrorKind::Unsuitable));
        // Without tags (fake or old transports), nothing changes.
        let mut results: Vec<Option<NodeResult>> = vec![None; 2];
        insert_vote(
            &mut results,
            &names,
            0,
            Ok(Reply::new(vec![Answer::Ok])),
            rules,
        );
        insert_vote(
            &mut results,
            &names,
            1,
            Ok(Reply::new(vec![Answer::Ok])),
            rules,
        );
        assert!(results.iter().all(|r| matches!(r, Some(Ok(_)))));
    }

    #[test]
    fn quorum_is_a_strict_majority() {
        let table = [(1, 1), (2, 2), (3, 2), (4, 3), (5, 3), (6, 4), (7, 4)];
        for (n, q) in table {
            assert_eq!(quorum(n), q, "n = {n}");
        }
    }

    #[test]
    fn drift_is_ttl_times_factor_plus_two_ms() {
        assert_eq!(drift_allowance(Duration::from_secs(10), 0.01), 102 * MS);
        assert_eq!(drift_allowance(Duration::ZERO, 0.01), 2 * MS);
        assert_eq!(drift_allowance(Duration::from_secs(1), 0.0), 2 * MS);
        // Extreme values saturate instead of panicking.
        assert!(drift_allowance(Duration::MAX, 0.5) > Duration::from_secs(u64::MAX / 4));
        assert_eq!(drift_allowance(Duration::MAX, 2.0), Duration::MAX);
    }

    #[test]
    fn validity_saturates_at_zero() {
        assert_eq!(validity(100 * MS, 10 * MS, 3 * MS), 87 * MS);
        assert_eq!(validity(3 * MS, 10 * MS, 3 * MS), Duration::ZERO);
        assert_eq!(
            validity(Duration::ZERO, Duration::MAX, Duration::MAX),
            Duration::ZERO
        );
    }

    #[test]
    fn acquire_needs_a_majority_and_positive_validity() {
        use Answer::*;
        let ttl = 1000 * MS;
        let drift = 12 * MS;
        let ok = decide_acquire(tally(&[Some(Ok), Some(Ok), None]), ttl, 5 * MS, drift);
        assert_eq!(ok.unwrap(), 983 * MS);

        let late = decide_acquire(tally(&[Some(Ok), Some(Ok), Some(Ok)]), ttl, 990 * MS, drift);
        assert!(
            matches!(late, Err(Error::ValidityExhausted { .. })),
            "{late:?}"
        );

        let taken = decide_acquire(tally(&[Some(Ok), Some(Other), Some(Other)]), ttl, MS, drift);
        assert!(
            matches!(taken, Err(Error::Taken { held: 2, nodes: 3 })),
            "{taken:?}"
        );

        // One OK, one taken, one failed: the failed node could have made a
        // majority, so the failure is what is reported.
        let noq = decide_acquire(tally(&[Some(Ok), Some(Other), None]), ttl, MS, drift);
        match noq {
            Err(Error::NoQuorum {
                agreed: 1,
                quorum: 2,
                failures,
            }) => {
                assert_eq!(failures.len(), 1);
                assert_eq!(failures[0].node(), "n2");
            }
            other => panic!("{other:?}"),
        }

        // Two of three down.
        let down = decide_acquire(tally(&[Some(Ok), None, None]), ttl, MS, drift);
        assert!(
            matches!(down, Err(Error::NoQuorum { agreed: 1, .. })),
            "{down:?}"
        );
    }

    #[test]
    fn release_tells_expired_from_stolen() {
        use Answer::*;
        assert!(decide_release(tally(&[Some(Ok), Some(Ok), Some(Absent)])).is_ok());
        assert!(matches!(
            decide_release(tally(&[Some(Absent), Some(Absent), Some(Ok)])),
            Err(Error::Expired)
        ));
        assert!(matches!(
            decide_release(tally(&[Some(Other), Some(Other), Some(Absent)])),
            Err(Error::NotOwner { nodes: 2 })
        ));
        assert!(matches!(
            decide_release(tally(&[Some(Ok), None, None])),
            Err(Error::NoQuorum { .. })
        ));
    }

    #[test]
    fn extend_must_finish_inside_the_old_validity() {
        use Answer::*;
        let t = || tally(&[Some(Ok), Some(Ok), Some(Ok)]);
        let ttl = 100 * MS;
        assert_eq!(
            decide_extend(t(), ttl, 4 * MS, 3 * MS, 50 * MS).unwrap(),
            93 * MS
        );
        assert!(matches!(
            decide_extend(t(), ttl, 60 * MS, 3 * MS, 50 * MS),
            Err(Error::Expired)
        ));
        assert!(matches!(
            decide_extend(
                tally(&[Some(Other), Some(Absent), Some(Absent)]),
                ttl,
                MS,
                MS,
                50 * MS
            ),
            Err(Error::NotOwner { nodes: 1 })
        ));
    }

    #[test]
    fn retry_delay_stays_in_its_band() {
        let base = 100 * MS;
        let jitter = 100 * MS;
        let rng = crate::clock::Rng::new(7);
        let mut lo = Duration::MAX;
        let mut hi = Duration::ZERO;
        for _ in 0..10_000 {
            let d = retry_delay(base, jitter, rng.next_u64());
            lo = lo.min(d);
            hi = hi.max(d);
        }
        assert!(
            hi <= 200 * MS && lo < 10 * MS && hi > 190 * MS,
            "{lo:?}..{hi:?}"
        );
        assert_eq!(retry_delay(base, Duration::ZERO, 12345), base);
        // No overflow for absurd settings.
        let _ = retry_delay(Duration::MAX, Duration::MAX, u64::MAX);
    }
    /// The fallback's bound: a majority is free once the quorum-th
    /// soonest owner's key expires; a node our SET landed on is free now;
    /// failures and keys without expiry are "never".
    #[test]
    fn free_in_is_the_quorum_th_soonest_expiry() {
        use crate::algorithm::round::Reply;
        let held = |ms: Option<u64>| -> NodeResult {
            let mut r = Reply::new(vec![Answer::Other]);
            r.held = Some(ms.map_or(Duration::MAX, Duration::from_millis));
            Ok(r)
        };
        let ours = || -> NodeResult { Ok(Reply::new(vec![Answer::Ok])) };
        let ms = |n| Some(Duration::from_millis(n));
        assert_eq!(
            free_in(&[held(Some(300)), held(Some(100)), held(Some(200))], 0),
            ms(200)
        );
        assert_eq!(
            free_in(&[ours(), held(Some(900)), held(Some(400))], 0),
            ms(400)
        );
        assert_eq!(free_in(&[fail("a"), held(Some(900)), held(None)], 0), None);
        assert_eq!(
            free_in(&[fail("a"), held(Some(900)), held(Some(5))], 0),
            ms(900)
        );
        assert_eq!(
            free_in(
                &[
                    held(Some(1)),
                    held(Some(2)),
                    fail("c"),
                    fail("d"),
                    held(Some(3))
                ],
                0
            ),
            ms(3)
        );
        assert_eq!(free_in(&[], 0), None);
        // A reply without that key's answer says nothing.
        assert_eq!(free_in(&[ours(), ours(), ours()], 1), None);
    }
}
