//! Wires the event hooks to counters and a latency histogram, runs a small
//! contended workload (8 threads, 4 keys, auto-renewed locks), then prints
//! what the handler saw.
//!
//! ```text
//! cargo run --example metrics
//! ```
//!
//! Uses the nodes in `REDLOCK_NODES` (comma-separated `redis://` URLs) when
//! set; otherwise starts three throwaway Redis nodes itself.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use quorumlock::{
    AttemptEvent, EventHandler, LostEvent, NodeEvent, NodeOutcome, Redlock, ReleaseEvent,
    RenewalEvent,
};

#[path = "../tests/common/mod.rs"]
mod common;

/// Power-of-two latency buckets, in microseconds: bucket `i` counts
/// attempts that took `[2^i, 2^(i+1))` µs. Lock-free: one atomic add each.
#[derive(Default)]
struct Histogram {
    buckets: [AtomicU64; 32],
}

impl Histogram {
    fn record(&self, d: Duration) {
        let us = u64::try_from(d.as_micros()).unwrap_or(u64::MAX).max(1);
        let i = (63 - us.leading_zeros() as usize).min(31);
        self.buckets[i].fetch_add(1, Ordering::Relaxed);
    }

    fn print(&self, title: &str) {
        println!("{title}");
        let counts: Vec<u64> = self
            .buckets
            .iter()
            .map(|b| b.load(Ordering::Relaxed))
            .collect();
        let most = counts.iter().copied().max().unwrap_or(0).max(1);
        for (i, &n) in counts.iter().enumerate().filter(|(_, n)| **n > 0) {
            let bar = "#".repeat((n * 40).div_ceil(most) as usize);
            println!(
                "  {:>8} µs .. {:>8} µs {n:>6} {bar}",
                1u64 << i,
                1u64 << (i + 1)
            );
        }
    }
}

/// What a metrics exporter would keep (here printed at the end).
#[derive(Default)]
struct Metrics {
    acquired: AtomicU64,
    refused: AtomicU64,
    node_failures: AtomicU64,
    renewals: AtomicU64,
    renewals_failed: AtomicU64,
    lost: AtomicU64,
    released: AtomicU64,
    node_changes: AtomicU64,
    attempt_latency: Histogram,
}

impl EventHandler for Metrics {
    fn on_attempt(&self, e: &AttemptEvent<'_>) {
        let counter = if e.acquired() {
            &self.acquired
        } else {
            &self.refused
        };
        counter.fetch_add(1, Ordering::Relaxed);
        self.attempt_latency.record(e.elapsed());
        let failed = e
            .nodes()
            .iter()
            .filter(|(_, o)| matches!(o, NodeOutcome::Failed(_)))
            .count();
        self.node_failures
            .fetch_add(failed as u64, Ordering::Relaxed);
    }

    fn on_renewal(&self, e: &RenewalEvent<'_>) {
        let counter = if e.validity().is_some() {
            &self.renewals
        } else {
            &self.renewals_failed
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    fn on_lost(&self, e: &LostEvent<'_>) {
        self.lost.fetch_add(1, Ordering::Relaxed);
        eprintln!(
            "lost {:?} after {:?}: {}",
            e.resource(),
            e.held(),
            e.error()
        );
    }

    fn on_release(&self, _: &ReleaseEvent<'_>) {
        self.released.fetch_add(1, Ordering::Relaxed);
    }

    fn on_node(&self, e: &NodeEvent<'_>) {
        self.node_changes.fetch_add(1, Ordering::Relaxed);
        println!("node {}: {:?}", e.node(), e.change());
    }
}

fn main() {
    if let Err(e) = run() {
        eprintln!("metrics example failed: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let (urls, cluster) = common::example_nodes(3)?;
    let metrics = Arc::new(Metrics::default());
    let locks = Redlock::builder()
        .nodes(urls)
        .fresh_cluster(cluster.is_some())
        .auto_renew(true)
        .events(metrics.clone())
        .build()?;

    let run = std::process::id();
    let workers: Vec<_> = (0..8)
        .map(|w| {
            let locks = locks.clone();
            std::thread::spawn(move || {
                for i in 0..50 {
                    let key = format!("metrics:{run}:{}", (w + i) % 4);
                    // A short TTL so that the renewal thread has work to do.
                    match locks
                        .request(&key, Duration::from_millis(300))
                        .acquire_for(Duration::from_secs(5))
                    {
                        Ok(guard) => {
                            std::thread::sleep(Duration::from_millis(if i % 10 == 0 {
                                250
                            } else {
                                2
                            }));
                            let _ = guard.release();
                        }
                        Err(e) => eprintln!("worker {w}: {e}"),
                    }
                }
            })
        })
        .collect();
    for w in workers {
        let _ = w.join();
    }

    let m = &*metrics;
    let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
    println!(
        "attempts: {} acquired, {} refused",
        get(&m.acquired),
        get(&m.refused)
    );
    println!(
        "renewals: {} ok, {} failed; {} lost",
        get(&m.renewals),
        get(&m.renewals_failed),
        get(&m.lost)
    );
    println!("releases: {}", get(&m.released));
    println!(
        "node failures seen in attempts: {}; node state changes: {}",
        get(&m.node_failures),
        get(&m.node_changes)
    );
    m.attempt_latency.print("attempt latency:");
    drop(cluster);
    Ok(())
}
