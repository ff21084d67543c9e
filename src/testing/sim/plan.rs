//! What one seed draws: the mix of faults, the plan of a run (nodes,
//! clients, network, faults, workers) and the report it ends with.

use crate::lock::settings::Settings;
use crate::testing::sim::check::{Kind, Stats, Violation};
use crate::testing::sim::rng::SimRng;

/// The network's behaviour for one run.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Net {
    /// One-way delay range (ns).
    pub(crate) latency: (u64, u64),
    /// Chance of a delay spike, and its largest size (ns).
    pub(crate) spike: f64,
    pub(crate) spike_max: u64,
    /// Chance that one message (request or reply) is lost.
    pub(crate) loss: f64,
    /// Chance that a release's message to a waiting client is delivered
    /// twice (the copy later); commands and replies on a connection are
    /// never repeated (a lost one resets it).
    pub(crate) dup: f64,
}

impl Net {
    pub(crate) fn calm() -> Self {
        Net {
            latency: (100_000, 1_000_000),
            spike: 0.0,
            spike_max: 0,
            loss: 0.0,
            dup: 0.0,
        }
    }

    /// The longest a message can take (a duplicate: twice).
    pub(crate) fn max_delay(&self) -> u64 {
        2 * (self.latency.1 + self.spike_max)
    }
}

/// A scheduled change to the world.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Fault {
    Pause(usize),
    Resume(usize),
    Crash(usize),
    Restart {
        node: usize,
        wipe: bool,
    },
    Isolate(usize),
    Heal(usize),
    /// The node's replies are lost (it still runs what it receives).
    Mute(usize),
    Unmute(usize),
    /// The node's wall clock steps by this many ns.
    Jump(usize, i64),
    /// The node loses its lock keys but keeps its lock history: eviction
    /// under memory pressure, or a failover to a replica that lagged.
    LoseKeys(usize),
    /// `CLIENT KILL` on the node: every connection to it is closed; the
    /// node stays up with its data.
    Kill(usize),
    /// `SCRIPT FLUSH` on the node: its connections stay, the next `EVALSHA`
    /// meets NOSCRIPT.
    FlushScripts(usize),
    /// `FLUSHALL` on the node: it loses every key and its lock history,
    /// as a restart without data does, but its connections stay.
    Flush(usize),
    /// The network turns calm and every node comes back up.
    HealAll,
    /// This many forged release messages, each with a fresh notice, to
    /// every subscriber of every key (anyone with channel rights can
    /// publish: the waiters must not run a round per message).
    Forge(u32),
}

/// A millisecond of virtual time (ns).
pub(crate) const MS: u64 = 1_000_000;

/// Which assumptions a run keeps or breaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mix {
    /// Every fault within Redlock's assumptions: pauses, crashes, restarts
    /// with and without data, isolation, lossy and reordering networks,
    /// clock drift within the factor, stalls past the TTL with fencing.
    Standard,
    /// Clocks set back and stepped forward a little, no data loss.
    ClockJumps,
    /// Broken: restart protection off, restarts wipe data.
    NoRestartProtection,
    /// Broken: node clocks run up to 2× fast against a 1 % factor.
    DriftBeyondFactor,
    /// Broken: holders stall past their TTL and the store has no fencing.
    StallWithoutFencing,
    /// One server listed twice (4 entries, 3 servers), and that server
    /// loses lock keys (eviction, a failover) while keeping its history:
    /// it votes once.
    ListedTwice,
    /// Broken: as [`Mix::ListedTwice`], with its answers counted twice.
    ListedTwiceCountedTwice,
    /// One node of three evicts lock keys, and its votes are refused
    /// (the default).
    Evicting,
    /// Broken: as [`Mix::Evicting`], with its votes counted
    /// (`allow_evicting_nodes`).
    EvictingCounted,
    /// As [`Mix::Standard`], with many keys and long TTLs: releases that
    /// cannot reach a node pile up in its retry queue, and a key left there
    /// stays long enough to be seen.
    Releases,
    /// Calm nodes and network; `CLIENT KILL` on every node at once now and
    /// then (and, as in every run, on single nodes, and `SCRIPT FLUSH`);
    /// half the attempts on keys of their own, each of which must succeed
    /// unless a connection was closed during it.
    KillStorm,
}

