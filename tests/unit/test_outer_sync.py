"""The outer synchronisation of local SGD / DiLoCo (hpcpar/parallel/dp/outer.py) on one process:
its schedule, its fragments, and one replica, which trains as if nothing synchronised it. The
replicas themselves are tested against one-process replicas in tests/parallel/test_diloco.py."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from hpcpar.config.load import load_config
from hpcpar.parallel.dp.outer import OuterConfig, OuterSync, fragment_of, syncs_after
from hpcpar.runtime.comm import Communicator
from hpcpar.training.trainer import Trainer

TOKENS = np.random.default_rng(5).integers(0, 256, 4000).astype(np.uint8)
TINY = ["model.n_layer=2", "model.n_embd=16", "model.n_head=2", "model.block_size=8", "model.dtype=float64",
        "train.steps=10", "train.warmup=1", "train.lr=0.01", "run.eval_every=0", "run.progress=false",
        "train.micro_batch_size=2", "train.microbatches=2", "model.dropout=0.1"]


def test_fragments_sync_every_H_steps_H_over_F_apart():
    steps = range(12)
    assert [s for s in steps if syncs_after(s, 0, 3, 1)] == [2, 5, 8, 11]
    assert [s for s in steps if syncs_after(s, 0, 4, 2)] == [1, 5, 9]
    assert [s for s in steps if syncs_after(s, 1, 4, 2)] == [3, 7, 11]
    assert [s for s in steps if syncs_after(s, 0, 1, 1)] == list(steps)


def test_fragments_are_consecutive_blocks_with_the_embeddings_first_and_the_head_last():
    names = ["transformer.wte.weight", "transformer.wpe.weight", "transformer.h.0.attn.c_attn.weight",
             "transformer.h.1.mlp.c_fc.bias", "transformer.h.2.ln_1.weight", "transformer.h.3.mlp.experts.0.w",
             "transformer.ln_f.weight", "lm_head.weight"]
    assert [fragment_of(n, 4, 2) for n in names] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [fragment_of(n, 4, 4) for n in names] == [0, 0, 0, 1, 2, 3, 3, 3]
    assert {fragment_of(n, 4, 1) for n in names} == {0}


@pytest.mark.parametrize("outer", [OuterConfig("local", every=3), OuterConfig("diloco", every=3, lr=1.0, momentum=0.0),
                                   OuterConfig("local", every=2, fragments=2)],
                         ids=["local", "diloco-lr1", "local-streaming"])
def test_one_replica_trains_as_if_nothing_synchronised_it(outer):
    """With one replica the mean of the outer gradients is its own, so the outer step puts the
    parameters back where the inner steps took them (up to rounding). (Not with a delay: a result
    that lands tau steps late replaces, or with `mix` blends, the steps taken meanwhile, as
    Streaming DiLoCo does.)"""
    def trainer():
        return Trainer(load_config(None, TINY), MPI.COMM_SELF, tokens=TOKENS)

    plain, synced = trainer(), trainer()
    sync = OuterSync(outer, synced.dp.parameter_pieces(), Communicator.local(), n_layer=2)
    a, b = [], []
    for s in range(7):
        a.append(plain.train_step(s).loss)
        b.append(synced.train_step(s).loss)
        sync.after_step(s)
    pa, pb = plain.global_parameters(), synced.global_parameters()
    worst = max(float(np.max(np.abs(pa[n] - pb[n]))) / float(np.max(np.abs(pa[n]))) for n in pa)
    assert np.allclose(a, b, rtol=1e-12, atol=0) and worst <= 1e-12, (a, b, worst)
    assert sync.in_flight == {}  # every result landed
    plain.free()
    synced.free()


def test_one_replica_with_outer_momentum_is_not_plain_training():
    """The outer Nesterov step is a real optimizer: with momentum even one replica moves
    differently (what the test above would miss if the outer step did nothing)."""
    t = Trainer(load_config(None, TINY), MPI.COMM_SELF, tokens=TOKENS)
    before = {k: d.copy() for k, _, d in t.dp.parameter_pieces()}
    sync = OuterSync(OuterConfig("diloco", every=2, lr=0.7, momentum=0.9), t.dp.parameter_pieces(),
                     Communicator.local(), n_layer=2)
    for s in range(2):
        t.train_step(s)
    inner = {k: d.copy() for k, _, d in t.dp.parameter_pieces()}
    sync.after_step(1)
    for k, _, d in t.dp.parameter_pieces():
        delta = before[k] - inner[k]
        expected = before[k] - 0.7 * (delta + 0.9 * delta)
        assert np.allclose(d, expected, rtol=1e-12, atol=1e-15), k
    t.free()
