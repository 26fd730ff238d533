"""Schemathesis against the OpenAPI spec of a real control-plane process: no 500s, ever.

Bounded examples per operation keep it fast; every operation runs with a write token (so
writes really happen) and again without (so the auth path is fuzzed too).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import Case
from schemathesis.checks import not_a_server_error

from meshcache.control_plane.api import create_app
from meshcache.control_plane.auth import TokenTable
from meshcache.control_plane.settings import Settings
from meshcache.control_plane.wiring import ControlPlane
from tests.helpers.control_plane import WRITE_TOKEN, ControlPlaneProc, module_control_plane


@pytest.fixture(scope="module")
def running_cp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlaneProc]:
    with module_control_plane(tmp_path_factory) as cp:
        # Something to read, purge and roll back to.
        cp.client().put("/v1/policies/seed", json={"ttl_s": 5})
        yield cp


def _spec() -> dict:
    # The spec is static: build it from the app without starting anything (the process under
    # test serves the same one, see test_served_spec_is_the_tested_one).
    return create_app(ControlPlane(Settings(), TokenTable([]))).openapi()


schema = schemathesis.openapi.from_dict(_spec())


def test_served_spec_is_the_tested_one(running_cp: ControlPlaneProc) -> None:
    served = running_cp.client(None).get("/openapi.json").json()
    assert served == _spec()
    assert {"/v1/policies", "/v1/policies/{model_prefix}", "/v1/purge", "/v1/snapshot",
            "/v1/snapshots/{version}", "/v1/rollback", "/v1/proxies", "/healthz", "/readyz",
            "/metrics"} <= set(served["paths"])


@schema.parametrize()
@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.filter_too_much,
                                 HealthCheck.too_slow])
def test_no_server_errors(case: Case, running_cp: ControlPlaneProc) -> None:
    for headers in ({"Authorization": f"Bearer {WRITE_TOKEN}"}, {}):
        response = case.call(base_url=running_cp.url, headers=headers)
        case.validate_response(response, checks=[not_a_server_error])
        assert response.status_code < 500 or response.status_code == 503 and "Redis" in response.text
