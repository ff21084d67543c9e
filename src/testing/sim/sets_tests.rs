//! A lock of several resources among single locks of them (issue 41): the
//! set gets its turn within a bound, the single locks keep theirs, and a
//! set waiting on a long holder keeps nobody out. Scripted schedules on the
//! production engine, every checker on.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::clock::Clock;
use crate::testing::sim::check::Kind;
use crate::testing::sim::plan::{Plan, Report};
use crate::testing::sim::tests::describe;
use crate::testing::sim::{simulate, Ctx, MS};

const T: fn(u64) -> Duration = Duration::from_millis;

/// The longest a call may wait in these schedules (virtual time): a few
/// sections of the others and a retry pause, far below the seconds a set
/// waited for every key to be free at once.
const BOUND: Duration = Duration::from_millis(400);

fn run(seed: u64, f: fn(&Arc<Ctx>)) -> Report {
    let mut plan = Plan::calm(seed, 3);
    plan.wakeups = true;
    simulate(plan, Box::new(move |ctx, _| f(ctx)))
}

/// Two clients lock each of `keys` on their own, again and again (held
/// `hold`), until `end_ms`; each call's wait past [`BOUND`] is a failure.
fn singles(ctx: &Arc<Ctx>, keys: &[&'static str], hold: Duration, end_ms: u64) -> Arc<AtomicU64> {
    let longest = Arc::new(AtomicU64::new(0));
    for (i, key) in keys.iter().copied().enumerate() {
        for j in 0..2 {
            let (ctx2, longest) = (ctx.clone(), longest.clone());
            let who = format!("single {key} {j}");
            let locks = ctx.client(ctx.plan.settings.clone());
            ctx.spawn(&who.clone(), move || {
                let clock = ctx2.clock();
                // (Apart, so that the keys' holders do not line up.)
                clock.sleep(T(1 + 3 * i as u64 + j));
                while ctx2.now() < end_ms * MS {
                    let asked = ctx2.now();
                    match locks.request(key, T(1_000)).acquire_for(T(2_000)) {
                        Ok(g) => {
                            let waited = ctx2.now() - asked;
                            longest.fetch_max(waited, Ordering::Relaxed);
                            let id = ctx2.grant(&g, &who);
                            clock.sleep(hold);
                            let told = g.is_held();
                            let _ = g.release();
                            ctx2.end(id, told);
                        }
                        Err(e) => ctx2.fail(Kind::Liveness, format!("{who}: {e}")),
                    }
                }
            });
        }
    }
    longest
}

/// A set of the three keys, asked at 100 ms while two clients take turns
/// on each key (10 ms sections): it gets in within the bound, and so does
/// every single call. Before the claims, a set got in only when all three
/// keys were free at the same moment, which took seconds here.
fn set_among_singles(ctx: &Arc<Ctx>) {
    let keys = ["s0", "s1", "s2"];
    let longest = singles(ctx, &keys, T(10), 1_500);
    ctx.sleep_until(100);
    let set = ctx.client(ctx.plan.settings.clone());
    let asked = ctx.now();
    match set
        .request(keys[0], T(1_000))
        .and(keys[1])
        .and(keys[2])
        .acquire_for(T(3_000))
    {
        Ok(g) => {
            let waited = Duration::from_nanos(ctx.now() - asked);
            let id = ctx.grant(&g, "set");
            ctx.clock().sleep(T(10));
            let _ = g.release();
            ctx.end(id, true);
            if waited > BOUND {
                ctx.fail(Kind::Liveness, format!("the set waited {waited:?}"));
            }
        }
        Err(e) => ctx.fail(Kind::Liveness, format!("the set: {e}")),
    }
    ctx.sleep_until(1_600);
    let longest = Duration::from_nanos(longest.load(Ordering::Relaxed));
    if longest > BOUND {
        ctx.fail(Kind::Liveness, format!("a single call waited {longest:?}"));
    }
}

#[test]
fn a_set_among_single_locks_of_its_keys_gets_its_turn() {
    for seed in 0..8 {
        let r = run(seed, set_among_singles);
        assert!(r.violations.is_empty(), "{}", describe(&r));
    }
}

/// A set of `a` and `b` (`with_set`) while `a` is held for two seconds: it
/// must not keep `b` from the two clients that take turns on it (their
/// calls stay within the bound), and it gets in soon after `a`'s release.
/// `renewed`: the holder keeps `a` the usual way, a short TTL renewed by the
/// watchdog. Each renewal read as a new owner (the time left grows), so the
/// set was never "stuck" for long and its claims on `b` kept coming back
/// while `a` stayed held (found by review).
fn behind_a_long_holder(ctx: &Arc<Ctx>, renewed: bool, with_set: bool) {
    let holder = ctx.client(ctx.plan.settings.clone());
    let ttl = if renewed { T(300) } else { T(3_000) };
    let Ok(ga) = holder.request("a", ttl).acquire_for(T(1_000)) else {
        ctx.fail(Kind::Liveness, "the long holder".into());
        return;
    };
    if renewed {
        ga.auto_renew();
    }
    let id = ctx.grant(&ga, "long holder");
    let longest = singles(ctx, &["b"], T(10), 2_500);
    let set = ctx.client(ctx.plan.settings.clone());
    if with_set {
        let ctx2 = ctx.clone();
        ctx.spawn("set", move || {
            ctx2.sleep_until(50);
            match set.request("a", T(1_000)).and("b").acquire_for(T(5_000)) {
                Ok(g) => {
                    let id = ctx2.grant(&g, "set");
                    let _ = g.release();
                    ctx2.end(id, true);
                }
                Err(e) => ctx2.fail(Kind::Liveness, format!("the set: {e}")),
            }
        });
    }
    ctx.sleep_until(2_000);
    let _ = ga.release();
    ctx.end(id, true);
    ctx.sleep_until(2_800);
    let longest = Duration::from_nanos(longest.load(Ordering::Relaxed));
    if longest > BOUND {
        ctx.fail(
            Kind::Liveness,
            format!("a single call on b waited {longest:?} behind the set"),
        );
    }
}

fn set_behind_a_long_holder(ctx: &Arc<Ctx>) {
    behind_a_long_holder(ctx, false, true);
}

fn set_behind_a_renewed_holder(ctx: &Arc<Ctx>) {
    behind_a_long_holder(ctx, true, true);
}

fn no_set_control(ctx: &Arc<Ctx>) {
    behind_a_long_holder(ctx, true, false);
}

#[test]
fn a_set_behind_a_long_holder_keeps_nobody_out() {
    for seed in 0..8 {
        let r = run(seed, set_behind_a_long_holder);
        assert!(r.violations.is_empty(), "{}", describe(&r));
    }
}

#[test]
fn a_set_behind_a_renewed_holder_keeps_nobody_out() {
    let mut bad = Vec::new();
    for seed in 0..8 {
        let r = run(seed, set_behind_a_renewed_holder);
        if !r.violations.is_empty() {
            bad.push(format!("seed {seed}: {}", describe(&r)));
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// The same holder and single locks without the set: within the bound (so
/// that the test above measures the set).
#[test]
fn a_renewed_holder_and_single_locks_alone_stay_within_the_bound() {
    let mut bad = Vec::new();
    for seed in 0..8 {
        let r = run(seed, no_set_control);
        if !r.violations.is_empty() {
            bad.push(format!("seed {seed}: {}", describe(&r)));
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}
