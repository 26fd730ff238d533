//! HTTP stream contexts: gather inputs through `Host` (the ABI, or the tests' fake), apply the
//! core's request/response/answer/store steps, write results back. Every path fails open: on any
//! surprise the request continues and `errors` counts it. Thread-locals here are per VM/worker.

use crate::host::{Buffer, Host, Map};
use meshcache_core::hit::{self, HitRequest};
use meshcache_core::cache_control::NotStored;
use meshcache_core::coalesce::{self, Join, LockTable, Release, Ticket, Waiters, Woken};
use meshcache_core::config::{Config, Limits, Role};
use meshcache_core::request::{self, BodyDecision, Cacheable, HeadDecision, RequestHead};
use meshcache_core::grpc;
use meshcache_core::logs;
use meshcache_core::headermap::{self, Headers};
use meshcache_core::response::{self, Collect};
use meshcache_core::metric_names as m;
use meshcache_core::model::ModelSource;
use meshcache_core::names::{self, Bypass};
use meshcache_core::route_key;
use meshcache_core::revalidate::{self, Claim};
use meshcache_core::semantic::{self, Plan, Verdict};
use meshcache_core::stale;
use meshcache_core::store::{Cache, Lifetime, Lookup, Outcome};
use meshcache_core::insert;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;

const CONTINUE: u32 = 0;
const PAUSE: u32 = 1;

thread_local! {
    static STREAMS: RefCell<HashMap<u32, Stream>> = RefCell::new(HashMap::new());
}

pub fn create(id: u32, root: u32, plugin: Option<Rc<Config>>) {
    let stream =
        Stream { id, root, plugin, phase: Phase::Pass, fallback: None, stale_route: false, lock: None, refreshing: None, semantic: None };
    STREAMS.with(|s| s.borrow_mut().insert(id, stream));
}

pub fn delete<H: Host>(h: &mut H, id: u32) {
    let gone = STREAMS.with(|s| s.borrow_mut().remove(&id));
    if let Some(key) = gone.as_ref().and_then(|s| s.refreshing) {
        // This forwarded request was the key's refresh: done, stored or not.
        revalidate::release(&h.shared(), &key);
    }
    GRPC_REPLIES.with(|r| r.borrow_mut().remove(&id));
    WAITERS.with(|w| w.borrow_mut().remove(id));
    if let Some(mut stream) = gone {
        // A leader that ends without an answer (reset, client gone): its waiters try again.
        stream.release(h, Release::Retry);
    }
}

// ---------------------------------------------------------------- request coalescing
//
// The lock table (`coalesce::LockTable`, shared data) says which key is in flight and which
// workers wait on it; each worker keeps its own paused waiters (`WAITERS`) and a shared queue
// the leaders' releases are sent to. `on_queue_ready` resumes the waiters of a released key;
// the root's tick resumes those whose `coalesce_timeout_ms` has passed.

thread_local! {
    static WAITERS: RefCell<Waiters> = RefCell::new(Waiters::default());
    /// This worker's wake queue, once a root context registered it.
    static WAKE_QUEUE: Cell<Option<u32>> = Cell::new(None);
    static WAKE_NAME: RefCell<String> = RefCell::new(String::new());
}

/// A hit saves what its entry's answer cost (its stored OpenAI `usage`).
fn count_tokens_saved<H: Host>(h: &mut H, prefix: &str, entry: &meshcache_core::entry::Entry) {
    for (what, n) in [(m::TOKENS_SAVED_PROMPT, entry.usage.prompt_tokens), (m::TOKENS_SAVED_COMPLETION, entry.usage.completion_tokens)] {
        if n > 0 {
            h.count_policy(prefix, what, n as u64);
        }
    }
}

/// Resumes the effective stream's request (a waiter that goes upstream after all).
fn continue_now<H: Host>(h: &mut H) -> u32 {
    if !h.continue_request() {
        h.error("could not resume a coalesced request");
    }
    CONTINUE
}

/// Wake messages handled per queue callback (the rest wait for the next one).
const MAX_WAKES_PER_CALLBACK: usize = 4096;

/// Called by each root context's `on_configure`: the lock table exists, and this worker's
/// queue is registered under a name no other worker uses (registering it again points it at
/// the newest root context).
pub fn setup_coalescing<H: Host>(h: &mut H) {
    LockTable { data: &h.shared() }.create_slots();
    let name = WAKE_NAME.with(|n| {
        let mut n = n.borrow_mut();
        if n.is_empty() {
            *n = format!("meshcache:wake:{}", h.now_ns());
        }
        n.clone()
    });
    match h.register_queue(&name) {
        Some(q) => WAKE_QUEUE.with(|w| w.set(Some(q))),
        None => h.error("could not register the coalescing queue; identical misses are not coalesced"),
    }
}

pub fn on_queue_ready<H: Host>(h: &mut H, queue: u32) {
    for _ in 0..MAX_WAKES_PER_CALLBACK {
        let message = match h.dequeue(queue) {
            Some(m) => m,
            None => return,
        };
        let (key, release) = match coalesce::decode_wake(&message) {
            Some(w) => w,
            None => {
                h.error("unreadable coalescing wake message");
                continue;
            }
        };
        for (id, deadline) in WAITERS.with(|w| w.borrow_mut().take(&key)) {
            if h.set_effective_context(id) {
                with(id, |s| s.on_wake(h, release, deadline));
            }
        }
    }
}

/// The root's tick: waiters past their deadline go upstream themselves.
pub fn expire_waiters<H: Host>(h: &mut H) {
    if WAITERS.with(|w| w.borrow().is_empty()) {
        return;
    }
    let late = WAITERS.with(|w| w.borrow_mut().expired(h.now_ms()));
    for id in late {
        if h.set_effective_context(id) {
            with(id, |s| s.on_coalesce_timeout(h));
        }
    }
}

// ---------------------------------------------------------------- single-pass gRPC hits
//
// A local reply to a gRPC request is headers-only (trailers-only) in Envoy. The hit route's Lua
// step (`meshcache.grpc_hit_body`, see docs/filter.md) gives it an empty body; the reply's
// response callbacks, which may run while `send_local_response` is still on the stack (the
// stream is then out of STREAMS), find the answer here, write the headers, the framed message
// and a `grpc-status: 0` trailer.

