//! The checkers, evaluated at every scheduling step (the world changes only
//! at steps, so that is continuous on virtual time).

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::algorithm::round::Op;
use crate::lock::state::LockState;
pub(crate) use crate::testing::sim::observe::{traced, Kind, Observed};

/// When a client let go of a lineage, and the live copies left then
/// (node, until when: see [`BACKLOG`]).
type LetGo = (u64, Vec<(usize, u64)>);

/// Marks a copy that a paused node's backlog will write when it resumes
/// (the rest of the value is the TTL it sets, in ns).
pub(crate) const BACKLOG: u64 = 1 << 63;

/// How often the simulated retry job ([`links`](crate::testing::sim::links))
/// sends owed releases again (as the driver does); the leak account allows
/// for it.
pub(crate) const RETRY_EVERY: Duration = Duration::from_millis(100);

/// Most releases in one retried command: the driver's 1,000 would hold
/// every release a simulated client ever owes; two make the queue's order
/// matter.
pub(crate) const RETRY_BATCH: usize = 2;

/// How long after a node takes connections again its owed releases may
/// take to reach it (virtual ns): the retry interval (100 ms) and a
/// connect; and one more interval for every [`RETRY_BATCH`] releases owed
/// to it then (each run of the retry job sends one batch).
const RETRY_GRACE: u64 = 150_000_000;

/// The lineage of a token: a handed-over lock's section tokens `L.x` and
/// its first token `L` are one lock on the nodes.
pub(crate) fn lineage(token: &str) -> &str {
    token.split('.').next().unwrap_or(token)
}

/// One violation, at a virtual instant.
#[derive(Debug, Clone)]
pub(crate) struct Violation {
    pub(crate) at: u64,
    pub(crate) kind: Kind,
    pub(crate) what: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:?} at {:.3} ms: {}",
            self.kind,
            self.at as f64 / 1e6,
            self.what
        )
    }
}

struct Section {
    who: String,
    state: Arc<LockState>,
    granted: u64,
    /// When the round that first set its keys started (the restart rule
    /// holds back any node that lost its data after that).
    since: u64,
    /// Seen not valid (lost, or past its deadline) while not yet released.
    lapsed: bool,
    ended: bool,
}

/// The protected storage of one resource: a counter updated by
/// read-modify-write, refusing stale fencing tokens when they are used.
#[derive(Debug, Default)]
struct Protected {
    value: u64,
    last_fence: u64,
}

/// Counts for the run's report.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Stats {
    pub(crate) grants: u64,
    /// Grants of locks of several resources.
    pub(crate) sets: u64,
    /// Grants of read locks, and of those while another reader of the
    /// resource was valid (shared).
    pub(crate) reads: u64,
    pub(crate) shared_reads: u64,
    /// Writers' calls made while readers held the resource (see
    /// [`Kind::WriterStarved`]).
    pub(crate) writes_behind_readers: u64,
    pub(crate) writes: u64,
    pub(crate) refused: u64,
    pub(crate) lapsed: u64,
    /// Shared connections (see `multiplexed::MultiplexedStats`), summed over clients.
    pub(crate) batched: u64,
    pub(crate) closed_batches: u64,
    pub(crate) orphan_replies: u64,
    pub(crate) deferred: u64,
}

