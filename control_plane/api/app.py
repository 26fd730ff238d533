"""`create_app`: the FastAPI application of one control plane (middleware, error handlers, routers)."""

from __future__ import annotations

from fastapi import FastAPI

from ..wiring import ControlPlane
from . import errors
from .docs import mount_offline_docs
from .middleware import BodyLimit
from .routers import health, policies, proxies, snapshots, stats, status_page


def create_app(cp: ControlPlane) -> FastAPI:
    app = FastAPI(title="meshcache control plane", version="1",
                  description="Cache policies for the meshcache filter, pushed to Envoy over xDS (ECDS).",
                  docs_url=None, redoc_url=None)
    mount_offline_docs(app)  # /docs and /redoc without a CDN
    app.state.cp = cp
    app.add_middleware(BodyLimit, limit=cp.settings.max_request_bytes)
    errors.install_handlers(app)
    for router in (health.router, policies.router, snapshots.router, proxies.router, stats.router,
                   status_page.router):
        app.include_router(router)
    return app
