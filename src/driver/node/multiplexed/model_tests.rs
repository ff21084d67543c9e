//! Model tests of the hand-offs between rounds on shared connections,
//! under `shuttle`'s scheduler (build with `RUSTFLAGS="--cfg
//! quorumlock_shuttle"`; `.ci/run` does): rounds of several threads write
//! to multiplexed connections of two nodes, one of them reads for all (the reader role), each
//! sleeps until as many replies as it needs are in, and a server thread
//! answers what was written. The multiplexed connections, the role, the reply count and
//! `wait_ready` are the production code; only the sockets and the threads'
//! sleep are the model's.
//!
//! Checked in every explored interleaving: every round gets every reply it
//! sent for, its own (the replies are paired with their owners), and
//! returns (a lost wake-up leaves every thread asleep, which `shuttle`
//! reports as a deadlock); the reader role is left held by no one, with no
//! one asleep. (One batch in flight is the multiplexed connection's own tests'.)

use std::collections::VecDeque;
use std::io;
use std::sync::Arc;
use std::time::{Duration, Instant};

use redis::Value;
use shuttle::sync::{Condvar, Mutex as ShuttleMutex};

use super::role::Role;
use super::{join, Multiplexed, MultiplexedSlot, ReplyCount, RoundConn, Wake};
use crate::algorithm::health::Admit;
use crate::driver::conn_state::{ConnState, InFlight};
use crate::driver::node::link::Link;
use crate::driver::node::node_round::NodeRound;
use crate::driver::node::state::NodeState;

/// What the threads share: each connection's bytes and replies, and who
/// was woken.
#[derive(Default)]
struct World {
    /// Per connection: commands written and not answered (their owners'
    /// ids, in order), replies answered and not read.
    conns: Vec<(VecDeque<u64>, VecDeque<Value>)>,
    /// Per thread: woken since it last looked.
    armed: Vec<bool>,
    /// Replies the server has answered so far (the reader's poll).
    answered: u64,
    /// The rounds are done: the server stops.
    done: bool,
    /// Threads whose rounds are done.
    finished: usize,
    /// Thread 0's replies wait until every other thread is done (its
    /// round, often the reader's, waits on meanwhile).
    hold_first: Option<usize>,
}

struct Shared {
    world: ShuttleMutex<World>,
    changed: Condvar,
}

impl Shared {
    fn with<T>(&self, f: impl FnOnce(&mut World) -> T) -> T {
        let mut w = self.world.lock().unwrap_or_else(|e| e.into_inner());
        let out = f(&mut w);
        self.changed.notify_all();
        out
    }
}

/// A connection of the model: what it writes reaches the world.
struct ModelConn {
    wire: ConnState,
    index: usize,
    shared: Arc<Shared>,
}

impl Link for ModelConn {
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
        if out.is_empty() {
            return Ok(());
        }
        // Each command is its owner's id and a `;`.
        let ids: Vec<u64> = out
            .split(|b| *b == b';')
            .filter(|s| !s.is_empty())
            .filter_map(|s| std::str::from_utf8(s).ok()?.parse().ok())
            .collect();
        let i = self.index;
        self.shared.with(|w| w.conns[i].0.extend(ids));
        self.wire.written(out.len());
        Ok(())
    }

    fn on_ready(&mut self, (): ()) -> io::Result<()> {
        Ok(())
    }

    fn next_reply(&mut self) -> io::Result<Option<(InFlight, Value)>> {
        let i = self.index;
        match self.shared.with(|w| w.conns[i].1.pop_front()) {
            Some(v) => self.wire.answer(v).map(Some),
            None => Ok(None),
        }
    }

    fn wants_write(&self) -> bool {
        false
    }

    fn read_all(&mut self) -> io::Result<()> {
        Ok(())
    }

    fn abandon(&mut self) {
        self.wire.broken = true;
    }
}

/// A thread's waker: the production reply count, and a flag in the world.
struct ModelWaker {
    me: usize,
    count: ReplyCount,
    shared: Arc<Shared>,
}

impl Wake for ModelWaker {
    fn wake(&self) {
        let me = self.me;
        self.shared.with(|w| w.armed[me] = true);
    }

    fn replies(&self) -> Option<&ReplyCount> {
        Some(&self.count)
    }
}

/// How a thread of the model waits: asleep until woken, or, reading, until
/// the server answered more.
struct ModelAwait {
    waker: Arc<ModelWaker>,
    role: Arc<Role<ModelConn>>,
}

impl super::Await<ModelConn> for ModelAwait {
    fn clock_now(&self) -> Instant {
        Instant::now()
    }

    fn role(&self) -> &Role<ModelConn> {
        &self.role
    }

    fn waker(&self) -> Option<Arc<dyn Wake>> {
        Some(self.waker.clone() as Arc<dyn Wake>)
    }

    fn mark(&self) -> u64 {
        0
    }

    fn block(&self, lines: &[Arc<Multiplexed<ModelConn>>], _until: Instant, _mark: u64) {
        let me = self.waker.me;
        let shared = &self.waker.shared;
        let mut w = shared.world.lock().unwrap_or_else(|e| e.into_inner());
        let seen = w.answered;
        // A reader also wakes for replies on its multiplexed connections (a poll would).
        let unread = |w: &World| -> bool {
            !lines.is_empty() && (w.answered != seen || w.conns.iter().any(|c| !c.1.is_empty()))
        };
        while !w.armed[me] && !unread(&w) {
            w = shared.changed.wait(w).unwrap_or_else(|e| e.into_inner());
        }
        w.armed[me] = false;
        drop(w);
        for l in lines {
            l.pump(None);
        }
    }
}