struct GrpcReply {
    headers: Vec<(String, String)>,
    framed: Vec<u8>,
}

thread_local! {
    static GRPC_REPLIES: RefCell<HashMap<u32, GrpcReply>> = RefCell::new(HashMap::new());
    /// Set when a hit reply arrived without the body the hit route's Lua step adds: this Envoy
    /// lacks the route or the Lua filter, so gRPC requests bypass from then on (fail open).
    static GRPC_HITS_BROKEN: std::cell::Cell<bool> = std::cell::Cell::new(false);
}

const LOCAL_MARKER: &str = "meshcache_local";
/// Filter state `wasm.meshcache_stale`: selects the stale route, whose Lua step gives a gRPC
/// error (trailers-only) a body the filter can fill with the stale message.
const STALE_MARKER: &str = "meshcache_stale";

/// Response headers of a stream's pending gRPC hit reply, if it has one.
pub fn grpc_reply_headers<H: Host>(h: &mut H, id: u32, eos: bool) -> Option<u32> {
    let headers = GRPC_REPLIES.with(|r| r.borrow().get(&id).map(|g| g.headers.clone()))?;
    if eos {
        // No body will follow: the message cannot be delivered. Say so rather than answer OK
        // without a message; gRPC clients retry UNAVAILABLE.
        GRPC_REPLIES.with(|r| r.borrow_mut().remove(&id));
        GRPC_HITS_BROKEN.with(|b| b.set(true));
        h.error("gRPC hit reply without a body: the meshcache_grpc_hit route or the meshcache.grpc_hit_body Lua filter is missing; gRPC requests bypass the cache from now on");
        h.set_headers(
            Map::ResponseHeaders,
            &[(":status", "200"), ("content-type", "application/grpc"), ("grpc-status", "14"),
              ("grpc-message", "meshcache: gRPC hit route missing; retry")],
        );
        return Some(CONTINUE);
    }
    let mut all: Vec<(&str, &str)> = vec![(":status", "200")];
    all.extend(headers.iter().map(|(n, v)| (n.as_str(), v.as_str())));
    h.set_headers(Map::ResponseHeaders, &all);
    Some(CONTINUE)
}

/// Body of a stream's pending gRPC hit reply: the framed message, then the trailer.
pub fn grpc_reply_body<H: Host>(h: &mut H, id: u32, size: usize, eos: bool) -> Option<u32> {
    if !eos {
        return GRPC_REPLIES.with(|r| r.borrow().contains_key(&id)).then(|| CONTINUE);
    }
    let reply = GRPC_REPLIES.with(|r| r.borrow_mut().remove(&id))?;
    if !h.set_body(Buffer::ResponseBody, 0, size, &reply.framed) {
        h.error("gRPC hit: could not write the message");
    }
    // Adding to the (absent) trailers at end of stream makes Envoy create them.
    h.add_header(Map::ResponseTrailers, "grpc-status", "0");
    Some(CONTINUE)
}

/// Runs a callback with the stream taken out of the map, so a host call that re-enters the
/// module for the same stream (a local reply runs on_response_headers) finds nothing to do.
pub fn with<F: FnOnce(&mut Stream) -> u32>(id: u32, f: F) -> u32 {
    let taken = STREAMS.with(|s| s.borrow_mut().remove(&id));
    match taken {
        None => CONTINUE,
        Some(mut stream) => {
            let action = f(&mut stream);
            STREAMS.with(|s| s.borrow_mut().insert(id, stream));
            action
        }
    }
}

enum Phase {
    /// Not ours (or failed open): untouched.
    Pass,
    /// An inference request the cache stays out of; its answer says so (and why, if known).
    Bypass(Bypass),
    Buffering { source: ModelSource, refresh: bool, headers: Headers },
    Miss(Cacheable),
    /// Paused while an identical request is in flight (request coalescing).
    Waiting(Box<Waiting>),
    /// An exact miss paused for its semantic lookup (`on_semantic_answer` resumes it).
    SemanticLookup(Box<SemanticLookup>),
    /// A storable miss whose answer is passing: copied for the store while it streams (or
    /// while held, see `response::should_hold`).
    Collect(Box<Collecting>),
    /// A gRPC error the stale route's Lua step gave a body, not replaced: its status moves
    /// from the headers to trailers at the end of that (empty) body.
    StatusToTrailers(Vec<(String, String)>),
    Done,
}

pub struct Waiting {
    c: Cacheable,
    /// Request headers, for the answer (If-None-Match).
    headers: Vec<(String, String)>,
}

pub struct SemanticLookup {
    c: Cacheable,
    /// Request headers and body, for a semantic hit's answer (If-None-Match, the caller's id).
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

/// A request of a semantic policy after its lookup: its stored answer is indexed; in shadow
/// mode, the would-be hit's answer digest and similarity, compared with the upstream answer's.
pub struct SemanticAfter {
    plan: Plan,
    shadow: Option<(String, f64)>,
}

pub struct Collecting {
    c: Cacheable,
    ttl: meshcache_core::cache_control::Ttl,
    status: u16,
    headers: Vec<(String, String)>,
    /// The answer so far (absolute body offsets), while it may still be stored.
    copy: Vec<u8>,
    /// The answer's hash, fed each chunk as it arrives (None: hashed whole when stored).
    hasher: Option<meshcache_core::hashing::AnswerHasher>,
    /// Response headers not yet sent (paused): they can still say `stored` and the hash.
    held: bool,
    /// Body bytes already passed on before the host's current buffer starts.
    base: usize,
}

/// Where the outcome of a store can still be written.
#[derive(Clone, Copy, PartialEq)]
enum Open {
    /// The response headers are held (or in their callback).
    Headers,
    /// We are in the response trailers callback (headers have left).
    Trailers,
    /// Nothing: headers and body have left, no trailers.
    Closed,
}

pub struct Stream {
    id: u32,
    /// The root context: owns background refreshes, which outlive the stream.
    root: u32,
    plugin: Option<Rc<Config>>,
    phase: Phase,
    /// An expired entry this forwarded request may be answered with if the origin fails
    /// (stale-if-error). Read whole at lookup: one entry per such request in flight.
    fallback: Option<Box<Fallback>>,
    /// The request took the stale route (gRPC): a trailers-only answer arrives with a body.
    stale_route: bool,
    /// Held while this stream leads a coalesced key: released with its outcome.
    lock: Option<Ticket>,
    /// This forwarded request refreshes the key (stale-while-revalidate without a background
    /// request): its lock is released when the stream ends.
    refreshing: Option<meshcache_core::hashing::KeyDigest>,
    /// The semantic layer's part in this request (issue 38): set by a lookup on an exact miss.
    semantic: Option<Box<SemanticAfter>>,
}

struct Fallback {
    entry: meshcache_core::entry::Entry,
    policy: meshcache_core::config::Policy,
    /// Request headers and id, for the answer (If-None-Match, the caller's id).
    headers: Vec<(String, String)>,
    id: meshcache_core::shaping::RequestId,
    grpc: bool,
}

impl Stream {
    fn config(&self) -> Option<Rc<Config>> {
        self.plugin.clone()
    }

