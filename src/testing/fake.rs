//! Test doubles: a virtual clock and in-memory nodes behind the same
//! [`Transport`] trait as the Redis driver. The seed of the deterministic
//! simulation: the algorithm runs unchanged against them.

use crate::testing::store::Store;

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::algorithm::quorum::VoteRules;
use crate::algorithm::round::Key;
use crate::algorithm::round::{NodeResult, Op, ServerKind, ServerTag};
use crate::clock::{after, Clock, Rng};
use crate::error::{NodeError, NodeErrorKind};
use crate::lock::settings::Settings;
use crate::lock::transport::{AfterRound, Transport, Watch};
use crate::redlock::Redlock;

/// Virtual time: starts at a fixed instant, moves only when told (or slept).
#[derive(Debug)]
pub(crate) struct ManualClock {
    pub(crate) base: Instant,
    nanos: AtomicU64,
}

impl ManualClock {
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(ManualClock {
            base: Instant::now(),
            nanos: AtomicU64::new(0),
        })
    }

    pub(crate) fn advance(&self, d: Duration) {
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.nanos.fetch_add(ns, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Instant {
        after(
            self.base,
            Duration::from_nanos(self.nanos.load(Ordering::SeqCst)),
        )
    }
    fn sleep(&self, d: Duration) {
        self.advance(d)
    }
    /// Waits in real time as long as the virtual wait; if nobody notified
    /// meanwhile, the virtual time passes too (nothing else happened).
    fn wait(&self, signal: &Arc<crate::clock::Signal>, seen: u64, until: Option<Instant>) {
        let left = until.map(|u| u.saturating_duration_since(self.now()));
        signal.wait_real(seen, left.map(|d| after(Instant::now(), d)));
        if let Some(u) = until {
            if signal.seen() == seen {
                let behind = u.saturating_duration_since(self.now());
                self.advance(behind);
            }
        }
    }
}

/// How a fake node behaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    Up,
    /// Refuses connections.
    Down,
    /// Never answers: the round waits until its deadline.
    Hung,
    /// Executes commands but its replies are lost (a timeout that still
    /// changed state, as a SET on a briefly hung node does).
    Lossy,
}

/// N in-memory nodes sharing one [`ManualClock`].
#[derive(Debug)]
pub(crate) struct FakeNodes {
    names: Vec<String>,
    modes: Mutex<Vec<Mode>>,
    pub(crate) stores: Vec<Mutex<Store>>,
    /// Per node, its wall clock's offset in µs (fencing counters' floor).
    offsets: Mutex<Vec<i64>>,
    pub(crate) clock: Arc<ManualClock>,
    /// Virtual time one healthy round takes.
    pub latency: Mutex<Duration>,
    pub rounds: AtomicUsize,
    /// Makes the next round panic (a bug in a tick, simulated).
    pub panic_next: AtomicBool,
    /// Runs at the start of every round, before the nodes' modes are read.
    pub before_round: Mutex<Option<Hook>>,
    /// Per entry, the store (server) it reaches: itself unless aliased.
    servers: Mutex<Vec<usize>>,
    /// Per store, what kind of node it is.
    kinds: Mutex<Vec<ServerKind>>,
}

/// A test's hook into every round: the nodes and the round's operation.
pub(crate) struct Hook(pub Box<HookFn>);

type HookFn = dyn Fn(&FakeNodes, Op) + Send + Sync;

impl std::fmt::Debug for Hook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Hook")
    }
}

impl FakeNodes {
    pub(crate) fn new(n: usize, clock: Arc<ManualClock>) -> Arc<Self> {
        Arc::new(FakeNodes {
            names: (0..n).map(|i| format!("fake{i}:6379")).collect(),
            modes: Mutex::new(vec![Mode::Up; n]),
            stores: (0..n).map(|_| Mutex::default()).collect(),
            offsets: Mutex::new(vec![0; n]),
            clock,
            latency: Mutex::new(Duration::from_millis(1)),
            rounds: AtomicUsize::new(0),
            panic_next: AtomicBool::new(false),
            before_round: Mutex::new(None),
            servers: Mutex::new((0..n).collect()),
            kinds: Mutex::new(vec![ServerKind::Fit; n]),
        })
    }

    /// Entry `entry` reaches the server (store) of entry `server`: one
    /// server listed twice.
    pub(crate) fn alias(&self, entry: usize, server: usize) {
        self.servers.lock()[entry] = server;
    }

