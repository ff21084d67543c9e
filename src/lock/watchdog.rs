//! The renewal thread: one per client, started with the first renewed lock.
//!
//! Locks register and deregister over a channel. The thread sleeps until the
//! earliest renewal is due (or a message arrives), renews every lock due in
//! that window with one round trip per node per TTL (the Lua scripts take
//! many keys), and declares a lock lost when a majority says it is not ours
//! or its validity runs out before a renewal succeeds. It holds only a weak
//! reference to the client and stops when the client is gone.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, TryRecvError};
use log::{debug, error};
use parking_lot::Mutex;

use crate::clock::{after, Clock, Signal};
use crate::lock::spans::{Caller, Renewals};
use crate::lock::state::LockState;
use crate::Result;

/// Thread name (Linux shows 15 characters).
pub(crate) const THREAD_NAME: &str = "qlock-watchdog";
/// Most keys renewed in one round trip.
pub(crate) const MAX_BATCH: usize = 5_000;
/// How long dropping the client waits for the thread to end.
const JOIN_BOUND: Duration = Duration::from_secs(1);

/// What the renewal thread needs of the engine that owns it.
pub(crate) trait Renew: Send + Sync + 'static {
    /// The renewal fraction and the node timeout.
    fn pacing(&self) -> (f64, Duration);
    /// Extends `states` to `ttl` in one round, restoring missing copies.
    fn renew(&self, states: &[&LockState], ttl: Duration) -> Vec<Result<Duration>>;
    /// A renewal round ended (a release may be waiting for one).
    fn renewed(&self);
    /// Declares `state` lost: it ran out of validity before a renewal.
    fn expire(&self, state: &LockState);
    /// Deletes what may still be ours of lost locks.
    fn release_lost(&self, states: &[&LockState]);
}

enum Msg {
    Add(Arc<LockState>),
    Remove(u64),
}

/// Handle to the running thread, owned by the client.
pub(crate) struct Watchdog {
    tx: Option<Sender<Msg>>,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// Wakes the thread: a message was sent, or the channel closed.
    wake: Arc<Signal>,
    /// Set, and `wake` notified, when the thread has ended.
    exited: Arc<AtomicBool>,
    clock: Arc<dyn Clock>,
}

impl Watchdog {
    pub(crate) fn spawn(client: Weak<dyn Renew>, clock: Arc<dyn Clock>) -> Watchdog {
        let (tx, rx) = crossbeam_channel::unbounded();
        let wake = Arc::new(Signal::default());
        let exited = Arc::new(AtomicBool::new(false));
        let run_clock = clock.clone();
        let (run_wake, run_exited) = (wake.clone(), exited.clone());
        let thread = clock.spawn(
            THREAD_NAME,
            Box::new(move || {
                run(&client, &*run_clock, &rx, &run_wake);
                debug!("watchdog stopped");
                run_exited.store(true, Ordering::Release);
                run_wake.notify();
            }),
        );
        let thread = match thread {
            Ok(h) => Some(h),
            Err(e) => {
                error!("cannot start the renewal thread: {e}; locks will not be renewed");
                None
            }
        };
        Watchdog {
            tx: Some(tx),
            thread: Mutex::new(thread),
            wake,
            exited,
            clock,
        }
    }

    fn send(&self, msg: Msg) {
        if let Some(tx) = &self.tx {
            let _ = tx.send(msg);
            self.wake.notify();
        }
    }

    pub(crate) fn add(&self, state: Arc<LockState>) {
        self.send(Msg::Add(state));
    }

    pub(crate) fn remove(&self, id: u64) {
        self.send(Msg::Remove(id));
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        // Closing the channel and waking the thread ends it.
        self.tx.take();
        self.wake.notify();
        let Some(handle) = self.thread.lock().take() else {
            return;
        };
        if handle.thread().id() == thread::current().id() {
            // The last client handle went away on the watchdog thread itself:
            // it ends on its own once this tick returns.
            return;
        }
        let until = after(self.clock.now(), JOIN_BOUND);
        loop {
            let seen = self.wake.seen();
            if self.exited.load(Ordering::Acquire) {
                let _ = handle.join();
                return;
            }
            if self.clock.now() >= until {
                debug!("watchdog still busy after {JOIN_BOUND:?}; detached");
                return;
            }
            self.clock.wait(&self.wake, seen, Some(until));
        }
    }
}

