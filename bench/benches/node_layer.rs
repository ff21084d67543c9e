//! The node layer's figures (issue 7, "Benchmarks"), on 5 local nodes, one
//! run, side by side in one table at the end:
//!
//! 1. healthy: quorumlock against two hand-written floors (below);
//! 2. one node hung from client start (a black hole in the node list);
//! 3. one node write-paused (`CLIENT PAUSE 60000 WRITE`) after warm-up;
//! 4. one node slow: a proxy delaying its replies by 45 ms (node timeout 50 ms);
//! 5. 32 threads × 2 s, distinct keys, `try_lock` + release back to back:
//!    quorumlock (one shared client) against `rslock` (32 tokio tasks) and
//!    the floor (32 threads, each with its own connections).
//!
//! Every single-thread scenario times `*CYCLES` lock+unlock cycles on distinct
//! keys after `*WARM` cycles of warm-up. The two floors, both on one blocking
//! redis-rs connection per node (TCP_NODELAY, no CLIENT SETINFO), send a
//! command to all nodes, then read the replies node after node:
//! - `floor SET`: `SET k tok NX PX ttl`, then a one-key compare-and-delete
//!   script by EVALSHA (the classic Redlock by hand);
//! - `floor script`: quorumlock's own acquire script (SET NX PX plus the
//!   `quorumlock:meta` bookkeeping) and its release script by EVALSHA, the
//!   same bytes quorumlock sends, so the gap left is the client's.
//!
//! Columns: cycle p50/p99/max, the lock and unlock steps' p50, p50 against
//! healthy quorumlock, failures, and for scenarios 1 and 5 the CPU per cycle
//! of this process ("cli": client, harness and background threads) and of
//! the 5 redis-servers ("srv", from `INFO cpu`). Notes below the table: lock
//! keys still on the nodes after each run (the client alive: none should
//! be), connections opened to the sick node, first cycles after a fault.
//!
//! ```text
//! QUORUMLOCK_TEST_BACKEND=process cargo bench --bench node_layer
//! QUORUMLOCK_TEST_BACKEND=process cargo bench --bench node_layer -- threads   # one scenario
//! ```
//! Scenario names for the filter: healthy, hung, paused, slow, threads.
//! `NODE_LAYER_LOG=debug` prints quorumlock's log records on stderr.
//! Compiled as a test (`cargo test --benches`) it returns at once.

use std::sync::{Barrier, OnceLock};
use std::time::{Duration, Instant};

use quorumlock::Redlock;
use redis::Value;

#[path = "../../tests/common/mod.rs"]
mod common;

use common::faults::{pause_writes, unpause_writes, Blackhole, DelayProxy};
use common::Cluster;

/// How many local nodes: 5, or `QUORUMLOCK_BENCH_NODES` (at least 3).
static NODES: std::sync::LazyLock<usize> = std::sync::LazyLock::new(|| {
    std::env::var("QUORUMLOCK_BENCH_NODES")
        .ok()
        .and_then(|n| n.parse().ok())
        .map_or(5, |n: usize| n.max(3))
});
const TTL: Duration = Duration::from_secs(10);
/// Timed cycles per single-thread scenario and variant.
static CYCLES: std::sync::LazyLock<usize> =
    std::sync::LazyLock::new(|| common::bench_count(5000, 40));
/// Untimed cycles before them.
static WARM: std::sync::LazyLock<usize> = std::sync::LazyLock::new(|| common::bench_count(200, 10));
/// Scenario 1 runs its three variants in turns of this many cycles, so that
/// drift in the machine's load is shared out evenly.
static TURN: std::sync::LazyLock<usize> = std::sync::LazyLock::new(|| common::bench_count(500, 20));
/// Cycles timed separately at the very start of a client (scenarios 2 and 4)
/// or right after the fault appears (scenario 3).
const FIRST: usize = 20;
const THREADS: usize = 32;
static THREAD_WARM: std::sync::LazyLock<Duration> = std::sync::LazyLock::new(|| {
    if common::bench_smoke() {
        Duration::from_millis(50)
    } else {
        Duration::from_millis(300)
    }
});
static THREAD_RUN: std::sync::LazyLock<Duration> = std::sync::LazyLock::new(|| {
    if common::bench_smoke() {
        Duration::from_millis(200)
    } else {
        Duration::from_secs(2)
    }
});
/// quorumlock's default, stated for the report.
const NODE_TIMEOUT: Duration = Duration::from_millis(50);
const SLOW_DELAY: Duration = Duration::from_millis(45);
const PAUSE: Duration = Duration::from_secs(60);
const TOKEN: &str = "0123456789abcdef0123456789abcdef";

/// quorumlock's own scripts: `src/driver/scripts/` itself, compiled into
/// this bench, so that the floor sends exactly what the crate sends (also
/// checked at run time: their SHA1s must be in the nodes' script cache
/// after quorumlock has used them). The two constants it takes from the
/// crate are given here under the paths it names them by.
#[path = "../../src/driver/scripts/mod.rs"]
#[allow(dead_code, unused_imports)]
mod scripts;

mod algorithm {
    pub(crate) mod round {
        pub(crate) use crate::META_KEY;
        /// As `quorumlock`'s (`src/algorithm/round.rs`).
        pub(crate) const FENCE_LIMIT: u64 = (1 << 53) - 1;
    }
}

/// The classic one-key compare-and-delete.
const UNLOCK_LUA: &str =
    "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end";

