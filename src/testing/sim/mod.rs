//! Deterministic simulation: the production algorithm (attempts, the
//! delayed-restart rule, fencing, the health model's admission rules, the
//! local queue and hand-over, the renewal thread) against simulated nodes
//! and a simulated network, driven by one seed.
//!
//! - [`sched`]: logical threads on virtual time, one running at a time.
//! - [`world`]: nodes (the fake nodes' script semantics, each with its own
//!   clock rate and jumps), the network (delay, reordering across
//!   connections, FIFO within one, a loss that resets or hangs its
//!   connection; wake-up messages lost and doubled), faults (pause, crash,
//!   restart with or without data, isolation, `CLIENT KILL`, `SCRIPT
//!   FLUSH`, `FLUSHALL`).
//! - The clients run the production node engine ([`engine`] over
//!   [`links`]: the driver's rounds, admission, late replies, undo, closes
//!   and release retries over simulated connections that carry the
//!   driver's bytes, which [`redis`] reads and [`serve`] answers).
//! - [`check`]: safety, liveness and accounting checkers.
//! - [`elections`]: candidates of an election run the production
//!   [`Election`](crate::Election), each in a process of its own that may
//!   die or be paused ([`links::Fate`]); [`leaders`] checks them (one
//!   valid lease at a time, each term once and rising, a leader within a
//!   bound after a resignation or a death, `leader()` naming the leader),
//!   and `leader()` reads the nodes through [`inspect`].
//!
//! What it does not run: the sockets and `poll`, the r2d2 pools' limits
//! (the busy-pool wait, and the write a granted lock sends a node no free
//! connection reached), which the integration suite runs against real
//! nodes.

use crate::testing::sim::plan::Mix;
use crate::testing::sim::plan::Plan;
use crate::testing::sim::plan::Report;

pub(crate) mod chan;
pub(crate) mod check;
pub(crate) mod elections;
pub(crate) mod engine;
pub(crate) mod faults;
pub(crate) mod inspect;
pub(crate) mod leaders;
pub(crate) mod links;
pub(crate) mod observe;
pub(crate) mod plan;
pub(crate) mod redis;
pub(crate) mod rng;
pub(crate) mod rw;
pub(crate) mod sched;
pub(crate) mod serve;
pub(crate) mod wakeups;
pub(crate) mod workload;
pub(crate) mod world;

#[cfg(test)]
mod election_tests;
#[cfg(test)]
mod history_regressions;
#[cfg(test)]
mod outage_tests;
#[cfg(test)]
mod regressions;
#[cfg(test)]
mod rw_tests;
#[cfg(test)]
mod sets_tests;
#[cfg(test)]
mod tests;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::clock::{Clock, Rng, Signal};
use crate::guard::LockGuard;
use crate::lock::settings::Settings;
use crate::redlock::Redlock;

use check::{Checker, Kind, Observed};
use plan::Fault;
use plan::MS;
use rng::SimRng;
use sched::{Sched, SimClock};
use world::World;

/// Runs the plan of `seed` under `mix`.
pub(crate) fn run(seed: u64, mix: Mix) -> Report {
    run_plan(Plan::new(seed, mix))
}

/// [`run`] with node engine defects put back.
pub(crate) fn run_defective(
    seed: u64,
    mix: Mix,
    defects: crate::driver::node::state::Defects,
) -> Report {
    run_as(seed, mix, |p| p.defects = defects)
}

/// [`run`] with releases waking the waiters of other clients (see
/// [`wakeups`]).
pub(crate) fn run_wakeups(seed: u64, mix: Mix) -> Report {
    run_as(seed, mix, |p| p.wakeups = true)
}

/// [`run`] with elections beside the locks (see [`elections`]).
pub(crate) fn run_elections(seed: u64, mix: Mix) -> Report {
    run_as(seed, mix, |p| p.elections = true)
}

/// [`run`] with some sections locks of several resources (and, `wakeups`,
/// releases waking waiters).
pub(crate) fn run_sets(seed: u64, mix: Mix, wakeups: bool) -> Report {
    run_as(seed, mix, |p| {
        p.sets = true;
        p.wakeups = wakeups;
    })
}

/// [`run`] with the plan's flags set by `f` (wake-ups, locks of several
/// resources, read locks: see [`Plan`]; and [`rw`] for the schedules of a
/// writer behind a stream of readers).
pub(crate) fn run_as(seed: u64, mix: Mix, f: impl FnOnce(&mut Plan)) -> Report {
    let mut plan = Plan::new(seed, mix);
    f(&mut plan);
    run_plan(plan)
}

