//! [`Redlock`]: the client handle, its lock calls and its operator's
//! queries; the work is the [`Engine`]'s.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::algorithm::quorum;
use crate::clock::after;
use crate::guard::LockGuard;
use crate::inspect::NodeKey;
use crate::lock::engine::{validate_resource, Engine};
use crate::request::LockRequest;
use crate::Result;

/// A Redlock client over N independent Redis nodes.
///
/// Cheap to clone (an `Arc` inside) and safe to share between threads.
/// Created by [`Redlock::builder`].
///
/// ```no_run
/// use std::time::Duration;
///
/// let locks = quorumlock::Redlock::builder()
///     .nodes(["redis://127.0.0.1:7001", "redis://127.0.0.1:7002", "redis://127.0.0.1:7003"])
///     .build()?;
/// let guard = locks.lock("lock:sku:42", Duration::from_secs(10))?;
/// // ... critical section: finish within guard.validity() ...
/// guard.release()?;
/// # Ok::<(), quorumlock::Error>(())
/// ```
#[derive(Clone)]
pub struct Redlock {
    pub(crate) engine: Arc<Engine>,
}

impl fmt::Debug for Redlock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Redlock")
            .field("nodes", &self.engine.transport.node_names())
            .field("settings", &self.engine.settings)
            .finish()
    }
}

impl Redlock {
    /// Number of nodes.
    pub fn node_count(&self) -> usize {
        self.engine.transport.node_names().len()
    }

    /// Nodes that must agree for a lock to be held: `N/2 + 1`.
    pub fn quorum(&self) -> usize {
        quorum::quorum(self.node_count())
    }

    /// Makes one attempt to take `resource` for `ttl`: the shorthand of
    /// [`request(resource, ttl).try_acquire()`](LockRequest::try_acquire).
    ///
    /// # Errors
    /// [`Error::Taken`](crate::Error::Taken) when another owner holds it, [`Error::NoQuorum`](crate::Error::NoQuorum) when
    /// too many nodes failed, [`Error::ValidityExhausted`](crate::Error::ValidityExhausted) when the round was
    /// too slow for the TTL, [`Error::InvalidInput`](crate::Error::InvalidInput) for an empty resource or
    /// a TTL that is zero, too long, or not above the drift allowance.
    pub fn try_lock(&self, resource: &str, ttl: Duration) -> Result<LockGuard> {
        self.request(resource, ttl).try_acquire()
    }

    /// Takes `resource` for `ttl`, waiting as the client is configured to
    /// (see [`LockRequest::acquire`]): the shorthand of
    /// [`request(resource, ttl).acquire()`](LockRequest::acquire).
    ///
    /// # Errors
    /// As [`try_lock`](Self::try_lock), the last attempt's.
    pub fn lock(&self, resource: &str, ttl: Duration) -> Result<LockGuard> {
        self.request(resource, ttl).acquire()
    }

    /// A lock request for `resource`, held for `ttl` once taken: add more
    /// resources ([`and`](LockRequest::and)) or ask for a shared lock
    /// ([`read`](LockRequest::read)), then say how long to wait
    /// ([`try_acquire`](LockRequest::try_acquire),
    /// [`acquire`](LockRequest::acquire),
    /// [`acquire_for`](LockRequest::acquire_for),
    /// [`acquire_until`](LockRequest::acquire_until)).
    ///
    /// ```no_run
    /// # use std::time::Duration;
    /// # let locks = quorumlock::Redlock::builder().node("redis://127.0.0.1:6379").build()?;
    /// let ttl = Duration::from_secs(10);
    /// let both = locks.request("sku:1042", ttl).and("sku:2210").acquire_for(Duration::from_secs(2))?;
    /// both.release()?;
    /// # Ok::<(), quorumlock::Error>(())
    /// ```
    pub fn request<'a>(&'a self, resource: &'a str, ttl: Duration) -> LockRequest<'a> {
        LockRequest::new(&self.engine, resource, ttl)
    }

    /// Waits until every node has a pooled connection (and the client has
    /// read who its server is and which lock history it has) or has failed
    /// to connect, for at most `within`; returns how many nodes are
    /// connected.
    ///
    /// Also checks the node list: every connection asks its server for its
    /// `run_id` (and reads its lock history's id), and two entries that
    /// reach one server (two names of one host, a load balancer, two
    /// databases of one server) are an error. Rounds already count such a
    /// server's answers once ([`NodeErrorKind::SameServer`](crate::NodeErrorKind::SameServer)),
    /// but a cluster listed that way has fewer independent nodes than it
    /// seems: fix the list. Under an ACL that refuses `INFO`, only entries
    /// of one database are told apart, once its lock history exists.
    ///
    /// Never needed for correctness otherwise. A client connects in the
    /// background, and its rounds do not wait for a node still connecting
    /// (its vote cannot change a settled outcome), but for a round that uses
    /// a TTL longer than any the client knows of (its very first round, for
    /// one): that waits, at most one node timeout, for the lock histories
    /// the nodes report at connect, so that the TTL is recorded as first used
    /// after them (see "Delayed restarts" in the README). Other first
    /// locks may be set on only the nodes connected by then: a bare
    /// majority, one node failure from loss. A short-lived process that takes one lock
    /// (a cron job, `quorumlock run`) calls this first; a long-lived service
    /// need not.
    ///
    /// ```no_run
    /// use std::time::Duration;
    ///
    /// let locks = quorumlock::Redlock::builder()
    ///     .nodes(["redis://127.0.0.1:7001", "redis://127.0.0.1:7002", "redis://127.0.0.1:7003"])
    ///     .build()?;
    /// let connected = locks.wait_connected(Duration::from_millis(200))?;
    /// assert!(connected <= locks.node_count());
    /// # Ok::<(), quorumlock::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`InvalidInput::SameServer`](crate::InvalidInput::SameServer) naming
    /// two entries that reach one server.
    pub fn wait_connected(&self, within: Duration) -> Result<usize> {
        let deadline = after(self.engine.clock.now(), within);
        Ok(self.engine.transport.wait_connected(deadline)?)
    }

