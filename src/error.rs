//! The crate's error type and per-node failure detail.

use std::fmt;
use std::time::Duration;

/// What went wrong, as one enum callers can match on.
///
/// Every variant carries enough to act on: how many nodes held the lock, which
/// nodes failed and why, or which input was rejected.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum Error {
    /// Another owner holds the resource: `held` of `nodes` nodes refused it.
    ///
    /// Retrying later may succeed.
    Taken {
        /// Nodes seen holding the key for someone else: at least this many
        /// hold it. A round ends as soon as its outcome is decided, and the
        /// nodes that had not answered by then are not counted
        /// (`quorumlock status` may show it held on more).
        held: usize,
        /// Nodes in the cluster.
        nodes: usize,
    },
    /// A majority could not be reached because nodes failed (timed out,
    /// refused the connection, answered with an error).
    NoQuorum {
        /// Nodes that agreed.
        agreed: usize,
        /// Nodes needed for a majority.
        quorum: usize,
        /// Each failed node with the reason.
        failures: Vec<NodeError>,
    },
    /// A majority agreed, but so late that no validity was left: the lock
    /// was released again. Raise the TTL or look at node latency.
    ValidityExhausted {
        /// Time the round took.
        elapsed: Duration,
        /// The TTL asked for.
        ttl: Duration,
    },
    /// The lock expired: release or extend found its keys gone from a
    /// majority, the renewal thread could not extend it in time, or
    /// [`LockGuard::run`](crate::LockGuard::run)'s closure ended after its
    /// deadline.
    Expired,
    /// Release or extend found the key held by another owner on `nodes`
    /// nodes: our lock expired and someone else took it.
    NotOwner {
        /// Nodes seen holding the key for another owner (at least this
        /// many: nodes not awaited are not counted).
        nodes: usize,
    },
    /// The configuration or an argument was rejected before any I/O.
    InvalidInput(InvalidInput),
    /// The election was stopped ([`Election::stop`](crate::Election::stop))
    /// before this candidate was elected.
    Stopped,
    /// Too many nodes refuse the lock's Lua scripts for a majority ever to
    /// agree: their ACL lacks `EVAL`/`EVALSHA` (or a command the scripts
    /// run), or the server has no Lua (Valkey can be built so). Each
    /// refusing node is a failure of kind
    /// [`NodeErrorKind::ScriptsRefused`] with the server's words.
    ///
    /// Not retryable: the nodes' configuration must change. Allow the
    /// client's user `+eval +evalsha +script|load` and the commands of the
    /// minimal ACL in the crate docs' "TLS and ACL users" (read locks need
    /// the sorted-set ones), on servers with Lua.
    ScriptsRefused {
        /// Nodes in the cluster.
        nodes: usize,
        /// Nodes needed for a majority.
        quorum: usize,
        /// Each failed node with the reason (the refusing ones and any
        /// others).
        failures: Vec<NodeError>,
    },
}

impl Error {
    /// Whether trying again later may succeed (contention or node trouble),
    /// as opposed to bad input or a lock that is already gone.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            Error::Taken { .. } | Error::NoQuorum { .. } | Error::ValidityExhausted { .. }
        )
    }
}

