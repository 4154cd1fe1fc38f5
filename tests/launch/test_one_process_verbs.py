"""One-process verbs started under `mpiexec -n 2`: rank 0 alone does the work and prints it once,
the other rank ends with rank 0's status (0, or 2 with the one error line), and the files are
those one process writes."""

from __future__ import annotations

import os
import pathlib
import sys

import numpy as np
import pytest

from hpcpar.checkpoint.directory import latest
from hpcpar.data import prepare

from tiny_run import texts_and_tiny_run

PY = sys.executable


@pytest.fixture(scope="module")
def place(tmp_path_factory) -> pathlib.Path:
    """Three text files in texts/ and a tiny trained run in run/ (one process)."""
    return texts_and_tiny_run(tmp_path_factory.mktemp("one-process-verbs"), files=3, size=3000, seed=0)


def two_ranks(mpirun, *args: str):
    job = mpirun(2, [PY, "-m", "hpcpar", *args], timeout=120)
    assert not job.timed_out, job.output
    assert "Traceback" not in job.output, job.output
    return job


def test_data_prepare_is_done_once_by_rank_0(mpirun, place, tmp_path):
    out = tmp_path / "tok"
    job = two_ranks(mpirun, "data", "prepare", str(place / "texts"), "--out", str(out), "--no-progress")
    assert job.returncode == 0, job.output
    assert job.stdout.count("wrote 9,003 tokens") == 1 and job.stdout.count("train on it with:") == 1, job.output
    assert job.stderr == "", job.output
    alone = tmp_path / "alone"
    prepare.prepare([str(place / "texts")], str(alone), progress=False)
    assert sorted(os.listdir(out)) == sorted(os.listdir(alone))
    assert (out / "tokens.bin").read_bytes() == (alone / "tokens.bin").read_bytes()
    assert (out / "tokenizer.json").read_bytes() == (alone / "tokenizer.json").read_bytes()


def test_ckpt_info_prints_once(mpirun, place):
    job = two_ranks(mpirun, "ckpt", "info", str(place / "run" / "checkpoints"))
    assert job.returncode == 0, job.output
    step = latest(str(place / "run" / "checkpoints"))
    assert job.stdout.count(f"checkpoint {step}\n") == 1, job.output
    assert job.stderr == "", job.output


def test_ckpt_export_writes_and_prints_once(mpirun, place, tmp_path):
    job = two_ranks(mpirun, "ckpt", "export", str(place / "run" / "checkpoints"), "--out", str(tmp_path / "w.npz"))
    assert job.returncode == 0, job.output
    assert job.stdout.count("wrote ") == 1 and job.stdout.count("\n") == 1, job.output
    with np.load(tmp_path / "w.npz") as weights:
        assert "model/transformer.wte.weight" in weights.files


def test_a_user_error_on_rank_0_is_one_line_and_status_2_on_every_rank(mpirun, place):
    job = two_ranks(mpirun, "ckpt", "info", str(place / "nothing"))
    errors = [line for line in job.stderr.splitlines() if line.startswith("hpcpar: error")]
    assert job.returncode == 2, job.output
    assert len(errors) == 1 and errors[0].startswith(f"hpcpar: error: no checkpoint at {place / 'nothing'}"), \
        job.output
    assert job.stdout == "", job.output


def test_plan_prints_once(mpirun):
    job = two_ranks(mpirun, "plan", "--ranks", "4", "--hardware", "a100", "--top", "2")
    assert job.returncode == 0, job.output
    assert job.stdout.count("plans for 4 ranks on a100") == 1, job.output
