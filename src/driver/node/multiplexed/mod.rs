//! Connection sharing: the rounds of one client that overlap in time send
//! their commands to a node on one connection, a *multiplexed connection*.
//!
//! - Each round queues on its own [`ConnState`] (its [`RoundConn`], which the round
//!   sees as its connection: every node-layer rule runs on it unchanged).
//!   Flushing carries those bytes onto the multiplexed connection behind the
//!   others', with one entry per command that says whose reply it is; Redis
//!   answers one connection's commands in order, so the entries pair every
//!   reply with its owner.
//! - One batch in flight: commands sent while a multiplexed connection owes replies wait
//!   staged, and whoever reads the batch's last reply writes everything
//!   staged meanwhile in one write (the server reads it in one read). A
//!   round alone on an idle multiplexed connection writes at once.
//! - One waiting round of the client at a time, the *reader* (see
//!   [`role`]), waits on the sockets of every multiplexed connection that owes replies; it
//!   reads every reply that arrived and hands each to its owner's mailbox,
//!   waking the owner, who takes it on its own thread. No round waits for
//!   another's batch past its own deadline: it waits on its mailbox (or the
//!   sockets) until then, and at its deadline reads the socket itself.
//! - A round that ends with replies owed leaves its connection state to the multiplexed connection: the
//!   multiplexed connection reads those late replies for it, by the node layer's late-reply
//!   rules, as the next user of a pooled connection would (a multiplexed connection no round
//!   uses reads what arrived before it takes the next). A multiplexed connection stays
//!   between rounds; when it goes (the client is dropped), the connection
//!   goes back to its pool owing exactly what it owed, each entry its
//!   owner's own.
//! - A close, or a reply owed past the node timeout, ends the multiplexed connection for every
//!   owner at once: each gets the close (or the timeout) as its answer, and
//!   nothing is sent again but by the node layer's rules for a close.
//!
//! Production and the simulation run this same code; only how a thread
//! blocks ([`Await`]) differs.

use std::collections::VecDeque;
use std::io;
use std::sync::{Arc, Weak};
use std::time::Instant;

use redis::Value;
use sync::Mutex;

use crate::algorithm::health::Outcome;
use crate::driver::conn_state::{timed_out, ConnState, Facts, Owed};
use crate::driver::node::link::Link;
use crate::driver::node::replies::{ask_info_when_due, give_up_why, late_reply};
use crate::driver::node::state::{HeldEvents, NodeState};

/// What multiplexed connections did, for the simulation's coverage check.
#[cfg(test)]
#[derive(Debug, Default)]
pub(crate) struct MultiplexedStats {
    /// Writes that carried two rounds' commands or more.
    pub(crate) batched: std::sync::atomic::AtomicU64,
    /// Lines that ended with replies owed to two rounds or more.
    pub(crate) closed_batches: std::sync::atomic::AtomicU64,
    /// Late replies taken for rounds that had left.
    pub(crate) orphan_replies: std::sync::atomic::AtomicU64,
    /// Sends left staged behind a batch in flight.
    pub(crate) deferred: std::sync::atomic::AtomicU64,
}

#[cfg(test)]
fn count(n: &std::sync::atomic::AtomicU64) {
    n.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}

/// A round on the multiplexed connection, or (`orphan`) one that left owing replies.
struct Owner {
    id: u64,
    /// Replies read for it, not yet taken, each with what the connection
    /// knew of its server when it read it, if that changed since the last.
    replies: VecDeque<(Value, Option<Facts>)>,
    /// The connection's [`ConnState::facts_seq`] its last reply was read with.
    facts_seq: u64,
    /// Its commands on the connection whose replies have not been read.
    owed: usize,
    /// Its commands left staged behind a batch in flight (see
    /// [`State::in_flight`]): owed too, should the multiplexed connection end first.
    staged: usize,
    waker: Option<Arc<dyn Wake>>,
    /// Blocked waiting for its replies.
    waiting: bool,
    /// The connection state of a round that left, whose late replies the multiplexed connection takes.
    orphan: Option<ConnState>,
}

