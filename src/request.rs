//! [`LockRequest`]: what to lock, how, and how long to wait: the one path
//! every lock call takes.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::clock::after;
use crate::guard::LockGuard;
use crate::lock::engine::{Budget, Engine, Want};
use crate::Result;

/// A lock to take: its resources, its kind and its TTL, made by
/// [`Redlock::request`](crate::Redlock::request) and taken by one of its `acquire` calls, which say
/// how long to wait.
///
/// * [`and`](Self::and) adds a resource: a lock of several, taken all or
///   none.
/// * [`read`](Self::read) asks for a read lock, shared with other readers.
///
/// ```no_run
/// # use std::time::Duration;
/// # let locks = quorumlock::Redlock::builder().node("redis://127.0.0.1:6379").build()?;
/// let ttl = Duration::from_secs(10);
/// let report = locks.request("report:2026", ttl).read().try_acquire()?;
/// let stock = locks.request("sku:1042", ttl).and("sku:2210").acquire()?;
/// # Ok::<(), quorumlock::Error>(())
/// ```
#[must_use = "a request does nothing until one of its `acquire` calls"]
#[derive(Clone)]
pub struct LockRequest<'a> {
    engine: &'a Arc<Engine>,
    resource: &'a str,
    also: Vec<String>,
    ttl: Duration,
    read: bool,
    /// An election's candidate (see [`crate::election`]): its id,
    /// hex-encoded; empty for a lock.
    tag: &'a str,
}

impl fmt::Debug for LockRequest<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockRequest")
            .field("resource", &self.resource)
            .field("also", &self.also)
            .field("ttl", &self.ttl)
            .field("read", &self.read)
            .finish()
    }
}

impl<'a> LockRequest<'a> {
    pub(crate) fn new(engine: &'a Arc<Engine>, resource: &'a str, ttl: Duration) -> Self {
        LockRequest {
            engine,
            resource,
            also: Vec::new(),
            ttl,
            read: false,
            tag: "",
        }
    }

    /// A candidate's request: fenced, its id (hex) in its token.
    pub(crate) fn candidate(mut self, tag: &'a str) -> Self {
        self.tag = tag;
        self
    }

    /// Adds `resource` to the lock: the lock is of every resource named, as
    /// one, all of them or none.
    ///
    /// On each node one script sets every resource's key or none (a node
    /// where any is taken sets nothing), so each node votes for the whole
    /// set, and the lock is held, as any lock, with a majority of votes.
    /// The guard releases, extends, renews and loses them together; its
    /// [`resource`](LockGuard::resource) is the first. Locks of overlapping
    /// sets exclude each other and never deadlock: no client ever holds
    /// part of a set. With [`fencing`](crate::Builder::fencing), the guard's
    /// one token is above the last token of every resource in the set, and
    /// is written back to each.
    ///
    /// A lock of several has no place in this client's local queue (its
    /// threads meet at the nodes); its waiters are woken by a release of
    /// any of its resources (of a set of at most 64). Each of its rounds
    /// waits for a node one [`node_timeout`](crate::Builder::node_timeout)
    /// more per 200 resources: a node runs them all in one script.
    ///
    /// The acquire calls refuse, with [`Error::InvalidInput`](crate::Error::InvalidInput),
    /// a resource named twice and names longer in all than
    /// [`MAX_RESOURCES_LEN`](crate::MAX_RESOURCES_LEN).
    pub fn and(mut self, resource: impl Into<String>) -> Self {
        self.also.push(resource.into());
        self
    }

