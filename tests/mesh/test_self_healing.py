"""Each component of a running mesh (`meshcache up --detach`) SIGKILLed under light load: the
supervisor brings it back, `meshcache status` is healthy again within seconds and counts the
restart, and no answer is ever wrong (every one is compared with the engines' bytes). Failed
requests are allowed only while the component is down and only where its absence must show:
none for Redis and the control plane (the sidecars keep their config), uncached requests for an
engine (hits keep coming from the server sidecar), everything for a sidecar."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from meshcache.ctl.mesh import state
from meshcache.ctl.mesh.api_client import ApiError, PolicyApi
from meshcache.ctl.mesh.config import Ports
from meshcache.ctl.mesh.topology import SERVER_NODE
from tests.helpers.load import KINDS, Load, call, expected_answers

CLI = [str(Path(sys.executable).parent / "meshcache")]
RECOVERY_LIMIT_S = 30.0  # generous for a shared 2-core machine; the measured times are printed
# After a component is back, each load caller must get every kind answered right this many more
# times in a row (a clean window measured in answers, not seconds) before the next kill.
CLEAN_ROUNDS = 2

# Which request kinds may fail while a component is down.
ENGINE_BOUND = {"grpc-engine", "rest-engine"}
CANARY_BOUND = {"rest-blue-engine"}
MAY_FAIL: dict[str, set[str]] = {
    "redis": set(),
    "control-plane": set(),
    "engine": ENGINE_BOUND,
    "engine-canary": CANARY_BOUND,
    "server-sidecar": {k.name for k in KINDS},
    "client-sidecar": {k.name for k in KINDS},
}


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


def _status(state_dir: Path) -> tuple[bool, dict[str, Any]]:
    out = _cli("status", "--json", "--state-dir", str(state_dir))
    return out.returncode == 0, json.loads(out.stdout) if out.stdout.startswith("{") else {}


@pytest.fixture
def running_mesh(tmp_path: Path) -> Iterator[tuple[Path, Ports]]:
    state_dir = tmp_path / "state"
    ports = Ports.free()
    config = tmp_path / "mesh.json"
    # Only mlp-classifier is cached, for 10 minutes: hits stay hits for the whole test.
    config.write_text(json.dumps({"ports": asdict(ports),
                                  "policies": {"mlp-classifier": {"ttl_s": 600, "max_ttl_s": 1800}}}))
    try:
        up = _cli("up", "--detach", "--config", str(config), "--state-dir", str(state_dir), timeout=240)
        assert up.returncode == 0, up.stdout + up.stderr
        yield state_dir, ports
    finally:
        state.stop_mesh(state_dir, timeout=30)


def _kill(state_dir: Path, name: str) -> int:
    current = state.read_state(state_dir)
    assert current is not None
    child = next(c for c in current["children"] if c["name"] == name)
    assert state.pid_alive(child["pid"], child["start_time"])  # the very process the mesh started
    os.kill(child["pid"], signal.SIGKILL)
    return int(child["pid"])


def _wait_healthy(state_dir: Path, name: str, restarts: int) -> dict[str, Any]:
    deadline = time.monotonic() + RECOVERY_LIMIT_S
    report: dict[str, Any] = {}
    while time.monotonic() < deadline:
        healthy, report = _status(state_dir)
        if healthy and report["components"][name]["restarts"] == restarts:
            return report
        time.sleep(0.1)
    log = (state_dir / "logs" / "supervisor.log").read_text()[-3000:]
    pytest.fail(f"{name} not back and healthy within {RECOVERY_LIMIT_S:.0f}s: {report}\n{log}")


def _put_retrying_503(api: PolicyApi, model_prefix: str, spec: dict[str, Any]) -> tuple[int, int]:
    """A policy write as a client does it: a 503 says nothing was applied and to retry (Redis
    may still be syncing its append-only file to disk on a loaded machine). Returns the new
    version and how many 503s came first; any other refusal fails at once."""
    deadline = time.monotonic() + RECOVERY_LIMIT_S
    refused = 0
    while True:
        try:
            return int(api.put(model_prefix, spec)["version"]), refused
        except ApiError as exc:
            if exc.status != 503 or time.monotonic() > deadline:
                raise
            refused += 1
            time.sleep(0.2)


def test_every_component_killed_under_load_comes_back_without_a_wrong_answer(
        running_mesh: tuple[Path, Ports]) -> None:
    state_dir, ports = running_mesh
    app = f"127.0.0.1:{ports.app}"
    expected = expected_answers(ports.engine_http, ports.engine_grpc, ports.canary_http)
    assert expected["rest-hit"] != expected["rest-blue-hit"]  # the canary's answers differ
    for kind in KINDS:  # the hits' entries are stored now
        assert call(kind, app) == expected[kind.name], kind.name
    token = (state_dir / "token").read_text().strip()
    load = Load(app, expected).start()
    measured: list[str] = []
    try:
        # Each phase starts once every caller's every kind was answered right (the load runs).
        phase_start = time.monotonic()
        load.wait_answered(since=phase_start, timeout=RECOVERY_LIMIT_S)
        for n, (name, may_fail) in enumerate(MAY_FAIL.items()):
            old_pid = _kill(state_dir, name)
            t_kill = time.monotonic()
            report = _wait_healthy(state_dir, name, restarts=1)
            t_back = time.monotonic()
            component = report["components"][name]
            assert component["pid"] != old_pid and component["state"] == "running"
            assert "exit code -9" in component["last_exit"]
            extra = ""
            if name in ("redis", "control-plane"):
                # Writes work again, and (after a control-plane restart) reach the server sidecar.
                with PolicyApi(f"http://127.0.0.1:{ports.cp_http}", token) as api:
                    version, refused = _put_retrying_503(api, "resnet-mini", {"ttl_s": 60 + n})
                    api.wait_acked(SERVER_NODE, version, timeout=15)
                extra = (f", policy change acked {time.monotonic() - t_kill:.2f} s after the kill"
                         + (f" ({refused} write(s) answered 503 first)" if refused else ""))
            # Back: every caller gets every kind answered right by requests sent after the status
            # said healthy (requests in flight across the kill have ended by then, failed or not)...
            t_ok = load.wait_answered(since=t_back, timeout=RECOVERY_LIMIT_S)
            # ...then a clean window: every caller answers every kind right CLEAN_ROUNDS more times.
            t_end = load.wait_answered(since=t_ok, times=CLEAN_ROUNDS, timeout=RECOVERY_LIMIT_S)
            during = [o for o in load.between(phase_start, math.inf) if o.started < t_ok]
            failed = [o for o in during if not o.ok]
            assert not [o for o in failed if o.kind not in may_fail], (name, failed[:5])
            after = [o for o in load.between(t_ok, t_end) if o.started >= t_ok]
            assert after and all(o.ok for o in after), (name, [o for o in after if not o.ok][:5])
            for kind in may_fail:  # each kind that failed is answered right again after the restart
                assert any(o.ok for o in load.between(t_back, t_end) if o.kind == kind), (name, kind)
            # Per kind that failed: when its first right answer after its last failure came.
            recovered = []
            for kind in {o.kind for o in failed}:
                last_failure = max(o.at for o in failed if o.kind == kind)
                recovered.append(min(o.at for o in load.between(last_failure, t_end) if o.kind == kind and o.ok))
            worst = max(recovered, default=t_kill) - t_kill
            measured.append(f"{name}: status healthy {t_back - t_kill:.2f} s after SIGKILL; "
                            f"{len(failed)} of {len(during)} requests failed while down"
                            + (f", every kind answered right again {worst:.2f} s after the kill" if failed else "")
                            + extra)
            phase_start = t_end
    finally:
        load.stop()
    assert not [o for o in load.outcomes if o.wrong], [o for o in load.outcomes if o.wrong][:5]
    assert len(load.outcomes) > 200  # the load really ran
    print("\n" + "\n".join(measured))
    _, report = _status(state_dir)
    assert all(c["restarts"] == 1 for c in report["components"].values()), report["components"]
    assert "cache was emptied" in report["components"]["server-sidecar"]["note"]
    text = _cli("status", "--state-dir", str(state_dir)).stdout
    assert "restarts 1" in text and "its response cache was emptied by the restart" in text
    # The server sidecar's cache is new: a hit kind was stored again after the restart.
    assert call(KINDS[1], app) == expected[KINDS[1].name]


def test_a_stopped_control_plane_is_killed_by_its_liveness_probe_and_restarted(
        running_mesh: tuple[Path, Ports]) -> None:
    """SIGSTOP: the process lives on and its ports still accept, so only a probe that needs an
    answer notices. The supervisor's liveness probe (the rendered one: GET /healthz/xds) has it
    killed and restarted, as kubelet would; the sidecars keep serving meanwhile."""
    state_dir, ports = running_mesh
    app = f"127.0.0.1:{ports.app}"
    expected = expected_answers(ports.engine_http, ports.engine_grpc, ports.canary_http)
    for kind in KINDS:
        assert call(kind, app) == expected[kind.name], kind.name
    current = state.read_state(state_dir)
    assert current is not None
    cp = next(c for c in current["children"] if c["name"] == "control-plane")
    os.kill(cp["pid"], signal.SIGSTOP)
    try:
        t_stop = time.monotonic()
        for kind in KINDS:  # served by the sidecars from their last config
            assert call(kind, app) == expected[kind.name], kind.name
        report = _wait_healthy(state_dir, "control-plane", restarts=1)
        back_s = time.monotonic() - t_stop
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(cp["pid"], signal.SIGCONT)
    component = report["components"]["control-plane"]
    assert component["pid"] != cp["pid"] and component["last_exit"].startswith("killed by its liveness probe")
    assert "liveness probes failed in a row (GET http://127.0.0.1:" in \
        (state_dir / "logs" / "supervisor.log").read_text()
    token = (state_dir / "token").read_text().strip()
    with PolicyApi(f"http://127.0.0.1:{ports.cp_http}", token) as api:
        version, _ = _put_retrying_503(api, "resnet-mini", {"ttl_s": 77})
        api.wait_acked(SERVER_NODE, version, timeout=15)
    for kind in KINDS:
        assert call(kind, app) == expected[kind.name], kind.name
    print(f"\ncontrol plane stopped -> killed and healthy again in {back_s:.2f} s")
