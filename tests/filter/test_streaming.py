"""Any answer passes intact and misses stream, under Envoy's default 1 MiB buffer limits (an
Istio sidecar's) and under the project's configs: sizes past every limit, chunked and paced
answers, gzip, SSE streams (first event before the last is sent, replayed byte for byte)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import grpc
import httpx
import pytest

from meshcache.ctl.procs import local_http
from tests.filter.stack import LIMITS, config, expected_hash, filter_stack, infer_request, policy

INFER = "/v2/models/m/infer"
MiB = 1_048_576
MISS = "meshcache; fwd=miss"


def _body(tag: str) -> bytes:
    return b'{"parameters": {"tag": "%s"}, "inputs": []}' % tag.encode()


@pytest.mark.parametrize("limits", LIMITS)
def test_answers_of_any_size_pass_and_cacheable_ones_are_stored(tmp_path: Path, limits: str, host: str) -> None:
    cfg = config(policy("m"), max_entry_bytes=9 * MiB, max_total_bytes=64 * MiB)
    with filter_stack(tmp_path, cfg, buffer_limit_bytes=LIMITS[limits], host=host) as s, httpx.Client(timeout=60) as c:
        for size in (MiB, 3 * MiB, 8 * MiB):
            shaping = {"x-origin-size": str(size)}
            first = c.post(s.url(INFER), content=_body(str(size)), headers=shaping)
            assert first.status_code == 200, (size, first.status_code)
            assert len(first.content) == size
            # Larger than a miss holds back: its headers left before the body was stored.
            assert first.headers["cache-status"] == MISS
            hit = c.post(s.url(INFER), content=_body(str(size)), headers=shaping)
            assert hit.headers["cache-status"].startswith("meshcache; hit"), size
            assert hit.content == first.content
            assert hit.headers["x-response-hash"] == expected_hash(first.content, first.headers)
        # Past max_entry_bytes and past the project's 16 MiB buffers: intact, not stored. With a
        # declared length the headers already know; chunked, they left before the size was known.
        for chunked, status in (("", "meshcache; fwd=miss; detail=too-big"), ("1048576", MISS)):
            for _ in range(2):
                shaping = {"x-origin-size": str(20 * MiB), **({"x-origin-chunked": chunked} if chunked else {})}
                big = c.post(s.url(INFER), content=_body("20m"), headers=shaping)
                assert big.status_code == 200 and len(big.content) == 20 * MiB
                assert big.headers["cache-status"] == status
        s.stats_reaching({"meshcache.stores": 3})


@pytest.mark.parametrize("limits", LIMITS)
def test_chunked_paced_and_gzip_answers(tmp_path: Path, limits: str, host: str) -> None:
    cfg = config(policy("m"), max_entry_bytes=4 * MiB)
    with filter_stack(tmp_path, cfg, buffer_limit_bytes=LIMITS[limits], host=host) as s, httpx.Client(timeout=60) as c:
        shapes = [
            {"x-origin-size": str(2 * MiB), "x-origin-chunked": "65536", "x-origin-pace": "0.01"},
            {"x-origin-size": "3000", "x-origin-chunked": "7", "x-origin-pace": "0.001"},
            {"x-origin-size": str(3 * MiB), "x-origin-gzip": "1"},
            {"x-origin-size": "1000", "x-origin-gzip": "1"},
        ]
        for i, shaping in enumerate(shapes):
            first = c.post(s.url(INFER), content=_body(f"shape{i}"), headers=shaping)
            assert first.status_code == 200
            assert len(first.content) == int(shaping["x-origin-size"]), shaping
            hit = c.post(s.url(INFER), content=_body(f"shape{i}"), headers=shaping)
            assert hit.headers["cache-status"].startswith("meshcache; hit"), shaping
            assert hit.content == first.content
            assert hit.headers.get("content-encoding") == first.headers.get("content-encoding")
        # Small whole answers are still held: the miss says stored and carries the hash.
        small = c.post(s.url(INFER), content=_body("small"), headers={"x-origin-size": "1000"})
        assert small.headers["cache-status"] == "meshcache; fwd=miss; stored"
        assert small.headers["x-response-hash"] == expected_hash(small.content, small.headers)


@pytest.mark.parametrize("limits", LIMITS)
def test_sse_miss_streams_and_hit_replays_byte_for_byte(tmp_path: Path, limits: str, host: str) -> None:
    chat = b'{"model": "gpt-mini", "stream": true, "messages": [{"role": "user", "content": "hi"}]}'
    with filter_stack(tmp_path, config(policy("gpt")), buffer_limit_bytes=LIMITS[limits], host=host) as s:
        shaping = {"x-origin-sse": "4", "x-origin-pace": "0.5", "content-type": "application/json"}
        with httpx.Client(timeout=30) as c, c.stream("POST", s.url("/v1/chat/completions"), content=chat,
                                                     headers=shaping) as r:
            assert r.headers["cache-status"] == MISS
            chunks = []
            first_at = None
            for chunk in r.iter_raw():
                if first_at is None:
                    first_at = time.time()
                chunks.append(chunk)
        streamed = b"".join(chunks)
        events = [json.loads(line[6:]) for line in streamed.decode().split("\n") if line.startswith("data: {")]
        assert [e["i"] for e in events] == [0, 1, 2, 3]
        assert first_at is not None
        assert first_at < events[-1]["sent"], "the first event arrived before the last was sent"
        hit = local_http().post(s.url("/v1/chat/completions"), content=chat, headers=shaping, timeout=30)
        assert hit.headers["cache-status"].startswith("meshcache; hit")
        assert hit.headers["content-type"] == "text/event-stream"
        assert hit.content == streamed, "byte-identical replay"
        assert s.origin_calls()["http"] == 1


@pytest.mark.parametrize("limits", LIMITS)
def test_grpc_streamed_miss_carries_the_hash_in_trailers(tmp_path: Path, limits: str, host: str) -> None:
    cfg = config(policy("resnet"), max_entry_bytes=4 * MiB)
    with filter_stack(tmp_path, cfg, buffer_limit_bytes=LIMITS[limits], host=host) as s:
        meta = (("x-origin-size", str(3 * MiB)),)
        first, call = s.grpc_infer(infer_request("resnet-mini"), meta)
        assert call.code() == grpc.StatusCode.OK
        assert dict(call.initial_metadata())["cache-status"] == MISS
        h = expected_hash(first, {"content-type": "application/grpc"})
        assert dict(call.trailing_metadata())["x-response-hash"] == h
        second, call2 = s.grpc_infer(infer_request("resnet-mini"), meta)
        assert second == first
        assert dict(call2.initial_metadata())["x-response-hash"] == h


@pytest.mark.parametrize("limits", LIMITS)
def test_large_requests_pass(tmp_path: Path, limits: str, host: str) -> None:
    with filter_stack(tmp_path, config(policy("m")), buffer_limit_bytes=LIMITS[limits], host=host) as s:
        big = b'{"inputs": [], "parameters": {"pad": "' + b"x" * (2 * MiB) + b'"}}'
        r = local_http().post(s.url(INFER), content=big, timeout=30)
        assert r.status_code == 200
        assert r.headers["cache-status"] == "meshcache; fwd=bypass; detail=too-big"
