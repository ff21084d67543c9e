//! The checker on hand-made sections and nodes.

use super::*;
use crate::lock::state::Timing;
use crate::testing::sim::plan::Net;
use crate::testing::sim::rng::SimRng;
use crate::testing::sim::world::{SimNode, World, CLOCK_START};

const MS: u64 = 1_000_000;

fn lock(
    base: Instant,
    token: &str,
    since: u64,
    valid: u64,
    ttl: u64,
    fence: Option<u64>,
) -> Arc<LockState> {
    let since = base + Duration::from_nanos(since * MS);
    Arc::new(LockState::new(
        "r",
        token.into(),
        fence,
        Timing {
            since,
            deadline: since + Duration::from_millis(valid),
            ttl: Duration::from_millis(ttl),
        },
    ))
}

/// A world of `nodes` calm nodes, one entry each, with a fresh checker.
fn world(base: Instant, nodes: usize) -> World {
    let entries: Vec<usize> = (0..nodes).collect();
    World::new(
        base,
        &vec![1.0; nodes],
        &entries,
        Net::calm(),
        SimRng::new(1),
        Checker::new(base, 0),
    )
}

fn kinds(c: &Checker) -> Vec<Kind> {
    let mut k: Vec<Kind> = c.violations.iter().map(|v| v.kind).collect();
    k.sort();
    k
}

/// Every checker can fail: fed the violation it is about, it reports
/// it (and a lawful history reports nothing).
#[test]
fn each_checker_reports_the_violation_it_is_about() {
    let base = Instant::now();
    let mut c = Checker::new(base, 0);
    let a = lock(base, "a", 0, 90, 100, Some(5));
    c.grant(0, &a, "a");
    c.observe(10 * MS, &[] as &[SimNode], base);
    assert!(c.violations.is_empty(), "one holder is lawful");
    let b = lock(base, "b", 50, 90, 100, Some(5));
    c.grant(50 * MS, &b, "b");
    assert_eq!(kinds(&c), [Kind::TwoHolders, Kind::FenceOrder]);

    let mut c = Checker::new(base, 0);
    let v = c.read("x", None);
    assert!(c.write(0, "x", v, None, "first"));
    assert!(c.violations.is_empty());
    assert!(c.write(0, "x", v, None, "stale"));
    assert_eq!(kinds(&c), [Kind::LostUpdate]);
    // Fenced: the newer reader's token makes the stale write refused.
    let mut c = Checker::new(base, 0);
    let v = c.read("x", Some(8));
    assert!(c.write(0, "x", v, Some(8), "new"));
    assert!(!c.write(0, "x", v, Some(7), "old"), "refused");
    assert!(c.violations.is_empty());

    let mut c = Checker::new(base, 0);
    let long = lock(base, "l", 0, 200, 100, None);
    c.grant(0, &long, "long");
    c.observe(MS, &[] as &[SimNode], base);
    assert_eq!(kinds(&c), [Kind::DeadlineBeyondTtl]);

    let mut c = Checker::new(base, 0);
    let ia2 = c.grant(0, &a, "a");
    c.observe(95 * MS, &[] as &[SimNode], base); // past its deadline, not released
    c.end(ia2, 96 * MS, true);
    assert_eq!(kinds(&c), [Kind::Unsignalled]);

    let mut w = world(base, 1);
    w.check.landed("b", 0, 0, 0);
    w.check.delete_sent("b", 0, MS);
    w.check.landed("b.1", 0, 2 * MS, 2 * MS); // a later write of the lineage
    let nodes = std::mem::take(&mut w.nodes);
    w.check.finish_with(3 * MS, &nodes);
    assert_eq!(kinds(&w.check), [Kind::Leaked]);
}

#[test]
fn a_key_left_long_after_its_round_is_reported() {
    let base = Instant::now();
    let mut w = world(base, 1);
    let ttl = Duration::from_millis(100);
    let key = crate::algorithm::round::Key::new("r", "t");
    let op = Op::Acquire {
        lean: None,
        intent: std::time::Duration::ZERO,
        place: crate::algorithm::round::Place::NONE,
        ttl,
        known_max: ttl,
        fenced: false,
        after: crate::algorithm::round::After::NONE,
        known_prev: std::time::Duration::ZERO,
    };
    w.check.sent(op, &[key], 0);
    let expiry = base + Duration::from_nanos(CLOCK_START) + Duration::from_secs(10);
    w.nodes[0]
        .store
        .keys
        .insert("r".into(), ("t".into(), expiry));
    w.observe(50 * MS);
    assert!(w.check.violations.is_empty(), "within its TTL");
    w.observe(500 * MS);
    assert_eq!(kinds(&w.check), [Kind::KeyOutlived]);
}

