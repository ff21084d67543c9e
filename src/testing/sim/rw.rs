//! Read-write locks in the simulation. The random workload's readers are
//! `workload::reader` (with [`Plan::readers`]: see [`run_rw`](super::run_rw));
//! here, the schedules of a writer behind a stream of readers: on a calm
//! network with healthy nodes, readers overlap without a gap on one key,
//! and a writer that waits for it (`acquire_for`)
//! must get in within one reader TTL, a retry pause and a few rounds of its
//! call ([`Kind::WriterStarved`]): a waiting writer's intent keeps new
//! readers out, so only those in already are waited for. Every other
//! checker runs too (no writer beside a reader, keys on a majority, no key
//! left behind).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::clock::Clock;
use crate::testing::sim::check::Kind;
use crate::testing::sim::plan::{Mix, Net, Plan, Report};
use crate::testing::sim::rng::SimRng;
use crate::testing::sim::{client, simulate, Ctx};
use crate::testing::store::Broken;

/// The resource the stream's readers and its writer meet on.
const KEY: &str = "rw";

/// Calls the writer makes behind the readers in one schedule.
const WRITES: u32 = 3;

/// How a reader-stream schedule runs.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Stream {
    /// Releases wake waiters of other clients.
    pub(crate) wakeups: bool,
    /// The nodes' scripts break a reader-writer rule.
    pub(crate) broken: Broken,
    /// The writer's TTL may be shorter than its intent's span (its retry
    /// pause and three node timeouts; the engine once cut the intent to the
    /// TTL, and such writers starved); else it is at least that span.
    pub(crate) short_writer: bool,
}

/// A writer behind a stream of readers (see the module's documentation),
/// run as `how` says.
pub(crate) fn run_reader_stream(seed: u64, how: Stream) -> Report {
    let mut plan = calm(Plan::new(seed, Mix::Standard));
    plan.wakeups = how.wakeups;
    plan.readers = true;
    plan.broken = how.broken;
    simulate(
        plan,
        Box::new(move |ctx, rng| stream(ctx, rng, how.short_writer)),
    )
}

/// `plan` on a calm network with healthy nodes: no fault, no stall, no
/// closed connection (its settings and node clocks, within the drift
/// factor, stay).
fn calm(mut plan: Plan) -> Plan {
    plan.net = Net::calm();
    plan.faults.clear();
    plan.stall = 0.0;
    plan
}

/// How long after its call a writer behind readers of `reader_ttl` must be
/// in: the readers in already (one TTL, on a node clock as slow as the
/// drift factor allows); then its retry pause; and a few rounds (its first,
/// which marks its intent, the undo of a failed one, the last, and the
/// yield after its own release reached waiters).
fn writer_bound(ctx: &Ctx, reader_ttl: Duration) -> Duration {
    let s = &ctx.plan.settings;
    reader_ttl.mul_f64(1.0 + 2.0 * s.drift_factor)
        + s.retry_delay
        + s.retry_jitter
        + s.node_timeout * 5
        + Duration::from_millis(2)
}

/// The schedule's first thread: readers on two clients, staggered so that
/// one is always in, and a writer on a third.
fn stream(ctx: &Arc<Ctx>, mut rng: SimRng, short_writer: bool) {
    let reader_ttl = rng.millis(60, 160);
    let readers = 3 + rng.below(2) as u32;
    let holding = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicBool::new(false));
    let clients = [
        client(ctx, ctx.plan.settings.clone(), rng.next()),
        client(ctx, ctx.plan.settings.clone(), rng.next()),
    ];
    for n in 0..readers {
        let locks = clients[n as usize % 2].clone();
        let (ctx2, holding, done) = (ctx.clone(), holding.clone(), done.clone());
        let mut rng = rng.fork();
        let who = format!("reader{n}");
        let name = who.clone();
        ctx.spawn(&name, move || {
            let clock = ctx2.clock();
            clock.sleep(reader_ttl * n / readers);
            while !done.load(Ordering::Acquire) {
                let got = locks
                    .request(KEY, reader_ttl)
                    .read()
                    .acquire_for(reader_ttl * 2);
                if let Ok(g) = got {
                    let id = ctx2.grant(&g, &who);
                    holding.fetch_add(1, Ordering::AcqRel);
                    // Half to three quarters of its TTL, never renewed.
                    let hold = reader_ttl / 2 + reader_ttl.mul_f64(rng.below(250) as f64 / 1e3);
                    clock.sleep(hold);
                    let told = g.is_held();
                    holding.fetch_sub(1, Ordering::AcqRel);
                    if rng.chance(0.75) {
                        let _ = g.release();
                    } else {
                        drop(g);
                    }
                    ctx2.end(id, told);
                }
                clock.sleep(Duration::from_millis(rng.below(4)));
            }
        });
    }
    let locks = client(ctx, ctx.plan.settings.clone(), rng.next());
    let clock = ctx.clock();
    let bound = writer_bound(ctx, reader_ttl);
    for _ in 0..WRITES {
        // The readers settle in (again) first.
        clock.sleep(reader_ttl + rng.millis(0, 100));
        let behind = holding.load(Ordering::Acquire) > 0;
        let s = &ctx.plan.settings;
        let span = s.retry_delay + s.retry_jitter + s.node_timeout * 3;
        let ttl = if short_writer {
            rng.millis(40, 120)
        } else {
            span + rng.millis(0, 100)
        };
        let start = ctx.now();
        ctx.trace("writer", || {
            let s = &ctx.plan.settings;
            format!(
                "calls with TTL {ttl:?}, behind {behind}, readers' TTL {reader_ttl:?}; retry {:?} + {:?}, node timeout {:?}",
                s.retry_delay, s.retry_jitter, s.node_timeout
            )
        });
        let call = "acquire_for";
        let got = locks.request(KEY, ttl).acquire_for(bound * 3);
        let waited = Duration::from_nanos(ctx.now() - start);
        let behind_readers = format!(
            "behind readers of {reader_ttl:?} (from {:.3} ms)",
            start as f64 / 1e6
        );
        match got {
            Ok(g) => {
                let id = ctx.grant(&g, "writer");
                if waited > bound {
                    let what =
                        format!("{call} got in after {waited:?} {behind_readers}, bound {bound:?}");
                    ctx.fail(Kind::WriterStarved, what);
                }
                ctx.with(|c| c.stats.writes_behind_readers += u64::from(behind));
                clock.sleep(rng.millis(5, 30));
                let told = g.is_held();
                let _ = g.release();
                ctx.end(id, told);
            }
            Err(e) => {
                let what = format!("{call} not granted in {waited:?} {behind_readers}: {e}");
                ctx.fail(Kind::WriterStarved, what);
            }
        }
    }
    done.store(true, Ordering::Release);
}
