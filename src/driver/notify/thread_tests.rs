//! The subscriber connection's answers, paired with what it sent, against
//! a local listener that answers as a node would.

use std::io::Write;
use std::net::TcpListener;
use std::os::unix::net::UnixStream;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::{read_frames, Owed, Subscriber, RECONNECT};
use crate::driver::conn::{Conn, For, Target};
use crate::driver::notify::{Chan, Shared, St};
use crate::driver::poll::PollFlags;

/// A link connected to a listener, the listener's side, and the state of
/// one node with the channel of key `k` (generation 1).
fn linked() -> (Shared, Subscriber, std::net::TcpStream) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let target = Target::local(listener.local_addr().expect("addr").port());
    let conn = Conn::connect(&target, Duration::from_secs(2), For::Query).expect("connect");
    let (server, _) = listener.accept().expect("accept");
    let (_, tx) = UnixStream::pair().expect("pair");
    let mut st = St {
        up: vec![true],
        tried: vec![true],
        ..St::default()
    };
    st.chans.insert("k".into(), Chan::new(1, 1));
    let sh = Shared {
        st: Mutex::new(st),
        wake: tx,
        stop: AtomicBool::new(false),
        nodes: 1,
    };
    let now = Instant::now();
    let link = Subscriber {
        name: "n".into(),
        target,
        conn: Some(conn),
        owed: Default::default(),
        retry_at: now,
        backoff: RECONNECT,
        last_heard: now,
        pinged: None,
    };
    (sh, link, server)
}

/// Feeds `bytes` from the node and reads them.
fn feed(sh: &Shared, l: &mut Subscriber, server: &mut std::net::TcpStream, bytes: &[u8]) -> bool {
    server.write_all(bytes).expect("write");
    std::thread::sleep(Duration::from_millis(20));
    read_frames(sh, 0, l, PollFlags::IN).is_ok()
}

#[test]
fn a_plain_pong_answers_the_keepalive_of_a_connection_with_no_subscription() {
    // Outside subscribed mode (every channel refused) a node answers `+PONG`,
    // not `*2 pong ""`: it left the PING owed, and the link was made anew
    // every few seconds.
    let (sh, mut l, mut server) = linked();
    l.owed.push_back(Owed::Ping);
    l.pinged = Some(Instant::now());
    assert!(feed(&sh, &mut l, &mut server, b"+PONG\r\n"));
    assert!(l.pinged.is_none() && l.owed.is_empty());
    // And in subscribed mode.
    l.owed.push_back(Owed::Ping);
    l.pinged = Some(Instant::now());
    assert!(feed(
        &sh,
        &mut l,
        &mut server,
        b"*2\r\n$4\r\npong\r\n$0\r\n\r\n"
    ));
    assert!(l.pinged.is_none() && l.owed.is_empty());
}

#[test]
fn a_confirmation_counts_only_for_the_channel_generation_that_asked() {
    let (sh, mut l, mut server) = linked();
    // An old generation's SUBSCRIBE, answered after the channel was made anew.
    l.owed.push_back(Owed::Subscribe("k".into(), 0));
    let confirm = b"*3\r\n$9\r\nsubscribe\r\n$17\r\nquorumlock:free:k\r\n:1\r\n";
    assert!(feed(&sh, &mut l, &mut server, confirm));
    assert!(
        !sh.st.lock().chans["k"].confirmed[0],
        "credited to the new channel"
    );
    l.owed.push_back(Owed::Subscribe("k".into(), 1));
    assert!(feed(&sh, &mut l, &mut server, confirm));
    assert!(sh.st.lock().chans["k"].confirmed[0]);
}

#[test]
fn a_refusal_names_its_own_channel_and_keeps_the_connection() {
    let (sh, mut l, mut server) = linked();
    l.owed.push_back(Owed::Subscribe("k".into(), 1));
    assert!(feed(
        &sh,
        &mut l,
        &mut server,
        b"-NOPERM this user has no permissions to access one of the channels\r\n"
    ));
    assert!(sh.st.lock().chans["k"].refused[0]);
    assert!(l.conn.is_some());
}

