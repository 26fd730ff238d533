"""MCP-over-xDS for istiod against a real control-plane process: full state per type, the
WasmPlugin re-sent on every policy change, empty answers for other types, ACK and NACK."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import grpc
import pytest
from google.protobuf import json_format

from control_plane.mcp import WASM_PLUGIN_TYPE_URL, EmptyMcpRenderer, WasmPluginMcpRenderer, mcp_fallback
from control_plane.models import Policy
from control_plane.snapshots import EMPTY, Snapshot
from meshcache.istio import render
from meshcache.protos.istio.extensions.v1alpha1 import wasm_pb2
from tests.control_plane.helpers import ControlPlaneProc, aeventually, run
from tests.istio.istiod_client import IstiodLikeClient

DIGEST = "c0ffee" + "0" * 58
URL = f"oci://registry.example.com/meshcache/filter@sha256:{DIGEST}"
OTHER_TYPES = ["networking.istio.io/v1/VirtualService", "security.istio.io/v1/PeerAuthentication",
               "core/v1alpha1/MeshConfig"]
TYPES = [WASM_PLUGIN_TYPE_URL, *OTHER_TYPES]


def _env(url: str = URL) -> dict[str, str]:
    return {"MESHCACHE_CP_ISTIO_WASM_URL": url, "MESHCACHE_CP_ISTIO_WASM_SHA256": DIGEST,
            "MESHCACHE_CP_ISTIO_NAMESPACE": "ml", "MESHCACHE_CP_ISTIO_COLOR": "green"}


def _proxies(cp: ControlPlaneProc) -> list[dict]:
    return cp.client().get("/v1/proxies").json()["proxies"]  # type: ignore[no-any-return]


def test_istiod_syncs_then_gets_the_wasm_plugin_on_every_change(start_cp: Callable[..., ControlPlaneProc]) -> None:
    cp = start_cp(extra_env=_env())

    async def scenario() -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{cp.xds_port}") as ch:
            istiod = IstiodLikeClient(ch, TYPES)
            await istiod.start()
            # Before any policy: every subscribed type is answered (istiod's HasSynced), empty.
            first = {}
            for _ in TYPES:
                resp = await istiod.recv()
                assert await istiod.handle(resp) is None
                first[resp.type_url] = resp
            assert set(first) == set(TYPES) and all(not r.resources for r in first.values())

            assert cp.client().put("/v1/policies/bert", json={"ttl_s": 42}).status_code == 200
            resp = await istiod.recv()
            # Only the WasmPlugin changes; the other types are not re-sent.
            assert (resp.type_url, resp.version_info, len(resp.resources)) == (WASM_PLUGIN_TYPE_URL, "1", 1)
            assert await istiod.handle(resp) is None
            plugin = istiod.state[WASM_PLUGIN_TYPE_URL]["ml/meshcache"]
            snapshot = json.loads(cp.client().get("/v1/snapshot").json()["plugin_config"])
            assert plugin["spec"]["pluginConfig"] == {**snapshot, "color": "green", "hold_headers": False}
            assert plugin["spec"]["selector"]["matchLabels"] == {"app": "meshcache-engine", "color": "green"}
            assert (plugin["spec"]["url"], plugin["spec"]["sha256"]) == (URL, DIGEST)
            assert (plugin["spec"]["failStrategy"], plugin["spec"]["phase"], plugin["spec"]["priority"]) == \
                ("FAIL_OPEN", "STATS", -100)
            assert plugin["spec"]["match"] == [{"mode": "SERVER", "ports": [{"number": 8000}, {"number": 8001}]}]
            assert plugin["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "meshcache-control-plane"
            await aeventually(lambda: any(WASM_PLUGIN_TYPE_URL in p["type_urls"] for p in _proxies(cp)))

            # Every change re-sends the full state (one plugin, the new config).
            assert cp.client().delete("/v1/policies/bert").status_code == 200
            resp = await istiod.recv()
            assert (resp.type_url, resp.version_info, len(resp.resources)) == (WASM_PLUGIN_TYPE_URL, "2", 1)
            assert await istiod.handle(resp) is None
            assert istiod.state[WASM_PLUGIN_TYPE_URL]["ml/meshcache"]["spec"]["pluginConfig"]["policies"] == []
            with pytest.raises(asyncio.TimeoutError):
                await istiod.recv(timeout=0.5)  # ACKed: nothing more until the next change
            [p] = _proxies(cp)
            assert p["node_id"] == "istiod-0" and p["last_nack"] is None
            await istiod.close()

    run(scenario())


def test_bad_plugin_is_nacked_and_not_resent(start_cp: Callable[..., ControlPlaneProc]) -> None:
    cp = start_cp(extra_env=_env(url="ftp://example.com/filter.wasm"))

    async def scenario() -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{cp.xds_port}") as ch:
            istiod = IstiodLikeClient(ch, [WASM_PLUGIN_TYPE_URL])
            await istiod.start()
            assert await istiod.handle(await istiod.recv()) is None  # version 0: empty, fine
            cp.client().put("/v1/policies/bert", json={"ttl_s": 42})
            resp = await istiod.recv()
            error = await istiod.handle(resp)
            assert error is not None and "scheme" in error
            assert WASM_PLUGIN_TYPE_URL not in istiod.state or not istiod.state[WASM_PLUGIN_TYPE_URL]
            nack = await aeventually(lambda: _proxies(cp)[0]["last_nack"])
            assert nack["version"] == "1" and "scheme" in nack["error"]
            with pytest.raises(asyncio.TimeoutError):
                await istiod.recv(timeout=0.5)  # the rejected version is not re-sent
            cp.client().put("/v1/policies/gpt", json={"ttl_s": 1})
            resp = await istiod.recv()
            assert resp.version_info == "2"  # the next snapshot is pushed as usual
            await istiod.close()

    run(scenario())


# ---- the renderer and the wire format, in process ----------------------------------------------

def _snapshot() -> Snapshot:
    return Snapshot(version=5, created_at=1_700_000_000.5, policies=(
        Policy(model_prefix="m", ttl_s=10, max_ttl_s=10, generation=5),))


def test_field_numbers_on_the_wire_are_istios() -> None:
    """Tags from the notes (istio/api wasm.proto): url 2, sha256 3, pluginName 8, phase 9,
    priority 10, match 12, failStrategy 13; FAIL_OPEN = 1, STATS = 3, SERVER = 2."""
    def wire(**fields: object) -> bytes:
        return json_format.ParseDict(fields, wasm_pb2.WasmPlugin()).SerializeToString()
    assert wire(url="u") == b"\x12\x01u"
    assert wire(sha256="s") == b"\x1a\x01s"
    assert wire(pluginName="p") == b"\x42\x01p"
    assert wire(phase="STATS") == b"\x48\x03"
    assert wire(priority=5) == b"\x52\x02\x08\x05"
    assert wire(failStrategy="FAIL_OPEN") == b"\x68\x01"
    assert wire(match=[{"mode": "SERVER"}]) == b"\x62\x02\x08\x02"
    assert wire(selector={"matchLabels": {"a": "b"}}) == b"\x0a\x08\x0a\x06\x0a\x01a\x12\x01b"


def test_renderer_output() -> None:
    r = WasmPluginMcpRenderer("ml", URL, DIGEST, color="blue", revision="1-30")
    assert r.resources(EMPTY) == {}
    snap = _snapshot()
    [(name, packed)] = r.resources(snap).items()
    assert name == "ml/meshcache" and r.resources(snap) is r.resources(snap)  # rendered once per snapshot
    assert packed.type_url == "type.googleapis.com/istio.mcp.v1alpha1.Resource"
    res = r.mcp_resource(_snapshot())
    assert (res.metadata.name, res.metadata.version) == ("ml/meshcache", "5")
    assert res.metadata.create_time.seconds == 1_700_000_000 and res.metadata.labels["istio.io/rev"] == "1-30"
    plugin = wasm_pb2.WasmPlugin()
    assert res.body.Unpack(plugin)
    expected = {**_snapshot().plugin_config(), "color": "blue", "hold_headers": False}
    assert json_format.MessageToDict(plugin.plugin_config) == expected
    # The same spec as the rendered manifests.
    spec = json_format.MessageToDict(plugin)
    rendered = render.wasm_plugin_spec(url=URL, sha256=DIGEST, selector={"app": "meshcache-engine", "color": "blue"},
                                       plugin_config={**_snapshot().plugin_config(), "color": "blue"})
    assert spec == rendered
    assert WasmPluginMcpRenderer("ml", "", DIGEST).resources(_snapshot()) == {}


def test_fallback_answers_istio_types_only() -> None:
    assert isinstance(mcp_fallback("networking.istio.io/v1/VirtualService"), EmptyMcpRenderer)
    assert isinstance(mcp_fallback("core/v1alpha1/MeshConfig"), EmptyMcpRenderer)
    assert mcp_fallback("type.googleapis.com/envoy.config.cluster.v3.Cluster") is None
    assert mcp_fallback("not a type") is None
