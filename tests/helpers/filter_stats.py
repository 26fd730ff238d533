"""The meshcache filter's counters and gauges as one Envoy reports them: the one reader the
filter, control-plane and mesh tests use.

Keys are the filter's own metric names (docs/filter.md, "Metrics"): `meshcache.hits`,
`meshcache.policy.<prefix>.entries`, `meshcache.routed`, ...; Envoy's admin shows them in its
`wasmcustom.` namespace, which is left out here. The filter hands its metrics to Envoy every
200 ms (per worker), so a value just after traffic may be stale: wait for the value you assert
(tests.helpers.wait.eventually)."""

from __future__ import annotations

from meshcache.ctl import launchers

ENVOY_NAMESPACE = "wasmcustom."


def filter_stats(admin_port: int) -> dict[str, int]:
    """Every meshcache metric of the Envoy with this admin port, by the filter's name for it."""
    raw = launchers.envoy_stats(admin_port, f"{ENVOY_NAMESPACE}meshcache.")
    return {k.removeprefix(ENVOY_NAMESPACE): v for k, v in raw.items() if k.startswith(ENVOY_NAMESPACE)}


def filter_counter(admin_port: int, name: str) -> int:
    """One metric (`meshcache.hits`, ...) from `filter_stats`; 0 while the filter has not defined it."""
    return filter_stats(admin_port).get(name, 0)
