//! One HTTP stream through the cache, for both hosts: decide the request (bypass, route, hit,
//! wait for an identical one in flight, or miss), answer hits and stale entries, then collect
//! the answer of a miss and store it or say why not. An exact miss of a semantic policy is
//! looked up by meaning first (a callout to the index service; docs/llm.md). The proxy is reached only through `Host`
//! (host.rs); each host crate keeps its streams, calls these callbacks and maps `Action` to its
//! ABI's status codes. Every path fails open: on any surprise the request continues and
//! `errors` counts it.

use crate::cache_control::{NotStored, Ttl};
use crate::coalesce::{self, Join, LockTable, Release, Ticket, Woken};
use crate::config::{Config, Policy, Role, Scope};
use crate::entry::Entry;
use crate::hashing::{AnswerHasher, KeyDigest};
use crate::headermap::{self, Headers};
use crate::hit::{self, HitRequest};
use crate::host::{Action, CalloutAnswer, GrpcAt, Host, Map, Side, StaleRoute};
use crate::insert;
use crate::logs;
use crate::metric_names as m;
use crate::model::ModelSource;
use crate::names::{self, Bypass};
use crate::request::{self, BodyDecision, Cacheable, HeadDecision, RequestHead};
use crate::response::{self, Collect};
use crate::revalidate::{self, Claim};
use crate::route_key;
use crate::semantic::{self, Plan, Verdict};
use crate::shaping::RequestId;
use crate::stale;
use crate::store::{Cache, Lifetime, Lookup, Outcome};
use std::sync::Arc;

use Action::{Continue, Pause, Stop};

enum Phase {
    /// Not ours (or failed open): untouched.
    Pass,
    /// An inference request the cache stays out of; its answer says so (and why).
    Bypass(Bypass),
    Buffering { source: ModelSource, refresh: bool, headers: Headers },
    Miss(Box<Cacheable>),
    /// Paused while an identical request is in flight (request coalescing).
    Waiting(Box<Waiting>),
    /// An exact miss paused for its semantic lookup (`Host::callout`; `on_callout` resumes it).
    Callout(Box<Callout>),
    /// A storable miss whose answer is passing: copied for the store while it streams (or
    /// while held, see `response::should_hold`).
    Collect(Box<Collecting>),
    /// A gRPC error the stale route gave a body, not replaced: its status moves from the
    /// headers to trailers at the end of that (empty) body.
    StatusToTrailers(Vec<(String, String)>),
    Done,
}

struct Waiting {
    c: Cacheable,
    /// Request headers, for the answer (If-None-Match).
    headers: Vec<(String, String)>,
    /// When it stops waiting (`coalesce_timeout_ms` after it first parked).
    deadline: u64,
}

struct Callout {
    c: Cacheable,
    /// Request headers and body, for a semantic hit's answer (If-None-Match, the caller's id).
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

/// A request of a semantic policy after its lookup: its stored answer is indexed; in shadow
/// mode, the would-be hit's answer digest and similarity, compared with the upstream answer's.
struct SemanticAfter {
    plan: Plan,
    shadow: Option<(String, f64)>,
}

struct Collecting {
    c: Cacheable,
    ttl: Ttl,
    status: u16,
    headers: Vec<(String, String)>,
    /// The answer so far (absolute body offsets), while it may still be stored.
    copy: Vec<u8>,
    /// What the answer may grow to and still be stored.
    limit: usize,
    /// The answer's hash, fed each chunk as it arrives (None: hashed whole when stored).
    hasher: Option<AnswerHasher>,
    /// Response headers not yet sent (paused): they can still say `stored` and the hash.
    held: bool,
    /// Body bytes already passed on before the host's current buffer starts.
    base: usize,
}

/// Where the outcome of a store can still be written.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Open {
    /// The response headers are held (or in their callback).
    Headers,
    /// In the response trailers callback (headers have left).
    Trailers,
    /// Nothing: headers and body have left, no trailers.
    Closed,
}

/// An expired entry a forwarded request may be answered with if the origin fails
/// (stale-if-error), read whole at lookup.
struct Fallback {
    entry: Entry,
    policy: Policy,
    /// Request headers and id, for the answer (If-None-Match, the caller's id).
    headers: Vec<(String, String)>,
    id: RequestId,
    grpc: bool,
}

