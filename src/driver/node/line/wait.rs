//! How rounds on lines wait: on their mailboxes, or (one round per line)
//! on the socket.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::{Line, Share, Watch};
use crate::clock::after;
use crate::driver::node::link::Link;
use crate::driver::node::part::Part;

/// How a client's threads block while their rounds wait on lines.
pub(crate) trait Await<C: Link> {
    /// Now.
    fn clock_now(&self) -> Instant;
    /// A mark taken before looking at the mailboxes: a wake after it ends
    /// the next [`block`](Self::block).
    fn mark(&self) -> u64;
    /// Blocks until one of `lines` (which this thread reads) has something
    /// to read, or this thread is woken, or `until`; reads what arrived on
    /// each of `lines` ([`Line::pump`]).
    fn block(&self, lines: &[&Line<C>], until: Instant, writes: bool, mark: u64);
}

/// [`Links::wait_ready`](crate::driver::node::links::Links::wait_ready) for
/// rounds on lines: waits at most `wait` until a part awaiting a reply has
/// one (or its line's end) in its mailbox, reading the socket of each line
/// no other round reads.
pub(crate) fn wait_ready<C: Link>(
    a: &impl Await<C>,
    parts: &[Part<Share<C>>],
    wait: Duration,
    writes: bool,
    ready: &mut Vec<(usize, ())>,
) {
    let until = after(a.clock_now(), wait);
    let mut mine: Vec<&Line<C>> = Vec::with_capacity(parts.len());
    let mut following: Vec<&Share<C>> = Vec::with_capacity(parts.len());
    loop {
        let mark = a.mark();
        let last = wait.is_zero() || a.clock_now() >= until;
        mine.clear();
        following.clear();
        for (i, s) in parts.iter().enumerate() {
            let Some(c) = s.conn.as_ref() else { continue };
            if !c.wire.awaits_wanted() {
                // It waits for nothing here: another round reads.
                if c.reading.swap(false, Ordering::AcqRel) {
                    c.line.resign(c.id);
                }
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
            match c.line.watch(c.id) {
                Watch::News => ready.push((i, ())),
                Watch::Reader => {
                    c.reading.store(true, Ordering::Release);
                    mine.push(&c.line);
                }
                Watch::Follower => following.push(c),
            }
        }
        if ready.is_empty() && !last {
            // A follower's commands staged too long go out now; the wait
            // ends when the next would be due.
            let mut wake_at = until;
            let now = a.clock_now();
            for c in &following {
                if let Some(due) = c.line.write_stale(now) {
                    wake_at = wake_at.min(due);
                }
            }
            a.block(&mine, wake_at, writes, mark);
        }
        for c in &following {
            if c.line.unwatch(c.id) {
                c.reading.store(true, Ordering::Release);
            }
        }
        if last || !ready.is_empty() {
            return;
        }
    }
}
