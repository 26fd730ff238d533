"""A real istiod between the control plane and the sidecars: it reads the control plane over MCP
(TLS, as istio/ configures it) and the translated istio/ objects from fs://, and configures stock
Envoys (bootstrapped like istio-agent's) that serve the hits.

One mesh for the module (tests/istiod/conftest.py): main colour green (default route), canary
blue, one client pod; every test uses its own inputs. The key tests also run on Istio 1.31's
mesh (`native_mesh`: every sidecar Envoy 1.39, the cache as the dynamic module from the native
mode's EnvoyFilters, three green replicas with cache affinity), parametrized by `mesh`.
"""

from __future__ import annotations

import json
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from meshcache.contract.extensions import GRPC_PORT, HTTP_PORT, RBAC_TYPE_URL
from meshcache.contract.grpc_hit import GRPC_HIT_LUA_FILTER, GRPC_HIT_ROUTE, GRPC_STALE_ROUTE
from meshcache.contract.native_filter import DYNAMIC_MODULE_TYPE_URL
from meshcache.contract.paths import FILTER_WASM, filter_native
from meshcache.ctl.istiod.mesh import NATIVE_ENVOY, IstiodMesh, ecds_filters, ecds_version
from meshcache.ctl.istiod.status import ECDS_TYPE_URL as ECDS_TYPE
from meshcache.ctl.pki import spiffe_id
from tests.helpers.kserve import mlp_json, mlp_request
from tests.helpers.wait import eventually
from tests.istiod.helpers import (
    ISTIO_INBOUND_ORDER,
    ROUTER,
    app_requests,
    assert_cache_affinity,
    assert_client_role_fails_open,
    canary_engine_calls,
    commit_invalid_policy,
    grpc_infer,
    hcm,
    inbound_listener,
    main_engine_calls,
    rest_infer,
    snake_keys,
    syncz_of,
)
from tests.istiod.helpers import istiod_mesh as start_istiod_mesh  # the fixture below is named native_mesh

METRICS_PORT = 8002  # the engine pod's `metrics` container port (istio/base/engine.yaml)

XDS_TYPES = ("Cluster", "Listener", "RouteConfiguration", "ClusterLoadAssignment")


@pytest.fixture(scope="module")
def native_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[IstiodMesh]:
    with start_istiod_mesh(tmp_path_factory, "istiod-native", filter="native", replicas=3) as m:
        yield m


@pytest.fixture(params=["wasm", "native"])
def mesh(request: pytest.FixtureRequest) -> IstiodMesh:
    """The Istio 1.30-style mesh (Wasm filter) or Istio 1.31's (native host): the same tests."""
    return request.getfixturevalue("istiod_mesh" if request.param == "wasm" else "native_mesh")  # type: ignore[no-any-return]


def test_istiod_synced_from_the_control_plane_and_every_proxy_acked(istiod_mesh: IstiodMesh) -> None:
    mesh = istiod_mesh
    assert mesh.istiod is not None
    configz = mesh.istiod.configz()
    filters = {c["metadata"]["name"] for c in configz if c["kind"] == "EnvoyFilter"}
    # From MCP (nothing in fs://): one per colour, and the client role's.
    assert filters == {"meshcache-green", "meshcache-blue", "meshcache-client"}
    kinds = {c["kind"] for c in configz}
    assert {"ServiceEntry", "WorkloadEntry", "Sidecar", "PeerAuthentication", "AuthorizationPolicy",
            "DestinationRule", "VirtualService"} <= kinds
    for sc in [*mesh.server_sidecars(), mesh.client]:
        assert sc is not None
        status = syncz_of(mesh, sc)
        for name, res in status["resources"].items():
            assert res["acked"] == res["sent"] and not res.get("lastError"), (sc.pod.name, name, res)
        assert {t.rsplit(".", 1)[1] for t in status["resources"]} >= set(XDS_TYPES)
    for sc in mesh.server_sidecars():
        assert syncz_of(mesh, sc)["resources"][ECDS_TYPE]["acked"], "the filter config came by ECDS"


