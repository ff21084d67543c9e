//! The waits between a call's attempts: after a failed attempt, a wait for
//! a release's wake-up (see [`crate::driver::notify`]) or a fallback: the
//! retry pause, or the owner's expiry where sooner, at most
//! [`FALLBACK_CAP`]; and the rules that keep woken waiters from splitting
//! the votes or being driven by forged messages.

use std::time::{Duration, Instant};

use log::{debug, trace};

use crate::algorithm::quorum;
use crate::algorithm::round::Place;
use crate::clock::after;
use crate::error::Error;
use crate::events::Begun;
use crate::lock::transport::Watch;
use crate::Result;

use super::remote::SetWaiting;
use super::{Budget, Engine, Want};

/// Quick retries in a row after an attempt that found the key not held
/// everywhere (see [`Waiter::pause`]).
const QUICK_RETRIES: u32 = 2;

/// Woken tries in a row that met the same owners (see
/// [`quorum::new_owner`]) after which a waiter stops listening until its
/// next try by the clock. Three: such a try may be a real release followed
/// at once by an owner with as much time left, within a round's time (under
/// hot contention two in a row were seen, and the waiter missed the next
/// release by a retry pause); a stream of forged messages costs a waiter at
/// most three rounds per fallback pause (five where each notice's copies
/// make a majority after the retry it woke: see [`Watch::again`]).
const SAME_OWNERS: u32 = 3;

/// Wake-ups lost after which a woken waiter tries at once (see
/// [`Waiter::sleep`]) where this client has not seen how many others wait:
/// with four clients taking turns, the one that lost to the three others.
/// Otherwise the other clients its last release of the key reached (at
/// most [`MAX_FRONT`]).
const FRONT: u32 = 3;

/// The most wake-ups a woken waiter waits to have lost before it tries at
/// once.
const MAX_FRONT: u32 = 16;

/// The longest a subscribed waiter waits for a wake-up before it tries
/// again (its retry pause or the owner's expiry, where shorter): a lost
/// message costs at most this.
pub(crate) const FALLBACK_CAP: Duration = Duration::from_secs(1);

/// What a failed attempt saw, for the wait after it.
#[derive(Debug, Default, Clone)]
pub(super) struct Failed {
    /// Nodes where its SET landed (undone since).
    pub ours: usize,
    /// How long until a majority could take the key, by the owners'
    /// remaining TTLs (see [`quorum::free_in`]).
    pub free_in: Option<Duration>,
    /// What each node said of the owner (see [`quorum::new_owner`]).
    pub owners: Vec<quorum::Seen>,
}

impl Failed {
    /// What an attempt at `keys` keys saw, from its results after the
    /// restart rule.
    pub(super) fn of(judged: &[crate::algorithm::round::NodeResult], keys: usize) -> Self {
        Failed {
            ours: quorum::Tally::of(judged, 0).ok,
            free_in: quorum::free_in(judged),
            owners: quorum::seen(judged, keys),
        }
    }
}

/// What the next attempt is told of the call so far.
pub(super) struct Try {
    /// When the call began and whether this try was woken (for events).
    pub begun: Begun,
    /// How long a waiting writer keeps new readers out (zero on a last
    /// try: see [`Op::Acquire`](crate::algorithm::round::Op::Acquire)).
    pub intent: Duration,
    /// The call's first try.
    pub first: bool,
    /// A waiting writer's place among the waiters of its keys, and a
    /// set's claims (see [`Place`]).
    pub place: Place,
}

