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
"""

from __future__ import annotations

from typing import Any

_ENVOY = "type.googleapis.com/envoy."
GRPC_HIT_LUA_FILTER = "meshcache.grpc_hit_body"
GRPC_HIT_ROUTE = "meshcache_grpc_hit"
LOCAL_MARKER_FILTER_STATE = "wasm.meshcache_local"  # the filter's proxy_set_property("meshcache_local")
LUA_TYPE = _ENVOY + "extensions.filters.http.lua.v3.Lua"
LUA_PER_ROUTE_TYPE = _ENVOY + "extensions.filters.http.lua.v3.LuaPerRoute"
# body(true): a headers-only response gets a body (empty), so the wasm filter sees its body callback.
GRPC_HIT_LUA_SCRIPT = "function envoy_on_response(h) h:body(true) end"


def grpc_hit_lua_filter() -> dict[str, Any]:
    """The `http_filters` entry, placed right after the meshcache wasm filter. No default script:
    it does nothing except on routes that carry `grpc_hit_lua_per_route()`."""
    return {"name": GRPC_HIT_LUA_FILTER, "typed_config": {"@type": LUA_TYPE}}


def grpc_hit_lua_per_route() -> dict[str, Any]:
    """The LuaPerRoute config the hit route carries (as `typed_per_filter_config` value)."""
    return {"@type": LUA_PER_ROUTE_TYPE, "source_code": {"inline_string": GRPC_HIT_LUA_SCRIPT}}


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
    }]
