"""Triton's perf_analyzer (installed by scripts/setup.sh) runs briefly against the engine over gRPC
(unary and streaming) and HTTP, and what it reports agrees with the engine's own statistics."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from meshcache.engine import perf_analyzer
from tests.engine.helpers import running_engine


@pytest.mark.parametrize(("protocol", "extra"), [("grpc", []), ("grpc", ["--streaming"]), ("http", [])],
                         ids=["grpc", "grpc-streaming", "http"])
def test_perf_analyzer_against_the_engine(demo_repo: Path, tmp_path: Path, protocol: str, extra: list[str]) -> None:
    with running_engine(demo_repo, tmp_path) as engine:
        url = f"127.0.0.1:{engine.grpc_port if protocol == 'grpc' else engine.http_port}"
        [result] = perf_analyzer.run("resnet-mini", url, protocol, [4], extra=extra, measurement_ms=800)
        stats = httpx.get(f"{engine.http_url}/v2/models/resnet-mini/stats").json()["model_stats"][0]
    assert result.concurrency == 4 and result.throughput > 0
    assert 0 < result.p50_us <= result.p99_us
    # perf_analyzer's server-side numbers come from the statistics extension: the engine ran the
    # requests it sent, in fewer runs than requests (dynamic batching at concurrency 4).
    success = stats["inference_stats"]["success"]["count"]
    assert success >= result.throughput * 0.8 * 3  # at least three measurement windows of 0.8 s
    assert stats["inference_count"] == success  # one row per request (perf_analyzer's batch size 1)
    assert stats["execution_count"] < success
    assert result.server_compute_infer_us > 0
