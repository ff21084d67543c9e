//! Read-write locks (issue 23) on 5 local nodes: a read lock's cycle against
//! a plain lock's; readers holding one key at once (8 threads of one
//! process, then 3 processes); and how long a writer waits under a
//! continuous stream of readers.
//!
//! ```text
//! cargo bench --bench rw
//! QUORUMLOCK_TEST_BACKEND=process cargo bench --bench rw   # redis-server processes
//! ```
//! Prints the figures the README quotes; fails when readers never overlap or
//! a writer waits more than twice a reader's TTL.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use quorumlock::Redlock;

#[path = "../../tests/common/mod.rs"]
mod common;

use common::Cluster;

const TTL: Duration = Duration::from_secs(10);
/// How long a reader holds in the overlap runs.
const HOLD: Duration = Duration::from_millis(5);
const CHILD: &str = "QUORUMLOCK_BENCH_RW_CHILD";

fn client(urls: &[String]) -> Redlock {
    Redlock::builder()
        .fresh_cluster(true)
        .nodes(urls.iter().cloned())
        .build()
        .expect("client")
}

fn wall_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}

fn median_p99(mut v: Vec<Duration>) -> (Duration, Duration) {
    v.sort_unstable();
    let at = |q: f64| v[((v.len() as f64 - 1.0) * q).round() as usize];
    (at(0.5), at(0.99))
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Reader sections as `(start, end)` in wall-clock ns, each holding
/// [`HOLD`]: `threads` threads of one client on `key` for `run_for`.
fn read_loop(locks: &Redlock, key: &str, threads: usize, run_for: Duration) -> Vec<(u128, u128)> {
    let end = Instant::now() + run_for;
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| {
                    let mut out = Vec::new();
                    while Instant::now() < end {
                        let left = end.saturating_duration_since(Instant::now());
                        let Ok(g) = locks.request(key, TTL).read().acquire_for(left) else {
                            continue;
                        };
                        let start = wall_ns();
                        std::thread::sleep(HOLD);
                        out.push((start, wall_ns()));
                        drop(g);
                    }
                    out
                })
            })
            .collect();
        hs.into_iter()
            .flat_map(|h| h.join().unwrap_or_default())
            .collect()
    })
}

/// The most sections inside at once, and the share of the time from the
/// first start to the last end that two or more were inside.
fn overlap(secs: &[(u128, u128)]) -> (usize, f64) {
    let mut edges: Vec<(u128, i32)> = secs.iter().flat_map(|&(a, b)| [(a, 1), (b, -1)]).collect();
    edges.sort_unstable();
    let (mut inside, mut most, mut shared, mut last) = (0i32, 0i32, 0u128, 0u128);
    for (t, d) in &edges {
        if inside >= 2 {
            shared += t.saturating_sub(last);
        }
        inside += d;
        most = most.max(inside);
        last = *t;
    }
    let span = match (edges.first(), edges.last()) {
        (Some(a), Some(b)) => b.0.saturating_sub(a.0).max(1),
        _ => 1,
    };
    (
        usize::try_from(most).unwrap_or(0),
        shared as f64 / span as f64,
    )
}

/// In a child process: reads `key` in a loop for the time its environment
/// says, prints one `start end` line per section, and exits. Returns only
/// in the parent.
fn child_main() {
    let Ok(spec) = std::env::var(CHILD) else {
        return;
    };
    // `urls|key|run_ms`
    let parts: Vec<&str> = spec.split('|').collect();
    let [urls, key, run_ms] = parts[..] else {
        eprintln!("bad {CHILD}: {spec}");
        std::process::exit(2);
    };
    let urls: Vec<String> = urls.split(',').map(str::to_owned).collect();
    let run_for = Duration::from_millis(run_ms.parse().unwrap_or(1000));
    let locks = client(&urls);
    let _ = locks.wait_connected(Duration::from_secs(2));
    for (a, b) in read_loop(&locks, key, 1, run_for) {
        println!("{a} {b}");
    }
    std::process::exit(0);
}

/// `procs` processes of one reader thread each on `key`: their sections.
fn read_processes(
    urls: &[String],
    key: &str,
    procs: usize,
    run_for: Duration,
) -> Vec<(u128, u128)> {
    let exe = std::env::current_exe().expect("the bench's own path");
    let spec = format!("{}|{key}|{}", urls.join(","), run_for.as_millis());
    let children: Vec<_> = (0..procs)
        .map(|_| {
            Command::new(&exe)
                .env(CHILD, &spec)
                .stdout(Stdio::piped())
                .spawn()
                .expect("spawn a child process")
        })
        .collect();
    let mut secs = Vec::new();
    for mut c in children {
        if let Some(out) = c.stdout.take() {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                let f: Vec<u128> = line.split(' ').filter_map(|x| x.parse().ok()).collect();
                if let [a, b] = f[..] {
                    secs.push((a, b));
                }
            }
        }
        let _ = c.wait();
    }
    secs
}

