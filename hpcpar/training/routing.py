"""A mixture-of-experts step's routing figures: this rank's table, and the world's figures from it.

Each rank counts its micro-batches' routing in a `table` [MoE layers, E + 3] (E experts): per
layer the tokens routed to each expert (before dropping), then the dropped assignments, the
assignments and the aux (+ z) loss. The step's agreement (`Trainer._agree`) sums the tables over
the world in its one collective; `figures` turns the sum into the metrics fields, and
`ExpertBias` (model.moe_expert_bias_rate > 0) updates the experts' routing bias from it.
"""

from __future__ import annotations

import numpy as np

from hpcpar import backend
from hpcpar.errors import CheckpointError
from hpcpar.nn.gpt import GPTConfig
from hpcpar.state import SavedState, StoredState


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


class ExpertBias:
    """Auxiliary-loss-free load balancing (DeepSeek-V3, Wang et al., arXiv 2408.15664; Megatron-Core's
    --moe-router-enable-expert-bias): a bias b, float64 [MoE layers, E], that each MoE layer adds to
    its router probs only to choose the top-k (`MoE.expert_bias`, row l for the l-th MoE layer),
    updated after every training step from the global batch's loads (tokens routed to each expert
    before dropping, the `table`s summed over the world):

        b[l, e] += rate * sign(mean_e' load[l, e'] - load[l, e])

    An overloaded expert's bias falls, an underloaded one's rises, one at the mean keeps its own.
    Every rank sums the same gathered rows in the same order, so every rank, whatever its layout,
    holds bitwise the bias of the one-process model. Evaluation forwards use it, never update it.

    `Checkpointable`: saved in the metadata (`moe_expert_bias`: rows of JSON floats, which round-trip
    exactly), replicated, so any layout loads it; a checkpoint without it (older, or rate 0) starts
    from zeros. At rate 0 it is inert: no layer gets a bias, nothing is saved or loaded.

    Args:
        model: the model's config (`moe_expert_bias_rate`, the MoE layers).
        stages: this rank's pipeline stages; their MoE layers get their rows.
    """

    META = "moe_expert_bias"

    def __init__(self, model: GPTConfig, stages: list):
        self.rate, self.experts = model.moe_expert_bias_rate, model.moe_experts
        self.layers = [i for i in range(model.n_layer) if model.is_moe(i)]
        self.bias = np.zeros((len(self.layers), self.experts))
        self.modules = [moe for stage in stages for moe in stage.moe_layers()]
        self._push()

    def record_step(self, summed: np.ndarray, batches: int) -> dict:
        """The step's routing `figures` from the `table`s summed over the world, after which the
        bias takes the step's update (`update`); with a bias, `moe_expert_bias_max` is max |b| after it."""
        out = figures(summed, self.experts, batches)
        if self.rate:
            # Also after a skipped step (non-finite loss or gradient): its loads are whole token
            # counts of routing that did happen, as Megatron-Core updates before the optimizer's
            # finite check; and the bias stays a function of the batches seen, not of the verdict.
            self.update(summed)
            out["moe_expert_bias_max"] = float(np.abs(self.bias).max())
        return out

    def update(self, summed: np.ndarray) -> None:
        """b += rate * sign(mean load - load) per MoE layer, from the summed tables [MoE layers, E + 3]."""
        load = summed[:, :self.experts]
        self.bias += self.rate * np.sign(load.mean(axis=1, keepdims=True) - load)
        self._push()

    def _push(self) -> None:
        """Give this rank's MoE layers their rows (None at rate 0: no bias)."""
        for moe in self.modules:
            moe.expert_bias = self.bias[self.layers.index(moe.index)] if self.rate else None

    def checkpoint_state(self) -> SavedState:
        """The bias in the metadata (nothing at rate 0)."""
        return SavedState(meta={self.META: self.bias.tolist()} if self.rate else {})

    def load_checkpoint_state(self, stored: StoredState) -> None:
        """The checkpoint's bias (zeros when it has none); also for weights only: routing depends on it."""
        if not self.rate:
            return
        saved = stored.meta.get(self.META)
        bias = np.zeros_like(self.bias) if saved is None else np.asarray(saved, dtype=np.float64)
        if bias.shape != self.bias.shape:
            raise CheckpointError(f"checkpoint {stored.path} holds an expert bias of shape {list(bias.shape)} "
                                  f"(MoE layers, experts), this model needs {list(self.bias.shape)}; load it into "
                                  "the model it was saved from, or set model.moe_expert_bias_rate=0")

        def take(_: dict) -> None:
            self.bias[...] = bias
            self._push()
        stored.read({}, take)
