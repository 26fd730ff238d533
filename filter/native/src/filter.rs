//! One HTTP stream through the phase-1 cache: POST KServe v2 REST inference requests under a
//! policy are keyed, looked up in the process-wide store, answered from it (a local reply), or
//! forwarded and their 200 answers stored.
//!
//! The stream talks to Envoy only through `Host` (lib.rs implements it over the ABI; the tests
//! below over a fake), the shape phase 2 gives the shared core (DESIGN.md).
//!
//! THROWAWAY KEYING (phase 1 only): the key is sha256(path, 0x00, body) — no model/version
//! parsing of the body, no colour, vary headers, principal scope or ignored fields. Phase 2
//! replaces it with the core's key (filter/src/keybody.rs and decide.rs today).

use std::sync::Arc;
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

use crate::config::{infer_model, Config};
use crate::store::{Entry, Key, Store, Stored};

pub const CACHE_STATUS: &str = "cache-status";
pub const HIT_PREFIX: &str = "meshcache; hit; ttl=";
pub const MISS_STORED: &[u8] = b"meshcache; fwd=miss; stored";
pub const MISS: &[u8] = b"meshcache; fwd=miss";
pub const MISS_TOO_BIG: &[u8] = b"meshcache; fwd=miss; detail=too-big";
pub const BYPASS: &[u8] = b"meshcache; fwd=bypass";
pub const BYPASS_TOO_BIG: &[u8] = b"meshcache; fwd=bypass; detail=too-big";
/// The most a stream holds back (request body to key, answer to store), whatever
/// max_entry_bytes says: under Envoy's default 1 MiB buffer limit (an Istio sidecar's), so
/// holding never makes Envoy fail the request. Phase 1 stores only answers it can hold; storing
/// larger ones while they stream through is the full filter's (phase 2).
pub const MAX_HELD_BYTES: usize = 768 * 1024;

/// What the filter needs from its proxy for one stream.
pub trait Host {
    fn request_header(&self, name: &str) -> Option<&[u8]>;
    fn response_header(&self, name: &str) -> Option<&[u8]>;
    fn set_response_header(&mut self, name: &str, value: &[u8]);
    /// Visits the body bytes that arrived with this callback.
    fn received_body(&self, response: bool, f: &mut dyn FnMut(&[u8]));
    /// Visits the whole body seen so far (what was held back plus what arrived now), once each.
    fn whole_body(&self, response: bool, f: &mut dyn FnMut(&[u8]));
    fn send_response(&mut self, status: u32, headers: &[(&str, &[u8])], body: &[u8]);
    fn now(&self) -> Instant;
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    Continue,
    /// Headers: hold them (the body decides). Body: keep buffering.
    Hold,
    /// Body: a local reply was sent; drop what arrived.
    Stop,
}

enum State {
    /// Not ours: no header, no work.
    Ignore,
    /// Passed through with this Cache-Status.
    Pass(&'static [u8]),
    /// Reading the request body into the key.
    Keying { hasher: Sha256, ttl: Duration, seen: usize },
    /// Forwarded; the answer is stored if it qualifies.
    Miss { key: Key, ttl: Duration },
    /// Holding the answer back until it is complete.
    Storing { key: Key, ttl: Duration, content_type: Box<[u8]>, seen: usize },
    /// Answered locally.
    Hit,
    Done,
}

pub struct Stream {
    config: Arc<Config>,
    store: Arc<Store>,
    state: State,
}

impl Stream {
    pub fn new(config: Arc<Config>, store: Arc<Store>) -> Stream {
        Stream { config, store, state: State::Ignore }
    }

    pub fn on_request_headers(&mut self, host: &mut dyn Host, end_of_stream: bool) -> Flow {
        if host.request_header(":method") != Some(b"POST") {
            return Flow::Continue;
        }
        let path = match host.request_header(":path") {
            Some(p) => p,
            None => return Flow::Continue,
        };
        let model = match infer_model(path) {
            Some(m) => m,
            None => return Flow::Continue,
        };
        let ttl = match self.config.policy(model) {
            Some(p) => Duration::from_secs(p.ttl_s),
            None => {
                self.state = State::Pass(BYPASS);
                return Flow::Continue;
            }
        };
        if end_of_stream {
            self.state = State::Pass(BYPASS); // no body to key
            return Flow::Continue;
        }
        let mut hasher = Sha256::new();
        hasher.update(path);
        hasher.update([0u8]);
        self.state = State::Keying { hasher, ttl, seen: 0 };
        Flow::Hold
    }

