"""Mixture-of-experts dispatch and combine: row gathers whose gradients are row gathers too.

A micro-batch's N tokens routed to k experts each give N k assignments, a = j N + n being token
n's j-th choice (choice-major: their capacity priority), of which K are kept
(`nn.moe.dispatch_order`). `Assignments` holds where they travel:

    order [K]    the kept assignments sorted by expert: the order of the rows sent to the experts
    source [K]   order % N, the token of each of those rows
    row [N k]    each assignment's row among them (0 for a dropped one, masked by `lost`)
    lost [N k]   the dropped assignments (bool), or None when none is

`dispatch_rows`: tokens [N, C] -> their rows in `order` [K, C]; `combine_rows`: the experts'
outputs [K, C] -> per token the sum over its kept choices of probability times output [N, C];
`permute_rows`: rows reordered by a permutation (the arrived rows grouped by expert under expert
parallelism). Every gradient is one gather per choice, summed in choice order: no scatter-add
(NumPy's add.at goes row by row; the one-hot GEMM that replaces it costs as much as an expert's
GEMM), and each op is one graph node instead of a chain of gathers, pads, products and sums.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpcpar.backend import array_module
from hpcpar.autograd.tensor import Tensor


@dataclass
class Assignments:
    """Where a micro-batch's N k assignments travel (see the module doc); index arrays in the
    activations' array module. `of` builds it from `dispatch_order`'s host arrays."""

    tokens: int
    k: int
    order: object
    source: object
    row: object
    lost: object

    @classmethod
    def of(cls, order, row, tokens: int, k: int, xp) -> "Assignments":
        """From order [K] and row [N k] (K marking a dropped assignment), NumPy int arrays."""
        lost = row == order.size
        safe = row.copy()
        safe[lost] = 0
        return cls(tokens, k, xp.asarray(order), xp.asarray(order % tokens), xp.asarray(safe),
                   xp.asarray(lost) if lost.any() else None)

    def gather(self, a, j: int):
        """Rows of a [K, C] for every token's j-th choice: [N, C], zero where that choice was dropped."""
        n = self.tokens
        if a.shape[0] == 0:  # nothing kept: every choice dropped
            return array_module(a).zeros((n,) + a.shape[1:], dtype=a.dtype)
        out = a[self.row[j * n:(j + 1) * n]]
        if self.lost is not None:
            out[self.lost[j * n:(j + 1) * n]] = 0
        return out


def dispatch_rows(x: Tensor, where: Assignments) -> Tensor:
    """x [N, C] -> [K, C], row i being token `where.source[i]`. Backward: dx[n] = the sum over
    j of g[row[j N + n]] (nothing for a dropped choice), in choice order."""
    def backward(g):
        dx = where.gather(g, 0)
        for j in range(1, where.k):
            dx += where.gather(g, j)
        return (dx,)
    return Tensor.from_op(x.data[where.source], (x,), backward)


def combine_rows(out: Tensor, probs: Tensor, choices, where: Assignments) -> Tensor:
    """The experts' outputs out [K, C] (rows in `where.order`) back to the tokens: y [N, C],
    y[n] = sum over j of probs[n, choices[n, j]] * out[row[j N + n]] (a dropped choice adds
    nothing; no renormalisation), summed in choice order. probs [N, E], choices [N, k] (the
    distinct experts of each token). Backward: dout[i] = g[source[i]] times its probability; dprobs
    at (n, choices[n, j]) = <g[n], out[row[j N + n]]>, zero elsewhere."""
    od, pd = out.data, probs.data
    xp = array_module(od)
    n, k = where.tokens, where.k
    picked = (xp.arange(n)[:, None], choices)
    gates = pd[picked]                                                  # [N, k]
    y = where.gather(od, 0)
    y *= gates[:, :1]
    for j in range(1, k):
        part = where.gather(od, j)
        part *= gates[:, j:j + 1]
        y += part

    def backward(g):
        dout = dprobs = None
        if out.requires_grad:
            dout = g[where.source] * gates.T.reshape(-1)[where.order][:, None]
        if probs.requires_grad:
            dgates = xp.stack([(g * where.gather(od, j)).sum(axis=1) for j in range(k)], axis=1)
            dprobs = xp.zeros_like(pd)
            dprobs[picked] = dgates
        return dout, dprobs
    return Tensor.from_op(y, (out, probs), backward)


def permute_rows(x: Tensor, perm, inverse) -> Tensor:
    """x[perm] for a permutation `perm` of x's rows ([M, ...] -> [M, ...]); `inverse` its
    inverse (inverse[perm] = arange(M)). Backward: g[inverse]."""
    return Tensor.from_op(x.data[perm], (x,), lambda g: (g[inverse],))
