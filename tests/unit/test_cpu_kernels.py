"""The cache-blocked CPU kernels (hpcpar/backend/cpu/) against the plain NumPy formulas.

Elementwise and row-wise results must be bitwise those of the unblocked composition (same
operations on each element in the same order), whatever the block size and the thread count; the
attention against a dense [T, T] softmax reference (1e-12 in float64: its sums run over fewer
keys); and a row's result must not depend on which other rows, heads or samples share the call
(what lets every mesh reproduce the single-process model).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from hpcpar.backend import kernel_pool
from hpcpar.backend.cpu import adamw, attention, bias, blocks, cross_entropy, gelu, layer_norm
from hpcpar.backend.precision import down, up

RNG = np.random.default_rng(7)


try:
    import numba  # noqa: F401
    LOOPS = ["numpy", "numba"]
except ImportError:
    LOOPS = ["numpy"]


@pytest.fixture(params=LOOPS)
def loops(request, monkeypatch):
    """Each test with the NumPy chains, and with Numba's compiled loops when the `fast` extra is in."""
    if request.param == "numpy":
        monkeypatch.setattr(blocks, "_jit_module", False)
    else:
        from hpcpar.backend.jit import kernels as jit_kernels
        monkeypatch.setattr(blocks, "_jit_module", jit_kernels)
    return request.param


@pytest.fixture(params=[(1, None), (3, 4096)], ids=["1-thread", "3-threads-small-blocks"])
def blocking(request, monkeypatch, loops):
    """Run each test with one thread and default blocks, and with three threads and tiny blocks (with
    either kind of loops)."""
    threads, block = request.param
    kernel_pool.set_threads(threads)
    if block:
        monkeypatch.setattr(blocks, "BLOCK_BYTES", block)
        monkeypatch.setattr(attention, "ATTENTION_BYTES", block)
    yield loops
    kernel_pool.set_threads(None)


C_GELU = math.sqrt(2.0 / math.pi)


def gelu_reference(x):
    t = x * x
    t *= 0.044715
    t += 1.0
    t *= x
    t *= C_GELU
    np.tanh(t, out=t)
    y = t + 1.0
    y *= x
    y *= 0.5
    return y, t


def gelu_grad_reference(x, t, g):
    x2 = x * x
    x2 *= 3 * 0.044715
    x2 += 1.0
    x2 *= C_GELU
    s = 1.0 - t * t
    s *= x
    s *= x2
    s += t
    s += 1.0
    s *= 0.5
    s *= g
    return s


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gelu_is_bitwise_the_plain_formula(blocking, dtype):
    x = RNG.standard_normal((5, 37, 24)).astype(dtype)
    g = RNG.standard_normal(x.shape).astype(dtype)
    y, t = gelu.gelu_forward(x)
    ry, rt = gelu_reference(x)
    assert y.dtype == dtype and np.array_equal(y, ry) and np.array_equal(t, rt)
    assert np.array_equal(gelu.gelu_backward(x, t, g), gelu_grad_reference(x, rt, g))
    assert np.array_equal(gelu.gelu_backward(x, None, g), gelu_grad_reference(x, rt, g))  # t recomputed


def test_gelu_in_16_bits_computes_in_float32_and_rounds_once(blocking):
    x = down(RNG.standard_normal((7, 33)).astype(np.float32), np.dtype("bfloat16"))
    g = down(RNG.standard_normal(x.shape).astype(np.float32), np.dtype("bfloat16"))
    y, t = gelu.gelu_forward(x, keep_tanh=False)
    ry, rt = gelu_reference(up(x))
    assert t is None and y.dtype == x.dtype and np.array_equal(y, down(ry, x.dtype))
    assert np.array_equal(gelu.gelu_backward(x, None, g), down(gelu_grad_reference(up(x), rt, up(g)), x.dtype))


def row_mean(a, b=None):
    """Row means as the kernels take them: einsum's row sums (of a, or of a * b) over the count."""
    c = a.shape[-1]
    s = np.einsum("...j->...", a) if b is None else np.einsum("...j,...j->...", a, b)
    return s[..., None] / c


