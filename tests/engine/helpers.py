"""Starting real meshcache-engine processes on free ports, and building test-only models."""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import onnx
from google.protobuf import json_format
from onnx import TensorProto, helper, numpy_helper

from meshcache.contract.protos import grpc_predict_v2_pb2 as pb
from meshcache.ctl import launchers, procs
from meshcache.ctl.launchers import Engine, start_engine
from meshcache.engine.model_config import CONFIG_FILE, parse_text, to_text


@contextmanager
def running_engine(repo: Path, log_dir: Path, **kwargs: Any) -> Iterator[Engine]:
    engine = start_engine(repo, log_dir, **kwargs)
    with procs.supervised([engine.proc]):
        yield engine


def init_demo_models(directory: Path) -> Path:
    """The demo repository, written by the real CLI."""
    return launchers.init_demo_models(directory)


# Inputs per demo model: (input name, one-row example shape, dtype).
DEMO_INPUTS: dict[str, tuple[str, tuple[int, ...], type]] = {
    "mlp-classifier": ("input", (16,), np.float32),
    "resnet-mini": ("image", (3, 32, 32), np.float32),
    "text-embedder": ("token_ids", (12,), np.int64),
}
DEMO_OUTPUTS = {"mlp-classifier": "probabilities", "resnet-mini": "logits", "text-embedder": "embedding"}


def demo_batch(model: str, rows: int, seed: int = 0) -> np.ndarray:
    _, shape, dtype = DEMO_INPUTS[model]
    rng = np.random.default_rng(seed)
    if dtype is np.int64:
        return rng.integers(0, 5000, size=(rows, *shape), dtype=np.int64)
    return rng.standard_normal((rows, *shape)).astype(np.float32)


def copy_model(src_repo: Path, dst_repo: Path, name: str, **config_changes: Any) -> None:
    """Copies a model directory; `config_changes` replace top-level fields of its config.pbtxt
    (values in Triton's JSON form, e.g. dynamic_batching={"max_queue_delay_microseconds": 5})."""
    shutil.copytree(src_repo / name, dst_repo / name)
    config_path = dst_repo / name / CONFIG_FILE
    config = parse_text(config_path.read_text(), str(config_path))
    for key, value in config_changes.items():
        config.ClearField(key)
        json_format.ParseDict({key: value}, config)
    config_path.write_text(to_text(config))


def write_slow_model(repo: Path, layers: int = 480, max_queue_size: int = 8) -> None:
    """`slow`: ~0.3 s per request on one core, unbatched, so tests can fill its queue on purpose
    (long enough that a loaded machine still queues the next requests before it finishes)."""
    rng = np.random.Generator(np.random.PCG64(7))
    inits = [
        numpy_helper.from_array((rng.standard_normal((16, 512)) * 0.1).astype(np.float32), "w0"),
        numpy_helper.from_array((rng.standard_normal((512, 512)) / 512**0.5).astype(np.float32), "w"),
        numpy_helper.from_array(np.array([64, 1], dtype=np.int64), "reps"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "w0"], ["h0"]),
        helper.make_node("Tile", ["h0", "reps"], ["t0"]),
    ]
    prev = "t0"
    for i in range(layers):  # one shared weight: slow to run, small on disk
        nodes += [
            helper.make_node("MatMul", [prev, "w"], [f"m{i}"]),
            helper.make_node("Tanh", [f"m{i}"], [f"a{i}"]),
        ]
        prev = f"a{i}"
    nodes.append(helper.make_node("ReduceMean", [prev], ["y"], axes=[1], keepdims=0))
    graph = helper.make_graph(
        nodes,
        "slow",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [64])],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    (repo / "slow" / "1").mkdir(parents=True)
    onnx.save(model, repo / "slow" / "1" / "model.onnx")
    (repo / "slow" / CONFIG_FILE).write_text(f"""
name: "slow"
backend: "onnxruntime"
max_batch_size: 0
input [ {{ name: "x", data_type: TYPE_FP32, dims: [ 1, 16 ] }} ]
output [ {{ name: "y", data_type: TYPE_FP32, dims: [ 64 ] }} ]
dynamic_batching {{
  priority_levels: 10
  default_priority_level: 5
  default_queue_policy {{ max_queue_size: {max_queue_size} }}
}}
""")


async def until_running(client: httpx.AsyncClient, metrics_url: str, runs: int, model: str = "slow") -> None:
    """Waits until `runs` onnxruntime runs of `model` have started (a fixed sleep is flaky on a busy machine)."""
    deadline = time.perf_counter() + 10
    while metric_value((await client.get(metrics_url)).text, "meshcache_engine_batch_size_count", model=model) < runs:
        assert time.perf_counter() < deadline, f"run {runs} of {model} never started"
        await asyncio.sleep(0.005)


async def until_pending(client: httpx.AsyncClient, metrics_url: str, waiting: int, model: str = "slow") -> None:
    """Waits until `waiting` requests of `model` sit in its queue (instead of a fixed sleep)."""
    deadline = time.perf_counter() + 10
    name = "meshcache_engine_pending_requests"
    while metric_value((await client.get(metrics_url)).text, name, model=model) < waiting:
        assert time.perf_counter() < deadline, f"{waiting} requests never queued for {model}"
        await asyncio.sleep(0.005)


def metric_value(text: str, name: str, **labels: str) -> float:
    """One sample from Prometheus text output (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        metric, _, label_text = series.partition("{")
        got = ",".join(sorted(label_text.rstrip("}").split(","))) if label_text else ""
        if metric == name and got == want:
            return float(value)
    return 0.0


def grpc_infer_request(
    model: str,
    inputs: dict[str, np.ndarray],
    version: str = "",
    raw: bool = True,
    priority: int | None = None,
) -> pb.ModelInferRequest:
    from meshcache.engine.tensors import CONTENTS_FIELD, DATATYPE_OF

    request = pb.ModelInferRequest(model_name=model, model_version=version)
    if priority is not None:
        request.parameters["priority"].int64_param = priority
    for name, array in inputs.items():
        datatype = DATATYPE_OF[array.dtype]
        tensor = request.inputs.add(name=name, datatype=datatype, shape=array.shape)
        if raw:
            request.raw_input_contents.append(array.tobytes())
        else:
            getattr(tensor.contents, CONTENTS_FIELD[datatype]).extend(array.reshape(-1).tolist())
    return request


def grpc_outputs(response: pb.ModelInferResponse) -> dict[str, np.ndarray]:
    from meshcache.engine.tensors import CONTENTS_FIELD, DTYPES

    out = {}
    for i, tensor in enumerate(response.outputs):
        dtype = DTYPES[tensor.datatype]
        if response.raw_output_contents:
            array = np.frombuffer(response.raw_output_contents[i], dtype=dtype)
        else:
            array = np.array(getattr(tensor.contents, CONTENTS_FIELD[tensor.datatype]), dtype=dtype)
        out[tensor.name] = array.reshape(tuple(tensor.shape))
    return out


def http_get_json(url: str) -> Any:
    response = procs.local_http().get(url, timeout=10)
    response.raise_for_status()
    return response.json()