/// One registered lock and when to renew it next.
struct Entry {
    state: Arc<LockState>,
    next: Instant,
}

fn run(client: &Weak<dyn Renew>, clock: &dyn Clock, rx: &Receiver<Msg>, wake: &Arc<Signal>) {
    let mut entries: Vec<Entry> = Vec::new();
    loop {
        // Read before looking, so that a message sent meanwhile wakes us.
        let seen = wake.seen();
        let Some(engine) = client.upgrade() else {
            return;
        };
        let (fraction, _) = engine.pacing();
        loop {
            match rx.try_recv() {
                Ok(Msg::Add(state)) => {
                    let t = state.timing();
                    let next = after(t.since, interval(t.ttl, fraction));
                    entries.push(Entry { state, next });
                }
                Ok(Msg::Remove(id)) => entries.retain(|e| e.state.id != id),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => return,
            }
        }
        let ticked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            tick(&*engine, clock, &mut entries)
        }));
        if ticked.is_err() {
            error!("a renewal tick panicked; the watchdog keeps running");
        }
        // Not kept while asleep: the client may be dropped meanwhile.
        drop(engine);
        let next = entries.iter().map(|e| e.next).min();
        clock.wait(wake, seen, next);
    }
}

/// Time between renewals of a lock with this TTL: `ttl × fraction`, at
/// least 1 ms.
pub(crate) fn interval(ttl: Duration, fraction: f64) -> Duration {
    Duration::try_from_secs_f64(ttl.as_secs_f64() * fraction)
        .unwrap_or(ttl)
        .max(Duration::from_millis(1))
}

/// Whether a renewal planned for `next` should go in the batch sent at
/// `now`: locks due within an eighth of their interval are renewed together.
pub(crate) fn is_due(next: Instant, now: Instant, interval: Duration) -> bool {
    next <= after(now, interval / 8)
}

/// When to try again after a renewal that did not reach a majority: soon,
/// but not past the lock's deadline (where it will be declared lost).
pub(crate) fn retry_at(
    now: Instant,
    deadline: Instant,
    interval: Duration,
    timeout: Duration,
) -> Instant {
    after(now, (interval / 4).max(timeout)).min(deadline)
}

/// What the renewal thread's spans say of each of `states`: its resource,
/// section and the span of the caller that took it (see [`Renewals`]).
fn spanned<'a>(states: &'a [&'a LockState]) -> impl Iterator<Item = (&'a str, u64, &'a Caller)> {
    states
        .iter()
        .map(|s| (s.resource.as_str(), s.section, &s.caller))
}

