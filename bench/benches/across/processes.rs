//! Waiting across processes: P processes × T threads all want ONE key, each
//! holds it `HOLD` and asks again at once (`acquire_for`). The bench spawns
//! itself as the processes (`QUORUMLOCK_BENCH_CHILD` set); each writes one
//! line per section it held (see [`Section`]), in ns of the wall clock
//! (every process on one machine shares it), and the parent measures what
//! waiters meet: sections/s, how busy the lock was, the wait from a
//! process's section end to its next start, the gap between sections, how
//! often the next holder is the same process, fairness over processes
//! (Jain's index), and overlaps.
//!
//! The same children also run a plain polling loop instead of the library
//! ([`Mode::Poll`], see `poll.rs`), the library with probes on the steps of
//! a hand-over ([`Mode::Probe`], see `probe.rs`), and locks of 1 and 3 of 4
//! resources ([`Mode::Sets`], see `sets.rs`).

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use quorumlock::{AttemptEvent, EventHandler, Redlock};

use super::{poll, probe};

const CHILD: &str = "QUORUMLOCK_BENCH_CHILD";
pub const HOLD: Duration = Duration::from_millis(2);

pub fn wall_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}

/// What the children run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// `acquire_for` on the one key.
    Lock,
    /// As `Lock`, with a logger and an event handler that time the steps of
    /// a hand-over (see `probe.rs`); slower, so a run of its own.
    Probe,
    /// A plain polling loop on the one key, no library (see `poll.rs`).
    Poll,
    /// Resources `key:r0..r3`: even threads lock a random 3 of them as one
    /// lock, odd threads a random one.
    Sets,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Lock => "lock",
            Mode::Probe => "probe",
            Mode::Poll => "poll",
            Mode::Sets => "sets",
        }
    }

    fn parse(s: &str) -> Option<Mode> {
        [Mode::Lock, Mode::Probe, Mode::Poll, Mode::Sets]
            .into_iter()
            .find(|m| m.name() == s)
    }
}

/// What a child is told, as `mode|urls|key|threads|run_ms|ttl_ms`.
pub struct Spec {
    pub mode: Mode,
    pub urls: Vec<String>,
    pub key: String,
    pub threads: usize,
    pub run_for: Duration,
    pub ttl: Duration,
}

impl Spec {
    fn encode(&self) -> String {
        format!(
            "{}|{}|{}|{}|{}|{}",
            self.mode.name(),
            self.urls.join(","),
            self.key,
            self.threads,
            self.run_for.as_millis(),
            self.ttl.as_millis()
        )
    }

    fn parse(spec: &str) -> Option<Spec> {
        let parts: Vec<&str> = spec.split('|').collect();
        let [mode, urls, key, threads, run_ms, ttl_ms] = parts[..] else {
            return None;
        };
        Some(Spec {
            mode: Mode::parse(mode)?,
            urls: urls.split(',').map(str::to_owned).collect(),
            key: key.to_owned(),
            threads: threads.parse().ok()?,
            run_for: Duration::from_millis(run_ms.parse().ok()?),
            ttl: Duration::from_millis(ttl_ms.parse().ok()?),
        })
    }

    /// The resources of `mask` (bit i: `key:ri`); the key itself for the
    /// modes of one key.
    fn resources(&self, mask: u8) -> Vec<String> {
        if self.mode != Mode::Sets {
            return vec![self.key.clone()];
        }
        (0..8)
            .filter(|i| mask & (1 << i) != 0)
            .map(|i| format!("{}:r{i}", self.key))
            .collect()
    }
}

/// One section a child held: when its thread asked, got the lock, ended
/// the section (its release call began) and the release returned, all in
/// wall-clock ns; the process; the resources held (bit i: resource i; the
/// one key is bit 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Section {
    pub start: u128,
    pub end: u128,
    pub asked: u128,
    pub released: u128,
    pub pid: u32,
    pub mask: u8,
}

