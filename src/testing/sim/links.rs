//! The simulation's [`Links`]: each simulated client (process) gets pools
//! of simulated connections to the world's nodes and virtual time, and runs
//! the production round ([`Round`]) over them: the node engine's admission,
//! late replies, undo after a failed attempt, NOSCRIPT fallback, closes and
//! release retries are the driver's own code, and the bytes they write are
//! the driver's own encoding, which the simulated nodes read back.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use redis::Value;

use crate::algorithm::health::Outcome;
use crate::algorithm::quorum::VoteRules;
use crate::algorithm::round::{Key, Op};
use crate::clock::Clock;
use crate::driver::conn::{queue_connect_commands, For};
use crate::driver::conn_state::{ConnState, InFlight};
use crate::driver::node::encode::Encoded;
use crate::driver::node::jobs::{drain_owing, resend_releases};
use crate::driver::node::link::Link;
use crate::driver::node::links::Links;
use crate::driver::node::multiplexed::{self, Await, Multiplexed, RoundConn, Wake};
use crate::driver::node::node_round::NodeRound;
use crate::driver::node::replies::catch_up;
use crate::driver::node::retries::Retry;
use crate::driver::node::servers::Servers;
use crate::driver::node::state::{Defects, NodeState};
use crate::error::{NodeError, NodeErrorKind};
use crate::events::Events;
use crate::testing::sim::check::{RETRY_BATCH, RETRY_EVERY};
use crate::testing::sim::redis::Inbox;
use crate::testing::sim::redis::{command, commands, Command, OwnedKey};
use crate::testing::sim::sched::{Sched, SimClock};
use crate::testing::sim::world::{Msg, ServerStatus};

/// One simulated connection: what it owes, the connection (lane) it is in
/// the world, and what it has received.
struct SimLink {
    wire: ConnState,
    lane: u64,
    node: usize,
    inbox: Arc<Inbox>,
}

/// A simulated connection checked out of its pool; back to it when
/// dropped, unless broken.
pub(crate) struct SimConn {
    link: Option<SimLink>,
    pool: Arc<Mutex<Vec<SimLink>>>,
    /// The node's count of idle connections owing replies.
    owing: Arc<std::sync::atomic::AtomicUsize>,
    sched: Arc<Sched>,
    /// Its client's process: a dead one writes nothing.
    fate: Arc<Fate>,
}

impl SimConn {
    fn link(&self) -> &SimLink {
        self.link.as_ref().expect("checked out")
    }

    fn link_mut(&mut self) -> &mut SimLink {
        self.link.as_mut().expect("checked out")
    }
}

impl Drop for SimConn {
    fn drop(&mut self) {
        if let Some(mut l) = self.link.take() {
            if !l.wire.idles(&self.owing) {
                self.pool.lock().push(l);
            }
        }
    }
}

fn reset() -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::ConnectionReset,
        "connection reset by the node",
    )
}

impl Link for SimConn {
    type Ready = ();
    type Handle = ();

    fn handle(&self) -> Option<()> {
        Some(())
    }

    fn wire(&self) -> &ConnState {
        &self.link().wire
    }

    fn wire_mut(&mut self) -> &mut ConnState {
        &mut self.link_mut().wire
    }

