"""Reads the safetensors format (an 8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and byte range, then the raw little-endian data) into numpy arrays.

The format is small enough to read directly; the `safetensors` package would add a dependency
for one function.
"""

from __future__ import annotations

import json
import struct

import numpy as np

_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I64": np.int64, "I32": np.int32}
_MAX_HEADER = 100 * 2**20


class SafetensorsError(ValueError):
    pass


def read_safetensors(data: bytes) -> dict[str, np.ndarray]:
    if len(data) < 8:
        raise SafetensorsError("safetensors data shorter than its 8-byte header length")
    (header_len,) = struct.unpack("<Q", data[:8])
    if header_len > min(_MAX_HEADER, len(data) - 8):
        raise SafetensorsError(f"safetensors header length {header_len} is past the data")
    try:
        header = json.loads(data[8:8 + header_len])
    except ValueError as exc:
        raise SafetensorsError(f"safetensors header is not JSON: {exc}") from None
    body = memoryview(data)[8 + header_len:]
    tensors: dict[str, np.ndarray] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise SafetensorsError(f"tensor {name!r}: dtype {info.get('dtype')!r} is not supported")
        start, end = info["data_offsets"]
        shape = tuple(int(d) for d in info["shape"])
        count = int(np.prod(shape, dtype=np.int64))
        if not 0 <= start <= end <= len(body) or end - start != count * np.dtype(dtype).itemsize:
            raise SafetensorsError(f"tensor {name!r}: byte range {start}..{end} does not fit shape {list(shape)}")
        array = np.frombuffer(body[start:end], dtype=np.dtype(dtype).newbyteorder("<"), count=count)
        tensors[name] = array.astype(dtype).reshape(shape)
    return tensors
