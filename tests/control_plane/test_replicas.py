"""Several control-plane replicas on one Redis with real Envoys spread over them: a PUT on any
replica reaches every Envoy, every replica lists every proxy, and a replica killed under load
loses nothing (its Envoys reopen their stream on another; no request fails)."""

from __future__ import annotations

import sys
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from meshcache.contract.paths import FILTER_WASM
from meshcache.ctl import launchers, procs
from meshcache.ctl.envoy_config import CacheProxy, write
from tests.helpers.control_plane import ControlPlaneProc
from tests.helpers.wait import eventually

pytestmark = pytest.mark.skipif(not FILTER_WASM.exists(), reason="filter not built (make filter)")

BODY = b'{"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}]}'
NODES = ("envoy-a", "envoy-b")


def fleet(cp: ControlPlaneProc) -> dict[str, dict]:
    """node id -> its entry in this replica's /v1/proxies (every replica's proxies)."""
    body = cp.client().get("/v1/proxies").json()
    assert body["complete"]
    return {p["node_id"]: p for p in body["proxies"] if p["node_id"] in NODES}


def all_acked(cp: ControlPlaneProc, version: int, replica: str | None = None) -> dict[str, dict]:
    got = fleet(cp)
    ok = set(got) == set(NODES) and all(p["acked_version"] == str(version) for p in got.values())
    return got if ok and (replica is None or {p["replica"] for p in got.values()} == {replica}) else {}


def test_replicas_share_the_fleet_and_losing_one_under_load_costs_nothing(
        tmp_path: Path, start_cp: Callable[..., ControlPlaneProc]) -> None:
    cp1, cp2 = start_cp("cp-1"), start_cp("cp-2")
    logs = tmp_path / "logs"
    origin_port, grpc_port = procs.free_port(), procs.free_port()
    started: list[procs.Proc] = []
    with procs.supervised(started):
        started.append(procs.start("origin", [sys.executable, "-m", "tests.filter.origin", "--http-port",
                                              str(origin_port), "--grpc-port", str(grpc_port)], logs))
        procs.wait_until(started[0], procs.tcp_open(origin_port))
        listen = {}
        # Opposite endpoint orders: with round robin starting anywhere, they may still share one.
        for node, xds in zip(NODES, ([cp1.xds_port, cp2.xds_port], [cp2.xds_port, cp1.xds_port]), strict=True):
            listen[node], admin = procs.free_port(), procs.free_port()
            proxy = CacheProxy(listen_port=listen[node], admin_port=admin, http_upstream_port=origin_port,
                               wasm_path=FILTER_WASM, plugin_config={"version": "default", "policies": []},
                               ecds_port=xds, node_id=node)
            started.append(launchers.start_envoy(write(proxy, tmp_path / f"{node}.yaml"), admin, logs, name=node))

        # A PUT on either replica reaches both Envoys; either replica lists both, with its holder.
        assert cp1.client().put("/v1/policies/m", json={"ttl_s": 60}).json()["version"] == 1
        eventually(lambda: all_acked(cp2, 1), timeout=15)
        assert cp2.client().put("/v1/policies/m", json={"ttl_s": 61}).json()["version"] == 2
        held = eventually(lambda: all_acked(cp1, 2), timeout=10)
        replicas = {cp1.client().get("/v1/proxies").json()["replica"]: cp1,
                    cp2.client().get("/v1/proxies").json()["replica"]: cp2}
        assert {p["replica"] for p in held.values()} <= set(replicas)

        # Load through both Envoys while the replica holding envoy-a is killed.
        statuses: Counter[int] = Counter()
        stop = threading.Event()

        def load() -> None:
            with httpx.Client(timeout=10) as c:
                while not stop.is_set():
                    for port in listen.values():
                        r = c.post(f"http://127.0.0.1:{port}/v2/models/m/infer", content=BODY,
                                   headers={"content-type": "application/json"})
                        statuses[r.status_code] += 1

        loader = threading.Thread(target=load)
        loader.start()
        try:
            eventually(lambda: statuses.total() >= 20)
            victim = replicas[held["envoy-a"]["replica"]]
            survivor = cp2 if victim is cp1 else cp1
            survivor_id = next(r for r, cp in replicas.items() if cp is survivor)
            victim.proc.kill()  # SIGKILL: no goodbye, its proxy list expires in Redis
            assert survivor.client().put("/v1/policies/m", json={"ttl_s": 62}).json()["version"] == 3
            # Both Envoys now hold their stream on the survivor and ACKed the change made after the
            # loss; the dead replica's entries are gone from the list.
            moved = eventually(lambda: all_acked(survivor, 3, survivor_id), timeout=15)
            assert len(survivor.client().get("/v1/proxies").json()["proxies"]) == 2
            served = statuses.total()
            eventually(lambda: statuses.total() >= served + 20)
        finally:
            stop.set()
            loader.join()
        assert set(statuses) == {200}, statuses  # not one request failed
        assert all(p["current"] for p in moved.values())
