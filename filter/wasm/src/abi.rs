//! proxy-wasm ABI v0.2.1: raw host imports and safe wrappers. Nothing here knows about caching.

use meshcache_core::headermap::{decode_headers, Headers};
use meshcache_core::store::SharedData;

pub use crate::host::{Buffer, Map};

pub use meshcache_core::headermap::serialize_map;

pub const STATUS_OK: u32 = 0;

#[derive(Clone, Copy)]
#[repr(u32)]
pub enum LogLevel {
    Debug = 1,
    Info = 2,
    Warn = 3,
    Error = 4,
}

#[derive(Clone, Copy)]
#[repr(u32)]
pub enum MetricKind {
    Counter = 0,
    Gauge = 1,
}

extern "C" {
    fn proxy_log(level: u32, ptr: *const u8, len: usize) -> u32;
    fn proxy_get_log_level(out: *mut u32) -> u32;
    fn proxy_get_current_time_nanoseconds(out: *mut u64) -> u32;
    fn proxy_get_buffer_bytes(kind: u32, start: usize, max: usize, out_ptr: *mut *mut u8, out_len: *mut usize) -> u32;
    fn proxy_get_buffer_status(kind: u32, out_len: *mut usize, out_flags: *mut u32) -> u32;
    fn proxy_get_header_map_pairs(map: u32, out_ptr: *mut *mut u8, out_len: *mut usize) -> u32;
    fn proxy_set_header_map_pairs(map: u32, ptr: *const u8, len: usize) -> u32;
    fn proxy_get_header_map_value(map: u32, k: *const u8, kl: usize, out_ptr: *mut *mut u8, out_len: *mut usize) -> u32;
    fn proxy_replace_header_map_value(map: u32, k: *const u8, kl: usize, v: *const u8, vl: usize) -> u32;
    fn proxy_remove_header_map_value(map: u32, k: *const u8, kl: usize) -> u32;
    fn proxy_send_local_response(
        status: u32, details: *const u8, details_len: usize, body: *const u8, body_len: usize,
        headers: *const u8, headers_len: usize, grpc_status: i32,
    ) -> u32;
    fn proxy_get_shared_data(k: *const u8, kl: usize, out_ptr: *mut *mut u8, out_len: *mut usize, cas: *mut u32) -> u32;
    fn proxy_set_shared_data(k: *const u8, kl: usize, v: *const u8, vl: usize, cas: u32) -> u32;
    fn proxy_get_property(path: *const u8, path_len: usize, out_ptr: *mut *mut u8, out_len: *mut usize) -> u32;
    fn proxy_define_metric(kind: u32, name: *const u8, name_len: usize, out_id: *mut u32) -> u32;
    fn proxy_increment_metric(id: u32, delta: i64) -> u32;
    fn proxy_record_metric(id: u32, value: u64) -> u32;
    fn proxy_set_tick_period_milliseconds(period: u32) -> u32;
    fn proxy_set_buffer_bytes(kind: u32, start: usize, len: usize, data: *const u8, data_len: usize) -> u32;
    fn proxy_add_header_map_value(map: u32, k: *const u8, kl: usize, v: *const u8, vl: usize) -> u32;
    fn proxy_set_property(path: *const u8, path_len: usize, value: *const u8, value_len: usize) -> u32;
    fn proxy_register_shared_queue(name: *const u8, name_len: usize, out_id: *mut u32) -> u32;
    fn proxy_enqueue_shared_queue(id: u32, value: *const u8, value_len: usize) -> u32;
    fn proxy_dequeue_shared_queue(id: u32, out_ptr: *mut *mut u8, out_len: *mut usize) -> u32;
    fn proxy_set_effective_context(id: u32) -> u32;
    fn proxy_continue_stream(stream_type: u32) -> u32;
    fn proxy_http_call(
        upstream: *const u8, upstream_len: usize, headers: *const u8, headers_len: usize, body: *const u8,
        body_len: usize, trailers: *const u8, trailers_len: usize, timeout_ms: u32, token: *mut u32,
    ) -> u32;
    fn proxy_call_foreign_function(
        name: *const u8, name_len: usize, arg: *const u8, arg_len: usize, out_ptr: *mut *mut u8, out_len: *mut usize,
    ) -> u32;
}

