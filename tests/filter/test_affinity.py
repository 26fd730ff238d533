"""Cache-affinity routing through real Envoys: client sidecars run the filter in the client role
and hash on its routing key over three server sidecars (each its own cache, strict mTLS), all in
front of one real origin. Which replica served a request shows in that replica's own counters.
Every test runs with both hosts of the cache core (conftest.py): the sidecars' filter is the Wasm
filter or the native module."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import ssl
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from meshcache.contract.filter_config import client_plugin_config
from meshcache.contract.headers import ROUTE_KEY_HEADER
from meshcache.contract.paths import FILTER_NATIVE, FILTER_WASM
from meshcache.ctl import launchers, procs
from meshcache.ctl.envoy_config import Affinity, CacheProxy, ClientSidecar, write
from meshcache.ctl.pki import CertificateAuthority, Identity, spiffe_id
from tests.filter.stack import METRICS_FLUSH_S, config, policy
from tests.helpers.filter_stats import filter_counter, filter_stats, filter_stats_reaching
from tests.helpers.wait import eventually

REPLICAS = 3
SERVER_ID = spiffe_id("ml", "engine")
ALICE, BOB = spiffe_id("team-a", "app"), spiffe_id("team-b", "app")
CONFIG = config(policy("m"), policy("private", scope="principal"))
URL = "/v2/models/m/infer"


@dataclass
class Replica:
    port: int
    admin: int


@dataclass
class Mesh:
    tmp: Path
    replicas: list[Replica]
    ca: CertificateAuthority
    identities: dict[str, Identity]
    origin_port: int
    started: list[procs.Proc]
    client_admins: dict[str, int]
    host: str = "wasm"
    # One test's view of the module's replicas (the `mesh` fixture): its request bodies start at
    # `first_input`, and the counts it reads are since it began.
    first_input: int = 0
    replicas_before: list[dict[str, int]] = field(default_factory=list)
    origin_before: int = 0
    tests: int = 0

    def body(self, i: int) -> str:
        """The test's `i`th distinct request body (no other test of the module sends it)."""
        n = self.first_input + i
        return json.dumps({"inputs": [{"name": "x", "datatype": "INT32", "shape": [1], "data": [n]}]})

    def client_sidecar(self, who: str, replicas: list[Replica] | None = None, affinity: bool = True,
                       lb_policy: str = "RING_HASH") -> str:
        """A client sidecar as `who` (alice or bob) in front of `replicas` (default all); its URL."""
        listen, admin = procs.free_port(), procs.free_port()
        sidecar = ClientSidecar(
            listen_port=listen, admin_port=admin, server_ports=[r.port for r in replicas or self.replicas],
            identity=self.identities[who], server_identities=[SERVER_ID], color="",
            node_id=f"client-{who}-{listen}",
            affinity=Affinity(FILTER_WASM, client_plugin_config(CONFIG), lb_policy=lb_policy,
                              native_module=FILTER_NATIVE if self.host == "native" else None) if affinity else None)
        d = self.tmp / f"client-{listen}"
        d.mkdir()
        self.started.append(launchers.start_envoy(write(sidecar, d / "envoy.yaml"), admin, d))
        url = f"http://127.0.0.1:{listen}"
        self.client_admins[url] = admin
        return url

    def routed(self, client: str, expected: int) -> None:
        """Waits until the client sidecar's filter has given `expected` requests a routing key."""
        if expected == 0:
            # Nothing to wait for: let the requests sent so far reach Envoy's counters first.
            time.sleep(METRICS_FLUSH_S)
            assert filter_counter(self.client_admins[client], "meshcache.routed") == 0
            return
        filter_stats_reaching(self.client_admins[client], {"meshcache.routed": expected})

    def per_replica(self, what: str, total: int) -> list[int]:
        """`meshcache.<what>` of each replica since the test began, once they add up to `total`
        (the filter flushes its counters every 200 ms)."""
        name = f"meshcache.{what}"

        def added_up() -> list[int] | None:
            counts = [filter_counter(r.admin, name) - before.get(name, 0)
                      for r, before in zip(self.replicas, self.replicas_before, strict=True)]
            assert sum(counts) == total, f"{what} {counts}: not {total} in all"
            return counts
        return eventually(added_up)

    def origin_calls(self) -> int:
        """HTTP requests the origin served since the test began."""
        return self._origin_total() - self.origin_before

    def _origin_total(self) -> int:
        return int(procs.local_http().get(f"http://127.0.0.1:{self.origin_port}/calls", timeout=5).json()["http"])


