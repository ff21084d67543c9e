//! The simulation's seeded randomness.

use std::time::Duration;

/// SplitMix64: the simulation's only source of randomness.
#[derive(Debug, Clone)]
pub(crate) struct SimRng(u64);

impl SimRng {
    pub(crate) fn new(seed: u64) -> Self {
        SimRng(seed)
    }

    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (0 when `n` is 0).
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next() % n
        }
    }

    /// True with probability `p`.
    pub(crate) fn chance(&mut self, p: f64) -> bool {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64 <= p && p > 0.0
    }

    /// Uniform in `lo..=hi` (milliseconds, as a duration).
    pub(crate) fn millis(&mut self, lo: u64, hi: u64) -> Duration {
        Duration::from_millis(lo + self.below(hi.saturating_sub(lo) + 1))
    }

    /// A new independent stream (for one thread or one part of the world).
    pub(crate) fn fork(&mut self) -> SimRng {
        SimRng::new(self.next())
    }
}
