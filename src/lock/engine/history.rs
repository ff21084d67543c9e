//! What the engine knows for the delayed-restart rule: the TTLs in use and
//! each node's lock history, learnt from replies and applied to rounds.

use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::algorithm::restart::{self, RestartRule, TtlHistory};
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
            .first_histories
            .get(i)
            .map_or(0, |e| e.load(Ordering::Relaxed));
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
            if let Some(e) = self.first_histories.get(i) {
                let _ = e.compare_exchange(0, f.history, Ordering::Relaxed, Ordering::Relaxed);
            }
            if let Some(k) = self.histories.get(i) {
                k.store(f.history, Ordering::Relaxed);
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

    /// The lock histories this client has seen begin (the last one each
    /// node reported).
    pub(super) fn begun(&self) -> After {
        let mut out = After::NONE;
        for k in &self.histories {
            out.insert(k.load(Ordering::Relaxed));
        }
        out
    }

    /// What a round using `ttl` sends as the histories it comes after: the
    /// ones this client has seen begin if `ttl` is longer than any it knows
    /// of (a first use), else none (nothing is recorded).
    pub(super) fn first_use(&self, ttl: Duration, known: &TtlHistory) -> After {
        if ttl > known.max {
            self.begun()
        } else {
            After::NONE
        }
    }
}