impl Error {
    /// The variant's name in `snake_case` (`taken`, `no_quorum`, …): the
    /// `outcome` of the `tracing` feature's spans and of the `metrics`
    /// feature's labels.
    #[cfg(any(feature = "tracing", feature = "metrics"))]
    pub(crate) fn label(&self) -> &'static str {
        match self {
            Error::Taken { .. } => "taken",
            Error::NoQuorum { .. } => "no_quorum",
            Error::ValidityExhausted { .. } => "validity_exhausted",
            Error::Expired => "expired",
            Error::NotOwner { .. } => "not_owner",
            Error::InvalidInput(_) => "invalid_input",
            Error::Stopped => "stopped",
            Error::ScriptsRefused { .. } => "scripts_refused",
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            // (No node's answer named the owner: no count to give.)
            Error::Taken { held: 0, .. } => f.write_str("taken: another owner holds the lock"),
            // Every node seen holding it: exact. Else a lower bound: the
            // round ended without awaiting the rest.
            Error::Taken { held, nodes } if held >= nodes => write!(
                f,
                "taken: another owner holds the lock on {held} of {nodes} nodes"
            ),
            Error::Taken { held, nodes } => write!(
                f,
                "taken: another owner holds the lock on at least {held} of {nodes} nodes"
            ),
            Error::NoQuorum {
                agreed,
                quorum,
                failures,
            } => {
                write!(
                    f,
                    "no quorum: {agreed} {} agreed, {quorum} needed",
                    plural(*agreed)
                )?;
                groups(f, failures.iter())
            }
            Error::ValidityExhausted { elapsed, ttl } => write!(
                f,
                "validity exhausted: the round took {elapsed:?} of a {ttl:?} ttl"
            ),
            Error::Expired => {
                f.write_str("expired: the lock's time ran out (or its keys were deleted)")
            }
            Error::NotOwner { nodes } => write!(
                f,
                "no longer ours: the lock expired and another owner took it on {nodes} {}",
                plural(*nodes)
            ),
            Error::InvalidInput(e) => write!(f, "invalid input: {e}"),
            Error::Stopped => f.write_str("stopped: the election was stopped"),
            Error::ScriptsRefused {
                nodes,
                quorum,
                failures,
            } => {
                let refused = |e: &&NodeError| e.kind == NodeErrorKind::ScriptsRefused;
                let n = failures.iter().filter(refused).count();
                write!(
                    f,
                    "scripts refused: {n} of {nodes} {} refused the lock's Lua scripts or a command they run, and a lock needs {quorum}; \
                     allow the client's user +eval +evalsha +script|load and the commands of the crate docs' minimal ACL \
                     (read locks: the sorted-set ones), on servers with Lua",
                    plural(*nodes)
                )?;
                // The refusals, then the rest as `NoQuorum` lists them.
                list(
                    f,
                    "refused",
                    failures.iter().filter(refused),
                    ToString::to_string,
                )?;
                groups(f, failures.iter().filter(|e| !refused(e)))
            }
        }
    }
}

/// `failures` in groups: failures, then nodes that answered but whose votes
/// do not count, then nodes the round ended without (not failures).
fn groups<'a>(
    f: &mut fmt::Formatter<'_>,
    failures: impl Iterator<Item = &'a NodeError> + Clone,
) -> fmt::Result {
    let failed = failures.clone().filter(|e| e.kind.is_failure());
    let uncounted = failures.clone().filter(|e| e.kind.is_uncounted());
    let unawaited = failures.filter(|e| e.kind == NodeErrorKind::NotAwaited);
    list(f, "failed", failed, ToString::to_string)?;
    list(f, "not counted", uncounted, ToString::to_string)?;
    list(f, "not awaited", unawaited, |e| e.node.clone())
}

/// `node` or `nodes`, for a count of `n`.
fn plural(n: usize) -> &'static str {
    if n == 1 {
        "node"
    } else {
        "nodes"
    }
}

/// `; TITLE: A; B` of `items` shown by `show`, nothing when there is none.
fn list<'a>(
    f: &mut fmt::Formatter<'_>,
    title: &str,
    items: impl Iterator<Item = &'a NodeError>,
    show: impl Fn(&NodeError) -> String,
) -> fmt::Result {
    let shown: Vec<String> = items.map(show).collect();
    if shown.is_empty() {
        return Ok(());
    }
    write!(f, "; {title}: {}", shown.join("; "))
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::InvalidInput(e) => Some(e),
            // `NoQuorum` names every failed node itself.
            _ => None,
        }
    }
}

impl From<InvalidInput> for Error {
    fn from(e: InvalidInput) -> Self {
        Error::InvalidInput(e)
    }
}

