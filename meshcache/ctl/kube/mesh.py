"""The Kubernetes-mode mesh's control side, as child processes on loopback:

    meshcache control plane (Redis; MCP over TLS) --xds://--> istiod <--> kube-apiserver (LocalCluster)
                                                              webhooks: injection, validation

rendered from istio/ (`meshcache istio render`): the control plane runs with the rendered
Deployment's MCP settings, istiod from the rendered IstioOperator (istiod.py). Workloads are
applied with `kubectl apply --server-side` (`apply_rendered`); pods that really run come from the
test kubelet (kubelet.py); `meshcache up --kube` runs it all (up.py).
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from meshcache.contract.filter_config import DEMO_POLICIES
from meshcache.contract.paths import FILTER_WASM
from meshcache.ctl import launchers, procs
from meshcache.ctl.istio import render, xds_tls

from . import istiod as kube_istiod
from . import registry
from .cluster import LocalCluster, start_cluster
from .kubelet import TestKubelet
from .netns import NodeNetwork

Obj = dict[str, Any]


@dataclass
class KubeMeshConfig:
    work_dir: Path
    namespace: str = render.BASE_NAMESPACE
    module: Path = FILTER_WASM
    kubelet: bool = False  # a test node whose pods run Istio's containers (kubelet.py; root)
    seed_policies: bool = False  # the demo policies PUT at start (the filter then has work to do)
    workload_cert_ttl: str = ""  # e.g. "40s": the lifetime the agents ask istiod's CA for (SECRET_TTL)
    # Told of the node network as soon as it exists (`meshcache up --kube` records it for `down`).
    on_network: Callable[[NodeNetwork], None] | None = None


@dataclass
class KubeMesh:
    """Start with `start()` (or as a context manager), stop with `stop()`."""

    config: KubeMeshConfig
    cluster: LocalCluster | None = None
    istiod: kube_istiod.KubeIstiod | None = None
    objects: list[Obj] = field(default_factory=list)  # the rendered istio/ objects
    operator: Obj = field(default_factory=dict)  # the rendered istio-operator-mcp.yaml
    token: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    cp_http: int = 0
    cp_xds: int = 0
    procs: list[procs.Proc] = field(default_factory=list)
    network: NodeNetwork | None = None
    kubelet: TestKubelet | None = None
    _cp_argv: list[str] = field(default_factory=list)

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
        work = cfg.work_dir
        opts = render.RenderOptions(namespace=cfg.namespace, module_path=cfg.module)
        self.objects = render.render(opts)
        self.operator = render.render_operators(opts)[1]
        self.cluster = start_cluster(work / "cluster")
        self._start_control_plane(work)
        metadata: dict[str, str] = {}
        hosts: dict[str, str] = {}
        if cfg.kubelet:
            self.network = NodeNetwork.create()
            if cfg.on_network is not None:
                cfg.on_network(self.network)
            # The filter's registry on the node (registry.py): the agents fetch the rendered oci:// URL.
            self.procs.append(registry.start_registry(self.network.node_ip, cfg.module, work / "registry"))
            metadata["WASM_INSECURE_REGISTRIES"] = registry.HOST
            hosts[registry.HOST] = self.network.node_ip
        if cfg.workload_cert_ttl:  # the agents rotate at half the lifetime (SECRET_GRACE_PERIOD_RATIO)
            metadata["SECRET_TTL"] = cfg.workload_cert_ttl
        self.istiod = kube_istiod.start(self.cluster, self.operator, f"127.0.0.1:{self.cp_xds}",
                                        (work / "xds-tls" / "ca.crt").read_text(), work / "istiod",
                                        pod_facing_host=self.network.node_ip if self.network else None,
                                        proxy_metadata=metadata)
        if self.network is not None:
            self.kubelet = TestKubelet(self.cluster, self.network, work / "kubelet", hosts=hosts)
            self.kubelet.start()
        if cfg.seed_policies:
            with self.api() as api:
                for prefix, spec in DEMO_POLICIES.items():
                    api.put(f"/v1/policies/{prefix}", json=spec).raise_for_status()

    def api(self) -> httpx.Client:
        """The control plane's API with its write token."""
        return procs.http_client(base_url=f"http://127.0.0.1:{self.cp_http}",
                                 headers={"Authorization": f"Bearer {self.token}"}, timeout=10)

    def _start_control_plane(self, work: Path) -> None:
        """The control plane as the rendered Deployment runs it (its MCP settings unchanged),
        with its xDS server certificate for the Service name istiod checks."""
        tls_dir = work / "xds-tls"
        xds_tls.issue(self.config.namespace, tls_dir)
        redis_port = procs.free_port()
        self.procs.append(launchers.start_redis(work / "redis", port=redis_port)[0])
        self.cp_http, self.cp_xds = procs.free_port(), procs.free_port()
        self._cp_argv = launchers.control_plane_argv(redis_port, self.cp_http, self.cp_xds, "--host", "127.0.0.1",
                                                     "--instance-id", "meshcache-kube-local",
                                                     "--xds-tls-cert", str(tls_dir / "tls.crt"),
                                                     "--xds-tls-key", str(tls_dir / "tls.key"))
        self.procs.append(self._control_plane(self.objects))

    def _control_plane(self, objects: list[Obj]) -> procs.Proc:
        env = {k: v for k, v in render.control_plane_env(objects).items() if k.startswith("MESHCACHE_CP_ISTIO_")}
        env |= {"MESHCACHE_CP_TOKENS": f"write:mesh:{self.token}", "MESHCACHE_CP_RESYNC_INTERVAL_S": "0.5"}
        return launchers.start_control_plane(self._cp_argv, env, self.config.work_dir / "logs", self.cp_http,
                                             self.cp_xds)

    def roll_control_plane(self, objects: list[Obj]) -> None:
        """What `kubectl apply` of a changed control-plane Deployment rolls out in a cluster: the
        control plane again (same ports, Redis and token: the policies stay) with the MCP settings
        of the rendered `objects` (another module pin, another colour list)."""
        index = next(i for i, p in enumerate(self.procs) if p.name == "control-plane")
        self.procs[index].stop()
        self.procs[index] = self._control_plane(objects)

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
        while self.procs:
            with contextlib.suppress(Exception):
                self.procs.pop().stop()
        if self.cluster is not None:
            self.cluster.stop()
        if self.network is not None:
            self.network.delete()
