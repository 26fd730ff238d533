"""The local mesh as real child processes: start in dependency order, check health, stop in reverse.

    redis-server -> control plane -> engine(s) (+ canary engine) -> server sidecar(s) -> client sidecar

The app talks plaintext to the client sidecar, which adds its traffic colour and forwards over
HTTP/2 + strict mTLS to a server sidecar; that one runs the meshcache filter (config from the
control plane over ECDS), serves hits itself and routes misses by colour to its engine (the
canary colour to the one canary engine). With `replicas` N > 1 there are N engine + server
sidecar pairs (`engine-2`, `server-sidecar-2`, ...), each with its own cache, and the client
sidecar runs the filter in the client role (ECDS resource `meshcache-client`) and hashes on its
routing key (cache affinity: one replica holds each answer) unless `affinity` is off.
`filter: native` runs the cache in the server sidecars as the Envoy dynamic module (ECDS resource
`meshcache-native`) instead of the Wasm filter, and with replicas the client role in the client
sidecar too (`meshcache-native-client`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from meshcache.contract.filter_config import client_plugin_config
from meshcache.contract.paths import FILTER_NATIVE, FILTER_WASM, envoy_binary
from meshcache.ctl import launchers, procs
from meshcache.ctl.envoy_config import SEMANTIC_CLUSTER, Affinity, CacheProxy, ClientSidecar, Upstream, write
from meshcache.ctl.istio import render
from meshcache.ctl.mesh.api_client import ApiError, PolicyApi
from meshcache.ctl.mesh.certs import CONTROL_PLANE_NAME, MeshCertificates, ensure_certificates
from meshcache.ctl.mesh.config import HOST_NAMES, MeshConfig, Ports, ReplicaPorts
from meshcache.ctl.mesh.errors import MeshError
from meshcache.ctl.mesh.healing import Healer, Liveness, RestartPolicy
from meshcache.ctl.mesh.state import process_start_time

SERVER_NODE = "meshcache-server-sidecar"
CLIENT_NODE = "meshcache-client-sidecar"
# The server sidecar caches nothing until the control plane's policies arrive over ECDS.
DEFAULT_PLUGIN_CONFIG: dict[str, Any] = {"version": "default", "policies": []}
# Restarts wait for these to run first: the control plane is ready only with Redis reachable.
DEPENDS_ON: dict[str, tuple[str, ...]] = {"control-plane": ("redis",)}
# Components whose restart loses state users notice (every replica's server sidecar).
RESTART_NOTE_SERVER = "its response cache was emptied by the restart"


def replica_name(base: str, k: int) -> str:
    """Replica 1 keeps the plain names (`engine`, `server-sidecar`); others get `-k`."""
    return base if k == 1 else f"{base}-{k}"


def server_node(k: int) -> str:
    return replica_name(SERVER_NODE, k)


def restart_note(name: str) -> str:
    return RESTART_NOTE_SERVER if name.split("-")[:2] == ["server", "sidecar"] else ""


def _check_port_free(port: int, what: str) -> None:
    # SO_REUSEADDR like the servers themselves: only a real listener (not TIME_WAIT) counts as taken.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError as exc:
            reason = "already in use" if exc.errno == errno.EADDRINUSE else str(exc)
            raise MeshError(f"port {port} ({what}) is {reason}: stop what holds it, or choose other "
                            f"ports (meshcache up --free-ports, or --config FILE)") from exc


def check_prerequisites(config: MeshConfig) -> None:
    """Binaries, the built filter and every port, before anything starts."""
    try:
        envoy_binary()
    except FileNotFoundError as exc:
        raise MeshError(str(exc)) from exc
    if not shutil.which("redis-server"):
        raise MeshError("redis-server not found on PATH: install the Debian package redis-server (make setup)")
    if not Path(launchers.ENGINE_BIN).exists():
        raise MeshError(f"{launchers.ENGINE_BIN} not found: install this package (make setup)")
    if not FILTER_WASM.exists():
        raise MeshError(f"{FILTER_WASM} is missing: build the filter (make filter)")
    if config.filter == "native" and not FILTER_NATIVE.exists():
        raise MeshError(f"{FILTER_NATIVE} is missing (--filter native runs the cache as an Envoy dynamic module): "
                        f"build it (make filter)")
    ports = config.ports
    for name in vars(ports):
        if (name.startswith("canary_") and not config.canary_color) or name == "replica_base" \
                or (name == "semantic" and not config.llm):
            continue
        _check_port_free(getattr(ports, name), Ports.describe(name))
    for k in range(2, config.replicas + 1):
        for name, port in vars(ports.replica(k)).items():
            _check_port_free(port, f"replica {k} {Ports.describe(name)}")


def load_or_create_token(state_dir: Path) -> str:
    """The control plane's write token, kept 0600 in the state dir for `meshcache policy`."""
    path = state_dir / "token"
    if path.exists():
        return path.read_text().strip()
    token = secrets.token_urlsafe(24)
    state_dir.mkdir(parents=True, exist_ok=True)
    with open(path, "x", opener=lambda p, f: os.open(p, f, 0o600)) as f:
        f.write(token + "\n")
    return token


