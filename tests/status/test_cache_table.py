"""`meshcache status`'s per-model table from a /v1/stats answer."""

from __future__ import annotations

from meshcache.ctl.mesh.cache_table import format_cache_table


def _stats(**over: object) -> dict:
    stats = {"version": 7, "proxies_read": 1, "proxies_unread": 1, "unattributed_entries": 2,
             "unattributed_bytes": 3 * 1024,
             "models": [{"model_prefix": "resnet", "in_policy": True, "hits": 5, "misses": 5, "hit_ratio": 0.5,
                         "entries": 4, "bytes": 2048, "ambiguous_with": []}],
             "proxies": [{"node_id": "a", "ok": True, "entries": 6, "bytes": 5120, "evictions": 0, "errors": 0},
                         {"node_id": "b", "ok": False, "error": "HTTP 503 from http://b"}]}
    stats.update(over)
    return stats


def test_entries_and_bytes_per_model_and_unattributed() -> None:
    out = format_cache_table(_stats()).splitlines()
    resnet = next(line.split() for line in out if line.split()[:1] == ["resnet"])
    assert resnet[1:] == ["5", "5", "50.0", "%", "4", "2.0", "KiB"]
    other = next(line for line in out if line.strip().startswith("(no current policy)"))
    assert other.split()[3:6] == ["2", "3.0", "KiB"]
    assert any("proxy b: stats unavailable: HTTP 503" in line for line in out)


def test_unknown_entries_say_so() -> None:
    stats = _stats(unattributed_entries=None, unattributed_bytes=None)
    stats["models"][0].update(entries=None, bytes=None)
    out = format_cache_table(stats)
    resnet = next(line.split() for line in out.splitlines() if line.split()[:1] == ["resnet"])
    assert resnet[5:] == ["-", "-"]
    assert "per model unknown" in out and "(no current policy)" not in out


def test_a_degraded_control_plane_is_the_first_line() -> None:
    detail = "policy store (Redis) unreachable: serving snapshot 7 from the state file"
    out = format_cache_table(_stats(serving={"source": "disk", "version": 7, "degraded": True,
                                             "store_reachable": False, "detail": detail})).splitlines()
    assert out[0] == f"control plane DEGRADED: {detail}; writes answer 503"
    healthy = format_cache_table(_stats(serving={"source": "redis", "version": 7, "degraded": False,
                                                 "store_reachable": True, "detail": "..."}))
    assert "DEGRADED" not in healthy and healthy.startswith("cache (policy version 7")


def test_tokens_saved_and_semantic_counters() -> None:
    """Models that saved tokens get a line each (prompt, completion); the semantic layer's counters
    one line; neither appears for a filter without them."""
    stats = _stats(semantic={"lookups": 12, "hits": 3, "would_hit": 2, "errors": 1})
    stats["models"][0].update(tokens_saved_prompt=0, tokens_saved_completion=0)
    stats["models"].append({"model_prefix": "llama3-", "in_policy": True, "hits": 4, "misses": 2,
                            "hit_ratio": 4 / 6, "entries": 2, "bytes": 900, "ambiguous_with": [],
                            "tokens_saved_prompt": 1208, "tokens_saved_completion": 480})
    out = format_cache_table(stats).splitlines()
    start = out.index("  tokens saved (LLM answers served from the cache)")
    assert out[start + 1].split() == ["model", "prefix", "prompt", "completion"]
    assert out[start + 2].split() == ["llama3-", "1,208", "480"]
    assert not any(line.split()[:1] == ["resnet"] for line in out[start:])  # saved nothing: not listed
    assert "  semantic: 12 lookups, 3 hits, 2 would-be hits (shadow), 1 errors" in out
    plain = format_cache_table(_stats())
    assert "tokens saved" not in plain and "semantic" not in plain
