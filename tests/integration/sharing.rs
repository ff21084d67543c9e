//! Rounds of one client that overlap in time share one connection per node: a reply that
//! comes after its round ended is read and dropped on that connection, which stays in
//! use, and connections killed under many rounds at once leave no key behind.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use quorumlock::Redlock;

use crate::common::faults::WritePause;
use crate::common::{unique_key, wait_until, Cluster};

/// The ids of the connections to node `i` other than the one asking.
pub(crate) fn client_ids(c: &Cluster, i: usize) -> BTreeSet<u64> {
    let mut conn = c.conn(i);
    let me: u64 = redis::cmd("CLIENT")
        .arg("ID")
        .query(&mut conn)
        .expect("CLIENT ID");
    let list: String = redis::cmd("CLIENT")
        .arg("LIST")
        .arg("TYPE")
        .arg("normal")
        .query(&mut conn)
        .expect("CLIENT LIST");
    list.lines()
        .filter_map(|l| l.strip_prefix("id="))
        .filter_map(|l| l.split(' ').next()?.parse().ok())
        .filter(|&id| id != me)
        .collect()
}

fn three_nodes() -> (Cluster, Redlock) {
    let c = Cluster::start(3);
    let locks = Redlock::builder()
        .fresh_cluster(true)
        .nodes(c.urls())
        .build()
        .expect("valid config");
    assert_eq!(locks.wait_connected(Duration::from_secs(5)).ok(), Some(3));
    (c, locks)
}

/// A node holds a SET for 30 ms (less than the node timeout): the lock is granted by the
/// other two, and the late reply is read later on the same connection, which is not
/// closed; the release then deletes the key everywhere.
#[test]
fn a_reply_after_its_round_ended_is_read_and_its_connection_kept() {
    let (c, locks) = three_nodes();
    for n in 0..5 {
        let g = locks
            .try_lock(&unique_key(&format!("warm{n}")), Duration::from_secs(5))
            .expect("lock on healthy nodes");
        g.release().expect("release");
    }
    let before = client_ids(&c, 0);
    assert!(
        !before.is_empty(),
        "the client holds no connection to node 0"
    );
    let key = unique_key("late-reply");
    let guard = {
        let _paused = WritePause::start(&c, 0, Duration::from_millis(30));
        locks
            .try_lock(&key, Duration::from_secs(5))
            .expect("granted by the two other nodes")
    };
    // The held SET runs when the pause ends: its reply comes after the round ended.
    assert!(
        wait_until(Duration::from_secs(2), || c.get(0, &key).is_some()),
        "the held SET never ran on node 0"
    );
    // Rounds meanwhile and after: the late reply is read on the connection that carried it.
    for n in 0..5 {
        let g = locks
            .try_lock(&unique_key(&format!("after{n}")), Duration::from_secs(5))
            .expect("lock on healthy nodes");
        g.release().expect("release");
    }
    guard.release().expect("release");
    assert!(
        c.gone_everywhere(&key, Duration::from_secs(2)),
        "the key outlived its release"
    );
    let after = client_ids(&c, 0);
    let closed: Vec<_> = before.difference(&after).collect();
    assert!(
        closed.is_empty(),
        "connections {closed:?} to node 0 were closed (before {before:?}, after {after:?})"
    );
}