pub(crate) const META_KEY: &str = "quorumlock:meta";

// ---------------------------------------------------------------------------
// samples

/// One lock+unlock cycle's outcome: `Ok(time of the lock step)`.
type Cycle = Result<Duration, String>;

/// Cycle times and failures of one variant.
#[derive(Default)]
struct Run {
    /// Whole cycles.
    lat: Vec<Duration>,
    /// The lock step and the unlock step of the successful cycles.
    acquire: Vec<Duration>,
    release: Vec<Duration>,
    failures: usize,
    first_error: Option<String>,
}

impl Run {
    fn record(&mut self, took: Duration, r: Cycle) {
        self.lat.push(took);
        match r {
            Ok(acquire) => {
                self.acquire.push(acquire);
                self.release.push(took.saturating_sub(acquire));
            }
            Err(e) => {
                self.failures += 1;
                self.first_error.get_or_insert(e);
            }
        }
    }

    fn stats(&self) -> Stats {
        Stats::of(&self.lat)
    }
}

#[derive(Default, Clone, Copy)]
struct Stats {
    n: usize,
    p50: Duration,
    p99: Duration,
    max: Duration,
}

impl Stats {
    fn of(samples: &[Duration]) -> Stats {
        let mut v = samples.to_vec();
        v.sort_unstable();
        if v.is_empty() {
            return Stats::default();
        }
        let at = |q: f64| v[((v.len() as f64 - 1.0) * q).round() as usize];
        Stats {
            n: v.len(),
            p50: at(0.5),
            p99: at(0.99),
            max: at(1.0),
        }
    }
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// `n` timed cycles of `cycle` on keys `nl:{tag}:{i}`.
fn series(run: &mut Run, n: usize, tag: &str, mut cycle: impl FnMut(&str) -> Cycle) {
    for i in 0..n {
        let key = format!("nl:{tag}:{i}");
        let t = Instant::now();
        let r = cycle(&key);
        run.record(t.elapsed(), r);
    }
}

// ---------------------------------------------------------------------------
// the clients

fn client(urls: &[String]) -> Redlock {
    Redlock::builder()
        .fresh_cluster(true)
        .nodes(urls.iter().cloned())
        .build()
        .expect("client")
}

/// One quorumlock cycle: `try_lock`, then `release`.
fn ql_cycle(locks: &Redlock, key: &str) -> Cycle {
    let t = Instant::now();
    let guard = locks.try_lock(key, TTL).map_err(|e| format!("lock: {e}"))?;
    let acquire = t.elapsed();
    guard.release().map_err(|e| format!("release: {e}"))?;
    Ok(acquire)
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Wire {
    /// `SET NX PX`, one-key compare-and-delete.
    Set,
    /// quorumlock's acquire and release scripts.
    Script,
}

/// The hand-written floor: one blocking connection per node; each step sends
/// to every node, then reads the replies in node order.
struct Floor {
    conns: Vec<redis::Connection>,
    wire: Wire,
    quorum: usize,
    acquire: redis::Script,
    release: redis::Script,
    unlock: redis::Script,
}

impl Floor {
    fn connect(urls: &[String], wire: Wire) -> Floor {
        let conns: Vec<redis::Connection> = urls
            .iter()
            .map(|url| {
                let info = redis::IntoConnectionInfo::into_connection_info(url.as_str())
                    .expect("url")
                    .set_tcp_settings(redis::io::tcp::TcpSettings::default().set_nodelay(true));
                let settings = info.redis_settings().clone().set_skip_set_lib_name();
                let client =
                    redis::Client::open(info.set_redis_settings(settings)).expect("client");
                let conn = client
                    .get_connection_with_timeout(Duration::from_secs(1))
                    .expect("connect");
                // A safety net only: the floor runs on healthy nodes.
                conn.set_read_timeout(Some(Duration::from_secs(1)))
                    .expect("timeout");
                conn
            })
            .collect();
        let mut floor = Floor {
            quorum: conns.len() / 2 + 1,
            conns,
            wire,
            acquire: redis::Script::new(scripts::ACQUIRE_LUA),
            release: redis::Script::new(scripts::RELEASE_LUA),
            unlock: redis::Script::new(UNLOCK_LUA),
        };
        for c in floor.conns.iter_mut() {
            for s in [&floor.acquire, &floor.release, &floor.unlock] {
                let _: String = s.prepare_invoke().load(c).expect("SCRIPT LOAD");
            }
        }
        floor
    }

    fn cycle(&mut self, key: &str) -> Cycle {
        let t = Instant::now();
        let ttl = TTL.as_millis() as u64;
        let (set, del) = match self.wire {
            Wire::Set => (
                redis::cmd("SET")
                    .arg(key)
                    .arg(TOKEN)
                    .arg("NX")
                    .arg("PX")
                    .arg(ttl)
                    .get_packed_command(),
                redis::cmd("EVALSHA")
                    .arg(self.unlock.get_hash())
                    .arg(1)
                    .arg(key)
                    .arg(TOKEN)
                    .get_packed_command(),
            ),
            Wire::Script => (
                redis::cmd("EVALSHA")
                    .arg(self.acquire.get_hash())
                    .arg(2)
                    .arg(key)
                    .arg(META_KEY)
                    .arg(ttl)
                    .arg(ttl)
                    .arg(0) // unfenced, no writer's intent
                    .arg(TOKEN)
                    .get_packed_command(),
                redis::cmd("EVALSHA")
                    .arg(self.release.get_hash())
                    .arg(1)
                    .arg(key)
                    .arg(0)
                    .arg(TOKEN)
                    .get_packed_command(),
            ),
        };
        for c in self.conns.iter_mut() {
            c.send_packed_command(&set).map_err(|e| e.to_string())?;
        }
        let mut ok = 0;
        for c in self.conns.iter_mut() {
            let v = c.recv_response().map_err(|e| e.to_string())?;
            let set = match (self.wire, &v) {
                (Wire::Set, Value::Okay) => true,
                // The node's history (5 fields, see `ACQUIRE_LUA`), then the key's answer.
                (Wire::Script, Value::Array(items)) => items.get(5) == Some(&Value::Int(1)),
                _ => false,
            };
            ok += usize::from(set);
        }
        let acquire = t.elapsed();
        for c in self.conns.iter_mut() {
            c.send_packed_command(&del).map_err(|e| e.to_string())?;
        }
        for c in self.conns.iter_mut() {
            c.recv_response().map_err(|e| e.to_string())?;
        }
        if ok >= self.quorum {
            Ok(acquire)
        } else {
            Err(format!("{ok} of {} nodes set", self.conns.len()))
        }
    }
}

/// Whether every node has `script` cached (quorumlock loads its scripts
/// with EVAL on NOSCRIPT, so this says our copy matches the crate's).
fn cached_everywhere(c: &Cluster, script: &str) -> bool {
    let sha = redis::Script::new(script).get_hash().to_owned();
    (0..c.len()).all(|i| {
        let found: Vec<bool> = redis::cmd("SCRIPT")
            .arg("EXISTS")
            .arg(&sha)
            .query(&mut c.conn(i))
            .unwrap_or_default();
        found == [true]
    })
}

// ---------------------------------------------------------------------------
// many threads

/// A many-thread run: the measured window, and CPU over the whole run.
struct Threaded {
    run: Run,
    ok: usize,
    warm_cycles: usize,
    warm_failures: usize,
    per_sec: f64,
    /// CPU time of this process (client, harness, background threads) and
    /// of the 5 redis-servers, per cycle (warm-up included).
    client_cpu: Duration,
    server_cpu: Duration,
    /// The nodes' reads (`total_reads_processed`) and commands
    /// (`total_commands_processed`, a script's own commands included) per
    /// cycle, all nodes together.
    reads: f64,
    commands: f64,
}

/// One worker's record: time and outcome of each cycle started inside the
/// measured window; cycles and failures during the warm-up.
#[derive(Default)]
struct Records {
    cycles: Vec<(Duration, Cycle)>,
    warm_cycles: usize,
    warm_failures: usize,
}

fn sum_up(records: Vec<Records>) -> Threaded {
    let mut run = Run::default();
    let mut ok = 0;
    let (mut warm_cycles, mut warm_failures) = (0, 0);
    for r in records {
        warm_cycles += r.warm_cycles;
        warm_failures += r.warm_failures;
        for (took, r) in r.cycles {
            ok += usize::from(r.is_ok());
            run.record(took, r);
        }
    }
    Threaded {
        run,
        ok,
        warm_cycles,
        warm_failures,
        per_sec: ok as f64 / THREAD_RUN.as_secs_f64(),
        client_cpu: Duration::ZERO,
        server_cpu: Duration::ZERO,
        reads: 0.0,
        commands: 0.0,
    }
}

/// CPU time used so far by this process (all its threads, live or ended).
fn process_cpu() -> Duration {
    // Fields 14 and 15 of /proc/self/stat: utime, stime in clock ticks
    // (USER_HZ, 100 on Linux).
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let after = stat.rfind(')').map_or("", |i| &stat[i + 1..]);
    let ticks: u64 = after
        .split_whitespace()
        .skip(11)
        .take(2)
        .filter_map(|f| f.parse::<u64>().ok())
        .sum();
    Duration::from_millis(ticks * 10)
}

/// CPU time used so far by all the nodes (`INFO cpu`).
fn servers_cpu(c: &Cluster) -> Duration {
    (0..c.len())
        .map(|i| {
            let info: String = redis::cmd("INFO")
                .arg("cpu")
                .query(&mut c.conn(i))
                .unwrap_or_default();
            let secs: f64 = info
                .lines()
                .filter(|l| l.starts_with("used_cpu_sys:") || l.starts_with("used_cpu_user:"))
                .filter_map(|l| l.split(':').nth(1)?.trim().parse::<f64>().ok())
                .sum();
            Duration::from_secs_f64(secs)
        })
        .sum()
}

/// What all the nodes read and ran so far (`INFO stats`): reads, commands.
fn servers_io(c: &Cluster) -> (u64, u64) {
    (0..c.len())
        .map(|i| {
            (
                info_number(c, i, "stats", "total_reads_processed"),
                info_number(c, i, "stats", "total_commands_processed"),
            )
        })
        .fold((0, 0), |(r, n), (a, b)| (r + a, n + b))
}

/// Connections node `i` has accepted so far (`INFO stats`), not counting
/// the one this asks on.
fn conns_received(c: &Cluster, i: usize) -> u64 {
    info_number(c, i, "stats", "total_connections_received")
}

/// `field` of node `i`'s `INFO section`, less the one connection asking.
fn info_number(c: &Cluster, i: usize, section: &str, field: &str) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg(section)
        .query(&mut c.conn(i))
        .unwrap_or_default();
    info.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map_or(0, |v| v.saturating_sub(1))
}

/// Clients connected to node `i` now, less the one asking.
fn clients_now(c: &Cluster, i: usize) -> u64 {
    info_number(c, i, "clients", "connected_clients")
}

/// Keys matching `pattern` on each node.
fn left_behind(c: &Cluster, pattern: &str) -> Vec<usize> {
    (0..c.len())
        .map(|i| {
            let keys: Vec<String> = redis::cmd("KEYS")
                .arg(pattern)
                .query(&mut c.conn(i))
                .unwrap_or_default();
            keys.len()
        })
        .collect()
}

/// Note: lock keys still on the nodes a while after the run (and the fault)
/// ended, with the client still alive to retry its releases.
fn leftover_note(t: &mut Table, name: &str, c: &Cluster, pattern: &str, after: Duration) {
    std::thread::sleep(after);
    t.verdict(format!(
        "{name}: keys {pattern} still on nodes 0..{} {after:?} later: {:?}",
        c.len() - 1,
        left_behind(c, pattern)
    ));
}

/// When keys matching `pattern` are still on some node although every
/// release returned: shows a few with their PTTL, then looks again after a
/// pause (nothing done), and after a burst of 32-thread cycles with the same
/// client (its pooled connections used again).
fn leftover_probe(t: &mut Table, c: &Cluster, pattern: &str, locks: &Redlock) {
    let Some(node) = left_behind(c, pattern).iter().position(|&n| n > 0) else {
        return;
    };
    let mut conn = c.conn(node);
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(pattern)
        .query(&mut conn)
        .unwrap_or_default();
    let shown: Vec<String> = keys
        .iter()
        .take(3)
        .map(|k| {
            let pttl: i64 = redis::cmd("PTTL").arg(k).query(&mut conn).unwrap_or(-3);
            format!("{k} (pttl {pttl} ms)")
        })
        .collect();
    t.verdict(format!(
        "  leftover probe, node {node}: {} keys, e.g. {}",
        keys.len(),
        shown.join(", ")
    ));
    std::thread::sleep(Duration::from_secs(2));
    t.verdict(format!(
        "  leftover probe: 2 s later, client idle: {:?}",
        left_behind(c, pattern)
    ));
    let started = Instant::now();
    std::thread::scope(|s| {
        for th in 0..THREADS {
            s.spawn(move || {
                let mut i = 0;
                while started.elapsed() < Duration::from_millis(300) {
                    let _ = ql_cycle(locks, &format!("nl:probe:{th}:{i}"));
                    i += 1;
                }
            });
        }
    });
    std::thread::sleep(Duration::from_millis(200));
    t.verdict(format!(
        "  leftover probe: after 300 ms more of 32-thread cycles on the same client: {:?} (probe keys: {:?})",
        left_behind(c, pattern),
        left_behind(c, "nl:probe:*")
    ));
}

/// Note: connections the client opened to the sick node and to a healthy
/// one while `cycles` ran.
fn churn_note(t: &mut Table, name: &str, sick: u64, healthy: u64, cycles: usize) {
    t.verdict(format!(
        "{name}: connections opened during the {cycles} timed cycles: sick node {sick}, a healthy node {healthy}"
    ));
}

/// CPU charged to one variant of a single-thread scenario.
#[derive(Default)]
struct CpuUse {
    reads: u64,
    commands: u64,
    client: Duration,
    server: Duration,
    cycles: u32,
}

impl CpuUse {
    /// Runs `f` (`cycles` cycles) and charges it the CPU used meanwhile.
    fn charge<T>(&mut self, c: &Cluster, cycles: usize, f: impl FnOnce() -> T) -> T {
        let (client0, server0, io0) = (process_cpu(), servers_cpu(c), servers_io(c));
        let out = f();
        self.client += process_cpu().saturating_sub(client0);
        self.server += servers_cpu(c).saturating_sub(server0);
        let io = servers_io(c);
        self.reads += io.0.saturating_sub(io0.0);
        self.commands += io.1.saturating_sub(io0.1);
        self.cycles += cycles as u32;
        out
    }

