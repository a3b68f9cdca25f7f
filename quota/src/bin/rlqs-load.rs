//! `floodgate-rlqs-load`: RLQS load for `make quota-bench` (never run by the
//! tests). Opens `--streams` streams of Envoy's rate limit quota protocol
//! to a service, each reporting the same `--buckets` buckets of `--domain`
//! (`{<key>: b<i>}`), as a fleet of Envoys sharing its tenants does, and
//! sends each stream's next report as soon as the last one is answered,
//! for `--duration`. Prints one line: bucket reports answered a second,
//! the p50 and p99 of an answer (a report of every bucket of a stream,
//! from sending it to its assignments), in milliseconds, and the bucket
//! reports left unanswered.
//!
//! The service answers only the buckets it decided: a report whose
//! buckets the store could not decide in time (`--store-timeout`) is
//! answered in part, or not at all (the Envoy keeps its assignments). A
//! report not answered within `--answer-timeout` is counted unanswered,
//! whole, and the stream goes on with its next one, as an Envoy does at its
//! next interval; so the run reports what happened instead of waiting for
//! an answer that will not come. (An answer that came later than that
//! would be taken for the next report's: the timeout is well above the
//! time the service takes to answer or give up, its store timeout.)

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use clap::Parser;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_client::RateLimitQuotaServiceClient;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{BucketId, RateLimitQuotaUsageReports};
use envoy_types::pb::google::protobuf::Duration as ProtoDuration;
use tokio::sync::mpsc;

/// RLQS load: streams × buckets, closed loop.
#[derive(Debug, Parser)]
#[command(name = "floodgate-rlqs-load")]
struct Args {
    /// The service's gRPC address.
    #[arg(long)]
    target: String,
    /// The domain reported.
    #[arg(long, default_value = "bench")]
    domain: String,
    /// The bucket id's key.
    #[arg(long, default_value = "tenant")]
    key: String,
    /// Streams (Envoys).
    #[arg(long, default_value_t = 100)]
    streams: usize,
    /// Buckets each stream reports (the same ones on every stream).
    #[arg(long, default_value_t = 1000)]
    buckets: usize,
    /// How long to report, in seconds.
    #[arg(long, default_value_t = 5)]
    duration: u64,
    /// How long to wait for a report's answer before counting it
    /// unanswered and sending the next, in milliseconds.
    #[arg(long, default_value_t = 6000)]
    answer_timeout: u64,
}

struct Outgoing(mpsc::Receiver<RateLimitQuotaUsageReports>);

impl futures_core::Stream for Outgoing {
    type Item = RateLimitQuotaUsageReports;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.0.poll_recv(cx)
    }
}

fn report(args: &Args, elapsed: i64, round: u64) -> RateLimitQuotaUsageReports {
    let usages = (0..args.buckets)
        .map(|i| BucketQuotaUsage {
            bucket_id: Some(BucketId { bucket: [(args.key.clone(), format!("b{i}"))].into_iter().collect() }),
            time_elapsed: Some(ProtoDuration { seconds: elapsed, nanos: 0 }),
            num_requests_allowed: 10 + (round + i as u64) % 7,
            num_requests_denied: round % 3,
        })
        .collect();
    RateLimitQuotaUsageReports { domain: args.domain.clone(), bucket_quota_usages: usages }
}

/// What one stream saw: its answers' latencies (microseconds), the bucket
/// reports answered, and those not.
#[derive(Default)]
struct Seen {
    latencies: Vec<u64>,
    answered: u64,
    unanswered: u64,
}

/// One stream.
async fn stream(args: &Args, until: Instant) -> Result<Seen, String> {
    let mut client = RateLimitQuotaServiceClient::connect(format!("http://{}", args.target))
        .await
        .map_err(|e| e.to_string())?
        .max_decoding_message_size(64 << 20)
        .max_encoding_message_size(64 << 20);
    let (sender, receiver) = mpsc::channel(2);
    // The buckets' first report, answered by nothing (see the service).
    sender.send(report(args, 0, 0)).await.map_err(|e| e.to_string())?;
    let mut answers =
        client.stream_rate_limit_quotas(Outgoing(receiver)).await.map_err(|e| e.to_string())?.into_inner();
    let mut seen = Seen::default();
    let buckets = u64::try_from(args.buckets).unwrap_or(u64::MAX);
    let wait = Duration::from_millis(args.answer_timeout);
    let mut round = 1;
    while Instant::now() < until {
        let sent = Instant::now();
        sender.send(report(args, 5, round)).await.map_err(|e| e.to_string())?;
        match tokio::time::timeout(wait, answers.message()).await {
            Ok(Ok(Some(answer))) => {
                seen.latencies.push(u64::try_from(sent.elapsed().as_micros()).unwrap_or(u64::MAX));
                let actions = u64::try_from(answer.bucket_action.len()).unwrap_or(u64::MAX).min(buckets);
                seen.answered += actions;
                seen.unanswered += buckets - actions;
            }
            Ok(Ok(None)) => return Err("the stream ended".into()),
            Ok(Err(status)) => return Err(format!("{status:?}")),
            Err(_) => seen.unanswered += buckets,
        }
        round += 1;
    }
    Ok(seen)
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), String> {
    let args: &'static Args = Box::leak(Box::new(Args::parse()));
    let started = Instant::now();
    let until = started + Duration::from_secs(args.duration);
    let tasks: Vec<_> = (0..args.streams).map(|_| tokio::spawn(stream(args, until))).collect();
    let mut all = Seen::default();
    for task in tasks {
        let seen = task.await.map_err(|e| e.to_string())??;
        all.latencies.extend(seen.latencies);
        all.answered += seen.answered;
        all.unanswered += seen.unanswered;
    }
    let seconds = started.elapsed().as_secs_f64();
    let mut latencies = all.latencies;
    latencies.sort_unstable();
    let pick = |q: f64| {
        let at = ((latencies.len() as f64 * q) as usize).min(latencies.len().saturating_sub(1));
        latencies.get(at).map_or(f64::NAN, |us| *us as f64 / 1000.0)
    };
    println!("{:.2} {:.2}ms {:.2}ms {}", all.answered as f64 / seconds, pick(0.50), pick(0.99), all.unanswered);
    Ok(())
}
