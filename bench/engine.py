"""Engine benchmark (`python -m bench.engine`): resnet-mini on the engine side by side with MLServer,
dynamic batching against max_batch_size 1, the engine's overhead over onnxruntime, and Triton's
perf_analyzer against the engine and through the local mesh. Writes the `engine` and
`engine-perf-analyzer` sections of docs/benchmarks.md.

Peer: MLServer 1.7.1 (Seldon's KServe v2 server) with a minimal custom runtime on the same
onnxruntime and session options (one intra-op thread, sequential, all graph optimisations),
`parallel_workers: 0` (inference in the server process, as the engine) and adaptive batching
(max_batch_size 16, max_batch_time 1 ms: the engine's demo config has max_batch_size 16 and
max_queue_delay_microseconds 1000). MLServer pins protobuf 6 where the project pins 7, so it runs
from its own venv that this benchmark creates (pip, PyPI) outside the project venv.

Load: gRPC from one grpc.aio client in this process (raw request bytes, the same request for every
server: raw_input_contents), REST from wrk (a C client, one fixed KServe v2 JSON body); both a
closed loop of C concurrent callers (connections for wrk). All four servers (engine and MLServer,
batched and not) run for the whole benchmark and are measured in turn, round after round
(interleaved), so slow drifts of a shared machine hit them alike.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import onnxruntime as ort

from bench.loadgen import wrk
from bench.report import publish, table, write_section
from bench.stats import mean_quantiles, ms, percentile, quantiles_ms
from meshcache.contract.paths import REPO_ROOT
from meshcache.contract.protos import grpc_predict_v2_pb2 as pb
from meshcache.ctl import launchers, procs
from meshcache.engine import perf_analyzer
from meshcache.engine.demo_models import DEMO_MODELS, demo_config, write_demo_models
from meshcache.engine.model_config import CONFIG_FILE, to_text
from tests.helpers.kserve import MODEL_INFER

MODEL = "resnet-mini"
LIVE = "/inference.GRPCInferenceService/ServerLive"
MLSERVER_VERSION = "1.7.1"
MLSERVER_VENV = REPO_ROOT / ".bench" / f"mlserver-{MLSERVER_VERSION}"
LEVELS = [1, 8, 32]

# The MLServer runtime: decode, run, encode, nothing else (MLServer's documented custom-runtime shape).
MLSERVER_RUNTIME = '''
import onnxruntime as ort
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse
from mlserver.utils import get_model_uri


class OnnxModel(MLModel):
    async def load(self) -> bool:
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self._session = ort.InferenceSession(await get_model_uri(self.settings), options,
                                             providers=["CPUExecutionProvider"])
        self._input = self._session.get_inputs()[0].name
        self._outputs = [o.name for o in self._session.get_outputs()]
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        x = NumpyCodec.decode_input(payload.inputs[0])
        results = self._session.run(self._outputs, {self._input: x})
        return InferenceResponse(model_name=self.name, id=payload.id,
                                 outputs=[NumpyCodec.encode_output(n, y) for n, y in zip(self._outputs, results)])
'''


@dataclass
class Result:
    """One load level: from per-call latencies (gRPC) or a load generator's summary (wrk: p50/p99)."""

    requests: int
    seconds: float
    latencies: list[float] = field(default_factory=list)
    p50: float = 0.0
    p99: float = 0.0
    errors: int = 0
    # wrk's recorded latency distribution (ms, 0..100 %) where no per-call latencies exist.
    quantiles: list[float] | None = None

    @property
    def throughput(self) -> float:
        return self.requests / self.seconds

    def percentile(self, q: float) -> float:
        return percentile(self.latencies, q)


@dataclass
class Server:
    label: str
    grpc_target: str
    http_url: str


def _image_shape() -> list[int]:
    """One request's input shape, [1, C, H, W], from the demo model's config."""
    return [1, *DEMO_MODELS[MODEL][2]["input"][0]["dims"]]


def _images(rows: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, *_image_shape()[1:])).astype(np.float32)


def _request_bytes(seed: int) -> bytes:
    request = pb.ModelInferRequest(model_name=MODEL)
    request.inputs.add(name="image", datatype="FP32", shape=_image_shape())
    request.raw_input_contents.append(_images(1, seed).tobytes())
    return request.SerializeToString()


