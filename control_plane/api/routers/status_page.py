"""The status page: a static shell (HTML, script, style) with no data in it.

Its script asks for a token, keeps it in sessionStorage (gone when the tab closes) and sends it as
`Authorization: Bearer` on every API call, so the same read/write roles apply as for any API
client and no cookie exists that a cross-site form could ride on (no CSRF). deploy/README.md
describes what it shows.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse, RedirectResponse

from ..errors import ApiError

STATIC = Path(__file__).resolve().parents[2] / "static"
# Everything the page loads comes from this server; no inline script or style.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; form-action 'none'; frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
ASSETS = {"status.js": "text/javascript", "status.css": "text/css"}

router = APIRouter(include_in_schema=False)


@router.get("/")
async def root() -> RedirectResponse:
    return RedirectResponse("/status")


@router.get("/status")
async def status_page() -> FileResponse:
    return FileResponse(STATIC / "status.html", media_type="text/html", headers=PAGE_HEADERS)


@router.get("/status/{name}")
async def status_asset(name: str) -> FileResponse:
    media = ASSETS.get(name)
    if media is None:
        raise ApiError(404, f"no such file: {name}")
    return FileResponse(STATIC / name, media_type=media, headers=PAGE_HEADERS)
