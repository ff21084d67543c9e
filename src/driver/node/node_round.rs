//! One node's part in a round, as events on its connection: a reply read
//! ([`take_reply`]: the node's health, a late reply's rules, the `EVAL`
//! fallback after NOSCRIPT, the vote it casts), the connection lost
//! ([`lose_connection`]), and the round's end ([`end_part`]: what stays
//! owed, and the result of a node without one). No I/O: the connection
//! reads the replies and sends what these queue on its [`ConnState`].

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use log::{debug, info};
use redis::Value;

use crate::algorithm::health::{Admit, Outcome};
use crate::algorithm::quorum::{self, VoteRules};
use crate::algorithm::restart::Read;
use crate::algorithm::round::{
    allowance, Answer, Key, NodeFacts, NodeResult, Op, ServerTag, KEYS_PER_TIMEOUT,
};
use crate::clock::after;
use crate::driver::conn;
use crate::driver::conn_state::{ConnState, InFlight};
use crate::driver::node::encode::Encoded;
use crate::driver::node::link::Link;
use crate::driver::node::replies::late_reply;
use crate::driver::node::state::NodeState;
use crate::error::{NodeError, NodeErrorKind};

/// What a round's replies are counted against: its command, the node
/// names, and the client's voting rules.
pub(crate) struct VoteContext<'a> {
    pub(crate) enc: &'a Encoded,
    pub(crate) names: &'a [String],
    pub(crate) rules: VoteRules,
}

/// Takes reply `v` to command `p` from node `i`, whose part in the round
/// has sent the `EVAL` fallback already (`fell_back`) or lost a command
/// with a connection (`lost`): a reply the round waits for becomes node
/// `i`'s entry in `results` (or, on NOSCRIPT, the fallback is queued); any
/// other is a late reply. `Ok(true)` when commands were queued on `wire`
/// to send now; `Err` when the connection cannot be used.
#[allow(clippy::too_many_arguments)]
pub(crate) fn take_reply(
    ballot: &VoteContext<'_>,
    i: usize,
    fell_back: &mut bool,
    lost: bool,
    wire: &mut ConnState,
    shared: &NodeState,
    (p, v): (InFlight, Value),
    now: Instant,
    results: &mut [Option<NodeResult>],
) -> std::io::Result<bool> {
    let enc = ballot.enc;
    if !p.wanted {
        return late_reply(wire, shared, p, &v, now);
    }
    shared.observe(Outcome::Answered);
    if let (Value::ServerError(e), false) = (&v, *fell_back) {
        if e.kind() == Some(redis::ServerErrorKind::NoScript) {
            debug!("node {}: script not cached, sending EVAL", ballot.names[i]);
            *fell_back = true;
            wire.queue_keys(&enc.fallback(), now, true, enc.n);
            return Ok(true);
        }
    }
    let server = wire.server;
    // A lean acquire sent again as the script reads as a script's reply.
    let lean = match enc.op {
        Op::Acquire { lean, .. } if enc.is_lean_reply(&v) => lean,
        _ => None,
    };
    let mut r = enc.decode(v);
    if let (Err((NodeErrorKind::Server, why)), Some(_)) = (&r, lean) {
        // Refused for good (an ACL, a renamed command), not for now (OOM,
        // READONLY, BUSY: a failed vote, as a script's error).
        let refused = super::encode::refused_for_good(why);
        if refused && !shared.lean_refused.swap(true, Ordering::AcqRel) {
            info!(
                "node {}: the plain acquire was refused ({why}); this client's acquires send it the script",
                ballot.names[i]
            );
        }
        *shared.read.lock() = None;
    }
    if let Ok(reply) = &mut r {
        // The history's key and the age's cap come from what this
        // connection knows of its server (see `scripts::ACQUIRE`).
        let uptime = wire.uptime_at(p.sent);
        reply.facts = reply
            .facts
            .map(|f| f.seen_by(wire.run_id.as_deref(), uptime, &mut wire.history_key));
        // Who answered: the connection's server (its history's id as
        // the node last reported it, if this connection has none).
        let history = server.history.or_else(|| shared.servers.history(i));
        reply.server = Some(ServerTag { history, ..server });
    }
    if let (Ok(reply), Op::Acquire { .. }) = (&mut r, enc.op) {
        match reply
            .facts
            .map(|f| read_or_confirm(shared, lean, f, p.sent))
        {
            Some(None) => {
                r = Err((
                    NodeErrorKind::Restarted,
                    "lock history changed since it was read (a flush, an eviction or a restart): its votes count once it is read again".to_owned(),
                ));
            }
            Some(facts) => reply.facts = facts,
            None => {}
        }
    }
    if let (Ok(reply), Op::Release { .. }) = (&mut r, enc.op) {
        // "Absent" behind our own undo of a late SET: deleted by us.
        let mut undone = shared.undone.lock();
        if !undone.is_empty() {
            for (a, t) in reply.answers.iter_mut().zip(&enc.tokens) {
                if *a == Answer::Absent && undone.remove(t).is_some() {
                    *a = Answer::Ok;
                }
            }
        }
    }
    if let (true, Op::Release { .. }, Ok(reply)) = (lost, enc.op, &r) {
        // The first delete, lost with its connection, may have run:
        // "absent" or another owner now says nothing (the key may
        // also have expired, or never reached this node).
        if reply.answers.iter().any(|a| *a != Answer::Ok) {
            r = Err((
                NodeErrorKind::Io,
                "connection closed before the reply; sent again, the key was no longer ours: the first delete may have run".to_owned(),
            ));
        }
    }
    let r = r.map_err(|(kind, detail)| NodeError::new(&ballot.names[i], kind, detail));
    quorum::insert_vote(results, ballot.names, i, r, ballot.rules);
    Ok(false)
}

