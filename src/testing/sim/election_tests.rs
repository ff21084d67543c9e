//! Elections in the simulation (issue 42): candidates run the production
//! [`Election`](crate::Election) over the simulated nodes and network,
//! their processes dying or paused past their lease, the nodes crashing
//! (with and without their data), paused and cut off; every checker on (see
//! [`leaders`](super::leaders): never two valid leases at once, each term
//! once and rising, a leader within the bound after a resignation or a
//! death, `leader()` naming the leader), and a leader paused past its lease
//! reads `is_leader() == false` on resuming. Scripted schedules over several
//! seeds, as `sets_tests`.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::elections::{campaign, Odds};
use super::leaders::{End, LeaderStats};
use super::plan::{Fault, Mix, Net, Plan, Report, MS};
use super::rng::SimRng;
use super::simulate;
use super::tests::{describe, env_u64};
use crate::algorithm::round::candidate_of;
use crate::clock::Clock;
use crate::error::Error;
use crate::testing::sim::check::Kind;

const T: fn(u64) -> Duration = Duration::from_millis;

/// The seeds of each scripted schedule: six (`QUORUMLOCK_SIM_ELECTION_SEEDS`)
/// from 0 (`QUORUMLOCK_SIM_ELECTION_FIRST`: with `QUORUMLOCK_SIM_TRACE`,
/// one seed's trace).
fn seeds() -> std::ops::Range<u64> {
    let first = env_u64("QUORUMLOCK_SIM_ELECTION_FIRST").unwrap_or(0);
    first..first + env_u64("QUORUMLOCK_SIM_ELECTION_SEEDS").unwrap_or(6)
}

/// A seeded plan (its settings drawn as a standard run's; its network too,
/// or, `calm`, a steady one) of `nodes` nodes, without the locks' workload
/// or drawn faults: the elections run `run_for` ms, with `faults` (ms),
/// after which every node heals.
fn plan(seed: u64, nodes: usize, run_for: u64, faults: &[(u64, Fault)], calm: bool) -> Plan {
    let mut p = Plan::new(seed, Mix::Standard);
    p.rates = (0..nodes).map(|i| p.rates[i % p.rates.len()]).collect();
    p.nodes = nodes;
    p.entries = (0..nodes).collect();
    p.evicting = vec![false; nodes];
    p.clients = 0;
    p.threads = 0;
    p.stall = 0.0;
    p.foreign.clear();
    if calm {
        p.net = Net::calm();
    }
    p.run_for = run_for * MS;
    p.faults = faults.iter().map(|&(at, f)| (at * MS, f)).collect();
    p.faults.push((p.run_for, Fault::HealAll));
    p
}

/// Runs `candidates` candidates of one election (TTL `ttl` ms) with `odds`
/// in `p`.
fn elect(mut p: Plan, ttl: u64, candidates: usize, odds: Odds) -> Report {
    p.ttls = vec![ttl];
    simulate(
        p,
        Box::new(move |ctx, mut rng| campaign(ctx, "e", T(ttl), candidates, odds, &mut rng)),
    )
}

/// What a run of schedules found: every failure, and the figures.
#[derive(Default)]
struct Sum {
    runs: u64,
    failed: Vec<String>,
    stats: LeaderStats,
}

impl Sum {
    fn add(&mut self, r: &Report) {
        self.runs += 1;
        if !r.violations.is_empty() {
            self.failed.push(describe(r));
        }
        self.stats.add(&r.leaders);
    }

    /// Prints the figures; fails with every failing schedule.
    fn check(&self, what: &str) -> &LeaderStats {
        println!("{what}: {} schedules: {}", self.runs, self.stats.figures());
        assert!(
            self.failed.is_empty(),
            "{} of {} {what} schedules failed:\n{}",
            self.failed.len(),
            self.runs,
            self.failed.join("\n")
        );
        &self.stats
    }
}

/// Leaders that lead a few steps and resign: each is followed within the
/// bound (the TTL, a retry pause, slack), terms rise, never two at once.
#[test]
fn resigning_leaders_are_followed_within_the_bound() {
    let odds = Odds {
        death: 0.0,
        pause: 0.0,
        resign: 1.0,
        campaign_for: 0.0,
        ..Odds::default()
    };
    let mut sum = Sum::default();
    for seed in seeds() {
        sum.add(&elect(plan(seed, 3, 1_500, &[], true), 120, 3, odds));
    }
    let s = sum.check("resignations");
    assert!(
        s.resigned >= 10 * seeds().count() as u64,
        "{} resignations",
        s.resigned
    );
    assert!(
        s.judged >= s.resigned / 2,
        "{} of {} judged",
        s.judged,
        s.resigned
    );
}

