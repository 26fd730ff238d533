"""Dynamic batching: concurrent requests share onnxruntime runs and each gets its own answer,
byte-identical to running the model alone."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import numpy as np
import onnxruntime as ort
import pytest

from meshcache.contract.protos import grpc_predict_v2_pb2_grpc as pb_grpc
from meshcache.ctl.procs import local_http
from meshcache.engine.demo_models import DEMO_MODELS, write_demo_models
from meshcache.engine.repository import read_model
from tests.engine.helpers import (
    DEMO_INPUTS,
    DEMO_OUTPUTS,
    copy_model,
    demo_batch,
    grpc_infer_request,
    grpc_outputs,
    metric_value,
    running_engine,
)


@pytest.fixture(scope="module")
def batching_repo(demo_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo models with a long queue delay, so concurrent test requests surely meet in a batch."""
    repo = tmp_path_factory.mktemp("batching-models")
    for model in DEMO_INPUTS:
        copy_model(
            demo_repo,
            repo,
            model,
            dynamic_batching={"max_queue_delay_microseconds": 300_000},
        )
    return repo


async def _concurrent_grpc(target: str, model: str, rows: list[np.ndarray]) -> list[np.ndarray]:
    name = DEMO_INPUTS[model][0]
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        responses = await asyncio.gather(
            *[stub.ModelInfer(grpc_infer_request(model, {name: x})) for x in rows]
        )
    return [grpc_outputs(r)[DEMO_OUTPUTS[model]] for r in responses]


@pytest.mark.parametrize("model", list(DEMO_INPUTS))
def test_concurrent_requests_share_a_batch_with_unchanged_answers(
    batching_repo: Path, tmp_path: Path, reference_sessions: dict[str, ort.InferenceSession], model: str
) -> None:
    name = DEMO_INPUTS[model][0]
    # Requests of 1, 2 and 3 rows: 12 rows in 6 requests, under every demo model's max_batch_size.
    sizes = [1, 2, 3, 1, 2, 3]
    rows = [demo_batch(model, n, seed=100 + i) for i, n in enumerate(sizes)]
    with running_engine(batching_repo, tmp_path) as engine:
        answers = asyncio.run(_concurrent_grpc(engine.grpc_target, model, rows))
        metrics = local_http().get(engine.metrics_url).text
    for x, got in zip(rows, answers, strict=True):
        expected = np.concatenate(
            [reference_sessions[model].run(None, {name: x[i : i + 1]})[0] for i in range(len(x))]
        )
        assert got.tobytes() == expected.tobytes()
    runs = metric_value(metrics, "meshcache_engine_batch_size_count", model=model)
    batched_rows = metric_value(metrics, "meshcache_engine_batch_size_sum", model=model)
    assert batched_rows == sum(sizes)
    assert runs < len(sizes), f"{len(sizes)} concurrent requests ran in {runs} batches"


def test_batch_composition_never_changes_output_bytes(tmp_path: Path) -> None:
    """Every demo model and version, every batch size up to its max and every position in the
    batch: a row's output bytes equal its batch-1 bytes, with the engine's session options."""
    write_demo_models(tmp_path)
    for model, (_, versions, config) in DEMO_MODELS.items():
        name, max_batch = DEMO_INPUTS[model][0], config["max_batch_size"]
        entry = read_model(tmp_path, model, 1)
        for version in versions:
            session = entry.versions[str(version)]
            x = demo_batch(model, max_batch, seed=version)
            out_name = DEMO_OUTPUTS[model]
            single = [session.run({name: x[i : i + 1]})[out_name].tobytes() for i in range(max_batch)]
            for size in range(2, max_batch + 1):
                for start in {0, max_batch - size}:
                    out = session.run({name: x[start : start + size]})[out_name]
                    for i in range(size):
                        assert out[i : i + 1].tobytes() == single[start + i], (model, version, size, start, i)


def test_largest_formed_preferred_batch_size_runs_at_once(demo_repo: Path, tmp_path: Path) -> None:
    """Triton's rule: two queued rows form preferred size 2, so they run together at once rather than
    waiting the (long) delay for preferred size 4."""
    repo = tmp_path / "models"
    repo.mkdir()
    copy_model(demo_repo, repo, "mlp-classifier",
               dynamic_batching={"max_queue_delay_microseconds": 10_000_000, "preferred_batch_size": [2, 4]})
    rows = [demo_batch("mlp-classifier", 1, seed=s) for s in (1, 2)]
    with running_engine(repo, tmp_path / "logs") as engine:
        started = time.perf_counter()
        asyncio.run(_concurrent_grpc(engine.grpc_target, "mlp-classifier", rows))
        elapsed = time.perf_counter() - started
        metrics = local_http().get(engine.metrics_url).text
    assert elapsed < 5, f"two requests took {elapsed:.1f} s: they waited out the delay"
    assert metric_value(metrics, "meshcache_engine_batch_size_sum", model="mlp-classifier") == 2
    assert metric_value(metrics, "meshcache_engine_batch_size_count", model="mlp-classifier") == 1
