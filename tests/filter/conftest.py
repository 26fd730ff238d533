"""The filter suite runs against both hosts of the cache core (issue 24): the proxy-wasm filter
(`wasm`, what Istio loads) and the Envoy dynamic module (`native`), so neither drifts. A test that
takes a `host` argument runs once per host.

A test marked `@pytest.mark.envoy_1_39` runs a third time, as `native-1.39`: the module's Envoy
1.39 build (filter/dist/libmeshcache_native-envoy-1.39.so, what istio-proxy 1.31 would load) on
the real Envoy 1.39.3 that setup installs beside 1.40. A representative subset carries the mark
(REST and gRPC hits, pass-through, stale answers, background refresh, peer identity): the two
ABIs differ only in the version string for what the module uses (filter/native/DESIGN.md).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.filter.stack import HOSTS, SharedStacks

NATIVE_ENVOY_1_39 = "native-1.39"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "envoy_1_39: also runs on the module's Envoy 1.39 build on Envoy 1.39.3 (host native-1.39)"
    )


@pytest.fixture(scope="module")
def shared_stacks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedStacks]:
    """The module's shared filter stacks (tests.filter.stack.SharedStacks)."""
    stacks = SharedStacks(tmp_path_factory)
    try:
        yield stacks
    finally:
        stacks.close()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "host" in metafunc.fixturenames:
        extra = (NATIVE_ENVOY_1_39,) if metafunc.definition.get_closest_marker("envoy_1_39") else ()
        metafunc.parametrize("host", HOSTS + extra)