def _model_repos(config: MeshConfig) -> tuple[Path, Path | None]:
    """The default engine's repository, and the canary's (same models, other default versions)."""
    models = config.state_dir / "models"
    default = models / "default"
    # The engine's own command writes them, and only when its generator changed (its version stamp).
    launchers.init_demo_models(default, if_stale=True, llm=config.llm)
    if not config.canary_color:
        return default, None
    # Same models; the canary serves the configured versions only (e.g. mlp-classifier 1, where the
    # default engine serves the highest, 2), so routing is visible in the answers.
    canary = launchers.init_demo_models(models / "canary", if_stale=True, serve_versions=config.canary_defaults,
                                        llm=config.llm)
    return default, canary


class Mesh:
    """One running local mesh; `start()` then `stop()` (or use it as a context manager)."""

    def __init__(self, config: MeshConfig, log: Callable[[str], None] = print) -> None:
        self.config = config
        self.log = log
        self.procs: list[procs.Proc] = []
        self.engine: launchers.Engine | None = None  # replica 1's
        self.engines: dict[int, launchers.Engine] = {}  # by replica number
        self.canary: launchers.Engine | None = None
        self.certs: MeshCertificates | None = None
        self.token = ""
        # How to start each component again (same ports, same config files), by name.
        self._starters: dict[str, Callable[[], procs.Proc]] = {}

    # ---- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> Mesh:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        cfg, ports = self.config, self.config.ports
        check_prerequisites(cfg)
        cfg.state_dir.mkdir(parents=True, exist_ok=True)
        self.certs = ensure_certificates(cfg)
        if self.certs.issued:
            self.log(f"issued certificates: {', '.join(self.certs.issued)} (valid {cfg.cert_hours:g} h)")
        self.token = load_or_create_token(cfg.state_dir)
        try:
            self._start_all(ports)
        except BaseException:
            self.stop()
            raise

    def _start_all(self, ports: Ports) -> None:
        cfg, certs = self.config, self.certs
        assert certs is not None
        try:
            default_repo, canary_repo = _model_repos(cfg)  # the engine's init-models command may fail
        except procs.StartError as exc:
            raise MeshError(str(exc)) from exc
        color_routes: dict[str, Upstream] = {}
        if canary_repo is not None:
            color_routes[cfg.canary_color] = Upstream(ports.canary_http, ports.canary_grpc)
        replicas = {k: ports.replica(k) for k in range(1, cfg.replicas + 1)}
        affinity = None
        if cfg.replicas > 1 and cfg.affinity:
            affinity = Affinity(FILTER_WASM, client_plugin_config(DEFAULT_PLUGIN_CONFIG), lb_policy=cfg.lb_policy,
                                ecds_port=ports.cp_xds, xds_tls=certs.client, xds_peers=(cfg.control_plane_id,),
                                native_module=FILTER_NATIVE if cfg.filter == "native" else None)
        client = ClientSidecar(listen_port=ports.app, admin_port=ports.client_admin,
                               server_ports=[r.server_inbound for r in replicas.values()], identity=certs.client,
                               server_identities=[cfg.server_id], color=cfg.color, node_id=CLIENT_NODE,
                               affinity=affinity)
        starts: list[tuple[str, str, Callable[[], procs.Proc]]] = [
            ("redis", "redis-server", lambda: launchers.start_redis(cfg.state_dir / "redis", port=ports.redis)[0]),
            ("control-plane", "the control plane", self._start_control_plane),
        ]
        for k in replicas:
            of = f" (replica {k} of {cfg.replicas})" if cfg.replicas > 1 else ""
            starts.append((replica_name("engine", k), f"the engine{of}",
                           lambda k=k: self._start_engine(default_repo, replica_name("engine", k))))
        if canary_repo is not None:
            starts.append(("engine-canary", f"the canary engine (traffic colour {cfg.canary_color!r})",
                           lambda: self._start_engine(canary_repo, "engine-canary")))
        if cfg.llm:
            starts.append(("semantic", "the semantic index service (embeddings: the engine's all-minilm-l6-v2)",
                           self._start_semantic))
        for k, rp in replicas.items():
            of = f", replica {k} of {cfg.replicas}" if cfg.replicas > 1 else ""
            name = replica_name("server-sidecar", k)
            starts.append((name, f"the server sidecar (mTLS, meshcache {HOST_NAMES[cfg.filter]} over ECDS{of})",
                           self._envoy_starter(name, self._server_proxy(k, rp, color_routes), rp.server_admin)))
        what = "the client sidecar" + (f" ({cfg.lb_policy} cache affinity over {cfg.replicas} replicas)"
                                       if affinity is not None else "")
        starts.append(("client-sidecar", what, self._envoy_starter("client-sidecar", client, ports.client_admin)))
        try:
            for name, what, start in starts:
                self.log(f"starting {what} ...")
                self._starters[name] = start
                self.procs.append(start())
            self._apply_policies()
            self._wait_end_to_end()
        except procs.StartError as exc:
            raise MeshError(str(exc)) from exc
        except ApiError as exc:
            raise MeshError(f"control plane: {exc}\n{self._tail('control-plane')}") from exc

    def _server_proxy(self, k: int, rp: ReplicaPorts, color_routes: dict[str, Upstream]) -> CacheProxy:
        cfg, certs = self.config, self.certs
        assert certs is not None
        return CacheProxy(
            listen_port=rp.server_inbound, admin_port=rp.server_admin,
            http_upstream_port=rp.engine_http, grpc_upstream_port=rp.engine_grpc,
            wasm_path=FILTER_WASM, native_module=FILTER_NATIVE if cfg.filter == "native" else None,
            plugin_config=DEFAULT_PLUGIN_CONFIG, ecds_port=cfg.ports.cp_xds,
            node_id=server_node(k), cluster="meshcache-server", downstream_tls=certs.server,
            allowed_peers=[cfg.client_id], color_routes=color_routes,
            xds_tls=certs.server, xds_peers=[cfg.control_plane_id],
            semantic_port=cfg.ports.semantic if cfg.llm else None)

    def _start_semantic(self) -> procs.Proc:
        """The semantic index service, embedding with replica 1's engine (/v1/embeddings)."""
        embedder = f"http://127.0.0.1:{self.config.ports.engine_http}"
        return launchers.start_semantic(embedder, self.config.log_dir, port=self.config.ports.semantic).proc

    def _start_engine(self, repo: Path, name: str) -> procs.Proc:
        ports = self.config.ports
        if name == "engine-canary":
            engine = launchers.start_engine(repo, self.config.log_dir, name=name,
                                            ports=(ports.canary_http, ports.canary_grpc, ports.canary_metrics))
            self.canary = engine
            return engine.proc
        k = 1 if name == "engine" else int(name.rsplit("-", 1)[1])
        rp = ports.replica(k)
        engine = launchers.start_engine(repo, self.config.log_dir, name=name,
                                        ports=(rp.engine_http, rp.engine_grpc, rp.engine_metrics))
        self.engines[k] = engine
        if k == 1:
            self.engine = engine
        return engine.proc

    def restart(self, name: str) -> procs.Proc:
        """Start component `name` again (same ports and config) in its place; StartError if it fails."""
        index = next(i for i, p in enumerate(self.procs) if p.name == name)
        with contextlib.suppress(Exception):
            self.procs[index].stop(timeout=5)  # closes the old log handle; reaps the exited process
        proc = self._starters[name]()
        self.procs[index] = proc
        return proc

    def healer(self, policy: RestartPolicy, log: Callable[[str], None]) -> Healer:
        # The control plane's liveness probe as Kubernetes runs it (istio/base): a wedged one is
        # killed and restarted.
        liveness = Liveness.http_get(render.control_plane_probe(), f"http://127.0.0.1:{self.config.ports.cp_http}")
        return Healer(self.procs, self.restart, DEPENDS_ON, policy, log,
                      on_restart_note=lambda name: (f"{restart_note(name)} at {time.strftime('%H:%M:%S')}"
                                                    if restart_note(name) else ""),
                      liveness={"control-plane": liveness})

    def refresh_certificates(self, force: bool = False) -> tuple[str, ...]:
        """Re-issue certificates that are due (or all of them with `force`); returns what was issued.

        The sidecars pick theirs up over SDS without a restart. The control plane reads its xDS
        certificate at start, so it is restarted when that one was re-issued: its API pauses for
        a few seconds, traffic does not (the sidecars keep their config and reconnect)."""
        self.certs = ensure_certificates(self.config, force=force)
        if f"{CONTROL_PLANE_NAME}.crt" in self.certs.issued and any(p.name == "control-plane" for p in self.procs):
            self.restart("control-plane")
        return self.certs.issued

    def _start_control_plane(self) -> procs.Proc:
        ports = self.config.ports
        certs = self.certs
        assert certs is not None
        # xDS only for holders of a mesh-CA certificate (the sidecars): no other local process
        # can read the config, forge ACK/NACKs or use up the stream limit.
        argv = launchers.control_plane_argv(ports.redis, ports.cp_http, ports.cp_xds, "--host", "127.0.0.1",
                                           "--wasm-path", str(FILTER_WASM), "--native-module", str(FILTER_NATIVE),
                                           "--instance-id", "meshcache-up",
                                           # the last good snapshot, served after a restart without Redis
                                           "--state-dir", str(self.config.state_dir / "control-plane"),
                                           "--xds-tls-cert", str(certs.control_plane.cert),
                                           "--xds-tls-key", str(certs.control_plane.key),
                                           "--xds-tls-client-ca", str(certs.ca_cert),
                                           # the status page's cache counters: the sidecars' stats
                                           "--proxy-stats", ",".join(f"{n}={u}" for n, u in self.stats_urls().items()),
                                           # which models exist: a policy prefix matching none is warned about
                                           "--engine-index", ",".join(self.engine_urls()),
                                           *self._semantic_args())
        env = {"MESHCACHE_CP_TOKENS": f"write:mesh:{self.token}"}
        return launchers.start_control_plane(argv, env, self.config.log_dir, ports.cp_http, ports.cp_xds,
                                            ready_path="/readyz")

    def _semantic_args(self) -> list[str]:
        """With the LLM models: the sidecars' cluster for the semantic index service, named in the
        filter config (`semantic_service`), and where the control plane sends purges."""
        if not self.config.llm:
            return []
        return ["--semantic-cluster", SEMANTIC_CLUSTER,
                "--semantic-authority", f"127.0.0.1:{self.config.ports.semantic}"]

    def _envoy_starter(self, name: str, proxy: CacheProxy | ClientSidecar, admin_port: int
                       ) -> Callable[[], procs.Proc]:
        """Writes the config once; every (re)start runs Envoy on that same file."""
        directory = self.config.state_dir / "envoy"
        directory.mkdir(parents=True, exist_ok=True)
        path = write(proxy, directory / f"{name}.yaml")
        return lambda: launchers.start_envoy(path, admin_port, self.config.log_dir, name=name,
                                            concurrency=self.config.envoy_concurrency)

    def _apply_policies(self) -> None:
        """Seed the default policies into a fresh control plane; wait until the server sidecar has them."""
        with self.api() as api:
            version = api.version()
            if version == 0:
                for prefix, spec in self.config.policies.items():
                    version = api.put(prefix, spec)["version"]
                self.log(f"seeded {len(self.config.policies)} cache policies (version {version})")
            if version > 0:
                for node in self.xds_nodes():
                    api.wait_acked(node, version, timeout=15)

    def _wait_end_to_end(self, timeout: float = 15.0) -> None:
        """The app port answers through both sidecars and mTLS (the engine's readiness endpoint)."""
        url = f"http://127.0.0.1:{self.config.ports.app}/v2/health/ready"
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                r = httpx.get(url, timeout=2)
                if r.status_code == 200:
                    return
                last = f"{r.status_code} {r.text[:200]}"
            time.sleep(0.1)
        raise MeshError(f"app port {self.config.ports.app} does not reach the engine through the sidecars "
                        f"({last or 'no answer'}):\n{self._tail('client-sidecar')}\n{self._tail('server-sidecar')}")

    def stop(self) -> None:
        """Reverse start order: sidecars first, so no request reaches a stopped engine or Redis."""
        while self.procs:
            p = self.procs.pop()
            with contextlib.suppress(Exception):
                p.stop()

    # ---- inspection --------------------------------------------------------------------------

    def api(self) -> PolicyApi:
        return PolicyApi(f"http://127.0.0.1:{self.config.ports.cp_http}", self.token)

    def server_stats_url(self, k: int = 1) -> str:
        return f"http://127.0.0.1:{self.config.ports.replica(k).server_admin}/stats/prometheus"

    def has_affinity(self) -> bool:
        return self.config.replicas > 1 and self.config.affinity

    def xds_nodes(self) -> list[str]:
        """Envoys that take the filter's config from the control plane."""
        nodes = [server_node(k) for k in range(1, self.config.replicas + 1)]
        return nodes + [CLIENT_NODE] if self.has_affinity() else nodes

    def engine_urls(self) -> list[str]:
        """The engines' REST base URLs (replicas, then the canary)."""
        ports = self.config.ports
        urls = [f"http://127.0.0.1:{ports.replica(k).engine_http}" for k in range(1, self.config.replicas + 1)]
        if self.config.canary_color:
            urls.append(f"http://127.0.0.1:{ports.canary_http}")
        return urls

    def stats_urls(self) -> dict[str, str]:
        urls = {server_node(k): self.server_stats_url(k) for k in range(1, self.config.replicas + 1)}
        if self.has_affinity():
            urls[CLIENT_NODE] = f"http://127.0.0.1:{self.config.ports.client_admin}/stats/prometheus"
        return urls

    def proc(self, name: str) -> procs.Proc:
        return next(p for p in self.procs if p.name == name)

    def _tail(self, name: str) -> str:
        found = [p for p in self.procs if p.name == name]
        return f"--- {name} log ---\n{found[0].log_tail()}" if found else ""

    def children(self) -> list[dict[str, Any]]:
        return [{"name": p.name, "pid": p.popen.pid, "start_time": process_start_time(p.popen.pid),
                 "log": str(p.log_path)} for p in self.procs]

    def endpoints(self) -> dict[str, Any]:
        cfg, ports = self.config, self.config.ports
        out: dict[str, Any] = {
            "app": f"127.0.0.1:{ports.app}",
            "app_color": cfg.color,
            "filter": cfg.filter,
            "control_plane_api": f"http://127.0.0.1:{ports.cp_http}",
            "control_plane_xds": f"127.0.0.1:{ports.cp_xds}",
            "token_file": str(cfg.state_dir / "token"),
            "client_sidecar_admin": f"http://127.0.0.1:{ports.client_admin}",
            "server_sidecar_admin": f"http://127.0.0.1:{ports.server_admin}",
            "server_sidecar_mtls": f"127.0.0.1:{ports.server_inbound}",
            "engine_http": f"http://127.0.0.1:{ports.engine_http}",
            "engine_grpc": f"127.0.0.1:{ports.engine_grpc}",
            "engine_metrics": f"http://127.0.0.1:{ports.engine_metrics}/metrics",
            "redis": f"127.0.0.1:{ports.redis}",
            "client_identity": cfg.client_id,
            "server_identity": cfg.server_id,
            "ca": str(self.certs.ca_cert) if self.certs else "",
        }
        if cfg.replicas > 1:
            out["replicas"] = [{"server_sidecar_admin": f"http://127.0.0.1:{rp.server_admin}",
                                "server_sidecar_mtls": f"127.0.0.1:{rp.server_inbound}",
                                "engine_http": f"http://127.0.0.1:{rp.engine_http}"}
                               for rp in (ports.replica(k) for k in range(1, cfg.replicas + 1))]
            out["routing"] = f"{cfg.lb_policy} cache affinity" if cfg.affinity else "round robin"
        if cfg.llm:
            out["semantic"] = f"http://127.0.0.1:{ports.semantic}"
        if cfg.canary_color:
            out["canary_color"] = cfg.canary_color
            out["canary_engine_metrics"] = f"http://127.0.0.1:{ports.canary_metrics}/metrics"
        return out
