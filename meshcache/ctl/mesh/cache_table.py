"""The per-model cache table of `meshcache status`: the same numbers as the status page (/v1/stats)."""

from __future__ import annotations

from typing import Any


def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    value, unit = float(n), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            break
        value /= 1024
    return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"


def _count(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"


def _ratio(hits: int | None, misses: int | None) -> str:
    """Of this proxy's lookups; `-` before any (a client-role sidecar never looks up)."""
    if hits is None or misses is None or hits + misses == 0:
        return "-"
    return f"{hits / (hits + misses) * 100:.1f} %"


def _tokens_and_semantic(stats: dict[str, Any], width: int) -> list[str]:
    """LLM tokens answered from the cache per model (only models that saved any) and the semantic
    layer's counters (only when a proxy's filter has them)."""
    saved = [m for m in stats["models"]
             if (m.get("tokens_saved_prompt") or 0) + (m.get("tokens_saved_completion") or 0) > 0]
    lines = []
    if saved:
        lines.append(f"  tokens saved (LLM answers served from the cache)\n"
                     f"  {'model prefix':<{width}}{'prompt':>12}{'completion':>12}")
        lines += [f"  {m['model_prefix']:<{width}}{_count(m['tokens_saved_prompt']):>12}"
                  f"{_count(m['tokens_saved_completion']):>12}" for m in saved]
    sem = stats.get("semantic")
    if sem:
        lines.append(f"  semantic: {_count(sem['lookups'])} lookups, {_count(sem['hits'])} hits, "
                     f"{_count(sem['would_hit'])} would-be hits (shadow), {_count(sem['errors'])} errors")
    return lines


def format_cache_table(stats: dict[str, Any]) -> str:
    """`stats` is the control plane's GET /v1/stats answer."""
    total = stats["proxies_read"] + stats["proxies_unread"]
    serving = stats.get("serving") or {}
    lines = [f"control plane DEGRADED: {serving['detail']}; writes answer 503"] if serving.get("degraded") else []
    lines.append(f"cache (policy version {stats['version']}; counters since each proxy started; "
                 f"stats of {stats['proxies_read']} of {total} proxies read)")
    width = max([len("(no current policy)"), *(len(m["model_prefix"]) for m in stats["models"])]) + 2
    lines.append(f"  {'model prefix':<{width}}{'hits':>10}{'misses':>10}{'hit ratio':>11}{'entries':>9}{'bytes':>10}")
    for m in stats["models"]:
        ratio = "-" if m["hit_ratio"] is None else f"{m['hit_ratio'] * 100:.1f} %"
        note = "" if m["in_policy"] else "   (no policy now)"
        if m["ambiguous_with"]:
            note += f"   (counted together with {', '.join(m['ambiguous_with'])})"
        lines.append(f"  {m['model_prefix']:<{width}}{_count(m['hits']):>10}{_count(m['misses']):>10}{ratio:>11}"
                     f"{_count(m['entries']):>9}{human_bytes(m['bytes']):>10}{note}")
    if not stats["models"]:
        lines.append("  (no policies)")
    if stats.get("unattributed_entries"):
        other = f"{_count(stats['unattributed_entries']):>9}{human_bytes(stats.get('unattributed_bytes')):>10}"
        lines.append(f"  {'(no current policy)':<{width}}{'':>31}{other}   (a removed policy's entries, until evicted)")
    if stats["proxies_read"] and stats.get("unattributed_entries") is None:
        lines.append("  entries and bytes per model unknown: a proxy's filter reports them per proxy only")
    lines += _tokens_and_semantic(stats, width)
    for p in stats["proxies"]:
        if p["ok"]:
            lines.append(f"  proxy {p['node_id']}: {_count(p['entries'])} entries, {human_bytes(p['bytes'])}, "
                         f"hit ratio {_ratio(p.get('hits'), p.get('misses'))}, "
                         f"{_count(p['evictions'])} evictions, {_count(p['errors'])} errors")
        else:
            lines.append(f"  proxy {p['node_id']}: stats unavailable: {p['error']} (left out of the sums)")
    return "\n".join(lines)
