"""HTTP API against a real control-plane process and a real redis-server."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from meshcache.contract.wasm_filter import plugin_config_json
from meshcache.ctl import procs
from tests.engine.helpers import init_demo_models, running_engine
from tests.helpers.control_plane import READ_TOKEN, ControlPlaneProc, module_control_plane


@pytest.fixture(scope="module")
def shared_cp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlaneProc]:
    """One replica for the tests that only add their own prefixes (field round trips, validation,
    auth); room for all their policies."""
    with module_control_plane(tmp_path_factory, extra_env={"MESHCACHE_CP_MAX_POLICIES": "50"}) as cp:
        yield cp


def test_put_get_list_delete(cp: ControlPlaneProc) -> None:
    c = cp.client()
    r = c.put("/v1/policies/llama3-70b", json={"ttl_s": 300, "max_ttl_s": 1800})
    assert r.status_code == 200, r.text
    assert r.json()["version"] == 1 and r.json()["changed"] is True
    assert r.headers["ETag"] == '"1"'
    policy = c.get("/v1/policies/llama3-70b").json()["policy"]
    assert policy == {"model_prefix": "llama3-70b", "ttl_s": 300, "max_ttl_s": 1800, "generation": 1,
                      "hash_headers": ["content-type", "x-model-id"], "vary_headers": [],
                      "scope": "shared", "enabled": True, "ignore_fields": [], "deterministic_only": False,
                      "coalesce_timeout_ms": 5000, "stale_if_error_s": 0, "stale_while_revalidate_s": 0,
                      "client_no_cache": "revalidate", "semantic": None}
    # An identical PUT is not a change: no new snapshot.
    again = c.put("/v1/policies/llama3-70b", json={"ttl_s": 300, "max_ttl_s": 1800}).json()
    assert (again["version"], again["changed"]) == (1, False)
    r = c.put("/v1/policies/mistral", json={"ttl_s": 5, "scope": "principal", "vary_headers": ["accept"],
                                            "model_prefix": "mistral", "enabled": False})
    assert r.json()["version"] == 2
    listed = c.get("/v1/policies").json()
    assert listed["version"] == 2
    assert [p["model_prefix"] for p in listed["policies"]] == ["llama3-70b", "mistral"]
    assert listed["policies"][1]["max_ttl_s"] == 5  # defaults to ttl_s
    r = c.delete("/v1/policies/llama3-70b")
    assert r.status_code == 200 and r.json()["version"] == 3
    assert c.get("/v1/policies/llama3-70b").status_code == 404
    assert c.delete("/v1/policies/llama3-70b").status_code == 404
    assert c.get("/v1/snapshot").json()["version"] == 3


def served_row(c: httpx.Client, prefix: str) -> dict[str, Any]:
    """The served filter config's row of one policy (the shared replica serves other tests' too)."""
    rows = json.loads(c.get("/v1/snapshot").json()["plugin_config"])["policies"]
    return next(row for row in rows if row["model_prefix"] == prefix)  # type: ignore[no-any-return]


def test_key_shaping_fields_round_trip_into_the_filter_config(shared_cp: ControlPlaneProc) -> None:
    c = shared_cp.client()
    r = c.put("/v1/policies/shaping-gpt", json={"ttl_s": 60, "ignore_fields": ["user", "metadata"],
                                        "deterministic_only": True})
    assert r.status_code == 200, r.text
    policy = c.get("/v1/policies/shaping-gpt").json()["policy"]
    assert (policy["ignore_fields"], policy["deterministic_only"]) == (["user", "metadata"], True)
    row = served_row(c, "shaping-gpt")
    assert (row["ignore_fields"], row["deterministic_only"]) == (["user", "metadata"], True)
    # Order is kept (it is the operator's), and a change of either field is a change.
    again = c.put("/v1/policies/shaping-gpt", json={"ttl_s": 60, "ignore_fields": ["metadata", "user"],
                                            "deterministic_only": True}).json()
    assert again["changed"] is True


def test_coalescing_and_stale_fields_round_trip_into_the_filter_config(shared_cp: ControlPlaneProc) -> None:
    c = shared_cp.client()
    fields = {"coalesce_timeout_ms": 0, "stale_if_error_s": 600, "stale_while_revalidate_s": 30}
    r = c.put("/v1/policies/stale-rn", json={"ttl_s": 60, **fields})
    assert r.status_code == 200, r.text
    policy = c.get("/v1/policies/stale-rn").json()["policy"]
    assert {k: policy[k] for k in fields} == fields
    row = served_row(c, "stale-rn")
    assert {k: row[k] for k in fields} == fields
    assert c.put("/v1/policies/stale-rn", json={"ttl_s": 60, **fields, "coalesce_timeout_ms": 250}).json()["changed"]
    schema = c.get("/openapi.json").json()["components"]["schemas"]["PolicySpec"]["properties"]
    assert schema["coalesce_timeout_ms"]["maximum"] == 60_000 and schema["coalesce_timeout_ms"]["default"] == 5000
    assert schema["stale_if_error_s"]["maximum"] == schema["stale_while_revalidate_s"]["maximum"] == 86_400


def test_client_no_cache_round_trips_into_the_filter_config(shared_cp: ControlPlaneProc) -> None:
    """`client_no_cache` (issue 32): revalidate by default, ignore when set; PUT and PATCH reach
    the filter's row; any other value is a 422 naming the field, and changes nothing."""
    c = shared_cp.client()
    assert c.put("/v1/policies/no-cache-llm", json={"ttl_s": 60}).status_code == 200
    assert c.get("/v1/policies/no-cache-llm").json()["policy"]["client_no_cache"] == "revalidate"
    r = c.patch("/v1/policies/no-cache-llm", content=json.dumps({"client_no_cache": "ignore"}), headers=MERGE_PATCH)
    assert r.status_code == 200, r.text
    row = served_row(c, "no-cache-llm")
    assert row["client_no_cache"] == "ignore"
    version = c.get("/v1/snapshot").json()["version"]
    for bad in ("bypass", True, None, ""):
        r = c.put("/v1/policies/no-cache-llm", json={"ttl_s": 60, "client_no_cache": bad})
        assert r.status_code == 422 and "client_no_cache" in r.text, (bad, r.text)
    assert c.get("/v1/snapshot").json()["version"] == version
    schema = c.get("/openapi.json").json()["components"]["schemas"]["PolicySpec"]["properties"]
    assert schema["client_no_cache"]["enum"] == ["revalidate", "ignore"]
    assert schema["client_no_cache"]["default"] == "revalidate"


