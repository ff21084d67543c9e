//! What [`Redlock::inspect`](crate::Redlock::inspect) reports: one node's
//! copy of a lock key, a writer's token or a set of readers.

use std::fmt;
use std::time::Duration;

use crate::error::NodeError;
use crate::lock::transport::Stored;

/// One node's copy of a lock key, from [`Redlock::inspect`](crate::Redlock::inspect).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeKey {
    node: String,
    key: std::result::Result<Option<KeyInfo>, NodeError>,
}

impl NodeKey {
    pub(crate) fn new(node: String, key: std::result::Result<Option<Stored>, NodeError>) -> Self {
        NodeKey {
            node,
            key: key.map(|k| k.map(KeyInfo::from)),
        }
    }

    /// The node's address, `host:port` (with `/db` when not 0).
    pub fn node(&self) -> &str {
        &self.node
    }

    /// The key on this node: `Ok(None)` when it does not exist, `Err` when
    /// the node could not be asked.
    pub fn key(&self) -> std::result::Result<Option<&KeyInfo>, &NodeError> {
        self.key.as_ref().map(Option::as_ref)
    }
}

/// A lock key as one node stores it: a writer's token, or the set of
/// readers of a read lock ([`is_read`](Self::is_read)).
///
/// `Debug` hides the tokens: a token is what lets its owner release or
/// extend the lock, so it is printed only when asked for
/// ([`token`](Self::token), [`ReaderInfo::token`]).
#[derive(Clone, PartialEq, Eq)]
pub struct KeyInfo {
    lock: bool,
    token: String,
    ttl: Option<Duration>,
    set: Option<ReaderSet>,
    claim: bool,
}

/// The reader set's live entries.
#[derive(Clone, PartialEq, Eq)]
struct ReaderSet {
    readers: Vec<ReaderInfo>,
    intent: Option<Duration>,
}

impl KeyInfo {
    /// The stored token (the value a holder's [`LockGuard::token`](crate::LockGuard::token)
    /// starts with; after a hand-over it carries a section suffix). Empty
    /// for a set of readers: each reader has its own
    /// ([`readers`](Self::readers)).
    pub fn token(&self) -> &str {
        &self.token
    }

    /// Remaining time to live on this node's clock; `None` for a key
    /// without expiry (not one this crate wrote). For a set of readers,
    /// the set's own remaining life: as long as its longest-lived entry
    /// (a reader or a waiting writer's intent), give or take the
    /// entries' expiries the node has not yet dropped; each reader's own
    /// time is [`ReaderInfo::ttl`].
    pub fn ttl(&self) -> Option<Duration> {
        self.ttl
    }

    /// Whether the key is a lock's: a writer's token or a set of readers
    /// this crate wrote. `false` for any other value under the lock's name
    /// (an application's string, hash, list, set, sorted set or stream):
    /// no lock takes it, reads it as readers or changes it, and its value
    /// is not reported here ([`token`](Self::token) is empty). A string of
    /// a token's shape (32 lowercase hex digits, as a UUID or an MD5 digest
    /// may be) cannot be told from a lock's here and is reported as one;
    /// the scripts still never take it (they compare whole tokens).
    pub fn is_lock(&self) -> bool {
        self.lock
    }

    /// Whether the key is a set of readers (a resource read-locked, see
    /// [`LockRequest::read`](crate::LockRequest::read), or
    /// awaited by a writer while readers held it) rather than a writer's
    /// token. A set may have no live reader left: then it is free, for a
    /// writer at once and for readers once no writer waits.
    pub fn is_read(&self) -> bool {
        self.set.is_some()
    }

    /// The set's live readers, each with its token and time left on this
    /// node, longest-lived first (entries whose expiry has passed are left
    /// out: they count for nobody). Empty for a writer's key.
    ///
    /// ```no_run
    /// # let locks = quorumlock::Redlock::builder().node("redis://127.0.0.1:6379").build()?;
    /// for node in locks.inspect("report:2026")? {
    ///     if let Ok(Some(key)) = node.key() {
    ///         for reader in key.readers() {
    ///             println!("{}: a reader, {:?} left", node.node(), reader.ttl());
    ///         }
    ///     }
    /// }
    /// # Ok::<(), quorumlock::Error>(())
    /// ```
    pub fn readers(&self) -> &[ReaderInfo] {
        self.set.as_ref().map_or(&[], |s| &s.readers)
    }