/// An acquire's facts, `f`, sent at `sent`: a script's are the node's
/// [`Read`] from now on; a lean reply's (`lean`: the generation of the
/// reads its round was decided on) stand for the facts last read there
/// where that read is one the decision saw and its history the same one,
/// and `None` where not (where the history changed, the next acquire's
/// script reads it again).
fn read_or_confirm(
    shared: &NodeState,
    lean: Option<u64>,
    f: NodeFacts,
    sent: Instant,
) -> Option<NodeFacts> {
    let mut read = shared.read.lock();
    let Some(gen) = lean else {
        if shared.lean_refused.load(Ordering::Acquire) {
            return Some(f);
        }
        // A history read again keeps its generation; a new one gets the
        // next: a round decided on generations up to `gen` never takes a
        // history it did not judge for its own.
        let gen = match *read {
            Some(r) if r.facts.history == f.history => r.gen,
            _ => shared.servers.next_read(),
        };
        *read = Some(Read {
            facts: f,
            from: sent,
            // Taken with the lock held, after the counter moves.
            at: shared.clock.now(),
            gen,
        });
        return Some(f);
    };
    let known = Read::confirm(read.as_ref(), &f, sent, gen);
    #[cfg(test)]
    let known = known.or_else(|| {
        read.filter(|_| shared.defects.lean_ignores_history)
            .map(|r| r.aged(sent))
    });
    if known.is_none() && read.is_some_and(|r| r.gen <= gen) {
        *read = None;
    }
    known
}

/// One node's part in a round.
pub(crate) struct NodeRound<C> {
    pub(crate) admit: Admit,
    pub(crate) conn: Option<C>,
    /// When our command was queued on `conn` (or on a connection since lost).
    pub(crate) sent: Option<Instant>,
    /// The EVAL fallback was sent after NOSCRIPT.
    pub(crate) fell_back: bool,
    /// When the round trip began: a connection made before then may have been
    /// closed while idle, and one made since is the node's answer.
    pub(crate) began: Instant,
    /// A command was lost with its connection (it may have run).
    pub(crate) lost: bool,
    /// A connection older than the round closed under our command: it is
    /// sent again, whatever the node's health meanwhile (another round's
    /// close may have marked it failing: that close was not this command's
    /// answer), as soon as a connection is at hand, until the round's
    /// deadline.
    pub(crate) again: bool,
}