def test_snapshot_renders_the_filter_config(cp: ControlPlaneProc) -> None:
    c = cp.client()
    c.put("/v1/policies/llama3-70b", json={"ttl_s": 300, "max_ttl_s": 1800})
    c.put("/v1/limits", json={"max_entry_bytes": 2048, "max_total_bytes": 1 << 20, "max_entries": 100})
    snap = c.get("/v1/snapshot").json()
    expected = {
        "version": "2", "color": "", "max_entry_bytes": 2048, "max_total_bytes": 1 << 20, "max_entries": 100,
        "policies": [{"model_prefix": "llama3-70b", "ttl_s": 300, "max_ttl_s": 1800, "generation": 1,
                      "hash_headers": ["content-type", "x-model-id"], "vary_headers": [],
                      "scope": "shared", "enabled": True, "ignore_fields": [], "deterministic_only": False,
                      "coalesce_timeout_ms": 5000, "stale_if_error_s": 0, "stale_while_revalidate_s": 0,
                      "client_no_cache": "revalidate"}],
    }
    assert snap["plugin_config"] == plugin_config_json(expected)
    assert (snap["author"], snap["action"]) == ("admin", "limits")
    assert c.get("/v1/limits").json() == {"max_entry_bytes": 2048, "max_total_bytes": 1 << 20,
                                           "max_entries": 100}
    # Older snapshots stay readable, unchanged.
    first = c.get("/v1/snapshots/1").json()
    assert json.loads(first["plugin_config"])["max_entries"] == 16384
    assert c.get("/v1/snapshots/99").status_code == 404


