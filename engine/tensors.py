"""KServe v2 tensors: datatype names, and decoding/encoding of JSON and protobuf tensor data."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from meshcache.contract.protos import grpc_predict_v2_pb2 as pb
from meshcache.engine.errors import InvalidInput

# v2 datatype name -> numpy dtype (little-endian, as the protocol's raw contents are).
DTYPES: dict[str, np.dtype[Any]] = {
    "BOOL": np.dtype("bool"),
    "UINT8": np.dtype("<u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
}
DATATYPE_OF: dict[np.dtype[Any], str] = {dt: name for name, dt in DTYPES.items()}

# Which InferTensorContents field carries each datatype (8/16-bit ints travel widened).
CONTENTS_FIELD: dict[str, str] = {
    "BOOL": "bool_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
}


def dtype_for(name: str, datatype: str) -> np.dtype[Any]:
    try:
        return DTYPES[datatype]
    except KeyError:
        raise InvalidInput(
            f"input {name!r}: unsupported datatype {datatype!r}; expected one of {', '.join(DTYPES)}"
        ) from None


def check_shape(name: str, shape: Any) -> tuple[int, ...]:
    if not isinstance(shape, list | tuple) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise InvalidInput(f"input {name!r}: shape must be a list of non-negative integers, got {shape!r}")
    return tuple(int(d) for d in shape)


def _element_count(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def from_raw(name: str, datatype: str, shape: tuple[int, ...], raw: bytes) -> np.ndarray:
    """Raw little-endian row-major bytes (gRPC raw_input_contents, HTTP binary extension)."""
    dtype = dtype_for(name, datatype)
    expected = _element_count(shape) * dtype.itemsize
    if len(raw) != expected:
        raise InvalidInput(
            f"input {name!r}: raw data has {len(raw)} bytes, expected {expected} "
            f"for {datatype} with shape {list(shape)}"
        )
    return np.frombuffer(raw, dtype=dtype).reshape(shape)


def _number_array(name: str, datatype: str, data: Any) -> np.ndarray:
    """JSON numbers (flat or nested lists) -> array of the datatype, refusing silent conversions."""
    dtype = dtype_for(name, datatype)
    try:
        values = np.array(data)
    except ValueError as exc:  # ragged nesting
        raise InvalidInput(f"input {name!r}: data is not a regular array of numbers ({exc})") from None
    kind = values.dtype.kind
    if values.size == 0:
        return values.astype(dtype)
    allowed = {"b": "b", "u": "iu", "i": "iu", "f": "iuf"}[dtype.kind]
    if kind not in allowed:
        want = {"b": "booleans", "u": "integers", "i": "integers", "f": "numbers"}[dtype.kind]
        raise InvalidInput(f"input {name!r}: data must be {want} for datatype {datatype}")
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        if values.min() < info.min or values.max() > info.max:
            raise InvalidInput(f"input {name!r}: data out of range for datatype {datatype}")
    return values.astype(dtype)


def from_json(name: str, datatype: str, shape: tuple[int, ...], data: Any) -> np.ndarray:
    if not isinstance(data, list):
        raise InvalidInput(f"input {name!r}: 'data' must be a JSON array")
    values = _number_array(name, datatype, data).reshape(-1)
    expected = _element_count(shape)
    if values.size != expected:
        raise InvalidInput(
            f"input {name!r}: data has {values.size} elements, expected {expected} for shape {list(shape)}"
        )
    return values.reshape(shape)


def from_contents(
    name: str, datatype: str, shape: tuple[int, ...], contents: pb.InferTensorContents
) -> np.ndarray:
    dtype = dtype_for(name, datatype)
    field = CONTENTS_FIELD.get(datatype)
    if field is None:
        raise InvalidInput(f"input {name!r}: datatype {datatype} must be sent in raw_input_contents")
    values = np.array(getattr(contents, field), dtype=dtype)
    expected = _element_count(shape)
    if values.size != expected:
        raise InvalidInput(
            f"input {name!r}: {field} has {values.size} elements, expected {expected} for shape {list(shape)}"
        )
    return values.reshape(shape)


def to_json_data(array: np.ndarray) -> list[Any]:
    """Flat row-major values; float32 widens exactly to Python floats, so the text is deterministic."""
    return array.reshape(-1).tolist()


def to_raw(array: np.ndarray) -> bytes:
    return np.ascontiguousarray(array).tobytes()


def fill_contents(contents: pb.InferTensorContents, datatype: str, array: np.ndarray) -> None:
    getattr(contents, CONTENTS_FIELD[datatype]).extend(array.reshape(-1).tolist())