    pub fn on_request_body(&mut self, host: &mut dyn Host, end_of_stream: bool) -> Flow {
        let max = MAX_HELD_BYTES;
        let (key, ttl) = match &mut self.state {
            State::Keying { hasher, ttl, seen } => {
                host.received_body(false, &mut |chunk| {
                    *seen += chunk.len();
                    hasher.update(chunk);
                });
                if *seen > max {
                    self.state = State::Pass(BYPASS_TOO_BIG);
                    return Flow::Continue;
                }
                if !end_of_stream {
                    return Flow::Hold;
                }
                let ttl = *ttl;
                let hasher = std::mem::replace(hasher, Sha256::new());
                let key: Key = hasher.finalize().into();
                (key, ttl)
            }
            _ => return Flow::Continue,
        };
        let now = host.now();
        match self.store.get(&key, now) {
            Some(entry) => {
                self.state = State::Hit;
                // Whole seconds left, rounded up (as the Wasm filter's ttl=).
                let left = (entry.expires_at.saturating_duration_since(now).as_millis() as u64 + 999) / 1000;
                let age = now.saturating_duration_since(entry.stored_at).as_secs();
                let status = format!("{}{}", HIT_PREFIX, left);
                let age = age.to_string();
                host.send_response(200, &[("content-type", &entry.content_type), (CACHE_STATUS, status.as_bytes()),
                                          ("age", age.as_bytes())], &entry.body);
                Flow::Stop
            }
            None => {
                self.state = State::Miss { key, ttl };
                Flow::Continue
            }
        }
    }

    pub fn on_response_headers(&mut self, host: &mut dyn Host, end_of_stream: bool) -> Flow {
        match std::mem::replace(&mut self.state, State::Done) {
            State::Pass(status) => host.set_response_header(CACHE_STATUS, status),
            State::Miss { key, ttl } => {
                if host.response_header(":status") != Some(b"200") || end_of_stream {
                    host.set_response_header(CACHE_STATUS, MISS);
                } else {
                    let content_type = host.response_header("content-type").unwrap_or(b"").into();
                    self.state = State::Storing { key, ttl, content_type, seen: 0 };
                    return Flow::Hold;
                }
            }
            State::Hit => self.state = State::Hit,
            State::Keying { .. } => host.set_response_header(CACHE_STATUS, MISS), // answered before the body ended
            other => self.state = other,
        }
        Flow::Continue
    }

    pub fn on_response_body(&mut self, host: &mut dyn Host, end_of_stream: bool) -> Flow {
        let max = (self.config.max_entry_bytes as usize).min(MAX_HELD_BYTES);
        let seen = match &mut self.state {
            State::Storing { seen, .. } => {
                host.received_body(true, &mut |chunk| *seen += chunk.len());
                *seen
            }
            _ => return Flow::Continue,
        };
        if seen > max {
            self.state = State::Done;
            host.set_response_header(CACHE_STATUS, MISS_TOO_BIG);
            return Flow::Continue;
        }
        if !end_of_stream {
            return Flow::Hold;
        }
        if let State::Storing { key, ttl, content_type, seen } = std::mem::replace(&mut self.state, State::Done) {
            let mut body = Vec::with_capacity(seen);
            host.whole_body(true, &mut |chunk| body.extend_from_slice(chunk));
            let now = host.now();
            let entry = Entry { body: body.into_boxed_slice(), content_type, stored_at: now, expires_at: now + ttl };
            let status = match self.store.insert(key, entry) {
                Stored::Stored { .. } => MISS_STORED,
                Stored::TooBig => MISS_TOO_BIG,
            };
            host.set_response_header(CACHE_STATUS, status);
        }
        Flow::Continue
    }