def test_if_match(cp: ControlPlaneProc) -> None:
    c = cp.client()
    assert c.put("/v1/policies/a", json={"ttl_s": 1}, headers={"If-Match": "0"}).status_code == 200
    r = c.put("/v1/policies/a", json={"ttl_s": 2}, headers={"If-Match": "0"})
    assert r.status_code == 412 and "current version is 1" in r.json()["detail"]
    assert r.headers["ETag"] == '"1"'
    assert c.get("/v1/policies/a").json()["policy"]["ttl_s"] == 1  # nothing written
    assert c.put("/v1/policies/a", json={"ttl_s": 2}, headers={"If-Match": '"1"'}).json()["version"] == 2
    assert c.delete("/v1/policies/a", headers={"If-Match": "1"}).status_code == 412
    r = c.put("/v1/policies/a", json={"ttl_s": 3}, headers={"If-Match": "yesterday"})
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "If-Match"
    assert c.delete("/v1/policies/a", headers={"If-Match": "2"}).json()["version"] == 3


MERGE_PATCH = {"content-type": "application/merge-patch+json"}


def test_patch_changes_only_the_fields_it_names(cp: ControlPlaneProc) -> None:
    c = cp.client()
    full = {"ttl_s": 600, "max_ttl_s": 1800, "coalesce_timeout_ms": 2000, "stale_if_error_s": 600,
            "vary_headers": ["x-tenant"]}
    assert c.put("/v1/policies/resnet-mini", json=full).json()["version"] == 1
    r = c.patch("/v1/policies/resnet-mini", content=json.dumps({"ttl_s": 300}), headers=MERGE_PATCH)
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["version"], body["changed"], r.headers["ETag"]) == (2, True, '"2"')
    assert body["changes"] == [{"what": "changed", "model_prefix": "resnet-mini", "fields": {"ttl_s": [600, 300]}}]
    assert body["warnings"] == []
    kept = {k: body["policy"][k] for k in ("max_ttl_s", "coalesce_timeout_ms", "stale_if_error_s", "vary_headers",
                                            "generation")}
    assert kept == {"max_ttl_s": 1800, "coalesce_timeout_ms": 2000, "stale_if_error_s": 600,
                    "vary_headers": ["x-tenant"], "generation": 1}
    # null resets a field to its default; application/json is taken too.
    r = c.patch("/v1/policies/resnet-mini", json={"stale_if_error_s": None, "vary_headers": None, "max_ttl_s": None})
    assert r.status_code == 200, r.text
    policy = r.json()["policy"]
    assert (policy["stale_if_error_s"], policy["vary_headers"], policy["max_ttl_s"]) == (0, [], 300)
    assert r.json()["changes"][0]["fields"] == {"max_ttl_s": [1800, 300], "stale_if_error_s": [600, 0],
                                                 "vary_headers": [["x-tenant"], []]}
    # The same patch again changes nothing: no new snapshot.
    again = c.patch("/v1/policies/resnet-mini", json={"stale_if_error_s": None}).json()
    assert (again["version"], again["changed"], again["changes"]) == (3, False, [])
    # If-Match: only on that snapshot version.
    stale = c.patch("/v1/policies/resnet-mini", json={"ttl_s": 1}, headers={**MERGE_PATCH, "If-Match": '"2"'})
    assert stale.status_code == 412 and stale.headers["ETag"] == '"3"'
    assert c.patch("/v1/policies/resnet-mini", json={"ttl_s": 250}, headers={"If-Match": '"3"'}).status_code == 200
    # A patch that would make the policy invalid writes nothing and names the field.
    before = c.get("/v1/policies").json()
    for patch, field, reason in (({"max_ttl_s": 10}, "max_ttl_s", "must be at least ttl_s"),
                                 ({"ttl_s": None}, "ttl_s", "is required"),
                                 ({"ttl_s": "300"}, "ttl_s", "valid integer"),
                                 ({"generation": 9}, "generation", "managed by the control plane"),
                                 ({"scope": "user"}, "scope", "'shared' or 'principal'"),
                                 ({"ttl_s": 5, "nope": 1}, "nope", "unknown field"),
                                 ({"model_prefix": "other"}, "model_prefix", "path")):
        r = c.patch("/v1/policies/resnet-mini", json=patch)
        assert r.status_code == 422, (patch, r.text)
        errors = r.json()["errors"]
        assert errors and errors[0]["field"] == field and reason in errors[0]["reason"], (patch, errors)
    for content, headers, status in ((b"[1]", MERGE_PATCH, 422), (b"{not json", MERGE_PATCH, 422),
                                     (b'{"ttl_s": 5}', {"content-type": "text/plain"}, 415)):
        r = c.patch("/v1/policies/resnet-mini", content=content, headers=headers)
        assert r.status_code == status, (content, r.text)
    assert c.get("/v1/policies").json() == before, "nothing was written"
    # On a prefix without a policy, PATCH creates one from the defaults (ttl_s needed).
    assert c.patch("/v1/policies/mlp", json={"enabled": False}).status_code == 422
    created = c.patch("/v1/policies/mlp", json={"ttl_s": 30}).json()
    assert created["policy"]["coalesce_timeout_ms"] == 5000 and created["changes"][0]["what"] == "added"
    # PUT stays a full replace: what it leaves out takes the defaults.
    replaced = c.put("/v1/policies/resnet-mini", json={"ttl_s": 200}).json()
    assert replaced["policy"]["coalesce_timeout_ms"] == 5000
    assert replaced["changes"][0]["fields"]["coalesce_timeout_ms"] == [2000, 5000]