pub struct Flow {
    config: Arc<Config>,
    phase: Phase,
    fallback: Option<Box<Fallback>>,
    /// The request took the stale route (`StaleRoute::Taken`).
    stale_route: bool,
    /// Held while this stream leads a coalesced key: released with its outcome.
    lock: Option<Ticket>,
    /// This forwarded request refreshes the key (stale-while-revalidate without a background
    /// request): its refresh lock is released when the stream ends.
    refreshing: Option<KeyDigest>,
    /// The semantic layer's part in this request: set by a lookup on an exact miss.
    semantic: Option<Box<SemanticAfter>>,
}

impl Flow {
    pub fn new(config: Arc<Config>) -> Flow {
        Flow { config, phase: Phase::Pass, fallback: None, stale_route: false, lock: None, refreshing: None, semantic: None }
    }

    /// The stream ends (done, reset, client gone): it leaves any wait, a key it leads is handed
    /// on (its waiters try again), a refresh it carried frees its lock.
    pub fn end<H: Host>(&mut self, h: &mut H) {
        h.unpark();
        self.release(h, Release::Retry);
        if let Some(key) = self.refreshing.take() {
            revalidate::release(h.shared(), &key);
        }
    }

    /// After a panic in a callback: fail open for the rest of the stream.
    pub fn fail_open(&mut self) {
        self.phase = Phase::Done;
    }

    /// The cache stays out of this request: counted, and its answer says `fwd=bypass` and why.
    fn bypass<H: Host>(&mut self, h: &mut H, why: Bypass, request: &[(String, String)]) -> Action {
        if self.config.role == Role::Client {
            // The client role only routes: no routing key, the request balances normally.
            self.phase = Phase::Done;
            return Continue;
        }
        self.phase = Phase::Bypass(why);
        h.count(m::BYPASSES, 1);
        h.count(m::bypass_counter(why), 1);
        h.log_debug(&|| logs::bypass_line(why, request));
        Continue
    }

    pub fn on_request_headers<H: Host>(&mut self, h: &mut H, eos: bool) -> Action {
        let cfg = self.config.clone();
        let mut headers = h.headers(Map::RequestHeaders);
        // Both roles: a routing key the caller sent is dropped before anything reads the headers.
        if route_key::strip(&mut headers) {
            h.remove_header(Map::RequestHeaders, names::ROUTE_KEY_HEADER);
        }
        let method = headermap::header(&headers.pairs, ":method").unwrap_or("");
        let path = headermap::header(&headers.pairs, ":path").unwrap_or("");
        let head = RequestHead { method, path, headers: &headers.pairs, not_utf8: &headers.not_utf8 };
        match request::classify_head(&head) {
            HeadDecision::Ignore => Continue,
            HeadDecision::Bypass(why) => self.bypass(h, why, &headers.pairs),
            HeadDecision::Buffer { source, refresh } => {
                if eos {
                    return self.decide_request(h, &headers, &source, refresh, &[]);
                }
                if cfg.role == Role::Client && !cfg.hold_headers {
                    // Routing happens when the headers continue: no body, no key.
                    return Continue;
                }
                if cfg.role == Role::Server && source == ModelSource::GrpcBody && !h.grpc_hits_work() {
                    return self.bypass(h, Bypass::NoHitRoute, &headers.pairs);
                }
                if request::request_declared_too_big(headermap::header(&headers.pairs, "content-length")) {
                    return self.bypass(h, Bypass::TooBig, &headers.pairs);
                }
                self.phase = Phase::Buffering { source, refresh, headers };
                // Held headers: routing waits for the decision. Otherwise the body alone waits.
                if cfg.hold_headers || h.always_holds_request_headers() {
                    Pause
                } else {
                    Continue
                }
            }
        }
    }

    pub fn on_request_body<H: Host>(&mut self, h: &mut H, eos: bool) -> Action {
        if !matches!(self.phase, Phase::Buffering { .. }) {
            return Continue;
        }
        // Until the end, only its size is read (room 0 copies nothing but an empty body).
        let room = if eos { request::MAX_REQUEST_BYTES } else { 0 };
        let mut body = Vec::new();
        let size = h.read_body(Side::Request, 0, room, &mut body);
        if size.map_or(false, |n| n > request::MAX_REQUEST_BYTES) {
            let request = match &self.phase {
                Phase::Buffering { headers, .. } => headers.pairs.clone(),
                _ => Vec::new(),
            };
            return self.bypass(h, Bypass::TooBig, &request);
        }
        if !eos {
            return Pause;
        }
        if size != Some(body.len()) {
            self.phase = Phase::Pass;
            h.error("request body unreadable; passing through");
            return Continue;
        }
        match std::mem::replace(&mut self.phase, Phase::Pass) {
            Phase::Buffering { source, refresh, headers } => self.decide_request(h, &headers, &source, refresh, &body),
            _ => Continue,
        }
    }