def layer_norm_reference(x, w, b, eps):
    mu = row_mean(x)
    xhat = x - mu
    var = row_mean(xhat, xhat)
    rstd = 1.0 / np.sqrt(var + eps)
    xhat *= rstd
    out = xhat * w
    out += b
    return out, xhat, rstd


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_layer_norm_is_bitwise_the_plain_formula(blocking, dtype):
    """The NumPy chain bitwise; Numba's loops add each row in eight lanes instead: equal to rounding.
    The backward's passes (dx and the weight's sums together, or each alone) give the same bits."""
    x = (RNG.standard_normal((3, 41, 16)) * 3 + 1).astype(dtype)
    w, b = RNG.standard_normal(16).astype(dtype), RNG.standard_normal(16).astype(dtype)
    g = RNG.standard_normal(x.shape).astype(dtype)
    y, mean, rstd = layer_norm.layer_norm_forward(x, w, b, 1e-5)
    ry, rxhat, rrstd = layer_norm_reference(x, w, b, 1e-5)
    gxhat = g * w
    rgx = gxhat - row_mean(gxhat)
    rgx -= rxhat * row_mean(gxhat, rxhat)
    rgx *= rrstd
    gx, dw, db = layer_norm.layer_norm_backward(x, w, mean, rstd, g, True, True, True)
    if blocking == "numpy":
        assert np.array_equal(y, ry) and np.array_equal(rstd.reshape(rrstd.shape), rrstd)
        assert np.array_equal(gx, rgx)
    else:
        tol = 1e-12 if dtype == np.float64 else 2e-5
        for got, want in ((y, ry), (rstd.reshape(rrstd.shape), rrstd), (gx, rgx)):
            np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    rows = (g * rxhat).reshape(-1, 16)
    tol = 1e-12 if dtype == np.float64 else 1e-5
    np.testing.assert_allclose(dw, rows.sum(axis=0), rtol=tol, atol=tol)
    np.testing.assert_allclose(db, g.reshape(-1, 16).sum(axis=0), rtol=tol, atol=tol)
    alone_dx = layer_norm.layer_norm_backward(x, w, mean, rstd, g, True, False, True)
    alone_dw = layer_norm.layer_norm_backward(x, w, mean, rstd, g, False, True, True)
    assert alone_dx[1] is None and alone_dw[0] is None and alone_dw[2] is not None
    assert np.array_equal(alone_dx[0], gx) and np.array_equal(alone_dw[1], dw) and np.array_equal(alone_dw[2], db)
    assert layer_norm.layer_norm_backward(x, w, mean, rstd, g, False, True, False)[2] is None


def test_layer_norm_rows_do_not_depend_on_their_neighbours(loops):
    x, g = RNG.standard_normal((37, 24)), RNG.standard_normal((37, 24))
    w, b = RNG.standard_normal(24), RNG.standard_normal(24)
    y, mean, rstd = layer_norm.layer_norm_forward(x, w, b, 1e-5)
    gx = layer_norm.layer_norm_backward(x, w, mean, rstd, g, True, False, True)[0]
    for rows in (slice(5, 6), slice(10, 31)):
        y1, m1, r1 = layer_norm.layer_norm_forward(x[rows], w, b, 1e-5)
        assert np.array_equal(y1, y[rows])
        assert np.array_equal(layer_norm.layer_norm_backward(x[rows], w, m1, r1, g[rows], True, False, True)[0], gx[rows])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_layer_norm_does_not_depend_on_threads(monkeypatch, loops, dtype):
    """Every output bitwise the same on 1, 2 and 5 threads (with Numba the passes run as compiled
    tasks on the kernel threads, a run of whole blocks each; the weight's partial sums are the
    blocks'), with blocks that do not divide the rows."""
    x, g = RNG.standard_normal((300, 8)).astype(dtype), RNG.standard_normal((300, 8)).astype(dtype)
    w, b = RNG.standard_normal(8).astype(dtype), RNG.standard_normal(8).astype(dtype)
    monkeypatch.setattr(blocks, "BLOCK_BYTES", 256)
    results = []
    for threads in (1, 2, 5):
        kernel_pool.set_threads(threads)
        y, mean, rstd = layer_norm.layer_norm_forward(x, w, b, 1e-5)
        results.append((y, mean, rstd) + layer_norm.layer_norm_backward(x, w, mean, rstd, g, True, True, True))
    kernel_pool.set_threads(None)
    assert all(np.array_equal(a, c) for r in results[1:] for a, c in zip(r, results[0]))


