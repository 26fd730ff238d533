//! meshcache: a proxy-wasm response cache for ML inference traffic.
//!
//! Plain-Rust logic (tested on the host with `cargo test`): `config`, `model`, `hashing`,
//! `cache_control`, `entry`, `store`, `decide`, `grpc`, `headermap`. The proxy-wasm ABI glue
//! (`abi`, `contexts`) is compiled for wasm32 only.

pub mod cache_control;
pub mod config;
pub mod decide;
pub mod entry;
pub mod grpc;
pub mod hashing;
pub mod headermap;
pub mod model;
pub mod store;

#[cfg(target_arch = "wasm32")]
mod abi;
#[cfg(target_arch = "wasm32")]
mod contexts;
