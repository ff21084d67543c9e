//! Issue 9, fault suite scenario 5: K workers × M fenced increments across
//! 3 processes while lock nodes are killed, restarted and paused on a seeded
//! schedule.
//!
//! The test runs its own binary again as 3 worker processes (the child role
//! is [`fence_worker_child`], which does nothing unless `QL_FENCE_ID` is
//! set). Each runs K threads; each thread makes M critical sections on one
//! resource: lock (fenced), read a counter from a separate, never faulted
//! Redis "store" with its token, write the counter + 1 back with its token
//! and a unique op id, release. Meanwhile the parent stops, restarts (empty)
//! and pauses the 3 lock nodes, one at a time, on a schedule drawn from
//! `FENCE_SEED` (printed). Some sections stall past their TTL (a GC pause,
//! seeded), so stale holders exist with or without node faults. Faults
//! never take a majority away: a restarted node, held back ~2 s by restart
//! protection, is the only one faulted until it votes again (so the
//! delayed-restart hazard itself cannot arise here; degraded.rs tests it).
//!
//! The store (one Lua script) keeps the highest token it has seen. In run 1
//! it refuses a write whose token is below that: the final value must equal
//! the accepted writes (0 lost, 0 applied twice) and some stale writes must
//! have been refused. Run 2 (same seed, new key) switches that check off,
//! and must lose updates: a stalled holder read the counter, its lock
//! expired, others incremented the counter, and its late write puts an old
//! value + 1 back. That run shows that the test can fail. Both runs also
//! check what the library itself promises (no token shared or going back, no
//! section overtaken while its lock is valid) and print their figures.

use std::collections::BTreeMap;
use std::io::Read;
use std::process::{Child, Command, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use quorumlock::{LockGuard, Redlock};

use crate::common::{unique_key, wait_until, Cluster};

const PROCESSES: u64 = 3;
/// K: worker threads per process.
const THREADS: u64 = 2;
/// M: critical sections per thread.
const SECTIONS: u64 = 20;
/// Sections per thread that stall past their TTL.
const STALLS: u64 = 2;
const TTL: Duration = Duration::from_millis(400);
const NODE_TIMEOUT: Duration = Duration::from_millis(100);
/// How far past the TTL a stalled section sleeps.
const STALL_PAST_TTL: Duration = Duration::from_millis(200);
/// A section overtaken (a higher token seen by the store) while its lock
/// had this much validity left overlapped another one: a library bug.
const MARGIN: Duration = Duration::from_millis(100);
/// How long a restarted node is held back (history younger than the TTL,
/// age capped by uptime in whole seconds): no other node is faulted meanwhile.
const RECOVERY: Duration = Duration::from_millis(2500);
const RUN_LIMIT: Duration = Duration::from_secs(30);
const DEFAULT_SEED: u64 = 0x5EED_F3AC;
/// Figures that must be 0 in both runs: a write applied twice, and what the
/// library promises (no two sections share a token, a thread's tokens grow,
/// no section is overtaken while its lock is valid, fenced locks have a
/// token, a lock is had within 5 s while a majority is up).
const ZERO: [&str; 6] = [
    "doubles",
    "store_dup_tokens",
    "token_regressions",
    "overtaken_while_valid",
    "no_token",
    "skipped_sections",
];

/// Named counts (and `max_*` figures); children print theirs, the parent
/// merges them.
type Tally = BTreeMap<String, u64>;

fn bump(t: &mut Tally, name: &str) {
    *t.entry(name.to_owned()).or_default() += 1;
}

fn merge(into: &mut Tally, from: impl IntoIterator<Item = (String, u64)>) {
    for (k, v) in from {
        let e = into.entry(k.clone()).or_default();
        *e = if k.starts_with("max_") {
            v.max(*e)
        } else {
            *e + v
        };
    }
}

/// SplitMix64: enough randomness for a reproducible schedule.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        (z ^ (z >> 31)) % n
    }

    fn millis(&mut self, lo: u64, hi: u64) -> Duration {
        Duration::from_millis(lo + self.below(hi - lo))
    }
}

