"""A policy purge through the control plane also drops that policy's entries from the semantic
index service (a real control plane, Redis, service and engine embedder); the service being down
never fails or holds up the purge: it is logged and counted."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from meshcache.ctl import procs
from meshcache.ctl.launchers import Engine, Semantic, start_semantic
from meshcache.semantic.scope import semantic_scope
from tests.helpers.control_plane import ControlPlaneProc
from tests.helpers.wait import eventually


@pytest.fixture(scope="module")
def service(llm_engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Semantic]:
    s = start_semantic(llm_engine.http_url, tmp_path_factory.mktemp("semantic"))
    with procs.supervised([s.proc]):
        yield s


def _env(url: str) -> dict[str, str]:
    authority = url.removeprefix("http://")
    return {"MESHCACHE_CP_SEMANTIC_CLUSTER": "meshcache_semantic", "MESHCACHE_CP_SEMANTIC_AUTHORITY": authority}


def _store(http: httpx.Client, policy: str, generation: int, text: str) -> None:
    chat = {"model": f"{policy}demo", "temperature": 0,
            "messages": [{"role": "user", "content": text}]}
    scope, _ = semantic_scope(chat, policy, generation)
    r = http.post("/v1/semantic/store", json={"policy": policy, "scope": scope, "text": text,
                                              "key": f"{policy}:{text}", "ttl_s": 600})
    assert r.status_code == 200, r.text


def _purges(cp: ControlPlaneProc, outcome: str) -> float:
    for line in cp.client().get("/metrics").text.splitlines():
        if line.startswith(f'meshcache_cp_semantic_purges_total{{outcome="{outcome}"}}'):
            return float(line.split()[-1])
    return 0.0


def test_a_policy_purge_purges_its_semantic_index(service: Semantic,
                                                  start_cp: Callable[..., ControlPlaneProc]) -> None:
    cp = start_cp(extra_env=_env(service.url))
    c = cp.client()
    for prefix in ("llama3-", "gemma2-"):
        assert c.put(f"/v1/policies/{prefix}", json={"ttl_s": 600, "semantic": {}}).status_code == 200
    with httpx.Client(base_url=service.url, timeout=30) as http:
        http.post("/v1/semantic/purge", json={"all": True}).raise_for_status()
        _store(http, "llama3-", 1, "How do I reset my password?")
        _store(http, "llama3-", 1, "What is the capital of France?")
        _store(http, "gemma2-", 2, "How do I reset my password?")
        assert http.get("/v1/semantic/stats").json()["entries"] == 3
        r = c.post("/v1/purge", json={"model_prefix": "llama3-"})
        assert r.status_code == 200, r.text
        # Only that policy's entries go; the other policy keeps its own.
        eventually(lambda: http.get("/v1/semantic/stats").json()["entries"] == 1)
        assert eventually(lambda: _purges(cp, "ok") == 1)
        # A dry run purges nothing, here or there.
        assert c.post("/v1/purge?dry_run=true", json={"all": True}).status_code == 200
        assert http.get("/v1/semantic/stats").json()["entries"] == 1
        assert c.post("/v1/purge", json={"all": True}).status_code == 200
        eventually(lambda: http.get("/v1/semantic/stats").json()["entries"] == 0)
        assert eventually(lambda: _purges(cp, "ok") == 2)
        # Deleting a policy drops its entries too (a re-created one starts a new generation).
        _store(http, "gemma2-", 2, "How do I reset my password?")
        assert c.delete("/v1/policies/gemma2-").status_code == 200
        eventually(lambda: http.get("/v1/semantic/stats").json()["entries"] == 0)
        assert eventually(lambda: _purges(cp, "ok") == 3)
        assert _purges(cp, "error") == 0


def test_an_unreachable_service_never_fails_the_purge(start_cp: Callable[..., ControlPlaneProc]) -> None:
    dead = f"http://127.0.0.1:{procs.free_port()}"  # nothing listens there
    cp = start_cp(extra_env=_env(dead))
    c = cp.client()
    assert c.put("/v1/policies/llama3-", json={"ttl_s": 600, "semantic": {}}).status_code == 200
    started = time.monotonic()
    r = c.post("/v1/purge", json={"model_prefix": "llama3-"})
    took = time.monotonic() - started
    assert r.status_code == 200, r.text
    assert r.json()["policy"]["generation"] == r.json()["version"]  # the purge itself happened
    assert took < 2.0, took  # not held up by the service (its bound is 2 s)
    assert eventually(lambda: _purges(cp, "error") == 1)
    assert "semantic index purge {'policy': 'llama3-'}" in (cp.log_dir / "control-plane.log").read_text()
