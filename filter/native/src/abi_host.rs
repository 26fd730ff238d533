//! The flow's `Host` (`meshcache_core::host`) over Envoy's dynamic-module ABI (abi.rs): one
//! stream during one of its hooks. Local replies are `send_response_*` (a gRPC reply is sent in
//! one pass: headers, framed message, `grpc-status: 0` trailer, no hit route); coalesced waiters
//! park on the process's `Parking` with their scheduler handle; background refreshes go to the
//! filter config's `Background`. The semantic lookup is the stream's own HTTP callout (answered
//! in `on_http_filter_http_callout_done`); index store and shadow posts are config-level
//! callouts the main thread sends (`Background::post`): they outlive the stream.

use std::ffi::c_void;

use meshcache_core::coalesce::{Refused, Release};
use meshcache_core::config::{Config, Limits};
use meshcache_core::hashing::KeyDigest;
use meshcache_core::headermap::Headers;
use meshcache_core::host::{Action, GrpcAt, Host, Map, Side};
use meshcache_core::metric_names;
use meshcache_core::request::Cacheable;

use crate::abi::*;
use crate::background::{Background, Job, Post};
use crate::metrics::{record_gauges, Metrics};
use crate::park::{Parking, Wake};
use crate::store::Shared;

/// Where a stream waits when it coalesces: the process's parking, its worker's queue and its
/// own id there.
pub struct Place {
    pub parking: std::sync::Arc<Parking>,
    pub queue: u32,
    pub id: u32,
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

/// One stream in one hook. `ptr` is null when the stream is destroyed (no hook runs): then
/// only the store and the parking are used (`Flow::end`).
pub struct EnvoyHost<'m> {
    pub ptr: FilterEnvoyPtr,
    pub shared: &'m Shared,
    pub config: &'m Config,
    pub place: &'m Place,
    pub metrics: &'m Metrics,
    pub background: &'m Background,
}

const INLINE_CHUNKS: usize = 16;

fn kind(m: Map) -> u32 {
    match m {
        Map::RequestHeaders => REQUEST_HEADER,
        Map::ResponseHeaders => RESPONSE_HEADER,
        Map::ResponseTrailers => RESPONSE_TRAILER,
    }
}

fn module_headers<'a>(headers: &'a [(&str, &str)]) -> Vec<ModuleHttpHeader> {
    headers.iter().map(|(k, v)| ModuleHttpHeader::of(k.as_bytes(), v.as_bytes())).collect::<Vec<_>>()
}

impl EnvoyHost<'_> {
    fn set(&mut self, kind: u32, name: &str, value: Option<&[u8]>) {
        let value = value.map_or(ModuleBuffer { ptr: std::ptr::null(), length: 0 }, ModuleBuffer::of);
        // SAFETY: `ptr` is the stream Envoy passed to the running hook.
        unsafe {
            envoy_dynamic_module_callback_http_set_header(self.ptr, kind, ModuleBuffer::of(name.as_bytes()), value);
        }
    }

    /// Appends the body chunks of `body_type` (valid for the rest of the hook) to `out`.
    fn chunks(&self, body_type: u32, out: &mut Vec<EnvoyBuffer>) {
        // SAFETY: as in `set`; `got` has room for the count Envoy reported just before.
        unsafe {
            let n = envoy_dynamic_module_callback_http_get_body_chunks_size(self.ptr, body_type);
            if n == 0 {
                return;
            }
            let from = out.len();
            out.resize(from + n, EnvoyBuffer::EMPTY);
            if !envoy_dynamic_module_callback_http_get_body_chunks(self.ptr, body_type, out[from..].as_mut_ptr()) {
                out.truncate(from);
            }
        }
    }
}

/// `Host::read_body` over the held body's chunks: their total size; the bytes from `skip` on
/// appended to `out` when they are at most `room`.
fn append_held(chunks: &[&[u8]], skip: usize, room: usize, out: &mut Vec<u8>) -> usize {
    let size: usize = chunks.iter().map(|c| c.len()).sum();
    if size.saturating_sub(skip) <= room {
        let mut skip = skip;
        for bytes in chunks {
            let from = skip.min(bytes.len());
            out.extend_from_slice(&bytes[from..]);
            skip -= from;
        }
    }
    size
}

