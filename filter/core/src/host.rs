//! What the per-stream flow (`flow`) asks of the proxy that runs it: one trait for both hosts.
//! The proxy-wasm host implements it over the Wasm ABI (filter/wasm/src/abi_host.rs), the
//! Envoy dynamic-module host over that ABI (filter/native/src/lib.rs), the core's scenario
//! suite over memory (flow_tests.rs). Calls act on the stream whose callback is running (or,
//! for a woken waiter, the stream being resumed). Where the two ABIs force a difference, one
//! method here says so (`send_grpc`, `take_stale_route`, `set_ours`, `reroute`, `grpc_hits_work`,
//! `callout`, `post`).

use crate::coalesce::{Refused, Release};
use crate::config::Limits;
use crate::hashing::KeyDigest;
use crate::headermap::Headers;
use crate::metric_names::{ERRORS, EVICTIONS};
use crate::request::Cacheable;
use crate::store::{Outcome, SharedData};

/// The header maps the flow reads or writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Map {
    RequestHeaders,
    ResponseHeaders,
    ResponseTrailers,
}

/// A stream's direction (for its body).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    Request,
    Response,
}

/// What a callback tells the proxy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    Continue,
    /// Headers: stop here. Body: stop and keep buffering (Envoy holds what arrived).
    Pause,
    /// A local reply was sent: stop, and drop what arrived.
    Stop,
}

/// Where a gRPC reply (an entry's message, framed, and a `grpc-status: 0` trailer) is sent from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GrpcAt {
    /// Instead of forwarding the request (a hit).
    Request,
    /// In place of the origin's error, from its response headers callback (stale-if-error);
    /// `eos`: those headers end the answer.
    ResponseHeaders { eos: bool },
}

/// What a gRPC request that may be answered stale after an origin error needs from its host.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StaleRoute {
    /// Nothing: the host can replace any gRPC error (native).
    NotNeeded,
    /// The request took the stale route: a trailers-only error arrives with a body to fill,
    /// and an error not replaced has its status moved to trailers (Wasm).
    Taken,
    /// It could not be marked: a gRPC error reaches the client as it is.
    Failed,
}

/// An HTTP callout's answer (`Host::callout`): None when it failed or timed out.
pub struct CalloutAnswer {
    pub headers: Headers,
    pub body: Vec<u8>,
}

pub trait Host {
    /// The process-wide store (Envoy's shared data, or the native host's own).
    type Shared: SharedData;
    fn shared(&self) -> &Self::Shared;

    fn headers(&mut self, map: Map) -> Headers;
    fn header(&mut self, map: Map, name: &str) -> Option<String> {
        let all = self.headers(map);
        crate::headermap::header(&all.pairs, name).map(str::to_string)
    }
    /// Sets (replaces) one header.
    fn set_header(&mut self, map: Map, name: &str, value: &str);
    /// Adds one header (a trailer added at the end of the body creates the trailers).
    fn add_header(&mut self, map: Map, name: &str, value: &str);
    fn remove_header(&mut self, map: Map, name: &str);
    /// Sets `ours` on a map the flow read as `base` and that has not changed since (held
    /// response headers): one call where the ABI can replace a whole map.
    fn set_ours(&mut self, map: Map, base: &[(String, String)], ours: &[(&str, &str)]) {
        let _ = base;
        for (n, v) in ours {
            self.set_header(map, n, v);
        }
    }

    /// The size of the body the host holds for `side` now (everything since the stream last
    /// continued); appends its bytes from `skip` on to `out` when they are at most `room`.
    /// None: unreadable.
    fn read_body(&mut self, side: Side, skip: usize, room: usize, out: &mut Vec<u8>) -> Option<usize>;

