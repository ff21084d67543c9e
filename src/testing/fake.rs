//! Test doubles: a virtual clock and in-memory nodes behind the same
//! [`Transport`] trait as the Redis driver. The seed of the deterministic
//! simulation: the algorithm runs unchanged against them.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::algorithm::quorum::VoteRules;
use crate::algorithm::round::Key;
use crate::algorithm::round::{
    After, Answer, NodeFacts, NodeResult, Op, Reply, ServerKind, ServerTag,
};
use crate::clock::{after, Clock, Rng};
use crate::error::{NodeError, NodeErrorKind};
use crate::lock::settings::Settings;
use crate::lock::transport::{AfterRound, Transport};
use crate::redlock::Redlock;

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

/// One node's data, as the scripts keep it (shared with the simulation).
#[derive(Debug)]
pub(crate) struct Store {
    pub(crate) keys: HashMap<String, (String, Instant)>,
    /// Lock history: when it began, and the TTLs recorded.
    meta: Option<Meta>,
    /// Fencing counters, per resource (they go with the lock history).
    fences: HashMap<String, u64>,
    /// The metadata's id: unique per store, new when its data is lost
    /// (what the connect-time script writes on a real node).
    id: u64,
}

/// A node's lock history, as the scripts keep it in `quorumlock:meta`.
#[derive(Debug, Clone, Copy)]
struct Meta {
    /// When the history began (`None`: a record an extension wrote on a
    /// node without history; the next acquire begins it).
    epoch: Option<Instant>,
    /// The longest TTL recorded.
    max: Duration,
    /// The longest before `max` was first used.
    prev: Duration,
    /// The histories `max` was first used after (empty: since always).
    after: After,
}

impl Meta {
    fn new(epoch: Option<Instant>) -> Meta {
        Meta {
            epoch,
            max: Duration::ZERO,
            prev: Duration::ZERO,
            after: After::NONE,
        }
    }

    /// The scripts' record of a command's `ttl`, with `known`, the longest
    /// its client knew of before, and `after`, the histories it knew to
    /// have begun (see `raise_lua!`).
    fn raise(&mut self, ttl: Duration, known: Duration, after: After) {
        let base = self.max.max(known);
        if ttl > base {
            (self.max, self.prev, self.after) = (ttl, base, after);
        } else if known > self.max {
            (self.max, self.prev, self.after) = (known, known, After::NONE);
        }
    }
}

impl Default for Store {
    fn default() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        Store {
            keys: HashMap::new(),
            meta: None,
            fences: HashMap::new(),
            id: NEXT.fetch_add(1, Ordering::Relaxed),
        }
    }
}

impl Store {
    /// The acquire script's bookkeeping: facts before this command.
    fn history(
        &mut self,
        (ttl, known, after): (Duration, Duration, After),
        now: Instant,
        base: Instant,
    ) -> NodeFacts {
        let meta = self.meta.get_or_insert(Meta::new(Some(now)));
        let epoch = *meta.epoch.get_or_insert(now);
        let before = *meta;
        meta.raise(ttl, known, after);
        NodeFacts {
            epoch: u64::try_from(epoch.saturating_duration_since(base).as_nanos()).unwrap_or(0) + 1,
            age: now.saturating_duration_since(epoch),
            max_ttl: before.max,
            // One key per history: a store that loses its data is a new one.
            history: self.id,
            after: before.after,
            prev_max: before.prev,
        }
    }

