//! The Wasm flow against a fake host: Envoy's side of each exchange (headers, the body buffer of
//! the current callback, local replies, the wake queue, the background refresh) kept in memory,
//! so held, streamed, hit, coalesced and stale cases run in milliseconds. The Envoy suite
//! (tests/filter) checks the same cases against the real host.

use super::*;
use meshcache_core::config::parse_plugin_config;
use meshcache_core::store::SharedData;
use std::collections::VecDeque;

/// Envoy's shared data for one VM: cas 0 writes unconditionally, each write a fresh cas.
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

/// One stream's side of Envoy.
#[derive(Default)]
struct Exchange {
    req: Vec<(String, String)>,
    req_body: Vec<u8>,
    resp: Vec<(String, String)>,
    /// The response body buffer of the current callback (what was paused plus what arrived).
    resp_body: Vec<u8>,
    /// Response body bytes let through to the client.
    passed: Vec<u8>,
    trailers: Vec<(String, String)>,
    reply: Option<(u32, Vec<(String, String)>, Vec<u8>)>,
    resumed: bool,
}

#[derive(Default)]
struct Fake {
    now: u64,
    data: Mem,
    current: u32,
    x: HashMap<u32, Exchange>,
    counts: HashMap<String, u64>,
    errors: Vec<String>,
    queues: HashMap<u32, VecDeque<Vec<u8>>>,
    refresh_ok: bool,
    refreshes: Vec<(u32, u32, meshcache_core::hashing::KeyDigest)>,
    logged: Vec<String>,
    /// The semantic service's calls: (path, body, reply); `semantic_down`: none can be sent.
    semantic_calls: Vec<(String, Vec<u8>, bool)>,
    semantic_down: bool,
}

fn set(h: &mut Vec<(String, String)>, name: &str, value: &str) {
    h.retain(|(n, _)| !n.eq_ignore_ascii_case(name));
    h.push((name.to_string(), value.to_string()));
}

fn get<'a>(h: &'a [(String, String)], name: &str) -> Option<&'a str> {
    h.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
}

impl Fake {
    fn x(&mut self) -> &mut Exchange {
        self.x.entry(self.current).or_default()
    }
    fn map(&mut self, map: Map) -> &mut Vec<(String, String)> {
        let x = self.x();
        match map {
            Map::RequestHeaders => &mut x.req,
            Map::ResponseHeaders => &mut x.resp,
            _ => &mut x.trailers,
        }
    }
    fn buf(&mut self, kind: Buffer) -> &mut Vec<u8> {
        let x = self.x();
        match kind {
            Buffer::RequestBody => &mut x.req_body,
            _ => &mut x.resp_body,
        }
    }
    fn counted(&self, name: &str) -> u64 {
        self.counts.get(name).copied().unwrap_or(0)
    }
}