struct State<C> {
    conn: C,
    owners: Vec<Owner>,
    next_id: u64,
    /// Why the multiplexed connection ended, for every owner still owed a reply.
    closed: Option<(io::ErrorKind, String, bool)>,
    /// It ended with replies owed to two rounds or more.
    #[cfg(test)]
    closed_batches: bool,
}

/// A node's current multiplexed connection, kept between rounds.
pub(crate) type MultiplexedSlot<C> = Mutex<Option<Arc<Multiplexed<C>>>>;

/// Commands rounds queued for the multiplexed connection's next write, in order: their
/// bytes, per command its owner and when it was queued, and since when the
/// oldest waits.
#[derive(Default)]
struct Pipeline {
    bytes: Vec<u8>,
    cmds: Vec<(u64, Owed)>,
    since: Option<Instant>,
}

/// Longest a round's commands wait staged behind a batch in flight; then
/// the round writes them itself.
pub(crate) const STAGE_MAX: std::time::Duration = std::time::Duration::from_micros(1000);

/// One connection shared by rounds.
pub(crate) struct Multiplexed<C: Link> {
    state: Mutex<State<C>>,
    /// What rounds queued while another round wrote (or read): the next
    /// writer sends it all in one write.
    staged: Mutex<Pipeline>,
    node: Arc<NodeState>,
    /// What the client's reader waits on.
    pub(crate) handle: Option<C::Handle>,
    /// The client's reader role, told when the multiplexed connection comes to owe replies.
    role: Weak<Role<C>>,
    /// Where it is kept while it takes rounds.
    slot: Weak<MultiplexedSlot<C>>,
}

/// A round's place on a multiplexed connection: the connection as the round sees it.
pub(crate) struct RoundConn<C: Link> {
    line: Arc<Multiplexed<C>>,
    id: u64,
    wire: ConnState,
}

impl Owner {
    /// Whether a reply is owed to it (read or not, written or staged).
    fn owes(&self) -> bool {
        self.owed > 0 || self.staged > 0
    }
}

fn error_of((kind, text, given_up): &(io::ErrorKind, String, bool)) -> io::Error {
    if *given_up {
        return timed_out();
    }
    io::Error::new(*kind, text.clone())
}

fn wake_all(wake: Vec<Arc<dyn Wake>>) {
    for w in wake {
        if !w.is_current() {
            w.wake();
        }
    }
}

impl<C: Link> Multiplexed<C> {
    /// A multiplexed connection over `conn`, a connection to `node` whose late replies were
    /// read, read by `role`'s reader.
    pub(crate) fn new(
        conn: C,
        node: Arc<NodeState>,
        slot: Weak<MultiplexedSlot<C>>,
        role: Weak<Role<C>>,
    ) -> Arc<Self> {
        Arc::new(Multiplexed {
            handle: conn.handle(),
            role,
            state: Mutex::new(State {
                conn,
                owners: Vec::new(),
                next_id: 1,
                closed: None,
                #[cfg(test)]
                closed_batches: false,
            }),
            node,
            slot,
            staged: Mutex::default(),
        })
    }

    /// Takes the multiplexed connection out of its slot (if it is still there): it takes no
    /// new round, and goes when its last round does.
    fn unslot(&self) {
        let Some(slot) = self.slot.upgrade() else {
            return;
        };
        let mut current = slot.lock();
        if current.as_ref().is_some_and(|l| std::ptr::eq(&**l, self)) {
            let line = current.take();
            drop(current);
            drop(line);
        }
    }

