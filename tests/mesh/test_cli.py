"""The `meshcache` console script: up (foreground and detached), status, policy, down, and clear errors.

Each test starts its own mesh through the CLI on free ports and checks that no process is left.
The detached one runs the cache as the native host (`--filter native`) first, then, on the same
state dir, as the Wasm filter (the default).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from meshcache.contract.native_filter import NATIVE_FILTER_NAME
from meshcache.ctl import launchers
from meshcache.ctl.interrupts import deferred_stop_signals
from meshcache.ctl.mesh import state
from meshcache.ctl.procs import local_http
from tests.helpers.kserve import mlp_json, rest_infer
from tests.helpers.wait import eventually

CLI = [str(Path(sys.executable).parent / "meshcache")]
WASM_RUNTIME_STATS = r"^wasm\."  # Envoy's Wasm runtime (`wasm.envoy.wasm.runtime.v8.*`); a regex


def run(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def _pids(state_dir: Path) -> list[tuple[int, int | None]]:
    current = state.read_state(state_dir)
    assert current is not None
    return [(current["pid"], current["pid_start_time"])] + [(c["pid"], c["start_time"]) for c in current["children"]]


def _all_gone(pids: list[tuple[int, int | None]], timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(state.pid_alive(pid, start) for pid, start in pids):
            return True
        time.sleep(0.1)
    return False


def _cleanup(state_dir: Path) -> None:
    state.stop_mesh(state_dir, timeout=10)


def test_up_detached_status_policy_down(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    try:
        up = run("up", "--detach", "--free-ports", "--filter", "native", "--state-dir", str(state_dir))
        assert up.returncode == 0, up.stdout + up.stderr
        assert "meshcache mesh is up" in up.stdout and "app (gRPC + HTTP, plaintext)" in up.stdout
        assert "cache in the server sidecars:  native host (Envoy dynamic module)" in up.stdout
        pids = _pids(state_dir)
        assert len(pids) == 7  # supervisor, redis, control plane, 2 engines, 2 sidecars
        assert (state_dir / "pki" / "client-sidecar" / "tls.key").stat().st_mode & 0o777 == 0o600

        status = run("status", "--json", "--state-dir", str(state_dir))
        assert status.returncode == 0, status.stdout + status.stderr
        report = json.loads(status.stdout)
        assert report["healthy"] and all(report["processes"].values()) and all(report["health"].values())
        assert report["endpoints"]["filter"] == "native"

        assert run("up", "--detach", "--free-ports", "--state-dir", str(state_dir)).returncode == 1  # already up

        listed = json.loads(run("policy", "list", "--json", "--state-dir", str(state_dir)).stdout)
        assert {p["model_prefix"] for p in listed["policies"]} == {"resnet-mini", "mlp-classifier", "text-embedder"}
        changed = run("policy", "set", "mlp-classifier", "--ttl", "17", "--state-dir", str(state_dir))
        assert changed.returncode == 0 and "version" in changed.stdout, changed.stderr
        app = report["endpoints"]["app"]
        body = mlp_json(seed=5001)
        deadline = time.monotonic() + 10  # until the sidecar has the new policy
        while time.monotonic() < deadline:
            rest_infer(app, "mlp-classifier", body)
            if rest_infer(app, "mlp-classifier", body).headers["cache-status"] == "meshcache; hit; ttl=17":
                break
            body = mlp_json(seed=int(time.monotonic() * 1000))
        else:
            pytest.fail("the TTL set with `meshcache policy set` never showed up in the mesh")
        # /v1/infer picks the version with x-model-version (issue 32): each version is its own
        # entry, never answered with another version's output.
        v1_body = json.dumps({"input": mlp_json(seed=5002)["inputs"][0]["data"], "shape": [1, 16]})
        answers = {}
        for version in ("1", "2"):
            for n in range(2):
                r = local_http().post(f"http://{app}/v1/infer", content=v1_body, timeout=10,
                                      headers={"x-model-id": "mlp-classifier", "x-model-version": version})
                assert r.status_code == 200, r.text
                assert r.headers["cache-status"].startswith("meshcache; hit" if n else "meshcache; fwd=miss"), \
                    (version, r.headers["cache-status"])
            answers[version] = r.content
        assert answers["1"] != answers["2"]
        # That hit came from the native host: the server sidecar's only cache filter is the dynamic
        # module, configured over ECDS (resource meshcache-native) by every policy version so far.
        admin = int(report["endpoints"]["server_sidecar_admin"].rsplit(":", 1)[1])
        ecds = launchers.envoy_stats(admin, f"extension_config_discovery.http_filter.{NATIVE_FILTER_NAME}.")
        assert ecds[f"extension_config_discovery.http_filter.{NATIVE_FILTER_NAME}.config_reload"] >= 2, ecds
        assert not launchers.envoy_stats(admin, WASM_RUNTIME_STATS), "no Wasm VM in the native host's sidecar"
        # `meshcache status` reads the native host's counters (its Prometheus names differ).
        def mlp_hits() -> int:
            cache = json.loads(run("status", "--json", "--state-dir", str(state_dir)).stdout)["cache"]
            assert cache["proxies_read"] == 1, cache
            return next(m for m in cache["models"] if m["model_prefix"] == "mlp-classifier")["hits"]
        assert eventually(mlp_hits, timeout=10, interval=0.2) >= 1
        shaped = run("policy", "set", "text-embedder", "--ttl", "600", "--max-ttl", "3600", "--ignore-field", "user",
                     "--ignore-field", "metadata", "--deterministic-only", "--state-dir", str(state_dir))
        assert shaped.returncode == 0, shaped.stderr
        listed = json.loads(run("policy", "list", "--json", "--state-dir", str(state_dir)).stdout)
        row = next(p for p in listed["policies"] if p["model_prefix"] == "text-embedder")
        assert (row["ignore_fields"], row["deterministic_only"]) == (["user", "metadata"], True)
        bad = run("policy", "set", "mlp-classifier", "--ttl", "-1", "--state-dir", str(state_dir))
        assert bad.returncode == 1 and "422" in bad.stderr

        down = run("down", "--state-dir", str(state_dir), timeout=90)
        assert down.returncode == 0 and "mesh stopped" in down.stdout, down.stdout + down.stderr
        assert "had to kill" not in down.stdout
        assert _all_gone(pids)
        assert state.read_state(state_dir) is None
        assert run("status", "--state-dir", str(state_dir)).returncode == 1

        # Up again on the same state dir: policies survived in Redis (AOF), certificates are reused.
        again = run("up", "--detach", "--free-ports", "--state-dir", str(state_dir))
        assert again.returncode == 0, again.stdout + again.stderr
        assert "cache in the server sidecars:  Wasm filter" in again.stdout
        endpoints = json.loads(run("status", "--json", "--state-dir", str(state_dir)).stdout)["endpoints"]
        admin = int(endpoints["server_sidecar_admin"].rsplit(":", 1)[1])
        assert endpoints["filter"] == "wasm" and launchers.envoy_stats(admin, WASM_RUNTIME_STATS)
        assert "issued certificates" not in again.stdout and "seeded" not in again.stdout
        listed = json.loads(run("policy", "list", "--json", "--state-dir", str(state_dir)).stdout)
        assert {p["model_prefix"]: p["ttl_s"] for p in listed["policies"]}["mlp-classifier"] == 17
        pids = _pids(state_dir)
        assert run("down", "--state-dir", str(state_dir), timeout=90).returncode == 0
        assert _all_gone(pids)
    finally:
        _cleanup(state_dir)


def _start_up(state_dir: Path) -> tuple[subprocess.Popen[str], queue.Queue[str]]:
    """`meshcache up` in the foreground; its output lines arrive on the queue."""
    proc = subprocess.Popen([*CLI, "up", "--free-ports", "--state-dir", str(state_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.put(line)
        lines.put(EOF)

    threading.Thread(target=pump, daemon=True).start()
    return proc, lines


EOF = ""  # after the process's last line (a line read from a pipe is never empty)


def _wait_for_line(proc: subprocess.Popen[str], lines: queue.Queue[str], text: str, seen: list[str],
                   timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not any(text in line for line in seen):
        assert time.monotonic() < deadline and proc.poll() is None, "".join(seen)
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            continue
        if line == EOF:
            lines.put(EOF)  # for _drain
        else:
            seen.append(line)


def _drain(lines: queue.Queue[str], seen: list[str], timeout: float = 10) -> str:
    """Everything the process wrote, up to its end of output (or `timeout` if it still runs)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            line = lines.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            break
        if line == EOF:
            break
        seen.append(line)
    return "".join(seen)


