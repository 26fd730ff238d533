"""The native host (Envoy dynamic module, the 1.39 build) in the local Kubernetes through istiod's
real injection: the engine pod as `render --filter native --istio-version 1.31` writes it, applied
with kubectl, injected by istiod's webhook with a classic istio-proxy sidecar; the test kubelet runs
the module image's init container (its real copy-and-check command), then the sidecar (Envoy 1.39,
the module from the emptyDir through `sidecar.istio.io/userVolumeMount`), then the engine. The
same key checks as the istiod native mesh (tests/istiod/test_istiod.py), on injected pods."""

from __future__ import annotations

import json
import re
from functools import partial
from typing import Any

from meshcache.contract import oci
from meshcache.contract.extensions import GRPC_PORT
from meshcache.contract.grpc_hit import GRPC_HIT_LUA_FILTER, GRPC_HIT_ROUTE, GRPC_STALE_ROUTE
from meshcache.contract.native_filter import DYNAMIC_MODULE_TYPE_URL
from meshcache.ctl.istio import native_module, render
from meshcache.ctl.istio.filter_host import NATIVE_MODULE_FOR_ENVOY
from meshcache.ctl.kube import module_image
from meshcache.ctl.kube.mesh import NATIVE_ENVOY, KubeMesh
from meshcache.ctl.kube.up import wait_applied
from tests.helpers.kserve import MODEL_INFER, mlp_json, mlp_request
from tests.helpers.wait import eventually
from tests.istiod.helpers import ROUTER
from tests.kube.mesh.helpers import (
    NATIVE_CALLER,
    NS,
    caller_pod,
    ecds_filters,
    engine_calls,
    envoy_admin,
    grpc_call,
    http_ok,
    ready_engine_pods,
    running,
    service_ip,
)

Obj = dict[str, Any]
MODULE_FILE = NATIVE_MODULE_FOR_ENVOY[NATIVE_ENVOY]  # libmeshcache_native-envoy-1.39.so


def _caller(mesh: KubeMesh) -> Any:
    return caller_pod(mesh, NATIVE_CALLER, "meshcache-client")


def _inbound_http_filters(mesh: KubeMesh, pod: Obj, port: int) -> list[Obj]:
    """The engine sidecar's HTTP connection managers on inbound `port` (istiod's virtualInbound
    listener: one filter chain per port and transport), from its config dump."""
    dump = json.loads(envoy_admin(running(mesh, pod), "/config_dump"))
    listeners = [item["active_state"]["listener"] for c in dump["configs"]
                 if c.get("@type", "").endswith("ListenersConfigDump") for item in c.get("dynamic_listeners", [])
                 if "active_state" in item]
    inbound = next(lis for lis in listeners if lis["name"] == "virtualInbound")
    return [f["typed_config"] for fc in inbound["filter_chains"]
            if fc.get("filter_chain_match", {}).get("destination_port") == port
            for f in fc["filters"] if f["name"] == "envoy.filters.network.http_connection_manager"]


def test_the_engine_pod_runs_the_module_image_then_a_classic_sidecar_on_envoy_1_39(
        native_kube_mesh: KubeMesh) -> None:
    mesh = native_kube_mesh
    (pod,) = ready_engine_pods(mesh, count=1)
    spec = pod["spec"]
    inits = [c["name"] for c in spec["initContainers"]]
    # Injected by istiod as a classic sidecar (nativeSidecar "false"): the first container, started
    # after every init container (the module's copy included), the app held by its postStart hook.
    assert native_module.INIT_CONTAINER in inits and "istio-init" in inits and "istio-proxy" not in inits, inits
    proxy = spec["containers"][0]
    assert proxy["name"] == "istio-proxy" and proxy["lifecycle"]["postStart"]["exec"]["command"][:2] == \
        ["pilot-agent", "wait"], proxy
    assert {"name": native_module.VOLUME, "mountPath": "/var/lib/meshcache/modules", "readOnly": True} \
        in proxy["volumeMounts"], proxy["volumeMounts"]
    statuses = {c["name"]: c for c in pod["status"]["initContainerStatuses"]}
    assert statuses[native_module.INIT_CONTAINER]["state"]["terminated"]["exitCode"] == 0, statuses
    init = next(c for c in spec["initContainers"] if c["name"] == native_module.INIT_CONTAINER)
    assert init["image"] == module_image.reference()
    # Its real command ran: the copy checked by sha256sum, the file left read-only in the emptyDir.
    run = running(mesh, pod)
    log = run.procs[native_module.INIT_CONTAINER].log_path.read_text()
    assert re.search(rf"/meshcache-module/{re.escape(MODULE_FILE)}\.tmp: OK", log), log
    copied = run.root / "volumes" / native_module.VOLUME / MODULE_FILE
    assert oct(copied.stat().st_mode & 0o777) == "0o444" and copied.stat().st_uid == 1337
    assert copied.read_bytes() == (module_image.DIST / MODULE_FILE).read_bytes()
    # Every sidecar (engine, caller) runs Envoy 1.39, istio-proxy 1.31's.
    for sidecar in (run, _caller(mesh)):
        version = json.loads(envoy_admin(sidecar, "/server_info"))["version"]
        assert version.split("/")[1].startswith(f"{NATIVE_ENVOY}."), version
    # The filter from istiod's ECDS: the dynamic module, naming the 1.39 build where the pod mounts it.
    typed = ecds_filters(run)["meshcache"]["typed_config"]
    assert typed["@type"] == DYNAMIC_MODULE_TYPE_URL, typed
    assert typed["dynamic_module_config"]["module"]["local"]["filename"] == native_module.sidecar_path(MODULE_FILE)
    assert json.loads(typed["filter_config"]["value"])["policies"], "the seeded policies"
    # Envoy 1.39 loaded the 1.39 build with the ABI it expects (its log, through the agent's).
    assert "Dynamic module ABI version v0.1.0 matched." in run.procs["istio-proxy"].log_path.read_text()
    # The agent handed Envoy the config and Envoy took it (no config failure).
    stats = envoy_admin(run, "/stats?filter=extension_config_discovery.http_filter.meshcache")
    assert re.search(r"config_reload: [1-9]", stats) and re.search(r"config_fail: 0\b", stats), stats


