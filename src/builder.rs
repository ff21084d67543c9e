//! [`Builder`]: node list, timeouts, drift, retry policy, pool size.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::clock::{Rng, SystemClock};
use crate::driver::node::{DriverConfig, RedisTransport};
use crate::driver::url::{parse_nodes_with, redact, TlsSettings};
use crate::error::InvalidInput;
use crate::lock::engine::Engine;
use crate::lock::settings::{Settings, MAX_POOL_SIZE};
use crate::redlock::Redlock;
use crate::Result;

/// Configures and creates a [`Redlock`] client.
///
/// ```no_run
/// use std::time::Duration;
///
/// let locks = quorumlock::Redlock::builder()
///     .nodes(["redis://10.0.0.1:6379", "redis://10.0.0.2:6379", "redis://10.0.0.3:6379"])
///     .node_timeout(Duration::from_millis(50))
///     .retry_count(5)
///     .build()?;
/// # Ok::<(), quorumlock::Error>(())
/// ```
#[derive(Clone)]
pub struct Builder {
    nodes: Vec<String>,
    settings: Settings,
    pool_size: u32,
    tls: TlsSettings,
}

impl Default for Builder {
    fn default() -> Self {
        Builder {
            nodes: Vec::new(),
            settings: Settings::default(),
            pool_size: 32,
            tls: TlsSettings::default(),
        }
    }
}

impl fmt::Debug for Builder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let nodes: Vec<String> = self.nodes.iter().map(|u| redact(u)).collect();
        f.debug_struct("Builder")
            .field("nodes", &nodes)
            .field("settings", &self.settings)
            .field("pool_size", &self.pool_size)
            .field("tls", &self.tls)
            .finish()
    }
}

impl Redlock {
    /// Starts configuring a client.
    pub fn builder() -> Builder {
        Builder::new()
    }
}

impl Builder {
    /// A builder with the defaults and no nodes.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets the node list (replacing any earlier one): `redis://[user:password@]host:port[/db]`
    /// URLs of independent Redis servers (not replicas of each other, not a
    /// cluster). Use an odd number, typically 3 or 5.
    ///
    /// Defaults to no nodes (and [`build`](Self::build) fails).
    pub fn nodes<I, S>(mut self, urls: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.nodes = urls.into_iter().map(Into::into).collect();
        self
    }

    /// Adds one node URL to the list.
    pub fn node(mut self, url: impl Into<String>) -> Self {
        self.nodes.push(url.into());
        self
    }

    /// Sets the per-node I/O timeout, used for connect, read and write, and
    /// as the bound of each round (acquire, extend, release). A round of a
    /// lock of several resources, or a renewal of many locks at once, gets
    /// one node timeout more per 200 keys it carries (a node runs them
    /// all in one script); a lone lock's round gets exactly this.
    ///
    /// Defaults to 50 ms.
    pub fn node_timeout(mut self, timeout: Duration) -> Self {
        self.settings.node_timeout = timeout;
        self
    }

    /// Sets the clock-drift factor: validity is `ttl − elapsed − (ttl × factor + 2 ms)`.
    /// Must be in `0.0..1.0`.
    ///
    /// Defaults to 0.01.
    pub fn drift_factor(mut self, factor: f64) -> Self {
        self.settings.drift_factor = factor;
        self
    }

    /// Sets how many attempts [`Redlock::lock`] makes before giving up (at least 1).
    /// With 1, `lock` and [`LockRequest::acquire`](crate::LockRequest::acquire) make
    /// one attempt, as `try_lock` does: they neither wait in the local queue nor for a
    /// release.
    ///
    /// Defaults to 3.
    pub fn retry_count(mut self, attempts: u32) -> Self {
        self.settings.retry_count = attempts;
        self
    }

