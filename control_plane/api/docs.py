"""API docs that work offline: Swagger UI at /docs and ReDoc at /redoc, assets served by this app.

FastAPI's default pages load Swagger UI and ReDoc from a CDN, so they stay blank on an air-gapped
cluster. The `fastapi-offline` wheel ships the same builds (swagger-ui-bundle.js, swagger-ui.css,
redoc.standalone.js); only its static files are used here, mounted under /docs/assets. Swagger UI's
online validator badge (a request to validator.swagger.io) is switched off, and both pages carry a
Content-Security-Policy that lets them load from this origin only: ReDoc's side menu otherwise
fetches its logo from cdn.redoc.ly (it hides the image when that fails).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

ASSETS_URL = "/docs/assets"
ASSET_FILES = ("swagger-ui-bundle.js", "swagger-ui.css", "redoc.standalone.js", "favicon.png")
# Inline script/style: the pages' own initialiser and the UIs' styles; workers from blob: (ReDoc).
CSP = ("default-src 'self'; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'; "
       "img-src 'self' data:; font-src 'self' data:; worker-src 'self' blob:; connect-src 'self'")


def _self_only(page: HTMLResponse) -> HTMLResponse:
    page.headers["Content-Security-Policy"] = CSP
    return page


def assets_dir() -> Path:
    """The static files of the installed fastapi-offline package (without importing its code)."""
    spec = importlib.util.find_spec("fastapi_offline")
    if spec is None or spec.origin is None:
        raise RuntimeError("fastapi-offline is not installed (pip install -e .): no offline API docs")
    directory = Path(spec.origin).parent / "static"
    missing = [f for f in ASSET_FILES if not (directory / f).is_file()]
    if missing:
        raise RuntimeError(f"{directory} lacks {missing}: reinstall fastapi-offline")
    return directory


def mount_offline_docs(app: FastAPI, docs_url: str = "/docs", redoc_url: str = "/redoc") -> None:
    """Add the docs pages to an app created with docs_url=None, redoc_url=None."""
    app.mount(ASSETS_URL, StaticFiles(directory=assets_dir()), name="docs-assets")
    openapi_url = app.openapi_url or "/openapi.json"
    oauth2_redirect = f"{docs_url}/oauth2-redirect"

    @app.get(docs_url, include_in_schema=False)
    async def swagger_ui() -> HTMLResponse:
        return _self_only(get_swagger_ui_html(
            openapi_url=openapi_url, title=f"{app.title} - Swagger UI",
            swagger_js_url=f"{ASSETS_URL}/swagger-ui-bundle.js", swagger_css_url=f"{ASSETS_URL}/swagger-ui.css",
            swagger_favicon_url=f"{ASSETS_URL}/favicon.png", oauth2_redirect_url=oauth2_redirect,
            swagger_ui_parameters={"validatorUrl": None}))

    @app.get(oauth2_redirect, include_in_schema=False)
    async def swagger_ui_oauth2_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    @app.get(redoc_url, include_in_schema=False)
    async def redoc() -> HTMLResponse:
        return _self_only(get_redoc_html(openapi_url=openapi_url, title=f"{app.title} - ReDoc",
                                         redoc_js_url=f"{ASSETS_URL}/redoc.standalone.js",
                                         redoc_favicon_url=f"{ASSETS_URL}/favicon.png", with_google_fonts=False))
