"""The meshcache WasmPlugin spec: one definition for the rendered manifests and the control
plane's MCP-over-xDS resource (so what istiod gets from either source is the same plugin).

Placement (`phase: STATS`, `priority: -100`):
- After Istio's authn and authz filters (AUTHN/AUTHZ phases would run before RBAC): a cache
  placed before `envoy.filters.http.rbac` would answer requests the AuthorizationPolicy denies,
  and principal-scoped entries need the authenticated peer.
- STATS is the last phase with a defined position (just before `istio.stats`), which also
  keeps it ahead of the grpc_http1_reverse_bridge the EnvoyFilter inserts before the router:
  the bridge must see the hit route the filter selects, never the other way round.
- A negative priority runs it after other STATS-phase plugins at the default 0 (descending
  order), so they see cache hits too.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from meshcache.wasm_filter import ROOT_ID

PHASE = "STATS"
PRIORITY = -100
FAIL_STRATEGY = "FAIL_OPEN"  # a broken or missing module must not take inference traffic down
ENGINE_PORTS = (8000, 8001)  # REST and gRPC; never the metrics port
DIGEST_RE = re.compile(r"^[a-f0-9]{64}$")


def oci_url(repository: str, digest: str) -> str:
    """`oci://REPO@sha256:DIGEST`: pinned by digest, so `IfNotPresent` can never serve stale code."""
    repository = repository.removeprefix("oci://")
    return f"oci://{repository}@sha256:{digest}"


def wasm_plugin_spec(*, url: str, sha256: str, plugin_config: dict[str, Any],
                     selector: dict[str, str] | None = None, ports: Iterable[int] = ENGINE_PORTS,
                     pull_secret: str = "") -> dict[str, Any]:
    """The WasmPlugin `spec` in Kubernetes (camelCase) form; `json_format.ParseDict` turns it
    into the protobuf istiod decodes from MCP."""
    if sha256 and not DIGEST_RE.match(sha256):
        raise ValueError(f"sha256 must be 64 lowercase hex characters, got {sha256!r}")
    spec: dict[str, Any] = {}
    if selector:
        spec["selector"] = {"matchLabels": dict(selector)}
    spec |= {
        "url": url,
        "sha256": sha256,
        "imagePullPolicy": "IfNotPresent",
        "pluginName": ROOT_ID,
        "phase": PHASE,
        "priority": PRIORITY,
        "failStrategy": FAIL_STRATEGY,
        "type": "HTTP",
        "match": [{"mode": "SERVER", "ports": [{"number": p} for p in ports]}],
        # A WasmPlugin cannot set Envoy's allow_on_headers_stop_iteration, so the filter must not
        # hold request headers (docs/filter.md, "hold_headers"): without this, requests with a
        # body would wait forever.
        "pluginConfig": {**plugin_config, "hold_headers": False},
    }
    if pull_secret:
        spec["imagePullSecret"] = pull_secret
    return spec
