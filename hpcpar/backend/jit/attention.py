"""Causal self-attention as one compiled call per run of (sample, head) pairs (Numba + the GEMM's C
entry point), when the `fast` extra is installed.

`cpu.attention.causal_attention_forward/_backward` without Numba run a (batch group, query block) as
a dozen NumPy calls. Each holds the GIL for its Python part, and with two kernel threads every
call also waits for the other thread's GIL hand-off (tens of microseconds of thread wake-ups on a
VM): two threads ran the default model's attention 1.1x faster than one, where two processes run
it 2x faster. Here a thread's whole share is one call that holds no GIL: the products go straight
to `cblas_?gemm` (MKL's, or the OpenBLAS NumPy bundles: `blas.compiled_gemm`) on the strided q, k,
v columns of qkv, with no copies; exp, the row sums, the normalisation and softmax's gradient are
loops over rows that stay in L1.

Layouts. qkv [B, T, 3 C] (rows [q; k; v] of c_attn, head h in columns h D .. h D + D of each),
C = H D. A unit u = b H + h is one (sample, head) pair; query blocks [a, e) of `qblock` rows (the
last one shorter) see keys [0, e). probs [B H, K] keeps E = exp(S) of every block of a unit, block
j at `offsets[j]` as a C-ordered [e - a, e] matrix (K = cpu.attention.kept_probabilities(T));
rowsum [B, H, T, 1] holds l = rowsum(E). The arithmetic of a unit never depends on the other units
in the call, the thread it runs on or the memory around it (same products, same loops), which is
what lets every mesh (dp rows, tp heads) reproduce the single-process model bit for bit.

exp is jit.kernels.exp32 / exp64, not libm's (a scalar call per element, 4x slower than NumPy's
SIMD exp): a range reduction and a polynomial, within an ulp (tests/unit/test_cpu_kernels.py), whose
loops vectorize. A row whose sum leaves the range where E keeps full precision is recomputed with
its maximum subtracted, as in cpu.attention._exp_scores.
"""

from __future__ import annotations

import numpy as np
from hpcpar.backend.jit.kernels import _row_sum, exp32, exp64, gemm as _gemm, jit

_NO_TRANS, _TRANS = 111, 112


@jit
def _exp_row(s, n):
    """s[:n] = exp(s[:n]) in place (s 1-D, float32 or float64): jit.kernels.exp32 / exp64."""
    if s.itemsize == 4:
        for i in range(n):
            s[i] = exp32(s[i])
    else:
        for i in range(n):
            s[i] = exp64(s[i])


@jit
def _row_dot(x, y, zero):
    """sum x y over two 1-D rows of equal length, in eight interleaved lanes (as _row_sum); `zero`
    in their dtype."""
    n = x.size
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = zero
    i = 0
    while i + 8 <= n:
        s0 += x[i] * y[i]
        s1 += x[i + 1] * y[i + 1]
        s2 += x[i + 2] * y[i + 2]
        s3 += x[i + 3] * y[i + 3]
        s4 += x[i + 4] * y[i + 4]
        s5 += x[i + 5] * y[i + 5]
        s6 += x[i + 6] * y[i + 6]
        s7 += x[i + 7] * y[i + 7]
        i += 8
    total = ((s0 + s4) + (s1 + s5)) + ((s2 + s6) + (s3 + s7))
    while i < n:
        total += x[i] * y[i]
        i += 1
    return total


@jit
def _scores_row_shifted(qkv, qrow, krow0, valid, d, scale, zero, row):
    """row[:valid] = exp(S - max S) for one query against keys krow0.. (the rare row whose unshifted
    sum left the range); returns its sum. qrow, krow0: flat offsets of the query's and the first
    key's D values in qkv (keys `three_c` apart)."""
    flat = qkv.reshape(-1)
    three_c = qkv.shape[2]
    for j in range(valid):
        acc = zero
        for i in range(d):
            acc += flat[qrow + i] * flat[krow0 + j * three_c + i]
        row[j] = acc * scale
    top = row[0]
    for j in range(1, valid):
        top = row[j] if row[j] > top else top
    for j in range(valid):
        row[j] -= top
    _exp_row(row, valid)
    return _row_sum(row[:valid], zero)


@jit
def _block_scores(gemm, qkv, b, h, a, e, d, scale, zero, tiny, huge, s, sums):
    """Query block [a, e) of unit (b, h): s [e - a, e] (C-ordered, `s` 1-D of (e - a) e) = E =
    exp(S), S = q k^T scale, zero past each query's causal edge; sums [e - a] = its row sums."""
    t, three_c = qkv.shape[1], qkv.shape[2]
    c = three_c // 3
    m = e - a
    size = qkv.itemsize
    q0 = (b * t * three_c) + h * d                       # flat offset of (b, 0, q head h)
    base = qkv.ctypes.data
    _gemm(gemm, _NO_TRANS, _TRANS, m, e, d, scale, base + (q0 + a * three_c) * size, three_c,
         base + (q0 + c) * size, three_c, zero, s.ctypes.data, e)
    for r in range(m):
        row = s[r * e:(r + 1) * e]
        valid = a + r + 1
        _exp_row(row, valid)
        row[valid:] = zero
        total = _row_sum(row[:valid], zero)
        if not (total > tiny and total < huge) and total == total:
            total = _scores_row_shifted(qkv, q0 + (a + r) * three_c, q0 + c, valid, d, scale, zero, row)
        sums[r] = total