/// A configuration value or argument that was rejected, naming the problem.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum InvalidInput {
    /// The builder was given no nodes.
    NoNodes,
    /// A node URL could not be parsed.
    BadNodeUrl {
        /// The URL as given, with its password masked as `***` (in a URL
        /// that does not parse, whatever may hold one: a port or a path
        /// that is no number, a query, a fragment).
        url: String,
        /// Why it was rejected.
        reason: String,
    },
    /// The same server (host and port) was listed twice.
    DuplicateNode(String),
    /// Two entries of the node list reach one server (found once connected:
    /// the same `run_id`, or the same lock history), so that it would get
    /// two votes. Reported by [`Redlock::wait_connected`](crate::Redlock::wait_connected).
    SameServer {
        /// The first entry (`host:port`, no credentials).
        first: String,
        /// The entry that reaches the same server.
        second: String,
    },
    /// A duration setting was zero.
    ZeroDuration(&'static str),
    /// A count setting was zero.
    ZeroCount(&'static str),
    /// The drift factor was not a finite number in `0.0..1.0`.
    DriftFactor(f64),
    /// The renewal fraction was not a finite number in `(0.0, 0.5]`.
    RenewFraction(f64),
    /// The resource name was empty.
    EmptyResource,
    /// The resource name is longer than [`MAX_RESOURCE_LEN`](crate::MAX_RESOURCE_LEN) bytes.
    ResourceTooLong {
        /// Its length in bytes.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The resource name is a key this crate keeps on every node.
    ReservedResource(&'static str),
    /// A read lock was asked of several resources
    /// ([`LockRequest::read`](crate::LockRequest::read) with
    /// [`LockRequest::and`](crate::LockRequest::and)): a read lock is of one
    /// resource; take one read lock per resource, or a write lock of the set.
    ReadOfSeveral,
    /// A lock of several resources names this one more than once.
    DuplicateResource(String),
    /// The names of a lock of several resources are longer, together, than
    /// [`MAX_RESOURCES_LEN`](crate::MAX_RESOURCES_LEN) bytes.
    ResourcesTooLong {
        /// Their total length in bytes.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// A count setting is above the bound this crate accepts.
    CountTooLarge {
        /// Which setting.
        what: &'static str,
        /// The value given.
        value: u64,
        /// The largest value accepted.
        max: u64,
    },
    /// A duration setting is above the bound this crate accepts.
    DurationTooLong {
        /// Which setting.
        what: &'static str,
        /// The value given.
        value: Duration,
        /// The largest value accepted.
        max: Duration,
    },
    /// The TTL was zero.
    ZeroTtl,
    /// The TTL does not exceed the clock-drift allowance, so no lock could
    /// ever be valid.
    TtlTooShort {
        /// The TTL asked for.
        ttl: Duration,
        /// The drift allowance it must exceed.
        allowance: Duration,
    },
    /// The TTL is longer than [`MAX_TTL`](crate::MAX_TTL) (one hour), or
    /// than the client's [`Builder::max_ttl`](crate::Builder::max_ttl).
    TtlTooLong(Duration),
    /// The TLS settings cannot be used: a file that cannot be read or holds
    /// no certificate or key, a key that does not match its certificate.
    Tls(String),
    /// A candidate's id ([`Election::id`](crate::Election::id)) is empty
    /// or longer than [`MAX_ID_LEN`](crate::MAX_ID_LEN) bytes.
    BadCandidateId {
        /// Its length in bytes.
        len: usize,
    },
}

impl fmt::Display for InvalidInput {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            InvalidInput::NoNodes => f.write_str("no nodes configured"),
            InvalidInput::BadNodeUrl { url, reason } => {
                write!(f, "bad node url {url:?}: {reason}")
            }
            InvalidInput::DuplicateNode(n) => write!(f, "node {n} listed twice"),
            InvalidInput::SameServer { first, second } => write!(
                f,
                "nodes {first} and {second} are one server: Redlock needs independent servers, \
                 and this one would get two votes"
            ),
            InvalidInput::ZeroDuration(what) => write!(f, "{what} must be greater than zero"),
            InvalidInput::ZeroCount(what) => write!(f, "{what} must be at least 1"),
            InvalidInput::DriftFactor(x) => {
                write!(f, "drift factor {x} is not a finite number in 0.0..1.0")
            }
            InvalidInput::RenewFraction(x) => {
                write!(f, "renew fraction {x} is not a finite number in (0.0, 0.5]")
            }
            InvalidInput::EmptyResource => f.write_str("resource name is empty"),
            InvalidInput::ResourceTooLong { len, max } => {
                write!(
                    f,
                    "resource name is {len} bytes long; at most {max} are accepted"
                )
            }
            InvalidInput::ReservedResource(name) => {
                write!(f, "resource name {name:?} is reserved by quorumlock")
            }
            InvalidInput::ReadOfSeveral => {
                f.write_str("a read lock is of one resource; several were named")
            }
            InvalidInput::DuplicateResource(name) => {
                write!(f, "resource {name:?} is listed twice in one lock")
            }
            InvalidInput::ResourcesTooLong { len, max } => write!(
                f,
                "the resources' names are {len} bytes long in all; at most {max} are accepted"
            ),
            InvalidInput::CountTooLarge { what, value, max } => {
                write!(f, "{what} {value} is above the largest accepted, {max}")
            }
            InvalidInput::DurationTooLong { what, value, max } => {
                write!(f, "{what} {value:?} is above the largest accepted, {max:?}")
            }
            InvalidInput::ZeroTtl => f.write_str("ttl is zero"),
            InvalidInput::TtlTooShort { ttl, allowance } => write!(
                f,
                "ttl {ttl:?} does not exceed the clock-drift allowance {allowance:?}"
            ),
            InvalidInput::TtlTooLong(ttl) => write!(f, "ttl {ttl:?} is too long"),
            InvalidInput::Tls(why) => write!(f, "TLS settings: {why}"),
            InvalidInput::BadCandidateId { len } => write!(
                f,
                "a candidate's id is {len} bytes long; 1 to {} are accepted",
                crate::MAX_ID_LEN
            ),
        }
    }
}

impl std::error::Error for InvalidInput {}

/// Why one node did not answer usefully.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum NodeErrorKind {
    /// No reply before the deadline (a hung or slow node).
    Timeout,
    /// The node refuses connections, or is unreachable.
    Unavailable,
    /// The connection broke while talking (reset, closed).
    Io,
    /// The server answered with an error.
    Server,
    /// The server's reply was not what the command returns.
    Protocol,
    /// Not waited for: the node's last command timed out, so it counts as
    /// a failed vote at no cost until it answers again (it is sent a trial
    /// command at most every 100 ms).
    Skipped,
    /// Its vote was not counted: the node's lock history is younger than the
    /// longest TTL in use (it is new, or restarted and lost its data), so it
    /// may have forgotten locks that are still held; its votes count again
    /// after that (the Redlock delayed-restart rule).
    Restarted,
    /// Not a failure: the round's outcome was settled before this node's
    /// reply arrived, so it was not waited for (its reply is read later).
    NotAwaited,
    /// The TLS handshake failed: the node's certificate was not trusted
    /// (or not for its name), or the node refused our client certificate or
    /// its absence. The detail says which.
    Tls,
    /// No pooled connection to the node was free before the round ended.
    /// This is the client's own condition (all connections busy, or still
    /// connecting), not the node's: raise
    /// [`pool_size`](crate::Builder::pool_size) if it persists.
    NoConnection,
    /// Not counted: this entry reached the same server as another entry of
    /// the node list (the same `run_id`, or the same lock history), which
    /// already answered. Redlock needs independent servers: one server
    /// listed twice (two names, two databases) must not get two votes.
    SameServer,
    /// The node refused this client's credentials: a wrong password or user
    /// name (`WRONGPASS`), none given where it requires one (`NOAUTH`), or
    /// one given where it has none.
    /// A configuration error: trying again does not help until the node
    /// URL (or the node's ACL) is fixed.
    Auth,
    /// Not counted: the node cannot keep locks as an independent Redlock
    /// node: a replica, a Redis Cluster node, or (unless
    /// [`allow_evicting_nodes`](crate::Builder::allow_evicting_nodes) is
    /// set) a node whose memory policy can evict lock keys. The detail says
    /// which, and what to set.
    Unsuitable,
    /// The node refuses the lock's Lua scripts for good: its ACL lacks
    /// `EVAL`/`EVALSHA` or a command they run (`NOPERM`), the commands are
    /// renamed away, or the server has no Lua. The detail is the server's
    /// words; see [`Error::ScriptsRefused`] for the fix.
    ScriptsRefused,
}

impl NodeErrorKind {
    /// The node answered, but its vote does not count (not a failure of
    /// the node's: what it is, or its lock history's age).
    fn is_uncounted(self) -> bool {
        matches!(
            self,
            NodeErrorKind::Restarted | NodeErrorKind::SameServer | NodeErrorKind::Unsuitable
        )
    }

    /// The node failed: neither a vote that does not count nor a reply
    /// the round did not wait for.
    fn is_failure(self) -> bool {
        !self.is_uncounted() && self != NodeErrorKind::NotAwaited
    }
}

impl fmt::Display for NodeErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            NodeErrorKind::Timeout => "timed out",
            NodeErrorKind::Unavailable => "unavailable",
            NodeErrorKind::Io => "i/o error",
            NodeErrorKind::Server => "server error",
            NodeErrorKind::Protocol => "unexpected reply",
            NodeErrorKind::Skipped => "not answering, not waited for",
            NodeErrorKind::Restarted => "lock history too young to vote",
            NodeErrorKind::NoConnection => "no free connection",
            NodeErrorKind::Tls => "TLS handshake failed",
            NodeErrorKind::NotAwaited => "not awaited",
            NodeErrorKind::SameServer => "same server as another entry",
            NodeErrorKind::Unsuitable => "cannot keep locks",
            NodeErrorKind::ScriptsRefused => "refuses the lock's scripts",
            NodeErrorKind::Auth => "refused the credentials",
        })
    }
}

