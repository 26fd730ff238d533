//! One HTTP stream through the cache core (`meshcache-core`): the same request reading, keys,
//! policies, HTTP semantics, answers and store as the Wasm host (filter/wasm/src/stream.rs), so
//! both give the same `Cache-Status`, `x-response-hash`, `ETag`, `Age` and bodies.
//!
//! The stream talks to Envoy only through `Host` (lib.rs implements it over the dynamic-module
//! ABI; the tests below over a fake). gRPC hits are answered in one pass with headers, the
//! framed message and a `grpc-status: 0` trailer (no hit route or Lua step, unlike the Wasm
//! host); stale-if-error answers an origin error (HTTP or gRPC) with the expired entry.
//! Identical misses are coalesced by the core's rules (`coalesce::LockTable`, `coalesce::wake`):
//! waiters park (`park.rs`) and are woken by their leader's outcome or their timeout through
//! Envoy's scheduler. Stale-while-revalidate refreshes go out as config-level callouts
//! (`background.rs`); the client role puts the routing key on the held request headers.

use std::sync::Arc;

use meshcache_core::hit::{self, HitRequest};
use meshcache_core::cache_control::{NotStored, Ttl};
use meshcache_core::config::{Config, Policy, Role};
use meshcache_core::entry::Entry;
use meshcache_core::shaping::RequestId;
use meshcache_core::stale;
use meshcache_core::grpc;
use meshcache_core::logs;
use meshcache_core::request::{self, BodyDecision, Cacheable, HeadDecision, RequestHead};
use meshcache_core::accounting::{attribute, policy_tag};
use meshcache_core::headermap::{self, Headers};
use meshcache_core::metric_names;
use meshcache_core::response::{self, Collect};
use meshcache_core::hashing::AnswerHasher;
use meshcache_core::model::ModelSource;
use meshcache_core::names::{self, Bypass};
use meshcache_core::route_key;
use meshcache_core::store::{Cache, Lifetime, Lookup, Outcome};
use meshcache_core::insert;
use meshcache_core::coalesce::{self, Join, LockTable, Release, Ticket, Woken};
use meshcache_core::revalidate::{self, Claim};

use crate::park::{self, Parking, Wake};
use crate::store::Shared;

/// What the filter needs from its proxy for one stream.
pub trait Host {
    fn request_headers(&self) -> Headers;
    fn response_headers(&self) -> Headers;
    fn remove_request_header(&mut self, name: &str);
    fn set_request_header(&mut self, name: &str, value: &[u8]);
    /// The route is chosen again (after a request header the routes may match changed).
    fn clear_route_cache(&mut self);
    fn set_response_header(&mut self, name: &str, value: &[u8]);
    /// In the response trailers hook: sets a trailer.
    fn set_response_trailer(&mut self, name: &str, value: &[u8]);
    /// Visits the body bytes that arrived with this callback.
    fn received_body(&self, response: bool, f: &mut dyn FnMut(&[u8]));
    /// Visits the whole body seen so far (what was held back plus what arrived now), once each.
    fn whole_body(&self, response: bool, f: &mut dyn FnMut(&[u8]));
    fn send_response(&mut self, status: u32, headers: &[(&str, &[u8])], body: &[u8]);
    /// A reply with trailers (a gRPC hit): headers (with `:status`), body, trailers.
    fn send_response_with_trailers(&mut self, headers: &[(&str, &[u8])], body: &[u8], trailers: &[(&str, &[u8])]);
    fn response_trailers(&self) -> Headers;
    /// Wall clock, milliseconds since the epoch (entries record when they were stored).
    fn now_ms(&self) -> u64;
    /// The peer's identity (its certificate's URI SAN), for principal-scoped policies.
    fn peer_identity(&self) -> Option<String>;
    /// Adds to a counter (`meshcache_core::metric_names`).
    fn count(&mut self, name: &str, n: u64);
    fn set_gauge(&mut self, name: &str, value: u64);
    /// A line for Envoy's log at debug level (`meshcache_core::logs`), formatted only when that
    /// level is on.
    fn log_debug(&mut self, line: &dyn Fn() -> String);
    /// What wakes this stream once it is parked (coalescing); None: it cannot wait.
    fn waker(&mut self) -> Option<Box<dyn Wake>>;
    /// Resumes the held request (outside the request hooks: a parked stream going upstream).
    fn resume_request(&mut self);
    /// Sends `c`'s request again in the background to refresh its entry
    /// (stale-while-revalidate): the answer goes to `store_refresh`, then `revalidate::release`
    /// (stored) or `revalidate::failed`. False: it cannot be sent (this request refreshes instead).
    fn refresh(&mut self, c: &Cacheable, headers: &[(String, String)], body: &[u8]) -> bool;
}

/// Entries and bytes, cache-wide and per policy of `config`, from the accounting record, each
/// given to `set`. Under one lock per process: the last writer reads the newest record, so the
/// gauges end at its value.
pub fn record_gauges(shared: &Shared, config: &Config, set: &mut dyn FnMut(&str, u64)) {
    let _one_at_a_time = shared.gauges.lock().unwrap_or_else(|p| p.into_inner());
    let (meta, _) = Cache::read_only(shared).meta();
    set(metric_names::ENTRIES, meta.entries());
    set(metric_names::BYTES, meta.total_bytes());
    let named: Vec<(u64, String)> =
        config.policies.iter().map(|p| (policy_tag(&p.model_prefix), metric_names::safe_name(&p.model_prefix))).collect();
    let got = attribute(&meta, &named);
    set(metric_names::UNATTRIBUTED_ENTRIES, got.unattributed.0);
    set(metric_names::UNATTRIBUTED_BYTES, got.unattributed.1);
    for (name, (entries, bytes)) in &got.per_name {
        set(&format!("meshcache.policy.{}.entries", name), *entries);
        set(&format!("meshcache.policy.{}.bytes", name), *bytes);
    }
}

/// A background refresh's answer (`Host::refresh`) into the store, under the rules of a miss's:
/// status 200, gRPC status 0 where its headers carry one (the callout's answer comes without its
/// trailers: a gRPC answer is taken as one whole framed message, checked when unframed), storable
/// per policy, within `max_entry_bytes`. Ok: stored (with what it freed on the way).
pub fn store_refresh(shared: &Shared, limits: &meshcache_core::config::Limits, c: &Cacheable, response: &Headers,
                     body: Vec<u8>, now_ms: u64) -> Result<Outcome, NotStored> {
    if headermap::header(&response.pairs, ":status") != Some("200") {
        return Err(NotStored::Status);
    }
    if c.grpc && headermap::header(&response.pairs, "grpc-status").is_some_and(|g| g.trim() != "0") {
        return Err(NotStored::GrpcStatus);
    }
    let ttl = response::check_storable(&c.policy, &response.pairs, &response.not_utf8, now_ms)?;
    let mut c = c.clone();
    c.request_ms = now_ms;
    let cache = Cache { data: shared, limits };
    let mut out = Outcome::default();
    insert::store_answer(&cache, &c, &response.pairs, 200, body, ttl, &mut out)?;
    Ok(out)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    Continue,
    /// Headers: hold them (the body decides). Body: keep buffering.
    Hold,
    /// Body: a local reply was sent; drop what arrived.
    Stop,
}

/// Where the outcome of a store can still be written.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Open {
    Headers,
    Trailers,
    Closed,
}

struct Collecting {
    c: Cacheable,
    ttl: Ttl,
    status: u16,
    headers: Vec<(String, String)>,
    /// The answer so far, once it streams (while held, Envoy keeps it: read whole at the end).
    copy: Vec<u8>,
    /// Bytes seen so far.
    seen: usize,
    /// Response headers not yet sent: they can still say `stored` and carry the hash.
    held: bool,
    /// What the answer may grow to and still be stored.
    limit: usize,
    /// The answer's hash, fed each chunk as it arrives (None: hashed whole when stored).
    hasher: Option<AnswerHasher>,
}

enum State {
    /// Not ours (or failed open): untouched.
    Pass,
    /// An inference request the cache stays out of; its answer says so and why.
    Bypass(Bypass),
    Buffering { source: ModelSource, refresh: bool, headers: Headers, seen: usize },
    Miss(Box<Cacheable>),
    /// Parked while an identical request is in flight (request coalescing).
    Waiting(Box<Waiting>),
    Collect(Box<Collecting>),
    Done,
}

struct Waiting {
    c: Cacheable,
    /// Request headers, for the answer (If-None-Match).
    headers: Vec<(String, String)>,
    /// When it stops waiting (`coalesce_timeout_ms` after it first parked).
    deadline: u64,
}

/// Where this stream waits when it coalesces: the process's parking, its worker's queue and
/// its own id there.
pub struct Place {
    pub parking: Arc<Parking>,
    pub queue: u32,
    pub id: u32,
}

/// An expired entry a forwarded HTTP request may be answered with if the origin fails
/// (stale-if-error), read whole at lookup.
struct Fallback {
    entry: Entry,
    policy: Policy,
    /// Request headers and id, for the answer (If-None-Match, the caller's id).
    headers: Vec<(String, String)>,
    id: RequestId,
    grpc: bool,
}


pub struct Stream {
    config: Arc<Config>,
    shared: Arc<Shared>,
    state: State,
    fallback: Option<Box<Fallback>>,
    /// None: this stream never coalesces.
    place: Option<Place>,
    /// Held while this stream leads a coalesced key: released with its outcome.
    lock: Option<Ticket>,
    /// This forwarded request refreshes the key (stale-while-revalidate without a background
    /// request): its refresh lock is released when the stream ends.
    refreshing: Option<meshcache_core::hashing::KeyDigest>,
}

