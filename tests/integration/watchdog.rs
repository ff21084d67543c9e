//! Automatic renewal against real Redis nodes.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use quorumlock::{Error, Redlock};

use crate::common::{shared, unique_key, wait_until, Cluster};

const TTL: Duration = Duration::from_millis(600);

fn client(urls: Vec<String>, renew: bool) -> Redlock {
    Redlock::builder()
        .fresh_cluster(true)
        .nodes(urls)
        .node_timeout(Duration::from_millis(150))
        .auto_renew(renew)
        .build()
        .expect("valid config")
}

#[test]
fn renewal_keeps_a_lock_through_a_section_three_times_its_ttl() {
    let c = shared();
    let key = unique_key("renewed");
    let (holder, rival) = (client(c.urls(), true), client(c.urls(), false));
    let g = holder.lock(&key, TTL).unwrap();
    assert!(g.is_auto_renewed());
    let started = Instant::now();
    while started.elapsed() < TTL * 3 {
        // Taken, or NoQuorum when a node is slow: never acquired.
        assert!(
            rival.try_lock(&key, TTL).is_err(),
            "rival got the lock after {:?}",
            started.elapsed()
        );
        assert!(g.is_held(), "lost after {:?}", started.elapsed());
        std::thread::sleep(TTL / 6);
    }
    g.release().unwrap();
    let t = Instant::now();
    let r = rival
        .request(&key, TTL)
        .acquire_for(Duration::from_secs(2))
        .expect("rival acquires after release");
    assert!(t.elapsed() < TTL / 2, "took {:?}", t.elapsed());
    drop(r);
}

#[test]
fn without_renewal_the_lock_expires_after_its_ttl() {
    let c = shared();
    let key = unique_key("not-renewed");
    let (holder, rival) = (client(c.urls(), false), client(c.urls(), false));
    let g = holder.lock(&key, TTL).unwrap();
    assert!(!g.is_auto_renewed());
    assert!(rival.try_lock(&key, TTL).is_err());
    std::thread::sleep(TTL + TTL / 4);
    assert!(!g.is_held());
    let taken = rival.try_lock(&key, TTL).expect("expired lock is free");
    drop(taken);
}

#[test]
fn losing_the_majority_fires_the_loss_channel_within_about_a_ttl() {
    let c = Cluster::start(3);
    struct CountLost(AtomicUsize);
    impl quorumlock::EventHandler for CountLost {
        fn on_lost(&self, _: &quorumlock::LostEvent<'_>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
    let lost_calls = Arc::new(CountLost(AtomicUsize::new(0)));
    let locks = Redlock::builder()
        .fresh_cluster(true)
        .nodes(c.urls())
        .auto_renew(true)
        .events(lost_calls.clone())
        .build()
        .unwrap();
    let g = locks.lock(&unique_key("majority-lost"), TTL).unwrap();
    let lost = g.lost();
    c.stop(1);
    c.stop(2);
    let t = Instant::now();
    let why = lost
        .wait_timeout(TTL * 3)
        .expect("loss reported within three TTLs");
    assert!(
        t.elapsed() < TTL + TTL / 2,
        "reported after {:?}",
        t.elapsed()
    );
    assert!(matches!(why, Error::Expired), "{why:?}");
    assert!(g.is_lost() && !g.is_held());
    // The event comes just after the signal.
    assert!(wait_until(Duration::from_secs(1), || lost_calls
        .0
        .load(Ordering::SeqCst)
        == 1));
    // Dropping a lost guard with most nodes down returns promptly.
    let t = Instant::now();
    drop(g);
    assert!(
        t.elapsed() < Duration::from_millis(500),
        "{:?}",
        t.elapsed()
    );
}

#[test]
fn a_key_deleted_behind_the_holders_back_is_lost_at_the_next_renewal() {
    let c = shared();
    let key = unique_key("deleted");
    let locks = client(c.urls(), true);
    let g = locks.lock(&key, TTL).unwrap();
    // A new client's first lock may reach a node still connecting only after
    // its round (the SET is sent once a connection is free): let every copy
    // land before deleting two of them.
    assert!(
        wait_until(Duration::from_secs(2), || c.holders(&key, g.token()) == 3),
        "the lock never reached every node"
    );
    c.del(0, &key);
    c.del(1, &key);
    let why = g
        .lost()
        .wait_timeout(TTL)
        .expect("loss detected at the next renewal");
    assert!(matches!(why, Error::Expired), "{why:?}");
    assert!(!g.is_held());
    assert!(matches!(g.release(), Err(Error::Expired)));
    // The watchdog cleaned up the key that was still ours.
    assert_eq!(c.get(2, &key), None);
}

/// After a release (or drop) the key must be gone from every node once its
/// TTL has passed, and stay gone: nothing renews it. (A node the breaker
/// skipped during the release keeps its copy until the TTL; that copy must
/// not be renewed either.)
fn assert_never_renewed_again(c: &crate::common::Cluster, key: &str) {
    let released = Instant::now();
    assert!(
        (0..c.len()).filter(|&i| c.get(i, key).is_none()).count() >= 2,
        "still on a majority right after the release"
    );
    std::thread::sleep(TTL + TTL / 6);
    while released.elapsed() < TTL * 3 {
        assert!(
            (0..c.len()).all(|i| c.get(i, key).is_none()),
            "renewed after release ({:?} later)",
            released.elapsed()
        );
        std::thread::sleep(TTL / 3);
    }
}

#[test]
fn release_stops_renewal_for_good() {
    let c = shared();
    let key = unique_key("released-renewed");
    let locks = client(c.urls(), true);
    let g = locks.lock(&key, TTL).unwrap();
    std::thread::sleep(TTL / 2); // at least one renewal
    let lost = g.lost();
    let released = g.release();
    assert!(
        matches!(released, Ok(()) | Err(Error::NoQuorum { .. })),
        "{released:?}"
    );
    assert!(
        lost.wait().is_none(),
        "released: the loss signal ends without a reason"
    );
    assert_never_renewed_again(&c, &key);
}

#[test]
fn dropped_renewed_guard_is_released_and_not_renewed() {
    let c = shared();
    let key = unique_key("dropped-renewed");
    let locks = client(c.urls(), true);
    drop(locks.lock(&key, TTL).unwrap());
    assert_never_renewed_again(&c, &key);
    assert!(locks.try_lock(&key, TTL).is_ok());
}

#[test]
fn with_lock_renews_during_the_closure_and_releases_after() {
    let c = shared();
    let key = unique_key("with-lock");
    let locks = client(c.urls(), false);
    let rival = client(c.urls(), false);
    let out = locks
        .lock(&key, TTL)
        .and_then(|g| {
            g.run(|g| {
                assert!(g.is_auto_renewed());
                std::thread::sleep(TTL * 2);
                assert!(rival.try_lock(&key, TTL).is_err());
                g.is_held()
            })
        })
        .unwrap();
    assert!(out, "held through the whole closure");
    assert!(c.gone_everywhere(&key, Duration::from_secs(1)));

    // A panicking closure still releases.
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _ = locks
            .lock(&key, TTL)
            .and_then(|g| g.run(|_| panic!("boom")));
    }));
    assert!(panicked.is_err());
    assert!(c.gone_everywhere(&key, Duration::from_secs(1)));
}

