//! Per-node health, free of I/O: a circuit breaker that skips a failing
//! node, and the delayed-restart rule that keeps a freshly restarted node's
//! votes out until the longest TTL has passed.
//!
//! The Redis driver feeds these from what it observes; a simulated cluster
//! can reuse them unchanged.

use std::time::{Duration, Instant};

use crate::clock::after;

/// First skip window after a failure.
pub(crate) const BREAKER_BASE: Duration = Duration::from_millis(200);
/// Longest skip window: a node down for long is still probed this often.
pub(crate) const BREAKER_MAX: Duration = Duration::from_secs(5);
/// Rounds in a row a node may answer only after the outcome was decided
/// before it counts as a failure.
pub(crate) const LATE_LIMIT: u32 = 5;

/// What to do with a node in the next round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Admit {
    /// Send it the command.
    Send,
    /// Skip it: count a failed vote at no cost. `until` is the end of the
    /// current window (informational).
    Skip { until: Instant },
    /// Skip it, and start one background probe now.
    Probe,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Closed { late: u32 },
    Open { until: Instant, backoff: Duration },
    Probing { backoff: Duration },
}

/// Closed → (failure) → Open for a backoff window → one probe → Closed on
/// success, Open with a doubled window (bounded) on failure.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Breaker {
    state: State,
}

impl Default for Breaker {
    fn default() -> Self {
        Breaker {
            state: State::Closed { late: 0 },
        }
    }
}

impl Breaker {
    pub(crate) fn admit(&mut self, now: Instant) -> Admit {
        match self.state {
            State::Closed { .. } => Admit::Send,
            State::Open { until, backoff } if now >= until => {
                self.state = State::Probing { backoff };
                Admit::Probe
            }
            State::Open { until, .. } => Admit::Skip { until },
            State::Probing { backoff } => Admit::Skip {
                until: after(now, backoff),
            },
        }
    }

    /// The node answered. Returns true when this closes an open breaker.
    pub(crate) fn success(&mut self) -> bool {
        let was_open = !matches!(self.state, State::Closed { .. });
        self.state = State::Closed { late: 0 };
        was_open
    }

    /// The node timed out, refused or broke the connection. Returns the
    /// skip window it now gets.
    pub(crate) fn failure(&mut self, now: Instant) -> Duration {
        let backoff = match self.state {
            State::Closed { .. } => BREAKER_BASE,
            State::Open { backoff, .. } | State::Probing { backoff } => {
                backoff.saturating_mul(2).min(BREAKER_MAX)
            }
        };
        self.state = State::Open {
            until: after(now, backoff),
            backoff,
        };
        backoff
    }

    /// The round was decided without this node's reply, and it had not
    /// answered shortly after. Repeatedly late counts as a failure.
    pub(crate) fn late(&mut self, now: Instant) -> Option<Duration> {
        match self.state {
            State::Closed { late } if late + 1 >= LATE_LIMIT => Some(self.failure(now)),
            State::Closed { late } => {
                self.state = State::Closed { late: late + 1 };
                None
            }
            _ => None,
        }
    }

    pub(crate) fn is_closed(&self) -> bool {
        matches!(self.state, State::Closed { .. })
    }
}

/// Resolution of Redis's `uptime_in_seconds`.
const UPTIME_GRAIN: Duration = Duration::from_secs(1);

/// The delayed-restart rule.
///
/// A node that restarts without persistence has forgotten the locks it held.
/// If its vote counted at once, a second client could win a majority made of
/// the restarted node plus nodes the first owner never had. Holding its votes
/// back until it has been up for the longest TTL in use guarantees every lock
/// it forgot has expired everywhere else too.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct RestartWatch {
    run_id: Option<String>,
    hold_until: Option<Instant>,
}

