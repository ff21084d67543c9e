//! Regression tests of the node layer against real Redis nodes, one per failure it once
//! had: a write-paused node, a node hung from client start, the unlock after a timed-out
//! attempt, a huge resource name, a restarted node met by a fresh client in another
//! process, and recovery after a majority outage. Two more are binaries of their own, so
//! that no other test runs beside them: 32 threads on one client
//! (`tests/pool_under_threads.rs`: it loads the CPU, and is timing-sensitive itself) and
//! the thread count after drop (`tests/threads_after_drop.rs`: it counts threads).
//!
//! Also a node slower than the others but inside the node timeout (a delaying proxy): it
//! must get the scripts, keep the locks it took, and be heard before restarted nodes vote.
//!
//! Bounds are generous (a loaded 2-core CI machine): each is a fraction of the node timeout
//! the old code waited in full, or a figure many times what the new code needs.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use quorumlock::{Error, InvalidInput, Redlock, MAX_RESOURCE_LEN};

use crate::common::faults::{Blackhole, DelayProxy, WritePause};
use crate::common::{summary, unique_key, wait_until, Cluster};

/// Node timeout where timeouts are not the subject (loaded CI machines).
const SLACK: Duration = Duration::from_millis(250);

/// Wall-clock milliseconds since the Unix epoch: comparable between processes.
fn unix_ms() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis())
}

/// What each node holds under `key` (for failure messages).
fn on_nodes(c: &Cluster, key: &str) -> Vec<Option<String>> {
    (0..c.len()).map(|i| c.get(i, key)).collect()
}

/// [`on_nodes`] without asking node `down`.
fn on_nodes_but(c: &Cluster, key: &str, down: usize) -> Vec<Option<String>> {
    (0..c.len())
        .map(|i| if i == down { None } else { c.get(i, key) })
        .collect()
}

// ---------------------------------------------------------------------------------------
// A node that answers reads but not writes

/// `CLIENT PAUSE … WRITE`: the node accepts connections and answers `INFO`, which closed
/// the breaker its write timeout had just opened, and replies were read in an order of
/// their own (fastest node first), so an attempt waited a full node timeout whenever the
/// paused node came first. Each node is paused in turn, so that whichever node a client
/// would read first is paused once.
#[test]
fn a_write_paused_node_costs_no_attempt_a_timeout() {
    let c = Cluster::start(3);
    let timeout = Duration::from_secs(1);
    let locks = crate::client_with(c.urls(), timeout);
    drop(locks.lock(&unique_key("warm"), SLACK * 4).expect("warm-up"));
    // Long enough that keys set when a pause ends have not expired by themselves when the
    // leftovers are checked.
    let ttl = Duration::from_secs(30);
    // (cycle, try_lock, paused node, attempt) of the slowest cycle.
    let mut slowest = (Duration::ZERO, Duration::ZERO, 0, 0);
    for paused_node in 0..c.len() {
        let paused = WritePause::start(&c, paused_node, Duration::from_secs(10));
        let mut keys = Vec::new();
        for n in 0..7 {
            let key = unique_key("write-paused");
            let t = Instant::now();
            let g = locks.try_lock(&key, ttl).unwrap_or_else(|e| {
                panic!(
                    "node {paused_node} paused: attempt {n} failed after {:?}: {e}",
                    t.elapsed()
                )
            });
            let locked = t.elapsed();
            g.release()
                .unwrap_or_else(|e| panic!("node {paused_node} paused: release {n}: {e}"));
            let cycle = t.elapsed();
            slowest = slowest.max((cycle, locked, paused_node, n));
            assert!(
                locked < Duration::from_millis(300) && cycle < Duration::from_millis(300),
                "node {paused_node} paused: attempt {n}: try_lock {locked:?}, with release \
                 {cycle:?}: waited for the write-paused node (node timeout {timeout:?})"
            );
            keys.push(key);
            // Time for background probes and reconnects between attempts.
            std::thread::sleep(Duration::from_millis(50));
        }
        // End the pause: the node runs the queued SETs, then the releases.
        drop(paused);
        let left = || {
            keys.iter()
                .filter(|k| c.get(paused_node, k).is_some())
                .count()
        };
        assert!(
            wait_until(Duration::from_secs(3), || left() == 0),
            "{} of {} keys left on node {paused_node} after its pause ended",
            left(),
            keys.len()
        );
    }
    let (cycle, locked, node, n) = slowest;
    eprintln!(
        "write-paused node: slowest of 21 lock+release cycles {cycle:?} (try_lock {locked:?}; \
         node {node} paused, attempt {n})"
    );
}

// ---------------------------------------------------------------------------------------
// A hung node present from client start

/// A node that accepts TCP and never answers, in the list from the start: the two
/// connector threads shared by all nodes were busy with its connects, healthy nodes got no
/// connection in time, and every attempt of the first moments failed.
#[test]
fn a_node_hung_from_client_start_fails_no_attempt() {
    let c = Cluster::start(2);
    let hole = Blackhole::start();
    let timeout = Duration::from_secs(1);
    let ttl = Duration::from_secs(5);
    let urls = vec![c.url(0), hole.url(), c.url(1)];
    let locks = crate::client_with(urls, timeout);
    let mut took = Vec::new();
    for n in 0..20 {
        let key = unique_key("hung-from-start");
        let t = Instant::now();
        let g = match locks.try_lock(&key, ttl) {
            Ok(g) => g,
            Err(e) => panic!(
                "attempt {n} (after {took:?}) failed in {:?}: {e}",
                t.elapsed()
            ),
        };
        let locked = t.elapsed();
        took.push(locked);
        assert!(
            locked < timeout / 2,
            "attempt {n} took {locked:?} (node timeout {timeout:?}); earlier: {took:?}"
        );
        g.release().unwrap_or_else(|e| panic!("release {n}: {e}"));
    }
    eprintln!(
        "hung node from client start: first attempt {:?}, slowest {:?}",
        took[0],
        took.iter().max().copied().unwrap_or_default()
    );
}

