//! The healthy lock+unlock cycle (3 local nodes) with no event handler,
//! with a no-op handler and with a counting handler, interleaved in blocks
//! so that drift in the machine's load hits all three alike.
//!
//! ```text
//! QUORUMLOCK_TEST_BACKEND=process cargo bench --bench events
//! ```
//! Prints each variant's median and mean cycle, and the no-op handler's
//! cost relative to none (the goal: within 2 %).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use quorumlock::{AttemptEvent, EventHandler, Redlock, ReleaseEvent};

#[path = "../../tests/common/mod.rs"]
mod common;

const TTL: Duration = Duration::from_secs(10);
static BLOCKS: std::sync::LazyLock<usize> = std::sync::LazyLock::new(|| common::bench_count(30, 3));
static PER_BLOCK: std::sync::LazyLock<usize> =
    std::sync::LazyLock::new(|| common::bench_count(500, 20));

struct Noop;
impl EventHandler for Noop {}

#[derive(Default)]
struct Counting {
    attempts: AtomicU64,
    nodes_agreed: AtomicU64,
    releases: AtomicU64,
}

impl EventHandler for Counting {
    fn on_attempt(&self, e: &AttemptEvent<'_>) {
        self.attempts.fetch_add(1, Ordering::Relaxed);
        self.nodes_agreed
            .fetch_add(e.nodes().agreed() as u64, Ordering::Relaxed);
    }
    fn on_release(&self, _: &ReleaseEvent<'_>) {
        self.releases.fetch_add(1, Ordering::Relaxed);
    }
}

fn client(urls: &[String], events: Option<Arc<dyn EventHandler>>) -> Redlock {
    let mut b = Redlock::builder().fresh_cluster(true).nodes(urls.to_vec());
    if let Some(h) = events {
        b = b.events(h);
    }
    b.build().expect("client")
}

fn block(locks: &Redlock, tag: &str, block: usize, out: &mut Vec<Duration>) {
    for i in 0..*PER_BLOCK {
        let key = format!("bench:events:{tag}:{block}:{i}");
        let t = Instant::now();
        let g = locks.try_lock(&key, TTL).expect("lock");
        g.release().expect("unlock");
        out.push(t.elapsed());
    }
}

fn median(v: &mut [Duration]) -> Duration {
    v.sort_unstable();
    v[v.len() / 2]
}

fn mean(v: &[Duration]) -> Duration {
    v.iter().sum::<Duration>() / u32::try_from(v.len()).unwrap_or(u32::MAX).max(1)
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return; // `cargo test --benches` lists benches; nothing to list here
    }
    let cluster = common::Cluster::start(3);
    let urls = cluster.urls();
    let counting = Arc::new(Counting::default());
    let variants: Vec<(&str, Redlock)> = vec![
        ("none", client(&urls, None)),
        ("no-op", client(&urls, Some(Arc::new(Noop)))),
        ("counting", client(&urls, Some(counting.clone()))),
    ];
    let mut times: Vec<Vec<Duration>> = vec![Vec::new(); variants.len()];
    // Warm-up: pools connected, caches hot.
    for (tag, locks) in &variants {
        block(locks, tag, usize::MAX, &mut Vec::new());
    }
    for b in 0..*BLOCKS {
        // Rotate the order so that no variant always runs first.
        for k in 0..variants.len() {
            let j = (b + k) % variants.len();
            let (tag, locks) = &variants[j];
            block(locks, tag, b, &mut times[j]);
        }
    }
    // Each block's median per variant, and per block the ratio to "none":
    // the median of those ratios cancels load that drifts between blocks.
    let per_block = |t: &[Duration]| -> Vec<Duration> {
        t.chunks(*PER_BLOCK)
            .map(|c| median(&mut c.to_vec()))
            .collect()
    };
    let blocks: Vec<Vec<Duration>> = times.iter().map(|t| per_block(t)).collect();
    let paired = |j: usize| -> f64 {
        let mut r: Vec<f64> = blocks[j]
            .iter()
            .zip(&blocks[0])
            .map(|(a, b)| a.as_secs_f64() / b.as_secs_f64() - 1.0)
            .collect();
        r.sort_by(f64::total_cmp);
        r[r.len() / 2] * 100.0
    };
    for ((tag, _), t) in variants.iter().zip(&mut times) {
        let mean = mean(t);
        let m = median(t);
        println!(
            "events/{tag:<9} cycles {:>6}  median {:>8.1} µs  mean {:>8.1} µs",
            t.len(),
            m.as_secs_f64() * 1e6,
            mean.as_secs_f64() * 1e6
        );
    }
    let blocks = *BLOCKS;
    println!(
        "vs no handler, median of {blocks} paired block medians: no-op {:+.2} %, counting {:+.2} %",
        paired(1),
        paired(2),
    );
    println!(
        "counting handler saw {} attempts, {} releases",
        counting.attempts.load(Ordering::Relaxed),
        counting.releases.load(Ordering::Relaxed)
    );
}
