//! The multiplexed connection's rules on a scripted connection: replies paired with their
//! owners, late replies of rounds that left, the close and the timeout for
//! every owner, one batch in flight, the reader role's hand-over, and the
//! connection given back.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use super::*;
use crate::driver::conn_state::{is_given_up, InFlight};

/// What a scripted connection was sent, what it will read, and what it
/// owed when it was given back.
#[derive(Default)]
pub(super) struct Script {
    pub(super) written: Vec<u8>,
    replies: VecDeque<Value>,
    closed: bool,
    given_back: Option<Vec<InFlight>>,
}

pub(super) struct Scripted {
    pub(super) wire: ConnState,
    pub(super) script: Arc<Mutex<Script>>,
}

impl Drop for Scripted {
    fn drop(&mut self) {
        let owed = self.wire.pending().iter().cloned().collect();
        self.script.lock().given_back = Some(owed);
    }
}

impl Link for Scripted {
    type Ready = ();
    type Handle = ();

    fn handle(&self) -> Option<()> {
        None
    }

    fn wire(&self) -> &ConnState {
        &self.wire
    }

    fn wire_mut(&mut self) -> &mut ConnState {
        &mut self.wire
    }

    fn flush(&mut self) -> io::Result<()> {
        let out = self.wire.output().to_vec();
        self.script.lock().written.extend_from_slice(&out);
        self.wire.written(out.len());
        Ok(())
    }

    fn on_ready(&mut self, (): ()) -> io::Result<()> {
        self.read_all()
    }

    fn next_reply(&mut self) -> io::Result<Option<(InFlight, Value)>> {
        let v = self.script.lock().replies.pop_front();
        match v {
            Some(v) => self.wire.answer(v).map(Some),
            None => Ok(None),
        }
    }

    fn wants_write(&self) -> bool {
        false
    }

    fn read_all(&mut self) -> io::Result<()> {
        // Like a socket: what arrived before the close is read, then the
        // close is the read's error.
        if self.script.lock().closed {
            return Err(io::Error::new(
                io::ErrorKind::ConnectionReset,
                "connection reset",
            ));
        }
        Ok(())
    }

    fn abandon(&mut self) {
        if self.wire.give_up(Instant::now()) {
            let _ = self.flush();
        }
        self.wire.broken = true;
    }
}

#[derive(Default)]
pub(super) struct Count(pub(super) AtomicUsize);

impl Wake for Count {
    fn wake(&self) {
        self.0.fetch_add(1, Ordering::AcqRel);
    }
}

pub(super) fn line() -> (
    Arc<Multiplexed<Scripted>>,
    Arc<Mutex<Script>>,
    Arc<NodeState>,
) {
    let script = Arc::new(Mutex::new(Script::default()));
    let node = Arc::new(NodeState::for_tests());
    let conn = Scripted {
        wire: ConnState::new(Instant::now()),
        script: script.clone(),
    };
    (
        Multiplexed::new(conn, node.clone(), Weak::new(), Weak::new()),
        script,
        node,
    )
}

fn int(n: i64) -> Value {
    Value::Int(n)
}

pub(super) fn send(s: &mut RoundConn<Scripted>, cmd: &[u8]) {
    s.wire_mut().queue(cmd, Instant::now(), true);
    s.flush().expect("sent");
}

fn reply(s: &mut RoundConn<Scripted>) -> Option<Value> {
    s.next_reply().expect("no error").map(|(_, v)| v)
}

#[test]
fn rounds_on_one_line_get_their_own_replies_in_order() {
    let (line, script, _) = line();
    let mut a = line.admit(None, Instant::now()).expect("open");
    let mut b = line.admit(None, Instant::now()).expect("open");
    send(&mut a, b"A1");
    send(&mut b, b"B1");
    send(&mut a, b"A2");
    assert_eq!(
        script.lock().written,
        b"A1",
        "B1 and A2 wait for A1's reply"
    );
    script.lock().replies.push_back(int(1));
    line.pump(None);
    assert_eq!(script.lock().written, b"A1B1A2", "one stream, in order");
    script.lock().replies.extend([int(2), int(3)]);
    line.pump(None);
    assert_eq!(reply(&mut b), Some(int(2)));
    assert_eq!(reply(&mut a), Some(int(1)));
    assert_eq!(reply(&mut a), Some(int(3)));
    assert_eq!(reply(&mut a), None);
    assert!(!a.wire().awaits_wanted() && !b.wire().awaits_wanted());
}

