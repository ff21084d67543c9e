//! In-process queueing of threads that want the same resource.
//!
//! Without it, threads of one process contending for a hot key each poll the
//! nodes with jittered sleeps: they fight each other, waste round trips and
//! leave the lock idle between a release and the next lucky retry. With it,
//! such threads wait in a FIFO queue here; only the head goes to the nodes,
//! and a release hands over to the next thread at once. Contention between
//! processes is still settled by the nodes (jittered retry).
//!
//! A release with waiters queued and at least half its TTL of validity left
//! hands the lock to the next thread as its next critical section (see
//! `Engine::accept_hand_over`). Below half the TTL the lock is released on
//! the nodes as usual, so one process cannot keep a key for longer than one
//! TTL by handing it around.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Weak};
use std::time::Instant;

use parking_lot::{Mutex, MutexGuard};

use crate::clock::{Clock, Signal};
use crate::lock::state::LockState;

/// The queues, one per resource that some thread holds or waits for.
#[derive(Debug)]
pub(crate) struct Queues {
    map: Mutex<HashMap<String, Arc<Queue>>>,
    /// Time and waits (virtual in the simulation).
    clock: Arc<dyn Clock>,
}

#[derive(Debug, Default)]
struct Queue {
    state: Mutex<QueueState>,
    changed: Arc<Signal>,
}

#[derive(Debug, Default)]
struct QueueState {
    held: bool,
    waiting: VecDeque<u64>,
    next_ticket: u64,
    /// A held lock passed from the last holder to the next.
    handed: Option<Arc<LockState>>,
    /// The lock the turn's holder holds, once it has one: waiters stop
    /// waiting when it expires or is lost, whatever its guard does.
    holder: Option<Weak<LockState>>,
}

/// This thread's turn at a resource; the next waiter's starts when it drops.
#[derive(Debug)]
pub(crate) struct Turn {
    queues: Arc<Queues>,
    resource: String,
    queue: Arc<Queue>,
    /// The turn was passed on with the lock: nothing left to give up.
    passed_on: bool,
}

impl Queues {
    pub(crate) fn new(clock: Arc<dyn Clock>) -> Self {
        Queues {
            map: Mutex::default(),
            clock,
        }
    }

    fn queue(&self, resource: &str) -> Arc<Queue> {
        self.map
            .lock()
            .entry(resource.to_owned())
            .or_default()
            .clone()
    }

    /// Takes the resource's turn, waiting in FIFO order until `deadline`.
    pub(crate) fn acquire(self: &Arc<Self>, resource: &str, deadline: Instant) -> Option<Turn> {
        let queue = self.queue(resource);
        let got = {
            let mut st = queue.state.lock();
            if !st.held && st.waiting.is_empty() {
                st.held = true;
                true
            } else {
                let ticket = st.next_ticket;
                st.next_ticket = st.next_ticket.wrapping_add(1);
                st.waiting.push_back(ticket);
                loop {
                    let my_turn = !st.held && st.waiting.front() == Some(&ticket);
                    if my_turn {
                        st.waiting.pop_front();
                        st.held = true;
                        break true;
                    }
                    let now = self.clock.now();
                    // Waiting is bounded by the holder's lock, not its guard:
                    // once that expires or is lost, go to the nodes.
                    let holder_until = st.held.then(|| holder_deadline(&st, now)).flatten();
                    if holder_until.is_some_and(|h| h <= now) {
                        st.waiting.retain(|&t| t != ticket);
                        queue.changed.notify();
                        break false;
                    }
                    if now >= deadline {
                        if !st.held && st.waiting.len() == 1 && st.handed.is_some() {
                            // Nobody else is left to take a handed-over lock:
                            // take the turn so that it is used or released.
                            st.waiting.clear();
                            st.held = true;
                            break true;
                        }
                        st.waiting.retain(|&t| t != ticket);
                        // The head may have changed: let the new head look.
                        queue.changed.notify();
                        break false;
                    }
                    let wake = holder_until.map_or(deadline, |h| h.min(deadline));
                    self.wait(&queue, &mut st, wake);
                }
            }
        };
        self.turn_at(resource, queue, got)
    }