impl Drop for Stream {
    /// A stream that ends parked leaves its table; a leader that ends without an answer (reset,
    /// client gone) hands its key on: its waiters try again.
    fn drop(&mut self) {
        if let Some(p) = &self.place {
            p.parking.unpark(p.queue, p.id);
        }
        self.release(Release::Retry);
        if let Some(key) = self.refreshing.take() {
            revalidate::release(&*self.shared, &key);
        }
    }
}

impl Stream {
    pub fn new(config: Arc<Config>, shared: Arc<Shared>) -> Stream {
        Stream { config, shared, state: State::Pass, fallback: None, place: None, lock: None, refreshing: None }
    }

    /// This stream coalesces identical misses, waiting at `place`.
    pub fn coalescing(mut self, place: Place) -> Stream {
        self.place = Some(place);
        self
    }

    fn bypass(&mut self, host: &mut dyn Host, why: Bypass, request: &[(String, String)]) -> Flow {
        if self.config.role == Role::Client {
            // The client role only routes: no routing key, the request balances normally.
            self.state = State::Done;
            return Flow::Continue;
        }
        host.count(metric_names::BYPASSES, 1);
        host.count(metric_names::bypass_counter(why), 1);
        host.log_debug(&|| logs::bypass_line(why, request));
        self.state = State::Bypass(why);
        Flow::Continue
    }

    /// What a lookup or store freed on the way (evicted, expired, unreadable): counted, and the
    /// gauges follow the space given back.
    fn record_outcome(&self, host: &mut dyn Host, out: &Outcome) {
        if out.evicted > 0 {
            host.count(metric_names::EVICTIONS, out.evicted as u64);
        }
        if out.corrupt > 0 {
            host.count(metric_names::ERRORS, out.corrupt as u64);
        }
        if out.evicted > 0 || out.corrupt > 0 {
            self.record_gauges(host);
        }
    }

    /// Entries and bytes, cache-wide and per policy, from the accounting record. Under one lock
    /// per process: the last writer reads the newest record, so the gauges end at its value.
    fn record_gauges(&self, host: &mut dyn Host) {
        record_gauges(&self.shared, &self.config, &mut |name, value| host.set_gauge(name, value));
    }

    pub fn on_request_headers(&mut self, host: &mut dyn Host, end_of_stream: bool) -> Flow {
        let mut headers = host.request_headers();
        // A routing key the caller sent is dropped before anything reads the headers.
        if route_key::strip(&mut headers) {
            host.remove_request_header(names::ROUTE_KEY_HEADER);
        }
        let decision = {
            let method = headermap::header(&headers.pairs, ":method").unwrap_or("");
            let path = headermap::header(&headers.pairs, ":path").unwrap_or("");
            request::classify_head(&RequestHead { method, path, headers: &headers.pairs, not_utf8: &headers.not_utf8 })
        };
        match decision {
            HeadDecision::Ignore => Flow::Continue,
            HeadDecision::Bypass(why) => self.bypass(host, why, &headers.pairs),
            HeadDecision::Buffer { source, refresh } => {
                if end_of_stream {
                    return self.decide_request(host, &headers, &source, refresh, &[]);
                }
                if self.config.role == Role::Client && !self.config.hold_headers {
                    // Routing happens when the headers continue: no body, no key.
                    return Flow::Continue;
                }
                if request::request_declared_too_big(headermap::header(&headers.pairs, "content-length")) {
                    return self.bypass(host, Bypass::TooBig, &headers.pairs);
                }
                self.state = State::Buffering { source, refresh, headers, seen: 0 };
                Flow::Hold
            }
        }
    }

    pub fn on_request_body(&mut self, host: &mut dyn Host, end_of_stream: bool) -> Flow {
        match &mut self.state {
            State::Buffering { seen, .. } => host.received_body(false, &mut |chunk| *seen += chunk.len()),
            _ => return Flow::Continue,
        }
        if let State::Buffering { seen, headers, .. } = &self.state {
            if *seen > request::MAX_REQUEST_BYTES {
                let request = headers.pairs.clone();
                return self.bypass(host, Bypass::TooBig, &request);
            }
            if !end_of_stream {
                return Flow::Hold;
            }
        }
        self.decide_buffered(host)
    }

    /// Trailers end the request (an HTTP/2 or gRPC body followed by trailers): decide on the
    /// body held so far, as at the end of a body (the Wasm host does the same).
    pub fn on_request_trailers(&mut self, host: &mut dyn Host) -> Flow {
        match self.state {
            State::Buffering { .. } => self.decide_buffered(host),
            _ => Flow::Continue,
        }
    }

    /// The whole request is in: its key and what to do with it.
    fn decide_buffered(&mut self, host: &mut dyn Host) -> Flow {
        let (source, refresh, headers, seen) = match std::mem::replace(&mut self.state, State::Pass) {
            State::Buffering { source, refresh, headers, seen } => (source, refresh, headers, seen),
            _ => return Flow::Continue,
        };
        let mut body = Vec::with_capacity(seen);
        host.whole_body(false, &mut |chunk| body.extend_from_slice(chunk));
        self.decide_request(host, &headers, &source, refresh, &body)
    }

    fn decide_request(&mut self, host: &mut dyn Host, request: &Headers, source: &ModelSource, refresh: bool,
                      body: &[u8]) -> Flow {
        let headers = &request.pairs;
        let method = headermap::header(headers, ":method").unwrap_or("");
        let path = headermap::header(headers, ":path").unwrap_or("");
        let head = RequestHead { method, path, headers, not_utf8: &request.not_utf8 };
        if self.config.role == Role::Client {
            return self.route(host, &head, source, refresh, body);
        }
        // The peer identity is asked for only when the matched policy scopes by it.
        let principal = || host.peer_identity();
        let mut c = match request::key_request(&self.config, &head, source, refresh, body, principal) {
            BodyDecision::Bypass(why) => return self.bypass(host, why, headers),
            BodyDecision::Cacheable(c) => c,
        };
        let now = host.now_ms();
        c.request_ms = now;
        if c.refresh {
            return self.miss(host, c);
        }
        let cache = Cache { data: &*self.shared, limits: &self.config.limits };
        let mut out = Outcome::default();
        let found = cache.lookup_keeping(&c.key, now, Lifetime::of(&c.policy), &mut out);
        self.record_outcome(host, &out);
        let entry = match found {
            Lookup::Hit(e) => e,
            Lookup::Miss(seen) => {
                c.seen = seen;
                if self.joins_in_flight(host, &c, now) {
                    return self.wait(host, c, headers);
                }
                return self.miss(host, c);
            }
            Lookup::Stale(e, seen) => {
                c.seen = Some(seen);
                if let Some(u) = stale::stale_use(&e, &c.policy, now).filter(|u| u.while_revalidate) {
                    match revalidate::claim(&*self.shared, &c.key, now) {
                        Claim::Busy => return self.answer_stale_while_revalidate(host, &c, &e, headers, body, u, now),
                        Claim::Background => {
                            if host.refresh(&c, headers, body) {
                                host.count(metric_names::REFRESHES, 1);
                                return self.answer_stale_while_revalidate(host, &c, &e, headers, body, u, now);
                            }
                            // No background request here: this request refreshes the entry.
                            host.count(metric_names::REFRESH_FAILURES, 1);
                            self.refreshing = Some(c.key);
                        }
                        Claim::Forward => self.refreshing = Some(c.key),
                    }
                }
                // An expired hot entry is a stampede too: its refresh is coalesced like a miss
                // (unless this request is the stale-while-revalidate refresh).
                if self.refreshing.is_none() && self.joins_in_flight(host, &c, now) {
                    return self.wait(host, c, headers);
                }
                return self.forward_expired(host, c, e, headers, now);
            }
        };
        let request = HitRequest { headers, body, id: &c.request_id };
        self.answer_hit(host, &c, &request, &entry, now, None);
        Flow::Stop
    }

    /// Client role: the routing key goes on the held request headers (and the route is chosen
    /// again, as Envoy does after a Wasm filter's header change), so the router's consistent hash
    /// sends identical requests to one replica; nothing is looked up or stored.
    fn route(&mut self, host: &mut dyn Host, head: &RequestHead, source: &ModelSource, refresh: bool, body: &[u8]) -> Flow {
        self.state = State::Done;
        if let Some(key) = route_key::route_key(&self.config, head, source, refresh, body) {
            host.set_request_header(names::ROUTE_KEY_HEADER, key.as_bytes());
            host.clear_route_cache();
            host.count(metric_names::ROUTED, 1);
        }
        Flow::Continue
    }

    /// Answers from an entry (a hit; `cache_status`, when given, replaces the hit's).
    fn answer_hit(&mut self, host: &mut dyn Host, c: &Cacheable, request: &HitRequest, entry: &Entry, now: u64,
                  cache_status: Option<String>) {
        host.count(metric_names::HITS, 1);
        host.count(&metric_names::policy_metric(&c.policy.model_prefix, "hits"), 1);
        self.answer_entry(host, c, request, entry, now, cache_status);
    }

    /// Stale-while-revalidate: the expired entry answers at once; its refresh is under way.
    #[allow(clippy::too_many_arguments)]
    fn answer_stale_while_revalidate(&mut self, host: &mut dyn Host, c: &Cacheable, entry: &Entry,
                                     headers: &[(String, String)], body: &[u8], u: stale::StaleUse, now: u64) -> Flow {
        host.count(metric_names::STALE_WHILE_REVALIDATE, 1);
        let request = HitRequest { headers, body, id: &c.request_id };
        let status = names::cache_status_stale_while_revalidate(u.past_s());
        self.answer_entry(host, c, &request, entry, now, Some(status));
        Flow::Stop
    }