/// A shared view of the run for the workload threads.
pub(crate) struct Ctx {
    sched: Arc<Sched>,
    plan: Plan,
    /// Workers still running, and the signal each notifies when it ends.
    running: AtomicUsize,
    done: Arc<Signal>,
    /// The elections' candidates, stopped when the workload ends.
    elections: parking_lot::Mutex<Vec<crate::election::Election>>,
}

impl Ctx {
    pub(crate) fn now(&self) -> u64 {
        self.sched.nanos()
    }

    pub(crate) fn clock(&self) -> SimClock {
        SimClock(self.sched.clone())
    }

    /// A new client (a process of its own) with `settings`.
    pub(crate) fn client(&self, settings: Settings) -> Redlock {
        client(self, settings, self.plan.seed)
    }

    /// Starts a logical thread.
    pub(crate) fn spawn(&self, name: &str, f: impl FnOnce() + Send + 'static) {
        if self.clock().spawn(name, Box::new(f)).is_err() {
            self.fail(Kind::Crash, format!("cannot start {name}"));
        }
    }

    /// A critical section starts (for the checkers); see [`end`](Self::end).
    pub(crate) fn grant(&self, g: &LockGuard, who: &str) -> usize {
        let now = self.now();
        let foreign = g.resources().find(|r| self.foreign(r)).map(str::to_owned);
        let mut core = self.sched.lock();
        let world = &mut core.world;
        if let Some(r) = foreign {
            let what = format!("{who} granted {r:?}, an application's key on all but a minority");
            world.check.fail(now, Kind::ForeignTaken, what);
        }
        world.check.grant(now, g.state(), who)
    }

    /// Whether `resource` is an application's key on so many nodes now
    /// that the others are short of a majority: no lock may take it (a
    /// node that lost its data lost that key too).
    pub(crate) fn foreign(&self, resource: &str) -> bool {
        let core = self.sched.lock();
        let nodes = &core.world.nodes;
        let on = nodes
            .iter()
            .filter(|n| n.store.foreign.contains(resource))
            .count();
        nodes.len() - on < crate::algorithm::quorum::quorum(nodes.len())
    }

    /// A critical section ended; `told_held`: what the API told it.
    pub(crate) fn end(&self, id: usize, told_held: bool) {
        let now = self.now();
        self.with(|c| c.end(id, now, told_held));
    }

    /// Changes the world now: what the caller does next meets it (a fault
    /// scheduled for now would wait until no thread is ready to run).
    pub(crate) fn fault(&self, f: Fault) {
        let now = self.now();
        self.sched.lock().world.fault(f, now);
    }

    /// Another client's lock on `resource`, on `node` only.
    pub(crate) fn plant(&self, node: usize, resource: &str, ttl: Duration) {
        let now = self.now();
        self.sched
            .lock()
            .world
            .plant(node, resource, "someone-else", ttl, now);
    }

    /// `release()` returned Ok: the lock's lineage must be gone from a
    /// majority of nodes now.
    fn check_released(&self, resource: &str, token: &str) {
        let now = self.now();
        let mut core = self.sched.lock();
        let world = &mut core.world;
        let holding = world
            .nodes
            .iter()
            .filter(|n| n.holds(world.base, now, resource, check::lineage(token)))
            .count();
        let n = world.nodes.len();
        if n - holding < crate::algorithm::quorum::quorum(n) {
            let what = format!("release() returned Ok with the key on {holding} of {n} nodes");
            world.check.fail(now, Kind::Leaked, what);
        }
    }

    /// Sleeps until `ms` milliseconds of virtual time.
    pub(crate) fn sleep_until(&self, ms: u64) {
        let left = (ms * MS).saturating_sub(self.now());
        self.clock().sleep(Duration::from_nanos(left));
    }

    fn with<T>(&self, f: impl FnOnce(&mut Checker) -> T) -> T {
        f(&mut self.sched.lock().world.check)
    }

    /// With `QUORUMLOCK_SIM_TRACE` set, prints what a worker does.
    fn trace(&self, who: &str, what: impl FnOnce() -> String) {
        if std::env::var_os("QUORUMLOCK_SIM_TRACE").is_some() {
            println!("{:10.3} ms {who}: {}", self.now() as f64 / 1e6, what());
        }
    }

    pub(crate) fn fail(&self, kind: Kind, what: String) {
        let now = self.now();
        self.with(|c| c.fail(now, kind, what));
    }

