//! Stale-while-revalidate refreshes (proxy-wasm glue): the request the filter sends itself to
//! the upstream cluster of the client's route, owned by the root context so it outlives the
//! client's stream (answered at once from the stale entry), and what its answer does.

use crate::abi::{self, Buffer, Map};
use meshcache_core::config::Limits;
use meshcache_core::request::Cacheable;
use crate::metrics::{self, count};
use meshcache_core::revalidate;
use meshcache_core::store::{Cache, Outcome};
use std::cell::RefCell;
use std::collections::HashMap;

struct Pending {
    c: Cacheable,
    limits: Limits,
    sent_ms: u64,
}

thread_local! {
    /// Refreshes this worker has in flight, by call token. Bounded: the lock table bounds them
    /// across workers, and entries whose answer can never come (the owning root context went
    /// away with a configuration change) are dropped once they are past their timeout.
    static PENDING: RefCell<HashMap<u32, Pending>> = RefCell::new(HashMap::new());
}

/// The upstream cluster Envoy chose for this request's route.
pub fn cluster_name() -> Option<String> {
    abi::property(&["xds", "cluster_name"]).and_then(|b| String::from_utf8(b).ok()).filter(|c| !c.is_empty())
}

/// Sends the refresh of `c` (the client's request again); false when it cannot be sent.
pub fn start(root: u32, stream: u32, c: &Cacheable, request: &[(String, String)], body: &[u8], limits: &Limits, now: u64) -> bool {
    let full = PENDING.with(|p| {
        let mut p = p.borrow_mut();
        p.retain(|_, v| now < v.sent_ms + 2 * revalidate::REFRESH_TIMEOUT_MS);
        p.len() >= revalidate::REFRESH_LOCKS as usize
    });
    let cluster = match cluster_name() {
        Some(c) if !full => c,
        _ => return false,
    };
    let headers: Vec<(&str, &str)> =
        request.iter().filter(|(n, _)| revalidate::repeats_header(n)).map(|(n, v)| (n.as_str(), v.as_str())).collect();
    match abi::http_call(root, stream, &cluster, &headers, body, revalidate::REFRESH_TIMEOUT_MS as u32) {
        Some(token) => {
            let mut c = c.clone();
            c.request_ms = now;
            PENDING.with(|p| p.borrow_mut().insert(token, Pending { c, limits: limits.clone(), sent_ms: now }));
            true
        }
        None => false,
    }
}

/// The refresh's answer (or its failure: no headers) is in.
pub fn on_response(token: u32, body_size: usize) {
    let p = match PENDING.with(|p| p.borrow_mut().remove(&token)) {
        Some(p) => p,
        None => return,
    };
    let now = abi::now_ms();
    if store(&p, body_size, now) {
        revalidate::release(&abi::HostShared, &p.c.key);
    } else {
        count(metrics::REFRESH_FAILURES, 1);
        revalidate::failed(&abi::HostShared, &p.c.key, now);
    }
}

/// Stores a good answer in place of the stale entry, under the rules of a miss's
/// (`revalidate::store_refresh`, with the answer's trailers).
fn store(p: &Pending, body_size: usize, now: u64) -> bool {
    let response = abi::headers(Map::HttpCallResponseHeaders);
    let trailers = abi::headers(Map::HttpCallResponseTrailers);
    let limit = p.limits.max_entry_bytes as usize + if p.c.grpc { 5 } else { 0 };
    if body_size > limit {
        return false;
    }
    let body = if body_size == 0 { Vec::new() } else { abi::buffer(Buffer::HttpCallResponseBody, 0, body_size).unwrap_or_default() };
    if body.len() != body_size {
        return false;
    }
    let cache = Cache { data: &abi::HostShared, limits: &p.limits };
    let mut out = Outcome::default();
    let result = revalidate::store_refresh(&cache, &p.c, &response, Some(&trailers), body, now, &mut out);
    metrics::record_outcome(&out);
    if result.is_ok() {
        count(metrics::STORES, 1);
    }
    result.is_ok()
}
