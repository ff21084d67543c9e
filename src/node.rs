//! The Redis driver: one r2d2 pool per node and scatter/gather I/O on the
//! pooled sockets.
//!
//! A round writes the same packed command to every node first and only then
//! reads the replies, so it costs about one round trip to the slowest node,
//! not the sum, without a thread per node. Every read is bounded by the
//! round's deadline; a connection that saw any error is marked broken and
//! never returns to the pool.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use log::{debug, info, warn};
use parking_lot::Mutex;
use r2d2::{ManageConnection, Pool, PooledConnection};
use redis::{ConnectionInfo, ConnectionLike, RedisError, Value};
use scheduled_thread_pool::ScheduledThreadPool;

use crate::clock::{after, Throttle, WARN_EVERY};
use crate::error::{NodeError, NodeErrorKind};
use crate::health::{Admit, Breaker, RestartWatch, LATE_LIMIT};
use crate::scripts;
use crate::transport::{Answer, Decided, Key, NodeResult, Op, Transport};

/// The smallest socket timeout we set (`Some(ZERO)` is an error for std).
const MIN_TIMEOUT: Duration = Duration::from_millis(1);

/// A parsed node address.
#[derive(Debug, Clone)]
pub(crate) struct NodeSpec {
    /// `host:port`, with `/db` when not 0. No credentials.
    pub name: String,
    pub info: ConnectionInfo,
}

/// Settings the driver needs beyond addresses.
#[derive(Debug, Clone)]
pub(crate) struct DriverConfig {
    pub timeout: Duration,
    pub pool_size: u32,
    /// Apply the delayed-restart rule (read `INFO server` on each new
    /// connection).
    pub restart_protection: bool,
    /// The operator's maximum TTL, if configured.
    pub max_ttl: Option<Duration>,
}

/// What the pools' background threads and the rounds share about the nodes.
#[derive(Debug)]
struct Shared {
    config: DriverConfig,
    /// Longest TTL sent so far, in milliseconds.
    tracked_ttl_ms: AtomicU64,
}

/// One node: its pool and what we know of its health.
struct Node {
    pool: Pool<Manager>,
    health: Arc<Health>,
}

/// A node's breaker, restart watch and reply latency.
#[derive(Debug)]
struct Health {
    name: String,
    breaker: Mutex<Breaker>,
    restart: Mutex<RestartWatch>,
    /// Moving average of reply latency (ns): the order replies are read in.
    latency_ns: AtomicU64,
    /// Rate limit of the warning that INFO is not permitted.
    info_refused: Throttle,
}

impl Health {
    fn failure(&self, now: Instant, why: &str) {
        let window = self.breaker.lock().failure(now);
        debug!("node {}: {why}; skipped for {window:?}", self.name);
    }

    /// Folds one reply time (or time waited in vain) into the average that
    /// orders reads: nodes that answer fast are read first.
    fn sample_latency(&self, latency: Duration) {
        let sample = u64::try_from(latency.as_nanos()).unwrap_or(u64::MAX);
        let old = self.latency_ns.load(Ordering::Relaxed);
        let avg = if old == 0 {
            sample
        } else {
            old - old / 8 + sample / 8
        };
        self.latency_ns.store(avg, Ordering::Relaxed);
    }

    fn success(&self, latency: Duration) {
        self.sample_latency(latency);
        if self.breaker.lock().success() {
            info!("node {}: answering again, back in use", self.name);
        }
    }
}

/// The production [`Transport`].
pub(crate) struct RedisTransport {
    names: Vec<String>,
    nodes: Vec<Node>,
    shared: Arc<Shared>,
    threads: Arc<ScheduledThreadPool>,
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
    pub(crate) fn new(specs: Vec<NodeSpec>, mut config: DriverConfig) -> Self {
        config.timeout = config.timeout.max(MIN_TIMEOUT);
        let shared = Arc::new(Shared {
            config,
            tracked_ttl_ms: AtomicU64::new(0),
        });
        // One small set of connector threads for all of this client's pools:
        // safe because every connect is bounded by the timeout.
        let threads = Arc::new(
            ScheduledThreadPool::builder()
                .num_threads(2)
                .thread_name_pattern("quorumlock-connect-{}")
                .build(),
        );
        let mut names = Vec::with_capacity(specs.len());
        let mut nodes = Vec::with_capacity(specs.len());
        for spec in specs {
            let health = Arc::new(Health {
                name: spec.name.clone(),
                breaker: Mutex::new(Breaker::default()),
                restart: Mutex::new(RestartWatch::default()),
                latency_ns: AtomicU64::new(0),
                info_refused: Throttle::default(),
            });
            let manager = Manager {
                client: spec.info,
                shared: shared.clone(),
                health: health.clone(),
            };
            let pool = Pool::builder()
                .max_size(shared.config.pool_size)
                .min_idle(None)
                .test_on_check_out(false)
                // Background reconnects back off up to half of this: a node
                // that comes back is used again within about a second.
                .connection_timeout(Duration::from_secs(2))
                .error_handler(Box::new(ConnectErrors {
                    node: spec.name.clone(),
                    warned: Throttle::default(),
                }))
                .thread_pool(threads.clone())
                .build_unchecked(manager);
            names.push(spec.name);
            nodes.push(Node { pool, health });
        }
        RedisTransport {
            names,
            nodes,
            shared,
            threads,
        }
    }