/// Every checker's state.
pub(crate) struct Checker {
    pub(crate) violations: Vec<Violation>,
    pub(crate) stats: Stats,
    /// When each section began (virtual ns), in order.
    pub(crate) grants_at: Vec<u64>,
    base: Instant,
    sections: BTreeMap<usize, Section>,
    next_section: usize,
    max_fence: BTreeMap<String, u64>,
    /// The clients' node timeout (ns).
    pub(crate) node_timeout: u64,
    /// Per lineage and node (the node engine writes each node on
    /// connections of its own, and sends each node its owed deletes
    /// again), when the last command that landed (set or kept the key) was
    /// sent and when the last one landed, and when the last delete that
    /// could reach it was sent.
    landed: BTreeMap<(String, usize), (u64, u64)>,
    deleted: BTreeMap<(String, usize), u64>,
    /// Per lineage, when the client let go of it and the live copies left
    /// then (node, until when): see [`owed`](Self::owed).
    owed: BTreeMap<String, Vec<LetGo>>,
    /// Per token, over the commands that set its expiry: the latest send
    /// time plus TTL, and the longest TTL (they may land in any order).
    last_write: BTreeMap<String, (u64, Duration)>,
    stores: BTreeMap<String, Protected>,
    last_keys_check: u64,
    /// The longest a message can be in flight in this run (ns).
    max_delay: u64,
    /// Lineages of clients whose process died: their keys expire by their
    /// TTL, no delete is owed (see [`abandon`](Self::abandon)).
    abandoned: std::collections::BTreeSet<String>,
    /// The elections' leaders (see [`leaders`](crate::testing::sim::leaders)).
    pub(crate) leaders: crate::testing::sim::leaders::Leaders,
}

impl Checker {
    pub(crate) fn new(base: Instant, max_delay: u64) -> Self {
        Checker {
            violations: Vec::new(),
            stats: Stats::default(),
            grants_at: Vec::new(),
            base,
            sections: BTreeMap::new(),
            next_section: 0,
            max_fence: BTreeMap::new(),
            last_write: BTreeMap::new(),
            node_timeout: 0,
            landed: BTreeMap::new(),
            deleted: BTreeMap::new(),
            owed: BTreeMap::new(),
            stores: BTreeMap::new(),
            last_keys_check: 0,
            max_delay,
            abandoned: Default::default(),
            leaders: Default::default(),
        }
    }

    pub(crate) fn fail(&mut self, at: u64, kind: Kind, what: String) {
        // One of each kind is enough to report (and keeps runs cheap).
        if !self.violations.iter().any(|v| v.kind == kind) {
            self.violations.push(Violation { at, kind, what });
        }
    }

    pub(crate) fn violation(&mut self, at: u64, what: String) {
        self.fail(at, Kind::Crash, what);
    }

    fn nanos(&self, t: Instant) -> u64 {
        u64::try_from(t.saturating_duration_since(self.base).as_nanos()).unwrap_or(u64::MAX)
    }

    fn held(&self, s: &Section, now: u64) -> bool {
        !s.ended
            && !s.state.is_lost()
            && !s.state.is_released()
            && self.nanos(s.state.deadline()) > now
    }

    /// A critical section starts: returns its handle for [`end`](Self::end).
    /// A lock of several resources is one section over all of them.
    pub(crate) fn grant(&mut self, now: u64, state: &Arc<LockState>, who: &str) -> usize {
        self.stats.grants += 1;
        self.grants_at.push(now);
        self.stats.sets += u64::from(!state.also.is_empty());
        self.stats.reads += u64::from(state.is_read());
        let mut overlap = None;
        let mut shared = false;
        for s in self.sections.values() {
            if !self.held(s, now) || !shares(&s.state, state) {
                continue;
            }
            shared |= state.is_read() && s.state.is_read();
            if conflicts(&s.state, state) {
                overlap = Some(format!(
                    "{who} granted {:?} {} while {} (granted at {:.3} ms {}) still holds it until {:.3} ms",
                    names(state),
                    role(state),
                    s.who,
                    s.granted as f64 / 1e6,
                    role(&s.state),
                    self.nanos(s.state.deadline()) as f64 / 1e6
                ));
            }
        }
        self.stats.shared_reads += u64::from(shared);
        if let Some(what) = overlap {
            self.fail(now, Kind::TwoHolders, what);
        }
        if let Some(f) = state.fence {
            // A lock of several: one token above every resource's last.
            for r in names(state) {
                let r: &str = r;
                let max = *self.max_fence.entry(r.to_owned()).or_default();
                if f <= max {
                    let what = format!("{who} got fencing token {f} for {r:?}, not above {max}");
                    self.fail(now, Kind::FenceOrder, what);
                }
                let max = self.max_fence.entry(r.to_owned()).or_default();
                *max = (*max).max(f);
            }
        }
        self.next_section += 1;
        let id = self.next_section;
        self.sections.insert(
            id,
            Section {
                who: who.to_owned(),
                state: state.clone(),
                granted: now,
                since: self.nanos(state.timing().since),
                lapsed: false,
                ended: false,
            },
        );
        id
    }