impl Host for Fake {
    type Shared = Mem;
    fn shared(&self) -> Mem {
        self.data.clone()
    }
    fn headers(&mut self, map: Map) -> Headers {
        Headers { pairs: self.map(map).clone(), not_utf8: Vec::new() }
    }
    fn header(&mut self, map: Map, name: &str) -> Option<String> {
        get(self.map(map), name).map(str::to_string)
    }
    fn set_header(&mut self, map: Map, name: &str, value: &str) {
        set(self.map(map), name, value)
    }
    fn set_headers(&mut self, map: Map, pairs: &[(&str, &str)]) -> bool {
        *self.map(map) = pairs.iter().map(|(n, v)| (n.to_string(), v.to_string())).collect();
        true
    }
    fn add_header(&mut self, map: Map, name: &str, value: &str) -> bool {
        self.map(map).push((name.to_string(), value.to_string()));
        true
    }
    fn remove_header(&mut self, map: Map, name: &str) {
        self.map(map).retain(|(n, _)| !n.eq_ignore_ascii_case(name))
    }
    fn body(&mut self, kind: Buffer, start: usize, max: usize) -> Option<Vec<u8>> {
        let b = self.buf(kind);
        b.get(start..(start + max).min(b.len())).map(<[u8]>::to_vec)
    }
    fn body_into(&mut self, kind: Buffer, start: usize, max: usize, out: &mut Vec<u8>) -> Option<usize> {
        let got = self.body(kind, start, max)?;
        out.extend_from_slice(&got);
        Some(got.len())
    }
    fn set_body(&mut self, kind: Buffer, start: usize, len: usize, data: &[u8]) -> bool {
        let b = self.buf(kind);
        let end = (start + len).min(b.len());
        b.splice(start..end, data.iter().copied());
        true
    }
    fn send_local_response(&mut self, status: u32, _details: &str, body: &[u8], headers: &[(&str, &str)], _grpc: i32) -> bool {
        let h = headers.iter().map(|(n, v)| (n.to_string(), v.to_string())).collect();
        self.x().reply = Some((status, h, body.to_vec()));
        true
    }
    fn continue_request(&mut self) -> bool {
        self.x().resumed = true;
        true
    }
    fn set_effective_context(&mut self, id: u32) -> bool {
        self.current = id;
        true
    }
    fn now_ms(&self) -> u64 {
        self.now
    }
    fn now_ns(&self) -> u64 {
        self.now * 1_000_000
    }
    fn peer_identity(&self) -> Option<String> {
        None
    }
    fn upstream_cluster(&self) -> Option<String> {
        Some("origin".to_string())
    }
    fn set_property(&mut self, _name: &str, _value: &[u8]) -> bool {
        true
    }
    fn clear_route_cache(&mut self) -> bool {
        true
    }
    fn count(&mut self, name: &str, n: u64) {
        *self.counts.entry(name.to_string()).or_default() += n;
    }
    fn semantic_instance(&mut self) -> String {
        "test-instance".to_string()
    }
    fn semantic_call(&mut self, _root: u32, _stream: u32, _service: &meshcache_core::config::SemanticService, path: &str, body: &[u8],
                     reply: bool) -> bool {
        self.semantic_calls.push((path.to_string(), body.to_vec(), reply));
        !self.semantic_down
    }
    fn count_policy(&mut self, prefix: &str, what: &str, n: u64) {
        self.count(&meshcache_core::metric_names::policy_metric(prefix, what), n);
    }
    fn error(&mut self, msg: &str) {
        self.count(m::ERRORS, 1);
        self.errors.push(msg.to_string());
    }
    fn log_debug(&mut self, line: &dyn Fn() -> String) {
        self.logged.push(line());
    }
    fn register_queue(&mut self, _name: &str) -> Option<u32> {
        self.queues.insert(7, VecDeque::new());
        Some(7)
    }
    fn enqueue(&mut self, queue: u32, message: &[u8]) -> bool {
        match self.queues.get_mut(&queue) {
            Some(q) => {
                q.push_back(message.to_vec());
                true
            }
            None => false,
        }
    }
    fn dequeue(&mut self, queue: u32) -> Option<Vec<u8>> {
        self.queues.get_mut(&queue)?.pop_front()
    }
    fn refresh(&mut self, root: u32, stream: u32, c: &Cacheable, _headers: &[(String, String)], _body: &[u8], _limits: &Limits,
               _now: u64) -> bool {
        if self.refresh_ok {
            self.refreshes.push((root, stream, c.key));
        }
        self.refresh_ok
    }
}

const ROOT: u32 = 1;
const T0: u64 = 1_800_000_000_000;
const ASK: &[u8] = br#"{"model": "m1", "messages": [{"role": "user", "content": "hi"}]}"#;

