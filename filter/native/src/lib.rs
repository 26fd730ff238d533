//! meshcache as an Envoy dynamic module (`envoy.filters.http.dynamic_modules`): the second host
//! of the cache core (`meshcache-core`; the first is the proxy-wasm filter, filter/wasm).
//!
//! This file is the host: the `envoy_dynamic_module_on_*` hooks Envoy calls, and `EnvoyHost`,
//! the `filter::Host` over Envoy's callbacks (abi.rs). Every hook catches panics: a bug fails
//! open (the request passes through), it never unwinds into Envoy.
//!
//! The store is process-wide: one per Envoy process, shared by every worker and every filter
//! config (an ECDS update replaces the config, not the cached entries); each new config
//! reconciles it to its limits, as the Wasm filter's root context does with shared data. So are
//! the coalescing waiters' tables and their timer (park.rs); background refreshes belong to
//! the filter config that sent them (background.rs).

pub mod abi;
pub mod background;
pub mod filter;
pub mod metrics;
pub mod park;
pub mod store;

use std::os::raw::{c_char, c_void};
use std::cell::Cell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use abi::*;
use background::{Background, Job, Post};
use filter::{Flow, Host, Place, Stream};
use meshcache_core::coalesce::LockTable;
use meshcache_core::config::{parse_plugin_config, Config, SemanticService};
use meshcache_core::semantic;
use meshcache_core::headermap::Headers;
use meshcache_core::store::{Cache, Outcome};
use metrics::Metrics;
use park::{Parking, Wake};
use store::Shared;

static SHARED: OnceLock<Arc<Shared>> = OnceLock::new();
/// Coalesced requests waiting, all workers; created with its timer thread on first use.
static PARKING: OnceLock<Arc<Parking>> = OnceLock::new();
/// Stream ids within a worker's table (unique per process; 0 is never used).
static NEXT_STREAM: AtomicU32 = AtomicU32::new(1);

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// The process's parking and the one thread that wakes waiters past their deadline (every
/// 10 ms while any wait, the precision of `coalesce_timeout_ms`; 25 ms when none do).
fn parking() -> Arc<Parking> {
    PARKING
        .get_or_init(|| {
            let p = Arc::new(Parking::default());
            let timer = p.clone();
            let spawned = std::thread::Builder::new().name("meshcache-wait".into()).spawn(move || loop {
                let busy = timer.parked() > 0;
                std::thread::sleep(Duration::from_millis(if busy { 10 } else { 25 }));
                if busy || timer.parked() > 0 {
                    let _ = catch_unwind(AssertUnwindSafe(|| timer.expire(now_ms())));
                }
            });
            if spawned.is_err() {
                eprintln!("meshcache native filter: no timer thread; coalesced requests wait for their leader only");
            }
            p
        })
        .clone()
}

/// A parked stream's scheduler handle (owned; deleted when dropped, from any thread).
struct Scheduler(*mut c_void);

// SAFETY: Envoy's scheduler handle is made to be committed and deleted from any thread (it
// holds a weak reference to the stream and posts to the stream's dispatcher).
unsafe impl Send for Scheduler {}

impl Wake for Scheduler {
    fn wake(&self, event: u64) {
        // SAFETY: a live handle from `scheduler_new` (deleted only in `drop`).
        unsafe { envoy_dynamic_module_callback_http_filter_scheduler_commit(self.0, event) }
    }
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        // SAFETY: as in `wake`; dropped once.
        unsafe { envoy_dynamic_module_callback_http_filter_scheduler_delete(self.0) }
    }
}

struct FilterConfig {
    config: Arc<Config>,
    shared: Arc<Shared>,
    metrics: Arc<Metrics>,
    background: Arc<Background>,
}

/// What Envoy's module pointer for a stream points at: the flow, the stats it counts into and
/// its config's background refreshes.
struct StreamContext {
    stream: Stream,
    metrics: Arc<Metrics>,
    background: Arc<Background>,
    hooks: HookGuard,
}