#[test]
fn one_notice_from_every_node_wakes_once_and_a_new_one_again() {
    let (sh, mut l, mut server) = linked();
    let msg = |n: &str| {
        format!(
            "*3\r\n$7\r\nmessage\r\n$17\r\nquorumlock:free:k\r\n${}\r\n{n}\r\n",
            n.len()
        )
    };
    let count = |sh: &Shared| sh.st.lock().chans["k"].count;
    assert!(feed(&sh, &mut l, &mut server, msg("7").as_bytes()));
    assert_eq!(count(&sh), 1);
    assert!(feed(&sh, &mut l, &mut server, msg("7").as_bytes()));
    assert_eq!(count(&sh), 1, "the same release's copy");
    assert!(feed(&sh, &mut l, &mut server, msg("9").as_bytes()));
    assert_eq!(count(&sh), 2);
}

#[test]
fn an_answer_owed_to_nothing_makes_the_connection_anew() {
    let (sh, mut l, mut server) = linked();
    assert!(!feed(&sh, &mut l, &mut server, b"+PONG\r\n"));
}

/// A release whose first copy (node 0's) woke a waiter that then began a try before
/// the release reached a majority: the try met the key held on nodes 1 and 2, so the
/// copy that completes the majority wakes it again, however soon it comes. (Seen under
/// load: the releaser's round reached nodes 1 and 2 a few milliseconds after node 0,
/// the woken try read them in between, and the waiter slept its whole fallback, 1 s.)
/// A copy that completes the majority before any try began wakes nobody again. The
/// waits tell a wake-up by such a majority from a first copy's (`Watch::again`).
#[test]
fn a_copy_that_completes_the_majority_after_a_try_began_wakes_again() {
    use std::sync::Arc;

    use crate::lock::transport::Watch;

    let mut st = St {
        up: vec![true; 3],
        tried: vec![true; 3],
        ..St::default()
    };
    st.chans.insert("k".into(), Chan::new(3, 1));
    let (_, tx) = UnixStream::pair().expect("pair");
    let sh = Arc::new(Shared {
        st: Mutex::new(st),
        wake: tx,
        stop: AtomicBool::new(false),
        nodes: 3,
    });
    let msg = |n: &str| {
        [b"message".as_slice(), b"quorumlock:free:k", n.as_bytes()]
            .map(|w| redis::Value::BulkString(w.to_vec()))
    };
    let now = Instant::now;
    let single = |sh: &Arc<Shared>| super::super::Waiting {
        shared: sh.clone(),
        cv: sh.st.lock().chans["k"].cv.clone(),
        resource: "k".into(),
        seen: 0,
        again: 0,
    };
    let (mut w, mut set) = (
        single(&sh),
        super::super::WaitingAll {
            parts: vec![single(&sh)],
            any: sh.st.lock().any.clone(),
            listen: vec![true],
        },
    );
    w.mark();
    set.mark();
    // Release 7 reaches node 0: the waiters are woken, and try.
    super::message(&sh, 0, &msg("7"));
    assert!(w.wait(now()) && set.wait(now()), "the first copy");
    assert!(
        !w.again() && !set.again(),
        "a first copy is no majority after a try"
    );
    w.mark();
    set.mark();
    // Node 1 runs it a millisecond later: the key is free on a majority only now.
    super::message(&sh, 1, &msg("7"));
    assert!(
        w.wait(now()),
        "the copy that completes the majority, after the try"
    );
    assert!(set.wait(now()), "the same, for a lock of several");
    assert!(
        w.again() && set.again(),
        "woken by the majority after the try"
    );
    w.mark();
    set.mark();
    super::message(&sh, 2, &msg("7"));
    assert!(!w.wait(now()) && !set.wait(now()), "past the majority");
    // Release 9: every copy comes before the woken try begins.
    for node in 0..3 {
        super::message(&sh, node, &msg("9"));
    }
    assert!(w.wait(now()) && !w.again());
    w.mark();
    set.mark();
    assert!(
        !w.wait(now()) && !set.wait(now()),
        "one wake-up for release 9"
    );
}