/// Leaders whose process dies (neither renewing nor releasing its lease):
/// no one else leads until that lease is over, and someone does within the
/// bound after.
#[test]
fn dead_leaders_are_followed_within_the_bound() {
    let odds = Odds {
        death: 0.3,
        pause: 0.0,
        resign: 1.0,
        campaign_for: 0.0,
        ..Odds::default()
    };
    let mut sum = Sum::default();
    for seed in seeds() {
        sum.add(&elect(plan(seed, 3, 1_500, &[], true), 120, 3, odds));
    }
    let s = sum.check("deaths");
    assert!(s.died >= 2 * seeds().count() as u64, "{} deaths", s.died);
    let followed = s.failovers.iter().filter(|f| f.0 == End::Died).count();
    assert!(
        followed as u64 >= s.died / 2,
        "{followed} of {} deaths followed",
        s.died
    );
}

/// Leaders whose process (renewal thread and all) is paused past its lease
/// read `is_leader() == false` when they resume, before acting, and
/// `wait_end` says so at once; their reigns end lost, and others lead.
#[test]
fn leaders_paused_past_their_lease_know_it_on_resuming() {
    let odds = Odds {
        death: 0.0,
        pause: 0.4,
        past: 1.0,
        ..Odds::default()
    };
    let mut sum = Sum::default();
    for seed in seeds() {
        sum.add(&elect(plan(seed, 3, 1_500, &[], false), 60, 3, odds));
    }
    let s = sum.check("pauses");
    assert!(
        s.stale_checks >= 2 * seeds().count() as u64,
        "{} checks",
        s.stale_checks
    );
    assert!(s.lost >= s.stale_checks, "{} lost", s.lost);
    assert!(s.elected > s.stale_checks, "{} elected", s.elected);
}

/// Elections through node faults: a node crashing with and without its
/// data, paused, cut off, and a majority crashing, on three and five nodes,
/// while candidates resign, die and are paused.
#[test]
fn elections_through_node_faults() {
    let mut sum = Sum::default();
    for seed in seeds() {
        let nodes = if seed % 2 == 0 { 3 } else { 5 };
        let mut r = SimRng::new(seed ^ 0xe1ec);
        let mut at = |base: u64| base + r.below(150);
        let minority = [(0..1), (0..2)][usize::from(nodes == 5)].clone();
        let majority = [(0..2), (0..3)][usize::from(nodes == 5)].clone();
        let mut faults = Vec::new();
        for (i, n) in minority.clone().enumerate() {
            let wipe = i % 2 == 0;
            let t = at(200);
            faults.push((t, Fault::Crash(n)));
            faults.push((t + 300, Fault::Restart { node: n, wipe }));
        }
        let t = at(800);
        faults.extend(minority.clone().map(|n| (t, Fault::Pause(n + 1))));
        faults.extend(minority.clone().map(|n| (t + 250, Fault::Resume(n + 1))));
        let t = at(1_300);
        faults.extend(minority.clone().map(|n| (t, Fault::Isolate(nodes - 1 - n))));
        faults.extend(minority.map(|n| (t + 300, Fault::Heal(nodes - 1 - n))));
        let t = at(1_900);
        for n in majority {
            faults.push((t, Fault::Crash(n)));
            faults.push((
                t + 200,
                Fault::Restart {
                    node: n,
                    wipe: n == 0,
                },
            ));
        }
        let p = plan(seed, nodes, 2_800, &faults, seed % 3 == 0);
        sum.add(&elect(p, 120, 3, Odds::default()));
    }
    let s = sum.check("node faults");
    assert!(s.died > 0 && s.stale_checks > 0 && s.resigned > 0);
    assert!(s.judged > 0, "no failover judged");
}