    /// Answers the request from `entry` (a hit, or a stale answer whose `Cache-Status` says so).
    fn answer_entry(&mut self, host: &mut dyn Host, c: &Cacheable, request: &HitRequest, entry: &Entry, now: u64,
                    cache_status: Option<String>) {
        self.state = State::Done;
        if c.grpc {
            let mut reply = hit::grpc_hit(entry, request, now);
            if let Some(status) = cache_status {
                hit::set_cache_status(&mut reply, status);
            }
            let mut h: Vec<(&str, &[u8])> = vec![(":status", b"200")];
            h.extend(reply.headers.iter().map(|(n, v)| (n.as_str(), v.as_bytes())));
            host.send_response_with_trailers(&h, &grpc::frame(&reply.body), &[("grpc-status", b"0")]);
            return;
        }
        let mut reply = hit::http_hit(entry, request, now);
        if let Some(status) = cache_status {
            hit::set_cache_status(&mut reply, status);
        }
        let h: Vec<(&str, &[u8])> = reply.headers.iter().map(|(n, v)| (n.as_str(), v.as_bytes())).collect();
        host.send_response(reply.status as u32, &h, &reply.body);
    }

    /// A request whose entry expired is forwarded (a fresh answer replaces the entry where it
    /// is); if stale-if-error may use the entry, it stands by.
    fn forward_expired(&mut self, host: &mut dyn Host, c: Cacheable, e: Entry, headers: &[(String, String)], now: u64)
        -> Flow {
        let if_error = stale::stale_use(&e, &c.policy, now).is_some_and(|u| u.if_error);
        if if_error {
            let fallback = Fallback { entry: e, policy: c.policy.clone(), headers: headers.to_vec(), id: c.request_id.clone(),
                                      grpc: c.grpc };
            self.fallback = Some(Box::new(fallback));
        }
        self.miss(host, c)
    }

    /// A request about to go upstream under a policy with `coalesce_timeout_ms`: true when an
    /// identical one is in flight and this one is parked to wait for it; false: it goes
    /// upstream (holding the key's lock when it was free). Requests that skip the lookup
    /// (`no-cache`) neither lead nor wait.
    fn joins_in_flight(&mut self, host: &mut dyn Host, c: &Cacheable, now: u64) -> bool {
        let timeout = c.policy.coalesce_timeout_ms;
        timeout > 0 && !c.refresh && self.lead_or_wait(host, c, now, now.saturating_add(timeout))
    }

    fn wait(&mut self, host: &mut dyn Host, c: Cacheable, headers: &[(String, String)]) -> Flow {
        host.count(metric_names::COALESCE_WAITS, 1);
        let deadline = c.request_ms.saturating_add(c.policy.coalesce_timeout_ms);
        self.state = State::Waiting(Box::new(Waiting { c, headers: headers.to_vec(), deadline }));
        Flow::Hold
    }

    /// True: parked until woken or `deadline`. False: go upstream, as the key's leader when the
    /// lock was free.
    fn lead_or_wait(&mut self, host: &mut dyn Host, c: &Cacheable, now: u64, deadline: u64) -> bool {
        let (parking, queue, id) = match &self.place {
            Some(p) => (p.parking.clone(), p.queue, p.id),
            None => return false,
        };
        let owner = ((queue as u64) << 32) | id as u64;
        match (LockTable { data: &*self.shared }).join(&c.key, owner, queue, now, c.policy.coalesce_timeout_ms) {
            Join::Lead(ticket) => {
                self.lock = Some(ticket);
                false
            }
            Join::Wait => {
                let wake = match host.waker() {
                    Some(w) => w,
                    None => return false,
                };
                match parking.park(queue, id, &c.key, deadline, wake) {
                    Ok(()) => true,
                    Err(_) => {
                        host.count(metric_names::COALESCE_OVERFLOW, 1);
                        false
                    }
                }
            }
            Join::Full => {
                host.count(metric_names::COALESCE_OVERFLOW, 1);
                false
            }
            Join::Busy | Join::Unavailable => false,
        }
    }

    /// The leader of this key is done: free the lock and wake every stream that waits on it.
    fn release(&mut self, release: Release) {
        if let Some(ticket) = self.lock.take() {
            let queues = (LockTable { data: &*self.shared }).release(&ticket);
            if let Some(p) = &self.place {
                p.parking.wake(&queues, &ticket.key, release);
            }
        }
    }

    /// A parked stream's event (its leader's outcome, or its timeout): answer from the entry,
    /// or go upstream; after a failure that may pass, lead or wait again within the deadline.
    pub fn on_scheduled(&mut self, host: &mut dyn Host, event: u64) {
        let release = park::release_of(event);
        if release.is_none() && matches!(self.state, State::Waiting(_)) {
            host.count(metric_names::COALESCE_TIMEOUTS, 1);
        }
        self.resume_waiter(host, release);
    }

    /// A waiter leaves the wait: `release` is its leader's outcome (None: timed out).
    fn resume_waiter(&mut self, host: &mut dyn Host, release: Option<Release>) {
        let Waiting { mut c, headers, deadline } = match std::mem::replace(&mut self.state, State::Done) {
            State::Waiting(w) => *w,
            other => {
                self.state = other;
                return;
            }
        };
        let now = host.now_ms();
        let cache = Cache { data: &*self.shared, limits: &self.config.limits };
        let mut out = Outcome::default();
        let woken = coalesce::wake(&cache, &mut c, release, now, deadline, &mut out, &mut |name| host.count(name, 1));
        self.record_outcome(host, &out);
        let (again, expired) = match woken {
            Woken::Answer { entry, cache_status } => {
                let request = HitRequest { headers: &headers, body: &[], id: &c.request_id };
                self.answer_hit(host, &c, &request, &entry, now, Some(cache_status));
                return;
            }
            Woken::Upstream { again, expired } => (again, expired),
        };
        if again && self.lead_or_wait(host, &c, now, deadline) {
            self.state = State::Waiting(Box::new(Waiting { c, headers, deadline }));
            return;
        }
        match expired {
            Some(entry) => self.forward_expired(host, c, entry, &headers, now),
            None => self.miss(host, c),
        };
        host.resume_request();
    }

    fn miss(&mut self, host: &mut dyn Host, c: Cacheable) -> Flow {
        host.count(metric_names::MISSES, 1);
        host.count(&metric_names::policy_metric(&c.policy.model_prefix, "misses"), 1);
        self.state = State::Miss(Box::new(c));
        Flow::Continue
    }

    fn not_stored(&mut self, host: &mut dyn Host, refresh: bool, why: NotStored, headers_open: bool) -> Flow {
        self.release(Release::not_stored(why));
        host.count(metric_names::not_stored_counter(why), 1);
        if headers_open {
            host.set_response_header(names::CACHE_STATUS, names::cache_status_not_stored(refresh, why).as_bytes());
        }
        self.state = State::Done;
        Flow::Continue
    }

    pub fn on_response_headers(&mut self, host: &mut dyn Host, end_of_stream: bool) -> Flow {
        if let Some(f) = self.fallback.take() {
            if f.grpc {
                if self.grpc_stale_if_error(host, &f) {
                    self.release(Release::OriginError);
                    self.state = State::Done;
                    return Flow::Hold;
                }
            } else if self.stale_if_error(host, &f) {
                // Its waiters may answer from the same expired entry.
                self.release(Release::OriginError);
                self.state = State::Done;
                return Flow::Stop;
            }
        }
        match std::mem::replace(&mut self.state, State::Done) {
            State::Bypass(why) => {
                host.set_response_header(names::CACHE_STATUS, names::cache_status_bypass(why.detail()).as_bytes());
                Flow::Continue
            }
            State::Miss(c) => self.start_collect(host, *c, end_of_stream),
            // Answered before the request body ended (Envoy or the origin): it passes as it is.
            State::Buffering { .. } => Flow::Continue,
            other => {
                self.state = other;
                Flow::Continue
            }
        }
    }

    /// The origin (or Envoy for it: unreachable, timed out) answered with an error and an
    /// expired entry may stand in for it: answer with the entry instead (a local reply in the
    /// response path goes straight to the client; the error is dropped). False: it passes.
    fn stale_if_error(&mut self, host: &mut dyn Host, f: &Fallback) -> bool {
        let (status, now, u) = match error_to_stand_in_for(host, f) {
            Some(found) => found,
            None => return false,
        };
        let request = HitRequest { headers: &f.headers, body: b"", id: &f.id };
        let mut reply = hit::http_hit(&f.entry, &request, now);
        hit::set_cache_status(&mut reply, names::cache_status_stale_if_error(u.past_s(), Some(status)));
        let h: Vec<(&str, &[u8])> = reply.headers.iter().map(|(n, v)| (n.as_str(), v.as_bytes())).collect();
        host.count(metric_names::STALE_IF_ERROR, 1);
        host.send_response(reply.status as u32, &h, &reply.body);
        true
    }

