"""A linear's bias on the CPU: adding it to the GEMM's output, and its gradient's column sums.

    add_bias(y, b)      y [N, n] += b [n] in place
    column_sums(a)      the sum over rows of a [N, n], per-block partial sums added in block order

With the `fast` extra both are compiled loops over rows (`jit.kernels`), large ones in runs of whole
blocks on the kernel threads (`jit.pool` row tasks); the bits do not depend on the thread count.
"""

from __future__ import annotations

import numpy as np

from hpcpar.backend import kernel_pool
from hpcpar.backend.cpu.blocks import block_rows, compiled_loops, compiled_tasks, sum_partials
from hpcpar.backend.kernel_pool import num_threads


def _compiled_rows(a):
    """(jit.kernels, jit.pool or None, rows per block) for a [N, n] that the compiled loops take
    (C-contiguous, float32 or float64), else None. jit.pool (row tasks on the kernel threads) only
    with several threads and more than two blocks: below that a task's set-up costs more than the
    second thread gains."""
    jit = compiled_loops()
    if jit is None or a.ndim != 2 or not a.flags.c_contiguous or a.dtype not in (np.float32, np.float64):
        return None
    rows = block_rows(a.shape[1], a.dtype)
    pool = compiled_tasks() if num_threads() > 1 and a.shape[0] > 2 * rows else None
    return jit, pool, rows


def add_bias(y, b) -> None:
    """y [N, n] += b [n] in place (a linear's bias: a broadcast over short rows is a slow NumPy loop);
    large ones in runs of whole rows on the kernel threads."""
    compiled = _compiled_rows(y) if y.dtype == b.dtype else None
    if compiled is None:
        y += b
        return
    jit, pool, rows = compiled
    b = np.ascontiguousarray(b)
    if pool is None:
        jit.add_bias_rows(y, b)
    else:
        kernel_pool.run_tasks(pool.row_tasks(pool.ADD_BIAS, y, b, b, b, b, y, y, b, b, 0, b, rows, num_threads()))


def column_sums(a):
    """The sum over rows of a [N, n] (a bias's gradient): with the compiled loops, each block's
    (`blocks.block_rows`) sum row by row, the blocks' sums added in block order (the same bits on any
    thread count; large ones with the blocks' runs on the kernel threads); else NumPy's."""
    compiled = _compiled_rows(a)
    if compiled is None:
        return a.sum(axis=0)
    jit, pool, rows = compiled
    parts = np.empty((-(-a.shape[0] // rows), a.shape[1]), dtype=a.dtype)
    if pool is None:
        jit.column_sums_blocks(a, parts, rows)
    else:
        kernel_pool.run_tasks(pool.row_tasks(pool.COLUMN_SUMS, a, parts, parts, parts, parts, a, a, parts, parts, 0,
                                             parts, rows, num_threads()))
    return sum_partials(parts)

