//! What the watchdog costs: hold K = 1, 100 and 10,000 auto-renewed locks on
//! 3 local nodes and measure, over three renewal intervals, the renewal round
//! trips each node served (from `INFO commandstats`) and the CPU time of the
//! watchdog thread (from `/proc/self/task/<tid>/schedstat`, Linux).
//!
//! ```text
//! cargo bench --bench renewal
//! ```

use std::time::{Duration, Instant};

use quorumlock::{LockGuard, Redlock};

#[path = "../../tests/common/mod.rs"]
mod common;

use common::Cluster;

const TTL: Duration = Duration::from_secs(6);
/// Renewal every TTL/3.
const INTERVAL: Duration = Duration::from_secs(2);
static INTERVALS: std::sync::LazyLock<u32> =
    std::sync::LazyLock::new(|| if common::bench_smoke() { 1 } else { 3 });

/// The watchdog thread's CPU time so far (ns), if it exists.
fn watchdog_cpu_ns() -> Option<u64> {
    for task in std::fs::read_dir("/proc/self/task").ok()? {
        let path = task.ok()?.path();
        let comm = std::fs::read_to_string(path.join("comm")).unwrap_or_default();
        if comm.trim_end() == "qlock-watchdog" {
            let stat = std::fs::read_to_string(path.join("schedstat")).ok()?;
            return stat.split_whitespace().next()?.parse().ok();
        }
    }
    None
}

/// EVALSHA calls node `i` has served (renewals, releases).
fn evalsha_calls(c: &Cluster, i: usize) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(&mut c.conn(i))
        .expect("INFO");
    info.lines()
        .find_map(|l| l.strip_prefix("cmdstat_evalsha:calls="))
        .and_then(|rest| rest.split(',').next()?.parse().ok())
        .unwrap_or(0)
}

fn take(locks: &Redlock, prefix: &str, k: usize) -> Vec<LockGuard> {
    let threads = 8.min(k);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let locks = locks.clone();
                s.spawn(move || {
                    (t..k)
                        .step_by(threads)
                        .map(|i| locks.lock(&format!("{prefix}:{i}"), TTL).expect("lock"))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap_or_default())
            .collect()
    })
}

fn main() {
    let c = Cluster::start(3);
    eprintln!("3 nodes on the {:?} backend", c.backend());
    let mut rows = Vec::new();
    for k in [1usize, 100, 10_000] {
        let locks = Redlock::builder()
            .fresh_cluster(true)
            .nodes(c.urls())
            .auto_renew(true)
            .build()
            .expect("client");
        let t = Instant::now();
        let guards = take(&locks, &format!("bench:renew:{k}"), k);
        let took = t.elapsed();
        // Let the first renewals happen, then measure whole intervals.
        std::thread::sleep(INTERVAL);
        let (calls0, cpu0) = (evalsha_calls(&c, 0), watchdog_cpu_ns().unwrap_or(0));
        std::thread::sleep(INTERVAL * *INTERVALS);
        let (calls1, cpu1) = (evalsha_calls(&c, 0), watchdog_cpu_ns().unwrap_or(0));
        let held = guards
            .iter()
            .filter(|g| g.is_held() && !g.is_lost())
            .count();
        let rounds = calls1.saturating_sub(calls0) as f64;
        let cpu = Duration::from_nanos(cpu1.saturating_sub(cpu0));
        let renewals = (k as u64 * u64::from(*INTERVALS)) as f64;
        rows.push(format!(
            "K = {k:>6}: {:>5.1} round trips per node per renewal interval ({:>7.0} keys each), \
             watchdog CPU {:>8.1} us per interval = {:>6.2} us per renewed lock; held {held}/{k} \
             (acquired in {:.2} s)",
            rounds / f64::from(*INTERVALS),
            renewals / rounds.max(1.0),
            cpu.as_secs_f64() * 1e6 / f64::from(*INTERVALS),
            cpu.as_secs_f64() * 1e6 / renewals,
            took.as_secs_f64(),
        ));
        drop(guards);
        drop(locks);
        // The watchdog's one task: the bench fails when it loses locks (it
        // printed "held 2112/10000" for a while, and nobody looked). 1 %
        // slack for a loaded machine.
        assert!(
            held * 100 >= k * 99,
            "the watchdog kept {held} of {k} locks; {:?}",
            rows.last()
        );
    }
    let intervals = *INTERVALS;
    println!("\nquorumlock renewal (ttl {TTL:?}, renewed every {INTERVAL:?}, {intervals} intervals measured):");
    for r in rows {
        println!("  {r}");
    }
}
