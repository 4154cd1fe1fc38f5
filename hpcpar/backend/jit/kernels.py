"""Compiled loops for the CPU kernels' blocks (Numba), when the `fast` extra is installed.

`backend/cpu/` runs each op as a chain of NumPy calls over cache-sized blocks; a chain of ten
calls reads and writes its block ten times and holds the GIL between calls. Here the arithmetic of
a chain is one loop per block, compiled once (Numba, cached on disk) and run without the GIL, so
the kernel pool's threads compute at once: GELU's backward and AdamW's update 2.5-4x faster per
thread, LayerNorm 2-3x. Transcendentals stay NumPy's (its SIMD tanh and exp; Numba's are scalar
libm calls, several times slower): GELU's forward is u = poly(x) here, tanh(u) in NumPy, then
y = 0.5 x (1 + t) here. The exception is `exp32`/`exp64`, a range reduction and a polynomial that
vectorize (within an ulp), for the compiled attention (jit.attention), which runs without NumPy;
and `gemm`, a call of the BLAS's ILP64 `cblas_?gemm` from compiled code (jit.attention, jit.pool).

Each elementwise loop performs the NumPy chain's operations on each element in the same order
with the same constants (rounded to the array's dtype, as NumPy does with a Python float), so
GELU and AdamW give the NumPy path's bits. LayerNorm's row sums run in eight interleaved lanes
instead of einsum's order: equal to rounding. The gradient norm's sum of squares is vectorized by
LLVM in its own lane order (reassociation allowed in that sum alone: 4x faster than eight scalar
lanes), fixed by the array's length and the build. Float32 and float64 arrays only (16-bit activations
take the NumPy path). This module imports Numba: `cpu.blocks` imports it on first use, and goes
without it when Numba is not installed or HPCPAR_JIT=0.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

jit = numba.njit(nogil=True, cache=True, error_model="numpy")

@intrinsic
def _as_float(typingctx, bits):
    """The float whose bits are `bits`: int32 -> float32, int64 -> float64 (LLVM's bitcast)."""
    target = {types.int32: types.float32, types.int64: types.float64}.get(bits)
    if target is None:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(target))
    return target(bits), codegen


_ROW_MAJOR = 101


@intrinsic
def gemm(typingctx, address, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):
    """cblas_?gemm(row-major, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc) through
    the function at `address` (blas.compiled_gemm: ILP64, so 64-bit dimensions); a, b, c are the
    matrices' addresses, alpha and beta in the matrices' dtype (float32: sgemm, float64: dgemm).
    Taking the address as data (not a ctypes object) keeps the kernels cacheable and their calls
    free of per-call typing."""
    if alpha not in (types.float32, types.float64) or beta != alpha:
        return None
    i64, i32 = types.int64, types.int32
    sig = types.void(i64, i32, i32, i64, i64, i64, alpha, i64, i64, i64, i64, alpha, i64, i64)

    def codegen(context, builder, signature, args):
        i32_t, i64_t, ptr = ir.IntType(32), ir.IntType(64), ir.IntType(8).as_pointer()
        f = context.get_value_type(alpha)
        fnty = ir.FunctionType(ir.VoidType(), [i32_t, i32_t, i32_t, i64_t, i64_t, i64_t, f, ptr, i64_t, ptr, i64_t,
                                              f, ptr, i64_t])
        fn = builder.inttoptr(args[0], fnty.as_pointer())
        (_, ta, tb, m_, n_, k_, al, pa, la, pb, lb, be, pc, lc) = args
        builder.call(fn, [ir.Constant(i32_t, _ROW_MAJOR), ta, tb, m_, n_, k_, al, builder.inttoptr(pa, ptr), la,
                          builder.inttoptr(pb, ptr), lb, be, builder.inttoptr(pc, ptr), lc])
        return context.get_dummy_value()
    return sig, codegen


# exp(g) = sum g^k / k!, |g| <= ln(2) / 2: the Taylor coefficients 1 / k!, k = 2..13.
_C = tuple(1.0 / float(np.prod(np.arange(1, k + 1))) for k in range(2, 14))
# ln 2 = hi + lo with hi's few significant bits, so r hi is exact for the r that occur (Cody and
# Waite): the reduced argument g = (x - r hi) - r lo is then good to an ulp of g.
_LN2_HI32, _LN2_LO32 = 0.693359375, -2.12194440e-4
_LN2_HI64, _LN2_LO64 = 6.93147180369123816490e-01, 1.90821492927058770002e-10
_C32 = tuple(np.float32(c) for c in _C[:6])


