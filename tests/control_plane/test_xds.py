"""ECDS and ADS against a real control-plane process, with a Python xDS client on real gRPC."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from envoy.config.core.v3 import extension_pb2
from envoy.extensions.filters.http.wasm.v3 import wasm_pb2
from google.protobuf import json_format, wrappers_pb2

from meshcache.contract.paths import FILTER_WASM
from meshcache.contract.wasm_filter import FILTER_NAME, ROOT_ID, VM_ID, wasm_filter_config
from meshcache.control_plane.xds_client import XdsClient, plugin_config_of
from tests.helpers.control_plane import ControlPlaneProc, run
from tests.helpers.wait import aeventually


def proxies(cp: ControlPlaneProc) -> list[dict]:
    return cp.client().get("/v1/proxies").json()["proxies"]


def test_push_on_change_and_ack_tracking(cp: ControlPlaneProc) -> None:
    async def scenario() -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{cp.xds_port}") as ch:
            client = XdsClient(ch, "sidecar-1", cluster="web")
            await client.subscribe()
            # Never configured (version 0): nothing is pushed, Envoy keeps its default_config.
            with pytest.raises(asyncio.TimeoutError):
                await client.recv(timeout=0.5)
            assert cp.client().put("/v1/policies/llama", json={"ttl_s": 7}).status_code == 200
            resp = await client.recv()
            assert resp.version_info == "1" and resp.type_url.endswith("TypedExtensionConfig")
            tec = extension_pb2.TypedExtensionConfig()
            resp.resources[0].Unpack(tec)
            assert tec.name == FILTER_NAME
            wasm = wasm_pb2.Wasm()
            assert tec.typed_config.Unpack(wasm)
            vm = wasm.config.vm_config
            assert (wasm.config.root_id, vm.vm_id) == (ROOT_ID, VM_ID)
            assert vm.code.local.filename == str(FILTER_WASM)
            value = wrappers_pb2.StringValue()
            wasm.config.configuration.Unpack(value)
            plugin_config = cp.client().get("/v1/snapshot").json()["plugin_config"]
            assert value.value == plugin_config
            assert json.loads(value.value)["policies"][0]["ttl_s"] == 7
            # Exactly the shared definition of the filter config (so Envoy reuses the VM).
            expected = json_format.ParseDict(wasm_filter_config(FILTER_WASM, json.loads(plugin_config)),
                                             wasm_pb2.Wasm())
            assert wasm == expected
            # Before the ACK the proxy is connected but not current.
            p = proxies(cp)
            assert [(x["node_id"], x["cluster"], x["current"]) for x in p] == [("sidecar-1", "web", False)]
            await client.ack(resp)
            await aeventually(lambda: proxies(cp)[0]["current"])
            assert proxies(cp)[0]["acked_version"] == "1"
            cp.client().post("/v1/purge", json={"model_prefix": "llama"})
            resp = await client.recv()
            assert resp.version_info == "2"
            assert plugin_config_of(resp)["policies"][0]["generation"] == 2
            await client.ack(resp)
            await aeventually(lambda: proxies(cp)[0]["acked_version"] == "2")
            await client.close()
        await aeventually(lambda: proxies(cp) == [])  # disconnected streams leave the list

    run(scenario())


def test_nack_is_reported_and_not_resent(cp: ControlPlaneProc) -> None:
    async def scenario() -> None:
        cp.client().put("/v1/policies/m", json={"ttl_s": 1})
        async with grpc.aio.insecure_channel(f"127.0.0.1:{cp.xds_port}") as ch:
            client = XdsClient(ch, "sidecar-nack")
            await client.subscribe()
            await client.ack(await client.recv())
            cp.client().put("/v1/policies/m", json={"ttl_s": 2})
            resp = await client.recv()
            await client.nack(resp, "meshcache: invalid plugin configuration: ttl_s: nope")
            p = await aeventually(lambda: proxies(cp)[0]["last_nack"] and proxies(cp)[0])
            assert p["last_nack"]["version"] == "2" and "ttl_s: nope" in p["last_nack"]["error"]
            assert (p["acked_version"], p["current"]) == ("1", False)  # Envoy kept version 1
            with pytest.raises(asyncio.TimeoutError):  # the rejected version is not pushed again
                await client.recv(timeout=0.5)
            cp.client().put("/v1/policies/m", json={"ttl_s": 3})
            resp = await client.recv()
            assert resp.version_info == "3"
            await client.ack(resp)
            await aeventually(lambda: proxies(cp)[0]["current"])
            assert "cp_xds_nacks_total 1.0" in cp.client().get("/metrics").text
            await client.close()

    run(scenario())


def test_ads_and_reconnect_with_known_version(cp: ControlPlaneProc) -> None:
    async def scenario() -> None:
        cp.client().put("/v1/policies/m", json={"ttl_s": 1})
        async with grpc.aio.insecure_channel(f"127.0.0.1:{cp.xds_port}") as ch:
            ads = XdsClient(ch, "ads-node", ads=True)
            await ads.subscribe()
            resp = await ads.recv()
            assert resp.version_info == "1" and plugin_config_of(resp)["policies"][0]["model_prefix"] == "m"
            await ads.ack(resp)
            # Types this server does not render are ignored on ADS (no answer, stream stays up).
            other = XdsClient(ch, "ads-other", ads=True,
                              type_url="type.googleapis.com/envoy.config.cluster.v3.Cluster")
            await other.subscribe()
            with pytest.raises(asyncio.TimeoutError):
                await other.recv(timeout=0.3)
            # A reconnecting Envoy reports what it has; it shows as current right away.
            again = XdsClient(ch, "reconnected")
            await again.subscribe(version_info="1")
            p = await aeventually(lambda: [x for x in proxies(cp) if x["node_id"] == "reconnected"])
            assert p[0]["acked_version"] == "1" and p[0]["current"]
            for c in (ads, other, again):
                await c.close()

    run(scenario())


def test_many_streams_all_converge(cp: ControlPlaneProc) -> None:
    async def scenario() -> None:
        cp.client().put("/v1/policies/m", json={"ttl_s": 1})
        async with grpc.aio.insecure_channel(f"127.0.0.1:{cp.xds_port}") as ch:
            clients = [XdsClient(ch, f"n{i}") for i in range(100)]
            for c in clients:
                await c.subscribe()
            for c in clients:
                await c.ack(await c.recv())
            await asyncio.to_thread(cp.client().put, "/v1/policies/m", json={"ttl_s": 2})
            versions = await asyncio.gather(*(c.recv() for c in clients))
            assert {r.version_info for r in versions} == {"2"}
            for c, r in zip(clients, versions, strict=True):
                await c.ack(r)
            await aeventually(lambda: len(ps := proxies(cp)) == 100 and all(p["current"] for p in ps))
            for c in clients:
                await c.close()

    run(scenario())


def test_a_burst_of_2000_new_streams_is_served_whole(cp: ControlPlaneProc) -> None:
    """2,000 streams opened at once (a fleet reconnecting after a replica's loss): every one gets
    the snapshot. grpc core queues new RPCs until the Python loop takes them and, past its default
    soft limit of 1,000 pending, refuses some at random (the cliff of issue 25)."""
    cp.client().put("/v1/policies/m", json={"ttl_s": 1}).raise_for_status()

    async def scenario() -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{cp.xds_port}") as ch:
            clients = [XdsClient(ch, f"burst-{i}") for i in range(2000)]
            for c in clients:
                await c.subscribe()
            got = await asyncio.gather(*(c.recv(timeout=30) for c in clients), return_exceptions=True)
            failed = [g for g in got if isinstance(g, BaseException)]
            assert not failed, f"{len(failed)} of 2000 streams failed, e.g. {failed[0]!r}"
            assert {r.version_info for r in got} == {"1"}  # type: ignore[union-attr]
            for c in clients:
                await c.close()

    run(scenario())
