//! meshcache: a proxy-wasm response cache for ML inference traffic.
//!
//! Plain-Rust logic (tested on the host with `cargo test`): `config`, `model`, `hashing`, `accounting`,
//! `cache_control`, `entry`, `store`, `coalesce`, `stale`, `refresh`, `decide`, `answer`, `names`, `grpc`,
//! `headermap`, `route_key`.
//! The proxy-wasm glue is compiled for wasm32 only: `abi` (host imports), `exports` (the
//! exported callbacks), `root` (root context), `stream` (stream context), `metrics`.

pub mod accounting;
pub mod answer;
pub mod cache_control;
pub mod coalesce;
pub mod config;
pub mod decide;
pub mod entry;
pub mod grpc;
pub mod hashing;
pub mod headermap;
pub mod json;
pub mod keybody;
pub mod model;
pub mod names;
pub mod refresh;
pub mod route_key;
pub mod stale;
pub mod store;
#[cfg(test)]
mod test_rng;

#[cfg(target_arch = "wasm32")]
mod abi;
#[cfg(target_arch = "wasm32")]
mod background;
#[cfg(target_arch = "wasm32")]
mod exports;
#[cfg(target_arch = "wasm32")]
mod metrics;
#[cfg(target_arch = "wasm32")]
mod root;
#[cfg(target_arch = "wasm32")]
mod stream;
