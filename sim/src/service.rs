//! The quota service as the simulation runs it: a store that is only bytes
//! under keys (what Redis or the memory store holds), and the service's own
//! decision code called as `quota/src/store/calls.rs` calls it — each lease
//! by `lease_on` (its record written beside its bucket), each return by
//! `decide::give_back`, each check by `decide::check`. Lease calls arrive as
//! the JSON bodies the filter builds and answers leave as the JSON the
//! service writes (`LeaseOutcome::to_wire`), so their sizes are the real
//! ones. Every value written is counted: the store writes a call costs.

use floodgate_core::time::Nanos;
use floodgate_protocol::{LeaseRequest, LeaseResponse, ReturnRequest, ReturnResponse};
use floodgate_quota::notices::NoticeBoard;
use floodgate_quota::service::notice_until;
use floodgate_quota::store::decide::{self, LeaseRecord};
use floodgate_quota::store::{lease_key, lease_on, BucketLease, Next};

use crate::keys::{Key, DOMAIN};
use crate::rng::Map;

/// One stored value: its bytes, when the store may forget it (Redis's time
/// to live, from the decision's `idle_at`), and the simulated key it
/// belongs to (to weigh its bytes by the key's sampling weight).
#[derive(Debug, Clone)]
struct Entry {
    bytes: Vec<u8>,
    idle_at: Nanos,
    key: usize,
}

/// What the store did for a call, as simulated (unweighted).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Writes {
    /// Values written (a bucket, a lease record).
    pub values: u64,
}

/// The service's store and settings.
#[derive(Debug)]
pub struct SimulatedService {
    store: Map<String, Entry>,
    /// How long leased tokens stay valid (`--lease-ttl`, 1 s by default).
    ttl: Nanos,
    /// Whether a lease that asks `per_window` may get an allowance (false:
    /// as if the filter never asked, for comparison).
    allowances: bool,
    /// Keys found near their limit (the service's own board).
    notices: NoticeBoard,
}

/// The key index a descriptor names (`k<index>`).
fn key_of(descriptor: &[(String, String)]) -> Option<usize> {
    descriptor.first().and_then(|(_, v)| v.strip_prefix('k')).and_then(|i| i.parse().ok())
}

impl SimulatedService {
    /// An empty store; leases valid `ttl`; allowances granted if `allowances`.
    pub fn new(ttl: Nanos, allowances: bool) -> Self {
        SimulatedService { store: Map::default(), ttl, allowances, notices: NoticeBoard::default() }
    }

    /// The bytes stored under `key` at `now` (an entry past its time to live is gone).
    fn get(&self, key: &str, now: Nanos) -> Option<&[u8]> {
        self.store.get(key).filter(|e| e.idle_at > now).map(|e| e.bytes.as_slice())
    }

    fn put(&mut self, key: &str, next: Next, owner: usize) {
        match self.store.get_mut(key) {
            Some(entry) => *entry = Entry { bytes: next.bytes, idle_at: next.idle_at, key: owner },
            None => {
                self.store.insert(key.to_string(), Entry { bytes: next.bytes, idle_at: next.idle_at, key: owner });
            }
        }
    }

    /// A restart of a service with the memory store: everything is forgotten.
    pub fn restart(&mut self) {
        self.store.clear();
    }

    /// Forgets what has outlived its time to live, as Redis does.
    pub fn expire(&mut self, now: Nanos) {
        self.store.retain(|_, e| e.idle_at > now);
    }

    /// Bytes of keys and values held at `now`, each entry weighted by what
    /// it stands for (a bucket by its key's `key_weight`, a lease record by
    /// its `pair_weight`): all of it, and the lease records' part.
    pub fn size(&self, keys: &[Key], now: Nanos) -> (f64, f64) {
        let (mut all, mut records) = (0.0, 0.0);
        for (name, entry) in self.store.iter().filter(|(_, e)| e.idle_at > now) {
            let bytes = (name.len() + entry.bytes.len()) as f64;
            // A lease record's first byte is its tag, 255.
            let record = entry.bytes.first() == Some(&u8::MAX);
            let weight = keys.get(entry.key).map_or(1.0, |k| if record { k.pair_weight } else { k.key_weight });
            all += bytes * weight;
            if record {
                records += bytes * weight;
            }
        }
        (all, records)
    }

