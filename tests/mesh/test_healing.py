"""The healer's rules on real child processes: backoff, crash-loop limit, dependency order, and exit
reports from the current run's log only. (Whole-mesh kills under load: test_self_healing.py.)"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from meshcache.ctl import procs
from meshcache.ctl.mesh.healing import Healer, RestartPolicy


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


class Children:
    """Named child processes started by `start(name)`, each from a script that may change."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.scripts: dict[str, str] = {}
        self.procs: list[procs.Proc] = []
        self.starts: list[str] = []

    def start(self, name: str) -> procs.Proc:
        """Ready once the script printed `serving` (StartError if it exits before)."""
        self.starts.append(name)
        proc = procs.start(name, _python(self.scripts[name]), self.log_dir)
        try:
            procs.wait_until(proc, lambda: "serving" in proc.log_tail(), timeout=10, what="serving")
        except BaseException:
            proc.stop()
            raise
        for i, p in enumerate(self.procs):
            if p.name == name:
                p.stop()
                self.procs[i] = proc
                return proc
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for p in self.procs:
            p.stop(timeout=5)


@pytest.fixture
def children(tmp_path: Path) -> Iterator[Children]:
    c = Children(tmp_path)
    try:
        yield c
    finally:
        c.stop()


def _run_until(healer: Healer, done: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, {n: r.to_json() for n, r in healer.records.items()}
        healer.tick()
        time.sleep(0.02)


SLEEPER = "import time; print('serving', flush=True); time.sleep(60)"


def _dies(code: int, words: str) -> str:
    """Serves for a moment, says `words`, and exits with `code` (negative: killed by that signal)."""
    end = f"os.kill(os.getpid(), {-code})" if code < 0 else f"sys.exit({code})"
    return f"import os, sys, time; print('serving', flush=True); time.sleep(0.2); print({words!r}, flush=True); {end}"


def test_backoff_doubles_and_is_capped() -> None:
    policy = RestartPolicy(initial_backoff_s=0.25, max_backoff_s=2.0)
    assert [policy.backoff(n) for n in range(1, 7)] == [0.25, 0.5, 1.0, 2.0, 2.0, 2.0]


def test_a_killed_process_is_restarted_and_its_exit_reported_from_its_own_run(children: Children) -> None:
    children.scripts["worker"] = "import time; print('serving', flush=True); print('first run says goodbye', " \
                                 "flush=True); time.sleep(60)"
    children.start("worker")
    lines: list[str] = []
    healer = Healer(children.procs, children.start, {}, RestartPolicy(initial_backoff_s=0.05), lines.append)
    first = children.procs[0]
    procs.wait_until(first, lambda: "goodbye" in first.log_tail(), timeout=10)
    first.stop()  # a clean exit of the first run (code -15)...
    children.scripts["worker"] = _dies(-9, "second run")
    _run_until(healer, lambda: healer.records["worker"].restarts == 1)
    # ... then the second run dies: its report shows its own lines, never the first run's goodbye.
    children.scripts["worker"] = SLEEPER
    _run_until(healer, lambda: healer.records["worker"].restarts == 2)
    report = next(line for line in lines if "exited with code -9" in line)
    assert "second run" in report and "goodbye" not in report
    log = (children.log_dir / "worker.log").read_text()
    assert log.count("===== meshcache: worker started") == 3  # every start is marked in the log
    assert healer.records["worker"].state == "running" and children.procs[0].alive()


def test_a_crash_loop_is_given_up_on_and_said_clearly(children: Children) -> None:
    children.scripts["steady"] = SLEEPER
    children.scripts["broken"] = _dies(3, "config is bad: port 1 is not ours")
    children.start("steady")
    children.start("broken")
    lines: list[str] = []
    policy = RestartPolicy(initial_backoff_s=0.05, max_backoff_s=0.2, crash_loop_limit=3, stable_after_s=30)
    healer = Healer(children.procs, children.start, {}, policy, lines.append)
    t0 = time.monotonic()
    _run_until(healer, lambda: healer.records["broken"].state == "crash-loop")
    elapsed = time.monotonic() - t0
    record = healer.records["broken"]
    assert record.restarts == 3 and children.starts.count("broken") == 4  # first start + 3 restarts
    assert elapsed >= 0.05 + 0.1 + 0.2  # the backoffs were waited out
    assert "gave up after 3 restarts" in record.note and "exit code 3" in record.last_exit
    loud = [line for line in lines if line.startswith("CRASH LOOP: broken")]
    assert len(loud) == 1 and "config is bad" in loud[0]
    assert not healer.healthy()
    # The rest keeps running, and nothing restarts the given-up component any more.
    time.sleep(0.5)
    healer.tick()
    assert children.starts.count("broken") == 4 and healer.records["steady"].state == "running"
    assert children.procs[0].alive()


def test_a_run_that_stays_up_clears_the_failure_count(children: Children) -> None:
    children.scripts["flaky"] = SLEEPER
    children.start("flaky")
    policy = RestartPolicy(initial_backoff_s=0.05, crash_loop_limit=2, stable_after_s=0.5)
    healer = Healer(children.procs, children.start, {}, policy, lambda _: None)
    for round_ in range(1, 5):  # four crashes, more than the limit, each after a stable run
        time.sleep(0.6)
        healer.tick()
        assert healer.records["flaky"].failures == 0
        children.procs[0].kill()
        _run_until(healer, lambda r=round_: healer.records["flaky"].restarts == r)  # type: ignore[misc]
    assert healer.records["flaky"].state == "running"


def test_restarts_wait_for_dependencies(children: Children) -> None:
    children.scripts["store"] = SLEEPER
    children.scripts["api"] = SLEEPER
    children.start("store")
    children.start("api")
    policy = RestartPolicy(initial_backoff_s=0.05)
    lines: list[str] = []
    healer = Healer(children.procs, children.start, {"api": ("store",)}, policy, lines.append)
    # The store crashes on its next start once, so the api has to wait longer than its backoff.
    children.scripts["store"] = "import sys; sys.exit(1)"
    for p in reversed(children.procs):
        p.kill()
    _run_until(healer, lambda: healer.records["store"].failures == 2)
    assert healer.records["api"].state == "waiting" and children.starts.count("api") == 1
    children.scripts["store"] = SLEEPER
    _run_until(healer, lambda: healer.records["api"].state == "running")
    restarts = children.starts[2:]
    assert restarts.index("store") < restarts.index("api")
    assert any("api: waiting for store" in line for line in lines)
