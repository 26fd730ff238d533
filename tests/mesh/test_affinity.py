"""`meshcache up --replicas 3`: three engine + server-sidecar pairs behind the client sidecar's
consistent-hash cluster, the client-role filter's config from the control plane over ECDS."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import grpc
import httpx
import pytest

from meshcache.ctl import launchers
from meshcache.ctl.mesh.cache_table import format_cache_table
from meshcache.ctl.mesh.config import MeshConfig
from meshcache.ctl.mesh.topology import CLIENT_NODE, Mesh, server_node
from tests.helpers.filter_stats import filter_counter
from tests.helpers.kserve import (
    MLP,
    MODEL_INFER,
    engine_calls,
    grpc_call,
    infer_path,
    mlp_json,
    mlp_request,
    rest_infer,
)
from tests.helpers.wait import eventually
from tests.mesh.helpers import canary_engine_calls

REPLICAS = 3


@pytest.fixture(scope="module")
def replicated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    config = MeshConfig(state_dir=tmp_path_factory.mktemp("mesh-replicas"), replicas=REPLICAS).with_free_ports()
    with Mesh(config, log=lambda _: None) as m:
        yield m


def replica_stats(mesh: Mesh, *what: str) -> list[list[int]]:
    """`meshcache.<what>` of each replica, once earlier traffic (another test's, whose counters
    nobody waited for) has reached them: the filter flushes its counters every 200 ms."""
    time.sleep(0.45)
    return [_per_replica(mesh, w) for w in what]


def _per_replica(mesh: Mesh, what: str) -> list[int]:
    return [filter_counter(mesh.config.ports.replica(k).server_admin, f"meshcache.{what}")
            for k in range(1, REPLICAS + 1)]


def replica_deltas(mesh: Mesh, what: str, before: list[int], total: int) -> list[int]:
    """Each replica's `meshcache.<what>` since `before`, once they add up to `total`."""
    def added_up() -> list[int]:
        deltas = [a - b for a, b in zip(_per_replica(mesh, what), before, strict=True)]
        assert sum(deltas) == total, f"{what} {deltas}: not {total} in all"
        return deltas
    return eventually(added_up)


def replica_engine_calls(mesh: Mesh) -> list[float]:
    return [engine_calls(MLP, f"http://127.0.0.1:{mesh.config.ports.replica(k).engine_metrics}/metrics")
            for k in range(1, REPLICAS + 1)]


def test_every_replica_and_the_client_sidecar_get_the_policies(replicated: Mesh) -> None:
    with replicated.api() as api:
        version = api.version()
        for node in [*(server_node(k) for k in range(1, REPLICAS + 1)), CLIENT_NODE]:
            api.wait_acked(node, version, timeout=10)
    assert "replicas" in replicated.endpoints() and len(replicated.endpoints()["replicas"]) == REPLICAS


def test_identical_requests_hit_on_the_replica_that_stored_them(replicated: Mesh) -> None:
    app = replicated.endpoints()["app"]
    (stores_before, hits_before) = replica_stats(replicated, "stores", "hits")
    calls_before = replica_engine_calls(replicated)
    body = mlp_json(seed=1301)
    assert rest_infer(replicated.endpoints()["app"], MLP, body).headers["cache-status"] == "meshcache; fwd=miss; stored"
    for _ in range(4):
        assert rest_infer(app, MLP, body).headers["cache-status"].startswith("meshcache; hit")
    request = mlp_request(seed=1302).SerializeToString()
    assert grpc_call(app, request)[1] == "meshcache; fwd=miss; stored"
    for _ in range(3):
        assert grpc_call(app, request)[1].startswith("meshcache; hit")
    stores = replica_deltas(replicated, "stores", stores_before, 2)
    hits = replica_deltas(replicated, "hits", hits_before, 7)
    calls = [a - b for a, b in zip(replica_engine_calls(replicated), calls_before, strict=True)]
    assert sum(calls) == 2
    # Each answer's hits are on the replica whose engine computed it.
    for k in range(REPLICAS):
        assert hits[k] in (0, 4, 3, 7) and (hits[k] > 0) == (stores[k] > 0) == (calls[k] > 0)


def test_keys_spread_over_the_replicas(replicated: Mesh) -> None:
    app = replicated.endpoints()["app"]
    [before] = replica_stats(replicated, "stores")
    for seed in range(1400, 1430):
        assert rest_infer(app, MLP, mlp_json(seed)).headers["cache-status"] == "meshcache; fwd=miss; stored"
    stores = replica_deltas(replicated, "stores", before, 30)
    assert all(s > 0 for s in stores), stores
    for seed in range(1400, 1430):
        assert rest_infer(app, MLP, mlp_json(seed)).headers["cache-status"].startswith("meshcache; hit")


def test_the_canary_colour_keeps_its_engine_with_affinity(replicated: Mesh) -> None:
    app = replicated.endpoints()["app"]
    body = mlp_json(seed=1501)
    canary_before = canary_engine_calls(replicated, MLP)
    blue = {"x-traffic-color": replicated.config.canary_color}
    first = rest_infer(app, MLP, body, blue)
    assert first.headers["cache-status"] == "meshcache; fwd=miss; stored"
    assert json.loads(first.content)["model_version"] == "1"  # the canary's default version
    for _ in range(3):
        again = rest_infer(app, MLP, body, blue)
        assert again.headers["cache-status"].startswith("meshcache; hit")
        assert json.loads(again.content)["model_version"] == "1"
    default = rest_infer(app, MLP, body)
    assert default.headers["cache-status"] == "meshcache; fwd=miss; stored"  # colours never share entries
    assert json.loads(default.content)["model_version"] == "2"
    assert canary_engine_calls(replicated, MLP) == canary_before + 1