    /// As `stale_if_error`, for gRPC: a local reply to a gRPC request would be trailers-only
    /// (its body moved into grpc-message), so the answer is sent as a hit is, headers + framed
    /// message + `grpc-status: 0` trailer through the stream's encoder, from inside this hook
    /// (replacing the response headers, as Envoy's own local reply in the response path does);
    /// the origin's error stops here. Sent later instead (a scheduled event), the answer's body
    /// would resume the stopped error and end the stream before the trailer. True: answered.
    fn grpc_stale_if_error(&mut self, host: &mut dyn Host, f: &Fallback) -> bool {
        let (_, now, u) = match error_to_stand_in_for(host, f) {
            Some(found) => found,
            None => return false,
        };
        let request = HitRequest { headers: &f.headers, body: b"", id: &f.id };
        let mut reply = hit::grpc_hit(&f.entry, &request, now);
        hit::set_cache_status(&mut reply, names::cache_status_stale_if_error(u.past_s(), None));
        let framed = grpc::frame(&reply.body);
        host.count(metric_names::STALE_IF_ERROR, 1);
        let mut h: Vec<(&str, &[u8])> = vec![(":status", b"200")];
        h.extend(reply.headers.iter().map(|(n, v)| (n.as_str(), v.as_bytes())));
        host.send_response_with_trailers(&h, &framed, &[("grpc-status", b"0")]);
        true
    }

    fn start_collect(&mut self, host: &mut dyn Host, c: Cacheable, end_of_stream: bool) -> Flow {
        let response = host.response_headers();
        let (status, plan) = response::begin_collect(&c, &response, end_of_stream, host.now_ms(),
                                                     self.config.limits.max_entry_bytes, self.config.hold_headers);
        let headers = response.pairs;
        match plan {
            Collect::Skip { why, release } => {
                self.release(release);
                self.not_stored(host, c.refresh, why, true)
            }
            Collect::StoreNow(ttl) => self.finish_store(host, c, ttl, status, headers, Vec::new(), None, Open::Headers),
            Collect::Start { ttl, limit, held, hasher, .. } => {
                if !held {
                    // The answer streams: say what is known now; it is copied and stored at its end.
                    host.set_response_header(names::CACHE_STATUS, names::cache_status_forwarded(c.refresh).as_bytes());
                }
                let k = Collecting { c, ttl, status, headers, copy: Vec::new(), seen: 0, held, limit, hasher };
                self.state = State::Collect(Box::new(k));
                if held {
                    Flow::Hold
                } else {
                    Flow::Continue
                }
            }
        }
    }

    /// The answer's body passes (or is held while small); it is kept for the store up to
    /// `max_entry_bytes`.
    pub fn on_response_body(&mut self, host: &mut dyn Host, end_of_stream: bool) -> Flow {
        let mut k = match std::mem::replace(&mut self.state, State::Done) {
            State::Collect(k) => k,
            other => {
                self.state = other;
                return Flow::Continue;
            }
        };
        {
            let Collecting { copy, seen, held, limit, hasher, .. } = &mut *k;
            let mut arrived = 0;
            host.received_body(true, &mut |chunk| {
                arrived += chunk.len();
                if *seen + arrived <= *limit {
                    if let Some(h) = hasher.as_mut() {
                        h.update(chunk);
                    }
                    if !*held {
                        copy.extend_from_slice(chunk);
                    }
                }
            });
            *seen += arrived;
        }
        if k.seen > k.limit {
            return self.not_stored(host, k.c.refresh, NotStored::TooBig, k.held);
        }
        if end_of_stream {
            if k.c.grpc {
                // A gRPC answer without trailers has no grpc-status: not a success we can store.
                return self.not_stored(host, k.c.refresh, NotStored::GrpcStatus, k.held);
            }
            let open = if k.held { Open::Headers } else { Open::Closed };
            let body = self.take_body(host, &mut k);
            let Collecting { c, ttl, status, headers, hasher, .. } = *k;
            return self.finish_store(host, c, ttl, status, headers, body, hasher, open);
        }
        if k.held && k.seen <= response::HOLD_BYTES {
            self.state = State::Collect(k);
            return Flow::Hold;
        }
        if k.held {
            // Grown past what a miss holds back: copy what Envoy held, let it stream from here.
            host.set_response_header(names::CACHE_STATUS, names::cache_status_forwarded(k.c.refresh).as_bytes());
            k.copy = self.take_body(host, &mut k);
            k.held = false;
        }
        self.state = State::Collect(k);
        Flow::Continue
    }

    /// The answer so far: Envoy's held buffer while held, the copy once it streamed.
    fn take_body(&self, host: &mut dyn Host, k: &mut Collecting) -> Vec<u8> {
        if !k.held {
            return std::mem::take(&mut k.copy);
        }
        let mut body = Vec::with_capacity(k.seen);
        host.whole_body(true, &mut |chunk| body.extend_from_slice(chunk));
        body
    }