    /// A local HTTP reply (in the response path it replaces the origin's answer). False: failed.
    fn send_reply(&mut self, status: u32, details: &str, headers: &[(&str, &str)], body: &[u8]) -> bool;
    /// A gRPC reply in one pass: `headers` (without `:status`), `framed`, a `grpc-status: 0`
    /// trailer. The Wasm host routes it through the hit route's Lua step and fills it in the
    /// reply's own callbacks; the native host sends the three parts. None: not sent.
    fn send_grpc(&mut self, at: GrpcAt, headers: Vec<(String, String)>, framed: Vec<u8>) -> Option<Action>;
    /// False once gRPC hits have been seen to fail here (the hit route is missing): gRPC
    /// requests then bypass.
    fn grpc_hits_work(&self) -> bool {
        true
    }
    /// Prepares a gRPC request whose expired entry may answer an origin error.
    fn take_stale_route(&mut self, hold_headers: bool) -> StaleRoute {
        let _ = hold_headers;
        StaleRoute::NotNeeded
    }
    /// True: request headers wait for the body's decision even with `hold_headers: false` (the
    /// native host: its filter chain has no `allow_on_headers_stop_iteration` to lack).
    fn always_holds_request_headers(&self) -> bool {
        false
    }
    /// The routing key went on the request headers: the route is chosen again (Envoy does it
    /// itself after a Wasm filter changes headers; the native host asks for it).
    fn reroute(&mut self) {}
    /// Resumes the paused request (a woken waiter, or one back from a callout). False: failed.
    fn resume_request(&mut self) -> bool;

    /// Wall clock, milliseconds since the epoch.
    fn now_ms(&self) -> u64;
    /// The peer's identity (its certificate's URI SAN), for principal-scoped policies.
    fn peer_identity(&self) -> Option<String>;

    /// Adds to a counter (`metric_names`).
    fn count(&mut self, name: &str, n: u64);
    /// Adds `n` to a per-policy counter (`metric_names::POLICY_COUNTERS`).
    fn count_policy(&mut self, prefix: &str, what: &str, n: u64);
    /// An internal surprise: counted and logged; the caller fails open.
    fn error(&mut self, msg: &str);
    /// A line for Envoy's log at debug level, formatted only when that level is on.
    fn log_debug(&mut self, line: &dyn Fn() -> String);
    /// What a lookup or store freed on the way.
    fn record_outcome(&mut self, out: &Outcome) {
        if out.evicted > 0 {
            self.count(EVICTIONS, out.evicted as u64);
        }
        if out.corrupt > 0 {
            self.count(ERRORS, out.corrupt as u64);
        }
    }
    /// The store's size changed (a store, an eviction): hosts that report gauges per change do.
    fn gauges_changed(&mut self) {}

    /// This stream's place in the coalescing lock table: (its worker's queue, its id). None:
    /// it does not coalesce.
    fn place(&self) -> Option<(u32, u32)>;
    /// Parks this stream on `key` until its leader's release or `deadline_ms`; the host then
    /// calls `Flow::resume` (Wasm: its worker's wake queue and tick; native: the stream's
    /// scheduler and the process's timer thread).
    fn park(&mut self, key: &KeyDigest, deadline_ms: u64) -> Result<(), Refused>;
    /// This stream leaves any wait (it ends).
    fn unpark(&mut self);
    /// Wakes the streams parked on `key` in `queues` with their leader's outcome.
    fn wake(&mut self, queues: &[u32], key: &KeyDigest, release: Release);

    /// Sends `c`'s request again in the background (stale-while-revalidate), owned by
    /// something that outlives this stream; its answer goes to `revalidate::store_refresh`.
    /// False: it cannot be sent (this request refreshes instead).
    fn refresh(&mut self, c: &Cacheable, headers: &[(String, String)], body: &[u8], limits: &Limits) -> bool;

    /// This Envoy process's cache instance id (the store is per process): part of every
    /// semantic scope, so an index shared by sidecars never names another store's entry.
    fn instance_id(&mut self) -> String;
    /// Starts an HTTP callout from this stream to `cluster` (the semantic lookup, asked before
    /// the request goes upstream); its answer comes back through `Flow::on_callout`. False: not
    /// sent. Wasm: dispatched by the root context, answered to this stream; native: the stream's
    /// own callout.
    fn callout(&mut self, cluster: &str, headers: &[(&str, &str)], body: &[u8], timeout_ms: u64) -> bool;
    /// A fire-and-forget HTTP request to `cluster` (the semantic index store and shadow
    /// reports) owned by something that outlives this stream; its answer is not read. False:
    /// not sent.
    fn post(&mut self, cluster: &str, headers: &[(&str, &str)], body: &[u8], timeout_ms: u64) -> bool;
}
