//! Scripted schedules of the restart rule's lock histories (issue 38): a
//! longer TTL first used on young nodes holds back only what the rule
//! needs, with the clients' connections learning the histories at
//! connect, from the nodes' replies.

use std::sync::Arc;
use std::time::Duration;

use crate::clock::Clock;
use crate::testing::sim::check::Kind;
use crate::testing::sim::plan::{Fault, Plan, Report};
use crate::testing::sim::tests::describe;
use crate::testing::sim::{simulate, Ctx, MS};

const T: fn(u64) -> Duration = Duration::from_millis;

fn script(seed: u64, f: fn(&Arc<Ctx>)) -> Report {
    simulate(Plan::calm(seed, 3), Box::new(move |ctx, _| f(ctx)))
}

/// Every node restarts empty at 1 ms; a first client's 100 ms locks
/// begin their histories (after the one wait of a brand-new cluster);
/// at 400 ms the nodes are young for any TTL above 400 ms.
fn young_nodes(ctx: &Arc<Ctx>) {
    for node in 0..3 {
        ctx.fault(Fault::Crash(node));
    }
    ctx.sleep_until(1);
    for node in 0..3 {
        ctx.fault(Fault::Restart { node, wipe: true });
    }
    let warm = ctx.client(ctx.plan.settings.clone());
    if let Ok(g) = warm.request("w", T(100)).acquire_for(T(1_000)) {
        let _ = g.release();
    }
    ctx.sleep_until(400);
}

/// A fresh client's first use of a 3 s TTL on young nodes (its own lock
/// waits: the TTL it asks counts as in use since always for it) holds no
/// other client back: a fresh client's 100 ms lock on another key is
/// granted at once. It was recorded as in use since always, and every
/// lock failed for 3 s.
#[test]
fn a_long_ttl_first_used_on_young_nodes_holds_no_other_client_back() {
    for seed in 0..4 {
        let r = script(seed, |ctx| {
            young_nodes(ctx);
            let long = ctx.client(ctx.plan.settings.clone());
            if let Ok(g) = long.try_lock("long", T(3_000)) {
                ctx.fail(
                    Kind::Liveness,
                    "young nodes voted for their first 3 s lock".into(),
                );
                let _ = g.release();
            }
            let other = ctx.client(ctx.plan.settings.clone());
            match other.try_lock("other", T(100)) {
                Ok(g) => {
                    let id = ctx.grant(&g, "other");
                    let _ = g.release();
                    ctx.end(id, true);
                }
                Err(e) => ctx.fail(Kind::Liveness, format!("held back by another's TTL: {e}")),
            }
        });
        assert!(r.violations.is_empty(), "{}", describe(&r));
    }
}

/// The same first use, then X holds `r` with the 3 s TTL on nodes 0 and
/// 1 (a client that trusts the nodes), and node 0 restarts empty: its new
/// history began after the first use, so it is in no record's `after`,
/// and a fresh contender (which learns it, and from 1.5 s first uses a
/// longer TTL after it) never wins nodes 0 and 2 while X holds.
#[test]
fn a_node_restarted_after_a_long_ttl_was_first_used_is_held_back() {
    for seed in 0..4 {
        let r = script(seed, restarted_under_a_long_ttl);
        assert!(r.violations.is_empty(), "{}", describe(&r));
    }
}

/// [`a_node_restarted_after_a_long_ttl_was_first_used_is_held_back`]'s
/// schedule.
fn restarted_under_a_long_ttl(ctx: &Arc<Ctx>) {
    young_nodes(ctx);
    let long = ctx.client(ctx.plan.settings.clone());
    let _ = long.try_lock("long", T(3_000)).map(|g| g.release());
    let mut trusting = ctx.plan.settings.clone();
    trusting.fresh_cluster = true;
    let x = ctx.client(trusting);
    ctx.fault(Fault::Isolate(2));
    ctx.sleep_until(450);
    let g = x.try_lock("r", T(3_000)).expect("X on nodes 0 and 1");
    let id = ctx.grant(&g, "holder");
    ctx.fault(Fault::Heal(2));
    ctx.fault(Fault::Crash(0));
    ctx.sleep_until(500);
    ctx.fault(Fault::Restart {
        node: 0,
        wipe: true,
    });
    let y = ctx.client(ctx.plan.settings.clone());
    while ctx.now() < 2_500 * MS {
        if let Ok(c) = y.try_lock("r", T(100)) {
            let cid = ctx.grant(&c, "contender");
            let _ = c.release();
            ctx.end(cid, true);
        }
        if ctx.now() > 1_500 * MS {
            let _ = y.try_lock("longer", T(3_500)).map(|g| g.release());
        }
        ctx.clock().sleep(T(20));
    }
    ctx.end(id, g.is_held());
    drop(g);
}
