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
//! hands the lock to the next thread, which makes it its own critical section
//! with one swap round (a fresh token, the same expiry; see
//! `Inner::take_over`). Below half the TTL the lock is released on the nodes
//! as usual, so one process cannot keep a key for longer than one TTL by
//! handing it around.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Weak};
use std::time::Instant;

use parking_lot::{Mutex, MutexGuard};

use crate::clock::{Clock, Signal, SystemClock};
use crate::lock::state::LockState;

/// The queues, one per resource that some thread holds or waits for.
#[derive(Debug)]
pub(crate) struct Gates {
    map: Mutex<HashMap<String, Arc<Gate>>>,
    /// Time and waits (virtual in the simulation).
    clock: Arc<dyn Clock>,
}

impl Default for Gates {
    fn default() -> Self {
        Gates::new(Arc::new(SystemClock))
    }
}

#[derive(Debug, Default)]
struct Gate {
    state: Mutex<GateState>,
    turn: Arc<Signal>,
}

#[derive(Debug, Default)]
struct GateState {
    held: bool,
    waiting: VecDeque<u64>,
    next_ticket: u64,
    /// A held lock passed from the last holder to the next.
    baton: Option<Arc<LockState>>,
    /// The lock the turn's holder holds, once it has one: waiters stop
    /// waiting when it expires or is lost, whatever its guard does.
    holder: Option<Weak<LockState>>,
}

/// This thread's turn at a resource; the next waiter's starts when it drops.
#[derive(Debug)]
pub(crate) struct Permit {
    gates: Arc<Gates>,
    resource: String,
    gate: Arc<Gate>,
    /// The turn was passed on with the lock: nothing left to give up.
    handed: bool,
}

impl Gates {
    pub(crate) fn new(clock: Arc<dyn Clock>) -> Self {
        Gates {
            map: Mutex::default(),
            clock,
        }
    }

    fn gate(&self, resource: &str) -> Arc<Gate> {
        self.map
            .lock()
            .entry(resource.to_owned())
            .or_default()
            .clone()
    }

    /// Takes the resource's turn, waiting in FIFO order until `deadline`.
    pub(crate) fn acquire(self: &Arc<Self>, resource: &str, deadline: Instant) -> Option<Permit> {
        let gate = self.gate(resource);
        let got = {
            let mut st = gate.state.lock();
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
                        gate.turn.notify();
                        break false;
                    }
                    if now >= deadline {
                        if !st.held && st.waiting.len() == 1 && st.baton.is_some() {
                            // Nobody else is left to take a handed-over lock:
                            // take the turn so that it is used or released.
                            st.waiting.clear();
                            st.held = true;
                            break true;
                        }
                        st.waiting.retain(|&t| t != ticket);
                        // The head may have changed: let the new head look.
                        gate.turn.notify();
                        break false;
                    }
                    let wake = holder_until.map_or(deadline, |h| h.min(deadline));
                    self.wait(&gate, &mut st, wake);
                }
            }
        };
        self.permit(resource, gate, got)
    }

    /// Waits for a change at `gate` (or `until`), without its state lock.
    fn wait(&self, gate: &Gate, st: &mut MutexGuard<'_, GateState>, until: Instant) {
        let seen = gate.turn.seen();
        MutexGuard::unlocked(st, || self.clock.wait(&gate.turn, seen, Some(until)));
    }

    /// Takes the resource's turn only if nobody holds or waits for it.
    pub(crate) fn try_acquire(self: &Arc<Self>, resource: &str) -> Option<Permit> {
        let gate = self.gate(resource);
        let got = {
            let mut st = gate.state.lock();
            let free = !st.held && st.waiting.is_empty();
            st.held |= free;
            free
        };
        self.permit(resource, gate, got)
    }

    /// The turn when `got`; else forgets the queue if it is idle.
    fn permit(self: &Arc<Self>, resource: &str, gate: Arc<Gate>, got: bool) -> Option<Permit> {
        if got {
            return Some(Permit {
                gates: self.clone(),
                resource: resource.to_owned(),
                gate,
                handed: false,
            });
        }
        self.forget_if_idle(resource, &gate);
        None
    }

    /// Removes a resource's queue once nobody holds, waits for or refers to it.
    fn forget_if_idle(&self, resource: &str, gate: &Arc<Gate>) {
        let mut map = self.map.lock();
        let idle = {
            let st = gate.state.lock();
            !st.held && st.waiting.is_empty()
        };
        // Two references: the map's and the caller's.
        if idle && Arc::strong_count(gate) == 2 {
            map.remove(resource);
        }
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.map.lock().len()
    }
}