    fn per_cycle(&self) -> (Duration, Duration) {
        let n = self.cycles.max(1);
        (self.client / n, self.server / n)
    }
}

/// Runs `f` and charges it the CPU this process and the nodes used.
fn with_cpu(c: &Cluster, f: impl FnOnce() -> Threaded) -> Threaded {
    let (client0, server0, io0) = (process_cpu(), servers_cpu(c), servers_io(c));
    let mut r = f();
    let cycles = (r.warm_cycles + r.run.lat.len()).max(1) as u32;
    r.client_cpu = process_cpu().saturating_sub(client0) / cycles;
    r.server_cpu = servers_cpu(c).saturating_sub(server0) / cycles;
    let io = servers_io(c);
    r.reads = io.0.saturating_sub(io0.0) as f64 / f64::from(cycles);
    r.commands = io.1.saturating_sub(io0.1) as f64 / f64::from(cycles);
    r
}

/// One worker's loop: cycles until warm-up + run are over, keeping those
/// started after the warm-up.
fn work_loop(start: Instant, tag: &str, t: usize, mut cycle: impl FnMut(&str) -> Cycle) -> Records {
    let mut out = Records::default();
    let mut i = 0usize;
    loop {
        let key = format!("nl:mt:{tag}:{t}:{i}");
        i += 1;
        let t0 = Instant::now();
        let since = t0.saturating_duration_since(start);
        if since >= *THREAD_WARM + *THREAD_RUN {
            break;
        }
        let r = cycle(&key);
        let took = t0.elapsed();
        if since < *THREAD_WARM {
            out.warm_cycles += 1;
            out.warm_failures += usize::from(r.is_err());
        } else {
            out.cycles.push((took, r));
        }
    }
    out
}

/// `THREADS` OS threads; each builds its worker with `make` (connections
/// and all) before the common start.
fn threaded<W>(tag: &str, make: impl Fn() -> W + Sync) -> Threaded
where
    W: FnMut(&str) -> Cycle,
{
    let barrier = Barrier::new(THREADS);
    let start: OnceLock<Instant> = OnceLock::new();
    let records: Vec<Records> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..THREADS)
            .map(|t| {
                let (barrier, start, make) = (&barrier, &start, &make);
                s.spawn(move || {
                    let cycle = make();
                    barrier.wait();
                    let start = *start.get_or_init(Instant::now);
                    work_loop(start, tag, t, cycle)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("worker panicked"))
            .collect()
    });
    sum_up(records)
}

/// `rslock` 0.10 on one thread: a current-thread runtime that blocks on
/// each lock and unlock, as a blocking caller would use it.
struct RslockOne {
    rt: tokio::runtime::Runtime,
    manager: rslock::LockManager,
}

impl RslockOne {
    fn connect(urls: &[String]) -> RslockOne {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let mut manager = rslock::LockManager::new(urls.to_vec());
        manager.set_retry(1, Duration::from_millis(1));
        RslockOne { rt, manager }
    }

