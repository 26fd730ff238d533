"""The filter in a real Envoy, HTTP inference traffic: what is cached, keyed, served and stored."""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from meshcache.contract.paths import REPO_ROOT
from meshcache.ctl import procs
from meshcache.ctl.istio import monitoring
from meshcache.ctl.procs import local_http
from tests.filter.stack import SharedStacks, config, expected_hash, filter_stack, policy
from tests.helpers.filter_stats import filter_stats
from tests.helpers.wait import eventually

INFER = "/v2/models/m/infer"
NOT_STORED = "meshcache; fwd=miss; detail="
BODY = b'{"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}]}'


@pytest.mark.envoy_1_39
def test_second_identical_request_is_a_hit_and_origin_is_not_called(tmp_path: Path, host: str) -> None:
    with filter_stack(tmp_path, config(), host=host) as s, httpx.Client() as c:
        first = c.post(s.url(INFER), content=BODY, headers={"content-type": "application/json"})
        assert first.status_code == 200
        assert first.headers["cache-status"] == "meshcache; fwd=miss; stored"
        h = expected_hash(first.content, {"content-type": "application/json"})
        assert first.headers["x-response-hash"] == h
        assert first.headers["etag"] == f'"{h}"'

        second = c.post(s.url(INFER), content=BODY, headers={"content-type": "application/json"})
        assert second.status_code == 200
        assert second.content == first.content
        assert second.headers["cache-status"] == "meshcache; hit; ttl=60"
        assert second.headers["x-response-hash"] == h
        assert second.headers["content-type"] == "application/json"
        assert int(second.headers["age"]) >= 0
        assert s.origin_calls()["http"] == 1
        stats = s.stats_reaching({"meshcache.hits": 1, "meshcache.misses": 1, "meshcache.stores": 1,
                                  "meshcache.policy.m.hits": 1, "meshcache.policy.m.misses": 1,
                                  "meshcache.entries": 1})
        assert stats["meshcache.bytes"] > len(first.content)


def test_model_sources_header_and_openai_body(tmp_path: Path, host: str) -> None:
    cfg = config(policy("m"), policy("gpt", ttl_s=30))
    with filter_stack(tmp_path, cfg, host=host) as s, httpx.Client() as c:
        for _ in range(2):
            r = c.post(s.url("/v1/infer"), content=b'{"input": [1], "shape": [1]}', headers={"x-model-id": "m-small"})
        assert r.headers["cache-status"] == "meshcache; hit; ttl=60"
        chat = b'{"model": "gpt-mini", "messages": [{"role": "user", "content": "hi"}]}'
        for _ in range(2):
            r = c.post(s.url("/v1/chat/completions"), content=chat, headers={"content-type": "application/json"})
        assert r.headers["cache-status"] == "meshcache; hit; ttl=30"
        no_model = c.post(s.url("/v1/chat/completions"), content=b'{"messages": []}')
        assert no_model.headers["cache-status"] == "meshcache; fwd=bypass; detail=no-model"
        assert s.origin_calls()["http"] == 3


def test_what_shapes_the_answer_gets_its_own_entry(tmp_path: Path, host: str) -> None:
    cfg = config(policy("m", vary_headers=["x-tenant"]), color="inference-2026")
    with filter_stack(tmp_path, cfg, host=host) as s, httpx.Client() as c:
        variants = [
            ("/v2/models/m/infer", BODY, {}),
            ("/v2/models/m/infer", BODY + b" ", {}),
            ("/v2/models/m2/infer", BODY, {}),
            ("/v2/models/m/versions/2/infer", BODY, {}),
            ("/v2/models/m/infer", BODY, {"x-traffic-color": "blue"}),
            ("/v2/models/m/infer", BODY, {"x-tenant": "a"}),
            ("/v2/models/m/infer", BODY, {"x-tenant": "b"}),
        ]
        for path, body, headers in variants:
            r = c.post(s.url(path), content=body, headers=headers)
            assert r.headers["cache-status"] == "meshcache; fwd=miss; stored", (path, headers)
        for path, body, headers in variants:
            r = c.post(s.url(path), content=body, headers=headers)
            assert r.headers["cache-status"].startswith("meshcache; hit"), (path, headers)
        # The config's colour is the default when the request names none.
        r = c.post(s.url(INFER), content=BODY, headers={"x-traffic-color": "inference-2026"})
        assert r.headers["cache-status"].startswith("meshcache; hit")
        # A header that is not a vary header does not split entries.
        r = c.post(s.url(INFER), content=BODY, headers={"x-unrelated": "1"})
        assert r.headers["cache-status"].startswith("meshcache; hit")
        assert s.origin_calls()["http"] == len(variants)


