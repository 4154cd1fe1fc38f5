"""The array module: NumPy on CPU, CuPy on GPU.

`backend.xp` is the module new arrays are made with: NumPy unless the environment
says `HPCPAR_BACKEND=cupy` or a caller runs `backend.use("cupy")`. Operations on
existing arrays take their module from the arrays (`array_module`), so one
process can hold both kinds. CuPy is imported only when asked for, so a CPU-only
machine never needs it. Nothing else in hpcpar imports numpy-vs-cupy specifics.

The package around it: `precision` (16-bit storage, float32 arithmetic), `blas` (the CPU's GEMMs:
MKL or NumPy's BLAS), `cpu/` (cache-blocked fused kernels, one module per op), `jit/` (their Numba
loops, the `fast` extra), `gpu_kernels` (fused CuPy kernels), `kernel_pool` (the threads a rank
computes on), `splitmix` (counter-based hashing for dropout masks and batches).
"""

from __future__ import annotations

import os
from types import ModuleType

import numpy

from hpcpar.errors import ConfigError

BACKENDS = ("numpy", "cupy")

xp: ModuleType = numpy
_name = "numpy"


def _import_cupy() -> ModuleType:
    try:
        import cupy
    except ImportError as err:
        raise ConfigError(f"backend 'cupy' was asked for but CuPy cannot be imported ({err}); "
                          "install hpcpar[gpu] or use backend 'numpy'") from None
    return cupy


def use(name: str) -> ModuleType:
    """Make `name` ("numpy" or "cupy") the module new arrays are created with; returns it."""
    global xp, _name
    if name not in BACKENDS:
        raise ConfigError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    xp = _import_cupy() if name == "cupy" else numpy
    _name = name
    return xp


def name() -> str:
    """The current backend's name: "numpy" or "cupy"."""
    return _name


def is_device_array(a) -> bool:
    """True for a CuPy (GPU) array. Decided from the type, so CuPy is never imported here."""
    kind = type(a)
    return kind is not numpy.ndarray and kind.__module__.startswith("cupy")


def array_module(*arrays) -> ModuleType:
    """The module of the given arrays: cupy if any is a CuPy array, else numpy."""
    if any(is_device_array(a) for a in arrays):
        return _import_cupy()
    return numpy


def to_host(a) -> numpy.ndarray:
    """A NumPy array with the values of `a` (the same object when it already is one)."""
    if is_device_array(a):
        return a.get()
    return numpy.asarray(a)


def to_device(a):
    """`a` as an array of the current backend (a GPU copy under cupy; unchanged under numpy)."""
    if _name == "cupy":
        return xp.asarray(a)
    return to_host(a)


def synchronize() -> None:
    """Wait for queued GPU work on the current stream (nothing to wait for under numpy)."""
    if _name == "cupy":
        xp.cuda.get_current_stream().synchronize()


# glibc mallopt parameters (malloc.h): the mmap threshold, and the free space at the heap's top
# that is handed back to the system.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_KEEP_BYTES = 1 << 30


def reuse_freed_host_memory() -> bool:
    """Ask the C allocator to keep freed host memory for the next arrays of the same size.

    A training step allocates and frees the same activation arrays (megabytes each) every micro-batch.
    By default glibc maps every allocation above 128 KiB (its adaptive threshold stops at 32 MiB)
    with mmap and unmaps it on free, so each new array starts with page faults and zero-filling by
    the kernel: about a fifth of a CPU step on the default model. Raising the mmap threshold and the
    trim threshold to 1 GiB keeps those pages in the heap, where the next step's arrays reuse them
    (resident memory stays at the step's high-water mark instead of dropping between steps). Only
    glibc is asked (elsewhere this does nothing); returns whether it took the settings."""
    import ctypes
    import ctypes.util
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, _KEEP_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, _KEEP_BYTES))


def select_device(node_local_rank: int) -> None:
    """Under cupy, use GPU `node_local_rank % GPUs on this node` (one rank per GPU when they match)."""
    if _name == "cupy":
        count = xp.cuda.runtime.getDeviceCount()
        xp.cuda.Device(node_local_rank % count).use()


_requested = os.environ.get("HPCPAR_BACKEND", "numpy").strip().lower() or "numpy"
if _requested != "numpy":
    use(_requested)
