//! [`Settings`]: the timing, retry and voting settings the engine runs with,
//! validated once when the client is built.

use std::time::Duration;

use crate::error::InvalidInput;

/// The timing and retry settings the algorithm uses, validated.
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    pub node_timeout: Duration,
    pub drift_factor: f64,
    pub retry_count: u32,
    pub retry_delay: Duration,
    pub retry_jitter: Duration,
    pub auto_renew: bool,
    pub renew_fraction: f64,
    pub local_queue: bool,
    pub wake_ups: bool,
    /// Apply the delayed-restart rule to acquire votes.
    pub restart_protection: bool,
    /// The simulation's broken variant of the rule (see
    /// [`crate::algorithm::restart::RestartRule::loose`]). Test builds only.
    #[cfg(test)]
    pub loose_restart_rule: bool,
    /// Trust a node's lock history the first time this client sees it.
    pub fresh_cluster: bool,
    /// The operator's longest TTL, if configured.
    pub max_ttl: Option<Duration>,
    /// Give every lock a fencing token (one more round trip per acquire).
    pub fencing: bool,
    /// The user's event handler.
    pub events: crate::events::Events,
    /// Count the votes of nodes whose memory policy can evict lock keys.
    pub allow_evicting: bool,
    /// Count one vote per server (off only in tests, to show what the
    /// rule prevents).
    #[cfg(test)]
    pub one_vote_per_server: bool,
}

/// Largest pool size accepted (connections per node): far above any useful
/// number of threads locking at once.
pub(crate) const MAX_POOL_SIZE: u32 = 1024;

/// Largest retry pause (and jitter) accepted: `lock()` makes several.
pub(crate) const MAX_RETRY_DELAY: Duration = Duration::from_secs(60);

/// Largest node timeout accepted: a round waits at most this long.
pub(crate) const MAX_NODE_TIMEOUT: Duration = Duration::from_secs(60);

impl Default for Settings {
    fn default() -> Self {
        Settings {
            node_timeout: Duration::from_millis(50),
            drift_factor: 0.01,
            retry_count: 3,
            retry_delay: Duration::from_millis(100),
            retry_jitter: Duration::from_millis(100),
            auto_renew: false,
            renew_fraction: 1.0 / 3.0,
            local_queue: true,
            wake_ups: true,
            restart_protection: true,
            #[cfg(test)]
            loose_restart_rule: false,
            fresh_cluster: false,
            max_ttl: None,
            fencing: false,
            events: crate::events::Events::default(),
            allow_evicting: false,
            #[cfg(test)]
            one_vote_per_server: true,
        }
    }
}

impl Settings {
    /// Which answers count as votes.
    pub(crate) fn rules(&self) -> crate::algorithm::quorum::VoteRules {
        crate::algorithm::quorum::VoteRules {
            #[cfg(test)]
            one_per_server: self.one_vote_per_server,
            allow_evicting: self.allow_evicting,
        }
    }

    pub(crate) fn validate(&self) -> Result<(), InvalidInput> {
        if self.node_timeout.is_zero() {
            return Err(InvalidInput::ZeroDuration("node_timeout"));
        }
        if self.node_timeout > MAX_NODE_TIMEOUT {
            return Err(InvalidInput::DurationTooLong {
                what: "node_timeout",
                value: self.node_timeout,
                max: MAX_NODE_TIMEOUT,
            });
        }
        if let Some(max) = self.max_ttl {
            if max.is_zero() {
                return Err(InvalidInput::ZeroDuration("max_ttl"));
            }
            if max > crate::MAX_TTL {
                return Err(InvalidInput::DurationTooLong {
                    what: "max_ttl",
                    value: max,
                    max: crate::MAX_TTL,
                });
            }
        }
        if !(self.drift_factor.is_finite() && (0.0..1.0).contains(&self.drift_factor)) {
            return Err(InvalidInput::DriftFactor(self.drift_factor));
        }
        // At most 1/2: a renewal due at ttl × fraction must leave room, inside
        // the validity (ttl less the drift allowance and the round), for it
        // to fail and be retried at least once.
        if !(self.renew_fraction.is_finite()
            && self.renew_fraction > 0.0
            && self.renew_fraction <= 0.5)
        {
            return Err(InvalidInput::RenewFraction(self.renew_fraction));
        }
        for (what, value) in [
            ("retry_delay", self.retry_delay),
            ("retry_jitter", self.retry_jitter),
        ] {
            if value > MAX_RETRY_DELAY {
                return Err(InvalidInput::DurationTooLong {
                    what,
                    value,
                    max: MAX_RETRY_DELAY,
                });
            }
        }
        if self.retry_count == 0 {
            return Err(InvalidInput::ZeroCount("retry_count"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_that_cannot_work_are_refused() {
        let base = Settings::default;
        // Renewed after its deadline: a healthy lock would be lost.
        for f in [0.995, 0.51, 1.0, 0.0, f64::NAN] {
            let s = Settings {
                renew_fraction: f,
                ..base()
            };
            assert!(
                matches!(s.validate(), Err(InvalidInput::RenewFraction(_))),
                "{f}"
            );
        }
        assert!(Settings {
            renew_fraction: 0.5,
            ..base()
        }
        .validate()
        .is_ok());
        // lock() would block for ever.
        for (what, s) in [
            (
                "retry_delay",
                Settings {
                    retry_delay: Duration::MAX,
                    ..base()
                },
            ),
            (
                "retry_jitter",
                Settings {
                    retry_jitter: Duration::MAX,
                    ..base()
                },
            ),
        ] {
            match s.validate() {
                Err(InvalidInput::DurationTooLong { what: w, .. }) => assert_eq!(w, what),
                other => panic!("{what}: {other:?}"),
            }
        }
    }
}
