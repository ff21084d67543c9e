//! The `metrics` feature: installs a recorder, hands two clients a
//! `quorumlock::metrics::Metrics` handler (with a resource label by
//! pattern), runs a small contended workload (8 threads, 4 keys,
//! auto-renewed locks), then prints what the recorder got.
//!
//! ```text
//! cargo run --example metrics --features metrics
//! ```
//!
//! A real application installs an exporter instead (e.g. a Prometheus one);
//! this one keeps the values in memory (tests/common/recorder.rs).
//!
//! Uses the nodes in `REDLOCK_NODES` (comma-separated `redis://` URLs) when
//! set; otherwise starts three throwaway Redis nodes itself.

use std::sync::Arc;
use std::time::Duration;

use quorumlock::metrics::Metrics;
use quorumlock::Redlock;

#[path = "../tests/common/mod.rs"]
mod common;
#[path = "../tests/common/recorder.rs"]
mod recorder;

fn main() {
    if let Err(e) = run() {
        eprintln!("metrics example failed: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    // The recorder first: `Metrics::new` describes the metrics to it.
    let recorded = recorder::installed();
    let (urls, cluster) = common::example_nodes(3)?;
    let run = std::process::id();
    // One handler for two clients (as two processes would be): they contend
    // at the nodes, where threads of one client take turns locally.
    let metrics = Arc::new(
        Metrics::new().resource_label(|r: &str| r.starts_with("metrics:").then_some("metrics")),
    );
    let clients = [(); 2].map(|_| {
        Redlock::builder()
            .nodes(urls.clone())
            .fresh_cluster(cluster.is_some())
            .auto_renew(true)
            .events(metrics.clone())
            .build()
    });
    let [a, b] = clients;
    let clients = [a?, b?];

    let workers: Vec<_> = (0..8)
        .map(|w| {
            let locks = clients[w % 2].clone();
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

    println!("counters:");
    for ((name, labels), total) in recorded.counters() {
        println!("  {name}{} {total}", show(&labels));
    }
    println!("histograms (count, p50, p99, max):");
    for ((name, labels), mut samples) in recorded.histograms() {
        if samples.is_empty() {
            continue;
        }
        samples.sort_by(f64::total_cmp);
        let at = |q: f64| samples[((samples.len() - 1) as f64 * q) as usize];
        println!(
            "  {name}{} {} {:.4} {:.4} {:.4}",
            show(&labels),
            samples.len(),
            at(0.5),
            at(0.99),
            at(1.0)
        );
    }
    drop(cluster);
    Ok(())
}

/// Labels as `{k="v",…}`.
fn show(labels: &[(String, String)]) -> String {
    if labels.is_empty() {
        return String::new();
    }
    let inner: Vec<String> = labels.iter().map(|(k, v)| format!("{k}={v:?}")).collect();
    format!("{{{}}}", inner.join(","))
}