/// The protected storage. `read` raises `last` to the token and answers
/// `{value, last before}`. `write` refuses (`0`) a token below `last` when
/// `ARGV[2]` is `1` (else counts it in `stale_applied`), refuses (`-1`) an
/// op id already applied and counts a double, else sets the value (`1`).
/// A read with a token another section read with counts in `dup_tokens`.
const STORE_LUA: &str = r"local st, applied, owners = KEYS[1], KEYS[2], KEYS[3]
local token, op = tonumber(ARGV[3]), ARGV[4]
local last = tonumber(redis.call('HGET', st, 'last')) or 0
if token > last then redis.call('HSET', st, 'last', ARGV[3]) end
if ARGV[1] == 'read' then
  local owner = redis.call('HGET', owners, ARGV[3])
  if owner and owner ~= op then redis.call('HINCRBY', st, 'dup_tokens', 1) end
  redis.call('HSET', owners, ARGV[3], op)
  return {tonumber(redis.call('HGET', st, 'value')) or 0, last}
end
if token < last then
  if ARGV[2] == '1' then
    redis.call('HINCRBY', st, 'rejected', 1)
    return {0, last}
  end
  redis.call('HINCRBY', st, 'stale_applied', 1)
end
if redis.call('SISMEMBER', applied, op) == 1 then
  redis.call('HINCRBY', st, 'doubles', 1)
  return {-1, last}
end
redis.call('HSET', st, 'value', ARGV[5])
redis.call('SADD', applied, op)
redis.call('HINCRBY', st, 'accepted', 1)
return {1, last}";

/// A worker's connection to the store (never faulted: errors are test bugs).
struct Store {
    conn: redis::Connection,
    /// State hash, applied op ids, token owners.
    keys: [String; 3],
    checked: bool,
}

impl Store {
    fn keys(resource: &str) -> [String; 3] {
        ["state", "applied", "owners"].map(|k| format!("{resource}:store:{k}"))
    }

    /// `op` (`read`/`write`) with this token and op id; `value` for a write.
    fn call(&mut self, op: &str, token: u64, op_id: &str, value: i64) -> (i64, u64) {
        let script = redis::Script::new(STORE_LUA);
        let mut inv = script.prepare_invoke();
        for k in &self.keys {
            inv.key(k);
        }
        let check = if self.checked { "1" } else { "0" };
        inv.arg(op).arg(check).arg(token).arg(op_id).arg(value);
        let r: Vec<i64> = inv.invoke(&mut self.conn).expect("store script");
        (r[0], r[1] as u64)
    }
}

