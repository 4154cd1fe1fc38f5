"""Differentiable causal self-attention, fused: qkv [B, T, 3 H D] (q, k, v side by side) ->
[B, T, H D] with the heads merged.

On the CPU the cache-blocked kernels of `backend.cpu.attention`; on a GPU cuBLAS for the products
and `gpu_kernels`' row kernels for the softmax, in chunks of queries. Either way only the causal
blocks of the [B, H, T, T] probabilities are computed and kept, or none with `recompute`.
"""

from __future__ import annotations

import math

import numpy as np

from hpcpar.backend import array_module, gpu_kernels, is_device_array
from hpcpar.backend.cpu import attention as cpu_attention
from hpcpar.backend.precision import down, up
from hpcpar.autograd.tensor import Tensor


def causal_attention(qkv: Tensor, n_head: int, recompute: bool = False) -> Tensor:
    """Fused causal self-attention.

    qkv [B, T, 3*H*D] holds q, k, v side by side (the c_attn output, rows [q; k; v]);
    returns [B, T, H*D] with heads merged. Scores, mask, softmax and the weighted sum
    happen inside, by blocks of queries whose keys stop at the block's causal edge (on the CPU
    `cpu_attention.causal_attention_forward`, on a GPU `_causal_attention_fused`); only the causal
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
    out, saved = cpu_attention.causal_attention_forward(stored, n_head, keep_probs=not recompute)
    return Tensor.from_op(out, (qkv,), lambda g: (cpu_attention.causal_attention_backward(stored, n_head, saved, g),))


def document_attention(qkv: Tensor, n_head: int, documents, recompute: bool = False) -> Tensor:
    """Causal self-attention within segments (packed documents, `data.packing.Documents`).

    qkv [B, T, 3*H*D] as in `causal_attention`; `documents` gives each row's segment starts. Every
    segment [a, e) of row b attends causally to itself only: its q, k, v rows qkv[b, a:e] go,
    with the other segments of the same length, through the CPU causal kernels as a batch
    [n, e - a, 3*H*D], so the work is sum(len_i^2), not T^2, and each segment's result is its
    causal attention run alone. Returns [B, T, H*D]. Forward and backward are those of
    `causal_attention` per group (`recompute`: no probabilities kept, recomputed in backward).
    """
    if documents.whole:
        return causal_attention(qkv, n_head, recompute)
    stored = qkv.data
    b, t, three_c = stored.shape
    groups, out = [], None
    for length, rows, offsets in documents.segments():
        at = (rows[:, None], offsets[:, None] + np.arange(length))     # [n, L] tokens of the group
        part = np.ascontiguousarray(stored[at])                         # [n, L, 3C]
        y, saved = cpu_attention.causal_attention_forward(part, n_head, keep_probs=not recompute)
        if out is None:
            out = np.empty((b, t, y.shape[-1]), dtype=y.dtype)
        out[at] = y
        groups.append((at, part, saved))

    def backward(g):
        grad = np.empty((b, t, three_c), dtype=stored.dtype)            # every token is in one segment
        for at, part, saved in groups:
            grad[at] = cpu_attention.causal_attention_backward(part, n_head, saved, np.ascontiguousarray(g[at]))
        return (grad,)
    return Tensor.from_op(out, (qkv,), backward)


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

