"""The kernel threads (hpcpar/backend/kernel_pool.py): parts on every thread, errors, calls while busy, sleeping
threads woken, compiled tasks (LayerNorm's), and GEMMs split among the threads equal to the product
in one piece.

Run with the compiled waits (Numba's jit_pool: spinning, then sleeping on a lock) and with the locks
alone; the split GEMMs need Numba and MKL (the `fast` and `mkl` extras) and are skipped without.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from hpcpar.backend import blas, kernel_pool

WAYS = ["locks"] + (["compiled"] if kernel_pool.splits_gemms() else [])


@pytest.fixture(params=WAYS)
def pool(request, monkeypatch):
    """The pool with kernel threads of one kind: compiled waits with spinning allowed (the module's own
    threads: each serves its row of the mailbox), or locks (threads of the test's own)."""
    if request.param == "locks":
        monkeypatch.setattr(kernel_pool, "_workers", [])
        monkeypatch.setattr(kernel_pool, "_jit", False)
    else:
        monkeypatch.setattr(kernel_pool, "_spin_allowed", True)
    yield kernel_pool
    kernel_pool.set_threads(None)


def _within(seconds: float, fn) -> None:
    """fn() on a helper thread, failing the test if it has not returned after `seconds` (a hang)."""
    errors: list = []

    def call():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)
    helper = threading.Thread(target=call, daemon=True)
    helper.start()
    helper.join(seconds)
    assert not helper.is_alive(), f"kernel_pool call still running after {seconds} s"
    if errors:
        raise errors[0]


@pytest.mark.parametrize("threads", [2, 3])
def test_every_part_runs_once_part_zero_on_the_caller(pool, threads):
    pool.set_threads(threads)
    seen: dict = {}

    def part(i):
        seen[i] = threading.get_ident()

    def go():
        pool.run(part, list(range(threads)))
        assert sorted(seen) == list(range(threads))
        assert seen[0] == threading.get_ident()
        assert len(set(seen.values())) == threads
    _within(30, go)


def test_the_first_error_is_raised_after_every_part_finished_and_the_pool_still_works(pool):
    pool.set_threads(3)
    done: list = []

    def part(i):
        if i == 2:
            raise KeyError("part 2")
        time.sleep(0.01)
        done.append(i)

    def go():
        with pytest.raises(KeyError, match="part 2"):
            pool.run(part, [0, 1, 2])
        assert sorted(done) == [0, 1]
        out: list = []
        pool.run(out.append, [0, 1, 2])
        assert sorted(out) == [0, 1, 2]
    _within(30, go)


def test_a_call_from_inside_a_part_runs_its_parts_on_that_thread(pool):
    pool.set_threads(2)
    inner: list = []

    def part(i):
        pool.run(lambda j: inner.append((i, j, threading.get_ident())), [0, 1])

    _within(30, lambda: pool.run(part, [0, 1]))
    by_outer = {i: {ident for o, _, ident in inner if o == i} for i in (0, 1)}
    assert sorted((i, j) for i, j, _ in inner) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(len(idents) == 1 for idents in by_outer.values())


def test_threads_that_went_to_sleep_are_woken(pool, monkeypatch):
    """Spinning briefly, the threads sleep between calls; every call must still complete."""
    monkeypatch.setattr(kernel_pool, "SPIN_S", 1e-5)
    pool.set_threads(2)

    def go():
        for rep in range(30):
            out: list = []
            pool.run(out.append, [0, 1])
            assert sorted(out) == [0, 1]
            time.sleep(0.002 if rep % 2 else 0.0)
    _within(60, go)


@pytest.mark.skipif(not kernel_pool.splits_gemms(), reason="compiled tasks need Numba (the fast extra)")
@pytest.mark.parametrize("threads", [2, 3])
def test_compiled_tasks_run_once_each_from_the_caller_and_from_inside_a_part(pool, threads):
    """LayerNorm's compiled tasks (jit_pool rows) posted to the threads, or run on the calling thread
    when the pool is busy (called from inside a Python part) or waits on locks: each row's rows
    computed once, the same bits as all rows run in order on one thread."""
    from hpcpar.backend.jit import pool as jit_pool
    pool.set_threads(threads)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((300, 24))
    w, b = rng.standard_normal(24), rng.standard_normal(24)
    consts = np.array([24.0, 1e-5])

    def forward():
        out, mean, rstd = np.full_like(x, np.nan), np.full((300, 1), np.nan), np.full((300, 1), np.nan)
        rows = jit_pool.row_tasks(jit_pool.LN_FORWARD, x, w, b, mean, rstd, x, out, mean, mean,
                                         jit_pool.HAS_BIAS, consts, 40, threads)
        return rows, (out, mean, rstd)
    rows, want = forward()
    assert len(rows) == threads and rows[:, jit_pool.N].sum() == 300
    jit_pool.run_here(rows)
    got: list = []

    def go():
        rows, outs = forward()
        pool.run_tasks(rows)
        got.append(outs)
        inner = [forward() for _ in range(threads)]
        pool.run(lambda i: pool.run_tasks(inner[i][0]), list(range(threads)))
        got.extend(outs for _, outs in inner)
    _within(30, go)
    assert len(got) == threads + 1
    assert all(np.array_equal(a, c) for outs in got for a, c in zip(outs, want))


