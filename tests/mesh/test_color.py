"""Traffic colours: the client sidecar adds its colour unless the app set one; the server sidecar
routes `blue` to the canary engine; each colour has its own cache entries."""

from __future__ import annotations

import json

from meshcache.contract.protos import grpc_predict_v2_pb2 as pb
from meshcache.ctl.mesh.topology import Mesh
from tests.helpers.kserve import MLP, grpc_call, mlp_json, mlp_request, rest_infer
from tests.mesh.helpers import canary_engine_calls, default_engine_calls


def _version(response: bytes) -> str:
    return pb.ModelInferResponse.FromString(response).model_version


def test_blue_goes_to_the_canary_and_colours_are_cached_apart(mesh: Mesh) -> None:
    app, blue = mesh.endpoints()["app"], mesh.config.canary_color
    request = mlp_request(seed=2001).SerializeToString()
    default_before, canary_before = default_engine_calls(mesh, MLP), canary_engine_calls(mesh, MLP)

    # The sidecar's own colour: the default engine (mlp-classifier version 2).
    plain, status = grpc_call(app, request)
    assert status == "meshcache; fwd=miss; stored" and _version(plain) == "2"
    assert grpc_call(app, request)[1].startswith("meshcache; hit")

    # The same bytes coloured blue are another cache entry, served by the canary engine (version 1).
    colored, status = grpc_call(app, request, metadata=(("x-traffic-color", blue),))
    assert status == "meshcache; fwd=miss; stored" and _version(colored) == "1"
    assert colored != plain
    hit, status = grpc_call(app, request, metadata=(("x-traffic-color", blue),))
    assert status.startswith("meshcache; hit") and hit == colored

    assert default_engine_calls(mesh, MLP) == default_before + 1
    assert canary_engine_calls(mesh, MLP) == canary_before + 1


def test_an_app_chosen_colour_is_kept_and_keys_its_own_entries(mesh: Mesh) -> None:
    app = mesh.endpoints()["app"]
    body = mlp_json(seed=2002)
    default_before, canary_before = default_engine_calls(mesh, MLP), canary_engine_calls(mesh, MLP)
    # Another colour (not routed specially) still goes to the default engine, but is cached apart
    # from the sidecar's colour: the header the app sent reached the server sidecar unchanged.
    for color in ("green", ""):
        headers = {"x-traffic-color": color} if color else {}
        first = rest_infer(app, MLP, body, headers)
        assert first.headers["cache-status"] == "meshcache; fwd=miss; stored", color
        second = rest_infer(app, MLP, body, headers)
        assert second.headers["cache-status"].startswith("meshcache; hit")
        assert json.loads(second.content)["model_version"] == "2"
    assert default_engine_calls(mesh, MLP) == default_before + 2
    assert canary_engine_calls(mesh, MLP) == canary_before
    blue = rest_infer(app, MLP, body, {"x-traffic-color": mesh.config.canary_color})
    assert blue.headers["cache-status"] == "meshcache; fwd=miss; stored"
    assert json.loads(blue.content)["model_version"] == "1"
    assert canary_engine_calls(mesh, MLP) == canary_before + 1


def test_the_sidecar_sets_its_configured_colour(mesh: Mesh) -> None:
    app = mesh.endpoints()["app"]
    body = mlp_json(seed=2003)
    assert rest_infer(app, MLP, body).headers["cache-status"] == "meshcache; fwd=miss; stored"
    # Naming the sidecar's colour explicitly finds the entry stored without a colour from the app.
    explicit = rest_infer(app, MLP, body, {"x-traffic-color": mesh.config.color})
    assert explicit.headers["cache-status"].startswith("meshcache; hit")
