"""Transports: how an array op moves its bytes, over MPI or NCCL.

A transport starts one op from prepared contiguous buffers and returns a request with `Test()`
(or None when a blocking call already completed it). The Communicator (comm.py) prepares the
buffers and finishes the result once for every transport; only the call that moves the bytes
differs:

- `MpiTransport`: host (NumPy) arrays with mpi4py's upper-case buffer methods, blocking or
  non-blocking; a large polled all-reduce into a new array runs as `_SplitAllReduce`. `starter`
  works out once the call a repeated collective makes (the Communicator keeps it per shape).
- `NcclTransport`: CuPy arrays over an NCCL communicator of the same ranks, on its own CUDA
  stream; its requests are CUDA events (`_EventRequest`). `nccl_possible` says whether every rank
  has its own GPU and NCCL loads (otherwise GPU arrays are staged through host memory).
- `Handle`: a started op, completed by `wait()`; `bytes_sent`: the bytes an op sends.
"""

from __future__ import annotations

import zlib
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from hpcpar.runtime.buffers import DTYPE_FACTS, nccl_buffer

# A polled all-reduce of a host array into a new result of at least this many bytes runs as a
# reduce-scatter into this rank's part of the result and an in-place all-gather of the parts
# (`_SplitAllReduce`). MPI's out-of-place all-reduce first copies the input into the result and
# reduces there; the reduce-scatter reads the input where it is, so that copy is saved. MPICH 5.0,
# 4 ranks on 2 cores (bench/allreduce.py, hpcpar's all_reduce with and without it in one run):
# 1.0-1.1x at 1 MiB, 1.1-1.2x at 2 MiB, 1.2-1.5x from 4 MiB up, 0.95x at 512 KiB (two latencies
# instead of one), so smaller arrays keep MPI's all-reduce. In-place reductions (the data-parallel
# buckets) gain nothing from it (measured: slower), and an all-reduce waited for inside MPI's
# blocking call keeps the library's own tuned algorithm (a blocking reduce-scatter + all-gather
# was slower there).
_SPLIT_ALL_REDUCE_BYTES = 1 << 20


class Handle:
    """A started operation. `wait()` completes it, `complete(*args)`, and returns its result
    (idempotent). `args` (the buffers MPI uses until the op completes among them) are kept until
    then; a function and its arguments rather than a closure: ops are latency-bound."""

    __slots__ = ("_complete", "_args", "_result", "request", "record")

    def __init__(self, complete: Callable[..., Any], args: tuple = (), request: Any = None, record: Any = None):
        self._complete: Callable[..., Any] | None = complete
        self._args = args
        self._result: Any = None
        self.request = request  # what `waiting.wait_any` polls (None: nothing to poll)
        self.record = record  # the op's flight-recorder entry

    @classmethod
    def ready(cls, value: Any) -> "Handle":
        """A handle whose op had nothing to do (size-1 communicator)."""
        return cls(_identity, (value,))

    def wait(self) -> Any:
        if self._complete is not None:
            complete, self._complete = self._complete, None
            self._result = complete(*self._args)
            self._args = ()
        return self._result


def _identity(value: Any) -> Any:
    return value


# The ops a transport starts. "send"/"recv" name a peer, "broadcast" a root (as peer); "all_to_all_v"
# also takes `counts`: (send, recv) elements per rank.
KINDS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "all_to_all_v", "broadcast", "send", "recv",
         "barrier")


def bytes_sent(op: str, nbytes: int, size: int) -> float:
    """Bytes one rank sends for one op over `size` ranks whose input (as the op records it) is
    `nbytes` long: what a bandwidth-optimal algorithm sends (ring or Rabenseifner; nccl-tests'
    bus-bandwidth factors), whatever algorithm the MPI library picks.

        all_reduce       2 (n-1)/n · S     (S = the whole array)
        reduce_scatter     (n-1)/n · S     (S = the whole input, n parts)
        all_gather         (n-1)   · S     (S = this rank's piece: it reaches n-1 others)
        all_to_all         (n-1)/n · S     (S = the whole input: all parts but its own leave)
        all_to_all_v       the rows that leave the rank (counted by the op itself, not here)
        broadcast          S on the root, 0 elsewhere (the data that leaves the root)
        send               S;  recv, barrier: 0
    """
    return send_factor(op, size) * nbytes


