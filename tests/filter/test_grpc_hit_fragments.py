"""The single-pass gRPC-hit Envoy fragments (shared with the Istio renderer) validate in Envoy."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from meshcache.contract import grpc_hit
from meshcache.contract.paths import FILTER_WASM, envoy_binary
from meshcache.ctl import envoy_config as ec


def _bootstrap_with_fragments(wasm: Path) -> dict:
    proxy = ec.CacheProxy(listen_port=10000, admin_port=10001, http_upstream_port=10002,
                          grpc_upstream_port=10003, wasm_path=wasm)
    bootstrap = ec.render(proxy)
    hcm = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    filters = hcm["http_filters"]
    wasm_at = next(i for i, f in enumerate(filters) if f["name"] == "meshcache")
    if not any(f["name"] == grpc_hit.GRPC_HIT_LUA_FILTER for f in filters):
        filters.insert(wasm_at + 1, grpc_hit.grpc_hit_lua_filter())
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    if not any(r["name"] == grpc_hit.GRPC_HIT_ROUTE for r in routes):
        routes[:0] = grpc_hit.grpc_hit_routes()
    return bootstrap


def test_fragments_validate_in_envoy(tmp_path: Path) -> None:
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(_bootstrap_with_fragments(FILTER_WASM), sort_keys=False))
    result = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path), "--log-level", "error"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_fragment_shapes() -> None:
    assert grpc_hit.grpc_hit_lua_filter() == {"name": "meshcache.grpc_hit_body",
                                              "typed_config": {"@type": grpc_hit.LUA_TYPE}}
    route, stale = grpc_hit.grpc_hit_routes()
    assert route["match"]["grpc"] == {}
    assert route["match"]["filter_state"] == [{"key": "wasm.meshcache_local", "string_match": {"exact": "1"}}]
    assert route["typed_per_filter_config"]["meshcache.grpc_hit_body"] == grpc_hit.grpc_hit_lua_per_route()
    # stale-if-error: forwards (held headers) to the cluster the filter names, Lua body step on errors only.
    assert stale["name"] == grpc_hit.GRPC_STALE_ROUTE and stale["match"]["grpc"] == {}
    assert stale["match"]["filter_state"] == [{"key": "wasm.meshcache_stale", "string_match": {"exact": "1"}}]
    assert stale["route"]["cluster_header"] == "x-meshcache-upstream-cluster"
    assert stale["request_headers_to_remove"] == ["x-meshcache-upstream-cluster"]
    lua = stale["typed_per_filter_config"]["meshcache.grpc_hit_body"]["source_code"]["inline_string"]
    assert 'get("grpc-status")' in lua
