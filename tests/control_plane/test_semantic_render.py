"""`semantic_service` (issue 38) is deployment, not policy content: the control plane's settings
put it in every snapshot it installs, so the ECDS resources (Wasm and native, server and client
role) and the Istio objects (EnvoyFilter, TrafficExtension) carry the same block; the stored
record does not, and a bad setting fails at startup."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from envoy.config.core.v3 import extension_pb2
from envoy.extensions.filters.http.wasm.v3 import wasm_pb2
from google.protobuf import wrappers_pb2
from pydantic import ValidationError

from meshcache.contract import extensions
from meshcache.contract.filter_config import (
    DEFAULT_SEMANTIC_THRESHOLD,
    SemanticPolicy,
    SemanticService,
    demo_policies,
)
from meshcache.contract.wasm_filter import CLIENT_FILTER_NAME, FILTER_NAME
from meshcache.control_plane.renderers import EcdsRenderer
from meshcache.control_plane.settings import Settings
from meshcache.control_plane.snapshots import Snapshot, SnapshotCache
from meshcache.semantic import DEFAULT_THRESHOLD

SERVICE = SemanticService(cluster="outbound|8090||semantic.meshcache.svc.cluster.local",
                          authority="semantic.meshcache.svc.cluster.local:8090")
BLOCK = {"cluster": SERVICE.cluster, "authority": SERVICE.authority, "timeout_ms": 200}


def _snapshot(version: int = 3) -> Snapshot:
    llm = demo_policies(version)[0].model_copy(update={"model_prefix": "llama3-", "semantic": SemanticPolicy()})
    return Snapshot(version=version, policies=(*demo_policies(version), llm))


def _wasm_config(typed: extension_pb2.TypedExtensionConfig) -> dict[str, Any]:
    wasm, value = wasm_pb2.Wasm(), wrappers_pb2.StringValue()
    assert typed.typed_config.Unpack(wasm) and wasm.config.configuration.Unpack(value)
    return json.loads(value.value)  # type: ignore[no-any-return]


def test_the_cache_installs_every_snapshot_with_the_deployment_service() -> None:
    cache = SnapshotCache(None, semantic_service=SERVICE)
    seen: list[Snapshot] = []
    cache.watch(seen.append)
    assert cache.set(_snapshot(3))
    assert cache.current.semantic_service == SERVICE and seen[0] is cache.current
    config = json.loads(cache.current.plugin_config_json)
    assert config["semantic_service"] == BLOCK
    assert {p["model_prefix"]: "semantic" in p for p in config["policies"]}["llama3-"]
    assert [p for p in config["policies"] if p["model_prefix"] == "resnet-mini"][0].get("semantic") is None
    # Not stored: the record is policy content only (a deployment without the service reads it back off).
    record = json.loads(cache.current.to_record())
    assert "semantic_service" not in record
    again = Snapshot.from_record(cache.current.to_record())
    assert again.semantic_service is None and again.same_content(cache.current)
    assert "semantic_service" not in json.loads(again.plugin_config_json)
    # Without a configured service nothing is added (the bytes of a deployment without it are unchanged).
    plain = SnapshotCache(None)
    plain.set(_snapshot(3))
    assert plain.current.plugin_config_json == _snapshot(3).plugin_config_json
    assert "semantic_service" not in plain.current.plugin_config_json


def test_ecds_and_istio_objects_carry_the_same_block() -> None:
    cache = SnapshotCache(None, semantic_service=SERVICE)
    cache.set(_snapshot(4))
    snap = cache.current
    renderer = EcdsRenderer(Path("/etc/meshcache/meshcache_filter.wasm"))
    server = _wasm_config(renderer.typed_extension_config(snap))
    client = _wasm_config(renderer.typed_extension_config(snap, client=True))
    assert server["semantic_service"] == client["semantic_service"] == BLOCK
    assert sorted(renderer.resources(snap)) == sorted([FILTER_NAME, CLIENT_FILTER_NAME, "meshcache-native",
                                                       "meshcache-native-client"])
    # The native host gets the same text (inside its DynamicModuleFilter's StringValue).
    assert snap.plugin_config_json.encode() in renderer.native_extension_config(snap).typed_config.value
    url, sha = "oci://r/f@sha256:" + "a" * 64, "a" * 64
    for mode in ("full", "basic"):
        objects = extensions.objects(mode, colors=["blue"], url=url, sha256=sha, plugin_config=snap.plugin_config())
        assert _find_semantic_service(objects[0]) == BLOCK, mode


def _find_semantic_service(obj: Any) -> Any:
    """The `semantic_service` block wherever the object carries the plugin configuration (a JSON
    string in an EnvoyFilter's Wasm config, a struct in a TrafficExtension)."""
    if isinstance(obj, dict):
        if "semantic_service" in obj:
            return obj["semantic_service"]
        for v in obj.values():
            found = _find_semantic_service(v)
            if found is not None:
                return found
    elif isinstance(obj, list):
        for v in obj:
            found = _find_semantic_service(v)
            if found is not None:
                return found
    elif isinstance(obj, str) and obj.startswith("{") and "semantic_service" in obj:
        return _find_semantic_service(json.loads(obj))
    return None


@pytest.mark.parametrize(("env", "reason"), [
    ({"semantic_cluster": "c"}, "go together"),
    ({"semantic_authority": "h:1"}, "go together"),
    ({"semantic_cluster": "c", "semantic_authority": "h:1/path"}, "pattern"),
    ({"semantic_cluster": "c d", "semantic_authority": "h:1"}, "pattern"),
    ({"semantic_cluster": "c", "semantic_authority": "h:1", "semantic_timeout_ms": 0}, "greater than or equal to 1"),
    ({"semantic_cluster": "c", "semantic_authority": "h:1", "semantic_timeout_ms": 5001}, "less than or equal"),
    ({"semantic_url": "http://h:1"}, "needs semantic_cluster"),
    ({"semantic_cluster": "c", "semantic_authority": "h:1", "semantic_url": "ftp://h"}, "pattern"),
])
def test_bad_semantic_settings_fail_at_startup(env: dict[str, Any], reason: str) -> None:
    with pytest.raises(ValidationError, match=reason):
        Settings(**env)


def test_settings_make_the_block_and_the_purge_url() -> None:
    s = Settings(semantic_cluster="meshcache_semantic", semantic_authority="127.0.0.1:8090", semantic_timeout_ms=300)
    assert s.semantic_service() == SemanticService(cluster="meshcache_semantic", authority="127.0.0.1:8090",
                                                   timeout_ms=300)
    assert s.semantic_base_url() == "http://127.0.0.1:8090"
    assert Settings(semantic_cluster="c", semantic_authority="h:1", semantic_url="https://x:9/").semantic_base_url() \
        == "https://x:9"
    assert Settings().semantic_service() is None and Settings().semantic_base_url() == ""


def test_the_policy_default_is_the_services_shipped_threshold() -> None:
    assert DEFAULT_SEMANTIC_THRESHOLD == DEFAULT_THRESHOLD == SemanticPolicy().threshold
