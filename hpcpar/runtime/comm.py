"""Collectives on arrays, over one MPI communicator (plus NCCL for GPU arrays).

`Communicator(mpi_comm, name)` wraps an mpi4py communicator. Host (NumPy) arrays
travel with mpi4py's buffer methods (upper-case, never pickle). CuPy arrays use an
NCCL communicator over the same ranks when every rank has its own GPU, and are
staged through host memory and MPI otherwise.

Every op is recorded in the flight recorder (`watchdog.recorder`) and numbered per
communicator, and the bytes it sends from this rank are counted (`Communicator.sent`, by op
kind; `bytes_sent` is the formula per collective kind). Blocking ops on host arrays call MPI's
blocking functions (MPICH's blocking collectives are faster than its non-blocking ones); the
watchdog's monitor thread watches them and aborts the job with a report across ranks when one waits
longer than `watchdog.timeout()`. Not when the node runs more ranks than cores
(`mpi_waits_block`): there every op polls, since some MPIs' blocking waits never yield the core.
Non-blocking ops (`Handle.wait()`) and GPU ops are
completed by one polling loop (`_wait`) that yields the core to ranks sharing it and
raises `watchdog.CommTimeout` when the monitor reports a timeout. Without
MPI_THREAD_MULTIPLE (no monitor) every op polls and times out on its own.

Small messages are latency-bound, so every op's own path is kept short (bench/allreduce.py
measures it next to raw mpi4py): datatypes and byte-count factors are worked out once per dtype
or communicator, a blocking op returns its result without a Handle, results are finished by
named functions (no closures), large results reuse their array objects, and the flight recorder
takes no lock and keeps a blocking op as a tuple.

Aliasing: blocking ops other than `broadcast`/`recv` never modify their input, but
on a size-1 communicator every op returns its input object itself (nothing to do),
so do not mutate a result in place while still needing the input. `broadcast`,
`recv` and `iall_reduce` (on a contiguous input) work in place, like MPI. Large
results live in recycled memory that no live array (or view) still uses.
"""

from __future__ import annotations

import collections
import math
import os
import pickle
import sys
import time
import zlib
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from hpcpar import backend
from hpcpar.backend import threads
from hpcpar.runtime import watchdog
from hpcpar.errors import ConfigError
from hpcpar.backend.precision import is_low

# Polling. MPI moves data only inside MPI calls, so while a transfer can still be
# running the loop calls Test() back to back, yielding the core every few polls
# (ranks that share cores would otherwise starve the peer they wait for; MPICH's
# own blocking wait yields too), and reading the clock only every _POLLS_PER_CLOCK
# polls: whatever the loop does between two Test() calls delays a large transfer
# (a 1 MiB all-reduce over 4 ranks on 2 cores took 10% longer with a clock read
# every 4 polls). That phase lasts _SPIN_S, or longer for big
# messages (bytes / _SPIN_BYTES_PER_S). A wait beyond it means a peer is late:
# the loop then sleeps between polls, from _FIRST_SLEEP_S doubling up to
# _MAX_SLEEP_S, to give the core away. bench/allreduce.py measures the cost.
_POLLS_PER_YIELD = 4
_POLLS_PER_CLOCK = 64
_SPIN_S = 5e-3
_SPIN_BYTES_PER_S = 2.5e8
_FIRST_SLEEP_S = 1e-6
_MAX_SLEEP_S = 1e-3

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


def mpi_waits_block() -> bool:
    """Whether blocking ops may wait inside MPI's blocking calls (given a monitor to watch them).

    `HPCPAR_MPI_WAIT=block|poll` decides; unset or `auto`: block, unless this node runs more ranks
    than it has cores (`threads.local_ranks()` against this process's cores). Then every op polls
    in `_wait`, which yields the core: some MPIs' blocking waits spin through their time slice
    without yielding (Debian's MPICH 4.0 with UCX: a 4-rank barrier on 2 cores took 8 ms, and the
    parallel test suite ran 10x slower than with polling), and a rank spinning there holds the core
    that the peer it waits for needs.
    """
    choice = os.environ.get("HPCPAR_MPI_WAIT", "auto").strip().lower() or "auto"
    if choice not in ("auto", "block", "poll"):
        raise ConfigError(f"HPCPAR_MPI_WAIT={choice!r} is not a wait mode; use auto, block or poll")
    if choice != "auto":
        return choice == "block"
    return threads.local_ranks() <= threads.cores()


# The requests and buffers of ops that timed out, kept until the process ends. MPI may still be
# working on them (a late peer can arrive after the CommTimeout), and freeing an active collective's
# request is erroneous in MPI (mpi4py frees a request it garbage-collects): under Open MPI the
# progress engine later touches freed memory and crashes. The communicator stays broken.
_ABANDONED: list[tuple[Any, Any, Any]] = []

# Result buffers of at least _POOL_MIN_BYTES are recycled (see Communicator._result);
# each communicator keeps at most _POOL_BUFFERS of them.
_POOL_MIN_BYTES = 64 * 1024
_POOL_BUFFERS = 8


