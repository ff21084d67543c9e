//! The releases a node still owes an answer to (or that must be sent
//! again while a SET of their token may land), and the acquires whose reply
//! has not been read.

use std::collections::VecDeque;
use std::time::Instant;

use log::debug;

/// Most releases kept for retry per node (the oldest are dropped first).
pub(crate) const MAX_RETRIES: usize = 10_000;

/// An acquire whose reply has not been read yet.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Unsettled {
    pub(crate) until: Instant,
    pub(crate) released: bool,
}

/// A release to send again.
pub(crate) struct Retry {
    pub(crate) resource: String,
    pub(crate) token: String,
    pub(crate) until: Instant,
}

/// A node's releases to send again: those it has not answered (`owed`),
/// sent first, and those it answered while a SET of their token may still
/// land (`watched`: deleted again until that SET's reply is read or its TTL
/// ends). At most [`MAX_RETRIES`] in all; a full queue drops watched ones
/// first, the oldest first.
#[derive(Default)]
pub(crate) struct Retries {
    pub(crate) owed: VecDeque<Retry>,
    pub(crate) watched: VecDeque<Retry>,
}

impl Retries {
    pub(crate) fn push(&mut self, r: Retry, watched: bool, node: &str) {
        if self.owed.len() + self.watched.len() >= MAX_RETRIES && self.watched.pop_front().is_none()
        {
            self.owed.pop_front();
            debug!("node {node}: release retry queue full; oldest dropped");
        }
        if watched {
            self.watched.push_back(r);
        } else {
            self.owed.push_back(r);
        }
    }

    /// Up to `n` live releases, owed ones first, taken off the queue; more
    /// where the last one's token has more keys next (a lock of several
    /// resources): a batch never splits a token, since the node's answer
    /// settles every release of the tokens it names.
    pub(crate) fn take(&mut self, n: usize, now: Instant) -> Vec<Retry> {
        self.owed.retain(|r| r.until > now);
        self.watched.retain(|r| r.until > now);
        let mut batch = Vec::new();
        take_whole(&mut self.owed, n, &mut batch);
        take_whole(&mut self.watched, n.saturating_sub(batch.len()), &mut batch);
        batch
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.owed.is_empty() && self.watched.is_empty()
    }
}

/// Moves up to `n` entries from the front of `q` to `batch`, and then those
/// right behind with the last one's token.
fn take_whole(q: &mut VecDeque<Retry>, n: usize, batch: &mut Vec<Retry>) {
    let mut k = q.len().min(n);
    if let Some(last) = k.checked_sub(1).and_then(|i| q.get(i)) {
        let token = last.token.clone();
        while q.get(k).is_some_and(|r| r.token == token) {
            k += 1;
        }
    }
    batch.extend(q.drain(..k));
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn retry(token: &str, until: Instant) -> Retry {
        Retry {
            resource: "r".into(),
            token: token.into(),
            until,
        }
    }

    /// A batch never splits the releases of one token (the keys of a lock of
    /// several resources): a node's answer to a batch settles its tokens,
    /// and a key of the set left for the next batch was dropped with them,
    /// its key left on the node for its TTL.
    #[test]
    fn a_batch_takes_every_key_of_a_token() {
        let now = Instant::now();
        let later = now + Duration::from_secs(30);
        let mut q = Retries::default();
        for (resource, token) in [("a", "T"), ("b", "T"), ("c", "T"), ("d", "U")] {
            let r = Retry {
                resource: resource.into(),
                token: token.into(),
                until: later,
            };
            q.push(r, false, "n");
        }
        let batch = q.take(1, now);
        let keys: Vec<&str> = batch.iter().map(|r| r.resource.as_str()).collect();
        assert_eq!(keys, ["a", "b", "c"]);
        assert_eq!(q.take(1, now).len(), 1);
        assert!(q.is_empty());
    }

    /// Releases the node never answered go first, and are the last to be
    /// dropped from a full queue: a storm of watched releases (answered,
    /// their SET still unsettled) left thousands of keys for their TTL.
    #[test]
    fn owed_releases_go_first_and_outlive_watched_ones() {
        let now = Instant::now();
        let later = now + Duration::from_secs(30);
        let mut q = Retries::default();
        for i in 0..MAX_RETRIES {
            q.push(retry(&format!("w{i}"), later), true, "n");
        }
        q.push(retry("gone", now), false, "n");
        for i in 0..10 {
            q.push(retry(&format!("o{i}"), later), false, "n");
        }
        assert_eq!(q.owed.len() + q.watched.len(), MAX_RETRIES);
        assert_eq!(q.owed.len(), 11, "a full queue dropped watched ones");
        assert_eq!(q.watched.front().map(|r| r.token.as_str()), Some("w11"));
        let batch = q.take(5, now);
        let tokens: Vec<&str> = batch.iter().map(|r| r.token.as_str()).collect();
        assert_eq!(
            tokens,
            ["o0", "o1", "o2", "o3", "o4"],
            "expired dropped, owed first"
        );
        let batch = q.take(8, now);
        assert_eq!(batch.len(), 8);
        assert_eq!(batch[4].token, "o9");
        assert_eq!(batch[5].token, "w11", "then the oldest watched");
        for i in 0..(MAX_RETRIES + 5) {
            q.push(retry(&format!("x{i}"), later), false, "n");
        }
        assert!(q.watched.is_empty(), "watched ones go before owed ones");
        assert_eq!(q.owed.len(), MAX_RETRIES);
    }
}
