//! What the engine tells the event handler and the log about attempts,
//! releases, losses and failing nodes.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use log::{debug, trace, warn};

use crate::algorithm::restart::{self, RestartRule};
use crate::algorithm::round::{candidate_of, NodeResult};
use crate::clock::WARN_EVERY;
use crate::error::Error;
use crate::events::{
    AcquireEvent, AttemptEvent, Begun, LeadershipChange, LeadershipEvent, LostEvent, NodeChange,
    NodeEvent, Nodes, ReleaseEvent,
};
use crate::lock::state::LockState;
use crate::Result;

use super::Engine;

impl Engine {
    /// Tells the event handler a lock's critical section ended.
    pub(crate) fn release_event(
        &self,
        state: &LockState,
        outcome: &Result<()>,
        results: &[NodeResult],
    ) {
        if let Some(h) = self.settings.events.get() {
            h.on_release(&ReleaseEvent {
                resource: &state.resource,
                section: state.section,
                held: self.clock.now().saturating_duration_since(state.acquired),
                outcome: outcome.as_ref().map(|_| ()),
                nodes: Nodes::new(self.transport.node_names(), results, 0),
            });
        }
        // A leader's end: lost where its lease had run out or was gone
        // (unless its loss was told already), else resigned. (Nothing to
        // do, nor the clock read, for a lock's release or without a handler.)
        if self.settings.events.get().is_none() || !state.token.contains('@') {
            return;
        }
        match outcome {
            _ if state.is_lost() => {}
            Err(e @ (Error::Expired | Error::NotOwner { .. })) => {
                self.leadership_event(state, LeadershipChange::Lost, Some(e));
            }
            _ if self.clock.now() >= state.deadline() => {
                self.leadership_event(state, LeadershipChange::Lost, Some(&Error::Expired))
            }
            _ => self.leadership_event(state, LeadershipChange::Resigned, None),
        }
    }

    /// Tells the event handler a lock was lost.
    pub(crate) fn lost_event(&self, state: &LockState, error: &Error) {
        if let Some(h) = self.settings.events.get() {
            h.on_lost(&LostEvent {
                resource: &state.resource,
                section: state.section,
                error,
                held: self.clock.now().saturating_duration_since(state.acquired),
            });
        }
        self.leadership_event(state, LeadershipChange::Lost, Some(error));
    }

    /// Tells the event handler what happened to a leader's lease, where
    /// `state` is one (its token names a candidate: see `crate::election`).
    pub(crate) fn leadership_event(
        &self,
        state: &LockState,
        change: LeadershipChange,
        error: Option<&Error>,
    ) {
        let Some(h) = self.settings.events.get() else {
            return;
        };
        if let Some(id) = candidate_of(&state.token) {
            h.on_leadership(&LeadershipEvent {
                name: &state.resource,
                id: &id,
                term: state.fence.unwrap_or(0),
                change,
                error,
            });
        }
    }

    /// Tells the event handler an attempt at `resource`'s critical section
    /// `section`, begun at `start`, ended: the lock, valid until the given
    /// deadline, or why not; `nodes`: what each node answered (none for a
    /// hand-over that sent nothing).
    pub(super) fn attempt_event(
        &self,
        (resource, section): (&str, u64),
        start: Instant,
        outcome: Result<Instant, &Error>,
        nodes: &[NodeResult],
        begun: Begun,
    ) {
        if let Some(h) = self.settings.events.get() {
            let now = self.clock.now();
            h.on_attempt(&AttemptEvent {
                resource,
                section,
                elapsed: now.saturating_duration_since(start),
                outcome: outcome.map(|d| d.saturating_duration_since(now)),
                nodes: Nodes::new(self.transport.node_names(), nodes, 0),
                begun,
            });
        }
    }

    /// Tells the event handler a call for `resource`, made at `called`,
    /// returned after `attempts` attempts at the nodes.
    pub(super) fn acquire_event(
        &self,
        resource: &str,
        called: Instant,
        attempts: u32,
        outcome: Result<(), &Error>,
    ) {
        if let Some(h) = self.settings.events.get() {
            h.on_acquire(&AcquireEvent {
                resource,
                waited: self.clock.now().saturating_duration_since(called),
                attempts,
                outcome,
            });
        }
    }

    /// Tells the event handler which nodes the delayed-restart rule started
    /// or stopped holding back in an acquire round (`judged`: its results
    /// after the rule).
    pub(super) fn held_back_events(
        &self,
        (judged, results, rule): (&[NodeResult], &[NodeResult], &RestartRule),
    ) {
        let Some(h) = self.settings.events.get() else {
            return;
        };
        let rule = rule.heard(results);
        let names = self.transport.node_names();
        for (i, r) in judged.iter().enumerate() {
            let Some(flag) = self.nodes.get(i).map(|n| &n.held_back) else {
                continue;
            };
            // How long the restart rule holds the node's vote back.
            let facts = results.get(i).and_then(|r| r.as_ref().ok()?.facts);
            let left = facts.map_or(Duration::ZERO, |f| {
                rule.hold(&f, restart::facts_of(results.iter()), self.trusted(i, &f))
            });
            let change = match r {
                Err(e) if e.kind() == crate::NodeErrorKind::Restarted && !left.is_zero() => (!flag
                    .swap(true, Ordering::Relaxed))
                .then_some(NodeChange::HeldBack { votes_in: left }),
                Ok(_) => flag
                    .swap(false, Ordering::Relaxed)
                    .then_some(NodeChange::HoldOver),
                Err(_) => None,
            };
            if let (Some(change), Some(node)) = (change, names.get(i)) {
                h.on_node(&NodeEvent { node, change });
            }
        }
    }

    /// Logs node failures: at most one warn per node per [`WARN_EVERY`],
    /// the rest at debug.
    pub(super) fn note_failures(&self, results: &[NodeResult]) {
        let now = self.clock.now();
        for (i, r) in results.iter().enumerate() {
            if let Err(e) = r {
                if e.kind() == crate::NodeErrorKind::NotAwaited {
                    trace!("{e}");
                } else if self
                    .nodes
                    .get(i)
                    .is_some_and(|n| n.warned.ready(now, WARN_EVERY))
                {
                    warn!("{e} (further failures of this node logged at debug for {WARN_EVERY:?})");
                } else {
                    debug!("{e}");
                }
            }
        }
    }
}
