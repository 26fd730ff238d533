"""How many requests the local mesh's engines answered (requests: tests.helpers.kserve)."""

from __future__ import annotations

from meshcache.ctl.mesh.topology import Mesh
from tests.helpers.kserve import engine_calls


def default_engine_calls(mesh: Mesh, model: str) -> float:
    return engine_calls(model, mesh.endpoints()["engine_metrics"])


def canary_engine_calls(mesh: Mesh, model: str) -> float:
    return engine_calls(model, mesh.endpoints()["canary_engine_metrics"])