    fn cycle(&mut self, key: &str) -> Cycle {
        let t = Instant::now();
        let m = &self.manager;
        self.rt.block_on(async {
            let l = m.lock(key, TTL).await.map_err(|e| format!("lock: {e:?}"))?;
            let acquire = t.elapsed();
            m.unlock(&l).await;
            Ok(acquire)
        })
    }
}

/// `THREADS` tokio tasks on a multi-thread runtime (one worker per core),
/// sharing one `rslock::LockManager` with no retry.
fn rslock_tasks(urls: &[String]) -> Threaded {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let mut manager = rslock::LockManager::new(urls.to_vec());
        manager.set_retry(1, Duration::from_millis(1));
        // Connect every node (rslock connects lazily) outside the window.
        for i in 0..20 {
            if let Ok(l) = manager.lock(format!("nl:rs:warm:{i}").as_str(), TTL).await {
                manager.unlock(&l).await;
            }
        }
        let start = Instant::now();
        let tasks: Vec<_> = (0..THREADS)
            .map(|t| {
                let manager = manager.clone();
                tokio::spawn(async move {
                    let mut out = Records::default();
                    let mut i = 0usize;
                    loop {
                        let key = format!("nl:mt:rslock:{t}:{i}");
                        i += 1;
                        let t0 = Instant::now();
                        let since = t0.saturating_duration_since(start);
                        if since >= *THREAD_WARM + *THREAD_RUN {
                            break;
                        }
                        let r = match manager.lock(key.as_str(), TTL).await {
                            // rslock's unlock reports nothing.
                            Ok(l) => {
                                let acquire = t0.elapsed();
                                manager.unlock(&l).await;
                                Ok(acquire)
                            }
                            Err(e) => Err(format!("lock: {e:?}")),
                        };
                        let took = t0.elapsed();
                        if since < *THREAD_WARM {
                            out.warm_cycles += 1;
                            out.warm_failures += usize::from(r.is_err());
                        } else {
                            out.cycles.push((took, r));
                        }
                    }
                    out
                })
            })
            .collect();
        let mut records = Vec::with_capacity(THREADS);
        for t in tasks {
            records.push(t.await.expect("task panicked"));
        }
        sum_up(records)
    })
}

