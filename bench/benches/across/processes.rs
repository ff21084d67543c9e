//! Waiting across processes: P processes × T threads all want ONE key, each
//! holds it `HOLD` and asks again at once (`acquire_for`). The bench spawns
//! itself as the processes (`QUORUMLOCK_BENCH_CHILD` set); each writes one
//! line per section it held, `start end pid` in ns of the wall clock (every
//! process on one machine shares it), and the parent measures what waiters
//! meet: sections/s, how busy the lock was, the wait from a process's
//! section end to its next start, how often the next holder is the same
//! process, fairness over processes (Jain's index), and overlaps.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use std::sync::atomic::{AtomicUsize, Ordering};

use quorumlock::{AttemptEvent, EventHandler, Redlock};

const CHILD: &str = "QUORUMLOCK_BENCH_CHILD";
const HOLD: Duration = Duration::from_millis(2);

fn wall_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}

/// In a child: runs the loop its environment describes and exits. Returns
/// only in the parent.
pub fn child_main() {
    let Ok(spec) = std::env::var(CHILD) else {
        return;
    };
    // `urls|key|threads|run_ms|ttl_ms`
    let parts: Vec<&str> = spec.split('|').collect();
    let [urls, key, threads, run_ms, ttl_ms] = parts[..] else {
        eprintln!("bad {CHILD}: {spec}");
        std::process::exit(2);
    };
    let urls: Vec<String> = urls.split(',').map(str::to_owned).collect();
    let threads: usize = threads.parse().unwrap_or(1);
    let run_for = Duration::from_millis(run_ms.parse().unwrap_or(1000));
    let ttl = Duration::from_millis(ttl_ms.parse().unwrap_or(30_000));
    let attempts = std::sync::Arc::new(Attempts::default());
    let locks = Redlock::builder()
        .fresh_cluster(true)
        .nodes(urls)
        .events(attempts.clone())
        .build()
        .expect("client");
    let pid = std::process::id();
    let end = std::time::Instant::now() + run_for;
    let lines = std::thread::scope(|s| {
        let hs: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| {
                    let mut out = Vec::new();
                    while std::time::Instant::now() < end {
                        let left = end.saturating_duration_since(std::time::Instant::now());
                        let Ok(g) = locks.request(key, ttl).acquire_for(left) else {
                            continue;
                        };
                        let start = wall_ns();
                        std::thread::sleep(HOLD);
                        let stop = wall_ns();
                        drop(g);
                        out.push(format!("{start} {stop} {pid}"));
                    }
                    out
                })
            })
            .collect();
        hs.into_iter()
            .flat_map(|h| h.join().unwrap_or_default())
            .collect::<Vec<_>>()
    });
    for l in lines {
        println!("{l}");
    }
    let n = |a: &AtomicUsize| a.load(Ordering::Relaxed);
    println!(
        "# {} {} {}",
        n(&attempts.all),
        n(&attempts.woken),
        n(&attempts.split)
    );
    std::process::exit(0);
}

/// A child's attempts: all, woken, and failed with some nodes set (votes
/// split between waiters, or the releaser's copies not yet deleted).
#[derive(Default)]
struct Attempts {
    all: AtomicUsize,
    woken: AtomicUsize,
    split: AtomicUsize,
}

