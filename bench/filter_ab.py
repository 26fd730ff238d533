"""The current filter build against an earlier revision's, side by side (`python -m bench.filter_ab`).

bench.filter compares the filter with plain proxying; its absolute numbers move by tens of
percent between machines and runs, so two of its runs cannot tell whether a change made the
filter slower. This one can: two Envoys with the same config (one worker each), one running the
module built from `--baseline-rev` (a git worktree built by filter/build.sh, like `make filter`),
the other the current `filter/dist/meshcache_filter.wasm` (`--host native`: the dynamic module,
`filter/dist/libmeshcache_native.so`, built by `filter/build.sh native`), behind one nginx origin, driven by the
same wrk script shape as bench.filter (HTTP/1.1, 16 connections, one thread). Per answer size,
misses (every body new) and hits (one body), builds alternating in order from round to round.
`--protocol grpc`: single-pass gRPC hits instead (h2load, 16 connections, bench.filter's
ModelInferRequest with and without a request id, which the hit echoes), with a third Envoy
without the filter measured in the same rounds, so each build's rows also read as a ratio to
plain proxying.
Besides req/s it records each Envoy's CPU time per request (user + system), which moves less
with the machine's other load than throughput does (no hardware counters on these VMs).
Writes the `filter-ab` section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
from pathlib import Path

from bench import filter as bf
from bench.loadgen import LoadResult, h2load, wrk
from bench.report import publish, table
from bench.stats import cpu_seconds
from meshcache.contract.paths import REPO_ROOT, require_filter_native, require_filter_wasm
from meshcache.ctl import launchers, procs
from meshcache.ctl.envoy_config import CacheProxy, write

DEFAULT_BASELINE = "667f1c9"  # the filter before cache affinity, coalescing and stale answers
BUILDS = ("baseline", "current")
MODES = {"misses": "unique.lua", "hits": "fixed.lua"}
# gRPC: h2load repeats one body, so only hits; each mode's request file (bench.filter.infer_request).
GRPC_MODES = {"hits, request id": "grpc-request.bin", "hits, no request id": "grpc-request-no-id.bin"}
GRPC_HEADERS = ["content-type: application/grpc", "te: trailers"]
MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"
PLAIN = "plain"  # gRPC runs: an Envoy without the filter, measured each round
POLICY = {"version": "bench", "max_entry_bytes": 9 * 1_048_576, "max_total_bytes": 256 * 1_048_576,
          "policies": [{"model_prefix": "bench", "ttl_s": 3600}]}


HOSTS = {"wasm": ("release", "meshcache_filter.wasm"), "native": ("native", "libmeshcache_native.so")}


def build_baseline(rev: str, workdir: Path, host: str = "wasm") -> Path:
    """The module as `rev` builds it for `host` (a detached worktree, removed again by the caller's
    tempdir)."""
    tree = workdir / "baseline-tree"
    mode, name = HOSTS[host]
    subprocess.run(["git", "-C", str(REPO_ROOT), "worktree", "add", "--detach", "-q", str(tree), rev], check=True)
    try:
        subprocess.run([str(tree / "filter" / "build.sh"), mode], check=True, timeout=900)
        module = workdir / f"{rev}-{name}"
        shutil.copy(tree / "filter" / "dist" / name, module)
        return module
    finally:
        subprocess.run(["git", "-C", str(REPO_ROOT), "worktree", "remove", "--force", str(tree)], check=False)


Results = dict[tuple[str, str], list[tuple[LoadResult, float]]]  # (build, mode) -> (load, CPU µs/request) per round


def run_size(size: int, wasm: dict[str, Path], seconds: int, rounds: int, d: Path, host: str = "wasm",
             protocol: str = "http") -> Results:
    d.mkdir(parents=True)
    (d / "grpc-request.bin").write_bytes(bf.infer_request("bench-model"))
    (d / "grpc-request-no-id.bin").write_bytes(bf.infer_request("bench-model", with_id=False))
    (d / "fixed.lua").write_text(bf.REQUEST_LUA.format(body=bf.REQUEST_JSON, vary="0"))
    for n in range(rounds):
        # Each round's misses start past the last round's: wrk restarts its counter, and a body an
        # earlier round sent would be a hit (the stores keep every entry for an hour).
        (d / f"unique-{n}.lua").write_text(bf.REQUEST_LUA.format(body=bf.REQUEST_JSON, vary=f"n + {n * 10**9}"))
    out: Results = {}
    started: list[procs.Proc] = []
    with procs.supervised(started):
        ports = bf.start_origin(d, started, size)
        listen: dict[str, int] = {}
        pid: dict[str, int] = {}
        grpc = protocol == "grpc"
        for build in (*BUILDS, PLAIN) if grpc else BUILDS:
            listen[build], admin = procs.free_port(), procs.free_port()
            module = {"native_module": wasm[build]} if host == "native" and build != PLAIN else \
                {"wasm_path": wasm.get(build, wasm["current"])}
            cfg = CacheProxy(listen_port=listen[build], admin_port=admin, http_upstream_port=ports["http_port"],
                             grpc_upstream_port=ports["grpc_port"], plugin_config=POLICY, with_filter=build != PLAIN,
                             **module)
            config = write(cfg, d / f"envoy-{build}.yaml")
            envoy = launchers.start_envoy(config, admin, d, name=f"envoy-{build}")
            started.append(envoy)
            pid[build] = envoy.popen.pid
        if grpc:
            return run_grpc(listen, pid, seconds, rounds, d)
        for n in range(rounds):
            for build in BUILDS if n % 2 == 0 else tuple(reversed(BUILDS)):
                for mode, script in MODES.items():
                    cpu = cpu_seconds(pid[build])
                    script = script.replace("unique", f"unique-{n}")
                    result = wrk(f"http://127.0.0.1:{listen[build]}/v2/models/bench/infer", d / script, seconds)
                    cpu_us = (cpu_seconds(pid[build]) - cpu) * 1e6 / max(1, result.requests)
                    out.setdefault((build, mode), []).append((result, cpu_us))
    return out


def run_grpc(listen: dict[str, int], pid: dict[str, int], seconds: int, rounds: int, d: Path) -> Results:
    """Single-pass gRPC hits per build and mode, plain proxying once per round, orders alternating."""
    out: Results = {}

    def run(build: str, mode: str, request: str) -> None:
        cpu = cpu_seconds(pid[build])
        result = h2load(f"http://127.0.0.1:{listen[build]}{MODEL_INFER}", d / request, GRPC_HEADERS, seconds)
        cpu_us = (cpu_seconds(pid[build]) - cpu) * 1e6 / max(1, result.requests)
        out.setdefault((build, mode), []).append((result, cpu_us))

    for build in BUILDS:
        for request in GRPC_MODES.values():
            # Stores the answer (a miss), so the measured runs are hits.
            h2load(f"http://127.0.0.1:{listen[build]}{MODEL_INFER}", d / request, GRPC_HEADERS, 1, connections=1)
    for n in range(rounds):
        order = (*BUILDS, PLAIN) if n % 2 == 0 else (PLAIN, *reversed(BUILDS))
        for build in order:
            if build == PLAIN:
                run(PLAIN, "no filter", "grpc-request.bin")
                continue
            for mode, request in GRPC_MODES.items():
                run(build, mode, request)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--baseline-rev", default=DEFAULT_BASELINE, help="git revision whose filter is the baseline")
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--sizes", default="1024,65536", help="answer sizes in bytes")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    parser.add_argument("--host", choices=sorted(HOSTS), default="wasm", help="which host of the cache core")
    parser.add_argument("--protocol", choices=("http", "grpc"), default="http",
                        help="http: misses and hits (wrk); grpc: single-pass hits with and without a request id "
                             "(h2load), beside plain proxying")
    args = parser.parse_args(argv)
    grpc = args.protocol == "grpc"
    rows, stored = [], []
    with tempfile.TemporaryDirectory(prefix="meshcache-bench-filter-ab-") as tmp:
        current = require_filter_native() if args.host == "native" else require_filter_wasm()
        wasm = {"baseline": build_baseline(args.baseline_rev, Path(tmp), args.host), "current": current}
        for size in (int(s) for s in args.sizes.split(",")):
            label = f"{size // 1024} KiB" if size < 1_048_576 else f"{size // 1_048_576} MiB"
            results = run_size(size, wasm, args.seconds, args.rounds, Path(tmp) / f"s{size}", args.host, args.protocol)
            plain = [r.rps for r, _ in results.get((PLAIN, "no filter"), [])]
            plain_cpu = [c for _, c in results.get((PLAIN, "no filter"), [])]
            if plain:
                rows.append([label, "plain proxying (no filter)", "-", f"{sum(plain) / len(plain):,.0f}", "-", "-", "-",
                             "-", f"{sum(plain_cpu) / len(plain_cpu):.0f}", "-",
                             sum(r.errors for r, _ in results[(PLAIN, "no filter")])])
            for mode in GRPC_MODES if grpc else MODES:
                rps = {b: [r.rps for r, _ in results[(b, mode)]] for b in BUILDS}
                cpu = {b: [c for _, c in results[(b, mode)]] for b in BUILDS}
                mean = {b: sum(v) / len(v) for b, v in rps.items()}
                cpu_mean = {b: sum(v) / len(v) for b, v in cpu.items()}
                per_round = [c / b for b, c in zip(rps["baseline"], rps["current"], strict=True)]
                errors = sum(r.errors for b in BUILDS for r, _ in results[(b, mode)])
                # Each build against plain proxying in the same rounds (gRPC runs only).
                vs_plain = (f"{mean['baseline'] / (sum(plain) / len(plain)):.2f}x / "
                            f"{mean['current'] / (sum(plain) / len(plain)):.2f}x") if plain else "-"
                rows.append([label, mode, f"{mean['baseline']:,.0f}", f"{mean['current']:,.0f}",
                             f"{mean['current'] / mean['baseline']:.2f}x",
                             f"{min(per_round):.2f}-{max(per_round):.2f}", vs_plain,
                             f"{cpu_mean['baseline']:.0f}", f"{cpu_mean['current']:.0f}",
                             f"{cpu_mean['current'] / cpu_mean['baseline']:.2f}x", errors])
                stored.append({"answer": label, "mode": mode, "baseline_rps": rps["baseline"],
                               "current_rps": rps["current"], "ratio": mean["current"] / mean["baseline"],
                               "baseline_cpu_us": cpu["baseline"], "current_cpu_us": cpu["current"],
                               "cpu_ratio": cpu_mean["current"] / cpu_mean["baseline"], "errors": errors})
    body = "\n".join([
        f"`python -m bench.filter_ab --baseline-rev {args.baseline_rev}`: two Envoys (one worker each) with the "
        "same config and policy (coalescing at its default, on), one running the filter built from "
        f"`{args.baseline_rev}`, the other the current build, behind one nginx origin; "
        + ("h2load -t1 -c16, single-pass gRPC hits of bench.filter's ModelInferRequest with and without a request "
           "id, and a third Envoy without the filter in the same rounds; " if grpc else
           "wrk -t1 -c16 with bench.filter's script shape; ")
        + f"{args.rounds} rounds of {args.seconds} s per build and mode, the builds' "
        "order alternating per round. The ratio is current / baseline of the mean req/s; its range is the "
        "per-round ratios (a round runs both builds within seconds of each other). Envoy CPU µs/request: the "
        "Envoy process's user + system time over a run divided by the requests it served (mean of rounds).",
        "",
        table(["answer", "mode", "baseline req/s", "current req/s", "current / baseline", "per round",
               "baseline / current vs plain", "baseline Envoy CPU µs/request", "current Envoy CPU µs/request",
               "CPU current / baseline", "errors"],
              rows),
    ])
    print(body)
    if not args.no_write:
        # gRPC runs have their own section: they do not replace the HTTP one.
        publish("filter-ab-grpc" if grpc else "filter-ab",
                f"Filter build against an earlier one ({args.baseline_rev}{', gRPC hits' if grpc else ''})", body,
                {"baseline_rev": args.baseline_rev, "rows": stored})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
