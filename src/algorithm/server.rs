//! What a node says about itself in `INFO`, and what that means for
//! Redlock: whether it is an independent server that keeps its keys.
//!
//! Read by every connection at connect (see [`crate::driver::conn::Conn::connect`]),
//! and again every few seconds on a pooled one (a replica promoted or a
//! memory policy changed at runtime keeps its connections), ahead of its next
//! command. The same reading and the same verdicts serve the rounds (a
//! replica's answers are not votes, see [`crate::algorithm::quorum::insert_vote`]) and
//! [`Redlock::check`](crate::Redlock::check).

use crate::algorithm::round::ServerKind;

/// The fields of `INFO` (default sections) that matter to a lock.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct ServerInfo {
    /// `run_id`: random per server process (all its databases share it).
    pub run_id: Option<String>,
    /// `redis_version` (Valkey reports the Redis version it is compatible
    /// with, 7.2.4, whatever its own).
    pub version: Option<String>,
    /// `server_name` (`valkey`; Redis has none) and `valkey_version`.
    pub server: Option<(String, Option<String>)>,
    /// `role`: `master` or `slave`.
    pub role: Option<String>,
    /// `cluster_enabled:1`.
    pub cluster: Option<bool>,
    /// `maxmemory` in bytes (0: no limit).
    pub maxmemory: Option<u64>,
    pub policy: Option<String>,
    /// `aof_enabled:1`.
    pub aof: Option<bool>,
    /// `uptime_in_seconds`.
    pub uptime: Option<u64>,
}

impl ServerInfo {
    /// Parses `INFO`'s text (`key:value` lines; sections and unknown keys
    /// are skipped).
    pub(crate) fn parse(text: &str) -> ServerInfo {
        Self::parse_bytes(text.as_bytes())
    }

    /// [`parse`](Self::parse) on the reply's bytes as they came (no copy;
    /// only the values kept are converted).
    pub(crate) fn parse_bytes(text: &[u8]) -> ServerInfo {
        let mut s = ServerInfo::default();
        let string = |v: &[u8]| Some(String::from_utf8_lossy(v).into_owned());
        let number = |v: &[u8]| std::str::from_utf8(v).ok()?.parse().ok();
        for line in text.split(|b| *b == b'\n') {
            let Some(colon) = line.iter().position(|b| *b == b':') else {
                continue;
            };
            let (k, v) = (&line[..colon], line[colon + 1..].trim_ascii_end());
            let flag = || match v {
                b"1" => Some(true),
                b"0" => Some(false),
                _ => None,
            };
            match k {
                b"run_id" if !v.is_empty() => s.run_id = string(v),
                b"redis_version" => s.version = string(v),
                b"server_name" => {
                    let version = s.server.take().and_then(|(_, v)| v);
                    s.server = string(v).map(|n| (n, version));
                }
                b"valkey_version" => {
                    let name = s
                        .server
                        .take()
                        .map_or_else(|| "valkey".to_owned(), |(n, _)| n);
                    s.server = Some((name, string(v)));
                }
                b"role" => s.role = string(v),
                b"cluster_enabled" => s.cluster = flag(),
                b"maxmemory" => s.maxmemory = number(v),
                b"maxmemory_policy" => s.policy = string(v),
                b"aof_enabled" => s.aof = flag(),
                b"uptime_in_seconds" => s.uptime = number(v),
                _ => {}
            }
        }
        s
    }

    /// The server and its version as its users name them: `Valkey 9.1.2`
    /// (by `server_name`/`valkey_version`, not the Redis version Valkey
    /// reports), `Redis 7.0.15`, or another server's own name.
    pub(crate) fn product(&self) -> String {
        let redis = self.version.as_deref().unwrap_or("?");
        match &self.server {
            None => format!("Redis {redis}"),
            Some((name, version)) => {
                let name = match name.as_str() {
                    "valkey" => "Valkey".to_owned(),
                    other => other.to_owned(),
                };
                let version = version.as_deref().unwrap_or(redis);
                format!("{name} {version}")
            }
        }
    }

    /// What kind of Redlock node this is: a replica or a cluster node can
    /// never keep a lock of its own; a node with a memory limit and a
    /// policy other than `noeviction` can drop lock keys (`volatile-*`
    /// evicts exactly the keys with a TTL, and every lock key has one).
    pub(crate) fn kind(&self) -> ServerKind {
        if self.role.as_deref().is_some_and(|r| r != "master") {
            return ServerKind::Replica;
        }
        if self.cluster == Some(true) {
            return ServerKind::Cluster;
        }
        self.evicting()
            .map_or(ServerKind::Fit, ServerKind::Evicting)
    }

