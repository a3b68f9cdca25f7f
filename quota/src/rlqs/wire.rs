//! RLQS messages: what a usage report says (checked, with a message naming
//! the field for anything malformed) and an assignment as Envoy's
//! `BucketAction`.

use std::collections::HashSet;

use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::{BlanketRule, Strategy};
use envoy_types::pb::envoy::r#type::v3::{RateLimitStrategy, TokenBucket as ProtoTokenBucket};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::{
    AbandonAction, BucketAction as Action, QuotaAssignmentAction,
};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::BucketAction;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::BucketId;
use envoy_types::pb::google::protobuf::{Duration as ProtoDuration, UInt32Value};
use floodgate_core::lease::shares::{Assigned, Assignment};
use floodgate_core::time::{Nanos, SECOND};
use floodgate_protocol::{MAX_ENTRIES, MAX_ENTRY_LEN};

/// One bucket's usage, checked: its entries sorted by key (a bucket id is a
/// map: this is the one order every Envoy's id of the bucket comes to).
#[derive(Debug, Clone, PartialEq)]
pub struct Usage {
    /// The bucket id's entries, sorted.
    pub entries: Vec<(String, String)>,
    /// The bucket id as Envoy sent it, to name the bucket in the answer.
    pub id: BucketId,
    /// Requests allowed since the last report.
    pub allowed: u64,
    /// Requests denied since the last report.
    pub denied: u64,
    /// The time they were counted over.
    pub elapsed: Nanos,
}

/// Checks every usage of a report: a bucket id of 1 to [`MAX_ENTRIES`]
/// entries with non-empty keys, keys and values of at most
/// [`MAX_ENTRY_LEN`] bytes, each bucket once, a `time_elapsed` that is a
/// duration (not negative, nanoseconds below a second). The message names
/// the field.
pub fn usages(reports: Vec<BucketQuotaUsage>) -> Result<Vec<Usage>, String> {
    let mut seen = HashSet::with_capacity(reports.len());
    let mut out = Vec::with_capacity(reports.len());
    for (i, usage) in reports.into_iter().enumerate() {
        let field = format!("bucket_quota_usages[{i}]");
        let id = usage.bucket_id.unwrap_or_default();
        if id.bucket.is_empty() {
            return Err(format!("{field}.bucket_id is empty: a bucket id needs at least one entry"));
        }
        if id.bucket.len() > MAX_ENTRIES {
            return Err(format!(
                "{field}.bucket_id has {} entries; at most {MAX_ENTRIES} are allowed",
                id.bucket.len()
            ));
        }
        let mut entries: Vec<(String, String)> = id.bucket.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        entries.sort();
        for (key, value) in &entries {
            if key.is_empty() {
                return Err(format!("{field}.bucket_id has an empty key"));
            }
            if key.len() > MAX_ENTRY_LEN || value.len() > MAX_ENTRY_LEN {
                return Err(format!(
                    "{field}.bucket_id has an entry too long; keys and values are at most {MAX_ENTRY_LEN} bytes"
                ));
            }
        }
        let elapsed = match usage.time_elapsed {
            None => Nanos::ZERO,
            Some(d) => duration(&d)
                .ok_or_else(|| format!("{field}.time_elapsed is not a duration ({}s {}ns)", d.seconds, d.nanos))?,
        };
        if !seen.insert(entries.clone()) {
            return Err(format!("{field} reports a bucket an earlier usage of this report already did"));
        }
        out.push(Usage {
            entries,
            id,
            allowed: usage.num_requests_allowed,
            denied: usage.num_requests_denied,
            elapsed,
        });
    }
    Ok(out)
}

/// A protobuf duration as nanoseconds, if it is one (not negative).
fn duration(d: &ProtoDuration) -> Option<Nanos> {
    let seconds = u64::try_from(d.seconds).ok()?;
    let nanos = u64::try_from(d.nanos).ok().filter(|n| *n < SECOND.get())?;
    Some(Nanos::from_secs(seconds) + Nanos::from_nanos(nanos))
}

/// Whole seconds as a protobuf duration.
fn seconds(span: Nanos) -> ProtoDuration {
    ProtoDuration { seconds: i64::try_from(span / SECOND).unwrap_or(i64::MAX), nanos: 0 }
}

