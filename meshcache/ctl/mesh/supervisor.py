"""`meshcache up`: a supervisor process owns the mesh; the command in the terminal follows it.

The supervisor runs in its own session (so a terminal's Ctrl-C reaches only `meshcache up`,
which then asks the supervisor to stop the children in reverse order), writes mesh.json,
restarts components that exit (meshcache.ctl.mesh.healing) and rotates the sidecars' certificates
before they expire (meshcache.ctl.mesh.certs; Envoy picks them up over SDS). Foreground and
`--detach` run the very same supervisor: in the foreground the command waits for it and forwards
SIGINT/SIGTERM; detached it returns once the mesh is ready and `meshcache down` stops it later.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

from meshcache.ctl.mesh import state
from meshcache.ctl.mesh.certs import not_after
from meshcache.ctl.mesh.config import MeshConfig
from meshcache.ctl.mesh.errors import MeshError
from meshcache.ctl.mesh.healing import Healer, RestartPolicy
from meshcache.ctl.mesh.topology import Mesh

CONFIG_FILE = "mesh-config.json"
SUPERVISOR_LOG = "supervisor.log"
READY_TIMEOUT_S = 120.0
KUBE_READY_TIMEOUT_S = 300.0  # `up --kube`: a cluster, istiod, and pods whose agents fetch the filter
STOP_TIMEOUT_S = 60.0


class _Stop(BaseException):
    """Raised from the signal handler so a start in progress unwinds and stops what it started.
    A BaseException, so no `except Exception` on the way (a failed certificate rotation, a restart)
    swallows a stop request and leaves children running after the supervisor is killed."""


def _raise_stop(signum: int, _frame: FrameType | None) -> None:
    raise _Stop(signal.Signals(signum).name)


def config_to_json(config: MeshConfig) -> dict[str, Any]:
    raw = dataclasses.asdict(config)
    raw["state_dir"] = str(config.state_dir)
    return raw


def supervise(config: MeshConfig) -> int:
    """The supervisor's main: start the mesh, record it, watch it, stop it on SIGTERM/SIGINT/SIGHUP."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _raise_stop)
    me = {"pid": os.getpid(), "pid_start_time": state.process_start_time(os.getpid()),
          "state_dir": str(config.state_dir)}
    mesh: Mesh | None = None
    healer: Healer | None = None
    ready: dict[str, Any] = {}

    def record(status: str, **extra: Any) -> None:
        children = mesh.children() if mesh else []
        if healer is not None:
            for child in children:
                child.update(healer.records[child["name"]].to_json())
        certs = _certificate_report(mesh) if mesh and mesh.certs else {}
        state.write_state(config.state_dir, {**me, "status": status, "children": children, **ready,
                                             "certificates": certs, **extra})

    def log(message: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} {message}", flush=True)
        # Each progress line follows a child's start: keep the pids on disk, so `down` finds
        # them even if this process is killed mid-start.
        record("starting")

    try:
        record("starting")
        mesh = build_mesh(config, log=log)
        mesh.start()
    except _Stop as exc:
        _quiet_stop(mesh, config.state_dir, f"stopped during start ({exc})")
        return 0
    except Exception as exc:  # MeshError says what failed; anything else is a bug, reported as such
        message = str(exc) if isinstance(exc, MeshError) else f"{type(exc).__name__}: {exc}"
        if not isinstance(exc, MeshError):
            traceback.print_exc()
        print(f"mesh failed to start: {message}", flush=True)
        if mesh is not None:
            mesh.stop()
        record("failed", error=message)
        return 1
    try:  # from "ready" on (`up` may stop it as soon as it reads that), a stop is an orderly stop
        ready.update(endpoints=mesh.endpoints(), started_at=time.time())
        healer = mesh.healer(_restart_policy(config), log=_say)
        healer.start_probes()  # liveness (the control plane's xDS round trip), as kubelet's
        record("ready")
        _say("mesh is up")
        next_cert_check = time.monotonic() + config.cert_check_interval_s
        while True:
            time.sleep(0.5)
            changed = healer.tick()
            if time.monotonic() >= next_cert_check:
                next_cert_check = time.monotonic() + config.cert_check_interval_s
                changed |= _rotate(mesh)
            if changed:
                record("ready")
    except _Stop as exc:
        if healer is not None:
            healer.stop_probes()  # no liveness kill of what the orderly stop is stopping
        _quiet_stop(mesh, config.state_dir, f"stopping ({exc})")
    return 0


def build_mesh(config: MeshConfig, log: Callable[[str], None]) -> Any:
    """The local mesh, or with `istiod` the one with a real istiod in the middle (same interface
    for the supervisor: start/stop, children, endpoints, healer, certificates)."""
    if config.kube:
        from meshcache.ctl.kube.up import KubeUp, KubeUpConfig

        return KubeUp(KubeUpConfig(state_dir=config.state_dir, replicas=config.kube_replicas or None), log=log)
    if not config.istiod:
        return Mesh(config, log=log)
    from meshcache.ctl.istiod.mesh import IstiodMesh, IstiodMeshConfig

    return IstiodMesh(IstiodMeshConfig(work_dir=config.state_dir, replicas=config.replicas, affinity=config.affinity,
                                       canary_color=config.canary_color, policies=config.policies,
                                       filter=config.filter), log=log)


