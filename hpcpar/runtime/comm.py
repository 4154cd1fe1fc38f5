"""The Communicator: collectives on arrays over one MPI communicator (plus NCCL for GPU arrays).

`Communicator(mpi_comm, name)` wraps an mpi4py communicator. Host (NumPy) arrays
travel with mpi4py's buffer methods (upper-case, never pickle: `transports.MpiTransport`). CuPy
arrays use an NCCL communicator over the same ranks when every rank has its own GPU
(`transports.NcclTransport`), and are staged through host memory and MPI otherwise. The
Communicator checks the arguments, prepares the buffers, starts the op on a transport, waits
for it and finishes the result, the same way for every transport.

Every op is recorded in the flight recorder (`watchdog.recorder`) and numbered per
communicator, and the bytes it sends from this rank are counted (`Communicator.sent`, by op
kind; `bytes_sent` is the formula per collective kind). Blocking ops on host arrays call MPI's
blocking functions (MPICH's blocking collectives are faster than its non-blocking ones), or poll
where the node runs more ranks than cores (`waiting.mpi_waits_block`: some MPIs' blocking waits
never yield the core); the watchdog's monitor thread watches them and aborts the job with a
report across ranks when one waits longer than `watchdog.timeout()`. Non-blocking ops
(`Handle.wait()`) and GPU ops are completed by one polling loop (`waiting.wait_for`) that yields
the core to ranks sharing it and raises `watchdog.CommTimeout` when the monitor reports a
timeout. Without MPI_THREAD_MULTIPLE (no monitor) every op polls and times out on its own.

Small messages are latency-bound and, with ranks sharing cores, any interpreter work next to an
op delays every rank many times over, so every op's path is kept short (bench/allreduce.py
measures it next to raw mpi4py): an op enters MPI before it is recorded; a repeated all_reduce,
reduce_scatter, all_gather or iall_reduce of a contiguous NumPy array runs from a plan kept per
shape and dtype (`_keep_plan`); a blocking op is recorded as a tuple and returns without a
Handle; results are finished by named functions and large ones reuse their arrays (`ResultPool`).

Aliasing: blocking ops other than `broadcast`/`recv` never modify their input, but
on a size-1 communicator every op returns its input object itself (nothing to do),
so do not mutate a result in place while still needing the input. `broadcast`,
`recv` and `iall_reduce` (on a contiguous input) work in place, like MPI. Large
results live in recycled memory that no live array (or view) still uses.
"""
from __future__ import annotations

import collections
import math
import pickle
import zlib
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from hpcpar import backend
from hpcpar.runtime import ulfm, watchdog
from hpcpar.runtime.buffers import DTYPE_FACTS, ResultPool, contiguous, copied, from_front, mpi_datatype, to_front
from hpcpar.runtime.transports import KINDS, Handle, MpiTransport, NcclTransport, nccl_possible, send_factor
from hpcpar.runtime.transports import bytes_sent as bytes_sent  # part of this module's API
from hpcpar.runtime.waiting import mpi_waits_block, wait_any, wait_blocked, wait_for

# The requests and buffers of ops that timed out, kept until the process ends. MPI may still be
# working on them (a late peer can arrive after the CommTimeout), and freeing an active collective's
# request is erroneous in MPI (mpi4py frees a request it garbage-collects): under Open MPI the
# progress engine later touches freed memory and crashes. The communicator stays broken.
_ABANDONED: list[tuple[Any, Any, Any]] = []