def test_ttl_expiry_and_origin_cache_control(tmp_path: Path, host: str) -> None:
    cfg = config(policy("short", ttl_s=1), policy("m", ttl_s=60, max_ttl_s=120))
    with filter_stack(tmp_path, cfg, host=host) as s, httpx.Client() as c:
        url = s.url("/v2/models/short/infer")
        assert c.post(url, content=BODY).headers["cache-status"] == "meshcache; fwd=miss; stored"
        assert c.post(url, content=BODY).headers["cache-status"] == "meshcache; hit; ttl=1"
        time.sleep(1.2)
        expired = c.post(url, content=BODY)
        assert expired.headers["cache-status"] == "meshcache; fwd=miss; stored", "expired entries are never served"
        assert s.origin_calls()["http"] == 2

        # Origin max-age beyond max_ttl_s is clamped; s-maxage wins over max-age.
        for cc, ttl in (("max-age=100000", 120), ("max-age=5, s-maxage=7", 7)):
            headers = {"x-origin-cache-control": cc}
            c.post(s.url(INFER), content=json.dumps({"cc": cc}).encode(), headers=headers)
            r = c.post(s.url(INFER), content=json.dumps({"cc": cc}).encode(), headers=headers)
            assert r.headers["cache-status"] == f"meshcache; hit; ttl={ttl}"


@pytest.mark.parametrize(
    ("request_headers", "first_status", "then_status"),
    [
        ({"cache-control": "no-store"}, "meshcache; fwd=bypass; detail=no-store",
         "meshcache; fwd=bypass; detail=no-store"),
        ({"x-origin-cache-control": "no-store"}, NOT_STORED + "no-store", NOT_STORED + "no-store"),
        ({"x-origin-cache-control": "private, max-age=60"}, NOT_STORED + "private", NOT_STORED + "private"),
        ({"x-origin-status": "500"}, "meshcache; fwd=miss; detail=status", "meshcache; fwd=miss; detail=status"),
        ({"x-origin-status": "404"}, "meshcache; fwd=miss; detail=status", "meshcache; fwd=miss; detail=status"),
        ({"authorization": "Bearer t"}, "meshcache; fwd=bypass; detail=credentials",
         "meshcache; fwd=bypass; detail=credentials"),
    ],
)
def test_not_cached(shared_stacks: SharedStacks, request_headers: dict[str, str], first_status: str,
                    then_status: str, host: str) -> None:
    s = shared_stacks.get(config(), host)
    with httpx.Client() as c:
        first = c.post(s.infer_url("m"), content=BODY, headers=request_headers)
        second = c.post(s.infer_url("m"), content=BODY, headers=request_headers)
        assert first.headers["cache-status"] == first_status
        assert second.headers["cache-status"] == then_status
        assert "x-response-hash" not in second.headers
        assert second.status_code == int(request_headers.get("x-origin-status", "200"))
        assert s.origin_calls()["http"] == 2


@pytest.mark.parametrize("directive", ["no-cache", "max-age=0"])
def test_client_no_cache_refreshes_the_entry(shared_stacks: SharedStacks, host: str, directive: str) -> None:
    """RFC 9111 §5.2.1: a request that accepts no stored answer goes upstream, gets the origin's
    answer (never the stored one, never another caller's) and that answer refreshes the entry."""
    s = shared_stacks.get(config(), host)
    served = lambda n: {"x-origin-header": f"x-served: {n}"}  # noqa: E731 - not keyed: same entry
    with httpx.Client() as c:
        url = s.infer_url("m")
        assert c.post(url, content=BODY, headers=served(1)).headers["cache-status"] == "meshcache; fwd=miss; stored"
        r = c.post(url, content=BODY, headers={"cache-control": directive, **served(2)})
        assert r.headers["cache-status"] == "meshcache; fwd=request; stored"
        assert r.headers["x-served"] == "2", "the origin's answer, not the stored one"
        hit = c.post(url, content=BODY, headers=served(3))
        assert hit.headers["cache-status"].startswith("meshcache; hit")
        assert hit.headers["x-served"] == "2", "the revalidation refreshed the entry"
        assert s.origin_calls()["http"] == 2


