"""Several xDS processes behind one port (`--xds-workers N`): the main process (HTTP API + xDS)
starts N-1 workers, each serving xDS only on the same port (SO_REUSEPORT: the kernel spreads new
connections over the listening processes) and following the snapshot from Redis like any
replica. Each worker publishes its proxies to Redis (fleet.py), so the main process's
`/v1/proxies` shows every proxy. A worker exits when the main process is gone.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time

from .settings import Settings
from .wiring import ControlPlane
from .xds_probe import probe_address

log = logging.getLogger("meshcache.control_plane.xds_workers")
PARENT_CHECK_S = 1.0
STOP_TIMEOUT_S = 3.0


def settings_env(settings: Settings) -> dict[str, str]:
    """The settings as MESHCACHE_CP_* variables (how a worker gets exactly the main's)."""
    out = {}
    for name, value in settings.model_dump().items():
        if value is not None:
            out[f"MESHCACHE_CP_{name.upper()}"] = str(value)
    return out


def start_workers(settings: Settings, xds_port: int, log_level: str, probe_token: str) -> list[subprocess.Popen[bytes]]:
    """`probe_token`: the main's XdsServer.probe_token, so the main's probe reaches every worker."""
    env = {**os.environ, **settings_env(settings), "MESHCACHE_CP_XDS_PORT": str(xds_port),
           "MESHCACHE_CP_XDS_WORKERS": "1"}
    return [subprocess.Popen([sys.executable, "-m", "meshcache.control_plane.xds_workers", "--log-level", log_level,
                              "--index", str(i), "--parent", str(os.getpid()), "--probe-token", probe_token], env=env)
            for i in range(1, settings.xds_workers)]


def stop_workers(workers: list[subprocess.Popen[bytes]], timeout: float = STOP_TIMEOUT_S + 1) -> None:
    """SIGTERM to every worker, then one deadline for all of them (each ends itself within
    STOP_TIMEOUT_S); a worker still running then is killed."""
    for w in workers:
        if w.poll() is None:
            w.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for w in workers:
        try:
            w.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            w.kill()
            w.wait(5)


async def serve_worker(settings: Settings, parent: int, probe: str) -> None:
    cp = ControlPlane(settings)
    cp.xds.probe_address = probe
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await cp.start()
    try:
        while not stop.is_set() and os.getppid() == parent:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), PARENT_CHECK_S)
    finally:
        log.info("stopping (%s)", "signal" if stop.is_set() else "the main process is gone")
        # Bounded: grpc aio's stop can hang (seen when the main died right after the worker
        # started), and so can asyncio.run's teardown of its leftover tasks; a worker holds
        # nothing that needs more than this, so it ends the process itself.
        done, _ = await asyncio.wait({asyncio.ensure_future(cp.stop())}, timeout=STOP_TIMEOUT_S)
        if done:
            log.info("stopped")
        else:
            log.warning("stop timed out after %.0f s", STOP_TIMEOUT_S)
        logging.shutdown()
        os._exit(0)


def main() -> None:
    p = argparse.ArgumentParser(prog="meshcache-control-plane xDS worker")
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--parent", type=int, required=True)
    p.add_argument("--probe-token", required=True)
    p.add_argument("--log-level", default="info")
    args = p.parse_args()
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s %(name)s[xds-worker-{args.index}]: %(message)s")
    settings = Settings()
    settings.kube_write = False  # delivery kube: the main process alone writes to the API server
    settings.instance_id = f"{settings.instance_id}-xds{args.index}"
    asyncio.run(serve_worker(settings, args.parent, probe_address(args.probe_token, args.index)))


if __name__ == "__main__":
    main()