def test_engine_sidecar_has_the_filter_and_hit_route_in_istios_inbound_order(istiod_mesh: IstiodMesh) -> None:
    mesh = istiod_mesh
    assert mesh.istiod is not None
    sc = mesh.engines[0].sidecar
    assert sc is not None
    # What the sidecar runs and what istiod generated for it are the same.
    for dump in (sc.config_dump(), snake_keys(mesh.istiod.config_dump(sc.pod.proxy_id))):
        grpc_hcm = hcm(inbound_listener(dump, GRPC_PORT))
        names = [f["name"] for f in grpc_hcm["http_filters"]]
        assert names[-3:] == ["meshcache", GRPC_HIT_LUA_FILTER, ROUTER], names
        istio_part = names[:-3]
        assert "envoy.filters.http.rbac" in istio_part, "the AuthorizationPolicy runs before the cache"
        assert istio_part == [n for n in ISTIO_INBOUND_ORDER if n in istio_part], names
        cache = next(f for f in grpc_hcm["http_filters"] if f["name"] == "meshcache")
        assert "ads" in cache["config_discovery"]["config_source"]
        route = grpc_hcm["route_config"]
        assert route["name"] == f"inbound|{GRPC_PORT}||"
        assert [r["name"] for r in route["virtual_hosts"][0]["routes"]][:2] == [GRPC_HIT_ROUTE, GRPC_STALE_ROUTE]
        rest = [f["name"] for f in hcm(inbound_listener(dump, HTTP_PORT))["http_filters"]]
        assert rest[-2:] == ["meshcache", ROUTER], rest
    # The filter config from ECDS: the exact Wasm config (vm_id, held headers, the module file).
    wasm = next(f["ecds_filter"]["typed_config"]["config"] for f in ecds_filters(sc)
                if f["ecds_filter"]["name"] == "meshcache")
    assert wasm["vm_config"]["vm_id"] == "meshcache"
    assert wasm["vm_config"]["code"]["local"]["filename"] == str(FILTER_WASM)
    assert wasm.get("allow_on_headers_stop_iteration") is True
    # The client pod gets the client role only where it carries the affinity label (not here).
    assert mesh.client is not None
    assert not [f for f in ecds_filters(mesh.client) if f["ecds_filter"]["name"] == "meshcache-client"]


def test_second_grpc_model_infer_is_a_single_pass_hit(mesh: IstiodMesh) -> None:
    request = mlp_request(seed=2301).SerializeToString()
    calls = main_engine_calls(mesh, "mlp-classifier")
    first, status1 = grpc_infer(mesh, request)
    assert status1 == "meshcache; fwd=miss; stored"
    upstream = sum(app_requests(e.sidecar, GRPC_PORT) for e in mesh.engines if e.sidecar)
    second, status2 = grpc_infer(mesh, request)
    assert status2.startswith("meshcache; hit; ttl=")
    assert second == first
    assert main_engine_calls(mesh, "mlp-classifier") == calls + 1
    # Single pass: the hit never left a sidecar (no second request to the app's cluster).
    assert sum(app_requests(e.sidecar, GRPC_PORT) for e in mesh.engines if e.sidecar) == upstream


def test_second_rest_infer_is_a_hit(mesh: IstiodMesh) -> None:
    body = mlp_json(seed=2302)
    calls = main_engine_calls(mesh, "mlp-classifier")
    first = rest_infer(mesh, "mlp-classifier", body)
    assert first.status_code == 200 and first.headers["cache-status"] == "meshcache; fwd=miss; stored"
    second = rest_infer(mesh, "mlp-classifier", body)
    assert second.headers["cache-status"].startswith("meshcache; hit; ttl=")
    assert second.content == first.content
    assert main_engine_calls(mesh, "mlp-classifier") == calls + 1


