"""An ADS client that behaves as istiod does with a `configSources` `xds://` address (istio
pkg/adsc): one stream; initial requests per type URL carrying the node and a timestamp nonce;
every response decoded (istio.mcp.v1alpha1.Resource, "<ns>/<name>", the WasmPlugin body) and
ACKed, or NACKed (with the previous version) when it does not decode or validate."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.protobuf import json_format
from google.rpc import status_pb2

from control_plane.mcp import WASM_PLUGIN_TYPE_URL
from meshcache.istio import validate
from meshcache.protos.istio.extensions.v1alpha1 import wasm_pb2
from meshcache.protos.istio.mcp.v1alpha1 import resource_pb2

RESOURCE_ANY = "type.googleapis.com/istio.mcp.v1alpha1.Resource"
WASM_PLUGIN_ANY = "type.googleapis.com/istio.extensions.v1alpha1.WasmPlugin"
BODY_TYPES = {WASM_PLUGIN_TYPE_URL: (WASM_PLUGIN_ANY, wasm_pb2.WasmPlugin, "WasmPlugin")}


class BadResource(ValueError):
    pass


def decode(resp: discovery_pb2.DiscoveryResponse) -> dict[str, dict[str, Any]]:
    """"ns/name" -> the object as istiod would store it (apiVersion/kind/metadata/spec dicts)."""
    out: dict[str, dict[str, Any]] = {}
    for packed in resp.resources:
        if packed.type_url != RESOURCE_ANY:
            raise BadResource(f"resource is {packed.type_url}, not an MCP Resource")
        res = resource_pb2.Resource()
        packed.Unpack(res)
        parts = res.metadata.name.split("/")
        if len(parts) != 2 or not all(parts):
            raise BadResource(f"invalid name {res.metadata.name!r}: want <namespace>/<name>")
        if resp.type_url not in BODY_TYPES:
            raise BadResource(f"unexpected resources for {resp.type_url}")
        any_type, cls, kind = BODY_TYPES[resp.type_url]
        if res.body.type_url != any_type:
            raise BadResource(f"body is {res.body.type_url}, want {any_type}")
        body = cls()
        res.body.Unpack(body)
        group_version = resp.type_url.rsplit("/", 1)[0]
        obj = {"apiVersion": group_version, "kind": kind,
               "metadata": {"name": parts[1], "namespace": parts[0], "labels": dict(res.metadata.labels)},
               "spec": json_format.MessageToDict(body)}
        # What the API server would say about the same object (CRD schema, unknown fields).
        errors = validate.validate_object(obj)
        if kind == "WasmPlugin" and obj["spec"]["url"].split("://")[0] not in ("oci", "http", "https", "file"):
            errors.append(f"url {obj['spec']['url']!r}: scheme must be oci, http, https or file")
        if errors:
            raise BadResource("; ".join(errors))
        out[res.metadata.name] = obj
    return out


class IstiodLikeClient:
    def __init__(self, channel: grpc.aio.Channel, type_urls: list[str], node_id: str = "istiod-0") -> None:
        self.type_urls = type_urls
        self.node = base_pb2.Node(id=node_id, cluster="istiod")
        self.versions: dict[str, str] = {}
        self.state: dict[str, dict[str, dict[str, Any]]] = {}  # type URL -> full state
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
                node=self.node if i == 0 else None, type_url=type_url, response_nonce=time.strftime("%c")))

    async def recv(self, timeout: float = 5.0) -> discovery_pb2.DiscoveryResponse:
        item = await asyncio.wait_for(self._responses.get(), timeout)
        if isinstance(item, BaseException):
            raise item
        return item

    async def handle(self, resp: discovery_pb2.DiscoveryResponse) -> str | None:
        """ACK and store the full state, or NACK; returns the NACK message (None when ACKed)."""
        try:
            decoded = decode(resp)
        except BadResource as exc:
            await self._requests.put(discovery_pb2.DiscoveryRequest(
                type_url=resp.type_url, response_nonce=resp.nonce, version_info=self.versions.get(resp.type_url, ""),
                error_detail=status_pb2.Status(code=3, message=str(exc))))
            return str(exc)
        self.state[resp.type_url] = decoded  # full state: anything absent is deleted
        self.versions[resp.type_url] = resp.version_info
        await self._requests.put(discovery_pb2.DiscoveryRequest(
            type_url=resp.type_url, response_nonce=resp.nonce, version_info=resp.version_info))
        return None

    async def close(self) -> None:
        await self._requests.put(None)
        self._call.cancel()
        self._reader.cancel()
