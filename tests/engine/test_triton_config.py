"""Triton model repositories: config.pbtxt parsed against Triton's ModelConfig, auto-complete from
the ONNX model, version policies, instance groups, and a clear error for every field or value the
engine does not implement."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from meshcache.ctl.launchers import ENGINE_BIN
from meshcache.ctl.procs import local_http
from meshcache.engine.model_config import ConfigError
from meshcache.engine.repository import read_model
from tests.engine.helpers import (
    demo_batch,
    metric_value,
    running_engine,
    until_pending,
    until_running,
    write_slow_model,
)

# As a Triton user writes it by hand: list syntax, comments, backend instead of platform.
HAND_WRITTEN = """
# resnet-style classifier, served by Triton's onnxruntime backend
name: "mlp"
backend: "onnxruntime"
max_batch_size: 8
version_policy: { latest: { num_versions: 1 } }
input [
  {
    name: "input"
    data_type: TYPE_FP32
    format: FORMAT_NONE
    dims: [ 16 ]
  }
]
output [
  {
    name: "probabilities"
    data_type: TYPE_FP32
    dims: [ 4 ]
  }
]
instance_group [ { count: 1, kind: KIND_CPU } ]
dynamic_batching {
  preferred_batch_size: [ 4, 8 ]
  max_queue_delay_microseconds: 100
}
parameters { key: "intra_op_thread_count" value: { string_value: "1" } }
"""


def _mlp_dir(demo_repo: Path, root: Path, config: str | None, name: str = "mlp") -> Path:
    """mlp-classifier's two versions under `name`, with `config` as config.pbtxt (None: none)."""
    shutil.copytree(demo_repo / "mlp-classifier", root / name)
    (root / name / "config.pbtxt").unlink()
    if config is not None:
        (root / name / "config.pbtxt").write_text(config)
    return root


def test_hand_written_triton_config_is_served_unchanged(demo_repo: Path, tmp_path: Path) -> None:
    repo = tmp_path / "models"
    repo.mkdir()
    _mlp_dir(demo_repo, repo, HAND_WRITTEN)
    with running_engine(repo, tmp_path / "logs") as engine:
        meta = local_http().get(f"{engine.http_url}/v2/models/mlp").json()
        config = local_http().get(f"{engine.http_url}/v2/models/mlp/config").json()
        x = demo_batch("mlp-classifier", 2).reshape(-1).tolist()
        r = local_http().post(f"{engine.http_url}/v2/models/mlp/infer", json={"inputs": [
            {"name": "input", "datatype": "FP32", "shape": [2, 16], "data": x}]})
    # latest { num_versions: 1 }: only the highest version is served.
    assert meta["versions"] == ["2"] and meta["inputs"][0]["shape"] == [-1, 16]
    assert r.status_code == 200 and r.json()["model_version"] == "2"
    assert config["name"] == "mlp" and config["max_batch_size"] == 8
    assert config["platform"] == "onnxruntime_onnx" and config["backend"] == "onnxruntime"
    assert config["input"] == [{"name": "input", "data_type": "TYPE_FP32", "format": "FORMAT_NONE", "dims": [16]}]
    assert config["dynamic_batching"]["preferred_batch_size"] == [4, 8]
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 100
    assert config["instance_group"][0]["count"] == 1 and config["instance_group"][0]["kind"] == "KIND_CPU"
    assert config["parameters"] == {"intra_op_thread_count": {"string_value": "1"}}


def test_absent_config_is_auto_completed_from_the_onnx_model(demo_repo: Path, tmp_path: Path) -> None:
    _mlp_dir(demo_repo, tmp_path, None)
    entry = read_model(tmp_path, "mlp", 1)
    cfg = entry.config
    # Triton's onnxruntime backend: a variable first dimension everywhere -> batching model with
    # max_batch_size 4 and dynamic batching; the default version policy serves the latest version.
    assert cfg.max_batch_size == 4 and cfg.batching.dynamic
    assert [(s.name, s.datatype, s.shape) for s in cfg.inputs] == [("input", "FP32", (16,))]
    assert [(s.name, s.datatype, s.shape) for s in cfg.outputs] == [("probabilities", "FP32", (4,))]
    assert list(entry.versions) == ["2"]
    assert cfg.proto.platform == "onnxruntime_onnx" and cfg.proto.version_policy.latest.num_versions == 1
    # A config with only some fields gets the rest from the model.
    (tmp_path / "mlp" / "config.pbtxt").write_text('max_batch_size: 2\nversion_policy { all {} }\n')
    partial = read_model(tmp_path, "mlp", 1)
    assert partial.config.max_batch_size == 2 and not partial.config.batching.dynamic
    assert partial.config.inputs[0].shape == (16,) and sorted(partial.versions) == ["1", "2"]


