//! The engine on fake nodes: acquire, release, take-over, extension,
//! fencing and the delayed-restart rule.

use super::*;
use crate::testing::fake::{client, client_over, client_with, Mode};
use std::sync::atomic::Ordering;

const MS: Duration = Duration::from_millis(1);
const TTL: Duration = Duration::from_secs(10);

#[test]
fn acquires_on_every_node_with_validity_below_ttl() {
    let (locks, nodes, _) = client(3);
    let g = locks.try_lock("r", TTL).unwrap();
    // 10 s − 1 ms round − (100 ms + 2 ms) drift.
    assert_eq!(g.validity(), TTL - MS - 102 * MS);
    for i in 0..3 {
        assert_eq!(nodes.get(i, "r").as_deref(), Some(g.token()));
    }
    g.release().unwrap();
    assert!((0..3).all(|i| nodes.get(i, "r").is_none()));
}

#[test]
fn a_second_owner_is_refused_until_release() {
    let (locks, _, _) = client(3);
    let g = locks.try_lock("r", TTL).unwrap();
    match locks.try_lock("r", TTL) {
        Err(Error::Taken { held: 3, nodes: 3 }) => {}
        other => panic!("{other:?}"),
    }
    drop(g);
    assert!(locks.try_lock("r", TTL).is_ok());
}

#[test]
fn survives_a_minority_and_names_a_failed_majority() {
    let (locks, nodes, _) = client(3);
    nodes.set_mode(2, Mode::Down);
    drop(locks.try_lock("a", TTL).unwrap());
    nodes.set_mode(1, Mode::Hung);
    match locks.try_lock("b", TTL) {
        Err(Error::NoQuorum {
            agreed: 1,
            quorum: 2,
            failures,
        }) => {
            let names: Vec<_> = failures.iter().map(|f| f.node().to_owned()).collect();
            assert_eq!(names, ["fake1:6379", "fake2:6379"]);
        }
        other => panic!("{other:?}"),
    }
    // The failed attempt released its one successful SET.
    assert!(nodes.get(0, "b").is_none());
}

#[test]
fn a_failed_attempt_unlocks_nodes_whose_reply_was_lost() {
    let (locks, nodes, _) = client(3);
    nodes.set_mode(1, Mode::Lossy);
    nodes.set_mode(2, Mode::Lossy);
    assert!(matches!(
        locks.try_lock("r", TTL),
        Err(Error::NoQuorum { .. })
    ));
    // Lossy nodes executed the SET, and then the release.
    assert!((0..3).all(|i| nodes.get(i, "r").is_none()));
}

#[test]
fn no_release_round_when_every_node_refused() {
    let (locks, nodes, _) = client(3);
    let _g = locks.try_lock("r", TTL).unwrap();
    let before = nodes.rounds.load(Ordering::SeqCst);
    assert!(locks.try_lock("r", TTL).is_err());
    assert_eq!(nodes.rounds.load(Ordering::SeqCst) - before, 1);
}

#[test]
fn too_slow_a_round_exhausts_validity_and_unlocks() {
    let (locks, nodes, _) = client(3);
    *nodes.latency.lock() = 40 * MS;
    match locks.try_lock("r", 41 * MS) {
        // The round is cut off where validity would reach zero.
        Err(Error::ValidityExhausted { elapsed, ttl }) => {
            let drift = quorum::drift_allowance(41 * MS, 0.01);
            assert_eq!((elapsed, ttl), (41 * MS - drift, 41 * MS));
        }
        other => panic!("{other:?}"),
    }
    assert!((0..3).all(|i| nodes.get(i, "r").is_none()));
}

