"""Pipeline stages: the model's layers split into virtual stages, and this rank's chunks of them.

Virtual stages. With `chunks` = v model chunks per pipeline rank there are V = pp * v virtual
stages; a `schedules.Placement` says which: chunk c of pp rank r is virtual stage c * pp + r
(the loop), or under ZB-V's V stage r for chunk 0 and 2 pp - 1 - r for chunk 1. Virtual stage 0
holds the embedding and reads token ids; virtual stage V - 1 holds ln_f, the LM head and the
loss. Each is one `GPT(config, layers=range(a, b), embed=..., head=...)`.

Layer split (`split_layers`). Cost unit: one transformer block's forward FLOPs per token,
24 C^2 (QKV 6C^2 + projection 2C^2 + MLP 16C^2, 2 FLOPs per multiply-add; attention's T-dependent
part is ignored). The LM head costs 2 C V per token, i.e. `head_cost = V / (12 C)` blocks
(~0.17 for the byte-level default V=256, C=128; ~5.5 for GPT-2's V=50257, C=768). The
embedding is a gather and costs ~0. The split is contiguous, gives every virtual stage at least
one block, minimises the most expensive stage and then maximises the cheapest; remaining ties
give the head stage the fewest blocks, and leftover blocks go to the earliest stages.

Importing this module loads no MPI: the config checks and the planner split layers on login nodes.
"""

from __future__ import annotations

from hpcpar.errors import ConfigError
from hpcpar.nn.gpt import GPT, GPTConfig
from hpcpar.parallel.cp.attention import ContextParallel
from hpcpar.parallel.pp.schedules import Placement
from hpcpar.runtime.topology import Axis


def head_cost(config: GPTConfig) -> float:
    """Cost of ln_f + LM head + loss in transformer blocks: 2 C V / (24 C^2) = V / (12 C)."""
    return config.vocab_size / (12 * config.n_embd)


def split_layers(n_layer: int, virtual_stages: int, head_cost: float = 0.0) -> list[range]:
    """Contiguous block ranges, one per virtual stage, balanced by cost (see the module doc).

    A block costs 1; the last virtual stage also pays `head_cost`. Every stage gets >= 1 block.
    Returns `virtual_stages` ranges covering 0 .. n_layer - 1 in order.
    """
    if virtual_stages < 1 or n_layer < virtual_stages:
        raise ConfigError(f"model.n_layer={n_layer} cannot be split into {virtual_stages} virtual pipeline "
                          "stages (mesh.pp x pipeline.chunks) of >= 1 layer each; need n_layer >= "
                          f"{max(virtual_stages, 1)}")
    if head_cost < 0:
        raise ValueError(f"head_cost must be >= 0, got {head_cost}")
    rest = virtual_stages - 1
    if rest == 0:
        return [range(n_layer)]

    def spread(last: int) -> tuple[float, float]:
        """(costliest, -cheapest) stage cost when the head stage takes `last` blocks."""
        others = n_layer - last
        return (max(last + head_cost, -(-others // rest)), -min(last + head_cost, others // rest))

    # Most balanced: smallest maximum, then largest minimum; on a tie the fewest head-stage blocks.
    last = min(range(1, n_layer - rest + 1), key=spread)
    base, extra = divmod(n_layer - last, rest)
    sizes = [base + (1 if s < extra else 0) for s in range(rest)] + [last]
    ranges, start = [], 0
    for size in sizes:
        ranges.append(range(start, start + size))
        start += size
    return ranges


def build_stages(gpt_config: GPTConfig, mesh, chunks: int, seed: int,
                 sequence_parallel: bool = False, cp: ContextParallel | None = None,
                 placement: Placement | None = None, precision: str = "full") -> list[GPT]:
    """This rank's model chunks: element c is virtual stage `placement.stage(pp_rank, c)`
    (default placement: the loop, c * pp + pp_rank, with `chunks` chunks).

    Parameters are initialised from the seed by global name, so they equal the whole model's.
    `cp`: the context-parallel group every chunk's attention uses (default: ring attention over
    `mesh.comm(Axis.CP)`). MoE layers divide their experts over `mesh.comm(Axis.EP)`. `precision`:
    train.precision (see `GPT`).
    """
    if cp is None:
        cp = ContextParallel(mesh.comm(Axis.CP))
    pp, rank = mesh.size(Axis.PP), mesh.rank(Axis.PP)
    place = placement if placement is not None else Placement(pp, chunks)
    n_virtual = place.stages
    ranges = split_layers(gpt_config.n_layer, n_virtual, head_cost(gpt_config))
    stages = []
    for chunk in range(place.chunks):
        v = place.stage(rank, chunk)
        stages.append(GPT(gpt_config, tp_comm=mesh.comm(Axis.TP), layers=ranges[v], embed=v == 0,
                          head=v == n_virtual - 1, sequence_parallel=sequence_parallel, seed=seed, cp=cp,
                          ep_comm=mesh.comm(Axis.EP), precision=precision))
    return stages
