"""The kernel threads' compiled side (Numba): waiting by spinning without the GIL, and GEMMs run by a
kernel thread without returning to Python. Used by `kernel_pool` when the `fast` extra is installed.

Waking a thread that sleeps on a lock costs 70-95 us a round trip on the benchmark VM, as long as a
[1536, 128] x [128, 128] product takes on one core; Intel OpenMP's GEMM threads pay the same
wake-up per call when they sleep at once (`KMP_BLOCKTIME=0`, which the kernel threads needed while
they were a second set of threads on the same cores). So an idle kernel thread spins here for a
while (`serve`), reading its mailbox with acquire loads and a `pause` between reads, and runs a GEMM
piece posted to it right there: a split GEMM (`kernel_pool.split_gemm`: `post_gemm`, then
`gemm_and_wait`) costs the caller a few stores, and waiting for the pieces is a spin too. A Python
part makes `serve` return to its thread's Python loop.

Mailbox: `ctrl`, int64 [threads - 1, 16] (a row per kernel thread, 128 bytes apart: no false
sharing): POSTED (sequence number of the last task posted), DONE (of the last task finished), SLEEP
(1 while the thread sleeps on its lock, or is about to). `task`, int64 [threads - 1, 16]: KIND
(GEMM_F32, GEMM_F64, PYTHON), then a GEMM's address, trans_a, trans_b, m, n, k, a, lda, b, ldb, c,
ldc. Stores to POSTED and DONE are releases, their loads acquires, SLEEP's accesses sequentially
consistent (a Dekker handshake with POSTED: `kernel_pool` explains), so this holds on any CPU, not
only on x86's ordered stores.
"""

from __future__ import annotations

import platform

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from hpcpar.jit_kernels import gemm, jit

POSTED, DONE, SLEEP = 0, 1, 2
KIND = 0
GEMM_F32, GEMM_F64, PYTHON = 1, 2, 3
ROW = 16  # int64s per row of ctrl and task

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


@jit
def _run_gemm(task, t):
    """The GEMM part in row `t` of `task` (C = op(A) op(B), alpha 1, beta 0)."""
    if task[t, KIND] == GEMM_F32:
        gemm(task[t, 1], np.int32(task[t, 2]), np.int32(task[t, 3]), task[t, 4], task[t, 5], task[t, 6],
             np.float32(1.0), task[t, 7], task[t, 8], task[t, 9], task[t, 10], np.float32(0.0), task[t, 11],
             task[t, 12])
    else:
        gemm(task[t, 1], np.int32(task[t, 2]), np.int32(task[t, 3]), task[t, 4], task[t, 5], task[t, 6],
             1.0, task[t, 7], task[t, 8], task[t, 9], task[t, 10], 0.0, task[t, 11], task[t, 12])


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
                _run_gemm(task, t)
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
def post_gemm(ctrl, task, address, f64, parts, trans_a, trans_b, k, a, lda, b, ldb, c, ldc):
    """Post pieces 1.. of C = op(A) op(B) (alpha 1, beta 0) to kernel threads 0.. (piece p to thread
    p - 1). parts [n, 5]: each piece's rows m, columns n and byte offsets into A, B and C (whole rows
    or whole columns of C). Returns a mask of the threads that sleep (bit t: the caller releases
    thread t's lock), before it computes piece 0 (`gemm_and_wait`)."""
    sleepers = 0
    for p in range(1, parts.shape[0]):
        t = p - 1
        task[t, 1] = address
        task[t, 2] = trans_a
        task[t, 3] = trans_b
        task[t, 4] = parts[p, 0]
        task[t, 5] = parts[p, 1]
        task[t, 6] = k
        task[t, 7] = a + parts[p, 2]
        task[t, 8] = lda
        task[t, 9] = b + parts[p, 3]
        task[t, 10] = ldb
        task[t, 11] = c + parts[p, 4]
        task[t, 12] = ldc
        _, asleep = post(ctrl, task, t, GEMM_F64 if f64 else GEMM_F32)
        if asleep:
            sleepers |= 1 << t
    return sleepers


@jit
def gemm_and_wait(ctrl, address, f64, parts, trans_a, trans_b, k, a, lda, b, ldb, c, ldc, polite):
    """Piece 0 of the GEMM `post_gemm` posted, here; then wait for the other pieces."""
    if f64:
        gemm(address, np.int32(trans_a), np.int32(trans_b), parts[0, 0], parts[0, 1], k, 1.0, a + parts[0, 2], lda,
             b + parts[0, 3], ldb, 0.0, c + parts[0, 4], ldc)
    else:
        gemm(address, np.int32(trans_a), np.int32(trans_b), parts[0, 0], parts[0, 1], k, np.float32(1.0),
             a + parts[0, 2], lda, b + parts[0, 3], ldb, np.float32(0.0), c + parts[0, 4], ldc)
    for t in range(parts.shape[0] - 1):
        wait(ctrl, t, polite)


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
