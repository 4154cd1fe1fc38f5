"""Differentiable matrix products: matmul, linear (optionally fused with its GELU), a bias added
after a reduction, and one linear map per group of rows (mixture-of-experts).

Layouts: x [..., in], weight [out, in] (nn.Linear's), bias [out]; grouped: weight [G, out, in],
bias [G, out]. The weight gradients are weight work (`weight_grad`): under a split backward (B/W)
dX is computed in B and dW, db in W. Backward reads `weight.data` when it runs, so the graph keeps
no reference to a parameter's array (ZeRO-3 frees gathered parameters between the passes).
16-bit activations: the GEMMs read float32 (NumPy) or float16 (CuPy, `_gemm_in_16_bits`) operands
and accumulate in float32; outputs are rounded once (`precision`).
"""

from __future__ import annotations

import itertools

import numpy as np

from hpcpar.backend import array_module, blas, is_device_array
from hpcpar.backend.cpu import bias as cpu_bias, gelu as cpu_gelu
from hpcpar.backend.precision import down, is_low, rounded, up
# ops as a module, its names looked up at call time: tensor.py imports this module at its end, which
# may run while ops itself is still being imported.
from hpcpar.autograd import ops
from hpcpar.autograd.tensor import Tensor, weight_grad


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """Batched a @ b over the last two dims, batch dims broadcast (both at least 2-D)."""
    ad, bd = a.data, b.data
    out = ad @ bd

    def backward(g):
        ga = ops.unbroadcast(g @ bd.swapaxes(-1, -2), a.shape) if a.requires_grad else None
        gb = ops.unbroadcast(ad.swapaxes(-1, -2) @ g, b.shape) if b.requires_grad else None
        return ga, gb
    return Tensor.from_op(out, (a, b), backward)


def _gemm_in_16_bits(a, dt) -> bool:
    """Whether an op computing for `dt` activations runs its GEMMs in 16 bits: CuPy float16 (cuBLAS
    on the tensor cores, float32 accumulation). NumPy has no 16-bit BLAS: float32 there."""
    return dt == _FLOAT16 and is_device_array(a)


_FLOAT16 = np.dtype(np.float16)


def _gemm(a, b, dt):
    """a @ b, operands holding values of `dt` (in `dt` or float32 arrays), the result in float32 (in
    the full-precision dtype without 16 bits): a 16-bit GEMM where `_gemm_in_16_bits`, else float32."""
    if _gemm_in_16_bits(a, dt):
        return (a.astype(dt, copy=False) @ b.astype(dt, copy=False)).astype(np.float32)
    if is_device_array(a):
        return up(a) @ up(b)
    return blas.matmul(up(a), up(b))


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, out_dtype=None,
           activation: str | None = None) -> Tensor:
    """y = x @ weight.T + bias.  x [..., in], weight [out, in] (nn.Linear layout), bias [out].

    The backward reads `weight.data` when it runs: the graph keeps no reference to a parameter's
    array (ZeRO-3 frees gathered parameters after forward and gathers them again for backward).
    Split backward (B/W): dX in B; dW = g^T x and db = sum(g) are weight work (`weight_grad`),
    which keeps g and x until W. `out_dtype`: y's dtype (default x's; float32 for a partial sum
    of 16-bit activations that a reduction adds up before rounding).

    `activation="gelu"`: y = gelu(x @ weight.T + bias) (the MLP's c_fc), the same values as
    `gelu(linear(x, weight, bias))`. On the CPU the bias add and the GELU are one cache-blocked
    pass over the GEMM's output, and in backward GELU's gradient and the bias gradient another
    (`cpu_gelu.bias_gelu_forward` / `_backward`); the pre-activation is kept where the
    separate ops kept the linear's output.
    """
    if activation not in (None, "gelu"):
        raise ValueError(f"activation must be None or 'gelu', not {activation!r}")
    if activation == "gelu" and (is_device_array(x.data) or out_dtype is not None):
        return ops.gelu(linear(x, weight, bias, out_dtype))
    xd, dt = x.data, x.data.dtype
    x2 = xd.reshape(-1, xd.shape[-1])
    wd = rounded(weight.data, dt)
    y = _gemm(x2, wd.T, dt)
    shape = xd.shape[:-1] + (wd.shape[0],)
    del wd
    if activation == "gelu":
        b = rounded(bias.data, dt) if bias is not None else None
        out, pre, kept = cpu_gelu.bias_gelu_forward(y, b, dt)
        del y, b

        def backward(g):
            g2, db = cpu_gelu.bias_gelu_backward(pre, kept, g.reshape(-1, g.shape[-1]), bias is not None)
            return _linear_grads(g2, x, x2, weight, bias, dt, lambda: db)
        return Tensor.from_op(out.reshape(shape), (x, weight, bias), backward)
    if bias is not None:
        if is_device_array(y):
            y += rounded(bias.data, dt)
        else:
            cpu_bias.add_bias(y, rounded(bias.data, dt))
    out = down(y, dt if out_dtype is None else out_dtype).reshape(shape)
    del y

    def backward(g):
        g2 = g.reshape(-1, g.shape[-1])
        return _linear_grads(g2, x, x2, weight, bias, dt, lambda: ops.sum_rows(up(g2)))
    return Tensor.from_op(out, (x, weight, bias), backward)


