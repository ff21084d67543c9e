//! The Redis driver: one r2d2 pool of non-blocking connections per node, and
//! rounds that take replies in the order they arrive.
//!
//! A round checks out a connection per node without waiting, writes the same
//! packed command to every node, then waits on all sockets at once
//! (`poll(2)`) and takes each reply as it arrives, until the caller says the
//! outcome is settled (plus a short grace for stragglers) or the deadline
//! passes. Nodes still lacking a connection are checked again while the round
//! waits, so a node whose pool is busy or still connecting costs nothing
//! unless its answer is needed.
//!
//! Health follows one rule: only a node's own answers to commands change it
//! (see [`crate::algorithm::health`]). Replies still in flight when a round ends stay on
//! their connection and are read by its next user.

use std::collections::{HashMap, HashSet, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use log::{debug, info, warn};
use parking_lot::Mutex;
use r2d2::{ManageConnection, Pool, PooledConnection};
use redis::Value;
use scheduled_thread_pool::{OnPoolDropBehavior, ScheduledThreadPool};

use crate::algorithm::health::{self, Admit, NodeHealth, Outcome};
use crate::algorithm::quorum::{self, VoteRules};
use crate::algorithm::round::Key;
use crate::algorithm::round::{
    After, Answer, NodeFacts, NodeResult, Op, Reply, ServerKind, ServerTag,
};
use crate::algorithm::server::{id_hash, ServerInfo};
use crate::clock::{after, Throttle, WARN_EVERY};
use crate::driver::conn::{
    self, Conn, ConnectError, PollFlags, Setup, Target, MAX_PENDING, MIN_TIMEOUT,
};
use crate::driver::scripts;
use crate::error::{InvalidInput, NodeError, NodeErrorKind};
use crate::events::{Events, NodeChange, NodeEvent};
use crate::lock::transport::{AfterRound, Decided, Stored, Transport, Undo};

/// A parsed node address.
#[derive(Clone)]
pub(crate) struct NodeSpec {
    /// `host:port`, with `/db` when not 0. No credentials.
    pub name: String,
    pub target: Target,
}

impl fmt::Debug for NodeSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NodeSpec")
            .field("name", &self.name)
            .finish()
    }
}

/// Settings the driver needs beyond addresses.
#[derive(Debug, Clone)]
pub(crate) struct DriverConfig {
    pub timeout: Duration,
    pub pool_size: u32,
    pub events: Events,
    /// Which answers count as votes (see [`quorum::insert_vote`]).
    pub rules: VoteRules,
}

/// Idle connections kept open per node.
const MIN_IDLE: u32 = 2;
/// How often unanswered releases are sent again.
const RETRY_EVERY: Duration = Duration::from_millis(100);
/// Most releases kept for retry per node (the oldest are dropped first).
const MAX_RETRIES: usize = 10_000;
/// Most keys in one retried release command.
const RETRY_BATCH: usize = 1_000;
/// How often a round looks again for a connection it is still missing.
const CONN_RECHECK: Duration = Duration::from_micros(200);

/// What the connections learnt about the nodes' servers, one entry per
/// node, for telling the entries apart (one server listed twice) and for
/// naming the nodes that cannot keep locks, each once.
struct Servers {
    names: Vec<String>,
    known: Mutex<Vec<Known>>,
    /// Some entry has a twin (read without the lock on every round).
    any_twin: AtomicBool,
    /// Per entry, the last history id learnt (0: none), without the lock.
    histories: Vec<AtomicU64>,
}

/// What is known of one node's server.
#[derive(Default, Clone)]
struct Known {
    /// The hash of its `run_id` (`INFO` at connect).
    run: Option<u64>,
    /// The hash of its lock history's id.
    history: Option<u64>,
    /// An `INFO` reply (or its refusal) has been read.
    info_read: bool,
    /// What was logged of it last: its kind (a replica, a cluster node, an
    /// evicting node), or `None` for `INFO` refused; once per change.
    told: Option<Option<ServerKind>>,
    /// The entry found to reach the same server, with a lower index.
    twin: Option<usize>,
    /// A pair with this entry was logged.
    warned_twin: bool,
}

impl Servers {
    fn new(names: Vec<String>) -> Self {
        let known = Mutex::new(vec![Known::default(); names.len()]);
        Servers {
            histories: names.iter().map(|_| AtomicU64::new(0)).collect(),
            names,
            known,
            any_twin: AtomicBool::new(false),
        }
    }

    /// Node `i`'s `INFO` was read: `Ok` with what it says, or `Err` with
    /// why it was refused.
    fn learn_info(&self, i: usize, info: &Result<ServerInfo, String>) {
        let name = &self.names[i];
        let mut known = self.known.lock();
        let k = &mut known[i];
        k.info_read = true;
        let now = info.as_ref().ok().map(ServerInfo::kind);
        // Logged when it changes (INFO is read again now and then: a replica
        // promoted, a policy changed at runtime), a fit node only after an
        // unfit one.
        let first = k.told != Some(now) && !(k.told.is_none() && now == Some(ServerKind::Fit));
        k.told = Some(now);
        match info {
            Ok(info) => {
                k.run = info.run_id.as_deref().map(|r| id_hash(r.as_bytes()));
                if first {
                    match info.kind() {
                        ServerKind::Fit => info!("node {name}: now a primary that keeps its keys; its answers count"),
                        ServerKind::Replica => warn!(
                            "node {name} is a replica (role:{}): it cannot keep locks of its own; its answers are not counted",
                            info.role.as_deref().unwrap_or("?")
                        ),
                        ServerKind::Cluster => warn!(
                            "node {name} is a Redis Cluster node (cluster_enabled:1), not an independent server: its answers are not counted"
                        ),
                        ServerKind::Evicting(policy) => warn!(
                            "node {name} has maxmemory {} with maxmemory-policy {policy}: under memory pressure it can evict lock keys, and a second client then takes a held lock; set maxmemory-policy noeviction (or Builder::refuse_evicting_nodes(true) to refuse its votes)",
                            info.maxmemory.unwrap_or(0)
                        ),
                    }
                }
            }
            Err(why) => {
                if first {
                    info!(
                        "node {name}: INFO refused ({why}): this client cannot tell by run_id whether two entries are one server, nor see a replica, a cluster node or an evicting policy; grant the lock user +info"
                    );
                }
            }
        }
        self.pair(&mut known, i);
    }

    /// Node `i`'s lock history has the id whose hash is `history` (read on
    /// every acquire reply: the lock is taken only when it changed).
    fn learn_history(&self, i: usize, history: u64) {
        if self.histories[i].swap(history, Ordering::Relaxed) == history {
            return;
        }
        let mut known = self.known.lock();
        if known[i].history != Some(history) {
            known[i].history = Some(history);
            self.pair(&mut known, i);
        }
    }

    /// Finds, again, every entry's twin (the first earlier entry that is
    /// the same server, as [`ServerTag::same_server`] decides: what one
    /// node learnt may make or unmake a pair); logs a new pair once.
    fn pair(&self, known: &mut [Known], _i: usize) {
        let tag = |k: &Known| ServerTag {
            run: k.run,
            history: k.history,
            kind: ServerKind::Fit,
        };
        let mut any = false;
        for b in 0..known.len() {
            let twin = (0..b).find(|&a| tag(&known[a]).same_server(&tag(&known[b])));
            if twin.is_some() && known[b].twin != twin && !known[b].warned_twin {
                known[b].warned_twin = true;
                if let Some(a) = twin {
                    warn!(
                        "nodes {} and {} are one server (listed twice: two names, or two databases of it): Redlock needs independent servers; its answers are counted once",
                        self.names[a], self.names[b]
                    );
                }
            }
            known[b].twin = twin;
            any |= twin.is_some();
        }
        self.any_twin.store(any, Ordering::Relaxed);
    }

    /// The node's history id, if known (for answers without one).
    fn history(&self, i: usize) -> Option<u64> {
        Some(self.histories[i].load(Ordering::Relaxed)).filter(|h| *h != 0)
    }

    /// Whether node `i`'s `INFO` (or its refusal) has been read.
    fn info_read(&self, i: usize) -> bool {
        self.known.lock()[i].info_read
    }

    /// Per entry, whether it is known to reach the same server as an
    /// earlier one (empty when no entry is: the usual case, no allocation).
    fn twin_mask(&self) -> Vec<bool> {
        if !self.any_twin.load(Ordering::Relaxed) {
            return Vec::new();
        }
        self.known.lock().iter().map(|k| k.twin.is_some()).collect()
    }

    /// The first pair of entries found to reach one server.
    fn twins(&self) -> Option<(usize, usize)> {
        let known = self.known.lock();
        known
            .iter()
            .enumerate()
            .find_map(|(b, k)| k.twin.map(|a| (a, b)))
    }
}

/// What one node's connections, rounds and background jobs share.
struct NodeShared {
    /// The node's place in the node list.
    index: usize,
    servers: Arc<Servers>,
    name: String,
    timeout: Duration,
    health: Mutex<NodeHealth>,
    /// Releases to send this node again.
    retries: Mutex<Retries>,
    /// Batches of retried releases the node answered (their tokens), for
    /// the retry job to take off `retries`.
    answered: Mutex<Vec<Vec<String>>>,
    /// Tokens of acquires sent to this node whose reply has not been read:
    /// their SET may still land, after a delete sent on another connection.
    /// Kept until the reply is read (or the key would have expired), with
    /// whether a release was sent meanwhile: then the reader deletes the key
    /// again, on the connection that carried the SET.
    unsettled: Mutex<HashMap<String, Unsettled>>,
    /// Tokens whose late SET was deleted again here, by that undo, because
    /// a release was under way (until when the key would have expired). The
    /// release's own delete, on another connection, may then find the key
    /// gone: deleted by us, and counted so.
    undone: Mutex<HashMap<String, Instant>>,
    retry_scheduled: AtomicBool,
    /// Idle connections that were returned to the pool owing replies (a
    /// round that settled before this node answered): the retry job reads
    /// those, and pops no more of the pool than it takes to find them.
    owing: Arc<AtomicUsize>,
    /// The retry job holds idle connections (for microseconds: it only
    /// reads what has arrived): a round that finds none waits for them
    /// instead of failing or growing the pool.
    draining: AtomicBool,
    /// Why the node last refused a connection (a failed connect, or a
    /// server that turned it away), cleared when it answers again: for the
    /// errors of rounds that could not use the node.
    connect_error: Mutex<Option<(NodeErrorKind, String)>>,
    events: Events,
}

/// An acquire whose reply has not been read yet.
#[derive(Debug, Clone, Copy)]
struct Unsettled {
    until: Instant,
    released: bool,
}

/// A release to send again.
struct Retry {
    resource: String,
    token: String,
    until: Instant,
}

/// A node's releases to send again: those it has not answered (`owed`),
/// sent first, and those it answered while a SET of their token may still
/// land (`watched`: deleted again until that SET's reply is read or its TTL
/// ends). At most [`MAX_RETRIES`] in all; a full queue drops watched ones
/// first, the oldest first.
#[derive(Default)]
struct Retries {
    owed: VecDeque<Retry>,
    watched: VecDeque<Retry>,
}

