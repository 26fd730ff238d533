"""The KServe v2 REST transport (plus the seed's `POST /v1/infer`) as a plain ASGI app, with
Triton's extensions: model configuration (`GET .../config`), statistics (`GET /v2/models/stats`,
`.../stats`) and the model repository (`POST /v2/repository/index`, `.../models/{m}/load|unload`).

Plain ASGI rather than FastAPI: every route needs hand-built v2 error bodies (400, not FastAPI's
422), the binary tensor extension reads the raw body, and fewer layers means less per-request
overhead. Responses carry only content-type and content-length (plus the server's Date), so the
same request always gets the same header set.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import orjson

from meshcache.contract.headers import MODEL_ID_HEADER
from meshcache.contract.protos import grpc_predict_v2_pb2 as pb
from meshcache.engine import tensors
from meshcache.engine.errors import EngineError, InvalidInput, NotFound, TooLarge
from meshcache.engine.model_config import to_json
from meshcache.engine.repository import LoadedModel, TensorSpec
from meshcache.engine.service import (
    EXTENSIONS,
    SERVER_NAME,
    SERVER_VERSION,
    InferenceService,
    parse_priority,
    parse_timeout,
)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

_MODEL_PATH = re.compile(
    r"^/v2/models/(?P<model>[^/]+)(?:/versions/(?P<version>[^/]+))?(?P<action>/ready|/infer|/config|/stats)?$"
)
_REPOSITORY_PATH = re.compile(r"^/v2/repository/models/(?P<model>[^/]+)/(?P<action>load|unload)$")
BINARY_HEADER = "inference-header-content-length"
_DECIMAL = re.compile(r"[0-9]+")


class Response:
    def __init__(self, status: int, body: bytes, content_type: str = "application/json",
                 extra_headers: list[tuple[bytes, bytes]] | None = None) -> None:
        self.status, self.body, self.content_type = status, body, content_type
        self.extra_headers = extra_headers or []


def json_response(payload: object, status: int = 200) -> Response:
    return Response(status, json.dumps(payload, separators=(",", ":"), allow_nan=False).encode())


def error_response(exc: EngineError) -> Response:
    return json_response({"error": str(exc)}, exc.http_status)


class HttpApp:
    def __init__(self, service: InferenceService, max_body_bytes: int) -> None:
        self.service = service
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # lifespan is off; nothing else is served
            return
        try:
            response = await self._route(scope, receive)
        except EngineError as exc:
            response = error_response(exc)
        except Exception as exc:  # a bug or an unencodable output must not take the server down
            response = json_response({"error": f"internal error: {type(exc).__name__}"}, 500)
        headers = [(b"content-type", response.content_type.encode()),
                   (b"content-length", str(len(response.body)).encode()), *response.extra_headers]
        await send({"type": "http.response.start", "status": response.status, "headers": headers})
        await send({"type": "http.response.body", "body": response.body})

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes:
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > self.max_body_bytes:
                raise TooLarge(f"request body over the {self.max_body_bytes} byte limit")
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise InvalidInput("client disconnected")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise TooLarge(f"request body over the {self.max_body_bytes} byte limit")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _route(self, scope: Scope, receive: Receive) -> Response:
        method, path = scope["method"], scope["path"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if sum(k.lower() == BINARY_HEADER.encode() for k, _ in scope["headers"]) > 1:
            # Servers differ on which line counts (the first, the last): refuse, don't guess.
            raise InvalidInput(f"{BINARY_HEADER} given more than once")
        if path == "/v2/health/live":
            return self._only_get(method) or json_response({"live": True})
        if path == "/v2/health/ready":
            return self._only_get(method) or json_response({"ready": self.service.ready},
                                                           200 if self.service.ready else 503)
        if path == "/v2":
            return self._only_get(method) or json_response(
                {"name": SERVER_NAME, "version": SERVER_VERSION, "extensions": EXTENSIONS})
        if path == "/v1/infer":
            if method != "POST":
                return _method_not_allowed()
            return await self._v1_infer(headers, await self._read_body(scope, receive))
        if path == "/v2/models/stats":
            return self._only_get(method) or self._stats("", "")
        if path == "/v2/repository/index":
            if method != "POST":
                return _method_not_allowed()
            return self._index(await self._read_body(scope, receive))
        repo_match = _REPOSITORY_PATH.match(path)
        if repo_match is not None:
            if method != "POST":
                return _method_not_allowed()
            body = await self._read_body(scope, receive)
            return await self._model_control(repo_match["model"], repo_match["action"], body)
        match = _MODEL_PATH.match(path)
        if match is None:
            raise NotFound(f"no route for {path}")
        name, version, action = match["model"], match["version"] or "", match["action"]
        if action == "/infer":
            if method != "POST":
                return _method_not_allowed()
            body = await self._read_body(scope, receive)
            return await self._v2_infer(name, version, headers, body)
        if method not in ("GET", "HEAD"):
            return _method_not_allowed()
        if action == "/stats":
            return self._stats(name, version)
        model = self.service.repository.get(name, version)
        if action == "/config":
            return json_response(to_json(model.config.proto))
        if action == "/ready":
            ready = self.service.ready
            return json_response({"name": name, "ready": ready}, 200 if ready else 503)
        return json_response(self._metadata(model, version))

    def _stats(self, name: str, version: str) -> Response:
        return json_response(to_json(pb.ModelStatisticsResponse(model_stats=self.service.statistics(name, version))))

    def _index(self, body: bytes) -> Response:
        request = _parse_json(body) if body.strip() else {}
        ready = request.get("ready", False)
        if not isinstance(ready, bool):
            raise InvalidInput("'ready' must be a boolean")
        return json_response([to_json(m) for m in self.service.index(ready)])

    async def _model_control(self, name: str, action: str, body: bytes) -> Response:
        request = _parse_json(body) if body.strip() else {}
        params = request.get("parameters") or {}
        if not isinstance(params, dict):
            raise InvalidInput("'parameters' must be a JSON object")
        if action == "load":
            for key in params:
                if key != "config":
                    raise InvalidInput(f"load parameter {key!r} is not supported; supported: 'config' "
                                       f"(JSON ModelConfig)")
            config = params.get("config")
            if config is not None and not isinstance(config, str):
                raise InvalidInput("load parameter 'config' must be a string holding a JSON ModelConfig")
            await self.service.load(name, config)
        else:
            for key, value in params.items():
                if key != "unload_dependents" or not isinstance(value, bool):
                    raise InvalidInput(f"unload parameter {key!r} is not supported; supported: "
                                       f"'unload_dependents' (bool)")
            await self.service.unload(name)
        return Response(200, b"")

    @staticmethod
    def _only_get(method: str) -> Response | None:
        return None if method in ("GET", "HEAD") else _method_not_allowed()

    def _metadata(self, model: LoadedModel, version: str) -> dict[str, Any]:
        cfg = model.config
        entry = self.service.repository.entry(cfg.name)

        def describe(specs: tuple[TensorSpec, ...]) -> list[dict[str, Any]]:
            return [{"name": s.name, "datatype": s.datatype, "shape": cfg.full_shape(s)} for s in specs]

        return {
            "name": cfg.name,
            "versions": [model.version] if version else entry.sorted_versions(),
            "platform": cfg.platform,
            "inputs": describe(cfg.inputs),
            "outputs": describe(cfg.outputs),
        }

    async def _v2_infer(self, name: str, version: str, headers: dict[str, str], body: bytes) -> Response:
        async with self.service.request(name, "http") as call:
            model = call.resolve(version)
            request, binary = _split_binary(headers, body)
            inputs = _decode_inputs(request, binary)
            raw_params = request.get("parameters") or {}
            if not isinstance(raw_params, dict):
                raise InvalidInput("'parameters' must be a JSON object")
            priority = parse_priority(headers.get("x-priority", raw_params.get("priority")))
            timeout = parse_timeout(raw_params.get("timeout"))
            requested, binary_outputs = _requested_outputs(request, raw_params)
            outputs = await self.service.infer(call, model, inputs, requested, priority, timeout)
            return _encode_v2_response(request, model, outputs, binary_outputs)

    async def _v1_infer(self, headers: dict[str, str], body: bytes) -> Response:
        name = headers.get(MODEL_ID_HEADER, "")
        async with self.service.request(name, "http") as call:
            if not name:
                raise InvalidInput(f"header {MODEL_ID_HEADER} is required")
            model = call.resolve(headers.get("x-model-version", ""))
            priority = parse_priority(headers.get("x-priority"))
            request = _parse_json(body)
            if "input" not in request or "shape" not in request:
                raise InvalidInput('body must be {"input": [...], "shape": [...]}')
            spec, out_spec = model.config.inputs[0], model.config.outputs[0]
            if len(model.config.inputs) != 1:
                raise InvalidInput(f"model {name!r} takes several inputs; use /v2/models/{name}/infer")
            shape = tensors.check_shape(spec.name, request["shape"])
            array = tensors.from_json(spec.name, spec.datatype, shape, request["input"])
            outputs = await self.service.infer(call, model, {spec.name: array}, [out_spec.name], priority)
            out = outputs[out_spec.name]
            return json_response({"output": tensors.to_json_data(out), "shape": list(out.shape)})


def _method_not_allowed() -> Response:
    return json_response({"error": "method not allowed"}, 405)


def _parse_json(body: bytes) -> dict[str, Any]:
    try:
        # orjson: several times faster than json on a tensor's thousands of numbers, and strict
        # (no NaN/Infinity literals, integers within 64 bits).
        request = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidInput(f"malformed JSON body: {exc}") from None
    if not isinstance(request, dict):
        raise InvalidInput("request body must be a JSON object")
    return request


def _split_binary(headers: dict[str, str], body: bytes) -> tuple[dict[str, Any], bytes]:
    """The binary tensor extension: a JSON header of the given length, then raw tensor bytes."""
    header_len = headers.get(BINARY_HEADER)
    if header_len is None:
        return _parse_json(body), b""
    # ASCII digits only (str.isdigit() also takes e.g. "²", which int() then refuses).
    if _DECIMAL.fullmatch(header_len) is None or int(header_len) > len(body):
        raise InvalidInput(f"{BINARY_HEADER} must be an integer no larger than the body ({len(body)} bytes)")
    n = int(header_len)
    return _parse_json(body[:n]), body[n:]


def _decode_inputs(request: dict[str, Any], binary: bytes) -> dict[str, np.ndarray]:
    items = request.get("inputs")
    if not isinstance(items, list) or not items:
        raise InvalidInput("'inputs' must be a non-empty list of tensors")
    inputs: dict[str, np.ndarray] = {}
    offset = 0
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise InvalidInput("each input needs a string 'name'")
        name = item["name"]
        if name in inputs:
            raise InvalidInput(f"input {name!r} is given twice")
        datatype = item.get("datatype")
        if not isinstance(datatype, str):
            raise InvalidInput(f"input {name!r}: 'datatype' must be a string")
        shape = tensors.check_shape(name, item.get("shape"))
        params = item.get("parameters") or {}
        size = params.get("binary_data_size") if isinstance(params, dict) else None
        if size is not None:
            if not isinstance(size, int) or size < 0 or offset + size > len(binary):
                raise InvalidInput(f"input {name!r}: binary_data_size {size!r} exceeds the binary data sent")
            inputs[name] = tensors.from_raw(name, datatype, shape, binary[offset:offset + size])
            offset += size
        else:
            if "data" not in item:
                raise InvalidInput(f"input {name!r}: 'data' is missing")
            inputs[name] = tensors.from_json(name, datatype, shape, item["data"])
    if offset != len(binary):
        raise InvalidInput(f"{len(binary) - offset} bytes of binary data are not claimed by any input")
    return inputs


def _requested_outputs(request: dict[str, Any], params: dict[str, Any]) -> tuple[list[str] | None, set[str]]:
    """Requested output names (None: all) and which of them go in binary form."""
    binary_all = params.get("binary_data_output") is True
    items = request.get("outputs")
    if items is None:
        return None, {"*"} if binary_all else set()
    if not isinstance(items, list):
        raise InvalidInput("'outputs' must be a list")
    names, binary = [], set()
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise InvalidInput("each requested output needs a string 'name'")
        names.append(item["name"])
        out_params = item.get("parameters") or {}
        if (isinstance(out_params, dict) and out_params.get("binary_data") is True) or binary_all:
            binary.add(item["name"])
    return names or None, binary


def _encode_v2_response(
    request: dict[str, Any], model: LoadedModel, outputs: dict[str, np.ndarray], binary_outputs: set[str]
) -> Response:
    body: dict[str, Any] = {"model_name": model.config.name, "model_version": model.version}
    if isinstance(request.get("id"), str):
        body["id"] = request["id"]
    chunks: list[bytes] = []
    encoded = []
    for name, array in outputs.items():
        tensor: dict[str, Any] = {"name": name, "datatype": tensors.DATATYPE_OF[array.dtype],
                                  "shape": list(array.shape)}
        if "*" in binary_outputs or name in binary_outputs:
            raw = tensors.to_raw(array)
            tensor["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        else:
            tensor["data"] = tensors.to_json_data(array)
        encoded.append(tensor)
    body["outputs"] = encoded
    header = json.dumps(body, separators=(",", ":"), allow_nan=False).encode()
    if not chunks:
        return Response(200, header)
    return Response(200, header + b"".join(chunks), "application/octet-stream",
                    [(BINARY_HEADER.encode(), str(len(header)).encode())])