@numba.njit(nogil=True, cache=True, error_model="numpy", inline="always")
def exp32(x):
    """exp of a float32 as 2^r exp(g), r = round(x / ln 2), g = x - r ln 2 (exp(g) a Taylor
    polynomial of degree 7, truncation 5e-9): within an ulp of the exact value, and a loop of it
    vectorizes (libm's expf is a scalar call, 4x slower than NumPy's SIMD exp). NaN stays NaN;
    x / ln 2 above 127 gives inf or a finite value far too large (callers treat both as overflow),
    below -126 gives 0."""
    c2, c3, c4, c5, c6, c7 = _C32
    t = x * np.float32(1.4426950408889634)
    t = np.float32(127.0) if t > np.float32(127.0) else t
    under = t < np.float32(-126.0)
    t = np.float32(-126.0) if under else t
    r = (t + np.float32(12582912.0)) - np.float32(12582912.0)          # 1.5 2^23: rounds to an integer
    g = (x - r * np.float32(_LN2_HI32)) - r * np.float32(_LN2_LO32)
    p = ((((((c7 * g + c6) * g + c5) * g + c4) * g + c3) * g + c2) * g + np.float32(1.0)) * g + np.float32(1.0)
    y = p * _as_float(np.int32((np.int32(r) + np.int32(127)) << np.int32(23)))
    y = np.float32(0.0) if under else y
    return x if x != x else y


@numba.njit(nogil=True, cache=True, error_model="numpy", inline="always")
def exp64(x):
    """exp32's float64 twin: exp(g) of degree 13 (truncation 4e-18), r in [-1022, 1023]."""
    c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13 = _C
    t = x * 1.4426950408889634
    t = 1023.0 if t > 1023.0 else t
    under = t < -1022.0
    t = -1022.0 if under else t
    r = (t + 6755399441055744.0) - 6755399441055744.0                  # 1.5 2^52
    g = (x - r * _LN2_HI64) - r * _LN2_LO64
    p = c13 * g + c12
    p = p * g + c11
    p = p * g + c10
    p = p * g + c9
    p = p * g + c8
    p = p * g + c7
    p = p * g + c6
    p = p * g + c5
    p = p * g + c4
    p = p * g + c3
    p = p * g + c2
    p = p * g + 1.0
    p = p * g + 1.0
    y = p * _as_float(np.int64((np.int64(r) + np.int64(1023)) << np.int64(52)))
    y = 0.0 if under else y
    return x if x != x else y


# Every constant comes in as an argument of the arrays' dtype (the CPU kernels make them): a literal
# would make Numba compute a float32 expression in float64 and round once, not as NumPy does.


@jit
def gelu_inner(x, t, a, one, c):
    """t = ((x x a + 1) x) c: tanh's argument (1-D blocks)."""
    for i in range(x.size):
        v = x[i]
        t[i] = ((v * v * a + one) * v) * c


@jit
def gelu_outer(x, t, o, one, half):
    """o = (t + 1) x 0.5 from t = tanh(..)."""
    for i in range(x.size):
        o[i] = (t[i] + one) * x[i] * half


@jit
def gelu_grad(x, t, g, s, a3, one, c, half):
    """s = g (0.5 (1 + t) + 0.5 x (1 - t^2) c (1 + 3 a x^2)) in cpu.gelu._gelu_grad's order."""
    for i in range(x.size):
        v = x[i]
        tt = t[i]
        x2 = (v * v * a3 + one) * c
        s[i] = ((((one - tt * tt) * v) * x2 + tt) + one) * half * g[i]


@jit
def add_bias_rows(y, b):
    """y [n, c] += b [c] in place."""
    n, c = y.shape
    for i in range(n):
        for j in range(c):
            y[i, j] += b[j]


@jit
def adamw(p, g, m, v, scale, decay, b1, b2, one_minus_b1, one_minus_b2, eps, neg_step, inv_bias2_sqrt):
    """One AdamW step in place, in optim.optimizers.AdamW's order; `scale` says whether to decay."""
    for i in range(p.size):
        pi = p[i] * decay if scale else p[i]
        gi = g[i]
        vi = v[i] * b2 + gi * gi * one_minus_b2
        mi = m[i] * b1 + gi * one_minus_b1
        v[i] = vi
        m[i] = mi
        p[i] = pi + mi / (np.sqrt(vi) * inv_bias2_sqrt + eps) * neg_step


@jit
def _row_sum(a, zero):
    """Sum of a 1-D row in eight interleaved lanes (a fixed order, and SIMD-friendly); `zero` in a's dtype."""
    n = a.size
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = zero
    i = 0
    while i + 8 <= n:
        s0 += a[i]
        s1 += a[i + 1]
        s2 += a[i + 2]
        s3 += a[i + 3]
        s4 += a[i + 4]
        s5 += a[i + 5]
        s6 += a[i + 6]
        s7 += a[i + 7]
        i += 8
    total = ((s0 + s4) + (s1 + s5)) + ((s2 + s6) + (s3 + s7))
    while i < n:
        total += a[i]
        i += 1
    return total


# The gradient norm's sum of squares with reassociation allowed: LLVM then vectorizes it in its own
# lane order (4x faster than eight scalar lanes), fixed by the array's length and this build. Only
# that sum carries the flag.
_sum_jit = numba.njit(nogil=True, cache=True, error_model="numpy", fastmath={"reassoc"})


