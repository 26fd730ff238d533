"""The meshcache filter's counters and gauges as one Envoy reports them: the one reader the
filter, control-plane and mesh tests use.

Keys are the filter's own metric names (docs/filter.md, "Metrics"): `meshcache.hits`,
`meshcache.policy.<prefix>.entries`, `meshcache.routed`, ...; Envoy's admin shows them in its
`wasmcustom.` namespace, which is left out here. The filter hands its metrics to Envoy every
200 ms (per worker), so a value just after traffic may be stale: wait for the value you assert
(`filter_stats_reaching`, or tests.helpers.wait.eventually)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

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
    def reached(stats: dict[str, int]) -> None:
        off = {k: stats.get(k, 0) for k, v in expected.items() if stats.get(k, 0) != v}
        assert not off, f"expected {dict(expected)}, read {off}"

    return filter_stats_where(admin_port, reached, timeout)


def filter_stats_where(admin_port: int, check: Callable[[dict[str, int]], None],
                       timeout: float = 10.0) -> dict[str, int]:
    """Every meshcache metric, read once `check` (asserting on them) passes: for what
    `filter_stats_reaching` cannot name, bounds and sums (`waits <= 128`, `waits + overflow == n`);
    fails with the check's last assertion."""
    read: list[dict[str, int]] = []

    def passes() -> bool:
        stats = filter_stats(admin_port)
        check(stats)
        read.append(stats)
        return True

    eventually(passes, timeout)
    return read[-1]