def test_blue_reaches_the_canary_through_the_rendered_routes_and_is_cached_apart(mesh: IstiodMesh) -> None:
    body = mlp_json(seed=2303)
    main = rest_infer(mesh, "mlp-classifier", body)
    assert main.json()["model_version"] == "2", "the default route: green, the main engine"
    canary_calls = canary_engine_calls(mesh, "mlp-classifier")
    blue = rest_infer(mesh, "mlp-classifier", body, color="blue")
    assert blue.headers["cache-status"] == "meshcache; fwd=miss; stored", "not the green entry"
    assert blue.json()["model_version"] == "1", "the canary engine serves version 1"
    again = rest_infer(mesh, "mlp-classifier", body, color="blue")
    assert again.headers["cache-status"].startswith("meshcache; hit; ttl=") and again.content == blue.content
    assert canary_engine_calls(mesh, "mlp-classifier") == canary_calls + 1
    # gRPC the same way.
    request = mlp_request(seed=2304).SerializeToString()
    g1, s1 = grpc_infer(mesh, request, color="blue")
    g2, s2 = grpc_infer(mesh, request, color="blue")
    assert s1 == "meshcache; fwd=miss; stored" and s2.startswith("meshcache; hit; ttl=") and g1 == g2
    assert canary_engine_calls(mesh, "mlp-classifier") == canary_calls + 2


def test_strict_mtls_and_the_rendered_authorization_policy(istiod_mesh: IstiodMesh, tmp_path: Path) -> None:
    """Straight to the engine pod's port (no client sidecar): plaintext is refused (STRICT); a
    mesh certificate of another service account is denied by the AuthorizationPolicy; the
    allowed principal passes."""
    mesh = istiod_mesh
    assert mesh.ca is not None
    url = f"https://{mesh.engines[0].pod.ip}:{HTTP_PORT}/v2/health/ready"
    with pytest.raises(httpx.HTTPError):
        httpx.get(url.replace("https://", "http://"), timeout=5)

    def get_as(account: str, at: str = url) -> httpx.Response:
        ident = mesh.ca.issue(spiffe_id("meshcache", account), tmp_path / account, "tls")  # type: ignore[union-attr]
        ctx = ssl.create_default_context(cafile=str(ident.ca))
        ctx.check_hostname = False  # Istio checks the peer's SPIFFE identity, not a host name
        ctx.load_cert_chain(str(ident.cert), str(ident.key))
        return httpx.get(at, verify=ctx, timeout=5)

    denied = get_as("intruder")
    assert denied.status_code == 403 and "RBAC" in denied.text
    assert get_as("meshcache-client").status_code == 200
    # Every other port of the pod admits any caller (the policy's notPorts rule): the engine's
    # metrics port answers the same intruder, as it would Prometheus.
    metrics = get_as("intruder", f"https://{mesh.engines[0].pod.ip}:{METRICS_PORT}/metrics")
    assert metrics.status_code == 200 and "# TYPE" in metrics.text


def test_policy_put_reaches_the_sidecars_through_istiod(mesh: IstiodMesh) -> None:
    body = mlp_json(seed=2307)
    assert rest_infer(mesh, "mlp-classifier", body).headers["cache-status"] == "meshcache; fwd=miss; stored"
    before = {sc.pod.name: syncz_of(mesh, sc)["resources"][ECDS_TYPE]["sent"] for sc in mesh.server_sidecars()}
    with mesh.api() as api:
        version = api.put("/v1/policies/resnet-mini", json={"ttl_s": 120, "max_ttl_s": 1800}).json()["version"]
    mesh.wait_synced(version, timeout=15)
    for sc in mesh.server_sidecars():
        res = syncz_of(mesh, sc)["resources"][ECDS_TYPE]
        assert res["sent"] != before[sc.pod.name] and res["acked"] == res["sent"], res
        assert ecds_version(sc) == version
    # The new filter config keeps the store (Wasm: the same VM; native: the same loaded module).
    assert rest_infer(mesh, "mlp-classifier", body).headers["cache-status"].startswith("meshcache; hit")


