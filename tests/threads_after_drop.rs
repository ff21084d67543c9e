//! Every thread a client starts ends soon after the client is dropped (connector threads
//! used to outlive the client by up to 30 s). In a binary of its own so that no other
//! test's client adds `quorumlock-*` / `qlock-*` threads while it counts.

use std::time::{Duration, Instant};

use quorumlock::Redlock;

mod common;

use common::faults::threads_named;
use common::{unique_key, Cluster};

/// The client's threads: one `quorumlock-n{i}` per node, the `qlock-watchdog` and, once it
/// waited for a key, the `qlock-notify`.
fn client_threads() -> (usize, usize) {
    (threads_named("quorumlock-"), threads_named("qlock-"))
}

/// Waits up to 2 s for the thread counts to be back to `before`.
fn assert_threads_end(before: (usize, usize), what: &str) {
    let t = Instant::now();
    while client_threads() != before {
        assert!(
            t.elapsed() < Duration::from_secs(2),
            "{what}: 2 s after the drop, threads (quorumlock-*, qlock-*) = {:?}, before = \
             {before:?}",
            client_threads()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    eprintln!("{what}: threads ended {:?} after the drop", t.elapsed());
}

#[test]
fn every_client_thread_ends_soon_after_the_client_is_dropped() {
    assert!(
        std::path::Path::new("/proc/self/task").is_dir(),
        "needs /proc/self/task (Linux) to count threads"
    );
    let c = Cluster::start(3);
    let before = client_threads();
    let ttl = Duration::from_millis(600);
    let build = || {
        Redlock::builder()
            .fresh_cluster(true)
            .nodes(c.urls())
            .auto_renew(true)
            .build()
            .expect("valid config")
    };

    // Healthy nodes: locks renewed by the watchdog, then released.
    let locks = build();
    let prefix = unique_key("threads");
    let guards: Vec<_> = (0..10)
        .map(|i| locks.lock(&format!("{prefix}:{i}"), ttl).expect("lock"))
        .collect();
    std::thread::sleep(ttl + ttl / 2);
    assert!(guards.iter().all(|g| g.is_held()), "renewed past the TTL");
    let during = client_threads();
    assert_eq!(during.1, before.1 + 1, "one watchdog thread");
    assert!(
        during.0 > before.0,
        "node threads while in use: {during:?}, before {before:?}"
    );
    drop(guards);
    drop(locks);
    assert_threads_end(before, "healthy nodes");

    // A client that waited for a key another holds: its wake-up thread (`qlock-notify`,
    // one subscriber connection per node) ends with it too.
    let holder = build();
    let locks = build();
    let key = unique_key("threads-waited");
    let held = holder.lock(&key, ttl).expect("lock");
    let before_wait = client_threads();
    assert!(locks
        .request(&key, ttl)
        .acquire_for(Duration::from_millis(300))
        .is_err());
    assert!(
        client_threads().1 > before_wait.1,
        "the waiter's wake-up thread runs"
    );
    drop(held);
    drop(holder);
    drop(locks);
    assert_threads_end(before, "a client that waited");

    // A dead node: the releases meant for it wait in its retry queue (sent again every
    // 100 ms until the keys' TTL has passed) when the client is dropped.
    let locks = build();
    let prefix = unique_key("threads-dead");
    let guards: Vec<_> = (0..10)
        .map(|i| {
            locks
                .lock(&format!("{prefix}:{i}"), ttl * 10)
                .expect("lock")
        })
        .collect();
    c.stop(2);
    // Whether each release reaches a majority depends on where its lock landed (a round
    // settles without a node whose connection is still opening): not the subject here.
    drop(guards);
    std::thread::sleep(Duration::from_millis(250)); // a retry or two
    drop(locks);
    assert_threads_end(before, "one node dead, releases queued");
    c.restart(2);

    // A hung node: its replies are owed when the client is dropped.
    let locks = build();
    drop(locks.lock(&unique_key("warm"), ttl).expect("warm-up"));
    c.pause(2);
    let prefix = unique_key("threads-hung");
    let guards: Vec<_> = (0..10)
        .map(|i| locks.lock(&format!("{prefix}:{i}"), ttl).expect("lock"))
        .collect();
    std::thread::sleep(Duration::from_millis(100));
    drop(guards);
    drop(locks);
    assert_threads_end(before, "one node hung");
    c.unpause(2);
}
