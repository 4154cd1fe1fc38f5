"""`Trainer.train`, the loop of `hpcpar train`, driven as benchmarks and tests drive it: no files.

Run: mpiexec -n 4 python -m pytest tests/parallel/test_train_loop.py (any world size; the mesh
is the default for the world, dp=2 x pp=2 at 4 ranks).
- `train(steps=n, files=False, on_step=...)` runs n steps from `trainer.step`, hands every rank
  each step's record and touches no file; the records equal `train_step` run by hand on a second
  Trainer, bitwise; a second call goes on where the first stopped.
- The skip policy: a non-finite step is skipped and counted; a finite one resets the count;
  `train.max_bad_steps` in a row raise HpcparError on every rank.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
from mpi4py import MPI

from collective import collective_assert

from hpcpar.config.load import load_config
from hpcpar.errors import HpcparError
from hpcpar.training.trainer import Trainer
from hpcpar.training.update import StepResult

WORLD = MPI.COMM_WORLD
TINY = ["model.n_layer=2", "model.n_embd=16", "model.n_head=2", "model.block_size=8", "model.dtype=float64",
        "train.micro_batch_size=2", "train.microbatches=2", "train.steps=6", "train.warmup=1", "train.lr=0.01",
        "run.eval_every=2", "run.eval_batches=1", "checkpoint.every=1", "train.max_bad_steps=2"]
TOKENS = np.random.default_rng(5).integers(32, 127, 20_000).astype(np.uint8)


def make_trainer(run_dir: str) -> Trainer:
    return Trainer(load_config(None, TINY + [f"run.dir={run_dir}"]), WORLD, tokens=TOKENS)


@pytest.mark.timeout(120)
def test_train_without_files_matches_train_step(shared_dir):
    run_dir = os.path.join(shared_dir, "run")
    trainer = make_trainer(run_dir)
    records: list = []
    first = trainer.train(steps=2, files=False, progress=False, on_step=records.append, peak_flops=0.0)
    rest = trainer.train(files=False, progress=False, on_step=records.append, peak_flops=0.0)
    reference = make_trainer(run_dir)
    expected = [reference.train_step(s) for s in range(6)]
    problems = []
    if [r["step"] for r in records] != list(range(6)) or trainer.step != 6:
        problems.append(f"steps {[r['step'] for r in records]}, trainer.step {trainer.step}")
    for r, e in zip(records, expected):
        if (r["loss"], r["grad_norm"], r["lr"], r["skipped"]) != (e.loss, e.grad_norm, e.lr, e.skipped):
            problems.append(f"step {r['step']}: {r} vs {e}")
        if r["mfu"] != 0.0 or not r["cpu_time_s"] >= 0.0:
            problems.append(f"step {r['step']}: mfu {r['mfu']}, cpu_time_s {r['cpu_time_s']}")
    # Evaluation every 2 steps and after the last step of each call.
    with_val = [r["step"] for r in records if "val_loss" in r]
    if with_val != [1, 3, 5]:
        problems.append(f"val_loss at steps {with_val}")
    if (first.status, rest.status, first.summary["steps"], rest.summary["steps"]) != (0, 0, 2, 6):
        problems.append(f"status/steps {first.status} {rest.status} {first.summary['steps']} {rest.summary['steps']}")
    if rest.summary["final_loss"] != expected[-1].loss or rest.summary["val_loss"] != records[-1]["val_loss"]:
        problems.append(f"summary {rest.summary}")
    if os.path.exists(run_dir):
        problems.append(f"files=False wrote {os.listdir(run_dir)}")
    collective_assert(not problems, "; ".join(problems[:4]))
    trainer.mesh.free()
    reference.mesh.free()


@pytest.mark.timeout(120)
def test_skip_policy(shared_dir):
    trainer = make_trainer(os.path.join(shared_dir, "run"))
    pattern = {0: False, 1: True, 2: False, 3: True, 4: True}  # step -> non-finite

    def fake_step(step: int) -> StepResult:
        trainer.step = step + 1
        loss = math.nan if pattern[step] else 1.0 + step
        return StepResult(loss, 1.0, 0.01, pattern[step], "transformer.wte.weight" if pattern[step] else "")

    trainer.train_step = fake_step  # the loop calls it through the instance
    records: list = []
    with pytest.raises(HpcparError, match=r"2 consecutive steps with a non-finite loss or gradient \(last: step 4, "
                                          r"first bad parameter: transformer.wte.weight\)"):
        trainer.train(files=False, progress=False, on_step=records.append, peak_flops=0.0)
    # The step that trips the limit raises before its record: steps 0-3 were reported.
    collective_assert([r["skipped"] for r in records] == [False, True, False, True], f"records {records}")
    trainer.mesh.free()
