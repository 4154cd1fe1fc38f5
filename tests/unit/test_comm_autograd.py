"""Differentiable collectives and tensor-parallel layers in one process: size-1 behaviour,
the vocabulary-parallel loss against the fused single-process loss, and configuration errors."""

from dataclasses import dataclass

import numpy as np
import pytest
from mpi4py import MPI

from hpcpar.autograd.functional import cross_entropy
from hpcpar.runtime.comm import Communicator
from hpcpar.errors import ConfigError
from hpcpar.nn.gpt import GPT, GPTConfig
from hpcpar.parallel.tp import layers
from hpcpar.parallel.mappings import all_gather_dim, copy_to, gather_from, reduce_from, reduce_scatter_dim, split_to
from hpcpar.autograd.tensor import Tensor


@dataclass
class Ranks:
    """Stands in for a Communicator where only the group's size and my rank matter (layer setup)."""

    size: int
    rank: int = 0


def test_size_one_collectives_return_their_input_without_a_graph_node():
    x = Tensor(np.arange(6.0).reshape(2, 3), requires_grad=True)
    for comm in (None, Communicator(MPI.COMM_SELF, "tp")):
        for op in (copy_to, reduce_from):
            assert op(x, comm) is x
        for op in (all_gather_dim, reduce_scatter_dim, split_to, gather_from):
            assert op(x, comm, 1) is x


def test_gpt_with_size_one_tp_comm_is_the_plain_model():
    cfg = GPTConfig(vocab_size=32, block_size=4, n_layer=1, n_head=2, n_embd=8, dtype="float64")
    model = GPT(cfg, tp_comm=Communicator(MPI.COMM_SELF, "tp"), sequence_parallel=True)
    assert model.tp_comm is None and not model.sequence_parallel
    assert type(model.transformer.h.items[0].attn).__name__ == "CausalSelfAttention"


@pytest.mark.parametrize("ignore", [False, True])
def test_vocab_parallel_cross_entropy_on_one_rank_equals_the_fused_loss(ignore):
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((3, 5, 11)) * 4
    targets = rng.integers(0, 11, (3, 5))
    if ignore:
        targets[0, :3] = -100
    a, b = Tensor(logits.copy(), requires_grad=True), Tensor(logits.copy(), requires_grad=True)
    loss = layers.vocab_parallel_cross_entropy(a, targets, Communicator(MPI.COMM_SELF, "tp"))
    ref = cross_entropy(b, targets)
    loss.backward()
    ref.backward()
    assert abs(loss.item() - ref.item()) < 1e-13 * abs(ref.item())
    np.testing.assert_allclose(a.grad, b.grad, rtol=0, atol=1e-15)


def test_gpt_rejects_heads_that_tp_does_not_divide():
    cfg = GPTConfig(vocab_size=256, n_head=6, n_embd=48)
    with pytest.raises(ConfigError, match="n_head"):
        GPT(cfg, tp_comm=Ranks(4))


@pytest.mark.parametrize("vocab,tp,rows,real", [(250, 4, 63, [63, 63, 63, 61]), (256, 3, 86, [86, 86, 84]),
                                                 (9, 4, 3, [3, 3, 3, 0]), (64, 4, 16, [16] * 4)])
def test_vocabulary_that_tp_does_not_divide_is_padded(vocab, tp, rows, real):
    """Every rank holds ceil(V/tp) rows of wte; the rows past V are zero padding, outside the
    global [V, C] tensor (so checkpoints do not depend on tp)."""
    full = np.arange(vocab * 2, dtype=np.float64).reshape(vocab, 2) + 1
    for rank in range(tp):
        layout = layers.vocab_layout(vocab, 2, Ranks(tp, rank))
        assert layout.global_shape == (vocab, 2) and layout.local_shape == (rows, 2)
        assert layout.padded == (real[rank] < rows)
        local = layout.take(full)
        assert np.array_equal(local[:real[rank]], full[rank * rows:rank * rows + real[rank]])
        assert not local[real[rank]:].any()   # padding is zero
        back = np.zeros_like(full)
        layout.put(local, back)
        assert np.array_equal(back[rank * rows:rank * rows + real[rank]], local[:real[rank]])


def test_padded_vocabulary_gets_no_probability_in_the_loss():
    """A size-1 group holding a padded shard: the padding column gets -inf, so the loss and its
    gradient equal the unpadded loss's, and the padding's gradient is exactly 0."""
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((4, 7)) * 3
    targets = rng.integers(0, 7, 4)
    padded = np.concatenate([logits, np.full((4, 2), 50.0)], axis=1)   # padding would dominate
    a, b = Tensor(padded, requires_grad=True), Tensor(logits.copy(), requires_grad=True)
    loss = layers.vocab_parallel_cross_entropy(a, targets, Communicator(MPI.COMM_SELF, "tp"), vocab_size=7)
    ref = cross_entropy(b, targets)
    loss.backward()
    ref.backward()
    assert abs(loss.item() - ref.item()) < 1e-13 * abs(ref.item())
    np.testing.assert_allclose(a.grad[:, :7], b.grad, rtol=0, atol=1e-15)
    assert not a.grad[:, 7:].any()


def test_layers_reject_sizes_that_tp_does_not_divide():
    cfg = GPTConfig(n_head=3, n_embd=24)
    with pytest.raises(ConfigError, match="n_head=3"):
        layers.ParallelSelfAttention(cfg, Ranks(2))
    with pytest.raises(ConfigError, match="4\\*n_embd"):
        layers.ParallelMLP(GPTConfig(n_head=1, n_embd=5), Ranks(3))
    with pytest.raises(ConfigError, match="in_features=10"):
        layers.RowParallelLinear(10, 4, Ranks(4))
    with pytest.raises(ConfigError):
        layers.ColumnParallelLinear(4, 6, Ranks(4))
    with pytest.raises(ValueError, match="groups=1"):
        layers.ColumnParallelLinear(4, 12, Ranks(2), groups=3, gather_output=True)


def test_fused_qkv_shard_holds_my_heads_q_k_and_v_rows():
    layer = layers.ColumnParallelLinear(8, 24, Ranks(2, rank=1), groups=3)
    full = np.arange(24 * 8, dtype=float).reshape(24, 8)
    mine = layer.weight.layout.take(full)
    np.testing.assert_array_equal(mine, np.concatenate([full[4:8], full[12:16], full[20:24]]))
