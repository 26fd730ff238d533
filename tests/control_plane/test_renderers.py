"""xDS renderers in-process: rendered once per snapshot, and ECDS carries the snapshot's JSON as is."""

from __future__ import annotations

import json
from pathlib import Path

from envoy.config.core.v3 import base_pb2, extension_pb2
from envoy.extensions.filters.http.dynamic_modules.v3 import dynamic_modules_pb2
from envoy.extensions.filters.http.wasm.v3 import wasm_pb2
from google.protobuf import wrappers_pb2
from google.protobuf.unknown_fields import UnknownFieldSet

from meshcache.contract import extensions
from meshcache.contract.filter_config import client_plugin_config, demo_policies, plugin_config_json
from meshcache.contract.native_filter import (
    DYNAMIC_MODULE_TYPE_URL,
    METRICS_NAMESPACE,
    MODULE_FILTER_NAME,
    NATIVE_CLIENT_FILTER_NAME,
    NATIVE_FILTER_NAME,
)
from meshcache.contract.wasm_filter import CLIENT_FILTER_NAME, FILTER_NAME, VM_ID
from meshcache.control_plane.mcp import MODE_TYPE_URL, IstioMcpRenderer, mcp_fallback
from meshcache.control_plane.renderers import ECDS_TYPE_URL, EcdsRenderer, Renderer
from meshcache.control_plane.snapshots import Snapshot, SnapshotMemo


def test_memo_builds_once_per_snapshot() -> None:
    calls: list[int] = []
    memo = SnapshotMemo(lambda s: calls.append(s.version) or [s.version])
    a, b = Snapshot(version=1), Snapshot(version=2)
    assert memo(a) is memo(a)
    assert memo(b) == [2] and memo(b) is memo(b)
    assert calls == [1, 2]
    memo(a)  # an equal-content but different snapshot object is rendered again
    assert calls == [1, 2, 1]


def test_ecds_packs_the_snapshot_json_and_shares_it_across_streams() -> None:
    renderer = EcdsRenderer(Path("/etc/meshcache/meshcache_filter.wasm"))
    snap = Snapshot(version=3, policies=tuple(demo_policies(generation=3)))
    first = renderer.resources(snap)
    assert renderer.resources(snap) is first
    typed = renderer.typed_extension_config(snap)
    wasm = wasm_pb2.Wasm()
    assert typed.typed_config.Unpack(wasm)
    value = wrappers_pb2.StringValue()
    assert wasm.config.configuration.Unpack(value)
    assert value.value == snap.plugin_config_json
    assert renderer.resources(Snapshot(version=4)) is not first


def test_mcp_renders_once_per_snapshot() -> None:
    builds: list[dict] = []

    def build(plugin_config: dict) -> list[dict]:
        builds.append(plugin_config)
        return extensions.objects("full", colors=["blue"], url="oci://r/f@sha256:" + "a" * 64, sha256="a" * 64,
                                  plugin_config=plugin_config)

    renderer = IstioMcpRenderer(MODE_TYPE_URL["full"], build, "ml")
    snap = Snapshot(version=2, policies=tuple(demo_policies(generation=2)))
    assert renderer.resources(snap) is renderer.resources(snap)
    assert list(renderer.resources(snap)) == ["ml/meshcache-blue", "ml/meshcache-client"] and len(builds) == 1
    assert renderer.resources(Snapshot(version=0)) == {}


