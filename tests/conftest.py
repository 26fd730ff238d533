"""Shared fixtures: a per-test temp dir for logs and state, and the built filter."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshcache.paths import require_filter_wasm


@pytest.fixture(scope="session")
def filter_wasm() -> Path:
    return require_filter_wasm()
