"""The mesh with a real istiod in the middle, as child processes on loopback:

    control plane (API + MCP over TLS) --xds://--> istiod <--fs:// translated istio/ objects
                                                     | ADS (plaintext port)
        client pod's sidecar --mTLS (ISTIO_MUTUAL)--> engine pods' sidecars (meshcache filter) --> engines

Rendered from istio/ (`meshcache istio render`: main colour, canary colour as a live colour),
translated for istiod (translate.py), sidecars bootstrapped like istio-agent's (sidecar.py) with
certificates from the mesh CA over SDS. Used by tests/istiod, `meshcache up --istiod` and
`meshcache demo --istiod`.

Addresses: every pod gets its own loopback IP in a random 127.X.Y.0/24 (so two meshes on one
machine never share an address, and pods can bind the Service ports 8000/8001 as in a cluster).
The app sends to the client pod's IP: its sidecar's egress listeners are bound there
(translate.py, "No iptables").
"""

from __future__ import annotations

import contextlib
import hashlib
import random
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from meshcache.contract.extensions import AFFINITY_LABEL, GRPC_PORT, HTTP_PORT
from meshcache.contract.filter_config import DEMO_POLICIES
from meshcache.contract.paths import FILTER_WASM, envoy_binary, filter_native
from meshcache.ctl import launchers, procs
from meshcache.ctl.istio import render, xds_tls
from meshcache.ctl.mesh.errors import MeshError
from meshcache.ctl.mesh.healing import Healer, Liveness, RestartPolicy
from meshcache.ctl.mesh.state import process_start_time
from meshcache.ctl.pki import CertificateAuthority, spiffe_id, write_private

from . import status, translate
from .binary import IstiodMissing, require
from .server import Istiod, IstiodPorts, start_istiod, write_mesh_config
from .sidecar import Sidecar, proxy_metadata_of, start_sidecar
from .translate import Pod

CLIENT_APP = "meshcache-client"
CLIENT_SA = "meshcache-client"
CANARY_SERVE_VERSIONS = {"mlp-classifier": "1"}  # as the local mesh's canary: visibly different answers
NATIVE_ENVOY = "1.39"  # the Envoy of istio-proxy 1.31, the first Istio that links dynamic modules


@dataclass
class IstiodMeshConfig:
    work_dir: Path
    namespace: str = render.BASE_NAMESPACE
    color: str = "green"  # the default route's colour
    canary_color: str = "blue"  # a second live colour (its own engine, `x-traffic-color: blue`); "" = none
    replicas: int = 1  # engine pods of the main colour
    mode: str = "full"
    affinity: bool = True  # replicas > 1: the client pod carries meshcache.io/cache-affinity
    policies: dict[str, dict[str, Any]] = field(default_factory=lambda: dict(DEMO_POLICIES))
    seed_policies: bool = True
    module: Path = FILTER_WASM
    # The cache's host in the sidecars: wasm, or native = the Envoy dynamic module, as under Istio
    # 1.31: every sidecar runs Envoy 1.39 (istio-proxy 1.31's) and the module's 1.39 build, from
    # the native mode's EnvoyFilters (docs/istio.md, "The native host under Istio 1.31").
    filter: str = "wasm"

    @property
    def envoy(self) -> str:
        return NATIVE_ENVOY if self.filter == "native" else "1.40"

    def __post_init__(self) -> None:
        if self.filter not in ("wasm", "native"):
            raise ValueError(f"filter {self.filter!r}: wasm or native")
        if self.filter == "native" and self.mode != "full":
            raise ValueError(f"filter native replaces the full mode's Wasm filter, not the {self.mode} mode's")


@dataclass
class Engine:
    pod: Pod
    engine: launchers.Engine
    sidecar: Sidecar | None = None


def check_prerequisites(filter_host: str = "wasm") -> None:
    """Binaries and the built filter, before anything starts (every port is picked free)."""
    try:
        envoy_binary(NATIVE_ENVOY if filter_host == "native" else "1.40")
        require("pilot-discovery")
    except FileNotFoundError as exc:
        raise MeshError(str(exc)) from exc
    if not shutil.which("redis-server"):
        raise MeshError("redis-server not found on PATH: install the Debian package redis-server (make setup)")
    if not FILTER_WASM.exists():
        raise MeshError(f"{FILTER_WASM} is missing: build the filter (make filter)")
    if filter_host == "native" and not filter_native(NATIVE_ENVOY).exists():
        raise MeshError(f"{filter_native(NATIVE_ENVOY)} is missing: build the filter (make filter)")