/// Node `i`'s connection failed with `e` during a round (a write or a read
/// error, a close, bytes that are not RESP): the connection is given up;
/// a command it carried may have run. A close of a connection older than
/// the round is most likely not the node's answer, and the command is to be
/// sent again (`part.sent` cleared); otherwise `e` is node `i`'s result.
pub(crate) fn lose_connection<C: Link>(
    ballot: &VoteContext<'_>,
    i: usize,
    s: &mut NodeRound<C>,
    shared: &NodeState,
    e: std::io::Error,
    results: &mut [Option<NodeResult>],
) {
    let enc = ballot.enc;
    let made = s.conn.as_ref().map(|c| c.wire().made);
    // Our command went out and its reply never will come: it may have
    // run, or (through a proxy) may still run.
    let lost = s.conn.as_ref().is_some_and(|c| c.wire().awaits_wanted());
    if let Some(c) = s.conn.as_mut() {
        let w = c.wire_mut();
        w.broken = true;
        w.unwant(None, &[], None, &[]);
    }
    s.conn = None;
    s.lost |= lost;
    if let (true, Some(ttl)) = (lost, enc.writes()) {
        // Its SET counts as reached for the attempt's undo, and its
        // token stays unsettled until its TTL ends: a release of it is
        // sent again until then, in case a proxy passes the lost SET on
        // after the delete.
        shared.unsettle(&enc.written, after(s.began, ttl), shared.clock.now());
    }
    #[cfg(test)]
    let made = made.filter(|_| !shared.defects.close_is_answer);
    if conn::is_close(&e) && s.admit == Admit::Wait && made.is_some_and(|t| t < s.began) {
        // A connection older than the round, closed before the node
        // answered our command: most likely by a close already on its
        // way when the command left (a kill, an idle timeout), so not the
        // node's answer. The round sends again on another connection; a
        // node that is down refuses that connect, and a close of a
        // connection made during the round is the node's answer. (Older
        // connections are at most the pool's size.) The same token makes
        // the repeat safe: a SET or swap that did land answers as done,
        // and an extension or fencing write-back is idempotent. A
        // release's repeat that does not find the key ours cannot tell
        // whether the first delete ran (see [`take_reply`]).
        s.sent = None;
        s.fell_back = false;
        s.again = true;
        debug!(
            "node {}: connection closed before the reply ({e}); sending again",
            ballot.names[i]
        );
        return;
    }
    if crate::driver::conn_state::is_given_up(&e) {
        // A shared connection another round gave up: a reply on it was
        // owed past the node timeout (observed once, by that round).
        results[i] = Some(Err(NodeError::from_io(
            &ballot.names[i],
            NodeErrorKind::Timeout,
            e,
        )));
        return;
    }
    let kind = match e.kind() {
        std::io::ErrorKind::InvalidData => {
            shared.observe(Outcome::Answered);
            NodeErrorKind::Protocol
        }
        // The server turned the connection away (its answer, already
        // observed): say so, in its words.
        std::io::ErrorKind::ConnectionRefused => NodeErrorKind::Unavailable,
        _ => {
            shared.observe(Outcome::Refused);
            NodeErrorKind::Io
        }
    };
    results[i] = Some(Err(NodeError::from_io(&ballot.names[i], kind, e)));
}

/// What a round that ended leaves on the connections still owing its
/// reply: the undo of an acquire or a swap (sent if the late reply says
/// set, and the lock was released meanwhile), the tokens whose write may
/// still land, and a release again as `EVAL` (in case it met NOSCRIPT).
pub(crate) struct LateReplies {
    undo: Option<Vec<u8>>,
    tokens: Vec<String>,
    resend: Option<Vec<u8>>,
    /// A release's tokens: its round queues the deletes still owed for the
    /// retry job, and their late replies take them off again.
    released: Vec<String>,
    /// Until when a write still owed may land.
    unsettled_until: Option<Instant>,
}

impl LateReplies {
    /// What the round of `enc` on `keys`, started at `start`, leaves on
    /// `parts` (built only when some reply is still owed).
    pub(crate) fn of<C: Link>(
        enc: &Encoded,
        keys: &[Key<'_>],
        parts: &[NodeRound<C>],
        start: Instant,
    ) -> LateReplies {
        // An acquire reply still owed may yet say "set": keep its undo.
        let owed = parts
            .iter()
            .any(|s| s.conn.as_ref().is_some_and(|c| c.wire().awaits_wanted()));
        // The tokens a late acquire or swap may still write, and their keys.
        let written = crate::algorithm::round::written(enc.op, keys);
        // Only a command that may write: a release's late reply says nothing
        // of where a SET landed.
        let tokens: Vec<String> = if owed && enc.writes().is_some() {
            written.iter().map(|k| k.token.to_owned()).collect()
        } else {
            Vec::new()
        };
        let (resend, released) = match enc.op {
            Op::Release { .. } if owed => (
                Some(enc.fallback()),
                keys.iter().map(|k| k.token.to_owned()).collect(),
            ),
            _ => (None, Vec::new()),
        };
        let unsettled_until = enc.writes().filter(|_| owed).map(|ttl| after(start, ttl));
        let undo = match (enc.op, unsettled_until) {
            (Op::Acquire { .. } | Op::Swap { .. }, Some(until)) => {
                let rel = Op::Release {
                    keep_until: until,
                    notice: 0,
                };
                Some(Encoded::new(rel, &written).packed)
            }
            _ => None,
        };
        LateReplies {
            undo,
            tokens,
            resend,
            released,
            unsettled_until,
        }
    }
}

/// How a round ended: when, when it started, whether its caller settled it
/// (else it timed out), and (asked only for a node left without a
/// connection) the pool's size if every pooled connection to the node is
/// in use.
pub(crate) struct End<'a> {
    pub(crate) now: Instant,
    pub(crate) start: Instant,
    /// The round's deadline.
    pub(crate) deadline: Instant,
    pub(crate) settled: bool,
    pub(crate) pool_busy: &'a dyn Fn(usize) -> Option<u32>,
}