/// Locks `key`, retrying any error for up to 5 s; counts errors by kind and
/// keeps the longest call as `max_lock_ms`.
fn acquire(locks: &Redlock, key: &str, tally: &mut Tally) -> Option<LockGuard> {
    let give_up = Instant::now() + Duration::from_secs(5);
    loop {
        let t = Instant::now();
        let r = locks.request(key, TTL).acquire_for(Duration::from_secs(1));
        merge(
            tally,
            [("max_lock_ms".into(), t.elapsed().as_millis() as u64)],
        );
        match r {
            Ok(g) => return Some(g),
            Err(e) => bump(tally, &format!("lock_err_{}", kind(&e))),
        }
        if Instant::now() >= give_up {
            return None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The error's variant name (`Taken`, `NoQuorum`, ...).
fn kind(e: &quorumlock::Error) -> String {
    let debug = format!("{e:?}");
    let name = debug.split(|c: char| !c.is_alphanumeric()).next();
    name.unwrap_or_default().to_owned()
}

/// One worker thread: M critical sections, named `name.i`.
fn worker(locks: &Redlock, mut store: Store, key: &str, name: &str, seed: u64) -> Tally {
    let mut rng = Rng(seed);
    let stalls: Vec<u64> = (0..STALLS).map(|_| 1 + rng.below(SECTIONS - 3)).collect();
    let (mut tally, mut prev) = (Tally::new(), 0);
    for i in 0..SECTIONS {
        let op_id = format!("{name}.{i}");
        let Some(guard) = acquire(locks, key, &mut tally) else {
            bump(&mut tally, "skipped_sections");
            continue;
        };
        let Some(token) = guard.fencing_token() else {
            bump(&mut tally, "no_token");
            continue;
        };
        if token <= prev {
            eprintln!("FENCE_ANOMALY {op_id}: token {token} after {prev}");
            bump(&mut tally, "token_regressions");
        }
        prev = token;
        let held = guard.validity();
        let (value, last) = store.call("read", token, &op_id, 0);
        if token < last && held > MARGIN {
            eprintln!("FENCE_ANOMALY {op_id}: read, token {token} < {last}, {held:?} left");
            bump(&mut tally, "overtaken_while_valid");
        }
        let stalled = stalls.contains(&i);
        if stalled {
            bump(&mut tally, "stalls");
            std::thread::sleep(TTL + STALL_PAST_TTL);
        }
        let held = guard.validity();
        match store.call("write", token, &op_id, value + 1) {
            (1, _) => bump(&mut tally, "accepted"),
            (0, last) => {
                bump(&mut tally, "rejected_stale");
                if held > MARGIN {
                    eprintln!(
                        "FENCE_ANOMALY {op_id}: write, token {token} < {last}, {held:?} left"
                    );
                    bump(&mut tally, "overtaken_while_valid");
                }
            }
            _ => bump(&mut tally, "doubles"),
        }
        if let Err(e) = guard.release() {
            let what = if stalled {
                "stale_release"
            } else {
                "release_err"
            };
            bump(&mut tally, &format!("{what}_{}", kind(&e)));
        }
    }
    tally
}

/// The child role of [`fenced_increments_across_processes_under_node_faults`]:
/// one worker process. Returns at once unless that test set `QL_FENCE_ID`.
#[test]
#[ignore = "child role of fenced_increments_across_processes_under_node_faults"]
fn fence_worker_child() {
    let Ok(id) = std::env::var("QL_FENCE_ID") else {
        return;
    };
    let var = |name: &str| std::env::var(name).unwrap_or_else(|_| panic!("{name} unset"));
    let key = var("QL_FENCE_KEY");
    let seed: u64 = var("QL_FENCE_SEED").parse().expect("seed");
    let locks = Redlock::builder()
        .nodes(var("QL_FENCE_NODES").split(','))
        .fencing(true)
        .restart_protection(true)
        .node_timeout(NODE_TIMEOUT)
        .retry_delay(Duration::from_millis(20))
        .retry_jitter(Duration::from_millis(20))
        .build()
        .expect("valid config");
    let client = redis::Client::open(var("QL_FENCE_STORE")).expect("store url");
    let mut total = Tally::new();
    std::thread::scope(|s| {
        let threads: Vec<_> = (0..THREADS)
            .map(|t| {
                let store = Store {
                    conn: client.get_connection().expect("connect to the store"),
                    keys: Store::keys(&key),
                    checked: var("QL_FENCE_CHECKED") == "1",
                };
                let (name, locks, key) = (format!("p{id}t{t}"), &locks, &key);
                let seed = seed ^ (0x100 + t) ^ (id.parse::<u64>().expect("id") << 16);
                s.spawn(move || worker(locks, store, key, &name, seed))
            })
            .collect();
        for t in threads {
            merge(&mut total, t.join().expect("worker thread"));
        }
    });
    let fields: Vec<String> = total.iter().map(|(k, v)| format!("{k}={v}")).collect();
    println!("FENCE_WORKER {}", fields.join(" "));
}

/// Worker processes, killed (and reaped) when dropped: also on a panic.
#[derive(Default)]
struct Children {
    procs: Vec<Child>,
    readers: Vec<JoinHandle<String>>,
}

impl Drop for Children {
    fn drop(&mut self) {
        for c in &mut self.procs {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The lock-node faults, one node at a time.
struct Schedule {
    rng: Rng,
    next: Instant,
    /// The faulted node, whether it was stopped (else paused), when to heal.
    active: Option<(usize, bool, Instant)>,
    /// A restarted node still held back, and until when.
    recovering: Option<(usize, Instant)>,
    counts: Tally,
}

impl Schedule {
    fn tick(&mut self, c: &Cluster) {
        let now = Instant::now();
        if let Some((_, _, heal)) = self.active {
            if now >= heal {
                self.heal(c);
            }
            return;
        }
        if now < self.next {
            return;
        }
        self.next = now + self.rng.millis(200, 400);
        let node = match self.recovering {
            Some((i, until)) if now < until => i,
            _ => self.rng.below(c.len() as u64) as usize,
        };
        let (name, stopped, lasts) = match self.rng.below(3) {
            0 => ("faults_stop_restart", true, self.rng.millis(200, 600)),
            1 => ("faults_pause", false, self.rng.millis(150, 400)),
            _ => ("faults_none", false, Duration::ZERO),
        };
        bump(&mut self.counts, name);
        match (lasts.is_zero(), stopped) {
            (true, _) => return,
            (false, true) => c.stop(node),
            (false, false) => c.pause(node),
        }
        self.active = Some((node, stopped, now + lasts));
    }

    /// Ends the active fault: the node restarts (empty) or resumes.
    fn heal(&mut self, c: &Cluster) {
        match self.active.take() {
            Some((i, true, _)) => {
                c.restart(i);
                self.recovering = Some((i, Instant::now() + RECOVERY));
            }
            Some((i, false, _)) => c.unpause(i),
            None => {}
        }
    }
}

/// One run: starts the workers, injects faults until they are done, heals;
/// returns the merged tallies with the store's figures (`store_*`) and
/// the number of applied op ids.
fn run(nodes: &Cluster, store: &Cluster, faults: &mut Schedule, seed: u64, checked: bool) -> Tally {
    let key = unique_key("fence-workers");
    (faults.rng, faults.next) = (Rng(seed), Instant::now());
    faults.counts.clear();
    let started = Instant::now();
    let mut kids = Children::default();
    // `/proc/self/exe` still runs this binary after a concurrent `cargo`
    // build replaced the file.
    let exe = Some(std::path::PathBuf::from("/proc/self/exe")).filter(|p| p.exists());
    let exe = exe.unwrap_or_else(|| std::env::current_exe().expect("test binary"));
    for id in 0..PROCESSES {
        let mut child = Command::new(&exe)
            .args(["fence_workers::fence_worker_child", "--exact", "--ignored"])
            .args(["--nocapture", "--test-threads=1"])
            .env("QL_FENCE_ID", id.to_string())
            .env("QL_FENCE_NODES", nodes.urls().join(","))
            .env("QL_FENCE_STORE", store.url(0))
            .env("QL_FENCE_KEY", &key)
            .env("QL_FENCE_CHECKED", if checked { "1" } else { "0" })
            .env("QL_FENCE_SEED", seed.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start a worker process");
        let mut out = child.stdout.take().expect("piped stdout");
        kids.procs.push(child);
        kids.readers.push(std::thread::spawn(move || {
            let mut s = String::new();
            let _ = out.read_to_string(&mut s);
            s
        }));
    }
    while kids
        .procs
        .iter_mut()
        .any(|c| matches!(c.try_wait(), Ok(None)))
    {
        let late = started.elapsed() > RUN_LIMIT;
        assert!(!late, "workers still running after {RUN_LIMIT:?}");
        faults.tick(nodes);
        std::thread::sleep(Duration::from_millis(10));
    }
    faults.heal(nodes);
    let mut total = faults.counts.clone();
    total.insert("elapsed_ms".into(), started.elapsed().as_millis() as u64);
    for (c, r) in kids.procs.iter_mut().zip(std::mem::take(&mut kids.readers)) {
        let status = c.wait().expect("wait for a worker");
        let out = r.join().expect("reader");
        let line = out.lines().find_map(|l| l.split_once("FENCE_WORKER "));
        let line = line.filter(|_| status.success()).map(|(_, fields)| fields);
        let line = line.unwrap_or_else(|| panic!("worker failed ({status}):\n{out}"));
        let fields = line.split_whitespace().filter_map(|f| f.split_once('='));
        merge(
            &mut total,
            fields.map(|(k, v)| (k.into(), v.parse().expect("count"))),
        );
    }
    let [state, applied, _] = Store::keys(&key);
    let mut conn = store.conn(0);
    let st: Tally = redis::cmd("HGETALL").arg(&state).query(&mut conn).unwrap();
    for (k, v) in st.into_iter().filter(|(k, _)| k != "last") {
        total.insert(format!("store_{k}"), v);
    }
    let ids: u64 = redis::cmd("SCARD").arg(&applied).query(&mut conn).unwrap();
    total.insert("applied_ids".into(), ids);
    // Released, or expired with the TTL (none left without an expiry).
    let gone = nodes.gone_everywhere(&key, TTL + Duration::from_secs(1));
    let pttl: Vec<i64> = (0..nodes.len()).map(|i| nodes.pttl(i, &key)).collect();
    assert!(
        gone,
        "lock key {key} still on a node after its TTL (PTTL {pttl:?})"
    );
    total
}

/// Adds `lost` (accepted writes less the final value) and `doubles` (as
/// counted by workers and store); returns the figures line.
fn figures(label: &str, seed: u64, t: &mut Tally) -> String {
    let g = |k: &str| t.get(k).copied().unwrap_or(0);
    let lost = g("accepted").checked_sub(g("store_value"));
    let lost = lost.unwrap_or_else(|| panic!("final value above accepted writes: {t:?}"));
    let doubles = g("doubles") + g("store_doubles");
    t.insert("lost".into(), lost);
    t.insert("doubles".into(), doubles);
    for k in ZERO
        .iter()
        .chain(&["rejected_stale", "store_stale_applied"])
    {
        t.entry(k.to_string()).or_default();
    }
    let fields: Vec<String> = t.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let head = format!("processes={PROCESSES} K={THREADS} M={SECTIONS} seed={seed:#x}");
    format!("fence_workers [{label}]: {head} {}", fields.join(" "))
}

#[test]
fn fenced_increments_across_processes_under_node_faults() {
    let seed = std::env::var("FENCE_SEED").map_or(DEFAULT_SEED, |s| {
        let s = s.trim();
        let hex = s.strip_prefix("0x").map(|h| u64::from_str_radix(h, 16));
        hex.unwrap_or_else(|| s.parse())
            .expect("FENCE_SEED: a number")
    });
    let (nodes, store) = (Cluster::start(3), Cluster::start(1));
    // The workers use production settings (no fresh_cluster): the nodes'
    // lock history must be one TTL old (and their uptime 2 s) before they
    // vote.
    let warm = crate::client_with(nodes.urls(), Duration::from_millis(250));
    assert!(nodes.write_history(&warm, TTL), "no lock history written");
    let probe = Redlock::builder().nodes(nodes.urls()).build().unwrap();
    let voted = || probe.try_lock(&unique_key("warm"), TTL).is_ok();
    assert!(wait_until(Duration::from_secs(5), voted), "no vote");
    let mut faults = Schedule {
        rng: Rng(seed),
        next: Instant::now(),
        active: None,
        recovering: None,
        counts: Tally::new(),
    };
    let mut on = run(&nodes, &store, &mut faults, seed, true);
    let mut off = run(&nodes, &store, &mut faults, seed, false);
    let shown = [
        figures("store checks tokens", seed, &mut on),
        figures("store ignores tokens", seed, &mut off),
    ];
    println!("{}\n{}", shown[0], shown[1]);
    for (t, shown) in [(&on, &shown[0]), (&off, &shown[1])] {
        let g = |k: &str| t.get(k).copied().unwrap_or(0);
        assert!(g("accepted") > 0, "no write accepted: {shown}");
        for k in ["store_accepted", "applied_ids"] {
            assert_eq!(g(k), g("accepted"), "{k} is not accepted: {shown}");
        }
        for k in ZERO {
            assert_eq!(g(k), 0, "{k}: {shown}");
        }
    }
    let g = |t: &Tally, k: &str| t.get(k).copied().unwrap_or(0);
    assert_eq!(
        g(&on, "lost"),
        0,
        "updates lost despite fencing: {}",
        shown[0]
    );
    assert_eq!(g(&on, "rejected_stale"), g(&on, "store_rejected"));
    assert!(g(&on, "rejected_stale") > 0, "none refused: {}", shown[0]);
    assert!(g(&off, "lost") > 0, "unchecked, none lost: {}", shown[1]);
}
