"""Restarting crashed components: capped exponential backoff, a crash-loop limit, dependency order.

The supervisor calls `Healer.tick()` twice a second. A component whose process exited is reported
once (exit code and the last lines of *this* run's log), then started again after a backoff that
doubles with each failure in a row (`initial_backoff_s` .. `max_backoff_s`). A run that stays up
for `stable_after_s` clears the failure count. After `crash_loop_limit` failures in a row the
component is given up on, said loudly in the log and in `meshcache status`; the rest keeps running.
A component waits for the components it depends on (the control plane for Redis: its readiness
needs Redis) to be running before it is started again, so after a wider outage they come back in
start order.

A component can also have a liveness probe (`Liveness`, what kubelet does with a livenessProbe):
checked every `period_s` while it runs, by its own thread (`start_probes`), as kubelet's probe
workers run apart from restarts: a restart that blocks (istiod's start waits for the very control
plane that is wedged) must not hold the probe back. `failure_threshold` failures in a row and the
process is killed with SIGKILL (a stopped or wedged process ignores SIGTERM); `tick` then restarts
it like any exit. The control plane's is the rendered Deployment's: `GET /healthz/xds`, an ADS
round trip through its xDS server (docs/istio.md, "What istiod waits for").
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from meshcache.ctl import procs


@dataclass(frozen=True)
class RestartPolicy:
    initial_backoff_s: float = 0.25
    max_backoff_s: float = 30.0
    crash_loop_limit: int = 5
    stable_after_s: float = 30.0

    def backoff(self, failures: int) -> float:
        """Delay before the restart that follows the `failures`-th failure in a row (1-based)."""
        return min(self.max_backoff_s, self.initial_backoff_s * 2 ** max(0, failures - 1))


@dataclass(frozen=True)
class Liveness:
    """A livenessProbe: `check()` must answer within its own timeout (True = alive)."""

    check: Callable[[], bool]
    what: str  # for the log, e.g. "GET http://127.0.0.1:8080/healthz/xds"
    period_s: float = 10.0
    failure_threshold: int = 3

    @classmethod
    def http_get(cls, probe: dict[str, Any], base_url: str) -> Liveness:
        """From a Kubernetes `httpGet` probe (kubelet's defaults where a field is unset)."""
        url = f"{base_url}{probe['httpGet']['path']}"
        timeout = float(probe.get("timeoutSeconds", 1))

        def check() -> bool:
            try:
                return procs.local_http().get(url, timeout=timeout).status_code == 200
            except Exception:  # timeout, refused: a failed probe, as for kubelet
                return False

        return cls(check, f"GET {url}", float(probe.get("periodSeconds", 10)), int(probe.get("failureThreshold", 3)))


@dataclass
class ComponentRecord:
    """What `meshcache status` shows per component besides its pid."""

    restarts: int = 0
    failures: int = 0  # in a row, since the last run that stayed up stable_after_s
    state: str = "running"  # running | restarting | waiting | crash-loop
    last_exit: str = ""
    note: str = ""
    started_at: float = field(default_factory=time.monotonic)
    restart_at: float | None = None
    reported: bool = False  # this run's exit was reported
    killed_by_probe: str = ""  # why this run was killed by its liveness probe

    def to_json(self) -> dict[str, Any]:
        return {"restarts": self.restarts, "state": self.state, "last_exit": self.last_exit, "note": self.note}


class Healer:
    """Watches `procs` (the mesh's list, updated in place) and restarts what exits."""

    def __init__(self, procs_list: list[procs.Proc], restart: Callable[[str], procs.Proc],
                 depends_on: dict[str, tuple[str, ...]], policy: RestartPolicy,
                 log: Callable[[str], None], on_restart_note: Callable[[str], str] | None = None,
                 liveness: dict[str, Liveness] | None = None) -> None:
        self.procs = procs_list
        self.liveness = liveness or {}
        self.restart = restart
        self.depends_on = depends_on
        self.policy = policy
        self.log = log
        self.on_restart_note = on_restart_note or (lambda _name: "")
        self.records: dict[str, ComponentRecord] = {p.name: ComponentRecord() for p in procs_list}
        self._probes_stop = threading.Event()
        self._probe_threads: list[threading.Thread] = []

    def _proc(self, name: str) -> procs.Proc:
        return next(p for p in self.procs if p.name == name)

    def _running(self, name: str) -> bool:
        return self.records[name].state == "running" and self._proc(name).alive()

    def tick(self) -> bool:
        """One pass in start order; True when something changed (the caller rewrites mesh.json)."""
        changed = False
        now = time.monotonic()
        for p in list(self.procs):
            rec = self.records[p.name]
            if rec.state == "crash-loop":
                continue
            if rec.state == "running":
                if p.alive():
                    if rec.failures and now - rec.started_at >= self.policy.stable_after_s:
                        rec.failures = 0
                    continue
                self._on_exit(p, rec, time.monotonic())
                changed = True
            if rec.state in ("restarting", "waiting") and rec.restart_at is not None and now >= rec.restart_at:
                changed |= self._try_restart(p.name, rec)
        return changed

    def start_probes(self) -> None:
        """One thread per liveness probe, until `stop_probes`."""
        for name, probe in self.liveness.items():
            t = threading.Thread(target=self._probe_loop, args=(name, probe), name=f"liveness-{name}", daemon=True)
            t.start()
            self._probe_threads.append(t)

    def stop_probes(self) -> None:
        self._probes_stop.set()
        for t in self._probe_threads:
            t.join(timeout=10)

    def _probe_loop(self, name: str, probe: Liveness) -> None:
        """Probes whichever process runs `name` now; failures count per process (a restarted one
        starts from zero, as a new container does). Only kills: `tick` sees the exit and restarts."""
        current: procs.Proc | None = None
        failures = 0
        due = time.monotonic()
        while True:
            # Every period_s, or at once when a check outlasted it (kubelet's pace).
            due = max(due + probe.period_s, time.monotonic())
            if self._probes_stop.wait(max(0.0, due - time.monotonic())):
                return
            p = self._proc(name)
            if p is not current:
                current, failures = p, 0
            if self.records[name].state != "running" or not p.alive():
                continue
            if probe.check():
                failures = 0
                continue
            failures += 1
            if failures >= probe.failure_threshold and p.alive() and not self._probes_stop.is_set():
                why = f"{failures} liveness probes failed in a row ({probe.what}, every {probe.period_s:g} s)"
                self.records[name].killed_by_probe = why
                self.log(f"{name}: {why}: killing it (SIGKILL) to restart it, as kubelet would")
                p.kill()

    def _on_exit(self, p: procs.Proc, rec: ComponentRecord, now: float) -> None:
        code = p.popen.returncode
        ran = now - rec.started_at
        killed = rec.killed_by_probe
        how = "killed by its liveness probe" if killed else f"exit code {code}"
        ended = f"was killed by its liveness probe ({killed})" if killed else f"exited with code {code}"
        rec.last_exit = f"{how} at {time.strftime('%H:%M:%S')} after {ran:.1f} s"
        rec.killed_by_probe = ""
        rec.failures += 1
        tail = p.log_tail(15)
        with_tail = f" Last lines of this run's log ({p.log_path}):\n{tail}" if tail else ""
        if rec.failures > self.policy.crash_loop_limit:
            self._give_up(p.name, rec, f"{ended}.{with_tail}")
            return
        delay = self.policy.backoff(rec.failures)
        rec.state, rec.restart_at = "restarting", now + delay
        self.log(f"{p.name} {ended} after {ran:.1f} s; restarting in {delay:.2f} s "
                 f"(failure {rec.failures} of {self.policy.crash_loop_limit} in a row).{with_tail}")

    def _give_up(self, name: str, rec: ComponentRecord, why: str) -> None:
        rec.state, rec.restart_at = "crash-loop", None
        rec.note = (f"gave up after {self.policy.crash_loop_limit} restarts in a row that did not stay up "
                    f"{self.policy.stable_after_s:g} s; fix the cause, then `meshcache down` and `meshcache up`")
        self.log(f"CRASH LOOP: {name} {why}\n{name}: {rec.note}; the rest of the mesh keeps running.")

    def _try_restart(self, name: str, rec: ComponentRecord) -> bool:
        waiting_for = [d for d in self.depends_on.get(name, ()) if not self._running(d)]
        if waiting_for:
            if rec.state != "waiting":
                rec.state = "waiting"
                self.log(f"{name}: waiting for {', '.join(waiting_for)} before restarting")
                return True
            return False
        t0 = time.monotonic()
        try:
            self.restart(name)
        except procs.StartError as exc:
            rec.failures += 1
            rec.last_exit = f"restart failed at {time.strftime('%H:%M:%S')}"
            if rec.failures > self.policy.crash_loop_limit:
                self._give_up(name, rec, f"could not be restarted: {exc}")
                return True
            delay = self.policy.backoff(rec.failures)
            rec.state, rec.restart_at = "restarting", time.monotonic() + delay
            self.log(f"{name}: restart failed; next try in {delay:.2f} s "
                     f"(failure {rec.failures} of {self.policy.crash_loop_limit} in a row): {exc}")
            return True
        rec.restarts += 1
        rec.state, rec.restart_at, rec.started_at = "running", None, time.monotonic()
        rec.note = self.on_restart_note(name)
        self.log(f"{name} restarted and ready in {rec.started_at - t0:.1f} s (restart {rec.restarts})"
                 + (f"; {rec.note}" if rec.note else ""))
        return True

    def healthy(self) -> bool:
        return all(r.state == "running" for r in self.records.values())
