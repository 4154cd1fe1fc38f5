"""Fixtures of the cluster suite: a cluster of node namespaces (harness.py), launchers, runs.

Run as root with `python -m pytest -q tests/cluster` (README, Tests). Skipped with a reason where
no cluster can start (not root, no namespaces), and when HPCPAR_CLUSTER_TEST=0. The launchers:
- hydra: this Python's mpi4py must run on MPICH, whose `mpiexec` lies beside the interpreter (the
  `mpich` extra) or on PATH;
- Open MPI: the interpreter HPCPAR_OPENMPI_PYTHON names (a venv whose mpi4py runs on Open MPI,
  `mpirun.openmpi` on PATH); tests that need it skip without it.
Run and checkpoint directories live in `cluster.shared` (every node sees it); each node's /tmp is
its own disk.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

import harness

sys.path.insert(0, str(harness.REPO / "tests" / "launch"))
import processes  # noqa: E402 - tests/launch's: the job runner both suites use
from processes import Job  # noqa: E402

REPO = harness.REPO
PY = sys.executable
OPENMPI_PY = os.environ.get("HPCPAR_OPENMPI_PYTHON", "")

_why = "HPCPAR_CLUSTER_TEST=0" if os.environ.get("HPCPAR_CLUSTER_TEST") == "0" else harness.missing()


def pytest_collection_modifyitems(config, items):
    if _why is not None:
        for item in items:
            item.add_marker(pytest.mark.skip(reason=f"no cluster: {_why}"))


def _mpi_family(python: str) -> str:
    code = "from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])"
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60).stdout
    return "openmpi" if "Open MPI" in out else "mpich" if "MPICH" in out else out.strip() or "none"


def hydra_mpiexec() -> str:
    """The MPICH mpiexec for this interpreter; skips the test when this Python is not on MPICH."""
    if _mpi_family(PY) != "mpich":
        pytest.skip(f"{PY}'s mpi4py does not run on MPICH (hydra tests)")
    beside = pathlib.Path(PY).parent / "mpiexec"
    found = str(beside) if beside.exists() else shutil.which("mpiexec")
    if found is None:
        pytest.skip("no mpiexec found")
    return found


def openmpi_python() -> str:
    """The interpreter of the Open MPI tests; skips the test when there is none."""
    if not OPENMPI_PY:
        pytest.skip("HPCPAR_OPENMPI_PYTHON is not set (a Python whose mpi4py runs on Open MPI)")
    if shutil.which("mpirun.openmpi") is None:
        pytest.skip("mpirun.openmpi not installed (apt-get install openmpi-bin)")
    if _mpi_family(OPENMPI_PY) != "openmpi":
        pytest.skip(f"HPCPAR_OPENMPI_PYTHON={OPENMPI_PY}: its mpi4py does not run on Open MPI")
    return OPENMPI_PY


ENV = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
       "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def run(argv: list[str], timeout: float = 180, env: dict[str, str] | None = None,
        cwd: str | os.PathLike | None = None) -> Job:
    """Run a launcher command line; kill its process group after `timeout` s (a hang: timed_out)."""
    return processes.run(argv, timeout, dict(os.environ, **ENV, **(env or {})), cwd or REPO)


# A tiny float64 GPT: every layout of it gives the single-process model's losses.
TINY = ["model.n_layer=2", "model.n_embd=32", "model.n_head=2", "model.block_size=16", "model.dtype=float64",
        "train.micro_batch_size=2", "train.warmup=0", "train.lr=0.01", "run.progress=false", "run.eval_every=0",
        "run.log_every=1", "train.seed=3"]


def train_args(python: str, run_dir, steps: int, corpus, *extra: str) -> list[str]:
    args = [python, "-m", "hpcpar", "train"]
    for item in [*TINY, f"data.corpus={corpus}", f"train.steps={steps}", f"run.dir={run_dir}", *extra]:
        args += ["--set", item]
    return args


def losses(run_dir) -> dict[int, float]:
    with open(pathlib.Path(run_dir) / "metrics.jsonl") as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


@pytest.fixture(scope="module")
def cluster():
    """Three nodes of two ranks each, unshaped; stopped (and checked clean) after the module."""
    if _why is not None:
        pytest.skip(f"no cluster: {_why}")
    venvs = [os.path.dirname(os.path.dirname(p)) for p in (OPENMPI_PY, os.environ.get("HPCPAR_ULFM_PYTHON", "")) if p]
    c = harness.Cluster(nodes=3, ranks_per_node=2, keep=venvs).up()
    try:
        yield c
    finally:
        c.down()
        mine = f"{harness.PREFIX}-{c.token}-"
        left = [n for n in harness.sh("ip", "netns", "list").stdout.split() if n.startswith(mine)]
        assert not left, f"namespaces left after down(): {left}"


@pytest.fixture(scope="module")
def corpus(cluster) -> pathlib.Path:
    path = cluster.shared / "corpus.txt"
    path.write_bytes(bytes(range(32, 127)) * 300)
    return path
