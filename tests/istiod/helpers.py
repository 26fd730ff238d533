"""Requests through the istiod mesh's client sidecar, and what istiod and the sidecars report."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from meshcache.contract.filter_config import Policy
from meshcache.contract.headers import COLOR_HEADER
from meshcache.contract.wasm_filter import CLIENT_FILTER_NAME
from meshcache.control_plane.settings import Settings
from meshcache.control_plane.snapshots import Snapshot
from meshcache.control_plane.store import Store
from meshcache.ctl.istiod import binary
from meshcache.ctl.istiod.mesh import IstiodMesh, IstiodMeshConfig, ecds_filters
from meshcache.ctl.istiod.sidecar import Sidecar
from meshcache.ctl.istiod.status import ECDS_TYPE_URL
from tests.helpers import kserve
from tests.helpers.kserve import engine_calls, grpc_call, mlp_json, mlp_request
from tests.helpers.load import Load, call, rest_kinds
from tests.helpers.wait import eventually

ROUTER = "envoy.filters.http.router"
# Istio's inbound HTTP filter order (listener_builder.go), the ones a stock Envoy runs; the
# istio-proxy-only ones are turned off (docs/istio.md, "Running against a real istiod").
ISTIO_INBOUND_ORDER = ["istio.metadata_exchange", "envoy.filters.http.ext_authz", "istio_authn",
                       "envoy.filters.http.rbac", "envoy.filters.http.grpc_stats", "envoy.filters.http.fault",
                       "envoy.filters.http.cors", "istio.stats"]


def require_istiod() -> None:
    """One clear line when the binaries are missing (setup builds them)."""
    try:
        binary.require("pilot-discovery")
        binary.require("istioctl")
    except binary.IstiodMissing as exc:
        pytest.fail(str(exc), pytrace=False)


@contextlib.contextmanager
def istiod_mesh(tmp_path_factory: pytest.TempPathFactory, name: str, **config: Any) -> Iterator[IstiodMesh]:
    """A mesh with a real istiod (meshcache/ctl/istiod/mesh.py) in a fresh directory."""
    require_istiod()
    with IstiodMesh(IstiodMeshConfig(work_dir=tmp_path_factory.mktemp(name), **config), log=lambda _: None) as m:
        yield m


def grpc_infer(mesh: IstiodMesh, request: bytes, color: str = "") -> tuple[bytes, str]:
    """Raw bytes through the client sidecar (the app calls the Service name); (response, Cache-Status)."""
    metadata = ((COLOR_HEADER, color),) if color else ()
    return grpc_call(mesh.app_grpc, request, metadata, authority=f"{mesh.service_authority}:8001")


def rest_infer(mesh: IstiodMesh, model: str, body: dict, color: str = "") -> httpx.Response:
    headers = {"host": mesh.service_authority, **({COLOR_HEADER: color} if color else {})}
    return kserve.rest_infer(mesh.app_http, model, body, headers)


def assert_cache_affinity(mesh: IstiodMesh, seeds: range, grpc_seeds: range) -> None:
    """Through a client pod labelled for cache affinity and several engine replicas of one colour:
    the client-role filter's key and the DestinationRule's consistent hash send identical
    requests to the replica that holds the answer, so each is computed once in the mesh."""
    from meshcache.ctl.istiod.mesh import ecds_filters

    assert mesh.client is not None and len(mesh.engines) > 1
    assert [f["ecds_filter"]["name"] for f in ecds_filters(mesh.client)] == ["meshcache-client"]

    def per_replica() -> list[float]:
        return [engine_calls("mlp-classifier", e.engine.metrics_url) for e in mesh.engines]

    before = per_replica()
    for seed in seeds:
        first = rest_infer(mesh, "mlp-classifier", mlp_json(seed=seed))
        assert first.headers["cache-status"] == "meshcache; fwd=miss; stored"
    for seed in seeds:
        again = rest_infer(mesh, "mlp-classifier", mlp_json(seed=seed))
        assert again.headers["cache-status"].startswith("meshcache; hit; ttl="), seed
    added = [a - b for a, b in zip(per_replica(), before, strict=True)]
    assert sum(added) == len(seeds), "each answer computed once in the whole mesh"
    assert sum(1 for a in added if a) >= 2, f"keys spread over the replicas: {added}"
    before_grpc = sum(per_replica())
    for seed in grpc_seeds:
        request = mlp_request(seed=seed).SerializeToString()
        first_g, s1 = grpc_infer(mesh, request)
        second_g, s2 = grpc_infer(mesh, request)
        assert s1 == "meshcache; fwd=miss; stored" and s2.startswith("meshcache; hit; ttl=") and first_g == second_g
    assert sum(per_replica()) == before_grpc + len(grpc_seeds)


def main_engine_calls(mesh: IstiodMesh, model: str) -> float:
    return engine_calls(model, *(e.engine.metrics_url for e in mesh.engines))


def canary_engine_calls(mesh: IstiodMesh, model: str) -> float:
    assert mesh.canary is not None
    return engine_calls(model, mesh.canary.engine.metrics_url)


# The requests of the load tests (faults, store outage, xDS TLS rotation): mlp-classifier seeds.
SEEDS = range(2600, 2608)


def warmed_load(mesh: IstiodMesh) -> Load:
    """One caller repeating the SEEDS' REST requests through the client sidecar, without pause;
    their expected bytes are the mesh's answers now (which also warms the cache)."""
    target, kinds = mesh.app_http.removeprefix("http://"), rest_kinds(SEEDS, {"host": mesh.service_authority})
    expected = {kind.name: call(kind, target, timeout=10) for kind in kinds}
    return Load(target, expected, threads=1, pause_s=0, kinds=kinds, timeout_s=10)


