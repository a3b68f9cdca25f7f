//! A script resent after a dropped connection makes the decision its first
//! send made (else one check may count twice), even when another instance
//! wrote the keys in between. A proxy between the service and Redis forwards
//! the first script, lets another instance check the same key once Redis has
//! applied it, then drops the connection before the reply: the service resends
//! on a new connection, and the key counts two checks, not three.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use floodgate_core::time::{Clock, FakeClock, SECOND};
use floodgate_e2e::RedisServer;
use floodgate_quota::config::Limit;
use floodgate_quota::store::{BucketCheck, QuotaStore, RedisOptions, RedisStore};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

fn store(url: &str, clock: &Arc<FakeClock>) -> QuotaStore {
    let shared: Arc<dyn Clock> = clock.clone();
    let options = RedisOptions { timeout: Duration::from_secs(5), clock: Some(shared), clock_bound: None };
    QuotaStore::new(Arc::new(RedisStore::new(url, options).unwrap()))
}

/// Forwards connections to Redis at `to`; while `armed`, the first reply to
/// an `EVALSHA` is held: `between` runs, then the client's connection is
/// dropped without the reply.
async fn proxy(listener: TcpListener, to: u16, armed: Arc<AtomicBool>, between: Arc<QuotaStore>, item: BucketCheck) {
    loop {
        let Ok((mut client, _)) = listener.accept().await else { return };
        let mut redis = TcpStream::connect(("127.0.0.1", to)).await.unwrap();
        let (armed, between, item) = (armed.clone(), between.clone(), item.clone());
        tokio::spawn(async move {
            let (mut buf_c, mut buf_r) = (vec![0u8; 65_536], vec![0u8; 65_536]);
            let mut script_sent = false;
            loop {
                tokio::select! {
                    n = client.read(&mut buf_c) => {
                        let Ok(n) = n else { return };
                        if n == 0 { return; }
                        script_sent |= armed.load(Ordering::SeqCst) && buf_c[..n].windows(7).any(|w| w == b"EVALSHA");
                        if redis.write_all(&buf_c[..n]).await.is_err() { return; }
                    }
                    n = redis.read(&mut buf_r) => {
                        let Ok(n) = n else { return };
                        if n == 0 { return; }
                        if script_sent && armed.swap(false, Ordering::SeqCst) {
                            // Applied by Redis; another instance writes; the
                            // reply is lost with the connection.
                            assert!(between.check(std::slice::from_ref(&item)).await.unwrap().committed);
                            return;
                        }
                        if client.write_all(&buf_r[..n]).await.is_err() { return; }
                    }
                }
            }
        });
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resent_script_makes_its_first_sends_decision() {
    let redis = RedisServer::start();
    let port: u16 = redis.url().trim_start_matches("redis://127.0.0.1:").trim_end_matches('/').parse().unwrap();
    let clock = Arc::new(FakeClock::new(common::T0));
    let limit = Limit::new("fixed_window", 10, SECOND.times(3_600), "{}").unwrap();
    let item = BucketCheck { key: "fg:{resend}:fw:one".into(), limit, cost: 1, shadow: false };
    let other = Arc::new(store(&redis.url(), &clock));
    let armed = Arc::new(AtomicBool::new(false));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let through = format!("redis://{}/", listener.local_addr().unwrap());
    tokio::spawn(proxy(listener, port, armed.clone(), other.clone(), item.clone()));
    let service = store(&through, &clock);

    // Known keys and a live connection first.
    assert!(service.check(std::slice::from_ref(&item)).await.unwrap().committed);
    armed.store(true, Ordering::SeqCst);
    let resent = service.check(std::slice::from_ref(&item)).await.unwrap();
    assert!(!armed.load(Ordering::SeqCst), "the proxy dropped the first send's reply");
    assert!(resent.committed, "the first send admitted it, and so does the answer");
    let after = other.check(&[BucketCheck { cost: 0, ..item.clone() }]).await.unwrap();
    assert_eq!(after.decisions[0].remaining, 7, "three checks counted (one before, the resent one once, the other's)");
}