def test_every_policy_field_is_described_in_the_openapi_spec(shared_cp: ControlPlaneProc) -> None:
    spec = shared_cp.client(None).get("/openapi.json").json()
    patch = spec["paths"]["/v1/policies/{model_prefix}"]["patch"]
    patch_schema = patch["requestBody"]["content"]["application/merge-patch+json"]["schema"]
    for name, schema in (("PolicySpec", spec["components"]["schemas"]["PolicySpec"]), ("PolicyPatch", patch_schema)):
        props = schema["properties"]
        assert set(props) >= {"ttl_s", "max_ttl_s", "scope", "enabled", "coalesce_timeout_ms", "vary_headers"}
        undocumented = [f for f, p in props.items() if len(p.get("description", "")) < 20]
        assert not undocumented, (name, undocumented)
        scope = props["scope"]["description"]
        assert "workload" in scope and "SPIFFE" in scope and "not on the end user" in scope
    assert set(patch["requestBody"]["content"]) == {"application/merge-patch+json", "application/json"}
    assert "412" in patch["responses"] and "415" in patch["responses"]
    assert "full replace" in spec["paths"]["/v1/policies/{model_prefix}"]["put"]["description"] or \
        "whole policy" in spec["paths"]["/v1/policies/{model_prefix}"]["put"]["description"]


def test_a_prefix_no_engine_serves_is_applied_with_a_warning(start_cp: Any, tmp_path: Path) -> None:
    """The engines' repository index says which models exist: a policy whose prefix matches
    none (a typo, most likely) is applied anyway, with a warning in the answer."""
    with running_engine(init_demo_models(tmp_path / "models"), tmp_path / "engine") as engine:
        unreachable = f"http://127.0.0.1:{procs.free_port()}"
        cp = start_cp(extra_env={"MESHCACHE_CP_ENGINE_INDEX": engine.http_url})
        c = cp.client()
        ok = c.put("/v1/policies/resnet", json={"ttl_s": 5}).json()
        assert ok["warnings"] == [] and ok["changed"]
        typo = c.patch("/v1/policies/renset-mini", json={"ttl_s": 5}).json()
        assert typo["changed"] and c.get("/v1/policies/renset-mini").status_code == 200, "applied anyway"
        assert len(typo["warnings"]) == 1
        assert "'renset-mini' matches no model the engines serve" in typo["warnings"][0]
        assert "mlp-classifier" in typo["warnings"][0] and "resnet-mini" in typo["warnings"][0]
        blind = start_cp(name="blind", extra_env={"MESHCACHE_CP_ENGINE_INDEX": unreachable})
        r = blind.client().put("/v1/policies/text", json={"ttl_s": 5}).json()
        assert r["changed"] and r["warnings"] and "could not read every engine's model index" in r["warnings"][0]


