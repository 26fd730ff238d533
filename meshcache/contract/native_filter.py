"""The Envoy config that runs meshcache as a dynamic module (`filter/native/`, issue 24).

`envoy.filters.http.dynamic_modules` loads `filter/dist/libmeshcache_native.so` (Envoy 1.40's
dynamic-module ABI; `libmeshcache_native-envoy-1.39.so` for Envoy 1.39, with the same config) and
hands it the same plugin configuration JSON as the Wasm filter, carried as a
`google.protobuf.StringValue` so the module receives the JSON text itself.

Over ECDS the native filter is its own resource, `meshcache-native` (the Wasm filter's is
`meshcache`), and so is its client role, `meshcache-native-client` (the Wasm one's
`meshcache-client`): each Envoy asks for the host it runs, so one control plane serves a fleet
that mixes both hosts (e.g. while moving from one to the other).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from google.protobuf import any_pb2, wrappers_pb2

from .filter_config import plugin_config_json
from .wasm_filter import FILTER_NAME

DYNAMIC_MODULE_TYPE_URL = "type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter"
MODULE_FILTER_NAME = "meshcache"  # the filter name the module is asked for (`filter_name`)
# The HTTP filter and ECDS resource name of the native filter when it comes from the control plane.
NATIVE_FILTER_NAME = "meshcache-native"
# The same for the client role (cache-affinity routing in a client sidecar).
NATIVE_CLIENT_FILTER_NAME = "meshcache-native-client"
# The module's stats go under this namespace: the Wasm filter's prefix, so both hosts' stats read
# `wasmcustom.meshcache.*` (one set of names for stats readers, the status page, dashboards).
METRICS_NAMESPACE = "wasmcustom"


def native_filter_config(module_path: Path | str, plugin_config: dict[str, Any]) -> dict[str, Any]:
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
    """The `http_filters` entry (named like the Wasm filter: one filter name in every static config)."""
    return {"name": FILTER_NAME,
            "typed_config": {"@type": DYNAMIC_MODULE_TYPE_URL, **native_filter_config(module_path, plugin_config)}}


# ---- the same config as protobuf bytes (the control plane's ECDS resource) ------------------------
# The Python protos of `xds-protos` predate Envoy 1.40's `DynamicModuleConfig.module` and
# `metrics_namespace`, so the message is encoded here. Field numbers as Envoy 1.40.0 itself has them
# (the file descriptors embedded in the pinned envoy binary):
#   DynamicModuleFilter: dynamic_module_config 1, filter_name 2, filter_config 3 (Any)
#   DynamicModuleConfig: metrics_namespace 5, module 6 (core.v3.AsyncDataSource)
#   AsyncDataSource: local 1 (DataSource); DataSource: filename 1


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """One length-delimited field (wire type 2)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def native_filter_proto(module_path: Path, config_json: str) -> bytes:
    """`native_filter_config` serialized as `DynamicModuleFilter`, for a plugin configuration
    already in canonical JSON text (a snapshot's, carried as is)."""
    plugin = any_pb2.Any()
    plugin.Pack(wrappers_pb2.StringValue(value=config_json))
    source = _field(1, _field(1, str(module_path).encode()))  # AsyncDataSource.local.filename
    module_config = _field(5, METRICS_NAMESPACE.encode()) + _field(6, source)
    return _field(1, module_config) + _field(2, MODULE_FILTER_NAME.encode()) + _field(3, plugin.SerializeToString())
