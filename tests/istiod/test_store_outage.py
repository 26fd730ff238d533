"""Issue 33's first failure with the real istiod: Redis stalls (SIGSTOP) and the control plane is
SIGKILLed and started again (as the supervisor or kubelet would). Before, it came back at version
0, istiod's EnvoyFilters went to `[]` and the filter vanished from every sidecar. Now it serves
its saved snapshot (degraded), or, with no saved state, nothing at all; either way istiod keeps
the meshcache EnvoyFilters, the sidecars keep the filter and their entries, and hits continue."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from meshcache.control_plane.mcp import ENVOY_FILTER_TYPE_URL
from meshcache.control_plane.renderers import ECDS_TYPE_URL
from meshcache.ctl.istiod.mesh import IstiodMesh, ecds_version
from tests.helpers.kserve import mlp_json
from tests.helpers.signals import stopped
from tests.helpers.wait import eventually
from tests.istiod.helpers import SEEDS, istiod_mesh, put_and_sync, rest_infer, warmed_load


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[IstiodMesh]:
    with istiod_mesh(tmp_path_factory, "istiod-store-outage", canary_color="") as m:
        yield m


def meshcache_filters(mesh: IstiodMesh) -> dict[str, str]:
    """istiod's meshcache EnvoyFilters (its /debug/configz): name -> the snapshot version each carries."""
    assert mesh.istiod is not None
    return {c["metadata"]["name"]: c["metadata"].get("annotations", {}).get("meshcache.io/snapshot-version", "")
            for c in mesh.istiod.configz()
            if c["kind"] == "EnvoyFilter" and c["metadata"]["name"].startswith("meshcache")}


def config_clients(mesh: IstiodMesh) -> list[dict[str, Any]]:
    """The control plane's MCP streams (istiod's), which /v1/proxies lists apart from proxies."""
    with mesh.api() as api:
        return api.get("/v1/proxies").json()["config_clients"]  # type: ignore[no-any-return]


def istiod_node(mesh: IstiodMesh) -> str:
    """The node id of istiod's MCP stream (the one that acknowledged EnvoyFilters)."""
    return next(p["node_id"] for p in config_clients(mesh) if ENVOY_FILTER_TYPE_URL in p["type_urls"])


def istiod_stream(mesh: IstiodMesh, node: str, since: float) -> dict[str, Any] | None:
    """istiod's MCP stream to the control plane, opened after `since` (the control plane's view)."""
    return next((p for p in config_clients(mesh) if p["node_id"] == node and p["connected_since"] > since), None)


def responses_sent(mesh: IstiodMesh, type_url: str = "") -> float:
    """xDS/MCP responses this control-plane process has sent (of `type_url`, or any)."""
    with mesh.api() as api:
        text = api.get("/metrics").text
    prefix = "meshcache_cp_xds_pushes_total{" + (f'type_url="{type_url}"' if type_url else "")
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(prefix))


def all_hits(mesh: IstiodMesh) -> bool:
    return all(rest_infer(mesh, "mlp-classifier", mlp_json(s)).headers.get("cache-status", "").startswith(
        "meshcache; hit") for s in SEEDS)


def test_stalled_redis_and_killed_control_plane_leave_istiod_and_the_sidecars_as_they_were(mesh: IstiodMesh) -> None:
    assert mesh.istiod is not None
    with mesh.api() as api:
        version = api.get("/v1/snapshot").json()["version"]
    assert version > 0
    before = meshcache_filters(mesh)
    assert before and set(before.values()) == {str(version)}, before
    node = istiod_node(mesh)
    state_file = mesh.work / "control-plane" / "snapshot.json"
    eventually(state_file.exists)
    with warmed_load(mesh) as load, stopped(mesh.proc("redis")) as resume_redis:
        load.wait_hits(0)
        # 1. Killed and restarted while Redis is stalled: it serves the snapshot it saved.
        hits_before, sent_before, t_kill = load.hits, len(load.outcomes), time.monotonic()
        mesh.proc("control-plane").kill()
        restarted_at = time.time()
        mesh.restart("control-plane")
        t_started = time.monotonic()
        with mesh.api() as api:
            ready = api.get("/readyz")
            assert ready.status_code == 200 and ready.json()["status"] == "degraded", ready.text
            assert ready.json()["serving"]["source"] == "disk" and ready.json()["serving"]["version"] == version
        # istiod reconnects and acknowledges the same version: nothing changed for it.
        stream = eventually(lambda: (s := istiod_stream(mesh, node, restarted_at))
                            and ENVOY_FILTER_TYPE_URL in s["type_urls"] and s, timeout=60)
        eventually(lambda: responses_sent(mesh, ENVOY_FILTER_TYPE_URL) >= 1)  # the saved version, sent
        t_resent = time.monotonic()
        assert stream["last_nack"] is None
        assert meshcache_filters(mesh) == before
        assert all(ecds_version(sc) == version for sc in mesh.server_sidecars())
        load.wait_hits(load.hits)
        assert all_hits(mesh)  # the entries cached before the outage are still served

        # 2. Killed again, and its saved state gone too: it serves nothing, istiod keeps its config.
        mesh.proc("control-plane").kill()
        state_file.unlink()
        restarted_at = time.time()
        mesh.restart("control-plane")
        with mesh.api() as api:
            assert api.get("/readyz").status_code == 503
        eventually(lambda: istiod_stream(mesh, node, restarted_at), timeout=60)  # istiod is connected ...
        load.wait_hits(load.hits)
        # ... and got no answer for any kind that carries policies (the empty kinds meshcache
        # never serves are answered: they replace nothing, and the liveness probe reads them).
        assert responses_sent(mesh, ENVOY_FILTER_TYPE_URL) == 0
        assert responses_sent(mesh, ECDS_TYPE_URL) == 0
        assert meshcache_filters(mesh) == before
        assert all(ecds_version(sc) == version for sc in mesh.server_sidecars())
        assert all_hits(mesh)

        # 3. Redis is back: the store's snapshot is served, writes work and reach the sidecars.
        resume_redis()
        with mesh.api() as api:
            eventually(lambda: api.get("/readyz").json().get("status") == "ready", timeout=15)
        put_and_sync(mesh, 123)
        load.wait_hits(load.hits)
        t_back = time.monotonic()
    assert not load.failed(), load.failed()[:5]
    assert set(meshcache_filters(mesh).values()) == {str(version + 1)}
    assert all_hits(mesh)
    print(f"\ncontrol plane restarted (Redis stalled) in {t_started - t_kill:.2f} s, istiod had the saved "
          f"version {version} again {t_resent - t_kill:.2f} s after the kill; {load.hits - hits_before} hits of "
          f"{len(load.outcomes) - sent_before} answers, none wrong, over the {t_back - t_kill:.1f} s outage and "
          "recovery")