    /// The cache stays out of this request: counted, and its answer says `fwd=bypass` and why.
    fn bypass<H: Host>(&mut self, h: &mut H, why: Bypass, request: &[(String, String)]) -> u32 {
        if self.is_client() {
            // The client role only routes: no routing key, the request balances normally.
            self.phase = Phase::Done;
            return CONTINUE;
        }
        self.phase = Phase::Bypass(why);
        h.count(m::BYPASSES, 1);
        h.count(m::bypass_counter(why), 1);
        h.log_debug(&|| logs::bypass_line(why, request));
        CONTINUE
    }

    pub fn on_request_headers<H: Host>(&mut self, h: &mut H, eos: bool) -> u32 {
        let plugin = match self.config() {
            Some(p) => p,
            None => {
                h.error("stream without a configured plugin; passing through");
                return CONTINUE;
            }
        };
        let cfg = &*plugin;
        let mut headers = h.headers(Map::RequestHeaders);
        // Both roles: a routing key the caller sent is dropped before anything reads the headers.
        if route_key::strip(&mut headers) {
            h.remove_header(Map::RequestHeaders, names::ROUTE_KEY_HEADER);
        }
        let method = headermap::header(&headers.pairs, ":method").unwrap_or("");
        let path = headermap::header(&headers.pairs, ":path").unwrap_or("");
        let head = RequestHead { method, path, headers: &headers.pairs, not_utf8: &headers.not_utf8 };
        match request::classify_head(&head) {
            HeadDecision::Ignore => CONTINUE,
            HeadDecision::Bypass(why) => self.bypass(h, why, &headers.pairs),
            HeadDecision::Buffer { source, refresh } => {
                if eos {
                    return self.decide_request(h, cfg, &headers, &source, refresh, &[]);
                }
                if cfg.role == Role::Client && !cfg.hold_headers {
                    // Routing happens when the headers continue: no body, no key.
                    return CONTINUE;
                }
                if cfg.role == Role::Server && source == ModelSource::GrpcBody && GRPC_HITS_BROKEN.with(|b| b.get()) {
                    return self.bypass(h, Bypass::NoHitRoute, &headers.pairs);
                }
                if request::request_declared_too_big(headermap::header(&headers.pairs, "content-length")) {
                    return self.bypass(h, Bypass::TooBig, &headers.pairs);
                }
                self.phase = Phase::Buffering { source, refresh, headers };
                // Held headers: routing waits for the decision. Otherwise the body alone waits.
                if cfg.hold_headers {
                    PAUSE
                } else {
                    CONTINUE
                }
            }
        }
    }

    pub fn on_request_body<H: Host>(&mut self, h: &mut H, size: usize, eos: bool) -> u32 {
        let request = match &self.phase {
            Phase::Buffering { headers, .. } if size > request::MAX_REQUEST_BYTES => headers.pairs.clone(),
            Phase::Buffering { .. } => Vec::new(),
            _ => return CONTINUE,
        };
        if size > request::MAX_REQUEST_BYTES {
            return self.bypass(h, Bypass::TooBig, &request);
        }
        if !eos {
            return PAUSE;
        }
        let body = match h.body(Buffer::RequestBody, 0, size) {
            Some(b) => b,
            None if size == 0 => Vec::new(),
            None => {
                self.phase = Phase::Pass;
                h.error("request body unreadable; passing through");
                return CONTINUE;
            }
        };
        let plugin = match self.config() {
            Some(p) => p,
            None => return CONTINUE,
        };
        let phase = std::mem::replace(&mut self.phase, Phase::Pass);
        match phase {
            Phase::Buffering { source, refresh, headers } => self.decide_request(h, &plugin, &headers, &source, refresh, &body),
            _ => CONTINUE,
        }
    }

