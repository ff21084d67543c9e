//! Sets of 1 and 3 sharing resources (issue 41): processes whose even
//! threads lock a random 3 of the resources `r0..r3` as one lock and whose
//! odd threads lock a random one of them, each holding it 2 ms and asking
//! again at once. Per size: sections/s and the wait from asking to getting
//! (p50, p99, max), and the asks the run's end cut off (a set that never got
//! in shows there, not in the waits); overlaps per resource.

use super::processes::{nanos, overlaps, quantile, Got, Section};

/// The row of a sets run.
pub fn row(name: &str, got: &Got) -> String {
    let mut out = format!("{name:<28}");
    for size in [1u32, 3] {
        let of_size = |m: u8| m.count_ones() == size;
        let mut waits: Vec<_> = got
            .secs
            .iter()
            .filter(|s| of_size(s.mask))
            .map(|s| nanos(s.start.saturating_sub(s.asked)))
            .collect();
        waits.sort_unstable();
        let cut: Vec<_> = got
            .unfinished
            .iter()
            .filter(|u| of_size(u.2))
            .map(|u| nanos(u.1.saturating_sub(u.0)))
            .collect();
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        out.push_str(&format!(
            "  sets of {size}: {:>5.0} sections/s  wait p50 {:.1} ms p99 {:.1} ms max {:.1} ms  \
             asks cut off by the run's end {} (longest {:.0} ms)",
            waits.len() as f64 / got.run_for.as_secs_f64(),
            ms(quantile(&waits, 0.5)),
            ms(quantile(&waits, 0.99)),
            ms(quantile(&waits, 1.0)),
            cut.len(),
            ms(cut.iter().copied().max().unwrap_or_default()),
        ));
    }
    let per_resource: Vec<usize> = (0..4)
        .map(|r| {
            let of_r = |s: &&Section| s.mask & (1 << r) != 0;
            overlaps(got.secs.iter().filter(of_r))
        })
        .collect();
    out.push_str(&format!("  overlaps per resource {per_resource:?}"));
    out
}
