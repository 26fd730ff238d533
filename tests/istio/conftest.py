"""Istio fixtures: the CRD schemas, the built module's pins, and (for the MCP tests) the
control-plane fixtures: a real redis-server and real control-plane processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshcache.istio import render, validate
from tests.control_plane.conftest import cp, redis_server, start_cp  # noqa: F401 - fixtures

ISTIO_DIR = render.ISTIO_DIR
OVERLAYS = sorted(p.parent for p in (ISTIO_DIR / "overlays").glob("*/kustomization.yaml"))
KUSTOMIZATIONS = [render.BASE_DIR, *OVERLAYS]


@pytest.fixture(scope="session")
def crds() -> dict[tuple[str, str], dict]:
    # Raises FileNotFoundError naming the expected path (../shared/istio/...) when it is missing.
    return validate.crd_schemas(validate.crd_file())


@pytest.fixture(scope="session")
def pins(filter_wasm: Path) -> render.Pins:
    return render.pins_for(render.RenderOptions(module_path=filter_wasm))
