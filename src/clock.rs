//! The one seam through which the algorithm reads time, waits, starts
//! threads and draws randomness.
//!
//! Production code uses [`SystemClock`]; tests substitute a virtual clock,
//! and the deterministic simulation (`crate::testing::sim`) a scheduler that runs one
//! thread at a time on virtual time, so that every timing decision of the
//! algorithm, the local queue and the renewal thread replays from a seed.

use std::fmt;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Monotonic time as the algorithm sees it, and every way it blocks: the
/// algorithm never calls `Instant::now`, sleeps or waits on a condition
/// variable except through this trait.
pub(crate) trait Clock: Send + Sync + fmt::Debug + 'static {
    /// The current instant.
    fn now(&self) -> Instant;

    /// Block the calling thread for `d` (retry back-off).
    fn sleep(&self, d: Duration);

    /// Blocks until `signal` is notified after it read `seen` (see
    /// [`Signal::seen`]) or, with `until`, until that instant of this
    /// clock. May return early; callers re-check their condition.
    fn wait(&self, signal: &Arc<Signal>, seen: u64, until: Option<Instant>) {
        // This clock's instants, as a real timeout (equal for real time).
        let real = until.map(|u| after(Instant::now(), u.saturating_duration_since(self.now())));
        signal.wait_real(seen, real);
    }

    /// The wall clock in ms since the Unix epoch: not for measuring time
    /// (that is [`now`](Self::now)), only for the order of waiting calls
    /// across processes (see [`crate::algorithm::round::Place`]).
    fn wall_ms(&self) -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
    }

    /// Starts a thread whose time and waits go through this clock.
    fn spawn(&self, name: &str, f: Box<dyn FnOnce() + Send>) -> io::Result<JoinHandle<()>> {
        std::thread::Builder::new().name(name.into()).spawn(f)
    }
}

/// Real time: `Instant::now`, `thread::sleep`, OS threads.
#[derive(Debug, Default)]
pub(crate) struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Instant {
        Instant::now()
    }
    fn sleep(&self, d: Duration) {
        std::thread::sleep(d)
    }
}

/// A wake-up call between threads: a condition variable with a count, so
/// that a wait that starts after a notification (`seen` is stale) returns at
/// once. Read [`seen`](Self::seen) while holding the lock that guards the
/// condition, release it, then [`Clock::wait`].
#[derive(Debug, Default)]
pub(crate) struct Signal {
    count: parking_lot::Mutex<u64>,
    cv: parking_lot::Condvar,
}

impl Signal {
    /// Notifications so far.
    pub(crate) fn seen(&self) -> u64 {
        *self.count.lock()
    }

    /// Wakes every thread waiting on this signal.
    pub(crate) fn notify(&self) {
        let mut count = self.count.lock();
        *count = count.wrapping_add(1);
        self.cv.notify_all();
    }

    /// Real-time wait: until notified after `seen` or `until` passes.
    pub(crate) fn wait_real(&self, seen: u64, until: Option<Instant>) {
        let mut count = self.count.lock();
        while *count == seen {
            match until {
                Some(u) => {
                    if self.cv.wait_until(&mut count, u).timed_out() {
                        return;
                    }
                }
                None => self.cv.wait(&mut count),
            }
        }
    }
}

/// A small lock-free pseudo-random source (SplitMix64) for retry jitter.
/// Seeded from the OS for real clients, fixed in tests.
#[derive(Debug)]
pub(crate) struct Rng(AtomicU64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Rng(AtomicU64::new(seed))
    }

    pub(crate) fn from_os() -> Self {
        Rng::new(uuid::Uuid::new_v4().as_u64_pair().0)
    }

    pub(crate) fn next_u64(&self) -> u64 {
        let mut z = self
            .0
            .fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed)
            .wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// A fresh random lock token: a UUIDv4 (122 random bits from the OS) as 32
/// hex digits.
pub(crate) fn new_token() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}

/// A reader's token: `r` and 128 random bits in hex (see
/// [`crate::algorithm::round::is_reader`]).
pub(crate) fn new_reader_token() -> String {
    format!("r{}", uuid::Uuid::new_v4().simple())
}

/// The token of a new critical section of a handed-over lock: the lock's
/// lineage (the token it was acquired with), a dot, 64 fresh random bits.
/// The release script deletes any token of a lineage, so a node that missed
/// a swap is still cleaned up (see `scripts::RELEASE_LUA`).
pub(crate) fn section_token(token: &str) -> String {
    let lineage = token.split('.').next().unwrap_or(token);
    let random = uuid::Uuid::new_v4().as_u64_pair().0;
    format!("{lineage}.{random:016x}")
}

/// How often one node's failures may be logged at warn level.
pub(crate) const WARN_EVERY: Duration = Duration::from_secs(30);

/// Lets an event through at most once per period (for warn-level logs).
#[derive(Debug, Default)]
pub(crate) struct Throttle(parking_lot::Mutex<Option<Instant>>);

impl Throttle {
    /// True when the last `true` was at least `every` before `now`.
    pub(crate) fn ready(&self, now: Instant, every: Duration) -> bool {
        let mut last = self.0.lock();
        let due = last.is_none_or(|t| now.saturating_duration_since(t) >= every);
        if due {
            *last = Some(now);
        }
        due
    }
}

/// `d` less 1 %: a span measured by one clock, as a bound on what another
/// clock (a node's, the client's) may have measured over it, their rates
/// differing by up to 1 %.
pub(crate) fn slower(d: Duration) -> Duration {
    d.saturating_sub(d / 100)
}

/// `t + d`, saturating to a far-future instant instead of panicking.
pub(crate) fn after(t: Instant, d: Duration) -> Instant {
    t.checked_add(d)
        .or_else(|| t.checked_add(Duration::from_secs(100 * 365 * 86_400)))
        .unwrap_or(t)
}
