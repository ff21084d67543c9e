//! The core client against real Redis nodes.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use quorumlock::{Error, InvalidInput, NodeErrorKind, Redlock};

use crate::common::{shared, unique_key, Cluster};

const TTL: Duration = Duration::from_secs(5);

/// Node timeout for tests that are not about timeouts: generous, so that a
/// loaded CI machine does not turn a slow healthy node into a failure.
const SLACK: Duration = Duration::from_millis(250);

fn client(urls: &[String]) -> Redlock {
    crate::client_with(urls.to_vec(), SLACK)
}

#[test]
fn second_client_waits_for_release() {
    let c = shared();
    let key = unique_key("exclusion");
    let (a, b) = (client(&c.urls()), client(&c.urls()));
    let held = a.try_lock(&key, TTL).expect("first client locks");
    match b.try_lock(&key, TTL) {
        // Every node that was asked says so (under load one may be skipped).
        Err(Error::Taken { held, nodes: 3 }) if held >= 2 => {}
        other => panic!("second client should be refused: {other:?}"),
    }
    held.release().expect("release");
    let g = b
        .try_lock(&key, TTL)
        .expect("second client locks after release");
    drop(g);
}

#[test]
fn validity_is_less_than_ttl_and_token_is_on_every_node() {
    let c = shared();
    let key = unique_key("validity");
    let g = client(&c.urls()).try_lock(&key, TTL).unwrap();
    assert!(
        g.validity() < TTL && g.validity() > TTL / 2,
        "{:?}",
        g.validity()
    );
    assert!(g.is_held());
    assert_eq!(g.token().len(), 32);
    assert!(c.holders(&key, g.token()) >= 2, "not on a majority");
    for i in 0..c.len() {
        let pttl = c.pttl(i, &key);
        assert!(pttl <= 5000, "node {i}: pttl {pttl}");
        assert!(pttl > 0 || c.get(i, &key).is_none(), "node {i}: no expiry");
    }
}

#[test]
fn released_lock_is_gone_from_every_node() {
    let c = shared();
    let key = unique_key("released");
    let locks = client(&c.urls());
    locks.try_lock(&key, TTL).unwrap().release().unwrap();
    assert!(c.gone_everywhere(&key, Duration::from_secs(1)));

    // Dropping the guard releases too.
    let g = locks.try_lock(&key, TTL).unwrap();
    drop(g);
    assert!(c.gone_everywhere(&key, Duration::from_secs(1)));
}

#[test]
fn non_owner_cannot_release_or_extend() {
    let c = shared();
    let key = unique_key("non-owner");
    let locks = client(&c.urls());
    // Our key vanishes behind our back (an operator, a node restart) and
    // another client takes the resource while our guard still has validity.
    let stale = locks.try_lock(&key, TTL).unwrap();
    for i in 0..c.len() {
        c.del(i, &key);
    }
    let owner = locks.try_lock(&key, TTL).expect("free again");
    assert!(matches!(stale.extend(TTL), Err(Error::NotOwner { nodes }) if nodes >= 2));
    assert!(stale.is_lost() && !stale.is_held());
    assert!(matches!(stale.release(), Err(Error::NotOwner { nodes }) if nodes >= 2));
    assert!(c.holders(&key, owner.token()) >= 2, "owner's key survived");

    // After its validity ran out a guard does not even try to extend, and
    // its release leaves the new owner's key alone.
    let key = unique_key("non-owner-expired");
    let stale = locks.try_lock(&key, Duration::from_millis(200)).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let owner = locks
        .try_lock(&key, TTL)
        .expect("expired lock can be taken");
    assert!(matches!(stale.extend(TTL), Err(Error::Expired)));
    assert!(matches!(stale.release(), Err(Error::NotOwner { nodes }) if nodes >= 2));
    assert!(c.holders(&key, owner.token()) >= 2, "owner's key survived");
}