    /// A new round on the multiplexed connection, woken by `waker`; None when the multiplexed connection cannot
    /// take a command: it closed, or is given up now by the node layer's
    /// rule for a connection in use (a reply owed past the node timeout),
    /// or it owes as many replies as a connection may (it goes on for its
    /// rounds; the new one takes another connection).
    fn admit(self: &Arc<Self>, waker: Option<Arc<dyn Wake>>, now: Instant) -> Option<RoundConn<C>> {
        let mut st = self.state.lock();
        if st.closed.is_some() {
            return None;
        }
        // What arrived is read first when no round reads the multiplexed connection (late
        // replies; a close while idle, which is no answer: not charged), and
        // before a reply is taken as overdue (it may be there, unread).
        let idle = st.owners.iter().all(|o| o.orphan.is_some());
        if idle || give_up_why(st.conn.wire(), &self.node, now).is_some() {
            let mut wake = Vec::new();
            st.read(&self.node, None, now, &mut wake);
            // The reply read may be the last of the batch in flight: what
            // waits staged goes out.
            if st.closed.is_none() {
                st.next_batch(&self.staged, &self.node, &mut wake);
            }
            let closed = st.closed.is_some();
            if closed {
                drop(st);
                wake_all(wake);
                return None;
            }
            // Rounds whose replies this read took.
            let wakers = std::mem::take(&mut wake);
            drop(st);
            wake_all(wakers);
            st = self.state.lock();
            if st.closed.is_some() {
                return None;
            }
        }
        match give_up_why(st.conn.wire(), &self.node, now) {
            None => {}
            Some(false) => return None,
            Some(true) => {
                st.give_up(now);
                self.node.observe(Outcome::TimedOut);
                let wake = st.close(&timed_out());
                drop(st);
                wake_all(wake);
                return None;
            }
        }
        let owed_before = st.owes_reads();
        if let Err(e) = ask_info_when_due(&mut st.conn, now) {
            let wake = st.close(&e);
            drop(st);
            wake_all(wake);
            return None;
        }
        self.began_owing(owed_before, &st);
        let id = st.next_id;
        st.next_id += 1;
        let facts_seq = st.conn.wire().facts_seq;
        st.owners.push(Owner {
            id,
            replies: VecDeque::new(),
            facts_seq,
            owed: 0,
            staged: 0,
            waker,
            waiting: false,
            orphan: None,
        });
        let wire = ConnState::joining(st.conn.wire());
        Some(RoundConn {
            line: self.clone(),
            id,
            wire,
        })
    }

    /// Reads what arrived (what `ready` reports, or all there is) and hands
    /// each reply to its owner.
    pub(crate) fn pump(&self, ready: Option<C::Ready>) {
        let now = self.node.clock.now();
        self.act(|st, wake| {
            st.read(&self.node, ready, now, wake);
            if st.closed.is_none() {
                st.next_batch(&self.staged, &self.node, wake);
            }
        });
    }

    /// Writes what rounds staged if the oldest has waited [`STAGE_MAX`]
    /// (the reader did not get to it). When, if anything is staged, it is
    /// due.
    fn write_stale(&self, now: Instant) -> Option<Instant> {
        let since = self.staged.lock().since?;
        let due = crate::clock::after(since, STAGE_MAX);
        if now < due {
            return Some(due);
        }
        self.act(|st, wake| st.write_staged(&self.staged, &self.node, wake));
        None
    }

    /// Runs `f` on the state of the multiplexed connection unless it ended; then wakes the
    /// rounds `f` woke, and takes the multiplexed connection out of its slot if it ended.
    fn act(&self, f: impl FnOnce(&mut State<C>, &mut Vec<Arc<dyn Wake>>)) {
        let _held = HeldEvents::new();
        let mut wake = Vec::new();
        let closed = {
            let mut st = self.state.lock();
            if st.closed.is_some() {
                return;
            }
            f(&mut st, &mut wake);
            st.closed.is_some()
        };
        wake_all(wake);
        if closed {
            self.unslot();
        }
    }

    /// Whether the connection has part of a command still to write.
    pub(crate) fn wants_write(&self) -> bool {
        self.state.lock().conn.wants_write()
    }

    /// Whether round `id` has news (replies, or the multiplexed connection's end); if not,
    /// it waits: a reply read for it wakes it.
    fn watch(&self, id: u64) -> bool {
        let mut st = self.state.lock();
        let closed = st.closed.is_some();
        let Some(o) = st.owner(id) else {
            return true;
        };
        if !o.replies.is_empty() || (closed && o.owes()) {
            return true;
        }
        o.waiting = !closed;
        false
    }

