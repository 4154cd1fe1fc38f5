"""Data parallelism for a mixture-of-experts model: dense weights over dp, experts over edp.

Dense weights are replicated over dp x cp, and their gradients are averaged there as always.
An expert weight lives on one rank of each ep group (expert parallelism splits the experts over
ep ranks borrowed from dp_shard x cp, `mesh.Mesh`) and is replicated over the ranks holding
the same experts, the expert-data-parallel group `mesh.comm(Axis.EDP)` (dp x cp / ep ranks).

The normalisation: rank d's loss is the mean over its tokens, L_d, and the objective is the
mean over the dp ranks, (1/dp) sum_d L_d; a dense gradient is averaged over dp. An expert's
gradient on one rank already sums the contributions of the tokens that every rank of its ep
group sent it (the dispatch's backward brings them home), so averaging it over the edp group
gives (ep/dp) sum_d dL_d/dW: `finish_backward` divides by ep, leaving (1/dp) sum_d dL_d/dW,
what the single-process model computes. With ep = 1 the edp group is dp x cp and nothing changes.

`ExpertDataParallel` is a gradient sync strategy (`sync.GradientSync`) made of two: one for
each kind of weight, both of the run's ZeRO stage (`sync.make_gradient_sync`; the expert one over
(edp, edp_shard, dp_replicate): ZeRO-1/2 shards expert optimizer state over edp_shard). It
answers the training loop as one: a single global gradient norm over both, one step, one
checkpoint. Gradient compression and ZeRO-3 are refused with experts by config validation.
"""

from __future__ import annotations

from typing import Any, Callable

from hpcpar.runtime.topology import Axis
from hpcpar.parallel.dp.clipping import clip_global_norm
from hpcpar.parallel.dp.data_parallel import DataParallel
from hpcpar.parallel.dp.sync import make_gradient_sync
from hpcpar.state import SavedState, StoredState


class ExpertDataParallel:
    """`sync.GradientSync` over dense weights (dp x cp) and expert weights (edp).

    Args:
        named_params: (global name, Parameter) of every parameter on this rank; those with
            `expert` set are the experts.
        mesh: the Mesh (with its ep groups).
        expert_groups: the expert part's (gradient, shard, replica) groups instead of (edp,
            edp_shard, dp_replicate): with train.sync = "local" / "diloco", (edp_shard, edp_shard,
            alone), the replica's own.
        **kwargs: `sync.make_gradient_sync`'s other arguments, for both parts (the expert part
            sums no tied weights: it has none).

    Attributes:
        dense, experts: the two parts (`experts` None on a rank without expert weights).
        parts: both, dense first.
    """

    def __init__(self, named_params, mesh, expert_groups: tuple | None = None, **kwargs):
        named = list(named_params)
        self.mesh = mesh
        self.ep = mesh.size(Axis.EP)
        self.dense = make_gradient_sync([(n, p) for n, p in named if not p.expert], mesh, **kwargs)
        experts = [(n, p) for n, p in named if p.expert]
        # Every rank of an edp group sits on the same pipeline stage: all have experts, or none.
        groups = expert_groups or (mesh.comm(Axis.EDP), mesh.comm(Axis.EDP_SHARD), mesh.comm(Axis.DP_REPLICATE))
        self.experts = make_gradient_sync(experts, mesh, **{**kwargs, "local_tied": True, "groups": groups}
                                          ) if experts else None
        self.parts = [self.dense] + ([self.experts] if self.experts is not None else [])
        self.unit_hooks = None  # no ZeRO-3 with experts

    # -- the step -------------------------------------------------------------------------------
    def begin_step(self, microbatches: int = 1, step: int | None = None) -> None:
        for part in self.parts:
            part.begin_step(microbatches, step)

    def finish_backward(self) -> None:
        """Both reductions; then the expert gradients divided by ep (the module doc)."""
        for part in self.parts:
            part.finish_backward()
        if self.experts is not None and self.ep > 1:
            for g in self.experts.norm_parts()[1]:
                g *= 1.0 / self.ep

    def norm_parts(self) -> tuple[list, list]:
        """Both parts' (items counted toward the global norm, gradient buffers)."""
        items, buffers = [], []
        for part in self.parts:
            mine, grads = part.norm_parts()
            items += mine
            buffers += grads
        return items, buffers

    def clip_grad_norm(self, max_norm: float, loss_scale: float = 1.0) -> float:
        """One global norm over dense and expert gradients (collective over the world); gradients of
        a loss scaled by `loss_scale` are unscaled first (`clip_global_norm`)."""
        return clip_global_norm(*self.norm_parts(), max_norm, self.mesh.world, loss_scale)

    def step(self, lr: float | None = None) -> None:
        for part in self.parts:
            part.step(lr)

    @property
    def compressing(self) -> bool:
        return False

    def nonfinite_gradients(self) -> list[str]:
        return [n for part in self.parts for n in part.nonfinite_gradients()]

    def sync_bytes(self) -> float:
        return sum(part.sync_bytes() for part in self.parts)

    def uncompressed_bytes(self) -> float | None:
        return sum(part.uncompressed_bytes() for part in self.parts)

    def step_bytes(self) -> float:
        return sum(part.step_bytes() for part in self.parts)

    # -- parameters, optimizer state, checkpoints -----------------------------------------------
    def full_parameters(self) -> dict[str, Any]:
        return self._merged(lambda part: part.full_parameters())

    def parameter_pieces(self) -> list:
        """Both parts' `DataParallel.parameter_pieces`, dense first."""
        return [piece for part in self.parts for piece in part.parameter_pieces()]

    def optimizer_step_count(self) -> int:
        return self.dense.optimizer_step_count()

    def state_names(self) -> tuple[str, ...]:
        return self.dense.state_names()

    def checkpoint_state(self) -> SavedState:
        """Both parts' tensors, and the optimizer step once (the parts step together). No
        compressor with experts (refused by config validation)."""
        states = [part.checkpoint_state() for part in self.parts]
        return SavedState({n: t for state in states for n, t in state.tensors.items()}, states[0].meta)

    def load_checkpoint_state(self, stored: StoredState) -> None:
        """Each part asks for its own tensors (the loader reads them all at once)."""
        for part in self.parts:
            part.load_checkpoint_state(stored)

    def _merged(self, get: Callable[[DataParallel], dict]) -> dict:
        out: dict = {}
        for part in self.parts:
            out.update(get(part))
        return out
