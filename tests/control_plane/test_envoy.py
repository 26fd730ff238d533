"""The control plane driving a real Envoy running the real filter over ECDS.

Stack per test: redis-server, the control-plane process, the test origin (tests/filter/origin.py)
and Envoy whose meshcache filter comes from ECDS with a static default_config. The sidecar runs
the Wasm filter unless a test is parametrized by `host` (FILTER_HOSTS, as the filter suite): then
also the native host, fed the `meshcache-native` resource.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from meshcache.contract.filter_config import DEFAULT_MAX_TOTAL_BYTES, client_plugin_config
from meshcache.contract.native_filter import NATIVE_CLIENT_FILTER_NAME, NATIVE_FILTER_NAME
from meshcache.contract.paths import FILTER_WASM, require_filter_native
from meshcache.contract.wasm_filter import CLIENT_FILTER_NAME, FILTER_NAME
from meshcache.control_plane.schemas import Policy
from meshcache.control_plane.settings import Settings
from meshcache.control_plane.snapshots import Snapshot
from meshcache.control_plane.store import Store
from meshcache.ctl import launchers, procs
from meshcache.ctl.envoy_config import Affinity, CacheProxy, ClientSidecar, write
from meshcache.ctl.mesh.config import FILTER_HOSTS
from meshcache.ctl.pki import CertificateAuthority, spiffe_id
from meshcache.ctl.procs import local_http
from tests.helpers.control_plane import WRITE_TOKEN, ControlPlaneProc, run
from tests.helpers.filter_stats import filter_stats_reaching
from tests.helpers.wait import eventually

pytestmark = pytest.mark.skipif(not FILTER_WASM.exists(), reason="filter not built (make filter)")

NODE = "sidecar-ecds"
BODY = b'{"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}]}'
# The static default: no policies (everything bypasses) until the control plane says otherwise.
DEFAULT_CONFIG = {"version": "default", "policies": []}
# Envoy's ECDS counters of the filter, by the HTTP filter (= ECDS resource) name.
ECDS_STATS = "extension_config_discovery.http_filter.{}."


@dataclass
class Sidecar:
    listen_port: int
    admin_port: int
    origin_port: int
    proc: procs.Proc
    filter_name: str

    def infer(self, model: str, body: bytes = BODY) -> httpx.Response:
        return local_http().post(f"http://127.0.0.1:{self.listen_port}/v2/models/{model}/infer", content=body,
                                 headers={"content-type": "application/json"}, timeout=10)

    def origin_calls(self) -> int:
        return int(local_http().get(f"http://127.0.0.1:{self.origin_port}/calls", timeout=5).json()["http"])

    def ecds_stats(self) -> dict[str, int]:
        prefix = ECDS_STATS.format(self.filter_name)
        raw = launchers.envoy_stats(self.admin_port, prefix)
        return {k.removeprefix(prefix): v for k, v in raw.items()}


@pytest.fixture
def host() -> str:
    """The sidecar's cache host; a test parametrized by `host` overrides it."""
    return "wasm"


@pytest.fixture
def sidecar(tmp_path: Path, cp: ControlPlaneProc, host: str) -> Iterator[Sidecar]:
    origin_port, grpc_port, listen_port, admin_port = (procs.free_port() for _ in range(4))
    started: list[procs.Proc] = []
    with procs.supervised(started):
        origin = procs.start("origin", [sys.executable, "-m", "tests.filter.origin", "--http-port",
                                        str(origin_port), "--grpc-port", str(grpc_port)], tmp_path / "logs")
        started.append(origin)
        procs.wait_until(origin, procs.tcp_open(origin_port))
        proxy = CacheProxy(listen_port=listen_port, admin_port=admin_port, http_upstream_port=origin_port,
                           grpc_upstream_port=grpc_port, wasm_path=FILTER_WASM, plugin_config=DEFAULT_CONFIG,
                           ecds_port=cp.xds_port, node_id=NODE,
                           native_module=require_filter_native() if host == "native" else None)
        envoy = launchers.start_envoy(write(proxy, tmp_path / "envoy.yaml"), admin_port, tmp_path / "logs")
        started.append(envoy)
        yield Sidecar(listen_port, admin_port, origin_port, envoy,
                      NATIVE_FILTER_NAME if host == "native" else FILTER_NAME)


