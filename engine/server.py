"""Runs the engine: loads the repository, serves gRPC, REST and metrics, drains on SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from meshcache.engine.grpc_server import create_server
from meshcache.engine.http_server import HttpApp
from meshcache.engine.metrics import EngineMetrics
from meshcache.engine.openai_api import OpenAIEndpoints
from meshcache.engine.openai_models import load_served
from meshcache.engine.repository import ModelRepository
from meshcache.engine.service import InferenceService


@dataclass(frozen=True)
class Settings:
    model_repository: Path
    host: str = "0.0.0.0"
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002  # 0 disables the metrics endpoint
    intra_op_threads: int = 1
    max_request_bytes: int = 16 * 2**20
    shutdown_grace_seconds: float = 30.0
    # "explicit": the model repository API may load and unload models; "none": it refuses to.
    model_control_mode: str = "explicit"


class _UvicornServer(uvicorn.Server):
    """uvicorn without its own signal handling: the engine decides when HTTP stops."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def log(message: str) -> None:
    print(f"meshcache-engine: {message}", file=sys.stderr, flush=True)


async def serve(settings: Settings) -> None:
    # onnxruntime releases the GIL while it runs; when a run ends, its thread needs the GIL back to
    # hand the answers over, and waits up to the switch interval (5 ms by default) for the event
    # loop thread to yield it: a stall per batch. A short interval bounds that wait.
    sys.setswitchinterval(float(os.environ.get("MESHCACHE_ENGINE_SWITCH_INTERVAL", "0.0005")))
    repository = ModelRepository.load(settings.model_repository, settings.intra_op_threads)
    metrics = EngineMetrics()
    service = InferenceService(repository, metrics, allow_model_control=settings.model_control_mode == "explicit",
                               unload_grace_seconds=settings.shutdown_grace_seconds)
    service.start()
    # Models with an openai.json are also served on /v1/chat/completions, /v1/embeddings, ...
    served = load_served(settings.model_repository, repository.models)
    openai = OpenAIEndpoints(service, served, settings.max_request_bytes)

    grpc_server = create_server(service, settings.host, settings.grpc_port, settings.max_request_bytes)
    await grpc_server.start()
    http_server = _UvicornServer(uvicorn.Config(
        HttpApp(service, settings.max_request_bytes, openai), host=settings.host, port=settings.http_port,
        lifespan="off", access_log=False, log_level="warning", server_header=False, date_header=True,
        timeout_graceful_shutdown=5, limit_concurrency=1024,
        # httptools (C) parses HTTP/1.1 several times faster than the pure-Python h11.
        http="httptools",
    ))
    http_task = asyncio.create_task(http_server.serve())
    if settings.metrics_port:
        metrics.serve(settings.metrics_port, settings.host)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    while not http_server.started and not http_task.done():
        await asyncio.sleep(0.01)
    if http_task.done():
        await http_task  # re-raises the bind error
        raise OSError(f"HTTP server on {settings.host}:{settings.http_port} stopped at startup")
    models = ", ".join(f"{n}@{e.default_version}" for n, e in repository.models.items())
    if served:
        log(f"OpenAI-compatible API on http {settings.http_port}: {', '.join(sorted(served))}")
    log(f"serving {models}; http {settings.http_port}, grpc {settings.grpc_port}, "
        f"metrics {settings.metrics_port or 'off'}")

    await stop.wait()
    # Refuse new requests at once, let the in-flight ones finish, then close the listeners.
    log("draining")
    service.begin_drain()
    if not await service.wait_idle(settings.shutdown_grace_seconds):
        log(f"{service.in_flight} requests still running after {settings.shutdown_grace_seconds}s")
    await grpc_server.stop(grace=1.0)
    http_server.should_exit = True
    await http_task
    await service.stop()
    metrics.stop()
    log("stopped")
