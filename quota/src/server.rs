//! The server loop: accepts connections and serves the router over HTTP/1.1
//! with the limits `axum::serve` lacks, so that slow or half-open clients
//! cannot hold the service:
//!
//! - a **header-read timeout**, which also closes kept-alive connections that
//!   stay idle that long (hyper counts from the moment it waits for a head);
//! - a **body-read timeout**: a request's whole body must arrive within it,
//!   however slowly it trickles (408 otherwise);
//! - a **connection cap**: beyond it a new connection gets an immediate 503
//!   and is closed, rather than waiting in the kernel's queue or using up the
//!   open-files limit;
//! - a **shutdown deadline**: after the shutdown signal no connection is
//!   accepted, requests in flight finish, and whatever is still open at the
//!   deadline is closed.

use std::error::Error as StdError;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::Router;
use http_body::{Body as HttpBody, Frame, SizeHint};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinSet;
use tokio::time::{sleep, Instant, Sleep};
use tower::ServiceExt;

/// The server's limits (each a command-line flag of the binary).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Longest wait for a request's complete head, and for the next request
    /// on a kept-alive connection.
    pub header_read_timeout: Duration,
    /// Longest time to receive a request's whole body, from its head.
    pub body_read_timeout: Duration,
    /// Most connections open at once.
    pub max_connections: usize,
    /// After the shutdown signal, how long requests in flight may take.
    pub shutdown_deadline: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            header_read_timeout: Duration::from_secs(10),
            body_read_timeout: Duration::from_secs(10),
            max_connections: 512,
            shutdown_deadline: Duration::from_secs(10),
        }
    }
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

/// Serves `router` on `listener` until `shutdown` completes, then stops
/// accepting, lets requests in flight finish for up to
/// [`Limits::shutdown_deadline`] and closes what is left.
pub async fn serve(listener: TcpListener, router: Router, limits: Limits, shutdown: impl Future<Output = ()>) {
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    let (stop, stopping) = watch::channel(false);
    let mut connections = JoinSet::new();
    let mut http = http1::Builder::new();
    http.timer(TokioTimer::new()).header_read_timeout(limits.header_read_timeout);
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            () = &mut shutdown => break,
            // Reap finished connections so the set holds only open ones.
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            accepted = listener.accept() => {
                let stream = match accepted {
                    Ok((stream, _)) => stream,
                    Err(e) => {
                        // Out of file descriptors or similar: back off
                        // instead of spinning; connections will close.
                        tracing::warn!(error = %e, "cannot accept a connection");
                        sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let Ok(permit) = permits.clone().try_acquire_owned() else {
                    refuse(&stream);
                    continue;
                };
                let _ = stream.set_nodelay(true);
                let router = router.clone();
                let body_read_timeout = limits.body_read_timeout;
                let service = hyper::service::service_fn(move |request: hyper::Request<Incoming>| {
                    let request = request.map(|inner| {
                        Body::new(DeadlineBody {
                            inner,
                            deadline: Box::pin(sleep(body_read_timeout)),
                            limit: body_read_timeout,
                        })
                    });
                    router.clone().oneshot(request)
                });
                let connection = http.serve_connection(TokioIo::new(stream), service);
                let mut stopping = stopping.clone();
                connections.spawn(async move {
                    let _permit = permit;
                    tokio::pin!(connection);
                    tokio::select! {
                        result = connection.as_mut() => {
                            if let Err(e) = result {
                                tracing::debug!(error = %e, "connection ended");
                            }
                        }
                        _ = async { stopping.wait_for(|stop| *stop).await.map(|_| ()) } => {
                            // Idle connections close now, busy ones after
                            // their response.
                            connection.as_mut().graceful_shutdown();
                            let _ = connection.await;
                        }
                    }
                });
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

/// Answers a connection beyond the cap with a 503 if the socket takes it at
/// once, and closes it: no task, no wait.
fn refuse(stream: &TcpStream) {
    tracing::debug!("connection refused: the connection cap is reached");
    let _ = stream.try_write(REFUSAL);
}

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