def test_the_second_grpc_model_infer_is_a_single_pass_hit_through_the_injected_sidecars(
        native_kube_mesh: KubeMesh) -> None:
    mesh = native_kube_mesh
    (pod,) = ready_engine_pods(mesh, count=1)
    ip = service_ip(mesh)
    client = _caller(mesh)
    request = mlp_request(seed=3701).SerializeToString()

    def infer() -> Obj:
        result = grpc_call(client, MODEL_INFER, request, render.ENGINE_APP, ip)
        assert result["code"] == "OK", result  # UNAVAILABLE until the client sidecar has endpoints
        return result

    calls = sum(engine_calls(mesh, "mlp-classifier", [pod]).values())
    first = eventually(infer, timeout=30)
    assert first["cache_status"] == "meshcache; fwd=miss; stored", first
    second = infer()
    assert second["cache_status"].startswith("meshcache; hit; ttl="), second
    assert second["response"] == first["response"] and first["response"]
    assert sum(engine_calls(mesh, "mlp-classifier", [pod]).values()) == calls + 1
    # Single pass: the module answers a hit itself, so the gRPC port's chains have no Lua filter and
    # no hit route (the Wasm host's second pass); the cache sits right before the router, after RBAC.
    managers = _inbound_http_filters(mesh, pod, GRPC_PORT)
    assert managers
    for hcm in managers:
        names = [f["name"] for f in hcm["http_filters"]]
        assert names[-2:] == ["meshcache", ROUTER] and "envoy.filters.http.rbac" in names, names
        assert GRPC_HIT_LUA_FILTER not in names, names
        routes = [r.get("name") for vh in hcm["route_config"]["virtual_hosts"] for r in vh["routes"]]
        assert GRPC_HIT_ROUTE not in routes and GRPC_STALE_ROUTE not in routes, routes


def test_the_second_rest_infer_is_a_hit(native_kube_mesh: KubeMesh) -> None:
    mesh = native_kube_mesh
    (pod,) = ready_engine_pods(mesh, count=1)
    ip, client = service_ip(mesh), _caller(mesh)
    path, body = "/v2/models/mlp-classifier/infer", json.dumps(mlp_json(seed=3702))

    post = partial(http_ok, client, path, ip, body)

    calls = sum(engine_calls(mesh, "mlp-classifier", [pod]).values())
    first = eventually(post, timeout=30)
    assert first["headers"]["cache-status"] == "meshcache; fwd=miss; stored", first["headers"]
    second = post()
    assert second["headers"]["cache-status"].startswith("meshcache; hit; ttl="), second["headers"]
    assert second["body"] == first["body"]
    assert sum(engine_calls(mesh, "mlp-classifier", [pod]).values()) == calls + 1