/// Issue 21: an unfenced take-over is the lock's next critical section
/// and sends nothing: the key keeps its token and expiry on every node,
/// the section number moves on, and releasing it deletes the key.
#[test]
fn an_unfenced_take_over_sends_nothing() {
    let (locks, nodes, clock) = client(3);
    let g = locks.lock("r", TTL).unwrap();
    let old = g.state().clone();
    assert_eq!(old.section, 1);
    clock.advance(TTL / 4);
    let before = nodes.rounds.load(Ordering::SeqCst);
    let new = locks
        .engine
        .accept_hand_over(&old, TTL)
        .expect("taken over");
    assert_eq!(nodes.rounds.load(Ordering::SeqCst), before, "no round");
    assert_eq!(new.token, old.token);
    assert_eq!(new.section, 2);
    assert_eq!(new.timing(), old.timing(), "the same expiry");
    assert_eq!(new.holding(), old.holding());
    assert_eq!(new.reach(), old.reach());
    let third = locks.engine.accept_hand_over(&new, TTL).expect("again");
    assert_eq!(third.section, 3);
    assert_eq!(nodes.rounds.load(Ordering::SeqCst), before, "no round");
    std::mem::forget(g);
    locks.engine.release(&third).expect("released");
    assert!((0..3).all(|i| nodes.get(i, "r").is_none()), "nothing left");

    // With less than a node timeout of validity left it is released, not
    // handed on (the receiver locks anew).
    let g = locks.lock("s", TTL).unwrap();
    clock.advance(g.validity() - 10 * MS);
    assert!(matches!(
        locks.engine.accept_hand_over(g.state(), TTL),
        Err(Error::Expired)
    ));
    assert!((0..3).all(|i| nodes.get(i, "s").is_none()), "released");
    std::mem::forget(g);
}

/// A fenced take-over is a new critical section under a fresh token,
/// swapped on every node in one round, keeping the lock's expiry.
#[test]
fn a_fenced_take_over_swaps_in_a_fresh_token_in_one_round() {
    let (locks, nodes, clock) = client_with(3, fenced());
    let g = locks.lock("r", TTL).unwrap();
    let old = g.state().clone();
    // An extension of the old section may still land: its reach stays.
    old.reach_until(clock.now() + 2 * TTL);
    clock.advance(TTL / 4);
    let before = nodes.rounds.load(Ordering::SeqCst);
    let new = locks
        .engine
        .accept_hand_over(&old, TTL)
        .expect("taken over");
    assert_eq!(nodes.rounds.load(Ordering::SeqCst) - before, 1);
    assert_ne!(new.token, old.token);
    assert_eq!(new.section, 2);
    assert!((0..3).all(|i| nodes.get(i, "r").as_deref() == Some(new.token.as_str())));
    assert_eq!(new.timing(), old.timing(), "the same expiry");
    assert_eq!(new.reach(), old.reach(), "the same reach");
    std::mem::forget(g);
}

fn fenced() -> Settings {
    Settings {
        fencing: true,
        ..crate::testing::fake::settings()
    }
}

/// A node the swap did not reach keeps the old token, with the lock's
/// expiry: the next swap takes it from there, and releasing the new
/// section deletes it there too, so no key is left behind to block that
/// node's vote until the TTL runs out.
#[test]
fn releasing_a_taken_over_lock_deletes_old_tokens_the_swap_missed() {
    let (locks, nodes, _) = client_with(3, fenced());
    let g = locks.lock("r", TTL).unwrap();
    nodes.set_mode(2, Mode::Down);
    let b = locks
        .engine
        .accept_hand_over(g.state(), TTL)
        .expect("2 of 3");
    std::mem::forget(g);
    nodes.set_mode(2, Mode::Up);
    // And once more, with node 2 still on the first token.
    nodes.set_mode(1, Mode::Down);
    let c = locks.engine.accept_hand_over(&b, TTL).expect("2 of 3");
    nodes.set_mode(1, Mode::Up);
    // Node 2 missed the first swap; the second takes it from there.
    assert_eq!(nodes.get(2, "r").as_deref(), Some(c.token.as_str()));
    assert!(nodes.get(1, "r").is_some_and(|t| t != c.token), "missed");
    locks.engine.release(&c).expect("released");
    assert!((0..3).all(|i| nodes.get(i, "r").is_none()), "nothing left");
}

