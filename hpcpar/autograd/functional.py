"""Differentiable lookup, normalisation and probabilities: embedding, softmax, layer_norm and
cross_entropy, each forward next to its gradient.

Layouts: embedding ids int [...] into weight [V, C] -> [..., C]; layer_norm over the last dim of
x [..., C] with weight/bias [C]; cross_entropy of logits [..., V] against int targets [...].
layer_norm and cross_entropy are fused: on the CPU one cache-blocked kernel per pass
(`backend.cpu.layer_norm`, `backend.cpu.cross_entropy`), on a GPU one row kernel per pass
(`gpu_kernels`). For backward, layer_norm keeps each row's mean and 1/std (not xhat);
cross_entropy keeps each row's log-sum-exp on a GPU, and on the CPU the [N, V] exponentials, which
its backward turns into the gradient in place.
"""

from __future__ import annotations

from hpcpar.backend import array_module, gpu_kernels, is_device_array
from hpcpar.backend.cpu import cross_entropy as cpu_cross_entropy, layer_norm as cpu_layer_norm
from hpcpar.backend.precision import down, rounded, up
from hpcpar.autograd.ops import scatter_add, sum_rows, uses_gpu_kernels
from hpcpar.autograd.tensor import Tensor, defers_weight_grads, weight_grad


def embedding(idx, weight: Tensor) -> Tensor:
    """weight[idx]: idx int [...], weight [V, C] -> [..., C]; gradient is a scatter-add (weight
    work: all of it W under a split backward)."""
    ids = idx.data if isinstance(idx, Tensor) else idx
    wd = weight.data
    shape, dtype = wd.shape, wd.dtype  # not the array: the graph keeps no reference to a parameter's

    def scatter(g):
        return scatter_add(array_module(g), shape, dtype, ids.reshape(-1), g.reshape(-1, shape[1]))
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
    in W (`weight_grad`). On the CPU each pass is one cache-blocked kernel (`backend.cpu.layer_norm`)."""
    stored, dt = x.data, x.data.dtype
    if is_device_array(stored):
        return _layer_norm_fused(x, weight, bias, eps)
    w = rounded(weight.data, dt)
    b = rounded(bias.data, dt) if bias is not None else None
    out, mu, rstd = cpu_layer_norm.layer_norm_forward(stored, w, b, eps)
    del w, b

    def backward(g):
        w, has_bias = rounded(weight.data, dt), bias is not None
        want_w = weight.requires_grad or (has_bias and bias.requires_grad)
        now_w = want_w and not defers_weight_grads()
        gx = dw = db = None
        if x.requires_grad or now_w:
            gx, dw, db = cpu_layer_norm.layer_norm_backward(stored, w, mu, rstd, g, x.requires_grad, now_w, has_bias)
        late = [None]  # split backward: dweight and dbias from one pass over g in W, the first to ask runs it

        def part(i):
            if now_w:
                return (dw, db)[i]
            if late[0] is None:
                late[0] = cpu_layer_norm.layer_norm_backward(stored, w, mu, rstd, g, False, True, has_bias)[1:]
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
        gw = weight_grad(lambda: sum_rows(g_xhat)) if weight.requires_grad else None
        gb = weight_grad(lambda: sum_rows(g.reshape(-1, c))) if bias is not None and bias.requires_grad else None
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
    if uses_gpu_kernels(ld):
        return _cross_entropy_fused(logits, xp.ascontiguousarray(z), t.astype(xp.int64), valid, ignore_index)
    safe_t = xp.where(valid, t, 0)
    nll, probs, total = cpu_cross_entropy.cross_entropy_forward(z, safe_t, valid)
    # Kept as an array (no device-to-host sync on GPU).
    count = xp.maximum(valid.sum(), 1).astype(ld.dtype)
    loss = nll.sum() / count

    def backward(g):
        coef = (valid * (g / count)).astype(probs.dtype)
        grad = cpu_cross_entropy.cross_entropy_backward(probs, total, safe_t, coef)
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