class IstiodMesh:
    """Start with `start()` (or as a context manager), stop with `stop()`. Every child process is
    started through `_run(name, starter)`, so `restart(name)` (tests, the supervisor's healing)
    starts it again on the same ports and config."""

    def __init__(self, config: IstiodMeshConfig, log: Callable[[str], None] = print) -> None:
        self.config = config
        self.log = log
        self.work = config.work_dir
        self.log_dir = self.work / "logs"
        self.token = secrets.token_urlsafe(24)
        base = f"127.{random.randint(1, 254)}.{random.randint(1, 254)}"
        self._ips = (f"{base}.{k}" for k in range(1, 255))
        self.procs: list[procs.Proc] = []
        self._starters: dict[str, Callable[[], procs.Proc]] = {}
        self.istiod: Istiod | None = None
        self.engines: list[Engine] = []
        self.canary: Engine | None = None
        self.client_pod: Pod | None = None
        self.client: Sidecar | None = None
        self.cp_http = self.cp_xds = self.redis_port = 0
        self.objects: list[dict[str, Any]] = []
        self.fs_dir = self.work / "istio-fs"
        self.certs = None  # the supervisor's certificate report: workload certificates live 24 h here
        self.ca: CertificateAuthority | None = None  # the mesh CA the sidecars' SDS serves from
        self._deployments: dict[str, dict[str, Any]] = {}  # pod name -> its rendered Deployment
        self._admin_ports: dict[str, int] = {}  # pod name -> its sidecar's Envoy admin port
        self._socket_dir: Path | None = None  # the SDS sockets (a short path, made at start)

    # ---- start -----------------------------------------------------------------------------

    def __enter__(self) -> IstiodMesh:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self, name: str, starter: Callable[[], procs.Proc]) -> procs.Proc:
        proc = starter()
        self.procs.append(proc)
        self._starters[name] = starter
        return proc

    def restart(self, name: str) -> procs.Proc:
        """Start component `name` again (same ports and config) in its place."""
        index = next(i for i, p in enumerate(self.procs) if p.name == name)
        with contextlib.suppress(Exception):
            self.procs[index].stop(timeout=5)
        proc = self._starters[name]()
        self.procs[index] = proc
        return proc

    def start(self) -> None:
        try:
            self._start()
        except (procs.StartError, IstiodMissing) as exc:
            raise MeshError(str(exc)) from exc

    def _start(self) -> None:
        cfg = self.config
        t0 = time.monotonic()
        self.objects, operator = self._render()
        ca = self.ca = CertificateAuthority.create(name="meshcache mesh CA (istiod)")
        self.work.mkdir(parents=True, exist_ok=True)
        self._socket_dir = Path(tempfile.mkdtemp(prefix="meshcache-sds-"))
        write_private(self.work / "token", (self.token + "\n").encode())
        self.redis_port = procs.free_port()
        self._run("redis", lambda: launchers.start_redis(self.work / "redis", port=self.redis_port)[0])
        models = self.work / "models"
        main_repo = launchers.init_demo_models(models / "main", if_stale=True)
        canary_repo = (launchers.init_demo_models(models / "canary", if_stale=True,
                                                  serve_versions=CANARY_SERVE_VERSIONS)
                       if cfg.canary_color else None)
        # Engines first: their pods' Sidecar resources name the ports they listen on.
        self.log("starting the engines ...")
        main_dep = self._deployment(self.objects, cfg.color)
        for k in range(1, cfg.replicas + 1):
            self.engines.append(self._engine(main_dep, main_repo, f"{main_dep['metadata']['name']}-{k}"))
        if canary_repo is not None:
            canary_dep = self._deployment(self._render_color(cfg.canary_color), cfg.canary_color)
            self.canary = self._engine(canary_dep, canary_repo, f"{canary_dep['metadata']['name']}-1")
        # istiod's ports first: the control plane reads its syncz (the sidecars' ACKs, status page).
        ports = IstiodPorts.free()
        self.log("starting the control plane (MCP for istiod over TLS) ...")
        self._start_control_plane(ports)
        labels = {"app": CLIENT_APP}
        if cfg.replicas > 1 and cfg.affinity:
            labels[AFFINITY_LABEL] = "true"
        self.client_pod = Pod(name=f"{CLIENT_APP}-1", namespace=cfg.namespace, ip=next(self._ips), labels=labels,
                              service_account=CLIENT_SA, container_ports={}, caller=True)
        translate.write(translate.translate(self.objects, self.pods()), self.fs_dir)
        mesh = translate.mesh_config(operator, self.fs_dir, self.cp_xds, (self.work / "xds-tls" / "ca.crt").read_text())
        mesh_config_path = write_mesh_config(mesh, self.work / "mesh.yaml")
        t1 = time.monotonic()
        self.log("starting istiod (pilot-discovery, no Kubernetes) ...")

        def start_istiod_proc() -> procs.Proc:
            self.istiod = start_istiod(mesh_config_path, self.log_dir, ports)
            return self.istiod.proc

        self._run("istiod", start_istiod_proc)
        self.log(f"istiod ready (every config source synced) in {time.monotonic() - t1:.1f}s")
        self.log("starting the sidecars (config from istiod, certificates over SDS) ...")
        for e in [*self.engines, *([self.canary] if self.canary else [])]:
            e.sidecar = self._sidecar(e.pod, ca, proxy_metadata_of(self._deployments[e.pod.name]))
        self.client = self._sidecar(self.client_pod, ca, {})
        if cfg.seed_policies:
            version = 0
            with self.api() as api:
                if int(api.get("/v1/policies").raise_for_status().json()["version"]) == 0:
                    for prefix, spec in cfg.policies.items():
                        version = int(api.put(f"/v1/policies/{prefix}", json=spec).raise_for_status().json()["version"])
            self.wait_synced(version)
        self.log(f"mesh up in {time.monotonic() - t0:.1f}s")

    def _render(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        cfg = self.config
        also = (cfg.canary_color,) if cfg.canary_color else ()
        source = render.ISTIO_DIR / "overlays" / "basic" if cfg.mode == "basic" else render.BASE_DIR
        opts = render.RenderOptions(namespace=cfg.namespace, color=cfg.color, also_colors=also,
                                    module_path=cfg.module, source=source)
        return render.render(opts), render.render_operators(opts)[1]

    def _render_color(self, color: str) -> list[dict[str, Any]]:
        """The colour's own Deployment, as it was rendered when that colour was rolled out."""
        cfg = self.config
        return render.render(render.RenderOptions(namespace=cfg.namespace, color=color, module_path=cfg.module))

    @staticmethod
    def _deployment(objects: list[dict[str, Any]], color: str) -> dict[str, Any]:
        return next(o for o in objects if o["kind"] == "Deployment"
                    and o["metadata"].get("labels", {}).get("app") == render.ENGINE_APP
                    and o["metadata"]["labels"].get("color") == color)

    def _engine(self, deployment: dict[str, Any], repo: Path, name: str) -> Engine:
        ports = (procs.free_port(), procs.free_port(), procs.free_port())
        holder: list[launchers.Engine] = []

        def start() -> procs.Proc:
            engine = launchers.start_engine(repo, self.log_dir, name=f"engine-{name}", ports=ports)
            holder[:] = [engine]
            for e in self.engines + ([self.canary] if self.canary else []):
                if e.pod.name == name:
                    e.engine = engine
            return engine.proc

        self._run(f"engine-{name}", start)
        metrics = next(p["containerPort"] for c in deployment["spec"]["template"]["spec"]["containers"]
                       for p in c.get("ports", []) if p.get("name") == "metrics")
        pod = translate.pod_from_template(deployment, name, next(self._ips),
                                          app_ports={HTTP_PORT: ports[0], GRPC_PORT: ports[1], metrics: ports[2]})
        self._deployments[name] = deployment
        self._admin_ports[name] = procs.free_port()
        return Engine(pod, holder[0])

    def _sidecar(self, pod: Pod, ca: CertificateAuthority, proxy_metadata: dict[str, str]) -> Sidecar:
        assert self.istiod is not None
        work = self.work / "pods" / pod.name
        identity = ca.issue(spiffe_id(pod.namespace, pod.service_account), work / "certs", "workload")
        # Unix socket paths are limited to 107 bytes: the SDS sockets live in a short directory.
        assert self._socket_dir is not None
        socket = self._socket_dir / f"{len(self._starters)}.sock"
        sc = start_sidecar(pod, identity, istiod_port=self.istiod.ports.grpc, work_dir=work, log_dir=self.log_dir,
                           socket=socket, proxy_metadata=proxy_metadata, admin_port=self._admin_ports.get(pod.name),
                           envoy=self.config.envoy)
        self.procs += [sc.sds, sc.envoy]

        def start_sds() -> procs.Proc:
            sc.sds = sc.start_sds()
            return sc.sds

        def start_envoy() -> procs.Proc:
            sc.restart_envoy()
            return sc.envoy

        self._starters[sc.sds.name] = start_sds
        self._starters[sc.envoy.name] = start_envoy
        return sc

    def _start_control_plane(self, istiod: IstiodPorts) -> None:
        cfg = self.config
        tls_dir = self.work / "xds-tls"
        xds_tls.issue(cfg.namespace, tls_dir)
        env_of_deployment = render.control_plane_env(self.objects)
        self.cp_http, self.cp_xds = procs.free_port(), procs.free_port()
        argv = launchers.control_plane_argv(self.redis_port, self.cp_http, self.cp_xds, "--host", "127.0.0.1",
                                           "--instance-id", "meshcache-istiod-local",
                                           # the last good snapshot, served after a restart without Redis
                                           "--state-dir", str(self.work / "control-plane"),
                                           "--xds-tls-cert", str(tls_dir / "tls.crt"),
                                           "--xds-tls-key", str(tls_dir / "tls.key"),
                                           "--proxy-stats", ",".join(f"{n}={u}" for n, u in self._stats_urls()),
                                           "--istiod-debug", f"http://127.0.0.1:{istiod.monitoring}/debug",
                                           # policy-prefix typo warnings: the engines' model index
                                           "--engine-index", ",".join(e.engine.http_url for e in self._all_engines()))
        # The rendered Deployment's MCP settings; the module as a local file (no registry, no
        # istio-agent to fetch oci://: docs/istio.md, "Running against a real istiod").
        env = {k: v for k, v in env_of_deployment.items() if k.startswith("MESHCACHE_CP_ISTIO_")}
        env |= {"MESHCACHE_CP_ISTIO_NAMESPACE": cfg.namespace,
                "MESHCACHE_CP_ISTIO_WASM_URL": f"file://{cfg.module}",
                "MESHCACHE_CP_ISTIO_WASM_SHA256": hashlib.sha256(cfg.module.read_bytes()).hexdigest(),
                "MESHCACHE_CP_TOKENS": f"write:mesh:{self.token}",
                "MESHCACHE_CP_RESYNC_INTERVAL_S": "0.5"}
        if cfg.filter == "native":  # the module's 1.39 build, a local file as the Wasm module is
            env |= {"MESHCACHE_CP_ISTIO_MODE": "native",
                    "MESHCACHE_CP_ISTIO_NATIVE_MODULE": str(filter_native(NATIVE_ENVOY))}
        self._run("control-plane", lambda: launchers.start_control_plane(argv, env, self.log_dir, self.cp_http,
                                                                         self.cp_xds))

    def _stats_urls(self) -> list[tuple[str, str]]:
        """Where the control plane's status page reads the engine sidecars' counters (their admin
        ports are picked with the engines, before the control plane starts), under istiod's proxy
        ids: the rows of istiod's syncz."""
        return [(e.pod.proxy_id, f"http://127.0.0.1:{self._admin_ports[e.pod.name]}/stats/prometheus")
                for e in self._all_engines()]

    def _all_engines(self) -> list[Engine]:
        return [*self.engines, *([self.canary] if self.canary else [])]

    # ---- use -------------------------------------------------------------------------------

    def proc(self, name: str) -> procs.Proc:
        return next(p for p in self.procs if p.name == name)

    def pods(self) -> list[Pod]:
        out = [e.pod for e in self.engines]
        if self.canary:
            out.append(self.canary.pod)
        if self.client_pod:
            out.append(self.client_pod)
        return out

    def api(self) -> httpx.Client:
        return procs.http_client(base_url=f"http://127.0.0.1:{self.cp_http}",
                                 headers={"Authorization": f"Bearer {self.token}"}, timeout=10)

    @property
    def app_http(self) -> str:
        """Where the app sends REST: the client pod's sidecar (egress bound on its IP)."""
        assert self.client_pod is not None
        return f"http://{self.client_pod.ip}:{HTTP_PORT}"

    @property
    def app_grpc(self) -> str:
        assert self.client_pod is not None
        return f"{self.client_pod.ip}:{GRPC_PORT}"

    @property
    def service_authority(self) -> str:
        """The Service name the app calls (Host / :authority picks the route in its sidecar)."""
        return render.ENGINE_APP

    def server_sidecars(self) -> list[Sidecar]:
        return [e.sidecar for e in [*self.engines, *([self.canary] if self.canary else [])] if e.sidecar]

    def sidecars(self) -> list[Sidecar]:
        return [*self.server_sidecars(), *([self.client] if self.client else [])]

    def server_admins(self) -> dict[str, str]:
        """Engine sidecars: proxy id -> admin URL."""
        return {sc.pod.proxy_id: sc.admin for sc in self.server_sidecars()}

    def wait_synced(self, version: int, timeout: float = 30.0) -> None:
        """Until every engine sidecar runs policy snapshot `version` (or later), from istiod over
        ECDS, and istiod has the ACK."""
        assert self.istiod is not None
        try:
            status.wait_applied(self.istiod.debug_url, self.server_admins(), version, timeout)
        except TimeoutError as exc:
            raise MeshError(str(exc)) from exc

    # ---- for `meshcache up --istiod` (the supervisor) ------------------------------------------

    def children(self) -> list[dict[str, Any]]:
        return [{"name": p.name, "pid": p.popen.pid, "start_time": process_start_time(p.popen.pid),
                 "log": str(p.log_path)} for p in self.procs]

    def healer(self, policy: RestartPolicy, log: Callable[[str], None]) -> Healer:
        """Restarts what exits, and the control plane when its rendered liveness probe (an ADS
        round trip through its xDS server) fails, as kubelet would: a wedged control plane must
        not keep a restarting istiod from syncing."""
        return Healer(self.procs, self.restart, {"control-plane": ("redis",)}, policy, log,
                      liveness={"control-plane": self.control_plane_liveness()})

    def control_plane_liveness(self) -> Liveness:
        return Liveness.http_get(render.control_plane_probe(self.objects), f"http://127.0.0.1:{self.cp_http}")

    def refresh_certificates(self, force: bool = False) -> tuple[str, ...]:
        return ()  # workload certificates are issued for 24 h at start; no rotation here (docs)

    def endpoints(self) -> dict[str, Any]:
        assert self.istiod is not None and self.client_pod is not None
        return {
            "mode": "istiod",
            "filter": self.config.filter,  # the cache's host in the sidecars (native: Envoy 1.39)
            "app_http": self.app_http,
            "app_grpc": self.app_grpc,
            "app_authority": self.service_authority,
            "app_color": self.config.color,
            "canary_color": self.config.canary_color,
            "control_plane_api": f"http://127.0.0.1:{self.cp_http}",
            "control_plane_xds": f"127.0.0.1:{self.cp_xds} (TLS, MCP for istiod)",
            "token_file": str(self.work / "token"),
            "istiod_debug": f"http://127.0.0.1:{self.istiod.ports.monitoring}/debug",
            "istiod_xds": f"127.0.0.1:{self.istiod.ports.grpc}",
            "engine_metrics": {e.pod.name: e.engine.metrics_url
                               for e in self._all_engines()},
            "sidecars": {sc.pod.proxy_id: {"admin": sc.admin, "ip": sc.pod.ip} for sc in self.sidecars()},
        }

    def stop(self) -> None:
        """Reverse start order: sidecars first, istiod, engines, the control plane, Redis."""
        while self.procs:
            p = self.procs.pop()
            with contextlib.suppress(Exception):
                p.stop()
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)


def ecds_version(sidecar: Sidecar) -> int:
    return status.ecds_version(sidecar.admin)


def ecds_filters(sidecar: Sidecar) -> list[dict[str, Any]]:
    return status.ecds_filters(sidecar.admin)
