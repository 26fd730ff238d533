"""How many inference requests an engine has received, read from its Prometheus metrics."""

from __future__ import annotations

import httpx


def engine_requests(metrics_url: str, model: str) -> float:
    """Inference requests the engine has received for `model`, over both protocols."""
    total = 0.0
    for line in httpx.get(metrics_url, timeout=5).text.splitlines():
        if line.startswith("meshcache_engine_requests_total{") and f'model="{model}"' in line:
            total += float(line.rpartition(" ")[2])
    return total
