"""The bucketed strategies' common part (DDP and ZeRO-1/2): gradients in flat buckets, reduced
while backward runs, optionally through a gradient compressor.

Each parameter's `.grad` is a view of a flat bucket (buckets.py); the `BucketManager`'s grad
hooks launch each complete bucket's non-blocking reduction in index order while backward goes
on. How a bucket travels is the strategy's (`_plain_reduction`: DDP all-reduces the whole bucket
over dp x cp, ZeRO reduce-scatters it in the shard group); a compressor (compression/) replaces
it after `compression.start_step` warm-up steps. Without HSDP the buckets are compressed over
dp x cp; with HSDP the shard group reduce-scatters uncompressed and the compressor averages the
shards over dp_replicate (except PowerSGD, which factors whole matrices: over all of dp x cp).
The compressor's residuals and PowerSGD Qs go into checkpoints (compression/state.py).

A strategy may keep row-sparse gradients out of the buckets (`_sparse_rows`: the untied
embedding, synced as (row id, row) pairs or dense each step after the buckets, sparse.py: DDP's
`SparseRows`, ZeRO-1/2's `OwnedRows`, each row to its owner).
"""

from __future__ import annotations

import abc
from typing import Any, Callable, Iterable

from hpcpar.runtime.topology import Axis
from hpcpar.parallel.dp.buckets import BucketManager, CompressedReduction, Reduction, assign_buckets
from hpcpar.parallel.dp.compression.compressors import BucketSpec, Compression, SpecSlot, make_compressor
from hpcpar.parallel.dp.compression.state import CompressionState
from hpcpar.parallel.dp.data_parallel import DataParallel, distinct_nbytes
from hpcpar.parallel.dp.sparse import OwnedRows, SparseRows
from hpcpar.state import key_of

_MIB = 1 << 20


