"""Collectives on arrays, over one MPI communicator (plus NCCL for GPU arrays).

`Communicator(mpi_comm, name)` wraps an mpi4py communicator. Host (NumPy) arrays
travel with mpi4py's buffer methods (upper-case, never pickle). CuPy arrays use an
NCCL communicator over the same ranks when every rank has its own GPU, and are
staged through host memory and MPI otherwise.

Every op is recorded in the flight recorder (`watchdog.recorder`) and numbered per
communicator. Blocking ops on host arrays call MPI's blocking functions (MPICH's
blocking collectives are faster than its non-blocking ones); the watchdog's monitor
thread watches them and aborts the job with a report across ranks when one waits
longer than `watchdog.timeout()`. Non-blocking ops (`Handle.wait()`) and GPU ops are
completed by one polling loop (`_wait`) that yields the core to ranks sharing it and
raises `watchdog.CommTimeout` when the monitor reports a timeout. Without
MPI_THREAD_MULTIPLE (no monitor) every op polls and times out on its own.

Aliasing: blocking ops other than `broadcast`/`recv` never modify their input, but
on a size-1 communicator every op returns its input object itself (nothing to do),
so do not mutate a result in place while still needing the input. `broadcast`,
`recv` and `iall_reduce` (on a contiguous input) work in place, like MPI. Large
results live in recycled memory that no live array (or view) still uses.
"""

from __future__ import annotations

import math
import os
import sys
import time
import zlib
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from hpcpar import backend, watchdog

_REDUCE_OPS = {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX}

# Polling. MPI moves data only inside MPI calls, so while a transfer can still be
# running the loop calls Test() back to back, yielding the core every few polls
# (ranks that share cores would otherwise starve the peer they wait for; MPICH's
# own blocking wait yields too). That phase lasts _SPIN_S, or longer for big
# messages (bytes / _SPIN_BYTES_PER_S). A wait beyond it means a peer is late:
# the loop then sleeps between polls, from _FIRST_SLEEP_S doubling up to
# _MAX_SLEEP_S, to give the core away. bench/allreduce.py measures the cost.
_POLLS_PER_YIELD = 4
_SPIN_S = 5e-3
_SPIN_BYTES_PER_S = 2.5e8
_FIRST_SLEEP_S = 1e-6
_MAX_SLEEP_S = 1e-3

# Result buffers of at least _POOL_MIN_BYTES are recycled (see Communicator._result);
# each communicator keeps at most _POOL_BUFFERS of them.
_POOL_MIN_BYTES = 64 * 1024
_POOL_BUFFERS = 8


class Handle:
    """A started operation. `wait()` completes it and returns its result (idempotent)."""

    def __init__(self, complete: Callable[[], Any], keep: Any = None):
        self._complete: Callable[[], Any] | None = complete
        self._keep = keep  # a buffer MPI uses until the op completes
        self._result: Any = None

    @classmethod
    def ready(cls, value: Any) -> "Handle":
        """A handle whose op had nothing to do (size-1 communicator)."""
        return cls(lambda: value)

    def wait(self) -> Any:
        if self._complete is not None:
            complete, self._complete = self._complete, None
            self._result = complete()
            self._keep = None
        return self._result


class _EventRequest:
    """A CUDA event behind the `Test()` interface of an MPI request (for NCCL ops)."""

    def __init__(self, stream):
        import cupy
        self._event = cupy.cuda.Event(block=False, disable_timing=True)
        self._event.record(stream)

    def Test(self) -> bool:  # noqa: N802 - mirrors mpi4py's Request.Test
        return self._event.done


class _Nccl:
    """An NCCL communicator over the ranks of an MPI communicator (one GPU per rank).

    NCCL ops are queued on the current CuPy stream in call order; point-to-point
    messages have no tags, so sends and recvs between two ranks must be posted in
    matching order.
    """

    def __init__(self, mpi_comm: MPI.Comm):
        from cupy.cuda import nccl
        self.nccl = nccl
        uid = np.zeros(128, dtype=np.int64)  # NCCL_UNIQUE_ID_BYTES
        if mpi_comm.rank == 0:
            uid[:] = nccl.get_unique_id()
        mpi_comm.Bcast([uid, MPI.INT64_T], root=0)
        self.comm = nccl.NcclCommunicator(mpi_comm.size, tuple(int(v) for v in uid), mpi_comm.rank)
        self.ops = {"sum": nccl.NCCL_SUM, "avg": nccl.NCCL_SUM, "max": nccl.NCCL_MAX}

    @staticmethod
    def stream():
        import cupy
        return cupy.cuda.get_current_stream()

    def done(self) -> _EventRequest:
        return _EventRequest(self.stream())


