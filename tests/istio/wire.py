"""A protobuf wire-format reader with Istio's field numbers written out here, independent of the
project's generated `*_pb2` modules: decoding what the control plane sends with these tables
checks the numbers the .proto files in proto/istio/ claim (istio/api 1.30.3:
extensions/v1alpha1/traffic_extension.proto, networking/v1alpha3/envoy_filter.proto,
networking/v1alpha3/sidecar.proto WorkloadSelector, type/v1beta1/selector.proto,
mcp/v1alpha1/{resource,metadata}.proto, google/protobuf/struct.proto). Output is the Kubernetes
(camelCase JSON) form, so it can be compared with the manifests and checked against the CRDs."""

from __future__ import annotations

import struct
from typing import Any

# field number -> (JSON name, kind, repeated). Kinds: "string", "uint", "int32", "bool", an enum
# table (dict), a message table (name in SCHEMAS), "map:<message>" (map entries), "struct", "value".
Field = tuple[str, Any, bool]

ENUMS: dict[str, dict[int, str]] = {
    "ExecutionPhase": {0: "UNSPECIFIED", 1: "AUTHN", 2: "AUTHZ", 3: "STATS"},
    "PullPolicy": {0: "UNSPECIFIED_POLICY", 1: "IfNotPresent", 2: "Always"},
    "FailStrategy": {0: "FAIL_CLOSE", 1: "FAIL_OPEN", 2: "FAIL_RELOAD"},
    "PluginType": {0: "UNSPECIFIED_PLUGIN_TYPE", 1: "HTTP", 2: "NETWORK"},
    "WorkloadMode": {0: "UNDEFINED", 1: "CLIENT", 2: "SERVER", 3: "CLIENT_AND_SERVER"},
    "ApplyTo": {0: "INVALID", 1: "LISTENER", 2: "FILTER_CHAIN", 3: "NETWORK_FILTER", 4: "HTTP_FILTER",
                5: "ROUTE_CONFIGURATION", 6: "VIRTUAL_HOST", 7: "HTTP_ROUTE", 8: "CLUSTER", 9: "EXTENSION_CONFIG",
                10: "BOOTSTRAP", 11: "LISTENER_FILTER"},
    "PatchContext": {0: "ANY", 1: "SIDECAR_INBOUND", 2: "SIDECAR_OUTBOUND", 3: "GATEWAY", 4: "WAYPOINT"},
    "Operation": {0: "INVALID", 1: "MERGE", 2: "ADD", 3: "REMOVE", 4: "INSERT_BEFORE", 5: "INSERT_AFTER",
                  6: "INSERT_FIRST", 7: "REPLACE"},
    "FilterClass": {0: "UNSPECIFIED", 1: "AUTHN", 2: "AUTHZ", 3: "STATS"},
    "RouteAction": {0: "ANY", 1: "ROUTE", 2: "REDIRECT", 3: "DIRECT_RESPONSE"},
}