@contextlib.contextmanager
def affinity_mesh(tmp: Path, host: str = "wasm") -> Iterator[Mesh]:
    ca = CertificateAuthority.create()
    pki = tmp / "pki"
    server = ca.issue(SERVER_ID, pki, "server")
    identities = {"alice": ca.issue(ALICE, pki, "alice"), "bob": ca.issue(BOB, pki, "bob")}
    started: list[procs.Proc] = []
    with procs.supervised(started):
        http_port, grpc_port = procs.free_port(), procs.free_port()
        origin = procs.start("origin", [sys.executable, "-m", "tests.filter.origin", "--http-port", str(http_port),
                                        "--grpc-port", str(grpc_port)], tmp)
        started.append(origin)
        procs.wait_until(origin, procs.tcp_open(http_port))
        replicas = []
        for i in range(REPLICAS):
            port, admin = procs.free_port(), procs.free_port()
            proxy = CacheProxy(listen_port=port, admin_port=admin, http_upstream_port=http_port,
                               grpc_upstream_port=grpc_port, wasm_path=FILTER_WASM, plugin_config=CONFIG,
                               downstream_tls=server, allowed_peers=[ALICE, BOB], node_id=f"replica-{i}",
                               native_module=FILTER_NATIVE if host == "native" else None)
            d = tmp / f"replica-{i}"
            d.mkdir()
            started.append(launchers.start_envoy(write(proxy, d / "envoy.yaml"), admin, d))
            replicas.append(Replica(port, admin))
        yield Mesh(tmp, replicas, ca, identities, http_port, started, {}, host)


@pytest.fixture(scope="module")
def module_meshes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Mesh]]:
    """The module's replicas and origin, one set per host, started when a test first asks for it."""
    with contextlib.ExitStack() as stack:
        yield _LazyMeshes(stack, tmp_path_factory)


class _LazyMeshes(dict[str, Mesh]):
    def __init__(self, stack: contextlib.ExitStack, factory: pytest.TempPathFactory) -> None:
        super().__init__()
        self.stack, self.factory = stack, factory

    def __missing__(self, host: str) -> Mesh:
        self[host] = self.stack.enter_context(affinity_mesh(self.factory.mktemp(f"affinity-{host}"), host))
        return self[host]


@pytest.fixture
def mesh(module_meshes: dict[str, Mesh], host: str, tmp_path: Path) -> Iterator[Mesh]:
    """The module's replicas and origin for one test: its own client sidecars (stopped after it),
    its own request bodies, and counts since it began."""
    module_mesh = module_meshes[host]
    # The last requests of the test before may not have reached the replicas' counters yet (the
    # filter flushes every 200 ms) and there is no count to wait for: give them one flush.
    time.sleep(METRICS_FLUSH_S)
    module_mesh.tests += 1
    m = dataclasses.replace(module_mesh, tmp=tmp_path, started=[], client_admins={},
                            first_input=module_mesh.tests * 1000,
                            replicas_before=[filter_stats(r.admin) for r in module_mesh.replicas],
                            origin_before=module_mesh._origin_total())
    with procs.supervised(m.started):
        yield m


def post(base: str, body: str, headers: dict[str, str] | None = None, url: str = URL) -> httpx.Response:
    r = procs.local_http().post(base + url, content=body,
                                headers={"content-type": "application/json", **(headers or {})}, timeout=10)
    assert r.status_code == 200, r.text
    return r


