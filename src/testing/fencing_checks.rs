//! Fencing tokens under hostile schedules, on the fake nodes: attacks on
//! the write-back, the counters and the hand-overs. The first group were
//! defects, each failing before its fix; the second held up.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use super::logs::capture_logs;
use crate::algorithm::round::Op;
use crate::clock::Clock;
use crate::error::Error;
use crate::lock::settings::Settings;
use crate::testing::fake::{client_over, client_with, settings, FakeNodes, Hook, Mode};

const MS: Duration = Duration::from_millis(1);
const TTL: Duration = Duration::from_secs(10);

fn fenced() -> Settings {
    Settings {
        fencing: true,
        ..settings()
    }
}

fn hook(nodes: &FakeNodes, f: impl Fn(&FakeNodes, Op) + Send + Sync + 'static) {
    *nodes.before_round.lock() = Some(Hook(Box::new(f)));
}

fn unhook(nodes: &FakeNodes) {
    *nodes.before_round.lock() = None;
}

/// Another owner's key, planted on `node` (as if its SET had won there).
fn plant(nodes: &FakeNodes, node: usize, resource: &str, token: &str) {
    let exp = crate::clock::after(nodes.clock.now(), TTL);
    nodes.stores[node]
        .lock()
        .keys
        .insert(resource.into(), (token.into(), exp));
}

// ------------------------------------------------------------------
// Defects: each failed before its fix.

/// The write-back finds another owner's key on a majority (ours was
/// deleted behind our back, e.g. FLUSHALL/failover, and another client
/// won the nodes). Nothing was slow: 1 ms rounds, 10 s TTL. The error
/// should say the lock is taken (as an acquire that meets another owner
/// says), not `ValidityExhausted`, whose documentation tells the caller
/// "a majority agreed, but so late that no validity was left … raise the
/// TTL or look at node latency".
#[test]
fn a_write_back_beaten_by_another_owner_reports_taken() {
    let (locks, nodes, _) = client_with(3, fenced());
    hook(&nodes, |n, op| {
        if matches!(op, Op::Fence { .. }) {
            for i in 0..3 {
                n.del(i, "r");
                plant(n, i, "r", "another-owner");
            }
        }
    });
    let err = locks.try_lock("r", TTL).expect_err("not granted");
    unhook(&nodes);
    assert!(err.is_retryable(), "{err:?}");
    assert!(
        matches!(err, Error::Taken { .. }),
        "the write-back met another owner on 3 of 3 nodes after a 1 ms round, \
         yet the error is {err:?} ({err})"
    );
}

/// Counters stop at the limit of exact Lua numbers: an acquire meeting
/// one is refused by the node (before its SET), and a handed whose next
/// token would pass it is not handed over.
#[test]
fn counters_at_the_limit_refuse_instead_of_tying() {
    let (locks, nodes, _) = client_with(3, fenced());
    let limit = crate::algorithm::round::FENCE_LIMIT;
    for i in 0..3 {
        nodes.stores[i].lock().fences.insert("r".into(), limit);
    }
    match locks.try_lock("r", TTL) {
        Err(Error::NoQuorum { failures, .. }) => assert!(failures
            .iter()
            .all(|f| f.kind() == crate::NodeErrorKind::Server)),
        other => panic!("{other:?}"),
    }
    assert!((0..3).all(|i| nodes.get(i, "r").is_none()), "no SET ran");
    for i in 0..3 {
        nodes.stores[i].lock().fences.insert("s".into(), limit - 1);
    }
    let g = locks.try_lock("s", TTL).expect("the last exact token");
    assert_eq!(g.fencing_token(), Some(limit));
    assert!(
        locks.engine.accept_hand_over(g.state(), TTL).is_err(),
        "limit + 1"
    );
    std::mem::forget(g);
    assert!((0..3).all(|i| nodes.get(i, "s").is_none()), "released");
}

