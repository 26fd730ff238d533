"""The xDS serving path's own probe: an ADS round trip through this process's xDS server.

istiod cannot serve until it has an answer for every type it asks its `xds://` source for
(docs/istio.md, "What istiod waits for"), so "alive" and "ready" here mean "answers an ADS
stream now", not "the port accepts": the kernel accepts TCP connections for a process that is
stopped or whose event loop is wedged, so a TCP check passes on exactly the process that blocks
istiod. Kubelet cannot speak TLS gRPC to the xDS port, so each xDS server also listens on a Linux
abstract Unix socket (plaintext; in a pod only the pod's own containers share that namespace),
and the HTTP endpoints `/healthz/xds` and `/readyz/xds` (api/routers/health.py) open a stream
there and wait for the answers, within a deadline. With `--xds-workers N` every worker has its
own socket and the main process probes them all.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2

from .mcp import GVK_RE

# istiod's first subscription; the fallback renderer answers it from the stream loop alone (no
# snapshot needed): the liveness round trip.
LIVE_TYPES = ("core/v1alpha1/MeshConfig",)
PROBE_NODE = "meshcache-probe"
TIMEOUT_S = 1.0


def probe_address(token: str, index: int) -> str:
    """The probe socket of xDS process `index` (0 = the main process) of the control plane whose
    xDS server has `token` (XdsServer.probe_token)."""
    return f"unix-abstract:meshcache-cp-xds-probe-{token}-{index}"


def is_probe_peer(peer: str) -> bool:
    """The xDS server listens on TCP and on its probe socket only: a Unix peer is the probe."""
    return peer.startswith("unix")


def ready_types(served: Sequence[str]) -> tuple[str, ...]:
    """What readiness waits for: the liveness type plus every Istio kind this process serves
    istiod (EnvoyFilter or TrafficExtension): the answers istiod's sync needs."""
    return (*LIVE_TYPES, *sorted(t for t in served if GVK_RE.match(t) and t not in LIVE_TYPES))


class ProbeRefused(Exception):
    """The server ended the probe's stream (its status as the message)."""


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    elapsed_ms: float
    error: str = ""


async def round_trip(address: str, type_urls: Sequence[str], timeout_s: float = TIMEOUT_S) -> ProbeResult:
    """One ADS stream to `address`: a request per type URL, then every answer within `timeout_s`."""
    t0 = time.monotonic()
    missing = set(type_urls)

    async def run() -> None:
        async with grpc.aio.insecure_channel(address) as channel:
            call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).StreamAggregatedResources(timeout=timeout_s)
            node = base_pb2.Node(id=PROBE_NODE)
            try:
                for type_url in type_urls:
                    await call.write(discovery_pb2.DiscoveryRequest(type_url=type_url, node=node))
            except grpc.aio.AioRpcError:
                # The server ended the stream first (a write then fails INTERNAL): say why it did.
                raise ProbeRefused(f"{(await call.code()).name}: {await call.details()}") from None
            while missing:
                resp = await call.read()
                if resp is grpc.aio.EOF:
                    break
                missing.discard(resp.type_url)
            call.cancel()

    error = ""
    try:
        await asyncio.wait_for(run(), timeout_s)
    except TimeoutError:
        error = f"no answer within {timeout_s:g} s"
    except ProbeRefused as exc:
        error = str(exc)
    except grpc.aio.AioRpcError as exc:
        error = f"{exc.code().name}: {exc.details()}"
    except Exception as exc:  # a probe answers 503 with the reason, whatever failed
        error = f"{type(exc).__name__}: {exc}"
    if not error and missing:
        error = "stream ended"
    if error and missing:
        error += f" (waiting for {', '.join(sorted(missing))})"
    return ProbeResult(not error, round((time.monotonic() - t0) * 1000, 1), error)


class XdsProbe:
    """The round trips of one control plane (every xDS process), one at a time per kind: probes
    arriving while one runs share its result, so a burst of them costs one round trip."""

    def __init__(self, token: str, processes: int, served: Sequence[str], timeout_s: float = TIMEOUT_S) -> None:
        self.addresses = [probe_address(token, i) for i in range(processes)]
        self.kinds = {"live": LIVE_TYPES, "ready": ready_types(served)}
        self.timeout_s = timeout_s
        self._inflight: dict[str, asyncio.Future[list[ProbeResult]]] = {}

    async def check(self, kind: str) -> list[ProbeResult]:
        running = self._inflight.get(kind)
        if running is None or running.done():
            running = self._inflight[kind] = asyncio.ensure_future(asyncio.gather(
                *(round_trip(a, self.kinds[kind], self.timeout_s) for a in self.addresses)))
        return await asyncio.shield(running)