def test_purge_through_istiod(mesh: IstiodMesh) -> None:
    body = mlp_json(seed=2305)
    rest_infer(mesh, "mlp-classifier", body)
    assert rest_infer(mesh, "mlp-classifier", body).headers["cache-status"].startswith("meshcache; hit")
    with mesh.api() as api:
        version = api.post("/v1/purge", json={"model_prefix": "mlp-classifier"}).json()["version"]
    mesh.wait_synced(version, timeout=15)
    assert rest_infer(mesh, "mlp-classifier", body).headers["cache-status"] == "meshcache; fwd=miss; stored"


def test_a_config_the_filter_rejects_is_a_nack_istiod_reports_and_the_sidecar_keeps_the_last_good_one(
        mesh: IstiodMesh) -> None:
    sc = mesh.engines[0].sidecar
    assert sc is not None
    body = mlp_json(seed=2306)
    rest_infer(mesh, "mlp-classifier", body)
    good = ecds_version(sc)

    bad_version = commit_invalid_policy(mesh)
    error = eventually(lambda: syncz_of(mesh, sc)["resources"][ECDS_TYPE].get("lastError"), timeout=15)
    # Envoy's NACK text: the Wasm filter names its plugin; the dynamic-module filter says the
    # module refused the config (Envoy 1.39), the reason being in the sidecar's log (below).
    nack_says = {"wasm": "meshcache", "native": "Failed to initialize dynamic module"}[mesh.config.filter]
    assert nack_says in error, error
    fail = "extension_config_discovery.http_filter.meshcache.config_fail"
    eventually(lambda: sc.stats(fail).get(fail, 0) >= 1, timeout=10)  # syncz may report before Envoy's stat shows
    assert bad_version > good
    assert "max_ttl_s: must be at least ttl_s" in sc.envoy.log_path.read_text()
    # The status page's proxy row (from istiod's syncz): the NACK, and not at the rejected version.
    with mesh.api() as api:
        def row() -> dict:
            return next(p for p in api.get("/v1/proxies").json()["proxies"] if p["node_id"] == sc.pod.proxy_id)

        nacked = eventually(lambda: row() if row()["last_nack"] else None, timeout=10)
    assert nack_says in nacked["last_nack"]["error"] and not nacked["current"], nacked
    assert nacked["acked_version"] != str(bad_version), nacked
    # The last good config (and its cache) keeps serving: had the rejected one been applied, the
    # plugin would have failed open and answered uncached.
    assert rest_infer(mesh, "mlp-classifier", body).headers["cache-status"].startswith("meshcache; hit")
    # A valid change afterwards is accepted again, and istiod clears the error.
    t0 = time.monotonic()
    with mesh.api() as api:
        version = api.put("/v1/policies/text-embedder", json={"ttl_s": 600, "max_ttl_s": 3600}).json()["version"]
    mesh.wait_synced(version, timeout=15)
    assert time.monotonic() - t0 < 15
    eventually(lambda: not syncz_of(mesh, sc)["resources"][ECDS_TYPE].get("lastError"), timeout=10)


