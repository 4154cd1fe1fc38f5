"""Cross-entropy of rows of logits on the CPU, one cache-blocked pass each way.

    cross_entropy_forward(z, t, valid)      z [N, V] -> nll [N], and for backward probs [N, V] =
                                            exp(z - rowmax) with their row sums [N]
    cross_entropy_backward(probs, ...)      dz, computed in place in the forward's probs
"""

from __future__ import annotations

import numpy as np

from hpcpar.backend.cpu.blocks import block_ranges, run_blocks


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
    run_blocks(block, block_ranges(n, vocab * z.itemsize))
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
    run_blocks(block, block_ranges(n, vocab * probs.itemsize))
    return probs