    /// Asks for a read lock: shared with other readers, excluded by a
    /// writer (any other lock of the resource).
    ///
    /// On each node a reader enters the key's set of readers, each with its
    /// own expiry (a reader that crashed drops out at its TTL), unless a
    /// writer holds the key or waits for it: a writer that waits (any
    /// acquire call but [`try_acquire`](Self::try_acquire)) keeps new
    /// readers out until it gets in, so that a stream of readers cannot
    /// starve it. Any reader majority and any writer majority share a node,
    /// where the two cannot be at once. A read lock has no fencing token
    /// and no place in the local queue; its waiters are woken by a writer's
    /// release.
    ///
    /// A read lock is of one resource: the acquire calls refuse a read lock
    /// of several with [`InvalidInput::ReadOfSeveral`](crate::InvalidInput::ReadOfSeveral).
    pub fn read(mut self) -> Self {
        self.read = true;
        self
    }

    /// Makes one attempt.
    ///
    /// # Errors
    /// [`Error::Taken`](crate::Error::Taken) when another owner holds a
    /// resource (for a reader: a writer holds it or waits for it) on a
    /// majority, [`Error::NoQuorum`](crate::Error::NoQuorum) when too many
    /// nodes failed, [`Error::ValidityExhausted`](crate::Error::ValidityExhausted)
    /// when the round was too slow for the TTL,
    /// [`Error::InvalidInput`](crate::Error::InvalidInput) for a bad
    /// resource name or TTL, or a read lock of several.
    pub fn try_acquire(self) -> Result<LockGuard> {
        self.take(Budget::Attempts(1))
    }

    /// Makes up to [`retry_count`](crate::Builder::retry_count) attempts
    /// with a jittered pause between them, cut short when another client's
    /// release of the resource wakes it (after its first failed attempt it
    /// subscribes to the key's releases and tries once more; see the guide
    /// on waiting). A subscribed waiter also tries in between, at the
    /// moment the owner's keys expire and at least once a second; those
    /// tries are not counted.
    ///
    /// Waits at most `retry_count × (retry_delay + retry_jitter +
    /// node_timeout)` in all (750 ms with the defaults), queueing behind
    /// threads of this process included, plus at most two node timeouts
    /// (the last attempt's round and the delete of what it may have set;
    /// three with [`fencing`](crate::Builder::fencing)).
    ///
    /// # Errors
    /// As [`try_acquire`](Self::try_acquire), the last attempt's.
    pub fn acquire(self) -> Result<LockGuard> {
        let attempts = self.engine.settings.retry_count;
        self.take(Budget::Attempts(attempts))
    }

    /// Retries as [`acquire`](Self::acquire) does until it succeeds or
    /// `wait` has passed (at least one attempt is made), within `wait` plus
    /// the node timeouts `acquire` adds to its own bound.
    ///
    /// # Errors
    /// As [`try_acquire`](Self::try_acquire), the last attempt's; or
    /// [`Error::Taken`](crate::Error::Taken) where another thread of this
    /// process held the lock until the wait ran out (it hands its lock over
    /// to the next thread in line, and one that comes too late is not
    /// taken).
    pub fn acquire_for(self, wait: Duration) -> Result<LockGuard> {
        let until = after(self.engine.clock.now(), wait);
        self.take(Budget::Until(until))
    }

    /// Retries as [`acquire`](Self::acquire) does until it succeeds or
    /// `deadline` has passed (at least one attempt is made).
    ///
    /// # Errors
    /// As [`acquire_for`](Self::acquire_for).
    pub fn acquire_until(self, deadline: Instant) -> Result<LockGuard> {
        self.take(Budget::Until(deadline))
    }

    pub(crate) fn take(self, budget: Budget) -> Result<LockGuard> {
        let engine = self.engine;
        let want = Want {
            resource: self.resource,
            also: &self.also,
            ttl: self.ttl,
            read: self.read,
            fenced: !self.read && (engine.settings.fencing || !self.tag.is_empty()),
            tag: self.tag,
        };
        let (state, turn) = engine.acquire(want, budget)?;
        if let Some(turn) = &turn {
            // Local waiters wait for this lock, not for its guard.
            turn.set_holder(&state);
        }
        let guard = LockGuard::new(engine.clone(), state, turn);
        if engine.settings.auto_renew {
            guard.auto_renew();
        }
        Ok(guard)
    }
}
