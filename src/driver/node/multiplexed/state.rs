//! What a multiplexed connection does under its lock: carry commands onto the connection,
//! read and route replies, end, give up.

use std::io;
use std::sync::Arc;
use std::time::Instant;

use super::sync::Mutex;
use redis::Value;

#[cfg(test)]
use super::count;
use super::{Owner, Pipeline, ReplyCount, State, Wake};
use crate::driver::conn_state::{is_given_up, ConnState, InFlight, Owed};
use crate::driver::node::link::Link;
use crate::driver::node::replies::{late_reply, late_reply_on};
use crate::driver::node::state::NodeState;

impl<C> State<C>
where
    C: Link,
{
    pub(super) fn owner(&mut self, id: u64) -> Option<&mut Owner> {
        self.owners.iter_mut().find(|o| o.id == id)
    }

    /// Carries what `wire` (owner `id`'s) has queued onto the connection.
    pub(super) fn carry(&mut self, id: u64, wire: &mut ConnState) {
        let mut bytes = Vec::new();
        let mut cmds = Vec::new();
        if wire.take_uncarried(&mut bytes, |o| cmds.push((id, o))) > 0 || !bytes.is_empty() {
            self.carry_staged(&bytes, cmds.into_iter());
        }
    }

    /// Carries commands onto the connection: their bytes, and per command
    /// its owner, when it was queued and how many keys it names.
    pub(super) fn carry_staged(&mut self, bytes: &[u8], cmds: impl Iterator<Item = (u64, Owed)>) {
        let owners = &mut self.owners;
        let counted = cmds.inspect(|&(id, _)| {
            if let Some(o) = owners.iter_mut().find(|o| o.id == id) {
                // Staged until now, if it was (see `State::in_flight`).
                o.staged = o.staged.saturating_sub(1);
                o.owed += 1;
            }
        });
        self.conn.wire_mut().carry(bytes, counted);
    }

    /// Carries what rounds staged (see [`Multiplexed::send`](super::Multiplexed::send)).
    /// Whether anything was.
    pub(super) fn drain(&mut self, staged: &Mutex<Pipeline>, _node: &NodeState) -> bool {
        // Under the stage's lock (a copy), so that its buffers are reused.
        let mut sg = staged.lock();
        if sg.bytes.is_empty() && sg.cmds.is_empty() {
            sg.since = None;
            return false;
        }
        #[cfg(test)]
        if sg.cmds.iter().any(|c| c.0 != sg.cmds[0].0) {
            count(&_node.line_stats.batched);
        }
        let Pipeline { bytes, cmds, since } = &mut *sg;
        self.carry_staged(bytes, cmds.drain(..));
        bytes.clear();
        *since = None;
        true
    }

    /// Writes what rounds staged (and what a full socket left unwritten);
    /// ends the multiplexed connection on an error.
    pub(super) fn write_staged(
        &mut self,
        staged: &Mutex<Pipeline>,
        node: &NodeState,
        wake: &mut Vec<Arc<dyn Wake>>,
    ) {
        if self.drain(staged, node) || self.conn.wants_write() {
            if let Err(e) = self.conn.flush() {
                wake.extend(self.close(&e));
            }
        }
    }

    /// Whether the connection owes replies or has bytes to write.
    pub(super) fn owes_reads(&self) -> bool {
        !self.conn.wire().pending().is_empty() || self.conn.wants_write()
    }

    /// Whether a batch is in flight: replies are owed and all of it is
    /// written. Whoever reads its last reply writes what was staged
    /// meanwhile in one write ([`State::next_batch`]), so the server reads
    /// it in one read: one batch in flight per connection.
    pub(super) fn in_flight(&self) -> bool {
        !self.conn.wire().pending().is_empty() && !self.conn.wants_write()
    }

    /// Whether round `id`'s commands wait staged: a batch is in flight and
    /// another round uses the multiplexed connection. A round alone on it (replies owed, if
    /// any, only to rounds that left: a single thread's stragglers) writes
    /// at once: waiting would cost it a round trip and batch nothing.
    pub(super) fn holds_back(&self, id: u64) -> bool {
        self.in_flight() && self.owners.iter().any(|o| o.id != id && o.orphan.is_none())
    }

    /// Writes what is staged, unless a batch is in flight.
    pub(super) fn next_batch(
        &mut self,
        staged: &Mutex<Pipeline>,
        node: &NodeState,
        wake: &mut Vec<Arc<dyn Wake>>,
    ) {
        if !self.in_flight() {
            self.write_staged(staged, node, wake);
        }
    }

    /// Ends the multiplexed connection: every owner still owed a reply gets `e`; wakers of
    /// every round on it are returned.
    pub(super) fn close(&mut self, e: &io::Error) -> Vec<Arc<dyn Wake>> {
        #[cfg(test)]
        if self.closed.is_none() && self.owners.iter().filter(|o| o.owes()).count() >= 2 {
            self.closed_batches = true;
        }
        if self.closed.is_none() {
            self.closed = Some((e.kind(), e.to_string(), is_given_up(e)));
        }
        self.conn.wire_mut().broken = true;
        // Late replies of rounds that left will not come.
        self.owners.retain(|o| o.orphan.is_none());
        self.owners.iter().filter_map(|o| o.waker.clone()).collect()
    }

    /// Gives the connection up (a reply owed past the node timeout): the
    /// undos and resends the node layer queues then go out first.
    pub(super) fn give_up(&mut self, now: Instant) {
        let ids: Vec<u64> = self
            .owners
            .iter()
            .filter(|o| o.orphan.is_some())
            .map(|o| o.id)
            .collect();
        for id in ids {
            let Some(mut w) = self.owner(id).and_then(|o| o.orphan.take()) else {
                continue;
            };
            if w.give_up(now) {
                self.carry(id, &mut w);
            }
            if let Some(o) = self.owner(id) {
                o.orphan = Some(w);
            }
        }
        self.conn.abandon();
    }

    /// Hands a reply read off the connection to its owner (a round that
    /// left: its late reply, taken here).
    pub(super) fn route(
        &mut self,
        node: &NodeState,
        (p, v): (InFlight, Value),
        now: Instant,
        wake: &mut Vec<Arc<dyn Wake>>,
    ) -> io::Result<()> {
        if p.owner == 0 {
            // The connection's own: sent at connect, or queued since by it.
            return late_reply_on(&mut self.conn, node, p, &v, now);
        }
        let Some(k) = self.owners.iter().position(|o| o.id == p.owner) else {
            return Err(self.conn.wire_mut().protocol_error("reply for no round"));
        };
        let o = &mut self.owners[k];
        o.owed = o.owed.saturating_sub(1);
        let Some(mut w) = o.orphan.take() else {
            let seq = self.conn.wire().facts_seq;
            let facts = (seq != o.facts_seq).then(|| self.conn.wire().facts());
            let o = &mut self.owners[k];
            o.facts_seq = seq;
            o.replies.push_back((v, facts));
            // The reader too: another thread may have read its reply (the
            // retry job, a round at its deadline, one joining), and its
            // poll would find the socket empty.
            if o.waiting {
                wake.extend(
                    o.waker
                        .clone()
                        .filter(|w| w.replies().is_none_or(ReplyCount::count)),
                );
            }
            return Ok(());
        };
        let own = w.answered()?;
        #[cfg(test)]
        count(&node.line_stats.orphan_replies);
        let queued = late_reply(&mut w, node, own, &v, now)?;
        let id = p.owner;
        if queued {
            self.carry(id, &mut w);
        }
        let done = w.pending().is_empty();
        if let Some(o) = self.owner(id) {
            if done && o.owed == 0 {
                self.owners.retain(|o| o.id != id);
            } else {
                o.orphan = Some(w);
            }
        }
        if queued {
            self.conn.flush()?;
        }
        Ok(())
    }

    /// Reads what arrived (what `ready` reports, or all there is), hands
    /// each reply to its owner, and ends the multiplexed connection on an error.
    pub(super) fn read(
        &mut self,
        node: &NodeState,
        ready: Option<C::Ready>,
        now: Instant,
        wake: &mut Vec<Arc<dyn Wake>>,
    ) {
        let mut io = match ready {
            Some(r) => self.conn.on_ready(r),
            None => self.conn.read_all(),
        }
        .err();
        if io.is_none() && self.conn.wants_write() {
            // What a full socket left unwritten goes on.
            io = self.conn.flush().err();
        }
        loop {
            match self.conn.next_reply() {
                Ok(Some(r)) => {
                    if let Err(e) = self.route(node, r, now, wake) {
                        io = Some(e);
                        break;
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    io = Some(e);
                    break;
                }
            }
        }
        if let Some(e) = io {
            wake.extend(self.close(&e));
        }
    }
}
