//! The keys a fleet serves and how their requests reach it: Zipf-distributed
//! request rates over the fleet's traffic (a rate per Envoy times the
//! Envoys), a limit each (per-second or per-minute fixed windows,
//! per-second token buckets), a tenth of the busier keys limited below
//! their demand; a balancer that spreads a key's requests over every Envoy
//! or sends them all to one. A fleet too large to simulate request by
//! request is sampled ([`Plan`]): keys by stratum of rank, each standing
//! for `key_weight` keys, and a key hotter than the plan's cap simulated
//! at a fraction of its traffic (a stand-in, [`Key::scale`]).

use floodgate_core::time::{Nanos, SECOND};
use floodgate_quota::config::Limit;
use floodgate_quota::store::bucket_key;

use crate::rng::{mix, unit};

/// The limits domain every key is in.
pub const DOMAIN: &str = "edge";

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

    /// Its place in per-shape tables.
    pub fn index(self) -> usize {
        match self {
            Shape::PerSecond => 0,
            Shape::PerMinute => 1,
            Shape::Bucket => 2,
        }
    }
}

/// How a load balancer in front of the fleet spreads a key's requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Balancer {
    /// Every request to an Envoy drawn at random (round robin, least
    /// request): each (key, Envoy) pair sees `1/N` of the key.
    Uniform,
    /// Consistent hashing on the key (Envoy's ring hash or Maglev, Istio's
    /// `consistentHash`): every request of a key to one Envoy, the keys
    /// spread evenly over the fleet.
    KeyAffine,
}

impl Balancer {
    /// A short label.
    pub fn label(self) -> &'static str {
        match self {
            Balancer::Uniform => "uniform",
            Balancer::KeyAffine => "key-affine",
        }
    }
}

/// The Envoys a simulated key's requests go to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Envoys {
    /// Any of the fleet's `N`, drawn per request.
    All,
    /// `count` Envoys, `first + i·step (mod N)` for `i < count`, drawn per
    /// request: a stand-in for the whole fleet (see [`Key::scale`]).
    Some {
        /// The first.
        first: u32,
        /// The spacing.
        step: u32,
        /// How many.
        count: u32,
    },
    /// This one Envoy only.
    One(u32),
}

/// One simulated key.
#[derive(Debug, Clone)]
pub struct Key {
    /// Its rank in the fleet's key population (1: the hottest).
    pub rank: u64,
    /// Simulated requests per second, fleet-wide.
    pub rate: f64,
    /// The share of the real key's traffic simulated (1: all of it): a key
    /// hotter than the plan's cap is simulated over fewer Envoys (uniform
    /// balancer: each pair at its real rate, `scale` of the pairs) or at a
    /// lower rate (key-affine: its one pair), with its limit scaled alike.
    pub scale: f64,
    /// Real keys it stands for (1 when every key of its stratum is simulated).
    pub key_weight: f64,
    /// Real requests each simulated one stands for (`key_weight / scale`).
    pub request_weight: f64,
    /// Real (key, Envoy) pairs' events — leases, returns, calls' items,
    /// store writes of leases — each simulated one stands for: as
    /// requests under a uniform balancer (its pairs are scaled with its
    /// traffic), `key_weight` under a key-affine one (one pair, whatever
    /// its rate).
    pub pair_weight: f64,
    /// Where its requests go.
    pub envoys: Envoys,
    /// How it is limited.
    pub shape: Shape,
    /// Units per period, as simulated (scaled with its traffic).
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
    /// `rate` requests a second, limited to `limit` per `shape`'s period,
    /// every request of it simulated and standing for itself, sent to
    /// `envoys`.
    pub fn new(index: usize, rate: f64, shape: Shape, limit: u64, over: bool, envoys: Envoys) -> Result<Self, String> {
        let rule = match shape {
            Shape::PerSecond | Shape::PerMinute => Limit::new("fixed_window", limit, shape.period(), "{}")?,
            Shape::Bucket => Limit::new("token_bucket", limit, shape.period(), "{}")?,
        };
        let descriptor = vec![("key".to_string(), format!("k{index}"))];
        let bucket = bucket_key(DOMAIN, &rule, &descriptor);
        Ok(Key {
            rank: index as u64 + 1,
            rate,
            scale: 1.0,
            key_weight: 1.0,
            request_weight: 1.0,
            pair_weight: 1.0,
            envoys,
            shape,
            limit,
            over,
            descriptor,
            rule,
            bucket,
        })
    }

