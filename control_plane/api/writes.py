"""The write routes' common path: apply a change (or, with `dry_run`, only say what it would do)
and answer with its diff and its effect on the entries already cached (cache_effects.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import Response

from .. import cache_effects
from ..policy_service import Change, PreconditionFailed
from ..schemas import HistoryChange, WriteResult
from ..snapshots import Snapshot
from ..wiring import ControlPlane
from .dependencies import current_snapshot, set_etag


@dataclass(frozen=True)
class Written:
    current: Snapshot  # the current snapshot afterwards (a dry run: unchanged)
    result: Snapshot  # what the change made (a dry run: would make)
    changed: bool
    diff: list[dict[str, Any]]
    dry_run: bool


async def write(cp: ControlPlane, change: Change, who: str, detail: str, if_match: int | None,
                dry_run: bool) -> Written:
    """Apply `change`, or for a dry run only derive it from the current snapshot (nothing is
    written; a stale If-Match is 412 and a change error 4xx, as for the write)."""
    if not dry_run:
        snap, changed, diff = await cp.service.write(change, who, detail, if_match)
        return Written(snap, snap, changed, diff, False)
    known = current_snapshot(cp)  # 503 while none is known: no preview against a made-up empty one
    if if_match is not None and known.version != if_match:
        raise PreconditionFailed(known.version)
    cur, new, changed, diff = cp.service.preview(change)
    return Written(cur, new, changed, diff, True)


def result(response: Response, w: Written, model_prefix: str | None = None,
           warnings: list[str] | None = None) -> WriteResult:
    """The answer: version and ETag of the current snapshot, the diff, and the cache effects
    (also appended to `warnings`, after the caller's)."""
    set_etag(response, w.current.version)
    effects = cache_effects.effects(w.diff)
    return WriteResult(version=w.current.version, changed=w.changed, dry_run=w.dry_run,
                       policy=w.result.policy(model_prefix) if model_prefix is not None else None,
                       changes=[HistoryChange(**c) for c in w.diff], cache_effects=effects,
                       warnings=[*(warnings or []), *(e.message for e in effects)])
