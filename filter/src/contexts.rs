//! Root and HTTP stream contexts: gather inputs from the host, apply `decide`, write results
//! back. Every path fails open: on any surprise the request continues and `errors` counts it.

use crate::abi::{self, Buffer, LogLevel, Map, MetricKind};
use crate::cache_control::{response_ttl, NotStored};
use crate::config::{parse_plugin_config, Config, Limits, PluginConfig};
use crate::decide::{self, BodyDecision, Cacheable, HeadDecision, RequestHead};
use crate::grpc;
use crate::model::ModelSource;
use crate::store::{Cache, Lookup, Meta, Outcome, StoreError};
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

const CONTINUE: u32 = 0;
const PAUSE: u32 = 1;
const PEER_SAN: [&str; 2] = ["connection", "uri_san_peer_certificate"];

thread_local! {
    static ROOTS: RefCell<HashMap<u32, Option<Rc<PluginConfig>>>> = RefCell::new(HashMap::new());
    static STREAMS: RefCell<HashMap<u32, Stream>> = RefCell::new(HashMap::new());
    static METRIC_IDS: RefCell<HashMap<String, u32>> = RefCell::new(HashMap::new());
}

// ---------------------------------------------------------------- metrics
//
// Every host call crosses the VM boundary, which costs more than the cache logic itself, so
// counters are summed in the VM and handed to Envoy once per tick (METRICS_FLUSH_MS).

const METRICS_FLUSH_MS: u32 = 200;

thread_local! {
    static PENDING: RefCell<HashMap<String, u64>> = RefCell::new(HashMap::new());
}

fn metric(kind: MetricKind, name: &str) -> Option<u32> {
    if let Some(id) = METRIC_IDS.with(|m| m.borrow().get(name).copied()) {
        return Some(id);
    }
    let id = abi::define_metric(kind, name)?;
    METRIC_IDS.with(|m| m.borrow_mut().insert(name.to_string(), id));
    Some(id)
}

fn count(name: &str, n: u64) {
    if n == 0 {
        return;
    }
    PENDING.with(|p| {
        let mut p = p.borrow_mut();
        match p.get_mut(name) {
            Some(v) => *v += n,
            None => {
                p.insert(name.to_string(), n);
            }
        }
    });
}

/// Per-policy counters; the prefix is reduced to characters safe in a stat name.
fn count_policy(prefix: &str, what: &str) {
    let safe: String = prefix.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' { c } else { '_' }).collect();
    count(&format!("meshcache.policy.{}.{}", safe, what), 1);
}

fn record_outcome(out: &Outcome) {
    count("meshcache.evictions", out.evicted as u64);
    count("meshcache.errors", out.corrupt as u64);
}

fn record_gauges(meta: &Meta) {
    if let Some(id) = metric(MetricKind::Gauge, "meshcache.entries") {
        abi::record_metric(id, meta.entries as u64);
    }
    if let Some(id) = metric(MetricKind::Gauge, "meshcache.bytes") {
        abi::record_metric(id, meta.total_bytes);
    }
}

fn flush_metrics() {
    let pending: Vec<(String, u64)> = PENDING.with(|p| p.borrow_mut().drain().filter(|(_, v)| *v > 0).collect());
    for (name, n) in pending {
        if let Some(id) = metric(MetricKind::Counter, &name) {
            abi::increment_metric(id, n as i64);
        }
    }
}

fn error(msg: &str) {
    count("meshcache.errors", 1);
    abi::log(LogLevel::Warn, msg);
}

#[no_mangle]
pub extern "C" fn proxy_on_tick(root: u32) {
    flush_metrics();
    let is_cache = ROOTS.with(|r| matches!(r.borrow().get(&root), Some(Some(p)) if matches!(**p, PluginConfig::Cache(_))));
    if is_cache {
        // Gauges come from the shared accounting record: every worker reports the same value.
        record_gauges(&Cache::read_only(&abi::HostShared).meta().0);
    }
}

// ---------------------------------------------------------------- root context

#[no_mangle]
pub extern "C" fn proxy_on_vm_start(_root: u32, _size: usize) -> u32 {
    1
}

#[no_mangle]
pub extern "C" fn proxy_on_context_create(id: u32, parent: u32) {
    if parent == 0 {
        ROOTS.with(|r| r.borrow_mut().insert(id, None));
        return;
    }
    let plugin = ROOTS.with(|r| r.borrow().get(&parent).cloned().flatten());
    STREAMS.with(|s| s.borrow_mut().insert(id, Stream { plugin, phase: Phase::Pass }));
}

