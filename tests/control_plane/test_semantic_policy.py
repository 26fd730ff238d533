"""The per-policy `semantic` field and the top-level `semantic_service` (issue 38), against a real
control-plane process and a real redis-server: the API round trip into the filter config, 422s
that name the field and write nothing, and the service block rendered only when configured."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from meshcache.semantic import DEFAULT_THRESHOLD
from tests.helpers.control_plane import ControlPlaneProc
from tests.helpers.wait import eventually

MERGE_PATCH = {"content-type": "application/merge-patch+json"}
SERVICE_ENV = {"MESHCACHE_CP_SEMANTIC_CLUSTER": "meshcache_semantic",
               "MESHCACHE_CP_SEMANTIC_AUTHORITY": "semantic.meshcache:8090",
               "MESHCACHE_CP_SEMANTIC_TIMEOUT_MS": "150"}


def _rows(c: Any) -> dict[str, dict[str, Any]]:
    config = json.loads(c.get("/v1/snapshot").json()["plugin_config"])
    return {row["model_prefix"]: row for row in config["policies"]}


def test_semantic_round_trips_into_the_filter_config(cp: ControlPlaneProc) -> None:
    c = cp.client()
    assert c.put("/v1/policies/plain", json={"ttl_s": 60}).status_code == 200
    r = c.put("/v1/policies/llama3-", json={"ttl_s": 60, "semantic": {}})
    assert r.status_code == 200, r.text
    assert r.json()["policy"]["semantic"] == {"threshold": DEFAULT_THRESHOLD, "shadow": False}
    rows = _rows(c)
    # Off is absent from the filter's row (a policy without it renders exactly as before).
    assert "semantic" not in rows["plain"]
    assert c.get("/v1/policies/plain").json()["policy"]["semantic"] is None
    assert rows["llama3-"]["semantic"] == {"threshold": 0.999, "shadow": False}
    # A merge patch merges into the object: the threshold stays, shadow turns on.
    r = c.patch("/v1/policies/llama3-", content=json.dumps({"semantic": {"shadow": True}}), headers=MERGE_PATCH)
    assert r.status_code == 200, r.text
    assert _rows(c)["llama3-"]["semantic"] == {"threshold": 0.999, "shadow": True}
    r = c.patch("/v1/policies/llama3-", content=json.dumps({"semantic": {"threshold": 0.95}}), headers=MERGE_PATCH)
    assert _rows(c)["llama3-"]["semantic"] == {"threshold": 0.95, "shadow": True}
    assert r.json()["changes"][0]["fields"]["semantic"] == [{"threshold": 0.999, "shadow": True},
                                                            {"threshold": 0.95, "shadow": True}]
    # null turns it off; the store kept every step (a restart serves the same).
    c.patch("/v1/policies/llama3-", content=json.dumps({"semantic": None}), headers=MERGE_PATCH)
    assert "semantic" not in _rows(c)["llama3-"]
    c.put("/v1/policies/llama3-", json={"ttl_s": 60, "semantic": {"threshold": 1, "shadow": False}})
    version = c.get("/v1/snapshot").json()["version"]
    cp.restart()
    eventually(lambda: cp.client().get("/readyz").status_code == 200)
    c = cp.client()
    assert c.get("/v1/snapshot").json()["version"] == version
    assert _rows(c)["llama3-"]["semantic"] == {"threshold": 1.0, "shadow": False}
    # No semantic service configured: no `semantic_service` block (lookups off everywhere).
    assert "semantic_service" not in json.loads(c.get("/v1/snapshot").json()["plugin_config"])
    schema = c.get("/openapi.json").json()["components"]["schemas"]
    assert schema["PolicySpec"]["properties"]["semantic"]["description"].startswith("Opt-in semantic layer")


BAD = [
    ({"semantic": {"threshold": 0}}, "semantic.threshold", "greater than 0"),
    ({"semantic": {"threshold": -0.5}}, "semantic.threshold", "greater than 0"),
    ({"semantic": {"threshold": 1.01}}, "semantic.threshold", "less than or equal to 1"),
    ({"semantic": {"threshold": "0.9"}}, "semantic.threshold", "number"),
    ({"semantic": {"shadow": "yes"}}, "semantic.shadow", "boolean"),
    ({"semantic": {"embedder": "x"}}, "semantic.embedder", "unknown field"),
    ({"semantic": True}, "semantic", ""),
    ({"semantic": 0.9}, "semantic", ""),
]


def test_bad_semantic_values_are_422_naming_the_field(module_cp: ControlPlaneProc) -> None:
    c = module_cp.client()
    assert c.put("/v1/policies/bad-llama3-", json={"ttl_s": 60, "semantic": {"threshold": 0.99}}).status_code == 200
    before = c.get("/v1/snapshot").json()
    for body, field, reason in BAD:
        put = c.put("/v1/policies/bad-llama3-", json={"ttl_s": 60, **body})
        patch = c.patch("/v1/policies/bad-llama3-", content=json.dumps(body), headers=MERGE_PATCH)
        for method, r in (("PUT", put), ("PATCH", patch)):
            assert r.status_code == 422, (method, body, r.text)
            errors = {e["field"]: e["reason"] for e in r.json()["errors"]}
            assert any(f.startswith(field) and reason in why for f, why in errors.items()), (method, r.json())
            assert "semantic" in r.json()["detail"]
    assert c.get("/v1/snapshot").json() == before  # nothing written


def test_semantic_service_is_rendered_when_configured(start_cp: Callable[..., ControlPlaneProc]) -> None:
    cp = start_cp(extra_env=SERVICE_ENV)
    c = cp.client()
    assert c.put("/v1/policies/llama3-", json={"ttl_s": 60, "semantic": {"shadow": True}}).status_code == 200
    config = json.loads(c.get("/v1/snapshot").json()["plugin_config"])
    assert config["semantic_service"] == {"cluster": "meshcache_semantic", "authority": "semantic.meshcache:8090",
                                          "timeout_ms": 150}
    assert config["policies"][0]["semantic"] == {"threshold": DEFAULT_THRESHOLD, "shadow": True}


def test_cli_policy_set_turns_the_layer_on_and_off(module_cp: ControlPlaneProc) -> None:
    """`meshcache policy set --semantic-threshold/--semantic-shadow` patch the members of `semantic`
    (the other member kept), `--unset semantic` turns it off, a bad value changes nothing."""
    from tests.control_plane.test_cli_day2 import cli

    cp = module_cp  # shared with the 422 test, which writes its own prefix

    def row() -> dict[str, Any]:
        return _rows(cp.client())["llama3-"]

    done = cli(cp, "policy", "set", "llama3-", "--ttl", "60", "--semantic-shadow")
    assert done.returncode == 0, done.stderr
    assert row()["semantic"] == {"threshold": DEFAULT_THRESHOLD, "shadow": True}
    assert cli(cp, "policy", "set", "llama3-", "--semantic-threshold", "0.95").returncode == 0
    assert row()["semantic"] == {"threshold": 0.95, "shadow": True}
    done = cli(cp, "policy", "set", "llama3-", "--no-semantic-shadow")
    assert done.returncode == 0 and "semantic" in done.stdout, done.stdout
    assert row()["semantic"] == {"threshold": 0.95, "shadow": False}
    bad = cli(cp, "policy", "set", "llama3-", "--semantic-threshold", "1.5")
    assert bad.returncode == 1 and "semantic.threshold" in bad.stderr, bad.stderr
    assert row()["semantic"] == {"threshold": 0.95, "shadow": False}
    assert cli(cp, "policy", "set", "llama3-", "--unset", "semantic").returncode == 0
    assert "semantic" not in row()