/// The server: answers each command written with its owner's id, until
/// the rounds are done.
fn serve(shared: &Shared) {
    let mut w = shared.world.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        let mut any = false;
        let hold = w.hold_first.is_some_and(|others| w.finished < others);
        for c in &mut w.conns {
            if hold && c.0.front().is_some_and(|id| id / 1000 == 0) {
                // Its multiplexed connection only: no one else's reply is behind it.
                continue;
            }
            if let Some(id) = c.0.pop_front() {
                c.1.push_back(Value::Int(id as i64));
                any = true;
            }
        }
        if any {
            w.answered += 1;
            shared.changed.notify_all();
            drop(w);
            shuttle::thread::yield_now();
            w = shared.world.lock().unwrap_or_else(|e| e.into_inner());
            continue;
        }
        if w.done {
            return;
        }
        w = shared.changed.wait(w).unwrap_or_else(|e| e.into_inner());
    }
}

/// `threads` threads, `rounds` rounds each, on `nodes` multiplexed connections; each round
/// needs the replies of `need` of its nodes before it looks. With
/// `hold_first`, thread 0 makes one round on a line of its own (the last),
/// whose reply comes only once the others are done; they use the others.
fn model(threads: usize, rounds: usize, nodes: usize, need: usize, hold_first: bool) {
    let shared = Arc::new(Shared {
        world: ShuttleMutex::new(World {
            conns: vec![Default::default(); nodes],
            armed: vec![false; threads],
            hold_first: hold_first.then_some(threads - 1),
            ..World::default()
        }),
        changed: Condvar::new(),
    });
    let role: Arc<Role<ModelConn>> = Arc::default();
    let node = Arc::new(NodeState::for_tests());
    let slots: Vec<Arc<MultiplexedSlot<ModelConn>>> = (0..nodes).map(|_| Arc::default()).collect();
    let server = {
        let shared = shared.clone();
        shuttle::thread::spawn(move || serve(&shared))
    };
    let workers: Vec<_> = (0..threads)
        .map(|me| {
            let (shared, role, node, slots) =
                (shared.clone(), role.clone(), node.clone(), slots.clone());
            shuttle::thread::spawn(move || {
                let waker = Arc::new(ModelWaker {
                    me,
                    count: ReplyCount::default(),
                    shared: shared.clone(),
                });
                let a = ModelAwait {
                    waker: waker.clone(),
                    role: role.clone(),
                };
                let (mine, rounds) = match (hold_first, me) {
                    (false, _) => (0..nodes, rounds),
                    (true, 0) => (nodes - 1..nodes, 1),
                    (true, _) => (0..nodes - 1, rounds),
                };
                let count = mine.len();
                for r in 0..rounds {
                    let id = (me * 1000 + r) as u64;
                    let now = Instant::now();
                    let mut parts: Vec<NodeRound<RoundConn<ModelConn>>> = Vec::new();
                    for (i, slot) in slots.iter().enumerate() {
                        if !mine.contains(&i) {
                            continue;
                        }
                        let w = Some(waker.clone() as Arc<dyn Wake>);
                        let shared = shared.clone();
                        let mut s = join(slot, &node, &role, w, now, move || {
                            Some(ModelConn {
                                wire: ConnState::new(now),
                                index: i,
                                shared,
                            })
                        })
                        .expect("a line");
                        s.wire_mut().queue(format!("{id};").as_bytes(), now, true);
                        s.flush().expect("sent");
                        parts.push(NodeRound {
                            admit: Admit::Wait,
                            conn: Some(s),
                            sent: Some(now),
                            fell_back: false,
                            began: now,
                            lost: false,
                            again: false,
                        });
                    }
                    let mut got = 0;
                    let mut ready = Vec::new();
                    while got < count {
                        let want = need.min(count - got);
                        super::wait_ready(&a, &parts, Duration::from_secs(3600), want, &mut ready);
                        for &(i, ()) in &ready {
                            let c = parts[i].conn.as_mut().expect("its connection");
                            while let Some((_, v)) = c.next_reply().expect("no close") {
                                assert_eq!(v, Value::Int(id as i64), "another round's reply");
                                got += 1;
                            }
                        }
                    }
                }
                if me > 0 {
                    shared.with(|w| w.finished += 1);
                }
            })
        })
        .collect();
    for w in workers {
        w.join().expect("a round thread failed");
    }
    shared.with(|w| w.done = true);
    server.join().expect("the server failed");
    assert!(
        role.idle(),
        "the reader role is still held, or a wait sleeps"
    );
}

/// Three threads, two rounds each, on two nodes, each round waiting for
/// both replies before it looks: random schedules.
#[test]
fn rounds_sharing_lines_get_their_own_replies_and_never_sleep_through_them() {
    shuttle::check_random(|| model(3, 2, 2, 2, false), 3_000);
}

/// The same under PCT (schedules that preempt at a few chosen points,
/// which finds ordering bugs of small depth with high probability), with a
/// round that looks at each reply as it comes.
#[test]
fn rounds_sharing_lines_survive_preemption_at_any_point() {
    shuttle::check_pct(|| model(3, 2, 2, 1, false), 3_000, 3);
}

/// Two threads' rounds on one node, each needing its one reply, while
/// thread 0's round on another node waits for a reply that comes only once
/// they are done (so a reader holding the role need not leave it soon): a
/// reply counted between a round's look and its sleep must wake it.
#[test]
fn a_reply_counted_as_a_round_goes_to_sleep_wakes_it() {
    shuttle::check_pct(|| model(3, 3, 2, 1, true), 5_000, 3);
}
