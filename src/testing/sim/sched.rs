//! The deterministic scheduler: logical threads on virtual time.
//!
//! Every logical thread is an OS thread, but only the one holding the handed
//! runs; the others are parked on their own condition variable. A thread
//! gives the handed up only where production code blocks, that is through
//! [`Clock`] (sleep, wait on a [`Signal`]) or the simulated connections
//! (wait for replies). The scheduler then picks the next thread among those
//! whose wait is over, with the run's seeded RNG, and when none is, moves
//! virtual time to the next timer or world event and fires it. One seed, one
//! interleaving: a failing schedule replays exactly.

use std::cell::Cell;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, MutexGuard};

use crate::clock::{after, Clock, Signal};
use crate::testing::sim::rng::SimRng;
use crate::testing::sim::world::World;

thread_local! {
    /// The logical thread this OS thread runs, if any.
    static ME: Cell<Option<usize>> = const { Cell::new(None) };
}

/// What a parked thread waits for (times in virtual nanoseconds).
enum Wait {
    Ready,
    Until(u64),
    Signal(Arc<Signal>, u64, Option<u64>),
    Done,
}

struct Slot {
    name: String,
    cv: Arc<Condvar>,
    wait: Wait,
}

/// Everything the scheduler guards: the threads and the world.
pub(crate) struct Core {
    pub(crate) world: World,
    threads: Vec<Slot>,
    running: Option<usize>,
    rng: SimRng,
    /// Scheduling decisions so far (a runaway schedule is stopped).
    pub(crate) steps: u64,
    /// Why the run stopped early (deadlock, runaway), if it did.
    pub(crate) aborted: Option<String>,
    /// A hash of every decision (who ran, at what time): equal for two
    /// runs of one seed.
    pub(crate) trace: u64,
}

/// Most scheduling steps in one run: far above any plan's need.
const STEP_LIMIT: u64 = 2_000_000;

/// The scheduler of one simulated run.
pub(crate) struct Sched {
    base: Instant,
    now: AtomicU64,
    core: Mutex<Core>,
    /// Notified when every thread is done or the run aborted.
    finished: Condvar,
}

impl Sched {
    pub(crate) fn new(seed: u64, world: World, base: Instant) -> Arc<Sched> {
        Arc::new(Sched {
            base,
            now: AtomicU64::new(0),
            core: Mutex::new(Core {
                world,
                threads: Vec::new(),
                running: None,
                rng: SimRng::new(seed ^ 0x5c4e_d01e),
                steps: 0,
                aborted: None,
                trace: 0xcbf2_9ce4_8422_2325,
            }),
            finished: Condvar::new(),
        })
    }

    /// Virtual nanoseconds since the start.
    pub(crate) fn nanos(&self) -> u64 {
        self.now.load(Ordering::Acquire)
    }

    pub(crate) fn instant(&self, nanos: u64) -> Instant {
        after(self.base, Duration::from_nanos(nanos))
    }

    pub(crate) fn nanos_of(&self, t: Instant) -> u64 {
        u64::try_from(t.saturating_duration_since(self.base).as_nanos()).unwrap_or(u64::MAX)
    }

