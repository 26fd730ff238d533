"""Snapshots and the Redis store in-process (real redis-server), plus property-based tests."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshcache.contract.filter_config import Policy
from meshcache.control_plane import history
from meshcache.control_plane import snapshots as ch
from meshcache.control_plane.schemas import PolicySpec
from meshcache.control_plane.settings import Settings
from meshcache.control_plane.snapshots import EMPTY, Snapshot, SnapshotCache
from meshcache.control_plane.store import Store, VersionConflict
from meshcache.ctl import procs

PREFIXES = ["a", "ab", "llama", "llama3-70b"]


def row(prefix: str, ttl_s: int) -> Policy:
    return Policy(model_prefix=prefix, ttl_s=ttl_s, max_ttl_s=ttl_s)


spec_strategy = st.builds(
    PolicySpec,
    ttl_s=st.integers(0, 1000),
    scope=st.sampled_from(["shared", "principal"]),
    enabled=st.booleans(),
    vary_headers=st.lists(st.sampled_from(["accept", "x-user", "x-tenant"]), unique=True, max_size=3),
    ignore_fields=st.lists(st.sampled_from(["user", "metadata", "caf\u00e9"]), unique=True, max_size=3),
    deterministic_only=st.booleans(),
    coalesce_timeout_ms=st.sampled_from([0, 250, 5000]),
    stale_if_error_s=st.integers(0, 86_400),
)
# A put carries an arbitrary generation: put_policy must replace it with the server's.
op_strategy = st.one_of(
    st.tuples(st.just("put"), st.sampled_from(PREFIXES), st.tuples(spec_strategy, st.integers(0, 10**6))),
    st.tuples(st.just("delete"), st.sampled_from(PREFIXES), st.none()),
    st.tuples(st.just("purge"), st.sampled_from(PREFIXES), st.none()),
    st.tuples(st.just("rollback"), st.integers(0, 30), st.none()),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(op_strategy, max_size=30))
def test_generations_never_go_backwards_and_purge_always_moves_forward(ops: list[tuple]) -> None:
    history = [EMPTY]
    highest: dict[str, int] = {}  # highest generation ever used per prefix
    for kind, arg, spec in ops:
        cur, v = history[-1], history[-1].version + 1
        try:
            if kind == "put":
                body, given_generation = spec
                new = ch.put_policy(cur, v, "t", body.policy(arg, given_generation), max_policies=10)
                before = cur.policy(arg)
                put = new.policy(arg)
                assert put is not None and put.generation == (before.generation if before else v)
            elif kind == "delete":
                new = ch.delete_policy(cur, v, "t", arg)
            elif kind == "purge":
                new = ch.purge(cur, v, "t", arg)
            else:
                new = ch.rollback(cur, history[min(arg, len(history) - 1)], v, "t")
        except ch.NotFound:
            continue
        for p in new.policies:
            assert p.generation >= highest.get(p.model_prefix, 0)
            if kind == "purge" and p.model_prefix == arg:
                assert p.generation > highest.get(arg, 0)
            highest[p.model_prefix] = p.generation
        # The rendered config is canonical: the record round-trips to identical bytes.
        assert Snapshot.from_record(new.to_record()).plugin_config_json == new.plugin_config_json
        cfg = json.loads(new.plugin_config_json)
        assert cfg["version"] == str(v)
        assert all(p["max_ttl_s"] >= p["ttl_s"] >= 0 for p in cfg["policies"])
        history.append(new)


def test_cache_versions_only_move_forward() -> None:
    cache = SnapshotCache()
    seen: list[int] = []
    cache.watch(lambda s: seen.append(s.version))
    assert cache.set(Snapshot(version=2))
    assert not cache.set(Snapshot(version=1))
    assert not cache.set(Snapshot(version=2))
    assert cache.set(Snapshot(version=5))
    assert seen == [2, 5] and cache.current.version == 5


@pytest.fixture
def store_settings(redis_server: tuple[procs.Proc, int], tmp_path: Path) -> Settings:
    return Settings(redis_url=f"redis://127.0.0.1:{redis_server[1]}/0", snapshot_retention=10,
                    audit_maxlen=100, wasm_path=tmp_path / "f.wasm")


def test_commit_is_compare_and_set(store_settings: Settings) -> None:
    async def scenario() -> None:
        store = Store(store_settings)
        try:
            s1 = ch.put_policy(EMPTY, 1, "t", row("m", 1), 10)
            assert await store.commit(s1, 0, "t", "d") == 1
            # A writer that derived from version 0 too loses, and nothing of it is written.
            other = ch.put_policy(EMPTY, 1, "t", row("x", 1), 10)
            with pytest.raises(VersionConflict) as info:
                await store.commit(other, 0, "t", "d")
            assert info.value.current == 1
            assert (await store.load_current()).same_content(s1)
            # Concurrent writers from one base: exactly one wins.
            base = await store.load_current()
            cands = [ch.put_policy(base, 2, "t", row(f"p{i}", i), 10) for i in range(8)]
            results = await asyncio.gather(*(store.commit(c, 1, "t", "d") for c in cands),
                                           return_exceptions=True)
            assert sum(1 for r in results if r == 2) == 1
            assert sum(1 for r in results if isinstance(r, VersionConflict)) == 7
        finally:
            await store.close()

    asyncio.run(scenario())


def test_retention_audit_bound_and_restore(store_settings: Settings) -> None:
    async def scenario() -> None:
        store = Store(store_settings)
        try:
            cur = EMPTY
            for i in range(1, 301):
                cur = ch.put_policy(cur, i, "t", row("m", i), 10)
                await store.commit(cur, i - 1, "t", "d")
            assert await store.load(300) is not None
            assert await store.load(291) is not None and await store.load(290) is None  # retention 10
            assert await store.redis.xlen(store.audit_key) <= 200  # MAXLEN ~ 100 (approximate trim)
            # Redis lost data (say, restarted without AOF): a newer snapshot is put back, never older.
            await store.redis.set(store.current_key, 5)
            assert await store.restore(cur) == 300
            assert await store.current_version() == 300
            assert await store.restore(Snapshot(version=10)) == 300
        finally:
            await store.close()

    asyncio.run(scenario())


def test_history_reads_the_longest_page_past_the_connection_pool(store_settings: Settings) -> None:
    # More snapshots than the store's 64 pooled connections: one concurrent GET each failed
    # ("Too many connections" -> 503), which the schemathesis run hit once its writes passed 64.
    async def scenario() -> None:
        store = Store(store_settings.model_copy(update={"snapshot_retention": 200}))
        try:
            cur = EMPTY
            for i in range(1, history.MAX_HISTORY + 11):
                cur = ch.put_policy(cur, i, "t", row(f"p{i % 3}", i), 10)
                await store.commit(cur, i - 1, "t", "d")
            page = await history.recent(store, cur, history.MAX_HISTORY)
            assert [e["version"] for e in page] == list(range(cur.version, cur.version - history.MAX_HISTORY, -1))
            assert all(e["diff_known"] and e["changes"][0]["fields"]["ttl_s"][1] == e["version"] for e in page)
            assert await store.load_many([]) == []
            assert [s.version if s else None for s in await store.load_many([3, 10_000])] == [3, None]
        finally:
            await store.close()

    asyncio.run(scenario())
