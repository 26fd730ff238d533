"""The running mesh as seen from other commands: `mesh.json` in the state dir.

The supervisor writes its pid, status (starting/ready/failed/stopping), endpoints and its
children's pids (with their start times, so a recycled pid is never signalled). `down`,
`status`, `demo` and `policy` read it; `down` falls back to signalling the children itself
should the supervisor be gone or stuck.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

STATE_FILE = "mesh.json"


def state_path(state_dir: Path) -> Path:
    return state_dir / STATE_FILE


def write_state(state_dir: Path, data: dict[str, Any]) -> None:
    """Atomically (rename), so readers never see half a file."""
    state_dir.mkdir(parents=True, exist_ok=True)
    tmp = state_dir / f".{STATE_FILE}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, state_path(state_dir))


def read_state(state_dir: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(state_path(state_dir).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def clear_state(state_dir: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        state_path(state_dir).unlink()


def _start_time(pid: int) -> tuple[int, str] | None:
    """(start time, state letter) from /proc/PID/stat, or None when there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()
    return int(fields[19]), fields[0]


def process_start_time(pid: int) -> int | None:
    """When the process started (clock ticks since boot); None when there is no such process."""
    info = _start_time(pid)
    return info[0] if info else None


def pid_alive(pid: int, start_time: int | None = None) -> bool:
    """Running (not a zombie) and, when `start_time` is given, the very process we started."""
    info = _start_time(pid)
    if info is None or info[1] == "Z":
        return False
    return start_time is None or info[0] == start_time


def terminate(pid: int, start_time: int | None, timeout: float) -> bool:
    """SIGTERM, wait up to `timeout`, then SIGKILL (bounded). True if the process is gone."""
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
        if not pid_alive(pid, start_time):
            return True
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and pid_alive(pid, start_time):
            time.sleep(0.05)
    return not pid_alive(pid, start_time)


def running(state: dict[str, Any] | None) -> bool:
    return bool(state) and pid_alive(int(state["pid"]), state.get("pid_start_time"))  # type: ignore[index]


def leftover_children(state: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for c in state.get("children", []) if pid_alive(int(c["pid"]), c.get("start_time"))]


def stop_mesh(state_dir: Path, timeout: float = 60.0) -> list[str]:
    """Stop the mesh recorded in `state_dir`; returns the names of processes that had to be killed.

    The supervisor stops its children in reverse start order on SIGTERM; whatever is still alive
    afterwards (supervisor killed or stuck) is terminated here, child by child."""
    state = read_state(state_dir)
    if state is None:
        return []
    forced: list[str] = []
    pid, start = int(state["pid"]), state.get("pid_start_time")
    if pid_alive(pid, start) and not terminate(pid, start, timeout):
        forced.append("supervisor")
    for child in leftover_children(state):
        forced.append(child["name"])
        terminate(int(child["pid"]), child.get("start_time"), 5.0)
    clear_state(state_dir)
    return forced
