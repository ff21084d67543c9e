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

use parking_lot::Mutex;

/// Keys remembered at most; the oldest mark goes first.
const MAX_KEYS: usize = 4096;

#[derive(Debug, Default)]
pub(crate) struct Remote {
    /// Whether `marks` holds anything (read without the lock on every
    /// acquire and release).
    any: AtomicBool,
    /// Key → until when this client's next attempt yields.
    marks: Mutex<HashMap<String, Instant>>,
}

impl Remote {
    /// A release of `resource` succeeded; `others`: it reached waiters of
    /// other clients, who get until `yield_until` to go first.
    pub(crate) fn released(&self, resource: &str, others: bool, yield_until: Instant) {
        if others {
            let mut marks = self.marks.lock();
            if marks.len() >= MAX_KEYS && !marks.contains_key(resource) {
                let oldest = marks
                    .iter()
                    .min_by_key(|(_, t)| **t)
                    .map(|(k, _)| k.clone());
                if let Some(k) = oldest {
                    marks.remove(&k);
                }
            }
            marks.insert(resource.to_owned(), yield_until);
            self.any.store(true, Ordering::Release);
        } else if self.any.load(Ordering::Acquire) {
            let mut marks = self.marks.lock();
            marks.remove(resource);
            if marks.is_empty() {
                self.any.store(false, Ordering::Release);
            }
        }
    }

    /// Until when this client's next attempt on `resource` yields.
    pub(crate) fn yield_until(&self, resource: &str) -> Option<Instant> {
        if !self.any.load(Ordering::Acquire) {
            return None;
        }
        self.marks.lock().get(resource).copied()
    }

    /// Whether the last release of `resource` reached other clients' waiters.
    pub(crate) fn others_wait(&self, resource: &str) -> bool {
        self.any.load(Ordering::Acquire) && self.marks.lock().contains_key(resource)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_release_that_reached_others_marks_the_key_until_one_reaches_nobody() {
        let r = Remote::default();
        let t = Instant::now() + Duration::from_millis(1);
        assert!(!r.others_wait("k") && r.yield_until("k").is_none());
        r.released("k", true, t);
        assert!(r.others_wait("k"));
        assert_eq!(r.yield_until("k"), Some(t));
        assert!(!r.others_wait("other"));
        r.released("k", false, t);
        assert!(!r.others_wait("k") && r.yield_until("k").is_none());
    }

    #[test]
    fn marks_are_bounded() {
        let r = Remote::default();
        let t0 = Instant::now();
        for i in 0..MAX_KEYS + 10 {
            r.released(&format!("k{i}"), true, t0 + Duration::from_micros(i as u64));
        }
        assert_eq!(r.marks.lock().len(), MAX_KEYS);
        assert!(!r.others_wait("k0"), "the oldest went first");
        assert!(r.others_wait(&format!("k{}", MAX_KEYS + 9)));
    }
}