/// The error beneath a [`NodeError`], shared by its clones.
pub(crate) type Source = std::sync::Arc<dyn std::error::Error + Send + Sync + 'static>;

/// One node's failure: which node (address without credentials), what kind,
/// the message, and (for an I/O failure) the error beneath it, as
/// [`source`](std::error::Error::source).
///
/// ```
/// # fn show(e: &quorumlock::NodeError) {
/// use std::error::Error as _;
/// if let Some(io) = e.source().and_then(|s| s.downcast_ref::<std::io::Error>()) {
///     eprintln!("{}: {:?}", e.node(), io.kind());
/// }
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct NodeError {
    node: String,
    kind: NodeErrorKind,
    detail: String,
    pub(crate) source: Option<Source>,
}

impl NodeError {
    pub(crate) fn new(
        node: impl Into<String>,
        kind: NodeErrorKind,
        detail: impl Into<String>,
    ) -> Self {
        NodeError {
            node: node.into(),
            kind,
            detail: detail.into(),
            source: None,
        }
    }

    /// A failure of `kind` on `node` caused by the I/O error `e` (its
    /// message is the detail).
    pub(crate) fn from_io(node: impl Into<String>, kind: NodeErrorKind, e: std::io::Error) -> Self {
        let detail = e.to_string();
        NodeError::new(node, kind, detail).caused_by(Some(std::sync::Arc::new(e)))
    }