/// An assignment as Envoy's `BucketAction` for the bucket `id`.
///
/// A token bucket's fill interval is whole seconds (Envoy 1.40 reads only
/// those: 500 ms would be an unlimited rate) and carries its count of
/// seconds again as nanoseconds (`k s + k ns`, which Envoy reads as `k s`):
/// Envoy 1.40 decides whether a new token bucket replaces the one it runs by
/// comparing `max_tokens`, `tokens_per_fill` and only the nanoseconds of the
/// fill interval, so a share moving from one token per 2 s to one per 3 s
/// would otherwise keep the old rate.
pub fn action(id: BucketId, assigned: &Assigned) -> BucketAction {
    let ttl = Some(seconds(assigned.ttl));
    let strategy = |strategy| QuotaAssignmentAction {
        assignment_time_to_live: ttl,
        rate_limit_strategy: Some(RateLimitStrategy { strategy: Some(strategy) }),
    };
    let action = match assigned.assignment {
        Assignment::TokenBucket(bucket) => {
            let whole = seconds(bucket.fill_interval);
            let nanos = i32::try_from(whole.seconds).ok().filter(|n| *n < 1_000_000_000).unwrap_or(0);
            Action::QuotaAssignmentAction(strategy(Strategy::TokenBucket(ProtoTokenBucket {
                max_tokens: bucket.max_tokens,
                tokens_per_fill: Some(UInt32Value { value: bucket.tokens_per_fill }),
                fill_interval: Some(ProtoDuration { seconds: whole.seconds, nanos }),
            })))
        }
        Assignment::AllowAll => {
            Action::QuotaAssignmentAction(strategy(Strategy::BlanketRule(BlanketRule::AllowAll as i32)))
        }
        Assignment::DenyAll => {
            Action::QuotaAssignmentAction(strategy(Strategy::BlanketRule(BlanketRule::DenyAll as i32)))
        }
        Assignment::Abandon => Action::AbandonAction(AbandonAction {}),
    };
    BucketAction { bucket_id: Some(id), bucket_action: Some(action) }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::collections::HashMap;

    use floodgate_core::lease::shares::TokenBucket;

    use super::*;

    fn usage(entries: &[(&str, &str)], elapsed: Option<ProtoDuration>) -> BucketQuotaUsage {
        BucketQuotaUsage {
            bucket_id: Some(BucketId {
                bucket: entries.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<HashMap<_, _>>(),
            }),
            time_elapsed: elapsed,
            num_requests_allowed: 3,
            num_requests_denied: 1,
        }
    }

    #[test]
    fn usages_are_checked_and_named_by_field() {
        let ok = usages(vec![usage(&[("b", "2"), ("a", "1")], Some(ProtoDuration { seconds: 5, nanos: 0 }))]).unwrap();
        assert_eq!(ok[0].entries, vec![("a".to_string(), "1".to_string()), ("b".to_string(), "2".to_string())]);
        assert_eq!(ok[0].elapsed, Nanos::from_secs(5));
        let refused = |u: BucketQuotaUsage| usages(vec![usage(&[("t", "x")], None), u]).unwrap_err();
        assert!(refused(usage(&[], None)).starts_with("bucket_quota_usages[1].bucket_id is empty"));
        assert!(refused(usage(&[("", "x")], None)).contains("empty key"));
        assert!(refused(usage(&[("k", &"v".repeat(257))], None)).contains("at most 256 bytes"));
        let many: Vec<(String, String)> = (0..17).map(|i| (format!("k{i}"), String::new())).collect();
        let many: Vec<(&str, &str)> = many.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        assert!(refused(usage(&many, None)).contains("17 entries"));
        let negative = refused(usage(&[("k", "v")], Some(ProtoDuration { seconds: -1, nanos: 0 })));
        assert!(negative.contains("time_elapsed is not a duration"), "{negative}");
        assert!(refused(usage(&[("k", "v")], Some(ProtoDuration { seconds: 1, nanos: 1_000_000_000 })))
            .contains("time_elapsed"));
        assert!(refused(usage(&[("t", "x")], None)).contains("already did"));
    }

    #[test]
    fn token_buckets_carry_whole_seconds_twice() {
        let assigned = Assigned {
            assignment: Assignment::TokenBucket(TokenBucket {
                max_tokens: 1,
                tokens_per_fill: 1,
                fill_interval: Nanos::from_secs(3),
            }),
            ttl: Nanos::from_secs(15),
        };
        let BucketAction { bucket_action: Some(Action::QuotaAssignmentAction(a)), .. } =
            action(BucketId::default(), &assigned)
        else {
            panic!()
        };
        assert_eq!(a.assignment_time_to_live, Some(ProtoDuration { seconds: 15, nanos: 0 }));
        let Some(Strategy::TokenBucket(b)) = a.rate_limit_strategy.unwrap().strategy else { panic!() };
        assert_eq!(b.fill_interval, Some(ProtoDuration { seconds: 3, nanos: 3 }));
        assert_eq!(b.tokens_per_fill, Some(UInt32Value { value: 1 }));
    }
}