needs_split = pytest.mark.skipif(not kernel_pool.splits_gemms() or blas.name() != "mkl",
                                 reason="split GEMMs need Numba and MKL (the fast and mkl extras)")


def _operand(rng, shape, dtype, transposed):
    a = rng.standard_normal(shape[::-1] if transposed else shape).astype(dtype)
    return a.T if transposed else a


@needs_split
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("m,k,n", [(300, 64, 80), (40, 96, 500), (1000, 130, 33), (70, 1500, 70)])
def test_split_products_equal_the_product_in_one_piece(monkeypatch, dtype, threads, m, k, n):
    rng = np.random.default_rng(m + n)
    blas._load()
    for ta in (False, True):
        for tb in (False, True):
            a, b = _operand(rng, (m, k), dtype, ta), _operand(rng, (k, n), dtype, tb)
            monkeypatch.setattr(blas, "_split", False)
            whole = blas.matmul(a, b)
            monkeypatch.setattr(blas, "_split", True)
            kernel_pool.set_threads(threads)
            try:
                out = np.full((m, n + 3), np.nan, dtype=dtype)[:, 1:n + 1]   # a view with strided rows
                split = blas.matmul(a, b)
                blas.matmul(a, b, out=out)
            finally:
                kernel_pool.set_threads(None)
            # Equal to rounding (a piece may take other kernels of MKL than the whole): a wrong piece
            # (rows, offsets) would be off by the size of the entries.
            rounding = np.finfo(dtype).eps * k * np.abs(a).max() * np.abs(b).max()
            np.testing.assert_allclose(split, whole, rtol=0, atol=rounding)
            assert np.array_equal(out, split)


@needs_split
def test_pieces_cover_the_product_in_aligned_runs_of_rows_or_columns():
    rows = blas._pieces(1000, 40, (blas._NO_TRANS, 64), (blas._TRANS, 64), 40, 4, 3)
    assert rows[:, 0].tolist() == [336, 336, 328] and set(rows[:, 1]) == {40}
    assert rows[:, 2].tolist() == [0, 336 * 64 * 4, 672 * 64 * 4] and rows[:, 4].tolist() == [0, 336 * 40 * 4, 672 * 40 * 4]
    cols = blas._pieces(30, 100, (blas._NO_TRANS, 8), (blas._NO_TRANS, 100), 100, 8, 2)
    assert cols[:, 1].tolist() == [64, 36] and cols[:, 3].tolist() == [0, 64 * 8] and cols[:, 4].tolist() == [0, 64 * 8]
    assert len(blas._pieces(20, 10, (blas._NO_TRANS, 8), (blas._NO_TRANS, 10), 10, 4, 4)) == 2  # 16 rows at least


@needs_split
def test_training_with_split_gemms_on_two_threads_equals_one_thread(monkeypatch):
    """A tiny float64 GPT, 3 steps: every product split between two threads (and the kernels'
    blocks shared out) gives the one-thread losses and parameters to rounding."""
    from mpi4py import MPI

    from hpcpar.config.load import load_config
    from hpcpar.training.trainer import Trainer
    overrides = ["model.n_layer=2", "model.n_embd=64", "model.n_head=4", "model.block_size=64",
                 "model.dtype=float64", "model.dropout=0.1", "mesh.dp=1", "mesh.tp=1", "mesh.pp=1",
                 "train.micro_batch_size=4", "train.microbatches=2", "train.steps=3", "train.warmup=0"]
    tokens = np.random.default_rng(0).integers(0, 256, 20000).astype(np.uint16)
    blas._load()
    runs = []
    real = kernel_pool.split_gemm
    for split, threads in ((False, 1), (True, 2)):
        monkeypatch.setattr(blas, "_split", split)
        kernel_pool.set_threads(threads)
        calls: list = []
        monkeypatch.setattr(kernel_pool, "split_gemm", lambda *a: calls.append(1) or real(*a))
        try:
            trainer = Trainer(load_config(None, overrides), MPI.COMM_SELF, tokens=tokens)
            losses = [trainer.train_step(step).loss for step in range(3)]
            runs.append((losses, trainer.global_parameters(), len(calls)))
            trainer.free()
        finally:
            kernel_pool.set_threads(None)
    (one, p1, n1), (two, p2, n2) = runs
    assert n1 == 0 and n2 > 0  # the second run did split its products
    np.testing.assert_allclose(two, one, rtol=1e-12)
    for name, value in p1.items():
        np.testing.assert_allclose(p2[name], value, rtol=1e-10, atol=1e-13, err_msg=name)
