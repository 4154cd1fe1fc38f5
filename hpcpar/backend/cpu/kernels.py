"""Cache-blocked CPU kernels: the CPU twins of `kernels.py`.

A chain of NumPy calls over a whole activation ([B T, 4C] floats, megabytes) streams the array
through main memory once per call, and every call allocates a result as large. Here each chain
runs over blocks small enough (`BLOCK_BYTES`) that all its intermediates stay in a core's L2
cache, in scratch arrays reused from block to block and step to step, so memory sees each input
and output about once. With the `fast` extra a block's chain is one compiled loop instead
(`jit_kernels`, Numba: NumPy keeps tanh and exp). With more than one thread per rank
(`threads.blas_threads()`, or `set_threads`) the blocks are shared out to the rank's compute threads
(`kernel_pool`), the caller included: NumPy calls and the compiled loops release the GIL, so the
threads compute at once. With Numba, LayerNorm, large bias adds and column sums, and AdamW's step
go to the threads as compiled tasks (`jit_pool`: runs of whole blocks, no Python on the threads).

    gelu_forward / gelu_backward            elementwise, tanh form (bias_gelu_*: with a linear's bias)
    add_bias / column_sums                  a linear's bias and its gradient
    sum_of_squares                          a gradient norm's share, in float64
    layer_norm_forward / _backward          rows of [N, C]
    causal_attention_forward / _backward    per (batch group, query block), causal blocks skipped;
                                            with Numba, per (sample, head) in compiled calls
                                            (jit_attention)
    cross_entropy_forward / _backward       rows of logits [N, V]
    adamw_update                            every parameter of a step in place, blockwise

The elementwise kernels compute what the plain NumPy composition computes (the same operations on
each element in the same order; tests/unit/test_cpu_kernels.py holds them to it); LayerNorm's row
statistics and the attention's softmax are rearranged (row sums by einsum or in eight lanes,
exponentials without the max shift, normalisation after P V: see each docstring) and equal the
textbook formulas to rounding. 16-bit inputs (bf16/fp16 activations, `precision.py`) are taken up
to float32 block by block and the results rounded once. Results do not depend on the thread
count: blocks are cut from the shape alone, each element's (each row's) arithmetic is the same in
whichever block it lands, and the reductions across rows (weight and bias gradients) add
per-block partial sums in block order.
"""

from __future__ import annotations

import functools
import math
import os
import threading
import weakref
from types import SimpleNamespace

import numpy as np

from hpcpar.backend import blas, kernel_pool
from hpcpar.backend.kernel_pool import num_threads, set_threads  # noqa: F401 - this module's thread knobs
from hpcpar.backend.precision import down, is_low, up, up_dtype

# Bytes of one block's main array: the three or four arrays of a chain fit a 2 MiB L2 cache
# together. Measured on the default and the largest benchmark model's GELU and LayerNorm: one
# thread is 1.6x faster than unblocked from 128 to 384 KiB and slower again from 768 KiB; two
# threads gain 1.2-1.5x over one from 384 KiB, where a block's arithmetic outweighs the Python
# around each NumPy call (which holds the GIL), and nothing at 192 KiB.
BLOCK_BYTES = 384 * 1024
# Attention: bytes of one work unit's [nb, H, T, T] scores (a group of batch rows, all heads), and
# query rows per block. A block's keys stop at its last query (the causal edge), so the scores above
# the diagonal blocks are never computed: 1/4 of them for T = 128, 3/8 for T = 256.
ATTENTION_BYTES = 1024 * 1024
QUERY_BLOCK = 64

_GELU_A = 0.044715
_GELU_C = math.sqrt(2.0 / math.pi)

# -- blocks and threads ------------------------------------------------------------------------

# Blocks a thread takes at least: handing a part to a sleeping thread and waiting for it costs
# 60-80 us on the benchmark VM (waking a sleeping thread there takes tens of microseconds), as much
# as a 384 KiB block's arithmetic, so a kernel of two or three blocks runs on the caller alone.
_MIN_BLOCKS_PER_THREAD = 2
_local = threading.local()


