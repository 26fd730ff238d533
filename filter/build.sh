#!/usr/bin/env bash
# Builds filter/dist/meshcache_filter.wasm (`release`) or runs the unit tests of the core and the
# Wasm host (`test`): the workspace filter/Cargo.toml (core/, wasm/). A rustup toolchain with the
# wasm32 target is used when present; otherwise Debian's rustc 1.63 with the crates Debian
# packages (no crates.io here).
# `native` builds the Envoy dynamic module for each Envoy ABI it speaks, from one source:
# filter/dist/libmeshcache_native.so (Envoy 1.40) and filter/dist/libmeshcache_native-envoy-1.39.so
# (Envoy 1.39, istio-proxy 1.31: the cargo feature envoy-1-39, its own target directory so the two
# builds do not invalidate each other); `native-test` runs its unit tests and the core's again: filter/native/ is its own Cargo package (depending on
# core/ by path), built with rustup's stable toolchain and pinned crates.io crates (its own
# Cargo.lock, --locked), never with the wasm toolchain.
set -euo pipefail
cd "$(dirname "$0")"
mode=${1:-release}

native_cargo() {
  local cargo="${CARGO_HOME:-$HOME/.cargo}/bin/cargo"
  if [ ! -x "$cargo" ]; then
    echo "filter/build.sh: rustup's cargo not found at $cargo (the native module needs a stable Rust >= 1.80 from rustup)" >&2
    exit 1
  fi
  (cd native && "$cargo" "$@")
}

case "$mode" in
  native)
    mkdir -p dist
    native_cargo build --quiet --locked --release
    cp native/target/release/libmeshcache_native.so dist/libmeshcache_native.so.tmp
    mv dist/libmeshcache_native.so.tmp dist/libmeshcache_native.so
    native_cargo build --quiet --locked --release --features envoy-1-39 --target-dir target/envoy-1.39
    cp native/target/envoy-1.39/release/libmeshcache_native.so dist/libmeshcache_native-envoy-1.39.so.tmp
    mv dist/libmeshcache_native-envoy-1.39.so.tmp dist/libmeshcache_native-envoy-1.39.so
    exit 0
    ;;
  native-test)
    # Once, for Envoy 1.40's ABI: the envoy-1-39 feature changes only the ABI version string and the
    # load check, which the Envoy tests check on the built 1.39 module (tests/filter, native-1.39).
    native_cargo test --quiet --locked -p meshcache-native -p meshcache-core
    exit 0
    ;;
esac

if command -v rustup >/dev/null 2>&1 && rustup target list --installed 2>/dev/null | grep -qx wasm32-unknown-unknown; then
  cargo=(cargo)
else
  export RUSTC=/usr/bin/rustc RUSTDOC=/usr/bin/rustdoc
  cargo=(/usr/bin/cargo
    --config 'source.crates-io.replace-with="debian"'
    --config 'source.debian.directory="/usr/share/cargo/registry"')
fi

case "$mode" in
  release)
    # Reproducible bytes wherever the checkout lives: rustc writes the core crate's source paths
    # (panic locations) absolute, and the module's digest is pinned in istio/base.
    "${cargo[@]}" --config "target.wasm32-unknown-unknown.rustflags=[\"--remap-path-prefix=$PWD=filter\"]" \
      build --quiet --locked --offline --release --target wasm32-unknown-unknown
    mkdir -p dist
    cp target/wasm32-unknown-unknown/release/meshcache_filter.wasm dist/meshcache_filter.wasm.tmp
    mv dist/meshcache_filter.wasm.tmp dist/meshcache_filter.wasm
    ;;
  test)
    "${cargo[@]}" test --quiet --locked --offline
    ;;
  *)
    echo "usage: $0 [release|test|native|native-test]" >&2
    exit 2
    ;;
esac
