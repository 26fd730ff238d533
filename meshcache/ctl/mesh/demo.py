"""`meshcache demo`: KServe v2 inference through the local mesh, and the control plane at work.

Uses the mesh running in the state dir if there is one, otherwise starts a private one (temp
dir, free ports) and stops it at the end. Every run uses fresh inputs, so the first request
of each kind is a miss even against a long-running mesh.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np

from meshcache.contract.filter_config import DEMO_POLICIES, LLM_DEMO_POLICIES, policy_spec
from meshcache.contract.headers import CACHE_STATUS_HEADER, COLOR_HEADER
from meshcache.contract.protos import grpc_predict_v2_pb2 as pb
from meshcache.contract.protos import grpc_predict_v2_pb2_grpc as pb_grpc
from meshcache.ctl.mesh import state
from meshcache.ctl.mesh.api_client import PolicyApi
from meshcache.ctl.mesh.config import HOST_NAMES, MeshConfig
from meshcache.ctl.mesh.errors import MeshError
from meshcache.ctl.mesh.topology import SERVER_NODE, Mesh

# model -> (input name, shape, dtype)
INPUTS: dict[str, tuple[str, tuple[int, ...], str]] = {
    "resnet-mini": ("image", (1, 3, 32, 32), "FP32"),
    "mlp-classifier": ("input", (1, 16), "FP32"),
    "text-embedder": ("token_ids", (1, 6), "INT64"),
}


@dataclass
class Row:
    model: str
    transport: str
    color: str
    cache_status: str
    ms: float

    @property
    def hit(self) -> bool:
        return "; hit" in self.cache_status


@dataclass
class Client:
    """Sends KServe v2 requests to the app port and prints one table row per request."""

    app: str
    default_color: str
    rng: np.random.Generator
    rows: list[Row] = field(default_factory=list)
    app_grpc: str = ""  # gRPC elsewhere than `app` (the istiod mesh: the Service port 8001)
    authority: str = ""  # Host / :authority to send (the istiod mesh: the Service name)

    def __post_init__(self) -> None:
        headers = {"host": self.authority} if self.authority else {}
        self.http = httpx.Client(base_url=f"http://{self.app}", timeout=10, headers=headers)
        target = self.app_grpc or self.app
        options = [("grpc.default_authority", f"{self.authority}:{target.rsplit(':', 1)[1]}")] if self.authority else []
        self.channel = grpc.insecure_channel(target, options=options)
        self.stub = pb_grpc.GRPCInferenceServiceStub(self.channel)
        self.stub.ServerLive(pb.ServerLiveRequest(), timeout=10)  # connect before timing anything

    def close(self) -> None:
        self.http.close()
        self.channel.close()

    def tensor(self, model: str) -> np.ndarray:
        _, shape, dtype = INPUTS[model]
        if dtype == "INT64":
            return self.rng.integers(1, 1000, size=shape, dtype=np.int64)
        return self.rng.random(shape, dtype=np.float32)

    def rest(self, model: str, x: np.ndarray, color: str = "") -> Row:
        name, _, dtype = INPUTS[model]
        body = {"inputs": [{"name": name, "shape": list(x.shape), "datatype": dtype,
                            "data": x.reshape(-1).tolist()}]}
        content = json.dumps(body).encode()  # encoded before the clock starts: time the mesh, not json
        headers = {"content-type": "application/json", **({COLOR_HEADER: color} if color else {})}
        t0 = time.perf_counter()
        r = self.http.post(f"/v2/models/{model}/infer", content=content, headers=headers)
        ms = (time.perf_counter() - t0) * 1000
        r.raise_for_status()
        return self._row(model, "REST", color, r.headers.get(CACHE_STATUS_HEADER, "-"), ms)

    def grpc(self, model: str, x: np.ndarray, color: str = "") -> Row:
        name, _, dtype = INPUTS[model]
        request = pb.ModelInferRequest(model_name=model)
        request.inputs.add(name=name, datatype=dtype, shape=list(x.shape))
        request.raw_input_contents.append(x.tobytes())
        metadata = ((COLOR_HEADER, color),) if color else ()
        t0 = time.perf_counter()
        _, call = self.stub.ModelInfer.with_call(request, metadata=metadata, timeout=10)
        ms = (time.perf_counter() - t0) * 1000
        return self._row(model, "gRPC", color, dict(call.initial_metadata()).get(CACHE_STATUS_HEADER, "-"), ms)

    def _row(self, model: str, transport: str, color: str, status: str, ms: float) -> Row:
        row = Row(model, transport, color or self.default_color, status, ms)
        self.rows.append(row)
        print(f"{model:<15} {transport:<9} {row.color:<15} {'HIT' if row.hit else 'MISS':<5} "
              f"{ms:>8.2f} ms   {status}", flush=True)
        return row


def _header(title: str) -> None:
    print(f"\n== {title}")
    print(f"{'model':<15} {'transport':<9} {'colour':<15} {'':<5} {'latency':>11}   Cache-Status")


@contextlib.contextmanager
def _mesh_for_demo(state_dir: Path | None, istiod: bool = False, host: str | None = None, kube: bool = False,
                   llm: bool = False) -> Iterator[tuple[dict[str, Any], str, bool]]:
    """(endpoints, token, started_here): a running mesh if there is one, else a private one whose
    server sidecars run the cache in `host` (MeshConfig.filter; default wasm)."""
    current = state.read_state(state_dir) if state_dir else None
    if current and current.get("status") == "ready" and state.running(current):
        endpoints = current["endpoints"]
        running = endpoints.get("filter", "wasm")
        print(f"using the mesh running in {state_dir} (pid {current['pid']}; cache: {HOST_NAMES[running]}"
              + (f", not the {host} asked for: that applies to a mesh the demo starts)" if host and host != running
                 else ")"))
        yield endpoints, Path(endpoints["token_file"]).read_text().strip(), False
        return
    if llm and (kube or istiod):
        raise MeshError("--llm runs on the local mesh (no --istiod, --kube yet)")
    if kube:
        from meshcache.ctl.kube.up import KubeUp, KubeUpConfig, check_prerequisites

        check_prerequisites()
        with tempfile.TemporaryDirectory(prefix="meshcache-demo-kube-") as tmp:
            print("starting Kubernetes in the loop (cluster, istiod in Kubernetes mode, control plane, injected "
                  "engine pods and a client pod on the test kubelet) ...")
            kmesh = KubeUp(KubeUpConfig(state_dir=Path(tmp)), log=lambda m: print(f"  {m}"))
            try:
                kmesh.start()
                yield kmesh.endpoints(), kmesh.mesh.token if kmesh.mesh else "", True
            finally:
                kmesh.stop()
            print("stopped the mesh.")
        return
    if istiod:
        from meshcache.ctl.istiod.mesh import IstiodMesh, IstiodMeshConfig

        with tempfile.TemporaryDirectory(prefix="meshcache-demo-istiod-") as tmp:
            print("starting a local mesh with a real istiod in the middle (redis, control plane, istiod, "
                  "engines, sidecars configured by istiod) ...")
            with IstiodMesh(IstiodMeshConfig(work_dir=Path(tmp), filter=host or "wasm"),
                            log=lambda m: print(f"  {m}")) as imesh:
                yield imesh.endpoints(), imesh.token, True
            print("stopped the mesh.")
        return
    with tempfile.TemporaryDirectory(prefix="meshcache-demo-") as tmp:
        config = MeshConfig(state_dir=Path(tmp), filter=host or "wasm", llm=llm,
                            policies={**DEMO_POLICIES, **(LLM_DEMO_POLICIES if llm else {})}).with_free_ports()
        print(f"starting a local mesh (redis, control plane, engines, two sidecars with mTLS; cache: "
              f"{HOST_NAMES[config.filter]}) ...")
        t0 = time.perf_counter()
        with Mesh(config, log=lambda m: print(f"  {m}")) as mesh:
            print(f"mesh up in {time.perf_counter() - t0:.1f}s")
            yield mesh.endpoints(), mesh.token, True
        print("stopped the mesh.")


def run(state_dir: Path | None, istiod: bool = False, host: str | None = None, kube: bool = False,
        llm: bool = False) -> int:
    with _mesh_for_demo(state_dir, istiod, host, kube, llm) as (endpoints, token, _started):
        api = PolicyApi(endpoints["control_plane_api"], token)
        if llm:
            try:
                _llm(endpoints, api)
            finally:
                api.close()
            return 0
        rng = np.random.default_rng(time.time_ns())
        if endpoints.get("mode") in ("istiod", "kube"):
            client = Client(endpoints["app_http"].removeprefix("http://"), endpoints["app_color"], rng,
                            app_grpc=endpoints["app_grpc"], authority=endpoints["app_authority"])
        else:
            client = Client(endpoints["app"], endpoints["app_color"], rng)
        try:
            _scenario(client, api, endpoints.get("canary_color", ""), _applied_by(endpoints, api))
        finally:
            client.close()
            api.close()
    return 0


def _llm(endpoints: dict[str, Any], api: PolicyApi) -> None:
    from meshcache.ctl.mesh import demo_llm

    with httpx.Client(base_url=f"http://{endpoints['app']}", timeout=30) as http:
        demo_llm.check_models(http)
        for version in demo_llm.ensure_policies(api.policies()["policies"], api.put):
            api.wait_acked(SERVER_NODE, version)
        seed = time.time_ns() // 1000
        demo_llm.scenario(http, seed)
        url = endpoints.get("semantic")
        with httpx.Client(base_url=url, timeout=5) if url else contextlib.nullcontext() as semantic:
            demo_llm.semantic_scenario(http, semantic, seed)


Waiter = tuple[Callable[[int], None], str]


def _applied_by(endpoints: dict[str, Any], api: PolicyApi) -> Waiter:
    """How to wait until a policy version is in the server sidecar(s), and what to call it."""
    if endpoints.get("mode") == "kube":
        from meshcache.ctl.kube.up import wait_applied as wait_applied_kube

        return ((lambda version: wait_applied_kube(endpoints["istiod_debug"], endpoints["engine_netns"], version)),
                "the engine pods' sidecars (control plane -> MCP -> istiod -> istio-agent -> Envoy, ACK seen by "
                "istiod)")
    if endpoints.get("mode") != "istiod":
        return (lambda version: api.wait_acked(SERVER_NODE, version)), "the server sidecar (ECDS)"
    from meshcache.ctl.istiod.status import wait_applied

    engines = {p: sc["admin"] for p, sc in endpoints["sidecars"].items() if not p.startswith("meshcache-client")}
    return ((lambda version: wait_applied(endpoints["istiod_debug"], engines, version)),
            "the engine sidecars (control plane -> MCP -> istiod -> ECDS, ACK seen by istiod)")


def _apply(api: PolicyApi, change: Callable[[], dict[str, Any]], what: str, applied: Waiter) -> None:
    version = change()["version"]
    t0 = time.perf_counter()
    applied[0](version)
    print(f"\n{what}: policy version {version}, applied by {applied[1]} in "
          f"{(time.perf_counter() - t0) * 1000:.0f} ms")


def _scenario(c: Client, api: PolicyApi, canary: str, applied: Waiter) -> None:
    inputs = {m: c.tensor(m) for m in INPUTS}
    _header("each request twice, over gRPC and REST: the first is served by the engine, the second by the cache")
    for model, x in inputs.items():
        for send in (c.grpc, c.rest):
            send(model, x)
            send(model, x)
    if canary:
        _header(f"traffic colour {canary!r}: routed to the canary engine (mlp-classifier v1), cached separately")
        c.grpc("mlp-classifier", inputs["mlp-classifier"], color=canary)
        c.grpc("mlp-classifier", inputs["mlp-classifier"], color=canary)

    before = next(p for p in api.policies()["policies"] if p["model_prefix"] == "mlp-classifier")
    _apply(api, lambda: api.put("mlp-classifier", {"ttl_s": 30, "max_ttl_s": 30}), "TTL of mlp-classifier -> 30 s",
           applied)
    _header("stored entries keep their TTL; new entries get 30 s")
    c.grpc("mlp-classifier", inputs["mlp-classifier"])
    fresh = c.tensor("mlp-classifier")
    c.grpc("mlp-classifier", fresh)
    c.grpc("mlp-classifier", fresh)

    _apply(api, lambda: api.purge("resnet-mini"), "purge resnet-mini", applied)
    _header("after the purge the same request is a miss again, then cached anew")
    c.rest("resnet-mini", inputs["resnet-mini"])
    c.rest("resnet-mini", inputs["resnet-mini"])
    c.grpc("text-embedder", inputs["text-embedder"])  # other models keep their entries

    # Leave a shared mesh's policy as we found it.
    spec = policy_spec(before)
    api.put("mlp-classifier", spec)

    hits = [r.ms for r in c.rows if r.hit]
    misses = [r.ms for r in c.rows if not r.hit]
    print(f"\nhit ratio: {len(hits)}/{len(c.rows)} = {len(hits) / len(c.rows):.0%}")
    if hits and misses:
        print(f"mean latency: hit {statistics.fmean(hits):.2f} ms, miss {statistics.fmean(misses):.2f} ms "
              f"(hits {statistics.fmean(misses) / statistics.fmean(hits):.1f}x faster)")
