"""How the servers behind the filter read a request's bytes: the oracle of the differential test
(`test_differential.py`), and what the test origin answers when asked (`x-origin-read`).

REST bodies are read with Python's `json` (what KServe's Python server, vLLM and this project's
engine use: the last of repeated keys wins, `NaN` and lone surrogates are accepted); the path as
uvicorn hands it to the router (percent-decoded, then matched exactly); the model from the KServe
path, else the body's `model` member (whatever its type), else `x-model-id` (with the version from
`x-model-version`, as the engine's `/v1/infer` reads it); the binary tensor
extension as the engine reads it (exactly one line of ASCII digits, no larger than the body;
`engine/http_server.py`). gRPC: protobuf's own parser (the last of repeated scalar fields wins).
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any
from urllib.parse import unquote

from google.protobuf.message import DecodeError

from meshcache.contract.protos import grpc_predict_v2_pb2 as pb

OPENAI_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
KSERVE_PATH = re.compile(r"/v2/models/(?P<model>[^/]+)(?:/versions/(?P<version>[^/]+))?/infer")
BINARY_HEADER = "inference-header-content-length"
MODEL_VERSION_HEADER = "x-model-version"
# The differential test's policies all ignore this field: the answer may differ in it.
IGNORED_FIELDS = ("user",)


class Unreadable(ValueError):
    """The server refuses the request (4xx)."""


def _object(data: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise Unreadable(f"not JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise Unreadable("not a JSON object")
    return doc


def _digest(doc: dict[str, Any], drop: tuple[str, ...], tail: bytes = b"") -> str:
    kept = {k: v for k, v in doc.items() if k not in drop}
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode() + tail).hexdigest()


def read_rest(path: str, headers: list[tuple[str, str]], body: bytes) -> dict[str, Any]:
    """What the server reads: the model (any JSON value), the version, and a digest of the body as
    parsed, without the KServe request id and the ignored fields. Raises Unreadable."""
    route = unquote(path.split("?", 1)[0])
    model_ids = [v for k, v in headers if k.lower() == "x-model-id"]
    header_model = model_ids[-1] if model_ids else None
    if (kserve := KSERVE_PATH.fullmatch(route)) is not None:
        lines = [v for k, v in headers if k.lower() == BINARY_HEADER]
        if len(lines) > 1:
            raise Unreadable(f"{BINARY_HEADER} given more than once")
        tail = b""
        if lines:
            if re.fullmatch(r"[0-9]+", lines[0]) is None or int(lines[0]) > len(body):
                raise Unreadable(f"bad {BINARY_HEADER}")
            body, tail = body[: int(lines[0])], body[int(lines[0]):]
        doc = _object(body)
        return {"model": kserve["model"], "version": kserve["version"] or "",
                "body": _digest(doc, ("id", *IGNORED_FIELDS), tail)}
    if route in OPENAI_PATHS:
        doc = _object(body)
        model = doc["model"] if "model" in doc else header_model
        return {"model": model, "version": "", "body": _digest(doc, IGNORED_FIELDS)}
    # Any other path (x-model-id, the version from x-model-version as the engine's /v1/infer reads
    # them: a header dict, the last line wins): an opaque body, or a JSON object the policy may
    # leave fields of.
    versions = [v for k, v in headers if k.lower() == MODEL_VERSION_HEADER]
    try:
        digest = _digest(_object(body), IGNORED_FIELDS)
    except Unreadable:
        digest = hashlib.sha256(body).hexdigest()
    return {"model": header_model, "version": versions[-1] if versions else "", "body": digest}


def read_grpc(message: bytes) -> pb.ModelInferRequest:
    try:
        return pb.ModelInferRequest.FromString(message)
    except DecodeError as exc:
        raise Unreadable(f"not a ModelInferRequest: {exc}") from exc


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if not n:
            out.append(b)
            return bytes(out)
        out.append(b | 0x80)


def grpc_answer(parsed: pb.ModelInferRequest, size: int = 0) -> bytes:
    """The test origin's ModelInferResponse: the model name (field 1), the echoed id (field 3)
    and a digest of the request as parsed without its id (field 5), `size` bytes of it if asked."""
    request_id = parsed.id.encode()
    without_id = pb.ModelInferRequest()
    without_id.CopyFrom(parsed)
    without_id.id = ""
    digest = hashlib.sha256(without_id.SerializeToString(deterministic=True)).digest()
    payload = (digest * (size // 32 + 1) if size else digest)[: max(size, 32)]
    name = parsed.model_name.encode()
    echoed = b"\x1a" + varint(len(request_id)) + request_id if request_id else b""
    return b"\x0a" + varint(len(name)) + name + echoed + b"\x2a" + varint(len(payload)) + payload