/// What a timed-out node's error says: how long its reply was waited for
/// and, when that was less than the node timeout, why: the command left
/// late (this client's thread was not scheduled, or waited for a
/// connection), the thread got the CPU back only after the round's
/// deadline, or the round's deadline was nearer than a node timeout (the
/// lock's validity, the caller's wait). None is the node's doing.
fn timed_out(
    waited: Duration,
    sent: Option<Instant>,
    end: &End<'_>,
    (timeout, keys): (Duration, usize),
) -> String {
    if waited >= timeout {
        return format!("no reply in {waited:?}");
    }
    let of = if keys >= KEYS_PER_TIMEOUT {
        format!(" for {keys} keys")
    } else {
        String::new()
    };
    let mut why = format!("no reply in {waited:?}, less than the node timeout ({timeout:?}{of})");
    let late_send = sent.map_or(Duration::ZERO, |t| t.saturating_duration_since(end.start));
    if late_send > waited {
        why.push_str(&format!(
            ": the command left {late_send:?} after the round began (this client's thread was not scheduled, or waited for a connection)"
        ));
    }
    let overrun = end.now.saturating_duration_since(end.deadline);
    if overrun >= OVERRUN {
        why.push_str(&format!(
            "; this client's thread got the CPU back {overrun:?} after the round's deadline"
        ));
    } else if late_send <= waited {
        // Sent in time and woken in time: the round's own bound was shorter
        // than a node timeout.
        why.push_str(
            ": the round's deadline (the lock's validity, or the caller's wait) came first",
        );
    }
    why
}

/// A round's end this long past its deadline was the scheduler's doing.
const OVERRUN: Duration = Duration::from_millis(1);

/// Node `i`'s part when the round ended: a reply still owed stays owed on
/// its connection with the round's [`LateReplies`] (and gives the connection
/// up when the node let it pass the node timeout: its own doing), and a node
/// without a result gets one that says why (not awaited, timed out, a lost
/// command, no connection, not waited for). True when the connection was
/// given up and queued commands to send.
pub(crate) fn end_part<C: Link>(
    ballot: &VoteContext<'_>,
    i: usize,
    s: &mut NodeRound<C>,
    shared: &NodeState,
    left: &LateReplies,
    end: &End<'_>,
    result: &mut Option<NodeResult>,
) -> bool {
    let (now, start) = (end.now, end.start);
    let name = &ballot.names[i];
    // What the node had for this command: the node timeout, one more per
    // 200 keys it names.
    let timeout = allowance(shared.timeout, ballot.enc.n);
    let mut flush = false;
    if let Some(c) = s.conn.as_mut() {
        let wire = c.wire_mut();
        if wire.awaits_wanted() {
            wire.unwant(
                left.undo.as_deref(),
                &left.tokens,
                left.resend.as_deref(),
                &left.released,
            );
            if let Some(until) = left.unsettled_until {
                shared.unsettle(&left.tokens, until, now);
            }
            if s.sent
                .is_some_and(|t| now.saturating_duration_since(t) >= timeout)
            {
                // No reply within the node timeout (one more per 200
                // keys): the node's own doing.
                flush = wire.give_up(now);
                wire.broken = true;
                shared.observe(Outcome::TimedOut);
            }
            if result.is_none() {
                let waited = now.saturating_duration_since(s.sent.unwrap_or(start));
                *result = Some(Err(if end.settled {
                    NodeError::new(
                        name,
                        NodeErrorKind::NotAwaited,
                        format!("settled {waited:?} after sending, before its reply"),
                    )
                } else {
                    NodeError::new(
                        name,
                        NodeErrorKind::Timeout,
                        timed_out(waited, s.sent, end, (timeout, ballot.enc.n)),
                    )
                }));
            }
        }
    }
    if result.is_none() {
        *result = Some(Err(if s.lost {
            // Not `NoConnection`: the command may have run.
            NodeError::new(
                name,
                NodeErrorKind::Io,
                "connection closed before the reply; not sent again before the round ended",
            )
        } else if shared.is_healthy() {
            let detail = match (end.pool_busy)(i) {
                Some(size) => format!(
                    "all {size} pooled connections busy until the round ended (this client's condition: raise pool_size)"
                ),
                None => "still connecting when the round ended".to_owned(),
            };
            NodeError::new(name, NodeErrorKind::NoConnection, detail)
        } else {
            shared.not_waited(Admit::Skip, now)
        }));
    }
    flush
}

#[cfg(test)]
#[path = "node_round_tests.rs"]
mod tests;

#[cfg(test)]
#[path = "node_round_end_tests.rs"]
mod end_tests;
