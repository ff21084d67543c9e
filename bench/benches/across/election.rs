//! Leader election across processes (issue 42's goals): [`PROCS`]
//! candidate processes (the bench run again as `common::candidates`'
//! child), each a client of its own running `Election::run` on the bench's
//! 5 nodes, TTL [`TTL`], retry pause [`PAUSE`] without jitter. The parent
//! makes leaders resign (after a random hold) and SIGKILLs some (starting a
//! new candidate in its place), in four stretches: the nodes healthy, one
//! node hung (SIGSTOP), two hung, one restarted empty (its vote held back
//! for a TTL, the leader's copy restored).
//!
//! Per stretch: failover after a resignation (from the leader's end of term
//! to the next election, wall clock, p50 / p99 / max, and how many winning
//! attempts were woken) and after a death (from the SIGKILL, against TTL +
//! retry pause). Over the run: terms, pairs of valid leases that overlap
//! (a lease: from its election to the earlier of its end and its validity
//! deadline, or its death), terms not rising from lease to lease,
//! successors elected before a dead leader's validity deadline, leases
//! lost, and the attempts a candidate makes per second. The bench fails
//! where one of the safety figures is not 0.

use std::process::Command;
use std::time::{Duration, Instant};

use quorumlock::Redlock;

use super::common::candidates::{leases, wall_ns, Candidates, Leases, Line, Spec};
use super::common::{wait_until, Cluster};
use super::processes::{ms, nanos, quantile, Rng};

/// Candidate processes at any time.
pub const PROCS: usize = 4;
pub const TTL: Duration = Duration::from_secs(1);
pub const PAUSE: Duration = Duration::from_millis(100);
/// A leader leads this long, at random, before it is told to resign.
const HOLD: (u64, u64) = (30, 150);
/// How long a leader leads before it is killed (its renewals under way).
const BEFORE_KILL: Duration = Duration::from_millis(400);
/// The longest wait for any line: a failure.
const LONG: Duration = Duration::from_secs(20);

/// The nodes' state in a stretch.
#[derive(Clone, Copy)]
enum Faults {
    Healthy,
    /// These nodes SIGSTOPped for the stretch.
    Hung(&'static [usize]),
    /// This node restarted empty as the stretch begins.
    Restarted(usize),
}

impl Faults {
    fn name(self) -> String {
        match self {
            Faults::Healthy => "healthy".into(),
            Faults::Hung(n) => format!("{} of 5 hung", n.len()),
            Faults::Restarted(_) => "1 restarted empty".into(),
        }
    }
}

/// A stretch's failovers, in ns.
#[derive(Default)]
struct Stretch {
    resigned: Vec<u128>,
    /// Of the resignations' successors, those whose winning attempt was
    /// woken, and those that were the same candidate again.
    woken: usize,
    same: usize,
    killed: Vec<u128>,
}

/// The run's candidates.
struct Run {
    c: Candidates,
    /// A new candidate's spec (`who` set when it starts).
    spec: Spec,
    rng: Rng,
}

impl Run {
    /// The first line read so far that `want`s, or the next one read.
    fn find(&mut self, want: impl Fn(&Line) -> bool) -> Line {
        if let Some(l) = self.c.lines.iter().find(|l| want(l)) {
            return l.clone();
        }
        if let Some(l) = self.c.wait_for(LONG, want) {
            return l;
        }
        let tail = self.c.lines.len().saturating_sub(30);
        let tail: Vec<String> = self.c.lines[tail..].iter().map(Line::to_string).collect();
        panic!(
            "election: no line the bench waits for in {LONG:?}; the last read:\n{}",
            tail.join("\n")
        );
    }

    /// The leader now: the last elected, unless its term ended or it died
    /// (then the next one).
    fn leader(&mut self) -> Line {
        let until = Instant::now() + LONG;
        loop {
            let c = &self.c;
            let last = c.lines.iter().rev().find(|l| l.is("ELECTED"));
            let on = last.filter(|l| {
                let ended = c.of(l.who(), "ENDED").iter().any(|e| e.term() == l.term());
                !ended && !c.killed.iter().any(|&(w, _)| w == l.who())
            });
            if let Some(l) = on {
                return l.clone();
            }
            self.c.next(until).expect("a leader");
        }
    }

    /// The first election after `since`.
    fn successor(&mut self, since: u128) -> Line {
        self.find(|l| l.is("ELECTED") && l.at() >= since)
    }

    fn resign(&mut self, s: &mut Stretch) {
        let l = self.leader();
        let hold = HOLD.0 + self.rng.below(HOLD.1 - HOLD.0);
        self.c.read_for(Duration::from_millis(hold));
        let (who, term) = (l.who(), l.term());
        self.c.resign(who, term);
        let ended = self.find(|e| e.is("ENDED") && e.who() == who && e.term() == term);
        if ended.words[4] != "resigned" {
            // Lost before it was told (counted with the leases).
            return;
        }
        // (Itself, where no other candidate was elected within its retry
        // pause.)
        let next = self.successor(ended.at());
        s.resigned.push(next.at().saturating_sub(ended.at()));
        s.same += usize::from(next.who() == who);
        let won = self.c.of(next.who(), "WON");
        if won.last().is_some_and(|w| w.words[2] == "1") {
            s.woken += 1;
        }
    }