    fn unwatch(&self, id: u64) {
        if let Some(o) = self.state.lock().owner(id) {
            o.waiting = false;
        }
    }

    /// Whether the multiplexed connection owes replies or has bytes to write: the reader
    /// polls it.
    pub(crate) fn owes_reads(&self) -> bool {
        let st = self.state.lock();
        st.closed.is_none() && st.owes_reads()
    }

    /// Tells the reader role that the multiplexed connection came to owe replies (it did not
    /// before `st`'s change): the reader polls it too.
    fn began_owing(&self, owed_before: bool, st: &State<C>) {
        if !owed_before && st.closed.is_none() && st.owes_reads() {
            if let Some(role) = self.role.upgrade() {
                role.began_owing();
            }
        }
    }

    fn has_news(&self, id: u64) -> bool {
        let mut st = self.state.lock();
        let closed = st.closed.is_some();
        st.owner(id)
            .is_some_and(|o| !o.replies.is_empty() || (closed && o.owes()))
    }

    /// Owner `id`'s next reply, or the multiplexed connection's end.
    fn take(&self, id: u64) -> Option<io::Result<(Value, Option<Facts>)>> {
        let mut st = self.state.lock();
        let closed = st.closed.clone();
        let o = st.owner(id)?;
        if let Some(v) = o.replies.pop_front() {
            return Some(Ok(v));
        }
        match closed {
            Some(c) if o.owes() => {
                o.owed = 0;
                o.staged = 0;
                Some(Err(error_of(&c)))
            }
            _ => None,
        }
    }

    /// Sends what `wire` (round `id`'s) queued. Its commands are staged
    /// first; whichever round takes the multiplexed connection next writes everything staged
    /// in one write, so rounds that send while another writes share its
    /// next write (and the server reads them in one read). While a batch is
    /// in flight they stay staged: whoever reads its last reply writes them
    /// (see [`State::in_flight`]), with every command staged meanwhile.
    fn send(&self, id: u64, wire: &mut ConnState) -> io::Result<()> {
        let _held = HeldEvents::new();
        let now = self.node.clock.now();
        {
            let mut sg = self.staged.lock();
            let Pipeline { bytes, cmds, since } = &mut *sg;
            wire.take_uncarried(bytes, |o| cmds.push((id, o)));
            since.get_or_insert(now);
        }
        // The simulation lets other threads run here, as a scheduler may.
        #[cfg(test)]
        if let Some(y) = &self.node.stage_yield {
            y();
        }
        let mut st = self.state.lock();
        if let Some(c) = &st.closed {
            wire.broken = true;
            return Err(error_of(c));
        }
        if !wire.broken && st.holds_back(id) {
            let staged = self.staged.lock().cmds.iter().filter(|c| c.0 == id).count();
            if let Some(o) = st.owner(id) {
                o.staged = staged;
            }
            #[cfg(test)]
            count(&self.node.line_stats.deferred);
            return Ok(());
        }
        let owed_before = st.owes_reads();
        let drained = st.drain(&self.staged, &self.node);
        let r = if wire.broken {
            // The round gave the connection up: its reply was owed past
            // the node timeout (observed by the round).
            st.give_up(now);
            Err(timed_out())
        } else if drained || st.conn.wants_write() {
            st.conn.flush()
        } else {
            // Written by a round that took the multiplexed connection first.
            Ok(())
        };
        let wake = match &r {
            Err(e) => st.close(e),
            Ok(()) => Vec::new(),
        };
        self.began_owing(owed_before, &st);
        drop(st);
        wake_all(wake);
        if r.is_err() {
            self.unslot();
        }
        r
    }

