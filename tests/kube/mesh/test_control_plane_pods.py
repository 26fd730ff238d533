"""The meshcache control plane and Redis as the rendered istio/ objects run them: pods of the test
kubelet (the control-plane image's entrypoint, Redis's image as redis-server on a provisioned
PersistentVolume), probed and restarted as kubelet does, and istiod's MCP source the rendered
Service DNS name. Healing: a killed control plane (every replica) is restarted by the kubelet and a
hung one (SIGSTOP) is killed by its liveness probe and restarted, while the engine sidecars keep
their config and cache (issue 33's no-empty-config guarantees, through istiod in kube mode)."""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from meshcache.contract.extensions import AFFINITY_LABEL
from meshcache.contract.wasm_filter import CLIENT_FILTER_NAME
from meshcache.ctl.istio import render
from meshcache.ctl.kube.mesh import CP_NAME, REDIS_NAME, KubeMesh
from tests.helpers.kserve import mlp_json
from tests.helpers.wait import eventually

Obj = dict[str, Any]
NS = render.BASE_NAMESPACE
APP_UID = 1000
# The sidecar's dynamic config: every ECDS filter (the meshcache Wasm filter among them) and the
# listeners' names, from Envoy's admin in the pod's namespace.
DUMP = ("import urllib.request,json;"
        "d=json.loads(urllib.request.urlopen('http://127.0.0.1:15000/config_dump').read());"
        "e={f['ecds_filter']['name']:f['ecds_filter']['typed_config'] for c in d['configs'] if 'Ecds' in c['@type']"
        " for f in c['ecds_filters']};"
        "l=sorted(x['name'] for c in d['configs'] if 'Listeners' in c['@type'] for x in c.get('dynamic_listeners',[]));"
        "print(json.dumps({'ecds':e,'listeners':l},sort_keys=True))")
POST = """import sys, urllib.request
req = urllib.request.Request(sys.argv[1], data=sys.argv[3].encode(), method="POST",
                             headers={"Host": sys.argv[2], "Content-Type": "application/json"})
r = urllib.request.urlopen(req, timeout=20)
print(r.headers.get("cache-status"))
print(r.read().decode())
"""


def _pods(mesh: KubeMesh, app: str) -> list[Obj]:
    assert mesh.cluster is not None
    return (mesh.cluster.get(f"/api/v1/namespaces/{NS}/pods?labelSelector=app%3D{app}") or {}).get("items", [])


def _ready(pod: Obj) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", []))


def _ready_pods(mesh: KubeMesh, app: str, count: int) -> list[Obj]:
    def ready() -> list[Obj]:
        pods = [p for p in _pods(mesh, app) if not p["metadata"].get("deletionTimestamp")]
        assert len(pods) == count and all(_ready(p) for p in pods), [(p["metadata"]["name"], p["status"]) for p in pods]
        return pods

    return eventually(ready, timeout=180, interval=0.5)


def _replicas(mesh: KubeMesh, kind: str, app: str) -> int:
    """The rendered replicas of the `kind` objects labelled `app`."""
    return sum(int(o["spec"]["replicas"]) for o in mesh.objects
               if o["kind"] == kind and o["metadata"].get("labels", {}).get("app") == app)


def _sidecar_config(mesh: KubeMesh, pod: Obj) -> Obj:
    assert mesh.kubelet is not None
    running = mesh.kubelet.pods[f"{NS}/{pod['metadata']['name']}"]
    out = subprocess.run(running.net.exec_argv(sys.executable, "-c", DUMP), capture_output=True, text=True,
                         check=True, timeout=20).stdout
    return json.loads(out)


def _cp_container(pod: Obj) -> Obj:
    return next(c for c in pod["status"]["containerStatuses"] if c["name"] == "control-plane")


