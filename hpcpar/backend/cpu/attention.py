"""Causal self-attention on the CPU, fused: qkv [B, T, 3 H D] -> y [B, T, H D] and back.

    causal_attention_forward / _backward    per (batch group, query block), the keys of a block
                                            stopping at its causal edge (the blocks above the
                                            diagonal never computed); with the `fast` extra per
                                            (sample, head) in compiled calls (`jit.attention`)
    kept_probabilities(t)                   elements of one head's probabilities kept for backward
    AttentionSaved                          what forward keeps for backward

The softmax is rearranged (exponentials without the max shift, normalisation after P V: see
`_exp_scores` and `causal_attention_forward`) and equals the textbook formulas to rounding. A row's
result depends on that row alone, whichever batch group, thread or block it is computed in.
"""

from __future__ import annotations

import math

import numpy as np

from hpcpar.backend import blas
from hpcpar.backend.cpu.blocks import compiled_loops, run_blocks, scratch
from hpcpar.backend.kernel_pool import num_threads
from hpcpar.backend.precision import down, is_low, up, up_dtype

# Bytes of one work unit's [nb, H, T, T] scores (a group of batch rows, all heads), and query rows
# per block. A block's keys stop at its last query (the causal edge), so the scores above the
# diagonal blocks are never computed: 1/4 of them for T = 128, 3/8 for T = 256.
ATTENTION_BYTES = 1024 * 1024
QUERY_BLOCK = 64

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
    out = scratch(slot, x.shape[:2] + (x.shape[3], x.shape[2]), cd)
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
        array [B H, K] of every (sample, head)'s blocks (`jit.attention`); None when backward
        recomputes them.
    rowsum: l = the row sums of E [B, H, T, 1] (full precision; None in 16 bits, where P = E / l).
    compiled: forward ran `jit.attention`'s kernels, and so does backward (the layout of probs).
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
    qs = scratch("attn_qs", q.shape, cd)
    np.multiply(q, scale, out=qs)
    return qs


def _compiled_attention(dtype):
    """(jit.attention, cblas gemm) where attention runs as compiled kernels (the `fast` extra, a
    float32/float64 model and a GEMM compiled code can call: `blas.compiled_gemm`), else None."""
    if is_low(dtype) or compiled_loops() is None:
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
        run_blocks(run, _unit_blocks(b * n_head))
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
        run_blocks(run, _unit_blocks(b * n_head))
    return grad


def causal_attention_forward(qkv, n_head: int, keep_probs: bool = True):
    """Causal self-attention of qkv [B, T, 3 H D] -> (y [B, T, H D] in qkv's dtype, saved).

    Per batch group and query block [a, e): E = exp(S) against keys [0, e) only (the
    diagonal block masked), y = (E V) / rowsum(E): the normalisation divides the [q, D] product,
    never the [q, e] block, and backward needs no normalised P either (`causal_attention_backward`).
    In 16 bits P = E / l is formed and rounded to 16 bits first, as a 16-bit model stores it.
    `keep_probs`: keep each block's E (P) for backward; else backward recomputes them with the same
    operations (selective recomputation: the same bits). With the `fast` extra, float32/float64
    attention runs as compiled kernels instead (`jit.attention`: the same formulas, one GIL-free call
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
        vg = scratch("attn_v", (b1 - b0, n_head, t, d), cd)
        vg[...] = v[b0:b1]
        for j, (a, e) in enumerate(qblocks):
            shape = (b1 - b0, n_head, e - a, e)
            p = np.empty(shape, dtype=cd) if keep_probs else scratch("attn_p", shape, cd)
            total = _exp_scores(qs, kt, a, e, dt, p)
            y = scratch("attn_y", (b1 - b0, n_head, e - a, d), cd)
            blas.matmul(p, vg[:, :, :e], out=y)
            if total is None:                                                  # 16 bits: P is normalised
                out_heads[b0:b1, :, a:e] = y
            else:
                np.divide(y, total, out=out_heads[b0:b1, :, a:e])
                saved.rowsum[b0:b1, :, a:e] = total
            if keep_probs:
                saved.probs[first[b0] + j] = down(p, dt)
    run_blocks(group, groups, gemms=True)
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
    jit = None if is_low(dt) else compiled_loops()
    zero_rows = np.zeros(1, dtype=cd)

    def group(b0, b1):
        nb = b1 - b0
        qg, kg = up(q[b0:b1]), up(k[b0:b1])
        vt = _transposed(v[b0:b1], "attn_vt", cd)
        if saved.probs is None:
            qs, kt = _scaled_queries(q[b0:b1], scale, cd), _transposed(k[b0:b1], "attn_kt", cd)
        gy = scratch("attn_gy", (nb, n_head, t, d), cd)                        # dY' = dY / l
        dk, dv = scratch("attn_dk", gy.shape, cd), scratch("attn_dv", gy.shape, cd)
        rowsum = saved.rowsum[b0:b1] if saved.rowsum is not None else None
        if rowsum is not None:
            np.divide(up(g_heads[b0:b1]), rowsum, out=gy)
        else:
            gy[...] = up(g_heads[b0:b1])
        for j, (a, e) in qblocks:
            if saved.probs is not None:
                p = up(saved.probs[first[b0] + j])
            else:
                p = scratch("attn_p", (nb, n_head, e - a, e), cd)
                _exp_scores(qs, kt, a, e, dt, p)
            gya = gy[:, :, a:e]
            whole = e == t                                                     # the first block here
            part = dv if whole else scratch("attn_part", (nb, n_head, e, d), cd)
            blas.matmul(p.swapaxes(-1, -2), gya, out=part)                       # dV[:e] += E^T dY'
            if not whole:
                dv[:, :, :e] += part
            gs = scratch("attn_gs", (nb, n_head, e - a, e), cd)
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
            dq = scratch("attn_dq", (nb, n_head, e - a, d), cd)
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
    run_blocks(group, groups, gemms=True)
    return grad

