"""A mixture-of-experts step's routing figures: this rank's table, and the world's figures from it.

Each rank counts its micro-batches' routing in a `table` [MoE layers, E + 3] (E experts): per
layer the tokens routed to each expert (before dropping), then the dropped assignments, the
assignments and the aux (+ z) loss. The step's agreement (`Trainer._agree`) sums the tables over
the world in its one collective; `figures` turns the sum into the metrics fields.
"""

from __future__ import annotations

import numpy as np

from hpcpar import backend
from hpcpar.nn.gpt import GPTConfig


def table(stages: list, model: GPTConfig, tp_rank: int) -> np.ndarray:
    """This rank's routing figures of the step just run [MoE layers, E + 3], summed over its
    micro-batches; zeros on tp ranks other than 0 (tp ranks route identically). Clears the
    layers' per-micro-batch stats."""
    layers = [i for i in range(model.n_layer) if model.is_moe(i)]
    out = np.zeros((len(layers), model.moe_experts + 3))
    for stage in stages:
        for moe in stage.moe_layers():
            row = out[layers.index(moe.index)]
            aux = backend.to_host(backend.xp.stack([a for _, _, _, a in moe.stats])) if moe.stats else []
            for (routed, dropped, assignments, _), loss in zip(moe.stats, aux):
                row += np.concatenate([routed, [dropped, assignments, float(loss)]])
            moe.stats.clear()
    if tp_rank != 0:
        out[...] = 0
    return out


def figures(summed: np.ndarray, experts: int, batches: int) -> dict:
    """The step's routing figures from the `table`s summed over the world, with `batches`
    micro-batches in the global batch: `moe_aux_loss`, the aux (+ z) losses of all MoE layers
    summed, mean over the micro-batches; `moe_load_imbalance`, max over mean tokens per expert
    (counted before dropping, over the global batch) of the worst MoE layer, `moe_layer_imbalance`
    the same per MoE layer; `moe_dropped_fraction`, the share of (token, expert) assignments
    dropped by the capacity limit."""
    routed = summed[:, :experts]
    imbalance = routed.max(axis=1) / np.maximum(routed.mean(axis=1), 1e-300)
    e = experts
    return {"moe_aux_loss": float(summed[:, e + 2].sum() / batches),
            "moe_load_imbalance": float(imbalance.max()),
            "moe_layer_imbalance": [float(v) for v in imbalance],
            "moe_dropped_fraction": float(summed[:, e].sum() / max(summed[:, e + 1].sum(), 1.0))}
