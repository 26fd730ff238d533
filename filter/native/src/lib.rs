//! meshcache as an Envoy dynamic module (`envoy.filters.http.dynamic_modules`), phase 1.
//!
//! This file is the host: the `envoy_dynamic_module_on_*` hooks Envoy calls, and `EnvoyHost`,
//! the `filter::Host` over Envoy's callbacks (abi.rs). Every hook catches panics: a bug fails
//! open (the request passes through), it never unwinds into Envoy.
//!
//! The store is process-wide: one per Envoy process, shared by every worker and every filter
//! config (an ECDS update replaces the config, not the cached entries), created with the first
//! config's limits.

pub mod abi;
pub mod config;
pub mod filter;
pub mod store;

use std::os::raw::{c_char, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use abi::*;
use filter::{Flow, Host, Stream};
use store::Store;

static STORE: OnceLock<Arc<Store>> = OnceLock::new();

struct FilterConfig {
    config: Arc<config::Config>,
    store: Arc<Store>,
}

struct EnvoyHost {
    ptr: FilterEnvoyPtr,
}

const INLINE_CHUNKS: usize = 16;

impl EnvoyHost {
    fn header(&self, kind: u32, name: &str) -> Option<&[u8]> {
        let mut out = EnvoyBuffer::EMPTY;
        // SAFETY: `ptr` is the stream Envoy passed to the running hook; the value stays valid
        // for the rest of that hook, which is as long as `&self` can be borrowed.
        unsafe {
            envoy_dynamic_module_callback_http_get_header(self.ptr, kind, ModuleBuffer::of(name.as_bytes()), &mut out, 0,
                                                          std::ptr::null_mut())
                .then(|| out.as_slice())
        }
    }

    fn visit(&self, body_type: u32, f: &mut dyn FnMut(&[u8])) {
        // SAFETY: as in `header`; `chunks` has room for the count Envoy reported just before.
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

impl Host for EnvoyHost {
    fn request_header(&self, name: &str) -> Option<&[u8]> {
        self.header(REQUEST_HEADER, name)
    }

    fn response_header(&self, name: &str) -> Option<&[u8]> {
        self.header(RESPONSE_HEADER, name)
    }

    fn set_response_header(&mut self, name: &str, value: &[u8]) {
        // SAFETY: as in `header`.
        unsafe {
            envoy_dynamic_module_callback_http_set_header(self.ptr, RESPONSE_HEADER, ModuleBuffer::of(name.as_bytes()),
                                                          ModuleBuffer::of(value));
        }
    }

    fn received_body(&self, response: bool, f: &mut dyn FnMut(&[u8])) {
        self.visit(if response { RECEIVED_RESPONSE_BODY } else { RECEIVED_REQUEST_BODY }, f);
    }

    fn whole_body(&self, response: bool, f: &mut dyn FnMut(&[u8])) {
        // SAFETY: as in `header`.
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
        // SAFETY: as in `header`; Envoy copies headers and body before returning.
        unsafe {
            envoy_dynamic_module_callback_http_send_response(self.ptr, status, hs.as_ptr(), hs.len(), ModuleBuffer::of(body),
                                                             ModuleBuffer::of(b"meshcache_hit"));
        }
    }

    fn now(&self) -> Instant {
        Instant::now()
    }
}

/// Runs a stream hook; a panic fails the stream open.
unsafe fn with_stream(envoy: FilterEnvoyPtr, module: FilterModulePtr, f: impl FnOnce(&mut Stream, &mut EnvoyHost) -> Flow)
    -> Flow {
    let stream = &mut *(module as *mut Stream);
    let mut host = EnvoyHost { ptr: envoy };
    match catch_unwind(AssertUnwindSafe(|| f(stream, &mut host))) {
        Ok(flow) => flow,
        Err(_) => {
            stream.fail_open();
            Flow::Continue
        }
    }
}

fn headers_status(flow: Flow) -> u32 {
    match flow {
        Flow::Continue => HEADERS_CONTINUE,
        Flow::Hold | Flow::Stop => HEADERS_STOP_ITERATION,
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
    abi::abi_version()
}

/// A null return makes Envoy reject the filter config (the error is on stderr).
///
/// # Safety
/// Called by Envoy with buffers valid for the call.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_new(
    _config_envoy: ConfigEnvoyPtr,
    _name: EnvoyBuffer,
    config: EnvoyBuffer,
) -> ConfigModulePtr {
    let bytes = config.as_slice();
    let made = catch_unwind(|| match config::parse(bytes) {
        Ok(c) => {
            let store = STORE
                .get_or_init(|| Arc::new(Store::new(c.max_total_bytes as usize, c.max_entry_bytes as usize)))
                .clone();
            Box::into_raw(Box::new(FilterConfig { config: Arc::new(c), store })) as ConfigModulePtr
        }
        Err(e) => {
            eprintln!("meshcache native filter: invalid config: {}", e);
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
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_new(config: ConfigModulePtr, _envoy: FilterEnvoyPtr)
    -> FilterModulePtr {
    let c = &*(config as *const FilterConfig);
    Box::into_raw(Box::new(Stream::new(c.config.clone(), c.store.clone()))) as FilterModulePtr
}

/// # Safety
/// `module` is a pointer returned by `envoy_dynamic_module_on_http_filter_new`.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_destroy(module: FilterModulePtr) {
    drop(Box::from_raw(module as *mut Stream));
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
    _envoy: FilterEnvoyPtr, _module: FilterModulePtr) -> u32 {
    TRAILERS_CONTINUE
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
    with_stream(envoy, module, |s, h| {
        s.on_response_trailers(h);
        Flow::Continue
    });
    TRAILERS_CONTINUE
}

/// # Safety
/// As for request headers.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_stream_complete(
    _envoy: FilterEnvoyPtr, _module: FilterModulePtr) {
}


// Hooks Envoy 1.40 resolves for every HTTP filter module; phase 1 uses no callouts, streams,
// scheduler events or watermarks, so they do nothing (arguments after the pointers ignored).
// Phase 2 wires `scheduled` to coalescing wakes and `http_callout_done` to background refreshes.

/// # Safety
/// Called by Envoy.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_http_callout_done(
    _envoy: FilterEnvoyPtr, _module: FilterModulePtr, _callout_id: u64, _result: u32, _headers: *const c_void,
    _headers_size: usize, _chunks: *const EnvoyBuffer, _chunks_size: usize) {
}

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
    _envoy: FilterEnvoyPtr, _module: FilterModulePtr, _event_id: u64) {
}

/// # Safety
/// Called by Envoy.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_scheduled(
    _config_envoy: ConfigEnvoyPtr, _config: ConfigModulePtr, _event_id: u64) {
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
