"""How many inference requests an engine has received, read from its Prometheus metrics."""

from __future__ import annotations

import httpx


def engine_requests(metrics_url: str, model: str) -> float:
    """Inference requests the engine has received for `model`, over both protocols."""
    return requests_in(httpx.get(metrics_url, timeout=5).text, model)


def requests_in(metrics: str, model: str) -> float:
    """`engine_requests` of an already read metrics page (e.g. one read inside a pod's namespace)."""
    total = 0.0
    for line in metrics.splitlines():
        if line.startswith("meshcache_engine_requests_total{") and f'model="{model}"' in line:
            total += float(line.rpartition(" ")[2])
    return total