/// Envoy 1.39 can destroy a stream from inside one of its hooks: a local reply sent from the
/// response path (`send_response`, or `send_response_trailers`, in the response headers hook:
/// stale-if-error) completes the stream, and its filter manager calls
/// `on_http_filter_destroy` before the callback returns (seen in its debug log and a crash in
/// the hook's later frees); 1.40 does not. So the destroy hook, arriving while a hook of the
/// same stream runs, only marks the stream, and that hook frees it when it returns.
#[derive(Default)]
struct HookGuard {
    depth: Cell<u32>,
    destroyed: Cell<bool>,
}

/// Marks a hook of `module`'s stream as running; pair with `leave_hook`.
unsafe fn enter_hook(module: FilterModulePtr) -> *mut StreamContext {
    let ctx = module as *mut StreamContext;
    let guard = &(*ctx).hooks;
    guard.depth.set(guard.depth.get() + 1);
    ctx
}

/// Ends a hook; frees the stream if Envoy destroyed it meanwhile.
unsafe fn leave_hook(ctx: *mut StreamContext) {
    let guard = &(*ctx).hooks;
    guard.depth.set(guard.depth.get() - 1);
    if guard.depth.get() == 0 && guard.destroyed.get() {
        let _ = catch_unwind(AssertUnwindSafe(|| drop(Box::from_raw(ctx))));
    }
}

struct EnvoyHost<'m> {
    ptr: FilterEnvoyPtr,
    metrics: &'m Metrics,
    background: &'m Background,
}

const INLINE_CHUNKS: usize = 16;

impl EnvoyHost<'_> {
    fn headers(&self, kind: u32) -> Headers {
        let mut out = Headers::default();
        // SAFETY: `ptr` is the stream Envoy passed to the running hook; the entries stay valid
        // for the rest of that hook and are copied out before it returns; `all` has room for
        // the count Envoy reported just before.
        unsafe {
            let n = envoy_dynamic_module_callback_http_get_headers_size(self.ptr, kind);
            if n == 0 {
                return out;
            }
            let mut all = vec![EnvoyHttpHeader::EMPTY; n];
            if !envoy_dynamic_module_callback_http_get_headers(self.ptr, kind, all.as_mut_ptr()) {
                return out;
            }
            out.pairs.reserve(n);
            for h in &all {
                let (k, v) = (h.key.as_slice(), h.value.as_slice());
                // As the Wasm host's header map: text, lossy for bytes that are not UTF-8, whose
                // names are listed so nothing trusts their text (keys bypass, answers not stored).
                let name = String::from_utf8_lossy(k).to_ascii_lowercase();
                if std::str::from_utf8(k).is_err() || std::str::from_utf8(v).is_err() {
                    out.not_utf8.push(name.clone());
                }
                out.pairs.push((name, String::from_utf8_lossy(v).into_owned()));
            }
        }
        out
    }

    fn set(&mut self, kind: u32, name: &str, value: Option<&[u8]>) {
        let value = value.map_or(ModuleBuffer { ptr: std::ptr::null(), length: 0 }, ModuleBuffer::of);
        // SAFETY: as in `headers`.
        unsafe {
            envoy_dynamic_module_callback_http_set_header(self.ptr, kind, ModuleBuffer::of(name.as_bytes()), value);
        }
    }

    fn visit(&self, body_type: u32, f: &mut dyn FnMut(&[u8])) {
        // SAFETY: as in `headers`; `chunks` has room for the count Envoy reported just before.
        unsafe {
            let n = envoy_dynamic_module_callback_http_get_body_chunks_size(self.ptr, body_type);
            if n == 0 {
                return;
            }
            let mut inline = [EnvoyBuffer::EMPTY; INLINE_CHUNKS];
            let mut heap = Vec::new();
            let chunks: &mut [EnvoyBuffer] = if n <= INLINE_CHUNKS {
                &mut inline[..n]
            } else {
                heap.resize(n, EnvoyBuffer::EMPTY);
                &mut heap[..]
            };
            if envoy_dynamic_module_callback_http_get_body_chunks(self.ptr, body_type, chunks.as_mut_ptr()) {
                chunks.iter().for_each(|c| f(c.as_slice()));
            }
        }
    }
}

