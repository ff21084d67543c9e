//! A node's background work: releases sent again, granted locks' writes
//! that missed their round, and what is owed when the client goes.

use crate::driver::node::conns::Node;
use crate::driver::node::encode::Encoded;
use crate::driver::node::link::Link;
use crate::driver::node::queries::release_once;
use crate::driver::node::replies::catch_up;
use crate::driver::node::retries::Retry;
use crate::driver::node::state::NodeState;
use crate::driver::node::{RedisTransport, CONN_RECHECK, MIN_IDLE};

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use log::debug;

use crate::algorithm::round::{allowance, Key};
use crate::algorithm::round::{After, Op};
use crate::algorithm::server::id_hash;
use crate::clock::after;

impl RedisTransport {
    /// Sends a granted lock's `SET` to node `i` after its round (which found
    /// no free connection to it in time), from the node's thread, as soon
    /// as a connection is free (within the node timeout), with the TTL that
    /// is left: the key then lives as long as the others. Its reply is read
    /// as a late reply: if the lock was released meanwhile, the key is
    /// deleted again behind it (and a release before it leaves cancels it).
    pub(crate) fn write_later(
        &self,
        i: usize,
        k: &Key<'_>,
        ttl: Duration,
        known_max: Duration,
        start: Instant,
    ) {
        let node = &self.nodes[i];
        let shared = &node.shared;
        let until = after(start, ttl);
        // Unsettled from now on: a release marks it, and keeps deleting.
        shared.unsettle(&[k.token.to_owned()], until, Instant::now());
        let job = LateWrite {
            resource: k.resource.to_owned(),
            token: k.token.to_owned(),
            ttl,
            known_max,
            start,
            give_up: after(Instant::now(), self.timeout),
        };
        let weak = Arc::downgrade(node);
        node.threads.execute(move || late_write(&weak, job));
    }

