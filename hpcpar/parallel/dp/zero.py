"""ZeRO-1 and ZeRO-2: optimizer state (and ZeRO-2's gradients) sharded over the dp ranks
(arXiv 1910.02054, stages 1 and 2).

Every dp replica holds all parameters, but the optimizer's state (AdamW's two moments: twice
the parameters) is split: rank r owns part r of every gradient bucket (hpcpar/parallel/dp/buckets.py),
the elements `[r * size/n, (r + 1) * size/n)` of the flat `[size]` bucket (`size` is padded to
a multiple of n, the ranks of the shard group: dp x cp, or with HSDP dp_shard x cp), and keeps
optimizer state for those elements only, 1/n of the total.

Parameters live in one flat buffer per bucket, laid out like its gradients (`Part.flat`; every
`p.data` is a view of it). Per step: a reduce-scatter has left each rank the averaged gradient of
its part of every bucket (`bucket.part`, `[size/n]`); the optimizer updates this rank's part of
the parameters in place (`Part.data`, a view `flat[lo:hi]`, so no copy of the parameters is
kept); a non-blocking all-gather per bucket then fills every rank's whole `flat` with the
updated parts. ZeRO-2 is the same optimizer: only the bucket manager differs (it drops each
full gradient buffer once reduced, buckets.py).

The optimizer sees this rank's part as segments (segments.py): the piece of each parameter
inside it, flat views of the part and of the reduced gradient part, so results equal the
unsharded optimizer's bit for bit and checkpoints save every piece as it is (no rank ever holds
another rank's state).

An untied embedding (`Parameter.sparse_grad`, `sparse_embedding = "auto"`, no compressor, a
shard group of more than one rank) stays out of the buckets: its gradient goes each step to the
owners of its rows, as (row id, row) pairs when fewer bytes than its reduce-scatter, else dense
(`sparse.OwnedRows`). It has a flat buffer of its own cut at the row partition, so this rank's
optimizer segment of it is the rows it owns; the step and the all-gather are the buckets' (a
`Part` of it, after the buckets' parts). ZeRO-2 keeps its whole gradient buffer (the lookup's
scatter-add needs one), as DDP does.

`ZeRO` is the gradient sync strategy (`sync.GradientSync`) of stages 1 and 2: the bucketed
reductions of bucketed.py with a reduce-scatter, and `ZeroOptimizer` over the parts.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import numpy as np

from hpcpar import backend
from hpcpar.runtime.comm import Communicator, bytes_sent
from hpcpar.optim.optimizers import AdamW
from hpcpar.parallel.dp.bucketed import BucketedDataParallel
from hpcpar.parallel.dp.buckets import Bucket, ReduceScatterAvg
from hpcpar.parallel.dp.compression.compressors import Compression
from hpcpar.parallel.dp.sparse import OwnedRows
from hpcpar.parallel.dp.segments import ShardedState, gather_state, load_state, segments_of


class Part:
    """This rank's part of one bucket: elements [lo, hi) of the flat bucket.

    Attributes:
        bucket: the Bucket.
        flat: `[size]`, the bucket's parameters back to back (every `p.data` is a view of it).
        data: `flat[lo:hi]`, this rank's part of the parameters (what the optimizer updates).
        segments: the parameters' pieces inside [lo, hi), in slot order.
    """

    def __init__(self, bucket: Bucket, rank: int, size: int, xp):
        n = bucket.assignment.size // size
        self.bucket = bucket
        self.lo, self.hi = rank * n, (rank + 1) * n
        self.flat = xp.zeros(bucket.assignment.size, dtype=bucket.assignment.dtype)
        for s, p in zip(bucket.assignment.slots, bucket.params):  # the parameters move into the flat buffer
            view = self.flat[s.offset:s.offset + s.numel].reshape(p.shape)
            view[...] = p.data
            p.data = view
        self.data = self.flat[self.lo:self.hi]
        self.segments = segments_of(bucket.assignment.slots, bucket.params, self.lo, self.hi, self.data)


class ZeroOptimizer:
    """An optimizer over this rank's parts of `buckets`, plus the all-gather of the parameters.

    Args:
        buckets: the gradient buckets (sizes multiples of `comm.size`), reduced by reduce-scatter,
            then the `OwnedRows` (each a bucket of one parameter to `Part`).
        comm: the shard group (dp x cp; with HSDP dp_shard x cp).
        make_optimizer: builds the optimizer from the list of segments.

    Per step, after the reduction: `attach_grads()`, then (after clipping) `step(lr)`.
    """

    def __init__(self, buckets: list[Bucket | OwnedRows], comm: Communicator, make_optimizer: Callable[[list], Any]):
        self.comm = comm
        xp = backend.array_module(*(p.data for b in buckets for p in b.params))
        self.parts = [Part(b, comm.rank, comm.size, xp) for b in buckets]
        self.segments = [s for part in self.parts for s in part.segments]
        self.optimizer = make_optimizer(self.segments)

    def attach_grads(self) -> None:
        """Point every segment's `.grad` at its piece of its bucket's reduced part."""
        for part in self.parts:
            for seg in part.segments:
                seg.grad = part.bucket.part[seg.part_lo:seg.part_lo + (seg.hi - seg.lo)]

    def step(self, lr: float | None = None) -> None:
        """Update this rank's part in place, then all-gather every bucket's parts into its flat
        parameter buffer (all started before the first wait, so they overlap each other)."""
        self.optimizer.step(lr)
        if self.comm.size == 1:
            return  # the part is the whole flat buffer, updated in place
        # The part is sent from a copy: MPI's send and receive buffers must not overlap.
        handles = [self.comm.iall_gather(part.data.copy(), dim=0, out=part.flat) for part in self.parts]
        for h in handles:
            h.wait()

    def step_bytes(self) -> float:
        """Bytes `step` sends from this rank: the all-gather of every updated part, counted by
        `comm.bytes_sent`'s formula as the communicator counts it (known before the step)."""
        if self.comm.size == 1:
            return 0.0
        return sum(bytes_sent("all_gather", part.data.nbytes, self.comm.size) for part in self.parts)

    def state_groups(self) -> list[tuple[list, Any, list]]:
        """Per bucket: ([(slot, param)], this rank's part of the parameters, its segments)."""
        return [(list(zip(part.bucket.assignment.slots, part.bucket.params)), part.data, part.segments)
                for part in self.parts]

    def state(self, state_names: tuple[str, ...]) -> dict[str, dict[str, Any]]:
        """{parameter name: {state name: array of the parameter's local shape}}, gathered over
        the shard group (collective: one all-gather per bucket and state name, in that order).
        For tests and tools; checkpoints save the shards."""
        return gather_state(self.state_groups(), self.optimizer, state_names, self.comm)

    def load_state(self, state: dict[str, dict[str, Any]]) -> None:
        """Take this rank's part of whole-parameter state (the structure of `state`, already
        checked). The parameters themselves are loaded whole beforehand (views of the flat
        buffers: nothing to re-read)."""
        load_state(self.segments, self.optimizer, state)


