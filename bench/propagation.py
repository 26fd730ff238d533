"""Propagation benchmark: from a policy `PUT` returning to the ECDS ACK reaching the control
plane, with one real Envoy (running the real filter) and with 500, 2,000 and 5,000 simulated ECDS
streams (`--clients`, a fresh control plane for each); and the
same through a real istiod (control plane -> MCP -> istiod -> ECDS): one sidecar configured by
istiod, and 200 simulated sidecars connected to istiod (`--istiod-clients`); and through istiod in
Kubernetes mode to the rendered engine pods' sidecars, each istio-agent driving Envoy
(meshcache/ctl/kube, root; `--no-kube` skips it).
Run with `python -m bench.propagation`; writes the `propagation` section of docs/benchmarks.md.

Through istiod the ACK reaches istiod, not the control plane: latency = the moment the benchmark
sees istiod's `/debug/syncz` report the ECDS ACK of the new push for every sidecar (polled every
10 ms with one sidecar, 50 ms with many; istiod records no ACK time) minus the PUT's answer. With
many sidecars only the last ACK of each change is measured.

Latency per (round, client) = the control plane's wall-clock time of the ACK for the new version
(`acked_at` in /v1/proxies) minus the benchmark's wall-clock time when the PUT answered; both
processes are on this machine and read the same clock. An ACK can beat the PUT's answer (the
push starts right after the Redis commit): those count as 0 ms.
The simulated clients are gRPC aio streams in client processes of 500 streams each (one channel
and one TCP connection per client, like real sidecars; a grpc local subchannel pool, else the
channels of a process share one connection) that ACK every response at once and, like Envoy,
reopen a failed stream after 0.5-1.5 s. `--xds-workers N` runs the control plane with N xDS
processes.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

import grpc
import httpx

from bench import stats
from bench.report import publish, table
from bench.stats import percentile
from meshcache.contract.paths import FILTER_WASM, require_filter_wasm
from meshcache.control_plane.xds_client import XdsClient
from meshcache.ctl import launchers, procs
from meshcache.ctl.envoy_config import CacheProxy, write

WRITE_TOKEN = "bench-write-token-0123456789"
HEADERS = {"Authorization": f"Bearer {WRITE_TOKEN}"}


def start_stack(tmp: Path, max_streams: int = 100, xds_workers: int = 1) -> tuple[list[procs.Proc], str, int]:
    """redis-server + the control plane; returns (processes, API URL, xDS port)."""
    redis, redis_port = launchers.start_redis(tmp / "redis")
    http_port, xds_port = procs.free_port(), procs.free_port()
    argv = launchers.control_plane_argv(redis_port, http_port, xds_port, "--wasm-path", str(FILTER_WASM),
                                       "--log-level", "warning")
    # Room above the simulated streams: a client that reconnects may briefly hold two.
    env = {"MESHCACHE_CP_TOKENS": f"write:bench:{WRITE_TOKEN}",
           "MESHCACHE_CP_MAX_XDS_STREAMS": str(max_streams + max(100, max_streams // 10)),
           "MESHCACHE_CP_XDS_WORKERS": str(xds_workers)}
    cp = launchers.start_control_plane(argv, env, tmp, http_port, xds_port)
    return [redis, cp], f"http://127.0.0.1:{http_port}", xds_port


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def acks_total(c: httpx.Client) -> int:
    """The control plane's count of ECDS ACKs received (Prometheus)."""
    for line in c.get("/metrics").text.splitlines():
        if line.startswith("meshcache_cp_xds_acks_total "):
            return int(float(line.split()[1]))
    raise RuntimeError("no meshcache_cp_xds_acks_total in /metrics")


