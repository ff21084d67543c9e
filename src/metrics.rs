//! Metrics through the [`metrics`] facade (feature `metrics`):
//! [`Metrics`], an [`EventHandler`] that records what callers wait, how
//! long they hold, how often they contend and lose, and what each node
//! fails with.
//!
//! The library only records; the application installs a recorder (an
//! exporter: Prometheus, StatsD, …) with the `metrics` ecosystem's crates.
//! Without one, recording does nothing.
//!
//! | name | kind | unit | labels | what |
//! |---|---|---|---|---|
//! | `quorumlock_acquire_wait_seconds` | histogram | seconds | `outcome`, `resource`¹ | a call's whole wait, from the call to its return ([`AcquireEvent::waited`]) |
//! | `quorumlock_acquire_attempts` | histogram | count | `outcome`, `resource`¹ | attempts at the nodes per call ([`AcquireEvent::attempts`]) |
//! | `quorumlock_attempts_total` | counter | count | `outcome`, `resource`¹ | attempts, hand-overs between threads of this process included; `outcome="taken"`: another owner held the lock (contention) |
//! | `quorumlock_hold_seconds` | histogram | seconds | `outcome`, `resource`¹ | from a critical section's acquisition to its release ([`ReleaseEvent::held`]) |
//! | `quorumlock_losses_total` | counter | count | `outcome`, `resource`¹ | held locks found lost ([`LostEvent`]) |
//! | `quorumlock_renewals_total` | counter | count | `outcome`, `resource`¹ | extensions: the renewal thread's and [`LockGuard::extend`](crate::LockGuard::extend)'s |
//! | `quorumlock_renewal_margin_seconds` | histogram | seconds | `resource`¹ | the renewal thread's renewals: validity left when each began ([`RenewalEvent::left`]); a renewal thread that falls behind shows as this shrinking toward zero |
//! | `quorumlock_node_errors_total` | counter | count | `node`, `kind` | a node's failures in attempts, renewals and releases, by kind |
//!
//! Labels:
//! - `outcome`: `acquired` (or `released`, `renewed`), else the error's
//!   kind: `taken`, `no_quorum`, `validity_exhausted`, `expired`,
//!   `not_owner`, `invalid_input`, `stopped`, `scripts_refused`.
//! - `resource`¹: only where a pattern is set
//!   ([`Metrics::resource_prefixes`], [`Metrics::resource_label`]); absent
//!   by default. Never the resource itself: each distinct value is a series
//!   of its own, and resource names are unbounded.
//! - `node`: the node's `host:port` as the client names it, without
//!   credentials (as in [`Nodes::iter`](crate::Nodes::iter)).
//! - `kind`: `timeout`, `unavailable`, `io`, `server`, `protocol`,
//!   `skipped`, `restarted`, `no_connection`, `tls`, `same_server`,
//!   `unsuitable`, `auth`, `scripts_refused` (see [`NodeErrorKind`];
//!   replies not awaited are no
//!   errors and are not counted).
//!
//! A client has one handler ([`Builder::events`](crate::Builder::events)):
//! to keep hooks of your own, hand them to [`Metrics::forward_to`], which
//! passes every event on after recording it.

use std::sync::Arc;

use ::metrics::{
    counter, describe_counter, describe_histogram, histogram, Label, SharedString, Unit,
};

use crate::error::{Error, NodeErrorKind};
use crate::events::{
    AcquireEvent, AttemptEvent, EventHandler, LeadershipEvent, LostEvent, NodeEvent, NodeOutcome,
    Nodes, ReleaseEvent, RenewalEvent,
};

/// `quorumlock_acquire_wait_seconds`: a call's whole wait.
pub const ACQUIRE_WAIT: &str = "quorumlock_acquire_wait_seconds";
/// `quorumlock_acquire_attempts`: attempts at the nodes per call.
pub const ACQUIRE_ATTEMPTS: &str = "quorumlock_acquire_attempts";
/// `quorumlock_attempts_total`: attempts by outcome.
pub const ATTEMPTS: &str = "quorumlock_attempts_total";
/// `quorumlock_hold_seconds`: how long critical sections lasted.
pub const HOLD: &str = "quorumlock_hold_seconds";
/// `quorumlock_losses_total`: held locks found lost.
pub const LOSSES: &str = "quorumlock_losses_total";
/// `quorumlock_renewals_total`: extensions by outcome.
pub const RENEWALS: &str = "quorumlock_renewals_total";
/// `quorumlock_renewal_margin_seconds`: validity left when a renewal began.
pub const RENEWAL_MARGIN: &str = "quorumlock_renewal_margin_seconds";
/// `quorumlock_node_errors_total`: node failures by node and kind.
pub const NODE_ERRORS: &str = "quorumlock_node_errors_total";