def test_version_policies(demo_repo: Path, tmp_path: Path) -> None:
    _mlp_dir(demo_repo, tmp_path, "version_policy: { specific: { versions: [1] } }")
    entry = read_model(tmp_path, "mlp", 1)
    assert list(entry.versions) == ["1"] and entry.default_version == "1"
    (tmp_path / "mlp" / "config.pbtxt").write_text("version_policy: { latest: { num_versions: 2 } }")
    entry = read_model(tmp_path, "mlp", 1)
    assert entry.sorted_versions() == ["1", "2"] and entry.default_version == "2"
    (tmp_path / "mlp" / "config.pbtxt").write_text("version_policy: { specific: { versions: [1, 3] } }")
    with pytest.raises(ConfigError, match=r"version_policy specific versions \[3\] have no <version>/model.onnx"):
        read_model(tmp_path, "mlp", 1)


# (config.pbtxt, what the error must say). Each names the field (and the file, checked below).
BAD_CONFIGS = [
    ("max_batch_size: 8\nmax_batch_sise: 4", "ModelConfig has no field 'max_batch_sise' (not in Triton's"),
    ("optimization { graph { level: 1 } }",
     "ModelConfig field 'optimization' (a Triton feature) is not supported by meshcache-engine"),
    ("sequence_batching { }", "ModelConfig field 'sequence_batching' (a Triton feature) is not supported"),
    ('input [ { name: "input", data_type: TYPE_FP32, dims: [16], reshape: { shape: [4, 4] } } ]',
     "ModelInput field 'reshape' (a Triton feature) is not supported"),
    ("dynamic_batching { preserve_ordering: true }",
     "ModelDynamicBatching field 'preserve_ordering' (a Triton feature) is not supported"),
    ("instance_group [ { count: 1, gpus: [0] } ]", "ModelInstanceGroup field 'gpus' (a Triton feature)"),
    ("instance_group [ { count: 1, kind: KIND_GPU } ]", "instance_group kind KIND_GPU is not supported"),
    ('platform: "tensorflow_savedmodel"', "platform 'tensorflow_savedmodel' is not supported"),
    ('backend: "python"', "backend 'python' is not supported"),
    ('name: "other"', "name 'other' differs from the model directory 'mlp'"),
    ("max_batch_size: -1", "max_batch_size must be >= 0"),
    ('input [ { name: "input", data_type: TYPE_STRING, dims: [16] } ]', "data_type TYPE_STRING is not supported"),
    ('input [ { name: "input", data_type: TYPE_FLOAT, dims: [16] } ]', 'has no value named TYPE_FLOAT'),
    ('max_batch_size: 8\ninput [ { name: "input", data_type: TYPE_FP32, dims: [15] } ]',
     "input 'input' dims [15] do not match the ONNX graph's [16]"),
    ('max_batch_size: 8\ninput [ { name: "input", data_type: TYPE_INT64, dims: [16] } ]',
     "input 'input' is FP32 in the ONNX graph, config says TYPE_INT64"),
    ('max_batch_size: 8\ninput [ { name: "pixels", data_type: TYPE_FP32, dims: [16] } ]',
     "input 'pixels' is not in the ONNX graph"),
    ("max_batch_size: 4\ndynamic_batching { preferred_batch_size: [8] }",
     "preferred_batch_size 8 must lie in 1..max_batch_size (4)"),
    ("dynamic_batching { priority_levels: 3, default_priority_level: 4 }",
     "default_priority_level must lie in 1..priority_levels (3), got 4"),
    ("version_policy { latest { num_versions: 0 } }", "version_policy latest num_versions must be >= 1"),
    ('parameters { key: "execution_mode" value { string_value: "1" } }',
     "parameters key 'execution_mode' is not supported"),
    ("max_batch_size: {", "Couldn't parse integer"),
]


@pytest.mark.parametrize(("config", "message"), BAD_CONFIGS, ids=[m[:40] for _, m in BAD_CONFIGS])
def test_bad_config_is_refused_with_a_clear_error(demo_repo: Path, tmp_path: Path, config: str,
                                                  message: str) -> None:
    _mlp_dir(demo_repo, tmp_path, config)
    with pytest.raises(ConfigError) as err:
        read_model(tmp_path, "mlp", 1)
    assert message in str(err.value)
    assert str(tmp_path / "mlp" / "config.pbtxt") in str(err.value)


def test_old_config_json_is_not_silently_ignored(demo_repo: Path, tmp_path: Path) -> None:
    _mlp_dir(demo_repo, tmp_path, None)
    (tmp_path / "mlp" / "config.json").write_text('{"max_batch_size": 8}')
    with pytest.raises(ConfigError, match="config.json is not read; write the configuration as config.pbtxt"):
        read_model(tmp_path, "mlp", 1)