/// An observer (`observe()`, woken by resignations) in a schedule of
/// resigning and dying leaders: every change it yields until the election
/// is stopped, (when, id, term).
fn observed(seed: u64) -> (Report, Vec<(u64, String, u64)>) {
    let mut p = plan(seed, 3, 1_000, &[], true);
    p.wakeups = true;
    p.ttls = vec![120];
    let seen = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let seen2 = seen.clone();
    let r = simulate(
        p,
        Box::new(move |ctx, mut rng| {
            let odds = Odds {
                pause: 0.0,
                ..Odds::default()
            };
            campaign(ctx, "e", T(120), 3, odds, &mut rng);
            let (locks, _) = ctx.process(ctx.plan.settings.clone());
            let election = locks.election("e", T(120));
            ctx.elections.lock().push(election.clone());
            for change in election.observe() {
                if let Ok(Some(l)) = change {
                    seen2.lock().push((ctx.now(), l.id().to_owned(), l.term()));
                }
            }
        }),
    );
    let seen = std::mem::take(&mut *seen.lock());
    (r, seen)
}

/// The observer names the leaders, one change after another, each with
/// the term it was granted (`leader()` reports a leader once its term is
/// recorded), the terms it reads never fall, and it ends when the election
/// is stopped. (On the library before the terms' own record, `leader()`
/// read the highest fencing counter among the nodes holding the
/// candidate's key, and a node the campaign's round did not wait for kept
/// its own, higher counter until the write-back set it to the granted
/// term: the observer yielded the leader with that higher term, then the
/// same leader with its own; seed 0: `ec0.0` read in term ...918641 at
/// 900.407 ms, elected in term ...903850 at 900.350 ms, read so at
/// 902.115 ms.)
///
/// Three seeds (each a few hundred ms of real time).
#[test]
fn an_observer_follows_the_leaders() {
    let mut changes = 0;
    for seed in seeds().take(3) {
        let (r, seen) = observed(seed);
        assert!(r.violations.is_empty(), "{}", describe(&r));
        assert!(seen.len() >= 3, "seed {seed}: {seen:?}");
        for (at, id, term) in &seen {
            let granted = r
                .leaders
                .grants
                .iter()
                .any(|(who, t)| who == id && t == term);
            assert!(
                granted,
                "seed {seed}: {id:?} in term {term} at {at}: never granted"
            );
        }
        for w in seen.windows(2) {
            assert!(w[0].2 <= w[1].2, "seed {seed}: terms read fell: {w:?}");
        }
        changes += seen.len();
    }
    println!(
        "{} schedules: the observer saw {changes} leaders",
        seeds().take(3).count()
    );
}

/// `stop()`: a campaign blocked behind another leader returns
/// [`Error::Stopped`] within a second and a round, and a leader of a
/// stopped election is no longer `is_leader()`.
#[test]
fn a_stopped_election_stops_campaigning_and_leading() {
    for seed in seeds() {
        let r = simulate(
            plan(seed, 3, 1_000, &[], true),
            Box::new(|ctx, _| {
                let clock = ctx.clock();
                let (a, _) = ctx.process(ctx.plan.settings.clone());
                let (b, _) = ctx.process(ctx.plan.settings.clone());
                let ea = a.election("e", T(200)).id("a");
                let eb = b.election("e", T(200)).id("b");
                let Ok(la) = ea.campaign() else {
                    return ctx.fail(Kind::Liveness, "a alone".into());
                };
                let la = Arc::new(la);
                let id = ctx.elected("a", &la);
                let stopped_at = Arc::new(AtomicU64::new(0));
                let (ctx2, eb2, at) = (ctx.clone(), eb.clone(), stopped_at.clone());
                ctx.spawn("stopper", move || {
                    ctx2.clock().sleep(T(300));
                    at.store(ctx2.now(), Ordering::Release);
                    eb2.stop();
                });
                let got = eb.campaign();
                let late = Duration::from_nanos(ctx.now() - stopped_at.load(Ordering::Acquire));
                let bound = T(1_000) + ctx.bound(ctx.per_attempt());
                if !matches!(got, Err(Error::Stopped)) || late > bound {
                    let what = format!("b's campaign: {:?}, {late:?} after stop", got.err());
                    ctx.fail(Kind::WaitBound, what);
                }
                if !la.is_leader() {
                    ctx.fail(Kind::Liveness, "a lost its lease".into());
                }
                ea.stop();
                if la.is_leader() || !la.wait_end(T(1)) {
                    ctx.fail(Kind::StaleLeader, "a leads after stop()".into());
                }
                clock.sleep(T(10));
                if let Some(l) = ctx.leader_ended(id, End::Resigned, la) {
                    let _ = l.resign();
                }
            }),
        );
        assert!(r.violations.is_empty(), "{}", describe(&r));
    }
}

