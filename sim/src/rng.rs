//! The simulation's draws, on the core's deterministic generator: every run
//! with the same seed draws the same traffic, delays and samples.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use floodgate_core::rng::Rng;
use floodgate_core::time::Nanos;

/// A hash map whose iteration order is the same in every run (the
/// standard map's hasher is seeded at random): sums over it are the same
/// bytes every time. Its hasher is a fast one (the simulation's maps are
/// its own keys, not an attacker's).
pub type Map<K, V> = HashMap<K, V, BuildHasherDefault<FastHasher>>;

/// rustc's "Fx" hash: a rotate, a xor and a multiply per word.
#[derive(Debug, Default, Clone, Copy)]
pub struct FastHasher(u64);

impl FastHasher {
    fn add(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
}

impl Hasher for FastHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for chunk in &mut chunks {
            let mut word = [0u8; 8];
            word.copy_from_slice(chunk);
            self.add(u64::from_le_bytes(word));
        }
        let mut last = [0u8; 8];
        let rest = chunks.remainder();
        for (to, from) in last.iter_mut().zip(rest) {
            *to = *from;
        }
        self.add(u64::from_le_bytes(last) ^ rest.len() as u64);
    }

    fn write_u8(&mut self, i: u8) {
        self.add(u64::from(i));
    }

    fn write_u32(&mut self, i: u32) {
        self.add(u64::from(i));
    }

    fn write_u64(&mut self, i: u64) {
        self.add(i);
    }

    fn write_usize(&mut self, i: usize) {
        self.add(i as u64);
    }
}

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

/// The run's generator for `seed`: the core's xorshift64*, its state the
/// seed hashed through splitmix64 (so a zero seed is fine).
pub fn seeded(seed: u64) -> Rng {
    Rng::new(mix(seed) | 1)
}

/// The network between the Envoys and the quota service: one-way delays.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Network {
    /// A datacenter: 0.5–2 ms nine times in ten, 2–5 ms otherwise (a tail:
    /// a busy host, a slow path).
    Datacenter,
    /// Loopback on one machine, the quota service's own time included:
    /// `low`–`high` microseconds, uniformly.
    Loopback {
        /// The shortest.
        low: u64,
        /// The longest.
        high: u64,
    },
}

/// The simulation's draws, on the core's generator.
pub trait Traffic {
    /// An exponential gap at `rate` per second (steady random arrivals).
    fn gap(&mut self, rate: f64) -> Nanos;
    /// A one-way delay of `network`.
    fn delay(&mut self, network: Network) -> Nanos;
}

impl Traffic for Rng {
    fn gap(&mut self, rate: f64) -> Nanos {
        let u = self.uniform();
        Nanos::from_nanos((-(1.0 - u).ln() / rate * 1e9) as u64 + 1)
    }

    fn delay(&mut self, network: Network) -> Nanos {
        let micros = match network {
            Network::Datacenter if self.below(10) < 9 => 500 + self.below(1_500),
            Network::Datacenter => 2_000 + self.below(3_000),
            Network::Loopback { low, high } => low + self.below(high.saturating_sub(low).max(1)),
        };
        Nanos::from_micros(micros)
    }
}
