"""Triton's perf_analyzer (installed by scripts/setup.sh) runs briefly against the engine over gRPC
(unary and streaming) and HTTP, and what it reports agrees with the engine's own statistics."""

from __future__ import annotations

import pytest

from meshcache.ctl import procs
from meshcache.engine import perf_analyzer
from tests.engine.helpers import Engine


def _resnet_stats(engine: Engine) -> dict:
    url = f"{engine.http_url}/v2/models/resnet-mini/stats"
    return procs.local_http().get(url, timeout=10).json()["model_stats"][0]


@pytest.mark.parametrize(("protocol", "extra"), [("grpc", []), ("grpc", ["--streaming"]), ("http", [])],
                         ids=["grpc", "grpc-streaming", "http"])
def test_perf_analyzer_against_the_engine(engine: Engine, protocol: str, extra: list[str]) -> None:
    # The worker's session engine: its statistics are counted from before this run (the worker's
    # tests run one at a time, so the difference is perf_analyzer's).
    before = _resnet_stats(engine)
    url = f"127.0.0.1:{engine.grpc_port if protocol == 'grpc' else engine.http_port}"
    [result] = perf_analyzer.run("resnet-mini", url, protocol, [4], extra=extra, measurement_ms=800)
    after = _resnet_stats(engine)
    assert result.concurrency == 4 and result.throughput > 0
    assert 0 < result.p50_us <= result.p99_us
    # perf_analyzer's server-side numbers come from the statistics extension: the engine ran the
    # requests it sent, in fewer runs than requests (dynamic batching at concurrency 4).
    success = after["inference_stats"]["success"]["count"] - before["inference_stats"]["success"]["count"]
    assert success >= result.throughput * 0.8 * 3  # at least three measurement windows of 0.8 s
    # One row per request (perf_analyzer's batch size 1).
    assert after["inference_count"] - before["inference_count"] == success
    assert after["execution_count"] - before["execution_count"] < success
    assert result.server_compute_infer_us > 0
