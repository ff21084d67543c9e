//! Where one hand-over's time goes, across processes: from (a) the holder's
//! release call → (b) its return (a majority answered) → (c) the waiting
//! process's subscriber thread reads the release message → (d) the waiting
//! thread wakes from its wait → (e) its winning attempt is sent → (e') that
//! attempt's decision → (f) `acquire_for` returns.
//!
//! (a), (b) and (f) are the section lines' times. In a child of a probed
//! run, (c) and (d) come from the library's trace lines (a logger that keeps
//! only those two, with the wall clock when they were logged; the library
//! logs nothing unless a logger is installed, so only this run pays for it),
//! (e) and (e') from the winning attempt's event (its end less its
//! `elapsed`). All in wall-clock ns, which the processes of one machine
//! share.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use log::{Level, LevelFilter, Log, Metadata, Record};

use super::processes::{nanos, quantile, wall_ns, Got};

/// The subscriber thread's line when a release message wakes a key's
/// waiters (src/driver/notify/thread.rs).
const READ_TARGET: &str = "quorumlock::driver::notify::thread";
const READ: &str = "release message read";
/// The waiter's line when it wakes (src/lock/engine/wait.rs).
const WOKEN_TARGET: &str = "quorumlock::lock::engine::wait";
const WOKEN: &str = "woken (true); trying in ";

/// The logger of a probed child: keeps `P read <ns>` and
/// `P woken <ns> <spacing ns>` lines.
#[derive(Default)]
pub struct Probe {
    lines: Mutex<Vec<String>>,
}

