"""Request coalescing in a real Envoy with two workers and a slow origin: identical misses in
flight wait for the first one's answer (HTTP and gRPC), within bounds and timeouts, and are
still answered when the first one fails.

The origin holds the requests that reach it (`x-origin-hold`, `held`) until what the test needs
in flight has happened (every waiter parked: `meshcache.coalesce.waits`; every request at the
origin), rather than answering after a delay long enough for a slow machine. These tests read
cache-wide coalescing counters, so each has its own stack."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import grpc
import httpx
import pytest

from meshcache.contract.headers import CACHE_STATUS_COLLAPSED
from meshcache.ctl import launchers, procs
from tests.filter.stack import Stack, config, filter_stack, infer_request, policy
from tests.helpers.kserve import MODEL_INFER
from tests.helpers.wait import eventually

INFER = "/v2/models/m/infer"
STORED = "meshcache; fwd=miss; stored"
WAITS = "meshcache.coalesce.waits"
T = TypeVar("T")


def body(n: int = 0) -> bytes:
    return b'{"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [%d]}]}' % n


def at_once(n: int, call: Callable[[int, Callable[[], None]], T]) -> list[T]:
    """`call(i, ready)` for i in 0..n on n threads; each connects, then calls `ready()`, which
    returns when all n are connected, so the requests leave together."""
    barrier = threading.Barrier(n)
    with ThreadPoolExecutor(max_workers=n) as pool:
        return list(pool.map(lambda i: call(i, lambda: barrier.wait(timeout=60)), range(n)))


def posts(s: Stack, content: bytes, headers: dict[str, str] | None = None,
          timeout: float = 30) -> Callable[[int, Callable[[], None]], httpx.Response]:
    """One POST per call on its own connection (Envoy spreads connections over its workers),
    opened before `ready` with a request the filter ignores."""
    def call(_: int, ready: Callable[[], None]) -> httpx.Response:
        with procs.http_client(timeout=timeout) as c:  # one connection per call; the CA bundle shared
            c.get(s.url("/calls"))
            ready()
            return c.post(s.url(INFER), content=content,
                          headers={"content-type": "application/json", **(headers or {})})
    return call


def held(s: Stack, name: str, n: int, call: Callable[[int, Callable[[], None]], T],
         until: Callable[[], object]) -> list[T]:
    """`at_once(n, call)` whose requests carry `x-origin-hold: name`: the origin holds those that
    reach it until `until()` (which waits for a condition, failing if it never comes) has
    returned, then answers them."""
    with ThreadPoolExecutor(max_workers=1) as background:
        answers = background.submit(at_once, n, call)
        try:
            until()
        finally:
            s.release(name)
        return answers.result()


def origin_reached(s: Stack, kind: str, n: int) -> Callable[[], object]:
    """Waits until `n` requests of `kind` (http or grpc) reached the origin in this test."""
    return lambda: eventually(lambda: s.origin_calls()[kind] == n)


def post(s: Stack, content: bytes, headers: dict[str, str] | None = None, timeout: float = 30) -> httpx.Response:
    return posts(s, content, headers, timeout)(0, lambda: None)


def grpc_calls(s: Stack, request: Callable[[int], bytes],
               metadata: tuple[tuple[str, str], ...]) -> Callable[[int, Callable[[], None]], tuple[bytes, str]]:
    """One ModelInfer per call on its own HTTP/2 connection (a local subchannel pool: grpcio
    shares connections otherwise), connected before `ready`. Returns (message, Cache-Status)."""
    def call(i: int, ready: Callable[[], None]) -> tuple[bytes, str]:
        target = f"127.0.0.1:{s.listen_port}"
        with grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
            grpc.channel_ready_future(ch).result(timeout=30)
            ready()
            response, c = ch.unary_unary(MODEL_INFER).with_call(request(i), metadata=metadata, timeout=30)
            return response, dict(c.initial_metadata())["cache-status"]
    return call


def workers_used(s: Stack) -> int:
    """How many Envoy workers accepted downstream connections."""
    stats = launchers.envoy_stats(s.admin_port, "listener.")
    return sum(1 for name, v in stats.items()
               if ".worker_" in name and name.endswith(".downstream_cx_total") and str(s.listen_port) in name and v)


def coalescing(**fields: Any) -> dict[str, Any]:
    return config(policy("m", **fields), policy("resnet", **fields))


@pytest.mark.envoy_1_39
def test_32_identical_http_misses_make_one_origin_call_on_both_workers(tmp_path: Path, host: str) -> None:
    with filter_stack(tmp_path, coalescing(coalesce_timeout_ms=10_000), concurrency=2, host=host) as s:
        answers = held(s, "lead", 32, posts(s, body(), {"x-origin-hold": "lead"}),
                       lambda: s.stats_reaching({WAITS: 31}))
        assert [r.status_code for r in answers] == [200] * 32
        assert len({r.content for r in answers}) == 1, "32 identical answers"
        statuses = Counter(r.headers["cache-status"] for r in answers)
        assert statuses == {STORED: 1, CACHE_STATUS_COLLAPSED: 31}, statuses
        assert len({r.headers["x-response-hash"] for r in answers}) == 1
        assert s.origin_calls()["http"] == 1
        assert workers_used(s) == 2, "the waiters were spread over both Envoy workers"
        stats = s.stats_reaching({WAITS: 31, "meshcache.coalesce.served": 31})
        assert stats["meshcache.coalesce.timeouts"] == stats["meshcache.coalesce.overflow"] == 0
        # Afterwards the entry answers as a plain hit.
        assert post(s, body()).headers["cache-status"].startswith("meshcache; hit; ttl=")


def test_32_identical_grpc_misses_make_one_origin_call(tmp_path: Path, host: str) -> None:
    with filter_stack(tmp_path, coalescing(coalesce_timeout_ms=10_000), concurrency=2, host=host) as s:
        call = grpc_calls(s, lambda i: infer_request("resnet-mini"), (("x-origin-hold", "lead"),))
        answers = held(s, "lead", 32, call, lambda: s.stats_reaching({WAITS: 31}))
        assert len({message for message, _ in answers}) == 1, "32 identical messages"
        assert answers[0][0].startswith(b"\x0a\x0bresnet-mini")
        statuses = Counter(status for _, status in answers)
        assert statuses == {STORED: 1, CACHE_STATUS_COLLAPSED: 31}, statuses
        assert s.origin_calls()["grpc"] == 1
        assert workers_used(s) == 2
        s.stats_reaching({"meshcache.coalesce.served": 31})


def test_grpc_waiters_keep_their_own_request_ids(tmp_path: Path, host: str) -> None:
    with filter_stack(tmp_path, coalescing(), concurrency=2, host=host) as s:
        answers = held(s, "lead", 8, grpc_calls(s, lambda i: infer_request("resnet-mini", request_id=b"id-%d" % i),
                                                (("x-origin-hold", "lead"),)),
                       lambda: s.stats_reaching({WAITS: 7}))
        for i, (message, _) in enumerate(answers):
            assert b"\x1a\x04id-%d" % i in message, "each caller gets its own id back"
        assert Counter(status for _, status in answers)[CACHE_STATUS_COLLAPSED] == 7
        assert s.origin_calls()["grpc"] == 1


def test_a_waiter_gives_up_after_coalesce_timeout_ms_and_goes_upstream(tmp_path: Path, host: str) -> None:
    with filter_stack(tmp_path, coalescing(coalesce_timeout_ms=200), concurrency=2, host=host) as s:
        def waiters_gave_up() -> None:
            s.stats_reaching({"meshcache.coalesce.timeouts": 3})
            origin_reached(s, "http", 4)()

        # Held until every waiter has timed out and gone upstream itself.
        answers = held(s, "lead", 4, posts(s, body(1), {"x-origin-hold": "lead"}), waiters_gave_up)
        assert [r.status_code for r in answers] == [200] * 4
        assert len({r.content for r in answers}) == 1
        assert CACHE_STATUS_COLLAPSED not in {r.headers["cache-status"] for r in answers}
        assert s.origin_calls()["http"] == 4, "each waiter went upstream after 200 ms"
        stats = s.stats_reaching({WAITS: 3, "meshcache.coalesce.timeouts": 3})
        assert stats["meshcache.coalesce.served"] == 0


def test_leader_failure_hands_over_to_one_new_leader_and_waiters_are_answered(tmp_path: Path, host: str) -> None:
    with filter_stack(tmp_path, coalescing(), concurrency=2, host=host) as s:
        headers = {"x-origin-hold": "lead", "x-origin-fail-first": "leader"}
        answers = held(s, "lead", 16, posts(s, body(2), headers), lambda: s.stats_reaching({WAITS: 15}))
        codes = Counter(r.status_code for r in answers)
        assert codes == {500: 1, 200: 15}, codes
        ok = [r for r in answers if r.status_code == 200]
        assert len({r.content for r in ok}) == 1
        assert Counter(r.headers["cache-status"] for r in ok) == {STORED: 1, CACHE_STATUS_COLLAPSED: 14}
        assert s.origin_calls()["http"] == 2, "the failed leader, then one new leader"

        def handed_over(stats: dict[str, int]) -> None:
            # The new leader was woken without an entry (released); each other waiter either was
            # too and waited again, or woke after the new leader stored and was served at once.
            assert stats.get("meshcache.coalesce.released", 0) >= 1 and stats.get("meshcache.coalesce.served") == 14

        s.stats_where(handed_over)


def test_grpc_leader_failure_is_retried_by_one_waiter(tmp_path: Path, host: str) -> None:
    with filter_stack(tmp_path, coalescing(), concurrency=2, host=host) as s:
        meta = (("x-origin-hold", "lead"), ("x-origin-fail-first", "grpc-leader"))
        one = grpc_calls(s, lambda i: infer_request("resnet-mini"), meta)

        def call(i: int, ready: Callable[[], None]) -> tuple[str, bytes]:
            try:
                message, status = one(i, ready)
                return status, message
            except grpc.RpcError as e:
                return e.code().name, b""

        answers = held(s, "lead", 8, call, lambda: s.stats_reaching({WAITS: 7}))
        outcomes = Counter(status for status, _ in answers)
        assert outcomes == {"UNAVAILABLE": 1, STORED: 1, CACHE_STATUS_COLLAPSED: 6}, outcomes
        assert s.origin_calls()["grpc"] == 2


def test_an_uncacheable_answer_sends_every_waiter_upstream(tmp_path: Path, host: str) -> None:
    with filter_stack(tmp_path, coalescing(), concurrency=2, host=host) as s:
        answers = held(s, "lead", 6, posts(s, body(3), {"x-origin-hold": "lead", "x-origin-cache-control": "no-store"}),
                       lambda: s.stats_reaching({WAITS: 5}))
        assert [r.status_code for r in answers] == [200] * 6
        assert {r.headers["cache-status"] for r in answers} == {"meshcache; fwd=miss; detail=no-store"}
        assert s.origin_calls()["http"] == 6
        s.stats_reaching({"meshcache.coalesce.released": 5, WAITS: 5})


def test_a_leader_whose_client_goes_away_releases_its_waiters(tmp_path: Path, host: str) -> None:
    with filter_stack(tmp_path, coalescing(), concurrency=2, host=host) as s:
        headers = {"x-origin-hold": "lead"}
        leader = threading.Thread(target=lambda: _gives_up(s, body(4), headers))
        leader.start()
        origin_reached(s, "http", 1)()  # the leader is in flight
        # Held until one of them, the new leader, has gone upstream after the first one's client left.
        answers = held(s, "lead", 6, posts(s, body(4), headers), origin_reached(s, "http", 2))
        leader.join()
        assert [r.status_code for r in answers] == [200] * 6
        assert Counter(r.headers["cache-status"] for r in answers) == {STORED: 1, CACHE_STATUS_COLLAPSED: 5}
        assert s.origin_calls()["http"] == 2, "the abandoned leader's call, then one new leader"


def _gives_up(s: Stack, content: bytes, headers: dict[str, str]) -> None:
    try:
        post(s, content, headers, timeout=0.6)
    except httpx.TimeoutException:
        return
    raise AssertionError("the leader was expected to time out on the client side")


def test_without_held_headers_waiters_are_answered_too(tmp_path: Path, host: str) -> None:
    """Istio's WasmPlugin mode: the request headers have gone upstream; waiters pause their body
    and are answered by a local reply (Envoy resets their started upstream requests), HTTP and
    gRPC."""
    cfg = config(policy("m"), hold_headers=False)
    with filter_stack(tmp_path, cfg, concurrency=2, allow_on_headers_stop_iteration=False, host=host) as s:
        answers = held(s, "lead", 8, posts(s, body(7), {"x-origin-hold": "lead"}), lambda: s.stats_reaching({WAITS: 7}))
        assert [r.status_code for r in answers] == [200] * 8
        assert len({r.content for r in answers}) == 1
        statuses = Counter(r.headers["cache-status"] for r in answers)
        assert statuses == {"meshcache; fwd=miss": 1, CACHE_STATUS_COLLAPSED: 7}, statuses
        assert s.origin_calls()["http"] == 1, "only the leader's request reached the origin whole"
        # gRPC in that mode: waiters answered by the single-pass hit through filter state.
        call = grpc_calls(s, lambda i: infer_request("m-grpc"), (("x-origin-hold", "grpc-lead"),))
        answers = held(s, "grpc-lead", 6, call, lambda: s.stats_reaching({WAITS: 7 + 5}))
        assert len({message for message, _ in answers}) == 1
        assert Counter(status for _, status in answers)[CACHE_STATUS_COLLAPSED] == 5
        assert s.origin_calls()["grpc"] == 1


def test_coalesce_timeout_ms_0_turns_it_off(tmp_path: Path, host: str) -> None:
    with filter_stack(tmp_path, coalescing(coalesce_timeout_ms=0), concurrency=2, host=host) as s:
        # All eight in flight at the origin at once: none waited for another.
        answers = held(s, "all", 8, posts(s, body(5), {"x-origin-hold": "all"}), origin_reached(s, "http", 8))
        # Identical answers stored at once: one store wins the slot, the others say so.
        assert {r.headers["cache-status"] for r in answers} <= {STORED, "meshcache; fwd=miss; detail=contended"}
        assert s.origin_calls()["http"] == 8
        assert s.stats_reaching({"meshcache.misses": 8})[WAITS] == 0  # counted with the lookups


def test_distinct_keys_are_not_coalesced(tmp_path: Path, host: str) -> None:
    with filter_stack(tmp_path, coalescing(), concurrency=2, host=host) as s:
        answers = held(s, "all", 12, lambda i, ready: posts(s, body(100 + i), {"x-origin-hold": "all"})(i, ready),
                       origin_reached(s, "http", 12))
        assert {r.headers["cache-status"] for r in answers} == {STORED}
        assert len({r.content for r in answers}) == 12
        assert s.origin_calls()["http"] == 12
        assert s.stats_reaching({"meshcache.misses": 12})[WAITS] == 0


def test_waiters_past_the_per_key_bound_go_upstream_and_are_counted(tmp_path: Path, host: str) -> None:
    """An attacker (or a stampede) sending many identical requests cannot park more than the
    bound per key and worker: the rest go upstream at once, counted as overflow."""
    n = 200
    with filter_stack(tmp_path, coalescing(), concurrency=2, host=host) as s:
        def all_parked_or_upstream(stats: dict[str, int]) -> None:
            assert stats.get(WAITS, 0) + stats.get("meshcache.coalesce.overflow", 0) == n - 1, stats

        answers = held(s, "lead", n, posts(s, body(6), {"x-origin-hold": "lead"}),
                       lambda: s.stats_where(all_parked_or_upstream, timeout=30))
        assert [r.status_code for r in answers] == [200] * n
        assert len({r.content for r in answers}) == 1

        def all_served(stats: dict[str, int]) -> None:
            assert stats.get("meshcache.coalesce.served") == stats.get(WAITS), stats

        stats = s.stats_where(all_served)
        overflow, waits = stats["meshcache.coalesce.overflow"], stats[WAITS]
        assert waits <= 2 * 64, "at most MAX_WAITERS_PER_KEY (64) per worker wait"
        assert overflow >= n - 1 - 2 * 64
        assert s.origin_calls()["http"] == 1 + overflow, "the leader and every overflowing request"
        assert stats["meshcache.coalesce.served"] == waits


def test_an_expired_hot_entry_is_refreshed_by_one_request(tmp_path: Path, host: str) -> None:
    """A popular entry's expiry is a stampede too: its refresh is coalesced like a miss."""
    with filter_stack(tmp_path, coalescing(), concurrency=2, host=host) as s:
        first = post(s, body(8), {"x-origin-cache-control": "max-age=1"})
        assert first.headers["cache-status"] == STORED
        time.sleep(1.2)
        refresh = {"x-origin-hold": "lead", "x-origin-cache-control": "max-age=60"}
        answers = held(s, "lead", 8, posts(s, body(8), refresh), lambda: s.stats_reaching({WAITS: 7}))
        assert Counter(r.headers["cache-status"] for r in answers) == {STORED: 1, CACHE_STATUS_COLLAPSED: 7}
        assert s.origin_calls()["http"] == 2


