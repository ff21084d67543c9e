//! Replies no round waits for: late replies read off a connection at its
//! next use, and the replies to the commands sent at connect.

use crate::driver::node::encode::acquired_any;
use crate::driver::node::state::NodeState;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use log::debug;
use redis::Value;

use crate::algorithm::health::Outcome;
use crate::algorithm::round::allowance;
use crate::algorithm::round::history_key;
use crate::algorithm::server::{id_hash, ServerInfo};
use crate::driver::conn::{is_auth_error, server_text, MAX_PENDING};
use crate::driver::conn_state::{ConnState, InFlight, Setup};
use crate::driver::node::link::Link;
use crate::driver::scripts;
use crate::error::{NodeError, NodeErrorKind};

/// Reads late replies off a checked-out connection. False (and the
/// connection marked broken) when it cannot take a new command.
pub(crate) fn catch_up<L: Link>(c: &mut L, node: &NodeState, now: Instant) -> bool {
    if let Some(n) = c.wire_mut().owing.take() {
        n.fetch_sub(1, Ordering::AcqRel);
    }
    if c.wire_mut().broken {
        return false;
    }
    // One non-blocking read: late replies, and whether the node closed the
    // connection (CLIENT KILL, a server's or a proxy's idle timeout).
    let closed = c.read_all().is_err();
    loop {
        match c.next_reply() {
            Ok(Some((p, v))) => {
                if late_reply_on(c, node, p, &v, now).is_err() {
                    return false;
                }
            }
            Ok(None) => break,
            Err(_) => {
                node.observe(Outcome::Refused);
                return false;
            }
        }
    }
    if closed {
        // Closed while idle (CLIENT KILL, a server's or a proxy's idle
        // timeout, a restart): the node answered on this connection before,
        // and a close is no answer, so no change to its health; the round
        // takes another connection, and a node that is down refuses that.
        debug!(
            "node {}: a pooled connection was closed while idle ({} replies owed)",
            node.name,
            c.wire().pending().len()
        );
        return false;
    }
    keep_using(c, node, now)
}

/// Whether a connection in use may take a new command: not when its oldest
/// reply owed is older than its allowance, the node timeout (one more per
/// 200 keys it names: the node's timeout, the connection is given up),
/// or it owes too many; asks `INFO` again when due.
pub(crate) fn keep_using<L: Link>(c: &mut L, node: &NodeState, now: Instant) -> bool {
    if let Some(overdue) = give_up_why(c.wire(), node, now) {
        c.abandon();
        if overdue {
            node.observe(Outcome::TimedOut);
        }
        return false;
    }
    ask_info_when_due(c, now).is_ok()
}

/// Why a connection in use is to be given up: `Some(true)` when its oldest
/// reply owed is older than its allowance (the node timeout, one more per
/// 200 keys the command names: see [`allowance`]; the node's own doing),
/// `Some(false)` when it owes too many replies.
pub(crate) fn give_up_why(wire: &ConnState, node: &NodeState, now: Instant) -> Option<bool> {
    let oldest = wire.pending().front()?;
    if now.saturating_duration_since(oldest.sent) >= allowance(node.timeout, oldest.keys) {
        return Some(true);
    }
    (wire.pending().len() >= MAX_PENDING).then_some(false)
}

/// Asks the server's `INFO` again when [`INFO_EVERY`] has passed. `Err`
/// when the connection cannot send.
pub(crate) fn ask_info_when_due<L: Link>(c: &mut L, now: Instant) -> std::io::Result<()> {
    if now.saturating_duration_since(c.wire().info_at) >= INFO_EVERY {
        // What the server is can change without a new connection (a replica
        // promoted, a memory policy set at runtime): asked again, ahead of
        // this connection's next command, not waited for.
        c.wire_mut().info_at = now;
        c.wire_mut()
            .queue_setup(&redis::cmd("INFO").get_packed_command(), now, Setup::Info);
        // Sent now (a caller of `catch_up` may send nothing after it, and a
        // reply owed for a command never sent would look like a timeout).
        c.flush()?;
    }
    Ok(())
}

/// What an `INFO` reply says (an unexpected reply says nothing).
pub(crate) fn info_of(v: &Value) -> ServerInfo {
    match v {
        Value::BulkString(b) => ServerInfo::parse_bytes(b),
        Value::VerbatimString { text, .. } | Value::SimpleString(text) => ServerInfo::parse(text),
        _ => ServerInfo::default(),
    }
}

/// How often a pooled connection asks its server's `INFO` again.
pub(crate) const INFO_EVERY: Duration = Duration::from_secs(10);

