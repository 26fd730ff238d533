"""Engine fixtures: the demo repository and one shared engine per test worker."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import onnxruntime as ort
import pytest

from tests.engine.helpers import DEMO_INPUTS, Engine, init_demo_models, running_engine


@pytest.fixture(scope="session")
def demo_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_demo_models(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def engine(demo_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    with running_engine(demo_repo, tmp_path_factory.mktemp("engine-logs")) as e:
        yield e


@pytest.fixture(scope="session")
def reference_sessions(demo_repo: Path) -> dict[str, ort.InferenceSession]:
    """onnxruntime sessions on the same files, to compare the engine against the model run alone."""
    sessions = {}
    for model in DEMO_INPUTS:
        version = "2" if model == "mlp-classifier" else "1"
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        sessions[model] = ort.InferenceSession(str(demo_repo / model / version / "model.onnx"), options)
    return sessions