/// The label value of a resource that matches no pattern.
const OTHER: &str = "other";

/// Maps a resource name to its `resource` label.
type Pattern = dyn Fn(&str) -> SharedString + Send + Sync;

/// An [`EventHandler`] that records through the [`metrics`]
/// facade (see [the module](self) for the names, units and labels).
///
/// ```no_run
/// use std::sync::Arc;
/// use quorumlock::metrics::Metrics;
///
/// // First the application's recorder (an exporter), then:
/// let locks = quorumlock::Redlock::builder()
///     .nodes(["redis://10.0.0.1:6379", "redis://10.0.0.2:6379", "redis://10.0.0.3:6379"])
///     .events(Arc::new(Metrics::new().resource_prefixes(["orders:", "stock:"])))
///     .build()?;
/// # drop(locks);
/// # Ok::<(), quorumlock::Error>(())
/// ```
pub struct Metrics {
    resource: Option<Box<Pattern>>,
    inner: Option<Arc<dyn EventHandler>>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics")
            .field("resource_label", &self.resource.is_some())
            .field("forwards", &self.inner.is_some())
            .finish()
    }
}

impl Metrics {
    /// Records with no `resource` label and forwards to nothing. Describes
    /// the metrics (see [`describe`](Self::describe)) to the recorder
    /// installed now.
    pub fn new() -> Self {
        Metrics::describe();
        Metrics {
            resource: None,
            inner: None,
        }
    }

    /// Describes every metric (its unit and what it counts) to the recorder
    /// installed now: [`new`](Self::new) does, and an application that
    /// installs its recorder later calls this once after.
    pub fn describe() {
        for (name, unit, what) in [
            (
                ACQUIRE_WAIT,
                Unit::Seconds,
                "A lock call's whole wait, from the call to its return, by outcome.",
            ),
            (
                ACQUIRE_ATTEMPTS,
                Unit::Count,
                "Attempts at the nodes per lock call, by outcome.",
            ),
            (
                HOLD,
                Unit::Seconds,
                "Critical sections' length, from acquisition to release.",
            ),
            (
                RENEWAL_MARGIN,
                Unit::Seconds,
                "Validity a lock had left when its automatic renewal began.",
            ),
        ] {
            describe_histogram!(name, unit, what);
        }
        describe_counter!(
            ATTEMPTS,
            Unit::Count,
            "Lock attempts by outcome; outcome=taken: another owner held the lock."
        );
        describe_counter!(LOSSES, Unit::Count, "Held locks found lost, by how.");
        describe_counter!(RENEWALS, Unit::Count, "Lock extensions, by outcome.");
        describe_counter!(
            NODE_ERRORS,
            Unit::Count,
            "Node failures in lock rounds, by node and kind."
        );
    }

    /// Labels each metric of a lock with `resource`: the longest of
    /// `prefixes` its resource starts with, or `other`. Replaces any
    /// earlier pattern. Defaults to none: no `resource` label.
    ///
    /// ```
    /// let m = quorumlock::metrics::Metrics::new().resource_prefixes(["orders:", "stock:"]);
    /// # drop(m);
    /// ```
    pub fn resource_prefixes<I, S>(self, prefixes: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let mut prefixes: Vec<SharedString> = prefixes
            .into_iter()
            .map(|p| SharedString::from(p.into()))
            .collect();
        // Longest first: the first match is the longest.
        prefixes.sort_by_key(|p| std::cmp::Reverse(p.len()));
        self.resource_label(move |r: &str| prefixes.iter().find(|p| r.starts_with(&***p)).cloned())
    }

    /// Labels each metric of a lock with `resource`: what `pattern` maps
    /// its resource to, or `other` where it gives `None`. Replaces any
    /// earlier pattern. Defaults to none: no `resource` label.
    ///
    /// Keep the values few: each is a series of its own in every metric
    /// (give a kind of resource, never a resource itself).
    ///
    /// ```
    /// // "tenant-7:invoice:2231" → "invoice"
    /// let m = quorumlock::metrics::Metrics::new()
    ///     .resource_label(|r: &str| r.split(':').nth(1).map(str::to_owned));
    /// # drop(m);
    /// ```
    pub fn resource_label<F, L>(mut self, pattern: F) -> Self
    where
        F: Fn(&str) -> Option<L> + Send + Sync + 'static,
        L: Into<SharedString>,
    {
        self.resource = Some(Box::new(move |r: &str| {
            pattern(r).map_or(SharedString::const_str(OTHER), Into::into)
        }));
        self
    }