/// The same with 32 threads on one client: the hung node's connection owes replies that
/// never come, and the client's reader polls it with the others; no attempt fails and none
/// waits for it (each round needs the two that answer). A round that waited for the hung
/// node would take its node timeout (2 s), which no attempt may reach, however loaded the
/// machine.
#[test]
fn a_node_hung_from_client_start_fails_no_attempt_under_32_threads() {
    let c = Cluster::start(2);
    let hole = Blackhole::start();
    let timeout = Duration::from_secs(2);
    let locks = crate::client_with(vec![c.url(0), hole.url(), c.url(1)], timeout);
    let prefix = unique_key("hung-from-start-32");
    let bad: Vec<String> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..32)
            .map(|t| {
                let (locks, prefix) = (locks.clone(), &prefix);
                s.spawn(move || {
                    let mut bad = Vec::new();
                    for n in 0..10 {
                        let key = format!("{prefix}:{t}:{n}");
                        let start = Instant::now();
                        match locks.try_lock(&key, Duration::from_secs(5)) {
                            Ok(g) => {
                                let took = start.elapsed();
                                if took >= timeout {
                                    bad.push(format!("{key}: locked in {took:?}"));
                                }
                                if let Err(e) = g.release() {
                                    bad.push(format!("{key}: release: {e}"));
                                }
                            }
                            Err(e) => bad.push(format!("{key}: {e}")),
                        }
                    }
                    bad
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| w.join().expect("worker panicked"))
            .collect()
    });
    assert!(
        bad.is_empty(),
        "{} of 320 attempts failed or waited (node timeout {timeout:?}): {:?}",
        bad.len(),
        &bad[..bad.len().min(5)]
    );
}

