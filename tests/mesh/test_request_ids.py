"""Clients that send a fresh request id per call, through the local mesh: tritonclient with
`request_id`, and KServe's own Python SDK with default requests. Hits carry each caller's own id
and never reach the engine."""

from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path

import numpy as np
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp

from meshcache.contract.filter_config import policy_spec
from meshcache.contract.paths import REPO_ROOT
from meshcache.ctl.mesh.topology import SERVER_NODE, Mesh
from meshcache.ctl.procs import local_http
from tests.helpers.kserve import mlp_json, rest_infer
from tests.mesh.helpers import default_engine_calls

KSERVE_PYTHON = REPO_ROOT / ".venv-kserve" / "bin" / "python"
KSERVE_CLIENT = Path(__file__).with_name("kserve_client.py")


def test_tritonclient_request_ids_hit_with_their_own_ids(mesh: Mesh) -> None:
    app = mesh.endpoints()["app"]
    x = np.random.default_rng(1701).random((1, 16), dtype=np.float32)
    http_client, grpc_client = thttp.InferenceServerClient(app), tgrpc.InferenceServerClient(app)
    before = default_engine_calls(mesh, "mlp-classifier")
    try:
        outputs = []
        for _ in range(4):
            rid = str(uuid.uuid4())
            inp = thttp.InferInput("input", [1, 16], "FP32")
            inp.set_data_from_numpy(x)  # tritonclient's default: binary tensors
            result = http_client.infer("mlp-classifier", [inp], request_id=rid)
            assert result.get_response()["id"] == rid
            outputs.append(result.as_numpy("probabilities"))
            g_inp = tgrpc.InferInput("input", [1, 16], "FP32")
            g_inp.set_data_from_numpy(x)
            g_result = grpc_client.infer("mlp-classifier", [g_inp], request_id=rid + "-g")
            assert g_result.get_response().id == rid + "-g"
            outputs.append(g_result.as_numpy("probabilities"))
    finally:
        http_client.close()
        grpc_client.close()
    assert default_engine_calls(mesh, "mlp-classifier") == before + 2, "one miss per protocol; the rest were hits"
    assert all(o.tobytes() == outputs[0].tobytes() for o in outputs)


def test_kserve_sdk_default_requests_hit_with_their_own_ids(mesh: Mesh) -> None:
    before = default_engine_calls(mesh, "mlp-classifier")
    run = subprocess.run([str(KSERVE_PYTHON), str(KSERVE_CLIENT), "--app", mesh.endpoints()["app"], "--seed", "1702"],
                         capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    calls = json.loads(run.stdout)
    rest = calls["rest"]
    # The SDK sent a fresh UUID each time, and each answer carries the caller's own.
    assert len({c["sent"] for c in rest}) == 3
    assert all(uuid.UUID(c["sent"]) and c["answered"] == c["sent"] for c in rest)
    assert [c["cache_status"].split(";")[1].strip() for c in rest] == ["fwd=miss", "hit", "hit"], rest
    for kind in ("grpc_default", "grpc_with_id"):
        assert all(c["output"] == calls[kind][0]["output"] for c in calls[kind])
    assert all(c["answered"] == "" for c in calls["grpc_default"]), "no id in, no id out"
    assert all(c["answered"] == c["sent"] for c in calls["grpc_with_id"])
    assert all(c["output"] == rest[0]["output"] for c in rest)
    # One miss per kind of call (REST, gRPC without id, gRPC with ids); every other call a hit.
    assert default_engine_calls(mesh, "mlp-classifier") == before + 3


def test_key_shaping_policy_fields_reach_the_filter_through_the_api(mesh: Mesh) -> None:
    """`ignore_fields` and `deterministic_only` set through the control-plane API travel by ECDS
    to the server sidecar's filter and change what it keys and bypasses."""
    app = mesh.endpoints()["app"]
    with mesh.api() as api:
        original = next(p for p in api.policies()["policies"] if p["model_prefix"] == "mlp-classifier")
        spec = policy_spec(original)
        try:
            api.wait_acked(SERVER_NODE, api.put("mlp-classifier", {**spec, "ignore_fields": ["parameters"]})["version"])
            body = mlp_json(seed=1711)
            before = default_engine_calls(mesh, "mlp-classifier")
            first = rest_infer(app, "mlp-classifier", {**body, "parameters": {"trace": "a"}})
            assert first.headers["cache-status"] == "meshcache; fwd=miss; stored"
            other = rest_infer(app, "mlp-classifier", {**body, "parameters": {"trace": "b"}})
            assert other.headers["cache-status"].startswith("meshcache; hit"), "the ignored field is not keyed"
            assert other.content == first.content
            assert default_engine_calls(mesh, "mlp-classifier") == before + 1

            # deterministic_only applies to OpenAI text generation: a chat request for a model
            # under such a policy bypasses before it goes anywhere near an engine.
            api.wait_acked(SERVER_NODE, api.put("gpt-test", {"ttl_s": 60, "deterministic_only": True})["version"])
            chat = local_http().post(f"http://{app}/v1/chat/completions", timeout=10,
                                     json={"model": "gpt-test-1", "messages": [], "temperature": 0.9})
            assert chat.headers["cache-status"] == "meshcache; fwd=bypass; detail=nondeterministic"
        finally:
            api.wait_acked(SERVER_NODE, api.put("mlp-classifier", spec)["version"])
            if any(p["model_prefix"] == "gpt-test" for p in api.policies()["policies"]):
                api.wait_acked(SERVER_NODE, api.delete("gpt-test")["version"])
