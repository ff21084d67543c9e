//! [`Redlock::check`](crate::Redlock::check): an audit of the node list, the
//! way the client judges nodes at connect and more, with a verdict per node
//! and for the set.
//!
//! The driver gathers the facts
//! ([`Probe`](crate::lock::transport::Probe), one per node, each on a
//! connection of its own); [`assess()`] turns them into findings, a pure
//! function of the facts, so that every rule here is the one the rounds
//! apply ([`ServerInfo::kind`](crate::algorithm::server::ServerInfo::kind))
//! and can be tested without a server.

use std::fmt;
use std::time::Duration;

mod assess;

pub(crate) use assess::assess;

/// How a finding bears on using the node (or the set) for Redlock.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
#[non_exhaustive]
pub enum Verdict {
    /// Fine, or a fact worth knowing.
    Ok,
    /// Works, with a risk or a cost worth fixing (a slow node, clocks far
    /// apart, a check the ACL did not allow).
    Warn,
    /// The node cannot take part in a lock (unreachable, the ACL refuses
    /// the scripts): a failure the quorum must absorb.
    Fail,
    /// The node (or the set) can give two holders of one lock: a replica,
    /// a cluster node, an evicting memory policy, one server listed twice.
    Unsafe,
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Verdict::Ok => "ok",
            Verdict::Warn => "warn",
            Verdict::Fail => "FAIL",
            Verdict::Unsafe => "UNSAFE",
        })
    }
}

/// One thing [`Redlock::check`](crate::Redlock::check) found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    verdict: Verdict,
    topic: &'static str,
    text: String,
}

impl Finding {
    fn new(verdict: Verdict, topic: &'static str, text: impl Into<String>) -> Self {
        Finding {
            verdict,
            topic,
            text: text.into(),
        }
    }

    /// What it means for Redlock.
    pub fn verdict(&self) -> Verdict {
        self.verdict
    }

    /// What it is about: `connect`, `credentials`, `identity`, `role`, `cluster`,
    /// `memory`, `persistence`, `clock`, `latency`, `scripts`, `nodes`.
    pub fn topic(&self) -> &'static str {
        self.topic
    }

    /// What was found, and what it means.
    pub fn text(&self) -> &str {
        &self.text
    }
}

/// One line: the verdict, the topic and the text, in columns.
impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:<6} {:<12} {}",
            self.verdict.to_string(),
            self.topic,
            self.text
        )
    }
}

/// What [`Redlock::check`](crate::Redlock::check) found on one node.
#[derive(Debug, Clone)]
pub struct NodeCheck {
    node: String,
    findings: Vec<Finding>,
    round_trip: Option<Duration>,
    clock_offset_us: Option<i64>,
}

impl NodeCheck {
    /// The node's address (`host:port`, with `/db` when not 0).
    pub fn node(&self) -> &str {
        &self.node
    }

    /// Every finding, in the order checked.
    pub fn findings(&self) -> &[Finding] {
        &self.findings
    }

    /// The worst verdict among the findings.
    pub fn verdict(&self) -> Verdict {
        worst(&self.findings)
    }

    /// The median of a few `PING` round trips, when the node answered.
    pub fn round_trip(&self) -> Option<Duration> {
        self.round_trip
    }

    /// The node's clock (`TIME`) minus this machine's, in microseconds,
    /// measured in one round trip (off by at most half of it).
    pub fn clock_offset_micros(&self) -> Option<i64> {
        self.clock_offset_us
    }

    fn usable(&self) -> bool {
        self.verdict() <= Verdict::Warn
    }
}

/// The result of [`Redlock::check`](crate::Redlock::check): each node's
/// findings and the set's. Its `Display` is the report `quorumlock check`
/// prints.
#[derive(Debug, Clone)]
pub struct Check {
    nodes: Vec<NodeCheck>,
    findings: Vec<Finding>,
    quorum: usize,
}

impl Check {
    /// One entry per node, in the builder's order.
    pub fn nodes(&self) -> &[NodeCheck] {
        &self.nodes
    }

    /// What was found about the set as a whole (independence, how many
    /// nodes are usable, clocks against each other).
    pub fn findings(&self) -> &[Finding] {
        &self.findings
    }

    /// Whether the set is safe for Redlock: no finding anywhere can give two
    /// holders, and at least a majority of the nodes is usable.
    pub fn is_safe(&self) -> bool {
        self.usable() >= self.quorum
            && worst(&self.findings) < Verdict::Unsafe
            && self.nodes.iter().all(|n| n.verdict() < Verdict::Unsafe)
    }

    /// Whether some node is not usable (unreachable, refusing the
    /// credentials or the scripts, or unsafe): a set that is still safe
    /// absorbs fewer node failures than it was built for. `quorumlock
    /// check` exits 1 for a safe set that is degraded.
    pub fn is_degraded(&self) -> bool {
        self.usable() < self.nodes.len()
    }

    /// How many nodes can take part in a lock (no finding worse than a
    /// warning).
    pub fn usable(&self) -> usize {
        self.nodes.iter().filter(|n| n.usable()).count()
    }

    /// How many nodes could be reached at all.
    pub fn reachable(&self) -> usize {
        self.nodes
            .iter()
            .filter(|n| n.findings.iter().all(|f| f.topic != "connect"))
            .count()
    }
}

impl fmt::Display for Check {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for n in &self.nodes {
            writeln!(f, "{}  {}", n.node, n.verdict())?;
            for x in &n.findings {
                writeln!(f, "  {x}")?;
            }
        }
        writeln!(f, "set")?;
        for x in &self.findings {
            writeln!(f, "  {x}")?;
        }
        let (usable, n) = (self.usable(), self.nodes.len());
        if !self.is_safe() {
            f.write_str("verdict: NOT safe for Redlock")
        } else if usable < n {
            // Safe now; say how many more failures it takes to stop locks.
            let spare = usable - self.quorum;
            write!(
                f,
                "verdict: degraded: {usable} of {n} nodes usable, {} needed: ",
                self.quorum
            )?;
            match spare {
                0 => f.write_str("one more node failure and no lock can be taken"),
                1 => f.write_str("locks survive one more node failure"),
                s => write!(f, "locks survive {s} more node failures"),
            }
        } else {
            f.write_str("verdict: safe for Redlock")
        }
    }
}

pub(super) fn worst(findings: &[Finding]) -> Verdict {
    findings
        .iter()
        .map(|f| f.verdict)
        .max()
        .unwrap_or(Verdict::Ok)
}
