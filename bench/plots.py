"""PNG charts of each benchmark, drawn from the results it stores as JSON (docs/benchmarks/<name>.json).

The JSON is the one source of both a benchmark's table in docs/benchmarks.md and its charts:
`python -m bench.plots` redraws every chart from the stored results without re-running anything.
Rows with `quantiles_ms` (latency at 0, 1, ..., 100 %, as the benchmark recorded them) are drawn
as distributions; rows with only p50/p99 as bars. Where a benchmark stores each round's numbers
(`rounds_rps`, `rounds_vs_no_filter`), bars show the spread over the rounds.
"""

from __future__ import annotations

import json
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402 - after choosing the backend
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import FuncFormatter, NullFormatter  # noqa: E402

from meshcache.contract.paths import REPO_ROOT  # noqa: E402

RESULTS_DIR = REPO_ROOT / "docs" / "benchmarks"
Results = dict[str, Any]
COLORS = ("#2451b7", "#d9822b", "#17803d", "#b42318", "#7a4fb5", "#5b6678", "#0f8b8d", "#c2185b", "#8d6e00",
          "#9aa5b8")


def results_path(name: str, directory: Path = RESULTS_DIR) -> Path:
    return directory / f"{name}.json"


def save_results(name: str, results: Results, directory: Path = RESULTS_DIR) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = results_path(name, directory)
    path.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    return path


def load_results(name: str, directory: Path = RESULTS_DIR) -> Results:
    return json.loads(results_path(name, directory).read_text())  # type: ignore[no-any-return]


def _figure(title: str, results: Results, width: float = 9.0, height: float = 4.6) -> tuple[Figure, Axes]:
    fig, ax = plt.subplots(figsize=(width, height), dpi=100)
    ax.set_title(title, fontsize=12, loc="left")
    fig.text(0.01, 0.005, f"{results.get('date', '')}  {results.get('machine_short', '')}", fontsize=7, color="#5b6678")
    ax.grid(axis="y", color="#e3e7ee")
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    return fig, ax


def _save(fig: Figure, path: Path) -> Path:
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    fig.savefig(path, format="png", metadata={"Software": None})  # no timestamps: same data, same bytes
    plt.close(fig)
    return path