    /// The fingerprint of its pools in every Envoy's table (the filter's is
    /// a keyed hash of the descriptor; any well-mixed 64 bits do).
    pub fn fingerprint(&self) -> u64 {
        mix(self.rank ^ 0x706f_6f6c)
    }
}

/// A fleet's traffic: `envoys` Envoys of two workers, `per_envoy` requests a
/// second each on average, over `keys` keys of Zipf popularity, spread by
/// `balancer`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Traffic {
    /// Envoys in the fleet.
    pub envoys: u32,
    /// Requests a second per Envoy (the fleet's rate over its size).
    pub per_envoy: f64,
    /// Keys the fleet serves.
    pub keys: u64,
    /// How requests are spread.
    pub balancer: Balancer,
}

impl Traffic {
    /// Requests a second, fleet-wide.
    pub fn fleet_rate(&self) -> f64 {
        f64::from(self.envoys) * self.per_envoy
    }

    /// Requests a second of the key of `rank` (Zipf, exponent 1: rank `i`
    /// gets `1/(i·H)` of the fleet's traffic, `H` the key count's harmonic
    /// number).
    pub fn rate_of(&self, rank: u64) -> f64 {
        self.fleet_rate() / (rank as f64 * harmonic(self.keys))
    }
}

/// `1 + 1/2 + … + 1/n`.
pub fn harmonic(n: u64) -> f64 {
    if n < 100_000 {
        (1..=n).map(|i| 1.0 / i as f64).sum()
    } else {
        // Euler–Maclaurin: exact to 1e-12 here.
        let n = n as f64;
        n.ln() + 0.577_215_664_901_532_9 + 1.0 / (2.0 * n) - 1.0 / (12.0 * n * n)
    }
}

/// How a fleet is sampled: at most `per_stratum` keys of each stratum of
/// ranks (`[2^j, 2^(j+1))`), and no key simulated above `rate_cap`
/// requests a second (a uniform balancer's stand-in keeps at least
/// [`MIN_STAND_IN`] Envoys). `Plan::EXACT` simulates everything.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Plan {
    /// Keys drawn per stratum.
    pub per_stratum: u64,
    /// The most requests a second one key is simulated with.
    pub rate_cap: f64,
}

impl Plan {
    /// Every key, every request.
    pub const EXACT: Plan = Plan { per_stratum: u64::MAX, rate_cap: f64::INFINITY };

    /// Whether the plan leaves anything out for `traffic`.
    pub fn is_exact(&self, traffic: &Traffic) -> bool {
        self.per_stratum >= traffic.keys && traffic.rate_of(1) <= self.rate_cap
    }
}

/// The fewest Envoys a uniform balancer's stand-in for a hot key spans: its
/// limit, scaled with its traffic, stays many times a pair's allowance (one
/// allowance holds at most a quarter of a limit).
pub const MIN_STAND_IN: u32 = 8;

/// What a key of `rank` is, from `seed` (the same whatever the plan): its
/// shape, a uniform draw for its limit, and whether it is one of the tenth
/// limited below their demand.
fn character(rank: u64, seed: u64) -> (Shape, f64, bool) {
    let h = mix(seed ^ rank.wrapping_mul(0x9e37_79b9));
    let shape = match h % 4 {
        0 | 1 => Shape::PerSecond,
        2 => Shape::PerMinute,
        _ => Shape::Bucket,
    };
    (shape, unit(h >> 16), (h >> 8) % 10 == 0)
}

