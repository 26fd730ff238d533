"""HTTP API (FastAPI): policies, purge, snapshots, rollback, proxies, health and metrics."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Header, Path, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from . import snapshots as changes
from .app import ControlPlane
from .auth import Principal, Role
from .models import (
    MAX_PREFIX_LEN,
    PREFIX_PATTERN,
    AuditOut,
    ErrorOut,
    FieldError,
    Limits,
    PoliciesOut,
    PolicyOut,
    PolicySpec,
    ProxiesOut,
    ProxyOut,
    PurgeRequest,
    RollbackRequest,
    SnapshotOut,
    WriteResult,
)
from .models import NackOut as NackModel
from .service import PreconditionFailed
from .snapshots import ChangeError, Snapshot
from .store import StoreUnavailable

UNAVAILABLE = "policy store (Redis) unavailable: the change was not applied; retry later"


class ApiError(Exception):
    def __init__(self, status: int, detail: str, errors: list[FieldError] | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(detail)
        self.status, self.detail, self.errors, self.headers = status, detail, errors or [], headers


def _err(status: int, detail: str, errors: list[FieldError] | None = None,
         headers: dict[str, str] | None = None) -> JSONResponse:
    body = ErrorOut(detail=detail, errors=errors or []).model_dump()
    return JSONResponse(body, status_code=status, headers=headers)


class BodyLimit:
    """Rejects request bodies over `limit` bytes with 413 before the app reads them."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        too_big = declared is not None and (not declared.isdigit() or int(declared) > self.limit)
        messages: list[Message] = []
        if not too_big:
            size, more = 0, True
            while more:
                msg = await receive()
                messages.append(msg)
                if msg["type"] != "http.request":
                    break
                size += len(msg.get("body", b""))
                more = msg.get("more_body", False)
                if size > self.limit:
                    too_big = True
                    break
        if too_big:
            resp = _err(413, f"request body larger than {self.limit} bytes")
            await resp(scope, receive, send)
            return

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)


def _field_errors(exc: RequestValidationError) -> list[FieldError]:
    out = []
    for e in exc.errors()[:20]:
        loc = [str(x) for x in e.get("loc", ())]
        if loc and loc[0] in ("body", "path", "query", "header"):
            loc = loc[1:]
        field = ".".join(loc) or "body"
        reason = str(e.get("msg", "invalid"))
        if e.get("type") == "extra_forbidden":
            reason = ("managed by the control plane (use POST /v1/purge)" if field == "generation"
                      else "unknown field")
        elif e.get("type") == "missing":
            reason = "is required"
        out.append(FieldError(field=field, reason=reason.removeprefix("Value error, ")))
    return out


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
PrefixPath = Annotated[str, Path(min_length=1, max_length=MAX_PREFIX_LEN, pattern=PREFIX_PATTERN,
                                 description="The policy's model_prefix")]
IfMatch = Annotated[str | None, Header(alias="If-Match", max_length=64,
                                       description="Snapshot version the change is based on")]
_ETAG = re.compile(r'^\s*(?:W/)?"?(\d{1,15})"?\s*$')


def _if_match(value: str | None) -> int | None:
    if value is None or value.strip() == "*":
        return None
    m = _ETAG.match(value)
    if not m:
        raise ApiError(422, "invalid If-Match", [FieldError(field="If-Match",
                                                          reason="must be a snapshot version number")])
    return int(m.group(1))


def _etag(response: Response, version: int) -> None:
    response.headers["ETag"] = f'"{version}"'


def _snapshot_out(s: Snapshot) -> SnapshotOut:
    return SnapshotOut(version=s.version, created_at=s.created_at, author=s.author, action=s.action,
                       limits=s.limits, policies=list(s.policies), plugin_config=s.plugin_config_json)


ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorOut} for code in (401, 403, 413, 422)
}
WRITE_ERRORS: dict[int | str, dict[str, Any]] = {
    **ERRORS, **{code: {"model": ErrorOut} for code in (404, 409, 412, 503)}
}