class ZeRO(ShardedState, BucketedDataParallel):
    """ZeRO stage 1 (optimizer state sharded) or 2 (gradients too) over the shard group.

    Args: those of `BucketedDataParallel`, `stage` (1 or 2), `make_optimizer`, which builds
    the optimizer from this rank's segments, and `sparse_embedding` ("auto" or "never",
    `train.sparse_embedding`: an untied wte's rows to their owners, module doc).

    Attributes:
        segments: this rank's pieces of the parameters, the optimizer's "parameters".
    """

    shards_parts = True

    def __init__(self, named_params: Iterable[tuple[str, Any]], mesh, make_optimizer: Callable[[list], Any] = AdamW,
                 *, stage: int, bucket_mb: float = 25.0, compression: Compression = Compression(),
                 overlap: bool = True, local_tied: bool = False, groups: tuple | None = None,
                 sparse_embedding: str = "auto"):
        self.stage = stage
        self.sparse_embedding = sparse_embedding  # read by `_sparse_rows` during the base's construction
        super().__init__(named_params, mesh, bucket_mb=bucket_mb, compression=compression, overlap=overlap,
                         release=stage == 2, local_tied=local_tied, groups=groups)
        self._zero = ZeroOptimizer(self.buckets + self._sparse, self.shard_comm, make_optimizer)
        self.segments = self._zero.segments
        self.optimizer = self._zero.optimizer
        self._norm_items = self._sharded_norm_items()

    def _plain_reduction(self) -> ReduceScatterAvg:
        # ZeRO-1 keeps the whole gradient buffer anyway: the part goes back into it.
        return ReduceScatterAvg(self.shard_comm, self.replicate_comm, in_bucket=self.stage == 1)

    def _sparse_rows(self, named: list[tuple[str, Any]]) -> list[OwnedRows]:
        """The untied embedding's gradient, unless "never", one rank in the shard group or
        compression (the buckets' own wire)."""
        if self.sparse_embedding == "never" or self.shard_comm.size == 1 or self.compressor is not None:
            return []
        return [OwnedRows(n, p, self.shard_comm, self.replicate_comm, self.sparse_embedding) for n, p in named
                if getattr(p, "sparse_grad", False)]

    def _reduce(self) -> None:
        super()._reduce()
        self._zero.attach_grads()

    def _grad_buffers(self) -> list:
        return [b.part for b in self.buckets] + [r.part for r in self._sparse]

    def _update(self, lr: float | None) -> None:
        """Update this rank's part, all-gather the parameters."""
        self._zero.step(lr)

    def step_bytes(self) -> float:
        """Bytes `step()` will send from this rank: the all-gather of the updated parts, known
        before it runs (the step's traffic is agreed on before the optimizer step)."""
        return self._zero.step_bytes()

    def uncompressed_bytes(self) -> float:
        """Bytes this rank sends per step to synchronise gradients without compression: per bucket
        a reduce-scatter in the shard group, HSDP's all-reduce of the part over the replicas and
        the all-gather of the updated part (`comm.bytes_sent`)."""
        total = 0.0
        n = self.shard_comm.size
        for b in self.buckets:
            nbytes = b.assignment.size * np.dtype(b.assignment.dtype).itemsize
            total += (bytes_sent("reduce_scatter", nbytes, n) + bytes_sent("all_reduce", nbytes // n,
                                                                          self.replicate_comm.size)
                      + bytes_sent("all_gather", nbytes // n, n))
        return total + sum(r.uncompressed_bytes() for r in self._sparse)

    def _parameter_pieces(self) -> list[tuple[Any, str, Any, Any]]:
        """The parameters whole: ZeRO-1/2 keeps them whole on every rank."""
        return [(p, n, p.layout, p.data) for n, p in zip(self.names, self.params)]