    /// Passes every event on to `handler` after recording it: a client has
    /// one handler, and this keeps hooks of your own beside the metrics.
    /// Replaces any earlier one. Defaults to none.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use quorumlock::{EventHandler, LostEvent};
    ///
    /// struct Alert;
    /// impl EventHandler for Alert {
    ///     fn on_lost(&self, e: &LostEvent<'_>) {
    ///         eprintln!("lost {}: {}", e.resource(), e.error());
    ///     }
    /// }
    ///
    /// let handler = quorumlock::metrics::Metrics::new().forward_to(Arc::new(Alert));
    /// let builder = quorumlock::Redlock::builder().events(Arc::new(handler));
    /// # drop(builder);
    /// ```
    pub fn forward_to(mut self, handler: Arc<dyn EventHandler>) -> Self {
        self.inner = Some(handler);
        self
    }

    /// The labels of a lock's metric: `outcome` where given, and `resource`
    /// where a pattern is set.
    fn labels(&self, outcome: Option<&'static str>, resource: &str) -> Vec<Label> {
        let mut labels = Vec::with_capacity(2);
        if let Some(o) = outcome {
            labels.push(Label::from_static_parts("outcome", o));
        }
        if let Some(pattern) = &self.resource {
            labels.push(Label::new("resource", pattern(resource)));
        }
        labels
    }

    /// Counts the nodes' failures of one round.
    fn node_errors(&self, nodes: Nodes<'_>) {
        for (node, outcome) in nodes.iter() {
            if let NodeOutcome::Failed(kind) = outcome {
                if let Some(kind) = kind_label(kind) {
                    let labels = [
                        Label::new("node", node.to_owned()),
                        Label::from_static_parts("kind", kind),
                    ];
                    counter!(NODE_ERRORS, labels.iter()).increment(1);
                }
            }
        }
    }
}

/// A node failure's `kind` label; none for a reply not awaited (no failure).
fn kind_label(kind: NodeErrorKind) -> Option<&'static str> {
    Some(match kind {
        NodeErrorKind::Timeout => "timeout",
        NodeErrorKind::Unavailable => "unavailable",
        NodeErrorKind::Io => "io",
        NodeErrorKind::Server => "server",
        NodeErrorKind::Protocol => "protocol",
        NodeErrorKind::Skipped => "skipped",
        NodeErrorKind::Restarted => "restarted",
        NodeErrorKind::NoConnection => "no_connection",
        NodeErrorKind::Tls => "tls",
        NodeErrorKind::SameServer => "same_server",
        NodeErrorKind::Unsuitable => "unsuitable",
        NodeErrorKind::Auth => "auth",
        NodeErrorKind::ScriptsRefused => "scripts_refused",
        NodeErrorKind::NotAwaited => return None,
    })
}

impl EventHandler for Metrics {
    fn on_attempt(&self, e: &AttemptEvent<'_>) {
        let outcome = e.error().map_or("acquired", Error::label);
        counter!(ATTEMPTS, self.labels(Some(outcome), e.resource())).increment(1);
        self.node_errors(e.nodes());
        if let Some(h) = &self.inner {
            h.on_attempt(e);
        }
    }

    fn on_acquire(&self, e: &AcquireEvent<'_>) {
        let outcome = e.error().map_or("acquired", Error::label);
        let labels = self.labels(Some(outcome), e.resource());
        histogram!(ACQUIRE_WAIT, labels.iter()).record(e.waited());
        histogram!(ACQUIRE_ATTEMPTS, labels).record(f64::from(e.attempts()));
        if let Some(h) = &self.inner {
            h.on_acquire(e);
        }
    }

    fn on_renewal(&self, e: &RenewalEvent<'_>) {
        let outcome = e.error().map_or("renewed", Error::label);
        counter!(RENEWALS, self.labels(Some(outcome), e.resource())).increment(1);
        if e.is_automatic() {
            histogram!(RENEWAL_MARGIN, self.labels(None, e.resource())).record(e.left());
        }
        self.node_errors(e.nodes());
        if let Some(h) = &self.inner {
            h.on_renewal(e);
        }
    }

    fn on_lost(&self, e: &LostEvent<'_>) {
        let outcome = Error::label(e.error());
        counter!(LOSSES, self.labels(Some(outcome), e.resource())).increment(1);
        if let Some(h) = &self.inner {
            h.on_lost(e);
        }
    }

    fn on_release(&self, e: &ReleaseEvent<'_>) {
        let outcome = e.error().map_or("released", Error::label);
        histogram!(HOLD, self.labels(Some(outcome), e.resource())).record(e.held());
        self.node_errors(e.nodes());
        if let Some(h) = &self.inner {
            h.on_release(e);
        }
    }

    fn on_leadership(&self, e: &LeadershipEvent<'_>) {
        if let Some(h) = &self.inner {
            h.on_leadership(e);
        }
    }

    fn on_node(&self, e: &NodeEvent<'_>) {
        if let Some(h) = &self.inner {
            h.on_node(e);
        }
    }
}
