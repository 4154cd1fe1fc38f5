"""The kernel threads' compiled side (Numba): waiting by spinning without the GIL, and compiled tasks
(GEMM pieces, runs of rows of LayerNorm and the bias kernels, runs of AdamW's elements) run by a
kernel thread without returning to Python. Used by `kernel_pool` when the `fast` extra is installed.

Waking a thread that sleeps on a lock costs 70-95 us a round trip on the benchmark VM, as long as a
[1536, 128] x [128, 128] product takes on one core; Intel OpenMP's GEMM threads pay the same
wake-up per call when they sleep at once (`KMP_BLOCKTIME=0`, which the kernel threads needed while
they were a second set of threads on the same cores). So an idle kernel thread spins here for a
while (`serve`), reading its mailbox with acquire loads and a `pause` between reads, and runs a
compiled task posted to it right there: a split GEMM or a LayerNorm pass (`kernel_pool.split_gemm`,
`run_tasks`: `post_tasks`, then `run_and_wait`) costs the caller a few stores, and waiting for the pieces is a
spin too. A Python part makes `serve` return to its thread's Python loop.

Mailbox: `ctrl`, int64 [threads - 1, 16] (a row per kernel thread, 128 bytes apart: no false
sharing): POSTED (sequence number of the last task posted), DONE (of the last task finished), SLEEP
(1 while the thread sleeps on its lock, or is about to). `task`, int64 [threads - 1, 16]: KIND
(GEMM_F32, GEMM_F64, LN_FORWARD, LN_BACKWARD, ADD_BIAS, COLUMN_SUMS, ADAMW, PYTHON), then a GEMM's
address, trans_a, trans_b, m, n, k, a, lda, b, ldb, c, ldc, or a row task's or an AdamW step's slots
(below); the rows `gemm_tasks`, `row_tasks` and `adamw_tasks` build are copied in. A task's arrays
are the caller's, alive until it has waited for every task. Stores to POSTED and DONE are releases,
their loads acquires, SLEEP's accesses sequentially consistent (a Dekker handshake with POSTED:
`kernel_pool` explains), so this holds on any CPU, not only on x86's ordered stores.
"""

from __future__ import annotations

import platform

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from hpcpar.backend.jit.kernels import (adamw, add_bias_rows, column_sums_blocks, gemm, jit, layer_norm_backward,
                                 layer_norm_forward)

POSTED, DONE, SLEEP = 0, 1, 2
KIND = 0
GEMM_F32, GEMM_F64, PYTHON, LN_FORWARD, LN_BACKWARD, ADAMW, ADD_BIAS, COLUMN_SUMS = 1, 2, 3, 4, 5, 6, 7, 8
ROW = 16  # int64s per row of ctrl and task
# A row task's row (LayerNorm's passes, a bias added to rows, a bias's gradient): its dtype, rows and
# width, the arrays' addresses (at the task's first row), FLAGS (HAS_BIAS | WANT_DX | WANT_DW), the
# address of consts [c, eps] in the dtype, rows per partial sum of dw and db. OUT is LayerNorm's y
# (forward) or dx (backward); ADD_BIAS adds B to the rows of X, COLUMN_SUMS puts X's block sums in DW.
F64, N, C, X, W, B, MEAN, RSTD, G, OUT, DW, DB, FLAGS, CONSTS, BLOCK_ROWS = range(1, 16)
HAS_BIAS, WANT_DX, WANT_DW = 1, 2, 4
# An AdamW task's row: F64 and N (as above: the dtype, the parameters), the address of the table
# int64 [N, 5] (each parameter's p, g, m, v addresses and size), of decays [N] and of consts [7]
# (b1, b2, 1 - b1, 1 - b2, eps, -step_size, inv_bias2_sqrt) in the dtype, and the task's elements
# [START, END) of all the parameters' elements in table order.
TABLE, DECAYS, ADAM_CONSTS, START, END = 3, 4, 5, 6, 7

# The CPU's spin-wait hint as an LLVM intrinsic (Numba's LLVM takes no inline assembly): x86's
# `pause`, Arm's `yield` (hint #1); none elsewhere.
_PAUSE = {"x86_64": ("llvm.x86.sse2.pause", ()), "amd64": ("llvm.x86.sse2.pause", ()),
          "aarch64": ("llvm.aarch64.hint", (1,)), "arm64": ("llvm.aarch64.hint", (1,))}.get(platform.machine().lower())


def _pointer(builder, address):
    return builder.inttoptr(address, ir.IntType(64).as_pointer())


