"""Reading the filter's counters from Prometheus text, per-model sums, sources, snapshot diffs."""

from __future__ import annotations

import pytest

from meshcache.contract.filter_config import Limits, Policy
from meshcache.control_plane.history import diff
from meshcache.control_plane.proxy_stats import (
    ProxyCounters,
    ProxyReading,
    ProxyStatsReader,
    StatsConfigError,
    parse_dns_names,
    parse_prometheus,
    parse_sources,
    per_model,
    prom_name,
    semantic_totals,
    unattributed,
)
from meshcache.control_plane.snapshots import Snapshot

# The shape Envoy's /stats/prometheus gives a Wasm filter's stats (custom namespace stripped).
ENVOY_PAGE = """\
# TYPE envoy_cluster_upstream_rq_total counter
envoy_cluster_upstream_rq_total{envoy_cluster_name="engine"} 12
# TYPE meshcache_hits counter
meshcache_hits{} 7
# TYPE meshcache_misses counter
meshcache_misses{} 5
# TYPE meshcache_policy_resnet_mini_hits counter
meshcache_policy_resnet_mini_hits{} 4
# TYPE meshcache_policy_resnet_mini_misses counter
meshcache_policy_resnet_mini_misses{} 1
# TYPE meshcache_policy_bert_v2_hits counter
meshcache_policy_bert_v2_hits{} 3
# TYPE meshcache_policy_old_model_misses counter
meshcache_policy_old_model_misses{} 4
# TYPE meshcache_cp_snapshot_version gauge
meshcache_cp_snapshot_version 9
# TYPE meshcache_entries gauge
meshcache_entries{} 3
# TYPE meshcache_bytes gauge
meshcache_bytes{} 1236
"""

# The same proxy with a filter that reports entries and bytes per policy.
PER_POLICY_GAUGES = ENVOY_PAGE + """# TYPE meshcache_policy_resnet_mini_entries gauge
meshcache_policy_resnet_mini_entries{} 2
# TYPE meshcache_policy_resnet_mini_bytes gauge
meshcache_policy_resnet_mini_bytes{} 1000
# TYPE meshcache_policy_bert_v2_entries gauge
meshcache_policy_bert_v2_entries{} 0
# TYPE meshcache_policy_bert_v2_bytes gauge
meshcache_policy_bert_v2_bytes{} 0
# TYPE meshcache_policy_a_hits_entries gauge
meshcache_policy_a_hits_entries{} 0
# TYPE meshcache_unattributed_entries gauge
meshcache_unattributed_entries{} 1
# TYPE meshcache_unattributed_bytes gauge
meshcache_unattributed_bytes{} 236
"""

# The same proxy with a filter that counts LLM tokens served from the cache per policy and has the
# semantic layer (issue 38): `meshcache.policy.llama3-.tokens_saved_prompt` in the filter, `-` as
# `_` in Envoy's Prometheus output (so the prefix `llama3-` ends in `__`).
LLM_PAGE = PER_POLICY_GAUGES + """# TYPE meshcache_policy_llama3__hits counter
meshcache_policy_llama3__hits{} 6
# TYPE meshcache_policy_llama3__misses counter
meshcache_policy_llama3__misses{} 2
# TYPE meshcache_policy_llama3__tokens_saved_prompt counter
meshcache_policy_llama3__tokens_saved_prompt{} 162
# TYPE meshcache_policy_llama3__tokens_saved_completion counter
meshcache_policy_llama3__tokens_saved_completion{} 72
# TYPE meshcache_policy_resnet_mini_tokens_saved_prompt counter
meshcache_policy_resnet_mini_tokens_saved_prompt{} 0
# TYPE meshcache_policy_resnet_mini_tokens_saved_completion counter
meshcache_policy_resnet_mini_tokens_saved_completion{} 0
# TYPE meshcache_semantic_lookups counter
meshcache_semantic_lookups{} 9
# TYPE meshcache_semantic_hits counter
meshcache_semantic_hits{} 2
# TYPE meshcache_semantic_would_hit counter
meshcache_semantic_would_hit{} 3
# TYPE meshcache_semantic_errors counter
meshcache_semantic_errors{} 1
"""


