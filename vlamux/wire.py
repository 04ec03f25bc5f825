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
MAX_DIM = 1 << 31  # one dimension's length; and the product of the non-zero ones is bounded as well:
MAX_EXTENT = 1 << 40  # an empty array may not claim a shape no array could have


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
    if len(shape) > 32:
        raise WireError(f"{path}: at most 32 dimensions, got {len(shape)}", path)
    extent = 1
    for n in shape:  # Python integers: a hostile shape cannot overflow into a match
        if n > MAX_DIM:
            raise WireError(f"{path}: a dimension of {n} in shape {shape[:8]}; at most {MAX_DIM}", path)
        extent *= max(n, 1)
    if extent > MAX_EXTENT:
        raise WireError(f"{path}: shape {shape[:8]} spans more than {MAX_EXTENT} elements", path)
    dt = np.dtype(dtype).newbyteorder("<")
    expected = dt.itemsize
    for n in shape:
        expected *= n
    if len(data) != expected:
        raise WireError(f"{path}: {len(data)} bytes of data for shape {shape} {dtype} ({expected} expected)", path)
    try:
        return np.frombuffer(data, dtype=dt).reshape(shape).astype(dt.newbyteorder("="), copy=True)
    except (ValueError, MemoryError) as e:  # whatever numpy refuses is the sender's shape, not a 500
        raise WireError(f"{path}: shape {shape[:8]} does not make an array ({e})", path) from None


def dumps(obj: Any) -> bytes:
    return msgpack.packb(_pack(obj), use_bin_type=True)


MAX_ELEMENTS = 20_000  # msgpack objects in one body: a real request has dozens (arrays travel as bytes)

# msgpack type byte -> (bytes of the fixed part after it, bytes of a length field); a length field
# counts payload bytes for str/bin/ext, elements for arrays, pairs for maps
_FIXED = {0xc0: 0, 0xc2: 0, 0xc3: 0, 0xca: 4, 0xcb: 8, 0xcc: 1, 0xcd: 2, 0xce: 4, 0xcf: 8, 0xd0: 1, 0xd1: 2,
          0xd2: 4, 0xd3: 8, 0xd4: 2, 0xd5: 3, 0xd6: 5, 0xd7: 9, 0xd8: 17}
_SIZED = {0xc4: 1, 0xc5: 2, 0xc6: 4, 0xd9: 1, 0xda: 2, 0xdb: 4}  # bin and str: length, then bytes
_EXT = {0xc7: 1, 0xc8: 2, 0xc9: 4}  # length, type byte, then bytes
_ARRAY = {0xdc: 2, 0xdd: 4}
_MAP = {0xde: 2, 0xdf: 4}


def check_size(data: bytes, max_elements: int = MAX_ELEMENTS) -> None:
    """Refuse a body of more than `max_elements` msgpack objects by reading its headers only: payloads
    (an image's bytes) are skipped, and the scan stops at the cap, so a hostile body of millions of
    empty arrays costs the cap's worth of work, not the millions of objects a decoder would build."""
    pos, pending, count, n = 0, 1, 0, len(data)
    while pending:
        if pos >= n:
            raise WireError("body is not valid msgpack: it ends inside an object")
        b = data[pos]
        pos += 1
        pending -= 1
        count += 1
        if count > max_elements:
            raise WireError(f"body: more than {max_elements} msgpack objects; arrays travel as one binary each")
        if b <= 0x7f or b >= 0xe0:
            continue
        if b <= 0x8f:
            pending += 2 * (b & 0x0f)
        elif b <= 0x9f:
            pending += b & 0x0f
        elif b <= 0xbf:
            pos += b & 0x1f
        elif b in _FIXED:
            pos += _FIXED[b]
        elif b in _SIZED or b in _EXT or b in _ARRAY or b in _MAP:
            width = _SIZED.get(b) or _EXT.get(b) or _ARRAY.get(b) or _MAP[b]
            length = int.from_bytes(data[pos:pos + width], "big")
            pos += width
            if b in _ARRAY:
                pending += length
            elif b in _MAP:
                pending += 2 * length
            else:
                pos += length + (1 if b in _EXT else 0)
        else:
            raise WireError(f"body is not valid msgpack: byte 0x{b:02x} at offset {pos - 1}")
        if pending > max_elements:
            raise WireError(f"body: more than {max_elements} msgpack objects; arrays travel as one binary each")
    if pos != n:
        raise WireError("body is not valid msgpack: extra bytes after the document")


def loads(data: bytes, max_depth: int = 16) -> Any:
    check_size(data)
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
