//! What the engine knows for the delayed-restart rule: the TTLs in use and
//! each node's lock history, learnt from replies and applied to rounds.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::algorithm::restart::{self, Read, RestartRule, TtlHistory};
use crate::algorithm::round::{After, NodeFacts, NodeResult};

use crate::MAX_TTL;

use super::Engine;

impl Engine {
    /// Whether this client chose to trust node `i`'s lock history as seen.
    pub(super) fn trusted(&self, i: usize, facts: &NodeFacts) -> bool {
        if !self.settings.fresh_cluster {
            return false;
        }
        // By key, not epoch: a node restarted from a snapshot keeps its
        // epoch but may have lost its latest locks (its key is new).
        let seen = self
            .nodes
            .get(i)
            .map_or(0, |n| n.first_history.load(Ordering::Relaxed));
        seen == 0 || seen == facts.history
    }

    /// Applies the delayed-restart rule to an acquire round's results.
    pub(super) fn apply_restart_rule(
        &self,
        results: Vec<NodeResult>,
        rule: &RestartRule,
    ) -> Vec<NodeResult> {
        let rule = &rule.heard(&results);
        let longest = rule.longest(restart::facts_of(results.iter()));
        let horizon = self.horizon().max(longest);
        let heard_all = restart::heard_all(&results);
        let all: Vec<NodeFacts> = restart::facts_of(results.iter()).copied().collect();
        restart::hold_back(results, self.transport.node_names(), |i, f| {
            let trusted = self.trusted(i, f);
            let left = rule.hold(f, all.iter(), trusted);
            if !left.is_zero() {
                Some(format!(
                    "lock history {:?} old; its votes count in {left:?}",
                    f.age
                ))
            } else if rule.enabled && !trusted && !heard_all && f.age < horizon {
                // A node that did not answer may know a longer TTL in use.
                Some(format!(
                    "lock history {:?} old, and not every node answered to say no longer TTL is in use",
                    f.age
                ))
            } else {
                None
            }
        })
    }

    /// Whether an acquire using `ttl` under `rule` may be lean (see
    /// [`Op::Acquire`](crate::algorithm::round::Op::Acquire); the caller
    /// checks that it is one writer's key, unfenced, with no intent or on
    /// the call's first try, which then marks none: readers refuse it, and
    /// the next try marks the intent): nothing to record (no first use, and
    /// every node's record knows this client's longest TTL), and every
    /// node's history was read by a script, each begun before the earliest
    /// of those reads, and counts under this rule as if every node answered
    /// now (`Some`: the generation of those reads). The lean reply stands
    /// for that read where the history it reads after its SET is the same
    /// one: nothing older than the reads can be lost unseen (a node that
    /// loses its data loses the history with it), and a TTL first used
    /// since came after every one of those histories began, so it holds
    /// none of them back.
    pub(super) fn lean(&self, ttl: Duration, rule: &RestartRule) -> Option<u64> {
        let known = &rule.known;
        if ttl > known.max {
            return None;
        }
        let (gen, reads) = self.transport.reads();
        if reads.len() != self.transport.node_names().len() {
            return None;
        }
        let reads = reads.into_iter().collect::<Option<Vec<Read>>>()?;
        // (A history first read since the counter was loaded: its reply
        // would be held back.)
        if reads.iter().any(|r| r.gen > gen) {
            return None;
        }
        let first = reads.iter().map(|r| r.from).min()?;
        let begun_before =
            |r: &Read| r.at.saturating_duration_since(first) <= crate::clock::slower(r.facts.age);
        if !reads
            .iter()
            .all(|r| r.facts.max_ttl >= known.max && begun_before(r))
        {
            return None;
        }
        let now = self.clock.now();
        let facts: Vec<NodeFacts> = reads.iter().map(|r| r.aged(now)).collect();
        let rule = RestartRule {
            complete: true,
            ..*rule
        };
        facts
            .iter()
            .enumerate()
            .all(|(i, f)| rule.hold(f, facts.iter(), self.trusted(i, f)).is_zero())
            .then_some(gen)
    }

    /// Beyond this age a node's vote cannot be disqualified by what another
    /// node reports: no TTL in use is longer.
    pub(super) fn horizon(&self) -> Duration {
        self.settings.max_ttl.unwrap_or(MAX_TTL)
    }