#[test]
fn a_late_reply_of_a_round_that_left_is_taken_by_the_late_reply_rules() {
    let (line, script, _) = line();
    let mut a = line.admit(None, Instant::now()).expect("open");
    let b = line.admit(None, Instant::now()).expect("open");
    send(&mut a, b"RELEASE");
    // The round ended before the reply: a release is sent again as EVAL
    // if it met NOSCRIPT.
    a.wire_mut().unwant(None, &[], Some(b"EVAL-RELEASE"), &[]);
    drop(a);
    let noscript = redis::parse_redis_value(b"-NOSCRIPT No matching script.\r\n").expect("RESP");
    script.lock().replies.push_back(noscript);
    line.pump(None);
    let written = script.lock().written.clone();
    assert!(
        written.starts_with(b"RELEASEEVAL-RELEASE"),
        "the resend follows on the same connection: {:?}",
        String::from_utf8_lossy(&written)
    );
    drop(b);
    drop(line);
    // The resend and the script loads are owed by the connection given back.
    let owed = script.lock().given_back.clone().expect("given back");
    assert!(owed.len() >= 2, "owed {owed:?}");
    assert!(owed.iter().all(|p| p.owner == 0 && !p.wanted));
}

#[test]
fn the_last_round_out_gives_the_connection_back_owing_what_it_owed() {
    let (line, script, _) = line();
    let mut a = line.admit(None, Instant::now()).expect("open");
    send(&mut a, b"RELEASE");
    a.wire_mut().unwant(None, &[], Some(b"EVAL-RELEASE"), &[]);
    drop(a);
    drop(line);
    let owed = script.lock().given_back.clone().expect("given back");
    assert_eq!(owed.len(), 1);
    assert_eq!(owed[0].owner, 0, "the connection's own entry now");
    assert_eq!(owed[0].resend.as_deref(), Some(&b"EVAL-RELEASE"[..]));
}

#[test]
fn a_close_is_every_owed_rounds_answer_and_no_one_joins_the_line() {
    let (line, script, _) = line();
    let mut a = line.admit(None, Instant::now()).expect("open");
    let mut b = line.admit(None, Instant::now()).expect("open");
    send(&mut a, b"A1");
    send(&mut b, b"B1");
    {
        let mut s = script.lock();
        s.replies.push_back(int(1));
        s.closed = true;
    }
    line.pump(None);
    // What arrived before the close is read first.
    assert_eq!(reply(&mut a), Some(int(1)));
    let e = b.next_reply().expect_err("the close");
    assert_eq!(e.kind(), io::ErrorKind::ConnectionReset);
    assert!(a.next_reply().expect("nothing owed").is_none());
    assert!(line.admit(None, Instant::now()).is_none());
    assert!(
        a.flush().is_err() && a.wire().broken,
        "a closed line sends nothing"
    );
}

#[test]
fn a_reply_owed_past_the_node_timeout_ends_the_line_for_every_owner() {
    let (line, _, node) = line();
    let mut a = line.admit(None, Instant::now()).expect("open");
    let long_ago = Instant::now()
        .checked_sub(node.timeout * 2)
        .expect("a monotonic clock this old");
    a.wire_mut().queue(b"A1", long_ago, true);
    a.flush().expect("sent");
    assert!(node.is_healthy());
    assert!(line.admit(None, Instant::now()).is_none(), "given up");
    let e = a.next_reply().expect_err("the timeout");
    assert_eq!(e.kind(), io::ErrorKind::TimedOut);
    // The node's own doing: observed.
    assert!(matches!(
        *node.health.lock(),
        crate::algorithm::health::NodeHealth::Failing {
            last: Outcome::TimedOut,
            ..
        }
    ));
}

#[test]
fn a_reply_wakes_its_owner_only_while_it_waits() {
    let (line, script, _) = line();
    let woken = Arc::new(Count::default());
    let mut a = line.admit(None, Instant::now()).expect("open");
    let mut b = line
        .admit(Some(woken.clone() as Arc<dyn Wake>), Instant::now())
        .expect("open");
    send(&mut a, b"A1");
    send(&mut b, b"B1");
    send(&mut b, b"B2");
    script.lock().replies.push_back(int(1));
    line.pump(None);
    assert_eq!(woken.0.load(Ordering::Acquire), 0, "not waiting: not woken");
    assert_eq!(reply(&mut a), Some(int(1)));
    assert!(!line.watch(b.id), "waits");
    script.lock().replies.push_back(int(2));
    line.pump(None);
    assert_eq!(woken.0.load(Ordering::Acquire), 1);
    assert!(line.watch(b.id), "its reply is there");
    assert_eq!(reply(&mut b), Some(int(2)));
}

