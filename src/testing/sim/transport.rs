//! The transport through which the production engine talks to the
//! simulated world: one per client (process), with the node layer's health
//! and admission rules.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::algorithm::health::{self, Admit, NodeHealth, Outcome};
use crate::algorithm::quorum::VoteRules;
use crate::algorithm::round::{allowance, Key, NodeResult, Op};
use crate::clock::{after, Signal};
use crate::error::{NodeError, NodeErrorKind};
use crate::lock::transport::{AfterRound, Decided, Transport, Undo};
use crate::testing::sim::redis::OwnedKey;
use crate::testing::sim::sched::Sched;
use crate::testing::sim::world::{Msg, Round};

/// One client's (one process's) view of the simulated nodes.
pub(crate) struct SimTransport {
    sched: Arc<Sched>,
    names: Vec<String>,
    /// Per entry, the node it reaches.
    entries: Vec<usize>,
    health: Arc<Mutex<Vec<NodeHealth>>>,
    timeout: Duration,
    /// Yield to the scheduler before every round.
    preempt: bool,
    rules: VoteRules,
    watches: crate::testing::sim::wakeups::Watches,
}

impl SimTransport {
    pub(crate) fn new(
        sched: &Arc<Sched>,
        timeout: Duration,
        preempt: bool,
        rules: VoteRules,
    ) -> Self {
        let (names, entries) = {
            let core = sched.lock();
            (core.world.names.clone(), core.world.entries.clone())
        };
        SimTransport {
            sched: sched.clone(),
            health: Arc::new(Mutex::new(vec![NodeHealth::default(); names.len()])),
            names,
            entries,
            timeout,
            preempt,
            rules,
            watches: Default::default(),
        }
    }

    /// Sends `op` to the nodes `admits` lets through, on connections
    /// `lanes` (new ones when empty), as one round; nodes not waited for
    /// count as failed until their reply arrives, as in `node.rs`.
    fn send(&self, op: Op, keys: &[Key<'_>], admits: &[Admit], lanes: &mut Vec<u64>) -> Arc<Round> {
        let n = self.names.len();
        let health = self.health.lock().clone();
        let prefilled: Vec<Option<NodeResult>> = (0..n)
            .map(|i| (admits[i] != Admit::Wait).then(|| Err(self.not_waited(i, &health))))
            .collect();
        let round = Arc::new(Round {
            results: Mutex::new(prefilled),
            replied: Mutex::new(vec![false; n]),
            signal: Arc::new(Signal::default()),
            open: AtomicBool::new(true),
            health: self.health.clone(),
            rules: self.rules,
        });
        let owned: Vec<OwnedKey> = keys
            .iter()
            .map(|k| OwnedKey {
                resource: k.resource.to_owned(),
                token: k.token.to_owned(),
                next: k.next.map(str::to_owned),
            })
            .collect();
        let now = self.sched.nanos();
        let mut core = self.sched.lock();
        let world = &mut core.world;
        world.check.sent(op, keys, now);
        if lanes.is_empty() {
            for _ in 0..n {
                world.next_lane += 1;
                lanes.push(world.next_lane);
            }
        }
        for (i, &lane) in lanes.iter().enumerate() {
            if admits[i] != Admit::Skip {
                let msg = Msg {
                    node: self.entries[i],
                    entry: i,
                    sent: now,
                    op,
                    keys: owned.clone(),
                    round: Some(round.clone()),
                    wire: None,
                    lane,
                };
                world.send(msg, lane, now);
            }
        }
        round
    }

    /// The error of a node not waited for, as `node.rs` words it.
    fn not_waited(&self, i: usize, health: &[NodeHealth]) -> NodeError {
        let kind = match health[i] {
            NodeHealth::Failing {
                last: Outcome::Refused,
                ..
            } => NodeErrorKind::Unavailable,
            _ => NodeErrorKind::Skipped,
        };
        NodeError::new(&self.names[i], kind, "not waited for")
    }

    /// Waits for `round`'s replies from the nodes in `wait` until
    /// `decided` or `deadline`; returns the results and whether it settled.
    fn gather(
        &self,
        round: &Round,
        wait: &[bool],
        deadline: Instant,
        decided: Option<Decided<'_>>,
        linger: bool,
    ) -> (Vec<Option<NodeResult>>, bool) {
        let start = self.sched.instant(self.sched.nanos());
        // As `node.rs`: a lingering round reads on after it settled, for as
        // long again as it took.
        let mut settled: Option<Instant> = None;
        loop {
            let seen = round.signal.seen();
            let results = round.results.lock().clone();
            let now = self.sched.instant(self.sched.nanos());
            if settled.is_none() && decided.is_some_and(|f| f(&results) == 0) {
                if !linger {
                    return (results, true);
                }
                let again = now.saturating_duration_since(start);
                settled = Some(now.checked_add(again).map_or(deadline, |l| l.min(deadline)));
            }
            let missing = (0..results.len()).any(|i| wait[i] && results[i].is_none());
            let until = settled.unwrap_or(deadline);
            if !missing || now >= until {
                return (results, settled.is_some());
            }
            self.sched.wait_signal(&round.signal, seen, Some(until));
        }
    }
}

impl Transport for SimTransport {
    fn node_names(&self) -> &[String] {
        &self.names
    }

