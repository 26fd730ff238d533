"""Policies, purge and the global limits: reads from the in-memory snapshot, writes through the
policy service (compare-and-set on the snapshot version, optional If-Match)."""

from __future__ import annotations

from fastapi import APIRouter, Response

from ... import snapshots as changes
from ...schemas import ErrorOut, FieldError, Limits, PoliciesOut, PolicyOut, PolicySpec, PurgeRequest, WriteResult
from ..dependencies import CP, IfMatch, PrefixPath, Reader, Writer, if_match_version, set_etag
from ..errors import ERRORS, WRITE_ERRORS, ApiError

router = APIRouter()


@router.get("/v1/policies", responses=ERRORS)
async def list_policies(cp: CP, _p: Reader, response: Response) -> PoliciesOut:
    snap = cp.cache.current
    set_etag(response, snap.version)
    return PoliciesOut(version=snap.version, policies=list(snap.policies))


@router.get("/v1/policies/{model_prefix:path}", responses={**ERRORS, 404: {"model": ErrorOut}})
async def get_policy(model_prefix: PrefixPath, cp: CP, _p: Reader, response: Response) -> PolicyOut:
    snap = cp.cache.current
    policy = snap.policy(model_prefix)
    if policy is None:
        raise ApiError(404, f"no policy for model_prefix {model_prefix!r}")
    set_etag(response, snap.version)
    return PolicyOut(version=snap.version, policy=policy)


@router.put("/v1/policies/{model_prefix:path}", responses=WRITE_ERRORS)
async def put_policy(model_prefix: PrefixPath, spec: PolicySpec, cp: CP, who: Writer,
                     response: Response, if_match: IfMatch = None) -> WriteResult:
    if spec.model_prefix is not None and spec.model_prefix != model_prefix:
        raise ApiError(422, "model_prefix in body differs from the path",
                       [FieldError(field="model_prefix", reason="must equal the path's model_prefix")])
    max_policies = cp.settings.max_policies
    policy = spec.policy(model_prefix, generation=0)  # the generation is put_policy's to assign
    snap, changed = await cp.service.apply(
        lambda cur, v: changes.put_policy(cur, v, who.name, policy, max_policies),
        who.name, spec.model_dump_json(exclude_none=True), if_match_version(if_match))
    set_etag(response, snap.version)
    return WriteResult(version=snap.version, changed=changed, policy=snap.policy(model_prefix))


@router.delete("/v1/policies/{model_prefix:path}", responses=WRITE_ERRORS)
async def delete_policy(model_prefix: PrefixPath, cp: CP, who: Writer, response: Response,
                        if_match: IfMatch = None) -> WriteResult:
    snap, changed = await cp.service.apply(
        lambda cur, v: changes.delete_policy(cur, v, who.name, model_prefix),
        who.name, model_prefix, if_match_version(if_match))
    set_etag(response, snap.version)
    return WriteResult(version=snap.version, changed=changed)


@router.post("/v1/purge", responses=WRITE_ERRORS)
async def purge(body: PurgeRequest, cp: CP, who: Writer, response: Response) -> WriteResult:
    snap, changed = await cp.service.apply(
        lambda cur, v: changes.purge(cur, v, who.name, body.model_prefix), who.name, body.model_prefix)
    set_etag(response, snap.version)
    return WriteResult(version=snap.version, changed=changed, policy=snap.policy(body.model_prefix))


@router.get("/v1/limits", responses=ERRORS)
async def get_limits(cp: CP, _p: Reader, response: Response) -> Limits:
    set_etag(response, cp.cache.current.version)
    return cp.cache.current.limits


@router.put("/v1/limits", responses=WRITE_ERRORS)
async def put_limits(limits: Limits, cp: CP, who: Writer, response: Response,
                     if_match: IfMatch = None) -> WriteResult:
    snap, changed = await cp.service.apply(
        lambda cur, v: changes.set_limits(cur, v, who.name, limits),
        who.name, limits.model_dump_json(), if_match_version(if_match))
    set_etag(response, snap.version)
    return WriteResult(version=snap.version, changed=changed)
