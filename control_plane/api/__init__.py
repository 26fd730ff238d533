"""HTTP API (FastAPI): policies, purge, limits, snapshots, rollback, audit, proxies, health, metrics.

`app.create_app` assembles the pieces: `middleware` (request body limit), `errors` (one JSON error
shape for every failure), `dependencies` (auth, path and header parameters) and `routers/`.
"""

from .app import create_app

__all__ = ["create_app"]