    fn decide_request<H: Host>(&mut self, h: &mut H,
        cfg: &Config,
        request: &Headers,
        source: &ModelSource,
        refresh: bool,
        body: &[u8],
    ) -> u32 {
        let headers = &request.pairs;
        let method = headermap::header(headers, ":method").unwrap_or("");
        let path = headermap::header(headers, ":path").unwrap_or("");
        let head = RequestHead { method, path, headers, not_utf8: &request.not_utf8 };
        if cfg.role == Role::Client {
            return self.route(h, cfg, &head, source, refresh, body);
        }
        let principal = || h.peer_identity();
        let mut c = match request::key_request(cfg, &head, source, refresh, body, principal) {
            BodyDecision::Bypass(why) => return self.bypass(h, why, headers),
            BodyDecision::Cacheable(c) => c,
        };
        let now = h.now_ms();
        c.request_ms = now;
        if c.refresh {
            return self.miss(h, c);
        }
        let cache = Cache { data: &h.shared(), limits: &cfg.limits };
        let mut out = Outcome::default();
        let found = cache.lookup_keeping(&c.key, now, Lifetime::of(&c.policy), &mut out);
        h.record_outcome(&out);
        let entry = match found {
            Lookup::Hit(e) => e,
            Lookup::Miss(seen) => {
                c.seen = seen;
                // ---- semantic layer (issue 38): look the prompt up by meaning first.
                if self.semantic_lookup(h, cfg, &c, path, body) {
                    self.phase = Phase::SemanticLookup(Box::new(SemanticLookup { c, headers: headers.to_vec(), body: body.to_vec() }));
                    return PAUSE;
                }
                if self.joins_in_flight(h, &c, now) {
                    return self.wait(h, c, headers);
                }
                return self.miss(h, c);
            }
            Lookup::Stale(e, seen) => {
                // A fresh answer replaces the entry where it is.
                c.seen = Some(seen);
                let u = stale::stale_use(&e, &c.policy, now);
                if let Some(u) = u.filter(|u| u.while_revalidate) {
                    match revalidate::claim(&h.shared(), &c.key, now) {
                        Claim::Busy => return self.answer_stale_while_revalidate(h, &c, &e, headers, body, u, now),
                        Claim::Background => {
                            if h.refresh(self.root, self.id, &c, headers, body, &cfg.limits, now) {
                                h.count(m::REFRESHES, 1);
                                return self.answer_stale_while_revalidate(h, &c, &e, headers, body, u, now);
                            }
                            // No background request here: this request refreshes the entry.
                            h.count(m::REFRESH_FAILURES, 1);
                            self.refreshing = Some(c.key);
                        }
                        Claim::Forward => self.refreshing = Some(c.key),
                    }
                }
                // An expired hot entry is a stampede too: its refresh is coalesced like a miss
                // (unless this request is the stale-while-revalidate refresh).
                if self.refreshing.is_none() && self.joins_in_flight(h, &c, now) {
                    return self.wait(h, c, headers);
                }
                return self.forward_expired(h, cfg, c, e, headers, now);
            }
        };
        self.answer_hit(h, &c, &HitRequest { headers, body, id: &c.request_id }, &entry, now, None)
    }

    // ------------------------------------------------------------ semantic layer (issue 38)
    //
    // Three calls into the flow: `semantic_lookup` on an exact miss, `on_semantic_answer` when
    // the service answered, `semantic_stored` after an answer is stored. The decisions are
    // `meshcache_core::semantic`'s; these only send, pause and resume.

    /// Sends the lookup of an exact miss of a semantic policy: true when the request now waits
    /// for its answer. A lookup that cannot be sent counts an error and the request goes on.
    fn semantic_lookup<H: Host>(&mut self, h: &mut H, cfg: &Config, c: &Cacheable, path: &str, body: &[u8]) -> bool {
        let service = match cfg.semantic_service.as_ref() {
            Some(s) if c.policy.semantic.is_some() => s,
            _ => return false,
        };
        let principal = if c.policy.scope == meshcache_core::config::Scope::Principal { h.peer_identity() } else { None };
        let instance = h.semantic_instance();
        let plan = match semantic::plan(Some(service), &c.policy, path, body, principal.as_deref(), &instance) {
            Some(p) => p,
            None => return false,
        };
        h.count(m::SEMANTIC_LOOKUPS, 1);
        let sent = h.semantic_call(self.root, self.id, service, semantic::LOOKUP_PATH, &semantic::lookup_body(&plan), true);
        // Whatever the lookup says, the answer this request stores is indexed.
        self.semantic = Some(Box::new(SemanticAfter { plan, shadow: None }));
        if !sent {
            h.count(m::SEMANTIC_ERRORS, 1);
        }
        sent
    }

    /// The service answered the paused request's lookup (Err: it failed; fail open): a hit
    /// this sidecar holds fresh is answered with it; anything else goes on as an exact miss.
    pub fn on_semantic_answer<H: Host>(&mut self, h: &mut H, verdict: Result<Verdict, &str>) -> u32 {
        let SemanticLookup { c, headers, body } = match std::mem::replace(&mut self.phase, Phase::Done) {
            Phase::SemanticLookup(w) => *w,
            other => {
                self.phase = other;
                return CONTINUE;
            }
        };
        let now = h.now_ms();
        match verdict {
            Err(why) => {
                h.count(m::SEMANTIC_ERRORS, 1);
                h.log_debug(&|| format!("semantic lookup failed ({}); going upstream", why));
            }
            Ok(Verdict::Upstream) => {}
            Ok(Verdict::Shadow { response_hash, similarity }) => {
                h.count(m::SEMANTIC_WOULD_HIT, 1);
                if let Some(s) = self.semantic.as_mut() {
                    s.shadow = Some((response_hash, similarity));
                }
            }
            Ok(Verdict::Serve { key, similarity }) => {
                if let Some(cfg) = self.config() {
                    let mut out = Outcome::default();
                    let found = semantic::served(&Cache { data: &h.shared(), limits: &cfg.limits }, &c, &key, now, &mut out);
                    h.record_outcome(&out);
                    match found {
                        Some(entry) => {
                            let request = HitRequest { headers: &headers, body: &body, id: &c.request_id };
                            if self.answer_semantic_hit(h, &c, &request, &entry, now, similarity) {
                                return PAUSE;
                            }
                        }
                        // The entry is gone (evicted, expired, this sidecar restarted): upstream.
                        None => h.count(m::SEMANTIC_WOULD_HIT, 1),
                    }
                }
            }
        }
        if self.joins_in_flight(h, &c, now) {
            self.wait(h, c, &headers);
            return PAUSE;
        }
        self.miss(h, c);
        continue_now(h)
    }

    /// Answers from a similar prompt's entry: `Cache-Status: meshcache; hit; detail=semantic`
    /// and the similarity. False: the local reply failed.
    fn answer_semantic_hit<H: Host>(&mut self, h: &mut H, c: &Cacheable, request: &HitRequest, entry: &meshcache_core::entry::Entry,
                                    now: u64, similarity: f64) -> bool {
        let reply = semantic::hit_answer(entry, request, now, similarity);
        let hdrs: Vec<(&str, &str)> = reply.headers.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
        if !h.send_local_response(reply.status as u32, "meshcache_semantic_hit", &reply.body, &hdrs, -1) {
            h.error("local reply failed; passing through");
            return false;
        }
        self.phase = Phase::Done;
        self.semantic = None;
        h.count(m::HITS, 1);
        h.count(m::SEMANTIC_HITS, 1);
        h.count_policy(&c.policy.model_prefix, "hits", 1);
        count_tokens_saved(h, &c.policy.model_prefix, entry);
        true
    }

