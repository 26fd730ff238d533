"""RFC 5861 in a real Envoy: expired entries answer when the origin fails (stale-if-error) and
at once while one background request refreshes them (stale-while-revalidate)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import grpc
import httpx
import pytest

from meshcache.ctl import procs
from tests.filter.stack import LIMITS, Stack, config, expected_hash, filter_stack, infer_request, policy
from tests.helpers.wait import eventually

INFER = "/v2/models/m/infer"
BODY = b'{"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}]}'
JSON = {"content-type": "application/json"}
TTL = {"x-origin-cache-control": "max-age=1"}


def _post(c: httpx.Client, url: str, **headers: str) -> httpx.Response:
    return c.post(url, content=BODY, headers={**JSON, **headers})


def _wait_past(seconds: float, since: float) -> None:
    time.sleep(max(0.0, since + seconds - time.monotonic()))


@pytest.mark.envoy_1_39
@pytest.mark.parametrize("held", [True, False], ids=["held-headers", "istio-style"])
def test_http_5xx_after_ttl_serves_stale_within_the_window_then_the_error(tmp_path: Path, held: bool,
                                                                          host: str) -> None:
    cfg = config(policy(stale_if_error_s=2), hold_headers=held)
    with filter_stack(tmp_path, cfg, allow_on_headers_stop_iteration=held, host=host) as s, procs.http_client() as c:
        stored_at = time.monotonic()
        first = _post(c, s.url(INFER), **TTL)
        assert first.headers["cache-status"].startswith("meshcache; fwd=miss")
        _wait_past(1.2, stored_at)
        stale = _post(c, s.url(INFER), **{"x-origin-status": "503"})
        assert stale.status_code == 200
        assert stale.content == first.content
        assert stale.headers["cache-status"].startswith("meshcache; hit; stale; ttl=-")
        assert stale.headers["cache-status"].endswith("; fwd=stale; fwd-status=503; detail=stale-if-error")
        assert int(stale.headers["age"]) >= 1, "Age counts from when the answer was produced"
        assert stale.headers["x-response-hash"] == expected_hash(first.content, JSON)
        assert s.origin_calls()["http"] == 2, "the origin was asked first"
        # A 502 without a body (its headers end the stream) is replaced the same way.
        empty = _post(c, s.url(INFER), **{"x-origin-status": "502", "x-origin-size": "0"})
        assert empty.status_code == 200 and empty.content == first.content
        assert empty.headers["cache-status"].endswith("; fwd-status=502; detail=stale-if-error")
        _wait_past(3.2, stored_at)
        late = _post(c, s.url(INFER), **{"x-origin-status": "503"})
        assert late.status_code == 503
        assert late.headers["cache-status"] == "meshcache; fwd=miss; detail=status"
        s.stats_reaching({"meshcache.stale_if_error": 2})


def test_unreachable_or_timed_out_origin_serves_stale(tmp_path: Path, host: str) -> None:
    """Envoy's own answers for the upstream (504 timeout, 503 connect failure) pass through the
    filter's response callbacks like the origin's."""
    with filter_stack(tmp_path, config(policy(stale_if_error_s=30)), route_timeout_s=1.0, host=host) as s, \
            procs.http_client() as c:
        stored_at = time.monotonic()
        first = _post(c, s.url(INFER), **TTL)
        _wait_past(1.2, stored_at)
        # Held past the route's 1 s timeout (never released: the origin is stopped next).
        timed_out = _post(c, s.url(INFER), **{"x-origin-hold": "past-the-timeout"})
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
        s.stats_reaching({"meshcache.stale_if_error": 2})


def _grpc_code(s: Stack, request: bytes, metadata: tuple[tuple[str, str], ...]) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        s.grpc_infer(request, metadata)
    return err.value.code()  # type: ignore[no-any-return]


@pytest.mark.envoy_1_39
@pytest.mark.parametrize("held", [True, False], ids=["held-headers", "istio-style"])
def test_grpc_unavailable_after_ttl_serves_the_stored_message_byte_identical(tmp_path: Path, held: bool,
                                                                              host: str) -> None:
    cfg = config(policy("resnet", ttl_s=1, stale_if_error_s=2), hold_headers=held)
    with filter_stack(tmp_path, cfg, allow_on_headers_stop_iteration=held, host=host) as s:
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
        s.stats_reaching({"meshcache.stale_if_error": 1})


def test_grpc_origin_unreachable_serves_stale(tmp_path: Path, host: str) -> None:
    with filter_stack(tmp_path, config(policy("resnet", ttl_s=1, stale_if_error_s=30)), host=host) as s:
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


@pytest.mark.envoy_1_39
@pytest.mark.parametrize("held", [True, False], ids=["held-headers", "istio-style"])
def test_stale_while_revalidate_answers_at_once_and_one_background_request_refreshes(
    tmp_path: Path, held: bool, host: str) -> None:
    cfg = config(policy(stale_while_revalidate_s=30), hold_headers=held)
    with filter_stack(tmp_path, cfg, allow_on_headers_stop_iteration=held, host=host) as s, procs.http_client() as c:
        stored_at = time.monotonic()
        first = _post(c, s.url(INFER), **TTL)
        assert json.loads(first.content)["user"] == ""
        _wait_past(1.2, stored_at)
        # The origin echoes x-user (not part of the key): the refreshed answer shows whose request
        # refreshed it. The refresh repeats the request, so the origin holds it until released.
        answers = [_post(c, s.url(INFER), **{"x-user": f"u{i}", "x-origin-hold": "refresh"}) for i in range(3)]
        s.release("refresh")
        for a in answers:
            assert a.status_code == 200
            assert a.content == first.content, "the stale answer, not the origin's new one"
            assert a.headers["cache-status"].startswith("meshcache; hit; stale; ttl=-")
            assert a.headers["cache-status"].endswith("; detail=stale-while-revalidate")
            assert int(a.headers["age"]) >= 1

        def refreshed() -> httpx.Response:
            fresh = _post(c, s.url(INFER))
            assert fresh.headers["cache-status"].startswith("meshcache; hit; ttl="), fresh.headers["cache-status"]
            return fresh

        fresh = eventually(refreshed)
        assert json.loads(fresh.content)["user"] == "u0", "refreshed by the first stale request's background call"
        assert s.origin_calls()["http"] == 2, "exactly one refresh reached the origin"
        stats = s.stats_reaching({"meshcache.refreshes": 1})
        assert stats["meshcache.stale_while_revalidate"] >= 3
        assert stats["meshcache.refreshes"] == 1
        assert stats["meshcache.refresh_failures"] == 0


def test_failed_background_refresh_forwards_the_next_request(tmp_path: Path, host: str) -> None:
    cfg = config(policy(stale_while_revalidate_s=30, stale_if_error_s=30))
    with filter_stack(tmp_path, cfg, host=host) as s, procs.http_client() as c:
        stored_at = time.monotonic()
        first = _post(c, s.url(INFER), **TTL)
        _wait_past(1.2, stored_at)
        stale = _post(c, s.url(INFER), **{"x-origin-status": "503"})
        assert stale.content == first.content
        assert stale.headers["cache-status"].endswith("; detail=stale-while-revalidate")
        s.stats_reaching({"meshcache.refresh_failures": 1})
        # The background request got a 503: the next request goes to the origin itself (and
        # meets a 503 too, so stale-if-error answers it).
        forwarded = _post(c, s.url(INFER), **{"x-origin-status": "503"})
        assert forwarded.content == first.content
        assert forwarded.headers["cache-status"].endswith("; fwd-status=503; detail=stale-if-error")
        assert s.origin_calls()["http"] == 3
        after = _post(c, s.url(INFER), **TTL)
        assert after.headers["cache-status"].endswith("; detail=stale-while-revalidate"), "lock freed again"


def test_grpc_stale_while_revalidate(tmp_path: Path, host: str) -> None:
    with filter_stack(tmp_path, config(policy("resnet", ttl_s=1, stale_while_revalidate_s=30)), host=host) as s:
        request = infer_request("resnet-mini")
        stored_at = time.monotonic()
        first, _ = s.grpc_infer(request)
        stored_bytes = s.stats_reaching({"meshcache.entries": 1})["meshcache.bytes"]  # set with the entries
        _wait_past(1.2, stored_at)
        # x-origin-size (not in the key) makes the refreshed answer longer: it shows when it lands.
        stale, call = s.grpc_infer(request, (("x-origin-size", "64"),))
        assert stale == first
        assert dict(call.initial_metadata())["cache-status"].endswith("; detail=stale-while-revalidate")

        def refreshed() -> bytes:
            fresh, call = s.grpc_infer(request)
            assert dict(call.initial_metadata())["cache-status"].startswith("meshcache; hit; ttl=")
            return fresh

        fresh = eventually(refreshed)
        assert len(fresh) > len(first) and fresh[: len(b"\x0a\x0bresnet-mini")] == first[: len(b"\x0a\x0bresnet-mini")]
        assert s.origin_calls()["grpc"] == 2
        def grown(stats: dict[str, int]) -> None:
            assert stats.get("meshcache.bytes", 0) > stored_bytes, "the gauges follow the refreshed entry"

        s.stats_where(grown)


def test_window_zero_is_the_old_behaviour(tmp_path: Path, host: str) -> None:
    with filter_stack(tmp_path, config(policy()), host=host) as s, procs.http_client() as c:
        stored_at = time.monotonic()
        _post(c, s.url(INFER), **TTL)
        _wait_past(1.2, stored_at)
        err = _post(c, s.url(INFER), **{"x-origin-status": "503"})
        assert err.status_code == 503
        assert err.headers["cache-status"] == "meshcache; fwd=miss; detail=status"
        # The store's gauge was flushed long ago (1.2 s): 0 now is the lookup's free.
        stats = s.stats_reaching({"meshcache.entries": 0})
        assert stats["meshcache.stale_if_error"] == 0 and stats["meshcache.stale_while_revalidate"] == 0


def test_upstream_stale_if_error_is_honoured_and_clamped_by_the_policy(tmp_path: Path, host: str) -> None:
    with filter_stack(tmp_path, config(policy(stale_if_error_s=2)), host=host) as s, procs.http_client() as c:
        # The origin allows 1 s and 3600 s for two keys; the policy allows 2 s.
        cc = "x-origin-cache-control"
        short = c.post(s.url(INFER), content=b'{"a": 1}', headers={**JSON, cc: "max-age=1, stale-if-error=1"})
        long = c.post(s.url(INFER), content=b'{"a": 2}', headers={**JSON, cc: "max-age=1, stale-if-error=3600"})
        stored_at = time.monotonic()
        assert short.status_code == long.status_code == 200
        _wait_past(2.3, stored_at)
        fail = {"x-origin-status": "503"}
        r = c.post(s.url(INFER), content=b'{"a": 1}', headers={**JSON, **fail})
        assert r.status_code == 503, "origin's stale-if-error=1 is over"
        r = c.post(s.url(INFER), content=b'{"a": 2}', headers={**JSON, **fail})
        assert r.status_code == 200 and r.headers["cache-status"].endswith("detail=stale-if-error")
        _wait_past(3.3, stored_at)
        r = c.post(s.url(INFER), content=b'{"a": 2}', headers={**JSON, **fail})
        assert r.status_code == 503, "the policy's 2 s clamp the origin's 3600 s"


def test_grpc_stale_large_message_under_envoy_default_limits_carries_the_callers_id(tmp_path: Path, host: str) -> None:
    """Envoy's default 1 MiB buffers (an Istio sidecar's); the stored answer's request id is
    replaced by the caller's, as on hits."""
    cfg = config(policy("resnet", ttl_s=1, stale_if_error_s=30))
    with filter_stack(tmp_path, cfg, buffer_limit_bytes=LIMITS["envoy-default"], host=host) as s:
        size = (("x-origin-size", "700000"),)
        stored_at = time.monotonic()
        first, _ = s.grpc_infer(infer_request("resnet-mini", request_id=b"r-1"), size)
        assert len(first) > 700_000 and b"r-1" in first[:40]
        _wait_past(1.2, stored_at)
        fail = (*size, ("x-origin-grpc-code", "UNAVAILABLE"))
        stale, call = s.grpc_infer(infer_request("resnet-mini", request_id=b"r-2"), fail)
        assert dict(call.initial_metadata())["cache-status"].endswith("detail=stale-if-error")
        assert stale == first.replace(b"r-1", b"r-2", 1)
