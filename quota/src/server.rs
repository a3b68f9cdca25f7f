//! The server loop: accepts connections and serves the JSON API over
//! HTTP/1.1 or Envoy's rate limit service API over gRPC (HTTP/2), with the
//! limits `axum::serve` and tonic's server lack, so that slow, half-open or
//! greedy clients cannot hold the service:
//!
//! - a **header-read timeout**: a request's complete head (HTTP/1.1), or the
//!   HTTP/2 connection preface (gRPC), must arrive within it; it also closes
//!   a connection idle that long (a kept-alive HTTP/1.1 connection; a gRPC
//!   connection without a call in flight, with a `GOAWAY`);
//! - a **body-read timeout**: a request's whole body must arrive within it,
//!   however slowly it trickles (408 over HTTP; a gRPC call is answered
//!   `DEADLINE_EXCEEDED` when it has not been answered by then);
//! - a **connection cap**: beyond it a new connection is refused at once
//!   (HTTP: a 503; gRPC: closed), rather than waiting in the kernel's queue
//!   or using up the open-files limit;
//! - a **per-peer cap**: one peer address holds at most so many of the
//!   connections, so one client cannot take them all (and, with the cap on,
//!   each request carries its peer address as its [`Caller`], which the
//!   memory store charges lease records to);
//! - a **shutdown deadline**: after the shutdown signal no connection is
//!   accepted, requests in flight finish, and whatever is still open at the
//!   deadline is closed;
//! - **one request per turn** of a connection's task (HTTP/1.1): a client
//!   pipelining requests gets the next one started only after every other
//!   connection ready meanwhile has had its turn, so a pipelined flood cannot
//!   hold the event loop (see [`Turn`]).

use std::collections::HashMap;
use std::error::Error as StdError;
use std::fmt;
use std::future::Future;
use std::io;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::Router;
use http_body::{Body as HttpBody, Frame, SizeHint};
use hyper::body::Incoming;
use hyper::server::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio::time::{sleep, Instant, Sleep};
use tower::ServiceExt;

use crate::rls::RlsService;
use crate::store::Caller;

/// The server's limits (each a command-line flag of the binary).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Longest wait for a request's complete head (or a gRPC connection's
    /// preface), and for the next request on an idle connection.
    pub header_read_timeout: Duration,
    /// Longest time to receive a request's whole body, from its head (for a
    /// gRPC call: to answer it).
    pub body_read_timeout: Duration,
    /// Most connections open at once.
    pub max_connections: usize,
    /// Most connections open at once from one peer address (0: no limit;
    /// never more than half of `max_connections`, see [`Limits::peer_share`]).
    pub max_connections_per_peer: usize,
    /// After the shutdown signal, how long requests in flight may take.
    pub shutdown_deadline: Duration,
    /// Whether peer addresses tell callers apart (see [`Caller::of`]): each
    /// request then carries its caller, whose share the service keeps of
    /// what callers share (the memory store's lease records, a key's
    /// allowances, a domain's notices). Off behind a proxy that gives every
    /// caller its own address; independent of the per-peer connection cap.
    pub callers_by_peer: bool,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            header_read_timeout: Duration::from_secs(10),
            body_read_timeout: Duration::from_secs(10),
            max_connections: 512,
            max_connections_per_peer: 64,
            shutdown_deadline: Duration::from_secs(10),
            callers_by_peer: true,
        }
    }
}

impl Limits {
    /// Most connections one peer address may hold: `max_connections_per_peer`,
    /// but never more than half the cap, so that one client always leaves
    /// room for the others whatever the two flags say (0: no limit).
    pub fn peer_share(&self) -> usize {
        match self.max_connections_per_peer {
            0 => 0,
            share => share.min((self.max_connections / 2).max(1)),
        }
    }
}

/// What a listener serves.
#[derive(Debug, Clone)]
pub enum App {
    /// The JSON API (and health, readiness, metrics) over HTTP/1.1.
    Http(Router),
    /// Envoy's rate limit service API over gRPC.
    Grpc(RlsService),
}