def test_parse_keeps_the_filter_samples_only() -> None:
    c = parse_prometheus(ENVOY_PAGE)
    assert c.totals == {"hits": 7, "misses": 5, "entries": 3, "bytes": 1236}
    assert c.policies == {"resnet_mini": {"hits": 4, "misses": 1}, "bert_v2": {"hits": 3, "misses": 0},
                          "old_model": {"hits": 0, "misses": 4}}


def test_the_native_hosts_names_read_the_same() -> None:
    """An Envoy with only the native host keeps `envoy_wasmcustom_` in front (no Wasm filter
    registered the namespace); Envoy's own `envoy_*` stats stay ignored."""
    native = "\n".join(line.replace("meshcache_", "envoy_wasmcustom_meshcache_", 1)
                        if "meshcache_cp" not in line else line for line in PER_POLICY_GAUGES.splitlines())
    assert "envoy_wasmcustom_meshcache_hits{} 7" in native
    c, wasm = parse_prometheus(native), parse_prometheus(PER_POLICY_GAUGES)
    assert (c.totals, c.policies, c.unattributed) == (wasm.totals, wasm.policies, wasm.unattributed)


def test_per_policy_gauges_parse_and_add_up() -> None:
    c = parse_prometheus(PER_POLICY_GAUGES)
    assert c.per_policy_gauges and not parse_prometheus(ENVOY_PAGE).per_policy_gauges
    assert c.policies["resnet_mini"] == {"hits": 4, "misses": 1, "entries": 2, "bytes": 1000}
    assert c.policies["a_hits"] == {"hits": 0, "misses": 0, "entries": 0}, "a prefix ending in _hits"
    assert c.unattributed == {"entries": 1, "bytes": 236}
    assert sum(p.get("bytes", 0) for p in c.policies.values()) + c.unattributed["bytes"] == c.totals["bytes"]


def test_per_model_entries_are_unknown_unless_every_readable_proxy_reports_them() -> None:
    new = ProxyReading("a", "http://a", True, None, 0.0, parse_prometheus(PER_POLICY_GAUGES))
    new2 = ProxyReading("b", "http://b", True, None, 0.0, parse_prometheus(PER_POLICY_GAUGES))
    old = ProxyReading("c", "http://c", True, None, 0.0, parse_prometheus(ENVOY_PAGE))
    down = ProxyReading("d", "http://d", False, "timed out", 0.0, None)
    rows = {r.model_prefix: r for r in per_model([new, new2, down], ["resnet-mini", "bert.v2", "idle"])}
    assert (rows["resnet-mini"].entries, rows["resnet-mini"].bytes) == (4, 2000)
    assert (rows["idle"].entries, rows["idle"].bytes) == (0, 0), "no proxy holds entries of it"
    assert unattributed([new, new2, down]) == (2, 472)
    rows = {r.model_prefix: r for r in per_model([new, old], ["resnet-mini"])}
    assert (rows["resnet-mini"].entries, rows["resnet-mini"].bytes) == (None, None)
    assert unattributed([new, old]) == (None, None)
    assert unattributed([down]) == (None, None) and per_model([down], ["x"])[0].entries is None


def test_per_model_sums_readable_proxies_and_flags_collisions() -> None:
    ok = ProxyReading("a", "http://a", True, None, 0.0, parse_prometheus(ENVOY_PAGE))
    also = ProxyReading("b", "http://b", True, None, 0.0,
                        ProxyCounters({"hits": 1}, {"resnet_mini": {"hits": 10, "misses": 10}}))
    broken = ProxyReading("c", "http://c", False, "timed out", 0.0,
                          ProxyCounters({"hits": 1}, {"resnet_mini": {"hits": 1000, "misses": 0}}))
    rows = {r.model_prefix: r for r in per_model([ok, also, broken], ["resnet-mini", "bert.v2", "bert_v2", "idle"])}
    assert (rows["resnet-mini"].hits, rows["resnet-mini"].misses) == (14, 11)  # the unreadable proxy is left out
    assert rows["resnet-mini"].hit_ratio == pytest.approx(14 / 25)
    assert rows["bert.v2"].ambiguous_with == ["bert_v2"] and rows["bert_v2"].ambiguous_with == ["bert.v2"]
    assert rows["idle"].hit_ratio is None and rows["idle"].hits == 0
    assert not rows["old_model"].in_policy and rows["old_model"].misses == 4


