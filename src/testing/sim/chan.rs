//! What a simulated release's message reaches: one client's wake-ups for
//! one key (see [`crate::testing::sim::wakeups`]), and their counts.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::driver::notify::Heard;

use crate::clock::Signal;

/// One client's wake-ups for one key.
#[derive(Default)]
pub(crate) struct SimChan {
    pub(crate) signal: Arc<Signal>,
    /// The waits for any of several keys (locks of several resources)
    /// this key's wake-ups also reach.
    pub(crate) also: Mutex<Vec<std::sync::Weak<Signal>>>,
    /// The last notices delivered (a release's copies wake once).
    recent: Mutex<crate::driver::notify::Notices<u64>>,
    /// Wake-ups by a notice's majority after a try began (see
    /// [`Heard::Majority`]).
    pub(crate) again: AtomicU64,
}

impl SimChan {
    /// A message from node `node` of `nodes` arrives: whether it woke the
    /// waiters (see [`Notices::heard`](crate::driver::notify::Notices::heard)).
    pub(crate) fn deliver(&self, notice: u64, (node, nodes): (usize, usize)) -> bool {
        let heard = self.recent.lock().heard(notice, node, nodes);
        let new = heard != Heard::Nothing;
        if heard == Heard::Majority {
            self.again.fetch_add(1, Ordering::SeqCst);
        }
        if new {
            self.signal.notify();
            self.wake_sets();
        }
        new
    }

    /// Wakes the waits for several keys this key is one of.
    pub(crate) fn wake_sets(&self) {
        self.also.lock().retain(|s| match s.upgrade() {
            Some(s) => {
                s.notify();
                true
            }
            None => false,
        });
    }

    /// A waiter of the key begins a try (see
    /// [`Notices::tried`](crate::driver::notify::Notices::tried)).
    pub(crate) fn tried(&self) {
        self.recent.lock().tried();
    }

    /// This client's own release's `notice`: none of its messages wakes.
    pub(crate) fn mine(&self, notice: u64) {
        self.recent.lock().mine(notice);
    }
}

/// Who waits for which key, per world: `None` when the run has no
/// wake-ups (the clients poll, as before).
pub(crate) type Subscribers = Option<BTreeMap<String, Vec<Arc<SimChan>>>>;

/// A run's wake-ups delivered, and release messages lost and doubled.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct WakeStats {
    pub(crate) woken: u64,
    pub(crate) lost: u64,
    pub(crate) doubled: u64,
}