def test_when_the_refresh_fails_every_waiter_gets_the_stale_entry(tmp_path: Path, host: str) -> None:
    """stale-if-error with coalescing: the one request that went upstream met the origin's 503
    and was answered from the expired entry; its waiters are answered from it too."""
    with filter_stack(tmp_path, coalescing(stale_if_error_s=30), concurrency=2, host=host) as s:
        first = post(s, body(9), {"x-origin-cache-control": "max-age=1"})
        time.sleep(1.2)
        answers = held(s, "lead", 8, posts(s, body(9), {"x-origin-hold": "lead", "x-origin-status": "503"}),
                       lambda: s.stats_reaching({WAITS: 7}))
        assert [r.status_code for r in answers] == [200] * 8
        assert {r.content for r in answers} == {first.content}
        statuses = [r.headers["cache-status"] for r in answers]
        assert sum(st.endswith("; fwd=stale; fwd-status=503; detail=stale-if-error") for st in statuses) == 1
        assert sum(st.endswith("; fwd=stale; detail=stale-if-error; collapsed") for st in statuses) == 7, statuses
        assert all(st.startswith("meshcache; hit; stale; ttl=-") for st in statuses)
        assert s.origin_calls()["http"] == 2, "one refresh attempt for all eight"
        s.stats_reaching({"meshcache.stale_if_error": 8, "meshcache.coalesce.served": 7})


def test_grpc_waiters_get_the_stale_message_when_the_refresh_fails(tmp_path: Path, host: str) -> None:
    with filter_stack(tmp_path, config(policy("resnet", ttl_s=1, stale_if_error_s=30)), concurrency=2, host=host) as s:
        request = infer_request("resnet-mini")
        first, _ = s.grpc_infer(request)
        time.sleep(1.2)
        meta = (("x-origin-hold", "lead"), ("x-origin-grpc-code", "UNAVAILABLE"))
        answers = held(s, "lead", 6, grpc_calls(s, lambda i: request, meta), lambda: s.stats_reaching({WAITS: 5}))
        assert {message for message, _ in answers} == {first}
        statuses = [status for _, status in answers]
        assert sum(st.endswith("; detail=stale-if-error; collapsed") for st in statuses) == 5, statuses
        assert s.origin_calls()["grpc"] == 2