def _running_from(state_dir: Path) -> list[str]:
    """Processes whose command line names the state dir (every child of the mesh but redis)."""
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return [line for line in ps.splitlines() if str(state_dir) in line]


def _catches(pid: int, *signals: signal.Signals) -> bool:
    """Whether the process has its own handler for every one of `signals` (SigCgt in /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            mask = int(line.split()[1], 16)
            return all(mask >> (s - 1) & 1 for s in signals)
    return False


def test_up_foreground_stops_everything_on_ctrl_c(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    proc, lines = _start_up(state_dir)
    seen: list[str] = []
    try:
        _wait_for_line(proc, lines, "Ctrl-C stops the mesh", seen)
        pids = _pids(state_dir)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        assert _all_gone(pids)
        assert state.read_state(state_dir) is None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        _cleanup(state_dir)


def test_ctrl_c_while_up_starts_leaves_nothing_and_no_traceback(tmp_path: Path) -> None:
    """Ctrl-C as soon as `up` handles it (main's first line, before imports that take seconds on a
    busy machine: a traceback before), and again while the supervisor starts the children."""
    early = tmp_path / "early"
    proc, lines = _start_up(early)
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 30
        # SIGTERM: Python leaves it alone, so a handler for it is main's (SIGINT: in case this
        # test runs with SIGINT ignored, which the child inherits, until `up` sets its own).
        while not _catches(proc.pid, signal.SIGINT, signal.SIGTERM):
            assert time.monotonic() < deadline and proc.poll() is None, _drain(lines, seen)
            time.sleep(0.005)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130
        out = _drain(lines, seen)
        assert "interrupted" in out and "Traceback" not in out, out
        assert state.read_state(early) is None
        assert not _running_from(early)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        _cleanup(early)  # what a failed run left (a supervisor runs in its own session)

    mid = tmp_path / "mid"
    proc, lines = _start_up(mid)
    seen = []
    try:
        _wait_for_line(proc, lines, "starting the control plane", seen)  # redis-server is up and recorded
        pids = _pids(mid)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=90) == 130
        out = _drain(lines, seen)
        assert "interrupted: stopping what was started" in out and "Traceback" not in out, out
        assert _all_gone(pids)
        assert state.read_state(mid) is None
        # Nor the child being started at that moment (not yet in mesh.json): its arguments name the state dir.
        assert not _running_from(mid)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        _cleanup(mid)


def test_a_stop_signal_while_a_child_starts_is_handled_once_it_is_held() -> None:
    """In process: the signal waits for the end of the step, then reaches the handler that was in
    place (the supervisor's stop, `up`'s KeyboardInterrupt), which can then stop the child."""
    seen: list[object] = []
    previous = signal.signal(signal.SIGHUP, lambda signum, _frame: seen.append(signum))
    try:
        with deferred_stop_signals():
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(0.05)  # Python runs handlers between bytecodes: it had every chance
            seen.append("held")
        assert seen == ["held", signal.SIGHUP]
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_port_in_use_is_named(tmp_path: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        config = tmp_path / "mesh.json"
        config.write_text(json.dumps({"ports": {"app": port}}))
        t0 = time.monotonic()
        # Fixed defaults for the other ports may be taken on a shared machine: then that port is
        # named instead, which is just as correct; so take free ports for all but `app`.
        from meshcache.ctl.mesh.config import Ports
        free = {k: v for k, v in vars(Ports.free()).items() if k != "app"}
        config.write_text(json.dumps({"ports": {**free, "app": port}}))
        out = run("up", "--config", str(config), "--state-dir", str(tmp_path / "state"))
    assert out.returncode == 1
    assert f"port {port} (client sidecar app listener) is already in use" in out.stderr
    assert time.monotonic() - t0 < 20
    assert state.read_state(tmp_path / "state") is None


def test_missing_redis_binary_is_named(tmp_path: Path) -> None:
    out = run("up", "--free-ports", "--state-dir", str(tmp_path / "state"), env={"PATH": "/nonexistent"})
    assert out.returncode == 1
    assert "redis-server not found" in out.stderr


def test_missing_native_module_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from meshcache.ctl.mesh import topology
    from meshcache.ctl.mesh.config import MeshConfig
    from meshcache.ctl.mesh.errors import MeshError

    config = MeshConfig(state_dir=tmp_path / "state", filter="native").with_free_ports()
    topology.check_prerequisites(config)  # the built module: nothing to say
    missing = tmp_path / "libmeshcache_native.so"
    monkeypatch.setattr(topology, "FILTER_NATIVE", missing)
    with pytest.raises(MeshError, match=r"libmeshcache_native\.so is missing .*build it \(make filter\)"):
        topology.check_prerequisites(config)
    topology.check_prerequisites(MeshConfig(state_dir=tmp_path / "state").with_free_ports())  # wasm: not needed
    # With istiod the sidecars are Istio 1.31's Envoy (1.39) and need the module's 1.39 build.
    from meshcache.ctl.istiod import mesh as istiod_mesh

    istiod_mesh.check_prerequisites("native")
    monkeypatch.setattr(istiod_mesh, "filter_native", lambda envoy: tmp_path / f"libmeshcache_native-envoy-{envoy}.so")
    with pytest.raises(MeshError, match=r"libmeshcache_native-envoy-1\.39\.so is missing"):
        istiod_mesh.check_prerequisites("native")
    istiod_mesh.check_prerequisites("wasm")


def test_a_failing_component_reports_its_log_and_leaves_nothing(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    # A setting the control plane refuses: it exits at once, after redis-server has started.
    out = run("up", "--free-ports", "--state-dir", str(state_dir), env={"MESHCACHE_CP_MAX_POLICIES": "0"})
    assert out.returncode == 1
    assert "control-plane exited with 2 before ready" in out.stderr, out.stderr
    assert "bad configuration" in out.stderr and "max_policies" in out.stderr  # its log tail
    assert state.read_state(state_dir) is None
    # redis-server (started before the control plane) was stopped again.
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(state_dir) not in ps


def test_demo_starts_its_own_mesh_shows_hits_and_stops_it(tmp_path: Path) -> None:
    out = run("demo", "--state-dir", str(tmp_path / "no-mesh-here"), timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [line for line in out.stdout.splitlines() if "meshcache; " in line]
    assert sum("; hit; ttl=" in r for r in rows) >= 8 and sum("fwd=miss" in r for r in rows) >= 8
    assert any("gRPC" in r for r in rows) and any("REST" in r for r in rows)
    assert any(r.split()[2] == "blue" and "; hit" in r for r in rows)
    assert "hit; ttl=30" in out.stdout  # the TTL change showed
    assert "hit ratio:" in out.stdout and "mean latency: hit" in out.stdout
    assert "stopped the mesh." in out.stdout
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert "meshcache-demo-" not in ps  # nothing of its temporary mesh is left


def test_demo_llm_shows_chat_completions_cached_stream_and_not(tmp_path: Path) -> None:
    out = run("demo", "--llm", "--state-dir", str(tmp_path / "no-mesh-here"), timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [line.split() for line in out.stdout.splitlines() if "meshcache; " in line]
    kinds = [(r[0], r[1], " ".join(r[6:])) for r in rows]  # model, chat|stream, Cache-Status and note
    assert kinds[0][1:] == ("chat", "meshcache; fwd=miss; stored")
    assert kinds[1][2].startswith("meshcache; hit; ttl=600") and kinds[1][2].endswith("same answer")
    assert kinds[3][:2] == ("gemma2-27b-demo", "chat") and kinds[3][2] == "meshcache; fwd=miss; stored"
    assert kinds[4][1:] == ("stream", "meshcache; fwd=miss")
    assert kinds[5][1] == "stream" and "hit" in kinds[5][2] and "the first stream's bytes" in kinds[5][2]
    assert "last '[DONE]'; deltas joined equal the non-streamed answer" in out.stdout
    assert kinds[6][2] == "meshcache; fwd=bypass; detail=nondeterministic"
    assert "4/9 answered by the cache" in out.stdout and "stopped the mesh." in out.stdout
    # The semantic layer's section (issue 38): it says "semantic hit" exactly where the filter
    # answered one (Cache-Status detail=semantic), and a changed number is never one.
    section = out.stdout[out.stdout.index("== semantic layer (chat)"):].splitlines()
    semantic_rows = [line for line in section if "meshcache; " in line]
    assert len(semantic_rows) == 6, section
    for line in semantic_rows:
        assert ("semantic hit, similarity" in line) == ("detail=semantic" in line), line
    assert all("a changed number: not answered by similarity" in semantic_rows[i] for i in (2, 5)), semantic_rows
    assert any(line.endswith("reworded requests answered by similarity") or "reworded requests answered by "
               "similarity (similarity" in line for line in section), section
    # Not with istiod (yet): said at once, nothing started.
    refused = run("demo", "--llm", "--istiod", "--state-dir", str(tmp_path / "none"), timeout=30)
    assert refused.returncode == 1 and "--llm runs on the local mesh" in refused.stderr