/// One call's waiting between its attempts: the counted attempts and the
/// retry pause, the subscription to releases, and what the last tries saw.
pub(super) struct Waiter<'a> {
    engine: &'a Engine,
    want: Want<'a>,
    budget: Budget,
    /// The end of the call.
    until: Instant,
    /// When the call began.
    called: Instant,
    /// Whether the call listens for releases (it waits, wake-ups are on).
    wakes: bool,
    /// How long a waiting writer's intent lasts (zero for a reader, or a
    /// call that does not wait).
    span: Duration,
    /// Counted as a waiter for a lock of several or a read lock (see
    /// [`SetWaiting`]), for the call.
    _set_waiting: Option<SetWaiting<'a>>,
    /// Counted attempts so far.
    attempt: u32,
    /// When the next counted attempt is due (the retry pause after the
    /// last): a subscribed waiter's tries at a shorter fallback (the cap,
    /// the owner's expiry) come in between, not counted, so that
    /// `lock()`'s attempts stay a retry pause apart.
    due: Option<Instant>,
    /// Wake-ups by the releases of other clients: from the first failed
    /// attempt on, or from the start where this client is subscribed
    /// already.
    watch: Option<Box<dyn Watch>>,
    /// Whether the current try was woken.
    woken: bool,
    /// Whether an owner's expiry may end a wait: not after a try at an
    /// expiry found the key still held (a live holder renews it; its
    /// waiters would try at every expiry they read), for the rest of the
    /// call.
    trust_expiry: bool,
    /// Whether the current try was made at the owners' expiry.
    at_expiry: bool,
    /// Wake-ups this call lost (the last one woken is not lost yet).
    lost: u32,
    /// Wake-ups lost after which a woken try goes at once (see [`FRONT`]).
    front: u32,
    /// What the last try saw of the owners, when, and how long it took: a
    /// woken try that meets the same owners again may have been woken by a
    /// message no release sent (forged, or from another database: pub/sub
    /// ignores it). After [`SAME_OWNERS`] such tries in a row the waiter
    /// hears no more messages until its next try by the clock.
    owners: Option<(Instant, Duration, Vec<quorum::Seen>)>,
    /// Woken tries in a row that met the same owners.
    same: u32,
    /// A waiting writer's place (see [`Place`]): its call's start; a set's
    /// claim id.
    place: Place,
    /// A set's keys that kept it out through a whole wait with no wake-up
    /// (a try by the clock found them held, as the try before did: their
    /// holders stay, renewed or not): until a release of one wakes it, or
    /// a try finds them free, the set claims nothing and listens to them
    /// alone (a claim must not keep others out while a long holder keeps
    /// the set out).
    stuck: Option<Vec<bool>>,
    /// The keys that kept a set out at its last failed try.
    blocked: Vec<bool>,
    /// Whether the wait before the current try ran out with no wake-up.
    quiet: bool,
    /// Whether a set's tries since its claims last went may have claimed
    /// keys.
    claiming: bool,
    /// Quick retries in a row (see [`QUICK_RETRIES`]).
    quick: u32,
    /// Tries so far, counted or not.
    tries: u32,
    /// When the current try began.
    tried: Instant,
}

impl<'a> Waiter<'a> {
    /// The waiting of a call for `want` until `until`, begun at `called`:
    /// a waiting call first yields to the waiters of other clients (see
    /// `yield_to_others`).
    pub(super) fn new(
        engine: &'a Engine,
        want: Want<'a>,
        budget: Budget,
        (called, until): (Instant, Instant),
    ) -> Self {
        let waits = !matches!(budget, Budget::Attempts(1));
        let wakes = waits && engine.settings.wake_ups;
        let others = if waits {
            engine.yield_to_others(want, until)
        } else {
            None
        };
        // This client's own releases wake its waiters for locks of several
        // and its readers.
        let set_waiting = (waits && !want.alone()).then(|| engine.remote.set_waiting());
        // A waiting writer's intent outlives the longest wait between its
        // tries: the retry pause, and the round and undo before it (each
        // as long as a round of its keys may wait). (Not cut to the TTL: a
        // TTL below the pause let readers in between the tries, and a
        // stream of them starved the writer.)
        let span = if waits && !want.read {
            let s = &engine.settings;
            s.retry_delay
                .saturating_add(s.retry_jitter)
                .saturating_add(engine.allowance(want.size()).saturating_mul(3))
        } else {
            Duration::ZERO
        };
        let watch = if wakes && want.alone() {
            engine.transport.watch_existing(want.resource)
        } else {
            None
        };
        let front = others.map_or(FRONT, |n| n.clamp(1, MAX_FRONT));
        // A waiting writer's place: its call's start; a set's claim id. (A
        // set of more than 64 keys has none: it polls, and claims nothing.)
        let place = if waits && !want.read && want.size() <= u64::BITS as usize {
            Place {
                since: engine.clock.wall_ms(),
                claim: if want.alone() {
                    0
                } else {
                    engine.rng.next_u64() | 1
                },
                life: Duration::ZERO,
                keys: 0,
            }
        } else {
            Place::NONE
        };
        Waiter {
            place,
            stuck: None,
            blocked: Vec::new(),
            quiet: false,
            claiming: false,
            engine,
            front,
            want,
            budget,
            until,
            called,
            wakes,
            span,
            _set_waiting: set_waiting,
            attempt: 1,
            due: None,
            watch,
            woken: false,
            trust_expiry: true,
            at_expiry: false,
            lost: 0,
            owners: None,
            same: 0,
            quick: 0,
            tries: 0,
            tried: called,
        }
    }

