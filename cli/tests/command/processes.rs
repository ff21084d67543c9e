//! Several processes on the same resources, as separate hosts would meet them: `quorumlock
//! run` processes (each its own client, started and ended per section) on sets that
//! overlap in a cycle, and readers and a writer of one key. Each command prints its
//! section's start and end (wall-clock ns, one machine's clock for all); no two sections
//! that exclude each other may overlap, and readers must share.

use crate::cli::{finish, run_cmd, Scratch};
use crate::common::{shared, unique_key, Cluster};

/// The command of every section: its start and end, `hold` apart.
fn section(hold: &str) -> String {
    format!(r#"echo "$(date +%s%N) $(sleep {hold}; date +%s%N)""#)
}

/// `runs` sections, one process each, one after another, of `quorumlock run --wait 60s
/// [extra] key`; the sections' `(start, end)`.
fn sections(
    c: &Cluster,
    dir: &Scratch,
    name: &str,
    (key, extra): (&str, &[&str]),
    runs: usize,
    hold: &str,
) -> Vec<(u128, u128)> {
    let mut extra = extra.to_vec();
    extra.extend(["--wait", "60s"]);
    (0..runs)
        .map(|i| {
            let run = format!("{name}-{i}");
            let (code, err) = finish(
                run_cmd(c, dir, &run, key, &extra, &section(hold)),
                dir,
                &run,
            );
            assert_eq!(code, 0, "{run}: {err}");
            let out =
                std::fs::read_to_string(dir.path(&format!("{run}.stdout"))).unwrap_or_default();
            let t: Vec<u128> = out
                .split_whitespace()
                .filter_map(|x| x.parse().ok())
                .collect();
            match t[..] {
                [a, b] => (a, b),
                _ => panic!("{run} printed {out:?}"),
            }
        })
        .collect()
}

fn overlaps(a: &[(u128, u128)], b: &[(u128, u128)]) -> usize {
    a.iter()
        .map(|x| b.iter().filter(|y| x.0 < y.1 && y.0 < x.1).count())
        .sum()
}

/// Three processes at a time take sets `{k0, k1}`, `{k1, k2}`, `{k2, k0}` (each pair
/// shares a key): no two sections overlap, and every run gets its turn (none deadlocks).
#[test]
fn processes_on_overlapping_sets_never_hold_together() {
    let c = shared();
    let dir = Scratch::new("procs-sets");
    let k: Vec<String> = (0..3)
        .map(|i| format!("{}-{i}", unique_key("psets")))
        .collect();
    let all: Vec<Vec<(u128, u128)>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..3)
            .map(|p| {
                let (c, dir, k) = (&c, &dir, &k);
                s.spawn(move || {
                    let and = ["--and", k[(p + 1) % 3].as_str()];
                    sections(c, dir, &format!("set{p}"), (&k[p], &and), 5, "0.02")
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("runner")).collect()
    });
    for a in 0..3 {
        for b in a + 1..3 {
            assert_eq!(
                overlaps(&all[a], &all[b]),
                0,
                "sets {a} and {b} (they share a key) held at once"
            );
        }
    }
}

/// Two reader processes and a writer process at a time on one key: the writer's sections
/// overlap no other section, the readers' overlap each other.
#[test]
fn reader_and_writer_processes_exclude_as_they_should() {
    let c = shared();
    let dir = Scratch::new("procs-rw");
    let key = unique_key("prw");
    let (w, r1, r2) = std::thread::scope(|s| {
        let (c, dir, key) = (&c, &dir, key.as_str());
        let w = s.spawn(move || sections(c, dir, "w", (key, &[]), 5, "0.02"));
        let r1 = s.spawn(move || sections(c, dir, "r1", (key, &["--read"]), 5, "0.3"));
        let r2 = s.spawn(move || sections(c, dir, "r2", (key, &["--read"]), 5, "0.3"));
        (
            w.join().expect("writer"),
            r1.join().expect("reader 1"),
            r2.join().expect("reader 2"),
        )
    });
    assert_eq!(
        overlaps(&w, &r1) + overlaps(&w, &r2),
        0,
        "a writer beside a reader"
    );
    assert!(
        overlaps(&r1, &r2) > 0,
        "the readers never shared: {r1:?} {r2:?}"
    );
}
