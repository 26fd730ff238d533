"""Priorities, bounded queues and graceful shutdown, on a deliberately slow unbatched model."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest

from meshcache.contract.protos import grpc_predict_v2_pb2_grpc as pb_grpc
from tests.engine.helpers import (
    grpc_infer_request,
    metric_value,
    running_engine,
    until_pending,
    until_running,
    write_slow_model,
)

X = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 16], "data": [0.5] * 16}]}


@pytest.fixture
def slow_repo(tmp_path: Path) -> Path:
    repo = tmp_path / "models"
    write_slow_model(repo, max_queue_size=3)
    return repo


async def _post(client: httpx.AsyncClient, url: str, priority: int, done: list[int], tag: int) -> int:
    r = await client.post(url, json=X, headers={"x-priority": str(priority)})
    done.append(tag)
    return r.status_code


def test_higher_priority_runs_first(slow_repo: Path, tmp_path: Path) -> None:
    async def scenario(url: str, metrics_url: str) -> list[int]:
        done: list[int] = []
        async with httpx.AsyncClient(timeout=30) as client:
            busy = asyncio.create_task(_post(client, url, 0, done, 0))
            await until_running(client, metrics_url, 1)  # request 0 runs; the next ones wait in the queue
            # Triton's levels: 1 is the highest of priority_levels 10; 0 means the default level (5).
            low1 = asyncio.create_task(_post(client, url, 9, done, 1))
            await until_pending(client, metrics_url, 1)
            low2 = asyncio.create_task(_post(client, url, 9, done, 2))
            await until_pending(client, metrics_url, 2)
            high = asyncio.create_task(_post(client, url, 1, done, 3))
            codes = await asyncio.gather(busy, low1, low2, high)
        assert codes == [200] * 4
        return done

    with running_engine(slow_repo, tmp_path) as engine:
        order = asyncio.run(scenario(f"{engine.http_url}/v2/models/slow/infer", engine.metrics_url))
    assert order == [0, 3, 1, 2]


def test_full_queue_is_refused_at_once_then_recovers(slow_repo: Path, tmp_path: Path) -> None:
    async def scenario(url: str, grpc_target: str, metrics_url: str) -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            busy = [asyncio.create_task(client.post(url, json=X))]
            await until_running(client, metrics_url, 1)
            busy += [asyncio.create_task(client.post(url, json=X)) for _ in range(3)]  # fills the queue
            await until_pending(client, metrics_url, 3)
            started = time.perf_counter()
            refused = await client.post(url, json=X)
            refused_after = time.perf_counter() - started
            async with grpc.aio.insecure_channel(grpc_target) as channel:
                stub = pb_grpc.GRPCInferenceServiceStub(channel)

                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.ModelInfer(
                        grpc_infer_request("slow", {"x": np.full((1, 16), 0.5, np.float32)})
                    )
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "queue is full" in (err.value.details() or "")
            assert refused.status_code == 503 and "queue is full" in refused.json()["error"]
            # Answered at once, not after the queue drained (4 runs of ~0.3 s); the margin is for a busy machine.
            assert refused_after < 0.2
            assert [r.status_code for r in await asyncio.gather(*busy)] == [200] * 4
            assert (await client.post(url, json=X)).status_code == 200

    with running_engine(slow_repo, tmp_path) as engine:
        asyncio.run(scenario(f"{engine.http_url}/v2/models/slow/infer", engine.grpc_target, engine.metrics_url))


def test_sigterm_finishes_in_flight_and_refuses_new(slow_repo: Path, tmp_path: Path) -> None:
    async def scenario(url: str, metrics_url: str, proc_signal: object) -> tuple[int, int]:
        async with httpx.AsyncClient(timeout=30) as client:
            in_flight = asyncio.create_task(client.post(url, json=X))
            queued = asyncio.create_task(client.post(url, json=X))
            # Both requests reached the engine (a fixed sleep is flaky on a busy machine).
            deadline = time.perf_counter() + 10
            while metric_value((await client.get(metrics_url)).text, "meshcache_engine_requests_total",
                               model="slow", protocol="http") < 2:
                assert time.perf_counter() < deadline
                await asyncio.sleep(0.005)
            proc_signal(signal.SIGTERM)  # type: ignore[operator]
            await asyncio.sleep(0.01)
            late = await client.post(url, json=X)
            first, second = await asyncio.gather(in_flight, queued)
        assert late.status_code == 503 and "shutting down" in late.json()["error"]
        return first.status_code, second.status_code

    with running_engine(slow_repo, tmp_path) as engine:
        codes = asyncio.run(
            scenario(f"{engine.http_url}/v2/models/slow/infer", engine.metrics_url, engine.proc.popen.send_signal)
        )
        assert codes == (200, 200)
        assert engine.proc.popen.wait(timeout=15) == 0
        assert "stopped" in engine.proc.log_tail()