    /// As a connection made now learns them (this transport models no
    /// connect): the history of every node that is up. Cut off or not: a
    /// history learnt is one that had begun, which is all the restart rule
    /// asks of it, and the most this can send (the sternest test of it).
    fn begun(&self, _until: Option<Instant>) -> Vec<u64> {
        let core = self.sched.lock();
        let world = &core.world;
        self.entries
            .iter()
            .map(|&node| {
                let n = &world.nodes[node];
                if n.state == crate::testing::sim::world::NodeState::Up {
                    n.store.begun()
                } else {
                    0
                }
            })
            .collect()
    }

    crate::testing::sim::wakeups::wake_ups_of!(names);

    fn run(
        &self,
        op: Op,
        keys: &[Key<'_>],
        deadline: Instant,
        decided: Option<Decided<'_>>,
        undo: Option<Undo<'_>>,
    ) -> Vec<NodeResult> {
        let n = self.names.len();
        if self.preempt {
            // Another thread may run between the caller's decision to send
            // and the send (preemption, which blocking points alone miss).
            self.sched.yield_now();
        }
        let start = self.sched.instant(self.sched.nanos());
        // The production node layer's admission rules.
        let mut admits: Vec<Admit> = self
            .health
            .lock()
            .iter_mut()
            .map(|h| h.admit(start))
            .collect();
        let release = matches!(op, Op::Release { .. });
        // An entry that reaches the server of an earlier one, as the
        // driver learns at connect.
        let twins: Vec<bool> = (0..n)
            .map(|i| self.rules.one_per_server && self.entries[..i].contains(&self.entries[i]))
            .collect();
        health::admit_round(
            &mut admits,
            release,
            crate::algorithm::quorum::quorum(n),
            &twins,
        );
        let sent: Vec<bool> = admits.iter().map(|a| *a != Admit::Skip).collect();
        let wait: Vec<bool> = admits.iter().map(|a| *a == Admit::Wait).collect();
        let mut lanes = Vec::new();
        let round = self.send(op, keys, &admits, &mut lanes);
        let linger = matches!(op, Op::Extend { linger: true, .. });
        let (results, settled) = self.gather(&round, &wait, deadline, decided, linger);
        round.open.store(false, Ordering::Release);
        let end = self.sched.instant(self.sched.nanos());
        let results: Vec<NodeResult> = results
            .into_iter()
            .enumerate()
            .map(|(i, r)| {
                r.unwrap_or_else(|| {
                    let (kind, why) = if settled {
                        (NodeErrorKind::NotAwaited, "settled before its reply")
                    } else {
                        // Only a node that had the whole node timeout
                        // (one more per 200 keys) failed; a round cut
                        // short by the caller's deadline says nothing
                        // about it (rule 2).
                        if end.saturating_duration_since(start)
                            >= allowance(self.timeout, keys.len())
                        {
                            self.health.lock()[i].observe(end, Outcome::TimedOut);
                        }
                        (NodeErrorKind::Timeout, "no reply")
                    };
                    Err(NodeError::new(&self.names[i], kind, why))
                })
            })
            .collect();
        // `AfterRound::Complete` has nothing to do here: a round reaches
        // every node it waits for (no pool to run dry).
        if let (Some(undo), Op::Acquire { ttl, .. } | Op::Swap { ttl, .. }) = (undo, op) {
            if undo(&results) == AfterRound::Undo {
                // Where our write may have landed, on the same connections,
                // waiting (but for a swap's) for the nodes that answered.
                let written = crate::algorithm::round::written(op, keys);
                let rel = Op::Release {
                    keep_until: after(start, ttl),
                    notice: 0,
                };
                let health = self.health.lock().clone();
                let admits: Vec<Admit> = (0..n)
                    .map(|i| match (sent[i], &results[i]) {
                        (false, _) if matches!(op, Op::Swap { .. }) => Admit::Trial,
                        (false, _) => Admit::Skip,
                        (true, Ok(_)) => Admit::Wait,
                        (true, Err(_)) if health[i].is_healthy() => Admit::Wait,
                        (true, Err(_)) => Admit::Trial,
                    })
                    .collect();
                let wait: Vec<bool> = admits.iter().map(|a| *a == Admit::Wait).collect();
                let undo_round = self.send(rel, &written, &admits, &mut lanes);
                let wait_for = match op {
                    Op::Swap { .. } => Duration::ZERO,
                    _ => allowance(self.timeout, written.len()),
                };
                let now = self.sched.instant(self.sched.nanos());
                self.gather(&undo_round, &wait, after(now, wait_for), None, false);
                undo_round.open.store(false, Ordering::Release);
            }
        }
        results
    }
}
