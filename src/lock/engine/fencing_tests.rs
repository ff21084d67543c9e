//! Fencing tokens on fake nodes: they grow with every critical section,
//! are written back to every granting node, and restart from a node's
//! clock after it lost its counters.

use super::*;
use crate::testing::fake::{client, client_over, client_with, Mode};
use std::sync::atomic::Ordering;
const MS: Duration = Duration::from_millis(1);
const TTL: Duration = Duration::from_secs(10);

fn fenced() -> Settings {
    Settings {
        fencing: true,
        ..crate::testing::fake::settings()
    }
}

/// Issue 9: tokens grow with every critical section, across clients,
/// and cost exactly one more round; an unfenced client has none.
#[test]
fn fencing_tokens_grow_with_every_critical_section() {
    let (a, nodes, clock) = client_with(3, fenced());
    let b = client_over(&nodes, fenced());
    let mut last = 0;
    for i in 0..20 {
        let locks = if i % 2 == 0 { &a } else { &b };
        let before = nodes.rounds.load(Ordering::SeqCst);
        let g = locks.try_lock("r", TTL).unwrap();
        assert_eq!(
            nodes.rounds.load(Ordering::SeqCst) - before,
            2,
            "SET, write-back"
        );
        let t = g.fencing_token().expect("fenced");
        assert!(t > last, "{t} after {last}");
        last = t;
        // Renewal keeps the token.
        g.extend(TTL).unwrap();
        assert_eq!(g.fencing_token(), Some(t));
        if i % 3 == 0 {
            drop(g); // released
        } else {
            std::mem::forget(g);
            clock.advance(TTL + MS); // expired
        }
    }
    let (plain, _, _) = client(3);
    assert_eq!(plain.try_lock("r", TTL).unwrap().fencing_token(), None);
}

/// Issue 9's ordering argument: the token is the largest counter of the
/// granting majority, and it is written back where our key is, so that
/// a later holder granted by other nodes still gets a larger one. Node
/// 2's clock runs a second ahead: its counter, hence our token, is far
/// above node 0's until the write-back.
#[test]
fn the_write_back_lifts_every_granting_node_to_the_token() {
    let (locks, nodes, _) = client_with(3, fenced());
    nodes.set_clock_offset(2, 1_000_000);
    nodes.set_mode(1, Mode::Down);
    let g = locks.try_lock("r", TTL).unwrap();
    let t1 = g.fencing_token().unwrap();
    assert_eq!(
        nodes.fence(2, "r"),
        Some(t1),
        "node 2's counter is the token"
    );
    assert_eq!(nodes.fence(0, "r"), Some(t1), "written back to node 0");
    g.release().unwrap();
    nodes.set_mode(1, Mode::Up);
    nodes.set_mode(2, Mode::Down);
    let g = locks.try_lock("r", TTL).unwrap();
    assert!(
        g.fencing_token().unwrap() > t1,
        "nodes 0 and 1 grant a larger one"
    );
}

/// A write-back that misses the majority (a node gone between the SET
/// and the write-back) must not hand out the lock: it is released, and
/// the attempt fails with a retryable error.
#[test]
fn a_lock_whose_token_was_not_written_back_is_not_returned() {
    let (locks, nodes, _) = client_with(3, fenced());
    *nodes.before_round.lock() = Some(crate::testing::fake::Hook(Box::new(|n, op| {
        if matches!(op, Op::Fence { .. }) {
            n.set_mode(0, Mode::Down);
            n.set_mode(1, Mode::Hung);
        }
    })));
    match locks.try_lock("r", TTL) {
        Err(e @ Error::NoQuorum { .. }) => assert!(e.is_retryable()),
        other => panic!("{other:?}"),
    }
    *nodes.before_round.lock() = None;
    assert!(nodes.get(2, "r").is_none(), "released where it answered");
    // A key deleted behind our back between the rounds: the same.
    *nodes.before_round.lock() = Some(crate::testing::fake::Hook(Box::new(|n, op| {
        if matches!(op, Op::Fence { .. }) {
            n.del(0, "s");
            n.del(1, "s");
        }
    })));
    match locks.try_lock("s", TTL) {
        Err(e) => assert!(e.is_retryable(), "{e:?}"),
        Ok(g) => panic!("granted without a written-back token: {g:?}"),
    }
}

