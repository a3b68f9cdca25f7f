//! `floodgate-quota`: the central quota service's binary.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, ValueEnum};
use floodgate_core::time::parse_duration;
use floodgate_core::time::{Clock, Nanos};
use floodgate_quota::auth::Tokens;
use floodgate_quota::clock::SystemClock;
use floodgate_quota::config::Domains;
use floodgate_quota::http::{router, AppState};
use floodgate_quota::metrics::ServiceMetrics;
use floodgate_quota::reload::spawn_reloader;
use floodgate_quota::rlqs::{RlqsArgs, RlqsService};
use floodgate_quota::rls::{GrpcArgs, RlsOptions, RlsService};
use floodgate_quota::server::{serve, App, Limits};
use floodgate_quota::service::{Service, Settings, MAX_LEASE_TTL};
use floodgate_quota::store::{StoreOptions, StoreSpec};

/// The allocator: a check makes some 40 small allocations (the request's
/// strings, the decision's keys and values, the answer) and hyper a fresh
/// 8 KiB read buffer per request, which sends glibc's malloc into
/// consolidating its fast bins every time (allocation was ~8 % of a check's
/// CPU on one core; see docs/benchmarks.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Floodgate's central quota service: fleet-wide rate limits for many Envoys.
#[derive(Debug, Parser)]
#[command(name = "floodgate-quota", version, about)]
struct Cli {
    /// A limits file (envoyproxy/ratelimit YAML, one domain per file). Repeat
    /// for several domains. Reloaded when it changes.
    #[arg(long, required = true, value_name = "FILE")]
    config: Vec<PathBuf>,

    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:8081", value_name = "ADDR")]
    listen: SocketAddr,

    /// Where counters live: `memory`, a Redis URL (`redis://host:port/db`),
    /// or a Redis Cluster's seed nodes (`redis+cluster://host:port,host:port…`).
    #[arg(long, default_value = "memory", value_name = "memory|redis://…|redis+cluster://…")]
    store: StoreSpec,

    /// Require `Authorization: Bearer TOKEN` on API calls.
    #[arg(long, env = "FLOODGATE_QUOTA_TOKEN", hide_env_values = true, value_name = "TOKEN")]
    auth_token: Option<String>,

