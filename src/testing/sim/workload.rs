//! The random workload's threads: sections by every call of the API
//! (`run`, `lock`, `try_lock`, `acquire_for`, `acquire_for`, and
//! the read locks' `run`, `read().acquire`, `read().try_acquire`,
//! `acquire_for`), renewed, extended,
//! stalled, released or dropped, each checked against its documented
//! bound; and the kill storm's threads, on keys of their own.

use std::time::Duration;

use crate::clock::Clock;
use crate::error::Error;
use crate::guard::LockGuard;
use crate::redlock::Redlock;
use crate::testing::sim::check::Kind;
use crate::testing::sim::plan::Fault;
use crate::testing::sim::rng::SimRng;
use crate::testing::sim::sched::SimClock;
use crate::testing::sim::Ctx;

pub(crate) fn worker(ctx: &Ctx, locks: &Redlock, mut rng: SimRng, who: &str) {
    let clock = SimClock(ctx.sched.clone());
    let plan = &ctx.plan;
    while ctx.now() < plan.run_for {
        let resource = format!("r{}", rng.below(plan.resources as u64));
        let ttl = Duration::from_millis(plan.ttls[rng.below(plan.ttls.len() as u64) as usize]);
        let start = clock.now();
        if plan.sets && rng.chance(0.4) {
            // A lock of two or three resources, in a random order (sets
            // that overlap in a cycle deadlock when taken one by one).
            let mut set = vec![resource];
            for _ in 0..1 + rng.below(2) {
                let r = format!("r{}", rng.below(plan.resources as u64));
                if !set.contains(&r) {
                    set.push(r);
                }
            }
            let wait = Duration::from_millis(rng.below(300));
            let got = crate::testing::request_all(locks, &set, ttl).acquire_for(wait);
            ctx.trace(who, || {
                format!(
                    "request().and().acquire({set:?}, {ttl:?}, {wait:?}) -> {:?}",
                    got.as_ref().err()
                )
            });
            check_wait(ctx, "acquire_for", clock.now() - start, wait);
            if let Ok(g) = got {
                manual(ctx, &clock, &mut rng, g, ttl, who);
            }
            clock.sleep(Duration::from_millis(rng.below(30)));
            continue;
        }
        if plan.readers && rng.chance(0.4) {
            reader(ctx, locks, &mut rng, &resource, ttl, who);
            clock.sleep(Duration::from_millis(rng.below(30)));
            continue;
        }
        match rng.below(10) {
            0..=3 => scoped(ctx, locks, &mut rng, &resource, ttl, who, false),
            4..=6 => {
                let got = locks.lock(&resource, ttl);
                let budget = ctx.per_attempt() * plan.settings.retry_count;
                check_wait(ctx, "lock", clock.now() - start, budget);
                if let Ok(g) = got {
                    manual(ctx, &clock, &mut rng, g, ttl, who);
                }
            }
            7 => {
                let got = locks.try_lock(&resource, ttl);
                check_wait(ctx, "try_lock", clock.now() - start, ctx.per_attempt());
                if let Ok(g) = got {
                    manual(ctx, &clock, &mut rng, g, ttl, who);
                }
            }
            _ => {
                let wait = Duration::from_millis(rng.below(300));
                ctx.trace(who, || {
                    format!("acquire_for({resource}, {ttl:?}, {wait:?})")
                });
                let got = if plan.readers {
                    // (Its other name, which reads best beside readers.)
                    locks.request(&resource, ttl).acquire_for(wait)
                } else {
                    locks.request(&resource, ttl).acquire_for(wait)
                };
                ctx.trace(who, || {
                    format!("-> {:?}", got.as_ref().map(|g| g.deadline() - start))
                });
                check_wait(ctx, "acquire_for", clock.now() - start, wait);
                if let Ok(g) = got {
                    manual(ctx, &clock, &mut rng, g, ttl, who);
                }
            }
        }
        clock.sleep(Duration::from_millis(rng.below(30)));
    }
}

