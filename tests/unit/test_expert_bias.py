"""Auxiliary-loss-free load balancing (model.moe_expert_bias_rate, training/routing.py
`ExpertBias`, nn/moe.py), on one process, in float64.

- The update: b += rate * sign(mean load - load) per MoE layer, from the summed routing tables
  (an overloaded expert's bias falls, an underloaded one's rises, one exactly at the mean keeps
  its own); each MoE layer gets its own row, also when only every other block is one.
- Routing: the bias only chooses the top-k; the output is the unbiased reference's with the
  biased choices (combine weights and aux loss from the unbiased probs); ties stay stable.
- Checkpoints: saved in the metadata and loaded back exactly (JSON round trip); a checkpoint
  without it starts from zeros; one of another shape is refused in one line; rate 0 saves
  nothing and sets no bias.
- The step's figures carry max |b| (after the step's update) with the bias on, nothing without.
"""

import json
from dataclasses import dataclass, field

import numpy as np
import pytest

from hpcpar.autograd.tensor import Tensor
from hpcpar.errors import CheckpointError
from hpcpar.nn.gpt import GPTConfig
from hpcpar.nn.moe import MoE, top_k
from hpcpar.training.routing import ExpertBias, figures

from test_moe import config, layer, numpy_moe

pytestmark = pytest.mark.usefixtures("numpy_backend")


@dataclass
class _Stage:
    layers: list

    def moe_layers(self) -> list:
        return self.layers


@dataclass
class _Stored:
    """A StoredState whose tensors nobody asks for: `read` calls `then` at once."""

    meta: dict = field(default_factory=dict)
    path: str = "ckpt"
    weights_only: bool = False

    def read(self, wanted, then):
        assert not wanted
        then({})


def biased(rate: float, n_layer: int = 3, every: int = 1, experts: int = 4):
    cfg = GPTConfig(vocab_size=64, block_size=8, n_layer=n_layer, n_head=2, n_embd=8, dtype="float64",
                    moe_experts=experts, moe_top_k=1, moe_every=every, moe_expert_bias_rate=rate)
    modules = [MoE(cfg, index=i) for i in range(n_layer) if cfg.is_moe(i)]
    return ExpertBias(cfg, [_Stage(modules)]), modules


def summed(loads) -> np.ndarray:
    """Routing tables [MoE layers, E + 3] with these per-expert loads (the 3 figures after: 0)."""
    loads = np.asarray(loads, dtype=np.float64)
    return np.concatenate([loads, np.zeros((loads.shape[0], 3))], axis=1)


def test_update_moves_each_bias_against_its_load_and_leaves_the_mean_alone():
    bias, modules = biased(0.01, n_layer=2)
    bias.update(summed([[10, 2, 4, 4], [5, 5, 5, 5]]))        # layer 0: mean 5; layer 1: balanced
    assert bias.bias.tolist() == [[-0.01, 0.01, 0.01, 0.01], [0.0, 0.0, 0.0, 0.0]]
    bias.update(summed([[1, 9, 5, 5], [8, 2, 5, 5]]))         # expert 2, 3 of layer 0 at the mean: kept
    assert bias.bias.tolist() == [[0.0, 0.0, 0.01, 0.01], [-0.01, 0.01, 0.0, 0.0]]
    assert [m.expert_bias.tolist() for m in modules] == bias.bias.tolist()


def test_each_moe_layer_gets_its_own_row_with_moe_every_2():
    bias, modules = biased(0.5, n_layer=5, every=2)           # MoE blocks 0, 2, 4
    assert [m.index for m in modules] == [0, 2, 4] and bias.bias.shape == (3, 4)
    bias.update(summed([[4, 0, 0, 0], [0, 4, 0, 0], [0, 0, 0, 4]]))
    for row, m in zip(bias.bias, modules):
        assert np.array_equal(m.expert_bias, row)
    assert [int(np.argmin(m.expert_bias)) for m in modules] == [0, 1, 3]


