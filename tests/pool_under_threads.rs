//! 32 threads on one client with the default pool, on healthy nodes: no attempt fails
//! (issue 7). In a binary of its own: its 32 busy threads would load a 2-core machine for
//! the other tests, and another test's load would stall its 50 ms rounds.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use quorumlock::Redlock;

mod common;

use common::{summary, unique_key, Cluster};

/// Waiting for a pooled connection was charged to the node (its breaker opened, other
/// rounds gave healthy nodes up) and the pool held 8 connections: about 80 % of the
/// attempts of 32 threads failed with `NoQuorum` on healthy nodes.
#[test]
fn thirty_two_threads_on_one_client_never_fail_on_healthy_nodes() {
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
                                    failures.push(format!("release: {}", summary(&e)));
                                }
                            }
                            Err(e) => failures.push(format!("try_lock: {}", summary(&e))),
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
    assert_eq!(
        failed, 0,
        "{failed} of {cycles} cycles failed on healthy nodes: {kinds:?}"
    );
    assert!(cycles >= 32, "only {cycles} cycles in {elapsed:?}");
}
