"""Differentiable ops on Tensors: each forward sits next to its gradient rule.

Every op computes its result with the array module of its inputs (NumPy or CuPy)
and, when gradients are enabled and an input requires them, returns a Tensor whose
`_backward(g)` closure maps the output gradient `g` to one gradient per parent (or
None). Broadcasting ops reduce their gradients back to each input's shape.

The transformer's hot paths are fused into single ops (linear, layer_norm, gelu,
causal attention, cross_entropy) so that per-op Python overhead stays small and
no temporary outlives the op that needs it.

Mixed precision (`precision.py`): when activations arrive in 16 bits, these fused ops compute in
float32 (`up`), read weights rounded to the activations' dtype (`rounded`), store their outputs and
input gradients in 16 bits (`down`) and keep only 16-bit arrays (or per-row statistics) for
backward; weight gradients stay float32. In full precision every helper is the identity.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from hpcpar.backend import blas, gpu_kernels
from hpcpar.backend.cpu import kernels as cpu_kernels
from hpcpar.backend import array_module, is_device_array
from hpcpar.backend.precision import down, is_low, rounded, up
from hpcpar.autograd.tensor import Tensor, defers_weight_grads, enable_grad, is_grad_enabled, no_grad, weight_grad


def _fused(a) -> bool:
    """Use the fused GPU kernel (kernels.py) for array `a`: a CuPy float32/float64 array."""
    return is_device_array(a) and gpu_kernels.supported(a)


def _sum_rows(a2d):
    """Column sums of a [rows, n] array (bias and LayerNorm gradients). On the GPU as a GEMV,
    ones[rows] @ a: cuBLAS reads the rows coalesced, where a reduction over axis 0 strides."""
    if not _fused(a2d):
        return cpu_kernels.column_sums(a2d) if not is_device_array(a2d) else a2d.sum(axis=0)
    xp = array_module(a2d)
    return xp.ones(a2d.shape[0], dtype=a2d.dtype) @ a2d


def _unbroadcast(g, shape: tuple):
    """Sum `g` over the dims that broadcasting added or stretched to reach its shape."""
    if g.shape == shape:
        return g
    extra = g.ndim - len(shape)
    if extra:
        g = g.sum(axis=tuple(range(extra)))
    stretched = tuple(i for i, n in enumerate(shape) if n == 1 and g.shape[i] != 1)
    if stretched:
        g = g.sum(axis=stretched, keepdims=True)
    return g.reshape(shape)


def _data(x):
    return x.data if isinstance(x, Tensor) else x


def _param(x) -> bool:
    """A leaf that wants a gradient (a parameter): its gradient is weight work (`weight_grad`)."""
    return isinstance(x, Tensor) and x.requires_grad and x.is_leaf


# ----------------------------------------------------------------------------------------
# Elementwise arithmetic (with broadcasting; a plain number may stand for either operand)
# ----------------------------------------------------------------------------------------
def add(a, b) -> Tensor:
    a_t, b_t = isinstance(a, Tensor), isinstance(b, Tensor)
    out = _data(a) + _data(b)
    a_shape = a.shape if a_t else None
    b_shape = b.shape if b_t else None

    def backward(g):
        return (_leaf_or_now(a, lambda: _unbroadcast(g, a_shape)) if a_t else None,
                _leaf_or_now(b, lambda: _unbroadcast(g, b_shape)) if b_t else None)
    return Tensor.from_op(out, (a if a_t else None, b if b_t else None), backward)


def _leaf_or_now(x, fn):
    """fn(): a parameter operand's gradient is weight work (a bias added after a reduction)."""
    return weight_grad(fn) if _param(x) else fn()


def sub(a, b) -> Tensor:
    a_t, b_t = isinstance(a, Tensor), isinstance(b, Tensor)
    out = _data(a) - _data(b)
    a_shape = a.shape if a_t else None
    b_shape = b.shape if b_t else None

    def backward(g):
        return (_unbroadcast(g, a_shape) if a_t else None,
                _unbroadcast(-g, b_shape) if b_t else None)
    return Tensor.from_op(out, (a if a_t else None, b if b_t else None), backward)


def mul(a, b) -> Tensor:
    a_t, b_t = isinstance(a, Tensor), isinstance(b, Tensor)
    ad, bd = _data(a), _data(b)
    out = ad * bd

    def backward(g):
        return (_leaf_or_now(a, lambda: _unbroadcast(g * bd, a.shape)) if a_t and a.requires_grad else None,
                _leaf_or_now(b, lambda: _unbroadcast(g * ad, b.shape)) if b_t and b.requires_grad else None)
    return Tensor.from_op(out, (a if a_t else None, b if b_t else None), backward)