@numba.njit(nogil=True, cache=True, error_model="numpy", inline="always")
def _private(c, like):
    """A zeroed work array of c values of `like`'s dtype, 128 bytes clear of any other allocation on
    both sides: two threads' work arrays allocated at the same time may otherwise share a cache line
    that both write row after row (measured: a LayerNorm pass on two threads then ran slower than on
    one)."""
    pad = 128 // like.itemsize
    return np.zeros(c + 2 * pad, dtype=like.dtype)[pad:pad + c]


@jit
def layer_norm_forward(x, w, b, has_bias, consts, out, mean, rstd):
    """Rows of x [n, c]: mean [n, 1], 1/std rstd [n, 1], out = (x - mean) rstd w (+ b when has_bias).
    consts [2]: c and eps in x's dtype."""
    n, c = x.shape
    width, eps = consts[0], consts[1]
    zero = width - width
    one = width / width
    d = _private(c, x)
    sq = _private(c, x)
    for i in range(n):
        mu = _row_sum(x[i], zero) / width
        for j in range(c):
            d[j] = x[i, j] - mu
            sq[j] = d[j] * d[j]
        rs = one / np.sqrt(_row_sum(sq, zero) / width + eps)
        mean[i, 0] = mu
        rstd[i, 0] = rs
        for j in range(c):
            o = d[j] * rs * w[j]
            out[i, j] = o + b[j] if has_bias else o


@jit
def layer_norm_backward(x, w, mean, rstd, g, consts, dx, dw, db, want_dx, want_dw, has_bias, block_rows):
    """LayerNorm's gradients for rows of x [n, c] (saved mean, rstd [n, 1]; output gradient g [n, c];
    xhat = (x - mean) rstd rebuilt per row): dx [n, c] = (g w - mean(g w) - xhat mean(g w xhat)) rstd
    when want_dx; when want_dw, for each block of `block_rows` rows its partial sums dw[k] [c] of
    g xhat and db[k] of g (db when has_bias), row by row. consts [2]: c (and eps) in x's dtype."""
    n, c = x.shape
    width = consts[0]
    zero = width - width
    gw, gwx, xh = _private(c, x), _private(c, x), _private(c, x)
    # The block's sums build up in this thread's own arrays and are stored once per block: rows of dw
    # next to each other share a cache line at their ends, which two threads adding row by row into
    # neighbouring blocks would pass back and forth.
    sum_w, sum_b = _private(c, x), _private(c, x)
    for i in range(n):
        gi = g[i]
        rs, mu = rstd[i, 0], mean[i, 0]
        for j in range(c):
            xh[j] = (x[i, j] - mu) * rs
        if want_dw:
            for j in range(c):
                sum_w[j] += gi[j] * xh[j]
            if has_bias:
                for j in range(c):
                    sum_b[j] += gi[j]
        if want_dx:
            for j in range(c):
                gw[j] = gi[j] * w[j]
                gwx[j] = gw[j] * xh[j]
            m1 = _row_sum(gw, zero) / width
            m2 = _row_sum(gwx, zero) / width
            for j in range(c):
                dx[i, j] = ((gw[j] - m1) - xh[j] * m2) * rs
        if want_dw:
            if (i + 1) % block_rows == 0 or i == n - 1:
                dw[i // block_rows, :] = sum_w
                sum_w[:] = zero
                if has_bias:
                    db[i // block_rows, :] = sum_b
                    sum_b[:] = zero


@jit
def softmax_grad_rows(gs, p, rowsum, has_rowsum, zero):
    """dS in place in gs [n, e] (the rows of attention blocks): delta = rowsum(gs p) (/ l when
    has_rowsum, l = rowsum[n]), then gs = (gs - delta) p; cpu.attention.causal_attention_backward."""
    n, e = gs.shape
    prod = np.empty(e, dtype=gs.dtype)
    for i in range(n):
        for j in range(e):
            prod[j] = gs[i, j] * p[i, j]
        delta = _row_sum(prod, zero)
        if has_rowsum:
            delta /= rowsum[i]
        for j in range(e):
            gs[i, j] = (gs[i, j] - delta) * p[i, j]


@jit
def column_sums_blocks(a, out, block_rows):
    """out [k] [c] = the sum over the rows of block k of a [n, c] (`block_rows` rows each), row by row
    (a bias's gradient in partial sums), built up in a private array and stored once per block."""
    n, c = a.shape
    acc = _private(c, a)
    for i in range(n):
        for j in range(c):
            acc[j] += a[i, j]
        if (i + 1) % block_rows == 0 or i == n - 1:
            out[i // block_rows, :] = acc
            acc[:] = 0


@_sum_jit
def sum_of_squares(a):
    """The sum of a's squares (1-D, float32 or float64) accumulated in float64, in the lanes LLVM
    vectorizes it into (reassociation allowed: 4-8x the eight scalar lanes' speed)."""
    s = 0.0
    for i in range(a.size):
        v = np.float64(a[i])
        s += v * v
    return s
