//! The production [`Links`]: one r2d2 pool of non-blocking sockets per
//! node, waited on with `poll(2)`.

#[cfg(not(any(target_os = "linux", target_os = "android")))]
use std::io::{Read as _, Write as _};
#[cfg(not(any(target_os = "linux", target_os = "android")))]
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use r2d2::PooledConnection;
use redis::Value;

use crate::algorithm::quorum::VoteRules;
use crate::algorithm::round::Key;
use crate::driver::conn::{self, PollFlags};
use crate::driver::conn_state::{ConnState, InFlight};
use crate::driver::node::link::Link;
use crate::driver::node::links::Links;
use crate::driver::node::multiplexed::{self, Await, Multiplexed, ReplyCount, RoundConn, Wake};
use crate::driver::node::node_round::NodeRound;
use crate::driver::node::replies::catch_up;
use crate::driver::node::state::{Manager, NodeState};
use crate::driver::node::{RedisTransport, CONN_RECHECK};

pub(crate) use crate::driver::node::state::Pooled;

impl Link for Pooled {
    type Ready = PollFlags;
    type Handle = Arc<std::net::TcpStream>;

    fn handle(&self) -> Option<Arc<std::net::TcpStream>> {
        self.poll_handle()
    }

    fn wire(&self) -> &ConnState {
        &self.wire
    }

    fn wire_mut(&mut self) -> &mut ConnState {
        &mut self.wire
    }

    fn flush(&mut self) -> std::io::Result<()> {
        conn::Conn::flush(self)
    }

    fn on_ready(&mut self, ready: PollFlags) -> std::io::Result<()> {
        conn::Conn::on_ready(self, ready)
    }

    fn next_reply(&mut self) -> std::io::Result<Option<(InFlight, Value)>> {
        conn::Conn::next_reply(self)
    }

    fn wants_write(&self) -> bool {
        conn::Conn::wants_write(self)
    }

    fn read_all(&mut self) -> std::io::Result<()> {
        conn::Conn::fill(self, true)
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
        let node = &self.nodes[i];
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

    /// This thread's round on node `i`'s current multiplexed connection, or on a new one over
    /// the connection `fresh` gives.
    fn share(
        &self,
        i: usize,
        now: Instant,
        fresh: impl FnOnce() -> Option<Pooled>,
    ) -> Option<RoundConn<Pooled>> {
        let node = &self.nodes[i];
        let waker = thread_waker().map(|w| w as Arc<dyn Wake>);
        multiplexed::join(&node.line, &node.shared, &self.role, waker, now, || {
            if self.line_starting(i, now) {
                // A connection for the multiplexed connection is on its way: an idle one is
                // taken, none is started.
                let mut c = node.pool.try_get()?;
                return catch_up(&mut c, &node.shared, now).then_some(c);
            }
            let c = fresh();
            if c.is_none() {
                *node.line_started.lock() = Some(now);
            }
            c
        })
    }

    /// Whether a connection for node `i`'s multiplexed connection was started less than a
    /// node timeout ago.
    fn line_starting(&self, i: usize, now: Instant) -> bool {
        self.nodes[i]
            .line_started
            .lock()
            .is_some_and(|t| now.saturating_duration_since(t) < self.timeout)
    }
}

/// Wakes a thread blocked in `poll(2)`: a count on an `eventfd` it polls
/// (a byte on a socket pair where there is no `eventfd`).
struct PipeWaker {
    #[cfg(any(target_os = "linux", target_os = "android"))]
    rx: std::os::fd::OwnedFd,
    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    rx: UnixStream,
    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    tx: UnixStream,
    /// A wake is (or is about to be) on its way.
    armed: AtomicBool,
    /// Replies read for the thread's round (see [`Wake::replies`]).
    count: ReplyCount,
}

impl PipeWaker {
    #[cfg(any(target_os = "linux", target_os = "android"))]
    fn new() -> std::io::Result<Self> {
        use rustix::event::{eventfd, EventfdFlags};
        let rx = eventfd(0, EventfdFlags::NONBLOCK | EventfdFlags::CLOEXEC)?;
        Ok(PipeWaker {
            rx,
            armed: AtomicBool::new(false),
            count: ReplyCount::default(),
        })
    }

    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    fn new() -> std::io::Result<Self> {
        let (tx, rx) = UnixStream::pair()?;
        tx.set_nonblocking(true)?;
        rx.set_nonblocking(true)?;
        Ok(PipeWaker {
            tx,
            rx,
            armed: AtomicBool::new(false),
            count: ReplyCount::default(),
        })
    }

    /// Takes the wakes that arrived.
    fn drain(&self) {
        // Read first, then disarm: a wake after this signals again, and one
        // before it is seen by the caller's look at its mailboxes (made
        // after every wait).
        let mut buf = [0u8; 64];
        #[cfg(any(target_os = "linux", target_os = "android"))]
        let _ = rustix::io::read(&self.rx, &mut buf[..8]);
        #[cfg(not(any(target_os = "linux", target_os = "android")))]
        while let Ok(n) = (&self.rx).read(&mut buf) {
            if n == 0 {
                break;
            }
        }
        self.armed.store(false, Ordering::Release);
    }

    /// Signals the thread.
    fn signal(&self) {
        #[cfg(any(target_os = "linux", target_os = "android"))]
        let _ = rustix::io::write(&self.rx, &1u64.to_ne_bytes());
        #[cfg(not(any(target_os = "linux", target_os = "android")))]
        let _ = (&self.tx).write(&[1]);
    }
}

impl Wake for PipeWaker {
    fn wake(&self) {
        if !self.armed.swap(true, Ordering::AcqRel) {
            self.signal();
        }
    }

    fn replies(&self) -> Option<&ReplyCount> {
        Some(&self.count)
    }