def test_purge_bumps_generation_and_rollback_never_lowers_it(cp: ControlPlaneProc) -> None:
    c = cp.client()
    c.put("/v1/policies/bert", json={"ttl_s": 60})                      # v1, generation 1
    r = c.post("/v1/purge", json={"model_prefix": "bert"})              # v2
    assert r.status_code == 200 and r.json()["policy"]["generation"] == 2
    c.put("/v1/policies/bert", json={"ttl_s": 30})                      # v3, keeps generation 2
    assert c.get("/v1/policies/bert").json()["policy"]["generation"] == 2
    r = c.post("/v1/rollback", json={"version": 1})                     # v4 = v1's content...
    assert r.status_code == 200 and r.json()["version"] == 4
    p = c.get("/v1/policies/bert").json()["policy"]
    assert p["ttl_s"] == 60 and p["generation"] == 2                    # ...but the purge stands
    c.delete("/v1/policies/bert")                                       # v5
    c.put("/v1/policies/bert", json={"ttl_s": 60})                      # v6: recreated, fresh generation
    assert c.get("/v1/policies/bert").json()["policy"]["generation"] == 6
    assert c.post("/v1/purge", json={"model_prefix": "nope"}).status_code == 404


def test_rollback(cp: ControlPlaneProc) -> None:
    c = cp.client()
    c.put("/v1/policies/a", json={"ttl_s": 10})   # v1
    c.put("/v1/policies/b", json={"ttl_s": 20})   # v2
    c.put("/v1/limits", json={"max_entries": 7})  # v3
    r = c.post("/v1/rollback", json={"version": 1})
    assert {k: r.json()[k] for k in ("version", "changed", "policy")} == {"version": 4, "changed": True, "policy": None}
    assert [(ch["what"], ch["model_prefix"]) for ch in r.json()["changes"]] == [("removed", "b"), ("limits", None)]
    snap = c.get("/v1/snapshot").json()
    assert [p["model_prefix"] for p in snap["policies"]] == ["a"]
    assert snap["limits"]["max_entries"] == 16384 and snap["action"] == "rollback to 1"
    assert c.post("/v1/rollback", json={"version": 4}).json()["changed"] is False  # equal content
    assert c.post("/v1/rollback", json={"version": 77}).status_code == 404
    assert c.post("/v1/rollback", json={"version": 0}).status_code == 422


def test_audit_records_who_changed_what(cp: ControlPlaneProc) -> None:
    c = cp.client()
    c.put("/v1/policies/a", json={"ttl_s": 10})
    c.post("/v1/purge", json={"model_prefix": "a"})
    entries = cp.client(READ_TOKEN).get("/v1/audit", params={"count": 10}).json()["entries"]
    assert [(e["version"], e["actor"], e["action"]) for e in entries] == [
        (2, "admin", "purge a"), (1, "admin", "put a")]
    assert json.loads(entries[1]["detail"])["ttl_s"] == 10


def test_auth(shared_cp: ControlPlaneProc) -> None:
    anon, reader, writer = shared_cp.client(None), shared_cp.client(READ_TOKEN), shared_cp.client()
    r = anon.get("/v1/policies")
    assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer"
    assert shared_cp.client("not-a-real-token-at-all").get("/v1/policies").status_code == 401
    assert anon.put("/v1/policies/auth-x", json={"ttl_s": 1}).status_code == 401
    r = reader.put("/v1/policies/auth-x", json={"ttl_s": 1})
    assert r.status_code == 403 and "write needed" in r.json()["detail"]
    assert reader.post("/v1/purge", json={"model_prefix": "auth-x"}).status_code == 403
    assert reader.post("/v1/rollback", json={"version": 1}).status_code == 403
    assert reader.get("/v1/policies").status_code == 200
    assert reader.get("/v1/proxies").status_code == 200
    assert writer.put("/v1/policies/auth-x", json={"ttl_s": 1}).status_code == 200
    for path in ("/healthz", "/readyz", "/metrics", "/openapi.json"):
        assert anon.get(path).status_code == 200, path