/// A fake host with the store laid out and (server role) the wake queue registered, as the
/// root context's `on_configure` leaves them.
fn setup(policy: &str) -> (Fake, Rc<Config>) {
    let cfg = parse_plugin_config(format!(r#"{{"policies": [{{"model_prefix": "m", {}}}]}}"#, policy).as_bytes()).unwrap();
    let mut f = Fake { now: T0, ..Fake::default() };
    Cache { data: &f.shared(), limits: &cfg.limits }.reconcile(&mut Outcome::default());
    setup_coalescing(&mut f);
    (f, Rc::new(cfg))
}

/// Stream `id` sends `body` (headers, then the whole body): the body callback's action.
fn ask(f: &mut Fake, cfg: &Rc<Config>, id: u32, body: &[u8]) -> u32 {
    create(id, ROOT, Some(cfg.clone()));
    f.current = id;
    let x = f.x();
    for (n, v) in [(":method", "POST"), (":path", "/v1/chat/completions"), (":authority", "svc"), ("content-type", "application/json")] {
        set(&mut x.req, n, v);
    }
    x.req_body = body.to_vec();
    assert_eq!(with(id, |s| s.on_request_headers(f, false)), PAUSE, "held while the body is read");
    with(id, |s| s.on_request_body(f, body.len(), true))
}

/// The origin answers stream `id`: status, `content-length`, the body in `chunks`. The
/// response headers' action.
fn answer(f: &mut Fake, id: u32, status: u16, body: &[u8], chunks: usize) -> u32 {
    f.current = id;
    let x = f.x();
    x.resp = vec![(":status".into(), status.to_string()), ("content-type".into(), "application/json".into()),
                  ("content-length".into(), body.len().to_string())];
    let headers = with(id, |s| s.on_response_headers(f, body.is_empty()));
    let size = (body.len() + chunks - 1) / chunks.max(1);
    let mut parts = body.chunks(size.max(1)).peekable();
    while let Some(part) = parts.next() {
        f.current = id;
        f.x().resp_body.extend_from_slice(part);
        let n = f.x().resp_body.len();
        if with(id, |s| s.on_response_body(f, n, parts.peek().is_none())) == CONTINUE {
            let x = f.x();
            let sent = std::mem::take(&mut x.resp_body);
            x.passed.extend_from_slice(&sent);
        }
    }
    headers
}

fn reply(f: &Fake, id: u32) -> (u32, Vec<(String, String)>, Vec<u8>) {
    f.x.get(&id).and_then(|x| x.reply.clone()).expect("a local reply")
}

fn status_of(headers: &[(String, String)]) -> String {
    get(headers, CACHE_STATUS_NAME).unwrap_or("").to_string()
}

const CACHE_STATUS_NAME: &str = names::CACHE_STATUS;

#[test]
fn a_small_miss_is_held_stored_and_then_hit() {
    let (mut f, cfg) = setup(r#""ttl_s": 60"#);
    assert_eq!(ask(&mut f, &cfg, 2, ASK), CONTINUE, "a miss goes upstream");
    let body = br#"{"answer": 42}"#;
    assert_eq!(answer(&mut f, 2, 200, body, 2), PAUSE, "a small answer's headers are held");
    let x = &f.x[&2];
    assert_eq!(x.passed, body.to_vec());
    assert_eq!(status_of(&x.resp), names::cache_status_stored(false));
    assert!(get(&x.resp, names::HASH_HEADER).is_some(), "the held headers carry the hash");
    assert_eq!(f.counted(m::STORES), 1);

    f.now += 1000;
    assert_eq!(ask(&mut f, &cfg, 3, ASK), PAUSE, "a hit is answered locally");
    let (status, headers, got) = reply(&f, 3);
    assert_eq!((status, got), (200, body.to_vec()));
    assert!(status_of(&headers).contains("hit"), "{:?}", headers);
    assert_eq!(f.counted(m::HITS), 1);
    assert!(f.errors.is_empty(), "{:?}", f.errors);
}

#[test]
fn a_large_answer_streams_through_and_is_stored_whole() {
    let (mut f, cfg) = setup(r#""ttl_s": 60"#);
    assert_eq!(ask(&mut f, &cfg, 2, ASK), CONTINUE);
    let big: Vec<u8> = (0..response::HOLD_BYTES + 4096).map(|i| b'a' + (i % 26) as u8).collect();
    assert_eq!(answer(&mut f, 2, 200, &big, 5), CONTINUE, "headers of an answer past HOLD_BYTES are not held");
    let x = &f.x[&2];
    assert_eq!(x.passed.len(), big.len(), "every chunk passed as it came");
    assert_eq!(status_of(&x.resp), names::cache_status_forwarded(false));
    assert_eq!(f.counted(m::STORES), 1, "{:?}", f.errors);

    assert_eq!(ask(&mut f, &cfg, 3, ASK), PAUSE);
    assert_eq!(reply(&f, 3).2, big, "the hit answers the whole body");
}

#[test]
fn an_answer_past_max_entry_bytes_passes_and_is_not_stored() {
    let (mut f, cfg) = setup(r#""ttl_s": 60"#);
    let limit = cfg.limits.max_entry_bytes as usize;
    assert_eq!(ask(&mut f, &cfg, 2, ASK), CONTINUE);
    let big = vec![b'x'; limit + 1];
    answer(&mut f, 2, 200, &big, 3);
    assert_eq!(f.counted(m::STORES), 0);
    assert!(status_of(&f.x[&2].resp).contains("fwd=miss"), "{:?}", f.x[&2].resp);
    assert_eq!(ask(&mut f, &cfg, 3, ASK), CONTINUE, "still a miss");
}

#[test]
fn a_coalesced_waiter_is_served_from_the_leaders_entry() {
    let (mut f, cfg) = setup(r#""ttl_s": 60, "coalesce_timeout_ms": 5000"#);
    assert_eq!(ask(&mut f, &cfg, 2, ASK), CONTINUE, "the leader goes upstream");
    assert_eq!(ask(&mut f, &cfg, 3, ASK), PAUSE, "an identical request waits");
    assert_eq!(f.counted(m::COALESCE_WAITS), 1);
    let body = br#"{"answer": "once"}"#;
    answer(&mut f, 2, 200, body, 1);
    assert_eq!(f.queues[&7].len(), 1, "the leader's store wakes this worker");
    on_queue_ready(&mut f, 7);
    let (status, headers, got) = reply(&f, 3);
    assert_eq!((status, got), (200, body.to_vec()));
    assert_eq!(status_of(&headers), names::CACHE_STATUS_COLLAPSED);
    assert!(!f.x[&3].resumed, "the waiter never went upstream");
    assert_eq!(f.counted(m::COALESCE_SERVED), 1);
}

#[test]
fn a_coalesced_waiter_goes_upstream_when_the_leader_fails() {
    let (mut f, cfg) = setup(r#""ttl_s": 60, "coalesce_timeout_ms": 5000"#);
    assert_eq!(ask(&mut f, &cfg, 2, ASK), CONTINUE);
    assert_eq!(ask(&mut f, &cfg, 3, ASK), PAUSE);
    answer(&mut f, 2, 503, b"busy", 1);
    on_queue_ready(&mut f, 7);
    assert!(f.x[&3].reply.is_none());
    assert!(f.x[&3].resumed, "the waiter is resumed to go upstream itself");
    // It leads now: its answer is stored.
    answer(&mut f, 3, 200, br#"{"answer": 1}"#, 1);
    assert_eq!(f.counted(m::STORES), 1, "{:?}", f.errors);
}

#[test]
fn a_waiter_resumes_when_its_leader_is_reset() {
    let (mut f, cfg) = setup(r#""ttl_s": 60, "coalesce_timeout_ms": 5000"#);
    assert_eq!(ask(&mut f, &cfg, 2, ASK), CONTINUE);
    assert_eq!(ask(&mut f, &cfg, 3, ASK), PAUSE);
    delete(&mut f, 2);
    on_queue_ready(&mut f, 7);
    assert!(f.x[&3].resumed);
}

#[test]
fn a_waiter_past_its_timeout_goes_upstream() {
    let (mut f, cfg) = setup(r#""ttl_s": 60, "coalesce_timeout_ms": 100"#);
    assert_eq!(ask(&mut f, &cfg, 2, ASK), CONTINUE);
    assert_eq!(ask(&mut f, &cfg, 3, ASK), PAUSE);
    f.now += 50;
    expire_waiters(&mut f);
    assert!(!f.x[&3].resumed, "not yet");
    f.now += 100;
    expire_waiters(&mut f);
    assert!(f.x[&3].resumed);
    assert_eq!(f.counted(m::COALESCE_TIMEOUTS), 1);
}

/// Stores an answer for `ASK` through stream `id`, then lets `past_ms` pass.
fn stored(f: &mut Fake, cfg: &Rc<Config>, id: u32, body: &[u8], past_ms: u64) {
    assert_eq!(ask(f, cfg, id, ASK), CONTINUE);
    answer(f, id, 200, body, 1);
    assert_eq!(f.counted(m::STORES), 1, "{:?}", f.errors);
    f.now += past_ms;
}

#[test]
fn stale_if_error_answers_an_origin_error_with_the_expired_entry() {
    let (mut f, cfg) = setup(r#""ttl_s": 1, "stale_if_error_s": 60"#);
    let body = br#"{"answer": "old"}"#;
    stored(&mut f, &cfg, 2, body, 5_000);
    assert_eq!(ask(&mut f, &cfg, 3, ASK), CONTINUE, "an expired entry: the request goes upstream");
    assert_eq!(answer(&mut f, 3, 503, b"down", 1), PAUSE);
    let (status, headers, got) = reply(&f, 3);
    assert_eq!((status, got), (200, body.to_vec()));
    assert!(status_of(&headers).contains("stale"), "{:?}", headers);
    assert_eq!(f.counted(m::STALE_IF_ERROR), 1);
}

#[test]
fn an_origin_success_replaces_the_expired_entry() {
    let (mut f, cfg) = setup(r#""ttl_s": 1, "stale_if_error_s": 60"#);
    stored(&mut f, &cfg, 2, b"\"old\"", 5_000);
    assert_eq!(ask(&mut f, &cfg, 3, ASK), CONTINUE);
    answer(&mut f, 3, 200, b"\"new\"", 1);
    assert!(f.x[&3].reply.is_none());
    assert_eq!(ask(&mut f, &cfg, 4, ASK), PAUSE);
    assert_eq!(reply(&f, 4).2, b"\"new\"".to_vec());
}

#[test]
fn stale_while_revalidate_answers_at_once_and_refreshes_once() {
    let (mut f, cfg) = setup(r#""ttl_s": 1, "stale_while_revalidate_s": 60"#);
    f.refresh_ok = true;
    let body = br#"{"answer": "old"}"#;
    stored(&mut f, &cfg, 2, body, 5_000);
    for id in [3, 4, 5] {
        assert_eq!(ask(&mut f, &cfg, id, ASK), PAUSE, "answered from the expired entry");
        let (status, headers, got) = reply(&f, id);
        assert_eq!((status, got), (200, body.to_vec()));
        assert!(status_of(&headers).contains("stale"), "{:?}", headers);
    }
    assert_eq!(f.refreshes.len(), 1, "one background refresh for the key");
    assert_eq!(f.refreshes[0].0, ROOT, "owned by the root context");
    assert_eq!(f.counted(m::STALE_WHILE_REVALIDATE), 3);
    assert_eq!(f.counted(m::REFRESHES), 1, "counted where it is sent, as on the native host");
}

#[test]
fn stale_while_revalidate_without_a_background_request_forwards_this_one() {
    let (mut f, cfg) = setup(r#""ttl_s": 1, "stale_while_revalidate_s": 60"#);
    stored(&mut f, &cfg, 2, b"\"old\"", 5_000);
    assert_eq!(ask(&mut f, &cfg, 3, ASK), CONTINUE, "this request refreshes the entry");
    assert_eq!(f.counted(m::REFRESH_FAILURES), 1);
    assert_eq!(ask(&mut f, &cfg, 4, ASK), PAUSE, "others are answered stale meanwhile");
    answer(&mut f, 3, 200, b"\"new\"", 1);
    delete(&mut f, 3);
    assert_eq!(ask(&mut f, &cfg, 5, ASK), PAUSE);
    assert_eq!(reply(&f, 5).2, b"\"new\"".to_vec());
}

#[test]
fn a_grpc_answer_is_stored_at_its_trailers_and_hit_in_one_pass() {
    let (mut f, cfg) = setup(r#""ttl_s": 60"#);
    // ModelInferRequest { model_name: "m1" }, framed.
    let ask_grpc = grpc::frame(&[0x0a, 2, b'm', b'1']);
    let answer_grpc = grpc::frame(&[0x0a, 2, b'm', b'1', 0x12, 1, b'1']);
    for id in [2, 3] {
        create(id, ROOT, Some(cfg.clone()));
        f.current = id;
        let x = f.x();
        for (n, v) in [(":method", "POST"), (":path", meshcache_core::model::GRPC_MODEL_INFER_PATH), ("content-type", "application/grpc")] {
            set(&mut x.req, n, v);
        }
        x.req_body = ask_grpc.clone();
        assert_eq!(with(id, |s| s.on_request_headers(&mut f, false)), PAUSE);
    }
    // The first is a miss: its answer is held (unary gRPC) and stored when the trailers say OK.
    f.current = 2;
    assert_eq!(with(2, |s| s.on_request_body(&mut f, ask_grpc.len(), true)), CONTINUE);
    f.x().resp = vec![(":status".into(), "200".into()), ("content-type".into(), "application/grpc".into())];
    assert_eq!(with(2, |s| s.on_response_headers(&mut f, false)), PAUSE);
    f.x().resp_body = answer_grpc.clone();
    assert_eq!(with(2, |s| s.on_response_body(&mut f, answer_grpc.len(), false)), PAUSE);
    f.x().trailers = vec![("grpc-status".into(), "0".into())];
    assert_eq!(with(2, |s| s.on_response_trailers(&mut f)), CONTINUE);
    assert_eq!(status_of(&f.x[&2].resp), names::cache_status_stored(false));
    assert_eq!(f.counted(m::STORES), 1, "{:?}", f.errors);

    // The second is a hit: an empty local reply, which the hit route's Lua step gives a body that
    // the response callbacks fill with the message and a grpc-status trailer.
    f.current = 3;
    assert_eq!(with(3, |s| s.on_request_body(&mut f, ask_grpc.len(), true)), PAUSE);
    assert_eq!(reply(&f, 3).2, Vec::<u8>::new());
    assert_eq!(grpc_reply_headers(&mut f, 3, false), Some(CONTINUE));
    assert!(status_of(&f.x[&3].resp).contains("hit"), "{:?}", f.x[&3].resp);
    assert_eq!(grpc_reply_body(&mut f, 3, 0, true), Some(CONTINUE));
    assert_eq!(f.x[&3].resp_body, answer_grpc);
    assert_eq!(get(&f.x[&3].trailers, "grpc-status"), Some("0"));
    assert_eq!(grpc_reply_body(&mut f, 3, 0, true), None, "answered once");
}

#[test]
fn the_client_role_puts_a_routing_key_on_the_request() {
    let cfg = Rc::new(parse_plugin_config(br#"{"role": "client", "policies": [{"model_prefix": "m", "ttl_s": 60}]}"#).unwrap());
    let mut f = Fake { now: T0, ..Fake::default() };
    f.current = 2;
    set(&mut f.x().req, names::ROUTE_KEY_HEADER, "forged");
    assert_eq!(ask(&mut f, &cfg, 2, ASK), CONTINUE);
    let key = get(&f.x[&2].req, names::ROUTE_KEY_HEADER).expect("a routing key").to_string();
    assert_ne!(key, "forged", "a caller's key is dropped");
    assert_eq!(f.counted(m::ROUTED), 1);
    ask(&mut f, &cfg, 3, ASK);
    assert_eq!(get(&f.x[&3].req, names::ROUTE_KEY_HEADER), Some(key.as_str()), "identical requests, one key");
}

#[test]
fn a_bypass_is_counted_by_reason_and_logged_at_debug() {
    let (mut f, cfg) = setup(r#""ttl_s": 60"#);
    assert_eq!(ask(&mut f, &cfg, 2, br#"{"model": "other"}"#), CONTINUE);
    assert_eq!(f.counted(m::bypass_counter(Bypass::NoPolicy)), 1);
    assert_eq!(f.logged, vec!["meshcache: bypass detail=no-policy model=- path=/v1/chat/completions".to_string()]);
}

// ---------------------------------------------------------------- semantic layer, tokens saved

const CHAT_ANSWER: &[u8] = br#"{"id":"a","choices":[{"index":0,"message":{"role":"assistant","content":"Paris"}}],"usage":{"prompt_tokens":27,"completion_tokens":12}}"#;

fn semantic_setup(semantic: &str) -> (Fake, Rc<Config>) {
    let json = format!(r#"{{"semantic_service": {{"cluster": "semantic", "authority": "127.0.0.1:9"}},
        "policies": [{{"model_prefix": "m", "ttl_s": 60, "semantic": {}}}]}}"#, semantic);
    let cfg = parse_plugin_config(json.as_bytes()).unwrap();
    let mut f = Fake { now: T0, ..Fake::default() };
    Cache { data: &f.shared(), limits: &cfg.limits }.reconcile(&mut Outcome::default());
    setup_coalescing(&mut f);
    (f, Rc::new(cfg))
}

fn json_of(body: &[u8]) -> serde_json::Value {
    serde_json::from_slice(body).unwrap()
}

#[test]
fn a_hit_counts_the_tokens_its_entry_saved() {
    let (mut f, cfg) = setup(r#""ttl_s": 60"#);
    assert_eq!(ask(&mut f, &cfg, 2, ASK), CONTINUE);
    answer(&mut f, 2, 200, CHAT_ANSWER, 1);
    for id in [3, 4] {
        assert_eq!(ask(&mut f, &cfg, id, ASK), PAUSE);
    }
    assert_eq!(f.counted(&m::policy_metric("m", m::TOKENS_SAVED_PROMPT)), 54);
    assert_eq!(f.counted(&m::policy_metric("m", m::TOKENS_SAVED_COMPLETION)), 24);
}

#[test]
fn an_exact_miss_is_looked_up_indexed_once_stored_and_a_similar_prompt_served() {
    let (mut f, cfg) = semantic_setup(r#"{"threshold": 0.9}"#);
    assert_eq!(ask(&mut f, &cfg, 2, ASK), PAUSE, "paused for the lookup");
    let (path, body, reply_to) = f.semantic_calls[0].clone();
    assert_eq!((path.as_str(), reply_to), (semantic::LOOKUP_PATH, true));
    let lookup = json_of(&body);
    assert_eq!((lookup["text"].as_str(), lookup["threshold"].as_f64(), lookup["shadow"].as_bool()), (Some("hi"), Some(0.9), Some(false)));
    f.current = 2;
    with(2, |s| s.on_semantic_answer(&mut f, Ok(Verdict::Upstream)));
    assert!(f.x[&2].resumed, "nothing similar: upstream");
    answer(&mut f, 2, 200, CHAT_ANSWER, 1);
    let (path, body, reply_to) = f.semantic_calls[1].clone();
    assert_eq!((path.as_str(), reply_to), (semantic::STORE_PATH, false));
    let stored = json_of(&body);
    assert_eq!((stored["scope"].clone(), stored["ttl_s"].as_u64()), (lookup["scope"].clone(), Some(60)));
    let key = meshcache_core::hashing::unhex(stored["key"].as_str().unwrap()).unwrap();

    let similar = br#"{"model": "m1", "messages": [{"role": "user", "content": "hello"}]}"#;
    assert_eq!(ask(&mut f, &cfg, 3, similar), PAUSE);
    assert_eq!(json_of(&f.semantic_calls[2].1)["scope"], lookup["scope"], "same scope, another text");
    let mut digest = [0u8; 32];
    digest.copy_from_slice(&key);
    f.current = 3;
    assert_eq!(with(3, |s| s.on_semantic_answer(&mut f, Ok(Verdict::Serve { key: digest, similarity: 0.93456 }))), PAUSE);
    let (status, headers, got) = reply(&f, 3);
    assert_eq!((status, got), (200, CHAT_ANSWER.to_vec()));
    assert_eq!(status_of(&headers), "meshcache; hit; detail=semantic");
    assert_eq!(get(&headers, "x-meshcache-similarity"), Some("0.9346"));
    assert_eq!((f.counted(m::SEMANTIC_LOOKUPS), f.counted(m::SEMANTIC_HITS), f.counted(m::HITS)), (2, 1, 1));
    assert_eq!(f.counted(&m::policy_metric("m", m::TOKENS_SAVED_COMPLETION)), 12);
    assert_eq!(f.semantic_calls.len(), 3, "a hit stores nothing");

    // A key this sidecar does not hold: upstream (would_hit), its answer indexed.
    assert_eq!(ask(&mut f, &cfg, 4, br#"{"model": "m1", "messages": [{"role": "user", "content": "hey"}]}"#), PAUSE);
    f.current = 4;
    with(4, |s| s.on_semantic_answer(&mut f, Ok(Verdict::Serve { key: [9; 32], similarity: 0.95 })));
    assert!(f.x[&4].resumed);
    assert_eq!(f.counted(m::SEMANTIC_WOULD_HIT), 1);
    assert!(f.errors.is_empty(), "{:?}", f.errors);
}

#[test]
fn shadow_mode_goes_upstream_and_reports_whether_the_answers_matched() {
    let (mut f, cfg) = semantic_setup(r#"{"shadow": true}"#);
    let same = semantic::answer_digest(Some("application/json"), CHAT_ANSWER);
    for (id, hash, matched) in [(2, same.clone(), true), (3, "0".repeat(64), false)] {
        let body = format!(r#"{{"model": "m1", "messages": [{{"role": "user", "content": "q{}"}}]}}"#, id);
        assert_eq!(ask(&mut f, &cfg, id, body.as_bytes()), PAUSE);
        f.current = id;
        with(id, |s| s.on_semantic_answer(&mut f, Ok(Verdict::Shadow { response_hash: hash, similarity: 0.97 })));
        assert!(f.x[&id].resumed, "shadow mode never serves");
        answer(&mut f, id, 200, CHAT_ANSWER, 1);
        let (path, report, _) = f.semantic_calls.last().unwrap().clone();
        assert_eq!(path, semantic::SHADOW_PATH);
        assert_eq!(json_of(&report), serde_json::json!({"policy": "m", "similarity": 0.97, "matched": matched}));
    }
    assert_eq!(f.counted(m::SEMANTIC_WOULD_HIT), 2);
}

#[test]
fn a_failed_lookup_goes_upstream() {
    let (mut f, cfg) = semantic_setup("{}");
    f.semantic_down = true;
    assert_eq!(ask(&mut f, &cfg, 2, ASK), CONTINUE, "not sent: upstream at once");
    f.semantic_down = false;
    assert_eq!(ask(&mut f, &cfg, 3, br#"{"model": "m1", "messages": [{"role": "user", "content": "x"}]}"#), PAUSE);
    f.current = 3;
    with(3, |s| s.on_semantic_answer(&mut f, Err("timeout")));
    assert!(f.x[&3].resumed);
    assert_eq!((f.counted(m::SEMANTIC_ERRORS), f.counted(m::MISSES)), (2, 2));
}
