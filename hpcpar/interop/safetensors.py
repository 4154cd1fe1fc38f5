"""The safetensors file format, written and read with NumPy alone.

A file is an 8-byte little-endian length N, N bytes of JSON, then the tensors' bytes:

    {"<name>": {"dtype": "F32", "shape": [768, 2304], "data_offsets": [begin, end]}, ...,
     "__metadata__": {"format": "pt"}}

each tensor C-ordered, little-endian, its offsets relative to the end of the header
(https://github.com/huggingface/safetensors, "Format"). The format is this small, so hpcpar
needs no package to exchange weights with HuggingFace; reading memory-maps the file, so a
tensor is read when it is used.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping

import numpy as np

from hpcpar.errors import CheckpointError

_TO_NUMPY = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1",
             "U8": "u1", "BOOL": "?"}
_FROM_NUMPY = {np.dtype(v).str if k != "BOOL" else "|b1": k for k, v in _TO_NUMPY.items()}
_HEADER_LIMIT = 100 << 20    # the reference implementation's limit on the JSON header


def write(path: str, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None) -> None:
    """Write `tensors` (name -> array) to `path`; the header is padded to 8 bytes as the library does."""
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    arrays, offset = [], 0
    for name in sorted(tensors):
        a = np.asarray(tensors[name], order="C")   # (ascontiguousarray would make a scalar 1-D)
        a = a.astype(a.dtype.newbyteorder("<")) if a.dtype.byteorder == ">" else a
        code = "BF16" if a.dtype.name == "bfloat16" else _FROM_NUMPY.get(a.dtype.str if a.dtype.kind != "b" else "|b1")
        if code is None:
            raise CheckpointError(f"safetensors: cannot store {name} of dtype {a.dtype}")
        header[name] = {"dtype": code, "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        arrays.append(a)
        offset += a.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    tmp = path + ".partial"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for a in arrays:
            f.write(a.tobytes())
    os.replace(tmp, path)


def read_header(path: str) -> tuple[dict, int]:
    """(the JSON header, where the data starts). One-line CheckpointError for a file that is not
    safetensors or is cut short."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if not 0 < n <= min(_HEADER_LIMIT, size - 8):
                raise CheckpointError(f"{path}: not a safetensors file (bad header length)")
            header = json.loads(f.read(n))
    except OSError as err:
        raise CheckpointError(f"cannot read {path}: {err.strerror}") from None
    except ValueError as err:
        raise CheckpointError(f"{path}: not a safetensors file (header is not JSON: {err})") from None
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end > size:
        raise CheckpointError(f"{path}: {size} bytes, but its header needs {8 + n + end} (truncated)")
    return header, 8 + n


def read(path: str) -> dict[str, np.ndarray]:
    """Every tensor of the file as a read-only NumPy array (memory-mapped). BF16 becomes float32
    (exactly: bfloat16 is float32's upper half)."""
    header, start = read_header(path)
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        shape = tuple(info["shape"])
        code = info["dtype"]
        if code == "BF16":
            count = (end - begin) // 2
            raw = _map(path, "<u2", start + begin, count, shape)
            out[name] = (raw.astype(np.uint32) << 16).view(np.float32)
            continue
        if code not in _TO_NUMPY:
            raise CheckpointError(f"{path}: tensor {name} has dtype {code}, which hpcpar does not read")
        dtype = np.dtype(_TO_NUMPY[code])
        if end - begin != dtype.itemsize * int(np.prod(shape, dtype=np.int64)):
            raise CheckpointError(f"{path}: tensor {name}: {end - begin} bytes for shape {list(shape)} {code}")
        count = (end - begin) // dtype.itemsize
        out[name] = _map(path, dtype, start + begin, count, shape)
    return out


def _map(path: str, dtype, offset: int, count: int, shape: tuple) -> np.ndarray:
    """`count` elements at `offset`, memory-mapped (read when used), as an array of `shape`."""
    if not count:
        return np.zeros(shape, dtype)
    return np.asarray(np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(count,))).reshape(shape)
