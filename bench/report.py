"""Writes one benchmark's results into its own section of docs/benchmarks.md.

Each benchmark owns a section between `<!-- bench:NAME -->` and `<!-- /bench:NAME -->`, so
benchmarks can be re-run one at a time without clobbering each other's numbers.
"""

from __future__ import annotations

import datetime as dt
import os
import platform
import re
from pathlib import Path
from typing import Any

from meshcache.contract.paths import REPO_ROOT

BENCHMARKS_MD = REPO_ROOT / "docs" / "benchmarks.md"
HEADER = ("# Benchmarks\n\nEach section is written by the benchmark named in it (`make bench` runs them all). "
          "Its raw results are\nstored in `docs/benchmarks/<name>.json`, the charts beside them are drawn from "
          "those\n(`python -m bench.plots` redraws them without re-running anything).\n")


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{cpu}, {os.cpu_count()} cores, {mem_gib:.0f} GiB, {platform.platform()}"


def now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")


def machine_line() -> str:
    return f"Machine: {machine()}. Date: {now()}."


def write_section(name: str, title: str, body_markdown: str, path: Path = BENCHMARKS_MD) -> None:
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    section = f"{start}\n## {title}\n\n{machine_line()}\n\n{body_markdown.strip()}\n{end}"
    text = path.read_text() if path.exists() else HEADER
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    text = pattern.sub(lambda _: section, text) if pattern.search(text) else text.rstrip() + "\n\n" + section + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def publish(name: str, title: str, body_markdown: str, results: dict[str, Any]) -> None:
    """Store a run's results (the numbers of its tables, and latency quantiles where recorded) as
    docs/benchmarks/<name>.json, draw its charts from them, and write its section with the charts."""
    from bench import plots  # matplotlib only when publishing

    cpu = machine().split(",")
    results = {**results, "benchmark": name, "machine": machine(), "date": now(),
               "machine_short": f"{cpu[0]}, {cpu[1].strip()}", "load_average_1m": os.getloadavg()[0]}
    plots.save_results(name, results)
    images = plots.plot(name, results)
    write_section(name, title, body_markdown.rstrip() + "\n\n" + plots.markdown_images(images))


def table(headers: list[str], rows: list[list[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
