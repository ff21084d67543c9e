//! The leak account of [`Checker`]: every write of ours that a round sent or
//! that landed on a node, and the deletes sent after it.

use crate::algorithm::round::{written, Key, Op};

use super::{lineage, traced, Checker};

impl Checker {
    /// A command of `op` on `keys` leaves the client for one node.
    pub(crate) fn sent(&mut self, op: Op, keys: &[Key<'_>], now: u64) {
        if let Op::Acquire { ttl, .. }
        | Op::Swap { ttl, .. }
        | Op::Extend { ttl, .. }
        | Op::Restore { ttl } = op
        {
            let until = now.saturating_add(u64::try_from(ttl.as_nanos()).unwrap_or(u64::MAX));
            for k in written(op, keys) {
                let w = self.last_write.entry(k.token.to_owned()).or_default();
                *w = (w.0.max(until), w.1.max(ttl));
            }
        }
        if std::env::var_os("QUORUMLOCK_SIM_TRACE").is_some() {
            println!("{:10.3} ms send {}", now as f64 / 1e6, traced(op, keys));
        }
    }

    /// A delete of `token` left the client at `now` on a connection to
    /// `node` that could carry it there (the node was up or paused, not cut
    /// off): the client did its part, even if the connection resets.
    pub(crate) fn delete_sent(&mut self, token: &str, node: usize, now: u64) {
        let d = self
            .deleted
            .entry((lineage(token).to_owned(), node))
            .or_default();
        *d = (*d).max(now);
    }

    /// The client lets go of `lineage` at `now` with nothing of it left on
    /// any node and no write of it in flight (its key expired first): no
    /// delete is owed for its earlier writes.
    pub(crate) fn nothing_left(&mut self, lineage: &str, now: u64) {
        self.owed(lineage, now, Vec::new());
    }

    /// The client lets go of `lineage` at `now` with live copies left on
    /// `copies` (node, until when): a delete is owed to each, unless no
    /// connection to that node could be made before its copy expired.
    pub(crate) fn owed(&mut self, lineage: &str, now: u64, copies: Vec<(usize, u64)>) {
        self.owed
            .entry(lineage.to_owned())
            .or_default()
            .push((now, copies));
    }

    /// Node `node` applied a command that set or kept our key, sent at
    /// `sent`, at `now`.
    pub(crate) fn landed(&mut self, token: &str, node: usize, sent: u64, now: u64) {
        let t = self
            .landed
            .entry((lineage(token).to_owned(), node))
            .or_default();
        *t = (t.0.max(sent), t.1.max(now));
    }

    /// A client's process died having written `lineages`: what it left on
    /// the nodes expires by its TTL (the key checks still hold it to
    /// that), and no delete of it is owed.
    pub(crate) fn abandon(&mut self, lineages: impl IntoIterator<Item = String>) {
        self.abandoned.extend(lineages);
    }
}
