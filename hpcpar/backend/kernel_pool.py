"""The threads a rank computes on: the calling thread plus `num_threads() - 1` kernel threads.

    set_threads(n) / num_threads()   how many (None: the rank's BLAS threads, `environment.blas_threads()`)
    run(fn, parts)                   fn(part) for every part, parts[0] on the caller, parts[i] on
                                     kernel thread i - 1 (the blocks of backend/cpu's kernels)
    split_gemm(...)                  one matrix product in pieces, piece 0 on the caller (blas.matmul)
    run_tasks(rows)                  compiled tasks (jit.pool's rows: LayerNorm's passes, the bias
                                     kernels, AdamW's step), row 0 on the caller
    splits_gemms()                   whether split_gemm is available (Numba), so that the BLAS may
                                     run sequentially and leave its threads to this pool

Called from one thread (the training loop's); a call made while the pool is busy (a kernel part
that multiplies matrices, another thread) runs its parts on the calling thread alone.

How the threads wait. Handing a part to a thread that sleeps on a lock and waiting for it costs
70-95 us a round trip on the benchmark VM (thread wake-ups there take tens of microseconds), as
long as a [1536, 128] x [128, 128] product takes on one core. Intel OpenMP's GEMM threads paid the
same per call: they had to sleep at once (`KMP_BLOCKTIME=0`) so as not to spin on the cores this
pool's threads needed next, and two threads ran the default model's GEMMs ~100 us per call slower
than PyTorch's (one OpenMP pool for everything, its threads spinning between calls). With Numba
(`jit.pool`) this pool is that one pool: `blas` runs MKL sequentially and splits each product here
(`split_gemm`); an idle kernel thread spins without the GIL for `SPIN_S` after its last task and runs
a posted GEMM piece without returning to Python; the caller posts with a few stores and waits for
the pieces spinning too. Then it sleeps on its lock; a poster that finds it asleep releases it (a
Dekker handshake on the mailbox's SLEEP and POSTED words, both sides sequentially consistent: the
thread sets SLEEP then reads POSTED, the poster writes POSTED then swaps SLEEP to 0; whichever of
the two swaps SLEEP from 1 owns the wake-up, so the lock is released exactly once per sleep).
Spinning only where it takes no core from anyone: the BLAS handed its threads over
(`allow_spinning`, from blas) and no more threads than cores (else a thread sleeps at once and the
caller yields the core while it waits). Without Numba the threads sleep on locks between parts.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from hpcpar import environment
from hpcpar.backend.jit import load as load_jit

# How long an idle kernel thread spins before it sleeps: longer than the gaps between a step's
# kernels (the Python of the autograd between them, tens of microseconds), short enough that a
# thread of a rank waiting for a collective or a checkpoint gives its core back soon.
SPIN_S = 0.002
_MAX_THREADS = 64

_threads_set: int | None = None
_polite = False          # more threads than cores: no spinning, waits yield the core
_busy = threading.Lock()
_workers: list = []
_jit = None              # jit.pool, False when unavailable, None before the first look
_spins_per_s = 0.0
_spin_allowed = False
_ctrl = _task = None     # the mailbox (jit.pool's docstring): int64 [_MAX_THREADS - 1, 16] each


def set_threads(n: int | None) -> None:
    """Threads the kernels use (None: this rank's BLAS threads, `environment.blas_threads()`; at most
    64, the bits of the mask in which `jit.pool.post_tasks` reports sleeping threads)."""
    global _threads_set, _polite
    if n is not None and n < 1:
        raise ValueError(f"kernel threads must be >= 1, got {n}")
    _threads_set = min(n if n is not None else environment.blas_threads(), _MAX_THREADS)
    _polite = _threads_set > environment.cores()


def num_threads() -> int:
    """The threads the kernels use now."""
    if _threads_set is None:
        set_threads(None)
    return _threads_set


def _compiled():
    """jit.pool, or None: Numba not installed, or HPCPAR_JIT=0."""
    global _jit, _ctrl, _task
    if _jit is None:
        jit_pool = load_jit("pool")
        if jit_pool is not None:
            _ctrl = np.zeros((_MAX_THREADS - 1, jit_pool.ROW), dtype=np.int64)
            _task = np.zeros((_MAX_THREADS - 1, jit_pool.ROW), dtype=np.int64)
        _jit = jit_pool or False
    return _jit or None


def splits_gemms() -> bool:
    """Whether `split_gemm` is available (Numba): the BLAS may then run sequentially."""
    return _compiled() is not None


def allow_spinning() -> None:
    """The BLAS runs sequentially and splits its products here (blas): idle kernel threads may spin,
    no other pool's threads want their cores."""
    global _spin_allowed
    _spin_allowed = True


def _spins() -> int:
    """Empty waits an idle kernel thread spins for before it sleeps (0: sleep at once)."""
    global _spins_per_s
    if not _spin_allowed or _polite:
        return 0
    if not _spins_per_s:
        _jit.spin_rate(1)
        count = 1 << 16
        start = time.perf_counter()
        _jit.spin_rate(count)
        _spins_per_s = count / max(time.perf_counter() - start, 1e-9)
    return max(1, int(SPIN_S * _spins_per_s))


def _run_task(thread) -> None:
    """A kernel thread's Python part: fn(part) from `thread.task`, its error kept in `thread.error` for
    the caller to raise. The task is dropped before the thread waits again (and this frame's names
    with it): a kernel's closure holds its arrays (attention's saved probabilities), which would
    otherwise stay alive until the next task."""
    fn, part = thread.task
    thread.task = None
    try:
        fn(part)
    except BaseException as e:  # noqa: BLE001 - handed to the caller, which re-raises it
        thread.error = e


