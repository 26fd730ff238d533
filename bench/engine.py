"""Engine benchmark: resnet-mini over gRPC, dynamic batching vs max_batch_size 1, and the engine's
overhead over calling onnxruntime directly. Run with `python -m bench.engine`; writes the `engine`
section of docs/benchmarks.md.

The load generator runs in this process on the same machine as the engine, as a closed loop of
C concurrent callers, each sending its next request when the previous answer arrives.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import onnxruntime as ort

from bench.report import table, write_section
from engine.demo_models import write_demo_models
from meshcache import procs
from meshcache.protos import grpc_predict_v2_pb2 as pb

MODEL = "resnet-mini"
ENGINE_BIN = str(Path(sys.executable).parent / "meshcache-engine")
INFER = "/inference.GRPCInferenceService/ModelInfer"


@dataclass
class Result:
    requests: int
    seconds: float
    latencies: list[float]

    @property
    def throughput(self) -> float:
        return self.requests / self.seconds

    def percentile(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _request_bytes(seed: int) -> bytes:
    x = np.random.default_rng(seed).standard_normal((1, 3, 32, 32)).astype(np.float32)
    request = pb.ModelInferRequest(model_name=MODEL)
    request.inputs.add(name="image", datatype="FP32", shape=[1, 3, 32, 32])
    request.raw_input_contents.append(x.tobytes())
    return request.SerializeToString()


async def _load(target: str, concurrency: int, warmup: float, duration: float) -> Result:
    payloads = [_request_bytes(i) for i in range(64)]
    latencies: list[float] = []
    async with grpc.aio.insecure_channel(target) as channel:
        call = channel.unary_unary(INFER)  # bytes in, bytes out: no client-side protobuf work
        start = time.perf_counter()
        measure_from, stop_at = start + warmup, start + warmup + duration

        async def caller(k: int) -> None:
            i = k
            while True:
                sent = time.perf_counter()
                if sent >= stop_at:
                    return
                await call(payloads[i % len(payloads)], timeout=30)
                if sent >= measure_from:
                    latencies.append(time.perf_counter() - sent)
                i += concurrency

        await asyncio.gather(*[caller(k) for k in range(concurrency)])
    return Result(len(latencies), duration, latencies)


def _raw_onnxruntime(model_path: Path, iterations: int) -> Result:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).standard_normal((1, 3, 32, 32)).astype(np.float32)
    for _ in range(200):
        session.run(None, {"image": x})
    latencies = []
    started = time.perf_counter()
    for _ in range(iterations):
        t = time.perf_counter()
        session.run(None, {"image": x})
        latencies.append(time.perf_counter() - t)
    return Result(iterations, time.perf_counter() - started, latencies)


def _repositories(root: Path) -> dict[str, Path]:
    batching, single = root / "batching", root / "single"
    write_demo_models(batching)
    write_demo_models(single)
    # Only resnet-mini is measured; the baseline engine never batches it.
    config_path = single / MODEL / "config.json"
    config = json.loads(config_path.read_text())
    config["max_batch_size"] = 1
    config["dynamic_batching"] = {"max_queue_delay_us": 0, "preferred_batch_sizes": [], "max_queue_size": 256}
    config_path.write_text(json.dumps(config))
    return {"dynamic batching": batching, "max_batch_size 1": single}


def _run_engine(
    repo: Path, log_dir: Path, name: str, levels: list[int], warmup: float, duration: float
) -> dict[int, Result]:
    grpc_port, http_port = procs.free_port(), procs.free_port()
    argv = [
        ENGINE_BIN,
        "--model-repository",
        str(repo),
        "--host",
        "127.0.0.1",
        "--http-port",
        str(http_port),
        "--grpc-port",
        str(grpc_port),
        "--metrics-port",
        "0",
    ]
    proc = procs.start(name, argv, log_dir)
    with procs.supervised([proc]):
        procs.wait_until(proc, procs.http_ok(f"http://127.0.0.1:{http_port}/v2/health/ready"), timeout=60)
        procs.wait_until(proc, procs.tcp_open(grpc_port), timeout=10)
        return {c: asyncio.run(_load(f"127.0.0.1:{grpc_port}", c, warmup, duration)) for c in levels}


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--duration", type=float, default=6.0, help="measured seconds per concurrency level")
    p.add_argument("--warmup", type=float, default=1.5)
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = p.parse_args(argv)
    levels = [1, 8, 32]
    # Both sides share this machine's cores, so other load skews the numbers: record it.
    load_before = os.getloadavg()[0]

    with tempfile.TemporaryDirectory(prefix="bench-engine-") as tmp:
        repos = _repositories(Path(tmp))
        raw = _raw_onnxruntime(repos["dynamic batching"] / MODEL / "1" / "model.onnx", 3000)
        results = {
            label: _run_engine(repo, Path(tmp) / "logs", label.replace(" ", "-"), levels, args.warmup, args.duration)
            for label, repo in repos.items()
        }

    rows = []
    for label, by_level in results.items():
        for c, r in by_level.items():
            rows.append([label, c, f"{r.throughput:.0f}", _ms(r.percentile(0.5)), _ms(r.percentile(0.99))])
    batched, single = results["dynamic batching"], results["max_batch_size 1"]
    speedup = batched[32].throughput / single[32].throughput
    raw_p50 = statistics.median(raw.latencies)
    overhead = single[1].percentile(0.5) - raw_p50
    overhead_batching = batched[1].percentile(0.5) - raw_p50
    body = "\n\n".join(
        [
            f"`python -m bench.engine`: `{MODEL}` (1x3x32x32 FP32) over gRPC with raw tensor contents; "
            "a closed "
            f"loop of C concurrent callers in one client process on the same machine, {args.duration:.0f} s "
            f"measured per level after {args.warmup:.1f} s warm-up. Dynamic batching uses the demo config "
            "(max_batch_size 16, max_queue_delay_us 1000, preferred 4/8/16); the baseline is the same model "
            "with max_batch_size 1. onnxruntime uses one intra-op thread per session in both. "
            f"1-minute load average when the run started: {load_before:.2f} on {os.cpu_count()} cores "
            "(anything above ~0.5 means other work competed for the CPU).",
            table(["config", "concurrency", "requests/s", "p50 ms", "p99 ms"], rows),
            table(
                ["measure", "value", "target", "met"],
                [
                    [
                        "batching throughput / max_batch_size 1, concurrency 32",
                        f"{speedup:.2f}x",
                        ">= 2x",
                        "yes" if speedup >= 2 else "no",
                    ],
                    ["raw onnxruntime `InferenceSession.run`, batch 1, p50", f"{_ms(raw_p50)} ms", "", ""],
                    [
                        "engine overhead at concurrency 1 (max_batch_size 1 p50 - raw p50)",
                        f"{_ms(overhead)} ms",
                        "< 1 ms",
                        "yes" if overhead < 1e-3 else "no",
                    ],
                    [
                        "same with dynamic batching (includes waiting out max_queue_delay_us)",
                        f"{_ms(overhead_batching)} ms",
                        "",
                        "",
                    ],
                ],
            ),
        ]
    )
    print(body)
    if not args.no_write:
        write_section("engine", "Engine: dynamic batching and overhead (resnet-mini, gRPC)", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