def test_tokens_saved_and_semantic_counters_parse_and_sum() -> None:
    c = parse_prometheus(LLM_PAGE)
    assert c.policies["llama3_"] == {"hits": 6, "misses": 2, "tokens_saved_prompt": 162,
                                     "tokens_saved_completion": 72}
    assert c.tokens_known and not parse_prometheus(PER_POLICY_GAUGES).tokens_known
    assert c.semantic == {"lookups": 9, "hits": 2, "would_hit": 3, "errors": 1}
    # The semantic counters are not cache-wide hits: the totals are the filter's own.
    assert c.totals["hits"] == 7
    native = "\n".join(line.replace("meshcache_", "envoy_wasmcustom_meshcache_", 1) for line in LLM_PAGE.splitlines())
    assert parse_prometheus(native).policies == c.policies and parse_prometheus(native).semantic == c.semantic
    a, b = (ProxyReading(n, f"http://{n}", True, None, 0.0, parse_prometheus(LLM_PAGE)) for n in "ab")
    old = ProxyReading("c", "http://c", True, None, 0.0, parse_prometheus(PER_POLICY_GAUGES))
    rows = {r.model_prefix: r for r in per_model([a, b, old], ["llama3-", "resnet-mini", "idle"])}
    assert (rows["llama3-"].tokens_saved_prompt, rows["llama3-"].tokens_saved_completion) == (324, 144)
    assert (rows["resnet-mini"].tokens_saved_prompt, rows["idle"].tokens_saved_completion) == (0, 0)
    assert semantic_totals([a, b, old]) == {"lookups": 18, "hits": 4, "would_hit": 6, "errors": 2}
    # A filter without them: unknown, never zero.
    rows = {r.model_prefix: r for r in per_model([old], ["llama3-"])}
    assert rows["llama3-"].tokens_saved_prompt is None and semantic_totals([old]) is None


def test_prom_name_matches_envoys_sanitising() -> None:
    assert prom_name("resnet-mini") == "resnet_mini"
    assert prom_name("m.v2:latest@x+y") == "m_v2_latest_x_y"


def test_sources_parse_and_reject_garbage() -> None:
    assert parse_sources("a=http://127.0.0.1:1/stats/prometheus, b=https://h:15020/stats/prometheus\n") == {
        "a": "http://127.0.0.1:1/stats/prometheus", "b": "https://h:15020/stats/prometheus"}
    for bad in ("no-equals-sign", "a=ftp://x/y", "a=notaurl"):
        with pytest.raises(StatsConfigError):
            parse_sources(bad)


def test_dns_names_parse_and_need_a_template() -> None:
    assert parse_dns_names("meshcache-engine-proxies, a.b.svc.cluster.local\n") == [
        "meshcache-engine-proxies", "a.b.svc.cluster.local"]
    for bad in ("a b", "under_score", "-lead", "x" * 254):
        with pytest.raises(StatsConfigError):
            parse_dns_names(bad)
    with pytest.raises(StatsConfigError, match="template with"):
        ProxyStatsReader({}, "", dns_names=["meshcache-engine-proxies"])
    with pytest.raises(StatsConfigError, match="template with"):
        ProxyStatsReader({}, "http://fixed:15090/stats/prometheus", dns_names=["meshcache-engine-proxies"])


def _policy(prefix: str, ttl: int, generation: int) -> Policy:
    return Policy(model_prefix=prefix, ttl_s=ttl, max_ttl_s=ttl, generation=generation)


def test_diff_names_each_change() -> None:
    before = Snapshot(version=4, policies=(_policy("a", 10, 1), _policy("b", 20, 2), _policy("c", 5, 3)))
    after = Snapshot(version=5, policies=(_policy("a", 30, 1), _policy("b", 20, 5), _policy("d", 7, 5)),
                     limits=Limits(max_entries=10))
    changes = {(c["what"], c["model_prefix"]): c["fields"] for c in diff(before, after)}
    assert changes[("changed", "a")] == {"ttl_s": [10, 30], "max_ttl_s": [10, 30]}
    assert changes[("purged", "b")] == {"generation": [2, 5]}
    assert changes[("removed", "c")] == {}
    assert changes[("added", "d")]["ttl_s"] == [None, 7]
    assert changes[("limits", None)] == {"max_entries": [16384, 10]}
    assert diff(None, after) == [] and diff(after, after) == []
