"""Shared fixtures: the built filter, and a real redis-server and real control-plane processes
per test (used by the control-plane and Istio tests)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from meshcache.contract.paths import MissingOutsideFile, require_filter_wasm
from meshcache.ctl import launchers, procs
from tests.helpers.control_plane import ControlPlaneProc, start_control_plane


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