    /// What every node stores for `resource` right now: whether the key
    /// exists, its token and its remaining time to live; for a resource
    /// read-locked, its live readers (each reader's token and time left)
    /// and whether a writer waits ([`KeyInfo::readers`](crate::KeyInfo::readers),
    /// [`KeyInfo::writer_waiting`](crate::KeyInfo::writer_waiting)). One
    /// entry per node, in the builder's order.
    ///
    /// For operators and status tools (`quorumlock status`): each node is
    /// asked on a connection of its own, all at once, each step within the
    /// node timeout (TCP connect, TLS handshake, `AUTH`, `SELECT`, then the
    /// replies; name resolution is not bounded). One round trip of `GET`,
    /// `PTTL`, `ZREVRANGE` and `TIME`, commands the lock's own scripts run,
    /// so that the ACL of a read lock's user allows them (under one for
    /// exclusive locks alone, without the sorted-set commands, a writer's
    /// key still reads, and a reader set is the node's refusal). It takes no lock
    /// and changes no node's health. A node's copy says nothing on its own
    /// about who holds the lock: a lock is held only on a majority, within
    /// its validity.
    ///
    /// ```no_run
    /// let locks = quorumlock::Redlock::builder()
    ///     .nodes(["redis://127.0.0.1:7001", "redis://127.0.0.1:7002", "redis://127.0.0.1:7003"])
    ///     .build()?;
    /// for node in locks.inspect("lock:nightly-report")? {
    ///     match node.key() {
    ///         Ok(Some(k)) if k.is_read() => {
    ///             let waits = if k.writer_waiting().is_some() { ", a writer waits" } else { "" };
    ///             println!("{}: {} readers{waits}", node.node(), k.readers().len());
    ///         }
    ///         Ok(Some(k)) => println!("{}: held, {:?} left", node.node(), k.ttl()),
    ///         Ok(None) => println!("{}: free", node.node()),
    ///         Err(e) => println!("{}: {e}", node.node()),
    ///     }
    /// }
    /// # Ok::<(), quorumlock::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidInput`](crate::Error::InvalidInput) for a resource name [`lock`](Self::lock)
    /// would refuse; per-node failures are in the entries.
    pub fn inspect(&self, resource: &str) -> Result<Vec<NodeKey>> {
        validate_resource(resource)?;
        let names = self.engine.transport.node_names();
        let found = self
            .engine
            .transport
            .inspect(resource, self.engine.settings.node_timeout);
        Ok(names
            .iter()
            .zip(found)
            .map(|(node, key)| NodeKey::new(node.clone(), key))
            .collect())
    }

    /// Audits the node list as the client judges nodes at connect, and
    /// more, with a verdict per node and for the set (`quorumlock check`
    /// prints it): whether the entries are distinct servers (`run_id`, lock
    /// history id), each node's role and cluster mode, its memory policy
    /// (an evicting one drops lock keys), its persistence settings and what
    /// they mean for the restart rule, its clock against this machine's
    /// (measured in one round trip), its round trip against the node
    /// timeout, and whether the lock's scripts run on `key` under its ACL
    /// (and the read locks', two readers on `key`: a warning where the ACL
    /// refuses them, read locks being optional).
    ///
    /// Each node is asked on a connection of its own, all at once, each
    /// step within the node timeout. The script test runs the acquire and
    /// release scripts on `key` on each node alone, with a random token for
    /// at most a second: one node's key never grants a lock, but a client
    /// locking `key` at that moment may count that node's vote as taken.
    /// Use a key your locks' ACL allows (`lock:check` under `~lock:*`).
    ///
    /// ```no_run
    /// let locks = quorumlock::Redlock::builder()
    ///     .nodes(["redis://127.0.0.1:7001", "redis://127.0.0.1:7002", "redis://127.0.0.1:7003"])
    ///     .build()?;
    /// let check = locks.check("lock:check")?;
    /// println!("{check}");
    /// assert!(check.is_safe(), "fix the findings marked UNSAFE or FAIL");
    /// # Ok::<(), quorumlock::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidInput`](crate::Error::InvalidInput) for a key [`lock`](Self::lock) would refuse.
    pub fn check(&self, key: &str) -> Result<crate::Check> {
        validate_resource(key)?;
        let timeout = self.engine.settings.node_timeout;
        let probes = self.engine.transport.probe(key, timeout);
        Ok(crate::check::assess(
            self.engine.transport.node_names(),
            probes,
            timeout,
            self.quorum(),
            key,
        ))
    }
}