impl Host for EnvoyHost<'_> {
    type Shared = Shared;
    fn shared(&self) -> &Shared {
        self.shared
    }

    fn headers(&mut self, m: Map) -> Headers {
        let mut out = Headers::default();
        // SAFETY: as in `set`; the entries stay valid for the rest of the hook and are copied out
        // before it returns; `all` has room for the count Envoy reported just before.
        unsafe {
            let n = envoy_dynamic_module_callback_http_get_headers_size(self.ptr, kind(m));
            if n == 0 {
                return out;
            }
            let mut all = vec![EnvoyHttpHeader::EMPTY; n];
            if !envoy_dynamic_module_callback_http_get_headers(self.ptr, kind(m), all.as_mut_ptr()) {
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

    fn set_header(&mut self, m: Map, name: &str, value: &str) {
        self.set(kind(m), name, Some(value.as_bytes()));
    }

    fn add_header(&mut self, m: Map, name: &str, value: &str) {
        self.set(kind(m), name, Some(value.as_bytes()));
    }

    fn remove_header(&mut self, m: Map, name: &str) {
        self.set(kind(m), name, None);
    }

    /// Envoy's held body (`buffered`, unless what arrived now is the held body) and what
    /// arrived with this hook, in one pass over their chunks.
    fn read_body(&mut self, side: Side, skip: usize, room: usize, out: &mut Vec<u8>) -> Option<usize> {
        let response = side == Side::Response;
        // SAFETY: as in `set`.
        let received_is_held = unsafe {
            if response {
                envoy_dynamic_module_callback_http_received_buffered_response_body(self.ptr)
            } else {
                envoy_dynamic_module_callback_http_received_buffered_request_body(self.ptr)
            }
        };
        let mut chunks = Vec::with_capacity(INLINE_CHUNKS);
        if !received_is_held {
            self.chunks(if response { BUFFERED_RESPONSE_BODY } else { BUFFERED_REQUEST_BODY }, &mut chunks);
        }
        self.chunks(if response { RECEIVED_RESPONSE_BODY } else { RECEIVED_REQUEST_BODY }, &mut chunks);
        // SAFETY: chunks Envoy gave this hook.
        let slices: Vec<&[u8]> = chunks.iter().map(|c| unsafe { c.as_slice() }).collect();
        Some(append_held(&slices, skip, room, out))
    }

    fn send_reply(&mut self, status: u32, details: &str, headers: &[(&str, &str)], body: &[u8]) -> bool {
        let hs = module_headers(headers);
        // SAFETY: as in `set`; Envoy copies headers and body before returning.
        unsafe {
            envoy_dynamic_module_callback_http_send_response(self.ptr, status, hs.as_ptr(), hs.len(), ModuleBuffer::of(body),
                                                             ModuleBuffer::of(details.as_bytes()));
        }
        true
    }

    /// Headers, message and trailer through the stream's encoder, from inside the hook (in the
    /// response headers hook this replaces the origin's error, as Envoy's own local reply in
    /// the response path does; sent later instead, the answer's body would resume the stopped
    /// error and end the stream before the trailer).
    fn send_grpc(&mut self, at: GrpcAt, headers: Vec<(String, String)>, framed: Vec<u8>) -> Option<Action> {
        let mut all: Vec<(&str, &str)> = vec![(":status", "200")];
        all.extend(headers.iter().map(|(n, v)| (n.as_str(), v.as_str())));
        let hs = module_headers(&all);
        let ts = module_headers(&[("grpc-status", "0")]);
        // SAFETY: as in `set`; Envoy copies headers, body and trailers before returning.
        unsafe {
            envoy_dynamic_module_callback_http_send_response_headers(self.ptr, hs.as_ptr(), hs.len(), false);
            envoy_dynamic_module_callback_http_send_response_data(self.ptr, ModuleBuffer::of(&framed), false);
            envoy_dynamic_module_callback_http_send_response_trailers(self.ptr, ts.as_ptr(), ts.len());
        }
        Some(if at == GrpcAt::Request { Action::Stop } else { Action::Pause })
    }

    fn always_holds_request_headers(&self) -> bool {
        true
    }

    fn reroute(&mut self) {
        // SAFETY: as in `set`.
        unsafe { envoy_dynamic_module_callback_http_clear_route_cache(self.ptr) }
    }

    fn resume_request(&mut self) -> bool {
        // SAFETY: as in `set`.
        unsafe { envoy_dynamic_module_callback_http_filter_continue_decoding(self.ptr) }
        true
    }

    fn now_ms(&self) -> u64 {
        crate::now_ms()
    }

    fn peer_identity(&self) -> Option<String> {
        let mut out = EnvoyBuffer::EMPTY;
        // SAFETY: as in `set`; the value is copied out before the hook returns.
        unsafe {
            envoy_dynamic_module_callback_http_filter_get_attribute_string(
                self.ptr, ATTRIBUTE_CONNECTION_URI_SAN_PEER_CERTIFICATE, &mut out)
                .then(|| String::from_utf8(out.as_slice().to_vec()).ok())
                .flatten()
        }
    }

    fn count(&mut self, name: &str, n: u64) {
        if !self.ptr.is_null() {
            // SAFETY: as in `set`.
            unsafe { self.metrics.count(self.ptr, name, n) }
        }
    }

    fn count_policy(&mut self, prefix: &str, what: &str, n: u64) {
        self.count(&metric_names::policy_metric(prefix, what), n);
    }

    fn error(&mut self, msg: &str) {
        self.count(metric_names::ERRORS, 1);
        // SAFETY: a plain call; Envoy copies the message before returning.
        unsafe { envoy_dynamic_module_callback_log(LOG_ERROR, ModuleBuffer::of(format!("meshcache: {}", msg).as_bytes())) }
    }

    fn log_debug(&mut self, line: &dyn Fn() -> String) {
        // SAFETY: plain calls; Envoy copies the message before returning.
        unsafe {
            if envoy_dynamic_module_callback_log_enabled(LOG_DEBUG) {
                envoy_dynamic_module_callback_log(LOG_DEBUG, ModuleBuffer::of(line().as_bytes()));
            }
        }
    }

    /// Entries and bytes follow each change here (the Wasm host reports them on its tick).
    fn gauges_changed(&mut self) {
        if self.ptr.is_null() {
            return;
        }
        let (metrics, ptr) = (self.metrics, self.ptr);
        // SAFETY: as in `set`.
        record_gauges(self.shared, self.config, &mut |name, value| unsafe { metrics.set_gauge(ptr, name, value) });
    }

    fn place(&self) -> Option<(u32, u32)> {
        Some((self.place.queue, self.place.id))
    }

    fn park(&mut self, key: &KeyDigest, deadline_ms: u64) -> Result<(), Refused> {
        // SAFETY: as in `set` (the handle is created on the stream's worker, in its hook).
        let s = unsafe { envoy_dynamic_module_callback_http_filter_scheduler_new(self.ptr) };
        if s.is_null() {
            return Err(Refused::AllFull);
        }
        let p = self.place;
        p.parking.park(p.queue, p.id, key, deadline_ms, Box::new(Scheduler(s)))
    }

    fn unpark(&mut self) {
        self.place.parking.unpark(self.place.queue, self.place.id);
    }

    fn wake(&mut self, queues: &[u32], key: &KeyDigest, release: Release) {
        self.place.parking.wake(queues, key, release);
    }

    fn refresh(&mut self, c: &Cacheable, headers: &[(String, String)], body: &[u8], _limits: &Limits) -> bool {
        let mut cluster = EnvoyBuffer::EMPTY;
        // SAFETY: as in `set`; the name is copied out before the hook returns.
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

    fn instance_id(&mut self) -> String {
        instance_id().to_string()
    }

    fn callout(&mut self, cluster: &str, headers: &[(&str, &str)], body: &[u8], timeout_ms: u64) -> bool {
        let hs = module_headers(headers);
        let mut id = 0u64;
        // SAFETY: as in `set`; Envoy copies cluster, headers and body during the call (and sets
        // content-length).
        unsafe {
            envoy_dynamic_module_callback_http_filter_http_callout(self.ptr, &mut id, ModuleBuffer::of(cluster.as_bytes()),
                hs.as_ptr(), hs.len(), ModuleBuffer::of(body), timeout_ms) == CALLOUT_SUCCESS
        }
    }

    fn post(&mut self, cluster: &str, headers: &[(&str, &str)], body: &[u8], timeout_ms: u64) -> bool {
        let headers = headers.iter().map(|(n, v)| (n.to_string(), v.to_string())).collect();
        self.background.post(Post { cluster: cluster.to_string(), headers, body: body.to_vec(), timeout_ms })
    }
}

/// This Envoy process's cache instance id (the store lives in process memory: one per
/// process), made once from the clock and the process id.
fn instance_id() -> &'static str {
    static INSTANCE: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    INSTANCE.get_or_init(|| {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
        format!("{:016x}{:08x}", nanos, std::process::id())
    })
}

#[cfg(test)]
mod tests {
    use super::append_held;

    #[test]
    fn the_held_body_is_read_past_what_was_copied_across_chunks_and_only_when_it_fits() {
        let chunks: [&[u8]; 3] = [b"abc", b"", b"defg"];
        let mut out = b"ab".to_vec();
        assert_eq!(append_held(&chunks, 2, 5, &mut out), 7);
        assert_eq!(out, b"abcdefg", "from the third byte on, across the chunks");
        let mut out = Vec::new();
        assert_eq!(append_held(&chunks, 0, 6, &mut out), 7, "the size, always");
        assert!(out.is_empty(), "past the room: nothing copied");
        assert_eq!(append_held(&[], 0, 0, &mut out), 0);
    }
}
