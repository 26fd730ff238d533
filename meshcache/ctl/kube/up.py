"""`meshcache up --kube`: the Kubernetes-mode mesh (mesh.py, with the test kubelet) run by the
local mesh's supervisor, plus an injected client pod whose app relays host traffic into the mesh
(forward.py). Same interface for the supervisor as the local and istiod meshes: start/stop,
children, endpoints, healer, certs.

What it makes outside its own processes is recorded in the state dir (`kube-network.json`) the
moment it exists, so `meshcache down` removes it even after a crashed or killed `up`
(`remove_leftovers`): the node bridge, every pod's network namespace (and whatever still runs
in it), their /etc/netns files and the pods' root directory.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from meshcache.contract.extensions import AFFINITY_LABEL, GRPC_PORT, HTTP_PORT
from meshcache.ctl import procs
from meshcache.ctl.istio import render
from meshcache.ctl.mesh.errors import MeshError
from meshcache.ctl.mesh.healing import ComponentRecord
from meshcache.ctl.mesh.state import process_start_time

from .mesh import KubeMesh, KubeMeshConfig
from .netns import NETNS_ETC, NodeNetwork

Obj = dict[str, Any]
RECORD = "kube-network.json"
CLIENT_POD = "meshcache-client"
CLIENT_SA = "meshcache-client"
APP_UID = 1000  # the client app is not istio-proxy (1337): its outbound traffic is captured
START_TIMEOUT_S = 240.0


def _write_record(state_dir: Path, data: Obj) -> None:
    tmp = state_dir / f".{RECORD}.tmp"
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, state_dir / RECORD)


def _netns_names() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def remove_leftovers(state_dir: Path) -> list[str]:
    """Remove what a kube mesh recorded in `state_dir` and left behind; returns what was removed."""
    try:
        record = json.loads((state_dir / RECORD).read_text())
    except (OSError, ValueError):
        return []
    removed: list[str] = []
    prefix = f"mc-{int(record['index'])}-"
    for ns in (n for n in _netns_names() if n.startswith(prefix)):
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30).stdout.split()
        for pid in pids:  # only our pods' processes live in our pods' namespaces
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
        removed.append(f"netns {ns}" + (f" ({len(pids)} processes)" if pids else ""))
    bridge = record["bridge"]
    if subprocess.run(["ip", "link", "del", bridge], capture_output=True, timeout=30).returncode == 0:
        removed.append(f"bridge {bridge}")
    if record.get("pods_dir") and Path(record["pods_dir"]).exists():
        shutil.rmtree(record["pods_dir"], ignore_errors=True)
        removed.append(f"pods dir {record['pods_dir']}")
    (state_dir / RECORD).unlink(missing_ok=True)
    return removed


class _Unhealed:
    """The supervisor's healer interface without restarts: a kube mesh's components are not
    restarted by `meshcache up --kube` (status shows what exited)."""

    def __init__(self) -> None:
        self.records: dict[str, ComponentRecord] = _Records()

    def start_probes(self) -> None:
        pass

    def stop_probes(self) -> None:
        pass

    def tick(self) -> bool:
        return False


class _Records(dict):  # type: ignore[type-arg]
    def __missing__(self, key: str) -> ComponentRecord:
        self[key] = ComponentRecord()
        return self[key]


@dataclass
class KubeUpConfig:
    state_dir: Path
    module: Path | None = None
    replicas: int | None = None  # the engine Deployment's pods; None: as rendered


def scale_engine(objects: list[Obj], replicas: int) -> list[Obj]:
    """The rendered objects with the engine Deployment at `replicas` pods (what `kubectl scale`
    would set, applied with the rest so the field stays the rendering's field manager's)."""
    out = copy.deepcopy(objects)
    engines = [o for o in out if o["kind"] == "Deployment" and o["metadata"].get("labels", {}).get("app")
               == render.ENGINE_APP]
    if len(engines) != 1:
        raise MeshError(f"--replicas scales meshcache's engine Deployment; the rendering has {len(engines)}")
    engines[0]["spec"]["replicas"] = replicas
    return out


@dataclass
class KubeUp:
    config: KubeUpConfig
    log: Callable[[str], None] = print
    mesh: KubeMesh | None = None
    client_ip: str = ""
    service_ip: str = ""
    procs: list[procs.Proc] = field(default_factory=list)
    certs: None = None  # workload certificates are istiod's, rotated by the agents

    def _network_made(self, network: NodeNetwork) -> None:
        _write_record(self.config.state_dir, {"index": network.index, "bridge": network.bridge})
        self.log(f"node network {network.cidr} on bridge {network.bridge}")

    def start(self) -> None:
        state_dir = self.config.state_dir
        state_dir.mkdir(parents=True, exist_ok=True)
        remove_leftovers(state_dir)  # a crashed earlier run's
        kw = {"module": self.config.module} if self.config.module else {}
        self.mesh = KubeMesh(KubeMeshConfig(state_dir / "kube", kubelet=True, seed_policies=True,
                                            on_network=self._network_made, **kw))
        self.mesh.start()
        assert self.mesh.kubelet is not None and self.mesh.network is not None
        _write_record(state_dir, {"index": self.mesh.network.index, "bridge": self.mesh.network.bridge,
                                  "pods_dir": str(self.mesh.kubelet.pods_dir)})
        (state_dir / "token").write_text(self.mesh.token + "\n")
        (state_dir / "token").chmod(0o600)
        self.log("cluster, istiod, control plane and the test kubelet are up; applying istio/ with kubectl")
        if self.config.replicas is not None:
            self.mesh.objects = scale_engine(self.mesh.objects, self.config.replicas)
            self.log(f"engine Deployment at {self.config.replicas} replicas")
        self.mesh.apply_rendered()
        self._client_pod()
        self._wait_ready()

    def _client_pod(self) -> None:
        mesh = self.mesh
        assert mesh is not None and mesh.cluster is not None and mesh.kubelet is not None
        ns = mesh.config.namespace
        if mesh.cluster.get(f"/api/v1/namespaces/{ns}/serviceaccounts/{CLIENT_SA}") is None:
            mesh.cluster.kubectl("create", "serviceaccount", CLIENT_SA, "-n", ns)
        ports = f"{HTTP_PORT},{GRPC_PORT}"
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": CLIENT_POD, "namespace": ns,
                            "labels": {"app": CLIENT_POD, AFFINITY_LABEL: "true"},
                            # The relay listens on these ports of the pod's IP for the host: not
                            # captured inbound (its outbound connections are).
                            "annotations": {"traffic.sidecar.istio.io/excludeInboundPorts": ports}},
               "spec": {"serviceAccountName": CLIENT_SA,
                        "containers": [{"name": "app", "image": "meshcache.invalid/client-relay:1"}]}}
        mesh.cluster.kubectl("apply", "--server-side", "-f", "-", input=json.dumps(pod))
        service = mesh.cluster.get(f"/api/v1/namespaces/{ns}/services/{render.ENGINE_APP}")
        assert service is not None
        self.service_ip = service["spec"]["clusterIP"]
        running = self._until(lambda: self._proxy_ready(f"{ns}/{CLIENT_POD}"), "the client pod's sidecar ready")
        self.client_ip = running.net.ip
        argv = running.net.exec_argv("setpriv", f"--reuid={APP_UID}", f"--regid={APP_UID}", "--clear-groups",
                                     sys.executable, "-m", "meshcache.ctl.kube.forward",
                                     *(f"{self.client_ip}:{p}={self.service_ip}:{p}" for p in (HTTP_PORT, GRPC_PORT)))
        self.procs.append(procs.start("client-app", argv, self.config.state_dir / "logs", cwd=Path("/")))
        self.log(f"client pod {CLIENT_POD} at {self.client_ip}: its app relays to {render.ENGINE_APP} "
                 f"({self.service_ip}) through its sidecar")

    def _proxy_ready(self, key: str) -> Any:
        mesh = self.mesh
        assert mesh is not None and mesh.kubelet is not None
        running = mesh.kubelet.pods.get(key)
        return running if running is not None and running.proxy_ready else None

    def _until(self, check: Callable[[], Any], what: str) -> Any:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                got = check()
                if got:
                    return got
            time.sleep(0.5)
        errors = self.mesh.kubelet.errors[-3:] if self.mesh and self.mesh.kubelet else []
        raise MeshError(f"not {what} after {START_TIMEOUT_S:.0f} s (kubelet: {errors})")

    def _wait_ready(self) -> None:
        """Every pod Ready and the app path answering through both sidecars."""
        def app_ok() -> bool:
            r = httpx.get(f"{self.app_http}/v2/health/ready", headers={"host": render.ENGINE_APP}, timeout=5)
            return r.status_code == 200

        self._until(lambda: all(pod_ok(p) for p in self.pods()) and app_ok(),
                    "every engine pod Ready, every sidecar ready and the app path")

    @property
    def app_http(self) -> str:
        return f"http://{self.client_ip}:{HTTP_PORT}"

    def pods(self) -> list[Obj]:
        mesh = self.mesh
        assert mesh is not None and mesh.cluster is not None
        got = mesh.cluster.get(f"/api/v1/namespaces/{mesh.config.namespace}/pods") or {}
        return [pod_summary(p) for p in got.get("items", [])]

    def children(self) -> list[Obj]:
        mesh = self.mesh
        all_procs: list[procs.Proc] = []
        if mesh is not None:
            if mesh.cluster is not None:
                all_procs += mesh.cluster.procs
            all_procs += mesh.procs
            if mesh.istiod is not None:
                all_procs.append(mesh.istiod.proc)
            if mesh.kubelet is not None:
                all_procs += [p for pod in list(mesh.kubelet.pods.values()) for p in pod.procs.values()]
        all_procs += self.procs
        return [{"name": p.name, "pid": p.popen.pid, "start_time": process_start_time(p.popen.pid),
                 "log": str(p.log_path)} for p in all_procs]

    def healer(self, policy: Any, log: Callable[[str], None]) -> _Unhealed:
        return _Unhealed()

    def refresh_certificates(self, force: bool = False) -> tuple[str, ...]:
        return ()

    def endpoints(self) -> Obj:
        mesh = self.mesh
        assert mesh is not None and mesh.cluster is not None and mesh.istiod is not None
        return {
            "mode": "kube",
            "app_http": self.app_http,
            "app_grpc": f"{self.client_ip}:{GRPC_PORT}",
            "app_authority": render.ENGINE_APP,
            "kubeconfig": str(mesh.cluster.kubeconfig),
            "namespace": mesh.config.namespace,
            "client_pod": CLIENT_POD,
            "control_plane_api": mesh.control_plane_api,
            "control_plane_xds": f"{mesh.control_plane_xds} (TLS, MCP for istiod)",
            "token_file": str(self.config.state_dir / "token"),
            "istiod_debug": f"http://127.0.0.1:{mesh.istiod.ports.monitoring}/debug",
            "app_color": "",  # istio/ as rendered: one colour, no canary
            "canary_color": "",
            # The engine pods' network namespaces (their sidecars' admin is on the pod's loopback).
            "engine_netns": self._engine_netns(),
        }

    def _engine_netns(self) -> dict[str, str]:
        mesh = self.mesh
        assert mesh is not None and mesh.kubelet is not None
        ns = mesh.config.namespace
        return {f"{key.split('/', 1)[1]}.{ns}": running.net.name for key, running in list(mesh.kubelet.pods.items())
                if key.startswith(f"{ns}/{render.ENGINE_APP}-")}

    def stop(self) -> None:
        while self.procs:
            with contextlib.suppress(Exception):
                self.procs.pop().stop()
        if self.mesh is not None:
            self.mesh.stop()
        remove_leftovers(self.config.state_dir)


def check_prerequisites() -> None:
    """Root (network namespaces, iptables) and the binaries, before anything starts."""
    from meshcache.ctl.istiod.mesh import check_prerequisites as istiod_prerequisites

    from . import binary

    if os.geteuid() != 0:
        raise MeshError("up --kube runs pods in network namespaces with iptables capture: run it as root")
    istiod_prerequisites()
    try:
        for name in ("kube-apiserver", "kubectl", "etcd"):
            binary.require(name)
    except FileNotFoundError as exc:
        raise MeshError(str(exc)) from exc


ECDS_SCRIPT = ("import urllib.request,json;d=json.loads(urllib.request.urlopen('http://127.0.0.1:15000/config_dump')"
               ".read());print(json.dumps([f for c in d['configs'] if c.get('@type','').endswith('EcdsConfigDump')"
               " for f in c.get('ecds_filters',[])]))")


def wait_applied(istiod_debug: str, engine_netns: dict[str, str], version: int, timeout: float = 30.0) -> None:
    """Until every engine sidecar (proxy id -> its pod's netns) runs policy `version` and istiod
    has its ACK; the sidecar's admin is read from inside the pod (root)."""
    from meshcache.ctl.istiod.status import ECDS_TYPE_URL, policy_version, syncz

    def applied(proxy: str, netns: str) -> bool:
        out = subprocess.run(["ip", "netns", "exec", netns, sys.executable, "-c", ECDS_SCRIPT],
                             capture_output=True, text=True, timeout=10)
        if out.returncode != 0 or policy_version(json.loads(out.stdout)) < version:
            return False
        for s in syncz(istiod_debug):
            if s.get("proxy") == proxy:
                res = s.get("resources", {}).get(ECDS_TYPE_URL, {})
                return bool(res.get("acked")) and res.get("acked") == res.get("sent") and not res.get("lastError")
        return False

    deadline = time.monotonic() + timeout
    pending = dict(engine_netns)
    while pending and time.monotonic() < deadline:
        pending = {p: n for p, n in pending.items() if not applied(p, n)}
        if pending:
            time.sleep(0.2)
    if pending:
        raise TimeoutError(f"policy version {version} not applied by {', '.join(pending)} within {timeout:.0f}s")


def pod_summary(pod: Obj) -> Obj:
    """A pod as `meshcache status` shows it: name, IP, Ready, whether istio-proxy was injected."""
    status = pod.get("status", {})
    spec = pod.get("spec", {})
    names = {c["name"] for c in spec.get("initContainers", []) + spec.get("containers", [])}
    conditions = {c["type"]: c["status"] for c in status.get("conditions", [])}
    proxy = [c for c in status.get("initContainerStatuses", []) + status.get("containerStatuses", [])
             if c["name"] == "istio-proxy"]
    return {"name": pod["metadata"]["name"], "app": pod["metadata"].get("labels", {}).get("app", ""),
            "ip": status.get("podIP", ""), "phase": status.get("phase", ""),
            "ready": conditions.get("Ready") == "True", "injected": "istio-proxy" in names,
            "sidecar_ready": bool(proxy) and bool(proxy[0].get("ready"))}


def pod_ok(pod: Obj) -> bool:
    """What the kube mesh needs of a pod: every pod Ready (engines, control plane, Redis), every
    injected pod's sidecar ready. The client pod's app container stays Pending (its image is not
    run by the test kubelet: its app is forward.py, started by up.py): its sidecar must be ready."""
    if pod["injected"] and not pod["sidecar_ready"]:
        return False
    return pod["ready"] or pod["app"] == CLIENT_POD


def kube_pods(kubeconfig: str, namespace: str) -> list[Obj]:
    """The pods as the API server reports them (kubectl, as cluster-admin)."""
    from .binary import require

    out = subprocess.run([str(require("kubectl")), f"--kubeconfig={kubeconfig}", "get", "pods", "-n", namespace,
                          "-o", "json"], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise MeshError(f"kubectl get pods: {out.stderr.strip()}")
    return [pod_summary(p) for p in json.loads(out.stdout).get("items", [])]
