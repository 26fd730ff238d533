//! The flow's HTTP calls to the semantic index service (issue 38) on the proxy-wasm ABI:
//! `Host::callout` (the lookup on an exact miss; its answer goes to the paused stream's
//! `Flow::on_callout`) and `Host::post` (the fire-and-forget store and shadow reports). Each is
//! dispatched by the root context (the stream may end first) and bounded by its timeout; the
//! process's cache instance id lives in shared data (`instance`).

use crate::abi::{self, Buffer, Map};
use crate::stream;
use meshcache_core::host::CalloutAnswer;
use std::cell::RefCell;
use std::collections::HashMap;

/// Calls in flight per worker: more are not sent (a lookup then goes upstream at once).
const MAX_CALLS: usize = 1024;
/// The service's answers are small; a bigger one is not read (an error: the request goes upstream).
const MAX_ANSWER_BYTES: usize = 64 * 1024;
/// Where the instance id lives in the process's shared data (one per Envoy process, as the store).
const INSTANCE_KEY: &str = "meshcache.semantic.instance";

struct Call {
    /// The stream that waits for this lookup's answer (None: fire and forget).
    stream: Option<u32>,
    /// Past this the call's callback can no longer come (its owner went away): forgotten.
    forget_at_ms: u64,
}

thread_local! {
    static CALLS: RefCell<HashMap<u32, Call>> = RefCell::new(HashMap::new());
    static INSTANCE: RefCell<String> = RefCell::new(String::new());
}

/// This Envoy process's cache instance id: made by the first worker that needs it and kept in
/// shared data, so every worker (one VM each) scopes with the same one. Two workers racing at
/// the first lookup may briefly use two ids: that loses semantic hits, never serves across stores.
pub fn instance() -> String {
    INSTANCE.with(|i| {
        let mut i = i.borrow_mut();
        if i.is_empty() {
            use meshcache_core::store::SharedData;
            let read = |shared: &abi::HostShared| shared.get(INSTANCE_KEY).and_then(|(v, _)| String::from_utf8(v).ok()).filter(|v| !v.is_empty());
            let shared = abi::HostShared;
            let id = match read(&shared) {
                Some(id) => id,
                None => {
                    let marker = 0u8;
                    let made = format!("{:016x}{:08x}", abi::now_ns(), &marker as *const u8 as usize as u32);
                    shared.set(INSTANCE_KEY, made.as_bytes(), 0);
                    read(&shared).unwrap_or(made)
                }
            };
            *i = id;
        }
        i.clone()
    })
}

/// Sends `body` to `cluster` from root context `root`; `reply`: its answer goes to stream
/// `stream`'s flow (false: fire and forget). False: not sent.
pub fn call(root: u32, stream: u32, cluster: &str, headers: &[(&str, &str)], body: &[u8], timeout_ms: u64, reply: bool) -> bool {
    let now = abi::now_ms();
    let full = CALLS.with(|c| {
        let mut c = c.borrow_mut();
        c.retain(|_, call| now < call.forget_at_ms);
        c.len() >= MAX_CALLS
    });
    if full {
        return false;
    }
    let length = body.len().to_string();
    let mut all = headers.to_vec();
    all.push(("content-length", length.as_str()));
    match abi::http_call(root, stream, cluster, &all, body, timeout_ms as u32) {
        Some(token) => {
            let call = Call { stream: if reply { Some(stream) } else { None }, forget_at_ms: now + 2 * timeout_ms + 1000 };
            CALLS.with(|c| c.borrow_mut().insert(token, call));
            true
        }
        None => false,
    }
}

/// A call's answer (or its failure: no headers). False: not one of ours.
pub fn on_response(token: u32, body_size: usize) -> bool {
    let call = match CALLS.with(|c| c.borrow_mut().remove(&token)) {
        Some(call) => call,
        None => return false,
    };
    let stream_id = match call.stream {
        Some(id) => id,
        None => return true,
    };
    let headers = abi::headers(Map::HttpCallResponseHeaders);
    // A failed call (reset, timed out) has no `:status`.
    let answer = if headers.pairs.iter().any(|(n, _)| n == ":status") {
        let body = if body_size == 0 || body_size > MAX_ANSWER_BYTES {
            Vec::new()
        } else {
            abi::buffer(Buffer::HttpCallResponseBody, 0, body_size).unwrap_or_default()
        };
        Some(CalloutAnswer { headers, body })
    } else {
        None
    };
    if abi::set_effective_context(stream_id) {
        stream::with(stream_id, 0, |flow, h| {
            flow.on_callout(h, answer);
            meshcache_core::host::Action::Continue
        });
    }
    true
}