    fn flush(&mut self) -> std::io::Result<()> {
        let sched = self.sched.clone();
        let dead = self.fate.is_dead();
        let l = self.link_mut();
        if dead {
            // Its process is gone: nothing it would write leaves.
            l.wire.broken = true;
            return Err(reset());
        }
        if l.inbox.is_closed() && !l.inbox.ready_replies() {
            // The close was read (a write after it fails, as TCP's does
            // once the reset is back).
            l.wire.broken = true;
            return Err(reset());
        }
        let bytes = l.wire.output().to_vec();
        if bytes.is_empty() {
            return Ok(());
        }
        let now = sched.nanos();
        let mut core = sched.lock();
        let world = &mut core.world;
        let node = &world.nodes[l.node];
        let reaches = node.state != ServerStatus::Down
            && !node.isolated
            && !l.inbox.is_severed()
            && (!world.dead.contains(&l.lane) || world.resetting.contains(&l.lane));
        for cmd in commands(&bytes) {
            if let Command::Script { op, keys, .. } = command(&cmd) {
                if let (Op::Release { .. }, true) = (op, reaches) {
                    for k in &keys {
                        world.check.delete_sent(&k.token, l.node, now);
                    }
                }
                let keys: Vec<Key<'_>> = keys.iter().map(OwnedKey::key).collect();
                if std::env::var_os("QUORUMLOCK_SIM_TRACE").is_some() {
                    let to = if reaches { "" } else { " (cannot reach it)" };
                    println!(
                        "{:10.3} ms to node {} lane {}{to}:",
                        now as f64 / 1e6,
                        l.node,
                        l.lane
                    );
                }
                world.check.sent(op, &keys, now);
            }
            if let Command::Set { key, ttl } = command(&cmd) {
                // The lean acquire's write.
                let op = Op::Acquire {
                    ttl,
                    known_max: ttl,
                    fenced: false,
                    after: crate::algorithm::round::After::NONE,
                    known_prev: Duration::ZERO,
                    intent: Duration::ZERO,
                    place: crate::algorithm::round::Place::NONE,
                    lean: Some(0),
                };
                world.check.sent(op, &[key.key()], now);
            }
            let msg = Msg {
                node: l.node,
                sent: now,
                cmd,
                inbox: l.inbox.clone(),
                lane: l.lane,
            };
            world.send(msg, now);
        }
        drop(core);
        l.wire.written(bytes.len());
        Ok(())
    }

    fn on_ready(&mut self, (): ()) -> std::io::Result<()> {
        // Replies that arrived before the close are read first.
        let l = self.link_mut();
        if l.inbox.is_closed() && !l.inbox.ready_replies() {
            l.wire.broken = true;
            return Err(reset());
        }
        Ok(())
    }

    fn next_reply(&mut self) -> std::io::Result<Option<(InFlight, Value)>> {
        let l = self.link_mut();
        while let Some(v) = l.inbox.pop() {
            if let Some(r) = l.wire.gather(v)? {
                return Ok(Some(r));
            }
        }
        Ok(None)
    }

    fn wants_write(&self) -> bool {
        false
    }

    fn read_all(&mut self) -> std::io::Result<()> {
        self.on_ready(())
    }

    fn abandon(&mut self) {
        let now = self.sched.instant(self.sched.nanos());
        if self.wire_mut().give_up(now) {
            let _ = self.flush();
        }
        self.wire_mut().broken = true;
    }
}

/// One simulated client's connections to the nodes.
pub(crate) struct SimLinks {
    sched: Arc<Sched>,
    pub(crate) names: Vec<String>,
    /// Per entry, the node (server) it reaches.
    entries: Vec<usize>,
    nodes: Vec<Arc<NodeState>>,
    /// Per entry, the connection its rounds share now.
    lines: Vec<Arc<multiplexed::MultiplexedSlot<SimConn>>>,
    pub(crate) servers: Arc<Servers>,
    rules: VoteRules,
    timeout: Duration,
    pools: Vec<Arc<Mutex<Vec<SimLink>>>>,
    /// Wakes this client's rounds when a reply reaches one of its
    /// connections.
    signal: Arc<crate::clock::Signal>,
    /// Who reads the multiplexed connections.
    role: Arc<multiplexed::Role<SimConn>>,
    /// Per entry, a retry thread is scheduled.
    retrying: Vec<AtomicBool>,

    /// The simulation's clock (threads and sleeps go through it).
    clock: Arc<dyn Clock>,
    me: Weak<SimLinks>,
    /// The client's process (see [`Fate`]).
    pub(crate) fate: Arc<Fate>,
}

impl SimLinks {
    /// Each node's lock history as its last acquire script read it.
    pub(crate) fn reads(&self) -> (u64, Vec<Option<crate::algorithm::restart::Read>>) {
        let gen = self.servers.reads_made();
        (gen, self.nodes.iter().map(|n| *n.read.lock()).collect())
    }

