"""fleet.py against a real redis-server: two replicas' proxy lists merged, one entry per node id,
a stopped replica's list withdrawn, Redis down = this replica's proxies only."""

from __future__ import annotations

from pathlib import Path

from meshcache.control_plane.fleet import FleetView
from meshcache.control_plane.proxy_registry import ProxyRegistry
from meshcache.control_plane.settings import Settings
from meshcache.control_plane.store import Store
from meshcache.ctl import procs
from tests.helpers.control_plane import run


def test_replicas_see_each_others_proxies(tmp_path: Path, redis_server: tuple[procs.Proc, int]) -> None:
    settings = Settings(redis_url=f"redis://127.0.0.1:{redis_server[1]}/0", redis_timeout_s=0.5)

    async def scenario() -> None:
        stores = [Store(settings), Store(settings)]
        regs = [ProxyRegistry(), ProxyRegistry()]
        a, b = (FleetView(s, r, f"r{i}", 0.2) for i, (s, r) in enumerate(zip(stores, regs, strict=True)))
        on_a = regs[0].open("ecds", "peer-1")
        on_a.node_id = "envoy-1"
        on_a.acked["t"] = ("3", 1.0)
        moved = regs[0].open("ecds", "peer-2")  # envoy-2's old stream, on a replica it left
        moved.node_id = "envoy-2"
        await a.publish_once()
        on_b = regs[1].open("ecds", "peer-2")
        on_b.node_id = "envoy-2"
        on_b.connected_since = moved.connected_since + 1
        await b.publish_once()

        entries, complete = await b.all()
        assert complete
        by_node = {e["node_id"]: e for e in entries}
        assert sorted(by_node) == ["envoy-1", "envoy-2"]  # envoy-2 once: its newest connection
        assert by_node["envoy-1"]["replica"] == "r0" and by_node["envoy-1"]["acked_version"] == "3"
        assert by_node["envoy-2"]["replica"] == "r1"

        # An ACK changes the registry: published on the next round.
        on_a.acked["t"] = ("4", 2.0)
        on_a.touch()
        await a.publish_once()
        assert {e["node_id"]: e["acked_version"] for e in (await b.all())[0]}["envoy-1"] == "4"

        # Another replica's list that is not what this release writes: left out, said so, no error.
        await stores[0].redis.set(f"{stores[0].proxies_prefix}r0", b'{"not": "a list"}')
        entries, complete = await b.all()
        assert not complete and [e["node_id"] for e in entries] == ["envoy-2"]
        await a.withdraw()  # a clean stop: gone at once
        assert [e["node_id"] for e in (await b.all())[0]] == ["envoy-2"]

        redis_server[0].kill()
        entries, complete = await b.all()
        assert not complete and [e["node_id"] for e in entries] == ["envoy-2"]
        for s in stores:
            await s.close()

    run(scenario())