    /// `POST /v1/lease`: the request body in, the response body out, each
    /// lease decided by the store's `lease_on`; and the values written.
    pub fn lease(&mut self, keys: &[Key], body: &[u8], now: Nanos) -> Result<(Vec<u8>, Writes), String> {
        let request: LeaseRequest = serde_json::from_slice(body).map_err(|e| e.to_string())?;
        let mut leases = Vec::with_capacity(request.leases.len());
        let mut writes = Writes::default();
        for want in &request.leases {
            let index = key_of(&want.descriptor).ok_or("a lease of an unknown descriptor")?;
            let key = keys.get(index).ok_or("a lease of an unknown key")?;
            let record_key = lease_key(DOMAIN, &want.id);
            let item = BucketLease {
                key: key.bucket.clone(),
                limit: key.rule.clone(),
                wanted: want.wanted,
                rate: want.rate,
                window: want.window,
                per_window: want.per_window && self.allowances,
                reported: want.reported,
                check: want.check,
                record: record_key.clone(),
                caller: None,
            };
            let values = [&key.bucket, &record_key].map(|at| self.get(at, now).map(<[u8]>::to_vec));
            let (outcome, next) = lease_on(&item, &values, now, self.ttl);
            let outcome = outcome.ok_or("a lease id recorded for another key")?;
            for (at, next) in [&key.bucket, &record_key].into_iter().zip(next) {
                if let Some(next) = next {
                    writes.values += 1;
                    self.put(at, next, index);
                }
            }
            if let Some(until) = notice_until(&outcome, want.reported, &key.rule, now) {
                self.notices.post(DOMAIN, &want.descriptor, until);
            }
            leases.push(outcome.to_wire(&key.rule, false));
        }
        let near = if request.notices { self.notices.current(DOMAIN, now) } else { Vec::new() };
        let body = serde_json::to_vec(&LeaseResponse { leases, near }).map_err(|e| e.to_string())?;
        Ok((body, writes))
    }

    /// `POST /v1/return`: as the store's `give_back` (without its retry
    /// loop: nothing else writes meanwhile). The answer, the tokens given
    /// back and the values written.
    pub fn give_back(&mut self, body: &[u8], now: Nanos) -> Result<(Vec<u8>, u64, Writes), String> {
        let request: ReturnRequest = serde_json::from_slice(body).map_err(|e| e.to_string())?;
        let mut returned = Vec::with_capacity(request.returns.len());
        let mut replayed = Vec::with_capacity(request.returns.len());
        let mut writes = Writes::default();
        for item in &request.returns {
            let record_key = lease_key(DOMAIN, &item.id);
            let owner = self.store.get(&record_key).map_or(0, |e| e.key);
            let Some(mut done) = LeaseRecord::live(self.get(&record_key, now), now) else {
                returned.push(0);
                replayed.push(false);
                continue;
            };
            let (back, next) = decide::give_back(&done, self.get(&done.bucket, now), now, item.tokens);
            let again = done.returned;
            if !again {
                done.returned = true;
                writes.values += 1;
                self.put(&record_key, done.to_next(None), owner);
            }
            if let Some(next) = next {
                let bucket = done.bucket.clone();
                writes.values += 1;
                self.put(&bucket, next, owner);
            }
            returned.push(back);
            replayed.push(again);
        }
        let total = returned.iter().sum();
        let body = serde_json::to_vec(&ReturnResponse { returned, replayed }).map_err(|e| e.to_string())?;
        Ok((body, total, writes))
    }

    /// `POST /v1/check` of one request of `key` (check mode: one
    /// descriptor, one unit): whether it was admitted, and the values
    /// written (the store writes an admitting bucket that changed).
    pub fn check(&mut self, keys: &[Key], index: usize, now: Nanos) -> (bool, Writes) {
        let Some(key) = keys.get(index) else { return (false, Writes::default()) };
        let stored = self.get(&key.bucket, now);
        let (decision, next) = decide::check(&key.rule, stored, now, 1);
        let changed = stored != Some(next.bytes.as_slice());
        if decision.allowed() && changed {
            let bucket = key.bucket.clone();
            self.put(&bucket, next, index);
            return (true, Writes { values: 1 });
        }
        (decision.allowed(), Writes::default())
    }
}
