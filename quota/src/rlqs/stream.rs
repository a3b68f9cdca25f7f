//! One RLQS stream (one Envoy, one domain): its buckets, each matched once
//! to the limits file, and what each report of them comes to.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use envoy_types::pb::envoy::service::rate_limit_quota::v3::{RateLimitQuotaResponse, RateLimitQuotaUsageReports};
use floodgate_core::lease::shares::{Assigned, Assignment, Report};
use tonic::Status;

use super::wire::{self, Usage};
use super::Shared;
use crate::config::{DescriptorRule, Domains, Limit};
use crate::store::{shares_key, ShareReport};

/// What a bucket of the stream is subject to.
#[derive(Debug, Clone)]
enum Matched {
    /// A limit: shared by demand, in the store under `key`.
    Limited { key: String, limit: Limit },
    /// No limit (no rule, `unlimited`, or a shadow rule, which never
    /// denies): allow-all.
    Free,
}

#[derive(Debug)]
struct Bucket {
    matched: Matched,
    /// The limits it was matched under (a reload matches it again).
    under: Arc<Domains>,
}

/// One stream's state.
#[derive(Debug)]
pub struct Stream {
    shared: Arc<Shared>,
    /// The Envoy's id in the buckets' share tables.
    envoy: u64,
    domain: Option<String>,
    buckets: HashMap<Vec<(String, String)>, Bucket>,
}

impl Stream {
    /// A stream with no bucket yet.
    pub fn new(shared: Arc<Shared>, envoy: u64) -> Self {
        Self { shared, envoy, domain: None, buckets: HashMap::new() }
    }

    /// Buckets it holds.
    pub fn bucket_count(&self) -> usize {
        self.buckets.len()
    }

    /// Records a report and answers the assignments of its buckets
    /// (`None`: nothing to answer). An error ends the stream with its status.
    pub async fn report(
        &mut self,
        message: RateLimitQuotaUsageReports,
    ) -> Result<Option<RateLimitQuotaResponse>, Status> {
        let domain = match (&self.domain, message.domain.as_str()) {
            (None, "") => return Err(Status::invalid_argument("the stream's first report names no domain")),
            (None, name) => name.to_string(),
            (Some(known), "") => known.clone(),
            (Some(known), name) if name == known => known.clone(),
            (Some(known), name) => {
                return Err(Status::invalid_argument(format!(
                    "the stream is of domain {known:?}; a report names {name:?} (one stream per domain)"
                )))
            }
        };
        let domains = self.shared.service.domains();
        let Some(limits) = domains.domain(&domain) else {
            return Err(Status::not_found(format!("unknown domain {domain:?}: no limits file names it")));
        };
        self.domain = Some(domain.clone());
        let usages = wire::usages(message.bucket_quota_usages)
            .map_err(|why| Status::invalid_argument(format!("malformed RateLimitQuotaUsageReports: {why}")))?;
        self.make_room(&usages)?;
        let metrics = self.shared.service.metrics();
        metrics.rlqs_reports.with_label_values(&[&domain]).inc_by(u64::try_from(usages.len()).unwrap_or(u64::MAX));

        // Match new buckets (and all of them after a reload).
        for usage in &usages {
            let stale = self.buckets.get(&usage.entries).is_none_or(|b| !Arc::ptr_eq(&b.under, &domains));
            if stale {
                let matched = match limits.rule_for_set(&usage.entries) {
                    Some((order, DescriptorRule::Limited { limit, shadow: false })) => {
                        Matched::Limited { key: shares_key(&domain, limit, &order), limit: limit.clone() }
                    }
                    _ => Matched::Free,
                };
                let bucket = Bucket { matched, under: Arc::clone(&domains) };
                // New buckets' room was reserved by `make_room`.
                if self.buckets.insert(usage.entries.clone(), bucket).is_none() {
                    metrics.rlqs_buckets.inc();
                }
            }
        }

        // The limited ones' shares, in one call of the store.
        let mut reports = Vec::new();
        let mut answers: Vec<Option<Assigned>> = Vec::with_capacity(usages.len());
        let free = Assigned { assignment: Assignment::AllowAll, ttl: self.shared.timings.ttl };
        for usage in &usages {
            match self.buckets.get(&usage.entries).map(|b| &b.matched) {
                Some(Matched::Limited { key, limit }) => {
                    reports.push(ShareReport {
                        key: key.clone(),
                        limit: limit.clone(),
                        timings: self.shared.timings,
                        report: Report {
                            envoy: self.envoy,
                            allowed: usage.allowed,
                            denied: usage.denied,
                            elapsed: usage.elapsed,
                        },
                    });
                    answers.push(None);
                }
                _ => answers.push(Some(free)),
            }
        }
        if !reports.is_empty() {
            let store = self.shared.service.store();
            let started = Instant::now();
            let decided = match self.shared.turn_in_store(reports.len()).await {
                Ok(_permit) => self.shared.reports.report(store, reports).await,
                Err(failure) => vec![Err(failure); reports.len()],
            };
            metrics.store_latency.with_label_values(&[store.name(), "rlqs"]).observe(started.elapsed().as_secs_f64());
            let mut decided = decided.into_iter();
            for slot in answers.iter_mut().filter(|a| a.is_none()) {
                match decided.next() {
                    Some(Ok(assigned)) => *slot = assigned,
                    // No answer for this bucket: the Envoy keeps its last
                    // assignment until it expires, and reports again.
                    Some(Err(failure)) => {
                        metrics.store_errors.with_label_values(&[store.name(), failure.kind()]).inc();
                        self.shared.log_store_failure(&failure);
                    }
                    None => {}
                }
            }
        }

        let mut actions = Vec::with_capacity(usages.len());
        for (usage, answer) in usages.into_iter().zip(answers) {
            let Some(assigned) = answer else { continue };
            metrics.rlqs_assignments.with_label_values(&[&domain, assigned.assignment.kind()]).inc();
            if assigned.assignment == Assignment::Abandon && self.buckets.remove(&usage.entries).is_some() {
                self.shared.buckets.fetch_sub(1, Ordering::Relaxed);
                metrics.rlqs_buckets.dec();
            }
            actions.push(wire::action(usage.id, &assigned));
        }
        Ok((!actions.is_empty()).then_some(RateLimitQuotaResponse { bucket_action: actions }))
    }

    /// Reserves room for a report's new buckets, or refuses a report that
    /// would take the stream past its share of the buckets' room, or the
    /// room past its size.
    fn make_room(&self, usages: &[Usage]) -> Result<(), Status> {
        let new = usages.iter().filter(|u| !self.buckets.contains_key(&u.entries)).count();
        let per_stream = self.shared.limits.buckets_per_stream();
        if self.buckets.len() + new > per_stream {
            return Err(Status::resource_exhausted(format!(
                "the stream would hold {} buckets; one stream holds at most {per_stream} (a sixteenth of \
                 --rlqs-max-buckets)",
                self.buckets.len() + new
            )));
        }
        let most = self.shared.limits.max_buckets;
        let reserved = self.shared.buckets.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |held| {
            held.checked_add(new).filter(|total| *total <= most)
        });
        match reserved {
            Ok(_) => Ok(()),
            Err(held) => Err(Status::resource_exhausted(format!(
                "the service holds {held} RLQS buckets and {new} more would pass --rlqs-max-buckets ({most})"
            ))),
        }
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        let n = self.buckets.len();
        self.shared.buckets.fetch_sub(n, Ordering::Relaxed);
        self.shared.service.metrics().rlqs_buckets.sub(i64::try_from(n).unwrap_or(i64::MAX));
    }
}