def create_app(cp: ControlPlane) -> FastAPI:
    app = FastAPI(title="meshcache control plane", version="1",
                  description="Cache policies for the meshcache filter, pushed to Envoy over xDS (ECDS).")
    app.state.cp = cp
    app.add_middleware(BodyLimit, limit=cp.settings.max_request_bytes)

    @app.exception_handler(RequestValidationError)
    async def _on_invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        errs = _field_errors(exc)
        return _err(422, "invalid request: " + "; ".join(f"{e.field}: {e.reason}" for e in errs), errs)

    @app.exception_handler(ApiError)
    async def _on_api_error(_: Request, exc: ApiError) -> JSONResponse:
        return _err(exc.status, exc.detail, exc.errors, exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _err(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(StoreUnavailable)
    async def _on_unavailable(_: Request, exc: StoreUnavailable) -> JSONResponse:
        return _err(503, UNAVAILABLE, headers={"Retry-After": "1"})

    @app.exception_handler(PreconditionFailed)
    async def _on_precondition(_: Request, exc: PreconditionFailed) -> JSONResponse:
        return _err(412, f"snapshot moved on: current version is {exc.current}",
                    headers={"ETag": f'"{exc.current}"'})

    @app.exception_handler(ChangeError)
    async def _on_change(_: Request, exc: ChangeError) -> JSONResponse:
        return _err(exc.status, str(exc))

    # ---- health ------------------------------------------------------------------------------

    @app.get("/healthz", tags=["health"])
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", tags=["health"], responses={503: {"model": ErrorOut}})
    async def readyz(cp: CP) -> Any:
        if await cp.store.ping():
            return {"status": "ready", "version": cp.cache.current.version}
        return _err(503, "Redis unreachable")

    @app.get("/metrics", tags=["health"], response_class=Response)
    async def metrics(cp: CP) -> Response:
        return Response(cp.metrics.render(), media_type="text/plain; version=0.0.4")

    # ---- policies ----------------------------------------------------------------------------

    @app.get("/v1/policies", responses=ERRORS)
    async def list_policies(cp: CP, _p: Reader, response: Response) -> PoliciesOut:
        snap = cp.cache.current
        _etag(response, snap.version)
        return PoliciesOut(version=snap.version, policies=list(snap.policies))

    @app.get("/v1/policies/{model_prefix:path}", responses={**ERRORS, 404: {"model": ErrorOut}})
    async def get_policy(model_prefix: PrefixPath, cp: CP, _p: Reader, response: Response) -> PolicyOut:
        snap = cp.cache.current
        policy = snap.policy(model_prefix)
        if policy is None:
            raise ApiError(404, f"no policy for model_prefix {model_prefix!r}")
        _etag(response, snap.version)
        return PolicyOut(version=snap.version, policy=policy)

    @app.put("/v1/policies/{model_prefix:path}", responses=WRITE_ERRORS)
    async def put_policy(model_prefix: PrefixPath, spec: PolicySpec, cp: CP, who: Writer,
                         response: Response, if_match: IfMatch = None) -> WriteResult:
        if spec.model_prefix is not None and spec.model_prefix != model_prefix:
            raise ApiError(422, "model_prefix in body differs from the path",
                           [FieldError(field="model_prefix", reason="must equal the path's model_prefix")])
        max_policies = cp.settings.max_policies
        snap, changed = await cp.service.apply(
            lambda cur, v: changes.put_policy(cur, v, who.name, model_prefix, spec, max_policies),
            who.name, spec.model_dump_json(exclude_none=True), _if_match(if_match))
        _etag(response, snap.version)
        return WriteResult(version=snap.version, changed=changed, policy=snap.policy(model_prefix))

    @app.delete("/v1/policies/{model_prefix:path}", responses=WRITE_ERRORS)
    async def delete_policy(model_prefix: PrefixPath, cp: CP, who: Writer, response: Response,
                            if_match: IfMatch = None) -> WriteResult:
        snap, changed = await cp.service.apply(
            lambda cur, v: changes.delete_policy(cur, v, who.name, model_prefix),
            who.name, model_prefix, _if_match(if_match))
        _etag(response, snap.version)
        return WriteResult(version=snap.version, changed=changed)

    @app.post("/v1/purge", responses=WRITE_ERRORS)
    async def purge(body: PurgeRequest, cp: CP, who: Writer, response: Response) -> WriteResult:
        snap, changed = await cp.service.apply(
            lambda cur, v: changes.purge(cur, v, who.name, body.model_prefix), who.name, body.model_prefix)
        _etag(response, snap.version)
        return WriteResult(version=snap.version, changed=changed, policy=snap.policy(body.model_prefix))

    # ---- limits ------------------------------------------------------------------------------

    @app.get("/v1/limits", responses=ERRORS)
    async def get_limits(cp: CP, _p: Reader, response: Response) -> Limits:
        _etag(response, cp.cache.current.version)
        return cp.cache.current.limits

    @app.put("/v1/limits", responses=WRITE_ERRORS)
    async def put_limits(limits: Limits, cp: CP, who: Writer, response: Response,
                         if_match: IfMatch = None) -> WriteResult:
        snap, changed = await cp.service.apply(
            lambda cur, v: changes.set_limits(cur, v, who.name, limits),
            who.name, limits.model_dump_json(), _if_match(if_match))
        _etag(response, snap.version)
        return WriteResult(version=snap.version, changed=changed)

    # ---- snapshots ---------------------------------------------------------------------------

    @app.get("/v1/snapshot", responses=ERRORS)
    async def current_snapshot(cp: CP, _p: Reader, response: Response) -> SnapshotOut:
        snap = cp.cache.current
        _etag(response, snap.version)
        return _snapshot_out(snap)

    @app.get("/v1/snapshots/{version}",
             responses={**ERRORS, 404: {"model": ErrorOut}, 503: {"model": ErrorOut}})
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

    @app.post("/v1/rollback", responses=WRITE_ERRORS)
    async def do_rollback(body: RollbackRequest, cp: CP, who: Writer, response: Response) -> WriteResult:
        target = await cp.store.load(body.version)
        if target is None:
            raise ApiError(404, f"snapshot {body.version} does not exist (or is older than the retention)")
        snap, changed = await cp.service.apply(
            lambda cur, v: changes.rollback(cur, target, v, who.name), who.name, f"to {body.version}")
        _etag(response, snap.version)
        return WriteResult(version=snap.version, changed=changed)

    @app.get("/v1/audit", responses={**ERRORS, 503: {"model": ErrorOut}})
    async def audit(cp: CP, _p: Reader, count: Annotated[int, Query(ge=1, le=1000)] = 100) -> AuditOut:
        return AuditOut(entries=await cp.store.audit(count))

    # ---- proxies -----------------------------------------------------------------------------

    @app.get("/v1/proxies", responses=ERRORS)
    async def proxies(cp: CP, _p: Reader) -> ProxiesOut:
        current = str(cp.cache.current.version)
        out = []
        for c in list(cp.xds.registry.connections.values()):
            acked, acked_at = c.acked_version()
            nack = c.last_nack
            out.append(ProxyOut(
                node_id=c.node_id, cluster=c.cluster, stream_id=c.stream_id, transport=c.transport,
                type_urls=sorted(c.acked), connected_since=c.connected_since, acked_version=acked,
                acked_at=acked_at, current=acked == current,
                last_nack=NackModel(version=nack.version, error=nack.error, at=nack.at) if nack else None,
            ))
        return ProxiesOut(version=cp.cache.current.version, proxies=out)

    return app
