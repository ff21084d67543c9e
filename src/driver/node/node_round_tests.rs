//! One node's part in a round, driven by parsed replies and errors on a
//! [`ConnState`](crate::driver::conn_state::ConnState), no socket.

use std::time::{Duration, Instant};

use super::*;
use crate::algorithm::round::Key;

const NAMES: [&str; 1] = ["n0"];

pub(super) fn node() -> NodeState {
    NodeState::for_tests()
}

pub(super) fn release() -> Encoded {
    let op = Op::Release {
        keep_until: Instant::now() + Duration::from_secs(10),
        notice: 0,
    };
    Encoded::new(op, &[Key::new("r", "t")])
}

/// Sends `enc` as a wanted command on a new connection state, and takes reply `v`
/// to it; returns what `take_reply` said, the connection state and the result.
fn take(
    enc: &Encoded,
    n: &NodeState,
    fell_back: &mut bool,
    lost: bool,
    v: Value,
) -> (std::io::Result<bool>, ConnState, Option<NodeResult>) {
    let names: Vec<String> = NAMES.iter().map(|s| s.to_string()).collect();
    let ballot = VoteContext {
        enc,
        names: &names,
        rules: VoteRules::default(),
    };
    let mut w = ConnState::new(Instant::now());
    w.queue(&enc.packed, Instant::now(), true);
    w.written(w.output().len());
    let pv = w.answer(v).expect("owed");
    let mut results = vec![None];
    let r = take_reply(
        &ballot,
        0,
        fell_back,
        lost,
        &mut w,
        n,
        pv,
        Instant::now(),
        &mut results,
    );
    (r, w, results.pop().flatten())
}

fn noscript() -> Value {
    redis::parse_redis_value(b"-NOSCRIPT No matching script.\r\n").expect("RESP")
}

#[test]
fn noscript_sends_the_eval_fallback_once_then_counts_the_error() {
    let (n, enc) = (node(), release());
    let mut fell_back = false;
    let (r, w, result) = take(&enc, &n, &mut fell_back, false, noscript());
    assert!(r.expect("usable"), "the fallback is to be sent now");
    assert!(
        fell_back && result.is_none(),
        "no vote yet: the EVAL's reply is it"
    );
    assert_eq!(w.output(), &enc.fallback()[..]);
    assert!(
        w.awaits_wanted(),
        "the round waits for the fallback's reply"
    );
    // NOSCRIPT again (the EVAL itself refused): the node's error, counted.
    let (r, _, result) = take(&enc, &n, &mut fell_back, false, noscript());
    assert!(!r.expect("usable"));
    let e = result.expect("counted").expect_err("an error");
    assert_eq!(e.kind(), NodeErrorKind::Server);
}

#[test]
fn a_release_finding_its_own_undone_key_absent_counts_it_deleted() {
    let (n, enc) = (node(), release());
    let absent = || Value::Array(vec![Value::Int(0)]);
    let (_, _, result) = take(&enc, &n, &mut false, false, absent());
    let reply = result.expect("counted").expect("a reply");
    assert_eq!(reply.answers, vec![Answer::Absent], "absent is absent");
    // Deleted by this client's own undo of a late SET: that is ours.
    let until = Instant::now() + Duration::from_secs(10);
    n.undone.lock().insert("t".into(), until);
    let (_, _, result) = take(&enc, &n, &mut false, false, absent());
    let reply = result.expect("counted").expect("a reply");
    assert_eq!(reply.answers, vec![Answer::Ok]);
    assert!(n.undone.lock().is_empty(), "counted once");
}

#[test]
fn a_release_sent_again_after_a_lost_connection_cannot_tell_absent_from_deleted() {
    let (n, enc) = (node(), release());
    let (_, _, result) = take(
        &enc,
        &n,
        &mut false,
        true,
        Value::Array(vec![Value::Int(0)]),
    );
    let e = result.expect("counted").expect_err("not a vote");
    assert_eq!(e.kind(), NodeErrorKind::Io, "the first delete may have run");
    // Found ours and deleted: that is an answer.
    let (_, _, result) = take(
        &enc,
        &n,
        &mut false,
        true,
        Value::Array(vec![Value::Int(1)]),
    );
    assert_eq!(
        result.expect("counted").expect("a reply").answers,
        vec![Answer::Ok]
    );
}

#[test]
fn a_reply_names_the_server_that_answered() {
    let (n, enc) = (node(), release());
    n.servers.learn_history(0, 77);
    let (_, _, result) = take(
        &enc,
        &n,
        &mut false,
        false,
        Value::Array(vec![Value::Int(1)]),
    );
    let tag = result
        .expect("counted")
        .expect("a reply")
        .server
        .expect("tagged");
    assert_eq!(tag.history, Some(77), "the node's last reported history");
    assert!(n.is_healthy());
}

pub(super) struct TestLink(pub(super) ConnState);

impl Link for TestLink {
    type Handle = ();

