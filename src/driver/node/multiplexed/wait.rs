//! How rounds on multiplexed connections wait: one of the client's waiting rounds reads every
//! multiplexed connection that owes replies (see [`super::role`]), the others sleep until a
//! reply is theirs; each until its own deadline.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::role::wait_id;
use super::{Multiplexed, Role, RoundConn, Wake};
use crate::clock::after;
use crate::driver::node::link::Link;
use crate::driver::node::node_round::NodeRound;

/// How a client's threads block while their rounds wait on multiplexed connections.
pub(crate) trait Await<C: Link> {
    /// Now.
    fn clock_now(&self) -> Instant;
    /// The client's reader role.
    fn role(&self) -> &Role<C>;
    /// What wakes this thread.
    fn waker(&self) -> Option<Arc<dyn Wake>>;
    /// A mark taken before looking at the mailboxes: a wake after it ends
    /// the next [`block`](Self::block).
    fn mark(&self) -> u64;
    /// Blocks until one of `lines` (which this thread reads) has something
    /// to read, or this thread is woken, or `until`; reads what arrived on
    /// each of `lines` ([`Multiplexed::pump`]).
    fn block(&self, lines: &[Arc<Multiplexed<C>>], until: Instant, mark: u64);
}

/// [`Links::wait_ready`](crate::driver::node::links::Links::wait_ready) for
/// rounds on multiplexed connections: waits at most `wait` until `need` parts awaiting a
/// reply have one (or their multiplexed connection's end) in their mailboxes, reading every
/// line of the client that owes replies while it holds the reader role.
/// The round is not woken for fewer replies than it needs.
pub(crate) fn wait_ready<C: Link>(
    a: &impl Await<C>,
    parts: &[NodeRound<RoundConn<C>>],
    wait: Duration,
    need: usize,
    ready: &mut Vec<(usize, ())>,
) {
    let until = after(a.clock_now(), wait);
    let id = wait_id();
    // However this wait ends (a panic in a late reply's rules too), it
    // holds the reader role no longer and sleeps no more.
    let _leave = Leave { role: a.role(), id };
    let waker = a.waker();
    let mut waiting: Vec<&RoundConn<C>> = Vec::with_capacity(parts.len());
    loop {
        let mark = a.mark();
        let count = waker.as_ref().and_then(|w| w.replies());
        if let Some(c) = count {
            c.recount();
        }
        let last = wait.is_zero() || a.clock_now() >= until;
        waiting.clear();
        ready.clear();
        for (i, s) in parts.iter().enumerate() {
            let Some(c) = s.conn.as_ref() else { continue };
            if !c.wire.awaits_wanted() {
                continue;
            }
            if last {
                // At its deadline a round reads for itself.
                c.line.pump(None);
                if c.line.has_news(c.id) {
                    ready.push((i, ()));
                }
                continue;
            }
            if c.line.watch(c.id) {
                ready.push((i, ()));
            } else {
                waiting.push(c);
            }
        }
        // All of them, if fewer can come.
        let need = need.min(ready.len() + waiting.len()).max(1);
        let more = need.saturating_sub(ready.len());
        if more == 0 || last {
            for c in &waiting {
                c.line.unwatch(c.id);
            }
            return;
        }
        // Replies counted since the look: look again.
        if !count.is_some_and(|c| c.expect(more)) {
            // Commands staged too long go out now; the wait ends when the
            // next would be due.
            let mut wake_at = until;
            let now = a.clock_now();
            for c in &waiting {
                if let Some(due) = c.line.write_stale(now) {
                    wake_at = wake_at.min(due);
                }
            }
            let lines = if a.role().take(id, waker.as_ref()) {
                a.role().owing()
            } else {
                Vec::new()
            };
            a.block(&lines, wake_at, mark);
        }
        for c in &waiting {
            c.line.unwatch(c.id);
        }
    }
}

/// Ends a wait's part in the reader role when the wait ends.
struct Leave<'a, C: Link> {
    role: &'a Role<C>,
    id: u64,
}

impl<C: Link> Drop for Leave<'_, C> {
    fn drop(&mut self) {
        self.role.leave(self.id);
    }
}