/// The ranks a plan simulates and the real keys each stands for: every
/// rank of a stratum no larger than the plan's `per_stratum`, else that
/// many drawn by systematic sampling (an even step from a random start).
fn sampled_ranks(total: u64, per_stratum: u64, seed: u64) -> Vec<(u64, f64)> {
    let mut ranks = Vec::new();
    let mut low = 1u64;
    let mut stratum = 0u64;
    while low <= total {
        let high = low.saturating_mul(2).saturating_sub(1).min(total);
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
}

/// One sampled key before it is made a [`Key`]: what the plan makes of it.
#[derive(Debug, Clone, Copy)]
struct Drawn {
    rank: u64,
    key_weight: f64,
    real_rate: f64,
    scale: f64,
    envoys: Envoys,
    shape: Shape,
    limit: u64,
    over: bool,
}

impl Drawn {
    fn pair_weight(&self, balancer: Balancer) -> f64 {
        match balancer {
            Balancer::Uniform => self.key_weight / self.scale,
            Balancer::KeyAffine => self.key_weight,
        }
    }
}

/// The keys `plan` draws of `traffic`, from `seed`, as numbers.
fn drawn(traffic: &Traffic, plan: &Plan, seed: u64) -> Vec<Drawn> {
    let envoys = traffic.envoys;
    let per_key = traffic.fleet_rate() / harmonic(traffic.keys);
    sampled_ranks(traffic.keys, plan.per_stratum, seed)
        .into_iter()
        .map(|(rank, key_weight)| {
            let real_rate = per_key / rank as f64;
            let (shape, u, chosen) = character(rank, seed);
            let per_period = shape.period().events_at(real_rate);
            // The chosen tenth with demand for two or more units a period
            // get a limit of 30–70 % of it; the rest 1.5–4 times it.
            let over = chosen && per_period >= 2.0;
            let factor = if over { 0.3 + 0.4 * u } else { 1.5 + 2.5 * u };
            let real_limit = (per_period * factor).ceil().max(1.0);
            let home = (mix(seed ^ rank ^ 0x686f_6d65) % u64::from(envoys)) as u32;
            // A stand-in's limit stays at least `MIN_SCALED_LIMIT` units.
            let floor = (MIN_SCALED_LIMIT / real_limit).min(1.0);
            let (scale, where_to) = match traffic.balancer {
                _ if real_rate <= plan.rate_cap || floor >= 1.0 => {
                    (1.0, if traffic.balancer == Balancer::Uniform { Envoys::All } else { Envoys::One(home) })
                }
                Balancer::Uniform => {
                    let wanted = f64::from(envoys) * (plan.rate_cap / real_rate).max(floor);
                    let count = (wanted.ceil() as u32).max(MIN_STAND_IN).min(envoys);
                    let step = (envoys / count).max(1);
                    let scale = f64::from(count) / f64::from(envoys);
                    (scale, if count == envoys { Envoys::All } else { Envoys::Some { first: home, step, count } })
                }
                Balancer::KeyAffine => ((plan.rate_cap / real_rate).max(floor), Envoys::One(home)),
            };
            let limit = (real_limit * scale).round().max(1.0) as u64;
            Drawn { rank, key_weight, real_rate, scale, envoys: where_to, shape, limit, over }
        })
        .collect()
}

/// The keys `plan` simulates of `traffic`, drawn from `seed`.
pub fn fleet(traffic: &Traffic, plan: &Plan, seed: u64) -> Result<Vec<Key>, String> {
    drawn(traffic, plan, seed)
        .into_iter()
        .enumerate()
        .map(|(index, d)| {
            let mut key = Key::new(index, d.real_rate * d.scale, d.shape, d.limit, d.over, d.envoys)?;
            key.rank = d.rank;
            key.scale = d.scale;
            key.key_weight = d.key_weight;
            key.request_weight = d.key_weight / d.scale;
            key.pair_weight = d.pair_weight(traffic.balancer);
            Ok(key)
        })
        .collect()
}

/// What a plan simulates of a fleet, in numbers.
#[derive(Debug, Clone, Copy)]
pub struct Sample {
    /// Simulated requests a second.
    pub rate: f64,
    /// The share of the real fleet's (key, Envoy) pairs it holds, for the
    /// Envoys' tables: simulated requests over the real ones under a
    /// uniform balancer (its pairs come and go with requests), simulated
    /// keys over the real ones under a key-affine one (a key keeps its one
    /// pair).
    pub pair_share: f64,
}

/// What `plan` simulates of `traffic` (without making the keys).
pub fn sample(traffic: &Traffic, plan: &Plan, seed: u64) -> Sample {
    let drawn = drawn(traffic, plan, seed);
    let rate: f64 = drawn.iter().map(|k| k.real_rate * k.scale).sum();
    let pair_share = match traffic.balancer {
        Balancer::Uniform => rate / drawn.iter().map(|k| k.real_rate * k.key_weight).sum::<f64>().max(1e-9),
        Balancer::KeyAffine => drawn.len() as f64 / drawn.iter().map(|k| k.key_weight).sum::<f64>().max(1.0),
    };
    Sample { rate, pair_share }
}

/// Simulated requests a second of `keys`.
pub fn simulated_rate(keys: &[Key]) -> f64 {
    keys.iter().map(|k| k.rate).sum()
}

/// The fewest units a period a stand-in's scaled limit keeps: below it
/// rounding and the grant rules' shares of a limit (an allowance holds at
/// most a quarter of it) would not scale with it.
pub const MIN_SCALED_LIMIT: f64 = 20.0;

/// The lowest rate cap a plan may have under `balancer`. A uniform
/// balancer's stand-in keeps each pair's rate (it spans fewer Envoys): the
/// cap only has to leave it [`MIN_STAND_IN`] Envoys and its limit. A
/// key-affine stand-in is its one pair at a lower rate: it must stay a
/// busy pair (many requests per lease), whose leases a second do not
/// depend on its rate.
pub fn min_rate_cap(balancer: Balancer) -> f64 {
    match balancer {
        Balancer::Uniform => 10.0,
        Balancer::KeyAffine => 20.0,
    }
}

/// The plan for `traffic` within `budget` simulated requests a second:
/// exact if that fits; else the most keys per stratum (halving from 4,096)
/// whose hottest keys, capped at the highest rate that keeps the whole
/// within the budget, are capped no lower than [`min_rate_cap`].
pub fn plan_for(traffic: &Traffic, budget: f64, seed: u64) -> Result<Plan, String> {
    if traffic.fleet_rate() <= budget {
        return Ok(Plan::EXACT);
    }
    let cost = |plan: &Plan| -> f64 { drawn(traffic, plan, seed).iter().map(|k| k.real_rate * k.scale).sum() };
    let mut per_stratum = 4_096u64;
    loop {
        // The highest cap within the budget, by bisection on its logarithm.
        let floor = min_rate_cap(traffic.balancer);
        let (mut low, mut high) = (floor.ln(), traffic.rate_of(1).max(floor).ln());
        let at_floor = Plan { per_stratum, rate_cap: floor };
        if cost(&at_floor) <= budget {
            for _ in 0..30 {
                let mid = (low + high) / 2.0;
                if cost(&Plan { per_stratum, rate_cap: mid.exp() }) <= budget {
                    low = mid;
                } else {
                    high = mid;
                }
            }
            // A round number: the plan is printed.
            let rate_cap = low.exp().floor().max(floor);
            return Ok(Plan { per_stratum, rate_cap });
        }
        if per_stratum <= 8 {
            return Err(format!("no plan fits {budget} requests/s for {traffic:?}"));
        }
        per_stratum /= 2;
    }
}

/// Thin keys for the overshoot budget's table: `count` keys with
/// per-second windows of 10, three in four at 2 requests a second (below
/// the limit), one in four at 20 (twice the limit), over every Envoy.
pub fn thin(count: usize) -> Result<Vec<Key>, String> {
    (0..count)
        .map(|index| {
            let over = index % 4 == 3;
            Key::new(index, if over { 20.0 } else { 2.0 }, Shape::PerSecond, 10, over, Envoys::All)
        })
        .collect()
}

/// `count` keys at `rate` requests a second each, fixed windows of `limit`
/// per second, over every Envoy: the end-to-end shape
/// (`tests/tests/long_tail.rs`: 300 users at 3 a second, 40 a second each).
pub fn flat(count: usize, rate: f64, limit: u64) -> Result<Vec<Key>, String> {
    (0..count).map(|index| Key::new(index, rate, Shape::PerSecond, limit, false, Envoys::All)).collect()
}

/// Every `every`-th of `keys`, each standing for `every` of them: the
/// end-to-end shape sampled, to check the calls model where calls carry
/// many leases.
pub fn every_nth(keys: &[Key], every: usize) -> Result<Vec<Key>, String> {
    keys.iter()
        .step_by(every.max(1))
        .enumerate()
        .map(|(index, k)| {
            let mut key = Key::new(index, k.rate, k.shape, k.limit, k.over, k.envoys)?;
            key.rank = k.rank;
            key.key_weight = every as f64;
            key.request_weight = every as f64;
            key.pair_weight = every as f64;
            Ok(key)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;

    fn traffic(envoys: u32, per_envoy: f64, keys: u64, balancer: Balancer) -> Traffic {
        Traffic { envoys, per_envoy, keys, balancer }
    }

    #[test]
    fn weights_add_up_to_the_fleet_whatever_the_plan() {
        let t = traffic(1_000, 1_000.0, 100_000, Balancer::Uniform);
        for plan in [Plan::EXACT, Plan { per_stratum: 64, rate_cap: 500.0 }] {
            let keys = fleet(&t, &plan, 3).unwrap();
            let represented: f64 = keys.iter().map(|k| k.key_weight).sum();
            assert!((represented - 100_000.0).abs() < 1e-6, "{represented}");
            let requests: f64 = keys.iter().map(|k| k.rate * k.request_weight).sum();
            // Systematic sampling within a stratum whose rates differ up
            // to twofold: within a percent.
            assert!((requests / t.fleet_rate() - 1.0).abs() < 0.01, "{requests}");
        }
    }

    #[test]
    fn a_stand_in_keeps_each_pairs_rate_and_share_of_the_limit() {
        let t = traffic(10_000, 1_000.0, 1_000, Balancer::Uniform);
        let keys = fleet(&t, &Plan { per_stratum: 64, rate_cap: 1_000.0 }, 3).unwrap();
        let hottest = &keys[0];
        let Envoys::Some { count, .. } = hottest.envoys else { panic!("{:?}", hottest.envoys) };
        let per_pair_real = t.rate_of(1) / 10_000.0;
        assert!((hottest.rate / f64::from(count) - per_pair_real).abs() < 1e-9);
        assert_eq!(hottest.pair_weight, hottest.request_weight);
        let affine =
            fleet(&Traffic { balancer: Balancer::KeyAffine, ..t }, &Plan { per_stratum: 64, rate_cap: 1_000.0 }, 3)
                .unwrap();
        assert!((affine[0].rate - 1_000.0).abs() < 1e-9);
        assert_eq!(affine[0].pair_weight, 1.0, "one pair, whatever its rate");
        assert_eq!((affine[0].shape, affine[0].over), (hottest.shape, hottest.over), "the same key");
    }

    #[test]
    fn a_plan_stays_within_its_budget() {
        let t = traffic(10_000, 1_000.0, 1_000_000, Balancer::Uniform);
        let plan = plan_for(&t, 10_000.0, 3).unwrap();
        let keys = fleet(&t, &plan, 3).unwrap();
        assert!(simulated_rate(&keys) <= 10_000.0, "{plan:?}: {}", simulated_rate(&keys));
        assert!(plan.rate_cap >= min_rate_cap(Balancer::Uniform));
        let small = traffic(10, 100.0, 1_000_000, Balancer::Uniform);
        assert_eq!(plan_for(&small, 10_000.0, 3).unwrap(), Plan::EXACT);
    }
}