/// A command sent again after its connection closed (it may have run):
/// the store answers as the scripts do, our own SET (with its counter)
/// and our own swap count as done, another token's key does not.
#[test]
fn commands_sent_again_count_what_they_did_the_first_time() {
    use crate::algorithm::round::{Answer, Key};
    let mut store = crate::testing::store::Store::default();
    let now = std::time::Instant::now();
    let acquire = Op::Acquire {
        lean: None,
        intent: std::time::Duration::ZERO,
        place: crate::algorithm::round::Place::NONE,
        ttl: TTL,
        known_max: TTL,
        fenced: true,
        after: crate::algorithm::round::After::NONE,
        known_prev: std::time::Duration::ZERO,
    };
    let first = store
        .round(acquire, &[Key::new("r", "t1")], now, now, 5)
        .expect("first");
    let again = store
        .round(acquire, &[Key::new("r", "t1")], now, now, 9)
        .expect("again");
    assert_eq!(first.answers, vec![Answer::Ok]);
    assert_eq!(again.answers, vec![Answer::Ok]);
    assert_eq!(again.fence, first.fence, "the same section's counter");
    let other = store
        .round(acquire, &[Key::new("r", "t2")], now, now, 9)
        .expect("other");
    assert_eq!(other.answers, vec![Answer::Other]);
    let swap = Op::Swap {
        ttl: TTL,
        known_max: TTL,
        fence: None,
    };
    let key = Key {
        next: Some("t1.s"),
        ..Key::new("r", "t1")
    };
    for _ in 0..2 {
        let r = store.round(swap, &[key], now, now, 9).expect("swap");
        assert_eq!(r.answers, vec![Answer::Ok]);
    }
}

// ------------------------------------------------------------------
// Attacks that held up.

/// The write-back reaches one node and executes on a Lossy one (reply
/// lost): one confirmed of three is no majority. Refused, retryable, and
/// the key is gone where the release ran (the Lossy node executed it).
#[test]
fn lossy_write_back_is_not_counted() {
    let (locks, nodes, _) = client_with(3, fenced());
    hook(&nodes, |n, op| {
        if let Op::Fence { .. } = op {
            n.set_mode(1, Mode::Lossy);
            n.set_mode(2, Mode::Down);
        }
    });
    match locks.try_lock("r", TTL) {
        Err(e @ Error::NoQuorum { agreed: 1, .. }) => assert!(e.is_retryable()),
        other => panic!("{other:?}"),
    }
    unhook(&nodes);
    // Node 2 (down) is left to the background retries the fake lacks.
    assert!((0..2).all(|i| nodes.get(i, "r").is_none()));
}

/// The acquire round eats most of the validity; the write-back round
/// (same latency) cannot end inside it. Refused, retryable, key gone.
#[test]
fn validity_running_out_during_the_write_back() {
    let (locks, nodes, _) = client_with(3, fenced());
    let ttl = 100 * MS;
    *nodes.latency.lock() = 49 * MS;
    match locks.try_lock("r", ttl) {
        Err(e @ Error::ValidityExhausted { .. }) => assert!(e.is_retryable()),
        Ok(g) => panic!("granted with {:?} left", g.validity()),
        Err(e) => panic!("{e:?}"),
    }
    assert!((0..3).all(|i| nodes.get(i, "r").is_none()));
    // One ms less per round: granted, with its token written back.
    *nodes.latency.lock() = 40 * MS;
    let g = locks.try_lock("s", ttl).expect("fits");
    let t = g.fencing_token().unwrap();
    assert!((0..3).all(|i| nodes.fence(i, "s") == Some(t)));
}

/// lock() retries after a failed write-back and the retry's token is
/// larger than any counter the failed attempt left behind.
#[test]
fn lock_retries_after_a_failed_write_back() {
    let (locks, nodes, _) = client_with(3, fenced());
    let fences = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let seen = fences.clone();
    hook(&nodes, move |n, op| {
        if matches!(op, Op::Fence { .. }) && seen.fetch_add(1, Ordering::SeqCst) == 0 {
            n.del(0, "r");
            n.del(1, "r");
        }
    });
    let g = locks.lock("r", TTL).expect("second attempt");
    assert_eq!(fences.load(Ordering::SeqCst), 2);
    let t = g.fencing_token().unwrap();
    assert!((0..3).all(|i| nodes.fence(i, "r").is_some_and(|c| c <= t)));
}

