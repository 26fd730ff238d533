"""Never less than the last good snapshot (issue 33): what a control plane serves when it starts
with its store (a real redis-server) reachable, stopped (SIGSTOP: connects, never answers),
refusing, or behind its state file; read by real xDS/MCP clients on real gRPC."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from meshcache.control_plane.mcp import ENVOY_FILTER_TYPE_URL
from meshcache.control_plane.snapshots import Snapshot
from meshcache.control_plane.state_file import StateFile
from meshcache.control_plane.xds_client import XdsClient, plugin_config_of
from meshcache.ctl import launchers, procs
from tests.helpers.control_plane import ControlPlaneProc, run
from tests.helpers.signals import stopped
from tests.helpers.wait import eventually
from tests.istio.istiod_client import ISTIOD_1_30_TYPES, IstiodLikeClient

DIGEST = "c0ffee" + "0" * 58
MCP_ENV = {"MESHCACHE_CP_ISTIO_WASM_URL": f"oci://registry.example.com/meshcache/filter@sha256:{DIGEST}",
           "MESHCACHE_CP_ISTIO_WASM_SHA256": DIGEST, "MESHCACHE_CP_ISTIO_NAMESPACE": "ml"}
NO_ANSWER_S = 2.0  # how long a client is shown to get nothing (istiod and Envoy wait far longer)


def _env(state_dir: Path | None, mcp: bool = True) -> dict[str, str]:
    return {**(MCP_ENV if mcp else {}), **({"MESHCACHE_CP_STATE_DIR": str(state_dir)} if state_dir else {})}


def _seed(cp: ControlPlaneProc, n: int) -> int:
    """n policy writes as a client makes them: a 503 (a Redis call timed out on a loaded machine)
    says nothing was applied and to retry; any other refusal fails at once."""
    version = 0
    for i in range(n):
        r = eventually(lambda i=i: _not_503(cp.client().put(f"/v1/policies/m{i}", json={"ttl_s": 10 + i})),
                       timeout=15, interval=0.5)
        assert r.status_code == 200, r.text
        version = r.json()["version"]
    return version


def _not_503(r: httpx.Response) -> httpx.Response | None:
    return None if r.status_code == 503 else r


def _saved_version(state_dir: Path) -> int:
    snap = StateFile(state_dir, "meshcache:cp").load()
    return snap.version if snap is not None else 0


async def _ecds(port: int, node: str) -> XdsClient:
    ch = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    client = XdsClient(ch, node)
    await client.subscribe()
    return client


def _metric(cp: ControlPlaneProc, line_prefix: str) -> float:
    for line in cp.client().get("/metrics").text.splitlines():
        if line.startswith(line_prefix + " "):
            return float(line.split()[-1])
    raise AssertionError(f"no metric {line_prefix}")


# ---- the state file itself -----------------------------------------------------------------


def test_state_file_is_atomic_never_goes_back_and_ignores_foreign_or_corrupt_files(tmp_path: Path) -> None:
    f = StateFile(tmp_path / "state", "meshcache:cp")
    assert f.load() is None  # no directory yet
    assert f.save(Snapshot(version=3, action="three")) is True
    assert f.save(Snapshot(version=2, action="two")) is False  # never replaced by an older one
    loaded = f.load()
    assert loaded is not None and (loaded.version, loaded.action) == (3, "three")
    assert [p.name for p in (tmp_path / "state").iterdir() if p.name.endswith(".tmp")] == []
    assert (tmp_path / "state" / "snapshot.json").stat().st_mode & 0o077 == 0
    assert StateFile(tmp_path / "state", "other:prefix").load() is None  # another deployment's
    (tmp_path / "state" / "snapshot.json").write_text('{"format": 1, "key_prefix": "meshcache:cp", "snap')
    assert f.load() is None  # corrupt: ignored (logged), never half a snapshot
    assert f.save(Snapshot(version=1)) is True and f.load().version == 1  # type: ignore[union-attr]


# ---- start: store reachable --------------------------------------------------------------


def test_reachable_empty_store_is_served_as_empty_and_mcp_answers(start_cp: Callable[..., ControlPlaneProc],
                                                                  tmp_path: Path) -> None:
    """Empty is served when it is the store's real state (Redis reachable, no state file)."""
    cp = start_cp(extra_env=_env(tmp_path / "state"))
    ready = cp.client().get("/readyz")
    assert ready.status_code == 200 and ready.json()["status"] == "ready"
    assert ready.json()["serving"] == {"source": "redis", "version": 0, "degraded": False, "store_reachable": True,
                                       "detail": "serving snapshot 0 from the policy store (Redis)"}
    assert cp.client().get("/v1/snapshot").json()["version"] == 0

    async def scenario() -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{cp.xds_port}") as ch:
            istiod = IstiodLikeClient(ch)
            await istiod.start()
            await istiod.sync()  # every type answered, empty: istiod can start
            assert istiod.answered == set(ISTIOD_1_30_TYPES) and not istiod.effective()
            await istiod.close()

    run(scenario())
    assert _saved_version(tmp_path / "state") == 0  # version 0 is never saved


