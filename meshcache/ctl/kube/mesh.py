"""The Kubernetes-mode mesh, rendered from istio/ (`meshcache istio render`):

    control-plane pods (+ Redis pod) <--Service proxy (node address)-- istiod (host) <--> kube-apiserver
                                         xds://<Service DNS name>       webhooks: injection, validation

The local cluster (cluster.py), the test node (kubelet.py) whose pods really run, then the
rendered control plane and Redis objects (Deployment, StatefulSet with its claim, Services, ...)
applied with `kubectl apply --server-side` next to the Secrets the operator creates (tokens, xDS
server certificate), so the control plane and Redis run as pods; once a control-plane replica is
ready, istiod from the rendered IstioOperator (istiod.py) with the rendered `xds://` Service name,
reached through that Service's proxy (services.py). Workloads are applied afterwards, through
istiod's webhooks (`apply_rendered`); `meshcache up --kube` runs it all (up.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from meshcache.contract import paths
from meshcache.contract.filter_config import DEMO_POLICIES
from meshcache.contract.paths import FILTER_WASM
from meshcache.ctl import procs
from meshcache.ctl.istio import render, xds_tls

from . import istiod as kube_istiod
from . import module_image, registry
from .cluster import LocalCluster, start_cluster
from .kubelet import TestKubelet
from .netns import NodeNetwork
from .services import ServiceProxy

Obj = dict[str, Any]
CP_NAME = "meshcache-control-plane"  # the rendered Deployment, Service, ... (istio/base/control-plane.yaml)
REDIS_NAME = "meshcache-redis"
CP_TOKENS_SECRET = "meshcache-cp-tokens"  # the Secrets the operator creates (control-plane.yaml)
CP_XDS_SECRET = "meshcache-cp-xds-tls"
CP_API_PORT = 8080  # the Service's ports
CP_XDS_PORT = 18000
CP_START_TIMEOUT_S = 180.0
NATIVE_ISTIO = "1.31"  # the first Istio whose proxy links Envoy's dynamic modules
NATIVE_ENVOY = "1.39"  # istio-proxy 1.31's Envoy


@dataclass
class KubeMeshConfig:
    work_dir: Path
    namespace: str = render.BASE_NAMESPACE
    module: Path = FILTER_WASM
    kubelet: bool = True  # the test node (kubelet.py; root): required, the control plane runs on it
    seed_policies: bool = False  # the demo policies PUT at start (the filter then has work to do)
    workload_cert_ttl: str = ""  # e.g. "40s": the lifetime the agents ask istiod's CA for (SECRET_TTL)
    # Told of the node network as soon as it exists (`meshcache up --kube` records it for `down`).
    on_network: Callable[[NodeNetwork], None] | None = None
    # "native": Istio 1.31's mesh (`render --filter native --istio-version 1.31`): the module image's
    # init container (module_image.py) and classic sidecars on the engine pods, the control plane in
    # native mode, every sidecar on Envoy 1.39 (meshConfig.defaultConfig.binaryPath), no registry.
    filter: str = "wasm"
    control_plane_replicas: int | None = None  # None: as rendered (2)


@dataclass
class KubeMesh:
    """Start with `start()` (or as a context manager), stop with `stop()`."""

    config: KubeMeshConfig
    cluster: LocalCluster | None = None
    istiod: kube_istiod.KubeIstiod | None = None
    objects: list[Obj] = field(default_factory=list)  # the rendered istio/ objects
    operator: Obj = field(default_factory=dict)  # the rendered istio-operator-mcp.yaml
    token: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    procs: list[procs.Proc] = field(default_factory=list)
    network: NodeNetwork | None = None
    kubelet: TestKubelet | None = None
    cp_service: ServiceProxy | None = None  # the control plane's Service on the node address

    def __enter__(self) -> KubeMesh:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        cfg = self.config
        if not cfg.kubelet:
            raise ValueError("a KubeMesh runs its control plane as pods of its test node: kubelet=True")
        work = cfg.work_dir
        opts = render.RenderOptions(namespace=cfg.namespace, module_path=cfg.module)
        if cfg.filter == "native":
            opts = dataclasses.replace(opts, filter_host="native", istio_version=NATIVE_ISTIO,
                                       native_image=module_image.reference())
        self.objects = render.render(opts)
        self.operator = render.render_operators(opts)[1]
        if cfg.control_plane_replicas is not None:
            for obj in self.objects:
                if obj["kind"] == "Deployment" and obj["metadata"]["name"] == CP_NAME:
                    obj["spec"]["replicas"] = cfg.control_plane_replicas
        if cfg.filter == "native":  # istio-proxy 1.31's Envoy, for every sidecar of the mesh
            default = self.operator["spec"]["meshConfig"].setdefault("defaultConfig", {})
            default["binaryPath"] = paths.envoy_binary(NATIVE_ENVOY)
        self.cluster = start_cluster(work / "cluster")
        self.network = NodeNetwork.create()
        if cfg.on_network is not None:
            cfg.on_network(self.network)
        if cfg.filter != "native":
            # The filter's registry on the node (registry.py): the agents fetch the rendered oci:// URL.
            self.procs.append(registry.start_registry(self.network.node_ip, cfg.module, work / "registry"))
        metadata = {"WASM_INSECURE_REGISTRIES": registry.HOST}
        if cfg.workload_cert_ttl:  # the agents rotate at half the lifetime (SECRET_GRACE_PERIOD_RATIO)
            metadata["SECRET_TTL"] = cfg.workload_cert_ttl
        self.kubelet = TestKubelet(self.cluster, self.network, work / "kubelet",
                                   hosts={registry.HOST: self.network.node_ip})
        self.kubelet.start()
        self._start_control_plane(work)
        self.istiod = kube_istiod.start(self.cluster, self.operator, None,
                                        (work / "xds-tls" / "ca.crt").read_text(), work / "istiod",
                                        pod_facing_host=self.network.node_ip, proxy_metadata=metadata,
                                        hosts={h: self.network.node_ip for h in self.xds_hosts()})
        if cfg.seed_policies:
            with self.api() as api:
                for prefix, spec in DEMO_POLICIES.items():
                    api.put(f"/v1/policies/{prefix}", json=spec).raise_for_status()

    def xds_hosts(self) -> list[str]:
        """The host names of the rendered IstioOperator's xds:// config sources."""
        sources = self.operator["spec"]["meshConfig"].get("configSources", [])
        return [s["address"].removeprefix("xds://").rsplit(":", 1)[0] for s in sources
                if s["address"].startswith("xds://")]

    @property
    def control_plane_api(self) -> str:
        """The control plane's Service (its http-api port) from the host."""
        assert self.network is not None
        return f"http://{self.network.node_ip}:{CP_API_PORT}"

    @property
    def control_plane_xds(self) -> str:
        assert self.network is not None
        return f"{self.network.node_ip}:{CP_XDS_PORT}"

    def api(self) -> httpx.Client:
        """The control plane's API with its write token."""
        return procs.http_client(base_url=self.control_plane_api,
                                 headers={"Authorization": f"Bearer {self.token}"}, timeout=10)

    def _start_control_plane(self, work: Path) -> None:
        """The rendered control plane and Redis objects applied with the Secrets the operator
        makes (tokens; the xDS server certificate for the Service name istiod checks); ready once
        a control-plane replica is (its readiness probe: an MCP round trip)."""
        assert self.cluster is not None and self.network is not None
        ns = self.config.namespace
        tls_dir = work / "xds-tls"
        xds_tls.issue(ns, tls_dir)
        secrets = [{"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                    "metadata": {"name": CP_TOKENS_SECRET, "namespace": ns},
                    "stringData": {"tokens": f"write:mesh:{self.token}\n"}},
                   {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
                    "metadata": {"name": CP_XDS_SECRET, "namespace": ns},
                    "stringData": {"tls.crt": (tls_dir / "tls.crt").read_text(),
                                   "tls.key": (tls_dir / "tls.key").read_text()}}]
        own = [o for o in self.objects if "istio.io" not in o["apiVersion"]
               and o["metadata"]["name"].startswith((CP_NAME, REDIS_NAME))]
        kube_istiod.apply(self.cluster, [o for o in self.objects if o["kind"] == "Namespace"])
        kube_istiod.apply(self.cluster, [*secrets, *own])
        self.cp_service = ServiceProxy(self.cluster, ns, CP_NAME, self.network.node_ip)
        self.cp_service.start()
        deadline = time.monotonic() + CP_START_TIMEOUT_S
        while self.cp_service.endpoint("tls-xds") is None:
            if time.monotonic() > deadline:
                pods = (self.cluster.get(f"/api/v1/namespaces/{ns}/pods") or {}).get("items", [])
                raise RuntimeError(f"no ready control-plane replica after {CP_START_TIMEOUT_S:.0f} s: "
                                   f"{[(p['metadata']['name'], p.get('status', {}).get('phase')) for p in pods]} "
                                   f"(kubelet: {self.kubelet.errors[-3:] if self.kubelet else []})")
            time.sleep(0.5)

    def roll_control_plane(self, objects: list[Obj]) -> None:
        """`kubectl apply` of the control-plane Deployment of another rendering (another module
        pin, another colour list), waited for as `kubectl rollout status` does: the policies stay
        in Redis, the new replicas serve the new MCP settings."""
        assert self.cluster is not None
        deployment = [o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == CP_NAME]
        kube_istiod.apply(self.cluster, deployment)
        self.cluster.kubectl("rollout", "status", f"deployment/{CP_NAME}", "-n", self.config.namespace,
                             f"--timeout={CP_START_TIMEOUT_S:.0f}s", timeout=CP_START_TIMEOUT_S + 10)

    def apply_rendered(self, objects: list[Obj] | None = None) -> None:
        """`kubectl apply --server-side` of the rendered objects (Namespace first), through
        istiod's validation webhook."""
        assert self.cluster is not None
        objs = self.objects if objects is None else objects
        kube_istiod.apply(self.cluster, [o for o in objs if o["kind"] == "Namespace"])
        kube_istiod.apply(self.cluster, [o for o in objs if o["kind"] != "Namespace"])

    def stop(self) -> None:
        """The kubelet's pods, istiod, the control plane and Redis, the cluster, the node network."""
        if self.kubelet is not None:
            with contextlib.suppress(Exception):
                self.kubelet.stop()
        if self.istiod is not None:
            with contextlib.suppress(Exception):
                self.istiod.stop()
        if self.cp_service is not None:
            self.cp_service.stop()
        while self.procs:
            with contextlib.suppress(Exception):
                self.procs.pop().stop()
        if self.cluster is not None:
            self.cluster.stop()
        if self.network is not None:
            self.network.delete()