impl EventHandler for Attempts {
    fn on_attempt(&self, e: &AttemptEvent<'_>) {
        self.all.fetch_add(1, Ordering::Relaxed);
        if e.woken() {
            self.woken.fetch_add(1, Ordering::Relaxed);
        }
        if !e.acquired() && e.nodes().agreed() > 0 {
            self.split.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// What the parent measured.
pub struct Across {
    pub sections_per_sec: f64,
    pub busy: f64,
    pub wait_p50: Duration,
    pub wait_p99: Duration,
    pub wait_max: Duration,
    pub same_next: f64,
    pub jain: f64,
    pub per_process: Vec<usize>,
    pub overlaps: usize,
    /// The longest any process went without the key while asking for it
    /// (a process that got nothing: the whole run).
    pub starved: Duration,
    /// Attempts per section: all, woken, and failed with some nodes set.
    pub attempts: [f64; 3],
    /// The lock's idle time from one section's end to the next's start:
    /// median and 99th percentile.
    pub gap: [Duration; 2],
}

/// Runs `procs` processes of `threads` threads each on `key` for `run_for`;
/// `during` runs beside them (a fault to inject), from their start.
pub fn run(
    urls: &[String],
    key: &str,
    procs: usize,
    threads: usize,
    (run_for, ttl): (Duration, Duration),
    during: impl FnOnce() + Send,
) -> Across {
    let exe = std::env::current_exe().expect("the bench's own path");
    let spec = format!(
        "{}|{key}|{threads}|{}|{}",
        urls.join(","),
        run_for.as_millis(),
        ttl.as_millis()
    );
    let children: Vec<_> = (0..procs)
        .map(|_| {
            Command::new(&exe)
                .env(CHILD, &spec)
                .stdout(Stdio::piped())
                .spawn()
                .expect("spawn a child process")
        })
        .collect();
    let mut got = Got::default();
    std::thread::scope(|s| {
        s.spawn(during);
        got = read(children);
    });
    measure(got, run_for)
}

/// What the children wrote: every section (`start end pid`), how many each
/// had, and the sums of their attempt counts (all, woken, split).
#[derive(Default)]
struct Got {
    secs: Vec<(u128, u128, u32)>,
    per_process: Vec<usize>,
    attempts: [usize; 3],
}

fn read(children: Vec<std::process::Child>) -> Got {
    let mut got = Got::default();
    for mut c in children {
        let mut n = 0;
        if let Some(out) = c.stdout.take() {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if let Some(counts) = line.strip_prefix("# ") {
                    let c = counts.split(' ').filter_map(|x| x.parse::<usize>().ok());
                    for (sum, c) in got.attempts.iter_mut().zip(c) {
                        *sum += c;
                    }
                    continue;
                }
                let f: Vec<u128> = line.split(' ').filter_map(|x| x.parse().ok()).collect();
                if let [a, b, p] = f[..] {
                    got.secs.push((a, b, u32::try_from(p).unwrap_or(0)));
                    n += 1;
                }
            }
        }
        let _ = c.wait();
        got.per_process.push(n);
    }
    got
}

fn measure(got: Got, run_for: Duration) -> Across {
    let Got {
        mut secs,
        per_process,
        attempts,
    } = got;
    secs.sort_unstable();
    let overlaps = secs.windows(2).filter(|w| w[1].0 < w[0].1).count();
    // The lock's idle time between one section and the next (any process).
    let mut gaps: Vec<u128> = secs
        .windows(2)
        .map(|w| w[1].0.saturating_sub(w[0].1))
        .collect();
    gaps.sort_unstable();
    let gap = |q: f64| {
        let i = ((gaps.len().max(1) - 1) as f64 * q).round() as usize;
        Duration::from_nanos(u64::try_from(gaps.get(i).copied().unwrap_or(0)).unwrap_or(u64::MAX))
    };
    let same = secs.windows(2).filter(|w| w[1].2 == w[0].2).count();
    let held: u128 = secs.iter().map(|s| s.1.saturating_sub(s.0)).sum();
    let span = match (secs.first(), secs.last()) {
        (Some(a), Some(b)) => b.1.saturating_sub(a.0).max(1),
        _ => 1,
    };
    // A process's wait: from the end of one of its sections to the start
    // of its next (it asked again at once).
    let mut waits: Vec<Duration> = Vec::new();
    let mut last: std::collections::HashMap<u32, u128> = Default::default();
    for s in &secs {
        if let Some(prev) = last.insert(s.2, s.1) {
            waits.push(Duration::from_nanos(
                u64::try_from(s.0.saturating_sub(prev)).unwrap_or(u64::MAX),
            ));
        }
    }
    let (first, final_end) = (
        secs.first().map_or(0, |s| s.0),
        secs.last().map_or(0, |s| s.1),
    );
    let mut starved = waits.iter().copied().max().unwrap_or_default();
    let nanos = |n: u128| Duration::from_nanos(u64::try_from(n).unwrap_or(u64::MAX));
    if per_process.contains(&0) {
        starved = nanos(final_end.saturating_sub(first));
    }
    for (&pid, &end) in &last {
        let head = secs.iter().find(|s| s.2 == pid).map_or(0, |s| s.0);
        starved = starved
            .max(nanos(head.saturating_sub(first)))
            .max(nanos(final_end.saturating_sub(end)));
    }
    waits.sort_unstable();
    let at = |q: f64| {
        waits
            .get(((waits.len().max(1) - 1) as f64 * q).round() as usize)
            .copied()
            .unwrap_or_default()
    };
    let sum: f64 = per_process.iter().map(|&n| n as f64).sum();
    let sq: f64 = per_process.iter().map(|&n| (n as f64).powi(2)).sum();
    Across {
        sections_per_sec: secs.len() as f64 / run_for.as_secs_f64(),
        busy: held as f64 / span as f64,
        wait_p50: at(0.5),
        wait_p99: at(0.99),
        wait_max: at(1.0),
        same_next: same as f64 / secs.len().saturating_sub(1).max(1) as f64,
        jain: if sq > 0.0 {
            sum * sum / (per_process.len() as f64 * sq)
        } else {
            0.0
        },
        per_process,
        overlaps,
        starved,
        attempts: attempts.map(|a| a as f64 / secs.len().max(1) as f64),
        gap: [gap(0.5), gap(0.99)],
    }
}

impl Across {
    /// One row for the bench's table.
    pub fn row(&self, name: &str) -> String {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        format!(
            "{name:<28} {:>6.0} sections/s  busy {:>3.0} %  wait p50 {:.1} ms p99 {:.1} ms max {:.1} ms  same process next {:>3.0} %  Jain {:.2}  per process {:?}  longest starved {:.0} ms  overlaps {}  attempts/section {:.2} (woken {:.2}, split {:.2})  idle between sections p50 {:.2} ms p99 {:.2} ms",
            self.sections_per_sec,
            self.busy * 100.0,
            ms(self.wait_p50),
            ms(self.wait_p99),
            ms(self.wait_max),
            self.same_next * 100.0,
            self.jain,
            self.per_process,
            ms(self.starved),
            self.overlaps,
            self.attempts[0],
            self.attempts[1],
            self.attempts[2],
            ms(self.gap[0]),
            ms(self.gap[1])
        )
    }
}