def proxy_state(cp: ControlPlaneProc) -> dict:
    found = [p for p in cp.client().get("/v1/proxies").json()["proxies"] if p["node_id"] == NODE]
    assert found, "Envoy not connected"
    return found[0]


def wait_acked(cp: ControlPlaneProc, version: int) -> dict:
    return eventually(lambda: (p := proxy_state(cp))["acked_version"] == str(version) and p, timeout=10)


def cache_status(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.headers.get("cache-status", "")


@pytest.mark.parametrize("host", FILTER_HOSTS)
def test_policy_changes_take_effect_live(cp: ControlPlaneProc, sidecar: Sidecar, host: str) -> None:
    c = cp.client()
    # Before any policy exists Envoy runs its default_config: traffic flows, uncached.
    assert cache_status(sidecar.infer("llama3-70b")) == "meshcache; fwd=bypass; detail=no-policy"
    eventually(lambda: proxy_state(cp))  # connected, nothing pushed yet (version 0)

    v = c.put("/v1/policies/llama3", json={"ttl_s": 120, "max_ttl_s": 600}).json()["version"]
    acked = wait_acked(cp, v)
    # /v1/proxies (and the status page) say which filter it runs: the resource it asked for.
    assert acked["current"] and acked["resources"] == [sidecar.filter_name], acked
    calls = sidecar.origin_calls()
    assert cache_status(sidecar.infer("llama3-70b")) == "meshcache; fwd=miss; stored"
    assert cache_status(sidecar.infer("llama3-70b")) in ("meshcache; hit; ttl=120", "meshcache; hit; ttl=119")
    assert sidecar.origin_calls() == calls + 1

    # A TTL change keeps the generation: Envoy reuses the VM (the native host: the module's store
    # lives as long as the process), so the stored entry still hits,
    # for what is left of the new, lower TTL (the current policy applies at lookup).
    v = c.put("/v1/policies/llama3", json={"ttl_s": 30}).json()["version"]
    wait_acked(cp, v)
    lowered = cache_status(sidecar.infer("llama3-70b"))
    assert lowered.startswith("meshcache; hit; ttl=") and int(lowered.rsplit("=", 1)[1]) <= 30, lowered
    other = b'{"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [2]}]}'
    assert cache_status(sidecar.infer("llama3-8b", other)) == "meshcache; fwd=miss; stored"
    assert cache_status(sidecar.infer("llama3-8b", other)) in ("meshcache; hit; ttl=30", "meshcache; hit; ttl=29")

    # Purge: the next request is a miss (new generation), then cached again.
    v = c.post("/v1/purge", json={"model_prefix": "llama3"}).json()["version"]
    wait_acked(cp, v)
    calls = sidecar.origin_calls()
    assert cache_status(sidecar.infer("llama3-70b")) == "meshcache; fwd=miss; stored"
    assert sidecar.origin_calls() == calls + 1
    assert cache_status(sidecar.infer("llama3-70b")).startswith("meshcache; hit")

    # DELETE: no policy matches, the cache stays out.
    v = c.delete("/v1/policies/llama3").json()["version"]
    wait_acked(cp, v)
    assert cache_status(sidecar.infer("llama3-70b")) == "meshcache; fwd=bypass; detail=no-policy"

    # Rollback to the first snapshot brings the policy back, with a fresh generation.
    v = c.post("/v1/rollback", json={"version": 1}).json()["version"]
    wait_acked(cp, v)
    assert cache_status(sidecar.infer("llama3-70b")) == "meshcache; fwd=miss; stored"
    assert cache_status(sidecar.infer("llama3-70b")).startswith("meshcache; hit; ttl=1")

    stats = sidecar.ecds_stats()
    assert stats["config_reload"] == 5 and stats.get("config_fail", 0) == 0



def test_lowering_a_ttl_or_disabling_reaches_stored_entries(cp: ControlPlaneProc, sidecar: Sidecar) -> None:
    """Operators lower a TTL because answers went bad: the current policy's `ttl_s`, `max_ttl_s`
    and `enabled` apply to entries already stored, not only to new ones."""
    c = cp.client()
    eventually(lambda: proxy_state(cp))
    origin_max_age = b'{"inputs": [], "parameters": {"n": 1}}'
    wait_acked(cp, c.put("/v1/policies/llama3", json={"ttl_s": 600, "max_ttl_s": 1800}).json()["version"])
    for model, body in (("llama3-70b", BODY), ("llama3-8b", origin_max_age)):
        headers = {"x-origin-cache-control": "max-age=1200"} if body is origin_max_age else {}
        r = local_http().post(f"http://127.0.0.1:{sidecar.listen_port}/v2/models/{model}/infer", content=body,
                              headers=headers, timeout=10)
        assert cache_status(r) == "meshcache; fwd=miss; stored"

    def hit_ttl(model: str, body: bytes) -> str:
        r = local_http().post(f"http://127.0.0.1:{sidecar.listen_port}/v2/models/{model}/infer", content=body,
                              timeout=10)
        return cache_status(r)

    def ttl_left(status: str) -> int:
        assert status.startswith("meshcache; hit; ttl="), status
        return int(status.rsplit("=", 1)[1])

    assert 590 <= ttl_left(hit_ttl("llama3-70b", BODY)) <= 600  # the policy's 600 s
    assert 1190 <= ttl_left(hit_ttl("llama3-8b", origin_max_age)) <= 1200  # the origin's 1200 s
    # ttl_s lowered: entries whose TTL was the policy's follow it; max_ttl_s caps every entry.
    wait_acked(cp, c.put("/v1/policies/llama3", json={"ttl_s": 5, "max_ttl_s": 900}).json()["version"])
    assert 0 < ttl_left(hit_ttl("llama3-70b", BODY)) <= 5
    assert 890 <= ttl_left(hit_ttl("llama3-8b", origin_max_age)) <= 900
    # Disabled: nothing is served.
    off = {"ttl_s": 5, "max_ttl_s": 900, "enabled": False}
    wait_acked(cp, c.put("/v1/policies/llama3", json=off).json()["version"])
    calls = sidecar.origin_calls()
    assert hit_ttl("llama3-70b", BODY) == "meshcache; fwd=bypass; detail=disabled"
    assert hit_ttl("llama3-8b", origin_max_age) == "meshcache; fwd=bypass; detail=disabled"
    assert sidecar.origin_calls() == calls + 2
    # Enabled with ttl_s 0: entries whose TTL was the policy's are over; the origin's lives on
    # under max_ttl_s.
    wait_acked(cp, c.put("/v1/policies/llama3", json={"ttl_s": 0, "max_ttl_s": 900}).json()["version"])
    assert hit_ttl("llama3-70b", BODY) == "meshcache; fwd=miss; detail=ttl-zero"
    assert 890 <= ttl_left(hit_ttl("llama3-8b", origin_max_age)) <= 900
    # max_ttl_s 0: nothing stored is served any more.
    wait_acked(cp, c.put("/v1/policies/llama3", json={"ttl_s": 0, "max_ttl_s": 0}).json()["version"])
    assert hit_ttl("llama3-8b", origin_max_age) == "meshcache; fwd=miss; detail=ttl-zero"
    assert sidecar.origin_calls() == calls + 4

# What Envoy's NACK says when the filter refuses its configuration (its reason is in Envoy's log).
NACK_SUMMARY = {"wasm": "Wasm plugin meshcache", "native": "Failed to initialize dynamic module"}


@pytest.mark.parametrize("host", FILTER_HOSTS)
def test_config_the_filter_rejects_is_a_nack_and_envoy_keeps_the_last_good_one(
        tmp_path: Path, redis_server: tuple[procs.Proc, int], cp: ControlPlaneProc, sidecar: Sidecar, host: str
) -> None:
    v = cp.client().put("/v1/policies/bert", json={"ttl_s": 60}).json()["version"]
    wait_acked(cp, v)
    assert cache_status(sidecar.infer("bert-base")) == "meshcache; fwd=miss; stored"

    # The API never produces such a config, so write one straight into the store (test-only
    # path): max_ttl_s < ttl_s, which the filter rejects in on_configure.
    async def inject() -> int:
        store = Store(Settings(redis_url=f"redis://127.0.0.1:{redis_server[1]}/0"))
        try:
            cur = await store.load_current()
            bad = Policy(model_prefix="bert", ttl_s=60, max_ttl_s=5, generation=cur.version + 1)
            return await store.commit(Snapshot(version=cur.version + 1, policies=(bad,), action="bad"),
                                      cur.version, "test", "invalid on purpose")
        finally:
            await store.close()

    bad_version = run(inject())
    p = eventually(lambda: (p := proxy_state(cp))["last_nack"] and p, timeout=10)
    assert p["last_nack"]["version"] == str(bad_version)
    assert NACK_SUMMARY[host] in p["last_nack"]["error"], p["last_nack"]
    # The filter's own reason is in Envoy's log (Envoy's NACK carries only its summary).
    assert "max_ttl_s: must be at least ttl_s" in sidecar.proc.log_path.read_text()
    assert p["acked_version"] == str(v) and not p["current"]
    # Envoy's own count of the rejection, read from its admin port: a second observer of the NACK
    # the control plane saw, so waited for (and read with a default), never indexed at once.
    eventually(lambda: sidecar.ecds_stats().get("config_fail", 0) >= 1, timeout=10)
    # Envoy kept the last good config (and its cache).
    assert cache_status(sidecar.infer("bert-base")).startswith("meshcache; hit; ttl=")

    # A valid change afterwards is accepted again.
    v = cp.client().put("/v1/policies/bert", json={"ttl_s": 10}).json()["version"]
    assert wait_acked(cp, v)["current"]


def test_envoy_keeps_serving_without_the_control_plane_and_resyncs(
        cp: ControlPlaneProc, sidecar: Sidecar) -> None:
    v = cp.client().put("/v1/policies/gpt", json={"ttl_s": 60}).json()["version"]
    wait_acked(cp, v)
    cp.proc.kill()
    # Envoy keeps the last config: new requests are still cached and served.
    body = b'{"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [42]}]}'
    assert cache_status(sidecar.infer("gpt-4", body)) == "meshcache; fwd=miss; stored"
    assert cache_status(sidecar.infer("gpt-4", body)).startswith("meshcache; hit; ttl=")
    assert sidecar.proc.alive()

    cp.restart()
    # Envoy reconnects (its retry backoff) and reports the version it has.
    eventually(lambda: proxy_state(cp)["acked_version"] == str(v), timeout=20)
    v2 = cp.client().put("/v1/policies/gpt", json={"ttl_s": 60, "enabled": False}).json()["version"]
    wait_acked(cp, v2)
    assert cache_status(sidecar.infer("gpt-4", body)) == "meshcache; fwd=bypass; detail=disabled"




def _body(n: int) -> bytes:
    return json.dumps({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [n]}]}).encode()