    /// Whether node `i` takes part in this round; an error (counted as a
    /// failed vote, at no cost) when its breaker is open or it restarted
    /// too recently for its votes to count.
    fn admit(&self, i: usize, now: Instant) -> Result<(), NodeError> {
        let node = &self.nodes[i];
        if let Some(until) = node.health.restart.lock().held(now) {
            return Err(NodeError::new(
                &self.names[i],
                NodeErrorKind::Restarted,
                format!(
                    "votes count again in {:?}",
                    until.saturating_duration_since(now)
                ),
            ));
        }
        let admit = node.health.breaker.lock().admit(now);
        match admit {
            Admit::Send => Ok(()),
            Admit::Skip { until } => Err(NodeError::new(
                &self.names[i],
                NodeErrorKind::Skipped,
                format!(
                    "failing; retried in {:?}",
                    until.saturating_duration_since(now)
                ),
            )),
            Admit::Probe => {
                let (pool, health) = (node.pool.clone(), node.health.clone());
                let timeout = self.shared.config.timeout;
                self.threads.execute(move || probe(&pool, &health, timeout));
                Err(NodeError::new(
                    &self.names[i],
                    NodeErrorKind::Skipped,
                    "probing",
                ))
            }
        }
    }
}

/// One request to a node whose breaker is open: it rejoins on an answer.
fn probe(pool: &Pool<Manager>, health: &Health, timeout: Duration) {
    let started = Instant::now();
    let answered = match pool.get_timeout(timeout) {
        Ok(mut conn) => {
            let ok = conn.inner.set_read_timeout(Some(timeout)).is_ok()
                && redis::cmd("PING").query::<String>(&mut conn.inner).is_ok();
            conn.broken |= !ok;
            ok
        }
        Err(_) => false,
    };
    if answered {
        health.success(started.elapsed());
    } else {
        health.failure(Instant::now(), "probe failed");
    }
}

/// Least grace given to replies after a round is decided: a healthy node
/// on a busy machine answers within it, a hung one costs no more.
const DRAIN_MIN: Duration = Duration::from_millis(1);

impl Transport for RedisTransport {
    fn node_names(&self) -> &[String] {
        &self.names
    }

