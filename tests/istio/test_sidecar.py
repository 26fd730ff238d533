"""The full mode's EnvoyFilters, applied by a patch applier written from Istio's EnvoyFilter
semantics to an Envoy config shaped like istiod's inbound sidecar config: where the pieces land,
`envoy --mode validate` on the result, and a real Envoy running it that answers a gRPC hit
through the single-pass path, with the filter delivered as istiod would (MCP from a real control
plane -> EnvoyFilter -> ECDS over ADS, module fetched and digest-checked like istio-agent)."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import yaml

from meshcache.contract import extensions, grpc_hit, oci
from meshcache.contract.paths import envoy_binary
from meshcache.control_plane.proxy_stats import ProxyReading, ProxyStatsReader
from meshcache.ctl import envoy_config, launchers, procs
from meshcache.ctl.istio import kustomize, render
from meshcache.ctl.pki import CertificateAuthority, Identity, spiffe_id
from meshcache.ctl.procs import local_http
from tests.filter.stack import infer_request
from tests.helpers.control_plane import ControlPlaneProc, run
from tests.helpers.kserve import MODEL_INFER
from tests.helpers.wait import eventually
from tests.istio import sidecar
from tests.istio.envoyfilter_apply import UnsupportedPatch, apply
from tests.istio.istiod_client import IstiodLikeClient

REPOSITORY = "registry.example.com/meshcache/filter"
GRPC, HTTP = extensions.GRPC_PORT, extensions.HTTP_PORT


def _identity(tmp: Path) -> Identity:
    return CertificateAuthority.create().issue(spiffe_id("ml", "meshcache-engine"), tmp / "pki", "engine")


def _config(tmp: Path, **ports: int) -> dict:
    return sidecar.inbound_sidecar(listen_port=ports.get("listen", 15006), admin_port=ports.get("admin", 15000),
                                   xds_port=ports.get("xds", 15010),
                                   upstreams={HTTP: ports.get("http", 18000), GRPC: ports.get("grpc", 18001)},
                                   grpc_ports={GRPC}, identity=_identity(tmp))


def _envoy_filters(pins: render.Pins, client: bool = False) -> list[dict]:
    """The server sidecars' EnvoyFilters (the default), or the callers' client-role one."""
    objs = render.mcp_objects(render.render(render.RenderOptions()), render.demo_plugin_config())
    return [o for o in objs if (o["metadata"]["name"] == extensions.CLIENT_OBJECT) == client]


def _validate(config: dict, tmp: Path) -> subprocess.CompletedProcess:
    path = tmp / "sidecar.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path), "--log-level", "error"],
                          capture_output=True, text=True, timeout=120)


def test_patches_land_where_istio_puts_them(tmp_path: Path, pins: render.Pins) -> None:
    config = _config(tmp_path)
    [ef] = _envoy_filters(pins)
    patched, ecds, applied = apply(config, [ef])
    assert applied == len(ef["spec"]["configPatches"])  # every patch found its place
    order = sidecar.ISTIO_HTTP_FILTER_ORDER
    # Both chains of each port (mTLS and plaintext) get them, after istio.stats, before the router.
    assert list(sidecar.http_filters(patched, GRPC)) == 2 * [
        [*order[:-1], "meshcache", grpc_hit.GRPC_HIT_LUA_FILTER, order[-1]]]
    assert list(sidecar.http_filters(patched, HTTP)) == 2 * [[*order[:-1], "meshcache", order[-1]]]
    assert [r["name"] for r in sidecar.route_config(patched, GRPC)["virtual_hosts"][0]["routes"]] == [
        grpc_hit.GRPC_HIT_ROUTE, grpc_hit.GRPC_STALE_ROUTE, "default"]
    assert [r["name"] for r in sidecar.route_config(patched, HTTP)["virtual_hosts"][0]["routes"]] == ["default"]
    [(name, ext)] = ecds.items()
    wasm = ext["typed_config"]["config"]
    assert name == "meshcache" and wasm["vm_config"]["code"]["remote"]["sha256"] == pins.image_digest
    # Another default-priority EnvoyFilter inserting before the router is applied first (lower
    # priority): the Lua filter stays right after the cache filter.
    other = {"metadata": {"name": "other"}, "spec": {"configPatches": [{
        "applyTo": "HTTP_FILTER", "match": {"context": "SIDECAR_INBOUND", "listener": {"filterChain": {
            "filter": {"name": extensions.HCM, "subFilter": {"name": extensions.ROUTER}}}}},
        "patch": {"operation": "INSERT_BEFORE", "value": {"name": "x.other", "typed_config": sidecar.STAND_IN}}}]}}
    patched2, _, _ = apply(config, [ef, other])
    names = next(sidecar.http_filters(patched2, GRPC))
    assert names[-4:] == ["x.other", "meshcache", grpc_hit.GRPC_HIT_LUA_FILTER, "envoy.filters.http.router"]


def test_applier_refuses_what_it_does_not_implement(tmp_path: Path) -> None:
    config = _config(tmp_path)
    base = {"metadata": {"name": "x"}, "spec": {"configPatches": []}}
    merge = copy.deepcopy(base)
    merge["spec"]["configPatches"] = [{"applyTo": "HTTP_FILTER", "match": {"context": "SIDECAR_INBOUND"},
                                       "patch": {"operation": "MERGE", "value": {}}}]
    with pytest.raises(UnsupportedPatch):
        apply(config, [merge])
    missing = copy.deepcopy(base)
    missing["spec"]["configPatches"] = [{"applyTo": "HTTP_FILTER", "match": {"context": "SIDECAR_INBOUND", "listener": {
        "filterChain": {"filter": {"name": extensions.HCM, "subFilter": {"name": "no.such.filter"}}}}},
        "patch": {"operation": "INSERT_BEFORE", "value": {"name": "y"}}}]
    _, _, applied = apply(config, [missing])
    assert applied == 0  # an absent anchor is not an error in Istio: the patch just does not apply
    outbound = copy.deepcopy(missing)
    outbound["spec"]["configPatches"][0]["match"]["context"] = "SIDECAR_OUTBOUND"
    assert apply(config, [outbound])[2] == 0


def test_patched_sidecar_validates(tmp_path: Path, pins: render.Pins, filter_wasm: Path) -> None:
    [ef] = _envoy_filters(pins)
    patched, ecds, _ = apply(_config(tmp_path), [ef])
    result = _validate(patched, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    # The ECDS resource as Envoy gets it after the agent's rewrite, inlined where the filter is.
    local = sidecar.agent_rewrite(ecds, {REPOSITORY + f"@sha256:{pins.image_digest}": oci.image_for(filter_wasm)},
                                  tmp_path)
    assert "local" in local["meshcache"]["typed_config"]["config"]["vm_config"]["code"]
    for chain in patched["static_resources"]["listeners"][0]["filter_chains"]:
        for f in chain["filters"][0]["typed_config"]["http_filters"]:
            if f["name"] == "meshcache":
                del f["config_discovery"]
                f["typed_config"] = local["meshcache"]["typed_config"]
    result = _validate(patched, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    # And a broken one is caught (so the check above means something).
    local["meshcache"]["typed_config"]["config"]["vm_config"]["vm_idd"] = "x"
    assert _validate(patched, tmp_path).returncode != 0


def test_agent_rewrite_checks_the_digest(tmp_path: Path, pins: render.Pins, filter_wasm: Path) -> None:
    [ef] = _envoy_filters(pins)
    _, ecds, _ = apply(_config(tmp_path), [ef])
    wrong = {REPOSITORY + f"@sha256:{pins.image_digest}": oci.build_image(b"\0asm\1\0\0\0")}
    fallback = sidecar.agent_rewrite(ecds, wrong, tmp_path)["meshcache"]["typed_config"]
    assert fallback["@type"] == sidecar.RBAC_TYPE_URL  # FAIL_OPEN: allow-all, traffic flows uncached


def test_patched_sidecar_serves_a_grpc_hit_in_one_pass(tmp_path: Path, pins: render.Pins, filter_wasm: Path,
                                                        start_cp: Callable[..., ControlPlaneProc]) -> None:
    """MCP (real control plane, full mode) -> EnvoyFilter -> applied to the istiod-shaped config ->
    ECDS over ADS (module fetched and digest-checked as istio-agent does) -> a real Envoy that
    answers the second identical ModelInfer from the cache, through the single-pass hit route."""
    url = extensions.oci_url(REPOSITORY, pins.image_digest)
    cp = start_cp(extra_env={"MESHCACHE_CP_ISTIO_WASM_URL": url, "MESHCACHE_CP_ISTIO_WASM_SHA256": pins.image_digest,
                             "MESHCACHE_CP_ISTIO_NAMESPACE": "ml", "MESHCACHE_CP_ISTIO_COLOR": "blue"})
    assert cp.client().put("/v1/policies/resnet", json={"ttl_s": 60}).status_code == 200

    async def envoy_filters() -> list[dict]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{cp.xds_port}") as ch:
            istiod = IstiodLikeClient(ch)
            await istiod.start()
            await istiod.sync()
            while not istiod.effective():
                await istiod.handle(await istiod.recv())
            await istiod.close()
            assert not istiod.errors
            return list(istiod.effective().values())

    served = run(envoy_filters())
    http_port, grpc_port, listen_port, admin_port, stats_port = (procs.free_port() for _ in range(5))
    config = sidecar.inbound_sidecar(listen_port=listen_port, admin_port=admin_port, xds_port=0,
                                     upstreams={HTTP: http_port, GRPC: grpc_port}, grpc_ports={GRPC},
                                     identity=_identity(tmp_path), stats_port=stats_port,
                                     stats_inclusion_prefixes=_engine_stats_prefixes())
    patched, ecds, _ = apply(config, served)
    ads = sidecar.EcdsOverAds(sidecar.agent_rewrite(
        ecds, {url.removeprefix("oci://"): oci.image_for(filter_wasm)}, tmp_path))
    server, ads_port = sidecar.serve_ecds(ads)
    xds = next(c for c in patched["static_resources"]["clusters"] if c["name"] == "xds-grpc")
    xds["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"][
        "port_value"] = ads_port
    sidecar.remap_port(patched, GRPC, listen_port)  # iptables' job in a pod
    path = tmp_path / "sidecar.yaml"
    path.write_text(yaml.safe_dump(patched, sort_keys=False))
    started: list[procs.Proc] = []
    try:
        with procs.supervised(started):
            origin = procs.start("origin", [sys.executable, "-m", "tests.filter.origin", "--http-port",
                                            str(http_port), "--grpc-port", str(grpc_port)], tmp_path)
            started.append(origin)
            procs.wait_until(origin, procs.tcp_open(grpc_port))
            started.append(launchers.start_envoy(path, admin_port, tmp_path))
            request = infer_request("resnet-mini")
            answers = []
            with grpc.insecure_channel(f"127.0.0.1:{listen_port}") as channel:
                call = channel.unary_unary(MODEL_INFER)
                for _ in range(2):
                    body, c = call.with_call(request, timeout=10)
                    answers.append((body, dict(c.initial_metadata()), c.code()))
            assert ads.requested == ["meshcache"] and ads.acks and not ads.nacks
            (first, h1, code1), (second, h2, code2) = answers
            assert code1 == code2 == grpc.StatusCode.OK
            assert second == first and len(first) > 0  # exact bytes, from the cache
            assert "hit" not in h1.get("cache-status", "") and "hit" in h2.get("cache-status", ""), (h1, h2)
            calls = local_http().get(f"http://127.0.0.1:{http_port}/calls", timeout=5).json()
            assert calls["grpc"] == 1  # the origin saw the first call only
            _status_page_reads_the_sidecar(stats_port)
    finally:
        server.stop(0)


def _engine_stats_prefixes() -> list[str]:
    """The proxyStatsMatcher inclusion prefixes the committed engine Deployment gives its sidecar."""
    engine = next(o for o in kustomize.build(render.BASE_DIR)
                  if o["kind"] == "Deployment" and o["metadata"]["name"].startswith("meshcache-engine"))
    proxy = yaml.safe_load(engine["spec"]["template"]["metadata"]["annotations"]["proxy.istio.io/config"])
    return list(proxy["proxyStatsMatcher"]["inclusionPrefixes"])


def _status_page_reads_the_sidecar(stats_port: int) -> None:
    """What the control plane istio/base configures (DNS name -> {ip} template on :15090) reads the
    filter's counters and per-policy gauges through Istio's stats matcher and Prometheus listener;
    here `localhost` stands for the headless Service and `stats_port` for :15090."""
    cp_env = {e["name"]: e.get("value") for o in kustomize.build(render.BASE_DIR)
              if o["kind"] == "Deployment" and o["metadata"]["name"] == "meshcache-control-plane"
              for e in o["spec"]["template"]["spec"]["containers"][0]["env"]}
    template = cp_env["MESHCACHE_CP_PROXY_STATS_TEMPLATE"]
    assert template == "http://{ip}:15090/stats/prometheus" and cp_env["MESHCACHE_CP_PROXY_STATS_DNS"]
    page = local_http().get(f"http://127.0.0.1:{stats_port}/stats/prometheus", timeout=5).text
    assert "envoy_cluster_upstream_rq" not in page, "Istio's stats matcher keeps only what it includes"

    async def read() -> list[ProxyReading]:
        reader = ProxyStatsReader({}, template.replace("15090", str(stats_port)), dns_names=["localhost"],
                                  cache_s=0)
        try:
            return await reader.read([])
        finally:
            await reader.close()

    def resnet() -> ProxyReading | None:
        # Envoy flushes counters and gauges on its own timer: wait until the reading shows both the
        # stored entry and the hit (the gauge can arrive one flush before the counter).
        [r] = run(read())
        policy = r.counters.policies.get("resnet", {}) if r.ok and r.counters else {}
        done = policy.get("entries") == 1 and policy.get("hits") == 1 and r.counters.totals.get("hits") == 1
        return r if done else None

    reading = eventually(resnet, timeout=10)
    assert reading.node_id == "localhost/127.0.0.1" and reading.counters is not None
    assert reading.counters.totals["hits"] == 1 and reading.counters.policies["resnet"]["hits"] == 1
    assert reading.counters.unattributed == {"entries": 0, "bytes": 0}
    assert reading.counters.policies["resnet"]["bytes"] == reading.counters.totals["bytes"] > 0


def test_local_mesh_server_sidecar_runs_the_same_filter_chain(pins: render.Pins) -> None:
    """`meshcache up`'s server sidecar mirrors the full mode: the same filter entries in the same
    order before the router (ECDS-delivered cache filter, then the Lua body step) and the same hit
    route first; only the ECDS config source differs (the control plane there, ADS here)."""
    from meshcache.ctl.mesh.topology import DEFAULT_PLUGIN_CONFIG

    local = envoy_config.render(envoy_config.CacheProxy(
        listen_port=1, admin_port=2, http_upstream_port=3, grpc_upstream_port=4, plugin_config=DEFAULT_PLUGIN_CONFIG,
        ecds_port=5))
    hcm = local["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    [ef] = _envoy_filters(pins)
    patches = ef["spec"]["configPatches"]
    grpc_filters = [p["patch"]["value"] for p in patches
                    if p["applyTo"] == "HTTP_FILTER" and p["match"]["listener"]["portNumber"] == GRPC]
    assert [f["name"] for f in hcm["http_filters"]] == [*(f["name"] for f in grpc_filters),
                                                        "envoy.filters.http.router"]
    assert hcm["http_filters"][1] == grpc_filters[1]  # the Lua filter, identical
    assert hcm["http_filters"][0]["config_discovery"]["type_urls"][0] == \
        grpc_filters[0]["config_discovery"]["type_urls"][0]
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    # Each INSERT_FIRST patch lands on top: the last patch is the first route.
    hit = [p["patch"]["value"] for p in patches if p["applyTo"] == "HTTP_ROUTE"][::-1]
    assert routes[:len(hit)] == hit


def _outbound_sidecar(engine_ports: dict[int, int]) -> dict:
    """A caller's sidecar as istiod shapes its outbound side for the engine Service: one listener
    `0.0.0.0_<port>` per Service port, Istio's outbound filter chain, a route to the colour subset's
    cluster carrying the hash policy istiod derives from the DestinationRule's consistentHash."""
    objs = render.render(render.RenderOptions())
    dr = next(o for o in objs if o["kind"] == "DestinationRule" and o["spec"]["host"] == extensions.ENGINE_APP)
    [subset] = dr["spec"]["subsets"]
    ring = subset["trafficPolicy"]["loadBalancer"]["consistentHash"]
    listeners, clusters = [], []
    for port, upstream in engine_ports.items():
        cluster = f"outbound|{port}|{subset['name']}|meshcache-engine.meshcache.svc.cluster.local"
        hcm = copy.deepcopy(sidecar._hcm(port))["typed_config"]
        hcm["stat_prefix"] = f"outbound_0.0.0.0_{port}"
        hcm["http_filters"] = [f for f in hcm["http_filters"] if f["name"] not in ("istio_authn",
                                                                                   "envoy.filters.http.rbac")]
        hcm["route_config"] = {"name": str(port), "validate_clusters": False, "virtual_hosts": [{
            "name": f"meshcache-engine.meshcache.svc.cluster.local:{port}", "domains": ["*"], "routes": [{
                "name": "default", "match": {"prefix": "/"},
                "route": {"cluster": cluster, "timeout": "0s",
                          "hash_policy": [{"header": {"header_name": ring["httpHeaderName"]}}]}}]}]}
        listeners.append({"name": f"0.0.0.0_{port}", "address": {"socket_address": {
            "address": "0.0.0.0", "port_value": port}}, "filter_chains": [{"filters": [
                {"name": extensions.HCM, "typed_config": hcm}]}]})
        c = sidecar._cluster(cluster, upstream, http2=port == GRPC)
        c["lb_policy"] = "RING_HASH"
        c["ring_hash_lb_config"] = {"minimum_ring_size": ring["ringHash"]["minimumRingSize"]}
        clusters.append(c)
    clusters.append(sidecar._cluster("xds-grpc", 15010, http2=True))
    return {"node": {"id": "sidecar~10.0.0.2~app-0.apps~apps.svc.cluster.local", "cluster": "app.apps"},
            "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 15000}}},
            "static_resources": {"listeners": listeners, "clusters": clusters},
            "dynamic_resources": {"ads_config": {"api_type": "GRPC", "transport_api_version": "V3",
                                                 "grpc_services": [{"envoy_grpc": {"cluster_name": "xds-grpc"}}]}}}


