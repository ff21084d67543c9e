//! What the connections learnt about the nodes' servers: which entries
//! are one server (listed twice), and which nodes cannot keep locks.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use log::{info, warn};
use parking_lot::Mutex;

use crate::algorithm::round::{ServerKind, ServerTag};
use crate::algorithm::server::{id_hash, ServerInfo};

/// What the connections learnt about the nodes' servers, one entry per
/// node, for telling the entries apart (one server listed twice) and for
/// naming the nodes that cannot keep locks, each once.
pub(crate) struct Servers {
    pub(crate) names: Vec<String>,
    pub(crate) known: Mutex<Vec<Known>>,
    /// Some entry has a twin (read without the lock on every round).
    pub(crate) any_twin: AtomicBool,
    /// Per entry, the last history id learnt (0: none), without the lock.
    pub(crate) histories: Vec<AtomicU64>,
    /// Evicting nodes vote (`Builder::allow_evicting_nodes`): what their
    /// warning says.
    allow_evicting: bool,
    /// Per entry, the key of the lock history a connection last learnt at
    /// connect (0: none had begun; [`UNREAD`]: no connect answered yet).
    pub(crate) begun: Vec<AtomicU64>,
    /// How many lock histories this client's acquire scripts have read, on
    /// every node (see [`Read::gen`](crate::algorithm::restart::Read)).
    reads: AtomicU64,
}

/// [`Servers::begun`]: no connection's setup has been answered yet.
const UNREAD: u64 = u64::MAX;

/// What is known of one node's server.
#[derive(Default, Clone)]
pub(crate) struct Known {
    /// The hash of its `run_id` (`INFO` at connect).
    pub(crate) run: Option<u64>,
    /// The hash of its lock history's id.
    pub(crate) history: Option<u64>,
    /// What was logged of it last: its kind (a replica, a cluster node, an
    /// evicting node), or `None` for `INFO` refused; once per change.
    pub(crate) told: Option<Option<ServerKind>>,
    /// The entry found to reach the same server, with a lower index.
    pub(crate) twin: Option<usize>,
    /// A pair with this entry was logged.
    pub(crate) warned_twin: bool,
}

impl Servers {
    pub(crate) fn new(names: Vec<String>, allow_evicting: bool) -> Self {
        let known = Mutex::new(vec![Known::default(); names.len()]);
        Servers {
            histories: names.iter().map(|_| AtomicU64::new(0)).collect(),
            begun: names.iter().map(|_| AtomicU64::new(UNREAD)).collect(),
            names,
            known,
            any_twin: AtomicBool::new(false),
            allow_evicting,
            reads: AtomicU64::new(0),
        }
    }

    /// A script read a node's lock history: its generation (see
    /// [`Read::gen`](crate::algorithm::restart::Read)).
    pub(crate) fn next_read(&self) -> u64 {
        self.reads.fetch_add(1, Ordering::SeqCst) + 1
    }

    /// The generation of the last read made: loaded before the reads are,
    /// so that each read at or below it was seen.
    pub(crate) fn reads_made(&self) -> u64 {
        self.reads.load(Ordering::SeqCst)
    }

    /// Node `i`'s `INFO` was read: `Ok` with what it says, or `Err` with
    /// why it was refused.
    pub(crate) fn learn_info(&self, i: usize, info: &Result<ServerInfo, String>) {
        let name = &self.names[i];
        let mut known = self.known.lock();
        let k = &mut known[i];
        let now = info.as_ref().ok().map(ServerInfo::kind);
        // Logged when it changes (INFO is read again now and then: a replica
        // promoted, a policy changed at runtime), a fit node only after an
        // unfit one.
        let first = k.told != Some(now) && !(k.told.is_none() && now == Some(ServerKind::Fit));
        k.told = Some(now);
        match info {
            Ok(info) => {
                k.run = info.run_id.as_deref().map(|r| id_hash(r.as_bytes()));
                if first {
                    match info.kind() {
                        ServerKind::Fit => info!("node {name}: now a primary that keeps its keys; its answers count"),
                        ServerKind::Replica => warn!(
                            "node {name} is a replica (role:{}): it cannot keep locks of its own; its answers are not counted",
                            info.role.as_deref().unwrap_or("?")
                        ),
                        ServerKind::Cluster => warn!(
                            "node {name} is a Redis Cluster node (cluster_enabled:1), not an independent server: its answers are not counted"
                        ),
                        ServerKind::Evicting(_) if self.allow_evicting => warn!(
                            "node {name} has maxmemory {} with maxmemory-policy {}: under memory pressure it can evict lock keys, and a second client then takes a held lock; its answers count (Builder::allow_evicting_nodes(true)); set maxmemory-policy noeviction",
                            info.maxmemory.unwrap_or(0),
                            info.policy.as_deref().unwrap_or("?")
                        ),
                        ServerKind::Evicting(_) => warn!(
                            "node {name} has maxmemory {} with maxmemory-policy {}: under memory pressure it can evict lock keys, and a second client then takes a held lock; it does not vote; set maxmemory-policy noeviction (or Builder::allow_evicting_nodes(true) to count it anyway)",
                            info.maxmemory.unwrap_or(0),
                            info.policy.as_deref().unwrap_or("?")
                        ),
                    }
                }
            }
            Err(why) => {
                if first {
                    info!(
                        "node {name}: INFO refused ({why}): this client cannot tell by run_id whether two entries are one server, nor see a replica, a cluster node or an evicting policy, nor cap a lock history's age at the server's uptime (a node restarted from a snapshot); grant the lock user +info"
                    );
                }
            }
        }
        self.pair(&mut known, i);
    }

