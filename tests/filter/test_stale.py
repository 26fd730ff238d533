"""RFC 5861 in a real Envoy: expired entries answer when the origin fails (stale-if-error) and
at once while one background request refreshes them (stale-while-revalidate)."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import httpx
import pytest

from tests.filter.stack import Stack, config, filter_stack, infer_request, policy

INFER = "/v2/models/m/infer"
BODY = b'{"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}]}'
JSON = {"content-type": "application/json"}
TTL = {"x-origin-cache-control": "max-age=1"}


def _post(c: httpx.Client, url: str, **headers: str) -> httpx.Response:
    return c.post(url, content=BODY, headers={**JSON, **headers})


def _wait_past(seconds: float, since: float) -> None:
    time.sleep(max(0.0, since + seconds - time.monotonic()))


def test_http_5xx_after_ttl_serves_stale_within_the_window_then_the_error(tmp_path: Path) -> None:
    with filter_stack(tmp_path, config(policy(stale_if_error_s=2))) as s, httpx.Client() as c:
        stored_at = time.monotonic()
        first = _post(c, s.url(INFER), **TTL)
        assert first.headers["cache-status"] == "meshcache; fwd=miss; stored"
        _wait_past(1.2, stored_at)
        stale = _post(c, s.url(INFER), **{"x-origin-status": "503"})
        assert stale.status_code == 200
        assert stale.content == first.content
        assert stale.headers["cache-status"].startswith("meshcache; hit; stale; ttl=-")
        assert stale.headers["cache-status"].endswith("; fwd=stale; fwd-status=503; detail=stale-if-error")
        assert int(stale.headers["age"]) >= 1, "Age counts from when the answer was produced"
        assert stale.headers["x-response-hash"] == first.headers["x-response-hash"]
        assert s.origin_calls()["http"] == 2, "the origin was asked first"
        _wait_past(3.2, stored_at)
        late = _post(c, s.url(INFER), **{"x-origin-status": "503"})
        assert late.status_code == 503
        assert late.headers["cache-status"] == "meshcache; fwd=miss; detail=status"
        assert s.stats()["meshcache.stale_if_error"] == 1


def test_unreachable_or_timed_out_origin_serves_stale(tmp_path: Path) -> None:
    """Envoy's own answers for the upstream (504 timeout, 503 connect failure) pass through the
    filter's response callbacks like the origin's."""
    with filter_stack(tmp_path, config(policy(stale_if_error_s=30)), route_timeout_s=1.0) as s, httpx.Client() as c:
        stored_at = time.monotonic()
        first = _post(c, s.url(INFER), **TTL)
        _wait_past(1.2, stored_at)
        timed_out = _post(c, s.url(INFER), **{"x-origin-delay": "1.5"})
        assert timed_out.status_code == 200, timed_out.text
        assert timed_out.content == first.content
        assert timed_out.headers["cache-status"].endswith("; fwd=stale; fwd-status=504; detail=stale-if-error")
        assert s.origin is not None
        s.origin.kill()
        unreachable = _post(c, s.url(INFER))
        assert unreachable.status_code == 200, unreachable.text
        assert unreachable.content == first.content
        assert unreachable.headers["cache-status"].endswith("; fwd=stale; fwd-status=503; detail=stale-if-error")
        other = c.post(s.url(INFER), content=BODY + b" ", headers=JSON)
        assert other.status_code == 503, "nothing stored for that key: Envoy's error passes"
        assert s.stats()["meshcache.stale_if_error"] == 2


def _grpc_code(s: Stack, request: bytes, metadata: tuple[tuple[str, str], ...]) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        s.grpc_infer(request, metadata)
    return err.value.code()  # type: ignore[no-any-return]


@pytest.mark.parametrize("held", [True, False], ids=["held-headers", "istio-style"])
def test_grpc_unavailable_after_ttl_serves_the_stored_message_byte_identical(tmp_path: Path, held: bool) -> None:
    cfg = config(policy("resnet", ttl_s=1, stale_if_error_s=2), hold_headers=held)
    with filter_stack(tmp_path, cfg, allow_on_headers_stop_iteration=held) as s:
        request = infer_request("resnet-mini")
        stored_at = time.monotonic()
        first, call = s.grpc_infer(request)
        assert dict(call.initial_metadata())["cache-status"].startswith("meshcache; fwd=miss")
        _wait_past(1.2, stored_at)
        # An error stale-if-error does not cover passes, still a valid gRPC answer.
        assert _grpc_code(s, request, (("x-origin-grpc-code", "INVALID_ARGUMENT"),)) == grpc.StatusCode.INVALID_ARGUMENT
        stale, call = s.grpc_infer(request, (("x-origin-grpc-code", "UNAVAILABLE"),))
        assert call.code() == grpc.StatusCode.OK
        assert stale == first
        md = dict(call.initial_metadata())
        assert md["cache-status"].startswith("meshcache; hit; stale; ttl=-")
        assert md["cache-status"].endswith("; fwd=stale; detail=stale-if-error")
        assert int(md["age"]) >= 1
        assert s.origin_calls()["grpc"] == 3
        _wait_past(3.2, stored_at)
        assert _grpc_code(s, request, (("x-origin-grpc-code", "UNAVAILABLE"),)) == grpc.StatusCode.UNAVAILABLE
        assert s.stats()["meshcache.stale_if_error"] == 1


def test_grpc_origin_unreachable_serves_stale(tmp_path: Path) -> None:
    with filter_stack(tmp_path, config(policy("resnet", ttl_s=1, stale_if_error_s=30))) as s:
        request = infer_request("resnet-mini")
        stored_at = time.monotonic()
        first, _ = s.grpc_infer(request)
        _wait_past(1.2, stored_at)
        assert s.origin is not None
        s.origin.kill()
        stale, call = s.grpc_infer(request)
        assert stale == first
        assert dict(call.initial_metadata())["cache-status"].endswith("; fwd=stale; detail=stale-if-error")
        assert _grpc_code(s, infer_request("resnet-other"), ()) == grpc.StatusCode.UNAVAILABLE