def _linear_grads(g2, x: Tensor, x2, weight: Tensor, bias: Tensor | None, dt, bias_grad):
    """(dx, dweight, dbias) of a linear from the gradient of its (pre-activation) output g2 [N, out]:
    dx = g2 W in B, dW = g2^T x and db = `bias_grad()` as weight work."""
    gx = down(_gemm(g2, rounded(weight.data, dt), dt), dt).reshape(x.shape) if x.requires_grad else None
    gw = weight_grad(lambda: _gemm(g2.T, x2, dt)) if weight.requires_grad else None
    gb = weight_grad(bias_grad) if bias is not None and bias.requires_grad else None
    return gx, gw, gb


def add_bias(y: Tensor, bias: Tensor | None, dtype) -> Tensor:
    """y [..., C] + bias [C] (None: no bias), stored as `dtype`: a bias added after a reduction
    (row-parallel layers). With 16-bit `dtype`, y is the float32 reduced sum; the bias is read
    rounded to `dtype`, and the result is rounded once. In full precision it is `add` (or y)."""
    if not is_low(dtype):
        return y if bias is None else ops.add(y, bias)
    if bias is None:
        return ops.cast(y, dtype)
    out = up(y.data) + rounded(bias.data, dtype)
    c = out.shape[-1]

    def backward(g):
        return up(g), ops.weight_grad_if_param(bias, lambda: ops.sum_rows(up(g).reshape(-1, c)))
    return Tensor.from_op(down(out, dtype), (y, bias), backward)


def grouped_linear(x: Tensor, weight: Tensor, bias: Tensor | None, counts) -> Tensor:
    """One linear map per group of rows (a mixture-of-experts layer's experts, one GEMM each).

    x [M, in] holds the groups back to back, group g being `counts[g]` consecutive rows;
    weight [G, out, in], bias [G, out] -> [M, out], rows of group g mapped by weight[g], bias[g].
    Each GEMM writes its rows of the preallocated output (and of dX, dW[g]) in place; only the
    groups with rows run one. A group may be empty (an expert no token was routed to; M may be 0):
    it computes nothing, and its dW[g], db[g] are zero. Split backward (B/W) as `linear`: dX in B;
    dW[g] = g_g^T x_g and db[g] = sum(g_g) are weight work (`weight_grad`). The backward reads
    `weight.data` when it runs.
    """
    xd, wd = x.data, weight.data
    xp = array_module(xd)
    counts = [int(c) for c in counts]
    ends = list(itertools.accumulate(counts))
    if len(counts) != wd.shape[0] or any(c < 0 for c in counts) or (ends[-1] if ends else 0) != xd.shape[0]:
        raise ValueError(f"grouped_linear: {wd.shape[0]} group sizes >= 0 summing to the {xd.shape[0]} rows "
                         f"of x are needed, got {counts}")
    # Only the groups with rows: an empty one has no GEMM to run (a k = 0 product for dW).
    bounds = [(g, a, e) for g, (a, e) in enumerate(zip([0] + ends[:-1], ends)) if e > a]
    mm = blas.matmul if xp is np else xp.matmul
    out = xp.empty((xd.shape[0], wd.shape[1]), dtype=xd.dtype)
    for g, a, e in bounds:
        mm(xd[a:e], wd[g].T, out=out[a:e])
        if bias is not None:
            out[a:e] += bias.data[g]
    del wd

    def backward(gy):
        gx = None
        if x.requires_grad:
            w = weight.data
            gx = xp.empty_like(xd)
            for g, a, e in bounds:
                mm(gy[a:e], w[g], out=gx[a:e])

        def dw():
            gw = xp.zeros(weight.shape, dtype=weight.dtype)
            for g, a, e in bounds:
                mm(gy[a:e].T, xd[a:e], out=gw[g])
            return gw

        def db():
            gb = xp.zeros(bias.shape, dtype=bias.dtype)
            for g, a, e in bounds:
                gb[g] = gy[a:e].sum(axis=0)
            return gb
        gw = weight_grad(dw) if weight.requires_grad else None
        gb = weight_grad(db) if bias is not None and bias.requires_grad else None
        return gx, gw, gb
    return Tensor.from_op(out, (x, weight, bias), backward)