/// Takes ownership of a host-returned buffer allocated by `proxy_on_memory_allocate`.
unsafe fn owned(ptr: *mut u8, len: usize) -> Vec<u8> {
    if ptr.is_null() || len == 0 {
        if !ptr.is_null() {
            drop(Vec::from_raw_parts(ptr, 0, 0));
        }
        return Vec::new();
    }
    Vec::from_raw_parts(ptr, len, len)
}

pub fn log(level: LogLevel, msg: &str) {
    unsafe {
        proxy_log(level as u32, msg.as_ptr(), msg.len());
    }
}

/// Whether Envoy's `wasm` logger writes lines at `level` (so a line is formatted only then).
pub fn log_enabled(level: LogLevel) -> bool {
    let mut current: u32 = LogLevel::Info as u32;
    let rc = unsafe { proxy_get_log_level(&mut current) };
    rc == STATUS_OK && current <= level as u32
}

pub fn now_ms() -> u64 {
    now_ns() / 1_000_000
}

pub fn now_ns() -> u64 {
    let mut t: u64 = 0;
    unsafe {
        proxy_get_current_time_nanoseconds(&mut t);
    }
    t
}

pub fn buffer(kind: Buffer, start: usize, max: usize) -> Option<Vec<u8>> {
    let mut p: *mut u8 = std::ptr::null_mut();
    let mut l: usize = 0;
    let rc = unsafe { proxy_get_buffer_bytes(kind as u32, start, max, &mut p, &mut l) };
    if rc != STATUS_OK {
        return None;
    }
    Some(unsafe { owned(p, l) })
}

thread_local! {
    /// Where the host's next allocation lands (`buffer_into`): spare capacity of a caller's
    /// buffer, so body bytes are written there directly instead of into a new allocation that
    /// is then copied.
    static LANDING: std::cell::Cell<Option<(*mut u8, usize)>> = std::cell::Cell::new(None);
}

/// The memory the host asks for through `proxy_on_memory_allocate`: the landing spot when one
/// is set and large enough (taken once), else a fresh allocation the caller frees.
pub fn host_allocation(size: usize) -> *mut u8 {
    if let Some((p, room)) = LANDING.with(|l| l.take()) {
        if size <= room {
            return p;
        }
    }
    let mut v: Vec<u8> = Vec::with_capacity(size);
    let p = v.as_mut_ptr();
    std::mem::forget(v);
    p
}

/// Appends up to `max` bytes of a body buffer from `start` to `out`, read straight into its
/// spare capacity; the number of bytes appended, or None when the host refused.
pub fn buffer_into(kind: Buffer, start: usize, max: usize, out: &mut Vec<u8>) -> Option<usize> {
    out.reserve(max);
    let spare = unsafe { out.as_mut_ptr().add(out.len()) };
    LANDING.with(|l| l.set(Some((spare, out.capacity() - out.len()))));
    let mut p: *mut u8 = std::ptr::null_mut();
    let mut l: usize = 0;
    let rc = unsafe { proxy_get_buffer_bytes(kind as u32, start, max, &mut p, &mut l) };
    LANDING.with(|l| l.set(None));
    if rc != STATUS_OK {
        return None;
    }
    if p == spare && l <= out.capacity() - out.len() {
        // The host wrote the bytes where we pointed it.
        unsafe { out.set_len(out.len() + l) };
    } else {
        // It allocated elsewhere (or returned nothing): ours to copy and free.
        out.extend_from_slice(&unsafe { owned(p, l) });
    }
    Some(l)
}

