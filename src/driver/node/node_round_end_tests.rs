//! One node's part at the end of a round (`end_part`): what stays owed,
//! the errors of nodes without a result, and what a late release reply
//! does to the retry queue. On a [`ConnState`](crate::driver::conn_state::ConnState), no
//! socket.

use std::time::{Duration, Instant};

use super::tests::{acquire, ballot_for, node, release, sent_on, TestLink};
use super::*;
use crate::algorithm::round::Key;
use crate::driver::node::replies::give_up_why;

const MS: Duration = Duration::from_millis(1);

/// Ends node 0's `part` in a round of `enc` on `keys` begun at `start`, at
/// `now`, with the round's `deadline`, settled or not: whether the
/// connection was given up with commands to send, and node 0's result.
fn end_at(
    n: &NodeState,
    enc: &Encoded,
    keys: &[Key<'_>],
    part: &mut NodeRound<TestLink>,
    start: Instant,
    (now, deadline, settled): (Instant, Instant, bool),
) -> (bool, Option<NodeResult>) {
    let names = vec!["n0".to_owned()];
    let left = LateReplies::of(enc, keys, std::slice::from_ref(&*part), start);
    let none = |_: usize| None;
    let ended = End {
        now,
        start,
        deadline,
        settled,
        pool_busy: &none,
    };
    let mut result = None;
    let flush = end_part(
        &ballot_for(enc, &names),
        0,
        part,
        n,
        &left,
        &ended,
        &mut result,
    );
    (flush, result)
}

#[test]
fn a_reply_past_the_node_timeout_gives_its_connection_up_with_the_undo_sent() {
    let (n, enc) = (node(), acquire());
    let start = Instant::now();
    let mut parts = [sent_on(&enc, start, start)];
    let keys = [Key::new("r", "t")];
    let (flush, result) = end_at(
        &n,
        &enc,
        &keys,
        &mut parts[0],
        start,
        (start + 60 * MS, start + 50 * MS, false),
    );
    assert!(flush, "the undo goes out before the connection is dropped");
    let wire = parts[0].conn.as_ref().expect("still held").wire();
    assert!(wire.broken);
    assert!(wire.output().ends_with(
        &Encoded::new(
            Op::Release {
                keep_until: start + Duration::from_secs(10),
                notice: 0,
            },
            &keys
        )
        .packed
    ));
    assert_eq!(
        result.expect("set").expect_err("failed").kind(),
        NodeErrorKind::Timeout
    );
    assert!(
        !n.is_healthy(),
        "no reply within the node timeout is the node's doing"
    );
    assert!(n.unsettled.lock().contains_key("t"));
}

/// A command of 400 keys has three node timeouts (150 ms) for its reply:
/// owed 60 ms after it left when its round settled without it, its
/// connection is kept for the next round and its node stays healthy; owed
/// past 150 ms, the connection is given up as the node's doing.
#[test]
fn a_big_commands_reply_is_overdue_only_past_its_keys_allowance() {
    let n = node();
    let names: Vec<String> = (0..400).map(|i| format!("r{i}")).collect();
    let keys: Vec<Key<'_>> = names.iter().map(|r| Key::new(r, "t")).collect();
    let enc = Encoded::new(acquire().op, &keys);
    let start = Instant::now();
    let mut part = sent_on(&enc, start, start);
    let ends = (start + 60 * MS, start + 150 * MS, true);
    let (flush, _) = end_at(&n, &enc, &keys, &mut part, start, ends);
    let wire = part.conn.as_ref().expect("kept").wire();
    assert!(!flush && !wire.broken, "kept for the next round");
    assert!(n.is_healthy(), "within its allowance: not the node's doing");
    assert_eq!(give_up_why(wire, &n, start + 149 * MS), None);
    assert_eq!(give_up_why(wire, &n, start + 150 * MS), Some(true));
    let mut part = sent_on(&enc, start, start);
    let ends = (start + 150 * MS, start + 150 * MS, false);
    let (_, result) = end_at(&n, &enc, &keys, &mut part, start, ends);
    assert!(part.conn.as_ref().expect("held").wire().broken);
    assert_eq!(
        result.expect("set").expect_err("failed").kind(),
        NodeErrorKind::Timeout
    );
    assert!(!n.is_healthy(), "past its allowance: the node's doing");
}

#[test]
fn a_round_settled_before_a_reply_leaves_it_owed_with_its_undo() {
    let (n, enc) = (node(), acquire());
    let start = Instant::now();
    let mut parts = [sent_on(&enc, start, start)];
    let keys = [Key::new("r", "t")];
    let (flush, result) = end_at(
        &n,
        &enc,
        &keys,
        &mut parts[0],
        start,
        (start + 2 * MS, start + 50 * MS, true),
    );
    assert!(!flush);
    let wire = parts[0].conn.as_ref().expect("kept").wire();
    assert!(
        !wire.broken && !wire.awaits_wanted(),
        "owed, no longer wanted"
    );
    let p = wire.pending().front().expect("owed");
    assert!(p.undo.is_some() && p.tokens == vec!["t".to_owned()]);
    assert_eq!(
        result.expect("set").expect_err("no vote").kind(),
        NodeErrorKind::NotAwaited
    );
    assert!(n.is_healthy(), "settling early says nothing of the node");
}

#[test]
fn a_node_left_without_a_connection_says_why() {
    let (n, enc, names) = (node(), acquire(), vec!["n0".to_owned()]);
    let start = Instant::now();
    let unsent = || NodeRound::<TestLink> {
        admit: Admit::Wait,
        conn: None,
        sent: None,
        fell_back: false,
        began: start,
        lost: false,
        again: false,
    };
    let left = LateReplies::of(&enc, &[], &[unsent()], start);
    let detail = |busy: Option<u32>, lost: bool| {
        let pool = move |_: usize| busy;
        let ended = End {
            now: start,
            start,
            deadline: start + 50 * MS,
            settled: false,
            pool_busy: &pool,
        };
        let mut part = NodeRound { lost, ..unsent() };
        let mut result = None;
        end_part(
            &ballot_for(&enc, &names),
            0,
            &mut part,
            &n,
            &left,
            &ended,
            &mut result,
        );
        result.expect("set").expect_err("no vote")
    };
    let e = detail(Some(32), false);
    assert_eq!(e.kind(), NodeErrorKind::NoConnection);
    assert!(e.detail().contains("all 32 pooled connections busy"), "{e}");
    assert!(detail(None, false).detail().contains("still connecting"));
    assert_eq!(
        detail(None, true).kind(),
        NodeErrorKind::Io,
        "a lost command may have run"
    );
}

/// Issue 21: a round whose thread sent its command late, and got the CPU
/// back only after the deadline, says so instead of "no reply in 12µs",
/// and the node is not charged a timeout.
#[test]
fn a_timeout_the_client_caused_says_so() {
    let (n, enc) = (node(), acquire());
    let start = Instant::now();
    let sent = start + Duration::from_micros(49_988);
    let mut parts = [sent_on(&enc, start, sent)];
    let keys = [Key::new("r", "t")];
    let (_, result) = end_at(
        &n,
        &enc,
        &keys,
        &mut parts[0],
        start,
        (start + 53 * MS, start + 50 * MS, false),
    );
    let e = result.expect("set").expect_err("failed");
    assert_eq!(e.kind(), NodeErrorKind::Timeout);
    let detail = e.to_string();
    assert!(detail.contains("less than the node timeout"), "{detail}");
    assert!(detail.contains("after the round began"), "{detail}");
    assert!(
        detail.contains("got the CPU back 3ms after the round's deadline"),
        "{detail}"
    );
    assert!(n.is_healthy(), "not the node's doing");
}

/// Issue 21: a release round that settled before a node's reply queues
/// that node's delete for the retry job (its connection may be closed
/// before the node reads it); the late reply, once read, takes it off the
/// queue again, so a healthy cycle sends no delete twice. An error reply
/// (the script did not run) leaves it queued.
#[test]
fn a_late_release_reply_takes_its_retry_off_the_queue() {
    use crate::driver::node::replies::late_reply;
    for (reply, answered) in [
        (Value::Array(vec![Value::Int(1)]), true),
        (
            redis::parse_redis_value(b"-BUSY a script is running\r\n").expect("RESP"),
            false,
        ),
    ] {
        let (n, enc) = (node(), release());
        let start = Instant::now();
        let mut parts = [sent_on(&enc, start, start)];
        let keys = [Key::new("r", "t")];
        end_at(
            &n,
            &enc,
            &keys,
            &mut parts[0],
            start,
            (start + MS, start + 50 * MS, true),
        );
        let wire = &mut parts[0].conn.as_mut().expect("kept").0;
        wire.written(wire.output().len());
        let (p, v) = wire.answer(reply).expect("owed");
        assert_eq!(p.retried, ["t"], "the queued delete's token");
        late_reply(wire, &n, p, &v, Instant::now()).expect("usable");
        let got = n.answered.lock().clone();
        if answered {
            assert_eq!(got, vec![vec!["t".to_owned()]]);
        } else {
            assert!(got.is_empty(), "{got:?}");
        }
    }
}

/// A round whose own deadline was nearer than a node timeout (a short
/// validity, the caller's wait) says that is why it waited less.
#[test]
fn a_timeout_at_the_rounds_own_deadline_says_so() {
    let (n, enc) = (node(), acquire());
    let start = Instant::now();
    let mut parts = [sent_on(&enc, start, start)];
    let keys = [Key::new("r", "t")];
    let (_, result) = end_at(
        &n,
        &enc,
        &keys,
        &mut parts[0],
        start,
        (start + 10 * MS, start + 10 * MS, false),
    );
    let detail = result.expect("set").expect_err("failed").to_string();
    assert!(detail.contains("the round's deadline"), "{detail}");
    assert!(!detail.contains("CPU"), "{detail}");
}