impl Host for EnvoyHost<'_> {
    fn request_headers(&self) -> Headers {
        self.headers(REQUEST_HEADER)
    }

    fn response_headers(&self) -> Headers {
        self.headers(RESPONSE_HEADER)
    }

    fn remove_request_header(&mut self, name: &str) {
        self.set(REQUEST_HEADER, name, None);
    }

    fn set_request_header(&mut self, name: &str, value: &[u8]) {
        self.set(REQUEST_HEADER, name, Some(value));
    }

    fn clear_route_cache(&mut self) {
        // SAFETY: as in `headers`.
        unsafe { envoy_dynamic_module_callback_http_clear_route_cache(self.ptr) }
    }

    fn set_response_header(&mut self, name: &str, value: &[u8]) {
        self.set(RESPONSE_HEADER, name, Some(value));
    }

    fn set_response_trailer(&mut self, name: &str, value: &[u8]) {
        self.set(RESPONSE_TRAILER, name, Some(value));
    }

    fn received_body(&self, response: bool, f: &mut dyn FnMut(&[u8])) {
        self.visit(if response { RECEIVED_RESPONSE_BODY } else { RECEIVED_REQUEST_BODY }, f);
    }

    fn whole_body(&self, response: bool, f: &mut dyn FnMut(&[u8])) {
        // SAFETY: as in `headers`.
        let received_is_held = unsafe {
            if response {
                envoy_dynamic_module_callback_http_received_buffered_response_body(self.ptr)
            } else {
                envoy_dynamic_module_callback_http_received_buffered_request_body(self.ptr)
            }
        };
        if !received_is_held {
            self.visit(if response { BUFFERED_RESPONSE_BODY } else { BUFFERED_REQUEST_BODY }, f);
        }
        self.received_body(response, f);
    }

    fn send_response(&mut self, status: u32, headers: &[(&str, &[u8])], body: &[u8]) {
        let hs: Vec<ModuleHttpHeader> = headers.iter().map(|(k, v)| ModuleHttpHeader::of(k.as_bytes(), v)).collect();
        // SAFETY: as in `headers`; Envoy copies headers and body before returning.
        unsafe {
            envoy_dynamic_module_callback_http_send_response(self.ptr, status, hs.as_ptr(), hs.len(), ModuleBuffer::of(body),
                                                             ModuleBuffer::of(b"meshcache_hit"));
        }
    }

    fn send_response_with_trailers(&mut self, headers: &[(&str, &[u8])], body: &[u8], trailers: &[(&str, &[u8])]) {
        let hs: Vec<ModuleHttpHeader> = headers.iter().map(|(k, v)| ModuleHttpHeader::of(k.as_bytes(), v)).collect();
        let ts: Vec<ModuleHttpHeader> = trailers.iter().map(|(k, v)| ModuleHttpHeader::of(k.as_bytes(), v)).collect();
        // SAFETY: as in `headers`; Envoy copies headers, body and trailers before returning.
        unsafe {
            envoy_dynamic_module_callback_http_send_response_headers(self.ptr, hs.as_ptr(), hs.len(), false);
            envoy_dynamic_module_callback_http_send_response_data(self.ptr, ModuleBuffer::of(body), false);
            envoy_dynamic_module_callback_http_send_response_trailers(self.ptr, ts.as_ptr(), ts.len());
        }
    }

    fn response_trailers(&self) -> Headers {
        self.headers(RESPONSE_TRAILER)
    }

    fn peer_identity(&self) -> Option<String> {
        let mut out = EnvoyBuffer::EMPTY;
        // SAFETY: as in `headers`; the value is copied out before the hook returns.
        unsafe {
            envoy_dynamic_module_callback_http_filter_get_attribute_string(
                self.ptr, ATTRIBUTE_CONNECTION_URI_SAN_PEER_CERTIFICATE, &mut out)
                .then(|| String::from_utf8(out.as_slice().to_vec()).ok())
                .flatten()
        }
    }

    fn count(&mut self, name: &str, n: u64) {
        // SAFETY: as in `headers`.
        unsafe { self.metrics.count(self.ptr, name, n) }
    }

    fn set_gauge(&mut self, name: &str, value: u64) {
        // SAFETY: as in `headers`.
        unsafe { self.metrics.set_gauge(self.ptr, name, value) }
    }

    fn log_debug(&mut self, line: &dyn Fn() -> String) {
        // SAFETY: plain calls; Envoy copies the message before returning.
        unsafe {
            if envoy_dynamic_module_callback_log_enabled(LOG_DEBUG) {
                envoy_dynamic_module_callback_log(LOG_DEBUG, ModuleBuffer::of(line().as_bytes()));
            }
        }
    }

    fn now_ms(&self) -> u64 {
        now_ms()
    }

    fn waker(&mut self) -> Option<Box<dyn Wake>> {
        // SAFETY: as in `headers` (the handle is created on the stream's worker, in its hook).
        let s = unsafe { envoy_dynamic_module_callback_http_filter_scheduler_new(self.ptr) };
        (!s.is_null()).then(|| Box::new(Scheduler(s)) as Box<dyn Wake>)
    }

    fn resume_request(&mut self) {
        // SAFETY: as in `headers`.
        unsafe { envoy_dynamic_module_callback_http_filter_continue_decoding(self.ptr) }
    }

    fn refresh(&mut self, c: &meshcache_core::request::Cacheable, headers: &[(String, String)], body: &[u8]) -> bool {
        let mut cluster = EnvoyBuffer::EMPTY;
        // SAFETY: as in `headers`; the name is copied out before the hook returns.
        let cluster = unsafe {
            if !envoy_dynamic_module_callback_http_get_cluster_name(self.ptr, &mut cluster) {
                return false;
            }
            String::from_utf8_lossy(cluster.as_slice()).into_owned()
        };
        if cluster.is_empty() {
            return false;
        }
        let headers = headers.iter().filter(|(n, _)| meshcache_core::revalidate::repeats_header(n)).cloned().collect();
        self.background.submit(Job { c: c.clone(), cluster, headers, body: body.to_vec() })
    }

    fn semantic_instance(&mut self) -> String {
        semantic_instance().to_string()
    }

    fn semantic_lookup(&mut self, service: &SemanticService, body: &[u8]) -> bool {
        let hs = [ModuleHttpHeader::of(b":method", b"POST"), ModuleHttpHeader::of(b":path", semantic::LOOKUP_PATH.as_bytes()),
                  ModuleHttpHeader::of(b":authority", service.authority.as_bytes()),
                  ModuleHttpHeader::of(b"content-type", b"application/json")];
        let mut id = 0u64;
        // SAFETY: as in `headers`; Envoy copies cluster, headers and body during the call.
        unsafe {
            envoy_dynamic_module_callback_http_filter_http_callout(self.ptr, &mut id, ModuleBuffer::of(service.cluster.as_bytes()),
                hs.as_ptr(), hs.len(), ModuleBuffer::of(body), service.timeout_ms) == CALLOUT_SUCCESS
        }
    }

    fn semantic_post(&mut self, service: &SemanticService, path: &'static str, body: Vec<u8>) -> bool {
        self.background.post(Post { cluster: service.cluster.clone(), authority: service.authority.clone(), path, body,
                                    timeout_ms: service.timeout_ms })
    }
}