    /// Sets the mean pause between attempts (at most 60 s). A waiter woken
    /// by releases (see [`wake_ups`](Self::wake_ups)) waits for a wake-up
    /// at most this long, and at most a second.
    ///
    /// Defaults to 100 ms (with the default jitter: a random pause of 0–200 ms).
    pub fn retry_delay(mut self, delay: Duration) -> Self {
        self.settings.retry_delay = delay;
        self
    }

    /// Sets the jitter: each pause is drawn uniformly from `delay ± jitter`
    /// (never below zero), so that competing clients do not retry in step.
    ///
    /// Defaults to 100 ms.
    pub fn retry_jitter(mut self, jitter: Duration) -> Self {
        self.settings.retry_jitter = jitter;
        self
    }

    /// Sets the most connections this client opens to each node (1 to 1,024).
    ///
    /// Rounds that overlap in time share one connection per node (their
    /// commands are carried on it together, and one of them reads the
    /// replies for all), so a few connections serve many threads; the pool
    /// also gives connections to the background retries and replaces a
    /// connection given up after a timeout. Connections are opened on demand (two are kept idle) and closed after
    /// 10 minutes unused. A round that finds no free connection in time
    /// reports [`NodeErrorKind::NoConnection`](crate::NodeErrorKind::NoConnection)
    /// for that node; it never counts against the node's health.
    ///
    /// Defaults to 32.
    pub fn pool_size(mut self, size: u32) -> Self {
        self.pool_size = size;
        self
    }

    /// Queues threads of this process that wait for the same resource
    /// locally (FIFO), so that only one of them at a time asks the nodes and a
    /// release hands over to the next at once, instead of every thread
    /// polling the nodes with jittered sleeps. `try_lock` never waits in the
    /// queue. Contention with other processes is still settled by the nodes.
    ///
    /// A lock handed over is a new critical section, numbered one more (see
    /// [`LockGuard::section`](crate::LockGuard::section)), with the key's
    /// expiry unchanged. Unfenced, nothing is sent to the nodes: the key
    /// keeps its token. Fenced, one round swaps in a fresh token and the
    /// next fencing token. The receiver takes it only with the same TTL and
    /// at least `node_timeout` of validity left, else it is deleted and the
    /// receiver asks the nodes anew.
    ///
    /// Defaults to true.
    pub fn local_queue(mut self, on: bool) -> Self {
        self.settings.local_queue = on;
        self
    }

    /// Whether a waiting call is woken by another client's release of its
    /// key (pub/sub: one subscriber connection per node, a thread that
    /// reads them; see the README's "Waiting across processes"). Without a
    /// message it tries again after its retry pause (at most a second), or
    /// sooner when the owner's keys expire on a majority (as its failed
    /// attempt saw them). Off, it polls with its retry pause. This client's releases wake the others'
    /// waiters either way.
    ///
    /// Defaults to true.
    pub fn wake_ups(mut self, on: bool) -> Self {
        self.settings.wake_ups = on;
        self
    }

    /// Renews every lock this client takes in the background (as if
    /// [`LockGuard::auto_renew`](crate::LockGuard::auto_renew) were called on
    /// each guard) until it is released or lost.
    ///
    /// Defaults to false: locks expire after their TTL unless extended.
    pub fn auto_renew(mut self, on: bool) -> Self {
        self.settings.auto_renew = on;
        self
    }

    /// Sets when renewals happen: every `ttl × fraction`, in `(0, 1/2]` so that
    /// a failed renewal can be retried while validity remains.
    ///
    /// Defaults to 1/3 (as Redisson: a 30 s lock is renewed every 10 s).
    pub fn renew_fraction(mut self, fraction: f64) -> Self {
        self.settings.renew_fraction = fraction;
        self
    }

