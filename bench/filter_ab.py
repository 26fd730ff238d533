"""The current filter build against an earlier revision's, side by side (`python -m bench.filter_ab`).

bench.filter compares the filter with plain proxying; its absolute numbers move by tens of
percent between machines and runs, so two of its runs cannot tell whether a change made the
filter slower. This one can: two Envoys with the same config (one worker each), one running the
module built from `--baseline-rev` (a git worktree built by filter/build.sh, like `make filter`),
the other the current `filter/dist/meshcache_filter.wasm` (`--host native`: the dynamic module,
`filter/dist/libmeshcache_native.so`, built by `filter/build.sh native`), behind one nginx origin, driven by the
same wrk script shape as bench.filter (HTTP/1.1, 16 connections, one thread). Per answer size,
misses (every body new) and hits (one body), builds alternating in order from round to round.
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
from bench.loadgen import LoadResult, wrk
from bench.report import publish, table
from bench.stats import cpu_seconds
from meshcache.contract.paths import REPO_ROOT, require_filter_native, require_filter_wasm
from meshcache.ctl import launchers, procs
from meshcache.ctl.envoy_config import CacheProxy, write

DEFAULT_BASELINE = "667f1c9"  # the filter before cache affinity, coalescing and stale answers
BUILDS = ("baseline", "current")
MODES = {"misses": "unique.lua", "hits": "fixed.lua"}
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


def run_size(size: int, wasm: dict[str, Path], seconds: int, rounds: int, d: Path, host: str = "wasm") -> Results:
    d.mkdir(parents=True)
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
        for build in BUILDS:
            listen[build], admin = procs.free_port(), procs.free_port()
            module = {"native_module": wasm[build]} if host == "native" else {"wasm_path": wasm[build]}
            cfg = CacheProxy(listen_port=listen[build], admin_port=admin, http_upstream_port=ports["http_port"],
                             grpc_upstream_port=ports["grpc_port"], plugin_config=POLICY, **module)
            config = write(cfg, d / f"envoy-{build}.yaml")
            envoy = launchers.start_envoy(config, admin, d, name=f"envoy-{build}")
            started.append(envoy)
            pid[build] = envoy.popen.pid
        for n in range(rounds):
            for build in BUILDS if n % 2 == 0 else tuple(reversed(BUILDS)):
                for mode, script in MODES.items():
                    cpu = cpu_seconds(pid[build])
                    script = script.replace("unique", f"unique-{n}")
                    result = wrk(f"http://127.0.0.1:{listen[build]}/v2/models/bench/infer", d / script, seconds)
                    cpu_us = (cpu_seconds(pid[build]) - cpu) * 1e6 / max(1, result.requests)
                    out.setdefault((build, mode), []).append((result, cpu_us))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--baseline-rev", default=DEFAULT_BASELINE, help="git revision whose filter is the baseline")
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--sizes", default="1024,65536", help="answer sizes in bytes")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    parser.add_argument("--host", choices=sorted(HOSTS), default="wasm", help="which host of the cache core")
    args = parser.parse_args(argv)
    rows, stored = [], []
    with tempfile.TemporaryDirectory(prefix="meshcache-bench-filter-ab-") as tmp:
        current = require_filter_native() if args.host == "native" else require_filter_wasm()
        wasm = {"baseline": build_baseline(args.baseline_rev, Path(tmp), args.host), "current": current}
        for size in (int(s) for s in args.sizes.split(",")):
            label = f"{size // 1024} KiB"
            results = run_size(size, wasm, args.seconds, args.rounds, Path(tmp) / f"s{size}", args.host)
            for mode in MODES:
                rps = {b: [r.rps for r, _ in results[(b, mode)]] for b in BUILDS}
                cpu = {b: [c for _, c in results[(b, mode)]] for b in BUILDS}
                mean = {b: sum(v) / len(v) for b, v in rps.items()}
                cpu_mean = {b: sum(v) / len(v) for b, v in cpu.items()}
                per_round = [c / b for b, c in zip(rps["baseline"], rps["current"], strict=True)]
                errors = sum(r.errors for b in BUILDS for r, _ in results[(b, mode)])
                rows.append([label, mode, f"{mean['baseline']:,.0f}", f"{mean['current']:,.0f}",
                             f"{mean['current'] / mean['baseline']:.2f}x",
                             f"{min(per_round):.2f}-{max(per_round):.2f}",
                             f"{cpu_mean['baseline']:.0f}", f"{cpu_mean['current']:.0f}",
                             f"{cpu_mean['current'] / cpu_mean['baseline']:.2f}x", errors])
                stored.append({"answer": label, "mode": mode, "baseline_rps": rps["baseline"],
                               "current_rps": rps["current"], "ratio": mean["current"] / mean["baseline"],
                               "baseline_cpu_us": cpu["baseline"], "current_cpu_us": cpu["current"],
                               "cpu_ratio": cpu_mean["current"] / cpu_mean["baseline"], "errors": errors})
    body = "\n".join([
        f"`python -m bench.filter_ab --baseline-rev {args.baseline_rev}`: two Envoys (one worker each) with the "
        "same config and policy (coalescing at its default, on), one running the filter built from "
        f"`{args.baseline_rev}`, the other the current build, behind one nginx origin; wrk -t1 -c16 with "
        f"bench.filter's script shape; {args.rounds} rounds of {args.seconds} s per build and mode, the builds' "
        "order alternating per round. The ratio is current / baseline of the mean req/s; its range is the "
        "per-round ratios (a round runs both builds within seconds of each other). Envoy CPU µs/request: the "
        "Envoy process's user + system time over a run divided by the requests it served (mean of rounds).",
        "",
        table(["answer", "mode", "baseline req/s", "current req/s", "current / baseline", "per round",
               "baseline Envoy CPU µs/request", "current Envoy CPU µs/request", "CPU current / baseline", "errors"],
              rows),
    ])
    print(body)
    if not args.no_write:
        publish("filter-ab", f"Filter build against an earlier one ({args.baseline_rev})", body,
                {"baseline_rev": args.baseline_rev, "rows": stored})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
