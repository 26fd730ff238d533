"""`meshcache up --istiod`, `status` (with istiod's per-proxy sync state), healing, `demo` and
`down` through the console script: the local mesh with a real istiod in the middle."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from meshcache.ctl.mesh import state
from tests.istiod.helpers import require_istiod

CLI = [str(Path(sys.executable).parent / "meshcache")]


def run(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, env=dict(os.environ))


def test_up_istiod_status_demo_down(tmp_path: Path) -> None:
    require_istiod()
    state_dir = tmp_path / "state"
    try:
        up = run("up", "--istiod", "--detach", "--state-dir", str(state_dir))
        assert up.returncode == 0, up.stdout + up.stderr
        assert "istiod ready (every config source synced)" in up.stdout and "istiod:" in up.stdout
        endpoints = state.read_state(state_dir)["endpoints"]  # type: ignore[index]
        assert f"status page:                   {endpoints['control_plane_api']}/status" in up.stdout
        assert f"{endpoints['control_plane_api']}/metrics" in up.stdout
        for url in endpoints["engine_metrics"].values():
            assert f"metrics {url}" in up.stdout
        status = run("status", "--json", "--state-dir", str(state_dir))
        assert status.returncode == 0, status.stdout + status.stderr
        report = json.loads(status.stdout)
        assert report["healthy"] and report["endpoints"]["mode"] == "istiod"
        proxies = {p["proxy"]: p for p in report["istiod"]["proxies"]}
        assert set(report["endpoints"]["sidecars"]) <= set(proxies)
        engine = proxies["meshcache-engine-green-1.meshcache"]
        assert engine["synced"] and engine["types"]["TypedExtensionConfig"] == "ACKED", engine
        text = run("status", "--state-dir", str(state_dir)).stdout
        assert "istiod sync state (/debug/syncz):" in text and "ok   meshcache-engine-green-1.meshcache" in text
        assert text.startswith("mesh ready ("), text

        # A sidecar that stops answering (stopped, not exited: nothing heals it): degraded, not "ready".
        client = next(c for c in state.read_state(state_dir)["children"]  # type: ignore[index]
                      if c["name"] == "sidecar-meshcache-client-1")
        os.kill(client["pid"], signal.SIGSTOP)
        try:
            stopped = run("status", "--state-dir", str(state_dir))
        finally:
            os.kill(client["pid"], signal.SIGCONT)
        assert stopped.returncode == 1
        first = stopped.stdout.splitlines()[0]
        assert first.startswith("mesh DEGRADED: ") and "sidecar meshcache-client-1.meshcache" in first, stopped.stdout

        # The supervisor restarts istiod (same ports); the sidecars reconnect and resync.
        istiod = next(c for c in state.read_state(state_dir)["children"] if c["name"] == "istiod")  # type: ignore[index]
        os.kill(istiod["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            report = json.loads(run("status", "--json", "--state-dir", str(state_dir)).stdout)
            if report["healthy"] and report["components"]["istiod"]["restarts"] == 1:
                break
            time.sleep(0.5)
        assert report["healthy"] and report["components"]["istiod"]["restarts"] == 1, report["components"]["istiod"]

        demo = run("demo", "--state-dir", str(state_dir))
        assert demo.returncode == 0, demo.stdout + demo.stderr
        rows = [line.split() for line in demo.stdout.splitlines() if line.startswith("mlp-classifier ")]
        for transport in ("gRPC", "REST"):
            marks = [r[3] for r in rows if r[1] == transport][:2]
            assert marks == ["MISS", "HIT"], (transport, demo.stdout)
        assert "ACK seen by istiod" in demo.stdout
    finally:
        current = state.read_state(state_dir)
        down = run("down", "--state-dir", str(state_dir))
        assert down.returncode == 0, down.stdout + down.stderr
    assert current is not None
    assert not any(state.pid_alive(c["pid"], c.get("start_time")) for c in current["children"])