def cache_gauges(sidecar: Sidecar, expected: dict[str, int]) -> dict[str, int]:
    """The filter's entries/bytes gauges (per policy, unattributed, total), once each one in
    `expected` reads its value (the filter flushes them every 200 ms)."""
    stats = filter_stats_reaching(sidecar.admin_port, expected)
    return {k: v for k, v in stats.items() if k.endswith(("entries", "bytes"))}


def assert_adds_up(g: dict[str, int]) -> None:
    for what in ("entries", "bytes"):
        parts = sum(v for k, v in g.items() if k.startswith("meshcache.policy.") and k.endswith("." + what))
        assert parts + g[f"meshcache.unattributed.{what}"] == g[f"meshcache.{what}"], g


def test_entries_and_bytes_per_policy_through_removal_purge_and_layout_change(
        cp: ControlPlaneProc, sidecar: Sidecar) -> None:
    c = cp.client()
    c.put("/v1/policies/alpha", json={"ttl_s": 300})
    v = c.put("/v1/policies/beta", json={"ttl_s": 300}).json()["version"]
    wait_acked(cp, v)
    g = cache_gauges(sidecar, {"meshcache.policy.alpha.entries": 0})
    assert g["meshcache.policy.beta.entries"] == 0 and g["meshcache.unattributed.entries"] == 0, \
        "defined at configure time"
    for n in range(2):
        assert cache_status(sidecar.infer("alpha-1", _body(n))) == "meshcache; fwd=miss; stored"
    for n in range(3):
        assert cache_status(sidecar.infer("beta-7b", _body(n))) == "meshcache; fwd=miss; stored"
    g = cache_gauges(sidecar, {"meshcache.policy.alpha.entries": 2, "meshcache.policy.beta.entries": 3,
                               "meshcache.entries": 5})
    assert 0 < g["meshcache.policy.alpha.bytes"] < g["meshcache.policy.beta.bytes"]
    assert_adds_up(g)

    # Purge: a new generation, new keys; the old entries still take space under their policy.
    wait_acked(cp, c.post("/v1/purge", json={"model_prefix": "beta"}).json()["version"])
    assert cache_status(sidecar.infer("beta-7b", _body(0))) == "meshcache; fwd=miss; stored"
    g = cache_gauges(sidecar, {"meshcache.policy.beta.entries": 4, "meshcache.entries": 6})
    assert_adds_up(g)

    # Removing a policy moves its entries to the unattributed gauges (the total is unchanged);
    # bringing it back gives them back.
    alpha = (g["meshcache.policy.alpha.entries"], g["meshcache.policy.alpha.bytes"])
    wait_acked(cp, c.delete("/v1/policies/alpha").json()["version"])
    g = cache_gauges(sidecar, {"meshcache.unattributed.entries": 2})
    assert (g["meshcache.policy.alpha.entries"], g["meshcache.policy.alpha.bytes"]) == (0, 0)
    assert (g["meshcache.unattributed.entries"], g["meshcache.unattributed.bytes"]) == alpha
    assert g["meshcache.entries"] == 6
    assert_adds_up(g)
    wait_acked(cp, c.put("/v1/policies/alpha", json={"ttl_s": 300}).json()["version"])
    g = cache_gauges(sidecar, {"meshcache.policy.alpha.entries": 2})
    assert g["meshcache.unattributed.entries"] == 0
    assert_adds_up(g)

    # A new slot count empties the cache: every bucket back to 0.
    wait_acked(cp, c.put("/v1/limits", json={"max_entries": 64}).json()["version"])
    g = cache_gauges(sidecar, {"meshcache.entries": 0})
    assert all(v == 0 for v in g.values()), g


