"""KServe's own Python SDK calling the mesh with default requests; run by test_request_ids.py.

Runs in its own virtualenv (`.venv-kserve`, made by scripts/setup.sh from
tests/mesh/kserve-requirements.txt): kserve pins protobuf < 7 and the project's generated code
needs protobuf 7, so the SDK cannot share the project's environment. This file imports nothing
from meshcache. It prints one JSON document: per call, the id the SDK sent (REST, read off the
wire), the id in the answer, Cache-Status (REST) and the output values.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import uuid

import httpx
import numpy as np
from kserve import InferenceGRPCClient, InferenceRESTClient, InferInput, InferRequest, RESTConfig


class RecordingTransport(httpx.AsyncHTTPTransport):
    """The SDK's own transport, noting the request id each call put on the wire."""

    def __init__(self) -> None:
        super().__init__()
        self.sent_ids: list[str | None] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = request.content
        json_len = request.headers.get("inference-header-content-length")
        self.sent_ids.append(json.loads(body[: int(json_len)] if json_len else body).get("id"))
        return await super().handle_async_request(request)


def _inputs(seed: int) -> list[InferInput]:
    x = np.random.default_rng(seed).random((1, 16), dtype=np.float32)
    inp = InferInput(name="input", shape=[1, 16], datatype="FP32")
    inp.set_data_from_numpy(x)
    return [inp]


async def main(app: str, model: str, seed: int, calls: int) -> dict:
    transport = RecordingTransport()
    rest = InferenceRESTClient(RESTConfig(transport=transport, protocol="v2", retries=0, timeout=20))
    out: dict = {"rest": [], "grpc_default": [], "grpc_with_id": []}
    for _ in range(calls):
        headers: dict[str, str] = {}
        # The SDK's default request: no id given, so it sends a fresh UUID.
        response = await rest.infer(f"http://{app}", InferRequest(model, _inputs(seed)), model_name=model,
                                    response_headers=headers)
        out["rest"].append({"sent": transport.sent_ids[-1], "answered": response.id,
                            "cache_status": headers.get("cache-status"),
                            "output": response.outputs[0].as_numpy().tolist()})
    await rest.close()
    grpc_client = InferenceGRPCClient(app, retries=0, timeout=20)
    for _ in range(calls):
        response = await grpc_client.infer(InferRequest(model, _inputs(seed + 1)))
        out["grpc_default"].append({"answered": response.id, "output": response.outputs[0].as_numpy().tolist()})
    for _ in range(calls):
        request_id = str(uuid.uuid4())
        response = await grpc_client.infer(InferRequest(model, _inputs(seed + 2), request_id=request_id))
        out["grpc_with_id"].append({"sent": request_id, "answered": response.id,
                                    "output": response.outputs[0].as_numpy().tolist()})
    await grpc_client.close()
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--app", required=True, help="host:port of the client sidecar")
    parser.add_argument("--model", default="mlp-classifier")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--calls", type=int, default=3)
    a = parser.parse_args()
    print(json.dumps(asyncio.run(main(a.app, a.model, a.seed, a.calls))))
