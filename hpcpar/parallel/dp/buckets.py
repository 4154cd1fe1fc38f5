"""Gradient buckets: their assignment, the flat buffers, and launching their reductions in order.

A bucket is one flat gradient buffer `grad` of shape `[size]` (dtype of its parameters) that
holds the gradients of several parameters back to back, each parameter's `.grad` being a view
of its slice `grad[offset:offset + numel].reshape(shape)`; `size` is the sum of the numels
rounded up to a multiple of `pad_to` (zero padding at the end). Backward then accumulates
straight into the buffer that goes on the wire, and one large collective per bucket replaces
many small ones (PyTorch DDP, arXiv 2006.15704).

Three pieces, from pure to stateful:

- `assign_buckets` -> `BucketAssignment`s of `Slot`s: which parameter goes where (pure, no arrays).
  Buckets are filled in *reverse* registration order, about the order backward completes the
  gradients, so the first bucket can go on the wire while backward is still busy with earlier
  layers. Tied copies (the embedding and the LM head on different pipeline stages) go in one
  final bucket of their own, since they are summed across stages first.
- `Bucket`: an assignment plus its buffer, the parameter views and the state of this step's
  reduction.
- `BucketManager`: owns the buckets of one rank. A grad hook counts each parameter's
  contributions over the step's micro-batches; once every parameter of a bucket has all of them
  (with gradient accumulation only the last micro-batch's completes it), the bucket is ready.
  Ready buckets are launched strictly in index order (a ready bucket waits for its
  predecessors): every dp rank then issues identical collectives in identical order whatever
  its own hook timing, which is what non-blocking collectives require. After launching, a
  `comm.progress()` lets MPI (which has no progress thread) move the reductions in flight while
  backward computes. `finish_backward` launches whatever is left (a bucket whose parameters
  got no gradient is reduced as zeros, so no rank skips a collective another one issues) and
  waits for all.

How a bucket travels is pluggable (a "reduction"): `AllReduceAvg` leaves the dp average of the
whole bucket in `grad`; `ReduceScatterAvg` leaves this rank's part, `part = average of
grad[rank * size/dp : (rank + 1) * size/dp]` of shape `[size/dp]`, in `bucket.part` (ZeRO; with
HSDP the reduce-scatter runs inside the shard group and the part is then averaged over the
replicas); `CompressedReduction` does either through a gradient compressor
(hpcpar/parallel/dp/compression/compressors.py). A reduction has `comm` (the communicator the bucket is
divided over), `shards` (True: the result is this rank's part), `start(bucket) -> Handle`
(non-blocking, called from grad hooks) and `finish(bucket, handle)` (waits; returns the part
when `shards`, else leaves the whole average in `bucket.grad`).

ZeRO-2 (`release=True`): a bucket's full gradient buffer exists only while its gradients are
being produced and reduced. It is allocated at the first grad hook of one of its parameters
(that parameter's gradient so far is copied in, later micro-batches accumulate in place), and
dropped as soon as its reduce-scatter has completed: a bucket launched from a hook is waited
once more than `MAX_IN_FLIGHT` are on the wire, the rest in `finish_backward`. Only the parts
stay between steps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Hashable, Iterable, Protocol, Sequence

import numpy as np

from hpcpar import backend
from hpcpar.errors import ConfigError

if TYPE_CHECKING:
    from hpcpar.runtime.comm import Communicator
    from hpcpar.runtime.transports import Handle
    from hpcpar.parallel.dp.compression.compressors import Compressor


# -- the assignment (pure) ----------------------------------------------------------------------

@dataclass(frozen=True)
class Slot:
    """Where parameter `index` (position in the given list) lives in its bucket: [offset, offset+numel)."""

    name: str
    index: int
    offset: int
    numel: int


@dataclass(frozen=True)
class BucketAssignment:
    """The parameters one flat gradient buffer holds: their slots, its padded size (a multiple of
    `pad_to`) and dtype."""

    slots: tuple
    size: int
    dtype: str
    tied: bool = False

    @property
    def used(self) -> int:
        """Elements holding gradients (the rest is zero padding)."""
        return sum(s.numel for s in self.slots)


def assign_buckets(params: list[tuple[str, int, str]], bucket_bytes: int, pad_to: int = 1,
                   tied: Iterable[str] = (), groups: Sequence[Hashable] | None = None) -> list[BucketAssignment]:
    """Group parameters into flat buckets.

    Args:
        params: (name, numel, dtype) in registration order.
        bucket_bytes: a bucket is closed once it holds at least this many bytes (a larger
            parameter gets a bucket of its own).
        pad_to: every bucket's size is rounded up to a multiple of this (dp, for ZeRO's
            reduce-scatter and the compressed all-to-all).
        tied: names that go in one final bucket (sorted by name), not in the regular ones.
        groups: a key per parameter (same order as `params`): a bucket never mixes keys (nor
            dtypes). Each key keeps its own open bucket, so parameters of one key that are
            interleaved with another's still share buckets; the open buckets left at the end
            close in the order they were opened. Gradient compressors use it: PowerSGD keeps
            matrices and vectors apart, int8 and top-k keep tp-replicated parameters apart
            from tp-split ones (their blocks and selections span parameters, and a replicated
            parameter must be compressed identically on every tp rank).

    Returns:
        Regular buckets in reverse registration order (without `groups` a new bucket also
        starts where the dtype changes), then the tied bucket if any.
    """
    tied = set(tied)
    buckets: list[BucketAssignment] = []
    open_buckets: dict[Hashable, tuple[list[Slot], int, str]] = {}  # key -> (slots, elements, dtype)

    def close(key, is_tied: bool = False) -> None:
        slots, used, dt = open_buckets.pop(key)
        if slots:
            buckets.append(BucketAssignment(tuple(slots), -(-used // pad_to) * pad_to, dt, is_tied))

    for index in reversed(range(len(params))):
        name, numel, dt = params[index]
        if name in tied:
            continue
        key = (groups[index] if groups is not None else None, dt)
        if groups is None and open_buckets and key not in open_buckets:
            close(next(iter(open_buckets)))  # one open bucket: a dtype change closes it
        slots, offset, _ = open_buckets.setdefault(key, ([], 0, dt))
        slots.append(Slot(name, index, offset, numel))
        open_buckets[key] = (slots, offset + numel, dt)
        if (offset + numel) * np.dtype(dt).itemsize >= bucket_bytes:
            close(key)
    for key in list(open_buckets):
        close(key)

    tied_params = sorted((name, i) for i, (name, _, _) in enumerate(params) if name in tied)
    if tied_params:
        dtypes = {params[i][2] for _, i in tied_params}
        if len(dtypes) > 1:
            raise ConfigError(f"tied weights {[n for n, _ in tied_params]} have different dtypes {sorted(dtypes)}; "
                              "tied copies must share one dtype")
        slots, offset = [], 0
        for name, i in tied_params:
            slots.append(Slot(name, i, offset, params[i][1]))
            offset += params[i][1]
        open_buckets["tied"] = (slots, offset, dtypes.pop())
        close("tied", is_tied=True)
    return buckets


# -- reductions: how a bucket goes on the wire ----------------------------------------------------

class Reduction(Protocol):
    """How one bucket is averaged over `comm` (see the module docstring)."""

    comm: Communicator
    shards: bool

    def start(self, bucket: Bucket) -> Handle: ...

    def finish(self, bucket: Bucket, handle: Handle) -> Any: ...


class AllReduceAvg:
    """The whole bucket averaged in place on every rank (`iall_reduce(op="avg")`)."""

    shards = False

    def __init__(self, comm: Communicator):
        self.comm = comm

    def start(self, bucket: Bucket) -> Handle:
        return self.comm.iall_reduce(bucket.grad, op="avg")  # in place: the result is bucket.grad

    def finish(self, bucket: Bucket, handle: Handle) -> None:
        handle.wait()


class ReduceScatterAvg:
    """This rank's part of the averaged bucket, `[size/n]` (`ireduce_scatter(op="avg")` over the
    n ranks of `comm`): ZeRO. With `replicate` (HSDP: the same shard on every replica) the part is
    then averaged over the replicas too, so it is the average over `comm` x `replicate`. The part
    lands in a buffer the bucket keeps (`bucket.part_buffer`), never in recycled memory; with
    `in_bucket` (ZeRO-1, which keeps the whole gradient buffer anyway) it is then copied into the
    bucket's own elements of this rank's part, `grad[rank * size/n:(rank + 1) * size/n]`, and the
    separate buffer is freed: the unreduced local gradient there is not needed any more."""

    shards = True

    def __init__(self, comm: Communicator, replicate: Communicator | None = None, in_bucket: bool = False):
        self.comm = comm
        self.replicate = replicate if replicate is not None and replicate.size > 1 else None
        self.in_bucket = in_bucket

    def start(self, bucket: Bucket) -> Handle:
        if bucket.part_buffer is None:
            bucket.part_buffer = backend.array_module(bucket.grad).empty(bucket.assignment.size // self.comm.size,
                                                                         dtype=bucket.assignment.dtype)
        return self.comm.ireduce_scatter(bucket.grad, dim=0, op="avg", out=bucket.part_buffer)

    def finish(self, bucket: Bucket, handle: Handle):
        part = handle.wait()
        if self.replicate is not None:
            self.replicate.iall_reduce(part, op="avg").wait()  # in place
        if not self.in_bucket:
            return part
        n = bucket.assignment.size // self.comm.size
        mine = bucket.grad[self.comm.rank * n:(self.comm.rank + 1) * n]
        mine[...] = part
        bucket.part_buffer = None
        return mine


class CompressedReduction:
    """A bucket through a gradient compressor (hpcpar/parallel/dp/compression/compressors.py).

    Without `scatter` the compressor's communicator is the bucket's group: compress and exchange
    when launched; when finished, decompress this rank's averaged part, and unless `shards`,
    gather the whole averaged bucket back into `bucket.grad` (the all-reduce case). With `shards`
    the result is the part of `part_comm` (default: the compressor's communicator; PowerSGD under
    HSDP averages over all of dp and keeps the part of the shard group).

    With `scatter` (HSDP: the shard group; the compressor's communicator is then the replica
    group), the bucket is first reduce-scattered uncompressed inside the shard group (the fast
    links, inside a node), and this rank's part is then averaged over the replicas through the
    compressor, in the all-reduce form: compression goes where the links are slow.
    """

    def __init__(self, compressor: Compressor, shards: bool, scatter: Communicator | None = None,
                 part_comm: Communicator | None = None):
        self.compressor = compressor
        self.shards = shards
        self.scatter = scatter
        self.comm = scatter if scatter is not None else compressor.comm  # what the bucket divides over
        self.replicate = compressor.comm if scatter is not None else None
        self.part_comm = part_comm if part_comm is not None else self.comm
        if scatter is not None and not shards:
            raise ConfigError("a compressed reduction after a reduce-scatter (HSDP) needs ZeRO's parts (shards=True)")
        compressor.gathers = scatter is not None or not shards or self.part_comm is not compressor.comm

    def start(self, bucket: Bucket) -> Handle:
        if self.scatter is None:
            return self.compressor.exchange(self.compressor.compress(bucket.index, bucket.grad))
        if bucket.part_buffer is None:
            bucket.part_buffer = backend.array_module(bucket.grad).empty(bucket.assignment.size // self.scatter.size,
                                                                         dtype=bucket.assignment.dtype)
        return self.scatter.ireduce_scatter(bucket.grad, dim=0, op="avg", out=bucket.part_buffer)

    def finish(self, bucket: Bucket, handle: Handle):
        c, i = self.compressor, bucket.index
        if self.scatter is not None:  # HSDP: the shard's average over the replicas, compressed
            part = handle.wait()
            whole = c.all_gather(i, c.decompress(i, c.exchange(c.compress(i, part)).wait()))
            return whole.astype(bucket.assignment.dtype)
        part = c.decompress(i, handle.wait())
        if not self.shards:
            bucket.grad[...] = c.all_gather(i, part)
            return None
        if self.part_comm is not c.comm:
            whole = c.all_gather(i, part)
            n = whole.shape[0] // self.part_comm.size
            part = whole[self.part_comm.rank * n:(self.part_comm.rank + 1) * n]
        return part.astype(bucket.assignment.dtype)


# -- runtime ------------------------------------------------------------------------------------

class Bucket:
    """An assignment plus its buffers and the state of this step's reduction.

    Attributes:
        index: position in the manager's list (= launch order).
        assignment: the BucketAssignment.
        params: the parameters of `assignment.slots`, in slot order.
        grad: the flat gradient buffer `[assignment.size]`; each parameter's `.grad` is a view of it.
        views: those views, in slot order.
        ready: parameters with all their contributions this step.
        handle: the reduction in flight (None before launch, after completion, or when dp = 1).
        part: after completion of a sharding reduction, this rank's averaged part `[size/dp]`
            (with dp = 1 the whole `grad`); None otherwise.
        part_buffer: where a sharding reduction writes the part (kept from step to step).
    """

    def __init__(self, index: int, assignment: BucketAssignment, params: list, xp, allocate: bool = True):
        self.index = index
        self.assignment = assignment
        self.params = [params[s.index] for s in assignment.slots]
        self.xp = xp
        self.grad = None
        self.views: list = []
        self.ready = 0
        self.handle = None
        self.part = None
        self.part_buffer = None
        if allocate:
            self.allocate()

    def allocate(self) -> None:
        """A zeroed flat gradient buffer and the parameters' views of it."""
        self.grad = self.xp.zeros(self.assignment.size, dtype=self.assignment.dtype)
        self.views = [self.grad[s.offset:s.offset + s.numel].reshape(p.shape)
                      for s, p in zip(self.assignment.slots, self.params)]

    def release(self) -> None:
        """Drop the full gradient buffer (ZeRO-2, once reduced); the parameters' `.grad` too."""
        for p, v in zip(self.params, self.views):
            if p.grad is v:
                p.grad = None
        self.grad, self.views = None, []


