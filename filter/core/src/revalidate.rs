//! Stale-while-revalidate: at most one refresh per key at a time, across Envoy's workers, in a
//! small fixed table of locks in shared data (`meshcache:refresh:<i>`, `REFRESH_LOCKS` of them:
//! bounded whatever the key space; two keys sharing a lock refresh one after the other).
//!
//! A lock names the key it is held for, until when, and how the refresh goes: in the
//! background (a request the filter sends itself), or by forwarding the next client request
//! (after a background request could not be made or failed: Envoy's async client cannot reach
//! every upstream, e.g. an original-destination cluster).

use crate::cache_control::NotStored;
use crate::hashing::KeyDigest;
use crate::headermap::{header, Headers};
use crate::insert;
use crate::request::Cacheable;
use crate::response;
use crate::store::{Cache, Outcome, SharedData};

/// Locks in the table: also the most refreshes in flight at once (all workers together).
pub const REFRESH_LOCKS: u32 = 64;
/// How long a refresh may take before its lock is free again (the request's own timeout).
pub const REFRESH_TIMEOUT_MS: u64 = 30_000;
/// After a failed background refresh, how long the lock waits for a client request to forward.
pub const FORWARD_WINDOW_MS: u64 = 30_000;

/// Request headers a background refresh repeats (both hosts): all but per-connection ones,
/// conditionals and cache directives (a refresh wants the whole, storable answer), and Envoy's
/// and ours.
pub fn repeats_header(name: &str) -> bool {
    !(matches!(
        name,
        "content-length" | "transfer-encoding" | "connection" | "keep-alive" | "upgrade" | "proxy-connection"
            | "expect" | "if-none-match" | "if-modified-since" | "cache-control" | "pragma"
    ) || name.starts_with("x-envoy-")
        || name.starts_with("x-meshcache-"))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// A background request is in flight (or being sent).
    Background,
    /// The next request for the key is to be forwarded (background requests failed).
    ForwardNext,
    /// A client request was forwarded to refresh the key.
    Forwarding,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Claim {
    /// This request refreshes the key in the background: send it, then `release` or `failed`.
    Background,
    /// This request is forwarded to refresh the key; `release` when its answer is in.
    Forward,
    /// A refresh is already under way (or the lock is busy with another key): serve stale.
    Busy,
}

fn lock_key(key: &KeyDigest) -> String {
    format!("meshcache:refresh:{}", u32::from_be_bytes([key[4], key[5], key[6], key[7]]) % REFRESH_LOCKS)
}

fn encode(key: &KeyDigest, until_ms: u64, mode: Mode) -> Vec<u8> {
    let mut out = Vec::with_capacity(41);
    out.extend_from_slice(key);
    out.extend_from_slice(&until_ms.to_be_bytes());
    out.push(match mode {
        Mode::Background => 0,
        Mode::ForwardNext => 1,
        Mode::Forwarding => 2,
    });
    out
}

fn decode(v: &[u8]) -> Option<(&[u8], u64, Mode)> {
    if v.len() != 41 {
        return None;
    }
    let mut t = [0u8; 8];
    t.copy_from_slice(&v[32..40]);
    let mode = match v[40] {
        0 => Mode::Background,
        1 => Mode::ForwardNext,
        2 => Mode::Forwarding,
        _ => return None,
    };
    Some((&v[..32], u64::from_be_bytes(t), mode))
}

/// Tries to take the refresh of `key` at `now_ms` (one compare-and-swap; no retries: losing the
/// race means someone else refreshes).
pub fn claim<S: SharedData>(data: &S, key: &KeyDigest, now_ms: u64) -> Claim {
    let lk = lock_key(key);
    let (current, cas) = match data.get(&lk) {
        Some((v, cas)) => (v, cas),
        None => (Vec::new(), 0),
    };
    let (mode, claim) = match decode(&current) {
        Some((_, until, _)) if until <= now_ms => (Mode::Background, Claim::Background),
        Some((k, _, Mode::ForwardNext)) if k == &key[..] => (Mode::Forwarding, Claim::Forward),
        Some(_) => return Claim::Busy,
        None => (Mode::Background, Claim::Background),
    };
    let until = now_ms + REFRESH_TIMEOUT_MS;
    // cas 0 (a lock never written) is unconditional in Envoy: two workers may both win the
    // first write of a lock; at worst two refreshes of one key, once.
    if data.set(&lk, &encode(key, until, mode), cas) {
        claim
    } else {
        Claim::Busy
    }
}

/// Frees the lock if `key` still holds it (the refresh is done, stored or not).
pub fn release<S: SharedData>(data: &S, key: &KeyDigest) {
    let lk = lock_key(key);
    if let Some((v, cas)) = data.get(&lk) {
        if decode(&v).map_or(false, |(k, _, _)| k == &key[..]) {
            data.set(&lk, b"", cas);
        }
    }
}

/// A background refresh failed: the next request for the key is forwarded instead.
pub fn failed<S: SharedData>(data: &S, key: &KeyDigest, now_ms: u64) {
    let lk = lock_key(key);
    if let Some((v, cas)) = data.get(&lk) {
        if decode(&v).map_or(false, |(k, _, _)| k == &key[..]) {
            data.set(&lk, &encode(key, now_ms + FORWARD_WINDOW_MS, Mode::ForwardNext), cas);
        }
    }
}

/// A background refresh's answer into the store, in place of the stale entry, under a miss's
/// rules (both hosts): status 200; for gRPC, `grpc-status` 0 from the trailers, or from the
/// headers for a trailers-only answer (`trailers` None: the host's callouts do not deliver
/// trailers, so only a status in the headers can refuse it); storable per policy; within
/// `max_entry_bytes`. Ok: stored.
pub fn store_refresh<S: SharedData>(cache: &Cache<S>, c: &Cacheable, response: &Headers, trailers: Option<&Headers>,
                                    body: Vec<u8>, now_ms: u64, out: &mut Outcome) -> Result<(), NotStored> {
    if header(&response.pairs, ":status") != Some("200") {
        return Err(NotStored::Status);
    }
    if c.grpc {
        let status = trailers.and_then(|t| header(&t.pairs, "grpc-status")).or_else(|| header(&response.pairs, "grpc-status"));
        let unseen = status.is_none() && trailers.is_none();
        if !unseen && status.map(str::trim) != Some("0") {
            return Err(NotStored::GrpcStatus);
        }
    }
    let ttl = response::check_storable(&c.policy, &response.pairs, &response.not_utf8, now_ms)?;
    if body.len() > cache.limits.max_entry_bytes as usize + if c.grpc { 5 } else { 0 } {
        return Err(NotStored::TooBig);
    }
    let mut c = c.clone();
    c.request_ms = now_ms;
    insert::store_answer(cache, &c, &response.pairs, 200, body, ttl, out).map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::tests::MemShared;

    fn key(n: u8, bucket: u8) -> KeyDigest {
        let mut k = [n; 32];
        k[4..8].copy_from_slice(&[0, 0, 0, bucket]);
        k
    }

    #[test]
    fn one_refresh_per_key_then_free() {
        let data = MemShared::default();
        let a = key(1, 3);
        assert_eq!(claim(&data, &a, 1000), Claim::Background);
        assert_eq!(claim(&data, &a, 1001), Claim::Busy, "one refresh at a time");
        assert_eq!(claim(&data, &key(2, 3), 1001), Claim::Busy, "same lock, other key: later");
        assert_eq!(claim(&data, &key(2, 4), 1001), Claim::Background, "other lock");
        release(&data, &key(2, 3));
        assert_eq!(claim(&data, &a, 1002), Claim::Busy, "release by another key does nothing");
        release(&data, &a);
        assert_eq!(claim(&data, &a, 1003), Claim::Background);
        assert_eq!(claim(&data, &a, 1003 + REFRESH_TIMEOUT_MS), Claim::Background, "a lost refresh times out");
    }

    #[test]
    fn a_failed_background_refresh_forwards_the_next_request_once() {
        let data = MemShared::default();
        let a = key(1, 9);
        assert_eq!(claim(&data, &a, 0), Claim::Background);
        failed(&data, &a, 10);
        assert_eq!(claim(&data, &key(2, 9), 11), Claim::Busy);
        assert_eq!(claim(&data, &a, 11), Claim::Forward);
        assert_eq!(claim(&data, &a, 12), Claim::Busy, "one forwarded refresh at a time");
        release(&data, &a);
        assert_eq!(claim(&data, &a, 13), Claim::Background, "then background again");
        failed(&data, &a, 20);
        assert_eq!(claim(&data, &key(2, 9), 20 + FORWARD_WINDOW_MS), Claim::Background, "unused forward expires");
    }

    #[test]
    fn a_refresh_repeats_the_request_but_not_its_conditions_or_hop_headers() {
        for n in [":path", ":authority", "content-type", "x-model-id", "te"] {
            assert!(repeats_header(n), "{}", n);
        }
        for n in ["content-length", "if-none-match", "cache-control", "x-envoy-expected-rq-timeout-ms", "x-meshcache-route-key"] {
            assert!(!repeats_header(n), "{}", n);
        }
    }

    #[test]
    fn table_is_bounded() {
        let data = MemShared::default();
        for n in 0..=255u8 {
            claim(&data, &key(n, n), 0);
        }
        assert!(data.keys() <= REFRESH_LOCKS as usize);
    }
}
