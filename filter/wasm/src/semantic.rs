//! The semantic index service's calls (proxy-wasm glue, issue 38): a lookup on an exact miss
//! (its answer resumes the paused stream) and the fire-and-forget store and shadow reports, each
//! an HTTP call to the configured cluster bounded by `semantic_service.timeout_ms`, owned by the
//! root context (the stream may end first).

use crate::abi::{self, Buffer, Map};
use crate::abi_host::Abi;
use crate::stream;
use meshcache_core::config::SemanticService;
use meshcache_core::headermap;
use meshcache_core::semantic;
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

/// POSTs `body` to `path` of the service; `reply`: its answer resumes stream `stream`.
pub fn call(root: u32, stream: u32, service: &SemanticService, path: &str, body: &[u8], reply: bool) -> bool {
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
    let headers = [(":method", "POST"), (":path", path), (":authority", service.authority.as_str()),
                   ("content-type", "application/json"), ("content-length", length.as_str())];
    match abi::http_call(root, stream, &service.cluster, &headers, body, service.timeout_ms as u32) {
        Some(token) => {
            let call = Call { stream: if reply { Some(stream) } else { None }, forget_at_ms: now + 2 * service.timeout_ms + 1000 };
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
    let response = abi::headers(Map::HttpCallResponseHeaders);
    let body = if body_size == 0 || body_size > MAX_ANSWER_BYTES {
        Vec::new()
    } else {
        abi::buffer(Buffer::HttpCallResponseBody, 0, body_size).unwrap_or_default()
    };
    let verdict = semantic::verdict(headermap::header(&response.pairs, ":status"), &body);
    if abi::set_effective_context(stream_id) {
        stream::with(stream_id, |s| s.on_semantic_answer(&mut Abi, verdict));
    }
    true
}
