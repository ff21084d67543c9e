//! Per-node health, free of I/O: one state machine per node with one door.
//!
//! Its only input is an [`Outcome`]: what the node itself did with a command
//! sent to it (answered, refused the connection, or let it time out). Waiting
//! for a pooled connection, the caller's deadline, the caller's input and a
//! successful connect are not outcomes and never change a node's health. A
//! simulated cluster can drive this machine unchanged.

use std::time::{Duration, Instant};

use crate::clock::after;

/// How often a failing node is sent a command anyway (not waited for), so
/// that it rejoins within about this long once it answers again.
pub(crate) const TRIAL_EVERY: Duration = Duration::from_millis(100);

/// What a node did with one command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// It replied (any reply, including an error reply from the server).
    Answered,
    /// It refused or reset the connection, or the connect timed out.
    Refused,
    /// A command sent to it got no reply within the node timeout.
    TimedOut,
}

/// How a round treats a node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Admit {
    /// Send and wait for the reply while it can still change the outcome.
    Wait,
    /// Failing: send if a connection is at hand, take a reply that arrives
    /// in time, but do not wait for it.
    Trial,
    /// Failing, and tried recently: counted as a failed vote at no cost.
    Skip,
}

/// A node's health.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum NodeHealth {
    /// Answering: rounds wait for it.
    #[default]
    Healthy,
    /// Its last command was refused or timed out.
    Failing {
        /// When the failures began.
        since: Instant,
        /// The next round at or after this instant sends it a trial command.
        next_trial: Instant,
        /// What the last failure was.
        last: Outcome,
    },
}

impl NodeHealth {
    /// The one input. Returns true when the node's state flips (for logs).
    pub(crate) fn observe(&mut self, now: Instant, outcome: Outcome) -> bool {
        match self {
            _ if outcome == Outcome::Answered => {
                let flips = !self.is_healthy();
                *self = NodeHealth::Healthy;
                flips
            }
            NodeHealth::Healthy => {
                *self = NodeHealth::Failing {
                    since: now,
                    next_trial: after(now, TRIAL_EVERY),
                    last: outcome,
                };
                true
            }
            NodeHealth::Failing { last, .. } => {
                *last = outcome;
                false
            }
        }
    }

    /// How the round starting `now` treats this node. At most one trial per
    /// [`TRIAL_EVERY`] is handed out.
    pub(crate) fn admit(&mut self, now: Instant) -> Admit {
        match self {
            NodeHealth::Healthy => Admit::Wait,
            NodeHealth::Failing { next_trial, .. } if now >= *next_trial => {
                *next_trial = after(now, TRIAL_EVERY);
                Admit::Trial
            }
            NodeHealth::Failing { .. } => Admit::Skip,
        }
    }

    pub(crate) fn is_healthy(&self) -> bool {
        matches!(self, NodeHealth::Healthy)
    }
}

/// A round's admissions, from each node's own: a delete is always safe to
/// send, so it skips nobody (failing nodes get a trial); any other round
/// skips failing nodes only while the ones it waits for can still make a
/// quorum ([`upgrade_if_short`]). `twins[i]`: entry `i` is known to reach
/// the same server as an earlier entry (empty: none), so its vote cannot
/// add to a quorum.
pub(crate) fn admit_round(admits: &mut [Admit], release: bool, quorum: usize, twins: &[bool]) {
    if release {
        admits.iter_mut().for_each(|a| {
            if *a == Admit::Skip {
                *a = Admit::Trial
            }
        });
    } else {
        upgrade_if_short(admits, quorum, twins);
    }
}

/// Rule 4 of the node layer: nodes are skipped only while the servers a
/// round waits for can still make a quorum; otherwise every node is waited
/// for. A twin (see [`admit_round`]) is no server of its own.
pub(crate) fn upgrade_if_short(admits: &mut [Admit], quorum: usize, twins: &[bool]) {
    let waited = admits
        .iter()
        .enumerate()
        .filter(|&(i, a)| *a == Admit::Wait && !twins.get(i).copied().unwrap_or(false))
        .count();
    if waited < quorum {
        admits.iter_mut().for_each(|a| *a = Admit::Wait);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn only_outcomes_move_the_state() {
        let t0 = Instant::now();
        let mut h = NodeHealth::default();
        assert_eq!(h.admit(t0), Admit::Wait);
        assert!(!h.observe(t0, Outcome::Answered));
        assert!(h.observe(t0, Outcome::TimedOut));
        assert!(!h.is_healthy());
        // Failing: skipped until a trial is due, then one trial per period.
        assert_eq!(h.admit(t0 + MS), Admit::Skip);
        assert_eq!(h.admit(t0 + TRIAL_EVERY), Admit::Trial);
        assert_eq!(h.admit(t0 + TRIAL_EVERY), Admit::Skip);
        assert_eq!(h.admit(t0 + 2 * TRIAL_EVERY), Admit::Trial);
        // Further failures keep it failing without moving the trial clock.
        assert!(!h.observe(t0 + 2 * TRIAL_EVERY, Outcome::Refused));
        assert_eq!(h.admit(t0 + 2 * TRIAL_EVERY + MS), Admit::Skip);
        // An answer brings it straight back.
        assert!(h.observe(t0 + 3 * TRIAL_EVERY, Outcome::Answered));
        assert_eq!(h.admit(t0 + 3 * TRIAL_EVERY), Admit::Wait);
    }

    #[test]
    fn failing_since_is_kept_across_failures() {
        let t0 = Instant::now();
        let mut h = NodeHealth::default();
        h.observe(t0, Outcome::Refused);
        h.observe(t0 + 10 * MS, Outcome::TimedOut);
        match h {
            NodeHealth::Failing { since, last, .. } => {
                assert_eq!(since, t0);
                assert_eq!(last, Outcome::TimedOut);
            }
            NodeHealth::Healthy => panic!("should be failing"),
        }
    }

    #[test]
    fn skipping_never_costs_the_quorum() {
        use Admit::*;
        let mut a = [Wait, Wait, Skip, Trial, Wait];
        upgrade_if_short(&mut a, 3, &[]);
        assert_eq!(a, [Wait, Wait, Skip, Trial, Wait], "3 waited: enough");
        let mut a = [Wait, Skip, Trial, Skip, Wait];
        upgrade_if_short(&mut a, 3, &[]);
        assert_eq!(a, [Wait; 5], "2 waited of 3 needed: ask everyone");
        // Entries 0 and 1 are one server: two waited entries, one server.
        let mut a = [Wait, Wait, Skip];
        upgrade_if_short(&mut a, 2, &[false, true, false]);
        assert_eq!(a, [Wait; 3], "one server cannot make a quorum alone");
    }
}
