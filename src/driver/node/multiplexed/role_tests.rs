//! The reader role: who reads, who sleeps, who is woken when a multiplexed connection comes
//! to owe replies, and a wait that panics.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Instant;

use super::tests::{line, send, Count, Script, Scripted, TestAwait};
use super::*;
use crate::driver::conn_state::ConnState;

/// The reader role: one wait holds it; the others sleep; when the holder
/// leaves, the oldest sleeper is handed it and woken, and no one else.
#[test]
fn the_reader_role_passes_to_one_sleeping_wait() {
    let role: Role<Scripted> = Role::default();
    let (wb, wc) = (Arc::new(Count::default()), Arc::new(Count::default()));
    let (b, c) = (
        Some(wb.clone() as Arc<dyn Wake>),
        Some(wc.clone() as Arc<dyn Wake>),
    );
    assert!(role.take(1, None), "no one held it");
    assert!(role.take(1, None), "still its");
    assert!(!role.take(2, b.as_ref()));
    assert!(!role.take(3, c.as_ref()));
    role.leave(1);
    assert_eq!(wb.0.load(Ordering::Acquire), 1, "the oldest sleeper");
    assert_eq!(wc.0.load(Ordering::Acquire), 0, "woken for nothing");
    assert!(!role.take(3, c.as_ref()));
    // The one handed the role returns with a reply of its own instead.
    role.leave(2);
    assert_eq!(wc.0.load(Ordering::Acquire), 1, "passed on");
    assert!(role.take(3, c.as_ref()));
    role.leave(3);
    assert!(role.idle());
    assert!(role.take(4, None), "none slept: the next wait takes it");
}

/// A wait that ends in a panic holds the reader role no longer: else every
/// later round of the client would sleep to its deadline, no one reading.
#[test]
fn a_wait_that_panics_gives_the_reader_role_up() {
    use crate::driver::node::node_round::NodeRound;
    let (line, _, _) = line();
    let mut a = line.admit(None, Instant::now()).expect("open");
    send(&mut a, b"A1");
    let parts = vec![NodeRound {
        admit: crate::algorithm::health::Admit::Wait,
        conn: Some(a),
        sent: Some(Instant::now()),
        fell_back: false,
        began: Instant::now(),
        lost: false,
        again: false,
    }];
    // A thread that panics while it waits (in a late reply's rules, say).
    let waits = TestAwait {
        role: Role::default(),
        block: |_| panic!("a panic while reading"),
    };
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        wait_ready(
            &waits,
            &parts,
            std::time::Duration::from_secs(5),
            1,
            &mut Vec::new(),
        );
    }));
    assert!(r.is_err(), "it panicked");
    assert!(
        waits.role.idle(),
        "the role is still held by the wait that panicked"
    );
}

/// A multiplexed connection that comes to owe replies wakes the reader (which polls only
/// the multiplexed connections that owed when it began to wait); one that owed already does
/// not.
#[test]
fn a_line_that_comes_to_owe_replies_wakes_the_reader() {
    let role: Arc<Role<Scripted>> = Arc::default();
    let script = Arc::new(Mutex::new(Script::default()));
    let node = Arc::new(NodeState::for_tests());
    let conn = Scripted {
        wire: ConnState::new(Instant::now()),
        script: script.clone(),
    };
    let line = Multiplexed::new(conn, node, Weak::new(), Arc::downgrade(&role));
    role.register(&line);
    let woken = Arc::new(Count::default());
    assert!(role.take(9, Some(&(woken.clone() as Arc<dyn Wake>))));
    assert!(role.owing().is_empty());
    let mut a = line.admit(None, Instant::now()).expect("open");
    let mut b = line.admit(None, Instant::now()).expect("open");
    send(&mut a, b"A1");
    assert_eq!(woken.0.load(Ordering::Acquire), 1);
    assert_eq!(role.owing().len(), 1);
    send(&mut b, b"B1");
    assert_eq!(woken.0.load(Ordering::Acquire), 1, "it polls this line");
}

/// A new line whose connection still owes replies (its connect commands,
/// or late replies read into a pooled connection) wakes the reader, which
/// polls only the multiplexed connections that owed when it began to wait: else a round whose
/// command is staged behind those replies sleeps to the reader's deadline.
#[test]
fn a_new_line_that_owes_replies_wakes_the_reader() {
    let role: Arc<Role<Scripted>> = Arc::default();
    let woken = Arc::new(Count::default());
    assert!(role.take(9, Some(&(woken.clone() as Arc<dyn Wake>))));
    let node = Arc::new(NodeState::for_tests());
    let slot: Arc<MultiplexedSlot<Scripted>> = Arc::default();
    let share = join(&slot, &node, &role, None, Instant::now(), || {
        let mut wire = ConnState::new(Instant::now());
        // A connect command, written, its reply owed.
        wire.queue(b"HELLO", Instant::now(), false);
        let mut c = Scripted {
            wire,
            script: Arc::default(),
        };
        c.flush().expect("written");
        Some(c)
    })
    .expect("a line");
    assert_eq!(woken.0.load(Ordering::Acquire), 1, "the reader sleeps on");
    assert_eq!(role.owing().len(), 1);
    drop(share);
}

/// A multiplexed connection that asks its server's `INFO` again as a round joins it comes to
/// owe that reply: the reader is woken to poll it.
#[test]
fn an_info_asked_as_a_round_joins_wakes_the_reader() {
    let role: Arc<Role<Scripted>> = Arc::default();
    let script = Arc::new(Mutex::new(Script::default()));
    let node = Arc::new(NodeState::for_tests());
    let long_ago = Instant::now()
        .checked_sub(crate::driver::node::replies::INFO_EVERY * 2)
        .expect("a monotonic clock this old");
    let mut wire = ConnState::new(long_ago);
    wire.info_at = long_ago;
    let conn = Scripted {
        wire,
        script: script.clone(),
    };
    let line = Multiplexed::new(conn, node, Weak::new(), Arc::downgrade(&role));
    role.register(&line);
    let woken = Arc::new(Count::default());
    assert!(role.take(9, Some(&(woken.clone() as Arc<dyn Wake>))));
    let _a = line.admit(None, Instant::now()).expect("open");
    assert!(!script.lock().written.is_empty(), "INFO asked");
    assert_eq!(woken.0.load(Ordering::Acquire), 1, "the reader sleeps on");
}