    pub(crate) fn new(
        sched: &Arc<Sched>,
        clock: Arc<dyn Clock>,
        timeout: Duration,
        rules: VoteRules,
        defects: Defects,
        fate: Arc<Fate>,
    ) -> Arc<SimLinks> {
        let (names, entries) = {
            let core = sched.lock();
            (core.world.names.clone(), core.world.entries.clone())
        };
        let servers = Arc::new(Servers::new(names.clone(), rules.allow_evicting));
        let line_stats = Arc::new(crate::driver::node::multiplexed::MultiplexedStats::default());
        sched.lock().world.line_stats.push(line_stats.clone());
        Arc::new_cyclic(|me| SimLinks {
            sched: sched.clone(),
            nodes: names
                .iter()
                .enumerate()
                .map(|(i, n)| {
                    let mut shared = NodeState::new(
                        i,
                        servers.clone(),
                        n.clone(),
                        timeout,
                        Events::default(),
                        clock.clone(),
                    );
                    shared.defects = defects;
                    shared.line_stats = line_stats.clone();
                    let sched = sched.clone();
                    shared.stage_yield = Some(Arc::new(move || sched.yield_now()));
                    Arc::new(shared)
                })
                .collect(),
            lines: names.iter().map(|_| Arc::default()).collect(),
            pools: names.iter().map(|_| Arc::default()).collect(),
            retrying: names.iter().map(|_| AtomicBool::new(false)).collect(),

            names,
            entries,
            servers,
            rules,
            timeout,
            signal: Arc::default(),
            role: Arc::default(),
            clock,
            me: me.clone(),
            fate,
        })
    }

    /// A new connection to entry `i`'s node, its connect commands sent; or
    /// the node's refusal (or silence), observed.
    fn connect(&self, i: usize, now: Instant) -> Option<SimConn> {
        if self.fate.is_dead() {
            // Its process is gone: nothing would leave it.
            return None;
        }
        let inbox = Inbox::new(self.signal.clone());
        let node = self.entries[i];
        let opened = {
            let mut core = self.sched.lock();
            let world = &mut core.world;
            world.connect(node, &inbox)
        };
        let lane = match opened {
            Ok(lane) => lane,
            Err(outcome) => {
                let shared = &self.nodes[i];
                if outcome == Outcome::Refused {
                    *shared.connect_error.lock() = Some(NodeError::new(
                        &shared.name,
                        NodeErrorKind::Unavailable,
                        "connection refused",
                    ));
                }
                shared.observe(outcome);
                return None;
            }
        };
        let mut wire = ConnState::new(now);
        queue_connect_commands(&mut wire, For::Rounds, now);
        let mut c = SimConn {
            link: Some(SimLink {
                wire,
                lane,
                node,
                inbox,
            }),
            pool: self.pools[i].clone(),
            owing: self.nodes[i].owing.clone(),
            sched: self.sched.clone(),
            fate: self.fate.clone(),
        };
        c.flush().ok()?;
        Some(c)
    }

    /// As the driver's `wait_connected`, for a first use of a longer TTL:
    /// a connection to every healthy node whose connect commands no
    /// connection has had answered yet, their replies awaited until
    /// `until` at most (the lock histories they report, see
    /// [`Servers::begun_keys`]).
    pub(crate) fn learn_histories(&self, until: Instant) {
        let mut held: Vec<Option<SimConn>> = self.names.iter().map(|_| None).collect();
        loop {
            let mark = self.signal.seen();
            let now = Links::now(self);
            let mut pending = false;
            for (i, c) in held.iter_mut().enumerate() {
                let shared = &self.nodes[i];
                if self.servers.begun_read(i) || !shared.is_healthy() {
                    *c = None;
                    continue;
                }
                if c.is_none() {
                    *c = self.idle(i).or_else(|| self.connect(i, now));
                }
                if let Some(conn) = c.as_mut() {
                    if !catch_up(conn, shared, now) {
                        *c = None;
                    }
                }
                pending |= !self.servers.begun_read(i) && shared.is_healthy();
            }
            if !pending || now >= until {
                return;
            }
            self.sched.wait_signal(&self.signal, mark, Some(until));
        }
    }