def wait_all_acked(c: httpx.Client, version: int, n: int, timeout: float = 10.0, acks_at_least: int = 0
                   ) -> list[float]:
    """ACK times of `n` streams for `version` (from /v1/proxies). With many streams the cheap ACK
    counter is polled first (`acks_at_least`): /v1/proxies is served by the process being measured
    and building it for thousands of proxies on every poll took a fifth of its time."""
    deadline = time.monotonic() + timeout
    while acks_at_least and time.monotonic() < deadline and acks_total(c) < acks_at_least:
        time.sleep(0.02)
    while time.monotonic() < deadline:
        r = c.get("/v1/proxies")
        r.raise_for_status()
        ps = r.json()["proxies"]
        acked = [p["acked_at"] for p in ps if p["acked_version"] == str(version) and p["acked_at"]]
        if len(acked) >= n:
            return acked
        time.sleep(0.01 if n == 1 else 0.1)
    raise TimeoutError(f"version {version}: not all {n} streams acknowledged within {timeout}s")


def run_rounds(c: httpx.Client, rounds: int, n: int, count_acks: bool = True) -> tuple[list[float], list[float]]:
    """PUT `rounds` changes; returns (every ACK latency, per-round latency of the last ACK), in s.
    `count_acks` False: the ACK counter covers only part of the streams (xDS workers)."""
    every, last = [], []
    count_acks = count_acks and n > 1
    for i in range(rounds):
        before = acks_total(c) if count_acks else 0
        r = c.put("/v1/policies/bench-model", json={"ttl_s": 60 + i % 2}, headers=HEADERS)
        returned = time.time()
        r.raise_for_status()
        acks = wait_all_acked(c, r.json()["version"], n, timeout=max(10.0, n / 200),
                              acks_at_least=before + n if count_acks else 0)
        lat = [max(0.0, a - returned) for a in acks]
        every += lat
        last.append(max(lat))
        time.sleep(0.05)
    return every, last


def bench_envoy(tmp: Path, rounds: int) -> tuple[list[float], list[float]]:
    require_filter_wasm()
    started, url, xds_port = start_stack(tmp)
    with procs.supervised(started), httpx.Client(base_url=url, timeout=10, headers=HEADERS) as c:
        listen, admin = procs.free_port(), procs.free_port()
        proxy = CacheProxy(listen_port=listen, admin_port=admin, http_upstream_port=procs.free_port(),
                           wasm_path=FILTER_WASM, plugin_config={"version": "default", "policies": []},
                           ecds_port=xds_port, node_id="bench-envoy")
        started.append(launchers.start_envoy(write(proxy, tmp / "envoy.yaml"), admin, tmp))
        run_rounds(c, 3, 1)  # warm-up: first connection, first VM configuration
        return run_rounds(c, rounds, 1)


STREAMS_PER_PROCESS = 500  # one process with ~2,000 aio streams spends seconds per push on itself