#[test]
fn a_held_lock_whose_key_is_on_a_minority_is_reported() {
    let base = Instant::now();
    let mut w = world(base, 3);
    let held = lock(base, "t.1", 0, 90, 100, None);
    w.check.grant(0, &held, "holder");
    let expiry = base + Duration::from_nanos(CLOCK_START) + Duration::from_secs(1);
    // Another section token of its lineage counts (a missed swap).
    w.nodes[0]
        .store
        .keys
        .insert("r".into(), ("t".into(), expiry));
    w.nodes[1]
        .store
        .keys
        .insert("r".into(), ("t.1".into(), expiry));
    w.observe(MS);
    assert!(w.check.violations.is_empty(), "on 2 of 3");
    w.nodes[1]
        .store
        .keys
        .insert("r".into(), ("other".into(), expiry));
    w.observe(2 * MS);
    assert_eq!(kinds(&w.check), [Kind::DeadlineBeyondKeys]);
}

/// The leak account is kept per node: a delete that reached one node does
/// not cover our key on another, unless that node could not be reached
/// until the key expired.
#[test]
fn a_delete_that_reached_one_node_does_not_cover_another() {
    let base = Instant::now();
    let account = |reach_both: bool, dark_second: bool| {
        let mut w = world(base, 2);
        w.check.landed("t", 0, 0, MS);
        w.check.landed("t", 1, 0, MS);
        w.check.delete_sent("t", 0, 2 * MS);
        if reach_both {
            w.check.delete_sent("t", 1, 2 * MS);
        }
        // Let go at 2 ms with a copy left on node 1 until 300 ms.
        w.check.owed("t", 2 * MS, vec![(1, 300 * MS)]);
        if dark_second {
            w.nodes[1].dark.push((MS, 400 * MS));
        }
        let nodes = std::mem::take(&mut w.nodes);
        w.check.finish_with(500 * MS, &nodes);
        w.check.violations
    };
    let left = account(false, false);
    assert_eq!(left.len(), 1, "{left:?}");
    assert_eq!(left[0].kind, Kind::Leaked);
    assert!(left[0].what.contains("on node 1"), "{}", left[0].what);
    assert!(account(true, false).is_empty(), "deleted on both");
    assert!(
        account(false, true).is_empty(),
        "node 1 dark until it expired"
    );
}

/// The longest stretch a node could be reached in a window: between its
/// dark spans, and none once a dark span is still open.
#[test]
fn the_longest_reachable_stretch_skips_dark_spans() {
    let base = Instant::now();
    let mut w = world(base, 1);
    let n = &mut w.nodes[0];
    n.dark = vec![(10 * MS, 20 * MS), (50 * MS, 55 * MS)];
    assert_eq!(n.longest_reachable(0, 100 * MS), 45 * MS, "55..100");
    assert_eq!(n.longest_reachable(12 * MS, 52 * MS), 30 * MS, "20..50");
    assert_eq!(n.longest_reachable(11 * MS, 19 * MS), 0, "dark throughout");
    n.dark_since = Some(60 * MS);
    assert_eq!(
        n.longest_reachable(0, 100 * MS),
        30 * MS,
        "20..50; dark from 60"
    );
    assert_eq!(n.longest_reachable(61 * MS, 100 * MS), 0, "still dark");
}

/// Readers share: two read locks of one resource valid at once are
/// lawful, but a writer valid beside a reader is two holders; and a held
/// read lock's entries must be on a majority, as a writer's key.
#[test]
fn readers_share_but_not_with_a_writer_and_their_entries_count() {
    let base = Instant::now();
    let mut w = world(base, 3);
    let (ra, rb) = (
        lock(base, "ra", 0, 90, 100, None),
        lock(base, "rb", 5, 90, 100, None),
    );
    assert!(ra.is_read() && rb.is_read());
    w.check.grant(0, &ra, "reader a");
    w.check.grant(5 * MS, &rb, "reader b");
    let expiry = base + Duration::from_nanos(CLOCK_START) + Duration::from_secs(1);
    for (node, reader) in [(0, "ra"), (1, "ra"), (1, "rb"), (2, "rb")] {
        let set = w.nodes[node].store.readers.entry("r".into()).or_default();
        set.entries.insert(reader.into(), expiry);
    }
    w.observe(6 * MS);
    assert!(w.check.violations.is_empty(), "{:?}", w.check.violations);
    assert_eq!(w.check.stats.shared_reads, 1);
    // Reader a's entry leaves node 1: it is on 1 of 3 nodes.
    if let Some(set) = w.nodes[1].store.readers.get_mut("r") {
        set.entries.remove("ra");
    }
    w.observe(7 * MS);
    assert_eq!(kinds(&w.check), [Kind::DeadlineBeyondKeys]);
    let writer = lock(base, "feed", 8, 90, 100, None);
    w.check.grant(8 * MS, &writer, "writer");
    assert_eq!(
        kinds(&w.check),
        [Kind::TwoHolders, Kind::DeadlineBeyondKeys]
    );
}
