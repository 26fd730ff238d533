#!/usr/bin/env bash
# Builds filter/dist/meshcache_filter.wasm (`release`) or runs the host unit tests (`test`).
# A rustup toolchain with the wasm32 target is used when present; otherwise Debian's rustc 1.63
# with the crates Debian packages (no crates.io here).
set -euo pipefail
cd "$(dirname "$0")"
mode=${1:-release}

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
    "${cargo[@]}" build --quiet --locked --offline --release --target wasm32-unknown-unknown
    mkdir -p dist
    cp target/wasm32-unknown-unknown/release/meshcache_filter.wasm dist/meshcache_filter.wasm.tmp
    mv dist/meshcache_filter.wasm.tmp dist/meshcache_filter.wasm
    ;;
  test)
    "${cargo[@]}" test --quiet --locked --offline
    ;;
  *)
    echo "usage: $0 [release|test]" >&2
    exit 2
    ;;
esac
