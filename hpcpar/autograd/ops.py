"""Differentiable ops on Tensors: elementwise arithmetic, reductions and shape ops, each forward next
to its gradient rule, and the helpers the other op families share.

Every op computes its result with the array module of its inputs (NumPy or CuPy)
and, when gradients are enabled and an input requires them, returns a Tensor whose
`_backward(g)` closure maps the output gradient `g` to one gradient per parent (or
None). Broadcasting ops reduce their gradients back to each input's shape.

The other families, each in its module:

    linear      matmul, linear (optionally fused with GELU), add_bias, grouped_linear
    functional  embedding, softmax, layer_norm, cross_entropy
    attention   causal_attention
    dropout     dropout (counter-based masks: backend.splitmix)
    recompute   recompute (full activation recomputation)

The transformer's hot paths are fused into single ops (linear, layer_norm, gelu,
causal attention, cross_entropy) so that per-op Python overhead stays small and
no temporary outlives the op that needs it.

Mixed precision (`backend/precision.py`): when activations arrive in 16 bits, the fused ops compute in
float32 (`up`), read weights rounded to the activations' dtype (`rounded`), store their outputs and
input gradients in 16 bits (`down`) and keep only 16-bit arrays (or per-row statistics) for
backward; weight gradients stay float32. In full precision every helper is the identity.
"""

from __future__ import annotations

import math

import numpy as np

from hpcpar.backend import array_module, blas, gpu_kernels, is_device_array
from hpcpar.backend.cpu import bias as cpu_bias, gelu as cpu_gelu
from hpcpar.backend.precision import down, is_low, up
from hpcpar.autograd.tensor import Tensor, weight_grad


# ----------------------------------------------------------------------------------------
# Helpers shared by the op families
# ----------------------------------------------------------------------------------------
def uses_gpu_kernels(a) -> bool:
    """Use the fused GPU kernels (`gpu_kernels`) for array `a`: a CuPy float32/float64 array."""
    return is_device_array(a) and gpu_kernels.supported(a)


def sum_rows(a2d):
    """Column sums of a [rows, n] array (bias and LayerNorm gradients). On the GPU as a GEMV,
    ones[rows] @ a: cuBLAS reads the rows coalesced, where a reduction over axis 0 strides."""
    if not uses_gpu_kernels(a2d):
        return cpu_bias.column_sums(a2d) if not is_device_array(a2d) else a2d.sum(axis=0)
    xp = array_module(a2d)
    return xp.ones(a2d.shape[0], dtype=a2d.dtype) @ a2d


def unbroadcast(g, shape: tuple):
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


def weight_grad_if_param(x, fn):
    """Operand x's gradient fn(): weight work (`weight_grad`) when x is a parameter (a bias added after
    a reduction), else computed now."""
    return weight_grad(fn) if _param(x) else fn()


# ----------------------------------------------------------------------------------------
# Elementwise arithmetic (with broadcasting; a plain number may stand for either operand)
# ----------------------------------------------------------------------------------------
def add(a, b) -> Tensor:
    a_t, b_t = isinstance(a, Tensor), isinstance(b, Tensor)
    out = _data(a) + _data(b)
    a_shape = a.shape if a_t else None
    b_shape = b.shape if b_t else None

    def backward(g):
        return (weight_grad_if_param(a, lambda: unbroadcast(g, a_shape)) if a_t else None,
                weight_grad_if_param(b, lambda: unbroadcast(g, b_shape)) if b_t else None)
    return Tensor.from_op(out, (a if a_t else None, b if b_t else None), backward)


def sub(a, b) -> Tensor:
    a_t, b_t = isinstance(a, Tensor), isinstance(b, Tensor)
    out = _data(a) - _data(b)
    a_shape = a.shape if a_t else None
    b_shape = b.shape if b_t else None

    def backward(g):
        return (unbroadcast(g, a_shape) if a_t else None,
                unbroadcast(-g, b_shape) if b_t else None)
    return Tensor.from_op(out, (a if a_t else None, b if b_t else None), backward)


def mul(a, b) -> Tensor:
    a_t, b_t = isinstance(a, Tensor), isinstance(b, Tensor)
    ad, bd = _data(a), _data(b)
    out = ad * bd

    def backward(g):
        return (weight_grad_if_param(a, lambda: unbroadcast(g * bd, a.shape)) if a_t and a.requires_grad else None,
                weight_grad_if_param(b, lambda: unbroadcast(g * ad, b.shape)) if b_t and b.requires_grad else None)
    return Tensor.from_op(out, (a if a_t else None, b if b_t else None), backward)


def div(a, b) -> Tensor:
    a_t, b_t = isinstance(a, Tensor), isinstance(b, Tensor)
    ad, bd = _data(a), _data(b)
    out = ad / bd

    def backward(g):
        ga = unbroadcast(g / bd, a.shape) if a_t and a.requires_grad else None
        gb = unbroadcast(-g * out / bd, b.shape) if b_t and b.requires_grad else None
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
    each way: `gpu_kernels` on the GPU, `cpu.gelu` (cache-blocked NumPy) on the CPU."""
    stored, dt = x.data, x.data.dtype
    if is_device_array(stored):
        out, tanh_u = gpu_kernels.gelu_forward(up(stored))
        kept = None if is_low(dt) else tanh_u

        def backward(g):
            xs = up(stored)
            t = kept if kept is not None else gpu_kernels.gelu_forward(xs)[1]
            return (down(gpu_kernels.gelu_backward(xs, t, up(g)), dt),)
        return Tensor.from_op(down(out, dt), (x,), backward)
    out, kept = cpu_gelu.gelu_forward(stored, keep_tanh=not is_low(dt))
    return Tensor.from_op(out, (x,), lambda g: (cpu_gelu.gelu_backward(stored, kept, g),))


def cast(x: Tensor, dtype) -> Tensor:
    """x stored as `dtype` (rounded to nearest even); the gradient goes back in x's dtype. Where a
    mixed-precision model's activations enter 16 bits (after the embedding sum)."""
    source = x.data.dtype
    return Tensor.from_op(down(x.data, dtype), (x,), lambda g: (down(g, source),))


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
# Shape ops and gathers
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

    def backward(g):
        return (weight_grad_if_param(x, lambda: scatter_add(array_module(g), shape, dtype, index, g)),)
    return Tensor.from_op(xd[index], (x,), backward)


def scatter_add(xp, shape: tuple, dtype, index, g):
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
    if uses_gpu_kernels(out) and by_rows:
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
# Joining a side loss to the graph
# ----------------------------------------------------------------------------------------
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