def _nccl_possible(mpi_comm: MPI.Comm) -> bool:
    """True when NCCL loads and no two ranks of `mpi_comm` share a GPU (collective)."""
    try:
        import cupy
        from cupy.cuda import nccl
        ok = bool(nccl.available)
        device = cupy.cuda.Device().id
    except Exception:  # no NCCL build: host staging still works
        ok, device = False, -1
    # (host, device) identifies a GPU; a CRC of the host name keeps the exchange a fixed-size buffer
    # (not hash(): string hashes differ between processes).
    mine = np.array([zlib.crc32(MPI.Get_processor_name().encode()), device, int(ok)], dtype=np.int64)
    every = np.empty((mpi_comm.size, 3), dtype=np.int64)
    mpi_comm.Allgather([mine, MPI.INT64_T], [every, MPI.INT64_T])
    pairs = {(int(h), int(d)) for h, d, _ in every}
    return bool(every[:, 2].all()) and len(pairs) == mpi_comm.size


def _contiguous(a):
    return a if a.flags.c_contiguous else backend.array_module(a).ascontiguousarray(a)


def _to_front(a, dim: int):
    """`a` with `dim` moved first, C-contiguous (no copy when dim is 0 and `a` is contiguous)."""
    xp = backend.array_module(a)
    return _contiguous(xp.moveaxis(a, dim, 0) if dim else a)


def _from_front(a, dim: int):
    xp = backend.array_module(a)
    return xp.ascontiguousarray(xp.moveaxis(a, 0, dim)) if dim else a


def _reduce_dtype(dtype) -> np.dtype:
    """The dtype a reduction runs in: the array's own, or float32 when MPI has no such type."""
    return np.dtype(dtype) if backend.mpi_datatype(dtype) is not None else np.dtype(np.float32)