#[test]
fn with_lock_reports_a_loss_during_the_closure() {
    let c = shared();
    let key = unique_key("with-lock-lost");
    let locks = client(c.urls(), false);
    let r = locks.lock(&key, TTL).and_then(|g| {
        g.run(|g| {
            // Every copy first (a new client's SET may reach a node after its
            // round), then two of them deleted.
            wait_until(Duration::from_secs(2), || c.holders(&key, g.token()) == 3);
            c.del(0, &key);
            c.del(1, &key);
            let _ = g.lost().wait_timeout(TTL * 2);
            42
        })
    });
    assert!(matches!(r, Err(Error::Expired)), "{r:?}");
}

#[test]
fn renewal_survives_a_node_restart() {
    let c = Cluster::start(3);
    let key = unique_key("restart");
    let locks = client(c.urls(), true);
    // Connections open first: a round does not wait for a node still
    // connecting, so a client's very first lock may land on just a majority,
    // and this test is about a lock held on every node.
    drop(locks.lock(&unique_key("warm"), TTL).unwrap());
    std::thread::sleep(Duration::from_millis(200));
    let g = locks.lock(&key, TTL).unwrap();
    assert!(
        wait_until(Duration::from_secs(1), || c.holders(&key, g.token()) == 3),
        "not on every node"
    );
    c.stop(2);
    c.restart(2);
    let started = Instant::now();
    while started.elapsed() < TTL * 3 {
        assert!(g.is_held(), "lost after {:?}", started.elapsed());
        std::thread::sleep(TTL / 6);
    }
    assert_eq!(c.get(0, &key).as_deref(), Some(g.token()));
    g.release().unwrap();
}

/// Locks renewed together in one round, on nodes a few milliseconds away: the round waits
/// for their replies. (A round of several keys counted its keys among the replies, so
/// before any reply it was "settled"; such rounds ended at once, failed every time on
/// nodes 5 ms away, and every lock of the batch expired.)
#[test]
fn locks_renewed_together_survive_nodes_a_few_milliseconds_away() {
    let c = shared();
    let proxies: Vec<_> = (0..3)
        .map(|i| crate::common::faults::DelayProxy::start(&c.url(i), Duration::from_millis(5)))
        .collect();
    let locks = Redlock::builder()
        .fresh_cluster(true)
        .nodes(proxies.iter().map(|p| p.url()))
        .node_timeout(Duration::from_millis(250))
        .auto_renew(true)
        .build()
        .expect("valid config");
    let ttl = Duration::from_millis(1200);
    let key = unique_key("batch-far");
    // Taken back to back: due together, renewed in one round.
    let guards: Vec<_> = (0..4)
        .map(|i| locks.lock(&format!("{key}:{i}"), ttl).expect("lock"))
        .collect();
    std::thread::sleep(ttl * 3);
    for (i, g) in guards.iter().enumerate() {
        assert!(g.is_held(), "lock {i} lost: {:?}", g.lost().check());
    }
    drop(guards);
}
