"""The real engine serving the LLM demo models (all-minilm-l6-v2 for /v1/embeddings), shared by
the semantic index tests of a module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from meshcache.ctl import launchers
from meshcache.ctl.launchers import Engine
from tests.engine.helpers import running_engine


@pytest.fixture(scope="module")
def llm_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    repo = launchers.init_demo_models(tmp_path_factory.mktemp("models"), llm=True)
    with running_engine(repo, tmp_path_factory.mktemp("engine-logs")) as e:
        yield e