impl Section {
    fn line(&self) -> String {
        let s = self;
        format!(
            "S {} {} {} {} {} {}",
            s.asked, s.start, s.end, s.released, s.pid, s.mask
        )
    }

    fn parse(f: &[&str]) -> Option<Section> {
        let [asked, start, end, released, pid, mask] = f[..] else {
            return None;
        };
        Some(Section {
            asked: asked.parse().ok()?,
            start: start.parse().ok()?,
            end: end.parse().ok()?,
            released: released.parse().ok()?,
            pid: pid.parse().ok()?,
            mask: mask.parse().ok()?,
        })
    }
}

/// A small xorshift generator: random sets and polling pauses, no crate.
pub struct Rng(u64);

impl Rng {
    pub fn new(thread: usize) -> Rng {
        let seed = wall_ns() as u64 ^ u64::from(std::process::id()) << 32 ^ thread as u64;
        Rng(seed | 1)
    }

    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// Uniform in `0..n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// In a child: runs the loop its environment describes and exits. Returns
/// only in the parent.
pub fn child_main() {
    let Ok(raw) = std::env::var(CHILD) else {
        return;
    };
    let Some(spec) = Spec::parse(&raw) else {
        eprintln!("bad {CHILD}: {raw}");
        std::process::exit(2);
    };
    let end = Instant::now() + spec.run_for;
    let lines = match spec.mode {
        Mode::Poll => poll::child(&spec, end),
        _ => locking_child(&spec, end),
    };
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    for l in lines {
        let _ = std::io::Write::write_all(&mut out, format!("{l}\n").as_bytes());
    }
    let _ = std::io::Write::flush(&mut out);
    drop(out);
    std::process::exit(0);
}

/// Runs `threads` threads of `body` (given its index); their lines.
pub fn threads(threads: usize, body: impl Fn(usize) -> Vec<String> + Sync) -> Vec<String> {
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..threads)
            .map(|t| {
                let body = &body;
                s.spawn(move || body(t))
            })
            .collect();
        hs.into_iter()
            .flat_map(|h| h.join().unwrap_or_default())
            .collect()
    })
}

/// One held section: records it around a `HOLD` long sleep and the
/// release that `release` makes.
pub fn hold(asked: u128, mask: u8, release: impl FnOnce()) -> String {
    let start = wall_ns();
    std::thread::sleep(HOLD);
    let end = wall_ns();
    release();
    Section {
        asked,
        start,
        end,
        released: wall_ns(),
        pid: std::process::id(),
        mask,
    }
    .line()
}

/// An ask that ran out with the run: `U asked gave-up mask`.
pub fn unfinished(asked: u128, mask: u8) -> String {
    format!("U {asked} {} {mask}", wall_ns())
}

/// The child of the library's modes: each thread asks with `acquire_for`
/// until the run ends.
fn locking_child(spec: &Spec, end: Instant) -> Vec<String> {
    let probed = spec.mode == Mode::Probe;
    let probe = probed.then(probe::Probe::install);
    let diag = if probed { None } else { trace_file() };
    let attempts = Arc::new(Attempts {
        sent: probed.then(Default::default),
        ..Attempts::default()
    });
    let locks = Redlock::builder()
        .fresh_cluster(true)
        .nodes(spec.urls.clone())
        .events(attempts.clone())
        .build()
        .expect("client");
    let mut lines = threads(spec.threads, |t| {
        let mut rng = Rng::new(t);
        let mut out = Vec::new();
        while Instant::now() < end {
            let mask = match spec.mode {
                // A random 3 of the 4: all but one.
                Mode::Sets if t % 2 == 0 => 0b1111 & !(1 << rng.below(4)),
                Mode::Sets => 1 << rng.below(4),
                _ => 1,
            };
            let names = spec.resources(mask);
            let asked = wall_ns();
            let left = end.saturating_duration_since(Instant::now());
            match super::common::request_all(&locks, &names, spec.ttl).acquire_for(left) {
                Ok(g) => out.push(hold(asked, mask, || drop(g))),
                Err(_) => out.push(unfinished(asked, mask)),
            }
        }
        out
    });
    lines.push(attempts.counts());
    if let Some(sent) = &attempts.sent {
        lines.extend(sent.lock().unwrap_or_else(|e| e.into_inner()).drain(..));
    }
    if let Some(p) = probe {
        lines.extend(p.lines());
    }
    if let Some(d) = diag {
        log::Log::flush(d);
    }
    lines
}