/// A writer's waits under a stream of readers: 4 reader threads (clients
/// of their own) each hold the key `hold` at a time with `reader_ttl`, one
/// after another with a stagger, so that it is never free; a writer asks
/// for it `writes` times (`acquire_for`), holding it 1 ms.
fn writer_under_stream(
    urls: &[String],
    key: &str,
    reader_ttl: Duration,
    hold: Duration,
    writes: usize,
) -> (Vec<Duration>, usize) {
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let granted = Arc::new(AtomicUsize::new(0));
    let readers: Vec<_> = (0..4u32)
        .map(|n| {
            let (locks, key, stop, granted) =
                (client(urls), key.to_owned(), stop.clone(), granted.clone());
            std::thread::spawn(move || {
                std::thread::sleep(hold / 4 * n);
                while !stop.load(Ordering::SeqCst) {
                    match locks.request(&key, reader_ttl).read().try_acquire() {
                        Ok(g) => {
                            granted.fetch_add(1, Ordering::SeqCst);
                            std::thread::sleep(hold);
                            drop(g);
                        }
                        Err(_) => std::thread::sleep(Duration::from_millis(5)),
                    }
                }
            })
        })
        .collect();
    let writer = client(urls);
    let _ = writer.wait_connected(Duration::from_secs(2));
    std::thread::sleep(hold * 2);
    let mut waits = Vec::with_capacity(writes);
    for _ in 0..writes {
        let t = Instant::now();
        let g = writer
            .request(key, TTL)
            .acquire_for(reader_ttl * 4)
            .expect("the writer gets in under the stream");
        waits.push(t.elapsed());
        std::thread::sleep(Duration::from_millis(1));
        drop(g);
        // The stream resumes between writes.
        std::thread::sleep(hold * 2);
    }
    stop.store(true, Ordering::SeqCst);
    for r in readers {
        let _ = r.join();
    }
    (waits, granted.load(Ordering::SeqCst))
}

fn main() {
    child_main();
    let smoke = common::bench_smoke();
    let cycles = common::bench_count(3000, 40);
    let c = Cluster::start(5);
    eprintln!("5 nodes on the {:?} backend", c.backend());
    let urls = c.urls();
    let locks = client(&urls);
    let mut rows = Vec::new();

    // The cycle: plain and read locks in alternating blocks (so that the
    // machine's drift falls on both alike), each on keys of its own.
    let (mut plain, mut read) = (Vec::new(), Vec::new());
    for i in 0..20 {
        let _ = locks.try_lock(&format!("bench:rw:warm:{i}"), TTL);
        let _ = locks
            .request(&format!("bench:rw:warm-r:{i}"), TTL)
            .read()
            .try_acquire();
    }
    let block = 100.min(cycles);
    let mut i = 0;
    while plain.len() < cycles {
        for _ in 0..block {
            let t = Instant::now();
            let g = locks
                .try_lock(&format!("bench:rw:w:{i}"), TTL)
                .expect("lock");
            g.release().expect("unlock");
            plain.push(t.elapsed());
            let t = Instant::now();
            let g = locks
                .request(&format!("bench:rw:r:{i}"), TTL)
                .read()
                .try_acquire()
                .expect("read lock");
            g.release().expect("unlock");
            read.push(t.elapsed());
            i += 1;
        }
    }
    let ((pm, pp), (rm, rp)) = (median_p99(plain), median_p99(read));
    rows.push(format!(
        "cycle, plain lock            median {:>7.1} us  p99 {:>7.1} us",
        us(pm),
        us(pp)
    ));
    rows.push(format!(
        "cycle, read lock             median {:>7.1} us  p99 {:>7.1} us  {:.2}x plain",
        us(rm),
        us(rp),
        rm.as_secs_f64() / pm.as_secs_f64()
    ));

    // Readers at once: 8 threads of one client, then 3 processes; beside
    // them, 8 writer threads for what exclusion allows.
    let run_for = Duration::from_millis(if smoke { 400 } else { 3000 });
    let secs = read_loop(&locks, "bench:rw:threads", 8, run_for);
    let (most, shared) = overlap(&secs);
    let writers = {
        let end = Instant::now() + run_for;
        let n = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..8 {
                s.spawn(|| {
                    while Instant::now() < end {
                        let left = end.saturating_duration_since(Instant::now());
                        if let Ok(g) = locks.request("bench:rw:writers", TTL).acquire_for(left) {
                            std::thread::sleep(HOLD);
                            drop(g);
                            n.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                });
            }
        });
        n.load(Ordering::Relaxed)
    };
    let per_sec = |n: usize| n as f64 / run_for.as_secs_f64();
    rows.push(format!(
        "8 reader threads, 1 client   {:>6.0} sections/s  at once at most {most}  two or more inside {:>3.0} % of the time  (8 writer threads: {:.0} sections/s)",
        per_sec(secs.len()),
        shared * 100.0,
        per_sec(writers)
    ));
    assert!(most >= 2, "8 reader threads never held at once");
    let secs = read_processes(&urls, "bench:rw:procs", 3, run_for);
    let (most_p, shared_p) = overlap(&secs);
    rows.push(format!(
        "3 reader processes           {:>6.0} sections/s  at once at most {most_p}  two or more inside {:>3.0} % of the time",
        per_sec(secs.len()),
        shared_p * 100.0
    ));
    assert!(most_p >= 2, "3 reader processes never held at once");

    // A writer under a continuous stream of readers.
    let reader_ttl = Duration::from_secs(1);
    let hold = Duration::from_millis(200);
    let writes = if smoke { 3 } else { 20 };
    let (mut waits, granted) =
        writer_under_stream(&urls, "bench:rw:stream", reader_ttl, hold, writes);
    waits.sort_unstable();
    let worst = waits.last().copied().unwrap_or_default();
    rows.push(format!(
        "writer under a reader stream wait median {:.0} ms  max {:.0} ms  (reader TTL {:.0} ms, holds {:.0} ms; {granted} reader sections, {writes} writes)",
        ms(waits[waits.len() / 2]),
        ms(worst),
        ms(reader_ttl),
        ms(hold)
    ));
    assert!(
        worst < reader_ttl * 2,
        "a writer waited {worst:?} under the reader stream"
    );

    println!("\nquorumlock read-write locks, 5 nodes ({cycles} cycles each):");
    for r in rows {
        println!("  {r}");
    }
}