    /// Applies the Redlock delayed-restart rule: a node whose lock history
    /// is younger than the longest TTL in use does not vote.
    ///
    /// Every node keeps its lock history in one key, `quorumlock:meta`: when
    /// it first carried a lock (by its own clock) and the longest TTL any
    /// client used on it. A node that restarts without its data, or is
    /// flushed, loses that key with the locks, so its history starts again
    /// and its votes wait until every lock it may have forgotten has expired
    /// everywhere. Each acquire reads and updates the history in the same
    /// script as its `SET`: no extra round trip, no configuration, and it
    /// also protects a client that meets the node for the first time.
    ///
    /// A brand-new cluster looks exactly like a fully restarted one, so its
    /// first locks wait one TTL; see [`fresh_cluster`](Self::fresh_cluster).
    ///
    /// Defaults to true.
    pub fn restart_protection(mut self, on: bool) -> Self {
        self.settings.restart_protection = on;
        self
    }

    /// Trusts a node's lock history the first time this client sees it, even
    /// if it is young: for throwaway clusters (tests, demos) whose first
    /// locks should not wait one TTL. A node whose history this client later
    /// sees start again (it lost its data) is still held back.
    ///
    /// Unsafe for nodes that can lose their data while some client holds a
    /// lock: a client started after such a restart would count the node's
    /// vote at once.
    ///
    /// Defaults to false.
    pub fn fresh_cluster(mut self, on: bool) -> Self {
        self.settings.fresh_cluster = on;
        self
    }

    /// Sets the longest TTL any client of these nodes uses, for the
    /// delayed-restart rule. The nodes already carry the longest TTL used on
    /// them; set this when a client with a longer TTL may not have reached
    /// the nodes a restarted node is judged against (for instance when TTLs
    /// differ widely between clients and nodes are often down). It counts
    /// as in use since always: a node whose history is younger than it
    /// waits, whatever the nodes recorded. A lock or an extension longer
    /// than it is refused ([`InvalidInput::TtlTooLong`]).
    ///
    /// Defaults to unset (learnt from the nodes and from use).
    pub fn max_ttl(mut self, ttl: Duration) -> Self {
        self.settings.max_ttl = Some(ttl);
        self
    }

    /// Gives every lock a fencing token,
    /// [`LockGuard::fencing_token`](crate::LockGuard::fencing_token): a number
    /// that grows with every critical section of a resource, for storage to
    /// refuse writes from a holder that paused past its lock (see the
    /// README's "Fencing tokens").
    ///
    /// Costs one more round trip per acquisition: the token, the largest
    /// counter among the nodes that granted the lock, is written back to the
    /// nodes where the key is still ours, and the lock is returned only once
    /// a majority has it. Renewal keeps the token; a lock handed to another
    /// thread of this process gets the next one, in the swap it needs
    /// anyway.
    ///
    /// Each fenced resource keeps one counter per node, forever: a field
    /// `fence:<resource>` of the hash `quorumlock:meta`. Fence a bounded
    /// set of resources, not one name per request.
    ///
    /// Defaults to false.
    ///
    /// ```no_run
    /// use std::time::Duration;
    ///
    /// let locks = quorumlock::Redlock::builder()
    ///     .nodes(["redis://127.0.0.1:7001", "redis://127.0.0.1:7002", "redis://127.0.0.1:7003"])
    ///     .fencing(true)
    ///     .build()?;
    /// let guard = locks.lock("lock:sku:42", Duration::from_secs(10))?;
    /// let token = guard.fencing_token().expect("fencing is on");
    /// // UPDATE stock SET qty = qty - 1, last_token = :token
    /// //  WHERE sku = 42 AND last_token <= :token
    /// # let _ = token;
    /// # Ok::<(), quorumlock::Error>(())
    /// ```
    pub fn fencing(mut self, on: bool) -> Self {
        self.settings.fencing = on;
        self
    }

