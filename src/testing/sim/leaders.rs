//! The elections' checkers, beside the locks' (see [`Checker`]): the
//! candidates run the production [`Election`](crate::Election), and each
//! leader's lease is read here at every scheduling step through its own
//! [`Leadership`], as the holder's validity is for a lock (valid: not
//! ended, not found lost, before its deadline as the client computed it).
//!
//! - [`Kind::TwoLeaders`]: never two leaders of one election whose leases
//!   are valid at once. A leader's lease is valid from its campaign's
//!   return to the earlier of its resignation (the call) or loss and its
//!   deadline; a candidate whose process died keeps its lease, unrenewed,
//!   until that deadline.
//! - [`Kind::TermOrder`]: every term granted once, and above every term
//!   granted before it (in the order the campaigns returned).
//! - [`Kind::Failover`]: after a leader resigns or dies, some candidate
//!   leads within the election's bound (TTL, retry pause, slack: see
//!   [`Pace`]), counted from the latest of the vacancy, the start of a
//!   campaign still running, a majority of nodes being sound for
//!   [`Pace::settle`] (and, those that lost their data, for
//!   [`Pace::restart`]), and the network delivering ([`Pace::delivers`]).
//! - [`Kind::LeaderMisread`]: `Election::leader` names the leader whose
//!   lease was valid throughout the call, with its term (not another, not
//!   none), where no node lost its keys since that leader's campaign began.
//!
//! [`Kind::StaleLeader`] is checked by the candidates themselves (see
//! [`elections`](crate::testing::sim::elections)): only they know when
//! they resumed.
//!
//! [`Checker`]: crate::testing::sim::check::Checker

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::election::Leadership;
use crate::testing::sim::observe::{Kind, Observed};

/// How a leader's reign ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum End {
    /// `resign()` was called (or the `Leadership` dropped).
    Resigned,
    /// Its process died: its lease lives on, unrenewed, to its deadline.
    Died,
    /// Its lease was found lost or ran out (`is_leader() == false`).
    Lost,
}

/// What the failover check needs of one election (virtual ns).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Pace {
    /// The longest from a vacancy to the next leader: the TTL, the retry
    /// pause and the slack.
    pub(crate) bound: u64,
    /// How long a node must have been sound (see
    /// [`Observed::sound_since`]) to count towards the majority: a client
    /// that found it failing tries it again within that.
    pub(crate) settle: u64,
    /// How long after losing its data a node's votes may be held back (the
    /// restart rule).
    pub(crate) restart: u64,
    /// How many sound nodes make the majority.
    pub(crate) need: usize,
    /// From when the network delivers every message in time (a lossy one,
    /// or one whose delays spike, heals at the end of the workload): before
    /// that a failed attempt may leave its key on a node for a TTL, and
    /// another after it, so no bound holds.
    pub(crate) delivers: u64,
}

/// One leader's reign.
struct Reign {
    who: String,
    /// Its candidate id.
    id: String,
    election: String,
    term: u64,
    granted: u64,
    /// When the campaign that won it began (its keys were set since).
    began: u64,
    /// Its lease, read at every step until the reign ends.
    lease: Arc<Leadership>,
}

impl Reign {
    fn valid(&self) -> bool {
        !self.lease.validity().is_zero()
    }
}

/// An election without a leader since its leader resigned or died.
struct Vacancy {
    since: u64,
    how: End,
    after: String,
    reported: bool,
    /// From when the failover check counts (see [`Leaders::observe`]),
    /// as last computed; `None`: not judged then.
    judged_from: Option<u64>,
}

/// Figures of a run's elections.
#[derive(Debug, Clone, Default)]
pub(crate) struct LeaderStats {
    /// Campaigns that returned a leader.
    pub(crate) elected: u64,
    /// The highest term granted, per election.
    pub(crate) top_terms: Vec<u64>,
    /// How reigns ended.
    pub(crate) resigned: u64,
    pub(crate) died: u64,
    pub(crate) lost: u64,
    /// Per vacancy that a leader filled: how it began, and the virtual
    /// time to the next leader (ns).
    pub(crate) failovers: Vec<(End, u64)>,
    /// Of those, the ones the failover check judged (a candidate
    /// campaigning, a majority sound), and the largest share of its bound
    /// one of them took.
    pub(crate) judged: u64,
    pub(crate) closest: f64,
    /// Leaders that resumed from a pause past their lease and checked
    /// `is_leader()` (see [`Kind::StaleLeader`]).
    pub(crate) stale_checks: u64,
    /// `Election::leader` calls while a lease was valid throughout, and
    /// those that answered no leader, or could not tell.
    pub(crate) reads: u64,
    pub(crate) reads_none: u64,
    pub(crate) reads_failed: u64,
    /// Every term granted, with whom to (one run's, not added up).
    pub(crate) grants: Vec<(String, u64)>,
}

