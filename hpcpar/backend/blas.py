"""Matrix products on the CPU: Intel MKL's GEMM through ctypes when the `mkl` package is installed,
NumPy's matmul (OpenBLAS in NumPy's wheels) otherwise.

A GPT training step on the CPU is mostly GEMMs, and at a transformer's shapes MKL's sgemm runs
10-15 % faster than OpenBLAS's on the x86 CPUs this engine was measured on (bench/vs_torch.py;
PyTorch's CPU wheels use MKL too). `pip install hpcpar[mkl]` brings it (a large download, hence
optional); HPCPAR_BLAS=numpy turns it off. Both compute the same products; they add up each dot
product in a different order, so results agree to rounding, and every rank of a job uses the same.

    matmul(a, b, out=None)        a [m, k] @ b [k, n]: float32/float64 matrices, each C-ordered, a
                                  transposed view of one, or a view with strided rows (a column block)
    single_threaded()             called on a thread that runs GEMMs of its own (the kernel pool):
                                  MKL gives that thread's calls one thread, not the process's count
    compiled_gemm(dtype)          the address of an ILP64 cblas_?gemm that compiled loops call directly
                                  (jit.attention): MKL's, else the OpenBLAS inside NumPy's wheel

Threads: the rank's BLAS threads (MKL_NUM_THREADS, which `threads.py` sets like OMP_NUM_THREADS).
One thread runs MKL's sequential layer, which starts no OpenMP runtime. Two or more with Numba
(`kernel_pool.splits_gemms()`): MKL's sequential layer too, and each single product is cut into
pieces of whole rows (or columns) of C that the kernel pool's threads compute at once (`_pieces`,
`kernel_pool.split_gemm`): one pool of threads spinning between GEMMs and kernels, where MKL's
OpenMP threads had to sleep after every call. Otherwise MKL's OpenMP layer with that many threads.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import math
import os
import sys

import numpy as np

from hpcpar.backend import kernel_pool
from hpcpar import environment

_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112
_MKL_THREADING_SEQUENTIAL, _MKL_THREADING_INTEL = 1, 0

_lib = None            # the loaded libmkl_rt, or None
_gemm = {}             # numpy dtype -> cblas ?gemm
_gemm_batch = {}       # numpy dtype -> cblas ?gemm_batch_strided
_loaded = False
_split = False         # MKL runs sequentially; the kernel pool's threads share each product


def _candidates() -> list[str]:
    """Where pip's `mkl` wheel puts libmkl_rt (the environment's lib/), then the loader's paths."""
    found = []
    for prefix in dict.fromkeys((sys.prefix, sys.base_prefix, os.environ.get("CONDA_PREFIX", ""))):
        if prefix:
            found += sorted(glob.glob(os.path.join(prefix, "lib", "libmkl_rt.so*")), reverse=True)
    return found + ["libmkl_rt.so.2", "libmkl_rt.so"]


def _load():
    """libmkl_rt set up for this process (threading layer, threads), or None."""
    global _lib, _loaded, _split
    if _loaded:
        return _lib
    _loaded = True
    if os.environ.get("HPCPAR_BLAS", "").strip().lower() == "numpy":
        return None
    # Intel OpenMP's threads spin for 200 ms after each parallel GEMM by default, on the cores the
    # elementwise kernels' threads (backend/cpu) need next: sleep at once instead.
    os.environ.setdefault("KMP_BLOCKTIME", "0")
    for path in _candidates():
        try:
            lib = ctypes.CDLL(path)
            lib.cblas_sgemm, lib.cblas_dgemm  # noqa: B018 - both must be there
        except (OSError, AttributeError):
            continue
        n = environment.blas_threads()
        # With Numba the kernel pool splits each product among its threads (kernel_pool: one pool
        # whose threads spin between calls, as PyTorch's OpenMP pool does) and MKL runs sequentially.
        split = n > 1 and kernel_pool.splits_gemms() and compiled_gemm(np.float32, lib) is not None
        lib.MKL_Set_Threading_Layer(_MKL_THREADING_SEQUENTIAL if n == 1 or split else _MKL_THREADING_INTEL)
        lib.MKL_Set_Num_Threads(ctypes.c_int(n))
        vp, i = ctypes.c_void_p, ctypes.c_int
        for dtype, fn, batched, scalar in (
                (np.float32, lib.cblas_sgemm, lib.cblas_sgemm_batch_strided, ctypes.c_float),
                (np.float64, lib.cblas_dgemm, lib.cblas_dgemm_batch_strided, ctypes.c_double)):
            fn.restype = batched.restype = None
            fn.argtypes = [i, i, i, i, i, i, scalar, vp, i, vp, i, scalar, vp, i]
            batched.argtypes = [i, i, i, i, i, i, scalar, vp, i, i, vp, i, i, scalar, vp, i, i, i]
            _gemm[np.dtype(dtype)] = fn
            _gemm_batch[np.dtype(dtype)] = batched
        lib.MKL_Set_Num_Threads_Local.argtypes = [i]
        _lib = lib
        if split:
            _split = True
            kernel_pool.allow_spinning()
        # NumPy's OpenBLAS is left the products below MIN_MKL_WORK: one thread, so its workers do
        # not spin (as they do after each call) on the cores the kernels' threads need.
        one = _numpy_openblas("scipy_openblas_set_num_threads64_", "openblas_set_num_threads64_",
                              "openblas_set_num_threads")
        if one is not None:
            one(1)
        break
    return _lib