def test_a_policy_may_ignore_client_no_cache(shared_stacks: SharedStacks, host: str) -> None:
    """`client_no_cache: ignore`: a client's no-cache / max-age=0 is looked up like any request."""
    s = shared_stacks.get(config(policy("m", client_no_cache="ignore")), host)
    with httpx.Client() as c:
        url = s.infer_url("m")
        assert c.post(url, content=BODY).headers["cache-status"] == "meshcache; fwd=miss; stored"
        for directive in ("no-cache", "max-age=0"):
            r = c.post(url, content=BODY, headers={"cache-control": directive})
            assert r.headers["cache-status"].startswith("meshcache; hit"), directive
        assert s.origin_calls()["http"] == 1


def test_model_without_policy_and_non_inference_requests(tmp_path: Path, host: str) -> None:
    cfg = config(policy("m"), policy("off", enabled=False))
    with filter_stack(tmp_path, cfg, host=host) as s, httpx.Client() as c:
        for path, why in (("/v2/models/other/infer", "no-policy"), ("/v2/models/off/infer", "disabled")):
            for _ in range(2):
                r = c.post(s.url(path), content=BODY)
                assert r.headers["cache-status"] == f"meshcache; fwd=bypass; detail={why}"
        assert s.origin_calls()["http"] == 4
        get = c.get(s.url("/calls"))
        assert "cache-status" not in get.headers
        plain_post = c.post(s.url("/upload"), content=b"data")
        assert "cache-status" not in plain_post.headers
        # Another method on an inference path says why it is not cached.
        assert c.get(s.url("/v2/models/m/infer")).headers["cache-status"] == "meshcache; fwd=bypass; detail=method"
        # Counted in all, and per reason (the Cache-Status detail; every reason is defined up front).
        s.stats_reaching({"meshcache.bypasses": 5, "meshcache.bypass.no-policy": 2, "meshcache.bypass.disabled": 2,
                          "meshcache.bypass.method": 1})
        prom = local_http().get(f"http://127.0.0.1:{s.admin_port}/stats/prometheus", timeout=5).text
    reasons = {name: int(value) for name, value in BYPASS_REASON_LINE.findall(prom)}
    assert reasons == {detail.replace("-", "_"): {"no-policy": 2, "disabled": 2, "method": 1}.get(detail, 0)
                       for detail in documented_bypass_details()}, reasons


BYPASS_REASON_LINE = re.compile(r"^(?:envoy_wasmcustom_)?meshcache_bypass_(\w+)(?:\{\})? (\d+)$", re.M)


def documented_bypass_details() -> list[str]:
    """The `detail` column of docs/filter.md's bypass table: the fixed set of reasons."""
    doc = (REPO_ROOT / "docs" / "filter.md").read_text()
    table = doc.split("### Why a request bypasses", 1)[1].split("\n\n")[2]
    details = re.findall(r"^\| `([a-z-]+)` \|", table, re.M)
    assert len(details) >= 19, table
    # The scrape configs restore at most REASON_HYPHENS `-` in the `reason` label (deploy/).
    assert max(d.count("-") for d in details) <= monitoring.REASON_HYPHENS, details
    return details


@pytest.mark.envoy_1_39
def test_oversized_answers_pass_through_unstored(tmp_path: Path, host: str) -> None:
    with filter_stack(tmp_path, config(max_entry_bytes=1000), host=host) as s, httpx.Client() as c:
        for _ in range(2):
            r = c.post(s.url(INFER), content=BODY, headers={"x-origin-size": "5000"})
            assert r.status_code == 200
            assert len(r.content) == 5000
            assert r.headers["cache-status"] == "meshcache; fwd=miss; detail=too-big"
        small = c.post(s.url(INFER), content=BODY, headers={"x-origin-size": "700"})  # + ~230 entry bytes
        assert small.headers["cache-status"] == "meshcache; fwd=miss; stored"
        assert s.origin_calls()["http"] == 3


