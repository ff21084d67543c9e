//! Issue 41 in the simulation: after a majority outage ends, the virtual
//! time to the next granted section.

use super::plan::{Fault, Mix, Plan, MS};
use super::tests::{describe, env_u64};

/// How a majority goes away and comes back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Away {
    Pause,
    /// Crash, restart with its data.
    Crash,
    /// Crash, restart without its data (the restart rule then holds its
    /// votes back for the longest TTL).
    CrashWipe,
    Isolate,
}

impl Away {
    const ALL: [Away; 4] = [Away::Pause, Away::Crash, Away::CrashWipe, Away::Isolate];

    fn name(self) -> &'static str {
        match self {
            Away::Pause => "pause/resume",
            Away::Crash => "crash/restart",
            Away::CrashWipe => "crash/restart wiped",
            Away::Isolate => "isolate/heal",
        }
    }

    fn faults(self, node: usize) -> (Fault, Fault) {
        match self {
            Away::Pause => (Fault::Pause(node), Fault::Resume(node)),
            Away::Crash => (Fault::Crash(node), Fault::Restart { node, wipe: false }),
            Away::CrashWipe => (Fault::Crash(node), Fault::Restart { node, wipe: true }),
            Away::Isolate => (Fault::Isolate(node), Fault::Heal(node)),
        }
    }
}

/// The nodes each outage takes away, in turn (3 of 5, as the bench row).
const SETS: [[usize; 3]; 6] = [
    [0, 1, 2],
    [2, 3, 4],
    [0, 3, 4],
    [1, 2, 3],
    [0, 1, 4],
    [1, 3, 4],
];

/// A seeded plan (its settings and network drawn as a standard run's) of
/// 5 nodes, `clients` × 1 on one resource, with `outages` majority outages
/// of `away`, `length` long and `gap` apart: the plan, and when each
/// outage ends (the majority reachable again).
fn plan(seed: u64, away: Away, wakeups: bool) -> (Plan, Vec<u64>) {
    let clients = env_u64("QUORUMLOCK_SIM_OUTAGE_CLIENTS").unwrap_or(4) as usize;
    let length = env_u64("QUORUMLOCK_SIM_OUTAGE_MS").unwrap_or(400) * MS;
    let gap = 400 * MS;
    let outages = 4;
    let mut p = Plan::new(seed, Mix::Standard);
    p.nodes = 5;
    p.entries = (0..5).collect();
    p.evicting = vec![false; 5];
    p.rates = vec![1.0; 5];
    p.clients = clients;
    p.threads = 1;
    p.resources = env_u64("QUORUMLOCK_SIM_OUTAGE_RESOURCES").unwrap_or(1) as usize;
    p.stall = 0.0;
    p.foreign.clear();
    if std::env::var_os("QUORUMLOCK_SIM_OUTAGE_CALM").is_some() {
        p.net = super::plan::Net::calm();
    }
    p.wakeups = wakeups;
    p.faults.clear();
    let mut ends = Vec::new();
    for (i, set) in SETS.iter().cycle().take(outages).enumerate() {
        let at = gap + i as u64 * (gap + length);
        for &n in set {
            let (down, up) = away.faults(n);
            p.faults.push((at, down));
            p.faults.push((at + length, up));
        }
        ends.push(at + length);
    }
    p.run_for = outages as u64 * (gap + length) + gap;
    p.faults.push((p.run_for, Fault::HealAll));
    (p, ends)
}

/// Per outage, the time from its end to the next section granted (ms;
/// `None` where none began before the next outage); and the same figure
/// from the middle of the up time before each outage (the workload's own
/// gaps, as a baseline).
fn after_outages_and_before(
    seed: u64,
    away: Away,
    wakeups: bool,
) -> (Vec<Option<f64>>, Vec<Option<f64>>) {
    let (p, ends) = plan(seed, away, wakeups);
    if std::env::var_os("QUORUMLOCK_SIM_OUTAGE_PRINT").is_some() {
        println!("seed {seed:#x}: {:?} {:?}", p.settings, p.net);
    }
    let r = super::run_plan(p);
    if !r.violations.is_empty() {
        println!("seed {seed:#x} {}: {}", away.name(), describe(&r));
    }
    let trace = std::env::var_os("QUORUMLOCK_SIM_OUTAGE_PRINT").is_some();
    let length = ends.first().copied().unwrap_or(0) - 400 * MS;
    let baseline = ends
        .iter()
        .map(|&end| {
            let mid = end - length - 200 * MS;
            let next = r.grants_at.iter().copied().find(|&g| g >= mid);
            next.filter(|&g| g < mid + 200 * MS)
                .map(|g| (g - mid) as f64 / 1e6)
        })
        .collect();
    let after = ends
        .iter()
        .map(|&end| {
            let next = r.grants_at.iter().copied().find(|&g| g >= end);
            let d = next
                .filter(|&g| g < end + 400 * MS)
                .map(|g| (g - end) as f64 / 1e6);
            if trace {
                println!(
                    "seed {seed:#x} {} end {:.3} ms: next {d:?}",
                    away.name(),
                    end as f64 / 1e6
                );
            }
            d
        })
        .collect();
    (after, baseline)
}

