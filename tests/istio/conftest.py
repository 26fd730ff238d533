"""Istio fixtures: the CRD schemas and the built module's pins (the control-plane fixtures of the
MCP tests are the shared ones in tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshcache.ctl.istio import render, validate


@pytest.fixture(scope="session")
def crds() -> dict[tuple[str, str], dict]:
    # Raises FileNotFoundError naming the expected path (../shared/istio/...) when it is missing.
    return validate.crd_schemas(validate.crd_file())


@pytest.fixture(scope="session")
def pins(filter_wasm: Path) -> render.Pins:
    return render.pins_for(render.RenderOptions(module_path=filter_wasm))
