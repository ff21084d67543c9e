//! One round: the command to every admitted node, replies taken in arrival
//! order until the outcome is settled or the deadline passes, and what the
//! round leaves behind (late replies owed, releases to retry, an undo).

use crate::driver::node::encode::Encoded;
use crate::driver::node::link::Link;
use crate::driver::node::links::Links;
use crate::driver::node::node_round::{
    end_part, lose_connection, take_reply, End, LateReplies, NodeRound, VoteContext,
};
use crate::driver::node::CONN_RECHECK;

use std::time::{Duration, Instant};

use crate::algorithm::health::{self, Admit};
use crate::algorithm::quorum::{self};
use crate::algorithm::round::{allowance, Key};
use crate::algorithm::round::{NodeResult, Op};
use crate::clock::after;
use crate::error::{NodeError, NodeErrorKind};
use crate::lock::transport::{AfterRound, Decided, Undo};

/// What stays the same through one round trip: its command, its keys, when
/// it began and its deadline.
pub(crate) struct Trip<'a> {
    enc: &'a Encoded,
    keys: &'a [Key<'a>],
    start: Instant,
    deadline: Instant,
}

/// The round, for every [`Links`]: production's sockets and the
/// simulation's connections run this same code.
pub(crate) trait RoundRunner: Links + Sized {
    /// [`Transport::run`](crate::lock::transport::Transport::run): one round, and what the caller decides after it
    /// (the undo of a failed attempt, or the writes a granted lock missed).
    fn run_round(
        &self,
        op: Op,
        keys: &[Key<'_>],
        deadline: Instant,
        decided: Option<Decided<'_>>,
        undo: Option<Undo<'_>>,
    ) -> Vec<NodeResult> {
        let start = self.now();
        let mut parts = self.admit_parts(op, start);
        let enc = Encoded::new(op, keys);
        let results = self.round_trip(&enc, keys, &mut parts, start, deadline, decided);

        let after_round = match (undo, op) {
            (Some(undo), Op::Acquire { .. } | Op::Swap { .. }) => undo(&results),
            _ => AfterRound::Done,
        };
        if let (AfterRound::Complete, Op::Acquire { ttl, known_max, .. }) = (after_round, op) {
            self.write_missed(keys, &parts, &results, start, (ttl, known_max));
        }
        if let (AfterRound::Undo, Op::Acquire { ttl, .. } | Op::Swap { ttl, .. }) =
            (after_round, op)
        {
            self.undo(op, keys, &mut parts, &results, after(start, ttl));
        }
        results
    }

    /// Each node's part in a round of `op` starting at `start`, admitted
    /// by its health (see [`health::admit_round`]), before anything is sent.
    fn admit_parts(&self, op: Op, start: Instant) -> Vec<NodeRound<Self::Link>> {
        let n = self.names().len();
        let release = matches!(op, Op::Release { .. });
        let mut admits: Vec<Admit> = (0..n)
            .map(|i| self.node(i).health.lock().admit(start))
            .collect();
        let twins = self.twins();
        health::admit_round(&mut admits, release, quorum::quorum(n), &twins);
        admits
            .into_iter()
            .map(|admit| NodeRound {
                admit,
                conn: None,
                sent: None,
                fell_back: false,
                began: start,
                lost: false,
                again: false,
            })
            .collect()
    }

    /// After a granted acquire of one key: sends the `SET` later to each
    /// healthy node the round waited for but never reached (`ttl` and
    /// `known_max` are the acquire's).
    fn write_missed(
        &self,
        keys: &[Key<'_>],
        parts: &[NodeRound<Self::Link>],
        results: &[NodeResult],
        start: Instant,
        (ttl, known_max): (Duration, Duration),
    ) {
        // Not for a lock of several resources: each key's write is settled
        // on its own, and the node could end up with part of the set (the
        // renewal restores copies of a held set).
        let [k] = keys else {
            return;
        };
        for (i, (s, r)) in parts.iter().zip(results).enumerate() {
            // A healthy node the round waited for but never reached: no
            // connection was free in time (the pool was growing, or all
            // its connections were in use).
            let unreached = s.admit == Admit::Wait
                && s.sent.is_none()
                && !s.lost
                && matches!(r, Err(e) if e.kind() == NodeErrorKind::NoConnection);
            if unreached && self.node(i).is_healthy() {
                // Not a first use (the round recorded it).
                self.write_later(i, k, ttl, known_max.max(ttl), start);
            }
        }
    }

    /// Undoes a failed acquire or swap (`op`): a release of what it wrote,
    /// kept until `keep_until`, as a round trip on the round's own `parts`.
    fn undo(
        &self,
        op: Op,
        keys: &[Key<'_>],
        parts: &mut [NodeRound<Self::Link>],
        results: &[NodeResult],
        keep_until: Instant,
    ) {
        let now = self.now();
        let rel = Op::Release {
            keep_until,
            notice: 0,
        };
        self.admit_undo(op, parts, results);
        // A failed swap gives up the handed-over lock too.
        let written = crate::algorithm::round::written(op, keys);
        let keys = &written[..];
        let enc = Encoded::new(rel, keys);
        // A failed swap's caller locks anew within its own bound:
        // its undo is sent, not waited for (a delete not answered
        // is retried in the background). An acquire's is waited for
        // as a round of its keys.
        let wait = match op {
            Op::Swap { .. } => Duration::ZERO,
            _ => allowance(self.timeout(), keys.len()),
        };
        self.round_trip(&enc, keys, parts, now, after(now, wait), None);
    }

    /// Admits each node anew for the undo of `op`, by what the round's
    /// `results` say of it, and clears what the round's command left on
    /// its part (the connection stays).
    fn admit_undo(&self, op: Op, parts: &mut [NodeRound<Self::Link>], results: &[NodeResult]) {
        for (i, (s, r)) in parts.iter_mut().zip(results).enumerate() {
            // Only where our SET left this client, on the same
            // connection so that the delete lands after it; waiting
            // only for the nodes that answered the SET.
            // Reached: our SET is out (or was lost with its connection).
            let reached = s.sent.is_some() || s.lost;
            #[cfg(test)]
            let reached = reached && !(self.node(i).defects.undo_skips_lost && s.lost);
            s.admit = match (reached, r) {
                // A failed swap releases the old lock everywhere.
                (false, _) if matches!(op, Op::Swap { .. }) => Admit::Trial,
                (false, _) => Admit::Skip,
                (true, Ok(_)) => Admit::Wait,
                (true, Err(_)) if self.node(i).is_healthy() => Admit::Wait,
                (true, Err(_)) => Admit::Trial,
            };
            s.sent = None;
            s.fell_back = false;
            s.lost = false;
            s.again = false;
        }
    }

    /// Sends `enc` to every admitted node and gathers replies in arrival
    /// order until `decided` or `deadline`. Connections stay in `parts`.
    fn round_trip(
        &self,
        enc: &Encoded,
        keys: &[Key<'_>],
        parts: &mut [NodeRound<Self::Link>],
        start: Instant,
        deadline: Instant,
        decided: Option<Decided<'_>>,
    ) -> Vec<NodeResult> {
        let trip = Trip {
            enc,
            keys,
            start,
            deadline,
        };
        let mut results: Vec<Option<NodeResult>> = vec![None; parts.len()];
        if let Op::Release { .. } = enc.op {
            self.mark_released(parts.len(), keys);
        }
        self.send_all(&trip, parts, &mut results);
        let settled = self.gather(&trip, parts, decided, &mut results);
        // Replies that arrived while this thread was not scheduled are
        // taken before anyone is charged a timeout.
        self.collect_arrived(parts, enc, &mut results);
        self.end_parts(&trip, parts, settled, &mut results);
        // Releases a node did not answer are kept and sent again later.
        if let Op::Release { keep_until, .. } = enc.op {
            self.keep_unanswered(keys, parts, &results, keep_until);
        }
        results
            .into_iter()
            .zip(self.names())
            .map(|(r, name)| {
                r.unwrap_or_else(|| Err(NodeError::new(name, NodeErrorKind::Unavailable, "")))
            })
            .collect()
    }

    /// Before any delete of `keys` leaves (to the round's `n` nodes): whoever
    /// reads the reply of a SET of these keys from now on deletes the key
    /// again after it.
    fn mark_released(&self, n: usize, keys: &[Key<'_>]) {
        for i in 0..n {
            let mut u = self.node(i).unsettled.lock();
            if !u.is_empty() {
                for k in keys {
                    if let Some(e) = u.get_mut(k.token) {
                        e.released = true;
                    }
                }
            }
        }
    }

    /// Sends the round's command to every admitted node (queueing for a
    /// busy pool's connection when the round may); a node not waited for
    /// counts as failed unless its reply arrives.
    fn send_all(
        &self,
        t: &Trip<'_>,
        parts: &mut [NodeRound<Self::Link>],
        results: &mut [Option<NodeResult>],
    ) {
        // Queueing for a busy pool is safe only while this round holds no
        // connection to a later node (rounds then wait in one global order);
        // a round reusing its connections (an undo) never queues.
        let may_queue = parts.iter().all(|s| s.conn.is_none());
        for s in parts.iter_mut() {
            s.began = t.start;
        }
        // Nodes not waited for count as failed unless their reply arrives.
        for (i, s) in parts.iter_mut().enumerate() {
            if s.admit != Admit::Wait {
                results[i] = Some(Err(self.not_waited(i, s.admit)));
            }
            if s.admit != Admit::Skip {
                self.send(i, s, t.enc, t.start, results);
                if s.conn.is_none() && s.admit == Admit::Wait && may_queue {
                    // Every connection to this node is in use by other rounds
                    // of this client: queue for one, in node order, so that
                    // rounds never hold some connections while waiting for
                    // others held by rounds that wait for theirs.
                    s.conn = self.wait_for_free(i, t.deadline);
                    if s.conn.is_some() {
                        self.send(i, s, t.enc, self.now(), results);
                    }
                }
            }
        }
    }

    /// Takes replies in arrival order until the round is settled (`decided`
    /// counts none still needed; a lingering round then reads as long again)
    /// or its deadline passes, looking again meanwhile for connections to
    /// waited-for nodes without one. Whether the round settled.
    fn gather(
        &self,
        t: &Trip<'_>,
        parts: &mut [NodeRound<Self::Link>],
        decided: Option<Decided<'_>>,
        results: &mut [Option<NodeResult>],
    ) -> bool {
        let mut settle: Option<Instant> = None;
        // A lingering round keeps reading after it settled, as long again.
        let linger = matches!(t.enc.op, Op::Extend { linger: true, .. });
        let mut ready: Vec<(usize, <Self::Link as Link>::Ready)> = Vec::with_capacity(parts.len());
        loop {
            let now = self.now();
            // Replies the round needs at least before its outcome is known.
            let to_settle = decided.map_or(usize::MAX, |f| f(results));
            if settle.is_none() && to_settle == 0 {
                // Settled: what has already arrived is taken below; nothing
                // more is waited for (but for a lingering round's stragglers).
                settle = Some(if linger {
                    now.checked_add(now.saturating_duration_since(t.start))
                        .map_or(t.deadline, |l| l.min(t.deadline))
                } else {
                    now
                });
            }
            // Waited-for nodes still without a connection: look again.
            let may_send = settle.is_none() && now < t.deadline;
            let missing = self.look_again(t.enc, parts, now, may_send, results);
            // Only waited-for nodes keep the round open; a trial's reply is
            // taken if it arrives meanwhile.
            let waited = parts
                .iter()
                .filter(|s| {
                    s.admit == Admit::Wait
                        && s.conn.as_ref().is_some_and(|c| c.wire().awaits_wanted())
                })
                .count();
            let outstanding = waited > 0;
            let until = settle.unwrap_or(t.deadline);
            if (!outstanding && !missing) || now >= until || (settle.is_some() && !outstanding) {
                break;
            }
            let mut wait = until.saturating_duration_since(now);
            if missing && settle.is_none() {
                wait = wait.min(CONN_RECHECK);
            }
            ready.clear();
            // A settled round takes its stragglers as they come; one that
            // waits for every node needs only those it waits for (a
            // trial's reply is taken if it comes, not waited for).
            let need = if settle.is_some() {
                1
            } else {
                to_settle.min(waited)
            };
            self.wait_ready(parts, wait, need, &mut ready);
            for &(i, flags) in &ready {
                self.on_ready(i, &mut parts[i], flags, t.enc, results);
            }
        }
        settle.is_some()
    }

    /// Waited-for nodes still without a connection, looked at again at
    /// `now`: a refused connect is the node's answer; the others are sent
    /// the command if `may_send`. Whether some are still without one.
    fn look_again(
        &self,
        enc: &Encoded,
        parts: &mut [NodeRound<Self::Link>],
        now: Instant,
        may_send: bool,
        results: &mut [Option<NodeResult>],
    ) -> bool {
        let mut missing = false;
        for (i, s) in parts.iter_mut().enumerate() {
            if s.admit == Admit::Wait && s.sent.is_none() && results[i].is_none() {
                if !s.again && !self.node(i).is_healthy() {
                    // Its connect was refused meanwhile: that is its answer.
                    results[i] = Some(Err(self.not_waited(i, Admit::Skip)));
                    continue;
                }
                if may_send {
                    self.send(i, s, enc, now, results);
                }
                // Sent again (or failed on its own connection): the
                // node's health is its own answers' from here.
                s.again &= s.sent.is_none() && results[i].is_none();
                missing |= s.sent.is_none() && results[i].is_none();
            }
        }
        missing
    }

    /// Ends each node's part once no more replies are taken (see
    /// [`end_part`]): what stays owed, and the result of a node without one.
    fn end_parts(
        &self,
        t: &Trip<'_>,
        parts: &mut [NodeRound<Self::Link>],
        settled: bool,
        results: &mut [Option<NodeResult>],
    ) {
        let now = self.now();
        let left = LateReplies::of(t.enc, t.keys, parts, t.start);
        let ballot = VoteContext {
            enc: t.enc,
            names: self.names(),
            rules: self.rules(),
        };
        let pool_busy = |i: usize| self.pool_busy(i);
        let ended = End {
            now,
            start: t.start,
            deadline: t.deadline,
            settled,
            pool_busy: &pool_busy,
        };
        for (i, s) in parts.iter_mut().enumerate() {
            if let Some(c) = s.conn.as_mut() {
                if c.wants_write() {
                    // A half-written command: the connection cannot be reused.
                    c.wire_mut().broken = true;
                }
            }
            if end_part(&ballot, i, s, self.node(i), &left, &ended, &mut results[i]) {
                if let Some(c) = s.conn.as_mut() {
                    // Given up: what it queued (undos) goes out first.
                    let _ = c.flush();
                }
            }
        }
    }

    /// Keeps the deletes of a release (of `keys`, until `keep_until`) that a
    /// node did not answer, or that a SET of ours may yet land after, to
    /// send again later.
    fn keep_unanswered(
        &self,
        keys: &[Key<'_>],
        parts: &[NodeRound<Self::Link>],
        results: &[Option<NodeResult>],
        keep_until: Instant,
    ) {
        for (i, r) in results.iter().enumerate() {
            // Skip here means "our SET never reached it": nothing to undo.
            // A delete still in flight is kept too: its connection may be
            // closed before the node reads it (a kill discards the
            // unread commands), and deleting twice is harmless.
            // An entry that answered for a server another entry holds,
            // or a node that cannot keep locks, answered: not retried.
            let answered_anyway = matches!(r, Some(Err(e)) if matches!(
                e.kind(),
                NodeErrorKind::SameServer | NodeErrorKind::Unsuitable
            ));
            let unanswered =
                matches!(r, Some(Err(_))) && parts[i].admit != Admit::Skip && !answered_anyway;
            // A SET of ours still unsettled there may land after this
            // delete: keep deleting until its reply has been read.
            let unsettled = {
                let u = self.node(i).unsettled.lock();
                !u.is_empty() && keys.iter().any(|k| u.contains_key(k.token))
            };
            if unanswered || unsettled {
                self.retry_later(i, keys, keep_until);
            }
        }
    }

    /// One non-blocking pass over the connections still owing a reply.
    fn collect_arrived(
        &self,
        parts: &mut [NodeRound<Self::Link>],
        enc: &Encoded,
        results: &mut [Option<NodeResult>],
    ) {
        let mut ready = Vec::new();
        self.wait_ready(parts, Duration::ZERO, 1, &mut ready);
        for (i, flags) in ready {
            self.on_ready(i, &mut parts[i], flags, enc, results);
        }
    }

    /// The error of node `i`, not waited for (see [`NodeState::not_waited`](crate::driver::node::state::NodeState::not_waited)).
    fn not_waited(&self, i: usize, admit: Admit) -> NodeError {
        self.node(i).not_waited(admit, self.now())
    }

    /// Checks out a connection for node `i` if none is at hand and queues the
    /// round's command on it.
    fn send(
        &self,
        i: usize,
        s: &mut NodeRound<Self::Link>,
        enc: &Encoded,
        now: Instant,
        results: &mut [Option<NodeResult>],
    ) {
        if s.conn.as_ref().is_some_and(|c| c.wire().broken) {
            s.conn = None;
        }
        if s.conn.is_none() {
            s.conn = if s.again {
                self.checkout_anyway(i, now)
            } else {
                self.checkout(i, now)
            };
        }
        let Some(c) = s.conn.as_mut() else {
            return;
        };
        let sent = self.now();
        match s.lost.then(|| enc.script()).flatten() {
            // Lost with its connection: the script form (see `Encoded::script`).
            Some(script) => c.wire_mut().queue_keys(&script, sent, true, enc.n),
            None => {
                c.wire_mut().queue_keys(&enc.packed, sent, true, enc.n);
                c.wire_mut().last_frames(enc.frames);
            }
        }
        s.sent = Some(sent);
        if let Err(e) = c.flush() {
            self.failed(i, s, e, enc, results);
        }
    }

    fn failed(
        &self,
        i: usize,
        s: &mut NodeRound<Self::Link>,
        e: std::io::Error,
        enc: &Encoded,
        results: &mut [Option<NodeResult>],
    ) {
        let ballot = VoteContext {
            enc,
            names: self.names(),
            rules: self.rules(),
        };
        lose_connection(&ballot, i, s, self.node(i), e, results);
    }

    fn on_ready(
        &self,
        i: usize,
        s: &mut NodeRound<Self::Link>,
        flags: <Self::Link as Link>::Ready,
        enc: &Encoded,
        results: &mut [Option<NodeResult>],
    ) {
        let Some(c) = s.conn.as_mut() else {
            return;
        };
        // What arrived before a close is read first: a reply, or the
        // server's reason for closing (`max number of clients reached`).
        let mut io = c.on_ready(flags).err();
        let shared = self.node(i);
        loop {
            let Some(c) = s.conn.as_mut() else {
                return;
            };
            let (p, v) = match c.next_reply() {
                Ok(Some(r)) => r,
                Ok(None) => match io.take() {
                    Some(e) => return self.failed(i, s, e, enc, results),
                    None => return,
                },
                Err(e) => return self.failed(i, s, e, enc, results),
            };
            let now = self.now();
            let ballot = VoteContext {
                enc,
                names: self.names(),
                rules: self.rules(),
            };
            match take_reply(
                &ballot,
                i,
                &mut s.fell_back,
                s.lost,
                c.wire_mut(),
                shared,
                (p, v),
                now,
                results,
            ) {
                Ok(false) => {}
                Ok(true) => {
                    if let Err(e) = c.flush() {
                        return self.failed(i, s, e, enc, results);
                    }
                }
                Err(e) => return self.failed(i, s, e, enc, results),
            }
        }
    }
}

impl<L: Links> RoundRunner for L {}