impl RestartWatch {
    /// Records what a new connection read from `INFO server`. `configured`
    /// is the operator's maximum TTL, `tracked` the longest TTL this client
    /// used so far. Returns the hold's end when this observation starts one.
    ///
    /// - A changed `run_id` is a restart: hold until `start + max(configured, tracked)`.
    /// - At first contact nothing is known of earlier locks except what the
    ///   operator configured: hold until `start + configured` when set.
    pub(crate) fn observe(
        &mut self,
        run_id: &str,
        uptime: Duration,
        now: Instant,
        configured: Option<Duration>,
        tracked: Duration,
    ) -> Option<Instant> {
        // Redis counts uptime as whole seconds of wall time since the start
        // second, so it can read up to 1 s more than has passed: the start
        // is taken 1 s later than `now - uptime` to never end a hold early.
        let started = now
            .checked_sub(uptime)
            .map_or(now, |s| after(s, UPTIME_GRAIN).min(now));
        let window = match &self.run_id {
            Some(prev) if prev == run_id => None,
            Some(_) => Some(configured.unwrap_or_default().max(tracked)),
            None => configured,
        };
        self.run_id = Some(run_id.to_owned());
        let until = after(started, window?);
        if until > now && self.hold_until.is_none_or(|h| h < until) {
            self.hold_until = Some(until);
            return Some(until);
        }
        None
    }

    /// Until when this node's votes must not count, if they must not now.
    pub(crate) fn held(&self, now: Instant) -> Option<Instant> {
        self.hold_until.filter(|&h| h > now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn breaker_opens_probes_and_closes() {
        let t0 = Instant::now();
        let mut b = Breaker::default();
        assert_eq!(b.admit(t0), Admit::Send);
        assert_eq!(b.failure(t0), BREAKER_BASE);
        assert!(matches!(b.admit(t0 + MS), Admit::Skip { .. }));
        // Window over: exactly one probe, then skips while it runs.
        assert_eq!(b.admit(t0 + BREAKER_BASE), Admit::Probe);
        assert!(matches!(b.admit(t0 + BREAKER_BASE), Admit::Skip { .. }));
        assert!(b.success(), "probe success closes");
        assert_eq!(b.admit(t0 + BREAKER_BASE), Admit::Send);
        assert!(!b.success(), "already closed");
    }

    #[test]
    fn breaker_backoff_doubles_up_to_the_bound() {
        let t0 = Instant::now();
        let mut b = Breaker::default();
        let mut windows = vec![b.failure(t0)];
        for _ in 0..10 {
            assert_eq!(b.admit(t0 + BREAKER_MAX * 20), Admit::Probe);
            windows.push(b.failure(t0));
        }
        assert_eq!(windows[..4], [200 * MS, 400 * MS, 800 * MS, 1600 * MS]);
        assert_eq!(*windows.last().unwrap(), BREAKER_MAX);
        // A success resets the window.
        b.success();
        assert_eq!(b.failure(t0), BREAKER_BASE);
    }

    #[test]
    fn repeatedly_late_nodes_are_opened() {
        let t0 = Instant::now();
        let mut b = Breaker::default();
        for _ in 1..LATE_LIMIT {
            assert_eq!(b.late(t0), None);
        }
        assert_eq!(b.late(t0), Some(BREAKER_BASE));
        assert!(!b.is_closed());
        // An answer in between resets the count.
        let mut b = Breaker::default();
        b.late(t0);
        b.late(t0);
        b.success();
        assert_eq!(b.late(t0), None);
    }

    #[test]
    fn restart_detected_by_run_id_holds_votes_for_the_longest_ttl() {
        let now = Instant::now();
        let mut w = RestartWatch::default();
        // First contact, nothing configured: no hold even if young.
        assert_eq!(w.observe("a", 2 * MS, now, None, 10_000 * MS), None);
        assert_eq!(w.held(now), None);
        // Same run id: nothing new.
        assert_eq!(w.observe("a", 5000 * MS, now, None, 10_000 * MS), None);
        // New run id, up 1 s, longest TTL 10 s: held until 9 s from now.
        let until = w.observe("b", 1000 * MS, now, None, 10_000 * MS).unwrap();
        // Started at most 1 s ago by INFO's count, which may be 1 s high.
        assert_eq!(until, now + 10_000 * MS);
        assert_eq!(w.held(now), Some(until));
        assert_eq!(w.held(until), None, "votes count again after the window");
        // A restart long ago needs no hold.
        assert_eq!(w.observe("c", 60_000 * MS, now, None, 10_000 * MS), None);
    }

    #[test]
    fn configured_max_ttl_also_holds_young_nodes_at_first_contact() {
        let now = Instant::now();
        let mut w = RestartWatch::default();
        let until = w.observe("a", 500 * MS, now, Some(3000 * MS), Duration::ZERO);
        assert_eq!(until, Some(now + 3000 * MS));
        let mut old = RestartWatch::default();
        assert_eq!(
            old.observe("a", 5000 * MS, now, Some(3000 * MS), Duration::ZERO),
            None
        );
    }
}