/// A batch answered in part keeps what is staged behind it: the next write
/// goes out when its last reply is read, with everything staged meanwhile.
#[test]
fn the_next_batch_waits_for_the_last_reply_of_the_one_in_flight() {
    let (line, script, _) = line();
    let mut a = line.admit(None, Instant::now()).expect("open");
    let mut b = line.admit(None, Instant::now()).expect("open");
    let mut c = line.admit(None, Instant::now()).expect("open");
    send(&mut a, b"A1");
    send(&mut b, b"B1");
    assert_eq!(script.lock().written, b"A1");
    script.lock().replies.push_back(int(1));
    line.pump(None);
    assert_eq!(script.lock().written, b"A1B1");
    send(&mut c, b"C1");
    send(&mut a, b"A2");
    assert_eq!(script.lock().written, b"A1B1", "B1 is in flight");
    script.lock().replies.push_back(int(2));
    line.pump(None);
    assert_eq!(script.lock().written, b"A1B1C1A2", "both in one write");
}

#[test]
fn a_reply_that_arrived_unread_is_read_before_it_is_taken_as_overdue() {
    let (line, script, node) = line();
    let mut a = line.admit(None, Instant::now()).expect("open");
    let long_ago = Instant::now()
        .checked_sub(node.timeout * 2)
        .expect("a monotonic clock this old");
    a.wire_mut().queue(b"A1", long_ago, true);
    a.flush().expect("sent");
    // It arrived; no round read it.
    script.lock().replies.push_back(int(1));
    let b = line.admit(None, Instant::now());
    assert!(b.is_some(), "the line was given up for a reply it had");
    assert!(node.is_healthy(), "a timeout was charged");
    assert_eq!(reply(&mut a), Some(int(1)));
}

#[test]
fn a_line_given_up_says_so_apart_from_a_socket_timeout() {
    assert!(is_given_up(&timed_out()));
    let socket = io::Error::new(io::ErrorKind::TimedOut, "connection timed out");
    assert!(!is_given_up(&socket));
    let closed = (io::ErrorKind::TimedOut, timed_out().to_string(), true);
    assert!(
        is_given_up(&error_of(&closed)),
        "kept through the line's end"
    );
}

/// A multiplexed connection owing as many replies as a connection may owe takes no new round,
/// but stays for the rounds on it: their replies still come (too many
/// owed is no failure of theirs, nor of the node).
#[test]
fn a_full_line_refuses_new_rounds_and_keeps_its_own() {
    let (line, script, node) = line();
    let mut a = line.admit(None, Instant::now()).expect("open");
    for _ in 0..crate::driver::conn::MAX_PENDING {
        a.wire_mut().queue(b"A", Instant::now(), true);
    }
    a.flush().expect("sent");
    assert!(line.admit(None, Instant::now()).is_none(), "full");
    assert!(node.is_healthy(), "too many owed is not the node's doing");
    script.lock().replies.push_back(int(7));
    line.pump(None);
    assert_eq!(
        reply(&mut a),
        Some(int(7)),
        "the line went on for its rounds"
    );
    assert!(!a.wire().broken);
}

/// While another round reads the multiplexed connection and replies are owed, a round's
/// commands wait staged for the reader's next write: nothing is written
/// until the reader has read, then all of it at once. A close before that
/// is the staged round's answer too.
#[test]
fn commands_staged_behind_a_batch_in_flight_go_out_with_the_readers_next_write() {
    let (line, script, _) = line();
    let mut a = line.admit(None, Instant::now()).expect("open");
    let mut b = line.admit(None, Instant::now()).expect("open");
    let mut c = line.admit(None, Instant::now()).expect("open");
    send(&mut a, b"A1");
    send(&mut b, b"B1");
    send(&mut c, b"C1");
    assert_eq!(script.lock().written, b"A1", "staged while A1 is in flight");
    script.lock().replies.push_back(int(1));
    line.pump(None);
    assert_eq!(script.lock().written, b"A1B1C1", "one write after the read");
    assert_eq!(reply(&mut a), Some(int(1)));
    script.lock().replies.extend([int(2), int(3)]);
    line.pump(None);
    assert_eq!(reply(&mut b), Some(int(2)));
    assert_eq!(reply(&mut c), Some(int(3)));

    // Pipeline, then the multiplexed connection closes before the reader wrote it.
    send(&mut a, b"A2");
    send(&mut b, b"B2");
    script.lock().closed = true;
    line.pump(None);
    let e = b
        .next_reply()
        .expect_err("the close, for a staged command too");
    assert_eq!(e.kind(), io::ErrorKind::ConnectionReset);
}