BAD_POLICIES: list[tuple[dict[str, Any], str, str]] = [
    ({"ttl_s": 10, "max_ttl_s": 5}, "max_ttl_s", "at least ttl_s"),
    ({"ttl_s": -1}, "ttl_s", "greater than or equal to 0"),
    ({"ttl_s": 1, "max_ttl_s": -5}, "max_ttl_s", "greater than or equal to 0"),
    ({"ttl_s": 10**9}, "ttl_s", "less than or equal"),
    ({"ttl_s": "10"}, "ttl_s", "integer"),
    ({"ttl_s": 1.5}, "ttl_s", "integer"),
    ({}, "ttl_s", "required"),
    ({"ttl_s": 1, "hash_headers": ["Content-Type"]}, "hash_headers.0", "pattern"),
    ({"ttl_s": 1, "vary_headers": ["x y"]}, "vary_headers.0", "pattern"),
    ({"ttl_s": 1, "vary_headers": [""]}, "vary_headers.0", "at least 1"),
    ({"ttl_s": 1, "hash_headers": ["a", "a"]}, "hash_headers", "must not repeat"),
    ({"ttl_s": 1, "hash_headers": [f"h{i}" for i in range(40)]}, "hash_headers", "at most"),
    ({"ttl_s": 1, "scope": "global"}, "scope", "'shared' or 'principal'"),
    ({"ttl_s": 1, "enabled": "yes"}, "enabled", "boolean"),
    ({"ttl_s": 1, "generation": 3}, "generation", "managed by the control plane"),
    ({"ttl_s": 1, "colour": "red"}, "colour", "unknown field"),
    ({"ttl_s": 1, "model_prefix": "other"}, "model_prefix", "must equal the path"),
    ({"ttl_s": 1, "ignore_fields": "user"}, "ignore_fields", "valid list"),
    ({"ttl_s": 1, "ignore_fields": [""]}, "ignore_fields.0", "at least 1"),
    ({"ttl_s": 1, "ignore_fields": [7]}, "ignore_fields.0", "string"),
    ({"ttl_s": 1, "ignore_fields": ["user", "user"]}, "ignore_fields", "must not repeat"),
    ({"ttl_s": 1, "ignore_fields": [f"f{i}" for i in range(65)]}, "ignore_fields", "at most 64"),
    ({"ttl_s": 1, "ignore_fields": ["\u00e9" * 200]}, "ignore_fields", "at most 256 bytes"),
    ({"ttl_s": 1, "deterministic_only": "yes"}, "deterministic_only", "boolean"),
    ({"ttl_s": 1, "coalesce_timeout_ms": 60_001}, "coalesce_timeout_ms", "less than or equal to 60000"),
    ({"ttl_s": 1, "coalesce_timeout_ms": -1}, "coalesce_timeout_ms", "greater than or equal to 0"),
    ({"ttl_s": 1, "coalesce_timeout_ms": "5000"}, "coalesce_timeout_ms", "integer"),
    ({"ttl_s": 1, "stale_if_error_s": 86_401}, "stale_if_error_s", "less than or equal to 86400"),
    ({"ttl_s": 1, "stale_if_error_s": 1.5}, "stale_if_error_s", "integer"),
    ({"ttl_s": 1, "stale_while_revalidate_s": -3}, "stale_while_revalidate_s", "greater than or equal to 0"),
    ({"ttl_s": 1, "stale_while_revalidate_s": 10**9}, "stale_while_revalidate_s", "less than or equal to 86400"),
]


@pytest.mark.parametrize(("body", "field", "reason"), BAD_POLICIES,
                         ids=[b[1] + "-" + b[2] for b in BAD_POLICIES])
def test_invalid_policy_is_422_naming_the_field(shared_cp: ControlPlaneProc, body: dict[str, Any],
                                                field: str, reason: str) -> None:
    c = shared_cp.client()
    before = c.get("/v1/snapshot").json()["version"]
    r = c.put("/v1/policies/valid-prefix", json=body)
    assert r.status_code == 422, r.text
    errors = {e["field"]: e["reason"] for e in r.json()["errors"]}
    assert field in errors and reason in errors[field], r.json()
    assert field in r.json()["detail"]
    assert c.get("/v1/snapshot").json()["version"] == before  # no partial write
    assert c.get("/v1/policies/valid-prefix").status_code == 404


@pytest.mark.parametrize(("path", "reason"), [
    ("/v1/policies/" + "m" * 257, "at most 256"),
    ("/v1/policies/", "at least 1"),
    ("/v1/policies/has%20space", "pattern"),
    ("/v1/policies/a/b", "pattern"),
])
def test_invalid_prefix_is_422(shared_cp: ControlPlaneProc, path: str, reason: str) -> None:
    r = shared_cp.client().put(path, json={"ttl_s": 1})
    assert r.status_code == 422, r.text
    assert any(e["field"] == "model_prefix" and reason in e["reason"] for e in r.json()["errors"]), r.json()


