"""Typed settings of the local mesh: ports, state directory, identities, traffic colours.

Defaults are fixed, documented ports so `meshcache up` prints the same endpoints every time;
`with_free_ports()` gives tests (and `meshcache up --free-ports`) ports nobody else holds.
A JSON file (`meshcache up --config FILE`) may override any field, ports included.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshcache.contract.filter_config import DEMO_POLICIES
from meshcache.ctl import procs
from meshcache.ctl.envoy_config import LB_POLICIES
from meshcache.ctl.pki import spiffe_id

MAX_REPLICAS = 8
# Which host runs the cache in the server sidecars (`meshcache up --filter`): the proxy-wasm filter
# (what Istio loads) or the Envoy dynamic module (filter/native/, the native host).
FILTER_HOSTS = ("wasm", "native")
HOST_NAMES = {"wasm": "Wasm filter", "native": "native host (Envoy dynamic module)"}  # for messages, `status`
# Replicas 2..N (`meshcache up --replicas N`) take their ports from a block at `replica_base`:
# REPLICA_STRIDE ports each, in ReplicaPorts' field order.
REPLICA_STRIDE = 10
REPLICA_BLOCK = REPLICA_STRIDE * (MAX_REPLICAS - 1)


@dataclass(frozen=True)
class ReplicaPorts:
    """One engine replica and its server sidecar."""

    server_inbound: int
    server_admin: int
    engine_http: int
    engine_grpc: int
    engine_metrics: int


@dataclass(frozen=True)
class Ports:
    # Istio's numbers where there is one: 15000 admin, 15001 outbound, 15006 inbound.
    app: int = 15001  # client sidecar: plaintext gRPC + HTTP for the local app
    client_admin: int = 15000
    server_inbound: int = 15006  # server sidecar: strict mTLS only
    server_admin: int = 15100
    cp_http: int = 18080
    cp_xds: int = 18000
    redis: int = 16379
    engine_http: int = 18100
    engine_grpc: int = 18101
    engine_metrics: int = 18102
    canary_http: int = 18110
    canary_grpc: int = 18111
    canary_metrics: int = 18112
    semantic: int = 18120  # the semantic index service (with `llm`)
    replica_base: int = 18200  # replicas 2..N: REPLICA_STRIDE ports each from here

    def replica(self, k: int) -> ReplicaPorts:
        """Ports of replica k (1-based): replica 1 has the named ports above."""
        if k == 1:
            return ReplicaPorts(self.server_inbound, self.server_admin, self.engine_http, self.engine_grpc,
                                self.engine_metrics)
        if not 2 <= k <= MAX_REPLICAS:
            raise ValueError(f"replica {k}: 1 to {MAX_REPLICAS}")
        base = self.replica_base + REPLICA_STRIDE * (k - 2)
        return ReplicaPorts(*(base + i for i in range(len(dataclasses.fields(ReplicaPorts)))))

    # What listens on each port, for error messages ("port 15001 (client sidecar app listener)").
    @staticmethod
    def describe(name: str) -> str:
        return {
            "app": "client sidecar app listener", "client_admin": "client sidecar admin",
            "server_inbound": "server sidecar mTLS listener", "server_admin": "server sidecar admin",
            "cp_http": "control-plane API", "cp_xds": "control-plane xDS", "redis": "redis-server",
            "engine_http": "engine HTTP", "engine_grpc": "engine gRPC", "engine_metrics": "engine metrics",
            "canary_http": "canary engine HTTP", "canary_grpc": "canary engine gRPC",
            "canary_metrics": "canary engine metrics", "semantic": "semantic index service",
            "replica_base": "first port of replicas 2..N",
        }[name]

    @classmethod
    def free(cls) -> Ports:
        """Free ports, all different, outside the kernel's ephemeral range: a port from that range
        can be taken by any client socket on the machine in the seconds before a component binds
        it, or while a crashed component is being restarted on it. The sockets stay bound until
        every port is picked."""
        names = [f.name for f in dataclasses.fields(cls) if f.name != "replica_base"]
        low, high = _ephemeral_range()
        candidates = procs.port_range() or range(*FREE_PORT_POOL)
        pool = [p for p in candidates if not low <= p <= high]
        picked: list[int] = []
        with contextlib.ExitStack() as stack:
            base = _free_block(stack, [p for p in pool if p + REPLICA_BLOCK < candidates.stop
                                       and not low <= p + REPLICA_BLOCK <= high])
            block = range(base, base + REPLICA_BLOCK)
            for port in random.sample(pool, min(len(pool), 4096)):
                if port in block:
                    continue
                s = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                picked.append(port)
                if len(picked) == len(names):
                    return cls(**dict(zip(names, picked, strict=True)), replica_base=base)
        raise OSError(f"no {len(names)} free ports in {candidates.start}-{candidates.stop - 1} "
                      f"outside the ephemeral range {low}-{high}")


# Where `Ports.free` looks: above the well-known ports users' own services tend to take.
FREE_PORT_POOL = (20000, 32768)


def _free_block(stack: contextlib.ExitStack, starts: list[int]) -> int:
    """The first port of REPLICA_BLOCK consecutive free ports (kept bound on `stack`)."""
    for start in random.sample(starts, min(len(starts), 64)):
        sockets = []
        try:
            for port in range(start, start + REPLICA_BLOCK):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sockets.append(s)
                s.bind(("127.0.0.1", port))
        except OSError:
            for s in sockets:
                s.close()
            continue
        for s in sockets:
            stack.enter_context(s)
        return start
    raise OSError(f"no {REPLICA_BLOCK} consecutive free ports among {len(starts)} candidate starts")


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    return low, high


def default_state_dir() -> Path:
    if env := os.environ.get("MESHCACHE_STATE_DIR"):
        return Path(env)
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "meshcache"



@dataclass(frozen=True)
class MeshConfig:
    state_dir: Path = field(default_factory=default_state_dir)
    ports: Ports = field(default_factory=Ports)
    trust_domain: str = "cluster.local"
    namespace: str = "default"
    client_service_account: str = "inference-client"
    server_service_account: str = "inference-server"
    control_plane_service_account: str = "meshcache-control-plane"
    # The client sidecar's colour (the seed's traffic.color), sent unless the app sets its own.
    color: str = "inference-2026"
    # Traffic of this colour goes to a second (canary) engine; "" runs no canary.
    canary_color: str = "blue"
    # The canary engine serves the same models, but mlp-classifier defaults to version 1
    # (the default engine serves version 2), so routing is visible in the answers.
    canary_defaults: dict[str, str] = field(default_factory=lambda: {"mlp-classifier": "1"})
    cert_hours: float = 24.0  # workload certificates are short-lived ...
    renew_before_hours: float = 8.0  # ... and re-issued (rotated over SDS) when less than this is left
    # How often a running mesh checks whether certificates are due; 0: a quarter of
    # renew_before_hours, at most 60 s (so minute-long test certificates work too).
    cert_check_s: float = 0.0
    # Self-healing (meshcache.ctl.mesh.healing): restart delay doubles per failure in a row, capped;
    # after crash_loop_limit failures in a row (runs shorter than stable_after_s) a component is
    # given up on and reported.
    restart_initial_backoff_s: float = 0.25
    restart_max_backoff_s: float = 30.0
    crash_loop_limit: int = 5
    stable_after_s: float = 30.0
    envoy_concurrency: int = 1
    # Engine replicas, each with its own server sidecar (and cache). With more than one, the client
    # sidecar runs the filter in the client role and hashes on its routing key (cache affinity)
    # with `lb_policy` (RING_HASH or MAGLEV); `affinity: false` balances round robin instead.
    replicas: int = 1
    affinity: bool = True
    lb_policy: str = "RING_HASH"
    # A real istiod in the middle (`meshcache up --istiod`, meshcache/ctl/istiod): the control plane
    # feeds istiod over MCP and istiod configures the sidecars; ports are then picked free.
    istiod: bool = False
    # Kubernetes in the loop (`meshcache up --kube`, meshcache/ctl/kube/up.py): a local cluster,
    # istiod in Kubernetes mode, the test kubelet's injected pods and a client pod (root).
    kube: bool = False
    # `up --kube --replicas N`: the engine Deployment scaled to N pods (0: as rendered, istio/base's 2).
    kube_replicas: int = 0
    # The cache's host (FILTER_HOSTS): in the server sidecars, and with replicas in the client
    # sidecar's client role (affinity) too.
    filter: str = "wasm"
    # The engines also serve the OpenAI-compatible LLM demo models (`init-models --llm`: llama3-tiny,
    # its llama3-70b-demo / gemma2-27b-demo aliases, all-minilm-l6-v2).
    llm: bool = False
    # Seeded into the control plane on a fresh state dir (policy version 0); kept across restarts.
    policies: dict[str, dict[str, Any]] = field(default_factory=lambda: {k: dict(v) for k, v in DEMO_POLICIES.items()})

    @property
    def client_id(self) -> str:
        return spiffe_id(self.namespace, self.client_service_account, self.trust_domain)

    @property
    def server_id(self) -> str:
        return spiffe_id(self.namespace, self.server_service_account, self.trust_domain)

    def __post_init__(self) -> None:
        if not 1 <= self.replicas <= MAX_REPLICAS:
            raise ValueError(f"replicas must be 1 to {MAX_REPLICAS}; got {self.replicas}")
        if self.filter not in FILTER_HOSTS:
            raise ValueError(f"filter must be one of {', '.join(FILTER_HOSTS)}; got {self.filter!r}")
        if self.kube and (self.istiod or self.filter != "wasm" or self.replicas != 1):
            raise ValueError("kube: runs istio/ as rendered (the Wasm filter, istiod in Kubernetes mode); not with "
                             "istiod or filter, and its engine pods are kube_replicas (--replicas with --kube)")
        if not 0 <= self.kube_replicas <= MAX_REPLICAS or (self.kube_replicas and not self.kube):
            raise ValueError(f"kube_replicas must be 1 to {MAX_REPLICAS} (0: as rendered), with kube only; "
                             f"got {self.kube_replicas}")
        if self.lb_policy not in LB_POLICIES:
            raise ValueError(f"lb_policy must be one of {', '.join(LB_POLICIES)}; got {self.lb_policy!r}")
        if not 0 < self.renew_before_hours < self.cert_hours:
            raise ValueError(f"renew_before_hours must be above 0 and below cert_hours ({self.cert_hours:g}); "
                             f"got {self.renew_before_hours:g}")
        if self.crash_loop_limit < 1 or self.restart_initial_backoff_s <= 0 or self.stable_after_s <= 0 \
                or self.restart_max_backoff_s < self.restart_initial_backoff_s or self.cert_check_s < 0:
            raise ValueError("restart settings: crash_loop_limit >= 1, backoffs and stable_after_s > 0, "
                             "restart_max_backoff_s >= restart_initial_backoff_s, cert_check_s >= 0")

    @property
    def cert_check_interval_s(self) -> float:
        return self.cert_check_s or min(60.0, self.renew_before_hours * 3600 / 4)

    @property
    def control_plane_id(self) -> str:
        return spiffe_id(self.namespace, self.control_plane_service_account, self.trust_domain)

    @property
    def log_dir(self) -> Path:
        return self.state_dir / "logs"

    def with_free_ports(self) -> MeshConfig:
        return dataclasses.replace(self, ports=Ports.free())

    @classmethod
    def from_file(cls, path: Path, **overrides: Any) -> MeshConfig:
        """Fields from a JSON object (`ports` as an object of port names); unknown keys are errors."""
        raw = json.loads(path.read_text())
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: expected a JSON object")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(raw) - known
        if unknown:
            raise ValueError(f"{path}: unknown settings {sorted(unknown)}; known: {sorted(known)}")
        if "ports" in raw:
            port_names = {f.name for f in dataclasses.fields(Ports)}
            if bad := set(raw["ports"]) - port_names:
                raise ValueError(f"{path}: unknown ports {sorted(bad)}; known: {sorted(port_names)}")
            raw["ports"] = Ports(**raw["ports"])
        if "state_dir" in raw:
            raw["state_dir"] = Path(raw["state_dir"])
        raw.update(overrides)
        return cls(**raw)
