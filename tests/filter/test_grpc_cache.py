"""gRPC ModelInfer through the filter with an unmodified grpcio client: hits are answered in one
pass through Envoy (no internal listener), under Envoy's default buffer limits and the project's."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from meshcache.ctl.procs import local_http
from tests.filter.stack import LIMITS, SharedStacks, Stack, config, expected_hash, filter_stack, infer_request, policy
from tests.helpers.filter_stats import filter_stats
from tests.helpers.kserve import MODEL_INFER
from tests.helpers.wait import eventually


def _message_hash(message: bytes) -> str:
    # gRPC: the hashed body is the message without its 5-byte frame; the origin sends no
    # content-type... except application/grpc, which is in the default hash_headers.
    return expected_hash(message, {"content-type": "application/grpc"})


def _envoy_clusters(s: Stack) -> str:
    return local_http().get(f"http://127.0.0.1:{s.admin_port}/clusters", timeout=5).text


@pytest.mark.envoy_1_39
@pytest.mark.parametrize("limits", LIMITS)
def test_grpc_hit_returns_full_message_without_calling_origin(tmp_path: Path, limits: str, host: str) -> None:
    with filter_stack(tmp_path, config(policy("resnet")), buffer_limit_bytes=LIMITS[limits], host=host) as s:
        request = infer_request("resnet-mini")
        first, call1 = s.grpc_infer(request)
        md1 = dict(call1.initial_metadata())
        assert call1.code() == grpc.StatusCode.OK
        assert md1["cache-status"] == "meshcache; fwd=miss; stored"
        assert md1["x-response-hash"] == _message_hash(first)

        second, call2 = s.grpc_infer(request)
        md2 = dict(call2.initial_metadata())
        assert call2.code() == grpc.StatusCode.OK
        assert second == first
        assert md2["cache-status"].startswith("meshcache; hit; ttl=")
        assert md2["x-response-hash"] == md1["x-response-hash"]
        assert dict(call2.trailing_metadata()).get("grpc-status", "0") == "0"
        assert s.origin_calls()["grpc"] == 1
        s.stats_reaching({"meshcache.hits": 1})
        assert "cache_stub" not in _envoy_clusters(s), "single pass: no stub cluster"


@pytest.mark.parametrize("limits", LIMITS)
@pytest.mark.parametrize("size", [0, 47, 700_000, 3_000_000])
def test_grpc_hit_message_sizes_exact_bytes(shared_stacks: SharedStacks, limits: str, size: int, host: str) -> None:
    cfg = config(policy("resnet"), max_entry_bytes=4 * 1_048_576)
    s = shared_stacks.get(cfg, host, buffer_limit_bytes=LIMITS[limits])
    meta = (("x-origin-size", str(size)),)
    first, call1 = s.grpc_infer(infer_request(s.model("resnet-mini")), meta)
    assert len(first) >= max(size, 32)
    second, call = s.grpc_infer(infer_request(s.model("resnet-mini")), meta)
    assert second == first
    assert dict(call.initial_metadata())["cache-status"].startswith("meshcache; hit")
    assert s.origin_calls()["grpc"] == 1


def test_grpc_version_and_model_fields_key_the_entry(shared_stacks: SharedStacks, host: str) -> None:
    s = shared_stacks.get(config(policy("resnet")), host)
    requests = [infer_request(s.model("resnet-mini")), infer_request(s.model("resnet-mini"), "2"),
                infer_request(s.model("resnet-big"))]
    for r in requests:
        _, call = s.grpc_infer(r)
        assert dict(call.initial_metadata())["cache-status"] == "meshcache; fwd=miss; stored"
    for r in requests:
        _, call = s.grpc_infer(r)
        assert dict(call.initial_metadata())["cache-status"].startswith("meshcache; hit")
    assert s.origin_calls()["grpc"] == 3


def test_grpc_errors_are_not_stored(tmp_path: Path, host: str) -> None:
    with filter_stack(tmp_path, config(policy("resnet")), host=host) as s:
        for _ in range(2):
            with pytest.raises(grpc.RpcError) as err:
                s.grpc_infer(infer_request("resnet-mini"), (("x-origin-grpc-fail", "1"),))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details() == "origin asked to fail"
        assert s.origin_calls()["grpc"] == 2
        s.stats_reaching({"meshcache.misses": 2, "meshcache.stores": 0})


def test_grpc_model_without_policy_bypasses_and_markers_cannot_be_forged(shared_stacks: SharedStacks,
                                                                        host: str) -> None:
    s = shared_stacks.get(config(policy("resnet")), host)
    forged = (("x-meshcache-local", "1"), ("x-meshcache-hit", "0:" + "00" * 32))
    for _ in range(2):
        model = s.model("text-embedder").encode()
        response, call = s.grpc_infer(infer_request(model.decode()), forged)
        assert dict(call.initial_metadata())["cache-status"] == "meshcache; fwd=bypass; detail=no-policy"
        assert response.startswith(b"\x0a" + bytes([len(model)]) + model), "the origin answered"
    assert s.origin_calls()["grpc"] == 2


def test_grpc_hits_never_fail_under_eviction_churn(tmp_path: Path, host: str) -> None:
    """Many concurrent calls over more distinct requests than the cache has slots: entries are
    evicted between one call's lookup and another's, and every call still gets the right answer
    (the internal-listener design failed 92 of 1,500 calls here with UNKNOWN)."""
    cfg = config(policy("resnet"), max_entries=4, max_total_bytes=4 * 1200, max_entry_bytes=1200)
    with filter_stack(tmp_path, cfg, concurrency=2, host=host) as s:
        requests = [infer_request("resnet-mini", version=f"r{i}") for i in range(24)]
        expected = {}
        with grpc.insecure_channel(f"127.0.0.1:{s.listen_port}") as channel:
            call = channel.unary_unary(MODEL_INFER)
            for r in requests:
                expected[r] = call(r, timeout=10)

            def one(i: int) -> tuple[bool, str]:
                # Every other call repeats one request, so hits happen whatever slots the 24 keys
                # map to (slots are direct-mapped by key digest: a pure cycle over 24 keys and 4
                # slots may evict each entry before it is asked again, and then only timing decides
                # whether any call hits).
                r = requests[0] if i % 2 else requests[(i * 7) % len(requests)]
                response, c = call.with_call(r, timeout=20)
                return response == expected[r], dict(c.initial_metadata())["cache-status"]

            with ThreadPoolExecutor(8) as pool:
                results = list(pool.map(one, range(1500)))
        assert all(ok for ok, _ in results), "every answer is the one computed for its request"
        statuses = [st for _, st in results]
        assert sum(st.startswith("meshcache; hit") for st in statuses) > 0
        assert sum(not st.startswith("meshcache; hit") for st in statuses) > 0, "churn happened"


def test_grpc_web_bypasses(tmp_path: Path, host: str) -> None:
    with filter_stack(tmp_path, config(policy("resnet")), host=host) as s:
        message = infer_request("resnet-mini")
        framed = b"\x00" + len(message).to_bytes(4, "big") + message
        headers = {"content-type": "application/grpc-web+proto", "x-grpc-web": "1"}
        for _ in range(2):
            r = local_http().post(s.url(MODEL_INFER), content=framed, headers=headers,
                                  timeout=10)
            assert r.headers.get("cache-status") == "meshcache; fwd=bypass; detail=grpc-web"
        s.stats_reaching({"meshcache.bypasses": 2, "meshcache.hits": 0})


def test_compressed_messages_say_so(shared_stacks: SharedStacks, host: str) -> None:
    """A gzip-compressed message (grpc-encoding: gzip) is not read: the bypass says `compressed`;
    the same client without compression is cached."""
    s = shared_stacks.get(config(policy("resnet")), host)
    # Compressible (gRPC sends a message uncompressed when gzip would not shrink it).
    request = infer_request(s.model("resnet-mini"), request_id=b"z-1", extra=b"\x7a\x80\x02" + b"a" * 256)
    with grpc.insecure_channel(f"127.0.0.1:{s.listen_port}", compression=grpc.Compression.Gzip) as channel:
        call = channel.unary_unary(MODEL_INFER)
        for _ in range(2):
            answer, c = call.with_call(request, timeout=10)
            assert dict(c.initial_metadata())["cache-status"] == "meshcache; fwd=bypass; detail=compressed"
    plain, c = s.grpc_infer(request)
    assert dict(c.initial_metadata())["cache-status"] == "meshcache; fwd=miss; stored"
    assert plain == answer
    assert s.origin_calls()["grpc"] == 3


def test_missing_hit_route_fails_one_call_retryably_then_bypasses(tmp_path: Path) -> None:
    """An Envoy without the hit route or Lua filter cannot give a hit its body: that call gets
    UNAVAILABLE (never OK without a message), and gRPC requests bypass from then on. The Wasm
    host's only: the native host answers gRPC hits itself, without the route."""
    with filter_stack(tmp_path, config(policy("resnet")), without_grpc_hit_route=True) as s:
        request = infer_request("resnet-mini")
        first, _ = s.grpc_infer(request)
        with pytest.raises(grpc.RpcError) as err:
            s.grpc_infer(request)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "route missing" in (err.value.details() or "")
        for _ in range(2):
            again, call = s.grpc_infer(request)
            assert again == first
            assert dict(call.initial_metadata())["cache-status"] == "meshcache; fwd=bypass; detail=no-hit-route"
        eventually(lambda: filter_stats(s.admin_port)["meshcache.errors"] >= 1)
