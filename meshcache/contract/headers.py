"""HTTP header names the filter, the Envoy configs, Istio's routes and the tools share.

The filter's own copies are in filter/core/src/names.rs (tests/test_contract.py compares them)."""

from __future__ import annotations

# Traffic colour: part of the cache key, and what colour routes match on.
COLOR_HEADER = "x-traffic-color"
# The hash of the response body plus whitelisted headers, set on every cached response.
HASH_HEADER = "x-response-hash"
# RFC 9211 Cache-Status, set by the filter on the responses it handles.
CACHE_STATUS_HEADER = "cache-status"
# KServe v2 REST: the model a request is for (also a default hash header).
MODEL_ID_HEADER = "x-model-id"
# The engine's `POST /v1/infer`: the version of the `x-model-id` model (default: the latest).
# Like x-model-id it picks the model, so the filter keys it (docs/filter.md).
MODEL_VERSION_HEADER = "x-model-version"
# Internal: the client-role filter's routing key (consistent-hash `hash_policy` header that sends
# identical requests to one replica); the server-role filter removes it. Never part of a cache key.
ROUTE_KEY_HEADER = "x-meshcache-route-key"
# Set by the filter on a held gRPC request an expired entry may answer (stale-if-error): the
# cluster its route chose, which the stale route forwards to (meshcache.contract.grpc_hit).
UPSTREAM_CLUSTER_HEADER = "x-meshcache-upstream-cluster"
# Cache-Status of a request that waited for an identical one in flight and was answered from the
# entry it stored (request coalescing; RFC 9211's `collapsed` parameter).
CACHE_STATUS_COLLAPSED = "meshcache; fwd=miss; collapsed"