/// Sent to a connection beyond the cap, without reading its request.
const REFUSAL: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
content-length: 64\r\nconnection: close\r\n\r\n{\"error\":\"too many connections to the quota service; try again\"}";

/// The error a request body yields once its deadline passes; the HTTP layer
/// answers it with 408.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BodyTimeout(pub Duration);

impl fmt::Display for BodyTimeout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "the request body did not arrive within {:?}", self.0)
    }
}

impl StdError for BodyTimeout {}

/// A request body that fails with [`BodyTimeout`] when it has not been read
/// completely by its deadline (one deadline for the whole body, so a client
/// sending a byte now and then cannot stretch it).
struct DeadlineBody {
    inner: Incoming,
    deadline: Pin<Box<Sleep>>,
    limit: Duration,
}

impl HttpBody for DeadlineBody {
    type Data = Bytes;
    type Error = Box<dyn StdError + Send + Sync>;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if let Poll::Ready(frame) = Pin::new(&mut self.inner).poll_frame(cx) {
            return Poll::Ready(frame.map(|f| f.map_err(Into::into)));
        }
        match self.deadline.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Some(Err(Box::new(BodyTimeout(self.limit))))),
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Serves `app` on `listener` until `shutdown` completes, then stops
/// accepting, lets requests in flight finish for up to
/// [`Limits::shutdown_deadline`] and closes what is left.
pub async fn serve(listener: TcpListener, app: App, limits: Limits, shutdown: impl Future<Output = ()>) {
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    let probes = Arc::new(ProbeSlots::default());
    let peers = Arc::new(Peers::default());
    let (stop, stopping) = watch::channel(false);
    let mut connections = JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            () = &mut shutdown => break,
            // Reap finished connections so the set holds only open ones.
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            accepted = listener.accept() => {
                let (stream, peer) = match accepted {
                    Ok(accepted) => accepted,
                    Err(e) => {
                        // Out of file descriptors or similar: back off
                        // instead of spinning; connections will close.
                        tracing::warn!(error = %e, "cannot accept a connection");
                        sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let Ok(permit) = permits.clone().try_acquire_owned() else {
                    match app {
                        App::Http(_) => refuse_unless_health(stream, peer.ip(), &probes, "the connection cap is reached"),
                        App::Grpc(_) => refuse(&stream, &app, "the connection cap is reached"),
                    }
                    continue;
                };
                let Some(slot) = Peers::take(&peers, peer.ip(), limits.peer_share()) else {
                    match app {
                        App::Http(_) => {
                            refuse_unless_health(stream, peer.ip(), &probes, "the peer holds its share of connections");
                        }
                        App::Grpc(_) => refuse(&stream, &app, "the peer holds its share of connections"),
                    }
                    continue;
                };
                let _ = stream.set_nodelay(true);
                let held = Held { _permit: permit, _slot: slot };
                let stopping = stopping.clone();
                // Peer addresses tell callers apart unless told they do not
                // (behind a proxy, every caller has the proxy's address).
                let caller = limits.callers_by_peer.then(|| Caller::of(peer.ip()));
                match &app {
                    App::Http(router) => {
                        connections.spawn(serve_http(stream, router.clone(), limits, stopping, held, caller))
                    }
                    App::Grpc(rls) => connections.spawn(serve_grpc(stream, rls.clone(), limits, stopping, held)),
                };
            }
        }
    }
    drop(listener);
    stop.send_replace(true);
    let deadline = Instant::now() + limits.shutdown_deadline;
    while !connections.is_empty() {
        tokio::select! {
            _ = connections.join_next() => {}
            () = tokio::time::sleep_until(deadline) => {
                tracing::warn!(open = connections.len(), "shutdown deadline passed: closing the connections left");
                connections.shutdown().await;
            }
        }
    }
}