impl Probe {
    /// Installs the logger for the process, at trace level.
    pub fn install() -> &'static Probe {
        let p: &'static Probe = Box::leak(Box::default());
        log::set_logger(p).expect("the child's only logger");
        log::set_max_level(LevelFilter::Trace);
        p
    }

    /// What it kept.
    pub fn lines(&self) -> Vec<String> {
        std::mem::take(&mut *self.lines.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

impl Log for Probe {
    fn enabled(&self, m: &Metadata<'_>) -> bool {
        m.level() == Level::Trace && (m.target() == READ_TARGET || m.target() == WOKEN_TARGET)
    }

    fn log(&self, r: &Record<'_>) {
        if !self.enabled(r.metadata()) {
            return;
        }
        let now = wall_ns();
        let msg = r.args().to_string();
        let line = if msg.contains(READ) {
            format!("P read {now}")
        } else if let Some((_, spacing)) = msg.split_once(WOKEN) {
            format!("P woken {now} {}", parse_debug_duration(spacing).as_nanos())
        } else {
            return;
        };
        self.lines
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(line);
    }

    fn flush(&self) {}
}

/// A winning attempt: `P sent <send ns> <decision ns> <woken>`.
pub fn sent_line(send: u128, decided: u128, woken: bool) -> String {
    format!("P sent {send} {decided} {}", u8::from(woken))
}

/// A `Duration`'s `{:?}` (`812.5µs`, `1.2ms`, `0ns`, `1s`).
fn parse_debug_duration(s: &str) -> Duration {
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (n, unit) = s.split_at(split);
    let scale = match unit.trim() {
        "ns" => 1e-9,
        "µs" => 1e-6,
        "ms" => 1e-3,
        _ => 1.0,
    };
    Duration::from_secs_f64(n.parse::<f64>().unwrap_or(0.0) * scale)
}

/// One process's probe points, each list in time order.
#[derive(Default)]
struct Points {
    read: Vec<u128>,
    /// (when, the spacing slept after it).
    woken: Vec<(u128, u128)>,
    /// (sent, decided, woken).
    sent: Vec<(u128, u128, bool)>,
}

impl Points {
    fn of(lines: &[Vec<String>]) -> Points {
        let mut p = Points::default();
        let n = |w: &String| w.parse::<u128>().unwrap_or(0);
        for l in lines {
            match &l[..] {
                [k, t] if k == "read" => p.read.push(n(t)),
                [k, t, s] if k == "woken" => p.woken.push((n(t), n(s))),
                [k, t, d, w] if k == "sent" => p.sent.push((n(t), n(d), w == "1")),
                _ => {}
            }
        }
        p.read.sort_unstable();
        p.woken.sort_unstable();
        p.sent.sort_unstable_by_key(|s| s.1);
        p
    }
}

/// The last of `v` (sorted by `at`) in `from..=to`.
fn last_in<T: Copy>(v: &[T], at: impl Fn(&T) -> u128, from: u128, to: u128) -> Option<T> {
    let i = v.partition_point(|x| at(x) <= to);
    v[..i].last().copied().filter(|x| at(x) >= from)
}

const STEPS: [&str; 6] = [
    "a>b  release call -> its majority answered",
    "b>c  -> message read by the waiter's subscriber",
    "c>d  -> waiting thread awake",
    "d>e  -> winning attempt sent",
    "e>e' -> its decision",
    "e'>f -> acquire_for returns",
];

/// The breakdown of a probed run's hand-overs from one process to another,
/// as lines for the bench's table.
pub fn breakdown(got: &Got) -> Vec<String> {
    let points: HashMap<u32, Points> = got
        .probes
        .iter()
        .map(|(&pid, l)| (pid, Points::of(l)))
        .collect();
    let mut steps: Vec<Vec<i128>> = vec![Vec::new(); STEPS.len()];
    let (mut total, mut spacing, mut not_woken) = (Vec::new(), Vec::new(), Vec::new());
    let (mut to_read, mut overshoot) = (Vec::new(), Vec::new());
    let (mut handovers, mut unmatched) = (0, 0);
    for w in got.secs.windows(2) {
        let (s0, s1) = (&w[0], &w[1]);
        if s0.pid == s1.pid {
            continue;
        }
        handovers += 1;
        let (a, b, f) = (s0.end, s0.released, s1.start);
        let p = points.get(&s1.pid);
        let Some((e, e2, woken)) = p.and_then(|p| last_in(&p.sent, |s| s.1, a, f)) else {
            unmatched += 1;
            continue;
        };
        if !woken {
            not_woken.push(f.saturating_sub(a));
            continue;
        }
        let Some((d, slept)) = p.and_then(|p| last_in(&p.woken, |w| w.0, a, e)) else {
            unmatched += 1;
            continue;
        };
        let Some(c) = p.and_then(|p| last_in(&p.read, |&r| r, a, d)) else {
            unmatched += 1;
            continue;
        };
        let at = [a, b, c, d, e, e2, f].map(|t| t as i128);
        for (i, s) in steps.iter_mut().enumerate() {
            s.push(at[i + 1] - at[i]);
        }
        total.push(at[6] - at[0]);
        to_read.push(at[2] - at[0]);
        spacing.push(slept as i128);
        overshoot.push(at[4] - at[3] - slept as i128);
    }
    let us = |v: &mut Vec<i128>, q: f64| {
        v.sort_unstable();
        quantile(v, q) as f64 / 1e3
    };
    let mut lines = vec![format!(
        "hand-over breakdown: {handovers} hand-overs to another process, {} by a wake-up \
         (below), {} by a try not woken (a>f p50 {:.0} us), {unmatched} unmatched",
        total.len(),
        not_woken.len(),
        {
            not_woken.sort_unstable();
            nanos(quantile(&not_woken, 0.5)).as_secs_f64() * 1e6
        }
    )];
    let mut sum = 0.0;
    for (name, v) in STEPS.iter().zip(&mut steps) {
        let p50 = us(v, 0.5);
        sum += p50;
        lines.push(format!(
            "  {name:<52} p50 {p50:>7.0} us  p90 {:>7.0} us",
            us(v, 0.9)
        ));
    }
    lines.push(format!(
        "  {:<52} p50 {:>7.0} us  p90 {:>7.0} us  (sum of the step p50s {sum:.0} us)",
        "a>f  the whole hand-over (the gap between sections)",
        us(&mut total, 0.5),
        us(&mut total, 0.9),
    ));
    lines.push(format!(
        "  {:<52} p50 {:>7.0} us  p90 {:>7.0} us",
        "a>c: release call -> message read (b>c < 0: read first)",
        us(&mut to_read, 0.5),
        us(&mut to_read, 0.9),
    ));
    lines.push(format!(
        "  {:<52} p50 {:>7.0} us  p90 {:>7.0} us",
        "of d>e: the spacing slept after the wake-up",
        us(&mut spacing, 0.5),
        us(&mut spacing, 0.9),
    ));
    lines.push(format!(
        "  {:<52} p50 {:>7.0} us  p90 {:>7.0} us",
        "of d>e: the rest (sleep overshoot, scheduling)",
        us(&mut overshoot, 0.5),
        us(&mut overshoot, 0.9),
    ));
    lines
}