/// This Envoy process's cache instance id (the store lives in process memory: one per process),
/// made once from the clock and the process id.
fn semantic_instance() -> &'static str {
    static INSTANCE: OnceLock<String> = OnceLock::new();
    INSTANCE.get_or_init(|| {
        let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
        format!("{:016x}{:08x}", nanos, std::process::id())
    })
}

/// Runs a stream hook; a panic fails the stream open.
unsafe fn with_stream(envoy: FilterEnvoyPtr, module: FilterModulePtr, f: impl FnOnce(&mut Stream, &mut EnvoyHost) -> Flow)
    -> Flow {
    let ctx = enter_hook(module);
    // Field by field, so the destroy hook may reach `hooks` while the stream is borrowed.
    let stream = &mut (*ctx).stream;
    let mut host = EnvoyHost { ptr: envoy, metrics: &(*ctx).metrics, background: &(*ctx).background };
    let flow = match catch_unwind(AssertUnwindSafe(|| f(stream, &mut host))) {
        Ok(flow) => flow,
        Err(_) => {
            stream.fail_open();
            Flow::Continue
        }
    };
    leave_hook(ctx);
    flow
}

fn headers_status(flow: Flow) -> u32 {
    match flow {
        Flow::Continue => HEADERS_CONTINUE,
        Flow::Hold | Flow::Stop => HEADERS_STOP_ITERATION,
    }
}