    /// A domain's own token (repeat for several; the environment variable
    /// takes them comma-separated): it admits that domain's JSON API calls
    /// only, and only its bearer reads and posts the domain's near-limit
    /// notices.
    #[arg(
        long,
        env = "FLOODGATE_QUOTA_DOMAIN_TOKENS",
        hide_env_values = true,
        value_delimiter = ',',
        value_name = "DOMAIN=TOKEN"
    )]
    domain_token: Vec<String>,

    /// How long leased tokens stay valid (at most 60s).
    #[arg(long, default_value = "1s", value_parser = duration, value_name = "DURATION")]
    lease_ttl: Duration,

    /// Longest wait for the store before answering 503.
    #[arg(long, default_value = "250ms", value_parser = duration, value_name = "DURATION")]
    store_timeout: Duration,

    /// Whose clock decides with Redis: `redis` (all instances agree) or
    /// `local` (this service's clock).
    #[arg(long, value_enum, default_value_t = ClockChoice::Redis)]
    redis_clock: ClockChoice,

    /// How often the limits files are checked for changes.
    #[arg(long, default_value = "1s", value_parser = duration, value_name = "DURATION")]
    reload_interval: Duration,

    /// What a memory store that starts owes the limit: `forget` starts
    /// afresh (every window after a restart admits at most 1.75 times its
    /// limit until the term after the one in progress ends: its limit, and
    /// what allowances granted before still spend); `reserve` counts, in
    /// every key, what those allowances may still spend, so every such
    /// window admits at most its limit (at a quarter of it meanwhile).
    #[arg(long, value_enum, default_value_t = MemoryRestart::Forget)]
    memory_restart: MemoryRestart,

    /// Most buckets the memory store holds, and most lease records beside
    /// them, one caller's records never more than four times the room left
    /// free (see --callers); entries no longer kept are dropped first, then
    /// new keys get 503.
    #[arg(long, default_value_t = 1_000_000)]
    memory_max_buckets: usize,

    /// Longest wait for a request's headers, and for the next request on an
    /// idle kept-alive connection.
    #[arg(long, default_value = "10s", value_parser = duration, value_name = "DURATION")]
    header_read_timeout: Duration,

    /// Longest time for a request's whole body to arrive (then 408).
    #[arg(long, default_value = "10s", value_parser = duration, value_name = "DURATION")]
    body_read_timeout: Duration,

    /// Most connections open at once; more get 503 and are closed. Keep it
    /// (plus --grpc-max-connections) below the open-files limit (`ulimit -n`).
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u32).range(1..))]
    max_connections: u32,

    /// Most connections one peer address may hold open on each listener,
    /// never more than half its cap (0: no limit). Behind a proxy or load
    /// balancer every connection has its address: set 0.
    #[arg(long, default_value_t = 64)]
    max_connections_per_peer: u32,

    /// How callers are told apart, for what they share: each one's part of
    /// the memory store's lease records, of a key's allowances, of a
    /// domain's notices. `peer`: each IPv4 address, each IPv6 /64. `none`:
    /// not at all (behind a proxy or load balancer that hides them).
    /// Default: `peer`, or `none` with --max-connections-per-peer 0 (what
    /// that flag meant before this one).
    #[arg(long, value_enum)]
    callers: Option<Callers>,

    /// After SIGTERM, how long requests in flight may take before the
    /// connections left are closed.
    #[arg(long, default_value = "10s", value_parser = duration, value_name = "DURATION")]
    shutdown_deadline: Duration,

    /// Log format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,

    #[command(flatten)]
    grpc: GrpcArgs,

    #[command(flatten)]
    rlqs: RlqsArgs,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum MemoryRestart {
    Reserve,
    Forget,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Callers {
    Peer,
    None,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum ClockChoice {
    Redis,
    Local,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

/// The domain tokens of `--domain-token`, checked: `DOMAIN=TOKEN`, a domain
/// the limits files define, once each, every token its own (none the
/// service's token, none another domain's).
fn domain_tokens(
    given: &[String],
    domains: &Domains,
    service: Option<&str>,
) -> Result<HashMap<String, Arc<str>>, String> {
    let mut tokens: HashMap<String, Arc<str>> = HashMap::new();
    for (i, pair) in given.iter().enumerate() {
        let Some((domain, token)) = pair.split_once('=').filter(|(d, t)| !d.is_empty() && !t.is_empty()) else {
            return Err(format!("--domain-token #{}: expected DOMAIN=TOKEN", i + 1));
        };
        if domains.domain(domain).is_none() {
            return Err(format!("--domain-token #{}: no limits file defines domain {domain:?}", i + 1));
        }
        if tokens.contains_key(domain) {
            return Err(format!("--domain-token #{}: domain {domain:?} has a token already", i + 1));
        }
        if service == Some(token) || tokens.values().any(|t| **t == *token) {
            return Err(format!("--domain-token #{}: each token must be its own (one token, one domain)", i + 1));
        }
        tokens.insert(domain.to_string(), Arc::from(token));
    }
    Ok(tokens)
}

fn duration(text: &str) -> Result<Duration, String> {
    parse_duration(text).map(Duration::from).map_err(|e| e.to_string())
}

fn init_logs(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Colours only for a person at a terminal, not in files or journald.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(ansi);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        () = ctrl_c => {},
        () = term => {},
    }
    tracing::info!("shutting down: finishing requests in flight");
}

/// Turns transparent huge pages off for this process. mimalloc asks for
/// them (`madvise(MADV_HUGEPAGE)`) and hands freed memory back to the
/// system a second later; under calls of hundreds of leases every page
/// touched again was a fault that zeroed 2 MiB on the thread serving
/// requests (28 % of the service's core, in stretches of a few hundred
/// microseconds every call on one core waited behind). With 4 KiB pages a
/// fault zeroes what is touched. (It is what `MIMALLOC_ALLOW_THP=0` does,
/// which mimalloc reads before `main`.)
#[cfg(target_os = "linux")]
fn no_huge_pages() {
    // SAFETY: PR_SET_THP_DISABLE takes integer arguments only and touches
    // no memory of this process; a kernel without it returns an error,
    // which changes nothing (the pages stay as they were).
    let _ = unsafe { libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0) };
}

#[cfg(not(target_os = "linux"))]
fn no_huge_pages() {}

fn main() -> ExitCode {
    no_huge_pages();
    let cli = Cli::parse();
    init_logs(cli.log_format);
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            tracing::error!(error = %e, "cannot start the runtime");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            tracing::error!("{message}");
            eprintln!("floodgate-quota: {message}");
            ExitCode::from(2)
        }
    }
}