/// A node that missed many swaps in a row (down, or skipped as failing)
/// still holds the first section's token; the last section's release
/// must delete it (a list of recent tokens forgot it).
#[test]
fn a_node_that_missed_many_swaps_is_cleaned_by_the_release() {
    let (locks, nodes, _) = client_with(3, fenced());
    let g = locks.lock("r", TTL).unwrap();
    let first = g.state().token.clone();
    nodes.set_mode(2, Mode::Down);
    let mut state = locks
        .engine
        .accept_hand_over(g.state(), TTL)
        .expect("2 of 3");
    std::mem::forget(g);
    for _ in 0..10 {
        state = locks.engine.accept_hand_over(&state, TTL).expect("2 of 3");
    }
    nodes.set_mode(2, Mode::Up);
    assert_eq!(nodes.get(2, "r"), Some(first));
    locks.engine.release(&state).expect("released");
    assert!((0..3).all(|i| nodes.get(i, "r").is_none()), "nothing left");
}

/// A fenced handed-over lock that a majority no longer holds, or with too
/// little validity left to swap inside it, is not used: it is deleted
/// everywhere (the caller locks anew).
#[test]
fn a_take_over_that_cannot_count_deletes_the_old_lock() {
    let (locks, nodes, clock) = client_with(3, fenced());
    let g = locks.lock("r", TTL).unwrap();
    nodes.del(0, "r");
    nodes.del(1, "r");
    assert!(matches!(
        locks.engine.accept_hand_over(g.state(), TTL),
        Err(Error::Expired)
    ));
    assert!((0..3).all(|i| nodes.get(i, "r").is_none()), "nothing left");
    std::mem::forget(g);

    let g = locks.lock("s", TTL).unwrap();
    let left = g.validity();
    clock.advance(left - 10 * MS);
    let before = nodes.rounds.load(Ordering::SeqCst);
    assert!(locks.engine.accept_hand_over(g.state(), TTL).is_err());
    assert!((0..3).all(|i| nodes.get(i, "s").is_none()), "released");
    assert_eq!(
        nodes.rounds.load(Ordering::SeqCst) - before,
        1,
        "no swap tried"
    );
    std::mem::forget(g);
}

#[test]
fn lock_makes_retry_count_attempts_then_reports_the_last_error() {
    let settings = Settings {
        retry_count: 4,
        ..crate::testing::fake::settings()
    };
    let (locks, nodes, clock) = client_with(3, settings.clone());
    // Held by another process (a holder in this one would be queued
    // behind, on the same virtual clock, for the whole wait).
    let other = client_over(&nodes, settings);
    let _g = other.try_lock("r", TTL).unwrap();
    let (r0, t0) = (nodes.rounds.load(Ordering::SeqCst), clock.now());
    assert!(matches!(locks.lock("r", TTL), Err(Error::Taken { .. })));
    assert_eq!(nodes.rounds.load(Ordering::SeqCst) - r0, 4);
    // Three pauses of at most 200 ms each, plus four 1 ms rounds.
    assert!(clock.now() - t0 <= 604 * MS, "{:?}", clock.now() - t0);
}

#[test]
fn lock_timeout_keeps_trying_until_the_wait_is_over() {
    let (locks, nodes, clock) = client(3);
    let holder = locks.try_lock("r", TTL).unwrap();
    let t0 = clock.now();
    assert!(locks.request("r", TTL).acquire_for(2 * TTL / 10).is_err());
    let waited = clock.now() - t0;
    assert!(
        waited >= 2 * TTL / 10 && waited <= 2 * TTL / 10 + 2 * MS,
        "{waited:?}"
    );
    // It succeeds once the holder's key expires inside the wait.
    nodes.set_mode(0, Mode::Up);
    drop(holder);
    let g = locks.request("r", TTL).acquire_for(TTL).unwrap();
    assert!(g.is_held());
}