    /// This error with `source` as the error beneath it.
    pub(crate) fn caused_by(mut self, source: Option<Source>) -> Self {
        self.source = source;
        self
    }

    /// The node's address, `host:port` (with `/db` when not 0).
    pub fn node(&self) -> &str {
        &self.node
    }

    /// What kind of failure it was.
    pub fn kind(&self) -> NodeErrorKind {
        self.kind
    }

    /// The underlying message (from the driver or the server).
    pub fn detail(&self) -> &str {
        &self.detail
    }
}

/// Equal when the node, the kind and the message are (the error beneath is
/// not compared).
impl PartialEq for NodeError {
    fn eq(&self, other: &Self) -> bool {
        (&self.node, self.kind, &self.detail) == (&other.node, other.kind, &other.detail)
    }
}

impl Eq for NodeError {}

// The error beneath is only read (shared, never mutated), so a panic cannot
// leave it half-changed: a `NodeError`, and the `Error` holding it, stay
// unwind-safe as they were before they kept a source.
impl std::panic::UnwindSafe for NodeError {}
impl std::panic::RefUnwindSafe for NodeError {}

impl fmt::Display for NodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.node, self.kind)?;
        // (A detail that only repeats the kind, as an I/O error's "timed
        // out", says nothing more.)
        if !self.detail.is_empty() && self.detail != self.kind.to_string() {
            write!(f, " ({})", self.detail)?;
        }
        Ok(())
    }
}

