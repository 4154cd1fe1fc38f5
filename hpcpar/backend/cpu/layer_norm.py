"""LayerNorm over the last dim on the CPU, one cache-blocked pass each way.

    layer_norm_forward(x, w, b, eps)    y, and per-row mean and 1/std [N, 1] (N = rows of x [..., C])
    layer_norm_backward(...)            dx, and dweight / dbias as per-block partial sums added in
                                        block order (the same bits on any thread count)

Backward rebuilds xhat from the saved row statistics (the forward's bits) instead of keeping
[N, C]. Row means are einsum's row sums over the count, or with the `fast` extra eight-lane sums in
compiled row tasks (`jit.pool`): equal to the textbook formulas to rounding. 16-bit x is taken up to
float32 block by block and the results rounded once.
"""

from __future__ import annotations

import numpy as np

from hpcpar.backend import kernel_pool
from hpcpar.backend.cpu.blocks import block_ranges, block_rows, compiled_tasks, run_blocks, scratch, sum_partials
from hpcpar.backend.kernel_pool import num_threads
from hpcpar.backend.precision import is_low, up, up_dtype


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
    pool = None if low else compiled_tasks()
    if pool is not None:
        # Task rows hold addresses only: every array they name is bound to a name here until they ran.
        w = np.ascontiguousarray(w)
        b = np.ascontiguousarray(b) if b is not None else w
        consts = np.array([c, eps], dtype=cd)
        kernel_pool.run_tasks(pool.row_tasks(
            pool.LN_FORWARD, x2, w, b, mean, rstd, x2, out, mean, mean, pool.HAS_BIAS if b is not w else 0,
            consts, block_rows(c, cd), num_threads()))
        return out.reshape(x.shape), mean, rstd

    def block(a, e):
        xs = up(x2[a:e])
        mu = mean[a:e]
        _row_mean(xs, mu)
        xh = scratch("ln_xhat", (e - a, c), cd)
        np.subtract(xs, mu, out=xh)
        rs = rstd[a:e]
        _row_dot_mean(xh, xh, rs)
        rs += eps
        np.sqrt(rs, out=rs)
        np.divide(1.0, rs, out=rs)
        xh *= rs
        o = scratch("ln_out", (e - a, c), cd) if low else out[a:e]
        np.multiply(xh, w, out=o)
        if b is not None:
            o += b
        if low:
            out[a:e] = o
    run_blocks(block, block_ranges(n, c * cd.itemsize))
    return out.reshape(x.shape), mean, rstd


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
    rows = block_rows(c, cd)
    blocks = -(-n // rows)
    dx = np.empty((n, c), dtype=x2.dtype) if want_dx else None
    dw = np.empty((blocks, c), dtype=cd) if want_dw else None
    db = np.empty((blocks, c), dtype=cd) if want_dw and bias else None
    pool = None if low else compiled_tasks()
    if pool is not None:
        w = np.ascontiguousarray(w)  # (bound to names until the tasks ran, as in layer_norm_forward)
        consts = np.array([c, 0], dtype=cd)
        flags = (pool.WANT_DX if want_dx else 0) | (pool.WANT_DW if want_dw else 0) | (pool.HAS_BIAS if bias else 0)
        kernel_pool.run_tasks(pool.row_tasks(
            pool.LN_BACKWARD, x2, w, w, mean, rstd, g2, dx if dx is not None else x2,
            dw if dw is not None else mean, db if db is not None else mean, flags, consts, rows, num_threads()))
    else:
        def block(a, e):
            xh = scratch("ln_xhat", (e - a, c), cd)
            np.subtract(up(x2[a:e]), mean[a:e], out=xh)
            xh *= rstd[a:e]
            gs = up(g2[a:e])
            if want_dw:
                np.einsum("ij,ij->j", gs, xh, out=dw[a // rows])
                if bias:
                    np.einsum("ij->j", gs, out=db[a // rows])
            if not want_dx:
                return
            gxhat = scratch("ln_gxhat", (e - a, c), cd)
            np.multiply(gs, w, out=gxhat)
            m1 = scratch("ln_m1", (e - a, 1), cd)
            m2 = scratch("ln_m2", (e - a, 1), cd)
            _row_mean(gxhat, m1)
            _row_dot_mean(gxhat, xh, m2)
            gx = scratch("ln_gx", (e - a, c), cd) if low else dx[a:e]
            np.subtract(gxhat, m1, out=gx)
            np.multiply(xh, m2, out=gxhat)
            gx -= gxhat
            gx *= rstd[a:e]
            if low:
                dx[a:e] = gx
        run_blocks(block, block_ranges(n, c * cd.itemsize))
    return (dx.reshape(x.shape) if want_dx else None,
            sum_partials(dw) if want_dw else None, sum_partials(db) if db is not None else None)

