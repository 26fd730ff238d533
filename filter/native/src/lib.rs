//! meshcache as an Envoy dynamic module (`envoy.filters.http.dynamic_modules`): the second host
//! of the cache core (`meshcache-core`; the first is the proxy-wasm filter, filter/wasm). Each
//! stream runs the core's flow (`meshcache_core::flow::Flow`); this crate is its adapter.
//!
//! This file holds the `envoy_dynamic_module_on_*` hooks Envoy calls and each stream's context;
//! `abi_host.rs` is the flow's `Host` over Envoy's callbacks (abi.rs). Every hook catches
//! panics: a bug fails open (the request passes through), it never unwinds into Envoy.
//!
//! The store is process-wide: one per Envoy process, shared by every worker and every filter
//! config (an ECDS update replaces the config, not the cached entries); each new config
//! reconciles it to its limits, as the Wasm filter's root context does with shared data. So are
//! the coalescing waiters' tables and their timer (park.rs); background refreshes belong to
//! the filter config that sent them (background.rs).

pub mod abi;
pub mod abi_host;
pub mod background;
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
use abi_host::{EnvoyHost, Place};
use background::Background;
use meshcache_core::coalesce::LockTable;
use meshcache_core::config::{parse_plugin_config, Config};
use meshcache_core::flow::Flow;
use meshcache_core::headermap::Headers;
use meshcache_core::host::{Action, CalloutAnswer};
use meshcache_core::store::{Cache, Outcome};
use metrics::Metrics;
use park::Parking;
use store::Shared;

static SHARED: OnceLock<Arc<Shared>> = OnceLock::new();
/// Coalesced requests waiting, all workers; created with its timer thread on first use.
static PARKING: OnceLock<Arc<Parking>> = OnceLock::new();
/// Stream ids within a worker's table (unique per process; 0 is never used).
static NEXT_STREAM: AtomicU32 = AtomicU32::new(1);

pub(crate) fn now_ms() -> u64 {
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

struct FilterConfig {
    config: Arc<Config>,
    shared: Arc<Shared>,
    metrics: Arc<Metrics>,
    background: Arc<Background>,
}

/// What Envoy's module pointer for a stream points at: the core's flow for it, and what its
/// host (`abi_host::EnvoyHost`) reaches: the store, its config, its place to wait, the stats
/// it counts into and its config's background refreshes.
struct StreamContext {
    flow: Flow,
    shared: Arc<Shared>,
    config: Arc<Config>,
    place: Place,
    metrics: Arc<Metrics>,
    background: Arc<Background>,
    hooks: HookGuard,
}

impl StreamContext {
    fn host(&self, ptr: FilterEnvoyPtr) -> EnvoyHost<'_> {
        EnvoyHost { ptr, shared: &self.shared, config: &self.config, place: &self.place, metrics: &self.metrics,
                    background: &self.background }
    }
}