#[test]
fn release_after_expiry_says_expired() {
    let c = shared();
    let key = unique_key("expired");
    let g = client(&c.urls())
        .try_lock(&key, Duration::from_millis(100))
        .unwrap();
    std::thread::sleep(Duration::from_millis(200));
    assert!(!g.is_held());
    assert!(matches!(g.release(), Err(Error::Expired)));
}

#[test]
fn extend_keeps_exclusivity_past_the_original_ttl() {
    let c = shared();
    let key = unique_key("extend");
    let (a, b) = (client(&c.urls()), client(&c.urls()));
    let ttl = Duration::from_millis(300);
    let g = a.try_lock(&key, ttl).unwrap();
    let started = Instant::now();
    while started.elapsed() < ttl * 3 {
        std::thread::sleep(ttl / 3);
        let v = g.extend(ttl).expect("extend while held");
        assert!(v < ttl && v > ttl / 2, "{v:?}");
        assert!(matches!(b.try_lock(&key, ttl), Err(Error::Taken { .. })));
    }
    assert!(g.is_held());
    g.release().unwrap();
}

/// The simulation's find: an extension to a shorter TTL, delayed in the
/// network past a later renewal, cut the keys short under a holder that
/// believed it held. Extensions never shorten a key.
#[test]
fn extend_to_a_shorter_ttl_never_shortens_the_lock() {
    let c = shared();
    let key = unique_key("extend-shorter");
    let locks = client(&c.urls());
    // A new client's first lock lands only on the nodes connected by then.
    assert_eq!(locks.wait_connected(Duration::from_secs(5)).ok(), Some(3));
    let g = locks.try_lock(&key, TTL).unwrap();
    let token = g.token().to_owned();
    assert!(crate::common::wait_until(Duration::from_secs(1), || c
        .holders(&key, &token)
        == 3));
    let deadline = g.deadline();
    let v = g.extend(Duration::from_millis(500)).expect("extend");
    assert!(
        v > TTL / 2,
        "the validity left, not the shorter TTL's: {v:?}"
    );
    assert_eq!(g.deadline(), deadline, "the deadline stays");
    for i in 0..3 {
        let pttl = c.pttl(i, &key);
        assert!(
            pttl > 4_000,
            "node {i}: PTTL {pttl} ms after extend(500 ms)"
        );
    }
    // A longer one still extends.
    g.extend(TTL * 2).expect("extend");
    assert!(g.deadline() > deadline);
    assert!(c.pttl(0, &key) > 9_000);
    g.release().unwrap();
}

#[test]
fn many_threads_never_overlap() {
    let c = shared();
    let key = unique_key("overlap");
    let locks = Redlock::builder()
        .fresh_cluster(true)
        .nodes(c.urls())
        .node_timeout(SLACK)
        .retry_delay(Duration::from_millis(3))
        .retry_jitter(Duration::from_millis(3))
        .build()
        .unwrap();
    let inside = Arc::new(AtomicUsize::new(0));
    let overlaps = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicUsize::new(0));
    std::thread::scope(|s| {
        for _ in 0..16 {
            let (locks, key) = (locks.clone(), key.clone());
            let (inside, overlaps, done) = (inside.clone(), overlaps.clone(), done.clone());
            s.spawn(move || {
                for _ in 0..50 {
                    let g = locks
                        .request(&key, TTL)
                        .acquire_for(Duration::from_secs(60))
                        .expect("acquire within a minute");
                    if inside.fetch_add(1, Ordering::SeqCst) != 0 {
                        overlaps.fetch_add(1, Ordering::SeqCst);
                    }
                    std::thread::yield_now();
                    inside.fetch_sub(1, Ordering::SeqCst);
                    g.release().expect("release while held");
                    done.fetch_add(1, Ordering::SeqCst);
                }
            });
        }
    });
    assert_eq!(overlaps.load(Ordering::SeqCst), 0);
    assert_eq!(done.load(Ordering::SeqCst), 16 * 50);
}

