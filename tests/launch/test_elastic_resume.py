"""Elastic resume: a run killed at step k on 4 ranks and resumed on 2 or 3 ranks (mesh on auto,
checkpoint.resume=auto, no batch keys) keeps the global batch and gives the uninterrupted run's
losses (float64, 1e-10 relative).

The 4-rank run resolves to dp=2 x pp=2 with micro_batch_size=3 x microbatches=2: a global batch
of 12 sequences. On 2 ranks (dp=2) that is 3 x 2 again, on 3 ranks (dp=3) 3 x 1 per dp rank.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

TINY = ["model.n_layer=2", "model.n_embd=32", "model.n_head=2", "model.block_size=32", "model.dtype=float64",
        "model.dropout=0.1", "train.warmup=2", "train.lr=0.01", "run.progress=false", "run.eval_every=0",
        "run.log_every=1", "run.timeout=60"]
BATCH = ["train.micro_batch_size=3", "train.microbatches=2"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_bytes(np.random.default_rng(3).integers(32, 127, size=30_000, dtype=np.uint8).tobytes())
    return path


def train(mpirun, n, run_dir, corpus, overrides):
    args = [sys.executable, "-m", "hpcpar", "train"]
    for kv in TINY + [f"data.corpus={corpus}", f"run.dir={run_dir}"] + overrides:
        args += ["--set", kv]
    job = mpirun(n, args, timeout=120)
    assert not job.timed_out and job.returncode == 0, job.output[-4000:]
    return job


def losses(run_dir) -> dict[int, float]:
    with open(run_dir / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


@pytest.mark.parametrize("ranks", [2, 3])
def test_resume_on_fewer_ranks_continues_the_loss_curve(mpirun, tmp_path, corpus, ranks):
    straight, split = tmp_path / "straight", tmp_path / "split"
    train(mpirun, 4, straight, corpus, BATCH + ["train.steps=4"])
    train(mpirun, 4, split, corpus, BATCH + ["train.steps=2"])
    job = train(mpirun, ranks, split, corpus, ["train.steps=4", "checkpoint.resume=auto"])
    assert "elastic resume" in job.output and "at step 2" in job.output, job.output[-2000:]
    want, got = losses(straight), losses(split)
    assert sorted(want) == sorted(got) == [0, 1, 2, 3]
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-10, abs=0), step


def test_given_batch_keys_are_kept(mpirun, tmp_path, corpus):
    """Batch keys on the command line win: no derivation, the run uses them as given."""
    run = tmp_path / "run"
    train(mpirun, 4, run, corpus, BATCH + ["train.steps=2"])
    job = train(mpirun, 2, run, corpus, ["train.steps=3", "checkpoint.resume=auto", "train.micro_batch_size=2",
                                         "train.microbatches=1"])
    assert "elastic resume" not in job.output
