"""The command line: demo model generation, env-var settings, startup failures, metrics."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import numpy as np
import onnx

from meshcache.ctl import launchers
from meshcache.ctl.launchers import ENGINE_BIN
from meshcache.ctl.procs import local_http
from tests.engine.helpers import Engine, demo_batch, init_demo_models, metric_value, running_engine


def _digests(repo: Path) -> dict[str, str]:
    return {
        str(p.relative_to(repo)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(repo.rglob("*"))
        if p.is_file()
    }


def test_init_models_is_deterministic_and_complete(demo_repo: Path, tmp_path: Path) -> None:
    again = init_demo_models(tmp_path / "again")
    assert _digests(again) == _digests(demo_repo)
    assert set(_digests(demo_repo)) == {
        "mlp-classifier/config.pbtxt",
        "mlp-classifier/1/model.onnx",
        "mlp-classifier/2/model.onnx",
        "resnet-mini/config.pbtxt",
        "resnet-mini/1/model.onnx",
        "text-embedder/config.pbtxt",
        "text-embedder/1/model.onnx",
        "demo-models.version",  # the generator's version stamp (for `init-models --if-stale`)
    }
    resnet = onnx.load(demo_repo / "resnet-mini" / "1" / "model.onnx")
    ops = {n.op_type for n in resnet.graph.node}
    assert {"Conv", "Add", "MatMul", "Flatten"} <= ops  # residual blocks, then the fully connected head
    assert resnet.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    embedder = onnx.load(demo_repo / "text-embedder" / "1" / "model.onnx")
    assert embedder.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.INT64


def test_init_models_if_stale_rewrites_only_a_stale_repository(demo_repo: Path, tmp_path: Path) -> None:
    repo = init_demo_models(tmp_path / "repo")
    model = repo / "mlp-classifier" / "2" / "model.onnx"
    before = model.stat().st_mtime_ns
    launchers.init_demo_models(repo, if_stale=True)
    assert model.stat().st_mtime_ns == before, "a current repository was rewritten"
    (repo / "demo-models.version").write_text("older-generator\n")
    (repo / "retired-model").mkdir()
    launchers.init_demo_models(repo, if_stale=True)
    assert not (repo / "retired-model").exists(), "--clean keeps nothing of the stale repository"
    assert _digests(repo) == _digests(demo_repo)


def test_init_models_serve_version_pins_one_version(tmp_path: Path) -> None:
    canary = launchers.init_demo_models(tmp_path / "canary", serve_versions={"mlp-classifier": 1})
    config = (canary / "mlp-classifier" / "config.pbtxt").read_text()
    assert "specific" in config and "versions: 1" in config
    assert (canary / "mlp-classifier" / "2" / "model.onnx").is_file()  # still on disk, not served
    stamp = (canary / "demo-models.version").read_text()
    assert stamp.strip().endswith(" mlp-classifier=1")
    # The default repository's stamp differs: --if-stale rewrites a repository with other pins.
    launchers.init_demo_models(canary, if_stale=True)
    assert "specific" not in (canary / "mlp-classifier" / "config.pbtxt").read_text()
    bad = subprocess.run([ENGINE_BIN, "init-models", str(tmp_path / "bad"), "--serve-version", "nope=1"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "no demo model 'nope'" in bad.stderr


def test_settings_from_environment(demo_repo: Path, tmp_path: Path) -> None:
    from meshcache.ctl import procs

    ports = {name: procs.free_port() for name in ("HTTP_PORT", "GRPC_PORT", "METRICS_PORT")}
    env = {
        "MESHCACHE_ENGINE_MODEL_REPOSITORY": str(demo_repo),
        "MESHCACHE_ENGINE_HOST": "127.0.0.1",
        **{f"MESHCACHE_ENGINE_{k}": str(v) for k, v in ports.items()},
    }
    proc = procs.start("engine-env", [ENGINE_BIN], tmp_path, env=env)
    with procs.supervised([proc]):
        procs.wait_until(
            proc, procs.http_ok(f"http://127.0.0.1:{ports['HTTP_PORT']}/v2/health/ready"), timeout=60
        )
        procs.wait_until(proc, procs.tcp_open(ports["GRPC_PORT"]), timeout=10)
        assert local_http().get(f"http://127.0.0.1:{ports['METRICS_PORT']}/metrics").status_code == 200


def test_bad_repository_fails_with_a_message(tmp_path: Path) -> None:
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.pbtxt").write_text("max_batch_size: {")
    result = subprocess.run(
        [ENGINE_BIN, "--model-repository", str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2 and "broken/config.pbtxt:1:" in result.stderr
    missing = subprocess.run(
        [ENGINE_BIN, "--model-repository", str(tmp_path / "nope")], capture_output=True, text=True, timeout=60
    )
    assert missing.returncode == 2 and "not a directory" in missing.stderr


def test_metrics_count_requests_failures_latency_and_batches(demo_repo: Path, tmp_path: Path) -> None:
    with running_engine(demo_repo, tmp_path) as engine:
        _exercise(engine)
        text = local_http().get(engine.metrics_url).text
    assert metric_value(text, "meshcache_engine_requests_total", model="mlp-classifier", protocol="http") == 3
    assert (
        metric_value(
            text,
            "meshcache_engine_request_failures_total",
            model="mlp-classifier",
            protocol="http",
            reason="invalid_argument",
        )
        == 1
    )
    assert (
        metric_value(
            text,
            "meshcache_engine_request_failures_total",
            model="_unknown",
            protocol="http",
            reason="not_found",
        )
        == 1
    )
    assert (
        metric_value(
            text, "meshcache_engine_request_duration_seconds_count", model="mlp-classifier", protocol="http"
        )
        == 3
    )
    assert metric_value(text, "meshcache_engine_queue_duration_seconds_count", model="mlp-classifier") == 2
    assert metric_value(text, "meshcache_engine_batch_size_sum", model="mlp-classifier") == 3
    assert 'le="0.001"' in text


def _exercise(engine: Engine) -> None:
    x = demo_batch("mlp-classifier", 2)
    url = f"{engine.http_url}/v2/models/mlp-classifier/infer"
    ok = {"inputs": [{"name": "input", "datatype": "FP32", "shape": [2, 16], "data": x.reshape(-1).tolist()}]}
    assert local_http().post(url, json=ok).status_code == 200
    one = {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 16], "data": [0.0] * 16}]}
    assert local_http().post(url, json=one).status_code == 200
    bad = {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 15], "data": np.zeros(15).tolist()}]}
    assert local_http().post(url, json=bad).status_code == 400
    assert local_http().post(f"{engine.http_url}/v2/models/ghost/infer", json=ok).status_code == 404
