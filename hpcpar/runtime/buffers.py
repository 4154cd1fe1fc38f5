"""What an array travels as, and the recycled memory that results land in.

- `mpi_datatype`, `mpi_buffer`: the MPI datatype and mpi4py's upper-case buffer spec
  `[buffer, count, datatype]` of a host array; `nccl_buffer`: the NCCL spec `(device pointer,
  count, NCCL datatype)` of a CuPy array. Dtypes a library has no type for travel as raw bytes.
- `DTYPE_FACTS`: per dtype, what every op of the Communicator looks up (the datatype, whether
  reductions run in float32, whether it is floating), worked out once.
- `ResultPool`: large host results in recycled memory (MPI caches per-address work).
- `contiguous`, `to_front`, `from_front`, `copied`: the layouts an op's buffers need and its
  result gets back.
"""

from __future__ import annotations

import math
import sys

import numpy as np
from mpi4py import MPI

from hpcpar.backend import array_module, is_device_array
from hpcpar.backend.precision import is_low

_mpi_types: dict = {}  # numpy dtype -> MPI datatype or None (looked up once: ops are latency-bound)


def mpi_datatype(dtype):
    """The MPI datatype for a NumPy dtype, or None when the MPI library has none (e.g. bfloat16)."""
    try:
        return _mpi_types[dtype]
    except KeyError:
        pass
    try:
        datatype = MPI.Datatype.fromcode(np.dtype(dtype).char)
    except (KeyError, ValueError):
        datatype = None
    if np.dtype(dtype) == np.float16:
        # float16 travels as bytes, like bfloat16: hpcpar reduces 16-bit floats in float32 anyway
        # (`DTYPE_FACTS`), and Debian's MPICH 4.0.2 aborts in any MPI reduction of its float16 type
        # (typerep_yaksa_pack.c assertion), so no MPI call is ever given that type.
        datatype = None
    _mpi_types[dtype] = datatype
    return datatype


def mpi_buffer(a: np.ndarray) -> list:
    """The upper-case mpi4py buffer spec `[buffer, count, datatype]` of a contiguous host array.

    Dtypes the MPI library does not know travel as raw bytes (fine for moving data,
    not for reductions; the Communicator upcasts those before reducing).
    """
    if is_device_array(a):
        raise TypeError("mpi_buffer needs a host array; use to_host() or the NCCL path for CuPy arrays")
    if not a.flags.c_contiguous:
        raise ValueError("mpi_buffer needs a C-contiguous array; use numpy.ascontiguousarray first")
    datatype = mpi_datatype(a.dtype)
    if datatype is None:
        return [a, a.nbytes, MPI.BYTE]
    return [a, a.size, datatype]


def contiguous(a):
    """`a` itself when C-contiguous, else a C-contiguous copy (NumPy or CuPy)."""
    return a if a.flags.c_contiguous else array_module(a).ascontiguousarray(a)


def copied(src, dst):
    """`dst` with `src`'s values (an op's result that has to land in the caller's array)."""
    dst[...] = src
    return dst


def to_front(a, dim: int):
    """`a` with `dim` moved first, C-contiguous (no copy when dim is 0 and `a` is contiguous)."""
    return contiguous(array_module(a).moveaxis(a, dim, 0) if dim else a)


def from_front(a, dim: int):
    """`to_front` undone: axis 0 of `a` moved back to `dim`, C-contiguous."""
    if not dim:
        return a
    xp = array_module(a)
    return xp.ascontiguousarray(xp.moveaxis(a, 0, dim))


_NCCL_TYPES = {"int8": "NCCL_INT8", "uint8": "NCCL_UINT8", "int32": "NCCL_INT32",
               "uint32": "NCCL_UINT32", "int64": "NCCL_INT64", "uint64": "NCCL_UINT64",
               "float16": "NCCL_FLOAT16", "float32": "NCCL_FLOAT32", "float64": "NCCL_FLOAT64",
               "bfloat16": "NCCL_BFLOAT16"}


def nccl_buffer(a) -> tuple[int, int, int]:
    """The NCCL buffer spec `(device pointer, count, NCCL datatype)` of a contiguous CuPy array."""
    from cupy.cuda import nccl
    if not a.flags.c_contiguous:
        raise ValueError("nccl_buffer needs a C-contiguous array")
    key = _NCCL_TYPES.get(np.dtype(a.dtype).name)
    if key is None or not hasattr(nccl, key):
        return a.data.ptr, a.nbytes, nccl.NCCL_UINT8  # raw bytes: movement only, never reduced
    return a.data.ptr, a.size, getattr(nccl, key)


class _DtypeFacts(dict):
    """dtype -> (the MPI datatype its arrays travel as, whether MPI reductions of it run in
    float32, whether it is a floating dtype), worked out on the first lookup of a dtype (a plain
    dict lookup afterwards: every op makes one). Dtypes MPI has no type for travel as raw bytes
    (exact for moving data) and are reduced in float32, as are 16-bit floats
    (`Communicator._work_buffer`)."""

    def __missing__(self, dtype) -> tuple:
        datatype = mpi_datatype(dtype)
        facts = (MPI.BYTE if datatype is None else datatype, datatype is None or is_low(dtype),
                 bool(np.issubdtype(np.dtype(dtype), np.inexact)))
        self[dtype] = facts
        return facts


DTYPE_FACTS = _DtypeFacts()


class ResultPool:
    """New result arrays, in memory recycled from earlier results nobody holds any more.

    MPI libraries cache per-address work for large buffers (registration, mappings): receiving
    into brand-new memory every call made a 1 MiB all_reduce 2-3x slower than receiving into a
    reused buffer (bench/allreduce.py). A pooled buffer is handed out as a typed view, so while
    the caller (or any view of the result) is alive its refcount keeps it out of reuse; the pool
    keeps the last view of each buffer and hands out that same array again when it has the wanted
    shape and dtype and nobody holds it: making a new view every call cost 2-4% of a 1 MiB
    all-reduce here (the operands fill the cache, and new objects evict them). Results under
    `MIN_BYTES` are plain new arrays, and at most `BUFFERS` buffers are kept (one pool per
    communicator). CuPy has its own memory pool.
    """

    MIN_BYTES = 64 * 1024
    BUFFERS = 8

    __slots__ = ("_entries",)

    def __init__(self):
        self._entries: list[list] = []  # [byte buffer, its last view] behind earlier results

    def take(self, shape: tuple, dtype: np.dtype, xp):
        """An uninitialised array of `shape` and `dtype`, of module `xp` (pooled for NumPy only)."""
        nbytes = math.prod(shape) * dtype.itemsize  # not np.prod: 4 us a call, a third of the op
        if xp is not np or nbytes < self.MIN_BYTES:
            return xp.empty(shape, dtype=dtype)
        for entry in self._entries:
            buf, view = entry
            # A free buffer's references: the pool's entry, `buf`, getrefcount's argument and its view's
            # base; its free view's: the entry, `view`, the argument. More means a result still in use.
            if buf.nbytes == nbytes and sys.getrefcount(buf) <= 4 and sys.getrefcount(view) <= 3:
                if view.shape != shape or view.dtype != dtype:
                    view = entry[1] = buf.view(dtype).reshape(shape)
                return view
        buf = np.empty(nbytes, dtype=np.uint8)
        if len(self._entries) >= self.BUFFERS:
            self._entries.pop(0)  # the oldest buffer goes back to the allocator once its holders drop it
        view = buf.view(dtype).reshape(shape)
        self._entries.append([buf, view])
        return view