/// A lock another thread of this process hands over only after the waiter's
/// wait ran out, and that the waiter cannot take (it asked for another TTL),
/// ends the wait as `Taken`, not `Expired`: the lock did not expire, another
/// thread held it the whole wait.
#[test]
fn a_hand_over_too_late_for_the_wait_is_taken() {
    let (locks, _, clock) = client(3);
    let holder = locks.try_lock("r", 6 * TTL).unwrap();
    let waiter = {
        let locks = locks.clone();
        std::thread::spawn(move || locks.request("r", TTL).acquire_for(TTL / 10))
    };
    // The waiter queues behind the holder (its virtual wait takes as long in
    // real time, or until the holder hands over).
    std::thread::sleep(Duration::from_millis(200));
    clock.advance(TTL);
    drop(holder);
    match waiter.join().expect("waiter") {
        Err(Error::Taken { held: 3, nodes: 3 }) => {}
        other => panic!("expected Taken, got {other:?}"),
    }
}

#[test]
fn extend_moves_the_deadline_and_detects_loss() {
    let (locks, nodes, clock) = client(3);
    let g = locks.try_lock("r", 100 * MS).unwrap();
    clock.advance(50 * MS);
    let v = g.extend(100 * MS).unwrap();
    assert_eq!(v, 100 * MS - MS - 3 * MS);
    clock.advance(90 * MS);
    assert!(g.is_held(), "extension should outlive the original ttl");
    // Someone deletes it behind our back on a majority.
    nodes.del(0, "r");
    nodes.del(1, "r");
    assert!(matches!(g.extend(100 * MS), Err(Error::Expired)));
    assert!(!g.is_held());
    assert!(matches!(g.extend(100 * MS), Err(Error::Expired)));
}

#[test]
fn release_tells_expired_from_taken_over() {
    let (locks, _, clock) = client(3);
    let g = locks.try_lock("r", 100 * MS).unwrap();
    clock.advance(200 * MS);
    assert!(!g.is_held());
    assert!(matches!(g.release(), Err(Error::Expired)));

    let g = locks.try_lock("r", 100 * MS).unwrap();
    clock.advance(200 * MS);
    let _other = locks.try_lock("r", TTL).unwrap();
    assert!(matches!(g.release(), Err(Error::NotOwner { nodes: 3 })));
}

/// `max_ttl` is the longest TTL any client uses: the restart rule stops
/// waiting for stragglers beyond it, so a lock or an extension above it
/// is refused.
#[test]
fn a_ttl_above_the_configured_max_ttl_is_refused() {
    let settings = Settings {
        max_ttl: Some(Duration::from_secs(2)),
        ..crate::testing::fake::settings()
    };
    let (locks, _, _) = crate::testing::fake::client_with(3, settings);
    let long = Duration::from_secs(3);
    assert!(matches!(
        locks.try_lock("r", long),
        Err(Error::InvalidInput(InvalidInput::TtlTooLong(t))) if t == long
    ));
    let g = locks
        .try_lock("r", Duration::from_secs(2))
        .expect("at max_ttl");
    assert!(matches!(
        g.extend(long),
        Err(Error::InvalidInput(InvalidInput::TtlTooLong(_)))
    ));
    g.release().expect("release");
}

#[test]
fn bad_input_is_refused_before_any_io() {
    let (locks, nodes, _) = client(3);
    let cases: [(&str, Duration, InvalidInput); 4] = [
        ("", TTL, InvalidInput::EmptyResource),
        ("r", Duration::ZERO, InvalidInput::ZeroTtl),
        (
            "r",
            2 * MS,
            InvalidInput::TtlTooShort {
                ttl: 2 * MS,
                allowance: Duration::from_micros(2020),
            },
        ),
        ("r", Duration::MAX, InvalidInput::TtlTooLong(Duration::MAX)),
    ];
    for (res, ttl, want) in cases {
        match locks.lock(res, ttl) {
            Err(Error::InvalidInput(got)) => assert_eq!(got, want),
            other => panic!("{res:?} {ttl:?}: {other:?}"),
        }
    }
    assert_eq!(nodes.rounds.load(Ordering::SeqCst), 0);
}

