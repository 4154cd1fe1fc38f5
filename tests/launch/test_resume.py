"""Exact resume across jobs: N steps straight == N/2 steps, save, a new `mpiexec`, resume for N/2.

Each case launches `hpcpar train` under `mpiexec -n 4` three times with a tiny float64 GPT:
  straight   train.steps=4 in run dir A
  first half train.steps=2 in run dir B (the end-of-run save writes B/checkpoints/step-0000002)
  resume     train.steps=4, checkpoint.resume=auto in run dir B (a new mpiexec)
The warm-up (2 steps) covers the first half, so steps 0-1 have the same learning rate whether
the run is 2 or 4 steps long; from step 2 on both runs follow the 4-step schedule. Losses,
gradient norms and learning rates in metrics.jsonl and every tensor of the final checkpoints
(model and optimizer) must be bitwise identical.
"""

from __future__ import annotations

import json
import sys

import h5py
import numpy as np
import pytest

from hpcpar.checkpoint.directory import latest
from hpcpar.checkpoint.format import INDEX, MANIFEST
from hpcpar.checkpoint.tools import verify

NP = 4
TINY = ["model.n_layer=2", "model.n_embd=32", "model.n_head=2", "model.block_size=32", "model.dtype=float64",
        "train.micro_batch_size=2", "train.microbatches=2", "train.warmup=2", "train.lr=0.01",
        "run.progress=false", "run.eval_every=0", "run.log_every=1", "run.timeout=60"]

CASES = {
    "dp2xpp2": ["mesh.dp=2", "mesh.tp=1", "mesh.pp=2"],
    "tp2xpp2": ["mesh.dp=1", "mesh.tp=2", "mesh.pp=2"],
    "dp2xpp2-zero1-dropout": ["mesh.dp=2", "mesh.tp=1", "mesh.pp=2", "train.zero=1", "model.dropout=0.1"],
    "dp4-zero1-async": ["mesh.dp=4", "mesh.tp=1", "mesh.pp=1", "train.zero=1", "checkpoint.async_save=true",
                        "checkpoint.every=1", "checkpoint.keep=5"],
    "hsdp2x2-zero3-async-dropout": ["mesh.dp=4", "mesh.dp_replicate=2", "mesh.tp=1", "mesh.pp=1", "train.zero=3",
                                    "model.dropout=0.1", "checkpoint.async_save=true", "checkpoint.every=1",
                                    "checkpoint.keep=5"],
    # gradient compression: the residuals (and PowerSGD's Q) travel in the checkpoint
    "dp2xpp2-zero2-powersgd": ["mesh.dp=2", "mesh.tp=1", "mesh.pp=2", "train.zero=2", "train.grad_compression=powersgd",
                               "train.powersgd_rank=2"],
    "hsdp2x2-zero1-int8-async": ["mesh.dp=4", "mesh.dp_replicate=2", "mesh.tp=1", "mesh.pp=1", "train.zero=1",
                                 "train.grad_compression=int8", "checkpoint.async_save=true", "checkpoint.every=1",
                                 "checkpoint.keep=5"],
    "dp2xtp2-topk": ["mesh.dp=2", "mesh.tp=2", "mesh.pp=1", "train.grad_compression=topk",
                     "train.compression_ratio=0.05"],
    # the first half saves one shared HDF5 file (ZeRO shards: several blocks per rank and tensor),
    # which the resumed run loads and then saves per rank (the default)
    "dp2xtp2-zero1-shared": ["mesh.dp=2", "mesh.tp=2", "mesh.pp=1", "train.zero=1"],
}
SHARED_FIRST_HALF = {"dp2xtp2-zero1-shared"}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small text corpus (bytes 32..126), so the runs do not read the default one."""
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    rng = np.random.default_rng(7)
    path.write_bytes(rng.integers(32, 127, size=40_000, dtype=np.uint8).tobytes())
    return path


def train(mpirun, run_dir, corpus, overrides):
    args = [sys.executable, "-m", "hpcpar", "train"]
    for kv in TINY + [f"data.corpus={corpus}", f"run.dir={run_dir}"] + overrides:
        args += ["--set", kv]
    job = mpirun(NP, args, timeout=120)
    assert not job.timed_out and job.returncode == 0, job.output[-4000:]
    return job


def metrics(run_dir):
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def tensors(ckpt_dir) -> dict:
    """Every global tensor of a checkpoint, read through index.h5 as one process would."""
    with h5py.File(ckpt_dir / INDEX, "r") as f:
        out = {}
        f.visititems(lambda name, obj: out.__setitem__(name, obj[()]) if isinstance(obj, h5py.Dataset) else None)
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_resume_is_bitwise_exact(mpirun, tmp_path, corpus, case):
    mesh = CASES[case]
    first_half = []
    if case in SHARED_FIRST_HALF:
        if not h5py.get_config().mpi:
            pytest.skip("h5py is not built with MPI: no shared-file checkpoints (parallel HDF5)")
        first_half = ["checkpoint.format=shared"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    train(mpirun, straight, corpus, mesh + ["train.steps=4"])
    train(mpirun, split, corpus, mesh + ["train.steps=2"] + first_half)
    assert latest(str(split / "checkpoints")) == str(split / "checkpoints" / "step-0000002")
    storage = json.loads((split / "checkpoints" / "step-0000002" / MANIFEST).read_text()).get("storage")
    assert storage == ("shared" if first_half else "per_rank")
    job = train(mpirun, split, corpus, mesh + ["train.steps=4", "checkpoint.resume=auto"])
    assert "resumed from" in job.output and "at step 2" in job.output, job.output[-2000:]

    ref, got = metrics(straight), metrics(split)
    assert [r["step"] for r in ref] == [0, 1, 2, 3] and [r["step"] for r in got] == [0, 1, 2, 3]
    for r, g in zip(ref, got):
        for key in ("loss", "grad_norm", "lr"):
            assert r[key] == g[key], f"step {r['step']} {key}: straight {r[key]!r} vs resumed {g[key]!r}"

    a = tensors(straight / "checkpoints" / "step-0000004")
    b = tensors(split / "checkpoints" / "step-0000004")
    assert sorted(a) == sorted(b)
    assert any(n.startswith("optim/") for n in a) and "model/transformer.wte.weight" in a
    for name in a:
        assert a[name].dtype == np.float64 and np.array_equal(a[name], b[name]), name
    meta = json.loads(h5py.File(split / "checkpoints" / "step-0000004" / INDEX, "r").attrs["meta"])
    assert meta["step"] == 4 and meta["optimizer_step"] == 4 and meta["data_position"]["next_step"] == 4
    if "async" in case:  # every=1: the step-1 save ran in the background and was committed
        assert (split / "checkpoints" / "step-0000001").is_dir()
        assert verify(str(split / "checkpoints" / "step-0000001")) == []
