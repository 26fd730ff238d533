"""MCP-over-xDS for istiod against a real control-plane process, read by a client that behaves as
istiod 1.30 does: full state per type, the EnvoyFilters (full mode) or TrafficExtensions (basic)
re-sent on every policy change, empty answers for every other type, ACK and NACK; and the wire
format checked against Istio's field numbers (tests/istio/wire.py) rather than our own protos."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import grpc
import pytest
from google.protobuf import json_format

from meshcache.contract import extensions
from meshcache.contract.paths import FILTER_WASM
from meshcache.contract.protos.istio.extensions.v1alpha1 import traffic_extension_pb2
from meshcache.contract.protos.istio.networking.v1alpha3 import envoy_filter_pb2
from meshcache.contract.wasm_filter import local_code
from meshcache.control_plane.mcp import (
    ENVOY_FILTER_TYPE_URL,
    TRAFFIC_EXTENSION_TYPE_URL,
    WASM_PLUGIN_TYPE_URL,
    EmptyMcpRenderer,
    IstioMcpRenderer,
    mcp_fallback,
)
from meshcache.control_plane.renderers import EcdsRenderer
from meshcache.control_plane.schemas import Policy
from meshcache.control_plane.settings import Settings
from meshcache.control_plane.snapshots import EMPTY, Snapshot
from tests.helpers.control_plane import ControlPlaneProc, run
from tests.helpers.wait import aeventually
from tests.istio import istiod_client, wire
from tests.istio.istiod_client import ISTIOD_1_30_TYPES, IstiodLikeClient

DIGEST = "c0ffee" + "0" * 58
URL = f"oci://registry.example.com/meshcache/filter@sha256:{DIGEST}"


def _env(mode: str = "full", colors: str = "green,blue") -> dict[str, str]:
    return {"MESHCACHE_CP_ISTIO_WASM_URL": URL, "MESHCACHE_CP_ISTIO_WASM_SHA256": DIGEST,
            "MESHCACHE_CP_ISTIO_NAMESPACE": "ml", "MESHCACHE_CP_ISTIO_COLOR": colors,
            "MESHCACHE_CP_ISTIO_MODE": mode}


def _proxies(cp: ControlPlaneProc) -> list[dict]:
    """istiod's streams: listed as config clients (MCP), never as proxies."""
    out = cp.client().get("/v1/proxies").json()
    assert out["proxies"] == [], out["proxies"]
    return out["config_clients"]  # type: ignore[no-any-return]


def _expected(kind_builder: Callable[..., dict], cp: ControlPlaneProc, color: str) -> dict:
    snapshot = json.loads(cp.client().get("/v1/snapshot").json()["plugin_config"])
    obj = kind_builder(color=color, url=URL, sha256=DIGEST, plugin_config=snapshot)
    return obj["spec"]  # type: ignore[no-any-return]