impl Mix {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Mix::Standard => "standard",
            Mix::ClockJumps => "clock-jumps",
            Mix::NoRestartProtection => "no-restart-protection",
            Mix::DriftBeyondFactor => "drift-beyond-factor",
            Mix::StallWithoutFencing => "stall-without-fencing",
            Mix::ListedTwice => "listed-twice",
            Mix::ListedTwiceCountedTwice => "listed-twice-counted-twice",
            Mix::Evicting => "evicting",
            Mix::EvictingCounted => "evicting-counted",
            Mix::Releases => "releases",
            Mix::KillStorm => "kill-storm",
        }
    }

    pub(crate) fn parse(s: &str) -> Option<Mix> {
        [
            Mix::Standard,
            Mix::ClockJumps,
            Mix::NoRestartProtection,
            Mix::DriftBeyondFactor,
            Mix::StallWithoutFencing,
            Mix::ListedTwice,
            Mix::ListedTwiceCountedTwice,
            Mix::Evicting,
            Mix::EvictingCounted,
            Mix::Releases,
            Mix::KillStorm,
        ]
        .into_iter()
        .find(|m| m.name() == s)
    }
}

/// One run's parameters, all drawn from the seed.
#[derive(Debug, Clone)]
pub(crate) struct Plan {
    pub(crate) seed: u64,
    pub(crate) mix: Mix,
    pub(crate) nodes: usize,
    /// The clients' node list: per entry, the node it reaches.
    pub(crate) entries: Vec<usize>,
    /// Per node, whether its memory policy evicts lock keys.
    pub(crate) evicting: Vec<bool>,
    pub(crate) clients: usize,
    pub(crate) threads: usize,
    pub(crate) resources: usize,
    /// The workload runs this long (virtual ns); then faults heal.
    pub(crate) run_for: u64,
    pub(crate) settings: Settings,
    pub(crate) rates: Vec<f64>,
    pub(crate) net: Net,
    pub(crate) faults: Vec<(u64, Fault)>,
    /// Chance that a manual section stalls past its TTL without renewal.
    pub(crate) stall: f64,
    pub(crate) ttls: Vec<u64>,
    /// Threads may be preempted just before each round is sent.
    pub(crate) preempt: bool,
    /// Node engine defects put back, to show they are found.
    pub(crate) defects: crate::driver::node::state::Defects,
    /// Releases wake the waiters of other clients (see
    /// [`crate::testing::sim::wakeups`]); off, they poll.
    pub(crate) wakeups: bool,
    /// Some sections are locks of several resources (`request().and().acquire`).
    pub(crate) sets: bool,
    /// Some sections are read locks (`read().try_acquire` and its kin), beside
    /// writers of the same resources.
    pub(crate) readers: bool,
    /// The nodes' scripts with a reader-writer rule broken (see
    /// [`Broken`](crate::testing::store::Broken)), to show it is found.
    pub(crate) broken: crate::testing::store::Broken,
    /// An application's key under a resource's name: (node, resource).
    /// No lock may take a resource that is one on a majority of nodes.
    pub(crate) foreign: Vec<(usize, usize)>,
    /// Candidates of an election campaign and lead beside the locks (see
    /// [`elections`](crate::testing::sim::elections)).
    pub(crate) elections: bool,
}