def test_status_lists_the_sidecars_through_istiods_syncz_and_istiod_apart(istiod_mesh: IstiodMesh) -> None:
    """/v1/proxies and /v1/stats under istiod: istiod (an MCP client) is no proxy and has no stats
    row; the engine sidecars are listed from istiod's syncz with the policy version they ACKed."""
    mesh = istiod_mesh
    engines = {sc.pod.proxy_id for sc in mesh.server_sidecars()}
    with mesh.api() as api:
        version = api.put("/v1/policies/status-through-istiod", json={"ttl_s": 60}).raise_for_status().json()["version"]
        mesh.wait_synced(version, timeout=15)

        def listed() -> dict | None:
            out = api.get("/v1/proxies").raise_for_status().json()
            rows = {p["node_id"]: p for p in out["proxies"]}
            ok = engines <= set(rows) and all(rows[e]["current"] for e in engines)
            return out if ok else None

        out = eventually(listed, timeout=15)
        rows = {p["node_id"]: p for p in out["proxies"]}
        for e in engines:
            assert rows[e]["transport"] == "istiod" and rows[e]["acked_version"] == str(version), rows[e]
            assert rows[e]["last_nack"] is None
        assert out["complete"] and out["istiod_error"] is None
        assert [c["acked_version"] for c in out["config_clients"]] == [str(version)], out["config_clients"]
        istiod_ids = {c["node_id"] for c in out["config_clients"]}
        assert istiod_ids and not istiod_ids & set(rows)
        assert all(p["role"] == "proxy" for p in out["proxies"])
        stats = api.get("/v1/stats").raise_for_status().json()
        read = {p["node_id"]: p for p in stats["proxies"]}
        assert not istiod_ids & set(read)
        # The engine sidecars' stats; the client sidecar (no cache, no stats source) is not an unread proxy.
        assert set(read) == engines and stats["complete"] and all(p["ok"] for p in read.values()), read


def test_a_policy_prefix_no_engine_serves_warns_under_istiod(istiod_mesh: IstiodMesh) -> None:
    """The control plane of the istiod mesh knows its engines' model index (--engine-index)."""
    with istiod_mesh.api() as api:
        typo = api.put("/v1/policies/renset-mini", json={"ttl_s": 60}).raise_for_status().json()
        fine = api.put("/v1/policies/mlp-class", json={"ttl_s": 60}).raise_for_status().json()
    assert any("'renset-mini' matches no model the engines serve" in w for w in typo["warnings"]), typo
    assert fine["warnings"] == []


def test_logs_stay_quiet(istiod_mesh: IstiodMesh) -> None:
    """No Envoy deprecation lines from the sidecars (istio-agent's misc:error), no line per stats read."""
    mesh = istiod_mesh
    with mesh.api() as api:
        for _ in range(3):
            assert api.get("/v1/stats").raise_for_status().json()["proxies_read"] >= 1
    for sc in mesh.sidecars():
        log = sc.envoy.log_path.read_text()
        assert "Deprecated field" not in log and "max_grpc_timeout" not in log, sc.envoy.log_path
    cp_log = mesh.proc("control-plane").log_path.read_text()
    assert "HTTP Request:" not in cp_log, [line for line in cp_log.splitlines() if "HTTP Request:" in line][:3]


def test_native_host_through_istiod_in_istios_inbound_order(native_mesh: IstiodMesh) -> None:
    """Istio 1.31's mesh: every sidecar is Envoy 1.39 (istio-proxy 1.31's); the native mode's
    EnvoyFilters put the dynamic module where the Wasm filter goes (INSERT_BEFORE the router,
    after RBAC), by ECDS over ADS, with no Lua filter and no hit route (the module sends gRPC
    hits itself); the client role runs in the same host."""
    mesh = native_mesh
    assert mesh.istiod is not None
    for sc in mesh.sidecars():
        info = httpx.get(f"{sc.admin}/server_info", timeout=5).json()
        assert info["version"].split("/")[1].startswith(f"{NATIVE_ENVOY}."), info["version"]
    module = str(filter_native(NATIVE_ENVOY))
    for e in mesh.engines:
        sc = e.sidecar
        assert sc is not None
        for dump in (sc.config_dump(), snake_keys(mesh.istiod.config_dump(sc.pod.proxy_id))):
            for port in (HTTP_PORT, GRPC_PORT):
                port_hcm = hcm(inbound_listener(dump, port))
                names = [f["name"] for f in port_hcm["http_filters"]]
                assert names[-2:] == ["meshcache", ROUTER], names
                istio_part = names[:-2]
                assert "envoy.filters.http.rbac" in istio_part and GRPC_HIT_LUA_FILTER not in names, names
                assert istio_part == [n for n in ISTIO_INBOUND_ORDER if n in istio_part], names
                cache = next(f for f in port_hcm["http_filters"] if f["name"] == "meshcache")
                assert cache["config_discovery"]["type_urls"][0] == DYNAMIC_MODULE_TYPE_URL
                routes = [r["name"] for r in port_hcm["route_config"]["virtual_hosts"][0]["routes"]]
                assert GRPC_HIT_ROUTE not in routes and GRPC_STALE_ROUTE not in routes, routes
        typed = next(f["ecds_filter"]["typed_config"] for f in ecds_filters(sc)
                     if f["ecds_filter"]["name"] == "meshcache")
        assert typed["@type"] == DYNAMIC_MODULE_TYPE_URL
        assert typed["dynamic_module_config"]["module"]["local"]["filename"] == module
        assert json.loads(typed["filter_config"]["value"])["color"] == "green"
    assert mesh.client is not None
    client = [f["ecds_filter"] for f in ecds_filters(mesh.client)]
    assert [(f["name"], f["typed_config"]["@type"]) for f in client] == [("meshcache-client", DYNAMIC_MODULE_TYPE_URL)]
    assert json.loads(client[0]["typed_config"]["filter_config"]["value"])["role"] == "client"