// ---------------------------------------------------------------------------
// report

struct Table {
    rows: Vec<String>,
    notes: Vec<String>,
}

/// Column heads of [`Table::row`].
const HEADS: [&str; 12] = [
    "p50", "p99", "max", "lock p50", "unlk p50", "vs hlth", "fails", "cycles/s", "cpu cli",
    "cpu srv", "srv rd", "srv cmd",
];

impl Table {
    /// One line: the run's figures, then `extra` (ratio, throughput, CPU).
    /// Per cycle: CPU in us, the nodes' reads and commands (all nodes).
    fn row(&mut self, name: &str, run: &Run, extra: [String; 6], goal: &str) {
        let s = run.stats();
        let (a, r) = (Stats::of(&run.acquire), Stats::of(&run.release));
        let [ratio, rate, cli, srv, rd, cmd] = extra;
        self.rows.push(format!(
            "{name:<34} {:>8.1} {:>8.1} {:>9.1} {:>8.1} {:>8.1} {ratio:>7} {:>6} {rate:>8} {cli:>7} {srv:>7} {rd:>6} {cmd:>7}   {goal}",
            us(s.p50),
            us(s.p99),
            us(s.max),
            us(a.p50),
            us(r.p50),
            run.failures,
        ));
        if let Some(e) = &run.first_error {
            self.notes.push(format!("{name}: first failure: {e}"));
        }
    }

    fn single(&mut self, name: &str, run: &Run, healthy: Option<Duration>, goal: &str) {
        let ratio = healthy
            .map(|h| format!("{:.2}x", run.stats().p50.as_secs_f64() / h.as_secs_f64()))
            .unwrap_or_else(|| "-".into());
        let dash = || "-".to_string();
        self.row(
            name,
            run,
            [ratio, dash(), dash(), dash(), dash(), dash()],
            goal,
        );
    }