impl std::error::Error for NodeError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_stays_small() {
        // Results of this crate travel through hot paths; keep them cheap to move.
        assert!(
            std::mem::size_of::<Error>() <= 56,
            "{}",
            std::mem::size_of::<Error>()
        );
    }

    #[test]
    fn no_quorum_names_every_failed_node() {
        let e = Error::NoQuorum {
            agreed: 1,
            quorum: 2,
            failures: vec![
                NodeError::new("10.0.0.2:6379", NodeErrorKind::Timeout, ""),
                NodeError::new("10.0.0.3:6379", NodeErrorKind::Unavailable, "refused"),
            ],
        };
        let s = e.to_string();
        assert!(s.contains("10.0.0.2:6379 timed out"), "{s}");
        assert!(s.contains("10.0.0.3:6379 unavailable (refused)"), "{s}");
    }

    /// One node is "1 node", not "1 nodes".
    #[test]
    fn counts_of_one_are_singular() {
        let e = Error::NoQuorum {
            agreed: 1,
            quorum: 2,
            failures: vec![NodeError::new("n2", NodeErrorKind::Timeout, "")],
        };
        let s = e.to_string();
        assert!(s.contains("1 node agreed"), "{s}");
        let s = Error::NotOwner { nodes: 1 }.to_string();
        assert!(s.ends_with("on 1 node"), "{s}");
        let s = Error::NotOwner { nodes: 2 }.to_string();
        assert!(s.ends_with("on 2 nodes"), "{s}");
    }

    /// A round ends once its outcome is decided: a count of nodes seen
    /// holding the key is a lower bound, and says so unless every node
    /// was seen.
    #[test]
    fn taken_counts_what_it_saw_as_a_lower_bound() {
        let s = Error::Taken { held: 2, nodes: 3 }.to_string();
        assert!(s.contains("on at least 2 of 3 nodes"), "{s}");
        let s = Error::Taken { held: 3, nodes: 3 }.to_string();
        assert!(s.contains("on 3 of 3 nodes"), "{s}");
        let s = Error::Taken { held: 0, nodes: 3 }.to_string();
        assert!(!s.contains(" 0 "), "{s}");
    }

    /// Nodes whose replies were not awaited, and nodes whose votes do not
    /// count, are not listed as failed.
    #[test]
    fn no_quorum_lists_only_failures_as_failed() {
        let e = Error::NoQuorum {
            agreed: 0,
            quorum: 2,
            failures: vec![
                NodeError::new("n1", NodeErrorKind::Unavailable, "refused"),
                NodeError::new("n2", NodeErrorKind::Restarted, "history 2s old"),
                NodeError::new("n3", NodeErrorKind::NotAwaited, "settled"),
            ],
        };
        let s = e.to_string();
        let failed = s.split("failed: ").nth(1).unwrap_or_default();
        let failed = failed.split("; ").next().unwrap_or_default();
        assert_eq!(failed, "n1 unavailable (refused)", "{s}");
        assert!(
            s.contains("not counted: n2 lock history too young to vote"),
            "{s}"
        );
        assert!(s.contains("not awaited: n3"), "{s}");
    }

    /// A detail that only repeats the kind is not shown twice.
    #[test]
    fn node_error_does_not_repeat_its_kind() {
        let e = NodeError::new("n1", NodeErrorKind::Timeout, "timed out");
        assert_eq!(e.to_string(), "n1 timed out");
    }

    /// A resource taken before we got it and a lock of ours taken after it
    /// expired are different news; their messages say which.
    #[test]
    fn taken_and_not_owner_read_differently() {
        let taken = Error::Taken { held: 2, nodes: 3 }.to_string();
        let gone = Error::NotOwner { nodes: 2 }.to_string();
        let expired = Error::Expired.to_string();
        assert!(taken.starts_with("taken: "), "{taken}");
        assert!(gone.starts_with("no longer ours: "), "{gone}");
        assert!(taken != gone && gone != expired && taken != expired);
    }
}
