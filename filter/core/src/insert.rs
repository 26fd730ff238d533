//! The one path an origin answer takes into the store: a miss's answer (both hosts) and a
//! background stale-while-revalidate refresh's (the Wasm host) go through `store_answer`.

use crate::cache_control::{NotStored, Ttl};
use crate::request::Cacheable;
use crate::response::{self, Stored};
use crate::grpc;
use crate::hashing::AnswerHasher;
use crate::store::{Cache, Outcome, SharedData, StoreError};

/// Stores `body` (as received: gRPC still framed) as the answer to `c`, replacing what the
/// lookup saw in its slot (`c.seen`). The limits are the cache's (`max_entry_bytes` counts the
/// stored headers too, not only the body). Err: why nothing was stored.
pub fn store_answer<S: SharedData>(
    cache: &Cache<S>,
    c: &Cacheable,
    headers: &[(String, String)],
    status: u16,
    body: Vec<u8>,
    ttl: Ttl,
    out: &mut Outcome,
) -> Result<Stored, NotStored> {
    store_streamed(cache, c, headers, status, body, ttl, None, out)
}

/// `store_answer` for an answer hashed while it streamed through (`AnswerHasher`, fed the body
/// as received); a hash that does not cover exactly the stored body is computed again.
#[allow(clippy::too_many_arguments)]
pub fn store_streamed<S: SharedData>(
    cache: &Cache<S>,
    c: &Cacheable,
    headers: &[(String, String)],
    status: u16,
    body: Vec<u8>,
    ttl: Ttl,
    hashed: Option<AnswerHasher>,
    out: &mut Outcome,
) -> Result<Stored, NotStored> {
    let max = cache.limits.max_entry_bytes;
    let message = if c.grpc { grpc::unframe(&body).ok_or(NotStored::Error)?.to_vec() } else { body };
    if message.len() as u64 > max {
        return Err(NotStored::TooBig);
    }
    let stored = response::build_entry(c, headers, status, message, ttl, hashed)?;
    if stored.entry.encoded_len() as u64 > max {
        return Err(NotStored::TooBig);
    }
    match cache.insert(&stored.entry, c.seen, out) {
        Ok(()) => Ok(stored),
        Err(StoreError::NoSpace) => Err(NotStored::StoreFull),
        Err(StoreError::Contended) => Err(NotStored::Contended),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::cache_control::Ttl;
    use crate::config::{parse_plugin_config, Limits};
    use crate::request::{classify_head, key_request, BodyDecision, HeadDecision, RequestHead};
    use crate::store::tests::MemShared;
    use crate::store::Lookup;

    /// A miss under policy `m` (`ttl_s` 5), with limits of `max_entry` bytes per entry.
    pub(crate) fn cacheable(max_entry: u64) -> (Cacheable, Limits) {
        let cfg = parse_plugin_config(br#"{"policies": [{"model_prefix": "m", "ttl_s": 5}]}"#).unwrap();
        let head = RequestHead { method: "POST", path: "/v2/models/m/infer", headers: &[], not_utf8: &[] };
        let c = match classify_head(&head) {
            HeadDecision::Buffer { source, refresh } => match key_request(&cfg, &head, &source, refresh, br#"{"inputs":[]}"#, || None) {
                BodyDecision::Cacheable(c) => c,
                other => panic!("{:?}", other),
            },
            other => panic!("{:?}", other),
        };
        (c, Limits { max_entry_bytes: max_entry, max_total_bytes: 1 << 20, max_entries: 16 })
    }

    #[test]
    fn an_answer_is_stored_once_and_found() {
        let (c, limits) = cacheable(4096);
        let data = MemShared::default();
        let cache = Cache { data: &data, limits: &limits };
        cache.reconcile(&mut Outcome::default());
        let ttl = Ttl { s: 5, from_policy: true };
        let headers = vec![(":status".to_string(), "200".to_string()), ("content-type".to_string(), "application/json".to_string())];
        let stored = store_answer(&cache, &c, &headers, 200, b"{\"outputs\":[]}".to_vec(), ttl, &mut Outcome::default()).unwrap();
        assert_eq!(stored.added_etag, Some(format!("\"{}\"", stored.entry.response_hash)));
        match cache.lookup(&c.key, c.request_ms, &mut Outcome::default()) {
            Lookup::Hit(e) => assert_eq!(e, stored.entry),
            other => panic!("{:?}", other),
        }
    }

    #[test]
    fn an_answer_hashed_while_streaming_stores_the_same_entry() {
        let (c, limits) = cacheable(1 << 16);
        let ttl = Ttl { s: 5, from_policy: true };
        let headers = vec![(":status".to_string(), "200".to_string()), ("content-type".to_string(), "application/json".to_string())];
        let body = br#"{"outputs":[1,2,3]}"#.to_vec();
        let one_shot = {
            let data = MemShared::default();
            let cache = Cache { data: &data, limits: &limits };
            cache.reconcile(&mut Outcome::default());
            store_answer(&cache, &c, &headers, 200, body.clone(), ttl, &mut Outcome::default()).unwrap().entry
        };
        // Right, and wrong (declared one byte short: hashed whole again) streamed hashes.
        for declared in [body.len(), body.len() - 1] {
            let data = MemShared::default();
            let cache = Cache { data: &data, limits: &limits };
            cache.reconcile(&mut Outcome::default());
            let mut h = AnswerHasher::http(declared as u64);
            h.update(&body[..7]);
            h.update(&body[7..]);
            let stored = store_streamed(&cache, &c, &headers, 200, body.clone(), ttl, Some(h), &mut Outcome::default()).unwrap();
            assert_eq!(stored.entry, one_shot);
        }
        // gRPC: the hasher reads the frame; the entry holds the message.
        let mut g = c.clone();
        g.grpc = true;
        let data = MemShared::default();
        let cache = Cache { data: &data, limits: &limits };
        cache.reconcile(&mut Outcome::default());
        let framed = grpc::frame(b"\x0a\x03abc");
        let mut h = AnswerHasher::grpc();
        h.update(&framed[..3]);
        h.update(&framed[3..]);
        let stored = store_streamed(&cache, &g, &headers, 200, framed.clone(), ttl, Some(h), &mut Outcome::default()).unwrap();
        let data2 = MemShared::default();
        let cache2 = Cache { data: &data2, limits: &limits };
        cache2.reconcile(&mut Outcome::default());
        assert_eq!(stored.entry, store_answer(&cache2, &g, &headers, 200, framed, ttl, &mut Outcome::default()).unwrap().entry);
    }

    #[test]
    fn too_big_counts_the_stored_headers_and_stores_nothing() {
        let (c, limits) = cacheable(64);
        let data = MemShared::default();
        let cache = Cache { data: &data, limits: &limits };
        cache.reconcile(&mut Outcome::default());
        let ttl = Ttl { s: 5, from_policy: true };
        // The body fits max_entry_bytes alone; with the entry's headers it does not.
        let body = vec![b'x'; 60];
        assert_eq!(store_answer(&cache, &c, &[], 200, body, ttl, &mut Outcome::default()).unwrap_err(), NotStored::TooBig);
        assert_eq!(data.stored_bytes(), 0);
        let (mut g, _) = cacheable(64);
        g.grpc = true;
        assert_eq!(store_answer(&cache, &g, &[], 200, b"\x00\x00".to_vec(), ttl, &mut Outcome::default()).unwrap_err(), NotStored::Error);
    }
}
