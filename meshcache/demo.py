"""`make demo`: the engine behind an Envoy running the meshcache filter; each request twice.

Starts the KServe v2 engine with the demo models and an Envoy with the filter in front of it,
sends the same inference request twice over REST, gRPC and the simple `/v1/infer` form, prints
MISS then HIT with timings, and stops everything it started.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import httpx
import numpy as np

from engine.demo_models import write_demo_models
from meshcache import procs, services
from meshcache.envoy_config import CacheProxy, write
from meshcache.paths import require_filter_wasm
from meshcache.protos import grpc_predict_v2_pb2 as pb
from meshcache.protos import grpc_predict_v2_pb2_grpc as pb_grpc

POLICIES = {
    "version": "demo",
    "policies": [
        {"model_prefix": "resnet-mini", "ttl_s": 300},
        {"model_prefix": "mlp-classifier", "ttl_s": 300},
        {"model_prefix": "text-embedder", "ttl_s": 600},
    ],
}


def _rest_resnet(client: httpx.Client, base: str) -> Callable[[], str]:
    image = np.random.default_rng(7).random((1, 3, 32, 32), dtype=np.float32)
    body = {"inputs": [{"name": "image", "shape": [1, 3, 32, 32], "datatype": "FP32",
                        "data": image.reshape(-1).round(4).tolist()}]}

    def send() -> str:
        r = client.post(f"{base}/v2/models/resnet-mini/infer", json=body, timeout=10)
        r.raise_for_status()
        return r.headers.get("cache-status", "-")
    return send


def _grpc_mlp(target: str) -> Callable[[], str]:
    request = pb.ModelInferRequest(model_name="mlp-classifier")
    request.inputs.add(name="input", datatype="FP32", shape=[1, 16])
    request.raw_input_contents.append(np.linspace(-1, 1, 16, dtype=np.float32).tobytes())
    stub = pb_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(target))

    def send() -> str:
        _, call = stub.ModelInfer.with_call(request, timeout=10)
        return dict(call.initial_metadata()).get("cache-status", "-")
    return send


def _simple_embedder(client: httpx.Client, base: str) -> Callable[[], str]:
    def send() -> str:
        r = client.post(f"{base}/v1/infer", json={"input": [101, 2023, 2003, 1037, 3231, 102], "shape": [1, 6]},
                       headers={"x-model-id": "text-embedder"}, timeout=10)
        r.raise_for_status()
        return r.headers.get("cache-status", "-")
    return send


def main() -> None:
    wasm = require_filter_wasm()
    with tempfile.TemporaryDirectory(prefix="meshcache-demo-") as tmp_name:
        tmp = Path(tmp_name)
        write_demo_models(tmp / "models")
        started: list[procs.Proc] = []
        with procs.supervised(started), httpx.Client() as client:
            print("starting the engine (KServe v2 on onnxruntime) ...")
            engine = services.start_engine(tmp / "models", tmp)
            started.append(engine.proc)
            listen, admin = procs.free_port(), procs.free_port()
            proxy = CacheProxy(listen_port=listen, admin_port=admin, http_upstream_port=engine.http_port,
                               grpc_upstream_port=engine.grpc_port, wasm_path=wasm, plugin_config=POLICIES)
            print("starting Envoy with the meshcache filter ...")
            started.append(services.start_envoy(write(proxy, tmp / "envoy.yaml"), admin, tmp))
            base, target = f"http://127.0.0.1:{listen}", f"127.0.0.1:{listen}"
            cases = [
                ("resnet-mini", "REST /v2", _rest_resnet(client, base)),
                ("mlp-classifier", "gRPC", _grpc_mlp(target)),
                ("text-embedder", "REST /v1/infer", _simple_embedder(client, base)),
            ]
            print(f"\n{'model':<16} {'transport':<15} {'result':<5} {'latency':>9}  Cache-Status")
            for model, transport, send in cases:
                for _ in range(2):
                    t0 = time.perf_counter()
                    status = send()
                    ms = (time.perf_counter() - t0) * 1000
                    verdict = "HIT" if "; hit" in status else "MISS"
                    print(f"{model:<16} {transport:<15} {verdict:<5} {ms:>7.2f}ms  {status}")
            stats = services.envoy_stats(admin, "wasmcustom.meshcache")
            print(f"\nfilter: {stats.get('wasmcustom.meshcache.hits', 0)} hits, "
                  f"{stats.get('wasmcustom.meshcache.misses', 0)} misses, "
                  f"{stats.get('wasmcustom.meshcache.entries', 0)} entries cached")
        print("stopped everything.")


if __name__ == "__main__":
    main()
