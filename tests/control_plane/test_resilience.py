"""Redis outages and several replicas, with real processes and a Python xDS client."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from meshcache.control_plane.xds_client import XdsClient, plugin_config_of
from meshcache.ctl import launchers, procs
from tests.helpers.control_plane import ControlPlaneProc, run
from tests.helpers.wait import eventually


def test_redis_outage_503_on_writes_reads_from_memory_and_recovery(
        tmp_path: Path, redis_server: tuple[procs.Proc, int], cp: ControlPlaneProc) -> None:
    c = cp.client()
    assert c.put("/v1/policies/a", json={"ttl_s": 1}).status_code == 200
    assert c.put("/v1/policies/b", json={"ttl_s": 2}).status_code == 200
    redis_proc, port = redis_server
    redis_proc.kill()  # SIGKILL: no clean shutdown

    t0 = time.monotonic()
    r = c.put("/v1/policies/c", json={"ttl_s": 3})
    assert r.status_code == 503 and "Redis" in r.json()["detail"] and "not applied" in r.json()["detail"]
    assert r.headers["Retry-After"] == "1"
    assert time.monotonic() - t0 < 3  # fails fast, no hanging retries
    assert c.post("/v1/purge", json={"model_prefix": "a"}).status_code == 503
    assert c.delete("/v1/policies/a").status_code == 503
    assert c.put("/v1/policies/a", json={"ttl_s": 1}).status_code == 503  # even a no-op write
    # Reads of the current snapshot keep working from memory.
    assert [p["model_prefix"] for p in c.get("/v1/policies").json()["policies"]] == ["a", "b"]
    assert c.get("/v1/snapshot").json()["version"] == 2
    # Still ready (it serves the last good snapshot), and says it is degraded.
    ready = eventually(lambda: (r := c.get("/readyz")).json()["status"] == "degraded" and r)
    assert ready.status_code == 200 and ready.json()["serving"]["source"] == "memory"
    assert c.get("/v1/snapshots/1").status_code == 503

    async def xds_during_outage() -> dict:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{cp.xds_port}") as ch:
            client = XdsClient(ch, "during-outage")
            await client.subscribe()
            resp = await client.recv()
            await client.close()
            return plugin_config_of(resp)

    assert run(xds_during_outage())["version"] == "2"  # Envoys still get the last snapshot

    redis2, _ = launchers.start_redis(tmp_path / "redis", port=port, name="redis-restarted")
    try:
        r = eventually(lambda: (resp := c.put("/v1/policies/c", json={"ttl_s": 3})).status_code == 200 and resp,
                       timeout=10)
        assert r.json()["version"] == 3  # nothing lost: versions continue from the AOF
        assert [p["model_prefix"] for p in c.get("/v1/policies").json()["policies"]] == ["a", "b", "c"]
        assert c.get("/v1/snapshots/1").json()["policies"][0]["model_prefix"] == "a"
        eventually(lambda: c.get("/readyz").json()["status"] == "ready")  # the sync loop's next retry
        assert "meshcache_cp_writes_total{outcome=\"unavailable\"} 4.0" in c.get("/metrics").text
    finally:
        redis2.stop()


def test_two_replicas_agree_and_propagate_within_a_second(start_cp: Callable[..., ControlPlaneProc]) -> None:
    cp1, cp2 = start_cp("cp-1"), start_cp("cp-2")

    async def scenario() -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{cp2.xds_port}") as ch:
            client = XdsClient(ch, "on-replica-2")
            await client.subscribe()
            t0 = time.monotonic()
            r = await asyncio.to_thread(cp1.client().put, "/v1/policies/m", json={"ttl_s": 9})
            assert r.json()["version"] == 1
            resp = await client.recv(timeout=2)
            assert time.monotonic() - t0 < 1.0
            assert plugin_config_of(resp)["policies"][0]["ttl_s"] == 9
            await client.ack(resp)
            # Concurrent writes through both replicas: all succeed, versions are 2..21 with no gaps.
            def put(i: int) -> int:
                cp = cp1 if i % 2 else cp2
                r = cp.client().put(f"/v1/policies/p{i}", json={"ttl_s": i})
                assert r.status_code == 200, r.text
                return int(r.json()["version"])

            with ThreadPoolExecutor(8) as pool:
                versions = await asyncio.to_thread(lambda: list(pool.map(put, range(20))))
            assert sorted(versions) == list(range(2, 22))
            seen = []
            while not seen or seen[-1] != 21:
                resp = await client.recv(timeout=3)
                seen.append(int(resp.version_info))
                await client.ack(resp)
            assert seen == sorted(set(seen))  # never backwards
            await client.close()

    run(scenario())
    for cp in (cp1, cp2):
        snap = eventually(lambda cp=cp: (s := cp.client().get("/v1/snapshot").json())["version"] == 21 and s)
        assert len(snap["policies"]) == 21


def test_restarted_replica_resyncs_and_serves_the_current_snapshot(
        start_cp: Callable[..., ControlPlaneProc]) -> None:
    cp1, cp2 = start_cp("cp-1"), start_cp("cp-2")
    cp2.proc.kill()
    assert cp1.client().put("/v1/policies/m", json={"ttl_s": 4}).json()["version"] == 1
    assert cp1.client().put("/v1/policies/n", json={"ttl_s": 5}).json()["version"] == 2
    cp2.restart()
    assert cp2.client().get("/v1/snapshot").json()["version"] == 2

    async def scenario() -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{cp2.xds_port}") as ch:
            client = XdsClient(ch, "after-restart")
            await client.subscribe(version_info="1")
            resp = await client.recv()
            assert resp.version_info == "2"
            await client.close()

    run(scenario())


def test_starts_without_redis_and_recovers_when_it_appears(
        tmp_path: Path, redis_server: tuple[procs.Proc, int], start_cp: Callable[..., ControlPlaneProc]) -> None:
    redis_proc, port = redis_server
    redis_proc.stop()
    cp = start_cp()
    c = cp.client()
    assert c.get("/healthz").status_code == 200 and c.get("/readyz").status_code == 503
    assert c.get("/v1/snapshot").status_code == 503  # no snapshot known: not a made-up version 0
    assert c.put("/v1/policies/m", json={"ttl_s": 1}).status_code == 503
    redis2, _ = launchers.start_redis(tmp_path / "redis", port=port, name="redis-late")
    try:
        eventually(lambda: c.get("/readyz").status_code == 200, timeout=10)
        assert c.put("/v1/policies/m", json={"ttl_s": 1}).json()["version"] == 1
    finally:
        redis2.stop()
