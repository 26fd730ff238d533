"""Child processes on free loopback ports: start, wait until ready, stop.

Tests, benchmarks and `meshcache up` all supervise processes the same way: each process is a
child of the caller, logs to a file, and is stopped (SIGTERM, then SIGKILL) when done.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import random
import signal
import socket
import ssl
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from meshcache.ctl.interrupts import deferred_stop_signals

PORT_RANGE_ENV = "MESHCACHE_PORT_RANGE"


def port_range() -> range | None:
    """The ports `free_port` (and `meshcache up`'s `Ports.free`) pick from when
    MESHCACHE_PORT_RANGE=low-high is set. The test suite gives each parallel worker its own: a
    port one worker picked and has not bound yet is then never handed to another, as the kernel's
    choice for port 0 can be (and a server with SO_REUSEPORT, as gRPC's and Envoy's are by
    default, would then share the port silently)."""
    raw = os.environ.get(PORT_RANGE_ENV, "").strip()
    if not raw:
        return None
    low, sep, high = raw.partition("-")
    if not (sep and low.strip().isdigit() and high.strip().isdigit()
            and 1024 <= int(low) < int(high) <= 65535):
        raise ValueError(f"{PORT_RANGE_ENV} is low-high with 1024 <= low < high <= 65535, not {raw!r}")
    return range(int(low), int(high) + 1)


@functools.cache
def _walk(pool: range) -> Iterator[int]:
    """This process's walk through `pool`, endless, from a random start."""
    start = random.randrange(len(pool))
    return (pool[(start + i) % len(pool)] for i in itertools.count())


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now: the kernel's choice, or with
    MESHCACHE_PORT_RANGE the next free one in that range (from a random start, so this process
    hands out no port twice until it has walked the whole range)."""
    pool = port_range()
    if pool is None:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])
    walk = _walk(pool)
    for _ in range(len(pool)):
        port = next(walk)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise OSError(f"no free port in {PORT_RANGE_ENV}={pool.start}-{pool.stop - 1}")


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


@dataclass
class Proc:
    """A supervised child process and its log file.

    Logs are appended across restarts; each start writes a marker line first and `log_offset` is
    where this start's output begins, so `log_tail` never shows an earlier run's last words."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    _log: object = field(repr=False, default=None)
    log_offset: int = 0

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        """The last `lines` lines this run wrote (bounded read: the final 64 KiB at most)."""
        try:
            with open(self.log_path, "rb") as f:
                size = f.seek(0, os.SEEK_END)
                f.seek(max(self.log_offset, size - 64 * 1024))
                text = f.read().decode(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout: float = 10.0) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=5)
        if self._log is not None:
            self._log.close()  # type: ignore[attr-defined]
            self._log = None

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(timeout=5)


class StartError(RuntimeError):
    """A child process failed to start or become ready; the message carries its log tail."""


def start(
    name: str,
    argv: Sequence[str],
    log_dir: Path,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> Proc:
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    log = open(log_path, "ab")  # noqa: SIM115 - closed by Proc.stop
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    log.write(f"===== meshcache: {name} started {stamp}: {' '.join(argv)} =====\n".encode())
    log.flush()
    offset = log.tell()
    full_env = dict(os.environ)
    if env:
        full_env.update(env)
    try:
        popen = subprocess.Popen(
            list(argv), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=full_env, cwd=str(cwd) if cwd else None,
        )
    except FileNotFoundError as exc:
        log.close()
        raise StartError(f"{name}: cannot run {argv[0]!r}: {exc}") from exc
    return Proc(name=name, popen=popen, log_path=log_path, _log=log, log_offset=offset)


def wait_until(
    proc: Proc, ready: Callable[[], bool], timeout: float = 30.0, what: str = "ready"
) -> None:
    """Poll `ready` until true; fail fast with the log tail if the process dies or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not proc.alive():
            raise StartError(
                f"{proc.name} exited with {proc.popen.returncode} before {what}:\n{proc.log_tail()}"
            )
        with contextlib.suppress(Exception):
            if ready():
                return
        time.sleep(0.05)
    raise StartError(f"{proc.name} not {what} after {timeout:.0f}s:\n{proc.log_tail()}")


def start_ready(
    name: str,
    argv: Sequence[str],
    log_dir: Path,
    checks: Sequence[tuple[Callable[[], bool], float, str]],
    env: dict[str, str] | None = None,
) -> Proc:
    """Start a child and wait for each (check, timeout, what) in turn; a child that never gets
    ready is stopped before the error propagates, so a failed start leaves nothing behind."""
    proc: Proc | None = None
    try:
        # A stop signal while the child starts is handled once `proc` holds it (the supervisor
        # is stopped that way mid-start): it then stops the child instead of orphaning it.
        with deferred_stop_signals():
            proc = start(name, argv, log_dir, env=env)
        for check, timeout, what in checks:
            wait_until(proc, check, timeout=timeout, what=what)
    except BaseException:
        if proc is not None:
            proc.stop()
        raise
    return proc


@functools.cache
def _ca_context() -> ssl.SSLContext:
    return httpx.create_ssl_context()


def http_client(**kwargs: Any) -> httpx.Client:
    """An httpx client (kwargs as httpx.Client's, same certificate checks) sharing one loaded CA
    bundle: each new client otherwise loads it again, ~20-40 ms of CPU, far more than a loopback
    request."""
    return httpx.Client(verify=_ca_context(), **kwargs)


@functools.cache
def local_http() -> httpx.Client:
    """One client per process for one-off calls to local services (readiness polls, Envoy admin,
    stats); pass the timeout per request. No keep-alive, so a restarted server never meets a
    stale pooled connection."""
    return http_client(limits=httpx.Limits(max_keepalive_connections=0))


def http_ok(url: str) -> Callable[[], bool]:
    def check() -> bool:
        return local_http().get(url, timeout=1.0).status_code == 200

    return check


def tcp_open(port: int) -> Callable[[], bool]:
    return lambda: port_open(port)


@contextlib.contextmanager
def supervised(procs: list[Proc]) -> Iterator[list[Proc]]:
    """Stop every process in `procs` (in reverse start order) on exit, whatever happened."""
    try:
        yield procs
    finally:
        for p in reversed(procs):
            with contextlib.suppress(Exception):
                p.stop()
