//! The keys a fleet serves: Zipf-distributed request rates, a limit each
//! (per-second or per-minute fixed windows, per-second token buckets), a
//! tenth of the busier keys limited below their demand. A fleet of 10⁶ keys
//! is not simulated key by key: its head is, and its tail is sampled, each
//! sampled key standing for `weight` keys of its stratum.

use floodgate_core::time::{Nanos, SECOND};
use floodgate_quota::config::Limit;
use floodgate_quota::store::bucket_key;

use crate::rng::{mix, unit};

/// The limits domain every key is in.
pub const DOMAIN: &str = "edge";

/// Requests per second of the hottest key (rank 1); rank `i` gets `HOTTEST / i`.
pub const HOTTEST: f64 = 1_000.0;

/// How a key is limited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// A fixed window of one second.
    PerSecond,
    /// A fixed window of one minute.
    PerMinute,
    /// A token bucket refilling `limit` a second, burst `limit`.
    Bucket,
}

impl Shape {
    /// The period the limit is per.
    pub fn period(self) -> Nanos {
        match self {
            Shape::PerMinute => SECOND.times(60),
            Shape::PerSecond | Shape::Bucket => SECOND,
        }
    }
}

/// One simulated key.
#[derive(Debug, Clone)]
pub struct Key {
    /// Requests per second, fleet-wide.
    pub rate: f64,
    /// How many keys of the fleet it stands for (1 in the head).
    pub weight: f64,
    /// How it is limited.
    pub shape: Shape,
    /// Units per period.
    pub limit: u64,
    /// Demand above the limit (by design, not by chance).
    pub over: bool,
    /// The descriptor it is asked with.
    pub descriptor: Vec<(String, String)>,
    /// The service's limit.
    pub rule: Limit,
    /// The service's bucket key.
    pub bucket: String,
}

impl Key {
    /// The simulation's key `index` (its descriptor value is `k<index>`):
    /// `rate` requests a second, standing for `weight` keys, limited to
    /// `limit` per `shape`'s period.
    pub fn new(index: usize, rate: f64, weight: f64, shape: Shape, limit: u64, over: bool) -> Result<Self, String> {
        let rule = match shape {
            Shape::PerSecond | Shape::PerMinute => Limit::new("fixed_window", limit, shape.period(), "{}")?,
            Shape::Bucket => Limit::new("token_bucket", limit, shape.period(), "{}")?,
        };
        let descriptor = vec![("key".to_string(), format!("k{index}"))];
        let bucket = bucket_key(DOMAIN, &rule, &descriptor);
        Ok(Key { rate, weight, shape, limit, over, descriptor, rule, bucket })
    }
}

/// A Zipf fleet of `total` keys, drawn from `seed`: the `head` hottest keys
/// each simulated, the rest in strata of doubling rank ranges, `per_stratum`
/// keys of each drawn by systematic sampling (an even step from a random
/// start) and weighted by the stratum's size over the number drawn.
pub fn zipf(total: u64, head: u64, per_stratum: u64, seed: u64) -> Result<Vec<Key>, String> {
    let mut ranks: Vec<(u64, f64)> = (1..=total.min(head)).map(|r| (r, 1.0)).collect();
    let mut low = head + 1;
    let mut stratum = 0u64;
    while low <= total {
        let high = (low.saturating_mul(2) - 1).min(total);
        let size = high - low + 1;
        if size <= per_stratum {
            ranks.extend((low..=high).map(|r| (r, 1.0)));
        } else {
            let step = size as f64 / per_stratum as f64;
            let start = unit(seed ^ mix(stratum));
            for i in 0..per_stratum {
                let rank = low + ((i as f64 + start) * step) as u64;
                ranks.push((rank.min(high), step));
            }
        }
        low = high + 1;
        stratum += 1;
    }
    ranks
        .into_iter()
        .enumerate()
        .map(|(index, (rank, weight))| {
            let rate = HOTTEST / rank as f64;
            let h = mix(seed ^ rank.wrapping_mul(0x9e37_79b9));
            let shape = match h % 4 {
                0 | 1 => Shape::PerSecond,
                2 => Shape::PerMinute,
                _ => Shape::Bucket,
            };
            let per_period = shape.period().events_at(rate);
            // A tenth of the keys with demand for two or more units a
            // period get a limit of 30–70 % of it; the rest 1.5–4 times it.
            let over = (h >> 8) % 10 == 0 && per_period >= 2.0;
            let u = unit(h >> 16);
            let limit = if over { per_period * (0.3 + 0.4 * u) } else { per_period * (1.5 + 2.5 * u) };
            Key::new(index, rate, weight, shape, (limit.ceil() as u64).max(1), over)
        })
        .collect()
}

/// Thin keys for the overshoot budget's table: `count` keys with
/// per-second windows of 10, three in four at 2 requests a second (below
/// the limit), one in four at 20 (twice the limit).
pub fn thin(count: usize) -> Result<Vec<Key>, String> {
    (0..count)
        .map(|index| {
            let over = index % 4 == 3;
            Key::new(index, if over { 20.0 } else { 2.0 }, 1.0, Shape::PerSecond, 10, over)
        })
        .collect()
}

/// The end-to-end comparison (`tests/tests/long_tail.rs`): `count` keys at
/// 3 requests a second each, per-second fixed windows of 40.
pub fn flat(count: usize) -> Result<Vec<Key>, String> {
    (0..count).map(|index| Key::new(index, 3.0, 1.0, Shape::PerSecond, 40, false)).collect()
}