/// The restart race, made deterministic: X holds a lock on nodes 0 and
/// 2; node 2 restarts empty; a client that meets the cluster for the
/// first time must not win nodes 1 + 2, whatever TTL it asks for.
#[test]
fn a_node_that_lost_its_data_does_not_vote_for_a_fresh_client() {
    let (x, nodes, clock) = client(3);
    // The cluster has carried 10 s locks for a while.
    drop(x.try_lock("warm", TTL).unwrap());
    clock.advance(60 * TTL);
    nodes.set_mode(1, Mode::Down);
    let held = x.try_lock("r", TTL).expect("nodes 0 and 2");
    nodes.set_mode(1, Mode::Up);
    nodes.wipe(2);
    clock.advance(TTL / 10);

    // A fresh client with default (production) settings, asking 1 s.
    let y = client_over(&nodes, Settings::default());
    match y.try_lock("r", TTL / 10) {
        Err(Error::NoQuorum { failures, .. }) => {
            let f: Vec<_> = failures.iter().map(|f| (f.node(), f.kind())).collect();
            assert_eq!(f, [("fake2:6379", crate::NodeErrorKind::Restarted)]);
        }
        other => panic!("two holders: {other:?}"),
    }
    assert!(nodes.get(2, "r").is_none(), "the held-back SET was undone");
    // Without the rule it wins: the hazard is real.
    let unprotected = client_over(
        &nodes,
        Settings {
            restart_protection: false,
            ..Settings::default()
        },
    );
    assert!(unprotected.try_lock("r", TTL / 10).is_ok());
    assert!(held.is_held());
}

#[test]
fn a_held_back_node_votes_again_after_the_longest_ttl() {
    let (x, nodes, clock) = client(3);
    drop(x.try_lock("warm", TTL).unwrap());
    clock.advance(60 * TTL);
    nodes.wipe(0);
    nodes.wipe(1);
    let y = client_over(&nodes, Settings::default());
    assert!(y.try_lock("a", TTL / 10).is_err(), "two young nodes of 3");
    // The young nodes learnt nothing of the 10 s TTL, but node 2 reports
    // it: they are held for 10 s, not for the 1 s asked.
    clock.advance(TTL / 2);
    assert!(y.try_lock("b", TTL / 10).is_err());
    clock.advance(TTL / 2);
    assert!(y.try_lock("c", TTL / 10).is_ok());
}

#[test]
fn a_brand_new_cluster_waits_one_ttl_unless_declared_fresh() {
    let (_, nodes, clock) = client_with(3, Settings::default());
    let y = client_over(&nodes, Settings::default());
    let t0 = clock.now();
    let g = y
        .request("r", TTL)
        .acquire_for(2 * TTL)
        .expect("after one ttl");
    let waited = clock.now() - t0;
    assert!(waited >= TTL && waited < TTL + TTL / 2, "{waited:?}");
    drop(g);
    // Declared fresh: at once.
    let (fresh, _, _) = client(3);
    assert!(fresh.try_lock("r", TTL).is_ok());
}