impl Retries {
    fn push(&mut self, r: Retry, watched: bool, node: &str) {
        if self.owed.len() + self.watched.len() >= MAX_RETRIES && self.watched.pop_front().is_none()
        {
            self.owed.pop_front();
            debug!("node {node}: release retry queue full; oldest dropped");
        }
        if watched {
            self.watched.push_back(r);
        } else {
            self.owed.push_back(r);
        }
    }

    /// Up to `n` live releases, owed ones first, taken off the queue.
    fn take(&mut self, n: usize, now: Instant) -> Vec<Retry> {
        self.owed.retain(|r| r.until > now);
        self.watched.retain(|r| r.until > now);
        let k = self.owed.len().min(n);
        let mut batch: Vec<Retry> = self.owed.drain(..k).collect();
        let k = self.watched.len().min(n - batch.len());
        batch.extend(self.watched.drain(..k));
        batch
    }

    fn is_empty(&self) -> bool {
        self.owed.is_empty() && self.watched.is_empty()
    }
}

impl NodeShared {
    /// The single door of the node's health state machine.
    fn observe(&self, outcome: Outcome) {
        let flipped = self.health.lock().observe(Instant::now(), outcome);
        if flipped {
            let change = match outcome {
                Outcome::Answered => {
                    self.connect_error.lock().take();
                    info!("node {}: answering again, back in use", self.name);
                    NodeChange::Rejoined
                }
                o => {
                    debug!("node {}: {o:?}; not waited for until it answers", self.name);
                    NodeChange::Skipped {
                        refused: o == Outcome::Refused,
                    }
                }
            };
            if let Some(h) = self.events.get() {
                h.on_node(&NodeEvent {
                    node: &self.name,
                    change,
                });
            }
        }
    }

    /// A reply was read. When it arrived is not known for one read late
    /// (at the connection's next use), so any reply is an answer; a timeout
    /// is only ever seen as a reply still missing after the node timeout.
    fn replied(&self) {
        self.observe(Outcome::Answered);
    }

    fn is_healthy(&self) -> bool {
        self.health.lock().is_healthy()
    }
}

/// A node: its shared state and pool.
struct NodeInner {
    shared: Arc<NodeShared>,
    pool: Pool<Manager>,
}

struct Node {
    inner: Arc<NodeInner>,
    /// Where to connect outside the pool (status queries).
    target: Target,
    /// This node's own background thread: connects and release retries, so
    /// that a node that is slow to connect delays no other node.
    threads: Arc<ScheduledThreadPool>,
}

/// The production [`Transport`].
pub(crate) struct RedisTransport {
    names: Vec<String>,
    nodes: Vec<Node>,
    timeout: Duration,
    rules: VoteRules,
    servers: Arc<Servers>,
}

impl fmt::Debug for RedisTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisTransport")
            .field("nodes", &self.names)
            .finish()
    }
}

impl RedisTransport {
    /// Creates the pools without waiting for any node.
    pub(crate) fn new(specs: Vec<NodeSpec>, config: DriverConfig) -> Self {
        let timeout = config.timeout.max(MIN_TIMEOUT);
        let servers = Arc::new(Servers::new(specs.iter().map(|s| s.name.clone()).collect()));
        let mut names = Vec::with_capacity(specs.len());
        let mut nodes = Vec::with_capacity(specs.len());
        for (i, spec) in specs.into_iter().enumerate() {
            let threads = Arc::new(
                ScheduledThreadPool::builder()
                    .num_threads(1)
                    .thread_name_pattern(&format!("quorumlock-n{i}"))
                    .on_drop_behavior(OnPoolDropBehavior::DiscardPendingScheduled)
                    .build(),
            );
            let shared = Arc::new(NodeShared {
                index: i,
                servers: servers.clone(),
                name: spec.name.clone(),
                timeout,
                health: Mutex::new(NodeHealth::default()),
                retries: Mutex::new(Retries::default()),
                answered: Mutex::new(Vec::new()),
                unsettled: Mutex::new(HashMap::new()),
                undone: Mutex::new(HashMap::new()),
                retry_scheduled: AtomicBool::new(false),
                owing: Arc::new(AtomicUsize::new(0)),
                draining: AtomicBool::new(false),
                connect_error: Mutex::new(None),
                events: config.events.clone(),
            });
            let manager = Manager {
                target: spec.target.clone(),
                shared: shared.clone(),
            };
            let pool = Pool::builder()
                .max_size(config.pool_size)
                .min_idle(Some(MIN_IDLE.min(config.pool_size)))
                .test_on_check_out(false)
                // A failed background connect is retried after at most half
                // of this: a node that comes back is connected within 200 ms.
                .connection_timeout(Duration::from_millis(400))
                .error_handler(Box::new(ConnectErrors {
                    node: spec.name.clone(),
                    warned: Throttle::default(),
                }))
                .thread_pool(threads.clone())
                .build_unchecked(manager);
            names.push(spec.name);
            nodes.push(Node {
                inner: Arc::new(NodeInner { shared, pool }),
                target: spec.target,
                threads,
            });
        }
        RedisTransport {
            names,
            nodes,
            timeout,
            rules: config.rules,
            servers,
        }
    }

    /// A connection to node `i` if one is idle (a new one is started in the
    /// background otherwise). Late replies on it are read first; a connection
    /// owing a reply older than the node timeout is the node's timeout.
    fn checkout(&self, i: usize, now: Instant) -> Option<PooledConnection<Manager>> {
        let node = &self.nodes[i].inner;
        // Only a healthy node gets new connections started on demand; a
        // failing one is reconnected by the pool's background retries.
        // Nor while the retry job holds the idle ones: they are back at once.
        let grow = node.shared.is_healthy() && !node.shared.draining.load(Ordering::Acquire);
        for _ in 0..3 {
            let mut c = if grow {
                node.pool.get_timeout(Duration::ZERO).ok()?
            } else {
                node.pool.try_get()?
            };
            if prepare(&mut c, &node.shared, now) {
                return Some(c);
            }
        }
        None
    }

    /// Sends a granted lock's `SET` to node `i` after its round (which found
    /// no free connection to it in time), from the node's thread, as soon
    /// as a connection is free (within the node timeout), with the TTL that
    /// is left: the key then lives as long as the others. Its reply is read
    /// as a late reply: if the lock was released meanwhile, the key is
    /// deleted again behind it (and a release before it leaves cancels it).
    fn write_later(
        &self,
        i: usize,
        k: &Key<'_>,
        ttl: Duration,
        known_max: Duration,
        start: Instant,
    ) {
        let node = &self.nodes[i];
        let shared = &node.inner.shared;
        let until = after(start, ttl);
        {
            // Unsettled from now on: a release marks it, and keeps deleting.
            let mut unsettled = shared.unsettled.lock();
            if unsettled.len() >= MAX_RETRIES {
                let now = Instant::now();
                unsettled.retain(|_, u| u.until > now);
            }
            unsettled.entry(k.token.to_owned()).or_insert(Unsettled {
                until,
                released: false,
            });
        }
        let job = LateWrite {
            resource: k.resource.to_owned(),
            token: k.token.to_owned(),
            ttl,
            known_max,
            start,
            give_up: after(Instant::now(), self.timeout),
        };
        let weak = Arc::downgrade(&node.inner);
        let pool = Arc::downgrade(&node.threads);
        node.threads.execute(move || late_write(&weak, &pool, job));
    }