def test_layer_norm_in_16_bits_keeps_the_statistics_and_rebuilds_xhat(blocking):
    x = down((RNG.standard_normal((9, 16)) * 2).astype(np.float32), np.dtype("float16"))
    w, b = RNG.standard_normal(16).astype(np.float32), RNG.standard_normal(16).astype(np.float32)
    g = down(RNG.standard_normal(x.shape).astype(np.float32), np.dtype("float16"))
    y, mean, rstd = layer_norm.layer_norm_forward(x, w, b, 1e-5)
    ry, rxhat, _ = layer_norm_reference(up(x), w, b, 1e-5)
    assert mean.dtype == rstd.dtype == np.float32 and np.array_equal(y, down(ry, x.dtype))
    stats = layer_norm.layer_norm_forward(up(x), w, b, 1e-5)[1:]
    full = layer_norm.layer_norm_backward(up(x), w, *stats, up(g), True, False, True)[0]
    assert np.array_equal(layer_norm.layer_norm_backward(x, w, mean, rstd, g, True, False, True)[0], down(full, x.dtype))


def attention_reference(qkv, n_head):
    """Dense causal attention in float64 and its gradient function (the textbook formulas)."""
    b, t, three_c = qkv.shape
    d = three_c // 3 // n_head
    q, k, v = qkv.reshape(b, t, 3, n_head, d).transpose(2, 0, 3, 1, 4)
    s = q @ k.swapaxes(-1, -2) / math.sqrt(d) + np.triu(np.full((t, t), -np.inf), k=1)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    y = p @ v

    def grad(gy):
        gy = gy.reshape(b, t, n_head, d).transpose(0, 2, 1, 3)
        dv = p.swapaxes(-1, -2) @ gy
        dp = gy @ v.swapaxes(-1, -2)
        ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True)) / math.sqrt(d)
        dq, dk = ds @ k, ds.swapaxes(-1, -2) @ q
        return np.stack([dq, dk, dv]).transpose(1, 3, 0, 2, 4).reshape(b, t, three_c)
    return y.transpose(0, 2, 1, 3).reshape(b, t, n_head * d), grad