#[test]
fn one_stopped_node_of_three_still_locks() {
    let c = Cluster::start(3);
    let locks = client(&c.urls());
    c.stop(2);
    let key = unique_key("minority-down");
    let g = locks.lock(&key, TTL).expect("a majority is enough");
    assert!(g.is_held());
    assert_eq!(c.get(0, &key).as_deref(), Some(g.token()));
}

#[test]
fn two_stopped_nodes_of_three_fail_with_their_names() {
    let c = Cluster::start(3);
    let locks = client(&c.urls());
    let key = unique_key("majority-down");
    c.stop(1);
    c.stop(2);
    match locks.try_lock(&key, TTL) {
        // Node 0's reply may not have been waited for: the two refusals
        // settle the round on their own.
        Err(Error::NoQuorum {
            agreed: 0 | 1,
            quorum: 2,
            failures,
        }) => {
            let failed: Vec<String> = failures.iter().map(|f| f.node().to_owned()).collect();
            for i in [1, 2] {
                let name = c.url(i).trim_start_matches("redis://").to_owned();
                assert!(failed.contains(&name), "{name} not in {failed:?}");
            }
        }
        other => panic!("expected NoQuorum, got {other:?}"),
    }
    // The failed attempt did not leave its key on the healthy node.
    assert_eq!(c.get(0, &key), None);
}

#[test]
fn a_paused_node_costs_at_most_a_few_node_timeouts() {
    let c = Cluster::start(3);
    let timeout = Duration::from_millis(50);
    let locks = crate::client_with(c.urls(), timeout);
    // Warm the pools so the measurement is about the hung node only.
    drop(locks.lock(&unique_key("warm"), TTL).unwrap());
    c.pause(1);
    for n in 0..5 {
        let key = unique_key("paused");
        let t = Instant::now();
        // The bound is the point; on a loaded machine a healthy node may
        // time out too, so the outcome is not asserted.
        let attempt = locks.try_lock(&key, TTL);
        let took = t.elapsed();
        assert!(took < timeout * 4, "attempt {n} took {took:?}");
        if let Ok(g) = attempt {
            let t = Instant::now();
            let _ = g.release();
            assert!(
                t.elapsed() < timeout * 4,
                "release {n} took {:?}",
                t.elapsed()
            );
        }
    }
    c.unpause(1);
}

#[test]
fn building_with_every_node_down_succeeds_and_locking_fails_fast() {
    let c = Cluster::start(3);
    let urls = c.urls();
    for i in 0..3 {
        c.stop(i);
    }
    let t = Instant::now();
    let locks = client(&urls);
    assert!(
        t.elapsed() < Duration::from_millis(200),
        "build took {:?}",
        t.elapsed()
    );
    let t = Instant::now();
    match locks.try_lock(&unique_key("all-down"), TTL) {
        Err(Error::NoQuorum {
            agreed: 0,
            failures,
            ..
        }) => {
            assert_eq!(failures.len(), 3);
            // Two refusals settle the round: the third node may still have
            // been connecting (no connection yet), never a wait charged to it.
            let refused = failures
                .iter()
                .filter(|f| {
                    matches!(
                        f.kind(),
                        NodeErrorKind::Unavailable | NodeErrorKind::Io | NodeErrorKind::Skipped
                    )
                })
                .count();
            assert!(
                refused >= 2
                    && failures.iter().all(|f| refused == 3
                        || f.kind() != NodeErrorKind::NoConnection
                        || f.detail().contains("connecting")),
                "{failures:?}"
            );
        }
        other => panic!("expected NoQuorum, got {other:?}"),
    }
    assert!(
        t.elapsed() < Duration::from_millis(500),
        "lock took {:?}",
        t.elapsed()
    );
}