    /// The world, for the running thread (or before and after the run).
    pub(crate) fn lock(&self) -> MutexGuard<'_, Core> {
        self.core.lock()
    }

    /// Registers a logical thread running `f`, ready at once; it runs when
    /// the scheduler picks it.
    pub(crate) fn spawn(
        self: &Arc<Self>,
        name: &str,
        f: Box<dyn FnOnce() + Send>,
    ) -> io::Result<JoinHandle<()>> {
        let cv = Arc::new(Condvar::new());
        let id = {
            let mut core = self.core.lock();
            core.threads.push(Slot {
                name: name.to_owned(),
                cv: cv.clone(),
                wait: Wait::Ready,
            });
            core.threads.len() - 1
        };
        let sched = self.clone();
        std::thread::Builder::new()
            .name(format!("sim-{name}"))
            .stack_size(256 * 1024)
            .spawn(move || {
                ME.with(|me| me.set(Some(id)));
                {
                    let mut core = sched.core.lock();
                    while core.running != Some(id) {
                        cv.wait(&mut core);
                    }
                }
                let run = std::panic::AssertUnwindSafe(f);
                if let Err(p) = std::panic::catch_unwind(run) {
                    let what = p
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| p.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                        .unwrap_or_default();
                    let mut core = sched.core.lock();
                    let name = core.threads[id].name.clone();
                    let at = sched.nanos();
                    core.world
                        .check
                        .violation(at, format!("thread {name} panicked: {what}"));
                }
                let mut core = sched.core.lock();
                core.threads[id].wait = Wait::Done;
                sched.switch(&mut core);
            })
    }

    /// Runs the logical thread `main` (which may spawn more) until every
    /// thread is done, on this OS thread's watch: a run that takes longer
    /// than `real_limit` of real time is reported hung.
    pub(crate) fn run(self: &Arc<Self>, main: Box<dyn FnOnce() + Send>, real_limit: Duration) {
        if let Err(e) = self.spawn("main", main) {
            self.core.lock().aborted = Some(format!("cannot start a thread: {e}"));
            return;
        }
        let mut core = self.core.lock();
        self.switch(&mut core);
        let limit = after(Instant::now(), real_limit);
        while core.running.is_some() && core.aborted.is_none() {
            if self.finished.wait_until(&mut core, limit).timed_out() {
                let who: Vec<String> = core
                    .threads
                    .iter()
                    .filter(|t| !matches!(t.wait, Wait::Done))
                    .map(|t| t.name.clone())
                    .collect();
                core.aborted = Some(format!(
                    "hung in real time (a thread blocked outside the scheduler?): running {:?}, not done {who:?}",
                    core.running.map(|r| core.threads[r].name.clone())
                ));
            }
        }
    }

    /// Parks the calling logical thread until `wait` is over.
    fn block(&self, wait: Wait) {
        let Some(me) = ME.with(Cell::get) else {
            // Not a logical thread (a test's own thread, after the run):
            // the wait's time passes at once.
            if let Wait::Until(u) | Wait::Signal(_, _, Some(u)) = wait {
                self.now.fetch_max(u, Ordering::AcqRel);
            }
            return;
        };
        let mut core = self.core.lock();
        core.threads[me].wait = wait;
        self.switch(&mut core);
        let cv = core.threads[me].cv.clone();
        while core.running != Some(me) {
            cv.wait(&mut core);
        }
    }

    /// Lets the scheduler pick again (maybe another thread) at this instant.
    pub(crate) fn yield_now(&self) {
        self.block(Wait::Until(self.nanos()));
    }

    /// Parks the caller until `signal` moves past `seen` or `until`.
    pub(crate) fn wait_signal(&self, signal: &Arc<Signal>, seen: u64, until: Option<Instant>) {
        let until = until.map(|u| self.nanos_of(u));
        self.block(Wait::Signal(signal.clone(), seen, until));
    }

    /// Passes the handed: to a thread whose wait is over, moving time and
    /// firing world events until there is one. With none left, the run is
    /// over (or deadlocked).
    fn switch(&self, core: &mut Core) {
        core.running = None;
        loop {
            core.steps += 1;
            let now = self.nanos();
            core.world.observe(now);
            if core.steps > STEP_LIMIT {
                core.aborted = Some(format!("runaway: {STEP_LIMIT} steps"));
                self.finished.notify_all();
                return;
            }
            let ready: Vec<usize> = (0..core.threads.len())
                .filter(|&i| match &core.threads[i].wait {
                    Wait::Ready => true,
                    Wait::Until(t) => *t <= now,
                    Wait::Signal(s, seen, until) => {
                        s.seen() != *seen || until.is_some_and(|u| u <= now)
                    }
                    Wait::Done => false,
                })
                .collect();
            if !ready.is_empty() {
                let pick = ready[core.rng.below(ready.len() as u64) as usize];
                core.trace = (core.trace ^ (pick as u64) ^ now.rotate_left(17))
                    .wrapping_mul(0x0100_0000_01b3);
                let slot = &mut core.threads[pick];
                slot.wait = Wait::Ready;
                core.running = Some(pick);
                slot.cv.notify_one();
                return;
            }
            let timer = core
                .threads
                .iter()
                .filter_map(|t| match &t.wait {
                    Wait::Until(u) | Wait::Signal(_, _, Some(u)) => Some(*u),
                    _ => None,
                })
                .min();
            let next = match (timer, core.world.next_event()) {
                (Some(a), Some(b)) => a.min(b),
                (a, b) => match a.or(b) {
                    Some(t) => t,
                    None => {
                        if core.threads.iter().any(|t| !matches!(t.wait, Wait::Done)) {
                            let stuck: Vec<&str> = core
                                .threads
                                .iter()
                                .filter(|t| !matches!(t.wait, Wait::Done))
                                .map(|t| t.name.as_str())
                                .collect();
                            core.aborted =
                                Some(format!("deadlock: {stuck:?} wait with nothing due"));
                        }
                        self.finished.notify_all();
                        return;
                    }
                },
            };
            if next > now {
                self.now.store(next, Ordering::Release);
            }
            core.world.fire(next.max(now));
        }
    }
}

/// The simulation's [`Clock`]: virtual time, and blocking that passes the
/// handed.
#[derive(Clone)]
pub(crate) struct SimClock(pub(crate) Arc<Sched>);

impl std::fmt::Debug for SimClock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SimClock({} ns)", self.0.nanos())
    }
}

impl Clock for SimClock {
    fn now(&self) -> Instant {
        self.0.instant(self.0.nanos())
    }

    /// Virtual too: every client of a run on one wall clock, replayed.
    fn wall_ms(&self) -> u64 {
        1_796_000_000_000 + self.0.nanos() / 1_000_000
    }

    fn sleep(&self, d: Duration) {
        let until = self
            .0
            .nanos()
            .saturating_add(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
        self.0.block(Wait::Until(until));
    }

    fn wait(&self, signal: &Arc<Signal>, seen: u64, until: Option<Instant>) {
        self.0.wait_signal(signal, seen, until);
    }

    fn spawn(&self, name: &str, f: Box<dyn FnOnce() + Send>) -> io::Result<JoinHandle<()>> {
        self.0.spawn(name, f)
    }
}