def test_istiod_syncs_then_gets_the_envoy_filters_on_every_change(start_cp: Callable[..., ControlPlaneProc]) -> None:
    cp = start_cp(extra_env=_env())

    async def scenario() -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{cp.xds_port}") as ch:
            istiod = IstiodLikeClient(ch)
            await istiod.start()
            # Before any policy: every subscribed type is answered (istiod's HasSynced), empty.
            await istiod.sync()
            assert istiod.answered == set(ISTIOD_1_30_TYPES) and not istiod.effective() and not istiod.errors

            assert cp.client().put("/v1/policies/bert", json={"ttl_s": 42}).status_code == 200
            resp = await istiod.recv()
            # Only the EnvoyFilters change; no other type is re-sent.
            assert (resp.type_url, resp.version_info, len(resp.resources)) == (ENVOY_FILTER_TYPE_URL, "1", 3)
            assert await istiod.handle(resp) is None
            objs = istiod.effective()
            assert set(objs) == {"EnvoyFilter/ml/meshcache-green", "EnvoyFilter/ml/meshcache-blue",
                                 "EnvoyFilter/ml/meshcache-client"}
            # Cache affinity: the callers' client-role filter gets the same policies.
            snapshot = json.loads(cp.client().get("/v1/snapshot").json()["plugin_config"])
            assert objs["EnvoyFilter/ml/meshcache-client"]["spec"] == extensions.client_envoy_filter(
                url=URL, sha256=DIGEST, plugin_config=snapshot)["spec"]
            client_ecds = objs["EnvoyFilter/ml/meshcache-client"]["spec"]["configPatches"][0]["patch"]["value"]
            client_config = json.loads(client_ecds["typed_config"]["config"]["configuration"]["value"])
            assert client_config["role"] == "client" and client_config["policies"] == snapshot["policies"]
            for color in ("green", "blue"):
                got = objs[f"EnvoyFilter/ml/meshcache-{color}"]
                assert got["spec"] == _expected(extensions.envoy_filter, cp, color)
                assert got["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "meshcache-control-plane"
                ecds = got["spec"]["configPatches"][0]["patch"]["value"]["typed_config"]["config"]
                assert ecds["vm_config"]["vm_id"] == "meshcache" and ecds["allow_on_headers_stop_iteration"] is True
                assert ecds["vm_config"]["code"]["remote"] == {
                    "http_uri": {"uri": URL, "cluster": "_", "timeout": "30s"}, "sha256": DIGEST}
                assert json.loads(ecds["configuration"]["value"])["policies"][0]["model_prefix"] == "bert"
            await aeventually(lambda: any(ENVOY_FILTER_TYPE_URL in p["type_urls"] for p in _proxies(cp)))

            # Every change re-sends the full state (both objects, the new config).
            assert cp.client().delete("/v1/policies/bert").status_code == 200
            resp = await istiod.recv()
            assert (resp.type_url, resp.version_info, len(resp.resources)) == (ENVOY_FILTER_TYPE_URL, "2", 3)
            assert await istiod.handle(resp) is None
            config = istiod.effective()["EnvoyFilter/ml/meshcache-blue"]["spec"]["configPatches"][0]
            assert json.loads(config["patch"]["value"]["typed_config"]["config"]["configuration"]["value"])[
                "policies"] == []
            with pytest.raises(asyncio.TimeoutError):
                await istiod.recv(timeout=0.5)  # ACKed: nothing more until the next change
            [p] = _proxies(cp)
            assert p["node_id"] == "istiod-0" and p["last_nack"] is None
            assert p["role"] == "config-client" and p["acked_version"] == "2"  # the snapshot, not "empty"
            assert not istiod.state[WASM_PLUGIN_TYPE_URL] and not istiod.state[TRAFFIC_EXTENSION_TYPE_URL]
            await istiod.close()

    run(scenario())


def test_basic_mode_serves_traffic_extensions(start_cp: Callable[..., ControlPlaneProc]) -> None:
    cp = start_cp(extra_env=_env(mode="basic", colors="blue"))

    async def scenario() -> None:
        assert cp.client().put("/v1/policies/bert", json={"ttl_s": 42}).status_code == 200
        async with grpc.aio.insecure_channel(f"127.0.0.1:{cp.xds_port}") as ch:
            istiod = IstiodLikeClient(ch)
            await istiod.start()
            await istiod.sync()
            [(name, obj)] = istiod.effective().items()
            assert name == "TrafficExtension/ml/meshcache-blue" and not istiod.errors
            assert obj["spec"] == _expected(extensions.traffic_extension, cp, "blue")
            wasm = obj["spec"]["wasm"]
            assert (wasm["url"], wasm["sha256"], wasm["failStrategy"]) == (URL, DIGEST, "FAIL_OPEN")
            assert wasm["pluginConfig"]["hold_headers"] is False and wasm["pluginConfig"]["color"] == "blue"
            assert (obj["spec"]["phase"], obj["spec"]["priority"]) == ("STATS", -1000)
            assert not istiod.state[ENVOY_FILTER_TYPE_URL]
            await istiod.close()

    run(scenario())


def test_undecodable_objects_are_nacked_and_not_resent(start_cp: Callable[..., ControlPlaneProc],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # An istiod that does not know the body type (as 1.30 would not know a WasmPlugin-shaped body
    # under EnvoyFilter): with nack_invalid the server's NACK path runs.
    monkeypatch.setattr(istiod_client, "BODIES", {})
    cp = start_cp(extra_env=_env())

    async def scenario() -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{cp.xds_port}") as ch:
            istiod = IstiodLikeClient(ch, [ENVOY_FILTER_TYPE_URL], nack_invalid=True)
            await istiod.start()
            assert await istiod.handle(await istiod.recv()) is None  # version 0: empty, fine
            cp.client().put("/v1/policies/bert", json={"ttl_s": 42})
            error = await istiod.handle(await istiod.recv())
            assert error is not None and "no Istio kind" in error
            nack = await aeventually(lambda: _proxies(cp)[0]["last_nack"])
            assert nack["version"] == "1" and "no Istio kind" in nack["error"]
            with pytest.raises(asyncio.TimeoutError):
                await istiod.recv(timeout=0.5)  # the rejected version is not re-sent
            cp.client().put("/v1/policies/gpt", json={"ttl_s": 1})
            assert (await istiod.recv()).version_info == "2"  # the next snapshot is pushed as usual
            await istiod.close()

    run(scenario())


# ---- the renderer and the wire format, in process ----------------------------------------------

def _snapshot() -> Snapshot:
    return Snapshot(version=5, created_at=1_700_000_000.5, policies=(
        Policy(model_prefix="m", ttl_s=10, max_ttl_s=10, generation=5),))


def test_field_numbers_on_the_wire_are_istios() -> None:
    """Tags from istio/api 1.30.3: TrafficExtension selector 1, phase 3, priority 4 (Int32Value),
    match 5, wasm 6; WasmConfig url 1, sha256 2, plugin_config 6, plugin_name 7, fail_strategy 8,
    type 10; EnvoyFilter workload_selector 3, config_patches 4, priority 5; FAIL_OPEN = 1,
    STATS = 3, SERVER = 2, HTTP_FILTER = 4, INSERT_BEFORE = 4, EXTENSION_CONFIG = 9."""
    def te(**fields: object) -> bytes:
        return json_format.ParseDict(fields, traffic_extension_pb2.TrafficExtension()).SerializeToString()

    def ef(**fields: object) -> bytes:
        return json_format.ParseDict(fields, envoy_filter_pb2.EnvoyFilter()).SerializeToString()

    assert te(selector={"matchLabels": {"a": "b"}}) == b"\x0a\x08\x0a\x06\x0a\x01a\x12\x01b"
    assert te(phase="STATS") == b"\x18\x03"
    assert te(priority=-1) == b"\x22\x0b\x08" + b"\xff" * 9 + b"\x01"
    assert te(match=[{"mode": "SERVER", "ports": [{"number": 8001}]}]) == b"\x2a\x07\x08\x02\x12\x03\x08\xc1\x3e"
    assert te(wasm={"url": "u"}) == b"\x32\x03\x0a\x01u"
    assert te(wasm={"sha256": "s", "pluginName": "p", "failStrategy": "FAIL_OPEN", "type": "HTTP"}) == \
        b"\x32\x0a\x12\x01s\x3a\x01p\x40\x01\x50\x01"
    assert te(wasm={"pluginConfig": {}}) == b"\x32\x02\x32\x00"
    assert ef(workloadSelector={"labels": {"a": "b"}}) == b"\x1a\x08\x0a\x06\x0a\x01a\x12\x01b"
    assert ef(priority=10) == b"\x28\x0a"
    assert ef(configPatches=[{"applyTo": "EXTENSION_CONFIG"}]) == b"\x22\x02\x08\x09"
    assert ef(configPatches=[{"applyTo": "HTTP_FILTER", "match": {"context": "SIDECAR_INBOUND", "listener": {
        "portNumber": 8001}}, "patch": {"operation": "INSERT_BEFORE"}}]) == \
        b"\x22\x0f\x08\x04\x12\x07\x08\x01\x1a\x03\x08\xc1\x3e\x1a\x02\x08\x04"


@pytest.mark.parametrize("mode", extensions.MODES)
def test_every_served_object_decodes_with_istios_numbers(mode: str) -> None:
    """Whole objects: our protos' bytes, read back with the independent tables, give the spec."""
    module = "/var/lib/meshcache/modules/libmeshcache_native-envoy-1.39.so"
    settings = Settings(istio_wasm_url=URL, istio_wasm_sha256=DIGEST, istio_color="blue", istio_mode=mode,
                        istio_namespace="ml", istio_revision="1-30", istio_native_module=module)
    renderer = IstioMcpRenderer.from_settings(settings)
    assert renderer is not None
    snap = _snapshot()
    served = renderer.resources(snap)
    # Full and native modes add the callers' client-role EnvoyFilter (cache affinity); basic has none.
    assert list(served) == (["ml/meshcache-blue"] if mode == "basic" else ["ml/meshcache-blue", "ml/meshcache-client"])
    assert renderer.resources(snap) is served
    config = snap.plugin_config()
    if mode == "native":
        specs = {"ml/meshcache-blue": extensions.native_envoy_filter(color="blue", module_path=module,
                                                                      plugin_config=config),
                 "ml/meshcache-client": extensions.native_client_envoy_filter(module_path=module, plugin_config=config)}
    else:
        build = extensions.envoy_filter if mode == "full" else extensions.traffic_extension
        specs = {"ml/meshcache-blue": build(color="blue", url=URL, sha256=DIGEST, plugin_config=config),
                 "ml/meshcache-client": extensions.client_envoy_filter(url=URL, sha256=DIGEST, plugin_config=config)}
    for name, packed in served.items():
        res = wire.decode("Resource", packed.value)
        meta = res["metadata"]
        assert (meta["name"], meta["version"].split("-")[0], meta["labels"]["istio.io/rev"]) == (name, "5", "1-30")
        assert meta["createTime"]["seconds"] == 1_700_000_000
        schema, _ = istiod_client.BODIES[res["body"]["typeUrl"]]
        assert wire.decode(schema, res["body"]["value"]) == specs[name]["spec"]
    assert renderer.resources(EMPTY) == {}


def test_the_resource_version_changes_with_the_spec_not_only_with_the_snapshot() -> None:
    """istiod replaces a stored MCP object only when its version changes: a control plane rolled
    out with another module pin (same policies, same snapshot) must serve a new version, and the
    same settings the same one (no push for a restart that changes nothing)."""
    def versions(url: str, sha256: str) -> dict[str, str]:
        renderer = IstioMcpRenderer.from_settings(Settings(istio_wasm_url=url, istio_wasm_sha256=sha256,
                                                           istio_color="blue", istio_namespace="ml"))
        assert renderer is not None
        return {name: wire.decode("Resource", packed.value)["metadata"]["version"]
                for name, packed in renderer.resources(_snapshot()).items()}

    pinned = versions(URL, DIGEST)
    assert pinned == versions(URL, DIGEST)
    other = versions(URL.replace(DIGEST, "0" * 64), "0" * 64)
    assert set(other) == set(pinned) and all(other[n] != pinned[n] for n in pinned), (other, pinned)
    assert all(v.startswith("5-") for v in [*pinned.values(), *other.values()])


def test_bad_settings_fail_at_startup() -> None:
    assert IstioMcpRenderer.from_settings(Settings()) is None  # no URL: nothing served
    with pytest.raises(ValueError, match="sha256"):
        IstioMcpRenderer.from_settings(Settings(istio_wasm_url="https://x/f.wasm", istio_wasm_sha256="",
                                                istio_module_path="/nonexistent"))


def test_local_mesh_ecds_is_the_envoy_filters_extension_config() -> None:
    """The control plane's ECDS resource for local sidecars and the full-mode EXTENSION_CONFIG come
    from one builder: after istio-agent's rewrite (remote code -> the fetched file) they are equal."""
    snap = _snapshot()
    module = FILTER_WASM
    ef = extensions.envoy_filter(color="", url=URL, sha256=DIGEST, plugin_config=snap.plugin_config())
    ext = ef["spec"]["configPatches"][0]["patch"]["value"]
    ext["typed_config"]["config"]["vm_config"]["code"] = local_code(module)  # what the agent does
    local = json_format.MessageToDict(EcdsRenderer(module).typed_extension_config(snap),
                                      preserving_proto_field_name=True)
    assert local == ext


def test_fallback_answers_istio_types_only() -> None:
    assert isinstance(mcp_fallback("networking.istio.io/v1/VirtualService"), EmptyMcpRenderer)
    assert isinstance(mcp_fallback("core/v1alpha1/MeshConfig"), EmptyMcpRenderer)
    assert isinstance(mcp_fallback(WASM_PLUGIN_TYPE_URL), EmptyMcpRenderer)
    assert mcp_fallback("type.googleapis.com/envoy.config.cluster.v3.Cluster") is None
    assert mcp_fallback("not a type") is None
