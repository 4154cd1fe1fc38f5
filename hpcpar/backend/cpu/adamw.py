"""AdamW's step on the CPU: every host parameter of a step in place, in one call.

All parameters' blocks form one list that the threads share out; with the `fast` extra the step
runs as compiled tasks over equal runs of all the parameters' elements (`jit.pool.adamw_tasks`).
Each element sees the operations of `optim.optimizers.AdamW.step` in the same order, so the bits are the
NumPy chain's on any thread count.
"""

from __future__ import annotations

import weakref

import numpy as np

from hpcpar.backend import kernel_pool
from hpcpar.backend.cpu.blocks import block_ranges, compiled_loops, compiled_tasks, run_blocks, scratch
from hpcpar.backend.kernel_pool import num_threads


def adamw_update(params: list, b1: float, b2: float, eps: float, step_size: float, inv_bias2_sqrt: float) -> None:
    """One AdamW step of every parameter in `params`, [(p, g, m, v, decay), ...], in place (p, m, v),
    in the order of `optim.optimizers.AdamW.step`: decay (`decay` = 1 - lr wd, or 1), the moments, then
    p -= step_size m / (sqrt(v) inv_bias2_sqrt + eps). All parameters' blocks form one list, which
    the threads share out (one parameter's blocks would leave small parameters to one thread); with
    the compiled loops, all parameters' elements in equal runs of compiled tasks (`_adamw_tasks`)."""
    if _adamw_tasks(params, b1, b2, eps, step_size, inv_bias2_sqrt):
        return
    work = []
    for p, g, m, v, decay in params:
        arrays = (p, g, m, v)
        if not all(a.flags.c_contiguous for a in arrays):  # (a strided view: one block, in place as it is)
            work.append((arrays, decay))
            continue
        flat = tuple(a.reshape(-1) for a in arrays)
        work += [(tuple(a[s:e] for a in flat), decay) for s, e in block_ranges(flat[0].size, 4 * p.itemsize)]

    jit = compiled_loops()

    def block(a, e):
        for arrays, decay in work[a:e]:
            if jit is not None and all(x.flags.c_contiguous for x in arrays):
                t = arrays[0].dtype.type  # the constants rounded to the arrays' dtype, as NumPy does
                jit.adamw(*(x.reshape(-1) for x in arrays), decay != 1.0, t(decay), t(b1), t(b2), t(1.0 - b1),
                          t(1.0 - b2), t(eps), t(-step_size), t(inv_bias2_sqrt))
            else:
                _adamw_block(*arrays, decay, b1, b2, eps, step_size, inv_bias2_sqrt)
    run_blocks(block, [(i, i + 1) for i in range(len(work))])


_adam_table: dict = {"arrays": (), "table": None}


def _adamw_tasks(params: list, b1, b2, eps, step_size, inv_bias2_sqrt) -> bool:
    """adamw_update as compiled tasks (`jit.pool.adamw_tasks`: the threads take equal runs of all the
    parameters' elements, no Python per block), when the compiled loops are in use and every array is
    C-contiguous in one float32/float64 dtype; False (nothing done) otherwise. The table of addresses
    is kept while the same arrays come back (the optimizer's weights, moments and gradient buffers
    live across steps), checked through weak references to them: an array freed since cannot be
    mistaken for a new one at its address, and the table keeps no memory alive."""
    pool = compiled_tasks()
    if pool is None or not params:
        return False
    arrays = tuple(a for p, g, m, v, _ in params for a in (p, g, m, v))
    dt = arrays[0].dtype
    old = _adam_table["arrays"]
    if len(old) != len(arrays) or not all(ref() is a for ref, a in zip(old, arrays)):
        if dt not in (np.float32, np.float64) or not all(a.dtype == dt and a.flags.c_contiguous for a in arrays):
            return False
        _adam_table["table"] = np.array([[a.ctypes.data for a in arrays[i:i + 4]] + [arrays[i].size]
                                         for i in range(0, len(arrays), 4)], dtype=np.int64)
        _adam_table["arrays"] = tuple(weakref.ref(a) for a in arrays)
    decays = np.array([decay for *_, decay in params], dtype=dt)
    # The constants rounded to the arrays' dtype, as NumPy does with a Python float operand.
    consts = np.array([b1, b2, 1.0 - b1, 1.0 - b2, eps, -step_size, inv_bias2_sqrt], dtype=dt)
    kernel_pool.run_tasks(pool.adamw_tasks(_adam_table["table"], decays, consts, num_threads()))
    return True


def _adamw_block(pp, gg, mm, vv, decay, b1, b2, eps, step_size, inv_bias2_sqrt) -> None:
    if decay != 1.0:
        pp *= decay
    tmp = scratch("adam_tmp", gg.shape, pp.dtype)
    np.multiply(gg, gg, out=tmp)
    tmp *= 1.0 - b2
    vv *= b2
    vv += tmp
    np.multiply(gg, 1.0 - b1, out=tmp)
    mm *= b1
    mm += tmp
    np.sqrt(vv, out=tmp)
    tmp *= inv_bias2_sqrt
    tmp += eps
    np.divide(mm, tmp, out=tmp)
    tmp *= -step_size
    pp += tmp
