"""How a CPU kernel runs: cut into cache-sized blocks, the blocks shared out to the kernel threads,
per-thread scratch arrays, and which loops compute a block (NumPy's or Numba's compiled ones).

    block_ranges(n, item_bytes)     [(a, e), ...] covering range(n), about BLOCK_BYTES a block
    block_rows(c, dtype)            rows of [N, C] per block: the unit of per-block partial sums
    run_blocks(fn, ranges)          fn(a, e) for every block, on the caller or the kernel threads
    scratch(slot, shape, dtype)     a per-thread array reused from block to block and step to step
    sum_partials(parts)             per-block partial sums added in block order
    compiled_loops() / compiled_tasks() / jit_name()
                                    `jit.kernels` and `jit.pool`, or None without the `fast` extra

Blocks are cut from the shape alone (never from the thread count), and a thread takes a contiguous
run of them, so which block an element lands in, and the order in which per-block partial sums are
added, are the same on any thread count.
"""

from __future__ import annotations

import functools
import math
import threading

import numpy as np

from hpcpar.backend import blas, kernel_pool
from hpcpar.backend.jit import load as load_jit
from hpcpar.backend.kernel_pool import num_threads

# Bytes of one block's main array: the three or four arrays of a chain fit a 2 MiB L2 cache
# together. Measured on the default and the largest benchmark model's GELU and LayerNorm: one
# thread is 1.6x faster than unblocked from 128 to 384 KiB and slower again from 768 KiB; two
# threads gain 1.2-1.5x over one from 384 KiB, where a block's arithmetic outweighs the Python
# around each NumPy call (which holds the GIL), and nothing at 192 KiB.
BLOCK_BYTES = 384 * 1024

# Blocks a thread takes at least: handing a part to a sleeping thread and waiting for it costs
# 60-80 us on the benchmark VM (waking a sleeping thread there takes tens of microseconds), as much
# as a 384 KiB block's arithmetic, so a kernel of two or three blocks runs on the caller alone.
_MIN_BLOCKS_PER_THREAD = 2
_local = threading.local()


def run_blocks(fn, blocks: list, gemms: bool = False) -> None:
    """fn(a, e) for every (a, e) in `blocks`: on this thread, or, with several threads, each thread
    (this one too) taking a contiguous run of blocks (which block a result lands in never depends
    on it). `gemms`: the blocks multiply matrices, which then run single-threaded on each thread
    (the threads are the cores). Called from one thread at a time (the training loop's)."""
    n = min(num_threads(), len(blocks) // _MIN_BLOCKS_PER_THREAD)
    if n <= 1:
        for a, e in blocks:
            fn(a, e)
        return
    per = -(-len(blocks) // n)
    parts = [blocks[i:i + per] for i in range(0, len(blocks), per)]
    kernel_pool.run(functools.partial(_run_gemm_part if gemms else _run_part, fn), parts)


def _run_part(fn, part: list) -> None:
    for a, e in part:
        fn(a, e)


def _run_gemm_part(fn, part: list) -> None:
    with blas.one_thread():
        _run_part(fn, part)


def block_ranges(n: int, item_bytes: int, block_bytes: int = 0) -> list:
    """[(a, e), ...] covering range(n) in pieces of about `block_bytes` (default BLOCK_BYTES) of
    `item_bytes` each (at least one item a piece)."""
    step = max(1, (block_bytes or BLOCK_BYTES) // max(1, item_bytes))
    return [(a, min(a + step, n)) for a in range(0, n, step)]


def block_rows(c: int, cd) -> int:
    """Rows of [N, C] per block (BLOCK_BYTES of the compute dtype): the unit of the weight gradient's
    per-block partial sums, so that they are the same on any thread count."""
    return max(1, BLOCK_BYTES // max(1, c * np.dtype(cd).itemsize))


def scratch(slot: str, shape: tuple, dtype) -> np.ndarray:
    """A per-thread scratch array for `slot`, reused while the shape and dtype stay the same."""
    cache = getattr(_local, "cache", None)
    if cache is None:
        cache = _local.cache = {}
    key = (slot, dtype)
    buf = cache.get(key)
    size = math.prod(shape)
    if buf is None or buf.size < size:
        buf = cache[key] = np.empty(max(size, 1), dtype=dtype)
    return buf[:size].reshape(shape)


def flat(a) -> np.ndarray:
    """a as a C-contiguous 1-D array (a view when it already is contiguous)."""
    return np.ascontiguousarray(a).reshape(-1)


def sum_partials(parts):
    """parts[0] + parts[1] + ... in order (a left fold, the same on every thread count)."""
    total = parts[0].copy()
    for p in parts[1:]:
        total += p
    return total


# `jit.kernels`, False when unavailable, None before the first look (tests set it to choose the loops).
_jit_module = None


def compiled_loops():
    """`jit.kernels` (Numba's compiled loops), or None: Numba not installed, or HPCPAR_JIT=0."""
    global _jit_module
    if _jit_module is None:
        _jit_module = load_jit("kernels") or False
    return _jit_module or None


def compiled_tasks():
    """`jit.pool` (compiled tasks the kernel threads run without Python) when the compiled loops are
    in use, else None."""
    if compiled_loops() is None:
        return None
    from hpcpar.backend.jit import pool as jit_pool
    return jit_pool


def jit_name() -> str:
    """The elementwise loops in use: "numba" (the `fast` extra) or "numpy"."""
    return "numba" if compiled_loops() is not None else "numpy"