impl Plan {
    pub(crate) fn new(seed: u64, mix: Mix) -> Plan {
        let mut r = SimRng::new(seed);
        let two_names = matches!(mix, Mix::ListedTwice | Mix::ListedTwiceCountedTwice);
        let evicts = matches!(mix, Mix::Evicting | Mix::EvictingCounted);
        let nodes = if two_names || evicts {
            3
        } else {
            [3, 3, 5, 4, 1][r.below(5) as usize]
        };
        let mut settings = Settings {
            node_timeout: r.millis(20, 80),
            retry_count: 1 + r.below(4) as u32,
            retry_delay: r.millis(10, 100),
            retry_jitter: r.millis(0, 50),
            local_queue: r.below(5) != 0,
            fencing: r.chance(0.5),
            drift_factor: [0.01, 0.001, 0.05][r.below(3) as usize],
            renew_fraction: [1.0 / 3.0, 0.1, 0.5][r.below(3) as usize],
            ..Settings::default()
        };
        let rho = settings.drift_factor * 0.9;
        let mut rates: Vec<f64> = (0..nodes)
            .map(|_| 1.0 + rho * (2.0 * (r.below(1001) as f64 / 1000.0) - 1.0))
            .collect();
        let lossy = r.chance(0.6);
        let net = Net {
            latency: (50_000 + r.below(200_000), 300_000 + r.below(3 * MS)),
            spike: if lossy {
                0.05 * r.below(100) as f64 / 100.0
            } else {
                0.0
            },
            spike_max: r.below(3) * settings.node_timeout.as_nanos() as u64,
            loss: if lossy {
                0.05 * r.below(100) as f64 / 100.0
            } else {
                0.0
            },
            dup: if lossy {
                0.03 * r.below(100) as f64 / 100.0
            } else {
                0.0
            },
        };
        let run_for = 500 * MS + r.below(700) * MS;
        let mut stall = 0.0;
        let mut wipe = 0.5;
        let mut jumps = false;
        match mix {
            Mix::Standard => {
                if settings.fencing && r.chance(0.5) {
                    stall = 0.2;
                }
            }
            Mix::ClockJumps => {
                jumps = true;
                wipe = 0.0;
            }
            Mix::NoRestartProtection => {
                settings.restart_protection = false;
                settings.fencing = false;
                wipe = 1.0;
            }
            Mix::DriftBeyondFactor => {
                for rate in rates.iter_mut() {
                    if r.chance(0.5) {
                        *rate = 1.0 + r.below(100) as f64 / 100.0;
                    }
                }
            }
            Mix::StallWithoutFencing => {
                settings.fencing = false;
                stall = 0.3;
            }
            Mix::ListedTwice | Mix::Evicting | Mix::Releases | Mix::KillStorm => {}
            Mix::ListedTwiceCountedTwice => settings.one_vote_per_server = false,
            Mix::EvictingCounted => settings.allow_evicting = true,
        }
        // Node 0 is listed twice, or evicts: it loses its lock keys often.
        let entries: Vec<usize> = (0..nodes).chain(two_names.then_some(0)).collect();
        let evicting: Vec<bool> = (0..nodes).map(|i| evicts && i == 0).collect();
        let mut faults = Vec::new();
        for _ in 0..r.below(7) {
            let at = r.below(run_for);
            let node = r.below(nodes as u64) as usize;
            let d = r.below(400 * MS) + MS;
            let kind = r.below(if jumps { 5 } else { 4 });
            let (start, stop) = match kind {
                0 => (Fault::Pause(node), Fault::Resume(node)),
                1 => (
                    Fault::Crash(node),
                    Fault::Restart {
                        node,
                        wipe: r.chance(wipe),
                    },
                ),
                2 => (Fault::Isolate(node), Fault::Heal(node)),
                3 => (Fault::Mute(node), Fault::Unmute(node)),
                _ => {
                    // Back by up to a second, or forward by under 1 ms
                    // (inside the 2 ms of the drift allowance).
                    let delta = if r.chance(0.5) {
                        -(r.below(1_000 * MS) as i64)
                    } else {
                        r.below(MS) as i64
                    };
                    faults.push((at, Fault::Jump(node, delta)));
                    continue;
                }
            };
            faults.push((at, start));
            faults.push((at + d, stop));
        }
        if two_names || evicts {
            for _ in 0..2 + r.below(6) {
                faults.push((r.below(run_for), Fault::LoseKeys(0)));
            }
        }
        faults.push((run_for, Fault::HealAll));
        let mut plan = Plan {
            seed,
            mix,
            nodes,
            entries,
            evicting,
            clients: 1 + r.below(3) as usize,
            threads: 1 + r.below(3) as usize,
            resources: 1 + r.below(2) as usize,
            run_for,
            settings,
            rates,
            net,
            faults,
            stall,
            ttls: vec![30, 60, 120, 250],
            preempt: r.chance(0.5),
            defects: Default::default(),
            wakeups: false,
            sets: false,
            readers: false,
            broken: Default::default(),
            foreign: Vec::new(),
            elections: false,
        };
        match mix {
            Mix::Releases => {
                plan.resources = 2 + r.below(5) as usize;
                plan.threads = 2 + r.below(3) as usize;
                plan.ttls = vec![250, 1_000, 3_000];
            }
            Mix::KillStorm => {
                plan.net = Net::calm();
                plan.stall = 0.0;
                plan.preempt = false;
                plan.faults.clear();
                for _ in 0..3 + r.below(8) {
                    let at = r.below(run_for);
                    plan.faults.extend((0..nodes).map(|i| (at, Fault::Kill(i))));
                }
                plan.faults.push((run_for, Fault::HealAll));
            }
            _ => {}
        }
        // Application keys under lock names and forged messages, drawn
        // apart from the plan so that its other draws stay as they were.
        let mut r = SimRng::new(seed ^ 0x666f_7265);
        if !two_names && !evicts && r.chance(0.25) {
            let resource = r.below(plan.resources as u64) as usize;
            let on = if r.chance(0.5) { 1 } else { plan.nodes };
            let first = r.below(plan.nodes as u64) as usize;
            plan.foreign = (0..on)
                .map(|i| ((first + i) % plan.nodes, resource))
                .collect();
        }
        if r.chance(0.25) {
            for _ in 0..1 + r.below(4) {
                let at = r.below(plan.run_for);
                plan.faults.push((at, Fault::Forge(5 + r.below(50) as u32)));
            }
        }
        // `FLUSHALL` while clients are connected, drawn apart too.
        let mut r = SimRng::new(seed ^ 0x666c_7573);
        if matches!(mix, Mix::Standard | Mix::Releases) && r.chance(0.25) {
            for _ in 0..1 + r.below(3) {
                let at = r.below(plan.run_for);
                let node = r.below(plan.nodes as u64) as usize;
                plan.faults.push((at, Fault::Flush(node)));
            }
        }
        // Connections closed under the clients (`CLIENT KILL`) and script
        // caches emptied (`SCRIPT FLUSH`), drawn apart too.
        let mut r = SimRng::new(seed ^ 0x6b69_6c6c);
        for _ in 0..r.below(12) {
            let at = r.below(plan.run_for);
            let node = r.below(plan.nodes as u64) as usize;
            plan.faults.push((at, Fault::Kill(node)));
        }
        for _ in 0..r.below(4) {
            let at = r.below(plan.run_for);
            let node = r.below(plan.nodes as u64) as usize;
            plan.faults.push((at, Fault::FlushScripts(node)));
        }
        plan
    }
}