impl LeaderStats {
    /// Adds another run's figures.
    pub(crate) fn add(&mut self, t: &LeaderStats) {
        self.elected += t.elected;
        self.resigned += t.resigned;
        self.died += t.died;
        self.lost += t.lost;
        self.failovers.extend(t.failovers.iter().copied());
        self.judged += t.judged;
        self.closest = self.closest.max(t.closest);
        self.stale_checks += t.stale_checks;
        self.reads += t.reads;
        self.reads_none += t.reads_none;
        self.reads_failed += t.reads_failed;
    }

    /// The figures, in a line.
    pub(crate) fn figures(&self) -> String {
        let figure = |how: End| {
            let mut ms: Vec<f64> = self
                .failovers
                .iter()
                .filter(|f| f.0 == how)
                .map(|f| f.1 as f64 / 1e6)
                .collect();
            ms.sort_by(f64::total_cmp);
            match (ms.first(), ms.get(ms.len() / 2), ms.last()) {
                (Some(lo), Some(mid), Some(hi)) => {
                    format!("{} in {lo:.1} / {mid:.1} / {hi:.1} ms", ms.len())
                }
                _ => "none".to_owned(),
            }
        };
        format!(
            "{} leaders elected (terms granted), {} resigned, {} died, {} lost; \
             time to the next leader (min / median / max) after a resignation {}, \
             after a death {}; {} judged against the bound (at most {:.0} % of it); \
             {} leaders resumed past their lease; leader() read {} times under a \
             valid lease ({} no leader, {} failed)",
            self.elected,
            self.resigned,
            self.died,
            self.lost,
            figure(End::Resigned),
            figure(End::Died),
            self.judged,
            100.0 * self.closest,
            self.stale_checks,
            self.reads,
            self.reads_none,
            self.reads_failed,
        )
    }
}

/// Every election's leaders, vacancies and campaigns.
#[derive(Default)]
pub(crate) struct Leaders {
    reigns: BTreeMap<usize, Reign>,
    next: usize,
    /// Per election, every term granted: (term, who, when).
    granted: BTreeMap<String, Vec<(u64, String, u64)>>,
    vacant: BTreeMap<String, Vacancy>,
    /// Per election, the candidates campaigning now, and since when.
    campaigning: BTreeMap<String, BTreeMap<String, u64>>,
    /// Per election and candidate, when its last campaign began.
    began: BTreeMap<(String, String), u64>,
    paces: BTreeMap<String, Pace>,
    pub(crate) stats: LeaderStats,
}

type Found = Vec<(Kind, String)>;

fn ms(ns: u64) -> f64 {
    ns as f64 / 1e6
}

impl Leaders {
    /// Judges `election`'s failovers by `pace` (none are judged without).
    pub(crate) fn pace(&mut self, election: &str, pace: Pace) {
        self.paces.insert(election.to_owned(), pace);
    }

    /// Candidate `who` of `election` begins a campaign at `Some(now)`, or
    /// its campaign returned (`None`).
    pub(crate) fn campaigning(&mut self, election: &str, who: &str, since: Option<u64>) {
        let c = self.campaigning.entry(election.to_owned()).or_default();
        match since {
            Some(t) => c.insert(who.to_owned(), t),
            None => c.remove(who),
        };
        if let Some(t) = since {
            self.began.insert((election.to_owned(), who.to_owned()), t);
        }
    }