/// A child's attempts: all, woken, and failed with some nodes set (votes
/// split between waiters, or the releaser's copies not yet deleted); in a
/// probed run, each winning attempt's send and decision times.
#[derive(Default)]
struct Attempts {
    all: AtomicUsize,
    woken: AtomicUsize,
    split: AtomicUsize,
    sent: Option<std::sync::Mutex<Vec<String>>>,
}

impl Attempts {
    /// `# all woken split`.
    fn counts(&self) -> String {
        let n = |a: &AtomicUsize| a.load(Ordering::Relaxed);
        format!("# {} {} {}", n(&self.all), n(&self.woken), n(&self.split))
    }
}

impl EventHandler for Attempts {
    fn on_attempt(&self, e: &AttemptEvent<'_>) {
        log::debug!(target: "quorumlock::bench::attempt", "attempt took {:?} woken {} acquired {} agreed {} held {} err {:?}", e.elapsed(), e.woken(), e.acquired(), e.nodes().agreed(), e.nodes().held(), e.error().map(|e| e.to_string()));
        self.all.fetch_add(1, Ordering::Relaxed);
        if e.woken() {
            self.woken.fetch_add(1, Ordering::Relaxed);
        }
        if !e.acquired() && e.nodes().agreed() > 0 {
            self.split.fetch_add(1, Ordering::Relaxed);
        }
        if let (Some(sent), true) = (&self.sent, e.acquired()) {
            let now = wall_ns();
            let line = probe::sent_line(now.saturating_sub(e.elapsed().as_nanos()), now, e.woken());
            sent.lock().unwrap_or_else(|e| e.into_inner()).push(line);
        }
    }
}

/// Runs `procs` processes of `threads` threads each in `mode` on `key` for
/// `run_for`; `during` runs beside them (a fault to inject), from their
/// start. What they wrote.
pub fn run(
    urls: &[String],
    (key, mode): (&str, Mode),
    procs: usize,
    threads: usize,
    (run_for, ttl): (Duration, Duration),
    during: impl FnOnce() + Send,
) -> Got {
    let exe = std::env::current_exe().expect("the bench's own path");
    let spec = Spec {
        mode,
        urls: urls.to_vec(),
        key: key.to_owned(),
        threads,
        run_for,
        ttl,
    }
    .encode();
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
    got.run_for = run_for;
    got
}

/// What the children wrote: every section, every ask that ran out, how
/// many sections each had, the sums of their attempt counts (all, woken,
/// split), and each process's probe lines (`P kind ...`, split in words).
#[derive(Default)]
pub struct Got {
    pub secs: Vec<Section>,
    /// `(asked, gave up, mask)` of the asks that ran out with the run.
    pub unfinished: Vec<(u128, u128, u8)>,
    pub per_process: Vec<usize>,
    pub attempts: [usize; 3],
    pub probes: HashMap<u32, Vec<Vec<String>>>,
    pub run_for: Duration,
}