async def _clients_worker(port: int, n: int, first: int) -> None:
    """`n` simulated sidecars `sim-<first>`...: each its own channel and TCP connection (a local
    subchannel pool: grpc would otherwise share one connection between identical channels), one
    ECDS stream ACKing every response at once; like Envoy, a failed stream is reopened after
    0.5-1.5 s with the version it has. Prints `ready` once every stream got its first response."""
    got_first = [asyncio.Event() for _ in range(n)]
    reconnects = 0

    async def one(k: int) -> None:
        nonlocal reconnects
        version = ""
        while True:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}",
                                                 options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
                cl = XdsClient(ch, f"sim-{first + k}")
                try:
                    await cl.subscribe(version)
                    while True:
                        try:
                            resp = await cl.recv(timeout=3600)
                        except TimeoutError:
                            continue
                        await cl.ack(resp)
                        version = resp.version_info
                        got_first[k].set()
                except (grpc.aio.AioRpcError, ConnectionError):
                    reconnects += 1
                finally:
                    await cl.close()
            await asyncio.sleep(0.5 + random.random())

    tasks = [asyncio.create_task(one(k)) for k in range(n)]
    await asyncio.gather(*(e.wait() for e in got_first))
    print("ready", flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    print(f"reconnects {reconnects}", flush=True)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def bench_simulated(tmp: Path, n: int, rounds: int, xds_workers: int = 1
                    ) -> tuple[list[float], list[float], float, int]:
    """(every ACK latency, last ACK per round, server RSS per idle stream in bytes (the main
    process's; with workers not meaningful), reconnects)."""
    started, url, xds_port = start_stack(tmp, n, xds_workers)
    cp_pid = started[-1].popen.pid
    with procs.supervised(started), httpx.Client(base_url=url, timeout=30, headers=HEADERS) as c:
        c.put("/v1/policies/bench-model", json={"ttl_s": 1}, headers=HEADERS).raise_for_status()
        c.get("/v1/proxies").raise_for_status()  # the route and its serializers are warm before measuring
        rss_before = rss_bytes(cp_pid)
        workers = []
        for first in range(0, n, STREAMS_PER_PROCESS):
            count = min(STREAMS_PER_PROCESS, n - first)
            workers.append(procs.start(f"sim-clients-{first}", [
                sys.executable, "-m", "bench.propagation", "--worker-port", str(xds_port),
                "--clients", str(count), "--worker-first", str(first)], tmp))
            started.append(workers[-1])
        for w in workers:
            procs.wait_until(w, lambda w=w: "ready" in w.log_path.read_text(), timeout=120,
                             what="clients connected")
        wait_all_acked(c, 1, n, timeout=60)
        per_stream = (rss_bytes(cp_pid) - rss_before) / n
        run_rounds(c, 2, n, xds_workers == 1)  # warm-up
        every, last = run_rounds(c, rounds, n, xds_workers == 1)
        for w in workers:
            w.stop()
        reconnects = sum(int(line.split()[1]) for w in workers for line in w.log_path.read_text().splitlines()
                         if line.startswith("reconnects "))
        return every, last, per_stream, reconnects


# ---- through istiod ---------------------------------------------------------------------------

ISTIOD_ECDS = "type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig"
_ttl = itertools.count(60)  # every PUT a new value: each one is a change istiod must push


def _ecds_nonces(debug: str) -> dict[str, tuple[str, str, str]]:
    """proxy -> (sent, acked, lastError) of its ECDS stream, from istiod's /debug/syncz."""
    out = {}
    for s in httpx.get(f"{debug}/syncz", timeout=10).json() or []:
        res = s.get("resources", {}).get(ISTIOD_ECDS, {})
        out[s["proxy"]] = (res.get("sent", ""), res.get("acked", ""), res.get("lastError", ""))
    return out


def istiod_rounds(api: httpx.Client, debug: str, proxies: set[str], rounds: int,
                  poll: float) -> list[float]:
    """PUT `rounds` changes; per round, seconds until istiod has every proxy's ACK of a new push."""
    out = []
    for i in range(rounds):
        before = _ecds_nonces(debug)
        r = api.put("/v1/policies/bench-model", json={"ttl_s": next(_ttl)})
        returned = time.time()
        r.raise_for_status()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            now = _ecds_nonces(debug)
            done = {p for p in proxies if p in now and now[p][0] != before.get(p, ("",))[0]
                    and now[p][1] == now[p][0] and not now[p][2]}
            if done >= proxies:
                out.append(time.time() - returned)
                break
            time.sleep(poll)
        else:
            raise TimeoutError(f"round {i}: {len(proxies - done)} of {len(proxies)} sidecars did not ACK")
        time.sleep(0.05)
    return out


def bench_istiod(tmp: Path, rounds: int, clients: int, sim_rounds: int) -> tuple[list[float], list[float]]:
    """(1 sidecar configured by istiod, `clients` simulated sidecars connected to istiod)."""
    from meshcache.ctl.istiod.mesh import IstiodMesh, IstiodMeshConfig

    with IstiodMesh(IstiodMeshConfig(work_dir=tmp, canary_color=""), log=lambda _: None) as mesh, \
            mesh.api() as api:
        assert mesh.istiod is not None
        debug = mesh.istiod.debug_url
        engine = {sc.pod.proxy_id for sc in mesh.server_sidecars()}
        istiod_rounds(api, debug, engine, 3, 0.01)  # warm-up
        one = istiod_rounds(api, debug, engine, rounds, 0.01)
        worker = procs.start("istiod-sim-clients", [sys.executable, "-m", "bench.propagation",
                                                    "--istiod-worker-port", str(mesh.istiod.ports.grpc),
                                                    "--clients", str(clients)], tmp)
        with procs.supervised([worker]):
            procs.wait_until(worker, lambda: "ready" in worker.log_path.read_text(), timeout=120,
                             what="simulated sidecars connected")
            sims = {f"sim-{k}.meshcache" for k in range(clients)}
            deadline = time.monotonic() + 60
            while not sims <= {p for p, (_, acked, _) in _ecds_nonces(debug).items() if acked}:
                if time.monotonic() > deadline:
                    raise TimeoutError("simulated sidecars did not get their first ECDS push")
                time.sleep(0.2)
            istiod_rounds(api, debug, sims | engine, 2, 0.05)  # warm-up
            many = istiod_rounds(api, debug, sims | engine, sim_rounds, 0.05)
        return one, many


def bench_kube(tmp: Path, rounds: int) -> tuple[list[float], int]:
    """(latencies, sidecars): the engine pods of istio/ as rendered in the local cluster
    (meshcache/ctl/kube: istiod in Kubernetes mode, pods run by the test kubelet), each sidecar
    istio-agent driving Envoy, the module fetched by the agent over OCI. Needs root."""
    from meshcache.ctl.istio import render
    from meshcache.ctl.kube.mesh import KubeMesh, KubeMeshConfig

    with KubeMesh(KubeMeshConfig(tmp, kubelet=True, seed_policies=True)) as mesh, mesh.api() as api:
        assert mesh.cluster is not None and mesh.istiod is not None
        mesh.apply_rendered()
        ns = mesh.config.namespace
        debug = f"http://127.0.0.1:{mesh.istiod.ports.monitoring}/debug"
        replicas = next(o["spec"]["replicas"] for o in mesh.objects if o["kind"] == "Deployment"
                        and o["metadata"]["labels"].get("app") == render.ENGINE_APP)
        deadline = time.monotonic() + 300
        while True:  # every engine pod Ready and its sidecar's ECDS ACKed by istiod
            pods = (mesh.cluster.get(f"/api/v1/namespaces/{ns}/pods?labelSelector=app%3D{render.ENGINE_APP}")
                    or {}).get("items", [])
            ready = {f"{p['metadata']['name']}.{ns}" for p in pods
                     if any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))}
            acked = {p for p, (sent, ack, err) in _ecds_nonces(debug).items() if ack and ack == sent and not err}
            if len(ready) == replicas and ready <= acked:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine pods not Ready and ACKed: ready {sorted(ready)}, acked {sorted(acked)}")
            time.sleep(0.5)
        istiod_rounds(api, debug, ready, 3, 0.01)  # warm-up
        return istiod_rounds(api, debug, ready, rounds, 0.01), len(ready)