/// A section by `run` (or, `read`, `run`).
fn scoped(
    ctx: &Ctx,
    locks: &Redlock,
    rng: &mut SimRng,
    resource: &str,
    ttl: Duration,
    who: &str,
    read: bool,
) {
    let clock = ctx.clock();
    let start = clock.now();
    let mut acquired = None;
    let mut section = None;
    let body = |g: &LockGuard| {
        acquired = Some(clock.now());
        let id = ctx.grant(g, who);
        section = Some(id);
        work(ctx, &clock, rng, g, ttl, false);
    };
    let (call, out) = if read {
        (
            "run",
            locks
                .request(resource, ttl)
                .read()
                .acquire()
                .and_then(|g| g.run(body)),
        )
    } else {
        ("run", locks.lock(resource, ttl).and_then(|g| g.run(body)))
    };
    let waited = acquired.unwrap_or_else(|| clock.now()) - start;
    let budget = ctx.per_attempt() * ctx.plan.settings.retry_count;
    check_wait(ctx, call, waited, budget);
    ctx.trace(who, || {
        format!("{call}({resource}, {ttl:?}) -> {:?}", out.as_ref().err())
    });
    if let Some(id) = section {
        let now = ctx.now();
        ctx.with(|c| c.end(id, now, out.is_ok()));
    }
}

/// A reader's section, by each call of the read-lock API, each checked
/// against its documented bound: renewed, extended, stalled, released or
/// dropped as any other section (see [`manual`]), and never writing.
fn reader(ctx: &Ctx, locks: &Redlock, rng: &mut SimRng, resource: &str, ttl: Duration, who: &str) {
    let clock = ctx.clock();
    let start = clock.now();
    let attempts = ctx.per_attempt() * ctx.plan.settings.retry_count;
    let (call, got, budget) = match rng.below(4) {
        0 => return scoped(ctx, locks, rng, resource, ttl, who, true),
        1 => (
            "read().acquire",
            locks.request(resource, ttl).read().acquire(),
            attempts,
        ),
        2 => {
            let got = locks.request(resource, ttl).read().try_acquire();
            ("read().try_acquire", got, ctx.per_attempt())
        }
        _ => {
            let wait = Duration::from_millis(rng.below(300));
            let got = locks.request(resource, ttl).read().acquire_for(wait);
            ("acquire_for", got, wait)
        }
    };
    ctx.trace(who, || {
        format!("{call}({resource}, {ttl:?}) -> {:?}", got.as_ref().err())
    });
    check_wait(ctx, call, clock.now() - start, budget);
    if let Ok(g) = got {
        if !g.is_read() || g.fencing_token().is_some() {
            ctx.fail(Kind::Crash, format!("{call} gave a writer's guard"));
        }
        manual(ctx, &clock, rng, g, ttl, who);
    }
}

/// A kill storm's thread, over calm nodes whose connections are closed
/// under it now and then: every other attempt is on a key of its own, and
/// it, and its release, must succeed unless a connection was closed during
/// it (a close of a connection older than the round is not the node's
/// answer); the others contend for two shared keys (their failed attempts
/// leave undos for the leak account).
pub(crate) fn steady_worker(ctx: &Ctx, locks: &Redlock, mut rng: SimRng, who: &str) {
    let clock = SimClock(ctx.sched.clone());
    let ttl = Duration::from_millis(250);
    let killed = |from: u64, to: u64| {
        ctx.plan
            .faults
            .iter()
            .any(|&(at, f)| matches!(f, Fault::Kill(_)) && (from..=to).contains(&at))
    };
    // A key per attempt: a key an earlier release left behind (its round
    // met a close) never stands in the way.
    for n in 0.. {
        if ctx.now() >= ctx.plan.run_for {
            break;
        }
        let start = ctx.now();
        if rng.chance(0.5) {
            let shared = format!("shared-{}", rng.below(2));
            if let Ok(g) = locks.try_lock(&shared, ttl) {
                clock.sleep(Duration::from_millis(rng.below(5)));
                let _ = g.release();
            }
        } else {
            let got = locks.try_lock(&format!("{who}-{n}"), ttl);
            let out = got.and_then(|g| {
                clock.sleep(Duration::from_millis(rng.below(5)));
                g.release()
            });
            if let Err(e) = out {
                if !killed(start, ctx.now()) {
                    let what = format!("{who}: with no connection closed, its own key: {e}");
                    ctx.fail(Kind::Liveness, what);
                }
            }
        }
        clock.sleep(Duration::from_millis(rng.below(10)));
    }
}

pub(crate) fn check_wait(ctx: &Ctx, call: &str, waited: Duration, budget: Duration) {
    let bound = ctx.bound(budget);
    if waited > bound {
        ctx.fail(
            Kind::WaitBound,
            format!("{call} waited {waited:?}, bound {bound:?}"),
        );
    }
}

