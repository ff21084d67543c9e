//! Elections in the simulation: candidates run the production
//! [`Election`] (campaign, renewal, resignation: the same decision code as
//! in production, over the simulated nodes and network), each in a process
//! of its own that may die (it writes nothing more: its lease is neither
//! renewed nor released) or be paused (its renewal thread too) past its
//! lease; [`leaders`](crate::testing::sim::leaders) checks them.
//!
//! What the simulation cannot run of the election API:
//! [`Leadership::wait_end`] waits on channels in real time (the crate's
//! `Clock` does not carry them), so no virtual time passes in it (and a
//! loop on `wait_end` would never see its lease run out): it runs only
//! where the leadership has ended (it returns at once). [`Election::run`]'s
//! pause between terms and an observer's pauses sleep on the client's
//! clock, virtual here.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use crate::clock::Clock;
use crate::election::{Election, Leadership};
use crate::error::Error;
use crate::lock::settings::Settings;
use crate::redlock::Redlock;
use crate::testing::sim::check::Kind;
use crate::testing::sim::leaders::{End, Pace};
use crate::testing::sim::links::Fate;
use crate::testing::sim::rng::SimRng;
use crate::testing::sim::{Ctx, MS};

const T: fn(u64) -> Duration = Duration::from_millis;

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl Ctx {
    /// A new client in a process of its own, and its fate (see [`Fate`]).
    pub(crate) fn process(&self, settings: Settings) -> (Redlock, Arc<Fate>) {
        let fate = Arc::new(Fate::default());
        let locks = crate::testing::sim::client_in(self, settings, self.plan.seed, fate.clone());
        (locks, fate)
    }

    /// The process of `fate` dies now: what it wrote expires by its TTL.
    pub(crate) fn kill(&self, fate: &Fate) {
        let lineages = fate.kill();
        self.with(|c| c.abandon(lineages));
    }

    /// `election` is judged by `pace` (see [`Pace`]).
    pub(crate) fn pace(&self, election: &str, pace: Pace) {
        self.with(|c| c.leaders.pace(election, pace));
    }

    /// The failover pace of an election with `ttl` under this run's
    /// settings: the TTL, the retry pause and `slack`; a node counts once
    /// sound for a trial of a failing node and an attempt, and, having lost
    /// its data, the longest TTL in use (the restart rule) and an attempt;
    /// a lossy network's failovers count once it heals (at `run_for`).
    pub(crate) fn pace_of(&self, ttl: Duration, slack: Duration) -> Pace {
        let s = &self.plan.settings;
        let longest = self
            .plan
            .ttls
            .iter()
            .copied()
            .map(T)
            .max()
            .unwrap_or_default()
            .max(ttl);
        let n = self.plan.entries.len();
        let net = &self.plan.net;
        let lossy = net.loss > 0.0 || net.spike > 0.0;
        Pace {
            delivers: if lossy { self.plan.run_for } else { 0 },
            bound: nanos(ttl + s.retry_delay + s.retry_jitter + slack),
            settle: nanos(crate::algorithm::health::TRIAL_EVERY + self.per_attempt()),
            restart: nanos(longest + self.per_attempt()),
            need: crate::algorithm::quorum::quorum(n).min(self.plan.nodes),
        }
    }

    /// Candidate `who` of `election` begins (`true`) or ends a campaign.
    pub(crate) fn campaigning(&self, election: &str, who: &str, on: bool) {
        let now = self.now();
        self.with(|c| c.leaders.campaigning(election, who, on.then_some(now)));
    }

    /// `who` was elected with `lease`: its reign's handle.
    pub(crate) fn elected(&self, who: &str, lease: &Arc<Leadership>) -> usize {
        let now = self.now();
        let (id, found) = self.with(|c| {
            let (id, found) = c.leaders.elected(now, who, lease.clone());
            for (kind, what) in found.iter().cloned() {
                c.fail(now, kind, what);
            }
            (id, found)
        });
        self.trace(who, || {
            format!(
                "elected in term {} of {:?} ({:?} valid){}",
                lease.term(),
                lease.name(),
                lease.validity(),
                if found.is_empty() { "" } else { ": VIOLATION" }
            )
        });
        id
    }

    /// `who` leads `election` in `term` (a leadership the checkers cannot
    /// read, as `Election::run` lends it): the terms' checks only.
    pub(crate) fn term_granted(&self, election: &str, who: &str, term: u64) {
        let now = self.now();
        self.with(|c| {
            if let Some((kind, what)) = c.leaders.term(election, who, term, now) {
                c.fail(now, kind, what);
            }
            c.leaders.stats.elected += 1;
        });
    }

    /// The leader of reign `id` died now.
    pub(crate) fn leader_died(&self, id: usize) {
        let now = self.now();
        self.with(|c| c.leaders.died(id, now));
    }

    /// Reign `id` of `lease` ends now: the leadership, back from the
    /// checkers (`None`: it was not theirs).
    pub(crate) fn leader_ended(
        &self,
        id: usize,
        how: End,
        lease: Arc<Leadership>,
    ) -> Option<Leadership> {
        let now = self.now();
        // (Dropped out of the checkers' lock.)
        let theirs = self.with(|c| c.leaders.ended(id, now, how))?;
        drop(theirs);
        Arc::into_inner(lease)
    }

    /// A leader resumed from a pause past its lease and read `is_leader()`.
    pub(crate) fn stale_check(&self, who: &str, read: bool, ended: bool) {
        self.with(|c| c.leaders.stats.stale_checks += 1);
        if read {
            self.fail(
                Kind::StaleLeader,
                format!("{who}, paused past its lease, read is_leader() == true when it resumed"),
            );
        } else if !ended {
            self.fail(
                Kind::StaleLeader,
                format!("{who}, paused past its lease, was told by wait_end that it still led"),
            );
        }
    }

    /// `election.leader()`, checked against the reign valid throughout.
    pub(crate) fn read_leader(&self, election: &Election) {
        let start = self.now();
        let got = election.leader();
        let now = self.now();
        let seen = match &got {
            Ok(l) => Ok(l.as_ref().map(|l| (l.id().to_owned(), l.term()))),
            Err(_) => Err(()),
        };
        let name = election.name();
        let found = {
            let mut core = self.sched.lock();
            let world = &mut core.world;
            world
                .check
                .leaders
                .read(name, (start, now), seen, &world.nodes)
        };
        self.trace("reader", || format!("leader() -> {got:?}"));
        if let Some((kind, what)) = found {
            self.fail(kind, what);
        }
    }

    /// Stops every registered election (at the end of the workload).
    pub(crate) fn stop_elections(&self) {
        for e in self.elections.lock().drain(..) {
            e.stop();
        }
    }
}