/// [`late_reply`] on a connection, and what it queued sent at once.
pub(crate) fn late_reply_on<L: Link>(
    c: &mut L,
    node: &NodeState,
    p: InFlight,
    v: &Value,
    now: Instant,
) -> std::io::Result<()> {
    if late_reply(c.wire_mut(), node, p, v, now)? {
        c.flush()?;
    }
    Ok(())
}

/// A reply no round waits for any more: the node's answer (but for a
/// server turning the connection away); a command sent at connect (who the
/// server is), or a late reply; if it says a write of an ended round landed
/// on a lock released meanwhile, queues that key's delete on the same
/// connection (behind the SET). `Ok(true)` when it queued commands to send;
/// `Err` when the connection cannot be used: its node refused it
/// (`ConnectionRefused`, with the server's words). No I/O.
pub(crate) fn late_reply(
    c: &mut ConnState,
    node: &NodeState,
    p: InFlight,
    v: &Value,
    now: Instant,
) -> std::io::Result<bool> {
    // When it arrived is not known for a reply read late (at the
    // connection's next use), so any reply is an answer; a timeout is only
    // ever seen as a reply still missing after the node timeout.
    if !turned_away(&p, v) {
        node.observe(Outcome::Answered);
    }
    if p.setup != Setup::None {
        return setup_reply(c, node, p.setup, v).map(|()| false);
    }
    let mut queued = false;
    let mut released = None;
    if !p.tokens.is_empty() {
        let mut unsettled = node.unsettled.lock();
        for t in &p.tokens {
            if let Some(u) = unsettled.remove(t).filter(|u| u.released) {
                released = released.max(Some(u.until));
            }
        }
    }
    // A granted lock's late copy stays (it is part of the lock) unless the
    // lock was released meanwhile; a failed attempt's was undone already.
    // (A restore has no undo: its command also went to nodes whose copy the
    // lock held already, which a delete by token cannot tell apart; the
    // release's retries, kept up while its token is unsettled, delete it.)
    if let (Some(undo), Some(until)) = (p.undo.as_ref(), released) {
        if acquired_any(v) {
            debug!("node {}: a late write landed; deleting it", node.name);
            // As `EVAL` again should it meet NOSCRIPT (a plain SET lands
            // whatever the script cache holds).
            let resend = crate::driver::node::encode::eval_form(undo, scripts::RELEASE_LUA);
            c.queue_unwanted(undo, now, |u| {
                u.keys = p.keys.max(1);
                u.resend = Some(resend);
            });
            queued = true;
            let mut undone = node.undone.lock();
            for t in &p.tokens {
                undone.insert(t.clone(), until);
            }
        }
    }
    let noscript =
        matches!(v, Value::ServerError(e) if e.kind() == Some(redis::ServerErrorKind::NoScript));
    if !p.retried.is_empty() && matches!(v, Value::Array(_)) {
        // The node ran a release whose keys are queued for retry: a
        // retried one, or a round's that did not wait for this reply (a
        // release the script did not run, an error reply, is sent again:
        // as EVAL below after NOSCRIPT, and by the next retry). The queue
        // is updated by the retry job, off the round's path.
        node.answered.lock().push(p.retried.clone());
    }
    if noscript {
        // The round that sent it ended before it could fall back to EVAL:
        // a release is sent again as EVAL (a delete is never lost), and the
        // scripts are loaded so that the next round's EVALSHA runs.
        debug!("node {}: scripts not cached; loading them", node.name);
        if let Some(resend) = &p.resend {
            if p.retried.is_empty() {
                c.queue_keys(resend, now, false, p.keys);
            } else {
                // Its keys stay queued for retry until this one is answered.
                c.queue_retry(resend, now, resend.clone(), p.retried.clone());
            }
        }
        for load in scripts::load_commands() {
            c.queue_setup(&load, now, Setup::Load);
        }
        queued = true;
    }
    Ok(queued)
}