    /// Remembers what the nodes reported (the TTLs in use and, per node,
    /// the first and the last lock-history seen), and the TTL the round
    /// itself used, with the histories it sent as begun before it.
    pub(super) fn record_histories(&self, results: &[NodeResult], used: Option<(Duration, After)>) {
        let mut heard: Option<TtlHistory> = None;
        for (i, r) in results.iter().enumerate() {
            let Some(f) = r.as_ref().ok().and_then(|r| r.facts) else {
                continue;
            };
            let h = TtlHistory::reported(&f);
            heard = Some(heard.map_or(h, |k| k.merge(h)));
            if let Some(n) = self.nodes.get(i) {
                let first = &n.first_history;
                let _ = first.compare_exchange(0, f.history, Ordering::Relaxed, Ordering::Relaxed);
                n.history.store(f.history, Ordering::Relaxed);
            }
        }
        if heard.is_none() && used.is_none() {
            return;
        }
        let mut ttls = self.ttls.lock();
        let mut next = heard.map_or(*ttls, |h| ttls.merge(h));
        if let Some((ttl, begun)) = used {
            next = next.used(ttl, begun);
        }
        *ttls = next;
    }

    /// What a round using `ttl` sends as the histories it comes after: if
    /// `ttl` is longer than any it knows of (a first use), the ones this
    /// client has seen begin, the last one each node reported in a reply
    /// and the one each had when a connection to it was made (learnt at
    /// connect; with `until`, waiting until then at most for nodes still
    /// connecting: a fresh client's first round is one, it knows no TTL
    /// yet), every one begun before this call; else none (nothing is
    /// recorded).
    ///
    /// Why a history learnt at connect may be sent. The restart rule rests
    /// on one property of every record a node keeps: each history in its
    /// `after` had begun before the record was written. Then a lock with
    /// TTL `T` granted at `t0` by a node that kept its data is recorded
    /// there (by its own script, or earlier) as first used after histories
    /// that all began before `t0`; a node that lost the lock lost its data
    /// after `t0`, so its new history began after `t0` and is in no such
    /// record, and a later raise keeps `T` as the longest before (the
    /// README's safety argument). A history this client learnt, at connect
    /// or in a reply, was reported by the node before this call, so it had
    /// begun before the script that records this round's first use runs:
    /// the property holds whenever the key was learnt, however stale (a
    /// node restarted since has a new key, which is not sent and so is
    /// held back). A key learnt during the same round would not do: one
    /// node's history may begin after another node's script of that round
    /// ran. Where no history had begun (brand-new nodes, or nodes that all
    /// lost their data) none is learnt, and a first use with no history
    /// known is recorded as in use since always: such nodes look exactly
    /// like a fully restarted cluster, and nobody can say that the TTL was
    /// not in use before its locks were lost (the cluster waits once, for
    /// the first TTL used on it).
    pub(super) fn first_use(
        &self,
        ttl: Duration,
        known: &TtlHistory,
        until: Option<Instant>,
    ) -> After {
        let mut out = After::NONE;
        if ttl > known.max {
            for n in &self.nodes {
                out.insert(n.history.load(Ordering::Relaxed));
            }
            for k in self.transport.begun(until) {
                out.insert(k);
            }
        }
        out
    }
}

/// What a command using `ttl` tells the nodes with the longest TTL this
/// client knows of, `known.max` (see `raise_lua!`): for a first use of
/// `ttl`, `first` (the histories it comes after, see
/// [`Engine::first_use`]); else the histories `known.max` was first used
/// after and the longest TTL before it, as this client knows them (none:
/// in use since always), with which a node that does not know `known.max`
/// (it missed its first use, or lost its data since) records it.
///
/// Sound as a first use is: every key in `known.after` came from a record
/// or from histories this client learnt (each had begun before that
/// record was written, so before this command), and the script never lets
/// the longest before drop below the node's own longest so far, so a TTL
/// the node recorded for a lock it granted still counts for every history
/// begun after that. Without it such a node recorded `known.max` as in use
/// since always, and its record held every node younger than it back, for
/// every client.
pub(super) fn told(ttl: Duration, known: &TtlHistory, first: After) -> (After, Duration) {
    if ttl > known.max {
        (first, Duration::ZERO)
    } else {
        (known.after, known.prev)
    }
}