    /// The section's holder is done. `told_held`: what the API told it at
    /// the end (no loss reported, validity left, `run` returned Ok).
    pub(crate) fn end(&mut self, id: usize, now: u64, told_held: bool) {
        let Some(mut s) = self.sections.remove(&id) else {
            return;
        };
        s.ended = true;
        let (lapsed, who) = (s.lapsed, s.who.clone());
        if lapsed {
            self.stats.lapsed += 1;
            if told_held {
                let what = format!("{who}'s lock lapsed during its section; it was told it held");
                self.fail(now, Kind::Unsignalled, what);
            }
        }
    }

    /// Reads the protected value (registering the token, when fenced).
    pub(crate) fn read(&mut self, resource: &str, fence: Option<u64>) -> u64 {
        let p = self.stores.entry(resource.to_owned()).or_default();
        if let Some(f) = fence {
            p.last_fence = p.last_fence.max(f);
        }
        p.value
    }

    /// Writes `read + 1`; false when the store refused a stale token.
    pub(crate) fn write(
        &mut self,
        now: u64,
        resource: &str,
        read: u64,
        fence: Option<u64>,
        who: &str,
    ) -> bool {
        let p = self.stores.entry(resource.to_owned()).or_default();
        if fence.is_some_and(|f| f < p.last_fence) {
            self.stats.refused += 1;
            return false;
        }
        let current = p.value;
        p.value = read + 1;
        if let Some(f) = fence {
            p.last_fence = p.last_fence.max(f);
        }
        self.stats.writes += 1;
        if current != read {
            let what = format!(
                "{who} wrote {resource:?} = {} from a read of {read}, over {current} written meanwhile",
                read + 1
            );
            self.fail(now, Kind::LostUpdate, what);
        }
        true
    }