    /// An answer of a semantic policy was stored: index it (fire and forget) and, in shadow
    /// mode, report whether it equals the would-be hit's.
    fn semantic_stored<H: Host>(&mut self, h: &mut H, entry: &meshcache_core::entry::Entry) {
        let after = match self.semantic.take() {
            Some(a) => a,
            None => return,
        };
        let service = match self.config().and_then(|c| c.semantic_service.clone()) {
            Some(s) => s,
            None => return,
        };
        for (path, body) in semantic::after_store(&after.plan, after.shadow.as_ref(), entry) {
            if !h.semantic_call(self.root, self.id, &service, path, &body, false) {
                h.count(m::SEMANTIC_ERRORS, 1);
            }
        }
    }

    /// Answers from a stored entry (PAUSE), or CONTINUE when the local reply failed.
    /// `cache_status`: other than the hit's (a request that waited for an identical one).
    fn answer_hit<H: Host>(&mut self, h: &mut H, c: &Cacheable, request: &HitRequest, entry: &meshcache_core::entry::Entry, now: u64,
                  cache_status: Option<String>) -> u32 {
        h.count(m::HITS, 1);
        h.count_policy(&c.policy.model_prefix, "hits", 1);
        count_tokens_saved(h, &c.policy.model_prefix, entry);
        self.answer_entry(h, c, request, entry, now, cache_status)
    }

    /// Answers the request from `entry` (a hit, or a stale answer whose `Cache-Status` says so,
    /// as `cache_status` replaces the hit's): PAUSE, or CONTINUE when the local reply failed.
    fn answer_entry<H: Host>(&mut self, h: &mut H,
        c: &Cacheable,
        request: &HitRequest,
        entry: &meshcache_core::entry::Entry,
        now: u64,
        cache_status: Option<String>,
    ) -> u32 {
        self.phase = Phase::Done;
        if c.grpc {
            return self.answer_grpc_hit(h, entry, request, now, cache_status);
        }
        let mut reply = hit::http_hit(entry, request, now);
        if let Some(status) = cache_status {
            hit::set_cache_status(&mut reply, status);
        }
        let hdrs: Vec<(&str, &str)> = reply.headers.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
        if !h.send_local_response(reply.status as u32, "meshcache_hit", &reply.body, &hdrs, -1) {
            h.error("local reply failed; passing through");
            return CONTINUE;
        }
        PAUSE
    }

    /// Stale-while-revalidate: the expired entry answers at once; its refresh is under way.
    fn answer_stale_while_revalidate<H: Host>(&mut self, h: &mut H,
        c: &Cacheable,
        entry: &meshcache_core::entry::Entry,
        headers: &[(String, String)],
        body: &[u8],
        u: stale::StaleUse,
        now: u64,
    ) -> u32 {
        h.count(m::STALE_WHILE_REVALIDATE, 1);
        let request = HitRequest { headers, body, id: &c.request_id };
        self.answer_entry(h, c, &request, entry, now, Some(names::cache_status_stale_while_revalidate(u.past_s())))
    }

    /// A request whose entry expired is forwarded (a fresh answer replaces the entry where it
    /// is); if stale-if-error may use the entry, it stands by for an origin failure.
    fn forward_expired<H: Host>(&mut self, h: &mut H, cfg: &Config, c: Cacheable, e: meshcache_core::entry::Entry,
                       headers: &[(String, String)], now: u64) -> u32 {
        let if_error = stale::stale_use(&e, &c.policy, now).map_or(false, |u| u.if_error);
        if if_error && (!c.grpc || self.take_stale_route(h, cfg.hold_headers)) {
            let (id, grpc, policy) = (c.request_id.clone(), c.grpc, c.policy.clone());
            self.fallback = Some(Box::new(Fallback { entry: e, policy, headers: headers.to_vec(), id, grpc }));
        }
        self.miss(h, c)
    }

    /// Client role: the routing key goes on the held request headers (Envoy then clears the
    /// route cache, so the router hashes on it); nothing is looked up or stored.
    fn route<H: Host>(&mut self, h: &mut H, cfg: &Config, head: &RequestHead, source: &ModelSource, refresh: bool, body: &[u8]) -> u32 {
        self.phase = Phase::Done;
        if let Some(key) = route_key::route_key(cfg, head, source, refresh, body) {
            h.set_header(Map::RequestHeaders, names::ROUTE_KEY_HEADER, &key);
            h.count(m::ROUTED, 1);
        }
        CONTINUE
    }

    fn is_client(&self) -> bool {
        self.plugin.as_deref().map_or(false, |c| c.role == Role::Client)
    }

    /// Marks the request (filter state, so the local reply selects the hit route whose Lua step
    /// gives it a body), then sends the empty local reply; `grpc_reply_*` fill it. The entry was
    /// read whole at lookup, so eviction meanwhile cannot fail the answer.
    fn answer_grpc_hit<H: Host>(&mut self, h: &mut H, entry: &meshcache_core::entry::Entry, request: &HitRequest, now: u64, cache_status: Option<String>) -> u32 {
        let mut reply = hit::grpc_hit(entry, request, now);
        if let Some(status) = cache_status {
            hit::set_cache_status(&mut reply, status);
        }
        if !h.set_property(LOCAL_MARKER, b"1") || !h.clear_route_cache() {
            h.error("gRPC hit: could not mark the request; forwarding it");
            h.set_property(LOCAL_MARKER, b"0");
            return CONTINUE;
        }
        let framed = grpc::frame(&reply.body);
        GRPC_REPLIES.with(|r| r.borrow_mut().insert(self.id, GrpcReply { headers: reply.headers, framed }));
        if !h.send_local_response(200, "meshcache_hit", b"", &[], 0) {
            GRPC_REPLIES.with(|r| r.borrow_mut().remove(&self.id));
            h.set_property(LOCAL_MARKER, b"0");
            h.clear_route_cache();
            h.error("gRPC hit: local reply failed; forwarding the request");
            return CONTINUE;
        }
        PAUSE
    }