def test_redis_ahead_of_the_state_file_wins_and_the_file_follows(
        start_cp: Callable[..., ControlPlaneProc], tmp_path: Path) -> None:
    state = tmp_path / "state"
    cp1 = start_cp("cp-1", extra_env=_env(state))
    assert _seed(cp1, 2) == 2
    eventually(lambda: _saved_version(state) == 2)
    cp1.proc.kill()
    cp2 = start_cp("cp-2", extra_env=_env(None))  # no state dir: the file stays at 2
    assert _seed(cp2, 4) == 4
    cp1.restart()
    snap = cp1.client().get("/v1/snapshot").json()
    assert snap["version"] == 4 and len(snap["policies"]) == 4
    eventually(lambda: _saved_version(state) == 4)


def test_redis_behind_the_state_file_gets_it_back(tmp_path: Path, redis_server: tuple[procs.Proc, int],
                                                  start_cp: Callable[..., ControlPlaneProc]) -> None:
    """Redis came back empty (no AOF, a new volume): the file's snapshot is restored into it and
    served, not version 0; versions continue from there."""
    state = tmp_path / "state"
    cp = start_cp(extra_env=_env(state))
    assert _seed(cp, 3) == 3
    eventually(lambda: _saved_version(state) == 3)
    cp.proc.kill()
    redis_proc, port = redis_server
    redis_proc.kill()
    fresh, _ = launchers.start_redis(tmp_path / "redis-empty", port=port, name="redis-empty")
    try:
        cp.restart()
        assert cp.client().get("/v1/snapshot").json()["version"] == 3
        assert cp.client().get("/readyz").json()["serving"]["source"] == "redis"
        r = cp.client().put("/v1/policies/after", json={"ttl_s": 5})
        assert r.status_code == 200 and r.json()["version"] == 4
        assert [p["model_prefix"] for p in cp.client().get("/v1/policies").json()["policies"]] == [
            "after", "m0", "m1", "m2"]
    finally:
        fresh.stop()


# ---- start: store unreachable --------------------------------------------------------------


@pytest.mark.parametrize("outage", ["stopped", "refusing"])
def test_unreachable_store_with_a_state_file_serves_it_degraded(
        outage: str, tmp_path: Path, redis_server: tuple[procs.Proc, int],
        start_cp: Callable[..., ControlPlaneProc]) -> None:
    state = tmp_path / "state"
    cp = start_cp(extra_env=_env(state))
    assert _seed(cp, 2) == 2
    eventually(lambda: _saved_version(state) == 2)
    cp.proc.kill()  # SIGKILL: no clean shutdown
    redis_proc, port = redis_server
    with contextlib.ExitStack() as stack:
        if outage == "stopped":
            resume = stack.enter_context(stopped(redis_proc))
        else:
            redis_proc.kill()
        cp.restart()
        c = cp.client()
        ready = c.get("/readyz")
        assert ready.status_code == 200, ready.text
        assert ready.json()["status"] == "degraded" and ready.json()["serving"]["source"] == "disk"
        assert ready.json()["serving"]["version"] == 2
        assert c.get("/v1/snapshot").json()["version"] == 2
        r = c.put("/v1/policies/new", json={"ttl_s": 1})
        assert r.status_code == 503
        assert r.json()["detail"] == ("policy store (Redis) unavailable: the change was not applied; retry later "
                                      "(serving snapshot 2 from the state file meanwhile)")
        stats = c.get("/v1/stats").json()
        assert stats["serving"]["degraded"] is True and stats["serving"]["source"] == "disk"
        assert _metric(cp, "meshcache_cp_degraded") == 1
        assert _metric(cp, 'meshcache_cp_snapshot_source{source="disk"}') == 1

        async def served() -> None:
            ecds = await _ecds(cp.xds_port, "envoy-1")
            assert plugin_config_of(await ecds.recv(timeout=5))["version"] == "2"
            await ecds.close()
            async with grpc.aio.insecure_channel(f"127.0.0.1:{cp.xds_port}") as ch:
                istiod = IstiodLikeClient(ch)
                await istiod.start()
                await istiod.sync()
                assert sorted(istiod.effective()) == ["EnvoyFilter/ml/meshcache", "EnvoyFilter/ml/meshcache-client"]
                await istiod.close()

        run(served())
        # The store is back: the same replica is in step again, writes go through.
        if outage == "stopped":
            resume()
        else:
            stack.enter_context(_restarted_redis(tmp_path / "redis", port))
        eventually(lambda: c.get("/readyz").json()["status"] == "ready", timeout=10)
        assert c.get("/readyz").json()["serving"]["source"] == "redis"
        assert _metric(cp, "meshcache_cp_degraded") == 0
        assert c.put("/v1/policies/new", json={"ttl_s": 1}).json()["version"] == 3


