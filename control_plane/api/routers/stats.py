"""Cache counters per model and per proxy, read from the proxies' stats (proxy_stats.py); who am I."""

from __future__ import annotations

import time

from fastapi import APIRouter

from ...istiod_sync import TRANSPORT
from ...proxy_stats import ProxyReading, per_model, semantic_totals, unattributed
from ...schemas import ModelStats, ProxyStats, SemanticStats, StatsOut, WhoAmI
from ..dependencies import CP, Reader, serving_out
from ..errors import ERRORS

router = APIRouter()


def _proxy_stats(r: ProxyReading) -> ProxyStats:
    out = ProxyStats(node_id=r.node_id, source=r.source, ok=r.ok, error=r.error, read_at=r.read_at)
    if r.ok and r.counters is not None:
        for key, value in r.counters.totals.items():
            if key in ProxyStats.model_fields:
                setattr(out, key, value)
    return out


@router.get("/v1/stats", responses=ERRORS)
async def stats(cp: CP, _p: Reader) -> StatsOut:
    """Cache counters per model (summed over the proxies whose stats could be read) and per proxy."""
    snap = cp.cache.current
    # Every replica's proxies, and those of istiod's sidecars with a stats source (the rest, the
    # callers' client role, have no cache); not istiod itself.
    nodes = [e["node_id"] for e in (await cp.mesh_proxies()).proxies if e["node_id"]
             and (e["transport"] != TRANSPORT or cp.proxy_stats.source_of(e["node_id"]) is not None)]
    readings = await cp.proxy_stats.read(nodes)
    models = [ModelStats(model_prefix=m.model_prefix, in_policy=m.in_policy, hits=m.hits, misses=m.misses,
                         hit_ratio=m.hit_ratio, entries=m.entries, bytes=m.bytes,
                         tokens_saved_prompt=m.tokens_saved_prompt, tokens_saved_completion=m.tokens_saved_completion,
                         ambiguous_with=m.ambiguous_with)
              for m in per_model(readings, [p.model_prefix for p in snap.policies])]
    read = sum(1 for r in readings if r.ok)
    other_entries, other_bytes = unattributed(readings)
    semantic = semantic_totals(readings)
    return StatsOut(version=snap.version, serving=serving_out(cp), read_at=time.time(), complete=read == len(readings),
                    proxies_read=read, proxies_unread=len(readings) - read, models=models,
                    unattributed_entries=other_entries, unattributed_bytes=other_bytes,
                    semantic=SemanticStats(**semantic) if semantic is not None else None,
                    proxies=[_proxy_stats(r) for r in readings])


@router.get("/v1/whoami", responses=ERRORS)
async def whoami(who: Reader) -> WhoAmI:
    """The token's name and role (the status page shows rollback buttons only for write)."""
    return WhoAmI(name=who.name, role=who.role)
