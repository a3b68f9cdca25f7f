//! Loads for the end-to-end tests: many concurrent keep-alive connections,
//! started together, counting the answers.

use std::collections::HashMap;
use std::sync::{Arc, Barrier};
use std::thread;

use crate::envoy::Envoy;
use crate::http::Conn;

/// One request of a load: the label its answers are counted under, its
/// path, and its headers.
#[derive(Debug, Clone)]
pub struct Shot {
    /// What the answers are counted under.
    pub label: String,
    /// The request's path (and query).
    pub path: String,
    /// The request's headers.
    pub headers: Vec<(String, Vec<u8>)>,
}

/// Sends `per_client` requests from each of `clients` concurrent keep-alive
/// connections, started together; `shot(client, i)` says what each request
/// is. Returns, per label, how many answers had each status.
pub fn hammer_with(
    envoy: &Envoy,
    clients: usize,
    per_client: usize,
    shot: impl Fn(usize, usize) -> Shot + Send + Sync + 'static,
) -> HashMap<String, HashMap<u16, usize>> {
    let barrier = Arc::new(Barrier::new(clients));
    let shot = Arc::new(shot);
    let port = envoy.port;
    let handles: Vec<_> = (0..clients)
        .map(|client| {
            let (barrier, shot) = (Arc::clone(&barrier), Arc::clone(&shot));
            thread::spawn(move || {
                let mut conn = Conn::open(port).unwrap();
                barrier.wait();
                let mut seen: HashMap<String, HashMap<u16, usize>> = HashMap::new();
                for i in 0..per_client {
                    let Shot { label, path, headers } = shot(client, i);
                    let headers: Vec<(&str, &[u8])> = headers.iter().map(|(n, v)| (n.as_str(), v.as_slice())).collect();
                    let status = conn.get(&path, &headers).status;
                    *seen.entry(label).or_default().entry(status).or_default() += 1;
                }
                seen
            })
        })
        .collect();
    let mut total: HashMap<String, HashMap<u16, usize>> = HashMap::new();
    for handle in handles {
        for (label, statuses) in handle.join().unwrap() {
            for (status, n) in statuses {
                *total.entry(label.clone()).or_default().entry(status).or_default() += n;
            }
        }
    }
    total
}

/// Sends `per_client` requests to `/api/items` from each of `clients`
/// concurrent keep-alive connections, started together; `key_of(client, i)`
/// picks the x-api-key. Returns the number of 200s per key (keys with none
/// left out), and asserts every answer is 200 or 429.
pub fn hammer(
    envoy: &Envoy,
    clients: usize,
    per_client: usize,
    key_of: fn(usize, usize) -> String,
) -> HashMap<String, usize> {
    let seen = hammer_with(envoy, clients, per_client, move |client, i| {
        let key = key_of(client, i);
        Shot { path: "/api/items".into(), headers: vec![("x-api-key".into(), key.clone().into_bytes())], label: key }
    });
    seen.into_iter()
        .filter_map(|(key, statuses)| {
            for status in statuses.keys() {
                assert!(matches!(status, 200 | 429), "unexpected status {status}");
            }
            statuses.get(&200).map(|&n| (key, n))
        })
        .collect()
}