def div(a, b) -> Tensor:
    a_t, b_t = isinstance(a, Tensor), isinstance(b, Tensor)
    ad, bd = _data(a), _data(b)
    out = ad / bd

    def backward(g):
        ga = _unbroadcast(g / bd, a.shape) if a_t and a.requires_grad else None
        gb = _unbroadcast(-g * out / bd, b.shape) if b_t and b.requires_grad else None
        return ga, gb
    return Tensor.from_op(out, (a if a_t else None, b if b_t else None), backward)


def neg(x: Tensor) -> Tensor:
    return Tensor.from_op(-x.data, (x,), lambda g: (-g,))


def pow(x: Tensor, exponent: float) -> Tensor:
    """x ** exponent for a constant exponent."""
    xd = x.data
    out = xd ** exponent
    return Tensor.from_op(out, (x,), lambda g: (g * exponent * xd ** (exponent - 1),))


def exp(x: Tensor) -> Tensor:
    xp = array_module(x.data)
    out = xp.exp(x.data)
    return Tensor.from_op(out, (x,), lambda g: (g * out,))


def log(x: Tensor) -> Tensor:
    xp = array_module(x.data)
    xd = x.data
    return Tensor.from_op(xp.log(xd), (x,), lambda g: (g / xd,))


def tanh(x: Tensor) -> Tensor:
    xp = array_module(x.data)
    out = xp.tanh(x.data)
    return Tensor.from_op(out, (x,), lambda g: (g * (1 - out * out),))


def gelu(x: Tensor) -> Tensor:
    """GELU, tanh form: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))). Keeps t = tanh(..) for
    backward; with 16-bit x only x itself (backward recomputes t in float32). One fused kernel
    each way: `kernels` on the GPU, `cpu_kernels` (cache-blocked NumPy) on the CPU."""
    stored, dt = x.data, x.data.dtype
    if is_device_array(stored):
        out, tanh_u = gpu_kernels.gelu_forward(up(stored))
        kept = None if is_low(dt) else tanh_u

        def backward(g):
            xs = up(stored)
            t = kept if kept is not None else gpu_kernels.gelu_forward(xs)[1]
            return (down(gpu_kernels.gelu_backward(xs, t, up(g)), dt),)
        return Tensor.from_op(down(out, dt), (x,), backward)
    out, kept = cpu_kernels.gelu_forward(stored, keep_tanh=not is_low(dt))
    return Tensor.from_op(out, (x,), lambda g: (cpu_kernels.gelu_backward(stored, kept, g),))


def cast(x: Tensor, dtype) -> Tensor:
    """x stored as `dtype` (rounded to nearest even); the gradient goes back in x's dtype. Where a
    mixed-precision model's activations enter 16 bits (after the embedding sum)."""
    source = x.data.dtype
    return Tensor.from_op(down(x.data, dtype), (x,), lambda g: (down(g, source),))