    /// Round `id` leaves, its connection state as the round left it.
    fn leave(&self, id: u64, mut wire: ConnState) {
        let _held = HeldEvents::new();
        let now = self.node.clock.now();
        let mut wake = Vec::new();
        let unslot = {
            let mut st = self.state.lock();
            let owed_before = st.owes_reads();
            let Some(k) = st.owners.iter().position(|o| o.id == id) else {
                return;
            };
            if st.closed.is_some() {
                st.owners.swap_remove(k);
                return;
            }
            // The history's key the round worked out (a hash), for the
            // next rounds on the multiplexed connection (see `NodeFacts::seen_by`).
            let line_wire = st.conn.wire_mut();
            if wire.history_key.is_some() && line_wire.run_id == wire.run_id {
                line_wire.history_key = wire.history_key;
            }
            // Replies read for it and not taken are late replies now.
            let replies = std::mem::take(&mut st.owners[k].replies);
            let mut failed = None;
            for (v, facts) in replies {
                if let Some(f) = facts {
                    wire.adopt(f);
                }
                #[cfg(test)]
                count(&self.node.line_stats.orphan_replies);
                let r = wire
                    .answered()
                    .and_then(|p| late_reply(&mut wire, &self.node, p, &v, now));
                if let Err(e) = r {
                    failed = Some(e);
                    break;
                }
            }
            // What is staged goes out now if this round's commands are in it
            // (its replies are then owed where the multiplexed connection can take them as
            // late ones), else with the next batch.
            if !st.in_flight() || st.owners[k].staged > 0 {
                st.drain(&self.staged, &self.node);
            }
            st.carry(id, &mut wire);
            let r = match failed {
                Some(e) => Err(e),
                None if wire.broken => {
                    st.give_up(now);
                    Err(timed_out())
                }
                None => st.conn.flush(),
            };
            if let Err(e) = r {
                wake.extend(st.close(&e));
                st.owners.retain(|o| o.id != id);
            } else if let Some(o) = st.owner(id) {
                if o.owed > 0 {
                    o.orphan = Some(wire);
                    o.waker = None;
                    o.waiting = false;
                } else {
                    st.owners.retain(|o| o.id != id);
                }
            }
            // Late replies of rounds that left are read by the client's
            // reader, or the next round on the multiplexed connection (which reads what
            // arrived before it joins).
            self.began_owing(owed_before, &st);
            st.closed.is_some()
        };
        wake_all(wake);
        if unslot {
            self.unslot();
        }
    }
}

/// Round `waker`'s place on node `node`'s current multiplexed connection (kept in `slot`),
/// or on a new line over a connection `fresh` gives, read by `role`'s
/// reader.
pub(crate) fn join<C: Link>(
    slot: &Arc<MultiplexedSlot<C>>,
    node: &Arc<NodeState>,
    role: &Arc<Role<C>>,
    waker: Option<Arc<dyn Wake>>,
    now: Instant,
    fresh: impl FnOnce() -> Option<C>,
) -> Option<RoundConn<C>> {
    let _held = HeldEvents::new();
    let mut current = slot.lock();
    if let Some(line) = current.as_ref() {
        if let Some(share) = line.admit(waker.clone(), now) {
            return Some(share);
        }
    }
    // Closed or given up: it goes when its last round does.
    let old = current.take();
    let share = fresh().and_then(|conn| {
        let line = Multiplexed::new(
            conn,
            node.clone(),
            Arc::downgrade(slot),
            Arc::downgrade(role),
        );
        role.register(&line);
        // Its connect commands' replies (or late ones) may be owed: the
        // reader polls it from now.
        if line.owes_reads() {
            role.began_owing();
        }
        let share = line.admit(waker, now)?;
        *current = Some(line);
        Some(share)
    });
    drop(current);
    drop(old);
    share
}

pub(crate) mod role;
mod share;
mod state;
pub(crate) mod sync;
mod wait;
mod wake;

pub(crate) use role::Role;
pub(crate) use wake::{ReplyCount, Wake};

pub(crate) use wait::{wait_ready, Await};

#[cfg(all(test, quorumlock_shuttle))]
mod model_tests;
#[cfg(test)]
mod role_tests;
#[cfg(test)]
mod tests;