/// Issue 41's figure in the simulation: per kind of majority outage, the
/// time from its end to the next section, mean and max over seeds, with
/// wake-ups on and off (`cargo test --release --all-features --lib
/// outage_figures -- --ignored --nocapture`; `QUORUMLOCK_SIM_SEEDS`,
/// `QUORUMLOCK_SIM_OUTAGE_{CLIENTS,MS,RESOURCES,CALM,PRINT,FIRST}`).
#[test]
#[ignore = "a search, run by hand"]
fn outage_figures() {
    let seeds = env_u64("QUORUMLOCK_SIM_SEEDS").unwrap_or(200);
    let first = env_u64("QUORUMLOCK_SIM_OUTAGE_FIRST").unwrap_or(0);
    let only = std::env::var("QUORUMLOCK_SIM_OUTAGE_KIND").ok();
    for away in Away::ALL {
        if only.as_deref().is_some_and(|o| !away.name().starts_with(o)) {
            continue;
        }
        for wakeups in [false, true] {
            let which = std::env::var("QUORUMLOCK_SIM_OUTAGE_WAKEUPS").ok();
            if which.is_some_and(|w| (w == "on") != wakeups) {
                continue;
            }
            let (mut all, mut base) = (Vec::new(), Vec::new());
            for s in first..first + seeds {
                let (a, b) = after_outages_and_before(s, away, wakeups);
                all.extend(a);
                base.extend(b);
            }
            let base: Vec<f64> = base.into_iter().flatten().collect();
            let base_mean = base.iter().sum::<f64>() / base.len().max(1) as f64;
            let got: Vec<f64> = all.iter().flatten().copied().collect();
            let mut sorted = got.clone();
            sorted.sort_by(f64::total_cmp);
            let pct = |q: f64| {
                sorted
                    .get(((sorted.len() as f64 - 1.0) * q) as usize)
                    .copied()
            };
            let mean = got.iter().sum::<f64>() / got.len().max(1) as f64;
            println!(
                "{:22} wake-ups {:3}: {} outages, {} with no section within 400 ms; mean {mean:6.1} ms, p50 {:6.1}, p90 {:6.1}, max {:6.1}; from mid-up time (baseline) mean {base_mean:5.1} ms",
                away.name(),
                if wakeups { "on" } else { "off" },
                all.len(),
                all.len() - got.len(),
                pct(0.5).unwrap_or(0.0),
                pct(0.9).unwrap_or(0.0),
                pct(1.0).unwrap_or(0.0),
            );
        }
    }
}

/// In a seeded run's plan, each moment a majority of nodes is reachable
/// again after it was not (a node paused, down, isolated or muted is
/// away), before the workload ends, with the fault that ended it.
fn majority_returns(p: &Plan) -> Vec<(u64, Fault)> {
    outages_of(p)
        .into_iter()
        .map(|(_, end, f)| (end, f))
        .collect()
}

/// The majority outages of a plan: start, end and the fault that ended it.
fn outages_of(p: &Plan) -> Vec<(u64, u64, Fault)> {
    let mut faults = p.faults.clone();
    faults.sort_by_key(|f| f.0);
    let n = p.nodes;
    let (mut down, mut paused) = (vec![false; n], vec![false; n]);
    let (mut isolated, mut muted) = (vec![false; n], vec![false; n]);
    let quorum = crate::algorithm::quorum::quorum(n);
    let up = |d: &[bool], p: &[bool], i: &[bool], m: &[bool]| {
        (0..n).filter(|&k| !(d[k] || p[k] || i[k] || m[k])).count()
    };
    let mut out = Vec::new();
    let mut since = None;
    for (at, f) in faults {
        if at >= p.run_for {
            break;
        }
        let before = up(&down, &paused, &isolated, &muted);
        match f {
            Fault::Pause(i) if !down[i] => paused[i] = true,
            Fault::Resume(i) => paused[i] = false,
            Fault::Crash(i) => {
                down[i] = true;
                paused[i] = false;
            }
            Fault::Restart { node, .. } => down[node] = false,
            Fault::Isolate(i) => isolated[i] = true,
            Fault::Heal(i) => isolated[i] = false,
            Fault::Mute(i) => muted[i] = true,
            Fault::Unmute(i) => muted[i] = false,
            _ => {}
        }
        let after = up(&down, &paused, &isolated, &muted);
        if before >= quorum && after < quorum {
            since = Some(at);
        }
        if before < quorum && after >= quorum {
            out.push((since.take().unwrap_or(0), at, f));
        }
    }
    out
}