def put_and_sync(mesh: IstiodMesh, ttl: int) -> None:
    with mesh.api() as api:
        version = api.put("/v1/policies/resnet-mini", json={"ttl_s": ttl, "max_ttl_s": 1800}).json()["version"]
    mesh.wait_synced(version, timeout=30)


_CAMEL = re.compile(r"^[a-z][a-z0-9]*([A-Z][a-z0-9]*)+$")


def snake_keys(node: Any) -> Any:
    """istiod's debug config_dump is protojson (camelCase), Envoy's admin snake_case: one shape."""
    if isinstance(node, dict):
        return {(re.sub(r"([A-Z])", lambda m: "_" + m.group(1).lower(), k) if _CAMEL.match(k) else k): snake_keys(v)
                for k, v in node.items()}
    if isinstance(node, list):
        return [snake_keys(v) for v in node]
    return node


def app_requests(sidecar: Sidecar, port: int) -> int:
    """Requests the sidecar sent to its app on `port` (cluster `inbound|PORT||`, Istio's stat name)."""
    stats = sidecar.stats(rf"^cluster\.inbound\|{port}\|\|;?\.upstream_rq_total$")
    assert len(stats) == 1, stats
    return next(iter(stats.values()))


def inbound_listener(dump: dict[str, Any], port: int) -> dict[str, Any]:
    """The bound inbound listener of `port` (the pod IP's) in an Envoy/istiod config_dump."""
    for c in dump["configs"]:
        if c.get("@type", "").endswith("ListenersConfigDump"):
            for item in c.get("dynamic_listeners", []):
                listener = item.get("active_state", {}).get("listener", {})
                addr = listener.get("address", {}).get("socket_address", {})
                if listener.get("traffic_direction") == "INBOUND" and addr.get("port_value") == port:
                    return listener  # type: ignore[no-any-return]
    raise AssertionError(f"no inbound listener on port {port}")


def hcm(listener: dict[str, Any]) -> dict[str, Any]:
    chains = [f["typed_config"] for fc in listener["filter_chains"] for f in fc["filters"]
              if f["name"] == "envoy.filters.network.http_connection_manager"]
    assert len(chains) == 1, "one (mTLS) chain per port under STRICT"
    return chains[0]  # type: ignore[no-any-return]


def syncz_of(mesh: IstiodMesh, sidecar: Sidecar) -> dict[str, Any]:
    assert mesh.istiod is not None
    return next(s for s in mesh.istiod.syncz() if s["proxy"] == sidecar.pod.proxy_id)


def commit_invalid_policy(mesh: IstiodMesh) -> int:
    """The API never produces such a config: written straight into the store (max_ttl_s < ttl_s,
    which the filter rejects when it configures); istiod passes it on, the sidecars NACK it."""
    async def inject() -> int:
        store = Store(Settings(redis_url=f"redis://127.0.0.1:{mesh.redis_port}/0"))
        try:
            cur = await store.load_current()
            bad = Policy(model_prefix="text-embedder", ttl_s=60, max_ttl_s=5, generation=cur.version + 1)
            keep = tuple(p for p in cur.policies if p.model_prefix != "text-embedder")
            return await store.commit(Snapshot(version=cur.version + 1, policies=(*keep, bad), action="bad"),
                                      cur.version, "test", "invalid on purpose")
        finally:
            await store.close()

    return asyncio.run(inject())


def client_config_version(mesh: IstiodMesh) -> int:
    """The policy snapshot version in the client sidecar's `meshcache-client` config (either host)."""
    assert mesh.client is not None
    for f in ecds_filters(mesh.client):
        if f["ecds_filter"]["name"] == CLIENT_FILTER_NAME:
            typed = f["ecds_filter"]["typed_config"]
            value = (typed.get("config", {}).get("configuration") or typed.get("filter_config") or {})["value"]
            return int(json.loads(value)["version"])
    return 0


def assert_client_role_fails_open(mesh: IstiodMesh, seeds: range) -> None:
    """The client role's fail-open default: a caller's sidecar restarted while its only
    `meshcache-client` config is one the filter refuses passes the caller's requests (with no
    routing key: the ring hash spreads them) instead of answering 500; the next good config
    reaches it."""
    client = mesh.client
    assert client is not None
    commit_invalid_policy(mesh)
    eventually(lambda: syncz_of(mesh, client)["resources"][ECDS_TYPE_URL].get("lastError"), timeout=15)
    mesh.restart(client.envoy.name)  # waits until LIVE: the refusal ends the listener's wait
    fail = f"extension_config_discovery.http_filter.{CLIENT_FILTER_NAME}.config_fail"
    eventually(lambda: client.stats(fail).get(fail, 0) >= 1, timeout=15)
    for seed in seeds:
        r = rest_infer(mesh, "mlp-classifier", mlp_json(seed=seed))
        assert r.status_code == 200, (r.status_code, r.text)  # without the default: 500 from the client sidecar
    with mesh.api() as api:
        version = api.put("/v1/policies/text-embedder", json={"ttl_s": 600, "max_ttl_s": 3600}).json()["version"]
    eventually(lambda: client_config_version(mesh) == version, timeout=15)
    mesh.wait_synced(version, timeout=15)