/// What an open connection holds: its place under the cap and its peer's.
struct Held {
    _permit: OwnedSemaphorePermit,
    _slot: PeerSlot,
}

/// Open connections per peer address.
#[derive(Debug, Default)]
struct Peers {
    open: Mutex<HashMap<IpAddr, usize>>,
}

impl Peers {
    /// A place for one more connection of `peer`, if it holds fewer than
    /// `most` (0: any number).
    fn take(peers: &Arc<Peers>, peer: IpAddr, most: usize) -> Option<PeerSlot> {
        let mut open = peers.open.lock().unwrap_or_else(|p| p.into_inner());
        let count = open.entry(peer).or_insert(0);
        if most > 0 && *count >= most {
            return None;
        }
        *count += 1;
        Some(PeerSlot { peers: Arc::clone(peers), peer })
    }
}

/// One connection's place in its peer's share; given back when dropped.
struct PeerSlot {
    peers: Arc<Peers>,
    peer: IpAddr,
}

impl Drop for PeerSlot {
    fn drop(&mut self) {
        let mut open = self.peers.open.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(count) = open.get_mut(&self.peer) {
            *count -= 1;
            if *count == 0 {
                open.remove(&self.peer);
            }
        }
    }
}

/// Waits until `stopping` says so.
async fn stopped(mut stopping: watch::Receiver<bool>) {
    let _ = stopping.wait_for(|stop| *stop).await;
}

async fn serve_http(
    stream: TcpStream,
    router: Router,
    limits: Limits,
    stopping: watch::Receiver<bool>,
    held: Held,
    caller: Option<Caller>,
) {
    let body_read_timeout = limits.body_read_timeout;
    let turn = Arc::new(Turn::default());
    let turns = Arc::clone(&turn);
    let service = hyper::service::service_fn(move |request: hyper::Request<Incoming>| {
        let mut request = request.map(|inner| {
            Body::new(DeadlineBody { inner, deadline: Box::pin(sleep(body_read_timeout)), limit: body_read_timeout })
        });
        if let Some(caller) = caller {
            request.extensions_mut().insert(caller);
        }
        let (router, turn) = (router.clone(), Arc::clone(&turns));
        async move {
            turn.take().await;
            router.oneshot(request).await
        }
    });
    let mut http = http1::Builder::new();
    http.timer(TokioTimer::new()).header_read_timeout(limits.header_read_timeout);
    let connection = http.serve_connection(TokioIo::new(stream), service);
    tokio::pin!(connection);
    tokio::select! {
        result = turn.of(connection.as_mut()) => {
            if let Err(e) = result {
                tracing::debug!(error = %e, "connection ended");
            }
        }
        () = stopped(stopping) => {
            // Idle connections close now, busy ones after their response.
            connection.as_mut().graceful_shutdown();
            let _ = turn.of(connection).await;
        }
    }
    drop(held);
}

/// A connection's turn: one poll of its task. Each turn starts at most one
/// request; a request of a client that pipelines (its next request already
/// read when the last one is answered) waits for the connection's next turn,
/// after the tasks ready meanwhile, every other connection's included. Tokio
/// defers a yielding task's wake-up until the worker has looked for I/O
/// readiness again, so a connection whose pipelined requests keep it ready
/// cannot keep the others' readiness unseen (hyper serves up to 16 steps of
/// a connection per poll, and tokio looks for I/O every 61 polls while
/// tasks are ready: of 100 pipelined checks, 16 were decided before another
/// connection's one sent after them, 1 now). A client sending one request
/// at a time never waits here.
#[derive(Debug, Default)]
struct Turn {
    started: AtomicBool,
}

impl Turn {
    /// Waits for the connection's next turn if this one has started a
    /// request already.
    async fn take(&self) {
        if self.started.swap(true, Ordering::Relaxed) {
            tokio::task::yield_now().await;
        }
    }

    /// `connection`, each of whose polls is a new turn.
    fn of<'a, F: Future>(&'a self, connection: Pin<&'a mut F>) -> Turns<'a, F> {
        Turns { turn: self, connection }
    }
}