    pub fn on_response_trailers(&mut self, host: &mut dyn Host) -> Flow {
        match std::mem::replace(&mut self.state, State::Done) {
            State::Collect(mut k) => {
                let open = if k.held { Open::Headers } else { Open::Trailers };
                if k.c.grpc && headermap::header(&host.response_trailers().pairs, "grpc-status") != Some("0") {
                    return self.not_stored(host, k.c.refresh, NotStored::GrpcStatus, k.held);
                }
                let body = self.take_body(host, &mut k);
                let Collecting { c, ttl, status, headers, hasher, .. } = *k;
                self.finish_store(host, c, ttl, status, headers, body, hasher, open)
            }
            other => {
                self.state = other;
                Flow::Continue
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn finish_store(&mut self, host: &mut dyn Host, c: Cacheable, ttl: Ttl, status: u16, headers: Vec<(String, String)>,
                    body: Vec<u8>, hashed: Option<AnswerHasher>, open: Open) -> Flow {
        let cache = Cache { data: &*self.shared, limits: &self.config.limits };
        let refresh = c.refresh;
        let mut out = Outcome::default();
        let result = insert::store_streamed(&cache, &c, &headers, status, body, ttl, hashed, &mut out);
        self.record_outcome(host, &out);
        match result {
            Ok(stored) => {
                host.count(metric_names::STORES, 1);
                self.release(Release::Stored);
                self.record_gauges(host);
                self.state = State::Done;
                match open {
                    Open::Closed => {}
                    Open::Trailers => host.set_response_trailer(names::HASH_HEADER, stored.entry.response_hash.as_bytes()),
                    Open::Headers => {
                        host.set_response_header(names::HASH_HEADER, stored.entry.response_hash.as_bytes());
                        host.set_response_header(names::CACHE_STATUS, names::cache_status_stored(refresh).as_bytes());
                        if let Some(etag) = &stored.added_etag {
                            host.set_response_header("etag", etag.as_bytes());
                        }
                    }
                }
                Flow::Continue
            }
            Err(why) => self.not_stored(host, refresh, why, open == Open::Headers),
        }
    }

    /// After a panic in a hook: fail open for the rest of the stream.
    pub fn fail_open(&mut self) {
        self.state = State::Done;
    }
}

/// The origin (or Envoy for it) answered with an error that `f`'s expired entry may stand in
/// for: the error's status, the time and how the entry is used. None: the answer passes.
fn error_to_stand_in_for(host: &mut dyn Host, f: &Fallback) -> Option<(u16, u64, stale::StaleUse)> {
    let response = host.response_headers();
    let status: u16 = headermap::header(&response.pairs, ":status").and_then(|s| s.parse().ok()).unwrap_or(0);
    if !stale::is_origin_error(status, headermap::header(&response.pairs, "grpc-status")) {
        return None;
    }
    let now = host.now_ms();
    stale::stale_use(&f.entry, &f.policy, now).filter(|u| u.if_error).map(|u| (status, now, u))
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshcache_core::config::parse_plugin_config;
    use std::cell::{Cell, RefCell};

    /// One exchange's worth of Envoy: request and response headers, the body chunks of the
    /// current callback, what Envoy holds back, and what the filter sent or set.
    #[derive(Default)]
    struct Fake {
        req: Vec<(String, String)>,
        resp: Vec<(String, String)>,
        trailers: Vec<(String, String)>,
        held: Vec<Vec<u8>>,
        received: Vec<Vec<u8>>,
        sent: RefCell<Option<(u32, Vec<(String, String)>, Vec<u8>)>>,
        sent_trailers: Vec<(String, String)>,
        now: Cell<u64>,
        counts: std::collections::HashMap<String, u64>,
        peer: Option<String>,
        gauges: std::collections::HashMap<String, u64>,
        /// Events delivered to this stream's wakers (coalescing).
        woken: Arc<std::sync::Mutex<Vec<u64>>>,
        resumed: bool,
        /// Whether a background refresh can be sent, and the ones sent.
        refresh_ok: bool,
        refreshes: Vec<Cacheable>,
        routes_cleared: u32,
        logged: Vec<String>,
    }

    struct FakeWake(Arc<std::sync::Mutex<Vec<u64>>>);

    impl Wake for FakeWake {
        fn wake(&self, event: u64) {
            self.0.lock().unwrap().push(event);
        }
    }

    fn get(h: &[(String, String)], name: &str) -> Option<String> {
        h.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone())
    }

    fn set(h: &mut Vec<(String, String)>, name: &str, value: &[u8]) {
        h.retain(|(n, _)| n != name);
        h.push((name.to_string(), String::from_utf8(value.to_vec()).unwrap()));
    }

    impl Host for Fake {
        fn request_headers(&self) -> Headers {
            Headers { pairs: self.req.clone(), not_utf8: Vec::new() }
        }
        fn response_headers(&self) -> Headers {
            Headers { pairs: self.resp.clone(), not_utf8: Vec::new() }
        }
        fn remove_request_header(&mut self, name: &str) {
            self.req.retain(|(n, _)| n != name);
        }
        fn set_request_header(&mut self, name: &str, value: &[u8]) {
            set(&mut self.req, name, value);
        }
        fn clear_route_cache(&mut self) {
            self.routes_cleared += 1;
        }
        fn set_response_header(&mut self, name: &str, value: &[u8]) {
            set(&mut self.resp, name, value);
        }
        fn set_response_trailer(&mut self, name: &str, value: &[u8]) {
            set(&mut self.trailers, name, value);
        }
        fn received_body(&self, _response: bool, f: &mut dyn FnMut(&[u8])) {
            self.received.iter().for_each(|c| f(c));
        }
        fn whole_body(&self, _response: bool, f: &mut dyn FnMut(&[u8])) {
            self.held.iter().chain(self.received.iter()).for_each(|c| f(c));
        }
        fn send_response(&mut self, status: u32, headers: &[(&str, &[u8])], body: &[u8]) {
            let h = headers.iter().map(|(n, v)| (n.to_string(), String::from_utf8(v.to_vec()).unwrap())).collect();
            *self.sent.borrow_mut() = Some((status, h, body.to_vec()));
        }
        fn send_response_with_trailers(&mut self, headers: &[(&str, &[u8])], body: &[u8], trailers: &[(&str, &[u8])]) {
            let status = headers.iter().find(|(n, _)| *n == ":status").map_or(0, |(_, v)| std::str::from_utf8(v).unwrap().parse().unwrap());
            let rest: Vec<(&str, &[u8])> = headers.iter().filter(|(n, _)| *n != ":status").cloned().collect();
            self.send_response(status, &rest, body);
            self.sent_trailers = trailers.iter().map(|(n, v)| (n.to_string(), String::from_utf8(v.to_vec()).unwrap())).collect();
        }
        fn response_trailers(&self) -> Headers {
            Headers { pairs: self.trailers.clone(), not_utf8: Vec::new() }
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
        fn set_gauge(&mut self, name: &str, value: u64) {
            self.gauges.insert(name.to_string(), value);
        }
        fn log_debug(&mut self, line: &dyn Fn() -> String) {
            self.logged.push(line());
        }
        fn waker(&mut self) -> Option<Box<dyn Wake>> {
            Some(Box::new(FakeWake(self.woken.clone())))
        }
        fn resume_request(&mut self) {
            self.resumed = true;
        }
        fn refresh(&mut self, c: &Cacheable, _headers: &[(String, String)], _body: &[u8]) -> bool {
            if self.refresh_ok {
                self.refreshes.push(c.clone());
            }
            self.refresh_ok
        }
    }

    struct Env {
        config: Arc<Config>,
        shared: Arc<Shared>,
        now: u64,
    }

    fn env(json: &str) -> Env {
        let config = Arc::new(parse_plugin_config(json.as_bytes()).unwrap());
        let shared = Arc::new(Shared::default());
        Cache { data: &*shared, limits: &config.limits }.reconcile(&mut Outcome::default());
        Env { config, shared, now: 1_700_000_000_000 }
    }

    const INFER: &str = "/v2/models/m/infer";
    const BODY: &[u8] = br#"{"id":"a","inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1]}]}"#;

    /// Drives one exchange: request headers, the request body in `chunks`, and (unless answered
    /// locally) the origin's 200 answer in `answer` chunks with `extra` response headers.
    fn exchange(e: &Env, path: &str, req_headers: &[(&str, &str)], chunks: &[&[u8]], answer: &[&[u8]],
                extra: &[(&str, &str)]) -> Fake {
        let mut h = Fake::default();
        h.now.set(e.now);
        h.req = [(":method", "POST"), (":path", path), ("content-type", "application/json")]
            .iter()
            .chain(req_headers)
            .map(|(n, v)| (n.to_string(), v.to_string()))
            .collect();
        let mut s = Stream::new(e.config.clone(), e.shared.clone());
        let mut flow = s.on_request_headers(&mut h, chunks.is_empty());
        for (i, c) in chunks.iter().enumerate() {
            if flow == Flow::Hold {
                let r = std::mem::take(&mut h.received);
                h.held.extend(r);
            }
            h.received = vec![c.to_vec()];
            flow = s.on_request_body(&mut h, i + 1 == chunks.len());
        }
        if h.sent.borrow().is_some() {
            return h;
        }
        h.held.clear();
        h.received.clear();
        let len: usize = answer.iter().map(|c| c.len()).sum();
        h.resp = [(":status", "200"), ("content-type", "application/json"), ("content-length", &len.to_string())]
            .iter()
            .chain(extra)
            .map(|(n, v)| (n.to_string(), v.to_string()))
            .collect();
        let mut flow = s.on_response_headers(&mut h, answer.is_empty());
        for (i, c) in answer.iter().enumerate() {
            if flow == Flow::Hold {
                let r = std::mem::take(&mut h.received);
                h.held.extend(r);
            }
            h.received = vec![c.to_vec()];
            flow = s.on_response_body(&mut h, i + 1 == answer.len());
        }
        h
    }

    fn status(h: &Fake) -> String {
        match &*h.sent.borrow() {
            Some((_, headers, _)) => get(headers, "cache-status").unwrap_or_default(),
            None => get(&h.resp, "cache-status").unwrap_or_default(),
        }
    }

    const ANSWER: &[u8] = br#"{"id":"a","outputs":[{"name":"y","data":[2]}]}"#;

    #[test]
    fn a_miss_is_stored_with_hash_and_etag_then_hits_answer_with_age() {
        let mut e = env(r#"{"policies": [{"model_prefix": "m", "ttl_s": 60}]}"#);
        let miss = exchange(&e, INFER, &[], &[BODY], &[ANSWER], &[]);
        assert_eq!(status(&miss), "meshcache; fwd=miss; stored");
        assert_eq!((miss.counts["meshcache.misses"], miss.counts["meshcache.policy.m.misses"]), (1, 1));
        assert_eq!(miss.counts["meshcache.stores"], 1);
        assert_eq!(miss.gauges["meshcache.entries"], 1);
        assert_eq!(miss.gauges["meshcache.policy.m.entries"], 1);
        assert_eq!(miss.gauges["meshcache.bytes"], miss.gauges["meshcache.policy.m.bytes"]);
        assert!(miss.gauges["meshcache.bytes"] > ANSWER.len() as u64);
        let hash = get(&miss.resp, "x-response-hash").unwrap();
        assert_eq!(hash.len(), "xxh3-128:".len() + 32);
        assert_eq!(get(&miss.resp, "etag").unwrap(), format!("\"{}\"", hash));

        e.now += 2_500;
        let hit = exchange(&e, INFER, &[], &[&BODY[..9], &BODY[9..]], &[], &[]);
        let sent = hit.sent.borrow().clone().unwrap();
        assert_eq!((hit.counts["meshcache.hits"], hit.counts["meshcache.policy.m.hits"]), (1, 1));
        assert_eq!(sent.0, 200);
        assert_eq!(sent.2, ANSWER, "the caller's request id goes back in");
        assert_eq!(get(&sent.1, "cache-status").unwrap(), "meshcache; hit; ttl=58");
        assert_eq!(get(&sent.1, "age").unwrap(), "2");
        assert_eq!(get(&sent.1, "x-response-hash").unwrap(), hash);
        assert_eq!(get(&sent.1, "etag").unwrap(), format!("\"{}\"", hash));

        // Another request id: the same entry, the caller's id in the answer.
        let b = BODY.replace_id("b");
        let other = exchange(&e, INFER, &[], &[&b[..]], &[], &[]);
        let sent = other.sent.borrow().clone().unwrap();
        assert_eq!(sent.2, ANSWER.replace_id("b"));

        // If-None-Match with the ETag: 304, no body.
        let inm = exchange(&e, INFER, &[("if-none-match", &format!("\"{}\"", hash))], &[BODY], &[], &[]);
        assert_eq!(inm.sent.borrow().as_ref().unwrap().0, 304);
    }

    /// A request body that ends with trailers (HTTP/2): no body hook says end of stream.
    fn request_with_trailers(e: &Env, s: &mut Stream, chunks: &[&[u8]]) -> (Fake, Flow) {
        let mut h = Fake::default();
        h.now.set(e.now);
        h.req = [(":method", "POST"), (":path", INFER), ("content-type", "application/json")]
            .iter()
            .map(|(n, v)| (n.to_string(), v.to_string()))
            .collect();
        assert_eq!(s.on_request_headers(&mut h, false), Flow::Hold);
        for c in chunks {
            let r = std::mem::take(&mut h.received);
            h.held.extend(r);
            h.received = vec![c.to_vec()];
            assert_eq!(s.on_request_body(&mut h, false), Flow::Hold, "still buffering");
        }
        // In the trailers hook the last chunk is part of the held body.
        let r = std::mem::take(&mut h.received);
        h.held.extend(r);
        let flow = s.on_request_trailers(&mut h);
        (h, flow)
    }

    #[test]
    fn a_request_ending_with_trailers_is_decided_at_the_trailers() {
        let e = env(r#"{"policies": [{"model_prefix": "m", "ttl_s": 60}]}"#);
        let mut s = Stream::new(e.config.clone(), e.shared.clone());
        let (mut h, flow) = request_with_trailers(&e, &mut s, &[&BODY[..9], &BODY[9..]]);
        assert_eq!(flow, Flow::Continue, "a miss goes upstream");
        h.held.clear();
        h.resp = [(":status", "200"), ("content-type", "application/json"), ("content-length", &ANSWER.len().to_string())]
            .iter()
            .map(|(n, v)| (n.to_string(), v.to_string()))
            .collect();
        assert_eq!(s.on_response_headers(&mut h, false), Flow::Hold);
        h.received = vec![ANSWER.to_vec()];
        s.on_response_body(&mut h, true);
        assert_eq!(status(&h), "meshcache; fwd=miss; stored");

        let mut s = Stream::new(e.config.clone(), e.shared.clone());
        let (hit, flow) = request_with_trailers(&e, &mut s, &[BODY]);
        assert_eq!(flow, Flow::Stop, "answered locally");
        assert_eq!(hit.sent.borrow().as_ref().unwrap().2, ANSWER);
        assert!(status(&hit).starts_with("meshcache; hit"), "{}", status(&hit));
        // A stream not buffering (ignored or bypassed) lets its trailers through.
        let mut other = Stream::new(e.config.clone(), e.shared.clone());
        assert_eq!(other.on_request_trailers(&mut Fake::default()), Flow::Continue);
    }

    trait ReplaceId {
        fn replace_id(&self, id: &str) -> Vec<u8>;
    }

    impl ReplaceId for [u8] {
        fn replace_id(&self, id: &str) -> Vec<u8> {
            String::from_utf8(self.to_vec()).unwrap().replacen("\"a\"", &format!("\"{}\"", id), 1).into_bytes()
        }
    }

    #[test]
    fn bypasses_say_why_and_ignored_requests_get_no_header() {
        let e = env(r#"{"policies": [{"model_prefix": "m", "ttl_s": 60}]}"#);
        let no_policy = exchange(&e, "/v2/models/zz/infer", &[], &[BODY], &[ANSWER], &[]);
        assert_eq!(status(&no_policy), "meshcache; fwd=bypass; detail=no-policy");
        assert_eq!(no_policy.logged, vec!["meshcache: bypass detail=no-policy model=zz path=/v2/models/zz/infer".to_string()]);
        assert_eq!(no_policy.counts.get("meshcache.bypass.no-policy"), Some(&1));
        assert_eq!(status(&exchange(&e, INFER, &[("cache-control", "no-store")], &[BODY], &[ANSWER], &[])),
                   "meshcache; fwd=bypass; detail=no-store");
        assert_eq!(status(&exchange(&e, INFER, &[], &[b"{not json"], &[ANSWER], &[])),
                   "meshcache; fwd=bypass; detail=unparsable");
        assert_eq!(status(&exchange(&e, "/healthz", &[], &[BODY], &[ANSWER], &[])), "");
    }

    #[test]
    fn answers_the_policy_or_origin_refuses_are_not_stored() {
        let e = env(r#"{"policies": [{"model_prefix": "m", "ttl_s": 60}], "max_entry_bytes": 1024}"#);
        let no_store = exchange(&e, INFER, &[], &[BODY], &[ANSWER], &[("cache-control", "no-store")]);
        assert_eq!(status(&no_store), "meshcache; fwd=miss; detail=no-store");
        assert!(get(&no_store.resp, "x-response-hash").is_none());
        let big = vec![b' '; 2000];
        assert_eq!(status(&exchange(&e, INFER, &[], &[BODY], &[&big], &[])), "meshcache; fwd=miss; detail=too-big");
        let again = exchange(&e, INFER, &[], &[BODY], &[ANSWER], &[]);
        assert_eq!(status(&again), "meshcache; fwd=miss; stored", "nothing was stored before");
    }

    #[test]
    fn a_large_answer_streams_and_is_still_stored_whole() {
        let e = env(r#"{"policies": [{"model_prefix": "m", "ttl_s": 60}], "max_entry_bytes": 2000000}"#);
        let part = vec![b' '; response::HOLD_BYTES / 2 + 1];
        let mut whole = ANSWER[..ANSWER.len() - 1].to_vec();
        let chunks: Vec<Vec<u8>> = vec![whole.clone(), part.clone(), part.clone(), part.clone(), b"}".to_vec()];
        let refs: Vec<&[u8]> = chunks.iter().map(|c| &c[..]).collect();
        let miss = exchange(&e, INFER, &[], &[BODY], &refs, &[]);
        // Held until it outgrew HOLD_BYTES, then streamed: the headers said so, the store happened.
        assert_eq!(status(&miss), "meshcache; fwd=miss");
        whole = chunks.concat();
        let hit = exchange(&e, INFER, &[], &[BODY], &[], &[]);
        let sent = hit.sent.borrow().clone().unwrap();
        assert_eq!(sent.2, whole);
        assert_eq!(get(&sent.1, "x-response-hash").unwrap().len(), "xxh3-128:".len() + 32);
    }

    #[test]
    fn an_expired_entry_is_replaced_and_a_lower_policy_ttl_reaches_stored_entries() {
        let mut e = env(r#"{"policies": [{"model_prefix": "m", "ttl_s": 60}]}"#);
        exchange(&e, INFER, &[], &[BODY], &[ANSWER], &[]);
        e.now += 61_000;
        let expired = exchange(&e, INFER, &[], &[BODY], &[ANSWER], &[]);
        assert_eq!(status(&expired), "meshcache; fwd=miss; stored");
        assert_eq!(expired.counts["meshcache.evictions"], 1, "the expired entry was freed at lookup");
        let hit = exchange(&e, INFER, &[], &[BODY], &[], &[]);
        assert!(status(&hit).starts_with("meshcache; hit"));
        let lower = Env { config: Arc::new(parse_plugin_config(br#"{"policies": [{"model_prefix": "m", "ttl_s": 0}]}"#).unwrap()),
                          shared: e.shared.clone(), now: e.now + 1 };
        assert!(!status(&exchange(&lower, INFER, &[], &[BODY], &[ANSWER], &[])).contains("hit"));
    }

    #[test]
    fn a_purge_generation_is_a_new_key() {
        let e = env(r#"{"policies": [{"model_prefix": "m", "ttl_s": 60, "generation": 1}]}"#);
        exchange(&e, INFER, &[], &[BODY], &[ANSWER], &[]);
        assert!(status(&exchange(&e, INFER, &[], &[BODY], &[], &[])).contains("hit"));
        let purged = Env { config: Arc::new(parse_plugin_config(br#"{"policies": [{"model_prefix": "m", "ttl_s": 60, "generation": 2}]}"#).unwrap()),
                           shared: e.shared.clone(), now: e.now };
        assert_eq!(status(&exchange(&purged, INFER, &[], &[BODY], &[ANSWER], &[])), "meshcache; fwd=miss; stored");
    }
    fn framed(message: &[u8]) -> Vec<u8> {
        let mut f = vec![0u8];
        f.extend_from_slice(&(message.len() as u32).to_be_bytes());
        f.extend_from_slice(message);
        f
    }

    /// A unary ModelInfer through the stream: request headers and framed body, then (unless
    /// answered) the origin's headers, framed message and `grpc_status` trailer.
    fn grpc_exchange(e: &Env, grpc_status: &str) -> (Fake, Stream) {
        let mut h = Fake::default();
        h.now.set(e.now);
        h.req = [(":method", "POST"), (":path", "/inference.GRPCInferenceService/ModelInfer"),
                 ("content-type", "application/grpc")]
            .iter()
            .map(|(n, v)| (n.to_string(), v.to_string()))
            .collect();
        let mut s = Stream::new(e.config.clone(), e.shared.clone());
        assert_eq!(s.on_request_headers(&mut h, false), Flow::Hold);
        h.received = vec![framed(b"\x0a\x01m")]; // ModelInferRequest { model_name: "m" }
        if s.on_request_body(&mut h, true) == Flow::Stop {
            return (h, s);
        }
        h.received.clear();
        h.resp = vec![(":status".into(), "200".into()), ("content-type".into(), "application/grpc".into())];
        assert_eq!(s.on_response_headers(&mut h, false), Flow::Hold, "a unary gRPC answer is held");
        h.received = vec![framed(b"\x0a\x01m\x12\x011")];
        assert_eq!(s.on_response_body(&mut h, false), Flow::Hold);
        h.held = std::mem::take(&mut h.received);
        h.trailers = vec![("grpc-status".into(), grpc_status.into())];
        s.on_response_trailers(&mut h);
        (h, s)
    }

    #[test]
    fn grpc_misses_store_on_a_zero_status_and_hits_answer_in_one_pass_with_trailers() {
        let e = env(r#"{"policies": [{"model_prefix": "m", "ttl_s": 60}]}"#);
        let (failed, _) = grpc_exchange(&e, "13");
        assert_eq!(get(&failed.resp, "cache-status").unwrap(), "meshcache; fwd=miss; detail=grpc-status");
        let (miss, _) = grpc_exchange(&e, "0");
        assert_eq!(get(&miss.resp, "cache-status").unwrap(), "meshcache; fwd=miss; stored");
        let hash = get(&miss.resp, "x-response-hash").unwrap();
        let (hit, _) = grpc_exchange(&e, "0");
        let sent = hit.sent.borrow().clone().expect("answered from the store");
        assert_eq!(sent.0, 200);
        assert_eq!(sent.2, framed(b"\x0a\x01m\x12\x011"), "the stored message, framed");
        assert_eq!(get(&sent.1, "content-type").unwrap(), "application/grpc");
        assert_eq!(get(&sent.1, "x-response-hash").unwrap(), hash);
        assert!(get(&sent.1, "cache-status").unwrap().starts_with("meshcache; hit"));
        assert_eq!(hit.sent_trailers, vec![("grpc-status".to_string(), "0".to_string())]);
    }
    #[test]
    fn an_origin_error_is_answered_with_the_expired_entry_within_stale_if_error() {
        let mut e = env(r#"{"policies": [{"model_prefix": "m", "ttl_s": 1, "stale_if_error_s": 30}]}"#);
        exchange(&e, INFER, &[], &[BODY], &[ANSWER], &[]);
        e.now += 3_000;
        let mut h = Fake::default();
        h.now.set(e.now);
        h.req = vec![(":method".into(), "POST".into()), (":path".into(), INFER.into())];
        let mut s = Stream::new(e.config.clone(), e.shared.clone());
        s.on_request_headers(&mut h, false);
        h.received = vec![BODY.to_vec()];
        assert_eq!(s.on_request_body(&mut h, true), Flow::Continue, "expired: forwarded");
        h.resp = vec![(":status".into(), "503".into())];
        assert_eq!(s.on_response_headers(&mut h, false), Flow::Stop);
        let sent = h.sent.borrow().clone().expect("the stale answer");
        assert_eq!(sent.2, ANSWER);
        assert_eq!(get(&sent.1, "cache-status").unwrap(),
                   "meshcache; hit; stale; ttl=-2; fwd=stale; fwd-status=503; detail=stale-if-error");
        assert_eq!(h.counts["meshcache.stale_if_error"], 1);
    }
    /// `exchange` with the peer's identity set.
    fn exchange_as(e: &Env, peer: Option<&str>) -> Fake {
        let mut h = Fake { peer: peer.map(str::to_string), ..Fake::default() };
        h.now.set(e.now);
        h.req = vec![(":method".into(), "POST".into()), (":path".into(), INFER.into())];
        let mut s = Stream::new(e.config.clone(), e.shared.clone());
        s.on_request_headers(&mut h, false);
        h.received = vec![BODY.to_vec()];
        if s.on_request_body(&mut h, true) == Flow::Stop {
            return h;
        }
        h.received = vec![ANSWER.to_vec()];
        h.resp = vec![(":status".into(), "200".into()), ("content-length".into(), ANSWER.len().to_string())];
        s.on_response_headers(&mut h, false);
        s.on_response_body(&mut h, true);
        h
    }

    #[test]
    fn a_principal_scoped_policy_keeps_each_peers_entries_apart() {
        let e = env(r#"{"policies": [{"model_prefix": "m", "ttl_s": 60, "scope": "principal"}]}"#);
        assert_eq!(status(&exchange_as(&e, Some("spiffe://a"))), "meshcache; fwd=miss; stored");
        assert!(status(&exchange_as(&e, Some("spiffe://a"))).starts_with("meshcache; hit"));
        assert_eq!(status(&exchange_as(&e, Some("spiffe://b"))), "meshcache; fwd=miss; stored", "another peer, another entry");
        assert_eq!(status(&exchange_as(&e, None)), "meshcache; fwd=bypass; detail=no-identity");
    }

    // ------------------------------------------------------------ request coalescing

    const COALESCING: &str = r#"{"policies": [{"model_prefix": "m", "ttl_s": 60, "coalesce_timeout_ms": 1000}]}"#;

    fn coalescing_env(json: &str) -> (Env, Arc<Parking>) {
        let e = env(json);
        LockTable { data: &*e.shared }.create_slots();
        (e, Arc::new(Parking::default()))
    }

    /// A request through its request hooks on worker `queue` as stream `id`.
    fn arrive(e: &Env, parking: &Arc<Parking>, queue: u32, id: u32) -> (Stream, Fake, Flow) {
        let mut h = Fake::default();
        h.now.set(e.now);
        h.req = vec![(":method".into(), "POST".into()), (":path".into(), INFER.into())];
        let place = Place { parking: parking.clone(), queue, id };
        let mut s = Stream::new(e.config.clone(), e.shared.clone()).coalescing(place);
        assert_eq!(s.on_request_headers(&mut h, false), Flow::Hold);
        h.received = vec![BODY.to_vec()];
        let flow = s.on_request_body(&mut h, true);
        (s, h, flow)
    }

    /// The origin's answer through the response hooks.
    fn answer_with(s: &mut Stream, h: &mut Fake, status: &str, body: &[u8]) {
        h.resp = vec![(":status".into(), status.into()), ("content-length".into(), body.len().to_string())];
        h.received.clear();
        if s.on_response_headers(h, false) == Flow::Stop {
            return;
        }
        h.received = vec![body.to_vec()];
        s.on_response_body(h, true);
    }

    /// Delivers the events the stream's waker got (as Envoy's scheduler would, on its worker).
    fn deliver(s: &mut Stream, h: &mut Fake) -> Vec<u64> {
        let events = std::mem::take(&mut *h.woken.lock().unwrap());
        for ev in &events {
            s.on_scheduled(h, *ev);
        }
        events
    }

    fn sent_status(h: &Fake) -> String {
        get(&h.sent.borrow().as_ref().expect("answered").1, "cache-status").unwrap()
    }

    #[test]
    fn waiters_on_two_workers_are_woken_by_the_leaders_store_and_answered_from_its_entry() {
        let (e, parking) = coalescing_env(COALESCING);
        let (mut leader, mut lh, flow) = arrive(&e, &parking, 0, 1);
        assert_eq!(flow, Flow::Continue, "the first miss leads: upstream");
        let (mut w1, mut h1, f1) = arrive(&e, &parking, 0, 2);
        let (mut w2, mut h2, f2) = arrive(&e, &parking, 1, 3);
        assert_eq!((f1, f2), (Flow::Hold, Flow::Hold), "identical misses park");
        assert_eq!(parking.parked(), 2);
        assert_eq!(h1.counts["meshcache.coalesce.waits"], 1);
        assert!(h1.woken.lock().unwrap().is_empty());
        answer_with(&mut leader, &mut lh, "200", ANSWER);
        assert_eq!(status(&lh), "meshcache; fwd=miss; stored");
        assert_eq!(deliver(&mut w1, &mut h1), vec![park::event_of(Release::Stored)]);
        assert_eq!(deliver(&mut w2, &mut h2).len(), 1);
        for h in [&h1, &h2] {
            assert_eq!(sent_status(h), names::CACHE_STATUS_COLLAPSED);
            assert_eq!(h.sent.borrow().as_ref().unwrap().2, ANSWER);
            assert_eq!(h.counts["meshcache.coalesce.served"], 1);
            assert!(!h.resumed, "answered, not sent upstream");
        }
        assert_eq!(parking.parked(), 0);
    }

    #[test]
    fn a_failed_leader_hands_over_to_one_waiter_and_the_rest_wait_for_it() {
        let (e, parking) = coalescing_env(COALESCING);
        let (mut leader, mut lh, _) = arrive(&e, &parking, 0, 1);
        let (mut w1, mut h1, _) = arrive(&e, &parking, 0, 2);
        let (mut w2, mut h2, _) = arrive(&e, &parking, 1, 3);
        answer_with(&mut leader, &mut lh, "500", b"boom");
        assert_eq!(deliver(&mut w1, &mut h1), vec![park::event_of(Release::OriginError)], "a 500: retried");
        assert!(h1.resumed, "the first woken waiter leads anew: upstream");
        assert_eq!(h1.counts["meshcache.coalesce.released"], 1);
        assert_eq!(deliver(&mut w2, &mut h2).len(), 1);
        assert!(!h2.resumed && h2.sent.borrow().is_none(), "the second waits again, for the new leader");
        assert_eq!(parking.parked(), 1);
        answer_with(&mut w1, &mut h1, "200", ANSWER);
        assert_eq!(status(&h1), "meshcache; fwd=miss; stored");
        deliver(&mut w2, &mut h2);
        assert_eq!(sent_status(&h2), names::CACHE_STATUS_COLLAPSED);
    }

    #[test]
    fn an_uncacheable_answer_sends_each_waiter_upstream_and_a_vanished_leader_hands_over() {
        let (e, parking) = coalescing_env(COALESCING);
        let (mut leader, mut lh, _) = arrive(&e, &parking, 0, 1);
        let (mut w1, mut h1, _) = arrive(&e, &parking, 0, 2);
        lh.resp = vec![(":status".into(), "404".into())];
        leader.on_response_headers(&mut lh, true);
        deliver(&mut w1, &mut h1);
        assert!(h1.resumed, "404 is not retried: the waiter goes upstream itself");
        assert_eq!(parking.parked(), 0);

        let (leader, _, _) = arrive(&e, &parking, 0, 4);
        let (mut w2, mut h2, _) = arrive(&e, &parking, 1, 5);
        drop(leader); // the client went away before the answer
        assert_eq!(deliver(&mut w2, &mut h2), vec![park::event_of(Release::Retry)]);
        assert!(h2.resumed, "it leads now");
    }

    #[test]
    fn a_destroyed_waiter_is_never_woken_and_late_waiters_time_out_upstream() {
        let (e, parking) = coalescing_env(COALESCING);
        let (mut leader, mut lh, _) = arrive(&e, &parking, 0, 1);
        let (gone, gh, _) = arrive(&e, &parking, 0, 2);
        let (mut late, mut hl, _) = arrive(&e, &parking, 1, 3);
        drop(gone);
        assert_eq!(parking.parked(), 1, "the destroyed stream left its table");
        parking.expire(e.now + 999);
        assert!(hl.woken.lock().unwrap().is_empty());
        parking.expire(e.now + 1000);
        assert_eq!(deliver(&mut late, &mut hl), vec![park::EVENT_TIMEOUT]);
        assert!(hl.resumed);
        assert_eq!(hl.counts["meshcache.coalesce.timeouts"], 1);
        answer_with(&mut leader, &mut lh, "200", ANSWER);
        assert!(gh.woken.lock().unwrap().is_empty(), "no wake for a stream that is gone");
    }

    #[test]
    fn waiters_per_key_and_worker_are_bounded_the_rest_go_upstream_counted() {
        let (e, parking) = coalescing_env(COALESCING);
        let (_leader, _, _) = arrive(&e, &parking, 0, 1);
        let mut parked = Vec::new();
        for id in 0..meshcache_core::coalesce::MAX_WAITERS_PER_KEY as u32 {
            let (s, h, flow) = arrive(&e, &parking, 0, 10 + id);
            assert_eq!(flow, Flow::Hold);
            parked.push((s, h));
        }
        let (_s, over, flow) = arrive(&e, &parking, 0, 9999);
        assert_eq!(flow, Flow::Continue, "past the bound: upstream at once");
        assert_eq!(over.counts["meshcache.coalesce.overflow"], 1);
        assert_eq!(parking.parked(), meshcache_core::coalesce::MAX_WAITERS_PER_KEY);
        let (_s, other, flow) = arrive(&e, &parking, 1, 10_000);
        assert_eq!(flow, Flow::Hold, "another worker has its own bound");
        assert!(!other.counts.contains_key("meshcache.coalesce.overflow"));
    }

    #[test]
    fn a_failed_refresh_answers_every_waiter_with_the_stale_entry() {
        let (mut e, parking) = coalescing_env(r#"{"policies": [{"model_prefix": "m", "ttl_s": 1, "stale_if_error_s": 30, "coalesce_timeout_ms": 1000}]}"#);
        exchange(&e, INFER, &[], &[BODY], &[ANSWER], &[]);
        e.now += 2_000;
        let (mut leader, mut lh, _) = arrive(&e, &parking, 0, 1);
        let (mut w, mut h, flow) = arrive(&e, &parking, 1, 2);
        assert_eq!(flow, Flow::Hold, "an expired entry's refresh is coalesced like a miss");
        answer_with(&mut leader, &mut lh, "503", b"");
        assert!(sent_status(&lh).ends_with("; fwd=stale; fwd-status=503; detail=stale-if-error"));
        deliver(&mut w, &mut h);
        assert_eq!(sent_status(&h), "meshcache; hit; stale; ttl=-1; fwd=stale; detail=stale-if-error; collapsed");
        assert_eq!(h.sent.borrow().as_ref().unwrap().2, ANSWER);
        assert_eq!((h.counts["meshcache.stale_if_error"], h.counts["meshcache.coalesce.served"]), (1, 1));
    }

    #[test]
    fn a_grpc_origin_error_is_answered_with_the_stale_message_and_a_zero_status_trailer() {
        let mut e = env(r#"{"policies": [{"model_prefix": "m", "ttl_s": 1, "stale_if_error_s": 30}]}"#);
        let (miss, _) = grpc_exchange(&e, "0");
        assert_eq!(get(&miss.resp, "cache-status").unwrap(), "meshcache; fwd=miss; stored");
        e.now += 2_000;
        let mut h = Fake::default();
        h.now.set(e.now);
        h.req = vec![(":method".into(), "POST".into()), (":path".into(), "/inference.GRPCInferenceService/ModelInfer".into()),
                     ("content-type".into(), "application/grpc".into())];
        let mut s = Stream::new(e.config.clone(), e.shared.clone());
        s.on_request_headers(&mut h, false);
        h.received = vec![framed(b"\x0a\x01m")];
        assert_eq!(s.on_request_body(&mut h, true), Flow::Continue, "expired: forwarded");
        h.resp = vec![(":status".into(), "200".into()), ("content-type".into(), "application/grpc".into()),
                      ("grpc-status".into(), "14".into())];
        assert_eq!(s.on_response_headers(&mut h, true), Flow::Hold, "the trailers-only error stops here");
        let sent = h.sent.borrow().clone().expect("the stale answer");
        assert_eq!(sent.2, framed(b"\x0a\x01m\x12\x011"));
        assert!(get(&sent.1, "cache-status").unwrap().ends_with("; fwd=stale; detail=stale-if-error"));
        assert_eq!(h.sent_trailers, vec![("grpc-status".to_string(), "0".to_string())]);
        assert_eq!(h.counts["meshcache.stale_if_error"], 1);
    }

    // ------------------------------------------------------------ stale-while-revalidate

    const SWR: &str = r#"{"policies": [{"model_prefix": "m", "ttl_s": 1, "stale_while_revalidate_s": 30}]}"#;

    /// A request after expiry; `refresh_ok`: whether its host can send a background refresh.
    fn stale_request(e: &Env, refresh_ok: bool) -> (Stream, Fake, Flow) {
        let mut h = Fake { refresh_ok, ..Fake::default() };
        h.now.set(e.now);
        h.req = vec![(":method".into(), "POST".into()), (":path".into(), INFER.into())];
        let mut s = Stream::new(e.config.clone(), e.shared.clone());
        s.on_request_headers(&mut h, false);
        h.received = vec![BODY.to_vec()];
        let flow = s.on_request_body(&mut h, true);
        (s, h, flow)
    }

    fn refreshed_answer() -> Headers {
        Headers { pairs: vec![(":status".into(), "200".into()), ("content-type".into(), "application/json".into())],
                  not_utf8: Vec::new() }
    }

    #[test]
    fn stale_while_revalidate_answers_at_once_and_one_background_refresh_replaces_the_entry() {
        let mut e = env(SWR);
        exchange(&e, INFER, &[], &[BODY], &[ANSWER], &[]);
        e.now += 2_000;
        let (_a, a, flow) = stale_request(&e, true);
        assert_eq!(flow, Flow::Stop);
        assert_eq!(sent_status(&a), "meshcache; hit; stale; ttl=-1; detail=stale-while-revalidate");
        assert_eq!(a.sent.borrow().as_ref().unwrap().2, ANSWER);
        assert_eq!((a.refreshes.len(), a.counts["meshcache.refreshes"], a.counts["meshcache.stale_while_revalidate"]), (1, 1, 1));
        let (_b, b, _) = stale_request(&e, true);
        assert!(sent_status(&b).ends_with("detail=stale-while-revalidate"));
        assert!(b.refreshes.is_empty(), "one refresh per key at a time");
        // The refresh's answer lands (background.rs hands it to store_refresh).
        let limits = e.config.limits.clone();
        let newer = br#"{"id":"a","outputs":[{"name":"y","data":[3]}]}"#.to_vec();
        store_refresh(&e.shared, &limits, &a.refreshes[0], &refreshed_answer(), newer.clone(), e.now + 10).unwrap();
        revalidate::release(&*e.shared, &a.refreshes[0].key);
        let (_c, c, _) = stale_request(&e, true);
        assert!(sent_status(&c).starts_with("meshcache; hit; ttl="), "{}", sent_status(&c));
        assert_eq!(c.sent.borrow().as_ref().unwrap().2, newer);
    }

    #[test]
    fn a_refresh_that_cannot_be_sent_or_fails_forwards_a_request_instead() {
        let mut e = env(SWR);
        exchange(&e, INFER, &[], &[BODY], &[ANSWER], &[]);
        e.now += 2_000;
        let (forwarded, f, flow) = stale_request(&e, false);
        assert_eq!(flow, Flow::Continue, "no background request here: this one refreshes");
        assert_eq!(f.counts["meshcache.refresh_failures"], 1);
        let (_b, b, _) = stale_request(&e, true);
        assert!(sent_status(&b).ends_with("detail=stale-while-revalidate"), "the others still get the stale entry");
        drop(forwarded); // its answer never came: the lock is free again
        let (_c, c, _) = stale_request(&e, true);
        assert_eq!(c.refreshes.len(), 1);
        // A background answer that cannot be stored: the next request is forwarded.
        let limits = e.config.limits.clone();
        let mut failed = refreshed_answer();
        failed.pairs[0].1 = "503".into();
        assert!(store_refresh(&e.shared, &limits, &c.refreshes[0], &failed, b"x".to_vec(), e.now).is_err());
        revalidate::failed(&*e.shared, &c.refreshes[0].key, e.now);
        let (_d, d, flow) = stale_request(&e, true);
        assert_eq!(flow, Flow::Continue);
        assert!(d.refreshes.is_empty(), "forwarded, not sent in the background");
    }

    // ------------------------------------------------------------ client role

    #[test]
    fn the_client_role_puts_a_routing_key_on_the_request_and_stores_nothing() {
        let e = env(r#"{"role": "client", "policies": [{"model_prefix": "m", "ttl_s": 60}]}"#);
        let key_of = |body: &[u8], forged: Option<&str>| {
            let mut h = Fake::default();
            h.req = vec![(":method".into(), "POST".into()), (":path".into(), INFER.into())];
            if let Some(f) = forged {
                h.req.push((names::ROUTE_KEY_HEADER.into(), f.into()));
            }
            let mut s = Stream::new(e.config.clone(), e.shared.clone());
            assert_eq!(s.on_request_headers(&mut h, false), Flow::Hold, "the body makes the key");
            h.received = vec![body.to_vec()];
            assert_eq!(s.on_request_body(&mut h, true), Flow::Continue);
            h.resp = vec![(":status".into(), "200".into())];
            s.on_response_headers(&mut h, true);
            assert!(get(&h.resp, "cache-status").is_none(), "the client role says nothing in answers");
            (get(&h.req, names::ROUTE_KEY_HEADER), h.routes_cleared, h.counts.get("meshcache.routed").copied())
        };
        let (a, cleared, routed) = key_of(BODY, None);
        assert!(a.is_some());
        assert_eq!((cleared, routed), (1, Some(1)));
        assert_eq!(key_of(&BODY.replace_id("zz"), Some("forged")).0, a, "same key for the same inference, forged key gone");
        assert_ne!(key_of(br#"{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[9]}]}"#, None).0, a);
        assert_eq!(key_of(b"{not json", None), (None, 0, None), "what the server would bypass gets no key");
    }
}


