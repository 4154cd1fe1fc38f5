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
import math
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
    safetensors, is cut short, or whose header claims more than the file holds: the header's
    length is checked against the file's size before it is read, and every tensor's offsets
    against the data's size and its shape and dtype (`_check_entry`) before anything is mapped."""
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
    except RecursionError:
        raise CheckpointError(f"{path}: not a safetensors file (header nested too deep)") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: not a safetensors file (header is not a JSON object)")
    ends = [_check_entry(path, name, info) for name, info in header.items() if name != "__metadata__"]
    if 8 + n + max(ends, default=0) > size:
        raise CheckpointError(f"{path}: {size} bytes, but its header needs {8 + n + max(ends)} (truncated)")
    return header, 8 + n


def _check_entry(path: str, name: str, info) -> int:
    """A header entry's end offset, once it is `{"dtype", "shape", "data_offsets": [begin, end]}`
    with a dtype hpcpar reads, sizes that are integers and `end - begin` the bytes of its shape."""
    what = f"{path}: tensor {name}"
    if not isinstance(info, dict) or not isinstance(info.get("dtype"), str) or \
            not isinstance(info.get("shape"), list) or not isinstance(info.get("data_offsets"), list):
        raise CheckpointError(f"{what}: its header entry is not {{dtype, shape, data_offsets}} (not a safetensors "
                              "file, or a damaged one)")
    code, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if code != "BF16" and code not in _TO_NUMPY:
        raise CheckpointError(f"{what} has dtype {code}, which hpcpar does not read")
    if not all(_count(d) for d in shape) or len(offsets) != 2 or not all(_count(o) for o in offsets) or \
            offsets[0] > offsets[1]:
        raise CheckpointError(f"{what}: shape {shape} or data_offsets {offsets} are not sizes (damaged file)")
    itemsize = 2 if code == "BF16" else np.dtype(_TO_NUMPY[code]).itemsize
    if itemsize * math.prod(d for d in shape if d) >= 1 << 62:  # an empty array NumPy cannot shape either
        raise CheckpointError(f"{what}: shape {shape} is larger than any array (damaged file)")
    if offsets[1] - offsets[0] != itemsize * math.prod(shape):
        raise CheckpointError(f"{what}: {offsets[1] - offsets[0]} bytes for shape {list(shape)} {code}")
    return offsets[1]


def _count(value) -> bool:
    """A non-negative JSON integer (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


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
            raw = _map(path, "<u2", start + begin, (end - begin) // 2, shape)
            out[name] = (raw.astype(np.uint32) << 16).view(np.float32)
            continue
        dtype = np.dtype(_TO_NUMPY[code])
        out[name] = _map(path, dtype, start + begin, (end - begin) // dtype.itemsize, shape)
    return out


def _map(path: str, dtype, offset: int, count: int, shape: tuple) -> np.ndarray:
    """`count` elements at `offset`, memory-mapped (read when used), as an array of `shape`."""
    if not count:
        return np.zeros(shape, dtype)
    try:
        mapped = np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(count,))
    except (OSError, ValueError) as err:  # changed since its header was read
        raise CheckpointError(f"cannot map {path} at byte {offset}: {err}") from None
    return np.asarray(mapped).reshape(shape)
