"""The filter suite runs against both hosts of the cache core (issue 24): the proxy-wasm filter
(`wasm`, what Istio loads) and the Envoy dynamic module (`native`), so neither drifts.

A test that takes a `host` argument runs once per host. A test marked
`@pytest.mark.wasm_only("why")` tests something the native host does not do yet: it still runs
there, as a strict expected failure, so it shows in every run with its reason, a native change
that makes it pass fails the run until the mark goes, and the Wasm host's run is unchanged.

A test marked `@pytest.mark.envoy_1_39` runs a third time, as `native-1.39`: the module's Envoy
1.39 build (filter/dist/libmeshcache_native-envoy-1.39.so, what istio-proxy 1.31 would load) on
the real Envoy 1.39.3 that setup installs beside 1.40. A representative subset carries the mark
(REST and gRPC hits, pass-through, stale answers, background refresh, peer identity): the two
ABIs differ only in the version string for what the module uses (filter/native/DESIGN.md).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.filter.stack import SharedStacks

HOSTS = ("wasm", "native")
NATIVE_ENVOY_1_39 = "native-1.39"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "wasm_only(reason): the native host lacks this yet (runs there as a strict xfail)"
    )
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
    if "host" not in metafunc.fixturenames:
        return
    mark = metafunc.definition.get_closest_marker("wasm_only")
    params = []
    hosts = HOSTS + ((NATIVE_ENVOY_1_39,) if metafunc.definition.get_closest_marker("envoy_1_39") else ())
    for host in hosts:
        marks = []
        if host != "wasm" and mark is not None:
            reason = mark.args[0] if mark.args else mark.kwargs.get("reason", "")
            assert reason, f"{metafunc.definition.nodeid}: wasm_only needs the reason"
            marks = [pytest.mark.xfail(reason=f"wasm only: {reason}", strict=True)]
        params.append(pytest.param(host, id=host, marks=marks))
    metafunc.parametrize("host", params)
