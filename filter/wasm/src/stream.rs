//! HTTP stream contexts of the proxy-wasm host: each stream's `Flow` (the core's per-stream
//! flow) by context id, the worker's coalescing wake queue, and the single-pass gRPC reply the
//! hit route's Lua step lets the filter fill. Thread-locals here are per VM/worker.

use crate::abi::{self, Buffer, Map};
use crate::abi_host::Abi;
use meshcache_core::coalesce::{self, LockTable, Waiters};
use meshcache_core::config::Config;
use meshcache_core::flow::Flow;
use meshcache_core::host::{Action, GrpcAt, StaleRoute};
use meshcache_core::names;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::sync::Arc;

const CONTINUE: u32 = 0;
const PAUSE: u32 = 1;

struct Stream {
    flow: Flow,
    /// The root context: owns background refreshes, which outlive the stream.
    root: u32,
}

thread_local! {
    static STREAMS: RefCell<HashMap<u32, Stream>> = RefCell::new(HashMap::new());
    /// This worker's paused coalescing waiters, and its wake queue once a root registered it.
    pub(crate) static WAITERS: RefCell<Waiters> = RefCell::new(Waiters::default());
    pub(crate) static WAKE_QUEUE: Cell<Option<u32>> = Cell::new(None);
    static WAKE_NAME: RefCell<String> = RefCell::new(String::new());
}

pub fn create(id: u32, root: u32, config: Option<Arc<Config>>) {
    match config {
        Some(config) => STREAMS.with(|s| s.borrow_mut().insert(id, Stream { flow: Flow::new(config), root })),
        None => {
            crate::metrics::error("stream without a configured plugin; passing through");
            None
        }
    };
}

pub fn delete(id: u32) {
    GRPC_REPLIES.with(|r| r.borrow_mut().remove(&id));
    if let Some(mut s) = STREAMS.with(|s| s.borrow_mut().remove(&id)) {
        s.flow.end(&mut Abi { id, root: s.root, body: 0 });
    }
}

/// Runs a callback with the stream taken out of the map, so a host call that re-enters the
/// module for the same stream (a local reply runs on_response_headers) finds nothing to do.
/// `body`: the size of the body buffer the callback reported.
pub fn with<F: FnOnce(&mut Flow, &mut Abi) -> Action>(id: u32, body: usize, f: F) -> u32 {
    let mut stream = match STREAMS.with(|s| s.borrow_mut().remove(&id)) {
        Some(s) => s,
        None => return CONTINUE,
    };
    let action = f(&mut stream.flow, &mut Abi { id, root: stream.root, body });
    STREAMS.with(|s| s.borrow_mut().insert(id, stream));
    match action {
        Action::Continue => CONTINUE,
        Action::Pause | Action::Stop => PAUSE,
    }
}

// ---------------------------------------------------------------- request coalescing
//
// The lock table (shared data) says which key is in flight and which workers wait on it; each
// worker keeps its own paused waiters (`WAITERS`) and a shared queue the leaders' releases are
// sent to (`Abi::wake`). `on_queue_ready` resumes the waiters of a released key; the root's
// tick resumes those whose `coalesce_timeout_ms` has passed.

/// Wake messages handled per queue callback (the rest wait for the next one).
const MAX_WAKES_PER_CALLBACK: usize = 4096;

/// Called by each root context's `on_configure`: the lock table exists, and this worker's
/// queue is registered under a name no other worker uses (registering it again points it at
/// the newest root context).
pub fn setup_coalescing() {
    LockTable { data: &abi::HostShared }.create_slots();
    let name = WAKE_NAME.with(|n| {
        let mut n = n.borrow_mut();
        if n.is_empty() {
            *n = format!("meshcache:wake:{}", abi::now_ns());
        }
        n.clone()
    });
    match abi::register_queue(&name) {
        Some(q) => WAKE_QUEUE.with(|w| w.set(Some(q))),
        None => crate::metrics::error("could not register the coalescing queue; identical misses are not coalesced"),
    }
}

/// Resumes a parked stream as the effective one.
fn resume(id: u32, release: Option<coalesce::Release>) {
    if abi::set_effective_context(id) {
        with(id, 0, |flow, h| {
            flow.resume(h, release);
            Action::Continue
        });
    }
}

pub fn on_queue_ready(queue: u32) {
    for _ in 0..MAX_WAKES_PER_CALLBACK {
        let message = match abi::dequeue(queue) {
            Some(m) => m,
            None => return,
        };
        match coalesce::decode_wake(&message) {
            Some((key, release)) => {
                for (id, _) in WAITERS.with(|w| w.borrow_mut().take(&key)) {
                    resume(id, Some(release));
                }
            }
            None => crate::metrics::error("unreadable coalescing wake message"),
        }
    }
}

/// The root's tick: waiters past their deadline go upstream themselves.
pub fn expire_waiters() {
    if WAITERS.with(|w| w.borrow().is_empty()) {
        return;
    }
    for id in WAITERS.with(|w| w.borrow_mut().expired(abi::now_ms())) {
        resume(id, None);
    }
}

// ---------------------------------------------------------------- single-pass gRPC replies
//
// A local reply to a gRPC request is headers-only (trailers-only) in Envoy. The hit route's Lua
// step (`meshcache.grpc_hit_body`, see docs/filter.md) gives it an empty body; the reply's
// response callbacks, which may run while `send_local_response` is still on the stack (the
// stream is then out of STREAMS), find the answer here, write the headers, the framed message
// and a `grpc-status: 0` trailer. Stale-if-error fills the body the stale route gave an error.