#[no_mangle]
pub extern "C" fn proxy_on_configure(root: u32, size: usize) -> u32 {
    let bytes = if size == 0 { Vec::new() } else { abi::buffer(Buffer::PluginConfiguration, 0, size).unwrap_or_default() };
    match parse_plugin_config(&bytes) {
        Ok(plugin) => {
            if let PluginConfig::Cache(cfg) = &plugin {
                let cache = Cache { data: &abi::HostShared, limits: &cfg.limits };
                let mut out = Outcome::default();
                cache.reconcile(&mut out);
                record_outcome(&out);
                abi::log(
                    LogLevel::Info,
                    &format!("configuration version {:?} with {} policies", cfg.version, cfg.policies.len()),
                );
            }
            ROOTS.with(|r| r.borrow_mut().insert(root, Some(Rc::new(plugin))));
            abi::set_tick_period_ms(METRICS_FLUSH_MS);
            1
        }
        Err(e) => {
            count("meshcache.errors", 1);
            abi::log(LogLevel::Error, &e.to_string());
            0
        }
    }
}

// proxy_on_done and proxy_on_log are deliberately not exported: the host skips callbacks a
// module does not export, which saves two VM crossings per request.

#[no_mangle]
pub extern "C" fn proxy_on_delete(id: u32) {
    STREAMS.with(|s| s.borrow_mut().remove(&id));
    ROOTS.with(|r| r.borrow_mut().remove(&id));
}

// ---------------------------------------------------------------- stream context

enum Phase {
    /// Not ours (or failed open): untouched.
    Pass,
    Bypass,
    Buffering { source: ModelSource, refresh: bool, headers: Vec<(String, String)> },
    /// A gRPC hit routed to the stub (which also writes the hit headers).
    GrpcHit,
    Miss(Cacheable),
    Collect { c: Cacheable, ttl: u64, status: u16, headers: Vec<(String, String)>, body: Vec<u8> },
    Done,
}

struct Stream {
    plugin: Option<Rc<PluginConfig>>,
    phase: Phase,
}