fn trailers_status(flow: Flow) -> u32 {
    match flow {
        Flow::Continue => TRAILERS_CONTINUE,
        // Parked (coalescing) or answered locally: the request stops here.
        Flow::Hold | Flow::Stop => TRAILERS_STOP_ITERATION,
    }
}

fn body_status(flow: Flow) -> u32 {
    match flow {
        Flow::Continue => BODY_CONTINUE,
        Flow::Hold => BODY_STOP_ITERATION_AND_BUFFER,
        Flow::Stop => BODY_STOP_ITERATION_NO_BUFFER,
    }
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_program_init() -> *const c_char {
    abi::program_init()
}

/// A null return makes Envoy reject the filter config (the error is on stderr).
///
/// # Safety
/// Called by Envoy with buffers valid for the call.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_new(
    config_envoy: ConfigEnvoyPtr,
    _name: EnvoyBuffer,
    config: EnvoyBuffer,
) -> ConfigModulePtr {
    let bytes = config.as_slice();
    let made = catch_unwind(|| match parse_plugin_config(bytes) {
        Ok(c) => {
            let shared = SHARED.get_or_init(|| Arc::new(Shared::default())).clone();
            // The slots and accounting record for this config's limits (a shrink evicts).
            Cache { data: &*shared, limits: &c.limits }.reconcile(&mut Outcome::default());
            LockTable { data: &*shared }.create_slots();
            let metrics = Arc::new(Metrics::define(config_envoy, &c));
            let c = Arc::new(c);
            let background = Arc::new(Background::new(config_envoy, shared.clone(), c.clone(), metrics.clone()));
            Box::into_raw(Box::new(FilterConfig { config: c, shared, metrics, background })) as ConfigModulePtr
        }
        Err(e) => {
            eprintln!("meshcache native filter: {}", e);
            std::ptr::null()
        }
    });
    made.unwrap_or(std::ptr::null())
}

/// # Safety
/// `config` is a pointer returned by `envoy_dynamic_module_on_http_filter_config_new`.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_destroy(config: ConfigModulePtr) {
    drop(Box::from_raw(config as *mut FilterConfig));
}

/// # Safety
/// `config` is a pointer returned by `envoy_dynamic_module_on_http_filter_config_new`.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_new(config: ConfigModulePtr, envoy: FilterEnvoyPtr)
    -> FilterModulePtr {
    let c = &*(config as *const FilterConfig);
    let place = Place {
        parking: parking(),
        queue: envoy_dynamic_module_callback_http_filter_get_worker_index(envoy),
        id: NEXT_STREAM.fetch_add(1, Ordering::Relaxed).max(1),
    };
    let stream = Stream::new(c.config.clone(), c.shared.clone()).coalescing(place);
    Box::into_raw(Box::new(StreamContext {
        stream, metrics: c.metrics.clone(), background: c.background.clone(), hooks: HookGuard::default(),
    }))
        as FilterModulePtr
}