    /// The memory policy, when it can evict lock keys: a memory limit with
    /// any policy but `noeviction` (whatever its name: Redis 8.6 added
    /// `allkeys-lrm` and `volatile-lrm`, and later ones are evicting too).
    pub(crate) fn evicting(&self) -> Option<&'static str> {
        match (self.maxmemory, self.policy.as_deref()) {
            (Some(m), Some(p)) if m > 0 && p != "noeviction" => Some(policy_name(p)),
            _ => None,
        }
    }
}

/// A policy's name as a `'static` string (for [`ServerKind::Evicting`]).
fn policy_name(p: &str) -> &'static str {
    // Redis 8.6 added the `-lrm` (least recently modified) pair.
    const KNOWN: [&str; 9] = [
        "allkeys-lru",
        "allkeys-lfu",
        "allkeys-random",
        "allkeys-lrm",
        "volatile-lru",
        "volatile-lfu",
        "volatile-random",
        "volatile-ttl",
        "volatile-lrm",
    ];
    KNOWN
        .into_iter()
        .find(|k| *k == p)
        .unwrap_or("an evicting policy")
}

/// A stable 64-bit hash of an identity string (FNV-1a): equal ids give equal
/// hashes; two different 160-bit run ids collide with odds of 2^-64.
pub(crate) fn id_hash(id: &[u8]) -> u64 {
    id.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const PRIMARY: &str = "# Server\r\nredis_version:7.0.15\r\nrun_id:8a3f\r\nuptime_in_seconds:42\r\n\r\n# Memory\r\nmaxmemory:0\r\nmaxmemory_policy:noeviction\r\n# Persistence\r\naof_enabled:0\r\n# Replication\r\nrole:master\r\n# Cluster\r\ncluster_enabled:0\r\n";

    #[test]
    fn reads_the_fields_that_matter() {
        let s = ServerInfo::parse(PRIMARY);
        assert_eq!(s.run_id.as_deref(), Some("8a3f"));
        assert_eq!(s.version.as_deref(), Some("7.0.15"));
        assert_eq!(s.uptime, Some(42));
        assert_eq!(s.aof, Some(false));
        assert_eq!(s.kind(), ServerKind::Fit);
    }

    /// Valkey reports `redis_version:7.2.4` whatever its own version; it is
    /// named by `server_name` and `valkey_version`.
    #[test]
    fn the_server_is_named_as_it_names_itself() {
        assert_eq!(ServerInfo::parse(PRIMARY).product(), "Redis 7.0.15");
        let valkey = PRIMARY.replace(
            "redis_version:7.0.15\r\n",
            "redis_version:7.2.4\r\nserver_name:valkey\r\nvalkey_version:9.1.2\r\nvalkey_release_stage:ga\r\n",
        );
        assert_eq!(ServerInfo::parse(&valkey).product(), "Valkey 9.1.2");
        let unnamed = PRIMARY.replace("redis_version", "server_name:valkey\r\nredis_version");
        assert_eq!(ServerInfo::parse(&unnamed).product(), "Valkey 7.0.15");
        let other = PRIMARY.replace("redis_version", "server_name:keydb\r\nredis_version");
        assert_eq!(ServerInfo::parse(&other).product(), "keydb 7.0.15");
    }

    #[test]
    fn replicas_cluster_nodes_and_evicting_policies_are_told_apart() {
        let with = |from: &str, to: &str| ServerInfo::parse(&PRIMARY.replace(from, to)).kind();
        assert_eq!(with("role:master", "role:slave"), ServerKind::Replica);
        assert_eq!(
            with("cluster_enabled:0", "cluster_enabled:1"),
            ServerKind::Cluster
        );
        let evicting = |policy: &str| {
            ServerInfo::parse(
                &PRIMARY
                    .replace("maxmemory:0", "maxmemory:2097152")
                    .replace("noeviction", policy),
            )
            .kind()
        };
        // Every policy but noeviction, Redis 8.6's least-recently-modified
        // ones too, by their names.
        for p in [
            "volatile-lru",
            "volatile-lfu",
            "volatile-random",
            "volatile-ttl",
            "volatile-lrm",
            "allkeys-lru",
            "allkeys-lfu",
            "allkeys-random",
            "allkeys-lrm",
        ] {
            assert_eq!(evicting(p), ServerKind::Evicting(p), "{p}");
        }
        // A policy this version does not know is evicting too.
        assert_eq!(
            evicting("allkeys-future"),
            ServerKind::Evicting("an evicting policy")
        );
        assert_eq!(evicting("noeviction"), ServerKind::Fit);
        // No limit: nothing is ever evicted, whatever the policy.
        assert_eq!(with("noeviction", "allkeys-lru"), ServerKind::Fit);
        // Nothing known (INFO refused): nothing to refuse.
        assert_eq!(ServerInfo::parse("").kind(), ServerKind::Fit);
    }

    #[test]
    fn ids_hash_apart() {
        assert_eq!(id_hash(b"abc"), id_hash(b"abc"));
        assert_ne!(id_hash(b"abc"), id_hash(b"abd"));
    }
}