/// Runs a callback with the stream taken out of the map, so a host call that re-enters the
/// module for the same stream (a local reply runs on_response_headers) finds nothing to do.
fn with_stream<F: FnOnce(&mut Stream) -> u32>(id: u32, f: F) -> u32 {
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

#[no_mangle]
pub extern "C" fn proxy_on_request_headers(id: u32, _n: usize, eos: u32) -> u32 {
    with_stream(id, |s| s.on_request_headers(eos != 0))
}

#[no_mangle]
pub extern "C" fn proxy_on_request_body(id: u32, size: usize, eos: u32) -> u32 {
    with_stream(id, |s| s.on_request_body(size, eos != 0))
}

#[no_mangle]
pub extern "C" fn proxy_on_request_trailers(id: u32, _n: usize) -> u32 {
    // Trailers end the request: decide on whatever body was buffered.
    let size = abi::buffer_size(Buffer::RequestBody).unwrap_or(0);
    with_stream(id, |s| s.on_request_body(size, true))
}

#[no_mangle]
pub extern "C" fn proxy_on_response_headers(id: u32, _n: usize, eos: u32) -> u32 {
    with_stream(id, |s| s.on_response_headers(eos != 0))
}

#[no_mangle]
pub extern "C" fn proxy_on_response_body(id: u32, size: usize, eos: u32) -> u32 {
    with_stream(id, |s| s.on_response_body(size, eos != 0))
}

#[no_mangle]
pub extern "C" fn proxy_on_response_trailers(id: u32, _n: usize) -> u32 {
    with_stream(id, |s| s.on_response_trailers())
}

impl Stream {
    fn config(&self) -> Option<Rc<PluginConfig>> {
        self.plugin.clone()
    }

    fn on_request_headers(&mut self, eos: bool) -> u32 {
        let plugin = match self.config() {
            Some(p) => p,
            None => {
                error("stream without a configured plugin; passing through");
                return CONTINUE;
            }
        };
        let cfg = match &*plugin {
            // The marker says everything; the (bridged) request body is not needed.
            PluginConfig::Stub => return self.stub_answer(abi::header(Map::RequestHeaders, decide::HIT_HEADER)),
            PluginConfig::Cache(cfg) => cfg,
        };
        let mut headers = abi::headers(Map::RequestHeaders);
        // The internal hit marker is ours alone: drop any client-supplied copy first.
        if decide::header(&headers, decide::HIT_HEADER).is_some() {
            abi::remove_header(Map::RequestHeaders, decide::HIT_HEADER);
            headers.retain(|(n, _)| !n.eq_ignore_ascii_case(decide::HIT_HEADER));
        }
        let method = decide::header(&headers, ":method").unwrap_or("");
        let path = decide::header(&headers, ":path").unwrap_or("");
        let head = RequestHead { method, path, headers: &headers };
        match decide::on_head(&head) {
            HeadDecision::Ignore => CONTINUE,
            HeadDecision::Bypass => {
                self.phase = Phase::Bypass;
                count("meshcache.bypasses", 1);
                CONTINUE
            }
            HeadDecision::Buffer { source, refresh } => {
                if eos {
                    return self.decide_request(cfg, &headers, &source, refresh, &[]);
                }
                if source == ModelSource::GrpcBody && !cfg.hold_headers {
                    // Without held headers a gRPC hit cannot be routed to the stub: stay out.
                    self.phase = Phase::Bypass;
                    count("meshcache.bypasses", 1);
                    return CONTINUE;
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

    fn on_request_body(&mut self, size: usize, eos: bool) -> u32 {
        match &self.phase {
            Phase::Buffering { .. } => {}
            _ => return CONTINUE,
        }
        if size > decide::MAX_REQUEST_BYTES {
            self.phase = Phase::Bypass;
            count("meshcache.bypasses", 1);
            return CONTINUE;
        }
        if !eos {
            return PAUSE;
        }
        let body = match abi::buffer(Buffer::RequestBody, 0, size) {
            Some(b) => b,
            None if size == 0 => Vec::new(),
            None => {
                self.phase = Phase::Pass;
                error("request body unreadable; passing through");
                return CONTINUE;
            }
        };
        let plugin = match self.config() {
            Some(p) => p,
            None => return CONTINUE,
        };
        let phase = std::mem::replace(&mut self.phase, Phase::Pass);
        match (&*plugin, phase) {
            (PluginConfig::Cache(cfg), Phase::Buffering { source, refresh, headers }) => {
                self.decide_request(cfg, &headers, &source, refresh, &body)
            }
            _ => CONTINUE,
        }
    }

    fn decide_request(
        &mut self,
        cfg: &Config,
        headers: &[(String, String)],
        source: &ModelSource,
        refresh: bool,
        body: &[u8],
    ) -> u32 {
        let method = decide::header(headers, ":method").unwrap_or("");
        let path = decide::header(headers, ":path").unwrap_or("");
        let head = RequestHead { method, path, headers };
        let principal = || abi::property(&PEER_SAN).and_then(|b| String::from_utf8(b).ok());
        let mut c = match decide::on_body(cfg, &head, source, refresh, body, principal) {
            BodyDecision::Bypass => {
                self.phase = Phase::Bypass;
                count("meshcache.bypasses", 1);
                return CONTINUE;
            }
            BodyDecision::Cacheable(c) => c,
        };
        let now = abi::now_ms();
        c.request_ms = now;
        if c.refresh {
            count("meshcache.misses", 1);
            count_policy(&c.policy.model_prefix, "misses");
            self.phase = Phase::Miss(c);
            return CONTINUE;
        }
        let cache = Cache { data: &abi::HostShared, limits: &cfg.limits };
        let mut out = Outcome::default();
        let found = cache.lookup(&c.key, now, &mut out);
        record_outcome(&out);
        let entry = match found {
            Lookup::Hit(e) => e,
            Lookup::Miss(seen) => {
                c.seen = seen;
                count("meshcache.misses", 1);
                count_policy(&c.policy.model_prefix, "misses");
                self.phase = Phase::Miss(c);
                return CONTINUE;
            }
        };
        count("meshcache.hits", 1);
        count_policy(&c.policy.model_prefix, "hits");
        if c.grpc {
            // gRPC hits are answered by the stub listener (a local reply cannot carry a gRPC body).
            let slot = crate::store::slot_of(&c.key, cfg.limits.max_entries);
            abi::set_header(Map::RequestHeaders, decide::HIT_HEADER, &decide::hit_marker(slot, &c.key));
            self.phase = Phase::GrpcHit;
            return CONTINUE;
        }
        let extra = decide::hit_headers(&entry, now);
        let sent = if decide::not_modified(decide::header(headers, "if-none-match"), &entry) {
            let etag = decide::header(&entry.headers, "etag").unwrap_or("").to_string();
            let mut h: Vec<(&str, &str)> = extra.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
            h.push(("etag", &etag));
            abi::send_local_response(304, "meshcache_hit", b"", &h, -1)
        } else {
            let h: Vec<(&str, &str)> = entry.headers.iter().chain(extra.iter()).map(|(n, v)| (n.as_str(), v.as_str())).collect();
            abi::send_local_response(entry.status as u32, "meshcache_hit", &entry.body, &h, -1)
        };
        if !sent {
            error("local reply failed; passing through");
            self.phase = Phase::Done;
            return CONTINUE;
        }
        self.phase = Phase::Done;
        PAUSE
    }

    fn on_response_headers(&mut self, eos: bool) -> u32 {
        let phase = std::mem::replace(&mut self.phase, Phase::Done);
        match phase {
            Phase::Bypass => {
                abi::set_header(Map::ResponseHeaders, decide::CACHE_STATUS, decide::CACHE_STATUS_BYPASS);
                CONTINUE
            }
            Phase::GrpcHit => CONTINUE,
            Phase::Miss(c) => self.start_collect(c, eos),
            other => {
                self.phase = other;
                CONTINUE
            }
        }
    }

    fn limits(&self) -> Limits {
        match self.config().as_deref() {
            Some(PluginConfig::Cache(cfg)) => cfg.limits.clone(),
            _ => crate::config::Config::empty().limits,
        }
    }

    /// Whether response headers wait for our decision (see `Config::hold_headers`).
    fn holds_headers(&self) -> bool {
        match self.config().as_deref() {
            Some(PluginConfig::Cache(cfg)) => cfg.hold_headers,
            _ => true,
        }
    }

    /// `headers_open`: the response headers can still be changed (we are in their callback, or
    /// they are held until the body is complete).
    fn not_stored(&mut self, refresh: bool, why: NotStored, headers_open: bool) -> u32 {
        if headers_open {
            abi::set_header(Map::ResponseHeaders, decide::CACHE_STATUS, &decide::cache_status_not_stored(refresh, why));
        }
        self.phase = Phase::Done;
        CONTINUE
    }

    fn start_collect(&mut self, c: Cacheable, eos: bool) -> u32 {
        let headers = abi::headers(Map::ResponseHeaders);
        let status: u16 = decide::header(&headers, ":status").and_then(|s| s.parse().ok()).unwrap_or(0);
        if status != 200 {
            return self.not_stored(c.refresh, NotStored::Status, true);
        }
        if c.grpc && (eos || decide::header(&headers, "grpc-status").is_some()) {
            // Trailers-only gRPC responses are errors (or empty): nothing to store.
            return self.not_stored(c.refresh, NotStored::GrpcStatus, true);
        }
        let ttl = match response_ttl(&c.policy, decide::header(&headers, "cache-control")) {
            Ok(t) => t,
            Err(why) => return self.not_stored(c.refresh, why, true),
        };
        let limit = self.limits().max_entry_bytes as usize + if c.grpc { 5 } else { 0 };
        let declared: Option<usize> = decide::header(&headers, "content-length").and_then(|v| v.parse().ok());
        if declared.map_or(false, |n| n > limit) {
            return self.not_stored(c.refresh, NotStored::TooBig, true);
        }
        if eos {
            return self.finish_store(c, ttl, status, headers, Vec::new(), true);
        }
        let refresh = c.refresh;
        self.phase = Phase::Collect { c, ttl, status, headers, body: Vec::new() };
        if self.holds_headers() {
            return PAUSE;
        }
        // Headers cannot wait for the body here: say what is known now; the body is still
        // collected and stored at its end.
        let cs = if refresh { "meshcache; fwd=request" } else { "meshcache; fwd=miss" };
        abi::set_header(Map::ResponseHeaders, decide::CACHE_STATUS, cs);
        CONTINUE
    }

    fn on_response_body(&mut self, size: usize, eos: bool) -> u32 {
        let limit = self.limits().max_entry_bytes as usize;
        let phase = std::mem::replace(&mut self.phase, Phase::Done);
        let (c, ttl, status, headers, mut body) = match phase {
            Phase::Collect { c, ttl, status, headers, body } => (c, ttl, status, headers, body),
            other => {
                self.phase = other;
                return CONTINUE;
            }
        };
        let open = self.holds_headers();
        if size > limit + if c.grpc { 5 } else { 0 } {
            return self.not_stored(c.refresh, NotStored::TooBig, open);
        }
        // While paused the host keeps buffering: `size` is everything so far; read the new part.
        if size > body.len() {
            match abi::buffer(Buffer::ResponseBody, body.len(), size - body.len()) {
                Some(chunk) => body.extend_from_slice(&chunk),
                None => {
                    error("response body unreadable; not storing");
                    return self.not_stored(c.refresh, NotStored::Error, open);
                }
            }
        }
        if !eos {
            self.phase = Phase::Collect { c, ttl, status, headers, body };
            return PAUSE;
        }
        if c.grpc {
            // A gRPC answer without trailers has no grpc-status: not a success we can store.
            return self.not_stored(c.refresh, NotStored::GrpcStatus, open);
        }
        self.finish_store(c, ttl, status, headers, body, open)
    }

    fn on_response_trailers(&mut self) -> u32 {
        let phase = std::mem::replace(&mut self.phase, Phase::Done);
        match phase {
            Phase::Collect { c, ttl, status, headers, body } => {
                let open = self.holds_headers();
                if c.grpc && abi::header(Map::ResponseTrailers, "grpc-status").as_deref() != Some("0") {
                    return self.not_stored(c.refresh, NotStored::GrpcStatus, open);
                }
                self.finish_store(c, ttl, status, headers, body, open)
            }
            other => {
                self.phase = other;
                CONTINUE
            }
        }
    }

    fn finish_store(
        &mut self,
        c: Cacheable,
        ttl: u64,
        status: u16,
        headers: Vec<(String, String)>,
        body: Vec<u8>,
        headers_open: bool,
    ) -> u32 {
        let limits = self.limits();
        let message = if c.grpc {
            match grpc::unframe(&body) {
                Some(m) => m.to_vec(),
                None => return self.not_stored(c.refresh, NotStored::Error, headers_open),
            }
        } else {
            body
        };
        if message.len() as u64 > limits.max_entry_bytes {
            return self.not_stored(c.refresh, NotStored::TooBig, headers_open);
        }
        let refresh = c.refresh;
        let stored = decide::build_entry(&c, &headers, status, message, ttl);
        let cache = Cache { data: &abi::HostShared, limits: &limits };
        let mut out = Outcome::default();
        let result = cache.insert(&stored.entry, c.seen, &mut out);
        record_outcome(&out);
        match result {
            Ok(()) => {
                count("meshcache.stores", 1);
                self.phase = Phase::Done;
                if !headers_open {
                    return CONTINUE;
                }
                let cs = if refresh { decide::CACHE_STATUS_REFRESHED } else { decide::CACHE_STATUS_STORED };
                // The response headers are paused and unchanged since we read them: write them
                // back with ours added in a single host call.
                let ours: [(&str, &str); 3] = [
                    (decide::HASH_HEADER, &stored.entry.response_hash),
                    (decide::CACHE_STATUS, cs),
                    ("etag", stored.added_etag.as_deref().unwrap_or("")),
                ];
                let mut all: Vec<(&str, &str)> = headers
                    .iter()
                    .filter(|(n, _)| !ours.iter().any(|(o, v)| !v.is_empty() && n.eq_ignore_ascii_case(o)))
                    .map(|(n, v)| (n.as_str(), v.as_str()))
                    .collect();
                all.extend(ours.iter().filter(|(_, v)| !v.is_empty()));
                abi::set_headers(Map::ResponseHeaders, &all);
                CONTINUE
            }
            Err(StoreError::NoSpace) => self.not_stored(refresh, NotStored::StoreFull, headers_open),
            Err(StoreError::Contended) => self.not_stored(refresh, NotStored::Contended, headers_open),
        }
    }

    /// Stub side: answer a routed gRPC hit with the stored message; the reverse bridge frames it.
    fn stub_answer(&mut self, key_hex: Option<String>) -> u32 {
        self.phase = Phase::Done;
        let now = abi::now_ms();
        // The slot comes with the marker, so no configuration is needed to find the entry.
        let entry = key_hex.as_deref().and_then(decide::parse_hit_marker).and_then(|(slot, key)| {
            match Cache::read_only(&abi::HostShared).lookup_at(slot, &key, now, &mut Outcome::default()) {
                Lookup::Hit(e) => Some(e),
                Lookup::Miss(_) => None,
            }
        });
        let sent = match entry {
            Some(e) => {
                // The hit headers ride on the stub's reply through the bridge to the client, so the
                // cache filter in front need not touch the response (fewer VM crossings).
                let extra = decide::hit_headers(&e, now);
                let mut h: Vec<(&str, &str)> = vec![("content-type", "application/x-protobuf")];
                h.extend(extra.iter().map(|(n, v)| (n.as_str(), v.as_str())));
                abi::send_local_response(200, "meshcache_stub_hit", &e.body, &h, -1)
            }
            None => {
                count("meshcache.stub_misses", 1);
                abi::send_local_response(503, "meshcache_stub_miss", b"meshcache: entry no longer cached", &[], -1)
            }
        };
        if !sent {
            error("stub reply failed");
            return CONTINUE;
        }
        PAUSE
    }
}
