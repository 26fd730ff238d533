"""Policies, purge and the global limits: reads from the in-memory snapshot, writes through the
policy service (compare-and-set on the snapshot version, optional If-Match)."""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request, Response
from pydantic import ValidationError

from ... import snapshots as changes
from ...policy_service import Change
from ...schemas import (
    ErrorOut,
    FieldError,
    Limits,
    PoliciesOut,
    PolicyOut,
    PolicyPatch,
    PolicySpec,
    PurgeRequest,
    WriteResult,
)
from ...wiring import ControlPlane
from ..dependencies import (
    CP,
    DryRun,
    IfMatch,
    PrefixPath,
    Reader,
    Writer,
    current_snapshot,
    if_match_version,
    set_etag,
)
from ..errors import READ_ERRORS, WRITE_ERRORS, ApiError, field_errors
from ..writes import result, write

MERGE_PATCH = "application/merge-patch+json"

router = APIRouter()


@router.get("/v1/policies", responses=READ_ERRORS)
async def list_policies(cp: CP, _p: Reader, response: Response) -> PoliciesOut:
    snap = current_snapshot(cp)
    set_etag(response, snap.version)
    return PoliciesOut(version=snap.version, policies=list(snap.policies))


@router.get("/v1/policies/{model_prefix:path}", responses={**READ_ERRORS, 404: {"model": ErrorOut}})
async def get_policy(model_prefix: PrefixPath, cp: CP, _p: Reader, response: Response) -> PolicyOut:
    snap = current_snapshot(cp)
    policy = snap.policy(model_prefix)
    if policy is None:
        raise ApiError(404, f"no policy for model_prefix {model_prefix!r}")
    set_etag(response, snap.version)
    return PolicyOut(version=snap.version, policy=policy)


async def _policy_write(cp: ControlPlane, model_prefix: str, change: Change, who: str, detail: str,
                        if_match: str | None, response: Response, dry_run: bool) -> WriteResult:
    w = await write(cp, change, who, detail, if_match_version(if_match), dry_run)
    return result(response, w, model_prefix, await cp.model_index.prefix_warnings(model_prefix))


def _same_prefix(body_prefix: object, model_prefix: str) -> None:
    if body_prefix is not None and body_prefix != model_prefix:
        raise ApiError(422, "model_prefix in body differs from the path",
                       [FieldError(field="model_prefix", reason="must equal the path's model_prefix")])


@router.put("/v1/policies/{model_prefix:path}", responses=WRITE_ERRORS)
async def put_policy(model_prefix: PrefixPath, spec: PolicySpec, cp: CP, who: Writer,
                     response: Response, if_match: IfMatch = None, dry_run: DryRun = False) -> WriteResult:
    """Create or replace a policy: the body is the whole policy; fields it leaves out take
    their defaults (to change some fields only, PATCH)."""
    _same_prefix(spec.model_prefix, model_prefix)
    max_policies = cp.settings.max_policies
    policy = spec.policy(model_prefix, generation=0)  # the generation is put_policy's to assign
    return await _policy_write(cp, model_prefix,
                               lambda cur, v: changes.put_policy(cur, v, who.name, policy, max_policies),
                               who.name, spec.model_dump_json(exclude_none=True),
                               if_match, response, dry_run)


