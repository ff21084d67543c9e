//! The yardstick of the across-process rows: a plain polling loop, no
//! library. Each thread has one connection per node; an attempt sends
//! `SET key token NX PX ttl` to every node, then reads the replies (scatter,
//! then gather); with a majority it holds the key, otherwise it deletes its
//! token where it landed (compare-and-delete) and tries again after a random
//! 0.2–1 ms. The release is the compare-and-delete on every node, scattered
//! and gathered the same way. (No validity check against the clock: the TTL
//! is 10 s and an attempt takes well under a millisecond.)

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use super::processes::{hold, threads, unfinished, Rng, Spec};

/// Deletes the key where it still holds our token.
const UNLOCK: &str =
    "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end";

/// A thread's connections, one per node.
struct Nodes {
    conns: Vec<redis::Connection>,
    unlock: redis::Script,
}

impl Nodes {
    fn connect(urls: &[String]) -> Nodes {
        let unlock = redis::Script::new(UNLOCK);
        let conns = urls
            .iter()
            .map(|url| {
                let info = redis::IntoConnectionInfo::into_connection_info(url.as_str())
                    .expect("url")
                    .set_tcp_settings(redis::io::tcp::TcpSettings::default().set_nodelay(true));
                let mut conn = redis::Client::open(info)
                    .expect("client")
                    .get_connection()
                    .expect("connect");
                let _: String = unlock.prepare_invoke().load(&mut conn).expect("load");
                conn
            })
            .collect();
        Nodes { conns, unlock }
    }

    /// Sends `cmd` to the nodes `to` picks, then reads their replies: for
    /// each node, whether `ok` holds of its reply (false where not sent).
    fn scatter(
        &mut self,
        cmd: &[u8],
        to: impl Fn(usize) -> bool,
        ok: impl Fn(&redis::Value) -> bool,
    ) -> Vec<bool> {
        let sent: Vec<bool> = self
            .conns
            .iter_mut()
            .enumerate()
            .map(|(i, c)| to(i) && c.send_packed_command(cmd).is_ok())
            .collect();
        self.conns
            .iter_mut()
            .zip(&sent)
            .map(|(c, &sent)| sent && c.recv_response().is_ok_and(|v| ok(&v)))
            .collect()
    }

    /// `SET key token NX PX ttl` on every node: where it landed.
    fn set(&mut self, key: &str, token: &str, ttl: Duration) -> Vec<bool> {
        let cmd = redis::cmd("SET")
            .arg(key)
            .arg(token)
            .arg("NX")
            .arg("PX")
            .arg(ttl.as_millis() as u64)
            .get_packed_command();
        self.scatter(&cmd, |_| true, |v| matches!(v, redis::Value::Okay))
    }

    /// Compare-and-delete of `token` on the nodes in `on`.
    fn unset(&mut self, key: &str, token: &str, on: &[bool]) {
        let cmd = redis::cmd("EVALSHA")
            .arg(self.unlock.get_hash())
            .arg(1)
            .arg(key)
            .arg(token)
            .get_packed_command();
        self.scatter(&cmd, |i| on[i], |_| true);
    }
}

/// A polling child: its threads poll for `spec.key` until the run ends.
pub fn child(spec: &Spec, end: Instant) -> Vec<String> {
    let (all, split) = (AtomicUsize::new(0), AtomicUsize::new(0));
    let quorum = spec.urls.len() / 2 + 1;
    let key = spec.key.as_str();
    let mut lines = threads(spec.threads, |t| {
        let mut nodes = Nodes::connect(&spec.urls);
        let everywhere = vec![true; spec.urls.len()];
        let mut rng = Rng::new(t);
        let mut out = Vec::new();
        while Instant::now() < end {
            let asked = super::processes::wall_ns();
            loop {
                let token = uuid::Uuid::new_v4().simple().to_string();
                let landed = nodes.set(key, &token, spec.ttl);
                all.fetch_add(1, Ordering::Relaxed);
                if landed.iter().filter(|&&l| l).count() >= quorum {
                    out.push(hold(asked, 1, || nodes.unset(key, &token, &everywhere)));
                    break;
                }
                if landed.contains(&true) {
                    split.fetch_add(1, Ordering::Relaxed);
                    nodes.unset(key, &token, &landed);
                }
                if Instant::now() >= end {
                    out.push(unfinished(asked, 1));
                    break;
                }
                std::thread::sleep(Duration::from_micros(200 + rng.below(801)));
            }
        }
        out
    });
    let n = |a: &AtomicUsize| a.load(Ordering::Relaxed);
    lines.push(format!("# {} 0 {}", n(&all), n(&split)));
    lines
}
