//! A small deterministic generator: every run with the same seed draws the
//! same traffic, delays and samples.

use floodgate_core::time::Nanos;

/// xorshift64*, seeded through splitmix64 (a zero seed is fine).
#[derive(Debug, Clone)]
pub struct Rng(u64);

/// splitmix64: a good 64-bit hash of `x`, used for per-key draws that must
/// not depend on the order keys are simulated in.
pub fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// `x` hashed to a uniform number in `[0, 1)`.
pub fn unit(x: u64) -> f64 {
    (mix(x) >> 11) as f64 / (1u64 << 53) as f64
}

impl Rng {
    /// A generator for `seed`.
    pub fn new(seed: u64) -> Self {
        Rng(mix(seed) | 1)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform in `[0, 1)`.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `0..n` (`n` > 0; a slight modulo bias is irrelevant here).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    /// An exponential gap at `rate` per second (steady random arrivals).
    pub fn gap(&mut self, rate: f64) -> Nanos {
        let u = self.uniform();
        Nanos((-(1.0 - u).ln() / rate * 1e9) as u64 + 1)
    }

    /// A one-way network delay: 0.5–2 ms nine times in ten, 2–5 ms otherwise
    /// (a tail: a busy host, a retransmission-free slow path).
    pub fn delay(&mut self) -> Nanos {
        let micros = if self.below(10) < 9 { 500 + self.below(1_500) } else { 2_000 + self.below(3_000) };
        Nanos::from_micros(micros)
    }
}