/// # Safety
/// `module` is a pointer returned by `envoy_dynamic_module_on_http_filter_new`.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_destroy(module: FilterModulePtr) {
    // Dropping the stream unparks it and hands on a key it leads (filter.rs). Inside one of the
    // stream's hooks (Envoy 1.39, HookGuard), that hook drops it when it returns.
    let ctx = module as *mut StreamContext;
    if (*ctx).hooks.depth.get() > 0 {
        (*ctx).hooks.destroyed.set(true);
        return;
    }
    let _ = catch_unwind(AssertUnwindSafe(|| drop(Box::from_raw(ctx))));
}

/// # Safety
/// Envoy's stream and our stream object, during the hook.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_request_headers(
    envoy: FilterEnvoyPtr, module: FilterModulePtr, end_of_stream: bool) -> u32 {
    headers_status(with_stream(envoy, module, |s, h| s.on_request_headers(h, end_of_stream)))
}

/// # Safety
/// As for request headers.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_request_body(
    envoy: FilterEnvoyPtr, module: FilterModulePtr, end_of_stream: bool) -> u32 {
    body_status(with_stream(envoy, module, |s, h| s.on_request_body(h, end_of_stream)))
}

/// # Safety
/// As for request headers.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_request_trailers(
    envoy: FilterEnvoyPtr, module: FilterModulePtr) -> u32 {
    trailers_status(with_stream(envoy, module, |s, h| s.on_request_trailers(h)))
}

/// # Safety
/// As for request headers.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_response_headers(
    envoy: FilterEnvoyPtr, module: FilterModulePtr, end_of_stream: bool) -> u32 {
    headers_status(with_stream(envoy, module, |s, h| s.on_response_headers(h, end_of_stream)))
}

/// # Safety
/// As for request headers.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_response_body(
    envoy: FilterEnvoyPtr, module: FilterModulePtr, end_of_stream: bool) -> u32 {
    body_status(with_stream(envoy, module, |s, h| s.on_response_body(h, end_of_stream)))
}

/// # Safety
/// As for request headers.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_response_trailers(
    envoy: FilterEnvoyPtr, module: FilterModulePtr) -> u32 {
    with_stream(envoy, module, |s, h| s.on_response_trailers(h));
    TRAILERS_CONTINUE
}

/// # Safety
/// As for request headers.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_stream_complete(
    _envoy: FilterEnvoyPtr, _module: FilterModulePtr) {
}


// Hooks Envoy 1.40 resolves for every HTTP filter module. `scheduled` delivers coalescing wakes;
// the stream-level callouts, streams and watermarks are unused, so those do nothing (arguments
// after the pointers ignored).

/// # Safety
/// Called by Envoy.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_http_callout_done(
    envoy: FilterEnvoyPtr, module: FilterModulePtr, _callout_id: u64, result: u32, headers: *const EnvoyHttpHeader,
    headers_size: usize, chunks: *const EnvoyBuffer, chunks_size: usize) {
    // The stream's one callout: its semantic lookup (issue 38).
    let headers = if headers.is_null() { &[][..] } else { std::slice::from_raw_parts(headers, headers_size) };
    let chunks = if chunks.is_null() { &[][..] } else { std::slice::from_raw_parts(chunks, chunks_size) };
    let ctx = enter_hook(module);
    let stream = &mut (*ctx).stream;
    let mut host = EnvoyHost { ptr: envoy, metrics: &(*ctx).metrics, background: &(*ctx).background };
    let answered = catch_unwind(AssertUnwindSafe(|| {
        let status = headers.iter().find(|h| h.key.as_slice() == b":status").map(|h| String::from_utf8_lossy(h.value.as_slice()).into_owned());
        let size: usize = chunks.iter().map(|c| c.length).sum();
        let mut body = Vec::with_capacity(size.min(SEMANTIC_ANSWER_BYTES));
        if size <= SEMANTIC_ANSWER_BYTES {
            chunks.iter().for_each(|c| body.extend_from_slice(c.as_slice()));
        }
        let verdict = if result == CALLOUT_SUCCESS {
            semantic::verdict(status.as_deref(), &body)
        } else {
            Err("the semantic lookup failed (reset or timed out)")
        };
        stream.on_semantic_answer(&mut host, verdict);
    }));
    if answered.is_err() {
        // Fail open: a stopped request must not stay stopped.
        stream.fail_open();
        envoy_dynamic_module_callback_http_filter_continue_decoding(envoy);
    }
    leave_hook(ctx);
}