fn read(children: Vec<std::process::Child>) -> Got {
    let mut got = Got::default();
    for mut c in children {
        let mut n = 0;
        let pid = c.id();
        if let Some(out) = c.stdout.take() {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                let f: Vec<&str> = line.split(' ').collect();
                match f.split_first() {
                    Some((&"#", counts)) => {
                        let c = counts.iter().filter_map(|x| x.parse::<usize>().ok());
                        for (sum, c) in got.attempts.iter_mut().zip(c) {
                            *sum += c;
                        }
                    }
                    Some((&"S", rest)) => {
                        if let Some(s) = Section::parse(rest) {
                            got.secs.push(s);
                            n += 1;
                        }
                    }
                    Some((&"U", [asked, gave_up, mask])) => {
                        if let (Ok(a), Ok(g), Ok(m)) =
                            (asked.parse(), gave_up.parse(), mask.parse())
                        {
                            got.unfinished.push((a, g, m));
                        }
                    }
                    Some((&"P", rest)) => got
                        .probes
                        .entry(pid)
                        .or_default()
                        .push(rest.iter().map(|w| (*w).to_owned()).collect()),
                    _ => {}
                }
            }
        }
        let _ = c.wait();
        got.per_process.push(n);
    }
    got.secs.sort_unstable();
    got
}

/// The `q` quantile of sorted `v` (nearest rank); the default when empty.
pub fn quantile<T: Copy + Default>(v: &[T], q: f64) -> T {
    v.get(((v.len().max(1) - 1) as f64 * q).round() as usize)
        .copied()
        .unwrap_or_default()
}

pub fn nanos(n: u128) -> Duration {
    Duration::from_nanos(u64::try_from(n).unwrap_or(u64::MAX))
}

/// Sections that began before the one before them ended (sorted by start).
pub fn overlaps<'a>(secs: impl Iterator<Item = &'a Section>) -> usize {
    let mut last_end = None;
    let mut n = 0;
    for s in secs {
        if last_end.is_some_and(|e| s.start < e) {
            n += 1;
        }
        last_end = Some(last_end.map_or(s.end, |e: u128| e.max(s.end)));
    }
    n
}

/// What the parent measured of a run on one key.
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
    /// The gap between sections: from one section's end to the next's
    /// start, any process (the lock's idle time): p50, p90, p99.
    pub gap: [Duration; 3],
    /// The same where the next section is another process's: p50, p90.
    pub gap_across: [Duration; 2],
}

/// Measures a run on one key.
pub fn measure(got: &Got) -> Across {
    let Got {
        secs,
        per_process,
        attempts,
        run_for,
        ..
    } = got;
    let mut gaps: Vec<Duration> = secs
        .windows(2)
        .map(|w| nanos(w[1].start.saturating_sub(w[0].end)))
        .collect();
    gaps.sort_unstable();
    let mut gaps_across: Vec<Duration> = secs
        .windows(2)
        .filter(|w| w[1].pid != w[0].pid)
        .map(|w| nanos(w[1].start.saturating_sub(w[0].end)))
        .collect();
    gaps_across.sort_unstable();
    let same = secs.windows(2).filter(|w| w[1].pid == w[0].pid).count();
    let held: u128 = secs.iter().map(|s| s.end.saturating_sub(s.start)).sum();
    let span = match (secs.first(), secs.last()) {
        (Some(a), Some(b)) => b.end.saturating_sub(a.start).max(1),
        _ => 1,
    };
    // A process's wait: from the end of one of its sections to the start
    // of its next (it asked again at once).
    let mut waits: Vec<Duration> = Vec::new();
    let mut last: HashMap<u32, u128> = HashMap::new();
    for s in secs {
        if let Some(prev) = last.insert(s.pid, s.end) {
            waits.push(nanos(s.start.saturating_sub(prev)));
        }
    }
    let (first, final_end) = (
        secs.first().map_or(0, |s| s.start),
        secs.last().map_or(0, |s| s.end),
    );
    let mut starved = waits.iter().copied().max().unwrap_or_default();
    if per_process.contains(&0) {
        starved = nanos(final_end.saturating_sub(first));
    }
    for (&pid, &end) in &last {
        let head = secs.iter().find(|s| s.pid == pid).map_or(0, |s| s.start);
        starved = starved
            .max(nanos(head.saturating_sub(first)))
            .max(nanos(final_end.saturating_sub(end)));
    }
    waits.sort_unstable();
    let sum: f64 = per_process.iter().map(|&n| n as f64).sum();
    let sq: f64 = per_process.iter().map(|&n| (n as f64).powi(2)).sum();
    Across {
        sections_per_sec: secs.len() as f64 / run_for.as_secs_f64(),
        busy: held as f64 / span as f64,
        wait_p50: quantile(&waits, 0.5),
        wait_p99: quantile(&waits, 0.99),
        wait_max: quantile(&waits, 1.0),
        same_next: same as f64 / secs.len().saturating_sub(1).max(1) as f64,
        jain: if sq > 0.0 {
            sum * sum / (per_process.len() as f64 * sq)
        } else {
            0.0
        },
        per_process: per_process.clone(),
        overlaps: overlaps(secs.iter()),
        starved,
        attempts: attempts.map(|a| a as f64 / secs.len().max(1) as f64),
        gap: [0.5, 0.9, 0.99].map(|q| quantile(&gaps, q)),
        gap_across: [0.5, 0.9].map(|q| quantile(&gaps_across, q)),
    }
}

pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

impl Across {
    /// One row for the bench's table.
    pub fn row(&self, name: &str) -> String {
        format!(
            "{name:<28} {:>6.0} sections/s  busy {:>3.0} %  gap between sections p50 {:.2} ms p90 {:.2} ms p99 {:.2} ms (to another process p50 {:.2} ms p90 {:.2} ms)  wait p50 {:.1} ms p99 {:.1} ms max {:.1} ms  Jain {:.2}  overlaps {}  same process next {:>3.0} %  per process {:?}  longest starved {:.0} ms  attempts/section {:.2} (woken {:.2}, split {:.2})",
            self.sections_per_sec,
            self.busy * 100.0,
            ms(self.gap[0]),
            ms(self.gap[1]),
            ms(self.gap[2]),
            ms(self.gap_across[0]),
            ms(self.gap_across[1]),
            ms(self.wait_p50),
            ms(self.wait_p99),
            ms(self.wait_max),
            self.jain,
            self.overlaps,
            self.same_next * 100.0,
            self.per_process,
            ms(self.starved),
            self.attempts[0],
            self.attempts[1],
            self.attempts[2],
        )
    }
}

/// With `QUORUMLOCK_BENCH_TRACE_DIR` set: every quorumlock log line of a child, with the wall clock, to
/// `$QUORUMLOCK_BENCH_TRACE_DIR/<pid>.log`.
struct TraceFile(std::sync::Mutex<std::io::BufWriter<std::fs::File>>);

impl log::Log for TraceFile {
    fn enabled(&self, m: &log::Metadata<'_>) -> bool {
        m.target().starts_with("quorumlock")
    }
    fn log(&self, r: &log::Record<'_>) {
        if self.enabled(r.metadata()) {
            let line = format!(
                "{} {:?} {} {} {}\n",
                wall_ns(),
                std::thread::current().name().unwrap_or("-"),
                r.level(),
                r.target(),
                r.args()
            );
            let mut f = self.0.lock().unwrap_or_else(|e| e.into_inner());
            let _ = std::io::Write::write_all(&mut *f, line.as_bytes());
        }
    }
    fn flush(&self) {
        let mut f = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let _ = std::io::Write::flush(&mut *f);
    }
}

fn trace_file() -> Option<&'static TraceFile> {
    let dir = std::env::var_os("QUORUMLOCK_BENCH_TRACE_DIR")?;
    let path = std::path::Path::new(&dir).join(format!("{}.log", std::process::id()));
    let f = std::fs::File::create(path).ok()?;
    let t: &'static TraceFile = Box::leak(Box::new(TraceFile(std::sync::Mutex::new(
        std::io::BufWriter::new(f),
    ))));
    log::set_logger(t).ok()?;
    log::set_max_level(log::LevelFilter::Trace);
    Some(t)
}