def name() -> str:
    """The GEMM in use: "mkl" or "numpy"."""
    return "mkl" if _load() is not None else "numpy"


def single_threaded() -> None:
    """This thread's MKL GEMMs run on it alone (MKL's per-thread setting). OpenBLAS has none that
    works (its `openblas_set_num_threads_local` sets the count of the whole process in NumPy's
    pthreads build): NumPy's small GEMMs, the kind such threads issue, run single-threaded anyway."""
    lib = _load()
    if lib is not None:
        lib.MKL_Set_Num_Threads_Local(1)


@contextlib.contextmanager
def one_thread():
    """GEMMs of this thread run on it alone inside (MKL's per-thread setting), as the kernel pool's
    threads do: the caller of a threaded kernel computes a share of its blocks alongside them."""
    lib = _load()
    if lib is None or _split:  # (split: MKL runs its sequential layer, one thread already)
        yield
        return
    lib.MKL_Set_Num_Threads_Local(1)
    try:
        yield
    finally:
        lib.MKL_Set_Num_Threads_Local(0)  # 0: back to the process-wide count


_compiled: dict = {}


def compiled_gemm(dtype, lib=None) -> int | None:
    """The address of a row-major CBLAS ?gemm with 64-bit integer arguments (ILP64) for float32 /
    float64, for compiled code to call without the GIL (jit.attention): MKL's `cblas_?gemm_64` where
    MKL is loaded (oneMKL 2023 on), else the one in the OpenBLAS that NumPy's wheel bundles, else
    None (the callers take their NumPy path). `lib`: libmkl_rt while `_load` sets it up."""
    dtype = np.dtype(dtype)
    if dtype not in (np.float32, np.float64):
        return None
    if dtype not in _compiled:
        letter = "s" if dtype == np.float32 else "d"
        lib = lib or _load()
        fn = getattr(lib, f"cblas_{letter}gemm_64", None) if lib is not None else \
            _numpy_openblas(f"scipy_cblas_{letter}gemm64_", f"cblas_{letter}gemm64_", argtypes=None)
        _compiled[dtype] = ctypes.cast(fn, ctypes.c_void_p).value if fn is not None else None
    return _compiled[dtype]


def _numpy_openblas(*names: str, argtypes=(ctypes.c_int,)):
    """The first of `names` in the OpenBLAS that NumPy's wheel bundles (numpy.libs/), or None (a NumPy
    built otherwise: conda's MKL, a system BLAS); `argtypes` set when given (None: the caller's)."""
    libs = glob.glob(os.path.join(os.path.dirname(os.path.dirname(np.__file__)), "numpy.libs", "*openblas*.so*"))
    for path in libs:
        try:
            lib = ctypes.CDLL(path)  # already loaded by NumPy: the same library
        except OSError:
            continue
        for name in names:
            fn = getattr(lib, name, None)
            if fn is not None:
                if argtypes is not None:
                    fn.restype = None
                    fn.argtypes = list(argtypes)
                return fn
    return None