SCHEMAS: dict[str, dict[int, Field]] = {
    "Resource": {1: ("metadata", "Metadata", False), 2: ("body", "Any", False)},
    "Metadata": {1: ("name", "string", False), 2: ("createTime", "Timestamp", False),
                 3: ("version", "string", False), 4: ("labels", "map:StringMapEntry", False),
                 5: ("annotations", "map:StringMapEntry", False)},
    "Timestamp": {1: ("seconds", "int64", False), 2: ("nanos", "int32", False)},
    "Any": {1: ("typeUrl", "string", False), 2: ("value", "bytes", False)},
    "StringMapEntry": {1: ("key", "string", False), 2: ("value", "string", False)},
    "Int32Value": {1: ("value", "int32", False)},
    # istio.extensions.v1alpha1
    "TrafficExtension": {1: ("selector", "WorkloadSelectorV1beta1", False), 2: ("targetRefs", "TargetRef", True),
                         3: ("phase", "enum:ExecutionPhase", False), 4: ("priority", "wrapped:Int32Value", False),
                         5: ("match", "TrafficSelector", True), 6: ("wasm", "WasmConfig", False),
                         7: ("lua", "LuaConfig", False)},
    "WasmConfig": {1: ("url", "string", False), 2: ("sha256", "string", False),
                   3: ("imagePullPolicy", "enum:PullPolicy", False), 4: ("imagePullSecret", "string", False),
                   5: ("verificationKey", "string", False), 6: ("pluginConfig", "struct", False),
                   7: ("pluginName", "string", False), 8: ("failStrategy", "enum:FailStrategy", False),
                   9: ("vmConfig", "VmConfig", False), 10: ("type", "enum:PluginType", False)},
    "LuaConfig": {1: ("inlineCode", "string", False)},
    "VmConfig": {1: ("env", "EnvVar", True)},
    "EnvVar": {1: ("name", "string", False), 2: ("value", "string", False), 3: ("valueFrom", "uint", False)},
    "TrafficSelector": {1: ("mode", "enum:WorkloadMode", False), 2: ("ports", "PortSelector", True)},
    # istio.type.v1beta1
    "WorkloadSelectorV1beta1": {1: ("matchLabels", "map:StringMapEntry", False)},
    "PortSelector": {1: ("number", "uint", False)},
    "TargetRef": {1: ("group", "string", False), 2: ("kind", "string", False), 3: ("name", "string", False),
                  4: ("namespace", "string", False)},
    # istio.networking.v1alpha3
    "EnvoyFilter": {3: ("workloadSelector", "WorkloadSelectorV1alpha3", False), 6: ("targetRefs", "TargetRef", True),
                    4: ("configPatches", "EnvoyConfigObjectPatch", True), 5: ("priority", "int32", False)},
    "WorkloadSelectorV1alpha3": {1: ("labels", "map:StringMapEntry", False)},
    "EnvoyConfigObjectPatch": {1: ("applyTo", "enum:ApplyTo", False), 2: ("match", "EnvoyConfigObjectMatch", False),
                               3: ("patch", "Patch", False)},
    "EnvoyConfigObjectMatch": {1: ("context", "enum:PatchContext", False), 2: ("proxy", "ProxyMatch", False),
                               3: ("listener", "ListenerMatch", False),
                               4: ("routeConfiguration", "RouteConfigurationMatch", False),
                               5: ("cluster", "ClusterMatch", False)},
    "ProxyMatch": {1: ("proxyVersion", "string", False), 2: ("metadata", "map:StringMapEntry", False)},
    "ClusterMatch": {1: ("portNumber", "uint", False), 2: ("service", "string", False),
                     3: ("subset", "string", False), 4: ("name", "string", False)},
    "RouteConfigurationMatch": {1: ("portNumber", "uint", False), 2: ("portName", "string", False),
                                3: ("gateway", "string", False), 4: ("vhost", "VirtualHostMatch", False),
                                5: ("name", "string", False)},
    "VirtualHostMatch": {1: ("name", "string", False), 2: ("route", "RouteMatch", False),
                         3: ("domainName", "string", False)},
    "RouteMatch": {1: ("name", "string", False), 2: ("action", "enum:RouteAction", False)},
    "ListenerMatch": {1: ("portNumber", "uint", False), 2: ("portName", "string", False),
                      3: ("filterChain", "FilterChainMatch", False), 4: ("name", "string", False),
                      5: ("listenerFilter", "string", False)},
    "FilterChainMatch": {1: ("name", "string", False), 2: ("sni", "string", False),
                         3: ("transportProtocol", "string", False), 4: ("applicationProtocols", "string", False),
                         5: ("filter", "FilterMatch", False), 6: ("destinationPort", "uint", False)},
    "FilterMatch": {1: ("name", "string", False), 2: ("subFilter", "SubFilterMatch", False)},
    "SubFilterMatch": {1: ("name", "string", False)},
    "Patch": {1: ("operation", "enum:Operation", False), 2: ("value", "struct", False),
              3: ("filterClass", "enum:FilterClass", False)},
    # google.protobuf.Struct
    "Struct": {1: ("fields", "map:StructEntry", False)},
    "StructEntry": {1: ("key", "string", False), 2: ("value", "value", False)},
    "ListValue": {1: ("values", "value", True)},
}


class WireError(ValueError):
    pass


def _varint(data: bytes, i: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        if i >= len(data):
            raise WireError("truncated varint")
        b = data[i]
        i += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, i
        shift += 7


def fields(data: bytes) -> list[tuple[int, int, Any]]:
    """(field number, wire type, raw value) in order."""
    out, i = [], 0
    while i < len(data):
        key, i = _varint(data, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(data, i)
        elif wire == 1:
            value, i = data[i:i + 8], i + 8
        elif wire == 2:
            n, i = _varint(data, i)
            value, i = data[i:i + n], i + n
        elif wire == 5:
            value, i = data[i:i + 4], i + 4
        else:
            raise WireError(f"unsupported wire type {wire}")
        out.append((number, wire, value))
    return out


def _signed32(v: int) -> int:
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v & 0x80000000 else v


def _value(data: bytes) -> Any:
    """google.protobuf.Value: null 1, number 2, string 3, bool 4, struct 5, list 6."""
    for number, _wire, raw in fields(data):
        if number == 1:
            return None
        if number == 2:
            f = struct.unpack("<d", raw)[0]
            return int(f) if f.is_integer() else f
        if number == 3:
            return raw.decode()
        if number == 4:
            return bool(raw)
        if number == 5:
            return decode("Struct", raw)["fields"] if raw else {}
        if number == 6:
            return decode("ListValue", raw).get("values", [])
    return None


def decode(message: str, data: bytes) -> dict[str, Any]:
    """Decode bytes of `message`; unknown field numbers are an error (a wrong number shows up)."""
    schema, out = SCHEMAS[message], {}
    for number, wire, raw in fields(data):
        if number not in schema:
            raise WireError(f"{message}: unknown field number {number} (wire type {wire})")
        name, kind, repeated = schema[number]
        if kind == "string":
            value: Any = raw.decode()
        elif kind == "bytes":
            value = raw
        elif kind in ("uint", "int64"):
            value = raw
        elif kind == "int32":
            value = _signed32(raw)
        elif kind == "bool":
            value = bool(raw)
        elif kind.startswith("enum:"):
            value = ENUMS[kind[5:]].get(raw, raw)
        elif kind == "struct":
            value = decode("Struct", raw).get("fields", {})
        elif kind == "value":
            value = _value(raw)
        elif kind.startswith("wrapped:"):
            value = decode(kind[8:], raw).get("value", 0)
        elif kind.startswith("map:"):
            entry = decode(kind[4:], raw)
            out.setdefault(name, {})[entry.get("key", "")] = entry.get("value", "")
            continue
        else:
            value = decode(kind, raw)
        if repeated:
            out.setdefault(name, []).append(value)
        else:
            out[name] = value
    return out