def _atomic_load(order: str):
    """An intrinsic: the int64 at an address, an atomic load with LLVM ordering `order`."""
    @intrinsic
    def load(typingctx, address):
        def codegen(context, builder, signature, args):
            return builder.load_atomic(_pointer(builder, args[0]), order, 8)
        return types.int64(types.int64), codegen
    return load


def _atomic_store(order: str):
    """An intrinsic: store an int64 at an address, atomically with LLVM ordering `order`."""
    @intrinsic
    def store(typingctx, address, value):
        def codegen(context, builder, signature, args):
            builder.store_atomic(args[1], _pointer(builder, args[0]), order, 8)
            return context.get_dummy_value()
        return types.void(types.int64, types.int64), codegen
    return store


_load_acquire, _load_seq_cst = _atomic_load("acquire"), _atomic_load("seq_cst")
_store_release, _store_seq_cst = _atomic_store("release"), _atomic_store("seq_cst")


@intrinsic
def _exchange(typingctx, address, value):
    """Atomically replace the int64 at `address` by `value`; return the old value (seq_cst)."""
    def codegen(context, builder, signature, args):
        return builder.atomic_rmw("xchg", _pointer(builder, args[0]), args[1], "seq_cst")
    return types.int64(types.int64, types.int64), codegen


@intrinsic
def _pause(typingctx):
    """The CPU's spin-wait hint (x86 `pause`, Arm `yield`): the spinning core backs off its loads."""
    def codegen(context, builder, signature, args):
        if _PAUSE is not None:
            name, immediates = _PAUSE
            i32 = ir.IntType(32)
            fn = builder.module.declare_intrinsic(name, fnty=ir.FunctionType(ir.VoidType(), [i32] * len(immediates)))
            builder.call(fn, [ir.Constant(i32, v) for v in immediates])
        return context.get_dummy_value()
    return types.void(), codegen


@intrinsic
def _sched_yield(typingctx):
    """libc's sched_yield(): give the core to another runnable thread (more threads than cores)."""
    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(32), []), "sched_yield")
        builder.call(fn, [])
        return context.get_dummy_value()
    return types.void(), codegen


@intrinsic
def _pointer_to(typingctx, address, like):
    """`address` as a pointer to values of `like`'s type (for numba.carray)."""
    target = types.CPointer(like)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(target))
    return target(types.int64, like), codegen


@jit
def _run_gemm(row):
    """The GEMM part a task row holds (C = op(A) op(B), alpha 1, beta 0)."""
    if row[KIND] == GEMM_F32:
        gemm(row[1], np.int32(row[2]), np.int32(row[3]), row[4], row[5], row[6], np.float32(1.0), row[7], row[8],
             row[9], row[10], np.float32(0.0), row[11], row[12])
    else:
        gemm(row[1], np.int32(row[2]), np.int32(row[3]), row[4], row[5], row[6], 1.0, row[7], row[8], row[9],
             row[10], 0.0, row[11], row[12])


@jit
def _run_rows(row, one):
    """The row task a task row holds, on arrays of `one`'s dtype (jit.kernels' kernels)."""
    kind, n, c, flags = row[KIND], row[N], row[C], row[FLAGS]
    x = numba.carray(_pointer_to(row[X], one), (n, c))
    if kind == ADD_BIAS:
        add_bias_rows(x, numba.carray(_pointer_to(row[B], one), c))
        return
    blocks = (n + row[BLOCK_ROWS] - 1) // row[BLOCK_ROWS]
    if kind == COLUMN_SUMS:
        column_sums_blocks(x, numba.carray(_pointer_to(row[DW], one), (blocks, c)), row[BLOCK_ROWS])
        return
    w = numba.carray(_pointer_to(row[W], one), c)
    mean = numba.carray(_pointer_to(row[MEAN], one), (n, 1))
    rstd = numba.carray(_pointer_to(row[RSTD], one), (n, 1))
    out = numba.carray(_pointer_to(row[OUT], one), (n, c))
    consts = numba.carray(_pointer_to(row[CONSTS], one), 2)
    has_bias = flags & HAS_BIAS != 0
    if kind == LN_FORWARD:
        layer_norm_forward(x, w, numba.carray(_pointer_to(row[B], one), c), has_bias, consts, out, mean, rstd)
        return
    layer_norm_backward(x, w, mean, rstd, numba.carray(_pointer_to(row[G], one), (n, c)), consts, out,
                        numba.carray(_pointer_to(row[DW], one), (blocks, c)),
                        numba.carray(_pointer_to(row[DB], one), (blocks, c)),
                        flags & WANT_DX != 0, flags & WANT_DW != 0, has_bias, row[BLOCK_ROWS])