impl Drop for StreamContext {
    /// A stream that ends leaves its wait, hands on a key it leads (its waiters try again) and
    /// frees a refresh lock it carried (`Flow::end`: store and parking only, no Envoy call).
    fn drop(&mut self) {
        let mut flow = std::mem::replace(&mut self.flow, Flow::new(self.config.clone()));
        flow.end(&mut self.host(std::ptr::null_mut()));
    }
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

/// Runs a stream hook; a panic fails the stream open.
unsafe fn with_stream(envoy: FilterEnvoyPtr, module: FilterModulePtr, f: impl FnOnce(&mut Flow, &mut EnvoyHost) -> Action)
    -> Action {
    let ctx = enter_hook(module);
    // Field by field, so the destroy hook may reach `hooks` while the flow is borrowed.
    let mut host = EnvoyHost { ptr: envoy, shared: &(*ctx).shared, config: &(*ctx).config, place: &(*ctx).place,
                               metrics: &(*ctx).metrics, background: &(*ctx).background };
    let flow = &mut (*ctx).flow;
    let action = match catch_unwind(AssertUnwindSafe(|| f(flow, &mut host))) {
        Ok(action) => action,
        Err(_) => {
            flow.fail_open();
            Action::Continue
        }
    };
    leave_hook(ctx);
    action
}

fn headers_status(action: Action) -> u32 {
    match action {
        Action::Continue => HEADERS_CONTINUE,
        Action::Pause | Action::Stop => HEADERS_STOP_ITERATION,
    }
}

fn trailers_status(action: Action) -> u32 {
    match action {
        Action::Continue => TRAILERS_CONTINUE,
        // Parked (coalescing) or answered locally: the request stops here.
        Action::Pause | Action::Stop => TRAILERS_STOP_ITERATION,
    }
}

fn body_status(action: Action) -> u32 {
    match action {
        Action::Continue => BODY_CONTINUE,
        Action::Pause => BODY_STOP_ITERATION_AND_BUFFER,
        Action::Stop => BODY_STOP_ITERATION_NO_BUFFER,
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
    Box::into_raw(Box::new(StreamContext {
        flow: Flow::new(c.config.clone()), shared: c.shared.clone(), config: c.config.clone(), place,
        metrics: c.metrics.clone(), background: c.background.clone(), hooks: HookGuard::default(),
    }))
        as FilterModulePtr
}

/// # Safety
/// `module` is a pointer returned by `envoy_dynamic_module_on_http_filter_new`.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_destroy(module: FilterModulePtr) {
    // Dropping the stream unparks it and hands on a key it leads (`StreamContext::drop`). Inside one of the
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


/// The stream's one callout, its semantic lookup (`Host::callout`), answered: to the flow
/// (`result` not success: no answer; the request goes upstream).
///
/// # Safety
/// Called by Envoy with arrays valid during the call.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_http_callout_done(
    envoy: FilterEnvoyPtr, module: FilterModulePtr, _callout_id: u64, result: u32, headers: *const EnvoyHttpHeader,
    headers_size: usize, chunks: *const EnvoyBuffer, chunks_size: usize) {
    let headers = if headers.is_null() { &[][..] } else { std::slice::from_raw_parts(headers, headers_size) };
    let chunks = if chunks.is_null() { &[][..] } else { std::slice::from_raw_parts(chunks, chunks_size) };
    let ctx = enter_hook(module);
    // Field by field, so the destroy hook may reach `hooks` while the flow is borrowed.
    let mut host = EnvoyHost { ptr: envoy, shared: &(*ctx).shared, config: &(*ctx).config, place: &(*ctx).place,
                               metrics: &(*ctx).metrics, background: &(*ctx).background };
    let flow = &mut (*ctx).flow;
    let answered = catch_unwind(AssertUnwindSafe(|| {
        let answer = (result == CALLOUT_SUCCESS).then(|| {
            let pairs = headers.iter().map(|h| (String::from_utf8_lossy(h.key.as_slice()).into_owned(),
                                                String::from_utf8_lossy(h.value.as_slice()).into_owned())).collect();
            let size: usize = chunks.iter().map(|c| c.length).sum();
            let mut body = Vec::with_capacity(size.min(CALLOUT_ANSWER_BYTES));
            if size <= CALLOUT_ANSWER_BYTES {
                chunks.iter().for_each(|c| body.extend_from_slice(c.as_slice()));
            }
            CalloutAnswer { headers: Headers { pairs, not_utf8: Vec::new() }, body }
        });
        flow.on_callout(&mut host, answer);
    }));
    if answered.is_err() {
        // Fail open: a stopped request must not stay stopped.
        flow.fail_open();
        envoy_dynamic_module_callback_http_filter_continue_decoding(envoy);
    }
    leave_hook(ctx);
}

/// The semantic service's answers are small; a bigger one is not read (an error: upstream).
const CALLOUT_ANSWER_BYTES: usize = 64 * 1024;

// Hooks Envoy 1.40 resolves for every HTTP filter module. `scheduled` delivers coalescing wakes;
// the streams and watermarks are unused, so those do nothing (arguments after the pointers
// ignored).

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
    // Field by field, so the destroy hook may reach `hooks` while the flow is borrowed.
    let mut host = EnvoyHost { ptr: envoy, shared: &(*ctx).shared, config: &(*ctx).config, place: &(*ctx).place,
                               metrics: &(*ctx).metrics, background: &(*ctx).background };
    let flow = &mut (*ctx).flow;
    if catch_unwind(AssertUnwindSafe(|| flow.resume(&mut host, park::release_of(event_id)))).is_err() {
        // Fail open: a parked request must not stay stopped.
        flow.fail_open();
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_flows_actions_map_to_each_hooks_status() {
        assert_eq!([Action::Continue, Action::Pause, Action::Stop].map(headers_status),
                   [HEADERS_CONTINUE, HEADERS_STOP_ITERATION, HEADERS_STOP_ITERATION]);
        assert_eq!([Action::Continue, Action::Pause, Action::Stop].map(body_status),
                   [BODY_CONTINUE, BODY_STOP_ITERATION_AND_BUFFER, BODY_STOP_ITERATION_NO_BUFFER],
                   "a paused body keeps buffering; after a local reply what arrived is dropped");
        assert_eq!([Action::Continue, Action::Pause, Action::Stop].map(trailers_status),
                   [TRAILERS_CONTINUE, TRAILERS_STOP_ITERATION, TRAILERS_STOP_ITERATION]);
    }
}