/// The reply to a command sent at connect. `INFO` says who the server is
/// and what kind of node (kept on the connection, for the answers read after
/// it, and for the node); the history id names its database. An error that
/// says the server turned the connection away (`max number of clients
/// reached`, still loading its data) is the node's answer: it refused.
pub(crate) fn setup_reply(
    c: &mut ConnState,
    node: &NodeState,
    setup: Setup,
    v: &Value,
) -> std::io::Result<()> {
    if let Value::ServerError(e) = v {
        let text = server_text(e);
        // A node that wants a password none was given for (`NOAUTH`)
        // refuses every command: a connection of no use, and the
        // client's configuration to fix.
        let auth = is_auth_error(e);
        if auth || refuses_connection(e) {
            c.broken = true;
            let detail = if auth {
                text.clone()
            } else {
                format!("it turned the connection away: {text}")
            };
            let refused = || std::io::Error::new(std::io::ErrorKind::ConnectionRefused, &*detail);
            let kind = if auth {
                NodeErrorKind::Auth
            } else {
                NodeErrorKind::Unavailable
            };
            *node.connect_error.lock() = Some(NodeError::from_io(&node.name, kind, refused()));
            node.observe(Outcome::Refused);
            return Err(refused());
        }
        match setup {
            Setup::Info => node.servers.learn_info(node.index, &Err(text)),
            // Answered: no lock history learnt.
            Setup::History => node.servers.learn_begun(node.index, 0),
            Setup::Load | Setup::None => {}
        }
        return Ok(());
    }
    let text = |v: &Value| match v {
        Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        Value::VerbatimString { text, .. } => Some(text.clone()),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    };
    if matches!(setup, Setup::Info | Setup::History) {
        c.facts_seq += 1;
    }
    match setup {
        Setup::Info => {
            let info = info_of(v);
            c.server.run = info.run_id.as_deref().map(|r| id_hash(r.as_bytes()));
            c.uptime = info
                .uptime
                .map(|up| (Duration::from_secs(up.saturating_sub(1)), node.clock.now()));
            if c.run_id.as_deref() != info.run_id.as_deref() {
                c.history_key = None;
                c.run_id = info.run_id.as_deref().map(Arc::from);
            }
            c.server.kind = info.kind();
            node.servers.learn_info(node.index, &Ok(info));
        }
        Setup::History => {
            // `{id, epoch}` from a round's connection (`HISTORY_ID_LUA`),
            // the id alone from a check's (`HGET`).
            let (id, epoch) = match v {
                Value::Array(items) => (
                    items.first().and_then(text),
                    items.get(1).and_then(text).map(|e| e.parse::<u64>().ok()),
                ),
                v => (text(v), None),
            };
            if let Some(id) = id {
                let h = id_hash(id.as_bytes());
                c.server.history = Some(h);
                node.servers.learn_history(node.index, h);
            }
            if let Some(epoch) = epoch {
                // The lock history that had begun when the node answered
                // (none: `''`), keyed as the acquire replies key it (the
                // `INFO` before this reply gave the `run_id`).
                let key = epoch.map(|e| {
                    let k = history_key(c.run_id.as_deref(), e);
                    c.history_key = Some((e, k));
                    k
                });
                node.servers.learn_begun(node.index, key.unwrap_or(0));
            }
        }
        Setup::Load | Setup::None => {}
    }
    Ok(())
}

/// Whether this reply is a server turning the connection away (see
/// [`refuses_connection`]): not an answer that makes the node healthy.
fn turned_away(p: &InFlight, v: &Value) -> bool {
    p.setup != Setup::None && matches!(v, Value::ServerError(e) if refuses_connection(e))
}

