"""What the kube mesh's tests share: the engine pods as the API server reports them, caller pods
whose app is the test (a process in the pod's network namespace, not UID 1337, so istio-iptables
captures its outbound traffic to the client sidecar), and reads from inside a pod (the sidecar's
admin and the engine's metrics are on the pod's loopback)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from meshcache.ctl.istio import render
from meshcache.ctl.kube.kubelet import RunningPod
from meshcache.ctl.kube.mesh import KubeMesh
from meshcache.ctl.mesh.engine_metrics import requests_in
from tests.helpers.wait import eventually

Obj = dict[str, Any]
NS = render.BASE_NAMESPACE
APP_UID = 1000  # the test acts as the app container of a pod: a process in its namespace, not UID 1337
CACHE_CALLER = "cache-caller"  # the affinity-labelled caller pod the cache tests share (one pod, not one each)
NATIVE_CALLER = "native-caller"  # the native kube mesh's caller: no affinity label, so no client role
ENGINE_METRICS_PORT = 8002  # the engine container's `metrics` port (istio/base/engine.yaml)


def engine_pods(mesh: KubeMesh, selector: str = f"app={render.ENGINE_APP}", namespace: str = NS) -> list[Obj]:
    assert mesh.cluster is not None
    pods = mesh.cluster.get(f"/api/v1/namespaces/{namespace}/pods?labelSelector={selector.replace('=', '%3D')}")
    return [p for p in (pods["items"] if pods else []) if not p["metadata"].get("deletionTimestamp")]


def proxy_status(pod: Obj) -> Obj | None:
    """istio-proxy's status: a native sidecar's (init container) or a classic one's."""
    statuses = pod["status"].get("initContainerStatuses", []) + pod["status"].get("containerStatuses", [])
    return next((c for c in statuses if c["name"] == "istio-proxy"), None)


def ready_sidecars(mesh: KubeMesh) -> list[Obj]:
    return [p for p in engine_pods(mesh) if (proxy_status(p) or {}).get("ready")]


def ready_engine_pods(mesh: KubeMesh, count: int | None = None, selector: str = f"app={render.ENGINE_APP}",
                      timeout: float = 180, namespace: str = NS) -> list[Obj]:
    """The engine pods (of `selector`), once every one is Running and Ready (and `count` of them)."""
    def ready() -> list[Obj]:
        pods = engine_pods(mesh, selector, namespace)
        conditions = [{c["type"]: c["status"] for c in p["status"].get("conditions", [])} for p in pods]
        ok = pods and all(p["status"].get("phase") == "Running" and c.get("Ready") == "True"
                          for p, c in zip(pods, conditions, strict=True))
        ok = ok and (count is None or len(pods) == count)
        assert ok, (mesh.kubelet.errors[-3:], [(p["metadata"]["name"], p["status"].get("phase"))  # type: ignore[union-attr]
                                               for p in pods])
        return pods

    return eventually(ready, timeout=timeout, interval=0.5)


def running(mesh: KubeMesh, pod: Obj) -> RunningPod:
    assert mesh.kubelet is not None
    return mesh.kubelet.pods[f"{pod['metadata']['namespace']}/{pod['metadata']['name']}"]


def in_pod(pod: RunningPod, script: str, *args: str, as_app: bool = False, timeout: float = 60) -> str:
    """`python -c script args` inside the pod's network namespace (as its app's UID if `as_app`)."""
    user = ("setpriv", f"--reuid={APP_UID}", f"--regid={APP_UID}", "--clear-groups") if as_app else ()
    out = subprocess.run(pod.net.exec_argv(*user, sys.executable, "-c", script, *args), capture_output=True,
                         text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-800:]
    return out.stdout


def caller_pod(mesh: KubeMesh, name: str, account: str, labels: dict[str, str] | None = None,
               namespace: str = NS) -> RunningPod:
    """An injected pod whose app is this test (its container's image is not one the kubelet runs)."""
    assert mesh.cluster is not None and mesh.kubelet is not None
    if mesh.cluster.get(f"/api/v1/namespaces/{namespace}/serviceaccounts/{account}") is None:
        mesh.cluster.kubectl("create", "serviceaccount", account, "-n", namespace)
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "namespace": namespace, "labels": {"app": name, **(labels or {})}},
           "spec": {"serviceAccountName": account,
                    "containers": [{"name": "app", "image": "example.invalid/caller:1"}]}}
    mesh.cluster.kubectl("apply", "--server-side", "-f", "-", input=json.dumps(pod))

    def proxy_ready() -> RunningPod:
        got = mesh.cluster.get(f"/api/v1/namespaces/{namespace}/pods/{name}")  # type: ignore[union-attr]
        assert got is not None and (proxy_status(got) or {}).get("ready"), got and got["status"]
        return mesh.kubelet.pods[f"{namespace}/{name}"]  # type: ignore[union-attr]

    return eventually(proxy_ready, timeout=90, interval=0.5)


