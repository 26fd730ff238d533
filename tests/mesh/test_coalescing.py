"""Request coalescing in the local mesh: `coalesce_timeout_ms` set through the control-plane API
reaches the server sidecar over ECDS, and identical cold requests then cost one engine call.

mlp-classifier answers in about a millisecond, so without help the first request can be stored
before the others arrive. The engine is held (SIGSTOP) until the server sidecar counts every
other request as waiting, so the test sees coalescing, not a race."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import grpc

from meshcache.contract.filter_config import policy_spec
from meshcache.contract.headers import CACHE_STATUS_COLLAPSED
from meshcache.ctl.mesh.topology import SERVER_NODE, Mesh
from tests.helpers.filter_stats import filter_counter
from tests.helpers.kserve import MODEL_INFER, mlp_request
from tests.mesh.helpers import default_engine_calls

MODEL = "mlp-classifier"
STORED = "meshcache; fwd=miss; stored"
N = 16


def _together(app: str, request: bytes, pool: ThreadPoolExecutor) -> list[Future[tuple[bytes, str]]]:
    """N identical calls, each on its own connection, released together once all are connected."""
    barrier = threading.Barrier(N)

    def call(_: int) -> tuple[bytes, str]:
        with grpc.insecure_channel(app, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
            grpc.channel_ready_future(channel).result(timeout=10)
            barrier.wait(timeout=30)
            response, c = channel.unary_unary(MODEL_INFER).with_call(request, timeout=30)
            return response, dict(c.initial_metadata()).get("cache-status", "")

    return [pool.submit(call, i) for i in range(N)]


WAITS, MISSES = "meshcache.coalesce.waits", "meshcache.misses"


def _server_stat(mesh: Mesh, name: str) -> int:
    return filter_counter(mesh.config.ports.server_admin, name)


@contextmanager
def _engine_held(mesh: Mesh) -> Iterator[None]:
    """The default engine stopped (SIGSTOP) inside the block: requests reach it and wait."""
    pid = mesh.proc("engine").popen.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def _answers_with_engine_held(mesh: Mesh, request: bytes, stat: str, grows_by: int) -> list[tuple[bytes, str]]:
    """Send N identical requests while the engine is held; let it go once the server sidecar's
    `stat` has grown by `grows_by` (filter metrics flush every 200 ms), or after 10 s."""
    app = mesh.endpoints()["app"]
    before = _server_stat(mesh, stat)
    with ThreadPoolExecutor(N) as pool:
        with _engine_held(mesh):
            futures = _together(app, request, pool)
            deadline = time.monotonic() + 10
            while _server_stat(mesh, stat) - before < grows_by and time.monotonic() < deadline:
                time.sleep(0.05)
        return [f.result() for f in futures]


def test_identical_cold_requests_cost_one_engine_call_and_0_turns_it_off(mesh: Mesh) -> None:
    with mesh.api() as api:
        original = next(p for p in api.policies()["policies"] if p["model_prefix"] == MODEL)
        try:
            spec = policy_spec(original)
            api.wait_acked(SERVER_NODE, api.put(MODEL, {**spec, "coalesce_timeout_ms": 5000})["version"])
            before = default_engine_calls(mesh, MODEL)
            waits_before = _server_stat(mesh, WAITS)
            answers = _answers_with_engine_held(mesh, mlp_request(seed=4401).SerializeToString(), WAITS, N - 1)
            assert len({message for message, _ in answers}) == 1
            statuses = Counter(status for _, status in answers)
            assert statuses == {STORED: 1, CACHE_STATUS_COLLAPSED: N - 1}, statuses
            assert _server_stat(mesh, WAITS) - waits_before == N - 1
            assert default_engine_calls(mesh, MODEL) == before + 1

            api.wait_acked(SERVER_NODE, api.put(MODEL, {**spec, "coalesce_timeout_ms": 0})["version"])
            before = default_engine_calls(mesh, MODEL)
            waits_before = _server_stat(mesh, WAITS)
            # Nothing waits with coalescing off: every copy is a miss on its way to the engine.
            answers = _answers_with_engine_held(mesh, mlp_request(seed=4402).SerializeToString(), MISSES, N)
            assert len({message for message, _ in answers}) == 1
            # One store wins; the others find the slot changed since their lookup and leave it.
            statuses = Counter(status for _, status in answers)
            assert statuses == {STORED: 1, "meshcache; fwd=miss; detail=contended": N - 1}, statuses
            assert _server_stat(mesh, WAITS) == waits_before
            assert default_engine_calls(mesh, MODEL) == before + N, "identical misses in flight each reach the engine"
        finally:
            api.wait_acked(SERVER_NODE, api.put(MODEL, policy_spec(original))["version"])