    fn enqueue_retries(&self, i: usize, keys: &[Key<'_>], until: Instant) {
        if until <= Instant::now() || keys.is_empty() {
            return;
        }
        let node = &self.nodes[i];
        {
            let mut q = node.inner.shared.retries.lock();
            for k in keys {
                q.push(
                    Retry {
                        resource: k.resource.to_owned(),
                        token: k.token.to_owned(),
                        until,
                    },
                    false,
                    &node.inner.shared.name,
                );
            }
        }
        schedule_retry(&node.inner, &node.threads);
    }
}

impl Drop for RedisTransport {
    /// Sends each node the releases it still owes (it did not answer them,
    /// or a `SET` of theirs may still land) once more, all nodes at once,
    /// each on a connection of its own (a node that was failing may have no
    /// pooled one): at most one node timeout to connect and one for the
    /// reply. What is still unanswered then expires with its TTL.
    fn drop(&mut self) {
        let now = Instant::now();
        let owed: Vec<(usize, Vec<Retry>)> = self
            .nodes
            .iter()
            .enumerate()
            .map(|(i, node)| (i, node.inner.shared.retries.lock().take(usize::MAX, now)))
            .filter(|(_, batch)| !batch.is_empty())
            .collect();
        if owed.is_empty() {
            return;
        }
        let timeout = self.timeout;
        std::thread::scope(|scope| {
            for (i, batch) in &owed {
                let (node, name) = (&self.nodes[*i], &self.names[*i]);
                let spawned = std::thread::Builder::new()
                    .name("quorumlock-flush".into())
                    .spawn_scoped(scope, move || {
                        let keys: Vec<Key<'_>> = batch
                            .iter()
                            .map(|r| Key::new(&r.resource, &r.token))
                            .collect();
                        let enc = Encoded::new(Op::Release { keep_until: now }, &keys);
                        match release_once(&node.target, &enc.fallback(), timeout) {
                            Ok(()) => debug!(
                                "node {name}: client dropped; {} owed release(s) sent",
                                keys.len()
                            ),
                            Err(e) => debug!(
                                "node {name}: client dropped; {} owed release(s) lost: {e}",
                                keys.len()
                            ),
                        }
                    });
                if let Err(e) = spawned {
                    debug!("node {name}: cannot send owed releases: {e}");
                }
            }
        });
    }
}

/// Sends one release command (`EVAL`, so that no script cache is needed)
/// on a new connection, and waits for its reply: within `timeout` to
/// connect and `timeout` for the reply.
fn release_once(target: &Target, cmd: &[u8], timeout: Duration) -> Result<(), String> {
    let mut c = Conn::connect_for(target, timeout, conn::For::Query).map_err(|e| e.to_string())?;
    let now = Instant::now();
    c.queue(cmd, now, true);
    c.flush().map_err(|e| e.to_string())?;
    let deadline = after(now, timeout);
    loop {
        let wanted = c.pending().front().is_some_and(|p| p.wanted);
        let v = c.wait_reply(deadline).map_err(|e| e.to_string())?;
        if wanted {
            return match v {
                Value::ServerError(e) => Err(server_text(&e)),
                _ => Ok(()),
            };
        }
    }
}

/// What [`Redlock::check`](crate::Redlock::check) reads from one node, on a
/// connection of its own: the connect's own setup replies (`SCRIPT LOAD`,
/// `INFO`, the metadata's id), five `PING`s one after another, `TIME`
/// against this machine's clock, `CONFIG GET` of the persistence settings,
/// and the acquire and release scripts on `key` (on this node alone, for
/// one second at most: no lock is granted by one node).
fn probe_one(target: &Target, key: &str, timeout: Duration) -> crate::lock::transport::Probe {
    use crate::lock::transport::Probe;
    let mut p = Probe::default();
    let mut c = match Conn::connect_for(target, timeout, conn::For::Check) {
        Ok(c) => c,
        Err(e) => {
            p.connect = Some(e.to_string());
            return p;
        }
    };
    let text = |v: &Value| match v {
        Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        Value::VerbatimString { text, .. } => Some(text.clone()),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    };
    let io = |e: std::io::Error| e.to_string();
    // The connect's setup replies, in order.
    let deadline = after(Instant::now(), timeout);
    while let Some(setup) = c.pending().front().map(|q| q.setup) {
        let v = match c.wait_reply(deadline) {
            Ok(v) => v,
            Err(e) => {
                p.connect = Some(format!("no answer to the connect's commands: {e}"));
                return p;
            }
        };
        match (setup, &v) {
            (_, Value::ServerError(e)) if refuses_connection(e) => {
                p.connect = Some(format!("it turned the connection away: {}", server_text(e)));
                return p;
            }
            (Setup::Load, Value::ServerError(e)) => p.load = Some(server_text(e)),
            (Setup::Info, Value::ServerError(e)) => p.info = Some(Err(server_text(e))),
            (Setup::Info, v) => p.info = Some(Ok(info_of(v))),
            (Setup::History, v) => p.history = text(v),
            _ => {}
        }
    }
    // One command and its reply, timed.
    let ask = |c: &mut Conn, cmd: &redis::Cmd| -> Result<(Value, Duration), String> {
        let t0 = Instant::now();
        c.queue(&cmd.get_packed_command(), t0, true);
        c.flush().map_err(io)?;
        let v = c.wait_reply(after(t0, timeout)).map_err(io)?;
        Ok((v, t0.elapsed()))
    };
    for _ in 0..5 {
        match ask(&mut c, &redis::cmd("PING")) {
            Ok((_, rtt)) => p.rtts.push(rtt),
            Err(_) => break,
        }
    }
    let before = std::time::SystemTime::now();
    if let Ok((Value::Array(t), rtt)) = ask(&mut c, &redis::cmd("TIME")) {
        let num = |v: Option<&Value>| v.and_then(text).and_then(|s| s.parse::<i64>().ok());
        if let (Some(secs), Some(us)) = (num(t.first()), num(t.get(1))) {
            let mid = before + rtt / 2;
            let local = mid
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX));
            let node = secs.saturating_mul(1_000_000).saturating_add(us);
            p.clock = Some((node.saturating_sub(local), rtt));
        }
    }
    let mut config = |name: &str| match ask(&mut c, redis::cmd("CONFIG").arg("GET").arg(name)) {
        Ok((Value::Array(kv), _)) => Ok(kv.get(1).and_then(text).unwrap_or_default()),
        Ok((Value::ServerError(e), _)) => Err(server_text(&e)),
        Ok((v, _)) => Err(format!("{v:?}")),
        Err(e) => Err(e),
    };
    let persistence = (|| {
        Ok((
            config("save")?,
            config("appendonly")?,
            config("appendfsync")?,
        ))
    })();
    p.persistence = Some(persistence);
    // The lock's own scripts on `key`, on this node: a SET NX of a random
    // token for a second at most, and its compare-and-delete.
    let token = crate::clock::new_token();
    let k = Key::new(key, &token);
    let ttl = Duration::from_secs(1);
    let acquire = Encoded::new(
        Op::Acquire {
            ttl,
            known_max: ttl,
            fenced: false,
            after: After::NONE,
        },
        &[k],
    );
    let release = Encoded::new(
        Op::Release {
            keep_until: Instant::now(),
        },
        &[k],
    );
    let run = |c: &mut Conn, enc: &Encoded| -> Result<Reply, String> {
        let t0 = Instant::now();
        c.queue(&enc.fallback(), t0, true);
        c.flush().map_err(io)?;
        let v = c.wait_reply(after(t0, timeout)).map_err(io)?;
        enc.decode(v).map_err(|(_, why)| why)
    };
    p.scripts = Some(run(&mut c, &acquire).and_then(|r| {
        let other = r.answers.first() == Some(&Answer::Other);
        run(&mut c, &release).map(|_| other)
    }));
    p
}

/// `GET` and `PTTL` of one key on a new connection, within `timeout` each
/// for the connect and for the replies.
fn inspect_one(
    target: &Target,
    resource: &str,
    timeout: Duration,
) -> Result<Option<Stored>, (NodeErrorKind, String)> {
    let mut c =
        Conn::connect_for(target, timeout, conn::For::Query).map_err(|e| (e.kind(), e.detail()))?;
    let now = Instant::now();
    c.queue(
        &redis::cmd("GET").arg(resource).get_packed_command(),
        now,
        true,
    );
    c.queue(
        &redis::cmd("PTTL").arg(resource).get_packed_command(),
        now,
        true,
    );
    let io = |e: std::io::Error| {
        let kind = if e.kind() == std::io::ErrorKind::TimedOut {
            NodeErrorKind::Timeout
        } else {
            NodeErrorKind::Io
        };
        (kind, e.to_string())
    };
    c.flush().map_err(io)?;
    let deadline = after(now, timeout);
    // Replies to the connect's script loads come first.
    let mut replies = Vec::with_capacity(2);
    while replies.len() < 2 {
        let wanted = c.pending().front().is_some_and(|p| p.wanted);
        let v = c.wait_reply(deadline).map_err(io)?;
        if wanted {
            replies.push(v);
        }
    }
    let pttl = replies.pop();
    let value = replies.pop();
    let value = match value {
        Some(Value::Nil) => return Ok(None),
        Some(Value::BulkString(b)) => String::from_utf8_lossy(&b).into_owned(),
        Some(Value::ServerError(e)) => return Err((NodeErrorKind::Server, e.to_string())),
        v => return Err((NodeErrorKind::Protocol, format!("GET answered {v:?}"))),
    };
    let ttl = match pttl {
        Some(Value::Int(ms)) if ms >= 0 => Some(Duration::from_millis(ms.unsigned_abs())),
        Some(Value::Int(-1)) => None,
        // Expired between the two commands.
        Some(Value::Int(_)) => return Ok(None),
        Some(Value::ServerError(e)) => return Err((NodeErrorKind::Server, e.to_string())),
        v => return Err((NodeErrorKind::Protocol, format!("PTTL answered {v:?}"))),
    };
    Ok(Some(Stored { value, ttl }))
}

/// Reads late replies off a checked-out connection. False (and the
/// connection marked broken) when it cannot take a new command.
fn prepare(c: &mut PooledConnection<Manager>, node: &NodeShared, now: Instant) -> bool {
    if let Some(n) = c.owing.take() {
        n.fetch_sub(1, Ordering::AcqRel);
    }
    if c.broken {
        return false;
    }
    // One non-blocking read: late replies, and whether the node closed the
    // connection (CLIENT KILL, a server's or a proxy's idle timeout).
    let closed = c.fill_to_end().is_err();
    loop {
        match c.next_reply() {
            Ok(Some((p, v))) => {
                if !turned_away(&p, &v) {
                    node.replied();
                }
                if late_reply(c, node, p, &v, now).is_err() {
                    return false;
                }
            }
            Ok(None) => break,
            Err(_) => {
                node.observe(Outcome::Refused);
                return false;
            }
        }
    }
    if closed {
        // Closed while idle (CLIENT KILL, a server's or a proxy's idle
        // timeout, a restart): the node answered on this connection before,
        // and a close is no answer, so no change to its health; the round
        // takes another connection, and a node that is down refuses that.
        debug!(
            "node {}: a pooled connection was closed while idle ({} replies owed)",
            node.name,
            c.pending().len()
        );
        return false;
    }
    if let Some(oldest) = c.pending().front() {
        if now.saturating_duration_since(oldest.sent) >= node.timeout {
            c.abandon();
            node.observe(Outcome::TimedOut);
            return false;
        }
        if c.pending().len() >= MAX_PENDING {
            c.abandon();
            return false;
        }
    }
    if now.saturating_duration_since(c.info_at) >= INFO_EVERY {
        // What the server is can change without a new connection (a replica
        // promoted, a memory policy set at runtime): asked again, ahead of
        // this connection's next command, not waited for.
        c.info_at = now;
        c.queue_setup(&redis::cmd("INFO").get_packed_command(), now, Setup::Info);
        // Sent now (a caller of `prepare` may send nothing after it, and a
        // reply owed for a command never sent would look like a timeout).
        if c.flush().is_err() {
            return false;
        }
    }
    true
}

/// What an `INFO` reply says (an unexpected reply says nothing).
fn info_of(v: &Value) -> ServerInfo {
    match v {
        Value::BulkString(b) => ServerInfo::parse_bytes(b),
        Value::VerbatimString { text, .. } | Value::SimpleString(text) => ServerInfo::parse(text),
        _ => ServerInfo::default(),
    }
}

/// How often a pooled connection asks its server's `INFO` again.
const INFO_EVERY: Duration = Duration::from_secs(10);

/// A reply no round waits for any more: a command sent at connect (who the
/// server is), or a late reply; if it says a write of an ended round landed
/// on a lock released meanwhile, deletes that key again (on the same
/// connection). `Err` when the connection cannot be used: its node refused
/// it (`ConnectionRefused`, with the server's words), or a write failed.
fn late_reply(
    c: &mut Conn,
    node: &NodeShared,
    p: crate::driver::conn::Pending,
    v: &Value,
    now: Instant,
) -> std::io::Result<()> {
    if p.setup != Setup::None {
        return setup_reply(c, node, p.setup, v);
    }
    let mut released = None;
    if !p.tokens.is_empty() {
        let mut unsettled = node.unsettled.lock();
        for t in &p.tokens {
            if let Some(u) = unsettled.remove(t).filter(|u| u.released) {
                released = released.max(Some(u.until));
            }
        }
    }
    // A granted lock's late copy stays (it is part of the lock) unless the
    // lock was released meanwhile; a failed attempt's was undone already.
    // (A restore has no undo: its command also went to nodes whose copy the
    // lock held already, which a delete by token cannot tell apart; the
    // release's retries, kept up while its token is unsettled, delete it.)
    if let (Some(undo), Some(until)) = (p.undo.as_ref(), released) {
        if acquired_any(v) {
            debug!("node {}: a late write landed; deleting it", node.name);
            c.queue(undo, now, false);
            c.flush()?;
            let mut undone = node.undone.lock();
            for t in &p.tokens {
                undone.insert(t.clone(), until);
            }
        }
    }
    let noscript =
        matches!(v, Value::ServerError(e) if e.kind() == Some(redis::ServerErrorKind::NoScript));
    if !p.retried.is_empty() && !noscript {
        // The node answered a retried release (a release the script did
        // not run is sent again, as EVAL below and by the next retry). The
        // queue is updated by the retry job, off the round's path.
        node.answered.lock().push(p.retried);
    }
    if noscript {
        // The round that sent it ended before it could fall back to EVAL:
        // a release is sent again as EVAL (a delete is never lost), and the
        // scripts are loaded so that the next round's EVALSHA runs.
        debug!("node {}: scripts not cached; loading them", node.name);
        if let Some(resend) = &p.resend {
            c.queue(resend, now, false);
        }
        for load in scripts::load_commands() {
            c.queue_setup(&load, now, Setup::Load);
        }
        c.flush()?;
    }
    Ok(())
}