def test_client_role_lands_on_callers_outbound_chains_and_validates(tmp_path: Path, pins: render.Pins,
                                                                   filter_wasm: Path) -> None:
    [client] = _envoy_filters(pins, client=True)
    [server] = _envoy_filters(pins)
    config = _outbound_sidecar({HTTP: 18000, GRPC: 18001})
    # The server filters never touch a caller's outbound side; the client one never an inbound side.
    assert apply(config, [server], context="SIDECAR_OUTBOUND")[2] == 1  # its EXTENSION_CONFIG only
    assert apply(_config(tmp_path), [client])[2] == 1
    patched, ecds, applied = apply(config, [client], context="SIDECAR_OUTBOUND")
    assert applied == len(client["spec"]["configPatches"])
    for listener in patched["static_resources"]["listeners"]:
        names = [f["name"] for f in listener["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]]
        assert names[-2:] == ["meshcache-client", "envoy.filters.http.router"]
    [(name, ext)] = ecds.items()
    plugin = json.loads(ext["typed_config"]["config"]["configuration"]["value"])
    assert name == "meshcache-client" and plugin["role"] == "client" and plugin["hold_headers"] is True
    assert ext["typed_config"]["config"]["allow_on_headers_stop_iteration"] is True
    result = _validate(patched, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    # With the module as istio-agent hands it to Envoy, inlined: Envoy loads the client role.
    local = sidecar.agent_rewrite(ecds, {REPOSITORY + f"@sha256:{pins.image_digest}": oci.image_for(filter_wasm)},
                                  tmp_path)
    for listener in patched["static_resources"]["listeners"]:
        for f in listener["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]:
            if f["name"] == "meshcache-client":
                del f["config_discovery"]
                f["typed_config"] = local["meshcache-client"]["typed_config"]
    result = _validate(patched, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
