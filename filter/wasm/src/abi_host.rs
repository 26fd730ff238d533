//! The flow's `Host` over the proxy-wasm ABI. Its own module: the ABI wrappers (`abi`) know
//! nothing of the flow, and this file is the one place that ties them to `background` and
//! `metrics` (no `abi -> background -> metrics -> abi` loop).

use crate::abi::*;
use meshcache_core::headermap::Headers;

/// The flow's host (`host::Host`) in a proxy-wasm VM: each method one ABI call (or the VM's own
/// metric sums, flushed on the tick).
pub struct Abi;

impl crate::host::Host for Abi {
    type Shared = HostShared;
    fn shared(&self) -> HostShared {
        HostShared
    }
    fn headers(&mut self, map: Map) -> Headers {
        headers(map)
    }
    fn header(&mut self, map: Map, name: &str) -> Option<String> {
        header(map, name)
    }
    fn set_header(&mut self, map: Map, name: &str, value: &str) {
        set_header(map, name, value)
    }
    fn set_headers(&mut self, map: Map, pairs: &[(&str, &str)]) -> bool {
        set_headers(map, pairs)
    }
    fn add_header(&mut self, map: Map, name: &str, value: &str) -> bool {
        add_header(map, name, value)
    }
    fn remove_header(&mut self, map: Map, name: &str) {
        remove_header(map, name)
    }
    fn body(&mut self, kind: Buffer, start: usize, max: usize) -> Option<Vec<u8>> {
        buffer(kind, start, max)
    }
    fn body_into(&mut self, kind: Buffer, start: usize, max: usize, out: &mut Vec<u8>) -> Option<usize> {
        buffer_into(kind, start, max, out)
    }
    fn set_body(&mut self, kind: Buffer, start: usize, len: usize, data: &[u8]) -> bool {
        set_buffer(kind, start, len, data)
    }
    fn send_local_response(&mut self, status: u32, details: &str, body: &[u8], headers: &[(&str, &str)], grpc_status: i32) -> bool {
        send_local_response(status, details, body, headers, grpc_status)
    }
    fn continue_request(&mut self) -> bool {
        continue_request()
    }
    fn set_effective_context(&mut self, id: u32) -> bool {
        set_effective_context(id)
    }
    fn now_ms(&self) -> u64 {
        now_ms()
    }
    fn now_ns(&self) -> u64 {
        now_ns()
    }
    fn peer_identity(&self) -> Option<String> {
        property(&["connection", "uri_san_peer_certificate"]).and_then(|b| String::from_utf8(b).ok())
    }
    fn upstream_cluster(&self) -> Option<String> {
        crate::background::cluster_name()
    }
    fn set_property(&mut self, name: &str, value: &[u8]) -> bool {
        set_property(name, value)
    }
    fn clear_route_cache(&mut self) -> bool {
        call_foreign("clear_route_cache", b"")
    }
    fn count(&mut self, name: &str, n: u64) {
        crate::metrics::count(name, n)
    }
    fn count_policy(&mut self, prefix: &str, what: &str, n: u64) {
        crate::metrics::count_policy(prefix, what, n)
    }
    fn error(&mut self, msg: &str) {
        crate::metrics::error(msg)
    }
    fn log_debug(&mut self, line: &dyn Fn() -> String) {
        if log_enabled(LogLevel::Debug) {
            log(LogLevel::Debug, &line());
        }
    }
    fn register_queue(&mut self, name: &str) -> Option<u32> {
        register_queue(name)
    }
    fn enqueue(&mut self, queue: u32, message: &[u8]) -> bool {
        enqueue(queue, message)
    }
    fn dequeue(&mut self, queue: u32) -> Option<Vec<u8>> {
        dequeue(queue)
    }
    fn refresh(&mut self, root: u32, stream: u32, c: &meshcache_core::request::Cacheable, headers: &[(String, String)], body: &[u8],
               limits: &meshcache_core::config::Limits, now: u64) -> bool {
        crate::background::start(root, stream, c, headers, body, limits, now)
    }
    fn semantic_instance(&mut self) -> String {
        crate::semantic::instance()
    }
    fn semantic_call(&mut self, root: u32, stream: u32, service: &meshcache_core::config::SemanticService, path: &str, body: &[u8],
                     reply: bool) -> bool {
        crate::semantic::call(root, stream, service, path, body, reply)
    }
}
