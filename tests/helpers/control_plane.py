"""Test helpers: a real control-plane process on free ports and its API clients."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from meshcache.ctl import launchers, procs

WRITE_TOKEN = "write-token-0123456789abcdef"
READ_TOKEN = "read-token-0123456789abcdef"
TOKENS = f"write:admin:{WRITE_TOKEN},read:viewer:{READ_TOKEN}"
T = TypeVar("T")


@dataclass
class ControlPlaneProc:
    proc: procs.Proc
    http_port: int
    xds_port: int
    argv: list[str]
    env: dict[str, str]
    log_dir: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def client(self, token: str | None = WRITE_TOKEN) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return procs.http_client(base_url=self.url, headers=headers, timeout=10)

    def restart(self) -> None:
        """Start again on the same ports (after stop() or kill())."""
        self.proc.stop()
        self.proc = _launch(self.proc.name, self.argv, self.env, self.log_dir, self.http_port, self.xds_port)


def _launch(name: str, argv: list[str], env: dict[str, str], log_dir: Path, http_port: int,
            xds_port: int) -> procs.Proc:
    # /healthz, not /readyz: some tests start it while Redis is down on purpose.
    return launchers.start_control_plane(argv, env, log_dir, http_port, xds_port, name=name)


def start_control_plane(log_dir: Path, redis_port: int, name: str = "control-plane",
                        extra_env: dict[str, str] | None = None, wasm_path: Path | None = None
                        ) -> ControlPlaneProc:
    http_port, xds_port = procs.free_port(), procs.free_port()
    argv = launchers.control_plane_argv(redis_port, http_port, xds_port,
                                       *(["--wasm-path", str(wasm_path)] if wasm_path is not None else []))
    env = {"MESHCACHE_CP_TOKENS": TOKENS, "MESHCACHE_CP_REDIS_TIMEOUT_S": "0.5",
           "MESHCACHE_CP_RESYNC_INTERVAL_S": "0.5", **(extra_env or {})}
    proc = _launch(name, argv, env, log_dir, http_port, xds_port)
    return ControlPlaneProc(proc, http_port, xds_port, argv, env, log_dir)


@contextlib.contextmanager
def module_control_plane(tmp_path_factory: pytest.TempPathFactory,
                         extra_env: dict[str, str] | None = None) -> Iterator[ControlPlaneProc]:
    """A Redis and a control plane for a module's tests that only read, or write only their own
    prefixes: a replica started per test costs ~0.6 CPU-s, mostly imports."""
    d = tmp_path_factory.mktemp("module-cp")
    redis, port = launchers.start_redis(d / "redis")
    try:
        cp = start_control_plane(d / "logs", port, extra_env=extra_env)
        try:
            yield cp
        finally:
            cp.proc.stop()
    finally:
        redis.stop()


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)
