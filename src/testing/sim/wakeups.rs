//! Wake-ups in the simulation (see `crate::driver::notify`): a release
//! that deletes a key publishes it to the clients that wait for it, each
//! message lost and duplicated as the network loses and duplicates
//! requests, and delayed as replies are. The production engine waits on
//! them through [`Watch`]; the quorum decides, so the checkers hold
//! whatever the messages do, and the workload's bounds on every call's
//! wait (`check_wait`) bound the waits.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
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
            self.push(at, Event::Notify(chan.clone(), notice, node));
            if self.rng.chance(self.net.dup) {
                self.wakes.doubled += 1;
                let later = at + self.delay();
                self.push(later, Event::Notify(chan, notice, node));
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
                let node = self.rng.below(self.nodes.len() as u64) as usize;
                self.push(at, Event::Notify(chan.clone(), notice, node));
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
            seen: 0,
            again: 0,
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
        let mut parts = Vec::with_capacity(resources.len());
        let mut chans = Vec::with_capacity(resources.len());
        for r in resources {
            // (Subscribed as a lone waiter would be; its watch is dropped.)
            let _ = self.watch(sched, r, false)?;
            let part = Arc::new(crate::clock::Signal::default());
            let c = self.chans.lock().get(*r).cloned()?;
            {
                let mut also = c.also.lock();
                also.retain(|s| s.strong_count() > 0);
                also.push(Arc::downgrade(&signal));
                also.push(Arc::downgrade(&part));
            }
            chans.push((c, 0));
            parts.push((part, 0, true));
        }
        Some(Box::new(SimWatchAll {
            signal,
            parts,
            chans,
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
            c.mine(notice);
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
    seen: u64,
    /// The channel's wake-ups by a majority after a try, at the mark.
    again: u64,
}

impl Watch for SimWatch {
    fn mark(&mut self) {
        self.chan.tried();
        self.seen = self.chan.signal.seen();
        self.again = self.chan.again.load(Ordering::SeqCst);
    }

    fn wait(&self, until: Instant) -> bool {
        self.sched
            .wait_signal(&self.chan.signal, self.seen, Some(until));
        self.chan.signal.seen() != self.seen
    }

    fn listen_to(&mut self, _keys: &[bool]) {}

    fn again(&self) -> bool {
        let now = self.chan.signal.seen();
        now != self.seen
            && now.wrapping_sub(self.seen)
                == self
                    .chan
                    .again
                    .load(Ordering::SeqCst)
                    .wrapping_sub(self.again)
    }
}

/// A wait for any of several keys: its own signal, which each key's
/// channel also notifies, and one per key (with its count at the mark and
/// whether it is listened to).
struct SimWatchAll {
    signal: Arc<crate::clock::Signal>,
    parts: Vec<(Arc<crate::clock::Signal>, u64, bool)>,
    /// The keys' channels (a try begun is told to each), in the order of
    /// `parts`, with their wake-ups by a majority after a try at the mark.
    chans: Vec<(Arc<SimChan>, u64)>,
    sched: Arc<Sched>,
}

impl SimWatchAll {
    fn woken(&self) -> bool {
        self.parts
            .iter()
            .any(|(s, seen, l)| *l && s.seen() != *seen)
    }
}

impl Watch for SimWatchAll {
    fn mark(&mut self) {
        for (c, again) in &mut self.chans {
            c.tried();
            *again = c.again.load(Ordering::SeqCst);
        }
        for (s, seen, _) in &mut self.parts {
            *seen = s.seen();
        }
    }

    fn wait(&self, until: Instant) -> bool {
        loop {
            if self.woken() {
                return true;
            }
            // Any key's wake-up ends the wait; one not listened to waits on.
            let any = self.signal.seen();
            self.sched.wait_signal(&self.signal, any, Some(until));
            if self.signal.seen() == any {
                return false;
            }
        }
    }

    fn listen_to(&mut self, keys: &[bool]) {
        if keys.len() == self.parts.len() {
            for ((_, _, l), k) in self.parts.iter_mut().zip(keys) {
                *l = *k;
            }
        }
    }

    fn again(&self) -> bool {
        let mut woken = self
            .parts
            .iter()
            .zip(&self.chans)
            .filter(|((s, seen, l), _)| *l && s.seen() != *seen)
            .peekable();
        woken.peek().is_some()
            && woken.all(|((s, seen, _), (c, again))| {
                s.seen().wrapping_sub(*seen) == c.again.load(Ordering::SeqCst).wrapping_sub(*again)
            })
    }
}
