//! The Redlock decisions, free of any I/O: majority, validity and clock-drift
//! maths, how votes turn into an outcome, retry back-off.
//!
//! Everything here is a pure function of its arguments so it can be tested
//! exhaustively and reused by a simulated cluster.

use std::time::Duration;

use crate::algorithm::round::{After, Answer, NodeFacts, NodeResult, ServerKind};
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

/// What is known of the TTLs in use: the longest, `max`, first used after
/// the lock histories in `after` had begun (empty: in use since always),
/// and at most `prev` before that. Kept by each client (from its own uses
/// and the nodes' reports) and, per node, by the scripts; one step is all
/// it keeps (a longer TTL first used later replaces it: `prev` becomes the
/// old `max`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TtlHistory {
    pub max: Duration,
    pub after: After,
    pub prev: Duration,
}

impl TtlHistory {
    /// `max` in use since always (or since when, nobody can tell).
    pub(crate) const fn since_always(max: Duration) -> TtlHistory {
        TtlHistory {
            max,
            after: After::NONE,
            prev: max,
        }
    }

    /// The longest TTL in use before the lock history `key` began.
    pub(crate) fn before(&self, key: u64) -> Duration {
        if self.after.contains(key) {
            self.prev
        } else {
            self.max
        }
    }

    /// After this client's own use of `ttl`, knowing that the histories
    /// `begun` had begun: a TTL longer than any known is first used now.
    pub(crate) fn used(self, ttl: Duration, begun: After) -> TtlHistory {
        let ttl = ttl.min(crate::MAX_TTL);
        if ttl <= self.max {
            self
        } else if begun.is_empty() {
            TtlHistory::since_always(ttl)
        } else {
            TtlHistory {
                max: ttl,
                after: begun,
                prev: self.max,
            }
        }
    }

    /// A node's report.
    pub(crate) fn reported(f: &NodeFacts) -> TtlHistory {
        let max = f.max_ttl.min(crate::MAX_TTL);
        if f.after.is_empty() {
            TtlHistory::since_always(max)
        } else {
            TtlHistory {
                max,
                after: f.after,
                prev: f.prev_max.min(max),
            }
        }
    }

    /// A history that bounds both: for every lock history, the longest TTL
    /// in use before it began is at most what this says.
    pub(crate) fn merge(self, other: TtlHistory) -> TtlHistory {
        let (max, after, prev) = if self.max == other.max {
            (
                self.max,
                self.after.intersect(&other.after),
                self.prev.max(other.prev),
            )
        } else {
            // The longer one's step, with the shorter one's longest before it.
            let (hi, lo) = if self.max > other.max {
                (self, other)
            } else {
                (other, self)
            };
            (hi.max, hi.after, hi.prev.max(lo.max))
        };
        if after.is_empty() {
            TtlHistory::since_always(max)
        } else {
            TtlHistory { max, after, prev }
        }
    }
}

/// The delayed-restart rule for one acquire round, decided from what the
/// nodes report about themselves (see the README's safety argument).
///
/// A node that lost its data may have lost locks granted before its lock
/// history began, and still held elsewhere, so its OK does not count until
/// its history is older than the longest TTL in use before it began: the
/// TTL asked for, and every TTL this client or a node that answered knew
/// of, unless it was first used by a client that had already seen that
/// history (its key is in the record's `after`). No clocks are compared:
/// "first used after" is what the first user saw.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RestartRule {
    pub enabled: bool,
    /// The TTL asked for (counted as in use since always: a cluster whose
    /// nodes all lost their data at once holds its first locks for it).
    pub floor: Duration,
    /// What this client knew of the TTLs in use when the round began.
    pub known: TtlHistory,
    /// Every node answered this round (see [`answered_all`]). Only then
    /// have all the records that may say a TTL was in use before a young
    /// history began been heard; otherwise every TTL known counts, as if
    /// it had always been in use.
    pub complete: bool,
    /// The simulation's broken variant: every TTL counts only as the
    /// longest before its first use, for every history (ignores first uses
    /// from before a history began).
    pub loose: bool,
}

impl RestartRule {
    /// This rule for a round whose results are in: complete if every node
    /// answered.
    pub(crate) fn heard(self, results: &[NodeResult]) -> RestartRule {
        RestartRule {
            complete: answered_all(results.iter().map(Some)),
            ..self
        }
    }