/// The reply to a command sent at connect. `INFO` says who the server is
/// and what kind of node (kept on the connection, for the answers read after
/// it, and for the node); the history id names its database. An error that
/// says the server turned the connection away (`max number of clients
/// reached`, still loading its data) is the node's answer: it refused.
fn setup_reply(c: &mut Conn, node: &NodeShared, setup: Setup, v: &Value) -> std::io::Result<()> {
    if let Value::ServerError(e) = v {
        let text = server_text(e);
        if refuses_connection(e) {
            c.broken = true;
            let detail = format!("it turned the connection away: {text}");
            *node.connect_error.lock() = Some((NodeErrorKind::Unavailable, detail.clone()));
            node.observe(Outcome::Refused);
            return Err(std::io::Error::new(
                std::io::ErrorKind::ConnectionRefused,
                detail,
            ));
        }
        if setup == Setup::Info {
            node.servers.learn_info(node.index, &Err(text));
        }
        return Ok(());
    }
    let text = |v: &Value| match v {
        Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        Value::VerbatimString { text, .. } => Some(text.clone()),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    };
    match setup {
        Setup::Info => {
            let info = info_of(v);
            c.server.run = info.run_id.as_deref().map(|r| id_hash(r.as_bytes()));
            c.server.kind = info.kind();
            node.servers.learn_info(node.index, &Ok(info));
        }
        Setup::History => {
            if let Some(id) = text(v) {
                let h = id_hash(id.as_bytes());
                c.server.history = Some(h);
                node.servers.learn_history(node.index, h);
            }
        }
        Setup::Load | Setup::None => {}
    }
    Ok(())
}

/// Whether this reply is a server turning the connection away (see
/// [`refuses_connection`]): not an answer that makes the node healthy.
fn turned_away(p: &crate::driver::conn::Pending, v: &Value) -> bool {
    p.setup != Setup::None && matches!(v, Value::ServerError(e) if refuses_connection(e))
}

/// Whether a server's error reply to a command sent at connect says it
/// turned this connection away (it closes it next).
fn refuses_connection(e: &redis::ServerError) -> bool {
    e.kind() == Some(redis::ServerErrorKind::BusyLoading)
        || e.details()
            .is_some_and(|d| d.contains("max number of clients reached"))
}

/// A server's error as it wrote it: `ERR max number of clients reached`.
fn server_text(e: &redis::ServerError) -> String {
    match e.details() {
        Some(d) => format!("{} {d}", e.code()),
        None => e.code().to_owned(),
    }
}

/// Whether an acquire or swap reply says some key was set: `1`, or a
/// fenced acquire's counter.
fn acquired_any(v: &Value) -> bool {
    matches!(v, Value::Array(items) if items.iter().skip(FACTS).any(|x| matches!(x, Value::Int(c) if *c > 0)))
}

/// Elements of an acquire or swap reply before its answers: the lock
/// history's epoch, age, longest TTL, key, the longest TTL before that was
/// first used, and the histories it was first used after (a string, last).
const FACTS: usize = 6;

/// A granted lock's `SET` to send a node after the round (see
/// [`RedisTransport::write_later`]).
struct LateWrite {
    resource: String,
    token: String,
    ttl: Duration,
    known_max: Duration,
    /// When the lock's round started: the key's TTL counts from there.
    start: Instant,
    /// When to stop looking for a free connection.
    give_up: Instant,
}

/// Runs on the node's thread: sends `w` on a free connection, or looks
/// again shortly (connects run on this thread too), until `w.give_up`.
fn late_write(weak: &Weak<NodeInner>, threads: &Weak<ScheduledThreadPool>, w: LateWrite) {
    let Some(node) = weak.upgrade() else {
        return;
    };
    let shared = &node.shared;
    let now = Instant::now();
    let left = after(w.start, w.ttl).saturating_duration_since(now);
    let released = shared
        .unsettled
        .lock()
        .get(&w.token)
        .is_none_or(|u| u.released);
    if released || left <= shared.timeout || now >= w.give_up {
        // Released meanwhile, about to expire, or no connection in time:
        // not sent (the renewal, if any, restores the copy).
        shared.unsettled.lock().remove(&w.token);
        return;
    }
    let mut free = node.pool.try_get();
    if let Some(c) = free.as_mut() {
        if !prepare(c, shared, now) {
            free = None;
        }
    }
    match free {
        Some(mut c) => {
            let key = Key::new(&w.resource, &w.token);
            let op = Op::Acquire {
                ttl: left,
                known_max: w.known_max,
                fenced: false,
                after: After::NONE,
            };
            let undo = Encoded::new(
                Op::Release {
                    keep_until: after(w.start, w.ttl),
                },
                &[key],
            )
            .packed;
            c.queue_late(
                &Encoded::new(op, &[key]).packed,
                now,
                undo,
                vec![w.token.clone()],
            );
            if c.flush().is_err() {
                shared.unsettled.lock().remove(&w.token);
            } else {
                debug!(
                    "node {}: a granted lock's SET sent after its round",
                    shared.name
                );
            }
        }
        _ => {
            if let Some(threads) = threads.upgrade() {
                let (weak, pool) = (weak.clone(), Arc::downgrade(&threads));
                threads.execute_after(CONN_RECHECK, move || late_write(&weak, &pool, w));
            }
        }
    }
}

/// A retried release was answered: its entries leave the queue, but for
/// those whose SET may still land here (tokens are one per attempt: they
/// name the entries), which are watched until it is read.
fn retries_answered(node: &NodeShared, tokens: &[String]) {
    let (watched, done): (HashSet<&str>, HashSet<&str>) = {
        let unsettled = node.unsettled.lock();
        tokens
            .iter()
            .map(String::as_str)
            .partition(|t| unsettled.contains_key(*t))
    };
    debug!(
        "node {}: {} retried release(s) answered",
        node.name,
        tokens.len()
    );
    let mut q = node.retries.lock();
    q.watched.retain(|r| !done.contains(r.token.as_str()));
    for r in std::mem::take(&mut q.owed) {
        let t = r.token.as_str();
        if watched.contains(t) {
            q.watched.push_back(r);
        } else if !done.contains(t) {
            q.owed.push_back(r);
        }
    }
}

/// Starts the node's release-retry job unless it is already scheduled.
fn schedule_retry(node: &Arc<NodeInner>, threads: &Arc<ScheduledThreadPool>) {
    if node.shared.retry_scheduled.swap(true, Ordering::AcqRel) {
        return;
    }
    let weak: Weak<NodeInner> = Arc::downgrade(node);
    let pool = Arc::downgrade(threads);
    threads.execute_after(RETRY_EVERY, move || retry_job(&weak, &pool));
}

/// Sends the node's unanswered releases again (one command for up to
/// [`RETRY_BATCH`] keys); drops those answered or expired; reschedules
/// itself while any remain. Stops when the client is gone.
fn retry_job(weak: &Weak<NodeInner>, threads: &Weak<ScheduledThreadPool>) {
    let Some(node) = weak.upgrade() else {
        return;
    };
    let shared = &node.shared;
    let now = Instant::now();
    // Read late replies off the idle connections that owe some (they may
    // say a SET landed, or answer a retried release). The pool is a stack
    // (the last connection given back is the first taken), so those are on
    // top unless rounds took them (which read them). Every pop that leaves
    // fewer than the pool's idle minimum starts a new connection (however
    // many are being made), so no more is popped than leaves that minimum
    // idle, and no more than owe; a round that finds none meanwhile waits (see `wait_busy_pool`).
    let mut owed = false;
    let want = shared.owing.load(Ordering::Acquire);
    if want > 0 {
        shared.draining.store(true, Ordering::Release);
        let mut idle = Vec::new();
        let max = node.pool.max_size();
        let spare = |st: r2d2::State| {
            // At the pool's size no pop starts a connection; one more is
            // left idle for a round of a busy client that comes meanwhile.
            let busy = u32::from(st.connections > st.idle_connections);
            st.connections >= max || st.idle_connections > MIN_IDLE.min(max) + busy
        };
        while idle.len() < want
            && shared.owing.load(Ordering::Acquire) > 0
            && spare(node.pool.state())
        {
            let Some(mut c) = node.pool.try_get() else {
                break;
            };
            prepare(&mut c, shared, now);
            idle.push(c);
        }
        // A release still owed its reply (it may come back NOSCRIPT): look again.
        owed = idle.iter().any(|c| !c.broken && c.owes_release());
        drop(idle);
        shared.draining.store(false, Ordering::Release);
    }
    let answered = std::mem::take(&mut *shared.answered.lock());
    for tokens in &answered {
        retries_answered(shared, tokens);
    }
    shared.unsettled.lock().retain(|_, u| u.until > now);
    shared.undone.lock().retain(|_, until| *until > now);
    // The batch leaves the queue and what is still owed goes back behind
    // the rest: a batch that cannot be settled yet (a SET of its tokens may
    // still land) never holds back the releases queued after it.
    let batch: Vec<Retry> = shared.retries.lock().take(RETRY_BATCH, now);
    if !batch.is_empty() {
        let keys: Vec<Key<'_>> = batch
            .iter()
            .map(|r| Key::new(&r.resource, &r.token))
            .collect();
        let enc = Encoded::new(
            Op::Release {
                keep_until: Instant::now(),
            },
            &keys,
        );
        // Sent, not waited for: its reply is read as a late reply (by the
        // next run, or a round), which takes the batch off the queue. Until
        // then it stays queued, and is sent again if no reply comes. Never
        // waiting keeps this thread free for the pool's connects and the
        // connection in the pool: a connection held for a round trip left
        // the pool below its idle minimum, and every round meanwhile
        // started one more connection.
        if let Some(mut c) = node.pool.try_get() {
            if prepare(&mut c, shared, Instant::now()) {
                let tokens = batch.iter().map(|r| r.token.clone()).collect();
                c.queue_retry(&enc.packed, Instant::now(), enc.fallback(), tokens);
                if c.flush().is_err() {
                    c.broken = true;
                }
            }
        }
        let mut q = shared.retries.lock();
        for r in batch {
            q.push(r, false, &shared.name);
        }
    }
    shared.retry_scheduled.store(false, Ordering::Release);
    let more = owed || !shared.retries.lock().is_empty();
    if more {
        if let Some(threads) = threads.upgrade() {
            schedule_retry(&node, &threads);
        }
    }
}

