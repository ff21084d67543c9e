//! The delayed-restart rule: a node that lost its data (restart, flush,
//! failover) does not vote until every lock it may have forgotten has
//! expired. [`TtlHistory`] is what is known of the TTLs in use,
//! [`RestartRule`] what one round knows of them and of each node's history,
//! and [`hold_back`] turns the votes it holds back into failures that say
//! why.

use std::time::{Duration, Instant};

use crate::algorithm::round::{After, Answer, NodeFacts, NodeResult};
use crate::error::{NodeError, NodeErrorKind};

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

/// A node's lock history as an acquire's script last read it, for the
/// lean acquire (see [`Op::Acquire`](crate::algorithm::round::Op::Acquire)):
/// its facts (the history's key as the reading connection named it), and
/// when: the command was queued at `from`, its reply read by `at`. `gen`:
/// when this history was first read, counted over the client's reads of
/// every node (one counter for all; a history read again keeps it), so
/// that a lean round checks its replies against the histories its
/// decision saw, not against one read since.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Read {
    pub facts: NodeFacts,
    pub from: Instant,
    pub at: Instant,
    pub gen: u64,
}

impl Read {
    /// The facts as they stand for a command sent at `sent`: the history
    /// older by the time since the read, less 1 % (the clocks' rates may
    /// differ), as a connection's uptime bound grows; younger by the time
    /// from `sent` to the read's reply, where the read came after.
    pub(crate) fn aged(&self, sent: Instant) -> NodeFacts {
        let since = sent.saturating_duration_since(self.at);
        // A read made after the command was sent (another round's, of the
        // same history) counts back from its reply to the send: the
        // history was at least that much younger when the command ran.
        let before = self.at.saturating_duration_since(sent);
        NodeFacts {
            age: self
                .facts
                .age
                .saturating_add(crate::clock::slower(since))
                .saturating_sub(before),
            ..self.facts
        }
    }

    /// What a lean acquire's reply says of this node (`now`: the history
    /// it read after its SET, keyed by its connection; `sent`: when it was
    /// queued; `gen`: the generation of the reads its round was decided
    /// on): the facts last read, aged, where that history is one the
    /// decision saw and the one read after the SET; `None` where it is not
    /// (the node lost its data since, or restarted, or its new history was
    /// read by another round after the decision: its vote is held back).
    pub(crate) fn confirm(
        read: Option<&Read>,
        now: &NodeFacts,
        sent: Instant,
        gen: u64,
    ) -> Option<NodeFacts> {
        read.filter(|r| r.gen <= gen && r.facts.history == now.history && now.epoch != 0)
            .map(|r| r.aged(sent))
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
    /// Every node answered this round (see [`answered`]). Only then
    /// have all the records that may say a TTL was in use before a young
    /// history began been heard; otherwise every TTL known counts, as if
    /// it had always been in use.
    pub complete: bool,
    /// The simulation's broken variant: every TTL counts only as the
    /// longest before its first use, for every history (ignores first uses
    /// from before a history began). Test builds only.
    #[cfg(test)]
    pub loose: bool,
}

impl RestartRule {
    /// This rule for a round whose results are in: complete if every node
    /// answered.
    pub(crate) fn heard(self, results: &[NodeResult]) -> RestartRule {
        RestartRule {
            complete: results.iter().all(answered),
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
        #[cfg(test)]
        if self.loose {
            let longest = all.fold(self.floor.max(self.known.prev), |l, o| l.max(o.prev_max));
            return longest.saturating_sub(f.age);
        }
        let mut longest = self.floor.max(self.known.before(key));
        for o in all {
            longest = longest.max(TtlHistory::reported(o).before(key));
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

/// Whether a node's result is its answer (its reply was read, as a vote or
/// not): a node skipped as failing, not reached or timed out was not heard,
/// whatever this client thinks of its health.
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
    results.iter().all(|r| {
        answered(r)
            || matches!(r, Err(e) if matches!(e.kind(), NodeErrorKind::Skipped | NodeErrorKind::Unavailable))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

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

    /// A lean reply stands for the read its round's decision saw, aged by
    /// the time since less 1 %, only where the history it read after its
    /// SET is that read's: not for another history (a flush, a restart),
    /// none (0), or one first read after the decision (another round's
    /// script read a new history meanwhile: the decision never judged it).
    #[test]
    fn a_lean_reply_stands_only_for_the_read_its_decision_saw() {
        let at = Instant::now();
        let read = Read {
            facts: facts(7, 5_000, 10_000, &[], 0),
            from: at,
            at,
            gen: 5,
        };
        let seen = |history: u64, epoch: u64| NodeFacts {
            epoch,
            ..facts(history, 0, 0, &[], 0)
        };
        let sent = at + Duration::from_secs(100);
        let ok = Read::confirm(Some(&read), &seen(7, 1), sent, 5).expect("same history");
        assert_eq!(ok.age, Duration::from_secs(104), "5 s + 99 % of 100 s");
        assert_eq!(ok.max_ttl, read.facts.max_ttl);
        // A command sent before the read's reply: younger by the difference.
        let early = Read::confirm(Some(&read), &seen(7, 1), at, 5).map(|f| f.age);
        assert_eq!(early, Some(Duration::from_secs(5)));
        let earlier = Read {
            at: at + Duration::from_secs(2),
            ..read
        };
        let early = Read::confirm(Some(&earlier), &seen(7, 1), at, 5).map(|f| f.age);
        assert_eq!(early, Some(Duration::from_secs(3)));
        assert!(Read::confirm(Some(&read), &seen(7, 1), sent, 9).is_some());
        assert_eq!(
            Read::confirm(Some(&read), &seen(7, 1), sent, 4),
            None,
            "first read since"
        );
        assert_eq!(
            Read::confirm(Some(&read), &seen(8, 1), sent, 5),
            None,
            "another"
        );
        assert_eq!(
            Read::confirm(Some(&read), &seen(7, 0), sent, 5),
            None,
            "none"
        );
        assert_eq!(Read::confirm(None, &seen(7, 1), sent, 5), None);
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