def service_ip(mesh: KubeMesh, namespace: str = NS) -> str:
    """The engine Service's ClusterIP (no kube-proxy: only the caller's capture routes it)."""
    assert mesh.cluster is not None
    service = mesh.cluster.get(f"/api/v1/namespaces/{namespace}/services/{render.ENGINE_APP}")
    assert service is not None
    return str(service["spec"]["clusterIP"])


HTTP = """import json, sys, urllib.request, urllib.error
spec = json.loads(sys.argv[1])
data = spec["body"].encode() if spec.get("body") is not None else None
req = urllib.request.Request(spec["url"], data=data, method="POST" if data else "GET", headers=spec["headers"])
try:
    r = urllib.request.urlopen(req, timeout=20)
except urllib.error.HTTPError as e:
    r = e
print(json.dumps({"status": r.status, "headers": {k.lower(): v for k, v in r.headers.items()},
                  "body": r.read().decode()}))
"""


def http_call(caller: RunningPod, path: str, host: str, ip: str, body: str | None = None,
              headers: dict[str, str] | None = None) -> Obj:
    """REST from the caller pod's app to the Service (`ip`:8000, Host `host`): status, headers, body."""
    spec = {"url": f"http://{ip}:8000{path}", "body": body,
            "headers": {"Host": host, "Content-Type": "application/json", **(headers or {})}}
    return json.loads(in_pod(caller, HTTP, json.dumps(spec), as_app=True))  # type: ignore[no-any-return]


def http_ok(caller: RunningPod, path: str, ip: str, body: str) -> Obj:
    """REST to the engine Service answered 200 (a 503 until the caller's sidecar has the engine's
    endpoints, so callers wait for it with `eventually`): the result."""
    result = http_call(caller, path, render.ENGINE_APP, ip, body=body)
    assert result["status"] == 200, result
    return result


GRPC = """import json, sys, grpc
spec = json.loads(sys.argv[1])
with grpc.insecure_channel(spec["target"], options=[("grpc.default_authority", spec["authority"])]) as channel:
    try:
        response, call = channel.unary_unary(spec["method"]).with_call(
            bytes.fromhex(spec["request"]), metadata=tuple(spec["metadata"].items()), timeout=20)
        out = {"code": "OK", "cache_status": dict(call.initial_metadata()).get("cache-status", ""),
               "response": response.hex()}
    except grpc.RpcError as e:
        out = {"code": e.code().name, "cache_status": "", "response": "", "details": e.details()}
print(json.dumps(out))
"""


def grpc_call(caller: RunningPod, method: str, request: bytes, host: str, ip: str,
              metadata: dict[str, str] | None = None) -> Obj:
    """A unary gRPC call from the caller pod's app to the Service (`ip`:8001, `:authority` host:8001)."""
    spec = {"target": f"{ip}:8001", "authority": f"{host}:8001", "method": method, "request": request.hex(),
            "metadata": metadata or {}}
    return json.loads(in_pod(caller, GRPC, json.dumps(spec), as_app=True))  # type: ignore[no-any-return]


FETCH = "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())"


def engine_calls(mesh: KubeMesh, model: str, pods: list[Obj] | None = None) -> dict[str, float]:
    """Inference requests each engine pod's engine has received for `model` (its metrics port, read
    on the pod's loopback: not captured), by pod name."""
    out = {}
    for pod in engine_pods(mesh) if pods is None else pods:
        text = in_pod(running(mesh, pod), FETCH, f"http://127.0.0.1:{ENGINE_METRICS_PORT}/metrics")
        out[pod["metadata"]["name"]] = requests_in(text, model)
    return out


def envoy_admin(pod: RunningPod, path: str) -> str:
    """The pod's sidecar admin (127.0.0.1:15000 in its namespace)."""
    return in_pod(pod, FETCH, f"http://127.0.0.1:15000{path}")


def ecds_filters(pod: RunningPod) -> dict[str, Obj]:
    """The sidecar's ECDS filters by name: {name: {"typed_config", "version_info"}}."""
    dump = json.loads(envoy_admin(pod, "/config_dump"))
    return {f["ecds_filter"]["name"]: {"typed_config": f["ecds_filter"]["typed_config"],
                                       "version_info": f.get("version_info", "")}
            for c in dump["configs"] if c.get("@type", "").endswith("EcdsConfigDump")
            for f in c.get("ecds_filters", [])}