    fn run(
        &self,
        op: Op,
        keys: &[Key<'_>],
        deadline: Instant,
        decided: Option<Decided<'_>>,
    ) -> Vec<NodeResult> {
        if let Op::Acquire { ttl } | Op::Extend { ttl } = op {
            self.shared
                .tracked_ttl_ms
                .fetch_max(millis_ceil(ttl), Ordering::Relaxed);
        }
        let round = Encoded::new(op, keys);
        let n = self.nodes.len();
        let mut results: Vec<Option<NodeResult>> = vec![None; n];
        let mut conns: Vec<Option<PooledConnection<Manager>>> = (0..n).map(|_| None).collect();

        // Admit and check out: idle connections first (never waits), then
        // wait for the rest within the round's deadline.
        let now = Instant::now();
        for i in 0..n {
            match self.admit(i, now) {
                Ok(()) => conns[i] = self.nodes[i].pool.try_get(),
                Err(e) => results[i] = Some(Err(e)),
            }
        }
        // Wait for the missing connections in short slices, so that a node
        // whose background connect was just refused (its breaker opens) is
        // given up at once instead of at the deadline.
        let mut missing: Vec<usize> = (0..n)
            .filter(|&i| conns[i].is_none() && results[i].is_none())
            .collect();
        while let Some(&first) = missing.first() {
            let now = Instant::now();
            if now >= deadline {
                for &i in &missing {
                    self.nodes[i].health.failure(now, "no connection in time");
                    results[i] = Some(Err(NodeError::new(
                        &self.names[i],
                        NodeErrorKind::Unavailable,
                        "no connection before the deadline",
                    )));
                }
                break;
            }
            missing.retain(|&i| {
                let node = &self.nodes[i];
                if let Some(c) = node.pool.try_get() {
                    conns[i] = Some(c);
                    false
                } else if !node.health.breaker.lock().is_closed() {
                    results[i] = Some(Err(NodeError::new(
                        &self.names[i],
                        NodeErrorKind::Unavailable,
                        "cannot connect",
                    )));
                    false
                } else {
                    true
                }
            });
            if missing.first() == Some(&first) {
                let slice = deadline.saturating_duration_since(now).min(MIN_TIMEOUT);
                if let Ok(c) = self.nodes[first].pool.get_timeout(slice) {
                    conns[first] = Some(c);
                    missing.remove(0);
                }
            }
        }

        // Scatter.
        let sent = Instant::now();
        for (i, slot) in conns.iter_mut().enumerate() {
            if let Some(conn) = slot {
                if let Err(e) = conn.inner.send_packed_command(&round.packed) {
                    conn.broken = true;
                    let err = node_error(&self.names[i], &e);
                    self.nodes[i].health.failure(Instant::now(), err.detail());
                    results[i] = Some(Err(err));
                    *slot = None;
                }
            }
        }

        // Gather, fastest nodes first, until the outcome is decided; then
        // take only replies that arrive shortly after.
        let mut order: Vec<usize> = (0..n).filter(|&i| conns[i].is_some()).collect();
        order.sort_by_key(|&i| self.nodes[i].health.latency_ns.load(Ordering::Relaxed));
        // Skipped nodes alone may already settle it (no majority possible).
        let mut drain: Option<Instant> = decided
            .is_some_and(|f| f(&results))
            .then(|| after(Instant::now(), DRAIN_MIN).min(deadline));
        for i in order {
            let Some(conn) = conns[i].as_mut() else {
                continue;
            };
            let health = &self.nodes[i].health;
            let (until, floor) = match drain {
                Some(d) => (d, Duration::from_micros(50)),
                None => (deadline, MIN_TIMEOUT),
            };
            let r = round.receive(conn, until, floor);
            let now = Instant::now();
            match &r {
                Ok(_) => health.success(now.saturating_duration_since(sent)),
                Err((NodeErrorKind::Timeout, _)) if drain.is_some() => {
                    // At least this slow: read after the others next time.
                    health.sample_latency(now.saturating_duration_since(sent));
                    if let Some(window) = health.breaker.lock().late(now) {
                        debug!(
                            "node {}: late {LATE_LIMIT} times; skipped for {window:?}",
                            health.name
                        );
                    }
                }
                Err((
                    NodeErrorKind::Timeout | NodeErrorKind::Io | NodeErrorKind::Unavailable,
                    why,
                )) => {
                    health.sample_latency(now.saturating_duration_since(sent));
                    health.failure(now, why)
                }
                Err(_) => {}
            }
            if r.is_err() {
                conn.broken = true;
            }
            results[i] =
                Some(r.map_err(|(kind, detail)| NodeError::new(&self.names[i], kind, detail)));
            if drain.is_none() && decided.is_some_and(|f| f(&results)) {
                let grace = now
                    .saturating_duration_since(sent)
                    .saturating_mul(2)
                    .max(DRAIN_MIN);
                drain = Some(after(now, grace).min(deadline));
            }
        }
        drop(conns);

        results
            .into_iter()
            .zip(&self.names)
            .map(|(r, name)| {
                r.unwrap_or_else(|| {
                    Err(NodeError::new(
                        name,
                        NodeErrorKind::Unavailable,
                        "no result",
                    ))
                })
            })
            .collect()
    }
}

/// A round's commands, packed once for all nodes.
struct Encoded {
    op: Op,
    keys: usize,
    packed: Vec<u8>,
    /// The same script sent as `EVAL`, for a node that answers NOSCRIPT.
    fallback: Option<Vec<u8>>,
}

impl Encoded {
    fn new(op: Op, keys: &[Key<'_>]) -> Self {
        match op {
            Op::Acquire { ttl } => {
                let ms = millis_ceil(ttl);
                let mut packed = Vec::with_capacity(keys.len() * 96);
                for k in keys {
                    let mut cmd = redis::cmd("SET");
                    cmd.arg(k.resource).arg(k.token).arg("NX").arg("PX").arg(ms);
                    cmd.write_packed_command(&mut packed);
                }
                Encoded {
                    op,
                    keys: keys.len(),
                    packed,
                    fallback: None,
                }
            }
            Op::Release => Self::script(op, &scripts::RELEASE, scripts::RELEASE_LUA, 0, keys),
            Op::Extend { ttl } => Self::script(
                op,
                &scripts::EXTEND,
                scripts::EXTEND_LUA,
                millis_ceil(ttl),
                keys,
            ),
        }
    }

    fn script(op: Op, script: &redis::Script, code: &str, arg: u64, keys: &[Key<'_>]) -> Self {
        let pack = |verb: &str, body: &str| {
            let mut cmd = redis::cmd(verb);
            cmd.arg(body).arg(keys.len());
            for k in keys {
                cmd.arg(k.resource);
            }
            cmd.arg(arg);
            for k in keys {
                cmd.arg(k.token);
            }
            cmd.get_packed_command()
        };
        Encoded {
            op,
            keys: keys.len(),
            packed: pack("EVALSHA", script.get_hash()),
            fallback: Some(pack("EVAL", code)),
        }
    }

    /// Reads this round's replies from one connection.
    fn receive(
        &self,
        conn: &mut Conn,
        deadline: Instant,
        floor: Duration,
    ) -> Result<Vec<Answer>, (NodeErrorKind, String)> {
        match self.op {
            Op::Acquire { .. } => {
                let mut answers = Vec::with_capacity(self.keys);
                for _ in 0..self.keys {
                    answers.push(match conn.recv(deadline, floor)? {
                        Value::Okay => Answer::Ok,
                        Value::Nil => Answer::Other,
                        v => return Err(unexpected(v)),
                    });
                }
                Ok(answers)
            }
            Op::Release | Op::Extend { .. } => {
                let mut reply = conn.recv(deadline, floor)?;
                if let (Value::ServerError(e), Some(fallback)) = (&reply, &self.fallback) {
                    if e.kind() == Some(redis::ServerErrorKind::NoScript) {
                        debug!("script not cached on node, sending EVAL");
                        conn.inner
                            .send_packed_command(fallback)
                            .map_err(|e| classify(&e))?;
                        reply = conn.recv(deadline, floor)?;
                    }
                }
                match reply {
                    Value::Array(items) if items.len() == self.keys => items
                        .into_iter()
                        .map(|v| match v {
                            Value::Int(1) => Ok(Answer::Ok),
                            Value::Int(0) => Ok(Answer::Absent),
                            Value::Int(-1) => Ok(Answer::Other),
                            v => Err(unexpected(v)),
                        })
                        .collect(),
                    v => Err(unexpected(v)),
                }
            }
        }
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

fn classify(e: &RedisError) -> (NodeErrorKind, String) {
    let kind = if e.is_timeout() {
        NodeErrorKind::Timeout
    } else if e.is_connection_refusal() {
        NodeErrorKind::Unavailable
    } else if e.is_io_error() || e.is_connection_dropped() {
        NodeErrorKind::Io
    } else {
        NodeErrorKind::Protocol
    };
    (kind, e.to_string())
}

fn node_error(node: &str, e: &RedisError) -> NodeError {
    let (kind, detail) = classify(e);
    NodeError::new(node, kind, detail)
}

/// A pooled connection that remembers whether it may be reused.
pub(crate) struct Conn {
    inner: redis::Connection,
    broken: bool,
}

impl Conn {
    /// Reads one reply, waiting until `deadline` — and past it at most
    /// `floor`, so that a reply that has already arrived is still taken (a
    /// slow node read earlier must not cost the others their votes).
    fn recv(
        &mut self,
        deadline: Instant,
        floor: Duration,
    ) -> Result<Value, (NodeErrorKind, String)> {
        let left = deadline.saturating_duration_since(Instant::now());
        self.inner
            .set_read_timeout(Some(left.max(floor)))
            .map_err(|e| classify(&e))?;
        self.inner.recv_response().map_err(|e| classify(&e))
    }
}

/// Our r2d2 connection manager: connect with a timeout, socket timeouts set,
/// TCP_NODELAY, no `CLIENT SETINFO`; with restart protection, one
/// `INFO server` per new connection to notice a restarted node.
pub(crate) struct Manager {
    client: ConnectionInfo,
    shared: Arc<Shared>,
    health: Arc<Health>,
}

impl fmt::Debug for Manager {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Manager")
            .field("node", &self.health.name)
            .finish()
    }
}

impl Manager {
    fn open(&self) -> Result<Conn, RedisError> {
        let timeout = self.shared.config.timeout;
        let client = redis::Client::open(self.client.clone())?;
        let mut inner = client.get_connection_with_timeout(timeout)?;
        inner.set_write_timeout(Some(timeout))?;
        inner.set_read_timeout(Some(timeout))?;
        if self.shared.config.restart_protection {
            let started = Instant::now();
            match redis::cmd("INFO").arg("server").query::<String>(&mut inner) {
                Ok(info) => {
                    self.health.success(started.elapsed());
                    self.observe(&info);
                }
                Err(e) if e.is_io_error() || e.is_timeout() || e.is_connection_dropped() => {
                    return Err(e)
                }
                // The node answers but will not tell (an ACL without INFO,
                // a proxy): usable, just without restart detection.
                Err(e) => {
                    self.health.success(started.elapsed());
                    if self.health.info_refused.ready(Instant::now(), WARN_EVERY) {
                        warn!(
                            "node {}: INFO server refused ({e}); restarts of this node cannot be detected",
                            self.health.name
                        );
                    }
                }
            }
        }
        Ok(Conn {
            inner,
            broken: false,
        })
    }

    /// Applies the delayed-restart rule to what `INFO server` said.
    fn observe(&self, info: &str) {
        let field = |name: &str| {
            info.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
                .map(str::trim)
        };
        let (Some(run_id), Some(uptime)) = (
            field("run_id"),
            field("uptime_in_seconds").and_then(|u| u.parse::<u64>().ok()),
        ) else {
            debug!("node {}: INFO without run_id/uptime", self.health.name);
            return;
        };
        let tracked = Duration::from_millis(self.shared.tracked_ttl_ms.load(Ordering::Relaxed));
        let held = self.health.restart.lock().observe(
            run_id,
            Duration::from_secs(uptime),
            Instant::now(),
            self.shared.config.max_ttl,
            tracked,
        );
        if let Some(until) = held {
            info!(
                "node {}: up only {uptime} s (restarted?); its votes are held back for {:?} so that locks it forgot expire first",
                self.health.name,
                until.saturating_duration_since(Instant::now())
            );
        }
    }
}

impl ManageConnection for Manager {
    type Connection = Conn;
    type Error = RedisError;

    fn connect(&self) -> Result<Conn, RedisError> {
        self.open().inspect_err(|e| {
            // A refused or timed-out connect makes rounds skip the node at
            // once instead of waiting for a connection that will not come.
            if e.is_connection_refusal() || e.is_timeout() || e.is_io_error() {
                self.health.failure(Instant::now(), "connect failed");
            }
        })
    }

    fn is_valid(&self, conn: &mut Conn) -> Result<(), RedisError> {
        conn.inner
            .set_read_timeout(Some(self.shared.config.timeout))?;
        redis::cmd("PING")
            .query::<String>(&mut conn.inner)
            .map(drop)
    }

    fn has_broken(&self, conn: &mut Conn) -> bool {
        conn.broken || !conn.inner.is_open()
    }
}

/// Logs background connect failures: every one at debug, at most one per
/// [`WARN_EVERY`] per node at warn, so a dead node does not flood the log.
#[derive(Debug)]
struct ConnectErrors {
    node: String,
    warned: Throttle,
}

impl r2d2::HandleError<RedisError> for ConnectErrors {
    fn handle_error(&self, error: RedisError) {
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

    #[test]
    fn millis_round_up_and_never_zero() {
        assert_eq!(millis_ceil(Duration::from_micros(1)), 1);
        assert_eq!(millis_ceil(Duration::from_micros(1500)), 2);
        assert_eq!(millis_ceil(Duration::from_millis(30_000)), 30_000);
        assert_eq!(millis_ceil(Duration::ZERO), 1);
        assert!(millis_ceil(Duration::MAX) > 0);
    }

    #[test]
    fn scripts_are_packed_once_with_hash_and_fallback() {
        let keys = [
            Key {
                resource: "a",
                token: "t1",
            },
            Key {
                resource: "b",
                token: "t2",
            },
        ];
        let e = Encoded::new(
            Op::Extend {
                ttl: Duration::from_millis(1500),
            },
            &keys,
        );
        let text = String::from_utf8_lossy(&e.packed);
        assert!(text.contains("EVALSHA") && text.contains(scripts::EXTEND.get_hash()));
        // KEYS then ttl then tokens.
        let order: Vec<&str> = text
            .split("\r\n")
            .filter(|s| !s.starts_with(['*', '$']))
            .collect();
        assert_eq!(order[2..], ["2", "a", "b", "1500", "t1", "t2", ""]);
        assert!(
            String::from_utf8_lossy(e.fallback.as_deref().unwrap_or_default()).contains("PEXPIRE")
        );
    }
}
