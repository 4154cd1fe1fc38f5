"""GELU (tanh form) as one cache-blocked pass each way, alone or fused with a linear's bias.

    gelu_forward / gelu_backward            elementwise over any shape; keeps t = tanh(..) for backward
    bias_gelu_forward / bias_gelu_backward  on a linear's GEMM output y [N, n]: the bias add and GELU in
                                            one pass, GELU's gradient and the bias gradient in another

Each element sees the operations of the plain NumPy composition in the same order (with the `fast`
extra as compiled loops, `jit.kernels`, NumPy keeping tanh), so results are its bits. 16-bit inputs
are taken up to float32 block by block and the results rounded once.
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace

import numpy as np

from hpcpar.backend.cpu.blocks import block_ranges, compiled_loops, flat, run_blocks, scratch, sum_partials
from hpcpar.backend.precision import is_low, up, up_dtype

_GELU_A = 0.044715
_GELU_C = math.sqrt(2.0 / math.pi)


@functools.cache
def _constants(dtype) -> SimpleNamespace:
    """The GELU constants in `dtype`, as NumPy rounds a Python float operand to the array's dtype."""
    t = np.dtype(dtype).type
    return SimpleNamespace(a=t(_GELU_A), a3=t(3 * _GELU_A), c=t(_GELU_C), one=t(1.0), half=t(0.5))


def _tanh_u(xs, t) -> None:
    """t = tanh(sqrt(2/pi) (x + 0.044715 x^3)) as ((x x 0.044715 + 1) x) sqrt(2/pi), in place in t
    (xs and t contiguous, the compute dtype)."""
    jit = compiled_loops()
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
    jit = compiled_loops()
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
    xf = flat(x)
    cd = up_dtype(xf.dtype)
    out = np.empty_like(xf)
    kept = np.empty(xf.shape, dtype=cd) if keep_tanh else None
    low = is_low(xf.dtype)

    def block(a, e):
        xs = up(xf[a:e])
        t = kept[a:e] if kept is not None else scratch("gelu_t", (e - a,), cd)
        _tanh_u(xs, t)
        o = scratch("gelu_o", (e - a,), cd) if low else out[a:e]
        _gelu_out(xs, t, o)
        if low:
            out[a:e] = o
    run_blocks(block, block_ranges(xf.size, cd.itemsize))
    return out.reshape(x.shape), (kept.reshape(x.shape) if kept is not None else None)


def gelu_backward(x, t, g):
    """dx of gelu_forward's y: g (0.5 (1 + t) + 0.5 x (1 - t^2) c (1 + 3 0.044715 x^2)), in x's
    dtype; `t` the kept tanh (None: recomputed from x, as for 16-bit x)."""
    xf, gf = flat(x), flat(g)
    tf = flat(t) if t is not None else None
    cd = up_dtype(xf.dtype)
    out = np.empty_like(xf)
    low = is_low(xf.dtype)

    def block(a, e):
        s = scratch("gelu_o", (e - a,), cd) if low else out[a:e]
        _gelu_grad(up(xf[a:e]), tf[a:e] if tf is not None else None, up(gf[a:e]), s)
        if low:
            out[a:e] = s
    run_blocks(block, block_ranges(xf.size, cd.itemsize))
    return out.reshape(x.shape)


def _gelu_grad(xs, tt, gs, s) -> None:
    """s = GELU's gradient at xs times gs (all in the compute dtype); tt: the kept tanh, or None."""
    if tt is None:
        tt = scratch("gelu_t", xs.shape, xs.dtype)
        _tanh_u(xs, tt)
    jit = compiled_loops()
    if jit is not None and xs.flags.c_contiguous and tt.flags.c_contiguous and gs.flags.c_contiguous:
        k = _constants(xs.dtype)
        jit.gelu_grad(xs.reshape(-1), tt.reshape(-1), gs.reshape(-1), s.reshape(-1), k.a3, k.one, k.c, k.half)
        return
    x2 = scratch("gelu_x2", xs.shape, xs.dtype)
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

    jit = compiled_loops()

    def block(a, e):
        ys = y[a:e]
        if b is not None:
            if jit is not None:
                jit.add_bias_rows(ys, b)
            else:
                ys += b
        if low:
            pre[a:e] = ys
            xs = scratch("bg_x", ys.shape, cd)
            xs[...] = pre[a:e]
        else:
            xs = ys
        t = kept[a:e] if kept is not None else scratch("gelu_t", ys.shape, cd)
        _tanh_u(xs, t)
        o = scratch("gelu_o", ys.shape, cd) if low else out[a:e]
        _gelu_out(xs, t, o)
        if low:
            out[a:e] = o
    run_blocks(block, block_ranges(n, cols * cd.itemsize))
    return out, pre, kept


def bias_gelu_backward(pre, t, g, bias: bool):
    """(g_pre [N, n] in pre's dtype, dbias [n] or None) for bias_gelu_forward's output gradient g:
    GELU's gradient, and the bias gradient = its column sums (per-block partials, in block order),
    both from one pass over the blocks."""
    n, cols = pre.shape
    cd = up_dtype(pre.dtype)
    low = is_low(pre.dtype)
    grad = np.empty((n, cols), dtype=pre.dtype)
    blocks = block_ranges(n, cols * cd.itemsize)
    db = np.empty((len(blocks), cols), dtype=cd) if bias else None
    index = {blk: i for i, blk in enumerate(blocks)}
    jit = compiled_loops()

    def block(a, e):
        s = scratch("bg_s", (e - a, cols), cd) if low else grad[a:e]
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
    run_blocks(block, blocks)
    return grad, (sum_partials(db) if db is not None else None)