    /// Waits for a change at `queue` (or `until`), without its state lock.
    fn wait(&self, queue: &Queue, st: &mut MutexGuard<'_, QueueState>, until: Instant) {
        let seen = queue.changed.seen();
        MutexGuard::unlocked(st, || self.clock.wait(&queue.changed, seen, Some(until)));
    }

    /// Takes the resource's turn only if nobody holds or waits for it.
    pub(crate) fn try_acquire(self: &Arc<Self>, resource: &str) -> Option<Turn> {
        let queue = self.queue(resource);
        let got = {
            let mut st = queue.state.lock();
            let free = !st.held && st.waiting.is_empty();
            st.held |= free;
            free
        };
        self.turn_at(resource, queue, got)
    }

    /// The turn when `got`; else forgets the queue if it is idle.
    fn turn_at(self: &Arc<Self>, resource: &str, queue: Arc<Queue>, got: bool) -> Option<Turn> {
        if got {
            return Some(Turn {
                queues: self.clone(),
                resource: resource.to_owned(),
                queue,
                passed_on: false,
            });
        }
        self.forget_if_idle(resource, &queue);
        None
    }

    /// Removes a resource's queue once nobody holds, waits for or refers to it.
    fn forget_if_idle(&self, resource: &str, queue: &Arc<Queue>) {
        let mut map = self.map.lock();
        let idle = {
            let st = queue.state.lock();
            !st.held && st.waiting.is_empty()
        };
        // Two references: the map's and the caller's.
        if idle && Arc::strong_count(queue) == 2 {
            map.remove(resource);
        }
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.map.lock().len()
    }
}

impl Turn {
    /// Whether other threads are queued for this resource.
    pub(crate) fn has_waiters(&self) -> bool {
        !self.queue.state.lock().waiting.is_empty()
    }

    /// Records the lock this turn's holder now holds.
    pub(crate) fn set_holder(&self, lock: &Arc<LockState>) {
        self.queue.state.lock().holder = Some(Arc::downgrade(lock));
    }

    /// Ends this turn, passing the held lock to the next thread in line, in
    /// one step: the turn and the lock go together to the waiter at the
    /// front, which takes both even if its deadline passes meanwhile. With
    /// nobody waiting any more, the lock comes back (the caller releases it)
    /// and the turn stays with this one.
    pub(crate) fn hand_over(mut self, lock: Arc<LockState>) -> Result<(), (Turn, Arc<LockState>)> {
        {
            let mut st = self.queue.state.lock();
            if st.waiting.is_empty() {
                drop(st);
                return Err((self, lock));
            }
            st.handed = Some(lock);
            st.held = false;
            st.holder = None;
        }
        self.passed_on = true;
        self.queue.changed.notify();
        Ok(())
    }

    /// A lock handed over by the previous holder, if any.
    pub(crate) fn take_hand_over(&self) -> Option<Arc<LockState>> {
        self.queue.state.lock().handed.take()
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        if !self.passed_on {
            let mut st = self.queue.state.lock();
            st.held = false;
            st.holder = None;
            drop(st);
            self.queue.changed.notify();
        }
        self.queues.forget_if_idle(&self.resource, &self.queue);
    }
}

