"""A real istiod (built by `make setup`) in the loop: the mesh of tests/istiod/test_istiod.py,
started once for the module (tests use unique inputs); other modules start their own variant."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from meshcache.ctl.istiod.mesh import IstiodMesh
from tests.istiod.helpers import istiod_mesh as start_istiod_mesh


@pytest.fixture(scope="module")
def istiod_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[IstiodMesh]:
    with start_istiod_mesh(tmp_path_factory, "istiod-mesh") as m:
        yield m