    /// Node `i`'s lock history has the id whose hash is `history` (read on
    /// every acquire reply: the lock is taken only when it changed).
    pub(crate) fn learn_history(&self, i: usize, history: u64) {
        if self.histories[i].swap(history, Ordering::Relaxed) == history {
            return;
        }
        let mut known = self.known.lock();
        if known[i].history != Some(history) {
            known[i].history = Some(history);
            self.pair(&mut known, i);
        }
    }

    /// A connection to node `i` learnt at connect that its lock history
    /// has the key `key` (0: none has begun).
    pub(crate) fn learn_begun(&self, i: usize, key: u64) {
        if let Some(b) = self.begun.get(i) {
            b.store(key, Ordering::Relaxed);
        }
    }

    /// Whether a connection to node `i` has answered its setup (the lock
    /// history, the last of its connect commands).
    pub(crate) fn begun_read(&self, i: usize) -> bool {
        self.begun
            .get(i)
            .is_some_and(|b| b.load(Ordering::Relaxed) != UNREAD)
    }

    /// Per entry, the key of the lock history learnt at connect (0: none,
    /// or not known yet).
    pub(crate) fn begun_keys(&self) -> Vec<u64> {
        self.begun
            .iter()
            .map(|b| {
                Some(b.load(Ordering::Relaxed))
                    .filter(|&k| k != UNREAD)
                    .unwrap_or(0)
            })
            .collect()
    }

    /// Finds, again, every entry's twin (the first earlier entry that is
    /// the same server, as [`ServerTag::same_server`] decides: what one
    /// node learnt may make or unmake a pair); logs a new pair once.
    pub(crate) fn pair(&self, known: &mut [Known], _i: usize) {
        let tag = |k: &Known| ServerTag {
            run: k.run,
            history: k.history,
            kind: ServerKind::Fit,
        };
        let mut any = false;
        for b in 0..known.len() {
            let twin = (0..b).find(|&a| tag(&known[a]).same_server(&tag(&known[b])));
            if twin.is_some() && known[b].twin != twin && !known[b].warned_twin {
                known[b].warned_twin = true;
                if let Some(a) = twin {
                    warn!(
                        "nodes {} and {} are one server (listed twice: two names, or two databases of it): Redlock needs independent servers; its answers are counted once",
                        self.names[a], self.names[b]
                    );
                }
            }
            known[b].twin = twin;
            any |= twin.is_some();
        }
        self.any_twin.store(any, Ordering::Relaxed);
    }

    /// The node's history id, if known (for answers without one).
    pub(crate) fn history(&self, i: usize) -> Option<u64> {
        Some(self.histories[i].load(Ordering::Relaxed)).filter(|h| *h != 0)
    }

    /// Per entry, whether it is known to reach the same server as an
    /// earlier one (empty when no entry is: the usual case, no allocation).
    pub(crate) fn twin_mask(&self) -> Vec<bool> {
        if !self.any_twin.load(Ordering::Relaxed) {
            return Vec::new();
        }
        self.known.lock().iter().map(|k| k.twin.is_some()).collect()
    }