fn kind_of(f: Fault) -> &'static str {
    match f {
        Fault::Resume(_) => "resume",
        Fault::Restart { wipe: true, .. } => "restart wiped",
        Fault::Restart { .. } => "restart",
        Fault::Heal(_) => "heal",
        Fault::Unmute(_) => "unmute",
        _ => "other",
    }
}

/// As [`outage_figures`], over the random plans of a mix
/// (`QUORUMLOCK_SIM_MIX`, standard by default): each majority's return,
/// grouped by the fault that ended the outage; the time to the next
/// section within a second (and before the workload ends).
#[test]
#[ignore = "a search, run by hand"]
fn outage_figures_random_plans() {
    let seeds = env_u64("QUORUMLOCK_SIM_SEEDS").unwrap_or(200);
    let mix = std::env::var("QUORUMLOCK_SIM_MIX")
        .ok()
        .and_then(|m| Mix::parse(&m))
        .unwrap_or(Mix::Standard);
    let print = std::env::var_os("QUORUMLOCK_SIM_OUTAGE_PRINT").is_some();
    let first = env_u64("QUORUMLOCK_SIM_OUTAGE_FIRST").unwrap_or(0);
    for wakeups in [false, true] {
        let mut per: std::collections::BTreeMap<&str, (Vec<f64>, usize)> = Default::default();
        let mut base = (0.0, 0.0);
        for seed in first..first + seeds {
            let mut p = Plan::new(seed, mix);
            p.wakeups = wakeups;
            let outages = outages_of(&p);
            let returns = majority_returns(&p);
            let run_for = p.run_for;
            let r = super::run_plan(p);
            // The workload's own gaps between sections, where no majority
            // outage touches them: the mean time from a moment to the
            // next section (sum of squares over twice the sum).
            let mut prev = None;
            for &g in r.grants_at.iter().filter(|&&g| g < run_for) {
                if let Some(p) = prev {
                    if !outages.iter().any(|&(s, e, _)| s < g && e > p) {
                        let d = (g - p) as f64 / 1e6;
                        base.0 += d * d / 2.0;
                        base.1 += d;
                    }
                }
                prev = Some(g);
            }
            for (end, f) in returns {
                let e = per.entry(kind_of(f)).or_default();
                let next = r.grants_at.iter().copied().find(|&g| g >= end);
                match next.filter(|&g| g < (end + 1_000 * MS).min(run_for)) {
                    Some(g) => {
                        let d = (g - end) as f64 / 1e6;
                        if print {
                            println!(
                                "seed {seed:#x} wake-ups {wakeups} {f:?} at {:.3} ms: {d:.1} ms",
                                end as f64 / 1e6
                            );
                        }
                        e.0.push(d);
                    }
                    None => e.1 += 1,
                }
            }
        }
        let mut all = Vec::new();
        for (kind, (v, none)) in &per {
            all.extend(v.iter().copied());
            let mean = v.iter().sum::<f64>() / v.len().max(1) as f64;
            let max = v.iter().copied().fold(0.0, f64::max);
            println!(
                "{:5} {kind:14} wake-ups {:3}: {:4} returns ({none} with none after); mean {mean:6.1} ms, max {max:6.1}",
                mix.name(),
                if wakeups { "on" } else { "off" },
                v.len()
            );
        }
        let mean = all.iter().sum::<f64>() / all.len().max(1) as f64;
        println!(
            "{:5} all            wake-ups {:3}: {:4} returns; mean {mean:6.1} ms; baseline (from a moment with no outage) {:5.1} ms",
            mix.name(),
            if wakeups { "on" } else { "off" },
            all.len(),
            base.0 / f64::max(base.1, 1e-9)
        );
    }
}
