"""Start the processes meshcache runs with (redis-server, Envoy, the engine, the control plane)
as supervised children that are ready when these return."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc

from meshcache.contract.paths import envoy_binary
from meshcache.contract.protos import grpc_predict_v2_pb2_grpc as pb_grpc
from meshcache.ctl import procs


def start_redis(data_dir: Path, port: int | None = None, name: str = "redis") -> tuple[procs.Proc, int]:
    """A redis-server on 127.0.0.1 with AOF on, fsynced before each reply, so acknowledged writes
    survive even a SIGKILL (policy writes are rare; durability matters more than write speed)."""
    binary = shutil.which("redis-server")
    if not binary:
        raise procs.StartError("redis-server not found: install the Debian package (make setup)")
    port = port or procs.free_port()
    data_dir.mkdir(parents=True, exist_ok=True)
    argv = [
        binary, "--bind", "127.0.0.1", "--port", str(port), "--dir", str(data_dir),
        "--appendonly", "yes", "--appendfsync", "always", "--save", "",
        "--daemonize", "no", "--protected-mode", "yes", "--maxmemory", "256mb",
    ]
    proc = procs.start_ready(name, argv, data_dir, [(procs.tcp_open(port), 15, "accepting connections")])
    return proc, port


def start_envoy(
    config_path: Path, admin_port: int, log_dir: Path, name: str = "envoy", concurrency: int = 1,
    extra_args: list[str] | None = None, log_level: str = "info", timeout: float = 30.0, what: str = "LIVE",
    envoy: str = "1.40",
) -> procs.Proc:
    """Envoy as a child process; ready once its admin endpoint reports LIVE (every listener
    warmed: with xDS, the initial config and its SDS secrets have arrived). `envoy`: which
    Envoy (meshcache.contract.paths.ENVOYS)."""
    argv = [
        envoy_binary(envoy), "-c", str(config_path), "--disable-hot-restart",
        "--concurrency", str(concurrency), "--log-level", log_level, *(extra_args or []),
    ]

    def live() -> bool:
        r = procs.local_http().get(f"http://127.0.0.1:{admin_port}/ready", timeout=1.0)
        return r.status_code == 200 and r.text.strip() == "LIVE"

    return procs.start_ready(name, argv, log_dir, [(live, timeout, what)])


def envoy_stats(admin_port: int, prefix: str = "") -> dict[str, int]:
    """Counters and gauges from Envoy's admin /stats (optionally those starting with prefix)."""
    text = procs.local_http().get(
        f"http://127.0.0.1:{admin_port}/stats", params={"filter": prefix} if prefix else None, timeout=5
    ).text
    out: dict[str, int] = {}
    for line in text.splitlines():
        name, sep, value = line.partition(": ")
        if sep and value.strip().lstrip("-").isdigit():
            out[name] = int(value)
    return out


ENGINE_BIN = str(Path(sys.executable).parent / "meshcache-engine")


def init_demo_models(directory: Path, if_stale: bool = False, serve_versions: Mapping[str, object] | None = None,
                     timeout: float = 300, llm: bool = False) -> Path:
    """The demo model repository, written by the engine's own command (`meshcache-engine init-models`).

    With `if_stale`, an up-to-date repository (the engine's version stamp matches) is left as it
    is, and a stale one is removed and rewritten. `serve_versions` (model -> version) makes those
    models serve only that version (a canary repository). `llm` adds the OpenAI-served models."""
    argv = [ENGINE_BIN, "init-models", str(directory), *(["--if-stale", "--clean"] if if_stale else []),
            *(["--llm"] if llm else []),
            *(f"--serve-version={m}={v}" for m, v in (serve_versions or {}).items())]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise procs.StartError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return directory


@dataclass
class Engine:
    """A running meshcache-engine child process and its ports."""

    proc: procs.Proc
    http_port: int
    grpc_port: int
    metrics_port: int

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def stub(self) -> pb_grpc.GRPCInferenceServiceStub:
        return pb_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(self.grpc_target))


def start_engine(
    repo: Path,
    log_dir: Path,
    name: str = "engine",
    extra: list[str] | None = None,
    env: dict[str, str] | None = None,
    ports: tuple[int, int, int] | None = None,
) -> Engine:
    """`ports` = (http, grpc, metrics); free ports when not given."""
    http_port, grpc_port, metrics_port = ports or (procs.free_port(), procs.free_port(), procs.free_port())
    argv = [
        ENGINE_BIN,
        "--model-repository",
        str(repo),
        "--host",
        "127.0.0.1",
        "--http-port",
        str(http_port),
        "--grpc-port",
        str(grpc_port),
        "--metrics-port",
        str(metrics_port),
        *(extra or []),
    ]
    proc = procs.start_ready(name, argv, log_dir, [
        (procs.http_ok(f"http://127.0.0.1:{http_port}/v2/health/ready"), 60, "ready"),
        (procs.tcp_open(grpc_port), 10, "serving gRPC"),
    ], env=env)
    return Engine(proc, http_port, grpc_port, metrics_port)


def control_plane_argv(redis_port: int, http_port: int, xds_port: int, *extra: str) -> list[str]:
    """The `meshcache-control-plane` command line for a local Redis and the given ports."""
    script = Path(sys.executable).parent / "meshcache-control-plane"
    argv = [str(script)] if script.exists() else [sys.executable, "-m", "meshcache.control_plane.cli"]
    return [*argv, "--redis-url", f"redis://127.0.0.1:{redis_port}/0", "--http-port", str(http_port),
            "--xds-port", str(xds_port), *extra]


def start_control_plane(argv: list[str], env: dict[str, str], log_dir: Path, http_port: int, xds_port: int,
                        name: str = "control-plane", ready_path: str = "/healthz") -> procs.Proc:
    """A control plane child process, ready once `ready_path` answers 200 and xDS accepts."""
    return procs.start_ready(name, argv, log_dir, [
        (procs.http_ok(f"http://127.0.0.1:{http_port}{ready_path}"), 30, "ready"),
        (procs.tcp_open(xds_port), 10, "serving xDS"),
    ], env=env)


@dataclass
class Semantic:
    """A running semantic index service (python -m meshcache.semantic)."""

    proc: procs.Proc
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def start_semantic(embedder_url: str, log_dir: Path, max_entries: int = 100_000, max_per_scope: int = 1_000,
                   name: str = "semantic", port: int | None = None) -> Semantic:
    port = port if port is not None else procs.free_port()
    argv = [sys.executable, "-m", "meshcache.semantic", "--port", str(port), "--embedder-url", embedder_url,
            "--max-entries", str(max_entries), "--max-per-scope", str(max_per_scope)]
    proc = procs.start_ready(name, argv, log_dir, [(procs.http_ok(f"http://127.0.0.1:{port}/healthz"), 30, "ready")])
    return Semantic(proc, port)
