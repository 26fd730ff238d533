"""bench/stats.py: the one percentile and result type every benchmark reports with."""

from __future__ import annotations

import pytest

from bench.stats import LatencyResult, ms, percentile, to_ms


def test_percentile_is_nearest_rank() -> None:
    values = [0.005, 0.001, 0.004, 0.002, 0.003]
    assert percentile(values, 0.5) == 0.003
    assert percentile(values, 0.99) == 0.005
    assert percentile(values, 1.0) == 0.005
    assert percentile(list(range(100)), 0.99) == 99
    with pytest.raises(ValueError):
        percentile([], 0.5)


def test_result_throughput_counts_batched_rows() -> None:
    single = LatencyResult([0.01] * 50, seconds=2.0)
    batched = LatencyResult([0.01] * 50, seconds=2.0, requests=400)
    assert single.throughput == 25 and batched.throughput == 200
    assert single.percentile(0.5) == 0.01


def test_rounds_distributions_merge_by_quantile() -> None:
    from bench.stats import mean_quantiles
    assert mean_quantiles([[1.0, 2.0, 4.0], None, [3.0, 4.0, 8.0]]) == [2.0, 3.0, 6.0]
    assert mean_quantiles([None, []]) is None


def test_formats() -> None:
    assert ms(0.0123) == "12.30" and ms(0.0123, digits=1) == "12.3"
    assert to_ms("250", "us") == 0.25 and to_ms("1.5", "s") == 1500