/// 32 threads on one client while a node is write-paused (`CLIENT PAUSE … WRITE`: it reads
/// and never answers a write): its shared connection keeps a batch in flight that never
/// ends, rounds' commands to it wait behind the batch and then go out on their own, no
/// attempt fails or waits the node timeout, and once the pause ends the releases it owed
/// reach it: no key is left.
#[test]
fn a_write_paused_node_costs_no_attempt_under_32_threads_and_leaves_no_key() {
    let c = Cluster::start(3);
    let timeout = Duration::from_secs(2);
    let locks = crate::client_with(c.urls(), timeout);
    drop(locks.lock(&unique_key("warm"), SLACK * 4).expect("warm-up"));
    let prefix = unique_key("write-paused-32");
    let paused = WritePause::start(&c, 1, Duration::from_secs(20));
    let (keys, bad): (Vec<String>, Vec<String>) = std::thread::scope(|s| {
        let workers: Vec<_> = (0..32)
            .map(|t| {
                let (locks, prefix) = (locks.clone(), &prefix);
                s.spawn(move || {
                    let (mut keys, mut bad) = (Vec::new(), Vec::new());
                    for n in 0..10 {
                        let key = format!("{prefix}:{t}:{n}");
                        let start = Instant::now();
                        match locks.try_lock(&key, Duration::from_secs(30)) {
                            Ok(g) => {
                                let took = start.elapsed();
                                if took >= timeout {
                                    bad.push(format!("{key}: locked in {took:?}"));
                                }
                                if let Err(e) = g.release() {
                                    bad.push(format!("{key}: release: {e}"));
                                }
                            }
                            Err(e) => bad.push(format!("{key}: {e}")),
                        }
                        keys.push(key);
                    }
                    (keys, bad)
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| w.join().expect("worker panicked"))
            .fold((Vec::new(), Vec::new()), |(mut k, mut b), (k2, b2)| {
                k.extend(k2);
                b.extend(b2);
                (k, b)
            })
    });
    drop(paused);
    assert!(
        bad.is_empty(),
        "{} of 320 attempts failed or waited (node timeout {timeout:?}): {:?}",
        bad.len(),
        &bad[..bad.len().min(5)]
    );
    let left: Vec<&String> = keys
        .iter()
        .filter(|k| !c.gone_everywhere(k, Duration::from_secs(5)))
        .collect();
    assert!(
        left.is_empty(),
        "{} of {} keys left after the pause ended: {:?}",
        left.len(),
        keys.len(),
        &left[..left.len().min(5)]
    );
}

// ---------------------------------------------------------------------------------------
// The unlock after a timed-out attempt

/// The unlock of a failed attempt went through the breaker the same attempt had just opened
/// for the nodes that timed out: after they resumed, our token sat on them for the rest of
/// the TTL and every client got `Taken { held: 2 }`.
#[test]
fn a_failed_attempt_unlocks_the_nodes_that_timed_out() {
    let c = Cluster::start(3);
    let locks = crate::client_with(c.urls(), Duration::from_millis(300));
    // Open connections to every node, so that the SET reaches the nodes that then hang.
    drop(locks.lock(&unique_key("warm"), SLACK * 4).expect("warm-up"));
    let ttl = Duration::from_secs(20);
    let key = unique_key("timed-out-unlock");
    c.pause(1);
    c.pause(2);
    let attempt = locks.try_lock(&key, ttl);
    c.unpause(1);
    c.unpause(2);
    match attempt {
        Err(Error::NoQuorum { agreed: 1, .. }) => {}
        other => panic!("expected NoQuorum with two nodes hung, got {other:?}"),
    }
    let resumed = Instant::now();
    let cleared = wait_until(Duration::from_secs(3), || {
        (0..3).all(|i| c.get(i, &key).is_none())
    });
    assert!(
        cleared,
        "3 s after the nodes resumed the failed attempt's key is still there: {:?}",
        on_nodes(&c, &key)
    );
    eprintln!(
        "failed attempt's keys gone {:?} after the nodes resumed",
        resumed.elapsed()
    );
    let other = crate::client_with(c.urls(), SLACK);
    match other.try_lock(&key, ttl) {
        Ok(g) => g.release().expect("release"),
        Err(e) => panic!(
            "a second client cannot lock a resource nobody holds: {e} (nodes: {:?})",
            on_nodes(&c, &key)
        ),
    }
}

// ---------------------------------------------------------------------------------------
// A huge resource name

/// An 8–64 MiB resource name was sent to every node; the write was not bounded by the
/// round deadline and tripped every node's breaker, so the caller's input made the client
/// unavailable.
#[test]
fn a_huge_resource_name_is_refused_and_harms_nothing() {
    let c = Cluster::start(3);
    let locks = Redlock::builder()
        .fresh_cluster(true)
        .nodes(c.urls())
        .build()
        .expect("valid config");
    let ttl = Duration::from_secs(5);
    // Keys on each node, but for the lock history the acquire script keeps.
    let keys_on_nodes = || -> Vec<i64> {
        (0..c.len())
            .map(|i| {
                // Both in one transaction: a late script may create the
                // history between two separate reads.
                let (all, meta): (i64, i64) = redis::pipe()
                    .atomic()
                    .cmd("DBSIZE")
                    .cmd("EXISTS")
                    .arg("quorumlock:meta")
                    .query(&mut c.conn(i))
                    .expect("DBSIZE, EXISTS");
                all - meta
            })
            .collect()
    };
    drop(locks.lock(&unique_key("warm"), ttl).expect("warm-up"));
    let before = keys_on_nodes();
    let prefix = unique_key("long");
    let named = |len: usize| format!("{prefix}:{}", "x".repeat(len - prefix.len() - 1));
    for len in [64 << 20, 8 << 20, MAX_RESOURCE_LEN + 1] {
        let name = named(len);
        let t = Instant::now();
        let tries = [
            locks.try_lock(&name, ttl).map(drop),
            locks.lock(&name, ttl).map(drop),
            locks
                .request(&name, ttl)
                .acquire_for(Duration::from_millis(500))
                .map(drop),
        ];
        for r in tries {
            match r {
                Err(Error::InvalidInput(InvalidInput::ResourceTooLong { len: l, max }))
                    if l == len && max == MAX_RESOURCE_LEN => {}
                other => panic!("a {len}-byte name: {other:?}"),
            }
        }
        assert!(
            t.elapsed() < Duration::from_millis(500),
            "refusing a {len}-byte name took {:?}: it was not refused before any I/O",
            t.elapsed()
        );
        // The same client, right after.
        let g = locks
            .try_lock(&unique_key("after-long"), ttl)
            .unwrap_or_else(|e| panic!("right after a {len}-byte name the client fails: {e}"));
        g.release().expect("release");
    }
    assert!(
        wait_until(Duration::from_secs(2), || keys_on_nodes() == before),
        "keys on the nodes: {:?}, before {before:?}",
        keys_on_nodes()
    );
    // A name of exactly the limit is accepted.
    let longest = named(MAX_RESOURCE_LEN);
    let g = locks
        .try_lock(&longest, ttl)
        .expect("a name of MAX_RESOURCE_LEN bytes locks");
    assert!(c.holders(&longest, g.token()) >= 2);
    g.release().expect("release");
}

// ---------------------------------------------------------------------------------------
// A fresh client meeting a restarted node while another process holds the lock

/// Selects the role of a child process (see [`child_process_role`]).
const ROLE: &str = "QUORUMLOCK_NODE_LAYER_ROLE";
const URLS: &str = "QUORUMLOCK_NODE_LAYER_URLS";
const KEY: &str = "QUORUMLOCK_NODE_LAYER_KEY";
/// Comma-separated TTLs in ms; the contender cycles through them.
const TTLS: &str = "QUORUMLOCK_NODE_LAYER_TTLS_MS";
const RUN_MS: &str = "QUORUMLOCK_NODE_LAYER_RUN_MS";
const PROTECT: &str = "QUORUMLOCK_NODE_LAYER_PROTECT";
const STOP_AT_FIRST: &str = "QUORUMLOCK_NODE_LAYER_STOP_AT_FIRST";

/// Not a test of its own: the entry point of the child processes of the restart tests,
/// which re-run this binary with `--exact node_layer::child_process_role` and [`ROLE`] set.
/// Without [`ROLE`] it does nothing.
#[test]
fn child_process_role() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    let var = |k: &str| std::env::var(k).unwrap_or_else(|_| panic!("{k} is not set"));
    let urls: Vec<String> = var(URLS).split(',').map(str::to_owned).collect();
    let key = var(KEY);
    let ttls: Vec<Duration> = var(TTLS)
        .split(',')
        .map(|t| Duration::from_millis(t.parse().expect("ttl ms")))
        .collect();
    match role.as_str() {
        "holder" => hold(urls, &key, ttls[0]),
        "contender" => contend(
            urls,
            &key,
            &ttls,
            Duration::from_millis(var(RUN_MS).parse().expect("run ms")),
            var(PROTECT) == "1",
            var(STOP_AT_FIRST) == "1",
        ),
        other => panic!("unknown role {other}"),
    }
}

/// Child "holder": a client with default settings takes `key` and keeps it until its
/// stdin is closed.
fn hold(urls: Vec<String>, key: &str, ttl: Duration) {
    let locks = Redlock::builder()
        .nodes(urls)
        .build()
        .expect("valid config");
    let guard = match locks.request(key, ttl).acquire_for(Duration::from_secs(3)) {
        Ok(g) => g,
        Err(e) => {
            println!("HOLDER_FAILED {e}");
            return;
        }
    };
    let deadline = SystemTime::now() + guard.deadline().saturating_duration_since(Instant::now());
    let deadline_ms = deadline
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    println!(
        "HOLDER_LOCKED token={} deadline_ms={deadline_ms} validity_ms={}",
        guard.token(),
        guard.validity().as_millis()
    );
    let _ = std::io::stdout().flush();
    let _ = std::io::stdin().read_to_end(&mut Vec::new());
    drop(guard);
}

/// Child "contender": a client built in this process (never seen the nodes before) tries
/// `key` back to back for `run_for`, printing every success and a summary.
fn contend(
    urls: Vec<String>,
    key: &str,
    ttls: &[Duration],
    run_for: Duration,
    protect: bool,
    stop_at_first: bool,
) {
    let locks = Redlock::builder()
        .nodes(urls)
        .restart_protection(protect)
        .build()
        .expect("valid config");
    let (started, start_ms) = (Instant::now(), unix_ms());
    let (mut attempts, mut got) = (0usize, 0usize);
    let mut errors: BTreeMap<String, usize> = BTreeMap::new();
    while started.elapsed() < run_for {
        let ttl = ttls[attempts % ttls.len()];
        attempts += 1;
        match locks.try_lock(key, ttl) {
            Ok(g) => {
                got += 1;
                println!(
                    "CONTENDER_GOT at_ms={} ttl_ms={} attempt={attempts}",
                    unix_ms(),
                    ttl.as_millis()
                );
                drop(g);
                if stop_at_first {
                    break;
                }
            }
            Err(e) => *errors.entry(summary(&e)).or_default() += 1,
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    println!(
        "CONTENDER_DONE start_ms={start_ms} end_ms={} attempts={attempts} got={got} \
         errors={errors:?}",
        unix_ms()
    );
    let _ = std::io::stdout().flush();
}

/// A child process running [`child_process_role`]; killed when dropped.
struct ChildProc {
    role: String,
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
}

impl ChildProc {
    fn spawn(role: &str, env: &[(&str, String)]) -> ChildProc {
        let exe = std::env::current_exe().expect("current_exe");
        let mut cmd = Command::new(exe);
        cmd.args([
            "--exact",
            "node_layer::child_process_role",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ROLE, role)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().unwrap_or_else(|e| panic!("spawn {role}: {e}"));
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, lines) = mpsc::channel();
        std::thread::Builder::new()
            .name("ql-test-child-out".into())
            .spawn(move || {
                for line in BufReader::new(stdout).lines() {
                    let Ok(line) = line else { break };
                    if tx.send(line).is_err() {
                        break;
                    }
                }
            })
            .expect("spawn reader");
        ChildProc {
            role: role.to_owned(),
            stdin: child.stdin.take(),
            child,
            lines,
        }
    }

    /// The child's lines from the first of `prefixes` on (other lines are the test
    /// harness's own), up to and including the first one starting with `last`, within
    /// `limit`.
    fn collect(&self, prefixes: &[&str], last: &str, limit: Duration) -> Vec<String> {
        let deadline = Instant::now() + limit;
        let mut out = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) => {
                    // libtest may print `test … ... ` before the first line on the same line.
                    let Some(at) = prefixes.iter().filter_map(|p| l.find(p)).min() else {
                        continue;
                    };
                    let l = l[at..].to_owned();
                    let done = l.starts_with(last);
                    out.push(l);
                    if done {
                        return out;
                    }
                }
                Err(e) => panic!(
                    "child {}: no {last} line within {limit:?} ({e}); got {out:?}",
                    self.role
                ),
            }
        }
    }
}

impl Drop for ChildProc {
    fn drop(&mut self) {
        drop(self.stdin.take()); // the holder's cue to release and exit
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(3) {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `name=value` field of a child's line.
fn field<'a>(line: &'a str, name: &str) -> &'a str {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(name)?.strip_prefix('='))
        .unwrap_or_else(|| panic!("no {name}= in {line:?}"))
}

fn field_ms(line: &str, name: &str) -> u128 {
    field(line, name)
        .parse()
        .unwrap_or_else(|e| panic!("{name} in {line:?}: {e}"))
}

/// How the node that does not hold the holder's key came to lack it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ThirdNode {
    /// It was down (killed) during the holder's acquire and was restarted empty after it:
    /// two of the three nodes are restarted.
    DownDuringAcquire,
    /// It never got the holder's write (a partition, simulated by deleting the key) and
    /// keeps its lock history: one node is restarted.
    MissedTheWrite,
}

/// Process A holds a lock on two nodes of 3 (say 0 and 2); node 2 is killed (SIGKILL) and
/// restarted empty; a client in a fresh process B (default settings: not `fresh_cluster`)
/// tries the key for 1.5 s and must never get it while A's lock is valid. A control process
/// with `restart_protection(false)` does get it, which shows the scenario is a real hazard.
fn restarted_node_met_by_a_fresh_process(third: ThirdNode) {
    const HOLD_TTL: Duration = Duration::from_secs(5);
    let c = Cluster::start(3);
    // Lock history older than the TTL: a lock on every node, then wait out the TTL (plus
    // a second, as INFO's uptime, which older versions used, counts whole seconds).
    let history = Redlock::builder()
        .fresh_cluster(true)
        .nodes(c.urls())
        .build()
        .expect("valid config");
    // Until one lock reached every node: a round settles without the slowest node, and a
    // node whose connection was not open yet is not sent the command at all.
    assert!(
        c.write_history(&history, HOLD_TTL),
        "no history lock reached all three nodes"
    );
    drop(history);
    // From the moment the last node's history was written (a loaded machine can take
    // seconds to get one lock onto all three nodes), not from the cluster's start.
    std::thread::sleep(HOLD_TTL + Duration::from_millis(1200));

    let key = unique_key("restart-race");
    let urls = c.urls().join(",");
    if third == ThirdNode::DownDuringAcquire {
        c.stop(1);
    }
    let holder = ChildProc::spawn(
        "holder",
        &[
            (URLS, urls.clone()),
            (KEY, key.clone()),
            (TTLS, HOLD_TTL.as_millis().to_string()),
        ],
    );
    let line = holder
        .collect(&["HOLDER_"], "HOLDER_", Duration::from_secs(30))
        .remove(0);
    assert!(line.starts_with("HOLDER_LOCKED"), "holder: {line}");
    let token = field(&line, "token").to_owned();
    let a_deadline = field_ms(&line, "deadline_ms");
    // Where A's key is. A round settles on a majority: a node whose connection was still
    // opening may never have been sent A's SET. So the roles follow what happened:
    // `keeper` keeps A's key, `restarted` had it and is killed and restarted empty,
    // `missing` lacks it (down during the acquire, or it missed the write).
    std::thread::sleep(Duration::from_millis(200)); // a SET still in flight lands
    let has_a = |i: usize| c.get(i, &key).as_deref() == Some(token.as_str());
    let (keeper, restarted, missing) = match third {
        ThirdNode::DownDuringAcquire => {
            assert!(
                has_a(0) && has_a(2),
                "A on nodes 0 and 2: {:?}",
                on_nodes_but(&c, &key, 1)
            );
            c.restart(1);
            (0, 2, 1)
        }
        ThirdNode::MissedTheWrite => {
            let held: Vec<usize> = (0..3).filter(|&i| has_a(i)).collect();
            assert!(
                held.len() >= 2,
                "A holds a majority: {:?}",
                on_nodes(&c, &key)
            );
            let (keeper, restarted) = (held[0], held[held.len() - 1]);
            let missing = 3 - keeper - restarted;
            c.del(missing, &key);
            (keeper, restarted, missing)
        }
    };
    // kill -9 and start again with no data.
    c.restart(restarted);
    let mut want = vec![None, None, None];
    want[keeper] = Some(token.clone());
    assert_eq!(on_nodes(&c, &key), want, "A now holds node {keeper} only");
    let roles = format!("keeper {keeper}, restarted {restarted}, missing {missing}");

    let contender = |protect: bool, stop_at_first: bool| {
        let p = ChildProc::spawn(
            "contender",
            &[
                (URLS, urls.clone()),
                (KEY, key.clone()),
                // A shorter TTL than A's (learnt from the nodes) and A's own.
                (TTLS, "1000,5000".to_owned()),
                (RUN_MS, "1500".to_owned()),
                (PROTECT, if protect { "1" } else { "0" }.to_owned()),
                (
                    STOP_AT_FIRST,
                    if stop_at_first { "1" } else { "0" }.to_owned(),
                ),
            ],
        );
        p.collect(&["CONTENDER_"], "CONTENDER_DONE", Duration::from_secs(30))
    };
    let fresh = contender(true, false);
    let control = contender(false, true);
    let a_left = a_deadline as i128 - unix_ms() as i128;
    drop(holder);
    eprintln!(
        "{third:?} ({roles}): fresh client: {fresh:?}; control: {control:?}; A's validity \
         left after both: {a_left} ms"
    );

    let done = fresh.last().expect("done line");
    let stolen: Vec<&String> = fresh
        .iter()
        .filter(|l| l.starts_with("CONTENDER_GOT") && field_ms(l, "at_ms") < a_deadline)
        .collect();
    assert!(
        stolen.is_empty(),
        "{third:?} ({roles}): a fresh client locked {key} while A held it until \
         {a_deadline}: {stolen:?} ({done})"
    );
    assert!(
        field_ms(done, "end_ms") < a_deadline,
        "{third:?} ({roles}): test too slow: the fresh client's tries ({done}) did not end \
         inside A's validity (until {a_deadline})"
    );
    assert!(
        field_ms(done, "attempts") >= 10,
        "{third:?} ({roles}): too few attempts: {done}"
    );
    let control_got = control
        .iter()
        .find(|l| l.starts_with("CONTENDER_GOT"))
        .unwrap_or_else(|| {
            panic!(
                "{third:?} ({roles}): the control (no restart protection) never locked: \
                 {control:?}"
            )
        });
    assert!(
        field_ms(control_got, "at_ms") < a_deadline,
        "{third:?} ({roles}): the control locked only after A's validity ({control_got}, A \
         until {a_deadline}): test too slow"
    );
}

#[test]
fn a_fresh_process_does_not_count_a_restarted_node_while_the_lock_is_held() {
    restarted_node_met_by_a_fresh_process(ThirdNode::MissedTheWrite);
}

#[test]
fn a_fresh_process_does_not_count_two_restarted_nodes_while_the_lock_is_held() {
    restarted_node_met_by_a_fresh_process(ThirdNode::DownDuringAcquire);
}

/// The same hazard with clients that each make one call (cron jobs), and the only node
/// that still knows the longest TTL in use a little slower than the others (a delaying
/// proxy: 15 ms, well inside the 50 ms node timeout). Nodes 1 and 2 restarted empty and a
/// one-shot client with a 1 s TTL has since written its TTL into their lock history; a
/// fresh client with the same 1 s TTL, after that 1 s, must still hear node 0 (which holds
/// A's 5 s lock and reports a 5 s TTL in use) before it counts the restarted nodes' votes.
#[test]
fn a_slow_node_that_knows_the_longest_ttl_is_heard_before_restarted_nodes_vote() {
    const HOLD_TTL: Duration = Duration::from_secs(5);
    const SHORT_TTL: Duration = Duration::from_secs(1);
    let c = Cluster::start(3);
    let slow0 = DelayProxy::start(&c.url(0), Duration::from_millis(15));
    let urls = vec![slow0.url(), c.url(1), c.url(2)];
    // A round settles without the slow node, so its late NOSCRIPT is never followed by
    // EVAL (see `a_slower_node_gets_the_scripts`): load them through a client of its own.
    load_scripts(&slow0.url());
    // Lock history older than the longest TTL, on every node.
    let history = Redlock::builder()
        .fresh_cluster(true)
        .nodes(urls.clone())
        .build()
        .expect("valid config");
    assert!(
        c.write_history(&history, HOLD_TTL),
        "no history lock reached all three nodes"
    );
    drop(history);
    // From when the last node's history was written, not from the cluster's start.
    std::thread::sleep(HOLD_TTL + Duration::from_millis(1200));

    // A: a default client, connections open, holds the key with a 5 s TTL on node 0.
    let a = Redlock::builder()
        .nodes(urls.clone())
        .build()
        .expect("valid config");
    drop(a.lock(&unique_key("warm"), HOLD_TTL).expect("warm-up"));
    let key = unique_key("slow-keeper");
    let held = a.lock(&key, HOLD_TTL).expect("A locks");
    assert!(
        wait_until(Duration::from_secs(1), || c.get(0, &key).as_deref()
            == Some(held.token())),
        "A's key on node 0: {:?}",
        on_nodes(&c, &key)
    );
    // Nodes 1 and 2: kill -9, start again with no data.
    c.restart(1);
    c.restart(2);
    // One-shot clients with a 1 s TTL: their first round writes their own TTL into the
    // restarted nodes' new lock history (their votes are held back: nothing is locked).
    for _ in 0..3 {
        let once = Redlock::builder()
            .nodes(urls.clone())
            .build()
            .expect("valid config");
        let r = once.try_lock(&unique_key("cron"), SHORT_TTL);
        assert!(r.is_err(), "the restarted nodes voted at once: {r:?}");
    }
    std::thread::sleep(SHORT_TTL + Duration::from_millis(200));

    // Fresh one-shot clients with a 1 s TTL try A's key.
    let mut outcomes = Vec::new();
    for _ in 0..10 {
        let fresh = Redlock::builder()
            .nodes(urls.clone())
            .build()
            .expect("valid config");
        match fresh.try_lock(&key, SHORT_TTL) {
            Ok(_) => outcomes.push(format!("LOCKED (A held: {})", held.is_held())),
            Err(e) => outcomes.push(summary(&e)),
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(held.is_held(), "test too slow: A's lock expired meanwhile");
    eprintln!("fresh one-shot clients against a slow keeper: {outcomes:?}");
    assert!(
        outcomes.iter().all(|o| !o.starts_with("LOCKED")),
        "a fresh client locked {key} while A held it (node 0, slow, knows the 5 s TTL; \
         nodes 1 and 2 restarted): {outcomes:?}"
    );
}

// ---------------------------------------------------------------------------------------
// A node slower than the others (inside the node timeout)

/// Loads the crate's scripts on the node at `url`: a client of that node alone waits for
/// its replies, so its NOSCRIPT is followed by EVAL.
fn load_scripts(url: &str) {
    let only = Redlock::builder()
        .fresh_cluster(true)
        .node(url)
        // The node is behind a delaying proxy; a loaded machine adds more.
        .node_timeout(Duration::from_secs(1))
        .build()
        .expect("valid config");
    let g = only
        .lock(&unique_key("load-scripts"), Duration::from_secs(5))
        .expect("lock on the node alone");
    g.extend(Duration::from_secs(5)).expect("extend");
    g.release().expect("release");
}

/// Node 0 answers 15 ms later than the others (a delaying proxy), well inside the 50 ms
/// node timeout, on a cluster that has not run the crate's scripts yet. Each round settles
/// on nodes 1 and 2 first; the client must still get its script onto node 0, so that the
/// locks it takes land there too.
#[test]
fn a_slower_node_gets_the_scripts() {
    let c = Cluster::start(3);
    let slow0 = DelayProxy::start(&c.url(0), Duration::from_millis(15));
    let locks = Redlock::builder()
        .fresh_cluster(true)
        .nodes([slow0.url(), c.url(1), c.url(2)])
        .build()
        .expect("valid config");
    let mut landed = 0;
    let mut guards = Vec::new();
    for _ in 0..20 {
        let g = locks
            .lock(&unique_key("slow-script"), Duration::from_secs(10))
            .expect("lock");
        // No other round meanwhile: nothing can have removed it yet.
        if wait_until(Duration::from_millis(100), || {
            c.get(0, g.resource()).as_deref() == Some(g.token())
        }) {
            landed += 1;
        }
        guards.push(g);
    }
    eprintln!("slower node, scripts not loaded: {landed} of 20 locks landed on it");
    assert!(
        landed >= 10,
        "only {landed} of 20 locks landed on the slower node (it answers in ~15 ms, node \
         timeout 50 ms)"
    );
}

/// Node 0 answers 15 ms later than the others, scripts loaded. The client takes 10 locks
/// and keeps them, with pauses between them shorter and longer than the node timeout; each
/// lock's key reached node 0 (its SET was sent there and answered "set" in time for the
/// next round to read it), and must still be there: the attempts succeeded, so there is
/// nothing to undo.
#[test]
fn a_slower_node_keeps_the_locks_it_took() {
    let c = Cluster::start(3);
    let slow0 = DelayProxy::start(&c.url(0), Duration::from_millis(15));
    load_scripts(&slow0.url());
    let locks = Redlock::builder()
        .fresh_cluster(true)
        .nodes([slow0.url(), c.url(1), c.url(2)])
        .build()
        .expect("valid config");
    drop(locks.lock(&unique_key("warm"), SLACK).expect("warm-up"));
    // Connecting to the slower node takes a few of its round trips (the
    // scripts are loaded on connect); rounds do not wait for it meanwhile.
    std::thread::sleep(Duration::from_millis(300));
    let mut report = Vec::new();
    for gap_ms in [5u64, 100] {
        let guards: Vec<_> = (0..10)
            .map(|_| {
                let g = locks
                    .lock(&unique_key("slow-keeps"), Duration::from_secs(10))
                    .expect("lock");
                std::thread::sleep(Duration::from_millis(gap_ms));
                g
            })
            .collect();
        std::thread::sleep(Duration::from_millis(100));
        let kept = guards
            .iter()
            .filter(|g| c.get(0, g.resource()).as_deref() == Some(g.token()))
            .count();
        let on_majority = guards
            .iter()
            .all(|g| c.holders(g.resource(), g.token()) >= 2);
        assert!(
            on_majority,
            "gap {gap_ms} ms: a held lock lost its majority"
        );
        report.push((gap_ms, kept));
    }
    eprintln!("slower node keeps the locks: (gap ms, kept of 10) {report:?}");
    assert!(
        report.iter().all(|&(_, kept)| kept >= 8),
        "the slower node lost held locks: (gap between locks in ms, locks of 10 still on \
         it) {report:?}"
    );
}

// ---------------------------------------------------------------------------------------
// Recovery after a majority outage

/// Tries `key`s back to back until one is acquired; returns how long that took.
fn time_to_next_lock(locks: &Redlock, name: &str, limit: Duration) -> Duration {
    let t = Instant::now();
    let mut last = None;
    while t.elapsed() < limit {
        match locks.try_lock(&unique_key(name), Duration::from_secs(5)) {
            Ok(g) => {
                let took = t.elapsed();
                drop(g);
                return took;
            }
            Err(e) => last = Some(e),
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    panic!("{name}: no lock within {limit:?} after the nodes came back; last error: {last:?}");
}

/// Keeps trying while 3 of 5 nodes are out for 2 s; every attempt must fail.
fn try_through_outage(locks: &Redlock, name: &str) -> usize {
    let t = Instant::now();
    let mut failures = 0;
    while t.elapsed() < Duration::from_secs(2) {
        match locks.try_lock(&unique_key(name), Duration::from_secs(5)) {
            Ok(g) => panic!("{name}: locked with 3 of 5 nodes out: {:?}", g.token()),
            Err(e) => {
                assert!(e.is_retryable(), "{name}: {e}");
                failures += 1;
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    failures
}

/// After 3 of 5 nodes were down for 2–5 s the next acquisition came a mean 343 ms (up to
/// 5.5 s) after the nodes were back: the breaker's window had grown to seconds.
#[test]
fn locking_resumes_soon_after_a_majority_outage() {
    let c = Cluster::start(5);
    // Killed nodes come back empty; the delayed-restart rule (which would hold them for a
    // TTL, by design) is not the subject here.
    let locks = Redlock::builder()
        .nodes(c.urls())
        .restart_protection(false)
        .build()
        .expect("valid config");
    drop(locks.lock(&unique_key("warm"), SLACK * 4).expect("warm-up"));

    // Dead majority: killed, then restarted.
    for i in 0..3 {
        c.stop(i);
    }
    let failed = try_through_outage(&locks, "dead-majority");
    std::thread::scope(|s| {
        for i in 0..3 {
            let c = &c;
            s.spawn(move || c.restart(i));
        }
    });
    let dead = time_to_next_lock(&locks, "after-dead", Duration::from_secs(15));

    // Hung majority: SIGSTOP, then SIGCONT.
    for i in 0..3 {
        c.pause(i);
    }
    let hung_failed = try_through_outage(&locks, "hung-majority");
    for i in 0..3 {
        c.unpause(i);
    }
    let hung = time_to_next_lock(&locks, "after-hung", Duration::from_secs(15));

    eprintln!(
        "recovery after 3 of 5 nodes were out for 2 s: killed+restarted {dead:?} \
         ({failed} failed attempts during the outage), hung+resumed {hung:?} ({hung_failed})"
    );
    assert!(
        dead < Duration::from_millis(1500),
        "first lock {dead:?} after the killed nodes were back"
    );
    assert!(
        hung < Duration::from_millis(1500),
        "first lock {hung:?} after the hung nodes resumed"
    );
}

/// `CLIENT KILL` of every client of node `i` but this one.
fn kill_clients(c: &Cluster, i: usize) {
    let _: redis::Value = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("TYPE")
        .arg("normal")
        .arg("SKIPME")
        .arg("yes")
        .query(&mut c.conn(i))
        .expect("CLIENT KILL");
}

/// Connections the nodes closed while idle (`CLIENT KILL`, a server
/// `timeout`, a proxy's idle cut) are not the nodes' answers to commands:
/// a round finds them closed before sending, takes fresh ones, and the
/// nodes stay healthy.
#[test]
fn idle_connections_closed_by_the_nodes_cost_nothing() {
    let c = Cluster::start(3);
    let locks = crate::client_with(c.urls(), Duration::from_millis(250));
    let key = unique_key("client-kill");
    assert_eq!(locks.wait_connected(Duration::from_secs(5)).ok(), Some(3));
    let g = locks.lock(&key, Duration::from_secs(10)).expect("lock");
    for round in 0..20 {
        for i in 0..2 {
            kill_clients(&c, i);
        }
        // Let the nodes close them (the FINs arrive).
        std::thread::sleep(Duration::from_millis(20));
        g.extend(Duration::from_secs(10))
            .unwrap_or_else(|e| panic!("extend {round} after CLIENT KILL on 2 nodes: {e}"));
    }
    g.release().expect("release");
}

/// Records the nodes' health changes.
#[derive(Default)]
struct NodeChanges(parking_lot::Mutex<Vec<String>>);

impl quorumlock::EventHandler for NodeChanges {
    fn on_node(&self, e: &quorumlock::NodeEvent<'_>) {
        self.0.lock().push(format!("{} {:?}", e.node(), e.change()));
    }
}

/// A pooled connection the node closes just as our command goes out (the
/// close reaches us only after the command left: here a proxy passes the
/// close on 30 ms late, as Docker's proxy or a load balancer may) got no
/// answer from the node: the round takes a fresh connection, the command
/// succeeds, and no node is reported skipped (rule 2).
#[test]
fn a_connection_closed_as_the_command_goes_out_is_replaced_not_counted() {
    let c = Cluster::start(3);
    let proxies: Vec<DelayProxy> = (0..3)
        .map(|i| DelayProxy::start(&c.url(i), Duration::from_millis(30)))
        .collect();
    let changes = std::sync::Arc::new(NodeChanges::default());
    let locks = Redlock::builder()
        .fresh_cluster(true)
        .nodes(proxies.iter().map(DelayProxy::url))
        // Generous: the fresh connection and its command may take long on a loaded
        // machine (CI's clean-clone run failed once under load); the close still
        // reaches us 30 ms after the command left, whatever the timeout.
        .node_timeout(Duration::from_secs(1))
        .events(changes.clone())
        .build()
        .expect("valid config");
    assert_eq!(locks.wait_connected(Duration::from_secs(5)).ok(), Some(3));
    let key = unique_key("kill-in-flight");
    let g = locks.lock(&key, Duration::from_secs(10)).expect("lock");
    for round in 0..10 {
        for i in 0..2 {
            kill_clients(&c, i);
        }
        // No pause: the close is still on its way when the extend goes out.
        g.extend(Duration::from_secs(10))
            .unwrap_or_else(|e| panic!("extend {round} right after CLIENT KILL on 2 nodes: {e}"));
    }
    let changes = changes.0.lock().clone();
    assert!(
        changes.is_empty(),
        "nodes that closed connections changed health: {changes:?}"
    );
    g.release().expect("release");
    assert!(c.gone_everywhere(&key, Duration::from_secs(2)));
}

/// Clients connected to node `i` (less this query's own connection).
fn clients_on(c: &Cluster, i: usize) -> usize {
    let info: String = redis::cmd("INFO")
        .arg("clients")
        .query(&mut c.conn(i))
        .expect("INFO clients");
    info.lines()
        .find_map(|l| l.strip_prefix("connected_clients:"))
        .and_then(|n| n.trim().parse::<usize>().ok())
        .map_or(0, |n| n.saturating_sub(1))
}

/// One thread's lock/release loop keeps a slow node's pool small and never misses a
/// connection. The retry job used to read late replies by popping every idle connection of
/// a node at once. Each pop below the pool's idle minimum started a new connection, so one
/// thread's lock/release loop grew a slow node's pool towards its 32, and a round that came
/// meanwhile found no idle connection below the pool's size and failed the node with
/// `NoConnection`. The retry job now pops only as many as owe replies.
#[test]
fn one_thread_with_a_slow_node_keeps_a_small_pool_and_never_misses_a_connection() {
    let c = Cluster::start(3);
    // Slower than the others, inside the node timeout: rounds settle without its replies.
    let slow = DelayProxy::start(&c.url(2), Duration::from_millis(15));
    let locks = Redlock::builder()
        .fresh_cluster(true)
        .nodes([c.url(0), c.url(1), slow.url()])
        .node_timeout(SLACK)
        .build()
        .expect("valid config");
    assert_eq!(locks.wait_connected(Duration::from_secs(5)).ok(), Some(3));
    let key = unique_key("small-pool");
    let mut missed = Vec::new();
    let until = Instant::now() + Duration::from_secs(3);
    while Instant::now() < until {
        match locks.try_lock(&key, Duration::from_secs(5)) {
            Ok(g) => {
                let _ = g.release();
            }
            Err(e) => missed.push(summary(&e)),
        }
    }
    std::thread::sleep(Duration::from_millis(300));
    let pools: Vec<usize> = (0..3).map(|i| clients_on(&c, i)).collect();
    eprintln!("pools {pools:?} missed {}", missed.len());
    assert!(missed.is_empty(), "{missed:?}");
    // The defect grew the slow node's pool towards its 32. A loaded machine's own
    // timeouts replace connections too (a fast node once showed 8 on a CI run), which is
    // not this: the bound is well below the pool's size and above that noise.
    assert!(
        pools.iter().all(|&n| n <= 12),
        "connections per node: {pools:?}"
    );
}