def _ready(value: Any, now: bool) -> Any:
    """An op's result that needed no communication: itself when `now` (blocking), else in a Handle."""
    return value if now else Handle.ready(value)


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
        self._results = ResultPool()  # large host results in recycled memory
        # (op, shape, dtype, dim or op) -> plan of a host op that needs no finishing (`_keep_plan`)
        self._plans: dict[tuple, tuple] = {}
        # op kind -> bytes this rank sent (bytes_sent), since creation
        self.sent: dict[str, float] = collections.defaultdict(float)
        self._factor = {kind: send_factor(kind, self.size) for kind in KINDS}  # bytes_sent per input byte
        self._node: Communicator | None = None  # split_by_node's, once made

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
        """Release the MPI communicator (not COMM_WORLD/COMM_SELF, which MPI owns), and the node
        communicator `split_by_node` kept."""
        node, self._node = self._node, None
        if node is not None:
            node.free()
        if self.mpi not in (MPI.COMM_WORLD, MPI.COMM_SELF) and self.mpi != MPI.COMM_NULL:
            self.mpi.Free()

    def split(self, color: int, key: int = 0, name: str | None = None) -> Communicator:
        """The ranks of this communicator with the same `color`, ordered by `key` (MPI_Comm_split;
        collective). The caller frees it."""
        return Communicator(self.mpi.Split(color, key), name or f"{self.name}/{color}")

    def subset(self, keep: bool, key: int = 0) -> MPI.Comm | None:
        """The ranks that pass `keep` = True, ordered by `key`, as a new MPI communicator to build a
        run over (a `Trainer` takes one, like `mpi_world()`); None on the others (collective)."""
        comm = self.mpi.Split(0 if keep else MPI.UNDEFINED, key)
        return None if comm == MPI.COMM_NULL else comm

    # -- after a failure (ULFM, runtime/ulfm.py) -------------------------------------------------

    def revoke(self) -> None:
        """Revoke this communicator: every rank waiting in an operation on it gets MPI_ERR_REVOKED
        (a rank that learned of a failure makes sure no survivor waits for it forever)."""
        ulfm.revoke([self.mpi])

    def shrink(self, name: str = "survivors") -> Communicator:
        """The ranks of this communicator still alive, as a new one (MPI_Comm_shrink; collective
        over the survivors, allowed on a revoked communicator)."""
        return Communicator(ulfm.shrink(self.mpi), name)

    def split_by_node(self) -> Communicator:
        """The ranks of this communicator that share this rank's node (its shared memory), in
        this communicator's rank order: made on the first call (collective then: every rank calls
        it the first time at the same point), then kept and freed with this communicator."""
        if self._node is None:
            self._node = Communicator(self.mpi.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank), "node")
        return self._node

    # -- the one path of every array op ----------------------------------------------------------

    def _transport(self, a) -> MpiTransport | NcclTransport | None:
        """The transport for array `a`: MPI for host arrays, NCCL for GPU arrays when every rank
        has its own GPU (decided collectively on the first GPU op), else None: stage via host."""
        if type(a) is np.ndarray or not backend.is_device_array(a):
            return self._host
        if self._nccl is None:
            self._nccl = NcclTransport(self.mpi) if nccl_possible(self.mpi) else False
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
        if kind != "send" and kind != "recv" and watchdog.check_every():
            # all_to_all_v's shapes differ between ranks by design: the check compares its name only.
            self._check_sequence(kind, a if kind != "all_to_all_v" else None)
        if now and self._watched and transport is self._host:
            self._block(kind, a, transport.start, (kind, send, recv, op, peer, tag, self._in_mpi, counts), send, recv,
                        peer, sent)
            return recv if finish is None else finish(*args)
        # A non-blocking start returns at once: the op is recorded after it, because with ranks
        # sharing cores whatever a rank does before it enters an op delays every rank many times
        # over (4 ranks on 2 cores, side by side: 3 us more before a 1 MiB all-reduce cost 70 us;
        # recording after took bench/allreduce.py's 1 MiB all-reduce from 0.88-0.92x raw to 0.97-1.01x).
        request = transport.start(kind, send, recv, op, peer, tag, False, counts)
        record = self._begin(kind, a, peer, False, sent)
        if now:
            return self._complete(request, record, send, recv, finish, args)
        # MPI (or NCCL) reads and writes the buffers until the op completes: the handle keeps them.
        return Handle(self._complete, (request, record, send, recv, finish, args), request, record)

    def _complete(self, request, record: watchdog.OpRecord, send, recv, finish: Callable | None, args: tuple):
        """Wait for an op `_start` started, then finish its result. A timed-out op's request and
        buffers are kept for good: MPI may still be working on them."""
        try:
            wait_for(request, record, self._watched)
        except watchdog.CommTimeout:
            _ABANDONED.append((request, send, recv))
            raise
        return recv if finish is None else finish(*args)

    def _block(self, kind: str, a, start: Callable, args: tuple, send, recv, peer: int | None = None,
               sent: float | None = None) -> None:
        """Complete blocking host op `start(*args)`: MPI's blocking call (`_in_mpi`), else a start
        polled once recorded (`_start`); recorded as blocked-in, whose timeout the monitor aborts."""
        if self._in_mpi:
            entry = self._begin(kind, a, peer, True, sent)
            try:
                start(*args)
            finally:  # an MPI error must not leave the op pending for the monitor to time out
                watchdog.recorder.leave(entry)
            return
        request = start(*args)
        entry = self._begin(kind, a, peer, True, sent)
        try:
            wait_blocked(request, entry)
        except watchdog.CommTimeout:
            _ABANDONED.append((request, send, recv))  # see _complete
            raise
        finally:
            watchdog.recorder.leave(entry)

    # -- plans: the short path of a repeated host op ----------------------------------------------

    def _keep_plan(self, key: tuple, kind: str, a, op: str | None, recv, now: bool) -> None:
        """Keep, under `key`, the plan of host op `kind` on C-contiguous NumPy `a` into `recv` (`a`:
        in place) that needs no finishing: (kind, its start `MpiTransport.starter`, the result's
        shape or None). The next calls with `key` check and prepare nothing but the result before
        entering MPI (`_run`, `iall_reduce`). Blocking plans need the monitor (see `_start`)."""
        if now and not self._watched:
            return
        if len(self._plans) >= 256:  # shapes come and go (evaluation, a changed batch): keep the recent
            self._plans.clear()
        in_place = recv is a
        start = self._host.starter(kind, a.dtype, op, now and self._in_mpi, in_place, a.size, recv.nbytes)
        self._plans[key] = (kind, start, None if in_place else recv.shape)

    def _run(self, plan: tuple, a):
        """Run a kept blocking plan on `a` (C-contiguous NumPy of its shape and dtype): its result."""
        kind, start, shape = plan
        recv = self._results.take(shape, a.dtype, np)
        if watchdog.check_every():
            self._check_sequence(kind, a)
        self._block(kind, a, start, (a, recv), a, recv)
        return recv

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

    def _begin(self, op: str, a, peer: int | None = None, blocked: bool = False, sent: float | None = None):
        """Number and record an op and count the bytes it sends from this rank (a broadcast's on
        its root `peer` only; `sent` when the op knows them better than `bytes_sent`'s formula:
        all_to_all_v). `blocked`: a blocking op, recorded as the op this thread is blocked in
        (`recorder.enter`; the monitor aborts the job on its timeout) and returned as the entry
        `recorder.leave` takes; else an OpRecord (`recorder.begin`) that a wait polls. The record
        keeps a send's or receive's `peer`. Every op passes here: it is kept short."""
        record_peer = peer if op == "send" or op == "recv" else None
        seq = self._seq
        self._seq = seq + 1
        if a is None:
            shape, dtype, nbytes = (), "", 0
        else:
            shape, dtype, nbytes = a.shape, a.dtype, a.nbytes
            if sent is not None or op != "broadcast" or peer == self.rank:
                self.sent[op] += self._factor[op] * nbytes if sent is None else sent
        if blocked:
            return watchdog.recorder.enter(self.name, seq, op, shape, dtype, nbytes, record_peer, self._group)
        return watchdog.recorder.begin(self.name, seq, op, shape, dtype, nbytes, record_peer, self._group)

    def wait_any(self, handles: list) -> int:
        """Complete whichever of `handles` (this communicator's non-blocking host ops; None entries
        are skipped) finishes first and return its index: a server's loop over its clients'
        messages (see `waiting.wait_any`)."""
        return wait_any(handles)

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
        wait_for(self.mpi.Iallgather([mine, MPI.INT64_T], [every, MPI.INT64_T]), record, self._watched)
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

    # -- reductions -----------------------------------------------------------------------------

    def _check_op(self, what: str, op: str, a, allowed=("sum", "avg", "max", "min")) -> None:
        if op not in allowed:
            raise ValueError(f"{what} on '{self.name}': unknown op {op!r}; use one of {', '.join(allowed)}")
        if op == "avg" and not DTYPE_FACTS[a.dtype][2]:
            raise ValueError(f"{what} on '{self.name}': op 'avg' needs a floating dtype, got {a.dtype}")

    def _work_buffer(self, send, transport):
        """`send` in the dtype its reduction runs in: its own, or float32 for 16-bit floats over
        MPI (bfloat16 has no MPI type; float16 sums would round at every addition, so a result
        would depend on the number of ranks; NCCL reduces those natively)."""
        if transport is self._host and DTYPE_FACTS[send.dtype][1]:
            return send.astype(np.float32)
        return send

    def iall_reduce(self, a, op: str = "sum") -> Handle:
        """Start an all-reduce; `wait()` returns the reduced array (same shape).

        In place on `a` when `a` is contiguous; otherwise on a contiguous copy.
        """
        plan = self._plans.get(("iall_reduce", a.shape, a.dtype, op))
        if plan is None or type(a) is not np.ndarray or not a.flags.c_contiguous:
            return self._iall_reduce(a, op, True, False)
        if watchdog.check_every():
            self._check_sequence("all_reduce", a)
        request = plan[1](a, a)
        record = self._begin("all_reduce", a)
        return Handle(self._complete, (request, record, a, a, None, ()), request, record)

    def all_reduce(self, a, op: str = "sum"):
        """Elementwise sum/avg/max/min of `a` over the ranks (replicated result); `a` is not modified."""
        plan = self._plans.get(("all_reduce", a.shape, a.dtype, op))
        if plan is None or type(a) is not np.ndarray or not a.flags.c_contiguous:
            return self._iall_reduce(a, op, False, True)
        return self._run(plan, a)

    def _iall_reduce(self, a, op: str, in_place: bool, now: bool):
        self._check_op("all_reduce", op, a)
        if self.size == 1:
            return _ready(a, now)
        transport = self._transport(a)
        if transport is None:
            return self._staged(self._iall_reduce, a, (op, in_place), now,
                                a if in_place and a.flags.c_contiguous else None)
        send = contiguous(a)
        work = self._work_buffer(send, transport)
        if work is not send:  # reduce the upcast copy in place, cast back when finished
            send = recv = work
        else:  # in place on `a` (or the copy a strided `a` needed) when asked, else into a new result:
            # out of place whatever `a`'s layout, since that decides the MPI calls (a large one is
            # split, `MpiTransport.start`) and every rank must issue the same ones
            recv = send if in_place else self._results.take(send.shape, send.dtype, transport.xp)
        finish = None if op != "avg" and recv.dtype == a.dtype else self._reduced
        if finish is None and send is a and transport is self._host:
            self._keep_plan(("all_reduce" if now else "iall_reduce", a.shape, a.dtype, op), "all_reduce", a, op,
                            recv, now)
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
        plan = self._plans.get(("reduce_scatter", a.shape, a.dtype, dim, op))
        if plan is None or type(a) is not np.ndarray or not a.flags.c_contiguous:
            return self._ireduce_scatter(a, dim, op, True)
        return self._run(plan, a)

    def _ireduce_scatter(self, a, dim: int, op: str, now: bool, out=None):
        self._check_op("reduce_scatter", op, a, allowed=("sum", "avg"))
        dim = self._dim_divisible("reduce_scatter", a, dim)
        if out is not None:
            self._check_out("reduce_scatter", a, dim, out, a.shape[0] // self.size)
        if self.size == 1:
            return _ready(a if out is None else copied(a, out), now)  # size 1: nothing to do
        transport = self._transport(a)
        if transport is None:
            return self._staged(self._ireduce_scatter, a, (dim, op), now, out)
        send = self._work_buffer(to_front(a, dim), transport)
        own = out is not None and out.dtype == send.dtype
        recv = out if own else self._results.take((send.shape[0] // self.size,) + send.shape[1:], send.dtype,
                                            transport.xp)
        finish = None if op != "avg" and not dim and recv.dtype == a.dtype else self._scattered
        if now and finish is None and out is None and send is a and transport is self._host:
            self._keep_plan(("reduce_scatter", a.shape, a.dtype, dim, op), "reduce_scatter", a, op, recv, True)
        return self._start("reduce_scatter", a, send, recv, transport, now, finish, (recv, a, dim, op, out), op)

    def _scattered(self, recv, a, dim: int, op: str, out):
        """A reduce-scatter's result from its receive buffer: divided by size for avg, in `out`
        when given, else cast back to `a`'s dtype with `dim` moved back."""
        if op == "avg":
            recv /= self.size
        if out is not None and recv is not out:
            out[...] = recv
            return out
        return from_front(recv.astype(a.dtype, copy=False), dim)

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
        plan = self._plans.get(("all_gather", a.shape, a.dtype, dim))
        if plan is None or type(a) is not np.ndarray or not a.flags.c_contiguous:
            return self._iall_gather(a, dim, True)
        return self._run(plan, a)

    def _iall_gather(self, a, dim: int, now: bool, out=None):
        dim = self._dim("all_gather", a, dim)
        if out is not None:
            self._check_out("all_gather", a, dim, out, a.shape[0] * self.size)
        if self.size == 1:
            return _ready(a if out is None else copied(a, out), now)  # size 1: nothing to do
        transport = self._transport(a)
        if transport is None:
            return self._staged(self._iall_gather, a, (dim,), now, out)
        send = to_front(a, dim)
        recv = out if out is not None else self._results.take((send.shape[0] * self.size,) + send.shape[1:], send.dtype,
                                                        transport.xp)
        if now and out is None and not dim and send is a and transport is self._host:
            self._keep_plan(("all_gather", a.shape, a.dtype, dim), "all_gather", a, None, recv, True)
        return self._start("all_gather", a, send, recv, transport, now, from_front if dim else None, (recv, dim))

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
        send = to_front(a, dim)
        recv = self._results.take(send.shape, send.dtype, transport.xp)
        return self._start("all_to_all", a, send, recv, transport, now, from_front if dim else None, (recv, dim))

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
        send = contiguous(a)
        row = math.prod(a.shape[1:])
        recv = self._results.take((sum(recv_counts),) + tuple(a.shape[1:]), a.dtype, np)
        elements = (np.array(send_counts, dtype=np.int64) * row, np.array(recv_counts, dtype=np.int64) * row)
        if mpi_datatype(a.dtype) is None:  # moved as raw bytes (see DTYPE_FACTS)
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
        buf = contiguous(a)
        return self._start("broadcast", a, buf, buf, transport, now, None if buf is a else copied, (buf, a),
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
        return self._start("send", a, contiguous(a), None, transport, now, peer=dest, tag=tag)

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
        return self._start("recv", out, None, buf, transport, now, copied, (buf, out), peer=source, tag=tag)

    def isend_irecv(self, a, dest: int, out, source: int, send_tag: int = 0, recv_tag: int = 0
                    ) -> tuple[Handle, Handle]:
        """Start sending `a` to `dest` and receiving into `out` from `source` at once; returns the
        (send, receive) handles. On NCCL the two are one group: NCCL matches messages in posting
        order and a send waits for its receiver, so two ranks that each send, then receive, would
        wait on each other forever if posted one by one (`simulate.check_in_order_transport`).
        On MPI, where tags match messages, it is an Irecv and an Isend."""
        if not (0 <= dest < self.size and 0 <= source < self.size):
            self._check_rank("send", dest, "dest")
            self._check_rank("recv", source, "source")
        if type(a) is np.ndarray and type(out) is np.ndarray and a.flags.c_contiguous and out.flags.c_contiguous:
            # Host arrays as they are: both started before either is recorded (see `_start`).
            send, receive = self._host.exchange(a, dest, send_tag, out, source, recv_tag)
            sent, received = self._begin("send", a, dest), self._begin("recv", out, source)
            return (Handle(self._complete, (send, sent, a, None, None, ()), send, sent),
                    Handle(self._complete, (receive, received, None, out, None, ()), receive, received))
        transport = self._transport(a)
        if not isinstance(transport, NcclTransport) or self._transport(out) is not transport:
            return self._isend(a, dest, send_tag, False), self._irecv(out, source, recv_tag, False)
        buf = contiguous(a)
        rbuf = out if out.flags.c_contiguous else transport.xp.empty_like(out, order="C")
        sent, received = self._begin("send", a, dest), self._begin("recv", out, source)
        request = transport.start_group([("send", buf, None, None, dest), ("recv", None, rbuf, None, source)])

        def sent_done(buf):  # the handle keeps the buffer NCCL reads until the op completes
            wait_for(request, sent, self._watched)

        def received_done(rbuf):
            wait_for(request, received, self._watched)
            return out if rbuf is out else copied(rbuf, out)
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


def mpi_world() -> MPI.Comm:
    """MPI_COMM_WORLD, for code above the runtime that builds a run over every rank of the job
    (a `Trainer`, `Mesh`) and imports no mpi4py itself."""
    return MPI.COMM_WORLD


def mpi_self() -> MPI.Comm:
    """MPI_COMM_SELF: this process alone (a one-rank `Mesh`), for code above the runtime."""
    return MPI.COMM_SELF
