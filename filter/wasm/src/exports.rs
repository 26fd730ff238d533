//! The proxy-wasm ABI 0.2.1 callbacks the module exports: thin dispatch to the root and stream
//! contexts. `proxy_on_done` and `proxy_on_log` are deliberately not exported: the host skips
//! callbacks a module does not export, which saves two VM crossings per request.

use crate::abi::{self, Buffer};
use crate::{background, root, semantic, stream};

/// The host allocates returned data through this export; we own it afterwards.
#[no_mangle]
pub extern "C" fn proxy_on_memory_allocate(size: usize) -> *mut u8 {
    abi::host_allocation(size)
}

#[no_mangle]
pub extern "C" fn proxy_abi_version_0_2_1() {}

#[no_mangle]
pub extern "C" fn proxy_on_vm_start(_root: u32, _size: usize) -> u32 {
    1
}

#[no_mangle]
pub extern "C" fn proxy_on_context_create(id: u32, parent: u32) {
    if parent == 0 {
        root::create(id);
    } else {
        stream::create(id, parent, root::config_of(parent));
    }
}

#[no_mangle]
pub extern "C" fn proxy_on_configure(root_id: u32, size: usize) -> u32 {
    root::on_configure(root_id, size) as u32
}

#[no_mangle]
pub extern "C" fn proxy_on_tick(root_id: u32) {
    root::on_tick(root_id);
}

/// A leader released a key this worker's requests wait on (request coalescing).
#[no_mangle]
pub extern "C" fn proxy_on_queue_ready(_root: u32, queue: u32) {
    stream::on_queue_ready(queue);
}

#[no_mangle]
pub extern "C" fn proxy_on_delete(id: u32) {
    if root::is_root(id) {
        root::delete(id);
    } else {
        stream::delete(id);
    }
}

#[no_mangle]
pub extern "C" fn proxy_on_request_headers(id: u32, _n: usize, eos: u32) -> u32 {
    stream::with(id, 0, |f, h| f.on_request_headers(h, eos != 0))
}

#[no_mangle]
pub extern "C" fn proxy_on_request_body(id: u32, size: usize, eos: u32) -> u32 {
    stream::with(id, size, |f, h| f.on_request_body(h, eos != 0))
}

#[no_mangle]
pub extern "C" fn proxy_on_request_trailers(id: u32, _n: usize) -> u32 {
    // Trailers end the request: decide on whatever body was buffered.
    let size = abi::buffer_size(Buffer::RequestBody).unwrap_or(0);
    stream::with(id, size, |f, h| f.on_request_trailers(h))
}

#[no_mangle]
pub extern "C" fn proxy_on_response_headers(id: u32, _n: usize, eos: u32) -> u32 {
    if let Some(action) = stream::grpc_reply_headers(id, eos != 0) {
        return action;
    }
    stream::with(id, 0, |f, h| f.on_response_headers(h, eos != 0))
}

#[no_mangle]
pub extern "C" fn proxy_on_response_body(id: u32, size: usize, eos: u32) -> u32 {
    if let Some(action) = stream::grpc_reply_body(id, size, eos != 0) {
        return action;
    }
    stream::with(id, size, |f, h| f.on_response_body(h, eos != 0))
}

#[no_mangle]
pub extern "C" fn proxy_on_http_call_response(_root: u32, token: u32, _headers: usize, body_size: usize, _trailers: usize) {
    if !semantic::on_response(token, body_size) {
        background::on_response(token, body_size);
    }
}

#[no_mangle]
pub extern "C" fn proxy_on_response_trailers(id: u32, _n: usize) -> u32 {
    stream::with(id, 0, |f, h| f.on_response_trailers(h))
}