/// A refused node's failure keeps the I/O error beneath it as its `source()`, so a caller
/// can match on the `io::ErrorKind` instead of parsing the message.
#[test]
fn a_refused_node_failure_keeps_its_io_error_as_source() {
    use std::error::Error as _;
    let locks = client(&["redis://127.0.0.1:1".to_string()]);
    let mut seen = Vec::new();
    for _ in 0..3 {
        match locks.try_lock(&unique_key("refused-source"), TTL) {
            Err(Error::NoQuorum { failures, .. }) => seen.extend(failures),
            other => panic!("expected NoQuorum, got {other:?}"),
        }
    }
    for f in &seen {
        let io = f
            .source()
            .and_then(|s| s.downcast_ref::<std::io::Error>())
            .unwrap_or_else(|| panic!("no io::Error beneath {f} ({f:?})"));
        assert_eq!(io.kind(), std::io::ErrorKind::ConnectionRefused, "{f}");
    }
}

#[test]
fn bad_input_gets_typed_errors() {
    let ok = ["redis://127.0.0.1:1".to_string()];
    let builder = || Redlock::builder().fresh_cluster(true).nodes(ok.clone());
    type Case = (
        &'static str,
        quorumlock::Result<Redlock>,
        fn(&InvalidInput) -> bool,
    );
    let cases: Vec<Case> = vec![
        (
            "no nodes",
            Redlock::builder().fresh_cluster(true).build(),
            |e| *e == InvalidInput::NoNodes,
        ),
        (
            "duplicate",
            builder().node("redis://127.0.0.1:1/2").build(),
            |e| matches!(e, InvalidInput::DuplicateNode(_)),
        ),
        (
            "bad url",
            Redlock::builder()
                .fresh_cluster(true)
                .node("mongodb://x")
                .build(),
            |e| matches!(e, InvalidInput::BadNodeUrl { .. }),
        ),
        (
            "zero timeout",
            builder().node_timeout(Duration::ZERO).build(),
            |e| *e == InvalidInput::ZeroDuration("node_timeout"),
        ),
        ("nan drift", builder().drift_factor(f64::NAN).build(), |e| {
            matches!(e, InvalidInput::DriftFactor(_))
        }),
        ("drift 1.0", builder().drift_factor(1.0).build(), |e| {
            matches!(e, InvalidInput::DriftFactor(_))
        }),
        ("zero retries", builder().retry_count(0).build(), |e| {
            *e == InvalidInput::ZeroCount("retry_count")
        }),
        ("zero pool", builder().pool_size(0).build(), |e| {
            *e == InvalidInput::ZeroCount("pool_size")
        }),
    ];
    for (name, result, check) in cases {
        match result {
            Err(Error::InvalidInput(e)) => assert!(check(&e), "{name}: {e:?}"),
            other => panic!("{name}: {other:?}"),
        }
    }

    let locks = builder().build().unwrap();
    let calls: Vec<(&str, Duration)> = vec![
        ("", TTL),
        ("k", Duration::ZERO),
        ("k", Duration::from_millis(2)),
        ("k", Duration::MAX),
    ];
    for (res, ttl) in calls {
        let e = locks.lock(res, ttl).expect_err("refused");
        assert!(
            matches!(e, Error::InvalidInput(_)),
            "{res:?} {ttl:?}: {e:?}"
        );
        assert!(!e.is_retryable());
    }
}

#[test]
fn flushed_scripts_fall_back_to_eval_on_every_kind_of_round() {
    let c = Cluster::start(3);
    let locks = client(&c.urls());
    drop(locks.try_lock(&unique_key("warm"), TTL).unwrap());
    for i in 0..3 {
        let _: () = redis::cmd("SCRIPT")
            .arg("FLUSH")
            .query(&mut c.conn(i))
            .expect("SCRIPT FLUSH");
    }
    // Acquire, extend and release each meet NOSCRIPT on pooled connections
    // and must still work (EVAL with the source, then cached again).
    let key = unique_key("flushed");
    let g = locks
        .try_lock(&key, TTL)
        .expect("acquire after SCRIPT FLUSH");
    // A node whose NOSCRIPT came after the round settled is not sent the SET
    // again (the round did not need it): a majority holds it.
    assert!(c.holders(&key, g.token()) >= 2);
    for i in 0..3 {
        let _: () = redis::cmd("SCRIPT")
            .arg("FLUSH")
            .query(&mut c.conn(i))
            .expect("SCRIPT FLUSH");
    }
    g.extend(TTL).expect("extend after SCRIPT FLUSH");
    for i in 0..3 {
        let _: () = redis::cmd("SCRIPT")
            .arg("FLUSH")
            .query(&mut c.conn(i))
            .expect("SCRIPT FLUSH");
    }
    g.release().expect("release after SCRIPT FLUSH");
    assert!(c.gone_everywhere(&key, Duration::from_secs(1)));
}