    /// The documented bound of a call that may wait `budget` in all.
    fn bound(&self, budget: Duration) -> Duration {
        let s = &self.plan.settings;
        let extra = s.node_timeout * if s.fencing { 3 } else { 2 };
        budget + extra + Duration::from_millis(1)
    }

    fn per_attempt(&self) -> Duration {
        let s = &self.plan.settings;
        s.retry_delay + s.retry_jitter + s.node_timeout
    }
}

/// Runs the random workload of `plan`.
pub(crate) fn run_plan(plan: Plan) -> Report {
    simulate(plan, Box::new(main_thread))
}

/// The first logical thread of a run: the workload, or a test's script.
pub(crate) type Script = Box<dyn FnOnce(&Arc<Ctx>, SimRng) + Send>;

/// Runs `main` in the world `plan` describes (nodes, clocks, network,
/// faults), with every checker on.
pub(crate) fn simulate(plan: Plan, main: Script) -> Report {
    debug_assert_eq!(plan.rates.len(), plan.nodes);
    let base = Instant::now();
    let mut rng = SimRng::new(plan.seed ^ 0xa076_1d64_78bd_642f);
    let mut check = Checker::new(base, plan.net.max_delay());
    check.node_timeout = u64::try_from(plan.settings.node_timeout.as_nanos()).unwrap_or(u64::MAX);
    let mut world = World::new(
        base,
        &plan.rates,
        &plan.entries,
        plan.net,
        rng.fork(),
        check,
    );
    for (node, &evicting) in world.nodes.iter_mut().zip(&plan.evicting) {
        node.evicting = evicting;
        if evicting {
            node.sound_since = None;
        }
        node.store.broken = plan.broken;
    }
    world.subs = plan.wakeups.then(Default::default);
    for &(node, resource) in &plan.foreign {
        world.nodes[node]
            .store
            .foreign
            .insert(format!("r{resource}"));
    }
    let sched = Sched::new(plan.seed, world, base);
    {
        let mut core = sched.lock();
        for &(at, f) in &plan.faults {
            core.world.schedule(at, f);
        }
    }
    let ctx = Arc::new(Ctx {
        sched: sched.clone(),
        plan: plan.clone(),
        running: AtomicUsize::new(plan.clients * plan.threads),
        done: Arc::default(),
        elections: Default::default(),
    });
    let main_rng = rng.fork();
    let main = {
        let ctx = ctx.clone();
        Box::new(move || main(&ctx, main_rng))
    };
    sched.run(main, Duration::from_secs(60));
    let mut core = sched.lock();
    let at = sched.nanos();
    let world = &mut core.world;
    for l in &world.line_stats {
        let stats = &mut world.check.stats;
        stats.batched += l.batched.load(Ordering::Relaxed);
        stats.closed_batches += l.closed_batches.load(Ordering::Relaxed);
        stats.orphan_replies += l.orphan_replies.load(Ordering::Relaxed);
        stats.deferred += l.deferred.load(Ordering::Relaxed);
    }
    if let Some(why) = core.aborted.take() {
        core.world.check.fail(at, Kind::Crash, why);
    } else {
        let world = &mut core.world;
        world.check.finish_with(at, &world.nodes);
    }
    core.world.check.leaders.finish();
    Report {
        plan,
        leaders: core.world.check.leaders.stats.clone(),
        violations: core.world.check.violations.clone(),
        stats: core.world.check.stats,
        grants_at: std::mem::take(&mut core.world.check.grants_at),
        wakes: core.world.wakes,
        steps: core.steps,
        virtual_ns: sched.nanos(),
        trace: core.trace,
    }
}

fn client(ctx: &Ctx, settings: Settings, seed: u64) -> Redlock {
    client_in(ctx, settings, seed, Arc::default())
}

/// A client whose process has `fate` (see [`links::Fate`]).
fn client_in(ctx: &Ctx, settings: Settings, seed: u64, fate: Arc<links::Fate>) -> Redlock {
    let clock: Arc<dyn Clock> = Arc::new(SimClock(ctx.sched.clone()));
    let transport = Box::new(engine::SimEngine::new(
        &ctx.sched,
        clock.clone(),
        settings.node_timeout,
        ctx.plan.preempt,
        settings.rules(),
        ctx.plan.defects,
        fate,
    ));
    crate::redlock::Redlock {
        engine: crate::lock::engine::Engine::new(settings, transport, clock, Rng::new(seed)),
    }
}