@pytest.mark.parametrize("t", [1, 5, 64, 130])
def test_attention_equals_the_dense_reference(blocking, t):
    qkv = RNG.standard_normal((3, t, 3 * 4 * 6))
    g = RNG.standard_normal((3, t, 4 * 6))
    y, saved = attention.causal_attention_forward(qkv, 4)
    ry, rgrad = attention_reference(qkv, 4)
    np.testing.assert_allclose(y, ry, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(attention.causal_attention_backward(qkv, 4, saved, g), rgrad(g), rtol=1e-11, atol=1e-12)


needs_numba = pytest.mark.skipif("numba" not in LOOPS, reason="the compiled kernels need the `fast` extra")


@needs_numba
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_compiled_exp_is_within_an_ulp(dtype):
    """jit_attention's vectorized exp against float64's exp over the range softmax meets, and at the
    edges: NaN stays NaN, overflow gives inf, underflow below the smallest normal number gives 0."""
    from hpcpar.backend.jit import attention
    x = np.concatenate([RNG.uniform(-80, 80, 200_000), RNG.standard_normal(10_000)]).astype(dtype)
    y = x.copy()
    attention._exp_row(y, y.size)
    exact = np.exp(x.astype(np.float64))
    assert np.max(np.abs(y - exact) / exact) <= 1.5 * np.finfo(dtype).eps
    edges = np.array([np.nan, np.inf, -np.inf, 1e4, -1e4, 0.0], dtype=dtype)
    attention._exp_row(edges, edges.size)
    assert np.isnan(edges[0]) and edges[1] == np.inf and edges[2] == 0 and edges[3] == np.inf
    assert edges[4] == 0 and edges[5] == 1


@needs_numba
def test_compiled_attention_with_the_openblas_gemm_equals_the_reference(monkeypatch):
    """The compiled attention through the OpenBLAS in NumPy's wheel (used when MKL is not installed)
    as well as through MKL: the dense reference, 1e-12 in float64."""
    from hpcpar.backend import blas
    import ctypes
    fn = blas._numpy_openblas("scipy_cblas_dgemm64_", "cblas_dgemm64_", argtypes=None)
    if fn is None:
        pytest.skip("this NumPy bundles no ILP64 OpenBLAS")
    monkeypatch.setattr(blocks, "_jit_module", None)
    monkeypatch.setattr(blas, "compiled_gemm", lambda dtype: ctypes.cast(fn, ctypes.c_void_p).value)
    qkv = RNG.standard_normal((3, 70, 3 * 4 * 6))
    g = RNG.standard_normal((3, 70, 4 * 6))
    y, saved = attention.causal_attention_forward(qkv, 4)
    assert saved.compiled
    ry, rgrad = attention_reference(qkv, 4)
    np.testing.assert_allclose(y, ry, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(attention.causal_attention_backward(qkv, 4, saved, g), rgrad(g), rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_attention_rows_whose_exponentials_leave_the_range_are_recomputed_shifted(dtype):
    """Scores in the thousands overflow exp (and below -1000 underflow it) unshifted: those rows are
    computed again with their row maximum subtracted and match the reference."""
    qkv = RNG.standard_normal((2, 70, 3 * 2 * 4))
    qkv[0, :, :8] *= 3000.0                       # sample 0's queries: scores of +-thousands
    g = RNG.standard_normal((2, 70, 8))
    y, saved = attention.causal_attention_forward(qkv.astype(dtype), 2)
    ry, rgrad = attention_reference(qkv.astype(dtype).astype(np.float64), 2)
    tol = 1e-10 if dtype == np.float64 else 2e-3
    assert np.isfinite(y).all()
    np.testing.assert_allclose(y, ry, rtol=tol, atol=tol)
    grad = attention.causal_attention_backward(qkv.astype(dtype), 2, saved, g.astype(dtype))
    scale = np.abs(rgrad(g)).max()
    np.testing.assert_allclose(grad / scale, rgrad(g) / scale, atol=tol * 10)


def test_attention_rows_do_not_depend_on_their_batch_or_heads_or_threads(loops):
    """A sample's and a head's results are the same bits alone or among others (dp, tp, threads)."""
    qkv = RNG.standard_normal((5, 130, 3 * 4 * 8))
    g = RNG.standard_normal((5, 130, 4 * 8))
    y, saved = attention.causal_attention_forward(qkv, 4)
    grad = attention.causal_attention_backward(qkv, 4, saved, g)
    alone = qkv[3:4]
    y1, saved1 = attention.causal_attention_forward(alone, 4)
    assert np.array_equal(y1, y[3:4])
    assert np.array_equal(attention.causal_attention_backward(alone, 4, saved1, g[3:4]), grad[3:4])
    # Heads 2..3 alone (a tensor-parallel rank's share): c_attn's per-head blocks of q, k and v.
    heads = qkv.reshape(5, 130, 3, 4, 8)[:, :, :, 2:].reshape(5, 130, 3 * 2 * 8)
    yh, savedh = attention.causal_attention_forward(heads, 2)
    assert np.array_equal(yh, y.reshape(5, 130, 4, 8)[:, :, 2:].reshape(5, 130, 16))
    gh = attention.causal_attention_backward(heads, 2, savedh, g.reshape(5, 130, 4, 8)[:, :, 2:].reshape(5, 130, 16))
    assert np.array_equal(gh, grad.reshape(5, 130, 3, 4, 8)[:, :, :, 2:].reshape(5, 130, 48))
    kernel_pool.set_threads(3)
    try:
        y3, saved3 = attention.causal_attention_forward(qkv, 4)
        assert np.array_equal(y3, y) and np.array_equal(attention.causal_attention_backward(qkv, 4, saved3, g), grad)
    finally:
        kernel_pool.set_threads(None)


def test_attention_recomputed_probabilities_give_the_same_bits(blocking):
    qkv = RNG.standard_normal((2, 70, 3 * 2 * 4)).astype(np.float32)
    g = RNG.standard_normal((2, 70, 8)).astype(np.float32)
    kept = attention.causal_attention_forward(qkv, 2, keep_probs=True)
    again = attention.causal_attention_forward(qkv, 2, keep_probs=False)
    assert np.array_equal(kept[0], again[0]) and again[1].probs is None
    assert np.array_equal(attention.causal_attention_backward(qkv, 2, kept[1], g),
                          attention.causal_attention_backward(qkv, 2, again[1], g))


def test_attention_in_16_bits_tracks_float32(blocking):
    qkv32 = RNG.standard_normal((2, 66, 3 * 2 * 8)).astype(np.float32)
    qkv = down(qkv32, np.dtype("bfloat16"))
    g = down(RNG.standard_normal((2, 66, 16)).astype(np.float32), np.dtype("bfloat16"))
    y, saved = attention.causal_attention_forward(qkv, 2)
    ry, rgrad = attention_reference(up(qkv).astype(np.float64), 2)
    assert y.dtype == qkv.dtype
    np.testing.assert_allclose(up(y), ry, atol=3e-2)
    grad = attention.causal_attention_backward(qkv, 2, saved, g)
    np.testing.assert_allclose(up(grad), rgrad(up(g).astype(np.float64)), atol=6e-2)


def test_cross_entropy_is_the_plain_formula(blocking):
    z = RNG.standard_normal((50, 11))
    t = RNG.integers(0, 11, 50)
    valid = RNG.random(50) > 0.2
    safe = np.where(valid, t, 0)
    nll, probs, total = cross_entropy.cross_entropy_forward(z, safe, valid)
    shifted = z - z.max(axis=1, keepdims=True)
    e = np.exp(shifted)
    assert np.array_equal(total, e.sum(axis=1))
    assert np.array_equal(nll, (np.log(e.sum(axis=1)) - shifted[np.arange(50), safe]) * valid)
    coef = valid * 0.37
    expected = e / e.sum(axis=1)[:, None]
    expected[np.arange(50), safe] -= 1.0
    expected *= coef[:, None]
    assert np.array_equal(cross_entropy.cross_entropy_backward(probs, total, safe, coef), expected)


@pytest.mark.parametrize("contiguous", [True, False])
def test_adamw_is_the_order_of_the_formula(blocking, contiguous):
    shape = (40, 30)
    p, g, m, v = (RNG.standard_normal(shape) for _ in range(4))
    v = np.abs(v)
    ref = [a.copy() for a in (p, g, m, v)]
    if not contiguous:
        p, g, m, v = (np.asfortranarray(a) for a in (p, g, m, v))
    small = [a.copy() for a in (p, g, m, v)]  # a second, small parameter in the same call
    adamw.adamw_update([(p, g, m, v, 0.99), tuple(small) + (1.0,)], 0.9, 0.95, 1e-8, 0.01, 1.3)
    rp, rg, rm, rv = ref
    rp *= 0.99
    rv *= 0.95
    rv += rg * rg * (1 - 0.95)
    rm *= 0.9
    rm += rg * (1 - 0.9)
    rp += rm / (np.sqrt(rv) * 1.3 + 1e-8) * -0.01
    np.testing.assert_array_equal(m, rm)
    np.testing.assert_array_equal(v, rv)
    np.testing.assert_allclose(p, rp, rtol=1e-15)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_adamw_gives_the_same_bits_on_any_thread_count_and_follows_new_arrays(loops, dtype):
    """With the compiled loops the step runs as tasks over all parameters' elements (equal runs per
    thread) from a table of addresses kept while the same arrays come back: the bits of the NumPy
    chain on 1, 2 and 5 threads, and a call with other arrays (the same count) updates those, not
    the arrays of the table before."""
    def params():
        out = []
        for shape in ((300, 7), (5,), (1000, 40), (3,)):
            p, g, m, v = (RNG.standard_normal(shape).astype(dtype) for _ in range(4))
            out.append([p, g, m, np.abs(v)])
        return out

    def reference(ps, decays):
        ref = [[a.copy() for a in p] for p in ps]
        for (p, g, m, v), d in zip(ref, decays):
            adamw._adamw_block(p, g, m, v, d, 0.9, 0.95, 1e-8, 0.01, 1.3)
        return ref
    decays = [0.99, 1.0, 0.98, 1.0]
    first = params()
    want_first = reference(first, decays)
    for threads in (1, 2, 5):
        kernel_pool.set_threads(threads)
        ps = [[a.copy() for a in p] for p in first]
        adamw.adamw_update([(*p, d) for p, d in zip(ps, decays)], 0.9, 0.95, 1e-8, 0.01, 1.3)
        assert all(np.array_equal(a, b) for p, q in zip(ps, want_first) for a, b in zip(p, q))
        before = [[a.copy() for a in p] for p in ps]
        other = params()
        want_other = reference(other, decays)
        adamw.adamw_update([(*p, d) for p, d in zip(other, decays)], 0.9, 0.95, 1e-8, 0.01, 1.3)
        assert all(np.array_equal(a, b) for p, q in zip(other, want_other) for a, b in zip(p, q))
        assert all(np.array_equal(a, b) for p, q in zip(ps, before) for a, b in zip(p, q))
    kernel_pool.set_threads(None)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_bias_add_and_column_sums_give_the_same_bits_on_any_thread_count(loops, monkeypatch, dtype):
    """A linear's bias add (elementwise) and its gradient's column sums (per-block sums added in block
    order) on 1, 2 and 5 threads, with blocks that do not divide the rows (row tasks on the kernel
    threads with the compiled loops): the same bits, equal to NumPy's to rounding."""
    monkeypatch.setattr(blocks, "BLOCK_BYTES", 512)
    a = RNG.standard_normal((301, 24)).astype(dtype)
    b = RNG.standard_normal(24).astype(dtype)
    results = []
    for threads in (1, 2, 5):
        kernel_pool.set_threads(threads)
        y = a.copy()
        bias.add_bias(y, b)
        results.append((y, bias.column_sums(a)))
    kernel_pool.set_threads(None)
    assert np.array_equal(results[0][0], a + b)
    tol = 1e-12 if dtype == np.float64 else 1e-5
    np.testing.assert_allclose(results[0][1], a.sum(axis=0), rtol=tol, atol=tol)
    assert all(np.array_equal(x, y) for r in results[1:] for x, y in zip(r, results[0]))


def test_kept_probabilities_count_the_causal_blocks():
    assert attention.kept_probabilities(128) == 64 * 64 + 64 * 128
    assert attention.kept_probabilities(5) == 25
    qkv = RNG.standard_normal((2, 130, 3 * 3 * 2))
    _, saved = attention.causal_attention_forward(qkv, 3)
    assert sum(p.size for p in saved.probs) == 2 * 3 * attention.kept_probabilities(130)


@pytest.mark.parametrize("dtype", [np.float64, np.dtype("bfloat16")])
def test_fused_bias_gelu_equals_the_separate_ops(blocking, dtype):
    """linear(..., activation="gelu") against ops.gelu(linear(...)): the same values and
    gradients (bitwise but for the bias gradient's summation order)."""
    from hpcpar.autograd import ops
    from hpcpar.autograd.linear import linear
    from hpcpar.autograd.tensor import Tensor
    x0 = down(RNG.standard_normal((3, 37, 8)), np.dtype(dtype)) if dtype != np.float64 else RNG.standard_normal((3, 37, 8))
    w0, b0 = RNG.standard_normal((24, 8)) * 0.3, RNG.standard_normal(24) * 0.3
    g = RNG.standard_normal((3, 37, 24)).astype(x0.dtype)
    outs = []
    for fused in (False, True):
        x, w, b = Tensor(x0.copy(), True), Tensor(w0.copy(), True), Tensor(b0.copy(), True)
        y = linear(x, w, b, activation="gelu") if fused else ops.gelu(linear(x, w, b))
        y.backward(g)
        outs.append((y.data, x.grad, w.grad, b.grad))
    (y1, gx1, gw1, gb1), (y2, gx2, gw2, gb2) = outs
    assert y2.dtype == y1.dtype and np.array_equal(y1, y2)
    assert np.array_equal(gx1, gx2) and np.array_equal(gw1, gw2)
    np.testing.assert_allclose(gb2, gb1, rtol=1e-12 if dtype == np.float64 else 1e-6, atol=1e-12)
