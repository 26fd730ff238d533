"""`hold_headers: false`: the filter as Istio's WasmPlugin runs it, without Envoy's
`allow_on_headers_stop_iteration` (request headers go upstream before the body is read)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.filter.stack import LIMITS, config, expected_hash, filter_stack, infer_request, policy

BODY = b'{"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [3]}]}'


@pytest.mark.parametrize("limits", LIMITS)
def test_http_and_grpc_are_cached_without_hanging(tmp_path: Path, limits: str, host: str) -> None:
    cfg = config(policy("m"), hold_headers=False)
    with filter_stack(tmp_path, cfg, allow_on_headers_stop_iteration=False,
                      buffer_limit_bytes=LIMITS[limits], host=host) as s, httpx.Client(timeout=5) as c:
        first = c.post(s.url("/v2/models/m/infer"), content=BODY)
        assert first.status_code == 200
        # The miss's headers went out before its body was read: whether it is stored is not
        # known yet, so neither "stored" nor the hash is claimed.
        assert first.headers["cache-status"] == "meshcache; fwd=miss"
        assert "x-response-hash" not in first.headers
        second = c.post(s.url("/v2/models/m/infer"), content=BODY)
        assert second.headers["cache-status"].startswith("meshcache; hit; ttl=")
        assert second.content == first.content
        assert second.headers["x-response-hash"] == expected_hash(first.content, first.headers)
        large = c.post(s.url("/v2/models/m/infer"), content=b"big", headers={"x-origin-size": "300000"})
        assert len(large.content) == 300000

        # gRPC: single-pass hits through filter state + clear_route_cache (no held headers).
        first_msg, call1 = s.grpc_infer(infer_request("m-grpc"))
        assert dict(call1.initial_metadata())["cache-status"].startswith("meshcache; fwd=miss")
        for _ in range(3):
            response, call = s.grpc_infer(infer_request("m-grpc"))
            assert response == first_msg
            assert dict(call.initial_metadata())["cache-status"].startswith("meshcache; hit")
        assert s.origin_calls()["grpc"] == 1