/// A connection's future, polled turn by turn (see [`Turn`]).
struct Turns<'a, F> {
    turn: &'a Turn,
    connection: Pin<&'a mut F>,
}

impl<F: Future> Future for Turns<'_, F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        self.turn.started.store(false, Ordering::Relaxed);
        self.connection.as_mut().poll(cx)
    }
}

async fn serve_grpc(stream: TcpStream, rls: RlsService, limits: Limits, stopping: watch::Receiver<bool>, held: Held) {
    let activity = Arc::new(Activity::default());
    let calls = Arc::clone(&activity);
    let service = hyper::service::service_fn(move |request: hyper::Request<Incoming>| {
        let call = calls.begin();
        let rls = rls.clone();
        let answer = tokio::time::timeout(limits.body_read_timeout, rls.clone().oneshot(request));
        async move {
            let response = match answer.await {
                Ok(Ok(response)) => response,
                Err(_) | Ok(Err(_)) => {
                    rls.count(tonic::Code::DeadlineExceeded);
                    tonic::Status::deadline_exceeded(format!(
                        "the call was not complete within {:?} (--body-read-timeout)",
                        limits.body_read_timeout
                    ))
                    .into_http()
                }
            };
            // The call is in flight until its answer's body ends: a stream
            // (RLQS) keeps its connection from being closed as idle.
            Ok::<_, std::convert::Infallible>(
                response.map(|body| tonic::body::Body::new(Tracked { body, _call: call })),
            )
        }
    });
    let io = TokioIo::new(Preface::new(stream, limits.header_read_timeout));
    let mut http = http2::Builder::new(TokioExecutor::new());
    http.timer(TokioTimer::new()).max_concurrent_streams(MAX_STREAMS);
    let connection = http.serve_connection(io, service);
    tokio::pin!(connection);
    tokio::select! {
        result = connection.as_mut() => {
            if let Err(e) = result {
                tracing::debug!(error = %e, "gRPC connection ended");
            }
        }
        () = activity.idle_for(limits.header_read_timeout) => {
            // A GOAWAY; a call that raced it still finishes.
            connection.as_mut().graceful_shutdown();
            closing(connection, limits).await;
        }
        () = stopped(stopping) => {
            connection.as_mut().graceful_shutdown();
            closing(connection, limits).await;
        }
    }
    drop(held);
}

/// Waits for a gRPC connection told to go away, for at most a call's time
/// (`--body-read-timeout`): HTTP/2 closes only when the client answers the
/// PING sent with the GOAWAY, and a client that sent the preface and fell
/// silent never does. Then the connection is dropped (closed).
async fn closing<C: Future>(connection: Pin<&mut C>, limits: Limits) {
    let _ = tokio::time::timeout(limits.body_read_timeout, connection).await;
}

/// Calls one gRPC connection may have open at once.
const MAX_STREAMS: u32 = 128;

/// The calls in flight on one connection, and when the last one ended.
#[derive(Debug)]
struct Activity {
    in_flight: AtomicUsize,
    /// Milliseconds from `since` to the end of the last call.
    last_ms: AtomicU64,
    since: Instant,
}

impl Default for Activity {
    fn default() -> Self {
        Activity { in_flight: AtomicUsize::new(0), last_ms: AtomicU64::new(0), since: Instant::now() }
    }
}

impl Activity {
    fn begin(self: &Arc<Self>) -> Call {
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        Call(Arc::clone(self))
    }

    /// Completes once the connection has had no call in flight for `idle`.
    async fn idle_for(&self, idle: Duration) {
        loop {
            let last = self.since + Duration::from_millis(self.last_ms.load(Ordering::SeqCst));
            let until = last + idle;
            if self.in_flight.load(Ordering::SeqCst) == 0 && Instant::now() >= until {
                return;
            }
            tokio::time::sleep_until(until.max(Instant::now() + idle / 4)).await;
        }
    }
}