def test_status_shows_each_replica(replicated: Mesh) -> None:
    rest_infer(replicated.endpoints()["app"], MLP, mlp_json(seed=1601))

    def stats_with_the_entry() -> dict | None:
        # The entries gauge shows on the sidecars' next stats flush (this may be the module's
        # first test on this worker, with nothing stored before).
        with replicated.api() as api:
            stats = api.stats()
        nodes = {p["node_id"]: p for p in stats["proxies"]}
        servers = [nodes.get(server_node(k), {}) for k in range(1, REPLICAS + 1)]
        ok = all(n.get("ok") for n in servers) and sum(n.get("entries", 0) for n in servers) > 0
        return stats if ok else None

    stats = eventually(stats_with_the_entry, timeout=15)
    nodes = {p["node_id"]: p for p in stats["proxies"]}
    for k in range(1, REPLICAS + 1):
        assert nodes[server_node(k)]["ok"], nodes
    assert sum(nodes[server_node(k)]["entries"] for k in range(1, REPLICAS + 1)) > 0
    table = format_cache_table(stats)
    for k in range(1, REPLICAS + 1):
        assert f"proxy {server_node(k)}: " in table
    assert "hit ratio" in table


def test_a_restarted_replica_rejoins_and_only_its_entries_are_lost(replicated: Mesh) -> None:
    app = replicated.endpoints()["app"]
    seeds = range(1700, 1724)
    for seed in seeds:
        rest_infer(app, MLP, mlp_json(seed))
    replicated.restart("server-sidecar-2")  # the supervisor's restart path, per replica
    replicated.restart("engine-2")
    with replicated.api() as api:
        api.wait_acked(server_node(2), api.version(), timeout=15)
    statuses = [rest_infer(app, MLP, mlp_json(seed)).headers["cache-status"] for seed in seeds]
    hits = sum(s.startswith("meshcache; hit") for s in statuses)
    # Replica 2's cache was emptied; the keys of replicas 1 and 3 still hit where they were.
    assert 0 < hits < len(seeds) and all(s.startswith("meshcache;") for s in statuses), statuses
    assert all(rest_infer(app, MLP, mlp_json(seed)).headers["cache-status"].startswith("meshcache; hit")
               for seed in seeds)


def test_losing_a_replica_under_load_costs_no_request(replicated: Mesh) -> None:
    """SIGKILL one replica's server sidecar while two callers (REST and gRPC) keep asking for keys
    spread over all replicas: the client sidecar retries what could not reach it on the next
    replica of the ring and ejects it, so every request is answered, and answered right."""
    app = replicated.endpoints()["app"]
    seeds = range(1800, 1824)
    rest_answers = {s: rest_infer(app, MLP, mlp_json(s)).json()["outputs"] for s in seeds}
    grpc_answers = {s: grpc_call(app, mlp_request(s).SerializeToString())[0] for s in seeds}
    failures: list[str] = []
    passes = [0, 0]
    stop = threading.Event()

    def rest_caller() -> None:
        with httpx.Client(timeout=10) as client:
            while not stop.is_set():
                for s in seeds:
                    try:
                        r = client.post(f"http://{app}{infer_path(MLP)}", json=mlp_json(s))
                        if r.status_code != 200 or r.json()["outputs"] != rest_answers[s]:
                            failures.append(f"REST {s}: {r.status_code} {r.headers.get('cache-status')} {r.text[:200]}")
                    except httpx.HTTPError as exc:
                        failures.append(f"REST {s}: {exc!r}")
                passes[0] += 1

    def grpc_caller() -> None:
        with grpc.insecure_channel(app) as channel:
            call = channel.unary_unary(MODEL_INFER)
            while not stop.is_set():
                for s in seeds:
                    try:
                        if call(mlp_request(s).SerializeToString(), timeout=10) != grpc_answers[s]:
                            failures.append(f"gRPC {s}: a different answer")
                    except grpc.RpcError as exc:
                        failures.append(f"gRPC {s}: {exc.code()} {exc.details()}")
                passes[1] += 1

    def wait_passes(n: int) -> None:
        target = (passes[0] + n, passes[1] + n)
        eventually(lambda: passes[0] >= target[0] and passes[1] >= target[1], timeout=60)

    callers = [threading.Thread(target=rest_caller), threading.Thread(target=grpc_caller)]
    for t in callers:
        t.start()
    try:
        wait_passes(2)
        replicated.proc("server-sidecar-3").kill()
        wait_passes(4)  # every key of the lost replica asked for again, several times
    finally:
        stop.set()
        for t in callers:
            t.join(timeout=30)
        replicated.restart("server-sidecar-3")
        with replicated.api() as api:
            api.wait_acked(server_node(3), api.version(), timeout=15)
    assert not failures, failures[:10]
    # The loss was seen and handled by the client sidecar, not avoided by luck.
    stats = launchers.envoy_stats(replicated.config.ports.client_admin, "cluster.mesh_upstream.")
    assert stats.get("cluster.mesh_upstream.outlier_detection.ejections_enforced_total", 0) >= 1, stats
    assert stats.get("cluster.mesh_upstream.upstream_rq_retry", 0) >= 1, stats