def test_if_none_match_gets_304(shared_stacks: SharedStacks, host: str) -> None:
    s = shared_stacks.get(config(), host)
    with httpx.Client() as c:
        url = s.infer_url("m")
        etag = c.post(url, content=BODY).headers["etag"]
        r = c.post(url, content=BODY, headers={"if-none-match": etag})
        assert r.status_code == 304
        assert r.content == b""
        assert r.headers["etag"] == etag
        assert r.headers["cache-status"].startswith("meshcache; hit")
        other = c.post(url, content=BODY, headers={"if-none-match": '"something-else"'})
        assert other.status_code == 200
        # RFC 9110 13.1.2: `*` may be answered 304 only on GET and HEAD; a POST gets the answer.
        for star in ("*", '"something-else", *'):
            r = c.post(url, content=BODY, headers={"if-none-match": star})
            assert r.status_code == 200, star
            assert r.headers["cache-status"].startswith("meshcache; hit")
            assert r.content == other.content
        # An origin ETag is kept and is what If-None-Match compares with.
        c.post(url, content=b'{"n": 2}', headers={"x-origin-etag": '"v7"'})
        r = c.post(url, content=b'{"n": 2}', headers={"x-origin-etag": '"v7"', "if-none-match": 'W/"v7"'})
        assert r.status_code == 304
        assert r.headers["etag"] == '"v7"'


def test_client_cannot_forge_internal_markers(shared_stacks: SharedStacks, host: str) -> None:
    s = shared_stacks.get(config(), host)
    with httpx.Client() as c:
        first = c.post(s.infer_url("m"), content=BODY)
        forged = {"x-meshcache-hit": "00" * 32, "x-meshcache-local": "1"}
        r = c.post(s.infer_url("nopolicy"), content=BODY, headers=forged)
        assert r.status_code == 200, "went to the origin"
        assert r.headers["cache-status"] == "meshcache; fwd=bypass; detail=no-policy"
        r = c.post(s.url("/upload"), content=BODY, headers=forged)
        assert r.status_code == 200
        assert s.origin_calls()["http"] == 3
        assert first.status_code == 200


def test_all_workers_share_one_cache(tmp_path: Path, host: str) -> None:
    with filter_stack(tmp_path, config(), concurrency=2, host=host) as s:
        assert local_http().post(s.url(INFER), content=BODY).headers["cache-status"] == "meshcache; fwd=miss; stored"
        statuses = set()
        for _ in range(12):
            with httpx.Client() as fresh_connection:
                statuses.add(fresh_connection.post(s.url(INFER), content=BODY).headers["cache-status"])
        assert all(st.startswith("meshcache; hit; ttl=") for st in statuses), statuses
        assert s.origin_calls()["http"] == 1


def test_memory_bound_holds_after_filling_past_the_limit(tmp_path: Path, host: str) -> None:
    cfg = config(max_entries=8, max_total_bytes=16384, max_entry_bytes=4096)
    with filter_stack(tmp_path, cfg, host=host) as s, httpx.Client() as c:
        for i in range(40):
            r = c.post(s.url(INFER), content=f'{{"request": {i}}}'.encode(), headers={"x-origin-size": "1500"})
            assert r.headers["cache-status"] == "meshcache; fwd=miss; stored"
            # The bound holds at every reading (the latest flush, maybe not this store's yet)...
            stats = filter_stats(s.admin_port)
            assert stats["meshcache.bytes"] <= 16384
            assert stats["meshcache.entries"] <= 8
        # ...and once every store has reached the gauges.
        stats = s.stats_reaching({"meshcache.stores": 40})
        assert stats["meshcache.bytes"] <= 16384
        assert stats["meshcache.entries"] <= 8
        assert stats["meshcache.evictions"] >= 30
        # The newest entry is served.
        r = c.post(s.url(INFER), content=b'{"request": 39}', headers={"x-origin-size": "1500"})
        assert r.headers["cache-status"].startswith("meshcache; hit")