def test_the_control_plane_and_redis_run_as_pods_and_istiod_reads_the_rendered_service(kube_mesh: KubeMesh) -> None:
    assert kube_mesh.cluster is not None and kube_mesh.kubelet is not None and kube_mesh.network is not None
    cidr = ipaddress.ip_network(kube_mesh.network.cidr)
    cps = _ready_pods(kube_mesh, CP_NAME, _replicas(kube_mesh, "Deployment", CP_NAME))
    for pod in cps:
        assert ipaddress.ip_address(pod["status"]["podIP"]) in cidr
        running = kube_mesh.kubelet.pods[f"{NS}/{pod['metadata']['name']}"]
        proc = running.procs["control-plane"]
        assert proc.alive()
        # The image's entrypoint as the pod's user, in the pod's network namespace.
        assert os.stat(f"/proc/{proc.popen.pid}").st_uid == pod["spec"]["securityContext"]["runAsUser"]
        assert os.readlink(f"/proc/{proc.popen.pid}/ns/net") != os.readlink("/proc/self/ns/net")
    # Redis: the StatefulSet's claim bound to a PersistentVolume made for it, the AOF written there.
    (redis,) = _ready_pods(kube_mesh, REDIS_NAME, _replicas(kube_mesh, "StatefulSet", REDIS_NAME))
    claim_name = next(v for v in redis["spec"]["volumes"] if v["name"] == "data")["persistentVolumeClaim"]["claimName"]
    claim = kube_mesh.cluster.get(f"/api/v1/namespaces/{NS}/persistentvolumeclaims/{claim_name}")
    assert claim is not None and claim["status"]["phase"] == "Bound"
    volume = kube_mesh.cluster.get(f"/api/v1/persistentvolumes/{claim['spec']['volumeName']}")
    assert volume is not None and volume["spec"]["claimRef"]["uid"] == claim["metadata"]["uid"]
    data = Path(volume["spec"]["hostPath"]["path"])
    assert eventually(lambda: list(data.glob("appendonlydir/*.aof")), timeout=30)
    # istiod's MCP source is the rendered Service name, unchanged, and the control plane's
    # EnvoyFilters reached istiod through it (istiod has them: it has no other source of them).
    istio = kube_mesh.cluster.get("/api/v1/namespaces/istio-system/configmaps/istio")
    assert istio is not None
    mesh_config = yaml.safe_load(istio["data"]["mesh"])
    rendered = [s["address"] for s in kube_mesh.operator["spec"]["meshConfig"]["configSources"]]
    assert [s["address"] for s in mesh_config["configSources"]] == rendered
    assert any(a.startswith(f"xds://{CP_NAME}.{NS}.svc.cluster.local:") for a in rendered)
    assert kube_mesh.istiod is not None

    def envoyfilters() -> list[str]:
        config = kube_mesh.istiod.debug("configz")  # type: ignore[union-attr]
        return [c["metadata"]["name"] for c in config if c.get("kind") == "EnvoyFilter"]

    assert eventually(envoyfilters, timeout=30)


def _caller(mesh: KubeMesh, name: str) -> Any:
    assert mesh.cluster is not None and mesh.kubelet is not None
    account = "meshcache-client"
    if mesh.cluster.get(f"/api/v1/namespaces/{NS}/serviceaccounts/{account}") is None:
        mesh.cluster.kubectl("create", "serviceaccount", account, "-n", NS)
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "namespace": NS, "labels": {"app": name, AFFINITY_LABEL: "true"}},
           "spec": {"serviceAccountName": account,
                    "containers": [{"name": "app", "image": "example.invalid/caller:1"}]}}
    mesh.cluster.kubectl("apply", "--server-side", "-f", "-", input=json.dumps(pod))

    def affinity_ready() -> Any:
        running = mesh.kubelet.pods.get(f"{NS}/{name}")  # type: ignore[union-attr]
        assert running is not None and running.proxy_ready
        # The client-role filter (cache affinity) loaded, not the agent's stand-in: before it,
        # requests are balanced without the route key and a hit is luck.
        out = subprocess.run(running.net.exec_argv(sys.executable, "-c", DUMP), capture_output=True, text=True,
                             check=True, timeout=20).stdout
        config = json.loads(out)["ecds"].get(CLIENT_FILTER_NAME, {})
        assert config.get("@type", "").endswith("wasm.v3.Wasm"), config
        return running

    return eventually(affinity_ready, timeout=120, interval=0.5)


def _post(mesh: KubeMesh, caller: Any, seed: int) -> tuple[str, str]:
    assert mesh.cluster is not None
    service = mesh.cluster.get(f"/api/v1/namespaces/{NS}/services/{render.ENGINE_APP}")
    assert service is not None
    url = f"http://{service['spec']['clusterIP']}:8000/v2/models/mlp-classifier/infer"
    argv = caller.net.exec_argv("setpriv", f"--reuid={APP_UID}", f"--regid={APP_UID}", "--clear-groups",
                                sys.executable, "-c", POST, url, render.ENGINE_APP, json.dumps(mlp_json(seed=seed)))
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    # Retried by `eventually` (503 until the caller's sidecar has the engine endpoints).
    assert out.returncode == 0, out.stderr[-500:]
    status, _, payload = out.stdout.partition("\n")
    return status, payload