    /// At the end of a run: every key of ours that landed on a node had a
    /// delete sent to it after (nothing is left locked by accident), once
    /// the node could be reached. Knowing when each node could be reached:
    /// a copy whose node took no connection from the moment the client let
    /// go until the copy expired could not be deleted, and is no leak
    /// (nothing is left locked: it expired). Nor one whose node never took
    /// connections for [`RETRY_GRACE`] and a node timeout on end (and an
    /// interval more per [`RETRY_BATCH`] releases that may be queued for it,
    /// beyond the first two) in that time: owed
    /// releases are sent again every 100 ms, so such a copy may rightly
    /// outlive the release by up to that much, and never past its TTL.
    pub(crate) fn finish_with(&mut self, now: u64, nodes: &[impl Observed]) {
        // The client owes deletes until its keys expire as it measures time
        // (the send of its last write and that TTL): a node whose clock was
        // set back keeps one longer, which no client can know.
        let mut expires: BTreeMap<&str, u64> = BTreeMap::new();
        for (token, &(until, _)) in &self.last_write {
            let e = expires.entry(lineage(token)).or_default();
            *e = (*e).max(until);
        }
        // Every let-go (lineage, when): a release round gives a failing node
        // a trial, and queues the delete for it when refused, whether or not
        // a copy is there; so a node's retry queue holds at most these.
        let let_goes: Vec<(u64, u64)> = self
            .owed
            .iter()
            .flat_map(|(l, v)| {
                let until = expires.get(l.as_str()).copied().unwrap_or(u64::MAX);
                v.iter().map(move |(at, _)| (*at, until))
            })
            .collect();
        // A copy is owed a delete only if its node could be reached, before
        // the copy expired, for long enough for the retry job to come round
        // to it (the let-go's own round may wait out a reply lost on a
        // connection that hangs, or give the node only a trial, and leave its
        // delete to the retry job).
        let timeout = self.node_timeout;
        let expired_unreached = |l: &str, i: usize, at: u64, until: u64| {
            let Some(n) = nodes.get(i) else {
                return false;
            };
            let until = n
                .copy_until(at, until)
                .min(expires.get(l).copied().unwrap_or(u64::MAX));
            let queued = let_goes
                .iter()
                .filter(|&&(a, u)| a < until && u > at)
                .count() as u64;
            let every = u64::try_from(RETRY_EVERY.as_nanos()).unwrap_or(u64::MAX);
            let runs = queued.div_ceil(RETRY_BATCH as u64).saturating_sub(1);
            let grace = RETRY_GRACE + timeout + every * runs;
            n.longest_reachable(at, until) < grace
        };
        let unsendable = |l: &str, node: usize, written: u64| {
            self.owed.get(l).into_iter().flatten().any(|(at, copies)| {
                *at >= written
                    && copies
                        .iter()
                        .filter(|&&(i, _)| i == node)
                        .all(|&(i, until)| expired_unreached(l, i, *at, until))
            })
        };
        // A node that lost its keys since a write landed holds none of it.
        let kept = |node: usize, at: u64| nodes.get(node).is_some_and(|n| !n.lost_keys_since(at));
        if std::env::var_os("QUORUMLOCK_SIM_TRACE").is_some() {
            for ((l, node), &(t, at)) in &self.landed {
                if self.deleted.get(&(l.clone(), *node)).is_none_or(|&d| d < t) {
                    println!(
                        "leak account: {} node {node} written {:.3} landed {:.3}: kept {}, unsendable {}, owed {:?}",
                        l.get(..8).unwrap_or(l), t as f64 / 1e6, at as f64 / 1e6,
                        kept(*node, at), unsendable(l, *node, t), self.owed.get(l)
                    );
                }
            }
        }
        let leaked: Vec<String> = self
            .landed
            .iter()
            .filter(|(k, &(t, _))| self.deleted.get(*k).is_none_or(|&d| d < t))
            .filter(|((_, node), &(_, at))| kept(*node, at))
            .filter(|((l, _), _)| !self.abandoned.contains(l))
            .filter(|((l, node), &(t, _))| !unsendable(l, *node, t))
            .map(|((l, node), (t, _))| {
                format!("{l} on node {node} (written at {:.3} ms)", *t as f64 / 1e6)
            })
            .collect();
        if !leaked.is_empty() {
            let what = format!("no delete sent after the last write of {leaked:?}");
            self.fail(now, Kind::Leaked, what);
        }
    }