async fn run(cli: Cli) -> Result<(), String> {
    let lease_ttl = Nanos::from(cli.lease_ttl);
    if lease_ttl > MAX_LEASE_TTL {
        return Err("--lease-ttl must be at most 60s".into());
    }
    let domains = Domains::load(&cli.config).map_err(|e| format!("invalid config: {e}"))?;
    let auth_token: Option<Arc<str>> = cli.auth_token.clone().map(Arc::from);
    let per_domain = domain_tokens(&cli.domain_token, &domains, cli.auth_token.as_deref())?;
    if !per_domain.is_empty() && auth_token.is_none() && cli.grpc.grpc_listen.is_some() {
        // The gRPC APIs know the service's token only: they would be open.
        return Err(
            "--domain-token with --grpc-listen needs --auth-token: RLS and RLQS take the service's token".into()
        );
    }
    let tokens = Arc::new(Tokens::new(auth_token.clone(), per_domain));
    let rlqs_options = cli.rlqs.options(auth_token.clone())?;
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let store = cli.store.open(&StoreOptions {
        clock: clock.clone(),
        timeout: cli.store_timeout,
        local_clock: cli.redis_clock == ClockChoice::Local,
        max_entries: cli.memory_max_buckets,
        owe_earlier_grants: cli.memory_restart == MemoryRestart::Reserve,
    })?;
    let metrics = ServiceMetrics::new().map_err(|e| format!("cannot register metrics: {e}"))?;
    let service = Arc::new(Service::new(domains, store, metrics, Settings { lease_ttl }));
    tracing::info!(domains = service.domains().len(), store = service.store().name(), "limits loaded");

    // Hot reload: a bad file, or one that drops limits, is logged and
    // counted, and the old limits keep serving; SIGHUP applies the files as
    // they are.
    let reloader = spawn_reloader(service.clone(), cli.config.clone(), cli.reload_interval);
    match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
        Ok(mut hangups) => {
            tokio::spawn(async move {
                while hangups.recv().await.is_some() {
                    tracing::info!("SIGHUP: applying the limits files as they are");
                    reloader.apply_as_is();
                }
            });
        }
        Err(e) => tracing::warn!(error = %e, "cannot listen for SIGHUP: limits that a reload drops need a restart"),
    }

    // Idle buckets are dropped in the background so memory follows live keys.
    let sweeper = service.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(10));
        loop {
            tick.tick().await;
            // In steps, requests served in between (with one worker thread,
            // every request used to wait for a whole sweep).
            let dropped = sweeper.store().sweep().await;
            if dropped > 0 {
                tracing::debug!(dropped, "idle entries dropped");
            }
        }
    });

    let listener =
        tokio::net::TcpListener::bind(cli.listen).await.map_err(|e| format!("cannot listen on {}: {e}", cli.listen))?;
    let local = listener.local_addr().map_err(|e| e.to_string())?;
    tracing::info!(address = %local, auth = tokens.any(), "listening");

    // One signal stops both servers; it carries when it came, for the deadline.
    let (stop, stopped) = tokio::sync::watch::channel(None);
    tokio::spawn(async move {
        shutdown_signal().await;
        let _ = stop.send(Some(tokio::time::Instant::now()));
    });
    let until_stopped = |mut rx: tokio::sync::watch::Receiver<Option<tokio::time::Instant>>| async move {
        let _ = rx.wait_for(Option::is_some).await;
    };
    let limits = Limits {
        header_read_timeout: cli.header_read_timeout,
        body_read_timeout: cli.body_read_timeout,
        max_connections: usize::try_from(cli.max_connections).unwrap_or(usize::MAX),
        max_connections_per_peer: usize::try_from(cli.max_connections_per_peer).unwrap_or(usize::MAX),
        shutdown_deadline: cli.shutdown_deadline,
        callers_by_peer: match cli.callers {
            Some(callers) => callers == Callers::Peer,
            None => cli.max_connections_per_peer > 0,
        },
    };
    let grpc = match cli.grpc.grpc_listen {
        Some(address) => {
            let listener = tokio::net::TcpListener::bind(address)
                .await
                .map_err(|e| format!("cannot listen on {address} (--grpc-listen): {e}"))?;
            tracing::info!(address = %listener.local_addr().map_err(|e| e.to_string())?, "gRPC rate limit service listening");
            let options =
                RlsOptions { response_headers: cli.grpc.grpc_response_headers, auth_token: auth_token.clone() };
            // Envoy's rate limit quota service beside it; its streams end
            // when the shutdown starts (Envoys reconnect elsewhere).
            let rlqs = RlqsService::new(service.clone(), rlqs_options);
            let stopper = rlqs.clone();
            let until = until_stopped(stopped.clone());
            tokio::spawn(async move {
                until.await;
                stopper.stop();
            });
            let app = App::Grpc(RlsService::new(service.clone(), options).with_rlqs(rlqs));
            let limits = Limits {
                max_connections: usize::try_from(cli.grpc.grpc_max_connections).unwrap_or(usize::MAX),
                ..limits
            };
            Some(tokio::spawn(serve(listener, app, limits, until_stopped(stopped.clone()))))
        }
        None => None,
    };
    let state = AppState { service, tokens };
    serve(listener, App::Http(router(state)), limits, until_stopped(stopped.clone())).await;
    if let Some(grpc) = grpc {
        // Both servers close what is left at the same deadline.
        let _ = grpc.await;
    }
    tracing::info!("stopped");
    Ok(())
}
