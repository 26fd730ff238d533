"""Restarting crashed components: capped exponential backoff, a crash-loop limit, dependency order.

The supervisor calls `Healer.tick()` twice a second. A component whose process exited is reported
once (exit code and the last lines of *this* run's log), then started again after a backoff that
doubles with each failure in a row (`initial_backoff_s` .. `max_backoff_s`). A run that stays up
for `stable_after_s` clears the failure count. After `crash_loop_limit` failures in a row the
component is given up on, said loudly in the log and in `meshcache status`; the rest keeps running.
A component waits for the components it depends on (the control plane for Redis: its readiness
needs Redis) to be running before it is started again, so after a wider outage they come back in
start order.
"""

from __future__ import annotations

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

    def to_json(self) -> dict[str, Any]:
        return {"restarts": self.restarts, "state": self.state, "last_exit": self.last_exit, "note": self.note}


class Healer:
    """Watches `procs` (the mesh's list, updated in place) and restarts what exits."""

    def __init__(self, procs_list: list[procs.Proc], restart: Callable[[str], procs.Proc],
                 depends_on: dict[str, tuple[str, ...]], policy: RestartPolicy,
                 log: Callable[[str], None], on_restart_note: Callable[[str], str] | None = None) -> None:
        self.procs = procs_list
        self.restart = restart
        self.depends_on = depends_on
        self.policy = policy
        self.log = log
        self.on_restart_note = on_restart_note or (lambda _name: "")
        self.records: dict[str, ComponentRecord] = {p.name: ComponentRecord() for p in procs_list}

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
                self._on_exit(p, rec, now)
                changed = True
            if rec.state in ("restarting", "waiting") and rec.restart_at is not None and now >= rec.restart_at:
                changed |= self._try_restart(p.name, rec)
        return changed

    def _on_exit(self, p: procs.Proc, rec: ComponentRecord, now: float) -> None:
        code = p.popen.returncode
        ran = now - rec.started_at
        rec.last_exit = f"exit code {code} at {time.strftime('%H:%M:%S')} after {ran:.1f} s"
        rec.failures += 1
        tail = p.log_tail(15)
        with_tail = f" Last lines of this run's log ({p.log_path}):\n{tail}" if tail else ""
        if rec.failures > self.policy.crash_loop_limit:
            self._give_up(p.name, rec, f"exited with code {code}.{with_tail}")
            return
        delay = self.policy.backoff(rec.failures)
        rec.state, rec.restart_at = "restarting", now + delay
        self.log(f"{p.name} exited with code {code} after {ran:.1f} s; restarting in {delay:.2f} s "
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
