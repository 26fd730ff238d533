//! meshcache's cache core: everything about caching that does not depend on the proxy that runs
//! it — request reading and keys (`shaping`, `model`, `hashing`, `json`), policy (`config`),
//! HTTP semantics (`cache_control`, `request`, `response`, `hit`, `names`, `grpc`,
//! `headermap`, `route_key`), entries (`entry`), the per-stream flow over a host (`flow`, `host`), the store over a host's shared data (`store`,
//! `insert`, `accounting`), coalescing (`coalesce`), stale answers (`stale`: when an expired
//! entry may answer; `revalidate`: one refresh per key) and log lines (`logs`).
//!
//! No `extern "C"`, no thread-locals, no I/O: `cargo test -p meshcache-core` checks it on the
//! build machine. The hosts (`filter/wasm`: proxy-wasm; `filter/native`: Envoy dynamic module)
//! read the proxy's headers and bodies, call into this crate, and write its answers back.

pub mod accounting;
pub mod cache_control;
pub mod coalesce;
pub mod config;
pub mod entry;
pub mod flow;
pub mod grpc;
pub mod hashing;
pub mod headermap;
pub mod hit;
pub mod host;
pub mod insert;
pub mod json;
pub mod logs;
pub mod metric_names;
pub mod model;
pub mod names;
pub mod request;
pub mod response;
pub mod revalidate;
pub mod route_key;
pub mod semantic;
pub mod shaping;
pub mod sse;
pub mod stale;
pub mod store;
pub mod usage;
#[cfg(test)]
mod test_rng;
