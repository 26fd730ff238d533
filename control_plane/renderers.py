"""What the xDS server serves, per type URL: a `Renderer` turns a snapshot into the named
resources of one type. The ECDS renderer (the meshcache filter for Envoy) is here; the Istio MCP
renderers are in mcp.py. The server (xds_server.py) and the stream loop (xds_stream.py) only
ever call the methods below, whose defaults suit Envoy-facing types."""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path

from envoy.config.core.v3 import extension_pb2
from envoy.extensions.filters.http.wasm.v3 import wasm_pb2  # noqa: F401 - registers the Wasm type for Any
from google.protobuf import any_pb2, json_format

from meshcache.contract.filter_config import client_plugin_config, plugin_config_json
from meshcache.contract.native_filter import (
    DYNAMIC_MODULE_TYPE_URL,
    NATIVE_CLIENT_FILTER_NAME,
    NATIVE_FILTER_NAME,
    native_filter_proto,
)
from meshcache.contract.paths import FILTER_NATIVE
from meshcache.contract.wasm_filter import CLIENT_FILTER_NAME, FILTER_NAME, extension_config_json, local_code

from .snapshots import Snapshot, SnapshotMemo

ECDS_TYPE_URL = "type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig"


class Renderer(ABC):
    """Turns a snapshot into the named resources of one type URL."""

    type_url: str
    # True: answer even with no resources and before the first snapshot (version 0): MCP sinks
    # (istiod) wait for an answer to every type they subscribe to. Envoy-facing renderers keep
    # False, so Envoy keeps its default_config until there is something to send.
    always_respond: bool = False
    # False: the output does not depend on any snapshot (an Istio kind meshcache never serves), so
    # it is answered even while no snapshot is known; withholding it would only keep a probe or a
    # restarting istiod waiting, while the kinds that carry policies stay unanswered.
    needs_snapshot: bool = True

    @abstractmethod
    def resources(self, snapshot: Snapshot) -> dict[str, any_pb2.Any]: ...

    def version_of(self, snapshot: Snapshot) -> str:
        """The `version_info` sent for `snapshot`; a renderer whose output never changes returns
        one constant version, so it is not re-sent on every snapshot."""
        return str(snapshot.version)

    def serves(self, snapshot: Snapshot) -> bool:
        """Whether to answer for `snapshot` at all (version 0 = never configured)."""
        return snapshot.version != 0 or self.always_respond


class EcdsRenderer(Renderer):
    """The meshcache HTTP filter as an ECDS `TypedExtensionConfig` (the Wasm filter config whose
    plugin configuration is the snapshot's canonical JSON, as is; VM config identical to the
    static default). A second resource, `meshcache-client`, carries the same policies in the
    client role, for client sidecars that route by cache affinity; `meshcache-native` and
    `meshcache-native-client` are the same two for the native host (the dynamic module's
    `DynamicModuleFilter`).
    Each Envoy asks for its name."""

    type_url = ECDS_TYPE_URL

    def __init__(self, wasm_path: Path, native_module: Path = FILTER_NATIVE, resource_name: str = FILTER_NAME
                 ) -> None:
        self.wasm_path = wasm_path
        self.native_module = native_module
        self.resource_name = resource_name
        self._packed = SnapshotMemo(self._render)  # once per snapshot, shared by every stream

    def typed_extension_config(self, snapshot: Snapshot, client: bool = False) -> extension_pb2.TypedExtensionConfig:
        # The same builder as the full-mode EnvoyFilter's EXTENSION_CONFIG (meshcache.contract.extensions), so a
        # local sidecar runs what istiod would deliver, with the module as a local file.
        if client:
            text, name = plugin_config_json(client_plugin_config(snapshot.plugin_config())), CLIENT_FILTER_NAME
        else:
            text, name = snapshot.plugin_config_json, self.resource_name
        config = extension_config_json(local_code(self.wasm_path), text, name)
        return json_format.ParseDict(config, extension_pb2.TypedExtensionConfig())

    def resources(self, snapshot: Snapshot) -> dict[str, any_pb2.Any]:
        return self._packed(snapshot)

    def native_extension_config(self, snapshot: Snapshot, client: bool = False) -> extension_pb2.TypedExtensionConfig:
        """The native host's resource: the same plugin configuration text, for the dynamic module."""
        if client:
            text, name = plugin_config_json(client_plugin_config(snapshot.plugin_config())), NATIVE_CLIENT_FILTER_NAME
        else:
            text, name = snapshot.plugin_config_json, NATIVE_FILTER_NAME
        module = any_pb2.Any(type_url=DYNAMIC_MODULE_TYPE_URL, value=native_filter_proto(self.native_module, text))
        return extension_pb2.TypedExtensionConfig(name=name, typed_config=module)

    def _render(self, snapshot: Snapshot) -> dict[str, any_pb2.Any]:
        out = {}
        configs = [render(snapshot, client) for render in (self.typed_extension_config, self.native_extension_config)
                   for client in (False, True)]
        for config in configs:
            packed = any_pb2.Any()
            packed.Pack(config)
            out[config.name] = packed
        return out