/// The semantic service's answers are small; a bigger one is not read (an error: upstream).
const SEMANTIC_ANSWER_BYTES: usize = 64 * 1024;

/// # Safety
/// Called by Envoy.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_headers(
    _envoy: FilterEnvoyPtr, _module: FilterModulePtr, _stream_id: u64, _headers: *const c_void, _headers_size: usize,
    _end_stream: bool) {
}

/// # Safety
/// Called by Envoy.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_data(
    _envoy: FilterEnvoyPtr, _module: FilterModulePtr, _stream_id: u64, _chunks: *const EnvoyBuffer, _chunks_size: usize,
    _end_stream: bool) {
}

/// # Safety
/// Called by Envoy.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_trailers(
    _envoy: FilterEnvoyPtr, _module: FilterModulePtr, _stream_id: u64, _trailers: *const c_void, _trailers_size: usize) {
}

/// # Safety
/// Called by Envoy.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_complete(
    _envoy: FilterEnvoyPtr, _module: FilterModulePtr, _stream_id: u64) {
}

/// # Safety
/// Called by Envoy.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_reset(
    _envoy: FilterEnvoyPtr, _module: FilterModulePtr, _stream_id: u64, _reason: u32) {
}

/// # Safety
/// Called by Envoy.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_scheduled(
    envoy: FilterEnvoyPtr, module: FilterModulePtr, event_id: u64) {
    let ctx = enter_hook(module);
    let stream = &mut (*ctx).stream;
    let mut host = EnvoyHost { ptr: envoy, metrics: &(*ctx).metrics, background: &(*ctx).background };
    if catch_unwind(AssertUnwindSafe(|| stream.on_scheduled(&mut host, event_id))).is_err() {
        // Fail open: a parked request must not stay stopped.
        stream.fail_open();
        envoy_dynamic_module_callback_http_filter_continue_decoding(envoy);
    }
    leave_hook(ctx);
}

/// # Safety
/// Called by Envoy.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_scheduled(
    _config_envoy: ConfigEnvoyPtr, config: ConfigModulePtr, _event_id: u64) {
    // Stale-while-revalidate refreshes the workers queued (background.rs), on the main thread.
    if config.is_null() {
        return;
    }
    let c = &*(config as *const FilterConfig);
    let _ = catch_unwind(AssertUnwindSafe(|| c.background.on_scheduled(now_ms())));
}

/// A background refresh's answer (or its failure), on the main thread.
///
/// # Safety
/// Called by Envoy with arrays valid during the call.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_http_callout_done(
    _config_envoy: ConfigEnvoyPtr, config: ConfigModulePtr, callout_id: u64, result: u32, headers: *const EnvoyHttpHeader,
    headers_size: usize, chunks: *const EnvoyBuffer, chunks_size: usize) {
    if config.is_null() {
        return;
    }
    let c = &*(config as *const FilterConfig);
    let headers = if headers.is_null() { &[][..] } else { std::slice::from_raw_parts(headers, headers_size) };
    let chunks = if chunks.is_null() { &[][..] } else { std::slice::from_raw_parts(chunks, chunks_size) };
    let _ = catch_unwind(AssertUnwindSafe(|| c.background.on_done(callout_id, result, headers, chunks, now_ms())));
}

/// # Safety
/// Called by Envoy.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_downstream_above_write_buffer_high_watermark(
    _envoy: FilterEnvoyPtr, _module: FilterModulePtr) {
}

/// # Safety
/// Called by Envoy.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_downstream_below_write_buffer_low_watermark(
    _envoy: FilterEnvoyPtr, _module: FilterModulePtr) {
}
