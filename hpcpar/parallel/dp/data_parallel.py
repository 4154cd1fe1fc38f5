"""Data parallelism: keeps the dp replicas identical, composed of the pieces next to it.

Every dp rank holds the same parameters and computes gradients on its own samples of the
global batch; averaging the gradients over dp makes each replica take the step the whole
batch would give (PyTorch DDP, arXiv 2006.15704). Context parallelism adds replicas of the
same kind: the cp ranks of a sequence hold the same weights and each computes the gradient of
the mean loss over its equal share of tokens, so the reduction group is dp x cp
(`mesh.comm((Axis.DP, Axis.CP))`; "dp" below means that group). `DataParallel` is the one object the
training loop talks to; the mechanisms live in their own modules:

- hpcpar/parallel/dp/buckets.py: the bucket plan, the flat gradient buffers every `.grad` is a
  view of, and the `BucketManager` whose grad hooks launch each complete bucket's non-blocking
  reduction in index order while backward goes on;
- hpcpar/parallel/dp/compression/compressors.py, powersgd.py: gradient compressors (16-bit wires, int8,
  top-k, PowerSGD) with error feedback, behind the same reduction interface, and
  compression_state.py, their state in checkpoints;
- hpcpar/parallel/dp/zero.py: ZeRO-1/2, optimizer state for this rank's part of every bucket only,
  and the all-gather of the updated parameters;
- hpcpar/parallel/dp/fsdp.py: ZeRO-3, parameters sharded per unit and gathered around each unit's
  forward and backward;
- hpcpar/parallel/dp/clipping.py: the global gradient norm over the whole mesh.

ZeRO stages (`zero`): 0 all-reduces whole buckets and every rank keeps everything; 1
reduce-scatters buckets and shards the optimizer state; 2 also drops each full gradient bucket
once reduced (only the parts stay); 3 shards the parameters too. ZeRO shards over the *shard
group* `mesh.comm((Axis.DP_SHARD, Axis.CP))`; with HSDP (`mesh.dp_replicate > 1`) the shard is
then averaged over the replicas (`mesh.comm(Axis.DP_REPLICATE)`), which keep identical shards
and identical optimizer state. Without HSDP the shard group is dp x cp.

Tied weights. The LM head on the last pipeline stage is a copy (`tied_to`) of the embedding
on the first. Both live in a separate final bucket (ZeRO-3: a flat parameter of its own, of
the same size on both stages): their gradients are summed over `mesh.embedding_comm`, so the
two copies receive identical updates. With `local_tied` (ZB-V: the first and the last virtual
stage are both on pipeline rank 0) the copy and its weight sit on the same rank: their
gradients are summed there, the same float an all-reduce of the two would give.

Checkpoints under ZeRO: `checkpoint_shards()` gives this rank's pieces of the parameters and of
the optimizer state, each a flat range of a parameter with its `Layout.flat_range` (no state is
gathered to save); `checkpoint_wanted()` / `load_checkpoint()` read them back in any layout.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable

import numpy as np

from hpcpar import backend
from hpcpar.runtime.comm import bytes_sent
from hpcpar.errors import CheckpointError, ConfigError
from hpcpar.runtime.mesh import Axis
from hpcpar.optim.optimizers import AdamW
from hpcpar.parallel.dp.buckets import (AllReduceAvg, BucketManager, CompressedReduction, ReduceScatterAvg,
                                     plan_buckets)
from hpcpar.parallel.dp.clipping import clip_global_norm, counts_toward_norm, tp_replicated
from hpcpar.parallel.dp.compression.compressors import BucketSpec, Compression, SpecSlot, make_compressor
from hpcpar.parallel.dp.compression.state import CompressionState
from hpcpar.parallel.dp.fsdp import ShardedUnits
from hpcpar.parallel.dp.zero import ZeroOptimizer

_MIB = 1 << 20
ZERO_STAGES = (0, 1, 2, 3)


class DataParallel:
    """Keeps dp replicas identical: overlapped bucketed gradient averaging, optimizer, clipping.

    Args:
        named_params: (global name, Parameter) of every parameter on this rank (all its
            pipeline chunks), in registration order.
        mesh: the Mesh; uses `comm((Axis.DP, Axis.CP))` (the replicas: weights are replicated
            over context parallelism too, so dp x cp ranks average their gradients), the shard
            group `comm((Axis.DP_SHARD, Axis.CP))` and `comm(Axis.DP_REPLICATE)` (HSDP),
            `comm(Axis.TP)`, `world` and `embedding_comm`.
        bucket_mb: bucket size in MiB.
        compression: gradient compression (`compression.Compression`, or its kind as a string:
            "none", "fp16", "bf16", "int8", "topk", "powersgd"; ZeRO 0-2). Without HSDP the
            buckets are compressed over dp x cp; with HSDP the shard group reduce-scatters
            uncompressed and the compressor averages the shards over dp_replicate (PowerSGD,
            which factors whole matrices: over all of dp x cp).
        zero: 0 (replicated), 1 (optimizer state sharded), 2 (gradients too), 3 (parameters too).
        make_optimizer: builds the optimizer from a list of objects with `.data`, `.grad`,
            `.no_decay` (the parameters, or under ZeRO this rank's segments).
        overlap: start reductions from grad hooks during backward (False: all in
            `finish_backward`, the no-overlap baseline for benchmarks; ZeRO 0-2).
        units: ZeRO-3 only: (chunk index, unit name, [(name, Parameter)]) in forward order
            (`GPT.fsdp_units()` of every chunk); each chunk's `unit_hooks` must be set to
            `dp.unit_hooks` so that the model gathers its units.
        reshard_after_forward: ZeRO-3: free a unit's gathered parameters after its forward.
        prefetch: ZeRO-3: issue the next unit's all-gather while the current one computes.
        local_tied: every tied copy's weight is on this rank too (pipeline placements that put
            the first and last virtual stage on one rank): sum their gradients here, not over
            `mesh.embedding_comm`.
        groups: (gradient group, shard group, replica group) instead of the mesh's (dp x cp,
            dp_shard x cp, dp_replicate): mixture-of-experts expert weights are replicated over
            the expert-data-parallel groups only (`parallel.experts.ExpertDataParallel`).

    Per step: `begin_step(microbatches, step)`, backward of every micro-batch, `finish_backward()`,
    `clip_grad_norm(max_norm)`, `step(lr)`.

    Attributes:
        buckets: the gradient buckets (`Bucket`: `.index`, `.plan`, `.grad`, ...), launch order
            (none under ZeRO-3).
        optimizer: the optimizer (under ZeRO over this rank's segments).
        unit_hooks: ZeRO-3's `fsdp.ShardedUnits` (None otherwise).
        events: (kind, what, time.perf_counter()) appended during the step: ("grad_ready", name, t)
            when a parameter has all its contributions, ("bucket_start", i, t) when bucket i's
            reduction is launched (ZeRO-3: the `ShardedUnits` events). Cleared by `begin_step`.
        wait_s: seconds the last `finish_backward` spent (launching the rest and waiting).
        compressor: the gradient compressor (None without compression).
    """

    def __init__(self, named_params: Iterable[tuple[str, Any]], mesh, bucket_mb: float = 25.0,
                 compression: Compression | str = "none", zero: int = 0,
                 make_optimizer: Callable[[list], Any] = AdamW, overlap: bool = True,
                 units: Iterable[tuple[int, str, list]] | None = None, reshard_after_forward: bool = True,
                 prefetch: bool = True, local_tied: bool = False, groups: tuple | None = None):
        # The gradient group: every rank holding the same weights on other tokens (dp x cp);
        # ZeRO shards over dp_shard x cp and averages the shards over dp_replicate (HSDP).
        self.dp_comm, self.shard_comm, self.replicate_comm = groups if groups is not None else (
            mesh.comm((Axis.DP, Axis.CP)), mesh.comm((Axis.DP_SHARD, Axis.CP)), mesh.comm(Axis.DP_REPLICATE))
        if zero not in ZERO_STAGES or isinstance(zero, bool):
            raise ConfigError(f"zero={zero!r} is not a supported ZeRO stage; choose 0, 1, 2 or 3")
        if isinstance(compression, str):
            compression = Compression(compression)
        if compression.enabled and zero == 3:
            raise ConfigError(f"grad_compression={compression.kind!r} works on gradient buckets (zero 0-2); ZeRO-3 "
                              "reduce-scatters each unit's flat gradient instead; use zero <= 2 or no compression")
        # Where the compressor runs: over dp x cp; under HSDP over the replicas only (the shard
        # group reduce-scatters uncompressed first), except PowerSGD, which factors whole matrices.
        hsdp = self.replicate_comm.size > 1
        self._compress_replicas = hsdp and compression.kind != "powersgd"
        compressor = make_compressor(compression, self.replicate_comm if self._compress_replicas else self.dp_comm)
        if not bucket_mb > 0:
            raise ConfigError(f"bucket_mb must be > 0, got {bucket_mb!r}")
        named = list(named_params)
        names = [n for n, _ in named]
        if len(set(names)) != len(names):
            raise ConfigError("DataParallel was given a parameter name twice; pass each parameter once")
        self.names = names
        self.params = [p for _, p in named]
        self.mesh = mesh
        self.zero = zero
        self.compression = compression
        self.compressor = compressor
        self.compression_state: CompressionState | None = None
        self._plain = None  # the uncompressed reduction (warm-up steps before compression.start_step)
        self.dp_size, self.dp_rank = self.dp_comm.size, self.dp_comm.rank
        self.embedding_comm = None if local_tied else mesh.embedding_comm
        self.tp_comm = mesh.comm(Axis.TP)
        self.tp_rank = tp_rank = self.tp_comm.rank
        # Sequence parallelism: replicated parameters applied to sequence shards hold a part of
        # their gradient per tp rank; this object sums them over tp once per step (`tp_sum_per_step`).
        self._sequence_parallel = [p for p in self.params if getattr(p, "sequence_parallel", False)
                                   and self.tp_comm.size > 1]
        self.tp_sum_per_step = True
        self.replica = self.replicate_comm.rank  # HSDP: replicas > 0 hold copies of replica 0's shards

        # Tied weights: copies (tied_to set) and the weights they mirror, here or on the peer stage.
        targets = {p.tied_to for p in self.params if getattr(p, "tied_to", None)}
        if self.embedding_comm is not None:
            for theirs in self.embedding_comm.all_gather_object(sorted(targets)):
                targets.update(theirs)
        tied = {n for n, p in named if getattr(p, "tied_to", None) or n in targets}
        # (copy, weight) pairs held together by this rank: summed here (`_sum_local_tied`).
        by_name = dict(named)
        self._local_tied = [(p, by_name[p.tied_to]) for p in self.params
                            if getattr(p, "tied_to", None) in by_name] if local_tied else []
        self.wait_s = 0.0
        self.buckets: list = []
        self.reducer = None
        self._zero: ZeroOptimizer | None = None
        self.unit_hooks: ShardedUnits | None = None

        if zero == 3:
            if units is None:
                raise ConfigError("zero=3 needs the model's units (DataParallel(..., units=[(chunk, name, "
                                  "[(name, param)]), ...]), e.g. from GPT.fsdp_units())")
            units = list(units)
            listed = {id(p) for _, _, ps in units for _, p in ps}
            missing = [n for n, p in named if id(p) not in listed]
            if missing:
                raise ConfigError(f"zero=3: parameters {missing[:3]} belong to no unit")
            self.unit_hooks = ShardedUnits(units, self.shard_comm, self.replicate_comm, tied,
                                           self.embedding_comm, reshard_after_forward, prefetch)
            self.segments = self.unit_hooks.segments
            if self.embedding_comm is not None:
                self._check_tied_match([(f.size, f.dtype) for f in self.unit_hooks.flats if f.tied])
        else:
            # Buckets padded to a multiple of the shard group (ZeRO's parts) or of dp x cp (the
            # compressors' rows, also of the parts of HSDP's shards over the replicas).
            pad = self.dp_size if compressor is not None or not zero else self.shard_comm.size
            groups = ([compression.bucket_group(p.data.ndim, not p.layout.is_replicated) for _, p in named]
                      if compressor is not None else None)
            plans = plan_buckets([(n, int(p.data.size), str(p.data.dtype)) for n, p in named],
                                 int(bucket_mb * _MIB), pad, tied, groups=groups)
            if zero:
                self._plain = reduction = ReduceScatterAvg(self.shard_comm, self.replicate_comm, in_bucket=zero == 1)
            else:
                self._plain = reduction = AllReduceAvg(self.dp_comm)
            if compressor is not None:
                self._compressed = reduction = CompressedReduction(
                    compressor, shards=bool(zero), scatter=self.shard_comm if self._compress_replicas else None,
                    part_comm=self.shard_comm if zero else None)
            # A compressor is not linear: it must see the whole (tp-summed) gradient, so there the
            # sequence-parallel parts are summed bucket by bucket, before each reduction starts.
            prepare = self._sum_bucket_over_tp if compressor is not None and self._sequence_parallel else None
            self.reducer = BucketManager(named, plans, reduction, tied_comm=self.embedding_comm, overlap=overlap,
                                         release=zero == 2, prepare=prepare)
            self.buckets = self.reducer.buckets
            if self.embedding_comm is not None:
                tied_buckets = [b for b in self.buckets if b.plan.tied]
                self._check_tied_match([(tied_buckets[0].plan.size, tied_buckets[0].plan.dtype)]
                                       if tied_buckets else [])
            if zero:
                self._zero = ZeroOptimizer(self.buckets, self.shard_comm, make_optimizer)
                self.segments = self._zero.segments
            if compressor is not None:
                self._setup_compressor(named)
        if zero:
            self.optimizer = make_optimizer(self.segments) if zero == 3 else self._zero.optimizer
            # Every rank of the shard group counts its own part, in segment order; replicas are
            # identical after the average, so replica 0 counts for all of them.
            self._norm_items = ([s for s in self.segments if counts_toward_norm(s.param, tp_rank)]
                                if self.replica == 0 else [])
        else:
            self.optimizer = make_optimizer(list(self.params))
            # Replicas are identical after the average: dp rank 0 counts for all of them.
            self._norm_items = [p for p in self.params if counts_toward_norm(p, tp_rank)] if self.dp_rank == 0 else []

    @staticmethod
    def _sum_local_tied(pairs: list) -> None:
        """Both arrays of each pair become their sum (the tied bucket before its reduction; under
        ZeRO-3 the reduced gradient shards, as `ShardedUnits` sums them over the embedding group)."""
        for a, b in pairs:
            a += b
            b[...] = a

    def _setup_compressor(self, named: list[tuple[str, Any]]) -> None:
        """Tell the compressor its buckets (each whole, or under HSDP this rank's shard of it) and
        map its state onto checkpoint tensors. A tied copy is known by the weight it mirrors (its
        PowerSGD Q starts the same, its state is saved once)."""
        names = {id(p): getattr(p, "tied_to", None) or n for n, p in named}
        specs, starts = [], {}
        for b in self.buckets:
            size = b.plan.size // (self.shard_comm.size if self._compress_replicas else 1)
            lo = self.shard_comm.rank * size if self._compress_replicas else 0
            starts[b.index] = lo
            slots = []
            for s, p in zip(b.plan.slots, b.params):
                a, z = max(lo, s.offset), min(lo + size, s.offset + s.numel)
                if a < z:
                    whole = (a, z) == (s.offset, s.offset + s.numel)
                    slots.append(SpecSlot(names[id(p)], a - lo, z - a, tuple(p.shape) if whole else (z - a,)))
            specs.append(BucketSpec(b.index, size, b.plan.dtype, tuple(slots)))
        self.compressor.setup(specs)
        self.compression_state = CompressionState(self.compressor, self.buckets, starts, lambda p: names[id(p)],
                                                  self.mesh.comm(Axis.TP))

    def _check_tied_match(self, mine: list) -> None:
        """Both stages' tied buckets (flats) must match, or their sum over embedding_comm would not."""
        sizes = self.embedding_comm.all_gather_object(mine[:1] or [(0, "")])
        if len({tuple(x) for x in sizes}) != 1 and len(sizes) > 1:
            raise ConfigError(f"tied weights differ between the first and last pipeline stage "
                              f"(size, dtype per rank: {sizes}); both copies must have the same local shape")

    @property
    def overlap(self) -> bool:
        """Whether reductions start from grad hooks during backward."""
        return self.reducer.overlap if self.reducer is not None else True

    @overlap.setter
    def overlap(self, value: bool) -> None:
        if self.reducer is not None:
            self.reducer.overlap = value

    @property
    def events(self) -> list[tuple[str, Any, float]]:
        """This step's ("grad_ready", name, t) and ("bucket_start", i, t) records (see the class
        docstring; ZeRO-3: the unit events of `fsdp.ShardedUnits`)."""
        return self.unit_hooks.events if self.unit_hooks is not None else self.reducer.events

    @events.setter
    def events(self, value: list) -> None:
        if self.unit_hooks is not None:
            self.unit_hooks.events = value
        else:
            self.reducer.events = value

    def on_bucket_ready(self, listener: Callable[[Any], None]) -> None:
        """Call `listener(bucket)` whenever a gradient bucket is complete on this rank, before its
        reduction starts, in bucket order (`BucketManager.listeners`): from the grad hooks of the
        last micro-batch's backward, the rest from `finish_backward`. Not under ZeRO-3 (no buckets).
        The sequence-parallel parameters' tp sum comes after, in `finish_backward`."""
        if self.reducer is None:
            raise ConfigError("on_bucket_ready needs gradient buckets (zero 0-2); ZeRO-3 has none")
        self.reducer.listeners.append(listener)

    # -- the step -------------------------------------------------------------------------------

    def begin_step(self, microbatches: int = 1, step: int | None = None) -> None:
        """Zero the gradient buckets, point every `.grad` at its view, arm the hooks (ZeRO-2:
        buffers come with the first gradients; ZeRO-3: with each unit's backward). `step` (the
        global step) decides whether gradient compression is on yet (`compression.start_step`);
        None: it is."""
        if self.unit_hooks is not None:
            self.unit_hooks.begin_step(microbatches)
            return
        if self.compressor is not None:
            warm_up = step is not None and step < self.compression.start_step
            self.reducer.set_reduction(self._plain if warm_up else self._compressed)
        self.reducer.begin_step(microbatches)

    @property
    def compressing(self) -> bool:
        """Whether this step's buckets go through the compressor (False in the warm-up steps)."""
        return self.compressor is not None and self.reducer.reduction is self._compressed

    def finish_backward(self) -> None:
        """Launch the buckets not yet started (tied weights last, after summing them across
        stages), wait for every reduction. Afterwards, without ZeRO each `.grad` holds the
        dp-averaged gradient; with ZeRO the averaged part lives with the optimizer's segments
        (ZeRO 2 and 3 keep no full gradient)."""
        t0 = time.perf_counter()
        if self.unit_hooks is not None:
            self.unit_hooks.finish_backward()
            flat_of = {id(p): f for f in self.unit_hooks.flats for p in f.params}
            self._sum_local_tied([(flat_of[id(a)].grad_shard, flat_of[id(b)].grad_shard)
                                  for a, b in self._local_tied])
        else:
            self._sum_local_tied([(a.grad, b.grad) for a, b in self._local_tied])
            self.reducer.finish_backward()
            if self._zero is not None:
                self._zero.attach_grads()
        if self.reducer is None or self.reducer.prepare is None:
            # The data-parallel average is linear, so averaging each tp rank's part and summing
            # after is the sum averaged: one all-reduce over tp for every part this rank holds.
            self._sum_over_tp([s.grad for s in self.segments if getattr(s.param, "tp_partial_grad", False)]
                              if self.zero else [p.grad for p in self._sequence_parallel if p.tp_partial_grad])
        self.wait_s = time.perf_counter() - t0

    # -- sequence parallelism: the tp sum of the sequence-shard parameters' gradients ---------------

    @property
    def tp_sum_per_step(self) -> bool:
        """Whether this object sums the gradients of the sequence-parallel parameters over tp
        once per step (default): after the data-parallel reduction, or with a compressor bucket
        by bucket before it. False leaves that to the model, at every use (f): the per-use
        baseline for benchmarks. Set it between steps."""
        return all(p.tp_partial_grad for p in self._sequence_parallel)

    @tp_sum_per_step.setter
    def tp_sum_per_step(self, value: bool) -> None:
        for p in self._sequence_parallel:
            p.tp_partial_grad = bool(value)

    def _sum_over_tp(self, grads: list) -> None:
        """Sum `grads` (this tp rank's parts of sequence-parallel gradients; every tp rank lists
        the same shapes in the same order) over tp in place: one all-reduce of their concatenation."""
        if not grads:
            return
        xp = backend.array_module(grads[0])
        total = self.tp_comm.all_reduce(xp.concatenate([g.reshape(-1) for g in grads]))
        at = 0
        for g in grads:
            g[...] = total[at:at + g.size].reshape(g.shape)
            at += g.size

    def _sum_bucket_over_tp(self, bucket) -> None:
        """Before bucket `bucket`'s (compressed) reduction: its sequence-parallel gradients summed over tp."""
        self._sum_over_tp([v for p, v in zip(bucket.params, bucket.views) if getattr(p, "tp_partial_grad", False)])

    def _grad_buffers(self) -> list:
        """The arrays that hold this rank's averaged gradients (clipping scales them)."""
        if self.unit_hooks is not None:
            return [f.grad_shard for f in self.unit_hooks.flats]
        return [b.part for b in self.buckets] if self._zero is not None else [b.grad for b in self.buckets]

    def norm_parts(self) -> tuple[list, list]:
        """(the items whose gradients this rank counts toward the global norm, the arrays holding
        its averaged gradients): what `clip_grad_norm` works on."""
        return self._norm_items, self._grad_buffers()

    def clip_grad_norm(self, max_norm: float, loss_scale: float = 1.0) -> float:
        """Global L2 norm of the averaged gradients over the whole mesh (the same float on every
        rank); when `max_norm > 0` and the norm exceeds it, scale every gradient by
        `max_norm / (norm + 1e-6)` (as torch.nn.utils.clip_grad_norm_). Returns the norm before.
        Gradients of a loss scaled by `loss_scale` are unscaled first (`clip_global_norm`)."""
        return clip_global_norm(*self.norm_parts(), max_norm, self.mesh.world, loss_scale)

    def step(self, lr: float | None = None) -> None:
        """Optimizer step with learning rate `lr`. ZeRO 1/2: update this rank's part, all-gather
        the parameters; ZeRO-3: update the shards (the next forward gathers them)."""
        if self.compressor is not None:
            self.compressor.commit()  # the step's residuals and Q count now that its update is applied
        if self._zero is not None:
            self._zero.step(lr)
        else:
            self.optimizer.step(lr)

    # -- bytes on the wire ----------------------------------------------------------------------------

    def sync_comms(self) -> list:
        """The communicators the gradient synchronisation uses (dp x cp, the shard group, the
        replicas; each once): their `sent` counters hold its bytes (and ZeRO's parameter
        all-gather's). The tied weights' sum over the embedding group is not counted: it is the
        same with and without compression."""
        out: list = []
        for c in (self.dp_comm, self.shard_comm, self.replicate_comm):
            if all(c is not o for o in out):
                out.append(c)
        return out

    def sync_bytes(self) -> float:
        """Bytes this rank has sent for gradient synchronisation so far (see `sync_comms`)."""
        return sum(c.bytes_sent_total() for c in self.sync_comms())

    def step_bytes(self) -> float:
        """Bytes `step()` will send from this rank (ZeRO 1/2: the all-gather of the updated parts;
        nothing otherwise), known before it runs: the step's traffic is agreed on before the
        optimizer step (`Trainer._agree`)."""
        return self._zero.step_bytes() if self._zero is not None else 0.0

    def uncompressed_bytes(self) -> float | None:
        """Bytes this rank sends per step to synchronise gradients without compression: the
        plain reduction's collectives through `comm.bytes_sent` (zero 0: an all-reduce of every
        bucket over dp x cp; zero 1/2: a reduce-scatter in the shard group, HSDP's all-reduce of
        the part over the replicas, the all-gather of the updated part). None under ZeRO-3 (no
        compression there: what is measured is what an uncompressed step sends)."""
        if self.unit_hooks is not None:
            return None
        total = 0.0
        for b in self.buckets:
            nbytes = b.plan.size * np.dtype(b.plan.dtype).itemsize
            if not self.zero:
                total += bytes_sent("all_reduce", nbytes, self.dp_comm.size)
                continue
            n = self.shard_comm.size
            total += (bytes_sent("reduce_scatter", nbytes, n) + bytes_sent("all_reduce", nbytes // n,
                                                                          self.replicate_comm.size)
                      + bytes_sent("all_gather", nbytes // n, n))
        return total

    def nonfinite_gradients(self) -> list[str]:
        """Names of this rank's parameters with a non-finite averaged gradient (its part under
        ZeRO), in model order. Call after `finish_backward`."""
        if self.zero:
            items = [(s.name, s.grad) for s in self.segments]
        else:
            items = list(zip(self.names, (p.grad for p in self.params)))
        bad = []
        for name, g in items:
            if g is not None and name not in bad and not bool(backend.array_module(g).isfinite(g).all()):
                bad.append(name)
        order = {n: i for i, n in enumerate(self.names)}
        return sorted(bad, key=lambda n: order.get(n, len(order)))

    # -- whole parameters -------------------------------------------------------------------------

    def full_parameters(self) -> dict[str, Any]:
        """{name: this rank's whole local array} (copies under ZeRO-3, gathered: collective over
        the shard group; the arrays themselves otherwise)."""
        if self.unit_hooks is None:
            return {n: p.data for n, p in zip(self.names, self.params)}
        self.unit_hooks.gather_all()
        try:
            return {n: p.data.copy() for n, p in zip(self.names, self.params)}
        finally:
            self.unit_hooks.release_all()

    # -- optimizer state and checkpoints ------------------------------------------------------------

    def optimizer_step_count(self) -> int:
        """Optimizer steps taken (AdamW's bias correction uses it); checkpoints save it."""
        return self.optimizer.step_count

    def state_names(self) -> tuple[str, ...]:
        """The optimizer's per-parameter state arrays ("exp_avg", "exp_avg_sq" for AdamW)."""
        return tuple(self.optimizer.state_names)

    def _shard_groups(self) -> list[tuple[list, Any, Any]]:
        """Per bucket (ZeRO 1/2) or flat (ZeRO-3): (slots with their params, part buffer, segments)."""
        if self.unit_hooks is not None:
            return [(list(zip(f.slots, f.params)), f.shard, f.segments) for f in self.unit_hooks.flats]
        return [(list(zip(part.bucket.plan.slots, part.bucket.params)), part.data, part.segments)
                for part in self._zero.parts]

    def optimizer_state(self) -> dict[str, dict[str, Any]]:
        """{parameter name: {state name: array of the parameter's local shape}} (copies).
        Under ZeRO the parts are all-gathered over the shard group first (collective): for tests
        and tools; checkpoints save the shards (`checkpoint_shards`)."""
        names = self.state_names()
        if not self.zero:
            return {n: {k: self.optimizer.state_of(p)[k].copy() for k in names}
                    for n, p in zip(self.names, self.params)}
        out: dict[str, dict[str, Any]] = {n: {} for n in self.names}
        for slots, part, segments in self._shard_groups():
            for k in names:
                mine = backend.array_module(part).zeros_like(part)
                for seg in segments:
                    mine[seg.part_lo:seg.part_lo + (seg.hi - seg.lo)] = self.optimizer.state_of(seg)[k]
                full = self.shard_comm.all_gather(mine, dim=0)
                for s, p in slots:
                    out[s.name][k] = full[s.offset:s.offset + s.numel].reshape(p.shape).copy()
        return out

    def load_optimizer_state(self, state: dict[str, dict[str, Any]], step_count: int | None = None) -> None:
        """Copy state of the `optimizer_state()` structure in (each rank takes its ZeRO part).

        Call it after loading the parameters themselves (ZeRO-3 keeps its own shards of them)."""
        names = set(self.state_names())
        missing = sorted(set(self.names) - set(state))
        if missing:
            raise CheckpointError(f"optimizer state lacks parameters {missing[:3]}{'...' if len(missing) > 3 else ''}; "
                                  "load a checkpoint of the same model")
        for n, p in zip(self.names, self.params):
            if set(state[n]) != names:
                raise CheckpointError(f"optimizer state of {n} holds {sorted(state[n])}, expected {sorted(names)}")
            for k, v in state[n].items():
                if tuple(v.shape) != tuple(p.shape):
                    raise CheckpointError(f"optimizer state {k} of {n} has shape {tuple(v.shape)}, "
                                          f"expected the parameter's local shape {tuple(p.shape)}")
        if self.zero:
            for seg in self.segments:
                xp = backend.array_module(seg.data)
                for k, dst in self.optimizer.state_of(seg).items():
                    dst[...] = xp.asarray(state[seg.name][k]).reshape(-1)[seg.lo:seg.hi]
        else:
            xp = backend.array_module(*(p.data for p in self.params))
            for n, p in zip(self.names, self.params):
                for k, dst in self.optimizer.state_of(p).items():
                    dst[...] = xp.asarray(state[n][k])
        if step_count is not None:
            self.optimizer.step_count = int(step_count)

    def _saved_segments(self) -> list:
        """The segments this rank writes: replica 0 only (HSDP), no tied copies (the weight they
        mirror is saved), tp-replicated parameters from tp rank 0 only."""
        if self.replica != 0:
            return []
        return [s for s in self.segments if not getattr(s.param, "tied_to", None)
                and (self.tp_rank == 0 or not tp_replicated(s.param))]

    def checkpoint_shards(self) -> dict[str, tuple[Any, Any]]:
        """ZeRO 1-3: {"model/<name>": (piece, layout), "optim/<name>/<state>": (piece, layout)}
        for this rank's segments, each a flat range of its parameter (`Layout.flat_range`): the
        shards of the shard group tile every tensor once, replica 0 writes them (HSDP). Nothing is
        gathered. Empty under ZeRO 0 (the trainer saves whole local tensors)."""
        if not self.zero:
            return {}
        out = {}
        names = self.state_names()
        for seg in self._saved_segments():
            layout = seg.layout
            out[f"model/{seg.name}"] = (seg.data, layout)
            state = self.optimizer.state_of(seg)
            for k in names:
                out[f"optim/{seg.name}/{k}"] = (state[k], layout)
        return out

    def checkpoint_wanted(self, key_of: Callable[[Any, str], str], weights_only: bool = False) -> dict[str, Any]:
        """ZeRO 1-3: {tensor name: Layout} this rank loads: the parameters whole (ZeRO 1/2, which
        keep them whole) or its shards of them (ZeRO-3), and its shards of the optimizer state
        (none with `weights_only`). `key_of(param, name)` names the global tensor (a tied copy
        loads the weight it mirrors)."""
        out: dict[str, Any] = {}
        if self.zero in (1, 2):
            for n, p in zip(self.names, self.params):
                out[f"model/{key_of(p, n)}"] = p.layout
        for seg in self.segments:
            key = key_of(seg.param, seg.name)
            if self.zero == 3:
                out[f"model/{key}"] = seg.layout
            if not weights_only:
                for k in self.state_names():
                    out[f"optim/{key}/{k}"] = seg.layout
        return out

    def load_checkpoint(self, arrays: dict[str, Any], key_of: Callable[[Any, str], str],
                        step_count: int | None = None, weights_only: bool = False) -> None:
        """ZeRO 1-3: take what `checkpoint_wanted` asked for (host arrays) into place; with
        `weights_only` the parameters only (the optimizer state stays as it is)."""
        if self.zero in (1, 2):
            for n, p in zip(self.names, self.params):
                p.data[...] = backend.array_module(p.data).asarray(arrays[f"model/{key_of(p, n)}"])
        for seg in self.segments:
            key = key_of(seg.param, seg.name)
            xp = backend.array_module(seg.data)
            if self.zero == 3:
                seg.data[...] = xp.asarray(arrays[f"model/{key}"])
            if weights_only:
                continue
            for k, dst in self.optimizer.state_of(seg).items():
                dst[...] = xp.asarray(arrays[f"optim/{key}/{k}"])
        if step_count is not None:
            self.optimizer.step_count = int(step_count)

    # -- compressor state in checkpoints (parallel/compression_state.py) -----------------------------

    def compression_tensors(self) -> dict[str, tuple[Any, Any]]:
        """{"compress/...": (local array, Layout)}: this rank's committed residuals and PowerSGD
        Qs ({} without compression)."""
        return self.compression_state.tensors() if self.compression_state is not None else {}

    def compression_meta(self) -> dict | None:
        """What a loader needs besides the tensors (kind, group size, tp, rank); None without."""
        return self.compression_state.meta() if self.compression_state is not None else None

    def compression_wanted(self, stored: dict | None) -> dict[str, Any]:
        """{name: Layout} of the compressor state to load from a checkpoint whose compression
        meta (with the names of its tensors) is `stored`."""
        return self.compression_state.wanted(stored) if self.compression_state is not None else {}

    def load_compression(self, arrays: dict[str, Any], stored: dict | None) -> None:
        """Take the compressor state `compression_wanted` asked for (zeros for what is missing)."""
        if self.compression_state is not None:
            self.compression_state.load(arrays, stored)

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds now, by kind: parameters (whole or shards; ZeRO-3 gathered
        buffers separately), gradients (buckets, parts, shards) and optimizer state, from the
        arrays themselves (each buffer counted once)."""
        seen: set = set()

        def size(arrays) -> int:
            total = 0
            for a in arrays:
                if a is None:
                    continue
                base = a
                while getattr(base, "base", None) is not None:
                    base = base.base
                if id(base) not in seen:
                    seen.add(id(base))
                    total += int(base.nbytes)
            return total
        state = [v for st in self.optimizer.state_dict()["state"] for v in st.values()]
        if self.unit_hooks is not None:
            flats = self.unit_hooks.flats
            return {"parameters": size(f.shard for f in flats), "gradients": size(f.grad_shard for f in flats)
                    + size(f.grad for f in flats), "optimizer": size(state),
                    "gathered": size(f.gathered for f in flats if f.comm.size > 1)}
        params = size(p.data for p in self.params)
        grads = size(b.grad for b in self.buckets) + size(b.part_buffer for b in self.buckets)
        return {"parameters": params, "gradients": grads, "optimizer": size(state), "gathered": 0}