    /// Marks a gRPC request for the stale route (see `STALE_MARKER`). With held headers the
    /// route forwards too: to the cluster the original route chose. False: not marked (the
    /// request goes as it is and a gRPC error reaches the client).
    fn take_stale_route<H: Host>(&mut self, h: &mut H, hold_headers: bool) -> bool {
        if hold_headers {
            match h.upstream_cluster() {
                Some(c) => h.set_header(Map::RequestHeaders, names::UPSTREAM_CLUSTER_HEADER, &c),
                None => {
                    h.error("stale-if-error: the request's upstream cluster is unknown; gRPC errors pass");
                    return false;
                }
            }
        }
        if !h.set_property(STALE_MARKER, b"1") || !h.clear_route_cache() {
            h.set_property(STALE_MARKER, b"0");
            h.error("stale-if-error: could not mark the gRPC request; gRPC errors pass");
            return false;
        }
        self.stale_route = true;
        true
    }

    /// A request about to go upstream under a policy with `coalesce_timeout_ms`: true when an
    /// identical one is in flight and this one is registered to wait for it; false: it goes
    /// upstream (holding the key's lock when it was free). Requests that skip the lookup
    /// (`no-cache`) neither lead nor wait.
    fn joins_in_flight<H: Host>(&mut self, h: &mut H, c: &Cacheable, now: u64) -> bool {
        let timeout = c.policy.coalesce_timeout_ms;
        timeout > 0 && !c.refresh && self.lead_or_wait(h, c, now, now.saturating_add(timeout))
    }

    fn wait<H: Host>(&mut self, h: &mut H, c: Cacheable, headers: &[(String, String)]) -> u32 {
        h.count(m::COALESCE_WAITS, 1);
        self.phase = Phase::Waiting(Box::new(Waiting { c, headers: headers.to_vec() }));
        PAUSE
    }

    /// True: wait (registered until `deadline`). False: go upstream, as the key's leader when
    /// the lock was free.
    fn lead_or_wait<H: Host>(&mut self, h: &mut H, c: &Cacheable, now: u64, deadline: u64) -> bool {
        let queue = match WAKE_QUEUE.with(|w| w.get()) {
            Some(q) => q,
            None => return false,
        };
        let owner = ((queue as u64) << 32) | self.id as u64;
        match (LockTable { data: &h.shared() }).join(&c.key, owner, queue, now, c.policy.coalesce_timeout_ms) {
            Join::Lead(ticket) => {
                self.lock = Some(ticket);
                false
            }
            Join::Wait => match WAITERS.with(|w| w.borrow_mut().add(&c.key, self.id, deadline)) {
                Ok(()) => true,
                Err(_) => {
                    h.count(m::COALESCE_OVERFLOW, 1);
                    false
                }
            },
            Join::Full => {
                h.count(m::COALESCE_OVERFLOW, 1);
                false
            }
            Join::Busy | Join::Unavailable => false,
        }
    }

    /// The leader of this key is done: free the lock and wake every worker that waits on it.
    fn release<H: Host>(&mut self, h: &mut H, release: Release) {
        if let Some(ticket) = self.lock.take() {
            let message = coalesce::encode_wake(&ticket.key, release);
            for queue in (LockTable { data: &h.shared() }).release(&ticket) {
                if !h.enqueue(queue, &message) {
                    h.error("could not wake coalesced requests (their timeout will)");
                }
            }
        }
    }

    /// Woken (from the queue callback) because the key's leader finished: answer from its entry,
    /// or (no entry) go upstream; after a failure that may pass, lead or wait again within the
    /// deadline.
    pub fn on_wake<H: Host>(&mut self, h: &mut H, release: Release, deadline: u64) -> u32 {
        self.resume_waiter(h, Some(release), deadline)
    }

    /// The waiter's `coalesce_timeout_ms` passed: it goes upstream itself (unless the entry
    /// arrived meanwhile).
    pub fn on_coalesce_timeout<H: Host>(&mut self, h: &mut H) -> u32 {
        if let Phase::Waiting(_) = self.phase {
            h.count(m::COALESCE_TIMEOUTS, 1);
        }
        self.resume_waiter(h, None, 0)
    }

    /// A waiter leaves the wait: `release` is its leader's outcome (None: timed out).
    fn resume_waiter<H: Host>(&mut self, h: &mut H, release: Option<Release>, deadline: u64) -> u32 {
        let Waiting { mut c, headers } = match std::mem::replace(&mut self.phase, Phase::Done) {
            Phase::Waiting(w) => *w,
            other => {
                self.phase = other;
                return CONTINUE;
            }
        };
        let cfg = match self.config() {
            Some(cfg) => cfg,
            None => {
                self.miss(h, c);
                return continue_now(h);
            }
        };
        let now = h.now_ms();
        let mut out = Outcome::default();
        let cache = Cache { data: &h.shared(), limits: &cfg.limits };
        let woken = coalesce::wake(&cache, &mut c, release, now, deadline, &mut out, &mut |name| h.count(name, 1));
        h.record_outcome(&out);
        let (again, expired) = match woken {
            Woken::Answer { entry, cache_status } => {
                let request = HitRequest { headers: &headers, body: &[], id: &c.request_id };
                return self.answer_waiter(h, &c, &request, &entry, now, cache_status);
            }
            Woken::Upstream { again, expired } => (again, expired),
        };
        if again && self.lead_or_wait(h, &c, now, deadline) {
            self.phase = Phase::Waiting(Box::new(Waiting { c, headers }));
            return PAUSE;
        }
        match expired {
            Some(entry) => self.forward_expired(h, &cfg, c, entry, &headers, now),
            None => self.miss(h, c),
        };
        continue_now(h)
    }

    /// Answers a waiter from an entry, `Cache-Status` set to `status`; a failed local reply
    /// sends it upstream uncached.
    fn answer_waiter<H: Host>(&mut self, h: &mut H, c: &Cacheable, request: &HitRequest, entry: &meshcache_core::entry::Entry, now: u64,
                     status: String) -> u32 {
        if self.answer_hit(h, c, request, entry, now, Some(status)) == CONTINUE {
            self.phase = Phase::Pass;
            return continue_now(h);
        }
        PAUSE
    }

