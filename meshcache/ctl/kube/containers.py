"""One app container of a test-kubelet pod, run as kubelet runs it: its process started, its
startup, liveness and readiness probes at their periods (timeouts and thresholds as the pod spec
says), restarted after it exits or fails its liveness probe (restartPolicy Always/OnFailure), with
kubelet's crash back-off (the first restart at once, then 10 s doubling to 300 s, reset after
10 minutes of running), and its status (state, lastState, ready, started, restartCount) as the
API server shows it.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from meshcache.ctl import procs

Obj = dict[str, Any]
BACKOFF_S = 10.0
BACKOFF_MAX_S = 300.0
BACKOFF_RESET_S = 600.0
TICK_S = 0.1
# A probe is run by one callable: (probe spec, timeout seconds) -> passed.
Probe = Callable[[Obj, float], bool]


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@dataclass
class _ProbeState:
    spec: Obj
    due: float
    failures: int = 0
    successes: int = 0

    @property
    def period(self) -> float:
        return float(self.spec.get("periodSeconds", 10))

    @property
    def timeout(self) -> float:
        return float(self.spec.get("timeoutSeconds", 1))

    def record(self, ok: bool) -> None:
        self.due = time.monotonic() + self.period
        self.failures = 0 if ok else self.failures + 1
        self.successes = self.successes + 1 if ok else 0

    def failed(self) -> bool:
        return self.failures >= int(self.spec.get("failureThreshold", 3))

    def passed(self) -> bool:
        return self.successes >= int(self.spec.get("successThreshold", 1))


@dataclass
class ContainerRunner:
    """`start()` runs the supervision thread; `stop()` ends it and the process."""

    container: Obj
    launch: Callable[[], procs.Proc]  # starts the container's process once
    probe: Probe
    restart_policy: str = "Always"
    grace_s: float = 30.0  # the pod's terminationGracePeriodSeconds
    on_start: Callable[[procs.Proc], None] = lambda _: None
    proc: procs.Proc | None = None
    restart_count: int = 0
    ready: bool = False
    started: bool = False  # the startup probe passed (or there is none)
    state: Obj = field(default_factory=lambda: {"waiting": {"reason": "ContainerCreating"}})
    last_state: Obj = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    @property
    def name(self) -> str:
        return str(self.container["name"])

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"container-{self.name}", daemon=True)
        self._thread.start()

    def status(self, image: str) -> Obj:
        return {"name": self.name, "image": image, "imageID": "", "state": self.state, "lastState": self.last_state,
                "ready": self.ready, "started": self.started, "restartCount": self.restart_count}

    def _run(self) -> None:
        backoff = 0.0
        while not self._stop.is_set():
            began = time.monotonic()
            code, reason = self._run_once()
            if self._stop.is_set():
                return
            self.last_state = {"terminated": {"exitCode": code, "reason": reason, "finishedAt": _now()}}
            if self.restart_policy == "Never" or (self.restart_policy == "OnFailure" and code == 0):
                self.state = self.last_state
                return
            if time.monotonic() - began > BACKOFF_RESET_S:
                backoff = 0.0
            self.state = {"waiting": {"reason": "CrashLoopBackOff" if backoff else "ContainerCreating"}}
            if self._stop.wait(backoff):
                return
            backoff = min(BACKOFF_MAX_S, backoff * 2 if backoff else BACKOFF_S)
            self.restart_count += 1

    def _run_once(self) -> tuple[int, str]:
        """One run of the process: probed until it exits or its liveness probe kills it."""
        self.ready = False
        self.started = "startupProbe" not in self.container
        proc = self.proc = self.launch()
        self.on_start(proc)
        self.state = {"running": {"startedAt": _now()}}
        at = time.monotonic()
        probes = {kind: _ProbeState(self.container[kind],
                                    at + float(self.container[kind].get("initialDelaySeconds", 0)))
                  for kind in ("startupProbe", "livenessProbe", "readinessProbe") if kind in self.container}
        if "readinessProbe" not in probes:
            self.ready = self.started
        killed = ""
        while proc.alive() and not self._stop.is_set():
            killed = self._probe_due(probes)
            if killed:
                self._kill(proc, probes[killed].spec)
                break
            self._stop.wait(TICK_S)
        if self._stop.is_set():
            return 0, "Completed"
        self.ready = False
        with contextlib.suppress(Exception):
            proc.popen.wait(timeout=5)
        code = proc.popen.returncode if proc.popen.returncode is not None else -9
        code = 128 - code if code < 0 else code  # a signal, as a container runtime reports it
        return code, "Completed" if code == 0 and not killed else "Error"

    def _probe_due(self, probes: dict[str, _ProbeState]) -> str:
        """Runs the probes that are due; returns the probe kind that says to kill, if any."""
        t = time.monotonic()
        startup = probes.get("startupProbe")
        if not self.started:
            if startup is not None and t >= startup.due:
                startup.record(self.probe(startup.spec, startup.timeout))
                if startup.passed():
                    self.started = True
                    self.ready = "readinessProbe" not in probes
                elif startup.failed():
                    return "startupProbe"
            return ""
        live = probes.get("livenessProbe")
        if live is not None and t >= live.due:
            live.record(self.probe(live.spec, live.timeout))
            if live.failed():
                return "livenessProbe"
        readiness = probes.get("readinessProbe")
        if readiness is not None and t >= readiness.due:
            readiness.record(self.probe(readiness.spec, readiness.timeout))
            if readiness.passed():
                self.ready = True
            elif readiness.failed():
                self.ready = False
        return ""

    def _kill(self, proc: procs.Proc, probe: Obj) -> None:
        """SIGTERM, then SIGKILL after the probe's (or the pod's) grace period, as kubelet does."""
        grace = float(probe.get("terminationGracePeriodSeconds", self.grace_s))
        with contextlib.suppress(ProcessLookupError):
            proc.popen.send_signal(signal.SIGTERM)
        try:
            proc.popen.wait(timeout=grace)
        except Exception:  # noqa: BLE001 - still running (a stopped process ignores SIGTERM)
            proc.kill()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout + 5)
        if self.proc is not None:
            with contextlib.suppress(Exception):
                self.proc.stop(timeout=timeout)
