"""A real istiod (built by `make setup`) in the loop: fixtures that start the istiod mesh
(meshcache/ctl/istiod/mesh.py) once per test module; tests use unique inputs."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from meshcache.ctl.istiod import binary
from meshcache.ctl.istiod.mesh import IstiodMesh, IstiodMeshConfig


def require_istiod() -> None:
    """One clear line when the binaries are missing (setup builds them)."""
    try:
        binary.require("pilot-discovery")
        binary.require("istioctl")
    except binary.IstiodMissing as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="module")
def istiod_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[IstiodMesh]:
    require_istiod()
    with IstiodMesh(IstiodMeshConfig(work_dir=tmp_path_factory.mktemp("istiod-mesh")), log=lambda _: None) as m:
        yield m