def test_engine_refuses_to_start_on_a_bad_config(demo_repo: Path, tmp_path: Path) -> None:
    _mlp_dir(demo_repo, tmp_path, "response_cache { enable: true }")
    result = subprocess.run([ENGINE_BIN, "--model-repository", str(tmp_path)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2
    assert "config.pbtxt:1:1: ModelConfig field 'response_cache' (a Triton feature) is not supported" in result.stderr


def test_instance_group_count_runs_instances_in_parallel(tmp_path: Path) -> None:
    repo = tmp_path / "models"
    write_slow_model(repo)
    cfg = repo / "slow" / "config.pbtxt"
    cfg.write_text(cfg.read_text() + "instance_group [ { count: 2, kind: KIND_CPU } ]\n")

    async def scenario(url: str, metrics_url: str) -> bool:
        body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 16], "data": [0.5] * 16}]}
        async with httpx.AsyncClient(timeout=30) as client:
            tasks = [asyncio.create_task(client.post(url, json=body)) for _ in range(2)]
            deadline = time.perf_counter() + 10
            overlapped = False
            while not all(t.done() for t in tasks) and time.perf_counter() < deadline:
                runs = metric_value((await client.get(metrics_url)).text, "meshcache_engine_batch_size_count",
                                    model="slow")
                overlapped |= runs == 2 and not any(t.done() for t in tasks)
                await asyncio.sleep(0.005)
            assert [(await t).status_code for t in tasks] == [200, 200]
        return overlapped

    with running_engine(repo, tmp_path / "logs") as engine:
        # Both runs started while neither request had its answer: two instances ran at once.
        assert asyncio.run(scenario(f"{engine.http_url}/v2/models/slow/infer", engine.metrics_url))


def _slow_with_queue_policy(tmp_path: Path, policy: str) -> Path:
    repo = tmp_path / "models"
    write_slow_model(repo)
    cfg = repo / "slow" / "config.pbtxt"
    cfg.write_text(cfg.read_text().replace("default_queue_policy {", f"default_queue_policy {{ {policy}"))
    return repo


def test_queue_timeout_rejects_and_request_may_shorten_it(tmp_path: Path) -> None:
    repo = _slow_with_queue_policy(tmp_path, "default_timeout_microseconds: 10000000 allow_timeout_override: true")
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 16], "data": [0.5] * 16}]}

    async def scenario(url: str, metrics_url: str) -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=30) as client:
            busy = asyncio.create_task(client.post(url, json=body))
            await until_running(client, metrics_url, 1)
            # Both wait ~0.3 s behind `busy`: over the 20 ms this one asks for, under the model's 10 s.
            short = asyncio.create_task(client.post(url, json={**body, "parameters": {"timeout": 20000}}))
            normal = asyncio.create_task(client.post(url, json=body))
            return [await busy, await short, await normal]

    with running_engine(repo, tmp_path / "logs") as engine:
        url = f"{engine.http_url}/v2/models/slow/infer"
        busy, short, normal = asyncio.run(scenario(url, engine.metrics_url))
        bad = local_http().post(url, json={**body, "parameters": {"timeout": "soon"}})
        stats = local_http().get(f"{engine.http_url}/v2/models/slow/stats").json()["model_stats"][0]
    assert busy.status_code == 200 and normal.status_code == 200
    assert short.status_code == 503 and "timed out after waiting" in short.json()["error"]
    assert bad.status_code == 400 and "timeout must be an integer" in bad.json()["error"]
    assert stats["inference_stats"]["success"]["count"] == 2 and stats["inference_stats"]["fail"]["count"] == 2


def test_queue_timeout_delay_moves_expired_requests_last(tmp_path: Path) -> None:
    repo = _slow_with_queue_policy(tmp_path, "timeout_action: DELAY allow_timeout_override: true")
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 16], "data": [0.5] * 16}]}

    async def scenario(url: str, metrics_url: str) -> list[int]:
        done: list[int] = []
        async with httpx.AsyncClient(timeout=30) as client:

            async def post(tag: int, extra: dict[str, object]) -> None:
                r = await client.post(url, json={**body, **extra})
                assert r.status_code == 200, r.text
                done.append(tag)

            busy = asyncio.create_task(post(0, {}))
            await until_running(client, metrics_url, 1)
            expiring = asyncio.create_task(post(1, {"parameters": {"timeout": 1000}}))  # expires while queued
            await until_pending(client, metrics_url, 1)
            later = asyncio.create_task(post(2, {}))
            await asyncio.gather(busy, expiring, later)
        return done

    with running_engine(repo, tmp_path / "logs") as engine:
        order = asyncio.run(scenario(f"{engine.http_url}/v2/models/slow/infer", engine.metrics_url))
    # DELAY: the expired request still runs, but after the one that arrived later and did not expire.
    assert order == [0, 2, 1]
