"""hpcpar.backend.blas.matmul: the same products as np.matmul for every operand layout the ops pass it.

With MKL loaded (the `mkl` extra) the products go through MKL's GEMM and batched GEMM; without it
through NumPy, and these tests still hold matmul to np.matmul (then trivially). They run on
whichever this environment has; `test_mkl_is_used_when_installed` says which.
"""

from __future__ import annotations

import importlib.metadata
import os

import numpy as np
import pytest

from hpcpar.backend import blas

RNG = np.random.default_rng(3)


@pytest.fixture(autouse=True)
def every_size_through_mkl(monkeypatch):
    """The products here are small: let MKL (when loaded) take them all, with fresh prepared calls."""
    monkeypatch.setattr(blas, "MIN_MKL_WORK", 0)
    monkeypatch.setattr(blas, "_prepared_gemms", {})


def heads(b=3, t=20, h=4, d=5):
    """q, k views [B, H, T, D] of a c_attn output [B, T, 3, H, D]: strided rows, heads apart by D."""
    qkv = RNG.standard_normal((b, t, 3, h, d))
    return qkv[:, :, 0].transpose(0, 2, 1, 3), qkv[:, :, 1].transpose(0, 2, 1, 3)


def cases():
    q, k = heads()
    w = RNG.standard_normal((6, 5))
    return {
        "plain": (RNG.standard_normal((7, 5)), RNG.standard_normal((5, 3))),
        "x @ W^T": (RNG.standard_normal((9, 5)), w.T),
        "g^T @ x": (RNG.standard_normal((9, 6)).T, RNG.standard_normal((9, 5))),
        "column block": (RNG.standard_normal((7, 12))[:, 2:7], RNG.standard_normal((5, 4))),
        "heads q k^T": (q, k.swapaxes(-1, -2)),
        "query block": (q[:, :, 3:9], k[:, :, :9].swapaxes(-1, -2)),
        "contiguous stack": (np.ascontiguousarray(q), np.ascontiguousarray(k.swapaxes(-1, -2))),
        "one head set": (q[1], k[1].swapaxes(-1, -2)),
        "stack @ matrix": (q, RNG.standard_normal((5, 2))),
        "single row": (RNG.standard_normal((1, 5)), RNG.standard_normal((5, 3))),
        "single column": (RNG.standard_normal((4, 5)), RNG.standard_normal((5, 1))),
    }


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("case", sorted(cases()))
def test_matmul_equals_numpy(case, dtype):
    a, b = cases()[case]
    a, b = a.astype(dtype, copy=False), b.astype(dtype, copy=False)
    got, want = blas.matmul(a, b), np.matmul(a, b)
    assert got.shape == want.shape and got.dtype == want.dtype
    tol = 1e-12 if dtype == np.float64 else 1e-5
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


def test_matmul_writes_into_out_views():
    q, k = heads()
    scores = np.empty((3, 4, 20, 20))
    assert blas.matmul(q, k.swapaxes(-1, -2), out=scores) is scores
    np.testing.assert_allclose(scores, q @ k.swapaxes(-1, -2), rtol=1e-12)
    rows = np.zeros((3, 4, 30, 5))[:, :, 5:25]          # a row block of a larger accumulator
    blas.matmul(scores, np.ascontiguousarray(k), out=rows)
    np.testing.assert_allclose(rows, scores @ k, rtol=1e-12)


def test_a_prepared_gemm_serves_new_arrays_of_the_same_layout():
    q, k = heads()
    first = blas.matmul(q, k.swapaxes(-1, -2))
    q2, k2 = heads()
    np.testing.assert_allclose(blas.matmul(q2, k2.swapaxes(-1, -2)), q2 @ k2.swapaxes(-1, -2), rtol=1e-12)
    np.testing.assert_allclose(first, q @ k.swapaxes(-1, -2), rtol=1e-12)


def test_integer_and_mixed_dtypes_fall_back_to_numpy():
    a, b = np.arange(6).reshape(2, 3), np.arange(6).reshape(3, 2)
    assert np.array_equal(blas.matmul(a, b), a @ b)
    assert np.allclose(blas.matmul(a.astype(np.float32), b.astype(np.float64)), a @ b)


def test_mkl_is_used_when_installed_and_numpy_when_asked(monkeypatch):
    try:
        importlib.metadata.version("mkl")
        installed = True
    except importlib.metadata.PackageNotFoundError:
        installed = False
    if installed and os.environ.get("HPCPAR_BLAS", "") != "numpy":
        assert blas.name() == "mkl"
    monkeypatch.setattr(blas, "_loaded", False)
    monkeypatch.setattr(blas, "_lib", None)
    monkeypatch.setenv("HPCPAR_BLAS", "numpy")
    assert blas.name() == "numpy"
    a, b = cases()["plain"]
    assert np.array_equal(blas.matmul(a, b), a @ b)
