"""The Envoy config that runs meshcache as a dynamic module (`filter/native/`, issue 24).

`envoy.filters.http.dynamic_modules` loads `filter/dist/libmeshcache_native.so` (Envoy 1.40's
dynamic-module ABI) and hands it the same plugin configuration JSON as the Wasm filter, carried as
a `google.protobuf.StringValue` so the module receives the JSON text itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .filter_config import plugin_config_json
from .wasm_filter import FILTER_NAME

DYNAMIC_MODULE_TYPE_URL = "type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter"
MODULE_FILTER_NAME = "meshcache"  # the filter name the module is asked for (`filter_name`)
# The module's stats go under this namespace: the Wasm filter's prefix, so both hosts' stats read
# `wasmcustom.meshcache.*` (one set of names for stats readers, the status page, dashboards).
METRICS_NAMESPACE = "wasmcustom"


def native_filter_config(module_path: Path, plugin_config: dict[str, Any]) -> dict[str, Any]:
    """`DynamicModuleFilter` as proto-JSON (without the @type)."""
    return {
        "dynamic_module_config": {"module": {"local": {"filename": str(module_path)}},
                                  "metrics_namespace": METRICS_NAMESPACE},
        "filter_name": MODULE_FILTER_NAME,
        "filter_config": {
            "@type": "type.googleapis.com/google.protobuf.StringValue",
            "value": plugin_config_json(plugin_config),
        },
    }


def native_http_filter(module_path: Path, plugin_config: dict[str, Any]) -> dict[str, Any]:
    """The `http_filters` entry (named like the Wasm filter: one filter name in every config)."""
    return {"name": FILTER_NAME,
            "typed_config": {"@type": DYNAMIC_MODULE_TYPE_URL, **native_filter_config(module_path, plugin_config)}}