    /// Entry `entry`'s server is of this kind (a replica, an evicting node).
    pub(crate) fn set_kind(&self, entry: usize, kind: ServerKind) {
        let server = self.servers.lock()[entry];
        self.kinds.lock()[server] = kind;
    }

    fn store(&self, entry: usize) -> &Mutex<Store> {
        &self.stores[self.servers.lock()[entry]]
    }

    pub(crate) fn set_mode(&self, node: usize, mode: Mode) {
        self.modes.lock()[node] = mode;
    }

    /// The token stored under `key` on `node`, if live.
    pub(crate) fn get(&self, node: usize, key: &str) -> Option<String> {
        let now = self.clock.now();
        let store = self.store(node).lock();
        store
            .keys
            .get(key)
            .filter(|(_, exp)| *exp > now)
            .map(|(t, _)| t.clone())
    }

    pub(crate) fn del(&self, node: usize, key: &str) {
        self.store(node).lock().keys.remove(key);
    }

    /// The node restarts without its data: keys and lock history are gone.
    pub(crate) fn wipe(&self, node: usize) {
        *self.store(node).lock() = Store::default();
    }

    /// Node `i`'s wall clock in µs (its `TIME`) at `now`: virtual time from
    /// a 2023 epoch, plus the node's offset.
    fn micros(&self, i: usize, now: Instant) -> u64 {
        let since = now.saturating_duration_since(self.clock.base);
        let t = 1_700_000_000_000_000i64
            .saturating_add(i64::try_from(since.as_micros()).unwrap_or(i64::MAX))
            .saturating_add(self.offsets.lock()[i]);
        u64::try_from(t).unwrap_or(0)
    }

    /// Moves node `i`'s wall clock (not its key expiry) by `micros`.
    pub(crate) fn set_clock_offset(&self, node: usize, micros: i64) {
        self.offsets.lock()[node] = micros;
    }

    /// The fencing counter of `resource` on `node`.
    pub(crate) fn fence(&self, node: usize, resource: &str) -> Option<u64> {
        self.store(node).lock().fences.get(resource).copied()
    }

    /// Runs `op` on every node in `modes`, as one round at `now`, each
    /// answer counted as `rules` say, in node order.
    fn apply_all(
        &self,
        modes: &[Mode],
        op: Op,
        keys: &[Key<'_>],
        now: Instant,
        rules: VoteRules,
    ) -> Vec<NodeResult> {
        let servers = self.servers.lock().clone();
        let kinds = self.kinds.lock().clone();
        let mut results: Vec<Option<NodeResult>> = vec![None; modes.len()];
        for (i, mode) in modes.iter().enumerate() {
            let name = &self.names[i];
            let r = match mode {
                Mode::Down => Err(NodeError::new(name, NodeErrorKind::Unavailable, "refused")),
                Mode::Hung => Err(NodeError::new(name, NodeErrorKind::Timeout, "")),
                Mode::Up | Mode::Lossy => {
                    let micros = self.micros(i, now);
                    let server = servers[i];
                    let reply =
                        self.stores[server]
                            .lock()
                            .round(op, keys, now, self.clock.base, micros);
                    match reply {
                        Err(why) => Err(NodeError::new(name, NodeErrorKind::Server, why)),
                        Ok(_) if *mode == Mode::Lossy => {
                            Err(NodeError::new(name, NodeErrorKind::Timeout, ""))
                        }
                        Ok(mut reply) => {
                            reply.server = Some(ServerTag {
                                run: Some(server as u64 + 1),
                                history: Some(self.stores[server].lock().id),
                                kind: kinds[server],
                            });
                            Ok(reply)
                        }
                    }
                }
            };
            crate::algorithm::quorum::insert_vote(&mut results, &self.names, i, r, rules);
        }
        results.into_iter().flatten().collect()
    }
}

/// Lets tests keep an `Arc<FakeNodes>` while the client owns a box; counts
/// answers as the client's `rules` say.
#[derive(Debug)]
pub(crate) struct Shared(pub Arc<FakeNodes>, pub VoteRules);

impl Transport for Shared {
    fn node_names(&self) -> &[String] {
        &self.0.names
    }

    // No wake-ups (waiters poll), no lean acquire, always connected, and
    // neither `check` nor `inspect` modelled.
    fn watch(&self, _resource: &str, _confirm_by: Instant) -> Option<Box<dyn Watch>> {
        None
    }

    fn watch_all(&self, _resources: &[&str], _confirm_by: Instant) -> Option<Box<dyn Watch>> {
        None
    }

