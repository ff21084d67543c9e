//! Wake-ups in the simulation (see `crate::driver::notify`): a release
//! that deletes a key publishes it to the clients that wait for it, each
//! message lost and duplicated as the network loses and duplicates
//! requests, and delayed as replies are. The production engine waits on
//! them through [`Watch`]; the quorum decides, so the checkers hold
//! whatever the messages do, and the workload's bounds on every call's
//! wait (`check_wait`) bound the waits.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;

use crate::algorithm::round::{is_reader, Answer, Key, Reply};
use crate::lock::transport::Watch;
use crate::testing::sim::chan::SimChan;
use crate::testing::sim::sched::Sched;
use crate::testing::sim::world::{Event, World};

impl World {
    /// Node `node` ran a release with `notice` (0: silent): each key it
    /// freed reaches that key's subscribers, and the reply counts them. A
    /// reader's release frees its key only where no live reader is left
    /// on the node after it (the last reader out, as `RELEASE_LUA`).
    pub(crate) fn publish(
        &mut self,
        node: usize,
        reply: &mut Reply,
        keys: &[Key<'_>],
        notice: u64,
        now: u64,
    ) {
        let Some(subs) = &self.subs else {
            return;
        };
        if notice == 0 {
            return;
        }
        let mut to = Vec::new();
        let store = &self.nodes[node].store;
        for (k, a) in keys.iter().zip(&reply.answers) {
            if *a != Answer::Ok || (is_reader(k.token) && store.live_readers(k.resource) > 0) {
                continue;
            }
            if let Some(list) = subs.get(k.resource) {
                reply.woke = reply
                    .woke
                    .max(u32::try_from(list.len()).unwrap_or(u32::MAX));
                to.extend(list.iter().cloned());
            }
        }
        if self.nodes[node].isolated || self.nodes[node].muted {
            return;
        }
        for chan in to {
            if self.rng.chance(self.net.loss) {
                self.wakes.lost += 1;
                continue;
            }
            let at = now + self.delay();
            self.push(at, Event::Notify(chan.clone(), notice));
            if self.rng.chance(self.net.dup) {
                self.wakes.doubled += 1;
                let later = at + self.delay();
                self.push(later, Event::Notify(chan, notice));
            }
        }
    }
}

impl World {
    /// `n` forged release messages, each with a fresh notice, to every
    /// subscriber of every key (see `Fault::Forge`).
    pub(crate) fn forge(&mut self, n: u32, now: u64) {
        let chans: Vec<_> = self
            .subs
            .iter()
            .flat_map(|s| s.values().flatten().cloned())
            .collect();
        for chan in chans {
            for _ in 0..n {
                let notice = self.rng.below(u64::MAX) | 1;
                let at = now + self.delay();
                self.push(at, Event::Notify(chan.clone(), notice));
            }
        }
    }
}

/// One client's subscriptions (shared by its threads, as the driver's one
/// subscriber connection per node is).
#[derive(Default)]
pub(crate) struct Watches {
    chans: Mutex<HashMap<String, Arc<SimChan>>>,
}

impl Watches {
    /// Subscribes to `resource` (or, `existing`, only where subscribed
    /// already). `None` when the run has no wake-ups.
    pub(crate) fn watch(
        &self,
        sched: &Arc<Sched>,
        resource: &str,
        existing: bool,
    ) -> Option<Box<dyn Watch>> {
        let mut core = sched.lock();
        let subs = core.world.subs.as_mut()?;
        let mut chans = self.chans.lock();
        let chan = match chans.get(resource) {
            Some(c) => c.clone(),
            None if existing => return None,
            None => {
                let c = Arc::new(SimChan::default());
                chans.insert(resource.to_owned(), c.clone());
                subs.entry(resource.to_owned()).or_default().push(c.clone());
                c
            }
        };
        Some(Box::new(SimWatch {
            chan,
            sched: sched.clone(),
        }))
    }

    /// Subscribes to every one of `resources`: one wait, woken by a
    /// message for any (as the driver's `Notifier::watch_all`).
    pub(crate) fn watch_all(
        &self,
        sched: &Arc<Sched>,
        resources: &[&str],
    ) -> Option<Box<dyn Watch>> {
        let signal = Arc::new(crate::clock::Signal::default());
        for r in resources {
            // (Subscribed as a lone waiter would be; its watch is dropped.)
            let _ = self.watch(sched, r, false)?;
            if let Some(c) = self.chans.lock().get(*r) {
                let mut also = c.also.lock();
                also.retain(|s| s.strong_count() > 0);
                also.push(Arc::downgrade(&signal));
            }
        }
        Some(Box::new(SimWatchAll {
            signal,
            sched: sched.clone(),
        }))
    }

    /// This client's release of `resources` ended: its waits for several
    /// keys try again (as the driver's `Notifier::released`).
    pub(crate) fn released(&self, resources: &[&str]) {
        let chans = self.chans.lock();
        for r in resources {
            if let Some(c) = chans.get(*r) {
                c.wake_sets();
            }
        }
    }

    /// This client releases `resource` with `notice`: its own message wakes
    /// none of its waiters (as in the driver).
    pub(crate) fn releasing(&self, resource: &str, notice: u64) {
        if let Some(c) = self.chans.lock().get(resource) {
            c.seen(notice);
        }
    }

    /// Per node, whether this client listens to `resource` (on every node
    /// once subscribed).
    pub(crate) fn watching(&self, resource: &str, nodes: usize) -> Vec<bool> {
        if self.chans.lock().contains_key(resource) {
            vec![true; nodes]
        } else {
            Vec::new()
        }
    }
}

struct SimWatch {
    chan: Arc<SimChan>,
    sched: Arc<Sched>,
}

impl Watch for SimWatch {
    fn seen(&self) -> u64 {
        self.chan.signal.seen()
    }

    fn wait(&self, seen: u64, until: Instant) -> bool {
        self.sched.wait_signal(&self.chan.signal, seen, Some(until));
        self.chan.signal.seen() != seen
    }
}

/// A wait for any of several keys: its own signal, which each key's
/// channel also notifies.
struct SimWatchAll {
    signal: Arc<crate::clock::Signal>,
    sched: Arc<Sched>,
}

impl Watch for SimWatchAll {
    fn seen(&self) -> u64 {
        self.signal.seen()
    }

    fn wait(&self, seen: u64, until: Instant) -> bool {
        self.sched.wait_signal(&self.signal, seen, Some(until));
        self.signal.seen() != seen
    }
}
