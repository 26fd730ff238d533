"""A local Kubernetes control plane: etcd, kube-apiserver, kube-controller-manager and
kube-scheduler as supervised children on 127.0.0.1, free ports, their own PKI (pki.py).

The API server is set up the way Istio needs it: service-account tokens signed by our key with
`istio-ca` among the accepted audiences (istiod's CA reviews third-party JWTs with that audience),
Node,RBAC authorization, admission webhooks on. `--endpoint-reconciler-type=none`: the
`kubernetes` Service would otherwise get 127.0.0.1 as its endpoint, which EndpointSlice validation
refuses (the API server then logs about it forever).

The controller manager (CONTROLLERS only) is needed for ReplicaSets and Pods from Deployments, the
`default` ServiceAccount (without it the API server refuses Pods), and namespace deletion; the scheduler
binds Pods to Nodes. There is no kubelet here: Nodes are registered by whoever runs pods.

    with local_cluster(tmp_dir) as cluster:
        cluster.kubectl("get", "ns")          # kubectl against it (cluster.kubeconfig)
        cluster.api().get("/api/v1/nodes")    # httpx, admin client certificate
"""

from __future__ import annotations

import contextlib
import functools
import ssl
import subprocess
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from meshcache.ctl import procs

from . import pki as cluster_pki
from .binary import require

SERVICE_CIDR = "10.96.0.0/16"  # ClusterIPs: allocated, never served (no kube-proxy)
SA_ISSUER = "https://kubernetes.default.svc.cluster.local"
# istio-ca: the audience istio-agent asks for (JWT_POLICY=third-party-jwt) and istiod's CA checks.
API_AUDIENCES = (SA_ISSUER, "istio-ca")
# The controllers whose work the project's pods and tests rely on, not all of them (`*`): each runs
# informers on what it manages (the resource-quota one on every kind, the CRDs' too) that cost the
# API server and the controller manager CPU for the cluster's whole life. No cloud, no node IPAM
# (the test kubelet owns its pod CIDR), no taint eviction (one node), no Jobs, DaemonSets,
# autoscalers, quotas or certificate requests (nothing here makes them).
CONTROLLERS = (
    "serviceaccount-controller", "serviceaccount-token-controller",  # `default` SA, token Secrets
    "root-ca-certificate-publisher-controller",  # kube-root-ca.crt: every pod's kube-api-access volume
    "namespace-controller", "garbage-collector-controller",  # deletion: namespaces, owned objects
    "deployment-controller", "replicaset-controller", "statefulset-controller", "disruption-controller",
    "endpointslice-controller", "endpoints-controller", "pod-garbage-collector-controller",
    "persistentvolume-binder-controller", "persistentvolume-protection-controller",
    "persistentvolumeclaim-protection-controller", "service-cidr-controller",
    # A new Node has the not-ready taint until this controller sees it Ready and lifts it.
    "node-lifecycle-controller",
)
START_TIMEOUT_S = 180.0  # the API server's first start on a loaded 2-core machine (~10-30 s idle)


@dataclass(frozen=True)
class ClusterPorts:
    apiserver: int
    etcd_client: int
    etcd_peer: int
    controller_manager: int  # its HTTPS /healthz
    scheduler: int  # its HTTPS /healthz

    @classmethod
    def free(cls) -> ClusterPorts:
        return cls(*(procs.free_port() for _ in range(5)))