/// A node held back by the restart rule granted our SET with a much
/// larger counter (its clock is ahead); the token comes from the counted
/// nodes only, and the next holder, granted by that node and one other,
/// still gets a larger token.
#[test]
fn a_held_back_node_with_a_larger_counter() {
    let s = Settings {
        fresh_cluster: false,
        max_ttl: Some(TTL),
        ..fenced()
    };
    let (locks, nodes, clock) = client_with(3, s.clone());
    // Everyone old enough.
    clock.advance(TTL);
    for i in 0..3 {
        let _ = nodes.stores[i].lock().history(
            (TTL, TTL, crate::algorithm::round::After::NONE, TTL),
            clock.base,
            clock.base,
        );
    }
    nodes.wipe(2);
    nodes.set_clock_offset(2, 5_000_000);
    let g = locks.try_lock("r", TTL).expect("nodes 0 and 1");
    let t = g.fencing_token().unwrap();
    assert!(nodes.fence(2, "r").unwrap() > t, "node 2's own counter");
    g.release().unwrap();
    nodes.set_mode(0, Mode::Down);
    clock.advance(TTL + MS);
    let b = client_over(&nodes, s);
    let tb = b.try_lock("r", TTL).unwrap().fencing_token().unwrap();
    assert!(tb > t);
}

/// Fenced and unfenced clients alternate on one resource: the unfenced
/// ones leave the counters alone, the fenced tokens keep growing.
#[test]
fn mixed_fenced_and_unfenced_clients() {
    let (a, nodes, clock) = client_with(3, fenced());
    let plain = client_over(&nodes, settings());
    let mut last = 0;
    for i in 0..10 {
        let g = plain.try_lock("r", TTL).unwrap();
        assert_eq!(g.fencing_token(), None);
        if i % 2 == 0 {
            drop(g);
        } else {
            std::mem::forget(g);
            clock.advance(TTL + MS);
        }
        let g = a.try_lock("r", TTL).unwrap();
        let t = g.fencing_token().unwrap();
        assert!(t > last, "{t} after {last}");
        last = t;
    }
}

/// try_lock with fencing, a node hung in the write-back and in the
/// release: at most three node timeouts (acquire, write-back, release).
#[test]
fn try_lock_bound_with_a_failing_write_back() {
    let (locks, nodes, clock) = client_with(3, fenced());
    let nt = locks.engine.settings.node_timeout;
    nodes.set_mode(2, Mode::Down);
    hook(&nodes, |n, op| match op {
        Op::Acquire { .. } => n.set_mode(1, Mode::Up),
        _ => n.set_mode(1, Mode::Hung),
    });
    let t0 = clock.now();
    assert!(locks.try_lock("r", TTL).is_err());
    let took = clock.now().saturating_duration_since(t0);
    assert!(took <= 3 * nt, "{took:?}");
    // lock(): retry_count × (delay + jitter + nt) + 3 nt.
    let s = &locks.engine.settings;
    let bound = (s.retry_delay + s.retry_jitter + nt) * s.retry_count + 3 * nt;
    let t0 = clock.now();
    assert!(locks.lock("r", TTL).is_err());
    let took = clock.now().saturating_duration_since(t0);
    assert!(took <= bound, "{took:?} > {bound:?}");
    unhook(&nodes);
}

/// Logging: a fenced happy path logs nothing at info or above, and no
/// fencing token ever appears in a record above debug, on success or on
/// a failed write-back.
#[test]
fn no_warn_on_the_happy_path_and_tokens_only_at_debug() {
    let records = capture_logs();
    let (locks, nodes, _) = client_with(3, fenced());
    let mut tokens = Vec::new();
    for _ in 0..5 {
        let g = locks.lock("r", TTL).unwrap();
        tokens.push(g.fencing_token().unwrap());
        g.release().unwrap();
    }
    let happy = records.take();
    assert!(
        happy
            .iter()
            .any(|(l, m)| *l == log::Level::Debug && m.contains("fencing token")),
        "the capture works: {happy:?}"
    );
    let loud: Vec<String> = happy
        .into_iter()
        .filter(|(l, _)| *l <= log::Level::Info)
        .map(|(_, m)| m)
        .collect();
    assert!(loud.is_empty(), "happy path logged: {loud:?}");
    // A failed write-back (one node gone between the rounds).
    nodes.set_mode(2, Mode::Down);
    hook(&nodes, |n, op| {
        if matches!(op, Op::Fence { .. }) {
            n.set_mode(1, Mode::Down);
        }
    });
    let _ = locks.try_lock("s", TTL);
    unhook(&nodes);
    for i in 0..3 {
        if let Some(t) = nodes.fence(i, "s") {
            tokens.push(t);
        }
    }
    for (l, m) in records.take() {
        if l <= log::Level::Info {
            for t in &tokens {
                assert!(!m.contains(&t.to_string()), "token at {l}: {m}");
            }
        }
    }
}