class Handle:
    """A started operation. `wait()` completes it, `complete(*args)`, and returns its result
    (idempotent). `args` (the buffers MPI uses until the op completes among them) are kept until
    then; a function and its arguments rather than a closure: ops are latency-bound."""

    __slots__ = ("_complete", "_args", "_result", "_request", "_record")

    def __init__(self, complete: Callable[..., Any], args: tuple = (), request: Any = None, record: Any = None):
        self._complete: Callable[..., Any] | None = complete
        self._args = args
        self._result: Any = None
        self._request = request  # MPI ops: what `Communicator.wait_any` polls
        self._record = record

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


def _ready(value: Any, now: bool) -> Any:
    """An op's result that needed no communication: itself when the caller waits for it (`now`),
    else in a Handle."""
    return value if now else Handle.ready(value)


# -- transports: how an array op moves bytes -------------------------------------------------------
# A transport starts one op from prepared contiguous buffers and returns a request with `Test()`
# (or None when a blocking call already completed it). The Communicator prepares the buffers and
# finishes the result once for every transport; only the call that moves the bytes differs.
# KINDS: op -> how its buffers are used. "send"/"recv" name a peer; "broadcast" a root (as peer).
# "all_to_all_v" also takes `counts`: (send, recv) elements per rank.
KINDS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "all_to_all_v", "broadcast", "send", "recv",
         "barrier")


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
        call = getattr(self.comm, self._CALLS[kind][0 if blocking else 1])
        if op is not None:  # all_reduce, reduce_scatter: [buffer, datatype]; MPI derives the counts
            datatype = _DTYPE_FACTS[recv.dtype][0]
            if kind == "reduce_scatter" and not blocking:  # Ireduce_scatter: every rank's count
                return call([send, datatype], [recv, datatype], [recv.size] * self.size, self._REDUCE_OPS[op])
            if (kind == "all_reduce" and not blocking and send is not recv
                    and recv.nbytes >= _SPLIT_ALL_REDUCE_BYTES and recv.size >= self.size):
                return _SplitAllReduce(self, send, recv, datatype, self._REDUCE_OPS[op])
            return call(MPI.IN_PLACE if send is recv else [send, datatype], [recv, datatype], self._REDUCE_OPS[op])
        if kind == "send":
            return call([send, _DTYPE_FACTS[send.dtype][0]], peer, tag)
        if kind == "recv":
            return call([recv, _DTYPE_FACTS[recv.dtype][0]], peer, tag)
        if kind == "broadcast":
            return call([recv, _DTYPE_FACTS[recv.dtype][0]], peer)
        if kind == "barrier":
            return call()
        datatype = _DTYPE_FACTS[recv.dtype][0]
        if kind == "all_to_all_v":
            # [buffer, (counts, displacements), datatype] per side; counts in elements of the datatype.
            return call(*([buf, (c, _displacements(c)), datatype] for buf, c in zip((send, recv), counts)))
        return call(MPI.IN_PLACE if send is recv else [send, datatype], [recv, datatype])


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
            ptr, count, dtype = backend.nccl_buffer(send)
            c.allReduce(ptr, recv.data.ptr, count, dtype, self._ops[op], s)
        elif kind == "reduce_scatter":
            ptr, count, dtype = backend.nccl_buffer(recv)
            c.reduceScatter(send.data.ptr, ptr, count, dtype, self._ops[op], s)
        elif kind == "all_gather":
            ptr, count, dtype = backend.nccl_buffer(send)
            c.allGather(ptr, recv.data.ptr, count, dtype, s)
        elif kind == "all_to_all":
            part = send.shape[0] // self.size
            self.nccl.groupStart()
            for j in range(self.size):
                ptr, count, dtype = backend.nccl_buffer(send[j * part:(j + 1) * part])
                c.send(ptr, count, dtype, j, s)
                c.recv(recv[j * part:(j + 1) * part].data.ptr, count, dtype, j, s)
            self.nccl.groupEnd()
        elif kind == "broadcast":
            ptr, count, dtype = backend.nccl_buffer(recv)
            c.bcast(ptr, count, dtype, peer, s)
        elif kind == "send":
            ptr, count, dtype = backend.nccl_buffer(send)
            c.send(ptr, count, dtype, peer, s)
        else:  # recv
            ptr, count, dtype = backend.nccl_buffer(recv)
            c.recv(ptr, count, dtype, peer, s)


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
    return _send_factor(op, size) * nbytes


def _send_factor(op: str, n: int) -> float:
    """bytes_sent(op, S, n) / S (Communicator caches it per op kind)."""
    if n <= 1:
        return 0.0
    return {"all_reduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n, "all_gather": n - 1,
            "all_to_all": (n - 1) / n, "send": 1.0, "broadcast": 1.0}.get(op, 0.0)


class _DtypeFacts(dict):
    """dtype -> (the MPI datatype its arrays travel as, whether MPI reductions of it run in
    float32, whether it is a floating dtype), worked out on the first lookup of a dtype (a plain
    dict lookup afterwards: every op makes one). Dtypes MPI has no type for travel as raw bytes
    (exact for moving data) and are reduced in float32, as are 16-bit floats (`_work_buffer`)."""

    def __missing__(self, dtype) -> tuple:
        datatype = backend.mpi_datatype(dtype)
        facts = (MPI.BYTE if datatype is None else datatype, datatype is None or is_low(dtype),
                 bool(np.issubdtype(np.dtype(dtype), np.inexact)))
        self[dtype] = facts
        return facts