/// What a candidate does with its leadership, drawn per step.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Odds {
    /// Its process dies (per step).
    pub(crate) death: f64,
    /// Its process is paused (per step), and of those, past the lease.
    pub(crate) pause: f64,
    pub(crate) past: f64,
    /// At the end, it resigns (else drops the leadership).
    pub(crate) resign: f64,
    /// Most steps of a reign.
    pub(crate) steps: u64,
    /// A campaign is a `campaign_for` (else a `campaign`).
    pub(crate) campaign_for: f64,
}

impl Default for Odds {
    fn default() -> Self {
        Odds {
            death: 0.04,
            pause: 0.08,
            past: 0.7,
            resign: 0.8,
            steps: 8,
            campaign_for: 0.25,
        }
    }
}

/// One candidate of `name` (TTL `ttl`) until the workload ends: it
/// campaigns (`campaign`, or now and then `campaign_for`), leads (see
/// [`lead`]), and campaigns again; a process of it that dies is followed
/// by a new one (a supervisor's restart, with a new id).
pub(crate) fn candidate(
    ctx: &Arc<Ctx>,
    name: &str,
    ttl: Duration,
    mut rng: SimRng,
    base: &str,
    odds: Odds,
) {
    let clock = ctx.clock();
    let end = ctx.plan.run_for;
    for life in 0.. {
        if ctx.now() >= end {
            return;
        }
        let who = format!("{base}.{life}");
        let (locks, fate) = ctx.process(ctx.plan.settings.clone());
        let election = locks.election(name, ttl).id(&who);
        ctx.elections.lock().push(election.clone());
        loop {
            if ctx.now() >= end || election.is_stopped() {
                return;
            }
            let start = ctx.now();
            ctx.campaigning(name, &who, true);
            let wait = rng.chance(odds.campaign_for).then(|| T(rng.below(300)));
            let got = match wait {
                Some(w) => election.campaign_for(w),
                None => election.campaign(),
            };
            ctx.campaigning(name, &who, false);
            ctx.trace(&who, || {
                format!(
                    "campaign ({wait:?}) -> {:?}",
                    got.as_ref().map(Leadership::term)
                )
            });
            if let Some(w) = wait {
                crate::testing::sim::workload::check_wait(
                    ctx,
                    "campaign_for",
                    Duration::from_nanos(ctx.now() - start),
                    w,
                );
            }
            match got {
                Ok(l) => {
                    if lead(ctx, &mut rng, l, &fate, &who, ttl, odds) == End::Died {
                        break;
                    }
                }
                Err(Error::Stopped) => return,
                Err(e) if e.is_retryable() => {}
                Err(e) => ctx.fail(Kind::Crash, format!("{who}: campaign: {e}")),
            }
            clock.sleep(T(rng.below(30)));
        }
    }
}