@jit
def attention_forward(gemm, qkv, n_head, scale, zero, qblock, offsets, u0, u1, out, rowsum, probs, keep,
                      tiny, huge):
    """Units u0..u1-1: out [B, T, C] (their heads' columns) = softmax(S) V, rowsum [B, H, T, 1] = l,
    and with `keep` probs[u] = each block's E (else nothing is kept). `scale` (1/sqrt(D)), `zero`,
    `tiny` and `huge` (cpu.attention._exp_range) in qkv's dtype; offsets [blocks + 1] int64."""
    t, three_c = qkv.shape[1], qkv.shape[2]
    c = three_c // 3
    d = c // n_head
    size = qkv.itemsize
    scratch = np.empty(qblock * t, dtype=qkv.dtype)
    sums = np.empty(qblock, dtype=qkv.dtype)
    one = np.ones(1, dtype=qkv.dtype)[0]                  # (alpha and beta in the matrices' dtype)
    base, obase = qkv.ctypes.data, out.ctypes.data
    for u in range(u0, u1):
        b, h = u // n_head, u % n_head
        v0 = (b * t * three_c) + 2 * c + h * d
        for j in range(offsets.size - 1):
            a = j * qblock
            e = min(a + qblock, t)
            m = e - a
            s = probs[u, offsets[j]:offsets[j] + m * e] if keep else scratch[:m * e]
            _block_scores(gemm, qkv, b, h, a, e, d, scale, zero, tiny, huge, s, sums)
            o0 = (b * t + a) * c + h * d
            _gemm(gemm, _NO_TRANS, _NO_TRANS, m, d, e, one, s.ctypes.data, e, base + v0 * size, three_c,
                 zero, obase + o0 * size, c)
            for r in range(m):
                rowsum[b, h, a + r, 0] = sums[r]
                o = out[b, a + r, h * d:(h + 1) * d]
                for i in range(d):
                    o[i] = o[i] / sums[r]


@jit
def attention_backward(gemm, qkv, g, n_head, scale, zero, qblock, offsets, u0, u1, grad, rowsum, probs,
                       keep, tiny, huge):
    """Units u0..u1-1 of dqkv = grad [B, T, 3 C] for dy = g [B, T, C], as
    cpu.attention.causal_attention_backward: with dY' = dY / l, per query block (last to first, so the
    first writes dK and dV whole and the others add to their leading rows) dV += E^T dY',
    dP' = dY' V^T, dS = E (dP' - rowsum(dP' E) / l), dQ = dS K scale, dK += dS^T Q scale."""
    t, three_c = qkv.shape[1], qkv.shape[2]
    c = three_c // 3
    d = c // n_head
    size = qkv.itemsize
    gy = np.empty(t * d, dtype=qkv.dtype)
    gs = np.empty(qblock * t, dtype=qkv.dtype)
    scratch = np.empty(qblock * t, dtype=qkv.dtype)
    sums = np.empty(qblock, dtype=qkv.dtype)
    one = np.ones(1, dtype=qkv.dtype)[0]
    base, gbase = qkv.ctypes.data, grad.ctypes.data
    nblocks = offsets.size - 1
    for u in range(u0, u1):
        b, h = u // n_head, u % n_head
        q0 = (b * t * three_c) + h * d
        for r in range(t):
            l_r = rowsum[b, h, r, 0]
            for i in range(d):
                gy[r * d + i] = g[b, r, h * d + i] / l_r
        for j in range(nblocks - 1, -1, -1):
            a = j * qblock
            e = min(a + qblock, t)
            m = e - a
            if keep:
                p = probs[u, offsets[j]:offsets[j] + m * e]
            else:
                p = scratch[:m * e]
                _block_scores(gemm, qkv, b, h, a, e, d, scale, zero, tiny, huge, p, sums)
            beta = zero if e == t else one
            pp, gya, gsp = p.ctypes.data, gy.ctypes.data + a * d * size, gs.ctypes.data
            _gemm(gemm, _TRANS, _NO_TRANS, e, d, m, one, pp, e, gya, d, beta,
                 gbase + (q0 + 2 * c) * size, three_c)                                   # dV[:e] += E^T dY'
            _gemm(gemm, _NO_TRANS, _TRANS, m, e, d, one, gya, d, base + (q0 + 2 * c) * size, three_c,
                 zero, gsp, e)                                                            # dP' = dY' V^T
            for r in range(m):
                grow = gs[r * e:(r + 1) * e]
                prow = p[r * e:(r + 1) * e]
                delta = _row_dot(grow, prow, zero) / rowsum[b, h, a + r, 0]
                for i in range(e):
                    grow[i] = (grow[i] - delta) * prow[i]
            _gemm(gemm, _NO_TRANS, _NO_TRANS, m, d, e, scale, gsp, e, base + (q0 + c) * size, three_c,
                 zero, gbase + (q0 + a * three_c) * size, three_c)                       # dQ = dS K scale
            _gemm(gemm, _TRANS, _NO_TRANS, e, d, m, scale, gsp, e, base + (q0 + a * three_c) * size,
                 three_c, beta, gbase + (q0 + c) * size, three_c)                        # dK[:e] += dS^T Q scale
