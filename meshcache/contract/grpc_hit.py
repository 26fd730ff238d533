"""The single-pass gRPC-hit Envoy fragments: one definition for every Envoy config that runs the
filter (the reference configs and local mesh via meshcache.ctl.envoy_config, and the EnvoyFilter
that istiod gets via meshcache.contract.extensions, from the control plane's MCP or the rendered
manifests).

A wasm local reply to a gRPC request is trailers-only (Envoy moves its body into grpc-message).
So on a hit the filter marks the request (filter state `wasm.meshcache_local` = "1", which a
client cannot forge), clears the route cache and sends an empty local reply; the reply
re-selects the route, and on the hit route only the Lua filter below gives the headers-only
reply an (empty) body, which the wasm filter then fills with the framed message and a
`grpc-status: 0` trailer. One Envoy pass, no second listener. See docs/filter.md.

Stale-if-error uses the same step on a gRPC error: a forwarded request that an expired entry may
still answer is marked `wasm.meshcache_stale` = "1" (route cache cleared); the stale route's Lua
step gives a trailers-only answer (an error: `grpc-status` in the headers) an empty body, which
the filter fills with the stored message when the status is one stale-if-error covers. With held
request headers the stale route also forwards: to the cluster the original route chose, which
the filter puts in `x-meshcache-upstream-cluster` (removed before the request leaves).
"""

from __future__ import annotations

from typing import Any

from meshcache.contract.headers import UPSTREAM_CLUSTER_HEADER

_ENVOY = "type.googleapis.com/envoy."
GRPC_HIT_LUA_FILTER = "meshcache.grpc_hit_body"
GRPC_HIT_ROUTE = "meshcache_grpc_hit"
GRPC_STALE_ROUTE = "meshcache_grpc_stale"
LOCAL_MARKER_FILTER_STATE = "wasm.meshcache_local"  # the filter's proxy_set_property("meshcache_local")
STALE_MARKER_FILTER_STATE = "wasm.meshcache_stale"  # the filter's proxy_set_property("meshcache_stale")
# The stale route's upstream timeout when it forwards (held request headers only).
GRPC_STALE_ROUTE_TIMEOUT = "60s"
LUA_TYPE = _ENVOY + "extensions.filters.http.lua.v3.Lua"
LUA_PER_ROUTE_TYPE = _ENVOY + "extensions.filters.http.lua.v3.LuaPerRoute"
# body(true): a headers-only response gets a body (empty), so the wasm filter sees its body callback.
GRPC_HIT_LUA_SCRIPT = "function envoy_on_response(h) h:body(true) end"
# Only trailers-only answers (gRPC errors: the status is in the headers) get a body; successful
# answers stream untouched.
GRPC_STALE_LUA_SCRIPT = ('function envoy_on_response(h) '
                         'if h:headers():get("grpc-status") ~= nil then h:body(true) end end')


def grpc_hit_lua_filter() -> dict[str, Any]:
    """The `http_filters` entry, placed right after the meshcache wasm filter. No default script:
    it does nothing except on routes that carry `grpc_hit_lua_per_route()`."""
    return {"name": GRPC_HIT_LUA_FILTER, "typed_config": {"@type": LUA_TYPE}}


def grpc_hit_lua_per_route(script: str = GRPC_HIT_LUA_SCRIPT) -> dict[str, Any]:
    """The LuaPerRoute config the hit route carries (as `typed_per_filter_config` value)."""
    return {"@type": LUA_PER_ROUTE_TYPE, "source_code": {"inline_string": script}}


def grpc_hit_routes() -> list[dict[str, Any]]:
    """The route(s) a marked gRPC hit's local reply selects; put them first in the virtual host.

    The action is never used to forward (the filter has already answered); should a marked
    request ever reach the router anyway, it gets a 503 instead of being forwarded anywhere."""
    return [{
        "name": GRPC_HIT_ROUTE,
        "match": {
            "prefix": "/",
            "grpc": {},
            "filter_state": [{"key": LOCAL_MARKER_FILTER_STATE, "string_match": {"exact": "1"}}],
        },
        "direct_response": {"status": 503},
        "typed_per_filter_config": {GRPC_HIT_LUA_FILTER: grpc_hit_lua_per_route()},
    }, {
        "name": GRPC_STALE_ROUTE,
        "match": {
            "prefix": "/",
            "grpc": {},
            "filter_state": [{"key": STALE_MARKER_FILTER_STATE, "string_match": {"exact": "1"}}],
        },
        "route": {"cluster_header": UPSTREAM_CLUSTER_HEADER, "timeout": GRPC_STALE_ROUTE_TIMEOUT},
        "request_headers_to_remove": [UPSTREAM_CLUSTER_HEADER],
        "typed_per_filter_config": {GRPC_HIT_LUA_FILTER: grpc_hit_lua_per_route(GRPC_STALE_LUA_SCRIPT)},
    }]
