"""One local mesh started through the CLI (`meshcache up --detach`) for the status tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from meshcache.ctl.mesh import state
from tests.status.helpers import RunningMesh, meshcache


@pytest.fixture(scope="session")
def running_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningMesh]:
    state_dir = tmp_path_factory.mktemp("status-mesh")
    up = meshcache("up", "--detach", "--free-ports", "--state-dir", str(state_dir))
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        current = state.read_state(state_dir)
        assert current is not None
        endpoints = current["endpoints"]
        yield RunningMesh(state_dir, endpoints, Path(endpoints["token_file"]).read_text().strip())
    finally:
        state.stop_mesh(state_dir, timeout=20)
