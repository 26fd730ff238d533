"""One real local mesh per xdist worker for the tests that leave it working (unique inputs per test).

Tests that kill components or run the CLI start their own meshes.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from meshcache.ctl.mesh.config import MeshConfig
from meshcache.ctl.mesh.topology import Mesh


@pytest.fixture(scope="session")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    config = MeshConfig(state_dir=tmp_path_factory.mktemp("mesh")).with_free_ports()
    with Mesh(config, log=lambda _: None) as m:
        yield m