    fn kill(&mut self, s: &mut Stretch) {
        let l = self.leader();
        self.c.read_for(BEFORE_KILL);
        let (who, term) = (l.who(), l.term());
        if self.c.of(who, "ENDED").iter().any(|e| e.term() == term) {
            // Its term ended meanwhile (under faults).
            return;
        }
        let at = self.c.kill(who);
        let next = self.successor(at);
        s.killed.push(next.at().saturating_sub(at));
        self.spec.who = self.c.len();
        self.c.spawn(&self.spec);
    }
}

fn p(v: &[u128], q: f64) -> f64 {
    ms(nanos(quantile(v, q)))
}

/// The `election` row: its lines, and whether every safety figure was 0.
pub fn run(c: &Cluster, resigns: usize, kills: usize) -> (Vec<String>, bool) {
    let exe = std::env::current_exe().expect("the bench's own path");
    let name = format!("bench:across:election:{}", wall_ns());
    // Production settings: candidates start while a node is held back
    // after its restart, and a client that met the node only then would
    // count its vote with `fresh_cluster` (as documented). The nodes' lock
    // history must then be one TTL old (and their uptime 2 s) first.
    let warm = Redlock::builder()
        .fresh_cluster(true)
        .nodes(c.urls())
        .build()
        .expect("client");
    assert!(c.write_history(&warm, TTL), "no lock history written");
    let probe = Redlock::builder().nodes(c.urls()).build().expect("client");
    let voted = || probe.try_lock(&format!("{name}:warm"), TTL).is_ok();
    assert!(wait_until(LONG, voted), "the nodes do not vote");
    let mut spec = Spec::new(0, c.urls(), &name, TTL);
    spec.pause = PAUSE;
    spec.fresh = false;
    let mut run = Run {
        c: Candidates::new(move || Command::new(&exe)),
        spec: spec.clone(),
        rng: Rng::new(0),
    };
    for who in 0..PROCS {
        spec.who = who;
        run.c.spawn(&spec);
    }
    let started = Instant::now();
    let stretches = [
        Faults::Healthy,
        Faults::Hung(&[0]),
        Faults::Hung(&[1, 2]),
        Faults::Restarted(3),
    ];
    let mut out = Vec::new();
    for faults in stretches {
        match faults {
            Faults::Healthy => {}
            Faults::Hung(nodes) => nodes.iter().for_each(|&i| c.pause(i)),
            Faults::Restarted(i) => c.restart(i),
        }
        let mut s = Stretch::default();
        for i in 0..resigns.max(kills) {
            if i < resigns {
                run.resign(&mut s);
            }
            if i < kills {
                run.kill(&mut s);
            }
        }
        if let Faults::Hung(nodes) = faults {
            nodes.iter().for_each(|&i| c.unpause(i));
        }
        let mut r = s.resigned.clone();
        r.sort_unstable();
        let killed: Vec<String> = s
            .killed
            .iter()
            .map(|&k| format!("{:.0}", ms(nanos(k))))
            .collect();
        out.push(format!(
            "  {:<18} after a resignation p50 {:.1} ms p99 {:.1} ms max {:.1} ms ({} of {} woken, {} the same again)  after a SIGKILL [{}] ms (TTL + retry pause {} ms)",
            faults.name(),
            p(&r, 0.5),
            p(&r, 0.99),
            p(&r, 1.0),
            s.woken,
            r.len(),
            s.same,
            killed.join(", "),
            (TTL + PAUSE).as_millis(),
        ));
    }
    let secs = started.elapsed().as_secs_f64();
    let quit = run.c.quit_all(LONG);
    let c = &run.c;
    let all = leases(&c.lines, &c.killed);
    let check = Leases(&all);
    let overlaps = check.overlaps().len();
    let falling = check.terms_not_rising().len();
    // A dead leader's successor before the dead one's validity deadline.
    let early = c
        .killed
        .iter()
        .filter(|&&(who, at)| {
            let valid = c
                .lines
                .iter()
                .filter(|l| l.who() == who && (l.is("ELECTED") || l.is("VALID")))
                .map(|l| l.num(if l.is("ELECTED") { 4 } else { 3 }))
                .max()
                .unwrap_or(0);
            let next = c.lines.iter().find(|l| l.is("ELECTED") && l.at() >= at);
            next.is_some_and(|n| n.at() < valid)
        })
        .count();
    // Attempts per second of each candidate's life (those that quit).
    let counts = c.lines.iter().filter(|l| l.is("COUNTS"));
    let (attempts, alive_ms) = counts.fold((0, 0), |(a, t), l| (a + l.num(2), t + l.num(4)));
    let ok = overlaps == 0 && falling == 0 && early == 0 && quit;
    out.insert(
        0,
        format!(
            "election, {PROCS} processes, 5 nodes, TTL {} ms, retry pause {} ms: {} terms in {secs:.0} s, overlaps of valid leases {overlaps}, terms not rising {falling}, successors before a dead leader's lease ended {early}, leases lost {}, attempts per candidate per second {:.1}{}",
            TTL.as_millis(),
            PAUSE.as_millis(),
            all.len(),
            check.ended("lost"),
            attempts as f64 * 1e3 / alive_ms.max(1) as f64,
            if quit { "" } else { " (some candidates did not quit)" },
        ),
    );
    (out, ok)
}