/// A section with a guard of its own: maybe renewed, maybe extended, maybe
/// stalled; then released or dropped.
fn manual(ctx: &Ctx, clock: &SimClock, rng: &mut SimRng, g: LockGuard, ttl: Duration, who: &str) {
    let id = ctx.grant(&g, who);
    let stall = rng.chance(ctx.plan.stall);
    ctx.trace(who, || {
        format!(
            "holds {} (stall {stall}) until {:.3} ms",
            g.resource(),
            ctx.sched.nanos_of(g.deadline()) as f64 / 1e6
        )
    });
    if !stall && rng.chance(0.5) {
        g.auto_renew();
    }
    if !stall && rng.chance(0.2) {
        let _ = g.extend(ttl);
    }
    work(ctx, clock, rng, &g, ttl, stall);
    let told = g.is_held() && g.lost().check().is_none();
    let resources: Vec<String> = g.resources().map(str::to_owned).collect();
    let token = g.token().to_owned();
    // A release may hand the lock to a local waiter instead (the key stays;
    // never a lock of several, which has no place in the queue).
    let may_hand = ctx.plan.settings.local_queue
        && resources.len() == 1
        && !g.is_read()
        && !g.state().is_renewing()
        && g.validity() >= g.ttl() / 2;
    let released = if rng.chance(0.5) {
        let r = g.release();
        if r.is_ok() && !may_hand {
            for resource in &resources {
                ctx.check_released(resource, &token);
            }
        }
        r
    } else {
        drop(g);
        Ok(())
    };
    if let Err(e @ Error::InvalidInput(_)) = &released {
        ctx.fail(Kind::Crash, format!("release: {e}"));
    }
    let now = ctx.now();
    ctx.trace(who, || {
        format!("ended {id}: told {told}, release {released:?}")
    });
    ctx.with(|c| c.end(id, now, told));
}

/// Extends the lock to a random TTL: a success must have completed inside
/// the old validity.
fn extend(ctx: &Ctx, clock: &SimClock, rng: &mut SimRng, g: &LockGuard) {
    let ttl = Duration::from_millis(ctx.plan.ttls[rng.below(ctx.plan.ttls.len() as u64) as usize]);
    let old = g.deadline();
    let t0 = ctx.now();
    let out = g.extend(ttl);
    ctx.trace("extend", || {
        format!(
            "{} {ttl:?} from {:.3} ms: {:?}, deadline {:.3} -> {:.3} ms",
            g.resource(),
            t0 as f64 / 1e6,
            out,
            ctx.sched.nanos_of(old) as f64 / 1e6,
            ctx.sched.nanos_of(g.deadline()) as f64 / 1e6
        )
    });
    if out.is_ok() && clock.now() >= old {
        let late = clock.now() - old;
        ctx.fail(
            Kind::LateExtend,
            format!("an extension completed {late:?} after the deadline succeeded"),
        );
    }
}

/// The critical section's work: a read, some steps (each checking the lock,
/// as careful code does), a write. A stalled holder checks, then pauses
/// past its TTL (a GC pause, a swapped-out process), then writes anyway:
/// only fencing can stop that write. A reader only reads.
fn work(ctx: &Ctx, clock: &SimClock, rng: &mut SimRng, g: &LockGuard, ttl: Duration, stall: bool) {
    let fence = g.fencing_token();
    let writes = !g.is_read();
    let resources: Vec<String> = g.resources().map(str::to_owned).collect();
    let reads: Vec<u64> = resources
        .iter()
        .map(|r| ctx.with(|c| c.read(r, fence)))
        .collect();
    if stall {
        let checked = g.is_held();
        clock.sleep(ttl + ttl * (1 + rng.below(3) as u32) / 2);
        if checked && writes {
            let now = ctx.now();
            for (r, read) in resources.iter().zip(&reads) {
                ctx.with(|c| c.write(now, r, *read, fence, "a stalled holder"));
            }
        }
        return;
    }
    let steps = 1 + rng.below(4);
    let long = rng.chance(0.2);
    for _ in 0..steps {
        if !g.is_held() {
            if rng.chance(0.3) {
                extend(ctx, clock, rng, g); // past the deadline: must fail
            }
            return;
        }
        if rng.chance(0.15) {
            extend(ctx, clock, rng, g);
        }
        let step = if long { ttl / 2 } else { ttl / 8 };
        clock.sleep(Duration::from_nanos(rng.below(step.as_nanos() as u64 + 1)));
    }
    if g.is_held() && writes {
        let now = ctx.now();
        for (r, read) in resources.iter().zip(&reads) {
            ctx.with(|c| c.write(now, r, *read, fence, "a holder"));
        }
    }
}
