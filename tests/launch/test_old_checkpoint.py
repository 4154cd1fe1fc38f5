"""A checkpoint written before the package's layout change (revision 031904d, the last one with the
flat module layout) loads into today's code and the run continues on the same loss curve, bit for bit.

data/checkpoint-031904d/step-0000002 was written by that revision's `hpcpar train` with the settings
below under `mpiexec -n 2` (dp=2, ZeRO-1, int8 gradient compression with error feedback, dropout,
float64: model, sharded optimizer state and compression residuals all in the checkpoint);
losses.json holds the losses that run printed for its steps 0-3.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import sys

DATA = pathlib.Path(__file__).resolve().parent / "data" / "checkpoint-031904d"
SETTINGS = ["model.n_layer=1", "model.n_embd=8", "model.n_head=2", "model.block_size=8", "model.dtype=float64",
            "model.dropout=0.1", "train.micro_batch_size=2", "train.microbatches=2", "train.steps=4",
            "train.warmup=1", "run.progress=false", "run.eval_every=0", "checkpoint.every=2", "checkpoint.keep=2",
            "mesh.dp=2", "train.zero=1", "train.grad_compression=int8"]


def corpus(path: pathlib.Path) -> pathlib.Path:
    path.write_text("def f(x):\n    return x * 2\n" * 200)   # the corpus the old run trained on
    return path


def test_the_old_checkpoint_verifies(tmp_path):
    from hpcpar.checkpoint.tools import verify
    assert verify(str(DATA / "step-0000002")) == []


def test_an_old_checkpoint_resumes_on_the_same_loss_curve(mpirun, tmp_path):
    """Resumed at step 2 on the same mesh, steps 2 and 3 have the old run's losses, to the bit."""
    shutil.copytree(DATA / "step-0000002", tmp_path / "ckpt" / "step-0000002")
    sets = [*SETTINGS, f"data.corpus={corpus(tmp_path / 'corpus.txt')}", f"run.dir={tmp_path / 'run'}",
            f"checkpoint.resume={tmp_path / 'ckpt' / 'step-0000002'}"]
    job = mpirun(2, [sys.executable, "-m", "hpcpar", "train", *[a for s in sets for a in ("--set", s)]], timeout=120)
    assert job.returncode == 0, job.output
    old = {int(step): loss for step, loss in json.loads((DATA / "losses.json").read_text()).items()}
    new = {r["step"]: r["loss"] for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())}
    assert sorted(new) == [2, 3], new
    assert [new[2], new[3]] == [old[2], old[3]], (new, old)