    /// Why the acquire script refuses a fenced acquire (before any write):
    /// a node clock or a counter at the limit of exact Lua numbers.
    fn refuses_fence(&self, op: Op, keys: &[Key<'_>], micros: u64) -> Option<&'static str> {
        let limit = crate::driver::scripts::FENCE_LIMIT;
        if !matches!(op, Op::Acquire { fenced: true, .. }) {
            None
        } else if micros >= limit - (1 << 40) {
            Some("the node clock is past the year 2255")
        } else if keys
            .iter()
            .any(|k| self.fences.get(k.resource).is_some_and(|&c| c >= limit))
        {
            Some("this resource's fencing counter is at its limit")
        } else {
            None
        }
    }

    /// `counter = max(counter, value)`; returns the new counter.
    fn raise_fence(&mut self, resource: &str, value: u64) -> u64 {
        let c = self.fences.entry(resource.into()).or_default();
        *c = (*c).max(value);
        *c
    }

    /// Runs one round's `op` on this node at `now` (its own clock; `base`
    /// is the instant its epochs count from, `micros` its wall clock), as
    /// the scripts do: the reply, or why the node refused.
    pub(crate) fn round(
        &mut self,
        op: Op,
        keys: &[Key<'_>],
        now: Instant,
        base: Instant,
        micros: u64,
    ) -> Result<Reply, &'static str> {
        if let Some(why) = self.refuses_fence(op, keys, micros) {
            return Err(why);
        }
        let facts = match op {
            Op::Acquire {
                ttl,
                known_max,
                after,
                ..
            } => Some(self.history((ttl, known_max, after), now, base)),
            Op::Swap { ttl, known_max, .. } => {
                Some(self.history((ttl, known_max, After::NONE), now, base))
            }
            Op::Extend {
                ttl,
                known_max,
                after,
                ..
            } => {
                // The script writes the record even where the history is
                // gone (a hash without an epoch, which the next acquire
                // starts).
                let meta = self.meta.get_or_insert(Meta::new(None));
                meta.raise(ttl, known_max, after);
                None
            }
            Op::Release { .. } | Op::Fence { .. } | Op::Restore { .. } => None,
        };
        let mut fence = None;
        let answers: Vec<Answer> = keys
            .iter()
            .map(|k| {
                let (a, f) = self.apply(op, k, now, micros);
                fence = fence.max(f);
                a
            })
            .collect();
        Ok(Reply {
            answers,
            facts,
            fence,
            server: None,
        })
    }

    /// The metadata's id.
    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// A lock history that began at `epoch` (a node that has run for a
    /// while), so that its votes count from the start.
    pub(crate) fn with_history(epoch: Instant) -> Self {
        Store {
            meta: Some(Meta::new(Some(epoch))),
            ..Store::default()
        }
    }

    /// Runs `op` for one key, as the scripts do; also returns the fencing
    /// counter a fenced acquire set. `micros`: the node's clock, the floor
    /// of a counter.
    fn apply(&mut self, op: Op, k: &Key<'_>, now: Instant, micros: u64) -> (Answer, Option<u64>) {
        if let (Op::Acquire { fenced, .. }, Some((t, exp))) = (op, self.keys.get(k.resource)) {
            if t == k.token && *exp > now {
                // This attempt's own SET, sent again: set, with its counter.
                let fence = fenced.then(|| self.fences.get(k.resource).copied().unwrap_or(0));
                return (Answer::Ok, fence);
            }
        }
        let answer = self.apply_key(op, k, now);
        let fence = match (op, answer) {
            (Op::Acquire { fenced: true, .. }, Answer::Ok) => {
                let next = self.fences.get(k.resource).map_or(0, |c| c + 1);
                Some(self.raise_fence(k.resource, next.max(micros)))
            }
            _ => None,
        };
        (answer, fence)
    }

    /// What `op` does to one key.
    fn apply_key(&mut self, op: Op, k: &Key<'_>, now: Instant) -> Answer {
        self.keys.retain(|_, (_, exp)| *exp > now);
        match (op, self.keys.get(k.resource)) {
            (Op::Acquire { ttl, .. }, None) => {
                self.keys
                    .insert(k.resource.into(), (k.token.into(), after(now, ttl)));
                Answer::Ok
            }
            (Op::Acquire { .. }, Some(_)) => Answer::Other,
            (Op::Restore { ttl }, None) => {
                self.keys
                    .insert(k.resource.into(), (k.token.into(), after(now, ttl)));
                Answer::Restored
            }
            (Op::Restore { .. }, Some((t, _))) if t == k.token => Answer::Ok,
            (Op::Restore { .. }, Some(_)) => Answer::Other,
            (_, None) => Answer::Absent,
            // This swap, sent again: done already.
            (Op::Swap { .. }, Some((t, _))) if k.next.is_some_and(|n| n == t) => Answer::Ok,
            (Op::Release { .. } | Op::Swap { .. }, Some((t, _)))
                if !crate::algorithm::round::ours(t, k.token) =>
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
            (Op::Extend { ttl, .. }, Some(&(_, expiry))) => {
                // Never shortens (the script's PTTL check).
                let expiry = expiry.max(after(now, ttl));
                self.keys
                    .insert(k.resource.into(), (k.token.into(), expiry));
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
    Redlock::from_parts(
        settings,
        Box::new(Shared(nodes.clone(), rules)),
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
        Box::new(Shared(nodes.clone(), VoteRules::default())),
        clock.clone(),
        Rng::new(42),
        Some(Arc::new(f)),
    );
    (client, nodes, clock)
}

/// Hostile review of the fencing tokens (issue 9), on the fake nodes.
/// Fencing under hostile schedules: what the review of issue 9 tried.
#[cfg(test)]
mod fencing_checks {
    use std::sync::atomic::Ordering;
    use std::sync::Arc;
    use std::time::Duration;

    use super::logs::capture_logs;
    use super::{client_over, client_with, settings, FakeNodes, Hook, Mode};
    use crate::algorithm::round::Op;
    use crate::clock::Clock;
    use crate::error::Error;
    use crate::lock::settings::Settings;

    const MS: Duration = Duration::from_millis(1);
    const TTL: Duration = Duration::from_secs(10);

    fn fenced() -> Settings {
        Settings {
            fencing: true,
            ..settings()
        }
    }

    fn hook(nodes: &FakeNodes, f: impl Fn(&FakeNodes, Op) + Send + Sync + 'static) {
        *nodes.before_round.lock() = Some(Hook(Box::new(f)));
    }

    fn unhook(nodes: &FakeNodes) {
        *nodes.before_round.lock() = None;
    }

    /// Another owner's key, planted on `node` (as if its SET had won there).
    fn plant(nodes: &FakeNodes, node: usize, resource: &str, token: &str) {
        let exp = crate::clock::after(nodes.clock.now(), TTL);
        nodes.stores[node]
            .lock()
            .keys
            .insert(resource.into(), (token.into(), exp));
    }

    // ------------------------------------------------------------------
    // Found by the review of issue 9.

    /// The write-back finds another owner's key on a majority (ours was
    /// deleted behind our back, e.g. FLUSHALL/failover, and another client
    /// won the nodes). Nothing was slow: 1 ms rounds, 10 s TTL. The error
    /// should say the lock is taken (as an acquire that meets another owner
    /// says), not `ValidityExhausted`, whose documentation tells the caller
    /// "a majority agreed, but so late that no validity was left … raise the
    /// TTL or look at node latency".
    #[test]
    fn a_write_back_beaten_by_another_owner_reports_taken() {
        let (locks, nodes, _) = client_with(3, fenced());
        hook(&nodes, |n, op| {
            if matches!(op, Op::Fence { .. }) {
                for i in 0..3 {
                    n.del(i, "r");
                    plant(n, i, "r", "another-owner");
                }
            }
        });
        let err = locks.try_lock("r", TTL).expect_err("not granted");
        unhook(&nodes);
        assert!(err.is_retryable(), "{err:?}");
        assert!(
            matches!(err, Error::Taken { .. }),
            "the write-back met another owner on 3 of 3 nodes after a 1 ms round, \
             yet the error is {err:?} ({err})"
        );
    }

    /// Counters stop at the limit of exact Lua numbers: an acquire meeting
    /// one is refused by the node (before its SET), and a baton whose next
    /// token would pass it is not handed over.
    #[test]
    fn counters_at_the_limit_refuse_instead_of_tying() {
        let (locks, nodes, _) = client_with(3, fenced());
        let limit = crate::driver::scripts::FENCE_LIMIT;
        for i in 0..3 {
            nodes.stores[i].lock().fences.insert("r".into(), limit);
        }
        match locks.try_lock("r", TTL) {
            Err(Error::NoQuorum { failures, .. }) => assert!(failures
                .iter()
                .all(|f| f.kind() == crate::NodeErrorKind::Server)),
            other => panic!("{other:?}"),
        }
        assert!((0..3).all(|i| nodes.get(i, "r").is_none()), "no SET ran");
        for i in 0..3 {
            nodes.stores[i].lock().fences.insert("s".into(), limit - 1);
        }
        let g = locks.try_lock("s", TTL).expect("the last exact token");
        assert_eq!(g.fencing_token(), Some(limit));
        assert!(locks.engine.take_over(g.state(), TTL).is_err(), "limit + 1");
        std::mem::forget(g);
        assert!((0..3).all(|i| nodes.get(i, "s").is_none()), "released");
    }

    /// A command sent again after its connection closed (it may have run):
    /// the store answers as the scripts do, our own SET (with its counter)
    /// and our own swap count as done, another token's key does not.
    #[test]
    fn commands_sent_again_count_what_they_did_the_first_time() {
        use crate::algorithm::round::{Answer, Key};
        let mut store = super::Store::default();
        let now = std::time::Instant::now();
        let acquire = Op::Acquire {
            ttl: TTL,
            known_max: TTL,
            fenced: true,
            after: crate::algorithm::round::After::NONE,
        };
        let first = store
            .round(acquire, &[Key::new("r", "t1")], now, now, 5)
            .expect("first");
        let again = store
            .round(acquire, &[Key::new("r", "t1")], now, now, 9)
            .expect("again");
        assert_eq!(first.answers, vec![Answer::Ok]);
        assert_eq!(again.answers, vec![Answer::Ok]);
        assert_eq!(again.fence, first.fence, "the same section's counter");
        let other = store
            .round(acquire, &[Key::new("r", "t2")], now, now, 9)
            .expect("other");
        assert_eq!(other.answers, vec![Answer::Other]);
        let swap = Op::Swap {
            ttl: TTL,
            known_max: TTL,
            fence: None,
        };
        let key = Key {
            next: Some("t1.s"),
            ..Key::new("r", "t1")
        };
        for _ in 0..2 {
            let r = store.round(swap, &[key], now, now, 9).expect("swap");
            assert_eq!(r.answers, vec![Answer::Ok]);
        }
    }

    // ------------------------------------------------------------------
    // Attacks that held up.

    /// The write-back reaches one node and executes on a Lossy one (reply
    /// lost): one confirmed of three is no majority. Refused, retryable, and
    /// the key is gone where the release ran (the Lossy node executed it).
    #[test]
    fn lossy_write_back_is_not_counted() {
        let (locks, nodes, _) = client_with(3, fenced());
        hook(&nodes, |n, op| {
            if let Op::Fence { .. } = op {
                n.set_mode(1, Mode::Lossy);
                n.set_mode(2, Mode::Down);
            }
        });
        match locks.try_lock("r", TTL) {
            Err(e @ Error::NoQuorum { agreed: 1, .. }) => assert!(e.is_retryable()),
            other => panic!("{other:?}"),
        }
        unhook(&nodes);
        // Node 2 (down) is left to the background retries the fake lacks.
        assert!((0..2).all(|i| nodes.get(i, "r").is_none()));
    }

    /// The acquire round eats most of the validity; the write-back round
    /// (same latency) cannot end inside it. Refused, retryable, key gone.
    #[test]
    fn validity_running_out_during_the_write_back() {
        let (locks, nodes, _) = client_with(3, fenced());
        let ttl = 100 * MS;
        *nodes.latency.lock() = 49 * MS;
        match locks.try_lock("r", ttl) {
            Err(e @ Error::ValidityExhausted { .. }) => assert!(e.is_retryable()),
            Ok(g) => panic!("granted with {:?} left", g.validity()),
            Err(e) => panic!("{e:?}"),
        }
        assert!((0..3).all(|i| nodes.get(i, "r").is_none()));
        // One ms less per round: granted, with its token written back.
        *nodes.latency.lock() = 40 * MS;
        let g = locks.try_lock("s", ttl).expect("fits");
        let t = g.fencing_token().unwrap();
        assert!((0..3).all(|i| nodes.fence(i, "s") == Some(t)));
    }

    /// lock() retries after a failed write-back and the retry's token is
    /// larger than any counter the failed attempt left behind.
    #[test]
    fn lock_retries_after_a_failed_write_back() {
        let (locks, nodes, _) = client_with(3, fenced());
        let fences = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let seen = fences.clone();
        hook(&nodes, move |n, op| {
            if matches!(op, Op::Fence { .. }) && seen.fetch_add(1, Ordering::SeqCst) == 0 {
                n.del(0, "r");
                n.del(1, "r");
            }
        });
        let g = locks.lock("r", TTL).expect("second attempt");
        assert_eq!(fences.load(Ordering::SeqCst), 2);
        let t = g.fencing_token().unwrap();
        assert!((0..3).all(|i| nodes.fence(i, "r").is_some_and(|c| c <= t)));
    }

    /// A node held back by the restart rule granted our SET with a much
    /// larger counter (its clock is ahead); the token comes from the counted
    /// nodes only, and the next holder, granted by that node and one other,
    /// still gets a larger token.
    #[test]
    fn a_held_back_node_with_a_larger_counter() {
        let s = Settings {
            fresh_cluster: false,
            max_ttl: Some(TTL),
            ..fenced()
        };
        let (locks, nodes, clock) = client_with(3, s.clone());
        // Everyone old enough.
        clock.advance(TTL);
        for i in 0..3 {
            let _ = nodes.stores[i].lock().history(
                (TTL, TTL, crate::algorithm::round::After::NONE),
                clock.base,
                clock.base,
            );
        }
        nodes.wipe(2);
        nodes.set_clock_offset(2, 5_000_000);
        let g = locks.try_lock("r", TTL).expect("nodes 0 and 1");
        let t = g.fencing_token().unwrap();
        assert!(nodes.fence(2, "r").unwrap() > t, "node 2's own counter");
        g.release().unwrap();
        nodes.set_mode(0, Mode::Down);
        clock.advance(TTL + MS);
        let b = client_over(&nodes, s);
        let tb = b.try_lock("r", TTL).unwrap().fencing_token().unwrap();
        assert!(tb > t);
    }

    /// Fenced and unfenced clients alternate on one resource: the unfenced
    /// ones leave the counters alone, the fenced tokens keep growing.
    #[test]
    fn mixed_fenced_and_unfenced_clients() {
        let (a, nodes, clock) = client_with(3, fenced());
        let plain = client_over(&nodes, settings());
        let mut last = 0;
        for i in 0..10 {
            let g = plain.try_lock("r", TTL).unwrap();
            assert_eq!(g.fencing_token(), None);
            if i % 2 == 0 {
                drop(g);
            } else {
                std::mem::forget(g);
                clock.advance(TTL + MS);
            }
            let g = a.try_lock("r", TTL).unwrap();
            let t = g.fencing_token().unwrap();
            assert!(t > last, "{t} after {last}");
            last = t;
        }
    }

    /// try_lock with fencing, a node hung in the write-back and in the
    /// release: at most three node timeouts (acquire, write-back, release).
    #[test]
    fn try_lock_bound_with_a_failing_write_back() {
        let (locks, nodes, clock) = client_with(3, fenced());
        let nt = locks.engine.settings.node_timeout;
        nodes.set_mode(2, Mode::Down);
        hook(&nodes, |n, op| match op {
            Op::Acquire { .. } => n.set_mode(1, Mode::Up),
            _ => n.set_mode(1, Mode::Hung),
        });
        let t0 = clock.now();
        assert!(locks.try_lock("r", TTL).is_err());
        let took = clock.now().saturating_duration_since(t0);
        assert!(took <= 3 * nt, "{took:?}");
        // lock(): retry_count × (delay + jitter + nt) + 3 nt.
        let s = &locks.engine.settings;
        let bound = (s.retry_delay + s.retry_jitter + nt) * s.retry_count + 3 * nt;
        let t0 = clock.now();
        assert!(locks.lock("r", TTL).is_err());
        let took = clock.now().saturating_duration_since(t0);
        assert!(took <= bound, "{took:?} > {bound:?}");
        unhook(&nodes);
    }

    /// Logging: a fenced happy path logs nothing at info or above, and no
    /// fencing token ever appears in a record above debug, on success or on
    /// a failed write-back.
    #[test]
    fn no_warn_on_the_happy_path_and_tokens_only_at_debug() {
        let records = capture_logs();
        let (locks, nodes, _) = client_with(3, fenced());
        let mut tokens = Vec::new();
        for _ in 0..5 {
            let g = locks.lock("r", TTL).unwrap();
            tokens.push(g.fencing_token().unwrap());
            g.release().unwrap();
        }
        let happy = records.take();
        assert!(
            happy
                .iter()
                .any(|(l, m)| *l == log::Level::Debug && m.contains("fencing token")),
            "the capture works: {happy:?}"
        );
        let loud: Vec<String> = happy
            .into_iter()
            .filter(|(l, _)| *l <= log::Level::Info)
            .map(|(_, m)| m)
            .collect();
        assert!(loud.is_empty(), "happy path logged: {loud:?}");
        // A failed write-back (one node gone between the rounds).
        nodes.set_mode(2, Mode::Down);
        hook(&nodes, |n, op| {
            if matches!(op, Op::Fence { .. }) {
                n.set_mode(1, Mode::Down);
            }
        });
        let _ = locks.try_lock("s", TTL);
        unhook(&nodes);
        for i in 0..3 {
            if let Some(t) = nodes.fence(i, "s") {
                tokens.push(t);
            }
        }
        for (l, m) in records.take() {
            if l <= log::Level::Info {
                for t in &tokens {
                    assert!(!m.contains(&t.to_string()), "token at {l}: {m}");
                }
            }
        }
    }
}

/// Log records of the calling thread, for tests of what is logged.
#[cfg(test)]
pub(crate) mod logs {
    use std::sync::Arc;

    /// A logger that keeps the records of the calling thread only.
    struct Capture {
        thread: std::thread::ThreadId,
        records: Arc<parking_lot::Mutex<Vec<(log::Level, String)>>>,
    }

    pub(crate) struct Records(Arc<parking_lot::Mutex<Vec<(log::Level, String)>>>);

    impl Records {
        pub(crate) fn take(&self) -> Vec<(log::Level, String)> {
            std::mem::take(&mut *self.0.lock())
        }
    }

    static SINK: std::sync::OnceLock<parking_lot::Mutex<Vec<Capture>>> = std::sync::OnceLock::new();

    struct Logger;

    impl log::Log for Logger {
        fn enabled(&self, _: &log::Metadata<'_>) -> bool {
            true
        }
        fn log(&self, record: &log::Record<'_>) {
            let me = std::thread::current().id();
            if let Some(sink) = SINK.get() {
                for c in sink.lock().iter().filter(|c| c.thread == me) {
                    c.records
                        .lock()
                        .push((record.level(), record.args().to_string()));
                }
            }
        }
        fn flush(&self) {}
    }

    pub(crate) fn capture_logs() -> Records {
        static LOGGER: Logger = Logger;
        let sink = SINK.get_or_init(Default::default);
        if log::set_logger(&LOGGER).is_ok() {
            log::set_max_level(log::LevelFilter::Trace);
        }
        let records = Arc::new(parking_lot::Mutex::new(Vec::new()));
        sink.lock().push(Capture {
            thread: std::thread::current().id(),
            records: records.clone(),
        });
        Records(records)
    }
}