/// `run()`: two candidates lead in turns (each term's work checks
/// `is_leader()`, writes fenced by its term, then returns) until stopped;
/// `run` returns `Ok` once stopped. (The settings' retry pause is 1 ms: the
/// pause between terms is short.)
#[test]
fn run_leads_in_turns_until_stopped() {
    let mut terms = 0;
    for seed in seeds() {
        let mut p = plan(seed, 3, 800, &[], true);
        p.settings.retry_delay = T(1);
        p.settings.retry_jitter = T(0);
        p.ttls = vec![100];
        let count = Arc::new(AtomicU64::new(0));
        let count2 = count.clone();
        let r = simulate(
            p,
            Box::new(move |ctx, _| {
                for c in 0..2 {
                    let (ctx2, count) = (ctx.clone(), count2.clone());
                    ctx.spawn(&format!("run{c}"), move || {
                        let (locks, _) = ctx2.process(ctx2.plan.settings.clone());
                        let election = locks.election("e", T(100)).id(format!("run{c}"));
                        ctx2.elections.lock().push(election.clone());
                        let who = format!("run{c}");
                        let out = election.run(|l| {
                            // (Lent: the checkers cannot read its lease, but
                            // check its term, and its writes are fenced.)
                            let term = l.term();
                            ctx2.term_granted("e", &who, term);
                            count.fetch_add(1, Ordering::Relaxed);
                            let read = ctx2.with(|c| c.read("e", Some(term)));
                            ctx2.clock().sleep(T(20));
                            if l.is_leader() {
                                let now = ctx2.now();
                                ctx2.with(|c| c.write(now, "e", read, Some(term), &who));
                            }
                        });
                        if let Err(e) = out {
                            ctx2.fail(Kind::Crash, format!("run: {e}"));
                        }
                    });
                }
                ctx.sleep_until(800);
                ctx.stop_elections();
            }),
        );
        assert!(r.violations.is_empty(), "{}", describe(&r));
        let n = count.load(Ordering::Relaxed);
        assert!(n >= 5, "seed {seed}: {n} terms");
        assert!(r.stats.refused == 0, "seed {seed}: a term's write refused");
        terms += n;
    }
    println!("{} schedules: {terms} terms by run()", seeds().count());
}

/// A leader whose lease is on two of three nodes, one of which is down
/// (its data kept: the lease is still on a majority, and no one else can
/// be elected), while the third answers without it: `leader()` answers
/// "no leader" (`Ok(None)`), though it documents `None` as "no candidate's
/// lease is on a majority" and `NoQuorum` for a majority it cannot read.
#[test]
fn leader_does_not_answer_none_while_a_leader_leads_unseen() {
    let told = Arc::new(AtomicBool::new(false));
    let told2 = told.clone();
    let mut p = plan(0, 3, 1_000, &[(0, Fault::Isolate(2))], true);
    p.settings.renew_fraction = 0.5;
    p.ttls = vec![1_000];
    let r = simulate(
        p,
        Box::new(move |ctx, _| {
            let (a, _) = ctx.process(ctx.plan.settings.clone());
            let ea = a.election("e", T(1_000)).id("a");
            let Ok(la) = ea.campaign() else {
                return ctx.fail(Kind::Liveness, "a alone".into());
            };
            let la = Arc::new(la);
            let id = ctx.elected("a", &la);
            // Its lease is on nodes 0 and 1; node 2 comes back without it,
            // node 1 goes down with its data.
            ctx.fault(Fault::Heal(2));
            ctx.fault(Fault::Crash(1));
            ctx.clock().sleep(T(20));
            let (reader, _) = ctx.process(ctx.plan.settings.clone());
            let got = reader.election("e", T(1_000)).leader();
            let valid = la.is_leader();
            // Where a's key is (node 1's down, with its data).
            let on: Vec<usize> = {
                let core = ctx.sched.lock();
                let nodes = &core.world.nodes;
                (0..nodes.len())
                    .filter(|&i| {
                        let key = nodes[i].store.keys.get("e");
                        key.and_then(|(token, _)| candidate_of(token)).as_deref() == Some("a")
                    })
                    .collect()
            };
            println!(
                "a valid {valid} ({:?} left), its key on nodes {on:?}; leader(): {got:?}",
                la.validity()
            );
            if on != [0, 1] {
                ctx.fail(
                    Kind::Crash,
                    format!("a's key on {on:?}, not on nodes 0 and 1"),
                );
            }
            if valid && matches!(got, Ok(None)) {
                told2.store(true, Ordering::Release);
            }
            ctx.fault(Fault::Restart {
                node: 1,
                wipe: false,
            });
            if let Some(l) = ctx.leader_ended(id, End::Resigned, la) {
                let _ = l.resign();
            }
        }),
    );
    assert!(r.violations.is_empty(), "{}", describe(&r));
    assert!(
        !told.load(Ordering::Acquire),
        "leader() said no one leads while a's lease was valid and on a majority"
    );
}

