"""Start the real third-party services meshcache runs with: redis-server and Envoy."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx

from meshcache import procs
from meshcache.paths import envoy_binary


def start_redis(data_dir: Path, port: int | None = None, name: str = "redis") -> tuple[procs.Proc, int]:
    """A redis-server on 127.0.0.1 with AOF on (acknowledged writes survive a restart)."""
    binary = shutil.which("redis-server")
    if not binary:
        raise procs.StartError("redis-server not found: install the Debian package (make setup)")
    port = port or procs.free_port()
    data_dir.mkdir(parents=True, exist_ok=True)
    argv = [
        binary, "--bind", "127.0.0.1", "--port", str(port), "--dir", str(data_dir),
        "--appendonly", "yes", "--appendfsync", "everysec", "--save", "",
        "--daemonize", "no", "--protected-mode", "yes", "--maxmemory", "256mb",
    ]
    proc = procs.start(name, argv, data_dir)
    procs.wait_until(proc, procs.tcp_open(port), timeout=15, what="accepting connections")
    return proc, port


def start_envoy(
    config_path: Path, admin_port: int, log_dir: Path, name: str = "envoy", concurrency: int = 1,
    extra_args: list[str] | None = None,
) -> procs.Proc:
    """Envoy as a child process; ready once its admin endpoint reports LIVE."""
    argv = [
        envoy_binary(), "-c", str(config_path), "--disable-hot-restart",
        "--concurrency", str(concurrency), "--log-level", "info", *(extra_args or []),
    ]
    proc = procs.start(name, argv, log_dir)

    def live() -> bool:
        r = httpx.get(f"http://127.0.0.1:{admin_port}/ready", timeout=1.0)
        return r.status_code == 200 and r.text.strip() == "LIVE"

    procs.wait_until(proc, live, timeout=30, what="LIVE")
    return proc


def envoy_stats(admin_port: int, prefix: str = "") -> dict[str, int]:
    """Counters and gauges from Envoy's admin /stats (optionally those starting with prefix)."""
    text = httpx.get(
        f"http://127.0.0.1:{admin_port}/stats", params={"filter": prefix} if prefix else None, timeout=5
    ).text
    out: dict[str, int] = {}
    for line in text.splitlines():
        name, sep, value = line.partition(": ")
        if sep and value.strip().lstrip("-").isdigit():
            out[name] = int(value)
    return out
