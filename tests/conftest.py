"""Shared fixtures: the built filter, and a real redis-server and real control-plane processes
per test, or one per module for tests that only read or write their own prefixes (used by the
control-plane and Istio tests)."""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from xdist.scheduler import LoadScopeScheduling

from meshcache.contract.paths import MissingOutsideFile, require_filter_wasm
from meshcache.ctl import launchers, procs
from meshcache.ctl.mesh.config import FREE_PORT_POOL
from tests.helpers.control_plane import ControlPlaneProc, module_control_plane, start_control_plane


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


# The costliest modules (measured worker seconds, 2 cores) go first: `make test` runs
# `--dist loadscope --no-loadscope-reorder`, one module to one worker at a time in this order
# (its module-scoped fixtures started once), so the long ones do not end up last on one worker
# while the others sit idle. The order changes how long the run takes, never what it checks.
SLOW_FIRST = (
    "tests/kube/mesh/", "tests/kube/mesh_rollouts/", "tests/kube/walkthroughs/", "tests/kube/native/",
    "tests/kube/test_up_cli.py",
    "tests/filter/test_stale.py", "tests/mesh/test_cli.py", "tests/mesh/test_rotation.py",
    "tests/images/", "tests/filter/test_affinity.py", "tests/filter/test_coalescing.py",
    "tests/mesh/test_self_healing.py", "tests/mesh/test_affinity.py", "tests/filter/test_streaming.py",
    "tests/istiod/", "tests/kube/cluster/", "tests/kube/", "tests/status/", "tests/mesh/",
)


# Directories whose modules share session-scoped stacks (a local Kubernetes cluster, a kube mesh):
# all their tests go to one worker, so each stack starts once per run, not once per module.
SHARED_STACK_DIRS = ("tests/kube/cluster/", "tests/kube/mesh/", "tests/kube/mesh_rollouts/", "tests/kube/native/",
                     "tests/kube/walkthroughs/")


class _SharedStackScheduling(LoadScopeScheduling):
    """`--dist loadscope` with one scope per SHARED_STACK_DIRS directory (modules elsewhere)."""

    def _split_scope(self, nodeid: str) -> str:
        return next((d for d in SHARED_STACK_DIRS if nodeid.startswith(d)), None) or super()._split_scope(nodeid)


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> LoadScopeScheduling | None:
    return _SharedStackScheduling(config, log) if config.getvalue("dist") == "loadscope" else None  # type: ignore[arg-type]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    _unique_node_ids(items)

    def rank(item: pytest.Item) -> int:
        path = item.nodeid.split("::")[0]
        return next((k for k, prefix in enumerate(SLOW_FIRST) if path.startswith(prefix)), len(SLOW_FIRST))

    items.sort(key=rank)  # stable: each module's tests keep their order


def _unique_node_ids(items: list[pytest.Item]) -> None:
    """schemathesis 4.32 under pytest 9.2 gives every API operation's item the test function's
    node id (the operation is only in the item's name), and pytest-xdist's loadscope tracks tests
    by node id: all but one would silently not run. Such items get their name's parameters back;
    any other duplicate stops the run."""
    counts = Counter(item.nodeid for item in items)
    for item in items:
        original = getattr(item, "originalname", None)
        node_id = getattr(item, "_id", None)
        if counts[item.nodeid] > 1 and original and node_id is not None and node_id.params is None \
                and item.name.startswith(f"{original}[") and item.name.endswith("]"):
            item._id = node_id.with_params(item.name[len(original) + 1:-1])
    duplicates = [nodeid for nodeid, n in Counter(item.nodeid for item in items).items() if n > 1]
    if duplicates:
        raise pytest.UsageError(f"tests share a node id (pytest-xdist would run one of each): {duplicates}")


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


@pytest.fixture(scope="module")
def module_cp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlaneProc]:
    """module_control_plane with the default settings."""
    with module_control_plane(tmp_path_factory) as cp:
        yield cp