/// Until when the turn's holder may still hold its lock; `None` while it
/// has none yet (it is asking the nodes) or its guard is gone. A lock being
/// released still counts until its turn ends, right after the release round
/// (waiters leaving then would race the holder's delete at the nodes).
fn holder_deadline(st: &QueueState, now: Instant) -> Option<Instant> {
    let h = st.holder.as_ref()?.upgrade()?;
    Some(if h.is_lost() { now } else { h.deadline() })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    impl Default for Queues {
        fn default() -> Self {
            Queues::new(Arc::new(crate::clock::SystemClock))
        }
    }

    #[test]
    fn one_turn_at_a_time_and_queues_are_forgotten() {
        let queues = Arc::new(Queues::default());
        let a = queues.try_acquire("r").expect("free");
        assert!(queues.try_acquire("r").is_none());
        assert!(queues.try_acquire("other").is_some());
        let soon = Instant::now() + Duration::from_millis(20);
        assert!(queues.acquire("r", soon).is_none(), "times out while held");
        drop(a);
        assert!(queues.try_acquire("r").is_some());
        assert_eq!(queues.len(), 0, "idle queues are removed");
    }

    /// A lock on "r" valid for `valid` from now.
    fn held_for(valid: Duration) -> Arc<LockState> {
        let now = Instant::now();
        Arc::new(LockState::new(
            "r",
            "token".into(),
            None,
            crate::lock::state::Timing {
                since: now,
                deadline: now + valid,
                ttl: valid,
            },
        ))
    }

    /// Issue 8's hand-over race: the holder saw a waiter, the waiter's
    /// deadline passed before the hand-over, and the handed-over lock was dropped with
    /// the queue (the lock stayed on the nodes with no guard anywhere). The
    /// hand-over must either reach a waiter that takes it or come back.
    #[test]
    fn a_hand_over_reaches_a_waiter_or_comes_back() {
        let queues = Arc::new(Queues::default());
        let holder = queues.try_acquire("r").expect("free");
        let waiter = {
            let queues = queues.clone();
            std::thread::spawn(move || {
                let soon = Instant::now() + Duration::from_millis(30);
                queues
                    .acquire("r", soon)
                    .map(|p| p.take_hand_over().is_some())
            })
        };
        while !holder.has_waiters() {
            std::thread::yield_now();
        }
        // The holder decided to hand over; the waiter gives up meanwhile.
        std::thread::sleep(Duration::from_millis(100));
        let lock = held_for(Duration::from_secs(10));
        let outcome = holder.hand_over(lock.clone());
        let took = waiter.join().expect("waiter");
        match (outcome, took) {
            (Ok(()), Some(true)) => {}
            (Err((_, back)), None) => assert!(Arc::ptr_eq(&back, &lock)),
            (o, t) => panic!("lock orphaned: hand-over {:?}, waiter {t:?}", o.is_ok()),
        }
    }

    /// Issue 8: a waiter waited for the holder's guard, not its lock: a
    /// guard kept alive past its lock's deadline (or leaked) stalled every
    /// later `lock()` of the key in the process for the whole wait.
    #[test]
    fn waiters_stop_waiting_for_a_holder_whose_lock_expired() {
        let queues = Arc::new(Queues::default());
        let holder = queues.try_acquire("r").expect("free");
        let lock = held_for(Duration::from_millis(50));
        holder.set_holder(&lock);
        let t = Instant::now();
        let got = queues.acquire("r", t + Duration::from_secs(5));
        let waited = t.elapsed();
        assert!(got.is_none(), "the turn is still the holder's");
        assert!(
            waited < Duration::from_secs(1),
            "waited {waited:?} for a lock that expired after 50 ms"
        );
        drop(holder);
        assert!(queues.try_acquire("r").is_some());
    }

    #[test]
    fn waiters_are_served_in_arrival_order() {
        let queues = Arc::new(Queues::default());
        let first = queues.try_acquire("r").expect("free");
        let order = Arc::new(Mutex::new(Vec::new()));
        let deadline = Instant::now() + Duration::from_secs(10);
        std::thread::scope(|s| {
            for i in 0..4 {
                let (mine, order) = (queues.clone(), order.clone());
                s.spawn(move || {
                    let p = mine.acquire("r", deadline).expect("turn");
                    order.lock().push(i);
                    std::thread::sleep(Duration::from_millis(2));
                    drop(p);
                });
                // Let thread i queue before thread i + 1.
                while queues.queue("r").state.lock().waiting.len() < i + 1 {
                    std::thread::yield_now();
                }
            }
            drop(first);
        });
        assert_eq!(*order.lock(), [0, 1, 2, 3]);
        assert_eq!(queues.len(), 0);
    }
}