    /// The longest TTL in use at all, as far as this round can tell.
    pub(crate) fn longest<'a>(&self, facts: impl Iterator<Item = &'a NodeFacts>) -> Duration {
        facts
            .map(|f| f.max_ttl)
            .fold(self.floor.max(self.known.max), Duration::max)
    }

    /// How much longer a node with facts `f` is held back (zero: its vote
    /// counts), given every report of the round so far (`all`). `trusted`:
    /// the client chose to trust this node's history.
    pub(crate) fn hold<'a>(
        &self,
        f: &NodeFacts,
        all: impl Iterator<Item = &'a NodeFacts>,
        trusted: bool,
    ) -> Duration {
        if !self.enabled || trusted {
            return Duration::ZERO;
        }
        // Without every node's record, a first use after the young history
        // proves nothing: an unheard node may hold an earlier one.
        let key = if self.complete { f.history } else { 0 };
        let own = if self.loose {
            self.known.prev
        } else {
            self.known.before(key)
        };
        let mut longest = self.floor.max(own);
        for o in all {
            longest = longest.max(if self.loose {
                o.prev_max
            } else {
                TtlHistory::reported(o).before(key)
            });
        }
        longest.saturating_sub(f.age)
    }
}

/// Facts of every reply so far, for [`RestartRule::longest`] and
/// [`RestartRule::hold`].
pub(crate) fn facts_of<'a>(
    results: impl Iterator<Item = &'a NodeResult>,
) -> impl Iterator<Item = &'a NodeFacts> {
    results.filter_map(|r| r.as_ref().ok()?.facts.as_ref())
}

/// Turns the OK votes of held-back nodes into failures that say why.
pub(crate) fn hold_back(
    results: Vec<NodeResult>,
    names: &[String],
    mut hold: impl FnMut(usize, &NodeFacts) -> Option<String>,
) -> Vec<NodeResult> {
    results
        .into_iter()
        .enumerate()
        .map(|(i, r)| match r {
            Ok(rep) if rep.answers.contains(&Answer::Ok) => match rep.facts {
                Some(f) => match hold(i, &f) {
                    None => Ok(rep),
                    Some(why) => Err(NodeError::new(
                        names.get(i).map_or("?", String::as_str),
                        NodeErrorKind::Restarted,
                        why,
                    )),
                },
                None => Ok(rep),
            },
            r => r,
        })
        .collect()
}

/// Whether every node answered the round (its reply was read, as a vote or
/// not): a node skipped as failing, not reached or timed out was not heard,
/// whatever this client thinks of its health.
pub(crate) fn answered_all<'a>(results: impl IntoIterator<Item = Option<&'a NodeResult>>) -> bool {
    results.into_iter().all(|r| r.is_some_and(answered))
}

/// Whether a node's result is its answer (see [`answered_all`]).
pub(crate) fn answered(r: &NodeResult) -> bool {
    match r {
        Ok(_) => true,
        Err(e) => matches!(
            e.kind(),
            NodeErrorKind::Restarted | NodeErrorKind::SameServer | NodeErrorKind::Unsuitable
        ),
    }
}