@dataclass
class LocalCluster:
    dir: Path
    ports: ClusterPorts
    pki: cluster_pki.ClusterPKI
    kubeconfig: Path  # cluster-admin (O=system:masters)
    admin: cluster_pki.KeyPair
    procs: list[procs.Proc] = field(default_factory=list)
    # `get`'s one client (kept-alive connections), made on first use: a client per call cost a TLS
    # context and handshake on both sides each time, and waits call `get` many times a second.
    _client: httpx.Client | None = field(default=None, repr=False)
    _client_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.ports.apiserver}"

    @functools.cached_property
    def admin_tls(self) -> ssl.SSLContext:
        """The cluster CA and the admin certificate, loaded once (contexts are safe to share)."""
        return tls_context(self.pki.ca.cert, self.admin)

    def api(self, timeout: float | httpx.Timeout = 30.0) -> httpx.Client:
        """An HTTP client for the API server as cluster-admin (close it, or use it in `with`)."""
        return httpx.Client(base_url=self.server, verify=self.admin_tls, timeout=timeout)

    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
        """kubectl against this cluster as cluster-admin; a failure (check) raises with its stderr."""
        argv = [str(require("kubectl")), f"--kubeconfig={self.kubeconfig}",
                f"--cache-dir={self.dir / 'kubectl-cache'}", *args]
        result = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise KubectlError(f"kubectl {' '.join(args)} exited with {result.returncode}:\n{result.stderr.strip()}")
        return result

    def get(self, path: str) -> dict[str, Any] | None:
        """GET an API path as cluster-admin: the object, or None when it does not exist (404)."""
        with self._client_lock:
            if self._client is None:
                self._client = self.api()
            client = self._client
        r = client.get(path)
        if r.status_code == 404:
            return None
        r.raise_for_status()
        return r.json()  # type: ignore[no-any-return]

    def kubeconfig_for(self, name: str, user: str, groups: tuple[str, ...] = ()) -> Path:
        """A kubeconfig for another identity (client certificate CN=user, O=groups)."""
        pair = self.pki.issue(f"client-{name}", user, groups)
        return self.pki.kubeconfig(self.dir / f"{name}.kubeconfig", self.server, user, pair)

    def stop(self) -> None:
        with self._client_lock:
            if self._client is not None:
                self._client.close()
                self._client = None
        for p in reversed(self.procs):
            with contextlib.suppress(Exception):
                p.stop()
        self.procs.clear()


class KubectlError(RuntimeError):
    pass


def tls_context(ca: Path, client: cluster_pki.KeyPair | None = None) -> ssl.SSLContext:
    """Trusting the cluster CA only, presenting `client`'s certificate if given."""
    context = ssl.create_default_context(cafile=str(ca))
    if client is not None:
        context.load_cert_chain(str(client.cert), str(client.key))
    return context


def _https_ok(url: str, context: ssl.SSLContext) -> bool:
    """One readiness check (polled 20 times a second: the TLS context is made once by the caller)."""
    with httpx.Client(verify=context, timeout=2.0) as c:
        return c.get(url).status_code == 200


def etcd_argv(data_dir: Path, ports: ClusterPorts) -> list[str]:
    peer = f"http://127.0.0.1:{ports.etcd_peer}"
    client = f"http://127.0.0.1:{ports.etcd_client}"
    return [
        str(require("etcd")), "--name=meshcache", f"--data-dir={data_dir}",
        f"--listen-client-urls={client}", f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}", f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=meshcache={peer}", "--initial-cluster-state=new",
        "--listen-metrics-urls=",
        # A throwaway test store: no fsync per write (the API server writes a lot at start).
        "--unsafe-no-fsync", "--log-level=warn",
    ]


def apiserver_argv(pki: cluster_pki.ClusterPKI, ports: ClusterPorts) -> list[str]:
    return [
        str(require("kube-apiserver")),
        f"--etcd-servers=http://127.0.0.1:{ports.etcd_client}",
        "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", f"--secure-port={ports.apiserver}",
        f"--tls-cert-file={pki.apiserver.cert}", f"--tls-private-key-file={pki.apiserver.key}",
        f"--client-ca-file={pki.ca.cert}",
        f"--service-account-issuer={SA_ISSUER}",
        f"--service-account-key-file={pki.sa_pub}", f"--service-account-signing-key-file={pki.sa_key}",
        f"--api-audiences={','.join(API_AUDIENCES)}",
        "--authorization-mode=Node,RBAC",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        "--endpoint-reconciler-type=none",
        # istio-init (traffic capture) asks for NET_ADMIN/NET_RAW; the test kubelet runs it.
        "--allow-privileged=true",
        "--profiling=false",
    ]