impl Permit {
    /// Whether other threads are queued for this resource.
    pub(crate) fn has_waiters(&self) -> bool {
        !self.gate.state.lock().waiting.is_empty()
    }

    /// Records the lock this turn's holder now holds.
    pub(crate) fn set_holder(&self, lock: &Arc<LockState>) {
        self.gate.state.lock().holder = Some(Arc::downgrade(lock));
    }

    /// Ends this turn, passing the held lock to the next thread in line, in
    /// one step: the turn and the lock go together to the waiter at the
    /// front, which takes both even if its deadline passes meanwhile. With
    /// nobody waiting any more, the lock comes back (the caller releases it)
    /// and the turn stays with this permit.
    pub(crate) fn hand_over(
        mut self,
        lock: Arc<LockState>,
    ) -> Result<(), (Permit, Arc<LockState>)> {
        {
            let mut st = self.gate.state.lock();
            if st.waiting.is_empty() {
                drop(st);
                return Err((self, lock));
            }
            st.baton = Some(lock);
            st.held = false;
            st.holder = None;
        }
        self.handed = true;
        self.gate.turn.notify();
        Ok(())
    }

    /// A lock handed over by the previous holder, if any.
    pub(crate) fn take_baton(&self) -> Option<Arc<LockState>> {
        self.gate.state.lock().baton.take()
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        if !self.handed {
            let mut st = self.gate.state.lock();
            st.held = false;
            st.holder = None;
            drop(st);
            self.gate.turn.notify();
        }
        self.gates.forget_if_idle(&self.resource, &self.gate);
    }
}

/// Until when the turn's holder may still hold its lock; `None` while it
/// has none yet (it is asking the nodes) or its guard is gone. A lock being
/// released still counts until its turn ends, right after the release round
/// (waiters leaving then would race the holder's delete at the nodes).
fn holder_deadline(st: &GateState, now: Instant) -> Option<Instant> {
    let h = st.holder.as_ref()?.upgrade()?;
    Some(if h.is_lost() { now } else { h.deadline() })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn one_turn_at_a_time_and_queues_are_forgotten() {
        let gates = Arc::new(Gates::default());
        let a = gates.try_acquire("r").expect("free");
        assert!(gates.try_acquire("r").is_none());
        assert!(gates.try_acquire("other").is_some());
        let soon = Instant::now() + Duration::from_millis(20);
        assert!(gates.acquire("r", soon).is_none(), "times out while held");
        drop(a);
        assert!(gates.try_acquire("r").is_some());
        assert_eq!(gates.len(), 0, "idle queues are removed");
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
    /// deadline passed before the hand-over, and the baton was dropped with
    /// the queue (the lock stayed on the nodes with no guard anywhere). The
    /// hand-over must either reach a waiter that takes it or come back.
    #[test]
    fn a_hand_over_reaches_a_waiter_or_comes_back() {
        let gates = Arc::new(Gates::default());
        let holder = gates.try_acquire("r").expect("free");
        let waiter = {
            let gates = gates.clone();
            std::thread::spawn(move || {
                let soon = Instant::now() + Duration::from_millis(30);
                gates.acquire("r", soon).map(|p| p.take_baton().is_some())
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
        let gates = Arc::new(Gates::default());
        let holder = gates.try_acquire("r").expect("free");
        let lock = held_for(Duration::from_millis(50));
        holder.set_holder(&lock);
        let t = Instant::now();
        let got = gates.acquire("r", t + Duration::from_secs(5));
        let waited = t.elapsed();
        assert!(got.is_none(), "the turn is still the holder's");
        assert!(
            waited < Duration::from_secs(1),
            "waited {waited:?} for a lock that expired after 50 ms"
        );
        drop(holder);
        assert!(gates.try_acquire("r").is_some());
    }

    #[test]
    fn waiters_are_served_in_arrival_order() {
        let gates = Arc::new(Gates::default());
        let first = gates.try_acquire("r").expect("free");
        let order = Arc::new(Mutex::new(Vec::new()));
        let deadline = Instant::now() + Duration::from_secs(10);
        std::thread::scope(|s| {
            for i in 0..4 {
                let (mine, order) = (gates.clone(), order.clone());
                s.spawn(move || {
                    let p = mine.acquire("r", deadline).expect("turn");
                    order.lock().push(i);
                    std::thread::sleep(Duration::from_millis(2));
                    drop(p);
                });
                // Let thread i queue before thread i + 1.
                while gates.gate("r").state.lock().waiting.len() < i + 1 {
                    std::thread::yield_now();
                }
            }
            drop(first);
        });
        assert_eq!(*order.lock(), [0, 1, 2, 3]);
        assert_eq!(gates.len(), 0);
    }
}