/// One node's part in a round.
struct Slot {
    admit: Admit,
    conn: Option<PooledConnection<Manager>>,
    /// When our command was queued on `conn` (or on a connection since lost).
    sent: Option<Instant>,
    /// The EVAL fallback was sent after NOSCRIPT.
    fell_back: bool,
    /// When the exchange began: a connection made before then may have been
    /// closed while idle, and one made since is the node's answer.
    began: Instant,
    /// A command was lost with its connection (it may have run).
    lost: bool,
}

impl Transport for RedisTransport {
    fn node_names(&self) -> &[String] {
        &self.names
    }

    fn wait_connected(&self, deadline: Instant) -> Result<usize, InvalidInput> {
        // One connection per node, kept while its setup replies are awaited:
        // popping one again every recheck left the pool below its idle
        // minimum each time, and each such pop started another connection.
        let mut held: Vec<Option<PooledConnection<Manager>>> =
            self.nodes.iter().map(|_| None).collect();
        loop {
            let mut connected = 0;
            let mut pending = false;
            for (i, node) in self.nodes.iter().enumerate() {
                let shared = &node.inner.shared;
                if node.inner.pool.state().connections > 0 {
                    connected += 1;
                    if !self.servers.info_read(i) && shared.is_healthy() {
                        // Read what its connections have been told (who the
                        // server is), without waiting.
                        let now = Instant::now();
                        let c = &mut held[i];
                        if c.is_none() {
                            *c = node.inner.pool.try_get();
                        }
                        if let Some(conn) = c.as_mut() {
                            if !prepare(conn, shared, now) {
                                *c = None;
                            }
                        }
                        pending |= !self.servers.info_read(i);
                    }
                } else if shared.is_healthy() {
                    // Connecting (or not started): a failing node has
                    // answered for itself.
                    pending = true;
                }
            }
            if let Some((a, b)) = self.servers.twins() {
                return Err(InvalidInput::SameServer {
                    first: self.names[a].clone(),
                    second: self.names[b].clone(),
                });
            }
            let now = Instant::now();
            if !pending || now >= deadline {
                return Ok(connected);
            }
            std::thread::sleep(CONN_RECHECK.min(deadline.saturating_duration_since(now)));
        }
    }

    fn probe(&self, key: &str, timeout: Duration) -> Vec<crate::lock::transport::Probe> {
        // A fresh connection per node, all at once, as for `inspect`.
        std::thread::scope(|scope| {
            let jobs: Vec<_> = self
                .nodes
                .iter()
                .map(|node| scope.spawn(move || probe_one(&node.target, key, timeout)))
                .collect();
            jobs.into_iter()
                .map(|job| {
                    job.join()
                        .unwrap_or_else(|_| crate::lock::transport::Probe {
                            connect: Some("the check panicked".into()),
                            ..Default::default()
                        })
                })
                .collect()
        })
    }

    fn inspect(&self, resource: &str, timeout: Duration) -> Vec<Result<Option<Stored>, NodeError>> {
        // A fresh connection per node, all at once: a status query neither
        // waits for a pooled connection nor changes a node's health.
        std::thread::scope(|scope| {
            let jobs: Vec<_> = self
                .nodes
                .iter()
                .zip(&self.names)
                .map(|(node, name)| {
                    scope.spawn(move || {
                        inspect_one(&node.target, resource, timeout)
                            .map_err(|(kind, detail)| NodeError::new(name, kind, detail))
                    })
                })
                .collect();
            jobs.into_iter()
                .zip(&self.names)
                .map(|(job, name)| {
                    job.join().unwrap_or_else(|_| {
                        Err(NodeError::new(
                            name,
                            NodeErrorKind::Protocol,
                            "status query panicked",
                        ))
                    })
                })
                .collect()
        })
    }

