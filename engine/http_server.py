"""The KServe v2 REST transport (plus the seed's `POST /v1/infer`) as a plain ASGI app, with
Triton's extensions: model configuration (`GET .../config`), statistics (`GET /v2/models/stats`,
`.../stats`) and the model repository (`POST /v2/repository/index`, `.../models/{m}/load|unload`).

Plain ASGI rather than FastAPI: every route needs hand-built v2 error bodies (400, not FastAPI's
422), the binary tensor extension reads the raw body, and fewer layers means less per-request
overhead. Responses carry only content-type and content-length (plus the server's Date), so the
same request always gets the same header set. Tensors and bodies are translated by
`rest_codec.py`; everything else is the service's (`service.py`), shared with gRPC.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any

from meshcache.contract.headers import MODEL_ID_HEADER, MODEL_VERSION_HEADER
from meshcache.contract.protos import grpc_predict_v2_pb2 as pb
from meshcache.engine import rest_codec
from meshcache.engine.errors import EngineError, InvalidInput, NotFound, TooLarge
from meshcache.engine.model_config import to_json
from meshcache.engine.openai_api import EventStream, JsonReply, OpenAIEndpoints
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


class Response:
    def __init__(self, status: int, body: bytes, content_type: str = "application/json",
                 extra_headers: list[tuple[bytes, bytes]] | None = None) -> None:
        self.status, self.body, self.content_type = status, body, content_type
        self.extra_headers = extra_headers or []


def json_response(payload: object, status: int = 200) -> Response:
    return Response(status, rest_codec.dumps(payload))


def error_response(exc: EngineError) -> Response:
    return json_response({"error": str(exc)}, exc.http_status)


class HttpApp:
    def __init__(self, service: InferenceService, max_body_bytes: int, openai: OpenAIEndpoints | None = None) -> None:
        self.service = service
        self.max_body_bytes = max_body_bytes
        self.openai = openai

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # lifespan is off; nothing else is served
            return
        if self.openai is not None and self.openai.handles(scope["path"]):
            await self._openai(scope, receive, send)
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

    async def _openai(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The OpenAI-compatible routes (engine/openai_api.py): JSON, or server-sent events."""
        assert self.openai is not None

        async def read_body(limit: int) -> bytes:
            return await self._read_body(scope, receive, limit)

        reply = await self.openai.route(scope["method"], scope["path"], read_body)
        if isinstance(reply, JsonReply):
            body = rest_codec.dumps(reply.payload)
            await send({"type": "http.response.start", "status": reply.status, "headers": [
                (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        assert isinstance(reply, EventStream)
        # No Cache-Control (OpenAI sends no-cache): the mesh's cache stores what the engine answers,
        # and would not store a no-cache answer (docs/filter.md, Storing). Chunked, no length.
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream")]})
        try:
            async for event in reply.events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
        except OSError:  # the client went away: stop generating (the generator is closed below)
            return
        finally:
            await reply.events.aclose()
        await send({"type": "http.response.body", "body": b""})

    async def _read_body(self, scope: Scope, receive: Receive, limit: int = 0) -> bytes:
        limit = limit or self.max_body_bytes
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                raise TooLarge(f"request body over the {limit} byte limit")
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise InvalidInput("client disconnected")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise TooLarge(f"request body over the {limit} byte limit")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _route(self, scope: Scope, receive: Receive) -> Response:
        method, path = scope["method"], scope["path"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        rest_codec.refuse_repeated_binary_header(scope["headers"])
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
        if action == "/config":
            return json_response(to_json(self.service.config_of(name, version)))
        if action == "/ready":
            ready = self.service.model_ready(name, version)
            return json_response({"name": name, "ready": ready}, 200 if ready else 503)
        return json_response(to_json(self.service.model_metadata(name, version)))

    def _stats(self, name: str, version: str) -> Response:
        return json_response(to_json(pb.ModelStatisticsResponse(model_stats=self.service.statistics(name, version))))

    def _index(self, body: bytes) -> Response:
        request = rest_codec.parse_json(body) if body.strip() else {}
        ready = request.get("ready", False)
        if not isinstance(ready, bool):
            raise InvalidInput("'ready' must be a boolean")
        return json_response([to_json(m) for m in self.service.index(ready)])

    async def _model_control(self, name: str, action: str, body: bytes) -> Response:
        params = rest_codec.request_parameters(rest_codec.parse_json(body) if body.strip() else {})
        if action == "load":
            await self.service.load(name, params)
        else:
            await self.service.unload(name, params)
        return Response(200, b"")

    @staticmethod
    def _only_get(method: str) -> Response | None:
        return None if method in ("GET", "HEAD") else _method_not_allowed()

    async def _v2_infer(self, name: str, version: str, headers: dict[str, str], body: bytes) -> Response:
        async with self.service.request(name, "http") as call:
            model = call.resolve(version)
            request, binary = rest_codec.split_binary(headers, body)
            inputs = rest_codec.decode_inputs(request, binary)
            params = rest_codec.request_parameters(request)
            priority = parse_priority(headers.get("x-priority", params.get("priority")))
            timeout = parse_timeout(params.get("timeout"))
            requested, binary_outputs = rest_codec.requested_outputs(request, params)
            outputs = await self.service.infer(call, model, inputs, requested, priority, timeout)
            encoded, header_length = rest_codec.encode_response(request, model, outputs, binary_outputs)
            if header_length is None:
                return Response(200, encoded)
            return Response(200, encoded, "application/octet-stream",
                            [(rest_codec.BINARY_HEADER.encode(), str(header_length).encode())])

    async def _v1_infer(self, headers: dict[str, str], body: bytes) -> Response:
        name = headers.get(MODEL_ID_HEADER, "")
        async with self.service.request(name, "http") as call:
            if not name:
                raise InvalidInput(f"header {MODEL_ID_HEADER} is required")
            model = call.resolve(headers.get(MODEL_VERSION_HEADER, ""))
            priority = parse_priority(headers.get("x-priority"))
            if len(model.config.inputs) != 1:
                raise InvalidInput(f"model {name!r} takes several inputs; use /v2/models/{name}/infer")
            spec, out_spec = model.config.inputs[0], model.config.outputs[0]
            array = rest_codec.decode_v1_input(body, spec)
            outputs = await self.service.infer(call, model, {spec.name: array}, [out_spec.name], priority)
            return json_response(rest_codec.encode_v1_output(outputs[out_spec.name]))


def _method_not_allowed() -> Response:
    return json_response({"error": "method not allowed"}, 405)