    fn handle(&self) -> Option<()> {
        None
    }
    type Ready = ();

    fn wire(&self) -> &ConnState {
        &self.0
    }

    fn wire_mut(&mut self) -> &mut ConnState {
        &mut self.0
    }

    fn flush(&mut self) -> std::io::Result<()> {
        let n = self.0.output().len();
        self.0.written(n);
        Ok(())
    }

    fn on_ready(&mut self, (): ()) -> std::io::Result<()> {
        Ok(())
    }

    fn next_reply(&mut self) -> std::io::Result<Option<(InFlight, Value)>> {
        Ok(None)
    }

    fn wants_write(&self) -> bool {
        false
    }

    fn read_all(&mut self) -> std::io::Result<()> {
        Ok(())
    }

    fn abandon(&mut self) {
        self.0.give_up(Instant::now());
        self.0.broken = true;
    }
}

pub(super) fn acquire() -> Encoded {
    let op = Op::Acquire {
        lean: None,
        intent: std::time::Duration::ZERO,
        place: crate::algorithm::round::Place::NONE,
        ttl: Duration::from_secs(10),
        known_max: Duration::from_secs(10),
        fenced: false,
        after: crate::algorithm::round::After::NONE,
        known_prev: std::time::Duration::ZERO,
    };
    Encoded::new(op, &[Key::new("r", "t")])
}

/// A part that sent `enc` at `began` on a connection made at `made`.
pub(super) fn sent_on(enc: &Encoded, made: Instant, began: Instant) -> NodeRound<TestLink> {
    let mut w = ConnState::new(made);
    w.queue_keys(&enc.packed, began, true, enc.n);
    NodeRound {
        admit: Admit::Wait,
        conn: Some(TestLink(w)),
        sent: Some(began),
        fell_back: false,
        began,
        lost: false,
        again: false,
    }
}

pub(super) fn ballot_for<'a>(enc: &'a Encoded, names: &'a [String]) -> VoteContext<'a> {
    VoteContext {
        enc,
        names,
        rules: VoteRules::default(),
    }
}

fn closed() -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset")
}

#[test]
fn a_close_of_a_connection_older_than_the_round_sends_again() {
    let (n, enc, names) = (node(), acquire(), vec!["n0".to_owned()]);
    let began = Instant::now();
    let mut part = sent_on(&enc, began - Duration::from_secs(1), began);
    let mut results = vec![None];
    lose_connection(
        &ballot_for(&enc, &names),
        0,
        &mut part,
        &n,
        closed(),
        &mut results,
    );
    assert!(results[0].is_none(), "not the node's answer");
    assert!(
        part.sent.is_none() && part.conn.is_none(),
        "to be sent again"
    );
    assert!(part.lost, "the first SET may have run");
    assert!(n.is_healthy());
    assert!(
        n.unsettled.lock().contains_key("t"),
        "a release deletes behind a SET that may still land"
    );
}

#[test]
fn a_close_of_a_connection_made_during_the_round_is_the_nodes_answer() {
    let (n, enc, names) = (node(), acquire(), vec!["n0".to_owned()]);
    let began = Instant::now();
    let mut part = sent_on(&enc, began, began);
    let mut results = vec![None];
    lose_connection(
        &ballot_for(&enc, &names),
        0,
        &mut part,
        &n,
        closed(),
        &mut results,
    );
    let e = results[0].take().expect("answered").expect_err("failed");
    assert_eq!(e.kind(), NodeErrorKind::Io);
    assert!(!n.is_healthy(), "a node that resets connections is failing");
    // Bytes that are not RESP are an answer, of the wrong kind.
    let n = node();
    let mut part = sent_on(&enc, began, began);
    let bad = std::io::Error::new(std::io::ErrorKind::InvalidData, "not RESP");
    lose_connection(
        &ballot_for(&enc, &names),
        0,
        &mut part,
        &n,
        bad,
        &mut results,
    );
    let e = results[0].take().expect("answered").expect_err("failed");
    assert_eq!(e.kind(), NodeErrorKind::Protocol);
    assert!(n.is_healthy());
}

