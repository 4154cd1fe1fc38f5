"""Reshard round trip through a checkpoint of a real training run (model + AdamW state).

Run: mpiexec -n 4 python -m pytest tests/parallel/test_resume.py (also -n 2 and 3; -n 1 skips).
A float64 GPT trains 2 steps on the save layout and is checkpointed; the checkpoint is loaded
on other layouts of the same world (other dp/tp/pp, ZeRO on or off) and saved again. Then:
- every global tensor of the re-saved checkpoint (model and optimizer) equals the original
  bitwise, and every local array (both copies of the tied embedding included) is the slice of
  the stored global tensor;
- 2 more steps on the new layout match 2 more steps on the old one to 1e-10 relative.
The global batch (dp * micro_batch_size * microbatches sequences) is the same on every layout.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from mpi4py import MPI

from collective import collective_assert, host, optimizer_pieces, stored

from hpcpar.config.load import load_config
from hpcpar.training.trainer import Trainer

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
TINY = ["model.n_layer=4", "model.n_embd=32", "model.n_head=4", "model.block_size=16", "model.dtype=float64",
        "train.steps=4", "train.warmup=1", "train.lr=0.01", "train.microbatches=2", "run.progress=false"]

# Per world size: (save layout, load layouts), each (dp, tp, pp, zero[, pipeline schedule]); and
# dp * micro_batch_size. The zero-bubble schedules (ZB-V: first and last stage on pp rank 0) load
# and save the same global tensors.
LAYOUTS = {
    2: ((1, 2, 1, 0), [(1, 1, 2, 0), (2, 1, 1, 1), (1, 1, 2, 0, "zbv")]),
    3: ((1, 1, 3, 0), [(3, 1, 1, 1), (1, 1, 3, 0, "zbh1")]),
    4: ((1, 2, 2, 0), [(4, 1, 1, 0), (1, 1, 4, 0), (2, 2, 1, 1), (2, 1, 2, 1), (1, 1, 4, 0, "zbh1"),
                       (2, 1, 2, 1, "zbv")]),
}
SEQUENCES_PER_MICROBATCH = {2: 4, 3: 3, 4: 4}
pytestmark = pytest.mark.skipif(SIZE not in LAYOUTS, reason="needs 2, 3 or 4 ranks")




def make_trainer(layout, tokens) -> Trainer:
    dp, tp, pp, zero, name = (*layout, "1f1b")[:5]
    cfg = load_config(None, TINY + [f"mesh.dp={dp}", f"mesh.tp={tp}", f"mesh.pp={pp}", f"train.zero={zero}",
                                           f"pipeline.schedule={name}",
                                           f"train.micro_batch_size={SEQUENCES_PER_MICROBATCH[SIZE] // dp}"])
    return Trainer(cfg, WORLD, tokens=tokens)


def local_mismatches(trainer: Trainer, glob: dict) -> list[str]:
    """Local parameters and optimizer state that are not the slice of the stored global tensor."""
    bad = []
    for name, p in trainer.named_parameters:
        key = p.tied_to or name  # the last stage's lm_head.weight is a copy of transformer.wte.weight
        if not np.array_equal(host(p.data), p.layout.take(glob[f"model/{key}"])):
            bad.append(f"model/{name}")
    for key, state, layout in optimizer_pieces(trainer.dp, trainer.named_parameters):
        for k, v in state.items():
            if not np.array_equal(host(v), layout.take(glob[f"optim/{key}/{k}"])):
                bad.append(f"optim/{key}/{k}")
    return bad




def test_reshard_round_trip_and_continued_training(shared_dir):
    save_layout, load_layouts = LAYOUTS[SIZE]
    tokens = np.random.default_rng(3).integers(32, 127, size=20_000, dtype=np.uint8)
    old = make_trainer(save_layout, tokens)
    for step in range(2):
        old.train_step(step)
    original = old.save(os.path.join(shared_dir, "old"), keep=1)
    reference = stored(original)
    assert any(n.startswith("optim/") and n.endswith("exp_avg_sq") for n in reference)
    collective_assert(not local_mismatches(old, reference), "save layout: local arrays differ from the checkpoint")
    old_losses = [old.train_step(step).loss for step in (2, 3)]
    old_params = old.global_parameters()

    for layout in load_layouts:
        new = make_trainer(layout, tokens)
        meta = new.load(original)
        assert meta["step"] == 2 and new.step == 2 and new.dp.optimizer_step_count() == 2
        bad = local_mismatches(new, reference)
        collective_assert(not bad, f"layout {layout}: loaded arrays differ: {bad[:4]}")
        resaved = stored(new.save(os.path.join(shared_dir, "x".join(map(str, layout))), keep=1))
        differ = sorted(n for n in reference if n not in resaved or not np.array_equal(reference[n], resaved[n]))
        collective_assert(sorted(resaved) == sorted(reference) and not differ,
                          f"layout {layout}: re-saved tensors differ: {differ[:4]}")

        losses = [new.train_step(step).loss for step in (2, 3)]
        params = new.global_parameters()
        worst = max(float(np.max(np.abs(params[n] - old_params[n])) / np.max(np.abs(old_params[n])))
                    for n in old_params)
        loss_err = max(abs(a - b) / abs(a) for a, b in zip(old_losses, losses))
        collective_assert(sorted(params) == sorted(old_params) and worst <= 1e-10 and loss_err <= 1e-10,
                          f"layout {layout}: continued training differs: params {worst:.2e}, loss {loss_err:.2e}")
