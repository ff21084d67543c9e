//! Lock+unlock latency on 3 and 5 local nodes — healthy, one node dead, one
//! node paused — against a bare hand-written Redlock on single connections,
//! plus hot-key contention (8 threads, one key, 5 nodes), each also with
//! fencing tokens on.
//!
//! ```text
//! cargo bench --bench cycle                 # everything
//! QUORUMLOCK_TEST_BACKEND=process cargo bench --bench cycle   # redis-server processes (less noise)
//! QUORUMLOCK_BENCH_ACROSS_ONLY=1 cargo bench --bench cycle     # the across-process rows alone (~50 s)
//! QUORUMLOCK_BENCH_ACROSS_ONLY=4x1,poll,breakdown cargo bench --bench cycle   # some of them
//! QUORUMLOCK_BENCH_ACROSS_ONLY=outage cargo bench --bench cycle   # majority outages (~35 s)
//! QUORUMLOCK_BENCH_ACROSS_ONLY=election cargo bench --bench cycle   # leader election, failovers (~60 s)
//! QUORUMLOCK_BENCH_TRACE_DIR=/tmp/t ...      # the children's library logs, <pid>.log
//! ```
//! Prints medians, p99 and max per scenario, and the ratios the README quotes.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::Criterion;
use quorumlock::Redlock;

#[path = "../../tests/common/mod.rs"]
mod common;

use common::Cluster;

#[path = "across/election.rs"]
mod election;
#[path = "across/outage.rs"]
mod outage;
#[path = "across/poll.rs"]
mod poll;
#[path = "across/probe.rs"]
mod probe;
#[path = "across/processes.rs"]
mod processes;
#[path = "across/sets.rs"]
mod sets;

const TTL: Duration = Duration::from_secs(10);
static CYCLES: std::sync::LazyLock<usize> =
    std::sync::LazyLock::new(|| common::bench_count(3000, 20));

struct Stats {
    median: Duration,
    p99: Duration,
    max: Duration,
}

