"""`hpcpar ckpt info|verify|export` on a checkpoint written by a real `hpcpar train` job.

One tiny float64 run under `mpiexec -n 4` (tp=2 x pp=2, so tensors are split over tp and the
tied embedding lives on two stages) makes the checkpoint; the CLI then runs as one process.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import h5py
import numpy as np
import pytest

from hpcpar.checkpoint.format import INDEX

REPO = pathlib.Path(__file__).resolve().parents[2]
_RUN: dict = {}  # the one training run, shared by the tests of this module


def hpcpar(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "hpcpar", *args], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=60)


@pytest.fixture
def run_dir(mpirun, tmp_path_factory):
    """A finished 3-step run with its checkpoint in <run_dir>/checkpoints/step-0000003."""
    if "dir" in _RUN:
        return _RUN["dir"]
    base = tmp_path_factory.mktemp("ckpt-cli")
    corpus = base / "text.txt"
    corpus.write_bytes(np.random.default_rng(1).integers(32, 127, size=20_000, dtype=np.uint8).tobytes())
    overrides = ["model.n_layer=2", "model.n_embd=32", "model.n_head=2", "model.block_size=16",
                 "model.dtype=float64", "mesh.dp=1", "mesh.tp=2", "mesh.pp=2", "train.steps=3",
                 "train.warmup=1", "train.micro_batch_size=2", "run.progress=false", "run.eval_every=0",
                 f"data.corpus={corpus}", f"run.dir={base / 'run'}"]
    args = [sys.executable, "-m", "hpcpar", "train"] + [a for kv in overrides for a in ("--set", kv)]
    job = mpirun(4, args, timeout=120)
    assert not job.timed_out and job.returncode == 0, job.output[-4000:]
    _RUN["dir"] = base / "run"
    return _RUN["dir"]


@pytest.fixture
def ckpt(run_dir, tmp_path):
    """A private copy of the run's checkpoint directory (tests may damage it)."""
    shutil.copytree(run_dir / "checkpoints", tmp_path / "checkpoints")
    return tmp_path / "checkpoints"


def test_info_lists_global_tensors(ckpt):
    out = hpcpar("ckpt", "info", str(ckpt))
    assert out.returncode == 0, out.stderr
    assert "step 3" in out.stdout and "saved by 4 rank(s)" in out.stdout
    assert "model/transformer.wte.weight" in out.stdout and "[256, 32]" in out.stdout
    assert "optim/transformer.h.0.attn.c_attn.weight/exp_avg" in out.stdout
    assert "blocks over dim 0" in out.stdout  # tp-split tensors are stored as blocks


def test_export_equals_index_read_with_h5py(ckpt, tmp_path):
    npz = tmp_path / "all.npz"
    out = hpcpar("ckpt", "export", str(ckpt), "--out", str(npz))
    assert out.returncode == 0, out.stderr
    with h5py.File(ckpt / "step-0000003" / INDEX, "r") as f:
        index = {}
        f.visititems(lambda n, obj: index.__setitem__(n, obj[()]) if isinstance(obj, h5py.Dataset) else None)
    with np.load(npz) as exported:
        assert sorted(exported.files) == sorted(index)
        for name, array in index.items():
            assert exported[name].dtype == array.dtype and np.array_equal(exported[name], array), name
            assert not np.isnan(array).any(), f"{name}: a block is missing from the index"
    assert "lm_head.weight" not in " ".join(index)  # the tied copy is stored once, as wte


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_export_in_16_bits_rounds_the_masters(ckpt, tmp_path, dtype):
    import ml_dtypes  # noqa: F401 - registers bfloat16 with NumPy

    from hpcpar.interop import safetensors
    npz, st = tmp_path / "w16.npz", tmp_path / "w16.safetensors"
    out = hpcpar("ckpt", "export", str(ckpt), "--dtype", dtype, "--out", str(st), "--format", "safetensors")
    assert out.returncode == 0, out.stderr
    out = hpcpar("ckpt", "export", str(ckpt), "--dtype", dtype, "--out", str(npz))
    masters = h5py.File(ckpt / "step-0000003" / INDEX, "r")["model/transformer.h.0.mlp.c_fc.weight"][()]
    if dtype == "bfloat16":  # an .npz cannot record bfloat16: refused in one line
        assert out.returncode == 2 and "needs --format safetensors" in out.stderr and "Traceback" not in out.stderr
    else:
        assert out.returncode == 0, out.stderr
        with np.load(npz) as exported:
            w = exported["model/transformer.h.0.mlp.c_fc.weight"]
            assert w.dtype == np.dtype(dtype) and np.array_equal(w, masters.astype(dtype))
    header, _ = safetensors.read_header(str(st))
    assert header["transformer.h.0.mlp.c_fc.weight"]["dtype"] == {"float16": "F16", "bfloat16": "BF16"}[dtype]
    read = safetensors.read(str(st))["transformer.h.0.mlp.c_fc.weight"]   # GPT-2's Conv1D layout: transposed
    assert np.array_equal(read.astype(np.float32), masters.astype(dtype).astype(np.float32).T)


def test_verify_good_checkpoint(ckpt):
    out = hpcpar("ckpt", "verify", str(ckpt))
    assert out.returncode == 0 and out.stdout.startswith("ok: "), out.stdout + out.stderr


def flip_byte_in_first_chunk(path):
    """Flip one byte inside the data of the file's first dataset that has some (format v2 rank
    files: contiguous, at the dataset's offset)."""
    with h5py.File(path, "r") as f:
        names = []
        f.visititems(lambda n, obj: names.append(n) if isinstance(obj, h5py.Dataset) and obj.size > 1 else None)
        offset = f[names[0]].id.get_offset()
    with open(path, "r+b") as f:
        f.seek(offset + 3)
        byte = f.read(1)
        f.seek(offset + 3)
        f.write(bytes([byte[0] ^ 0x10]))


@pytest.mark.parametrize("damage", ["flipped byte", "truncated", "missing"])
def test_verify_damaged_checkpoint_exits_2_naming_the_file(ckpt, damage):
    rank_file = ckpt / "step-0000003" / "rank-00001.h5"
    if damage == "flipped byte":
        flip_byte_in_first_chunk(rank_file)
    elif damage == "truncated":
        os.truncate(rank_file, os.path.getsize(rank_file) - 100)
    else:
        os.remove(rank_file)
    out = hpcpar("ckpt", "verify", str(ckpt))
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2, out.stdout + out.stderr
    assert len(lines) == 1 and lines[0].startswith("hpcpar: error: ") and "rank-00001.h5" in lines[0], lines
    assert {"flipped byte": "corrupt", "truncated": "truncated", "missing": "missing"}[damage] in lines[0]
