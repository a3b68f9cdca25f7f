//! `floodgate-rlqs-load`: RLQS load for `make quota-bench` (never run by the
//! tests). Opens `--streams` streams of Envoy's rate limit quota protocol
//! to a service, each reporting the same `--buckets` buckets of `--domain`
//! (`{<key>: b<i>}`), as a fleet of Envoys sharing its tenants does, and
//! sends each stream's next report as soon as the last one is answered,
//! for `--duration`. Prints one line: bucket reports decided a second, and
//! the p50 and p99 of an answer (a report of every bucket of a stream,
//! from sending it to its assignments), in milliseconds.

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

/// One stream: its answers' latencies, in microseconds.
async fn stream(args: &Args, until: Instant) -> Result<Vec<u64>, String> {
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
    let mut latencies = Vec::new();
    let mut round = 1;
    while Instant::now() < until {
        let sent = Instant::now();
        sender.send(report(args, 5, round)).await.map_err(|e| e.to_string())?;
        match answers.message().await {
            Ok(Some(_)) => latencies.push(u64::try_from(sent.elapsed().as_micros()).unwrap_or(u64::MAX)),
            Ok(None) => return Err("the stream ended".into()),
            Err(status) => return Err(format!("{status:?}")),
        }
        round += 1;
    }
    Ok(latencies)
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), String> {
    let args: &'static Args = Box::leak(Box::new(Args::parse()));
    let started = Instant::now();
    let until = started + Duration::from_secs(args.duration);
    let tasks: Vec<_> = (0..args.streams).map(|_| tokio::spawn(stream(args, until))).collect();
    let mut latencies = Vec::new();
    for task in tasks {
        latencies.extend(task.await.map_err(|e| e.to_string())??);
    }
    let seconds = started.elapsed().as_secs_f64();
    latencies.sort_unstable();
    let pick = |q: f64| {
        let at = ((latencies.len() as f64 * q) as usize).min(latencies.len().saturating_sub(1));
        latencies.get(at).map_or(f64::NAN, |us| *us as f64 / 1000.0)
    };
    let reports = latencies.len() as f64 * args.buckets as f64;
    println!("{:.2} {:.2}ms {:.2}ms", reports / seconds, pick(0.50), pick(0.99));
    Ok(())
}
