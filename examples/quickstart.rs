//! Takes, contends for, extends and releases a Redlock lock, and shows that a
//! stopped node costs only its vote.
//!
//! ```text
//! cargo run --example quickstart
//! ```
//!
//! Uses the nodes in `REDLOCK_NODES` (comma-separated `redis://` URLs) when
//! set; otherwise starts three throwaway Redis nodes itself (Docker with the
//! image in `QUORUMLOCK_REDIS_IMAGE`, default `redis:7-alpine`, or local
//! `redis-server` processes) and removes them on exit.

use std::time::{Duration, Instant};

use quorumlock::{Error, NodeErrorKind, Redlock};

#[path = "../tests/common/mod.rs"]
mod common;

fn main() {
    if let Err(e) = run() {
        eprintln!("quickstart failed: {e}");
        std::process::exit(1);
    }
}

/// `try_lock`, or, on nodes whose lock history is newer than a TTL in use (a
/// brand-new cluster, or one that lost its data), which hold their votes back
/// for that long, says so and waits it out.
fn lock_or_wait_out_the_hold(
    locks: &Redlock,
    resource: &str,
    ttl: Duration,
) -> Result<quorumlock::LockGuard, Error> {
    match locks.try_lock(resource, ttl) {
        Err(Error::NoQuorum { failures, .. })
            if failures
                .iter()
                .any(|f| f.kind() == NodeErrorKind::Restarted) =>
        {
            let detail = failures
                .iter()
                .find(|f| f.kind() == NodeErrorKind::Restarted)
                .map_or("", |f| f.detail());
            println!("these nodes' lock history is new ({detail}): waiting out the hold");
            // The hold lasts as long as the longest TTL in use before the
            // nodes' history began: on brand-new nodes, the first TTL used
            // on them (here 10 s), once; the 30 s this example extends to
            // is first used later and holds no one back.
            locks
                .request(resource, ttl)
                .acquire_for(Duration::from_secs(60))
        }
        other => other,
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let (urls, cluster) = common::example_nodes(3)?;

    // Our own throwaway nodes are brand new: trust their (empty) lock history
    // at once instead of waiting one TTL, as a restarted cluster would need.
    // Never do this for nodes that may lose their data while locks are held.
    let fresh = cluster.is_some();
    let locks = Redlock::builder()
        .nodes(urls.iter().cloned())
        .fresh_cluster(fresh)
        .build()?;
    println!(
        "client over {} nodes, quorum {}",
        locks.node_count(),
        locks.quorum()
    );

    // Optional: the first lock then hears every node (a round some node does
    // not answer cannot tell which nodes' lock histories are safe to count).
    locks.wait_connected(Duration::from_secs(2))?;

    let resource = format!("quickstart:{}", std::process::id());
    let ttl = Duration::from_secs(10);
    let t = Instant::now();
    let guard = lock_or_wait_out_the_hold(&locks, &resource, ttl)?;
    println!(
        "locked {resource:?} in {:?}; valid for {:?} of the {ttl:?} ttl",
        t.elapsed(),
        guard.validity()
    );

    let other = Redlock::builder()
        .nodes(urls.iter().cloned())
        .fresh_cluster(fresh)
        .build()?;
    other.wait_connected(Duration::from_secs(2))?;
    match other.try_lock(&resource, ttl) {
        // (Its count is of the nodes seen before the round was decided:
        // "at least" unless every node answered.)
        Err(e @ Error::Taken { .. }) => println!("a second client is refused: {e}"),
        Ok(_) => return Err("a second client got a held lock".into()),
        Err(e) => return Err(e.into()),
    }

    let validity = guard.extend(Duration::from_secs(30))?;
    println!("extended: now valid for {validity:?}");

    let t = Instant::now();
    guard.release()?;
    println!("released in {:?}", t.elapsed());
    let again = lock_or_wait_out_the_hold(&other, &resource, ttl)?;
    println!("the second client takes it after the release");
    drop(again); // dropping a guard releases it too

    if let Some(cluster) = &cluster {
        cluster.stop(2);
        let t = Instant::now();
        let guard = locks.lock(&resource, ttl)?;
        println!(
            "with node {} stopped the lock still holds on a majority ({:?})",
            cluster.url(2),
            t.elapsed()
        );
        guard.release()?;
        cluster.stop(1);
        match locks.try_lock(&resource, ttl) {
            Err(e @ Error::NoQuorum { .. }) => println!("with two of three stopped: {e}"),
            Ok(_) => return Err("locked without a majority".into()),
            Err(e) => return Err(e.into()),
        }
    }
    println!("done");
    Ok(())
}