def send_factor(op: str, n: int) -> float:
    """bytes_sent(op, S, n) / S (a Communicator keeps it per op kind)."""
    if n <= 1:
        return 0.0
    return {"all_reduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n, "all_gather": n - 1,
            "all_to_all": (n - 1) / n, "send": 1.0, "broadcast": 1.0}.get(op, 0.0)


class MpiTransport:
    """Host arrays over MPI's buffer methods (never pickled).

    Blocking calls (`blocking=True`) are used when the watchdog's monitor thread watches them
    (MPICH's blocking collectives are faster than its non-blocking ones); otherwise the
    non-blocking form starts the op and the Communicator polls it.
    """

    # kind -> the names of its (blocking, non-blocking) mpi4py methods
    _CALLS = {kind: (name, "I" + name[0].lower() + name[1:]) for kind, name in (
        ("all_reduce", "Allreduce"), ("all_gather", "Allgather"),
        ("all_to_all", "Alltoall"), ("all_to_all_v", "Alltoallv"), ("broadcast", "Bcast"), ("send", "Send"),
        ("recv", "Recv"), ("barrier", "Barrier"))}
    # MPICH's Ireduce_scatter_block takes 1.6-1.9x as long as its Reduce_scatter_block from 512 KiB
    # to 1 MiB on 4 ranks (another algorithm), its Ireduce_scatter with equal counts 1.1x: the
    # non-blocking reduce-scatter is the latter (same bytes, any size; measured side by side).
    _CALLS["reduce_scatter"] = ("Reduce_scatter_block", "Ireduce_scatter")
    _REDUCE_OPS = {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}  # avg: sum, divided when finished
    xp = np  # the array module of this transport's buffers

    def __init__(self, mpi_comm: MPI.Comm):
        self.comm = mpi_comm
        self.size, self.rank = mpi_comm.Get_size(), mpi_comm.Get_rank()
        self._parts: dict[int, tuple] = {}  # elements -> parts (see `parts`)

    def parts(self, elements: int) -> tuple[list, list, int, int]:
        """`elements` split into one part per rank in rank order, the longer parts first: (counts,
        starts, this rank's first element, its end), worked out once per size (an op's path)."""
        found = self._parts.get(elements)
        if found is None:
            base, longer = divmod(elements, self.size)
            counts = [base + 1] * longer + [base] * (self.size - longer)
            starts = _displacements(counts)
            if len(self._parts) >= 64:  # sizes come and go (evaluation, a changed batch): keep the recent
                self._parts.clear()
            found = self._parts[elements] = (counts, starts, starts[self.rank], starts[self.rank] + counts[self.rank])
        return found

    def start(self, kind: str, send, recv, op: str | None = None, peer: int | None = None, tag: int = 0,
              blocking: bool = False, counts: tuple | None = None):
        if kind == "all_reduce" or kind == "reduce_scatter" or kind == "all_gather":
            return self.starter(kind, recv.dtype, op, blocking, send is recv, send.size, recv.nbytes)(send, recv)
        call = getattr(self.comm, self._CALLS[kind][0 if blocking else 1])
        if kind == "send":
            return call([send, DTYPE_FACTS[send.dtype][0]], peer, tag)
        if kind == "recv":
            return call([recv, DTYPE_FACTS[recv.dtype][0]], peer, tag)
        if kind == "broadcast":
            return call([recv, DTYPE_FACTS[recv.dtype][0]], peer)
        if kind == "barrier":
            return call()
        datatype = DTYPE_FACTS[recv.dtype][0]
        if kind == "all_to_all_v":
            # [buffer, (counts, displacements), datatype] per side; counts in elements of the datatype.
            return call(*([buf, (c, _displacements(c)), datatype] for buf, c in zip((send, recv), counts)))
        return call(MPI.IN_PLACE if send is recv else [send, datatype], [recv, datatype])

    def exchange(self, send, dest: int, send_tag: int, recv, source: int, recv_tag: int) -> tuple:
        """Start receiving contiguous `recv` from `source` and sending contiguous `send` to `dest`
        (the receive posted first, as MPI_Sendrecv does); returns the (send, receive) requests."""
        comm = self.comm
        receive = comm.Irecv([recv, DTYPE_FACTS[recv.dtype][0]], source, recv_tag)
        return comm.Isend([send, DTYPE_FACTS[send.dtype][0]], dest, send_tag), receive

    def starter(self, kind: str, dtype, op: str | None, blocking: bool, in_place: bool, elements: int,
                nbytes: int) -> Callable:
        """The call `(send, recv) -> request` (None when `blocking`) that starts an all_reduce,
        reduce_scatter or all_gather on contiguous host buffers: `recv` of `dtype` and `nbytes`,
        `send` of `elements` (`recv` itself when `in_place`). Worked out once per op, shape and
        dtype and kept by the Communicator (`Communicator._plans`): each call then does nothing
        before MPI but build the two buffer specs."""
        call = getattr(self.comm, self._CALLS[kind][0 if blocking else 1])
        datatype = DTYPE_FACTS[dtype][0]
        if kind == "all_gather":
            return lambda send, recv: call([send, datatype], [recv, datatype])
        reduce_op = self._REDUCE_OPS[op]
        if kind == "reduce_scatter":
            if blocking:
                return lambda send, recv: call([send, datatype], [recv, datatype], reduce_op)
            counts = [elements // self.size] * self.size  # Ireduce_scatter: every rank's count
            return lambda send, recv: call([send, datatype], [recv, datatype], counts, reduce_op)
        if in_place:
            return lambda send, recv: call(MPI.IN_PLACE, [recv, datatype], reduce_op)
        if not blocking and nbytes >= _SPLIT_ALL_REDUCE_BYTES and elements >= self.size:
            return lambda send, recv: _SplitAllReduce(self, send, recv, datatype, reduce_op)
        return lambda send, recv: call([send, datatype], [recv, datatype], reduce_op)


class _SplitAllReduce:
    """An out-of-place all-reduce of `send` into `recv` (contiguous, same shape, at least one
    element per rank) in two MPI ops behind one `Test()`: a reduce-scatter of `send` into this
    rank's part of `recv` (the parts split the flat array in rank order, the longer ones first),
    then, once it completed, an in-place all-gather of the parts into `recv`. Every rank ends with
    the same bits (each part is reduced once, by its owner), in MPI's reduce-scatter order of
    summation. See `_SPLIT_ALL_REDUCE_BYTES` for when it is used and why."""

    __slots__ = ("_request", "_gather")

    def __init__(self, transport: MpiTransport, send, recv, datatype, op):
        flat = recv.reshape(-1)
        counts, starts, first, end = transport.parts(flat.size)
        comm = transport.comm
        self._request = comm.Ireduce_scatter([send, datatype], [flat[first:end], datatype], counts, op)
        self._gather = (comm, [flat, (counts, starts), datatype])  # started by the Test that sees phase 1 done

    def Test(self) -> bool:  # noqa: N802 - mirrors mpi4py's Request.Test
        if not self._request.Test():
            return False
        if self._gather is None:
            return True
        comm, parts = self._gather
        self._gather = None
        self._request = comm.Iallgatherv(MPI.IN_PLACE, parts)
        return self._request.Test()


class _EventRequest:
    """A CUDA event behind the `Test()` interface of an MPI request (for NCCL ops)."""

    def __init__(self, stream):
        import cupy
        self._event = cupy.cuda.Event(block=False, disable_timing=True)
        self._event.record(stream)

    def Test(self) -> bool:  # noqa: N802 - mirrors mpi4py's Request.Test
        return self._event.done


class NcclTransport:
    """GPU arrays over an NCCL communicator spanning the ranks of `mpi_comm` (one GPU per rank).

    Ops run on the transport's own CUDA stream, after the work already queued on the caller's
    current stream (an event orders them), so data-parallel reductions overlap the backward
    kernels that follow. NCCL point-to-point messages have no tags: sends and receives between
    two ranks must be posted in matching order. The barrier has no bytes and goes over MPI.
    """

    def __init__(self, mpi_comm: MPI.Comm):
        import cupy
        from cupy.cuda import nccl
        self.nccl = nccl
        # The id is NCCL_UNIQUE_ID_BYTES (128) bytes; CuPy hands it out as bytes or, in older
        # releases, as a tuple of signed chars: broadcast the bytes plus which form it was.
        uid = np.zeros(129, dtype=np.int8)
        if mpi_comm.rank == 0:
            raw = nccl.get_unique_id()
            as_bytes = isinstance(raw, (bytes, bytearray))
            uid[:128] = np.frombuffer(bytes(raw), dtype=np.int8) if as_bytes else np.array(raw, dtype=np.int8)
            uid[128] = as_bytes
        mpi_comm.Bcast([uid, MPI.INT8_T], root=0)
        comm_id = uid[:128].tobytes() if uid[128] else tuple(int(v) for v in uid[:128])
        self.comm = nccl.NcclCommunicator(mpi_comm.size, comm_id, mpi_comm.rank)
        self.xp = cupy  # the array module of this transport's buffers
        self.size = mpi_comm.size
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self._mpi = MpiTransport(mpi_comm)
        self._ops = {"sum": nccl.NCCL_SUM, "avg": nccl.NCCL_SUM, "max": nccl.NCCL_MAX, "min": nccl.NCCL_MIN}

    def start(self, kind: str, send, recv, op: str | None = None, peer: int | None = None, tag: int = 0,
              blocking: bool = False, counts: tuple | None = None) -> _EventRequest:
        if kind == "barrier":
            return self._mpi.start(kind, None, None, blocking=blocking)
        return self.start_group([(kind, send, recv, op, peer)])

    def start_group(self, ops: list[tuple]) -> _EventRequest:
        """Post `ops` ((kind, send, recv, op, peer) each) as one NCCL group: they progress together,
        so a send and a receive in one group cannot wait on each other's order."""
        import cupy
        ready = cupy.cuda.Event(block=False, disable_timing=True)
        ready.record(cupy.cuda.get_current_stream())
        self.stream.wait_event(ready)
        if len(ops) > 1:
            self.nccl.groupStart()
        for kind, send, recv, op, peer in ops:
            self._post(kind, send, recv, op, peer)
        if len(ops) > 1:
            self.nccl.groupEnd()
        return _EventRequest(self.stream)

    def _post(self, kind: str, send, recv, op: str | None, peer: int | None) -> None:
        s, c = self.stream.ptr, self.comm
        if kind == "all_reduce":
            ptr, count, dtype = nccl_buffer(send)
            c.allReduce(ptr, recv.data.ptr, count, dtype, self._ops[op], s)
        elif kind == "reduce_scatter":
            ptr, count, dtype = nccl_buffer(recv)
            c.reduceScatter(send.data.ptr, ptr, count, dtype, self._ops[op], s)
        elif kind == "all_gather":
            ptr, count, dtype = nccl_buffer(send)
            c.allGather(ptr, recv.data.ptr, count, dtype, s)
        elif kind == "all_to_all":
            part = send.shape[0] // self.size
            self.nccl.groupStart()
            for j in range(self.size):
                ptr, count, dtype = nccl_buffer(send[j * part:(j + 1) * part])
                c.send(ptr, count, dtype, j, s)
                c.recv(recv[j * part:(j + 1) * part].data.ptr, count, dtype, j, s)
            self.nccl.groupEnd()
        elif kind == "broadcast":
            ptr, count, dtype = nccl_buffer(recv)
            c.bcast(ptr, count, dtype, peer, s)
        elif kind == "send":
            ptr, count, dtype = nccl_buffer(send)
            c.send(ptr, count, dtype, peer, s)
        else:  # recv
            ptr, count, dtype = nccl_buffer(recv)
            c.recv(ptr, count, dtype, peer, s)


def nccl_possible(mpi_comm: MPI.Comm) -> bool:
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


def _displacements(counts):
    """Where each rank's part starts in a buffer of parts `counts` long, back to back."""
    return [0] + list(np.cumsum(counts[:-1], dtype=np.int64).tolist()) if len(counts) else []
