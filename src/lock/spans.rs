//! The `tracing` feature's spans, beside the `log` lines (which stay as they
//! are): a span per lock call ([`LockCall`]), per attempt of a call
//! ([`LockCall::round`]), and per lock per renewal round on the renewal
//! thread ([`Renewals`]), under the span of the caller that took the lock
//! ([`Caller`]). The guide lists their names, fields and levels.
//!
//! With the feature off every type here is empty and every function does
//! nothing: no field, no clock read, nothing on the hot path. With it on, a
//! span no subscriber wants is `Span::none()` (the callsite's cached
//! interest), and its fields are recorded at its end, where recording into
//! a disabled span costs nothing. No token is ever a field.

use std::time::Duration;

use crate::error::Error;

/// Every span's target (a stable name to filter by, whatever the module).
#[cfg(feature = "tracing")]
const TARGET: &str = "quorumlock";

/// The span current where a lock was taken: the parent of the work the
/// crate does for that lock on its own threads (its renewals, the release
/// of a lock found lost).
#[derive(Clone, Debug)]
pub(crate) struct Caller {
    #[cfg(feature = "tracing")]
    span: tracing::Span,
}

impl Caller {
    /// No caller's span (a lock made before the call's end sets its own).
    #[inline]
    pub(crate) fn none() -> Caller {
        Caller {
            #[cfg(feature = "tracing")]
            span: tracing::Span::none(),
        }
    }

    /// The current span, where a subscriber may want the crate's spans
    /// (they are at debug and below); else none.
    #[cfg(feature = "tracing")]
    fn current() -> Caller {
        Caller {
            span: if tracing::level_enabled!(tracing::Level::DEBUG) {
                tracing::Span::current()
            } else {
                tracing::Span::none()
            },
        }
    }
}

/// A lock call's kind, as its span names it.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Kind {
    /// An exclusive lock of one resource.
    Write,
    /// A read lock.
    Read,
    /// A lock of several resources.
    Several,
    /// A candidate's campaign in a leader election.
    Election,
}

impl Kind {
    #[cfg(feature = "tracing")]
    fn name(self) -> &'static str {
        match self {
            Kind::Write => "write",
            Kind::Read => "read",
            Kind::Several => "several",
            Kind::Election => "election",
        }
    }
}

/// A lock call's span (`quorumlock.lock`, debug), entered for the call;
/// its outcome, attempts and wait are recorded at its end.
pub(crate) struct LockCall {
    #[cfg(feature = "tracing")]
    span: tracing::Span,
    #[cfg(feature = "tracing")]
    caller: Caller,
    /// Attempts at the nodes so far (for the span, and the call's event).
    attempts: u32,
    #[cfg(feature = "tracing")]
    waited: Duration,
}

impl LockCall {
    /// Opens the span of a call for `resource` (the first of a lock of
    /// several) of `kind`, under the current span.
    #[inline]
    pub(crate) fn start(resource: &str, kind: Kind) -> LockCall {
        #[cfg(not(feature = "tracing"))]
        let _ = (resource, kind);
        LockCall {
            #[cfg(feature = "tracing")]
            span: tracing::debug_span!(
                target: TARGET,
                "quorumlock.lock",
                resource,
                kind = kind.name(),
                outcome = tracing::field::Empty,
                attempts = tracing::field::Empty,
                waited = tracing::field::Empty,
                error = tracing::field::Empty,
            ),
            #[cfg(feature = "tracing")]
            caller: Caller::current(),
            attempts: 0,
            #[cfg(feature = "tracing")]
            waited: Duration::ZERO,
        }
    }

    /// Runs `f` (the call) inside the span.
    #[inline]
    pub(crate) fn in_scope<T>(&mut self, f: impl FnOnce(&mut Self) -> T) -> T {
        #[cfg(feature = "tracing")]
        {
            let span = self.span.clone();
            let _entered = span.enter();
            f(self)
        }
        #[cfg(not(feature = "tracing"))]
        f(self)
    }

    /// Whether a subscriber wants this call's span (a detail that costs a
    /// clock read is worth it only then).
    /// The call's attempts at the nodes so far.
    #[inline]
    pub(crate) fn attempts(&self) -> u32 {
        self.attempts
    }

    #[inline]
    pub(crate) fn is_wanted(&self) -> bool {
        #[cfg(feature = "tracing")]
        return !self.span.is_disabled();
        #[cfg(not(feature = "tracing"))]
        false
    }

    /// Notes how long the call had waited at its end, where it made no
    /// attempt after (a lock handed over by another thread of this process).
    #[inline]
    pub(crate) fn waited(&mut self, waited: Duration) {
        #[cfg(feature = "tracing")]
        {
            self.waited = waited;
        }
        #[cfg(not(feature = "tracing"))]
        let _ = waited;
    }

