"""One JSON error shape (`ErrorOut`) for every failure, and the handlers that produce it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..policy_service import PreconditionFailed
from ..schemas import ErrorOut, FieldError
from ..snapshots import ChangeError, Invalid
from ..store import StoreUnavailable

UNAVAILABLE = "policy store (Redis) unavailable: the change was not applied; retry later"


def _serving_note(request: Request) -> str:
    """What this replica serves meanwhile (the app's control plane, when there is one)."""
    cp = getattr(request.app.state, "cp", None)
    if cp is None:
        return ""
    s = cp.serving()
    if s.source == "none":
        return " (no snapshot is served: none known yet)"
    where = "the state file" if s.source == "disk" else "memory"
    return f" (serving snapshot {s.version} from {where} meanwhile)"

# OpenAPI `responses` of read and write routes.
ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorOut} for code in (401, 403, 413, 422)
}
READ_ERRORS: dict[int | str, dict[str, Any]] = {**ERRORS, 503: {"model": ErrorOut}}
WRITE_ERRORS: dict[int | str, dict[str, Any]] = {
    **ERRORS, **{code: {"model": ErrorOut} for code in (404, 409, 412, 503)}
}


class ApiError(Exception):
    def __init__(self, status: int, detail: str, errors: list[FieldError] | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(detail)
        self.status, self.detail, self.errors, self.headers = status, detail, errors or [], headers


def error_response(status: int, detail: str, errors: list[FieldError] | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    body = ErrorOut(detail=detail, errors=errors or []).model_dump()
    return JSONResponse(body, status_code=status, headers=headers)


def field_errors(errors: Sequence[Any]) -> list[FieldError]:
    """pydantic's (or FastAPI's) validation errors as `FieldError`s, with plain reasons."""
    out = []
    for e in errors[:20]:
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


async def _on_invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
    errs = field_errors(exc.errors())
    return error_response(422, "invalid request: " + "; ".join(f"{e.field}: {e.reason}" for e in errs), errs)


async def _on_api_error(_: Request, exc: ApiError) -> JSONResponse:
    return error_response(exc.status, exc.detail, exc.errors, exc.headers)


async def _on_http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))


async def _on_unavailable(request: Request, exc: StoreUnavailable) -> JSONResponse:
    return error_response(503, UNAVAILABLE + _serving_note(request), headers={"Retry-After": "1"})


async def _on_precondition(_: Request, exc: PreconditionFailed) -> JSONResponse:
    return error_response(412, f"snapshot moved on: current version is {exc.current}",
                          headers={"ETag": f'"{exc.current}"'})


async def _on_change(_: Request, exc: ChangeError) -> JSONResponse:
    if isinstance(exc, Invalid):
        errs = field_errors(exc.errors)
        return error_response(exc.status, f"{exc}: " + "; ".join(f"{e.field}: {e.reason}" for e in errs), errs)
    return error_response(exc.status, str(exc))


def install_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _on_invalid)
    app.add_exception_handler(ApiError, _on_api_error)
    app.add_exception_handler(StarletteHTTPException, _on_http)
    app.add_exception_handler(StoreUnavailable, _on_unavailable)
    app.add_exception_handler(PreconditionFailed, _on_precondition)
    app.add_exception_handler(ChangeError, _on_change)
