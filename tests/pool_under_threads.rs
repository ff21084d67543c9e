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

/// What 32 threads did in a run.
struct Run {
    cycles: usize,
    failed: usize,
    kinds: BTreeMap<String, usize>,
    elapsed: Duration,
    /// Per node, the most connections of this client seen at once.
    most_connections: Vec<usize>,
}

/// Connections to node `i` of `c` other than the one asking (every one of them is the
/// client's under test: the cluster is this binary's own).
fn connections(c: &Cluster, i: usize) -> usize {
    let mut conn = c.conn(i);
    let list: String = redis::cmd("CLIENT")
        .arg("LIST")
        .arg("TYPE")
        .arg("normal")
        .query(&mut conn)
        .unwrap_or_default();
    list.lines().count().saturating_sub(1)
}

/// 32 threads lock and release distinct keys on `urls` for 1.5 s, with default settings;
/// the connections of the client to the nodes of `c` are counted meanwhile.
fn thirty_two_threads(c: &Cluster, urls: Vec<String>) -> Run {
    // Default settings (pool size, 50 ms node timeout); only the throwaway cluster's lock
    // history is trusted at once.
    let locks = Redlock::builder()
        .fresh_cluster(true)
        .nodes(urls)
        .build()
        .expect("valid config");
    let prefix = unique_key("threads32");
    let ttl = Duration::from_secs(5);
    let run_for = Duration::from_millis(1500);
    let started = Instant::now();
    let (per_thread, most_connections) = std::thread::scope(|s| {
        let counter = s.spawn(|| {
            let mut most = vec![0; c.len()];
            while started.elapsed() < run_for {
                std::thread::sleep(Duration::from_millis(100));
                for (i, m) in most.iter_mut().enumerate() {
                    *m = (*m).max(connections(c, i));
                }
            }
            most
        });
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
        let per_thread: Vec<(usize, Vec<String>)> = handles
            .into_iter()
            .map(|h| h.join().expect("worker panicked"))
            .collect();
        (per_thread, counter.join().expect("counter panicked"))
    });
    let elapsed = started.elapsed();
    let cycles: usize = per_thread.iter().map(|(n, _)| n).sum();
    let mut kinds: BTreeMap<String, usize> = BTreeMap::new();
    for f in per_thread.iter().flat_map(|(_, f)| f) {
        *kinds.entry(f.clone()).or_default() += 1;
    }
    let failed: usize = kinds.values().sum();
    eprintln!(
        "32 threads x {elapsed:?}: {cycles} cycles ({:.0}/s), {failed} failures, at most {most_connections:?} connections per node",
        cycles as f64 / elapsed.as_secs_f64()
    );
    Run {
        cycles,
        failed,
        kinds,
        elapsed,
        most_connections,
    }
}

/// This measures the client under 32 threads, so it runs on local redis-server processes
/// when there are any: on the Docker backend every request also crosses a userland proxy
/// process, and on 2 cores that proxy, not the client, decides whether 50 ms rounds make
/// it (nodes then really time out, and are rightly skipped).
fn prefer_processes() {
    let on_path = std::process::Command::new("redis-server")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if on_path && std::env::var("QUORUMLOCK_TEST_BACKEND").as_deref() != Ok("process") {
        eprintln!("pool_under_threads: using the process backend (redis-server found)");
        std::env::set_var("QUORUMLOCK_TEST_BACKEND", "process");
    }
}

/// The tests of this file, one at a time: each loads the machine with 32 threads.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Waiting for a pooled connection was charged to the node (its breaker opened, other
/// rounds gave healthy nodes up) and the pool held 8 connections: about 80 % of the
/// attempts of 32 threads failed with `NoQuorum` on healthy nodes. Each thread's rounds
/// also held a connection per node of their own (32 per node); rounds that overlap in time
/// now share one.
#[test]
fn thirty_two_threads_on_one_client_never_fail_on_healthy_nodes() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    prefer_processes();
    let c = Cluster::start(5);
    let run = thirty_two_threads(&c, c.urls());
    let Run {
        cycles,
        failed,
        ref kinds,
        elapsed,
        ref most_connections,
    } = run;
    // The defect's signature: attempts failed by pool waits alone, reported as the node's
    // failure (Unavailable) or as every pooled connection busy, on a machine that answered
    // (no timeout in that round). None at all. A round in which the machine stalled past
    // 50 ms on most nodes (timeouts) may also miss a connection: that is the stall's. So is
    // a connection still being made when a round ended.
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
    // after one, as it should be) are the machine's. The benchmark reports 0 failures on
    // the same machine (fewer servers, no debug build).
    assert!(
        failed * 20 <= cycles,
        "{failed} of {cycles} cycles failed on healthy nodes (more than 5 %): {kinds:?}"
    );
    assert!(cycles >= 32, "only {cycles} cycles in {elapsed:?}");
    // One shared connection per node carries the rounds; the pool keeps a couple idle, and
    // a connection given up (a stall past the node timeout) is replaced: 3 to 9 seen on a
    // quiet machine; on a loaded one a node whose replies stalled repeatedly had its
    // connection replaced up to the pool's size (once [26, 5, 32, 15, 5] during the whole
    // suite). Most nodes keep few, where one connection per thread (an earlier release)
    // held 32 on every node, which this still catches.
    let mut sorted = most_connections.clone();
    sorted.sort_unstable();
    let median = sorted[sorted.len() / 2];
    assert!(
        median <= 24,
        "32 threads held {most_connections:?} connections per node"
    );
}

/// A node that accepts connections and never answers, in the list from the client's start:
/// its rounds are never waited for past what the other four settle, under 32 threads.
#[test]
fn a_node_silent_from_the_start_costs_thirty_two_threads_nothing() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    prefer_processes();
    let c = Cluster::start(4);
    let hole = common::faults::Blackhole::start();
    let mut urls = c.urls();
    urls.insert(2, hole.url());
    let run = thirty_two_threads(&c, urls);
    assert!(
        run.failed * 20 <= run.cycles,
        "{} of {} cycles failed with one silent node (more than 5 %): {:?}",
        run.failed,
        run.cycles,
        run.kinds
    );
    assert!(
        run.cycles >= 32,
        "only {} cycles in {:?}",
        run.cycles,
        run.elapsed
    );
}