/// A reign: steps, each checking `is_leader()` before a write fenced by
/// the term; maybe the process pauses (then, past its lease, it must read
/// `is_leader() == false` on resuming, before acting) or dies (its lease
/// stays, unrenewed, to its deadline); then it resigns or drops the
/// leadership. How it ended.
pub(crate) fn lead(
    ctx: &Arc<Ctx>,
    rng: &mut SimRng,
    l: Leadership,
    fate: &Fate,
    who: &str,
    ttl: Duration,
    odds: Odds,
) -> End {
    let clock = ctx.clock();
    let (term, name) = (l.term(), l.name().to_owned());
    let l = Arc::new(l);
    let id = ctx.elected(who, &l);
    let steps = 1 + rng.below(odds.steps);
    for _ in 0..steps {
        if rng.chance(odds.death) {
            die(ctx, l, fate, id, who);
            return End::Died;
        }
        if rng.chance(odds.pause) {
            // Past its lease: longer than any validity it can have.
            let past = rng.chance(odds.past);
            let d = if past {
                ttl + ttl * rng.below(3) as u32 / 2 + T(1)
            } else {
                T(rng.below(nanos(ttl) / MS / 2 + 1))
            };
            ctx.trace(who, || format!("process paused for {d:?}"));
            fate.pause_until(ctx.now() + nanos(d));
            clock.sleep(d);
            let read = l.is_leader();
            if past {
                let ended = read || l.wait_end(T(1));
                ctx.stale_check(who, read, ended);
            }
        }
        if !l.is_leader() {
            break;
        }
        let read = ctx.with(|c| c.read(&name, Some(term)));
        clock.sleep(Duration::from_nanos(rng.below(nanos(ttl) / 4 + 1)));
        if !l.is_leader() {
            break;
        }
        let now = ctx.now();
        ctx.with(|c| c.write(now, &name, read, Some(term), who));
    }
    let how = if l.validity().is_zero() {
        End::Lost
    } else {
        End::Resigned
    };
    match ctx.leader_ended(id, how, l) {
        Some(l) if rng.chance(odds.resign) => {
            let out = l.resign();
            ctx.trace(who, || format!("resigned: {out:?}"));
        }
        Some(l) => drop(l),
        None => ctx.fail(
            Kind::Crash,
            format!("{who}: its leadership was not handed back"),
        ),
    }
    how
}

/// The process of a leader dies: its lease stays on the nodes, unrenewed,
/// and valid as its client computed it until its deadline, while the
/// checkers read it; then what is left of it goes (a dead process sends
/// nothing).
fn die(ctx: &Arc<Ctx>, l: Arc<Leadership>, fate: &Fate, id: usize, who: &str) {
    ctx.trace(who, || format!("process dies, {:?} left", l.validity()));
    ctx.kill(fate);
    ctx.leader_died(id);
    // A round in flight at the death may still move the deadline.
    while !l.validity().is_zero() {
        ctx.clock().sleep(l.validity() + T(1));
    }
    // Its release sends nothing.
    drop(ctx.leader_ended(id, End::Died, l));
}

/// The random workload's elections (a plan with `elections`): two or three
/// candidates of one election, its TTL one of the plan's, and a reader of
/// `leader()`; stopped when the workload ends.
pub(crate) fn start(ctx: &Arc<Ctx>, rng: &mut SimRng) {
    let ttls = &ctx.plan.ttls;
    let ttl = T(ttls[rng.below(ttls.len() as u64) as usize]);
    let candidates = 2 + rng.below(2) as usize;
    campaign(ctx, "e0", ttl, candidates, Odds::default(), rng);
}

/// `candidates` candidates of `name` with `ttl` (see [`candidate`]), and a
/// reader of `leader()` that stops the election when the workload ends;
/// failovers judged with a slack of two attempts and three node timeouts.
pub(crate) fn campaign(
    ctx: &Arc<Ctx>,
    name: &'static str,
    ttl: Duration,
    candidates: usize,
    odds: Odds,
    rng: &mut SimRng,
) {
    let slack = 2 * ctx.per_attempt() + 3 * ctx.plan.settings.node_timeout;
    ctx.pace(name, ctx.pace_of(ttl, slack));
    for c in 0..candidates {
        let (ctx2, crng) = (ctx.clone(), rng.fork());
        let base = format!("{name}c{c}");
        ctx.running.fetch_add(1, Ordering::AcqRel);
        ctx.spawn(&base.clone(), move || {
            candidate(&ctx2, name, ttl, crng, &base, odds);
            ctx2.running.fetch_sub(1, Ordering::AcqRel);
            ctx2.done.notify();
        });
    }
    let ctx2 = ctx.clone();
    ctx.running.fetch_add(1, Ordering::AcqRel);
    ctx.spawn("reader", move || {
        let (locks, _) = ctx2.process(ctx2.plan.settings.clone());
        let election = locks.election(name, ttl);
        while ctx2.now() < ctx2.plan.run_for {
            ctx2.read_leader(&election);
            ctx2.clock().sleep(ttl / 3);
        }
        ctx2.stop_elections();
        ctx2.running.fetch_sub(1, Ordering::AcqRel);
        ctx2.done.notify();
    });
}