def test_ecds_serves_the_client_role_with_the_same_policies() -> None:
    renderer = EcdsRenderer(Path("/etc/meshcache/meshcache_filter.wasm"))
    snap = Snapshot(version=5, policies=tuple(demo_policies(generation=5)))
    assert sorted(renderer.resources(snap)) == sorted([CLIENT_FILTER_NAME, FILTER_NAME, NATIVE_FILTER_NAME,
                                                       NATIVE_CLIENT_FILTER_NAME])
    configs = {}
    for client in (False, True):
        typed = renderer.typed_extension_config(snap, client)
        wasm = wasm_pb2.Wasm()
        assert typed.typed_config.Unpack(wasm)
        value = wrappers_pb2.StringValue()
        assert wasm.config.configuration.Unpack(value)
        configs[typed.name] = json.loads(value.value)
        # One VM config for both: a sidecar that ran both roles would share its module instance.
        assert wasm.config.vm_config.vm_id == VM_ID and wasm.config.allow_on_headers_stop_iteration
    server, client = configs[FILTER_NAME], configs[CLIENT_FILTER_NAME]
    assert "role" not in server and client["role"] == "client" and client["hold_headers"] is True
    assert client["policies"] == server["policies"] and client["version"] == server["version"] == "5"


def test_renderer_defaults_and_the_mcp_overrides() -> None:
    """What the stream loop and fetch ask every renderer (no getattr): Envoy-facing renderers wait
    for the first snapshot and version by snapshot; istiod's empty answers come always, once."""
    ecds, empty = EcdsRenderer(Path("/m.wasm")), mcp_fallback("networking.istio.io/v1alpha3/Gateway")
    assert empty is not None and mcp_fallback(ECDS_TYPE_URL) is None
    never, first = Snapshot(version=0), Snapshot(version=1)
    assert (ecds.serves(never), ecds.serves(first), ecds.version_of(first)) == (False, True, "1")
    assert (empty.serves(never), empty.version_of(never), empty.version_of(first)) == (True, "empty", "empty")
    assert isinstance(empty, Renderer) and isinstance(ecds, Renderer) and not ecds.always_respond


def test_ecds_serves_the_native_host_the_same_plugin_config() -> None:
    """`meshcache-native`: Envoy 1.40's DynamicModuleFilter (module file, metrics namespace, the
    snapshot's JSON as is). xds-protos' copy of the message predates `module` and
    `metrics_namespace` (fields 6 and 5 in 1.40), so those are read as unknown fields."""
    module = Path("/opt/meshcache/libmeshcache_native.so")
    renderer = EcdsRenderer(Path("/m.wasm"), native_module=module)
    snap = Snapshot(version=7, policies=tuple(demo_policies(generation=7)))
    typed = extension_pb2.TypedExtensionConfig()
    assert renderer.resources(snap)[NATIVE_FILTER_NAME].Unpack(typed)
    assert typed.name == NATIVE_FILTER_NAME and typed.typed_config.type_url == DYNAMIC_MODULE_TYPE_URL
    native = dynamic_modules_pb2.DynamicModuleFilter.FromString(typed.typed_config.value)
    value = wrappers_pb2.StringValue()
    assert native.filter_name == MODULE_FILTER_NAME and native.filter_config.Unpack(value)
    assert value.value == snap.plugin_config_json
    fields = {f.field_number: f.data for f in UnknownFieldSet(native.dynamic_module_config)}
    assert fields[5] == METRICS_NAMESPACE.encode()
    assert base_pb2.AsyncDataSource.FromString(fields[6]).local.filename == str(module)
    # The client role's resource for the native host: the same policies in the client role, as the
    # Wasm `meshcache-client` carries them.
    client = extension_pb2.TypedExtensionConfig()
    assert renderer.resources(snap)[NATIVE_CLIENT_FILTER_NAME].Unpack(client)
    assert client.name == NATIVE_CLIENT_FILTER_NAME
    assert native_filter_value(client) == plugin_config_json(client_plugin_config(snap.plugin_config()))


def native_filter_value(typed: extension_pb2.TypedExtensionConfig) -> str:
    """The plugin configuration JSON a native-host resource carries."""
    value = wrappers_pb2.StringValue()
    assert dynamic_modules_pb2.DynamicModuleFilter.FromString(typed.typed_config.value).filter_config.Unpack(value)
    return value.value