@jit
def _run_adamw(row, one):
    """The AdamW part a task row holds: the elements [START, END) of the parameters in its table, on
    arrays of `one`'s dtype (jit.kernels.adamw, one call per parameter the range covers)."""
    n, start, end = row[N], row[START], row[END]
    table = numba.carray(_pointer_to(row[TABLE], np.int64(0)), (n, 5))
    decays = numba.carray(_pointer_to(row[DECAYS], one), n)
    k = numba.carray(_pointer_to(row[ADAM_CONSTS], one), 7)
    item = 8 if row[F64] else 4
    offset = np.int64(0)
    for i in range(n):
        size = table[i, 4]
        a, e = max(start, offset) - offset, min(end, offset + size) - offset
        if a < e:
            p = numba.carray(_pointer_to(table[i, 0] + a * item, one), e - a)
            g = numba.carray(_pointer_to(table[i, 1] + a * item, one), e - a)
            m = numba.carray(_pointer_to(table[i, 2] + a * item, one), e - a)
            v = numba.carray(_pointer_to(table[i, 3] + a * item, one), e - a)
            adamw(p, g, m, v, decays[i] != one, decays[i], k[0], k[1], k[2], k[3], k[4], k[5], k[6])
        offset += size
        if offset >= end:
            return


@jit
def run_task(row):
    """Run the compiled task a row of `task` (or of a caller's rows) describes."""
    kind = row[KIND]
    if kind == GEMM_F32 or kind == GEMM_F64:
        _run_gemm(row)
    elif kind == ADAMW:
        if row[F64]:
            _run_adamw(row, 1.0)
        else:
            _run_adamw(row, np.float32(1.0))
    elif row[F64]:
        _run_rows(row, 1.0)
    else:
        _run_rows(row, np.float32(1.0))


@jit
def serve(ctrl, task, t, spins):
    """Kernel thread `t`'s wait: run the GEMM parts posted to it, and return the sequence number of a
    Python part (which its Python loop runs and then marks done), or 0 after `spins` reads found
    nothing new (the thread then sleeps on its lock)."""
    base = ctrl.ctypes.data + t * ROW * 8
    seen = _load_acquire(base + DONE * 8)
    idle = 0
    while True:  # (the mailbox is read at least once, whatever `spins`)
        seq = _load_acquire(base + POSTED * 8)
        if seq != seen:
            if task[t, KIND] != PYTHON:
                run_task(task[t])
                _store_release(base + DONE * 8, seq)
                seen = seq
                idle = 0
                continue
            return seq
        if idle >= spins:
            return 0
        _pause()
        idle += 1


@jit
def pending(ctrl, t):
    """Whether a task was posted to thread `t` that it has not finished (sequentially consistent:
    read after the thread declared itself asleep, see `kernel_pool`)."""
    base = ctrl.ctypes.data + t * ROW * 8
    return _load_seq_cst(base + POSTED * 8) != _load_acquire(base + DONE * 8)


@jit
def set_sleep(ctrl, t, value):
    """Set thread `t`'s SLEEP flag to `value`; return the old one (an atomic exchange)."""
    return _exchange(ctrl.ctypes.data + (t * ROW + SLEEP) * 8, value)


@jit
def finish(ctrl, t, seq):
    """Thread `t` finished task `seq` (its Python part)."""
    _store_release(ctrl.ctypes.data + (t * ROW + DONE) * 8, seq)


@jit
def post(ctrl, task, t, kind):
    """Post a task of `kind` to thread `t` (its parameters already in task[t]); return its sequence
    number and whether the thread sleeps (then the caller releases its lock)."""
    base = ctrl.ctypes.data + t * ROW * 8
    seq = _load_acquire(base + POSTED * 8) + 1
    task[t, KIND] = kind
    _store_seq_cst(base + POSTED * 8, seq)
    return seq, _exchange(base + SLEEP * 8, 0) == 1


@jit
def gemm_tasks(address, f64, parts, trans_a, trans_b, k, a, lda, b, ldb, c, ldc):
    """Task rows [len(parts), ROW] of C = op(A) op(B) (alpha 1, beta 0) in pieces. parts [n, 5]: each
    piece's rows m, columns n and byte offsets into A, B and C (whole rows or whole columns of C)."""
    rows = np.zeros((parts.shape[0], ROW), dtype=np.int64)
    for p in range(parts.shape[0]):
        r = rows[p]
        r[KIND] = GEMM_F64 if f64 else GEMM_F32
        r[1], r[2], r[3], r[4], r[5], r[6] = address, trans_a, trans_b, parts[p, 0], parts[p, 1], k
        r[7], r[8], r[9], r[10], r[11], r[12] = a + parts[p, 2], lda, b + parts[p, 3], ldb, c + parts[p, 4], ldc
    return rows