    fn single_cpu(&mut self, name: &str, run: &Run, cpu: &CpuUse, goal: &str) {
        let (cli, srv) = cpu.per_cycle();
        let n = f64::from(cpu.cycles.max(1));
        let extra = [
            "-".into(),
            "-".into(),
            format!("{:.1}", us(cli)),
            format!("{:.1}", us(srv)),
            format!("{:.2}", cpu.reads as f64 / n),
            format!("{:.1}", cpu.commands as f64 / n),
        ];
        self.row(name, run, extra, goal);
    }

    fn threaded(&mut self, name: &str, r: &Threaded, goal: &str) {
        self.row(
            name,
            &r.run,
            [
                "-".into(),
                format!("{:.0}", r.per_sec),
                format!("{:.1}", us(r.client_cpu)),
                format!("{:.1}", us(r.server_cpu)),
                format!("{:.2}", r.reads),
                format!("{:.1}", r.commands),
            ],
            goal,
        );
        self.notes.push(format!(
            "{name}: {} cycles in {:?} ({} ok); warm-up {} cycles, {} failures",
            r.run.lat.len(),
            *THREAD_RUN,
            r.ok,
            r.warm_cycles,
            r.warm_failures
        ));
    }

    fn verdict(&mut self, line: String) {
        self.notes.push(line);
    }
}

fn verdict(pass: bool) -> &'static str {
    if pass {
        "met"
    } else {
        "MISSED"
    }
}

/// Goals of a one-sick-node scenario: p50 ≤ 1.5× healthy, p99 ≤ 5 ms, max
/// under the node timeout.
fn sick_verdict(t: &mut Table, name: &str, run: &Run, healthy: Option<Duration>) {
    let s = run.stats();
    let ratio = healthy.map(|h| s.p50.as_secs_f64() / h.as_secs_f64());
    t.verdict(format!(
        "{name}: p50 {} x healthy ({}), p99 {:.2} ms ({}), max {:.2} ms vs node timeout {:?} ({}), failures {} ({})",
        ratio.map_or("?".into(), |r| format!("{r:.2}")),
        ratio.map_or("?", |r| verdict(r <= 1.5)),
        us(s.p99) / 1e3,
        verdict(s.p99 <= Duration::from_millis(5)),
        us(s.max) / 1e3,
        NODE_TIMEOUT,
        verdict(s.max < NODE_TIMEOUT),
        run.failures,
        verdict(run.failures == 0),
    ));
}

fn first_note(t: &mut Table, name: &str, first: &Run, what: &str) {
    let s = first.stats();
    t.verdict(format!(
        "{name}: first {} cycles {what}: max {:.2} ms, failures {}{}",
        s.n,
        us(s.max) / 1e3,
        first.failures,
        first
            .first_error
            .as_ref()
            .map(|e| format!(" (first: {e})"))
            .unwrap_or_default()
    ));
}

/// quorumlock's log records on stderr, with the time since start, when
/// `NODE_LAYER_LOG` names a level (`info`, `debug`, ...).
struct StderrLog {
    start: Instant,
}

impl log::Log for StderrLog {
    fn enabled(&self, m: &log::Metadata<'_>) -> bool {
        m.target().starts_with("quorumlock")
    }

    fn log(&self, r: &log::Record<'_>) {
        if self.enabled(r.metadata()) {
            eprintln!(
                "{:>10.3} ms {:<5} {}",
                self.start.elapsed().as_secs_f64() * 1e3,
                r.level(),
                r.args()
            );
        }
    }

    fn flush(&self) {}
}