def _component_argv(binary: str, kubeconfig: Path, serving: cluster_pki.KeyPair, port: int,
                    extra: Sequence[str]) -> list[str]:
    return [
        str(require(binary)), f"--kubeconfig={kubeconfig}",
        # Its delegated authn/authz (for /metrics) use the same identity; /healthz is always allowed.
        f"--authentication-kubeconfig={kubeconfig}", f"--authorization-kubeconfig={kubeconfig}",
        "--bind-address=127.0.0.1", f"--secure-port={port}",
        f"--tls-cert-file={serving.cert}", f"--tls-private-key-file={serving.key}",
        "--leader-elect=false",  # one instance
        *extra,
    ]


def start_cluster(directory: Path, controllers: bool = True, scheduler: bool = True,
                  timeout: float = START_TIMEOUT_S) -> LocalCluster:
    """etcd and the API server (ready = /readyz 200), then the controller manager (ready = the
    `default` ServiceAccount exists) and the scheduler (ready = /healthz 200). On any failure
    everything started is stopped before the error propagates."""
    directory.mkdir(parents=True, exist_ok=True)
    logs = directory / "logs"
    ports = ClusterPorts.free()
    pki = cluster_pki.create(directory / "pki")
    admin = pki.issue("client-admin", "meshcache-admin", ("system:masters",))
    kubeconfig = pki.kubeconfig(directory / "admin.kubeconfig", f"https://127.0.0.1:{ports.apiserver}",
                                "meshcache-admin", admin)
    cluster = LocalCluster(directory, ports, pki, kubeconfig, admin)
    try:
        cluster.procs.append(procs.start_ready(
            "etcd", etcd_argv(directory / "etcd", ports), logs,
            [(procs.http_ok(f"http://127.0.0.1:{ports.etcd_client}/health"), timeout, "healthy")]))
        cluster.procs.append(procs.start_ready(
            "kube-apiserver", apiserver_argv(pki, ports), logs,
            [(lambda: _https_ok(f"{cluster.server}/readyz", cluster.admin_tls), timeout, "ready (/readyz)")]))
        started: list[tuple[procs.Proc, Any, str]] = []
        if controllers:
            kcm_kubeconfig = cluster.kubeconfig_for("kube-controller-manager", "system:kube-controller-manager")
            serving = pki.issue("kube-controller-manager", "kube-controller-manager", ip_addresses=("127.0.0.1",))
            proc = procs.start("kube-controller-manager", _component_argv(
                "kube-controller-manager", kcm_kubeconfig, serving, ports.controller_manager,
                [f"--service-account-private-key-file={pki.sa_key}", f"--root-ca-file={pki.ca.cert}",
                 "--use-service-account-credentials=true",
                 f"--controllers={','.join(CONTROLLERS)}"]), logs)
            cluster.procs.append(proc)
            started.append((proc, lambda: cluster.get("/api/v1/namespaces/default/serviceaccounts/default"),
                            "creating the default ServiceAccount"))
        if scheduler:
            sched_kubeconfig = cluster.kubeconfig_for("kube-scheduler", "system:kube-scheduler")
            serving = pki.issue("kube-scheduler", "kube-scheduler", ip_addresses=("127.0.0.1",))
            proc = procs.start("kube-scheduler", _component_argv(
                "kube-scheduler", sched_kubeconfig, serving, ports.scheduler, []), logs)
            cluster.procs.append(proc)
            ca_only = tls_context(pki.ca.cert)
            started.append((proc, lambda: _https_ok(f"https://127.0.0.1:{ports.scheduler}/healthz", ca_only),
                            "healthy (/healthz)"))
        for proc, check, what in started:
            procs.wait_until(proc, check, timeout=timeout, what=what)
    except BaseException:
        cluster.stop()
        raise
    return cluster


@contextlib.contextmanager
def local_cluster(directory: Path, controllers: bool = True, scheduler: bool = True) -> Iterator[LocalCluster]:
    """start_cluster, stopped (every process) on exit."""
    cluster = start_cluster(directory, controllers=controllers, scheduler=scheduler)
    try:
        yield cluster
    finally:
        cluster.stop()