class BucketManager:
    """The buckets of one rank and the in-order launching of their reductions.

    Args:
        named_params: (name, Parameter) in registration order (the order `assignments` index into).
        assignments: from `assign_buckets` over the same list (regular buckets, then the tied one).
        reduction: how each bucket is averaged; its `comm` is the dp communicator.
        tied_comm: the tied bucket is summed over this communicator (first and last pipeline
            stage) before its reduction; None: nothing to sum.
        overlap: launch ready buckets from the grad hooks (False: all in `finish_backward`,
            the no-overlap baseline for benchmarks).
        release: ZeRO-2: allocate each bucket's full gradient buffer when its first gradient
            arrives and drop it once its (sharding) reduction has completed (module doc).
        prepare: called with each bucket when it is complete, just before its reduction starts
            (`DataParallel`: a compressed bucket's sequence-parallel gradients summed over tp).

    `listeners`: functions called with each bucket right after `prepare`, before its reduction
    starts, in launch order (regular buckets by index, from the hooks while backward goes on or
    from `finish_backward`, then the tied bucket, summed over `tied_comm`): this rank's gradients
    of its parameters are complete and not yet reduced (the parameter-server client pushes
    them from here).

    Per step: `begin_step(microbatches)`, the backwards (hooks call `on_grad`),
    `finish_backward()`.

    Attributes:
        events: (kind, what, time.perf_counter()) appended during the step: ("grad_ready", name, t)
            when a parameter has all its contributions, ("bucket_start", i, t) when bucket i's
            reduction is launched. Cleared by `begin_step`.
    """

    MAX_IN_FLIGHT = 2  # ZeRO-2: reductions launched from hooks and not yet waited, at most

    def __init__(self, named_params: list[tuple[str, Any]], assignments: list[BucketAssignment], reduction: Reduction,
                 tied_comm: Communicator | None = None, overlap: bool = True, release: bool = False,
                 prepare: Callable[[Bucket], None] | None = None):
        params = [p for _, p in named_params]
        self.reduction = reduction
        self.prepare = prepare
        self.comm = reduction.comm
        replicate = getattr(reduction, "replicate", None)
        self._alone = self.comm.size == 1 and (replicate is None or replicate.size == 1)  # nothing to reduce
        self.tied_comm = tied_comm
        self.overlap = overlap
        self.release = release
        if release and not reduction.shards:
            raise ConfigError("releasing bucket gradients (ZeRO-2) needs a sharding reduction")
        xp = backend.array_module(*(p.data for p in params))
        self.buckets = [Bucket(i, assignment, params, xp, allocate=not release)
                        for i, assignment in enumerate(assignments)]
        self._in_flight: list[Bucket] = []
        self.n_regular = sum(1 for b in self.buckets if not b.assignment.tied)
        self._name_of = {id(p): n for n, p in named_params}
        self._where = {id(p): b for b in self.buckets for p in b.params}
        self._counts = {id(p): 0 for p in params}
        self._microbatches = 0
        self._next_launch = 0
        self._armed = False
        self.events: list[tuple[str, Any, float]] = []
        self.listeners: list[Callable[[Bucket], None]] = []
        self.attach_grads()
        for p in params:
            p.register_grad_hook(self.on_grad)

    def set_reduction(self, reduction: Reduction) -> None:
        """Reduce the buckets with `reduction` from the next launch on (gradient compression
        switches between its compressed reduction and the plain one at its start step); it must
        give the same kind of result (parts or whole buckets) over the same ranks."""
        if reduction.shards != self.reduction.shards:
            raise ConfigError("set_reduction: the new reduction must give the same kind of result (parts or whole)")
        self.reduction, self.comm = reduction, reduction.comm

    def attach_grads(self) -> None:
        """Point every parameter's `.grad` at its slice of its bucket (someone may have reset it)."""
        for b in self.buckets:
            for p, v in zip(b.params, b.views):
                p.grad = v

    def begin_step(self, microbatches: int = 1) -> None:
        """Zero the buckets, point every `.grad` at its view, arm the hooks for `microbatches` backwards.
        (ZeRO-2: no buffer yet; every `.grad` is None until its bucket is allocated by a hook.)"""
        if microbatches < 1:
            raise ConfigError(f"microbatches must be >= 1, got {microbatches}")
        for b in self.buckets:
            if self.release:
                b.release()
                for p in b.params:
                    p.grad = None
            else:
                b.grad.fill(0)
            b.ready, b.handle, b.part = 0, None, None
        self._in_flight = []
        self.attach_grads()
        for k in self._counts:
            self._counts[k] = 0
        self._microbatches = microbatches
        self._next_launch = 0
        self._armed = True
        self.events = []

    def on_grad(self, p) -> None:
        """Grad hook: one more contribution to `p`; launch buckets that became complete."""
        if not self._armed:
            return
        key = id(p)
        n = self._counts[key] + 1
        self._counts[key] = n
        if n > self._microbatches:
            raise RuntimeError(f"parameter {self._name_of[key]} received {n} gradients in a step "
                               f"of {self._microbatches} micro-batch(es); its bucket was already reduced. "
                               "Call begin_step(microbatches=...) with the number of backward passes")
        if self.release:
            self._adopt(self._where[key], p)
        if n < self._microbatches:
            return
        self.events.append(("grad_ready", self._name_of[key], time.perf_counter()))
        self._where[key].ready += 1
        if self.overlap:
            while (self._next_launch < self.n_regular
                   and self.buckets[self._next_launch].ready == len(self.buckets[self._next_launch].params)):
                self._launch(self.buckets[self._next_launch])
                self._next_launch += 1
            if self._next_launch:
                self.comm.progress()  # keeps the launched reductions moving during backward
            while self.release and len(self._in_flight) > self.MAX_IN_FLIGHT:
                self._complete(self._in_flight.pop(0))  # the oldest: its full buffer goes away

    def _adopt(self, b: Bucket, p) -> None:
        """ZeRO-2: make sure bucket `b` has its buffer and `p.grad` is its view (copying in the
        gradient autograd stored on its own at `p`'s first contribution)."""
        if b.grad is None:
            b.allocate()
        view = b.views[b.params.index(p)]
        if p.grad is not view:
            if p.grad is not None:
                view[...] = p.grad
            p.grad = view

    def _launch(self, b: Bucket) -> None:
        """Start bucket `b`'s reduction (nothing to do on one rank)."""
        self.events.append(("bucket_start", b.index, time.perf_counter()))
        if self.release:
            for p in b.params:  # parameters that got no gradient (or no hook yet) are zeros / adopted
                self._adopt(b, p)
        if self.prepare is not None:
            self.prepare(b)
        for listener in self.listeners:
            listener(b)
        if not self._alone:
            b.handle = self.reduction.start(b)
        if self.release:
            self._in_flight.append(b)

    def _complete(self, b: Bucket) -> None:
        """Wait for bucket `b`'s reduction; the average is left in `b.grad` (or `b.part`). ZeRO-2
        drops the full buffer afterwards."""
        if b.part is not None or (b.handle is None and not self._alone):
            return  # completed already (ZeRO-2 waits for some from the hooks)
        if self._alone:  # one rank: the bucket is its own average, and all of it is this rank's part
            b.part = b.grad if self.reduction.shards else None
        else:
            handle, b.handle = b.handle, None
            b.part = self.reduction.finish(b, handle)
        if self.release:
            if b.part is b.grad:  # one rank: the part is the buffer; keep a copy, drop the rest
                b.part = b.grad.copy()
            b.release()

    def finish_backward(self) -> None:
        """Launch the buckets not yet started (the tied one last, after summing it over
        `tied_comm`), wait for every reduction."""
        if not self._armed:
            raise RuntimeError("finish_backward() without begin_step(); call begin_step(microbatches) first")
        while self._next_launch < self.n_regular:
            self._launch(self.buckets[self._next_launch])
            self._next_launch += 1
        for b in self.buckets[self.n_regular:]:
            if self.release:
                for p in b.params:
                    self._adopt(b, p)
            if self.tied_comm is not None:
                self.tied_comm.iall_reduce(b.grad, op="sum").wait()  # in place
            self._launch(b)
        for b in self.buckets:
            self._complete(b)
        self._in_flight = []
        self._armed = False
