"""The Envoy Wasm filter config that runs the meshcache module (one definition for all users).

The static Envoy configs, the ECDS default_config and the control plane's ECDS pushes all build
the filter from here, so the VM config (vm_id, runtime, code) is byte-for-byte the same and Envoy
reuses the running VM (and its shared-data cache) when only the plugin configuration changes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FILTER_NAME = "meshcache"  # HTTP filter name; also the ECDS resource name
ROOT_ID = "meshcache"
VM_ID = "meshcache"
WASM_TYPE_URL = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm"
STUB_ROLE_CONFIG = {"role": "stub"}


def plugin_config_json(config: dict[str, Any]) -> str:
    """Canonical JSON text of a plugin configuration (sorted keys: equal configs, equal bytes)."""
    return json.dumps(config, sort_keys=True, separators=(",", ":"))


def wasm_filter_config(
    wasm_path: Path, plugin_config: dict[str, Any], allow_on_headers_stop_iteration: bool = True
) -> dict[str, Any]:
    """`envoy.extensions.filters.http.wasm.v3.Wasm` as proto-JSON (without the @type).

    Without `allow_on_headers_stop_iteration` (as under Istio's WasmPlugin) the plugin
    configuration must say `"hold_headers": false`, or requests with a body would wait forever.
    """
    return {
        "config": {
            "name": FILTER_NAME,
            "root_id": ROOT_ID,
            "vm_config": {
                "vm_id": VM_ID,
                "runtime": "envoy.wasm.runtime.v8",
                "code": {"local": {"filename": str(wasm_path)}},
            },
            "configuration": {
                "@type": "type.googleapis.com/google.protobuf.StringValue",
                "value": plugin_config_json(plugin_config),
            },
            # Fail open: if the VM cannot run, traffic flows without the cache.
            "failure_policy": "FAIL_OPEN",
            # Lets the filter hold request headers and decide at end of body (before routing).
            "allow_on_headers_stop_iteration": allow_on_headers_stop_iteration,
        },
    }