def _inline_defs(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with its `#/$defs/...` references replaced by the definitions: an operation's
    schema given through `openapi_extra` is not hoisted into `components`, and OpenAPI viewers
    (ReDoc) cannot resolve a `$defs` reference there."""
    defs = schema.get("$defs", {})

    def resolve(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return resolve(defs[ref.removeprefix("#/$defs/")])
            return {k: resolve(v) for k, v in node.items() if k != "$defs"}
        if isinstance(node, list):
            return [resolve(v) for v in node]
        return node

    return resolve(schema)


_PATCH_SCHEMA = _inline_defs(PolicyPatch.model_json_schema())
_PATCH_BODY: dict[str, Any] = {
    "requestBody": {"required": True, "content": {
        media: {"schema": _PATCH_SCHEMA} for media in (MERGE_PATCH, "application/json")}}}


@router.patch("/v1/policies/{model_prefix:path}", responses={**WRITE_ERRORS, 415: {"model": ErrorOut}},
              openapi_extra=_PATCH_BODY)
async def patch_policy(model_prefix: PrefixPath, request: Request, cp: CP, who: Writer, response: Response,
                       if_match: IfMatch = None, dry_run: DryRun = False) -> WriteResult:
    """Change only the fields the body names (JSON merge patch, RFC 7396): `null` resets a field
    to its default. Creates the policy from the defaults when there is none (`ttl_s` needed).
    With `If-Match`, applied only to that snapshot version (else 412). Nothing is written when
    the patched policy is invalid (422, per field)."""
    media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media not in (MERGE_PATCH, "application/json"):
        raise ApiError(415, f"PATCH takes {MERGE_PATCH} (RFC 7396) or application/json, not {media or 'no type'}")
    try:
        patch = json.loads(await request.body())
    except ValueError as exc:
        raise ApiError(422, f"the body is not JSON: {exc}") from exc
    if not isinstance(patch, dict):
        raise ApiError(422, "a policy merge patch is a JSON object: the fields to change (null resets one)")
    try:
        PolicyPatch.model_validate(patch)
    except ValidationError as exc:
        errs = field_errors(exc.errors())
        raise ApiError(422, "invalid patch: " + "; ".join(f"{e.field}: {e.reason}" for e in errs), errs) from exc
    _same_prefix(patch.pop("model_prefix", None), model_prefix)
    max_policies = cp.settings.max_policies
    return await _policy_write(
        cp, model_prefix,
        lambda cur, v: changes.patch_policy(cur, v, who.name, model_prefix, patch, max_policies,
                                            lambda d: PolicySpec.model_validate(d).policy(model_prefix, 0)),
        who.name, json.dumps(patch, sort_keys=True), if_match, response, dry_run)


@router.delete("/v1/policies/{model_prefix:path}", responses=WRITE_ERRORS)
async def delete_policy(model_prefix: PrefixPath, cp: CP, who: Writer, response: Response,
                        if_match: IfMatch = None, dry_run: DryRun = False) -> WriteResult:
    w = await write(cp, lambda cur, v: changes.delete_policy(cur, v, who.name, model_prefix),
                    who.name, model_prefix, if_match_version(if_match), dry_run)
    if not dry_run:
        cp.semantic.policy(model_prefix)  # its entries can never be served again (as for a purge)
    return result(response, w)


@router.post("/v1/purge", responses=WRITE_ERRORS)
async def purge(body: PurgeRequest, cp: CP, who: Writer, response: Response,
                if_match: IfMatch = None, dry_run: DryRun = False) -> WriteResult:
    """Stop serving one model's cached entries (`model_prefix`) or every model's (`all`: true):
    the policies get a new generation, so new keys. cache_effects lists what is dropped. With a
    semantic index service configured, its entries for the purged policies are dropped too (in
    the background: a failure there never fails the purge)."""
    prefix = body.model_prefix
    if prefix is None:
        w = await write(cp, lambda cur, v: changes.purge_all(cur, v, who.name), who.name, "all",
                        if_match_version(if_match), dry_run)
        if not dry_run:
            cp.semantic.every_policy()
        return result(response, w)
    w = await write(cp, lambda cur, v: changes.purge(cur, v, who.name, prefix), who.name, prefix,
                    if_match_version(if_match), dry_run)
    if not dry_run:
        cp.semantic.policy(prefix)
    return result(response, w, prefix)


@router.get("/v1/limits", responses=READ_ERRORS)
async def get_limits(cp: CP, _p: Reader, response: Response) -> Limits:
    snap = current_snapshot(cp)
    set_etag(response, snap.version)
    return snap.limits


@router.put("/v1/limits", responses=WRITE_ERRORS)
async def put_limits(limits: Limits, cp: CP, who: Writer, response: Response,
                     if_match: IfMatch = None, dry_run: DryRun = False) -> WriteResult:
    """The global limits, whole (fields not given take their defaults). A new max_entries empties
    every proxy's cache, a lower max_total_bytes evicts: see cache_effects in the answer (and
    `dry_run` to see them first)."""
    w = await write(cp, lambda cur, v: changes.set_limits(cur, v, who.name, limits),
                    who.name, limits.model_dump_json(), if_match_version(if_match), dry_run)
    return result(response, w)