/// Renews every due lock; declares lost the ones that are gone or ran out.
fn tick(engine: &dyn Renew, clock: &dyn Clock, entries: &mut Vec<Entry>) {
    let now = clock.now();
    let (fraction, node_timeout) = engine.pacing();

    // Ran out of validity before a renewal succeeded: lost, and deleted
    // below with the others (the nodes may have executed renewals whose
    // replies never came, and keep the key).
    let mut expired: Vec<Arc<LockState>> = Vec::new();
    entries.retain(|e| {
        if e.state.is_released() || e.state.is_lost() {
            return false;
        }
        if e.state.deadline() <= now {
            engine.expire(&e.state);
            expired.push(e.state.clone());
            return false;
        }
        true
    });

    // (ttl, index) of every due lock, grouped by TTL, and readers apart
    // from writers: one round per TTL and kind. (A reader's renewal needs
    // `ZADD`, which a node out of memory refuses; the refusal fails the
    // whole script there, and a writer renewed in it lost its lock.)
    let mut due: Vec<(Duration, bool, usize)> = (0..entries.len())
        .filter_map(|i| {
            let (t, s) = (entries[i].state.timing(), &entries[i].state);
            is_due(entries[i].next, now, interval(t.ttl, fraction)).then(|| (t.ttl, s.is_read(), i))
        })
        .collect();
    due.sort_unstable();

    for group in due.chunk_by(|a, b| (a.0, a.1) == (b.0, b.1)) {
        // Batches of at most `MAX_BATCH` keys (a lock of several resources
        // has one per resource), at least one lock each.
        let (ttl, mut rest) = (group[0].0, group);
        while !rest.is_empty() {
            let mut keys = 0usize;
            let n = rest
                .iter()
                .take_while(|&&(_, _, i)| {
                    keys = keys.saturating_add(entries[i].state.size());
                    keys <= MAX_BATCH
                })
                .count()
                .max(1);
            let (batch, tail) = rest.split_at(n);
            rest = tail;
            // Rounds of earlier batches let other threads run: a lock may
            // have been released or lost meanwhile, and is not renewed. A
            // release from now on waits for this round to end (the renewal
            // restores missing copies, which must not land after its delete).
            let batch: Vec<(Duration, bool, usize)> = batch
                .iter()
                .copied()
                .filter(|&(_, _, i)| {
                    !entries[i].state.is_lost() && entries[i].state.begin_renewal()
                })
                .collect();
            if batch.is_empty() {
                continue;
            }
            let states: Vec<&LockState> =
                batch.iter().map(|&(_, _, i)| &*entries[i].state).collect();
            let spans = Renewals::renewal(spanned(&states), ttl);
            let outcomes = engine.renew(&states, ttl);
            spans.end(&outcomes);
            for s in &states {
                s.end_renewal();
            }
            engine.renewed();
            let after_round = clock.now();
            for (&(_, _, i), outcome) in batch.iter().zip(outcomes) {
                let e = &mut entries[i];
                let t = e.state.timing();
                let every = interval(t.ttl, fraction);
                e.next = match outcome {
                    Ok(_) => after(t.since, every),
                    Err(_) => retry_at(after_round, t.deadline, every, node_timeout),
                };
            }
        }
    }

    // Lost locks: stop renewing, and delete what may still be ours so that
    // nobody waits for a TTL that protects nothing.
    let mut lost: Vec<Arc<LockState>> = entries
        .iter()
        .filter(|e| e.state.is_lost())
        .map(|e| e.state.clone())
        .collect();
    lost.append(&mut expired);
    if !lost.is_empty() {
        entries.retain(|e| !e.state.is_lost());
        let states: Vec<&LockState> = lost.iter().map(|s| &**s).collect();
        Renewals::release_lost(spanned(&states), || engine.release_lost(&states));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;
    use crate::testing::fake::{client, Mode};
    use std::sync::atomic::Ordering;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn interval_is_a_fraction_of_the_ttl() {
        assert_eq!(interval(3000 * MS, 1.0 / 3.0), 1000 * MS);
        assert_eq!(interval(MS, 0.1), MS);
        assert!(interval(Duration::MAX, 0.5) > Duration::MAX / 3);
    }

    #[test]
    fn due_window_batches_near_neighbours() {
        let now = Instant::now();
        let every = 800 * MS;
        assert!(is_due(now, now, every));
        assert!(is_due(now + 100 * MS, now, every));
        assert!(!is_due(now + 101 * MS, now, every));
    }

    #[test]
    fn retries_soon_but_not_past_the_deadline() {
        let now = Instant::now();
        assert_eq!(
            retry_at(now, now + 10_000 * MS, 1000 * MS, 50 * MS),
            now + 250 * MS
        );
        assert_eq!(
            retry_at(now, now + 10_000 * MS, 100 * MS, 50 * MS),
            now + 50 * MS
        );
        assert_eq!(
            retry_at(now, now + 20 * MS, 1000 * MS, 50 * MS),
            now + 20 * MS
        );
    }

    fn entry(g: &crate::LockGuard, fraction: f64) -> Entry {
        let t = g.state().timing();
        Entry {
            state: g.state().clone(),
            next: after(t.since, interval(t.ttl, fraction)),
        }
    }

    #[test]
    fn due_locks_are_renewed_in_one_round() {
        let (locks, nodes, clock) = client(3);
        let ttl = 3000 * MS;
        // 100 acquisitions take 100 ms of virtual time.
        let guards: Vec<_> = (0..100)
            .map(|i| locks.try_lock(&format!("k{i}"), ttl).unwrap())
            .collect();
        let mut entries: Vec<Entry> = guards.iter().map(|g| entry(g, 1.0 / 3.0)).collect();
        let before = nodes.rounds.load(Ordering::SeqCst);

        tick(&*locks.engine, &*locks.engine.clock, &mut entries);
        assert_eq!(
            nodes.rounds.load(Ordering::SeqCst),
            before,
            "nothing due yet"
        );

        clock.advance(900 * MS);
        let old = guards[0].deadline();
        tick(&*locks.engine, &*locks.engine.clock, &mut entries);
        assert_eq!(
            nodes.rounds.load(Ordering::SeqCst),
            before + 1,
            "one round for all"
        );
        assert!(guards.iter().all(|g| g.deadline() > old + 900 * MS));
        // Kept alive well past the original TTL.
        for _ in 0..10 {
            clock.advance(1000 * MS);
            tick(&*locks.engine, &*locks.engine.clock, &mut entries);
        }
        assert_eq!(nodes.rounds.load(Ordering::SeqCst), before + 11);
        assert!(guards.iter().all(|g| g.is_held() && !g.is_lost()));
        assert!(nodes.get(0, "k99").is_some());
    }

    #[test]
    fn a_key_deleted_on_a_majority_is_lost_at_the_next_renewal() {
        let (locks, nodes, clock) = client(3);
        let g = locks.try_lock("k", 300 * MS).unwrap();
        let mut entries = vec![entry(&g, 1.0 / 3.0)];
        nodes.del(0, "k");
        nodes.del(1, "k");
        clock.advance(100 * MS);
        tick(&*locks.engine, &*locks.engine.clock, &mut entries);
        assert!(g.is_lost() && !g.is_held());
        assert!(matches!(g.lost().check(), Some(Error::Expired)));
        assert!(entries.is_empty(), "lost locks are not touched again");
        // The lost lock's remaining key was cleaned up.
        assert!(nodes.get(2, "k").is_none());
    }

    #[test]
    fn failed_renewals_retry_until_validity_runs_out() {
        let (locks, nodes, clock) = client(3);
        let g = locks.try_lock("k", 300 * MS).unwrap();
        let mut entries = vec![entry(&g, 1.0 / 3.0)];
        nodes.set_mode(1, Mode::Down);
        nodes.set_mode(2, Mode::Down);
        let mut ticks = 0;
        while !g.is_lost() && ticks < 100 {
            let next = entries.first().map(|e| e.next);
            if let Some(next) = next {
                clock.advance(next.saturating_duration_since(clock.now()));
            }
            tick(&*locks.engine, &*locks.engine.clock, &mut entries);
            ticks += 1;
        }
        assert!(g.is_lost(), "lost after {ticks} ticks");
        // Lost no later than its deadline, after several retries.
        assert!(ticks >= 3, "{ticks}");
        assert!(clock.now() <= g.deadline() + 60 * MS);
    }

    /// Issue 8: a lock declared lost because its validity ran out (the
    /// renewals' replies were lost, though the nodes executed them) must be
    /// deleted on the nodes, as the README says, not left for a whole TTL.
    #[test]
    fn a_lock_that_ran_out_of_validity_is_deleted_on_the_nodes() {
        let (locks, nodes, clock) = client(3);
        let g = locks.try_lock("k", 300 * MS).unwrap();
        let mut entries = vec![entry(&g, 1.0 / 3.0)];
        for i in 0..3 {
            nodes.set_mode(i, Mode::Lossy);
        }
        let mut ticks = 0;
        while !g.is_lost() && ticks < 100 {
            if let Some(next) = entries.first().map(|e| e.next) {
                clock.advance(next.saturating_duration_since(clock.now()));
            }
            tick(&*locks.engine, &*locks.engine.clock, &mut entries);
            ticks += 1;
        }
        assert!(g.is_lost());
        assert!(
            (0..3).all(|i| nodes.get(i, "k").is_none()),
            "keys left behind by a lock lost to its deadline"
        );
    }

    #[test]
    fn released_locks_are_never_renewed() {
        let (locks, nodes, clock) = client(3);
        let g = locks.try_lock("k", 300 * MS).unwrap();
        let mut entries = vec![entry(&g, 1.0 / 3.0)];
        g.release().unwrap();
        let before = nodes.rounds.load(Ordering::SeqCst);
        clock.advance(100 * MS);
        tick(&*locks.engine, &*locks.engine.clock, &mut entries);
        assert_eq!(nodes.rounds.load(Ordering::SeqCst), before);
        assert!(entries.is_empty());
    }

    fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
        let t = std::time::Instant::now();
        while !f() {
            assert!(
                t.elapsed() < Duration::from_secs(5),
                "timed out waiting for {what}"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn the_thread_survives_a_panicking_tick_and_ends_with_the_client() {
        let (locks, nodes, clock) = client(3);
        let g = locks.try_lock("k", 300 * MS).unwrap();
        g.auto_renew();
        let before = g.deadline();
        nodes.panic_next.store(true, Ordering::SeqCst);
        clock.advance(100 * MS); // renewal due: this tick panics
        wait_for("the injected panic", || {
            !nodes.panic_next.load(Ordering::SeqCst)
        });
        // Still alive: the same lock is renewed on the next tick.
        wait_for("a renewal after the panic", || g.deadline() > before);
        assert!(g.is_held() && !g.is_lost());

        let thread = locks
            .engine
            .watchdog()
            .thread
            .lock()
            .as_ref()
            .map(|h| h.thread().clone());
        assert!(thread.is_some_and(|t| t.name() == Some(THREAD_NAME)));
        let exited = locks.engine.watchdog().exited.clone();
        drop(g);
        drop(locks);
        // Dropping the client ends the thread (joined within a second; on
        // a loaded machine it may end just after).
        wait_for("the thread to end with the client", || {
            exited.load(std::sync::atomic::Ordering::Acquire)
        });
    }

    /// A batch holds at most `MAX_BATCH` keys, counting every key of a lock
    /// of several resources: 400 sets of 16 (6,400 keys) take two rounds.
    /// Counted by locks, one round sent them all, over the bound each
    /// node's script and a release's wait for it rest on.
    #[test]
    fn batches_count_every_key_of_a_set() {
        let (locks, nodes, clock) = client(3);
        let ttl = 30_000 * MS;
        let guards: Vec<_> = (0..400)
            .map(|i| {
                let set: Vec<String> = (0..16).map(|j| format!("s{i}-{j}")).collect();
                crate::testing::request_all(&locks, &set, ttl)
                    .try_acquire()
                    .unwrap()
            })
            .collect();
        let mut entries: Vec<Entry> = guards.iter().map(|g| entry(g, 1.0 / 3.0)).collect();
        let before = nodes.rounds.load(Ordering::SeqCst);
        clock.advance(10_500 * MS);
        tick(&*locks.engine, &*locks.engine.clock, &mut entries);
        assert_eq!(nodes.rounds.load(Ordering::SeqCst), before + 2);
        assert!(guards
            .iter()
            .all(|g| g.is_held() && g.deadline() > clock.now() + 20_000 * MS));
    }

    /// Readers and writers of one TTL are renewed in separate rounds: a
    /// reader's renewal needs `ZADD`, which a node out of memory refuses,
    /// and the refusal fails the whole script, the writers' renewals with
    /// it (a writer lost its lock that way beside a reader of its client).
    #[test]
    fn readers_and_writers_go_in_separate_batches() {
        let (locks, nodes, clock) = client(3);
        let w = locks.try_lock("w", 300 * MS).unwrap();
        let r = locks.request("r", 300 * MS).read().try_acquire().unwrap();
        let mut entries = vec![entry(&r, 1.0 / 3.0), entry(&w, 1.0 / 3.0)];
        let before = nodes.rounds.load(Ordering::SeqCst);
        clock.advance(110 * MS);
        tick(&*locks.engine, &*locks.engine.clock, &mut entries);
        assert_eq!(nodes.rounds.load(Ordering::SeqCst), before + 2);
        assert!(w.deadline() > clock.now() + 250 * MS && r.deadline() > clock.now() + 250 * MS);
    }

    #[test]
    fn locks_with_different_ttls_go_in_separate_batches() {
        let (locks, nodes, clock) = client(3);
        let a = locks.try_lock("a", 300 * MS).unwrap();
        let b = locks.try_lock("b", 330 * MS).unwrap();
        let mut entries = vec![entry(&a, 1.0 / 3.0), entry(&b, 1.0 / 3.0)];
        let before = nodes.rounds.load(Ordering::SeqCst);
        clock.advance(110 * MS);
        tick(&*locks.engine, &*locks.engine.clock, &mut entries);
        assert_eq!(nodes.rounds.load(Ordering::SeqCst), before + 2);
        assert_eq!(a.ttl(), 300 * MS);
        assert_eq!(b.ttl(), 330 * MS);
    }
}