struct GrpcReply {
    headers: Vec<(String, String)>,
    framed: Vec<u8>,
}

thread_local! {
    static GRPC_REPLIES: RefCell<HashMap<u32, GrpcReply>> = RefCell::new(HashMap::new());
    /// Set when a hit reply arrived without the body the hit route's Lua step adds: this Envoy
    /// lacks the route or the Lua filter, so gRPC requests bypass from then on (fail open).
    pub(crate) static GRPC_HITS_BROKEN: Cell<bool> = Cell::new(false);
}

const LOCAL_MARKER: &str = "meshcache_local";
/// Filter state `wasm.meshcache_stale`: selects the stale route, whose Lua step gives a gRPC
/// error (trailers-only) a body the filter can fill with the stale message.
const STALE_MARKER: &str = "meshcache_stale";

/// `Host::send_grpc` for this ABI.
pub fn send_grpc(id: u32, at: GrpcAt, headers: Vec<(String, String)>, framed: Vec<u8>) -> Option<Action> {
    match at {
        GrpcAt::ResponseHeaders { eos: true } => None, // no body to fill: the stale route is missing here
        GrpcAt::ResponseHeaders { eos: false } => {
            let mut all: Vec<(&str, &str)> = vec![(":status", "200")];
            all.extend(headers.iter().map(|(n, v)| (n.as_str(), v.as_str())));
            if !abi::set_headers(Map::ResponseHeaders, &all) {
                return None;
            }
            GRPC_REPLIES.with(|r| r.borrow_mut().insert(id, GrpcReply { headers: Vec::new(), framed }));
            Some(Action::Continue)
        }
        GrpcAt::Request => {
            // Marks the request (filter state, so the local reply selects the hit route), then
            // sends the empty local reply that `grpc_reply_*` fill.
            if !mark(LOCAL_MARKER) {
                return None;
            }
            GRPC_REPLIES.with(|r| r.borrow_mut().insert(id, GrpcReply { headers, framed }));
            if !abi::send_local_response(200, "meshcache_hit", b"", &[], 0) {
                GRPC_REPLIES.with(|r| r.borrow_mut().remove(&id));
                unmark(LOCAL_MARKER);
                return None;
            }
            Some(Action::Pause)
        }
    }
}

fn mark(marker: &str) -> bool {
    if abi::set_property(marker, b"1") && abi::call_foreign("clear_route_cache", b"") {
        return true;
    }
    unmark(marker);
    false
}

fn unmark(marker: &str) {
    abi::set_property(marker, b"0");
    abi::call_foreign("clear_route_cache", b"");
}

/// `Host::take_stale_route`: marks a gRPC request for the stale route. With held headers the
/// route forwards too: to the cluster the original route chose.
pub fn take_stale_route(hold_headers: bool) -> StaleRoute {
    if hold_headers {
        match crate::background::cluster_name() {
            Some(c) => abi::set_header(Map::RequestHeaders, names::UPSTREAM_CLUSTER_HEADER, &c),
            None => {
                crate::metrics::error("stale-if-error: the request's upstream cluster is unknown; gRPC errors pass");
                return StaleRoute::Failed;
            }
        }
    }
    if !mark(STALE_MARKER) {
        crate::metrics::error("stale-if-error: could not mark the gRPC request; gRPC errors pass");
        return StaleRoute::Failed;
    }
    StaleRoute::Taken
}

/// Response headers of a stream's pending gRPC reply, if it has one.
pub fn grpc_reply_headers(id: u32, eos: bool) -> Option<u32> {
    let headers = GRPC_REPLIES.with(|r| r.borrow().get(&id).map(|g| g.headers.clone()))?;
    if eos {
        // No body will follow: the message cannot be delivered. Say so rather than answer OK
        // without a message; gRPC clients retry UNAVAILABLE.
        GRPC_REPLIES.with(|r| r.borrow_mut().remove(&id));
        GRPC_HITS_BROKEN.with(|b| b.set(true));
        crate::metrics::error("gRPC hit reply without a body: the meshcache_grpc_hit route or the meshcache.grpc_hit_body Lua filter is missing; gRPC requests bypass the cache from now on");
        abi::set_headers(
            Map::ResponseHeaders,
            &[(":status", "200"), ("content-type", "application/grpc"), ("grpc-status", "14"),
              ("grpc-message", "meshcache: gRPC hit route missing; retry")],
        );
        return Some(CONTINUE);
    }
    if !headers.is_empty() {
        let mut all: Vec<(&str, &str)> = vec![(":status", "200")];
        all.extend(headers.iter().map(|(n, v)| (n.as_str(), v.as_str())));
        abi::set_headers(Map::ResponseHeaders, &all);
    }
    Some(CONTINUE)
}

/// Body of a stream's pending gRPC reply: the framed message, then the trailer.
pub fn grpc_reply_body(id: u32, size: usize, eos: bool) -> Option<u32> {
    if !eos {
        return GRPC_REPLIES.with(|r| r.borrow().contains_key(&id)).then(|| CONTINUE);
    }
    let reply = GRPC_REPLIES.with(|r| r.borrow_mut().remove(&id))?;
    if !abi::set_buffer(Buffer::ResponseBody, 0, size, &reply.framed) {
        crate::metrics::error("gRPC reply: could not write the message");
    }
    // Adding to the (absent) trailers at end of stream makes Envoy create them.
    abi::add_header(Map::ResponseTrailers, "grpc-status", "0");
    Some(CONTINUE)
}