@pytest.mark.parametrize("host", FILTER_HOSTS)
def test_a_client_sidecar_gets_the_client_role_of_its_host(tmp_path: Path, cp: ControlPlaneProc, host: str) -> None:
    """`meshcache up --replicas N`: the client sidecar asks for the client role of the host it runs
    (`meshcache-client`, or `meshcache-native-client` for the dynamic module), and each policy
    change reaches it."""
    admin = procs.free_port()
    identity = CertificateAuthority.create().issue(spiffe_id("default", "client"), tmp_path / "pki", "client")
    affinity = Affinity(FILTER_WASM, client_plugin_config(DEFAULT_CONFIG), ecds_port=cp.xds_port,
                        native_module=require_filter_native() if host == "native" else None)
    sidecar = ClientSidecar(listen_port=procs.free_port(), admin_port=admin, server_ports=[procs.free_port()],
                            identity=identity, server_identities=[spiffe_id("default", "server")],
                            node_id="client-ecds", affinity=affinity)
    name = NATIVE_CLIENT_FILTER_NAME if host == "native" else CLIENT_FILTER_NAME
    prefix = ECDS_STATS.format(name)
    with procs.supervised([launchers.start_envoy(write(sidecar, tmp_path / "client.yaml"), admin, tmp_path / "logs")]):
        c = cp.client()
        for pushed, ttl in enumerate((120, 60), start=1):
            c.put("/v1/policies/llama3", json={"ttl_s": ttl})
            eventually(lambda n=pushed: launchers.envoy_stats(admin, prefix).get(f"{prefix}config_reload") == n,
                       timeout=10)
        stats = launchers.envoy_stats(admin, prefix)
        assert stats[f"{prefix}config_reload"] == 2 and stats.get(f"{prefix}config_fail", 0) == 0, stats
        client = next(p for p in c.get("/v1/proxies").json()["proxies"] if p["node_id"] == "client-ecds")
        assert client["resources"] == [name], client