    fn is_current(&self) -> bool {
        WAKER
            .try_with(|w| w.as_ref().is_some_and(|w| std::ptr::eq(&**w, self)))
            .unwrap_or(false)
    }
}

thread_local! {
    /// This thread's waker, made at its first round (none if the socket
    /// pair cannot be made: the thread then looks again every
    /// [`UNWOKEN`]).
    static WAKER: Option<Arc<PipeWaker>> = PipeWaker::new().ok().map(Arc::new);
}

fn thread_waker() -> Option<Arc<PipeWaker>> {
    // None while the thread's locals are torn down (a guard dropped then).
    WAKER.try_with(Clone::clone).ok().flatten()
}

/// How often a thread that cannot be woken (or reads a multiplexed connection it cannot
/// poll) looks again.
const UNWOKEN: Duration = Duration::from_millis(1);

impl Await<Pooled> for RedisTransport {
    fn clock_now(&self) -> Instant {
        Instant::now()
    }

    fn role(&self) -> &multiplexed::Role<Pooled> {
        &self.role
    }

    fn waker(&self) -> Option<Arc<dyn Wake>> {
        thread_waker().map(|w| w as Arc<dyn Wake>)
    }

    fn mark(&self) -> u64 {
        // The waker's byte stays until drained: no wake is missed.
        0
    }

    fn block(&self, lines: &[Arc<Multiplexed<Pooled>>], until: Instant, _mark: u64) {
        let waker = thread_waker();
        let mut wait = until.saturating_duration_since(Instant::now());
        let mut fds = Vec::with_capacity(lines.len() + 1);
        let mut polled = Vec::with_capacity(lines.len());
        let mut unpolled = Vec::new();
        for l in lines {
            match &l.handle {
                Some(h) => {
                    let mut flags = PollFlags::IN;
                    if l.wants_write() {
                        flags |= PollFlags::OUT;
                    }
                    fds.push(conn::PollFd::new(&**h, flags));
                    polled.push(l);
                }
                None => {
                    wait = wait.min(UNWOKEN);
                    unpolled.push(l);
                }
            }
        }
        match &waker {
            Some(w) => fds.push(conn::PollFd::new(&w.rx, PollFlags::IN)),
            None => wait = wait.min(UNWOKEN),
        }
        if conn::poll(&mut fds, wait).is_err() {
            std::thread::sleep(wait.min(CONN_RECHECK));
        }
        for (fd, l) in fds.iter().zip(&polled) {
            let r = fd.revents();
            if !r.is_empty() {
                l.pump(Some(r));
            }
        }
        for l in unpolled {
            l.pump(None);
        }
        if let (Some(w), Some(fd)) = (&waker, fds.last()) {
            if !fd.revents().is_empty() {
                w.drain();
            }
        }
    }
}

impl Links for RedisTransport {
    type Link = RoundConn<Pooled>;

    fn names(&self) -> &[String] {
        &self.names
    }

    fn node(&self, i: usize) -> &NodeState {
        &self.nodes[i].shared
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

    fn checkout(&self, i: usize, now: Instant) -> Option<RoundConn<Pooled>> {
        self.share(i, now, || self.take_pooled(i, now, false))
    }

    fn checkout_anyway(&self, i: usize, now: Instant) -> Option<RoundConn<Pooled>> {
        self.share(i, now, || self.take_pooled(i, now, true))
    }

    fn wait_for_free(&self, i: usize, deadline: Instant) -> Option<RoundConn<Pooled>> {
        if self.line_starting(i, Instant::now()) {
            // A connection for the multiplexed connection is on its way: waited for (in node
            // order, as a pool wait is) without starting one more.
            loop {
                if !self.nodes[i].shared.is_healthy() {
                    return None;
                }
                let now = Instant::now();
                if let Some(s) = self.share(i, now, || None) {
                    return Some(s);
                }
                if now >= deadline {
                    return None;
                }
                std::thread::sleep(CONN_RECHECK.min(deadline.saturating_duration_since(now)));
            }
        }
        let c = self.wait_pooled(i, deadline)?;
        self.share(i, Instant::now(), || Some(c))
    }

    fn pool_busy(&self, i: usize) -> Option<u32> {
        let pool = &self.nodes[i].pool;
        (pool.state().connections >= pool.max_size()).then_some(pool.max_size())
    }

    fn wait_ready(
        &self,
        parts: &[NodeRound<RoundConn<Pooled>>],
        wait: Duration,
        need: usize,
        ready: &mut Vec<(usize, ())>,
    ) {
        multiplexed::wait_ready(self, parts, wait, need, ready);
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

#[cfg(test)]
mod tests {
    use super::*;

    fn readable(w: &PipeWaker) -> bool {
        let mut fds = [conn::PollFd::new(&w.rx, PollFlags::IN)];
        conn::poll(&mut fds, Duration::ZERO).is_ok() && !fds[0].revents().is_empty()
    }

    /// A thread's own waker is its own; another thread's is not (a thread
    /// that reads its own reply sends itself no wake).
    #[test]
    fn a_waker_knows_its_own_thread() {
        let mine = thread_waker().expect("a waker");
        assert!(mine.is_current());
        let theirs = std::thread::spawn(|| thread_waker().expect("a waker"))
            .join()
            .expect("thread");
        assert!(!theirs.is_current());
    }

    /// Wakes are coalesced into one byte, a drain takes it, and a wake
    /// after the drain reaches the thread again.
    #[test]
    fn a_drained_waker_wakes_again() {
        let w = PipeWaker::new().expect("an eventfd");
        w.wake();
        w.wake();
        assert!(readable(&w));
        w.drain();
        assert!(!readable(&w), "drained");
        w.wake();
        assert!(readable(&w), "a wake after the drain is lost");
    }
}