    /// Starts a try: what the attempt is told.
    pub(super) fn next_try(&mut self) -> Try {
        if let Some(w) = &mut self.watch {
            w.mark();
        }
        self.tried = self.engine.clock.now();
        // An attempt after which no try may come (the last counted one, or
        // at the deadline) marks no intent, and none outlives the call's
        // wait (a writer that gave up kept readers out for a whole pause).
        let last = matches!(self.budget, Budget::Attempts(n) if self.attempt >= n);
        let intent = if last {
            Duration::ZERO
        } else {
            self.span
                .min(self.until.saturating_duration_since(self.tried))
        };
        let first = self.tries == 0;
        self.tries += 1;
        // A set's claims live as its intent: once it has waited a retry
        // pause (before, it competes as any lock: claims cost the keys'
        // other users the time a claimed key waits for the set's other
        // keys), and never while a key it waits for is stuck with one owner.
        let starved =
            self.tried.saturating_duration_since(self.called) >= self.engine.settings.retry_delay;
        // (A first try sends no place: it is the youngest call anyway.)
        let place = if first {
            Place::NONE
        } else {
            Place {
                life: if self.stuck.is_some() || !starved {
                    Duration::ZERO
                } else {
                    intent
                },
                ..self.place
            }
        };
        self.claiming = !place.life.is_zero() && (place.keys != 0 || self.claiming);
        Try {
            place,
            begun: Begun {
                waited: self.tried.saturating_duration_since(self.called),
                woken: self.woken,
            },
            intent,
            first,
        }
    }