V8_CREATED = "wasm.envoy.wasm.runtime.v8.created"  # Envoy's count of Wasm VMs started


def _meshcache(cp: ControlPlaneProc, *args: str) -> subprocess.CompletedProcess[str]:
    """The CLI against this control plane, without a terminal (as a script runs it)."""
    return subprocess.run([str(Path(sys.executable).parent / "meshcache"), *args, "--url", cp.url,
                           "--token", WRITE_TOKEN], capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL)


def _rebuilt(module: Path, out: Path) -> Path:
    """`module` with one more Wasm custom section: other code bytes (a new build as far as Envoy
    can tell), the same behaviour. For the native host: a copy under another name (a new file to
    load), which is what a new build's path is."""
    if module.suffix == ".wasm":
        name = b"meshcache-test-build"
        payload = bytes([len(name)]) + name + b"2"
        out.write_bytes(module.read_bytes() + b"\x00" + bytes([len(payload)]) + payload)
    else:
        shutil.copy(module, out)
    return out


@pytest.mark.parametrize("host", FILTER_HOSTS)
def test_what_limits_and_module_changes_do_to_stored_entries(
        tmp_path: Path, cp: ControlPlaneProc, sidecar: Sidecar, host: str) -> None:
    """The cache effects the API and the CLI announce are what the filter does: raising a bound
    keeps the entry; a new max_entries is refused without --yes (nothing pushed, the entry still
    hits) and empties the cache with it. A new module build pushed over ECDS keeps the Wasm host's
    entries and empties the native host's (docs/istio.md, "Upgrading the filter module")."""
    # The control plane reads the sidecar's stats, so the CLI can say what is cached now.
    cp.env["MESHCACHE_CP_PROXY_STATS"] = f"{NODE}=http://127.0.0.1:{sidecar.admin_port}/stats/prometheus"
    cp.restart()
    c = cp.client()
    eventually(lambda: proxy_state(cp))

    def version() -> int:
        return int(c.get("/v1/snapshot").json()["version"])

    def store_and_hit() -> None:
        assert cache_status(sidecar.infer("llama3-70b")) == "meshcache; fwd=miss; stored"
        assert cache_status(sidecar.infer("llama3-70b")).startswith("meshcache; hit")

    wait_acked(cp, c.put("/v1/policies/llama3", json={"ttl_s": 600}).json()["version"])
    store_and_hit()
    raised = _meshcache(cp, "limits", "set", "--max-total-bytes", str(2 * DEFAULT_MAX_TOTAL_BYTES))
    assert raised.returncode == 0 and raised.stderr == "", raised.stderr
    wait_acked(cp, version())
    assert cache_status(sidecar.infer("llama3-70b")).startswith("meshcache; hit")  # nothing lost
    before = version()
    eventually(lambda: c.get("/v1/stats").json()["proxies"][0]["entries"] == 1)
    refused = _meshcache(cp, "limits", "set", "--max-entries", "1024")
    assert refused.returncode == 1 and "every proxy empties its whole cache" in refused.stderr, refused.stderr
    assert re.search(r"\(1 entry, \d+ bytes cached now on the 1 proxy read\)", refused.stderr), refused.stderr
    assert version() == before
    assert cache_status(sidecar.infer("llama3-70b")).startswith("meshcache; hit")

    # A new build of the module, pushed by the control plane (restarted with its path).
    reloads = sidecar.ecds_stats()["config_reload"]
    vms = launchers.envoy_stats(sidecar.admin_port, "wasm.").get(V8_CREATED, 0)
    module = require_filter_native() if host == "native" else FILTER_WASM
    flag = "--native-module" if host == "native" else "--wasm-path"
    cp.argv += [flag, str(_rebuilt(module, tmp_path / f"rebuilt-{module.name}"))]
    cp.restart()
    eventually(lambda: sidecar.ecds_stats()["config_reload"] > reloads, timeout=20)
    after_module = cache_status(sidecar.infer("llama3-70b"))
    if host == "wasm":
        # New code bytes: Envoy started new VMs (same vm_id), and the stored entry still hits: the
        # shared data belongs to the vm_id, and the old VMs hold it until the new ones run.
        assert launchers.envoy_stats(sidecar.admin_port, "wasm.")[V8_CREATED] > vms
        assert after_module.startswith("meshcache; hit"), after_module
    else:
        # A new module file is a new library: its store starts empty (the old one is unloaded).
        assert after_module == "meshcache; fwd=miss; stored", after_module
        assert cache_status(sidecar.infer("llama3-70b")).startswith("meshcache; hit")

    applied = _meshcache(cp, "limits", "set", "--max-entries", "1024", "--yes")
    assert applied.returncode == 0 and "meshcache: warning: max_entries" in applied.stderr, applied.stderr
    wait_acked(cp, version())
    store_and_hit()  # the entry was gone: a miss, stored again