def _say(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {message}", flush=True)


def _restart_policy(config: MeshConfig) -> RestartPolicy:
    return RestartPolicy(initial_backoff_s=config.restart_initial_backoff_s,
                         max_backoff_s=config.restart_max_backoff_s,
                         crash_loop_limit=config.crash_loop_limit, stable_after_s=config.stable_after_s)


def _rotate(mesh: Mesh) -> bool:
    """Certificates due for renewal are re-issued; a failure is reported and retried next time."""
    try:
        issued = mesh.refresh_certificates()
    except Exception as exc:  # disk full, unreadable CA ...: the current certificates stay in place
        _say(f"certificate rotation failed (retrying at the next check): {type(exc).__name__}: {exc}")
        return False
    if issued:
        _say(f"rotated certificates: {', '.join(issued)} (valid {mesh.config.cert_hours:g} h; "
             f"the sidecars load them over SDS, no restart)")
        if "control-plane.crt" in issued:
            _say("restarted the control plane to load its new xDS certificate")
    return bool(issued)


def _certificate_report(mesh: Mesh) -> dict[str, str]:
    assert mesh.certs is not None
    out = {}
    for name, identity in (("client-sidecar", mesh.certs.client), ("server-sidecar", mesh.certs.server)):
        try:
            out[name] = not_after(identity.cert).strftime("%Y-%m-%dT%H:%M:%SZ")
        except (OSError, ValueError):
            out[name] = "unreadable"
    return out


def _quiet_stop(mesh: Mesh | None, state_dir: Path, message: str) -> None:
    # A second Ctrl-C must not interrupt the orderly stop half way.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    print(f"{time.strftime('%H:%M:%S')} {message}: stopping all components", flush=True)
    if mesh is not None:
        mesh.stop()
    state.clear_state(state_dir)
    print(f"{time.strftime('%H:%M:%S')} stopped", flush=True)


def spawn(config: MeshConfig) -> subprocess.Popen[bytes]:
    """Start the supervisor as a new session; its output goes to logs/supervisor.log."""
    config.log_dir.mkdir(parents=True, exist_ok=True)
    config_path = config.state_dir / CONFIG_FILE
    config_path.write_text(json.dumps(config_to_json(config), indent=2) + "\n")
    with open(config.log_dir / SUPERVISOR_LOG, "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "meshcache.ctl.cli", "up", "--supervise", "--config", str(config_path),
             "--state-dir", str(config.state_dir)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )


class LogFollower:
    """Prints what the supervisor appends to its log (progress, exits) to this terminal."""

    def __init__(self, path: Path, out: TextIO) -> None:
        self.path, self.out = path, out
        self.offset = path.stat().st_size if path.exists() else 0

    def pump(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return
        if data:
            self.offset += len(data)
            self.out.write(data.decode(errors="replace"))
            self.out.flush()


def wait_ready(proc: subprocess.Popen[bytes], config: MeshConfig, follower: LogFollower,
               timeout: float = READY_TIMEOUT_S) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        follower.pump()
        exited = proc.poll() is not None  # before reading the state: a failure is recorded before exit
        current = state.read_state(config.state_dir)
        if current and current.get("pid") == proc.pid:
            if current.get("status") == "ready":
                return current
            if current.get("status") == "failed":
                proc.wait(timeout=10)
                state.clear_state(config.state_dir)
                raise MeshError(str(current.get("error")))
        if exited:
            follower.pump()
            state.stop_mesh(config.state_dir, timeout=5)
            raise MeshError(f"the mesh supervisor exited with {proc.returncode} before the mesh was ready "
                            f"(log: {config.log_dir / SUPERVISOR_LOG})")
        time.sleep(0.1)
    stop_supervisor(proc, config)
    raise MeshError(f"the mesh was not ready after {timeout:.0f}s; stopped it (log: {config.log_dir / SUPERVISOR_LOG})")


def stop_supervisor(proc: subprocess.Popen[bytes], config: MeshConfig) -> list[str]:
    """SIGTERM the supervisor (it stops the children), bounded; then stop whatever it left behind."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
    # Anything the supervisor could not stop (it was killed, or stuck) is stopped here.
    return state.stop_mesh(config.state_dir, timeout=5)


def follow(proc: subprocess.Popen[bytes], config: MeshConfig, follower: LogFollower, banner: str = "") -> int:
    """Foreground `up`: until Ctrl-C/SIGTERM (then stop the mesh) or until the supervisor ends.
    `banner` is printed once the handlers are in place, so a Ctrl-C right after it stops cleanly."""
    stop: list[str] = []

    def request_stop(signum: int, _frame: FrameType | None) -> None:
        stop.append(signal.Signals(signum).name)

    # SIGHUP too: a closed terminal stops the mesh rather than orphaning it.
    old = {s: signal.signal(s, request_stop) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    if banner:
        print(banner, flush=True)
    try:
        while proc.poll() is None and not stop:
            follower.pump()
            time.sleep(0.2)
        if stop:
            forced = stop_supervisor(proc, config)
            follower.pump()
            if forced:
                print(f"had to kill: {', '.join(forced)}", file=sys.stderr)
            return 0
        # The supervisor ended on its own (`meshcache down`, or it died): leave nothing behind.
        forced = state.stop_mesh(config.state_dir, timeout=5)
        follower.pump()
        if forced:
            print(f"the supervisor exited with {proc.returncode}; killed what it left: {', '.join(forced)}",
                  file=sys.stderr)
        return 0 if proc.returncode == 0 else 1
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