    /// After a failed try: waits until the next one is due and returns, or
    /// gives up with `err` (the call's time or attempts are used up).
    pub(super) fn after_failure(&mut self, err: Error, failed: Failed) -> Result<()> {
        let engine = self.engine;
        // Drawn first, as always (the simulation's schedules rest on the
        // order of the draws).
        let s = &engine.settings;
        let pause = quorum::retry_delay(s.retry_delay, s.retry_jitter, engine.rng.next_u64());
        let now = engine.clock.now();
        let left = self.until.saturating_duration_since(now);
        if left.is_zero() {
            return Err(err);
        }
        // A set's claims and what it listens to, from what this try saw.
        let keys = self.want.size();
        let drop_claims = keys > 1 && self.listen_and_claim(quorum::blocking(&failed.owners, keys));
        if self.watch.is_none() && self.wakes && self.subscribe(now, left) {
            self.quiet = false;
            // Tried again at once (not counted as an attempt): the release
            // may have come before the subscription.
            debug!(
                "lock {:?}: attempt failed ({err}); waiting for its release",
                self.want.resource
            );
            return Ok(());
        }
        // A woken try never counts: a message is a hint anyone can send, and
        // must not use up `lock()`'s attempts, which stay a retry pause
        // apart.
        if self.due.is_none_or(|d| now >= d) {
            if let Budget::Attempts(n) = self.budget {
                if self.attempt >= n {
                    return Err(err);
                }
            }
            self.attempt = self.attempt.saturating_add(1);
            // A subscribed candidate of an election tries by the clock once
            // per fallback cap, not per retry pause: a leader renews its
            // lease for as long as it leads, and its end comes as a
            // wake-up (a resignation) or at the lease's expiry (a death).
            let every = if self.want.tag.is_empty() || self.watch.is_none() {
                pause
            } else {
                FALLBACK_CAP
            };
            self.due = Some(after(now, every));
        }
        // What is left of the retry pause.
        let pause = self.due.map_or(pause, |d| d.saturating_duration_since(now));
        let took = now.saturating_duration_since(self.tried);
        let mut pause = self.pause(&err, failed, (now, took), pause);
        if drop_claims {
            // Claims out behind a holder that stays: they go at once.
            pause = Duration::ZERO;
        }
        debug!(
            "lock {:?}: attempt failed ({err}); retrying within {pause:?}",
            self.want.resource
        );
        self.sleep(pause, now, took);
        Ok(())
    }

    /// A set's waiting after a try that found `blocking` of its keys held
    /// elsewhere: it claims them once free (see [`Place`]) and listens to
    /// their releases (to every key where none is held). A try by the
    /// clock that finds keys held that the try before found held too makes
    /// them stuck (see [`Waiter::stuck`]): then it listens to them alone.
    /// Whether claims of its are out that a newly stuck key makes it drop.
    fn listen_and_claim(&mut self, blocking: Vec<bool>) -> bool {
        let both = |a: &[bool]| -> Option<Vec<bool>> {
            let v: Vec<bool> = a.iter().zip(&blocking).map(|(x, y)| *x && *y).collect();
            v.contains(&true).then_some(v)
        };
        let was = self.stuck.is_some();
        self.stuck = match self.stuck.take() {
            _ if self.woken => None,
            Some(s) => both(&s),
            None if self.quiet => both(&self.blocked),
            None => None,
        };
        self.place.keys = blocking
            .iter()
            .take(64)
            .enumerate()
            .filter(|(_, b)| **b)
            .fold(0, |m, (i, _)| m | 1 << i);
        let mut listen = self.stuck.clone().unwrap_or_else(|| blocking.clone());
        if !listen.contains(&true) {
            listen.fill(true);
        }
        if let Some(w) = self.watch.as_mut() {
            w.listen_to(&listen);
        }
        self.blocked = blocking;
        !was && self.stuck.is_some() && self.claiming
    }

    /// Whether the current try was made with the other waiters at once:
    /// woken, or at the owners' expiry.
    fn together(&self) -> bool {
        self.woken || self.at_expiry
    }

    /// Subscribes to the releases of the call's resources, waiting for the
    /// nodes until `now` + the node timeout (within `left`): whether it is.
    fn subscribe(&mut self, now: Instant, left: Duration) -> bool {
        let engine = self.engine;
        let confirm_by = after(now, engine.settings.node_timeout.min(left));
        self.watch = if self.want.alone() {
            engine.transport.watch(self.want.resource, confirm_by)
        } else {
            let names: Vec<&str> = self.want.resources().collect();
            engine.transport.watch_all(&names, confirm_by)
        };
        self.watch.is_some()
    }