/// Whether every node a round waited for answered it: only then have all
/// the reports that could name a longer TTL in use been heard. Nodes the
/// round did not wait for (failing) do not count.
pub(crate) fn heard_all(results: &[NodeResult]) -> bool {
    results.iter().all(|r| match r {
        Ok(_) => true,
        // Answered, though not as a vote: its report was heard.
        Err(e) => matches!(
            e.kind(),
            NodeErrorKind::Skipped
                | NodeErrorKind::Unavailable
                | NodeErrorKind::Restarted
                | NodeErrorKind::SameServer
                | NodeErrorKind::Unsuitable
        ),
    })
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

    fn after(keys: &[u64]) -> After {
        let mut a = After::NONE;
        for &k in keys {
            a.insert(k);
        }
        a
    }

    /// A merged history bounds both, for every lock history (in and out of
    /// either's `after`), with and without a record of first use; a new
    /// use keeps the bound.
    #[test]
    fn a_merged_ttl_history_bounds_both() {
        let rng = crate::clock::Rng::new(19);
        let pick = |n: u64| rng.next_u64() % n;
        let h = || {
            let max = Duration::from_millis(pick(6) * 100);
            let keys: Vec<u64> = (1..=4).filter(|_| pick(2) == 0).collect();
            TtlHistory::reported(&NodeFacts {
                epoch: 1,
                age: Duration::ZERO,
                max_ttl: max,
                history: 1,
                after: after(&keys),
                prev_max: Duration::from_millis(pick(6) * 100),
            })
        };
        for _ in 0..20_000 {
            let (a, b) = (h(), h());
            let m = a.merge(b);
            for key in 0..=5 {
                assert!(
                    m.before(key) >= a.before(key).max(b.before(key)),
                    "{a:?} + {b:?} = {m:?} for history {key}"
                );
            }
            let u = m.used(m.max + Duration::from_millis(1), after(&[2, 3]));
            for key in 0..=5 {
                assert!(u.before(key) >= m.before(key));
            }
            assert_eq!(u.before(2), m.max, "first used after history 2");
            assert_eq!(u.before(5), u.max, "not known to have begun");
        }
        // A report without a record of first use is since always.
        let always = TtlHistory::reported(&NodeFacts {
            epoch: 1,
            age: Duration::ZERO,
            max_ttl: Duration::from_secs(30),
            history: 1,
            after: After::NONE,
            prev_max: Duration::ZERO,
        });
        assert_eq!(always.before(1), Duration::from_secs(30));
    }

    fn facts(key: u64, age_ms: u64, max_ms: u64, after_keys: &[u64], prev_ms: u64) -> NodeFacts {
        let ms = Duration::from_millis;
        NodeFacts {
            epoch: 1,
            age: ms(age_ms),
            max_ttl: ms(max_ms),
            history: key,
            after: after(after_keys),
            prev_max: ms(prev_ms),
        }
    }

    /// A young node is held for the longest TTL in use before its history
    /// began: a TTL first used by a client that had seen that history does
    /// not count (the one before it does), any other does; a loose rule
    /// counts only the ones before.
    #[test]
    fn a_young_node_is_held_for_the_ttls_in_use_before_its_history() {
        let rule = RestartRule {
            enabled: true,
            floor: Duration::from_millis(100),
            known: TtlHistory::since_always(Duration::ZERO),
            complete: true,
            loose: false,
        };
        let young = facts(7, 5_000, 0, &[], 0);
        let hold =
            |other: NodeFacts, rule: &RestartRule| rule.hold(&young, [young, other].iter(), false);
        let s = Duration::from_secs;
        // 30 s first used after histories 1 and 2 began: not 7's.
        assert_eq!(hold(facts(1, 9_000, 30_000, &[1, 2], 100), &rule), s(25));
        // ... after 7's: the 10 s before it counts.
        assert_eq!(hold(facts(1, 9_000, 30_000, &[1, 7], 10_000), &rule), s(5));
        // Since always.
        assert_eq!(hold(facts(1, 9_000, 30_000, &[], 0), &rule), s(25));
        // Old enough for all of it.
        assert_eq!(hold(facts(1, 9_000, 4_000, &[], 0), &rule), Duration::ZERO);
        // The loose rule takes the one before, whatever the histories.
        let loose = RestartRule {
            loose: true,
            ..rule
        };
        assert_eq!(
            hold(facts(1, 9_000, 30_000, &[1, 2], 100), &loose),
            Duration::ZERO
        );
        // What the client knows counts the same way.
        let knows = |a: &[u64]| RestartRule {
            known: TtlHistory {
                max: s(30),
                after: after(a),
                prev: Duration::from_millis(100),
            },
            ..rule
        };
        assert_eq!(hold(facts(1, 0, 0, &[], 0), &knows(&[1])), s(25));
        assert_eq!(hold(facts(1, 0, 0, &[], 0), &knows(&[7])), Duration::ZERO);
        // An unknown history (key 0) is never "begun".
        let unknown = facts(0, 5_000, 0, &[], 0);
        let r = rule.hold(
            &unknown,
            [facts(1, 9_000, 30_000, &[0, 1], 100)].iter(),
            false,
        );
        assert_eq!(r, s(25));
        // A round not every node answered: no first use proves anything.
        let partial = RestartRule {
            complete: false,
            ..rule
        };
        assert_eq!(
            hold(facts(1, 9_000, 30_000, &[1, 7], 10_000), &partial),
            s(25)
        );
        // Off, or trusted: no hold.
        let off = RestartRule {
            enabled: false,
            ..rule
        };
        assert_eq!(hold(facts(1, 9_000, 30_000, &[], 0), &off), Duration::ZERO);
        assert_eq!(
            rule.hold(&young, [facts(1, 1, 30_000, &[], 0)].iter(), true),
            Duration::ZERO
        );
        // Duration::MAX anywhere saturates.
        let huge = NodeFacts {
            age: Duration::MAX,
            max_ttl: Duration::MAX,
            prev_max: Duration::MAX,
            ..young
        };
        let _ = rule.hold(&huge, [huge].iter(), false);
    }

    /// The script's form of a set of histories: parsed back as written,
    /// at most `CAP` keys, unknown and odd parts ignored.
    #[test]
    fn history_sets_round_trip_and_stay_bounded() {
        let a = after(&[3, 1_234_567_890_123, 42]);
        assert_eq!(After::parse(a.to_text().as_bytes()), a);
        assert_eq!(After::parse(b""), After::NONE);
        assert_eq!(After::parse(b"0,x,,-5,7").keys(), &[7]);
        let many: Vec<u64> = (1..=20).collect();
        assert_eq!(after(&many).keys().len(), After::CAP);
        assert!(!After::NONE.contains(0));
    }
}