def test_a_policy_put_and_a_purge_reach_the_sidecar_through_istiod_ecds(native_kube_mesh: KubeMesh) -> None:
    mesh = native_kube_mesh
    assert mesh.istiod is not None
    (pod,) = ready_engine_pods(mesh, count=1)
    run = running(mesh, pod)
    debug = f"http://127.0.0.1:{mesh.istiod.ports.monitoring}/debug"
    proxies = {f"{pod['metadata']['name']}.{NS}": run.net.name}
    ip, client = service_ip(mesh), _caller(mesh)
    path, body = "/v2/models/mlp-classifier/infer", json.dumps(mlp_json(seed=3703))

    post = partial(http_ok, client, path, ip, body)

    eventually(post, timeout=30)
    assert post()["headers"]["cache-status"].startswith("meshcache; hit; ttl=")
    prefix = "kube-native-put"  # this test's own prefix, deleted at the end
    with mesh.api() as api:
        version = int(api.put(f"/v1/policies/{prefix}", json={"ttl_s": 77}).raise_for_status().json()["version"])
    try:
        wait_applied(debug, proxies, version, timeout=60)  # the sidecar runs it, istiod has the ACK
        typed = ecds_filters(run)["meshcache"]["typed_config"]
        assert typed["@type"] == DYNAMIC_MODULE_TYPE_URL
        plugin = json.loads(typed["filter_config"]["value"])
        assert int(plugin["version"]) >= version
        assert any(p.get("model_prefix") == prefix and p.get("ttl_s") == 77 for p in plugin["policies"]), plugin
        # The module keeps its store across a config update: the entry is still a hit.
        assert post()["headers"]["cache-status"].startswith("meshcache; hit; ttl=")
    finally:
        with mesh.api() as api:
            gone = int(api.delete(f"/v1/policies/{prefix}").raise_for_status().json()["version"])
        wait_applied(debug, proxies, gone, timeout=60)
    calls = sum(engine_calls(mesh, "mlp-classifier", [pod]).values())
    with mesh.api() as api:
        purged = int(api.post("/v1/purge", json={"model_prefix": "mlp-classifier"}).raise_for_status()
                     .json()["version"])
    wait_applied(debug, proxies, purged, timeout=60)
    again = post()
    assert again["headers"]["cache-status"] == "meshcache; fwd=miss; stored", again["headers"]
    assert sum(engine_calls(mesh, "mlp-classifier", [pod]).values()) == calls + 1
    assert post()["headers"]["cache-status"].startswith("meshcache; hit; ttl=")


def _module_pod(mesh: KubeMesh, name: str, image: str, sha256: str) -> None:
    """A pod with the engine template's module init container, `image` and `sha256` changed (not
    injected: only the init container matters; its app's image is not one the kubelet runs)."""
    assert mesh.cluster is not None
    engine = next(o for o in mesh.objects if o["kind"] == "Deployment"
                  and o["metadata"].get("labels", {}).get("app") == render.ENGINE_APP)
    init = next(c for c in engine["spec"]["template"]["spec"]["initContainers"]
                if c["name"] == native_module.INIT_CONTAINER)
    init = {**init, "image": image, "command": native_module.copy_command(MODULE_FILE, sha256)}
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "namespace": NS, "labels": {"sidecar.istio.io/inject": "false"}},
           "spec": {"initContainers": [init], "volumes": [{"name": native_module.VOLUME, "emptyDir": {}}],
                    "containers": [{"name": "app", "image": "example.invalid/app:1"}]}}
    mesh.cluster.kubectl("apply", "--server-side", "-f", "-", input=json.dumps(pod))


def test_a_wrong_module_sha256_or_image_digest_keeps_the_pod_from_starting(native_kube_mesh: KubeMesh) -> None:
    """As in a cluster: a copy whose sha256 differs fails the init container (sha256sum -c), an
    image digest the registry does not hold is never pulled; either way the pod stays in Init."""
    mesh = native_kube_mesh
    assert mesh.cluster is not None
    _module_pod(mesh, "module-wrong-sha", module_image.reference(), "0" * 64)
    _module_pod(mesh, "module-wrong-digest", f"{module_image.REPOSITORY}@sha256:{'1' * 64}",
                oci.sha256_hex((module_image.DIST / MODULE_FILE).read_bytes()))
    try:
        def state(name: str) -> Obj:
            pod = mesh.cluster.get(f"/api/v1/namespaces/{NS}/pods/{name}")  # type: ignore[union-attr]
            assert pod is not None
            statuses = {s["name"]: s["state"] for s in pod["status"].get("initContainerStatuses", [])}
            assert native_module.INIT_CONTAINER in statuses, pod["status"]  # not reported yet
            st = statuses[native_module.INIT_CONTAINER]
            assert "running" not in st and st.get("waiting", {}).get("reason") != "PodInitializing", st
            conditions = {c["type"]: c["status"] for c in pod["status"].get("conditions", [])}
            assert pod["status"].get("phase") == "Pending" and conditions.get("Initialized") == "False", pod["status"]
            return st

        wrong_sha = eventually(lambda: state("module-wrong-sha"), timeout=30, interval=0.5)
        assert wrong_sha["terminated"]["exitCode"] != 0, wrong_sha
        run = mesh.kubelet.pods[f"{NS}/module-wrong-sha"]  # type: ignore[union-attr]
        log = run.procs[native_module.INIT_CONTAINER].log_path.read_text()
        assert "FAILED" in log, log  # sha256sum -c's verdict on the copy
        assert not (run.root / "volumes" / native_module.VOLUME / MODULE_FILE).exists(), "no file renamed in"
        wrong_digest = eventually(lambda: state("module-wrong-digest"), timeout=30, interval=0.5)
        assert wrong_digest["waiting"]["reason"] == "ErrImagePull", wrong_digest
        assert "manifest unknown" in wrong_digest["waiting"]["message"]
    finally:
        for name in ("module-wrong-sha", "module-wrong-digest"):
            mesh.cluster.kubectl("delete", "pod", name, "-n", NS, "--wait=false")