    /// The first pair of entries found to reach one server.
    pub(crate) fn twins(&self) -> Option<(usize, usize)> {
        let known = self.known.lock();
        known
            .iter()
            .enumerate()
            .find_map(|(b, k)| k.twin.map(|a| (a, b)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the connections learn of the servers is logged once per node (a
    /// node reconnects often: one warning, not one per connection), and two
    /// entries with one id are a pair, found by either id.
    #[test]
    fn servers_are_named_once_and_twins_found_by_either_id() {
        let logs = crate::testing::logs::capture_logs();
        let names: Vec<String> = ["a:1", "b:1", "c:1"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let servers = Servers::new(names, false);
        let evicting = ServerInfo::parse(
            "run_id:r0\nrole:master\nmaxmemory:1048576\nmaxmemory_policy:allkeys-lru\n",
        );
        for _ in 0..3 {
            servers.learn_info(0, &Ok(evicting.clone()));
        }
        servers.learn_info(1, &Err("NOPERM".into()));
        let warned: Vec<String> = logs
            .take()
            .into_iter()
            .filter(|(l, _)| *l <= log::Level::Info)
            .map(|(_, m)| m)
            .collect();
        assert_eq!(warned.len(), 2, "{warned:?}");
        assert!(warned[0].contains("allkeys-lru"), "{warned:?}");
        assert!(warned[1].contains("+info"), "{warned:?}");
        assert!(servers.twins().is_none());
        assert!(
            servers.twin_mask().is_empty(),
            "no allocation without twins"
        );
        // Entry 1 (no INFO) shares entry 2's lock history; entry 2 has a run id.
        servers.learn_history(1, 7);
        servers.learn_info(2, &Ok(ServerInfo::parse("run_id:r2\nrole:master\n")));
        servers.learn_history(2, 7);
        assert_eq!(servers.twins(), Some((1, 2)));
        assert_eq!(servers.twin_mask(), [false, false, true]);
        let pair = logs.take();
        assert_eq!(
            pair.iter()
                .filter(|(l, m)| *l == log::Level::Warn && m.contains("one server"))
                .count(),
            1,
            "{pair:?}"
        );
    }

    /// An evicting node is warned of once per change, and the warning says
    /// that it does not vote and what to set; a node that keeps its keys is
    /// never warned of, however often its `INFO` is read again.
    #[test]
    fn an_evicting_node_is_warned_of_once_per_change_and_a_fit_one_never() {
        let logs = crate::testing::logs::capture_logs();
        let names: Vec<String> = ["e:1", "f:1"].iter().map(|s| s.to_string()).collect();
        let servers = Servers::new(names, false);
        let info = |policy: &str| {
            ServerInfo::parse(&format!(
                "run_id:r0\nrole:master\nmaxmemory:104857600\nmaxmemory_policy:{policy}\n"
            ))
        };
        let fit =
            ServerInfo::parse("run_id:r1\nrole:master\nmaxmemory:0\nmaxmemory_policy:noeviction\n");
        let warnings = |logs: &crate::testing::logs::Records| -> Vec<String> {
            logs.take()
                .into_iter()
                .filter(|(l, _)| *l <= log::Level::Warn)
                .map(|(_, m)| m)
                .collect()
        };
        // The happy path: INFO read at connect and again every few seconds.
        for _ in 0..5 {
            servers.learn_info(1, &Ok(fit.clone()));
        }
        assert_eq!(warnings(&logs), Vec::<String>::new());
        // Switched to an evicting policy: one warning, however many re-reads.
        for _ in 0..5 {
            servers.learn_info(0, &Ok(info("allkeys-lru")));
        }
        let w = warnings(&logs);
        assert_eq!(w.len(), 1, "{w:?}");
        for words in [
            "e:1",
            "allkeys-lru",
            "does not vote",
            "maxmemory-policy noeviction",
            "allow_evicting_nodes(true)",
        ] {
            assert!(w[0].contains(words), "{words:?} not in {w:?}");
        }
        // Back to noeviction: said once, not at warn level.
        let fit0 = ServerInfo::parse(
            "run_id:r0\nrole:master\nmaxmemory:104857600\nmaxmemory_policy:noeviction\n",
        );
        for _ in 0..3 {
            servers.learn_info(0, &Ok(fit0.clone()));
        }
        assert_eq!(warnings(&logs), Vec::<String>::new());
        // Another evicting policy: a change, warned of again.
        servers.learn_info(0, &Ok(info("volatile-lrm")));
        servers.learn_info(0, &Ok(info("volatile-lrm")));
        let w = warnings(&logs);
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(w[0].contains("volatile-lrm"), "{w:?}");
        // With the opt-in the node votes, and the warning says so.
        let names: Vec<String> = vec!["a:1".to_owned()];
        let allowed = Servers::new(names, true);
        allowed.learn_info(0, &Ok(info("allkeys-lru")));
        allowed.learn_info(0, &Ok(info("allkeys-lru")));
        let w = warnings(&logs);
        assert_eq!(w.len(), 1, "{w:?}");
        for words in ["allkeys-lru", "its answers count", "noeviction"] {
            assert!(w[0].contains(words), "{words:?} not in {w:?}");
        }
    }
}