def test_percent_encoded_control_characters_in_a_prefix_are_422(shared_cp: ControlPlaneProc) -> None:
    """`PUT /v1/policies/a%0A` once wrote policy `a` (the route's `.*` stops at the newline).
    Every method refuses a prefix with a control character, naming the field, and writes nothing."""
    c = shared_cp.client()
    before = c.get("/v1/snapshot").json()["version"]
    for tail in ("%0A", "%0D", "%0D%0A", "%09", "%00", "%1F", "%7F"):
        for method, kwargs in (("PUT", {"json": {"ttl_s": 1}}), ("PATCH", {"json": {"ttl_s": 1}}),
                               ("DELETE", {}), ("GET", {})):
            r = c.request(method, f"/v1/policies/ctl-probe{tail}", **kwargs)
            assert r.status_code == 422, (method, tail, r.text)
            assert any(e["field"] == "model_prefix" for e in r.json()["errors"]), r.json()
    assert c.get("/v1/snapshot").json()["version"] == before  # nothing written
    assert c.get("/v1/policies/ctl-probe").status_code == 404


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/v1/limits", {"max_entry_bytes": 0}, "max_entry_bytes"),
    ("/v1/limits", {"max_entry_bytes": 65 * 2**20, "max_total_bytes": 2**30}, "max_entry_bytes"),
    ("/v1/limits", {"max_entries": 0}, "max_entries"),
    ("/v1/limits", {"max_entries": 2**21}, "max_entries"),
    ("/v1/limits", {"max_total_bytes": 17 * 2**30}, "max_total_bytes"),
    ("/v1/limits", {"max_entry_bytes": 4096, "max_total_bytes": 1024}, "max_total_bytes"),
    ("/v1/purge", {"model_prefix": ""}, "model_prefix"),
    ("/v1/purge", {}, "model_prefix"),
    ("/v1/rollback", {"version": -1}, "version"),
    ("/v1/rollback", {"version": "1"}, "version"),
])
def test_invalid_limits_purge_rollback_are_422(shared_cp: ControlPlaneProc, path: str,
                                               body: dict[str, Any], field: str) -> None:
    c = shared_cp.client()
    r = c.put(path, json=body) if path == "/v1/limits" else c.post(path, json=body)
    assert r.status_code == 422, r.text
    assert field in [e["field"] for e in r.json()["errors"]], r.json()


def test_malformed_and_oversized_bodies(shared_cp: ControlPlaneProc) -> None:
    c = shared_cp.client()
    r = c.put("/v1/policies/x", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 422
    r = c.put("/v1/policies/x", content=b"[1]", headers={"Content-Type": "application/json"})
    assert r.status_code == 422
    big = json.dumps({"ttl_s": 1, "vary_headers": ["a" * 100] * 1000}).encode()
    r = c.put("/v1/policies/x", content=big, headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and "larger than" in r.json()["detail"]


def test_number_of_policies_is_bounded(start_cp: Any) -> None:
    cp = start_cp(extra_env={"MESHCACHE_CP_MAX_POLICIES": "3"})
    c = cp.client()
    for name in ("a", "b", "c"):
        assert c.put(f"/v1/policies/{name}", json={"ttl_s": 1}).status_code == 200
    r = c.put("/v1/policies/d", json={"ttl_s": 1})
    assert r.status_code == 409 and "policy limit reached (3)" in r.json()["detail"]
    assert c.put("/v1/policies/a", json={"ttl_s": 2}).status_code == 200  # updates still fine


def test_health_ready_metrics(cp: ControlPlaneProc) -> None:
    c = cp.client(None)
    assert c.get("/healthz").json() == {"status": "ok"}
    assert c.get("/readyz").json()["status"] == "ready"
    cp.client().put("/v1/policies/m", json={"ttl_s": 1})
    text = c.get("/metrics").text
    assert "meshcache_cp_snapshot_version 1.0" in text
    assert 'meshcache_cp_writes_total{outcome="changed"} 1.0' in text
    spec = c.get("/openapi.json").json()
    assert "/v1/policies/{model_prefix}" in spec["paths"]
