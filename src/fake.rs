//! Test doubles: a virtual clock and in-memory nodes behind the same
//! [`Transport`] trait as the Redis driver. The seed of the deterministic
//! simulation: the algorithm runs unchanged against them.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::clock::{after, Clock, Rng};
use crate::config::Settings;
use crate::error::{NodeError, NodeErrorKind};
use crate::redlock::Redlock;
use crate::transport::{Answer, Key, NodeFacts, NodeResult, Op, Reply, Transport};

/// Virtual time: starts at a fixed instant, moves only when told (or slept).
#[derive(Debug)]
pub(crate) struct ManualClock {
    base: Instant,
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

#[derive(Debug, Default)]
struct Store {
    keys: HashMap<String, (String, Instant)>,
    /// Lock history: when it began, the longest TTL recorded.
    meta: Option<(Instant, Duration)>,
    /// Fencing counters, per resource (they go with the lock history).
    fences: HashMap<String, u64>,
}

impl Store {
    /// The acquire script's bookkeeping: facts before this command.
    fn history(
        &mut self,
        ttl: Duration,
        known: Duration,
        now: Instant,
        base: Instant,
    ) -> NodeFacts {
        let (epoch, max) = *self.meta.get_or_insert((now, Duration::ZERO));
        self.meta = Some((epoch, max.max(ttl).max(known)));
        NodeFacts {
            epoch: u64::try_from(epoch.saturating_duration_since(base).as_nanos()).unwrap_or(0) + 1,
            age: now.saturating_duration_since(epoch),
            max_ttl: max,
        }
    }

    /// `counter = max(counter, value)`; returns the new counter.
    fn raise_fence(&mut self, resource: &str, value: u64) -> u64 {
        let c = self.fences.entry(resource.into()).or_default();
        *c = (*c).max(value);
        *c
    }

    /// Runs `op` for one key, as the scripts do; also returns the fencing
    /// counter a fenced acquire set. `micros`: the node's clock, the floor
    /// of a counter.
    fn apply(&mut self, op: Op, k: &Key<'_>, now: Instant, micros: u64) -> (Answer, Option<u64>) {
        self.keys.retain(|_, (_, exp)| *exp > now);
        match (op, self.keys.get(k.resource)) {
            (Op::Acquire { ttl, fenced, .. }, None) => {
                self.keys
                    .insert(k.resource.into(), (k.token.into(), after(now, ttl)));
                let fence = fenced.then(|| {
                    let next = self.fences.get(k.resource).map_or(0, |c| c + 1);
                    self.raise_fence(k.resource, next.max(micros))
                });
                (Answer::Ok, fence)
            }
            (op, _) => (self.apply_other(op, k, now), None),
        }
    }