def _grouped_bars(ax: Axes, groups: list[str], series: dict[str, list[float | None]], fmt: str = "{:.0f}",
                  spread: dict[str, list[list[float]]] | None = None) -> None:
    """`spread`: per series and group, the values of each round (drawn as a min-max whisker)."""
    n = max(1, len(series))
    width = 0.8 / n
    for k, (label, values) in enumerate(series.items()):
        xs = [i + (k - (n - 1) / 2) * width for i in range(len(groups))]
        heights = [v if v is not None else 0.0 for v in values]
        bars = ax.bar(xs, heights, width * 0.95, label=label, color=COLORS[k % len(COLORS)])
        rounds = (spread or {}).get(label)
        if rounds:
            for x, vs in zip(xs, rounds, strict=True):
                if len(vs) > 1:
                    ax.vlines(x, min(vs), max(vs), color="#1d2430", linewidth=0.8)
                    ax.hlines([min(vs), max(vs)], x - width * 0.15, x + width * 0.15, color="#1d2430", linewidth=0.8)
        for bar, v in zip(bars, values, strict=True):
            if v is not None:
                ax.annotate(fmt.format(v), (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                            ha="center", va="bottom", fontsize=7, xytext=(0, 1), textcoords="offset points")
    wrap = max(10, 100 // max(1, len(groups)))  # narrower labels when there are more groups
    ax.set_xticks(range(len(groups)), [textwrap.fill(g, wrap) for g in groups], fontsize=8)
    ax.legend(fontsize=8, frameon=False)


def _cdf(ax: Axes, rows: list[dict[str, Any]], label: Callable[[dict[str, Any]], str]) -> bool:
    """Latency CDFs from each row's quantiles; False when no row has them."""
    drawn = False
    for k, row in enumerate(r for r in rows if r.get("quantiles_ms")):
        q = row["quantiles_ms"]
        ax.plot(q, [i / (len(q) - 1) for i in range(len(q))], label=label(row), color=COLORS[k % len(COLORS)],
                linestyle=("-", "--", ":")[(k // len(COLORS)) % 3], linewidth=1.6)
        drawn = True
    if drawn:
        ax.set_xscale("log")
        # Plain numbers (0.5, 1, 2, ...) rather than powers of ten, and no crowded minor labels.
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("latency, ms (log scale)")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.01)
        ax.legend(fontsize=8, frameon=False, loc="lower right")
    return drawn


def _percentile_bars(ax: Axes, rows: list[dict[str, Any]], label: Callable[[dict[str, Any]], str]) -> None:
    _grouped_bars(ax, [label(r) for r in rows], {"p50": [r.get("p50_ms") for r in rows],
                                                 "p99": [r.get("p99_ms") for r in rows]}, fmt="{:.1f}")
    ax.set_ylabel("latency, ms")


def _latency(results: Results, rows: list[dict[str, Any]], title: str, label: Callable[[dict[str, Any]], str],
             path: Path) -> Path:
    fig, ax = _figure(title, results)
    if not _cdf(ax, rows, label):
        _percentile_bars(ax, rows, label)
        ax.set_title(title + "\np50 and p99 only: this run recorded no raw samples", fontsize=12, loc="left")
    return _save(fig, path)


# ---- one function per benchmark: results -> chart files ------------------------------------

def plot_engine(results: Results, out: Path) -> list[Path]:
    rows = results["rows"]
    # Side-by-side servers per (transport, concurrency); older runs had one `config` per row.
    key = "server" if any("server" in r for r in rows) else "config"
    series = list(dict.fromkeys(r[key] for r in rows))
    groups = list(dict.fromkeys((r.get("transport", ""), r["concurrency"]) for r in rows))

    def value(name: str, group: tuple[str, int]) -> float | None:
        return next((r["rps"] for r in rows if r[key] == name and (r.get("transport", ""), r["concurrency"]) == group),
                    None)

    fig, ax = _figure(f"Engine throughput, {results.get('model', '')}", results, width=10.5)
    _grouped_bars(ax, [f"{t} c={c}".strip() for t, c in groups], {n: [value(n, g) for g in groups] for n in series})
    ax.set_ylabel("requests/s")
    throughput = _save(fig, out / "engine-throughput.png")
    shown = [r for r in rows if r.get("transport", "gRPC") == "gRPC"]
    latency = _latency(results, shown, "Engine latency (gRPC)", lambda r: f"{r[key]}, c={r['concurrency']}",
                       out / "engine-latency.png")
    rest = [r for r in rows if r.get("transport") == "REST"]
    if rest and all(r.get("quantiles_ms") for r in rest):  # wrk's distributions, recorded since 2026-12-01
        return [throughput, latency, _latency(results, rest, "Engine latency (REST, wrk)",
                                              lambda r: f"{r[key]}, c={r['concurrency']}",
                                              out / "engine-latency-rest.png")]
    return [throughput, latency]


def plot_mesh(results: Results, out: Path) -> list[Path]:
    rows = results["rows"]
    fig, ax = _figure("Local mesh throughput by case (same client, same concurrency)", results)
    shapes = list(dict.fromkeys((r["client"], r["concurrency"]) for r in rows))
    cases = list(dict.fromkeys(r["case"] for r in rows))

    def value(case: str, shape: tuple[str, int]) -> float | None:
        return next((r["rps"] for r in rows if r["case"] == case and (r["client"], r["concurrency"]) == shape), None)

    _grouped_bars(ax, [f"{c}, c={n}" for c, n in shapes], {case: [value(case, s) for s in shapes] for case in cases})
    ax.set_ylabel("requests/s")
    throughput = _save(fig, out / "mesh-throughput.png")
    grpc_rows = [r for r in rows if r["client"] == rows[0]["client"]]
    latency = _latency(results, grpc_rows, f"Local mesh latency ({rows[0]['client']} client)",
                       lambda r: f"{r['case']}, c={r['concurrency']}", out / "mesh-latency.png")
    return [throughput, latency]


def plot_mesh_hosts(results: Results, out: Path) -> list[Path]:
    hits = [r for r in results["rows"] if r["case"] == "hit"]
    shapes = list(dict.fromkeys((r["client"], r["concurrency"]) for r in hits))
    hosts = list(dict.fromkeys(r["host"] for r in hits))

    def value(host: str, shape: tuple[str, int]) -> float | None:
        return next((r["rps"] for r in hits if r["host"] == host and (r["client"], r["concurrency"]) == shape), None)

    fig, ax = _figure("Istio meshes: gRPC hits per second, Wasm vs native sidecars", results)
    _grouped_bars(ax, [f"{c}, c={n}" for c, n in shapes], {h: [value(h, s) for s in shapes] for h in hosts})
    ax.set_ylabel("requests/s")
    throughput = _save(fig, out / "mesh-hosts-throughput.png")
    latency = _latency(results, hits, "Istio meshes: gRPC hit latency, Wasm vs native sidecars",
                       lambda r: f"{r['host']}, {r['client']}, c={r['concurrency']}", out / "mesh-hosts-latency.png")
    return [throughput, latency]


def plot_propagation(results: Results, out: Path) -> list[Path]:
    rows = results["rows"]
    return [_latency(results, rows, "Policy propagation: PUT answered to ECDS ACK", lambda r: r["setup"],
                     out / "propagation-latency.png")]


def filter_series(mode: str) -> str | None:
    """The throughput chart's series a bench.filter mode belongs to (each host's hits and misses,
    whatever the size's variant of the mode, and the anchors); None: a table-only row."""
    if mode == "no filter":
        return None
    if mode in ("no filter (Envoy 1.39)", "Envoy cache filter, GET hits", "nginx proxy_cache, hits"):
        return mode
    if mode == "Wasm without held headers, hits (single pass)":
        return "Wasm hits, no held headers"
    host, _, kind = mode.partition(", ")
    if host in ("Wasm", "native", "native-1.39") and kind.split(" (")[0] in ("hits", "misses"):
        return f"{host} {kind.split(' (')[0]}"
    return None


def plot_filter(results: Results, out: Path) -> list[Path]:
    rows = results["rows"]
    shapes = list(dict.fromkeys((r["protocol"], r["answer"]) for r in rows))
    series = [s for s in dict.fromkeys(filter_series(r["mode"]) for r in rows) if s]

    def row(name: str, shape: tuple[str, str]) -> dict[str, Any] | None:
        return next((r for r in rows if filter_series(r["mode"]) == name and (r["protocol"], r["answer"]) == shape),
                    None)

    def ratio(name: str, shape: tuple[str, str]) -> float | None:
        r = row(name, shape)
        return r["vs_no_filter"] if r else None

    def rounds(name: str, shape: tuple[str, str]) -> list[float]:
        r = row(name, shape)
        return list(r.get("rounds_vs_no_filter") or []) if r else []

    spread = {m: [rounds(m, s) for s in shapes] for m in series}
    has_rounds = any(v for vs in spread.values() for v in vs)
    title = "Proxy throughput relative to Envoy without the filter (1.0 = no filter, the host's own Envoy)"
    fig, ax = _figure(title + ("\nwhiskers: min-max of the rounds' ratios (each round against its own no-filter run)"
                               if has_rounds else ""), results, width=11.5, height=5.6)
    _grouped_bars(ax, [f"{p} {a}" for p, a in shapes], {m: [ratio(m, s) for s in shapes] for m in series},
                  fmt="{:.2f}", spread=spread if has_rounds else None)
    ax.legend(fontsize=8, frameon=False, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.08))
    ax.axhline(1.0, color="#1d2430", linewidth=0.8)
    ax.set_ylabel("requests/s ÷ no filter")
    drawn = [_save(fig, out / "filter-throughput-ratio.png")]
    # Latency distributions where the run recorded them (wrk's histogram, h2load's request log).
    shown = [r for r in rows if r.get("quantiles_ms") and r["answer"] == "1 KiB"
             and r["mode"] in ("no filter", "Wasm, misses", "Wasm, hits", "Wasm, misses (no-cache)",
                               "Wasm, hits (single pass)", "native, misses", "native, hits",
                               "native, misses (no-cache)", "native, hits (single pass)",
                               "no filter (Envoy 1.39)", "native-1.39, hits", "native-1.39, hits (single pass)")]
    if shown:
        fig, ax = _figure("Filter latency, 1 KiB answers (16 connections, one load-generator thread)", results)
        _cdf(ax, shown, lambda r: f"{r['protocol']} {r['mode']}")
        drawn.append(_save(fig, out / "filter-latency.png"))
    return drawn


def plot_replicas(results: Results, out: Path) -> list[Path]:
    rows = results["rows"]
    fig, ax = _figure("Hit ratio vs replicas (round-robin, one cache per sidecar)", results, width=7.5)
    xs = [r["replicas"] for r in rows]
    ys = [r["hit_ratio"] for r in rows]
    ax.plot(xs, ys, marker="o", color=COLORS[0], linewidth=1.8)
    for x, y in zip(xs, ys, strict=True):
        ax.annotate(f"{y:.2f}", (x, y), textcoords="offset points", xytext=(0, 7), ha="center", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("replicas (sidecars, each with its own cache)")
    ax.set_ylabel("hit ratio")
    ax.set_ylim(0, 1)
    return [_save(fig, out / "replicas-hit-ratio.png")]


def plot_coalesce(results: Results, out: Path) -> list[Path]:
    return [_latency(results, results["rows"], "32 identical cold requests: latency of every caller",
                     lambda r: r["case"], out / "coalesce-latency.png")]


def plot_affinity(results: Results, out: Path) -> list[Path]:
    rows = results["rows"]
    labels = [r["label"] for r in rows]
    fig, ax = _figure("Hit ratio: one replica, three round robin, three with cache affinity", results)
    _grouped_bars(ax, labels, {"hit ratio": [r["hit_ratio"] for r in rows]}, fmt="{:.3f}")
    ax.set_ylim(0, 1)
    ax.set_ylabel("hit ratio")
    hit = _save(fig, out / "affinity-hit-ratio.png")
    fig, ax = _figure("Entries held, per replica (the same answers, copies counted)", results)
    n = max(len(r["entries_per_replica"]) for r in rows)
    _grouped_bars(ax, labels, {f"replica {k + 1}": [r["entries_per_replica"][k] if k < len(r["entries_per_replica"])
                                                    else None for r in rows] for k in range(n)})
    ax.set_ylabel("entries")
    entries = _save(fig, out / "affinity-entries.png")
    latency = _latency(results, rows, "Latency per request (client sidecar -> server sidecar -> origin)",
                       lambda r: r["label"], out / "affinity-latency.png")
    return [hit, entries, latency]


def plot_stale(results: Results, out: Path) -> list[Path]:
    return [_latency(results, results["rows"], "The first request after the TTL: latency",
                     lambda r: r["case"], out / "stale-latency.png")]


def plot_filter_ab(results: Results, out: Path) -> list[Path]:
    rows = results["rows"]
    fig, ax = _figure(f"Current filter build / build of {results.get('baseline_rev', 'baseline')}: req/s "
                      "(bars: mean, dots: each round)", results)
    labels = [f"{r['answer']} {r['mode']}" for r in rows]
    ax.bar(range(len(rows)), [r["ratio"] for r in rows], color=COLORS[0], width=0.6)
    for k, r in enumerate(rows):
        per_round = [c / b for b, c in zip(r["baseline_rps"], r["current_rps"], strict=True)]
        ax.scatter([k] * len(per_round), per_round, color=COLORS[1], s=14, zorder=3)
        ax.annotate(f"{r['ratio']:.2f}x", (k, r["ratio"]), textcoords="offset points", xytext=(14, 0), fontsize=8)
    ax.axhline(1.0, color="#555555", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(rows)), labels)
    ax.set_ylabel("current / baseline")
    return [_save(fig, out / f"{results.get('benchmark', 'filter-ab')}-ratio.png")]


PLOTTERS: dict[str, Callable[[Results, Path], list[Path]]] = {
    "engine": plot_engine, "mesh": plot_mesh, "propagation": plot_propagation, "filter": plot_filter,
    "replicas": plot_replicas, "coalesce": plot_coalesce, "affinity": plot_affinity, "stale": plot_stale,
    "filter-ab": plot_filter_ab, "filter-ab-grpc": plot_filter_ab, "mesh-hosts": plot_mesh_hosts,
}


def plot(name: str, results: Results, out: Path = RESULTS_DIR) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    return PLOTTERS[name](results, out)


def markdown_images(paths: list[Path], docs: Path = REPO_ROOT / "docs") -> str:
    """Image links relative to docs/benchmarks.md."""
    return "\n\n".join(f"![{p.stem}]({p.relative_to(docs).as_posix()})" for p in paths)


def main(argv: list[str] | None = None) -> int:
    names = (argv if argv is not None else sys.argv[1:]) or sorted(PLOTTERS)
    for name in names:
        if not results_path(name).exists():
            print(f"{name}: no stored results ({results_path(name)}); run `python -m bench.{name}`")
            continue
        for path in plot(name, load_results(name)):
            print(path.relative_to(REPO_ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