async def _grpc_load(target: str, concurrency: int, warmup: float, duration: float) -> Result:
    payloads = [_request_bytes(i) for i in range(64)]
    latencies: list[float] = []
    async with grpc.aio.insecure_channel(target) as channel:
        call = channel.unary_unary(MODEL_INFER)  # bytes in, bytes out: no client-side protobuf work
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
    r = Result(len(latencies), duration, latencies)
    r.p50, r.p99 = r.percentile(0.5), r.percentile(0.99)
    return r


def _rest_load(url: str, script: Path, concurrency: int, warmup: float, duration: float) -> Result:
    wrk(url, script, seconds=max(1, round(warmup)), connections=concurrency)
    out = wrk(url, script, seconds=max(1, round(duration)), connections=concurrency)
    # wrk counts socket errors (its 2 s timeout included) and non-2xx answers; reported per row.
    return Result(out.requests - out.errors, max(1, round(duration)), p50=(out.p50_ms or 0) / 1e3,
                  p99=(out.p99_ms or 0) / 1e3, errors=out.errors, quantiles=out.quantiles_ms)


def _wrk_script(path: Path) -> Path:
    x = _images(1, 0)
    body = {"inputs": [{"name": "image", "datatype": "FP32", "shape": _image_shape(),
                        "data": x.reshape(-1).tolist()}]}
    script = path / "infer.lua"
    script.write_text('wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
                      f"wrk.body = {json.dumps(json.dumps(body))}\n")
    return script


