"""Shared fixtures: the built filter, and a real redis-server and real control-plane processes
per test (used by the control-plane and Istio tests)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from meshcache.contract.paths import MissingOutsideFile, require_filter_wasm
from meshcache.ctl import launchers, procs
from meshcache.ctl.mesh.config import FREE_PORT_POOL
from tests.helpers.control_plane import ControlPlaneProc, start_control_plane


def _own_port_range() -> None:
    """Each pytest-xdist worker (and every process it starts) picks free ports from its own slice
    of 20000-32767 (meshcache.ctl.procs.port_range): a port one worker picked but has not bound
    yet is never handed to another, and no client socket takes it as its ephemeral port."""
    low, high = FREE_PORT_POOL[0], FREE_PORT_POOL[1] - 1
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    width = (high - low + 1) // workers
    os.environ[procs.PORT_RANGE_ENV] = f"{low + index * width}-{low + (index + 1) * width - 1}"


_own_port_range()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    with _outside_files_in_one_line():
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    with _outside_files_in_one_line():
        return (yield)


@contextlib.contextmanager
def _outside_files_in_one_line() -> Iterator[None]:
    """A test needing a file from outside the repository (../shared/) fails with one line saying
    which file and where to get it, not a traceback."""
    try:
        yield
    except MissingOutsideFile as exc:
        raise pytest.fail.Exception(f"missing file from outside the repository: {exc}", pytrace=False) from None


@pytest.fixture(scope="session")
def filter_wasm() -> Path:
    return require_filter_wasm()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[tuple[procs.Proc, int]]:
    proc, port = launchers.start_redis(tmp_path / "redis")
    try:
        yield proc, port
    finally:
        proc.stop()


@pytest.fixture
def start_cp(tmp_path: Path, redis_server: tuple[procs.Proc, int]
             ) -> Iterator[Callable[..., ControlPlaneProc]]:
    """Factory: start a control-plane replica on the test's Redis; all are stopped at the end."""
    started: list[ControlPlaneProc] = []

    def start(name: str = "control-plane", **kwargs: object) -> ControlPlaneProc:
        cp = start_control_plane(tmp_path / "logs", redis_server[1], name=name, **kwargs)  # type: ignore[arg-type]
        started.append(cp)
        return cp

    try:
        yield start
    finally:
        for cp in reversed(started):
            cp.proc.stop()


@pytest.fixture
def cp(start_cp: Callable[..., ControlPlaneProc]) -> ControlPlaneProc:
    return start_cp()
