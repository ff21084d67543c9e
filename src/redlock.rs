//! [`Redlock`]: the client handle, its lock calls and its operator's
//! queries; the work is the [`Engine`]'s.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use log::debug;

use crate::algorithm::quorum;
use crate::clock::{after, Clock, Rng};
use crate::error::Error;
use crate::guard::LockGuard;
use crate::inspect::NodeKey;
use crate::lock::engine::{validate_resource, Budget, Engine, Want};
use crate::lock::queue::Turn;
use crate::lock::settings::Settings;
use crate::lock::state::{LockState, LostCallback};
use crate::lock::transport::Transport;
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
    pub(crate) fn from_parts(
        settings: Settings,
        transport: Box<dyn Transport>,
        clock: Arc<dyn Clock>,
        rng: Rng,
        on_lost: Option<Arc<LostCallback>>,
    ) -> Self {
        Redlock {
            engine: Engine::new(settings, transport, clock, rng, on_lost),
        }
    }

    /// Number of nodes.
    pub fn node_count(&self) -> usize {
        self.engine.transport.node_names().len()
    }

    /// Nodes that must agree for a lock to be held: `N/2 + 1`.
    pub fn quorum(&self) -> usize {
        quorum::quorum(self.node_count())
    }

    /// Makes one attempt to take `resource` for `ttl`.
    ///
    /// # Errors
    /// [`Error::Taken`] when another owner holds it, [`Error::NoQuorum`] when
    /// too many nodes failed, [`Error::ValidityExhausted`] when the round was
    /// too slow for the TTL, [`Error::InvalidInput`] for an empty resource or
    /// a TTL that is zero, too long, or not above the drift allowance.
    pub fn try_lock(&self, resource: &str, ttl: Duration) -> Result<LockGuard> {
        self.acquire(resource, ttl, Budget::Attempts(1))
    }

    /// Takes `resource` for `ttl`, making up to
    /// [`retry_count`](crate::Builder::retry_count) attempts with a jittered pause
    /// between them, cut short when another client's release of `resource`
    /// wakes it (after its first failed attempt it subscribes to the key's
    /// releases and tries once more, an attempt not counted; see the
    /// README's "Waiting across processes"). A subscribed waiter also tries
    /// in between, at the moment the owner's keys expire and at least once
    /// a second (a lost message costs at most that); those tries are not
    /// counted. Returns the last attempt's error when all fail.
    ///
    /// Waits at most `retry_count × (retry_delay + retry_jitter +
    /// node_timeout)` in all (750 ms with the defaults), queueing behind
    /// threads of this process included, plus at most two node timeouts
    /// (the last attempt's round and, when it fails, the delete of what it
    /// may have set; three with [`fencing`](crate::Builder::fencing): the round,
    /// the write-back and, if that fails, the release).
    ///
    /// # Errors
    /// As [`try_lock`](Self::try_lock).
    pub fn lock(&self, resource: &str, ttl: Duration) -> Result<LockGuard> {
        self.acquire(
            resource,
            ttl,
            Budget::Attempts(self.engine.settings.retry_count),
        )
    }

    /// Takes `resource` for `ttl`, retrying with jittered pauses (cut short,
    /// as [`lock`](Self::lock)'s, by another client's release) until it
    /// succeeds or `wait` has passed (at least one attempt is made). Returns
    /// the last attempt's error when time runs out, within `wait` plus the
    /// node timeouts [`lock`](Self::lock) adds to its own bound.
    ///
    /// # Errors
    /// As [`try_lock`](Self::try_lock).
    pub fn lock_timeout(&self, resource: &str, ttl: Duration, wait: Duration) -> Result<LockGuard> {
        let until = after(self.engine.clock.now(), wait);
        self.acquire(resource, ttl, Budget::Until(until))
    }

    /// Takes `resource` for `ttl` (retrying as [`lock`](Self::lock) does),
    /// renews it in the background while `f` runs, and releases it
    /// afterwards — also when `f` panics. Returns what `f` returns.
    ///
    /// Inside `f`, check [`LockGuard::is_held`] (or select on
    /// [`LockGuard::lost`]) before each step that needs the lock.
    ///
    /// ```no_run
    /// # use std::time::Duration;
    /// # let locks = quorumlock::Redlock::builder().node("redis://127.0.0.1:6379").build()?;
    /// let rows = locks.with_lock("job:nightly", Duration::from_secs(30), |guard| {
    ///     let mut rows = 0;
    ///     while guard.is_held() && rows < 1_000 {
    ///         rows += 1; // one unit of work
    ///     }
    ///     rows
    /// })?;
    /// # Ok::<(), quorumlock::Error>(())
    /// ```
    ///
    /// # Errors
    /// As [`lock`](Self::lock) when the lock cannot be taken; and, after `f`
    /// ran, the reason the lock was lost ([`Error::Expired`],
    /// [`Error::NotOwner`]) if it was lost while `f` ran, and
    /// [`Error::Expired`] if `f` finished after the lock's deadline (whether
    /// or not the watchdog had noticed) — `f`'s result is then dropped,
    /// because its work was not protected.
    pub fn with_lock<T>(
        &self,
        resource: &str,
        ttl: Duration,
        f: impl FnOnce(&LockGuard) -> T,
    ) -> Result<T> {
        run_with(self.lock(resource, ttl)?, f)
    }

    /// Makes one attempt to take every one of `resources` for `ttl`, as one
    /// lock: all of them or none.
    ///
    /// On each node one script sets every resource's key or none (a node
    /// where any is taken sets nothing), so each node votes for the whole
    /// set, and the lock is held, as any lock, with a majority of votes. The
    /// guard releases, extends, renews and loses them together; its
    /// [`resource`](LockGuard::resource) is the first. Locks of
    /// overlapping sets exclude each other and never deadlock: no client
    /// ever holds part of a set as its lock (a node may keep a stray copy
    /// of some keys, which counts for nobody but the set's holder). With
    /// [`fencing`](crate::Builder::fencing), the guard's one token is above
    /// the last token of every resource in the set, and is written back to
    /// each (so a store guarded by any one of them can refuse older
    /// writers).
    ///
    /// A lock of several has no place in this client's local queue (its
    /// threads meet at the nodes); its waiters are woken by a release of
    /// any of its resources (of a set of at most 64). A lock of one
    /// resource is [`try_lock`](Self::try_lock)'s.
    ///
    /// Each round of a set (the acquire, the release, each extension) waits
    /// for a node the [`node_timeout`](crate::Builder::node_timeout), one
    /// more per 200 resources: a node runs them all in one script. The
    /// most the bounds admit, 8,256 names of one or two bytes, get 42 node
    /// timeouts (2.1 s with the defaults), which only a round that cannot
    /// settle without a slow node waits out; the lock's validity counts the
    /// round as always.
    ///
    /// ```no_run
    /// # use std::time::Duration;
    /// # let locks = quorumlock::Redlock::builder().node("redis://127.0.0.1:6379").build()?;
    /// let both = locks.lock_all(&["sku:1042", "sku:2210"], Duration::from_secs(10))?;
    /// // ... move stock from one to the other ...
    /// both.release()?;
    /// # Ok::<(), quorumlock::Error>(())
    /// ```
    ///
    /// # Errors
    /// As [`try_lock`](Self::try_lock) ([`Error::Taken`] where a majority
    /// had any of them taken), and [`Error::InvalidInput`] for no
    /// resources, one listed twice, or names longer in all than
    /// [`MAX_RESOURCES_LEN`](crate::MAX_RESOURCES_LEN).
    pub fn try_lock_all<S: AsRef<str>>(&self, resources: &[S], ttl: Duration) -> Result<LockGuard> {
        self.acquire_all(resources, ttl, Budget::Attempts(1))
    }

    /// [`try_lock_all`](Self::try_lock_all), retried as [`lock`](Self::lock)
    /// retries, woken by a release of any of the resources (those tries
    /// are not counted: they are hints). Its bound is `lock`'s with a set's
    /// round in place of the node timeout.
    ///
    /// # Errors
    /// As [`try_lock_all`](Self::try_lock_all).
    pub fn lock_all<S: AsRef<str>>(&self, resources: &[S], ttl: Duration) -> Result<LockGuard> {
        let attempts = self.engine.settings.retry_count;
        self.acquire_all(resources, ttl, Budget::Attempts(attempts))
    }

    /// [`try_lock_all`](Self::try_lock_all), retried until `wait` has
    /// passed, as [`lock_timeout`](Self::lock_timeout) retries.
    ///
    /// # Errors
    /// As [`try_lock_all`](Self::try_lock_all).
    pub fn lock_all_timeout<S: AsRef<str>>(
        &self,
        resources: &[S],
        ttl: Duration,
        wait: Duration,
    ) -> Result<LockGuard> {
        let until = after(self.engine.clock.now(), wait);
        self.acquire_all(resources, ttl, Budget::Until(until))
    }

    /// [`with_lock`](Self::with_lock) over every one of `resources`, taken
    /// as [`lock_all`](Self::lock_all) takes them.
    ///
    /// # Errors
    /// As [`lock_all`](Self::lock_all), then as [`with_lock`](Self::with_lock).
    pub fn with_lock_all<S: AsRef<str>, T>(
        &self,
        resources: &[S],
        ttl: Duration,
        f: impl FnOnce(&LockGuard) -> T,
    ) -> Result<T> {
        run_with(self.lock_all(resources, ttl)?, f)
    }

    /// Makes one attempt to take `resource` for reading, for `ttl`: shared
    /// with other readers, excluded by a writer.
    ///
    /// A writer is any exclusive lock of the resource: [`try_lock`](Self::try_lock),
    /// [`lock`](Self::lock) and the other exclusive calls, of which
    /// [`write_lock`](Self::write_lock) and its kin are other names. On each
    /// node a reader enters the key's set of readers, each with its own
    /// expiry (a reader that crashed drops out at its TTL), unless a writer
    /// holds the key or waits for it: a writer that waits (every call but
    /// `try_lock`) keeps new readers out until it gets in, so that a
    /// stream of readers cannot starve it. A read lock is held, as any
    /// lock, with a majority of such votes within its validity; any reader
    /// majority and any writer majority share a node, where the two
    /// cannot be at once. The guard releases, extends, renews and loses it
    /// as any guard; it has no fencing token and no place in this client's
    /// local queue (readers share: each meets the nodes).
    ///
    /// ```no_run
    /// # use std::time::Duration;
    /// # let locks = quorumlock::Redlock::builder().node("redis://127.0.0.1:6379").build()?;
    /// let a = locks.try_read_lock("report:2026", Duration::from_secs(10))?;
    /// let b = locks.try_read_lock("report:2026", Duration::from_secs(10))?; // shared
    /// assert!(a.is_read() && b.is_read());
    /// assert!(locks.try_write_lock("report:2026", Duration::from_secs(10)).is_err());
    /// # Ok::<(), quorumlock::Error>(())
    /// ```
    ///
    /// # Errors
    /// As [`try_lock`](Self::try_lock): [`Error::Taken`] where a writer
    /// holds the resource, or waits for it, on a majority.
    pub fn try_read_lock(&self, resource: &str, ttl: Duration) -> Result<LockGuard> {
        self.acquire_read(resource, ttl, Budget::Attempts(1))
    }

    /// [`try_read_lock`](Self::try_read_lock), retried as [`lock`](Self::lock)
    /// retries, woken by a writer's release (every reader of this client
    /// that waits at once; those tries are hints, not counted as attempts).
    ///
    /// # Errors
    /// As [`try_read_lock`](Self::try_read_lock).
    pub fn read_lock(&self, resource: &str, ttl: Duration) -> Result<LockGuard> {
        let attempts = self.engine.settings.retry_count;
        self.acquire_read(resource, ttl, Budget::Attempts(attempts))
    }

    /// [`try_read_lock`](Self::try_read_lock), retried until `wait` has
    /// passed, as [`lock_timeout`](Self::lock_timeout) retries.
    ///
    /// # Errors
    /// As [`try_read_lock`](Self::try_read_lock).
    pub fn read_lock_timeout(
        &self,
        resource: &str,
        ttl: Duration,
        wait: Duration,
    ) -> Result<LockGuard> {
        let until = after(self.engine.clock.now(), wait);
        self.acquire_read(resource, ttl, Budget::Until(until))
    }

    /// [`with_lock`](Self::with_lock) for a reader: takes `resource` as
    /// [`read_lock`](Self::read_lock) does, renews it while `f` runs,
    /// releases it afterwards.
    ///
    /// # Errors
    /// As [`read_lock`](Self::read_lock), then as [`with_lock`](Self::with_lock).
    pub fn with_read_lock<T>(
        &self,
        resource: &str,
        ttl: Duration,
        f: impl FnOnce(&LockGuard) -> T,
    ) -> Result<T> {
        run_with(self.read_lock(resource, ttl)?, f)
    }

    /// [`try_lock`](Self::try_lock) by the name a reader-writer pair reads
    /// best with: every exclusive lock excludes readers, and readers
    /// exclude it (see [`try_read_lock`](Self::try_read_lock)).
    ///
    /// # Errors
    /// As [`try_lock`](Self::try_lock).
    pub fn try_write_lock(&self, resource: &str, ttl: Duration) -> Result<LockGuard> {
        self.try_lock(resource, ttl)
    }

    /// [`lock`](Self::lock), by its reader-writer name: while it waits, no
    /// new reader gets in (see [`try_read_lock`](Self::try_read_lock)).
    ///
    /// # Errors
    /// As [`lock`](Self::lock).
    pub fn write_lock(&self, resource: &str, ttl: Duration) -> Result<LockGuard> {
        self.lock(resource, ttl)
    }

    /// [`lock_timeout`](Self::lock_timeout), by its reader-writer name.
    ///
    /// # Errors
    /// As [`lock_timeout`](Self::lock_timeout).
    pub fn write_lock_timeout(
        &self,
        resource: &str,
        ttl: Duration,
        wait: Duration,
    ) -> Result<LockGuard> {
        self.lock_timeout(resource, ttl, wait)
    }

    /// [`with_lock`](Self::with_lock), by its reader-writer name.
    ///
    /// # Errors
    /// As [`with_lock`](Self::with_lock).
    pub fn with_write_lock<T>(
        &self,
        resource: &str,
        ttl: Duration,
        f: impl FnOnce(&LockGuard) -> T,
    ) -> Result<T> {
        self.with_lock(resource, ttl, f)
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
    /// [`Error::InvalidInput`] for a resource name [`lock`](Self::lock)
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
    /// [`Error::InvalidInput`] for a key [`lock`](Self::lock) would refuse.
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

    /// A guard for a held lock, renewed when the client renews every lock.
    fn guard(&self, state: Arc<LockState>, turn: Option<Turn>) -> LockGuard {
        if let Some(turn) = &turn {
            // Local waiters wait for this lock, not for its guard.
            turn.set_holder(&state);
        }
        let guard = LockGuard::new(self.engine.clone(), state, turn);
        if self.engine.settings.auto_renew {
            guard.auto_renew();
        }
        guard
    }

    fn acquire(&self, resource: &str, ttl: Duration, budget: Budget) -> Result<LockGuard> {
        let (state, turn) = self
            .engine
            .acquire(Want::write(resource, &[], ttl), budget)?;
        Ok(self.guard(state, turn))
    }

    fn acquire_read(&self, resource: &str, ttl: Duration, budget: Budget) -> Result<LockGuard> {
        let want = Want {
            read: true,
            ..Want::write(resource, &[], ttl)
        };
        let (state, turn) = self.engine.acquire(want, budget)?;
        Ok(self.guard(state, turn))
    }

    fn acquire_all<S: AsRef<str>>(
        &self,
        resources: &[S],
        ttl: Duration,
        budget: Budget,
    ) -> Result<LockGuard> {
        let names = crate::lock::engine::validate_resources(resources)?;
        let Some((first, also)) = names.split_first() else {
            return Err(crate::InvalidInput::NoResources.into());
        };
        let (state, turn) = self.engine.acquire(Want::write(first, also, ttl), budget)?;
        Ok(self.guard(state, turn))
    }
}

/// Runs `f` under `guard`, renewed, then releases it (see
/// [`Redlock::with_lock`]).
fn run_with<T>(guard: LockGuard, f: impl FnOnce(&LockGuard) -> T) -> Result<T> {
    guard.auto_renew();
    let state = guard.state().clone();
    let out = f(&guard);
    let lost = guard.lost().try_recv().ok();
    // Judged by the deadline itself, whatever the watchdog has seen yet:
    // work that ended past it ran without the lock's guarantee (the keys
    // may still be ours on the nodes: they outlive validity by the drift
    // allowance).
    let in_time = guard.is_held();
    match (guard.release(), lost) {
        (_, Some(reason)) => Err(reason),
        (_, None) if !in_time => Err(Error::Expired),
        (Ok(()), None) => Ok(out),
        (Err(e @ (Error::Expired | Error::NotOwner { .. })), None) => Err(e),
        (Err(e), None) => {
            // Held to the end; the keys left behind expire with the TTL.
            debug!("with_lock {:?}: release: {e}", state.resource);
            Ok(out)
        }
    }
}
