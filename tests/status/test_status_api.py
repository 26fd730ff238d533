"""The endpoints behind the status page and `meshcache status`, on real processes."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from meshcache.ctl import launchers, procs
from meshcache.ctl.procs import local_http
from tests.helpers.control_plane import READ_TOKEN, WRITE_TOKEN, ControlPlaneProc, start_control_plane
from tests.helpers.filter_stats import filter_stats, filter_stats_where
from tests.helpers.kserve import grpc_call, mlp_request
from tests.helpers.wait import eventually
from tests.status.helpers import RunningMesh, meshcache

SERVER_NODE = "meshcache-server-sidecar"


@pytest.fixture
def lone_cp(tmp_path: Path) -> Iterator[tuple[ControlPlaneProc, str]]:
    """A control plane whose only configured proxy has no stats endpoint listening."""
    redis, port = launchers.start_redis(tmp_path / "redis")
    dead = f"http://127.0.0.1:{procs.free_port()}/stats/prometheus"
    cp = start_control_plane(tmp_path / "logs", port, extra_env={"MESHCACHE_CP_PROXY_STATS": f"ghost-proxy={dead}"})
    try:
        yield cp, dead
    finally:
        cp.proc.stop()
        redis.stop()


def _model(stats: dict, prefix: str) -> dict:
    return next(m for m in stats["models"] if m["model_prefix"] == prefix)


def test_stats_follow_the_traffic(running_mesh: RunningMesh) -> None:
    app = running_mesh.endpoints["app"]
    with running_mesh.client() as c:
        before = _model(c.get("/v1/stats").json(), "mlp-classifier")
        for seed in (7101, 7102):
            request = mlp_request(seed).SerializeToString()
            assert grpc_call(app, request)[1] == "meshcache; fwd=miss; stored"
            assert grpc_call(app, request)[1].startswith("meshcache; hit")

        def counted() -> dict:
            stats = c.get("/v1/stats").json()
            m = _model(stats, "mlp-classifier")
            return stats if (m["hits"], m["misses"]) == (before["hits"] + 2, before["misses"] + 2) else {}

        stats = eventually(counted, timeout=15)
    assert stats["complete"] and stats["proxies_read"] == 1
    m = _model(stats, "mlp-classifier")
    assert m["in_policy"] and 0 < m["hit_ratio"] < 1
    proxy = next(p for p in stats["proxies"] if p["node_id"] == SERVER_NODE)
    assert proxy["ok"] and proxy["source"].endswith("/stats/prometheus")
    assert proxy["entries"] >= 2 and proxy["bytes"] > 0 and proxy["errors"] == 0
    assert m["entries"] >= 2 and m["bytes"] > 0

    # One proxy: its entries and bytes are the models' plus the unattributed ones (read together,
    # retried: the filter sets its gauges one after another on each tick).
    def adds_up() -> dict:
        with running_mesh.client() as c:
            s = c.get("/v1/stats").json()
        p = next(p for p in s["proxies"] if p["node_id"] == SERVER_NODE)
        models = [x for x in s["models"] if x["entries"] is not None]
        ok = all(sum(x[w] for x in models) + s[f"unattributed_{w}"] == p[w] for w in ("entries", "bytes"))
        return s if ok else {}

    eventually(adds_up, timeout=10)


def test_meshcache_status_prints_the_per_model_table(running_mesh: RunningMesh) -> None:
    with running_mesh.client() as c:
        stats = c.get("/v1/stats").json()
    status = meshcache("status", "--state-dir", str(running_mesh.state_dir))
    assert status.returncode == 0, status.stdout + status.stderr
    out = status.stdout
    assert "model prefix" in out and "hit ratio" in out
    for m in stats["models"]:
        assert any(line.split()[:1] == [m["model_prefix"]] for line in out.splitlines()), out
    assert f"proxy {SERVER_NODE}:" in out and "stats unavailable" not in out
    row = re.search(r"^\s*mlp-classifier\s+[\d,]+\s+[\d,]+\s+(?:-|[\d.]+ %)\s+([\d,]+)\s+[\d.]+ \S*B\b", out, re.M)
    assert row and int(row.group(1).replace(",", "")) >= 2, out  # entries and bytes per model
    report = json.loads(meshcache("status", "--json", "--state-dir", str(running_mesh.state_dir)).stdout)
    assert {m["model_prefix"] for m in report["cache"]["models"]} >= {"mlp-classifier", "resnet-mini"}
    assert all(m["entries"] is not None for m in report["cache"]["models"])


def test_unreadable_proxy_stats_are_reported_not_zeroed(lone_cp: tuple[ControlPlaneProc, str]) -> None:
    cp, dead = lone_cp
    with cp.client(READ_TOKEN) as c:
        assert c.put("/v1/policies/m1", json={"ttl_s": 5}).status_code == 403  # read token
    with cp.client(WRITE_TOKEN) as c:
        assert c.put("/v1/policies/m1", json={"ttl_s": 5}).status_code == 200
        stats = c.get("/v1/stats").json()
    assert not stats["complete"] and stats["proxies_unread"] == 1 and stats["proxies_read"] == 0
    ghost = stats["proxies"][0]
    assert ghost["node_id"] == "ghost-proxy" and not ghost["ok"] and dead in ghost["error"]
    assert ghost["entries"] is None and ghost["hits"] is None
    assert _model(stats, "m1") == {"model_prefix": "m1", "in_policy": True, "hits": 0, "misses": 0,
                                   "hit_ratio": None, "entries": None, "bytes": None, "tokens_saved_prompt": None,
                                   "tokens_saved_completion": None, "ambiguous_with": []}
    assert stats["semantic"] is None  # no proxy read: unknown, not zeros


def test_history_lists_diffs_and_rollbacks(lone_cp: tuple[ControlPlaneProc, str]) -> None:
    cp, _ = lone_cp
    with cp.client(WRITE_TOKEN) as c:
        assert c.get("/v1/whoami").json() == {"name": "admin", "role": "write"}
        c.put("/v1/policies/m1", json={"ttl_s": 5})
        c.put("/v1/policies/m1", json={"ttl_s": 50})
        c.post("/v1/purge", json={"model_prefix": "m1"})
        assert c.post("/v1/rollback", json={"version": 1}).json()["version"] == 4
        hist = c.get("/v1/snapshots", params={"limit": 3}).json()
    assert hist["version"] == 4 and [s["version"] for s in hist["snapshots"]] == [4, 3, 2]
    rollback, purge, change = hist["snapshots"]
    assert rollback["action"] == "rollback to 1" and rollback["author"] == "admin"
    assert rollback["changes"] == [{"what": "changed", "model_prefix": "m1",
                                    "fields": {"ttl_s": [50, 5], "max_ttl_s": [50, 5]}}]  # generation kept
    assert purge["changes"] == [{"what": "purged", "model_prefix": "m1", "fields": {"generation": [1, 3]}}]
    assert change["changes"][0]["fields"]["ttl_s"] == [5, 50]
    with cp.client(READ_TOKEN) as c:
        assert c.get("/v1/whoami").json() == {"name": "viewer", "role": "read"}
        assert c.get("/v1/snapshots").status_code == 200
        assert c.post("/v1/rollback", json={"version": 1}).status_code == 403
        assert c.get("/v1/snapshots", params={"limit": 0}).status_code == 422
    with cp.client(None) as c:
        for path in ("/v1/stats", "/v1/snapshots", "/v1/whoami"):
            assert c.get(path).status_code == 401


def test_page_is_static_same_origin_and_locked_down(lone_cp: tuple[ControlPlaneProc, str]) -> None:
    cp, _ = lone_cp
    page = local_http().get(f"{cp.url}/status")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp and "unsafe-inline" not in csp
    assert "http" not in page.text.replace("http-equiv", "")  # no CDN or other origins
    assert local_http().get(f"{cp.url}/status/status.js").headers["content-type"].startswith("text/javascript")
    assert local_http().get(f"{cp.url}/status/status.css").status_code == 200
    for bad in ("/status/../settings.py", "/status/status.html", "/status/x.js"):
        assert local_http().get(f"{cp.url}{bad}").status_code == 404
    assert local_http().get(f"{cp.url}/", follow_redirects=False).headers["location"] == "/status"


def test_proxies_found_by_dns_are_read_through_the_template(running_mesh: RunningMesh, tmp_path: Path) -> None:
    """Istio's sidecars never connect here (istiod feeds them): they are found as the addresses of
    a headless Service's DNS name and read through the {ip} template (istio/base sets both).
    Here the name `localhost` stands for that Service and the local mesh's server sidecar for the pod."""
    admin_port = running_mesh.endpoints["server_sidecar_admin"].rsplit(":", 1)[1]
    # This test's own miss and hit (the mesh is shared: another test's traffic may not have come first).
    before = filter_stats(int(admin_port))
    request = mlp_request(7301).SerializeToString()
    assert grpc_call(running_mesh.endpoints["app"], request)[1] == "meshcache; fwd=miss; stored"
    assert grpc_call(running_mesh.endpoints["app"], request)[1].startswith("meshcache; hit")
    # At least: a hit of an earlier test on the shared mesh may be flushed after `before` was read.
    def counted(stats: dict[str, int]) -> None:
        assert stats.get("meshcache.hits", 0) > before.get("meshcache.hits", 0), stats

    filter_stats_where(int(admin_port), counted)
    redis, port = launchers.start_redis(tmp_path / "redis")
    cp = start_control_plane(tmp_path / "logs", port, extra_env={
        "MESHCACHE_CP_PROXY_STATS_TEMPLATE": f"http://{{ip}}:{admin_port}/stats/prometheus",
        "MESHCACHE_CP_PROXY_STATS_DNS": "localhost,no-such-proxy.invalid"})
    try:
        with cp.client(READ_TOKEN) as c:
            stats = c.get("/v1/stats").json()
    finally:
        cp.proc.stop()
        redis.stop()
    by_node = {p["node_id"]: p for p in stats["proxies"]}
    found = by_node["localhost/127.0.0.1"]
    assert found["ok"] and found["source"] == f"http://127.0.0.1:{admin_port}/stats/prometheus", found
    assert found["entries"] >= 1 and found["hits"] >= 1
    unresolved = by_node["no-such-proxy.invalid (DNS)"]
    assert not unresolved["ok"] and "DNS lookup of no-such-proxy.invalid failed" in unresolved["error"]
    assert not stats["complete"] and stats["proxies_read"] == 1 and stats["proxies_unread"] == 1
    # No policy in this control plane's snapshot: the sidecar's models are listed as not in policy,
    # with their entries (the sidecar's filter reports them per policy).
    assert any(not m["in_policy"] and m["entries"] is not None for m in stats["models"])