class Communicator:
    """Array collectives over the ranks of `mpi_comm`; `name` labels it in errors and records.

    Shapes: `all_reduce`/`broadcast` keep the shape; `reduce_scatter(a, dim)` divides
    `a.shape[dim]` by `size` (rank r keeps part r of the sum); `all_gather(a, dim)`
    multiplies it by `size` (rank r's `a` becomes part r); `all_to_all(a, dim)` keeps
    the shape and sends part j of `a` along `dim` to rank j, whose result holds the
    parts it received in rank order.
    """

    def __init__(self, mpi_comm: MPI.Comm, name: str):
        self.mpi = mpi_comm
        self.name = name
        self.size: int = mpi_comm.Get_size()
        self.rank: int = mpi_comm.Get_rank()
        self._seq = 0
        # This communicator's world ranks, for watchdog reports ("0,2": a str caches its hash).
        group, world = mpi_comm.Get_group(), MPI.COMM_WORLD.Get_group()
        self._group = ",".join(map(str, MPI.Group.Translate_ranks(group, list(range(self.size)), world)))
        group.Free()
        world.Free()
        self._blocking = watchdog.monitor()  # blocking MPI calls only when a monitor can watch them
        self._checked: list[str] = []  # debug mode: collectives since the last sequence check
        self._check_hash = 0
        self._nccl: _Nccl | None | bool = None  # None: not decided yet; False: stage through host
        self._pool: list[np.ndarray] = []  # byte buffers behind earlier results (see _result)

    def __repr__(self) -> str:
        return f"Communicator({self.name!r}, rank {self.rank} of {self.size})"

    def free(self) -> None:
        """Release the MPI communicator (not COMM_WORLD/COMM_SELF, which MPI owns)."""
        if self.mpi not in (MPI.COMM_WORLD, MPI.COMM_SELF) and self.mpi != MPI.COMM_NULL:
            self.mpi.Free()

    # -- issuing and waiting --------------------------------------------------------------------

    def _begin(self, op: str, a, peer: int | None = None, blocking: bool = False) -> watchdog.OpRecord:
        """Number and record an op (`blocking`: a blocking MPI call, watched by the monitor)."""
        if peer is None and watchdog.check_every():
            self._check_sequence(op, a)
        seq, self._seq = self._seq, self._seq + 1
        if a is None:
            return watchdog.recorder.begin(self.name, seq, op, (), "", 0, peer, self._group, blocking)
        return watchdog.recorder.begin(self.name, seq, op, a.shape, a.dtype, a.nbytes, peer, self._group,
                                       blocking)

    def _issue(self, record: watchdog.OpRecord, call: str, *args):
        """Run MPI's blocking `call` (e.g. "Allreduce") for a blocking record and return None,
        else start its non-blocking form ("Iallreduce") and return the request."""
        if record.blocking:
            try:
                getattr(self.mpi, call)(*args)
            finally:  # an MPI error must not leave the op pending for the monitor to time out
                watchdog.recorder.end(record)
            return None
        return getattr(self.mpi, "I" + call[0].lower() + call[1:])(*args)

    def _wait(self, request, record: watchdog.OpRecord) -> None:
        """Poll `request.Test()` until done; raise CommTimeout when the watchdog reports a timeout.

        The monitor thread delivers its report (`record.report`); with no monitor, or none
        delivered, this raises on its own past the timeout (plus a grace period with a monitor).
        """
        if not request.Test():
            watchdog.recorder.waiting(record)
            since = record.waiting
            limit = watchdog.timeout() + (watchdog.DELIVERY_GRACE_S if self._blocking else 0.0)
            spin_until = since + max(_SPIN_S, record.nbytes / _SPIN_BYTES_PER_S)
            delay = _FIRST_SLEEP_S
            polls = 0
            while not request.Test():
                polls += 1
                if polls % _POLLS_PER_YIELD:
                    continue
                now = time.monotonic()
                if now < spin_until:
                    os.sched_yield()
                    continue
                if record.report is not None or now - since > limit:
                    error = watchdog.CommTimeout(record, now - since, record.report)
                    record.report = str(error)  # reported: the monitor leaves it alone from now on
                    raise error
                time.sleep(delay)
                delay = min(2 * delay, _MAX_SLEEP_S)
        watchdog.recorder.end(record)

    def _handle(self, request, record: watchdog.OpRecord, finish: Callable[[], Any],
                keep: Any = None) -> Handle:
        """A handle that waits for `request` (None: the op already completed) and then `finish`es."""
        if request is None:
            return Handle(finish)

        def complete() -> Any:
            self._wait(request, record)
            return finish()
        return Handle(complete, keep)

    def _check_sequence(self, op: str, a) -> None:
        """Debug mode: every `watchdog.check_every()` collectives, before issuing the next, the
        ranks compare a hash of their collectives (op, dtype, shape) since the last check and
        raise OpSequenceMismatch naming the first one that differs. Collective over this comm."""
        what = f"{op} {a.dtype}{list(a.shape)}" if a is not None else op
        self._checked.append((self._seq, what))
        self._check_hash = zlib.crc32(what.encode(), self._check_hash)
        if len(self._checked) < watchdog.check_every() or self.size == 1:
            return
        mine = np.array([len(self._checked), self._check_hash], dtype=np.int64)
        every = np.empty((self.size, 2), dtype=np.int64)
        record = watchdog.recorder.begin(self.name, self._seq, "debug_check", (2,), mine.dtype, 16, None,
                                         self._group)
        self._wait(self.mpi.Iallgather([mine, MPI.INT64_T], [every, MPI.INT64_T]), record)
        checked, self._checked = self._checked, []
        if (every == every[0]).all():
            return
        lists = self.mpi.allgather(checked)  # debug only: pickled (seq, op description) pairs
        first = next(i for i in range(max(map(len, lists)))
                     if len({ops[i][1] if i < len(ops) else None for ops in lists}) > 1)
        world = self._group.split(",")
        ranks = "; ".join(f"rank {world[r]}: " + (f"#{ops[first][0]} {ops[first][1]}" if first < len(ops)
                                                  else "(nothing)") for r, ops in enumerate(lists))
        raise watchdog.OpSequenceMismatch(
            f"the ranks of communicator '{self.name}' issued different collectives; the first that "
            f"differs is collective {first + 1} since the last check: {ranks}")

    # -- result buffers -------------------------------------------------------------------------

    def _result(self, shape: tuple, dtype, xp) -> Any:
        """A new result array, in memory recycled from earlier results nobody holds any more.

        MPI libraries cache per-address work for large buffers (registration, mappings):
        receiving into brand-new memory every call made a 1 MiB all_reduce 2-3x slower
        than receiving into a reused buffer (bench/allreduce.py). A pooled buffer is
        handed out as a view, so while the caller (or any view of the result) is alive
        its refcount keeps it out of reuse; CuPy has its own memory pool.
        """
        dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize  # not np.prod: 4 us a call, a third of the op
        if xp is not np or nbytes < _POOL_MIN_BYTES:
            return xp.empty(shape, dtype=dtype)
        for buf in self._pool:
            # References: the pool's list, `buf`, and getrefcount's argument; more means in use.
            if buf.nbytes == nbytes and sys.getrefcount(buf) <= 3:
                return buf.view(dtype).reshape(shape)
        buf = np.empty(nbytes, dtype=np.uint8)
        if len(self._pool) >= _POOL_BUFFERS:
            self._pool.pop(0)  # the oldest buffer goes back to the allocator once its holders drop it
        self._pool.append(buf)
        return buf.view(dtype).reshape(shape)

    # -- GPU arrays -----------------------------------------------------------------------------

    def _nccl_comm(self) -> _Nccl | None:
        """The NCCL communicator, created on the first GPU op (collective), or None to stage."""
        if self._nccl is None:
            self._nccl = _Nccl(self.mpi) if _nccl_possible(self.mpi) else False
        return self._nccl or None

    def _staged(self, start: Callable[..., Handle], a, *args, into=None) -> Handle:
        """Run a host op on a copy of GPU array `a`; the result comes back to the GPU
        (into `into` when given, for the in-place ops)."""
        host = start(backend.to_host(a), *args)
        xp = backend.array_module(a)

        def complete():
            result = xp.asarray(host.wait())
            if into is None:
                return result
            into[...] = result
            return into
        return Handle(complete)

    # -- reductions -----------------------------------------------------------------------------

    def _check_op(self, what: str, op: str, a, allowed=("sum", "avg", "max")) -> None:
        if op not in allowed:
            raise ValueError(f"{what} on '{self.name}': unknown op {op!r}; use one of {', '.join(allowed)}")
        if op == "avg" and not np.issubdtype(np.dtype(a.dtype), np.inexact):
            raise ValueError(f"{what} on '{self.name}': op 'avg' needs a floating dtype, got {a.dtype}")

    def iall_reduce(self, a, op: str = "sum") -> Handle:
        """Start an all-reduce; `wait()` returns the reduced array (same shape).

        In place on `a` when `a` is contiguous; otherwise on a contiguous copy.
        """
        return self._iall_reduce(a, op, in_place=True)

    def all_reduce(self, a, op: str = "sum"):
        """Elementwise sum/avg/max of `a` over the ranks (replicated result); `a` is not modified."""
        return self._iall_reduce(a, op, in_place=False, blocking=self._blocking).wait()

    def _iall_reduce(self, a, op: str, in_place: bool, blocking: bool = False) -> Handle:
        self._check_op("all_reduce", op, a)
        if self.size == 1:
            return Handle.ready(a)
        if backend.is_device_array(a):
            nccl = self._nccl_comm()
            if nccl is None:
                return self._staged(self._iall_reduce, a, op, in_place,
                                    into=a if in_place and a.flags.c_contiguous else None)
            send = _contiguous(a)
            recv = send if in_place else backend.array_module(a).empty_like(send)
            ptr, count, dtype = backend.nccl_buffer(send)
            record = self._begin("all_reduce", a)
            nccl.comm.allReduce(ptr, recv.data.ptr, count, dtype, nccl.ops[op], nccl.stream().ptr)
            request = nccl.done()
        else:
            record = self._begin("all_reduce", a, blocking=blocking)
            send = _contiguous(a)
            work_dtype = _reduce_dtype(a.dtype)
            if work_dtype != send.dtype:  # e.g. bfloat16: reduce in float32, cast back at the end
                send = send.astype(work_dtype)
                recv = send
            else:  # reduce in place on `a` when asked, or on the copy a strided `a` needed anyway
                recv = send if in_place or send is not a else self._result(send.shape, send.dtype, np)
            spec = backend.mpi_buffer(recv)
            sendbuf = MPI.IN_PLACE if recv is send else backend.mpi_buffer(send)
            request = self._issue(record, "Allreduce", sendbuf, spec, _REDUCE_OPS[op])

        def finish():
            if op == "avg":
                recv[...] /= self.size
            if recv.dtype == a.dtype:
                return recv
            if in_place and a.flags.c_contiguous:
                a[...] = recv
                return a
            return recv.astype(a.dtype)
        return self._handle(request, record, finish)

    def ireduce_scatter(self, a, dim: int = 0, op: str = "sum") -> Handle:
        """Start a reduce-scatter; `wait()` returns this rank's part of the reduction.

        `a`: [..., n, ...] (n at `dim`, n divisible by size) -> [..., n/size, ...], part `rank`.
        """
        return self._ireduce_scatter(a, dim, op)

    def _ireduce_scatter(self, a, dim: int, op: str, blocking: bool = False) -> Handle:
        self._check_op("reduce_scatter", op, a, allowed=("sum", "avg"))
        dim = self._dim_divisible("reduce_scatter", a, dim)
        if self.size == 1:
            return Handle.ready(a)
        xp = backend.array_module(a)
        nccl = self._nccl_comm() if backend.is_device_array(a) else None
        if backend.is_device_array(a) and nccl is None:
            return self._staged(self.ireduce_scatter, a, dim, op)
        record = self._begin("reduce_scatter", a, blocking=blocking and nccl is None)
        send = _to_front(a, dim)
        work_dtype = _reduce_dtype(a.dtype)
        if work_dtype != send.dtype:
            send = send.astype(work_dtype)
        recv = self._result((send.shape[0] // self.size,) + send.shape[1:], send.dtype, xp)
        if nccl is not None:
            ptr, count, dtype = backend.nccl_buffer(recv)
            nccl.comm.reduceScatter(send.data.ptr, ptr, count, dtype, nccl.ops[op], nccl.stream().ptr)
            request = nccl.done()
        else:
            spec = backend.mpi_buffer(recv)
            request = self._issue(record, "Reduce_scatter_block", [send, spec[2]], [recv, spec[2]],
                                  _REDUCE_OPS[op])

        def finish():
            if op == "avg":
                recv[...] /= self.size
            return _from_front(recv.astype(a.dtype, copy=False), dim)
        return self._handle(request, record, finish)

    def reduce_scatter(self, a, dim: int = 0, op: str = "sum"):
        """Sum (or avg) over ranks, keeping part `rank` of `dim`: [.., n, ..] -> [.., n/size, ..]."""
        return self._ireduce_scatter(a, dim, op, blocking=self._blocking).wait()

    # -- data movement --------------------------------------------------------------------------

    def iall_gather(self, a, dim: int = 0) -> Handle:
        """Start an all-gather; `wait()` returns [..., size*m, ...] with rank r's `a` as part r."""
        return self._iall_gather(a, dim)

    def _iall_gather(self, a, dim: int, blocking: bool = False) -> Handle:
        dim = self._dim("all_gather", a, dim)
        if self.size == 1:
            return Handle.ready(a)
        xp = backend.array_module(a)
        nccl = self._nccl_comm() if backend.is_device_array(a) else None
        if backend.is_device_array(a) and nccl is None:
            return self._staged(self.iall_gather, a, dim)
        record = self._begin("all_gather", a, blocking=blocking and nccl is None)
        send = _to_front(a, dim)
        recv = self._result((send.shape[0] * self.size,) + send.shape[1:], send.dtype, xp)
        if nccl is not None:
            ptr, count, dtype = backend.nccl_buffer(send)
            nccl.comm.allGather(ptr, recv.data.ptr, count, dtype, nccl.stream().ptr)
            request = nccl.done()
        else:
            spec = backend.mpi_buffer(send)
            request = self._issue(record, "Allgather", spec, [recv, spec[2]])
        return self._handle(request, record, lambda: _from_front(recv, dim))

    def all_gather(self, a, dim: int = 0):
        """Concatenate every rank's `a` along `dim` in rank order: [.., m, ..] -> [.., size*m, ..]."""
        return self._iall_gather(a, dim, blocking=self._blocking).wait()

    def iall_to_all(self, a, dim: int = 0) -> Handle:
        """Start an all-to-all; `wait()` returns an array shaped like `a` (see `all_to_all`)."""
        return self._iall_to_all(a, dim)

    def _iall_to_all(self, a, dim: int, blocking: bool = False) -> Handle:
        dim = self._dim_divisible("all_to_all", a, dim)
        if self.size == 1:
            return Handle.ready(a)
        xp = backend.array_module(a)
        nccl = self._nccl_comm() if backend.is_device_array(a) else None
        if backend.is_device_array(a) and nccl is None:
            return self._staged(self.iall_to_all, a, dim)
        record = self._begin("all_to_all", a, blocking=blocking and nccl is None)
        send = _to_front(a, dim)
        recv = self._result(send.shape, send.dtype, xp)
        if nccl is not None:
            part = send.shape[0] // self.size
            stream = nccl.stream().ptr
            nccl.nccl.groupStart()
            for peer in range(self.size):
                _, count, dtype = backend.nccl_buffer(send[peer * part:(peer + 1) * part])
                nccl.comm.send(send[peer * part].data.ptr, count, dtype, peer, stream)
                nccl.comm.recv(recv[peer * part].data.ptr, count, dtype, peer, stream)
            nccl.nccl.groupEnd()
            request = nccl.done()
        else:
            spec = backend.mpi_buffer(send)
            request = self._issue(record, "Alltoall", [send, spec[2]], [recv, spec[2]])
        return self._handle(request, record, lambda: _from_front(recv, dim))

    def all_to_all(self, a, dim: int = 0):
        """Part j of `a` along `dim` goes to rank j; the result holds part `rank` of every rank's
        `a`, in rank order along `dim` (same shape as `a`; `a.shape[dim]` divisible by size)."""
        return self._iall_to_all(a, dim, blocking=self._blocking).wait()

    def ibroadcast(self, a, root: int = 0) -> Handle:
        """Start a broadcast of root's `a` into every rank's `a` (in place); `wait()` returns `a`."""
        return self._ibroadcast(a, root)

    def _ibroadcast(self, a, root: int, blocking: bool = False) -> Handle:
        self._check_rank("broadcast", root, "root")
        if self.size == 1:
            return Handle.ready(a)
        nccl = self._nccl_comm() if backend.is_device_array(a) else None
        if backend.is_device_array(a) and nccl is None:
            return self._staged(self.ibroadcast, a, root, into=a)
        record = self._begin("broadcast", a, blocking=blocking and nccl is None)
        buf = _contiguous(a)
        if nccl is not None:
            ptr, count, dtype = backend.nccl_buffer(buf)
            nccl.comm.bcast(ptr, count, dtype, root, nccl.stream().ptr)
            request = nccl.done()
        else:
            request = self._issue(record, "Bcast", backend.mpi_buffer(buf), root)

        def finish():
            if buf is not a:
                a[...] = buf
            return a
        return self._handle(request, record, finish)

    def broadcast(self, a, root: int = 0):
        """Root's `a` into every rank's `a`, in place like MPI_Bcast (same shape and dtype on
        every rank); returns `a`."""
        return self._ibroadcast(a, root, blocking=self._blocking).wait()

    def isend(self, a, dest: int, tag: int = 0) -> Handle:
        """Start sending `a` to rank `dest`; `wait()` returns None once `a` may be reused."""
        return self._isend(a, dest, tag)

    def _isend(self, a, dest: int, tag: int, blocking: bool = False) -> Handle:
        self._check_rank("send", dest, "dest")
        if backend.is_device_array(a):
            nccl = self._nccl_comm()
            if nccl is None:
                return self._staged(self.isend, a, dest, tag)
            buf = _contiguous(a)
            record = self._begin("send", a, peer=dest)
            ptr, count, dtype = backend.nccl_buffer(buf)
            nccl.comm.send(ptr, count, dtype, dest, nccl.stream().ptr)
            request = nccl.done()
        else:
            buf = _contiguous(a)
            record = self._begin("send", a, peer=dest, blocking=blocking)
            request = self._issue(record, "Send", backend.mpi_buffer(buf), dest, tag)
        # MPI reads `buf` until the send completes: the handle keeps it referenced till then.
        return self._handle(request, record, lambda: None, keep=buf)

    def send(self, a, dest: int, tag: int = 0) -> None:
        """Send `a` to rank `dest` (matched by a `recv` with the same tag there)."""
        self._isend(a, dest, tag, blocking=self._blocking).wait()

    def irecv(self, out, source: int, tag: int = 0) -> Handle:
        """Start receiving into `out` from rank `source`; `wait()` returns `out` filled."""
        return self._irecv(out, source, tag)

    def _irecv(self, out, source: int, tag: int, blocking: bool = False) -> Handle:
        self._check_rank("recv", source, "source")
        if backend.is_device_array(out):
            nccl = self._nccl_comm()
            if nccl is None:
                return self._staged(self.irecv, out, source, tag, into=out)
        else:
            nccl = None
        buf = out if out.flags.c_contiguous else backend.array_module(out).empty_like(out, order="C")
        record = self._begin("recv", out, peer=source, blocking=blocking and nccl is None)
        if nccl is not None:
            ptr, count, dtype = backend.nccl_buffer(buf)
            nccl.comm.recv(ptr, count, dtype, source, nccl.stream().ptr)
            request = nccl.done()
        else:
            request = self._issue(record, "Recv", backend.mpi_buffer(buf), source, tag)

        def finish():
            if buf is not out:
                out[...] = buf
            return out
        return self._handle(request, record, finish)

    def recv(self, out, source: int, tag: int = 0):
        """Receive into `out` (shape and dtype as sent) from rank `source`; returns `out`."""
        return self._irecv(out, source, tag, blocking=self._blocking).wait()

    def ibarrier(self) -> Handle:
        """Start a barrier; `wait()` returns once every rank has started it."""
        return self._ibarrier()

    def _ibarrier(self, blocking: bool = False) -> Handle:
        if self.size == 1:
            return Handle.ready(None)
        record = self._begin("barrier", None, blocking=blocking)
        return self._handle(self._issue(record, "Barrier"), record, lambda: None)

    def barrier(self) -> None:
        """Wait until every rank of the communicator arrives."""
        self._ibarrier(blocking=self._blocking).wait()

    # -- argument checks ------------------------------------------------------------------------

    def _dim(self, what: str, a, dim: int) -> int:
        if not -a.ndim <= dim < a.ndim:
            raise ValueError(f"{what} on '{self.name}': dim {dim} is out of range for shape {tuple(a.shape)}")
        return dim % a.ndim

    def _dim_divisible(self, what: str, a, dim: int) -> int:
        dim = self._dim(what, a, dim)
        if a.shape[dim] % self.size:
            raise ValueError(f"{what} on '{self.name}': dim {dim} of shape {tuple(a.shape)} has size "
                             f"{a.shape[dim]}, which does not divide into {self.size} equal parts")
        return dim

    def _check_rank(self, what: str, rank: int, role: str) -> None:
        if not 0 <= rank < self.size:
            raise ValueError(f"{what} on '{self.name}': {role} {rank} is not a rank of this "
                             f"communicator (ranks 0..{self.size - 1})")


# ---- Differentiable collectives (Megatron f/g and friends) ----
# Tensor ops whose backward is the adjoint collective, so tensor-parallel model code reads as
# plain math plus these calls. Layouts over the ranks of `comm`:
#   replicated      every rank holds the same full value; ranks compute identically from it
#                   unless it enters a sharded GEMM (then its gradient is a partial sum).
#   partial-sum     the value is the sum of the ranks' arrays.
#   sharded(dim)    rank r holds part r (equal parts, rank order) along `dim`.
# With `comm` None or of size 1 every op returns its input itself: no graph node, no cost.

from hpcpar.ops import _result  # noqa: E402  (this section builds on the array Communicator above)
from hpcpar.tensor import Tensor  # noqa: E402


def _trivial(comm: Communicator | None) -> bool:
    return comm is None or comm.size == 1


def _part(a, comm: Communicator, dim: int):
    """Part `comm.rank` of `a` along `dim` (a C-contiguous copy); `a.shape[dim]` must divide evenly."""
    dim = dim % a.ndim
    n = a.shape[dim]
    if n % comm.size:
        raise ValueError(f"split on '{comm.name}': dim {dim} of shape {tuple(a.shape)} has size {n}, "
                         f"which does not divide into {comm.size} equal parts")
    part = n // comm.size
    index = (slice(None),) * dim + (slice(comm.rank * part, (comm.rank + 1) * part),)
    return backend.array_module(a).ascontiguousarray(a[index])


def copy_to(x: Tensor, comm: Communicator | None) -> Tensor:
    """Megatron's f, at the entry of a region whose ranks differ (sharded GEMMs).

    In: replicated. Out: replicated (the same array). Backward: all-reduce (sum), because
    each rank's gradient is only its shard's contribution (partial-sum -> replicated).
    """
    if _trivial(comm):
        return x
    return _result(x.data, (x,), lambda g: (comm.all_reduce(g),))


def reduce_from(x: Tensor, comm: Communicator | None) -> Tensor:
    """Megatron's g, at the exit of a sharded region.

    In: partial-sum. Out: replicated (all-reduce, sum). Backward: identity (the gradient of
    a replicated value is already complete on every rank).
    """
    if _trivial(comm):
        return x
    return _result(comm.all_reduce(x.data), (x,), lambda g: (g,))


def all_gather_dim(x: Tensor, comm: Communicator | None, dim: int) -> Tensor:
    """Sequence-parallel entry: sharded(dim) -> full along `dim`, used by ranks that differ.

    In: [.., n, ..] sharded(dim). Out: [.., size*n, ..] (every rank's part, rank order).
    Backward: reduce-scatter along `dim` (partial-sum gradients -> sharded(dim)).
    """
    if _trivial(comm):
        return x
    return _result(comm.all_gather(x.data, dim), (x,), lambda g: (comm.reduce_scatter(g, dim),))


def reduce_scatter_dim(x: Tensor, comm: Communicator | None, dim: int) -> Tensor:
    """Sequence-parallel exit: partial-sum -> sharded(dim); the adjoint of `all_gather_dim`.

    In: [.., size*n, ..] partial-sum. Out: [.., n, ..], part `rank` of the sum.
    Backward: all-gather along `dim`.
    """
    if _trivial(comm):
        return x
    return _result(comm.reduce_scatter(x.data, dim), (x,), lambda g: (comm.all_gather(g, dim),))


def split_to(x: Tensor, comm: Communicator | None, dim: int) -> Tensor:
    """Keep my part: replicated -> sharded(dim), no communication forward.

    In: [.., size*n, ..] replicated. Out: [.., n, ..] part `rank`. Backward: all-gather along
    `dim`, so the replicated input's gradient is complete on every rank.
    """
    if _trivial(comm):
        return x
    return _result(_part(x.data, comm, dim), (x,), lambda g: (comm.all_gather(g, dim),))


def gather_from(x: Tensor, comm: Communicator | None, dim: int) -> Tensor:
    """Assemble the full tensor: sharded(dim) -> replicated (ranks then compute identically).

    In: [.., n, ..] sharded(dim). Out: [.., size*n, ..] replicated (all-gather).
    Backward: keep my part of the (replicated) gradient, no communication.
    """
    if _trivial(comm):
        return x
    return _result(comm.all_gather(x.data, dim), (x,), lambda g: (_part(g, comm, dim),))