/// A round whose commands the reader did not write within [`STAGE_MAX`]
/// writes them itself.
#[test]
fn a_staged_command_the_reader_does_not_write_is_written_by_its_round() {
    let (line, script, _) = line();
    let mut a = line.admit(None, Instant::now()).expect("open");
    let mut b = line.admit(None, Instant::now()).expect("open");
    send(&mut a, b"A1");
    send(&mut b, b"B1");
    let now = Instant::now();
    assert!(line.write_stale(now).is_some(), "due later");
    assert_eq!(script.lock().written, b"A1");
    assert!(line
        .write_stale(crate::clock::after(now, STAGE_MAX))
        .is_none());
    assert_eq!(script.lock().written, b"A1B1", "written by its round");
}

/// A reply for the reader that another thread read (the retry job, a round
/// at its deadline, a round joining) wakes the reader: its poll would find
/// the socket empty and sleep to its deadline.
#[test]
fn a_reply_read_for_the_reader_by_another_thread_wakes_it() {
    let (line, script, _) = line();
    let woken = Arc::new(Count::default());
    let mut a = line
        .admit(Some(woken.clone() as Arc<dyn Wake>), Instant::now())
        .expect("open");
    send(&mut a, b"A1");
    assert!(!line.watch(a.id), "waits");
    script.lock().replies.push_back(int(1));
    // Not the reader's own read.
    line.pump(None);
    assert_eq!(woken.0.load(Ordering::Acquire), 1, "the reader sleeps on");
    assert_eq!(reply(&mut a), Some(int(1)));
}

/// A joining round's read of what arrived also writes what waits staged
/// (the reply it read may be the last owed: nothing else would wake the
/// reader to write it).
#[test]
fn a_joining_rounds_read_writes_what_waits_staged() {
    let (line, script, node) = line();
    let mut a = line.admit(None, Instant::now()).expect("open");
    let mut b = line.admit(None, Instant::now()).expect("open");
    let long_ago = Instant::now()
        .checked_sub(node.timeout / 2)
        .expect("a monotonic clock this old");
    a.wire_mut().queue(b"A1", long_ago, true);
    a.flush().expect("sent");
    assert!(!line.watch(a.id), "waits");
    send(&mut b, b"B1");
    assert_eq!(script.lock().written, b"A1", "staged");
    script.lock().replies.push_back(int(1));
    // Joining at A1's node timeout: it reads first, then writes B1.
    let _c = line
        .admit(None, crate::clock::after(long_ago, node.timeout))
        .or_else(|| panic!("the reply was there: not given up"));
    assert_eq!(script.lock().written, b"A1B1");
}

/// A waker that is the calling thread's own.
#[derive(Default)]
struct Mine(AtomicUsize);

impl Wake for Mine {
    fn wake(&self) {
        self.0.fetch_add(1, Ordering::AcqRel);
    }
    fn is_current(&self) -> bool {
        true
    }
}

/// The reader reading its own reply sends itself no wake: it is awake, and
/// looks at its mailbox before it waits again.
#[test]
fn a_reader_reading_its_own_reply_does_not_wake_itself() {
    let (line, script, _) = line();
    let mine = Arc::new(Mine::default());
    let mut a = line
        .admit(Some(mine.clone() as Arc<dyn Wake>), Instant::now())
        .expect("open");
    send(&mut a, b"A1");
    assert!(!line.watch(a.id), "waits");
    script.lock().replies.push_back(int(1));
    line.pump(None);
    assert_eq!(mine.0.load(Ordering::Acquire), 0, "woke itself");
    assert!(line.watch(a.id));
    assert_eq!(reply(&mut a), Some(int(1)));
}