fn stats(mut v: Vec<Duration>) -> Stats {
    v.sort_unstable();
    let at = |q: f64| v[((v.len() as f64 - 1.0) * q).round() as usize];
    Stats {
        median: at(0.5),
        p99: at(0.99),
        max: at(1.0),
    }
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn client(c: &Cluster) -> Redlock {
    Redlock::builder()
        .fresh_cluster(true)
        .nodes(c.urls())
        .build()
        .expect("client")
}

/// A client whose locks carry fencing tokens (one more round trip each).
fn fenced_client(c: &Cluster) -> Redlock {
    Redlock::builder()
        .fresh_cluster(true)
        .nodes(c.urls())
        .fencing(true)
        .build()
        .expect("client")
}

/// `*CYCLES` lock+unlock cycles on distinct keys; returns each cycle's time.
fn cycles(locks: &Redlock, tag: &str) -> Vec<Duration> {
    // Warm the pools (and let a sick node be noticed) outside the sample.
    for i in 0..20 {
        if let Ok(g) = locks.try_lock(&format!("bench:{tag}:warm:{i}"), TTL) {
            let _ = g.release();
        }
    }
    (0..*CYCLES)
        .map(|i| {
            let key = format!("bench:{tag}:{i}");
            let t = Instant::now();
            let g = locks.try_lock(&key, TTL).expect("lock");
            g.release().expect("unlock");
            t.elapsed()
        })
        .collect()
}

/// Locks of several resources (issue 23): a set of `k` keys taken and
/// released as one lock (one round each way) against `k` single locks taken
/// one after another, then released; a set of one is the healthy cycle.
fn sets(locks: &Redlock, healthy: &Stats, rows: &mut Vec<String>) {
    for k in [4usize, 16] {
        let names = |tag: &str, i: usize| -> Vec<String> {
            (0..k).map(|j| format!("bench:{tag}{k}:{i}:{j}")).collect()
        };
        let set: Vec<Duration> = (0..*CYCLES)
            .map(|i| {
                let keys = names("set", i);
                let t = Instant::now();
                let g = keys[1..]
                    .iter()
                    .fold(locks.request(&keys[0], TTL), |r, k| r.and(k))
                    .try_acquire()
                    .expect("request().and().acquire");
                g.release().expect("unlock");
                t.elapsed()
            })
            .collect();
        let singles: Vec<Duration> = (0..*CYCLES)
            .map(|i| {
                let keys = names("singles", i);
                let t = Instant::now();
                let held: Vec<_> = keys
                    .iter()
                    .map(|key| locks.try_lock(key, TTL).expect("lock"))
                    .collect();
                for g in held {
                    g.release().expect("unlock");
                }
                t.elapsed()
            })
            .collect();
        let (set, singles) = (stats(set), stats(singles));
        rows.push(format!(
            "5 nodes set of {k:<2} keys       median {:>8.1} us  p99 {:>8.1} us  vs {k} locks one by one {:>6.2}x ({:.1} us)  vs one lock {:>6.2}x",
            us(set.median),
            us(set.p99),
            set.median.as_secs_f64() / singles.median.as_secs_f64(),
            us(singles.median),
            set.median.as_secs_f64() / healthy.median.as_secs_f64()
        ));
    }
}

/// The bare algorithm by hand: one plain connection per node, SET NX PX to
/// all, then the unlock script to all (scatter/gather, no pool, no checks).
fn baseline(c: &Cluster, tag: &str) -> Vec<Duration> {
    let mut conns: Vec<redis::Connection> = (0..c.len())
        .map(|i| {
            let info = redis::IntoConnectionInfo::into_connection_info(c.url(i).as_str())
                .expect("url")
                .set_tcp_settings(redis::io::tcp::TcpSettings::default().set_nodelay(true));
            let settings = info.redis_settings().clone().set_skip_set_lib_name();
            let client = redis::Client::open(info.set_redis_settings(settings)).expect("client");
            client.get_connection().expect("connect")
        })
        .collect();
    let unlock = redis::Script::new(
        "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end",
    );
    let token = "0123456789abcdef0123456789abcdef";
    let quorum = c.len() / 2 + 1;
    let mut run = |key: &str| {
        let set = redis::cmd("SET")
            .arg(key)
            .arg(token)
            .arg("NX")
            .arg("PX")
            .arg(TTL.as_millis() as u64)
            .get_packed_command();
        for conn in conns.iter_mut() {
            conn.send_packed_command(&set).expect("send");
        }
        let ok = conns
            .iter_mut()
            .map(|conn| conn.recv_response())
            .filter(|r| matches!(r, Ok(redis::Value::Okay)))
            .count();
        assert!(ok >= quorum);
        let del = redis::cmd("EVALSHA")
            .arg(unlock.get_hash())
            .arg(1)
            .arg(key)
            .arg(token)
            .get_packed_command();
        for conn in conns.iter_mut() {
            conn.send_packed_command(&del).expect("send");
        }
        for conn in conns.iter_mut() {
            let _ = conn.recv_response();
        }
    };
    // Load the script once.
    for i in 0..c.len() {
        let _: String = unlock.prepare_invoke().load(&mut c.conn(i)).expect("load");
    }
    for i in 0..20 {
        run(&format!("bench:{tag}:warm:{i}"));
    }
    (0..*CYCLES)
        .map(|i| {
            let key = format!("bench:{tag}:{i}");
            let t = Instant::now();
            run(&key);
            t.elapsed()
        })
        .collect()
}

struct Contention {
    per_sec: f64,
    min: usize,
    max: usize,
    overlaps: usize,
}

/// 8 threads on one key for `secs`: acquisitions per second, per-thread
/// spread, overlaps seen by an in-section detector.
fn contention(locks: &Redlock, key: &str, ttl: Duration, run_for: Duration) -> Contention {
    let inside = Arc::new(AtomicUsize::new(0));
    let overlaps = Arc::new(AtomicUsize::new(0));
    let counts: Vec<usize> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..8)
            .map(|_| {
                let (locks, inside, overlaps) = (locks.clone(), inside.clone(), overlaps.clone());
                s.spawn(move || {
                    let started = Instant::now();
                    let mut n = 0;
                    while started.elapsed() < run_for {
                        let left = run_for.saturating_sub(started.elapsed());
                        let Ok(g) = locks.request(key, ttl).acquire_for(left) else {
                            continue;
                        };
                        if inside.fetch_add(1, Ordering::SeqCst) != 0 {
                            overlaps.fetch_add(1, Ordering::SeqCst);
                        }
                        inside.fetch_sub(1, Ordering::SeqCst);
                        let _ = g.release();
                        n += 1;
                    }
                    n
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or(0)).collect()
    });
    let total: usize = counts.iter().sum();
    Contention {
        per_sec: total as f64 / run_for.as_secs_f64(),
        min: counts.iter().copied().min().unwrap_or(0),
        max: counts.iter().copied().max().unwrap_or(0),
        overlaps: overlaps.load(Ordering::SeqCst),
    }
}

fn main() {
    // A child process of the cross-process scenarios runs only that.
    processes::child_main();
    common::candidates::child_main();
    if std::env::var_os("QUORUMLOCK_BENCH_ACROSS_ONLY").is_some() {
        let mut rows = Vec::new();
        across(&Cluster::start(5), &mut rows);
        for r in rows {
            println!("  {r}");
        }
        return;
    }
    let mut criterion = Criterion::default()
        .configure_from_args()
        .sample_size(if common::bench_smoke() { 10 } else { 20 })
        .warm_up_time(if common::bench_smoke() {
            Duration::from_millis(50)
        } else {
            Duration::from_secs(3)
        })
        .measurement_time(if common::bench_smoke() {
            Duration::from_millis(200)
        } else {
            Duration::from_secs(3)
        });
    let mut rows: Vec<String> = Vec::new();
    let row = |rows: &mut Vec<String>,
               name: &str,
               s: &Stats,
               healthy: Option<Duration>,
               base: Option<Duration>| {
        let ratio = |d: Option<Duration>| {
            d.map(|d| format!("{:>6.2}x", s.median.as_secs_f64() / d.as_secs_f64()))
                .unwrap_or_else(|| "      -".into())
        };
        rows.push(format!(
            "{name:<28} median {:>8.1} us  p99 {:>8.1} us  max {:>9.1} us  vs healthy {}  vs bare {}",
            us(s.median),
            us(s.p99),
            us(s.max),
            ratio(healthy),
            ratio(base)
        ));
    };

    for n in [3usize, 5] {
        let c = Cluster::start(n);
        eprintln!("{n} nodes on the {:?} backend", c.backend());
        let bare = stats(baseline(&c, &format!("bare{n}")));
        row(
            &mut rows,
            &format!("{n} nodes bare algorithm"),
            &bare,
            None,
            None,
        );
        let locks = client(&c);
        criterion.bench_function(&format!("cycle/{n}-nodes/healthy"), |b| {
            let mut i = 0u64;
            b.iter(|| {
                i += 1;
                let g = locks
                    .try_lock(&format!("bench:crit{n}:{i}"), TTL)
                    .expect("lock");
                g.release().expect("unlock");
            })
        });
        let healthy = stats(cycles(&locks, &format!("healthy{n}")));
        row(
            &mut rows,
            &format!("{n} nodes healthy"),
            &healthy,
            None,
            Some(bare.median),
        );

        let fenced = stats(cycles(&fenced_client(&c), &format!("fenced{n}")));
        row(
            &mut rows,
            &format!("{n} nodes healthy, fenced"),
            &fenced,
            Some(healthy.median),
            Some(bare.median),
        );

        if n == 5 {
            sets(&locks, &healthy, &mut rows);
        }

        c.stop(n - 1);
        let dead = stats(cycles(&client(&c), &format!("dead{n}")));
        row(
            &mut rows,
            &format!("{n} nodes one dead"),
            &dead,
            Some(healthy.median),
            Some(bare.median),
        );
        c.restart(n - 1);

        c.pause(n - 1);
        let paused_client = client(&c);
        let first = Instant::now();
        drop(paused_client.try_lock(&format!("bench:first{n}"), TTL));
        let first = first.elapsed();
        let paused = stats(cycles(&paused_client, &format!("paused{n}")));
        row(
            &mut rows,
            &format!("{n} nodes one paused"),
            &paused,
            Some(healthy.median),
            Some(bare.median),
        );
        rows.push(format!(
            "{:<28} first attempt after the pause: {:.1} ms (node timeout 50 ms)",
            "",
            first.as_secs_f64() * 1e3
        ));
        c.unpause(n - 1);
    }

    let c = Cluster::start(5);
    let run_for = Duration::from_secs(3);
    let queued = contention(&client(&c), "bench:hot:queued", TTL, run_for);
    // A short TTL: the lock goes back to the nodes every 100 ms.
    let queued_short = contention(
        &client(&c),
        "bench:hot:queued-short",
        Duration::from_millis(200),
        run_for,
    );
    let queued_fenced = contention(&fenced_client(&c), "bench:hot:queued-fenced", TTL, run_for);
    // The yardstick: a plain retry loop (no queue, no wake-ups).
    let naive = contention(
        &Redlock::builder()
            .fresh_cluster(true)
            .nodes(c.urls())
            .local_queue(false)
            .wake_ups(false)
            .build()
            .expect("client"),
        "bench:hot:naive",
        TTL,
        run_for,
    );
    // No queue, wake-ups on (the default): what `local_queue(false)` costs.
    let unqueued = contention(
        &Redlock::builder()
            .fresh_cluster(true)
            .nodes(c.urls())
            .local_queue(false)
            .build()
            .expect("client"),
        "bench:hot:unqueued",
        TTL,
        run_for,
    );
    let tight = contention(
        &Redlock::builder()
            .fresh_cluster(true)
            .nodes(c.urls())
            .local_queue(false)
            .wake_ups(false)
            .retry_delay(Duration::from_millis(1))
            .retry_jitter(Duration::from_millis(1))
            .build()
            .expect("client"),
        "bench:hot:tight",
        TTL,
        run_for,
    );
    for (name, r) in [
        ("hot key, local queue", &queued),
        ("hot key, queue, ttl 200 ms", &queued_short),
        ("hot key, queue, fenced", &queued_fenced),
        ("hot key, no queue, woken", &unqueued),
        ("hot key, naive 100±100 ms", &naive),
        ("hot key, naive 1±1 ms", &tight),
    ] {
        rows.push(format!(
            "{name:<28} {:>8.0} acq/s  per thread min {} max {}  overlaps {}  ({:.1}x naive, {:.1}x tight)",
            r.per_sec,
            r.min,
            r.max,
            r.overlaps,
            r.per_sec / naive.per_sec.max(f64::MIN_POSITIVE),
            r.per_sec / tight.per_sec.max(f64::MIN_POSITIVE),
        ));
    }

    across(&c, &mut rows);

    criterion.final_summary();
    let cycles = *CYCLES;
    println!("\nquorumlock lock+unlock cycles ({cycles} per scenario, node timeout 50 ms):");
    for r in rows {
        println!("  {r}");
    }
}

/// Which across-process rows run: all, or those named in
/// `QUORUMLOCK_BENCH_ACROSS_ONLY` (comma-separated, of `4x1`, `8x1`, `poll`,
/// `breakdown`, `3x4`, `sets`, `restart`, `outage`, `election`; `1` or
/// empty: all).
fn across_rows() -> impl Fn(&str) -> bool {
    let only = std::env::var("QUORUMLOCK_BENCH_ACROSS_ONLY").unwrap_or_default();
    let names: Vec<String> = only
        .split(',')
        .map(|n| n.trim().to_owned())
        .filter(|n| !n.is_empty() && n != "1" && n != "all")
        .collect();
    move |row| names.is_empty() || names.iter().any(|n| n == row)
}

/// Waiting across processes (issues 22 and 41): 4 processes × 1 thread on
/// one key with 2 ms holds, next to a plain polling loop doing the same,
/// and a probed run of the same that breaks a hand-over down into its
/// steps; 3 × 4 with a short TTL; sets of 1 and 3 of 4 resources (4 × 2);
/// then 4 × 1 again with a node restarted mid-run, and with majority
/// outages (3 of 5 nodes hung or paused for 1 s, six times); then leader
/// election among 4 candidate processes (issue 42).
fn across(c: &Cluster, rows: &mut Vec<String>) {
    use processes::Mode;
    let smoke = common::bench_smoke();
    let span = |full: u64| Duration::from_millis(if smoke { 600 } else { full });
    let run = across_rows();
    let urls = c.urls();
    for (row, name, mode) in [
        ("4x1", "4 processes x 1 thread", Mode::Lock),
        ("poll", "4 x 1, a plain polling loop", Mode::Poll),
        ("breakdown", "4 x 1, probed", Mode::Probe),
    ] {
        if !run(row) {
            continue;
        }
        let key = format!("bench:across:4x1:{row}");
        let secs = span(if mode == Mode::Probe { 5_000 } else { 10_000 });
        let got = processes::run(&urls, (&key, mode), 4, 1, (secs, TTL), || {});
        rows.push(processes::measure(&got).row(name));
        if mode == Mode::Probe {
            rows.extend(probe::breakdown(&got));
        }
    }
    if run("8x1") {
        // More waiting processes than the woken waiters' order ranks
        // (see `FRONT` in the library's wait.rs): several try at once.
        let got = processes::run(
            &urls,
            ("bench:across:8x1", Mode::Lock),
            8,
            1,
            (span(5_000), TTL),
            || {},
        );
        rows.push(processes::measure(&got).row("8 processes x 1 thread"));
    }
    if run("3x4") {
        let (secs, ttl) = (span(4_000), Duration::from_millis(500));
        let got = processes::run(
            &urls,
            ("bench:across:3x4", Mode::Lock),
            3,
            4,
            (secs, ttl),
            || {},
        );
        rows.push(processes::measure(&got).row("3 processes x 4 threads"));
    }
    if run("sets") {
        let got = processes::run(
            &urls,
            ("bench:across:sets", Mode::Sets),
            4,
            2,
            (span(10_000), TTL),
            || {},
        );
        rows.push(sets::row("sets of 1 and 3 of 4, 4 x 2", &got));
    }
    if run("restart") {
        restarted(c, span(10_000), rows);
    }
    if run("outage") {
        outages(c, rows);
    }
    if run("election") {
        elections(c, rows);
    }
}

/// Leader election (issue 42): 4 candidate processes, leaders resigning
/// and SIGKILLed, the nodes healthy, then one and two hung, then one
/// restarted empty (see `across/election.rs`): failover times, and no two
/// valid leases at once, terms rising.
fn elections(c: &Cluster, rows: &mut Vec<String>) {
    let (resigns, kills) = if common::bench_smoke() {
        (2, 1)
    } else {
        (30, 4)
    };
    let (lines, ok) = election::run(c, resigns, kills);
    for l in &lines {
        eprintln!("{l}");
    }
    let summary = lines.first().cloned().unwrap_or_default();
    rows.extend(lines);
    assert!(ok, "election: {summary}");
}

/// 4 × 1 while a majority (3 of 5) goes away for 1 s, six times, hung and
/// then paused (see `across/outage.rs`): per outage, the time from the
/// majority's return to the next section; none overlap, no key is left.
fn outages(c: &Cluster, rows: &mut Vec<String>) {
    use outage::Kind;
    let mut bad = Vec::new();
    for (tag, kind) in [("hung", Kind::Hung), ("paused", Kind::Paused)] {
        let key = format!("bench:across:4x1:outage:{tag}");
        let (got, outages) = outage::run(c, &key, kind, TTL);
        let left = !c.gone_everywhere(&key, Duration::from_secs(2));
        let lines = outage::rows("4 x 1, majority outages", kind, &got, &outages, left);
        for l in &lines {
            eprintln!("{l}");
        }
        rows.extend(lines);
        let overlaps = processes::overlaps(got.secs.iter());
        if overlaps != 0 || left {
            bad.push(format!(
                "{tag}: {overlaps} overlapping sections, key left {left}"
            ));
        }
    }
    assert!(bad.is_empty(), "majority outages: {}", bad.join("; "));
}

/// 4 × 1 with node 4 killed a quarter into the run and restarted empty at
/// half (its votes held back for a TTL, 2 s, as a restarted node's are):
/// sections go on over the other four, none overlap, and no key is left.
fn restarted(c: &Cluster, secs: Duration, rows: &mut Vec<String>) {
    let ttl = Duration::from_secs(2);
    let key = "bench:across:4x1:restarted";
    let mode = processes::Mode::Lock;
    let got = processes::run(&c.urls(), (key, mode), 4, 1, (secs, ttl), || {
        std::thread::sleep(secs / 4);
        c.stop(4);
        std::thread::sleep(secs / 4);
        c.restart(4);
    });
    let r = processes::measure(&got);
    let left = !c.gone_everywhere(key, Duration::from_secs(2));
    rows.push(format!(
        "{}  key left {left}",
        r.row("4 x 1, node 4 restarted")
    ));
    assert!(
        r.overlaps == 0 && !left && r.per_process.iter().all(|&n| n > 0),
        "a node restarted mid-run: {} overlapping sections, key left {left}, sections {:?}",
        r.overlaps,
        r.per_process
    );
}