def test_identical_requests_from_several_clients_land_on_one_replica_and_hit(mesh: Mesh) -> None:
    alice, bob = mesh.client_sidecar("alice"), mesh.client_sidecar("bob")
    first = post(alice, mesh.body(1))
    assert first.headers["cache-status"] == "meshcache; fwd=miss; stored"
    for base in (alice, bob, alice, bob):
        assert post(base, mesh.body(1)).headers["cache-status"].startswith("meshcache; hit")
    assert mesh.origin_calls() == 1
    stores, hits = mesh.per_replica("stores", 1), mesh.per_replica("hits", 4)
    assert sorted(stores) == [0, 0, 1] and sorted(hits) == [0, 0, 4]
    assert stores.index(1) == hits.index(4)  # all on the replica that stored it
    # The origin never sees a routing key: the server sidecar removed it.
    assert "route_keys" not in first.json()


def test_keys_spread_over_replicas_and_repeat_where_they_are(mesh: Mesh) -> None:
    alice, bob = mesh.client_sidecar("alice"), mesh.client_sidecar("bob")
    n = 60
    for i in range(n):
        assert post(alice, mesh.body(i)).headers["cache-status"] == "meshcache; fwd=miss; stored"
    stores = mesh.per_replica("stores", n)
    assert min(stores) >= 8, stores  # each replica owns a share of the keys
    for i in range(n):
        assert post(bob, mesh.body(i)).headers["cache-status"].startswith("meshcache; hit"), i
    assert mesh.per_replica("hits", n) == stores  # every key hit on the replica holding it
    assert mesh.origin_calls() == n
    mesh.per_replica("entries", n)  # one copy of each answer in the mesh


@pytest.mark.parametrize("lb_policy", ["RING_HASH", "MAGLEV"])
def test_removing_a_replica_moves_mostly_its_keys(mesh: Mesh, lb_policy: str) -> None:
    alice = mesh.client_sidecar("alice", lb_policy=lb_policy)
    n = 90
    for i in range(n):
        post(alice, mesh.body(i))
    stores = mesh.per_replica("stores", n)
    gone = stores.index(max(stores))
    remaining = [r for i, r in enumerate(mesh.replicas) if i != gone]
    # The same client after the replica left its cluster (a new sidecar config with two endpoints).
    smaller = mesh.client_sidecar("alice", replicas=remaining, lb_policy=lb_policy)
    statuses = [post(smaller, mesh.body(i)).headers["cache-status"] for i in range(n)]
    moved = sum(not s.startswith("meshcache; hit") for s in statuses)  # a key that moved misses
    # Every key of the removed replica moved; of the others, only a few: Envoy re-spreads the ring
    # (or Maglev table) over fewer hosts, so a little more than the removed share moves.
    assert moved >= stores[gone]
    print(f"{lb_policy}: removed replica held {stores[gone]}/{n}, moved {moved}/{n}")
    # The issue's bound (share moved <= 1.5/N), taken relative to the removed replica's own share
    # (the busiest one here): keys of staying replicas that moved are at most half a fair share.
    assert moved - stores[gone] <= 0.5 * n / REPLICAS, (moved, stores)
    assert mesh.origin_calls() == n + moved


def test_forged_routing_keys_are_harmless(mesh: Mesh) -> None:
    alice = mesh.client_sidecar("alice")
    assert post(alice, mesh.body(7)).headers["cache-status"] == "meshcache; fwd=miss; stored"
    where = mesh.per_replica("stores", 1)
    # Through the client sidecar: the app's key is replaced by the filter's own.
    for forged in ("0" * 32, "f" * 32, "x"):
        r = post(alice, mesh.body(7), {ROUTE_KEY_HEADER: forged})
        assert r.headers["cache-status"].startswith("meshcache; hit")
    assert mesh.per_replica("hits", 3) == [3 * s for s in where]
    # Straight to a server sidecar: a forged key neither changes its cache key nor reaches the origin.
    replica = mesh.replicas[where.index(1)]
    ctx = ssl.create_default_context(cafile=str(mesh.identities["alice"].ca))
    ctx.load_cert_chain(str(mesh.identities["alice"].cert), str(mesh.identities["alice"].key))
    with httpx.Client(verify=ctx) as direct:
        url = f"https://localhost:{replica.port}{URL}"
        hdrs = {"content-type": "application/json", ROUTE_KEY_HEADER: "forged"}
        assert direct.post(url, content=mesh.body(7), headers=hdrs).headers["cache-status"].startswith("meshcache; hit")
        miss = direct.post(url, content=mesh.body(8), headers=hdrs)
        assert miss.headers["cache-status"] == "meshcache; fwd=miss; stored"
        assert "route_keys" not in miss.json()
        # Same key with or without the forged header: the answer stored above serves a clean request.
        clean = direct.post(url, content=mesh.body(8), headers={"content-type": "application/json"})
        assert clean.headers["cache-status"].startswith("meshcache; hit")


