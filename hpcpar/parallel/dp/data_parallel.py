"""Data parallelism's shared mechanics: what every gradient sync strategy over one group of
replicas does, whatever it shards.

Every dp rank holds the same parameters and computes gradients on its own samples of the
global batch; averaging the gradients over dp makes each replica take the step the whole
batch would give (PyTorch DDP, arXiv 2006.15704). Context parallelism adds replicas of the
same kind: the cp ranks of a sequence hold the same weights and each computes the gradient of
the mean loss over its equal share of tokens, so the reduction group is dp x cp
(`mesh.comm((Axis.DP, Axis.CP))`; "dp" below means that group). Sharding strategies shard over
the *shard group* `mesh.comm((Axis.DP_SHARD, Axis.CP))`; with HSDP (`mesh.dp_replicate > 1`) the
shard is then averaged over the replicas (`mesh.comm(Axis.DP_REPLICATE)`), which keep identical
shards and identical optimizer state. Without HSDP the shard group is dp x cp.

`DataParallel` is the base of the strategies (`sync.GradientSync` is their contract,
`sync.make_gradient_sync` chooses one): `ddp.DDP` (ZeRO stage 0, whole buckets all-reduced),
`zero.ZeRO` (stages 1 and 2, buckets reduce-scattered, optimizer state sharded), `fsdp.FSDP`
(stage 3, parameters sharded per unit); `experts.ExpertDataParallel` composes two of them. What
they share lives here:

- the groups, and the tied weights. The LM head on the last pipeline stage is a copy
  (`tied_to`) of the embedding on the first; both live in a separate final bucket (FSDP: a flat
  parameter of its own, of the same size on both stages): their gradients are summed over
  `mesh.embedding_comm`, so the two copies receive identical updates. With `local_tied` (ZB-V:
  the first and the last virtual stage are both on pipeline rank 0) the copy and its weight sit
  on the same rank: their gradients are summed there, the same float an all-reduce would give;
- sequence parallelism: replicated parameters applied to sequence shards hold a part of their
  gradient per tp rank, summed over tp once per step after the reduction (`tp_sum_per_step`);
- the end of backward (`finish_backward`), the global norm and clipping (clipping.py), the
  bytes accounting, the optimizer's step count, and the checkpointed state around what each
  strategy saves (`checkpoint_state`: its tensors, the optimizer step, the compressor's state).
"""

from __future__ import annotations

import abc
import time
from typing import Any, Iterable

from hpcpar import backend
from hpcpar.errors import ConfigError
from hpcpar.runtime.topology import Axis
from hpcpar.parallel.dp.clipping import clip_global_norm
from hpcpar.state import SavedState, StoredState, key_of