fn main_thread(ctx: &Arc<Ctx>, mut rng: SimRng) {
    let clock = SimClock(ctx.sched.clone());
    let plan = &ctx.plan;
    for c in 0..plan.clients {
        let locks = client(ctx, plan.settings.clone(), rng.next());
        for t in 0..plan.threads {
            let (ctx2, locks, trng) = (ctx.clone(), locks.clone(), rng.fork());
            let who = format!("c{c}t{t}");
            let body = Box::new(move || {
                if ctx2.plan.mix == Mix::KillStorm {
                    workload::steady_worker(&ctx2, &locks, trng, &who);
                } else {
                    workload::worker(&ctx2, &locks, trng, &who);
                }
                drop(locks);
                ctx2.running.fetch_sub(1, Ordering::AcqRel);
                ctx2.done.notify();
            });
            if clock.spawn(&format!("c{c}t{t}"), body).is_err() {
                ctx.fail(Kind::Crash, "cannot start a worker".into());
            }
        }
    }
    if plan.elections {
        // Drawn apart, so that the locks' workload stays as it was.
        let mut erng = SimRng::new(plan.seed ^ 0x656c_6563);
        elections::start(ctx, &mut erng);
    }
    // The workload runs, faults heal at `run_for`; once every worker is
    // done and a TTL has passed, a lone client must get every lock at once.
    loop {
        let seen = ctx.done.seen();
        if ctx.running.load(Ordering::Acquire) == 0 {
            break;
        }
        clock.wait(&ctx.done, seen, None);
    }
    let longest = Duration::from_millis(plan.ttls.iter().copied().max().unwrap_or(0));
    let healed = Duration::from_nanos(plan.run_for.saturating_sub(ctx.now()));
    // A clock set back keeps its node's keys that much longer.
    let back = plan
        .faults
        .iter()
        .filter_map(|f| match f.1 {
            Fault::Jump(_, d) if d < 0 => Some(d.unsigned_abs()),
            _ => None,
        })
        .sum::<u64>();
    let drain = Duration::from_nanos(plan.net.max_delay() + back);
    clock.sleep(healed + 2 * longest + drain);
    probe(ctx, &clock);
}

/// After healing: a fresh client, alone, must get each lock on its first
/// attempt, and nothing may be left on the nodes a TTL after.
fn probe(ctx: &Ctx, clock: &SimClock) {
    let plan = &ctx.plan;
    let settings = Settings {
        retry_count: 1,
        ..plan.settings.clone()
    };
    let locks = client(ctx, settings, plan.seed);
    let ttl = Duration::from_millis(200);
    // A node that lost its data votes once its new history is as old as
    // the longest TTL used (the restart rule), which starts at the first
    // lock command it runs.
    let longest = Duration::from_millis(plan.ttls.iter().copied().max().unwrap_or(0));
    let wait = ttl.max(longest) + 2 * ctx.per_attempt();
    for r in (0..plan.resources)
        .map(|i| format!("r{i}"))
        .chain(["fresh".to_owned()])
    {
        let foreign = ctx.foreign(&r);
        match locks.request(&r, ttl).acquire_for(wait) {
            // (The grant is flagged as such a lock's.)
            Ok(g) if foreign => {
                ctx.grant(&g, "probe");
            }
            // An application's key: refused, as it must be.
            Err(_) if foreign => {}
            Ok(g) => {
                if let Err(e) = g.release() {
                    ctx.fail(Kind::Liveness, format!("probe release of {r:?}: {e}"));
                }
            }
            Err(e) => ctx.fail(
                Kind::Liveness,
                format!("healthy and alone, {r:?} not granted: {e}"),
            ),
        }
    }
    drop(locks);
    clock.sleep(ttl * 2);
    let now = ctx.now();
    let core = ctx.sched.lock();
    let left: Vec<String> = core
        .world
        .nodes
        .iter()
        .enumerate()
        .filter(|(_, n)| !n.clock.jumped_back)
        .flat_map(|(i, n)| {
            let local = n.local(core.world.base, now);
            // Writers' keys and readers' entries alike.
            n.store
                .entries()
                .filter(move |&(_, _, exp)| exp > local)
                .map(move |(k, t, _)| format!("node {i}: {k} ({})", t.get(..8).unwrap_or(t)))
        })
        .collect();
    drop(core);
    if !left.is_empty() {
        ctx.fail(Kind::KeyOutlived, format!("keys left at the end: {left:?}"));
    }
}
