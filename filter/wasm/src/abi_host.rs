//! The flow's `Host` (`meshcache_core::host`) over the proxy-wasm ABI. Its own module: the ABI
//! wrappers (`abi`) know nothing of the flow, and this file is the one place that ties them to
//! `stream`, `background` and `metrics` (no `abi -> background -> metrics -> abi` loop).

use crate::abi::{self, HostShared};
use crate::host::{Buffer, Map as AbiMap};
use crate::stream::{self, WAITERS, WAKE_QUEUE};
use meshcache_core::coalesce::{self, Refused, Release};
use meshcache_core::config::Limits;
use meshcache_core::hashing::KeyDigest;
use meshcache_core::headermap::Headers;
use meshcache_core::host::{Action, GrpcAt, Host, Map, Side, StaleRoute};
use meshcache_core::request::Cacheable;

/// The effective stream in a proxy-wasm VM: each method one ABI call (or the VM's own metric
/// sums, flushed on the tick).
pub struct Abi {
    pub id: u32,
    /// Its root context (owns its background refreshes).
    pub root: u32,
    /// The size of the body buffer the running callback reported.
    pub body: usize,
}

fn map(m: Map) -> AbiMap {
    match m {
        Map::RequestHeaders => AbiMap::RequestHeaders,
        Map::ResponseHeaders => AbiMap::ResponseHeaders,
        Map::ResponseTrailers => AbiMap::ResponseTrailers,
    }
}

impl Host for Abi {
    type Shared = HostShared;
    fn shared(&self) -> &HostShared {
        &HostShared
    }
    fn headers(&mut self, m: Map) -> Headers {
        abi::headers(map(m))
    }
    fn header(&mut self, m: Map, name: &str) -> Option<String> {
        abi::header(map(m), name)
    }
    fn set_header(&mut self, m: Map, name: &str, value: &str) {
        abi::set_header(map(m), name, value)
    }
    fn add_header(&mut self, m: Map, name: &str, value: &str) {
        abi::add_header(map(m), name, value);
    }
    fn remove_header(&mut self, m: Map, name: &str) {
        abi::remove_header(map(m), name)
    }
    /// The held headers written back with ours in one host call.
    fn set_ours(&mut self, m: Map, base: &[(String, String)], ours: &[(&str, &str)]) {
        let mut all: Vec<(&str, &str)> = base
            .iter()
            .filter(|(n, _)| !ours.iter().any(|(o, _)| n.eq_ignore_ascii_case(o)))
            .map(|(n, v)| (n.as_str(), v.as_str()))
            .collect();
        all.extend_from_slice(ours);
        abi::set_headers(map(m), &all);
    }
    fn read_body(&mut self, side: Side, skip: usize, room: usize, out: &mut Vec<u8>) -> Option<usize> {
        let size = self.body;
        let more = size.saturating_sub(skip);
        if more > 0 && more <= room {
            let kind = if side == Side::Request { Buffer::RequestBody } else { Buffer::ResponseBody };
            if abi::buffer_into(kind, skip, more, out)? != more {
                return None;
            }
        }
        Some(size)
    }
    fn send_reply(&mut self, status: u32, details: &str, headers: &[(&str, &str)], body: &[u8]) -> bool {
        abi::send_local_response(status, details, body, headers, -1)
    }
    fn send_grpc(&mut self, at: GrpcAt, headers: Vec<(String, String)>, framed: Vec<u8>) -> Option<Action> {
        stream::send_grpc(self.id, at, headers, framed)
    }
    fn grpc_hits_work(&self) -> bool {
        !stream::GRPC_HITS_BROKEN.with(|b| b.get())
    }
    fn take_stale_route(&mut self, hold_headers: bool) -> StaleRoute {
        stream::take_stale_route(hold_headers)
    }
    fn resume_request(&mut self) -> bool {
        abi::continue_request()
    }
    fn now_ms(&self) -> u64 {
        abi::now_ms()
    }
    fn peer_identity(&self) -> Option<String> {
        abi::property(&["connection", "uri_san_peer_certificate"]).and_then(|b| String::from_utf8(b).ok())
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
        if abi::log_enabled(abi::LogLevel::Debug) {
            abi::log(abi::LogLevel::Debug, &line());
        }
    }
    fn place(&self) -> Option<(u32, u32)> {
        WAKE_QUEUE.with(|w| w.get()).map(|q| (q, self.id))
    }
    fn park(&mut self, key: &KeyDigest, deadline_ms: u64) -> Result<(), Refused> {
        WAITERS.with(|w| w.borrow_mut().add(key, self.id, deadline_ms))
    }
    fn unpark(&mut self) {
        WAITERS.with(|w| w.borrow_mut().remove(self.id));
    }
    fn wake(&mut self, queues: &[u32], key: &KeyDigest, release: Release) {
        let message = coalesce::encode_wake(key, release);
        for queue in queues {
            if !abi::enqueue(*queue, &message) {
                self.error("could not wake coalesced requests (their timeout will)");
            }
        }
    }
    fn refresh(&mut self, c: &Cacheable, headers: &[(String, String)], body: &[u8], limits: &Limits) -> bool {
        crate::background::start(self.root, self.id, c, headers, body, limits, abi::now_ms())
    }
    fn instance_id(&mut self) -> String {
        crate::semantic::instance()
    }
    fn callout(&mut self, cluster: &str, headers: &[(&str, &str)], body: &[u8], timeout_ms: u64) -> bool {
        crate::semantic::call(self.root, self.id, cluster, headers, body, timeout_ms, true)
    }
    fn post(&mut self, cluster: &str, headers: &[(&str, &str)], body: &[u8], timeout_ms: u64) -> bool {
        crate::semantic::call(self.root, self.id, cluster, headers, body, timeout_ms, false)
    }
}