class DataParallel(abc.ABC):
    """What every gradient sync strategy over one group of replicas shares (module docstring).

    Args:
        named_params: (global name, Parameter) of every parameter on this rank (all its
            pipeline chunks), in registration order.
        mesh: the Mesh; uses `comm((Axis.DP, Axis.CP))` (the replicas), the shard group
            `comm((Axis.DP_SHARD, Axis.CP))` and `comm(Axis.DP_REPLICATE)` (HSDP), `comm(Axis.TP)`,
            `world` and `embedding_comm`.
        local_tied: every tied copy's weight is on this rank too (pipeline placements that put
            the first and last virtual stage on one rank): sum their gradients here, not over
            `mesh.embedding_comm`.
        groups: (gradient group, shard group, replica group) instead of the mesh's (dp x cp,
            dp_shard x cp, dp_replicate): mixture-of-experts expert weights are replicated over
            the expert-data-parallel groups only (`experts.ExpertDataParallel`).

    Attributes:
        names, params: the parameters, in the given order.
        optimizer: the optimizer (sharding strategies: over this rank's segments).
        buckets: the gradient buckets (`Bucket`), launch order; none under FSDP.
        unit_hooks: FSDP's `fsdp.ShardedUnits` (None otherwise).
        compressor, compression_state: the gradient compressor and its checkpointed state
            (None without compression).
        wait_s: seconds the last `finish_backward` spent (launching the rest and waiting).
    """

    def __init__(self, named_params: Iterable[tuple[str, Any]], mesh, local_tied: bool = False,
                 groups: tuple | None = None):
        self.dp_comm, self.shard_comm, self.replicate_comm = groups if groups is not None else (
            mesh.comm((Axis.DP, Axis.CP)), mesh.comm((Axis.DP_SHARD, Axis.CP)), mesh.comm(Axis.DP_REPLICATE))
        named = list(named_params)
        names = [n for n, _ in named]
        if len(set(names)) != len(names):
            raise ConfigError("DataParallel was given a parameter name twice; pass each parameter once")
        self.names = names
        self.params = [p for _, p in named]
        self.mesh = mesh
        self.dp_size, self.dp_rank = self.dp_comm.size, self.dp_comm.rank
        self.replica = self.replicate_comm.rank  # HSDP: replicas > 0 hold copies of replica 0's shards
        self.embedding_comm = None if local_tied else mesh.embedding_comm
        self.tp_comm = mesh.comm(Axis.TP)
        self.tp_rank = self.tp_comm.rank
        self._sequence_parallel = [p for p in self.params if getattr(p, "sequence_parallel", False)
                                   and self.tp_comm.size > 1]
        self.tp_sum_per_step = True
        # A compressor is not linear: a strategy compressing sequence-parallel gradients sums
        # them over tp bucket by bucket, before each reduction, instead of after all of them.
        self._tp_summed_per_bucket = False
        self._tied = self._tied_names(named)
        by_name = dict(named)
        # (copy, weight) pairs held together by this rank: summed here (`_sum_local_tied`).
        self._local_tied = [(p, by_name[p.tied_to]) for p in self.params
                            if getattr(p, "tied_to", None) in by_name] if local_tied else []
        self.optimizer: Any = None
        self._norm_items: list = []
        self.buckets: list = []
        self.unit_hooks = None
        self.compressor = None
        self.compression_state = None
        self.wait_s = 0.0

    # -- tied weights -----------------------------------------------------------------------------

    def _tied_names(self, named: list[tuple[str, Any]]) -> set[str]:
        """Names of the copies (tied_to set) and of the weights they mirror, here or on the peer
        stage (collective over the embedding group)."""
        targets = {p.tied_to for _, p in named if getattr(p, "tied_to", None)}
        if self.embedding_comm is not None:
            for theirs in self.embedding_comm.all_gather_object(sorted(targets)):
                targets.update(theirs)
        return {n for n, p in named if getattr(p, "tied_to", None) or n in targets}

    def _check_tied_match(self, mine: list) -> None:
        """Both stages' tied buckets (flats) must match, or their sum over embedding_comm would not."""
        sizes = self.embedding_comm.all_gather_object(mine[:1] or [(0, "")])
        if len({tuple(x) for x in sizes}) != 1 and len(sizes) > 1:
            raise ConfigError(f"tied weights differ between the first and last pipeline stage "
                              f"(size, dtype per rank: {sizes}); both copies must have the same local shape")

    @staticmethod
    def _sum_local_tied(pairs: list) -> None:
        """Both arrays of each pair become their sum (the tied gradients before their reduction;
        under FSDP the reduced gradient shards, as `ShardedUnits` sums them over the embedding group)."""
        for a, b in pairs:
            a += b
            b[...] = a

    # -- the step ---------------------------------------------------------------------------------

    @abc.abstractmethod
    def begin_step(self, microbatches: int = 1, step: int | None = None) -> None:
        """Arm the gradient hooks for `microbatches` backward passes (see `sync.GradientSync`)."""

    @abc.abstractmethod
    def _reduce(self) -> None:
        """Launch the reductions not yet started and wait for all of them."""

    def finish_backward(self) -> None:
        """Launch the reductions not yet started (tied weights last, after summing them across
        stages), wait for every one. Afterwards each `.grad` holds the dp-averaged gradient, or
        under sharding the averaged part lives with the optimizer's segments."""
        t0 = time.perf_counter()
        self._reduce()
        if not self._tp_summed_per_bucket:
            # The data-parallel average is linear, so averaging each tp rank's part and summing
            # after is the sum averaged: one all-reduce over tp for every part this rank holds.
            self._sum_over_tp(self._tp_partial_grads())
        self.wait_s = time.perf_counter() - t0

    @property
    def compressing(self) -> bool:
        """Whether this step's buckets go through a compressor."""
        return False

    def step(self, lr: float | None = None) -> None:
        """Optimizer step with learning rate `lr`."""
        self.optimizer.step(lr)

    # -- sequence parallelism: the tp sum of the sequence-shard parameters' gradients -------------

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

    def _tp_partial_grads(self) -> list:
        """This rank's parts of sequence-parallel gradients still to be summed over tp."""
        return [p.grad for p in self._sequence_parallel if p.tp_partial_grad]

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

    # -- norms and checks -------------------------------------------------------------------------

    @abc.abstractmethod
    def _grad_buffers(self) -> list:
        """The arrays that hold this rank's averaged gradients (clipping scales them)."""

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

    def _named_grads(self) -> list[tuple[str, Any]]:
        """(parameter name, averaged gradient array) of what this rank holds."""
        return list(zip(self.names, (p.grad for p in self.params)))

    def nonfinite_gradients(self) -> list[str]:
        """Names of this rank's parameters with a non-finite averaged gradient (its part under
        sharding), in model order. Call after `finish_backward`."""
        bad = []
        for name, g in self._named_grads():
            if g is not None and name not in bad and not bool(backend.array_module(g).isfinite(g).all()):
                bad.append(name)
        order = {n: i for i, n in enumerate(self.names)}
        return sorted(bad, key=lambda n: order.get(n, len(order)))

    # -- bytes on the wire and in memory ----------------------------------------------------------

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
        """Bytes `step()` will send from this rank, known before it runs (nothing by default)."""
        return 0.0

    @abc.abstractmethod
    def uncompressed_bytes(self) -> float | None:
        """Bytes this rank sends per step to synchronise gradients without compression."""

    @abc.abstractmethod
    def model_state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds now, by kind: "parameters", "gradients", "optimizer", "gathered"."""

    # -- parameters, optimizer state --------------------------------------------------------------

    def full_parameters(self) -> dict[str, Any]:
        """{name: this rank's whole local array} (the arrays themselves)."""
        return {n: p.data for n, p in zip(self.names, self.params)}

    def parameter_pieces(self) -> list[tuple[str, Any, Any]]:
        """(checkpoint name, Layout, live array) of every piece of parameter data this rank holds:
        whole local arrays, or under ZeRO-3 its shards. Changing an array in place changes the
        model (the replicas' outer synchronisation, outer.py)."""
        return [(key_of(p, name), layout, data) for p, name, layout, data in self._parameter_pieces()]

    def _parameter_pieces(self) -> list[tuple[Any, str, Any, Any]]:
        """(param, name, layout, array) of each piece of parameter data this rank holds."""
        return [(p, n, p.layout, p.data) for n, p in zip(self.names, self.params)]

    def optimizer_step_count(self) -> int:
        """Optimizer steps taken (AdamW's bias correction uses it); checkpoints save it."""
        return self.optimizer.step_count

    def state_names(self) -> tuple[str, ...]:
        """The optimizer's per-parameter state arrays ("exp_avg", "exp_avg_sq" for AdamW)."""
        return tuple(self.optimizer.state_names)

    # -- checkpoints: the model and optimizer state, the compressor's (`Checkpointable`) -----------

    def checkpoint_state(self) -> SavedState:
        """This rank's `model/...` and `optim/...` tensors (`_saved_tensors`), the optimizer step,
        and the compressor's state (compression/state.py; collective over the world)."""
        states = [SavedState(self._saved_tensors(), {"optimizer_step": self.optimizer_step_count()})]
        if self.compression_state is not None:
            states.append(self.compression_state.checkpoint_state())
        return SavedState.merged(states)

    def load_checkpoint_state(self, stored: StoredState) -> None:
        """The parameters and, unless weights only, the optimizer state at the checkpoint's
        optimizer step and the compressor's state (zeros for what the checkpoint lacks)."""
        step_count = None if stored.weights_only else int(stored.meta["optimizer_step"])
        stored.read(self._wanted_tensors(stored.weights_only), lambda arrays: self._take_tensors(arrays, step_count))
        if self.compression_state is not None:
            self.compression_state.load_checkpoint_state(stored)

    @abc.abstractmethod
    def _saved_tensors(self) -> dict[str, tuple[Any, Any]]:
        """{"model/<name>" | "optim/<name>/<state>": (local array, Layout)} this rank saves (a tied
        copy under the weight it mirrors, `state.key_of`): the live arrays, which the save copies."""

    @abc.abstractmethod
    def _wanted_tensors(self, weights_only: bool) -> dict[str, Any]:
        """{tensor name: Layout} this rank loads: the parameters, and the optimizer state unless
        `weights_only`."""

    @abc.abstractmethod
    def _take_tensors(self, arrays: dict[str, Any], step_count: int | None) -> None:
        """Put what `_wanted_tensors` asked for (host arrays) in place; `step_count` None: the
        weights only (the optimizer keeps its state and step)."""


def distinct_nbytes(arrays: Iterable[Any], seen: set) -> int:
    """Bytes of the memory behind `arrays` (None skipped), each underlying buffer counted once
    over every call sharing `seen` (views count their base)."""
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
