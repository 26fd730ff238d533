"""Snapshots (current and by version), rollback, and the audit log."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Response

from ... import history
from ... import snapshots as changes
from ...schemas import (
    AuditOut,
    ErrorOut,
    HistoryEntry,
    HistoryOut,
    RollbackRequest,
    SnapshotOut,
    WriteResult,
)
from ...snapshots import Snapshot
from ...store import StoreUnavailable
from ..dependencies import CP, DryRun, IfMatch, Reader, Writer, current_snapshot, if_match_version, set_etag
from ..errors import READ_ERRORS, WRITE_ERRORS, ApiError
from ..writes import result, write

router = APIRouter()


def _snapshot_out(s: Snapshot) -> SnapshotOut:
    return SnapshotOut(version=s.version, created_at=s.created_at, author=s.author, action=s.action,
                       limits=s.limits, policies=list(s.policies), plugin_config=s.plugin_config_json)


@router.get("/v1/snapshot", responses=READ_ERRORS)
async def get_current_snapshot(cp: CP, _p: Reader, response: Response) -> SnapshotOut:
    snap = current_snapshot(cp)
    set_etag(response, snap.version)
    return _snapshot_out(snap)


@router.get("/v1/snapshots/{version}",
            responses={**READ_ERRORS, 404: {"model": ErrorOut}})
async def get_snapshot(version: Annotated[int, Path(ge=0, le=2**53)], cp: CP, _p: Reader) -> SnapshotOut:
    cur = cp.cache.current
    if version == cur.version:
        return _snapshot_out(cur)
    try:
        snap = await cp.store.load(version)
    except StoreUnavailable as exc:
        raise ApiError(503, "policy store (Redis) unavailable; only the current snapshot "
                       "can be read meanwhile", headers={"Retry-After": "1"}) from exc
    if snap is None:
        raise ApiError(404, f"snapshot {version} does not exist (or is older than the retention)")
    return _snapshot_out(snap)


@router.post("/v1/rollback", responses=WRITE_ERRORS)
async def do_rollback(body: RollbackRequest, cp: CP, who: Writer, response: Response,
                      if_match: IfMatch = None, dry_run: DryRun = False) -> WriteResult:
    """A new snapshot with the policies and limits of snapshot `version` (generations never go
    back: a purge stays a purge). cache_effects says what it drops (a limits change, a policy
    removed)."""
    target = await cp.store.load(body.version)
    if target is None:
        raise ApiError(404, f"snapshot {body.version} does not exist (or is older than the retention)")
    w = await write(cp, lambda cur, v: changes.rollback(cur, target, v, who.name), who.name, f"to {body.version}",
                    if_match_version(if_match), dry_run)
    return result(response, w)


@router.get("/v1/audit", responses=READ_ERRORS)
async def audit(cp: CP, _p: Reader, count: Annotated[int, Query(ge=1, le=1000)] = 100) -> AuditOut:
    return AuditOut(entries=await cp.store.audit(count))


@router.get("/v1/snapshots", responses=READ_ERRORS)
async def snapshot_history(cp: CP, _p: Reader,
                           limit: Annotated[int, Query(ge=1, le=history.MAX_HISTORY)] = 20) -> HistoryOut:
    """The newest snapshots, newest first, each with its changes from the one before."""
    cur = current_snapshot(cp)
    return HistoryOut(version=cur.version,
                      snapshots=[HistoryEntry(**e) for e in await history.recent(cp.store, cur, limit)])