fn init_log() {
    let Ok(level) = std::env::var("NODE_LAYER_LOG") else {
        return;
    };
    let Ok(level) = level.parse::<log::LevelFilter>() else {
        eprintln!("NODE_LAYER_LOG={level:?}: not a log level");
        return;
    };
    static LOG: OnceLock<StderrLog> = OnceLock::new();
    let logger = LOG.get_or_init(|| StderrLog {
        start: Instant::now(),
    });
    if log::set_logger(logger).is_ok() {
        log::set_max_level(level);
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if !args.iter().any(|a| a == "--bench") {
        eprintln!("node_layer: a benchmark; run it with `cargo bench --bench node_layer`");
        return;
    }
    init_log();
    let filters: Vec<&String> = args.iter().filter(|a| !a.starts_with("--")).collect();
    let wanted =
        |name: &str| filters.is_empty() || filters.iter().any(|f| name.contains(f.as_str()));

    let c = Cluster::start(*NODES);
    let urls = c.urls();
    eprintln!("{} nodes on the {:?} backend", *NODES, c.backend());
    let mut t = Table {
        rows: Vec::new(),
        notes: Vec::new(),
    };
    let mut healthy: Option<Duration> = None;

    // 1. Healthy: quorumlock and the two floors, in turns.
    if wanted("healthy") {
        log::info!(target: "quorumlock::bench", "scenario 1 healthy");
        let locks = client(&urls);
        let mut warm = Run::default();
        series(&mut warm, *WARM, "h:ql:warm", |k| ql_cycle(&locks, k));
        let same = cached_everywhere(&c, scripts::ACQUIRE_LUA)
            && cached_everywhere(&c, scripts::RELEASE_LUA);
        let mut set_floor = Floor::connect(&urls, Wire::Set);
        let mut script_floor = Floor::connect(&urls, Wire::Script);
        let mut rs = RslockOne::connect(&urls);
        series(&mut warm, *WARM, "h:set:warm", |k| set_floor.cycle(k));
        series(&mut warm, *WARM, "h:scr:warm", |k| script_floor.cycle(k));
        series(&mut warm, *WARM, "h:rs:warm", |k| rs.cycle(k));
        let (mut ql, mut set, mut script) = (Run::default(), Run::default(), Run::default());
        let (mut ql_cpu, mut set_cpu, mut script_cpu) =
            (CpuUse::default(), CpuUse::default(), CpuUse::default());
        let (mut rsl, mut rs_cpu) = (Run::default(), CpuUse::default());
        for turn in 0..*CYCLES / *TURN {
            ql_cpu.charge(&c, *TURN, || {
                series(&mut ql, *TURN, &format!("h:ql:{turn}"), |k| {
                    ql_cycle(&locks, k)
                })
            });
            set_cpu.charge(&c, *TURN, || {
                series(&mut set, *TURN, &format!("h:set:{turn}"), |k| {
                    set_floor.cycle(k)
                })
            });
            script_cpu.charge(&c, *TURN, || {
                series(&mut script, *TURN, &format!("h:scr:{turn}"), |k| {
                    script_floor.cycle(k)
                })
            });
            rs_cpu.charge(&c, *TURN, || {
                series(&mut rsl, *TURN, &format!("h:rs:{turn}"), |k| rs.cycle(k))
            });
        }
        leftover_note(
            &mut t,
            "1 healthy",
            &c,
            "nl:h:ql:*",
            Duration::from_millis(500),
        );
        let (q, f, g, rq) = (ql.stats(), set.stats(), script.stats(), rsl.stats());
        healthy = Some(q.p50);
        t.single_cpu("1 healthy: floor SET NX PX", &set, &set_cpu, "");
        t.single_cpu(
            "1 healthy: floor quorumlock script",
            &script,
            &script_cpu,
            "",
        );
        t.single_cpu("1 healthy: rslock 0.10 (one thread)", &rsl, &rs_cpu, "");
        t.single_cpu(
            "1 healthy: quorumlock",
            &ql,
            &ql_cpu,
            "p50 <= 1.1x floor SET",
        );
        let r = q.p50.as_secs_f64() / f.p50.as_secs_f64();
        t.verdict(format!(
            "1 healthy: quorumlock / floor SET p50 = {r:.2}x ({}); / rslock (one thread) = {:.2}x; / floor script = {:.2}x; floor script / floor SET = {:.2}x; p99 ratio vs floor SET {:.2}x; warm-up failures {}",
            verdict(r <= 1.1),
            q.p50.as_secs_f64() / rq.p50.as_secs_f64(),
            q.p50.as_secs_f64() / g.p50.as_secs_f64(),
            g.p50.as_secs_f64() / f.p50.as_secs_f64(),
            q.p99.as_secs_f64() / f.p99.as_secs_f64(),
            warm.failures,
        ));
        if !same {
            t.verdict(
                "1 healthy: WARNING: the floor's copy of the scripts is not what quorumlock sent (SHA1 not cached)"
                    .into(),
            );
        }
    }

    // 2. One node hung from client start: 4 real nodes and a black hole.
    if wanted("hung") {
        log::info!(target: "quorumlock::bench", "scenario 2 hung");
        let hole = Blackhole::start();
        let mut list = urls[..*NODES - 1].to_vec();
        list.push(hole.url());
        let locks = client(&list);
        let mut first = Run::default();
        series(&mut first, FIRST, "hung:first", |k| ql_cycle(&locks, k));
        let mut warm = Run::default();
        series(&mut warm, *WARM, "hung:warm", |k| ql_cycle(&locks, k));
        let mut run = Run::default();
        series(&mut run, *CYCLES, "hung", |k| ql_cycle(&locks, k));
        t.single(
            "2 one hung from start",
            &run,
            healthy,
            "p50<=1.5x, p99<=5ms",
        );
        sick_verdict(&mut t, "2 one hung from start", &run, healthy);
        first_note(&mut t, "2 one hung from start", &first, "from client start");
        leftover_note(
            &mut t,
            "2 one hung from start",
            &c,
            "nl:hung:*",
            Duration::from_secs(1),
        );
        drop(locks);
    }

    // 3. One node write-paused after warm-up.
    if wanted("paused") {
        log::info!(target: "quorumlock::bench", "scenario 3 paused");
        let locks = client(&urls);
        let mut warm = Run::default();
        series(&mut warm, *WARM, "wp:warm", |k| ql_cycle(&locks, k));
        pause_writes(&c, *NODES - 1, PAUSE);
        let mut first = Run::default();
        series(&mut first, FIRST, "wp:first", |k| ql_cycle(&locks, k));
        let conns0 = (conns_received(&c, *NODES - 1), conns_received(&c, 0));
        let mut run = Run::default();
        series(&mut run, *CYCLES, "wp", |k| ql_cycle(&locks, k));
        let conns1 = (conns_received(&c, *NODES - 1), conns_received(&c, 0));
        unpause_writes(&c, *NODES - 1);
        t.single("3 one write-paused", &run, healthy, "p50<=1.5x, p99<=5ms");
        sick_verdict(&mut t, "3 one write-paused", &run, healthy);
        first_note(&mut t, "3 one write-paused", &first, "after the pause");
        churn_note(
            &mut t,
            "3 one write-paused",
            (conns1.0 - conns0.0).saturating_sub(1),
            (conns1.1 - conns0.1).saturating_sub(1),
            *CYCLES,
        );
        // The node works off what the pause held; the client retries its
        // releases meanwhile.
        leftover_note(
            &mut t,
            "3 one write-paused",
            &c,
            "nl:wp*",
            Duration::from_secs(1),
        );
        leftover_probe(&mut t, &c, "nl:wp*", &locks);
        drop(locks);
    }

    // 4. One node slow: its replies 45 ms late.
    if wanted("slow") {
        log::info!(target: "quorumlock::bench", "scenario 4 slow");
        let proxy = DelayProxy::start(&urls[*NODES - 1], SLOW_DELAY);
        let mut list = urls[..*NODES - 1].to_vec();
        list.push(proxy.url());
        let locks = client(&list);
        let mut first = Run::default();
        series(&mut first, FIRST, "slow:first", |k| ql_cycle(&locks, k));
        let mut warm = Run::default();
        series(&mut warm, *WARM, "slow:warm", |k| ql_cycle(&locks, k));
        let conns0 = (conns_received(&c, *NODES - 1), conns_received(&c, 0));
        let mut run = Run::default();
        series(&mut run, *CYCLES, "slow", |k| ql_cycle(&locks, k));
        let conns1 = (conns_received(&c, *NODES - 1), conns_received(&c, 0));
        t.single("4 one slow (+45 ms)", &run, healthy, "p50<=1.5x, p99<=5ms");
        sick_verdict(&mut t, "4 one slow (+45 ms)", &run, healthy);
        first_note(&mut t, "4 one slow (+45 ms)", &first, "from client start");
        churn_note(
            &mut t,
            "4 one slow (+45 ms)",
            (conns1.0 - conns0.0).saturating_sub(1),
            (conns1.1 - conns0.1).saturating_sub(1),
            *CYCLES,
        );
        leftover_note(
            &mut t,
            "4 one slow (+45 ms)",
            &c,
            "nl:slow*",
            Duration::from_secs(1),
        );
        drop(locks);
    }

    // 5. 32 threads × 2 s on healthy nodes.
    if wanted("threads") {
        log::info!(target: "quorumlock::bench", "scenario 5 threads");
        let locks = client(&urls);
        let mut warm = Run::default();
        series(&mut warm, *WARM, "mt:ql:warm", |k| ql_cycle(&locks, k));
        let ql = with_cpu(&c, || {
            threaded("ql", || {
                let locks = locks.clone();
                move |k: &str| ql_cycle(&locks, k)
            })
        });
        // The client's connections to node 0 after the run (its pools keep
        // what the 32 threads needed).
        let sockets = clients_now(&c, 0);
        leftover_note(
            &mut t,
            "5 32 threads: quorumlock",
            &c,
            "nl:mt:ql:*",
            Duration::from_millis(500),
        );
        leftover_probe(&mut t, &c, "nl:mt:ql:*", &locks);
        drop(locks);
        t.verdict(format!(
            "5 32 threads: quorumlock holds {sockets} connections per node after the run ({THREADS} threads)"
        ));
        let rs = with_cpu(&c, || rslock_tasks(&urls));
        let setf = with_cpu(&c, || {
            threaded("set", || {
                let mut f = Floor::connect(&urls, Wire::Set);
                move |k: &str| f.cycle(k)
            })
        });
        let scrf = with_cpu(&c, || {
            threaded("scr", || {
                let mut f = Floor::connect(&urls, Wire::Script);
                move |k: &str| f.cycle(k)
            })
        });
        t.threaded(
            "5 32 threads: quorumlock",
            &ql,
            "0 failures, ahead of rslock",
        );
        t.threaded("5 32 tasks: rslock 0.10", &rs, "");
        t.threaded("5 32 threads: floor SET NX PX", &setf, "");
        t.threaded("5 32 threads: floor script", &scrf, "");
        t.verdict(format!(
            "5 32 threads: quorumlock {:.0}/s vs rslock {:.0}/s = {:.2}x ({}), vs floor SET {:.2}x, vs floor script {:.2}x; quorumlock failures {} ({})",
            ql.per_sec,
            rs.per_sec,
            ql.per_sec / rs.per_sec.max(f64::MIN_POSITIVE),
            verdict(ql.per_sec > rs.per_sec),
            ql.per_sec / setf.per_sec.max(f64::MIN_POSITIVE),
            ql.per_sec / scrf.per_sec.max(f64::MIN_POSITIVE),
            ql.run.failures,
            verdict(ql.run.failures == 0 && ql.warm_failures == 0),
        ));
    }

    let (cycles, warm) = (*CYCLES, *WARM);
    println!(
        "\nnode layer, {} local nodes ({:?} backend), node timeout {NODE_TIMEOUT:?}, TTL {TTL:?}; single-thread rows: {cycles} lock+unlock cycles after {warm} warm-up; times in us",
        *NODES,
        c.backend()
    );
    let h = HEADS;
    println!(
        "  {:<34} {:>8} {:>8} {:>9} {:>8} {:>8} {:>7} {:>6} {:>8} {:>7} {:>7} {:>6} {:>7}   goal",
        "scenario", h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7], h[8], h[9], h[10], h[11]
    );
    for r in &t.rows {
        println!("  {r}");
    }
    println!();
    for n in &t.notes {
        println!("  {n}");
    }
}
