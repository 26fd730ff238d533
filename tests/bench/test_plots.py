"""Benchmark charts: drawn from the stored results, linked from docs/benchmarks.md, distributions when recorded."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bench import plots
from meshcache.contract.paths import REPO_ROOT

PNG = b"\x89PNG\r\n\x1a\n"
DOC = REPO_ROOT / "docs" / "benchmarks.md"


@pytest.mark.parametrize("name", sorted(plots.PLOTTERS))
def test_stored_results_draw_the_charts_the_doc_shows(name: str, tmp_path: Path) -> None:
    results = plots.load_results(name)
    drawn = plots.plot(name, results, tmp_path)
    assert drawn
    section = re.search(rf"<!-- bench:{name} -->(.*?)<!-- /bench:{name} -->", DOC.read_text(), re.S)
    assert section, f"no {name} section in {DOC}"
    for path in drawn:
        data = path.read_bytes()
        assert data.startswith(PNG) and len(data) > 10_000
        assert f"(benchmarks/{path.name})" in section.group(1), f"{path.name} not linked from the {name} section"
        assert (plots.RESULTS_DIR / path.name).exists(), f"{path.name} not committed beside {name}.json"


def test_recorded_quantiles_are_drawn_as_distributions(tmp_path: Path) -> None:
    rows = [{"setup": "a", "p50_ms": 2.0, "p99_ms": 9.0, "quantiles_ms": [1.0 + i / 10 for i in range(101)]},
            {"setup": "b", "p50_ms": 4.0, "p99_ms": 8.0, "quantiles_ms": [2.0 + i / 10 for i in range(101)]}]
    with_samples = plots.plot("propagation", {"rows": rows}, tmp_path / "cdf")[0].read_bytes()
    for r in rows:
        del r["quantiles_ms"]
    without = plots.plot("propagation", {"rows": rows}, tmp_path / "bars")[0].read_bytes()
    assert with_samples.startswith(PNG) and without.startswith(PNG) and with_samples != without


def test_filter_chart_series_are_each_hosts_hits_and_misses_and_the_anchors() -> None:
    assert plots.filter_series("native-1.39, hits (single pass)") == "native-1.39 hits"
    assert plots.filter_series("native, misses (no-cache), streamed") == "native misses"
    assert plots.filter_series("Wasm, hits") == "Wasm hits"
    assert plots.filter_series("Wasm without held headers, hits (single pass)") == "Wasm hits, no held headers"
    assert plots.filter_series("no filter (Envoy 1.39)") == "no filter (Envoy 1.39)"
    for table_only in ("no filter", "Wasm, loaded, request ignored", "Wasm, hits, request ids",
                       "Wasm, misses, request ids", "Wasm, hits, no request id"):
        assert plots.filter_series(table_only) is None, table_only