/// A call in flight; its end is the connection's latest activity.
struct Call(Arc<Activity>);

/// An answer's body, holding its call in flight until the body is done
/// (sent, or dropped with the stream).
struct Tracked {
    body: tonic::body::Body,
    _call: Call,
}

impl HttpBody for Tracked {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

impl Drop for Call {
    fn drop(&mut self) {
        let elapsed = u64::try_from(self.0.since.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.0.last_ms.store(elapsed, Ordering::SeqCst);
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The HTTP/2 client connection preface (RFC 9113, section 3.4).
const PREFACE_LEN: usize = 24;

/// A connection whose first [`PREFACE_LEN`] bytes must arrive within a
/// deadline: a client that connects and never speaks (or trickles) is cut
/// off. Reads after the preface are not timed here.
struct Preface<S> {
    inner: S,
    read: usize,
    deadline: Option<Pin<Box<Sleep>>>,
}

impl<S> Preface<S> {
    fn new(inner: S, within: Duration) -> Self {
        Preface { inner, read: 0, deadline: Some(Box::pin(sleep(within))) }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Preface<S> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let result = Pin::new(&mut self.inner).poll_read(cx, buf);
        self.read += buf.filled().len() - before;
        if self.read >= PREFACE_LEN {
            self.deadline = None;
        }
        if let (Poll::Pending, Some(deadline)) = (&result, self.deadline.as_mut()) {
            if deadline.as_mut().poll(cx).is_ready() {
                return Poll::Ready(Err(io::Error::new(io::ErrorKind::TimedOut, "no HTTP/2 preface in time")));
            }
        }
        result
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Preface<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Refuses a connection beyond a cap: over HTTP with a 503 if the socket
/// takes it at once; over gRPC by closing it. No task, no wait.
fn refuse(stream: &TcpStream, app: &App, why: &str) {
    tracing::debug!(why, "connection refused");
    if let App::Http(_) = app {
        let _ = stream.try_write(REFUSAL);
    }
}

/// Connections beyond the caps that may still be asked what they want, at
/// once: enough for probes, too few to matter as load.
const PROBES: usize = 32;

/// Most of [`PROBES`] one caller (a peer address, an IPv6 /64) holds: a
/// client reopening silent connections beyond the caps as fast as they are
/// dropped holds a few, never all (40 from one address, reopened, made
/// every `/healthz` probe beyond the caps a `503`).
const PROBES_PER_CALLER: usize = 4;

/// How long a connection beyond the caps has to send its request line.
const PROBE_READ: Duration = Duration::from_millis(250);

/// The places of connections beyond the caps waiting for their request
/// line: at most [`PROBES`], at most [`PROBES_PER_CALLER`] of one caller.
/// When all are taken, a newcomer takes the place of the oldest waiting
/// connection of the caller holding the most, if that caller holds at least
/// two more than the newcomer's: so however many addresses a flood of
/// silent connections comes from, each holds no more places than any other
/// caller, and a probe from an address holding none finds one.
#[derive(Debug, Default)]
struct ProbeSlots {
    held: Mutex<ProbesHeld>,
}

#[derive(Debug, Default)]
struct ProbesHeld {
    next: u64,
    /// Each place: its number, its caller, and how to end its wait.
    places: Vec<(u64, Caller, Option<tokio::sync::oneshot::Sender<()>>)>,
}

/// A connection's place among [`ProbeSlots`], given back when dropped.
struct ProbePlace {
    slots: Arc<ProbeSlots>,
    id: u64,
}

impl Drop for ProbePlace {
    fn drop(&mut self) {
        let mut held = self.slots.held.lock().unwrap_or_else(|p| p.into_inner());
        held.places.retain(|(id, _, _)| *id != self.id);
    }
}

impl ProbeSlots {
    /// A place for a connection of `caller`, and what ends its wait early
    /// (another caller took its place); `None` when it may have none.
    fn take(slots: &Arc<ProbeSlots>, caller: Caller) -> Option<(ProbePlace, tokio::sync::oneshot::Receiver<()>)> {
        let mut held = slots.held.lock().unwrap_or_else(|p| p.into_inner());
        let count = |who: Caller, places: &[(u64, Caller, Option<tokio::sync::oneshot::Sender<()>>)]| {
            places.iter().filter(|(_, c, _)| *c == who).count()
        };
        let mine = count(caller, &held.places);
        if mine >= PROBES_PER_CALLER {
            return None;
        }
        if held.places.len() >= PROBES {
            // The oldest place of the caller holding the most.
            let (most, victim) =
                held.places.iter().map(|(_, c, _)| (count(*c, &held.places), *c)).max_by_key(|(n, _)| *n)?;
            if most < mine + 2 {
                return None;
            }
            let at = held.places.iter().position(|(_, c, _)| *c == victim)?;
            let (_, _, evict) = held.places.remove(at);
            if let Some(evict) = evict {
                let _ = evict.send(());
            }
        }
        let id = held.next;
        held.next += 1;
        let (evict, evicted) = tokio::sync::oneshot::channel();
        held.places.push((id, caller, Some(evict)));
        Some((ProbePlace { slots: Arc::clone(slots), id }, evicted))
    }
}

/// Health is the process serving, not the connection load: a probe's
/// `GET /healthz` is answered `200` even when the caps are full (a liveness
/// probe must not restart a serving instance whose connections a flood
/// holds). Beyond the caps a connection is given [`PROBE_READ`] to send its
/// request line, in one of the [`ProbeSlots`]; `/healthz` gets `ok`,
/// anything else (or nothing by then, or no place to wait, or its place
/// taken by another caller's connection) the refusal.
fn refuse_unless_health(stream: TcpStream, peer: IpAddr, probes: &Arc<ProbeSlots>, why: &'static str) {
    let Some((place, evicted)) = ProbeSlots::take(probes, Caller::of(peer)) else {
        tracing::debug!(why, "connection refused");
        let _ = stream.try_write(REFUSAL);
        return;
    };
    tokio::spawn(async move {
        let _place = place;
        let mut stream = stream;
        let health = tokio::select! {
            health = asks_for_health(&mut stream) => health,
            _ = evicted => false,
        };
        if health {
            use tokio::io::AsyncWriteExt;
            let _ = tokio::time::timeout(PROBE_READ, stream.write_all(HEALTHY)).await;
        } else {
            tracing::debug!(why, "connection refused");
            let _ = stream.try_write(REFUSAL);
        }
    });
}

/// Whether the request line that arrives within [`PROBE_READ`] is `GET /healthz`.
async fn asks_for_health(stream: &mut TcpStream) -> bool {
    use tokio::io::AsyncReadExt;
    const LINE: &[u8] = b"GET /healthz";
    let mut head = [0u8; LINE.len() + 1];
    let mut got = 0;
    let read = async {
        while got < head.len() {
            match stream.read(&mut head[got..]).await {
                Ok(0) | Err(_) => return,
                Ok(n) => got += n,
            }
        }
    };
    let _ = tokio::time::timeout(PROBE_READ, read).await;
    got == head.len() && head.starts_with(LINE) && matches!(head.last(), Some(b' ' | b'?'))
}

/// `/healthz`'s answer to a probe beyond the caps.
const HEALTHY: &[u8] =
    b"HTTP/1.1 200 OK\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: 3\r\nconnection: close\r\n\r\nok\n";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_refusal_is_a_complete_json_response() {
        let text = std::str::from_utf8(REFUSAL).unwrap_or_default();
        let (head, body) = text.split_once("\r\n\r\n").unwrap_or_default();
        assert!(head.contains(&format!("content-length: {}", body.len())), "{head}");
        let value: serde_json::Value = serde_json::from_str(body).unwrap_or_default();
        assert!(value["error"].as_str().is_some_and(|e| e.contains("too many connections")), "{body}");
    }
}