def test_native_cache_affinity_over_three_replicas(native_mesh: IstiodMesh) -> None:
    assert_cache_affinity(native_mesh, seeds=range(2480, 2492), grpc_seeds=range(2500, 2506))
    assert_client_role_fails_open(native_mesh, seeds=range(2510, 2516))


def test_sidecar_whose_first_config_is_refused_serves_uncached(mesh: IstiodMesh) -> None:
    """A sidecar starting while the only config is one the filter refuses (a config it rejects;
    the same for a module that cannot load: one built for another Envoy, a Wasm module that fails
    to start) runs the fail-open default, a pass-through, instead of Envoy's 500 for a filter
    without config; the next good config caches again. Both hosts."""
    engine = mesh.engines[-1]
    sc = engine.sidecar
    assert sc is not None
    # As istiod hands it over: the pass-through as the default, and the listener still waits for
    # the first answer (so a healthy new sidecar is Ready only with the cache in place).
    for port in (HTTP_PORT, GRPC_PORT):
        cache = next(f for f in hcm(inbound_listener(sc.config_dump(), port))["http_filters"]
                     if f["name"] == "meshcache")
        discovery = cache["config_discovery"]
        assert discovery["default_config"]["@type"] == RBAC_TYPE_URL and "rules" not in discovery["default_config"]
        assert not discovery.get("apply_default_config_without_warming"), discovery
    commit_invalid_policy(mesh)
    eventually(lambda: syncz_of(mesh, sc)["resources"][ECDS_TYPE].get("lastError"), timeout=15)
    mesh.restart(sc.envoy.name)  # waits until LIVE: the refusal ends the listener's wait
    fail = "extension_config_discovery.http_filter.meshcache.config_fail"
    eventually(lambda: sc.stats(fail).get(fail, 0) >= 1, timeout=15)  # the new process refused its first config
    before = app_requests(sc, HTTP_PORT)
    statuses = []
    for seed in range(2520, 2532):  # native: spread over the three replicas by the affinity hash
        r = rest_infer(mesh, "mlp-classifier", mlp_json(seed=seed))
        assert r.status_code == 200, r.text
        statuses.append(r.headers.get("cache-status"))
    served = app_requests(sc, HTTP_PORT) - before
    assert served >= 1, "some requests reached the restarted sidecar"
    assert statuses.count(None) == served, statuses  # those passed uncached, the others were cached
    with mesh.api() as api:
        version = api.put("/v1/policies/text-embedder", json={"ttl_s": 600, "max_ttl_s": 3600}).json()["version"]
    mesh.wait_synced(version, timeout=15)
    assert ecds_version(sc) == version