def _heal(kube_mesh: KubeMesh, kill: Any, pods: list[Obj]) -> tuple[list[Obj], dict[str, Obj]]:
    """`kill(proc)` on the control-plane container of each of `pods`; then, until every one is
    restarted and Ready again, the engine sidecars' config is checked to stay as it was."""
    engines = _ready_pods(kube_mesh, render.ENGINE_APP, _replicas(kube_mesh, "Deployment", render.ENGINE_APP))
    before = {p["metadata"]["name"]: _sidecar_config(kube_mesh, p) for p in engines}
    assert all("meshcache" in c["ecds"] for c in before.values()), before
    assert kube_mesh.kubelet is not None
    counts = {p["metadata"]["name"]: _cp_container(p)["restartCount"] for p in pods}
    for pod in pods:
        kill(kube_mesh.kubelet.pods[f"{NS}/{pod['metadata']['name']}"].procs["control-plane"])

    def restarted() -> list[Obj]:
        for engine in engines:  # nothing removed from the sidecars meanwhile
            assert _sidecar_config(kube_mesh, engine) == before[engine["metadata"]["name"]]
        now = {p["metadata"]["name"]: p for p in _pods(kube_mesh, CP_NAME)}
        for name, count in counts.items():
            status = _cp_container(now[name])
            assert status["restartCount"] == count + 1 and status["ready"], status
        return list(now.values())

    return eventually(restarted, timeout=120, interval=0.5), before


def test_a_killed_control_plane_is_restarted_by_the_kubelet_and_the_sidecars_keep_config_and_cache(
        kube_mesh: KubeMesh) -> None:
    cps = _ready_pods(kube_mesh, CP_NAME, _replicas(kube_mesh, "Deployment", CP_NAME))
    caller = _caller(kube_mesh, "cp-heal-caller")

    def hit() -> str:
        # A hit before the outage (the first request may precede the caller's affinity config).
        status, payload = _post(kube_mesh, caller, 3421)
        assert status.startswith("meshcache; hit; ttl="), status
        return payload

    first = eventually(hit, timeout=60, interval=0.5)
    # Every replica killed at once: istiod loses its MCP source until the kubelet restarts them.
    after, before = _heal(kube_mesh, lambda proc: proc.popen.send_signal(signal.SIGKILL), cps)
    for pod in after:
        assert _cp_container(pod)["lastState"]["terminated"]["exitCode"] == 128 + signal.SIGKILL
    status, second = _post(kube_mesh, caller, 3421)
    engines = _ready_pods(kube_mesh, render.ENGINE_APP, _replicas(kube_mesh, "Deployment", render.ENGINE_APP))
    for engine in engines:  # still the config from before the outage (no new VM: same cache)
        assert _sidecar_config(kube_mesh, engine) == before[engine["metadata"]["name"]]
    assert status.startswith("meshcache; hit; ttl="), status  # the sidecar's cache outlived it
    assert second == first
    # And the restarted control plane configures the mesh again through istiod: a new policy
    # reaches the engine sidecars' filter config (then removed: the mesh left as found).
    with kube_mesh.api() as api:
        api.put("/v1/policies/heal-check", json={"ttl_s": 60, "max_ttl_s": 60}).raise_for_status()
        try:
            for engine in engines:
                eventually(lambda e=engine: "heal-check" in json.dumps(_sidecar_config(kube_mesh, e)["ecds"]),
                           timeout=60, interval=0.5)
        finally:
            api.delete("/v1/policies/heal-check").raise_for_status()
    for engine in engines:
        eventually(lambda e=engine: "heal-check" not in json.dumps(_sidecar_config(kube_mesh, e)["ecds"]),
                   timeout=60, interval=0.5)


def test_a_hung_control_plane_is_killed_by_its_liveness_probe_and_restarted(kube_mesh: KubeMesh) -> None:
    cps = _ready_pods(kube_mesh, CP_NAME, _replicas(kube_mesh, "Deployment", CP_NAME))
    stopped: list[int] = []

    def hang(proc: Any) -> None:
        stopped.append(proc.popen.pid)
        proc.popen.send_signal(signal.SIGSTOP)

    after, _ = _heal(kube_mesh, hang, cps[:1])
    assert not Path(f"/proc/{stopped[0]}").exists()  # the stopped process was killed, not resumed
    pod = next(p for p in after if p["metadata"]["name"] == cps[0]["metadata"]["name"])
    assert _cp_container(pod)["lastState"]["terminated"]["exitCode"] == 128 + signal.SIGKILL
