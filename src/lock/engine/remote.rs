//! What this client's releases learned of other clients' waiters, for the
//! fairness rule between processes.
//!
//! A release that reached subscribers of other clients (they wait for the
//! key, see [`crate::driver::notify`]) marks the key: this client's next
//! attempt on it first waits as long as the release took (about one round
//! trip, so that the woken waiters go first), and its releases go to the
//! nodes instead of to the next local thread (see [`crate::lock::queue`]).
//! A release that reached nobody else clears the mark. So a process hands a
//! key among its own threads for at most half a TTL once (the local queue's
//! bound) before it learns that others wait, and from then on every section
//! ends with a release the others are woken by.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use log::trace;
use parking_lot::Mutex;

use crate::algorithm::round::{Key, NodeResult};
use crate::clock::after;
use crate::lock::state::LockState;

use super::{Engine, Want};

/// Keys remembered at most; the oldest mark goes first.
const MAX_KEYS: usize = 4096;

#[derive(Debug, Default)]
pub(crate) struct Remote {
    /// Whether `marks` holds anything (read without the lock on every
    /// acquire and release).
    any: AtomicBool,
    /// Key → until when this client's next attempt yields, and how many
    /// other clients its last release of the key reached.
    marks: Mutex<HashMap<String, (Instant, u32)>>,
    /// Calls of this client waiting for a lock of several resources now
    /// (its own releases wake them: see `Engine::note_woken`).
    set_waiters: std::sync::atomic::AtomicUsize,
}

impl Remote {
    /// A release of `resource` succeeded; `others`: how many other clients'
    /// waiters it reached, who get until `yield_until` to go first.
    pub(crate) fn released(&self, resource: &str, others: u32, yield_until: Instant) {
        if others > 0 {
            let mut marks = self.marks.lock();
            if marks.len() >= MAX_KEYS && !marks.contains_key(resource) {
                let oldest = marks
                    .iter()
                    .min_by_key(|(_, (t, _))| *t)
                    .map(|(k, _)| k.clone());
                if let Some(k) = oldest {
                    marks.remove(&k);
                }
            }
            marks.insert(resource.to_owned(), (yield_until, others));
            self.any.store(true, Ordering::Release);
        } else if self.any.load(Ordering::Acquire) {
            let mut marks = self.marks.lock();
            marks.remove(resource);
            if marks.is_empty() {
                self.any.store(false, Ordering::Release);
            }
        }
    }

    /// `resource`'s mark: until when this client's next attempt on it
    /// yields, and how many other clients' waiters its last release reached.
    pub(crate) fn mark(&self, resource: &str) -> Option<(Instant, u32)> {
        if !self.any.load(Ordering::Acquire) {
            return None;
        }
        self.marks.lock().get(resource).copied()
    }

    /// Whether the last release of `resource` reached other clients'
    /// waiters: a release then goes to the nodes rather than to the next
    /// local thread (see [`crate::lock::queue`]).
    pub(crate) fn others_wait(&self, resource: &str) -> bool {
        self.mark(resource).is_some()
    }

    /// A call waits for a lock of several until the returned mark drops.
    pub(crate) fn set_waiting(&self) -> SetWaiting<'_> {
        self.set_waiters.fetch_add(1, Ordering::AcqRel);
        SetWaiting(&self.set_waiters)
    }
}

/// A call waiting for a lock of several resources (see
/// [`Remote::set_waiting`]).
pub(crate) struct SetWaiting<'a>(&'a std::sync::atomic::AtomicUsize);

impl Drop for SetWaiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Engine {
    /// After this client's release of `resource` reached waiters of other
    /// clients, its next attempt on it waits as long as that release took
    /// (about one round trip), so that they, woken by it, go first: the
    /// releaser, which could try again at once, kept winning. Returns how
    /// many other clients' waiters that release reached (none: no mark).
    ///
    /// A lock of several yields for the longest mark of its resources, and
    /// counts the most waiters of any.
    pub(super) fn yield_to_others(&self, want: Want<'_>, until: Instant) -> Option<u32> {
        let resource = want.resource;
        let (end, others) = want
            .resources()
            .filter_map(|r| self.remote.mark(r))
            .reduce(|(a, n), (b, m)| (a.max(b), n.max(m)))?;
        let wait = end.min(until).saturating_duration_since(self.clock.now());
        if !wait.is_zero() {
            trace!("lock {resource:?}: yielding {wait:?} to the waiters of other clients");
            self.clock.sleep(wait);
        }
        Some(others)
    }

    /// After a release of `state` that began at `start` succeeded: marks
    /// its keys where it reached subscribers of other clients (the count
    /// less this client's own on each node), clears them where it reached
    /// nobody else. This client's own waiters for locks of several
    /// resources try again.
    ///
    /// (A lock of several: its reply counts the most subscribers of any of
    /// its keys on a node, less one where this client listens to any of
    /// them; so it may miss others that wait, never invent them.)
    pub(super) fn note_woken(&self, state: &LockState, results: &[NodeResult], start: Instant) {
        let any = results.iter().any(|r| r.as_ref().is_ok_and(|r| r.woke > 0));
        let woke = if any {
            let own: Vec<Vec<bool>> = state
                .keys()
                .map(|k| self.transport.watching(k.resource))
                .collect();
            results
                .iter()
                .enumerate()
                .filter_map(|(i, r)| r.as_ref().ok().map(|r| (i, r.woke)))
                .map(|(i, w)| {
                    let mine = own.iter().any(|o| o.get(i) == Some(&true));
                    w.saturating_sub(u32::from(mine))
                })
                .max()
                .unwrap_or(0)
        } else {
            0
        };
        let now = self.clock.now();
        let took = now
            .saturating_duration_since(start)
            .min(self.settings.node_timeout);
        for k in state.keys() {
            self.remote.released(k.resource, woke, after(now, took));
        }
        if self.remote.set_waiters.load(Ordering::Acquire) > 0 {
            let names: Vec<&str> = state.keys().map(|k| k.resource).collect();
            self.transport.released(&names);
        }
    }
}

/// A release's notice (see `Op::Release`): nonzero, one per lock token, so
/// that the copies of one release, and its repeats, wake a waiter once. (A
/// hash, not a random draw: the simulation's schedules stay as they were.)
pub(super) fn notice_of(key: &Key<'_>) -> u64 {
    crate::algorithm::server::id_hash(key.token.as_bytes()) | 1
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_release_that_reached_others_marks_the_key_until_one_reaches_nobody() {
        let r = Remote::default();
        let t = Instant::now() + Duration::from_millis(1);
        assert!(!r.others_wait("k") && r.mark("k").is_none());
        r.released("k", 3, t);
        assert!(r.others_wait("k"));
        assert_eq!(r.mark("k"), Some((t, 3)));
        assert!(!r.others_wait("other"));
        r.released("k", 0, t);
        assert!(!r.others_wait("k") && r.mark("k").is_none());
    }

    #[test]
    fn marks_are_bounded() {
        let r = Remote::default();
        let t0 = Instant::now();
        for i in 0..MAX_KEYS + 10 {
            r.released(&format!("k{i}"), 1, t0 + Duration::from_micros(i as u64));
        }
        assert_eq!(r.marks.lock().len(), MAX_KEYS);
        assert!(!r.others_wait("k0"), "the oldest went first");
        assert!(r.others_wait(&format!("k{}", MAX_KEYS + 9)));
    }
}