    fn run(
        &self,
        op: Op,
        keys: &[Key<'_>],
        deadline: Instant,
        decided: Option<Decided<'_>>,
        undo: Option<Undo<'_>>,
    ) -> Vec<NodeResult> {
        let start = Instant::now();
        let n = self.nodes.len();
        let release = matches!(op, Op::Release { .. });
        let mut admits: Vec<Admit> = self
            .nodes
            .iter()
            .map(|node| node.inner.shared.health.lock().admit(start))
            .collect();
        let twins = self.servers.twin_mask();
        health::admit_round(&mut admits, release, quorum::quorum(n), &twins);
        let mut slots: Vec<Slot> = admits
            .into_iter()
            .map(|admit| Slot {
                admit,
                conn: None,
                sent: None,
                fell_back: false,
                began: start,
                lost: false,
            })
            .collect();
        let enc = Encoded::new(op, keys);
        let results = self.exchange(&enc, keys, &mut slots, start, deadline, decided);

        let after_round = match (undo, op) {
            (Some(undo), Op::Acquire { .. } | Op::Swap { .. }) => undo(&results),
            _ => AfterRound::Done,
        };
        if let (AfterRound::Complete, Op::Acquire { ttl, known_max, .. }) = (after_round, op) {
            for (i, (s, r)) in slots.iter().zip(&results).enumerate() {
                // A healthy node the round waited for but never reached: no
                // connection was free in time (the pool was growing, or all
                // its connections were in use).
                let unreached = s.admit == Admit::Wait
                    && s.sent.is_none()
                    && !s.lost
                    && matches!(r, Err(e) if e.kind() == NodeErrorKind::NoConnection);
                if unreached && self.nodes[i].inner.shared.is_healthy() {
                    for k in keys {
                        // Not a first use (the round recorded it).
                        self.write_later(i, k, ttl, known_max.max(ttl), start);
                    }
                }
            }
        }
        if let (AfterRound::Undo, Op::Acquire { ttl, .. } | Op::Swap { ttl, .. }) =
            (after_round, op)
        {
            {
                let now = Instant::now();
                let rel = Op::Release {
                    keep_until: after(start, ttl),
                };
                for (i, (s, r)) in slots.iter_mut().zip(&results).enumerate() {
                    // Only where our SET left this client, on the same
                    // connection so that the delete lands after it; waiting
                    // only for the nodes that answered the SET.
                    // Reached: our SET is out (or was lost with its connection).
                    let reached = s.sent.is_some() || s.lost;
                    s.admit = match (reached, r) {
                        // A failed swap releases the old lock everywhere.
                        (false, _) if matches!(op, Op::Swap { .. }) => Admit::Trial,
                        (false, _) => Admit::Skip,
                        (true, Ok(_)) => Admit::Wait,
                        (true, Err(_)) if self.nodes[i].inner.shared.is_healthy() => Admit::Wait,
                        (true, Err(_)) => Admit::Trial,
                    };
                    s.sent = None;
                    s.fell_back = false;
                    s.lost = false;
                }
                // A failed swap gives up the handed-over lock too.
                let written = crate::algorithm::round::written(op, keys);
                let keys = &written[..];
                let enc = Encoded::new(rel, keys);
                // A failed swap's caller locks anew within its own bound:
                // its undo is sent, not waited for (a delete not answered
                // is retried in the background).
                let wait = match op {
                    Op::Swap { .. } => Duration::ZERO,
                    _ => self.timeout,
                };
                self.exchange(&enc, keys, &mut slots, now, after(now, wait), None);
            }
        }
        results
    }
}

impl RedisTransport {
    /// Sends `enc` to every admitted node and gathers replies in arrival
    /// order until `decided` or `deadline`. Connections stay in `slots`.
    fn exchange(
        &self,
        enc: &Encoded,
        keys: &[Key<'_>],
        slots: &mut [Slot],
        start: Instant,
        deadline: Instant,
        decided: Option<Decided<'_>>,
    ) -> Vec<NodeResult> {
        let n = slots.len();
        let mut results: Vec<Option<NodeResult>> = vec![None; n];
        if let Op::Release { .. } = enc.op {
            // Before any delete leaves: whoever reads the reply of a SET of
            // these keys from now on deletes the key again after it.
            for node in &self.nodes {
                let mut u = node.inner.shared.unsettled.lock();
                if !u.is_empty() {
                    for k in keys {
                        if let Some(e) = u.get_mut(k.token) {
                            e.released = true;
                        }
                    }
                }
            }
        }
        // Queueing for a busy pool is safe only while this round holds no
        // connection to a later node (rounds then wait in one global order);
        // a round reusing its connections (an undo) never queues.
        let may_queue = slots.iter().all(|s| s.conn.is_none());
        for s in slots.iter_mut() {
            s.began = start;
        }
        // Nodes not waited for count as failed unless their reply arrives.
        for (i, s) in slots.iter_mut().enumerate() {
            if s.admit != Admit::Wait {
                results[i] = Some(Err(self.not_waited(i, s.admit)));
            }
            if s.admit != Admit::Skip {
                self.send(i, s, enc, start, &mut results);
                if s.conn.is_none() && s.admit == Admit::Wait && may_queue {
                    // Every connection to this node is in use by other rounds
                    // of this client: queue for one, in node order, so that
                    // rounds never hold some connections while waiting for
                    // others held by rounds that wait for theirs.
                    s.conn = self.wait_busy_pool(i, deadline);
                    if s.conn.is_some() {
                        self.send(i, s, enc, Instant::now(), &mut results);
                    }
                }
            }
        }

        let mut settle: Option<Instant> = None;
        // A lingering round keeps reading after it settled, as long again.
        let linger = matches!(enc.op, Op::Extend { linger: true, .. });
        let mut ready: Vec<(usize, PollFlags)> = Vec::with_capacity(n);
        loop {
            let now = Instant::now();
            if settle.is_none() && decided.is_some_and(|f| f(&results)) {
                // Settled: what has already arrived is taken below; nothing
                // more is waited for (but for a lingering round's stragglers).
                settle = Some(if linger {
                    now.checked_add(now.saturating_duration_since(start))
                        .map_or(deadline, |l| l.min(deadline))
                } else {
                    now
                });
            }
            // Waited-for nodes still without a connection: look again.
            let mut missing = false;
            for (i, s) in slots.iter_mut().enumerate() {
                if s.admit == Admit::Wait && s.sent.is_none() && results[i].is_none() {
                    if !self.nodes[i].inner.shared.is_healthy() {
                        // Its connect was refused meanwhile: that is its answer.
                        results[i] = Some(Err(self.not_waited(i, Admit::Skip)));
                        continue;
                    }
                    if settle.is_none() {
                        self.send(i, s, enc, now, &mut results);
                    }
                    missing |= s.sent.is_none() && results[i].is_none();
                }
            }
            // Only waited-for nodes keep the round open; a trial's reply is
            // taken if it arrives meanwhile.
            let outstanding = slots.iter().any(|s| {
                s.admit == Admit::Wait && s.conn.as_ref().is_some_and(|c| c.awaits_wanted())
            });
            let until = settle.unwrap_or(deadline);
            if (!outstanding && !missing) || now >= until || (settle.is_some() && !outstanding) {
                break;
            }
            let mut wait = until.saturating_duration_since(now);
            if missing && settle.is_none() {
                wait = wait.min(CONN_RECHECK);
            }
            ready.clear();
            {
                let mut fds = Vec::with_capacity(n);
                let mut idx = Vec::with_capacity(n);
                for (i, s) in slots.iter().enumerate() {
                    if let Some(c) = s.conn.as_ref().filter(|c| c.awaits_wanted()) {
                        fds.push(c.poll_fd(c.wants_write()));
                        idx.push(i);
                    }
                }
                if fds.is_empty() {
                    std::thread::sleep(wait);
                } else if conn::poll(&mut fds, wait).is_err() {
                    std::thread::sleep(wait.min(CONN_RECHECK));
                }
                for (fd, &i) in fds.iter().zip(&idx) {
                    let r = fd.revents();
                    if !r.is_empty() {
                        ready.push((i, r));
                    }
                }
            }
            for &(i, flags) in &ready {
                self.on_ready(i, &mut slots[i], flags, enc, &mut results);
            }
        }

        // Replies that arrived while this thread was not scheduled are
        // taken before anyone is charged a timeout.
        self.collect_arrived(slots, enc, &mut results);
        let now = Instant::now();
        // An acquire reply still owed may yet say "set": keep its undo.
        // (Built only when some reply is still owed.)
        let owed = slots
            .iter()
            .any(|s| s.conn.as_ref().is_some_and(|c| c.awaits_wanted()));
        // The tokens a late acquire or swap may still write, and their keys.
        let written = crate::algorithm::round::written(enc.op, keys);
        // Only a command that may write: a release's late reply says nothing
        // of where a SET landed.
        let tokens: Vec<String> = if owed && enc.writes().is_some() {
            written.iter().map(|k| k.token.to_owned()).collect()
        } else {
            Vec::new()
        };
        let resend = match enc.op {
            Op::Release { .. } if owed => Some(enc.fallback()),
            _ => None,
        };
        let unsettled_until = enc.writes().filter(|_| owed).map(|ttl| after(start, ttl));
        let undo = match (enc.op, unsettled_until) {
            (Op::Acquire { .. } | Op::Swap { .. }, Some(until)) => {
                let rel = Op::Release { keep_until: until };
                Some(Encoded::new(rel, &written).packed)
            }
            _ => None,
        };
        for (i, s) in slots.iter_mut().enumerate() {
            let shared = &self.nodes[i].inner.shared;
            if let Some(c) = s.conn.as_mut() {
                if c.wants_write() {
                    // A half-written command: the connection cannot be reused.
                    c.broken = true;
                }
                if c.awaits_wanted() {
                    c.unwant(undo.as_deref(), &tokens, resend.as_deref());
                    if let Some(until) = unsettled_until {
                        let mut unsettled = shared.unsettled.lock();
                        if unsettled.len() >= MAX_RETRIES {
                            unsettled.retain(|_, u| u.until > now);
                        }
                        for t in &tokens {
                            unsettled.entry(t.clone()).or_insert(Unsettled {
                                until,
                                released: false,
                            });
                        }
                    }
                    if s.sent
                        .is_some_and(|t| now.saturating_duration_since(t) >= shared.timeout)
                    {
                        // No reply within the node timeout: the node's own doing.
                        c.abandon();
                        shared.observe(Outcome::TimedOut);
                    }
                    if results[i].is_none() {
                        let waited = now.saturating_duration_since(s.sent.unwrap_or(start));
                        results[i] = Some(Err(if settle.is_some() {
                            NodeError::new(
                                &self.names[i],
                                NodeErrorKind::NotAwaited,
                                format!("settled {waited:?} after sending, before its reply"),
                            )
                        } else {
                            NodeError::new(
                                &self.names[i],
                                NodeErrorKind::Timeout,
                                format!("no reply in {waited:?}"),
                            )
                        }));
                    }
                }
            }
            if results[i].is_none() {
                results[i] = Some(Err(if s.lost {
                    // Not `NoConnection`: the command may have run.
                    NodeError::new(
                        &self.names[i],
                        NodeErrorKind::Io,
                        "connection closed before the reply; not sent again before the round ended",
                    )
                } else if shared.is_healthy() {
                    let pool = &self.nodes[i].inner.pool;
                    let detail = if pool.state().connections >= pool.max_size() {
                        format!(
                            "all {} pooled connections busy until the round ended (this client's condition: raise pool_size)",
                            pool.max_size()
                        )
                    } else {
                        "still connecting when the round ended".to_owned()
                    };
                    NodeError::new(&self.names[i], NodeErrorKind::NoConnection, detail)
                } else {
                    self.not_waited(i, Admit::Skip)
                }));
            }
        }

        // Releases a node did not answer are kept and sent again later.
        if let Op::Release { keep_until } = enc.op {
            for (i, r) in results.iter().enumerate() {
                // Skip here means "our SET never reached it": nothing to undo.
                // A delete still in flight is kept too: its connection may be
                // closed before the node reads it (a kill discards the
                // unread commands), and deleting twice is harmless.
                // An entry that answered for a server another entry holds,
                // or a node that cannot keep locks, answered: not retried.
                let answered_anyway = matches!(r, Some(Err(e)) if matches!(
                    e.kind(),
                    NodeErrorKind::SameServer | NodeErrorKind::Unsuitable
                ));
                let unanswered =
                    matches!(r, Some(Err(_))) && slots[i].admit != Admit::Skip && !answered_anyway;
                // A SET of ours still unsettled there may land after this
                // delete: keep deleting until its reply has been read.
                let unsettled = {
                    let u = self.nodes[i].inner.shared.unsettled.lock();
                    !u.is_empty() && keys.iter().any(|k| u.contains_key(k.token))
                };
                if unanswered || unsettled {
                    self.enqueue_retries(i, keys, keep_until);
                }
            }
        }
        results
            .into_iter()
            .zip(&self.names)
            .map(|(r, name)| {
                r.unwrap_or_else(|| Err(NodeError::new(name, NodeErrorKind::Unavailable, "")))
            })
            .collect()
    }

    /// One non-blocking pass over the connections still owing a reply.
    fn collect_arrived(
        &self,
        slots: &mut [Slot],
        enc: &Encoded,
        results: &mut [Option<NodeResult>],
    ) {
        let mut ready = Vec::new();
        {
            let mut fds = Vec::new();
            let mut idx = Vec::new();
            for (i, s) in slots.iter().enumerate() {
                if let Some(c) = s.conn.as_ref().filter(|c| c.awaits_wanted()) {
                    fds.push(c.poll_fd(false));
                    idx.push(i);
                }
            }
            if fds.is_empty() || conn::poll(&mut fds, Duration::ZERO).is_err() {
                return;
            }
            for (fd, &i) in fds.iter().zip(&idx) {
                let r = fd.revents();
                if !r.is_empty() {
                    ready.push((i, r));
                }
            }
        }
        for (i, flags) in ready {
            self.on_ready(i, &mut slots[i], flags, enc, results);
        }
    }

    fn not_waited(&self, i: usize, admit: Admit) -> NodeError {
        let shared = &self.nodes[i].inner.shared;
        let h = *shared.health.lock();
        let connect_error = match h {
            NodeHealth::Failing { .. } => shared.connect_error.lock().clone(),
            NodeHealth::Healthy => None,
        };
        let tried = if admit == Admit::Trial {
            "tried, not waited for"
        } else {
            "not waited for"
        };
        let detail = match (h, &connect_error) {
            (NodeHealth::Failing { since, .. }, Some((_, e))) => format!(
                "{e}, for {:?}; {tried}",
                Instant::now().saturating_duration_since(since),
            ),
            (NodeHealth::Failing { since, last, .. }, None) => format!(
                "{} for {:?}; {tried}",
                match last {
                    Outcome::Refused => "refusing connections",
                    _ => "not answering",
                },
                Instant::now().saturating_duration_since(since),
            ),
            (NodeHealth::Healthy, _) => "not waited for".to_owned(),
        };
        let kind = match (h, connect_error) {
            (_, Some((kind @ (NodeErrorKind::Tls | NodeErrorKind::Server), _))) => kind,
            (
                NodeHealth::Failing {
                    last: Outcome::Refused,
                    ..
                },
                _,
            ) => NodeErrorKind::Unavailable,
            _ => NodeErrorKind::Skipped,
        };
        NodeError::new(&self.names[i], kind, detail)
    }

    /// Checks out a connection for node `i` if none is at hand and queues the
    /// round's command on it.
    fn send(
        &self,
        i: usize,
        s: &mut Slot,
        enc: &Encoded,
        now: Instant,
        results: &mut [Option<NodeResult>],
    ) {
        if s.conn.as_ref().is_some_and(|c| c.broken) {
            s.conn = None;
        }
        if s.conn.is_none() {
            s.conn = self.checkout(i, now);
        }
        let Some(c) = s.conn.as_mut() else {
            return;
        };
        let sent = Instant::now();
        c.queue(&enc.packed, sent, true);
        s.sent = Some(sent);
        if let Err(e) = c.flush() {
            self.failed(i, s, e, enc, results);
        }
    }

    /// A connection to a healthy node whose every connection is checked
    /// out, or whose idle ones the retry job holds for a moment: waits
    /// (until `deadline`) for one to come back. None when the node is not in
    /// that state (it is connecting, or failing).
    fn wait_busy_pool(&self, i: usize, deadline: Instant) -> Option<PooledConnection<Manager>> {
        let node = &self.nodes[i].inner;
        if !node.shared.is_healthy() {
            return None;
        }
        if node.shared.draining.load(Ordering::Acquire) {
            // The retry job gives them back as soon as it has read them.
        } else if let Some(mut c) = node.pool.try_get() {
            // Given back (by the retry job) since this round looked.
            return prepare(&mut c, &node.shared, Instant::now()).then_some(c);
        } else if node.pool.state().connections < node.pool.max_size() {
            return None;
        }
        let wait = deadline.saturating_duration_since(Instant::now());
        let mut c = node.pool.get_timeout(wait).ok()?;
        prepare(&mut c, &node.shared, Instant::now()).then_some(c)
    }

    fn failed(
        &self,
        i: usize,
        s: &mut Slot,
        e: std::io::Error,
        enc: &Encoded,
        results: &mut [Option<NodeResult>],
    ) {
        let shared = &self.nodes[i].inner.shared;
        let made = s.conn.as_ref().map(|c| c.made);
        // Our command went out and its reply never will come: it may have
        // run, or (through a proxy) may still run.
        let lost = s.conn.as_ref().is_some_and(|c| c.awaits_wanted());
        if let Some(c) = s.conn.as_mut() {
            c.broken = true;
            c.unwant(None, &[], None);
        }
        s.conn = None;
        s.lost |= lost;
        if let (true, Some(ttl)) = (lost, enc.writes()) {
            // Its SET counts as reached for the attempt's undo, and its
            // token stays unsettled until its TTL ends: a release of it is
            // sent again until then, in case a proxy passes the lost SET on
            // after the delete.
            let until = after(s.began, ttl);
            let mut unsettled = shared.unsettled.lock();
            if unsettled.len() >= MAX_RETRIES {
                let now = Instant::now();
                unsettled.retain(|_, u| u.until > now);
            }
            for t in &enc.written {
                unsettled.entry(t.clone()).or_insert(Unsettled {
                    until,
                    released: false,
                });
            }
        }
        if conn::is_close(&e) && s.admit == Admit::Wait && made.is_some_and(|t| t < s.began) {
            // A connection older than the round, closed before the node
            // answered our command: most likely by a close already on its
            // way when the command left (a kill, an idle timeout), so not the
            // node's answer. The round sends again on another connection; a
            // node that is down refuses that connect, and a close of a
            // connection made during the round is the node's answer. (Older
            // connections are at most the pool's size.) The same token makes
            // the repeat safe: a SET or swap that did land answers as done,
            // and an extension or fencing write-back is idempotent. A
            // release's repeat that does not find the key ours cannot tell
            // whether the first delete ran (see `on_ready`).
            s.sent = None;
            s.fell_back = false;
            debug!(
                "node {}: connection closed before the reply ({e}); sending again",
                self.names[i]
            );
            return;
        }
        let kind = match e.kind() {
            std::io::ErrorKind::InvalidData => {
                shared.observe(Outcome::Answered);
                NodeErrorKind::Protocol
            }
            // The server turned the connection away (its answer, already
            // observed): say so, in its words.
            std::io::ErrorKind::ConnectionRefused => NodeErrorKind::Unavailable,
            _ => {
                shared.observe(Outcome::Refused);
                NodeErrorKind::Io
            }
        };
        results[i] = Some(Err(NodeError::new(&self.names[i], kind, e.to_string())));
    }

    #[allow(clippy::too_many_arguments)]
    fn on_ready(
        &self,
        i: usize,
        s: &mut Slot,
        flags: PollFlags,
        enc: &Encoded,
        results: &mut [Option<NodeResult>],
    ) {
        let Some(c) = s.conn.as_mut() else {
            return;
        };
        // What arrived before a close is read first: a reply, or the
        // server's reason for closing (`max number of clients reached`).
        let mut io = c.on_ready(flags).err();
        let shared = &self.nodes[i].inner.shared;
        loop {
            let Some(c) = s.conn.as_mut() else {
                return;
            };
            let (p, v) = match c.next_reply() {
                Ok(Some(r)) => r,
                Ok(None) => match io.take() {
                    Some(e) => return self.failed(i, s, e, enc, results),
                    None => return,
                },
                Err(e) => return self.failed(i, s, e, enc, results),
            };
            let now = Instant::now();
            if !turned_away(&p, &v) {
                shared.replied();
            }
            if !p.wanted {
                if let Err(e) = late_reply(c, shared, p, &v, now) {
                    return self.failed(i, s, e, enc, results);
                }
                continue;
            }
            if let (Value::ServerError(e), false) = (&v, s.fell_back) {
                if e.kind() == Some(redis::ServerErrorKind::NoScript) {
                    debug!("node {}: script not cached, sending EVAL", self.names[i]);
                    s.fell_back = true;
                    c.queue(&enc.fallback(), now, true);
                    if let Err(e) = c.flush() {
                        return self.failed(i, s, e, enc, results);
                    }
                    continue;
                }
            }
            let server = c.server;
            let mut r = enc.decode(v);
            if let Ok(reply) = &mut r {
                // Who answered: the connection's server (its history's id as
                // the node last reported it, if this connection has none).
                let history = server.history.or_else(|| shared.servers.history(i));
                reply.server = Some(ServerTag { history, ..server });
            }
            if let (Ok(reply), Op::Release { .. }) = (&mut r, enc.op) {
                // "Absent" behind our own undo of a late SET: deleted by us.
                let mut undone = shared.undone.lock();
                if !undone.is_empty() {
                    for (a, t) in reply.answers.iter_mut().zip(&enc.tokens) {
                        if *a == Answer::Absent && undone.remove(t).is_some() {
                            *a = Answer::Ok;
                        }
                    }
                }
            }
            if let (true, Op::Release { .. }, Ok(reply)) = (s.lost, enc.op, &r) {
                // The first delete, lost with its connection, may have run:
                // "absent" or another owner now says nothing (the key may
                // also have expired, or never reached this node).
                if reply.answers.iter().any(|a| *a != Answer::Ok) {
                    r = Err((
                        NodeErrorKind::Io,
                        "connection closed before the reply; sent again, the key was no longer ours: the first delete may have run".to_owned(),
                    ));
                }
            }
            let r = r.map_err(|(kind, detail)| NodeError::new(&self.names[i], kind, detail));
            quorum::insert_vote(results, &self.names, i, r, self.rules);
        }
    }
}

/// A round's commands, packed once for all nodes.
struct Encoded {
    op: Op,
    n: usize,
    /// A release's tokens, in key order.
    tokens: Vec<String>,
    /// The tokens an acquire or swap writes.
    written: Vec<String>,
    packed: Vec<u8>,
    /// The script's source, for a node that answers NOSCRIPT.
    code: &'static str,
}

impl Encoded {
    fn new(op: Op, keys: &[Key<'_>]) -> Self {
        let (script, code, args): (&redis::Script, &str, Vec<u64>) = match op {
            Op::Acquire {
                ttl,
                known_max,
                fenced,
                ..
            } => (
                &scripts::ACQUIRE,
                scripts::ACQUIRE_LUA,
                vec![millis_ceil(ttl), millis_ceil(known_max), u64::from(fenced)],
            ),
            Op::Swap {
                ttl,
                known_max,
                fence,
            } => (
                &scripts::SWAP,
                scripts::SWAP_LUA,
                vec![millis_ceil(ttl), millis_ceil(known_max), fence.unwrap_or(0)],
            ),
            Op::Release { .. } => (&scripts::RELEASE, scripts::RELEASE_LUA, vec![0]),
            Op::Extend { ttl, known_max, .. } => (
                &scripts::EXTEND,
                scripts::EXTEND_LUA,
                vec![millis_ceil(ttl), millis_ceil(known_max)],
            ),
            Op::Restore { ttl } => (
                &scripts::RESTORE,
                scripts::RESTORE_LUA,
                vec![millis_ceil(ttl)],
            ),
            Op::Fence { value } => (&scripts::FENCE, scripts::FENCE_LUA, vec![value]),
        };
        let begun = match op {
            Op::Acquire { after, .. } | Op::Extend { after, .. } if !after.is_empty() => {
                Some(after)
            }
            _ => None,
        };
        // All but release and restore also take the node's lock-history key.
        let meta = !matches!(op, Op::Release { .. } | Op::Restore { .. });
        let swap = matches!(op, Op::Swap { .. });
        // A swap names one key, its new token, then the tokens it may hold.
        let named = if swap {
            &keys[..keys.len().min(1)]
        } else {
            keys
        };
        let pack = |verb: &str, body: &str| {
            let mut cmd = redis::cmd(verb);
            cmd.arg(body).arg(named.len() + usize::from(meta));
            for k in named {
                cmd.arg(k.resource);
            }
            if meta {
                cmd.arg(scripts::META_KEY);
            }
            for (j, a) in args.iter().enumerate() {
                match begun {
                    // A first use: the longest TTL known, and the histories
                    // it comes after (see `raise_lua!`).
                    Some(b) if j == 1 => cmd.arg(format!("{a};{}", b.to_text())),
                    _ => cmd.arg(*a),
                };
            }
            if swap {
                cmd.arg(keys.first().and_then(|k| k.next).unwrap_or_default());
            }
            for k in keys {
                cmd.arg(k.token);
            }
            cmd.get_packed_command()
        };
        let tokens = match op {
            Op::Release { .. } => keys.iter().map(|k| k.token.to_owned()).collect(),
            _ => Vec::new(),
        };
        let written = match op {
            Op::Acquire { .. } | Op::Swap { .. } | Op::Restore { .. } => {
                crate::algorithm::round::written(op, keys)
                    .iter()
                    .map(|k| k.token.to_owned())
                    .collect()
            }
            Op::Release { .. } | Op::Fence { .. } | Op::Extend { .. } => Vec::new(),
        };
        Encoded {
            op,
            n: named.len(),
            tokens,
            written,
            packed: pack("EVALSHA", script.get_hash()),
            code,
        }
    }

    /// For a command that may write a key of ours (an acquire, a swap, a
    /// restore): how long after it was sent the key may live.
    fn writes(&self) -> Option<Duration> {
        match self.op {
            Op::Acquire { ttl, .. } | Op::Swap { ttl, .. } | Op::Restore { ttl } => Some(ttl),
            Op::Release { .. } | Op::Fence { .. } | Op::Extend { .. } => None,
        }
    }

    /// The same command as `EVAL` with the script's source (built only for
    /// a node that answered NOSCRIPT): `packed` with its `EVALSHA <sha1>`
    /// elements replaced.
    fn fallback(&self) -> Vec<u8> {
        // `*N\r\n` then `$7\r\nEVALSHA\r\n` then `$40\r\n<sha1>\r\n`.
        let head = self
            .packed
            .windows(2)
            .position(|w| w == b"\r\n")
            .map_or(0, |p| p + 2);
        let rest = self.packed.get(head + 13 + 47..).unwrap_or_default();
        let mut out = Vec::with_capacity(self.packed.len() + self.code.len());
        out.extend_from_slice(&self.packed[..head]);
        out.extend_from_slice(b"$4\r\nEVAL\r\n");
        out.extend_from_slice(format!("${}\r\n", self.code.len()).as_bytes());
        out.extend_from_slice(self.code.as_bytes());
        out.extend_from_slice(b"\r\n");
        out.extend_from_slice(rest);
        out
    }

    fn decode(&self, v: Value) -> Result<Reply, (NodeErrorKind, String)> {
        let items = match v {
            Value::Array(items) => items,
            v => return Err(unexpected(v)),
        };
        let int = |v: &Value| match v {
            Value::Int(x) => Some(*x),
            _ => None,
        };
        let (facts, rest) = match self.op {
            Op::Acquire { .. } | Op::Swap { .. } => {
                if items.len() != self.n + FACTS {
                    return Err(unexpected(Value::Array(items)));
                }
                let f: Vec<i64> = items[..FACTS - 1].iter().filter_map(int).collect();
                let [epoch, age, max, key, prev] = f[..] else {
                    return Err(unexpected(Value::Array(items)));
                };
                let after = match &items[FACTS - 1] {
                    Value::BulkString(b) => After::parse(b),
                    Value::SimpleString(t) => After::parse(t.as_bytes()),
                    _ => return Err(unexpected(Value::Array(items))),
                };
                let ms = |v: i64| Duration::from_millis(u64::try_from(v).unwrap_or(0));
                let facts = NodeFacts {
                    epoch: u64::try_from(epoch).unwrap_or(0),
                    age: ms(age),
                    max_ttl: ms(max),
                    history: u64::try_from(key).unwrap_or(0),
                    after,
                    prev_max: ms(prev),
                };
                (Some(facts), &items[FACTS..])
            }
            _ => {
                if items.len() != self.n {
                    return Err(unexpected(Value::Array(items)));
                }
                (None, &items[..])
            }
        };
        // An acquire's 0 is "exists"; everyone else's "absent". A fenced
        // acquire answers a set key with its counter.
        let acquire = matches!(self.op, Op::Acquire { .. });
        let fenced = matches!(self.op, Op::Acquire { fenced: true, .. });
        let restore = matches!(self.op, Op::Restore { .. });
        let mut fence = None;
        let answers = rest
            .iter()
            .map(|v| match (int(v), acquire) {
                (Some(2), false) if restore => Ok(Answer::Restored),
                (Some(1), _) if !fenced => Ok(Answer::Ok),
                (Some(c), true) if fenced && c > 0 && c.unsigned_abs() <= scripts::FENCE_LIMIT => {
                    fence = fence.max(u64::try_from(c).ok());
                    Ok(Answer::Ok)
                }
                (Some(0), true) => Ok(Answer::Other),
                (Some(0), false) => Ok(Answer::Absent),
                (Some(-1), false) => Ok(Answer::Other),
                _ => Err(unexpected(v.clone())),
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Reply {
            answers,
            facts,
            fence,
            server: None,
        })
    }
}

fn unexpected(v: Value) -> (NodeErrorKind, String) {
    match v {
        Value::ServerError(e) => (NodeErrorKind::Server, e.to_string()),
        v => (NodeErrorKind::Protocol, format!("{v:?}")),
    }
}

/// Whole milliseconds, rounded up (the server keeps the key at least as long
/// as we assume), at least 1.
pub(crate) fn millis_ceil(d: Duration) -> u64 {
    let ms = d.as_nanos().div_ceil(1_000_000).max(1);
    u64::try_from(ms).unwrap_or(u64::MAX)
}

/// Our r2d2 connection manager: connect with a timeout, non-blocking
/// socket, TCP_NODELAY, AUTH and SELECT when configured. A refused or
/// timed-out connect is the node's answer; a successful one changes nothing.
pub(crate) struct Manager {
    target: Target,
    shared: Arc<NodeShared>,
}

impl fmt::Debug for Manager {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Manager")
            .field("node", &self.shared.name)
            .finish()
    }
}

impl ManageConnection for Manager {
    type Connection = Conn;
    type Error = ConnectError;