    /// Trailers end the request (an HTTP/2 or gRPC body followed by trailers): decide on the
    /// body held so far, as at the end of a body.
    pub fn on_request_trailers<H: Host>(&mut self, h: &mut H) -> Action {
        self.on_request_body(h, true)
    }

    fn decide_request<H: Host>(&mut self, h: &mut H, request: &Headers, source: &ModelSource, refresh: bool, body: &[u8])
        -> Action {
        let cfg = self.config.clone();
        let headers = &request.pairs;
        let method = headermap::header(headers, ":method").unwrap_or("");
        let path = headermap::header(headers, ":path").unwrap_or("");
        let head = RequestHead { method, path, headers, not_utf8: &request.not_utf8 };
        if cfg.role == Role::Client {
            return self.route(h, &head, source, refresh, body);
        }
        // The peer identity is asked for only when the matched policy scopes by it.
        let principal = || h.peer_identity();
        let mut c = match request::key_request(&cfg, &head, source, refresh, body, principal) {
            BodyDecision::Bypass(why) => return self.bypass(h, why, headers),
            BodyDecision::Cacheable(c) => c,
        };
        let now = h.now_ms();
        c.request_ms = now;
        if c.refresh {
            return self.miss(h, c);
        }
        let mut out = Outcome::default();
        let found = Cache { data: h.shared(), limits: &cfg.limits }.lookup_keeping(&c.key, now, Lifetime::of(&c.policy), &mut out);
        self.outcome(h, &out);
        let entry = match found {
            Lookup::Hit(e) => e,
            Lookup::Miss(seen) => {
                c.seen = seen;
                // Looked up by meaning first; coalescing comes after the lookup (`on_callout`).
                let c = match self.semantic_lookup(h, c, headers, path, body) {
                    Some(c) => c,
                    None => return Pause,
                };
                if self.joins_in_flight(h, &c, now) {
                    return self.wait(h, c, headers);
                }
                return self.miss(h, c);
            }
            Lookup::Stale(e, seen) => {
                // A fresh answer replaces the entry where it is.
                c.seen = Some(seen);
                if let Some(u) = stale::stale_use(&e, &c.policy, now).filter(|u| u.while_revalidate) {
                    let swr = names::cache_status_stale_while_revalidate(u.past_s());
                    match revalidate::claim(h.shared(), &c.key, now) {
                        Claim::Busy => return self.answer_stale(h, &c, &e, headers, body, now, swr),
                        Claim::Background => {
                            if h.refresh(&c, headers, body, &cfg.limits) {
                                h.count(m::REFRESHES, 1);
                                return self.answer_stale(h, &c, &e, headers, body, now, swr);
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
                return self.forward_expired(h, c, e, headers, now);
            }
        };
        self.answer_hit(h, &c, &HitRequest { headers, body, id: &c.request_id }, &entry, now, None)
    }

    /// Client role: the routing key goes on the held request headers, so the router's
    /// consistent hash sends identical requests to one replica; nothing is looked up or stored.
    fn route<H: Host>(&mut self, h: &mut H, head: &RequestHead, source: &ModelSource, refresh: bool, body: &[u8]) -> Action {
        self.phase = Phase::Done;
        if let Some(key) = route_key::route_key(&self.config, head, source, refresh, body) {
            h.set_header(Map::RequestHeaders, names::ROUTE_KEY_HEADER, &key);
            h.reroute();
            h.count(m::ROUTED, 1);
        }
        Continue
    }

    /// Answers from a stored entry (Stop), or Continue when the local reply failed.
    /// `cache_status`: other than the hit's (a request that waited for an identical one).
    fn answer_hit<H: Host>(&mut self, h: &mut H, c: &Cacheable, request: &HitRequest, entry: &Entry, now: u64,
                           cache_status: Option<String>) -> Action {
        count_hit(h, c, entry);
        self.answer_entry(h, c, request, entry, now, cache_status)
    }

    /// Stale-while-revalidate: the expired entry answers at once; its refresh is under way.
    #[allow(clippy::too_many_arguments)]
    fn answer_stale<H: Host>(&mut self, h: &mut H, c: &Cacheable, entry: &Entry, headers: &[(String, String)], body: &[u8],
                             now: u64, status: String) -> Action {
        h.count(m::STALE_WHILE_REVALIDATE, 1);
        self.answer_entry(h, c, &HitRequest { headers, body, id: &c.request_id }, entry, now, Some(status))
    }

    /// Answers the request from `entry` (a hit, or a stale answer whose `Cache-Status` says so).
    fn answer_entry<H: Host>(&mut self, h: &mut H, c: &Cacheable, request: &HitRequest, entry: &Entry, now: u64,
                             cache_status: Option<String>) -> Action {
        self.phase = Phase::Done;
        let mut reply = if c.grpc { hit::grpc_hit(entry, request, now) } else { hit::http_hit(entry, request, now) };
        if let Some(status) = cache_status {
            hit::set_cache_status(&mut reply, status);
        }
        if c.grpc {
            return match h.send_grpc(GrpcAt::Request, reply.headers, reply.body.into_wire()) {
                Some(action) => action,
                None => {
                    h.error("gRPC hit: local reply failed; forwarding the request");
                    Continue
                }
            };
        }
        let hdrs: Vec<(&str, &str)> = reply.headers.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
        if !h.send_reply(reply.status as u32, "meshcache_hit", &hdrs, &reply.body) {
            h.error("local reply failed; passing through");
            return Continue;
        }
        Stop
    }

    /// A request whose entry expired is forwarded (a fresh answer replaces the entry where it
    /// is); if stale-if-error may use the entry, it stands by for an origin failure.
    fn forward_expired<H: Host>(&mut self, h: &mut H, c: Cacheable, e: Entry, headers: &[(String, String)], now: u64)
        -> Action {
        let if_error = stale::stale_use(&e, &c.policy, now).map_or(false, |u| u.if_error);
        let ready = !c.grpc
            || match h.take_stale_route(self.config.hold_headers) {
                StaleRoute::NotNeeded => true,
                StaleRoute::Taken => {
                    self.stale_route = true;
                    true
                }
                StaleRoute::Failed => false,
            };
        if if_error && ready {
            let (id, grpc, policy) = (c.request_id.clone(), c.grpc, c.policy.clone());
            self.fallback = Some(Box::new(Fallback { entry: e, policy, headers: headers.to_vec(), id, grpc }));
        }
        self.miss(h, c)
    }

    /// The request goes to the origin; its answer may be stored.
    fn miss<H: Host>(&mut self, h: &mut H, c: Cacheable) -> Action {
        h.count(m::MISSES, 1);
        h.count_policy(&c.policy.model_prefix, "misses", 1);
        self.phase = Phase::Miss(Box::new(c));
        Continue
    }

    // ------------------------------------------------------------ request coalescing

    /// A request about to go upstream under a policy with `coalesce_timeout_ms`: true when an
    /// identical one is in flight and this one is parked to wait for it; false: it goes
    /// upstream (holding the key's lock when it was free). Requests that skip the lookup
    /// (`no-cache`) neither lead nor wait.
    fn joins_in_flight<H: Host>(&mut self, h: &mut H, c: &Cacheable, now: u64) -> bool {
        let timeout = c.policy.coalesce_timeout_ms;
        timeout > 0 && !c.refresh && self.lead_or_wait(h, c, now, now.saturating_add(timeout))
    }

    fn wait<H: Host>(&mut self, h: &mut H, c: Cacheable, headers: &[(String, String)]) -> Action {
        h.count(m::COALESCE_WAITS, 1);
        let deadline = c.request_ms.saturating_add(c.policy.coalesce_timeout_ms);
        self.phase = Phase::Waiting(Box::new(Waiting { c, headers: headers.to_vec(), deadline }));
        Pause
    }

    /// True: parked until woken or `deadline`. False: go upstream, as the key's leader when the
    /// lock was free.
    fn lead_or_wait<H: Host>(&mut self, h: &mut H, c: &Cacheable, now: u64, deadline: u64) -> bool {
        let (queue, id) = match h.place() {
            Some(p) => p,
            None => return false,
        };
        let owner = ((queue as u64) << 32) | id as u64;
        match (LockTable { data: h.shared() }).join(&c.key, owner, queue, now, c.policy.coalesce_timeout_ms) {
            Join::Lead(ticket) => {
                self.lock = Some(ticket);
                false
            }
            Join::Wait => match h.park(&c.key, deadline) {
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

    /// The leader of this key is done: free the lock and wake every stream that waits on it.
    fn release<H: Host>(&mut self, h: &mut H, release: Release) {
        if let Some(ticket) = self.lock.take() {
            let queues = (LockTable { data: h.shared() }).release(&ticket);
            h.wake(&queues, &ticket.key, release);
        }
    }

    /// A parked stream leaves its wait: `release` is its leader's outcome (None: its
    /// `coalesce_timeout_ms` passed). It answers from the leader's entry, or goes upstream;
    /// after a failure that may pass, it leads or waits again within its deadline. The host
    /// made this stream the current one.
    pub fn resume<H: Host>(&mut self, h: &mut H, release: Option<Release>) {
        let Waiting { mut c, headers, deadline } = match std::mem::replace(&mut self.phase, Phase::Done) {
            Phase::Waiting(w) => *w,
            other => {
                self.phase = other;
                return;
            }
        };
        if release.is_none() {
            h.count(m::COALESCE_TIMEOUTS, 1);
        }
        let now = h.now_ms();
        let cfg = self.config.clone();
        let mut out = Outcome::default();
        let mut moved: Vec<&'static str> = Vec::new();
        let cache = Cache { data: h.shared(), limits: &cfg.limits };
        let woken = coalesce::wake(&cache, &mut c, release, now, deadline, &mut out, &mut |name| moved.push(name));
        for name in moved {
            h.count(name, 1);
        }
        self.outcome(h, &out);
        let (again, expired) = match woken {
            Woken::Answer { entry, cache_status } => {
                let request = HitRequest { headers: &headers, body: &[], id: &c.request_id };
                if self.answer_hit(h, &c, &request, &entry, now, Some(cache_status)) != Continue {
                    return;
                }
                // The local reply failed: upstream, uncached.
                self.phase = Phase::Pass;
                return self.resume_request(h);
            }
            Woken::Upstream { again, expired } => (again, expired),
        };
        if again && self.lead_or_wait(h, &c, now, deadline) {
            self.phase = Phase::Waiting(Box::new(Waiting { c, headers, deadline }));
            return;
        }
        match expired {
            Some(entry) => self.forward_expired(h, c, entry, &headers, now),
            None => self.miss(h, c),
        };
        self.resume_request(h);
    }

    fn resume_request<H: Host>(&mut self, h: &mut H) {
        if !h.resume_request() {
            h.error("could not resume a paused request");
        }
    }

    // ------------------------------------------------------------ semantic layer (issue 38)
    //
    // `semantic_lookup` on an exact miss, `on_callout` with the index service's answer,
    // `semantic_stored` after an answer is stored. The decisions are `semantic`'s; the host
    // only sends (`Host::callout`, `Host::post`) and delivers the answer.

    /// Sends the lookup of an exact miss of a semantic policy (chat completions, the service
    /// configured) and pauses the request for it: None. Some: the request goes on as an exact
    /// miss (not a semantic one, or the lookup could not be sent: counted as an error).
    fn semantic_lookup<H: Host>(&mut self, h: &mut H, c: Cacheable, headers: &[(String, String)], path: &str, body: &[u8])
        -> Option<Cacheable> {
        let cfg = self.config.clone();
        let service = match cfg.semantic_service.as_ref() {
            Some(s) if c.policy.semantic.is_some() => s,
            _ => return Some(c),
        };
        let principal = if c.policy.scope == Scope::Principal { h.peer_identity() } else { None };
        let instance = h.instance_id();
        let plan = match semantic::plan(Some(service), &c.policy, path, body, principal.as_deref(), &instance) {
            Some(p) => p,
            None => return Some(c),
        };
        h.count(m::SEMANTIC_LOOKUPS, 1);
        let lookup = semantic::lookup_body(&plan);
        // Whatever the lookup says, the answer this request stores is indexed.
        self.semantic = Some(Box::new(SemanticAfter { plan, shadow: None }));
        if !h.callout(&service.cluster, &semantic::call_headers(service, semantic::LOOKUP_PATH), &lookup, service.timeout_ms) {
            h.count(m::SEMANTIC_ERRORS, 1);
            return Some(c);
        }
        self.phase = Phase::Callout(Box::new(Callout { c, headers: headers.to_vec(), body: body.to_vec() }));
        None
    }

    /// The semantic lookup's answer (None: it failed or timed out; fail open). A hit this
    /// store holds fresh answers the paused request; anything else resumes it as an exact
    /// miss (which may still wait for an identical request in flight).
    pub fn on_callout<H: Host>(&mut self, h: &mut H, answer: Option<CalloutAnswer>) {
        let Callout { c, headers, body } = match std::mem::replace(&mut self.phase, Phase::Done) {
            Phase::Callout(w) => *w,
            other => {
                self.phase = other;
                return;
            }
        };
        let verdict = match &answer {
            Some(a) => semantic::verdict(headermap::header(&a.headers.pairs, ":status"), &a.body),
            None => Err("no answer (reset or timed out)"),
        };
        let now = h.now_ms();
        match verdict {
            Err(why) => {
                h.count(m::SEMANTIC_ERRORS, 1);
                h.log_debug(&|| format!("meshcache: semantic lookup failed ({}); going upstream", why));
            }
            Ok(Verdict::Upstream) => {}
            Ok(Verdict::Shadow { response_hash, similarity }) => {
                h.count(m::SEMANTIC_WOULD_HIT, 1);
                if let Some(s) = self.semantic.as_mut() {
                    s.shadow = Some((response_hash, similarity));
                }
            }
            Ok(Verdict::Serve { key, similarity }) => {
                let cfg = self.config.clone();
                let mut out = Outcome::default();
                let found = semantic::served(&Cache { data: h.shared(), limits: &cfg.limits }, &c, &key, now, &mut out);
                self.outcome(h, &out);
                match found {
                    Some(entry) => {
                        let request = HitRequest { headers: &headers, body: &body, id: &c.request_id };
                        if self.answer_semantic_hit(h, &c, &request, &entry, now, similarity) {
                            return;
                        }
                    }
                    // The entry is gone (evicted, expired, this sidecar restarted): upstream.
                    None => h.count(m::SEMANTIC_WOULD_HIT, 1),
                }
            }
        }
        if self.joins_in_flight(h, &c, now) {
            self.wait(h, c, &headers);
            return;
        }
        self.miss(h, c);
        self.resume_request(h);
    }

    /// Answers from a similar prompt's entry: `Cache-Status: meshcache; hit; detail=semantic`
    /// and the similarity. False: the local reply failed (the request goes upstream).
    fn answer_semantic_hit<H: Host>(&mut self, h: &mut H, c: &Cacheable, request: &HitRequest, entry: &Entry, now: u64,
                                    similarity: f64) -> bool {
        let reply = semantic::hit_answer(entry, request, now, similarity);
        let hdrs: Vec<(&str, &str)> = reply.headers.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
        if !h.send_reply(reply.status as u32, "meshcache_semantic_hit", &hdrs, &reply.body) {
            h.error("semantic hit: local reply failed; going upstream");
            return false;
        }
        self.semantic = None;
        h.count(m::SEMANTIC_HITS, 1);
        count_hit(h, c, entry);
        true
    }

    /// An answer of a semantic policy was stored: index it and, in shadow mode, report whether
    /// it equals the would-be hit's (fire and forget).
    fn semantic_stored<H: Host>(&mut self, h: &mut H, entry: &Entry) {
        let (after, service) = match (self.semantic.take(), self.config.semantic_service.as_ref()) {
            (Some(a), Some(s)) => (a, s),
            _ => return,
        };
        for (path, body) in semantic::after_store(&after.plan, after.shadow.as_ref(), entry) {
            if !h.post(&service.cluster, &semantic::call_headers(service, path), &body, service.timeout_ms) {
                h.count(m::SEMANTIC_ERRORS, 1);
            }
        }
    }

    // ------------------------------------------------------------ the answer of a miss

    pub fn on_response_headers<H: Host>(&mut self, h: &mut H, eos: bool) -> Action {
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
                // A gRPC error the stale route gave a body and we do not replace: headers, then
                // the status as trailers (a valid gRPC answer, like the trailers-only one was).
                let mut moved = vec![("grpc-status".to_string(), status)];
                if let Some(msg) = h.header(Map::ResponseHeaders, "grpc-message") {
                    moved.push(("grpc-message".to_string(), msg));
                }
                h.remove_header(Map::ResponseHeaders, "grpc-status");
                h.remove_header(Map::ResponseHeaders, "grpc-message");
                let refresh = matches!(&self.phase, Phase::Miss(c) if c.refresh);
                self.release(h, Release::OriginError);
                h.set_header(Map::ResponseHeaders, names::CACHE_STATUS, &names::cache_status_not_stored(refresh, NotStored::GrpcStatus));
                self.phase = Phase::StatusToTrailers(moved);
                return Continue;
            }
        }
        match std::mem::replace(&mut self.phase, Phase::Done) {
            Phase::Bypass(why) => {
                h.set_header(Map::ResponseHeaders, names::CACHE_STATUS, &names::cache_status_bypass(why.detail()));
                Continue
            }
            Phase::Miss(c) => self.start_collect(h, *c, eos),
            // Answered before the request body ended (Envoy or the origin): it passes as it is.
            Phase::Buffering { .. } => Continue,
            other => {
                self.phase = other;
                Continue
            }
        }
    }

    /// The origin (or Envoy for it: unreachable, timed out) answered with an error and an
    /// expired entry may stand in for it: answer with the entry instead. None: the answer
    /// passes as it is.
    fn stale_if_error<H: Host>(&mut self, h: &mut H, f: Fallback, eos: bool) -> Option<Action> {
        let response = h.headers(Map::ResponseHeaders);
        let status: u16 = headermap::header(&response.pairs, ":status").and_then(|s| s.parse().ok()).unwrap_or(0);
        if !stale::is_origin_error(status, headermap::header(&response.pairs, "grpc-status")) {
            return None;
        }
        let now = h.now_ms();
        let u = stale::stale_use(&f.entry, &f.policy, now).filter(|u| u.if_error)?;
        let request = HitRequest { headers: &f.headers, body: b"", id: &f.id };
        let action = if f.grpc {
            let mut reply = hit::grpc_hit(&f.entry, &request, now);
            hit::set_cache_status(&mut reply, names::cache_status_stale_if_error(u.past_s(), None));
            h.send_grpc(GrpcAt::ResponseHeaders { eos }, reply.headers, reply.body.into_wire())
        } else {
            let mut reply = hit::http_hit(&f.entry, &request, now);
            hit::set_cache_status(&mut reply, names::cache_status_stale_if_error(u.past_s(), Some(status)));
            let hdrs: Vec<(&str, &str)> = reply.headers.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
            // In the response path a local reply goes straight to the client (the error is dropped).
            h.send_reply(reply.status as u32, "meshcache_stale_if_error", &hdrs, &reply.body).then(|| Stop)
        };
        match action {
            Some(_) => h.count(m::STALE_IF_ERROR, 1),
            None => h.error("stale-if-error: the stale answer could not be sent; passing the error through"),
        }
        action
    }

    /// `headers_open`: the response headers can still be changed (in their callback, or held
    /// until the body is complete).
    fn not_stored<H: Host>(&mut self, h: &mut H, refresh: bool, why: NotStored, headers_open: bool) -> Action {
        self.release(h, Release::not_stored(why));
        h.count(m::not_stored_counter(why), 1);
        if headers_open {
            h.set_header(Map::ResponseHeaders, names::CACHE_STATUS, &names::cache_status_not_stored(refresh, why));
        }
        self.phase = Phase::Done;
        Continue
    }

    fn start_collect<H: Host>(&mut self, h: &mut H, c: Cacheable, eos: bool) -> Action {
        let response = h.headers(Map::ResponseHeaders);
        let (max, hold) = (self.config.limits.max_entry_bytes, self.config.hold_headers);
        let (status, plan) = response::begin_collect(&c, &response, eos, h.now_ms(), max, hold);
        let headers = response.pairs;
        match plan {
            Collect::Skip { why, release } => {
                self.release(h, release);
                self.not_stored(h, c.refresh, why, true)
            }
            Collect::StoreNow(ttl) => self.finish_store(h, c, ttl, status, headers, Vec::new(), None, Open::Headers),
            Collect::Start { ttl, limit, held, hasher, declared } => {
                if !held {
                    // The answer streams: say what is known now; it is copied and stored at its end.
                    h.set_header(Map::ResponseHeaders, names::CACHE_STATUS, names::cache_status_forwarded(c.refresh));
                }
                // Room for the whole declared answer up front: chunks land in it without regrowing.
                let copy = Vec::with_capacity(declared.min(limit));
                self.phase = Phase::Collect(Box::new(Collecting { c, ttl, status, headers, copy, limit, hasher, held, base: 0 }));
                if held {
                    Pause
                } else {
                    Continue
                }
            }
        }
    }

    /// The answer's body passes (or is held while small); a copy is kept for the store up to
    /// `max_entry_bytes`, hashed as it arrives.
    pub fn on_response_body<H: Host>(&mut self, h: &mut H, eos: bool) -> Action {
        if let Phase::StatusToTrailers(moved) = &self.phase {
            if eos {
                for (n, v) in moved {
                    h.add_header(Map::ResponseTrailers, n, v);
                }
                self.phase = Phase::Done;
            }
            return Continue;
        }
        let mut k = match std::mem::replace(&mut self.phase, Phase::Done) {
            Phase::Collect(k) => k,
            other => {
                self.phase = other;
                return Continue;
            }
        };
        // The host holds body bytes [base, base + size): everything since we last let data
        // pass. Copy the part not copied yet.
        let have = k.copy.len() - k.base;
        let from = k.copy.len();
        let room = k.limit - k.copy.len();
        let size = match h.read_body(Side::Response, have, room, &mut k.copy) {
            Some(size) => size,
            None => {
                h.error("response body unreadable; not storing");
                return self.not_stored(h, k.c.refresh, NotStored::Error, k.held);
            }
        };
        if size - have.min(size) > room {
            return self.not_stored(h, k.c.refresh, NotStored::TooBig, k.held);
        }
        if k.copy.len() != k.base + size {
            h.error("response body unreadable; not storing");
            return self.not_stored(h, k.c.refresh, NotStored::Error, k.held);
        }
        if let Some(hasher) = k.hasher.as_mut() {
            hasher.update(&k.copy[from..]);
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
            return Pause;
        }
        if k.held {
            // Grown past what a miss holds back: let it stream from here.
            h.set_header(Map::ResponseHeaders, names::CACHE_STATUS, names::cache_status_forwarded(k.c.refresh));
            k.held = false;
        }
        k.base += size;
        self.phase = Phase::Collect(k);
        Continue
    }

    pub fn on_response_trailers<H: Host>(&mut self, h: &mut H) -> Action {
        let k = match std::mem::replace(&mut self.phase, Phase::Done) {
            Phase::Collect(k) => k,
            other => {
                self.phase = other;
                return Continue;
            }
        };
        if k.c.grpc && h.header(Map::ResponseTrailers, "grpc-status").as_deref() != Some("0") {
            return self.not_stored(h, k.c.refresh, NotStored::GrpcStatus, k.held);
        }
        let open = if k.held { Open::Headers } else { Open::Trailers };
        let Collecting { c, ttl, status, headers, copy, hasher, .. } = *k;
        self.finish_store(h, c, ttl, status, headers, copy, hasher, open)
    }

    #[allow(clippy::too_many_arguments)]
    fn finish_store<H: Host>(&mut self, h: &mut H, c: Cacheable, ttl: Ttl, status: u16, headers: Vec<(String, String)>,
                             body: Vec<u8>, hashed: Option<AnswerHasher>, open: Open) -> Action {
        let cfg = self.config.clone();
        let refresh = c.refresh;
        let mut out = Outcome::default();
        let cache = Cache { data: h.shared(), limits: &cfg.limits };
        let result = insert::store_streamed(&cache, &c, &headers, status, body, ttl, hashed, &mut out);
        self.outcome(h, &out);
        let stored = match result {
            Ok(stored) => stored,
            Err(why) => return self.not_stored(h, refresh, why, open == Open::Headers),
        };
        h.count(m::STORES, 1);
        h.gauges_changed();
        self.semantic_stored(h, &stored.entry);
        self.release(h, Release::Stored);
        self.phase = Phase::Done;
        match open {
            Open::Closed => {}
            // The headers have left: the hash goes in the trailers (gRPC's, or any an HTTP/2
            // answer has).
            Open::Trailers => h.add_header(Map::ResponseTrailers, names::HASH_HEADER, &stored.entry.response_hash),
            Open::Headers => {
                let mut ours: Vec<(&str, &str)> =
                    vec![(names::HASH_HEADER, &stored.entry.response_hash), (names::CACHE_STATUS, names::cache_status_stored(refresh))];
                if let Some(etag) = stored.added_etag.as_deref() {
                    ours.push(("etag", etag));
                }
                h.set_ours(Map::ResponseHeaders, &headers, &ours);
            }
        }
        Continue
    }

    /// What a lookup or store freed on the way: counted; the gauges follow the space given back.
    fn outcome<H: Host>(&self, h: &mut H, out: &Outcome) {
        h.record_outcome(out);
        if out.evicted > 0 || out.corrupt > 0 {
            h.gauges_changed();
        }
    }
}

/// A hit (exact, semantic, or a waiter's answer), and what its entry's answer cost (its stored
/// OpenAI `usage`): tokens saved.
fn count_hit<H: Host>(h: &mut H, c: &Cacheable, entry: &Entry) {
    h.count(m::HITS, 1);
    let prefix = &c.policy.model_prefix;
    h.count_policy(prefix, "hits", 1);
    for (what, n) in [(m::TOKENS_SAVED_PROMPT, entry.usage.prompt_tokens), (m::TOKENS_SAVED_COMPLETION, entry.usage.completion_tokens)] {
        if n > 0 {
            h.count_policy(prefix, what, n as u64);
        }
    }
}

#[cfg(test)]
#[path = "flow_tests.rs"]
mod tests;