class BucketedDataParallel(DataParallel):
    """Bucketed gradient averaging overlapped with backward, optionally compressed.

    Args (besides `DataParallel`'s):
        bucket_mb: bucket size in MiB.
        compression: gradient compression (`Compression`).
        overlap: start reductions from grad hooks during backward (False: all in
            `finish_backward`, the no-overlap baseline for benchmarks).
        release: ZeRO-2: drop each full gradient buffer once reduced (`BucketManager`).

    Attributes:
        buckets: the gradient buckets (`Bucket`: `.index`, `.assignment`, `.grad`, ...), launch order.
        events: (kind, what, time.perf_counter()) appended during the step: ("grad_ready", name, t)
            when a parameter has all its contributions, ("bucket_start", i, t) when bucket i's
            reduction is launched. Cleared by `begin_step`.
    """

    # Whether a reduction leaves this rank its part of each bucket (ZeRO) or the whole average.
    shards_parts: bool = False

    def __init__(self, named_params: Iterable[tuple[str, Any]], mesh, *, bucket_mb: float,
                 compression: Compression, overlap: bool = True, release: bool = False,
                 local_tied: bool = False, groups: tuple | None = None):
        named = list(named_params)
        super().__init__(named, mesh, local_tied=local_tied, groups=groups)
        self.compression = compression
        # Where the compressor runs: over dp x cp; under HSDP over the replicas only (the shard
        # group reduce-scatters uncompressed first), except PowerSGD, which factors whole matrices.
        self._compress_replicas = self.replicate_comm.size > 1 and compression.kind != "powersgd"
        self.compressor = make_compressor(compression, self.replicate_comm if self._compress_replicas else self.dp_comm)
        self._plain = reduction = self._plain_reduction()  # also the warm-up steps' reduction
        self._compressed = None
        if self.compressor is not None:
            self._compressed = reduction = CompressedReduction(
                self.compressor, shards=self.shards_parts,
                scatter=self.shard_comm if self._compress_replicas else None,
                part_comm=self.shard_comm if self.shards_parts else None)
        self._tp_summed_per_bucket = self.compressor is not None and bool(self._sequence_parallel)
        self._sparse = self._sparse_rows(named)  # synced apart from the buckets (sparse.py)
        named = [(n, p) for n, p in named if all(p is not s.param for s in self._sparse)]
        assignments = self._assign_buckets(named, bucket_mb)
        self.reducer = BucketManager(named, assignments, reduction, tied_comm=self.embedding_comm,
                                     overlap=overlap, release=release,
                                     prepare=self._sum_bucket_over_tp if self._tp_summed_per_bucket else None)
        self.buckets = self.reducer.buckets
        if self.embedding_comm is not None:
            tied = [b.assignment for b in self.buckets if b.assignment.tied]
            self._check_tied_match([(tied[0].size, tied[0].dtype)] if tied else [])
        if self.compressor is not None:
            self._setup_compressor(named)

    @abc.abstractmethod
    def _plain_reduction(self) -> Reduction:
        """How a bucket travels uncompressed."""

    def _sparse_rows(self, named: list[tuple[str, Any]]) -> list[SparseRows | OwnedRows]:
        """The row-sparse gradients this strategy syncs apart from the buckets (none by default)."""
        return []

    @property
    def embedding_sync(self) -> dict:
        """The row-sparse gradients' sync (sparse.py): {"steps": {"sparse": .., "dense": ..},
        "last": the last step's figures} of the (one) untied embedding; {} when it goes in the buckets."""
        return {"steps": dict(self._sparse[0].steps), "last": dict(self._sparse[0].last)} if self._sparse else {}

    def _assign_buckets(self, named: list[tuple[str, Any]], bucket_mb: float) -> list:
        """The bucket assignments: padded to a multiple of the shard group (ZeRO's parts) or of dp x cp
        (the compressors' rows, also of the parts of HSDP's shards over the replicas); with a
        compressor, parameters it must compress apart in different buckets."""
        pad = self.dp_size if self.compressor is not None or not self.shards_parts else self.shard_comm.size
        groups = ([self.compression.bucket_group(p.data.ndim, not p.layout.is_replicated) for _, p in named]
                  if self.compressor is not None else None)
        return assign_buckets([(n, int(p.data.size), str(p.data.dtype)) for n, p in named],
                              int(bucket_mb * _MIB), pad, self._tied, groups=groups)

    def _setup_compressor(self, named: list[tuple[str, Any]]) -> None:
        """Tell the compressor its buckets (each whole, or under HSDP this rank's shard of it) and
        map its state onto checkpoint tensors. A tied copy is known by the weight it mirrors (its
        PowerSGD Q starts the same, its state is saved once)."""
        names = {id(p): key_of(p, n) for n, p in named}
        specs, starts = [], {}
        for b in self.buckets:
            size = b.assignment.size // (self.shard_comm.size if self._compress_replicas else 1)
            lo = self.shard_comm.rank * size if self._compress_replicas else 0
            starts[b.index] = lo
            slots = []
            for s, p in zip(b.assignment.slots, b.params):
                a, z = max(lo, s.offset), min(lo + size, s.offset + s.numel)
                if a < z:
                    whole = (a, z) == (s.offset, s.offset + s.numel)
                    slots.append(SpecSlot(names[id(p)], a - lo, z - a, tuple(p.shape) if whole else (z - a,)))
            specs.append(BucketSpec(b.index, size, b.assignment.dtype, tuple(slots)))
        self.compressor.setup(specs)
        self.compression_state = CompressionState(self.compressor, self.buckets, starts, lambda p: names[id(p)],
                                                  self.mesh.comm(Axis.TP), self.mesh.world)

    # -- hooks and events -------------------------------------------------------------------------

    @property
    def overlap(self) -> bool:
        """Whether reductions start from grad hooks during backward."""
        return self.reducer.overlap

    @overlap.setter
    def overlap(self, value: bool) -> None:
        self.reducer.overlap = value

    @property
    def events(self) -> list[tuple[str, Any, float]]:
        """This step's ("grad_ready", name, t) and ("bucket_start", i, t) records."""
        return self.reducer.events

    @events.setter
    def events(self, value: list) -> None:
        self.reducer.events = value

    def on_bucket_ready(self, listener: Callable[[Any], None]) -> None:
        """Call `listener(bucket)` whenever a gradient bucket is complete on this rank, before its
        reduction starts, in bucket order (`BucketManager.listeners`): from the grad hooks of the
        last micro-batch's backward, the rest from `finish_backward`. The sequence-parallel
        parameters' tp sum comes after, in `finish_backward`."""
        self.reducer.listeners.append(listener)

    # -- the step ---------------------------------------------------------------------------------

    def begin_step(self, microbatches: int = 1, step: int | None = None) -> None:
        """Zero the gradient buckets, point every `.grad` at its view, arm the hooks (ZeRO-2:
        buffers come with the first gradients). `step` (the global step) decides whether
        gradient compression is on yet (`compression.start_step`); None: it is."""
        if self.compressor is not None:
            warm_up = step is not None and step < self.compression.start_step
            self.reducer.set_reduction(self._plain if warm_up else self._compressed)
        self.reducer.begin_step(microbatches)
        for rows in self._sparse:
            rows.begin_step()

    @property
    def compressing(self) -> bool:
        """Whether this step's buckets go through the compressor (False in the warm-up steps)."""
        return self.compressor is not None and self.reducer.reduction is self._compressed

    def _reduce(self) -> None:
        self._sum_local_tied([(a.grad, b.grad) for a, b in self._local_tied])
        self.reducer.finish_backward()
        for rows in self._sparse:  # after the buckets, in the same order on every rank
            rows.reduce()

    def _sum_bucket_over_tp(self, bucket) -> None:
        """Before bucket `bucket`'s (compressed) reduction: its sequence-parallel gradients summed over tp."""
        self._sum_over_tp([v for p, v in zip(bucket.params, bucket.views) if getattr(p, "tp_partial_grad", False)])

    def step(self, lr: float | None = None) -> None:
        if self.compressor is not None:
            self.compressor.commit()  # the step's residuals and Q count now that its update is applied
        self._update(lr)

    def _update(self, lr: float | None) -> None:
        """The optimizer step proper (ZeRO: and the all-gather of the updated parameters)."""
        self.optimizer.step(lr)

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds now, by kind: parameters, gradients (buckets and parts) and
        optimizer state, from the arrays themselves (each buffer counted once)."""
        seen: set = set()
        state = [v for st in self.optimizer.state_dict()["state"] for v in st.values()]
        params = distinct_nbytes((p.data for p in self.params), seen)
        grads = distinct_nbytes((b.grad for b in self.buckets), seen) + distinct_nbytes(
            (b.part_buffer for b in self.buckets), seen) + distinct_nbytes(
            (a for r in self._sparse for a in (r.grad, getattr(r, "part_buffer", None))), seen)
        return {"parameters": params, "gradients": grads, "optimizer": distinct_nbytes(state, seen), "gathered": 0}

