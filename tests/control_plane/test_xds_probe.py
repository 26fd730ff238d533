"""`/healthz/xds` and `/readyz/xds`: round trips through the xDS serving path (control_plane/
xds_probe.py), which is what kubelet's probes and the local mesh's supervisor use. A stopped or
wedged xDS process fails them; a TCP check on the xDS port would not (the kernel still accepts)."""

from __future__ import annotations

import os
import signal
import socket
from collections.abc import Callable

import grpc
import httpx
from envoy.service.discovery.v3 import ads_pb2_grpc

from meshcache.control_plane.mcp import ENVOY_FILTER_TYPE_URL
from meshcache.control_plane.xds_client import XdsClient
from meshcache.control_plane.xds_server import MAX_PROBE_STREAMS
from meshcache.ctl import procs
from tests.control_plane.test_xds_workers import children
from tests.helpers.control_plane import ControlPlaneProc, run
from tests.helpers.wait import eventually

ISTIO_ENV = {"MESHCACHE_CP_ISTIO_WASM_URL": "file:///opt/meshcache/filter.wasm",
             "MESHCACHE_CP_ISTIO_WASM_SHA256": "0" * 64}


def get(cp: ControlPlaneProc, path: str) -> httpx.Response:
    return procs.local_http().get(f"{cp.url}{path}", timeout=5)


def test_probes_answer_through_the_xds_server_and_are_no_proxies(
        start_cp: Callable[..., ControlPlaneProc]) -> None:
    cp = start_cp(extra_env=ISTIO_ENV)
    live, ready = get(cp, "/healthz/xds"), get(cp, "/readyz/xds")
    assert live.status_code == 200 and ready.status_code == 200, (live.text, ready.text)
    assert live.json()["processes"] == 1 and live.json()["round_trip_ms"] < 1000
    # The probe streams are not proxies: not listed, not counted as streams or pushes.
    assert cp.client().get("/v1/proxies").json()["proxies"] == []
    metrics = get(cp, "/metrics").text
    assert "meshcache_cp_xds_pushes_total{" not in metrics
    assert 'meshcache_cp_xds_streams{transport="ads"} 1' not in metrics


def test_readiness_fails_when_istiod_could_not_connect(start_cp: Callable[..., ControlPlaneProc]) -> None:
    """At the stream limit istiod's stream would be refused (and a starting istiod exits): the
    pod must leave the Service's endpoints. Liveness fails too (the process cannot serve)."""
    cp = start_cp(extra_env={**ISTIO_ENV, "MESHCACHE_CP_MAX_XDS_STREAMS": "1"})
    assert get(cp, "/readyz/xds").status_code == 200

    async def hold_one_stream() -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{cp.xds_port}") as ch:
            client = XdsClient(ch, "istiod-like", ads=True, resource_names=(), type_url=ENVOY_FILTER_TYPE_URL)
            await client.subscribe()
            await client.recv(timeout=10)
            assert get(cp, "/readyz/xds").status_code == 503
            # The reason: the server's refusal. Under load the probe's own write can lose the race
            # with that status (grpc core reports the failed write as INTERNAL): a later probe says it.
            eventually(lambda: "RESOURCE_EXHAUSTED" in get(cp, "/readyz/xds").json()["detail"], timeout=10)
            await client.close()

    run(hold_one_stream())
    eventually(lambda: get(cp, "/readyz/xds").status_code == 200)


def test_a_stopped_xds_worker_fails_the_probes_a_tcp_check_does_not(
        start_cp: Callable[..., ControlPlaneProc]) -> None:
    cp = start_cp(extra_env={**ISTIO_ENV, "MESHCACHE_CP_XDS_WORKERS": "2"})
    eventually(lambda: "[xds-worker-1]: xDS on" in cp.proc.log_path.read_text(), timeout=15)
    eventually(lambda: get(cp, "/healthz/xds").json().get("processes") == 2)
    (worker,) = children(cp.proc.popen.pid)
    os.kill(worker, signal.SIGSTOP)
    try:
        live = get(cp, "/healthz/xds")
        assert live.status_code == 503, live.text
        assert "xDS process 1: no answer within 1 s" in live.json()["detail"]
        assert get(cp, "/readyz/xds").status_code == 503
        # What the old readiness probe (tcpSocket on the xDS port) saw: still accepting.
        with socket.create_connection(("127.0.0.1", cp.xds_port), timeout=1):
            pass
    finally:
        os.kill(worker, signal.SIGCONT)
    eventually(lambda: get(cp, "/healthz/xds").status_code == 200)


def test_a_stopped_control_plane_fails_its_probe_within_the_timeout(cp: ControlPlaneProc) -> None:
    """What kubelet and the supervisor see of a wedged main process: no answer in time."""
    os.kill(cp.proc.popen.pid, signal.SIGSTOP)
    try:
        try:
            status = procs.local_http().get(f"{cp.url}/healthz/xds", timeout=1).status_code
        except httpx.TimeoutException:
            status = 0
        assert status == 0
    finally:
        os.kill(cp.proc.popen.pid, signal.SIGCONT)
    assert get(cp, "/healthz/xds").status_code == 200


def _probe_socket(pid: int) -> str:
    """The control plane's probe socket, as any local process can find it (/proc/net/unix)."""
    prefix = f"@meshcache-cp-xds-probe-{pid}-"
    names = {line.split()[-1] for line in open("/proc/net/unix").read().splitlines()[1:]
             if line.split()[-1].startswith(prefix)}
    (name,) = names
    return f"unix-abstract:{name[1:]}"


def test_the_probe_socket_serves_istio_kinds_only(start_cp: Callable[..., ControlPlaneProc]) -> None:
    """Plaintext and open to local processes: never the sidecars' ECDS (kept to certificate
    holders on `meshcache up`), and a bounded number of streams."""
    cp = start_cp(extra_env=ISTIO_ENV)
    cp.client().put("/v1/policies/m", json={"ttl_s": 1}).raise_for_status()
    address = _probe_socket(cp.proc.popen.pid)

    async def scenario() -> None:
        async with grpc.aio.insecure_channel(address) as ch:
            mcp = XdsClient(ch, "local", ads=True, resource_names=(), type_url=ENVOY_FILTER_TYPE_URL)
            await mcp.subscribe()
            assert (await mcp.recv(timeout=10)).resources  # the EnvoyFilters istiod gets
            ecds = XdsClient(ch, "local", ads=True)  # the server sidecars' `meshcache` resource
            await ecds.subscribe()
            try:
                await ecds.recv(timeout=1)
                raise AssertionError("ECDS answered on the probe socket")
            except TimeoutError:
                pass
            held = [XdsClient(ch, f"p{i}", ads=True, resource_names=(), type_url=ENVOY_FILTER_TYPE_URL)
                    for i in range(MAX_PROBE_STREAMS - 2)]
            for c in held:
                await c.subscribe()
                await c.recv(timeout=10)
            extra = ads_pb2_grpc.AggregatedDiscoveryServiceStub(ch).StreamAggregatedResources(timeout=10)
            assert await extra.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert await extra.details() == "too many probe streams"
            for c in (mcp, ecds, *held):
                await c.close()

    run(scenario())
    assert cp.client().get("/v1/proxies").json()["proxies"] == []
    assert get(cp, "/readyz/xds").status_code == 200
