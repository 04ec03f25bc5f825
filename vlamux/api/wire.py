"""Arrays on the wire: msgpack documents whose arrays travel as raw bytes.

An array is ``{"__nd__": 1, "dtype": "float32", "shape": [...], "data": <bytes>}`` (C order, little
endian), so an image batch costs its own size and no base64. Shared by the server and the SDK, so it
imports neither FastAPI nor torch.
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

CONTENT_TYPE = "application/msgpack"
# What a client may send: no object arrays, nothing a decoder could be tricked into executing.
DTYPES = {"uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64", "bool"}


class WireError(ValueError):
    """A payload that does not decode; `field` names where."""

    def __init__(self, message: str, field: str = ""):
        super().__init__(message)
        self.field = field


def _pack(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        if obj.dtype.name not in DTYPES:
            raise WireError(f"dtype {obj.dtype} cannot be sent; use one of {sorted(DTYPES)}")
        a = np.ascontiguousarray(obj, dtype=obj.dtype.newbyteorder("<"))
        return {"__nd__": 1, "dtype": a.dtype.name, "shape": list(a.shape), "data": a.tobytes()}
    if hasattr(obj, "numpy") and hasattr(obj, "detach"):  # a torch tensor, without importing torch
        return _pack(obj.detach().cpu().numpy())
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        return {k: _pack(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_pack(v) for v in obj]
    return obj


def _unpack(obj: Any, path: str) -> Any:
    if isinstance(obj, dict):
        if obj.get("__nd__") == 1:
            return _array(obj, path)
        return {k: _unpack(v, f"{path}.{k}" if path else str(k)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_unpack(v, f"{path}[{i}]") for i, v in enumerate(obj)]
    return obj


def _array(d: dict, path: str) -> np.ndarray:
    dtype, shape, data = d.get("dtype"), d.get("shape"), d.get("data")
    if dtype not in DTYPES:
        raise WireError(f"{path}: dtype {dtype!r} is not allowed; use one of {sorted(DTYPES)}", path)
    if not isinstance(shape, list) or not all(isinstance(n, int) and n >= 0 for n in shape):
        raise WireError(f"{path}: shape must be a list of non-negative integers, got {shape!r}", path)
    if not isinstance(data, bytes):
        raise WireError(f"{path}: data must be raw bytes", path)
    dt = np.dtype(dtype).newbyteorder("<")
    expected = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    if len(data) != expected:
        raise WireError(f"{path}: {len(data)} bytes of data for shape {shape} {dtype} ({expected} expected)", path)
    return np.frombuffer(data, dtype=dt).reshape(shape).astype(dt.newbyteorder("="), copy=True)


def dumps(obj: Any) -> bytes:
    return msgpack.packb(_pack(obj), use_bin_type=True)


def loads(data: bytes, max_depth: int = 16) -> Any:
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True, max_bin_len=len(data),
                              max_array_len=1 << 20, max_map_len=1 << 16)
    except Exception as e:  # noqa: BLE001 - msgpack raises many types for malformed input
        raise WireError(f"body is not valid msgpack: {e}") from None
    _check_depth(obj, max_depth)
    return _unpack(obj, "")


def _check_depth(obj: Any, left: int) -> None:
    if left < 0:
        raise WireError("payload is nested too deeply")
    if isinstance(obj, dict):
        for v in obj.values():
            _check_depth(v, left - 1)
    elif isinstance(obj, list):
        for v in obj:
            _check_depth(v, left - 1)
