//! The production [`Links`]: one r2d2 pool of non-blocking sockets per
//! node, waited on with `poll(2)`.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use r2d2::PooledConnection;
use redis::Value;

use crate::algorithm::quorum::VoteRules;
use crate::algorithm::round::Key;
use crate::driver::conn::{self, PollFlags};
use crate::driver::node::link::Link;
use crate::driver::node::links::Links;
use crate::driver::node::part::Part;
use crate::driver::node::replies::catch_up;
use crate::driver::node::shared::{Manager, NodeShared};
use crate::driver::node::{RedisTransport, CONN_RECHECK};
use crate::driver::wire::{Pending, Wire};

/// A pooled connection to a node.
pub(crate) type Pooled = PooledConnection<Manager>;

impl Link for Pooled {
    type Ready = PollFlags;

    fn wire(&self) -> &Wire {
        &self.wire
    }

    fn wire_mut(&mut self) -> &mut Wire {
        &mut self.wire
    }

    fn flush(&mut self) -> std::io::Result<()> {
        conn::Conn::flush(self)
    }

    fn on_ready(&mut self, ready: PollFlags) -> std::io::Result<()> {
        conn::Conn::on_ready(self, ready)
    }

    fn next_reply(&mut self) -> std::io::Result<Option<(Pending, Value)>> {
        conn::Conn::next_reply(self)
    }

    fn wants_write(&self) -> bool {
        conn::Conn::wants_write(self)
    }

    fn read_all(&mut self) -> std::io::Result<()> {
        conn::Conn::fill_to_end(self)
    }

    fn abandon(&mut self) {
        conn::Conn::abandon(self);
    }
}

impl RedisTransport {
    /// A connection to a healthy node whose every connection is checked
    /// out, or whose idle ones the retry job holds for a moment: waits
    /// (until `deadline`) for one to come back. None when the node is not in
    /// that state (it is connecting, or failing).
    fn wait_pooled(&self, i: usize, deadline: Instant) -> Option<PooledConnection<Manager>> {
        let node = &self.nodes[i].inner;
        if !node.shared.is_healthy() {
            return None;
        }
        if node.shared.draining.load(Ordering::Acquire) {
            // The retry job gives them back as soon as it has read them.
        } else if let Some(mut c) = node.pool.try_get() {
            // Given back (by the retry job) since this round looked.
            return catch_up(&mut c, &node.shared, Instant::now()).then_some(c);
        } else if node.pool.state().connections < node.pool.max_size() {
            return None;
        }
        let wait = deadline.saturating_duration_since(Instant::now());
        let mut c = node.pool.get_timeout(wait).ok()?;
        catch_up(&mut c, &node.shared, Instant::now()).then_some(c)
    }
}

impl Links for RedisTransport {
    type Link = Pooled;

    fn names(&self) -> &[String] {
        &self.names
    }

    fn node(&self, i: usize) -> &NodeShared {
        &self.nodes[i].inner.shared
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
        Instant::now()
    }

    fn checkout(&self, i: usize, now: Instant) -> Option<Pooled> {
        self.take_pooled(i, now, false)
    }

    fn checkout_anyway(&self, i: usize, now: Instant) -> Option<Pooled> {
        self.take_pooled(i, now, true)
    }

    fn wait_for_free(&self, i: usize, deadline: Instant) -> Option<Pooled> {
        self.wait_pooled(i, deadline)
    }

    fn pool_busy(&self, i: usize) -> Option<u32> {
        let pool = &self.nodes[i].inner.pool;
        (pool.state().connections >= pool.max_size()).then_some(pool.max_size())
    }

    fn wait_ready(
        &self,
        parts: &[Part<Pooled>],
        wait: Duration,
        writes: bool,
        ready: &mut Vec<(usize, PollFlags)>,
    ) {
        // Allocated only when some connection is still owed a reply.
        let mut fds = Vec::new();
        let mut idx = Vec::new();
        for (i, s) in parts.iter().enumerate() {
            if let Some(c) = s.conn.as_ref().filter(|c| c.wire.awaits_wanted()) {
                fds.push(c.poll_fd(writes && c.wants_write()));
                idx.push(i);
            }
        }
        if fds.is_empty() {
            if !wait.is_zero() {
                std::thread::sleep(wait);
            }
            return;
        }
        if conn::poll(&mut fds, wait).is_err() {
            if !wait.is_zero() {
                std::thread::sleep(wait.min(CONN_RECHECK));
            }
            return;
        }
        for (fd, &i) in fds.iter().zip(&idx) {
            let r = fd.revents();
            if !r.is_empty() {
                ready.push((i, r));
            }
        }
    }

    fn retry_later(&self, i: usize, keys: &[Key<'_>], until: Instant) {
        self.enqueue_retries(i, keys, until);
    }

    fn write_later(
        &self,
        i: usize,
        k: &Key<'_>,
        ttl: Duration,
        known_max: Duration,
        start: Instant,
    ) {
        RedisTransport::write_later(self, i, k, ttl, known_max, start);
    }
}