    /// Trailers end a held answer: let the held headers go (an answer with trailers is not
    /// stored in phase 1).
    pub fn on_response_trailers(&mut self, host: &mut dyn Host) {
        if let State::Storing { .. } = self.state {
            self.state = State::Done;
            host.set_response_header(CACHE_STATUS, MISS);
        }
    }

    /// After a panic in a hook: fail open for the rest of the stream.
    pub fn fail_open(&mut self) {
        self.state = State::Done;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;

    #[derive(Default)]
    struct Fake {
        req: Vec<(String, Vec<u8>)>,
        resp: Vec<(String, Vec<u8>)>,
        held: Vec<Vec<u8>>,
        received: Vec<Vec<u8>>,
        sent: RefCell<Option<(u32, Vec<(String, Vec<u8>)>, Vec<u8>)>>,
        now: Option<Instant>,
    }

    impl Host for Fake {
        fn request_header(&self, name: &str) -> Option<&[u8]> {
            self.req.iter().find(|(k, _)| k == name).map(|(_, v)| &v[..])
        }
        fn response_header(&self, name: &str) -> Option<&[u8]> {
            self.resp.iter().find(|(k, _)| k == name).map(|(_, v)| &v[..])
        }
        fn set_response_header(&mut self, name: &str, value: &[u8]) {
            self.resp.retain(|(k, _)| k != name);
            self.resp.push((name.into(), value.into()));
        }
        fn received_body(&self, _response: bool, f: &mut dyn FnMut(&[u8])) {
            self.received.iter().for_each(|c| f(c));
        }
        fn whole_body(&self, _response: bool, f: &mut dyn FnMut(&[u8])) {
            self.held.iter().chain(self.received.iter()).for_each(|c| f(c));
        }
        fn send_response(&mut self, status: u32, headers: &[(&str, &[u8])], body: &[u8]) {
            let hs = headers.iter().map(|(k, v)| (k.to_string(), v.to_vec())).collect();
            *self.sent.borrow_mut() = Some((status, hs, body.to_vec()));
        }
        fn now(&self) -> Instant {
            self.now.unwrap_or_else(Instant::now)
        }
    }

    fn setup(max_entry: u64) -> (Arc<Config>, Arc<Store>) {
        let config = crate::config::parse(format!(
            r#"{{"max_entry_bytes": {}, "max_total_bytes": 16777216, "policies": [{{"model_prefix": "m", "ttl_s": 60}}]}}"#,
            max_entry).as_bytes()).unwrap();
        let store = Arc::new(Store::new(config.max_total_bytes as usize, config.max_entry_bytes as usize));
        (Arc::new(config), store)
    }

    fn request(path: &str) -> Fake {
        Fake { req: vec![(":method".into(), b"POST".to_vec()), (":path".into(), path.as_bytes().to_vec())],
               ..Fake::default() }
    }

    /// Sends `chunks` as the request body, then (if forwarded) an answer in `answer` chunks.
    fn exchange(c: &(Arc<Config>, Arc<Store>), path: &str, chunks: &[&[u8]], answer: &[&[u8]]) -> Fake {
        let mut s = Stream::new(c.0.clone(), c.1.clone());
        let mut h = request(path);
        if s.on_request_headers(&mut h, false) == Flow::Continue {
            h.received = chunks.iter().map(|c| c.to_vec()).collect();
            s.on_request_body(&mut h, true);
        } else {
            for (i, chunk) in chunks.iter().enumerate() {
                h.received = vec![chunk.to_vec()];
                let last = i + 1 == chunks.len();
                let flow = s.on_request_body(&mut h, last);
                if flow == Flow::Stop {
                    return h;
                }
                if flow == Flow::Hold {
                    h.held.push(chunk.to_vec());
                }
            }
        }
        h.held.clear();
        h.received.clear();
        h.resp = vec![(":status".into(), b"200".to_vec()), ("content-type".into(), b"application/json".to_vec())];
        if s.on_response_headers(&mut h, answer.is_empty()) == Flow::Hold {
            for (i, chunk) in answer.iter().enumerate() {
                h.received = vec![chunk.to_vec()];
                if s.on_response_body(&mut h, i + 1 == answer.len()) == Flow::Hold {
                    h.held.push(chunk.to_vec());
                }
            }
        }
        h
    }

    fn status(h: &Fake) -> String {
        String::from_utf8(h.response_header(CACHE_STATUS).unwrap_or(b"-").to_vec()).unwrap()
    }

    #[test]
    fn miss_stores_then_hit_answers_from_the_store() {
        let c = setup(1 << 20);
        let miss = exchange(&c, "/v2/models/m1/infer", &[b"{\"a\":", b"1}"], &[b"{\"out\":", b"[1,2]}"]);
        assert_eq!(status(&miss), "meshcache; fwd=miss; stored");
        let hit = exchange(&c, "/v2/models/m1/infer", &[b"{\"a\":1}"], &[]);
        let (code, headers, body) = hit.sent.borrow().clone().expect("a local reply");
        assert_eq!(code, 200);
        assert_eq!(body, b"{\"out\":[1,2]}", "the chunks held back and the last one, once each");
        let get = |n: &str| headers.iter().find(|(k, _)| k == n).map(|(_, v)| String::from_utf8(v.clone()).unwrap());
        assert_eq!(get("content-type").as_deref(), Some("application/json"));
        assert!(get(CACHE_STATUS).unwrap().starts_with("meshcache; hit; ttl="));
    }

    #[test]
    fn the_key_covers_path_and_body() {
        let c = setup(1 << 20);
        exchange(&c, "/v2/models/m1/infer", &[b"{}"], &[b"A"]);
        assert_eq!(status(&exchange(&c, "/v2/models/m2/infer", &[b"{}"], &[b"B"])), "meshcache; fwd=miss; stored");
        assert_eq!(status(&exchange(&c, "/v2/models/m1/infer", &[b"{ }"], &[b"C"])), "meshcache; fwd=miss; stored");
        let hit = exchange(&c, "/v2/models/m1/infer", &[b"{", b"}"], &[]);
        assert_eq!(hit.sent.borrow().as_ref().unwrap().2, b"A", "chunking does not change the key");
    }

    #[test]
    fn what_is_not_cached() {
        let c = setup(16);
        assert_eq!(status(&exchange(&c, "/other", &[b"{}"], &[b"x"])), "-", "not an inference request");
        assert_eq!(status(&exchange(&c, "/v2/models/zz/infer", &[b"{}"], &[b"x"])), "meshcache; fwd=bypass");
        let chunk = vec![b'1'; 256 * 1024];
        let big_request = [&chunk[..], &chunk[..], &chunk[..], b"1"];
        assert_eq!(status(&exchange(&c, "/v2/models/m1/infer", &big_request, &[b"x"])),
                   "meshcache; fwd=bypass; detail=too-big");
        let c2 = setup(9 << 20);
        let held_too_long = [&chunk[..], &chunk[..], &chunk[..], b"1"];
        assert_eq!(status(&exchange(&c2, "/v2/models/m1/infer", &[b"{}"], &held_too_long)),
                   "meshcache; fwd=miss; detail=too-big", "never more than MAX_HELD_BYTES held back");
        let big_answer = [b"0123456789".as_slice(); 3];
        assert_eq!(status(&exchange(&c, "/v2/models/m1/infer", &[b"{}"], &big_answer)),
                   "meshcache; fwd=miss; detail=too-big");
        assert_eq!(c.1.usage().0, 0);
        // A GET is never ours.
        let mut s = Stream::new(c.0.clone(), c.1.clone());
        let mut h = request("/v2/models/m1/infer");
        h.req[0].1 = b"GET".to_vec();
        assert_eq!(s.on_request_headers(&mut h, true), Flow::Continue);
    }

    #[test]
    fn non_200_answers_are_not_stored() {
        let c = setup(1 << 20);
        let mut s = Stream::new(c.0.clone(), c.1.clone());
        let mut h = request("/v2/models/m1/infer");
        s.on_request_headers(&mut h, false);
        h.received = vec![b"{}".to_vec()];
        assert_eq!(s.on_request_body(&mut h, true), Flow::Continue);
        h.resp = vec![(":status".into(), b"503".to_vec())];
        assert_eq!(s.on_response_headers(&mut h, false), Flow::Continue);
        assert_eq!(status(&h), "meshcache; fwd=miss");
        assert_eq!(c.1.usage().0, 0);
    }
}