# ----------------------------------------------------------------------------------------
# Matrix products
# ----------------------------------------------------------------------------------------
def matmul(a: Tensor, b: Tensor) -> Tensor:
    """Batched a @ b over the last two dims, batch dims broadcast (both at least 2-D)."""
    ad, bd = a.data, b.data
    out = ad @ bd

    def backward(g):
        ga = _unbroadcast(g @ bd.swapaxes(-1, -2), a.shape) if a.requires_grad else None
        gb = _unbroadcast(ad.swapaxes(-1, -2) @ g, b.shape) if b.requires_grad else None
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
    (`cpu_kernels.bias_gelu_forward` / `_backward`); the pre-activation is kept where the
    separate ops kept the linear's output.
    """
    if activation not in (None, "gelu"):
        raise ValueError(f"activation must be None or 'gelu', not {activation!r}")
    if activation == "gelu" and (is_device_array(x.data) or out_dtype is not None):
        return gelu(linear(x, weight, bias, out_dtype))
    xd, dt = x.data, x.data.dtype
    x2 = xd.reshape(-1, xd.shape[-1])
    wd = rounded(weight.data, dt)
    y = _gemm(x2, wd.T, dt)
    shape = xd.shape[:-1] + (wd.shape[0],)
    del wd
    if activation == "gelu":
        b = rounded(bias.data, dt) if bias is not None else None
        out, pre, kept = cpu_kernels.bias_gelu_forward(y, b, dt)
        del y, b

        def backward(g):
            g2, db = cpu_kernels.bias_gelu_backward(pre, kept, g.reshape(-1, g.shape[-1]), bias is not None)
            return _linear_grads(g2, x, x2, weight, bias, dt, lambda: db)
        return Tensor.from_op(out.reshape(shape), (x, weight, bias), backward)
    if bias is not None:
        if is_device_array(y):
            y += rounded(bias.data, dt)
        else:
            cpu_kernels.add_bias(y, rounded(bias.data, dt))
    out = down(y, dt if out_dtype is None else out_dtype).reshape(shape)
    del y

    def backward(g):
        g2 = g.reshape(-1, g.shape[-1])
        return _linear_grads(g2, x, x2, weight, bias, dt, lambda: _sum_rows(up(g2)))
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
        return y if bias is None else add(y, bias)
    if bias is None:
        return cast(y, dtype)
    out = up(y.data) + rounded(bias.data, dtype)
    c = out.shape[-1]
    return Tensor.from_op(down(out, dtype), (y, bias),
                          lambda g: (up(g), _leaf_or_now(bias, lambda: _sum_rows(up(g).reshape(-1, c)))))


def grouped_linear(x: Tensor, weight: Tensor, bias: Tensor | None, counts) -> Tensor:
    """One linear map per group of rows (a mixture-of-experts layer's experts, one GEMM each).

    x [M, in] holds the groups back to back, group g being `counts[g]` consecutive rows;
    weight [G, out, in], bias [G, out] -> [M, out], rows of group g mapped by weight[g], bias[g].
    A group may be empty (an expert no token was routed to; M may be 0): it computes nothing, and
    its dW[g], db[g] are zero. Split backward (B/W) as `linear`: dX in B; dW[g] = g_g^T x_g and
    db[g] = sum(g_g) are weight work (`weight_grad`). The backward reads `weight.data` when it runs.
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
    out = xp.empty((xd.shape[0], wd.shape[1]), dtype=xd.dtype)
    for g, a, e in bounds:
        out[a:e] = xd[a:e] @ wd[g].T
        if bias is not None:
            out[a:e] += bias.data[g]
    del wd

    def backward(gy):
        gx = None
        if x.requires_grad:
            w = weight.data
            gx = xp.empty_like(xd)
            for g, a, e in bounds:
                gx[a:e] = gy[a:e] @ w[g]

        def dw():
            gw = xp.zeros(weight.shape, dtype=weight.dtype)
            for g, a, e in bounds:
                gw[g] = gy[a:e].T @ xd[a:e]
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


# ----------------------------------------------------------------------------------------
# Reductions
# ----------------------------------------------------------------------------------------
def _expand_reduced(g, shape, axis, keepdims):
    xp = array_module(g)
    if axis is None:
        return xp.broadcast_to(g.reshape((1,) * len(shape)), shape)
    if not keepdims:
        axes = (axis,) if isinstance(axis, int) else axis
        g = xp.expand_dims(g, tuple(a % len(shape) for a in axes))
    return xp.broadcast_to(g, shape)


def sum(x: Tensor, axis=None, keepdims: bool = False) -> Tensor:  # noqa: A001 (mirrors numpy)
    shape = x.shape
    out = x.data.sum(axis=axis, keepdims=keepdims)
    return Tensor.from_op(out, (x,), lambda g: (_expand_reduced(g, shape, axis, keepdims),))


def mean(x: Tensor, axis=None, keepdims: bool = False) -> Tensor:
    shape = x.shape
    out = x.data.mean(axis=axis, keepdims=keepdims)
    count = x.data.size // (out.size or 1)
    return Tensor.from_op(out, (x,), lambda g: (_expand_reduced(g / count, shape, axis, keepdims),))


def max(x: Tensor, axis=None, keepdims: bool = False) -> Tensor:  # noqa: A001
    """Maximum; the gradient is shared equally between tied maxima."""
    xd = x.data
    out = xd.max(axis=axis, keepdims=keepdims)

    def backward(g):
        full = _expand_reduced(out, xd.shape, axis, keepdims)
        mask = (xd == full).astype(xd.dtype)
        ties = mask.sum(axis=axis, keepdims=True)
        return (mask * _expand_reduced(g, xd.shape, axis, keepdims) / ties,)
    return Tensor.from_op(out, (x,), backward)


# ----------------------------------------------------------------------------------------
# Shape ops
# ----------------------------------------------------------------------------------------
def reshape(x: Tensor, shape: tuple) -> Tensor:
    old = x.shape
    return Tensor.from_op(x.data.reshape(shape), (x,), lambda g: (g.reshape(old),))


def transpose(x: Tensor, axes: tuple | None = None) -> Tensor:
    out = x.data.transpose(axes) if axes is not None else x.data.T
    if axes is None:
        return Tensor.from_op(out, (x,), lambda g: (g.T,))
    inverse = tuple(sorted(range(len(axes)), key=lambda i: axes[i]))
    return Tensor.from_op(out, (x,), lambda g: (g.transpose(inverse),))


def _is_basic(index) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return all(isinstance(i, (slice, int)) or i is None or i is Ellipsis for i in parts)


def getitem(x: Tensor, index) -> Tensor:
    """x[index] for basic and advanced indices; repeated indices accumulate gradient."""
    xd = x.data
    if isinstance(index, Tensor):
        index = index.data
    if _is_basic(index):
        return _slice(x, index)
    shape, dtype = xd.shape, xd.dtype
    return Tensor.from_op(xd[index], (x,),
                          lambda g: (_leaf_or_now(x, lambda: _scatter_add(array_module(g), shape, dtype, index, g)),))


def _scatter_add(xp, shape: tuple, dtype, index, g):
    """zeros(shape) with g added at `index`, repeated indices accumulating: a gather's gradient.

    On the GPU an integer index into dim 0 (an embedding lookup, a row gather) goes through a
    deterministic kernel: CuPy's `add.at` uses atomics, whose order (and so the float sum's last
    bits) changes from run to run. On the CPU, when the one-hot matrix of the ids is small
    (`_ONE_HOT_ELEMENTS`: a byte vocabulary, positions), such a gradient is one GEMM,
    onehot(ids)^T g: NumPy's `add.at` goes row by row, 3-4x slower for a step's [B T, C] gradient."""
    rows = index[0] if isinstance(index, tuple) and len(index) == 1 else index
    by_rows = getattr(rows, "dtype", None) is not None and rows.dtype.kind in "iu" and len(shape) >= 1
    # Each gathered row of g holds `row` elements: explicit, since reshape(-1) cannot infer it from
    # an empty g (a gather of no rows, e.g. an expert that no token was routed to).
    row = math.prod(shape[1:])
    if (by_rows and xp is np and shape[0] * rows.size <= _ONE_HOT_ELEMENTS
            and np.dtype(dtype) in _GEMM_DTYPES):
        ids = np.asarray(rows).reshape(-1)
        one_hot = np.zeros((shape[0], ids.size), dtype=dtype)
        one_hot[ids, np.arange(ids.size)] = 1.0
        return blas.matmul(one_hot, np.ascontiguousarray(g, dtype=dtype).reshape(ids.size, row)).reshape(shape)
    out = xp.zeros(shape, dtype=dtype)
    if _fused(out) and by_rows:
        ids = xp.asarray(rows).reshape(-1)
        gpu_kernels.scatter_add_rows(out.reshape(shape[0], row), ids, xp.ascontiguousarray(g).reshape(ids.size, row))
    else:
        xp.add.at(out, index, g)
    return out


_ONE_HOT_ELEMENTS = 1 << 22  # 16 MiB of float32
_GEMM_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def split(x: Tensor, sections, axis: int = -1) -> list:
    """Split along `axis` into equal `sections` (int) or pieces of the given sizes (list)."""
    n = x.shape[axis]
    if isinstance(sections, int):
        if n % sections:
            raise ValueError(f"dim of size {n} does not split into {sections} equal parts")
        sizes = [n // sections] * sections
    else:
        sizes = list(sections)
    pieces, start = [], 0
    axis = axis % x.ndim
    for size in sizes:
        index = (slice(None),) * axis + (slice(start, start + size),)
        pieces.append(_slice(x, index))
        start += size
    return pieces


def _slice(x: Tensor, index: tuple) -> Tensor:
    """A basic (slice-only) index: gradient written into a zero array, no scatter needed.

    A slice of a leaf (a parameter, e.g. wpe's rows) is a copy, not a view: the graph keeps no
    reference to a parameter's array (ZeRO-3 frees gathered parameters after forward)."""
    xd = x.data
    shape, dtype = xd.shape, xd.dtype

    def place(g):
        gx = array_module(g).zeros(shape, dtype=dtype)
        gx[index] = g
        return gx
    backward = (lambda g: (weight_grad(lambda: place(g)),)) if _param(x) else (lambda g: (place(g),))
    out = xd[index]
    return Tensor.from_op(out.copy() if x.is_leaf and x.requires_grad else out, (x,), backward)


def concat(tensors: list, axis: int = 0) -> Tensor:
    xp = array_module(tensors[0].data)
    axis = axis % tensors[0].ndim
    out = xp.concatenate([t.data for t in tensors], axis=axis)
    bounds, start = [], 0
    for t in tensors:
        bounds.append((start, start + t.shape[axis]))
        start += t.shape[axis]

    def backward(g):
        return tuple(g[(slice(None),) * axis + (slice(a, b),)] for a, b in bounds)
    return Tensor.from_op(out, tuple(tensors), backward)


# ----------------------------------------------------------------------------------------
# Lookup, normalisation, probabilities
# ----------------------------------------------------------------------------------------
def embedding(idx, weight: Tensor) -> Tensor:
    """weight[idx]: idx int [...], weight [V, C] -> [..., C]; gradient is a scatter-add (weight
    work: all of it W under a split backward)."""
    ids = idx.data if isinstance(idx, Tensor) else idx
    wd = weight.data
    shape, dtype = wd.shape, wd.dtype  # not the array: the graph keeps no reference to a parameter's

    def scatter(g):
        return _scatter_add(array_module(g), shape, dtype, ids.reshape(-1), g.reshape(-1, shape[1]))
    return Tensor.from_op(wd[ids], (weight,), lambda g: (weight_grad(lambda: scatter(g)),))


def softmax(x: Tensor, axis: int = -1) -> Tensor:
    xp = array_module(x.data)
    out = x.data - x.data.max(axis=axis, keepdims=True)
    xp.exp(out, out=out)
    out /= out.sum(axis=axis, keepdims=True)

    def backward(g):
        gy = g * out
        gy -= out * gy.sum(axis=axis, keepdims=True)
        return (gy,)
    return Tensor.from_op(out, (x,), backward)


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float = 1e-5) -> Tensor:
    """LayerNorm over the last dim. x [..., C], weight/bias [C]. Keeps the per-row mean and 1/std
    (xhat is rebuilt from x in backward, in float32 for 16-bit x). A plain backward computes dx,
    dweight = sum(g xhat) and dbias = sum(g) in one pass; a split one (B/W) dx in B and the other two
    in W (`weight_grad`). On the CPU each pass is one cache-blocked kernel (`cpu_kernels`)."""
    stored, dt = x.data, x.data.dtype
    if is_device_array(stored):
        return _layer_norm_fused(x, weight, bias, eps)
    w = rounded(weight.data, dt)
    b = rounded(bias.data, dt) if bias is not None else None
    out, mu, rstd = cpu_kernels.layer_norm_forward(stored, w, b, eps)
    del w, b

    def backward(g):
        w, has_bias = rounded(weight.data, dt), bias is not None
        want_w = weight.requires_grad or (has_bias and bias.requires_grad)
        now_w = want_w and not defers_weight_grads()
        gx = dw = db = None
        if x.requires_grad or now_w:
            gx, dw, db = cpu_kernels.layer_norm_backward(stored, w, mu, rstd, g, x.requires_grad, now_w, has_bias)
        late = [None]  # split backward: dweight and dbias from one pass over g in W, the first to ask runs it

        def part(i):
            if now_w:
                return (dw, db)[i]
            if late[0] is None:
                late[0] = cpu_kernels.layer_norm_backward(stored, w, mu, rstd, g, False, True, has_bias)[1:]
            return late[0][i]
        gw = weight_grad(lambda: part(0)) if weight.requires_grad else None
        gb = weight_grad(lambda: part(1)) if has_bias and bias.requires_grad else None
        return gx, gw, gb
    return Tensor.from_op(out, (x, weight, bias), backward)


def _layer_norm_fused(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float) -> Tensor:
    """layer_norm on the GPU: one kernel per pass; saves per-row mean and 1/std, not xhat. 16-bit x
    goes through the kernels in float32 (taken up again in backward) and comes out rounded once."""
    xp = array_module(x.data)
    stored, dt = x.data, x.data.dtype

    def rows():
        return xp.ascontiguousarray(up(stored))
    out, mu, rstd = gpu_kernels.layer_norm_forward(rows(), rounded(weight.data, dt),
                                               None if bias is None else rounded(bias.data, dt), eps)
    c = stored.shape[-1]

    def backward(g):
        g = xp.ascontiguousarray(up(g))
        gx, g_xhat = gpu_kernels.layer_norm_backward(rows(), rounded(weight.data, dt), mu, rstd, g)
        gw = weight_grad(lambda: _sum_rows(g_xhat)) if weight.requires_grad else None
        gb = weight_grad(lambda: _sum_rows(g.reshape(-1, c))) if bias is not None and bias.requires_grad else None
        return (down(gx, dt) if x.requires_grad else None), gw, gb
    return Tensor.from_op(down(out, dt), (x, weight, bias), backward)


def cross_entropy(logits: Tensor, targets, ignore_index: int = -100) -> Tensor:
    """Mean negative log-likelihood of `targets` under softmax(`logits`), fused.

    logits [..., V], targets int [...]; positions equal to `ignore_index` are left
    out of the mean. Returns a scalar Tensor.
    """
    xp = array_module(logits.data)
    ld = up(logits.data)    # 16-bit logits: the softmax and the loss in float32
    v = ld.shape[-1]
    z = ld.reshape(-1, v)
    t = (targets.data if isinstance(targets, Tensor) else targets).reshape(-1)
    valid = t != ignore_index
    if _fused(ld):
        return _cross_entropy_fused(logits, xp.ascontiguousarray(z), t.astype(xp.int64), valid, ignore_index)
    safe_t = xp.where(valid, t, 0)
    nll, probs, total = cpu_kernels.cross_entropy_forward(z, safe_t, valid)
    # Kept as an array (no device-to-host sync on GPU).
    count = xp.maximum(valid.sum(), 1).astype(ld.dtype)
    loss = nll.sum() / count

    def backward(g):
        coef = (valid * (g / count)).astype(probs.dtype)
        grad = cpu_kernels.cross_entropy_backward(probs, total, safe_t, coef)
        return (down(grad.reshape(ld.shape), logits.dtype),)
    return Tensor.from_op(loss.astype(ld.dtype), (logits,), backward)


def _cross_entropy_fused(logits: Tensor, z, t, valid, ignore_index: int) -> Tensor:
    """cross_entropy on the GPU: a row kernel each way; keeps log-sum-exp per row, not the
    [rows, V] probabilities."""
    xp = array_module(z)
    nll, lse = gpu_kernels.cross_entropy_forward(z, t, ignore_index)
    count = xp.maximum(valid.sum(), 1).astype(z.dtype)

    def backward(g):
        coef = (g / count).reshape(1).astype(z.dtype)
        return (down(gpu_kernels.cross_entropy_backward(z, t, lse, coef, ignore_index).reshape(logits.shape),
                     logits.dtype),)
    return Tensor.from_op((nll.sum() / count).astype(z.dtype), (logits,), backward)


def causal_attention(qkv: Tensor, n_head: int, recompute: bool = False) -> Tensor:
    """Fused causal self-attention.

    qkv [B, T, 3*H*D] holds q, k, v side by side (the c_attn output, rows [q; k; v]);
    returns [B, T, H*D] with heads merged. Scores, mask, softmax and the weighted sum
    happen inside, by blocks of queries whose keys stop at the block's causal edge (on the CPU
    `cpu_kernels.causal_attention_forward`, on a GPU `_causal_attention_fused`); only the causal
    blocks of the [B, H, T, T] probabilities are kept for backward.

    `recompute` (selective activation recomputation, Korthikanti et al. 2022): keep no
    probabilities; backward recomputes them from q and k (views of the saved qkv) with the same
    operations in the same order, so the gradients are bitwise those of `recompute=False`. This
    model has no dropout on the probabilities, so nothing else is redrawn.
    """
    stored = qkv.data
    if is_device_array(stored):
        b, t, three_c = qkv.shape
        heads = up(stored.reshape(b, t, 3, n_head, three_c // 3 // n_head).transpose(2, 0, 3, 1, 4))
        return _causal_attention_fused(qkv, heads, recompute)
    out, saved = cpu_kernels.causal_attention_forward(stored, n_head, keep_probs=not recompute)
    return Tensor.from_op(out, (qkv,), lambda g: (cpu_kernels.causal_attention_backward(stored, n_head, saved, g),))


_QUERY_CHUNK = 256  # GPU attention: queries per chunk (a chunk's scores stop at its causal edge)


def _causal_attention_fused(qkv: Tensor, heads, recompute: bool = False) -> Tensor:
    """causal_attention on the GPU: cuBLAS for the products, one row kernel for each softmax.

    The queries go in chunks of `_QUERY_CHUNK`: chunk [a, e) needs keys [0, e) only, so the
    scores above the diagonal's blocks are never computed, stored or read (for T = 1024 and
    chunks of 256, 10/16 of B H T^2; on an H100 chunks of 128 were slower, 512 no faster).
    Within a chunk the kernel masks keys past each query. `recompute`: keep no chunk's
    probabilities; backward recomputes each chunk's just before its gradient (one chunk at a time).
    The [.., T, T] operands keep their own layout in every product; the small [.., T, D] ones
    are the transposed side (a transposed batch operand is copied by cuBLAS's caller).
    """
    xp = array_module(heads)
    _, b, n_head, t, d = heads.shape
    scale = 1.0 / math.sqrt(d)
    q, k, v = (xp.ascontiguousarray(h) for h in heads)                     # [B, H, T, D] each
    kt = xp.ascontiguousarray(k.swapaxes(-1, -2))                          # [B, H, D, T]
    bounds = [(a, min(a + _QUERY_CHUNK, t)) for a in range(0, t, _QUERY_CHUNK)]

    def probabilities(a: int, e: int):
        p = q[:, :, a:e] @ kt[:, :, :, :e]                                 # [B, H, e-a, e] scores
        gpu_kernels.causal_softmax_forward(p, scale, first_query=a)
        return p

    probs, y = [], xp.empty_like(q)
    for a, e in bounds:
        p = probabilities(a, e)
        y[:, :, a:e] = p @ v[:, :, :e]
        probs.append(None if recompute else p)
        del p
    out = down(y.transpose(0, 2, 1, 3).reshape(b, t, n_head * d), qkv.dtype)

    def backward(g):
        gy = xp.ascontiguousarray(up(g).reshape(b, t, n_head, d).transpose(0, 2, 1, 3))  # [B, H, T, D]
        gq = xp.empty_like(q)
        gkt = xp.zeros_like(kt)                                            # dK^T [B, H, D, T]
        gvt = xp.zeros((b, n_head, d, t), dtype=q.dtype)                   # dV^T [B, H, D, T]
        vt = v.swapaxes(-1, -2)
        for (a, e), p in zip(bounds, probs):
            p = p if p is not None else probabilities(a, e)
            gya = gy[:, :, a:e]
            gvt[:, :, :, :e] += gya.swapaxes(-1, -2) @ p                   # dV^T += dY^T P
            gs = gya @ vt[:, :, :, :e]                                     # dP = dY V^T
            gpu_kernels.causal_softmax_backward(p, gs, scale)                  # dS, in place
            gq[:, :, a:e] = gs @ k[:, :, :e]                               # dQ = dS K
            gkt[:, :, :, :e] += q[:, :, a:e].swapaxes(-1, -2) @ gs         # dK^T += Q^T dS
        gqkv = xp.stack([gq, gkt.swapaxes(-1, -2), gvt.swapaxes(-1, -2)])  # [3, B, H, T, D]
        return (down(gqkv.transpose(1, 3, 0, 2, 4).reshape(b, t, 3 * n_head * d), qkv.dtype),)
    return Tensor.from_op(out, (qkv,), backward)


_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64 constants (Steele, Lea, Flood 2014)
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_MASK64 = (1 << 64) - 1


def _splitmix64(xp, z):
    """splitmix64's output function, in place on a uint64 array (wrapping arithmetic)."""
    t = xp.empty_like(z)
    z += xp.uint64(_GOLDEN)
    for shift, mix in ((30, _MIX1), (27, _MIX2)):
        xp.right_shift(z, xp.uint64(shift), out=t)
        z ^= t
        z *= xp.uint64(mix)
    xp.right_shift(z, xp.uint64(31), out=t)
    z ^= t
    return z


def _key_seed(key) -> int:
    """A 64-bit stream id from an integer key tuple, e.g. (seed, step, sample id, site)."""
    h = 0
    for k in key:  # each part folded through a splitmix round: (1, 2) and (2, 1) differ
        h = (h ^ (int(k) & _MASK64)) + _GOLDEN & _MASK64
        h = ((h ^ (h >> 30)) * _MIX1) & _MASK64
        h = ((h ^ (h >> 27)) * _MIX2) & _MASK64
        h ^= h >> 31
    return h


def counter_uniform(xp, keys, shape: tuple, rows=None):
    """Uniform [0, 1) floats [len(keys), *shape]: element i of row n is a hash of (keys[n], i).

    Counter-based (no generator state): the value of an element depends only on its key and its
    flat index in `shape`, so NumPy and CuPy draw identical numbers, a sample's values do not
    depend on its batch-mates, and `rows` (a slice of dim 0 of `shape`, or the indices of the rows
    wanted, in any order) draws just those rows of the full array, exactly as the full draw would
    have them (a sequence shard's part; under context parallelism, the positions a rank holds).
    """
    inner = math.prod(shape[1:])
    if rows is None or isinstance(rows, slice):
        lo, hi = (0, shape[0]) if rows is None else (rows.start, rows.stop)
        index = xp.arange(lo * inner, hi * inner, dtype=xp.uint64)
        n = hi - lo
    else:
        picked = xp.asarray(rows, dtype=xp.uint64)
        index = (picked[:, None] * xp.uint64(inner) + xp.arange(inner, dtype=xp.uint64)[None, :]).reshape(-1)
        n = int(picked.size)
    seeds = xp.asarray([_key_seed(k) for k in keys], dtype=xp.uint64)
    with _wrapping(xp):
        z = index * xp.uint64(_GOLDEN)
        z = _splitmix64(xp, seeds[:, None] + z[None, :])
    z >>= xp.uint64(11)  # the top 53 bits: a double in [0, 1) with every bit random
    u = z.astype(xp.float64)
    u *= 1.0 / (1 << 53)
    return u.reshape((len(keys), n) + tuple(shape[1:]))


def _wrapping(xp):
    """uint64 overflow is the point of the hash: silence NumPy's overflow warnings."""
    import contextlib
    return xp.errstate(over="ignore") if hasattr(xp, "errstate") else contextlib.nullcontext()


def dropout(x: Tensor, p: float, mask_rng_keys=None, training: bool = True, rows=None,
            full_shape: tuple | None = None) -> Tensor:
    """Inverted dropout with a counter-based mask (see `counter_uniform`).

    `mask_rng_keys` is one integer key tuple per row of dim 0 (e.g. per sample:
    (seed, step, sample_id, site)), so a sample's mask does not depend on which other samples
    share its batch, on the mesh or on the backend. A shard of the sequence passes
    `full_shape` (the per-sample shape [T, ..]) and its `rows` of T (a slice, or the positions it
    holds): it gets those rows of the mask the whole sequence would have.
    """
    if not training or p == 0.0:
        return x
    if mask_rng_keys is None:
        raise ValueError("dropout needs one rng key per sample (mask_rng_keys)")
    xp = array_module(x.data)
    keep = 1.0 - p
    shape = tuple(full_shape) if full_shape is not None else x.shape[1:]
    kept = counter_uniform(xp, mask_rng_keys, shape, rows) < keep
    if is_low(x.dtype):  # the 1/keep scaling in float32 (1/keep is not a 16-bit number)
        def scaled(a):
            out = up(a) * kept
            out *= 1.0 / keep
            return down(out, x.dtype)
        return Tensor.from_op(scaled(x.data), (x,), lambda g: (scaled(g),))
    mask = kept.astype(x.dtype)
    mask *= 1.0 / keep
    return Tensor.from_op(x.data * mask, (x,), lambda g: (g * mask,))


def with_loss(y: Tensor, loss: Tensor, scale: float) -> Tensor:
    """y itself, with a side loss joined to the graph: backward passes y's gradient through and
    gives `loss` (a scalar) the gradient `scale`, as if `scale * loss` had been added to the loss
    being differentiated (Megatron's MoEAuxLossAutoScaler). A layer's auxiliary loss (mixture of
    experts: load balancing) thus reaches its parameters wherever the main loss is computed, on
    this pipeline stage or a later one; `scale` is the main loss's own scale (1/micro-batches)."""
    xp = array_module(loss.data)

    def backward(g):
        return g, xp.full(loss.shape, scale, dtype=loss.dtype)
    return Tensor.from_op(y.data, (y, loss), backward)


# ----------------------------------------------------------------------------------------
# Activation recomputation
# ----------------------------------------------------------------------------------------
def recompute(fn, *inputs: Tensor) -> Tensor:
    """fn(*inputs) keeping only `inputs` for backward (full activation recomputation, a.k.a.
    gradient checkpointing; Chen et al. 2016, Korthikanti et al. 2022).

    Forward runs `fn` under `no_grad`: none of its intermediates outlive it. Backward re-runs
    `fn` with the graph recorded on fresh leaves holding the saved inputs' arrays and backpropagates
    the incoming gradient through that graph; the leaves' gradients are this op's. The re-run
    must compute what the first run did: `fn` may read no state that changed in between (a
    caller that keys dropout masks on a per-micro-batch context captures it in `fn`, see
    `nn.gpt.GPT`), and the same arithmetic in the same order then gives bitwise the same
    gradients as running `fn` without this op.

    Parameters used inside `fn` are not parents of this op: they are leaves of the re-run's
    graph, so each receives its gradient and fires its grad hooks (data parallelism's counting)
    once per backward of this op, inside it (under a split backward: in the weight pass, W,
    which then holds what the re-run's weight gradients need, as a block kept whole would).
    Collectives inside `fn` are issued again by the re-run, so every rank of their group must
    recompute the same `fn` at the same point.

    Under `no_grad` this is just `fn(*inputs)`. Returns a Tensor that requires grad (whenever
    gradients are enabled: `fn`'s parameters may need them though no input does).
    """
    if not is_grad_enabled():
        return fn(*inputs)
    with no_grad():
        out = fn(*inputs)

    def backward(g):
        leaves = tuple(Tensor(x.data, requires_grad=x.requires_grad) for x in inputs)
        with enable_grad():
            y = fn(*leaves)
        # Inside a split backward (B) only the leaves' gradients are wanted now; the parameters'
        # join the enclosing backward's weight pass (tensor.WeightGrads), in order.
        y.backward(g, inputs=leaves)
        return tuple(leaf.grad for leaf in leaves)
    return Tensor.from_op(out.data, tuple(inputs), backward, always=True)