def _raw_onnxruntime(model_path: Path, batch: int, seconds: float) -> tuple[Result, Result]:
    """`InferenceSession.run` in this process, batch 1 and `batch` rows per call, alternating in
    short slices (so load that comes and goes on a shared machine hits both alike)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])
    inputs = {1: _images(1, 0), batch: _images(batch, 0)}
    for x in inputs.values():
        for _ in range(5):
            session.run(None, {"image": x})
    latencies: dict[int, list[float]] = {1: [], batch: []}
    spent = {1: 0.0, batch: 0.0}
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        for rows, x in inputs.items():
            slice_end = time.perf_counter() + 0.2
            while time.perf_counter() < slice_end:
                t = time.perf_counter()
                session.run(None, {"image": x})
                latencies[rows].append(time.perf_counter() - t)
                spent[rows] += latencies[rows][-1]
    return (Result(len(latencies[1]), spent[1], latencies[1]),
            Result(len(latencies[batch]) * batch, spent[batch], latencies[batch]))


async def _round_trips(target: str, method: str, payload: bytes, seconds: float) -> Result:
    """Sequential calls (concurrency 1) from the same kind of client the load generator uses."""
    latencies: list[float] = []
    async with grpc.aio.insecure_channel(target) as channel:
        call = channel.unary_unary(method)
        for _ in range(50):
            await call(payload, timeout=30)
        started = time.perf_counter()
        while time.perf_counter() - started < seconds:
            t = time.perf_counter()
            await call(payload, timeout=30)
            latencies.append(time.perf_counter() - t)
    return Result(len(latencies), time.perf_counter() - started, latencies)


# ---- servers --------------------------------------------------------------------------------

def _engine_repositories(root: Path) -> dict[str, Path]:
    batching, single = root / "engine-batching", root / "engine-single"
    write_demo_models(batching)
    write_demo_models(single)
    (single / MODEL / CONFIG_FILE).write_text(to_text(demo_config(
        MODEL, max_batch_size=1, dynamic_batching={"default_queue_policy": {"max_queue_size": 256}})))
    return {"batched": batching, "unbatched": single}


def ensure_mlserver() -> Path:
    """MLServer in its own venv (its protobuf pin conflicts with the project's); created once."""
    binary = MLSERVER_VENV / "bin" / "mlserver"
    if binary.exists():
        return binary
    print(f"creating {MLSERVER_VENV} (pip install mlserver=={MLSERVER_VERSION}) ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(MLSERVER_VENV)], check=True)
    subprocess.run([str(MLSERVER_VENV / "bin" / "pip"), "install", "-q", f"mlserver=={MLSERVER_VERSION}",
                    f"onnxruntime=={ort.__version__}"], check=True)
    return binary


def _mlserver_repository(root: Path, model_path: Path, batched: bool, ports: tuple[int, int, int]) -> Path:
    repo = root / f"mlserver-{'batched' if batched else 'unbatched'}"
    model_dir = repo / MODEL
    model_dir.mkdir(parents=True)
    (model_dir / "model.onnx").write_bytes(model_path.read_bytes())
    (model_dir / "runtime.py").write_text(MLSERVER_RUNTIME)
    settings: dict[str, object] = {"name": MODEL, "implementation": "runtime.OnnxModel",
                                   "parameters": {"uri": "./model.onnx"}}
    if batched:
        settings.update(max_batch_size=16, max_batch_time=0.001)
    (model_dir / "model-settings.json").write_text(json.dumps(settings))
    http, grpc_port, metrics = ports
    (repo / "settings.json").write_text(json.dumps({
        "debug": False, "parallel_workers": 0, "host": "127.0.0.1", "http_port": http, "grpc_port": grpc_port,
        "metrics_port": metrics}))
    return repo


def _start_mlserver(binary: Path, repo: Path, log_dir: Path, name: str) -> tuple[procs.Proc, Server]:
    settings = json.loads((repo / "settings.json").read_text())
    http, grpc_port = settings["http_port"], settings["grpc_port"]
    proc = procs.start_ready(name, [str(binary), "start", str(repo)], log_dir, [
        (procs.http_ok(f"http://127.0.0.1:{http}/v2/models/{MODEL}/ready"), 180, "ready"),
        (procs.tcp_open(grpc_port), 30, "serving gRPC"),
    ])
    return proc, Server(name, f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{http}")


# ---- report ---------------------------------------------------------------------------------

def _met(ok: bool) -> str:
    return "yes" if ok else "no"


def _describe_config() -> str:
    config = DEMO_MODELS[MODEL][2]
    db = config["dynamic_batching"]
    preferred = "/".join(str(n) for n in db["preferred_batch_size"])
    return (f"max_batch_size {config['max_batch_size']}, max_queue_delay_microseconds "
            f"{db['max_queue_delay_microseconds']}, preferred {preferred}")


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


Key = tuple[str, str, int]  # (transport, server label, concurrency)


def _side_by_side(runs: dict[Key, list[Result]]) -> tuple[list[list[object]], dict[str, float]]:
    rows: list[list[object]] = []
    worst: dict[str, float] = {}
    for transport in ("gRPC", "REST"):
        for mode in ("batched", "unbatched"):
            for c in LEVELS:
                eng, mls = runs[(transport, f"engine {mode}", c)], runs[(transport, f"MLServer {mode}", c)]
                ratios = [e.throughput / m.throughput for e, m in zip(eng, mls, strict=True)]
                worst[f"{transport} {mode} c={c}"] = min(ratios)
                rows.append([transport, mode, c,
                             f"{statistics.median(r.throughput for r in eng):.0f}",
                             f"{statistics.median(r.throughput for r in mls):.0f}",
                             f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})",
                             ms(statistics.median(r.p50 for r in eng)), ms(statistics.median(r.p50 for r in mls)),
                             ms(statistics.median(r.p99 for r in eng)), ms(statistics.median(r.p99 for r in mls)),
                             f"{sum(r.errors for r in eng)} / {sum(r.errors for r in mls)}"])
    return rows, worst


def _stored_rows(runs: dict[Key, list[Result]]) -> list[dict[str, object]]:
    """The numbers behind the table (medians over rounds, each round's throughput) and the latency
    distribution: over all rounds' calls where the client timed each (gRPC), else the mean of the
    rounds' distributions as wrk recorded them (REST)."""
    out: list[dict[str, object]] = []
    for (transport, server, c), results in sorted(runs.items()):
        latencies = [x for r in results for x in r.latencies]
        out.append({"transport": transport, "server": server, "concurrency": c,
                    "rps": round(statistics.median(r.throughput for r in results), 1),
                    "rounds_rps": [round(r.throughput, 1) for r in results],
                    "p50_ms": statistics.median(r.p50 for r in results) * 1e3,
                    "p99_ms": statistics.median(r.p99 for r in results) * 1e3,
                    "errors": sum(r.errors for r in results),
                    **({"quantiles_ms": quantiles_ms(latencies)} if latencies else
                       {"quantiles_ms": q} if (q := mean_quantiles([r.quantiles for r in results])) else {})})
    return out


def _perf_analyzer_section(engine: launchers.Engine, mesh_levels: list[int], measurement_ms: int) -> str:
    """perf_analyzer against the engine (both transports) and through the local mesh's app port."""
    from meshcache.ctl.mesh.config import MeshConfig
    from meshcache.ctl.mesh.topology import Mesh

    rows: list[list[object]] = []
    for protocol, url in (("gRPC", engine.grpc_target), ("HTTP", f"127.0.0.1:{engine.http_port}")):
        for r in perf_analyzer.run(MODEL, url, protocol.lower(), mesh_levels, measurement_ms=measurement_ms):
            rows.append(["engine (dynamic batching)", protocol, r.concurrency, f"{r.throughput:.0f}",
                         f"{r.p50_us / 1e3:.2f}", f"{r.p99_us / 1e3:.2f}", f"{r.server_queue_us}",
                         f"{r.server_compute_infer_us}"])
    with tempfile.TemporaryDirectory(prefix="bench-mesh-") as tmp:
        import dataclasses

        config = dataclasses.replace(MeshConfig(state_dir=Path(tmp)), canary_color="").with_free_ports()
        with Mesh(config, log=lambda _: None) as mesh:
            app = mesh.endpoints()["app"]
            for protocol in ("gRPC", "HTTP"):
                for r in perf_analyzer.run(MODEL, app, protocol.lower(), mesh_levels, measurement_ms=measurement_ms,
                                           extra=["-x", "1"]):
                    rows.append(["local mesh app port (hits)", protocol, r.concurrency, f"{r.throughput:.0f}",
                                 f"{r.p50_us / 1e3:.2f}", f"{r.p99_us / 1e3:.2f}", "-", "-"])
    return "\n\n".join([
        f"`python -m bench.engine`: Triton's perf_analyzer 2.41.0 (from the tritonclient wheel) on `{MODEL}`, "
        f"batch size 1, its default random input (one tensor, repeated), synchronous requests, "
        f"{measurement_ms} ms measurement windows, each number the average of the last three (its stability "
        "check off: the machine is shared). Against the engine "
        "(demo config, dynamic batching) and through the local mesh's app port (`meshcache up` topology: client "
        "sidecar, mTLS, server sidecar with the filter; no canary), where the repeated input is a cache hit "
        "after its first answer. Through the cache perf_analyzer needs the version (`-x 1`): every request is a "
        "hit, the engine's statistics do not move, and perf_analyzer finds no version that served them. "
        "Server queue / compute infer come from the engine's statistics extension (microseconds per request). "
        f"`uptime` at the end: {_uptime()}.",
        table(["target", "protocol", "concurrency", "infer/s", "p50 ms", "p99 ms", "server queue us",
               "server compute infer us"], rows),
    ])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--duration", type=float, default=4.0, help="measured seconds per run")
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds over all servers")
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    p.add_argument("--skip-perf-analyzer", action="store_true")
    args = p.parse_args(argv)
    max_batch = DEMO_MODELS[MODEL][2]["max_batch_size"]
    uptime_before = _uptime()
    mlserver = ensure_mlserver()

    with tempfile.TemporaryDirectory(prefix="bench-engine-") as tmp_name:
        tmp = Path(tmp_name)
        repos = _engine_repositories(tmp)
        model_path = repos["batched"] / MODEL / "1" / "model.onnx"
        raw, raw_batch = _raw_onnxruntime(model_path, max_batch, 8.0)
        script = _wrk_script(tmp)
        servers: list[Server] = []
        children: list[procs.Proc] = []
        with procs.supervised(children):
            engines: dict[str, launchers.Engine] = {}
            for mode, repo in repos.items():
                engine = launchers.start_engine(repo, tmp / "logs", name=f"engine-{mode}")
                children.append(engine.proc)
                engines[mode] = engine
                servers.append(Server(f"engine {mode}", engine.grpc_target, engine.http_url))
            for batched in (True, False):
                ports = (procs.free_port(), procs.free_port(), procs.free_port())
                repo = _mlserver_repository(tmp, model_path, batched, ports)
                mode = "batched" if batched else "unbatched"
                proc, server = _start_mlserver(mlserver, repo, tmp / "logs", f"MLServer {mode}")
                children.append(proc)
                servers.append(server)
            runs: dict[Key, list[Result]] = {}
            loads: dict[str, Callable[[Server, int], Result]] = {
                "gRPC": lambda s, c: asyncio.run(_grpc_load(s.grpc_target, c, args.warmup, args.duration)),
                "REST": lambda s, c: _rest_load(f"{s.http_url}/v2/models/{MODEL}/infer", script, c, args.warmup,
                                                args.duration),
            }
            for k in range(args.rounds):
                # Rotate the server order each round so no server always runs first (or right after another).
                order = servers[k % len(servers):] + servers[:k % len(servers)]
                for transport, load in loads.items():
                    for c in LEVELS:
                        for server in order:
                            print(f"round {k + 1}: {transport} c={c} {server.label} ...", flush=True)
                            runs.setdefault((transport, server.label, c), []).append(load(server, c))
            live = asyncio.run(_round_trips(engines["unbatched"].grpc_target, LIVE,
                                            pb.ServerLiveRequest().SerializeToString(), 3.0))
            single_c1 = asyncio.run(_grpc_load(engines["unbatched"].grpc_target, 1, args.warmup, 5.0))
            raw_again, _ = _raw_onnxruntime(model_path, max_batch, 4.0)
            pa_section = None
            if not args.skip_perf_analyzer:
                pa_section = _perf_analyzer_section(engines["batched"], [1, 8], 1000)
    uptime_after = _uptime()

    rows, worst = _side_by_side(runs)
    eng_b = runs[("gRPC", "engine batched", 32)]
    eng_s = runs[("gRPC", "engine unbatched", 32)]
    gains = [b.throughput / s.throughput for b, s in zip(eng_b, eng_s, strict=True)]
    vs_mls_32 = [e.throughput / m.throughput
                 for e, m in zip(eng_b, runs[("gRPC", "MLServer batched", 32)], strict=True)]
    raw_p50 = statistics.median(raw.latencies + raw_again.latencies)
    raw_row_batched = statistics.median(raw_batch.latencies) / max_batch
    overhead = single_c1.percentile(0.5) - raw_p50
    below = sorted(k for k, v in worst.items() if v < 1.0)
    shape = "x".join(str(d) for d in _image_shape())
    body = "\n\n".join([
        f"`python -m bench.engine`: `{MODEL}` ({shape} FP32 per request). gRPC: a closed loop of C concurrent "
        f"callers in one grpcio (aio) client process, raw tensor contents; REST: wrk with C connections and one "
        f"KServe v2 JSON body (3072 numbers). {args.rounds} interleaved rounds over four servers running side by "
        f"side (engine and MLServer {MLSERVER_VERSION}, each batched and unbatched), {args.duration:.0f} s "
        f"measured per run after {args.warmup:.0f} s warm-up; the table gives medians and the engine/MLServer "
        f"ratio's median (min-max over rounds). Engine batched: the demo config ({_describe_config()}); "
        "unbatched: max_batch_size 1. MLServer: a minimal custom runtime on the same onnxruntime and session "
        "options, parallel_workers 0, adaptive batching max_batch_size 16 / max_batch_time 1 ms (batched) or "
        "none. One intra-op thread per onnxruntime session everywhere. The model (engine/demo_models.py) is a "
        "ResNet-18-layout trunk with a VGG-style 2x2048 fully connected head: what batching saves is mostly the "
        "head's weight traffic. The machine was shared with other engineers' tests and benchmarks while this ran "
        f"(2 cores): `uptime` before: {uptime_before}; after: {uptime_after}.",
        table(["transport", "mode", "concurrency", "engine req/s", "MLServer req/s", "engine / MLServer",
               "engine p50 ms", "MLServer p50 ms", "engine p99 ms", "MLServer p99 ms",
               "errors (engine / MLServer)"], rows),
        table(["measure", "value", "target", "met"], [
            ["engine batched / MLServer batched, gRPC, concurrency 32 (worst round)",
             f"{min(vs_mls_32):.2f}x", ">= 2x", _met(min(vs_mls_32) >= 2)],
            ["engine below MLServer in any row and round", ", ".join(below) or "none", "none", _met(not below)],
            ["batching gain: batched / max_batch_size 1, gRPC, concurrency 32 (median of rounds)",
             f"{statistics.median(gains):.2f}x", ">= 3x", _met(statistics.median(gains) >= 3)],
            ["raw onnxruntime `InferenceSession.run`, batch 1, p50", f"{ms(raw_p50)} ms", "", ""],
            [f"raw onnxruntime per-row speedup, batch {max_batch} vs 1 (ceiling for batching)",
             f"{raw_p50 / raw_row_batched:.2f}x", "", ""],
            ["engine overhead at concurrency 1 (unbatched gRPC p50 - raw p50)", f"{ms(overhead)} ms", "<= 0.5 ms",
             _met(overhead <= 0.5e-3)],
            ["part of that overhead: bare gRPC round trip from this client (ServerLive p50, no model)",
             f"{ms(live.percentile(0.5))} ms", "", ""],
        ]),
    ])
    print(body)
    if pa_section:
        print(pa_section)
    if not args.no_write:
        publish("engine", f"Engine vs MLServer: batching, overhead ({MODEL}, gRPC and REST)", body,
                {"model": MODEL, "rows": _stored_rows(runs), "rounds": args.rounds})
        if pa_section:
            write_section("engine-perf-analyzer", f"perf_analyzer against the engine and the mesh ({MODEL})",
                          pa_section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
