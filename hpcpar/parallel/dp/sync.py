"""The gradient sync contract (`GradientSync`) the training loop talks to, and the one place a
strategy is chosen (`make_gradient_sync`).

A strategy keeps the data-parallel replicas identical: it averages the gradients over the
ranks holding the same weights, owns the optimizer, and is the checkpointed part (`Checkpointable`)
of the model and optimizer state: it saves and loads what it shards.

    zero  strategy     gradients after the step's reduction   optimizer state  parameters
    0     ddp.DDP      whole buckets, all-reduced             whole            whole
    1     zero.ZeRO    this rank's part (in the whole bucket) this rank's part whole
    2     zero.ZeRO    this rank's part only                  this rank's part whole
    3     fsdp.FSDP    this rank's shard of each unit         this rank's part this rank's shard,
                                                                               gathered per unit

`experts.ExpertDataParallel` (mixture of experts) holds two strategies of the run's stage: one
for the dense weights (over dp x cp), one for the experts (over the expert-data-parallel group).

The trainer calls, per step: `begin_step(microbatches, step)`, the backward of every
micro-batch (the strategy's grad hooks start reductions meanwhile), `finish_backward()`, then
`norm_parts()` (or `clip_grad_norm`) and `step(lr)`; between steps the byte counters, and at
checkpoints `checkpoint_state()` / `load_checkpoint_state(stored)`.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Protocol

from hpcpar.errors import ConfigError
from hpcpar.optim.optimizers import AdamW
from hpcpar.parallel.dp.compression.compressors import Compression
from hpcpar.parallel.dp.ddp import DDP
from hpcpar.parallel.dp.fsdp import FSDP
from hpcpar.parallel.dp.zero import ZeRO
from hpcpar.state import Checkpointable, SavedState, StoredState

ZERO_STAGES = (0, 1, 2, 3)


class GradientSync(Checkpointable, Protocol):
    """What the training loop calls on data parallelism, whatever the strategy.

    Attributes:
        unit_hooks: FSDP's `fsdp.ShardedUnits`, which the model's chunks call around each unit
            (the trainer sets every chunk's `unit_hooks` to it once); None for the others.

    The bucketed strategies (DDP, ZeRO-1/2) also have `buckets` and `on_bucket_ready(listener)`,
    with which a parameter-server replica pushes each bucket as it completes.
    """

    unit_hooks: Any

    # -- the step ---------------------------------------------------------------------------------

    def begin_step(self, microbatches: int = 1, step: int | None = None) -> None:
        """Before the step's first backward: zero the gradient buffers and arm the hooks for
        `microbatches` backward passes. `step` (the global step) decides whether gradient
        compression is on yet (`Compression.start_step`); None: it is."""

    def finish_backward(self) -> None:
        """After the last micro-batch's backward: launch the reductions not yet started, wait for
        all. Afterwards this rank's averaged gradients are in place (whole, or its part)."""

    def norm_parts(self) -> tuple[list, list]:
        """(the items whose `.grad` this rank counts toward the global norm, the arrays holding its
        averaged gradients, which clipping scales). The trainer computes the global norm from
        every rank's share within the step's one world collective, then clips."""

    def clip_grad_norm(self, max_norm: float, loss_scale: float = 1.0) -> float:
        """Global norm (collective over the world) and clipping in one; returns the norm."""

    def step(self, lr: float | None = None) -> None:
        """The optimizer step (sharded strategies: then the parameters' all-gather, or none
        until the next forward gathers them)."""

    @property
    def compressing(self) -> bool:
        """Whether this step's gradients went through a compressor (metrics)."""

    def nonfinite_gradients(self) -> list[str]:
        """After `finish_backward`: names of this rank's parameters with a non-finite averaged
        gradient, in model order (the step is then skipped)."""

    # -- bytes on the wire ------------------------------------------------------------------------

    def sync_bytes(self) -> float:
        """Bytes this rank has sent for gradient synchronisation so far."""

    def uncompressed_bytes(self) -> float | None:
        """Bytes a step would send without compression (None under FSDP: no compression)."""

    def step_bytes(self) -> float:
        """Bytes `step()` will send, known before it runs (agreed on before the optimizer step)."""

    # -- parameters, optimizer state, checkpoints -------------------------------------------------

    def full_parameters(self) -> dict[str, Any]:
        """{name: this rank's whole local array} (FSDP: gathered copies; collective)."""

    def optimizer_step_count(self) -> int:
        """Optimizer steps taken (saved in checkpoints)."""

    def state_names(self) -> tuple[str, ...]:
        """The optimizer's per-parameter state arrays ("exp_avg", "exp_avg_sq" for AdamW)."""

    def checkpoint_state(self) -> SavedState:
        """What this rank saves (`Checkpointable`, hpcpar/state.py): `model/...` and `optim/...`
        (whole local tensors, or under sharding this rank's shards: nothing is gathered), the
        optimizer step, and the compressor's state (`compress/...`)."""

    def load_checkpoint_state(self, stored: StoredState) -> None:
        """The parameters (whole, or this rank's shards) and, unless weights only, the optimizer
        state at the checkpoint's optimizer step and the compressor's state, from any layout."""


def make_gradient_sync(named_params: Iterable[tuple[str, Any]], mesh, bucket_mb: float = 25.0,
                       compression: Compression | str = "none", zero: int = 0,
                       make_optimizer: Callable[[list], Any] = AdamW, overlap: bool = True,
                       units: Iterable[tuple[int, str, list]] | None = None, reshard_after_forward: bool = True,
                       prefetch: int = 3, local_tied: bool = False, groups: tuple | None = None,
                       sparse_embedding: str = "auto") -> GradientSync:
    """The strategy for ZeRO stage `zero` (the module's table).

    Args:
        named_params, mesh, local_tied, groups: see `data_parallel.DataParallel`.
        bucket_mb: bucket size in MiB (stages 0-2).
        compression: gradient compression (`Compression`, or its kind as a string: "none",
            "fp16", "bf16", "int8", "topk", "powersgd"; stages 0-2).
        zero: 0 (replicated), 1 (optimizer state sharded), 2 (gradients too), 3 (parameters too).
        make_optimizer: builds the optimizer from a list of objects with `.data`, `.grad`,
            `.no_decay` (the parameters, or under ZeRO this rank's segments).
        overlap: start reductions from grad hooks during backward (stages 0-2).
        units, reshard_after_forward, prefetch: stage 3, see `fsdp.FSDP`.
        sparse_embedding: "auto" syncs a row-sparse gradient (an untied wte) as (row id, row)
            pairs when fewer bytes than dense (ZeRO 1-3: each row to its owner only), "never" keeps
            it dense (sparse.py).
    """
    if zero not in ZERO_STAGES or isinstance(zero, bool):
        raise ConfigError(f"zero={zero!r} is not a supported ZeRO stage; choose 0, 1, 2 or 3")
    if isinstance(compression, str):
        compression = Compression(compression)
    if compression.enabled and zero == 3:
        raise ConfigError(f"grad_compression={compression.kind!r} works on gradient buckets (zero 0-2); ZeRO-3 "
                          "reduce-scatters each unit's flat gradient instead; use zero <= 2 or no compression")
    if not bucket_mb > 0:
        raise ConfigError(f"bucket_mb must be > 0, got {bucket_mb!r}")
    common = {"local_tied": local_tied, "groups": groups}
    if zero == 3:
        return FSDP(named_params, mesh, units, make_optimizer, reshard_after_forward=reshard_after_forward,
                    prefetch=prefetch, sparse_embedding=sparse_embedding, **common)
    bucketed = {"bucket_mb": bucket_mb, "compression": compression, "overlap": overlap, **common}
    if zero:
        return ZeRO(named_params, mesh, make_optimizer, stage=zero, sparse_embedding=sparse_embedding, **bucketed)
    return DDP(named_params, mesh, make_optimizer, sparse_embedding=sparse_embedding, **bucketed)