def test_concurrent_misses_for_one_key_store_once_and_account_exactly(tmp_path: Path, host: str) -> None:
    # Coalescing off: the three misses go upstream together and race to store.
    with filter_stack(tmp_path, config(policy("m", coalesce_timeout_ms=0)), host=host) as s:
        # The origin holds them until all three are there: they are in flight together.
        shaping = {"x-origin-size": "500", "x-origin-hold": "all"}

        def miss() -> httpx.Response:
            return procs.local_http().post(s.url(INFER), content=BODY, headers=shaping, timeout=30)

        with ThreadPoolExecutor(3) as pool:
            sent = [pool.submit(miss) for _ in range(3)]
            try:
                eventually(lambda: s.origin_calls()["http"] == 3)
            finally:
                s.release("all")
            statuses = sorted(f.result().headers["cache-status"] for f in sent)
        assert statuses == ["meshcache; fwd=miss; detail=contended"] * 2 + ["meshcache; fwd=miss; stored"]
        one = s.stats_reaching({"meshcache.stores": 1, "meshcache.entries": 1})
        # Another entry of the same size doubles the accounted bytes: nothing leaked.
        r = local_http().post(s.url(INFER), content=BODY + b" ", headers={"x-origin-size": "500"}, timeout=10)
        assert r.headers["cache-status"] == "meshcache; fwd=miss; stored"
        s.stats_reaching({"meshcache.entries": 2, "meshcache.bytes": 2 * one["meshcache.bytes"]})


def test_invalid_configuration_is_rejected_with_the_field_named(tmp_path: Path, host: str) -> None:
    from meshcache.ctl.procs import StartError

    bad = config(policy("m", ttl_s=10, max_ttl_s=5))
    with pytest.raises(StartError) as err, filter_stack(tmp_path, bad, host=host):
        pass
    assert "invalid plugin configuration: policies[0].max_ttl_s: must be at least ttl_s" in str(err.value) or (
        "policies[0].max_ttl_s" in (tmp_path / "envoy.log").read_text()
    )


def test_entries_and_bytes_per_policy_add_up_under_two_workers(tmp_path: Path, host: str) -> None:
    """Two Envoy workers race stores of the same keys for two policies (and evict, the store being
    small): the per-policy gauges always add up to the totals, nothing is unattributed."""
    cfg = config(policy("m"), policy("gpt", ttl_s=30), max_entries=32, max_total_bytes=48 * 1024,
                 max_entry_bytes=4096)
    bodies = [(f"/v2/models/{model}/infer", f'{{"request": {i}}}'.encode()) for i in range(40)
              for model in ("m-small", "gpt-mini")]
    # One client (a pool of up to 8 connections, spread over the workers): a client per request
    # costs more than the request.
    with filter_stack(tmp_path, cfg, concurrency=2, host=host) as s, ThreadPoolExecutor(8) as pool, \
            httpx.Client(timeout=10) as c:
        def send(item: tuple[str, bytes]) -> str:
            path, body = item
            r = c.post(s.url(path), content=body, headers={"x-origin-size": "700"})
            assert r.status_code == 200
            return r.headers["cache-status"]

        statuses = list(pool.map(send, bodies * 3))
        assert any(st.endswith("stored") for st in statuses) and any("hit" in st for st in statuses)
        # Every request counted as a hit or a miss, once both workers have flushed them all (the
        # gauges below are read with those counts).
        stats = eventually(lambda: (st := filter_stats(s.admin_port))["meshcache.hits"]
                           + st["meshcache.misses"] >= len(statuses) and st)
        per = {k: v for k, v in stats.items() if k.startswith("meshcache.policy.") and k.endswith(("entries", "bytes"))}
        assert set(per) == {f"meshcache.policy.{p}.{w}" for p in ("m", "gpt") for w in ("entries", "bytes")}
        assert stats["meshcache.unattributed.entries"] == 0 and stats["meshcache.unattributed.bytes"] == 0
        for what in ("entries", "bytes"):
            assert per[f"meshcache.policy.m.{what}"] + per[f"meshcache.policy.gpt.{what}"] == stats[f"meshcache.{what}"]
        assert 0 < stats["meshcache.entries"] <= 32 and stats["meshcache.bytes"] <= 48 * 1024
        assert per["meshcache.policy.m.entries"] > 0 and per["meshcache.policy.gpt.entries"] > 0
        assert stats["meshcache.evictions"] > 0 and stats["meshcache.errors"] == 0