/// 16 threads lock and release while every connection to node 0 is killed every 5 ms: each
/// round on a killed connection gets the close as its answer (sent again, or failed), no
/// thread hangs, and no key is left on any node.
#[test]
fn connections_killed_under_many_rounds_leave_no_key() {
    let (c, locks) = three_nodes();
    let prefix = unique_key("kill-storm");
    let stop = AtomicBool::new(false);
    let run_for = Duration::from_millis(800);
    let started = Instant::now();
    let (keys, kills) = std::thread::scope(|s| {
        let killer = s.spawn(|| {
            let mut conn = c.conn(0);
            let mut kills = 0u64;
            while !stop.load(Ordering::Acquire) {
                let n: u64 = redis::cmd("CLIENT")
                    .arg("KILL")
                    .arg("TYPE")
                    .arg("normal")
                    .arg("SKIPME")
                    .arg("yes")
                    .query(&mut conn)
                    .unwrap_or(0);
                kills += n;
                std::thread::sleep(Duration::from_millis(5));
            }
            kills
        });
        let workers: Vec<_> = (0..16)
            .map(|t| {
                let (locks, prefix) = (locks.clone(), prefix.clone());
                s.spawn(move || {
                    let mut keys = Vec::new();
                    let mut n = 0;
                    while started.elapsed() < run_for {
                        let key = format!("{prefix}:{t}:{n}");
                        n += 1;
                        if let Ok(g) = locks.try_lock(&key, Duration::from_secs(10)) {
                            let _ = g.release();
                        }
                        keys.push(key);
                    }
                    keys
                })
            })
            .collect();
        let keys: Vec<String> = workers
            .into_iter()
            .flat_map(|w| w.join().expect("worker panicked"))
            .collect();
        stop.store(true, Ordering::Release);
        (keys, killer.join().expect("killer panicked"))
    });
    let elapsed = started.elapsed();
    assert!(
        elapsed < run_for + Duration::from_secs(5),
        "the workers took {elapsed:?}"
    );
    assert!(kills > 0, "no connection was killed");
    assert!(keys.len() >= 16, "only {} attempts", keys.len());
    // Deletes a node missed are sent again by the retry job within a few hundred ms.
    let left: Vec<&String> = keys
        .iter()
        .filter(|k| !c.gone_everywhere(k, Duration::from_secs(3)))
        .collect();
    assert!(
        left.is_empty(),
        "{} of {} keys left after {kills} kills: {:?}",
        left.len(),
        keys.len(),
        &left[..left.len().min(5)]
    );
}

/// `total_reads_processed` of node `i` (`INFO stats`): one per read the server made on a
/// client's socket.
fn reads_processed(c: &Cluster, i: usize) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("stats")
        .query(&mut c.conn(i))
        .expect("INFO stats");
    info.lines()
        .find_map(|l| l.strip_prefix("total_reads_processed:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("total_reads_processed in INFO stats")
}

/// 32 threads on one client lock and release distinct keys: the nodes read their commands
/// in few reads, many commands in each (one batch in flight per connection, everything
/// queued meanwhile in the next write). A cycle sends 2 commands to each of the 3 nodes;
/// with one command per read that is 6 reads a cycle, and sharing that carries about two
/// commands per read made about 3.8. The bound asserted is 2 (3 commands per read).
#[test]
fn thirty_two_threads_send_each_node_their_commands_in_few_reads() {
    let (c, locks) = three_nodes();
    let prefix = unique_key("few-reads");
    let threads = 32;
    let per_thread = 40;
    let run = |tag: &str, cycles: usize| -> usize {
        std::thread::scope(|s| {
            let workers: Vec<_> = (0..threads)
                .map(|t| {
                    let (locks, key) = (locks.clone(), format!("{prefix}:{tag}:{t}"));
                    s.spawn(move || {
                        let mut ok = 0;
                        for n in 0..cycles {
                            if let Ok(g) =
                                locks.try_lock(&format!("{key}:{n}"), Duration::from_secs(10))
                            {
                                ok += usize::from(g.release().is_ok());
                            }
                        }
                        ok
                    })
                })
                .collect();
            workers
                .into_iter()
                .map(|w| w.join().expect("worker panicked"))
                .sum()
        })
    };
    run("warm", 2);
    let before: Vec<u64> = (0..3).map(|i| reads_processed(&c, i)).collect();
    let cycles = run("run", per_thread);
    let after: Vec<u64> = (0..3).map(|i| reads_processed(&c, i)).collect();
    // Less the one read of each INFO asked here.
    let reads: u64 = before
        .iter()
        .zip(&after)
        .map(|(b, a)| a.saturating_sub(*b).saturating_sub(1))
        .sum();
    let per_cycle = reads as f64 / cycles.max(1) as f64;
    eprintln!(
        "{cycles} of {} cycles ok; {reads} server reads on 3 nodes: {per_cycle:.2} a cycle",
        threads * per_thread
    );
    // Most cycles succeed (a loaded machine may fail a few rounds at the 50 ms node
    // timeout; their commands count among the reads, which only makes the bound harder).
    assert!(
        cycles >= threads * per_thread / 2,
        "only {cycles} of {} cycles succeeded",
        threads * per_thread
    );
    assert!(
        per_cycle <= 2.0,
        "{per_cycle:.2} server reads a cycle (6 commands): commands are not batched"
    );
}