    /// Runs `f`, an attempt at the nodes that began `waited` after the call
    /// (`woken`: after a release's wake-up), inside its span
    /// (`quorumlock.round`, trace, under the call's), and counts it.
    #[inline]
    pub(crate) fn round<T>(
        &mut self,
        (waited, woken): (Duration, bool),
        f: impl FnOnce() -> crate::Result<T>,
    ) -> crate::Result<T> {
        self.attempts = self.attempts.saturating_add(1);
        #[cfg(feature = "tracing")]
        {
            self.waited = waited;
            let span = tracing::trace_span!(
                target: TARGET,
                parent: &self.span,
                "quorumlock.round",
                attempt = self.attempts,
                woken,
                outcome = tracing::field::Empty,
            );
            let out = span.in_scope(f);
            span.record("outcome", outcome(out.as_ref().map(|_| ()), "acquired"));
            out
        }
        #[cfg(not(feature = "tracing"))]
        {
            let _ = (waited, woken);
            f()
        }
    }

    /// Records the call's outcome, attempts and wait; the caller's span, for
    /// the lock it took.
    #[inline]
    pub(crate) fn end(self, result: Result<(), &Error>) -> Caller {
        #[cfg(feature = "tracing")]
        {
            let span = &self.span;
            span.record("outcome", outcome(result, "acquired"));
            span.record("attempts", self.attempts);
            span.record("waited", tracing::field::debug(self.waited));
            if let Err(e) = result {
                span.record("error", tracing::field::display(e));
            }
            self.caller
        }
        #[cfg(not(feature = "tracing"))]
        {
            let _ = result;
            Caller::none()
        }
    }
}

/// The spans of one renewal round on the renewal thread: one per lock
/// (`quorumlock.renewal`, debug), under the span of the caller that took
/// it; and those of a release of locks found lost
/// (`quorumlock.release_lost`, debug).
pub(crate) struct Renewals {
    /// The wanted spans, with their lock's place in the round (no
    /// allocation where none is wanted).
    #[cfg(feature = "tracing")]
    spans: Vec<(usize, tracing::Span)>,
}

impl Renewals {
    /// Opens the spans of a renewal of `locks` (resource, section, caller)
    /// to `ttl`.
    #[inline]
    pub(crate) fn renewal<'a>(
        locks: impl Iterator<Item = (&'a str, u64, &'a Caller)>,
        ttl: Duration,
    ) -> Renewals {
        #[cfg(feature = "tracing")]
        {
            let mut spans = Vec::new();
            for (i, (resource, section, caller)) in locks.enumerate() {
                let span = tracing::debug_span!(
                    target: TARGET,
                    parent: &caller.span,
                    "quorumlock.renewal",
                    resource,
                    section,
                    ttl = ?ttl,
                    outcome = tracing::field::Empty,
                    validity = tracing::field::Empty,
                    error = tracing::field::Empty,
                );
                if !span.is_disabled() {
                    spans.push((i, span));
                }
            }
            Renewals { spans }
        }
        #[cfg(not(feature = "tracing"))]
        {
            let _ = (locks, ttl);
            Renewals {}
        }
    }

    /// Runs `f`, the release of `locks` (resource, section, caller) found
    /// lost, with their spans open.
    #[inline]
    pub(crate) fn release_lost<'a>(
        locks: impl Iterator<Item = (&'a str, u64, &'a Caller)>,
        f: impl FnOnce(),
    ) {
        #[cfg(feature = "tracing")]
        {
            let mut spans = Vec::new();
            for (resource, section, caller) in locks {
                let span = tracing::debug_span!(
                    target: TARGET,
                    parent: &caller.span,
                    "quorumlock.release_lost",
                    resource,
                    section,
                );
                if !span.is_disabled() {
                    spans.push(span);
                }
            }
            f();
            drop(spans);
        }
        #[cfg(not(feature = "tracing"))]
        {
            let _ = locks;
            f();
        }
    }

    /// Records each renewed lock's outcome (in the order opened).
    #[inline]
    pub(crate) fn end(self, outcomes: &[crate::Result<Duration>]) {
        #[cfg(feature = "tracing")]
        for (i, span) in &self.spans {
            let Some(outcome_of) = outcomes.get(*i) else {
                continue;
            };
            span.record(
                "outcome",
                outcome(outcome_of.as_ref().map(|_| ()), "renewed"),
            );
            match outcome_of {
                Ok(validity) => span.record("validity", tracing::field::debug(validity)),
                Err(e) => span.record("error", tracing::field::display(e)),
            };
        }
        #[cfg(not(feature = "tracing"))]
        let _ = outcomes;
    }
}

/// An outcome's name in a span: `ok`, or the error's kind.
#[cfg(feature = "tracing")]
fn outcome(result: Result<(), &Error>, ok: &'static str) -> &'static str {
    result.map_or_else(Error::label, |()| ok)
}

// Without the feature the spans weigh nothing: no field in a lock, nothing
// carried through a renewal round; a call carries only its attempt count
// (which its event reports).
#[cfg(not(feature = "tracing"))]
const _: () = assert!(
    std::mem::size_of::<Caller>() == 0
        && std::mem::size_of::<LockCall>() == std::mem::size_of::<u32>()
        && std::mem::size_of::<Renewals>() == 0
);