_DTYPE_FACTS = _DtypeFacts()


def _displacements(counts):
    """Where each rank's part starts in a buffer of parts `counts` long, back to back."""
    return [0] + list(np.cumsum(counts[:-1], dtype=np.int64).tolist()) if len(counts) else []


def _contiguous(a):
    return a if a.flags.c_contiguous else backend.array_module(a).ascontiguousarray(a)


def _copied(src, dst):
    """`dst` with `src`'s values (an op's result that has to land in the caller's array)."""
    dst[...] = src
    return dst


def _alone(a, out):
    """A size-1 communicator's result: the input itself, or copied into `out` when given."""
    return a if out is None else _copied(a, out)


def _to_front(a, dim: int):
    """`a` with `dim` moved first, C-contiguous (no copy when dim is 0 and `a` is contiguous)."""
    return _contiguous(backend.array_module(a).moveaxis(a, dim, 0) if dim else a)


def _from_front(a, dim: int):
    if not dim:
        return a
    xp = backend.array_module(a)
    return xp.ascontiguousarray(xp.moveaxis(a, 0, dim))


class Communicator:
    """Array collectives over the ranks of `mpi_comm`; `name` labels it in errors and records.

    The only door to MPI and NCCL for everything above it: array collectives, point-to-point,
    object collectives for setup and reports, progress. Every op is recorded in the flight
    recorder, and `sent` counts the bytes this rank sent, by op kind (`bytes_sent`'s formula of
    the op's recorded size; a broadcast counts on its root only). `bytes_sent_total()` sums them.

    Shapes: `all_reduce`/`broadcast` keep the shape; `reduce_scatter(a, dim)` divides
    `a.shape[dim]` by `size` (rank r keeps part r of the sum); `all_gather(a, dim)`
    multiplies it by `size` (rank r's `a` becomes part r); `all_to_all(a, dim)` keeps
    the shape and sends part j of `a` along `dim` to rank j, whose result holds the
    parts it received in rank order; `all_to_all_v(a, send_counts, recv_counts)` sends rows of
    different counts to every rank ([n, ...] -> [sum(recv_counts), ...]).
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
        watchdog.timeout()  # a bad $HPCPAR_TIMEOUT fails here, on every rank alike, not inside some wait
        self._watched = watchdog.monitor()  # a monitor thread watches this rank's waits
        self._in_mpi = self._watched and mpi_waits_block()  # blocking ops wait in MPI's blocking calls
        self._checked: list = []  # debug mode: collectives since the last sequence check
        self._check_hash = 0
        self._host = MpiTransport(mpi_comm)
        self._nccl: NcclTransport | None | bool = None  # None: not decided yet; False: stage through host
        self._pool: list[list] = []  # [byte buffer, its last view] behind earlier results (see _result)
        # op kind -> bytes this rank sent (bytes_sent), since creation
        self.sent: dict[str, float] = collections.defaultdict(float)
        self._factor = {kind: _send_factor(kind, self.size) for kind in KINDS}  # bytes_sent per input byte

    def bytes_sent_total(self) -> float:
        """Bytes this rank has sent over this communicator so far (every op kind)."""
        return sum(self.sent.values())

    @classmethod
    def local(cls) -> "Communicator":
        """A communicator of this process alone (MPI_COMM_SELF): every op is a no-op."""
        return cls(MPI.COMM_SELF, "self")

    def __repr__(self) -> str:
        return f"Communicator({self.name!r}, rank {self.rank} of {self.size})"

    def io_comm(self) -> MPI.Comm:
        """The MPI communicator itself, for collective file I/O that a library does over it
        (parallel HDF5's mpio driver: shared-file checkpoints). Use it for that only, from the
        thread that does this communicator's ops, with every rank taking part."""
        return self.mpi

    def free(self) -> None:
        """Release the MPI communicator (not COMM_WORLD/COMM_SELF, which MPI owns)."""
        if self.mpi not in (MPI.COMM_WORLD, MPI.COMM_SELF) and self.mpi != MPI.COMM_NULL:
            self.mpi.Free()

    # -- the one path of every array op ----------------------------------------------------------

    def _transport(self, a) -> MpiTransport | NcclTransport | None:
        """The transport for array `a`: MPI for host arrays, NCCL for GPU arrays when every rank
        has its own GPU (decided collectively on the first GPU op), else None: stage via host."""
        if type(a) is np.ndarray or not backend.is_device_array(a):
            return self._host
        if self._nccl is None:
            self._nccl = NcclTransport(self.mpi) if _nccl_possible(self.mpi) else False
        return self._nccl or None

    def _start(self, kind: str, a, send, recv, transport, now: bool, finish: Callable | None = None,
               args: tuple = (), op: str | None = None, peer: int | None = None, tag: int = 0,
               counts: tuple | None = None, sent: float | None = None):
        """Record the op and start it on `transport` from the prepared buffers. Its result, once
        it completed, is `finish(*args)`, or `recv` itself when `finish` is None (a named function
        and its arguments rather than a closure: ops are latency-bound). `now` (the blocking
        methods): complete it here and return the result, in MPI's blocking call when the
        monitor watches it; else return a Handle whose `wait()` does. `peer`: the other rank of
        a send/recv, a broadcast's root. `counts`: all_to_all_v's (send, recv) elements per rank;
        `sent`: its bytes leaving this rank."""
        # A blocking host op's timeout aborts the job (one report, from the monitor), whether it
        # waits in MPI's blocking call or polls (`mpi_waits_block`).
        blocking = now and self._watched and transport is self._host
        in_mpi = blocking and self._in_mpi
        if kind != "send" and kind != "recv" and watchdog.check_every():
            # all_to_all_v's shapes differ between ranks by design: the check compares its name only.
            self._check_sequence(kind, a if kind != "all_to_all_v" else None)
        if in_mpi:
            record = self._begin(kind, a, peer, True, True, sent)
            try:
                transport.start(kind, send, recv, op, peer, tag, True, counts)
            finally:  # an MPI error must not leave the op pending for the monitor to time out
                watchdog.recorder.leave(record)
            return recv if finish is None else finish(*args)
        # A non-blocking start returns at once: the op is recorded after it, because with ranks
        # sharing cores whatever a rank does before it enters an op delays every rank many times
        # over (4 ranks on 2 cores, side by side: 3 us more before a 1 MiB all-reduce cost 70 us;
        # recording after took bench/allreduce.py's 1 MiB all-reduce from 0.88-0.92x raw to 0.97-1.01x).
        request = transport.start(kind, send, recv, op, peer, tag, False, counts)
        record = self._begin(kind, a, peer, blocking, False, sent)
        if now:
            return self._complete(request, record, send, recv, finish, args)
        # MPI (or NCCL) reads and writes the buffers until the op completes: the handle keeps them.
        return Handle(self._complete, (request, record, send, recv, finish, args), request, record)

    def _complete(self, request, record: watchdog.OpRecord, send, recv, finish: Callable | None, args: tuple):
        """Wait for an op `_start` started, then finish its result. A timed-out op's request and
        buffers are kept for good: MPI may still be working on them."""
        try:
            self._wait(request, record)
        except watchdog.CommTimeout:
            _ABANDONED.append((request, send, recv))
            raise
        return recv if finish is None else finish(*args)

    def _staged(self, start: Callable, a, args: tuple, now: bool, into=None):
        """Run the host form of an op, `start(host copy of a, *args, now)`, on GPU array `a` (same
        transport, MPI); the result comes back to the GPU (into `into` when given, for the
        in-place ops): returned when `now`, else through a Handle."""
        xp = backend.array_module(a)

        def back(result):
            if result is None:
                return None
            result = xp.asarray(result)
            if into is None:
                return result
            into[...] = result
            return into
        host = start(backend.to_host(a), *args, now)
        return back(host) if now else Handle(lambda: back(host.wait()))

    # -- issuing and waiting --------------------------------------------------------------------

    def _begin(self, op: str, a, peer: int | None = None, blocking: bool = False, in_mpi: bool = False,
               sent: float | None = None):
        """Number and record an op and count the bytes it sends from this rank (a broadcast's on
        its root `peer` only; `sent` when the op knows them better than `bytes_sent`'s formula:
        all_to_all_v). `blocking`: an op the caller waits for at once, whose timeout the monitor
        turns into an abort; `in_mpi`: waited for in MPI's blocking call, recorded with
        `recorder.enter` (the entry `recorder.leave` takes); else an OpRecord (`recorder.begin`).
        The record keeps a send's or receive's `peer`. Every op passes here: it is kept short."""
        record_peer = peer if op == "send" or op == "recv" else None
        seq = self._seq
        self._seq = seq + 1
        if a is None:
            shape, dtype, nbytes = (), "", 0
        else:
            shape, dtype, nbytes = a.shape, a.dtype, a.nbytes
            if sent is not None or op != "broadcast" or peer == self.rank:
                self.sent[op] += self._factor[op] * nbytes if sent is None else sent
        if in_mpi:
            return watchdog.recorder.enter(self.name, seq, op, shape, dtype, nbytes, record_peer, self._group)
        return watchdog.recorder.begin(self.name, seq, op, shape, dtype, nbytes, record_peer, self._group, blocking)

    def _wait(self, request, record: watchdog.OpRecord) -> None:
        """Poll `request.Test()` until done; raise CommTimeout when the watchdog reports a timeout.

        The monitor thread delivers its report (`record.report`); with no monitor, or none
        delivered, this raises on its own past the timeout (plus a grace period with a monitor).
        """
        test = request.Test
        if not test():
            watchdog.recorder.waiting(record)
            since = record.waiting
            spin_until = since + max(_SPIN_S, record.nbytes / _SPIN_BYTES_PER_S)
            limit = None  # read once the spinning is over: most waits end before
            delay = _FIRST_SLEEP_S
            polls = 0
            yield_core = os.sched_yield
            while not test():
                polls += 1
                if polls % _POLLS_PER_YIELD:
                    continue
                if limit is None:  # spinning
                    if polls % _POLLS_PER_CLOCK or time.monotonic() < spin_until:
                        yield_core()
                        continue
                    limit = watchdog.timeout() + (watchdog.DELIVERY_GRACE_S if self._watched else 0.0)
                now = time.monotonic()
                if record.report is not None or now - since > limit:
                    error = watchdog.CommTimeout(record, now - since, record.report)
                    record.report = str(error)  # reported: the monitor leaves it alone from now on
                    raise error
                time.sleep(delay)
                delay = min(2 * delay, _MAX_SLEEP_S)
        watchdog.recorder.end(record)

    def wait_any(self, handles: list) -> int:
        """Complete whichever of `handles` (this communicator's non-blocking host ops; None entries
        are skipped) finishes first and return its index: a server's loop over its clients' messages.
        Polls as `_wait` does and raises `watchdog.CommTimeout` on the oldest op when none finishes
        within the timeout (the monitor sees them all as waiting meanwhile)."""
        live = [(i, h) for i, h in enumerate(handles) if h is not None]
        if not live:
            raise ValueError("wait_any needs at least one handle")
        for i, h in live:
            if h._request is None:   # done already (or nothing to poll): complete it
                h.wait()
                return i
        since = time.monotonic()
        records = [h._record for _, h in live]
        delay, polls, spinning = _FIRST_SLEEP_S, 0, True
        try:
            while True:
                for i, h in live:
                    if h._request.Test():
                        h.wait()
                        return i
                polls += 1
                if polls == 1:
                    for r in records:
                        watchdog.recorder.waiting(r)
                if polls % _POLLS_PER_YIELD:
                    continue
                if spinning:
                    if polls % _POLLS_PER_CLOCK or time.monotonic() < since + _SPIN_S:
                        os.sched_yield()
                        continue
                    spinning = False
                now = time.monotonic()
                reported = next((r for r in records if r.report is not None), None)
                if reported is not None or now - since > watchdog.timeout():
                    record = reported or min(records, key=lambda r: r.start)
                    error = watchdog.CommTimeout(record, now - since, record.report)
                    record.report = str(error)
                    raise error
                time.sleep(delay)
                delay = min(2 * delay, _MAX_SLEEP_S)
        finally:
            for r in records:   # the ones still pending are not waited for any more
                if r.end is None:
                    r.waiting = None

    def progress(self) -> None:
        """Let MPI advance this communicator's non-blocking ops (MPI moves data only inside MPI
        calls and has no progress thread): a cheap probe, for long stretches of computation."""
        if self.size > 1:
            self.mpi.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)

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

    def _result(self, shape: tuple, dtype: np.dtype, xp) -> Any:
        """A new result array, in memory recycled from earlier results nobody holds any more.

        MPI libraries cache per-address work for large buffers (registration, mappings):
        receiving into brand-new memory every call made a 1 MiB all_reduce 2-3x slower
        than receiving into a reused buffer (bench/allreduce.py). A pooled buffer is
        handed out as a typed view, so while the caller (or any view of the result) is alive
        its refcount keeps it out of reuse; the pool keeps the last view of each buffer and
        hands out that same array again when it has the wanted shape and dtype and nobody
        holds it: making a new view every call cost 2-4% of a 1 MiB all-reduce here (the
        operands fill the cache, and new objects evict them). CuPy has its own memory pool.
        """
        nbytes = math.prod(shape) * dtype.itemsize  # not np.prod: 4 us a call, a third of the op
        if xp is not np or nbytes < _POOL_MIN_BYTES:
            return xp.empty(shape, dtype=dtype)
        for entry in self._pool:
            buf, view = entry
            # A free buffer's references: the pool's entry, `buf`, getrefcount's argument and its view's
            # base; its free view's: the entry, `view`, the argument. More means a result still in use.
            if buf.nbytes == nbytes and sys.getrefcount(buf) <= 4 and sys.getrefcount(view) <= 3:
                if view.shape != shape or view.dtype != dtype:
                    view = entry[1] = buf.view(dtype).reshape(shape)
                return view
        buf = np.empty(nbytes, dtype=np.uint8)
        if len(self._pool) >= _POOL_BUFFERS:
            self._pool.pop(0)  # the oldest buffer goes back to the allocator once its holders drop it
        view = buf.view(dtype).reshape(shape)
        self._pool.append([buf, view])
        return view

    # -- reductions -----------------------------------------------------------------------------

    def _check_op(self, what: str, op: str, a, allowed=("sum", "avg", "max", "min")) -> None:
        if op not in allowed:
            raise ValueError(f"{what} on '{self.name}': unknown op {op!r}; use one of {', '.join(allowed)}")
        if op == "avg" and not _DTYPE_FACTS[a.dtype][2]:
            raise ValueError(f"{what} on '{self.name}': op 'avg' needs a floating dtype, got {a.dtype}")

    def _work_buffer(self, send, transport):
        """`send` in the dtype its reduction runs in: its own, or float32 for 16-bit floats over
        MPI (bfloat16 has no MPI type; float16 sums would round at every addition, so a result
        would depend on the number of ranks; NCCL reduces those natively)."""
        if transport is self._host and _DTYPE_FACTS[send.dtype][1]:
            return send.astype(np.float32)
        return send

    def iall_reduce(self, a, op: str = "sum") -> Handle:
        """Start an all-reduce; `wait()` returns the reduced array (same shape).

        In place on `a` when `a` is contiguous; otherwise on a contiguous copy.
        """
        return self._iall_reduce(a, op, True, False)

    def all_reduce(self, a, op: str = "sum"):
        """Elementwise sum/avg/max/min of `a` over the ranks (replicated result); `a` is not modified."""
        return self._iall_reduce(a, op, False, True)

    def _iall_reduce(self, a, op: str, in_place: bool, now: bool):
        self._check_op("all_reduce", op, a)
        if self.size == 1:
            return _ready(a, now)
        transport = self._transport(a)
        if transport is None:
            return self._staged(self._iall_reduce, a, (op, in_place), now,
                                a if in_place and a.flags.c_contiguous else None)
        send = _contiguous(a)
        work = self._work_buffer(send, transport)
        if work is not send:  # reduce the upcast copy in place, cast back when finished
            send = recv = work
        else:  # in place on `a` (or the copy a strided `a` needed) when asked, else into a new result:
            # out of place whatever `a`'s layout, since that decides the MPI calls (a large one is
            # split, `MpiTransport.start`) and every rank must issue the same ones
            recv = send if in_place else self._result(send.shape, send.dtype, transport.xp)
        finish = None if op != "avg" and recv.dtype == a.dtype else self._reduced
        return self._start("all_reduce", a, send, recv, transport, now, finish, (recv, a, op, in_place), op)

    def _reduced(self, recv, a, op: str, in_place: bool):
        """An all-reduce's result from its receive buffer: divided by size for avg, cast back to
        `a`'s dtype (into `a` itself for an in-place reduction of a contiguous `a`)."""
        if op == "avg":
            recv /= self.size
        if recv.dtype == a.dtype:
            return recv
        if in_place and a.flags.c_contiguous:
            a[...] = recv
            return a
        return recv.astype(a.dtype)

    def ireduce_scatter(self, a, dim: int = 0, op: str = "sum", out=None) -> Handle:
        """Start a reduce-scatter; `wait()` returns this rank's part of the reduction.

        `a`: [..., n, ...] (n at `dim`, n divisible by size) -> [..., n/size, ...], part `rank`.
        `out` (dim 0 only): an array of the result's shape and dtype to receive into, which
        `wait()` returns, instead of recycled memory (for results kept across steps).
        """
        return self._ireduce_scatter(a, dim, op, False, out)

    def reduce_scatter(self, a, dim: int = 0, op: str = "sum"):
        """Sum (or avg) over ranks, keeping part `rank` of `dim`: [.., n, ..] -> [.., n/size, ..]."""
        return self._ireduce_scatter(a, dim, op, True)

    def _ireduce_scatter(self, a, dim: int, op: str, now: bool, out=None):
        self._check_op("reduce_scatter", op, a, allowed=("sum", "avg"))
        dim = self._dim_divisible("reduce_scatter", a, dim)
        if out is not None:
            self._check_out("reduce_scatter", a, dim, out, a.shape[0] // self.size)
        if self.size == 1:
            return _ready(_alone(a, out), now)
        transport = self._transport(a)
        if transport is None:
            return self._staged(self._ireduce_scatter, a, (dim, op), now, out)
        send = self._work_buffer(_to_front(a, dim), transport)
        own = out is not None and out.dtype == send.dtype
        recv = out if own else self._result((send.shape[0] // self.size,) + send.shape[1:], send.dtype,
                                            transport.xp)
        finish = None if op != "avg" and not dim and recv.dtype == a.dtype else self._scattered
        return self._start("reduce_scatter", a, send, recv, transport, now, finish, (recv, a, dim, op, out), op)

    def _scattered(self, recv, a, dim: int, op: str, out):
        """A reduce-scatter's result from its receive buffer: divided by size for avg, in `out`
        when given, else cast back to `a`'s dtype with `dim` moved back."""
        if op == "avg":
            recv /= self.size
        if out is not None and recv is not out:
            out[...] = recv
            return out
        return _from_front(recv.astype(a.dtype, copy=False), dim)

    def _check_out(self, what: str, a, dim: int, out, rows: int) -> None:
        """`out` must be a C-contiguous array of `a`'s dtype and the result's shape (dim 0 only)."""
        shape = (rows,) + tuple(a.shape[1:])
        if dim != 0 or tuple(out.shape) != shape or out.dtype != a.dtype or not out.flags.c_contiguous:
            raise ValueError(f"{what} on '{self.name}': out must be a C-contiguous {a.dtype} array of shape "
                             f"{shape} (dim 0), got {out.dtype} {tuple(out.shape)} for dim {dim}")

    # -- data movement --------------------------------------------------------------------------

    def iall_gather(self, a, dim: int = 0, out=None) -> Handle:
        """Start an all-gather; `wait()` returns [..., size*m, ...] with rank r's `a` as part r.

        `out` (dim 0 only): an array of the result's shape and dtype to receive into, which
        `wait()` returns, instead of recycled memory: a result its owner frees when done with
        it (ZeRO-3's gathered parameters) must not stay alive in the recycling pool. `a` must
        not overlap `out`.
        """
        return self._iall_gather(a, dim, False, out)

    def all_gather(self, a, dim: int = 0):
        """Concatenate every rank's `a` along `dim` in rank order: [.., m, ..] -> [.., size*m, ..]."""
        return self._iall_gather(a, dim, True)

    def _iall_gather(self, a, dim: int, now: bool, out=None):
        dim = self._dim("all_gather", a, dim)
        if out is not None:
            self._check_out("all_gather", a, dim, out, a.shape[0] * self.size)
        if self.size == 1:
            return _ready(_alone(a, out), now)
        transport = self._transport(a)
        if transport is None:
            return self._staged(self._iall_gather, a, (dim,), now, out)
        send = _to_front(a, dim)
        recv = out if out is not None else self._result((send.shape[0] * self.size,) + send.shape[1:], send.dtype,
                                                        transport.xp)
        return self._start("all_gather", a, send, recv, transport, now, _from_front if dim else None, (recv, dim))

    def iall_to_all(self, a, dim: int = 0) -> Handle:
        """Start an all-to-all; `wait()` returns an array shaped like `a` (see `all_to_all`)."""
        return self._iall_to_all(a, dim, False)

    def all_to_all(self, a, dim: int = 0):
        """Part j of `a` along `dim` goes to rank j; the result holds part `rank` of every rank's
        `a`, in rank order along `dim` (same shape as `a`; `a.shape[dim]` divisible by size)."""
        return self._iall_to_all(a, dim, True)

    def _iall_to_all(self, a, dim: int, now: bool):
        dim = self._dim_divisible("all_to_all", a, dim)
        if self.size == 1:
            return _ready(a, now)
        transport = self._transport(a)
        if transport is None:
            return self._staged(self._iall_to_all, a, (dim,), now)
        send = _to_front(a, dim)
        recv = self._result(send.shape, send.dtype, transport.xp)
        return self._start("all_to_all", a, send, recv, transport, now, _from_front if dim else None, (recv, dim))

    def all_to_all_v(self, a, send_counts, recv_counts):
        """Rows of different lengths to every rank (MPI_Alltoallv): the first `send_counts[0]` rows
        of `a` [n, ...] go to rank 0, the next `send_counts[1]` to rank 1, and so on; the result
        [sum(recv_counts), ...] holds the rows from rank 0, then from rank 1, ... Both count lists
        (rows per rank, `size` long) must agree with the peers' (exchange them first, e.g. with
        `all_to_all`). Bytes counted as sent: the rows that leave this rank. GPU arrays go
        through host memory."""
        return self._iall_to_all_v(a, send_counts, recv_counts, True)

    def _iall_to_all_v(self, a, send_counts, recv_counts, now: bool):
        send_counts = [int(c) for c in send_counts]
        recv_counts = [int(c) for c in recv_counts]
        if len(send_counts) != self.size or len(recv_counts) != self.size or a.ndim < 1 \
                or sum(send_counts) != a.shape[0] or min(send_counts + recv_counts, default=0) < 0:
            raise ValueError(f"all_to_all_v on '{self.name}': {self.size} send and receive counts (rows >= 0) "
                             f"are needed, the send counts summing to the {a.shape[0] if a.ndim else 0} rows "
                             f"of a {tuple(a.shape)} array; got {send_counts} and {recv_counts}")
        if self.size == 1:
            return _ready(a, now)
        if backend.is_device_array(a):
            return self._staged(self._iall_to_all_v, a, (send_counts, recv_counts), now)
        send = _contiguous(a)
        row = math.prod(a.shape[1:])
        recv = self._result((sum(recv_counts),) + tuple(a.shape[1:]), a.dtype, np)
        elements = (np.array(send_counts, dtype=np.int64) * row, np.array(recv_counts, dtype=np.int64) * row)
        if backend.mpi_datatype(a.dtype) is None:  # moved as raw bytes (see _DtypeFacts)
            elements = tuple(e * a.dtype.itemsize for e in elements)
        sent = float((sum(send_counts) - send_counts[self.rank]) * row * a.dtype.itemsize)
        return self._start("all_to_all_v", a, send, recv, self._host, now, counts=elements, sent=sent)

    def ibroadcast(self, a, root: int = 0) -> Handle:
        """Start a broadcast of root's `a` into every rank's `a` (in place); `wait()` returns `a`."""
        return self._ibroadcast(a, root, False)

    def broadcast(self, a, root: int = 0):
        """Root's `a` into every rank's `a`, in place like MPI_Bcast (same shape and dtype on
        every rank); returns `a`."""
        return self._ibroadcast(a, root, True)

    def _ibroadcast(self, a, root: int, now: bool):
        self._check_rank("broadcast", root, "root")
        if self.size == 1:
            return _ready(a, now)
        transport = self._transport(a)
        if transport is None:
            return self._staged(self._ibroadcast, a, (root,), now, a)
        buf = _contiguous(a)
        return self._start("broadcast", a, buf, buf, transport, now, None if buf is a else _copied, (buf, a),
                           peer=root)

    def isend(self, a, dest: int, tag: int = 0) -> Handle:
        """Start sending `a` to rank `dest`; `wait()` returns None once `a` may be reused."""
        return self._isend(a, dest, tag, False)

    def send(self, a, dest: int, tag: int = 0) -> None:
        """Send `a` to rank `dest` (matched by a `recv` with the same tag there)."""
        self._isend(a, dest, tag, True)

    def _isend(self, a, dest: int, tag: int, now: bool):
        if not 0 <= dest < self.size:  # checked here, worded by _check_rank: the pipeline's hot path
            self._check_rank("send", dest, "dest")
        transport = self._transport(a)
        if transport is None:
            return self._staged(self._isend, a, (dest, tag), now)
        return self._start("send", a, _contiguous(a), None, transport, now, peer=dest, tag=tag)

    def irecv(self, out, source: int, tag: int = 0) -> Handle:
        """Start receiving into `out` from rank `source`; `wait()` returns `out` filled."""
        return self._irecv(out, source, tag, False)

    def recv(self, out, source: int, tag: int = 0):
        """Receive into `out` (shape and dtype as sent) from rank `source`; returns `out`."""
        return self._irecv(out, source, tag, True)

    def _irecv(self, out, source: int, tag: int, now: bool):
        if not 0 <= source < self.size:
            self._check_rank("recv", source, "source")
        transport = self._transport(out)
        if transport is None:
            return self._staged(self._irecv, out, (source, tag), now, out)
        if out.flags.c_contiguous:
            return self._start("recv", out, None, out, transport, now, peer=source, tag=tag)
        buf = transport.xp.empty_like(out, order="C")
        return self._start("recv", out, None, buf, transport, now, _copied, (buf, out), peer=source, tag=tag)

    def isend_irecv(self, a, dest: int, out, source: int, send_tag: int = 0, recv_tag: int = 0
                    ) -> tuple[Handle, Handle]:
        """Start sending `a` to `dest` and receiving into `out` from `source` at once; returns the
        (send, receive) handles. On NCCL the two are one group: NCCL matches messages in posting
        order and a send waits for its receiver, so two ranks that each send, then receive, would
        wait on each other forever if posted one by one (`schedule.check_in_order_transport`).
        On MPI, where tags match messages, it is an Isend and an Irecv."""
        if not (0 <= dest < self.size and 0 <= source < self.size):
            self._check_rank("send", dest, "dest")
            self._check_rank("recv", source, "source")
        transport = self._transport(a)
        if not isinstance(transport, NcclTransport) or self._transport(out) is not transport:
            return self._isend(a, dest, send_tag, False), self._irecv(out, source, recv_tag, False)
        buf = _contiguous(a)
        rbuf = out if out.flags.c_contiguous else transport.xp.empty_like(out, order="C")
        sent, received = self._begin("send", a, dest), self._begin("recv", out, source)
        request = transport.start_group([("send", buf, None, None, dest), ("recv", None, rbuf, None, source)])

        def sent_done(buf):  # the handle keeps the buffer NCCL reads until the op completes
            self._wait(request, sent)

        def received_done(rbuf):
            self._wait(request, received)
            return out if rbuf is out else _copied(rbuf, out)
        return Handle(sent_done, (buf,)), Handle(received_done, (rbuf,))

    def ibarrier(self) -> Handle:
        """Start a barrier; `wait()` returns once every rank has started it."""
        return self._ibarrier(False)

    def barrier(self) -> None:
        """Wait until every rank of the communicator arrives."""
        self._ibarrier(True)

    def _ibarrier(self, now: bool):
        if self.size == 1:
            return _ready(None, now)
        return self._start("barrier", None, None, None, self._host, now)

    # -- objects (setup, checkpoints, reports; never on a step's hot path) -----------------------

    def all_gather_object(self, obj: Any) -> list:
        """Every rank's picklable `obj`, in rank order, on every rank.

        Pickled, then moved as bytes by the array ops above (so recorded and watched like any
        op): for setup, checkpoints and reports, never on the hot path of a step.
        """
        if self.size == 1:
            return [obj]
        data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
        sizes = self.all_gather(np.array([data.size], dtype=np.int64))
        padded = np.zeros((1, int(sizes.max())), dtype=np.uint8)
        padded[0, :data.size] = data
        every = self.all_gather(padded, dim=0)
        return [pickle.loads(every[r, :sizes[r]].tobytes()) for r in range(self.size)]

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        """Root's picklable `obj` on every rank (the others' `obj` is ignored); see all_gather_object."""
        self._check_rank("broadcast_object", root, "root")
        if self.size == 1:
            return obj
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if self.rank == root else b""
        size = self.broadcast(np.array([len(data)], dtype=np.int64), root)
        buf = np.frombuffer(data, dtype=np.uint8).copy() if self.rank == root else np.empty(int(size[0]), np.uint8)
        self.broadcast(buf, root)
        return obj if self.rank == root else pickle.loads(buf.tobytes())

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