impl Plan {
    /// A calm world for a scripted schedule: `nodes` nodes, exact clocks,
    /// a steady 1 ms network, no faults, default settings (local queue on).
    pub(crate) fn calm(seed: u64, nodes: usize) -> Plan {
        Plan {
            seed,
            mix: Mix::Standard,
            nodes,
            entries: (0..nodes).collect(),
            evicting: vec![false; nodes],
            clients: 0,
            threads: 0,
            resources: 1,
            run_for: 0,
            settings: Settings::default(),
            rates: vec![1.0; nodes],
            net: Net {
                latency: (MS, MS),
                ..Net::calm()
            },
            faults: Vec::new(),
            stall: 0.0,
            ttls: Vec::new(),
            preempt: false,
            defects: Default::default(),
            wakeups: false,
            sets: false,
            readers: false,
            broken: Default::default(),
            foreign: Vec::new(),
            elections: false,
        }
    }
}

/// What one run found.
#[derive(Debug)]
pub(crate) struct Report {
    pub(crate) plan: Plan,
    /// The elections' figures.
    pub(crate) leaders: crate::testing::sim::leaders::LeaderStats,
    pub(crate) violations: Vec<Violation>,
    pub(crate) stats: Stats,
    /// When each section began (virtual ns), in order.
    pub(crate) grants_at: Vec<u64>,
    pub(crate) wakes: crate::testing::sim::chan::WakeStats,
    pub(crate) steps: u64,
    /// Virtual time the run covered (ns).
    pub(crate) virtual_ns: u64,
    /// The schedule's fingerprint (see `sched::Core::trace`).
    pub(crate) trace: u64,
}

impl Report {
    pub(crate) fn has(&self, kind: Kind) -> bool {
        self.violations.iter().any(|v| v.kind == kind)
    }

    /// The command that replays this run.
    pub(crate) fn replay(&self) -> String {
        let p = &self.plan;
        let flags: String = [
            (p.wakeups, " QUORUMLOCK_SIM_WAKEUPS=1"),
            (p.sets, " QUORUMLOCK_SIM_SETS=1"),
            (p.readers, " QUORUMLOCK_SIM_READERS=1"),
            (p.elections, " QUORUMLOCK_SIM_ELECTIONS=1"),
        ]
        .iter()
        .filter(|(on, _)| *on)
        .map(|(_, f)| *f)
        .collect();
        format!(
            "QUORUMLOCK_SIM_SEED={:#x} QUORUMLOCK_SIM_MIX={}{flags} cargo test --lib sim::tests::replay -- --nocapture",
            p.seed,
            p.mix.name(),
        )
    }
}