@jit
def row_tasks(kind, x, w, b, mean, rstd, g, out, dw, db, flags, consts, block_rows, pieces):
    """Task rows of a row task (LN_FORWARD, LN_BACKWARD, ADD_BIAS, COLUMN_SUMS) over x [n, c] in at
    most `pieces` pieces, each a run of whole blocks of `block_rows` rows (so dw's and db's [blocks, c] partial sums
    are those of the blocks, whatever the pieces). Arrays C-contiguous; mean, rstd [n, 1]; arrays a
    pass does not use may be any array (never read). The rows hold the arrays' addresses, not the
    arrays: the caller keeps every one of them alive (bound to a name) until the tasks ran."""
    n, c = x.shape
    blocks = (n + block_rows - 1) // block_rows
    per = (blocks + pieces - 1) // pieces
    count = (blocks + per - 1) // per
    rows = np.zeros((count, ROW), dtype=np.int64)
    item = x.itemsize
    for p in range(count):
        first = p * per * block_rows
        r = rows[p]
        r[KIND], r[F64], r[N], r[C] = kind, item == 8, min(n, first + per * block_rows) - first, c
        r[X], r[G], r[OUT] = x.ctypes.data + first * c * item, g.ctypes.data + first * c * item, \
            out.ctypes.data + first * c * item
        r[W], r[B], r[CONSTS] = w.ctypes.data, b.ctypes.data, consts.ctypes.data
        r[MEAN], r[RSTD] = mean.ctypes.data + first * item, rstd.ctypes.data + first * item
        r[DW], r[DB] = dw.ctypes.data + p * per * c * item, db.ctypes.data + p * per * c * item
        r[FLAGS], r[BLOCK_ROWS] = flags, block_rows
    return rows


@jit
def adamw_tasks(table, decays, consts, pieces):
    """Task rows of one AdamW step over the parameters of `table` (int64 [n, 5]: p, g, m, v addresses
    and size; decays [n] and consts [7] in the parameters' dtype): their elements in table order cut
    into at most `pieces` equal runs, at multiples of 16 elements. The caller keeps the arrays alive
    until the tasks ran (as for `row_tasks`)."""
    total = table[:, 4].sum()
    per = ((total + pieces - 1) // pieces + 15) // 16 * 16
    count = max(1, (total + per - 1) // per)
    rows = np.zeros((count, ROW), dtype=np.int64)
    for p in range(count):
        r = rows[p]
        r[KIND], r[F64], r[N] = ADAMW, decays.itemsize == 8, table.shape[0]
        r[TABLE], r[DECAYS], r[ADAM_CONSTS] = table.ctypes.data, decays.ctypes.data, consts.ctypes.data
        r[START], r[END] = p * per, min(total, (p + 1) * per)
    return rows


@jit
def post_tasks(ctrl, task, rows):
    """Post rows 1.. to kernel threads 0.. (row p to thread p - 1). Returns a mask of the threads that
    sleep (bit t: the caller releases thread t's lock), before it runs row 0 (`run_and_wait`)."""
    sleepers = 0
    for p in range(1, rows.shape[0]):
        t = p - 1
        task[t, 1:] = rows[p, 1:]
        _, asleep = post(ctrl, task, t, rows[p, KIND])
        if asleep:
            sleepers |= 1 << t
    return sleepers


@jit
def run_and_wait(ctrl, rows, polite):
    """Row 0 of the tasks `post_tasks` posted, here; then wait for the others."""
    run_task(rows[0])
    for t in range(rows.shape[0] - 1):
        wait(ctrl, t, polite)


@jit
def run_here(rows):
    """Every row, in order, on this thread (the pool is busy or has one thread)."""
    for p in range(rows.shape[0]):
        run_task(rows[p])


@jit
def wait(ctrl, t, polite):
    """Spin until thread `t` finished the last task posted to it; `polite`: yield the core between
    reads (more threads than cores)."""
    base = ctrl.ctypes.data + t * ROW * 8
    seq = _load_acquire(base + POSTED * 8)
    while _load_acquire(base + DONE * 8) != seq:
        if polite:
            _sched_yield()
        else:
            _pause()


@jit
def spin_rate(spins):
    """Run `spins` empty waits (for `kernel_pool` to time: waits per second on this CPU)."""
    x = 0
    for _ in range(spins):
        _pause()
        x += 1
    return x