async def _istiod_clients_worker(port: int, n: int) -> None:
    """`n` sidecars as istiod sees them (node id, NAMESPACE, LABELS of an engine pod), each on its
    own channel, subscribed to the meshcache ECDS resource over delta ADS, ACKing at once."""
    from envoy.config.core.v3 import base_pb2
    from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
    from google.protobuf import struct_pb2

    async def one(k: int, ready: asyncio.Event) -> None:
        ip = f"127.254.{k // 250}.{k % 250 + 1}"  # an identity only: nothing is sent there
        meta = struct_pb2.Struct()
        meta.update({"NAMESPACE": "meshcache", "ISTIO_VERSION": "1.31.0", "CLUSTER_ID": "Kubernetes",
                     "LABELS": {"app": "meshcache-engine", "color": "green"}, "INSTANCE_IPS": ip, "NAME": f"sim-{k}"})
        node = base_pb2.Node(id=f"sidecar~{ip}~sim-{k}.meshcache~meshcache.svc.cluster.local", metadata=meta)
        while True:  # like Envoy: reconnect after a failed stream (istiod limits new streams per second)
            try:
                async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                    call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(ch).DeltaAggregatedResources()
                    await call.write(discovery_pb2.DeltaDiscoveryRequest(
                        node=node, type_url=ISTIOD_ECDS, resource_names_subscribe=["meshcache"]))
                    while (resp := await call.read()) is not grpc.aio.EOF:
                        await call.write(discovery_pb2.DeltaDiscoveryRequest(type_url=resp.type_url,
                                                                             response_nonce=resp.nonce))
                        ready.set()
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.5 + random.random())

    events = [asyncio.Event() for _ in range(n)]
    tasks = [asyncio.create_task(one(k, e)) for k, e in enumerate(events)]
    await asyncio.gather(*(e.wait() for e in events))
    print("ready", flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    for t in tasks:
        t.cancel()


def ms(v: float) -> str:
    return stats.ms(v, digits=1)


TARGETS_S = {2000: 1.0, 5000: 2.0}  # p99 of every ACK (issue 25); smaller fleets: p99 < 1 s


def target_s(n: int) -> float:
    return TARGETS_S.get(n, 1.0 if n <= 2000 else 2.0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=100, help="policy changes with one Envoy")
    p.add_argument("--sim-rounds", type=int, default=30, help="policy changes with simulated clients")
    p.add_argument("--clients", default="500,2000,5000",
                   help="simulated ECDS stream counts, comma-separated (one fresh control plane each)")
    p.add_argument("--istiod-rounds", type=int, default=30, help="policy changes through istiod, 1 sidecar")
    p.add_argument("--istiod-sim-rounds", type=int, default=20, help="policy changes through istiod, many")
    p.add_argument("--istiod-clients", type=int, default=200, help="simulated sidecars connected to istiod")
    p.add_argument("--no-istiod", action="store_true", help="skip the istiod path")
    p.add_argument("--kube-rounds", type=int, default=30,
                   help="policy changes through istiod in Kubernetes mode (agent-driven sidecars in pods)")
    p.add_argument("--no-kube", action="store_true", help="skip the Kubernetes path (it needs root)")
    p.add_argument("--xds-workers", type=int, default=1, help="the control plane's --xds-workers")
    p.add_argument("--no-publish", action="store_true",
                   help="print the table only (docs/benchmarks.md and its JSON untouched)")
    p.add_argument("--worker-port", type=int, help=argparse.SUPPRESS)  # internal: run the clients
    p.add_argument("--worker-first", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--istiod-worker-port", type=int, help=argparse.SUPPRESS)  # internal: istiod's clients
    args = p.parse_args()
    if args.worker_port:
        asyncio.run(_clients_worker(args.worker_port, int(args.clients), args.worker_first))
        return
    if args.istiod_worker_port:
        asyncio.run(_istiod_clients_worker(args.istiod_worker_port, int(args.clients)))
        return
    counts = [int(x) for x in args.clients.split(",") if x.strip()]
    load = os.getloadavg()[0]
    sims = {}
    with tempfile.TemporaryDirectory(prefix="bench-propagation-") as d:
        envoy_all, _ = bench_envoy(Path(d) / "envoy", args.rounds)
        for n in counts:
            sims[n] = bench_simulated(Path(d) / f"sim-{n}", n, args.sim_rounds, args.xds_workers)
        if not args.no_istiod:
            istiod_one, istiod_many = bench_istiod(Path(d) / "istiod", args.istiod_rounds, args.istiod_clients,
                                                   args.istiod_sim_rounds)
        if not args.no_kube:
            kube, kube_sidecars = bench_kube(Path(d) / "kube", args.kube_rounds)
    rows: list[list[object]] = [
        ["1 real Envoy (filter via ECDS)", args.rounds, len(envoy_all), ms(percentile(envoy_all, 0.5)),
         ms(percentile(envoy_all, 0.99)), ms(max(envoy_all)), "", "", "p99 < 100 ms",
         "yes" if percentile(envoy_all, 0.99) < 0.1 else "no"]]
    samples = [envoy_all]
    for n, (every, last, per_stream, reconnects) in sims.items():
        workers = f", {args.xds_workers} xDS processes" if args.xds_workers > 1 else ""
        rows.append([f"{n} simulated ECDS streams{workers} (every ACK)", args.sim_rounds, len(every),
                     ms(percentile(every, 0.5)), ms(percentile(every, 0.99)), ms(max(every)),
                     f"{per_stream / 1024:.1f}", reconnects, f"p99 < {target_s(n):g} s",
                     "yes" if percentile(every, 0.99) < target_s(n) else "no"])
        rows.append([f"{n} simulated ECDS streams{workers} (last ACK of each change)", args.sim_rounds, len(last),
                     ms(percentile(last, 0.5)), ms(percentile(last, 0.99)), ms(max(last)), "", "", "", ""])
        samples += [every, last]
    if not args.no_istiod:
        rows += [
            ["through istiod: 1 sidecar configured by istiod (MCP -> ECDS)", args.istiod_rounds, len(istiod_one),
             ms(percentile(istiod_one, 0.5)), ms(percentile(istiod_one, 0.99)), ms(max(istiod_one)), "", "", "",
             ""],
            [f"through istiod: {args.istiod_clients} simulated sidecars + 1 (last ACK of each change)",
             args.istiod_sim_rounds, len(istiod_many), ms(percentile(istiod_many, 0.5)),
             ms(percentile(istiod_many, 0.99)), ms(max(istiod_many)), "", "", "p99 < 1 s",
             "yes" if percentile(istiod_many, 0.99) < 1.0 else "no"]]
        samples += [istiod_one, istiod_many]
    if not args.no_kube:
        rows.append([f"through istiod in Kubernetes: {kube_sidecars} engine pods, istio-agent + Envoy each "
                     "(last ACK of each change)", args.kube_rounds, len(kube), ms(percentile(kube, 0.5)),
                     ms(percentile(kube, 0.99)), ms(max(kube)), "", "", "", ""])
        samples.append(kube)
    body = (
        "`python -m bench.propagation`: one control plane (uvicorn + grpcio aio, one process) on a "
        "local redis-server, started afresh for each fleet size; each round is one `PUT "
        "/v1/policies/...` changing the TTL, and every stream must ACK it. Latency = control plane's "
        "receipt of the ECDS ACK for the new version minus the moment the PUT answered (ACKs that beat "
        "the answer count as 0). Simulated streams: one gRPC aio channel and TCP connection each (like "
        f"one Envoy each), {STREAMS_PER_PROCESS} per client process, ACKing at once and reopening a "
        "failed stream after 0.5-1.5 s like Envoy (`reconnects`: how often); everything shares the "
        "machine's cores. `KiB/stream`: the server's RSS growth from no stream to all streams idle, "
        "divided by the streams. "
        "Through istiod (a real pilot-discovery, meshcache/ctl/istiod): the control plane serves "
        "istiod the EnvoyFilter over MCP (TLS), istiod pushes ECDS to the sidecars after its debounce "
        "(PILOT_DEBOUNCE_AFTER, default 100 ms); latency = istiod's /debug/syncz showing the new push "
        "ACKed by every sidecar (polled) minus the PUT's answer. Simulated sidecars: delta ADS streams "
        "subscribed to the meshcache ECDS resource, one channel each, in a second process. "
        "In Kubernetes (meshcache/ctl/kube: the local cluster, istiod in Kubernetes mode, istio/ applied "
        "with kubectl, the engine pods run by the test kubelet): each sidecar is istio-agent driving "
        "Envoy, the agent between istiod and Envoy on the xDS stream (it rewrites the ECDS resource's "
        "OCI module to its local copy before Envoy sees it); same measure as through istiod. "
        f"1-minute load average when the run started: {load:.2f} on {os.cpu_count()} cores.\n\n"
        + table(["setup", "changes", "samples", "p50 ms", "p99 ms", "max ms", "KiB/stream", "reconnects",
                 "target", "met"], rows)
    )
    heads = ("setup", "changes", "samples", "p50_ms", "p99_ms", "max_ms", "kib_per_stream", "reconnects",
             "target", "met")
    stored = [{**dict(zip(heads, row, strict=True)), "p50_ms": percentile(s, 0.5) * 1e3,
               "p99_ms": percentile(s, 0.99) * 1e3, "max_ms": max(s) * 1e3, "quantiles_ms": stats.quantiles_ms(s)}
              for row, s in zip(rows, samples, strict=True)]
    if not args.no_publish:
        publish("propagation", "Control plane: policy propagation to Envoy (PUT to ECDS ACK)", body,
                {"rows": stored})
    print(body)
    print(json.dumps({"rows": stored, "load_average_1m": load}))


if __name__ == "__main__":
    main()
