"""A tiny trained run for the launch tests of the one-process verbs."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[2]


TINY_RUN = ["model.n_layer=1", "model.n_embd=16", "model.n_head=2", "model.block_size=8", "train.micro_batch_size=1",
            "train.microbatches=1", "train.steps=2", "train.warmup=0", "run.progress=false", "run.eval_every=0"]


def texts_and_tiny_run(tmp: pathlib.Path, files: int, size: int, seed: int) -> pathlib.Path:
    """`files` random printable text files of `size` bytes in tmp/texts/, and a tiny run trained on the
    first by one process in tmp/run/ (its checkpoints in tmp/run/checkpoints). Returns tmp."""
    rng = np.random.default_rng(seed)
    (tmp / "texts").mkdir()
    for i in range(files):
        (tmp / "texts" / f"part{i}.txt").write_bytes(rng.integers(32, 127, size=size, dtype=np.uint8).tobytes())
    sets = [a for item in [*TINY_RUN, f"data.corpus={tmp / 'texts' / 'part0.txt'}", f"run.dir={tmp / 'run'}"]
            for a in ("--set", item)]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    made = subprocess.run([sys.executable, "-m", "hpcpar", "train", *sets], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=120)
    assert made.returncode == 0, made.stdout + made.stderr
    return tmp
