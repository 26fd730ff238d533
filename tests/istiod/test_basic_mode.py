"""Basic mode through istiod: the control plane serves TrafficExtensions (Istio's Wasm extension
kind) with a `file://` module, which istiod itself turns into local code. REST is cached; gRPC is
not (istiod cannot ask Envoy to hold request headers for a TrafficExtension, so the filter runs
with `hold_headers: false` and gRPC requests bypass): shown here, not assumed."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from meshcache.contract.extensions import GRPC_PORT, HTTP_PORT
from meshcache.ctl.istiod.mesh import IstiodMesh
from tests.helpers.kserve import mlp_json, mlp_request
from tests.istiod.helpers import ROUTER, grpc_infer, hcm, inbound_listener, istiod_mesh, main_engine_calls, rest_infer

EXTENSION = "extensions.istio.io/trafficextension/meshcache.meshcache-green"


@pytest.fixture(scope="module")
def basic(tmp_path_factory: pytest.TempPathFactory) -> Iterator[IstiodMesh]:
    with istiod_mesh(tmp_path_factory, "istiod-basic", mode="basic", canary_color="") as m:
        yield m


def test_basic_mode_through_istiod(basic: IstiodMesh) -> None:
    """One test per mesh (a module's tests may land on both xdist workers): placement, then REST,
    then gRPC (which must come last: the filter stops trying gRPC hits after the first)."""
    placement(basic)
    rest_is_cached(basic)
    grpc_is_not_cached(basic)


def placement(basic: IstiodMesh) -> None:
    assert basic.istiod is not None
    kinds = {c["kind"] for c in basic.istiod.configz() if c["metadata"]["name"].startswith("meshcache")}
    assert "TrafficExtension" in kinds and "EnvoyFilter" not in kinds
    sc = basic.engines[0].sidecar
    assert sc is not None
    for port in (HTTP_PORT, GRPC_PORT):
        names = [f["name"] for f in hcm(inbound_listener(sc.config_dump(), port))["http_filters"]]
        assert EXTENSION in names and names[-1] == ROUTER, names
        assert names.index("envoy.filters.http.rbac") < names.index(EXTENSION), "after authz"
        assert "meshcache.grpc_hit_body" not in names, "no gRPC hit step in basic mode"


def rest_is_cached(basic: IstiodMesh) -> None:
    body = mlp_json(seed=2501)
    calls = main_engine_calls(basic, "mlp-classifier")
    first = rest_infer(basic, "mlp-classifier", body)
    # The headers went out before the body was read: "stored" is not claimed
    # (tests/filter/test_without_held_headers.py).
    assert first.headers["cache-status"] == "meshcache; fwd=miss"
    second = rest_infer(basic, "mlp-classifier", body)
    assert second.headers["cache-status"].startswith("meshcache; hit; ttl=") and second.content == first.content
    assert main_engine_calls(basic, "mlp-classifier") == calls + 1


def grpc_is_not_cached(basic: IstiodMesh) -> None:
    """What happens instead: the first repeat finds the stored answer but istiod built no hit
    route for a TrafficExtension, so the filter answers UNAVAILABLE once, logs it and bypasses gRPC
    from then on; the client's sidecar retries it (Istio's default route retries `unavailable`), so
    the app still gets the engine's answer."""
    sc = basic.engines[0].sidecar
    assert sc is not None
    request = mlp_request(seed=2502).SerializeToString()
    calls = main_engine_calls(basic, "mlp-classifier")
    assert basic.client is not None
    retries = r"^cluster\.outbound\|8001\|.*\.upstream_rq_retry$"
    assert sum(basic.client.stats(retries).values()) == 0
    first, s1 = grpc_infer(basic, request)
    second, s2 = grpc_infer(basic, request)
    third, s3 = grpc_infer(basic, request)
    assert first == second == third
    assert s1 == "meshcache; fwd=miss" and s2 == s3 == "meshcache; fwd=bypass; detail=no-hit-route", (s1, s2, s3)
    assert main_engine_calls(basic, "mlp-classifier") == calls + 3, "every call reached the engine"
    assert sum(basic.client.stats(retries).values()) == 1, "the UNAVAILABLE was retried by the client's sidecar"
    assert "the meshcache_grpc_hit route or the meshcache.grpc_hit_body Lua filter is missing" in (
        sc.envoy.log_path.read_text())