/// Issue 21: the acquire script no longer reads `INFO`; the connection's
/// own reading of it caps the age at the server's uptime (a node restarted
/// from a snapshot keeps an old history) and names the history by its
/// `run_id` and epoch, as every client does.
#[test]
fn a_connections_info_caps_the_age_and_names_the_history() {
    let (n, enc) = (node(), acquire());
    let names = vec!["n0".to_owned()];
    let now = Instant::now();
    let facts = |w: &mut ConnState, age_ms: i64| {
        w.queue(&enc.packed, now, true);
        w.written(w.output().len());
        // epoch 1000, age, longest TTL 10 s, prev 10 s, after "", set.
        let v = Value::Array(vec![
            Value::Int(1000),
            Value::Int(age_ms),
            Value::Int(10_000),
            Value::Int(10_000),
            Value::BulkString(Vec::new()),
            Value::Int(1),
        ]);
        let pv = w.answer(v).expect("owed");
        let mut results = vec![None];
        take_reply(
            &ballot_for(&enc, &names),
            0,
            &mut false,
            false,
            w,
            &n,
            pv,
            now,
            &mut results,
        )
        .expect("taken");
        let reply = results.pop().flatten().expect("voted").expect("a reply");
        reply.facts.expect("facts")
    };
    let mut w = ConnState::new(now);
    w.run_id = Some("8a3f".into());
    // Up for 3 s (INFO said 4, less its one-second resolution), read now.
    w.uptime = Some((Duration::from_secs(3), now));
    let f = facts(&mut w, 3_600_000);
    assert_eq!(f.age, Duration::from_secs(3), "capped at the uptime");
    assert_eq!(
        f.history,
        crate::algorithm::round::history_key(Some("8a3f"), 1000)
    );
    // No INFO (an ACL refused it): no cap, and the epoch alone names it.
    let mut w = ConnState::new(now);
    let f = facts(&mut w, 3_600_000);
    assert_eq!(f.age, Duration::from_secs(3600));
    assert_eq!(f.history, crate::algorithm::round::history_key(None, 1000));
    // A restart (another run id) or another epoch is another history.
    let keys = [
        (Some("8a3f"), 1000),
        (Some("8a40"), 1000),
        (Some("8a3f"), 1001),
        (None, 1000),
    ]
    .map(|(r, e)| crate::algorithm::round::history_key(r, e));
    for (i, a) in keys.iter().enumerate() {
        assert!(*a < 1 << 48, "exact in a Lua number");
        assert!(keys[i + 1..].iter().all(|b| b != a), "{keys:?}");
    }
}

/// The uptime bound grows with the time since `INFO` was read, a little
/// slower than the client's clock, and never before it was read.
#[test]
fn the_uptime_bound_grows_slower_than_the_clock() {
    let read = Instant::now();
    let mut w = ConnState::new(read);
    assert_eq!(w.uptime_at(read), None, "no INFO read");
    w.uptime = Some((Duration::from_secs(3), read));
    assert_eq!(w.uptime_at(read), Some(Duration::from_secs(3)));
    let later = read + Duration::from_secs(100);
    assert_eq!(w.uptime_at(later), Some(Duration::from_secs(102)));
    let earlier = read.checked_sub(Duration::from_secs(1)).unwrap_or(read);
    assert_eq!(w.uptime_at(earlier), Some(Duration::from_secs(3)));
}

/// The history's key is the one earlier releases' scripts made, so that
/// clients of both name one history alike during an upgrade:
/// `tonumber(string.sub(redis.sha1hex(run .. ':' .. epoch), 1, 12), 16)`
/// (`sha1sum` of `abc:1796176031670` begins `b878996a62f9`; Redis 7's Lua
/// prints that epoch with all its digits).
#[test]
fn the_history_key_is_the_one_the_scripts_made() {
    assert_eq!(
        crate::algorithm::round::history_key(Some("abc"), 1_796_176_031_670),
        0xb878_996a_62f9
    );
}

/// A script's read of a node keeps the generation of the history it reads
/// again (another round's script does not void a lean round's decision),
/// and a new history gets the next one: a lean reply of a round decided
/// before it is held back, and leaves the new read in place.
#[test]
fn a_history_read_again_keeps_its_generation_and_a_new_one_voids_older_decisions() {
    let shared = NodeState::for_tests();
    let facts = |history: u64, epoch: u64| NodeFacts {
        epoch,
        age: Duration::from_secs(60),
        max_ttl: Duration::from_secs(10),
        history,
        after: crate::algorithm::round::After::NONE,
        prev_max: Duration::ZERO,
    };
    let sent = Instant::now();
    let gen = |s: &NodeState| s.read.lock().map(|r| r.gen);
    assert!(read_or_confirm(&shared, None, facts(7, 1), sent).is_some());
    let first = gen(&shared).expect("read");
    read_or_confirm(&shared, None, facts(7, 1), sent);
    assert_eq!(gen(&shared), Some(first), "the same history");
    // A lean reply of a round decided on it stands, with the read's facts.
    let lean = |s: &NodeState, history: u64, decided: u64| {
        read_or_confirm(s, Some(decided), facts(history, 1), sent)
    };
    assert_eq!(
        lean(&shared, 7, first).map(|f| f.max_ttl),
        Some(Duration::from_secs(10))
    );
    // Another round's script reads a new history (a flush): a round decided
    // before it does not take it, and the read stays for the next rounds.
    read_or_confirm(&shared, None, facts(8, 2), sent);
    let second = gen(&shared).expect("read");
    assert!(second > first);
    assert_eq!(lean(&shared, 8, first), None);
    assert_eq!(gen(&shared), Some(second), "kept");
    assert!(lean(&shared, 8, second).is_some());
    // A history that changed since the read: held back, and read again.
    assert_eq!(lean(&shared, 9, second), None);
    assert_eq!(gen(&shared), None);
}