    fn watch_existing(&self, _resource: &str) -> Option<Box<dyn Watch>> {
        None
    }

    fn releasing(&self, _resource: &str, _notice: u64) {}

    fn released(&self, _resources: &[&str]) {}

    fn watching(&self, _resource: &str) -> Vec<bool> {
        Vec::new()
    }

    fn reads(&self) -> (u64, Vec<Option<crate::algorithm::restart::Read>>) {
        (0, Vec::new())
    }

    fn wait_connected(&self, _deadline: Instant) -> Result<usize, crate::error::InvalidInput> {
        Ok(self.0.names.len())
    }

    fn probe(&self, _key: &str, _timeout: Duration) -> Vec<crate::lock::transport::Probe> {
        crate::testing::unsupported_probes(&self.0.names)
    }

    fn inspect(
        &self,
        _resource: &str,
        _timeout: Duration,
    ) -> Vec<Result<Option<crate::lock::transport::Stored>, NodeError>> {
        crate::testing::unsupported_inspect(&self.0.names)
    }

    /// As a connection made now learns them: every node that answers.
    fn begun(&self, _until: Option<Instant>) -> Vec<u64> {
        let modes = self.0.modes.lock().clone();
        (0..modes.len())
            .map(|i| match modes[i] {
                Mode::Up | Mode::Lossy => self.0.store(i).lock().begun(),
                Mode::Down | Mode::Hung => 0,
            })
            .collect()
    }

    fn run(
        &self,
        op: Op,
        keys: &[Key<'_>],
        deadline: Instant,
        _decided: Option<crate::lock::transport::Decided<'_>>,
        undo: Option<crate::lock::transport::Undo<'_>>,
    ) -> Vec<NodeResult> {
        let (f, rules) = (&self.0, self.1);
        assert!(
            !f.panic_next.swap(false, Ordering::SeqCst),
            "injected panic"
        );
        f.rounds.fetch_add(1, Ordering::SeqCst);
        if let Some(hook) = &*f.before_round.lock() {
            (hook.0)(f, op);
        }
        let modes = f.modes.lock().clone();
        let now = f.clock.now();
        let results = f.apply_all(&modes, op, keys, now, rules);
        // The round lasts one latency, or until the deadline if anyone hung.
        let waits = modes.iter().any(|m| matches!(m, Mode::Hung | Mode::Lossy));
        let end = if waits {
            deadline
        } else {
            after(now, *f.latency.lock()).min(deadline)
        };
        f.clock.advance(end.saturating_duration_since(now));
        if let (Some(undo), Op::Acquire { ttl, .. } | Op::Swap { ttl, .. }) = (undo, op) {
            if undo(&results) == AfterRound::Undo {
                let release = Op::Release {
                    keep_until: after(now, ttl),
                    notice: 0,
                };
                let written = crate::algorithm::round::written(op, keys);
                f.apply_all(&modes, release, &written, f.clock.now(), rules);
            }
        }
        results
    }
}

/// A client over `n` fake nodes with default settings and a seeded RNG.
pub(crate) fn client(n: usize) -> (Redlock, Arc<FakeNodes>, Arc<ManualClock>) {
    client_with(n, settings())
}

/// Another client's lock on `resource`, on entry `node` only, for `ttl`.
pub(crate) fn plant(nodes: &FakeNodes, node: usize, resource: &str, token: &str, ttl: Duration) {
    let exp = after(nodes.clock.now(), ttl);
    nodes
        .store(node)
        .lock()
        .keys
        .insert(resource.into(), (token.into(), exp));
}

/// Default settings for a throwaway fake cluster (its first locks need not
/// wait one TTL).
pub(crate) fn settings() -> Settings {
    Settings {
        fresh_cluster: true,
        ..Settings::default()
    }
}

pub(crate) fn client_with(
    n: usize,
    settings: Settings,
) -> (Redlock, Arc<FakeNodes>, Arc<ManualClock>) {
    let clock = ManualClock::new();
    let nodes = FakeNodes::new(n, clock.clone());
    (client_over(&nodes, settings), nodes, clock)
}

/// Another client (another process) over the same fake nodes.
pub(crate) fn client_over(nodes: &Arc<FakeNodes>, settings: Settings) -> Redlock {
    let rules = settings.rules();
    crate::redlock::Redlock {
        engine: crate::lock::engine::Engine::new(
            settings,
            Box::new(Shared(nodes.clone(), rules)),
            nodes.clock.clone(),
            Rng::new(42),
        ),
    }
}
