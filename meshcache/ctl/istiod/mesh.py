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
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from meshcache.contract.extensions import AFFINITY_LABEL, GRPC_PORT, HTTP_PORT
from meshcache.contract.filter_config import DEMO_POLICIES
from meshcache.contract.paths import FILTER_WASM
from meshcache.contract.wasm_filter import FILTER_NAME
from meshcache.ctl import launchers, procs
from meshcache.ctl.istio import render, xds_tls
from meshcache.ctl.pki import CertificateAuthority, spiffe_id

from . import translate
from .server import Istiod, IstiodPorts, start_istiod, write_mesh_config
from .sidecar import Sidecar, proxy_metadata_of, start_sidecar
from .translate import Pod

TRAFFIC_EXTENSION_ECDS_PREFIX = "extensions.istio.io/trafficextension/"
ECDS_TYPE_URL = "type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig"
CLIENT_APP = "meshcache-client"
CLIENT_SA = "meshcache-client"
CANARY_SERVE_VERSIONS = {"mlp-classifier": "1"}  # as the local mesh's canary: visibly different answers


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


@dataclass
class Engine:
    pod: Pod
    engine: launchers.Engine
    sidecar: Sidecar | None = None


class IstiodMesh:
    def __init__(self, config: IstiodMeshConfig, log: Any = print) -> None:
        self.config = config
        self.log = log
        self.work = config.work_dir
        self.log_dir = self.work / "logs"
        self.token = secrets.token_urlsafe(24)
        base = f"127.{random.randint(1, 254)}.{random.randint(1, 254)}"
        self._ips = (f"{base}.{k}" for k in range(1, 255))
        self.procs: list[procs.Proc] = []
        self.istiod: Istiod | None = None
        self.engines: list[Engine] = []
        self.canary: Engine | None = None
        self.client_pod: Pod | None = None
        self.client: Sidecar | None = None
        self.cp_proc: procs.Proc | None = None
        self.cp_http = self.cp_xds = self.redis_port = 0
        self.objects: list[dict[str, Any]] = []
        self.fs_dir = self.work / "istio-fs"
        self._deployments: dict[str, dict[str, Any]] = {}  # pod name -> its rendered Deployment

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

    def start(self) -> None:
        cfg = self.config
        t0 = time.monotonic()
        self.objects, operator = self._render()
        ca = CertificateAuthority.create(name="meshcache mesh CA (istiod)")
        self._start_redis_and_control_plane()
        models = self.work / "models"
        main_repo = launchers.init_demo_models(models / "main", if_stale=True)
        canary_repo = (launchers.init_demo_models(models / "canary", if_stale=True,
                                                  serve_versions=CANARY_SERVE_VERSIONS)
                       if cfg.canary_color else None)
        # Engines first: their pods' Sidecar resources name the ports they listen on.
        main_dep = self._deployment(self.objects, cfg.color)
        for k in range(1, cfg.replicas + 1):
            self.engines.append(self._engine(main_dep, main_repo, f"{main_dep['metadata']['name']}-{k}"))
        if canary_repo is not None:
            canary_dep = self._deployment(self._render_color(cfg.canary_color), cfg.canary_color)
            self.canary = self._engine(canary_dep, canary_repo, f"{canary_dep['metadata']['name']}-1")
        labels = {"app": CLIENT_APP}
        if cfg.replicas > 1 and cfg.affinity:
            labels[AFFINITY_LABEL] = "true"
        self.client_pod = Pod(name=f"{CLIENT_APP}-1", namespace=cfg.namespace, ip=next(self._ips), labels=labels,
                              service_account=CLIENT_SA, container_ports={}, caller=True)
        translate.write(translate.translate(self.objects, self.pods()), self.fs_dir)
        mesh = translate.mesh_config(operator, self.fs_dir, self.cp_xds, (self.work / "xds-tls" / "ca.crt").read_text())
        self.mesh_config_path = write_mesh_config(mesh, self.work / "mesh.yaml")
        t1 = time.monotonic()
        self.istiod = start_istiod(self.mesh_config_path, self.log_dir, IstiodPorts.free())
        self.log(f"istiod ready (every config source synced) in {time.monotonic() - t1:.1f}s")
        for e in [*self.engines, *([self.canary] if self.canary else [])]:
            e.sidecar = self._sidecar(e.pod, ca, self._proxy_metadata(e.pod))
        self.client = self._sidecar(self.client_pod, ca, {})
        if cfg.seed_policies:
            version = 0
            with self.api() as api:
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
        engine = launchers.start_engine(repo, self.log_dir, name=f"engine-{name}")
        self.procs.append(engine.proc)
        pod = translate.pod_from_template(deployment, name, next(self._ips),
                                          app_ports={HTTP_PORT: engine.http_port, GRPC_PORT: engine.grpc_port})
        self._deployments[name] = deployment
        return Engine(pod, engine)

    def _proxy_metadata(self, pod: Pod) -> dict[str, str]:
        return proxy_metadata_of(self._deployments[pod.name])

    def _sidecar(self, pod: Pod, ca: CertificateAuthority, proxy_metadata: dict[str, str]) -> Sidecar:
        assert self.istiod is not None
        work = self.work / "pods" / pod.name
        identity = ca.issue(spiffe_id(pod.namespace, pod.service_account), work / "certs", "workload")
        sc = start_sidecar(pod, identity, istiod_port=self.istiod.ports.grpc, work_dir=work, log_dir=self.log_dir,
                           proxy_metadata=proxy_metadata)
        self.procs += [sc.sds, sc.envoy]
        return sc

    def _start_redis_and_control_plane(self) -> None:
        cfg = self.config
        redis, redis_port = launchers.start_redis(self.work / "redis")
        self.procs.append(redis)
        self.redis_port = redis_port
        tls_dir = self.work / "xds-tls"
        xds_tls.issue(cfg.namespace, tls_dir)
        env_of_deployment = render.control_plane_env(self.objects)
        self.cp_http, self.cp_xds = procs.free_port(), procs.free_port()
        argv = launchers.control_plane_argv(redis_port, self.cp_http, self.cp_xds, "--host", "127.0.0.1",
                                           "--instance-id", "meshcache-istiod-local",
                                           "--xds-tls-cert", str(tls_dir / "tls.crt"),
                                           "--xds-tls-key", str(tls_dir / "tls.key"))
        # The rendered Deployment's MCP settings; the module as a local file (no registry, no
        # istio-agent to fetch oci://: docs/istio.md, "Running against a real istiod").
        env = {k: v for k, v in env_of_deployment.items() if k.startswith("MESHCACHE_CP_ISTIO_")}
        env |= {"MESHCACHE_CP_ISTIO_NAMESPACE": cfg.namespace,
                "MESHCACHE_CP_ISTIO_WASM_URL": f"file://{cfg.module}",
                "MESHCACHE_CP_ISTIO_WASM_SHA256": hashlib.sha256(cfg.module.read_bytes()).hexdigest(),
                "MESHCACHE_CP_TOKENS": f"write:mesh:{self.token}",
                "MESHCACHE_CP_RESYNC_INTERVAL_S": "0.5"}
        self._cp_argv, self._cp_env = argv, env
        self.cp_proc = launchers.start_control_plane(argv, env, self.log_dir, self.cp_http, self.cp_xds)
        self.procs.append(self.cp_proc)

    def restart_control_plane(self) -> None:
        assert self.cp_proc is not None
        self.cp_proc.stop()
        idx = self.procs.index(self.cp_proc)
        self.cp_proc = launchers.start_control_plane(self._cp_argv, self._cp_env, self.log_dir, self.cp_http,
                                                     self.cp_xds)
        self.procs[idx] = self.cp_proc

    # ---- use -------------------------------------------------------------------------------

    def pods(self) -> list[Pod]:
        out = [e.pod for e in self.engines]
        if self.canary:
            out.append(self.canary.pod)
        if self.client_pod:
            out.append(self.client_pod)
        return out

    def api(self) -> httpx.Client:
        return httpx.Client(base_url=f"http://127.0.0.1:{self.cp_http}",
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

    def wait_synced(self, version: int, timeout: float = 30.0) -> None:
        """Until every engine sidecar runs policy snapshot `version` (or later), from istiod over
        ECDS: its config has that version and istiod saw the ACK (the config_dump alone also shows
        a config the sidecar NACKed)."""
        deadline = time.monotonic() + timeout
        pending = self.server_sidecars()
        while pending and time.monotonic() < deadline:
            pending = [sc for sc in pending if not self._acked(sc, version)]
            if pending:
                time.sleep(0.05)
        if pending:
            raise procs.StartError(f"policy version {version} not applied by "
                                   f"{', '.join(sc.pod.name for sc in pending)} within {timeout:.0f}s")

    def _acked(self, sidecar: Sidecar, version: int) -> bool:
        if ecds_version(sidecar) < version:
            return False
        assert self.istiod is not None
        for status in self.istiod.syncz():
            if status.get("proxy") == sidecar.pod.proxy_id:
                res = status.get("resources", {}).get(ECDS_TYPE_URL, {})
                return bool(res.get("acked")) and res.get("acked") == res.get("sent") and not res.get("lastError")
        return False

    def stop(self) -> None:
        while self.procs:
            p = self.procs.pop()
            with contextlib.suppress(Exception):
                p.stop()
        if self.istiod is not None:
            with contextlib.suppress(Exception):
                self.istiod.stop()


def ecds_version(sidecar: Sidecar) -> int:
    """The policy snapshot version in the sidecar's meshcache filter config (0 = none yet)."""
    import json

    for item in ecds_filters(sidecar):
        ecds = item.get("ecds_filter", {})
        # full mode: the EnvoyFilter's `meshcache`; basic: istiod's TrafficExtension resource
        if not (ecds.get("name") == FILTER_NAME or ecds.get("name", "").startswith(TRAFFIC_EXTENSION_ECDS_PREFIX)):
            continue
        value = ecds.get("typed_config", {}).get("config", {}).get("configuration", {}).get("value", "")
        with contextlib.suppress(ValueError):
            v = json.loads(value).get("version", "0")
            return int(v) if str(v).isdigit() else 0
    return 0


def ecds_filters(sidecar: Sidecar) -> list[dict[str, Any]]:
    """The ECDS filter configs in the sidecar's config_dump."""
    dump = sidecar.config_dump()
    return [item for c in dump.get("configs", []) if c.get("@type", "").endswith("EcdsConfigDump")
            for item in c.get("ecds_filters", [])]