    /// An idle connection to entry `i`, as it is (for the retry job's
    /// drain, which reads it).
    fn idle(&self, i: usize) -> Option<SimConn> {
        let link = self.pools[i].lock().pop()?;
        Some(SimConn {
            link: Some(link),
            pool: self.pools[i].clone(),
            owing: self.nodes[i].owing.clone(),
            sched: self.sched.clone(),
            fate: self.fate.clone(),
        })
    }

    /// Sends entry `i`'s owed releases again every [`RETRY_EVERY`] while
    /// any remain (first reading the late replies its idle connections
    /// owe), as the driver's retry job does.
    fn schedule_retries(&self, i: usize) {
        if self.retrying[i].swap(true, Ordering::AcqRel) {
            return;
        }
        let me = self.me.clone();
        let clock = self.clock.clone();
        let spawned = self.clock.spawn(
            "sim-retry",
            Box::new(move || loop {
                clock.sleep(RETRY_EVERY);
                let Some(links) = me.upgrade() else {
                    return;
                };
                let shared = &links.nodes[i];
                let now = links.now();
                let owed = drain_owing(shared, now, || links.idle(i));
                resend_releases(shared, now, RETRY_BATCH, || links.checkout(i, now));
                if !owed && shared.retries.lock().is_empty() {
                    links.retrying[i].store(false, Ordering::Release);
                    return;
                }
            }),
        );
        if spawned.is_err() {
            self.retrying[i].store(false, Ordering::Release);
        }
    }
}

impl Drop for SimLinks {
    /// As the driver's transport does when the client is dropped: each
    /// node's owed releases are sent once more, on a connection of their
    /// own (not waited for here: the simulated client is gone).
    fn drop(&mut self) {
        let now = self.now();
        for i in 0..self.nodes.len() {
            let batch = self.nodes[i].retries.lock().take(usize::MAX, now);
            if batch.is_empty() {
                continue;
            }
            let keys: Vec<Key<'_>> = batch
                .iter()
                .map(|r| Key::new(&r.resource, &r.token))
                .collect();
            let enc = Encoded::new(
                Op::Release {
                    keep_until: now,
                    notice: 0,
                },
                &keys,
            );
            if let Some(mut c) = self.connect(i, now) {
                c.wire_mut().queue(&enc.fallback(), now, false);
                let _ = c.flush();
            }
        }
    }
}

impl Await<SimConn> for SimLinks {
    fn clock_now(&self) -> Instant {
        Links::now(self)
    }

    fn role(&self) -> &multiplexed::Role<SimConn> {
        &self.role
    }

    fn waker(&self) -> Option<Arc<dyn Wake>> {
        Some(self.signal.clone() as Arc<dyn Wake>)
    }

    fn mark(&self) -> u64 {
        self.signal.seen()
    }

    fn block(&self, lines: &[Arc<Multiplexed<SimConn>>], until: Instant, mark: u64) {
        // What arrived before the reader looked is read first (a socket's
        // poll would report it at once): a reply it routes wakes the wait.
        for l in lines {
            l.pump(None);
        }
        self.sched.wait_signal(&self.signal, mark, Some(until));
        for l in lines {
            l.pump(None);
        }
    }
}

impl Links for SimLinks {
    type Link = RoundConn<SimConn>;

    fn names(&self) -> &[String] {
        &self.names
    }

    fn node(&self, i: usize) -> &NodeState {
        &self.nodes[i]
    }

    fn rules(&self) -> VoteRules {
        self.rules
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }

    fn twins(&self) -> Vec<bool> {
        self.servers.twin_mask()
    }

    fn now(&self) -> Instant {
        self.sched.instant(self.sched.nanos())
    }