    pub(crate) fn enqueue_retries(&self, i: usize, keys: &[Key<'_>], until: Instant) {
        if until <= Instant::now() || keys.is_empty() {
            return;
        }
        let node = &self.nodes[i];
        {
            let mut q = node.shared.retries.lock();
            for k in keys {
                q.push(
                    Retry {
                        resource: k.resource.to_owned(),
                        token: k.token.to_owned(),
                        until,
                    },
                    false,
                    &node.shared.name,
                );
            }
        }
        schedule_retry(node);
    }
}

/// How often unanswered releases are sent again.
pub(crate) const RETRY_EVERY: Duration = Duration::from_millis(100);

/// Most keys in one retried release command.
pub(crate) const RETRY_BATCH: usize = 1_000;

impl Drop for RedisTransport {
    /// Sends each node the releases it still owes (it did not answer them,
    /// or a `SET` of theirs may still land) once more, all nodes at once,
    /// each on a connection of its own (a node that was failing may have no
    /// pooled one): at most one node timeout to connect and one for the
    /// reply (one more per 200 keys). What is still unanswered then
    /// expires with its TTL.
    fn drop(&mut self) {
        let now = Instant::now();
        let owed: Vec<(usize, Vec<Retry>)> = self
            .nodes
            .iter()
            .enumerate()
            .map(|(i, node)| (i, node.shared.retries.lock().take(usize::MAX, now)))
            .filter(|(_, batch)| !batch.is_empty())
            .collect();
        if owed.is_empty() {
            return;
        }
        let timeout = self.timeout;
        std::thread::scope(|scope| {
            for (i, batch) in &owed {
                let (node, name) = (&self.nodes[*i], &self.names[*i]);
                let spawned = std::thread::Builder::new()
                    .name("quorumlock-flush".into())
                    .spawn_scoped(scope, move || {
                        let keys: Vec<Key<'_>> = batch
                            .iter()
                            .map(|r| Key::new(&r.resource, &r.token))
                            .collect();
                        let enc = Encoded::new(
                            Op::Release {
                                keep_until: now,
                                notice: 0,
                            },
                            &keys,
                        );
                        let reply = allowance(timeout, keys.len());
                        match release_once(&node.target, &enc.fallback(), (timeout, reply)) {
                            Ok(()) => debug!(
                                "node {name}: client dropped; {} owed release(s) sent",
                                keys.len()
                            ),
                            Err(e) => debug!(
                                "node {name}: client dropped; {} owed release(s) lost: {e}",
                                keys.len()
                            ),
                        }
                    });
                if let Err(e) = spawned {
                    debug!("node {name}: cannot send owed releases: {e}");
                }
            }
        });
    }
}

/// A granted lock's `SET` to send a node after the round (see
/// [`RedisTransport::write_later`]).
pub(crate) struct LateWrite {
    pub(crate) resource: String,
    pub(crate) token: String,
    pub(crate) ttl: Duration,
    pub(crate) known_max: Duration,
    /// When the lock's round started: the key's TTL counts from there.
    pub(crate) start: Instant,
    /// When to stop looking for a free connection.
    pub(crate) give_up: Instant,
}

/// Runs on the node's thread: sends `w` on a free connection, or looks
/// again shortly (connects run on this thread too), until `w.give_up`.
pub(crate) fn late_write(weak: &Weak<Node>, w: LateWrite) {
    let Some(node) = weak.upgrade() else {
        return;
    };
    let shared = &node.shared;
    let now = Instant::now();
    let left = after(w.start, w.ttl).saturating_duration_since(now);
    let released = shared
        .unsettled
        .lock()
        .get(&w.token)
        .is_none_or(|u| u.released);
    if released || left <= shared.timeout || now >= w.give_up {
        // Released meanwhile, about to expire, or no connection in time:
        // not sent (the renewal, if any, restores the copy).
        shared.unsettled.lock().remove(&w.token);
        return;
    }
    let mut free = node.pool.try_get();
    if let Some(c) = free.as_mut() {
        if !catch_up(c, shared, now) {
            free = None;
        }
    }
    match free {
        Some(mut c) => {
            let key = Key::new(&w.resource, &w.token);
            let op = Op::Acquire {
                ttl: left,
                known_max: w.known_max,
                fenced: false,
                after: After::NONE,
                known_prev: std::time::Duration::ZERO,
                lean: None,
                intent: Duration::ZERO,
                place: crate::algorithm::round::Place::NONE,
            };
            let undo = Encoded::new(
                Op::Release {
                    keep_until: after(w.start, w.ttl),
                    notice: 0,
                },
                &[key],
            )
            .packed;
            // It may write a key of ours (see `InFlight::undo`).
            c.wire
                .queue_unwanted(&Encoded::new(op, &[key]).packed, now, |p| {
                    p.undo = Some(undo);
                    p.tokens = vec![w.token.clone()];
                });
            if c.flush().is_err() {
                shared.unsettled.lock().remove(&w.token);
            } else {
                debug!(
                    "node {}: a granted lock's SET sent after its round",
                    shared.name
                );
            }
        }
        _ => {
            let weak = weak.clone();
            node.threads
                .execute_after(CONN_RECHECK, move || late_write(&weak, w));
        }
    }
}

/// A retried release was answered: its entries leave the queue, but for
/// those whose SET may still land here (tokens are one per attempt: they
/// name the entries), which are watched until it is read.
pub(crate) fn retries_answered(node: &NodeState, tokens: &[String]) {
    let (watched, done): (HashSet<&str>, HashSet<&str>) = {
        let unsettled = node.unsettled.lock();
        tokens
            .iter()
            .map(String::as_str)
            .partition(|t| unsettled.contains_key(*t))
    };
    debug!(
        "node {}: {} retried release(s) answered",
        node.name,
        tokens.len()
    );
    let mut q = node.retries.lock();
    q.watched.retain(|r| !done.contains(r.token.as_str()));
    for r in std::mem::take(&mut q.owed) {
        let t = r.token.as_str();
        if watched.contains(t) {
            q.watched.push_back(r);
        } else if !done.contains(t) {
            q.owed.push_back(r);
        }
    }
}

/// Starts the node's release-retry job unless it is already scheduled.
pub(crate) fn schedule_retry(node: &Arc<Node>) {
    if node.shared.retry_scheduled.swap(true, Ordering::AcqRel) {
        return;
    }
    let weak = Arc::downgrade(node);
    node.threads
        .execute_after(RETRY_EVERY, move || retry_job(&weak));
}

/// Sends the node's unanswered releases again (one command for up to
/// [`RETRY_BATCH`] keys); drops those answered or expired; reschedules
/// itself while any remain. Stops when the client is gone.
pub(crate) fn retry_job(weak: &Weak<Node>) {
    let Some(node) = weak.upgrade() else {
        return;
    };
    let shared = &node.shared;
    let now = Instant::now();
    // Read late replies off the idle connections that owe some. The pool
    // is a stack (the last connection given back is the first taken), so
    // those are on top unless rounds took them (which read them). Every
    // pop that leaves fewer than the pool's idle minimum starts a new
    // connection (however many are being made), so no more is popped than
    // leaves that minimum idle; a round that finds none meanwhile waits
    // (see `wait_busy_pool`).
    let max = node.pool.max_size();
    let spare = |st: r2d2::State| {
        // At the pool's size no pop starts a connection; one more is left
        // idle for a round of a busy client that comes meanwhile.
        let busy = u32::from(st.connections > st.idle_connections);
        st.connections >= max || st.idle_connections > MIN_IDLE.min(max) + busy
    };
    let owed = drain_owing(shared, now, || {
        spare(node.pool.state())
            .then(|| node.pool.try_get())
            .flatten()
    });
    // Late replies on the rounds' shared connection (a retried release's
    // answer, a late SET) are read too, and the releases are sent on it:
    // it may hold the pool's only connection.
    let current = node.line.lock().clone();
    if let Some(line) = current {
        line.pump(None);
    }
    resend_releases(shared, now, RETRY_BATCH, || {
        crate::driver::node::multiplexed::join(&node.line, shared, &node.role, None, now, || {
            let mut c = node.pool.try_get()?;
            catch_up(&mut c, shared, Instant::now()).then_some(c)
        })
    });
    shared.retry_scheduled.store(false, Ordering::Release);
    let more = owed || !shared.retries.lock().is_empty();
    if more {
        schedule_retry(&node);
    }
}

/// Reads the late replies off the node's idle connections that owe some
/// (they may say a SET landed, or answer a retried release), taking them
/// with `take` (no more than owe), and gives them back. Returns whether a
/// release is still owed its reply (it may come back NOSCRIPT: the job
/// looks again).
pub(crate) fn drain_owing<L: Link>(
    shared: &NodeState,
    now: Instant,
    mut take: impl FnMut() -> Option<L>,
) -> bool {
    let want = shared.owing.load(Ordering::Acquire);
    if want == 0 {
        return false;
    }
    shared.draining.store(true, Ordering::Release);
    let mut idle = Vec::new();
    while idle.len() < want && shared.owing.load(Ordering::Acquire) > 0 {
        let Some(mut c) = take() else {
            break;
        };
        catch_up(&mut c, shared, now);
        idle.push(c);
    }
    let owed = idle
        .iter()
        .any(|c| !c.wire().broken && c.wire().owes_release());
    drop(idle);
    shared.draining.store(false, Ordering::Release);
    owed
}

/// The part of a node's retry job that needs no pool: the batches the node
/// answered leave the queue, expired entries go, and the next batch is sent
/// (not waited for) on the connection `checkout` gives, if any. The batch
/// stays queued until the node answers it.
pub(crate) fn resend_releases<L: Link>(
    shared: &NodeState,
    now: Instant,
    batch_size: usize,
    checkout: impl FnOnce() -> Option<L>,
) {
    let answered = std::mem::take(&mut *shared.answered.lock());
    #[cfg(test)]
    let answered = if shared.defects.retry_same_batch {
        Vec::new()
    } else {
        answered
    };
    for tokens in &answered {
        retries_answered(shared, tokens);
    }
    shared.unsettled.lock().retain(|_, u| u.until > now);
    shared.undone.lock().retain(|_, until| *until > now);
    // The batch leaves the queue and what is still owed goes back behind
    // the rest: a batch that cannot be settled yet (a SET of its tokens may
    // still land) never holds back the releases queued after it.
    let batch: Vec<Retry> = shared.retries.lock().take(batch_size, now);
    if !batch.is_empty() {
        let keys: Vec<Key<'_>> = batch
            .iter()
            .map(|r| Key::new(&r.resource, &r.token))
            .collect();
        // Published where it frees a key: after an outage a key's last
        // copies (a release or an undo the node missed) go only now, and
        // with no message the waiters of every other client slept out their
        // retry pause on a free key (issue 41). Its own notice per token
        // and node, not the release's: the release's copies on the nodes
        // that answered woke the waiters already (to a key still held
        // here), and a repeat of their notice wakes nobody. So each node's
        // retry wakes them once; a batch's later tokens share the first's.
        // Only what a node failed to answer is retried: no message comes
        // from here on the happy path, and none a third party could not
        // send itself.
        let notice = batch.first().map_or(1, |r| {
            let (token, node) = (r.token.as_bytes(), shared.name.as_bytes());
            (id_hash(token) ^ id_hash(node).rotate_left(17)) | 1
        });
        let enc = Encoded::new(
            Op::Release {
                keep_until: now,
                notice,
            },
            &keys,
        );
        // Sent, not waited for: its reply is read as a late reply (by the
        // next run, or a round), which takes the batch off the queue. Until
        // then it stays queued, and is sent again if no reply comes. Never
        // waiting keeps this thread free for the pool's connects and the
        // connection in the pool: a connection held for a round trip left
        // the pool below its idle minimum, and every round meanwhile
        // started one more connection.
        if let Some(mut c) = checkout() {
            let tokens = batch.iter().map(|r| r.token.clone()).collect();
            c.wire_mut()
                .queue_retry(&enc.packed, shared.clock.now(), enc.fallback(), tokens);
            if c.flush().is_err() {
                c.wire_mut().broken = true;
            }
        }
        let mut q = shared.retries.lock();
        #[cfg(test)]
        if shared.defects.retry_same_batch {
            for r in batch.into_iter().rev() {
                q.owed.push_front(r);
            }
            return;
        }
        for r in batch {
            q.push(r, false, &shared.name);
        }
    }
}
