"""MCP-over-xDS for istiod: the control plane as a `meshConfig.configSources` `xds://` source.

istiod opens one ADS stream and subscribes to every Istio config type by its GVK type URL
(`extensions.istio.io/v1alpha1/WasmPlugin`, `networking.istio.io/v1/VirtualService`, ...). Each
resource is an Any of `istio.mcp.v1alpha1.Resource{metadata, body}`; every response is the full
state of its type (absent = deleted). Two istiod behaviours shape this module:
- istiod counts the source as synced only once *every* type it subscribed to got a response,
  so the types meshcache does not serve are answered too, with no resources (`EmptyMcpRenderer`),
  and the WasmPlugin type is answered even before the first snapshot (version 0: no plugin);
- its initial requests carry a (timestamp) nonce, handled by the server's first-request rule.

The WasmPlugin (`<namespace>/meshcache`) carries the current snapshot as `pluginConfig` and is
re-sent on every snapshot, with the same spec as the rendered manifests (meshcache/istio).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from google.protobuf import any_pb2, json_format, timestamp_pb2

from meshcache.istio.oci import image_for, sha256_hex
from meshcache.istio.wasmplugin import wasm_plugin_spec
from meshcache.protos.istio.extensions.v1alpha1 import wasm_pb2
from meshcache.protos.istio.mcp.v1alpha1 import metadata_pb2, resource_pb2

from .settings import Settings
from .snapshots import Snapshot

log = logging.getLogger("control_plane.mcp")

WASM_PLUGIN_TYPE_URL = "extensions.istio.io/v1alpha1/WasmPlugin"
RESOURCE_NAME = "meshcache"
# `group/version/Kind` as istiod's GVK strings (core types are "core/v1/..."); anything with a
# type.googleapis.com prefix is Envoy's xDS and handled by the other renderers.
GVK_RE = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/v[0-9]+((alpha|beta)[0-9]+)?/[A-Z][A-Za-z0-9]*$")
MANAGED_BY = {"app.kubernetes.io/managed-by": "meshcache-control-plane"}


class EmptyMcpRenderer:
    """An Istio config type meshcache has nothing for: answered with no resources so istiod syncs."""

    always_respond = True

    def __init__(self, type_url: str) -> None:
        self.type_url = type_url

    def resources(self, snapshot: Snapshot) -> dict[str, any_pb2.Any]:
        return {}

    def version_of(self, snapshot: Snapshot) -> str:
        return "empty"  # never changes: answered once per stream, not on every policy change


def mcp_fallback(type_url: str) -> EmptyMcpRenderer | None:
    """For `XdsServer.add_fallback`: any other Istio GVK gets an empty answer."""
    return EmptyMcpRenderer(type_url) if GVK_RE.match(type_url) else None


def default_sha256(url: str, module_path: Path) -> str:
    """What Istio verifies: the image manifest digest for oci://, else the file's sha256."""
    if not module_path.is_file():
        return ""
    if url.startswith("oci://"):
        return image_for(module_path).digest
    return sha256_hex(module_path.read_bytes())


class WasmPluginMcpRenderer:
    type_url = WASM_PLUGIN_TYPE_URL
    always_respond = True

    def __init__(self, namespace: str, url: str, sha256: str, color: str = "", revision: str = "",
                 selector: dict[str, str] | None = None) -> None:
        self.namespace, self.url, self.sha256, self.color = namespace, url, sha256, color
        self.revision = revision
        self.selector = dict(selector if selector is not None else {"app": "meshcache-engine"})
        if color:
            self.selector["color"] = color
        self._memo: tuple[Snapshot, dict[str, any_pb2.Any]] | None = None
        if not url:
            log.warning("MESHCACHE_CP_ISTIO_WASM_URL is not set: istiod gets no meshcache WasmPlugin over MCP")

    @classmethod
    def from_settings(cls, settings: Settings) -> WasmPluginMcpRenderer:
        sha = settings.istio_wasm_sha256 or default_sha256(settings.istio_wasm_url, settings.istio_module_path)
        return cls(settings.istio_namespace, settings.istio_wasm_url, sha, settings.istio_color,
                   settings.istio_revision)

    @property
    def resource_name(self) -> str:
        return f"{self.namespace}/{RESOURCE_NAME}"

    def wasm_plugin(self, snapshot: Snapshot) -> wasm_pb2.WasmPlugin:
        config = {**snapshot.plugin_config(), "color": self.color}
        spec = wasm_plugin_spec(url=self.url, sha256=self.sha256, plugin_config=config, selector=self.selector)
        return json_format.ParseDict(spec, wasm_pb2.WasmPlugin())

    def mcp_resource(self, snapshot: Snapshot) -> resource_pb2.Resource:
        created = timestamp_pb2.Timestamp()
        created.FromNanoseconds(int(snapshot.created_at * 1e9))
        labels = dict(MANAGED_BY)
        if self.revision:
            labels["istio.io/rev"] = self.revision
        body = any_pb2.Any()
        body.Pack(self.wasm_plugin(snapshot))
        return resource_pb2.Resource(
            metadata=metadata_pb2.Metadata(
                name=self.resource_name, create_time=created, version=str(snapshot.version), labels=labels,
                annotations={"meshcache.io/snapshot-version": str(snapshot.version)}),
            body=body)

    def resources(self, snapshot: Snapshot) -> dict[str, Any]:
        # Version 0 = no policies yet: full state is "no meshcache WasmPlugin" (the k8s one, if
        # any, still applies). Rendered once per snapshot for all streams.
        if snapshot.version == 0 or not self.url:
            return {}
        if self._memo is not None and self._memo[0] is snapshot:
            return self._memo[1]
        packed = any_pb2.Any()
        packed.Pack(self.mcp_resource(snapshot))
        out = {self.resource_name: packed}
        self._memo = (snapshot, out)
        return out
