//! The Redis driver: one r2d2 pool per node and scatter/gather I/O on the
//! pooled sockets.
//!
//! A round writes the same packed command to every node first and only then
//! reads the replies, so it costs about one round trip to the slowest node,
//! not the sum, without a thread per node. Every read is bounded by the
//! round's deadline; a connection that saw any error is marked broken and
//! never returns to the pool.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use log::{debug, warn};
use r2d2::{ManageConnection, Pool, PooledConnection};
use redis::{ConnectionInfo, ConnectionLike, RedisError, Value};
use scheduled_thread_pool::ScheduledThreadPool;

use crate::clock::Throttle;
use crate::error::{NodeError, NodeErrorKind};
use crate::scripts;
use crate::transport::{Answer, Key, NodeResult, Op, Transport};

/// The smallest socket timeout we set (`Some(ZERO)` is an error for std).
const MIN_TIMEOUT: Duration = Duration::from_millis(1);
/// How often a failing node may log at warn level.
pub(crate) const WARN_EVERY: Duration = Duration::from_secs(30);

/// A parsed node address.
#[derive(Debug, Clone)]
pub(crate) struct NodeSpec {
    /// `host:port`, with `/db` when not 0. No credentials.
    pub name: String,
    pub info: ConnectionInfo,
}

/// The production [`Transport`].
pub(crate) struct RedisTransport {
    names: Vec<String>,
    nodes: Vec<Pool<Manager>>,
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
    pub(crate) fn new(specs: Vec<NodeSpec>, timeout: Duration, pool_size: u32) -> Self {
        // One small set of connector threads for all of this client's pools:
        // safe because every connect is bounded by `timeout`.
        let threads = Arc::new(
            ScheduledThreadPool::builder()
                .num_threads(2)
                .thread_name_pattern("quorumlock-connect-{}")
                .build(),
        );
        let mut names = Vec::with_capacity(specs.len());
        let mut nodes = Vec::with_capacity(specs.len());
        for spec in specs {
            let manager = Manager {
                client: spec.info,
                timeout: timeout.max(MIN_TIMEOUT),
            };
            let pool = Pool::builder()
                .max_size(pool_size)
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
            nodes.push(pool);
        }
        RedisTransport { names, nodes }
    }
}

impl Transport for RedisTransport {
    fn node_names(&self) -> &[String] {
        &self.names
    }

    fn run(&self, op: Op, keys: &[Key<'_>], deadline: Instant) -> Vec<NodeResult> {
        let round = Encoded::new(op, keys);
        let n = self.nodes.len();
        let mut results: Vec<Option<NodeResult>> = vec![None; n];

        // Check out: idle connections first (never waits), then wait for the
        // rest within the round's deadline.
        let mut conns: Vec<Option<PooledConnection<Manager>>> =
            self.nodes.iter().map(|p| p.try_get()).collect();
        for i in 0..n {
            if conns[i].is_none() {
                let wait = deadline.saturating_duration_since(Instant::now());
                match self.nodes[i].get_timeout(wait) {
                    Ok(c) => conns[i] = Some(c),
                    Err(e) => {
                        results[i] = Some(Err(NodeError::new(
                            &self.names[i],
                            NodeErrorKind::Unavailable,
                            e.to_string(),
                        )))
                    }
                }
            }
        }

        // Scatter.
        for (i, slot) in conns.iter_mut().enumerate() {
            if let Some(conn) = slot {
                if let Err(e) = conn.inner.send_packed_command(&round.packed) {
                    conn.broken = true;
                    results[i] = Some(Err(node_error(&self.names[i], &e)));
                    *slot = None;
                }
            }
        }

        // Gather.
        for (i, slot) in conns.iter_mut().enumerate() {
            if let Some(conn) = slot {
                let r = round.receive(conn, deadline);
                if r.is_err() {
                    conn.broken = true;
                }
                results[i] =
                    Some(r.map_err(|(kind, detail)| NodeError::new(&self.names[i], kind, detail)));
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
    ) -> Result<Vec<Answer>, (NodeErrorKind, String)> {
        match self.op {
            Op::Acquire { .. } => {
                let mut answers = Vec::with_capacity(self.keys);
                for _ in 0..self.keys {
                    answers.push(match conn.recv(deadline)? {
                        Value::Okay => Answer::Ok,
                        Value::Nil => Answer::Other,
                        v => return Err(unexpected(v)),
                    });
                }
                Ok(answers)
            }
            Op::Release | Op::Extend { .. } => {
                let mut reply = conn.recv(deadline)?;
                if let (Value::ServerError(e), Some(fallback)) = (&reply, &self.fallback) {
                    if e.kind() == Some(redis::ServerErrorKind::NoScript) {
                        debug!("script not cached on node, sending EVAL");
                        conn.inner
                            .send_packed_command(fallback)
                            .map_err(|e| classify(&e))?;
                        reply = conn.recv(deadline)?;
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
    fn recv(&mut self, deadline: Instant) -> Result<Value, (NodeErrorKind, String)> {
        // Past the deadline we still take a reply that has already arrived
        // (a slow node read earlier must not cost the others their votes),
        // waiting at most MIN_TIMEOUT for it.
        let left = deadline.saturating_duration_since(Instant::now());
        self.inner
            .set_read_timeout(Some(left.max(MIN_TIMEOUT)))
            .map_err(|e| classify(&e))?;
        self.inner.recv_response().map_err(|e| classify(&e))
    }
}

/// Our r2d2 connection manager: connect with a timeout, socket timeouts set,
/// TCP_NODELAY, no extra set-up round trips.
pub(crate) struct Manager {
    client: ConnectionInfo,
    timeout: Duration,
}

impl fmt::Debug for Manager {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Manager")
            .field("addr", &self.client.addr().to_string())
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl ManageConnection for Manager {
    type Connection = Conn;
    type Error = RedisError;

    fn connect(&self) -> Result<Conn, RedisError> {
        let client = redis::Client::open(self.client.clone())?;
        let inner = client.get_connection_with_timeout(self.timeout)?;
        inner.set_write_timeout(Some(self.timeout))?;
        inner.set_read_timeout(Some(self.timeout))?;
        Ok(Conn {
            inner,
            broken: false,
        })
    }

    fn is_valid(&self, conn: &mut Conn) -> Result<(), RedisError> {
        conn.inner.set_read_timeout(Some(self.timeout))?;
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