    /// How long to wait after a try that failed with `err` and saw
    /// `failed`, at `now`, `took` after it began: `pause` (what is left of
    /// the retry pause), or for a subscribed waiter a fallback should no
    /// wake-up come, or a quick retry after a split vote.
    fn pause(
        &mut self,
        err: &Error,
        failed: Failed,
        (now, took): (Instant, Duration),
        pause: Duration,
    ) -> Duration {
        // Each reading is somewhere in its attempt: off by the longer of the
        // two attempts' times (and PTTL's millisecond).
        let read_in = self.owners.as_ref().map_or(took, |(_, t, _)| took.max(*t));
        let slack = read_in.saturating_add(Duration::from_millis(1));
        let before = self.owners.as_ref().map(|(t, _, o)| (*t, o.as_slice()));
        self.same = if self.woken && !quorum::new_owner(before, &failed.owners, now, slack) {
            self.same.saturating_add(1)
        } else {
            0
        };
        let deaf = self.same >= SAME_OWNERS;
        self.owners = Some((now, took, failed.owners));
        // A woken attempt that set the key on some nodes and still lost:
        // maybe waiters woken together split the votes and each undid its
        // own, which frees the key without a message. Tried again soon (half
        // to twice an attempt's time, at random), twice in a row at most,
        // then the retry pause. Not where the try met the same owners again
        // (`deaf`): a real split shows other waiters' keys where the try
        // before saw none, and a quick retry is no try by the clock (a
        // holder on a bare majority let every forged message set the free
        // nodes, and the quick retries in between ended the deafness: ~150
        // rounds in a 1.2 s storm).
        let split = !deaf
            && self.watch.is_some()
            && (self.together() || self.quick > 0)
            && self.quick < QUICK_RETRIES
            && failed.ours > 0
            && matches!(err, Error::Taken { .. });
        // A subscribed waiter's fallback, should no wake-up come: the retry
        // pause, or sooner the moment the owners' keys expire on a majority
        // (a holder that stopped without a release), never more than
        // `FALLBACK_CAP`. (Where this attempt set some nodes, the owners
        // elsewhere may be waiters that split the votes with it: their
        // keys' expiry is a whole TTL, and the shorter of it and the pause
        // never waits longer.)
        // (A candidate's leader renews: its expiry moves on, and stays
        // the moment to try should the leader die.)
        if self.at_expiry && !split && self.want.tag.is_empty() {
            self.trust_expiry = false;
        }
        let expiry = self
            .watch
            .as_ref()
            .and(failed.free_in)
            .filter(|_| self.trust_expiry)
            .map(|f| f.saturating_add(Duration::from_millis(1)));
        let pause = if split {
            self.quick += 1;
            let rng = self.engine.rng.next_u64();
            quorum::retry_delay(took * 5 / 4, took * 3 / 4, rng).min(pause)
        } else {
            self.quick = 0;
            match (&self.watch, expiry) {
                (Some(_), Some(e)) => e.min(pause).min(FALLBACK_CAP),
                (Some(_), None) => pause.min(FALLBACK_CAP),
                (None, _) => pause,
            }
        }
        .min(self.until.saturating_duration_since(now));
        self.at_expiry = !split && expiry.is_some_and(|e| e <= pause);
        pause
    }