    /// The continuous checks, at every step.
    pub(crate) fn observe(&mut self, now: u64, nodes: &[impl Observed], base: Instant) {
        let mut two = None;
        let live: Vec<&Section> = self.sections.values().collect();
        for (i, a) in live.iter().enumerate() {
            if self.held(a, now) {
                let t = a.state.timing();
                if t.deadline > crate::clock::after(t.since, t.ttl) {
                    let what = format!("{} valid until since + {:?}", a.who, t.deadline - t.since);
                    two.get_or_insert((Kind::DeadlineBeyondTtl, what));
                }
                for b in &live[i + 1..] {
                    if conflicts(&a.state, &b.state) && self.held(b, now) {
                        let what = format!(
                            "{} and {} both valid for {:?} {} and {:?} {}",
                            a.who,
                            b.who,
                            names(&a.state),
                            role(&a.state),
                            names(&b.state),
                            role(&b.state)
                        );
                        two.get_or_insert((Kind::TwoHolders, what));
                    }
                }
            }
        }
        if let Some((kind, what)) = two {
            self.fail(now, kind, what);
        }
        for (kind, what) in self.leaders.observe(now, nodes) {
            self.fail(now, kind, what);
        }
        // What the guard reports held must be on a majority of the nodes.
        let quorum = crate::algorithm::quorum::quorum(nodes.len());
        let mut short = None;
        for a in self.sections.values() {
            if nodes.is_empty() || !self.held(a, now) {
                continue;
            }
            let own = lineage(&a.state.token);
            // A node counts only with every key of the lock (all or
            // nothing per node: its vote was for the whole set).
            let holding = nodes
                .iter()
                .filter(|n| {
                    n.wiped_since(a.since)
                        || names(&a.state).iter().all(|r| n.holds(base, now, r, own))
                })
                .count();
            if holding < quorum {
                short.get_or_insert(format!(
                    "{} holds {:?} until {:.3} ms, but its keys are on {holding} of {} nodes",
                    a.who,
                    names(&a.state),
                    self.nanos(a.state.deadline()) as f64 / 1e6,
                    nodes.len()
                ));
            }
        }
        if let Some(what) = short {
            self.fail(now, Kind::DeadlineBeyondKeys, what);
        }
        for s in self.sections.values_mut() {
            if !s.ended
                && !s.state.is_released()
                && (s.state.is_lost() || {
                    let d = u64::try_from(
                        s.state
                            .deadline()
                            .saturating_duration_since(base)
                            .as_nanos(),
                    )
                    .unwrap_or(u64::MAX);
                    d <= now
                })
            {
                s.lapsed = true;
            }
        }
        // Keys: gone within one TTL of their section's end (in the node's
        // time), plus the network's longest delay and any time the node was
        // unreachable (it may run commands it held meanwhile).
        if now < self.last_keys_check + 1_000_000 {
            return;
        }
        self.last_keys_check = now;
        for (i, node) in nodes.iter().enumerate() {
            if !node.judged() {
                continue;
            }
            let local = node.local(base, now);
            for (resource, token, expiry) in node.store().entries() {
                if expiry <= local {
                    continue;
                }
                let Some(&(until, ttl)) = self.last_write.get(token) else {
                    continue;
                };
                // A TTL runs slower on a slow node clock.
                let slow = ttl.as_nanos() as f64 * (1.0 / node.rate() - 1.0);
                let bound =
                    until + self.max_delay + node.unreachable() + slow.max(0.0) as u64 + 2_000_000;
                if now > bound {
                    let what = format!(
                        "node {i} still holds {resource:?} {:.3} ms past its last write's TTL ({ttl:?}; {:?} left)",
                        (now - until) as f64 / 1e6,
                        expiry - local,
                    );
                    self.fail(now, Kind::KeyOutlived, what);
                }
            }
        }
    }
}

#[path = "check_leaks.rs"]
mod leaks;
#[cfg(test)]
#[path = "check_tests.rs"]
mod tests;

/// Every resource of a lock (one, or those of a lock of several).
fn names(s: &LockState) -> Vec<&str> {
    std::iter::once(s.resource.as_str())
        .chain(s.also.iter().map(String::as_str))
        .collect()
}

/// Whether two locks share a resource.
fn shares(a: &LockState, b: &LockState) -> bool {
    let b = names(b);
    names(a).iter().any(|r| b.contains(r))
}

/// How a lock holds its resources, for a violation's message.
fn role(s: &LockState) -> &'static str {
    if s.is_read() {
        "to read"
    } else {
        "to write"
    }
}

/// Whether two locks exclude each other: they share a resource, and one
/// of them at least is a writer (two readers share).
pub(crate) fn conflicts(a: &LockState, b: &LockState) -> bool {
    shares(a, b) && !(a.is_read() && b.is_read())
}
