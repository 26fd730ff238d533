"""Snapshot history: each recent snapshot with what changed from the one before it.

Snapshots are immutable and numbered without gaps (store.py), so the diff of version v is
v-1 -> v. Versions older than the store's retention are gone; the oldest kept one is shown
without a diff.
"""

from __future__ import annotations

from typing import Any

from .snapshots import Snapshot
from .store import Store

MAX_HISTORY = 100


def diff(before: Snapshot | None, after: Snapshot) -> list[dict[str, Any]]:
    """Changes from `before` to `after`: one entry per added/removed/changed policy, and limits."""
    if before is None:
        return []
    out: list[dict[str, Any]] = []
    old = {p.model_prefix: p.model_dump(mode="json") for p in before.policies}
    new = {p.model_prefix: p.model_dump(mode="json") for p in after.policies}
    for prefix in sorted(old.keys() | new.keys()):
        a, b = old.get(prefix), new.get(prefix)
        if a == b:
            continue
        if a is None:
            out.append({"what": "added", "model_prefix": prefix, "fields": {k: [None, v] for k, v in b.items()
                                                                            if k != "model_prefix"}})
        elif b is None:
            out.append({"what": "removed", "model_prefix": prefix, "fields": {}})
        else:
            fields = {k: [a.get(k), v] for k, v in b.items() if a.get(k) != v}
            purged = set(fields) == {"generation"}
            out.append({"what": "purged" if purged else "changed", "model_prefix": prefix, "fields": fields})
    la, lb = before.limits.model_dump(), after.limits.model_dump()
    changed = {k: [la[k], v] for k, v in lb.items() if la[k] != v}
    if changed:
        out.append({"what": "limits", "model_prefix": None, "fields": changed})
    return out


async def recent(store: Store, current: Snapshot, limit: int) -> list[dict[str, Any]]:
    """The newest `limit` snapshots (newest first), each with its diff from the previous one."""
    limit = max(1, min(limit, MAX_HISTORY))
    first = max(1, current.version - limit)  # one extra, older, to diff the oldest shown against
    versions = list(range(first, current.version))
    loaded = await store.load_many(versions)
    snaps: dict[int, Snapshot] = {v: s for v, s in zip(versions, loaded, strict=True) if s is not None}
    if current.version > 0:
        snaps[current.version] = current
    out = []
    for v in range(current.version, max(0, current.version - limit), -1):
        s = snaps.get(v)
        if s is None:
            break  # older than the retention
        prev = snaps.get(v - 1) if v > 1 else Snapshot(version=0)
        out.append({"version": v, "created_at": s.created_at, "author": s.author, "action": s.action,
                    "policies": len(s.policies), "changes": diff(prev, s), "diff_known": prev is not None})
    return out
