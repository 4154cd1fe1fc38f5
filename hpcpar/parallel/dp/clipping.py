"""Gradient-norm clipping over the whole mesh: one global norm, the same float on every rank.

The global norm is that of the single-process model's gradient, so every gradient element has
to be counted exactly once across the mesh although many ranks hold copies:

- tensor parallelism: a tp-split parameter's shards are disjoint, so every tp rank counts its
  own; a tp-replicated one (LayerNorm, `wpe`, row-parallel biases, experts) is identical on all
  tp ranks and only tp rank 0 counts it;
- expert parallelism: the ep ranks hold different experts and all count; the ranks holding the
  same experts (the expert-data-parallel group) are replicas of the kind below;
- pipeline parallelism: stages hold different parameters and all count; a tied copy (the LM
  head mirroring the embedding, `tied_to`) is skipped, the embedding counts;
- data parallelism: replicas are identical after the average, so only dp rank 0 counts,
  except under ZeRO, where each dp rank counts the segments of its own part. Context-parallel
  ranks are replicas of the same kind (the gradient group is dp x cp): "dp rank" is the rank in
  that group.

Choosing those items is the caller's (`counts_toward_norm` gives the tp/pp rule). Each rank
sums its squares in float64; the per-rank sums are all-gathered over the world and added in
rank order with `math.fsum` (`norm_from_parts`), so the norm is bitwise the same everywhere (a
tree all-reduce could add in a different order on different ranks) and the clipping decision
agrees. The training step gathers its part together with its other per-step figures, in the
step's one world collective (`Trainer._agree`), then clips with `clip_gradients`.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import numpy as np

from hpcpar.runtime.comm import Communicator
from hpcpar.optim.optimizers import grad_norm_sq


def tp_replicated(p: Any) -> bool:
    """Whether every tp rank holds the same array of parameter `p`: a replicated layout, or a
    mixture-of-experts expert (whole on every tp rank; its layout splits it over ep only)."""
    return p.layout.is_replicated or getattr(p, "expert", False)


def counts_toward_norm(p: Any, tp_rank: int) -> bool:
    """Whether parameter `p`'s gradient counts toward the global norm on a rank of `tp_rank`."""
    if getattr(p, "tied_to", None):
        return False
    return tp_rank == 0 or not tp_replicated(p)


def norm_from_parts(parts: Iterable[float]) -> float:
    """The L2 norm from every rank's sum of squares, `parts` in rank order (added with fsum)."""
    return math.sqrt(math.fsum(float(v) for v in parts))


def global_grad_norm(items: Iterable[Any], world: Communicator) -> float:
    """L2 norm over every rank of `world` of the `.grad`s of `items` (this rank's share)."""
    sq = np.array([grad_norm_sq(items)], dtype=np.float64)
    return norm_from_parts(world.all_gather(sq))  # one value per rank, in rank order


def clip_gradients(grads: Iterable[Any], norm: float, max_norm: float, loss_scale: float = 1.0) -> None:
    """Given the global (unscaled) `norm`: when `max_norm > 0` and the norm exceeds it, scale every
    array of `grads` in place by `max_norm / (norm + 1e-6)` (as torch.nn.utils.clip_grad_norm_).
    `grads` are the buffers that hold the gradients (whole buckets, or ZeRO parts), tied copies
    included. `loss_scale`: the gradients are of the loss times this (fp16 loss scaling): they are
    divided by it in the same pass. A non-finite norm (an overflow) leaves the gradients as they
    are: the step is skipped."""
    coef = 1.0 / loss_scale
    if max_norm > 0 and max_norm / (norm + 1e-6) < 1.0:
        coef *= max_norm / (norm + 1e-6)
    if coef != 1.0 and math.isfinite(norm):
        for g in grads:
            g *= coef


def clip_global_norm(items: Iterable[Any], grads: Iterable[Any], max_norm: float, world: Communicator,
                     loss_scale: float = 1.0) -> float:
    """Global norm of `items`' gradients (collective over `world`, divided by `loss_scale`), then
    `clip_gradients`. Returns the norm before clipping."""
    norm = global_grad_norm(items, world) / loss_scale
    clip_gradients(grads, norm, max_norm, loss_scale)
    return norm
