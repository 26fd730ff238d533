"""`--xds-workers`: several xDS processes behind one port, one fleet view."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import grpc

from meshcache.control_plane.xds_client import XdsClient
from tests.helpers.control_plane import ControlPlaneProc, run
from tests.helpers.wait import aeventually, eventually

STREAMS = 40


def children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z")
    except FileNotFoundError:
        return True


def test_two_xds_processes_share_the_port_and_the_proxy_list(start_cp: Callable[..., ControlPlaneProc]) -> None:
    cp = start_cp(extra_env={"MESHCACHE_CP_XDS_WORKERS": "2"})
    eventually(lambda: "[xds-worker-1]: xDS on" in cp.proc.log_path.read_text(), timeout=15)
    cp.client().put("/v1/policies/m", json={"ttl_s": 1}).raise_for_status()

    def listed() -> list[dict]:
        return [p for p in cp.client().get("/v1/proxies").json()["proxies"] if p["node_id"].startswith("w-")]

    async def scenario() -> None:
        # One TCP connection per client (a local subchannel pool), as separate Envoys have.
        channels = [grpc.aio.insecure_channel(f"127.0.0.1:{cp.xds_port}",
                                              options=[("grpc.use_local_subchannel_pool", 1)])
                    for _ in range(STREAMS)]
        clients = [XdsClient(ch, f"w-{i}") for i, ch in enumerate(channels)]
        for c in clients:
            await c.subscribe()
        for c in clients:
            await c.ack(await c.recv(timeout=10))
        # The kernel spread the connections over both processes; the main lists them all.
        ps = await aeventually(lambda: len(p := listed()) == STREAMS and all(x["acked_version"] == "1" for x in p)
                               and p)
        assert len({p["replica"] for p in ps}) == 2
        # A change reaches the streams of both processes.
        await asyncio.to_thread(cp.client().put, "/v1/policies/m", json={"ttl_s": 2})
        got = await asyncio.gather(*(c.recv(timeout=10) for c in clients))
        assert {r.version_info for r in got} == {"2"}
        for c, r in zip(clients, got, strict=True):
            await c.ack(r)
        await aeventually(lambda: len(p := listed()) == STREAMS and all(x["current"] for x in p))
        for c in clients:
            await c.close()
        for ch in channels:
            await ch.close()

    run(scenario())
    workers = children(cp.proc.popen.pid)
    assert len(workers) == 1
    cp.proc.stop()  # SIGTERM: the main stops its worker
    assert all(gone(w) for w in workers)
    assert "Traceback" not in cp.proc.log_path.read_text()

    cp.restart()
    eventually(lambda: len(children(cp.proc.popen.pid)) == 1)
    workers = children(cp.proc.popen.pid)
    cp.proc.kill()  # SIGKILL: the orphaned worker notices and exits on its own
    eventually(lambda: all(gone(w) for w in workers), timeout=5)
