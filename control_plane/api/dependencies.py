"""Request dependencies: the control plane, bearer-token roles, and the shared path/header parameters."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Annotated

from fastapi import Depends, Header, Path, Query, Request, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from meshcache.contract.filter_config import MAX_PREFIX_LEN, PREFIX_PATTERN

from ..auth import Principal, Role
from ..schemas import FieldError, ServingOut
from ..snapshots import Snapshot
from ..wiring import ControlPlane
from .errors import ApiError

_bearer = HTTPBearer(auto_error=False, description="Token with role read or write")


def cp_of(request: Request) -> ControlPlane:
    return request.app.state.cp  # type: ignore[no-any-return]


def require(role: Role) -> Callable[..., Awaitable[Principal]]:
    async def dep(request: Request,
                  creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> Principal:
        if creds is None or not creds.credentials:
            raise ApiError(401, "missing bearer token", headers={"WWW-Authenticate": "Bearer"})
        principal = cp_of(request).tokens.lookup(creds.credentials)
        if principal is None:
            raise ApiError(401, "unknown bearer token", headers={"WWW-Authenticate": "Bearer"})
        if not principal.can(role):
            raise ApiError(403, f"token {principal.name!r} has role {principal.role!r}; {role} needed")
        return principal

    return dep


Reader = Annotated[Principal, Depends(require("read"))]
Writer = Annotated[Principal, Depends(require("write"))]
CP = Annotated[ControlPlane, Depends(cp_of)]
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def prefix_path(request: Request,
                model_prefix: Annotated[str, Path(min_length=1, max_length=MAX_PREFIX_LEN, pattern=PREFIX_PATTERN,
                                                  description="The policy's model_prefix")]) -> str:
    """The `{model_prefix:path}` parameter, refused (422) when the decoded path holds a control
    character: the route's `.*` stops at a newline and its `$` matches before a trailing one, so
    `/v1/policies/a%0A` would otherwise reach policy `a`."""
    if _CONTROL.search(request.scope["path"]):
        raise ApiError(422, "model_prefix must not contain control characters",
                       [FieldError(field="model_prefix", reason="percent-encoded control characters are not allowed")])
    return model_prefix


PrefixPath = Annotated[str, Depends(prefix_path)]
IfMatch = Annotated[str | None, Header(alias="If-Match", max_length=64,
                                       description="Snapshot version the change is based on")]
DryRun = Annotated[bool, Query(description="true: apply nothing, answer what the change would do (its diff, "
                                           "cache_effects and warnings); version is the current one, to send "
                                           "as If-Match to apply exactly that")]
_ETAG = re.compile(r'^\s*(?:W/)?"?(\d{1,15})"?\s*$')


def if_match_version(value: str | None) -> int | None:
    if value is None or value.strip() == "*":
        return None
    m = _ETAG.match(value)
    if not m:
        raise ApiError(422, "invalid If-Match", [FieldError(field="If-Match",
                                                          reason="must be a snapshot version number")])
    return int(m.group(1))


def set_etag(response: Response, version: int) -> None:
    response.headers["ETag"] = f'"{version}"'


def current_snapshot(cp: ControlPlane) -> Snapshot:
    """The snapshot reads answer from; 503 while none is known (never a made-up version 0)."""
    if not cp.cache.known:
        raise ApiError(503, cp.serving().detail, headers={"Retry-After": "1"})
    return cp.cache.current


def serving_out(cp: ControlPlane) -> ServingOut:
    s = cp.serving()
    return ServingOut(source=s.source, version=s.version, degraded=s.degraded,  # type: ignore[arg-type]
                      store_reachable=s.store_reachable, detail=s.detail)