    /// **Unsafe:** counts the votes of nodes whose memory policy can evict
    /// lock keys. Such a node has `maxmemory` set with any
    /// `maxmemory-policy` but `noeviction` (`volatile-*` policies evict
    /// exactly the keys that have a TTL, and every lock key has one;
    /// `allkeys-*` evict them too). Under memory pressure it drops a held
    /// lock's key, and a second client can then be granted the lock while
    /// the first still holds it: two holders.
    ///
    /// By default such a node does not vote: its answers fail with
    /// [`NodeErrorKind::Unsuitable`](crate::NodeErrorKind::Unsuitable), and
    /// a lock needs a majority of nodes that keep their keys. Set
    /// `maxmemory-policy noeviction` on lock nodes instead (or leave
    /// `maxmemory` at 0): a full node then refuses writes, and a lock
    /// fails safely. Turn this on only for nodes where eviction is known
    /// not to happen.
    ///
    /// The client learns each node's policy from `INFO` when it connects
    /// and again every few seconds (a policy changed at runtime is seen
    /// within about ten seconds); an evicting node is named in the log at
    /// warn level, once per change, whatever this setting. An ACL that
    /// refuses `INFO` hides the policy: nothing is refused then.
    /// [`Redlock::check`](crate::Redlock::check) calls such a node unsafe.
    ///
    /// Defaults to false.
    ///
    /// ```no_run
    /// use quorumlock::Redlock;
    ///
    /// // Nodes configured with maxmemory-policy allkeys-lru, knowingly.
    /// let locks = Redlock::builder()
    ///     .nodes(["redis://127.0.0.1:7001", "redis://127.0.0.1:7002", "redis://127.0.0.1:7003"])
    ///     .allow_evicting_nodes(true)
    ///     .build()?;
    /// # drop(locks);
    /// # Ok::<(), quorumlock::Error>(())
    /// ```
    pub fn allow_evicting_nodes(mut self, on: bool) -> Self {
        self.settings.allow_evicting = on;
        self
    }

    /// Sends what the client does to `handler`: attempts, renewals,
    /// losses, releases and node state changes, for metrics and traces
    /// (see [`EventHandler`](crate::EventHandler)). Replaces any earlier
    /// handler. Defaults to none.
    pub fn events(mut self, handler: Arc<dyn crate::EventHandler>) -> Self {
        self.settings.events = crate::events::Events(Some(handler));
        self
    }

    /// TLS settings for `rediss://` nodes: which CAs to trust and, for
    /// nodes that require one, the client certificate (feature
    /// `tls-rustls`). `rediss://` nodes are verified against the default
    /// roots when this is not called; certificate verification cannot be
    /// turned off. The files are read by [`build`](Self::build).
    #[cfg(feature = "tls-rustls")]
    #[cfg_attr(docsrs, doc(cfg(feature = "tls-rustls")))]
    pub fn tls(mut self, tls: crate::Tls) -> Self {
        self.tls.tls = Some(tls);
        self
    }

    /// Validates the settings and creates the client. Never waits for a
    /// node: pools connect in the background, and a node that is down only
    /// costs its vote.
    ///
    /// # Errors
    /// [`Error::InvalidInput`](crate::Error::InvalidInput) naming the first
    /// problem: no nodes, an unparsable or duplicate URL, a zero timeout or
    /// count, a drift factor out of range.
    pub fn build(self) -> Result<Redlock> {
        self.settings.validate()?;
        if self.pool_size == 0 {
            return Err(InvalidInput::ZeroCount("pool_size").into());
        }
        if self.pool_size > MAX_POOL_SIZE {
            return Err(InvalidInput::CountTooLarge {
                what: "pool_size",
                value: self.pool_size.into(),
                max: MAX_POOL_SIZE.into(),
            }
            .into());
        }
        let specs = parse_nodes_with(&self.nodes, &self.tls)?;
        let transport = RedisTransport::new(
            specs,
            DriverConfig {
                timeout: self.settings.node_timeout,
                pool_size: self.pool_size,
                events: self.settings.events.clone(),
                rules: self.settings.rules(),
            },
        );
        Ok(Redlock {
            engine: Engine::new(
                self.settings,
                Box::new(transport),
                Arc::new(SystemClock),
                Rng::from_os(),
            ),
        })
    }
}