pub fn buffer_size(kind: Buffer) -> Option<usize> {
    let mut len: usize = 0;
    let mut flags: u32 = 0;
    let rc = unsafe { proxy_get_buffer_status(kind as u32, &mut len, &mut flags) };
    if rc == STATUS_OK {
        Some(len)
    } else {
        None
    }
}

pub fn headers(map: Map) -> Headers {
    let mut p: *mut u8 = std::ptr::null_mut();
    let mut l: usize = 0;
    let rc = unsafe { proxy_get_header_map_pairs(map as u32, &mut p, &mut l) };
    if rc != STATUS_OK {
        return Headers::default();
    }
    decode_headers(&unsafe { owned(p, l) })
}

pub fn header(map: Map, name: &str) -> Option<String> {
    let mut p: *mut u8 = std::ptr::null_mut();
    let mut l: usize = 0;
    let rc = unsafe { proxy_get_header_map_value(map as u32, name.as_ptr(), name.len(), &mut p, &mut l) };
    if rc != STATUS_OK {
        return None;
    }
    String::from_utf8(unsafe { owned(p, l) }).ok()
}

pub fn set_header(map: Map, name: &str, value: &str) {
    unsafe {
        proxy_replace_header_map_value(map as u32, name.as_ptr(), name.len(), value.as_ptr(), value.len());
    }
}

/// Replaces the whole map in one host call (cheaper than one call per changed header).
pub fn set_headers(map: Map, pairs: &[(&str, &str)]) -> bool {
    let b = serialize_map(pairs);
    unsafe { proxy_set_header_map_pairs(map as u32, b.as_ptr(), b.len()) == STATUS_OK }
}

pub fn add_header(map: Map, name: &str, value: &str) -> bool {
    unsafe { proxy_add_header_map_value(map as u32, name.as_ptr(), name.len(), value.as_ptr(), value.len()) == STATUS_OK }
}

/// Replaces `len` bytes at `start` of a body buffer with `data` (0, size: the whole buffer).
pub fn set_buffer(kind: Buffer, start: usize, len: usize, data: &[u8]) -> bool {
    unsafe { proxy_set_buffer_bytes(kind as u32, start, len, data.as_ptr(), data.len()) == STATUS_OK }
}

/// Sets a property of this stream; Envoy keeps it as filter state `wasm.<name>`, which route
/// matching can read and which a client cannot set.
pub fn set_property(name: &str, value: &[u8]) -> bool {
    unsafe { proxy_set_property(name.as_ptr(), name.len(), value.as_ptr(), value.len()) == STATUS_OK }
}

/// Calls one of Envoy's foreign functions (e.g. `clear_route_cache`); its result is dropped.
pub fn call_foreign(name: &str, arg: &[u8]) -> bool {
    let mut p: *mut u8 = std::ptr::null_mut();
    let mut l: usize = 0;
    let rc = unsafe { proxy_call_foreign_function(name.as_ptr(), name.len(), arg.as_ptr(), arg.len(), &mut p, &mut l) };
    drop(unsafe { owned(p, l) });
    rc == STATUS_OK
}

/// Registers (or re-opens) this VM's shared queue; `proxy_on_queue_ready` reports items.
pub fn register_queue(name: &str) -> Option<u32> {
    let mut id: u32 = 0;
    let rc = unsafe { proxy_register_shared_queue(name.as_ptr(), name.len(), &mut id) };
    if rc == STATUS_OK {
        Some(id)
    } else {
        None
    }
}

/// Sends a request to `cluster` on behalf of context `owner` (its callback arrives there:
/// a root context outlives the stream that asked), then makes `current` the effective context
/// again. The token names the answer in `proxy_on_http_call_response`.
pub fn http_call(owner: u32, current: u32, cluster: &str, headers: &[(&str, &str)], body: &[u8], timeout_ms: u32) -> Option<u32> {
    let h = serialize_map(headers);
    let t = serialize_map(&[]);
    let mut token: u32 = 0;
    let rc = unsafe {
        proxy_set_effective_context(owner);
        let rc = proxy_http_call(
            cluster.as_ptr(), cluster.len(), h.as_ptr(), h.len(), body.as_ptr(), body.len(), t.as_ptr(), t.len(), timeout_ms,
            &mut token,
        );
        proxy_set_effective_context(current);
        rc
    };
    if rc == STATUS_OK {
        Some(token)
    } else {
        None
    }
}