    fn checkout(&self, i: usize, now: Instant) -> Option<RoundConn<SimConn>> {
        let waker = Some(self.signal.clone() as Arc<dyn Wake>);
        multiplexed::join(
            &self.lines[i],
            &self.nodes[i],
            &self.role,
            waker,
            now,
            || {
                while let Some(mut c) = self.idle(i) {
                    if catch_up(&mut c, &self.nodes[i], now) {
                        return Some(c);
                    }
                }
                // The simulated pools connect on demand, whatever the node's
                // health (the driver's pools reconnect a failing node in the
                // background).
                self.connect(i, now)
            },
        )
    }

    fn checkout_anyway(&self, i: usize, now: Instant) -> Option<RoundConn<SimConn>> {
        // On demand whatever the node's health already (see `checkout`).
        self.checkout(i, now)
    }

    fn wait_for_free(&self, _i: usize, _deadline: Instant) -> Option<RoundConn<SimConn>> {
        // The simulated pools have no size limit: never all busy.
        None
    }

    fn pool_busy(&self, _i: usize) -> Option<u32> {
        None
    }

    fn wait_ready(
        &self,
        parts: &[NodeRound<RoundConn<SimConn>>],
        wait: Duration,
        need: usize,
        ready: &mut Vec<(usize, ())>,
    ) {
        multiplexed::wait_ready(self, parts, wait, need, ready);
    }

    fn retry_later(&self, i: usize, keys: &[Key<'_>], until: Instant) {
        // A delete the node did not take (a release, or the undo of a
        // failed attempt): the leak account learns what it leaves.
        let now = self.sched.nanos();
        self.sched.lock().world.let_go(keys, now);
        if until <= self.now() || keys.is_empty() {
            return;
        }
        {
            let shared = &self.nodes[i];
            let mut q = shared.retries.lock();
            for k in keys {
                q.push(
                    Retry {
                        resource: k.resource.to_owned(),
                        token: k.token.to_owned(),
                        until,
                    },
                    false,
                    &shared.name,
                );
            }
        }
        self.schedule_retries(i);
    }

    fn write_later(&self, _i: usize, _k: &Key<'_>, _ttl: Duration, _known: Duration, _at: Instant) {
        // Only a healthy node that no free connection reached is written to
        // after its round; the simulated pools always connect on demand,
        // so a healthy node is never left unreached.
    }
}

/// What becomes of a simulated client's process: it dies (it writes
/// nothing more: its locks, an election's lease among them, are neither
/// renewed nor released, and expire by their TTL), or it is paused (a
/// stop, a long GC: every thread of it, the renewal thread's rounds
/// included, starts and ends no round until the pause is over).
#[derive(Default)]
pub(crate) struct Fate {
    dead: AtomicBool,
    /// Paused until then (virtual ns).
    paused_until: AtomicU64,
    /// The lineages of every lock its rounds wrote (its keys left behind
    /// when it dies are no leak: see `Checker::abandon`).
    pub(crate) lineages: Mutex<BTreeSet<String>>,
}

impl Fate {
    pub(crate) fn is_dead(&self) -> bool {
        self.dead.load(Ordering::Acquire)
    }

    /// The process dies: the lineages it had written.
    pub(crate) fn kill(&self) -> Vec<String> {
        self.dead.store(true, Ordering::Release);
        self.lineages.lock().iter().cloned().collect()
    }

    /// The process is paused until `until` (virtual ns).
    pub(crate) fn pause_until(&self, until: u64) {
        self.paused_until.fetch_max(until, Ordering::AcqRel);
    }

    /// Waits out a pause (a thread of a paused process does nothing).
    pub(crate) fn hold(&self, sched: &Arc<Sched>) {
        loop {
            let (now, until) = (sched.nanos(), self.paused_until.load(Ordering::Acquire));
            if now >= until {
                return;
            }
            crate::clock::Clock::sleep(&SimClock(sched.clone()), Duration::from_nanos(until - now));
        }
    }
}