def _operand(a) -> tuple[int, int] | None:
    """(transpose flag, leading dimension) of a matrix (the last two dims) for a row-major GEMM,
    or None when neither its rows nor its columns are contiguous."""
    item = a.itemsize
    s0, s1 = a.strides[-2:]
    rows, cols = a.shape[-2:]
    if (s1 == item or cols == 1) and s0 % item == 0 and s0 >= cols * item:
        return _NO_TRANS, max(s0 // item, cols, 1)
    if (s0 == item or rows == 1) and s1 % item == 0 and s1 >= rows * item:
        return _TRANS, max(s1 // item, rows, 1)
    return None


def _batch_stride(a) -> int | None:
    """The element stride between consecutive matrices of a stack `a` [..., m, n], its batch dims
    flattened in C order (0 for a single matrix), or None when they do not collapse into one stride."""
    dims = [(n, st) for n, st in zip(a.shape[:-2], a.strides[:-2]) if n != 1]
    if not dims:
        return 0
    for (_, st0), (n1, st1) in zip(dims, dims[1:]):
        if st0 != st1 * n1:
            return None
    step = dims[-1][1]
    return step // a.itemsize if step >= 0 and step % a.itemsize == 0 else None


def matmul(a, b, out=None):
    """a @ b as np.matmul: matrices [m, k] @ [k, n], or stacks of them [..., m, k] @ [..., k, n]
    (batch dims equal, or one operand's absent), float32/float64, each matrix C-ordered, a
    transposed view of one, or with strided rows (a column block); `out` (optional) with unit
    column stride. Through MKL where it is loaded and the matrices are large enough to gain from
    it (`MIN_MKL_WORK`); NumPy's matmul otherwise. How to call MKL for a given set of shapes and
    strides is worked out once and kept (`_prepared_gemms`): a step makes the same calls every time."""
    if not _loaded:
        _load()
    if _lib is None:
        return np.matmul(a, b, out=out)
    key = (a.dtype, a.shape, a.strides, b.dtype, b.shape, b.strides,
           None if out is None else (out.dtype, out.shape, out.strides), _split and kernel_pool.num_threads())
    gemm = _prepared_gemms.get(key)
    if gemm is None:
        if len(_prepared_gemms) >= 4096:  # (shapes change only with the model or batch: a bound, not a policy)
            _prepared_gemms.clear()
        gemm = _prepared_gemms[key] = _prepare_gemm(a, b, out)
    if gemm is False:
        return np.matmul(a, b, out=out)
    if gemm.copy_a:
        a = np.ascontiguousarray(a)
    if gemm.copy_b:
        b = np.ascontiguousarray(b)
    if out is None:
        out = np.empty(gemm.shape, dtype=a.dtype)
    pa, pb, pc = a.ctypes.data, b.ctypes.data, out.ctypes.data
    if gemm.split is not None:
        address, f64, pieces, ta, tb, k, lda, ldb, ldc = gemm.split
        if kernel_pool.split_gemm(address, f64, pieces, ta, tb, k, pa, lda, pb, ldb, pc, ldc):
            return out
    for fn, head, lda, ldb, tail, oa, ob, oc in gemm.calls:
        fn(*head, pa + oa, *lda, pb + ob, *ldb, 0.0, pc + oc, *tail)
    return out


# Work per matrix (m n k) below which NumPy's matmul is used: OpenBLAS is as fast there and a
# ctypes call costs a few microseconds (attention's per-head products at small head sizes).
MIN_MKL_WORK = 1 << 20
_prepared_gemms: dict = {}


class _PreparedGemm:
    """How matmul calls MKL for one set of operand shapes and strides (`_prepare_gemm`): the output
    shape, which operands to copy first, the cblas calls, and the split among threads (or None)."""

    __slots__ = ("shape", "copy_a", "copy_b", "calls", "split")


# Rows (or columns) of a piece of a split product are a multiple of this: whole register tiles of
# the GEMM's kernels, so a piece runs as fast per element as the whole product.
_PIECE_ALIGN = 16


def _pieces(m: int, n: int, oa: tuple, ob: tuple, ldc: int, item: int, threads: int) -> np.ndarray:
    """How `kernel_pool.split_gemm` cuts C [m, n] = op(A) op(B) among `threads` threads: int64
    [pieces, 5] of (rows, columns, byte offsets into A, B, C), whole rows of C when m >= n (each
    piece reads all of B), else whole columns; at most `threads` pieces, each a multiple of
    _PIECE_ALIGN but the last. oa, ob: (transpose flag, leading dimension) of A and B."""
    rows = m >= n
    size = m if rows else n
    per = -(-size // threads)
    per = -(-per // _PIECE_ALIGN) * _PIECE_ALIGN
    pieces = []
    for lo in range(0, size, per):
        hi = min(lo + per, size)
        if rows:  # rows lo..hi of op(A): its rows (no transpose) or its columns (transposed)
            step_a = oa[1] * item if oa[0] == _NO_TRANS else item
            pieces.append((hi - lo, n, lo * step_a, 0, lo * ldc * item))
        else:     # columns lo..hi of op(B): its columns (no transpose) or its rows (transposed)
            step_b = item if ob[0] == _NO_TRANS else ob[1] * item
            pieces.append((m, hi - lo, 0, lo * step_b, lo * item))
    return np.array(pieces, dtype=np.int64)


def _prepare_gemm(a, b, out):
    """How matmul calls MKL for these operands, or False for NumPy."""
    dtype = a.dtype
    fn = _gemm.get(dtype)
    if (fn is None or a.ndim < 2 or b.ndim < 2 or b.dtype != dtype or 0 in a.shape or 0 in b.shape
            or a.shape[-1] != b.shape[-2] or (out is not None and out.dtype != dtype)):
        return False
    batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    if batch and (a.shape[:-2] not in (batch, ()) or b.shape[:-2] not in (batch, ())):
        return False
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    if m * n * k < MIN_MKL_WORK:
        return False
    if out is not None and out.shape != batch + (m, n):
        return False
    gemm = _PreparedGemm()
    gemm.shape = batch + (m, n)
    oa, ob = _operand(a), _operand(b)
    gemm.copy_a, gemm.copy_b = oa is None, ob is None
    if gemm.copy_a:
        a = np.ascontiguousarray(a)
        oa = _operand(a)
    if gemm.copy_b:
        b = np.ascontiguousarray(b)
        ob = _operand(b)
    c = out if out is not None else np.empty(gemm.shape, dtype=dtype)
    oc = _operand(c)
    if oc is None or oc[0] != _NO_TRANS:
        return False
    head = (_ROW_MAJOR, oa[0], ob[0], m, n, k, 1.0)
    count = math.prod(batch)
    sa, sb, sc = _batch_stride(a), _batch_stride(b), _batch_stride(c)
    gemm.split = None
    if count == 1:
        gemm.calls = [(fn, head, (oa[1],), (ob[1],), (oc[1],), 0, 0, 0)]
        threads = kernel_pool.num_threads() if _split else 1
        if threads > 1:
            pieces = _pieces(m, n, oa, ob, oc[1], a.itemsize, threads)
            if len(pieces) > 1:
                gemm.split = (compiled_gemm(dtype), dtype == np.float64, pieces, oa[0], ob[0], k, oa[1], ob[1], oc[1])
    elif sa is not None and sb is not None and sc:
        gemm.calls = [(_gemm_batch[dtype], head, (oa[1], sa), (ob[1], sb), (oc[1], sc, count), 0, 0, 0)]
    else:
        # Batch dims that do not collapse to one stride (the heads of a [B, T, 3, H, D] block): one
        # call per index of the first batch dim, batched over the rest where those collapse.
        def inner(x):
            return x[0] if x.ndim > 2 else x
        ia, ib, ic = inner(a), inner(b), inner(c)
        rest = math.prod(batch[1:])
        sa, sb, sc = _batch_stride(ia), _batch_stride(ib), _batch_stride(ic)
        if rest > 1 and not (sa is not None and sb is not None and sc):
            return False
        step_a = a.strides[0] if a.ndim > 2 else 0
        step_b = b.strides[0] if b.ndim > 2 else 0
        if rest == 1:
            one = (fn, head, (oa[1],), (ob[1],), (oc[1],))
        else:
            one = (_gemm_batch[dtype], head, (oa[1], sa), (ob[1], sb), (oc[1], sc, rest))
        gemm.calls = [one + (i * step_a, i * step_b, i * c.strides[0]) for i in range(batch[0])]
    return gemm