    /// A waiting writer's intent on this node, and how long it still keeps
    /// new readers out (a writer that waits for readers to leave marks it
    /// at each try, to last until its next one: its retry pause and a few
    /// node timeouts, never past its call's wait); `None` when no writer waits here
    /// (always for a writer's key).
    pub fn writer_waiting(&self) -> Option<Duration> {
        self.set.as_ref().and_then(|s| s.intent)
    }

    /// A waiting lock of several resources' claim on this free key, and
    /// how long it still lasts: no lock holds the key, and calls that
    /// began after that lock's keep out of it until the lock gets in or
    /// the claim ends (see the guide's "Locks of several resources").
    /// `None` when no such lock claims it.
    pub fn set_waiting(&self) -> Option<Duration> {
        if self.claim {
            self.ttl
        } else {
            None
        }
    }
}

impl From<Stored> for KeyInfo {
    fn from(s: Stored) -> Self {
        KeyInfo {
            lock: s.lock,
            claim: s.claim,
            token: s.value,
            ttl: s.ttl,
            set: s.readers.map(|r| ReaderSet {
                readers: r
                    .live
                    .into_iter()
                    .map(|(token, ttl)| ReaderInfo { token, ttl })
                    .collect(),
                intent: r.intent,
            }),
        }
    }
}

impl fmt::Debug for KeyInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("KeyInfo");
        match &self.set {
            None if !self.lock => d.field("lock", &false).field("ttl", &self.ttl),
            None if self.claim => d.field("set_waiting", &self.ttl),
            None => d.field("token", &"<hidden>").field("ttl", &self.ttl),
            Some(s) => d
                .field("ttl", &self.ttl)
                .field("readers", &s.readers)
                .field("writer_waiting", &s.intent),
        };
        d.finish()
    }
}

/// One live reader in a node's set of readers ([`KeyInfo::readers`]).
///
/// `Debug` hides the token, as [`KeyInfo`]'s does.
#[derive(Clone, PartialEq, Eq)]
pub struct ReaderInfo {
    token: String,
    ttl: Duration,
}

impl ReaderInfo {
    /// The reader's token (its [`LockGuard::token`](crate::LockGuard::token),
    /// beginning with `r`).
    pub fn token(&self) -> &str {
        &self.token
    }

    /// How long the reader's entry still lives on this node's clock.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }
}

impl fmt::Debug for ReaderInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReaderInfo")
            .field("token", &"<hidden>")
            .field("ttl", &self.ttl)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lock::transport::Readers;

    #[test]
    fn debug_hides_every_token() {
        let writer = KeyInfo::from(Stored {
            lock: true,
            value: "secret-writer".into(),
            ttl: Some(Duration::from_secs(3)),
            readers: None,
            claim: false,
            term: None,
        });
        assert!(!writer.is_read() && writer.readers().is_empty());
        assert_eq!(writer.writer_waiting(), None);
        let set = KeyInfo::from(Stored {
            lock: true,
            value: String::new(),
            ttl: Some(Duration::from_secs(9)),
            readers: Some(Readers {
                live: vec![("rsecret-reader".into(), Duration::from_secs(9))],
                intent: Some(Duration::from_millis(300)),
            }),
            claim: false,
            term: None,
        });
        assert!(set.is_read());
        assert_eq!(set.readers()[0].token(), "rsecret-reader");
        assert_eq!(set.writer_waiting(), Some(Duration::from_millis(300)));
        for shown in [format!("{writer:?}"), format!("{set:?}")] {
            assert!(!shown.contains("secret"), "{shown}");
            assert!(shown.contains("<hidden>"), "{shown}");
        }
    }
}
