"""Fixtures of the image tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.images.test_images import Containers


@pytest.fixture
def containers() -> Iterator[Containers]:
    """buildah working containers, removed at the end of the test."""
    c = Containers()
    yield c
    c.remove()