/// Whether a server's error reply to a command sent at connect says it
/// turned this connection away (it closes it next).
pub(crate) fn refuses_connection(e: &redis::ServerError) -> bool {
    e.kind() == Some(redis::ServerErrorKind::BusyLoading)
        || e.details()
            .is_some_and(|d| d.contains("max number of clients reached"))
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;
    use crate::driver::node::encode::FACTS;
    use crate::driver::node::retries::Unsettled;

    fn node() -> NodeState {
        NodeState::for_tests()
    }

    fn value(resp: &[u8]) -> Value {
        redis::parse_redis_value(resp).expect("valid RESP")
    }

    /// An acquire reply (the history's facts, then one answer per key).
    fn acquired(answer: i64) -> Value {
        let mut items: Vec<Value> = (0..FACTS - 1).map(|_| Value::Int(0)).collect();
        items.push(Value::BulkString(Vec::new()));
        items.push(Value::Int(answer));
        Value::Array(items)
    }

    /// A connection state that sent `cmd` as a round's SET that ended without its
    /// reply: the reply is owed, no longer wanted, with its undo.
    fn late_set(token: &str) -> ConnState {
        let mut w = ConnState::new(Instant::now());
        w.queue(b"SET", Instant::now(), true);
        w.unwant(Some(b"UNDO"), &[token.to_owned()], None, &[]);
        w.written(w.output().len());
        w
    }

    fn unsettled(node: &NodeState, token: &str, released: bool) {
        let until = Instant::now() + Duration::from_secs(10);
        node.unsettled
            .lock()
            .insert(token.to_owned(), Unsettled { until, released });
    }

    #[test]
    fn a_late_set_that_landed_after_its_release_is_deleted_behind_it() {
        let n = node();
        unsettled(&n, "t", true);
        let mut w = late_set("t");
        let (p, v) = w.answer(acquired(1)).expect("owed");
        assert!(late_reply(&mut w, &n, p, &v, Instant::now()).expect("usable"));
        assert_eq!(
            w.output(),
            b"UNDO",
            "the delete goes out on the SET's connection"
        );
        assert!(
            n.undone.lock().contains_key("t"),
            "the release will count it deleted"
        );
        assert!(n.unsettled.lock().is_empty(), "the SET's reply settles it");
    }

    /// A late SET deleted behind its release (a lean one lands whatever
    /// the script cache holds): should the delete meet NOSCRIPT, it goes
    /// again as `EVAL`, or the key would stay for its whole TTL.
    #[test]
    fn a_late_sets_delete_that_meets_noscript_is_sent_again_as_eval() {
        let n = node();
        unsettled(&n, "t", true);
        let mut w = late_set("t");
        let epoch = Value::BulkString(b"1796000000000".to_vec());
        let lean = Value::Array(vec![Value::Okay, Value::Int(10_000), epoch]);
        let (p, v) = w.answer(lean).expect("owed");
        assert!(late_reply(&mut w, &n, p, &v, Instant::now()).expect("usable"));
        assert_eq!(w.output(), b"UNDO");
        w.written(w.output().len());
        let (p, v) = w
            .answer(value(b"-NOSCRIPT No matching script.\r\n"))
            .expect("owed");
        assert!(late_reply(&mut w, &n, p, &v, Instant::now()).expect("usable"));
        let out = String::from_utf8_lossy(w.output()).into_owned();
        assert!(
            out.contains("EVAL") && out.contains(scripts::RELEASE_LUA),
            "{out}"
        );
    }

    #[test]
    fn a_late_set_of_a_lock_still_held_stays() {
        let n = node();
        unsettled(&n, "t", false);
        let mut w = late_set("t");
        let (p, v) = w.answer(acquired(1)).expect("owed");
        assert!(!late_reply(&mut w, &n, p, &v, Instant::now()).expect("usable"));
        assert!(
            w.output().is_empty(),
            "a granted lock's late copy is part of it"
        );
        assert!(n.unsettled.lock().is_empty());
        // A SET that did not land is not deleted either, released or not.
        unsettled(&n, "u", true);
        let mut w = late_set("u");
        let (p, v) = w.answer(acquired(0)).expect("owed");
        assert!(!late_reply(&mut w, &n, p, &v, Instant::now()).expect("usable"));
        assert!(w.output().is_empty());
    }

    /// A settled release's late NOSCRIPT: the EVAL sent again carries the
    /// keys its round queued for retry, so that its answer takes them off
    /// the queue (else a healthy cycle after `SCRIPT FLUSH` deletes twice).
    #[test]
    fn a_late_noscript_release_sent_again_keeps_its_queued_keys() {
        let n = node();
        let mut w = ConnState::new(Instant::now());
        w.queue(b"EVALSHA release", Instant::now(), true);
        w.unwant(None, &[], Some(b"EVAL release"), &["t".to_owned()]);
        w.written(w.output().len());
        let (p, v) = w
            .answer(value(b"-NOSCRIPT No matching script.\r\n"))
            .expect("owed");
        assert!(late_reply(&mut w, &n, p, &v, Instant::now()).expect("usable"));
        assert!(n.answered.lock().is_empty(), "not run: still queued");
        w.written(w.output().len());
        let (p, v) = w.answer(Value::Array(vec![Value::Int(1)])).expect("owed");
        assert_eq!(p.retried, ["t"]);
        assert!(!late_reply(&mut w, &n, p, &v, Instant::now()).expect("usable"));
        assert_eq!(*n.answered.lock(), vec![vec!["t".to_owned()]]);
    }

    #[test]
    fn a_late_noscript_release_is_sent_again_as_eval_and_the_scripts_loaded() {
        let n = node();
        let mut w = ConnState::new(Instant::now());
        w.queue(b"EVALSHA release", Instant::now(), true);
        w.unwant(None, &[], Some(b"EVAL release"), &[]);
        w.written(w.output().len());
        let (p, v) = w
            .answer(value(b"-NOSCRIPT No matching script.\r\n"))
            .expect("owed");
        assert!(late_reply(&mut w, &n, p, &v, Instant::now()).expect("usable"));
        assert!(
            w.output().starts_with(b"EVAL release"),
            "the delete is never lost"
        );
        assert_eq!(
            w.pending().len(),
            1 + scripts::load_commands().len(),
            "the release again, then every script loaded"
        );
    }

    #[test]
    fn a_retried_release_answered_is_handed_to_the_retry_job() {
        let n = node();
        let mut w = ConnState::new(Instant::now());
        w.queue_retry(
            b"EVALSHA",
            Instant::now(),
            b"EVAL".to_vec(),
            vec!["a".into(), "b".into()],
        );
        let (p, v) = w
            .answer(Value::Array(vec![Value::Int(1), Value::Int(0)]))
            .expect("owed");
        assert!(!late_reply(&mut w, &n, p, &v, Instant::now()).expect("usable"));
        assert_eq!(
            *n.answered.lock(),
            vec![vec!["a".to_owned(), "b".to_owned()]]
        );
        // A NOSCRIPT is no answer: the batch stays queued, sent again as EVAL.
        let mut w = ConnState::new(Instant::now());
        w.queue_retry(
            b"EVALSHA",
            Instant::now(),
            b"EVAL".to_vec(),
            vec!["c".into()],
        );
        w.written(w.output().len());
        let (p, v) = w
            .answer(value(b"-NOSCRIPT No matching script.\r\n"))
            .expect("owed");
        late_reply(&mut w, &n, p, &v, Instant::now()).expect("usable");
        assert_eq!(n.answered.lock().len(), 1);
        assert!(w.output().starts_with(b"EVAL"));
    }

    #[test]
    fn a_server_that_turns_the_connection_away_refuses_it() {
        let n = node();
        let mut w = ConnState::new(Instant::now());
        w.queue_setup(b"INFO", Instant::now(), Setup::Info);
        let (p, v) = w
            .answer(value(b"-ERR max number of clients reached\r\n"))
            .expect("owed");
        let e = late_reply(&mut w, &n, p, &v, Instant::now()).expect_err("refused");
        assert_eq!(e.kind(), std::io::ErrorKind::ConnectionRefused);
        assert!(w.broken, "the connection is not used again");
        assert!(
            !n.is_healthy(),
            "turning a connection away is the node's answer"
        );
        // An INFO the ACL refuses is only a missing fact.
        let n = node();
        let mut w = ConnState::new(Instant::now());
        w.queue_setup(b"INFO", Instant::now(), Setup::Info);
        let (p, v) = w
            .answer(value(b"-NOPERM no INFO for you\r\n"))
            .expect("owed");
        assert!(!late_reply(&mut w, &n, p, &v, Instant::now()).expect("usable"));
        assert!(!w.broken && n.is_healthy());
    }

    /// The connect-time history script answers the id and the epoch: the
    /// connection learns the history's key (with the `run_id` of the
    /// `INFO` before it), and the node's connect is answered; a node with
    /// no history answers none, and so does an error.
    #[test]
    fn a_connect_learns_the_lock_history_that_had_begun() {
        let connect = |run: &[u8], history: &[u8]| {
            let n = node();
            let mut w = ConnState::new(Instant::now());
            w.queue_setup(b"INFO", Instant::now(), Setup::Info);
            w.queue_setup(b"EVAL", Instant::now(), Setup::History);
            for reply in [run, history] {
                let (p, v) = w.answer(value(reply)).expect("owed");
                late_reply(&mut w, &n, p, &v, Instant::now()).expect("usable");
            }
            (
                n.servers.begun_read(0),
                n.servers.begun_keys(),
                w.history_key,
            )
        };
        let info = b"$12\r\nrun_id:abc\r\n\r\n";
        let key = crate::algorithm::round::history_key(Some("abc"), 1_700);
        assert_eq!(
            connect(info, b"*2\r\n$2\r\nid\r\n$4\r\n1700\r\n"),
            (true, vec![key], Some((1_700, key)))
        );
        assert_eq!(
            connect(info, b"*2\r\n$2\r\nid\r\n$0\r\n\r\n"),
            (true, vec![0], None)
        );
        assert_eq!(connect(info, b"-NOPERM no\r\n"), (true, vec![0], None));
        // A check's connection (`HGET id`) says nothing of the history.
        assert_eq!(connect(info, b"$2\r\nid\r\n"), (false, vec![0], None));
    }

    #[test]
    fn a_reply_to_no_command_breaks_the_wire() {
        let mut w = ConnState::new(Instant::now());
        assert!(w.answer(Value::Okay).is_err());
        assert!(w.broken);
    }
}