def test_requests_the_server_bypasses_get_no_key_and_balance(mesh: Mesh) -> None:
    alice = mesh.client_sidecar("alice")
    for _ in range(30):
        # Credentials on a shared policy: the server bypasses, so the client gives no key.
        r = post(alice, mesh.body(3), {"authorization": "Bearer t"})
        assert r.headers["cache-status"] == "meshcache; fwd=bypass; detail=credentials"
    bypasses = mesh.per_replica("bypasses", 30)
    assert sum(b > 0 for b in bypasses) >= 2, bypasses  # balanced, not pinned
    for _ in range(3):
        post(alice, mesh.body(3), url="/v2/models/nopolicy/infer")  # no policy: not cached, not keyed
    mesh.routed(alice, 0)
    post(alice, mesh.body(3))
    mesh.routed(alice, 1)
    assert mesh.origin_calls() == 34


def test_principal_scope_keeps_entries_per_caller_on_one_replica(mesh: Mesh) -> None:
    alice, bob = mesh.client_sidecar("alice"), mesh.client_sidecar("bob")
    url = "/v2/models/private/infer"
    hdrs = {"authorization": "Bearer x"}
    assert post(alice, mesh.body(5), hdrs, url).headers["cache-status"] == "meshcache; fwd=miss; stored"
    assert post(bob, mesh.body(5), hdrs, url).headers["cache-status"] == "meshcache; fwd=miss; stored"
    assert post(alice, mesh.body(5), hdrs, url).headers["cache-status"].startswith("meshcache; hit")
    assert post(bob, mesh.body(5), hdrs, url).headers["cache-status"].startswith("meshcache; hit")
    # Two entries (one per caller), both on the one replica the answer's key routes to.
    assert sorted(mesh.per_replica("stores", 2)) == [0, 0, 2] and sorted(mesh.per_replica("hits", 2)) == [0, 0, 2]


def test_colours_are_separate_entries_each_on_its_replica(mesh: Mesh) -> None:
    alice = mesh.client_sidecar("alice")
    seen: dict[str, Any] = {}
    for color in ("green", "blue", "green", "blue"):
        r = post(alice, mesh.body(9), {"x-traffic-color": color})
        assert r.json()["colors"] == [color]  # an answer never crosses colours
        seen.setdefault(color, []).append(r.headers["cache-status"])
    for color, statuses in seen.items():
        assert statuses[0] == "meshcache; fwd=miss; stored" and statuses[1].startswith("meshcache; hit"), color
    mesh.per_replica("stores", 2)
    mesh.per_replica("hits", 2)


def test_maglev_routes_by_the_key_too(mesh: Mesh) -> None:
    alice = mesh.client_sidecar("alice", lb_policy="MAGLEV")
    for _ in range(4):
        post(alice, mesh.body(11))
    assert sorted(mesh.per_replica("hits", 3)) == [0, 0, 3]


def test_bodies_too_big_to_key_pass_unkeyed(mesh: Mesh) -> None:
    alice = mesh.client_sidecar("alice")
    big = json.dumps({"inputs": [{"name": "x", "datatype": "BYTES", "shape": [1], "data": ["a" * 800_000]}]})
    for _ in range(3):
        r = post(alice, big)  # over the filter's 768 KiB request cap: neither side buffers it whole
        assert r.headers["cache-status"] == "meshcache; fwd=bypass; detail=too-big" and len(r.content) > 0
    mesh.routed(alice, 0)
    assert mesh.origin_calls() == 3
