//! How a waiting round is woken: [`Wake`], and the count of the replies
//! read for it that decides when ([`ReplyCount`]).

use std::sync::atomic::Ordering;

use super::sync;

/// Wakes a round that waits on its mailbox.
pub(crate) trait Wake: Send + Sync {
    /// Wakes it (a wake while it is not waiting makes its next wait return).
    fn wake(&self);
    /// Whether it wakes the calling thread, which is awake and looks at its
    /// mailboxes before it waits again: no wake is sent.
    fn is_current(&self) -> bool {
        false
    }
    /// The count of the replies read for its round, which wakes it only
    /// at the number it needs; none: every reply wakes it.
    fn replies(&self) -> Option<&ReplyCount> {
        None
    }
}

impl Wake for crate::clock::Signal {
    fn wake(&self) {
        self.notify();
    }
}

/// Replies read for a round since it last looked, and how many it needs
/// before it is woken (see [`Wake::replies`]). Either a reply counted sees the
/// round's new need, or the round sees the reply counted (both sequentially
/// consistent), so no wake is lost.
#[derive(Default)]
pub(crate) struct ReplyCount {
    replies: sync::AtomicUsize,
    needs: sync::AtomicUsize,
}

impl ReplyCount {
    /// Counts a reply; whether the round needs no more.
    pub(crate) fn count(&self) -> bool {
        let n = self.replies.fetch_add(1, Ordering::SeqCst) + 1;
        n >= self.needs.load(Ordering::SeqCst)
    }

    /// Counts from none, and wakes for none until [`ReplyCount::expect`].
    pub(crate) fn recount(&self) {
        self.needs.store(usize::MAX, Ordering::SeqCst);
        self.replies.store(0, Ordering::SeqCst);
    }

    /// The round needs `n`; whether they were counted already.
    pub(crate) fn expect(&self, n: usize) -> bool {
        self.needs.store(n, Ordering::SeqCst);
        self.replies.load(Ordering::SeqCst) >= n
    }
}
