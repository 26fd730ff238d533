"""A minimal state-of-the-world xDS client (ECDS or ADS) that behaves like Envoy's: subscribe,
then ACK or NACK every response. Used by the tests and the propagation benchmark, and handy
for debugging: `python -m meshcache.control_plane.xds_client --port 18000` prints every push.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2, extension_pb2
from envoy.extensions.filters.http.wasm.v3 import wasm_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from envoy.service.extension.v3 import config_discovery_pb2_grpc
from google.protobuf import wrappers_pb2
from google.rpc import status_pb2

from meshcache.contract.wasm_filter import FILTER_NAME

from .renderers import ECDS_TYPE_URL


def plugin_config_of(resp: discovery_pb2.DiscoveryResponse) -> dict[str, Any]:
    """The filter's plugin configuration carried by an ECDS response."""
    tec = extension_pb2.TypedExtensionConfig()
    resp.resources[0].Unpack(tec)
    wasm = wasm_pb2.Wasm()
    tec.typed_config.Unpack(wasm)
    value = wrappers_pb2.StringValue()
    wasm.config.configuration.Unpack(value)
    return json.loads(value.value)  # type: ignore[no-any-return]


class XdsClient:
    def __init__(self, channel: grpc.aio.Channel, node_id: str, cluster: str = "test",
                 ads: bool = False, resource_names: tuple[str, ...] = (FILTER_NAME,),
                 type_url: str = ECDS_TYPE_URL, queue_size: int = 16) -> None:
        self.node = base_pb2.Node(id=node_id, cluster=cluster)
        self.ads, self.names, self.type_url = ads, list(resource_names), type_url
        self._requests: asyncio.Queue[discovery_pb2.DiscoveryRequest | None] = asyncio.Queue(queue_size)
        if ads:
            stub: Any = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel)
            self._call = stub.StreamAggregatedResources(self._iter())
        else:
            stub = config_discovery_pb2_grpc.ExtensionConfigDiscoveryServiceStub(channel)
            self._call = stub.StreamExtensionConfigs(self._iter())
        self.version = ""  # last ACKed version
        # A reader task owns call.read(): cancelling a read (a recv timeout) would cancel the RPC.
        self._responses: asyncio.Queue[discovery_pb2.DiscoveryResponse | BaseException] = asyncio.Queue()
        self._reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        try:
            while True:
                resp = await self._call.read()
                if resp is grpc.aio.EOF:
                    raise ConnectionError("xDS stream closed by the server")
                self._responses.put_nowait(resp)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the next recv()
            self._responses.put_nowait(exc)

    async def _iter(self) -> AsyncIterator[discovery_pb2.DiscoveryRequest]:
        while True:
            req = await self._requests.get()
            if req is None:
                return
            yield req

    async def subscribe(self, version_info: str = "") -> None:
        self.version = version_info
        await self._requests.put(discovery_pb2.DiscoveryRequest(
            node=self.node, resource_names=self.names, type_url=self.type_url, version_info=version_info))

    async def recv(self, timeout: float = 5.0) -> discovery_pb2.DiscoveryResponse:
        item = await asyncio.wait_for(self._responses.get(), timeout)
        if isinstance(item, BaseException):
            raise item
        return item

    async def ack(self, resp: discovery_pb2.DiscoveryResponse) -> None:
        self.version = resp.version_info
        await self._requests.put(discovery_pb2.DiscoveryRequest(
            resource_names=self.names, type_url=self.type_url, version_info=resp.version_info,
            response_nonce=resp.nonce))

    async def nack(self, resp: discovery_pb2.DiscoveryResponse, message: str) -> None:
        await self._requests.put(discovery_pb2.DiscoveryRequest(
            resource_names=self.names, type_url=self.type_url, version_info=self.version,
            response_nonce=resp.nonce, error_detail=status_pb2.Status(code=3, message=message)))

    async def close(self) -> None:
        await self._requests.put(None)
        self._call.cancel()
        self._reader.cancel()


async def _watch(port: int, node_id: str) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        client = XdsClient(channel, node_id)
        await client.subscribe()
        while True:
            resp = await client.recv(timeout=3600)
            print(f"version {resp.version_info}: {json.dumps(plugin_config_of(resp))}", flush=True)
            await client.ack(resp)


def main() -> None:
    p = argparse.ArgumentParser(description="Print every ECDS push from a meshcache control plane")
    p.add_argument("--port", type=int, default=18000)
    p.add_argument("--node-id", default="xds-client")
    args = p.parse_args()
    asyncio.run(_watch(args.port, args.node_id))


if __name__ == "__main__":
    main()
