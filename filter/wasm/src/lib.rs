//! meshcache's proxy-wasm host: the filter Envoy and Istio load as Wasm
//! (`filter/dist/meshcache_filter.wasm`). The cache itself is `meshcache-core`; this crate is
//! the proxy-wasm glue, compiled for wasm32 only: `abi` (host imports, written against the
//! proxy-wasm ABI directly; docs/filter.md says why), `abi_host` (`impl Host for Abi`), `exports` (the exported callbacks), `root`
//! (root context), `stream` (stream contexts: each runs the core's `flow`), `background` (stale-while-revalidate refreshes),
//! `semantic` (the flow's callouts and posts to the semantic index service),
//! `metrics`.

#[cfg(target_arch = "wasm32")]
mod abi;
#[cfg(target_arch = "wasm32")]
mod abi_host;
#[cfg(target_arch = "wasm32")]
mod background;
#[cfg(target_arch = "wasm32")]
mod exports;
#[cfg(target_arch = "wasm32")]
mod host;
#[cfg(target_arch = "wasm32")]
mod metrics;
#[cfg(target_arch = "wasm32")]
mod root;
#[cfg(target_arch = "wasm32")]
mod semantic;
#[cfg(target_arch = "wasm32")]
mod stream;