def test_rate_zero_sets_no_bias_saves_nothing_and_reports_no_bias():
    bias, modules = biased(0.0)
    assert all(m.expert_bias is None for m in modules)
    out = bias.record_step(summed([[4, 0, 0, 0]] * 3), batches=1)
    assert out == figures(summed([[4, 0, 0, 0]] * 3), 4, 1) and "moe_expert_bias_max" not in out
    assert bias.checkpoint_state().meta == {} and not bias.bias.any()
    bias.load_checkpoint_state(_Stored({ExpertBias.META: [[1.0] * 4] * 3}))
    assert all(m.expert_bias is None for m in modules)


def test_record_step_update_the_bias_and_report_its_largest_magnitude():
    bias, _ = biased(0.25, n_layer=1)
    out = bias.record_step(summed([[6, 2, 0, 0]]), batches=2)      # mean 2: expert 1 keeps its bias
    assert bias.bias.tolist() == [[-0.25, 0.0, 0.25, 0.25]]
    assert out["moe_expert_bias_max"] == 0.25 and out["moe_load_imbalance"] == 3.0


def test_the_bias_chooses_the_experts_but_the_probabilities_weight_them():
    """A bias that favours expert 3 by far sends every token there (top-1), and the output is
    probs[n, 3] * expert_3(x_n): the reference with the biased choices and the unbiased weights."""
    cfg = config(moe_top_k=1)
    moe = layer(cfg, seed=2)
    x = np.random.default_rng(3).standard_normal((2, 5, cfg.n_embd))
    unbiased = moe(Tensor(x)).data
    moe.expert_bias = np.array([0.0, 0.0, 0.0, 2.0])
    y = moe(Tensor(x)).data
    routed = moe.stats[-1][0]
    assert routed.tolist() == [0, 0, 0, 10]
    want_y, want_aux = numpy_moe(cfg, moe, x, choose=lambda probs: top_k(probs + moe.expert_bias, 1))
    assert np.allclose(y, want_y, rtol=1e-12, atol=1e-12) and not np.allclose(y, unbiased)
    assert float(moe.stats[-1][3]) == pytest.approx(want_aux, rel=1e-12)


def test_biased_ties_go_to_the_lower_expert():
    probs = np.array([[0.5, 0.25, 0.75, 0.125]])                # binary fractions: sums are exact
    assert top_k(probs + np.array([0.0, 0.25, 0.0, 0.0]), 2).tolist() == [[2, 0]]    # 0.5 = 0.5: expert 0 first
    assert top_k(probs + np.array([0.25, 0.5, 0.0, 0.0]), 2).tolist() == [[0, 1]]    # 0.75 three ways


def test_checkpoint_round_trips_exactly_and_an_old_checkpoint_starts_from_zeros():
    bias, modules = biased(0.1)
    rng = np.random.default_rng(0)
    bias.bias[...] = rng.standard_normal(bias.bias.shape) / 3     # floats with all their digits
    meta = json.loads(json.dumps(bias.checkpoint_state().meta))
    other, others = biased(0.1)
    other.load_checkpoint_state(_Stored(meta))
    assert np.array_equal(other.bias, bias.bias) and all(np.array_equal(m.expert_bias, r)
                                                         for m, r in zip(others, bias.bias))
    other.load_checkpoint_state(_Stored({}))
    assert not other.bias.any() and all(not m.expert_bias.any() for m in others)


def test_a_bias_of_another_shape_is_refused_in_one_line():
    bias, _ = biased(0.1)
    with pytest.raises(CheckpointError) as info:
        bias.load_checkpoint_state(_Stored({ExpertBias.META: [[0.0] * 8] * 3}))
    assert "holds an expert bias of shape [3, 8]" in str(info.value) and "\n" not in str(info.value)
    assert not bias.bias.any()
