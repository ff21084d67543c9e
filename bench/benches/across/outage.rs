//! Majority outages (issue 41: "after a majority outage ends: time to the
//! next section"): 4 processes × 1 thread on one key, 5 nodes, 2 ms holds,
//! asking again at once (as the 4 × 1 row), while 3 of the 5 nodes go away
//! for [`LENGTH`] several times, [`GAP`] apart: hung (SIGSTOP, or `docker
//! pause`: TCP stays up, nothing is answered) or paused (`CLIENT PAUSE ms
//! ALL`: the node holds every command until the pause ends).
//!
//! When a node is back is read, not assumed: a probe connection per node
//! sends a `PING` during the outage, and the moment its answer arrives (wall
//! clock, as the children's section lines) is the node's return. The
//! majority is back when the first of the three answers (with the two that
//! stayed up, three of five); per outage the row gives the time from then
//! to the start of the next section, and its mean and max over outages.

use std::sync::Mutex;
use std::time::Duration;

use super::common::Cluster;
use super::processes::{self, ms, nanos, wall_ns, Got, Mode};

/// How long each outage lasts.
pub const LENGTH: Duration = Duration::from_secs(1);
/// Up time between outages (and before the first).
const GAP: Duration = Duration::from_millis(1_500);
/// Outages per run.
const OUTAGES: usize = 6;
/// The nodes each outage takes away, in turn (3 of 5).
const SETS: [[usize; 3]; 6] = [
    [0, 1, 2],
    [2, 3, 4],
    [0, 3, 4],
    [1, 2, 3],
    [0, 1, 4],
    [1, 3, 4],
];

/// How the nodes go away.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// SIGSTOP / SIGCONT (`docker pause` on that backend): a hung node.
    Hung,
    /// `CLIENT PAUSE <ms> ALL`: every command held until the pause ends.
    Paused,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Hung => "hung (SIGSTOP)",
            Kind::Paused => "CLIENT PAUSE ALL",
        }
    }
}

/// One outage: when it began and when each of its nodes answered again
/// (wall-clock ns; `None`: its probe failed).
pub struct Outage {
    pub nodes: [usize; 3],
    pub began: u128,
    pub back: Vec<Option<u128>>,
}

impl Outage {
    /// When the majority was back: the first of the nodes to answer.
    fn majority_back(&self) -> Option<u128> {
        self.back.iter().flatten().copied().min()
    }

    /// When every node of it was back.
    fn all_back(&self) -> Option<u128> {
        if self.back.iter().any(Option::is_none) {
            return None;
        }
        self.back.iter().flatten().copied().max()
    }
}

/// Takes `nodes` away as `kind` says, for [`LENGTH`]: when it began and
/// when each answered again.
fn one(c: &Cluster, kind: Kind, nodes: [usize; 3]) -> Outage {
    use redis::Value;
    // Probe connections made while the nodes answer; a read timeout well
    // past the outage.
    let mut probes: Vec<Option<redis::Connection>> = nodes
        .iter()
        .map(|&i| c.try_conn(i, LENGTH.saturating_mul(5)).ok())
        .collect();
    let ping = redis::cmd("PING").get_packed_command();
    match kind {
        Kind::Hung => {
            for &i in &nodes {
                c.pause(i);
            }
            // Sent to the hung nodes: answered once they run again.
            for p in probes.iter_mut().flatten() {
                let _ = p.send_packed_command(&ping);
            }
        }
        Kind::Paused => {
            let pause = redis::cmd("CLIENT")
                .arg("PAUSE")
                .arg(LENGTH.as_millis() as u64)
                .arg("ALL")
                .get_packed_command();
            for p in probes.iter_mut() {
                let ok = p.as_mut().is_some_and(|p| {
                    p.send_packed_command(&pause).is_ok()
                        && matches!(p.recv_response(), Ok(Value::Okay))
                        && p.send_packed_command(&ping).is_ok()
                });
                if !ok {
                    *p = None;
                }
            }
        }
    }
    // The majority is away once the last of its nodes is.
    let began = wall_ns();
    let back = std::thread::scope(|s| {
        let waits: Vec<_> = probes
            .iter_mut()
            .map(|p| {
                s.spawn(move || {
                    let p = p.as_mut()?;
                    matches!(p.recv_response(), Ok(Value::SimpleString(_))).then(wall_ns)
                })
            })
            .collect();
        if kind == Kind::Hung {
            std::thread::sleep(LENGTH);
            for &i in &nodes {
                c.unpause(i);
            }
        }
        waits.into_iter().map(|h| h.join().ok().flatten()).collect()
    });
    Outage { nodes, began, back }
}

/// A run of 4 × 1 on `key` with [`OUTAGES`] outages of `kind`: what the
/// children wrote, and the outages.
pub fn run(c: &Cluster, key: &str, kind: Kind, ttl: Duration) -> (Got, Vec<Outage>) {
    let outages = Mutex::new(Vec::new());
    let run_for = GAP
        .saturating_add(LENGTH)
        .saturating_mul(OUTAGES as u32)
        .saturating_add(GAP);
    let got = processes::run(&c.urls(), (key, Mode::Lock), 4, 1, (run_for, ttl), || {
        for nodes in SETS.iter().cycle().take(OUTAGES) {
            std::thread::sleep(GAP);
            let o = one(c, kind, *nodes);
            outages.lock().unwrap_or_else(|e| e.into_inner()).push(o);
        }
    });
    (got, outages.into_inner().unwrap_or_else(|e| e.into_inner()))
}

/// The rows of a run: one per outage, then the summary.
pub fn rows(name: &str, kind: Kind, got: &Got, outages: &[Outage], left: bool) -> Vec<String> {
    let mut out = Vec::new();
    let mut to_next = Vec::new();
    for (n, o) in outages.iter().enumerate() {
        let (Some(back), Some(all)) = (o.majority_back(), o.all_back()) else {
            out.push(format!("  outage {n} nodes {:?}: a probe failed", o.nodes));
            continue;
        };
        // Sections begun while the majority was away (must be none).
        let inside = got
            .secs
            .iter()
            .filter(|s| s.start > o.began && s.start < back)
            .count();
        let next = got.secs.iter().map(|s| s.start).find(|&t| t >= back);
        let line = match next {
            Some(t) => {
                let d = nanos(t - back);
                to_next.push(d);
                format!("next section {:>6.1} ms after", ms(d))
            }
            None => "no section after it".to_owned(),
        };
        if std::env::var_os("QUORUMLOCK_BENCH_TRACE_DIR").is_some() {
            out.push(format!(
                "  outage {n} (wall ns): began {} back {:?}",
                o.began, o.back
            ));
        }
        out.push(format!(
            "  outage {n} nodes {:?}: majority back {:.0} ms after it began (all back {:.1} ms later), {line}; sections during it {inside}",
            o.nodes,
            ms(nanos(back.saturating_sub(o.began))),
            ms(nanos(all - back)),
        ));
    }
    let mean = if to_next.is_empty() {
        Duration::ZERO
    } else {
        to_next.iter().sum::<Duration>() / to_next.len() as u32
    };
    let max = to_next.iter().copied().max().unwrap_or_default();
    let r = processes::measure(got);
    out.insert(
        0,
        format!(
            "{name:<28} {}: after a majority outage ends, time to the next section mean {:.1} ms max {:.1} ms over {} outages  overlaps {}  key left {left}  {:.0} sections/s  per process {:?}",
            kind.name(),
            ms(mean),
            ms(max),
            to_next.len(),
            r.overlaps,
            r.sections_per_sec,
            r.per_process,
        ),
    );
    out
}