    fn apply_other(&mut self, op: Op, k: &Key<'_>, now: Instant) -> Answer {
        match (op, self.keys.get(k.resource)) {
            (Op::Acquire { .. }, None) => Answer::Ok, // handled by `apply`
            (Op::Acquire { .. }, Some(_)) => Answer::Other,
            (_, None) => Answer::Absent,
            (Op::Release { .. } | Op::Swap { .. }, Some((t, _)))
                if !crate::transport::ours(t, k.token) || k.next.is_some_and(|n| n == t) =>
            {
                Answer::Other
            }
            (Op::Extend { .. } | Op::Fence { .. }, Some((t, _))) if t != k.token => Answer::Other,
            (Op::Fence { value }, Some(_)) => {
                self.raise_fence(k.resource, value);
                Answer::Ok
            }
            (Op::Release { .. }, Some(_)) => {
                self.keys.remove(k.resource);
                Answer::Ok
            }
            (Op::Extend { ttl }, Some(_)) => {
                self.keys
                    .insert(k.resource.into(), (k.token.into(), after(now, ttl)));
                Answer::Ok
            }
            (Op::Swap { fence, .. }, Some(&(_, expiry))) => {
                let next = k.next.unwrap_or(k.token);
                self.keys.insert(k.resource.into(), (next.into(), expiry));
                if let Some(f) = fence {
                    self.raise_fence(k.resource, f);
                }
                Answer::Ok
            }
        }
    }
}

/// N in-memory nodes sharing one [`ManualClock`].
#[derive(Debug)]
pub(crate) struct FakeNodes {
    names: Vec<String>,
    modes: Mutex<Vec<Mode>>,
    stores: Vec<Mutex<Store>>,
    /// Per node, its wall clock's offset in µs (fencing counters' floor).
    offsets: Mutex<Vec<i64>>,
    clock: Arc<ManualClock>,
    /// Virtual time one healthy round takes.
    pub latency: Mutex<Duration>,
    pub rounds: AtomicUsize,
    /// Makes the next round panic (a bug in a tick, simulated).
    pub panic_next: AtomicBool,
    /// Runs at the start of every round, before the nodes' modes are read.
    pub before_round: Mutex<Option<Hook>>,
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
        })
    }

    pub(crate) fn set_mode(&self, node: usize, mode: Mode) {
        self.modes.lock()[node] = mode;
    }

    /// The token stored under `key` on `node`, if live.
    pub(crate) fn get(&self, node: usize, key: &str) -> Option<String> {
        let now = self.clock.now();
        let store = self.stores[node].lock();
        store
            .keys
            .get(key)
            .filter(|(_, exp)| *exp > now)
            .map(|(t, _)| t.clone())
    }

    pub(crate) fn del(&self, node: usize, key: &str) {
        self.stores[node].lock().keys.remove(key);
    }

    /// The node restarts without its data: keys and lock history are gone.
    pub(crate) fn wipe(&self, node: usize) {
        *self.stores[node].lock() = Store::default();
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
        self.stores[node].lock().fences.get(resource).copied()
    }

    /// Runs `op` on every node in `modes`, as one round at `now`.
    fn apply_all(&self, modes: &[Mode], op: Op, keys: &[Key<'_>], now: Instant) -> Vec<NodeResult> {
        modes
            .iter()
            .enumerate()
            .map(|(i, mode)| {
                let name = &self.names[i];
                match mode {
                    Mode::Down => Err(NodeError::new(name, NodeErrorKind::Unavailable, "refused")),
                    Mode::Hung => Err(NodeError::new(name, NodeErrorKind::Timeout, "")),
                    Mode::Up | Mode::Lossy => {
                        let mut store = self.stores[i].lock();
                        let facts = match op {
                            Op::Acquire { ttl, known_max, .. }
                            | Op::Swap { ttl, known_max, .. } => {
                                Some(store.history(ttl, known_max, now, self.clock.base))
                            }
                            Op::Extend { ttl } => {
                                if let Some((_, max)) = &mut store.meta {
                                    *max = (*max).max(ttl);
                                }
                                None
                            }
                            Op::Release { .. } | Op::Fence { .. } => None,
                        };
                        let micros = self.micros(i, now);
                        let mut fence = None;
                        let answers: Vec<Answer> = keys
                            .iter()
                            .map(|k| {
                                let (a, f) = store.apply(op, k, now, micros);
                                fence = fence.max(f);
                                a
                            })
                            .collect();
                        if *mode == Mode::Lossy {
                            Err(NodeError::new(name, NodeErrorKind::Timeout, ""))
                        } else {
                            Ok(Reply {
                                answers,
                                facts,
                                fence,
                            })
                        }
                    }
                }
            })
            .collect()
    }
}

/// Lets tests keep an `Arc<FakeNodes>` while the client owns a box.
#[derive(Debug)]
pub(crate) struct Shared(pub Arc<FakeNodes>);

impl Transport for Shared {
    fn node_names(&self) -> &[String] {
        &self.0.names
    }

    fn run(
        &self,
        op: Op,
        keys: &[Key<'_>],
        deadline: Instant,
        _decided: Option<crate::transport::Decided<'_>>,
        undo: Option<crate::transport::Undo<'_>>,
    ) -> Vec<NodeResult> {
        let f = &self.0;
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
        let results = f.apply_all(&modes, op, keys, now);
        // The round lasts one latency, or until the deadline if anyone hung.
        let waits = modes.iter().any(|m| matches!(m, Mode::Hung | Mode::Lossy));
        let end = if waits {
            deadline
        } else {
            after(now, *f.latency.lock()).min(deadline)
        };
        f.clock.advance(end.saturating_duration_since(now));
        if let (Some(undo), Op::Acquire { ttl, .. } | Op::Swap { ttl, .. }) = (undo, op) {
            if undo(&results) {
                let release = Op::Release {
                    keep_until: after(now, ttl),
                };
                let written = crate::transport::written(op, keys);
                f.apply_all(&modes, release, &written, f.clock.now());
            }
        }
        results
    }
}

/// A client over `n` fake nodes with default settings and a seeded RNG.
pub(crate) fn client(n: usize) -> (Redlock, Arc<FakeNodes>, Arc<ManualClock>) {
    client_with(n, settings())
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
    Redlock::from_parts(
        settings,
        Box::new(Shared(nodes.clone())),
        nodes.clock.clone(),
        Rng::new(42),
        None,
    )
}

/// A client over `n` fake nodes (throwaway settings) whose `on_lost`
/// callback is `f`.
pub(crate) fn client_with_on_lost(
    n: usize,
    f: impl Fn(&str, &crate::Error) + Send + Sync + 'static,
) -> (Redlock, Arc<FakeNodes>, Arc<ManualClock>) {
    let clock = ManualClock::new();
    let nodes = FakeNodes::new(n, clock.clone());
    let client = Redlock::from_parts(
        settings(),
        Box::new(Shared(nodes.clone())),
        clock.clone(),
        Rng::new(42),
        Some(Arc::new(f)),
    );
    (client, nodes, clock)
}