@contextlib.contextmanager
def _restarted_redis(data_dir: Path, port: int) -> Iterator[procs.Proc]:
    proc, _ = launchers.start_redis(data_dir, port=port, name="redis-restarted")
    try:
        yield proc
    finally:
        proc.stop()


@pytest.mark.parametrize("outage", ["stopped", "refusing"])
def test_unreachable_store_and_no_state_serves_nothing_until_the_store_is_back(
        outage: str, tmp_path: Path, redis_server: tuple[procs.Proc, int],
        start_cp: Callable[..., ControlPlaneProc]) -> None:
    """No snapshot known: no answer for any type that carries policies (not version 0, not
    "empty": istiod and Envoys keep what they have), readiness false but alive, reads 503; the
    store's snapshot once it is back."""
    seeder = start_cp("seeder", extra_env=_env(None))
    assert _seed(seeder, 2) == 2
    seeder.proc.stop()
    redis_proc, port = redis_server
    with contextlib.ExitStack() as stack:
        if outage == "stopped":
            resume = stack.enter_context(stopped(redis_proc))
        else:
            redis_proc.stop()
        cp = start_cp(extra_env=_env(tmp_path / "empty-state"))
        c = cp.client()
        ready = c.get("/readyz")
        assert ready.status_code == 503 and ready.json()["detail"].startswith("no snapshot: the policy store")
        r = c.get("/v1/snapshot")
        assert r.status_code == 503 and r.json()["detail"].startswith("no snapshot"), r.text
        assert c.get("/v1/policies").status_code == 503
        assert c.get("/v1/stats").json()["serving"] == {
            "source": "none", "version": None, "degraded": True, "store_reachable": False,
            "detail": c.get("/readyz").json()["detail"]}
        assert _metric(cp, 'meshcache_cp_snapshot_source{source="none"}') == 1
        assert c.put("/v1/policies/x", json={"ttl_s": 1}).status_code == 503

        async def scenario() -> None:
            ecds = await _ecds(cp.xds_port, "envoy-1")
            async with grpc.aio.insecure_channel(f"127.0.0.1:{cp.xds_port}") as ch:
                istiod = IstiodLikeClient(ch)
                await istiod.start()
                # Only the kinds meshcache never serves are answered (empty, as always): they
                # replace nothing, and the liveness probe reads them. EnvoyFilter, the kind
                # that carries policies, stays unanswered, so istiod keeps what it has.
                policy_free = set(ISTIOD_1_30_TYPES) - {ENVOY_FILTER_TYPE_URL}
                while istiod.answered != policy_free:
                    await istiod.handle(await istiod.recv(timeout=10))
                with pytest.raises(asyncio.TimeoutError):
                    await istiod.recv(timeout=NO_ANSWER_S)
                assert ENVOY_FILTER_TYPE_URL not in istiod.answered
                # Alive (no restart loop), but not ready: a restarting istiod must not pick it.
                assert c.get("/healthz/xds").status_code == 200
                assert c.get("/readyz/xds").status_code == 503
                with pytest.raises(asyncio.TimeoutError):
                    await ecds.recv(timeout=0.1)
                assert c.get("/v1/proxies").json()["proxies"]  # the streams are open, just unanswered
                # The store is back: both get the store's snapshot on the streams they hold.
                if outage == "stopped":
                    resume()
                else:
                    stack.enter_context(_restarted_redis(tmp_path / "redis", port))
                assert plugin_config_of(await ecds.recv(timeout=10))["version"] == "2"
                await istiod.sync(timeout=10)
                assert istiod.answered == set(ISTIOD_1_30_TYPES)
                objs = istiod.effective()
                assert sorted(objs) == ["EnvoyFilter/ml/meshcache", "EnvoyFilter/ml/meshcache-client"]
                spec = objs["EnvoyFilter/ml/meshcache"]["spec"]["configPatches"][0]["patch"]["value"]
                config = json.loads(spec["typed_config"]["config"]["configuration"]["value"])
                assert config["version"] == "2"
                await istiod.close()
            await ecds.close()

        run(scenario())
        assert c.get("/readyz").json()["status"] == "ready"
        eventually(lambda: _saved_version(tmp_path / "empty-state") == 2)


def test_unary_fetch_is_unavailable_while_no_snapshot_is_known(
        redis_server: tuple[procs.Proc, int], start_cp: Callable[..., ControlPlaneProc], tmp_path: Path) -> None:
    from envoy.service.discovery.v3 import discovery_pb2
    from envoy.service.extension.v3 import config_discovery_pb2_grpc

    redis_proc, _ = redis_server
    with stopped(redis_proc):
        cp = start_cp(extra_env=_env(None, mcp=False))

        async def fetch() -> None:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{cp.xds_port}") as ch:
                stub = config_discovery_pb2_grpc.ExtensionConfigDiscoveryServiceStub(ch)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.FetchExtensionConfigs(discovery_pb2.DiscoveryRequest(), timeout=5)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE

        run(fetch())