    /// Waits up to `pause` after a try that ended at `now`, `took` after
    /// it began: for a wake-up where subscribed (unless deaf to them), then,
    /// woken, a spacing that puts who lost more wake-ups first.
    fn sleep(&mut self, pause: Duration, now: Instant, took: Duration) {
        let clock = &self.engine.clock;
        let resource = self.want.resource;
        // (A wait that runs out with no wake-up: see `Waiter::stuck`.)
        self.quiet = !pause.is_zero() && self.quick == 0;
        let Some(w) = &self.watch else {
            self.at_expiry = false;
            clock.sleep(pause);
            return;
        };
        self.woken = if self.same >= SAME_OWNERS {
            trace!("lock {resource:?}: woken for nothing; not listening for {pause:?}");
            clock.sleep(pause);
            false
        } else {
            w.wait(after(clock.now(), pause))
        };
        if self.woken && w.again() {
            // Woken by a release's copy that made its majority after the
            // last try began: that try read the owners before the release
            // freed the key (a loaded machine, or nodes back from an
            // outage), and met them again for no fault of the message.
            self.same = self.same.saturating_sub(1);
        }
        self.quiet &= !self.woken;
        // Woken, or at the owners' expiry: every waiter would try at once.
        let together = self.together();
        if self.woken {
            // (The expiry stays untrusted where it was: a woken try that
            // fails may meet the same renewed holder, after a forged or
            // duplicated message; a new owner that dies costs at most the
            // cap.)
            self.at_expiry = false;
        }
        if !together {
            trace!("lock {resource:?}: not woken; trying again");
            return;
        }
        // Every woken waiter would try at once. Who lost more wake-ups goes
        // first: one that lost as many as other clients wait (see
        // [`FRONT`]) at once, the others half an
        // attempt's time later for each wake-up they lost fewer (less up to
        // a quarter, at random), close to first come, first served, and the
        // votes rarely split. (Each waited an attempt's time over its
        // wake-ups lost, the first too: a third of every hand-over between
        // processes was that wait and the sleep's overshoot.) Never sooner
        // than one attempt's time after its last one ended: a stream of
        // messages cannot drive rounds back to back.
        self.lost = self.lost.saturating_add(1);
        let spread = woken_spacing(took, (self.lost, self.front), self.engine.rng.next_u64());
        let spaced = after(now, took).saturating_duration_since(clock.now());
        let wait = spread
            .max(spaced)
            .min(self.until.saturating_duration_since(clock.now()));
        trace!(
            "lock {resource:?}: woken ({}); trying in {wait:?}",
            self.woken
        );
        if !wait.is_zero() {
            clock.sleep(wait);
        }
    }
}

/// How long a woken waiter whose attempts take `took` and that lost
/// `lost` wake-ups (this one counted) waits before it tries: none from
/// `front` on (see [`FRONT`]), half an attempt's time more for each one
/// fewer, but never more than an attempt's time over `lost` (so a count of
/// waiters inflated by idle subscribers, or left from a busier time, costs
/// no more than the order by wake-ups lost alone); less up to a quarter at
/// random (`rng`).
fn woken_spacing(took: Duration, (lost, front): (u32, u32), rng: u64) -> Duration {
    let ranked = (took / 2).saturating_mul(front.saturating_sub(lost));
    let ahead = ranked.min(took / lost.max(1));
    ahead.saturating_sub(quorum::retry_delay(ahead / 8, ahead / 8, rng))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::{woken_spacing, FRONT};

    /// Woken together, who lost as many wake-ups as other clients wait
    /// tries at once (it waited an attempt's time over its wake-ups lost: a
    /// third of every hand-over between processes), the others later, in
    /// order of what they lost. (One front for every count of waiters let
    /// eight processes' waiters try together and split the votes; a front
    /// taken from fake subscribers slowed every hand-over.)
    #[test]
    fn the_waiter_that_lost_the_most_wake_ups_tries_at_once() {
        let took = Duration::from_micros(300);
        for rng in [0, 1 << 20, u64::MAX / 3, u64::MAX] {
            for front in [1, FRONT, 7] {
                assert_eq!(woken_spacing(took, (front, front), rng), Duration::ZERO);
                assert_eq!(woken_spacing(took, (front + 5, front), rng), Duration::ZERO);
            }
            // Seven other clients wait: every rank is apart.
            let ranks: Vec<Duration> = (1..=7).map(|l| woken_spacing(took, (l, 7), rng)).collect();
            assert!(ranks.windows(2).all(|w| w[0] > w[1]), "{ranks:?}");
            // Idle subscribers counted as waiters (or a count left from a
            // busier time) cost no more than an attempt's time over the
            // wake-ups lost.
            for lost in 1..16 {
                assert!(woken_spacing(took, (lost, 16), rng) <= took / lost);
            }
            let two = woken_spacing(took, (FRONT - 1, FRONT), rng);
            let one = woken_spacing(took, (FRONT - 2, FRONT), rng);
            assert!(two > Duration::ZERO && one > two, "{one:?} {two:?}");
            assert!(one <= took, "{one:?}");
        }
    }
}
