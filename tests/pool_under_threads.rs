//! 32 threads on one client with the default pool, on healthy nodes: no attempt fails
//! for a cause of the client's own (every pooled connection busy, or a pool wait charged
//! to the node). In a binary of its own: its 32 busy threads would load a 2-core machine
//! for the other tests, and another test's load would stall its 50 ms rounds.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use quorumlock::Redlock;

mod common;

use common::{summary, unique_key, Cluster};

/// [`summary`], with each `NoConnection` told apart by its cause: every pooled connection
/// busy (the client's own condition, the defect this file guards) or a connection still
/// being made when the round ended (after a stall broke connections by timeouts, or while
/// the pools fill at start, the machine did not make one in the whole round).
fn classified(e: &quorumlock::Error) -> String {
    match e {
        quorumlock::Error::NoQuorum {
            agreed, failures, ..
        } => {
            let kinds: Vec<String> = failures
                .iter()
                .map(|f| match f.kind() {
                    quorumlock::NodeErrorKind::NoConnection if f.detail().contains("busy") => {
                        "NoConnection(busy)".to_owned()
                    }
                    quorumlock::NodeErrorKind::NoConnection => {
                        "NoConnection(connecting)".to_owned()
                    }
                    k => format!("{k:?}"),
                })
                .collect();
            format!("NoQuorum(agreed {agreed}: {})", kinds.join("+"))
        }
        e => summary(e),
    }
}

/// Waiting for a pooled connection was charged to the node (its breaker opened, other
/// rounds gave healthy nodes up) and the pool held 8 connections: about 80 % of the
/// attempts of 32 threads failed with `NoQuorum` on healthy nodes.
#[test]
fn thirty_two_threads_on_one_client_never_fail_on_healthy_nodes() {
    // This measures the client under 32 threads, so it runs on local redis-server
    // processes when there are any: on the Docker backend every request also crosses a
    // userland proxy process, and on 2 cores that proxy, not the client, decides whether
    // 50 ms rounds make it (nodes then really time out, and are rightly skipped).
    let on_path = std::process::Command::new("redis-server")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if on_path && std::env::var("QUORUMLOCK_TEST_BACKEND").as_deref() != Ok("process") {
        eprintln!("pool_under_threads: using the process backend (redis-server found)");
        std::env::set_var("QUORUMLOCK_TEST_BACKEND", "process");
    }
    let c = Cluster::start(5);
    // Default settings (pool size, 50 ms node timeout); only the throwaway cluster's lock
    // history is trusted at once.
    let locks = Redlock::builder()
        .fresh_cluster(true)
        .nodes(c.urls())
        .build()
        .expect("valid config");
    let prefix = unique_key("threads32");
    let ttl = Duration::from_secs(5);
    let run_for = Duration::from_millis(1500);
    let started = Instant::now();
    let per_thread: Vec<(usize, Vec<String>)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..32)
            .map(|t| {
                let (locks, prefix) = (locks.clone(), prefix.clone());
                s.spawn(move || {
                    let (mut cycles, mut failures) = (0usize, Vec::new());
                    while started.elapsed() < run_for {
                        let key = format!("{prefix}:{t}:{cycles}");
                        cycles += 1;
                        match locks.try_lock(&key, ttl) {
                            Ok(g) => {
                                if let Err(e) = g.release() {
                                    failures.push(format!("release: {}", classified(&e)));
                                }
                            }
                            Err(e) => failures.push(format!("try_lock: {}", classified(&e))),
                        }
                    }
                    (cycles, failures)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("worker panicked"))
            .collect()
    });
    let elapsed = started.elapsed();
    let cycles: usize = per_thread.iter().map(|(n, _)| n).sum();
    let mut kinds: BTreeMap<&str, usize> = BTreeMap::new();
    for f in per_thread.iter().flat_map(|(_, f)| f) {
        *kinds.entry(f.as_str()).or_default() += 1;
    }
    let failed: usize = kinds.values().sum();
    eprintln!(
        "32 threads x {elapsed:?}: {cycles} cycles ({:.0}/s), {failed} failures",
        cycles as f64 / elapsed.as_secs_f64()
    );
    // The defect's signature: attempts failed by pool waits alone, reported as the node's
    // failure (Unavailable) or as every pooled connection busy, on a machine that answered
    // (no timeout in that round). None at all. A round in which the machine stalled past
    // 50 ms on most nodes (timeouts) may also miss a connection: that is the stall's. So is
    // a connection still being made when a round ended: with a pool as large as the
    // threads, one is missing only after a timeout closed it or before the pool filled, and
    // making it took the machine the whole round (one CI run: 1 of 1,221 cycles, all five
    // nodes still connecting, beside 18 timed-out rounds).
    let misattributed: usize = kinds
        .iter()
        .filter(|(k, _)| {
            !k.contains("Timeout")
                && ["Unavailable", "NoConnection(busy)"]
                    .iter()
                    .any(|m| k.contains(m))
        })
        .map(|(_, n)| n)
        .sum();
    assert_eq!(
        misattributed, 0,
        "{failed} of {cycles} cycles failed on healthy nodes: {kinds:?}"
    );
    // 32 busy threads on a 2-core machine (five servers beside them) can leave a thread or
    // a server unscheduled past a 50 ms round: such timeouts (and the node being skipped
    // after one, as it should be) are the machine's. Up to 1.8 % of cycles were seen on an
    // idle CI-sized machine, with and without the change under test; the benchmark reports
    // 0 failures on the same machine (fewer servers, no debug build).
    assert!(
        failed * 20 <= cycles,
        "{failed} of {cycles} cycles failed on healthy nodes (more than 5 %): {kinds:?}"
    );
    assert!(cycles >= 32, "only {cycles} cycles in {elapsed:?}");
}
