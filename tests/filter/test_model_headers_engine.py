"""Every request header the engine reads to choose the model or its version is in the key (issue
32), with the real engine behind a real Envoy on both hosts: `mlp-classifier` serves versions 1
and 2 (the demo repository), and `POST /v1/infer` picks the version from `x-model-version`. A
request for version 2 is never answered with version 1's stored answer, and a repeated or
non-UTF-8 `x-model-version` keeps the cache out."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from meshcache.ctl.launchers import Engine
from meshcache.ctl.procs import local_http
from tests.engine.helpers import init_demo_models, running_engine
from tests.filter.stack import config, filter_stack, policy

MODEL = "mlp-classifier"
V1_INFER = "/v1/infer"


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    repo = init_demo_models(tmp_path_factory.mktemp("models"))
    with running_engine(repo, tmp_path_factory.mktemp("engine-logs")) as e:
        yield e


def _body(seed: int) -> bytes:
    x = np.random.default_rng(seed).random(16, dtype=np.float32)
    return json.dumps({"input": x.tolist(), "shape": [1, 16]}).encode()


def _direct(engine: Engine, headers: dict[str, str], body: bytes) -> bytes:
    r = local_http().post(f"{engine.http_url}{V1_INFER}", content=body, headers=headers, timeout=10)
    assert r.status_code == 200, r.text
    return r.content


def test_x_model_version_picks_its_own_entry(tmp_path: Path, engine: Engine, host: str) -> None:
    body = _body(7)
    v1 = {"x-model-id": MODEL, "x-model-version": "1"}
    v2 = {"x-model-id": MODEL, "x-model-version": "2"}
    latest = {"x-model-id": MODEL}
    want = {name: _direct(engine, h, body) for name, h in (("1", v1), ("2", v2), ("latest", latest))}
    assert want["1"] != want["2"], "the demo's two versions answer differently (else this test proves nothing)"
    with filter_stack(tmp_path, config(policy("mlp")), upstream=(engine.http_port, engine.grpc_port), host=host) as s, \
            httpx.Client(timeout=10) as c:
        first = c.post(s.url(V1_INFER), content=body, headers=v1)
        assert first.headers["cache-status"] == "meshcache; fwd=miss; stored"
        assert first.content == want["1"]
        assert c.post(s.url(V1_INFER), content=body, headers=v1).headers["cache-status"].startswith("meshcache; hit")
        # Version 2, same body: its own entry, the engine's version-2 answer; then hit as itself.
        for n in range(2):
            r = c.post(s.url(V1_INFER), content=body, headers=v2)
            assert r.content == want["2"], f"version 2 was answered with another version's output ({n})"
            expected = "meshcache; fwd=miss; stored" if n == 0 else "meshcache; hit"
            assert r.headers["cache-status"].startswith(expected), r.headers["cache-status"]
        # No version (the engine's latest) and an empty one are entries of their own too.
        for headers in (latest, {**latest, "x-model-version": ""}):
            r = c.post(s.url(V1_INFER), content=body, headers=headers)
            assert r.headers["cache-status"] == "meshcache; fwd=miss; stored", headers
            assert r.content == want["latest"]
        # What the engine would read otherwise than the key: the cache stays out.
        twice = [("x-model-id", MODEL), ("x-model-version", "1"), ("x-model-version", "2")]
        r = c.post(s.url(V1_INFER), content=body, headers=twice)
        assert r.headers["cache-status"] == "meshcache; fwd=bypass; detail=repeated-header"
        assert r.content == want["2"], "the engine reads the last line"
        r = c.post(s.url(V1_INFER), content=body, headers=[("x-model-id", MODEL), ("x-model-version", b"\xff")])
        assert r.headers["cache-status"] == "meshcache; fwd=bypass; detail=header-bytes"
        # The KServe v2 path names its version in the path: both versions keyed apart there too.
        tensor = {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 16],
                              "data": json.loads(body)["input"]}]}
        answers = {}
        for version in ("1", "2"):
            path = f"/v2/models/{MODEL}/versions/{version}/infer"
            for _ in range(2):
                r = c.post(s.url(path), json=tensor)
                assert r.status_code == 200, r.text
            assert r.headers["cache-status"].startswith("meshcache; hit")
            answers[version] = r.json()["outputs"][0]["data"]
        assert answers["1"] != answers["2"]
