"""Data parallelism: keeps the dp replicas identical, composed of the pieces next to it.

Every dp rank holds the same parameters and computes gradients on its own samples of the
global batch; averaging the gradients over dp makes each replica take the step the whole
batch would give (PyTorch DDP, arXiv 2006.15704). Context parallelism adds replicas of the
same kind: the cp ranks of a sequence hold the same weights and each computes the gradient of
the mean loss over its equal share of tokens, so the reduction group is dp x cp
(`mesh.comm((Axis.DP, Axis.CP))`; "dp" below means that group). `DataParallel` is the one object the
training loop talks to; the mechanisms live in their own modules:

- hpcpar/parallel/buckets.py: the bucket plan, the flat gradient buffers every `.grad` is a
  view of, and the `BucketManager` whose grad hooks launch each complete bucket's non-blocking
  reduction in index order while backward goes on;
- hpcpar/parallel/compression.py: the optional 16-bit wire (`wire_dtype` "float16" or
  "bfloat16"), a compressor behind the same reduction interface;
- hpcpar/parallel/zero.py: ZeRO-1, optimizer state for this rank's part of every bucket only,
  and the all-gather of the updated parameters;
- hpcpar/parallel/clipping.py: the global gradient norm over the whole mesh.

Here they are put together: which reduction a bucket gets (all-reduce average; reduce-scatter
under ZeRO; a compressed exchange of either kind), which gradients count toward the norm, and
which optimizer (replicated over whole parameters, or ZeRO over segments).

Tied weights. The LM head on the last pipeline stage is a copy (`tied_to`) of the embedding
on the first. Both live in a separate final bucket: after backward their gradients are summed
over `mesh.embedding_comm`, then averaged over dp like any bucket, so the two copies receive
identical updates.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable

from hpcpar import backend
from hpcpar.errors import CheckpointError, ConfigError
from hpcpar.mesh import Axis
from hpcpar.optim import AdamW
from hpcpar.parallel.buckets import (AllReduceAvg, BucketManager, CompressedReduction, ReduceScatterAvg,
                                     plan_buckets)
from hpcpar.parallel.clipping import clip_global_norm, counts_toward_norm
from hpcpar.parallel.compression import make_compressor
from hpcpar.parallel.zero import ZeroOptimizer

_MIB = 1 << 20


class DataParallel:
    """Keeps dp replicas identical: overlapped bucketed gradient averaging, optimizer, clipping.

    Args:
        named_params: (global name, Parameter) of every parameter on this rank (all its
            pipeline chunks), in registration order.
        mesh: the Mesh; uses `comm((Axis.DP, Axis.CP))` (the replicas: weights are replicated
            over context parallelism too, so dp x cp ranks average their gradients), `comm(Axis.TP)`,
            `world` and `embedding_comm`.
        bucket_mb: bucket size in MiB.
        wire_dtype: "float32" (no compression), "float16" or "bfloat16".
        zero: 0 (replicated optimizer state) or 1 (state sharded over dp).
        make_optimizer: builds the optimizer from a list of objects with `.data`, `.grad`,
            `.no_decay` (the parameters, or under ZeRO this rank's segments).
        overlap: start reductions from grad hooks during backward (False: all in
            `finish_backward`, the no-overlap baseline for benchmarks).

    Per step: `begin_step(microbatches)`, backward of every micro-batch, `finish_backward()`,
    `clip_grad_norm(max_norm)`, `step(lr)`.

    Attributes:
        buckets: the gradient buckets (`Bucket`: `.index`, `.plan`, `.grad`, ...), launch order.
        optimizer: the optimizer (under ZeRO over this rank's segments).
        events: (kind, what, time.perf_counter()) appended during the step: ("grad_ready", name, t)
            when a parameter has all its contributions, ("bucket_start", i, t) when bucket i's
            reduction is launched. Cleared by `begin_step`.
        wait_s: seconds the last `finish_backward` spent (launching the rest and waiting).
    """

    def __init__(self, named_params: Iterable[tuple[str, Any]], mesh, bucket_mb: float = 25.0,
                 wire_dtype: str = "float32", zero: int = 0,
                 make_optimizer: Callable[[list], Any] = AdamW, overlap: bool = True):
        # The gradient group: every rank holding the same weights on other tokens (dp x cp).
        self.dp_comm = mesh.comm((Axis.DP, Axis.CP))
        compressor = make_compressor(wire_dtype, self.dp_comm)  # validates wire_dtype
        if zero not in (0, 1):
            raise ConfigError(f"zero={zero!r} is not a supported ZeRO stage; choose 0 or 1")
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
        self.wire_dtype = wire_dtype
        self.dp_size, self.dp_rank = self.dp_comm.size, self.dp_comm.rank
        self.embedding_comm = mesh.embedding_comm
        tp_rank = mesh.comm(Axis.TP).rank

        # Tied weights: copies (tied_to set) and the weights they mirror, here or on the peer stage.
        targets = {p.tied_to for p in self.params if getattr(p, "tied_to", None)}
        if self.embedding_comm is not None:
            for theirs in self.embedding_comm.all_gather_object(sorted(targets)):
                targets.update(theirs)
        tied = {n for n, p in named if getattr(p, "tied_to", None) or n in targets}

        # Buckets padded to a multiple of dp: ZeRO's parts and the compressed all-to-all's rows.
        plans = plan_buckets([(n, int(p.data.size), str(p.data.dtype)) for n, p in named],
                             int(bucket_mb * _MIB), self.dp_size, tied)
        if compressor is not None:
            reduction = CompressedReduction(compressor, shards=bool(zero))
        elif zero:
            reduction = ReduceScatterAvg(self.dp_comm)
        else:
            reduction = AllReduceAvg(self.dp_comm)
        self.reducer = BucketManager(named, plans, reduction, tied_comm=self.embedding_comm, overlap=overlap)
        self.buckets = self.reducer.buckets
        if self.embedding_comm is not None:
            self._check_tied_match()

        if zero:
            self._zero: ZeroOptimizer | None = ZeroOptimizer(self.buckets, self.dp_comm, make_optimizer)
            self.optimizer = self._zero.optimizer
            # Every dp rank counts its own part, in bucket and segment order.
            self._norm_items = [s for s in self._zero.segments if counts_toward_norm(s.param, tp_rank)]
        else:
            self._zero = None
            self.optimizer = make_optimizer(list(self.params))
            # Replicas are identical after the average: dp rank 0 counts for all of them.
            self._norm_items = [p for p in self.params if counts_toward_norm(p, tp_rank)] if self.dp_rank == 0 else []
        self.wait_s = 0.0

    def _check_tied_match(self) -> None:
        """Both stages' tied buckets must match, or their sum over embedding_comm would not."""
        tied = [b for b in self.buckets if b.plan.tied]
        mine = (tied[0].plan.size, tied[0].plan.dtype) if tied else (0, "")
        sizes = self.embedding_comm.all_gather_object(mine)
        if len(set(sizes)) != 1:
            raise ConfigError(f"tied weights differ between the first and last pipeline stage "
                              f"(size, dtype per rank: {sizes}); both copies must have the same local shape")

    @property
    def overlap(self) -> bool:
        """Whether reductions start from grad hooks during backward."""
        return self.reducer.overlap

    @overlap.setter
    def overlap(self, value: bool) -> None:
        self.reducer.overlap = value

    @property
    def events(self) -> list[tuple[str, Any, float]]:
        """This step's ("grad_ready", name, t) and ("bucket_start", i, t) records (see the class docstring)."""
        return self.reducer.events

    @events.setter
    def events(self, value: list) -> None:
        self.reducer.events = value

    # -- the step -------------------------------------------------------------------------------

    def begin_step(self, microbatches: int = 1) -> None:
        """Zero the gradient buckets, point every `.grad` at its view, arm the hooks."""
        self.reducer.begin_step(microbatches)

    def finish_backward(self) -> None:
        """Launch the buckets not yet started (tied weights last, after summing them across
        stages), wait for every reduction. Afterwards, without ZeRO each `.grad` holds the
        dp-averaged gradient; with ZeRO the averaged part lives with the optimizer's segments."""
        t0 = time.perf_counter()
        self.reducer.finish_backward()
        if self._zero is not None:
            self._zero.attach_grads()
        self.wait_s = time.perf_counter() - t0

    def clip_grad_norm(self, max_norm: float) -> float:
        """Global L2 norm of the averaged gradients over the whole mesh (the same float on every
        rank); when `max_norm > 0` and the norm exceeds it, scale every gradient by
        `max_norm / (norm + 1e-6)` (as torch.nn.utils.clip_grad_norm_). Returns the norm before."""
        grads = [b.part for b in self.buckets] if self._zero is not None else [b.grad for b in self.buckets]
        return clip_global_norm(self._norm_items, grads, max_norm, self.mesh.world)

    def step(self, lr: float | None = None) -> None:
        """Optimizer step with learning rate `lr`. ZeRO: update this rank's part, all-gather
        the parameters."""
        if self._zero is not None:
            self._zero.step(lr)
        else:
            self.optimizer.step(lr)

    # -- optimizer state for checkpoints ------------------------------------------------------------

    def optimizer_step_count(self) -> int:
        """Optimizer steps taken (AdamW's bias correction uses it); checkpoints save it."""
        return self.optimizer.step_count

    def state_names(self) -> tuple[str, ...]:
        """The optimizer's per-parameter state arrays ("exp_avg", "exp_avg_sq" for AdamW)."""
        return tuple(self.optimizer.state_names)

    def optimizer_state(self) -> dict[str, dict[str, Any]]:
        """{parameter name: {state name: array of the parameter's local shape}} (copies).
        Under ZeRO the parts are all-gathered over dp first (collective over dp)."""
        names = self.state_names()
        if self._zero is not None:
            gathered = self._zero.state(names)
            return {n: gathered.get(n, {}) for n in self.names}  # {} per name when the optimizer keeps no state
        out: dict[str, dict[str, Any]] = {}
        for n, p in zip(self.names, self.params):
            st = self.optimizer.state_of(p)
            out[n] = {k: st[k].copy() for k in names}
        return out

    def load_optimizer_state(self, state: dict[str, dict[str, Any]], step_count: int | None = None) -> None:
        """Copy state of the `optimizer_state()` structure in (each rank takes its ZeRO part).

        Call it after loading the parameters themselves: under ZeRO it also re-reads this rank's
        part of them (which `step` otherwise keeps up to date on its own)."""
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
        if self._zero is not None:
            self._zero.load_state(state)
        else:
            xp = backend.array_module(*(p.data for p in self.params))
            for n, p in zip(self.names, self.params):
                for k, dst in self.optimizer.state_of(p).items():
                    dst[...] = xp.asarray(state[n][k])
        if step_count is not None:
            self.optimizer.step_count = int(step_count)
