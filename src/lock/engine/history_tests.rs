//! The restart rule's knowledge of lock histories (issue 38): a client
//! learns the histories that have begun before its first round, so that
//! its first use of a longer TTL holds back only what the rule needs.

use std::time::Duration;

use crate::lock::settings::Settings;
use crate::testing::fake::{client_over, client_with, FakeNodes, ManualClock, Mode};
use crate::{Error, NodeErrorKind, MAX_TTL};

const SHORT: Duration = Duration::from_secs(1);

/// Three brand-new nodes whose lock histories a 1 s lock began, then 2 s
/// pass: young nodes (histories 3 s old), old enough for the 1 s TTL.
fn young_nodes() -> (std::sync::Arc<FakeNodes>, std::sync::Arc<ManualClock>) {
    let (warm, nodes, clock) = client_with(3, Settings::default());
    // A brand-new cluster waits once, for the first TTL used on it.
    let g = warm
        .request("warm", SHORT)
        .acquire_for(3 * SHORT)
        .expect("after one TTL");
    drop(g);
    clock.advance(2 * SHORT);
    (nodes, clock)
}

fn held_back(r: &crate::Result<crate::LockGuard>) -> bool {
    matches!(r, Err(Error::NoQuorum { failures, .. })
        if failures.iter().all(|f| f.kind() == NodeErrorKind::Restarted))
}

/// The hostile tester's defect: one fresh process asking for a one-hour
/// TTL on nodes less than an hour old made every lock on every key fail
/// for an hour (its first use, with no history seen, was recorded as in
/// use since always). A fresh client now learns the histories first: its
/// TTL is recorded as first used after them, and another fresh client's
/// short lock on another key is granted at once. The long lock's own
/// client still waits (the TTL asked for counts as in use since always,
/// for the client that asks it).
#[test]
fn a_fresh_clients_long_ttl_does_not_hold_back_other_keys_on_young_nodes() {
    let (nodes, _clock) = young_nodes();
    let long = client_over(&nodes, Settings::default());
    let r = long.try_lock("long", MAX_TTL);
    assert!(held_back(&r), "the asker's own TTL: {:?}", r.err());
    let other = client_over(&nodes, Settings::default());
    match other.try_lock("other", SHORT) {
        Ok(g) => drop(g),
        Err(e) => panic!("one client's long TTL held back another's lock: {e}"),
    }
    // And the client that knows the long TTL, for a short lock.
    drop(long.try_lock("short", SHORT).expect("its own short lock"));
}

/// The rule still holds back a node that lost its data while a lock with
/// the long TTL could be held: its new history began after the long TTL
/// was first used, so it is in no record's `after`.
#[test]
fn a_node_restarted_empty_is_held_back_after_a_long_ttl_was_first_used() {
    let (nodes, clock) = young_nodes();
    let long = Duration::from_secs(60);
    // First used after the three histories began (the asker waits).
    let first = client_over(&nodes, Settings::default());
    assert!(held_back(&first.try_lock("first", long)));
    // X holds `r` with it on nodes 0 and 2 (a client that trusts the
    // nodes, so that it holds at once).
    let x = client_over(&nodes, crate::testing::fake::settings());
    nodes.set_mode(1, Mode::Down);
    let held = x.try_lock("r", long).expect("nodes 0 and 2");
    nodes.set_mode(1, Mode::Up);
    // Node 2 restarts empty: its new history begins with the next round.
    nodes.wipe(2);
    clock.advance(SHORT);
    let y = client_over(&nodes, Settings::default());
    for _ in 0..5 {
        match y.try_lock("r", SHORT) {
            Err(Error::NoQuorum { failures, .. }) => {
                assert!(
                    failures
                        .iter()
                        .any(|f| f.node() == "fake2:6379" && f.kind() == NodeErrorKind::Restarted),
                    "{failures:?}"
                );
            }
            other => panic!("two holders: {other:?}"),
        }
        // Y learns node 2's new history and first uses a longer TTL after
        // it: the 60 s before it still counts.
        let _ = y.try_lock("longer", 2 * long);
        clock.advance(10 * SHORT);
    }
    assert!(held.is_held());
}

/// A node that missed the first use of a long TTL (down then) learns the
/// TTL later from what other clients know of it (their longest TTL comes
/// with every command). It recorded that as in use since always, and its
/// record then held every young node back for everyone. It now records
/// what the client knows: first used after the same histories. The node
/// that missed it is itself held back for it (its history was not read
/// before the first use, so it is in no `after`).
#[test]
fn a_node_that_missed_a_first_use_learns_it_as_first_used_after_the_same_histories() {
    let (nodes, _clock) = young_nodes();
    let long = Duration::from_secs(60);
    nodes.set_mode(2, Mode::Down);
    let first = client_over(&nodes, Settings::default());
    assert!(first.try_lock("first", long).is_err(), "its own TTL");
    nodes.set_mode(2, Mode::Up);
    let other = client_over(&nodes, Settings::default());
    for key in ["a", "b", "c", "d"] {
        match other.try_lock(key, SHORT) {
            Ok(g) => {
                // Nodes 0 and 1; node 2's history was not read before
                // the first use: held back for it.
                assert_eq!(nodes.get(2, key).as_deref(), Some(g.token()));
                drop(g);
            }
            Err(e) => panic!("{key}: held back by what node 2 learnt: {e}"),
        }
    }
}
