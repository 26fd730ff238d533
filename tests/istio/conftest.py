"""Istio fixtures: the CRD schemas and the built module's pins (the control-plane fixtures of the
MCP tests are the shared ones in tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshcache.ctl.istio import render, validate


@pytest.fixture(scope="session")
def crds() -> dict[tuple[str, str], dict]:
    # Missing (../shared/istio/...): the test fails with one line saying where to get it (tests/conftest.py).
    return validate.crd_schemas(validate.crd_file())


@pytest.fixture(scope="session")
def pins(filter_wasm: Path) -> render.Pins:
    return render.pins_for(render.RenderOptions(module_path=filter_wasm))