def _run(fn, blocks: list, gemms: bool = False) -> None:
    """fn(a, e) for every (a, e) in `blocks`: on this thread, or, with several threads, each thread
    (this one too) taking a contiguous run of blocks (which block a result lands in never depends
    on it). `gemms`: the blocks multiply matrices, which then run single-threaded on each thread
    (the threads are the cores). Called from one thread at a time (the training loop's)."""
    n = min(num_threads(), len(blocks) // _MIN_BLOCKS_PER_THREAD)
    if n <= 1:
        for a, e in blocks:
            fn(a, e)
        return
    per = -(-len(blocks) // n)
    parts = [blocks[i:i + per] for i in range(0, len(blocks), per)]
    kernel_pool.run(functools.partial(_run_gemm_part if gemms else _run_part, fn), parts)


def _run_part(fn, part: list) -> None:
    for a, e in part:
        fn(a, e)


def _run_gemm_part(fn, part: list) -> None:
    with blas.one_thread():
        _run_part(fn, part)


def _blocks(n: int, item_bytes: int, block_bytes: int = 0) -> list:
    """[(a, e), ...] covering range(n) in pieces of about `block_bytes` (default BLOCK_BYTES) of
    `item_bytes` each (at least one item a piece)."""
    step = max(1, (block_bytes or BLOCK_BYTES) // max(1, item_bytes))
    return [(a, min(a + step, n)) for a in range(0, n, step)]


def _scratch(slot: str, shape: tuple, dtype) -> np.ndarray:
    """A per-thread scratch array for `slot`, reused while the shape and dtype stay the same."""
    cache = getattr(_local, "cache", None)
    if cache is None:
        cache = _local.cache = {}
    key = (slot, dtype)
    buf = cache.get(key)
    size = math.prod(shape)
    if buf is None or buf.size < size:
        buf = cache[key] = np.empty(max(size, 1), dtype=dtype)
    return buf[:size].reshape(shape)


def _flat(a) -> np.ndarray:
    return np.ascontiguousarray(a).reshape(-1)


# -- GELU ------------------------------------------------------------------------------------------

_jit_module = None


def _jit():
    """`jit_kernels` (Numba's compiled loops), or None: Numba not installed, or HPCPAR_JIT=0."""
    global _jit_module
    if _jit_module is None:
        _jit_module = False
        if os.environ.get("HPCPAR_JIT", "1").strip() != "0":
            try:
                from hpcpar.backend.jit import kernels as jit_kernels
                _jit_module = jit_kernels
            except ImportError:
                pass
    return _jit_module or None


def _jit_pool():
    """`jit_pool` (compiled tasks the kernel threads run without Python) when the compiled loops are
    in use, else None."""
    if _jit() is None:
        return None
    from hpcpar.backend.jit import pool as jit_pool
    return jit_pool


def jit_name() -> str:
    """The elementwise loops in use: "numba" (the `fast` extra) or "numpy"."""
    return "numba" if _jit() is not None else "numpy"


@functools.cache
def _constants(dtype) -> SimpleNamespace:
    """The GELU constants in `dtype`, as NumPy rounds a Python float operand to the array's dtype."""
    t = np.dtype(dtype).type
    return SimpleNamespace(a=t(_GELU_A), a3=t(3 * _GELU_A), c=t(_GELU_C), one=t(1.0), half=t(0.5))


def _tanh_u(xs, t) -> None:
    """t = tanh(sqrt(2/pi) (x + 0.044715 x^3)) as ((x x 0.044715 + 1) x) sqrt(2/pi), in place in t
    (xs and t contiguous, the compute dtype)."""
    jit = _jit()
    if jit is not None:
        k = _constants(xs.dtype)
        jit.gelu_inner(xs.reshape(-1), t.reshape(-1), k.a, k.one, k.c)
    else:
        np.multiply(xs, xs, out=t)
        t *= _GELU_A
        t += 1.0
        t *= xs
        t *= _GELU_C
    np.tanh(t, out=t)


def _gelu_out(xs, t, o) -> None:
    """o = (t + 1) x 0.5: GELU from t = tanh(..) (contiguous, the compute dtype)."""
    jit = _jit()
    if jit is not None:
        k = _constants(xs.dtype)
        jit.gelu_outer(xs.reshape(-1), t.reshape(-1), o.reshape(-1), k.one, k.half)
        return
    np.add(t, 1.0, out=o)
    o *= xs
    o *= 0.5


def gelu_forward(x, keep_tanh: bool = True):
    """GELU (tanh form) of x (any shape, C-contiguous or not): (y, t) with y = 0.5 x (1 + t) in
    x's dtype and t = tanh(..) in the compute dtype (float32 for 16-bit x) when `keep_tanh`, else None."""
    xf = _flat(x)
    cd = up_dtype(xf.dtype)
    out = np.empty_like(xf)
    kept = np.empty(xf.shape, dtype=cd) if keep_tanh else None
    low = is_low(xf.dtype)

    def block(a, e):
        xs = up(xf[a:e])
        t = kept[a:e] if kept is not None else _scratch("gelu_t", (e - a,), cd)
        _tanh_u(xs, t)
        o = _scratch("gelu_o", (e - a,), cd) if low else out[a:e]
        _gelu_out(xs, t, o)
        if low:
            out[a:e] = o
    _run(block, _blocks(xf.size, cd.itemsize))
    return out.reshape(x.shape), (kept.reshape(x.shape) if kept is not None else None)


def gelu_backward(x, t, g):
    """dx of gelu_forward's y: g (0.5 (1 + t) + 0.5 x (1 - t^2) c (1 + 3 0.044715 x^2)), in x's
    dtype; `t` the kept tanh (None: recomputed from x, as for 16-bit x)."""
    xf, gf = _flat(x), _flat(g)
    tf = _flat(t) if t is not None else None
    cd = up_dtype(xf.dtype)
    out = np.empty_like(xf)
    low = is_low(xf.dtype)

    def block(a, e):
        s = _scratch("gelu_o", (e - a,), cd) if low else out[a:e]
        _gelu_grad(up(xf[a:e]), tf[a:e] if tf is not None else None, up(gf[a:e]), s)
        if low:
            out[a:e] = s
    _run(block, _blocks(xf.size, cd.itemsize))
    return out.reshape(x.shape)


def _gelu_grad(xs, tt, gs, s) -> None:
    """s = GELU's gradient at xs times gs (all in the compute dtype); tt: the kept tanh, or None."""
    if tt is None:
        tt = _scratch("gelu_t", xs.shape, xs.dtype)
        _tanh_u(xs, tt)
    jit = _jit()
    if jit is not None and xs.flags.c_contiguous and tt.flags.c_contiguous and gs.flags.c_contiguous:
        k = _constants(xs.dtype)
        jit.gelu_grad(xs.reshape(-1), tt.reshape(-1), gs.reshape(-1), s.reshape(-1), k.a3, k.one, k.c, k.half)
        return
    x2 = _scratch("gelu_x2", xs.shape, xs.dtype)
    np.multiply(xs, xs, out=x2)
    x2 *= 3 * _GELU_A
    x2 += 1.0
    x2 *= _GELU_C
    np.multiply(tt, tt, out=s)
    np.subtract(1.0, s, out=s)
    s *= xs
    s *= x2
    s += tt
    s += 1.0
    s *= 0.5
    s *= gs


def bias_gelu_forward(y, b, dt):
    """GELU of a linear's pre-activation: y [N, n] the GEMM's output (compute dtype, a fresh array:
    the bias is added into it), b [n] or None (compute dtype). Returns (out [N, n] in `dt`, pre, t):
    pre = y + b, kept for backward (y itself; rounded to `dt` in 16 bits, as a separate linear would
    have stored its output), and t = tanh(..) (None in 16 bits: backward recomputes it)."""
    n, cols = y.shape
    low = is_low(dt)
    cd = y.dtype
    out = np.empty((n, cols), dtype=dt)
    pre = np.empty((n, cols), dtype=dt) if low else y
    kept = None if low else np.empty_like(y)

    jit = _jit()

    def block(a, e):
        ys = y[a:e]
        if b is not None:
            if jit is not None:
                jit.add_bias_rows(ys, b)
            else:
                ys += b
        if low:
            pre[a:e] = ys
            xs = _scratch("bg_x", ys.shape, cd)
            xs[...] = pre[a:e]
        else:
            xs = ys
        t = kept[a:e] if kept is not None else _scratch("gelu_t", ys.shape, cd)
        _tanh_u(xs, t)
        o = _scratch("gelu_o", ys.shape, cd) if low else out[a:e]
        _gelu_out(xs, t, o)
        if low:
            out[a:e] = o
    _run(block, _blocks(n, cols * cd.itemsize))
    return out, pre, kept


def bias_gelu_backward(pre, t, g, bias: bool):
    """(g_pre [N, n] in pre's dtype, dbias [n] or None) for bias_gelu_forward's output gradient g:
    GELU's gradient, and the bias gradient = its column sums (per-block partials, in block order),
    both from one pass over the blocks."""
    n, cols = pre.shape
    cd = up_dtype(pre.dtype)
    low = is_low(pre.dtype)
    grad = np.empty((n, cols), dtype=pre.dtype)
    blocks = _blocks(n, cols * cd.itemsize)
    db = np.empty((len(blocks), cols), dtype=cd) if bias else None
    index = {blk: i for i, blk in enumerate(blocks)}
    jit = _jit()

    def block(a, e):
        s = _scratch("bg_s", (e - a, cols), cd) if low else grad[a:e]
        _gelu_grad(up(pre[a:e]), t[a:e] if t is not None else None, up(g[a:e]), s)
        if low:
            grad[a:e] = s
            s[...] = grad[a:e]  # the bias gradient of the rounded values, as a separate linear sums them
        if db is not None:
            if jit is not None and s.flags.c_contiguous:
                k = index[(a, e)]                                            # (einsum holds the GIL)
                jit.column_sums_blocks(s, db[k:k + 1], e - a)
            else:
                np.einsum("ij->j", s, out=db[index[(a, e)]])
    _run(block, blocks)
    return grad, (_sum_partials(db) if db is not None else None)


def _compiled_rows(a):
    """(jit_kernels, jit_pool or None, rows per block) for a [N, n] that the compiled loops take
    (C-contiguous, float32 or float64), else None. jit_pool (row tasks on the kernel threads) only
    with several threads and more than two blocks: below that a task's set-up costs more than the
    second thread gains."""
    jit = _jit()
    if jit is None or a.ndim != 2 or not a.flags.c_contiguous or a.dtype not in (np.float32, np.float64):
        return None
    rows = _block_rows(a.shape[1], a.dtype)
    pool = _jit_pool() if num_threads() > 1 and a.shape[0] > 2 * rows else None
    return jit, pool, rows


def add_bias(y, b) -> None:
    """y [N, n] += b [n] in place (a linear's bias: a broadcast over short rows is a slow NumPy loop);
    large ones in runs of whole rows on the kernel threads."""
    compiled = _compiled_rows(y) if y.dtype == b.dtype else None
    if compiled is None:
        y += b
        return
    jit, pool, rows = compiled
    b = np.ascontiguousarray(b)
    if pool is None:
        jit.add_bias_rows(y, b)
    else:
        kernel_pool.run_tasks(pool.row_tasks(pool.ADD_BIAS, y, b, b, b, b, y, y, b, b, 0, b, rows, num_threads()))


def column_sums(a):
    """The sum over rows of a [N, n] (a bias's gradient): with the compiled loops, each block's
    (`_block_rows`) sum row by row, the blocks' sums added in block order (the same bits on any
    thread count; large ones with the blocks' runs on the kernel threads); else NumPy's."""
    compiled = _compiled_rows(a)
    if compiled is None:
        return a.sum(axis=0)
    jit, pool, rows = compiled
    parts = np.empty((-(-a.shape[0] // rows), a.shape[1]), dtype=a.dtype)
    if pool is None:
        jit.column_sums_blocks(a, parts, rows)
    else:
        kernel_pool.run_tasks(pool.row_tasks(pool.COLUMN_SUMS, a, parts, parts, parts, parts, a, a, parts, parts, 0,
                                             parts, rows, num_threads()))
    return _sum_partials(parts)


def sum_of_squares(a) -> float:
    """The sum of the squares of a's elements, accumulated in float64 (a gradient norm's share):
    without a float64 copy of `a` when the compiled loops are there."""
    flat = a.reshape(-1)
    jit = _jit()
    if jit is not None and flat.dtype in (np.float32, np.float64):
        return float(jit.sum_of_squares(flat))
    flat = flat.astype(np.float64, copy=False)
    return float(np.dot(flat, flat))


# -- LayerNorm -------------------------------------------------------------------------------------

def _row_mean(a, out) -> None:
    """out [n, 1] = the mean of each row of a [n, c] (einsum's row sums: a third of the time of
    NumPy's reduction over short rows, and each row's sum the same bits wherever the row is)."""
    np.einsum("ij->i", a, out=out[:, 0])
    out /= a.shape[1]


def _row_dot_mean(a, b, out) -> None:
    """out [n, 1] = the mean over each row of a * b (one pass, no product array)."""
    np.einsum("ij,ij->i", a, b, out=out[:, 0])
    out /= a.shape[1]


def layer_norm_forward(x, w, b, eps: float):
    """LayerNorm over the last dim of x [..., C] with weight w [C] (and bias b [C] or None), both
    already in the compute dtype: xhat = (x - mean) / sqrt(var + eps), y = xhat w + b. Returns
    (y in x's dtype, mean [N, 1], rstd [N, 1]) with N = x.size / C: backward rebuilds xhat from them
    (the same bits as the forward's), as PyTorch and the GPU kernels do, instead of keeping [N, C]."""
    c = x.shape[-1]
    x2 = np.ascontiguousarray(x).reshape(-1, c)
    n = x2.shape[0]
    cd = up_dtype(x2.dtype)
    low = is_low(x2.dtype)
    out = np.empty_like(x2)
    mean = np.empty((n, 1), dtype=cd)
    rstd = np.empty((n, 1), dtype=cd)
    pool = None if low else _jit_pool()
    if pool is not None:
        # Task rows hold addresses only: every array they name is bound to a name here until they ran.
        w = np.ascontiguousarray(w)
        b = np.ascontiguousarray(b) if b is not None else w
        consts = np.array([c, eps], dtype=cd)
        kernel_pool.run_tasks(pool.row_tasks(
            pool.LN_FORWARD, x2, w, b, mean, rstd, x2, out, mean, mean, pool.HAS_BIAS if b is not w else 0,
            consts, _block_rows(c, cd), num_threads()))
        return out.reshape(x.shape), mean, rstd

    def block(a, e):
        xs = up(x2[a:e])
        mu = mean[a:e]
        _row_mean(xs, mu)
        xh = _scratch("ln_xhat", (e - a, c), cd)
        np.subtract(xs, mu, out=xh)
        rs = rstd[a:e]
        _row_dot_mean(xh, xh, rs)
        rs += eps
        np.sqrt(rs, out=rs)
        np.divide(1.0, rs, out=rs)
        xh *= rs
        o = _scratch("ln_out", (e - a, c), cd) if low else out[a:e]
        np.multiply(xh, w, out=o)
        if b is not None:
            o += b
        if low:
            out[a:e] = o
    _run(block, _blocks(n, c * cd.itemsize))
    return out.reshape(x.shape), mean, rstd


def _block_rows(c: int, cd) -> int:
    """Rows of [N, C] per block (BLOCK_BYTES of the compute dtype): the unit of the weight gradient's
    per-block partial sums, so that they are the same on any thread count."""
    return max(1, BLOCK_BYTES // max(1, c * np.dtype(cd).itemsize))


def layer_norm_backward(x, w, mean, rstd, g, want_dx: bool, want_dw: bool, bias: bool):
    """LayerNorm's gradients for output gradient g (x's shape), from the forward's mean and rstd
    (xhat = (x - mean) rstd rebuilt per row): (dx in x's dtype when want_dx, else None;
    dweight [C] and dbias [C] (None without bias) in the compute dtype when want_dw, else None).
    With gxhat = g w: dx = (gxhat - mean(gxhat) - xhat mean(gxhat xhat)) rstd per row;
    dweight = sum over rows of g xhat, dbias = of g, as per-block partial sums added in block order.
    Both at once read x and g once (a plain backward); a split backward (B, then W) asks for each alone."""
    c = x.shape[-1]
    x2 = np.ascontiguousarray(x).reshape(-1, c)
    g2 = np.ascontiguousarray(g).reshape(-1, c)
    n = x2.shape[0]
    cd = up_dtype(x2.dtype)
    low = is_low(x2.dtype)
    rows = _block_rows(c, cd)
    blocks = -(-n // rows)
    dx = np.empty((n, c), dtype=x2.dtype) if want_dx else None
    dw = np.empty((blocks, c), dtype=cd) if want_dw else None
    db = np.empty((blocks, c), dtype=cd) if want_dw and bias else None
    pool = None if low else _jit_pool()
    if pool is not None:
        w = np.ascontiguousarray(w)  # (bound to names until the tasks ran, as in layer_norm_forward)
        consts = np.array([c, 0], dtype=cd)
        flags = (pool.WANT_DX if want_dx else 0) | (pool.WANT_DW if want_dw else 0) | (pool.HAS_BIAS if bias else 0)
        kernel_pool.run_tasks(pool.row_tasks(
            pool.LN_BACKWARD, x2, w, w, mean, rstd, g2, dx if dx is not None else x2,
            dw if dw is not None else mean, db if db is not None else mean, flags, consts, rows, num_threads()))
    else:
        def block(a, e):
            xh = _scratch("ln_xhat", (e - a, c), cd)
            np.subtract(up(x2[a:e]), mean[a:e], out=xh)
            xh *= rstd[a:e]
            gs = up(g2[a:e])
            if want_dw:
                np.einsum("ij,ij->j", gs, xh, out=dw[a // rows])
                if bias:
                    np.einsum("ij->j", gs, out=db[a // rows])
            if not want_dx:
                return
            gxhat = _scratch("ln_gxhat", (e - a, c), cd)
            np.multiply(gs, w, out=gxhat)
            m1 = _scratch("ln_m1", (e - a, 1), cd)
            m2 = _scratch("ln_m2", (e - a, 1), cd)
            _row_mean(gxhat, m1)
            _row_dot_mean(gxhat, xh, m2)
            gx = _scratch("ln_gx", (e - a, c), cd) if low else dx[a:e]
            np.subtract(gxhat, m1, out=gx)
            np.multiply(xh, m2, out=gxhat)
            gx -= gxhat
            gx *= rstd[a:e]
            if low:
                dx[a:e] = gx
        _run(block, _blocks(n, c * cd.itemsize))
    return (dx.reshape(x.shape) if want_dx else None,
            _sum_partials(dw) if want_dw else None, _sum_partials(db) if db is not None else None)


def _sum_partials(parts):
    """parts[0] + parts[1] + ... in order (a left fold, the same on every thread count)."""
    total = parts[0].copy()
    for p in parts[1:]:
        total += p
    return total


# -- causal attention ------------------------------------------------------------------------------

_causal_bias_cache: dict = {}


def _causal_bias(a: int, e: int, dtype) -> np.ndarray:
    """[e - a, e] additive mask of queries a..e-1 against keys 0..e-1: -inf where the key comes after
    the query, 0 elsewhere. Added to a whole contiguous block of scores, it costs a third of adding
    the [q, q] triangle to the block's strided diagonal part."""
    key = (a, e, np.dtype(dtype).str)
    bias = _causal_bias_cache.get(key)
    if bias is None:
        bias = np.zeros((e - a, e), dtype=dtype)
        bias[:, a:] = np.triu(np.full((e - a, e - a), -np.inf, dtype=dtype), k=1)
        bias = _causal_bias_cache[key] = bias
    return bias


def _transposed(x, slot: str, cd):
    """x [nb, H, T, D] (a strided view of qkv) as a contiguous [nb, H, D, T] scratch copy: products
    with a transposed operand, S = Q K^T and dP = dY V^T, run at half speed in OpenBLAS at these
    sizes when the transpose is a view (and the copy serves every query block of the group)."""
    out = _scratch(slot, x.shape[:2] + (x.shape[3], x.shape[2]), cd)
    out[...] = x.swapaxes(-1, -2)
    return out


def _query_blocks(t: int) -> list:
    return [(a, min(a + QUERY_BLOCK, t)) for a in range(0, t, QUERY_BLOCK)]


def kept_probabilities(t: int) -> int:
    """Elements of one head's probabilities that causal_attention_forward keeps for a sequence of
    `t`: each query block's rows against the keys up to its causal edge (3/4 of T^2 at T = 128,
    5/8 at 256, about half for long sequences)."""
    return sum((e - a) * e for a, e in _query_blocks(t))


def _heads(qkv, n_head: int):
    """q, k, v views [B, H, T, D] of qkv [B, T, 3 H D] (rows [q; k; v] of c_attn)."""
    b, t, three_c = qkv.shape
    d = three_c // 3 // n_head
    five = qkv.reshape(b, t, 3, n_head, d)
    return tuple(five[:, :, i].transpose(0, 2, 1, 3) for i in range(3))


def _batch_groups(b: int, per_batch_bytes: int) -> list:
    """Batch rows per attention work unit: a group's [nb, H, T, T] scores at most about
    ATTENTION_BYTES, and as many groups as a multiple of the threads where the batch allows (three
    groups on two threads would leave one idle a third of the time). A row's results do not depend
    on which rows share its group, so the grouping may follow the thread count."""
    per = max(1, ATTENTION_BYTES // max(1, per_batch_bytes))
    groups = -(-b // per)
    threads = num_threads()
    if threads > 1:
        groups = min(b, -(-groups // threads) * threads)
    per = -(-b // groups)
    return [(a, min(a + per, b)) for a in range(0, b, per)]


class AttentionSaved:
    """What causal_attention_forward keeps for backward.

    probs: per (batch group, query block), in the order of the loops (group-major), the block's
        exponentiated scores E = exp(S) [nb, H, q, keys] (full precision; see `_exp_scores`), or its
        probabilities P rounded to 16 bits (bf16/fp16); with the compiled kernels (`compiled`) one
        array [B H, K] of every (sample, head)'s blocks (`jit_attention`); None when backward
        recomputes them.
    rowsum: l = the row sums of E [B, H, T, 1] (full precision; None in 16 bits, where P = E / l).
    compiled: forward ran `jit_attention`'s kernels, and so does backward (the layout of probs).
    """

    __slots__ = ("probs", "rowsum", "compiled")

    def __init__(self, blocks: int, keep: bool, compiled: bool = False):
        self.probs: list | None = [None] * blocks if keep else None
        self.rowsum = None
        self.compiled = compiled


def _exp_scores(qs, kt, a: int, e: int, dt, out):
    """The scores of queries a..e-1 against keys 0..e-1 exponentiated, into `out` [nb, H, e-a, e]:
    E = exp(S) with S = qs k^T (qs: the queries already scaled by 1/sqrt(D); kt = k^T [nb, H, D, T]
    contiguous, `_transposed`) and keys past each
    query masked out (the diagonal block). Returns l = rowsum(E) [nb, H, e-a, 1]; in 16 bits `out`
    holds P = E / l rounded to `dt` (and back, as the GEMMs read it) and l is None.

    Softmax is the same for any shift of a row, and the usual one, the row maximum, only keeps exp
    in range; it costs two passes over the block (NumPy's maximum over short rows is the slowest op
    here, 3x a sum). Scores of a trained model stay far inside exp's range (|S| < 88 in float32), so
    E is taken unshifted, and a row whose sum left the range where E keeps full precision (an
    overflow, or every score below about -80) is computed again with its row maximum as the
    shift. Each row's result depends on that row alone, whichever block it is in."""
    s = out
    blas.matmul(qs[:, :, a:e], kt[..., :e], out=s)
    s += _causal_bias(a, e, s.dtype)
    with np.errstate(over="ignore"):  # (an overflowing row is recomputed below)
        np.exp(s, out=s)
        total = np.einsum("...j->...", s)[..., None]
    tiny, huge = _exp_range(s.dtype)
    if not ((total > tiny) & (total < huge)).all():
        _rescore_rows(qs, kt, a, e, s, total, tiny, huge)
    if not is_low(dt):
        return total
    s /= total
    s[...] = up(down(s, dt))
    return None


def _exp_range(dtype) -> tuple[float, float]:
    """(smallest, largest) row sum of unshifted exp that keeps every term at full precision: above
    the smallest normal number times 2^24 (so the largest term is well clear of subnormals) and
    below the largest finite one divided by 2^24 (room for the sum of T <= 2^24 terms)."""
    info = np.finfo(dtype)
    return float(info.tiny) * 2.0 ** 24, float(info.max) / 2.0 ** 24


def _rescore_rows(qs, kt, a: int, e: int, s, total, tiny: float, huge: float) -> None:
    """The rows of `s` whose sum left (tiny, huge), again with the row maximum as the shift (in place)."""
    bias = _causal_bias(a, e, s.dtype)
    sums = total[..., 0]
    bad = ~((sums > tiny) & (sums < huge)) & ~np.isnan(sums)  # (NaN rows stay NaN: a bad step is skipped)
    for i, h, r in zip(*np.nonzero(bad)):
        row = qs[i, h, a + r] @ kt[i, h, :, :e]
        row += bias[r]
        row -= row.max()
        np.exp(row, out=row)
        s[i, h, r] = row
        total[i, h, r, 0] = np.einsum("j->", row)


def _scaled_queries(q, scale: float, cd):
    """q [nb, H, T, D] (a strided view) times 1/sqrt(D), in a scratch array of the compute dtype."""
    qs = _scratch("attn_qs", q.shape, cd)
    np.multiply(q, scale, out=qs)
    return qs


def _compiled_attention(dtype):
    """(jit_attention, cblas gemm) where attention runs as compiled kernels (the `fast` extra, a
    float32/float64 model and a GEMM compiled code can call: `blas.compiled_gemm`), else None."""
    if is_low(dtype) or _jit() is None:
        return None
    gemm = blas.compiled_gemm(dtype)
    if gemm is None:
        return None
    from hpcpar.backend.jit import attention as jit_attention
    return jit_attention, gemm


def _unit_blocks(units: int) -> list:
    """(sample, head) units in two runs per kernel thread (one run without threads): each run is one
    compiled call that holds no GIL."""
    threads = num_threads()
    parts = 1 if threads == 1 else min(units, 2 * threads)
    per = -(-units // parts)
    return [(a, min(a + per, units)) for a in range(0, units, per)]


def _block_offsets(t: int) -> np.ndarray:
    """[blocks + 1] int64: where each query block's E starts in a unit's row of probs, then K."""
    return np.cumsum([0] + [(e - a) * e for a, e in _query_blocks(t)], dtype=np.int64)


def _compiled_forward(compiled, qkv, n_head: int, keep_probs: bool):
    jit, gemm = compiled
    qkv = np.ascontiguousarray(qkv)
    b, t, three_c = qkv.shape
    c = three_c // 3
    dt = qkv.dtype.type
    offsets = _block_offsets(t)
    out = np.empty((b, t, c), dtype=qkv.dtype)
    saved = AttentionSaved(0, False, compiled=True)
    saved.rowsum = np.empty((b, n_head, t, 1), dtype=qkv.dtype)
    probs = np.empty((b * n_head, int(offsets[-1])) if keep_probs else (1, 1), dtype=qkv.dtype)
    if keep_probs:
        saved.probs = [probs]
    tiny, huge = _exp_range(qkv.dtype)
    scale = dt(1.0 / math.sqrt(c // n_head))

    def run(u0, u1):
        jit.attention_forward(gemm, qkv, n_head, scale, dt(0), QUERY_BLOCK, offsets, u0, u1, out, saved.rowsum,
                              probs, keep_probs, dt(tiny), dt(huge))
    with blas.one_thread():  # (the products of a unit run on its thread alone, whatever the thread count)
        _run(run, _unit_blocks(b * n_head))
    return out, saved


def _compiled_backward(compiled, qkv, n_head: int, saved: AttentionSaved, g):
    jit, gemm = compiled
    qkv, g = np.ascontiguousarray(qkv), np.ascontiguousarray(g)
    b, t, three_c = qkv.shape
    c = three_c // 3
    dt = qkv.dtype.type
    keep = saved.probs is not None
    probs = saved.probs[0] if keep else np.empty((1, 1), dtype=qkv.dtype)
    grad = np.empty((b, t, three_c), dtype=qkv.dtype)
    tiny, huge = _exp_range(qkv.dtype)
    scale = dt(1.0 / math.sqrt(c // n_head))
    offsets = _block_offsets(t)

    def run(u0, u1):
        jit.attention_backward(gemm, qkv, g, n_head, scale, dt(0), QUERY_BLOCK, offsets, u0, u1, grad,
                               saved.rowsum, probs, keep, dt(tiny), dt(huge))
    with blas.one_thread():
        _run(run, _unit_blocks(b * n_head))
    return grad


def causal_attention_forward(qkv, n_head: int, keep_probs: bool = True):
    """Causal self-attention of qkv [B, T, 3 H D] -> (y [B, T, H D] in qkv's dtype, saved).

    Per batch group and query block [a, e): E = exp(S) against keys [0, e) only (the
    diagonal block masked), y = (E V) / rowsum(E): the normalisation divides the [q, D] product,
    never the [q, e] block, and backward needs no normalised P either (`causal_attention_backward`).
    In 16 bits P = E / l is formed and rounded to 16 bits first, as a 16-bit model stores it.
    `keep_probs`: keep each block's E (P) for backward; else backward recomputes them with the same
    operations (selective recomputation: the same bits). With the `fast` extra, float32/float64
    attention runs as compiled kernels instead (`jit_attention`: the same formulas, one GIL-free call
    per run of (sample, head) pairs)."""
    compiled = _compiled_attention(qkv.dtype)
    if compiled is not None:
        return _compiled_forward(compiled, qkv, n_head, keep_probs)
    b, t, three_c = qkv.shape
    c = three_c // 3
    d = c // n_head
    dt = qkv.dtype
    cd = up_dtype(dt)
    low = is_low(dt)
    scale = 1.0 / math.sqrt(d)
    q, k, v = _heads(qkv, n_head)
    out = np.empty((b, t, c), dtype=dt)
    out_heads = out.reshape(b, t, n_head, d).transpose(0, 2, 1, 3)               # [B, H, T, D] view
    qblocks = _query_blocks(t)
    groups = _batch_groups(b, n_head * t * t * cd.itemsize)
    saved = AttentionSaved(len(groups) * len(qblocks), keep_probs)
    if not low:
        saved.rowsum = np.empty((b, n_head, t, 1), dtype=cd)
    first = {b0: i * len(qblocks) for i, (b0, _) in enumerate(groups)}

    def group(b0, b1):
        qs, kt = _scaled_queries(q[b0:b1], scale, cd), _transposed(k[b0:b1], "attn_kt", cd)
        vg = _scratch("attn_v", (b1 - b0, n_head, t, d), cd)
        vg[...] = v[b0:b1]
        for j, (a, e) in enumerate(qblocks):
            shape = (b1 - b0, n_head, e - a, e)
            p = np.empty(shape, dtype=cd) if keep_probs else _scratch("attn_p", shape, cd)
            total = _exp_scores(qs, kt, a, e, dt, p)
            y = _scratch("attn_y", (b1 - b0, n_head, e - a, d), cd)
            blas.matmul(p, vg[:, :, :e], out=y)
            if total is None:                                                  # 16 bits: P is normalised
                out_heads[b0:b1, :, a:e] = y
            else:
                np.divide(y, total, out=out_heads[b0:b1, :, a:e])
                saved.rowsum[b0:b1, :, a:e] = total
            if keep_probs:
                saved.probs[first[b0] + j] = down(p, dt)
    _run(group, groups, gemms=True)
    return out, saved


def causal_attention_backward(qkv, n_head: int, saved: AttentionSaved, g):
    """dqkv [B, T, 3 H D] (qkv's dtype) of causal_attention_forward for dy = g [B, T, H D].

    With P = E / l, dP = dY V^T and delta = rowsum(dP P): dS = P (dP - delta) = E (dP' - delta')
    for dY' = dY / l, dP' = dY' V^T and delta' = rowsum(dP' E) / l, so per block dV += E^T dY', dS
    as above, dQ = dS K / sqrt(D), dK += dS^T Q / sqrt(D); no [q, e] division anywhere. In 16 bits
    (l = 1, E = the rounded P) these are the textbook formulas.
    The query blocks run last to first: the last one sees every key, so it writes the dK and dV
    accumulators of its group whole and the others add to their leading rows."""
    if saved.compiled:
        return _compiled_backward(_compiled_attention(qkv.dtype), qkv, n_head, saved, g)
    b, t, three_c = qkv.shape
    c = three_c // 3
    d = c // n_head
    dt = qkv.dtype
    cd = up_dtype(dt)
    scale = 1.0 / math.sqrt(d)
    q, k, v = _heads(qkv, n_head)
    grad = np.empty((b, t, 3 * c), dtype=dt)
    gq, gk, gv = _heads(grad, n_head)
    g_heads = g.reshape(b, t, n_head, d).transpose(0, 2, 1, 3)                    # [B, H, T, D] view
    qblocks = list(enumerate(_query_blocks(t)))[::-1]
    groups = _batch_groups(b, n_head * t * t * cd.itemsize)
    first = {b0: i * len(qblocks) for i, (b0, _) in enumerate(groups)}
    jit = None if is_low(dt) else _jit()
    zero_rows = np.zeros(1, dtype=cd)

    def group(b0, b1):
        nb = b1 - b0
        qg, kg = up(q[b0:b1]), up(k[b0:b1])
        vt = _transposed(v[b0:b1], "attn_vt", cd)
        if saved.probs is None:
            qs, kt = _scaled_queries(q[b0:b1], scale, cd), _transposed(k[b0:b1], "attn_kt", cd)
        gy = _scratch("attn_gy", (nb, n_head, t, d), cd)                        # dY' = dY / l
        dk, dv = _scratch("attn_dk", gy.shape, cd), _scratch("attn_dv", gy.shape, cd)
        rowsum = saved.rowsum[b0:b1] if saved.rowsum is not None else None
        if rowsum is not None:
            np.divide(up(g_heads[b0:b1]), rowsum, out=gy)
        else:
            gy[...] = up(g_heads[b0:b1])
        for j, (a, e) in qblocks:
            if saved.probs is not None:
                p = up(saved.probs[first[b0] + j])
            else:
                p = _scratch("attn_p", (nb, n_head, e - a, e), cd)
                _exp_scores(qs, kt, a, e, dt, p)
            gya = gy[:, :, a:e]
            whole = e == t                                                     # the first block here
            part = dv if whole else _scratch("attn_part", (nb, n_head, e, d), cd)
            blas.matmul(p.swapaxes(-1, -2), gya, out=part)                       # dV[:e] += E^T dY'
            if not whole:
                dv[:, :, :e] += part
            gs = _scratch("attn_gs", (nb, n_head, e - a, e), cd)
            blas.matmul(gya, vt[..., :e], out=gs)                                # dY' V^T
            # delta' = rowsum(dP' E) / l, taken from the block itself (not as rowsum(dY y)): the
            # row sums of dS then cancel to rounding, as they must (softmax ignores a shift; the
            # key bias's gradient is zero).
            if jit is not None and p.flags.c_contiguous:
                sums = np.ascontiguousarray(rowsum[:, :, a:e]).reshape(-1) if rowsum is not None else zero_rows
                jit.softmax_grad_rows(gs.reshape(-1, e), p.reshape(-1, e), sums, rowsum is not None, cd.type(0))
            else:
                delta = np.einsum("...j,...j->...", gs, p)[..., None]
                if rowsum is not None:
                    delta /= rowsum[:, :, a:e]
                gs -= delta
                gs *= p                                                        # dS (unscaled)
            dq = _scratch("attn_dq", (nb, n_head, e - a, d), cd)
            blas.matmul(gs, kg[:, :, :e], out=dq)
            dq *= scale
            gq[b0:b1, :, a:e] = dq                                             # dQ = dS K / sqrt(D)
            part = dk if whole else part
            blas.matmul(gs.swapaxes(-1, -2), qg[:, :, a:e], out=part)            # dK[:e] += dS^T Q
            if not whole:
                dk[:, :, :e] += part
        dk *= scale
        gk[b0:b1] = dk                                                         # (rounded once in 16 bits)
        gv[b0:b1] = dv
    _run(group, groups, gemms=True)
    return grad


# -- cross-entropy ---------------------------------------------------------------------------------

def cross_entropy_forward(z, t, valid):
    """Logits z [N, V] (compute dtype), targets t int [N] (ignored rows already 0), valid bool [N]
    -> (nll [N] (0 on ignored rows), probs [N, V] = exp(z - rowmax), total [N] = their row sums)."""
    n, vocab = z.shape
    probs = np.empty_like(z)
    total = np.empty(n, dtype=z.dtype)
    picked = np.empty(n, dtype=z.dtype)

    def block(a, e):
        p = probs[a:e]
        np.subtract(z[a:e], z[a:e].max(axis=1, keepdims=True), out=p)
        picked[a:e] = p[np.arange(e - a), t[a:e]]
        np.exp(p, out=p)
        np.sum(p, axis=1, out=total[a:e])
    _run(block, _blocks(n, vocab * z.itemsize))
    nll = np.log(total)
    nll -= picked
    nll *= valid
    return nll, probs, total


def cross_entropy_backward(probs, total, t, coef):
    """dz = (probs / total - onehot(t)) coef[:, None], computed in place in `probs` (which the
    forward's graph no longer needs); coef [N] = valid * g / count."""
    n, vocab = probs.shape

    def block(a, e):
        p = probs[a:e]
        p /= total[a:e, None]
        p[np.arange(e - a), t[a:e]] -= 1.0
        p *= coef[a:e, None]
    _run(block, _blocks(n, vocab * probs.itemsize))
    return probs


# -- AdamW -----------------------------------------------------------------------------------------

def adamw_update(params: list, b1: float, b2: float, eps: float, step_size: float, inv_bias2_sqrt: float) -> None:
    """One AdamW step of every parameter in `params`, [(p, g, m, v, decay), ...], in place (p, m, v),
    in the order of `optim.AdamW.step`: decay (`decay` = 1 - lr wd, or 1), the moments, then
    p -= step_size m / (sqrt(v) inv_bias2_sqrt + eps). All parameters' blocks form one list, which
    the threads share out (one parameter's blocks would leave small parameters to one thread); with
    the compiled loops, all parameters' elements in equal runs of compiled tasks (`_adamw_tasks`)."""
    if _adamw_tasks(params, b1, b2, eps, step_size, inv_bias2_sqrt):
        return
    work = []
    for p, g, m, v, decay in params:
        arrays = (p, g, m, v)
        if not all(a.flags.c_contiguous for a in arrays):  # (a strided view: one block, in place as it is)
            work.append((arrays, decay))
            continue
        flat = tuple(a.reshape(-1) for a in arrays)
        work += [(tuple(a[s:e] for a in flat), decay) for s, e in _blocks(flat[0].size, 4 * p.itemsize)]

    jit = _jit()

    def block(a, e):
        for arrays, decay in work[a:e]:
            if jit is not None and all(x.flags.c_contiguous for x in arrays):
                t = arrays[0].dtype.type  # the constants rounded to the arrays' dtype, as NumPy does
                jit.adamw(*(x.reshape(-1) for x in arrays), decay != 1.0, t(decay), t(b1), t(b2), t(1.0 - b1),
                          t(1.0 - b2), t(eps), t(-step_size), t(inv_bias2_sqrt))
            else:
                _adamw_block(*arrays, decay, b1, b2, eps, step_size, inv_bias2_sqrt)
    _run(block, [(i, i + 1) for i in range(len(work))])


_adam_table: dict = {"arrays": (), "table": None}


def _adamw_tasks(params: list, b1, b2, eps, step_size, inv_bias2_sqrt) -> bool:
    """adamw_update as compiled tasks (`jit_pool.adamw_tasks`: the threads take equal runs of all the
    parameters' elements, no Python per block), when the compiled loops are in use and every array is
    C-contiguous in one float32/float64 dtype; False (nothing done) otherwise. The table of addresses
    is kept while the same arrays come back (the optimizer's weights, moments and gradient buffers
    live across steps), checked through weak references to them: an array freed since cannot be
    mistaken for a new one at its address, and the table keeps no memory alive."""
    pool = _jit_pool()
    if pool is None or not params:
        return False
    arrays = tuple(a for p, g, m, v, _ in params for a in (p, g, m, v))
    dt = arrays[0].dtype
    old = _adam_table["arrays"]
    if len(old) != len(arrays) or not all(ref() is a for ref, a in zip(old, arrays)):
        if dt not in (np.float32, np.float64) or not all(a.dtype == dt and a.flags.c_contiguous for a in arrays):
            return False
        _adam_table["table"] = np.array([[a.ctypes.data for a in arrays[i:i + 4]] + [arrays[i].size]
                                         for i in range(0, len(arrays), 4)], dtype=np.int64)
        _adam_table["arrays"] = tuple(weakref.ref(a) for a in arrays)
    decays = np.array([decay for *_, decay in params], dtype=dt)
    # The constants rounded to the arrays' dtype, as NumPy does with a Python float operand.
    consts = np.array([b1, b2, 1.0 - b1, 1.0 - b2, eps, -step_size, inv_bias2_sqrt], dtype=dt)
    kernel_pool.run_tasks(pool.adamw_tasks(_adam_table["table"], decays, consts, num_threads()))
    return True


def _adamw_block(pp, gg, mm, vv, decay, b1, b2, eps, step_size, inv_bias2_sqrt) -> None:
    if decay != 1.0:
        pp *= decay
    tmp = _scratch("adam_tmp", gg.shape, pp.dtype)
    np.multiply(gg, gg, out=tmp)
    tmp *= 1.0 - b2
    vv *= b2
    vv += tmp
    np.multiply(gg, 1.0 - b1, out=tmp)
    mm *= b1
    mm += tmp
    np.sqrt(vv, out=tmp)
    tmp *= inv_bias2_sqrt
    tmp += eps
    np.divide(mm, tmp, out=tmp)
    tmp *= -step_size
    pp += tmp