/// A release whose round settled before a slower node's reply came back NOSCRIPT (the
/// script cache was flushed) must still delete the key there, even if the client then
/// sits idle and nobody reuses that connection.
#[test]
fn a_late_noscript_release_is_resent_even_when_the_client_is_idle() {
    let c = Cluster::start(3);
    let slow = crate::common::faults::DelayProxy::start(&c.url(2), Duration::from_millis(30));
    let locks = Redlock::builder()
        .fresh_cluster(true)
        .nodes([c.url(0), c.url(1), slow.url()])
        .build()
        .expect("valid config");
    drop(locks.lock(&unique_key("warm"), TTL).unwrap());
    std::thread::sleep(Duration::from_millis(300));
    let key = unique_key("late-noscript");
    let g = locks.lock(&key, TTL).unwrap();
    assert!(
        crate::common::wait_until(Duration::from_secs(1), || c.get(2, &key).as_deref()
            == Some(g.token())),
        "the slow node never got the lock"
    );
    // Let the client read the slow node's late reply to that SET (its next
    // rounds do), so that only the release's own reply is owed below.
    std::thread::sleep(Duration::from_millis(100));
    for n in 0..3 {
        drop(locks.try_lock(&unique_key(&format!("drain{n}")), TTL));
        std::thread::sleep(Duration::from_millis(50));
    }
    for i in 0..3 {
        let _: () = redis::cmd("SCRIPT")
            .arg("FLUSH")
            .query(&mut c.conn(i))
            .expect("SCRIPT FLUSH");
    }
    g.release().expect("released on nodes 0 and 1");
    // The client is now idle: the slow node's NOSCRIPT must still lead to EVAL.
    assert!(
        c.gone_everywhere(&key, Duration::from_secs(2)),
        "left on the slow node: {:?}",
        c.get(2, &key)
    );
}

/// A brand-new client's first lock lands on the nodes connected by then; a
/// one-shot process waits for its connections first and gets every node.
#[test]
fn wait_connected_lets_a_new_clients_first_lock_reach_every_node() {
    let c = shared();
    for _ in 0..10 {
        let locks = client(&c.urls());
        assert_eq!(locks.wait_connected(Duration::from_secs(5)).ok(), Some(3));
        let key = unique_key("wait-connected");
        let g = locks.try_lock(&key, TTL).expect("lock");
        // Replies from every node: the round may settle on two, but the
        // third's SET was sent on its connection and lands.
        assert!(
            crate::common::wait_until(Duration::from_secs(2), || c.holders(&key, g.token()) == 3),
            "on {} of 3 nodes",
            c.holders(&key, g.token())
        );
        g.release().unwrap();
    }
}

#[test]
fn wait_connected_does_not_wait_for_a_dead_or_hung_node() {
    let c = Cluster::start(3);
    c.stop(1);
    c.pause(2);
    let start = Instant::now();
    let locks = crate::client_with(c.urls(), Duration::from_millis(50));
    // The stopped node refuses; the paused one's kernel still accepts TCP,
    // so it counts as connected (its commands will time out).
    assert_eq!(locks.wait_connected(Duration::from_secs(30)).ok(), Some(2));
    // Each failed connect is the node's answer: about one node timeout.
    assert!(
        start.elapsed() < Duration::from_secs(3),
        "{:?}",
        start.elapsed()
    );
    c.unpause(2);
}
