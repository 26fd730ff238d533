"""An ADS client that behaves as istiod 1.30 does with a `configSources` `xds://` address
(istio pkg/adsc, pilot/pkg/bootstrap/configcontroller.go):
- one stream; initial requests for MeshConfig and every type of `collections.Pilot`, the node on
  the first, each with a `time.Now().String()` nonce;
- synced (istiod starts serving xDS and its injection webhook) only once every type has had a
  response, empty ones included;
- every response ACKed with its version and nonce (adsc never NACKs: bad resources are logged
  and skipped); `nack_invalid=True` NACKs instead, to exercise the server's NACK path;
- resources decoded as `istio.mcp.v1alpha1.Resource` with names `<namespace>/<name>` and the
  body by its own type URL, using Istio's field numbers from tests/istio/wire.py;
- full state per type (absent = deleted);
- what the push context reads: TrafficExtension and EnvoyFilter. A WasmPlugin from MCP is stored
  but never used (the WasmPlugin -> TrafficExtension translation is on the Kubernetes store only).
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import AsyncIterator
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.rpc import status_pb2

from meshcache.ctl.istio import validate
from tests.istio import wire

# pkg/config/schema/collections Pilot (1.30.3) + MeshConfig, as GVK strings.
ISTIOD_1_30_TYPES = [
    "core/v1alpha1/MeshConfig",
    "security.istio.io/v1/AuthorizationPolicy",
    "networking.istio.io/v1/DestinationRule",
    "networking.istio.io/v1alpha3/EnvoyFilter",
    "networking.istio.io/v1/Gateway",
    "security.istio.io/v1/PeerAuthentication",
    "networking.istio.io/v1beta1/ProxyConfig",
    "security.istio.io/v1/RequestAuthentication",
    "networking.istio.io/v1/ServiceEntry",
    "networking.istio.io/v1/Sidecar",
    "telemetry.istio.io/v1/Telemetry",
    "extensions.istio.io/v1alpha1/TrafficExtension",
    "networking.istio.io/v1/VirtualService",
    "extensions.istio.io/v1alpha1/WasmPlugin",
    "networking.istio.io/v1/WorkloadEntry",
    "networking.istio.io/v1/WorkloadGroup",
]
RESOURCE_ANY = "type.googleapis.com/istio.mcp.v1alpha1.Resource"
WASM_PLUGIN_TYPE_URL = "extensions.istio.io/v1alpha1/WasmPlugin"
# Body type URL -> (the wire schema, the Kind istiod stores it as). The type URL istiod's
# `Body.UnmarshalNew()` resolves must be the one of Istio's own Go type.
BODIES = {
    "type.googleapis.com/istio.extensions.v1alpha1.TrafficExtension": ("TrafficExtension", "TrafficExtension"),
    "type.googleapis.com/istio.networking.v1alpha3.EnvoyFilter": ("EnvoyFilter", "EnvoyFilter"),
}
PUSH_CONTEXT_KINDS = ("TrafficExtension", "EnvoyFilter")


class BadResource(ValueError):
    pass


def go_time_now() -> str:
    """What Go's `time.Now().String()` looks like (adsc's initial nonce)."""
    now = dt.datetime.now(dt.UTC)
    return now.strftime("%Y-%m-%d %H:%M:%S.%f000 +0000 UTC m=+0.012345678")


def decode(resp: discovery_pb2.DiscoveryResponse, revision: str = "") -> dict[str, dict[str, Any]]:
    """"ns/name" -> the object as istiod would store it (apiVersion/kind/metadata/spec dicts)."""
    out: dict[str, dict[str, Any]] = {}
    group_version, _, kind_of_type = resp.type_url.rpartition("/")
    for packed in resp.resources:
        if packed.type_url != RESOURCE_ANY:
            raise BadResource(f"resource is {packed.type_url}, not an MCP Resource")
        try:
            res = wire.decode("Resource", packed.value)
        except wire.WireError as exc:
            raise BadResource(str(exc)) from exc
        meta = res.get("metadata", {})
        labels = meta.get("labels", {})
        if labels.get("istio.io/rev", revision) != revision:
            continue  # config.ObjectInRevision: another revision's object
        parts = meta.get("name", "").split("/")
        if len(parts) != 2 or not all(parts):
            raise BadResource(f"invalid name {meta.get('name')!r}: want <namespace>/<name>")
        body = res.get("body", {})
        if body.get("typeUrl") not in BODIES:
            raise BadResource(f"body type {body.get('typeUrl')!r} is no Istio kind this client knows")
        schema, kind = BODIES[body["typeUrl"]]
        if kind != kind_of_type:
            raise BadResource(f"{kind} body served under {resp.type_url}")
        try:
            spec = wire.decode(schema, body.get("value", b""))
        except wire.WireError as exc:
            raise BadResource(f"{meta['name']}: {exc}") from exc
        obj = {"apiVersion": group_version, "kind": kind,
               "metadata": {"name": parts[1], "namespace": parts[0], "labels": labels}, "spec": spec}
        # What the API server would say about the same object (CRD schema, unknown fields).
        errors = validate.validate_object(obj)
        if errors:
            raise BadResource("; ".join(errors))
        out[meta["name"]] = obj
    return out


class IstiodLikeClient:
    def __init__(self, channel: grpc.aio.Channel, type_urls: list[str] | None = None, node_id: str = "istiod-0",
                 revision: str = "", nack_invalid: bool = False) -> None:
        self.type_urls = list(type_urls or ISTIOD_1_30_TYPES)
        self.node = base_pb2.Node(id=node_id, cluster="istiod")
        self.revision, self.nack_invalid = revision, nack_invalid
        self.versions: dict[str, str] = {}
        self.state: dict[str, dict[str, dict[str, Any]]] = {}  # type URL -> full state
        self.answered: set[str] = set()
        self.errors: list[str] = []  # what istiod would log and skip
        self._requests: asyncio.Queue[discovery_pb2.DiscoveryRequest | None] = asyncio.Queue()
        self._call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).StreamAggregatedResources(self._iter())
        # One task owns call.read(): a timed-out read would otherwise cancel the whole RPC.
        self._responses: asyncio.Queue[discovery_pb2.DiscoveryResponse | BaseException] = asyncio.Queue()
        self._reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        try:
            while (resp := await self._call.read()) is not grpc.aio.EOF:
                self._responses.put_nowait(resp)
            self._responses.put_nowait(ConnectionError("stream closed"))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the next recv()
            self._responses.put_nowait(exc)

    async def _iter(self) -> AsyncIterator[discovery_pb2.DiscoveryRequest]:
        while (req := await self._requests.get()) is not None:
            yield req

    async def start(self) -> None:
        for i, type_url in enumerate(self.type_urls):
            # adsc.Send: node on the first request only; ResponseNonce = time.Now().String().
            await self._requests.put(discovery_pb2.DiscoveryRequest(
                node=self.node if i == 0 else None, type_url=type_url, response_nonce=go_time_now()))

    @property
    def synced(self) -> bool:
        """adsc.HasSynced: every subscribed type has had a response."""
        return self.answered >= set(self.type_urls)

    def effective(self) -> dict[str, dict[str, Any]]:
        """What the push context uses: TrafficExtensions and EnvoyFilters, by `Kind/ns/name`."""
        return {f"{o['kind']}/{name}": o for objs in self.state.values() for name, o in objs.items()
                if o["kind"] in PUSH_CONTEXT_KINDS}

    async def recv(self, timeout: float = 5.0) -> discovery_pb2.DiscoveryResponse:
        item = await asyncio.wait_for(self._responses.get(), timeout)
        if isinstance(item, BaseException):
            raise item
        return item

    async def handle(self, resp: discovery_pb2.DiscoveryResponse) -> str | None:
        """Store the full state and ACK; a resource that does not decode is skipped and logged as
        adsc does (or NACKed with `nack_invalid`). Returns the error, if any."""
        self.answered.add(resp.type_url)
        error = None
        try:
            if resp.type_url == WASM_PLUGIN_TYPE_URL:  # stored, never read by the push context
                decoded = {f"#{i}": {"kind": "WasmPlugin"} for i in range(len(resp.resources))}
            else:
                decoded = decode(resp, self.revision)
        except BadResource as exc:
            error = str(exc)
            self.errors.append(error)
            if self.nack_invalid:
                await self._requests.put(discovery_pb2.DiscoveryRequest(
                    type_url=resp.type_url, response_nonce=resp.nonce,
                    version_info=self.versions.get(resp.type_url, ""),
                    error_detail=status_pb2.Status(code=3, message=error)))
                return error
            decoded = {}
        self.state[resp.type_url] = decoded  # full state: anything absent is deleted
        self.versions[resp.type_url] = resp.version_info
        await self._requests.put(discovery_pb2.DiscoveryRequest(
            type_url=resp.type_url, response_nonce=resp.nonce, version_info=resp.version_info, node=self.node))
        return error

    async def sync(self, timeout: float = 10.0) -> None:
        """Read and handle responses until every type has been answered."""
        while not self.synced:
            await self.handle(await self.recv(timeout))

    async def close(self) -> None:
        await self._requests.put(None)
        self._call.cancel()
        self._reader.cancel()