class _SpinningThread:
    """A kernel thread that waits in `jit.pool.serve` (spinning, then on its lock `wake`)."""

    def __init__(self, t: int):
        self.t = t
        self.wake = threading.Lock()
        self.wake.acquire()
        self.task: tuple | None = None
        self.error: BaseException | None = None
        threading.Thread(target=self._loop, name=f"hpcpar-kernel-{t}", daemon=True).start()

    def _loop(self) -> None:
        jit, t = _jit, self.t
        while True:
            seq = jit.serve(_ctrl, _task, t, _spins())
            if seq == 0:  # idle: sleep, unless a task slipped in before a poster could see SLEEP
                jit.set_sleep(_ctrl, t, 1)
                if jit.pending(_ctrl, t) and jit.set_sleep(_ctrl, t, 0) == 1:
                    continue
                self.wake.acquire()  # released by the poster that swapped SLEEP from 1
                continue
            _run_task(self)
            jit.finish(_ctrl, t, seq)

    def start(self, fn, part) -> None:
        self.task = (fn, part)
        _, asleep = _jit.post(_ctrl, _task, self.t, _jit.PYTHON)
        if asleep:
            self.wake.release()

    def wait(self) -> None:
        _jit.wait(_ctrl, self.t, _polite)
        error, self.error = self.error, None
        if error is not None:
            raise error


class _LockedThread:
    """A kernel thread without Numba: blocks on `go` until handed a part, runs it, releases `done`.
    Two lock hand-offs per part: a thread pool's futures and queue cost a kernel of 0.2 ms half its
    time."""

    def __init__(self, t: int):
        self.go, self.done = threading.Lock(), threading.Lock()
        self.go.acquire()
        self.done.acquire()
        self.task: tuple | None = None
        self.error: BaseException | None = None
        threading.Thread(target=self._loop, name=f"hpcpar-kernel-{t}", daemon=True).start()

    def _loop(self) -> None:
        while True:
            self.go.acquire()
            _run_task(self)
            self.done.release()

    def start(self, fn, part) -> None:
        self.task = (fn, part)
        self.go.release()

    def wait(self) -> None:
        self.done.acquire()
        error, self.error = self.error, None
        if error is not None:
            raise error


def _kernel_threads(n: int) -> list:
    """The first n kernel threads, started on first use."""
    kind = _SpinningThread if _compiled() is not None else _LockedThread
    while len(_workers) < n:
        _workers.append(kind(len(_workers)))
    return _workers[:n]


def run(fn, parts: list) -> None:
    """fn(part) for every part of `parts`: parts[0] on this thread, parts[i] on kernel thread i - 1,
    all at once; returns when all are done and raises the first error. With the pool busy (a call
    from inside a part, or from another thread) every part runs here, in order."""
    if len(parts) < 2 or not _busy.acquire(blocking=False):
        for part in parts:
            fn(part)
        return
    started = []
    try:
        for worker, part in zip(_kernel_threads(len(parts) - 1), parts[1:]):
            worker.start(fn, part)
            started.append(worker)
        fn(parts[0])
    finally:
        errors = []
        for worker in started:  # every part is waited for; the first error is raised
            try:
                worker.wait()
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
        _busy.release()
        if errors:
            raise errors[0]


def split_gemm(address: int, f64: bool, pieces: np.ndarray, trans_a: int, trans_b: int, k: int,
               a: int, lda: int, b: int, ldb: int, c: int, ldc: int) -> bool:
    """C = op(A) op(B) (row-major CBLAS ?gemm at `address`, alpha 1, beta 0; a, b, c the matrices'
    addresses) in len(pieces) pieces at once, piece 0 on this thread. pieces: int64 [n, 5], each
    piece's rows, columns and byte offsets into A, B and C (blas._pieces). Returns False, computing
    nothing, when the pool is busy or has no compiled side: the caller multiplies alone."""
    jit = _compiled()
    if jit is None or not _busy.acquire(blocking=False):
        return False
    try:
        _post_and_run(jit, jit.gemm_tasks(address, f64, pieces, trans_a, trans_b, k, a, lda, b, ldb, c, ldc))
    finally:
        _busy.release()
    return True


def run_tasks(rows: np.ndarray) -> None:
    """Compiled tasks (`jit.pool` task rows, int64 [n, 16]: `jit.pool.row_tasks`, `adamw_tasks`) at once,
    rows[0] on this thread, rows[i] on kernel thread i - 1; all on this thread, in order, when the
    pool is busy or its threads wait on locks (no compiled side)."""
    jit = _compiled()
    if jit is None or len(rows) < 2 or not _busy.acquire(blocking=False):
        from hpcpar.backend.jit import pool as jit_pool
        jit_pool.run_here(rows)
        return
    try:
        _post_and_run(jit, rows)
    finally:
        _busy.release()


def _post_and_run(jit, rows: np.ndarray) -> None:
    """Post rows 1.. to the kernel threads, wake those asleep, run row 0 here and wait for the rest."""
    workers = _kernel_threads(len(rows) - 1)
    sleepers = jit.post_tasks(_ctrl, _task, rows)
    for t in range(len(workers)):
        if sleepers >> t & 1:
            workers[t].wake.release()
    jit.run_and_wait(_ctrl, rows, _polite)
