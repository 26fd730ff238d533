"""One local mesh started through the CLI (`meshcache up --detach`) for the status tests."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from meshcache.mesh import state
from meshcache.paths import FILTER_WASM

pytestmark = pytest.mark.skipif(not FILTER_WASM.exists(), reason="filter not built (make filter)")

CLI = [str(Path(sys.executable).parent / "meshcache")]


def meshcache(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, env=dict(os.environ))


@dataclass
class RunningMesh:
    state_dir: Path
    endpoints: dict[str, Any]
    token: str

    @property
    def api_url(self) -> str:
        return str(self.endpoints["control_plane_api"])

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.api_url, headers={"Authorization": f"Bearer {self.token}"}, timeout=10)


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