    /// `who`'s campaign returned `lease` at `now`: its reign's handle, and
    /// what that broke.
    pub(crate) fn elected(
        &mut self,
        now: u64,
        who: &str,
        lease: Arc<Leadership>,
    ) -> (usize, Found) {
        let mut found = Found::new();
        let election = lease.name().to_owned();
        let term = lease.term();
        for r in self.reigns.values() {
            if r.election == election && r.valid() {
                found.push((
                    Kind::TwoLeaders,
                    format!(
                        "{who} elected in term {term} of {election:?} at {:.3} ms while {} (term {}, elected at {:.3} ms) still leads for {:?}",
                        ms(now),
                        r.who,
                        r.term,
                        ms(r.granted),
                        r.lease.validity()
                    ),
                ));
            }
        }
        found.extend(self.term(&election, who, term, now));
        if let Some(v) = self.vacant.remove(&election) {
            self.stats.failovers.push((v.how, now - v.since));
            // Judged: the bound's clock had started (see `observe`).
            let from = v.judged_from.filter(|&f| f <= now);
            if let (Some(from), Some(pace)) = (from, self.paces.get(&election)) {
                self.stats.judged += 1;
                let share = now.saturating_sub(from) as f64 / pace.bound as f64;
                self.stats.closest = self.stats.closest.max(share);
            }
        }
        self.stats.elected += 1;
        self.next += 1;
        let began = self
            .began
            .get(&(election.clone(), who.to_owned()))
            .copied()
            .unwrap_or(now);
        self.reigns.insert(
            self.next,
            Reign {
                who: who.to_owned(),
                id: lease.id().to_owned(),
                election,
                term,
                granted: now,
                began,
                lease,
            },
        );
        (self.next, found)
    }

    /// `who` got `term` of `election` at `now` (a leader the checkers do
    /// not read the lease of: see [`elected`](Self::elected)): whether it
    /// was granted before, or is below a term granted before.
    pub(crate) fn term(
        &mut self,
        election: &str,
        who: &str,
        term: u64,
        now: u64,
    ) -> Option<(Kind, String)> {
        let terms = self.granted.entry(election.to_owned()).or_default();
        let found = if let Some((_, by, at)) = terms.iter().find(|(t, _, _)| *t == term) {
            Some((
                Kind::TermOrder,
                format!(
                    "term {term} of {election:?} granted twice: to {by} at {:.3} ms, to {who} at {:.3} ms",
                    ms(*at),
                    ms(now)
                ),
            ))
        } else {
            terms.iter().max_by_key(|(t, _, _)| *t).filter(|(top, _, _)| term < *top).map(|(top, by, at)| {
                (
                    Kind::TermOrder,
                    format!(
                        "{who} elected in term {term} of {election:?} at {:.3} ms, after {by} in term {top} at {:.3} ms",
                        ms(now),
                        ms(*at)
                    ),
                )
            })
        };
        terms.push((term, who.to_owned(), now));
        found
    }

    /// The leader of reign `id` died at `now`: its election is vacant from
    /// now on, though its lease stays valid until its deadline.
    pub(crate) fn died(&mut self, id: usize, now: u64) {
        let Some(r) = self.reigns.get(&id) else {
            return;
        };
        self.stats.died += 1;
        let v = Vacancy {
            since: now,
            how: End::Died,
            after: r.who.clone(),
            reported: false,
            judged_from: None,
        };
        self.vacant.insert(r.election.clone(), v);
    }

    /// Reign `id` ends at `now` (`how`: a resignation makes its election
    /// vacant): its lease, handed back to its holder.
    pub(crate) fn ended(&mut self, id: usize, now: u64, how: End) -> Option<Arc<Leadership>> {
        let r = self.reigns.remove(&id)?;
        match how {
            End::Resigned => {
                self.stats.resigned += 1;
                let v = Vacancy {
                    since: now,
                    how,
                    after: r.who.clone(),
                    reported: false,
                    judged_from: None,
                };
                self.vacant.insert(r.election.clone(), v);
            }
            End::Lost => self.stats.lost += 1,
            End::Died => {}
        }
        Some(r.lease)
    }