    fn connect(&self) -> Result<Conn, ConnectError> {
        let mut result = Conn::connect(&self.target, self.shared.timeout);
        if let Err(ConnectError::Io(e)) = &result {
            if conn::is_close(e) {
                // Closed before the node answered: a proxy in front of a dead
                // node, or a kill (`CLIENT KILL`, a restart) that met this
                // connect. One more try tells them apart.
                debug!(
                    "node {}: connection closed while connecting ({e}), trying again",
                    self.shared.name
                );
                result = Conn::connect(&self.target, self.shared.timeout);
            }
        }
        // Kept until the node answers again (a connect that succeeds may
        // still be turned away by the server, see `setup_reply`).
        if let Err(e) = &result {
            *self.shared.connect_error.lock() = Some((e.kind(), e.detail()));
        }
        result.inspect_err(|e| {
            self.shared.observe(match e {
                ConnectError::Io(e) if e.kind() == std::io::ErrorKind::TimedOut => {
                    Outcome::TimedOut
                }
                _ => Outcome::Refused,
            })
        })
    }

    fn is_valid(&self, _conn: &mut Conn) -> Result<(), ConnectError> {
        // Not called (test_on_check_out is off): the command itself is the
        // health check.
        Ok(())
    }

    fn has_broken(&self, conn: &mut Conn) -> bool {
        // Called by the pool as the connection comes back (the last word on
        // it before it idles): one owing replies is counted for the retry
        // job, once.
        // (A broken one is dropped, which uncounts it.)
        if !conn.broken && conn.owing.is_none() && !conn.pending().is_empty() {
            self.shared.owing.fetch_add(1, Ordering::AcqRel);
            conn.owing = Some(self.shared.owing.clone());
        }
        conn.broken
    }
}

/// Logs background connect failures: every one at debug, at most one per
/// [`WARN_EVERY`] per node at warn, so a dead node does not flood the log.
#[derive(Debug)]
struct ConnectErrors {
    node: String,
    warned: Throttle,
}

impl r2d2::HandleError<ConnectError> for ConnectErrors {
    fn handle_error(&self, error: ConnectError) {
        if self.warned.ready(Instant::now(), WARN_EVERY) {
            warn!(
                "node {}: cannot connect: {error} (repeats logged at debug for {WARN_EVERY:?})",
                self.node
            );
        } else {
            debug!("node {}: cannot connect: {error}", self.node);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn retry(token: &str, until: Instant) -> Retry {
        Retry {
            resource: "r".into(),
            token: token.into(),
            until,
        }
    }

    /// Releases the node never answered go first, and are the last to be
    /// dropped from a full queue: a storm of watched releases (answered,
    /// their SET still unsettled) left thousands of keys for their TTL.
    #[test]
    fn owed_releases_go_first_and_outlive_watched_ones() {
        let now = Instant::now();
        let later = now + Duration::from_secs(30);
        let mut q = Retries::default();
        for i in 0..MAX_RETRIES {
            q.push(retry(&format!("w{i}"), later), true, "n");
        }
        q.push(retry("gone", now), false, "n");
        for i in 0..10 {
            q.push(retry(&format!("o{i}"), later), false, "n");
        }
        assert_eq!(q.owed.len() + q.watched.len(), MAX_RETRIES);
        assert_eq!(q.owed.len(), 11, "a full queue dropped watched ones");
        assert_eq!(q.watched.front().map(|r| r.token.as_str()), Some("w11"));
        let batch = q.take(5, now);
        let tokens: Vec<&str> = batch.iter().map(|r| r.token.as_str()).collect();
        assert_eq!(
            tokens,
            ["o0", "o1", "o2", "o3", "o4"],
            "expired dropped, owed first"
        );
        let batch = q.take(8, now);
        assert_eq!(batch.len(), 8);
        assert_eq!(batch[4].token, "o9");
        assert_eq!(batch[5].token, "w11", "then the oldest watched");
        for i in 0..(MAX_RETRIES + 5) {
            q.push(retry(&format!("x{i}"), later), false, "n");
        }
        assert!(q.watched.is_empty(), "watched ones go before owed ones");
        assert_eq!(q.owed.len(), MAX_RETRIES);
    }

    /// What the connections learn of the servers is logged once per node (a
    /// node reconnects often: one warning, not one per connection), and two
    /// entries with one id are a pair, found by either id.
    #[test]
    fn servers_are_named_once_and_twins_found_by_either_id() {
        let logs = crate::testing::fake::logs::capture_logs();
        let names: Vec<String> = ["a:1", "b:1", "c:1"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let servers = Servers::new(names);
        let evicting = ServerInfo::parse(
            "run_id:r0\nrole:master\nmaxmemory:1048576\nmaxmemory_policy:allkeys-lru\n",
        );
        for _ in 0..3 {
            servers.learn_info(0, &Ok(evicting.clone()));
        }
        servers.learn_info(1, &Err("NOPERM".into()));
        let warned: Vec<String> = logs
            .take()
            .into_iter()
            .filter(|(l, _)| *l <= log::Level::Info)
            .map(|(_, m)| m)
            .collect();
        assert_eq!(warned.len(), 2, "{warned:?}");
        assert!(warned[0].contains("allkeys-lru"), "{warned:?}");
        assert!(warned[1].contains("+info"), "{warned:?}");
        assert!(servers.twins().is_none());
        assert!(
            servers.twin_mask().is_empty(),
            "no allocation without twins"
        );
        // Entry 1 (no INFO) shares entry 2's lock history; entry 2 has a run id.
        servers.learn_history(1, 7);
        servers.learn_info(2, &Ok(ServerInfo::parse("run_id:r2\nrole:master\n")));
        servers.learn_history(2, 7);
        assert_eq!(servers.twins(), Some((1, 2)));
        assert_eq!(servers.twin_mask(), [false, false, true]);
        let pair = logs.take();
        assert_eq!(
            pair.iter()
                .filter(|(l, m)| *l == log::Level::Warn && m.contains("one server"))
                .count(),
            1,
            "{pair:?}"
        );
    }

    #[test]
    fn fallback_is_the_same_command_as_eval() {
        let keys = [Key::new("a", "t1"), Key::new("b", "t2")];
        let ops = [
            Op::Acquire {
                ttl: Duration::from_millis(1500),
                known_max: Duration::from_secs(3),
                fenced: true,
                after: {
                    let mut a = After::NONE;
                    a.insert(123_456_789);
                    a.insert(42);
                    a
                },
            },
            Op::Swap {
                ttl: Duration::from_millis(1500),
                known_max: Duration::from_secs(3),
                fence: Some(1 << 52),
            },
            Op::Fence { value: 1 << 52 },
            Op::Extend {
                ttl: Duration::from_millis(1500),
                linger: false,
                known_max: Duration::from_secs(3),
                after: After::NONE,
            },
            Op::Release {
                keep_until: Instant::now(),
            },
        ];
        for op in ops {
            let e = Encoded::new(op, &keys);
            let text = String::from_utf8_lossy(&e.packed).into_owned();
            let want = text.replacen("$7\r\nEVALSHA", "$4\r\nEVAL", 1).replacen(
                &format!("$40\r\n{}", sha_of(&text)),
                &format!("${}\r\n{}", e.code.len(), e.code),
                1,
            );
            assert_eq!(String::from_utf8_lossy(&e.fallback()), want, "{op:?}");
        }
    }

    fn sha_of(packed: &str) -> String {
        packed.split("\r\n").nth(4).unwrap_or_default().to_owned()
    }

    /// A fenced acquire answers a set key with its counter, not 1: a late
    /// reply must still be seen as "set" (so that a lock released
    /// meanwhile is deleted again behind it).
    #[test]
    fn a_late_fenced_set_is_seen_as_set() {
        // The history's six facts (positive ones), then the answer.
        let reply = |r: i64| Value::Array([1, 2, 3, 3, 1, 9, r].map(Value::Int).to_vec());
        assert!(acquired_any(&reply(1)));
        assert!(acquired_any(&reply(1_796_000_000_000_000)));
        assert!(!acquired_any(&reply(0)), "exists");
        assert!(!acquired_any(&reply(-1)), "another owner (swap)");
    }

    #[test]
    fn millis_round_up_and_never_zero() {
        assert_eq!(millis_ceil(Duration::from_micros(1)), 1);
        assert_eq!(millis_ceil(Duration::from_micros(1500)), 2);
        assert_eq!(millis_ceil(Duration::from_millis(30_000)), 30_000);
        assert_eq!(millis_ceil(Duration::ZERO), 1);
        assert!(millis_ceil(Duration::MAX) > 0);
    }
}