/// Issue 9: a hand-over gives the next token, written by the swap
/// itself (no extra round), so a later holder elsewhere gets more.
#[test]
fn a_hand_over_gives_the_next_token_in_the_swap() {
    let (locks, nodes, _) = client_with(3, fenced());
    let g = locks.lock("r", TTL).unwrap();
    let t = g.fencing_token().unwrap();
    let before = nodes.rounds.load(Ordering::SeqCst);
    let next = locks
        .engine
        .accept_hand_over(g.state(), TTL)
        .expect("taken over");
    std::mem::forget(g);
    assert_eq!(nodes.rounds.load(Ordering::SeqCst) - before, 1);
    assert_eq!(next.fence, Some(t + 1));
    assert!((0..3).all(|i| nodes.fence(i, "r") == Some(t + 1)));
    locks.engine.release(&next).unwrap();
    let other = client_over(&nodes, fenced());
    assert!(other.try_lock("r", TTL).unwrap().fencing_token().unwrap() > t + 1);
}

/// A node that lost its data restarts its counters from its clock: the
/// next token is still larger, as long as that clock is not behind the
/// clocks that made earlier tokens by more than the time since. The
/// README states this assumption; the second half shows it is needed.
#[test]
fn a_node_that_lost_its_counters_restarts_them_from_its_clock() {
    let (locks, nodes, _) = client_with(3, fenced());
    nodes.set_mode(2, Mode::Down);
    let t1 = locks.try_lock("r", TTL).unwrap().fencing_token().unwrap();
    nodes.set_mode(2, Mode::Up);
    // Node 1 loses its data; node 0 is down: nodes 1 and 2 (which never
    // saw the lock) grant the next one, after the restart hold.
    nodes.wipe(1);
    nodes.set_mode(0, Mode::Down);
    let t2 = locks.request("r", TTL).acquire_for(2 * TTL).unwrap();
    let t2 = t2.fencing_token().unwrap();
    assert!(t2 > t1, "{t2} after {t1}");
    // The same with node 1's and node 2's clocks behind by more than the
    // time since t2 was granted: the token goes backwards.
    nodes.set_mode(0, Mode::Up);
    nodes.wipe(1);
    nodes.set_mode(0, Mode::Down);
    nodes.set_clock_offset(1, -60_000_000);
    nodes.set_clock_offset(2, -60_000_000);
    // Node 2 kept its counter (t2 was written back there): it still
    // wins. Wipe it too, as a whole-cluster data loss would.
    nodes.wipe(2);
    let t3 = locks.request("r", TTL).acquire_for(2 * TTL).unwrap();
    let t3 = t3.fencing_token().unwrap();
    assert!(t3 < t2, "assumption broken: {t3} after {t2}");
}

/// A waiting call's place (see `Place`) is sent only from its second try:
/// a first try is the youngest call anyway, so an uncontended lock (a
/// fenced one is never lean) sends nothing more than before (found by
/// review).
#[test]
fn a_first_try_sends_no_place_and_a_retry_does() {
    let (locks, nodes, _) = client_with(3, fenced());
    for node in 0..3 {
        crate::testing::fake::plant(&nodes, node, "r", "someone-else", TTL);
    }
    let places = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let seen = places.clone();
    *nodes.before_round.lock() = Some(crate::testing::fake::Hook(Box::new(move |_, op| {
        if let Op::Acquire { place, .. } = op {
            seen.lock().push(place);
        }
    })));
    let _ = locks
        .request("r", TTL)
        .acquire_for(Duration::from_millis(350));
    let places = places.lock().clone();
    assert!(places.len() >= 2, "{places:?}");
    assert_eq!(places[0], crate::algorithm::round::Place::NONE);
    assert!(
        places[1..].iter().all(|p| p.since > 0 && p.claim == 0),
        "{places:?}"
    );
}