    /// The request goes to the origin; its answer may be stored.
    fn miss<H: Host>(&mut self, h: &mut H, c: Cacheable) -> u32 {
        h.count(m::MISSES, 1);
        h.count_policy(&c.policy.model_prefix, "misses", 1);
        self.phase = Phase::Miss(c);
        CONTINUE
    }

    pub fn on_response_headers<H: Host>(&mut self, h: &mut H, eos: bool) -> u32 {
        if let Some(f) = self.fallback.take() {
            if let Some(action) = self.stale_if_error(h, *f, eos) {
                // Its waiters may answer from the same expired entry.
                self.release(h, Release::OriginError);
                self.phase = Phase::Done;
                return action;
            }
        }
        if self.stale_route && !eos {
            if let Some(status) = h.header(Map::ResponseHeaders, "grpc-status") {
                // A gRPC error the Lua step gave a body and we do not replace: headers, then the
                // status as trailers (a valid gRPC answer, like the trailers-only one was).
                let mut moved = vec![("grpc-status".to_string(), status)];
                if let Some(m) = h.header(Map::ResponseHeaders, "grpc-message") {
                    moved.push(("grpc-message".to_string(), m));
                }
                h.remove_header(Map::ResponseHeaders, "grpc-status");
                h.remove_header(Map::ResponseHeaders, "grpc-message");
                let refresh = matches!(&self.phase, Phase::Miss(c) if c.refresh);
                h.set_header(Map::ResponseHeaders, names::CACHE_STATUS, &names::cache_status_not_stored(refresh, NotStored::GrpcStatus));
                self.phase = Phase::StatusToTrailers(moved);
                return CONTINUE;
            }
        }
        let phase = std::mem::replace(&mut self.phase, Phase::Done);
        match phase {
            Phase::Bypass(why) => {
                h.set_header(Map::ResponseHeaders, names::CACHE_STATUS, &names::cache_status_bypass(why.detail()));
                CONTINUE
            }
            Phase::Miss(c) => self.start_collect(h, c, eos),
            other => {
                self.phase = other;
                CONTINUE
            }
        }
    }

    /// The origin (or Envoy for it: unreachable, timed out) answered with an error and an
    /// expired entry may stand in for it: answer with the entry instead. None: the answer
    /// passes as it is.
    fn stale_if_error<H: Host>(&mut self, h: &mut H, f: Fallback, eos: bool) -> Option<u32> {
        let response = h.headers(Map::ResponseHeaders);
        let status: u16 = headermap::header(&response.pairs, ":status").and_then(|s| s.parse().ok()).unwrap_or(0);
        if !stale::is_origin_error(status, headermap::header(&response.pairs, "grpc-status")) {
            return None;
        }
        let now = h.now_ms();
        let u = stale::stale_use(&f.entry, &f.policy, now).filter(|u| u.if_error)?;
        let request = HitRequest { headers: &f.headers, body: b"", id: &f.id };
        if f.grpc {
            if eos {
                // No body to fill: the stale route (or its Lua step) is missing here.
                h.error("stale-if-error: a gRPC error arrived without the stale route's body; passing it through");
                return None;
            }
            let mut reply = hit::grpc_hit(&f.entry, &request, now);
            hit::set_cache_status(&mut reply, names::cache_status_stale_if_error(u.past_s(), None));
            let mut all: Vec<(&str, &str)> = vec![(":status", "200")];
            all.extend(reply.headers.iter().map(|(n, v)| (n.as_str(), v.as_str())));
            if !h.set_headers(Map::ResponseHeaders, &all) {
                h.error("stale-if-error: could not write the gRPC headers; passing the error through");
                return None;
            }
            // The (empty) body and the trailer are written as for a hit (`grpc_reply_body`).
            let framed = grpc::frame(&reply.body);
            GRPC_REPLIES.with(|r| r.borrow_mut().insert(self.id, GrpcReply { headers: Vec::new(), framed }));
            h.count(m::STALE_IF_ERROR, 1);
            return Some(CONTINUE);
        }
        let mut reply = hit::http_hit(&f.entry, &request, now);
        hit::set_cache_status(&mut reply, names::cache_status_stale_if_error(u.past_s(), Some(status)));
        let hdrs: Vec<(&str, &str)> = reply.headers.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
        // In the response phase Envoy sends a local reply straight to the client (the error
        // answer is dropped).
        if !h.send_local_response(reply.status as u32, "meshcache_stale_if_error", &reply.body, &hdrs, -1) {
            h.error("stale-if-error: local reply failed; passing the error through");
            return None;
        }
        h.count(m::STALE_IF_ERROR, 1);
        Some(PAUSE)
    }

    fn limits(&self) -> Limits {
        match self.config().as_deref() {
            Some(cfg) => cfg.limits.clone(),
            _ => meshcache_core::config::Config::empty().limits,
        }
    }

    /// Whether response headers wait for our decision (see `Config::hold_headers`).
    fn holds_headers(&self) -> bool {
        match self.config().as_deref() {
            Some(cfg) => cfg.hold_headers,
            _ => true,
        }
    }

    /// `headers_open`: the response headers can still be changed (we are in their callback, or
    /// they are held until the body is complete).
    fn not_stored<H: Host>(&mut self, h: &mut H, refresh: bool, why: NotStored, headers_open: bool) -> u32 {
        self.release(h, Release::not_stored(why));
        h.count(m::not_stored_counter(why), 1);
        if headers_open {
            h.set_header(Map::ResponseHeaders, names::CACHE_STATUS, &names::cache_status_not_stored(refresh, why));
        }
        self.phase = Phase::Done;
        CONTINUE
    }