/// The checkers find two leaders when an assumption the lock rests on is
/// broken: node clocks running up to twice as fast as the drift factor
/// allows (seeded schedules of that mix, with elections).
#[test]
fn with_clocks_drifting_beyond_the_factor_two_leaders_are_found() {
    let found = (0..200).find_map(|seed| {
        let r = super::run_elections(seed, Mix::DriftBeyondFactor);
        r.has(Kind::TwoLeaders).then_some(r)
    });
    match found {
        Some(r) => println!("{}", describe(&r)),
        None => panic!("no two leaders in 200 seeds of drift-beyond-factor"),
    }
}

/// A leader on three nodes, two of which restart empty at once while it
/// leads: with the restart rule, no one else is elected before its lease
/// ends; without it (broken on purpose), another candidate is, and the
/// checkers find two leaders.
#[test]
fn without_the_restart_rule_two_leaders_are_found() {
    let run = |protected: bool, seed: u64| {
        let mut faults = Vec::new();
        for n in 0..2 {
            faults.push((300, Fault::Crash(n)));
            faults.push((
                310,
                Fault::Restart {
                    node: n,
                    wipe: true,
                },
            ));
        }
        let mut p = plan(seed, 3, 1_000, &faults, true);
        p.settings.restart_protection = protected;
        p.settings.renew_fraction = 0.5;
        let odds = Odds {
            death: 0.0,
            pause: 0.0,
            steps: 1_000,
            campaign_for: 0.0,
            ..Odds::default()
        };
        elect(p, 600, 3, odds)
    };
    for seed in seeds().take(3) {
        let r = run(true, seed);
        assert!(r.violations.is_empty(), "{}", describe(&r));
        let r = run(false, seed);
        assert!(r.has(Kind::TwoLeaders), "seed {seed}: {}", describe(&r));
    }
}

/// Defects of the library found by the sweep's schedules with elections,
/// kept failing (ignored) until fixed; the sweep runs their seeds without
/// elections meanwhile (`tests::KNOWN_DEFECTS`).
mod engine_defects {
    use super::{describe, Mix};

    /// Seed 0x3f (clock jumps, elections): `c0t1`'s lock of `r0` (a plain
    /// lock, not the election's) is released with `Ok` at 665.990 ms while
    /// its key is on 2 of 3 nodes. Its acquire's SET to node 1, sent at
    /// 635.399 ms on one connection, was delayed 30 ms (a spike, the node
    /// timeout is 30 ms) and the round settled without it; a renewal
    /// restored the copy on node 1 at 662.803 ms on another connection, the
    /// release deleted it there at 664.364 ms (answered `Ok`), and the
    /// delayed SET landed at 665.743 ms, after the delete, with node 0's
    /// delete still on its way (it lands at 709.973 ms). No delete is sent
    /// to node 1 after it: its copy stays until its TTL (the release's
    /// retries, which the driver keeps up while a SET of the token may
    /// still land, were not made), and the release returned `Ok` with the
    /// key on a majority. Replay: `QUORUMLOCK_SIM_SEED=0x3f
    /// QUORUMLOCK_SIM_MIX=clock-jumps QUORUMLOCK_SIM_ELECTIONS=1
    /// QUORUMLOCK_SIM_TRACE=1 cargo test --lib sim::tests::replay -- --nocapture`.
    #[test]
    #[ignore = "defect: a SET delayed past a release lands after it and stays (no retried delete); release() returned Ok with the key on 2 of 3 nodes"]
    fn a_late_set_after_a_release_is_deleted() {
        let r = crate::testing::sim::run_elections(0x3f, Mix::ClockJumps);
        assert!(r.violations.is_empty(), "{}", describe(&r));
    }
}
