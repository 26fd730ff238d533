"""The meshcache filter's counters and gauges as one Envoy reports them: the one reader the
filter, control-plane and mesh tests use.

Keys are the filter's own metric names (docs/filter.md, "Metrics"): `meshcache.hits`,
`meshcache.policy.<prefix>.entries`, `meshcache.routed`, ...; Envoy's admin shows them in its
`wasmcustom.` namespace, which is left out here. The filter hands its metrics to Envoy every
200 ms (per worker), so a value just after traffic may be stale: wait for the value you assert
(`filter_stats_reaching`, or tests.helpers.wait.eventually)."""

from __future__ import annotations

from collections.abc import Mapping

from meshcache.ctl import launchers
from tests.helpers.wait import eventually

ENVOY_NAMESPACE = "wasmcustom."


def filter_stats(admin_port: int) -> dict[str, int]:
    """Every meshcache metric of the Envoy with this admin port, by the filter's name for it."""
    raw = launchers.envoy_stats(admin_port, f"{ENVOY_NAMESPACE}meshcache.")
    return {k.removeprefix(ENVOY_NAMESPACE): v for k, v in raw.items() if k.startswith(ENVOY_NAMESPACE)}


def filter_counter(admin_port: int, name: str) -> int:
    """One metric (`meshcache.hits`, ...) from `filter_stats`; 0 while the filter has not defined it."""
    return filter_stats(admin_port).get(name, 0)


def filter_stats_reaching(admin_port: int, expected: Mapping[str, int], timeout: float = 10.0) -> dict[str, int]:
    """Every meshcache metric, read once each metric in `expected` has its value (a metric the
    filter has not defined reads 0); fails naming the ones that never got there. Name every
    metric the test asserts an exact value of: only those are known to be flushed."""
    read: list[dict[str, int]] = []

    def reached() -> bool:
        stats = filter_stats(admin_port)
        off = {k: stats.get(k, 0) for k, v in expected.items() if stats.get(k, 0) != v}
        assert not off, f"expected {dict(expected)}, read {off}"
        read.append(stats)
        return True

    eventually(reached, timeout)
    return read[-1]