    fn start_collect<H: Host>(&mut self, h: &mut H, c: Cacheable, eos: bool) -> u32 {
        let response = h.headers(Map::ResponseHeaders);
        let max_entry_bytes = self.limits().max_entry_bytes;
        let (status, plan) = response::begin_collect(&c, &response, eos, h.now_ms(), max_entry_bytes, self.holds_headers());
        let headers = response.pairs;
        match plan {
            Collect::Skip { why, release } => {
                self.release(h, release);
                self.not_stored(h, c.refresh, why, true)
            }
            Collect::StoreNow(ttl) => self.finish_store(h, c, ttl, status, headers, Vec::new(), None, Open::Headers),
            Collect::Start { ttl, held, hasher, declared, .. } => {
                if !held {
                    // The answer streams: say what is known now; it is copied and stored at its end.
                    h.set_header(Map::ResponseHeaders, names::CACHE_STATUS, names::cache_status_forwarded(c.refresh));
                }
                // Room for the whole declared answer up front: chunks land in it without regrowing.
                let copy = Vec::with_capacity(declared);
                self.phase = Phase::Collect(Box::new(Collecting { c, ttl, status, headers, copy, hasher, held, base: 0 }));
                if held {
                    PAUSE
                } else {
                    CONTINUE
                }
            }
        }
    }

    /// The answer's body passes; a copy is kept for the store up to `max_entry_bytes`.
    pub fn on_response_body<H: Host>(&mut self, h: &mut H, size: usize, eos: bool) -> u32 {
        if let Phase::StatusToTrailers(moved) = &self.phase {
            if eos {
                for (n, v) in moved {
                    h.add_header(Map::ResponseTrailers, n, v);
                }
                self.phase = Phase::Done;
            }
            return CONTINUE;
        }
        let limit = self.limits().max_entry_bytes as usize;
        let mut k = match std::mem::replace(&mut self.phase, Phase::Done) {
            Phase::Collect(k) => k,
            other => {
                self.phase = other;
                return CONTINUE;
            }
        };
        let limit = limit + if k.c.grpc { 5 } else { 0 };
        // The host's buffer holds body bytes [base, base + size): everything since the last
        // time we let data pass. Copy the part not copied yet.
        let have = k.copy.len().saturating_sub(k.base);
        if size > have {
            let more = size - have;
            if k.copy.len() + more > limit {
                return self.not_stored(h, k.c.refresh, NotStored::TooBig, k.held);
            }
            let from = k.copy.len();
            match h.body_into(Buffer::ResponseBody, have, more, &mut k.copy) {
                Some(n) if n == more => {
                    if let Some(h) = k.hasher.as_mut() {
                        h.update(&k.copy[from..]);
                    }
                }
                _ => {
                    h.error("response body unreadable; not storing");
                    return self.not_stored(h, k.c.refresh, NotStored::Error, k.held);
                }
            }
        }
        if eos {
            if k.c.grpc {
                // A gRPC answer without trailers has no grpc-status: not a success we can store.
                return self.not_stored(h, k.c.refresh, NotStored::GrpcStatus, k.held);
            }
            let open = if k.held { Open::Headers } else { Open::Closed };
            let Collecting { c, ttl, status, headers, copy, hasher, .. } = *k;
            return self.finish_store(h, c, ttl, status, headers, copy, hasher, open);
        }
        if k.held && k.copy.len() <= response::HOLD_BYTES {
            self.phase = Phase::Collect(k);
            return PAUSE;
        }
        if k.held {
            // Grown past what a miss holds back: let it stream from here.
            h.set_header(Map::ResponseHeaders, names::CACHE_STATUS, names::cache_status_forwarded(k.c.refresh));
            k.held = false;
        }
        k.base += size;
        self.phase = Phase::Collect(k);
        CONTINUE
    }

    pub fn on_response_trailers<H: Host>(&mut self, h: &mut H) -> u32 {
        match std::mem::replace(&mut self.phase, Phase::Done) {
            Phase::Collect(k) => {
                let open = if k.held { Open::Headers } else { Open::Trailers };
                if k.c.grpc && h.header(Map::ResponseTrailers, "grpc-status").as_deref() != Some("0") {
                    return self.not_stored(h, k.c.refresh, NotStored::GrpcStatus, k.held);
                }
                let Collecting { c, ttl, status, headers, copy, hasher, .. } = *k;
                self.finish_store(h, c, ttl, status, headers, copy, hasher, open)
            }
            other => {
                self.phase = other;
                CONTINUE
            }
        }
    }

    fn finish_store<H: Host>(&mut self, h: &mut H,
        c: Cacheable,
        ttl: meshcache_core::cache_control::Ttl,
        status: u16,
        headers: Vec<(String, String)>,
        body: Vec<u8>,
        hashed: Option<meshcache_core::hashing::AnswerHasher>,
        open: Open,
    ) -> u32 {
        let headers_open = open == Open::Headers;
        let limits = self.limits();
        let refresh = c.refresh;
        let cache = Cache { data: &h.shared(), limits: &limits };
        let mut out = Outcome::default();
        let result = insert::store_streamed(&cache, &c, &headers, status, body, ttl, hashed, &mut out);
        h.record_outcome(&out);
        match result {
            Ok(stored) => {
                h.count(m::STORES, 1);
                self.semantic_stored(h, &stored.entry);
                self.release(h, Release::Stored);
                self.phase = Phase::Done;
                match open {
                    Open::Closed => {}
                    // The headers have left: the hash goes in the trailers (gRPC's, or any an
                    // HTTP/2 answer has).
                    Open::Trailers => {
                        h.add_header(Map::ResponseTrailers, names::HASH_HEADER, &stored.entry.response_hash);
                    }
                    Open::Headers => {
                        // The response headers are paused and unchanged since we read them:
                        // write them back with ours added in a single host call.
                        let ours: [(&str, &str); 3] = [
                            (names::HASH_HEADER, &stored.entry.response_hash),
                            (names::CACHE_STATUS, names::cache_status_stored(refresh)),
                            ("etag", stored.added_etag.as_deref().unwrap_or("")),
                        ];
                        let mut all: Vec<(&str, &str)> = headers
                            .iter()
                            .filter(|(n, _)| !ours.iter().any(|(o, v)| !v.is_empty() && n.eq_ignore_ascii_case(o)))
                            .map(|(n, v)| (n.as_str(), v.as_str()))
                            .collect();
                        all.extend(ours.iter().filter(|(_, v)| !v.is_empty()));
                        h.set_headers(Map::ResponseHeaders, &all);
                    }
                }
                CONTINUE
            }
            Err(why) => self.not_stored(h, refresh, why, headers_open),
        }
    }
}

#[cfg(test)]
#[path = "stream_tests.rs"]
mod tests;
