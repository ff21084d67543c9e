//! Messages anyone can send (issue 38, items 2 and 3): a release's message is a hint,
//! never a grant, and never costs a waiter its attempts. Releases of the same name in
//! another database (pub/sub ignores `SELECT`) and a storm of forged messages, each with
//! a fresh notice, cost a waiter at most three extra rounds per retry pause. Clients use
//! `fresh_cluster(true)` on the shared throwaway nodes.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use quorumlock::{AttemptEvent, EventHandler, Redlock};

use crate::common::{shared, unique_key, Cluster};

/// Counts a client's attempts.
#[derive(Default)]
pub(crate) struct Rounds(pub(crate) AtomicUsize);

impl EventHandler for Rounds {
    fn on_attempt(&self, _: &AttemptEvent<'_>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

/// A client on `urls`, its attempts counted: `retry_count` 3, pauses of `pause` (no
/// jitter).
pub(crate) fn counted(urls: Vec<String>, pause: Duration) -> (Redlock, Arc<Rounds>) {
    let rounds = Arc::new(Rounds::default());
    let locks = Redlock::builder()
        .fresh_cluster(true)
        .nodes(urls)
        .node_timeout(Duration::from_millis(250))
        .retry_count(3)
        .retry_delay(pause)
        .retry_jitter(Duration::ZERO)
        .events(rounds.clone())
        .build()
        .expect("valid config");
    assert_eq!(locks.wait_connected(Duration::from_secs(5)).ok(), Some(3));
    (locks, rounds)
}

/// Forged release messages for `key`, a fresh notice each, as fast as one connection
/// per node publishes, for `storm`: how many were sent, and for how long.
pub(crate) fn forge(c: &Cluster, key: &str, storm: Duration) -> (u64, Duration) {
    let started = Instant::now();
    let publishers: Vec<_> = (0..c.len())
        .map(|i| {
            let mut conn = c.conn(i);
            let channel = format!("quorumlock:free:{key}");
            std::thread::spawn(move || {
                let mut sent = 0u64;
                while started.elapsed() < storm {
                    let _: i64 = redis::cmd("PUBLISH")
                        .arg(&channel)
                        .arg(format!("forged-{i}-{sent}"))
                        .query(&mut conn)
                        .expect("PUBLISH");
                    sent += 1;
                }
                sent
            })
        })
        .collect();
    let sent = publishers
        .into_iter()
        .map(|p| p.join().expect("publisher"))
        .sum();
    (sent, started.elapsed())
}

/// The node URLs with database `db` instead of 0.
fn in_db(c: &Cluster, db: u32) -> Vec<String> {
    c.urls()
        .into_iter()
        .map(|u| format!("{}/{db}", u.trim_end_matches('/')))
        .collect()
}

/// A holder in database 0 keeps `key` for 300 ms and dies (no release); a `lock()`
/// waiter with 3 attempts 200 ms apart gets it at the holder's expiry, although a client
/// in database 1 locks and releases the same name all along, and each release wakes the
/// waiter. Its woken tries used up its attempts: it gave up with `Taken` after 57 ms.
#[test]
fn releases_in_another_database_do_not_use_up_lock_attempts() {
    let c = shared();
    let key = unique_key("storm-db");
    let holder = crate::client_with(c.urls(), Duration::from_millis(250));
    let held_at = Instant::now();
    let g = holder
        .try_lock(&key, Duration::from_millis(300))
        .expect("the holder");
    std::mem::forget(g);
    let other = crate::client_with(in_db(&c, 1), Duration::from_millis(250));
    let stop = Arc::new(AtomicBool::new(false));
    let cycles = std::thread::spawn({
        let (stop, key) = (stop.clone(), key.clone());
        move || {
            let mut n = 0;
            while !stop.load(Ordering::SeqCst) {
                if let Ok(g) = other.try_lock(&key, Duration::from_secs(5)) {
                    let _ = g.release();
                    n += 1;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            n
        }
    });
    let (waiting, rounds) = counted(c.urls(), Duration::from_millis(200));
    let started = Instant::now();
    let got = waiting.lock(&key, Duration::from_secs(5));
    let waited = started.elapsed();
    stop.store(true, Ordering::SeqCst);
    let n = cycles.join().expect("cycles");
    assert!(n > 5, "the other database's cycles ran ({n})");
    let g = got.unwrap_or_else(|e| {
        panic!(
            "lock() gave up after {waited:?} and {} rounds, {n} releases in db 1: {e}",
            rounds.0.load(Ordering::SeqCst)
        )
    });
    assert!(
        held_at.elapsed() >= Duration::from_millis(300),
        "got it {:?} after the holder, before its expiry",
        held_at.elapsed()
    );
    g.release().expect("release");
}

/// While a holder keeps `key`, a storm of forged messages (a fresh notice each, as fast
/// as one connection publishes, on every node) for 1.2 s drives a `acquire_for` waiter
/// to at most three extra rounds per retry pause (100 ms here), where it ran 715–1,729
/// rounds; a `lock()` waiter (3 attempts 1.5 s apart) keeps its attempts through the
/// storm; both get the lock when the holder releases after it.
#[test]
fn a_forged_message_storm_costs_at_most_a_round_per_retry_pause() {
    let c = shared();
    let key = unique_key("storm-forged");
    let holder = crate::client_with(c.urls(), Duration::from_millis(250));
    let g = holder
        .try_lock(&key, Duration::from_secs(30))
        .expect("the holder");
    let (timed, timed_rounds) = counted(c.urls(), Duration::from_millis(100));
    let (counted_lock, lock_rounds) = counted(c.urls(), Duration::from_millis(1_500));
    let timed = std::thread::spawn({
        let key = key.clone();
        move || {
            timed
                .request(&key, Duration::from_secs(5))
                .acquire_for(Duration::from_secs(10))
                .map(|g| g.release())
        }
    });
    let counted_lock = std::thread::spawn({
        let key = key.clone();
        move || {
            counted_lock
                .lock(&key, Duration::from_secs(5))
                .map(|g| g.release())
        }
    });
    // Their first attempts fail and they subscribe.
    std::thread::sleep(Duration::from_millis(300));
    let (t0, l0) = (
        timed_rounds.0.load(Ordering::SeqCst),
        lock_rounds.0.load(Ordering::SeqCst),
    );
    let (sent, during) = forge(&c, &key, Duration::from_millis(1_200));
    let (t1, l1) = (
        timed_rounds.0.load(Ordering::SeqCst),
        lock_rounds.0.load(Ordering::SeqCst),
    );
    assert!(sent > 100, "the storm sent {sent} messages");
    // One round by the clock per fallback pause (the retry pause, at most 1 s), three
    // woken at most between: four per pause, and two for the pause under way at
    // either end.
    let bound = |pause: Duration| {
        let pause = pause.min(Duration::from_secs(1)).as_millis();
        4 * (during.as_millis() / pause) as usize + 6
    };
    assert!(
        t1 - t0 <= bound(Duration::from_millis(100)),
        "acquire_for ran {} rounds in a {during:?} storm of {sent} messages",
        t1 - t0
    );
    assert!(
        l1 - l0 <= bound(Duration::from_millis(1_500)),
        "lock() ran {} rounds in a {during:?} storm of {sent} messages",
        l1 - l0
    );
    assert!(!counted_lock.is_finished(), "lock() gave up in the storm");
    g.release().expect("release");
    let a = timed.join().expect("timed");
    let b = counted_lock.join().expect("lock()");
    assert!(
        matches!(a, Ok(Ok(()))),
        "acquire_for after the storm: {a:?}"
    );
    assert!(matches!(b, Ok(Ok(()))), "lock() after the storm: {b:?}");
}