#[test]
fn a_fresh_cluster_client_still_holds_back_a_node_it_saw_restart() {
    let (x, nodes, clock) = client(3);
    drop(x.try_lock("warm", TTL).unwrap());
    clock.advance(TTL);
    nodes.set_mode(1, Mode::Down);
    let _held = x.try_lock("r", TTL).unwrap();
    nodes.set_mode(1, Mode::Up);
    nodes.wipe(2);
    let y = client_over(&nodes, crate::testing::fake::settings());
    // y has never seen node 2: trusted at first sight (the documented
    // risk of fresh_cluster); x has, and holds it back.
    drop(y);
    match x.try_lock("other", TTL) {
        Ok(g) => {
            assert_eq!(nodes.get(2, "other").as_deref(), Some(g.token()));
            // Granted by nodes 0 and 1; node 2's vote did not count.
        }
        Err(e) => panic!("{e}"),
    }
    nodes.set_mode(1, Mode::Down);
    match x.try_lock("third", TTL) {
        Err(Error::NoQuorum { failures, .. }) => {
            assert!(failures
                .iter()
                .any(|f| f.kind() == crate::NodeErrorKind::Restarted));
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn releases_are_never_held_back() {
    let (x, nodes, clock) = client(3);
    drop(x.try_lock("warm", TTL).unwrap());
    nodes.wipe(2);
    clock.advance(TTL / 10);
    // x saw node 2's history start again: its acquire votes are held
    // back, but our SET there stands (it is ours).
    let g = x.try_lock("r", TTL).expect("nodes 0 and 1");
    assert_eq!(nodes.get(2, "r").as_deref(), Some(g.token()));
    match x.try_lock("probe", TTL) {
        Ok(p) => drop(p),
        Err(e) => panic!("{e}"),
    }
    // With node 0 down, the release needs node 2's delete to count.
    nodes.set_mode(0, Mode::Down);
    g.release().expect("deleted on nodes 1 and 2: a majority");
    assert!(nodes.get(2, "r").is_none());
}

#[test]
fn huge_and_reserved_resource_names_are_refused_before_any_io() {
    let (locks, nodes, _) = client(3);
    let huge = "x".repeat(crate::MAX_RESOURCE_LEN + 1);
    match locks.try_lock(&huge, TTL) {
        Err(Error::InvalidInput(InvalidInput::ResourceTooLong { len, max })) => {
            assert_eq!(
                (len, max),
                (crate::MAX_RESOURCE_LEN + 1, crate::MAX_RESOURCE_LEN)
            );
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        locks.lock(crate::algorithm::round::META_KEY, TTL),
        Err(Error::InvalidInput(InvalidInput::ReservedResource(_)))
    ));
    assert_eq!(nodes.rounds.load(Ordering::SeqCst), 0);
    let longest = "y".repeat(crate::MAX_RESOURCE_LEN);
    assert!(locks.try_lock(&longest, TTL).is_ok());
}

/// `run` must not report success for work that finished after the
/// lock's validity, even while the keys (which live the full TTL, a
/// drift allowance longer) are still ours on the nodes.
#[test]
fn with_lock_reports_work_that_outlived_its_validity() {
    let (locks, _, clock) = client(3);
    let ttl = TTL;
    let r = locks.lock("r", ttl).and_then(|g| {
        g.run(|g| {
            // Past the deadline, before the keys expire on the nodes.
            let past = g.validity() + MS;
            clock.advance(past);
            assert!(!g.is_held());
        })
    });
    assert!(matches!(r, Err(Error::Expired)), "{r:?}");
    // Work done in time is still Ok.
    assert!(locks
        .lock("s", ttl)
        .and_then(|g| g.run(|_| clock.advance(MS)))
        .is_ok());
}

/// Extensions never shorten a lock: one too short to survive its own
/// round, on a lock that already lasts longer, is done (it used to
/// report `ValidityExhausted` for a healthy lock).
#[test]
fn an_extension_shorter_than_what_is_left_is_done() {
    let (locks, nodes, _clock) = client(3);
    *nodes.latency.lock() = 2 * MS;
    let g = locks.try_lock("r", TTL).unwrap();
    let deadline = g.deadline();
    let v = g.extend(3 * MS).expect("nothing to do is done");
    assert!(v > TTL / 2, "{v:?}");
    assert_eq!(g.deadline(), deadline);
}

/// A failed extension may still have set a later expiry on the nodes
/// it reached: the release's retry window covers it.
#[test]
fn a_failed_extension_widens_the_release_window() {
    let (locks, nodes, clock) = client(3);
    let g = locks.try_lock("r", TTL).unwrap();
    for i in 0..3 {
        nodes.set_mode(i, Mode::Lossy);
    }
    let start = clock.now();
    assert!(g.extend(10 * TTL).is_err(), "no replies: not extended");
    assert!(g.deadline() < start + TTL, "the deadline stays");
    let keep = locks.engine.keep_until(g.state());
    assert!(
        keep >= start + 10 * TTL,
        "release window {:?}",
        keep - start
    );
}