pub fn enqueue(queue: u32, value: &[u8]) -> bool {
    unsafe { proxy_enqueue_shared_queue(queue, value.as_ptr(), value.len()) == STATUS_OK }
}

/// The next item of a queue, or None when it is empty (or unknown).
pub fn dequeue(queue: u32) -> Option<Vec<u8>> {
    let mut p: *mut u8 = std::ptr::null_mut();
    let mut l: usize = 0;
    let rc = unsafe { proxy_dequeue_shared_queue(queue, &mut p, &mut l) };
    if rc != STATUS_OK {
        return None;
    }
    Some(unsafe { owned(p, l) })
}

/// Makes later host calls act on this stream (from a root callback such as a queue or tick).
pub fn set_effective_context(id: u32) -> bool {
    unsafe { proxy_set_effective_context(id) == STATUS_OK }
}

/// Resumes the effective stream's request (paused in its headers or body).
pub fn continue_request() -> bool {
    unsafe { proxy_continue_stream(0) == STATUS_OK }
}

#[allow(dead_code)]
pub fn remove_header(map: Map, name: &str) {
    unsafe {
        proxy_remove_header_map_value(map as u32, name.as_ptr(), name.len());
    }
}

/// `grpc_status` -1 leaves the reply as plain HTTP.
pub fn send_local_response(status: u32, details: &str, body: &[u8], headers: &[(&str, &str)], grpc_status: i32) -> bool {
    let h = serialize_map(headers);
    let rc = unsafe {
        proxy_send_local_response(status, details.as_ptr(), details.len(), body.as_ptr(), body.len(), h.as_ptr(), h.len(), grpc_status)
    };
    rc == STATUS_OK
}

pub fn property(path: &[&str]) -> Option<Vec<u8>> {
    let joined = path.join("\0");
    let mut p: *mut u8 = std::ptr::null_mut();
    let mut l: usize = 0;
    let rc = unsafe { proxy_get_property(joined.as_ptr(), joined.len(), &mut p, &mut l) };
    if rc != STATUS_OK {
        return None;
    }
    Some(unsafe { owned(p, l) })
}

pub fn define_metric(kind: MetricKind, name: &str) -> Option<u32> {
    let mut id: u32 = 0;
    let rc = unsafe { proxy_define_metric(kind as u32, name.as_ptr(), name.len(), &mut id) };
    if rc == STATUS_OK {
        Some(id)
    } else {
        None
    }
}

pub fn increment_metric(id: u32, delta: i64) {
    unsafe {
        proxy_increment_metric(id, delta);
    }
}

pub fn record_metric(id: u32, value: u64) {
    unsafe {
        proxy_record_metric(id, value);
    }
}

pub fn set_tick_period_ms(period: u32) {
    unsafe {
        proxy_set_tick_period_milliseconds(period);
    }
}

/// Envoy's process-wide shared data for this vm_id.
pub struct HostShared;

impl SharedData for HostShared {
    fn get(&self, key: &str) -> Option<(Vec<u8>, u32)> {
        let mut p: *mut u8 = std::ptr::null_mut();
        let mut l: usize = 0;
        let mut cas: u32 = 0;
        let rc = unsafe { proxy_get_shared_data(key.as_ptr(), key.len(), &mut p, &mut l, &mut cas) };
        if rc != STATUS_OK {
            return None;
        }
        Some((unsafe { owned(p, l) }, cas))
    }

    fn set(&self, key: &str, value: &[u8], cas: u32) -> bool {
        let rc = unsafe { proxy_set_shared_data(key.as_ptr(), key.len(), value.as_ptr(), value.len(), cas) };
        rc == STATUS_OK
    }
}
