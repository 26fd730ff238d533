"""The KServe v2 REST codec: JSON request bodies and the binary tensor extension to arrays, and
arrays back to JSON (or JSON + raw bytes) response bodies. No routing, no service calls: the
REST transport (http_server.py) reads bodies and calls the service, this module only translates.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

import numpy as np
import orjson

from meshcache.engine import tensors
from meshcache.engine.errors import InvalidInput
from meshcache.engine.repository import LoadedModel, TensorSpec

BINARY_HEADER = "inference-header-content-length"
_BINARY_HEADER_BYTES = BINARY_HEADER.encode()
_DECIMAL = re.compile(r"[0-9]+")


def dumps(payload: object) -> bytes:
    """Compact JSON; NaN/Infinity refused (they are not JSON)."""
    return json.dumps(payload, separators=(",", ":"), allow_nan=False).encode()


def parse_json(body: bytes) -> dict[str, Any]:
    try:
        # orjson: several times faster than json on a tensor's thousands of numbers, and strict
        # (no NaN/Infinity literals, integers within 64 bits).
        request = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidInput(f"malformed JSON body: {exc}") from None
    if not isinstance(request, dict):
        raise InvalidInput("request body must be a JSON object")
    return request


def refuse_repeated_binary_header(raw_headers: Iterable[tuple[bytes, bytes]]) -> None:
    """Servers differ on which of several `Inference-Header-Content-Length` lines counts (the
    first, the last): refuse, don't guess."""
    if sum(k.lower() == _BINARY_HEADER_BYTES for k, _ in raw_headers) > 1:
        raise InvalidInput(f"{BINARY_HEADER} given more than once")


def split_binary(headers: dict[str, str], body: bytes) -> tuple[dict[str, Any], bytes]:
    """The binary tensor extension: a JSON header of the given length, then raw tensor bytes.
    The only place the `Inference-Header-Content-Length` request header is read."""
    header_len = headers.get(BINARY_HEADER)
    if header_len is None:
        return parse_json(body), b""
    # ASCII digits only (str.isdigit() also takes e.g. "²", which int() then refuses).
    if _DECIMAL.fullmatch(header_len) is None or int(header_len) > len(body):
        raise InvalidInput(f"{BINARY_HEADER} must be an integer no larger than the body ({len(body)} bytes)")
    n = int(header_len)
    return parse_json(body[:n]), body[n:]


def decode_inputs(request: dict[str, Any], binary: bytes) -> dict[str, np.ndarray]:
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


def request_parameters(request: dict[str, Any]) -> dict[str, Any]:
    params = request.get("parameters") or {}
    if not isinstance(params, dict):
        raise InvalidInput("'parameters' must be a JSON object")
    return params


def requested_outputs(request: dict[str, Any], params: dict[str, Any]) -> tuple[list[str] | None, set[str]]:
    """Requested output names (None: all) and which of them go in binary form ("*": all)."""
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


def encode_response(request: dict[str, Any], model: LoadedModel, outputs: dict[str, np.ndarray],
                    binary_outputs: set[str]) -> tuple[bytes, int | None]:
    """The v2 response body, and the JSON header's length when binary outputs follow it (the
    value of the `Inference-Header-Content-Length` response header); None for plain JSON."""
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
    header = dumps(body)
    if not chunks:
        return header, None
    return header + b"".join(chunks), len(header)


# ---- the seed's `POST /v1/infer`: {"input": [...], "shape": [...]} -> {"output", "shape"} ----


def decode_v1_input(body: bytes, spec: TensorSpec) -> np.ndarray:
    request = parse_json(body)
    if "input" not in request or "shape" not in request:
        raise InvalidInput('body must be {"input": [...], "shape": [...]}')
    shape = tensors.check_shape(spec.name, request["shape"])
    return tensors.from_json(spec.name, spec.datatype, shape, request["input"])


def encode_v1_output(array: np.ndarray) -> dict[str, Any]:
    return {"output": tensors.to_json_data(array), "shape": list(array.shape)}
