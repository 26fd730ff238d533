//! What the Wasm flow (`stream`) asks of its host, as a trait: the proxy-wasm ABI implements it
//! (`abi::Abi`, one host call per method), and the tests' fake host implements it in memory, so
//! the flow's held, streamed, coalesced and stale cases run as `cargo test`s on the build
//! machine. Not compiled for wasm32 only: nothing here calls the ABI.

use meshcache_core::config::Limits;
use meshcache_core::headermap::Headers;
use meshcache_core::metric_names::{ERRORS, EVICTIONS};
use meshcache_core::request::Cacheable;
use meshcache_core::store::{Outcome, SharedData};

/// The proxy-wasm buffers the filter reads or writes (their ABI numbers).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum Buffer {
    RequestBody = 0,
    ResponseBody = 1,
    HttpCallResponseBody = 4,
    PluginConfiguration = 7,
}

/// The proxy-wasm header maps (their ABI numbers).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum Map {
    RequestHeaders = 0,
    ResponseHeaders = 2,
    ResponseTrailers = 3,
    HttpCallResponseHeaders = 6,
    HttpCallResponseTrailers = 7,
}

/// The host as the flow sees it. Calls act on the effective stream (the one whose callback is
/// running, or the one `set_effective_context` named).
pub trait Host {
    /// The process-wide store (Envoy's shared data for this vm_id). Cheap to get: a handle.
    type Shared: SharedData;
    fn shared(&self) -> Self::Shared;

    fn headers(&mut self, map: Map) -> Headers;
    fn header(&mut self, map: Map, name: &str) -> Option<String>;
    /// Sets (replaces) one header.
    fn set_header(&mut self, map: Map, name: &str, value: &str);
    /// Replaces the whole map.
    fn set_headers(&mut self, map: Map, pairs: &[(&str, &str)]) -> bool;
    fn add_header(&mut self, map: Map, name: &str, value: &str) -> bool;
    fn remove_header(&mut self, map: Map, name: &str);

    /// Up to `max` bytes of a body buffer from `start`.
    fn body(&mut self, kind: Buffer, start: usize, max: usize) -> Option<Vec<u8>>;
    /// Appends up to `max` bytes of a body buffer from `start` to `out`: how many.
    fn body_into(&mut self, kind: Buffer, start: usize, max: usize, out: &mut Vec<u8>) -> Option<usize>;
    /// Replaces `len` bytes at `start` of a body buffer with `data`.
    fn set_body(&mut self, kind: Buffer, start: usize, len: usize, data: &[u8]) -> bool;

    /// `grpc_status` -1 leaves the reply as plain HTTP.
    fn send_local_response(&mut self, status: u32, details: &str, body: &[u8], headers: &[(&str, &str)], grpc_status: i32) -> bool;
    /// Resumes the effective stream's request (paused in its headers or body).
    fn continue_request(&mut self) -> bool;
    /// Makes later calls act on stream `id` (from a root callback: queue, tick).
    fn set_effective_context(&mut self, id: u32) -> bool;

    fn now_ms(&self) -> u64;
    fn now_ns(&self) -> u64;
    /// The peer's identity (its certificate's URI SAN), for principal-scoped policies.
    fn peer_identity(&self) -> Option<String>;
    /// The upstream cluster Envoy chose for this request's route.
    fn upstream_cluster(&self) -> Option<String>;
    /// Sets a stream property (Envoy's filter state `wasm.<name>`).
    fn set_property(&mut self, name: &str, value: &[u8]) -> bool;
    /// The route is chosen again (after filter state or headers the routes match changed).
    fn clear_route_cache(&mut self) -> bool;

    /// Adds to a counter (`metric_names`).
    fn count(&mut self, name: &str, n: u64);
    /// Counts a per-policy event (`metric_names::POLICY_COUNTERS`).
    fn count_policy(&mut self, prefix: &str, what: &str, n: u64);
    /// An internal surprise: counted and logged; the caller fails open.
    fn error(&mut self, msg: &str);
    /// A line for Envoy's log at debug level (`meshcache_core::logs`), formatted only when that level is on.
    fn log_debug(&mut self, line: &dyn Fn() -> String);
    fn record_outcome(&mut self, out: &Outcome) {
        self.count(EVICTIONS, out.evicted as u64);
        self.count(ERRORS, out.corrupt as u64);
    }

    /// This worker's coalescing wake queue: registered, written by leaders, read when ready.
    fn register_queue(&mut self, name: &str) -> Option<u32>;
    fn enqueue(&mut self, queue: u32, message: &[u8]) -> bool;
    fn dequeue(&mut self, queue: u32) -> Option<Vec<u8>>;

    /// Sends `c`'s request again in the background, owned by root context `root`
    /// (stale-while-revalidate); its answer is stored in place of the stale entry. False: it
    /// cannot be sent (the client's request refreshes instead).
    #[allow(clippy::too_many_arguments)]
    fn refresh(&mut self, root: u32, stream: u32, c: &Cacheable, headers: &[(String, String)], body: &[u8], limits: &Limits,
               now: u64) -> bool;

    /// This Envoy process's cache instance: part of every semantic scope (docs/llm.md).
    fn semantic_instance(&mut self) -> String;
    /// POSTs `body` to the semantic index service's `path`, owned by root context `root`;
    /// `reply`: the answer goes to stream `stream`'s `on_semantic_answer` (false: fire and
    /// forget). False: not sent.
    #[allow(clippy::too_many_arguments)]
    fn semantic_call(&mut self, root: u32, stream: u32, service: &meshcache_core::config::SemanticService, path: &str, body: &[u8],
                     reply: bool) -> bool;
}