/// A round that worked out the lock history's key (a hash of the server's
/// run id and the epoch) leaves it to the multiplexed connection, so the next round starts
/// with it; one that read its replies against another server's run id does
/// not.
#[test]
fn the_history_key_a_round_worked_out_stays_with_the_line() {
    let (line, _, _) = line();
    let mut a = line.admit(None, Instant::now()).expect("open");
    assert_eq!(a.wire().history_key, None);
    a.wire_mut().history_key = Some((7, 99));
    drop(a);
    let mut b = line.admit(None, Instant::now()).expect("open");
    assert_eq!(b.wire().history_key, Some((7, 99)), "kept by the line");
    b.wire_mut().run_id = Some("another".into());
    b.wire_mut().history_key = Some((8, 5));
    drop(b);
    let c = line.admit(None, Instant::now()).expect("open");
    assert_eq!(c.wire().history_key, Some((7, 99)), "another server's key");
}

/// A round alone on a multiplexed connection whose replies are owed only to rounds that left
/// (a single thread's stragglers) writes at once: waiting would cost it a
/// round trip and batch nothing.
#[test]
fn a_round_alone_behind_stragglers_writes_at_once() {
    let (line, script, _) = line();
    let mut a = line.admit(None, Instant::now()).expect("open");
    send(&mut a, b"A1");
    drop(a);
    let mut b = line.admit(None, Instant::now()).expect("open");
    send(&mut b, b"B1");
    assert_eq!(script.lock().written, b"A1B1", "B1 waited for A1's reply");
    script.lock().replies.extend([int(1), int(2)]);
    line.pump(None);
    assert_eq!(reply(&mut b), Some(int(2)));
}

/// A thread of the tests: how it blocks is `block`'s (given its wait's
/// end); no one wakes it.
pub(super) struct TestAwait {
    pub(super) role: Role<Scripted>,
    pub(super) block: fn(Instant),
}

impl Await<Scripted> for TestAwait {
    fn clock_now(&self) -> Instant {
        Instant::now()
    }
    fn role(&self) -> &Role<Scripted> {
        &self.role
    }
    fn waker(&self) -> Option<Arc<dyn Wake>> {
        None
    }
    fn mark(&self) -> u64 {
        0
    }
    fn block(&self, _: &[Arc<Multiplexed<Scripted>>], until: Instant, _: u64) {
        (self.block)(until);
    }
}

/// A round whose deadline passes while another round's batch is in flight
/// returns at its deadline, not at that batch's end (its command, staged
/// behind the batch, is written by its own round after `STAGE_MAX`); when
/// the replies come, its late one is read and dropped, and the connection
/// stays for the others.
#[test]
fn a_round_past_its_deadline_behind_another_batch_returns_on_time_and_keeps_the_line() {
    use crate::driver::node::node_round::NodeRound;
    let (line, script, _) = line();
    let mut a = line.admit(None, Instant::now()).expect("open");
    let mut b = line.admit(None, Instant::now()).expect("open");
    send(&mut a, b"A1");
    send(&mut b, b"B1");
    assert_eq!(script.lock().written, b"A1", "B1 waits behind A1");
    let mut parts = vec![NodeRound {
        admit: crate::algorithm::health::Admit::Wait,
        conn: Some(b),
        sent: Some(Instant::now()),
        fell_back: false,
        began: Instant::now(),
        lost: false,
        again: false,
    }];
    let deadline = std::time::Duration::from_millis(30);
    let start = Instant::now();
    let mut ready = Vec::new();
    let sleeper = TestAwait {
        role: Role::default(),
        block: |until| std::thread::sleep(until.saturating_duration_since(Instant::now())),
    };
    wait_ready(&sleeper, &parts, deadline, 1, &mut ready);
    let took = start.elapsed();
    assert!(ready.is_empty(), "no reply came");
    assert!(
        took >= deadline && took < deadline + std::time::Duration::from_secs(1),
        "returned after {took:?} (deadline {deadline:?})"
    );
    assert_eq!(script.lock().written, b"A1B1", "written by its round");
    // The round ends: its reply is no longer wanted, and it leaves.
    let mut b = parts.pop().and_then(|p| p.conn).expect("its connection");
    b.wire_mut().unwant(None, &[], None, &[]);
    drop(b);
    script.lock().replies.extend([int(1), int(2)]);
    line.pump(None);
    assert_eq!(reply(&mut a), Some(int(1)), "A's own reply");
    let mut c = line
        .admit(None, Instant::now())
        .expect("the connection stays: the line takes a new round");
    send(&mut c, b"C1");
    assert_eq!(script.lock().written, b"A1B1C1");
}
