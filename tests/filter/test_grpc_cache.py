"""gRPC ModelInfer through the filter with an unmodified grpcio client."""

from __future__ import annotations

import hashlib
from pathlib import Path

import grpc
import pytest

from tests.filter.stack import config, filter_stack, infer_request, policy


def _message_hash(message: bytes) -> str:
    # gRPC: the hashed body is the message without its 5-byte frame; the origin sends no
    # content-type... except application/grpc, which is in the default hash_headers.
    h = hashlib.sha256(len(message).to_bytes(8, "big") + message)
    h.update(b"content-type:application/grpc\n")
    return h.hexdigest()


def test_grpc_hit_returns_full_message_without_calling_origin(tmp_path: Path) -> None:
    with filter_stack(tmp_path, config(policy("resnet"))) as s:
        request = infer_request("resnet-mini", extra=b"req-1")
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
        assert s.origin_calls()["grpc"] == 1
        assert s.stats()["meshcache.hits"] == 1


def test_grpc_large_message_hit(tmp_path: Path) -> None:
    with filter_stack(tmp_path, config(policy("resnet"))) as s:
        meta = (("x-origin-size", str(700_000)),)
        first, _ = s.grpc_infer(infer_request("resnet-mini"), meta)
        second, call = s.grpc_infer(infer_request("resnet-mini"), meta)
        assert len(first) > 700_000
        assert second == first
        assert dict(call.initial_metadata())["cache-status"].startswith("meshcache; hit")
        assert s.origin_calls()["grpc"] == 1


def test_grpc_version_and_model_fields_key_the_entry(tmp_path: Path) -> None:
    with filter_stack(tmp_path, config(policy("resnet"))) as s:
        requests = [infer_request("resnet-mini"), infer_request("resnet-mini", "2"), infer_request("resnet-big")]
        for r in requests:
            _, call = s.grpc_infer(r)
            assert dict(call.initial_metadata())["cache-status"] == "meshcache; fwd=miss; stored"
        for r in requests:
            _, call = s.grpc_infer(r)
            assert dict(call.initial_metadata())["cache-status"].startswith("meshcache; hit")
        assert s.origin_calls()["grpc"] == 3


def test_grpc_errors_are_not_stored(tmp_path: Path) -> None:
    with filter_stack(tmp_path, config(policy("resnet"))) as s:
        for _ in range(2):
            with pytest.raises(grpc.RpcError) as err:
                s.grpc_infer(infer_request("resnet-mini"), (("x-origin-grpc-fail", "1"),))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details() == "origin asked to fail"
        assert s.origin_calls()["grpc"] == 2
        assert s.stats().get("meshcache.stores", 0) == 0


def test_grpc_model_without_policy_bypasses(tmp_path: Path) -> None:
    with filter_stack(tmp_path, config(policy("resnet"))) as s:
        for _ in range(2):
            response, call = s.grpc_infer(infer_request("text-embedder"))
            assert dict(call.initial_metadata())["cache-status"] == "meshcache; fwd=bypass"
            assert response
        assert s.origin_calls()["grpc"] == 2
