"""Request coalescing in the local mesh: `coalesce_timeout_ms` set through the control-plane API
reaches the server sidecar over ECDS, and identical cold requests then cost one engine call."""

from __future__ import annotations

import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import grpc

from meshcache.contract.filter_config import policy_spec
from meshcache.contract.headers import CACHE_STATUS_COLLAPSED
from meshcache.ctl.mesh.topology import SERVER_NODE, Mesh
from tests.mesh.helpers import MODEL_INFER, default_engine_calls, mlp_request

MODEL = "mlp-classifier"
N = 16


def _together(app: str, request: bytes) -> list[tuple[bytes, str]]:
    """N identical calls, each on its own connection, released together once all are connected."""
    barrier = threading.Barrier(N)

    def call(_: int) -> tuple[bytes, str]:
        with grpc.insecure_channel(app, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
            grpc.channel_ready_future(channel).result(timeout=10)
            barrier.wait(timeout=30)
            response, c = channel.unary_unary(MODEL_INFER).with_call(request, timeout=30)
            return response, dict(c.initial_metadata()).get("cache-status", "")

    with ThreadPoolExecutor(N) as pool:
        return list(pool.map(call, range(N)))


def test_identical_cold_requests_cost_one_engine_call_and_0_turns_it_off(mesh: Mesh) -> None:
    app = mesh.endpoints()["app"]
    with mesh.api() as api:
        original = next(p for p in api.policies()["policies"] if p["model_prefix"] == MODEL)
        try:
            spec = policy_spec(original)
            api.wait_acked(SERVER_NODE, api.put(MODEL, {**spec, "coalesce_timeout_ms": 5000})["version"])
            before = default_engine_calls(mesh, MODEL)
            answers = _together(app, mlp_request(seed=4401).SerializeToString())
            assert len({message for message, _ in answers}) == 1
            statuses = Counter(status for _, status in answers)
            assert statuses["meshcache; fwd=miss; stored"] == 1, statuses
            # The others waited for it (or, arriving after it was stored, were plain hits).
            assert statuses[CACHE_STATUS_COLLAPSED] >= 1, statuses
            assert set(statuses) <= {"meshcache; fwd=miss; stored", CACHE_STATUS_COLLAPSED} | {
                s for s in statuses if s.startswith("meshcache; hit; ttl=")}
            assert default_engine_calls(mesh, MODEL) == before + 1

            api.wait_acked(SERVER_NODE, api.put(MODEL, {**spec, "coalesce_timeout_ms": 0})["version"])
            before = default_engine_calls(mesh, MODEL)
            answers = _together(app, mlp_request(seed=4402).SerializeToString())
            assert CACHE_STATUS_COLLAPSED not in {status for _, status in answers}
            assert default_engine_calls(mesh, MODEL) >= before + 2, "identical misses in flight each reach the engine"
        finally:
            api.wait_acked(SERVER_NODE, api.put(MODEL, policy_spec(original))["version"])
