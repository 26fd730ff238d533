//! meshcache's proxy-wasm host: the filter Envoy and Istio load as Wasm
//! (`filter/dist/meshcache_filter.wasm`). The cache itself is `meshcache-core`; this crate is
//! the proxy-wasm glue, compiled for wasm32 only: `abi` (host imports, written against the
//! proxy-wasm ABI directly; docs/filter.md says why), `exports` (the exported callbacks), `root`
//! (root context), `stream` (stream context), `background` (stale-while-revalidate refreshes),
//! `metrics`.

// The core's modules under their old paths, so the host modules read `crate::config` etc.
pub use meshcache_core::{
    accounting, answer, cache_control, coalesce, config, entry, grpc, hashing, headermap, json, logs, metric_names, model, names, refresh,
    request, response, route_key, shaping, stale, store, storing,
};

#[cfg(target_arch = "wasm32")]
mod abi;
#[cfg(target_arch = "wasm32")]
mod background;
#[cfg(target_arch = "wasm32")]
mod exports;
pub mod host;
#[cfg(target_arch = "wasm32")]
mod metrics;
#[cfg(target_arch = "wasm32")]
mod root;
pub mod stream;