    /// `Election::leader` of `election`, called at `start`, answered
    /// `seen` at `now` (`Err`: it could not tell). Judged where a reign was
    /// valid throughout and no node lost its keys since its campaign began
    /// (then the nodes may store a key of a campaign that the restart rule
    /// kept from winning, or hold the lease on too few of them, and
    /// `leader` reports what they store).
    pub(crate) fn read(
        &mut self,
        election: &str,
        (start, now): (u64, u64),
        seen: Result<Option<(String, u64)>, ()>,
        nodes: &[impl Observed],
    ) -> Option<(Kind, String)> {
        let r = self.reigns.values().find(|r| {
            r.election == election
                && r.granted <= start
                && r.valid()
                && !nodes.iter().any(|n| n.lost_keys_since(r.began))
        })?;
        self.stats.reads += 1;
        match seen {
            Ok(Some((id, term))) if id == r.id && term == r.term => None,
            Ok(Some((id, term))) => Some((
                Kind::LeaderMisread,
                format!(
                    "leader() of {election:?} from {:.3} to {:.3} ms read {id:?} in term {term}, while {} ({:?}, term {}) led throughout",
                    ms(start),
                    ms(now),
                    r.who,
                    r.id,
                    r.term
                ),
            )),
            Ok(None) => {
                self.stats.reads_none += 1;
                Some((
                    Kind::LeaderMisread,
                    format!(
                        "leader() of {election:?} from {:.3} to {:.3} ms read no leader, while {} ({:?}, term {}) led throughout",
                        ms(start),
                        ms(now),
                        r.who,
                        r.id,
                        r.term
                    ),
                ))
            }
            Err(()) => {
                self.stats.reads_failed += 1;
                None
            }
        }
    }

    /// The continuous checks, at every step: one valid lease per election,
    /// and each vacancy filled in time.
    pub(crate) fn observe(&mut self, now: u64, nodes: &[impl Observed]) -> Found {
        let mut found = Found::new();
        if self.reigns.is_empty() && self.vacant.is_empty() {
            return found;
        }
        let valid: Vec<&Reign> = self.reigns.values().filter(|r| r.valid()).collect();
        for (i, a) in valid.iter().enumerate() {
            if let Some(b) = valid[i + 1..].iter().find(|b| b.election == a.election) {
                found.push((
                    Kind::TwoLeaders,
                    format!(
                        "{} (term {}, elected at {:.3} ms) and {} (term {}, elected at {:.3} ms) both lead {:?}",
                        a.who,
                        a.term,
                        ms(a.granted),
                        b.who,
                        b.term,
                        ms(b.granted),
                        a.election
                    ),
                ));
            }
        }
        if self.vacant.is_empty() {
            return found;
        }
        // When each node counts: sound for `settle`, and if it lost its
        // data, the restart rule's time after.
        let ready = |pace: &Pace| {
            let mut ready: Vec<u64> = nodes
                .iter()
                .filter_map(|n| {
                    let sound = n.sound_since()? + pace.settle;
                    Some(sound.max(n.wiped_at().map_or(0, |w| w + pace.restart)))
                })
                .collect();
            ready.sort_unstable();
            ready.get(pace.need.saturating_sub(1)).copied()
        };
        for (election, v) in &mut self.vacant {
            let Some(pace) = self.paces.get(election) else {
                continue;
            };
            let campaign = self
                .campaigning
                .get(election)
                .and_then(|c| c.values().min().copied());
            v.judged_from = None;
            let (Some(campaign), Some(majority)) = (campaign, ready(pace)) else {
                continue;
            };
            let from = v.since.max(campaign).max(majority).max(pace.delivers);
            v.judged_from = Some(from);
            if !v.reported && now > from + pace.bound {
                v.reported = true;
                found.push((
                    Kind::Failover,
                    format!(
                        "no leader of {election:?} {:.3} ms after {} {} at {:.3} ms (campaigning since {:.3} ms, a majority sound and voting since {:.3} ms; bound {:.3} ms)",
                        ms(now - from),
                        v.after,
                        if v.how == End::Died { "died" } else { "resigned" },
                        ms(v.since),
                        ms(campaign),
                        ms(majority),
                        ms(pace.bound)
                    ),
                ));
            }
        }
        found
    }

    /// At the end of a run: every term granted, and the highest of each
    /// election.
    pub(crate) fn finish(&mut self) {
        self.stats.grants = self
            .granted
            .values()
            .flatten()
            .map(|(t, who, _)| (who.clone(), *t))
            .collect();
        self.stats.top_terms = self
            .granted
            .values()
            .map(|t| t.iter().map(|g| g.0).max().unwrap_or(0))
            .collect();
    }
}
