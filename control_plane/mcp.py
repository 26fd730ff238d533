"""MCP-over-xDS for istiod: the control plane as a `meshConfig.configSources` `xds://` source.

istiod 1.30 (pkg/adsc) opens one ADS stream and subscribes to MeshConfig and every Istio config
type by its GVK type URL (`networking.istio.io/v1alpha3/EnvoyFilter`, ...). Each resource is an
Any of `istio.mcp.v1alpha1.Resource{metadata, body}`; every response is the full state of its
type (absent = deleted). What shapes this module:
- istiod counts the source as synced only once *every* type got a response, and serves neither
  xDS nor its injection webhook before that: types meshcache does not serve are answered too,
  with no resources (`EmptyMcpRenderer`), and before the first snapshot (version 0) as well;
- istiod reads WasmPlugin only from Kubernetes (its translation into TrafficExtension is attached
  to the Kubernetes store), so meshcache serves what the push context reads: TrafficExtension
  (basic mode) or EnvoyFilter (full mode), built by meshcache/contract/extensions.py exactly as
  `meshcache istio render` previews them, and re-sent in full on every snapshot;
- its initial requests carry a (timestamp) nonce, handled by the server's first-request rule.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from typing import Any

from google.protobuf import any_pb2, json_format, message, timestamp_pb2

from meshcache.contract import extensions
from meshcache.contract.protos.istio.extensions.v1alpha1 import traffic_extension_pb2
from meshcache.contract.protos.istio.mcp.v1alpha1 import metadata_pb2, resource_pb2
from meshcache.contract.protos.istio.networking.v1alpha3 import envoy_filter_pb2

from .istio_objects import IstioObjects
from .renderers import Renderer
from .settings import Settings
from .snapshots import Snapshot, SnapshotMemo

ENVOY_FILTER_TYPE_URL = "networking.istio.io/v1alpha3/EnvoyFilter"
TRAFFIC_EXTENSION_TYPE_URL = "extensions.istio.io/v1alpha1/TrafficExtension"
WASM_PLUGIN_TYPE_URL = "extensions.istio.io/v1alpha1/WasmPlugin"
# `group/version/Kind` as istiod's GVK strings (core types are "core/v1alpha1/..."); anything with
# a type.googleapis.com prefix is Envoy's xDS and handled by the other renderers.
GVK_RE = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/v[0-9]+((alpha|beta)[0-9]+)?/[A-Z][A-Za-z0-9]*$")
_BODIES: dict[str, type[message.Message]] = {
    ENVOY_FILTER_TYPE_URL: envoy_filter_pb2.EnvoyFilter,
    TRAFFIC_EXTENSION_TYPE_URL: traffic_extension_pb2.TrafficExtension,
}
MODE_TYPE_URL = {"full": ENVOY_FILTER_TYPE_URL, "basic": TRAFFIC_EXTENSION_TYPE_URL, "native": ENVOY_FILTER_TYPE_URL}


class EmptyMcpRenderer(Renderer):
    """An Istio config type meshcache has nothing for: answered with no resources so istiod syncs."""

    always_respond = True
    needs_snapshot = False

    def __init__(self, type_url: str) -> None:
        self.type_url = type_url

    def resources(self, snapshot: Snapshot) -> dict[str, any_pb2.Any]:
        return {}

    def version_of(self, snapshot: Snapshot) -> str:
        return "empty"  # never changes: answered once per stream, not on every policy change


def mcp_fallback(type_url: str) -> EmptyMcpRenderer | None:
    """For `XdsServer.add_fallback`: any other Istio GVK gets an empty answer."""
    return EmptyMcpRenderer(type_url) if GVK_RE.match(type_url) else None


class IstioMcpRenderer(Renderer):
    """The objects of one kind (EnvoyFilter or TrafficExtension) for one snapshot, as MCP resources
    `<namespace>/<name>`; rendered once per snapshot for every stream."""

    always_respond = True

    def __init__(self, type_url: str, build: Callable[[dict[str, Any]], list[dict[str, Any]]], namespace: str,
                 revision: str = "") -> None:
        self.type_url, self.build, self.namespace, self.revision = type_url, build, namespace, revision
        self.body_type = _BODIES[type_url]
        self._packed = SnapshotMemo(self._render)  # once per snapshot, shared by every stream

    @classmethod
    def from_settings(cls, settings: Settings) -> IstioMcpRenderer | None:
        """None when no module URL is configured (istiod then gets empty answers only)."""
        istio = IstioObjects.from_settings(settings)
        if istio is None:
            return None
        return cls(MODE_TYPE_URL[istio.mode], istio.build, istio.namespace, istio.revision)

    def mcp_resource(self, obj: dict[str, Any], snapshot: Snapshot) -> resource_pb2.Resource:
        created = timestamp_pb2.Timestamp()
        created.FromNanoseconds(int(snapshot.created_at * 1e9))
        labels = dict(extensions.MANAGED_BY)
        if self.revision:
            labels[extensions.REVISION_LABEL] = self.revision
        body = any_pb2.Any()
        body.Pack(json_format.ParseDict(obj["spec"], self.body_type()))
        # istiod (pkg/adsc) replaces a stored object only when this version changes: the snapshot
        # alone would hide a rollout that changes the spec but not the policies (a new module pin,
        # selector or ports), so the version also names the spec's content.
        spec_hash = hashlib.sha256(json.dumps(obj["spec"], sort_keys=True).encode()).hexdigest()[:12]
        return resource_pb2.Resource(
            metadata=metadata_pb2.Metadata(
                name=f"{self.namespace}/{obj['metadata']['name']}", create_time=created,
                version=f"{snapshot.version}-{spec_hash}", labels=labels,
                annotations={extensions.SNAPSHOT_ANNOTATION: str(snapshot.version)}),
            body=body)

    def resources(self, snapshot: Snapshot) -> dict[str, any_pb2.Any]:
        # Version 0 = no policies yet: full state is "no meshcache filter" (traffic flows uncached).
        if snapshot.version == 0:
            return {}
        return self._packed(snapshot)

    def _render(self, snapshot: Snapshot) -> dict[str, any_pb2.Any]:
        out = {}
        for obj in self.build(snapshot.plugin_config()):
            res = self.mcp_resource(obj, snapshot)
            packed = any_pb2.Any()
            packed.Pack(res)
            out[res.metadata.name] = packed
        return out
