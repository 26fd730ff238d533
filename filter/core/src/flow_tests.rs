//! The flow against one fake host: Envoy's side of each exchange (headers, the body the host
//! holds since the stream last continued, local replies, parking, background refreshes) kept
//! in memory, so every scenario both hosts run is checked in milliseconds, once. `Abi::Wasm`
//! fakes the choices the proxy-wasm host makes where the ABIs differ (the stale route, a gRPC
//! reply filled in its own callbacks); `Abi::Native` the dynamic module's. The Envoy suite
//! (tests/filter) checks the same scenarios against both real hosts.

use super::*;
use crate::coalesce::{Refused, Waiters, MAX_WAITERS_PER_KEY};
use crate::config::parse_plugin_config;
use crate::grpc;
use crate::host::{CalloutAnswer, StaleRoute};
use crate::store::SharedData;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;

/// Envoy's shared data: cas 0 writes unconditionally, each write a fresh cas.
#[derive(Clone, Default)]
struct Mem(Rc<RefCell<(HashMap<String, (Vec<u8>, u32)>, u32)>>);

impl SharedData for Mem {
    fn get(&self, key: &str) -> Option<(Vec<u8>, u32)> {
        self.0.borrow().0.get(key).cloned()
    }
    fn set(&self, key: &str, value: &[u8], cas: u32) -> bool {
        let mut m = self.0.borrow_mut();
        if let Some((_, current)) = m.0.get(key) {
            if cas != 0 && cas != *current {
                return false;
            }
        }
        m.1 += 1;
        let next = m.1;
        m.0.insert(key.to_string(), (value.to_vec(), next));
        true
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Abi {
    Wasm,
    Native,
}

/// Where waiters park, all workers (each worker's table bounded as a host's is).
#[derive(Default)]
struct Parking {
    workers: HashMap<u32, Waiters>,
    /// Wakes delivered and not yet run, per stream (None: its timeout).
    woken: HashMap<u32, Vec<Option<Release>>>,
}

impl Parking {
    fn parked(&self) -> usize {
        self.workers.values().map(|w| w.len()).sum()
    }
    fn expire(&mut self, now: u64) {
        for w in self.workers.values_mut() {
            for id in w.expired(now) {
                self.woken.entry(id).or_default().push(None);
            }
        }
    }
}

/// The process: its store, clock and parking; the configuration streams start with.
struct Env {
    config: Arc<Config>,
    data: Mem,
    now: Rc<Cell<u64>>,
    parking: Rc<RefCell<Parking>>,
    abi: Abi,
}

const T0: u64 = 1_700_000_000_000;

fn env(json: &str) -> Env {
    let config = Arc::new(parse_plugin_config(json.as_bytes()).unwrap());
    let data = Mem::default();
    Cache { data: &data, limits: &config.limits }.reconcile(&mut Outcome::default());
    LockTable { data: &data }.create_slots();
    Env { config, data, now: Rc::new(Cell::new(T0)), parking: Rc::default(), abi: Abi::Native }
}

impl Env {
    fn advance(&self, ms: u64) {
        self.now.set(self.now.get() + ms);
    }
    /// Another filter configuration over the same store (a policy change).
    fn with_config(&self, json: &str) -> Env {
        Env { config: Arc::new(parse_plugin_config(json.as_bytes()).unwrap()), data: self.data.clone(), now: self.now.clone(),
              parking: self.parking.clone(), abi: self.abi }
    }
    fn stream(&self, queue: u32, id: u32) -> (Flow, Fake) {
        let f = Fake {
            data: self.data.clone(), now: self.now.clone(), parking: self.parking.clone(), abi: self.abi, place: Some((queue, id)),
            refresh_ok: true, grpc_hits_work: true, ..Fake::default()
        };
        (Flow::new(self.config.clone()), f)
    }
}

/// One stream's side of Envoy.
#[derive(Default)]
struct Fake {
    data: Mem,
    now: Rc<Cell<u64>>,
    parking: Rc<RefCell<Parking>>,
    abi: Abi,
    place: Option<(u32, u32)>,
    req: Vec<(String, String)>,
    /// The request body the host holds (a paused request keeps buffering).
    req_body: Vec<u8>,
    resp: Vec<(String, String)>,
    /// The response body the host holds since the stream last continued.
    resp_body: Vec<u8>,
    /// Response body bytes let through to the client.
    passed: Vec<u8>,
    trailers: Vec<(String, String)>,
    sent: Option<(u32, Vec<(String, String)>, Vec<u8>)>,
    sent_trailers: Vec<(String, String)>,
    resumed: bool,
    counts: HashMap<String, u64>,
    errors: Vec<String>,
    logged: Vec<String>,
    peer: Option<String>,
    refresh_ok: bool,
    refreshes: Vec<Cacheable>,
    rerouted: u32,
    grpc_hits_work: bool,
    gauge_updates: u32,
    /// Callouts (the semantic lookup) and fire-and-forget posts: (cluster, headers, body).
    callouts: Vec<Sent>,
    posts: Vec<Sent>,
    /// The semantic service cannot be reached: nothing can be sent.
    callouts_down: bool,
}

type Sent = (String, Vec<(String, String)>, Vec<u8>);

impl Default for Abi {
    fn default() -> Abi {
        Abi::Native
    }
}

fn set(h: &mut Vec<(String, String)>, name: &str, value: &str) {
    h.retain(|(n, _)| !n.eq_ignore_ascii_case(name));
    h.push((name.to_string(), value.to_string()));
}

fn get(h: &[(String, String)], name: &str) -> Option<String> {
    h.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.clone())
}

impl Fake {
    fn map(&mut self, map: Map) -> &mut Vec<(String, String)> {
        match map {
            Map::RequestHeaders => &mut self.req,
            Map::ResponseHeaders => &mut self.resp,
            Map::ResponseTrailers => &mut self.trailers,
        }
    }
    fn counted(&self, name: &str) -> u64 {
        self.counts.get(name).copied().unwrap_or(0)
    }
    fn abi(&self) -> Abi {
        self.abi
    }
    /// The `Cache-Status` the client sees: the local reply's, else the response's.
    fn status(&self) -> String {
        match &self.sent {
            Some((_, headers, _)) => get(headers, names::CACHE_STATUS).unwrap_or_default(),
            None => get(&self.resp, names::CACHE_STATUS).unwrap_or_default(),
        }
    }
    fn sent_body(&self) -> Vec<u8> {
        self.sent.as_ref().expect("a local reply").2.clone()
    }
}

impl Host for Fake {
    type Shared = Mem;
    fn shared(&self) -> &Mem {
        &self.data
    }
    fn headers(&mut self, map: Map) -> Headers {
        Headers { pairs: self.map(map).clone(), not_utf8: Vec::new() }
    }
    fn set_header(&mut self, map: Map, name: &str, value: &str) {
        set(self.map(map), name, value)
    }
    fn add_header(&mut self, map: Map, name: &str, value: &str) {
        self.map(map).push((name.to_string(), value.to_string()));
    }
    fn remove_header(&mut self, map: Map, name: &str) {
        self.map(map).retain(|(n, _)| !n.eq_ignore_ascii_case(name))
    }
    fn read_body(&mut self, side: Side, skip: usize, room: usize, out: &mut Vec<u8>) -> Option<usize> {
        let held = if side == Side::Request { &self.req_body } else { &self.resp_body };
        if held.len() - skip.min(held.len()) <= room {
            out.extend_from_slice(&held[skip.min(held.len())..]);
        }
        Some(held.len())
    }
    fn send_reply(&mut self, status: u32, _details: &str, headers: &[(&str, &str)], body: &[u8]) -> bool {
        self.sent = Some((status, headers.iter().map(|(n, v)| (n.to_string(), v.to_string())).collect(), body.to_vec()));
        true
    }
    fn send_grpc(&mut self, at: GrpcAt, headers: Vec<(String, String)>, framed: Vec<u8>) -> Option<Action> {
        let wasm = self.abi() == Abi::Wasm;
        if wasm && at == (GrpcAt::ResponseHeaders { eos: true }) {
            return None; // no body to fill: the stale route is missing
        }
        self.sent = Some((200, headers, framed));
        self.sent_trailers = vec![("grpc-status".to_string(), "0".to_string())];
        Some(match (at, wasm) {
            (GrpcAt::Request, _) => Stop,
            (_, true) => Continue,
            (_, false) => Pause,
        })
    }
    fn grpc_hits_work(&self) -> bool {
        self.grpc_hits_work
    }
    fn take_stale_route(&mut self, _hold_headers: bool) -> StaleRoute {
        match self.abi() {
            Abi::Wasm => StaleRoute::Taken,
            Abi::Native => StaleRoute::NotNeeded,
        }
    }
    fn always_holds_request_headers(&self) -> bool {
        self.abi() == Abi::Native
    }
    fn reroute(&mut self) {
        self.rerouted += 1;
    }
    fn resume_request(&mut self) -> bool {
        self.resumed = true;
        true
    }
    fn now_ms(&self) -> u64 {
        self.now.get()
    }
    fn peer_identity(&self) -> Option<String> {
        self.peer.clone()
    }
    fn count(&mut self, name: &str, n: u64) {
        *self.counts.entry(name.to_string()).or_default() += n;
    }
    fn count_policy(&mut self, prefix: &str, what: &str, n: u64) {
        self.count(&m::policy_metric(prefix, what), n);
    }
    fn error(&mut self, msg: &str) {
        self.count(m::ERRORS, 1);
        self.errors.push(msg.to_string());
    }
    fn log_debug(&mut self, line: &dyn Fn() -> String) {
        self.logged.push(line());
    }
    fn gauges_changed(&mut self) {
        self.gauge_updates += 1;
    }
    fn place(&self) -> Option<(u32, u32)> {
        self.place
    }
    fn park(&mut self, key: &KeyDigest, deadline_ms: u64) -> Result<(), Refused> {
        let (queue, id) = self.place.expect("a place");
        self.parking.borrow_mut().workers.entry(queue).or_default().add(key, id, deadline_ms)
    }
    fn unpark(&mut self) {
        if let Some((queue, id)) = self.place {
            let mut p = self.parking.borrow_mut();
            if let Some(w) = p.workers.get_mut(&queue) {
                w.remove(id);
            }
            p.woken.remove(&id);
        }
    }
    fn wake(&mut self, queues: &[u32], key: &KeyDigest, release: Release) {
        let mut p = self.parking.borrow_mut();
        for q in queues {
            let ids: Vec<u32> = p.workers.get_mut(q).map(|w| w.take(key).into_iter().map(|(id, _)| id).collect()).unwrap_or_default();
            for id in ids {
                p.woken.entry(id).or_default().push(Some(release));
            }
        }
    }
    fn refresh(&mut self, c: &Cacheable, _headers: &[(String, String)], _body: &[u8], _limits: &crate::config::Limits) -> bool {
        if self.refresh_ok {
            self.refreshes.push(c.clone());
        }
        self.refresh_ok
    }
    fn instance_id(&mut self) -> String {
        "test-instance".to_string()
    }
    fn callout(&mut self, cluster: &str, headers: &[(&str, &str)], body: &[u8], _timeout_ms: u64) -> bool {
        self.callouts.push((cluster.to_string(), pairs(headers), body.to_vec()));
        !self.callouts_down
    }
    fn post(&mut self, cluster: &str, headers: &[(&str, &str)], body: &[u8], _timeout_ms: u64) -> bool {
        self.posts.push((cluster.to_string(), pairs(headers), body.to_vec()));
        !self.callouts_down
    }
}

const INFER: &str = "/v2/models/m/infer";
const GRPC_INFER: &str = "/inference.GRPCInferenceService/ModelInfer";
const BODY: &[u8] = br#"{"id":"a","inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1]}]}"#;
const NEW: &[u8] = br#"{"id":"a","outputs":[{"name":"y","data":[5]}]}"#;
const ANSWER: &[u8] = br#"{"id":"a","outputs":[{"name":"y","data":[2]}]}"#;

fn pairs(list: &[(&str, &str)]) -> Vec<(String, String)> {
    list.iter().map(|(n, v)| (n.to_string(), v.to_string())).collect()
}

/// A request through its request callbacks: headers, the body in `chunks` (held while paused),
/// ending with trailers when `trailers`. The last callback's action.
fn ask(flow: &mut Flow, h: &mut Fake, path: &str, extra: &[(&str, &str)], chunks: &[&[u8]], trailers: bool) -> Action {
    let ctype = if path == GRPC_INFER { "application/grpc" } else { "application/json" };
    h.req.extend(pairs(&[(":method", "POST"), (":path", path), ("content-type", ctype)]));
    h.req.extend(pairs(extra));
    let mut action = flow.on_request_headers(h, chunks.is_empty() && !trailers);
    for (i, c) in chunks.iter().enumerate() {
        h.req_body.extend_from_slice(c);
        action = flow.on_request_body(h, i + 1 == chunks.len() && !trailers);
    }
    if trailers {
        action = flow.on_request_trailers(h);
    }
    action
}

/// The origin answers: status and headers, the body in `chunks` (let through on Continue,
/// held on Pause), then `grpc_status` as trailers when given. The response headers' action.
fn answer(flow: &mut Flow, h: &mut Fake, status: &str, extra: &[(&str, &str)], chunks: &[&[u8]], grpc_status: Option<&str>)
    -> Action {
    h.resp = pairs(&[(":status", status)]);
    h.resp.extend(pairs(extra));
    let action = flow.on_response_headers(h, chunks.is_empty() && grpc_status.is_none());
    if h.sent.is_some() {
        return action;
    }
    for (i, c) in chunks.iter().enumerate() {
        h.resp_body.extend_from_slice(c);
        if flow.on_response_body(h, i + 1 == chunks.len() && grpc_status.is_none()) == Continue {
            let passed = std::mem::take(&mut h.resp_body);
            h.passed.extend(passed);
        }
    }
    if let Some(s) = grpc_status {
        h.trailers = pairs(&[("grpc-status", s)]);
        flow.on_response_trailers(h);
    }
    action
}

fn json_answer(flow: &mut Flow, h: &mut Fake, status: &str, body: &[u8], extra: &[(&str, &str)]) -> Action {
    let len = body.len().to_string();
    let mut all = vec![("content-type", "application/json"), ("content-length", len.as_str())];
    all.extend_from_slice(extra);
    answer(flow, h, status, &all, &[body], None)
}

/// A whole HTTP exchange on a fresh stream (not coalescing): the stream's host.
fn exchange(e: &Env, extra: &[(&str, &str)], body: &[u8], origin: &[u8]) -> Fake {
    let (mut flow, mut h) = e.stream(0, 0);
    h.place = None;
    if ask(&mut flow, &mut h, INFER, extra, &[body], false) == Continue {
        json_answer(&mut flow, &mut h, "200", origin, &[]);
    }
    flow.end(&mut h);
    h
}

fn framed(message: &[u8]) -> Vec<u8> {
    grpc::frame(message)
}

/// A unary ModelInfer: request, then (unless answered) the origin's message and trailer.
fn grpc_exchange(e: &Env, grpc_status: &str) -> Fake {
    let (mut flow, mut h) = e.stream(0, 0);
    if ask(&mut flow, &mut h, GRPC_INFER, &[], &[&framed(b"\x0a\x01m")], false) == Continue {
        h.resp = pairs(&[(":status", "200"), ("content-type", "application/grpc")]);
        assert_eq!(flow.on_response_headers(&mut h, false), Pause, "a unary gRPC answer is held");
        h.resp_body = framed(b"\x0a\x01m\x12\x011");
        assert_eq!(flow.on_response_body(&mut h, false), Pause);
        h.trailers = pairs(&[("grpc-status", grpc_status)]);
        flow.on_response_trailers(&mut h);
    }
    h
}

// ------------------------------------------------------------ miss, store, hit

#[test]
fn a_small_miss_is_held_stored_with_hash_and_etag_then_hits_answer_with_age() {
    let e = env(r#"{"policies": [{"model_prefix": "m", "ttl_s": 60}]}"#);
    let (mut flow, mut miss) = e.stream(0, 1);
    assert_eq!(ask(&mut flow, &mut miss, INFER, &[], &[&BODY[..9], &BODY[9..]], false), Continue, "a miss goes upstream");
    assert_eq!(json_answer(&mut flow, &mut miss, "200", ANSWER, &[]), Pause, "a small answer's headers are held");
    assert_eq!(miss.passed, ANSWER, "let through whole at its end");
    assert_eq!(miss.status(), "meshcache; fwd=miss; stored");
    assert_eq!((miss.counted(m::MISSES), miss.counted("meshcache.policy.m.misses"), miss.counted(m::STORES)), (1, 1, 1));
    assert_eq!(miss.gauge_updates, 1, "a store moves the gauges");
    let hash = get(&miss.resp, names::HASH_HEADER).unwrap();
    assert_eq!(hash.len(), "xxh3-128:".len() + 32);
    assert_eq!(get(&miss.resp, "etag").unwrap(), format!("\"{}\"", hash));

    e.advance(2_500);
    let hit = exchange(&e, &[], BODY, b"");
    let (status, headers, body) = hit.sent.clone().expect("answered locally");
    assert_eq!((hit.counted(m::HITS), hit.counted("meshcache.policy.m.hits")), (1, 1));
    assert_eq!((status, body), (200, ANSWER.to_vec()));
    assert_eq!(get(&headers, names::CACHE_STATUS).unwrap(), "meshcache; hit; ttl=58");
    assert_eq!(get(&headers, "age").unwrap(), "2");
    assert_eq!(get(&headers, names::HASH_HEADER).unwrap(), hash);

    // Another request id: the same entry, the caller's id in the answer.
    let other = exchange(&e, &[], &BODY.replace_id("b"), b"");
    assert_eq!(other.sent_body(), ANSWER.replace_id("b"));
    // If-None-Match with the ETag: 304, no body.
    let inm = exchange(&e, &[("if-none-match", &format!("\"{}\"", hash))], BODY, b"");
    assert_eq!(inm.sent.unwrap().0, 304);
    assert!(hit.errors.is_empty() && miss.errors.is_empty(), "{:?}", miss.errors);
}

#[test]
fn a_large_answer_streams_and_is_stored_whole_hashed_as_it_passes() {
    let e = env(r#"{"policies": [{"model_prefix": "m", "ttl_s": 60}], "max_entry_bytes": 2000000}"#);
    let part = vec![b' '; response::HOLD_BYTES / 2 + 1];
    let chunks: Vec<Vec<u8>> = vec![ANSWER[..ANSWER.len() - 1].to_vec(), part.clone(), part.clone(), part, b"}".to_vec()];
    let whole = chunks.concat();
    let refs: Vec<&[u8]> = chunks.iter().map(|c| &c[..]).collect();
    let (mut flow, mut h) = e.stream(0, 1);
    ask(&mut flow, &mut h, INFER, &[], &[BODY], false);
    let len = whole.len().to_string();
    answer(&mut flow, &mut h, "200", &[("content-type", "application/json"), ("content-length", &len)], &refs, None);
    // Held until it outgrew HOLD_BYTES, then streamed: the headers said so, the store happened.
    assert_eq!(h.status(), "meshcache; fwd=miss");
    assert_eq!(h.passed, whole, "every byte passed, once");
    assert_eq!(h.counted(m::STORES), 1, "{:?}", h.errors);
    let hit = exchange(&e, &[], BODY, b"");
    assert_eq!(hit.sent_body(), whole, "the hit answers the whole body");
    let stored_hash = get(&hit.sent.unwrap().1, names::HASH_HEADER).unwrap();
    // The same answer in one piece, in another store: the same hash.
    let other = env(r#"{"policies": [{"model_prefix": "m", "ttl_s": 60}], "max_entry_bytes": 2000000}"#);
    let (mut flow, mut h) = other.stream(0, 1);
    ask(&mut flow, &mut h, INFER, &[], &[BODY], false);
    answer(&mut flow, &mut h, "200", &[("content-type", "application/json"), ("content-length", &len)], &[&whole], None);
    assert_eq!(get(&h.resp, names::HASH_HEADER), None, "streamed: the hash is not in the headers");
    assert_eq!(exchange(&other, &[], BODY, b"").sent.map(|s| get(&s.1, names::HASH_HEADER).unwrap()), Some(stored_hash));
}

#[test]
fn answers_the_policy_or_origin_refuses_are_not_stored() {
    let e = env(r#"{"policies": [{"model_prefix": "m", "ttl_s": 60}], "max_entry_bytes": 1024}"#);
    let (mut flow, mut h) = e.stream(0, 1);
    ask(&mut flow, &mut h, INFER, &[], &[BODY], false);
    json_answer(&mut flow, &mut h, "200", ANSWER, &[("cache-control", "no-store")]);
    assert_eq!(h.status(), "meshcache; fwd=miss; detail=no-store");
    assert!(get(&h.resp, names::HASH_HEADER).is_none());
    // Too big: declared, or (no content-length) found while it streams.
    let big = vec![b' '; 2000];
    assert_eq!(exchange(&e, &[], BODY, &big).status(), "meshcache; fwd=miss; detail=too-big");
    let (mut flow, mut h) = e.stream(0, 1);
    ask(&mut flow, &mut h, INFER, &[], &[BODY], false);
    answer(&mut flow, &mut h, "200", &[("content-type", "text/event-stream")], &[&big[..600], &big[600..]], None);
    assert_eq!(h.passed.len(), big.len(), "it still passes whole");
    assert_eq!(h.counted("meshcache.not_stored.too-big"), 1, "{:?}", h.counts);
    assert_eq!(h.status(), "meshcache; fwd=miss", "the headers had left");
    let again = exchange(&e, &[], BODY, ANSWER);
    assert_eq!(again.status(), "meshcache; fwd=miss; stored", "nothing was stored before");
}

#[test]
fn an_expired_entry_is_replaced_and_a_lower_policy_ttl_reaches_stored_entries() {
    let e = env(r#"{"policies": [{"model_prefix": "m", "ttl_s": 60}]}"#);
    exchange(&e, &[], BODY, ANSWER);
    e.advance(61_000);
    let expired = exchange(&e, &[], BODY, NEW);
    assert_eq!(expired.status(), "meshcache; fwd=miss; stored");
    assert_eq!(expired.counted(m::EVICTIONS), 1, "the expired entry was freed at lookup");
    assert!(expired.gauge_updates >= 2, "the eviction and the store move the gauges");
    assert_eq!(exchange(&e, &[], BODY, b"").sent_body(), NEW);
    let lower = e.with_config(r#"{"policies": [{"model_prefix": "m", "ttl_s": 0}]}"#);
    e.advance(1);
    assert!(!exchange(&lower, &[], BODY, ANSWER).status().contains("hit"));
}

#[test]
fn a_purge_generation_is_a_new_key() {
    let e = env(r#"{"policies": [{"model_prefix": "m", "ttl_s": 60, "generation": 1}]}"#);
    exchange(&e, &[], BODY, ANSWER);
    assert!(exchange(&e, &[], BODY, b"").status().contains("hit"));
    let purged = e.with_config(r#"{"policies": [{"model_prefix": "m", "ttl_s": 60, "generation": 2}]}"#);
    assert_eq!(exchange(&purged, &[], BODY, ANSWER).status(), "meshcache; fwd=miss; stored");
}

#[test]
fn a_principal_scoped_policy_keeps_each_peers_entries_apart() {
    let e = env(r#"{"policies": [{"model_prefix": "m", "ttl_s": 60, "scope": "principal"}]}"#);
    let as_peer = |peer: Option<&str>| {
        let (mut flow, mut h) = e.stream(0, 1);
        h.peer = peer.map(str::to_string);
        if ask(&mut flow, &mut h, INFER, &[], &[BODY], false) == Continue {
            json_answer(&mut flow, &mut h, "200", ANSWER, &[]);
        }
        h.status()
    };
    assert_eq!(as_peer(Some("spiffe://a")), "meshcache; fwd=miss; stored");
    assert!(as_peer(Some("spiffe://a")).starts_with("meshcache; hit"));
    assert_eq!(as_peer(Some("spiffe://b")), "meshcache; fwd=miss; stored", "another peer, another entry");
    assert_eq!(as_peer(None), "meshcache; fwd=bypass; detail=no-identity");
}

#[test]
fn bypasses_say_why_are_counted_and_logged_and_ignored_requests_get_no_header() {
    let e = env(r#"{"policies": [{"model_prefix": "m", "ttl_s": 60}]}"#);
    let (mut flow, mut h) = e.stream(0, 1);
    ask(&mut flow, &mut h, "/v2/models/zz/infer", &[], &[BODY], false);
    json_answer(&mut flow, &mut h, "200", ANSWER, &[]);
    assert_eq!(h.status(), "meshcache; fwd=bypass; detail=no-policy");
    assert_eq!(h.logged, vec!["meshcache: bypass detail=no-policy model=zz path=/v2/models/zz/infer".to_string()]);
    assert_eq!((h.counted(m::BYPASSES), h.counted("meshcache.bypass.no-policy")), (1, 1));
    assert_eq!(exchange(&e, &[("cache-control", "no-store")], BODY, ANSWER).status(), "meshcache; fwd=bypass; detail=no-store");
    assert_eq!(exchange(&e, &[], b"{not json", ANSWER).status(), "meshcache; fwd=bypass; detail=unparsable");
    let (mut flow, mut h) = e.stream(0, 1);
    assert_eq!(ask(&mut flow, &mut h, "/healthz", &[], &[BODY], false), Continue);
    json_answer(&mut flow, &mut h, "200", ANSWER, &[]);
    assert_eq!(h.status(), "");
    // A request body past the limit, found while it is buffered: bypassed, not read.
    let (mut flow, mut h) = e.stream(0, 1);
    let huge = vec![b' '; request::MAX_REQUEST_BYTES + 1];
    assert_eq!(ask(&mut flow, &mut h, INFER, &[], &[&huge[..10], &huge[10..]], false), Continue);
    assert_eq!(h.counted("meshcache.bypass.too-big"), 1, "{:?}", h.counts);
}

#[test]
fn a_request_ending_with_trailers_is_decided_at_the_trailers() {
    let e = env(r#"{"policies": [{"model_prefix": "m", "ttl_s": 60}]}"#);
    let (mut flow, mut h) = e.stream(0, 1);
    assert_eq!(ask(&mut flow, &mut h, INFER, &[], &[&BODY[..9], &BODY[9..]], true), Continue, "a miss goes upstream");
    json_answer(&mut flow, &mut h, "200", ANSWER, &[]);
    assert_eq!(h.status(), "meshcache; fwd=miss; stored");
    let (mut flow, mut hit) = e.stream(0, 2);
    assert_eq!(ask(&mut flow, &mut hit, INFER, &[], &[BODY], true), Stop, "answered locally at the trailers");
    assert_eq!(hit.sent_body(), ANSWER);
    // A stream not buffering (ignored or bypassed) lets its trailers through.
    let (mut other, mut oh) = e.stream(0, 3);
    assert_eq!(other.on_request_trailers(&mut oh), Continue);
}

#[test]
fn without_held_headers_the_body_alone_waits_and_answers_still_store_and_hit() {
    for abi in [Abi::Wasm, Abi::Native] {
        let mut e = env(r#"{"hold_headers": false, "policies": [{"model_prefix": "m", "ttl_s": 60}]}"#);
        e.abi = abi;
        let (mut flow, mut h) = e.stream(0, 1);
        h.req = pairs(&[(":method", "POST"), (":path", INFER), ("content-type", "application/json")]);
        let expected = if abi == Abi::Wasm { Continue } else { Pause };
        assert_eq!(flow.on_request_headers(&mut h, false), expected, "{:?}: the native host always holds them", abi);
        h.req_body = BODY.to_vec();
        assert_eq!(flow.on_request_body(&mut h, true), Continue);
        assert_eq!(json_answer(&mut flow, &mut h, "200", ANSWER, &[]), Continue, "the answer's headers are not held");
        assert_eq!(h.status(), "meshcache; fwd=miss", "{:?}", abi);
        assert_eq!(h.counted(m::STORES), 1);
        assert_eq!(exchange(&e, &[], BODY, b"").sent_body(), ANSWER);
    }
}

// ------------------------------------------------------------ gRPC

#[test]
fn grpc_misses_store_on_a_zero_status_and_hits_answer_in_one_pass_with_trailers() {
    let e = env(r#"{"policies": [{"model_prefix": "m", "ttl_s": 60}]}"#);
    let failed = grpc_exchange(&e, "13");
    assert_eq!(get(&failed.resp, names::CACHE_STATUS).unwrap(), "meshcache; fwd=miss; detail=grpc-status");
    let miss = grpc_exchange(&e, "0");
    assert_eq!(get(&miss.resp, names::CACHE_STATUS).unwrap(), "meshcache; fwd=miss; stored");
    let hash = get(&miss.resp, names::HASH_HEADER).unwrap();
    let hit = grpc_exchange(&e, "0");
    let (status, headers, body) = hit.sent.clone().expect("answered from the store");
    assert_eq!((status, body), (200, framed(b"\x0a\x01m\x12\x011")), "the stored message, framed");
    assert_eq!(get(&headers, "content-type").unwrap(), "application/grpc");
    assert_eq!(get(&headers, names::HASH_HEADER).unwrap(), hash);
    assert!(hit.status().starts_with("meshcache; hit"));
    assert_eq!(hit.sent_trailers, pairs(&[("grpc-status", "0")]));
}

/// A ModelInferRequest / ModelInferResponse for model `m` with request id `id` (field 3; none
/// when empty, as proto3 writes it) and `rest` after it.
fn grpc_with_id(id: &[u8], rest: &[u8]) -> Vec<u8> {
    let mut m = b"\x0a\x01m".to_vec();
    if !id.is_empty() {
        m.push(0x1a);
        grpc::put_varint(&mut m, id.len() as u64);
        m.extend_from_slice(id);
    }
    m.extend_from_slice(rest);
    m
}

/// One gRPC exchange whose origin echoes the request's id; the framed message the client gets.
fn grpc_id_exchange(e: &Env, id: &[u8], outputs: &[u8]) -> (Fake, Vec<u8>) {
    let (mut flow, mut h) = e.stream(0, 0);
    h.place = None;
    if ask(&mut flow, &mut h, GRPC_INFER, &[], &[&framed(&grpc_with_id(id, b"\x2a\x02in"))], false) == Continue {
        answer(&mut flow, &mut h, "200", &[("content-type", "application/grpc")], &[&framed(&grpc_with_id(id, outputs))],
               Some("0"));
        let passed = h.passed.clone();
        return (h, passed);
    }
    let sent = h.sent_body();
    (h, sent)
}

#[test]
fn grpc_hits_echo_each_callers_request_id_in_the_framed_message() {
    for abi in [Abi::Native, Abi::Wasm] {
        let mut e = env(r#"{"policies": [{"model_prefix": "m", "ttl_s": 60}]}"#);
        e.abi = abi;
        // Outputs around the 2-byte varint boundary, so the frame length crosses 128 with the id.
        let outputs = [b"\x32\x7a".to_vec(), vec![7u8; 0x7a]].concat();
        let (miss, _) = grpc_id_exchange(&e, b"req-1", &outputs);
        assert_eq!(get(&miss.resp, names::CACHE_STATUS).unwrap(), "meshcache; fwd=miss; stored", "{:?}", abi);
        for id in [&b"req-2"[..], &[b'x'; 127][..], &[b'y'; 128][..], &[b'z'; 256][..]] {
            let (hit, sent) = grpc_id_exchange(&e, id, &outputs);
            assert!(hit.status().starts_with("meshcache; hit"), "{:?} {}", abi, hit.status());
            assert_eq!(sent, framed(&grpc_with_id(id, &outputs)), "{:?}: id of {} B", abi, id.len());
        }
    }
}

#[test]
fn grpc_requests_bypass_once_the_host_has_seen_its_hit_route_missing() {
    let e = env(r#"{"policies": [{"model_prefix": "m", "ttl_s": 60}]}"#);
    let (mut flow, mut h) = e.stream(0, 1);
    h.grpc_hits_work = false;
    assert_eq!(ask(&mut flow, &mut h, GRPC_INFER, &[], &[&framed(b"\x0a\x01m")], false), Continue);
    assert_eq!(h.counted("meshcache.bypass.no-hit-route"), 1, "{:?}", h.counts);
}

// ------------------------------------------------------------ stale-if-error

#[test]
fn an_origin_error_is_answered_with_the_expired_entry_within_stale_if_error() {
    let e = env(r#"{"policies": [{"model_prefix": "m", "ttl_s": 1, "stale_if_error_s": 30}]}"#);
    exchange(&e, &[], BODY, ANSWER);
    e.advance(3_000);
    let (mut flow, mut h) = e.stream(0, 1);
    assert_eq!(ask(&mut flow, &mut h, INFER, &[], &[BODY], false), Continue, "expired: forwarded");
    assert_eq!(answer(&mut flow, &mut h, "503", &[], &[b"down"], None), Stop);
    assert_eq!(h.sent_body(), ANSWER);
    assert_eq!(h.status(), "meshcache; hit; stale; ttl=-2; fwd=stale; fwd-status=503; detail=stale-if-error");
    assert_eq!(h.counted(m::STALE_IF_ERROR), 1);
    // An origin success replaces the expired entry instead.
    let fresh = exchange(&e, &[], BODY, NEW);
    assert_eq!(fresh.status(), "meshcache; fwd=miss; stored");
    assert_eq!(exchange(&e, &[], BODY, b"").sent_body(), NEW);
}

fn grpc_stale_if_error(abi: Abi, trailers_only: bool) -> Fake {
    let mut e = env(r#"{"policies": [{"model_prefix": "m", "ttl_s": 1, "stale_if_error_s": 30}]}"#);
    e.abi = abi;
    assert_eq!(get(&grpc_exchange(&e, "0").resp, names::CACHE_STATUS).unwrap(), "meshcache; fwd=miss; stored");
    e.advance(2_000);
    let (mut flow, mut h) = e.stream(0, 1);
    assert_eq!(ask(&mut flow, &mut h, GRPC_INFER, &[], &[&framed(b"\x0a\x01m")], false), Continue, "expired: forwarded");
    h.resp = pairs(&[(":status", "200"), ("content-type", "application/grpc"), ("grpc-status", "14")]);
    let action = flow.on_response_headers(&mut h, trailers_only);
    let expected = match (abi, trailers_only) {
        (Abi::Native, _) => Pause,
        (Abi::Wasm, false) => Continue,
        (Abi::Wasm, true) => Continue, // passes: no body to fill
    };
    assert_eq!(action, expected);
    if !trailers_only || abi == Abi::Native {
        flow.on_response_body(&mut h, true);
    }
    h
}

#[test]
fn a_grpc_origin_error_is_answered_with_the_stale_message_and_a_zero_status_trailer() {
    for abi in [Abi::Native, Abi::Wasm] {
        let h = grpc_stale_if_error(abi, abi == Abi::Native);
        assert_eq!(h.sent_body(), framed(b"\x0a\x01m\x12\x011"), "{:?}", abi);
        assert!(h.status().ends_with("; fwd=stale; detail=stale-if-error"), "{}", h.status());
        assert_eq!(h.sent_trailers, pairs(&[("grpc-status", "0")]));
        assert_eq!(h.counted(m::STALE_IF_ERROR), 1);
    }
    // Wasm: a trailers-only error without the stale route's body passes as it is, counted.
    let h = grpc_stale_if_error(Abi::Wasm, true);
    assert!(h.sent.is_none());
    assert_eq!(h.counted(m::ERRORS), 1);
}

#[test]
fn a_grpc_error_on_the_stale_route_not_replaced_moves_its_status_to_trailers() {
    let mut e = env(r#"{"policies": [{"model_prefix": "m", "ttl_s": 1, "stale_if_error_s": 1}]}"#);
    e.abi = Abi::Wasm;
    grpc_exchange(&e, "0");
    e.advance(1_500); // within stale-if-error at the request, past it at the answer
    let (mut flow, mut h) = e.stream(0, 1);
    assert_eq!(ask(&mut flow, &mut h, GRPC_INFER, &[], &[&framed(b"\x0a\x01m")], false), Continue);
    e.advance(2_000);
    h.resp = pairs(&[(":status", "200"), ("content-type", "application/grpc"), ("grpc-status", "14"), ("grpc-message", "x")]);
    assert_eq!(flow.on_response_headers(&mut h, false), Continue);
    assert!(get(&h.resp, "grpc-status").is_none());
    assert_eq!(h.status(), "meshcache; fwd=miss; detail=grpc-status");
    flow.on_response_body(&mut h, true);
    assert_eq!(h.trailers, pairs(&[("grpc-status", "14"), ("grpc-message", "x")]));
}

// ------------------------------------------------------------ stale-while-revalidate

const SWR: &str = r#"{"policies": [{"model_prefix": "m", "ttl_s": 1, "stale_while_revalidate_s": 30}]}"#;

/// A request after expiry; `refresh_ok`: whether its host can send a background refresh.
fn stale_request(e: &Env, refresh_ok: bool) -> (Flow, Fake, Action) {
    let (mut flow, mut h) = e.stream(0, 1);
    h.refresh_ok = refresh_ok;
    let action = ask(&mut flow, &mut h, INFER, &[], &[BODY], false);
    (flow, h, action)
}

fn refreshed_answer() -> Headers {
    Headers { pairs: pairs(&[(":status", "200"), ("content-type", "application/json")]), not_utf8: Vec::new() }
}

#[test]
fn stale_while_revalidate_answers_at_once_and_one_background_refresh_replaces_the_entry() {
    let e = env(SWR);
    exchange(&e, &[], BODY, ANSWER);
    e.advance(2_000);
    let (_a, a, action) = stale_request(&e, true);
    assert_eq!(action, Stop);
    assert_eq!(a.status(), "meshcache; hit; stale; ttl=-1; detail=stale-while-revalidate");
    assert_eq!(a.sent_body(), ANSWER);
    assert_eq!((a.refreshes.len(), a.counted(m::REFRESHES), a.counted(m::STALE_WHILE_REVALIDATE)), (1, 1, 1));
    let (_b, b, _) = stale_request(&e, true);
    assert!(b.status().ends_with("detail=stale-while-revalidate"));
    assert!(b.refreshes.is_empty() && b.counted(m::REFRESHES) == 0, "one refresh per key at a time, counted once");
    // The refresh's answer lands (each host hands it to revalidate::store_refresh).
    let newer = br#"{"id":"a","outputs":[{"name":"y","data":[3]}]}"#.to_vec();
    let cache = Cache { data: &e.data, limits: &e.config.limits };
    revalidate::store_refresh(&cache, &a.refreshes[0], &refreshed_answer(), None, newer.clone(), e.now.get() + 10,
                              &mut Outcome::default()).unwrap();
    revalidate::release(&e.data, &a.refreshes[0].key);
    let (_c, c, _) = stale_request(&e, true);
    assert!(c.status().starts_with("meshcache; hit; ttl="), "{}", c.status());
    assert_eq!(c.sent_body(), newer);
}

#[test]
fn a_refresh_that_cannot_be_sent_or_fails_forwards_a_request_instead() {
    let e = env(SWR);
    exchange(&e, &[], BODY, ANSWER);
    e.advance(2_000);
    let (mut forwarded, mut f, action) = stale_request(&e, false);
    assert_eq!(action, Continue, "no background request here: this one refreshes");
    assert_eq!(f.counted(m::REFRESH_FAILURES), 1);
    let (_b, b, _) = stale_request(&e, true);
    assert!(b.status().ends_with("detail=stale-while-revalidate"), "the others still get the stale entry");
    forwarded.end(&mut f); // its answer never came: the lock is free again
    let (_c, c, _) = stale_request(&e, true);
    assert_eq!(c.refreshes.len(), 1);
    // A background answer that cannot be stored: the next request is forwarded.
    let mut failed = refreshed_answer();
    failed.pairs[0].1 = "503".into();
    let cache = Cache { data: &e.data, limits: &e.config.limits };
    assert!(revalidate::store_refresh(&cache, &c.refreshes[0], &failed, None, b"x".to_vec(), e.now.get(), &mut Outcome::default())
        .is_err());
    revalidate::failed(&e.data, &c.refreshes[0].key, e.now.get());
    let (mut d, mut dh, action) = stale_request(&e, true);
    assert_eq!(action, Continue);
    assert!(dh.refreshes.is_empty(), "forwarded, not sent in the background");
    // That forwarded request's answer replaces the entry.
    json_answer(&mut d, &mut dh, "200", NEW, &[]);
    d.end(&mut dh);
    assert_eq!(stale_request(&e, true).1.sent_body(), NEW);
}

/// A gRPC entry past its TTL and the refresh its next request sent.
fn grpc_refresh() -> (Env, Cacheable) {
    let e = env(SWR);
    assert_eq!(grpc_exchange(&e, "0").status(), "meshcache; fwd=miss; stored");
    e.advance(2_000);
    let (mut flow, mut h) = e.stream(0, 1);
    assert_eq!(ask(&mut flow, &mut h, GRPC_INFER, &[], &[&framed(b"\x0a\x01m")], false), Stop);
    let c = h.refreshes[0].clone();
    (e, c)
}

#[test]
fn a_grpc_refresh_is_stored_on_a_zero_status_in_its_trailers_or_a_trailers_only_answer() {
    let head = |status: Option<&str>| {
        let mut h = pairs(&[(":status", "200"), ("content-type", "application/grpc")]);
        if let Some(s) = status {
            h.push(("grpc-status".into(), s.into()));
        }
        Headers { pairs: h, not_utf8: Vec::new() }
    };
    let store = |headers: Headers, trailers: Option<Headers>| {
        let (e, c) = grpc_refresh();
        let cache = Cache { data: &e.data, limits: &e.config.limits };
        revalidate::store_refresh(&cache, &c, &headers, trailers.as_ref(), framed(b"\x0a\x01m\x12\x012"), e.now.get(),
                                  &mut Outcome::default())
    };
    assert_eq!(store(head(Some("0")), Some(head(Some("13")))), Err(NotStored::GrpcStatus), "the trailers' status rules");
    assert_eq!(store(head(None), Some(head(None))), Err(NotStored::GrpcStatus), "no status anywhere: not a success");
    assert_eq!(store(head(Some("14")), None), Err(NotStored::GrpcStatus), "a trailers-only error");
    assert_eq!(store(head(None), Some(head(Some("0")))), Ok(()));
    assert_eq!(store(head(Some("0")), Some(head(None))), Ok(()), "a trailers-only success");
    assert_eq!(store(head(None), None), Ok(()), "a host whose callouts drop trailers: nothing refuses it");
}

// ------------------------------------------------------------ request coalescing

const COALESCING: &str = r#"{"policies": [{"model_prefix": "m", "ttl_s": 60, "coalesce_timeout_ms": 1000}]}"#;

/// A request through its request callbacks on worker `queue` as stream `id`.
fn arrive(e: &Env, queue: u32, id: u32) -> (Flow, Fake, Action) {
    let (mut flow, mut h) = e.stream(queue, id);
    let action = ask(&mut flow, &mut h, INFER, &[], &[BODY], false);
    (flow, h, action)
}

/// Runs the wakes delivered to this stream (as its host's queue or scheduler would).
fn deliver(e: &Env, flow: &mut Flow, h: &mut Fake) -> Vec<Option<Release>> {
    let id = h.place.unwrap().1;
    let events = e.parking.borrow_mut().woken.remove(&id).unwrap_or_default();
    for ev in &events {
        flow.resume(h, *ev);
    }
    events
}

#[test]
fn waiters_on_two_workers_are_woken_by_the_leaders_store_and_answered_from_its_entry() {
    let e = env(COALESCING);
    let (mut leader, mut lh, action) = arrive(&e, 0, 1);
    assert_eq!(action, Continue, "the first miss leads: upstream");
    let (mut w1, mut h1, a1) = arrive(&e, 0, 2);
    let (mut w2, mut h2, a2) = arrive(&e, 1, 3);
    assert_eq!((a1, a2), (Pause, Pause), "identical misses park");
    assert_eq!(e.parking.borrow().parked(), 2);
    assert_eq!(h1.counted(m::COALESCE_WAITS), 1);
    json_answer(&mut leader, &mut lh, "200", ANSWER, &[]);
    assert_eq!(lh.status(), "meshcache; fwd=miss; stored");
    assert_eq!(deliver(&e, &mut w1, &mut h1), vec![Some(Release::Stored)]);
    assert_eq!(deliver(&e, &mut w2, &mut h2).len(), 1);
    for h in [&h1, &h2] {
        assert_eq!(h.status(), names::CACHE_STATUS_COLLAPSED);
        assert_eq!(h.sent_body(), ANSWER);
        assert_eq!(h.counted(m::COALESCE_SERVED), 1);
        assert!(!h.resumed, "answered, not sent upstream");
    }
    assert_eq!(e.parking.borrow().parked(), 0);
}

#[test]
fn a_failed_leader_hands_over_to_one_waiter_and_the_rest_wait_for_it() {
    let e = env(COALESCING);
    let (mut leader, mut lh, _) = arrive(&e, 0, 1);
    let (mut w1, mut h1, _) = arrive(&e, 0, 2);
    let (mut w2, mut h2, _) = arrive(&e, 1, 3);
    json_answer(&mut leader, &mut lh, "500", b"boom", &[]);
    assert_eq!(deliver(&e, &mut w1, &mut h1), vec![Some(Release::OriginError)], "a 500: retried");
    assert!(h1.resumed, "the first woken waiter leads anew: upstream");
    assert_eq!(h1.counted(m::COALESCE_RELEASED), 1);
    assert_eq!(deliver(&e, &mut w2, &mut h2).len(), 1);
    assert!(!h2.resumed && h2.sent.is_none(), "the second waits again, for the new leader");
    assert_eq!(e.parking.borrow().parked(), 1);
    json_answer(&mut w1, &mut h1, "200", ANSWER, &[]);
    assert_eq!(h1.status(), "meshcache; fwd=miss; stored");
    deliver(&e, &mut w2, &mut h2);
    assert_eq!(h2.status(), names::CACHE_STATUS_COLLAPSED);
}

#[test]
fn an_uncacheable_answer_sends_each_waiter_upstream_and_a_reset_leader_hands_over() {
    let e = env(COALESCING);
    let (mut leader, mut lh, _) = arrive(&e, 0, 1);
    let (mut w1, mut h1, _) = arrive(&e, 0, 2);
    answer(&mut leader, &mut lh, "404", &[], &[], None);
    assert_eq!(deliver(&e, &mut w1, &mut h1), vec![Some(Release::Uncacheable)]);
    assert!(h1.resumed, "404 is not retried: the waiter goes upstream itself");
    assert_eq!(e.parking.borrow().parked(), 0);

    let (mut leader, mut lh, _) = arrive(&e, 0, 4);
    let (mut w2, mut h2, _) = arrive(&e, 1, 5);
    leader.end(&mut lh); // reset: the client went away before the answer
    assert_eq!(deliver(&e, &mut w2, &mut h2), vec![Some(Release::Retry)]);
    assert!(h2.resumed, "it leads now");
    json_answer(&mut w2, &mut h2, "200", ANSWER, &[]);
    assert_eq!(h2.counted(m::STORES), 1);
}

#[test]
fn a_leader_whose_answer_is_not_stored_sends_its_waiters_upstream() {
    let e = env(COALESCING);
    let (mut leader, mut lh, _) = arrive(&e, 0, 1);
    let (mut w1, mut h1, _) = arrive(&e, 0, 2);
    json_answer(&mut leader, &mut lh, "200", ANSWER, &[("cache-control", "no-store")]);
    assert_eq!(deliver(&e, &mut w1, &mut h1).len(), 1);
    assert!(h1.resumed && h1.sent.is_none());
}

#[test]
fn a_destroyed_waiter_is_never_woken_and_late_waiters_time_out_upstream() {
    let e = env(COALESCING);
    let (mut leader, mut lh, _) = arrive(&e, 0, 1);
    let (mut gone, mut gh, _) = arrive(&e, 0, 2);
    let (mut late, mut hl, _) = arrive(&e, 1, 3);
    gone.end(&mut gh);
    assert_eq!(e.parking.borrow().parked(), 1, "the destroyed stream left its table");
    e.parking.borrow_mut().expire(e.now.get() + 999);
    assert!(deliver(&e, &mut late, &mut hl).is_empty());
    e.parking.borrow_mut().expire(e.now.get() + 1000);
    assert_eq!(deliver(&e, &mut late, &mut hl), vec![None]);
    assert!(hl.resumed);
    assert_eq!(hl.counted(m::COALESCE_TIMEOUTS), 1);
    json_answer(&mut leader, &mut lh, "200", ANSWER, &[]);
    assert!(deliver(&e, &mut gone, &mut gh).is_empty(), "no wake for a stream that is gone");
}

#[test]
fn waiters_per_key_and_worker_are_bounded_the_rest_go_upstream_counted() {
    let e = env(COALESCING);
    let _leader = arrive(&e, 0, 1);
    let mut parked = Vec::new();
    for id in 0..MAX_WAITERS_PER_KEY as u32 {
        let (s, h, action) = arrive(&e, 0, 10 + id);
        assert_eq!(action, Pause);
        parked.push((s, h));
    }
    let (_s, over, action) = arrive(&e, 0, 9999);
    assert_eq!(action, Continue, "past the bound: upstream at once");
    assert_eq!(over.counted(m::COALESCE_OVERFLOW), 1);
    assert_eq!(e.parking.borrow().parked(), MAX_WAITERS_PER_KEY);
    let (_s, other, action) = arrive(&e, 1, 10_000);
    assert_eq!(action, Pause, "another worker has its own bound");
    assert_eq!(other.counted(m::COALESCE_OVERFLOW), 0);
}

#[test]
fn a_failed_refresh_answers_every_waiter_with_the_stale_entry() {
    let e = env(r#"{"policies": [{"model_prefix": "m", "ttl_s": 1, "stale_if_error_s": 30, "coalesce_timeout_ms": 1000}]}"#);
    exchange(&e, &[], BODY, ANSWER);
    e.advance(2_000);
    let (mut leader, mut lh, _) = arrive(&e, 0, 1);
    let (mut w, mut h, action) = arrive(&e, 1, 2);
    assert_eq!(action, Pause, "an expired entry's refresh is coalesced like a miss");
    json_answer(&mut leader, &mut lh, "503", b"", &[]);
    assert!(lh.status().ends_with("; fwd=stale; fwd-status=503; detail=stale-if-error"));
    deliver(&e, &mut w, &mut h);
    assert_eq!(h.status(), "meshcache; hit; stale; ttl=-1; fwd=stale; detail=stale-if-error; collapsed");
    assert_eq!(h.sent_body(), ANSWER);
    assert_eq!((h.counted(m::STALE_IF_ERROR), h.counted(m::COALESCE_SERVED)), (1, 1));
}

// ------------------------------------------------------------ client role, callouts

#[test]
fn the_client_role_puts_a_routing_key_on_the_request_and_stores_nothing() {
    let e = env(r#"{"role": "client", "policies": [{"model_prefix": "m", "ttl_s": 60}]}"#);
    let key_of = |body: &[u8], forged: Option<&str>| {
        let (mut flow, mut h) = e.stream(0, 1);
        let extra: Vec<(&str, &str)> = forged.map(|f| (names::ROUTE_KEY_HEADER, f)).into_iter().collect();
        assert_eq!(ask(&mut flow, &mut h, INFER, &extra, &[body], false), Continue);
        answer(&mut flow, &mut h, "200", &[], &[], None);
        assert!(get(&h.resp, names::CACHE_STATUS).is_none(), "the client role says nothing in answers");
        (get(&h.req, names::ROUTE_KEY_HEADER), h.rerouted, h.counts.get(m::ROUTED).copied())
    };
    let (a, rerouted, routed) = key_of(BODY, None);
    assert!(a.is_some());
    assert_eq!((rerouted, routed), (1, Some(1)));
    assert_eq!(key_of(&BODY.replace_id("zz"), Some("forged")).0, a, "same key for the same inference, forged key gone");
    assert_ne!(key_of(br#"{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[9]}]}"#, None).0, a);
    assert_eq!(key_of(b"{not json", None), (None, 0, None), "what the server would bypass gets no key");
}

// ------------------------------------------------------------ semantic layer, tokens saved

const CHAT: &str = "/v1/chat/completions";
const CHAT_ANSWER: &[u8] = br#"{"id":"a","choices":[{"index":0,"message":{"role":"assistant","content":"Paris"}}],"usage":{"prompt_tokens":27,"completion_tokens":12}}"#;

fn chat(text: &str) -> Vec<u8> {
    format!(r#"{{"model": "m1", "messages": [{{"role": "user", "content": "{}"}}]}}"#, text).into_bytes()
}

fn semantic_env(semantic: &str) -> Env {
    env(&format!(r#"{{"semantic_service": {{"cluster": "semantic", "authority": "127.0.0.1:9"}},
        "policies": [{{"model_prefix": "m", "ttl_s": 60, "semantic": {}}}]}}"#, semantic))
}

fn json_of(body: &[u8]) -> serde_json::Value {
    serde_json::from_slice(body).unwrap()
}

/// The index service's answer to a lookup.
fn service(status: &str, body: &str) -> Option<CalloutAnswer> {
    Some(CalloutAnswer { headers: Headers { pairs: pairs(&[(":status", status)]), not_utf8: Vec::new() }, body: body.as_bytes().to_vec() })
}

#[test]
fn a_hit_counts_the_tokens_its_entry_saved() {
    let e = env(r#"{"policies": [{"model_prefix": "m", "ttl_s": 60}]}"#);
    let (mut flow, mut h) = e.stream(0, 1);
    assert_eq!(ask(&mut flow, &mut h, CHAT, &[], &[&chat("hi")], false), Continue);
    json_answer(&mut flow, &mut h, "200", CHAT_ANSWER, &[]);
    assert_eq!(h.counted(m::STORES), 1);
    for id in [2, 3] {
        let (mut flow, mut h) = e.stream(0, id);
        assert_eq!(ask(&mut flow, &mut h, CHAT, &[], &[&chat("hi")], false), Stop);
        assert_eq!((h.counted(&m::policy_metric("m", m::TOKENS_SAVED_PROMPT)), h.counted(&m::policy_metric("m", m::TOKENS_SAVED_COMPLETION))),
                   (27, 12));
    }
    assert!(h.callouts.is_empty(), "no semantic policy: no lookup");
}

#[test]
fn an_exact_miss_is_looked_up_indexed_once_stored_and_a_similar_prompt_served() {
    let e = semantic_env(r#"{"threshold": 0.9}"#);
    let (mut flow, mut h) = e.stream(0, 1);
    assert_eq!(ask(&mut flow, &mut h, CHAT, &[], &[&chat("hi")], false), Pause, "paused for the lookup");
    let (cluster, headers, body) = h.callouts[0].clone();
    assert_eq!((cluster.as_str(), get(&headers, ":path"), get(&headers, ":authority")),
               ("semantic", Some(semantic::LOOKUP_PATH.to_string()), Some("127.0.0.1:9".to_string())));
    let lookup = json_of(&body);
    assert_eq!((lookup["text"].as_str(), lookup["threshold"].as_f64(), lookup["shadow"].as_bool()), (Some("hi"), Some(0.9), Some(false)));
    flow.on_callout(&mut h, service("200", r#"{"hit": false, "would_hit": false, "similarity": 0.2, "key": null}"#));
    assert!(h.resumed, "nothing similar: upstream");
    assert_eq!(h.counted(m::MISSES), 1);
    json_answer(&mut flow, &mut h, "200", CHAT_ANSWER, &[]);
    assert_eq!(h.status(), "meshcache; fwd=miss; stored");
    let (cluster, headers, body) = h.posts[0].clone();
    assert_eq!((cluster.as_str(), get(&headers, ":path")), ("semantic", Some(semantic::STORE_PATH.to_string())));
    let stored = json_of(&body);
    assert_eq!((stored["scope"].clone(), stored["ttl_s"].as_u64()), (lookup["scope"].clone(), Some(60)));
    let key = stored["key"].as_str().unwrap().to_string();

    let (mut flow, mut h) = e.stream(0, 2);
    assert_eq!(ask(&mut flow, &mut h, CHAT, &[], &[&chat("hello")], false), Pause);
    assert_eq!(json_of(&h.callouts[0].2)["scope"], lookup["scope"], "same scope, another text");
    flow.on_callout(&mut h, service("200", &format!(r#"{{"hit": true, "would_hit": true, "similarity": 0.93456, "key": "{}"}}"#, key)));
    let (status, headers, got) = h.sent.clone().expect("answered from the similar prompt's entry");
    assert_eq!((status, got), (200, CHAT_ANSWER.to_vec()));
    assert_eq!(get(&headers, names::CACHE_STATUS).unwrap(), semantic::CACHE_STATUS_SEMANTIC_HIT);
    assert_eq!(get(&headers, semantic::SIMILARITY_HEADER).unwrap(), "0.9346");
    assert!(!h.resumed);
    assert_eq!((h.counted(m::SEMANTIC_LOOKUPS), h.counted(m::SEMANTIC_HITS), h.counted(m::HITS), h.counted(m::MISSES)), (1, 1, 1, 0));
    assert_eq!(h.counted(&m::policy_metric("m", m::TOKENS_SAVED_COMPLETION)), 12, "a semantic hit saves its entry's tokens");
    flow.end(&mut h);
    assert!(h.posts.is_empty(), "a hit stores nothing");

    // A key this sidecar does not hold: upstream (would_hit), its answer indexed.
    let (mut flow, mut h) = e.stream(0, 3);
    assert_eq!(ask(&mut flow, &mut h, CHAT, &[], &[&chat("hey")], false), Pause);
    flow.on_callout(&mut h, service("200", &format!(r#"{{"hit": true, "would_hit": true, "similarity": 0.95, "key": "{}"}}"#, "09".repeat(32))));
    assert!(h.resumed && h.sent.is_none());
    assert_eq!(h.counted(m::SEMANTIC_WOULD_HIT), 1);
    json_answer(&mut flow, &mut h, "200", CHAT_ANSWER, &[]);
    assert_eq!(h.posts.len(), 1);
    assert!(h.errors.is_empty(), "{:?}", h.errors);
}

#[test]
fn shadow_mode_goes_upstream_and_reports_whether_the_answers_matched() {
    let e = semantic_env(r#"{"shadow": true}"#);
    let same = semantic::answer_digest(Some("application/json"), CHAT_ANSWER);
    for (id, hash, matched) in [(1, same, true), (2, "0".repeat(64), false)] {
        let (mut flow, mut h) = e.stream(0, id);
        assert_eq!(ask(&mut flow, &mut h, CHAT, &[], &[&chat(&format!("q{}", id))], false), Pause);
        let verdict = format!(r#"{{"hit": false, "would_hit": true, "similarity": 0.97, "key": "{}", "response_hash": "{}"}}"#, "01".repeat(32), hash);
        flow.on_callout(&mut h, service("200", &verdict));
        assert!(h.resumed && h.sent.is_none(), "shadow mode never serves");
        json_answer(&mut flow, &mut h, "200", CHAT_ANSWER, &[]);
        let paths: Vec<Option<String>> = h.posts.iter().map(|(_, hs, _)| get(hs, ":path")).collect();
        assert_eq!(paths, vec![Some(semantic::STORE_PATH.to_string()), Some(semantic::SHADOW_PATH.to_string())]);
        assert_eq!(json_of(&h.posts[1].2), serde_json::json!({"policy": "m", "similarity": 0.97, "matched": matched}));
        assert_eq!(h.counted(m::SEMANTIC_WOULD_HIT), 1);
    }
}

#[test]
fn a_failed_lookup_goes_upstream_and_counts_an_error() {
    let e = semantic_env("{}");
    let (mut flow, mut h) = e.stream(0, 1);
    h.callouts_down = true;
    assert_eq!(ask(&mut flow, &mut h, CHAT, &[], &[&chat("hi")], false), Continue, "not sent: upstream at once");
    for (id, answer) in [(2, None), (3, service("503", "")), (4, service("200", "{not json"))] {
        let (mut flow, mut h) = e.stream(0, id);
        assert_eq!(ask(&mut flow, &mut h, CHAT, &[], &[&chat(&format!("x{}", id))], false), Pause);
        flow.on_callout(&mut h, answer);
        assert!(h.resumed);
        assert_eq!((h.counted(m::SEMANTIC_ERRORS), h.counted(m::MISSES), h.counted(m::ERRORS)), (1, 1, 0));
    }
    assert_eq!((h.counted(m::SEMANTIC_ERRORS), h.counted(m::MISSES)), (1, 1));
    // Not a chat completion, or no last user text: no lookup.
    let (mut flow, mut h) = e.stream(0, 5);
    assert_eq!(ask(&mut flow, &mut h, INFER, &[], &[BODY], false), Continue);
    assert!(h.callouts.is_empty());
}

#[test]
fn after_the_lookup_an_identical_request_in_flight_is_waited_for() {
    let e = semantic_env("{}").with_config(r#"{"semantic_service": {"cluster": "semantic", "authority": "a"},
        "policies": [{"model_prefix": "m", "ttl_s": 60, "coalesce_timeout_ms": 5000, "semantic": {}}]}"#);
    let none = r#"{"hit": false, "would_hit": false, "similarity": 0.1, "key": null}"#;
    let (mut leader, mut lh) = e.stream(0, 1);
    let (mut waiter, mut wh) = e.stream(0, 2);
    assert_eq!(ask(&mut leader, &mut lh, CHAT, &[], &[&chat("hi")], false), Pause);
    assert_eq!(ask(&mut waiter, &mut wh, CHAT, &[], &[&chat("hi")], false), Pause, "both looked up: the lookup comes first");
    leader.on_callout(&mut lh, service("200", none));
    assert!(lh.resumed, "the first back leads");
    waiter.on_callout(&mut wh, service("200", none));
    assert!(!wh.resumed, "the second waits for it");
    assert_eq!(wh.counted(m::COALESCE_WAITS), 1);
    json_answer(&mut leader, &mut lh, "200", CHAT_ANSWER, &[]);
    deliver(&e, &mut waiter, &mut wh);
    assert_eq!(wh.sent_body(), CHAT_ANSWER);
    assert_eq!(wh.counted(&m::policy_metric("m", m::TOKENS_SAVED_PROMPT)), 27);
}

trait ReplaceId {
    fn replace_id(&self, id: &str) -> Vec<u8>;
}

impl ReplaceId for [u8] {
    fn replace_id(&self, id: &str) -> Vec<u8> {
        String::from_utf8(self.to_vec()).unwrap().replacen("\"a\"", &format!("\"{}\"", id), 1).into_bytes()
    }
}
